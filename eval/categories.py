"""The evaluation per (suite, category): τ with a bootstrap interval over prompts, α per position, outputs equal to
plain decoding, OOV rate, tokens/s with and without the drafter, and the speedup the verify cost predicts.

τ of a category is pooled over its turns (Σ emitted tokens in verify cycles / Σ verify forwards: eval/metrics.py).
Its 95% interval resamples the category's *prompts* (a prompt's turns stay together: its second turn follows its
own first answer) with replacement, `BOOTSTRAP_SAMPLES` times, and takes the 2.5th and 97.5th percentiles of the
pooled τ. Below `MIN_CI_PROMPTS` prompts there is no interval (null, printed "n<5"): n prompts have only
C(2n-1, n) distinct resamples (3 for two prompts, 10 for three), whose percentiles are the extreme prompts' τ
rather than a 95% interval; a category of one prompt would have a zero-width one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from eval import metrics
from eval.spec_decode import GenerationRecord
from infra.strict_json import dumps

BOOTSTRAP_SAMPLES = 2000
MIN_CI_PROMPTS = 5  # fewer prompts: no interval (see the module docstring)
NO_CI = f"n<{MIN_CI_PROMPTS}"  # how a missing interval is printed
CI_DEFINITION = (f"95% bootstrap interval of the pooled τ: the category's prompts resampled with replacement "
                 f"{BOOTSTRAP_SAMPLES} times (each prompt with all its turns), 2.5th / 97.5th percentiles; null "
                 f"({NO_CI}) with fewer than {MIN_CI_PROMPTS} prompts, whose few distinct resamples give no interval")


def bootstrap_tau_ci(per_prompt: Sequence[tuple[int, int]], samples: int = BOOTSTRAP_SAMPLES,
                     seed: int = 0) -> list[float] | None:
    """[low, high] of the pooled τ over prompts resampled with replacement; per_prompt = (emitted tokens in verify
    cycles, verify forwards) of each prompt. None without a verify forward or with fewer than `MIN_CI_PROMPTS`
    prompts."""
    counts = torch.tensor([list(p) for p in per_prompt], dtype=torch.float64).reshape(-1, 2)
    if len(counts) < MIN_CI_PROMPTS or counts[:, 1].sum() == 0:
        return None
    idx = torch.randint(len(counts), (samples, len(counts)), generator=torch.Generator().manual_seed(seed))
    tokens, steps = counts[idx, 0].sum(1), counts[idx, 1].sum(1)
    taus = (tokens / steps)[steps > 0]  # a draw of prompts that never verified has no τ
    q = torch.quantile(taus, torch.tensor([0.025, 0.975], dtype=torch.float64))
    return [float(q[0]), float(q[1])]


def prompt_counts(records: Sequence[GenerationRecord]) -> tuple[int, int]:
    steps = [a for r in records for a in r.accept_lengths]
    return sum(steps) + len(steps), len(steps)


def groups(samples: Sequence[dict]) -> dict[tuple[str, str], list[int]]:
    """(suite, category) -> the indices of its turns in `samples`, in first-seen order."""
    out: dict[tuple[str, str], list[int]] = {}
    for i, s in enumerate(samples):
        out.setdefault((s["suite"], s["category"]), []).append(i)
    return out


def acceptance_of(samples: Sequence[dict], spec: Sequence[GenerationRecord], idx: Sequence[int], depth: int) -> dict:
    """Prompts, turns, pooled τ with its interval over the prompts (a prompt's turns together) and α per position of
    the turns `idx` (samples[i] <-> spec[i])."""
    by_prompt: dict[tuple[str, str], list[GenerationRecord]] = {}
    for i in idx:
        by_prompt.setdefault((samples[i]["suite"], samples[i]["id"]), []).append(spec[i])
    recs = [spec[i] for i in idx]
    alpha = metrics.per_position_acceptance(recs)
    return {"prompts": len(by_prompt), "turns": len(idx), "tau": metrics.tau_pooled(recs),
            "tau_ci95": bootstrap_tau_ci([prompt_counts(r) for r in by_prompt.values()]),
            "alpha": alpha + [None] * (depth - len(alpha))}


def category_entries(samples: Sequence[dict], spec: Sequence[GenerationRecord], base: Sequence[GenerationRecord],
                     t2d: torch.Tensor | None, depth: int) -> list[dict]:
    """One entry per (suite, category) of the turns decoded (samples[i] <-> spec[i] <-> base[i]; base empty without
    a plain baseline; t2d None: a drafter over the whole vocabulary, OOV rate 0)."""
    entries = []
    for (suite, category), idx in groups(samples).items():
        recs = [spec[i] for i in idx]
        plain = [base[i] for i in idx] if base else []
        spec_rate, base_rate = metrics.tokens_per_s(recs), metrics.tokens_per_s(plain)
        entries.append({
            "suite": suite,
            "category": category,
            **acceptance_of(samples, spec, idx, depth),
            "identical": ({"count": sum(s.output_ids == b.output_ids for s, b in zip(recs, plain)), "of": len(plain)}
                          if plain else None),
            "oov_rate": metrics.oov_rate(recs, t2d) if t2d is not None else 0.0,
            "new_tokens": sum(len(r.output_ids) for r in recs),
            "tokens_per_s": {"speculative": spec_rate, "baseline": base_rate},
            "speedup": spec_rate / base_rate if plain and base_rate else None,
        })
    return entries


def suite_entries(samples: Sequence[dict], spec: Sequence[GenerationRecord], depth: int) -> dict[str, dict]:
    """Per suite, pooled over its categories: turns, τ with its interval over the suite's prompts, α per position."""
    out: dict[str, dict] = {}
    for suite in dict.fromkeys(s["suite"] for s in samples):
        out[suite] = acceptance_of(samples, spec, [i for i, s in enumerate(samples) if s["suite"] == suite], depth)
    return out


def tau_outside_interval(entry: dict) -> bool | None:
    """Whether the engine's τ lies outside our interval for the same prompts (a gap the table flags); None (not
    judged) without an interval (fewer than MIN_CI_PROMPTS prompts) or without the engine's τ."""
    ci, eng = entry.get("tau_ci95"), (entry.get("engine") or {}).get("tau")
    if ci is None or eng is None:
        return None
    slack = 1e-9  # two sums of the same counts in another order differ in the last bits
    return not ci[0] - slack <= eng <= ci[1] + slack


def _f(x, digits: int = 2) -> str:
    return "–" if x is None or x != x else f"{x:.{digits}f}"


def tau_with_ci(tau: float | None, ci: list[float] | None) -> str:
    """τ and its interval as printed: "1.500 [1.40, 1.60]", or "1.500 [n<5]" without one."""
    return f"{_f(tau, 3)} [{f'{_f(ci[0])}, {_f(ci[1])}' if ci else NO_CI}]"


TPOT_DEFINITION = ("TPOT: time per output token after the first, (last token's arrival − first token's) / (tokens − 1) "
                   "per request, mean over the level's requests; TTFT: time to the first token")
GAP = {True: "**outside CI**", False: "", None: NO_CI}  # tau_outside_interval's verdict in the table


def categories_markdown(entries: Sequence[dict]) -> str:
    """The per-category table (markdown: printed at the end of an evaluation and written beside report.json)."""
    engine = any(e.get("engine") for e in entries)
    head = ["suite", "category", "turns", "τ [95% CI]", "α per position", "identical", "OOV", "tok/s spec",
            "tok/s plain", "speedup (predicted)"]
    if engine:
        head += ["engine τ", "engine α", "engine tok/s spec / plain", "gap"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        same = e["identical"]
        tps = e["tokens_per_s"]
        row = [e["suite"], str(e["category"]), str(e["turns"]), tau_with_ci(e["tau"], e["tau_ci95"]),
               " ".join(_f(a) for a in e["alpha"]),
               f"{same['count']}/{same['of']}" if same else "–", _f(e["oov_rate"], 3),
               _f(tps["speculative"], 1), _f(tps["baseline"], 1),
               f"{_f(e['speedup'], 3)} ({_f(e.get('speedup_predicted'), 3)})"]
        if engine:
            g = e.get("engine") or {}
            gt = g.get("tokens_per_s") or {}
            row += [_f(g.get("tau"), 3), " ".join(_f(a) for a in g.get("alpha") or []),
                    f"{_f(gt.get('speculative'), 1)} / {_f(gt.get('baseline'), 1)}",
                    GAP[tau_outside_interval(e)] if g.get("tau") is not None else ""]
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def load_markdown(load: Sequence[dict]) -> str:
    """The engine's load sweep: per concurrency, with and without the drafter."""
    rows = ["| requests in flight | tok/s plain | tok/s EAGLE | speedup (predicted) | engine τ | TTFT ms plain / EAGLE "
            "| TPOT ms plain / EAGLE |", "|---|---|---|---|---|---|---|"]
    for lv in load:
        p, s = lv["plain"], lv["speculative"]
        rows.append(f"| {lv['concurrency']} | {_f(p['output_tokens_per_s'], 1)} | {_f(s['output_tokens_per_s'], 1)} | "
                    f"{_f(lv['speedup'], 3)} ({_f(lv['speedup_predicted'], 3)}) | {_f(s['tau'], 3)} | "
                    f"{_f(p['ttft_ms']['mean'], 0)} / {_f(s['ttft_ms']['mean'], 0)} | "
                    f"{_f(p['tpot_ms']['mean'], 1)} / {_f(s['tpot_ms']['mean'], 1)} |")
    return "\n".join(rows)


def settings_markdown(entries: Sequence[dict]) -> str:
    """The engine's draft-settings sweep: tokens/s (τ) per category and number of draft tokens; the best marked."""
    ks = list((entries[0].get("engine") or {}).get("settings") or {}) if entries else []
    if not ks:
        return ""
    rows = ["| suite | category | " + " | ".join(f"k={k}" if k != "0" else "no drafter" for k in ks) + " | best |",
            "|" + "---|" * (len(ks) + 3)]
    for e in entries:
        st, best = e["engine"]["settings"], str(e["engine"]["best_num_speculative_tokens"])
        cells = [(f"**{_f(st[k]['tokens_per_s'], 1)}**" if k == best else _f(st[k]["tokens_per_s"], 1))
                 + (f" ({_f(st[k]['tau'], 2)})" if st[k]["tau"] is not None else "") for k in ks]
        rows.append(f"| {e['suite']} | {e['category']} | " + " | ".join(cells) + f" | k={best} |")
    return "\n".join(rows)


def report_markdown(report: dict) -> str:
    """categories.md: the per-category table, and the engine's sweeps when it ran."""
    parts = ["## Per category", "", categories_markdown(report["categories"]), "",
             "τ = (accepted drafts + 1) per verify forward, pooled over the category's turns; " + CI_DEFINITION + ". "
             "identical: outputs equal to plain decoding's; OOV: share of emitted tokens outside the draft vocabulary; "
             "speedup = speculative / plain tokens/s, predicted from the measured verify cost (report.json "
             "cycle_cost)."]
    eng = report.get("engine")
    if eng:
        mode = eng["mode"]
        memory = eng.get("device_memory")
        parts += ["", f"engine: vLLM {eng.get('version') or ''}, {eng['method']} with {eng['num_speculative_tokens']} "
                  f"draft tokens, {'eager' if mode['enforce_eager'] else 'CUDA graphs'} ({mode['reason']})"
                  + (f", --gpu-memory-utilization {memory['share']} ({memory['reason']})" if memory else "")
                  + f"; both sides sample with {dumps(eng['sampling'])} (servers: --generation-config vllm); "
                  + ("every server answered one untimed request before it was timed; " if eng["warmup"] else "")
                  + f"**outside CI**: its τ lies outside our interval for the same prompts ({NO_CI}: no interval, "
                  "not judged)."]
        if len(eng["num_speculative_tokens_swept"]) > 2:
            parts += ["", "## Draft settings (engine tokens/s, τ in brackets)", "", settings_markdown(report["categories"])]
        if eng["load"]:
            parts += ["", "## Under load (engine)", "", load_markdown(eng["load"]), "", TPOT_DEFINITION + "."]
    return "\n".join(parts) + "\n"
