"""The exact teacher's rows kept across epochs, so its full-vocabulary head matmul runs once per sample.

The teacher (full-vocabulary logits of every target row: 49,152 columns for the embedded target) is the
step's one matmul that does not depend on the drafter, so it is the same in every epoch: a sample's teacher
depends only on its stored final hidden states. `TeacherCache` keeps, per sample (its id, and the first position a sequence-parallel slice
owns), what a `Target` is rebuilt from: the draft-vocabulary logits, the full log-sum-exp and the argmax
(`train.loss.DraftLogits`, fp32: the loss sees the very values it saw the first time). It fills up to a
memory budget per process and then only serves what it holds; a miss recomputes as before.
"""

from __future__ import annotations

import torch
from torch import Tensor

from train.batch import owned_span
from train.loss import DraftLogits


class TeacherCache:
    def __init__(self, budget_mb: int) -> None:
        self.budget_bytes = budget_mb * 2**20
        self.bytes = 0
        self.hits = self.misses = 0
        self._rows: dict[tuple[str, int], tuple[Tensor, DraftLogits]] = {}  # key -> (row positions j, rows)

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, keys: list[tuple[str, int]], positions: list[Tensor]) -> list[DraftLogits | None]:
        """Each sample's cached rows (None where not cached, or cached for other positions)."""
        found: list[DraftLogits | None] = []
        for key, pos in zip(keys, positions):
            entry = self._rows.get(key)
            hit = entry is not None and torch.equal(entry[0], pos)
            self.hits += hit
            self.misses += not hit
            found.append(entry[1] if hit else None)
        return found

    def store(self, keys: list[tuple[str, int]], positions: list[Tensor], rows: list[DraftLogits]) -> None:
        for key, pos, r in zip(keys, positions, rows):
            size = sum(t.numel() * t.element_size() for t in (pos, r.argmax, r.cols, r.lse))
            if key in self._rows or self.bytes + size > self.budget_bytes:
                continue
            # clone: a slice would keep the whole batch's tensor alive
            self._rows[key] = (pos.clone(), DraftLogits(r.argmax.clone(), r.cols.clone(), r.lse.clone()))
            self.bytes += size


def join(rows: list[DraftLogits]) -> DraftLogits:
    return DraftLogits(torch.cat([r.argmax for r in rows]), torch.cat([r.cols for r in rows]),
                       torch.cat([r.lse for r in rows]))


def split_by_sample(rows: DraftLogits, counts: list[int]) -> list[DraftLogits]:
    return [DraftLogits(a, c, s) for a, c, s in zip(rows.argmax.split(counts), rows.cols.split(counts),
                                                     rows.lse.split(counts))]


def cached_draft_logits(cache: TeacherCache, head, batch, b_idx: Tensor, j_idx: Tensor, maps,
                        chunk_size: int) -> DraftLogits:
    """The exact teacher of the batch's target rows (b_idx, j_idx; row-major, so each sample's rows are
    contiguous), computed per sample in chunks of `chunk_size` rows for the samples the cache lacks, then kept."""
    from train.loss import draft_logits

    start = owned_span(batch)[0]
    keys = [(sid, start) for sid in batch.sample_ids]
    counts = torch.bincount(b_idx, minlength=len(keys)).tolist()
    positions = list(j_idx.split(counts))
    rows = cache.lookup(keys, positions)
    missing = [i for i, r in enumerate(rows) if r is None]
    for i in missing:
        # One sample at a time: its rows come out the same whatever batch it is in, so a run that resumes
        # (cache empty) or a miss recomputes exactly what a hit would have served.
        hidden = batch.teacher_hidden[i, positions[i]]
        rows[i] = join([draft_logits(head, h, maps) for h in hidden.split(chunk_size)])
        cache.store([keys[i]], [positions[i]], [rows[i]])
    return join(rows)
