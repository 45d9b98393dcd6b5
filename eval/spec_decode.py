"""Speculative decoding on token ids (an EAGLE-3 or DFlash drafter + HF target), and the plain baseline.

Batch 1, knows nothing about tokenization. One step = draft (EAGLE: chain or dynamic tree; DFlash: one
block) -> ONE target forward over [root | drafted nodes] with a tree mask -> accept a path (greedy or
lossless sampling, eval/sampling.py) -> keep only the accepted path's K/V -> feed the accepted tokens'
target features to the drafter. How the drafter drafts and keeps its cache is a strategy
(eval/drafting.py `make_strategy`). Output is cut at max_new_tokens / EOS exactly where plain decoding
would stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from eval import sampling
from eval.drafting import make_strategy
from eval.sampling import SamplingParams
from eval.target import TargetRunner, keep_kv
from eval.tree import DraftTree, keep_best, tree_attention_allowed


@dataclass(frozen=True)
class SpecSettings:
    mode: str = "tree"  # "tree" | "chain"
    depth: int = 6  # tree levels = most draft tokens one step can accept (chain: K; DFlash: its block - 1)
    topk: int = 8  # tree only
    total_tokens: int = 60  # tree only: drafted nodes verified per step (the block is this + the root)
    sample_drafts: bool = False  # chain only, T > 0: draw drafts from the drafter (q) instead of its argmax

    def __post_init__(self) -> None:
        if self.mode not in ("tree", "chain"):
            raise ValueError(f"mode must be 'tree' or 'chain', got {self.mode!r}")
        if self.depth < 1 or self.topk < 1 or self.total_tokens < 1:
            raise ValueError("depth, topk and total_tokens must be >= 1")


@dataclass
class GenerationRecord:
    """One generate call. verify_forwards / accept_lengths / per-depth counts are empty for plain decoding."""

    prompt_len: int
    output_ids: list[int]
    stop_reason: str  # "eos" | "length"
    time_s: float
    target_forwards: int  # including the prefill
    accept_lengths: list[int] = field(default_factory=list)  # accepted DRAFT tokens per verify forward
    depth_attempts: list[int] = field(default_factory=list)  # [n]: steps that reached draft depth n
    depth_accepts: list[int] = field(default_factory=list)  # [n]: ... and accepted the draft at depth n
    # Wall seconds per phase of the speculative cycles (PHASES; the prefill is "prefill"); empty for plain.
    phase_s: dict[str, float] = field(default_factory=dict)
    # Plain decoding: per emitted token, the target's top-2 logit gap relative to max(1, |top-1 logit|).
    top2_gaps: list[float] = field(default_factory=list)

    @property
    def verify_forwards(self) -> int:
        return len(self.accept_lengths)


# In bf16 (or fp16) a verify forward over m tokens rounds otherwise than m one-token forwards (the CPU's and GPU's
# attention kernels block their sums by the number of queries and keys), so greedy outputs may part where the
# target's top two logits are this close, relative to max(1, |top-1 logit|); in fp32 they part nowhere. The GPU
# check holds bf16 decoding to the same bound (bench/gpu_check.py).
NEAR_TIE_RTOL = 2e-2


def relative_top2_gap(logits: Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1]) / max(1.0, abs(float(top[0])))


def first_difference(output_ids: list[int], plain: GenerationRecord) -> tuple[int, float | None] | None:
    """Where `output_ids` first parts from plain decoding's output, with the plain run's relative top-2 gap there
    (None where plain decoding emitted nothing there); None when the two are identical."""
    if output_ids == plain.output_ids:
        return None
    i = next((j for j, (a, b) in enumerate(zip(output_ids, plain.output_ids)) if a != b),
             min(len(output_ids), len(plain.output_ids)))
    return i, plain.top2_gaps[i] if i < len(plain.top2_gaps) else None


# Where a speculative cycle's time goes (bench/decode_profile.py): drafting, the tree mask, the verify
# forward, choosing the accepted path, cutting the target's KV cache, and feeding the drafter what was
# accepted; "other" is the loop's own bookkeeping (the rest of GenerationRecord.time_s).
PHASES = ("prefill", "draft", "mask", "verify", "accept", "kv", "commit")


class _PhaseClock:
    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.t = into, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.into[phase] = self.into.get(phase, 0.0) + now - self.t
        self.t = now


def _finish(out: list[int], new: list[int], max_new_tokens: int, eos: frozenset[int]) -> str | None:
    """Append `new` to `out`, stopping after an EOS or at the budget; return the stop reason if stopped."""
    for x in new:
        out.append(x)
        if x in eos:
            return "eos"
        if len(out) >= max_new_tokens:
            return "length"
    return None


@torch.no_grad()
def plain_generate(
    target: TargetRunner,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: tuple[int, ...] = (),
    generator: torch.Generator | None = None,
) -> GenerationRecord:
    """The baseline: one target forward per token, KV cache, the same token choice as speculation."""
    if max_new_tokens < 1 or not prompt_ids:
        raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
    t0 = time.perf_counter()
    eos = frozenset(eos_token_ids)
    cache = target.new_cache()
    out: list[int] = []
    gaps: list[float] = []
    logits = target.forward(prompt_ids, cache, want_taps=False, last_logits_only=True).logits[-1]
    forwards = 1
    while True:
        gaps.append(relative_top2_gap(logits))
        stop = _finish(out, [sampling.next_token(logits, params, generator)], max_new_tokens, eos)
        if stop:
            break
        logits = target.forward([out[-1]], cache, want_taps=False, last_logits_only=True).logits[-1]
        forwards += 1
    return GenerationRecord(len(prompt_ids), out, stop, time.perf_counter() - t0, forwards, top2_gaps=gaps)


def accept_path(
    tree: DraftTree, logits: Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Walk the verified tree from the root. Returns (accepted block indices incl. root 0, bonus token).

    Greedy: follow the child equal to the target's argmax. Sampling: at each node try its children with
    the lossless multi-candidate rule; the bonus comes from the (residual) target distribution.
    """
    children = tree.children()
    tokens = tree.tokens.tolist()
    path, cur = [0], 0
    while True:
        kids = children[cur]
        if params.greedy:
            best = int(logits[cur].argmax().item())
            nxt = next((c for c in kids if tokens[c] == best), None)
            if nxt is None:
                return path, best
        else:
            p = sampling.target_probs(logits[cur], params).cpu()
            if not kids:
                return path, sampling.sample(p, generator)
            qs = [tree.q[c] if tree.q is not None else None for c in kids]
            verdict = sampling.verify_candidates(p, [tokens[c] for c in kids], qs, generator)
            if verdict.accepted_child is None:
                return path, sampling.sample(verdict.residual, generator)
            nxt = kids[verdict.accepted_child]
        path.append(nxt)
        cur = nxt


