"""The exact teacher kept across epochs (train/teacher_cache.py): a hit serves the very rows a miss computed,
the loss and gradients match the uncached path's, the budget bounds it, and a training run with it gives the
same losses as without it, resumed or not."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from synthetic_prep import write_synthetic_prep
from tiny_ttt import H as H_TINY
from tiny_ttt import V as V_TINY
from tiny_ttt import tiny, trainable
from train_runs import records, train_in_one_process, weights
from ttt_stubs import random_batch

from train.teacher_cache import TeacherCache
from train.ttt import TTTSettings, count_valid, ttt_loss


def loss_and_grads(drafter, head, batch, settings, counts, targets):
    drafter.zero_grad(set_to_none=True)
    loss, m = ttt_loss(drafter, head, batch, settings, counts, teacher_targets=targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainable(drafter)}


@pytest.mark.parametrize("chunk", [5, 10**6])
def test_hits_serve_what_misses_computed_and_train_alike(chunk: int) -> None:
    drafter, head = tiny()
    settings = TTTSettings(steps=3, chunk_size=chunk)
    batch = random_batch("hidden", [13, 9, 11], V_TINY, H_TINY, seed=7)
    cache = TeacherCache(budget_mb=64)
    counts, first = count_valid(head, batch, settings, drafter, return_targets=True, cache=cache)
    assert (cache.hits, cache.misses, len(cache)) == (0, 3, 3)
    counts2, again = count_valid(head, batch, settings, drafter, return_targets=True, cache=cache)
    assert (cache.hits, cache.misses) == (3, 3) and torch.equal(counts, counts2)
    assert len(first) == len(again)
    for a, b in zip(first, again):
        assert torch.equal(a.p_tilde, b.p_tilde) and torch.equal(a.p_draft, b.p_draft) and torch.equal(a.argmax, b.argmax)
    # the same two first samples in another batch: served from the cache (one lookup per sample)
    count_valid(head, random_batch("hidden", [13, 9], V_TINY, H_TINY, seed=7), settings, drafter,
                return_targets=True, cache=cache)
    assert (cache.hits, cache.misses) == (5, 3)
    # an id whose rows sit at other positions (another sample under a cached id) is a miss, not a wrong hit
    impostor = replace(random_batch("hidden", [9], V_TINY, H_TINY, seed=8), sample_ids=["s2"])
    count_valid(head, impostor, settings, drafter, return_targets=True, cache=cache)
    assert (cache.hits, cache.misses) == (5, 4)
    plain_counts, plain = count_valid(head, batch, settings, drafter, return_targets=True)
    assert torch.equal(plain_counts, counts)
    ref = loss_and_grads(drafter, head, batch, settings, counts, plain)
    got = loss_and_grads(drafter, head, batch, settings, counts, again)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=1e-7)
    for name, g in got[1].items():
        torch.testing.assert_close(g, ref[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_budget_bounds_what_is_kept() -> None:
    drafter, head = tiny()
    batch = random_batch("hidden", [13, 9, 11], V_TINY, H_TINY, seed=7)
    cache = TeacherCache(budget_mb=0)
    count_valid(head, batch, TTTSettings(steps=3), drafter, return_targets=True, cache=cache)
    count_valid(head, batch, TTTSettings(steps=3), drafter, return_targets=True, cache=cache)
    assert len(cache) == 0 and cache.bytes == 0 and cache.hits == 0 and cache.misses == 6


EPOCHS = ["train.max_steps=8", "train.epochs=2", "train.save_interval=2"]  # 16 samples, batch 4: 2 epochs


@pytest.fixture(scope="module")
def cached_runs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("tcache")
    prep = write_synthetic_prep(base / "prep", n_train=16, n_eval=4, min_len=12, max_len=40)
    on = [*EPOCHS, "train.teacher_epoch_cache_mb=64"]
    train_in_one_process(prep, [
        (base / "off", EPOCHS),
        (base / "on", on),
        (base / "resumed", [*on, "train.stop_after_steps=6"]),  # stops in epoch 2: the cache is lost
        (base / "resumed", [*on, "train.resume=true"]),
    ])
    return {"off": base / "off", "on": base / "on", "resumed": base / "resumed"}


@pytest.mark.integration
def test_a_run_with_the_cache_trains_as_without_it(cached_runs) -> None:
    off, on = records(cached_runs["off"], "train"), records(cached_runs["on"], "train")
    assert sorted(off) == sorted(on) == list(range(1, 9))
    for step in on:
        assert on[step]["n_valid_k"] == off[step]["n_valid_k"]
        assert on[step]["loss"] == pytest.approx(off[step]["loss"], rel=1e-5), step


@pytest.mark.integration
def test_resuming_with_the_cache_is_bit_identical(cached_runs) -> None:
    r, x = records(cached_runs["resumed"], "train"), records(cached_runs["on"], "train")
    assert sorted(r) == sorted(x) == list(range(1, 9))
    assert all(r[s]["loss"] == x[s]["loss"] for s in r)  # served and recomputed rows are the same numbers
    wr, wx = weights(cached_runs["resumed"], 8), weights(cached_runs["on"], 8)
    assert all(torch.equal(wr[k], wx[k]) for k in wr)
