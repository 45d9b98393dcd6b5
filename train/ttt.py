"""Training-time test (TTT): the K-step unroll, its loss and its evaluation, shared by EAGLE-3
(train/eagle3.py) and EAGLE-1 (train/eagle1.py).

Alignment (docs/method.md §4.3), for a sequence x_0..x_{T-1} with fused target features g_t:
- step 0: position t takes (g_t, e(x_{t+1})) and predicts p_{t+1};
- step k >= 1: position t takes (a_t^{(k-1)}, e(x_{t+k+1})) and predicts p_{t+k+1};
- RoPE position of (t, k) is t + k; attention via models.attention.TTTCache (step-0 causal prefix
  plus the position's own diagonal chain; the drafter does that).
Inputs past the end (t+k+1 >= T) are the pad id 0. p_j (the distribution of x_{j+1}) is a target only
where j+1 < T_real, loss_mask[j+1], and the target's argmax at j is in the draft vocab; its step-k
prediction comes from position t = j-k-1 >= 0. Those are the "valid" (k, j) pairs.

Loss normalisation (fixed): loss = Σ_k decay^k · CE_k, CE_k = (Σ over valid positions of step k of
−Σ_x p̃(x) log q_k(x)) / normalizer[k]. With normalizer None it is this batch's own count of valid
positions of step k (clamped to >= 1), i.e. the mean over valid positions; a trainer passes the
all-reduced global counts (`count_valid`) so that the loss of a split batch sums to the full one.

Sequence slices (train/sequence_parallel.py): a batch may be one rank's slice of longer sequences, see
`owned_span`. It computes the TTT steps of its owned start positions t only (RoPE at global positions),
and its columns past them (a halo of K+1) supply the later tokens, teacher rows and masks those steps
need; each (k, j) pair is then counted by exactly one slice, the one owning t = j-k-1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from train.batch import PAD_ID, Batch, owned_span
from train.config import TrainConfig
from train.loss import (
    NO_ACCEPT,
    AcceptTerm,
    DraftLogits,
    VocabMaps,
    chunked_terms,
    fused_terms,
    gather_teacher,
    teacher_argmax,
    teacher_target,
)
from train.teacher_cache import TeacherCache, cached_draft_logits

SUM_KEYS = ("ce_sum", "acc_sum", "min_pq_sum", "n_valid_k")


@dataclass
class TTTSettings:
    # Defaults are the run config's (train/config.py TrainConfig); `from_train` builds them from a run's.
    steps: int = TrainConfig.ttt_steps  # K: TTT unroll length
    decay: float = TrainConfig.loss_decay  # λ: step k's CE is weighted λ^k
    chunk_size: int = TrainConfig.chunk_size  # target positions (flattened over the batch) per loss chunk
    # Fused output head (train/loss.py fused_terms): CE and its gradients in one pass over each chunk's
    # logits, the teacher once, nothing recomputed. Used when the drafter's logits are lm_head(norm(h))
    # (Eagle3Drafter); False, or another drafter, takes the autograd path below.
    fused_head: bool = True
    checkpoint_chunks: bool = True  # autograd path: checkpoint each loss chunk (recompute logits in backward)
    checkpoint_layer: bool = False  # activation-checkpoint the drafter layer of each TTT step
    # count_valid keeps the per-chunk teacher targets for ttt_loss (so the full-vocab teacher runs once per
    # batch, not twice) when they take at most this many MB; long sequences recompute them instead.
    teacher_cache_mb: int = 1024
    # The exact teacher's rows kept across epochs (train/teacher_cache.py), MB per process; 0 = off.
    teacher_epoch_cache_mb: int = TrainConfig.teacher_epoch_cache_mb
    accept: AcceptTerm = NO_ACCEPT  # the optional acceptance term of the loss (train.accept_loss*)

    @classmethod
    def from_train(cls, t: TrainConfig, held_out: bool = False) -> TTTSettings:
        """A run's settings (train.ttt_steps, loss_decay, chunk_size, checkpoint_layer); held_out: what its
        evaluations unroll (train.eval_ttt_steps, default K; no checkpointing without a backward)."""
        if held_out:
            return cls(steps=t.eval_ttt_steps or t.ttt_steps, decay=t.loss_decay, chunk_size=t.chunk_size)
        return cls(steps=t.ttt_steps, decay=t.loss_decay, chunk_size=t.chunk_size, checkpoint_layer=t.checkpoint_layer,
                   teacher_epoch_cache_mb=t.teacher_epoch_cache_mb, accept=AcceptTerm(t.accept_loss, t.accept_loss_weight))

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")


def shifted_ids(input_ids: Tensor, shift: int) -> Tensor:
    """ids[:, t] = input_ids[:, t + shift], PAD_ID past the end."""
    out = torch.full_like(input_ids, PAD_ID)
    if shift < input_ids.shape[1]:
        out[:, : input_ids.shape[1] - shift] = input_ids[:, shift:]
    return out


def target_rows(batch: Batch, steps: int) -> tuple[Tensor, Tensor, Tensor]:
    """Candidate target positions (b, j) and which steps can reach them.

    Candidates: j+1 is a real, loss-masked token. reachable[k, i]: step k predicts row i from the real
    position t = j-k-1 >= 0, which this batch owns (always, unless it is a slice: `owned_span`), and, in a
    rollout's batch (`draft_steps`), where inference drafted step k from t (train/rollout.py).
    The in-draft-vocab condition is added where the teacher is evaluated.
    """
    cand = torch.zeros_like(batch.valid)
    cand[:, :-1] = batch.valid[:, 1:] & batch.loss_mask[:, 1:]
    b_idx, j_idx = cand.nonzero(as_tuple=True)
    k = torch.arange(steps, device=j_idx.device)[:, None]
    t = j_idx[None, :] - k - 1  # [K, N] start position
    reachable = (t >= 0) & (t < owned_span(batch)[1])
    if batch.draft_steps is not None:  # a rollout's batch: only the (start, step) pairs inference visited
        visited = batch.draft_steps[b_idx[None, :].expand_as(t), t.clamp_min(0)]
        reachable &= visited > k
    return b_idx, j_idx, reachable


def _float_dtype(module: nn.Module) -> torch.dtype:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)


def _forward_step(drafter: nn.Module, hidden: Tensor, ids: Tensor, pos: Tensor, cache, ckpt: bool) -> Tensor:
    if not (ckpt and torch.is_grad_enabled()):
        return drafter.forward_step(hidden, ids, pos, cache)
    # Backward recomputes the step, and must see the cache as it was BEFORE it (not with this and later
    # steps' K/V appended): run on a copy of the cache so far and append its additions to the real one.
    n = len(cache)

    def run(h: Tensor) -> tuple[Tensor, ...]:
        view = type(cache)()
        for k, v in zip(cache.keys[:n], cache.values[:n]):
            view.append(k, v)
        out = drafter.forward_step(h, ids, pos, view)
        return (out, *view.keys[n:], *view.values[n:])

    out, *added = checkpoint(run, hidden, use_reentrant=False)
    half = len(added) // 2
    for k, v in zip(added[:half], added[half:]):
        cache.append(k, v)
    return out


def new_ttt_cache():
    from models.attention import TTTCache  # lazily: models/ may pull in optional attention kernels

    return TTTCache()


def unroll(drafter: nn.Module, batch: Batch, settings: TTTSettings, hidden: Tensor | None = None) -> list[Tensor]:
    """Run the K TTT steps; returns each step's drafter output a^{(k)} [B, T, H].

    `hidden`: the step-0 feature stream [B, T, H]; None = drafter.fuse(batch.taps) (EAGLE-3).
    A slice (`owned_span`) runs its T = owned positions only, at their global RoPE positions."""
    ids = batch.input_ids
    start, T = owned_span(batch)
    B = ids.shape[0]
    if hidden is None:
        hidden = drafter.fuse(batch.taps[:, :T].to(_float_dtype(drafter)))
    pos = torch.arange(start, start + T, device=ids.device).expand(B, T)
    from models.eagle3 import next_input  # lazily, as new_ttt_cache

    cache = new_ttt_cache()
    outs = []
    for k in range(settings.steps):
        if k:
            hidden = next_input(drafter, outs[-1])
        outs.append(_forward_step(
            drafter, hidden, shifted_ids(ids, k + 1)[:, :T], pos + k, cache, settings.checkpoint_layer
        ))
    return outs


@torch.no_grad()
def greedy_drafts(drafter: nn.Module, batch: Batch, steps: int, chunk: int = 1024) -> Tensor:
    """int64 [B, steps, T]: the target id the drafter drafts greedily at TTT step k from position t, the inputs
    teacher-forced along the batch's tokens. Along a chain whose drafts the target accepted, that is exactly what
    chain drafting at T=0 proposes (the accepted drafts are the batch's tokens): train/rollout.py greedy_accepts
    turns it into a greedy rollout's verify cycles. The logits are taken `chunk` positions at a time."""
    was_training = drafter.training
    drafter.eval()
    try:
        hiddens = unroll(drafter, batch, TTTSettings(steps=steps))
    finally:
        drafter.train(was_training)
    out = torch.empty(batch.input_ids.shape[0], steps, hiddens[0].shape[1], dtype=torch.long,
                      device=batch.input_ids.device)
    for k, h in enumerate(hiddens):
        for a in range(0, h.shape[1], chunk):
            best = drafter.compute_logits(h[:, a : a + chunk]).argmax(-1)
            out[:, k, a : a + chunk] = drafter.draft_to_target(best)
    return out


def output_head(drafter: nn.Module) -> tuple[nn.Module, Tensor] | None:
    """(norm, lm_head weight) if drafter.compute_logits(h) is lm_head(norm(h)) with a bias-free lm_head."""
    from models.eagle3 import Eagle3Drafter  # lazily, as new_ttt_cache

    if getattr(type(drafter), "compute_logits", None) is not Eagle3Drafter.compute_logits:
        return None  # e.g. a subclass with other logits: only the autograd path knows them
    lm_head = drafter.lm_head
    if not isinstance(lm_head, nn.Linear) or lm_head.bias is not None:
        return None
    return drafter.norm, lm_head.weight


def unroll_terms(
    drafter: nn.Module, head: nn.Module, batch: Batch, settings: TTTSettings, scale: Tensor | None = None,
    teacher_targets: list | None = None, hidden: Tensor | None = None,
) -> dict[str, Tensor | None]:
    """Per-step sums and [K, N] masks; with the fused head and `scale` ([K] weights of the CE sums)
    also "loss" = Σ_k scale_k·ce_k, the differentiable output (else "loss" is None: use "ce").
    "rows": each step's drafter outputs at the target rows ([N, H] per step), for extra loss terms."""
    maps = VocabMaps.from_drafter(drafter)
    b_idx, j_idx, reachable = target_rows(batch, settings.steps)
    hiddens = unroll(drafter, batch, settings, hidden)
    owned = owned_span(batch)[1]
    rows = [h[b_idx, (j_idx - k - 1).clamp(0, owned - 1)] for k, h in enumerate(hiddens)]  # [N, H] per step
    del hiddens
    teacher = gather_teacher(batch, b_idx, j_idx)
    parts = output_head(drafter) if settings.fused_head else None
    if parts is not None:
        loss, ce, acc, min_pq, valid, correct = fused_terms(
            *parts, rows, head, teacher, reachable, maps, settings.chunk_size, scale, teacher_targets, settings.accept
        )
        term = None
    else:
        loss = None
        ce, acc, min_pq, term, valid, correct = chunked_terms(
            drafter, head, rows, teacher, reachable, maps, settings.chunk_size, settings.checkpoint_chunks,
            settings.accept,
        )
    return dict(loss=loss, ce=ce, acc=acc, min_pq=min_pq, valid=valid, correct=correct, b_idx=b_idx, j_idx=j_idx,
                rows=rows, reachable=reachable, accept_term=term)


def _means(sums: dict[str, Tensor]) -> dict[str, Tensor]:
    n = sums["n_valid_k"].clamp_min(1).double()
    return {"loss_k": sums["ce_sum"] / n, "acc_k": sums["acc_sum"] / n, "min_pq_k": sums["min_pq_sum"] / n}


def ttt_loss(
    drafter: nn.Module,
    head: nn.Module,
    batch: Batch,
    settings: TTTSettings,
    normalizer: Tensor | None = None,
    teacher_targets: list | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The TTT loss of `batch` (normalisation: see the module docstring) and its metrics.

    `teacher_targets`: what `count_valid(..., return_targets=True)` computed for this batch (fused head only).

    metrics (detached tensors [K]): raw sums `ce_sum`, `acc_sum`, `min_pq_sum`, counts `n_valid_k`
    (add them over batches/ranks, or use `reduce_metrics`), and this batch's means `loss_k`, `acc_k`,
    `min_pq_k` (over its own valid positions), plus `weights` = decay^k.
    """
    device = batch.input_ids.device
    weights = settings.decay ** torch.arange(settings.steps, device=device, dtype=torch.float32)
    fused = settings.fused_head and output_head(drafter) is not None
    if fused and normalizer is None and torch.is_grad_enabled():
        # The fused head needs the step weights before its forward; a trainer passes its all-reduced
        # counts, anyone else pays this extra teacher-argmax pass.
        normalizer = count_valid(head, batch, settings, VocabMaps.from_drafter(drafter))
    scale = None if normalizer is None else weights / normalizer.to(device).clamp_min(1).to(weights.dtype)
    t = unroll_terms(drafter, head, batch, settings, scale, teacher_targets if fused else None)
    ce = t["ce"]
    n_valid = t["valid"].sum(-1)
    loss = t["loss"]
    if loss is None:
        norm = (n_valid if normalizer is None else normalizer.to(ce.device)).clamp_min(1).to(ce.dtype)
        objective = ce + settings.accept.weight * t["accept_term"] if settings.accept.active else ce
        loss = (weights * objective / norm).sum()
    sums = {
        "ce_sum": ce.detach().double(),
        "acc_sum": t["acc"],
        "min_pq_sum": t["min_pq"],
        "n_valid_k": n_valid,
    }
    return loss, {**sums, **_means(sums), "weights": weights.detach()}


def reduce_metrics(metrics: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Exact aggregate of `ttt_loss` metrics over batches (or gathered ranks): sums added, means redone."""
    sums = {k: torch.stack([m[k].to(metrics[0][k].device) for m in metrics]).sum(0) for k in SUM_KEYS}
    out = {**sums, **_means(sums)}
    if "weights" in metrics[0]:
        out["weights"] = metrics[0]["weights"]
        out["loss"] = (out["weights"].double() * out["loss_k"]).sum()
    return out


@torch.no_grad()
def count_valid(
    head: nn.Module, batch: Batch, settings: TTTSettings, vocab: VocabMaps | nn.Module | None = None,
    return_targets: bool = False, cache: TeacherCache | None = None,
):
    """This batch's number of valid positions per TTT step, int64 [K] (teacher argmax only, no drafter).

    `vocab`: the drafter (or its VocabMaps), whose t2d decides "argmax in the draft vocab"; None uses
    `head.d2t` / `head.t2d`. Cost: for the "hidden" teacher, one chunked full-vocab head matmul.
    With `return_targets`, returns (counts, targets): the per-chunk teacher targets for `ttt_loss`
    when they fit in settings.teacher_cache_mb (else None), so the loss does not redo that matmul.
    `cache` (exact teacher, sample ids known): rows computed in an earlier epoch are taken from it.
    """
    if vocab is None:
        vocab = head
    maps = vocab if isinstance(vocab, VocabMaps) else VocabMaps.from_drafter(vocab)
    b_idx, j_idx, reachable = target_rows(batch, settings.steps)
    teacher = gather_teacher(batch, b_idx, j_idx)
    chunks = teacher.split(settings.chunk_size)
    fits = b_idx.numel() * maps.draft_to_target.numel() * 8 <= settings.teacher_cache_mb * 2**20
    if return_targets and fits and cache is not None and teacher.kind == "hidden" and batch.sample_ids is not None:
        rows = cached_draft_logits(cache, head, batch, b_idx, j_idx, maps, settings.chunk_size)
        n = settings.chunk_size
        targets = [DraftLogits(rows.argmax[i:i + n], rows.cols[i:i + n], rows.lse[i:i + n]).target(maps)
                   for i in range(0, max(b_idx.numel(), 1), n)]
        in_vocab = torch.cat([t.in_vocab for t in targets])
    elif return_targets and fits:
        targets = [teacher_target(head, r, maps) for r in chunks]
        in_vocab = torch.cat([t.in_vocab for t in targets])
    else:
        targets = None
        in_vocab = torch.cat([maps.t2d[teacher_argmax(head, r)] for r in chunks])
    counts = (reachable & in_vocab).sum(-1)
    return (counts, targets) if return_targets else counts


def simulated_tau(acc: Sequence[float]) -> float:
    """1 + Σ_{n=1..K} Π_{j<n} acc_j (docs/method.md §6; the 1 is the bonus token)."""
    tau, prod = 1.0, 1.0
    for a in acc:
        prod *= float(a)
        tau += prod
    return tau


def _chain_counts(valid: Tensor, correct: Tensor, b_idx: Tensor, j_idx: Tensor, shape: tuple[int, int]):
    """Per start position t, follow its chain (t, k) -> target j = t+k+1; count for alpha_k.

    den_k: chains whose steps 0..k are valid and 0..k-1 correct; num_k: of those, step k correct too.
    """
    K = valid.shape[0]
    B, T = shape
    # A slice's halo rows lie past T + K (unreachable, so all invalid) when its halo exceeds K + 1.
    width = max(T + K + 1, int(j_idx.max()) + 1 if j_idx.numel() else 0)
    dense_v = torch.zeros(K, B, width, dtype=torch.bool, device=valid.device)
    dense_c = torch.zeros_like(dense_v)
    dense_v[:, b_idx, j_idx] = valid
    dense_c[:, b_idx, j_idx] = correct
    alive = torch.ones(B, T, dtype=torch.bool, device=valid.device)
    num, den = torch.zeros(K, dtype=torch.long), torch.zeros(K, dtype=torch.long)
    for k in range(K):
        v_k, c_k = dense_v[k, :, k + 1 : k + 1 + T], dense_c[k, :, k + 1 : k + 1 + T]  # indexed by t
        den[k] = (alive & v_k).sum().cpu()
        alive = alive & v_k & c_k
        num[k] = alive.sum().cpu()
    return num, den


@torch.no_grad()
def eval_sums(
    drafter: nn.Module, head: nn.Module, batches: Iterable[Batch], settings: TTTSettings,
    step0: Callable[[Batch], Tensor] | None = None,
) -> dict:
    """Raw, additive evaluation counts (CPU tensors [K]); add over ranks, then `summarize`.
    `step0(batch)`: the step-0 feature stream when it is not drafter.fuse(taps) (see `unroll`).

    `n_target_k` counts every (position, step) a user would count: the loss-masked target tokens step k
    reaches, whether or not the target's argmax is in the draft vocabulary; `n_valid_k` those in it (the
    loss's rows). A row outside the draft vocabulary can never be drafted: it is a miss in acc_k and
    ends its chain in alpha_k."""
    K = settings.steps
    device = next(drafter.parameters()).device
    out = {k: torch.zeros(K, dtype=torch.float64) for k in ("ce_sum", "acc_sum", "min_pq_sum")}
    out.update({k: torch.zeros(K, dtype=torch.long) for k in ("n_valid_k", "n_target_k", "alpha_num", "alpha_den")})
    out["num_samples"] = torch.zeros((), dtype=torch.long)
    was_training = drafter.training
    drafter.eval()
    try:
        for batch in batches:
            batch = batch.to(device)
            t = unroll_terms(drafter, head, batch, settings, hidden=None if step0 is None else step0(batch))
            start, owned = owned_span(batch)
            reachable = t["reachable"]
            num, den = _chain_counts(reachable, t["correct"], t["b_idx"], t["j_idx"], (len(batch), owned))
            out["ce_sum"] += t["ce"].double().cpu()
            out["acc_sum"] += t["acc"].cpu()
            out["min_pq_sum"] += t["min_pq"].cpu()
            out["n_valid_k"] += t["valid"].sum(-1).cpu()
            out["n_target_k"] += reachable.sum(-1).cpu()
            out["alpha_num"] += num
            out["alpha_den"] += den
            if start == 0:  # a sample split over ranks counts once, on the rank owning its start
                out["num_samples"] += int(batch.valid.any(1).sum())  # a blank row (train/data.py) is no sample
    finally:
        drafter.train(was_training)
    return out


def _nan_where_zero(count: Tensor) -> Tensor:
    # A step with no valid position has no accuracy: NaN, not a misleading 0.
    count = count.double()
    return torch.where(count > 0, count, torch.nan)


def summarize(sums: dict) -> dict:
    """Floats from `eval_sums` counts.

    acc_k: marginal teacher-forced accuracy of step k over ALL its target rows (`n_target_k`): a row whose
    target argmax lies outside the draft vocabulary counts as a miss. alpha_k: conditional per-position
    acceptance along each start position's chain (see `_chain_counts`), an out-of-vocabulary row ending
    the chain. sim_tau uses the MARGINAL acc_k, as docs/method.md §6 defines simulated τ; sim_tau_alpha is the
    same formula on alpha_k (= 1 + Σ_n P(first n drafts all accepted), closer to what chain decoding at
    T=0 sees). oov_rate: the share of step-0 target rows outside the draft vocabulary. loss_k and
    min_pq_k are over the in-vocabulary rows (`n_valid_k`, the rows the loss trains), and
    acc_in_vocab_k is acc_k over those rows only (the optimistic figure, for comparison).
    A step without target rows (or chains) gets NaN.
    """
    n = _nan_where_zero(sums["n_valid_k"])
    n_all = _nan_where_zero(sums["n_target_k"])
    acc = (sums["acc_sum"] / n_all).tolist()
    alpha = (sums["alpha_num"].double() / _nan_where_zero(sums["alpha_den"])).tolist()
    return {
        "acc_k": acc,
        "alpha_k": alpha,
        "sim_tau": simulated_tau(acc),
        "sim_tau_alpha": simulated_tau(alpha),
        "oov_rate": float(1 - sums["n_valid_k"][0].double() / n_all[0]),
        "acc_in_vocab_k": (sums["acc_sum"] / n).tolist(),
        "loss_k": (sums["ce_sum"] / n).tolist(),
        "min_pq_k": (sums["min_pq_sum"] / n).tolist(),
        "n_valid_k": sums["n_valid_k"].tolist(),
        "n_target_k": sums["n_target_k"].tolist(),
        "num_samples": int(sums["num_samples"]),
        "num_positions": int(sums["n_target_k"][0]),
    }


def evaluate(drafter: nn.Module, head: nn.Module, batches: Iterable[Batch], settings: TTTSettings) -> dict:
    """Teacher-forced TTT evaluation (no grad): acc_k, alpha_k, sim_tau, loss_k, min_pq_k, counts."""
    return summarize(eval_sums(drafter, head, batches, settings))
