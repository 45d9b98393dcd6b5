#!/usr/bin/env python
"""Training-step timing: one EAGLE-3 training step on synthetic inputs against the sequence length, and the demo
recipe's step on a real prep under each data source and with or without the teacher cache.

    python bench/train_step.py synthetic --seq-lens 2048,4096 [--geometry embedded] [--engine deepspeed]
        [--specforge-python .venv-specforge/bin/python]
    python bench/train_step.py synthetic --seq-lens 2048,8192,40960 --engine torch --checkpoint-layer \
        --out bench/results/long_context_embedded.json
    python bench/train_step.py recipe --prep outputs/prep/smollm2-135m-instruct --modes offline,online,hybrid
    python bench/train_step.py teacher-cache --prep outputs/prep/smollm2-135m-instruct --epochs 2

`synthetic`: the drafter of a target geometry (`--geometry`: the embedded SmolLM2-135M, gpt-oss-120b, or a tiny
one for tests) with random weights, a random frozen target head, synthetic taps and the exact full-vocabulary
teacher ("hidden"), one sequence of T tokens. Each length runs in a FRESH subprocess, so its peak memory (peak RSS
on CPU, max_memory_allocated on CUDA) belongs to that length alone; CPU workers run with MALLOC_MMAP_THRESHOLD_
(--mmap-threshold) so that peak RSS follows live tensors, not glibc's retention of freed blocks. The step:
- `--engine deepspeed` (default): what launch/train.py runs per micro-batch, train.trainer.micro_step (count_valid ->
  global normaliser -> ttt_loss -> engine.backward) + engine.step() on the DeepSpeed engine (ZeRO stage
  --zero-stage, 1 process, gloo);
- `--engine torch`: ttt_loss + backward + a torch AdamW step, no DeepSpeed (the long-context measurement: nothing
  but the TTT step's own memory).
--warmup untimed steps, then --repeats timed ones. With --specforge-python (a venv with the published `specforge`
package: `make specforge-venv`), `bench/peer_specforge.py step` times the SpecForge package's own offline TTT step
at the same lengths, geometry, K, dtype, threads, warmup and repeats, and the ratios (ours / SpecForge) are printed.
Writes --out (JSON: the arguments and one row per length and side) and a PNG beside it (memory and time against T).

`recipe`: the demo recipe (`+exp=eagle3_demo`, 1 rank, the same seed and so the same global batches) in this
process for --steps optimizer steps per data source (`--modes`: offline reads the prep's shards, online runs the
target inside training, hybrid captures epoch 0 and reads its own shards after), without evaluation, checkpoints or
export. Per mode: the median step time (metrics.jsonl: a step's tokens / tokens_per_s, data loading included; step 1
is left out, its window misses its own batch), the target forward's time per step and its share, and the bytes
each mode needs written (offline: the prep's shards; online: 0; hybrid: the run's own shards).

`teacher-cache`: the same recipe twice, without and with train.teacher_epoch_cache_mb, for --epochs epochs: per
epoch the median step time of each and the median of the per-step ratios (cached / uncached, the same batch on
both sides), the whole run's training-time ratio and the largest difference between the two runs' losses.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from infra.processes import peak_rss_mb
from infra.strict_json import dumps

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
# target geometries: what the drafter copies from the target's config
GEOMETRIES: dict[str, dict] = {
    # SmolLM2-135M-Instruct (the embedded target)
    "embedded": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=49152, num_hidden_layers=30, draft_vocab_size=32000),
    # gpt-oss-120b (= transformers' GptOssConfig defaults, checked): the drafter is a dense Llama layer of the
    # target's width; intermediate_size is the target's (per-expert) 2880, which from_target_config copies.
    "gpt-oss-120b": dict(hidden_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         intermediate_size=2880, vocab_size=201088, num_hidden_layers=36, draft_vocab_size=32000),
    # for smoke tests
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, num_hidden_layers=8, draft_vocab_size=128),
}
TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------- synthetic
def add_synthetic_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-lens", default="2048,4096")
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="embedded")
    p.add_argument("--engine", choices=["deepspeed", "torch"], default="deepspeed",
                   help="deepspeed: the trainer's micro_step + engine.step; torch: ttt_loss + torch AdamW")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=3, help="with --engine deepspeed")
    p.add_argument("--ttt-steps", type=int, default=7, help="TTT steps K")
    p.add_argument("--chunk-size", type=int, default=1024, help="loss chunk (target positions), train.chunk_size")
    p.add_argument("--checkpoint-layer", action=argparse.BooleanOptionalAction, default=False,
                   help="activation-checkpoint the drafter layer per TTT step (train.checkpoint_layer)")
    p.add_argument("--attn", default="auto", help="model.attn_backend (auto|fused|chunked|flash|flex|reference)")
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bf16")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=1, help="timed steps (the median is reported)")
    p.add_argument("--loss-frac", type=float, default=1.0, help="fraction of tokens that are loss targets")
    p.add_argument("--mmap-threshold", type=int, default=65536, help="CPU: glibc MALLOC_MMAP_THRESHOLD_; 0 = default")
    p.add_argument("--timeout", type=float, default=None, help="seconds per length and side")
    p.add_argument("--specforge-python", default=None,
                   help="python of a venv with the specforge package (make specforge-venv): time its step too")
    p.add_argument("--out", default=str(RESULTS / "train_step.json"))
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # run one length in-process


def build(args: argparse.Namespace, seq_len: int, cast_drafter: bool = True):
    """Drafter, frozen head, batch and a torch AdamW of the benchmark (random weights and data), on the device; the
    drafter stays fp32 with cast_drafter=False (DeepSpeed casts what it trains itself)."""
    import torch

    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.target_head import TargetHead
    from train.batch import Batch

    geo = dict(GEOMETRIES[args.geometry])
    vd = geo.pop("draft_vocab_size")
    dtype, device = getattr(torch, TORCH_DTYPES[args.dtype]), torch.device(args.device or "cpu")
    hf = {**geo, "max_position_embeddings": max(seq_len + args.ttt_steps + 1, 2048), "rope_theta": 10000.0}
    cfg = Eagle3Config.from_target_config(hf, draft_vocab_size=vd)
    torch.manual_seed(0)
    V, H = geo["vocab_size"], geo["hidden_size"]
    draft_ids = torch.randperm(V)[:vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    drafter = Eagle3Drafter(cfg, attn_backend=args.attn)
    drafter.load_target_embedding(torch.randn(V, H) * 0.02)
    drafter.set_vocab_mapping(draft_ids - torch.arange(vd), t2d)
    drafter = drafter.to(device=device, dtype=dtype if cast_drafter else torch.float32)
    head = TargetHead(H, V, rms_norm_eps=1e-5)
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.02)
    head = head.to(device=device, dtype=dtype)
    batch = Batch(
        input_ids=torch.randint(1, V, (1, seq_len)),
        loss_mask=torch.rand(1, seq_len) < args.loss_frac,
        valid=torch.ones(1, seq_len, dtype=torch.bool),
        taps=torch.randn(1, seq_len, len(cfg.tap_layers) * H),
        teacher_hidden=torch.randn(1, seq_len, H) * 4,
        sample_ids=["synthetic"],
    ).to(device, dtype)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-4)
    return drafter, head, batch, opt


def worker(args: argparse.Namespace) -> dict:
    """One length in this process: --warmup untimed steps, --repeats timed ones."""
    import torch

    from models.attention import resolve_backend
    from train.ttt import TTTSettings, ttt_loss

    torch.set_num_threads(args.threads)
    seq_len, device = args.worker, torch.device(args.device or "cpu")
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    drafter, head, batch, opt = build(args, seq_len, cast_drafter=args.engine == "torch")
    settings = TTTSettings(steps=args.ttt_steps, chunk_size=args.chunk_size, checkpoint_layer=args.checkpoint_layer)
    if args.engine == "deepspeed":
        from train.config import DeepSpeedConfig, TrainConfig
        from train.eagle3 import Eagle3Objective
        from train.engine import Engine, init_distributed
        from train.trainer import micro_step

        _, world = init_distributed("auto")
        engine = Engine(DeepSpeedConfig(zero_stage=args.zero_stage, precision=args.dtype),
                        TrainConfig(ttt_steps=args.ttt_steps, chunk_size=args.chunk_size,
                                    checkpoint_layer=args.checkpoint_layer, warmup_steps=0), 1000)
        head.to(engine.device, engine.dtype)
        module = engine.prepare(drafter, keep_gathered=Eagle3Objective.keep_gathered)
        objective = Eagle3Objective(settings)

        def one_step() -> float:
            packed, _ = micro_step(engine, module, head, batch, objective, world)
            engine.step()
            return float(packed[0])
        attn = resolve_backend(module.attn_backend, engine.device)
    else:
        engine = None

        def one_step() -> float:
            opt.zero_grad(set_to_none=True)
            loss, _ = ttt_loss(drafter, head, batch, settings)
            loss.backward()
            opt.step()
            return float(loss.detach())
        attn = resolve_backend(args.attn, device)
    build_s = time.perf_counter() - t0

    losses, times = [], []
    for i in range(args.warmup + args.repeats):
        if i == args.warmup:  # memory before the timed steps: weights, data (and the optimizer state after warmup)
            base = torch.cuda.memory_allocated() / 2**20 if cuda else peak_rss_mb()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        if cuda:
            torch.cuda.synchronize()
        tic = time.perf_counter()
        losses.append(one_step())
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - tic)
    peak_rss = peak_rss_mb()
    out = {
        "side": "ours", "seq_len": seq_len, "geometry": args.geometry, "engine": args.engine,
        "step_s": round(statistics.median(times), 4), "step_s_all": [round(x, 4) for x in times],
        "peak_mem_mb": round(torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss, 1),
        "peak_mem_kind": "cuda_max_memory_allocated" if cuda else "peak_rss",
        "base_mem_mb": round(base, 1), "peak_rss_mb": round(peak_rss, 1),
        "loss": round(losses[args.warmup], 5), "losses": [round(x, 5) for x in losses],
        "build_s": round(build_s, 2), "ttt_steps": args.ttt_steps, "chunk_size": args.chunk_size,
        "checkpoint_layer": args.checkpoint_layer, "attn_backend": attn, "dtype": args.dtype,
        "zero_stage": args.zero_stage if engine is not None else None, "device": str(device),
        "threads": torch.get_num_threads(), "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "trainable_params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "torch": torch.__version__,
    }
    if engine is not None:
        engine.destroy()
    return out


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The settings of this run as worker flags (the device resolved here, once)."""
    flags = {"--geometry": args.geometry, "--engine": args.engine, "--zero-stage": args.zero_stage,
             "--ttt-steps": args.ttt_steps, "--chunk-size": args.chunk_size, "--attn": args.attn,
             "--dtype": args.dtype, "--device": args.device, "--threads": args.threads, "--warmup": args.warmup,
             "--repeats": args.repeats, "--loss-frac": args.loss_frac}
    out = [f"{k}={v}" for k, v in flags.items()]
    return out + ["--checkpoint-layer" if args.checkpoint_layer else "--no-checkpoint-layer"]


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    if args.device == "cpu" and args.mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    return env


