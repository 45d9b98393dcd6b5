#!/usr/bin/env python
"""The memory plan (train/plan.py) against measured peak memory: one real training step per configuration.

    python bench/plan_check.py                      # 2K and 8K tokens x 1/2 ranks x offline/online
    python bench/plan_check.py --tokens 2048 --ranks 1 --sources offline
    python bench/plan_check.py --replan             # the plan again against the recorded measurements

Each configuration runs in a FRESH process (2 ranks: torchrun, gloo), so its peak RSS belongs to it alone. The
step is the trainer's: the embedded target's EAGLE-3 drafter (hidden 576, vocab 49,152, Vd 32,000, K=7, loss
chunks of 1024 rows, the layer checkpointed, the `fused` attention, fp32 as on CPU) wrapped by train/engine.py
(real DeepSpeed, ZeRO-3), the loss counts all-reduced and the teacher targets kept as train/trainer.py does
(train/ttt.py count_valid), backward and the optimizer step; one sequence of T tokens per rank, every token a
loss target (synthetic ids and features, bench/train_step.py's `build`). Online: the real embedded target
(SmolLM2-135M-Instruct, fp32) replicated on each rank, its capture forward (data_prep/capture.py) giving the
taps and the teacher before the step. A short first step (256 tokens) creates the Adam state, so the measured
step sees the run's steady state. Workers run with MALLOC_MMAP_THRESHOLD_=65536 (bench/train_step.py says
why: RSS then follows live tensors, not glibc's retention).

The CPU runtime (Python, torch, DeepSpeed and transformers imported, the process group up, nothing built) is
measured first, in a fresh process of its own, and is the plan's `runtime` row (train/plan.py CPU_RUNTIME_MB).
The 40,960-token point is not rerun (one step takes about an hour here): the plan is compared with the
measured peaks of bench/results/long_context_embedded.json (bench/train_step.py synthetic --engine torch: bf16,
a plain torch AdamW, no DeepSpeed, an untied random head, no kept teacher targets), that process's own runtime
measured here too.
Writes bench/results/plan_check.json and .png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from infra.processes import peak_rss_mb  # noqa: E402
from infra.strict_json import dumps  # noqa: E402

TARGET = "smollm2-135m-instruct"
VD, K, CHUNK, WARMUP_TOKENS = 32000, 7, 1024, 256
LONG_CONTEXT_FILE = ROOT / "bench" / "results" / "long_context_embedded.json"


# ------------------------------------------------------------------------------------------- workers
def runtime_worker(kind: str) -> dict:
    """Peak RSS of a process before it builds anything: `train` (what a training process imports, the process
    group up) or `bench` (what bench/train_step.py's worker imports)."""
    import torch  # noqa: F401

    if kind == "train":
        import transformers  # noqa: F401

        import train.trainer  # noqa: F401
        from train.engine import init_distributed

        init_distributed("gloo")
    else:
        import train_step  # noqa: F401

        from models.attention import resolve_backend  # noqa: F401
        from train.ttt import TTTSettings, ttt_loss  # noqa: F401
    return {"kind": kind, "runtime_mb": round(peak_rss_mb(), 1)}


def step_worker(tokens: int, source: str) -> dict:
    import torch
    import train_step

    from train.config import DeepSpeedConfig, TrainConfig
    from train.engine import Engine, init_distributed
    from train.ttt import TTTSettings, count_valid, ttt_loss

    torch.set_num_threads(1)
    rank, world = init_distributed("gloo")
    runtime = peak_rss_mb()
    args = train_step.parse_args(["synthetic", "--geometry", "embedded", "--dtype", "fp32", "--device", "cpu",
                                  "--ttt-steps", str(K), "--chunk-size", str(CHUNK), "--checkpoint-layer"])
    torch.manual_seed(rank)
    drafter, head, batch, _ = train_step.build(args, tokens)
    capture = None
    if source == "online":
        from data_prep.capture import HiddenStateCapture
        from data_prep.targets import load_target, resolve_target

        preset = resolve_target(TARGET)
        model, _ = load_target(preset, "float32", "cpu")
        capture = HiddenStateCapture(model, preset.tap_layers).__enter__()
    settings = TTTSettings(steps=K, chunk_size=CHUNK, checkpoint_layer=True)
    engine = Engine(DeepSpeedConfig(zero_stage=3, precision="fp32", dist_backend="gloo"),
                    TrainConfig(ttt_steps=K, chunk_size=CHUNK, checkpoint_layer=True), total_steps=2)
    module = engine.prepare(drafter, keep_gathered=("norm", "lm_head"))
    static = peak_rss_mb()

    def step(n: int) -> float:
        b = dataclasses.replace(batch, input_ids=batch.input_ids[:, :n], loss_mask=batch.loss_mask[:, :n],
                                valid=batch.valid[:, :n], taps=batch.taps[:, :n],
                                teacher_hidden=batch.teacher_hidden[:, :n])
        if capture is not None:  # the target's capture forward makes this step's features
            got = capture(b.input_ids, torch.ones_like(b.input_ids))
            b = dataclasses.replace(b, taps=got.taps.float(), teacher_hidden=got.final_hidden.float())
            del got
        counts, targets = count_valid(head, b, settings, vocab=module, return_targets=True)
        torch.distributed.all_reduce(counts)
        loss, _ = ttt_loss(module, head, b, settings, normalizer=counts, teacher_targets=targets)
        engine.backward(loss)
        engine.step()
        return float(loss.detach())

    step(min(WARMUP_TOKENS, tokens))
    warm = peak_rss_mb()
    t0 = time.perf_counter()
    loss = step(tokens)
    return {"rank": rank, "world_size": world, "tokens": tokens, "source": source, "runtime_mb": round(runtime, 1),
            "static_mb": round(static, 1), "after_warmup_mb": round(warm, 1), "peak_rss_mb": round(peak_rss_mb(), 1),
            "step_s": round(time.perf_counter() - t0, 1), "loss": round(loss, 4)}


# ------------------------------------------------------------------------------------------- the parent
def _env() -> dict:
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT)}


