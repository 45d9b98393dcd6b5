"""Sequence parallelism (train/sequence_parallel.py): slices with their halo add up to the whole batch,
2 gloo processes with DeepSpeed Ulysses give the 1-process loss, metrics and gradients of the real drafter, and
the trainer with deepspeed.sequence_parallel_size=2 follows its 1-process run."""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from synthetic_prep import write_synthetic_prep
from tiny_ttt import tiny
from train_runs import records, torchrun, train_in_one_process, weights
from ttt_stubs import StubDrafter, StubHead, random_batch, vocab

from train.config import ConfigError, RunConfig
from train.sequence_parallel import SeqSlice, apply_ulysses, owned_tokens, split_batch
from train.ttt import TTTSettings, count_valid, eval_sums, ttt_loss

V, VD, H = 96, 40, 32
SUMS = ("ce_sum", "acc_sum", "min_pq_sum", "n_valid_k")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _loss_grads(model, head, batch, settings, normalizer):
    model.zero_grad(set_to_none=True)
    loss, m = ttt_loss(model, head, batch, settings, normalizer=normalizer)
    loss.backward()
    return loss.detach(), m, _grads(model)


def test_split_batch_gives_each_rank_its_columns_and_a_halo() -> None:
    batch = random_batch("topk", [37, 20], V, H, seed=1)
    halo, parts = 4, [split_batch(batch, r, 2, 4) for r in range(2)]
    assert [(p.start, p.owned) for p in parts] == [(0, 19), (19, 19)]
    for p in parts:
        assert isinstance(p, SeqSlice) and p.taps.shape[1] == 19  # no taps in the halo
        for name in ("input_ids", "loss_mask", "valid", "teacher_topk_ids", "teacher_topk_logits"):
            got, full = getattr(p, name), getattr(batch, name)
            n = min(37, p.start + 19 + halo) - p.start
            assert got.shape[1] == 19 + halo and torch.equal(got[:, :n], full[:, p.start : p.start + n]), name
    assert not parts[1].valid[:, 18:].any() and (parts[1].input_ids[:, 18:] == 0).all()  # past T: padding
    assert torch.equal(torch.cat([p.taps for p in parts], 1)[:, :37], batch.taps)
    assert sum(int(owned_tokens(p)) for p in parts) == int(batch.valid.sum())
    moved = parts[1].to("cpu", torch.float64)
    assert isinstance(moved, SeqSlice) and (moved.start, moved.owned) == (19, 19)


@pytest.mark.parametrize("kind", ["hidden", "topk", "argmax"])
@pytest.mark.parametrize("size,steps", [(2, 3), (3, 7), (4, 1)])
def test_slices_add_up_to_the_whole_batch(kind: str, size: int, steps: int) -> None:
    """A position-wise drafter needs no attention exchange: the slices' loss, metrics, gradients and eval
    counts (with the global normaliser) are the whole batch's; the stub's position input checks the offset.
    Tolerances: the loss head works in fp32 whatever the input dtype, and sums in another order."""
    torch.manual_seed(0)
    d2t, t2d = vocab(V, VD, torch.Generator().manual_seed(0))
    drafter = StubDrafter(V, VD, H, 3, d2t, t2d).double()
    head = StubHead(H, V, torch.randn(V, H)).double()
    batch = random_batch(kind, [29, 17], V, H, head=head.float(), seed=2).to("cpu", torch.float64)
    head = head.double()
    settings = TTTSettings(steps=steps, chunk_size=5)
    full_counts = count_valid(head, batch, settings, drafter)
    ref_loss, ref_m, ref_g = _loss_grads(drafter, head, batch, settings, full_counts)
    slices = [split_batch(batch, r, size, steps + 1) for r in range(size)]
    assert torch.equal(sum(count_valid(head, s, settings, drafter) for s in slices), full_counts)
    outs = [_loss_grads(drafter, head, s, settings, full_counts) for s in slices]
    torch.testing.assert_close(sum(o[0] for o in outs), ref_loss, rtol=1e-6, atol=1e-8)
    for key in SUMS:
        torch.testing.assert_close(sum(o[1][key] for o in outs), ref_m[key], rtol=1e-6, atol=1e-8)
    for name, g in ref_g.items():
        torch.testing.assert_close(sum(o[2][name] for o in outs), g, rtol=1e-5, atol=1e-8)
    ref_eval = eval_sums(drafter, head, [batch], settings)
    got = [eval_sums(drafter, head, [s], settings) for s in slices]
    for key, value in ref_eval.items():
        torch.testing.assert_close(sum(g[key] for g in got), value, rtol=1e-6, atol=1e-8, msg=key)