def run_json(cmd: list[str], seq_len: int, side: str, timeout: float | None = None,
             env: dict[str, str] | None = None) -> dict:
    """A worker's last JSON line, or the failure recorded (a length that fails does not stop the others)."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"side": side, "seq_len": seq_len, "error": f"timeout after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"side": side, "seq_len": seq_len, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return {"side": side, **json.loads(lines[-1])}


def run_length(argv: list[str], seq_len: int, timeout: float | None = None, env: dict | None = None) -> dict:
    """Our step at one length in a fresh process (`argv`: the synthetic flags)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "synthetic", *argv, f"--worker={seq_len}"]
    return run_json(cmd, seq_len, "ours", timeout, env)


def specforge_argv(args: argparse.Namespace, seq_len: int) -> list[str]:
    return [args.specforge_python, str(ROOT / "bench" / "peer_specforge.py"), "step", f"--seq-len={seq_len}",
            f"--geometry={args.geometry}", f"--ttt-steps={args.ttt_steps}", f"--dtype={args.dtype}",
            f"--threads={args.threads}", f"--warmup={args.warmup}", f"--repeats={args.repeats}"]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    for side in sorted({r["side"] for r in rows}):
        ok = [r for r in rows if r["side"] == side and "error" not in r]
        xs = [r["seq_len"] for r in ok]
        ax_m.plot(xs, [r.get("peak_mem_mb", r.get("peak_rss_mb", 0)) / 1024 for r in ok], "o-", label=f"{side}: peak")
        ax_t.plot(xs, [r.get("step_s", r.get("step_s_median", 0)) for r in ok], "o-", label=side)
    for r in rows:
        if "error" in r:
            for ax in (ax_m, ax_t):
                ax.axvline(r["seq_len"], color="red", alpha=0.4, linestyle=":")
    ax_m.set(xlabel="sequence length T", ylabel="GiB", title="peak memory")
    ax_t.set(xlabel="sequence length T", ylabel="seconds", title="one training step")
    ax_m.legend()
    ax_t.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_synthetic(args: argparse.Namespace) -> list[dict]:
    if args.device is None:
        args.device = "cuda" if _cuda_available() else "cpu"
    if args.worker is not None:
        print(dumps(worker(args)), flush=True)
        return []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    env, rows = _env(args), []
    for n in (int(x) for x in args.seq_lens.split(",") if x):
        ours = run_length(worker_argv(args), n, args.timeout, env)
        rows.append(ours)
        print(dumps(ours), flush=True)
        if args.specforge_python:
            peer = run_json(specforge_argv(args, n), n, "specforge", args.timeout, env)
            rows.append(peer)
            print(dumps(peer), flush=True)
            if "error" not in ours and "error" not in peer:
                print(f"T={n}: step time ours/specforge = {ours['step_s'] / peer['step_s']:.2f}, "
                      f"peak RSS ours/specforge = {ours['peak_rss_mb'] / peer['peak_rss_mb']:.2f}", flush=True)
        record = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")}, "rows": rows}
        out.write_text(dumps(record, indent=1))  # after every length: a crash keeps what ran
    plot(rows, out.with_suffix(".png"))
    print(f"results: {out}", flush=True)
    return rows


