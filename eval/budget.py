"""The verify budget m (drafted nodes verified per step) from the target's own timings (docs/method.md §3).

Speculation pays while verifying m + 1 tokens costs about one decode step. On a GPU that holds for
dozens of tokens; on a CPU the m-token forward is a matrix-matrix product and grows much sooner.
Two ways to use the timings: `choose_total_tokens` fixes one m before decoding (the best predicted speedup
from verify costs timed at the context decoding reaches and the drafter's acceptance on a probe, m = 0 plain
decoding included); `AdaptiveBudget` picks m every cycle from the drafted tree's own probabilities and a cost
model (`VerifyCost` + the cycle's measured overhead), down to m = 0 (a plain step) when no draft is worth it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from eval.target import TargetRunner
from eval.tree import DraftTree


@torch.no_grad()
def time_verify_forward(
    target: TargetRunner, block: int, context_len: int = 128, repeats: int = 3, seed: int = 0
) -> float:
    """Median seconds of a `block`-token forward (with a 4D mask and taps, like a verify step) after a
    `context_len`-token prefix."""
    vocab = int(target.model.config.get_text_config().vocab_size)
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (context_len,), generator=gen).tolist()
    cache = target.new_cache()
    target.forward(prefix, cache, want_taps=False)
    ids = torch.randint(0, vocab, (block,), generator=gen)
    allowed = torch.ones(block, context_len + block, dtype=torch.bool).tril(context_len)
    pos = torch.arange(context_len, context_len + block)
    times = []
    for _ in range(repeats + 1):  # the first run warms kernels up and is dropped
        if target.device.type == "cuda":
            torch.cuda.synchronize(target.device)
        t0 = time.perf_counter()
        target.forward(ids, cache, pos, allowed)
        if target.device.type == "cuda":
            torch.cuda.synchronize(target.device)
        times.append(time.perf_counter() - t0)
        cache.crop(-block)
    times = sorted(times[1:])
    return times[len(times) // 2]


# A cycle's target forward for candidate m, in seconds: m = 0 the plain step, m >= 1 the verify of m + 1 tokens.
# `ForwardTimer` times the real target; tests script it.
Timer = Callable[[int], float]

# Interleaved timing passes per candidate: a median of 5 outlives two spikes in any candidate's column.
AUTO_PASSES = 5


class ForwardTimer:
    """One target forward per call, after a `context_len`-token prefix kept in a cache (the context decoding
    reaches): m = 0 is plain decoding's step (1 token, causal, no taps, the last logits), m >= 1 a verify forward of
    m + 1 tokens with a 4D mask and the drafter's taps, as SpeculativeDecoder runs them."""

    def __init__(self, target: TargetRunner, context_len: int, seed: int = 0) -> None:
        self.target, self.context_len = target, context_len
        self.vocab = int(target.model.config.get_text_config().vocab_size)
        self.gen = torch.Generator().manual_seed(seed)
        self.cache = target.new_cache()
        target.forward(torch.randint(0, self.vocab, (context_len,), generator=self.gen).tolist(), self.cache,
                       want_taps=False, last_logits_only=True)

    @torch.no_grad()
    def __call__(self, m: int) -> float:
        n, ctx, target = m + 1, self.context_len, self.target
        ids = torch.randint(0, self.vocab, (n,), generator=self.gen)
        if m:
            allowed = torch.ones(n, ctx + n, dtype=torch.bool).tril(ctx)  # a chain: same shapes as any tree's mask
            pos = torch.arange(ctx, ctx + n)
        cuda = target.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(target.device)
        t0 = time.perf_counter()
        if m:
            target.forward(ids, self.cache, pos, allowed)
        else:
            target.forward(ids, self.cache, want_taps=False, last_logits_only=True)
        if cuda:
            torch.cuda.synchronize(target.device)
        seconds = time.perf_counter() - t0
        self.cache.crop(-n)
        return seconds


