"""Pick the verify budget m (tree total_tokens) by timing the target, as docs/method.md §3 asks.

Speculation pays while verifying m + 1 tokens costs about one decode step. On a GPU that holds for
dozens of tokens; on a CPU the m-token forward is a matrix-matrix product and grows much sooner.
"""

from __future__ import annotations

import time

import torch

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


def choose_total_tokens(
    target: TargetRunner,
    candidates: list[int],
    tolerance: float = 1.3,
    context_len: int = 128,
    repeats: int = 3,
) -> tuple[int, dict[int, float]]:
    """The largest candidate m whose (m + 1)-token verify forward takes <= tolerance x a 1-token forward.

    Returns (m, {m: seconds}); timings[0] is the 1-token reference. Falls back to the smallest candidate
    when none is within tolerance.
    """
    time_verify_forward(target, 1, context_len, 1)  # first-call costs (allocator, kernel setup) land here
    timings = {0: time_verify_forward(target, 1, context_len, repeats)}
    for m in sorted(set(candidates)):
        timings[m] = time_verify_forward(target, m + 1, context_len, repeats)
    fitting = [m for m in sorted(set(candidates)) if timings[m] <= tolerance * timings[0]]
    return (max(fitting) if fitting else min(candidates)), timings
