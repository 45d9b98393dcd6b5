"""Short training runs in fresh processes, and what they leave behind, for the distributed, resume, online and
golden-loss tests.

`torchrun` starts launch/train.py under torchrun; `train_in_one_process` runs several 1-process jobs one after
another in ONE Python process (the in-process multi-job path a sweep uses: it saves the ~10 s of torch/DeepSpeed
imports per run). Both take their recipe from `common`: `COMMON` (offline, a synthetic prep) unless a test passes
`ONLINE_COMMON` (online training on a real prep of the tiny target). `records`, `weights` and `killed_after` read
and damage the run directory; `LOSS_RTOL` / `WEIGHT_ATOL` are what another world size may move.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from infra.processes import free_port

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "+exp=debug", "train.max_steps=4", "train.epochs=2", "train.ttt_steps=3", "train.chunk_size=8",
    "data.batch_size=4", "data.eval_batch_size=2", "data.eval_max_samples=4", "train.eval_interval=2",
    "train.save_interval=2", "train.keep_checkpoints=5", "train.export=false", "train.warmup_steps=1",
    "deepspeed.zero_stage=3", "deepspeed.stage3_param_persistence_threshold=0",
]
ONLINE_COMMON = [
    "+exp=debug", "train.ttt_steps=3", "train.chunk_size=8", "data.batch_size=2", "data.eval_batch_size=2",
    "data.eval_max_samples=2", "train.eval_interval=2", "train.save_interval=2", "train.keep_checkpoints=10",
    "train.export=false", "train.warmup_steps=1", "deepspeed.zero_stage=3",
    "deepspeed.stage3_param_persistence_threshold=0", "deepspeed.precision=fp32", "data.max_len=1024",
]
FOUR = ["train.max_steps=4", "train.epochs=2"]  # online recipe: 5 global batches per epoch, 4 steps stay in epoch 0

# What docs/training.md claims for another world size: the same batches, counts and schedule; the sums over ranks
# are added in another order, which moves the float32 losses by ~1e-7 relative (a rounding: 1.1e-7 measured
# here) and the weights by up to ~1e-6.
LOSS_RTOL, WEIGHT_ATOL = 1e-6, 1e-5


# Several 1-process runs in ONE process, in order (the in-process multi-job path a sweep uses).
DRIVER = """
import json, sys
from hydra import compose, initialize_config_dir
from train.config import RunConfig, register_configs
from train.trainer import run
register_configs()
with initialize_config_dir(sys.argv[1], version_base="1.3"):
    for overrides in json.loads(sys.argv[2]):
        cfg = RunConfig.from_omegaconf(compose("train", overrides=overrides)).validate(1)
        run(cfg, cfg.out_dir)
"""


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    return env


def check_ok(r: subprocess.CompletedProcess, what: str) -> None:
    assert r.returncode == 0, f"{what}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def torchrun(out: Path, prep: Path, *overrides: str, nproc: int = 2, common: list[str] = COMMON,
             timeout_s: float = 300) -> None:
    script = [str(ROOT / "launch" / "train.py"), *common, f"data.dir={prep}", f"out_dir={out}", *overrides]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(free_port())]
    r = subprocess.run([*launcher, *script], capture_output=True, text=True, env=clean_env(), timeout=timeout_s,
                       cwd=ROOT)
    check_ok(r, " ".join(script))


def train_in_one_process(prep: Path, jobs: list[tuple[Path, list[str]]], common: list[str] = COMMON) -> None:
    overrides = [[*common, f"data.dir={prep}", f"out_dir={out}", *extra] for out, extra in jobs]
    cmd = [sys.executable, "-c", DRIVER, str(ROOT / "conf"), json.dumps(overrides)]
    check_ok(subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=300, cwd=ROOT),
             str(overrides))


def records(run: Path, kind: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out = {r["step"]: r for r in rows if r["kind"] == kind}
    assert len(out) == len([r for r in rows if r["kind"] == kind]), "a step logged twice"
    return out


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


def killed_after(run: Path, step: int, copy: Path) -> Path:
    """A copy of `run` as a kill right after its checkpoint `step` leaves it (its later records are kept in
    metrics.jsonl; a resume drops them)."""
    shutil.copytree(run, copy)
    for later in (copy / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (copy / "checkpoints" / "latest").write_text(f"step_{step:06d}\n")
    return copy


ROLLOUT_COUNTERS = ("rollouts", "rollout_new_tokens", "rollout_cycles", "rollout_accepted", "replay_pairs",
                    "replay_rejected")


def assert_same_rollouts(run: Path, ref: Path) -> None:
    """The same steps and, at each, the same rollouts: every counter of train.on_policy's in metrics.jsonl."""
    r, x = records(run, "train"), records(ref, "train")
    assert sorted(r) == sorted(x)
    for step in x:
        for key in ROLLOUT_COUNTERS:
            assert r[step][key] == x[step][key], (step, key, r[step][key], x[step][key])


def assert_close_curves(run: Path, ref: Path, rtol: float) -> None:
    """The same batches (valid counts, learning rates) and losses within `rtol`, step by step."""
    r, x = records(run, "train"), records(ref, "train")
    assert sorted(r) == sorted(x)
    for step in r:
        assert r[step]["n_valid_k"] == x[step]["n_valid_k"] and r[step]["lr"] == x[step]["lr"], step  # same batch
        assert r[step]["loss"] == pytest.approx(x[step]["loss"], rel=rtol, abs=0), step
