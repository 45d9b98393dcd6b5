"""The export writer and reader every drafter family shares: config.json + model.safetensors, the file names
defined here once. Each family's own layout (its keys, its config.json) lives with its model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


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


def load_tensors(drafter: nn.Module, tensors: dict[str, Tensor]) -> None:
    """An export's tensors into the drafter built from its config (cast to the drafter's dtype; what they do
    not name stays as it is): a shape the config does not give is an error naming the key."""
    state = drafter.state_dict()
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(state[key].shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != config shape {tuple(state[key].shape)}")
    drafter.load_state_dict({**state, **tensors}, strict=True)
