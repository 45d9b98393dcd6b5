"""Export = what serving engines load: config.json (LlamaForCausalLMEagle3) + model.safetensors.

Written keys (docs/method.md §4.1): fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t, t2d; never the
embedding (engines share the target's). `load_export` also reads public EAGLE-3 drafters: `layers.0.*` instead
of `midlayer.*`, an included embed_tokens.weight, pytorch_model.bin, t2d absent (derived from d2t), d2t absent
when draft_vocab_size == vocab_size (identity). Like vLLM's loader, any other key is an error.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from models.config import Eagle3Config
from models.eagle3 import Eagle3Drafter
from models.target_head import EMBED_KEY

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def export_keys(cfg: Eagle3Config | None = None) -> list[str]:
    """The exact tensor names save_export writes (+ vLLM's `fc_norm.{i}.weight` for the fc_norm variant)."""
    layer = [f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"]
    layer += [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    layer += [f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    fc_norm = [f"fc_norm.{i}.weight" for i in range(cfg.n_taps)] if cfg is not None and cfg.fc_norm else []
    return [*fc_norm, "fc.weight", *layer, "norm.weight", "lm_head.weight", "d2t", "t2d"]


def write_export(
    state: dict[str, Tensor], keys: list[str], config: dict, out_dir: str | Path, dtype: torch.dtype
) -> Path:
    """config.json (+ torch_dtype) and model.safetensors with exactly `keys` of `state`, floats as `dtype`:
    the one way every drafter family writes its export."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Tensor] = {}
    for key in keys:
        t = state[key].detach()
        tensors[key] = (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu()
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def save_export(drafter: Eagle3Drafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    return write_export(drafter.state_dict(), export_keys(drafter.cfg), drafter.cfg.to_hf_dict(), out_dir, dtype)


def check_keys(tensors: dict[str, Tensor], expected: list[str], what: str) -> None:
    """Like vLLM's loader: a tensor the layout does not name, or a missing one, is an error."""
    unknown, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise ValueError(f"not {what}: unknown keys {unknown}, missing keys {missing}")


def read_weights(d: Path) -> dict[str, Tensor]:
    """model.safetensors, or the pytorch_model.bin that several public drafters ship."""
    if (d / WEIGHTS_FILE).exists():
        return load_file(str(d / WEIGHTS_FILE))
    if (d / "pytorch_model.bin").exists():  # several public EAGLE-3 drafters ship this
        return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{d} has neither {WEIGHTS_FILE} nor pytorch_model.bin")


def normalize_keys(tensors: dict[str, Tensor], cfg: Eagle3Config) -> dict[str, Tensor]:
    """Public layouts -> our parameter names; fills d2t/t2d where they may be derived; errors on the rest."""
    t = {(f"midlayer.{k[len('layers.0.'):]}" if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    if "d2t" not in t:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"no d2t but draft_vocab_size ({cfg.draft_vocab_size}) != vocab_size "
                             f"({cfg.vocab_size}): the draft->target mapping is lost")
        t["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in t:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + t["d2t"].long()] = True
        t["t2d"] = t2d
    check_keys({k: v for k, v in t.items() if k != EMBED_KEY}, export_keys(cfg),
               "an EAGLE-3 LlamaForCausalLMEagle3 checkpoint")
    return t


def load_export(
    export_dir: str | Path,
    embed_weight: Tensor | None = None,
    target_num_layers: int | None = None,
    attn_backend: str = "auto",
    dtype: torch.dtype = torch.float32,
    target_weights: dict[str, Tensor] | None = None,
) -> Eagle3Drafter:
    """embed_weight (or target_weights["embed_tokens.weight"]): the target's [V, H] embedding (wins over one
    stored in the checkpoint). target_num_layers: needed only for configs without
    eagle_aux_hidden_state_layer_ids. Other target_weights (the target's LM head) are not used by EAGLE-3."""
    if embed_weight is None and target_weights is not None:
        embed_weight = target_weights.get(EMBED_KEY)
    from models.registry import family_of_export

    d = Path(export_dir)
    raw = json.loads((d / CONFIG_FILE).read_text())
    cfg = Eagle3Config.from_hf_dict(raw, target_num_layers=target_num_layers)
    if family_of_export(raw).method != "eagle3":
        raise ValueError(f"{d / CONFIG_FILE}: architectures {raw.get('architectures')} is not an EAGLE-3 export")
    tensors = normalize_keys(read_weights(d), cfg)
    drafter = Eagle3Drafter(cfg, attn_backend=attn_backend).to(dtype)
    stored_embed = tensors.pop(EMBED_KEY, None)
    state = drafter.state_dict()
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(state[key].shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != config shape {tuple(state[key].shape)}")
    drafter.load_state_dict({**state, **tensors}, strict=True)  # load_state_dict casts to the drafter's dtype
    embed = embed_weight if embed_weight is not None else stored_embed
    if embed is not None:
        drafter.load_target_embedding(embed.to(dtype))
    else:
        warnings.warn("no target embedding given or stored: embed_tokens stays random until "
                      "load_target_embedding()", stacklevel=2)
    drafter.set_vocab_mapping(drafter.d2t.clone(), drafter.t2d.clone())  # re-check the loaded mapping
    return drafter
