"""A golden loss curve per family: a few optimizer steps of the real trainer (launch/train.py's code path,
one process, ZeRO-3; tests/train_runs.py's COMMON: 4 steps, K = 3, held-out evals at 2 and 4) on a
tiny seeded synthetic prep, the logged training losses and the last held-out loss and sim_tau pinned. Any
change to what training computes (data order, objectives, normalisation, schedule, optimizer,
initialisation) moves them; a change that should move them updates GOLDEN in the same commit, saying why.

The tolerance covers float reduction-order differences between CPUs (BLAS builds, vector widths), far
below what a real change of the loss does at the first step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from synthetic_prep import write_synthetic_prep
from train_runs import records, train_in_one_process

pytestmark = pytest.mark.integration

FAMILIES = {
    "eagle3": [],
    "eagle1": ["model=eagle1"],
    "dflash": ["model=dflash", "model.tap_layers=[1,3,4]", "model.dflash.mask_token_id=255",
               "model.dflash.num_layers=2", "model.dflash.block_size=6", "train.dflash.anchors=5"],
}
# method -> (train loss at steps 1..4, held-out loss_k[0] and sim_tau at step 4); measured at this commit
GOLDEN = {
    "eagle3": ([7.925130844116211, 7.624810218811035, 8.211864471435547, 8.466708183288574],
               2.7079285108126125, 1.841637744651798),
    "eagle1": ([3.3930532932281494, 3.2612481117248535, 3.0406720638275146, 3.617025375366211],
               5.319732079139123, 1.8374630177514792),
    "dflash": ([30.796974182128906, 27.08647346496582, 26.162126541137695, 25.137975692749023],
               23.789210510253906, 1.0),
}
RTOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("golden")
    prep = write_synthetic_prep(base / "prep", n_train=16, n_eval=4, min_len=12, max_len=32)
    jobs = {method: base / method for method in FAMILIES}
    train_in_one_process(prep, [(jobs[m], extra) for m, extra in FAMILIES.items()])
    return jobs


@pytest.mark.parametrize("method", list(FAMILIES))
def test_the_loss_curve_is_the_golden_one(runs: dict[str, Path], method: str) -> None:
    losses, held_out_loss, sim_tau = GOLDEN[method]
    train, held_out = records(runs[method], "train"), records(runs[method], "eval")
    assert sorted(train) == [1, 2, 3, 4]
    assert [train[s]["loss"] for s in sorted(train)] == pytest.approx(losses, rel=RTOL)
    assert held_out[4]["loss_k"][0] == pytest.approx(held_out_loss, rel=RTOL)
    assert held_out[4]["sim_tau"] == pytest.approx(sim_tau, rel=RTOL)
