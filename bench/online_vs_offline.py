"""Training step time with the target inside training (data.source=online) against reading its shards (offline).

    python bench/online_vs_offline.py --prep outputs/prep/smollm2-135m-instruct [--steps 20] [--modes offline,online]
        [--threads 2] [--train-args "data.batch_size=8"] [--out bench/results/online_vs_offline.json]

For each mode, the trainer runs in this process (1 rank, the demo recipe `+exp=eagle3_demo`, the same seed and so
the same global batches) for --steps optimizer steps, without evaluation, checkpoints or export until the end. Per
mode: the median step time (metrics.jsonl: a step's tokens / tokens_per_s, data loading included; step 1 is left
out, its window misses its own batch), the target forward's time per step (summary.json data.target_forward_s /
target_forwards, one forward per micro-batch) and its share of the step, and the bytes each mode needs written: the
prep's shards (offline: the prep's summary bytes_written), 0 (online), the run's own shards (hybrid). Prints one JSON
object and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
                 "logger.progress=false", "train.overwrite=true", *overrides]  # --work reused: each mode starts afresh
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prep", required=True, type=Path, help="a finished prep dir (shards + rendered samples)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="offline,online", help="comma-separated: offline, online, hybrid")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-args", default="", help="extra Hydra overrides for every mode")
    ap.add_argument("--work", type=Path, default=None, help="run dirs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "online_vs_offline.json")
    args = ap.parse_args()

    import torch

    from train.config import register_configs

    torch.set_num_threads(args.threads)
    register_configs()
    work = args.work or Path(tempfile.mkdtemp(prefix="online_vs_offline."))
    rows = [run_mode(args.prep.resolve(), mode, args.steps, work / mode, shlex.split(args.train_args))
            for mode in args.modes.split(",")]
    result = {"prep": str(args.prep), "threads": args.threads, "train_args": args.train_args,
              "device": "cuda" if torch.cuda.is_available() else "cpu", "rows": rows}
    by_mode = {r["mode"]: r for r in rows}
    if "offline" in by_mode and "online" in by_mode:
        result["online_over_offline_step_time"] = by_mode["online"]["step_s_median"] / by_mode["offline"]["step_s_median"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"} | {
        "rows": [{k: v for k, v in r.items() if k != "step_s_all"} for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
