"""Teacher targets and the per-step TTT loss, computed in chunks of target positions.

Memory, not FLOPs, limits long-context training: one 40K-token sequence's full-vocab logits are
tens of GB. So everything vocabulary-sized is built for `chunk_size` target positions at a time
(flattened over the batch), and each chunk runs under activation checkpointing: backward
recomputes the chunk's teacher and draft logits instead of keeping them. A chunk covers one set of
target positions j for ALL TTT steps, so the (expensive, full-vocab) teacher is computed once per
chunk and shared by the K steps that predict p_j.

Teacher kinds (method.md §4.3):
- "hidden": p_j = softmax(head.logits(teacher_hidden_j)) over the full vocab V. Its argmax decides
  validity (must be in the draft vocab); p̃ = softmax over the draft-vocab columns only; Σ min(p, q)
  uses the full-vocab p at the draft ids (q is 0 outside the draft vocab).
- "topk": the target's top-k ids/logits. argmax = the id with the largest stored logit; p̃ = softmax
  over the top-k entries that are in the draft vocab; p for Σ min(p, q) = softmax over all k stored
  logits (mass outside the top-k is treated as 0, so min_pq is a slight under-estimate).
- "argmax": hard label. CE against the draft id of the argmax; p = one-hot, so Σ min(p, q) = q(argmax).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class VocabMaps:
    """Draft <-> target id maps (d2t are OFFSETS: target_id = draft_id + d2t[draft_id])."""

    draft_to_target: Tensor  # int64 [Vd]
    target_to_draft: Tensor  # int64 [V], -1 where the target id is not in the draft vocab
    t2d: Tensor  # bool [V]

    @classmethod
    def build(cls, d2t: Tensor, t2d: Tensor) -> VocabMaps:
        d2t = d2t.long()
        draft_to_target = torch.arange(d2t.numel(), device=d2t.device) + d2t
        target_to_draft = torch.full((t2d.numel(),), -1, dtype=torch.long, device=d2t.device)
        target_to_draft[draft_to_target] = torch.arange(d2t.numel(), device=d2t.device)
        return cls(draft_to_target, target_to_draft, t2d.bool().to(d2t.device))

    @classmethod
    def from_drafter(cls, drafter: nn.Module) -> VocabMaps:
        return cls.build(drafter.d2t, drafter.t2d)


@dataclass
class TeacherRows:
    """Teacher inputs for a flat list of target positions (rows); only `kind`'s fields are set."""

    kind: str
    hidden: Tensor | None = None  # [N, H]
    topk_ids: Tensor | None = None  # int64 [N, k]
    topk_logits: Tensor | None = None  # [N, k]
    argmax: Tensor | None = None  # int64 [N]

    def split(self, size: int) -> list[TeacherRows]:
        parts = {
            name: getattr(self, name).split(size)
            for name in ("hidden", "topk_ids", "topk_logits", "argmax")
            if getattr(self, name) is not None
        }
        n = len(next(iter(parts.values())))
        return [TeacherRows(self.kind, **{name: p[i] for name, p in parts.items()}) for i in range(n)]


def gather_teacher(batch, b_idx: Tensor, j_idx: Tensor) -> TeacherRows:
    """Teacher rows of `batch` at positions (b_idx[i], j_idx[i])."""
    kind = batch.teacher_kind
    if kind == "hidden":
        return TeacherRows(kind, hidden=batch.teacher_hidden[b_idx, j_idx])
    if kind == "topk":
        return TeacherRows(
            kind,
            topk_ids=batch.teacher_topk_ids[b_idx, j_idx],
            topk_logits=batch.teacher_topk_logits[b_idx, j_idx],
        )
    return TeacherRows(kind, argmax=batch.teacher_argmax[b_idx, j_idx])


@dataclass
class Target:
    """What the loss needs from the teacher for a chunk of c rows.

    Either dense over the draft vocab (p_tilde, p_draft: [c, Vd]) or sparse (ids: draft ids [c, k]
    with weights p_tilde, p_draft: [c, k]; zero weight where an entry is not in the draft vocab).
    """

    argmax: Tensor  # int64 [c] target ids
    in_vocab: Tensor  # bool [c]
    p_tilde: Tensor  # fp32: renormalised over the draft vocab (CE target)
    p_draft: Tensor  # fp32: full-vocab p at the draft ids (for Σ min(p, q))
    ids: Tensor | None = None  # int64 [c, k] draft ids for the sparse form


def _module_dtype(module: nn.Module) -> torch.dtype:
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


@torch.no_grad()
def teacher_argmax(head: nn.Module, rows: TeacherRows) -> Tensor:
    """Target argmax (target ids, int64 [c]) of each row: all that validity needs."""
    if rows.kind == "hidden":
        return head.logits(rows.hidden.to(_module_dtype(head))).float().argmax(-1)
    if rows.kind == "topk":
        top = rows.topk_logits.float().argmax(-1, keepdim=True)
        return rows.topk_ids.gather(-1, top).squeeze(-1)
    return rows.argmax


