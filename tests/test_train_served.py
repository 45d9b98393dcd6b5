"""data.source=vllm (train/served.py): training fed live by vLLM servers, against tests/vllm_standin.py.

On a prep of the tiny 8-layer target captured by the stand-in server (capture.engine=vllm), fp32:
  (a) 2 ranks fed by one server that training starts give the offline run's per-step losses on that prep (within
      1e-4 relative: the same server computes the same features), nothing written, the wait for features reported;
  (b) kill -9 of training leaves no server process; a SIGTERM stops at a step with a checkpoint (exit 75); each
      resumes and ends with the uninterrupted run's losses;
  (c) a server that dies mid-training stops the run with one engine error naming the server and its log (exit 3),
      the checkpoints intact, and the rerun resumes to the same losses; a server that hangs stops it within
      vllm.timeout_s;
  (d) the user's server (vllm.urls) feeds the same run;
  (e) what would fail later fails before any server starts;
  (f) the on-policy stage (train.on_policy, greedy) rolls out on the server: the rollouts and losses of the same
      stage with the target in the ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from job_steps import signal_step
from train_runs import (
    ONLINE_COMMON,
    ROOT,
    assert_close_curves,
    assert_same_rollouts,
    clean_env,
    records,
    torchrun,
    train_in_one_process,
)
from vllm_standin import standin_python

pytestmark = pytest.mark.integration

RTOL = 1e-4  # what the live run must hold to the offline one (the same server: measured equal here)
SIX = ["train.max_steps=6", "train.epochs=2"]  # 5 global batches per epoch: into epoch 1


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> str:
    return standin_python(tmp_path_factory.mktemp("standin"))


@pytest.fixture(scope="module")
def prep(tmp_path_factory, tiny_prep_dir: Path, tiny_target_dir: Path, tiny_sharegpt_file: Path, standin: str) -> Path:
    """tiny_prep_dir's regenerated conversations (reused: that stage resumes), captured by the stand-in server."""
    from conftest import run_prep

    out = tmp_path_factory.mktemp("prep_served")
    shutil.copytree(tiny_prep_dir / "regen", out / "regen")
    run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=10, eval_samples=2,
             **{"regen.max_new_tokens": 24, "regen.max_turns": 2, "capture.engine": "vllm", "vllm.python": standin,
                "vllm.scratch_dir": str(out.parent / "prep_scratch")})
    return out


def served(standin: str, scratch: Path, *extra: str) -> list[str]:
    return ["data.source=vllm", f"vllm.python={standin}", f"vllm.scratch_dir={scratch}", "vllm.timeout_s=60",
            *extra]


def _servers(log: Path) -> list[dict]:
    return [json.loads(line[7:]) for line in log.read_text().splitlines() if line.startswith("server ")]


def _gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    def alive(pid: int) -> bool:
        stat = Path(f"/proc/{pid}/stat")
        return stat.exists() and stat.read_text().split()[2] not in ("Z", "X")

    deadline = time.time() + timeout_s
    while time.time() < deadline and any(map(alive, pids)):
        time.sleep(0.2)
    return not any(map(alive, pids))


def _train_process(out: Path, prep: Path, overrides: list[str], env: dict) -> subprocess.Popen:
    """`python launch/train.py ...` as one process of its own (what a launcher's rank is)."""
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), *ONLINE_COMMON, f"data.dir={prep}", f"out_dir={out}",
           *overrides]
    return subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**clean_env(), **env})


def _wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout_s: float = 240.0) -> None:
    deadline = time.time() + timeout_s
    while not ((run / "metrics.jsonl").exists() and records(run, "train").get(step)):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)


