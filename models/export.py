"""The export writer and reader every drafter family shares: config.json + model.safetensors, the file names
defined here once. Each family's own layout (its keys, its config.json) lives with its model.

Two checks every loader gets here: a weight that is not finite (NaN, ±Inf: a diverged run, a damaged or edited
file) is refused naming the tensor, before anything decodes with it; and the target a drafter was trained for
(`TARGET_KEY` in config.json: architecture, layer count, hidden and vocabulary size, tokenizer hash, and the
drafter's own tap layers) is compared with the target it is used with (`check_target`). vLLM and SGLang read
config.json into a transformers config, where an unknown key is one more attribute, unused.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from infra.files import save_safetensors

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TARGET_KEY = "drafters_target"  # config.json: the target the drafter was trained for (a dict, `target_fingerprint`)
# What must agree between that record and a target (`id`, where recorded, only names it: a local copy is the same).
FINGERPRINT = ("architecture", "num_layers", "hidden_size", "vocab_size", "tokenizer_hash")


class ExportError(ValueError):
    """An export that must not be used: non-finite weights, or a drafter for another target than the given one."""


def target_fingerprint(target: dict, tokenizer_hash: str, tap_layers: list[int] | None = None) -> dict:
    """The record of a target (a prep's ShardSpec.target: id, architecture, num_layers, hidden_size, vocab_size)
    with its tokenizer's hash and the drafter's tap layers (0-based), as an export's config.json keeps it."""
    out = {k: target.get(k) for k in ("id", "architecture", "num_layers", "hidden_size", "vocab_size")}
    out["tokenizer_hash"] = tokenizer_hash
    if tap_layers is not None:
        out["tap_layers"] = [int(i) for i in tap_layers]
    return out


def _describe(fp: dict) -> str:
    shape = ", ".join(f"{k} {fp.get(k)}" for k in FINGERPRINT if fp.get(k) is not None)
    return f"{fp.get('id') or fp.get('architecture') or 'a target'} ({shape})"


def check_target(recorded: dict | None, actual: dict, drafter: str, target: str) -> None:
    """ExportError naming both when the target a drafter was trained for (`recorded`, its config.json's
    TARGET_KEY; None: an export without one, nothing to compare) is not `actual`; a field unknown on either side
    is not compared. The tap layers must also be in range for `actual`'s layer count."""
    if recorded is not None:
        differ = [k for k in FINGERPRINT if None not in (recorded.get(k), actual.get(k)) and recorded[k] != actual[k]]
        if differ:
            raise ExportError(f"{drafter} was trained for {_describe(recorded)}, not for {target}: "
                              f"{_describe(actual)}; they differ in {', '.join(differ)}")
    taps, layers = (recorded or {}).get("tap_layers"), actual.get("num_layers")
    # -1: the top layer's feature after the final norm (EAGLE-1's tap, eval.target.FINAL_FEATURE)
    if taps and layers is not None and not all(int(i) == -1 or 0 <= int(i) < int(layers) for i in taps):
        raise ExportError(f"{drafter}: tap layers {taps} out of range for {target}, a {layers}-layer target")


def other_target_id(recorded: dict | None, names: list[str]) -> str | None:
    """The id an export records (`TARGET_KEY` `id`: a prep's hub id of its target) where it names another model than
    every one of `names` (hub ids, or a preset's name; case aside); None where it names one of them, records none,
    or either side is a local directory: a copy of any model, compared by shape and tokenizer (`check_target`),
    not by its name. The same shape and tokenizer do not make the same model (a base model and its instruct tune),
    and the drafter has only seen its own target's hidden states."""
    rid = (recorded or {}).get("id")
    names = [n for n in names if isinstance(n, str) and n]
    if not isinstance(rid, str) or not rid or not names or any(_local(x) for x in (rid, *names)):
        return None
    return None if rid.lower() in {n.lower() for n in names} else rid


def _local(ref: str) -> bool:
    return ref.startswith(("/", ".", "~")) or Path(ref).expanduser().is_dir()


def stamp_target(out_dir: str | Path, fingerprint: dict) -> None:
    """Record the drafter's target in an export's config.json (written to a temporary name and renamed)."""
    path = Path(out_dir) / CONFIG_FILE
    config = {**json.loads(path.read_text()), TARGET_KEY: fingerprint}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, path)


