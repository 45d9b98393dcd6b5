"""bench/long_context.py end to end at toy lengths (one subprocess per length)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "long_context.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("long_context", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_long_context_bench_tiny(tmp_path):
    bench = load_bench()
    out = tmp_path / "lc.json"
    argv = [
        "--geometry",
        "tiny",
        "--seq-lens",
        "24,40",
        "--steps",
        "3",
        "--chunk-size",
        "16",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    results = bench.main(argv)
    saved = json.loads(out.read_text())
    assert saved == results and [r["seq_len"] for r in saved] == [24, 40]
    for r in saved:
        assert "error" not in r, r
        assert r["ttt_steps"] == 3 and r["chunk_size"] == 16 and r["dtype"] == "bfloat16"
        assert r["attn_backend"] in ("fused", "chunked") and r["step_s"] > 0
        assert r["malloc_mmap_threshold"] == "65536"  # CPU workers: peak RSS tracks live tensors
        assert r["peak_mem_mb"] >= r["base_mem_mb"] > 50  # RSS of a process that imported torch
        assert 3 < r["loss"] < 3 * 2.44 * 2  # ~ (1 + .8 + .64) * ln(128) for a random drafter
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_bench_reports_a_failing_length():
    bench = load_bench()
    res = bench.run_length(["--geometry", "tiny", "--steps", "0", "--device", "cpu"], 16, timeout=120)
    assert res["seq_len"] == 16 and "steps must be >= 1" in res["error"]  # recorded, not raised
