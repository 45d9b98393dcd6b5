"""PNG plots of an eval report: per-position acceptance and the accepted-length histogram."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    return plt


def plot_per_position(alphas: list[float | None], path: Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = list(range(len(alphas)))
    ax.bar(xs, [a if a is not None else 0.0 for a in alphas], color="tab:blue")
    for x, a in zip(xs, alphas):
        ax.text(x, (a or 0.0) + 0.01, "n/a" if a is None else f"{a:.2f}", ha="center", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xlabel("draft depth n")
    ax.set_ylabel("α_n = P(accept | all before accepted)")
    ax.set_ylim(0, 1.08)
    ax.set_title(title or "per-position acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_accept_histogram(counts: list[int], path: Path, title: str = "") -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    total = max(sum(counts), 1)
    xs = list(range(len(counts)))
    ax.bar(xs, [c / total for c in counts], color="tab:green")
    ax.set_xticks(xs)
    ax.set_xlabel("accepted draft tokens per verify forward (emitted = this + 1)")
    ax.set_ylabel("fraction of verify forwards")
    ax.set_title(title or "accepted length")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
