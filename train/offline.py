"""Offline (teacher-forced) evaluation of a drafter of any family on a held-out shard set.

Runs the family objective's `eval_sums` + `summarize` (what the in-training eval runs) and writes
`offline_report.json` (acc_k, alpha_k, sim_tau, oov_rate, n_target_k, num_positions, ...; NaN written as
null) and `offline_report.png` (per-position marginal accuracy and conditional acceptance). Every family
reports the same fields under the same honest rule: every target counts, one the drafter cannot emit is a
miss (DFlash drafts over the whole vocabulary, so its oov_rate is 0).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from infra.strict_json import dumps
from train.batch import Batch, collate
from train.objective import Objective


def _batches(shard_set: Any, indices: Sequence[int], batch_size: int) -> Iterator[Batch]:
    # Similar lengths together: right padding costs compute, and nothing else here depends on order.
    lengths = shard_set.lengths()
    order = sorted(indices, key=lambda i: lengths[i])
    for start in range(0, len(order), batch_size):
        yield collate([shard_set[i] for i in order[start : start + batch_size]])


def plot_report(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    K = len(report["acc_k"])
    xs = list(range(K))
    width = 0.4
    fig, ax = plt.subplots(figsize=(1.2 * K + 3, 4))
    clean = [
        [0.0 if v is None or not math.isfinite(v) else v for v in report[key]] for key in ("acc_k", "alpha_k")
    ]
    ax.bar([x - width / 2 for x in xs], clean[0], width, label="acc_k (marginal, teacher-forced)")
    ax.bar([x + width / 2 for x in xs], clean[1], width, label="alpha_k (conditional acceptance)")
    ax.set_xticks(xs)
    ax.set_xlabel("draft position k (0 = the first drafted token)")
    ax.set_ylim(0, 1.25)
    ax.set_title(
        f"offline eval: sim τ = {report['sim_tau']:.3f} (incl. bonus), {report['num_positions']} positions"
    )
    ax.legend(loc="upper right", ncol=2, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def offline_report(
    objective: Objective,
    drafter: nn.Module,
    head: nn.Module,
    shard_set: Any,
    out_dir: str | Path,
    batch_size: int,
    max_samples: int | None = None,
) -> dict:
    """Evaluate on the first `max_samples` samples of `shard_set` (all if None); write JSON + PNG."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = len(shard_set) if max_samples is None else min(len(shard_set), max_samples)
    report = objective.summarize(objective.eval_sums(drafter, head, _batches(shard_set, range(n), batch_size)))
    report = {
        **report,
        "method": objective.method,
        "positions": objective.positions,
        "teacher": getattr(getattr(shard_set, "manifest", None), "teacher", None),
    }
    (out_dir / "offline_report.json").write_text(dumps(report, indent=1))
    plot_report(report, out_dir / "offline_report.png")
    return report
