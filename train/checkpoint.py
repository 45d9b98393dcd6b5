"""Portable training checkpoints: resume at any world size and ZeRO stage.

    <run_dir>/checkpoints/
        latest                      # text: the newest complete checkpoint's directory name
        step_000100/
            model.safetensors       # full fp32 trainable parameters + buffers (d2t, t2d) [+ rollout drafter]
            optimizer.safetensors   # full Adam moments: exp_avg/<param>, exp_avg_sq/<param>
            state.json              # step, Adam step, scheduler, data cursor (global), run metadata
            rng.pt                  # torch / cuda / python / numpy RNG state (rank 0's)
            drafter_config.json     # the drafter's config, so an export needs nothing else

Rank 0 writes everything into a temp directory and renames it into place, then replaces `latest`:
a crash leaves either the previous checkpoint or the new one, never a torn one. The frozen target
embedding is not stored (it comes from the prep dir's target_head.safetensors).

`latest` is the only way to "the newest checkpoint": it resolves to exactly the directory it names (a bare
step_* name beside it; `..`, a path or a missing directory is an error), never to whichever step_* sorts last.
Rotation keeps the checkpoint just written and the newest others by step number.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file
from torch import Tensor

from data_prep.shards import writing
from infra.files import save_safetensors
from infra.strict_json import dumps

LATEST = "latest"
STEP_DIR = re.compile(r"step_(\d+)")  # step_dir_name's form
CHECKPOINT_WEIGHTS = "model.safetensors"  # params/ and buffers/ of the drafter, by name
DRAFTER_CONFIG = "drafter_config.json"  # the drafter's config, so an export needs nothing else


@dataclass
class Checkpoint:
    path: Path
    params: dict[str, Tensor]
    buffers: dict[str, Tensor]
    moments: dict[str, dict[str, Tensor]]
    state: dict  # state.json
    rng: dict | None  # None when loaded without the optimizer state (an export)
    drafter_config: dict
    # Other tensors of model.safetensors, by their full name (the on-policy stage's rollout drafter: "rollout/...")
    extra: dict[str, Tensor] = field(default_factory=dict)

    def engine_state(self) -> dict:
        """The shape Engine.prepare(state=...) expects."""
        return {
            "params": self.params,
            **self.moments,
            "adam_step": self.state["adam_step"],
            "scheduler": self.state["scheduler"],
        }


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rng_state() -> dict:
    state = {
        "torch": torch.get_rng_state(),
        "python": list(_tuple_to_lists(random.getstate())),
        "numpy": _numpy_state_to_list(np.random.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_lists_to_tuple(state["python"]))
    np.random.set_state(_list_to_numpy_state(state["numpy"]))
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def save(
    root: Path,
    step: int,
    engine_state: dict,
    buffers: dict[str, Tensor],
    meta: dict,
    drafter_config: dict,
    keep: int,
    extra: dict[str, Tensor] | None = None,
) -> Path:
    """Rank 0 only: write checkpoint `step` atomically, point `latest` at it, drop old ones. `extra`: more tensors
    for model.safetensors, by full names outside param/ and buffer/ (Checkpoint.extra)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with writing(tmp):  # a full disk's error names no file
        model = {f"param/{k}": v.contiguous() for k, v in engine_state["params"].items()}
        model.update({f"buffer/{k}": v.contiguous() for k, v in buffers.items()})
        for k, v in (extra or {}).items():
            if k.startswith(("param/", "buffer/")):
                raise ValueError(f"checkpoint extra tensor {k!r}: param/ and buffer/ are the drafter's")
            model[k] = v.contiguous()
        save_safetensors(model, tmp / CHECKPOINT_WEIGHTS)
        moments = {
            f"{key}/{k}": v.contiguous()
            for key in ("exp_avg", "exp_avg_sq")
            for k, v in engine_state[key].items()
        }
        save_safetensors(moments, tmp / "optimizer.safetensors")
        state = {
            "step": step,
            "adam_step": engine_state["adam_step"],
            "scheduler": engine_state["scheduler"],
            **meta,
        }
        (tmp / "state.json").write_text(dumps(state, indent=1, default=_json_default))
        (tmp / DRAFTER_CONFIG).write_text(dumps(drafter_config, indent=1))
        torch.save(rng_state(), tmp / "rng.pt")
    if final.exists():  # a rerun of the same step (e.g. resumed and re-saved): replace it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _write_latest(root, final.name)
    _rotate(root, keep, final)
    return final


