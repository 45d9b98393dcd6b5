"""Tiny stand-ins for the drafter / target head contract and batch builders for the tests/test_ttt_* files.

No tests here: these stubs let the TTT tests check alignment and masking with behaviour chosen by
hand, independently of models/ (whose real Eagle3Drafter is exercised in test_ttt_drafter.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from train.batch import Batch, collate


@dataclass
class FakeSample:
    sample_id: str
    input_ids: Tensor
    loss_mask: Tensor
    taps: Tensor
    teacher_hidden: Tensor | None = None
    teacher_topk_ids: Tensor | None = None
    teacher_topk_logits: Tensor | None = None
    teacher_argmax: Tensor | None = None


def vocab(V: int, Vd: int, gen: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """A sorted random draft vocab: d2t offsets [Vd], t2d bool [V]."""
    ids = torch.randperm(V, generator=gen)[:Vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(Vd), t2d


class StubHead(nn.Module):
    """head.logits(h) = lm_head(norm(h)); a plain linear map is enough for the loss math."""

    def __init__(self, H: int, V: int, weight: Tensor | None = None):
        super().__init__()
        self.lm_head = nn.Linear(H, V, bias=False)
        if weight is not None:
            self.lm_head.weight.data.copy_(weight)
        self.requires_grad_(False)

    def logits(self, h: Tensor) -> Tensor:
        return self.lm_head(h)


class StubDrafter(nn.Module):
    """Position-wise drafter (no attention) that records every forward_step call."""

    def __init__(self, V: int, Vd: int, H: int, n_taps: int, d2t: Tensor, t2d: Tensor, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(V, H).requires_grad_(False)
        self.fc = nn.Linear(n_taps * H, H, bias=False)
        self.mix = nn.Linear(3 * H, H)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.calls: list[dict] = []

    def fuse(self, taps: Tensor) -> Tensor:
        return self.fc(taps)

    def forward_step(
        self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor, cache, attn_mask=None
    ) -> Tensor:
        self.calls.append(dict(hidden=hidden, ids=input_ids.clone(), pos=position_ids.clone()))
        pos = torch.sin(position_ids.float()[..., None] * torch.arange(1, hidden.shape[-1] + 1) / 7)
        x = torch.cat([hidden, self.embed_tokens(input_ids), pos.to(hidden.dtype)], dim=-1)
        return hidden + torch.tanh(self.mix(x))

    def compute_logits(self, h: Tensor) -> Tensor:
        return self.lm_head(h)


class OracleDrafter(nn.Module):
    """Predicts succ(x) from the embedded token x: always right on data where x_{j+1} = succ(x_j).

    hidden = one-hot of the embedded token (H = V); logits peak at the draft id of succ(token).
    """

    def __init__(self, V: int, d2t: Tensor, t2d: Tensor, succ: Tensor):
        super().__init__()
        Vd = d2t.numel()
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d.clone())
        self.fc = nn.Linear(1, 1)  # a parameter, so device/dtype lookups work
        t2d_index = torch.full((V,), 0, dtype=torch.long)
        t2d_index[torch.arange(Vd) + d2t] = torch.arange(Vd)
        table = torch.full((V, Vd), -10.0)
        in_vocab = t2d[succ]
        table[torch.arange(V)[in_vocab], t2d_index[succ[in_vocab]]] = 10.0
        self.register_buffer("table", table)
        self.V = V

    def fuse(self, taps: Tensor) -> Tensor:
        return torch.zeros(*taps.shape[:-1], self.V)

    def forward_step(
        self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor, cache, attn_mask=None
    ) -> Tensor:
        return torch.nn.functional.one_hot(input_ids, self.V).float()

    def compute_logits(self, h: Tensor) -> Tensor:
        return h @ self.table


def random_batch(
    kind: str,
    lengths: list[int],
    V: int,
    H: int,
    n_taps: int = 3,
    k: int = 4,
    head: StubHead | None = None,
    seed: int = 0,
) -> Batch:
    """Random samples of the given lengths with teacher `kind` (hidden | topk | argmax)."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, T in enumerate(lengths):
        hidden = torch.randn(T, H, generator=gen) * 3
        s = FakeSample(
            sample_id=f"s{i}",
            input_ids=torch.randint(1, V, (T,), generator=gen),
            loss_mask=torch.rand(T, generator=gen) < 0.7,
            taps=torch.randn(T, n_taps * H, generator=gen),
        )
        if kind == "hidden":
            s.teacher_hidden = hidden
        elif kind == "topk":
            logits = head.logits(hidden) if head is not None else torch.randn(T, V, generator=gen) * 3
            top = logits.topk(k, dim=-1)
            s.teacher_topk_ids, s.teacher_topk_logits = top.indices, top.values
        else:
            logits = head.logits(hidden) if head is not None else torch.randn(T, V, generator=gen)
            s.teacher_argmax = logits.argmax(-1)
        samples.append(s)
    return collate(samples)
