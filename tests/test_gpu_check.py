"""bench/gpu_check.py's CPU pass (DRY_RUN=1): every section runs its real code path at tiny sizes and passes its
checks, and a section that overruns its budget is recorded while the others still run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["attention", "zero3", "spec_decode", "train_step", "verify"]


def run_check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "DRY_RUN": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(out), *args],
                       capture_output=True, text=True, timeout=1500, cwd=ROOT, env=env)
    assert out.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return r, json.loads(out.read_text())


def test_dry_run_every_section_passes(tmp_path: Path) -> None:
    r, report = run_check(tmp_path)
    sections = report["sections"]
    failing = {k: (s["status"], s.get("error"), s.get("log_tail")) for k, s in sections.items() if s["status"] != "passed"}
    assert r.returncode == 0 and not failing, failing
    assert report["dry_run"] is True and report["passed"] is True and list(sections) == SECTIONS
    for name, sec in sections.items():
        assert sec["checks"] and all(c["ok"] for c in sec["checks"].values()), name
        assert 0 < sec["seconds"] <= sec["budget_s"], name
    # the table comes last, one line per section
    tail = r.stdout.strip().splitlines()[-len(SECTIONS) - 1:]
    assert [line.split()[:2] for line in tail[:-1]] == [[s, "passed"] for s in SECTIONS], tail

    attn = sections["attention"]
    rows = {(row["backend"], row["seq_len"], row["ttt_steps"]) for row in attn["rows"]}
    assert rows == {(b, T, k) for b in ("chunked", "fused") for T, k in ((64, 3), (96, 1))}
    for row in attn["rows"]:  # fp32 kernels against fp32 reference: the output and every input gradient
        assert set(row["rel_err"]) == {"out", "dq", *(f"d{x}{j}" for x in "kv" for j in range(row["ttt_steps"]))}
        assert 0 < row["max_rel_err"] < 1e-4 and row["fwd_bwd_ms"] > 0

    zero3 = sections["zero3"]
    runs = zero3["runs"]
    assert set(runs) == {"cpu-fp32-gloo", "device-fp32-gloo"}
    for run in runs.values():
        assert run["dist_backend"] == "gloo" and run["world_size"] == 1 and run["zero_stage"] == 3
        assert len(run["losses"]) == 3 and all(x > 0 for x in run["losses"])
    assert runs["cpu-fp32-gloo"]["losses"][-1] < runs["cpu-fp32-gloo"]["losses"][0]  # the steps really train
    assert zero3["rows"][0]["max_rel_loss_diff"] <= 1e-4

    spec = sections["spec_decode"]
    assert len(spec["rows"]) == 4 and all(row["identical"] == row["prompts"] == 3 for row in spec["rows"])
    assert max(row["max_accepted"] for row in spec["rows"]) == 4

    train = sections["train_step"]["rows"]
    assert [(row["geometry"], row["seq_len"]) for row in train] == [("tiny", 64), ("tiny", 128)]
    for row in train:
        assert row["tokens_per_s"] > 0 and row["peak_mem_mb"] > 0 and "plan_prediction" in row
        assert row["attn_backend"] in ("fused", "chunked")

    verify = sections["verify"]["rows"]
    assert [row["block"] for row in verify] == [1, 5] and verify[0]["over_step"] == 1.0
    assert all(row["verify_s"] > 0 for row in verify)


def test_a_section_over_budget_is_recorded_and_the_others_run(tmp_path: Path) -> None:
    # one second cannot even import torch and transformers: the verify section is killed at its budget
    r, report = run_check(tmp_path, "--sections", "verify,attention", "--budget", "verify=1")
    assert r.returncode == 1 and report["passed"] is False
    verify, attention = report["sections"]["verify"], report["sections"]["attention"]
    assert verify["status"] == "timeout" and verify["seconds"] < 30 and "log_tail" in verify
    assert attention["status"] == "passed" and attention["rows"]
    assert r.stdout.strip().splitlines()[-3].split()[:2] == ["verify", "timeout"]


def test_the_train_step_rows_carry_the_memory_plan_of_the_same_step(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_check
    from train_step import GEOMETRIES

    cfg = gpu_check.make_config(dry_run=False)  # the GPU run's settings; the plan is arithmetic on configs
    small = gpu_check._plan_prediction("embedded", GEOMETRIES["embedded"], 2048, cfg)
    large = gpu_check._plan_prediction("gpt-oss-120b", GEOMETRIES["gpt-oss-120b"], 40960, cfg)
    assert "error" not in small and "error" not in large, (small, large)
    assert small["target"] == "smollm2-135m-instruct" and large["target"] == "gpt-oss-120b"
    assert 0 < small["plan_mb"] < large["plan_mb"]
    assert abs(small["plan_mb"] - sum(small["rows_mb"].values())) <= 0.1 * len(small["rows_mb"])
    assert gpu_check._plan_prediction("tiny", GEOMETRIES["tiny"], 64, cfg) is None  # no preset: nothing to plan
