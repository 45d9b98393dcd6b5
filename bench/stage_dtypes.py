#!/usr/bin/env python
"""Each stage of the pipeline in fp32 and in bf16 on this machine, side by side in one run, each rate also as a
share of the machine's measured matmul peak in that dtype; and `make demo` cold on a fresh clone in each dtype.

    python bench/stage_dtypes.py stages [--samples 100] [--train-steps 40] [--prompts 1]
    python bench/stage_dtypes.py demo --dtype bf16     # then --dtype fp32; each merges into demo_dtypes.json
    python bench/stage_dtypes.py demo --dtype bf16 --label bf16_200 --make NUM_SAMPLES=200 ...   # other data
    python bench/stage_dtypes.py decode-bandwidth      # plain decoding against the machine's memory bandwidth
    python bench/stage_dtypes.py budget --work DIR --variants 173:6,260:4,403:3   # where the demo's time pays

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
demo's numbers (held-out simulated tau, MT-bench tau, outputs identical to plain decoding). Merges its row (named
--label, the dtype by default; --make VAR=value sets the demo's make variables) into bench/results/demo_dtypes.json
and draws demo_dtypes.png.

`decode-bandwidth`: batch-1 decoding reads every weight once per token, so its bound is the memory's read
bandwidth, not the matmul peak. For each dtype: the read bandwidth (a sum over a 256 MiB tensor on 2 threads, median
of 10) and plain decoding's one-token step as eval runs it (the embedded target, a 256-token context, a KV cache;
median of 30), whose weight bytes over its time give the bandwidth it reaches. Merges "decode_bandwidth" into stage_dtypes.json.

`budget`: what the demo's minutes buy, in this machine's default dtype: one `make prep` with the demo's settings on
--samples conversations, then `make train EXP=eagle3_demo` (2 ranks, held-out eval at the end) on nested subsets of
n of its training conversations (data.train_samples=n: by sha256 of the sample ids) for e epochs, each variant
n:e; held-out simulated tau (38 conversations, 7 TTT steps), steps and training wall seconds per variant, and the
prep's regeneration and capture tokens/s. Resumable: a finished prep or run in --work is read
back. Writes bench/results/demo_budget.json.
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
TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
TARGET = "smollm2-135m-instruct"
DEMO_EVAL = ("decode.mode=tree decode.temperature=0 decode.max_new_tokens=128 decode.auto_total_tokens=true "
             "threads=2")


def fresh_python(code: str) -> float:
    """Run `code` in a fresh .venv python (its own thread settings; the repository importable) and return the number
    its last line prints."""
    out = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def matmul_peak(dtype: str, n: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of an n^3 matmul on 2 threads, in a fresh process."""
    return fresh_python(
        f"import torch, time, statistics; torch.set_num_threads(2); dt = torch.{TORCH_DTYPES[dtype]}; "
        f"a = torch.randn({n}, {n}).to(dt); b = torch.randn({n}, {n}).to(dt)\n"
        "for _ in range(3): a @ b\n"
        "ts = []\n"
        f"for _ in range({repeats}):\n"
        "    t = time.perf_counter(); a @ b; ts.append(time.perf_counter() - t)\n"
        f"print(2 * {n} ** 3 / statistics.median(ts) / 1e9)")