class CheckpointError(FileNotFoundError):
    """A checkpoint path or `latest` pointer that names no complete checkpoint."""


def latest(root: Path) -> Path | None:
    """The checkpoint `root/latest` names (root: a checkpoints/ dir); None when there is no pointer and no step_*
    dir (nothing saved yet). Raises CheckpointError for a pointer that names anything but a complete step_* dir
    beside it, and for step_* dirs without a pointer (which of them is this run's newest is then unknown)."""
    pointer = Path(root) / LATEST
    if pointer.is_file():
        return follow(pointer)
    steps = sorted(p.name for p in Path(root).glob("step_*")) if Path(root).is_dir() else []
    if steps:
        raise CheckpointError(f"{root}: {', '.join(steps)} but no `{LATEST}` pointer naming the newest complete "
                              f"checkpoint; pass a checkpoint dir itself, or write its name into {pointer}")
    return None


def follow(pointer: Path) -> Path:
    """The checkpoint dir a `latest` file names: a bare step_* name in the same directory, complete (state.json)."""
    name = pointer.read_text().strip()
    if not STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{pointer}: names {name!r}, not a step_* directory beside it (a path, `..` or an "
                              "absolute name is refused)")
    path = pointer.parent / name
    if not (path / "state.json").is_file():
        raise CheckpointError(f"{pointer}: names {name}, but {path} is missing or incomplete (no state.json)")
    return path


def resolve(path: Path) -> Path:
    """A checkpoint dir itself, a `latest` file (-> what it names), or a checkpoints/ dir or run dir (-> what its
    `latest` names)."""
    path = Path(path)
    if (path / "state.json").is_file():
        return path
    if path.is_file() and path.name == LATEST:
        return follow(path)
    for root in (path, path / "checkpoints"):
        found = latest(root)
        if found is not None:
            return found
    raise CheckpointError(f"{path}: no checkpoint (expected a checkpoint dir with state.json, a `{LATEST}` file, "
                          f"or a run or checkpoints/ dir holding one)")


def load(path: Path, optimizer: bool = True) -> Checkpoint:
    """The checkpoint at `path` (see `resolve`). optimizer=False (an export): the weights, buffers, config and
    state only; optimizer.safetensors and rng.pt are neither read nor needed."""
    path = resolve(path)
    model = load_file(str(path / CHECKPOINT_WEIGHTS))
    moments: dict[str, dict[str, Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for k, v in (load_file(str(path / "optimizer.safetensors")) if optimizer else {}).items():
        key, name = k.split("/", 1)
        moments[key][name] = v
    return Checkpoint(
        path=path,
        params={k.split("/", 1)[1]: v for k, v in model.items() if k.startswith("param/")},
        buffers={k.split("/", 1)[1]: v for k, v in model.items() if k.startswith("buffer/")},
        moments=moments,
        state=json.loads((path / "state.json").read_text()),
        rng=torch.load(path / "rng.pt", weights_only=True) if optimizer else None,
        drafter_config=json.loads((path / DRAFTER_CONFIG).read_text()),
        extra={k: v for k, v in model.items() if not k.startswith(("param/", "buffer/"))},
    )


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)


def _rotate(root: Path, keep: int, current: Path) -> None:
    """Keep `current` (just written) and the keep - 1 newest older checkpoints by step number. A step_* dir past
    `current` is a continuation this run went back from (written after the checkpoint it resumed, before a
    kill moved `latest` on): superseded, removed."""
    step = _step(current)
    older = sorted((p for p in root.glob("step_*") if p.is_dir() and p != current and STEP_DIR.fullmatch(p.name)),
                   key=_step)
    kept = [p for p in older if _step(p) < step][-(keep - 1):] if keep > 1 else []
    for old in older:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _json_default(x):
    if isinstance(x, Tensor):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def _tuple_to_lists(x):
    return [_tuple_to_lists(v) for v in x] if isinstance(x, tuple) else x


def _lists_to_tuple(x):
    return tuple(_lists_to_tuple(v) for v in x) if isinstance(x, list) else x


def _numpy_state_to_list(state: tuple) -> list:
    name, keys, pos, has_gauss, cached = state
    return [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]


def _list_to_numpy_state(state: list) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, cached)
