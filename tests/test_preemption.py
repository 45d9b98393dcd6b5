"""Preemption: SIGTERM / SIGUSR1 stop training and prep cleanly, with exit status 75, and the resumed run loses and
repeats nothing (infra/preemption.py).

Training, 2 processes under torchrun on a tiny synthetic prep, checkpoints far apart (save_interval beyond the run):
  ref  uninterrupted, 16 steps
  P    SIGTERM to the torchrun launcher once step 2 is logged -> stops at s1, checkpoint step s1 written;
       resumed, SIGUSR1 to the rank-1 worker alone -> stops at s2 > s1, every worker exits 75;
       resumed, SIGUSR1 to the launcher started with --signals-to-handle ...,SIGUSR1 -> stops at s3 > s2;
       resumed again to the end: every step's loss, lr and the final weights equal ref's bit for bit.
The signal lands wherever the run is; what is asserted holds for any stop step.
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
import torch
from safetensors.torch import load_file
from synthetic_prep import write_synthetic_prep

from infra.preemption import PREEMPTED
from infra.processes import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # what torchrun forwards to its workers by default
COMMON = [
    "+exp=debug", f"train.max_steps={STEPS}", "train.epochs=20", "train.ttt_steps=3", "train.chunk_size=8",
    "data.batch_size=4", "data.eval_batch_size=2", "data.eval_max_samples=4", "train.eval_interval=0",
    "train.save_interval=1000", "train.log_interval=1", "train.keep_checkpoints=5", "train.export=false",
    "train.warmup_steps=1",
    "deepspeed.zero_stage=3", "deepspeed.stage3_param_persistence_threshold=0",
]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    env.update(extra)
    return env


def start(out: Path, prep: Path, *overrides: str, nproc: int | None = 2, torchrun: tuple[str, ...] = ()
          ) -> subprocess.Popen:
    """launch/train.py under torchrun (options `torchrun`) with `nproc` processes (None: plain python, 1 process)."""
    script = [str(ROOT / "launch" / "train.py"), *COMMON, f"data.dir={prep}", f"out_dir={out}", *overrides]
    launcher = [sys.executable]
    if nproc is not None:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(free_port()),
                     *torchrun]
    return subprocess.Popen([*launcher, *script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), cwd=ROOT)


def finish(proc: subprocess.Popen, timeout: float = 240) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out + err


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [r["step"] for r in rows if r["kind"] == "train"]


def wait_for_step(run: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    end = time.monotonic() + timeout
    while max(logged_steps(run), default=0) < step:
        assert proc.poll() is None, finish(proc)[1][-4000:]
        assert time.monotonic() < end, f"step {step} not logged in {timeout} s"
        time.sleep(0.05)


def children(parent: int) -> dict[int, list[bytes]]:
    """The processes whose parent is `parent`: pid -> environment."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if ppid == parent:
            out[int(proc.name)] = environ
    return out


def worker_pid(launcher: int, rank: int) -> int:
    """The pid of the worker of `rank` that torchrun process `launcher` started (its child with RANK=<rank>)."""
    found = [pid for pid, env in children(launcher).items() if f"RANK={rank}".encode() in env]
    assert found, f"no worker of rank {rank} under pid {launcher}"
    return found[0]