class SpeculativeDecoder:
    """`budget` (eval/budget.py AdaptiveBudget): each cycle verifies only the drafted nodes its cost model
    expects to pay (possibly none); None verifies everything the strategy drafts."""

    def __init__(self, target: TargetRunner, drafter, settings: SpecSettings, budget=None):
        self.target = target
        self.drafter = drafter
        self.settings = settings
        self.budget = budget
        self.strategy = make_strategy(drafter, settings)
        if budget is not None and hasattr(self.strategy, "worth"):  # strategies that draft level by level
            self.strategy.worth = budget.worth_expanding
        self.target_cache = None  # kept after generate() so tests can compare it with a fresh prefill
        # called with every cycle's verified tree and accepted path (eval/budget.py TreeProbe reads the acceptance
        # of smaller trees off them); None: nothing
        self.on_cycle: Callable[[DraftTree, list[int]], None] | None = None

    @property
    def depth(self) -> int:
        """The most draft tokens one step can accept (the length of per-position acceptance)."""
        return self.strategy.depth

    @property
    def drafter_cache(self):
        """The drafter's KV cache after generate() (EAGLE: a DecodeCache; DFlash: a DFlashCache)."""
        return self.strategy.cache

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        generator: torch.Generator | None = None,
    ) -> GenerationRecord:
        if max_new_tokens < 1 or not prompt_ids:
            raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
        t0 = time.perf_counter()
        eos = frozenset(eos_token_ids)
        depth, strategy = self.depth, self.strategy
        rec = GenerationRecord(len(prompt_ids), [], "length", 0.0, 0, [], [0] * depth, [0] * depth)
        self.target_cache = cache = self.target.new_cache()
        clock = _PhaseClock(rec.phase_s)

        pre = self.target.forward(prompt_ids, cache, last_logits_only=True)
        rec.target_forwards += 1
        root = sampling.next_token(pre.logits[-1], params, generator)
        stop = _finish(rec.output_ids, [root], max_new_tokens, eos)
        n = len(prompt_ids)  # tokens in the target's KV cache; root sits at position n
        if stop is None:
            strategy.start(prompt_ids, pre.taps, root)
        clock.lap("prefill")
        while stop is None:
            cycle_t0 = time.perf_counter()
            tree = strategy.draft(root, n, params, generator)
            draft_s = time.perf_counter() - cycle_t0
            if self.budget is not None:
                drafted = len(tree) - 1
                m, predicted = self.budget.choose(tree.values[1:])
                tree = keep_best(tree, m)
            clock.lap("draft")
            allowed = tree_attention_allowed(tree.parents, n)
            clock.lap("mask")
            verify_t0 = time.perf_counter()
            ver = self.target.forward(tree.tokens, cache, tree.position_ids(n), allowed)
            verify_s = time.perf_counter() - verify_t0
            rec.target_forwards += 1
            clock.lap("verify")
            path, bonus = accept_path(tree, ver.logits, params, generator)
            self._count(rec, tree, path)
            if self.on_cycle is not None:
                self.on_cycle(tree, path)
            clock.lap("accept")
            keep_kv(cache, n, torch.tensor(path))
            clock.lap("kv")
            accepted = tree.tokens[path[1:]].tolist()
            stop = _finish(rec.output_ids, [*accepted, bonus], max_new_tokens, eos)
            if stop is None:
                strategy.commit(ver.taps[path], accepted, bonus, n)
                clock.lap("commit")
            if self.budget is not None:
                self.budget.observe(m, predicted, len(path) - 1, time.perf_counter() - cycle_t0, verify_s,
                                    draft_s, tree.draft_forwards, drafted)
            if stop is not None:
                break
            n += len(path)
            root = bonus
        rec.stop_reason = stop
        rec.time_s = time.perf_counter() - t0
        return rec

    @staticmethod
    def _count(rec: GenerationRecord, tree: DraftTree, path: list[int]) -> None:
        """Accepted length and per-depth attempts/accepts (depth n attempted iff the path reached a node
        with children at depth n, i.e. all drafts before it were accepted)."""
        rec.accept_lengths.append(len(path) - 1)
        children = tree.children()
        for n, node in enumerate(path):
            if n < len(rec.depth_attempts) and children[node]:
                rec.depth_attempts[n] += 1
                if n + 1 < len(path):
                    rec.depth_accepts[n] += 1


@torch.no_grad()
def chain_rollout(target_model, drafter, prompt_ids: list[int], max_new_tokens: int, depth: int,
                  temperature: float = 0.0, eos_token_ids: tuple[int, ...] = (),
                  generator: torch.Generator | None = None) -> GenerationRecord:
    """One rollout of the on-policy stage (train/on_policy.py, named by the family table): lossless speculative
    decoding of `prompt_ids` by `target_model` (an HF CausalLM) with chains of `depth` drafts of `drafter`, no
    adaptive budget, so every verify cycle proposes `depth` drafts and its accepted length says which it rejected."""
    decoder = SpeculativeDecoder(TargetRunner(target_model, drafter.tap_layers), drafter,
                                 SpecSettings(mode="chain", depth=depth))
    return decoder.generate(list(prompt_ids), max_new_tokens, SamplingParams(temperature=temperature),
                            eos_token_ids, generator)
