#!/usr/bin/env python
"""One drafter on every shipped suite (eval/prompts.py SUITES), through our evaluator and vLLM's server side by
side in one run: τ (with its interval where a category or suite has 5 or more prompts), α, identical outputs and
tokens/s per category, the engine's own counters beside them (each server warmed up, both sides sampling with the
same stated parameters), its draft-settings sweep and its load sweep (eval/engine.py). Nothing else may share the
machine.

    python bench/eval_suites.py --drafter <export> --name demo --vllm-python .venv-vllm/bin/python \
        [--num-prompts 2 --max-new-tokens 48 --depth 3 --concurrency 1,4,16,64 --sweep 1,5]

Writes bench/results/suites_<name>.json (report.json without the per-turn samples), .md (the tables) and .png;
the full report (samples included) stays in --work (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from infra.strict_json import dumps

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def portable(value, work: Path):
    """The report with this machine's paths made relative: the checkout's to the checkout, the work dir's to <work>,
    the user's cache (where the embedded target unpacks) to <cache>, so a committed result names no machine path."""
    if isinstance(value, dict):
        return {k: portable(v, work) for k, v in value.items()}
    if isinstance(value, list):
        return [portable(v, work) for v in value]
    if isinstance(value, str):
        return (value.replace(f"{work.resolve()}/", "<work>/").replace(f"{ROOT}/", "")
                .replace(f"{Path.home() / '.cache'}/", "<cache>/"))
    return value


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="all")
    ap.add_argument("--num-prompts", type=int, default=2, help="per category")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--depth", type=int, default=3, help="draft tokens per step, ours (chain) and vLLM's")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--sweep", default="", help="more vLLM num_speculative_tokens values, e.g. 1,5")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None)
    args = ap.parse_args(argv)

    from eval.config import DecodeConfig, EngineVLLMConfig, EvalConfig
    from eval.run import format_summary, run_eval

    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    work = Path(args.work or tempfile.mkdtemp(prefix=f"suites_{args.name}_"))
    cfg = EvalConfig(drafter=args.drafter, target=args.target, prompts=args.prompts, out_dir=str(work),
                     threads=args.threads, engine="vllm",
                     decode=DecodeConfig(mode="chain", depth=args.depth, temperature=0.0,
                                         max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts),
                     vllm=EngineVLLMConfig(python=args.vllm_python, concurrency=ints(args.concurrency),
                                           num_speculative_tokens=ints(args.sweep)))
    report = run_eval(cfg)
    print(format_summary(report))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"suites_{args.name}"
    kept = portable({k: v for k, v in report.items() if k != "samples"}, work)
    kept["command"] = "python bench/eval_suites.py " + " ".join(argv or __import__("sys").argv[1:])
    out.with_suffix(".json").write_text(dumps(kept, indent=1))
    shutil.copy(work / "categories.md", out.with_suffix(".md"))
    shutil.copy(work / "categories.png", out.with_suffix(".png"))
    print(f"wrote {out}.json / .md / .png (full report: {work / 'report.json'})")
    return kept


if __name__ == "__main__":
    main()