def test_two_ranks_fed_by_one_server_give_the_offline_losses(tmp_path: Path, prep: Path, standin: str,
                                                            monkeypatch) -> None:
    """... and each sample's features are asked for once: epoch 1 and the held-out evaluations read the rank's
    cache (data.vllm_cache_gb), no prompt reaches the server twice."""
    log = tmp_path / "standin.log"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    monkeypatch.setenv("STANDIN_LOG_PROMPTS", "1")
    train_in_one_process(prep, [(tmp_path / "offline", SIX)], common=ONLINE_COMMON)
    scratch = tmp_path / "scratch"
    torchrun(tmp_path / "served", prep, *SIX, *served(standin, scratch), common=ONLINE_COMMON)
    assert len(records(tmp_path / "served", "train")) == 6
    assert_close_curves(tmp_path / "served", tmp_path / "offline", RTOL)
    ev, ref = records(tmp_path / "served", "eval"), records(tmp_path / "offline", "eval")
    assert sorted(ev) == sorted(ref) and all(ev[s]["loss_k"] == pytest.approx(ref[s]["loss_k"], rel=RTOL) for s in ev)
    servers = _servers(log)
    assert len(servers) == 1  # one server on the node, shared by its two ranks
    summary = json.loads((tmp_path / "served" / "summary.json").read_text())
    data = summary["data"]
    assert data["source"] == "vllm" and data["bytes_written"] == 0 and data["target_dtype"] == "float32"
    assert 0 <= data["feature_wait_share"] <= 1 and data["feature_wait_s"] >= 0
    assert data["samples_received"] == 6 and data["next_token_agreement"] is None  # teacher=hidden: no head is loaded
    prompts = [line for line in log.read_text().splitlines() if line.startswith("prompt ")]
    assert prompts and len(prompts) == len(set(prompts))  # every sample computed once, whatever the epoch
    assert data["samples_from_cache"] > 0 and data["samples_recomputed"] == 0 and data["cache_bytes"] > 0
    assert (tmp_path / "served" / "vllm.node0.s0.log").exists()
    assert not list(scratch.iterdir())  # every rank's scratch went with it
    assert _gone([servers[0]["pid"], servers[0]["child"]])