def interleaved_costs(timer: Timer, candidates: Sequence[int], passes: int = AUTO_PASSES) -> dict[int, float]:
    """Median seconds per candidate (m = 0, the plain step, always among them) of `passes` timings taken round-robin:
    every shape is run once untimed first (first-call costs: allocator, kernel choice), then each pass times every
    shape once, starting one shape later than the pass before. A load spike on the machine then lands in one
    sample of several shapes rather than in all samples of one, and the median drops it."""
    shapes = sorted({0, *candidates})
    for m in shapes:
        timer(m)
    samples: dict[int, list[float]] = {m: [] for m in shapes}
    for p in range(passes):
        for i in range(len(shapes)):
            m = shapes[(p + i) % len(shapes)]
            samples[m].append(timer(m))
    return {m: statistics.median(s) for m, s in samples.items()}


def decode_context_len(prompt_lens: Sequence[int], max_new_tokens: int) -> int:
    """The context a verify forward sees on average while decoding these prompts: a turn's verifies run after its
    prompt and 0 … max_new_tokens generated tokens, and a forward's cost grows about linearly with its context, so
    the mean prompt length plus half the generation budget stands for all of them."""
    return round(sum(prompt_lens) / len(prompt_lens) + max_new_tokens / 2) if prompt_lens else max_new_tokens // 2


@dataclass
class TreeProbe:
    """The drafter's acceptance at every candidate m, read off cycles decoded with the largest tree M.

    A tree of budget m is the best m nodes of the same drafted tree (eval/drafting.py draft_tree; a child never
    outranks its parent, so they form a connected tree). Greedy verification follows the target's argmax from the
    root; in the best-m tree it follows the same path as long as the path's nodes rank among the best m, and stops
    at the first that does not. So the drafts accepted at m are the leading nodes of the M-tree's accepted path
    ranked below m: exact per cycle for greedy decoding; at T > 0 the fewer siblings of a smaller tree change the
    rejection sampling's odds, and this reads them as at M."""

    ranks: list[list[int]] = field(default_factory=list)  # per cycle: the accepted path's ranks (0 = best node)
    largest: int = 0  # the m the probe decoded with

    def record(self, tree: DraftTree, path: list[int]) -> None:
        """SpeculativeDecoder's per-cycle hook: the verified tree and the accepted block indices (root first)."""
        order = torch.sort(-tree.values[1:], stable=True).indices  # keep_best's ranking: ties to the earlier node
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        self.ranks.append([int(rank[i - 1]) for i in path[1:]])

    @property
    def cycles(self) -> int:
        return len(self.ranks)

    def accepted(self, m: int) -> list[int]:
        """Per cycle, the drafts a best-m tree accepts."""
        out = []
        for ranks in self.ranks:
            k = 0
            while k < len(ranks) and ranks[k] < m:
                k += 1
            out.append(k)
        return out

    def tau(self, m: int) -> float:
        """Tokens a cycle emits at m (accepted drafts + the bonus token), mean over the probe's cycles."""
        acc = self.accepted(m)
        return 1.0 + sum(acc) / len(acc) if acc else 1.0

    def alpha(self, m: int, depth: int) -> list[float | None]:
        """α_n at m, n = 0 … depth − 1: P(the depth-n draft accepted | every draft before it accepted); None where
        no cycle reached depth n (as eval/metrics.py per_position_acceptance)."""
        acc = self.accepted(m)
        return [(sum(a > n for a in acc) / reached) if (reached := sum(a >= n for a in acc)) else None
                for n in range(depth)]


@dataclass
class CycleOverhead:
    """Our decoder's time per cycle outside its verify forward, measured on the probe's tree of M: drafting, and the
    rest (mask, acceptance, KV cut, the drafter's catch-up, bookkeeping). Drafting a tree of m runs
    min(depth, m) − 1 level forwards after the root's logits (no level deeper than m can hold one of the best m
    nodes), so its time is scaled by min(depth, m) of the probe's min(depth, M); the rest does not depend on m.
    m = 0 is plain decoding: no cycle, no overhead."""

    draft_s: float
    other_s: float
    depth: int
    largest: int

    @classmethod
    def from_records(cls, records, depth: int, largest: int) -> CycleOverhead:
        cycles = sum(r.verify_forwards for r in records)
        draft = sum(r.phase_s.get("draft", 0.0) for r in records)
        outside = sum(r.time_s - r.phase_s.get("prefill", 0.0) - r.phase_s.get("verify", 0.0) for r in records)
        return cls(draft / cycles if cycles else 0.0, max(0.0, outside - draft) / cycles if cycles else 0.0,
                   depth, largest)

    def __call__(self, m: int) -> float:
        if m == 0:
            return 0.0
        return self.other_s + self.draft_s * min(self.depth, m) / min(self.depth, self.largest)


