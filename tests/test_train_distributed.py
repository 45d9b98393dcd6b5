"""1 vs 2 processes (ZeRO-3, gloo) and interrupted-and-resumed runs reproduce the uninterrupted run.

Short CPU runs on a tiny synthetic prep dir, shared by the tests (module fixture):
  A    1 process, 4 optimizer steps, checkpoints at 2 and 4     (the reference)
  B    2 processes (torchrun), the same                         (parity with A up to the reduction order)
  C    1 process, stopped after step 2, then resumed to step 4  (1 -> 1: bit-identical to A)
  B22  B killed right after its step-2 checkpoint, resumed with 2 processes  (2 -> 2: bit-identical to B)
  B21  the same, resumed with 1 process                         (2 -> 1: B up to the reduction order)
The 1-process runs go through one Python process, one after another, as sweep jobs do (it saves the
~10 s of torch/DeepSpeed imports per run; tests/train_runs.py).
ZeRO-3 really partitions here (persistence threshold 0) and chunk_size=8 gives ranks different numbers
of loss chunks, the case that needs the output head kept gathered (train/engine.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from synthetic_prep import write_synthetic_prep
from train_runs import LOSS_RTOL, WEIGHT_ATOL, killed_after, records, torchrun, train_in_one_process, weights

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("dist")
    prep = write_synthetic_prep(base / "prep", n_train=16, n_eval=4, min_len=12, max_len=40)
    a, b, c = base / "A", base / "B", base / "C"
    torchrun(b, prep)
    b22, b21 = killed_after(b, 2, base / "B22"), killed_after(b, 2, base / "B21")
    torchrun(b22, prep, "train.resume=true")
    train_in_one_process(prep, [
        (a, []),
        (c, ["train.stop_after_steps=2"]),
        (c, ["train.resume=true"]),
        (b21, ["train.resume=true"]),
    ])
    return {"A": a, "B": b, "C": c, "B22": b22, "B21": b21}


def assert_same_up_to_reduction_order(run: Path, ref: Path, steps: list[int]) -> None:
    r, x = records(run, "train"), records(ref, "train")
    assert sorted(r) == sorted(x) == [1, 2, 3, 4]
    for step in steps:
        assert r[step]["n_valid_k"] == x[step]["n_valid_k"] and r[step]["lr"] == x[step]["lr"]  # same batch
        assert r[step]["loss"] == pytest.approx(x[step]["loss"], rel=LOSS_RTOL, abs=0), step
        assert r[step]["acc_k"] == pytest.approx(x[step]["acc_k"], abs=1e-9)
    for step in (2, 4):
        wr, wx = weights(run, step), weights(ref, step)
        assert wr.keys() == wx.keys()
        for key in wr:
            assert (wr[key].float() - wx[key].float()).abs().max() <= WEIGHT_ATOL, (step, key)


def assert_bit_identical(run: Path, ref: Path) -> None:
    r, x = records(run, "train"), records(ref, "train")
    assert sorted(r) == sorted(x) == [1, 2, 3, 4]
    for step in r:
        assert (r[step]["loss"], r[step]["lr"], r[step]["acc_k"]) == (x[step]["loss"], x[step]["lr"], x[step]["acc_k"])
    assert records(run, "eval")[4]["loss_k"] == records(ref, "eval")[4]["loss_k"]
    wr, wx = weights(run, 4), weights(ref, 4)
    assert wr.keys() == wx.keys() and all(torch.equal(wr[k], wx[k]) for k in wr)


def test_two_processes_match_one_process(runs) -> None:
    assert_same_up_to_reduction_order(runs["B"], runs["A"], [1, 2, 3, 4])
    a = records(runs["A"], "train")
    assert a[2]["loss"] != a[1]["loss"]
    ea, eb = records(runs["A"], "eval")[2], records(runs["B"], "eval")[2]
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
    assert json.loads((runs["B"] / "checkpoints" / "step_000002" / "state.json").read_text())["world_size"] == 2


@pytest.mark.parametrize(("run", "ref"), [("C", "A"), ("B22", "B")], ids=["1->1", "2->2"])
def test_resume_same_world_size_is_bit_identical(runs, run: str, ref: str) -> None:
    assert_bit_identical(runs[run], runs[ref])
    wa = weights(runs[ref], 4)
    assert not torch.equal(wa["param/lm_head.weight"], weights(runs[ref], 2)["param/lm_head.weight"])


def test_resume_at_another_world_size_differs_by_reduction_order_only(runs) -> None:
    assert_same_up_to_reduction_order(runs["B21"], runs["B"], [3, 4])  # the resumed run continues its metrics file
    summary = json.loads((runs["B21"] / "summary.json").read_text())
    assert summary["finished"] and summary["steps"] == 4 and summary["world_size"] == 1
    state = json.loads((runs["B21"] / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["world_size"] == 2  # it did resume from the 2-process checkpoint