def _json_lines(cmd: list[str], timeout: float) -> list[dict]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"{' '.join(cmd[-4:])}: exit {proc.returncode}: {tail}")
    return lines


def measure(tokens: int, ranks: int, source: str, timeout: float) -> dict:
    me = [str(Path(__file__).resolve()), "--worker", str(tokens), "--sources", source]
    if ranks == 1:
        cmd = [sys.executable, *me]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), *me]
    lines = _json_lines(cmd, timeout)
    return {"per_rank": lines, "peak_rss_mb": max(r["peak_rss_mb"] for r in lines)}


def predict(tokens: int, ranks: int, source: str, runtime_mb: float, *, bench: bool = False):
    """The plan of a measured configuration (bench: bench/train_step.py --engine torch's process, not the trainer's)."""
    from train.config import RunConfig
    from train.plan import components, describe_drafter, describe_target, settings_from_run

    cfg = RunConfig(out_dir="plan")
    cfg.data.dir, cfg.data.batch_size, cfg.data.max_len = "plan", ranks, tokens
    cfg.data.source, cfg.data.target_placement = source, "replicate"
    cfg.model.draft_vocab_size = VD
    cfg.train.ttt_steps, cfg.train.chunk_size, cfg.train.checkpoint_layer = K, CHUNK, True
    cfg.deepspeed.zero_stage, cfg.deepspeed.precision = 3, "fp32"
    # the workers' frozen head is bench/train_step.py's random one: untied (the trainer's SmolLM2 head is tied)
    extra = {"runtime_mb": runtime_mb, "head_tied": False}
    if bench:  # bf16 module and a torch AdamW on it, no kept teacher targets, one step (no Adam state at its peak)
        cfg.deepspeed.precision = "bf16"
        extra.update(optimizer="torch", teacher_cache_mb=0, first_step=True)
    target = describe_target(TARGET)
    target.dtype_bytes = 4  # the online target runs in fp32 here (load_target(..., "float32"))
    s = settings_from_run(cfg, ranks, tokens, "cpu", **extra)
    rows, phases = components(target, describe_drafter(cfg, target), s)  # a step at exactly `tokens`
    return {"plan_mb": round(sum(rows.values()) / 2**20, 1), "plan_rows_mb": {k: round(v / 2**20, 1) for k, v in rows.items()},
            "plan_phases_mb": {k: round(v / 2**20, 1) for k, v in phases.items()}}