# The rule `choose_total_tokens` applies, as the report states it.
CHOICE_DEFINITION = (
    "predicted_speedup(m) = tau(m) · T(0) / (T(m) + overhead(m)): what a cycle emits over what it costs in plain "
    "steps. T(0) = the plain step (1 token, no mask, no taps), T(m) = the verify forward of m + 1 tokens (mask and "
    "taps), each the median of interleaved passes after context_len tokens (mean prompt + half of max_new_tokens); "
    "tau(m) = 1 + the drafts a tree of the best m nodes accepts per cycle, read off the probe's cycles at the "
    "largest candidate; overhead(m) = our decoder's time per cycle outside the verify forward on the probe, its "
    "drafting scaled by min(depth, m). m = 0 is plain decoding (speedup 1); the best predicted speedup is chosen, "
    "the smaller m on a tie")


@dataclass
class TotalTokensChoice:
    """The verify budget m `choose_total_tokens` picked, every candidate's predicted speedup, and what they came
    from."""

    chosen: int
    candidates: list[dict]  # per m ascending, 0 first: m, verify_cost (s), tau, overhead_s, predicted_speedup
    context_len: int
    passes: int
    probe: dict  # what the acceptance was read from: the probe's m, prompts, cycles

    @property
    def timings(self) -> dict[int, float]:
        """m -> seconds of the cycle's target forward (0: the plain step)."""
        return {c["m"]: c["verify_cost"] for c in self.candidates}

    @property
    def reason(self) -> str:
        shown = ", ".join(f"m={c['m']} {c['predicted_speedup']:.2f}x" + (f" (τ {c['tau']:.2f})" if c["m"] else "")
                          for c in self.candidates)
        what = "plain decoding: no candidate is predicted to pay" if self.chosen == 0 else "the best predicted speedup"
        return (f"m={self.chosen}, {what} ({shown}; verify costs at {self.context_len} tokens of context, "
                f"acceptance from {self.probe['cycles']} probe cycles at m={self.probe['m']})")

    def to_dict(self) -> dict:
        return {"chosen": self.chosen, "candidates": self.candidates, "context_len": self.context_len,
                "passes": self.passes, "probe": self.probe, "reason": self.reason, "definition": CHOICE_DEFINITION}


def choose_total_tokens(costs: dict[int, float], tau: Callable[[int], float], overhead: Callable[[int], float],
                        context_len: int, passes: int = AUTO_PASSES, probe: dict | None = None) -> TotalTokensChoice:
    """The candidate m (costs' keys, 0 = plain decoding among them) of the best predicted speedup
    (CHOICE_DEFINITION): τ(m) tokens a cycle emits over the cycle's cost in plain steps, T(0) / (T(m) +
    overhead(m)). Every candidate is weighed, so a cheap m above a costly one (timings that are not monotone)
    competes on its own figures; ties go to the smaller m."""
    if 0 not in costs or costs[0] <= 0:
        raise ValueError(f"need the plain step's time (m = 0) and positive times, got {costs}")
    rows = []
    for m in sorted(costs):
        t = tau(m) if m else 1.0
        speedup = 1.0 if m == 0 else t * costs[0] / (costs[m] + overhead(m))
        rows.append({"m": m, "verify_cost": costs[m], "tau": t, "overhead_s": overhead(m), "predicted_speedup": speedup})
    best = max(rows, key=lambda r: (r["predicted_speedup"], -r["m"]))
    return TotalTokensChoice(best["m"], rows, context_len, passes, probe or {})


# Block sizes timed for the cost model (root + drafts); linear in between, the last slope beyond.
VERIFY_SIZES = (1, 2, 3, 5, 9, 17, 33, 61)


