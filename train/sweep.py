"""Sweep summary: held-out simulated tau, out-of-vocabulary rate and per-step accuracy over a sweep's jobs.

    python -m train.sweep <sweep_dir>      # also run automatically after `launch/train.py -m ...` (rank 0)

Reads every <sweep_dir>/job*/summary.json and metrics.jsonl (+ .hydra/overrides.yaml when present) and
writes <sweep_dir>/sweep_summary.md (table: the job's overrides, K, λ, steps, wall time, held-out sim τ,
OOV rate, acc_k), .json (rows, with each job's held-out learning curve) and .png (held-out sim τ against
steps and against wall seconds per job; acc_k per job). Held-out figures use the honest definition of
train/ttt.py `summarize`: a target outside the draft vocabulary is a miss.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hydra.experimental.callback import Callback

from infra.strict_json import dumps
from train.metrics import METRICS_FILE, RUN_SUMMARY


def collect(sweep_dir: Path) -> list[dict]:
    rows = []
    for job in sorted(sweep_dir.glob("job*"), key=lambda p: int(p.name[3:]) if p.name[3:].isdigit() else 1 << 30):
        path = job / RUN_SUMMARY
        if not path.exists():  # its learning curve so far still shows
            rows.append({"job": job.name, "status": "no summary (failed, stopped or running)",
                         "overrides": _overrides(job), "curve": _curve(job / METRICS_FILE)})
            continue
        s = json.loads(path.read_text())
        ev = s.get("eval") or {}
        rows.append({
            "job": job.name,
            "status": "finished" if s.get("finished") else "stopped",
            "K": s.get("ttt_steps"),
            "lambda": s.get("loss_decay"),
            "steps": s.get("steps"),
            "sim_tau": ev.get("sim_tau"),
            "acc_k": ev.get("acc_k"),
            "alpha_k": ev.get("alpha_k"),
            "eval_loss_k": ev.get("loss_k"),
            "oov_rate": ev.get("oov_rate"),
            "wall_s": s.get("wall_s"),
            "overrides": _overrides(job),
            "curve": _curve(job / METRICS_FILE),
        })
    return rows


def _overrides(job: Path) -> list[str]:
    """The job's Hydra overrides, less where it ran and how it logged."""
    path = job / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    import yaml

    return [o for o in yaml.safe_load(path.read_text()) or []
            if not o.startswith(("out_dir=", "data.dir=", "logger."))]


def _curve(path: Path) -> list[dict]:
    """Held-out sim τ per eval: [{"step", "sim_tau", "time_s" since the first record}]."""
    if not path.exists():
        return []
    from train.metrics import read_metrics

    records = read_metrics(path)
    if not records:
        return []
    t0 = records[0]["time"]
    return [{"step": r["step"], "sim_tau": r.get("sim_tau"), "time_s": r["time"] - t0}
            for r in records if r["kind"] == "eval"]


def _label(r: dict, common: set[str] = frozenset()) -> str:
    return " ".join(o for o in r.get("overrides") or [] if o not in common) or r["job"]


def _fmt(x, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown(rows: list[dict]) -> str:
    k_max = max((len(r["acc_k"]) for r in rows if r.get("acc_k")), default=0)
    head = ["job", "overrides", "K", "λ", "steps", "wall s", "held-out sim τ", "OOV rate",
            *[f"acc_{i}" for i in range(k_max)], "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        acc = list(r.get("acc_k") or []) + [None] * k_max
        wall = r.get("wall_s")
        cells = [r["job"], " ".join(r.get("overrides") or []), _fmt(r.get("K")), _fmt(r.get("lambda"), 2),
                 _fmt(r.get("steps")), _fmt(None if wall is None else round(wall)), _fmt(r.get("sim_tau")),
                 _fmt(r.get("oov_rate")), *[_fmt(a) for a in acc[:k_max]], r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    # the overrides every job shares say nothing about the difference between them
    common = set.intersection(*(set(r.get("overrides") or []) for r in rows)) if rows else set()
    fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, x, xlabel in ((ax0, "step", "optimizer step"), (ax1, "time_s", "wall seconds")):
        for i, r in enumerate(rows):  # a stopped job's curve so far too
            pts = [c for c in r.get("curve") or [] if c["sim_tau"] is not None]
            ax.plot([c[x] for c in pts], [c["sim_tau"] for c in pts], marker=".", color=f"C{i % 10}",
                    label=_label(r, common))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out simulated τ (OOV = miss)")
        ax.set_title(f"learning curve by {xlabel}")
    ax0.legend(fontsize=6, loc="lower right")
    for i, r in enumerate(rows):  # one colour per job in every panel
        if r.get("sim_tau") is not None:
            ax2.plot(range(len(r["acc_k"])), r["acc_k"], marker=".", color=f"C{i % 10}", label=_label(r, common))
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_xlabel("TTT step k")
    ax2.set_ylabel("held-out acc_k")
    ax2.set_title("per-step accuracy")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_summary(sweep_dir: str | Path) -> Path:
    sweep_dir = Path(sweep_dir)
    rows = collect(sweep_dir)
    (sweep_dir / "sweep_summary.json").write_text(dumps(rows, indent=1))
    (sweep_dir / "sweep_summary.md").write_text(markdown(rows))
    plot(rows, sweep_dir / "sweep_summary.png")
    return sweep_dir / "sweep_summary.md"


class SweepSummaryCallback(Callback):
    """Hydra callback (conf/train.yaml): after a multirun, rank 0 writes the sweep summary."""

    def on_multirun_end(self, config, **kwargs) -> None:
        if int(os.environ.get("RANK", "0")) != 0:
            return
        path = write_summary(Path(config.hydra.sweep.dir))
        print(path.read_text(), file=sys.stderr)
        print(f"sweep summary: {path}", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m train.sweep <sweep_dir>")
    print(write_summary(sys.argv[1]).read_text())
