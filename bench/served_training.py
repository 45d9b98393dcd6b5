#!/usr/bin/env python
"""Where the target's features come from, end to end on the demo's data and recipe, one quiet run, side by side:

    python bench/served_training.py --work DIR        # resumable: a finished stage in DIR is read back

  (a) offline   `make prep` with the demo's settings (one vLLM server regenerates and captures the features into
                shards), then `make train EXP=eagle3_demo` on its shards (2 ranks)
  (b) online    `make prep` with the demo's settings and stage=render (the same server regenerates; token ids and
                loss masks only), then the demo's training with data.source=online (the transformers target in
                each training rank computes the features)
  (c) vllm      the same render prep, then the demo's training with data.source=vllm (one vLLM server, started by
                training on the same CPU, computes them, every epoch)
  (d) hybrid    the same, with data.source=hybrid data.hybrid_from=vllm: epoch 0 from the server, written as the
                run's shards, later epochs read them
(b), (c) and (d) share one render prep: its wall time counts in each. Per variant: wall seconds end to end (prep +
training), training's tokens per second (summary tokens over the training loop's seconds, evals and saves left
out), the share of that loop spent waiting for the next batch (train/trainer.py feature_wait_share), feature bytes
on disk (the shards of the prep and of the run; the rendered samples' bytes beside them) and the held-out simulated
tau each run reaches. Writes bench/results/served_training.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from infra.strict_json import dumps

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "6"}  # the demo's, for every server
SERVED = ("data.source=vllm vllm.python={python} +vllm.engine_kwargs.enforce_eager=true")


def make(target: str, log: Path, **variables: str) -> float:
    """`make <target> VAR=value ...` in the repository; its wall seconds; the log kept at `log`."""
    args = ["make", target, *(f"{k}={v}" for k, v in variables.items())]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **VLLM_ENV}
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def stage(work: Path, name: str, done_file: str, run) -> float:
    """Run a stage once: its wall seconds are kept in DIR/<name>.wall (a rerun reads them back)."""
    wall = work / f"{name}.wall"
    if wall.exists() and (work / name / done_file).exists():
        return float(wall.read_text())
    seconds = run(work / name, work / f"{name}.log")
    wall.write_text(f"{seconds}\n")
    return seconds


def tree_bytes(root: Path, pattern: str) -> int:
    return sum(p.stat().st_size for p in root.rglob(pattern) if p.is_file()) if root.exists() else 0


def training(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    data = summary["data"]
    loop_s = data["feature_wait_s"] / data["feature_wait_share"] if data["feature_wait_share"] else None
    return {"steps": summary["steps"], "train_wall_s": summary["wall_s"], "loop_s": loop_s,
            "tokens_per_s": summary["tokens"] / loop_s if loop_s else None,
            "feature_wait_share": data["feature_wait_share"], "source": data["source"],
            "target_dtype": data.get("target_dtype"), "precision": summary["precision"],
            "held_out_sim_tau": summary["eval"]["sim_tau"],
            "run_feature_bytes": tree_bytes(run / "captured", "*.safetensors")}  # hybrid's shards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True, help="where the preps and runs go (outside the work tree; resumable)")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--out", default=str(RESULTS / "served_training.json"))
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    demo_prep = dict(NPROC="1", OMP_NUM_THREADS="2")
    walls = {
        "prep": stage(work, "prep", "summary.json", lambda out, log: make(
            "prep", log, PREP_DIR=str(out), ARGS="$(DEMO_PREP_ARGS) $(DEMO_VLLM_ARGS)", **demo_prep)),
        "prep_render": stage(work, "prep_render", "summary.json", lambda out, log: make(
            "prep", log, PREP_DIR=str(out), ARGS="$(DEMO_PREP_ARGS) $(DEMO_VLLM_ARGS) stage=render", **demo_prep)),
    }
    runs = {"offline": ("prep", ""), "online": ("prep_render", "data.source=online"),
            "vllm": ("prep_render", SERVED.format(python=args.vllm_python)),
            "hybrid_vllm": ("prep_render", SERVED.format(python=args.vllm_python).replace(
                "data.source=vllm", "data.source=hybrid data.hybrid_from=vllm"))}
    for name, (prep, extra) in runs.items():
        walls[name] = stage(work, f"run_{name}", "summary.json", lambda out, log, prep=prep, extra=extra: make(
            "train", log, EXP="eagle3_demo", PREP_DIR=str(work / prep), RUN_DIR=str(out),
            ARGS=f"$(DEMO_TRAIN_ARGS) {extra}"))
        print(f"{name}: prep {walls[prep]:.0f} s + training {walls[name]:.0f} s")
    variants = {}
    for name, (prep, _) in runs.items():
        shards = tree_bytes(work / prep / "train", "*.safetensors") + tree_bytes(work / prep / "eval", "*.safetensors")
        t = training(work / f"run_{name}")
        variants[name] = {"prep": prep, "prep_wall_s": walls[prep], "train_make_wall_s": walls[name],
                          "wall_s": walls[prep] + walls[name],
                          "feature_bytes_on_disk": shards + t.pop("run_feature_bytes"),
                          "rendered_bytes": tree_bytes(work / prep / "rendered", "*.safetensors"), **t}
    a, b, c = variants["offline"]["wall_s"], variants["online"]["wall_s"], variants["vllm"]["wall_s"]
    prep = json.loads((work / "prep" / "summary.json").read_text())
    result = {
        "what": "the demo's data and recipe (make prep's demo settings, make train EXP=eagle3_demo, 2 ranks) with the "
                "features (a) captured by prep into shards, (b) computed by the transformers target in each training "
                "rank, (c) computed by one vLLM server training starts, every epoch, (d) by that server in epoch 0, "
                "then read from the run's own shards; one quiet run each on this machine",
        "cpu": _cpu_name(), "samples": prep["samples"], "dtype": prep["dtype"], "variants": variants,
        "ratios": {"vllm_over_offline_wall": c / a, "vllm_over_online_wall": c / b},
        "goals": {"vllm_over_offline_wall": 1.0, "vllm_over_online_wall": 0.7},
    }
    Path(args.out).write_text(dumps(result, indent=1) + "\n")
    for name, v in variants.items():
        print(f"({name}) {v['wall_s']:.0f} s end to end (prep {v['prep_wall_s']:.0f} s), training "
              f"{v['tokens_per_s'] or 0:.0f} tokens/s, waiting {100 * (v['feature_wait_share'] or 0):.0f}% of the loop, "
              f"{v['feature_bytes_on_disk'] / 2**20:.0f} MiB of features on disk, held-out sim tau "
              f"{v['held_out_sim_tau']:.3f}")
    print(f"(c)/(a) {c / a:.2f} (goal <= 1.0), (c)/(b) {c / b:.2f} (goal <= 0.7)")
    plot(result, Path(args.out).with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["variants"])
    v = result["variants"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    ax[0].barh(names, [v[n]["prep_wall_s"] / 60 for n in names], label="prep")
    ax[0].barh(names, [v[n]["train_make_wall_s"] / 60 for n in names], left=[v[n]["prep_wall_s"] / 60 for n in names],
               label="training")
    ax[0].set_xlabel("minutes end to end")
    ax[0].legend()
    ax[0].invert_yaxis()
    ax[1].barh(names, [100 * (v[n]["feature_wait_share"] or 0) for n in names], color="tab:red")
    ax[1].set_xlabel("% of the training loop waiting for features")
    ax[1].invert_yaxis()
    for i, n in enumerate(names):
        ax[1].text(1, i, f"{v[n]['feature_bytes_on_disk'] / 2**20:.0f} MiB features on disk", va="center")
    fig.suptitle(f"Where the features come from: demo data and recipe ({result['cpu']}, {result['dtype']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