@dataclass
class VerifyCost:
    """Seconds of a verify forward of n tokens (the root + n − 1 drafts), linear between measured sizes."""

    seconds: dict[int, float]  # block size -> seconds; holds 1 and at least one more size

    def __post_init__(self) -> None:
        if 1 not in self.seconds or len(self.seconds) < 2:
            raise ValueError(f"need the 1-token time and one more size, got sizes {sorted(self.seconds)}")
        if min(self.seconds.values()) <= 0:
            raise ValueError(f"verify times must be positive, got {self.seconds}")
        self._points = sorted(self.seconds.items())

    def __call__(self, n: int) -> float:
        pts = self._points
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if n <= n1:
                return t0 + (t1 - t0) * (n - n0) / (n1 - n0)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) * (n - n1) / (n1 - n0)

    @classmethod
    def measure(cls, target: TargetRunner, max_block: int, context_len: int = 128, repeats: int = 3) -> VerifyCost:
        sizes = sorted({n for n in VERIFY_SIZES if n <= max_block} | {1, max(2, max_block)})
        time_verify_forward(target, 1, context_len, 1)  # first-call costs land here
        return cls({n: time_verify_forward(target, n, context_len, repeats) for n in sizes})


class AdaptiveBudget:
    """Per cycle, how many drafted nodes to verify: the best m by the drafter's path probability.

    A node is accepted only with its whole path, so keeping the best m nodes is expected to yield
    1 + c·V_m tokens, V_m = Σ of their path probabilities exp(value) and c a calibration (accepted /
    predicted so far: the drafter's confidence is not the target's). The cycle costs `overhead` (drafting,
    masks, acceptance, caches: everything but the verify forward, measured) + verify(m + 1). m maximises
    the long-run rate (Dinkelbach's rule): (1 + c·V_m) − r·(overhead + verify(m + 1)), with r the rate so
    far. Starts from `prior_cycles` pseudo-cycles at c = 1, no overhead, the plain rate."""

    def __init__(self, verify: VerifyCost, prior_cycles: int = 4) -> None:
        self.verify = verify
        self.predicted = self.accepted = float(prior_cycles)  # calibration c = accepted / predicted
        self.tokens, self.seconds = float(prior_cycles), prior_cycles * verify(1)  # rate r = tokens / seconds
        self.overhead_s, self.cycles = 0.0, 0
        self.draft_s, self.draft_forwards = 0.0, 0  # drafter forwards after the root's, and their time
        self.log: list[dict[str, float]] = []  # per cycle: m, predicted and accepted drafts, seconds
        self._verify_s = torch.zeros(0, dtype=torch.float64)  # verify(m + 1) for m = 0.., grown on demand

    @property
    def calibration(self) -> float:
        return self.accepted / self.predicted

    @property
    def overhead(self) -> float:
        return self.overhead_s / self.cycles if self.cycles else 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    def worth_expanding(self, path_prob: float) -> bool:
        """One more drafter forward (a tree level, a chain step) below nodes of summed path probability
        `path_prob`: what their children can add is at most c·path_prob tokens, against the forward's
        measured time at the current rate (nothing is known before the first forward: expand)."""
        if not self.draft_forwards:
            return True
        return self.calibration * path_prob > self.rate * self.draft_s / self.draft_forwards

    def choose(self, values: Tensor) -> tuple[int, float]:
        """(m, predicted accepted drafts c·V_m) for a tree whose drafted nodes have these path log-probs."""
        probs = torch.sort(values.double().exp(), descending=True).values
        gains = torch.cat([torch.zeros(1, dtype=torch.float64), probs.cumsum(0)]) * self.calibration
        n = gains.numel()
        if self._verify_s.numel() < n:  # once per tree size, not per cycle
            self._verify_s = torch.tensor([self.verify(m + 1) for m in range(n)], dtype=torch.float64)
        costs = self.overhead + self._verify_s[:n]
        m = int(torch.argmax(1.0 + gains - self.rate * costs))  # first maximum: the smaller tree on ties
        return m, float(gains[m])

    def observe(self, m: int, predicted: float, accepted: int, cycle_s: float, verify_s: float,
                draft_s: float = 0.0, draft_forwards: int = 0, drafted: int | None = None) -> None:
        """What the chosen cycle did: its accepted drafts, its wall time (verify forward included) and its
        drafting's time and forwards after the root's."""
        if draft_forwards:
            self.draft_s += draft_s
            self.draft_forwards += draft_forwards
        c = self.calibration
        self.predicted += predicted / c if c > 0 else 0.0  # the raw drafter probabilities, not calibrated ones
        self.accepted += accepted
        self.tokens += 1 + accepted
        self.seconds += cycle_s
        self.overhead_s += max(0.0, cycle_s - verify_s)
        self.cycles += 1
        self.log.append({"m": m, "predicted": predicted, "accepted": accepted, "cycle_s": cycle_s,
                         "draft_forwards": draft_forwards, "drafted": m if drafted is None else drafted})

    def summary(self) -> dict[str, float]:
        """Predicted against measured, over the cycles seen: τ, tokens/s and the mean m."""
        if not self.log:
            return {}
        n = len(self.log)
        pred_tokens = sum(1 + c["predicted"] for c in self.log)
        pred_s = sum(self.overhead + self.verify(int(c["m"]) + 1) for c in self.log)
        got_tokens = sum(1 + c["accepted"] for c in self.log)
        got_s = sum(c["cycle_s"] for c in self.log)
        return {
            "cycles": n,
            "mean_m": sum(c["m"] for c in self.log) / n,
            "mean_draft_forwards": sum(c["draft_forwards"] for c in self.log) / n,
            "share_m0": sum(c["m"] == 0 for c in self.log) / n,
            "calibration": self.calibration,
            "tau_predicted": pred_tokens / n,
            "tau_measured": got_tokens / n,
            "tokens_per_s_predicted": pred_tokens / pred_s if pred_s > 0 else math.nan,
            "tokens_per_s_measured": got_tokens / got_s if got_s > 0 else math.nan,
            "plain_tokens_per_s_predicted": 1.0 / self.verify(1),
        }