def plot(results: list[dict], bench_rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels, measured, planned = [], [], []
    for r in results:
        labels.append(f"{r['tokens'] // 1024}K {r['ranks']}r {r['source']}")
        measured.append(r["measured_peak_mb"] / 1024)
        planned.append(r["plan_mb"] / 1024)
    for r in bench_rows:
        labels.append(f"{r['tokens'] // 1024}K long_context (file)")
        measured.append(r["measured_peak_mb"] / 1024)
        planned.append(r["plan_mb"] / 1024)
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], measured, 0.4, label="measured peak RSS")
    ax.bar([i + 0.2 for i in x], planned, 0.4, label="plan (train/plan.py)")
    ax.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=8)
    ax.set(ylabel="GiB per rank", title="memory plan vs measured peak (embedded target, CPU)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="2048,8192")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--sources", default="offline,online")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "plan_check.json"))
    p.add_argument("--replan", action="store_true", help="recompute the plan for the measurements in --out")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--runtime-worker", choices=("train", "bench"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.runtime_worker:
        print(dumps(runtime_worker(args.runtime_worker)), flush=True)
        return
    if args.worker is not None:
        print(dumps(step_worker(args.worker, args.sources)), flush=True)
        return
    out = Path(args.out)
    if args.replan:  # the plan again against the measurements already recorded in --out
        old = json.loads(out.read_text())
        runtime = {"train": old["runtime"]["train_process_mb"], "bench": old["runtime"]["bench_long_context_process_mb"]}
        measured = [(r["tokens"], r["ranks"], r["source"], {"per_rank": r["per_rank"],
                                                           "peak_rss_mb": r["measured_peak_mb"]})
                    for r in old["configurations"]]
    else:
        me = [sys.executable, str(Path(__file__).resolve())]
        runtime = {k: _json_lines([*me, "--runtime-worker", k], args.timeout)[0]["runtime_mb"]
                   for k in ("train", "bench")}
        print(dumps({"runtime_mb": runtime}), flush=True)
        measured = []
    results: list[dict] = []
    grid = [(int(t), int(r), src) for t in args.tokens.split(",") for r in args.ranks.split(",")
            for src in args.sources.split(",")]
    todo = measured or [(int(t), int(r), src, None) for t in args.tokens.split(",") for r in args.ranks.split(",")
                        for src in args.sources.split(",")]
    for tokens, ranks, source, got in todo:
        got = got or measure(tokens, ranks, source, args.timeout)
        pl = predict(tokens, ranks, source, runtime["train"])
        row = {"tokens": tokens, "ranks": ranks, "source": source, "measured_peak_mb": got["peak_rss_mb"], **pl,
               "rel_error": round(pl["plan_mb"] / got["peak_rss_mb"] - 1, 4), "per_rank": got["per_rank"]}
        print(dumps({k: v for k, v in row.items() if k != "per_rank"}), flush=True)
        results.append(row)
        write(out, runtime, results, [], grid)  # after every configuration: a crash keeps what ran
    bench_rows = []
    for r in json.loads(LONG_CONTEXT_FILE.read_text()):
        pl = predict(r["seq_len"], 1, "offline", runtime["bench"], bench=True)
        bench_rows.append({"tokens": r["seq_len"], "source_file": str(LONG_CONTEXT_FILE.relative_to(ROOT)),
                           "measured_peak_mb": r["peak_mem_mb"], **pl,
                           "rel_error": round(pl["plan_mb"] / r["peak_mem_mb"] - 1, 4)})
        print(dumps(bench_rows[-1]), flush=True)
    write(out, runtime, results, bench_rows, grid)
    plot(results, bench_rows, out.with_suffix(".png"))


def write(out: Path, runtime: dict, results: list[dict], bench_rows: list[dict], grid: list[tuple]) -> None:
    done = {(r["tokens"], r["ranks"], r["source"]) for r in results}
    record = {
        "what": "train/plan.py's per-device prediction vs the measured peak RSS of one training step (CPU)",
        "target": TARGET, "draft_vocab_size": VD, "ttt_steps": K, "chunk_size": CHUNK, "checkpoint_layer": True,
        "precision": "fp32", "zero_stage": 3, "attn_backend": "fused", "malloc_mmap_threshold": 65536,
        "runtime": {"what": "peak RSS of a fresh process before it builds anything: the plan's `runtime` row (each "
                            "worker's own runtime_mb, taken once its process group is up, is in per_rank)",
                    "train_process_mb": runtime["train"], "bench_long_context_process_mb": runtime["bench"]},
        "configurations": results,
        "max_abs_rel_error": max((abs(r["rel_error"]) for r in results), default=None),
        "not_measured": [dict(zip(("tokens", "ranks", "source"), g)) for g in grid if g not in done],
        "long_context_embedded": {
            "what": "measured peaks from bench/results/long_context_embedded.json (not rerun here): bf16, plain "
                    "torch AdamW, no DeepSpeed; the plan configured the same way",
            "points": bench_rows},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(dumps(record, indent=1))
    tmp.replace(out)


if __name__ == "__main__":
    main()
