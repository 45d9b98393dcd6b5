"""Training step time with the exact teacher kept across epochs (train.teacher_epoch_cache_mb) against without.

    python bench/teacher_cache.py --prep outputs/prep/smollm2-135m-instruct [--epochs 2] [--cache-mb 4096]
        [--threads 2] [--train-args "..."] [--out bench/results/teacher_cache.json]

The demo recipe (`+exp=eagle3_demo`, `online_vs_offline.run_demo_recipe`) runs in this process twice, without and
with the cache, on the same seed and so the same global batches in the same order, for --epochs epochs (no
evaluation, checkpoint or export). A step's time is metrics.jsonl's tokens / tokens_per_s (data loading included). Epoch 0 fills the cache (every row a miss, so it
costs what the uncached step does plus the copy); from epoch 1 on every row is a hit and the full-vocabulary teacher
matmul is skipped. Reported per epoch: the median step time of each setting and the median of the per-step ratios
(cached / uncached, the same batch on both sides), the whole run's training time ratio, and the largest difference
between the two runs' losses (the cache serves the very rows it computed, so the runs agree to rounding). Prints
one JSON object and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prep", required=True, type=Path, help="a finished prep dir with the exact (hidden) teacher")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--cache-mb", type=int, default=4096, help="the cache's budget (MB per process)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-args", default="", help="extra Hydra overrides for both runs")
    ap.add_argument("--work", type=Path, default=None, help="run dirs (default: a temporary directory)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "teacher_cache.json")
    args = ap.parse_args()

    import torch
    from online_vs_offline import run_demo_recipe, step_seconds

    from train.config import register_configs

    torch.set_num_threads(args.threads)
    register_configs()
    work = args.work or Path(tempfile.mkdtemp(prefix="teacher_cache."))
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
    result = {"prep": str(args.prep), "threads": args.threads, "train_args": args.train_args,
              "cache_mb": args.cache_mb, "steps_per_epoch": per_epoch, "steps": summary["steps"], "epochs": epochs,
              "training_time_ratio": total, "max_abs_loss_difference": loss_diff}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
