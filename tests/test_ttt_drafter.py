"""TTT with the real Eagle3Drafter + TargetHead (models/): dependencies, checkpointing, padding, gradients."""

from __future__ import annotations

import pytest
import torch
from tiny_ttt import H, V, loss_and_grads, tiny, trainable
from ttt_stubs import random_batch

from train.ttt import TTTSettings, evaluate, ttt_loss, unroll


@pytest.mark.parametrize("backend", ["fused", "chunked"])
def test_outputs_depend_only_on_the_ttt_inputs(backend):
    """Output (t, k) may depend on taps g_{<=t} and tokens x_{<=t+k+1}; and it does on x_{t+k+1}."""
    drafter, head = tiny(backend)
    batch = random_batch("hidden", [16], V, H, seed=1)
    K, T = 3, 16
    with torch.no_grad():
        base = unroll(drafter, batch, TTTSettings(steps=K))
        p = 9
        poked = batch.to("cpu")
        poked.input_ids = batch.input_ids.clone()
        poked.input_ids[0, p] = (batch.input_ids[0, p] + 1) % V
        tok = unroll(drafter, poked, TTTSettings(steps=K))
        poked = batch.to("cpu")
        poked.taps = batch.taps.clone()
        poked.taps[0, p] += 1.0
        tap = unroll(drafter, poked, TTTSettings(steps=K))
    for k in range(K):
        changed_tok = (tok[k] - base[k]).abs().amax(-1)[0] > 1e-6  # [T]
        changed_tap = (tap[k] - base[k]).abs().amax(-1)[0] > 1e-6
        t = torch.arange(T)
        assert not changed_tok[t + k + 1 < p].any(), f"step {k}: future token leaked"
        assert changed_tok[p - k - 1], f"step {k}: position {p - k - 1} must see x_{p} (its own input)"
        assert not changed_tap[t < p].any(), f"step {k}: future taps leaked"
        assert changed_tap[p:].all()


def test_gradients_reach_trainable_parameters_only():
    drafter, head = tiny()
    batch = random_batch("hidden", [12, 7], V, H, seed=2)
    loss, m, grads = loss_and_grads(drafter, head, batch, TTTSettings(steps=3, chunk_size=8))
    assert torch.isfinite(loss) and m["n_valid_k"].min() > 0
    assert drafter.embed_tokens.weight.grad is None and not any(p.grad is not None for p in head.parameters())
    for name in (
        "fc.weight",
        "midlayer.self_attn.q_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "lm_head.weight",
    ):
        assert grads[name].abs().sum() > 0, name


@pytest.mark.parametrize("kind", ["hidden", "topk", "argmax"])
def test_checkpointing_and_chunking_do_not_change_loss_or_grads(kind):
    drafter, head = tiny()
    batch = random_batch(kind, [13, 9], V, H, head=head, seed=3)
    ref = loss_and_grads(
        drafter, head, batch, TTTSettings(steps=3, chunk_size=10**6, checkpoint_chunks=False)
    )
    for settings in (
        TTTSettings(steps=3, chunk_size=5),
        TTTSettings(steps=3, chunk_size=7, checkpoint_layer=True),
        TTTSettings(steps=3, chunk_size=3, checkpoint_chunks=False, checkpoint_layer=True),
    ):
        loss, m, grads = loss_and_grads(drafter, head, batch, settings)
        torch.testing.assert_close(loss, ref[0], rtol=1e-5, atol=0)
        assert torch.equal(m["n_valid_k"], ref[1]["n_valid_k"])
        for name, g in grads.items():
            torch.testing.assert_close(g, ref[2][name], rtol=1e-4, atol=1e-6, msg=f"{name} {settings}")


def test_right_padding_changes_nothing():
    drafter, head = tiny()
    both = random_batch("hidden", [14, 6], V, H, seed=4)
    settings = TTTSettings(steps=4, chunk_size=6)
    _, m_both = ttt_loss(drafter, head, both, settings)
    singles = []
    for i, n in enumerate(both.lengths.tolist()):
        one = both.to("cpu")
        for name in ("input_ids", "loss_mask", "valid", "taps", "teacher_hidden"):
            setattr(one, name, getattr(both, name)[i : i + 1, :n])
        singles.append(ttt_loss(drafter, head, one, settings)[1])
    for key in ("ce_sum", "acc_sum", "min_pq_sum", "n_valid_k"):
        torch.testing.assert_close(m_both[key], singles[0][key] + singles[1][key], rtol=1e-5, atol=1e-6)


def test_evaluate_real_drafter_is_consistent():
    drafter, head = tiny()
    batch = random_batch("hidden", [15, 10], V, H, seed=5)
    settings = TTTSettings(steps=4)
    out = evaluate(drafter, head, [batch], settings)
    _, m = ttt_loss(drafter, head, batch, settings)
    assert out["n_valid_k"] == m["n_valid_k"].tolist()
    assert 1.0 <= out["sim_tau"] <= 5.0
    assert all(0.0 <= a <= 1.0 for a in out["acc_k"] + out["min_pq_k"])


def test_batch_without_targets_gives_zero_loss_and_zero_grads_everywhere():
    """A rank whose batch has no valid position must still run the same backward (DDP / ZeRO hooks)."""
    drafter, head = tiny()
    batch = random_batch("hidden", [9, 5], V, H, seed=6)
    batch.loss_mask[:] = False
    loss, m, grads = loss_and_grads(drafter, head, batch, TTTSettings(steps=3, chunk_size=4))
    assert float(loss) == 0.0 and m["n_valid_k"].tolist() == [0, 0, 0]
    assert set(grads) == {n for n, _ in trainable(drafter)}
    assert all(float(g.abs().sum()) == 0.0 for g in grads.values())


# The long-context memory savings change nothing: the drafter layer checkpointed per TTT step (recomputed in
# backward) gives bit-identical loss, metrics and gradients. (Chunked = unchunked loss: test_ttt_loss.py.)
@pytest.mark.parametrize("backend,fused_head", [("fused", True), ("chunked", False), ("reference", True)])
def test_checkpointed_layer_gives_identical_loss_and_grads(backend: str, fused_head: bool) -> None:
    drafter, head = tiny(backend)
    batch = random_batch("hidden", [29, 18], V, H, seed=11)
    plain = TTTSettings(steps=7, chunk_size=16, fused_head=fused_head)
    ckpt = TTTSettings(steps=7, chunk_size=16, fused_head=fused_head, checkpoint_layer=True)
    loss, m, grads = loss_and_grads(drafter, head, batch, plain)
    loss_c, m_c, grads_c = loss_and_grads(drafter, head, batch, ckpt)
    assert torch.equal(loss, loss_c)
    assert all(torch.equal(m[k], m_c[k]) for k in ("ce_sum", "acc_sum", "min_pq_sum", "n_valid_k"))
    assert grads.keys() == grads_c.keys() and len(grads) >= 10
    for name, g in grads.items():
        assert torch.equal(g, grads_c[name]), name