@torch.no_grad()
def teacher_target(head: nn.Module, rows: TeacherRows, maps: VocabMaps) -> Target:
    if rows.kind == "hidden":
        logits = head.logits(rows.hidden.to(_module_dtype(head))).float()  # [c, V]
        argmax = logits.argmax(-1)
        cols = logits.index_select(-1, maps.draft_to_target)  # [c, Vd]
        p_draft = (cols - logits.logsumexp(-1, keepdim=True)).exp()
        del logits
        return Target(argmax, maps.t2d[argmax], cols.softmax(-1), p_draft)
    if rows.kind == "topk":
        logits = rows.topk_logits.float()
        argmax = teacher_argmax(head, rows)
        draft = maps.target_to_draft[rows.topk_ids]  # [c, k]
        ok = draft >= 0
        # finfo.min (not -inf) keeps rows with no in-vocab entry finite; they get weight 0 below.
        p_tilde = torch.where(ok, logits, torch.finfo(logits.dtype).min).softmax(-1) * ok
        p_draft = logits.softmax(-1) * ok
        return Target(argmax, maps.t2d[argmax], p_tilde, p_draft, ids=draft.clamp_min(0))
    argmax = rows.argmax
    ones = torch.ones(argmax.shape[0], 1, device=argmax.device)
    draft = maps.target_to_draft[argmax].clamp_min(0)[:, None]
    return Target(argmax, maps.t2d[argmax], ones, ones, ids=draft)


def step_ce(logits: Tensor, target: Target, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(Σ over rows in `mask` of −Σ_x p̃(x) log q(x), log q [c, Vd]) for one TTT step."""
    logq = F.log_softmax(logits.float(), dim=-1)  # [c, Vd]
    if target.ids is None:
        ce = -(target.p_tilde * logq).sum(-1)
    else:
        ce = -(target.p_tilde * logq.gather(-1, target.ids)).sum(-1)
    return torch.where(mask, ce, 0.0).sum(), logq


@torch.no_grad()
def step_metrics(
    logq: Tensor, target: Target, mask: Tensor, maps: VocabMaps
) -> tuple[Tensor, Tensor, Tensor]:
    """(acc_sum, min_pq_sum, correct [c]) over the rows in `mask`: acc by the d2t-mapped draft argmax."""
    q = logq.exp()
    q_at = q if target.ids is None else q.gather(-1, target.ids)
    min_pq = torch.minimum(target.p_draft, q_at).sum(-1)
    correct = (maps.draft_to_target[logq.argmax(-1)] == target.argmax) & mask
    return correct.sum().double(), torch.where(mask, min_pq, 0.0).sum().double(), correct


def chunk_terms(
    drafter: nn.Module,
    head: nn.Module,
    hiddens: Sequence[Tensor],
    rows: TeacherRows,
    reachable: Tensor,
    maps: VocabMaps,
) -> tuple[Tensor, ...]:
    """One chunk of c target rows for all K steps.

    hiddens[k]: [c, H] drafter output of step k at the position that predicts each row's target;
    reachable: bool [K, c], True where step k has a real input for the row and the target is a
    candidate (loss-masked, inside the sequence). Adds the in-draft-vocab condition.
    Returns (ce [K], acc [K], min_pq [K], valid bool [K, c], correct bool [K, c]).
    """
    target = teacher_target(head, rows, maps)
    mask = reachable & target.in_vocab  # [K, c]
    ce, logqs = zip(*(step_ce(drafter.compute_logits(h), target, m) for h, m in zip(hiddens, mask)))
    # Metrics last: checkpoint's recompute stops once the last saved tensor is rebuilt, so it skips them.
    acc, min_pq, correct = zip(*(step_metrics(lq.detach(), target, m, maps) for lq, m in zip(logqs, mask)))
    return torch.stack(ce), torch.stack(acc), torch.stack(min_pq), mask, torch.stack(correct)


def chunked_terms(
    drafter: nn.Module,
    head: nn.Module,
    hiddens: Sequence[Tensor],
    rows: TeacherRows,
    reachable: Tensor,
    maps: VocabMaps,
    chunk_size: int,
    use_checkpoint: bool = True,
) -> tuple[Tensor, ...]:
    """`chunk_terms` over N rows, `chunk_size` rows at a time: sums added, [K, c] masks concatenated.

    With `use_checkpoint` (and grad enabled) each chunk is activation-checkpointed, so at most one
    chunk's vocabulary-sized tensors are alive in forward and in backward.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    # split (not slicing in a loop): its backward is ONE concat, not a zero-filled [N, H] per chunk.
    h_chunks = [h.split(chunk_size) for h in hiddens]
    r_chunks, m_chunks = rows.split(chunk_size), reachable.split(chunk_size, dim=1)
    grad = torch.is_grad_enabled() and any(h.requires_grad for h in hiddens)
    totals: list[Tensor] | None = None
    valids, corrects = [], []
    for i, (r, m) in enumerate(zip(r_chunks, m_chunks)):
        hs = [c[i] for c in h_chunks]
        if use_checkpoint and grad:
            out = checkpoint(chunk_terms, drafter, head, hs, r, m, maps, use_reentrant=False)
        else:
            out = chunk_terms(drafter, head, hs, r, m, maps)
        *sums, valid, correct = out
        totals = sums if totals is None else [a + b for a, b in zip(totals, sums)]
        valids.append(valid)
        corrects.append(correct)
    assert totals is not None  # split() yields one (possibly empty) chunk even for N = 0
    return (*totals, torch.cat(valids, dim=1), torch.cat(corrects, dim=1))
