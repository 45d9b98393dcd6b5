"""Checkpoint -> serving export (config.json + model.safetensors), on CPU, offline.

Used at the end of a run (rank 0, from the consolidated fp32 parameters) and by launch/export.py for
any saved checkpoint. The layout itself is the family's save_export (models/eagle3.py, eagle1.py, dflash.py).
"""

from __future__ import annotations

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
    method: str = "eagle3",
) -> Path:
    from models.registry import family

    if max_position_embeddings is not None:
        config = {**config, "max_position_embeddings": max_position_embeddings}
    drafter = drafter_from_state(config, params, buffers, method)
    if hasattr(drafter, "set_vocab_mapping"):
        drafter.set_vocab_mapping(drafter.d2t.clone(), drafter.t2d.clone())  # refuse an inconsistent mapping
    return family(method).save_export(drafter, out)


def export_checkpoint(path: str | Path, out: str | Path, max_position_embeddings: int | None = None) -> Path:
    """Export the checkpoint at `path` (a step dir, a `latest` file, or a run / checkpoints dir -> what its `latest`
    names). The optimizer state and RNG files are not read: a checkpoint stripped to its weights exports too."""
    ckpt = checkpoint.load(Path(path), optimizer=False)
    method = ckpt.state.get("method", "eagle3")
    return export_drafter(ckpt.drafter_config, ckpt.params, ckpt.buffers, out, max_position_embeddings, method)

