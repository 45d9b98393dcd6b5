"""τ pooled vs per request, per-position acceptance, histogram and the report plots on hand-built records."""

from __future__ import annotations

import math

import pytest

from eval import metrics
from eval.spec_decode import GenerationRecord


def _rec(accepts: list[int], attempts: list[int], accepted: list[int], n_out: int) -> GenerationRecord:
    return GenerationRecord(prompt_len=5, output_ids=list(range(n_out)), stop_reason="length", time_s=1.0,
                            target_forwards=1 + len(accepts), accept_lengths=accepts,
                            depth_attempts=attempts, depth_accepts=accepted)


def _records() -> list[GenerationRecord]:
    # request A: 2 verify forwards accepting 3 and 1 drafts (emits 4 + 2) -> τ_A = 3.0
    # request B: 4 verify forwards accepting 0 each                        -> τ_B = 1.0
    a = _rec([3, 1], attempts=[2, 2, 1, 1], accepted=[2, 1, 1, 0], n_out=7)
    b = _rec([0, 0, 0, 0], attempts=[4, 0, 0, 0], accepted=[0, 0, 0, 0], n_out=5)
    return [a, b]


def test_tau_pooled_and_per_request_differ_as_defined() -> None:
    recs = _records()
    assert metrics.tau_pooled(recs) == (4 + 2 + 1 + 1 + 1 + 1) / 6  # 10 tokens / 6 verify forwards
    assert metrics.tau_per_request_mean(recs) == (3.0 + 1.0) / 2
    assert metrics.tau_of([]) != metrics.tau_of([])  # NaN: no verify step, no τ
    assert math.isnan(metrics.tau_pooled([]))


def test_per_position_acceptance_and_histogram() -> None:
    recs = _records()
    alpha = metrics.per_position_acceptance(recs)
    assert alpha == [2 / 6, 1 / 2, 1 / 1, 0 / 1]
    recs[1].depth_attempts = [4, 0, 0, 0, 0]  # deeper than any attempt -> None
    recs[1].depth_accepts = [0, 0, 0, 0, 0]
    assert metrics.per_position_acceptance(recs)[4] is None
    assert metrics.accept_length_histogram(recs) == [4, 1, 0, 1]
    assert metrics.accept_length_histogram(recs, depth=5) == [4, 1, 0, 1, 0, 0]
    s = metrics.summarize(recs, depth=5)
    assert s["verify_forwards"] == 6 and s["new_tokens"] == 12
    # consistency: mean accepted drafts = τ - 1
    assert math.isclose(sum(i * c for i, c in enumerate(s["accept_length_histogram"])) / 6, s["tau_pooled"] - 1)


def test_report_writer_and_plots(tmp_path) -> None:
    from eval.run import format_summary, write_report

    recs = _records()
    report = {
        "target": "t", "drafter": "d", "prompts": "p", "num_prompts": 2, "num_requests": 2,
        "decode": {"mode": "tree", "depth": 4, "topk": 2, "total_tokens": 8, "temperature": 0.0,
                   "max_new_tokens": 7},
        **metrics.summarize(recs, 4),
        "tokens_per_s": {"speculative": 20.0, "baseline": 10.0}, "speedup": 2.0, "samples": [],
    }
    path = write_report(report, tmp_path)
    assert path.exists()
    for name in ("per_position_acceptance.png", "accept_length_histogram.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = format_summary(report)
    assert "speedup=2.0" in text and "m=8" in text


def test_cycle_time_share_adds_up_to_one() -> None:
    recs = _records()
    assert metrics.cycle_time_share(recs) == {}  # no phase clocks: nothing to share out
    recs[0].time_s, recs[0].phase_s = 2.0, {"draft": 0.5, "verify": 1.0}
    recs[1].time_s, recs[1].phase_s = 2.0, {"draft": 0.5, "verify": 1.5, "kv": 0.25}
    share = metrics.cycle_time_share(recs)
    assert share == pytest.approx({"draft": 0.25, "verify": 0.625, "kv": 0.0625, "other": 0.0625})


def test_reports_are_strict_json() -> None:
    """NaN (a depth never reached) and inf become null at any depth, keys str, tuples lists."""
    import json

    from infra.strict_json import json_safe

    report = {"alpha_n": [0.5, math.nan], 3: {"tau": math.inf, "pair": (1.0, -math.inf)}, "n": 2}
    safe = json_safe(report)
    assert safe == {"alpha_n": [0.5, None], "3": {"tau": None, "pair": [1.0, None]}, "n": 2}
    json.dumps(safe, allow_nan=False)  # raises on anything strict JSON refuses
