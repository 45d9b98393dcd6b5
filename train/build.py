"""What every family's drafter is built from: a prep dir's target config, draft vocabulary and frozen target
head, and the drafter config for training (model code stays in models/; each objective builds its drafter)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from data_prep.shards import TARGET_CONFIG_FILE, TARGET_HEAD_FILE
from train.config import ModelConfig

GEOMETRY_OVERRIDES = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta")


def target_config(prep_dir: Path) -> dict:
    return json.loads((Path(prep_dir) / TARGET_CONFIG_FILE).read_text())


def draft_vocab(prep_dir: Path, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the prep; `size` (model.draft_vocab_size): cut anew from the prep's ranking."""
    from data_prep.vocab import VOCAB_FILE, draft_vocab_of_size, load_draft_vocab

    path = Path(prep_dir) / VOCAB_FILE
    d2t, t2d = load_draft_vocab(path) if size is None else draft_vocab_of_size(path, size)
    return d2t.long(), t2d.bool()


def drafter_config(config_cls: type, cfg: ModelConfig, prep_dir: Path, max_len: int, **fields):
    """Any family's drafter config (`config_cls.from_target_config`) from the prep's target config, the
    family's own `fields` and the geometry overrides in `cfg`, as training exports it (for max_len tokens,
    models.config.for_trained_length): the one place a drafter config is built for training."""
    from models.config import for_trained_length

    overrides = {k: getattr(cfg, k) for k in GEOMETRY_OVERRIDES if getattr(cfg, k) is not None}
    dcfg = config_cls.from_target_config(target_config(prep_dir), **fields, **overrides)
    return for_trained_length(dcfg, max_len, cfg.max_position_embeddings)


def initial_norm_weight(kind: str, head: nn.Module, like: torch.Tensor) -> torch.Tensor | None:
    """The drafter's final-norm weight at start (model.norm_init): None for `ones` (as constructed); `target`: the
    target's final norm as a plain x·w multiplier (SmolLM2's weights average ~1.8, so ones start the logits of a
    target head that much too cold); `zeros`: logits of exactly 0 at step 0. Why zeros: in front of a target LM
    head tied to the embedding (SmolLM2), a residual stream that still carries its input token's embedding is
    read back as a near-certain guess of a token it embeds (held-out CE ~53 at DFlash's step 0 against
    ln V = 10.8 for a uniform guess); a zero multiplier starts at the uniform guess and grows from there."""
    if kind == "ones":
        return None
    if kind == "zeros":
        return torch.zeros_like(like)
    return head.norm_weight_equivalent().to(like)


def load_head(prep_dir: Path) -> nn.Module:
    """The frozen target norm + lm_head (+ embedding) that turn teacher hidden states into p."""
    from models.target_head import TargetHead

    head = TargetHead.from_file(Path(prep_dir) / TARGET_HEAD_FILE, target_config(prep_dir))
    head.requires_grad_(False)
    return head.eval()


def drafter_from_state(
    config: dict, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], method: str
) -> nn.Module:
    """A CPU drafter rebuilt from a checkpoint's drafter_config.json + tensors (the target's frozen tensors
    stay zero: they are not part of a checkpoint or an export)."""
    from models.registry import family

    return family(method).from_state(config, params, buffers)
