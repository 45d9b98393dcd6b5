#!/usr/bin/env python
"""Each stage of the pipeline in fp32 and in bf16 on this machine, side by side in one run, each rate also as a
share of the machine's measured matmul peak in that dtype; and `make demo` cold on a fresh clone in each dtype.

    python bench/stage_dtypes.py stages [--samples 100] [--train-steps 40] [--prompts 1]
    python bench/stage_dtypes.py demo --dtype bf16     # then --dtype fp32; each merges into demo_dtypes.json

Both pick the dtype the way a user does: every stage's setting stays `auto` and DRAFTERS_CPU_BF16=1 / 0 says
whether this CPU's bf16 units are used (infra/precision.py), so what runs is exactly what `make demo` runs.

`stages`: for each dtype in turn, on the machine alone:
  peak     a 2048 x 2048 x 2048 matmul on 2 threads: GFLOP/s (median of 10, after 3 untimed)
  prep     `make prep` with the demo's settings (one vLLM server on both cores regenerates, then captures) on
           --samples conversations: regeneration's generated tokens/s and capture's prefill tokens/s, as prep's
           summary.json gives them (the vocabulary count comes from its cache: counted once before the runs)
  train    `make train EXP=eagle3_demo` (2 ranks, 1 thread each) for --train-steps steps on the fp32 prep (the
           same data for both dtypes): training tokens/s of the median step (steps after the first)
  decode   `make eval` with the demo's settings (tree, T=0, 128 new tokens) on that run's export, --prompts a
           category: plain decoding's tokens/s (one target forward per token) and speculative decoding's
Share of the peak: the stage's matmul FLOP rate (weights only, attention left out, so a lower bound) over the
peak: capture 2 x the target's decoder-layer parameters per token; regeneration and plain decoding 2 x (layers
+ LM head) per token; training 6 x the drafter's trained parameters x K (TTT steps) + 2 x the target head's per
token (the teacher's logits). Writes bench/results/stage_dtypes.{json,png}.

`demo`: clones HEAD into a temporary directory, with an empty DRAFTERS_CACHE (the target converted from its GGUF,
the vocabulary counted anew, as on a fresh machine; pip's own download cache is left as it is), runs `make demo`
and records its wall time, each stage's end (from the files it writes), the dtypes each stage ran in, and the
demo's numbers (held-out simulated tau, MT-bench tau, outputs identical to plain decoding). Merges its row into
bench/results/demo_dtypes.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from infra.strict_json import dumps

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DTYPES = {"fp32": "0", "bf16": "1"}  # DRAFTERS_CPU_BF16
TARGET = "smollm2-135m-instruct"
DEMO_EVAL = ("decode.mode=tree decode.temperature=0 decode.max_new_tokens=128 decode.auto_total_tokens=true "
             "threads=2")


def matmul_peak(dtype: str, n: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of an n^3 matmul on 2 threads, in a fresh process (its own thread settings)."""
    code = (f"import torch, time, statistics; torch.set_num_threads(2); dt = torch.{dtype}; "
            f"a = torch.randn({n}, {n}).to(dt); b = torch.randn({n}, {n}).to(dt)\n"
            "for _ in range(3): a @ b\n"
            "ts = []\n"
            f"for _ in range({repeats}):\n"
            "    t = time.perf_counter(); a @ b; ts.append(time.perf_counter() - t)\n"
            f"print(2 * {n} ** 3 / statistics.median(ts) / 1e9)")
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.strip().splitlines()[-1])


def make(target: str, log: Path, env: dict, **variables: str) -> float:
    """`make <target> VAR=value ...` in the repository; its wall seconds; the log kept at `log`."""
    args = ["make", target, *(f"{k}={v}" for k, v in variables.items())]
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def stage_env(dtype: str) -> dict:
    return {**os.environ, "DRAFTERS_CPU_BF16": DTYPES[dtype]}


