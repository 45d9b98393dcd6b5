"""The training batch: right-padded samples of one (length-bucketed) batch.

`collate` turns shard samples (data_prep.shards.Sample, or anything with the same fields) into a
`Batch`. Padding is on the right with token id 0; `valid` marks real tokens and `loss_mask` is False
on padding, so a position past a sample's end can never become a training target.
Teacher fields are present only when every sample carries them (a shard set has one teacher kind).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

PAD_ID = 0
_TEACHER_FIELDS = ("teacher_hidden", "teacher_topk_ids", "teacher_topk_logits", "teacher_argmax")


@dataclass
class Batch:
    input_ids: Tensor  # int64 [B, T], PAD_ID on padding
    loss_mask: Tensor  # bool [B, T], False on padding
    valid: Tensor  # bool [B, T], True on real tokens
    taps: Tensor  # [B, T, n_taps * H]
    teacher_hidden: Tensor | None = None  # [B, T, H]
    teacher_topk_ids: Tensor | None = None  # int64 [B, T, k]
    teacher_topk_logits: Tensor | None = None  # [B, T, k]
    teacher_argmax: Tensor | None = None  # int64 [B, T]
    sample_ids: list[str] | None = None
    # On-policy rollouts (train/rollout.py): at each position, the TTT steps inference visited from it (0: none);
    # the loss then counts only those (anchor, step) pairs. None: every pair (supervised training).
    draft_steps: Tensor | None = None  # int64 [B, T]

    @property
    def teacher_kind(self) -> str:
        """The richest teacher the batch carries: "hidden" | "topk" | "argmax"."""
        if self.teacher_hidden is not None:
            return "hidden"
        if self.teacher_topk_ids is not None and self.teacher_topk_logits is not None:
            return "topk"
        if self.teacher_argmax is not None:
            return "argmax"
        raise ValueError("batch carries no teacher (teacher_hidden / teacher_topk_* / teacher_argmax)")

    @property
    def lengths(self) -> Tensor:
        """Real length of each sample, int64 [B]."""
        return self.valid.sum(dim=1)

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select_taps(self, columns: Sequence[int] | None, n_source: int) -> Batch:
        """This batch with only the taps `columns` (indices into the shards' `n_source` taps), in that order:
        one prep carrying the union of several drafters' layers serves each of them."""
        if columns is None or list(columns) == list(range(n_source)):
            return self
        B, T, _ = self.taps.shape
        return replace(self, taps=self.taps.view(B, T, n_source, -1)[:, :, list(columns)].reshape(B, T, -1))

    def with_feature_noise(self, scale: float, n_taps: int) -> Batch:
        """This batch with Gaussian noise on the taps: std = `scale` x each tap row's RMS (train.feature_noise)."""
        if scale <= 0:
            return self
        B, T, _ = self.taps.shape
        taps = self.taps.float().view(B, T, n_taps, -1)
        rms = taps.pow(2).mean(-1, keepdim=True).sqrt()
        noisy = taps + scale * rms * torch.randn_like(taps)
        return replace(self, taps=noisy.view(B, T, -1).to(self.taps.dtype))

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
        """Move every tensor to `device`; floating tensors also to `dtype` (ints and bools keep theirs)."""

        def move(x: Any) -> Any:
            if not isinstance(x, Tensor):
                return x
            if dtype is not None and x.is_floating_point():
                return x.to(device=device, dtype=dtype)
            return x.to(device=device)

        return replace(self, **{f.name: move(getattr(self, f.name)) for f in fields(self)})


def tap_columns(source_layers: Sequence[int], wanted: Sequence[int], where: str = "the shards") -> list[int]:
    """Indices of the target layers `wanted` among `source_layers` (a manifest's tap_layers)."""
    missing = [i for i in wanted if i not in source_layers]
    if missing:
        raise ValueError(f"tap layers {missing} are not in {where} (they carry {list(source_layers)}): prepare "
                         f"with capture.tap_layers including them")
    return [list(source_layers).index(i) for i in wanted]


def _pad_stack(tensors: Sequence[Tensor], length: int, value: float | int = 0) -> Tensor:
    first = tensors[0]
    out = first.new_full((len(tensors), length, *first.shape[1:]), value)
    for i, x in enumerate(tensors):
        n = min(int(x.shape[0]), length)
        out[i, :n] = x[:n]
    return out


def collate(samples: Sequence[Any], max_len: int | None = None) -> Batch:
    """Right-pad `samples` to the longest one (truncated to `max_len` if given) and stack them."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    lengths = [int(s.input_ids.shape[0]) for s in samples]
    length = max(lengths) if max_len is None else min(max(lengths), max_len)
    valid = torch.zeros(len(samples), length, dtype=torch.bool)
    for i, n in enumerate(lengths):
        valid[i, : min(n, length)] = True
    teachers: dict[str, Tensor | None] = {}
    for name in _TEACHER_FIELDS:
        values = [getattr(s, name, None) for s in samples]
        present = [v is not None for v in values]
        if any(present) and not all(present):
            raise ValueError(f"{name} is present on some samples only; a batch needs one teacher kind")
        teachers[name] = _pad_stack(values, length) if all(present) else None
    steps = [getattr(s, "draft_steps", None) for s in samples]
    if any(v is not None for v in steps) and not all(v is not None for v in steps):
        raise ValueError("draft_steps is present on some samples only: a batch is rollouts or supervised samples")
    return Batch(
        input_ids=_pad_stack([s.input_ids.long() for s in samples], length, PAD_ID),
        loss_mask=_pad_stack([s.loss_mask.bool() for s in samples], length, False),
        valid=valid,
        taps=_pad_stack([s.taps for s in samples], length),
        sample_ids=[str(getattr(s, "sample_id", i)) for i, s in enumerate(samples)],
        draft_steps=_pad_stack([v.long() for v in steps], length, 0) if steps[0] is not None else None,
        **teachers,
    )


def owned_span(batch: Batch) -> tuple[int, int]:
    """(start, n): the batch's first n columns are the global positions start.. whose TTT steps it runs.

    A plain Batch owns all its columns from position 0. A sequence-parallel slice
    (train/sequence_parallel.SeqSlice) carries `start` and `owned`; its columns past `owned` are halo.
    """
    owned = getattr(batch, "owned", None)
    return int(getattr(batch, "start", 0)), int(owned) if owned else int(batch.input_ids.shape[1])
