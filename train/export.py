"""Checkpoint -> serving export (config.json + model.safetensors), on CPU, offline.

Used at the end of a run (rank 0, from the consolidated fp32 parameters) and by launch/export.py for
any saved checkpoint. The layout itself is the family's save_export (models/eagle3.py, eagle1.py, dflash.py).
The export's config.json records the target the drafter was trained for (models.export.TARGET_KEY), from the
checkpoint (its run's prep, recorded when it was saved) or, for a checkpoint from before, its prep directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import Tensor

from train import checkpoint
from train.build import drafter_from_state


def export_drafter(
    config: dict,
    params: dict[str, Tensor],
    buffers: dict[str, Tensor],
    out: str | Path,
    max_position_embeddings: int | None = None,
    *,
    method: str,
    target: dict | None = None,
) -> Path:
    """method: the drafter family (models/registry.py); target: the prep's target record (`prep_target`), which
    the export's config.json keeps with the tap layers."""
    from models.export import ExportError, check_target, stamp_target, target_fingerprint
    from models.registry import family

    if max_position_embeddings is not None:
        config = {**config, "max_position_embeddings": max_position_embeddings}
    fam = family(method)
    drafter = drafter_from_state(config, params, buffers, method)
    if fam.draft_vocab:
        drafter.set_vocab_mapping(drafter.d2t.clone(), drafter.t2d.clone())  # refuse an inconsistent mapping
    if target is None:
        return fam.save_export(drafter, out)
    hidden = config.get("target_hidden_size") or config.get("hidden_size")  # EAGLE-1, DFlash: the target's width
    differ = [f"{k} {mine} (the target's: {target[k]})" for k, mine in (("vocab_size", config.get("vocab_size")),
              ("hidden_size", hidden)) if None not in (mine, target.get(k)) and mine != target[k]]
    if differ:
        raise ExportError(f"the drafter of {out} was not trained for {target.get('id')}: {', '.join(differ)}")
    record = target_fingerprint(target, target.get("tokenizer_hash"), drafter.tap_layers)
    check_target(record, record, f"the drafter of {out}", "its target")  # its tap layers exist in that target
    out = fam.save_export(drafter, out)
    stamp_target(out, record)
    return out


def prep_target(prep_dir: str | Path | None) -> dict | None:
    """The target of a prep directory as its spec records it (ShardSpec.target + tokenizer_hash: the rendered
    samples' spec.json, else the train shards' manifest.json); None where neither is there."""
    if prep_dir is None:
        return None
    for path in (Path(prep_dir) / "rendered" / "spec.json", Path(prep_dir) / "train" / "manifest.json"):
        if path.is_file():
            raw = json.loads(path.read_text())
            spec = raw.get("spec", raw)
            return {**spec["target"], "tokenizer_hash": spec.get("tokenizer_hash") or None}
    return None


def export_checkpoint(path: str | Path, out: str | Path, max_position_embeddings: int | None = None) -> Path:
    """Export the checkpoint at `path` (a step dir, a `latest` file, or a run / checkpoints dir -> what its `latest`
    names). The optimizer state and RNG files are not read: a checkpoint stripped to its weights exports too."""
    from models.export import ExportError

    ckpt = checkpoint.load(Path(path), optimizer=False)
    method = ckpt.state.get("method")
    if method is None:
        raise ExportError(f"{ckpt.path} does not record its drafter family (no 'method' in its state.json): "
                          "it cannot be exported")
    return export_drafter(ckpt.drafter_config, ckpt.params, ckpt.buffers, out, max_position_embeddings,
                          method=method, target=checkpoint_target(ckpt))


def checkpoint_target(ckpt: checkpoint.Checkpoint) -> dict | None:
    """The target a checkpoint's drafter was trained for: what it recorded, checked against its prep directory's
    where that is still there (models.export.ExportError naming both when that prep is now for another target)."""
    from models.export import FINGERPRINT, ExportError

    recorded, prep = ckpt.state.get("target"), prep_target(ckpt.state.get("data_dir"))
    if recorded is not None and prep is not None:
        differ = [k for k in FINGERPRINT if None not in (recorded.get(k), prep.get(k)) and recorded[k] != prep[k]]
        if differ:
            raise ExportError(f"{ckpt.path} was trained for {recorded.get('id')} ({recorded}), but its prep "
                              f"{ckpt.state.get('data_dir')} is now for {prep.get('id')} ({prep}): they differ in "
                              f"{', '.join(differ)}")
    return recorded if recorded is not None else prep

