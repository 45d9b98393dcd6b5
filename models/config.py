"""What every drafter family's config takes from the target: its geometry and RoPE (`target_geometry`,
`rope_from_hf`), the checks every family's config runs on them (`check_geometry`, `check_layer_ids`), the
length a drafter is exported for (`for_trained_length`), and the pre-flight check prep runs
(`check_trainable_target`: those same checks, on the target's config). Each family's own config lives with its
model (models/eagle3.py, eagle1.py, dflash.py), which builds on this module; this module imports no family.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any, TypeVar

from infra.config_keys import ConfigError
from models.rope import SUPPORTED_ROPE_TYPES

FULL_ATTENTION = "full_attention"  # the layer type whose rotary settings a drafter takes (rope_from_hf)


def rope_from_hf(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers 4 (rope_theta + rope_scaling) or transformers 5
    (rope_parameters, which also carries rope_theta) config dict.

    Targets with per-layer-type settings (transformers 5's rope_parameters keyed by layer type: Gemma-3's
    sliding layers rotate with a local base, its full-attention layers with the global base and the
    long-context scaling) give the drafter the FULL-attention layers' settings: the drafter attends over the
    whole context, as those layers do. (transformers 4 configs of such targets already keep the full-attention
    settings in rope_theta / rope_scaling, the local base in a key of its own.)"""
    params = dict(hf.get("rope_parameters") or {})
    legacy = dict(hf.get("rope_scaling") or {})
    if params and any(isinstance(v, dict) for v in params.values()):
        if not isinstance(params.get(FULL_ATTENTION), dict):
            raise ValueError(f"per-layer-type rope_parameters without {FULL_ATTENTION!r} settings (layer types "
                             f"{sorted(params)}): the drafter takes the full-attention layers' rotation")
        params = dict(params[FULL_ATTENTION])
    theta = params.pop("rope_theta", None) or legacy.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0
    scaling = {**params, **legacy}
    rope_type = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in scaling:
        # transformers falls back to max_position_embeddings too
        scaling["original_max_position_embeddings"] = hf.get("original_max_position_embeddings") or hf.get(
            "max_position_embeddings"
        )
    if float(scaling.pop("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported by the Llama-layout drafter")
    return float(theta), (None if rope_type == "default" else scaling)


def pinned_rope_scaling(scaling: dict[str, Any] | None, target_max_pos: int) -> dict[str, Any] | None:
    """`scaling` with what it derives from max_position_embeddings made explicit: YaRN without a `factor`
    uses max_position_embeddings / original_max_position_embeddings (transformers, models/rope.py), which
    would follow the drafter's own max_position_embeddings instead of the target's. (`rope_from_hf` already
    pins original_max_position_embeddings, llama3's and yarn's, to the target's.)"""
    if not scaling or scaling.get("rope_type") != "yarn" or scaling.get("factor"):
        return scaling
    return {**scaling, "factor": target_max_pos / scaling["original_max_position_embeddings"]}


DrafterConfig = TypeVar("DrafterConfig")


def for_trained_length(cfg: DrafterConfig, trained_len: int, max_position_embeddings: int | None = None
                       ) -> DrafterConfig:
    """A drafter config built from the target's (any family: rope_scaling + max_position_embeddings fields)
    as training exports it: max_position_embeddings at least the trained length (engines size their RoPE
    caches by it; `max_position_embeddings` overrides), and the target's rope scaling pinned
    (`pinned_rope_scaling`) so that the larger value cannot change the rotation."""
    target_max = cfg.max_position_embeddings  # type: ignore[attr-defined]
    max_pos = max_position_embeddings or max(trained_len, target_max)
    return dataclasses.replace(cfg, max_position_embeddings=max_pos,  # type: ignore[type-var]
                               rope_scaling=pinned_rope_scaling(cfg.rope_scaling, target_max))  # type: ignore[attr-defined]


def layer_geometry(cfg: Any, num_hidden_layers: int) -> dict[str, Any]:
    """The Llama-style geometry keys of a drafter's config.json, in the order every family writes them."""
    return {
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": num_hidden_layers,
        "hidden_act": getattr(cfg, "hidden_act", "silu"),
        "rms_norm_eps": cfg.rms_norm_eps,
    }


def rope_keys(cfg: Any) -> dict[str, Any]:
    """A drafter config's rotation in config.json, both spellings: transformers 4 reads rope_theta /
    rope_scaling, 5 also rope_parameters."""
    return {
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rope_parameters": {"rope_type": "default", **(cfg.rope_scaling or {}), "rope_theta": cfg.rope_theta},
    }


def target_geometry(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The target's decoder geometry and rope from its HF config dict, as the keyword arguments a drafter
    config of the same width takes (head_dim None = hidden_size // num_attention_heads)."""
    hf = hf_config
    if "hidden_size" not in hf and isinstance(hf.get("text_config"), dict):
        hf = hf["text_config"]  # multimodal wrappers keep the language model's geometry here
    missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                           "vocab_size") if k not in hf]
    if missing:
        raise ValueError(f"target config lacks {missing}")
    theta, scaling = rope_from_hf(hf)
    return {
        "hidden_size": int(hf["hidden_size"]),
        "num_attention_heads": int(hf["num_attention_heads"]),
        "num_key_value_heads": int(hf.get("num_key_value_heads") or hf["num_attention_heads"]),
        "head_dim": hf.get("head_dim") or None,
        "intermediate_size": int(hf["intermediate_size"]),
        "vocab_size": int(hf["vocab_size"]),
        "target_num_layers": int(hf["num_hidden_layers"]),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
    }


GEOMETRY_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size",
                   "head_dim", "max_position_embeddings")


