"""The verify budget m (drafted nodes verified per step) from the target's own timings (docs/method.md §3).

Speculation pays while verifying m + 1 tokens costs about one decode step. On a GPU that holds for
dozens of tokens; on a CPU the m-token forward is a matrix-matrix product and grows much sooner.
Two ways to use the timings: `choose_total_tokens` fixes one m before decoding (a tolerance on the verify
cost); `AdaptiveBudget` picks m every cycle from the drafted tree's own probabilities and a cost model
(`VerifyCost` + the cycle's measured overhead), down to m = 0 (a plain step) when no draft is worth it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from eval.target import TargetRunner


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


@dataclass
class BudgetChoice:
    """The verify budget m `choose_total_tokens` picked, the timings it picked it from, and why."""

    m: int
    timings: dict[int, float]  # m -> seconds of the (m + 1)-token forward; 0: the 1-token reference
    tolerance: float
    within_tolerance: bool  # False: nothing fitted, m is the smallest candidate
    not_monotonic: list[int]  # candidates that fitted again above one that did not (ignored as noise)
    reason: str

    def ratios(self) -> dict[int, float]:
        return {m: t / self.timings[0] for m, t in self.timings.items() if m}

    def to_dict(self) -> dict:
        return {"m": self.m, "tolerance": self.tolerance, "within_tolerance": self.within_tolerance,
                "cost_ratio": self.ratios(), "not_monotonic": self.not_monotonic, "reason": self.reason}


def pick_total_tokens(timings: dict[int, float], candidates: list[int], tolerance: float) -> BudgetChoice:
    """From ascending candidates, the largest m before the first whose verify forward takes more than `tolerance`
    x the 1-token forward (timings[0]). A verify forward does not get cheaper with more tokens, so a larger m
    that fits again after one that did not is noise in the timings: the cheaper size is kept, and named. When
    not even the smallest fits, it is chosen and the choice says so (tree decoding may not pay on this machine)."""
    sizes = sorted(set(candidates))
    ratio = {m: timings[m] / timings[0] for m in sizes}
    fits = [m for m in sizes if ratio[m] <= tolerance]
    prefix = []
    for m in sizes:
        if ratio[m] > tolerance:
            break
        prefix.append(m)
    shown = ", ".join(f"m={m} {ratio[m]:.2f}x" for m in sizes)
    if not prefix:
        m = sizes[0]
        return BudgetChoice(m, timings, tolerance, False, [], (
            f"m={m}, the smallest candidate: none is within the tolerance {tolerance}x of a 1-token forward "
            f"({shown}); tree decoding may not pay on this machine (try decode.mode=chain or decode.budget=adaptive, "
            f"or a larger decode.auto_tolerance)"))
    m = prefix[-1]
    noise = [c for c in fits if c > m]
    reason = f"m={m}, the largest candidate whose verify forward is within {tolerance}x of a 1-token forward ({shown})"
    if noise:
        over = sizes[len(prefix)]
        reason += (f"; {', '.join(f'm={c}' for c in noise)} fitted again above m={over}, which did not: timings not "
                   f"monotonic (noise), so the cheaper m={m} is kept")
    return BudgetChoice(m, timings, tolerance, True, noise, reason)


def choose_total_tokens(
    target: TargetRunner,
    candidates: list[int],
    tolerance: float = 1.3,
    context_len: int = 128,
    repeats: int = 3,
) -> BudgetChoice:
    """Time the (m + 1)-token verify forward of every candidate m against a 1-token forward and pick m
    (`pick_total_tokens`: the rule, and what it says about its choice)."""
    time_verify_forward(target, 1, context_len, 1)  # first-call costs (allocator, kernel setup) land here
    timings = {0: time_verify_forward(target, 1, context_len, repeats)}
    for m in sorted(set(candidates)):
        timings[m] = time_verify_forward(target, m + 1, context_len, repeats)
    return pick_total_tokens(timings, candidates, tolerance)


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

    forward_s: dict[int, float]  # n tokens -> median seconds, after a 128-token prefix
    overhead_s: float  # per verify cycle, from the speculative records

    @classmethod
    def measure(cls, target: TargetRunner, sizes: list[int], records) -> CycleCost:
        time_verify_forward(target, 1, 128, 1)  # first-call costs land here
        forward = {n: time_verify_forward(target, n, 128, 3) for n in sorted({1, *sizes})}
        cycles = sum(r.verify_forwards for r in records)
        outside = sum(r.time_s - r.phase_s.get("prefill", 0.0) - r.phase_s.get("verify", 0.0) for r in records)
        return cls(forward, outside / cycles if cycles else 0.0)

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
                "definition": "speedup_predicted = τ · T(c) / (T(c · (m + 1)) + overhead · T(c) / T(1)); T(n) = "
                              "median target forward of n tokens with the verify's mask and taps after a "
                              "128-token prefix; overhead = our decoder's time per cycle outside its verify forward "
                              "(left out for the engine under load: τ · T(c) / T(c · (m + 1)))"}
