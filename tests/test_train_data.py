"""The global-batch sampler and per-rank loading: deterministic, world-size free, resumable."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from synthetic_prep import write_synthetic_prep

from data_prep.shards import ShardSet
from train.config import DataConfig
from train.data import ShardBatches, global_batches, pad_to


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return write_synthetic_prep(tmp_path_factory.mktemp("prep"), n_train=24, n_eval=6, min_len=8, max_len=40)


def test_global_batches_deterministic_per_seed_and_epoch() -> None:
    lengths = [int(x) for x in torch.randint(5, 500, (103,), generator=torch.Generator().manual_seed(0))]
    a = global_batches(lengths, 8, seed=1, epoch=0, bucket=True, bucket_pool=4)
    assert a == global_batches(lengths, 8, seed=1, epoch=0, bucket=True, bucket_pool=4)
    assert a != global_batches(lengths, 8, seed=1, epoch=1, bucket=True, bucket_pool=4)
    assert a != global_batches(lengths, 8, seed=2, epoch=0, bucket=True, bucket_pool=4)
    flat = [i for b in a for i in b]
    assert len(a) == 103 // 8 and all(len(b) == 8 for b in a)  # incomplete batch dropped
    assert len(set(flat)) == len(flat)  # no sample twice in an epoch


def test_bucketing_reduces_padding() -> None:
    lengths = [int(x) for x in torch.randint(5, 2000, (512,), generator=torch.Generator().manual_seed(0))]

    def padded(batches: list[list[int]]) -> int:
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    plain = padded(global_batches(lengths, 8, 0, 0, bucket=False, bucket_pool=16))
    bucketed = padded(global_batches(lengths, 8, 0, 0, bucket=True, bucket_pool=16))
    assert bucketed < plain / 4


@pytest.mark.parametrize("bucket", [True, False])
def test_rank_parts_make_up_the_same_global_batch(prep: Path, bucket: bool) -> None:
    cfg = DataConfig(dir=str(prep), batch_size=4, bucket=bucket, bucket_pool=2)
    one = list(ShardBatches(prep / "train", cfg, 4, rank=0, world_size=1, seed=3).epoch(1))
    two = [list(ShardBatches(prep / "train", cfg, 4, rank=r, world_size=2, seed=3).epoch(1)) for r in range(2)]
    assert len(one) == len(two[0]) == len(two[1]) == 24 // 4
    for whole, p0, p1 in zip(one, *two):
        assert sorted(whole.sample_ids) == sorted(p0.sample_ids + p1.sample_ids)
        # every rank is padded to the GLOBAL batch's longest sample: identical step shapes on all ranks
        assert p0.input_ids.shape[1] == p1.input_ids.shape[1] == whole.input_ids.shape[1]
        assert int(whole.valid.sum()) == int(p0.valid.sum() + p1.valid.sum())
        assert not (p0.loss_mask & ~p0.valid).any()


def test_cursor_resumes_mid_epoch(prep: Path) -> None:
    cfg = DataConfig(dir=str(prep), batch_size=4)
    data = ShardBatches(prep / "train", cfg, 4, rank=0, world_size=1, seed=0)
    full = [b.sample_ids for b in data.epoch(2)]
    assert [b.sample_ids for b in data.epoch(2, start=4)] == full[4:]


def test_eval_order_and_subset(prep: Path) -> None:
    cfg = DataConfig(dir=str(prep), eval_batch_size=2, eval_max_samples=5)
    data = ShardBatches(prep / "eval", cfg, 2, rank=0, world_size=1, max_samples=cfg.eval_max_samples)
    batches = list(data.epoch(0, shuffle=False))
    ids = [i for b in batches for i in b.sample_ids]
    assert len(ids) == 4 and set(ids) <= {f"eval-{i}" for i in range(5)}  # 5 -> 4: full batches only
    assert ids == [i for b in data.epoch(0, shuffle=False) for i in b.sample_ids]


def test_truncation_and_pad_to(prep: Path) -> None:
    cfg = DataConfig(dir=str(prep), batch_size=4, max_len=16)
    batch = next(iter(ShardBatches(prep / "train", cfg, 4, 0, 1).epoch(0)))
    assert batch.input_ids.shape[1] <= 16
    wide = pad_to(batch, 20)
    assert wide.input_ids.shape[1] == wide.taps.shape[1] == wide.teacher_hidden.shape[1] == 20
    assert not wide.valid[:, 16:].any() and not wide.loss_mask[:, 16:].any()
    assert torch.equal(wide.taps[:, :16], batch.taps[:, :16]) and (wide.input_ids[:, 16:] == 0).all()


def test_batch_size_must_split_evenly(prep: Path) -> None:
    with pytest.raises(ValueError, match="multiple of the world size"):
        ShardBatches(prep / "train", DataConfig(dir=str(prep)), 3, rank=0, world_size=2)


def test_train_samples_is_a_fixed_nested_subset_of_any_shard_layout(prep: Path) -> None:
    from train.data import nested_subset

    ids = [f"conv-{i}" for i in range(50)]
    small, large = nested_subset(ids, 10, "x"), nested_subset(ids, 30, "x")
    assert len(small) == 10 and set(small) < set(large)  # nested
    shuffled = ids[::-1]  # another shard layout of the same samples: the same samples are chosen
    assert {shuffled[i] for i in nested_subset(shuffled, 10, "x")} == {ids[i] for i in small}
    assert small != list(range(10))  # not the first (in a prep: the shortest) samples
    cfg = DataConfig(dir=str(prep), max_len=64, batch_size=4)
    full = ShardBatches(prep / "train", cfg, 4, rank=0, world_size=1)
    part = ShardBatches(prep / "train", cfg, 4, rank=0, world_size=1, subset=12)
    assert full.batches_per_epoch == 6 and part.batches_per_epoch == 3
    seen = {s for b in part.epoch(0) for s in b.sample_ids}
    assert seen == {full.shards.sample_ids()[i] for i in nested_subset(full.shards.sample_ids(), 12)}
    with pytest.raises(ValueError, match="data.train_samples=99"):
        ShardBatches(prep / "train", cfg, 4, rank=0, world_size=1, subset=99)


@pytest.mark.parametrize("world", [1, 2, 8])
def test_held_out_split_smaller_than_its_batch_gives_a_smaller_last_batch(prep: Path, world: int) -> None:
    """6 held-out samples, eval batch 8: one smaller batch, every sample once, none dropped; a rank the short batch
    leaves nothing (8 ranks) still runs the step, on a blank row that holds no sample and no target."""
    cfg = DataConfig(dir=str(prep))
    with pytest.raises(ValueError, match="fewer than one batch of 8"):
        ShardBatches(prep / "eval", cfg, 8, rank=0, world_size=1)  # training's rule: whole batches only
    parts = [list(ShardBatches(prep / "eval", cfg, 8, rank=r, world_size=world, drop_last=False).epoch(0, shuffle=False))
             for r in range(world)]
    assert all(len(p) == 1 for p in parts)
    batches = [p[0] for p in parts]
    real = [sid for b in batches for sid, row in zip(b.sample_ids, b.valid) if row.any()]
    assert sorted(real) == sorted(f"eval-{i}" for i in range(6))
    assert len({b.input_ids.shape[1] for b in batches}) == 1  # the same step shape on every rank
    blank = [b for b in batches if not b.valid.any()]
    assert len(blank) == max(0, world - 6)
    assert all(not b.loss_mask.any() and (b.input_ids == 0).all() for b in blank)
    mixed = ShardBatches(prep / "eval", cfg, 4, rank=0, world_size=1, drop_last=False)
    assert mixed.batches_per_epoch == 2 and [len(b) for b in mixed.epoch(0, shuffle=False)] == [4, 2]


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_loss_tokens_all_makes_every_real_token_a_target_once(prep: Path, overflow: str) -> None:
    """data.loss_tokens=all: the same batches, every real token a loss target (the prep's mask covers two thirds
    of each synthetic sample); split windows still leave their overlap to the window before (one target each)."""
    cfg = DataConfig(dir=str(prep), batch_size=4, max_len=24, split_overlap=6, overflow=overflow)
    masked = list(ShardBatches(prep / "train", cfg, 4, 0, 1, seed=0).epoch(0))
    every = list(ShardBatches(prep / "train", cfg, 4, 0, 1, seed=0, all_tokens=True).epoch(0))
    assert [b.sample_ids for b in masked] == [b.sample_ids for b in every]
    for m, e in zip(masked, every):
        assert not (m.loss_mask & ~e.loss_mask).any()  # a superset of the prep's mask
        assert not (e.loss_mask & ~e.valid).any()  # never padding
        first_windows = torch.tensor(["@" not in i for i in e.sample_ids])
        assert torch.equal(e.loss_mask[first_windows], e.valid[first_windows])
        later = e.loss_mask[~first_windows]
        assert not later[:, :6].any() and torch.equal(later[:, 6:], e.valid[~first_windows][:, 6:])
    assert sum(int(b.loss_mask.sum()) for b in every) > 1.3 * sum(int(b.loss_mask.sum()) for b in masked)
    assert (overflow == "split") == any("@" in i for b in every for i in b.sample_ids)  # later windows were seen


def test_loss_tokens_all_is_refused_on_a_one_pass_prep(prep: Path, tmp_path: Path) -> None:
    """A one-pass prep's samples hold zero rows past their loss mask: data.loss_tokens=all, which would train on
    them, is refused naming the prep, the key and why, before anything reads a shard; the prep's own mask, features
    computed whole in training, and a prep captured by prefills are not."""
    from infra.config_keys import ConfigError
    from train.data import check_loss_tokens

    one = write_synthetic_prep(tmp_path / "one", n_train=6, n_eval=2, min_len=8, max_len=24, one_pass=True)
    sample = next(iter(ShardSet(one / "train")))
    assert not sample.loss_mask[-2:].any() and not sample.taps[-2:].float().any()  # what `all` would train on
    with pytest.raises(ConfigError) as e:
        check_loss_tokens(DataConfig(dir=str(one), loss_tokens="all"))
    said = str(e.value)
    assert said.startswith(f"data.loss_tokens=all on {one}: 6 of its train samples were captured with their "
                           "regeneration (capture.one_pass") and "zeros" in said and "\n" not in said, said
    check_loss_tokens(DataConfig(dir=str(one), loss_tokens="assistant"))
    check_loss_tokens(DataConfig(dir=str(one), loss_tokens="all", source="online"))
    check_loss_tokens(DataConfig(dir=str(prep), loss_tokens="all"))
