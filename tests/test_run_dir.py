"""A run directory belongs to one run, and one writer: what a reused, shared or edited run dir gets.

- a fresh run refuses an out_dir holding another run's files (train.overwrite=true clears them first);
- `latest` resolves to exactly the complete step_* dir it names; rotation keeps what was just written;
- a resume with other sample-order or schedule settings is refused, naming the key, old and new value;
- one writer per run dir and per prep dir (infra/dirlock.py), refused naming the holder's host and pid, and
  free again when the holder dies; torchrun's workers die with their launcher (launch/paths.py);
- `make export`'s own argument form exports the run's latest checkpoint, without its optimizer state.

One tiny finished run (1 process, synthetic prep, 2 steps) serves the tests that need one.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from synthetic_prep import write_synthetic_prep

from infra.dirlock import LOCK_FILE, DirLock, DirLocked
from train import checkpoint
from train.config import ConfigError, RunConfig
from train.trainer import RESUME_KEYS, RunDirError, check_resume, prepare_run_dir

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ["+exp=debug", "train.max_steps=2", "train.save_interval=1", "train.keep_checkpoints=2", "data.max_len=64",
         "data.eval_batch_size=2", "deepspeed.zero_stage=2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled"}


def _train(out: Path, prep: Path, *extra: str, nproc: int = 1) -> subprocess.CompletedProcess:
    script = [str(ROOT / "launch" / "train.py"), *TRAIN, f"data.dir={prep}", f"out_dir={out}", *extra]
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", str(_port())]
    return subprocess.run([*launcher, *script], capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """(prep, run): a finished 2-step run, checkpoints step_000001 and step_000002, `latest` -> step_000002."""
    base = tmp_path_factory.mktemp("run_dir")
    prep = write_synthetic_prep(base / "prep", n_train=8, n_eval=2, min_len=12, max_len=32)
    r = _train(base / "run", prep)
    assert r.returncode == 0, r.stderr[-5000:]
    return prep, base / "run"


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and not p.name.endswith(".log") and ".hydra" not in p.parts and p.name != LOCK_FILE}


# ---------------------------------------------------------------------------------------------------------------
# a fresh run in a used out_dir


@pytest.mark.integration
def test_fresh_run_in_a_used_out_dir_is_refused_and_changes_nothing(finished) -> None:
    prep, run = finished
    before = _snapshot(run)
    r = _train(run, prep, "train.max_steps=1")
    assert r.returncode != 0
    assert "holds a previous run's files" in r.stderr and "train.resume=true" in r.stderr, r.stderr[-3000:]
    assert "train.overwrite=true" in r.stderr and "checkpoints" in r.stderr
    assert _snapshot(run) == before  # the old run's checkpoints, metrics and export are all still there


@pytest.mark.integration
def test_overwrite_clears_the_previous_run_first(finished, tmp_path: Path) -> None:
    prep, run = finished
    again = tmp_path / "again"
    shutil.copytree(run, again)
    r = _train(again, prep, "train.max_steps=1", "train.overwrite=true", "train.export=false")
    assert r.returncode == 0, r.stderr[-5000:]
    assert sorted(p.name for p in (again / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert checkpoint.resolve(again) == again / "checkpoints" / "step_000001"
    steps = {json.loads(line)["step"] for line in (again / "metrics.jsonl").read_text().splitlines()}
    assert steps == {0, 1} and not (again / "export").exists()  # nothing of the 2-step run is left


def test_overwrite_removes_nothing_when_the_dir_holds_foreign_files(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "train.log").write_text("a log")
    (tmp_path / "eval_chain").mkdir()  # an evaluation of the run's export
    with pytest.raises(RunDirError, match="also holds notes.txt: nothing was removed"):
        prepare_run_dir(tmp_path, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "eval_chain", "metrics.jsonl", "notes.txt",
                                                           "train.log"]
    (tmp_path / "notes.txt").unlink()
    prepare_run_dir(tmp_path, resume=False, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.log"]  # logs and .hydra are this launch's own
    prepare_run_dir(tmp_path, resume=False, overwrite=False)  # what is left counts as empty


def test_resume_and_overwrite_together_are_refused() -> None:
    cfg = RunConfig(out_dir="x")
    cfg.data.dir = "p"
    cfg.train.resume = cfg.train.overwrite = True
    with pytest.raises(ConfigError, match="train.resume=true and train.overwrite=true"):
        cfg.validate()


# ---------------------------------------------------------------------------------------------------------------
# `latest` and rotation

STATE = {"params": {"w": torch.zeros(2)}, "exp_avg": {"w": torch.zeros(2)}, "exp_avg_sq": {"w": torch.zeros(2)},
         "adam_step": 1, "scheduler": {}}


def _save(root: Path, step: int, keep: int = 2) -> Path:
    return checkpoint.save(root, step, STATE, {}, {}, {}, keep=keep)


def test_rotation_keeps_the_checkpoint_just_written_by_step_number(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    _save(root, 999_999, keep=1)
    _save(root, 1_000_000, keep=1)  # "step_1000000" sorts before "step_999999" by name
    assert [p.name for p in root.glob("step_*")] == ["step_1000000"]
    assert checkpoint.resolve(root) == root / "step_1000000"
    for step in (1, 2, 3):
        _save(root, step)  # a later step dir is a continuation the run went back from: superseded
    assert sorted(p.name for p in root.glob("step_*")) == ["step_000002", "step_000003"]
    assert checkpoint.resolve(tmp_path) == root / "step_000003"


@pytest.mark.parametrize(("pointer", "message"), [
    ("../elsewhere", "not a step_\\* directory beside it"),
    ("/abs/step_000001", "not a step_\\* directory beside it"),
    ("step_000007", "step_000007 is missing or incomplete"),
    ("step_000003", "step_000003 is missing or incomplete"),  # a dir without state.json: incomplete
], ids=["dotdot", "absolute", "missing", "incomplete"])
def test_latest_resolves_only_to_the_complete_dir_it_names(tmp_path: Path, pointer: str, message: str) -> None:
    root = tmp_path / "run" / "checkpoints"
    _save(root, 1)
    (root / "step_000003").mkdir()
    elsewhere = tmp_path / "run" / "elsewhere"  # a complete checkpoint outside checkpoints/
    shutil.copytree(root / "step_000001", elsewhere)
    (root / "latest").write_text(pointer + "\n")
    for path in (root, root.parent, root / "latest"):
        with pytest.raises(checkpoint.CheckpointError, match=message):
            checkpoint.resolve(path)


def test_step_dirs_without_a_pointer_are_not_guessed(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    _save(root, 1)
    (root / "latest").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="step_000001 but no `latest` pointer"):
        checkpoint.latest(root)
    assert checkpoint.latest(tmp_path / "nothing") is None  # nothing saved yet: no checkpoint, no error
    assert checkpoint.resolve(root / "step_000001") == root / "step_000001"  # a step dir itself still loads


# ---------------------------------------------------------------------------------------------------------------
# resume with changed settings


@pytest.mark.integration
def test_resume_with_another_batch_size_is_refused_naming_the_key(finished, tmp_path: Path) -> None:
    prep, run = finished
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    before = _snapshot(copy)
    r = _train(copy, prep, "train.resume=true", "data.batch_size=4")
    assert r.returncode != 0
    assert "data.batch_size: 2 -> 4" in r.stderr and "step_000002" in r.stderr, r.stderr[-3000:]
    assert _snapshot(copy) == before


def _run_config(run: Path, *overrides: str) -> RunConfig:
    raw = OmegaConf.merge(OmegaConf.load(run / "config.yaml"), OmegaConf.from_dotlist(list(overrides)))
    return RunConfig.from_omegaconf(raw)


@pytest.mark.integration
@pytest.mark.parametrize(("override", "named"), [
    ("train.seed=1", "train.seed: 0 -> 1"),
    ("train.max_steps=3", "train.max_steps: 2 -> 3"),
    ("train.lr=0.002", "train.lr: 0.001 -> 0.002"),
    ("train.schedule=wsd", "train.schedule: 'cosine' -> 'wsd'"),
    ("data.max_len=128", "data.max_len: 64 -> 128"),
    ("train.grad_accum=2", "train.grad_accum: 1 -> 2"),
    ("data.train_samples=4", "data.train_samples: None -> 4"),
    ("train.ttt_steps=5", "train.ttt_steps: 3 -> 5"),  # K changes the objective
    ("train.loss_decay=0.5", "train.loss_decay: 0.8 -> 0.5"),
])
def test_a_sample_order_or_schedule_setting_may_not_change(finished, override: str, named: str) -> None:
    _, run = finished
    latest = checkpoint.resolve(run)
    state = json.loads((latest / "state.json").read_text())
    assert sorted(state["settings"]) == sorted(RESUME_KEYS)
    check_resume(_run_config(run), state, latest)  # the run's own settings resume
    with pytest.raises(RunDirError, match=re.escape(named)):
        check_resume(_run_config(run, override), state, latest)


@pytest.mark.integration
def test_extending_a_finished_run_is_a_deliberate_option_and_recorded(finished, tmp_path: Path) -> None:
    prep, run = finished
    latest = checkpoint.resolve(run)
    state = json.loads((latest / "state.json").read_text())
    with pytest.raises(RunDirError, match="train.max_steps: 2 -> 4.*pass train.extend=true"):
        check_resume(_run_config(run, "train.max_steps=4"), state, latest)
    with pytest.raises(RunDirError, match="train.extend=true resumes .* on a longer schedule"):
        check_resume(_run_config(run, "train.extend=true", "train.resume=true", "train.max_steps=1"), state, latest)
    with pytest.raises(RunDirError, match="train.lr: 0.001 -> 0.002"):  # extend lengthens the schedule, nothing else
        check_resume(_run_config(run, "train.extend=true", "train.max_steps=4", "train.lr=0.002"), state, latest)
    got = check_resume(_run_config(run, "train.extend=true", "train.max_steps=4"), state, latest)
    assert got == [{"at_step": 2, "from": {"train.max_steps": 2}, "to": {"train.max_steps": 4}}]
    # end to end: the run goes on to step 4, and its summary and last checkpoint record the extension
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    r = _train(copy, prep, "train.resume=true", "train.extend=true", "train.max_steps=4")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["extensions"] == got
    assert json.loads((checkpoint.resolve(copy) / "state.json").read_text())["extensions"] == got


@pytest.mark.integration
def test_intervals_and_world_size_may_change(finished) -> None:
    _, run = finished
    latest = checkpoint.resolve(run)
    state = json.loads((latest / "state.json").read_text())
    cfg = _run_config(run, "train.eval_interval=7", "train.save_interval=3", "train.log_interval=2",
                      "train.keep_checkpoints=5", "train.stop_after_steps=1", "deepspeed.zero_stage=3",
                      "data.eval_batch_size=4", "data.num_workers=1", f"data.dir={Path(state['data_dir'])}/.")
    check_resume(cfg, state, latest)
    cfg.validate(world_size=2)  # another world size: the checkpoint is portable, the batches global


# ---------------------------------------------------------------------------------------------------------------
# one writer per directory


HOLD = """
import sys, time
from pathlib import Path
from infra.dirlock import DirLock
DirLock(Path(sys.argv[1]), "test").acquire()
print("locked", flush=True)
time.sleep(600)
"""


@pytest.mark.integration
def test_a_second_writer_is_refused_naming_the_holder_until_it_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DirLocked, match=f"host={re.escape(socket.gethostname())} pid={holder.pid}"):
            DirLock(tmp_path, "training").acquire()
    finally:
        holder.kill()  # SIGKILL: no cleanup runs, the kernel drops the lock
        holder.wait()
    with DirLock(tmp_path, "training") as lock:
        assert (tmp_path / LOCK_FILE).read_text() == f"host={socket.gethostname()} pid={os.getpid()}\n"
        assert lock.path == tmp_path / LOCK_FILE


def test_a_filesystem_without_locks_warns_instead_of_refusing(tmp_path: Path, monkeypatch) -> None:
    import errno
    import fcntl

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.warns(UserWarning, match="does not support flock .* would not be refused"):
        DirLock(tmp_path, "training").acquire().release()


@pytest.mark.integration
def test_a_second_torchrun_is_refused_before_any_training(tmp_path: Path) -> None:
    prep = write_synthetic_prep(tmp_path / "prep", n_train=8, n_eval=2, min_len=12, max_len=32)
    run = tmp_path / "run"
    with DirLock(run, "training"):  # a training already writing there (this process holds its lock)
        r = _train(run, prep, nproc=2)
    assert r.returncode != 0
    assert f"pid={os.getpid()}" in r.stderr and "another training writes this directory" in r.stderr, \
        r.stderr[-4000:]
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    assert not (run / "config.yaml").exists()


def test_a_second_prep_into_a_prep_dir_is_refused(tmp_path: Path) -> None:
    from data_prep.config import PrepConfig
    from data_prep.pipeline import run

    out = tmp_path / "prep"
    with DirLock(out, "prep"):
        with pytest.raises(DirLocked, match=f"another prep writes this directory \\(held by host=.* pid={os.getpid()}"):
            run(PrepConfig(model="no-such-model-is-ever-loaded", data="unused.jsonl", out=str(out)))
    assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
    with DirLock(out, "prep"):  # stage=vocab rewrites files of the prep dir too
        with pytest.raises(DirLocked, match=f"pid={os.getpid()}"):
            run(PrepConfig(model="no-such-model-is-ever-loaded", data="unused.jsonl", out=str(out), stage="vocab"))


WORKER = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import launch.paths  # what every launch script imports first
open(os.path.join(sys.argv[2], str(os.getpid())), "w").close()
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"  # a zombie has ended


@pytest.mark.integration
def test_workers_end_when_their_torchrun_launcher_is_killed(tmp_path: Path) -> None:
    script, pids = tmp_path / "worker.py", tmp_path / "pids"
    script.write_text(WORKER)
    pids.mkdir()
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_port", str(_port()), str(script), str(ROOT), str(pids)],
                                cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            workers = [int(p.name) for p in pids.iterdir()]
        assert len(workers) == 2, "the workers did not start"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _alive(w)], "workers outlived their launcher"
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def test_every_launch_script_imports_launch_paths_first() -> None:
    """The parent-death request lives in launch/paths.py: each entry point imports it before any package of ours."""
    import ast

    ours = ("launch", "data_prep", "train", "eval", "models")
    scripts = [p for p in sorted((ROOT / "launch").glob("*.py")) if '__name__ == "__main__"' in p.read_text()]
    assert {p.name for p in scripts} >= {"train.py", "prep.py", "eval.py", "export.py"}
    for path in scripts:
        imports = [n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
                   for n in ast.parse(path.read_text()).body if isinstance(n, (ast.Import, ast.ImportFrom))]
        first = next(m for m in imports if m and m.split(".")[0] in ours)
        assert first == "launch.paths", path.name


# ---------------------------------------------------------------------------------------------------------------
# make export


@pytest.mark.integration
def test_make_export_command_exports_the_latest_checkpoint(finished, tmp_path: Path) -> None:
    """The Makefile's own `export` recipe, RUN_DIR = the finished run, run as make would run it."""
    _, run = finished
    recipe = re.search(r"^export:.*\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    out = tmp_path / "export"
    argv = shlex.split(recipe.replace("$(BIN)/python", sys.executable).replace("$(RUN_DIR)", str(run))
                       .replace("$(ARGS)", "").replace(f"out={run}/export", f"out={out}"))
    assert argv[1:3] == ["launch/export.py", f"checkpoint={run}/checkpoints/latest"]
    r = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    ckpt = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    exported = load_file(str(out / "model.safetensors"))
    assert torch.equal(exported["fc.weight"], ckpt["param/fc.weight"].to(torch.bfloat16))
    # the end-of-run export is the same checkpoint's
    assert load_file(str(run / "export" / "model.safetensors")).keys() == exported.keys()


@pytest.mark.integration
def test_export_needs_no_optimizer_state(finished, tmp_path: Path) -> None:
    from train.export import export_checkpoint

    _, run = finished
    stripped = tmp_path / "step_000002"
    shutil.copytree(run / "checkpoints" / "step_000002", stripped)
    (stripped / "rng.pt").unlink()
    (stripped / "optimizer.safetensors").unlink()
    out = export_checkpoint(stripped, tmp_path / "export")
    full = load_file(str(run / "export" / "model.safetensors"))
    again = load_file(str(out / "model.safetensors"))
    assert full.keys() == again.keys() and all(torch.equal(full[k], again[k]) for k in full)
