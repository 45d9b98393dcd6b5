#!/usr/bin/env python
"""Training-step benchmark: time and peak memory of ONE full training step of this pipeline vs sequence length.

    python bench/train_step.py --seq-lens 1024,2048,4096,8192
    python bench/train_step.py --seq-lens 1024,2048 --specforge-python /path/to/specforge-venv/bin/python

The step is what launch/train.py runs per micro-batch, through the same code: train.trainer.micro_step
(count_valid -> global normaliser -> ttt_loss -> engine.backward) + engine.step() on the DeepSpeed
engine (ZeRO stage --zero-stage, default 3 as in training; 1 process, gloo), for the drafter of the
embedded target (SmolLM2-135M geometry: hidden 576, 9/3 heads, head_dim 64, intermediate 1536, vocab
49152, draft vocab 32000), random weights, synthetic bf16 taps and teacher hidden states (the full-vocab
"hidden" teacher), K=7, 1 thread, bf16 (--precision). Each length runs in a FRESH subprocess (peak RSS
belongs to that length alone): --warmup untimed steps, then --repeats timed steps; one JSON line per
length, all of them in --out. With --specforge-python, ../shared/bench/specforge_step.py (the optional harness
beside the checkout that runs the peer's own step) runs for the same lengths with the same thread count, warmup and
repeats, and the ratios (ours / SpecForge) are printed. Both workers get the same environment, including
MALLOC_MMAP_THRESHOLD_ (--mmap-threshold) so that peak RSS measures live tensors, not glibc's retention.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The optional side-by-side harness lives beside the checkout, never inside it (README, "Measured results").
SPECFORGE_STEP = ROOT.parent / "shared" / "bench" / "specforge_step.py"
GEOMETRIES: dict[str, dict] = {
    "embedded": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     intermediate_size=1536, vocab_size=49152, num_hidden_layers=30, draft_vocab_size=32000),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=128, vocab_size=512, num_hidden_layers=8, draft_vocab_size=128),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="1024,2048,4096,8192")
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="embedded")
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--chunk-size", type=int, default=2048, help="loss chunk (target positions), train.chunk_size")
    p.add_argument("--checkpoint-layer", action=argparse.BooleanOptionalAction, default=False,
                   help="activation-checkpoint the drafter layer per TTT step (train.checkpoint_layer)")
    p.add_argument("--attn", default="auto", help="model.attn_backend")
    p.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mmap-threshold", type=int, default=65536, help="glibc MALLOC_MMAP_THRESHOLD_; 0 = default")
    p.add_argument("--timeout", type=float, default=None, help="seconds per length and side")
    p.add_argument("--specforge-python", default=None, help="python of a venv with specforge==0.2.0 installed")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "train_step.json"))
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from models.attention import resolve_backend
    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.target_head import TargetHead
    from train.batch import Batch
    from train.config import DeepSpeedConfig, TrainConfig
    from train.eagle3 import Eagle3Objective
    from train.engine import Engine, init_distributed
    from train.trainer import micro_step
    from train.ttt import TTTSettings

    t0 = time.perf_counter()
    seq_len = args.worker
    geo = dict(GEOMETRIES[args.geometry])
    vd, V, H = geo.pop("draft_vocab_size"), geo["vocab_size"], geo["hidden_size"]
    hf = {**geo, "max_position_embeddings": max(seq_len + args.ttt_steps + 1, 2048), "rope_theta": 10000.0}
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(hf, draft_vocab_size=vd), attn_backend=args.attn)
    draft_ids = torch.randperm(V)[:vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    drafter.load_target_embedding(torch.randn(V, H) * 0.02)
    drafter.set_vocab_mapping(draft_ids - torch.arange(vd), t2d)
    head = TargetHead(H, V, rms_norm_eps=1e-5)
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.02)
    batch = Batch(
        input_ids=torch.randint(1, V, (1, seq_len)),
        loss_mask=torch.ones(1, seq_len, dtype=torch.bool),
        valid=torch.ones(1, seq_len, dtype=torch.bool),
        taps=torch.randn(1, seq_len, len(drafter.cfg.aux_layer_ids) * H).bfloat16(),
        teacher_hidden=(torch.randn(1, seq_len, H) * 4).bfloat16(),
        sample_ids=["synthetic"],
    )
    rank, world = init_distributed("auto")
    ds_cfg = DeepSpeedConfig(zero_stage=args.zero_stage, precision=args.precision)
    engine = Engine(ds_cfg, TrainConfig(ttt_steps=args.ttt_steps, chunk_size=args.chunk_size, warmup_steps=0), 1000)
    head.to(engine.device, engine.dtype)
    module = engine.prepare(drafter, keep_gathered=Eagle3Objective.keep_gathered)
    objective = Eagle3Objective(
        TTTSettings(steps=args.ttt_steps, chunk_size=args.chunk_size, checkpoint_layer=args.checkpoint_layer)
    )
    cuda = engine.device.type == "cuda"
    build_s, rss_after_build = time.perf_counter() - t0, _peak_rss_mb()

    times, losses = [], []
    for i in range(args.warmup + args.repeats):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        packed, _ = micro_step(engine, module, head, batch, objective, world)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        losses.append(float(packed[0]))
        if i >= args.warmup:
            times.append(time.perf_counter() - t)
    out = {
        "side": "ours",
        "seq_len": seq_len,
        "step_s_median": round(statistics.median(times), 4),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "loss": round(losses[args.warmup] if len(losses) > args.warmup else losses[-1], 5),
        "step_s_all": [round(x, 4) for x in times],
        "losses": [round(x, 5) for x in losses],
        "rss_after_build_mb": round(rss_after_build, 1),
        "build_s": round(build_s, 2),
        "geometry": args.geometry,
        "ttt_steps": args.ttt_steps,
        "chunk_size": args.chunk_size,
        "checkpoint_layer": args.checkpoint_layer,
        "attn": resolve_backend(module.attn_backend, engine.device),
        "precision": engine.precision,
        "zero_stage": args.zero_stage,
        "threads": torch.get_num_threads(),
        "trainable_params": sum(p.numel() for p in drafter.parameters() if p.requires_grad),
        "torch": torch.__version__,
    }
    if cuda:
        out["cuda_max_alloc_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    engine.destroy()
    return out


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(args.threads), PYTHONWARNINGS="ignore")
    if args.mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    return env


def _run_json(cmd: list[str], args: argparse.Namespace, seq_len: int, side: str) -> dict:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(args), timeout=args.timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"side": side, "seq_len": seq_len, "error": f"timeout after {args.timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"side": side, "seq_len": seq_len, "error": f"exit {r.returncode}", "stderr": r.stderr[-2000:]}
    return {"side": side, **json.loads(lines[-1])}


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args)), flush=True)
        return []
    rows: list[dict] = []
    passthrough = [f"--geometry={args.geometry}", f"--ttt-steps={args.ttt_steps}", f"--chunk-size={args.chunk_size}",
                   f"--attn={args.attn}", f"--precision={args.precision}", f"--zero-stage={args.zero_stage}",
                   f"--threads={args.threads}", f"--warmup={args.warmup}", f"--repeats={args.repeats}",
                   "--checkpoint-layer" if args.checkpoint_layer else "--no-checkpoint-layer"]
    for n in (int(x) for x in args.seq_lens.split(",")):
        ours = _run_json([sys.executable, __file__, f"--worker={n}", *passthrough], args, n, "ours")
        rows.append(ours)
        print(json.dumps(ours), flush=True)
        if args.specforge_python:
            peer = _run_json(
                [args.specforge_python, str(SPECFORGE_STEP), f"--seq-len={n}", f"--threads={args.threads}",
                 f"--ttt-length={args.ttt_steps}", f"--warmup={args.warmup}", f"--repeats={args.repeats}",
                 f"--dtype={args.precision}"],
                args, n, "specforge",
            )
            rows.append(peer)
            print(json.dumps(peer), flush=True)
            if "error" not in ours and "error" not in peer:
                print(f"T={n}: step time ours/specforge = {ours['step_s_median'] / peer['step_s_median']:.2f}, "
                      f"peak RSS ours/specforge = {ours['peak_rss_mb'] / peer['peak_rss_mb']:.2f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "worker"}, "rows": rows}, indent=1))
    print(f"results: {out}", flush=True)
    return rows


if __name__ == "__main__":
    main()
