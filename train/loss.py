"""Teacher targets and the per-step TTT loss, computed in chunks of target positions.

Memory, not FLOPs, limits long-context training: one 40K-token sequence's full-vocab logits are
tens of GB. So everything vocabulary-sized is built for `chunk_size` target positions at a time
(flattened over the batch). A chunk covers one set of target positions j for ALL TTT steps, so the
(expensive, full-vocab) teacher is computed once per chunk and shared by the K steps that predict p_j.
Two implementations of the same loss:
- `fused_terms` (training default, for drafters whose logits are lm_head(norm(h))): per chunk and
  step, the logits once and the CE's gradients right away, no recompute (see its section below);
- `chunked_terms`: plain autograd, each chunk activation-checkpointed (backward recomputes the
  chunk's teacher and draft logits); any `compute_logits`, and the reference for the fused path.

Teacher kinds (docs/method.md §4.3):
- "hidden": p_j = softmax(head.logits(teacher_hidden_j)) over the full vocab V. Its argmax decides
  validity (must be in the draft vocab); p̃ = softmax over the draft-vocab columns only; Σ min(p, q)
  uses the full-vocab p at the draft ids (q is 0 outside the draft vocab).
- "topk": the target's top-k ids/logits. argmax = the id with the largest stored logit; p̃ = softmax
  over the top-k entries that are in the draft vocab; p for Σ min(p, q) = softmax over all k stored
  logits (mass outside the top-k is treated as 0, so min_pq is a slight under-estimate).
- "argmax": hard label. CE against the draft id of the argmax; p = one-hot, so Σ min(p, q) = q(argmax).

Acceptance term (optional, `AcceptTerm`; docs/method.md §4.7): each row's loss is CE + β·A(α) with
α = Σ min(p, q), the probability that a sampled draft from q is accepted against p: A = 1 − α ("tv", the
total-variation distance on the draft ids) or −log α ("log"). Both paths add it; the reported CE stays CE.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from train.config import ACCEPT_KINDS


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


@dataclass(frozen=True)
class AcceptTerm:
    """β·A(α) added to every row's CE, α = Σ_draft ids min(p, q) (p: the target's full-vocab probabilities at
    the draft ids, so mass outside the draft vocabulary is never acceptable).
    "tv": A = 1 − α. "log": A = −log max(α, floor); below the floor the term is constant (no gradient), which
    keeps the 1/α of its gradient bounded while a fresh drafter puts almost no mass on the target's tokens."""

    kind: str = "none"
    weight: float = 0.0
    floor: float = 1e-3

    def __post_init__(self) -> None:
        if self.kind not in ACCEPT_KINDS:
            raise ValueError(f"acceptance term kind must be one of {ACCEPT_KINDS}, got {self.kind!r}")
        if self.weight < 0 or not 0 < self.floor < 1:
            raise ValueError(f"acceptance term needs weight >= 0 and floor in (0, 1), got {self.weight}, {self.floor}")

    @property
    def active(self) -> bool:
        return self.kind != "none" and self.weight > 0

    def value(self, alpha: Tensor) -> Tensor:
        """A(α) per row (differentiable: the autograd path's definition)."""
        if self.kind == "tv":
            return 1.0 - alpha
        return -torch.log(alpha.clamp_min(self.floor))

    def slope(self, alpha: Tensor) -> Tensor:
        """dA/dα per row (the fused path's)."""
        if self.kind == "tv":
            return torch.full_like(alpha, -1.0)
        return torch.where(alpha > self.floor, -1.0 / alpha.clamp_min(self.floor), 0.0)


NO_ACCEPT = AcceptTerm()


@dataclass
class TeacherRows:
    """Teacher inputs for a flat list of target positions (rows); only `kind`'s fields are set."""

    kind: str
    hidden: Tensor | None = None  # [N, H]
    topk_ids: Tensor | None = None  # int64 [N, k]
    topk_logits: Tensor | None = None  # [N, k]
    argmax: Tensor | None = None  # int64 [N]

    def take(self, rows: slice) -> TeacherRows:
        return TeacherRows(self.kind, **{
            name: getattr(self, name)[rows]
            for name in ("hidden", "topk_ids", "topk_logits", "argmax")
            if getattr(self, name) is not None
        })

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


