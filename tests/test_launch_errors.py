"""A user's mistake ends every launcher the same way: its message once (rank 0 under torchrun), no traceback, exit
status 2 (launch/errors.py); a bug keeps its traceback; a warning shows once per run, not once per rank."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from synthetic_prep import write_synthetic_prep

from data_prep.shards import ShardError
from launch.errors import USER_ERROR, user_errors

REPO = Path(__file__).resolve().parents[1]
TORCHRUN_REPORT = "torch/distributed/elastic"  # torchrun's own lines (its failure report) start after this


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "PYTHONWARNINGS", "HYDRA_FULL_ERROR")}
    return {**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", **extra}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(script: str, *overrides: str, nproc: int = 0) -> subprocess.CompletedProcess:
    launcher = [sys.executable] if not nproc else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(_port())]
    return subprocess.run([*launcher, str(REPO / "launch" / script), *overrides], capture_output=True, text=True,
                          env=_env(), timeout=300, cwd=REPO)


def _workers_output(r: subprocess.CompletedProcess) -> str:
    """What the workers printed: everything before torchrun's own failure report (its ChildFailedError traceback)."""
    text = r.stdout + r.stderr
    return "\n".join(line for line in text.splitlines()[: _report_start(text.splitlines())])


def _report_start(lines: list[str]) -> int:
    return next((i for i, line in enumerate(lines) if TORCHRUN_REPORT in line and "failed (exitcode" in line),
                len(lines))


def test_a_user_error_is_one_line_and_exit_2_a_bug_keeps_its_traceback(monkeypatch, capsys) -> None:
    def bad_prep() -> None:
        raise ShardError("/x: not a prep directory")

    def bug() -> None:
        raise KeyError("a bug")

    with pytest.raises(SystemExit) as e:
        user_errors(bad_prep)()
    assert e.value.code == USER_ERROR and capsys.readouterr().err == "error: /x: not a prep directory\n"
    with pytest.raises(SystemExit) as e:
        user_errors(lambda: sys.exit("config error: train.lr must be > 0"))()
    assert e.value.code == USER_ERROR and capsys.readouterr().err == "config error: train.lr must be > 0\n"
    with pytest.raises(KeyError):
        user_errors(bug)()
    monkeypatch.setenv("RANK", "1")  # another rank: the same exit status, nothing printed
    with pytest.raises(SystemExit) as e:
        user_errors(bad_prep)()
    assert e.value.code == USER_ERROR and capsys.readouterr().err == ""


@pytest.mark.integration
@pytest.mark.parametrize(("script", "overrides", "message"), [
    ("prep.py", ["+max_lenght=64", "out={tmp}/prep"], "config error: unknown config key 'max_lenght'"),
    ("prep.py", ["max_lenght=64", "out={tmp}/prep"], "config error: Could not override 'max_lenght'"),
    ("prep.py", ["model=nobody/nothing-here", "out={tmp}/prep"],
     "error: target 'nobody/nothing-here' is neither a preset"),
    ("eval.py", ["out_dir={tmp}/eval"],
     "config error: Structured config of type `EvalConfig` has missing mandatory value: drafter"),
    ("export.py", ["checkpoint={tmp}/run", "out={tmp}/export"], "/run"),
    ("train.py", ["data.dir={tmp}/prep", "out_dir={tmp}/run"], "/prep"),
], ids=["prep-unknown-key", "prep-override", "prep-unknown-target", "eval-missing-value", "export-missing-checkpoint",
        "train-missing-prep"])
def test_every_launcher_reports_a_user_error_once(tmp_path: Path, script: str, overrides: list[str],
                                                  message: str) -> None:
    r = _launch(script, *(o.format(tmp=tmp_path) for o in overrides))
    lines = [line for line in r.stderr.splitlines() if "accelerator" not in line]  # DeepSpeed's import-time note
    assert r.returncode == USER_ERROR, r.stderr[-3000:]
    assert message in r.stderr and "Traceback" not in r.stderr and "Error executing job" not in r.stderr, r.stderr
    assert sum(message in line for line in lines) == 1, r.stderr


@pytest.mark.integration
def test_under_torchrun_rank_0_reports_the_error_once(tmp_path: Path) -> None:
    r = _launch("prep.py", f"model={tmp_path}", f"out={tmp_path / 'prep'}", nproc=2)  # no config.json there
    workers = _workers_output(r)
    assert r.returncode == 1, workers  # torchrun's own status when a worker fails
    assert workers.count("a local target must be an HF model directory with config.json") == 1, workers
    assert "Traceback" not in workers and "Error executing job" not in workers, workers
    report = (r.stdout + r.stderr)[len(workers):]
    assert f"exitcode  : {USER_ERROR}" in report, report  # torchrun names each worker's exit status


@pytest.mark.integration
def test_a_two_rank_run_warns_once(tmp_path: Path) -> None:
    prep = write_synthetic_prep(tmp_path / "prep", n_train=8, n_eval=4)
    r = _launch("train.py", "+exp=debug", f"data.dir={prep}", f"out_dir={tmp_path / 'run'}", "train.max_steps=2",
                "data.batch_size=4", "data.eval_batch_size=2", "train.warmup_steps=5", "train.eval_interval=10",
                "train.export=false", "deepspeed=zero2", nproc=2)
    text = r.stdout + r.stderr
    assert r.returncode == 0, text[-4000:]
    assert text.count("train.eval_interval=10 > train.max_steps=2: only the final eval runs") == 1, text
    assert text.count("the lr warmup (5 optimizer steps) is not shorter than the run (2 steps)") == 1, text
