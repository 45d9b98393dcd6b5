"""The closing summary of `make demo`: what the drafter achieved first, then why this machine does not turn it
into a speedup (with the measured verify cost), then what each stage produced and where things lie.

    python launch/demo_summary.py <prep_dir> <run_dir>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launch.paths import CONF_DIR  # noqa: F401  (first: takes launch/ off sys.path)
from data_prep.shards import PREP_SUMMARY
from eval.run import REPORT_FILE, format_summary
from train.metrics import RUN_SUMMARY


def _num(value: float | None, fmt: str) -> str:
    """A metric that is null in a summary (nothing to measure it on) prints as n/a."""
    return "n/a" if value is None else format(value, fmt)


def why_no_speedup(report: dict) -> str | None:
    """The speedup in one-token-step units: a cycle emits tau tokens and costs tau / speedup one-token steps
    (speedup = speculative tokens/s / plain tokens/s, same prompts), of which the verify forward of m + 1 tokens
    costs timings[m] / timings[0]. Speculation gains only while a cycle costs fewer steps than it emits tokens."""
    tau, speedup = report.get("tau_pooled"), report.get("speedup")
    if not tau or not speedup:
        return None
    d = report["decode"]
    timings = d.get("total_tokens_timings_s") or {}
    cycle_steps = tau / speedup
    verify = ""
    m = d.get("total_tokens")
    if str(m) in timings and timings.get("0"):
        verify = (f"verifying m+1={m + 1} tokens costs {timings[str(m)] / timings['0']:.2f}x a one-token forward "
                  f"({timings[str(m)] * 1e3:.0f} vs {timings['0'] * 1e3:.0f} ms, measured before decoding), ")
    share = report.get("cycle_time_share") or {}
    drafting = f"drafting takes {share['draft']:.0%} of each cycle, " if "draft" in share else ""
    verdict = "so speculation pays here" if speedup > 1 else "so speculation loses here"
    return (f"why {'a' if speedup > 1 else 'no'} speedup on this machine: each cycle emits tau={tau:.2f} tokens and "
            f"costs {cycle_steps:.2f} one-token steps ({verify}{drafting}the rest bookkeeping), {verdict} "
            f"(speedup {speedup:.2f} = {tau:.2f} / {cycle_steps:.2f}). On a CPU the (m+1)-token forward is a "
            f"compute-bound matrix product that grows with m; on a GPU a decode step is memory-bound and verifying "
            f"a few dozen tokens costs about one step, which is where tau turns into speedup.")


def plain_choice(report: dict) -> str | None:
    """Where decode.auto_total_tokens chose plain decoding (m = 0: no tree predicted to pay on this machine), what
    the drafter would have given: the probe's tau at the tree of the best predicted speedup, and that speedup."""
    choice = report["decode"].get("total_tokens_choice") or {}
    trees = [c for c in choice.get("candidates") or [] if c.get("m")]
    if choice.get("chosen") != 0 or not trees:
        return None
    best = max(trees, key=lambda c: c["predicted_speedup"])
    return (f"speculation is not predicted to pay on this machine, so evaluation decoded plainly: the best tree "
            f"(m={best['m']}) accepts tau={_num(best.get('tau'), '.2f')} tokens per target forward on the probe, at a "
            f"predicted speedup of {best['predicted_speedup']:.2f} (decode.total_tokens_choice in report.json; "
            f"decode.total_tokens=<m> evaluates a fixed tree)")


def demo_lines(prep_summary: dict, train_summary: dict, report: dict, prep: Path, run: Path) -> list[str]:
    held_out = train_summary.get("eval") or {}
    alphas = " ".join(_num(a, ".2f") for a in report["per_position_acceptance"])
    lines = [
        "\n================ demo summary ================",
        f"drafter  tau={_num(report['tau_pooled'], '.3f')} tokens per target forward on {report['num_requests']} held-out "
        f"turns of {report['prompts']} ({report['decode']['mode']} decoding, T={report['decode']['temperature']}); "
        f"per-position acceptance alpha_1..: {alphas}",
        f"         held-out simulated tau {_num(held_out.get('sim_tau'), '.3f')} from training's own eval "
        f"(a target outside the draft vocab is a miss; {_num(held_out.get('oov_rate'), '.1%')} of them are)",
    ]
    why = why_no_speedup(report) or plain_choice(report)
    if why:
        lines.append(why)
    lines += [
        "",
        f"prep   {prep_summary['samples']['train']} train / {prep_summary['samples']['eval']} held-out samples, "
        f"{prep_summary['tokens']['train']} train tokens, draft vocab {prep_summary['draft_vocab_size']}  -> {prep}",
        f"train  {train_summary['steps']} steps on {train_summary['world_size']} processes "
        f"(ZeRO-{train_summary['zero_stage']}, K={train_summary['ttt_steps']}) in {train_summary['wall_s']:.0f} s  "
        f"-> {run}",
        f"export {run / 'export'} (LlamaForCausalLMEagle3: config.json + model.safetensors)",
        format_summary(report),
        f"plots  {run / 'eval' / 'per_position_acceptance.png'}, {run / 'eval' / 'accept_length_histogram.png'}",
        f"report {run / 'eval' / 'report.json'}; training metrics {run / 'metrics.jsonl'}",
    ]
    return lines


def main(prep_dir: str, run_dir: str) -> None:
    prep, run = Path(prep_dir), Path(run_dir)
    prep_summary = json.loads((prep / PREP_SUMMARY).read_text())
    train_summary = json.loads((run / RUN_SUMMARY).read_text())
    report = json.loads((run / "eval" / REPORT_FILE).read_text())
    print("\n".join(demo_lines(prep_summary, train_summary, report, prep, run)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