def train_records(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    out = {r["step"]: r for r in train}
    assert len(out) == len(train), "a step logged twice"
    return out


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def assert_stopped_at_checkpoint(run: Path, signame: str, after: int) -> int:
    """The run stopped by `signame` after step `after`: summary, checkpoint at the stop step, `latest` on it."""
    s = summary(run)
    assert s["preempted"] == signame and not s["finished"] and after < s["steps"] < STEPS, s
    ckpt = run / "checkpoints" / f"step_{s['steps']:06d}"
    assert (ckpt / "state.json").is_file() and (run / "checkpoints" / "latest").read_text().strip() == ckpt.name
    assert json.loads((ckpt / "state.json").read_text())["step"] == s["steps"]
    assert max(train_records(run)) == s["steps"]
    return s["steps"]


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return write_synthetic_prep(tmp_path_factory.mktemp("preempt") / "prep", n_train=16, n_eval=4, min_len=12,
                                max_len=40)


def test_training_stopped_by_signals_resumes_bit_identical(prep: Path, tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    reference = start(ref, prep)  # beside the first preempted run: both fit the test's time together

    first = start(run, prep)
    wait_for_step(run, 2, first)
    first.send_signal(signal.SIGTERM)  # the launcher: torchrun forwards SIGTERM to its workers
    code, log = finish(first)
    assert code == 1 and "Received 15 death signal" in log, log[-4000:]  # torchrun's own status after a signal
    s1 = assert_stopped_at_checkpoint(run, "SIGTERM", 2)

    second = start(run, prep, "train.resume=true")
    wait_for_step(run, s1 + 1, second)
    os.kill(worker_pid(second.pid, 1), signal.SIGUSR1)  # one worker alone: every rank stops after the same step
    code, log = finish(second)
    assert code == 1 and log.count(f"exitcode  : {PREEMPTED}") == 2, log[-4000:]  # torchrun lists each worker's
    s2 = assert_stopped_at_checkpoint(run, "SIGUSR1", s1)

    # SIGUSR1 (SLURM's --signal) to the launcher: forwarded only when torchrun is told to handle it
    third = start(run, prep, "train.resume=true", torchrun=("--signals-to-handle", f"{TORCHRUN_SIGNALS},SIGUSR1"))
    wait_for_step(run, s2 + 1, third)
    third.send_signal(signal.SIGUSR1)
    code, log = finish(third)
    assert code == 1 and "Received 10 death signal" in log, log[-4000:]
    s3 = assert_stopped_at_checkpoint(run, "SIGUSR1", s2)

    last = start(run, prep, "train.resume=true")
    code, log = finish(last)
    assert code == 0, log[-4000:]
    code, log = finish(reference)
    assert code == 0, log[-4000:]

    assert summary(run)["finished"] and summary(run)["preempted"] is None
    r, x = train_records(run), train_records(ref)
    assert sorted(r) == sorted(x) == list(range(1, STEPS + 1))
    for step in r:  # bit-identical: the same batches in the same order, the same state after each stop
        assert (r[step]["loss"], r[step]["lr"], r[step]["acc_k"]) == (x[step]["loss"], x[step]["lr"],
                                                                        x[step]["acc_k"]), (step, s1, s2, s3)
    wr = load_file(str(run / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))
    wx = load_file(str(ref / "checkpoints" / f"step_{STEPS:06d}" / "model.safetensors"))
    assert wr.keys() == wx.keys() and all(torch.equal(wr[k], wx[k]) for k in wr)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == [
        f"step_{s:06d}" for s in (s1, s2, s3, STEPS)]


def test_one_process_exits_preempted(prep: Path, tmp_path: Path) -> None:
    """Without torchrun the process's own status is the documented one. The signal goes to the training process
    and to its DataLoader worker at once, as SLURM signals every process of a job step."""
    run = tmp_path / "one"
    proc = start(run, prep, "data.num_workers=1", nproc=None)
    wait_for_step(run, 1, proc)
    loader_workers = list(children(proc.pid))
    assert loader_workers  # data.num_workers=1
    for pid in [proc.pid, *loader_workers]:
        os.kill(pid, signal.SIGTERM)
    code, log = finish(proc)
    assert code == PREEMPTED, log[-4000:]
    assert_stopped_at_checkpoint(run, "SIGTERM", 1)


# Prep: a real SIGTERM, sent by the process to itself as its first shard is recorded (a deterministic moment
# inside the capture loop); then a rerun completes the prep.
PREEMPTED_PREP = """
import os, runpy, signal, sys
import data_prep.shards as shards
calls = {"n": 0}
real = shards._atomic_write_text
def signal_at_first_shard(path, text):
    real(path, text)
    calls["n"] += 1
    if calls["n"] == 1:
        os.kill(os.getpid(), signal.SIGTERM)
shards._atomic_write_text = signal_at_first_shard
sys.argv = [sys.argv[1], *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_prep_stopped_by_signal_resumes_without_loss_or_duplicates(tmp_path, tiny_target_dir,
                                                                  tiny_sharegpt_file) -> None:
    from conftest import run_prep

    from data_prep.shards import ShardSet

    opts = {"capture.tokens_per_shard": 100, "capture.batch_tokens": 64, "regen.enabled": False, "eval_samples": 2,
            "draft_vocab_size": 32, "num_samples": 10}
    out = tmp_path / "stopped"
    args = [f"model={tiny_target_dir}", f"data={tiny_sharegpt_file}", f"out={out}",
            *(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in opts.items())]
    env = {**clean_env(), "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    proc = subprocess.run([sys.executable, "-c", PREEMPTED_PREP, str(ROOT / "launch" / "prep.py"), *args],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == PREEMPTED, proc.stderr[-3000:]
    assert not (out / "summary.json").exists()  # unfinished
    manifest = json.loads((out / "train" / "manifest.r0.json").read_text())
    shards = sorted(p.name for p in (out / "train" / "shards").iterdir())
    assert len(manifest["shards"]) == len(shards) >= 1  # the shard in flight was written and recorded, no orphan
    assert 0 < sum(len(s["sample_ids"]) for s in manifest["shards"]) < 10  # the rerun has work left
    run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), **opts)
    clean = tmp_path / "clean"
    run_prep(clean, str(tiny_target_dir), str(tiny_sharegpt_file), **opts)
    for split in ("train", "eval"):
        a, b = ShardSet(out / split, verify="eager"), ShardSet(clean / split, verify="eager")
        ids = [a[i].sample_id for i in range(len(a))]
        assert len(ids) == len(set(ids)) == len(b)  # nothing duplicated, nothing lost
        by_id = {b[i].sample_id: b[i] for i in range(len(b))}
        for i in range(len(a)):
            assert torch.equal(a[i].input_ids, by_id[a[i].sample_id].input_ids)
            assert torch.equal(a[i].taps, by_id[a[i].sample_id].taps)
