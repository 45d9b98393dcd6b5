"""EAGLE-1's objective (docs/method.md §2): regress the next top-layer feature, plus w x the token CE through the
frozen target LM head. It reuses the TTT unroll and its row alignment (train/ttt.py) with the step-0 stream
f_t = norm(teacher_hidden_t) instead of fused taps; train.ttt_steps = 1 is EAGLE-1 as published (more steps
unroll the drafter on its own predicted features, training-time test on top of EAGLE-1).

Per valid target row j (the step-k output at position t = j-k-1):
    feat = mean_H SmoothL1(f̂, f_j)          f_j = target_norm(teacher_hidden_j)
    ce   = -Σ_x p_j(x) log softmax(lm_head(f̂))(x)
    loss = Σ_k λ^k (Σ_rows feat + w · Σ_rows ce) / normalizer_k
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from train.batch import Batch
from train.ttt import TTTSettings, count_valid, eval_sums, summarize, unroll_terms

TOKEN_WEIGHT = 0.1  # w of docs/method.md §2


def top_feature(head: nn.Module, batch: Batch) -> Tensor:
    """f = the target's final norm applied to its last layer's output: the LM head's input [B, T, H]."""
    if batch.teacher_hidden is None:
        raise ValueError(f"EAGLE-1 regresses the target's top-layer feature: it needs shards with the "
                         f"'hidden' teacher, these carry '{batch.teacher_kind}' (prep with teacher=hidden)")
    return head.norm(batch.teacher_hidden)


class Eagle1Objective:
    method = "eagle1"
    keep_gathered = ("lm_head",)  # the CE calls the frozen target LM head once per loss chunk

    def __init__(self, settings: TTTSettings, eval_settings: TTTSettings | None = None, cfg=None,
                 token_weight: float = TOKEN_WEIGHT) -> None:
        # The drafter's logits are not norm+lm_head of a draft vocab: the autograd CE path, not the fused one.
        self.settings = TTTSettings(**{**vars(settings), "fused_head": False})
        self.eval_settings = TTTSettings(**{**vars(eval_settings or settings), "fused_head": False})
        self.cfg, self.token_weight = cfg, token_weight
        self.positions = settings.steps

    @classmethod
    def from_config(cls, cfg) -> Eagle1Objective:
        return cls(TTTSettings.from_train(cfg.train), TTTSettings.from_train(cfg.train, held_out=True), cfg)

    def build_drafter(self, prep_dir: Path, tap_layers: list[int], head: nn.Module) -> nn.Module:
        from models.eagle1 import Eagle1Config, Eagle1Drafter
        from train.build import drafter_config

        m = self.cfg.model
        drafter = Eagle1Drafter(drafter_config(Eagle1Config, m, prep_dir, self.cfg.data.max_len),
                                attn_backend=m.attn_backend)
        drafter.load_target_weights(head.embed_tokens_weight, head.lm_head.weight)
        return drafter

    def start_batch(self, epoch: int, index: int) -> None:
        pass  # deterministic: nothing drawn per batch

    def count(self, module: nn.Module, head: nn.Module, batch: Batch) -> tuple[Tensor, None]:
        return count_valid(head, batch, self.settings, vocab=module), None

    def loss(self, module: nn.Module, head: nn.Module, batch: Batch, normalizer: Tensor, state=None):
        s = self.settings
        features = top_feature(head, batch)
        t = unroll_terms(module, head, batch, s, hidden=features.to(module.fc.weight.dtype))
        dtype = torch.promote_types(t["rows"][0].dtype, torch.float32)  # bf16 runs sum in fp32
        target = features[t["b_idx"], t["j_idx"]].to(dtype)  # f_j per row [N, H]
        valid = t["valid"]
        feat = torch.stack([
            (F.smooth_l1_loss(row.to(dtype), target, reduction="none").mean(-1) * valid[k]).sum()
            for k, row in enumerate(t["rows"])
        ])
        weights = s.decay ** torch.arange(s.steps, device=feat.device, dtype=feat.dtype)
        norm = normalizer.to(feat.device).clamp_min(1).to(feat.dtype)
        loss = (weights * (feat + self.token_weight * t["ce"].to(dtype)) / norm).sum()
        sums = {"ce_sum": t["ce"].detach().double(), "acc_sum": t["acc"], "min_pq_sum": t["min_pq"],
                "feat_sum": feat.detach().double(), "n_valid_k": valid.sum(-1)}
        return loss, sums

    def eval_sums(self, module: nn.Module, head: nn.Module, batches: Iterable[Batch]) -> dict:
        dtype = next(p.dtype for p in module.parameters() if p.is_floating_point())
        return eval_sums(module, head, batches, self.eval_settings,
                         step0=lambda b: top_feature(head, b).to(dtype))

    def summarize(self, sums: dict) -> dict:
        return summarize(sums)
