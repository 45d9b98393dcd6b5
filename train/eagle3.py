"""EAGLE-3's objective (docs/method.md §4.3): the TTT loss of train/ttt.py on the fused taps, and the drafter
it trains built from a prep (its taps, draft vocabulary and output head's initialisation)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from torch import Tensor, nn

from models.config import target_geometry
from models.eagle3 import Eagle3Config, Eagle3Drafter, default_tap_layers
from train.batch import Batch, tap_columns
from train.build import draft_vocab, drafter_config, initial_norm_weight, target_config
from train.config import ModelConfig
from train.teacher_cache import TeacherCache
from train.ttt import SUM_KEYS, TTTSettings, count_valid, eval_sums, summarize, ttt_loss


def eagle3_config(cfg: ModelConfig, prep_dir: Path, tap_layers: list[int], max_len: int) -> Eagle3Config:
    """The drafter config from the prep's target config, the taps it reads and the EAGLE-3 levers in `cfg`."""
    d2t, _ = draft_vocab(prep_dir, cfg.draft_vocab_size)
    return drafter_config(Eagle3Config, cfg, prep_dir, max_len, draft_vocab_size=d2t.numel(),
                          tap_layers=tap_layers, fc_norm=cfg.fc_norm, norm_output=cfg.norm_output)


class Eagle3Objective:
    """EAGLE-3 with training-time test (train.ttt_steps = K, train.loss_decay = λ); see train/objective.py.
    Held-out metrics unroll train.eval_ttt_steps (default K) steps, so a K=1 drafter's decay is visible.
    The drafter reads model.tap_layers out of the shards' taps; default: EAGLE-3's [1, L/2-1, L-4] when the
    shards carry them (a prep for several drafters carries more), else every tap of the shards."""

    method = "eagle3"
    keep_gathered = ("norm", "lm_head")  # the fused head calls them once per loss chunk

    def __init__(self, settings: TTTSettings, eval_settings: TTTSettings | None = None, cfg=None) -> None:
        self.settings, self.eval_settings, self.cfg = settings, eval_settings or settings, cfg
        self.positions = settings.steps
        self.columns: list[int] | None = None  # the drafter's taps among the shards' (build_drafter)
        self.n_source_taps = 0
        mb = settings.teacher_epoch_cache_mb
        self.teacher_cache = TeacherCache(mb) if mb > 0 else None

    @classmethod
    def from_config(cls, cfg) -> Eagle3Objective:
        return cls(TTTSettings.from_train(cfg.train), TTTSettings.from_train(cfg.train, held_out=True), cfg)

    def build_drafter(self, prep_dir, tap_layers: list[int], head: nn.Module) -> nn.Module:
        """A freshly initialised drafter (seed first!) with the target's frozen embedding, the vocab maps
        and the output head's initialisation (model.lm_head_init, norm_init, freeze_lm_head)."""
        try:
            default = default_tap_layers(target_geometry(target_config(prep_dir))["target_num_layers"])
        except ValueError:  # a target too shallow for EAGLE-3's default taps: the drafter reads the shards'
            default = []
        wanted = list(self.cfg.model.tap_layers or (default if default and set(default) <= set(tap_layers)
                                                    else tap_layers))
        self.columns, self.n_source_taps = tap_columns(tap_layers, wanted), len(tap_layers)
        m = self.cfg.model
        drafter = Eagle3Drafter(eagle3_config(m, prep_dir, wanted, self.cfg.data.max_len), attn_backend=m.attn_backend)
        drafter.load_target_embedding(head.embed_tokens_weight)
        drafter.set_vocab_mapping(*draft_vocab(prep_dir, m.draft_vocab_size))
        drafter.init_output_from_target(head.lm_head.weight if m.lm_head_init == "target" else None,
                                        initial_norm_weight(m.norm_init, head, drafter.norm.weight))
        drafter.lm_head.weight.requires_grad_(not m.freeze_lm_head)
        if drafter.embed_tokens.weight.requires_grad:
            raise RuntimeError("the target embedding inside the drafter must be frozen")
        return drafter

    def start_batch(self, epoch: int, index: int) -> None:
        pass  # deterministic: nothing drawn per batch

    def _taps(self, batch: Batch) -> Batch:
        return batch.select_taps(self.columns, self.n_source_taps)

    def count(self, module: nn.Module, head: nn.Module, batch: Batch):
        return count_valid(head, batch, self.settings, vocab=module, return_targets=True, cache=self.teacher_cache)

    def loss(self, module: nn.Module, head: nn.Module, batch: Batch, normalizer: Tensor, state):
        batch = self._taps(batch)
        if self.cfg is not None and self.cfg.train.feature_noise > 0:
            batch = batch.with_feature_noise(self.cfg.train.feature_noise, module.cfg.n_taps)
        loss, m = ttt_loss(module, head, batch, self.settings, normalizer=normalizer, teacher_targets=state)
        return loss, {k: m[k] for k in SUM_KEYS}

    def eval_sums(self, module: nn.Module, head: nn.Module, batches: Iterable[Batch]) -> dict:
        return eval_sums(module, head, (self._taps(b) for b in batches), self.eval_settings)

    def summarize(self, sums: dict) -> dict:
        return summarize(sums)
