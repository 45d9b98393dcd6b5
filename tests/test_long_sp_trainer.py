"""The trainer with deepspeed.sequence_parallel_size=2 (2 gloo processes, ZeRO-3 really partitioned, DeepSpeed
Ulysses, the drafter layer checkpointed) follows the 1-process run: same losses, counts, eval and weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synthetic_prep import write_synthetic_prep
from test_train_distributed import records, torchrun, train_in_one_process, weights


def test_sequence_parallel_run_matches_one_process(tmp_path: Path) -> None:
    prep = write_synthetic_prep(tmp_path / "prep", n_train=8, n_eval=4, min_len=12, max_len=40)
    one, sp = tmp_path / "one", tmp_path / "sp"
    # one sample per step: without sequence parallelism 2 ranks could not even split the batch
    extra = ["train.stop_after_steps=2", "train.checkpoint_layer=true", "data.batch_size=1", "data.eval_batch_size=1"]
    train_in_one_process(prep, [(one, extra)])
    torchrun(sp, prep, *extra, "deepspeed.sequence_parallel_size=2")
    a, b = records(one, "train"), records(sp, "train")
    for step in (1, 2):
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5)
        assert b[step]["n_valid_k"] == a[step]["n_valid_k"] and b[step]["tokens"] == a[step]["tokens"]
    assert records(sp, "eval")[2]["sim_tau"] == pytest.approx(records(one, "eval")[2]["sim_tau"], rel=1e-6)
    wa, wb = weights(one, 2), weights(sp, 2)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert (wa[key].float() - wb[key].float()).abs().max() < 1e-5, key
    assert json.loads((sp / "summary.json").read_text())["sequence_parallel_size"] == 2
