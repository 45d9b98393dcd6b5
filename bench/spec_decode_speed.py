#!/usr/bin/env python
"""Speed of our speculative decoding on the embedded target, side by side with plain decoding and with
transformers' prompt-lookup assisted decoding, at T=0 and T=1, in ONE process.

    python bench/spec_decode_speed.py --drafter outputs/runs/demo/export \
        [--num-prompts 10 --max-new-tokens 128 --threads 2 --temperatures 0,1 --modes tree,chain]

What runs: one *pass* = one `eval.run.run_eval` call (one speculative mode at one temperature) over the
SAME first turns of the SAME MT-bench prompts with the same max new tokens and seeds. Inside a pass every
prompt is decoded by each method back to back (speculative, plain, and in the first pass of a temperature
also `model.generate` with and without prompt lookup), so machine noise hits them alike; every speedup is
a ratio to the plain decoding of its own pass (docs/method.md §6). Passes run temperature by temperature, tree
then chain. Tree's verify budget m is picked once by timing the target (docs/method.md §3: measure, then
choose) in the first tree pass and reused by the later ones, so T=0 and T=1 verify the same tree size.

Sampling (T=1) uses eval's defaults top_p=1, top_k=0 and the lossless rules of docs/method.md §1. Prompt
lookup at T=1 is transformers' assisted decoding with `do_sample=True`: its drafts carry no logits, so it
samples one token per position from the warped target distribution and keeps the drafts while they equal
the sampled token, which is the lossless rule for a point-mass draft (accept x with probability p(x), else
the sampled token follows the residual).

Prints one JSON object (one row per temperature x method: tokens/s, speedup vs plain, τ pooled and per
request, α_n) and writes it to --out, with a PNG next to it (tokens/s bars; per-position acceptance).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from data_prep.strict_json import json_safe
from eval.config import DecodeConfig, EvalConfig
from eval.run import run_eval

PLAIN, HF_PLAIN, PROMPT_LOOKUP = "plain", "hf_generate", "hf_prompt_lookup"


def pass_config(args: argparse.Namespace, mode: str, temperature: float, total_tokens: int | None,
                with_peer: bool, out_dir: Path) -> EvalConfig:
    decode = DecodeConfig(
        mode=mode,
        depth=args.depth if mode == "tree" else args.chain_depth,
        topk=args.topk,
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
        num_prompts=args.num_prompts,
        max_turns=1,  # first turns only: a second turn would follow each method's own first answer
        seed=args.seed,
    )
    if mode == "tree":
        if total_tokens is None:
            decode.auto_total_tokens = True
        else:
            decode.total_tokens = total_tokens
    return EvalConfig(drafter=args.drafter, target=args.target, prompts=args.prompts, out_dir=str(out_dir),
                      threads=args.threads, baseline=True, prompt_lookup=with_peer,
                      prompt_lookup_num_tokens=args.prompt_lookup_num_tokens, plots=False, decode=decode)


def spec_row(report: dict, temperature: float) -> dict:
    d = report["decode"]
    tps = report["tokens_per_s"]
    same = report.get("outputs_identical_to_baseline")
    return {
        "temperature": temperature, "method": d["mode"], "tokens_per_s": tps["speculative"],
        "speedup_vs_plain": report["speedup"], "plain_tokens_per_s_same_pass": tps["baseline"],
        "tau_pooled": report["tau_pooled"], "tau_per_request_mean": report["tau_per_request_mean"],
        "tau_per_request": [s["tau"] for s in report["samples"]],
        "per_position_acceptance": report["per_position_acceptance"],
        "accept_length_histogram": report["accept_length_histogram"],
        "verify_forwards": report["verify_forwards"], "new_tokens": report["new_tokens"],
        "drafting": report.get("drafting"),  # what the drafter really did (a DFlash export ignores mode/depth)
        "depth": d["depth"], "topk": d["topk"] if d["mode"] == "tree" else None,
        "total_tokens_m": d["total_tokens"] if d["mode"] == "tree" else None,
        "outputs_identical_to_plain": same or None,  # expected_all: greedy only (T>0 draws other streams)
    }


def plain_row(reports: list[dict], temperature: float) -> dict:
    """Plain decoding ran once per pass on the same prompts; pool those runs (Σ tokens / Σ seconds)."""
    tokens = [sum(len(s["baseline_output_token_ids"]) for s in r["samples"]) for r in reports]
    seconds = [n / r["tokens_per_s"]["baseline"] for n, r in zip(tokens, reports)]
    return {"temperature": temperature, "method": PLAIN, "tokens_per_s": sum(tokens) / sum(seconds),
            "speedup_vs_plain": 1.0, "tokens_per_s_by_pass": {r["decode"]["mode"]: r["tokens_per_s"]["baseline"]
                                                              for r in reports}}


def peer_rows(report: dict, temperature: float) -> list[dict]:
    p = report["prompt_lookup"]
    base = report["tokens_per_s"]["baseline"]
    return [
        {"temperature": temperature, "method": HF_PLAIN, "tokens_per_s": p["hf_generate_plain_tokens_per_s"],
         "speedup_vs_plain": p["hf_generate_plain_tokens_per_s"] / base, "plain_tokens_per_s_same_pass": base},
        {"temperature": temperature, "method": PROMPT_LOOKUP, "tokens_per_s": p["tokens_per_s"],
         "speedup_vs_plain": p["speedup"], "speedup_vs_hf_generate": p["speedup_vs_hf_generate_plain"],
         "plain_tokens_per_s_same_pass": base, "prompt_lookup_num_tokens": p["num_tokens"]},
    ]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on servers
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["temperature"], r["method"]): r for r in rows}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [t_i + (i - (len(methods) - 1) / 2) * width for t_i in range(len(temps))]
        vals = [(by.get((t, m)) or {}).get("tokens_per_s") or 0.0 for t in temps]
        bars = ax.bar(xs, vals, width, label=m)
        for bar, t in zip(bars, temps):
            s = (by.get((t, m)) or {}).get("speedup_vs_plain")
            if s is not None:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{s:.2f}×", ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(range(len(temps)), [f"T={t:g}" for t in temps])
    ax.set_ylabel("tokens/s (label: speedup vs plain, same pass)")
    ax.set_title("decoding speed per method")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # headroom: the legend sits above the bars
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    depth = max((len(r.get("per_position_acceptance") or []) for r in rows), default=0)
    for r in rows:
        alphas = r.get("per_position_acceptance")
        if alphas:
            ax2.plot(range(len(alphas)), [a if a is not None else float("nan") for a in alphas], marker="o",
                     label=f"{r['method']} T={r['temperature']:g} (τ={r['tau_pooled']:.2f})")
    ax2.set_xticks(range(depth))
    ax2.set_xlabel("draft depth n")
    ax2.set_ylabel("α_n = P(accept | all before accepted)")
    ax2.set_ylim(0, 1.05)
    ax2.set_title("per-position acceptance")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", required=True, help="engine-format export dir")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--modes", default="tree,chain")
    ap.add_argument("--depth", type=int, default=DecodeConfig.depth, help="tree depth")
    ap.add_argument("--topk", type=int, default=DecodeConfig.topk)
    ap.add_argument("--total-tokens", type=int, default=None, help="tree m; default: picked by timing the target")
    # Chain pays one verify slot and one drafter step per depth whatever the drafter's confidence; K=3 is
    # also what `make engine-check` compares with vLLM.
    ap.add_argument("--chain-depth", type=int, default=3)
    ap.add_argument("--prompt-lookup-num-tokens", type=int, default=EvalConfig.prompt_lookup_num_tokens)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/spec_decode_speed.json")
    args = ap.parse_args(argv)
    temps = [float(t) for t in args.temperatures.split(",")]
    modes = args.modes.split(",")

    t0 = time.perf_counter()
    rows: list[dict] = []
    total_tokens = args.total_tokens
    m_timings = None
    with tempfile.TemporaryDirectory() as tmp:
        for temp in temps:
            reports = []
            for i, mode in enumerate(modes):
                cfg = pass_config(args, mode, temp, total_tokens, with_peer=i == 0,
                                  out_dir=Path(tmp) / f"T{temp:g}_{mode}")
                report = run_eval(cfg, progress=sys.stderr.isatty())
                if mode == "tree" and total_tokens is None:
                    total_tokens = report["decode"]["total_tokens"]
                    m_timings = report["decode"]["total_tokens_timings_s"]
                reports.append(report)
            rows += [plain_row(reports, temp), *(spec_row(r, temp) for r in reports), *peer_rows(reports[0], temp)]
    result = {
        "args": vars(args),
        "target": reports[0]["target"], "drafter": args.drafter, "prompts": args.prompts,
        "num_prompts": reports[0]["num_prompts"], "first_turns_only": True,
        "dtype": reports[0]["dtype"], "device": reports[0]["device"], "torch_threads": torch.get_num_threads(),
        "sampling": {"top_p": DecodeConfig.top_p, "top_k": DecodeConfig.top_k},
        "tree_total_tokens_m": total_tokens, "tree_m_timings_s": m_timings,
        "protocol": "each pass = one run_eval call; per prompt: speculative, plain (and in the first pass of a "
                    "temperature HF generate with and without prompt lookup) back to back; speedup_vs_plain = "
                    "tokens/s / plain tokens/s of the same pass; the plain row pools the passes",
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    safe = json_safe(result)
    out.write_text(json.dumps(safe, indent=1))
    plot(safe["rows"], out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in safe.items() if k != "rows"} | {"rows": [
        {k: v for k, v in r.items() if k not in ("tau_per_request", "accept_length_histogram")} for r in safe["rows"]
    ]}))
    print(f"results: {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