# -------------------------------------------------------------------------------------- recipe, teacher-cache
def step_seconds(record: dict) -> float:
    """A train record's step time: its tokens / tokens_per_s (data loading included)."""
    return record["tokens"] / record["tokens_per_s"]


def run_demo_recipe(prep: Path, out: Path, overrides: list[str]) -> tuple[dict, dict[int, dict]]:
    """One 1-rank run of the demo recipe (`+exp=eagle3_demo`) in this process, without evaluation, checkpoints or
    export, `overrides` last: its summary and its train records (metrics.jsonl) by step."""
    from hydra import compose, initialize_config_dir

    from train.config import RunConfig
    from train.metrics import METRICS_FILE, read_metrics
    from train.trainer import run

    overrides = ["+exp=eagle3_demo", f"data.dir={prep}", f"out_dir={out}", "train.eval_interval=0",
                 "train.save_interval=0", "train.export=false", "data.eval_max_samples=2", "logger.wandb_mode=disabled",
                 "logger.progress=false", "train.overwrite=true", *overrides]  # --work reused: each run starts afresh
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = RunConfig.from_omegaconf(compose("train", overrides=overrides)).validate(1)
    summary = run(cfg, out)
    return summary, {r["step"]: r for r in read_metrics(out / METRICS_FILE, kind="train")}


