"""Samples longer than data.max_len: `truncate` (default, unchanged) or `split` into overlapping windows
(train/data.py `windows`) that train every (token, TTT step) pair of the sample exactly once."""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from synthetic_prep import write_synthetic_prep
from ttt_stubs import FakeSample

from train.batch import collate
from train.config import ConfigError, DataConfig, RunConfig
from train.data import ShardBatches, window, windows
from train.ttt import target_rows


def _sample(n: int, seed: int = 0) -> FakeSample:
    g = torch.Generator().manual_seed(seed)
    return FakeSample("s", torch.randint(1, 50, (n,), generator=g), torch.rand(n, generator=g) < 0.8,
                      torch.randn(n, 6, generator=g), teacher_argmax=torch.randint(0, 50, (n,), generator=g))


def _trained_pairs(sample: FakeSample, steps: int, offset: int = 0) -> Counter:
    """(TTT step, predicted token's index in the original sample) pairs a sample's loss counts."""
    _, j, reachable = target_rows(collate([sample]), steps)
    k, i = reachable.nonzero(as_tuple=True)
    return Counter(zip(k.tolist(), (j[i] + 1 + offset).tolist()))


def test_window_starts() -> None:
    assert windows(40, 40, 8) == [0]
    assert windows(41, 40, 8) == [0, 32]
    assert windows(100, 40, 8) == [0, 32, 64]  # [0, 40) [32, 72) [64, 100)
    assert windows(100, 40, 0) == [0, 40, 80]
    with pytest.raises(ValueError, match="overlap"):
        windows(100, 40, 40)


@pytest.mark.parametrize("steps,overlap", [(1, 2), (3, 4), (7, 8), (7, 13)])
def test_split_trains_every_token_and_step_once(steps: int, overlap: int) -> None:
    sample, max_len = _sample(131, seed=steps), 32
    whole = _trained_pairs(sample, steps)
    split: Counter = Counter()
    for start in windows(131, max_len, overlap):
        part = window(sample, start, max_len, overlap)
        assert len(part.input_ids) <= max_len and part.sample_id == f"s@{start}"
        assert torch.equal(part.taps, sample.taps[start : start + max_len])
        split += _trained_pairs(part, steps, offset=start)
    assert split == whole and max(split.values()) == 1


def test_disjoint_windows_lose_the_first_steps_at_window_starts() -> None:
    sample, steps = _sample(96, seed=3), 3
    split: Counter = Counter()
    for start in windows(96, 32, 0):
        split += _trained_pairs(window(sample, start, 32, 0), steps, offset=start)
    lost = _trained_pairs(sample, steps) - split
    assert lost and all(i % 32 < steps + 2 for _, i in lost)  # what the overlap >= K + 1 rule exists for


@pytest.fixture(scope="module")
def prep(tmp_path_factory) -> Path:
    return write_synthetic_prep(tmp_path_factory.mktemp("prep"), n_train=12, n_eval=2, min_len=8, max_len=40)


def test_split_mode_in_shard_batches(prep: Path) -> None:
    lengths = ShardBatches(prep / "train", DataConfig(dir=str(prep)), 2, 0, 1).shards.lengths()
    truncated = ShardBatches(prep / "train", DataConfig(dir=str(prep), max_len=16), 2, 0, 1)
    assert truncated.items == [(i, 0) for i in range(12)]  # the default: one item per sample, as before
    assert truncated.lengths == [min(n, 16) for n in lengths]

    cfg = DataConfig(dir=str(prep), max_len=16, overflow="split", split_overlap=4)
    data = ShardBatches(prep / "train", cfg, 1, 0, 1)  # batches of 1: no window dropped
    assert data.items == [(i, s) for i, n in enumerate(lengths) for s in windows(n, 16, 4)]
    assert len(data.items) > 12 and data.lengths == [min(lengths[i] - s, 16) for i, s in data.items]
    targets: Counter = Counter()
    for batch in data.epoch(0):
        assert batch.input_ids.shape[1] <= 16
        for sid, mask, valid in zip(batch.sample_ids, batch.loss_mask, batch.valid):
            targets[sid.split("@")[0]] += int((mask & valid)[1:].sum())
    full = {s.sample_id: int(s.loss_mask[1:].sum()) for s in data.shards}
    assert targets == full  # each loss-masked target token once, over the sample's windows


def test_split_config_is_validated() -> None:
    cfg = RunConfig(out_dir="/x")
    cfg.data.dir, cfg.data.overflow, cfg.data.max_len, cfg.data.split_overlap = "/x", "split", 64, 64
    with pytest.raises(ConfigError, match="split_overlap"):
        cfg.validate()
    cfg.data.split_overlap = 4  # < ttt_steps + 1 = 8
    with pytest.warns(UserWarning, match="never trained"):
        cfg.validate()
    cfg.data.split_overlap = 8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg.validate()
    cfg.data.overflow = "drop"
    with pytest.raises(ConfigError, match="data.overflow"):
        cfg.validate()
