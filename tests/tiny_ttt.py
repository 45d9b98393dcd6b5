"""The real tiny Eagle3Drafter with a target head for the TTT tests (tests/test_ttt_*, test_long_*,
test_train_teacher_cache.py): `tiny` builds the pair (most target argmaxes in the draft vocab), `trainable` lists
the drafter's trained parameters, `loss_and_grads` runs one TTT loss and backward.
"""

from __future__ import annotations

import torch
from ttt_stubs import vocab

from models.eagle3 import Eagle3Config, Eagle3Drafter
from models.target_head import TargetHead
from train.ttt import ttt_loss

V, VD, H = 96, 40, 32


def tiny(backend: str = "auto", seed: int = 0):
    cfg = Eagle3Config(
        hidden_size=H,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
        vocab_size=V,
        draft_vocab_size=VD,
        tap_layers=[1, 2, 3],
        max_position_embeddings=256,
    )
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, attn_backend=backend)
    drafter.load_target_embedding(torch.randn(V, H))
    gen = torch.Generator().manual_seed(seed)
    drafter.set_vocab_mapping(*vocab(V, VD, gen))
    head = TargetHead(H, V, 1e-6)
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 1, generator=gen)
        head.lm_head.weight[drafter.t2d] *= 2  # most target argmaxes in the draft vocab
    return drafter, head


def trainable(drafter):
    return [(n, p) for n, p in drafter.named_parameters() if p.requires_grad]


def loss_and_grads(drafter, head, batch, settings, normalizer=None):
    drafter.zero_grad(set_to_none=True)
    loss, metrics = ttt_loss(drafter, head, batch, settings, normalizer)
    loss.backward()
    return loss.detach(), metrics, {n: p.grad.clone() for n, p in trainable(drafter)}
