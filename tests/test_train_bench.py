"""bench/train_step.py end to end at a toy geometry and length (one fresh subprocess per length)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_train_step_bench_tiny(tmp_path: Path) -> None:
    out = tmp_path / "train_step.json"
    cmd = [sys.executable, str(ROOT / "bench" / "train_step.py"), "--geometry=tiny", "--seq-lens=24",
           "--warmup=1", "--repeats=2", "--ttt-steps=3", f"--out={out}", "--timeout=240"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and "error" not in rows[0], rows
    row = rows[0]
    assert row["seq_len"] == 24 and row["side"] == "ours" and row["zero_stage"] == 3
    assert row["precision"] == "bf16" and row["threads"] == 1 and row["ttt_steps"] == 3
    assert len(row["step_s_all"]) == 2 and row["step_s_median"] > 0 and row["peak_rss_mb"] > 0
    assert len(row["losses"]) == 3 and row["losses"][-1] < row["losses"][0]  # the steps really train