def check_tap_layers(recorded: dict | None, tap_layers: list[int], drafter: str) -> None:
    """ExportError when the layer ids of an export's config.json are not the ones it was trained with (an edit)."""
    taps = (recorded or {}).get("tap_layers")
    if taps is not None and [int(i) for i in taps] != [int(i) for i in tap_layers]:
        raise ExportError(f"{drafter}: config.json's layer ids give tap layers {list(tap_layers)}, but the drafter "
                          f"was trained on tap layers {taps} ({TARGET_KEY}): an edited config.json")


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
    save_safetensors(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def check_keys(tensors: dict[str, Tensor], expected: list[str], what: str) -> None:
    """Like vLLM's loader: a tensor the layout does not name, or a missing one, is an error."""
    unknown, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise ValueError(f"not {what}: unknown keys {unknown}, missing keys {missing}")


def read_weights(d: Path) -> dict[str, Tensor]:
    """model.safetensors, or the pytorch_model.bin that several public drafters ship; every floating-point
    tensor checked finite (`check_finite`)."""
    if (d / WEIGHTS_FILE).exists():
        path = d / WEIGHTS_FILE
        tensors = load_file(str(path))
    elif (d / "pytorch_model.bin").exists():  # several public EAGLE-3 drafters ship this
        path = d / "pytorch_model.bin"
        tensors = torch.load(path, map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{d} has neither {WEIGHTS_FILE} nor pytorch_model.bin")
    check_finite(tensors, path)
    return tensors


def check_finite(tensors: dict[str, Tensor], path: Path) -> None:
    """ExportError naming the first tensor (in name order) holding a NaN or an infinity, how many, and where the
    first is: decoding with it gives garbage drafts, which speculative decoding rejects silently (τ 1.0)."""
    for key in sorted(tensors):
        t = tensors[key]
        if not t.is_floating_point():
            continue
        bad = ~torch.isfinite(t)
        if bad.any():
            kinds = [f"{int(n)} {what}" for what, n in (("NaN", t.isnan().sum()), ("+Inf", (t == float("inf")).sum()),
                                                        ("-Inf", (t == float("-inf")).sum())) if n]
            first = [int(i) for i in bad.nonzero()[0]]
            raise ExportError(f"{path}: tensor {key} {tuple(t.shape)} holds {', '.join(kinds)} (the first at index "
                              f"{first}): a broken export (a diverged run or a damaged file), refused")


def load_tensors(drafter: nn.Module, tensors: dict[str, Tensor]) -> None:
    """An export's tensors into the drafter built from its config (cast to the drafter's dtype; what they do
    not name stays as it is): a shape the config does not give is an error naming the key."""
    state = drafter.state_dict()
    for key, value in tensors.items():
        if tuple(value.shape) != tuple(state[key].shape):
            raise ValueError(f"{key}: checkpoint shape {tuple(value.shape)} != config shape {tuple(state[key].shape)}")
    drafter.load_state_dict({**state, **tensors}, strict=True)


def read_export(export_dir: str) -> dict:
    """An export's config.json: FileNotFoundError without one, ExportError naming it when it is not a JSON object
    (a damaged or hand-edited file) or records its target as something else than an object."""
    path = Path(export_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"drafter {export_dir}: no {CONFIG_FILE} (an export dir holds {CONFIG_FILE} and "
                                f"{WEIGHTS_FILE}: launch/export.py writes one from a checkpoint)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # not UTF-8, not JSON
        raise ExportError(f"{path}: not valid JSON ({e}): a damaged export, refused") from None
    if not isinstance(raw, dict) or not isinstance(raw.get(TARGET_KEY) or {}, dict):
        raise ExportError(f"{path}: a drafter's config.json is a JSON object whose {TARGET_KEY!r} is one too: a "
                          "damaged export, refused")
    return raw


def _weights_file(export_dir: str) -> Path:
    d = Path(export_dir)
    return d / WEIGHTS_FILE if (d / WEIGHTS_FILE).exists() or not (d / "pytorch_model.bin").exists() else (
        d / "pytorch_model.bin")


@contextmanager
def unreadable_weights(export_dir: str) -> Iterator[None]:
    """A weights file that cannot be read (truncated, not a safetensors or torch file: safetensors' header check,
    torch's unpickler or zip reader) stops as an ExportError naming it, rather than as the reader's traceback."""
    from safetensors import SafetensorError

    try:
        yield
    except (SafetensorError, pickle.UnpicklingError, EOFError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "PytorchStreamReader" not in str(e):
            raise  # not the zip reader's: not a damaged file
        raise ExportError(f"{_weights_file(export_dir)}: cannot be read ({str(e).splitlines()[0]}): a damaged or "
                          "partly copied export, refused") from None
