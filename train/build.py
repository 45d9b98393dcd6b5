"""Build the drafter and the frozen target head from a prep dir (model code stays in models/)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from train.config import ModelConfig

GEOMETRY_OVERRIDES = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta")


def target_config(prep_dir: Path) -> dict:
    return json.loads((Path(prep_dir) / "target_config.json").read_text())


def draft_vocab(prep_dir: Path, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) of the prep; `size` (model.draft_vocab_size): cut anew from the prep's ranking."""
    from data_prep.vocab import VOCAB_FILE, draft_vocab_of_size, load_draft_vocab

    path = Path(prep_dir) / VOCAB_FILE
    d2t, t2d = load_draft_vocab(path) if size is None else draft_vocab_of_size(path, size)
    return d2t.long(), t2d.bool()


def drafter_config(cfg: ModelConfig, prep_dir: Path, tap_layers: list[int], max_len: int):
    """Eagle3Config from the target's config, the shards' tap layers and the overrides in `cfg`."""
    from models.config import for_trained_length
    from models.eagle3 import Eagle3Config

    target = target_config(prep_dir)
    d2t, _ = draft_vocab(prep_dir, cfg.draft_vocab_size)
    overrides = {k: getattr(cfg, k) for k in GEOMETRY_OVERRIDES if getattr(cfg, k) is not None}
    dcfg = Eagle3Config.from_target_config(target, draft_vocab_size=d2t.numel(), aux_layer_ids=tap_layers,
                                           fc_norm=cfg.fc_norm, norm_output=cfg.norm_output, **overrides)
    return for_trained_length(dcfg, max_len, cfg.max_position_embeddings)


def build_drafter(cfg: ModelConfig, prep_dir: Path, tap_layers: list[int], max_len: int, head) -> nn.Module:
    """A freshly initialised drafter (seed first!) with the target's frozen embedding and the vocab maps."""
    from models.eagle3 import Eagle3Drafter

    drafter = Eagle3Drafter(drafter_config(cfg, prep_dir, tap_layers, max_len), attn_backend=cfg.attn_backend)
    drafter.load_target_embedding(head.embed_tokens_weight)
    drafter.set_vocab_mapping(*draft_vocab(prep_dir, cfg.draft_vocab_size))
    drafter.init_output_from_target(head.lm_head.weight if cfg.lm_head_init == "target" else None,
                                    head.norm_weight_equivalent() if cfg.norm_init == "target" else None)
    drafter.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
    if drafter.embed_tokens.weight.requires_grad:
        raise RuntimeError("the target embedding inside the drafter must be frozen")
    return drafter


def load_head(prep_dir: Path) -> nn.Module:
    """The frozen target norm + lm_head (+ embedding) that turn teacher hidden states into p."""
    from models.target_head import TargetHead

    head = TargetHead.from_file(Path(prep_dir) / "target_head.safetensors", target_config(prep_dir))
    head.requires_grad_(False)
    return head.eval()


def drafter_from_state(
    config: dict, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], method: str = "eagle3"
) -> nn.Module:
    """A CPU drafter rebuilt from a checkpoint's drafter_config.json + tensors (the target's frozen tensors
    stay zero: they are not part of a checkpoint or an export)."""
    from models.registry import family

    return family(method).from_state(config, params, buffers)