def check_geometry(cfg: Any, what: str, positive: tuple[str, ...] = ()) -> None:
    """Raise ConfigError(f"{what}: ...") where a drafter config's Llama-block geometry (the fields
    `target_geometry` gives every family, head_dim resolved; plus the family's own `positive` int fields) cannot
    be built: what every family's `validate` and prep's `check_trainable_target` check, once."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{what}: {msg}")

    for name in (*GEOMETRY_FIELDS, *positive):
        value = getattr(cfg, name)
        need(isinstance(value, int) and value > 0, f"{name} must be a positive int, got {value!r}")
    need(cfg.num_attention_heads % cfg.num_key_value_heads == 0,
         f"num_attention_heads ({cfg.num_attention_heads}) must be a multiple of num_key_value_heads "
         f"({cfg.num_key_value_heads})")
    need(cfg.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {cfg.head_dim}")
    hidden_act = getattr(cfg, "hidden_act", "silu")
    need(hidden_act == "silu", f"only hidden_act='silu' (SwiGLU) is implemented, got {hidden_act!r}")
    need(cfg.rms_norm_eps > 0, "rms_norm_eps must be > 0")
    if cfg.rope_scaling is not None:
        rope_type = cfg.rope_scaling.get("rope_type")
        need(rope_type in SUPPORTED_ROPE_TYPES, f"rope_type {rope_type!r} not in {SUPPORTED_ROPE_TYPES}")


def check_layer_ids(ids: list[int], num_layers: int | None, what: str, name: str) -> None:
    """Raise ConfigError(f"{what}: ...") unless `ids` (called `name`) are distinct 0-based decoder layer ids of a
    `num_layers`-layer target (None: range unchecked)."""
    def need(ok: bool, msg: str) -> None:
        if not ok:
            raise ConfigError(f"{what}: {msg}")

    need(len(ids) > 0, f"{name} is empty")
    need(len(set(ids)) == len(ids), f"duplicate {name} {ids}")
    need(min(ids) >= 0, f"{name} are 0-based and must be >= 0: {ids}")
    if num_layers is not None:
        need(max(ids) < num_layers, f"{name} {ids} out of range for a {num_layers}-layer target")


def check_trainable_target(hf_config: dict[str, Any], tap_layers: list[int]) -> None:
    """Raise what training will raise when it builds a drafter (any family) for this target reading
    `tap_layers`: its geometry and RoPE layout (`target_geometry`, `check_geometry`) and the tap ids
    (`check_layer_ids`), by the code every family's config validates with. Prep calls it before the target's
    weights load, so it never makes a prep that training refuses."""
    geometry = target_geometry(hf_config)
    head_dim = geometry["head_dim"] or geometry["hidden_size"] // geometry["num_attention_heads"]
    check_geometry(SimpleNamespace(**{**geometry, "head_dim": head_dim}), "target")
    check_layer_ids(list(tap_layers), geometry["target_num_layers"], "target", "tap_layers")
