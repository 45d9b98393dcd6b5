"""Two nodes x 1 process give what 1 node x 2 processes gives: the same shards, the same losses, each output once.

The two "nodes" are two torchrun launchers on this machine, joined by the c10d rendezvous on loopback
(`--nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:<port>`), as launch/slurm/ starts one
per node. With c10d, torchrun gives node ranks in the rendezvous' own order (its participants sorted by host and
pid), not by --node_rank; nothing here depends on which launcher gets rank 0: every output is a function of the
global rank, and the files are asserted present once, whoever wrote them.

Training on a tiny synthetic prep (4 optimizer steps, checkpoints at 2 and 4, ZeRO-3):
  B    1 node x 2 processes                      (the reference)
  N    2 nodes x 1 process, beside B             (wandb offline on: one wandb run)
  N12  N cut back to its step-2 checkpoint, resumed on 1 node x 2 processes
  N11  the same, resumed on 1 node x 1 process
Prep on the tiny target: 2 nodes x 1 process beside 1 node x 2 processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import train_runs
from safetensors.torch import load_file
from synthetic_prep import write_synthetic_prep

from infra.processes import free_port

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
# train_runs' recipe with the export on: it is written once, by rank 0 of node 0
COMMON = [a.replace("train.export=false", "train.export=true") for a in train_runs.COMMON]
LOSS_RTOL = 1e-5  # 2 nodes x 1 against 1 x 2 (the same ranks and reduction: measured bit-identical)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled",
               PYTHONPATH=f"{ROOT}:{ROOT / 'tests'}")
    env.update(extra)
    return env


def launchers(nnodes: int, nproc: int) -> list[list[str]]:
    """The torchrun command of each node: one launcher (`nnodes` 1) or one per node joined by c10d rendezvous."""
    port = free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if nnodes == 1:
        return [[*torchrun, "--master_port", str(port)]]
    return [[*torchrun, "--nnodes", str(nnodes), "--node_rank", str(n), "--rdzv_backend", "c10d",
             "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"test{port}"] for n in range(nnodes)]


def start_all(jobs: list[tuple[list[str], dict]]) -> None:
    """Run every (command, env) at once and wait for all; each must succeed."""
    procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                    cwd=ROOT)) for cmd, env in jobs]
    failed = []
    for cmd, proc in procs:
        out, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failed.append(f"{' '.join(cmd)}\n{out[-2000:]}\n{err[-5000:]}")
    assert not failed, "\n\n".join(failed)


def train_jobs(out: Path, prep: Path, nnodes: int, nproc: int, *overrides: str, env: dict | None = None):
    script = [str(ROOT / "launch" / "train.py"), *COMMON, f"data.dir={prep}", f"out_dir={out}", *overrides]
    if nproc == 0:  # plain python, 1 process
        return [([sys.executable, *script], env or clean_env())]
    return [([*launcher, *script], env or clean_env()) for launcher in launchers(nnodes, nproc)]


def records(run: Path, kind: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    out = {r["step"]: r for r in rows if r["kind"] == kind}
    assert len(out) == len([r for r in rows if r["kind"] == kind]), f"{run}: a {kind} step logged twice"
    return out


def cut_back(run: Path, step: int, copy: Path) -> Path:
    """A copy of `run` as a preemption right after its checkpoint `step` leaves it."""
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("wandb", "export", "summary.json"))
    for later in (copy / "checkpoints").glob("step_*"):
        if int(later.name.removeprefix("step_")) > step:
            shutil.rmtree(later)
    (copy / "checkpoints" / "latest").write_text(f"step_{step:06d}\n")
    return copy


def files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("nodes")
    prep = write_synthetic_prep(base / "prep", n_train=16, n_eval=4, min_len=12, max_len=40)
    b, n = base / "B", base / "N"
    wandb_env = clean_env(WANDB_MODE="offline", WANDB_SILENT="true")
    start_all([*train_jobs(b, prep, 1, 2), *train_jobs(n, prep, 2, 1, "logger.wandb_mode=offline", env=wandb_env)])
    n12, n11 = cut_back(n, 2, base / "N12"), cut_back(n, 2, base / "N11")
    start_all([*train_jobs(n12, prep, 1, 2, "train.resume=true"), *train_jobs(n11, prep, 1, 0, "train.resume=true")])
    return {"B": b, "N": n, "N12": n12, "N11": n11}


def assert_losses_match(run: Path, ref: Path, steps: list[int], rtol: float) -> None:
    r, x = records(run, "train"), records(ref, "train")
    assert sorted(r) == sorted(x) == [1, 2, 3, 4]
    for step in steps:
        assert r[step]["n_valid_k"] == x[step]["n_valid_k"] and r[step]["lr"] == x[step]["lr"]  # the same batch
        assert r[step]["loss"] == pytest.approx(x[step]["loss"], rel=rtol, abs=0), (run.name, step)


def test_two_nodes_train_as_one_node_with_two_processes(runs) -> None:
    n, b = runs["N"], runs["B"]
    assert_losses_match(n, b, [1, 2, 3, 4], LOSS_RTOL)
    assert records(n, "eval")[4]["loss_k"] == pytest.approx(records(b, "eval")[4]["loss_k"], rel=LOSS_RTOL)
    s = json.loads((n / "summary.json").read_text())
    assert s["finished"] and s["world_size"] == 2 and s["steps"] == 4
    wn, wb = load_file(str(n / "export" / "model.safetensors")), load_file(str(b / "export" / "model.safetensors"))
    assert wn.keys() == wb.keys()
    for key in wn:
        torch.testing.assert_close(wn[key], wb[key], rtol=LOSS_RTOL, atol=1e-6)


def test_two_nodes_write_each_output_once(runs) -> None:
    n, b = runs["N"], runs["B"]
    # the same files as the 1-node run (rank 1's log beside rank 0's), besides the one wandb run
    assert [f for f in files(n) if not f.startswith("wandb/")] == files(b)
    assert sorted(p.name for p in (n / "checkpoints").iterdir()) == ["latest", "step_000002", "step_000004"]
    assert sorted(p.name for p in (n / "export").iterdir()) == sorted(p.name for p in (b / "export").iterdir())
    assert len(records(n, "summary")) == 1 and {"train.log", "train.rank1.log"} <= set(files(n))
    assert len(list((n / "wandb").glob("offline-run-*"))) == 1


def test_resume_on_another_number_of_nodes(runs) -> None:
    # 2 nodes x 1 -> 1 node x 2: the same ranks, so the same results as B; -> 1 x 1: B's up to the reduction order
    assert_losses_match(runs["N12"], runs["B"], [3, 4], LOSS_RTOL)
    assert_losses_match(runs["N11"], runs["B"], [3, 4], LOSS_RTOL)
    for name, world in (("N12", 2), ("N11", 1)):
        s = json.loads((runs[name] / "summary.json").read_text())
        assert s["finished"] and s["steps"] == 4 and s["world_size"] == world
        state = json.loads((runs[name] / "checkpoints" / "step_000002" / "state.json").read_text())
        assert state["world_size"] == 2  # resumed from the 2-node checkpoint


def test_two_nodes_prep_writes_the_shards_of_one_node(tmp_path, tiny_target_dir, tiny_sharegpt_file) -> None:
    def jobs(out: Path, nnodes: int, nproc: int):
        script = [str(ROOT / "launch" / "prep.py"), f"model={tiny_target_dir}", f"data={tiny_sharegpt_file}",
                  f"out={out}", "num_samples=10", "eval_samples=2", "draft_vocab_size=32", "regen.enabled=false",
                  "capture.tokens_per_shard=100"]
        return [([*launcher, *script], clean_env()) for launcher in launchers(nnodes, nproc)]

    one, two = tmp_path / "one_node", tmp_path / "two_nodes"
    start_all([*jobs(one, 1, 2), *jobs(two, 2, 1)])
    assert files(one) == files(two)  # every file once (summary.json, the vocabulary, the head: rank 0's)
    shard_files = [f for f in files(one) if f.split("/")[0] in ("train", "eval")]
    assert any("shards/r001-" in f for f in shard_files)
    for f in [*shard_files, "draft_vocab.safetensors", "target_head.safetensors"]:
        assert (one / f).read_bytes() == (two / f).read_bytes(), f  # byte for byte
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert s1["samples"] == s2["samples"] == {"train": 10, "eval": 2} and s1["tokens"] == s2["tokens"]
