"""bench/train_step.py synthetic end to end at a toy geometry and length (one fresh subprocess per length), under
both step engines, and a failing length recorded rather than raised."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "train_step.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("train_step", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.integration
def test_train_step_bench_tiny_deepspeed(tmp_path: Path) -> None:
    out = tmp_path / "train_step.json"
    cmd = [sys.executable, str(BENCH), "synthetic", "--geometry=tiny", "--seq-lens=24", "--warmup=1",
           "--repeats=2", "--ttt-steps=3", "--device=cpu", f"--out={out}", "--timeout=240"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and "error" not in rows[0], rows
    row = rows[0]
    assert row["seq_len"] == 24 and row["side"] == "ours" and row["engine"] == "deepspeed" and row["zero_stage"] == 3
    assert row["dtype"] == "bf16" and row["threads"] == 1 and row["ttt_steps"] == 3
    assert len(row["step_s_all"]) == 2 and row["step_s"] > 0 and row["peak_rss_mb"] > 0
    assert len(row["losses"]) == 3 and row["losses"][-1] < row["losses"][0]  # the steps really train
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_train_step_bench_tiny_torch(tmp_path: Path) -> None:
    bench = load_bench()
    out = tmp_path / "lc.json"
    rows = bench.main(["synthetic", "--geometry", "tiny", "--seq-lens", "24,40", "--engine", "torch",
                       "--ttt-steps", "3", "--chunk-size", "16", "--checkpoint-layer", "--warmup", "0",
                       "--device", "cpu", "--out", str(out)])
    saved = json.loads(out.read_text())["rows"]
    assert saved == rows and [r["seq_len"] for r in saved] == [24, 40]
    for r in saved:
        assert "error" not in r, r
        assert r["engine"] == "torch" and r["zero_stage"] is None
        assert r["ttt_steps"] == 3 and r["chunk_size"] == 16 and r["dtype"] == "bf16"
        assert r["attn_backend"] in ("fused", "chunked") and r["step_s"] > 0
        assert r["malloc_mmap_threshold"] == "65536"  # CPU workers: peak RSS tracks live tensors
        assert r["peak_mem_mb"] >= r["base_mem_mb"] > 50  # RSS of a process that imported torch
        assert 3 < r["loss"] < 3 * 2.44 * 2  # ~ (1 + .8 + .64) * ln(128) for a random drafter


def test_bench_reports_a_failing_length() -> None:
    bench = load_bench()
    res = bench.run_length(["--geometry=tiny", "--ttt-steps=0", "--device=cpu", "--engine=torch"], 16, timeout=120)
    assert res["seq_len"] == 16 and "steps must be >= 1" in res["error"]  # recorded, not raised
