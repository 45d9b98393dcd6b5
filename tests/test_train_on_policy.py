"""train.on_policy (train/on_policy.py): training on the drafter's own rollouts against the target in the ranks.

On a real prep of the tiny 8-layer target (conftest's tiny_prep_dir), from the export of a short supervised run
(train.init_from): the run logs its rollouts (rollout_*, replay_*), trains only the pairs they visited, refreshes
the rollout drafter from the trained weights at its interval and keeps it in every checkpoint; stopped between two
refreshes and resumed it is the uninterrupted run bit for bit; 2 processes match 1, and so do 2 processes whose
target is partitioned (zero3) or split (tp) over them, generating in lockstep. The sampled rollouts (temperature > 0)
run too. What the stage cannot run with is refused before training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from train_runs import (
    FOUR,
    LOSS_RTOL,
    ONLINE_COMMON,
    WEIGHT_ATOL,
    assert_close_curves,
    assert_same_rollouts,
    records,
    torchrun,
    train_in_one_process,
    weights,
)

from infra.config_keys import ConfigError
from train.config import DataConfig, RunConfig, TrainConfig

pytestmark = pytest.mark.integration

OPD = ["train.on_policy.enabled=true", "train.on_policy.max_new_tokens=12", "train.on_policy.depth=3",
       "train.on_policy.refresh_interval=2", "data.source=online"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_prep_dir: Path) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("on_policy")
    r = {k: base / k for k in ("supervised", "opd", "generated", "stopped", "two", "zero3", "tp", "sampled", "epochs",
                               "dflash_supervised", "dflash", "dflash_stopped", "dflash_two")}
    train_in_one_process(tiny_prep_dir, common=ONLINE_COMMON, jobs=[
        (r["supervised"], [*FOUR, "data.source=online", "train.export=true"]),
    ])
    start = f"train.init_from={r['supervised'] / 'export'}"
    train_in_one_process(tiny_prep_dir, common=ONLINE_COMMON, jobs=[
        (r["opd"], [*FOUR, *OPD, start]),
        (r["generated"], [*FOUR, *OPD, start, "train.on_policy.reuse_prep_replies=false"]),
        (r["stopped"], [*FOUR, *OPD, start, "train.stop_after_steps=3"]),  # between the refreshes at 2 and 4
        (r["stopped"], [*FOUR, *OPD, start, "train.resume=true"]),
    ])
    torchrun(r["two"], tiny_prep_dir, *FOUR, *OPD, start, common=ONLINE_COMMON)
    for placement in ("zero3", "tp"):
        torchrun(r[placement], tiny_prep_dir, *FOUR, *OPD, start, f"data.target_placement={placement}",
                 common=ONLINE_COMMON)
    train_in_one_process(tiny_prep_dir, common=ONLINE_COMMON, jobs=[
        (r["sampled"], ["train.max_steps=2", *OPD, start, "train.on_policy.temperature=1.0"]),
        (r["epochs"], ["train.max_steps=8", "train.epochs=2", *OPD, start]),
    ])
    taps = json.loads((tiny_prep_dir / "train" / "manifest.json").read_text())["tap_layers"]
    dflash = ["model=dflash", f"model.tap_layers=[{taps[0]},{taps[-1]}]", "model.dflash.block_size=4",
              "model.dflash.num_layers=1"]  # two of the prep's taps: the rollouts' replay picks them out
    train_in_one_process(tiny_prep_dir, common=ONLINE_COMMON, jobs=[
        (r["dflash_supervised"], [*FOUR, *dflash, "data.source=online", "train.export=true"]),
    ])
    dflash_start = f"train.init_from={r['dflash_supervised'] / 'export'}"
    train_in_one_process(tiny_prep_dir, common=ONLINE_COMMON, jobs=[
        (r["dflash"], [*FOUR, *OPD, *dflash, dflash_start]),
        (r["dflash_stopped"], [*FOUR, *OPD, *dflash, dflash_start, "train.stop_after_steps=3"]),
        (r["dflash_stopped"], [*FOUR, *OPD, *dflash, dflash_start, "train.resume=true"]),
    ])
    torchrun(r["dflash_two"], tiny_prep_dir, *FOUR, *OPD, *dflash, dflash_start, common=ONLINE_COMMON)
    return r


def test_an_on_policy_run_logs_its_rollouts_and_trains_the_visited_pairs(runs) -> None:
    train = records(runs["opd"], "train")
    assert sorted(train) == [1, 2, 3, 4]
    for step, rec in train.items():
        assert rec["rollouts"] == 2, step  # a global batch of 2 prompts, rolled out once each
        assert 0 < rec["rollout_new_tokens"] <= 2 * 12
        assert rec["rollout_cycles"] >= 1 and 1.0 <= rec["rollout_tau"] <= 4.0
        assert rec["replay_pairs"] >= rec["rollout_cycles"]  # every cycle visits at least its first step
        assert rec["n_valid_k"][0] >= rec["n_valid_k"][1] >= rec["n_valid_k"][2]
        assert sum(rec["n_valid_k"]) <= rec["replay_pairs"]  # only visited pairs are trained
    supervised = records(runs["supervised"], "train")
    assert train[1]["loss"] != pytest.approx(supervised[1]["loss"], rel=1e-3)  # other samples, other pairs
    summary = records(runs["opd"], "summary")[4]
    assert summary["data"]["source"] == "on_policy" and summary["data"]["rollout_drafter_step"] == 4
    assert summary["data"]["rollouts"] == 8
    assert summary["data"]["replay_pairs"] == sum(r["replay_pairs"] for r in train.values())


def test_the_rollout_drafter_is_refreshed_at_its_interval_and_checkpointed(runs) -> None:
    """Refreshed at steps 2 and 4 (before that step's checkpoint): each checkpoint's rollout drafter is its own
    trained weights; the run started from the export's weights, so step 2's are not the export's."""
    for step in (2, 4):
        w = weights(runs["opd"], step)
        rollout = {k.removeprefix("rollout/"): v for k, v in w.items() if k.startswith("rollout/")}
        params = {k.removeprefix("param/"): v for k, v in w.items() if k.startswith("param/")}
        assert sorted(rollout) == sorted(params)
        for name in params:
            assert torch.equal(rollout[name], params[name]), (step, name)
    stopped = weights(runs["stopped"], 3)  # stopped between refreshes: the drafter of step 2, not of step 3
    at_two = weights(runs["opd"], 2)
    for name in (k for k in stopped if k.startswith("rollout/")):
        assert torch.equal(stopped[name], at_two[name]), name
    assert any(not torch.equal(stopped[k], stopped["param/" + k.removeprefix("rollout/")])
               for k in stopped if k.startswith("rollout/"))


def test_a_stopped_on_policy_run_resumes_bit_identically(runs) -> None:
    a, b = records(runs["opd"], "train"), records(runs["stopped"], "train")
    assert sorted(a) == sorted(b)
    for step in a:
        for key in ("loss", "n_valid_k", "rollout_new_tokens", "rollout_cycles", "replay_pairs", "replay_rejected"):
            assert a[step][key] == b[step][key], (step, key)
    wa, wb = weights(runs["opd"], 4), weights(runs["stopped"], 4)
    assert sorted(wa) == sorted(wb)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_two_processes_match_one_on_policy(runs) -> None:
    assert_close_curves(runs["two"], runs["opd"], LOSS_RTOL)
    one, two = records(runs["opd"], "train"), records(runs["two"], "train")
    for step in one:
        assert one[step]["rollouts"] == two[step]["rollouts"] and one[step]["replay_pairs"] == two[step]["replay_pairs"]
    assert records(runs["two"], "summary")[4]["data"]["rollouts"] == 8  # every rank's, not rank 0's 4
    w1, w2 = weights(runs["opd"], 4), weights(runs["two"], 4)
    for name in (k for k in w1 if k.startswith("param/")):
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.parametrize("placement", ["zero3", "tp"])
def test_a_partitioned_or_split_target_rolls_out_what_a_whole_copy_does(runs, placement: str) -> None:
    """Greedy rollouts with the target's weights partitioned (zero3) or split (tp) over 2 ranks: generated in one
    batched call a step in lockstep, captured in one batched forward. The same rollouts as whole copies (every
    counter), and the losses to the fp32 rounding that padding and the split reductions move (as online training's
    placements agree)."""
    assert_same_rollouts(runs[placement], runs["two"])
    assert_close_curves(runs[placement], runs["two"], rtol=1e-5)
    summary = records(runs[placement], "summary")[4]["data"]
    assert summary["rollouts"] == 8 and summary["target_forwards"] == 4  # rank 0's: one batched capture a step


def test_a_greedy_rollouts_text_is_found_once_and_replayed_each_epoch(runs) -> None:
    """Epoch 0 (5 global batches) finds each sample's greedy continuation (prep's reply where it is the target's
    greedy text, else generated); epoch 1 (steps 6-8) finds none and replays the same texts with the drafter of its
    step: the same new tokens as epoch 0 had for them."""
    train = records(runs["epochs"], "train")
    assert sorted(train) == list(range(1, 9))
    assert all(train[s]["rollouts_generated"] + train[s]["rollouts_reused"] == train[s]["rollouts"] == 2
               for s in range(1, 6))
    assert all(train[s]["rollouts_generated"] == train[s]["rollouts_reused"] == 0 and train[s]["rollouts"] == 2
               for s in range(6, 9))
    first = sum(train[s]["rollout_new_tokens"] for s in range(1, 6))
    assert 0 < sum(train[s]["rollout_new_tokens"] for s in range(6, 9)) <= first


def test_prep_replies_that_are_the_greedy_text_are_not_generated_again(runs) -> None:
    """The tiny prep's replies were regenerated greedily by the same target: most are taken as the rollouts' texts
    (checked token by token on their capture), and the run is the one that generates every text: the same
    rollouts step by step, the same losses."""
    reused = sum(rec["rollouts_reused"] for rec in records(runs["opd"], "train").values())
    generated = records(runs["generated"], "train")
    assert reused > 0 and all(rec["rollouts_reused"] == 0 for rec in generated.values())
    assert_same_rollouts(runs["opd"], runs["generated"])
    assert_close_curves(runs["opd"], runs["generated"], rtol=1e-6)


def test_sampled_rollouts_decode_in_the_rank(runs) -> None:
    train = records(runs["sampled"], "train")
    assert sorted(train) == [1, 2]
    for rec in train.values():
        assert rec["rollouts"] == rec["rollouts_generated"] == 2  # sampled: new every time
        assert 0 < rec["rollout_new_tokens"] <= 2 * 12 and rec["rollout_cycles"] >= 1


def test_a_dflash_drafter_trains_on_its_rollouts_resumes_and_matches_two_ranks(runs) -> None:
    """DFlash (block drafting, greedy rollouts): cycles of its whole block (3 drafts), one block trained per cycle on
    the positions the target verified; stopped between two refreshes and resumed it is the uninterrupted run bit for
    bit; 2 processes match 1."""
    train = records(runs["dflash"], "train")
    assert sorted(train) == [1, 2, 3, 4]
    for step, rec in train.items():
        assert rec["rollouts"] == 2 and rec["rollout_cycles"] >= 1, step
        assert rec["n_valid_k"][0] <= rec["rollout_cycles"]  # a block per cycle, its first position verified
        assert sum(rec["n_valid_k"]) <= rec["replay_pairs"] and len(rec["n_valid_k"]) == 3
    stopped = records(runs["dflash_stopped"], "train")
    for step in train:
        for key in ("loss", "n_valid_k", "rollout_cycles", "replay_pairs", "replay_rejected"):
            assert stopped[step][key] == train[step][key], (step, key)
    wa, wb = weights(runs["dflash"], 4), weights(runs["dflash_stopped"], 4)
    assert sorted(wa) == sorted(wb) and any(k.startswith("rollout/") for k in wa)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert_close_curves(runs["dflash_two"], runs["dflash"], LOSS_RTOL)
    two = records(runs["dflash_two"], "train")
    for step in train:
        assert two[step]["replay_pairs"] == train[step]["replay_pairs"], step
    w2 = weights(runs["dflash_two"], 4)
    for name in (k for k in wa if k.startswith("param/")):
        torch.testing.assert_close(w2[name], wa[name], rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.parametrize("change, temperature, why", [
    ({"source": "offline"}, 0.0, "data.source=offline"),
    ({"source": "hybrid"}, 0.0, "data.source=hybrid"),
    ({"target_placement": "zero3"}, 1.0, "temperature=1.0 with data.target_placement=zero3"),
    ({"target_placement": "tp"}, 0.5, "temperature=0.5 with data.target_placement=tp"),
    ({"source": "vllm"}, 1.0, "temperature=1.0 with data.source=vllm"),
    ({"overflow": "split"}, 0.0, "data.overflow=split"),
])
def test_what_rollouts_cannot_run_with_is_refused(tiny_prep_dir: Path, change: dict, temperature: float,
                                                  why: str) -> None:
    cfg = RunConfig(out_dir="unused", data=DataConfig(**{"dir": str(tiny_prep_dir), "source": "online", **change}),
                    train=TrainConfig(ttt_steps=3))
    cfg.train.on_policy.enabled = True
    cfg.train.on_policy.temperature = temperature
    with pytest.raises(ConfigError, match=rf"train.on_policy.enabled=true: .*{why}"):
        cfg.validate(1)


@pytest.mark.parametrize("method, temperature, why", [
    ("eagle1", 0.0, "model.method=eagle1: EAGLE-1 drafters have no rollouts"),
    ("dflash", 1.0, "temperature=1.0 with model.method=dflash: DFlash rollouts are greedy"),
])
def test_what_a_family_cannot_roll_out_is_refused(tiny_prep_dir: Path, method: str, temperature: float,
                                                   why: str) -> None:
    from train.config import ModelConfig

    cfg = RunConfig(out_dir="unused", model=ModelConfig(method=method),
                    data=DataConfig(dir=str(tiny_prep_dir), source="online"), train=TrainConfig(ttt_steps=3))
    cfg.train.on_policy.enabled = True
    cfg.train.on_policy.temperature = temperature
    with pytest.raises(ConfigError, match=rf"train.on_policy.enabled=true: .*{why}"):
        cfg.validate(1)
