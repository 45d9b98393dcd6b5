#!/usr/bin/env python
"""The same drafter served by vLLM's CPU build: throughput with and without speculation, by concurrency.

    python bench/vllm_serving.py --vllm-python .venv-vllm/bin/python --drafter outputs/runs/demo/export \
        [--k 3 --concurrency 1,4,16 --num-prompts 16 --max-new-tokens 128 --dtype float32]

For each server (plain, then `--speculative-config {"method": "eagle3", "num_speculative_tokens": K}`; one at
a time, started and stopped by eval.engine_check.vllm_server) and each concurrency c, the first turns of
`--num-prompts` MT-bench prompts (token ids rendered with the target's chat template, greedy, `max_tokens`
fixed, `ignore_eos` so every request generates the same length) are sent with c requests in flight.
Figures: output tokens per wall second over the whole batch (throughput), mean request latency, and for the
speculative server its mean acceptance length (1 + accepted / drafts, vllm:spec_decode_* counters). The
speedup at c is throughput(spec) / throughput(plain) of the same prompts. Nothing else may share the machine.
Writes --out (JSON) and a PNG beside it, and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_batch(base: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    from eval.engine_check import http_post_json

    def one(ids: list[int]) -> tuple[int, float]:
        t0 = time.perf_counter()
        out = http_post_json(base + "/v1/completions", {"model": model, "prompt": ids, "max_tokens": max_tokens,
                                               "temperature": 0.0, "ignore_eos": True})
        return int(out["usage"]["completion_tokens"]), time.perf_counter() - t0

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    tokens = sum(n for n, _ in results)
    return {"concurrency": concurrency, "requests": len(prompts), "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "mean_latency_s": sum(s for _, s in results) / len(results)}


def serve_and_measure(args, model: str, prompts: list[list[int]], spec: dict | None, log: Path) -> list[dict]:
    from eval.engine_check import http_get, spec_counters, vllm_server

    extra = ["--speculative-config", json.dumps(spec)] if spec else []
    rows = []
    with vllm_server(args.vllm_python, model, dtype=args.dtype, log_path=log, extra_args=extra) as base:
        run_batch(base, model, prompts[:2], 8, 2)  # warm-up, untimed
        for c in args.concurrency:
            before = spec_counters(http_get(base + "/metrics"))
            row = run_batch(base, model, prompts, args.max_new_tokens, c)
            after = spec_counters(http_get(base + "/metrics"))
            if spec:
                drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
                accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
                row["mean_acceptance_length"] = 1 + accepted / max(drafts, 1)
            rows.append(row)
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, rows in (("plain", result["plain"]), (f"EAGLE-3 K={result['k']}", result["speculative"])):
        axes[0].plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=name)
    axes[0].set(xscale="log", xlabel="concurrent requests", ylabel="output tokens / s", title="vLLM CPU throughput")
    axes[0].legend()
    axes[1].plot([r["concurrency"] for r in result["speedup"]], [r["speedup"] for r in result["speedup"]], marker="o")
    axes[1].axhline(1.0, ls="--", color="grey", lw=0.8)
    axes[1].set(xscale="log", xlabel="concurrent requests", ylabel="throughput spec / plain", title="speedup")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--drafter", required=True, help="an EAGLE-3 export (config.json + model.safetensors)")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float32", help="vLLM's dtype (this CPU has no bf16 arithmetic)")
    ap.add_argument("--out", default="bench/results/vllm_serving.json")
    args = ap.parse_args()

    from data_prep.chat import render_prompt
    from data_prep.targets import load_tokenizer, model_path, resolve_target
    from eval.prompts import load_prompts

    preset = resolve_target(args.target)
    tokenizer = load_tokenizer(preset)
    records = load_prompts("mtbench", limit=args.num_prompts)
    prompts = [render_prompt(tokenizer, [{"role": "user", "content": r.turns[0]}]) for r in records]
    model = model_path(preset)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = {"method": "eagle3", "model": str(Path(args.drafter).resolve()), "num_speculative_tokens": args.k}
    plain = serve_and_measure(args, model, prompts, None, out.with_suffix(".plain.log"))
    speculative = serve_and_measure(args, model, prompts, spec, out.with_suffix(".spec.log"))
    result = {
        "target": preset.name, "drafter": args.drafter, "k": args.k, "dtype": args.dtype,
        "num_prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "definition": "tokens_per_s = output tokens of the whole batch / its wall seconds; speedup = spec / plain",
        "plain": plain, "speculative": speculative,
        "speedup": [{"concurrency": p["concurrency"], "speedup": s["tokens_per_s"] / p["tokens_per_s"]}
                    for p, s in zip(plain, speculative)],
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