def run_mode(prep: Path, mode: str, steps: int, out: Path, extra: list[str]) -> dict:
    start = time.perf_counter()
    summary, records = run_demo_recipe(prep, out, [f"data.source={mode}", f"train.max_steps={steps}",
                                                   "train.epochs=1000", *extra])
    wall = time.perf_counter() - start
    step_s = [step_seconds(r) for step, r in sorted(records.items()) if step > 1]  # step 1's window misses its batch
    data = summary["data"]
    median = statistics.median(step_s)
    # per optimizer step (one forward per sample, so batch-size forwards a step), not per forward
    forward = data["target_forward_s"] / summary["steps"] if data.get("target_forwards") else 0.0
    if mode == "offline":
        written = json.loads((prep / "summary.json").read_text())["bytes_written"]  # the dump offline reads
    else:
        written = sum(p.stat().st_size for p in (out / "captured").rglob("*") if p.is_file()) if mode == "hybrid" else 0
    return {"mode": mode, "steps": summary["steps"], "step_s_median": median, "step_s_all": step_s,
            "target_forward_s_per_step": forward, "target_share_of_step": forward / median if median else None,
            "bytes_written": written, "tokens": summary["tokens"], "wall_s": wall}


def _start_recipe(args: argparse.Namespace, prefix: str) -> Path:
    import torch

    from train.config import register_configs

    torch.set_num_threads(args.threads)
    register_configs()
    return args.work or Path(tempfile.mkdtemp(prefix=prefix))