def make(target: str, log: Path, env: dict, **variables: str) -> float:
    """`make <target> VAR=value ...` in the repository; its wall seconds; the log kept at `log`."""
    args = ["make", target, *(f"{k}={v}" for k, v in variables.items())]
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def make_demo_prep(prep: Path, log: Path, env: dict, samples: int) -> float:
    """`make prep` with the demo's settings (one vLLM server on both cores) on `samples` conversations; its wall s."""
    return make("prep", log, env, PREP_DIR=str(prep), NPROC="1", NUM_SAMPLES=str(samples), OMP_NUM_THREADS="2",
                VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="6",
                ARGS="$(DEMO_PREP_ARGS) $(DEMO_VLLM_ARGS)")


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
        row: dict = {"peak_gflops": matmul_peak(dtype)}
        prep = work / f"prep_{dtype}"
        shutil.rmtree(prep, ignore_errors=True)
        row["prep_wall_s"] = make_demo_prep(prep, work / f"prep_{dtype}.log", env, args.samples)
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
    label = args.label or args.dtype
    clone = Path(tempfile.mkdtemp(prefix=f"demo_{label}."))
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone / "repo")], check=True)
    repo = clone / "repo"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                            check=True).stdout.strip()
    env = {**stage_env(args.dtype), "DRAFTERS_CACHE": str(clone / "cache")}
    env.pop("PYTHONPATH", None)
    log = clone / "demo.log"
    start = time.time()
    with open(log, "w") as f:
        done = subprocess.run(["make", "demo", *args.make], cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - start
    if done.returncode:
        raise SystemExit(f"make demo ({label}) failed (exit {done.returncode}); see {log}")
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
        "commit": commit, "make": args.make, "dtype": args.dtype, "wall_s": wall, "stage_s": stage_s,
        "dtypes": {"prep": prep["dtype"], "train": train["precision"], "eval": report["dtype"]},
        "prep_samples": prep["samples"], "regen_tokens_per_s": prep["regen_tokens_per_s"],
        "capture_tokens_per_s": prep["capture_tokens_per_s"], "train_steps": train["steps"],
        "train_epochs": train["epoch"],
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
    merged.setdefault("rows", {})[label] = row
    path.write_text(dumps(merged, indent=1) + "\n")
    plot_demos(merged, path.with_suffix(".png"))
    print(dumps({label: row}, indent=1))
    if not args.keep:
        shutil.rmtree(clone, ignore_errors=True)
    return row


def plot_demos(result: dict, path: Path) -> None:
    """One stacked bar per cold demo: where its minutes went, its taus written beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(result["rows"])
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.7 * len(labels)))
    colors = {"setup": "tab:gray", "prep": "tab:blue", "train": "tab:orange", "eval": "tab:green",
              "summary": "tab:purple"}
    for y, label in enumerate(labels):
        row, left = result["rows"][label], 0.0
        for stage, seconds in row["stage_s"].items():
            ax.barh(y, seconds / 60, left=left, color=colors.get(stage, "black"),
                    label=stage if y == 0 else None)
            left += seconds / 60
        held = row["held_out_sim_tau"]
        ax.text(left + 0.2, y, f"{left:.1f} min; held-out sim tau {held:.3f}, MT-bench tau {row['mtbench_tau']:.3f}"
                if held is not None else f"{left:.1f} min", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)),
                  [f"{lb}\n{result['rows'][lb]['prep_samples']['train']} conv., {result['rows'][lb]['train_steps']} "
                   "steps" for lb in labels], fontsize=8)
    ax.set_xlabel("minutes, cold on a fresh clone")
    ax.set_xlim(0, max(sum(r["stage_s"].values()) for r in result["rows"].values()) / 60 * 1.9)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"make demo on {result['cpu']} (2 cores)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def read_bandwidth(dtype: str) -> float:
    """GB/s of a sum over a 256 MiB tensor on 2 threads, in a fresh process."""
    return fresh_python(
        f"import torch, time, statistics; torch.set_num_threads(2); "
        f"x = torch.ones(256 * 2**20 // {DTYPE_BYTES[dtype]}, dtype=torch.{TORCH_DTYPES[dtype]})\n"
        "for _ in range(3): x.sum()\n"
        "ts = []\n"
        "for _ in range(10):\n"
        "    t = time.perf_counter(); x.sum(); ts.append(time.perf_counter() - t)\n"
        "print(x.numel() * x.element_size() / statistics.median(ts) / 1e9)")


def decode_step_s(dtype: str, context: int = 256) -> float:
    """Median seconds of plain decoding's step as eval runs it (eval/spec_decode.py plain_generate: the target
    loaded by prep's loader, TargetRunner.forward of one token, last logits only) after a `context`-token prefill,
    2 threads, in a fresh process."""
    return fresh_python(f"""
import statistics, time, torch
from data_prep.targets import load_target, resolve_target
from eval.target import TargetRunner
torch.set_num_threads(2)
runner = TargetRunner(load_target(resolve_target({TARGET!r}), {TORCH_DTYPES[dtype]!r}, "cpu")[0].eval())
cache, ts = runner.new_cache(), []
runner.forward(torch.randint(0, 40000, ({context},)).tolist(), cache, want_taps=False, last_logits_only=True)
for i in range(35):
    t = time.perf_counter()
    runner.forward([5], cache, want_taps=False, last_logits_only=True)
    if i >= 5:
        ts.append(time.perf_counter() - t)
print(statistics.median(ts))
""")


def cmd_decode_bandwidth(args: argparse.Namespace) -> dict:
    params = target_params()
    weights = params["layers"] + params["head"]
    rows = {}
    for dtype in DTYPES:
        bandwidth, step = read_bandwidth(dtype), decode_step_s(dtype)
        reached = weights * DTYPE_BYTES[dtype] / step / 1e9
        rows[dtype] = {"read_gb_per_s": bandwidth, "step_s": step, "tokens_per_s": 1 / step,
                       "weight_bytes": weights * DTYPE_BYTES[dtype], "weight_gb_per_s": reached,
                       "share_of_read_bandwidth": reached / bandwidth}
        print(dtype, f"read {bandwidth:.1f} GB/s; one-token step {1000 * step:.1f} ms ({reached:.1f} GB/s of "
              f"weights, {100 * reached / bandwidth:.0f}% of the read bandwidth)")
    path = Path(args.out)
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged["decode_bandwidth"] = {
        "what": "batch-1 decoding reads every weight once per token: plain decoding's one-token step as eval runs "
                "it (the embedded target, 256-token context, KV cache, 2 threads, median of 30) against the read bandwidth of a "
                "256 MiB sum (2 threads, median of 10), one run, the machine alone",
        "rows": rows, "bf16_over_fp32": rows["bf16"]["tokens_per_s"] / rows["fp32"]["tokens_per_s"]}
    path.write_text(dumps(merged, indent=1) + "\n")
    return merged["decode_bandwidth"]


def cmd_budget(args: argparse.Namespace) -> dict:
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    prep = work / "prep"
    if not (prep / "summary.json").exists():
        make_demo_prep(prep, work / "prep.log", env, args.samples)
    summary = json.loads((prep / "summary.json").read_text())
    runs = {}
    for variant in args.variants.split(","):
        n, epochs = (int(x) for x in variant.split(":"))
        run = work / f"run_n{n}_e{epochs}"
        if not (run / "summary.json").exists():
            shutil.rmtree(run, ignore_errors=True)
            make("train", work / f"train_n{n}_e{epochs}.log", env, EXP="eagle3_demo", PREP_DIR=str(prep),
                 RUN_DIR=str(run), ARGS=f"$(DEMO_TRAIN_ARGS) data.train_samples={n} train.epochs={epochs}")
        done = json.loads((run / "summary.json").read_text())
        runs[f"n{n}_e{epochs}"] = {"conversations": n, "epochs": epochs, "steps": done["steps"],
                                   "train_wall_s": done["wall_s"], "precision": done["precision"],
                                   "held_out_sim_tau": done["eval"]["sim_tau"]}
        print(f"{n} conversations x {epochs} epochs: {done['steps']} steps, {done['wall_s']:.0f} s, held-out sim "
              f"tau {done['eval']['sim_tau']:.3f}")
    result = {
        "what": "what the demo's minutes buy: one prep with the demo's settings, then the demo recipe (2 ranks, "
                "held-out eval at the end) on nested subsets of n training conversations for e epochs; one seed "
                "each (the recipe's seed spread of held-out sim tau: 0.045, bench/results/schedule_b4.json)",
        "cpu": _cpu_name(), "prep_samples": summary["samples"], "prep_dtype": summary["dtype"],
        "regen_tokens_per_s": summary["regen_tokens_per_s"], "capture_tokens_per_s": summary["capture_tokens_per_s"],
        "train_tokens": summary["tokens"]["train"],
        "runs": runs,
    }
    out = Path(args.out)
    out.write_text(dumps(result, indent=1) + "\n")
    return result


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
    d.add_argument("--label", default=None, help="the row's name (default: the dtype)")
    d.add_argument("--make", action="append", default=[], metavar="VAR=value",
                   help="a make variable for `make demo` (repeatable), e.g. NUM_SAMPLES=200")
    g = sub.add_parser("budget", help="held-out tau of the demo recipe against conversations and epochs")
    g.add_argument("--work", required=True, help="where the prep and the runs go (resumable)")
    g.add_argument("--samples", type=int, default=450, help="prep's num_samples")
    g.add_argument("--variants", default="173:6,260:4,300:3,403:3,173:8", help="n:epochs, comma-separated")
    g.add_argument("--out", default=str(RESULTS / "demo_budget.json"))
    b = sub.add_parser("decode-bandwidth", help="plain decoding against the memory's read bandwidth")
    b.add_argument("--out", default=str(RESULTS / "stage_dtypes.json"))
    args = p.parse_args()
    {"stages": cmd_stages, "demo": cmd_demo, "decode-bandwidth": cmd_decode_bandwidth,
     "budget": cmd_budget}[args.cmd](args)


if __name__ == "__main__":
    main()
