"""Opt-in (`make train-vllm-check`): data.source=vllm on the real vLLM CPU build, the embedded target in fp32.

One prep of the embedded target's data captured by vLLM (capture.engine=vllm); then, at 2 ranks (torchrun, gloo):
the offline run on that prep, and a run fed live by the vLLM server training starts, killed with kill -9 (every
training process at once, as a node's loss or an OOM kill of the job does) after a checkpoint and resumed. It must
leave no vLLM process behind, and the resumed run's per-step losses must be the offline run's within 1e-4 relative
over 20 steps. Then the on-policy stage (train.on_policy, greedy) rolling out on that vLLM server at 2 ranks against
the same stage with the transformers target in the rank: the same rollouts (greedy text, verify cycles, accepted
drafts, replayed pairs, step by step) and losses within 1e-4 relative. DRAFTERS_VLLM_PYTHON names the python of a
vLLM install; skipped without it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_prep
from train_runs import (
    ROOT,
    assert_close_curves,
    assert_same_rollouts,
    clean_env,
    records,
    torchrun,
    train_in_one_process,
)

from infra.processes import free_port
from serving.server import group_members

VLLM_PYTHON = os.environ.get("DRAFTERS_VLLM_PYTHON", "")
RTOL = 1e-4
pytestmark = pytest.mark.skipif(not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
                                reason="opt-in: set DRAFTERS_VLLM_PYTHON to the python of a vLLM install "
                                       "(make train-vllm-check)")

COMMON = [
    "+exp=debug", "train.max_steps=20", "train.epochs=2", "train.ttt_steps=3", "data.batch_size=2",
    "data.eval_batch_size=2", "data.eval_max_samples=4", "train.eval_interval=10", "train.save_interval=4",
    "train.keep_checkpoints=10", "train.export=false", "train.warmup_steps=2", "deepspeed.zero_stage=3",
    "deepspeed.precision=fp32", "data.max_len=384",
]
ENGINE = {"enforce_eager": True}


def _server_groups(scratch: Path) -> set[int]:
    """The process groups of the servers whose scratch is under `scratch`: each server's guard leads one (its command
    line names the scratch) holding vLLM's API server and engine, so that servers of other jobs do not count."""
    groups = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "--guard" in cmd and str(scratch) in cmd:
                groups.add(int(proc.name))
    return groups


def _members(groups: set[int]) -> set[int]:
    return set().union(*(group_members(g) for g in groups))


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("served_vllm") / "prep"
    run_prep(out, "smollm2-135m-instruct", "sharegpt-embedded", num_samples=44, eval_samples=4, max_len=384,
             dtype="float32", draft_vocab_count="train",
             **{"regen.enabled": False, "capture.engine": "vllm", "vllm.python": VLLM_PYTHON,
                "vllm.engine_kwargs": ENGINE})
    return out


def test_two_ranks_fed_by_real_vllm_equal_offline_and_kill_9_resumes(tmp_path: Path, prep: Path) -> None:
    offline = tmp_path / "offline"
    torchrun(offline, prep, common=COMMON, timeout_s=900)
    assert len(records(offline, "train")) == 20

    scratch = tmp_path / "scratch"
    served = tmp_path / "served"
    args = [*COMMON, f"data.dir={prep}", f"out_dir={served}", "data.source=vllm", f"vllm.python={VLLM_PYTHON}",
            "+vllm.engine_kwargs.enforce_eager=true", f"vllm.scratch_dir={scratch}"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
              str(free_port()), str(ROOT / "launch" / "train.py")]
    proc = subprocess.Popen([*launch, *args], cwd=ROOT, env=clean_env(), start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 900
    while not (served / "checkpoints" / "latest").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-4000:]
        time.sleep(0.5)
    groups = _server_groups(scratch)
    started = _members(groups)
    assert len(started) >= 3, f"no guarded vLLM server while training ran: {started}"  # guard, server, engine
    os.killpg(proc.pid, signal.SIGKILL)  # every training process at once; the servers are in sessions of their own
    proc.wait(timeout=60)
    deadline = time.time() + 60
    while _members(groups) and time.time() < deadline:
        time.sleep(0.5)
    assert not _members(groups), "vLLM processes outlived kill -9 of training"
    killed_at = len(records(served, "train"))
    assert 4 <= killed_at < 20, killed_at

    torchrun(served, prep, "data.source=vllm", f"vllm.python={VLLM_PYTHON}", "+vllm.engine_kwargs.enforce_eager=true",
             f"vllm.scratch_dir={scratch}", "train.resume=true", common=COMMON, timeout_s=1200)
    assert_close_curves(served, offline, RTOL)
    summary = json.loads((served / "summary.json").read_text())
    data = summary["data"]
    print(f"killed after step {killed_at}; resumed: {data}")
    assert data["source"] == "vllm" and data["bytes_written"] == 0 and summary["finished"]
    assert not _members(_server_groups(scratch)), "vLLM processes outlived the resumed run"


def test_on_policy_rollouts_on_real_vllm_are_the_ranks_rollouts(tmp_path: Path, prep: Path) -> None:
    common = [o for o in COMMON if not o.startswith(("train.max_steps=", "train.save_interval="))]
    opd = ["train.max_steps=4", "train.save_interval=2", "train.on_policy.enabled=true",
           "train.on_policy.max_new_tokens=16", "train.on_policy.depth=3", "train.on_policy.refresh_interval=2"]
    train_in_one_process(prep, [(tmp_path / "online", [*opd, "data.source=online"])], common=common)
    scratch = tmp_path / "scratch"
    torchrun(tmp_path / "served", prep, *opd, "data.source=vllm", f"vllm.python={VLLM_PYTHON}",
             "+vllm.engine_kwargs.enforce_eager=true", f"vllm.scratch_dir={scratch}", common=common, timeout_s=1200)
    one, other = records(tmp_path / "online", "train"), records(tmp_path / "served", "train")
    assert sorted(one) == [1, 2, 3, 4] and sum(r["rollout_new_tokens"] for r in one.values()) > 0
    assert_same_rollouts(tmp_path / "served", tmp_path / "online")
    # fp32 vLLM features are the transformers target's to ~1e-6 relative (tests/test_prep_capture_vllm.py)
    assert_close_curves(tmp_path / "served", tmp_path / "online", RTOL)
    worst = max(abs(other[s]["loss"] - one[s]["loss"]) / abs(one[s]["loss"]) for s in one)
    summary = json.loads((tmp_path / "served" / "summary.json").read_text())["data"]
    print(f"on-policy on vLLM: largest relative loss difference to the in-rank target {worst:.1e}; {summary}")
    assert summary["source"] == "on_policy" and summary["rollouts"] == 8  # 4 steps of 2 samples
    assert not _members(_server_groups(scratch)), "vLLM processes outlived the run"
