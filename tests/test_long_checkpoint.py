"""The long-context memory savings change nothing: the drafter layer checkpointed per TTT step (recomputed
in backward) gives bit-identical loss, metrics and gradients. (Chunked = unchunked loss: test_ttt_drafter.py,
test_ttt_fused.py.)"""

from __future__ import annotations

import pytest
import torch
from test_ttt_drafter import H, V, loss_and_grads, tiny
from ttt_stubs import random_batch

from train.ttt import TTTSettings


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
