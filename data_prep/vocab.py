"""The reduced draft vocabulary: the Vd most frequent loss-masked target tokens, sorted by id.

Engines map a draft id to a target id by an OFFSET table, target_id = draft_id + d2t[draft_id]
(method.md §4.1); t2d marks which target ids the drafter can emit. Both ship with the drafter.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

VOCAB_FILE = "draft_vocab.safetensors"


def count_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Frequency of each target id among loss-masked tokens. samples: (input_ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in samples:
        counts += torch.bincount(ids[mask.bool()].long(), minlength=vocab_size)
    return counts


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (d2t int64[Vd], t2d bool[V]).

    Vd = min(draft_vocab_size, V, number of distinct tokens seen): a draft row for a token that never
    occurs in training is never trained, so it is left out rather than padded in. Ties in frequency are
    broken by the smaller id, so the result is deterministic.
    """
    vocab_size = counts.numel()
    seen = int((counts > 0).sum())
    if seen == 0:
        raise ValueError("no loss-masked tokens to build a draft vocabulary from")
    size = min(draft_vocab_size, vocab_size, seen)
    # Stable sort of -count keeps smaller ids first among equal counts.
    order = torch.sort(-counts, stable=True).indices[:size]
    selected = torch.sort(order).values  # draft ids follow target-id order
    d2t = selected - torch.arange(size)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[selected] = True
    return d2t, t2d


def save_draft_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, counts: torch.Tensor) -> None:
    save_file({"d2t": d2t.contiguous(), "t2d": t2d.contiguous(), "token_counts": counts.contiguous()}, str(path))


def load_draft_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = load_file(str(path))
    return tensors["d2t"], tensors["t2d"]


def coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Fraction of loss-masked training tokens the draft vocabulary can emit."""
    total = counts.sum().item()
    return float(counts[t2d].sum().item() / total) if total else 0.0