@dataclass
class DraftLogits:
    """What the exact ("hidden") teacher's rows reduce to: all a Target needs, a fifth of the full logits
    for a 49K/8K vocabulary pair (train/teacher_cache.py keeps these across epochs)."""

    argmax: Tensor  # int64 [c] target ids
    cols: Tensor  # fp32 [c, Vd] the target's logits at the draft ids
    lse: Tensor  # fp32 [c, 1] log-sum-exp of the full-vocab logits

    def target(self, maps: VocabMaps) -> Target:
        return Target(self.argmax, maps.t2d[self.argmax], self.cols.softmax(-1), (self.cols - self.lse).exp())


@torch.no_grad()
def draft_logits(head: nn.Module, hidden: Tensor, maps: VocabMaps) -> DraftLogits:
    """The exact teacher of `hidden` rows [c, H]: one full-vocab head matmul."""
    logits = head.logits(hidden.to(_module_dtype(head))).float()  # [c, V]
    return DraftLogits(logits.argmax(-1), logits.index_select(-1, maps.draft_to_target),
                       logits.logsumexp(-1, keepdim=True))


@torch.no_grad()
def teacher_target(head: nn.Module, rows: TeacherRows, maps: VocabMaps) -> Target:
    if rows.kind == "hidden":
        return draft_logits(head, rows.hidden, maps).target(maps)
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


def step_ce(
    logits: Tensor, target: Target, mask: Tensor, accept: AcceptTerm = NO_ACCEPT
) -> tuple[Tensor, Tensor, Tensor]:
    """(Σ over rows in `mask` of −Σ_x p̃(x) log q(x), of the acceptance term A(α), log q [c, Vd]) for one
    TTT step; the A sum is 0 when `accept` is off."""
    logq = F.log_softmax(logits.float(), dim=-1)  # [c, Vd]
    if target.ids is None:
        ce = -(target.p_tilde * logq).sum(-1)
    else:
        ce = -(target.p_tilde * logq.gather(-1, target.ids)).sum(-1)
    if not accept.active:
        return torch.where(mask, ce, 0.0).sum(), ce.new_zeros(()), logq
    q = logq.exp()
    q_at = q if target.ids is None else q.gather(-1, target.ids)
    term = accept.value(torch.minimum(target.p_draft, q_at).sum(-1))
    return torch.where(mask, ce, 0.0).sum(), torch.where(mask, term, 0.0).sum(), logq


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
    accept: AcceptTerm = NO_ACCEPT,
) -> tuple[Tensor, ...]:
    """One chunk of c target rows for all K steps.

    hiddens[k]: [c, H] drafter output of step k at the position that predicts each row's target;
    reachable: bool [K, c], True where step k has a real input for the row and the target is a
    candidate (loss-masked, inside the sequence). Adds the in-draft-vocab condition.
    Returns (ce [K], acc [K], min_pq [K], accept_term [K], valid bool [K, c], correct bool [K, c]).
    """
    target = teacher_target(head, rows, maps)
    mask = reachable & target.in_vocab  # [K, c]
    ce, term, logqs = zip(*(step_ce(drafter.compute_logits(h), target, m, accept) for h, m in zip(hiddens, mask)))
    # Metrics last: checkpoint's recompute stops once the last saved tensor is rebuilt, so it skips them.
    acc, min_pq, correct = zip(*(step_metrics(lq.detach(), target, m, maps) for lq, m in zip(logqs, mask)))
    return torch.stack(ce), torch.stack(acc), torch.stack(min_pq), torch.stack(term), mask, torch.stack(correct)


