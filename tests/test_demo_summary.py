"""`make demo`'s closing summary leads with what the drafter achieved and explains the speedup from the measured
verify cost: a cycle emitting tau tokens costs tau / speedup one-token steps."""

from pathlib import Path

from eval.run import format_summary
from launch.demo_summary import demo_lines, plain_choice, why_no_speedup

REPORT = {
    "target": "smollm2-135m-instruct", "drafter": "export", "prompts": "mt-bench", "num_prompts": 10,
    "num_requests": 10, "tau_pooled": 1.4, "tau_per_request_mean": 1.38, "oov_rate": 0.01,
    "per_position_acceptance": [0.37, 0.25, None],
    "tokens_per_s": {"speculative": 14.0, "baseline": 20.0}, "speedup": 0.7,
    "cycle_time_share": {"draft": 0.19, "verify": 0.74},
    "decode": {"mode": "tree", "depth": 6, "topk": 8, "total_tokens": 4, "temperature": 0.0, "max_new_tokens": 128,
               "total_tokens_timings_s": {"0": 0.0669, "4": 0.0931}},
}


def test_summary_leads_with_the_drafter_and_explains_the_speedup():
    lines = demo_lines(
        {"samples": {"train": 150, "eval": 17}, "tokens": {"train": 90000}, "draft_vocab_size": 32000},
        {"steps": 100, "world_size": 2, "zero_stage": 3, "ttt_steps": 7, "wall_s": 600.0,
         "eval": {"sim_tau": None, "oov_rate": 0.02}},
        REPORT, Path("p"), Path("r"),
    )
    assert lines[1].startswith("drafter  tau=1.400") and "alpha_1..: 0.37 0.25 n/a" in lines[1]
    assert "held-out simulated tau n/a" in lines[2]  # a null metric (strict JSON) prints as n/a
    why = lines[3]
    assert "costs 2.00 one-token steps" in why  # 1.4 / 0.7
    assert "verifying m+1=5 tokens costs 1.39x a one-token forward (93 vs 67 ms" in why
    assert "drafting takes 19% of each cycle" in why and "speculation loses here" in why
    assert format_summary(REPORT) in lines


def test_no_explanation_without_a_speedup_measured():
    assert why_no_speedup({**REPORT, "speedup": None}) is None


def test_a_plain_choice_says_what_the_best_tree_would_have_given():
    """decode.auto_total_tokens chose m = 0: the summary names the tree of the best predicted speedup and its tau."""
    choice = {"chosen": 0, "candidates": [
        {"m": 0, "tau": 1.0, "predicted_speedup": 1.0},
        {"m": 4, "tau": 1.5, "predicted_speedup": 0.93},
        {"m": 16, "tau": 1.7, "predicted_speedup": 0.81}]}
    report = {**REPORT, "tau_pooled": None, "speedup": None,
              "decode": {**REPORT["decode"], "total_tokens": 0, "total_tokens_choice": choice}}
    line = plain_choice(report)
    assert line.startswith("speculation is not predicted to pay on this machine") and "(m=4)" in line
    assert "tau=1.50" in line and "predicted speedup of 0.93" in line
    assert plain_choice(REPORT) is None