def test_kill_9_leaves_no_server_and_a_step_wide_sigterm_stops_and_both_resume_equal(tmp_path: Path, prep: Path,
                                                                                    standin: str) -> None:
    """kill -9 of training: its server goes with it. SIGTERM to every process of the step (SLURM's way: training, the
    guard, the server and its engine; the server exits on it): exit 75 with a checkpoint at the last step. Each
    rerun resumes, and the run ends with the uninterrupted run's losses."""

    ref = tmp_path / "ref"
    scratch = tmp_path / "scratch"
    common = [*SIX, *served(standin, scratch), "train.save_interval=1"]
    train_in_one_process(prep, [(ref, common)], common=ONLINE_COMMON)
    log = tmp_path / "standin.log"
    env = {"STANDIN_LOG": str(log), "STANDIN_SLOW_S": "0.2"}
    run = tmp_path / "run"
    proc = _train_process(run, prep, common, env)
    _wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    server = _servers(log)[0]
    assert _gone([server["pid"], server["child"]]), "training's vLLM server outlived kill -9 of training"
    log.unlink()
    proc = _train_process(run, prep, [*common, "train.resume=true"], env)
    _wait_for_step(run, 4, proc)
    pids = signal_step(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "engine error" not in err, err[-3000:]
    assert _gone(pids), "a process of training's step outlived its stop"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["preempted"] == "SIGTERM" and 4 <= summary["steps"] < 6
    train_in_one_process(prep, [(run, [*common, "train.resume=true"])], common=ONLINE_COMMON)
    assert_close_curves(run, ref, RTOL)
    assert not list(scratch.iterdir())


def test_a_server_that_dies_stops_the_run_naming_it_and_the_rerun_resumes(tmp_path: Path, prep: Path,
                                                                        standin: str) -> None:
    ref = tmp_path / "ref"
    common = [*SIX, *served(standin, tmp_path / "scratch"), "train.save_interval=1", "vllm.max_in_flight=1",
              "data.vllm_cache_gb=0"]
    train_in_one_process(prep, [(ref, common)], common=ONLINE_COMMON)
    run = tmp_path / "run"
    # the server exits at its 13th request: 2 samples a step and an eval of 2 at steps 0, 2 and 4 (nothing kept:
    # every one asked for again)
    proc = _train_process(run, prep, common, {"STANDIN_FAIL_AFTER": "12"})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-3000:]
    assert err.count("engine error on rank 0") == 1 and "Traceback" not in err, err[-3000:]
    assert re.search(r"vLLM server http://127.0.0.1:\d+ \(log: \S*/run/vllm\.\S+\.s0\.log\) exited: the server exited "
                     r"with status 3", err), err[-3000:]
    latest = int((run / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
    assert 3 <= latest < 6 and not (run / "summary.json").exists(), latest
    train_in_one_process(prep, [(run, [*common, "train.resume=true"])], common=ONLINE_COMMON)
    assert_close_curves(run, ref, RTOL)


def test_a_server_that_hangs_stops_the_run_within_its_timeout(tmp_path: Path, prep: Path, standin: str) -> None:
    run = tmp_path / "run"
    proc = _train_process(run, prep, [*SIX, *served(standin, tmp_path / "scratch", "vllm.timeout_s=6")],
                          {"STANDIN_HANG": "1"})
    start = time.time()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3, err[-3000:]
    assert re.search(r"vLLM server http://127.0.0.1:\d+ \(log: \S*/run/vllm\.\S+\.s0\.log\): no answer and no progress "
                     r"for 6 s", err), err[-3000:]
    assert time.time() - start < 120


def test_the_users_server_feeds_the_same_run(tmp_path: Path, prep: Path, standin: str, tiny_target_dir: Path) -> None:
    from serving.client import ServerSpec, serve_args
    from serving.server import VLLMServer
    from serving.states import engine_layer_ids

    ref = tmp_path / "ref"
    train_in_one_process(prep, [(ref, SIX)], common=ONLINE_COMMON)
    spec = ServerSpec(model=str(tiny_target_dir), dtype="float32", max_model_len=1025, hidden_size=32,
                      layer_ids=engine_layer_ids([1, 3, 4], 8))
    assert json.loads((prep / "rendered" / "spec.json").read_text())["spec"]["tap_layers"] == [1, 3, 4]
    with VLLMServer(standin, serve_args(spec, tmp_path / "spool", cuda=False), log_path=tmp_path / "user.log") as s:
        s.wait_healthy(120)
        os.environ["OPENAI_API_KEY"] = s.key
        try:
            train_in_one_process(prep, [(tmp_path / "user", [*SIX, "data.source=vllm", f"vllm.urls=[{s.url}]",
                                                             f"vllm.scratch_dir={tmp_path / 'scratch'}"])],
                                 common=ONLINE_COMMON)
        finally:
            del os.environ["OPENAI_API_KEY"]
    assert_close_curves(tmp_path / "user", ref, RTOL)
    assert not list((tmp_path / "user").glob("vllm.node*.log"))  # training started none


def test_on_policy_rollouts_on_the_server_are_the_ranks_rollouts(tmp_path: Path, prep: Path, standin: str,
                                                                 monkeypatch) -> None:
    """(f) train.on_policy with data.source=vllm on 2 ranks: each rollout is a capture request to the server, and a
    greedy request before it where prep's reply is not the greedy text; its chains replayed in the rank; every rollout counter is the one of the same stage with the
    target in 1 process (data.source=online), the losses within RTOL (the server's features)."""
    log = tmp_path / "standin.log"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    opd = ["train.max_steps=4", "train.on_policy.enabled=true", "train.on_policy.max_new_tokens=12",
           "train.on_policy.depth=3", "train.on_policy.refresh_interval=2"]
    train_in_one_process(prep, [(tmp_path / "online", [*opd, "data.source=online"])], common=ONLINE_COMMON)
    torchrun(tmp_path / "served", prep, *opd, *served(standin, tmp_path / "scratch"), common=ONLINE_COMMON)
    assert sorted(records(tmp_path / "online", "train")) == [1, 2, 3, 4]
    assert_same_rollouts(tmp_path / "served", tmp_path / "online")
    assert_close_curves(tmp_path / "served", tmp_path / "online", RTOL)
    requests = log.read_text().splitlines()
    summary = json.loads((tmp_path / "served" / "summary.json").read_text())["data"]
    assert summary["source"] == "on_policy" and summary["rollouts"] == 8
    # a greedy request for each rollout whose text is not prep's checked reply
    assert summary["rollouts_generated"] + summary["rollouts_reused"] == 8
    assert sum(line.startswith("generate") for line in requests) == summary["rollouts_generated"]


def test_hybrid_from_vllm_writes_epoch_0_then_reads_its_shards(tmp_path: Path, prep: Path, standin: str,
                                                               monkeypatch) -> None:
    """data.source=hybrid data.hybrid_from=vllm: epoch 0 from the server, written as the run's shards; epoch 1 reads
    them and asks the server nothing (the held-out split still comes from it); the losses are the offline run's."""
    log = tmp_path / "standin.log"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    train_in_one_process(prep, [(tmp_path / "offline", SIX)], common=ONLINE_COMMON)
    run = tmp_path / "hybrid"
    train_in_one_process(prep, [(run, [*SIX, *served(standin, tmp_path / "scratch"), "data.source=hybrid",
                                       "data.hybrid_from=vllm", "train.eval_interval=0"])], common=ONLINE_COMMON)
    assert_close_curves(run, tmp_path / "offline", RTOL)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data"]["source"] == "hybrid" and summary["data"]["bytes_written"] > 0
    from data_prep.shards import ShardSet

    assert len(ShardSet(run / "captured" / "train")) == 10  # every training sample, once
    asked = log.read_text().count("capture sample")
    assert 10 <= asked <= 10 + 2 + 2  # epoch 0's samples (and what ran ahead past them), the final eval's 2
