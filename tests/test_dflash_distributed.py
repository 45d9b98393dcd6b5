"""DFlash under the real trainer: 2 processes (torchrun, ZeRO-3, gloo) give the same losses, block counts
and held-out metrics as 1 process, so the anchors of every global batch are the same at both world sizes
(they are random here: fewer anchors than candidates). Tiny synthetic prep dir."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic_prep import write_synthetic_prep

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "+exp=debug", "model=dflash", "model.tap_layers=[1,3,4]", "model.dflash.mask_token_id=255",
    "model.dflash.num_layers=2", "model.dflash.block_size=6", "train.dflash.anchors=5", "train.max_steps=3",
    "train.epochs=2", "train.chunk_size=8",
    "data.batch_size=4", "data.eval_batch_size=2", "data.eval_max_samples=4", "train.eval_interval=3",
    "train.save_interval=0", "train.export=false", "train.warmup_steps=1", "train.checkpoint_layer=true",
    "deepspeed.zero_stage=3", "deepspeed.stage3_param_persistence_threshold=0",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(nproc: int, out: Path, prep: Path, *extra: str) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(_port())] if nproc > 1 else [sys.executable]
    cmd = [*launcher, str(ROOT / "launch" / "train.py"), *COMMON, f"data.dir={prep}", f"out_dir={out}", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-6000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one_process(tmp_path: Path) -> None:
    prep = write_synthetic_prep(tmp_path / "prep", n_train=16, n_eval=4, min_len=16, max_len=40)
    one, two = _run(1, tmp_path / "one", prep), _run(2, tmp_path / "two", prep)
    for kind in ("train", "eval"):
        a, b = [r for r in one if r["kind"] == kind], [r for r in two if r["kind"] == kind]
        assert [r["step"] for r in a] == [r["step"] for r in b] and a
        for ra, rb in zip(a, b):
            assert ra["n_valid_k"] == rb["n_valid_k"]  # the same blocks
            assert rb["loss_k"] == pytest.approx(ra["loss_k"], rel=1e-5)
            if kind == "train":
                assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5)
            else:
                assert rb["sim_tau"] == pytest.approx(ra["sim_tau"], rel=1e-6)
    train = [r for r in one if r["kind"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    assert train[0]["n_valid_k"][0] == 4 * 5  # 5 random anchors of many candidates, 4 samples per global batch


def test_resumed_run_draws_the_same_blocks(tmp_path: Path) -> None:
    """Stopped after step 1 and resumed: the same anchors (block counts) and losses as the uninterrupted
    run, because a batch's anchors are seeded by its place in training (objective.start_batch)."""
    prep = write_synthetic_prep(tmp_path / "prep", n_train=16, n_eval=4, min_len=16, max_len=40)
    full = [r for r in _run(1, tmp_path / "full", prep) if r["kind"] == "train"]
    _run(1, tmp_path / "cut", prep, "train.stop_after_steps=1")
    resumed = [r for r in _run(1, tmp_path / "cut", prep, "train.resume=true") if r["kind"] == "train"]
    assert [r["step"] for r in resumed] == [r["step"] for r in full] == [1, 2, 3]
    for a, b in zip(full, resumed):
        assert b["n_valid_k"] == a["n_valid_k"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
