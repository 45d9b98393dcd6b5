#!/usr/bin/env python
"""Held-out accuracy per position against training steps, for one or more runs, beside a reference run's acc_0.

    python bench/learning_curve.py --runs <run dir> [<run dir> ...] [--reference <EAGLE-3 run dir>] \
        [--positions 0,1,2,6] [--out bench/results/learning_curve.json]

Reads each run's metrics.jsonl eval records (the in-training held-out eval: acc_k = correct / every
loss-masked target that position reaches, out-of-vocabulary targets counted as misses). Position k is
TTT step k for EAGLE, block position k + 1 for DFlash (the anchor itself is given, not predicted). With
--reference, the reference run's final acc_0 and 0.8 x it are drawn and reported, with the first step at
which each run's acc_0 reaches 0.8 x it (null when it never does). Writes --out (JSON) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REFERENCE_SHARE = 0.8  # the DFlash issue's bar: block position 1 >= 0.8 x EAGLE-3's acc_0 on the same data


def curve(run_dir: Path) -> list[dict]:
    from train.metrics import METRICS_FILE, read_metrics

    return [{"step": r["step"], "acc_k": r["acc_k"], "sim_tau": r.get("sim_tau")}
            for r in read_metrics(run_dir / METRICS_FILE, kind="eval")]


def first_step_reaching(points: list[dict], bar: float) -> int | None:
    return next((p["step"] for p in points if p["acc_k"] and p["acc_k"][0] >= bar), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--labels", nargs="*", default=None, help="one per run (default: the directory names)")
    ap.add_argument("--reference", default=None, help="a run whose final acc_0 sets the bar")
    ap.add_argument("--positions", default="0,1,2,6", help="acc_k indices drawn")
    ap.add_argument("--out", default="bench/results/learning_curve.json")
    args = ap.parse_args()

    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
    positions = [int(k) for k in args.positions.split(",")]
    result: dict = {"definition": "held-out acc_k per eval step (honest: out-of-vocabulary targets are misses)",
                    "runs": {}}
    bar = None
    if args.reference:
        ref = curve(Path(args.reference))
        if not ref:
            raise SystemExit(f"{args.reference}: no eval records in its metrics file")
        bar = REFERENCE_SHARE * ref[-1]["acc_k"][0]
        result["reference"] = {"run": args.reference, "final_step": ref[-1]["step"], "acc_0": ref[-1]["acc_k"][0],
                               "bar": bar, "bar_definition": f"{REFERENCE_SHARE} x the reference's final acc_0"}
    for label, run in zip(labels, args.runs):
        points = curve(Path(run))
        if not points:
            raise SystemExit(f"{run}: no eval records in its metrics file")
        result["runs"][label] = {"run": run, "points": points,
                                 "first_step_at_bar": first_step_reaching(points, bar) if bar else None}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(labels), figsize=(4.5 * len(labels), 3.6), squeeze=False)
    for ax, label in zip(axes[0], labels):
        points = result["runs"][label]["points"]
        for k in positions:
            steps = [p["step"] for p in points if k < len(p["acc_k"])]
            ax.plot(steps, [p["acc_k"][k] for p in points if k < len(p["acc_k"])], marker="o", ms=3,
                    label=f"position {k}")
        if bar is not None:
            ax.axhline(result["reference"]["acc_0"], color="black", lw=0.8, label="reference acc_0")
            ax.axhline(bar, color="grey", ls="--", lw=0.8, label=f"{REFERENCE_SHARE} x reference")
        ax.set(title=label, xlabel="optimizer step", ylabel="held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"} |
                     {"first_step_at_bar": {k: v["first_step_at_bar"] for k, v in result["runs"].items()}}, indent=1))


if __name__ == "__main__":
    main()
