"""PNG plots of an eval report: per-position acceptance and the accepted-length histogram."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    return plt


def plot_per_position(alphas: list[float | None], path: Path, title: str = "") -> Path:
    plt = pyplot()
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


def draw_alpha_lines(ax, series: list[tuple[str, list[float | None], str | None]], title: str) -> None:
    """α per draft depth, one line per (label, alphas, color or None) on `ax`: a depth never reached is a gap."""
    for label, alphas, color in series:
        ax.plot(range(len(alphas)), [a if a is not None else float("nan") for a in alphas], "o-", color=color,
                label=label)
    ax.set_xticks(range(max((len(a) for _, a, _ in series), default=0)))
    ax.set_xlabel("draft depth n")
    ax.set_ylabel("α_n = P(accept | all before accepted)")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend(fontsize=7)


def plot_accept_histogram(counts: list[int], path: Path, title: str = "") -> Path:
    plt = pyplot()
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


def plot_categories(report: dict, path: Path) -> Path:
    """τ per (suite, category) with its 95% interval (and the engine's τ where it ran), and α per position per
    suite."""
    plt = pyplot()
    entries, suites = report["categories"], report["suites"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    xs = list(range(len(entries)))
    taus = [e["tau"] if e["tau"] == e["tau"] and e["tau"] is not None else 0.0 for e in entries]
    lo = [t - (e["tau_ci95"][0] if e["tau_ci95"] else t) for t, e in zip(taus, entries)]
    hi = [(e["tau_ci95"][1] if e["tau_ci95"] else t) - t for t, e in zip(taus, entries)]
    colors = {s: f"C{i}" for i, s in enumerate(suites)}
    ax.bar(xs, taus, yerr=[lo, hi], capsize=3, color=[colors[e["suite"]] for e in entries], alpha=0.8)
    eng = [(x, e["engine"]["tau"]) for x, e in zip(xs, entries) if (e.get("engine") or {}).get("tau") is not None]
    if eng:
        ax.plot([x for x, _ in eng], [t for _, t in eng], "k_", markersize=14, mew=2, label="vLLM's τ")
        ax.legend(fontsize=8)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{e['suite']}/{e['category']}" for e in entries], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("τ (tokens per verify forward)")
    ax.set_ylim(1.0, max([*[t + h for t, h in zip(taus, hi)], 1.5]) * 1.05)
    ax.set_title("τ per category, 95% bootstrap interval over prompts")
    draw_alpha_lines(bx, [(f"{suite} (τ {s['tau']:.2f})", s["alpha"], colors[suite]) for suite, s in suites.items()],
                     "α per position per suite")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