def chunked_terms(
    drafter: nn.Module,
    head: nn.Module,
    hiddens: Sequence[Tensor],
    rows: TeacherRows,
    reachable: Tensor,
    maps: VocabMaps,
    chunk_size: int,
    use_checkpoint: bool = True,
    accept: AcceptTerm = NO_ACCEPT,
) -> tuple[Tensor, ...]:
    """`chunk_terms` over N rows, `chunk_size` rows at a time: sums added, [K, c] masks concatenated.
    Returns (ce, acc, min_pq, accept_term, valid, correct); the loss of a step is ce + accept.weight·accept_term.

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
            out = checkpoint(chunk_terms, drafter, head, hs, r, m, maps, accept, use_reentrant=False)
        else:
            out = chunk_terms(drafter, head, hs, r, m, maps, accept)
        *sums, valid, correct = out
        totals = sums if totals is None else [a + b for a, b in zip(totals, sums)]
        valids.append(valid)
        corrects.append(correct)
    assert totals is not None  # split() yields one (possibly empty) chunk even for N = 0
    return (*totals, torch.cat(valids, dim=1), torch.cat(corrects, dim=1))


# ------------------------------------------------------------------------------------------------
# Fused output head: CE + its gradients in ONE pass over the logits, no recompute.
#
# The autograd path above does 4 head matmuls per row and step (the logits in forward, again in the
# checkpoint recompute, and the two of backward) and runs the teacher twice. `fused_terms` computes, per chunk
# and step, the logits once and right away the CE's gradient w.r.t. them, (q·Σp̃ − p̃)·w, then the
# two products that backward would have formed (w.r.t. the normed rows and the lm_head weight); the
# logits are freed before the next step. Backward only scales the saved gradients by grad_output.
# That is 3 matmuls per row and step instead of 4, the teacher once per chunk, and the norm's
# backward done per chunk too, so nothing vocabulary-sized outlives its chunk.
#
# The price: the per-step loss weights w_k (decay^k / normalizer_k) must be known in forward, since
# the lm_head gradient mixes the steps; one [Vd, H] fp32 accumulator holds it (not one per chunk).


@dataclass
class FusedSpec:
    """The non-tensor inputs of `fused_terms` (one TTT loss: K steps over N target rows)."""

    norm: nn.Module  # drafter.norm; called via .forward (no module hooks, see fused_terms)
    head: nn.Module | None  # the frozen target head (the "hidden" teacher only)
    rows: TeacherRows
    reachable: Tensor  # bool [K, N]
    maps: VocabMaps
    chunk_size: int
    scale: Tensor | None  # [K] loss weight of step k's CE sum; None: no loss/gradients (evaluation)
    targets: list[Target] | None = None  # per-chunk teacher targets computed earlier (count_valid)
    accept: AcceptTerm = NO_ACCEPT  # β·A(α) added to each row's CE


def _row_ce_and_min_pq(logq: Tensor, target: Target) -> tuple[Tensor, Tensor, Tensor]:
    """(−Σ p̃ log q, Σ min(p, q), q) per row; `logq` is consumed (exponentiated in place into q)."""
    if target.ids is None:
        ce = -torch.linalg.vecdot(target.p_tilde, logq)  # no [r, Vd] temporary, unlike (p * logq).sum(-1)
        q = logq.exp_()
        return ce, torch.minimum(target.p_draft, q).sum(-1), q
    ce = -(target.p_tilde * logq.gather(-1, target.ids)).sum(-1)
    q = logq.exp_()
    return ce, torch.minimum(target.p_draft, q.gather(-1, target.ids)).sum(-1), q


def _logits_grad_(
    q: Tensor, target: Target, p_sum: Tensor, coef: Tensor, alpha_coef: Tensor | None = None
) -> Tensor:
    """d(Σ_rows coef·CE_row + alpha_coef·α_row)/d logits, written into q (which is consumed).

    dCE/dz = q·Σp̃ − p̃; dα/dz = q⊙u − q·Σ(q⊙u) with u = [q < p] at the draft ids (α = Σ min(p, q))."""
    row = coef * p_sum
    qu = None
    if alpha_coef is not None:
        q_at = q if target.ids is None else q.gather(-1, target.ids)
        qu = q_at * (q_at < target.p_draft)  # a new tensor: q is overwritten below
        row = row - alpha_coef * qu.sum(-1)
    q.mul_(row[:, None])
    if target.ids is None:
        q.addcmul_(target.p_tilde, coef[:, None], value=-1.0)
        return q if qu is None else q.addcmul_(qu, alpha_coef[:, None])
    # scatter_add: padded sparse entries share id 0 with weight 0, duplicates must add.
    vals = target.p_tilde * -coef[:, None]
    if qu is not None:
        vals = vals + qu * alpha_coef[:, None]
    return q.scatter_add_(-1, target.ids, vals)


def _subset(target: Target, idx: Tensor) -> Target:
    pick = lambda x: None if x is None else x.index_select(0, idx)  # noqa: E731
    return Target(pick(target.argmax), pick(target.in_vocab), pick(target.p_tilde), pick(target.p_draft),
                  pick(target.ids))


def _head_pass(
    spec: FusedSpec, h: Tensor, weight: Tensor, norm_params: Sequence[Tensor], need: Sequence[bool]
) -> tuple[Tensor, ...]:
    """The fused forward. h: [K, N, H] un-normed rows; need = (h, weight, *norm_params) needs grad.

    Returns (ce [K], acc [K], min_pq [K], accept_term [K], valid [K, N], correct [K, N], grad_h, grad_weight,
    *grad_norm_params); a gradient is None where not needed.
    """
    K, N, _ = h.shape
    need_h, need_w, need_p = need[0], need[1], list(need[2:])
    need_norm = need_h or any(need_p)
    dev = h.device
    ce = torch.zeros(K, device=dev)
    acc = torch.zeros(K, dtype=torch.float64, device=dev)
    min_pq = torch.zeros(K, dtype=torch.float64, device=dev)
    accept = spec.accept
    term = torch.zeros(K, device=dev)
    valid = torch.zeros(K, N, dtype=torch.bool, device=dev)
    correct = torch.zeros(K, N, dtype=torch.bool, device=dev)
    grad_h = torch.zeros_like(h) if need_h else None
    # fp32 accumulators: one [Vd, H], whatever the number of chunks (a bf16 sum would lose bits).
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=dev) if need_w else None
    grad_p = [torch.zeros(p.shape, dtype=torch.float32, device=dev) if n else None
              for p, n in zip(norm_params, need_p)]
    w_t = weight.t()
    for start in range(0, N, spec.chunk_size):
        sl = slice(start, min(start + spec.chunk_size, N))
        if spec.targets is not None:
            target = spec.targets[start // spec.chunk_size]
        else:
            target = teacher_target(spec.head, spec.rows.take(sl), spec.maps)
        mask = spec.reachable[:, sl] & target.in_vocab  # [K, c]
        valid[:, sl] = mask
        # Rows valid at no step (argmax outside the draft vocab) cost nothing further.
        keep = mask.any(0).nonzero().squeeze(1)
        if keep.numel() == 0:
            continue
        all_kept = keep.numel() == mask.shape[1]
        if not all_kept:
            target, mask = _subset(target, keep), mask[:, keep]
        with torch.set_grad_enabled(need_norm):  # the norm's backward is taken right here, per chunk
            h_in = h[:, sl].detach().requires_grad_(need_norm)
            normed = spec.norm.forward(h_in)  # [K, c, H]
        grad_normed = torch.zeros_like(normed) if need_norm else None
        p_sum = target.p_tilde.sum(-1)
        chunk_correct = torch.zeros(K, sl.stop - sl.start, dtype=torch.bool, device=dev)
        for k in range(K):
            x = normed[k].detach() if all_kept else normed[k].detach().index_select(0, keep)  # [r, H]
            logits = (x @ w_t).float()  # [r, Vd]
            top = logits.argmax(-1)
            logq = torch.log_softmax(logits, -1)
            del logits
            ce_rows, min_pq_rows, q = _row_ce_and_min_pq(logq, target)
            m = mask[k]
            ce[k] += torch.where(m, ce_rows, 0.0).sum()
            min_pq[k] += torch.where(m, min_pq_rows, 0.0).sum().double()
            if accept.active:
                term[k] += torch.where(m, accept.value(min_pq_rows), 0.0).sum()
            hit = (spec.maps.draft_to_target[top] == target.argmax) & m
            acc[k] += hit.sum().double()
            if all_kept:
                chunk_correct[k] = hit
            else:
                chunk_correct[k].index_copy_(0, keep, hit)
            if need_norm or need_w:
                assert spec.scale is not None
                coef = spec.scale[k] * m
                alpha_coef = coef * accept.weight * accept.slope(min_pq_rows) if accept.active else None
                d = _logits_grad_(q, target, p_sum, coef, alpha_coef).to(weight.dtype)  # [r, Vd]
                if need_norm:
                    g = d @ weight  # [r, H]
                    if all_kept:
                        grad_normed[k] = g
                    else:
                        grad_normed[k].index_copy_(0, keep, g)
                if need_w and d.dtype == grad_w.dtype:
                    grad_w.addmm_(d.t(), x)
                elif need_w:
                    grad_w.add_(d.t() @ x)
            del q
        correct[:, sl] = chunk_correct
        if need_norm:
            wanted = [h_in] * need_h + [p for p, n in zip(norm_params, need_p) if n]
            got = list(torch.autograd.grad(normed, wanted, grad_normed))
            if need_h:
                grad_h[:, sl] = got.pop(0)
            for i, n in enumerate(need_p):
                if n:
                    grad_p[i] += got.pop(0)
    cast = lambda g, like: None if g is None else g.to(like.dtype)  # noqa: E731
    return (ce, acc, min_pq, term, valid, correct, grad_h, cast(grad_w, weight),
            *(cast(g, p) for g, p in zip(grad_p, norm_params)))


def _weighted_loss(spec: FusedSpec, ce: Tensor, term: Tensor) -> Tensor:
    objective = ce + spec.accept.weight * term if spec.accept.active else ce
    return (spec.scale.to(ce.dtype) * objective).sum()


class _FusedHeadLoss(torch.autograd.Function):
    """loss = Σ_k scale_k · (CE_k + β·A_k) with the gradients formed in forward; backward scales them."""

    @staticmethod
    def forward(ctx, spec: FusedSpec, h: Tensor, weight: Tensor, *norm_params: Tensor):
        ce, acc, min_pq, term, valid, correct, *grads = _head_pass(
            spec, h, weight, norm_params, ctx.needs_input_grad[1:]
        )
        assert spec.scale is not None
        loss = _weighted_loss(spec, ce, term)
        ctx.save_for_backward(*grads)
        ctx.mark_non_differentiable(ce, acc, min_pq, valid, correct)
        return loss, ce, acc, min_pq, valid, correct

    @staticmethod
    def backward(ctx, grad_loss: Tensor, *_unused):
        return None, *(None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors)


def fused_terms(
    norm: nn.Module,
    weight: Tensor,
    hiddens: Sequence[Tensor],
    head: nn.Module | None,
    rows: TeacherRows,
    reachable: Tensor,
    maps: VocabMaps,
    chunk_size: int,
    scale: Tensor | None,
    targets: list[Target] | None = None,
    accept: AcceptTerm = NO_ACCEPT,
) -> tuple[Tensor | None, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`chunked_terms` for a drafter whose logits are `F.linear(norm(h), weight)`, plus the loss.

    Returns (loss, ce [K], acc [K], min_pq [K], valid [K, N], correct [K, N]); loss = Σ_k scale[k]·(ce[k] +
    accept.weight·Σ_rows A(α))
    is the only differentiable output (w.r.t. hiddens, weight and norm's parameters), None when
    `scale` is None. `norm` is run through `.forward`, not `__call__`, and `weight` is used directly:
    no module hook fires per chunk, so the number of module calls does not depend on the data (ZeRO-3
    must still keep these parameters gathered, which train/engine.py's keep_gathered does).
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    h = torch.stack(list(hiddens))  # [K, N, H]
    spec = FusedSpec(norm, head, rows, reachable, maps, chunk_size, scale, targets, accept)
    norm_params = list(norm.parameters())
    inputs = (h, weight, *norm_params)
    if scale is not None and torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _FusedHeadLoss.apply(spec, *inputs)
    with torch.no_grad():
        ce, acc, min_pq, term, valid, correct, *_ = _head_pass(spec, h, weight, norm_params, [False] * len(inputs))
    loss = None if scale is None else _weighted_loss(spec, ce, term)
    return loss, ce, acc, min_pq, valid, correct