@dataclass
class CycleCost:
    """What a speculative cycle costs, measured: target forwards of n tokens (with the verify's mask and taps) and
    the decoder's time per cycle outside its verify forward (drafting, masks, acceptance, caches, bookkeeping)."""

    forward_s: dict[int, float]  # n tokens -> median seconds, after a context_len-token prefix
    overhead_s: float  # per verify cycle, from the speculative records
    context_len: int = 128

    @classmethod
    def measure(cls, target: TargetRunner, sizes: list[int], records) -> CycleCost:
        """The forwards timed after the context the records' verifies saw on average: each record's prompt and
        half its output (decode_context_len's reasoning, on what was decoded)."""
        ctx = (round(sum(r.prompt_len + len(r.output_ids) / 2 for r in records) / len(records)) if records
               else 128)
        time_verify_forward(target, 1, ctx, 1)  # first-call costs land here
        forward = {n: time_verify_forward(target, n, ctx, 3) for n in sorted({1, *sizes})}
        cycles = sum(r.verify_forwards for r in records)
        outside = sum(r.time_s - r.phase_s.get("prefill", 0.0) - r.phase_s.get("verify", 0.0) for r in records)
        return cls(forward, outside / cycles if cycles else 0.0, ctx)

    def predicted_speedup(self, tau: float | None, block: int, concurrency: int = 1,
                          drafting: bool = True) -> float | None:
        """τ tokens per cycle over the cycle's cost in plain steps, with c sequences in flight: τ · T(c) /
        (T(c · block) + overhead · T(c) / T(1)), T(n) the measured forward of n tokens (one sequence of c · block
        tokens standing for c sequences of block), our decoder's overhead the same number of plain steps at every
        c; drafting=False leaves the overhead out (an engine's drafting is not ours: the verify cost alone)."""
        if tau is None or tau != tau or concurrency not in self.forward_s or concurrency * block not in self.forward_s:
            return None
        t_c = self.forward_s[concurrency]
        overhead = self.overhead_s * t_c / self.forward_s[1] if drafting else 0.0
        return tau * t_c / (self.forward_s[concurrency * block] + overhead)

    def to_dict(self) -> dict:
        return {"forward_s": {str(n): s for n, s in self.forward_s.items()}, "overhead_s": self.overhead_s,
                "context_len": self.context_len,
                "definition": "speedup_predicted = τ · T(c) / (T(c · (m + 1)) + overhead · T(c) / T(1)); T(n) = "
                              "median target forward of n tokens with the verify's mask and taps after a "
                              "context_len-token prefix (the mean prompt + half the output decoded); overhead = our decoder's time per cycle outside its verify forward "
                              "(left out for the engine under load: τ · T(c) / T(c · (m + 1)))"}
