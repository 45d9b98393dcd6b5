"""What every family's drafter is built from: a prep dir's target config, draft vocabulary and frozen target
head, and the drafter config for training (model code stays in models/; each objective builds its drafter)."""

from __future__ import annotations

import dataclasses
import json
import warnings
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


# Drafter config fields a run decides for itself, whatever the export it starts from says: the length it trains
# for (and the rope scaling pinned with it, models.config.for_trained_length), the dtype it exports in, and the
# target layer count (only validates tap ids, checked against the prep's target below).
RUN_OWNED_FIELDS = ("max_position_embeddings", "rope_scaling", "torch_dtype", "target_num_layers")
# The run config key that sets a drafter config field, where one does (named by the refusal).
FIELD_KEYS = {"tap_layers": "model.tap_layers", "draft_vocab_size": "model.draft_vocab_size",
              "intermediate_size": "model.intermediate_size", "num_attention_heads": "model.num_attention_heads",
              "num_key_value_heads": "model.num_key_value_heads", "head_dim": "model.head_dim",
              "rope_theta": "model.rope_theta", "fc_norm": "model.fc_norm", "norm_output": "model.norm_output",
              "num_hidden_layers": "model.dflash.num_layers", "block_size": "model.dflash.block_size",
              "mask_token_id": "model.dflash.mask_token_id"}


@torch.no_grad()
def init_from_export(drafter: nn.Module, export_dir: str | Path, prep_dir: Path, head: nn.Module,
                     target: dict | None) -> dict:
    """train.init_from: an export's weights (ours, or a public drafter in the engine layout: models/<family>.py
    load_export reads both) into `drafter`, the one the objective built for this prep. Refused, naming the export,
    before training starts: another family's export; one recorded for another target than the prep's (architecture,
    geometry, tokenizer: models.export.check_target, as eval checks an export); a config that gives the drafter
    another shape or behaviour than this run's (each field named with both values and the key that sets it). The
    export's draft vocabulary mapping (d2t/t2d) comes with its weights, since its lm_head's rows mean those tokens;
    the teacher's targets follow the drafter's mapping (train/loss.py VocabMaps.from_drafter). One of the same shape
    recorded for another model id than the prep's (models.export.other_target_id) is warned of, naming both: the
    evaluation refuses that pair, a run may start from it on purpose. Returns what the
    log says of it: the family, and how many of its draft tokens the prep's own draft vocabulary has. `target`:
    the prep's target as its spec records it (train.export.prep_target)."""
    from models.export import (
        TARGET_KEY,
        ExportError,
        check_tap_layers,
        check_target,
        other_target_id,
        read_export,
        unreadable_weights,
    )
    from models.registry import family_of_drafter, family_of_export
    from models.target_head import EMBED_KEY, LM_HEAD_KEY

    where = f"train.init_from={export_dir}"
    raw = read_export(str(export_dir))  # FileNotFoundError / ExportError naming it
    mine = family_of_drafter(drafter)
    try:
        theirs = family_of_export(raw)
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from None
    if theirs.method != mine.method:
        raise ExportError(f"{where} is a {theirs.label} drafter; this run trains model.method={mine.method} "
                          f"({mine.label}): start from an export of the same family")
    target = target or {}
    check_target(raw.get(TARGET_KEY), target, where, f"the prep's target {target.get('id')} ({prep_dir})")
    other = other_target_id(raw.get(TARGET_KEY), [target.get("id")])
    if other is not None:  # evaluation refuses this pair (eval/run.py check_target_id); a run may mean it: warn
        warnings.warn(f"{where} was trained for target {other}, but the prep {prep_dir} is for target "
                      f"{target.get('id')}: a model of the same shape and tokenizer is still another model, whose "
                      "hidden states the drafter has not seen (evaluation refuses such a pair); training starts "
                      "from it all the same", stacklevel=2)
    weights = {EMBED_KEY: head.embed_tokens_weight.detach().float().cpu(),
               LM_HEAD_KEY: head.lm_head.weight.detach().float().cpu()}
    try:
        with unreadable_weights(str(export_dir)):
            loaded = theirs.load_export(export_dir, target_weights=weights, dtype=torch.float32,
                                        target_num_layers=target.get("num_layers"))
    except ExportError:
        raise
    except ValueError as e:  # its config.json or tensors do not make a drafter for this target
        raise ExportError(f"{where}: {e}") from e
    check_tap_layers(raw.get(TARGET_KEY), loaded.tap_layers, where)
    ours, given = dataclasses.asdict(drafter.cfg), dataclasses.asdict(loaded.cfg)
    differ = [k for k in ours if k not in RUN_OWNED_FIELDS and ours[k] != given.get(k)]
    if differ:
        raise ExportError(f"{where} gives another drafter than this run builds for {prep_dir}: " + "; ".join(
            f"{k} {given.get(k)!r} (this run: {ours[k]!r}{', set ' + FIELD_KEYS[k] if k in FIELD_KEYS else ''})"
            for k in differ))
    state = {k: v for k, v in loaded.state_dict().items() if k not in mine.frozen_keys}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in mine.frozen_keys]
    if missing or unexpected:  # the same family and config: a broken layout, not a user's choice
        raise ExportError(f"{where}: tensors {missing} missing, {unexpected} unexpected for the {mine.label} drafter")
    out = {"export": str(export_dir), "family": mine.method, "tap_layers": list(loaded.tap_layers)}
    if mine.draft_vocab:
        d2t, _ = draft_vocab(prep_dir, int(loaded.cfg.draft_vocab_size))
        export_ids = set((torch.arange(loaded.d2t.numel()) + loaded.d2t.long()).tolist())
        prep_ids = set((torch.arange(d2t.numel()) + d2t).tolist())
        out["draft_vocab_shared"] = len(export_ids & prep_ids) / max(1, len(export_ids))
    return out