def _write(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result, indent=1) + "\n")


def cmd_recipe(args: argparse.Namespace) -> dict:
    import torch

    work = _start_recipe(args, "train_step_recipe.")
    rows = [run_mode(args.prep.resolve(), mode, args.steps, work / mode, shlex.split(args.train_args))
            for mode in args.modes.split(",")]
    result = {"prep": args.prep.name, "threads": args.threads, "train_args": args.train_args,
              "device": "cuda" if torch.cuda.is_available() else "cpu", "rows": rows}
    by_mode = {r["mode"]: r for r in rows}
    if "offline" in by_mode and "online" in by_mode:
        result["online_over_offline_step_time"] = by_mode["online"]["step_s_median"] / by_mode["offline"]["step_s_median"]
    _write(result, args.out)
    print(dumps({k: v for k, v in result.items() if k != "rows"} | {
        "rows": [{k: v for k, v in r.items() if k != "step_s_all"} for r in rows]}, indent=1))
    return result


def cmd_teacher_cache(args: argparse.Namespace) -> dict:
    work = _start_recipe(args, "train_step_teacher_cache.")
    prep, extra = args.prep.resolve(), shlex.split(args.train_args)
    runs = {}
    for name, mb in (("uncached", 0), ("cached", args.cache_mb)):
        summary, runs[name] = run_demo_recipe(prep, work / name, [f"train.epochs={args.epochs}", *extra,
                                                                  f"train.teacher_epoch_cache_mb={mb}"])
    plain, cached = runs["uncached"], runs["cached"]
    per_epoch = summary["steps"] // args.epochs
    epochs = []
    for e in range(args.epochs):
        # step 1 is left out: its window misses its own batch (train.metrics)
        ids = [s for s in range(e * per_epoch + 1, (e + 1) * per_epoch + 1) if s > 1 and s in plain and s in cached]
        epochs.append({"epoch": e, "steps": len(ids),
                       "uncached_step_s_median": statistics.median(step_seconds(plain[s]) for s in ids),
                       "cached_step_s_median": statistics.median(step_seconds(cached[s]) for s in ids),
                       "cached_over_uncached_median": statistics.median(step_seconds(cached[s]) / step_seconds(plain[s])
                                                                          for s in ids)})
    common = sorted(set(plain) & set(cached) - {1})
    total = sum(step_seconds(cached[s]) for s in common) / sum(step_seconds(plain[s]) for s in common)
    loss_diff = max(abs(cached[s]["loss"] - plain[s]["loss"]) for s in common)
    result = {"prep": args.prep.name, "threads": args.threads, "train_args": args.train_args,
              "cache_mb": args.cache_mb, "steps_per_epoch": per_epoch, "steps": summary["steps"], "epochs": epochs,
              "training_time_ratio": total, "max_abs_loss_difference": loss_diff}
    _write(result, args.out)
    print(dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------------------------- cli
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    add_synthetic_args(sub.add_parser("synthetic", help="one step on synthetic inputs against the length"))
    for name, default_out in (("recipe", "online_vs_offline.json"), ("teacher-cache", "teacher_cache.json")):
        s = sub.add_parser(name, help="the demo recipe on a prep: " + (
            "offline / online / hybrid" if name == "recipe" else "with and without the teacher cache"))
        s.add_argument("--prep", required=True, type=Path, help="a finished prep dir (shards + rendered samples)")
        s.add_argument("--threads", type=int, default=2)
        s.add_argument("--train-args", default="", help="extra Hydra overrides for every run")
        s.add_argument("--work", type=Path, default=None, help="run dirs (default: a temporary directory)")
        s.add_argument("--out", type=Path, default=RESULTS / default_out)
        if name == "recipe":
            s.add_argument("--steps", type=int, default=20)
            s.add_argument("--modes", default="offline,online", help="comma-separated: offline, online, hybrid")
        else:
            s.add_argument("--epochs", type=int, default=2)
            s.add_argument("--cache-mb", type=int, default=4096, help="the cache's budget (MB per process)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    return {"synthetic": cmd_synthetic, "recipe": cmd_recipe, "teacher-cache": cmd_teacher_cache}[args.cmd](args)


if __name__ == "__main__":
    main()
