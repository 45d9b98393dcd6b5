"""Eagle3Config: the drafter's geometry, built from the target's HF config and written as the engines' config.json.

Layer-id conventions (docs/method.md §4.1, §8) - the one place they are converted:
- `aux_layer_ids` here are 0-based decoder layer ids: the tap is the hidden state AFTER layer i (the same ids
  as the shard manifest's `tap_layers`).
- `eagle_config.eagle_aux_hidden_state_layer_ids` in config.json is in HF `output_hidden_states` indexing
  (entry 0 = embedding output), i.e. 0-based id + 1: vLLM records the input of layer j, which is the output
  of layer j - 1. Engines default to (2, L//2, L-3) there, the same layers as our [1, L//2-1, L-4].
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, TypeVar

from models.rope import SUPPORTED_ROPE_TYPES

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Other names public EAGLE-3 checkpoints use for the same layout.
ARCHITECTURE_ALIASES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")
# eagle_config switches of vLLM's loader that change the forward; only their default (off) is implemented.
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc")
FULL_ATTENTION = "full_attention"  # the layer type whose rotary settings a drafter takes (rope_from_hf)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """0-based taps [1, L//2 - 1, L - 4] (= HF hidden_states entries [2, L//2, L - 3])."""
    if num_layers < 5:
        raise ValueError(f"default EAGLE-3 taps need a target with >= 5 layers, got {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


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
        "num_target_layers": int(hf["num_hidden_layers"]),
        "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
    }


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # target vocabulary V (embed_tokens rows, t2d length)
    draft_vocab_size: int  # Vd (lm_head rows, d2t length)
    aux_layer_ids: list[int]  # 0-based target layers tapped, in concat order
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    target_hidden_size: int | None = None  # None -> hidden_size; fc input = n_taps * target_hidden_size
    target_num_layers: int | None = None  # only used to validate aux_layer_ids
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None = plain RoPE; else has "rope_type"
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # dtype recorded in the exported config.json
    # The "EAGLE-3.1" variant (vLLM's keys): an RMSNorm on each tap before fc, and the NORMED hidden state
    # (instead of the un-normed one) fed to the next draft step.
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.aux_layer_ids = [int(i) for i in self.aux_layer_ids]

    @property
    def n_taps(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def fc_in_features(self) -> int:
        assert self.target_hidden_size is not None
        return self.n_taps * self.target_hidden_size

    def validate(self) -> Eagle3Config:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"Eagle3Config: {msg}")

        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                     "vocab_size", "draft_vocab_size", "head_dim", "target_hidden_size",
                     "max_position_embeddings"):
            value = getattr(self, name)
            need(isinstance(value, int) and value > 0, f"{name} must be a positive int, got {value!r}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
             f"({self.num_key_value_heads})")
        need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        need(self.draft_vocab_size <= self.vocab_size,
             f"draft_vocab_size ({self.draft_vocab_size}) > vocab_size ({self.vocab_size})")
        need(len(self.aux_layer_ids) > 0, "aux_layer_ids is empty")
        need(len(set(self.aux_layer_ids)) == len(self.aux_layer_ids), f"duplicate aux_layer_ids {self.aux_layer_ids}")
        need(min(self.aux_layer_ids) >= 0, f"aux_layer_ids are 0-based and must be >= 0: {self.aux_layer_ids}")
        if self.target_num_layers is not None:
            need(max(self.aux_layer_ids) < self.target_num_layers,
                 f"aux_layer_ids {self.aux_layer_ids} out of range for a {self.target_num_layers}-layer target")
        need(self.hidden_act == "silu", f"only hidden_act='silu' (SwiGLU) is implemented, got {self.hidden_act!r}")
        need(self.rms_norm_eps > 0, "rms_norm_eps must be > 0")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            need(rope_type in SUPPORTED_ROPE_TYPES, f"rope_type {rope_type!r} not in {SUPPORTED_ROPE_TYPES}")
        if self.n_taps != 3:
            warnings.warn(f"{self.n_taps} taps: vLLM and SGLang build fc with 3 * target_hidden_size inputs, "
                          "so this drafter will only load in this project", stacklevel=2)
        return self

    # ------------------------------------------------------------------ construction from the target
    @classmethod
    def from_target_config(
        cls,
        hf_config: dict[str, Any],
        draft_vocab_size: int,
        aux_layer_ids: list[int] | None = None,
        **overrides: Any,
    ) -> Eagle3Config:
        """Drafter geometry = the target's (a one-layer Llama block of the same width); `overrides` replace
        any field (e.g. intermediate_size=...)."""
        geometry = target_geometry(hf_config)
        num_layers = geometry.pop("num_target_layers")
        cfg = cls(
            **geometry,
            draft_vocab_size=int(draft_vocab_size),
            aux_layer_ids=list(aux_layer_ids) if aux_layer_ids is not None else default_aux_layer_ids(num_layers),
            target_hidden_size=geometry["hidden_size"],
            target_num_layers=num_layers,
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown Eagle3Config overrides: {sorted(unknown)}")
        return dataclasses.replace(cfg, **overrides).validate()

    # ------------------------------------------------------------------ engine config.json
    def to_hf_dict(self) -> dict[str, Any]:
        rope_params = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        eagle_config: dict[str, Any] = {
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.aux_layer_ids],  # HF hidden_states index
            "use_aux_hidden_state": True,
        }
        if self.target_num_layers is not None:
            eagle_config["target_num_hidden_layers"] = self.target_num_layers  # ours; engines ignore it
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            # Both spellings: transformers 4 reads rope_theta/rope_scaling, 5 also rope_parameters.
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": rope_params,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "eagle_config": eagle_config,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "torch_dtype": self.torch_dtype,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], target_num_layers: int | None = None) -> Eagle3Config:
        """Read an exported (ours or a public drafter's) LlamaForCausalLMEagle3 config.json."""
        arch = (d.get("architectures") or [None])[0]
        if arch not in ARCHITECTURE_ALIASES:
            raise ValueError(f"architectures[0] is {arch!r}; expected one of {ARCHITECTURE_ALIASES}")
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"only one-layer EAGLE-3 drafters are supported, got {d['num_hidden_layers']} layers")
        eagle = dict(d.get("eagle_config") or {})
        on = [k for k in _UNSUPPORTED_FLAGS if d.get(k) or eagle.get(k)]
        if on or eagle.get("use_aux_hidden_state") is False:
            raise ValueError(f"drafter variant not supported: {on or ['use_aux_hidden_state=false']}")
        target_num_layers = target_num_layers or eagle.get("target_num_hidden_layers")
        hf_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if hf_ids is not None:
            aux = [int(i) - 1 for i in hf_ids]
        elif target_num_layers is not None:
            aux = default_aux_layer_ids(int(target_num_layers))
        else:
            raise ValueError("config.json has no eagle_config.eagle_aux_hidden_state_layer_ids: pass "
                             "target_num_layers (the target's decoder layer count) to derive the engines' default")
        theta, scaling = rope_from_hf(d)
        hidden = int(d["hidden_size"])
        return cls(
            hidden_size=hidden,
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            head_dim=d.get("head_dim") or None,
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            aux_layer_ids=aux,
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            target_num_layers=int(target_num_layers) if target_num_layers is not None else None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            hidden_act=str(d.get("hidden_act", "silu")),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)),
        ).validate()


def check_target(hf_config: dict[str, Any], tap_layers: list[int]) -> None:
    """Raise what training will raise when it builds a drafter for this target reading `tap_layers`: its
    geometry and RoPE layout (`target_geometry`) and the tap ids (`Eagle3Config.validate`), by the same code.
    Prep calls it before the target's weights load, so it never makes a prep that training refuses."""
    geometry = target_geometry(hf_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the engines' 3-tap warning concerns an export, not a prep's taps
        Eagle3Config.from_target_config(hf_config, draft_vocab_size=geometry["vocab_size"],
                                        aux_layer_ids=list(tap_layers))