def target_params() -> dict:
    """The embedded target's parameter counts: its decoder layers (and final norm) and its LM head."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from data_prep.targets import materialise_embedded, resolve_target

    config = AutoConfig.from_pretrained(materialise_embedded(resolve_target(TARGET)))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight.numel()
    return {"layers": sum(p.numel() for p in model.parameters()) - embed,
            "head": config.vocab_size * config.hidden_size}


def drafter_params(export: Path) -> int:
    """The export's trained parameters (the embedding it shares with the target left out)."""
    from safetensors import safe_open

    with safe_open(str(export / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if "embed_tokens" not in k)


def train_rate(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("kind") == "train" and r["step"] > 1]  # step 1's window misses its batch
    seconds = statistics.median(r["tokens"] / r["tokens_per_s"] for r in steps)
    tokens = statistics.median(r["tokens"] for r in steps)
    summary = json.loads((run / "summary.json").read_text())
    return {"precision": summary["precision"], "steps": len(steps) + 1, "step_s_median": seconds,
            "tokens_per_step_median": tokens, "tokens_per_s": tokens / seconds, "ttt_steps": summary["ttt_steps"]}


def cmd_stages(args: argparse.Namespace) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="stage_dtypes."))
    work.mkdir(parents=True, exist_ok=True)
    params = target_params()
    rows: dict[str, dict] = {}
    for dtype in DTYPES:
        env = stage_env(dtype)
        row: dict = {"peak_gflops": matmul_peak({"fp32": "float32", "bf16": "bfloat16"}[dtype])}
        prep = work / f"prep_{dtype}"
        shutil.rmtree(prep, ignore_errors=True)
        row["prep_wall_s"] = make("prep", work / f"prep_{dtype}.log", env, PREP_DIR=str(prep), NPROC="1",
                                  NUM_SAMPLES=str(args.samples), OMP_NUM_THREADS="2",
                                  VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="6",
                                  ARGS="$(DEMO_PREP_ARGS) $(DEMO_VLLM_ARGS)")
        summary = json.loads((prep / "summary.json").read_text())
        row.update(prep_dtype=summary["dtype"], regen_tokens_per_s=summary["regen_tokens_per_s"],
                   capture_tokens_per_s=summary["capture_tokens_per_s"])
        run = work / f"run_{dtype}"
        shutil.rmtree(run, ignore_errors=True)
        row["train_wall_s"] = make("train", work / f"train_{dtype}.log", env, EXP="eagle3_demo",
                                   PREP_DIR=str(work / "prep_fp32"), RUN_DIR=str(run),
                                   ARGS=f"train.eval_interval=0 train.save_interval=0 train.epochs=1000 "
                                        f"train.max_steps={args.train_steps}")
        row["train"] = train_rate(run)
        row["eval_wall_s"] = make("eval", work / f"eval_{dtype}.log", env, RUN_DIR=str(run),
                                  ARGS=f"{DEMO_EVAL} decode.num_prompts={args.prompts}")
        report = json.loads((run / "eval" / "report.json").read_text())
        row.update(eval_dtype=report["dtype"], plain_tokens_per_s=report["tokens_per_s"]["baseline"],
                   speculative_tokens_per_s=report["tokens_per_s"]["speculative"],
                   outputs_identical=report["outputs_identical_to_baseline"])
        drafter = drafter_params(run / "export")
        flops = {  # matmul FLOPs per token of each stage (weights only)
            "capture": 2 * params["layers"],
            "regeneration": 2 * (params["layers"] + params["head"]),
            "training": 6 * drafter * row["train"]["ttt_steps"] + 2 * params["head"],
            "plain_decoding": 2 * (params["layers"] + params["head"]),
        }
        rates = {"capture": row["capture_tokens_per_s"], "regeneration": row["regen_tokens_per_s"],
                 "training": row["train"]["tokens_per_s"], "plain_decoding": row["plain_tokens_per_s"],
                 "speculative_decoding": row["speculative_tokens_per_s"]}
        row["tokens_per_s"] = rates
        row["share_of_peak"] = {k: rates[k] * flops[k] / (row["peak_gflops"] * 1e9) for k in flops}
        rows[dtype] = row
        print(dumps({dtype: row}, indent=1), flush=True)
    result = {
        "what": "each stage's tokens/s in fp32 and bf16 (DRAFTERS_CPU_BF16=0/1, every setting auto), the demo's "
                "settings, one run, the machine alone",
        "cpu": _cpu_name(), "cpu_bf16_flags": sorted(_bf16_flags()), "samples": args.samples,
        "train_steps": args.train_steps, "prompts_per_category": args.prompts,
        "target_params": params, "rows": rows,
        "bf16_over_fp32": {k: rows["bf16"]["tokens_per_s"][k] / rows["fp32"]["tokens_per_s"][k]
                           for k in rows["fp32"]["tokens_per_s"]},
        "peak_bf16_over_fp32": rows["bf16"]["peak_gflops"] / rows["fp32"]["peak_gflops"],
        "share_definition": "the stage's matmul FLOP rate (weights only, attention left out) over the peak "
                            "GFLOP/s of a 2048^3 matmul on 2 threads in the same dtype",
    }
    out = Path(args.out)
    out.write_text(dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(dumps({k: result[k] for k in ("bf16_over_fp32", "peak_bf16_over_fp32")}, indent=1))
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = list(result["bf16_over_fp32"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    ratios = [result["bf16_over_fp32"][s] for s in stages]
    a.bar(stages, ratios, color="tab:blue")
    a.axhline(result["peak_bf16_over_fp32"], color="tab:red", ls="--", label="matmul peak ratio")
    a.axhline(1.0, color="grey", lw=0.8)
    a.set_ylabel("bf16 tokens/s / fp32 tokens/s")
    a.set_title("bf16 over fp32, per stage")
    a.legend()
    a.tick_params(axis="x", rotation=30)
    shared = [s for s in stages if s in result["rows"]["fp32"]["share_of_peak"]]
    x = range(len(shared))
    for i, dtype in enumerate(("fp32", "bf16")):
        shares = [100 * result["rows"][dtype]["share_of_peak"][s] for s in shared]
        b.bar([j + 0.4 * i for j in x], shares, width=0.4, label=dtype)
    b.set_xticks([j + 0.2 for j in x], shared, rotation=30)
    b.set_ylabel("% of the matmul peak in that dtype")
    b.set_title("matmul FLOP rate / peak (weights only)")
    b.legend()
    fig.suptitle(f"{result['cpu']}: peak {result['rows']['fp32']['peak_gflops']:.0f} GFLOP/s fp32, "
                 f"{result['rows']['bf16']['peak_gflops']:.0f} bf16 (2 threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def _bf16_flags() -> set[str]:
    from infra.precision import BF16_CPU_FLAGS, cpu_flags

    return set(BF16_CPU_FLAGS) & cpu_flags()


def cmd_demo(args: argparse.Namespace) -> dict:
    clone = Path(tempfile.mkdtemp(prefix=f"demo_{args.dtype}."))
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone / "repo")], check=True)
    repo = clone / "repo"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                            check=True).stdout.strip()
    env = {**stage_env(args.dtype), "DRAFTERS_CACHE": str(clone / "cache")}
    env.pop("PYTHONPATH", None)
    log = clone / "demo.log"
    start = time.time()
    with open(log, "w") as f:
        done = subprocess.run(["make", "demo"], cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - start
    if done.returncode:
        raise SystemExit(f"make demo ({args.dtype}) failed (exit {done.returncode}); see {log}")
    out = repo / "outputs"
    prep_summary = out / "prep" / TARGET / "summary.json"
    run = out / "runs" / "demo"
    ends = {"setup": repo / ".venv" / ".installed", "prep": prep_summary, "train": run / "summary.json",
            "eval": run / "eval" / "report.json"}
    stage_s, last = {}, start
    for name, path in ends.items():
        stage_s[name] = path.stat().st_mtime - last
        last = path.stat().st_mtime
    stage_s["summary"] = start + wall - last
    prep, train = json.loads(prep_summary.read_text()), json.loads((run / "summary.json").read_text())
    report = json.loads((run / "eval" / "report.json").read_text())
    row = {
        "commit": commit, "wall_s": wall, "stage_s": stage_s,
        "dtypes": {"prep": prep["dtype"], "train": train["precision"], "eval": report["dtype"]},
        "prep_samples": prep["samples"], "regen_tokens_per_s": prep["regen_tokens_per_s"],
        "capture_tokens_per_s": prep["capture_tokens_per_s"], "train_steps": train["steps"],
        "held_out_sim_tau": (train.get("eval") or {}).get("sim_tau"),
        "mtbench_tau": report["tau_pooled"], "mtbench_tau_ci95": report.get("tau_ci95"),
        "mtbench_turns": report["num_requests"], "outputs_identical": report.get("outputs_identical_to_baseline"),
        "tokens_per_s": report["tokens_per_s"], "speedup": report["speedup"],
    }
    path = Path(args.out)
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.setdefault("what", "make demo cold on a fresh clone (empty DRAFTERS_CACHE), DRAFTERS_CPU_BF16=0 (fp32) "
                              "or 1 (bf16), every setting auto; stage_s: from the previous stage's end to the file "
                              "each stage writes last; held-out sim tau from training's own eval")
    merged["cpu"] = _cpu_name()
    merged.setdefault("rows", {})[args.dtype] = row
    path.write_text(dumps(merged, indent=1) + "\n")
    print(dumps({args.dtype: row}, indent=1))
    if not args.keep:
        shutil.rmtree(clone, ignore_errors=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stages", help="each stage's rate in fp32 and bf16")
    s.add_argument("--samples", type=int, default=100, help="prep's num_samples")
    s.add_argument("--train-steps", type=int, default=40)
    s.add_argument("--prompts", type=int, default=1, help="MT-bench prompts per category for the decode stage")
    s.add_argument("--work", default=None, help="where the preps and runs go (default: a temporary directory)")
    s.add_argument("--out", default=str(RESULTS / "stage_dtypes.json"))
    d = sub.add_parser("demo", help="make demo cold on a fresh clone in one dtype")
    d.add_argument("--dtype", choices=sorted(DTYPES), required=True)
    d.add_argument("--out", default=str(RESULTS / "demo_dtypes.json"))
    d.add_argument("--keep", action="store_true", help="keep the clone and its outputs")
    args = p.parse_args()
    (cmd_stages if args.cmd == "stages" else cmd_demo)(args)


if __name__ == "__main__":
    main()
