#!/usr/bin/env python
"""Long-context TTT benchmark: time and peak memory of ONE full EAGLE-3 training step vs sequence length.

    python bench/long_context.py --seq-lens 2048,4096,8192,16384,32768,40960 --geometry gpt-oss-120b

Each length runs in a FRESH subprocess, so the peak memory (peak RSS on CPU, max_memory_allocated on CUDA)
belongs to that length alone. The step is the real one: drafter = Eagle3Drafter of the geometry, random
frozen TargetHead, synthetic bf16 taps / teacher_hidden (teacher "hidden": the full-vocab teacher,
the expensive case), K TTT steps forward + backward + AdamW step. One JSON line per length is printed
and all of them are written to --out, with a PNG (memory and time vs T) next to it.
On CPU, the workers run with MALLOC_MMAP_THRESHOLD_=65536 (--mmap-threshold): with glibc's default,
freed large tensors stay in the heap and peak RSS measures the allocator's retention (about 0.6 MB per
token here at 256-512 tokens, embedded geometry) instead of live tensors (+4 MB from 256 to 512 tokens).
The claim it checks: memory grows linearly in T (the TTT attention and the chunked loss keep nothing
quadratic and nothing vocabulary-sized for the whole sequence).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# target geometries (what the drafter copies from the target's config)
GEOMETRIES: dict[str, dict] = {
    # SmolLM2-135M-Instruct (the embedded target)
    "embedded": dict(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        num_hidden_layers=30,
        draft_vocab_size=32000,
    ),
    # gpt-oss-120b (= transformers' GptOssConfig defaults, checked): the drafter is a dense Llama layer of the
    # target's width; intermediate_size is the target's (per-expert) 2880, which from_target_config copies.
    "gpt-oss-120b": dict(
        hidden_size=2880,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        vocab_size=201088,
        num_hidden_layers=36,
        draft_vocab_size=32000,
    ),
    # for smoke tests
    "tiny": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        num_hidden_layers=8,
        draft_vocab_size=128,
    ),
}
DTYPES = ("bfloat16", "float32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="2048,4096,8192,16384,32768,40960")
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="embedded")
    p.add_argument("--steps", type=int, default=7, help="TTT steps K")
    p.add_argument("--chunk-size", type=int, default=1024, help="loss chunk (target positions)")
    p.add_argument(
        "--checkpoint-layer",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="activation-checkpoint the drafter layer per TTT step",
    )
    p.add_argument(
        "--attn", default="auto", help="attention backend (auto|fused|chunked|flash|flex|reference)"
    )
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="parameter / activation dtype")
    p.add_argument("--device", default="cuda" if _cuda_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--warmup", type=int, default=-1, help="untimed steps first (-1: 1 on CUDA, 0 on CPU)")
    p.add_argument("--loss-frac", type=float, default=1.0, help="fraction of tokens that are loss-masked")
    p.add_argument(
        "--mmap-threshold",
        type=int,
        default=65536,
        help="CPU: glibc MALLOC_MMAP_THRESHOLD_ (bytes) for the workers; 0 = glibc default (see module doc)",
    )
    p.add_argument("--timeout", type=float, default=None, help="seconds per length (subprocess)")
    p.add_argument("--out", default=None, help="default bench/results/long_context_<geometry>.json")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)  # run one length in-process
    return p.parse_args(argv)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def build(args: argparse.Namespace, seq_len: int):
    """Drafter, frozen head, batch and optimizer of the benchmark (random weights and data)."""
    import torch

    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.target_head import TargetHead
    from train.batch import Batch

    geo = dict(GEOMETRIES[args.geometry])
    vd = geo.pop("draft_vocab_size")
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    hf = {**geo, "max_position_embeddings": max(seq_len + args.steps + 1, 2048), "rope_theta": 10000.0}
    cfg = Eagle3Config.from_target_config(hf, draft_vocab_size=vd)
    torch.manual_seed(0)
    V, H = geo["vocab_size"], geo["hidden_size"]
    draft_ids = torch.randperm(V)[:vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    drafter = Eagle3Drafter(cfg, attn_backend=args.attn)
    drafter.load_target_embedding(torch.randn(V, H) * 0.02)
    drafter.set_vocab_mapping(draft_ids - torch.arange(vd), t2d)
    drafter = drafter.to(device=device, dtype=dtype)
    head = TargetHead(H, V, rms_norm_eps=1e-5)
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.02)
    head = head.to(device=device, dtype=dtype)
    n_taps = len(cfg.aux_layer_ids)
    batch = Batch(
        input_ids=torch.randint(1, V, (1, seq_len)),
        loss_mask=torch.rand(1, seq_len) < args.loss_frac,
        valid=torch.ones(1, seq_len, dtype=torch.bool),
        taps=torch.randn(1, seq_len, n_taps * H),
        teacher_hidden=torch.randn(1, seq_len, H) * 4,
        sample_ids=["synthetic"],
    ).to(device, dtype)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    return drafter, head, batch, opt


def worker(args: argparse.Namespace) -> dict:
    import torch

    from models.attention import resolve_backend
    from train.ttt import TTTSettings, ttt_loss

    torch.set_num_threads(args.threads)
    seq_len = args.worker
    device = torch.device(args.device)
    drafter, head, batch, opt = build(args, seq_len)
    settings = TTTSettings(
        steps=args.steps, chunk_size=args.chunk_size, checkpoint_layer=args.checkpoint_layer
    )
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def step() -> tuple[float, float]:
        opt.zero_grad(set_to_none=True)
        sync()
        t0 = time.perf_counter()
        loss, _ = ttt_loss(drafter, head, batch, settings)
        loss.backward()
        opt.step()
        sync()
        return time.perf_counter() - t0, float(loss.detach())

    warmup = args.warmup if args.warmup >= 0 else (1 if cuda else 0)
    for _ in range(warmup):
        step()
    base_rss = _peak_rss_mb()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base_gpu = torch.cuda.memory_allocated() / 2**20
    step_s, loss = step()
    peak_rss = _peak_rss_mb()
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else peak_rss
    return {
        "seq_len": seq_len,
        "geometry": args.geometry,
        "step_s": round(step_s, 4),
        "peak_mem_mb": round(peak, 1),
        "peak_mem_kind": "cuda_max_memory_allocated" if cuda else "peak_rss",
        "base_mem_mb": round(base_gpu if cuda else base_rss, 1),  # before the timed step (model, data)
        "peak_rss_mb": round(peak_rss, 1),
        "ttt_steps": args.steps,
        "chunk_size": args.chunk_size,
        "checkpoint_layer": args.checkpoint_layer,
        "attn_backend": resolve_backend(args.attn, device),
        "dtype": args.dtype,
        "device": str(device),
        "threads": args.threads,
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
        "loss": round(loss, 5),
    }


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The settings of this run as worker flags (the device is resolved here, once)."""
    flags = {
        "--geometry": args.geometry,
        "--steps": args.steps,
        "--chunk-size": args.chunk_size,
        "--attn": args.attn,
        "--dtype": args.dtype,
        "--device": args.device,
        "--threads": args.threads,
        "--warmup": args.warmup,
        "--loss-frac": args.loss_frac,
    }
    out = [str(x) for kv in flags.items() for x in kv]
    return out + ["--checkpoint-layer" if args.checkpoint_layer else "--no-checkpoint-layer"]


