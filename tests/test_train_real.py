"""A short real training run on shards of the real embedded target: held-out loss falls, acc_0 rises."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_short_run_on_embedded_target_learns(smollm2_prep_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "+exp=debug", f"data.dir={smollm2_prep_dir}",
           f"out_dir={out}", "train.max_steps=40", "train.epochs=100", "train.ttt_steps=3", "train.lr=3e-3", "train.warmup_steps=4",
           "train.eval_interval=40", "train.save_interval=0", "data.batch_size=2", "data.eval_max_samples=2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == 40
    assert last["loss_k"][0] < 0.7 * first["loss_k"][0]
    assert last["acc_k"][0] > first["acc_k"][0] + 0.1
    assert last["sim_tau"] > first["sim_tau"]
    assert (out / "export" / "model.safetensors").exists()
