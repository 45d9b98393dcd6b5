"""The acceptance metrics of docs/method.md §6, defined once.

A verify forward that accepts a draft tokens emits a + 1 tokens (the bonus token counts). The prefill
forward (which emits the first token without any draft) and the cut at max_new_tokens / EOS are not
acceptance events, so τ is computed from the per-step accepted lengths:
- tau_pooled = Σ_steps (a + 1) / number of verify forwards, over all requests;
- tau_per_request_mean = mean over requests of that ratio (labelled separately: short requests weigh
  as much as long ones).
- α_n = accepted at draft depth n / attempted at depth n, attempted = every draft before it accepted.
- oov_rate = share of the emitted tokens (every output token, prefill's included) that lie outside
  the drafter's vocabulary (t2d False): tokens the drafter can never propose.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eval.spec_decode import GenerationRecord


def tau_of(accept_lengths: Sequence[int]) -> float:
    if not accept_lengths:
        return float("nan")
    return (sum(accept_lengths) + len(accept_lengths)) / len(accept_lengths)


def tau_pooled(records: Sequence[GenerationRecord]) -> float:
    steps = [a for r in records for a in r.accept_lengths]
    return tau_of(steps)


def tau_per_request_mean(records: Sequence[GenerationRecord]) -> float:
    taus = [tau_of(r.accept_lengths) for r in records if r.accept_lengths]
    return sum(taus) / len(taus) if taus else float("nan")


def per_position_acceptance(records: Sequence[GenerationRecord]) -> list[float | None]:
    """α_n for n = 0..depth-1; None where depth n was never attempted."""
    depth = max((len(r.depth_attempts) for r in records), default=0)
    att = [0] * depth
    acc = [0] * depth
    for r in records:
        for n, (a, c) in enumerate(zip(r.depth_attempts, r.depth_accepts)):
            att[n] += a
            acc[n] += c
    return [c / a if a else None for a, c in zip(att, acc)]


def accept_length_histogram(records: Sequence[GenerationRecord], depth: int | None = None) -> list[int]:
    """counts[a] = number of verify forwards that accepted exactly a draft tokens."""
    steps = [a for r in records for a in r.accept_lengths]
    size = max([*steps, (depth or 0)], default=0) + 1
    counts = [0] * size
    for a in steps:
        counts[a] += 1
    return counts


def summarize(records: Sequence[GenerationRecord], depth: int | None = None) -> dict:
    return {
        "tau_pooled": tau_pooled(records),
        "tau_per_request_mean": tau_per_request_mean(records),
        "per_position_acceptance": per_position_acceptance(records),
        "accept_length_histogram": accept_length_histogram(records, depth),
        "verify_forwards": sum(r.verify_forwards for r in records),
        "new_tokens": sum(len(r.output_ids) for r in records),
        "cycle_time_share": cycle_time_share(records),
    }


def cycle_time_share(records: Sequence[GenerationRecord]) -> dict[str, float]:
    """Share of the speculative requests' wall time spent in each phase (spec_decode.PHASES), the rest
    as "other" (the loop's bookkeeping); empty for plain decoding."""
    total = sum(r.time_s for r in records if r.phase_s)
    if total <= 0:
        return {}
    shares: dict[str, float] = {}
    for r in records:
        for phase, seconds in r.phase_s.items():
            shares[phase] = shares.get(phase, 0.0) + seconds / total
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def oov_rate(records: Sequence[GenerationRecord], t2d: torch.Tensor) -> float:
    """Share of emitted tokens outside the draft vocabulary (t2d: bool [V])."""
    ids = [i for r in records for i in r.output_ids]
    if not ids:
        return float("nan")
    return float((~t2d.cpu()[torch.tensor(ids, dtype=torch.long)]).double().mean())


def tokens_per_s(records: Sequence[GenerationRecord]) -> float:
    """Output tokens / the records' summed wall seconds; NaN (null in a report) without a measured second."""
    seconds = sum(r.time_s for r in records)
    return sum(len(r.output_ids) for r in records) / seconds if seconds > 0 else float("nan")
