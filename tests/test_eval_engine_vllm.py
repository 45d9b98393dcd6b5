"""`launch/eval.py engine=vllm` against a real vLLM (opt-in: `make engine-check`).

    DRAFTERS_VLLM_PYTHON=.venv-vllm/bin/python DRAFTERS_ENGINE_DRAFTER=outputs/runs/demo/export \
        pytest -s tests/test_eval_engine_vllm.py

Skipped unless DRAFTERS_VLLM_PYTHON names the python of a vLLM install (its own venv: vLLM pins its own torch) and
DRAFTERS_ENGINE_DRAFTER a trained EAGLE-3 export of the embedded target (a random drafter accepts nothing, so
the engine's τ could not disagree with ours). Greedy in float32, vLLM must emit our outputs and count our τ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("DRAFTERS_VLLM_PYTHON", "")
DRAFTER = os.environ.get("DRAFTERS_ENGINE_DRAFTER", "")

pytestmark = [pytest.mark.integration, pytest.mark.skipif(
    not (VLLM_PYTHON and DRAFTER), reason="opt-in: set DRAFTERS_VLLM_PYTHON and DRAFTERS_ENGINE_DRAFTER "
                                          "(make engine-check)")]


def test_vllm_counts_our_tau_per_category_and_serves_under_load(tmp_path) -> None:
    out = tmp_path / "eval"
    res = subprocess.run(
        [sys.executable, str(REPO / "launch" / "eval.py"), f"drafter={DRAFTER}", f"out_dir={out}",
         "prompts='mtbench,gsm8k'", "decode.num_prompts=1", "decode.max_new_tokens=24", "decode.mode=chain",
         "decode.depth=3", "dtype=float32", "threads=2", "engine=vllm", f"vllm.python={VLLM_PYTHON}",
         "vllm.concurrency=[1,4]", "vllm.num_speculative_tokens=[1]"],
        capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    cats = report["categories"]
    assert [(c["suite"], c["category"]) for c in cats][-1] == ("gsm8k", "grade_school") and len(cats) == 9
    for c in cats:
        eng = c["engine"]
        # the same token ids in, greedy float32 on both sides: the same tokens out and the same acceptance
        assert eng["identical_to_ours"] == {"count": c["turns"], "of": c["turns"]}, c
        assert eng["identical_to_plain"] == {"count": c["turns"], "of": c["turns"]}, c
        # one prompt a category: no interval, so no verdict on a gap (the τ itself must agree)
        assert eng["tau"] == pytest.approx(c["tau"], abs=1e-6) and c["tau_ci95"] is None and eng["tau_outside_ci"] is None
        assert eng["tokens_per_s"]["speculative"] > 0 and eng["tokens_per_s"]["baseline"] > 0
        assert set(eng["settings"]) == {"0", "3", "1"} and eng["best_num_speculative_tokens"] in (0, 1, 3)
    assert report["engine"]["tau"] == pytest.approx(report["tau_pooled"], abs=1e-6)
    # vLLM's CPU build: eager; both sides greedy with every sampling parameter stated; every server warmed up
    assert report["engine"]["mode"]["enforce_eager"] is True and report["engine"]["generation_config"] == "vllm"
    assert report["engine"]["sampling"]["temperature"] == 0.0 and report["engine"]["warmup"]["requests_per_server"] == 1
    load = report["engine"]["load"]
    assert [lv["concurrency"] for lv in load] == [1, 4]
    for lv in load:
        for side in ("plain", "speculative"):
            assert lv[side]["output_tokens"] == lv[side]["requests"] * 24  # ignore_eos: every request in full
            assert lv[side]["ttft_ms"]["mean"] > 0 and lv[side]["tpot_ms"]["mean"] > 0
        assert lv["speculative"]["tau"] > 1.0 and lv["speedup"] > 0 and lv["speedup_predicted"] > 0
    assert "| gsm8k | grade_school | 1 |" in (out / "categories.md").read_text() and "## Under load" in res.stdout