def run_length(argv: list[str], seq_len: int, timeout: float | None, env: dict | None = None) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", str(seq_len)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"seq_len": seq_len, "error": f"timeout after {timeout} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"seq_len": seq_len, "error": f"exit {proc.returncode}: {' | '.join(tail)}"}
    return json.loads(lines[-1])


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["seq_len"] for r in ok]
    ax_m.plot(xs, [r["peak_mem_mb"] / 1024 for r in ok], "o-", label="peak")
    ax_m.plot(xs, [r["base_mem_mb"] / 1024 for r in ok], "s--", label="before step (weights, data)")
    ax_m.set(
        xlabel="sequence length T", ylabel="GiB", title=f"memory ({ok[0]['peak_mem_kind'] if ok else ''})"
    )
    ax_m.legend()
    ax_t.plot(xs, [r["step_s"] for r in ok], "o-")
    ax_t.set(xlabel="sequence length T", ylabel="seconds", title="one TTT training step")
    for r in results:
        if "error" in r:
            for ax in (ax_m, ax_t):
                ax.axvline(r["seq_len"], color="red", alpha=0.4, linestyle=":")
    if ok:
        fig.suptitle(
            f"{ok[0]['geometry']}: K={ok[0]['ttt_steps']}, chunk {ok[0]['chunk_size']}, "
            f"{ok[0]['attn_backend']}, {ok[0]['dtype']}, {ok[0]['device']}"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(worker(args)), flush=True)
        return []
    out = Path(args.out or f"bench/results/long_context_{args.geometry}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    passthrough = worker_argv(args)
    env = dict(os.environ)
    if args.device == "cpu" and args.mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    results = []
    for seq_len in (int(s) for s in args.seq_lens.split(",") if s):
        result = run_length(passthrough, seq_len, args.timeout, env)
        print(json.dumps(result), flush=True)
        results.append(result)
        out.write_text(json.dumps(results, indent=1))  # after every length: a crash keeps what ran
    plot(results, out.with_suffix(".png"))
    return results


if __name__ == "__main__":
    main()
