"""A Hydra sweep under torchrun: every job runs on both ranks in the same deterministic directory, the
process group is reused across jobs, and rank 0 writes the sweep summary (Markdown, JSON, PNG)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from train.sweep import markdown
from train.synthetic import write_synthetic_prep

ROOT = Path(__file__).resolve().parents[1]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_by_one_sweep_under_torchrun_writes_summary(tmp_path: Path) -> None:
    prep = write_synthetic_prep(tmp_path / "prep", n_train=8, n_eval=4, min_len=12, max_len=32)
    out = tmp_path / "sweep"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_port()),
           str(ROOT / "launch" / "train.py"), "-m", "+exp=debug", f"data.dir={prep}", f"out_dir={out}",
           "train.max_steps=2", "train.save_interval=0", "train.export=false", "data.batch_size=2",
           "data.eval_batch_size=2", "data.eval_max_samples=4", "train.ttt_steps=1,2", "train.loss_decay=0.7"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"

    jobs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert jobs == ["job0", "job1"]  # nothing else: both ranks used the same (non-timestamped) dirs
    for job, k in (("job0", 1), ("job1", 2)):
        summary = json.loads((out / job / "summary.json").read_text())
        assert summary["finished"] and summary["world_size"] == 2
        assert (summary["ttt_steps"], summary["loss_decay"]) == (k, 0.7)
        assert len(summary["eval"]["acc_k"]) == k
        assert (out / job / "train.rank1.log").exists() and (out / job / ".hydra" / "config.yaml").exists()

    rows = json.loads((out / "sweep_summary.json").read_text())
    assert [(row["K"], row["lambda"]) for row in rows] == [(1, 0.7), (2, 0.7)]
    assert all(row["sim_tau"] >= 1.0 and row["status"] == "finished" for row in rows)
    table = (out / "sweep_summary.md").read_text()
    assert table == markdown(rows) and "acc_1" in table and table.count("\n") == 4
    assert (out / "sweep_summary.png").stat().st_size > 1000
