"""1 vs 2 processes (ZeRO-3, gloo) and interrupted-and-resumed runs reproduce the uninterrupted run.

Short CPU runs on a tiny synthetic prep dir, shared by the tests (module fixture):
  B   2 processes (torchrun), stopped after step 2             (parity with A; a world-size-2 checkpoint)
  A   1 process, 4 optimizer steps, checkpoints at 2 and 4      (the reference)
  C   1 process, stopped after step 2, then resumed to step 4   (resume at the same world size: exact)
  B'  B resumed with 1 process to step 4                        (resume at another world size)
The 1-process runs go through one Python process, one after another, as sweep jobs do (it saves the
~10 s of torch/DeepSpeed imports per run).
ZeRO-3 really partitions here (persistence threshold 0) and chunk_size=8 gives ranks different numbers
of loss chunks, the case that needs the output head kept gathered (train/engine.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train.synthetic import write_synthetic_prep

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "+exp=debug", "train.max_steps=4", "train.epochs=2", "train.ttt_steps=3", "train.chunk_size=8",
    "data.batch_size=4", "data.eval_batch_size=2", "data.eval_max_samples=4", "train.eval_interval=2",
    "train.save_interval=2", "train.keep_checkpoints=5", "train.export=false", "train.warmup_steps=1",
    "deepspeed.zero_stage=3", "deepspeed.stage3_param_persistence_threshold=0",
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Several 1-process runs in ONE process, in order (the in-process multi-job path a sweep uses).
DRIVER = """
import json, sys
from hydra import compose, initialize_config_dir
from train.config import RunConfig, register_configs
from train.trainer import run
register_configs()
with initialize_config_dir(sys.argv[1], version_base="1.3"):
    for overrides in json.loads(sys.argv[2]):
        cfg = RunConfig.from_omegaconf(compose("train", overrides=overrides)).validate(1)
        run(cfg, cfg.out_dir)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    return env


def _check(r: subprocess.CompletedProcess, what: str) -> None:
    assert r.returncode == 0, f"{what}\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


def torchrun(out: Path, prep: Path, *overrides: str, nproc: int = 2) -> None:
    script = [str(ROOT / "launch" / "train.py"), *COMMON, f"data.dir={prep}", f"out_dir={out}", *overrides]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_port", str(_port())]
    r = subprocess.run([*launcher, *script], capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    _check(r, " ".join(script))


def train_in_one_process(prep: Path, jobs: list[tuple[Path, list[str]]]) -> None:
    overrides = [[*COMMON, f"data.dir={prep}", f"out_dir={out}", *extra] for out, extra in jobs]
    cmd = [sys.executable, "-c", DRIVER, str(ROOT / "conf"), json.dumps(overrides)]
    _check(subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT), str(overrides))


def records(run: Path, kind: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out = {r["step"]: r for r in rows if r["kind"] == kind}
    assert len(out) == len([r for r in rows if r["kind"] == kind]), "a step logged twice"
    return out


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run / "checkpoints" / f"step_{step:06d}" / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("dist")
    prep = write_synthetic_prep(base / "prep", n_train=16, n_eval=4, min_len=12, max_len=40)
    a, b, c = base / "A", base / "B", base / "C"
    torchrun(b, prep, "train.stop_after_steps=2")
    shutil.copytree(b, base / "B_at_2")
    train_in_one_process(prep, [
        (a, []),
        (c, ["train.stop_after_steps=2"]),
        (c, ["train.resume=true"]),
        (b, ["train.resume=true"]),  # B' in place: a resumed run continues its own directory
    ])
    return {"A": a, "B2": base / "B_at_2", "B": b, "C": c}


def test_two_processes_match_one_process(runs) -> None:
    a, b2 = records(runs["A"], "train"), records(runs["B2"], "train")
    assert sorted(b2) == [1, 2]
    for step in (1, 2):
        assert b2[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5)
        assert b2[step]["n_valid_k"] == a[step]["n_valid_k"]  # the same global batch
        assert b2[step]["acc_k"] == pytest.approx(a[step]["acc_k"], abs=1e-9)
    assert a[2]["loss"] != a[1]["loss"]
    wa, wb = weights(runs["A"], 2), weights(runs["B2"], 2)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.allclose(wa[key].float(), wb[key].float(), atol=1e-6, rtol=1e-5), key
    ea, eb = records(runs["A"], "eval")[2], records(runs["B2"], "eval")[2]
    assert eb["sim_tau"] == pytest.approx(ea["sim_tau"], rel=1e-6) and eb["n_valid_k"] == ea["n_valid_k"]


def test_frozen_embedding_is_not_trained_or_checkpointed(runs) -> None:
    ckpt = runs["A"] / "checkpoints" / "step_000002"
    params = [k for k in load_file(str(ckpt / "model.safetensors")) if k.startswith("param/")]
    moments = list(load_file(str(ckpt / "optimizer.safetensors")))
    assert "param/fc.weight" in params and "param/lm_head.weight" in params
    assert not any("embed_tokens" in k for k in params + moments)
    assert len(moments) == 2 * len(params)  # exp_avg + exp_avg_sq for exactly the trainable params
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 2 and state["adam_step"] == 2 and state["cursor"] == {"epoch": 0, "batch": 2}
    assert json.loads((runs["B2"] / "checkpoints" / "step_000002" / "state.json").read_text())["world_size"] == 2


def test_resume_same_world_size_is_exact(runs) -> None:
    a, c = records(runs["A"], "train"), records(runs["C"], "train")
    assert sorted(c) == [1, 2, 3, 4]
    assert (runs["C"] / "checkpoints" / "step_000002").is_dir()  # where the first process stopped
    for step in (1, 2, 3, 4):
        assert c[step]["loss"] == a[step]["loss"] and c[step]["lr"] == a[step]["lr"]
        assert c[step]["acc_k"] == a[step]["acc_k"]
    assert records(runs["C"], "eval")[4]["loss_k"] == records(runs["A"], "eval")[4]["loss_k"]
    wa, wc = weights(runs["A"], 4), weights(runs["C"], 4)
    assert all(torch.equal(wa[k], wc[k]) for k in wa)
    assert not torch.equal(wa["param/lm_head.weight"], weights(runs["A"], 2)["param/lm_head.weight"])


def test_resume_at_another_world_size(runs) -> None:
    a, b = records(runs["A"], "train"), records(runs["B"], "train")
    assert sorted(b) == [1, 2, 3, 4]  # the resumed run continues the same metrics file
    for step in (3, 4):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5)
        assert b[step]["lr"] == a[step]["lr"]
    wa, wb = weights(runs["A"], 4), weights(runs["B"], 4)
    for key in wa:
        assert torch.allclose(wa[key].float(), wb[key].float(), atol=1e-6, rtol=1e-5), key
    summary = json.loads((runs["B"] / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 4 and summary["world_size"] == 1