def test_sequence_parallel_checks_heads_and_config() -> None:
    drafter, _ = tiny()  # 4 query heads, 2 kv heads
    with pytest.raises(ValueError, match="num_key_value_heads"):
        apply_ulysses(drafter, group=None, size=4)
    with pytest.raises(ValueError, match="no replaceable attention core"):
        apply_ulysses(torch.nn.Linear(2, 2), group=None, size=2)
    cfg = RunConfig(out_dir="/x")
    cfg.data.dir = "/x"
    cfg.deepspeed.sequence_parallel_size = 2
    cfg.data.batch_size = cfg.data.eval_batch_size = 2
    assert cfg.validate(world_size=4) is cfg  # 2 data-parallel groups of 2 ranks
    with pytest.raises(ConfigError, match="must divide the world size 3"):
        cfg.validate(world_size=3)
    cfg.data.batch_size = 3
    with pytest.raises(ConfigError, match="data-parallel size 2"):
        cfg.validate(world_size=4)
    cfg.data.batch_size, cfg.model.num_key_value_heads, cfg.model.num_attention_heads = 2, 3, 3
    with pytest.raises(ConfigError, match="num_attention_heads=3"):
        cfg.validate()
    cfg.model.num_key_value_heads = cfg.model.num_attention_heads = None
    cfg.model.method = "dflash"
    with pytest.raises(ConfigError, match="model.method=eagle3"):
        cfg.validate()


# ------------------------------------------------------------------------------- 2 processes, gloo
CASES = [  # (backend, TTTSettings kwargs): fused head + CPU flash kernel; autograd head + chunked + checkpoints
    ("fused", dict(steps=7, chunk_size=8)),
    ("chunked", dict(steps=3, chunk_size=5, fused_head=False, checkpoint_layer=True)),
    ("fused", dict(steps=2, chunk_size=64, checkpoint_layer=True)),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _all_sum(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    x = x.clone()
    dist.all_reduce(x)
    return x


def _sp_worker(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from train.engine import init_distributed, shutdown_distributed
    from train.sequence_parallel import SequenceParallel

    init_distributed("gloo")
    try:
        batch = random_batch("hidden", [37, 22], V, H, seed=7)  # T = 37: padded to 2 x 19
        for backend, kw in CASES:
            settings = TTTSettings(**kw)
            ref, head = tiny(backend)
            sp = SequenceParallel.create(world, max_steps=settings.steps)
            assert sp.data_parallel(rank, world) == (0, 1)
            model = sp.apply(copy.deepcopy(ref))
            counts = count_valid(head, batch, settings, ref)
            ref_loss, ref_m, ref_g = _loss_grads(ref, head, batch, settings, counts)

            part = sp.shard(batch)
            local = count_valid(head, part, settings, model)
            assert torch.equal(_all_sum(local), counts)
            loss, m, grads = _loss_grads(model, head, part, settings, _all_sum(local))
            torch.testing.assert_close(_all_sum(loss), ref_loss, rtol=1e-5, atol=1e-7)
            assert torch.equal(_all_sum(m["n_valid_k"]), ref_m["n_valid_k"])
            for key in ("ce_sum", "acc_sum", "min_pq_sum"):
                torch.testing.assert_close(_all_sum(m[key]), ref_m[key], rtol=1e-5, atol=1e-6, msg=key)
            assert grads.keys() == ref_g.keys()
            for name, g in ref_g.items():  # DeepSpeed's all-rank average x the trainer's loss * world = sum
                torch.testing.assert_close(_all_sum(grads[name]), g, rtol=1e-4, atol=1e-6, msg=f"{backend} {name}")

            ref_eval = eval_sums(ref, head, [batch], settings)
            got = eval_sums(model, head, [part], settings)
            for key, value in ref_eval.items():
                total = _all_sum(got[key])
                if value.is_floating_point():
                    torch.testing.assert_close(total, value, rtol=1e-5, atol=1e-6, msg=key)
                else:
                    assert torch.equal(total, value), key
    finally:
        shutdown_distributed()


@pytest.mark.integration
def test_sequence_parallel_2_processes_match_1_process() -> None:
    """SP=2 over gloo (DeepSpeed Ulysses all-to-all around the TTT attention, GQA 4 q / 2 kv heads, T not a
    multiple of 2, K up to 7): loss, metric sums, eval counts and summed gradients equal one process's."""
    mp.spawn(_sp_worker, args=(2, _port()), nprocs=2, join=True)


# The trainer with deepspeed.sequence_parallel_size=2 (2 gloo processes, ZeRO-3 really partitioned, DeepSpeed
# Ulysses, the drafter layer checkpointed) follows the 1-process run: same losses, counts, eval and weights.
@pytest.mark.integration
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
