"""Drafter families: the one table that names, per method, its model file, config, export layout, training
objective and drafting strategy, and what the family accepts (the run-config levers it takes, sequence
parallelism, a reduced draft vocabulary, its own config sections, block drafting, its label). Validation
(train/config.py), training, export and evaluation read these facts here; nothing else compares method names.

SpecForge's registry idea: a new drafter is a new model file (config + module + save/load of its export),
an objective and a drafting strategy, plus an entry here. Everything is named as "module:attribute" and
imported lazily, so reading this table costs nothing and models/ imports nothing of train/ or eval/.

Every family's module provides: a config dataclass, a drafter nn.Module with `cfg`, `save_export(drafter,
out_dir)` and `load_export(export_dir, *, target_weights, dtype, attn_backend, target_num_layers)` (one
keyword signature in every family). `frozen_keys` are the target's own
tensors the drafter holds frozen (embedding, LM head): never trained, checkpointed or exported, and
supplied from the target when the drafter is rebuilt.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from torch import Tensor, nn

from models.eagle3 import ARCHITECTURE_ALIASES
from models.target_head import EMBED_AND_LM_HEAD, EMBED_KEY

# Drafter config fields a checkpoint's drafter_config.json written under an earlier name may carry -> their name.
RENAMED_FIELDS = {"aux_layer_ids": "tap_layers", "target_layer_ids": "tap_layers",
                  "num_target_layers": "target_num_layers"}


@dataclass(frozen=True)
class DrafterFamily:
    method: str
    module: str  # "models.eagle3": its config, drafter and export (save_export / load_export)
    config_class: str
    drafter_class: str
    architectures: tuple[str, ...]  # config.json architectures[0] values of its exports
    frozen_keys: tuple[str, ...]
    objective: str  # "train.eagle3:Eagle3Objective": what the train loop asks of the method (train/objective.py)
    drafting: str  # "eval.drafting:EagleDrafting": how the decoder drafts with it (eval/drafting.py)
    label: str  # its name in reports, plots and messages
    # model.* levers of the run config it takes (train/config.py LEVERS); any other lever set is refused
    levers: tuple[str, ...] = ()
    sequence_parallel: bool = False  # deepspeed.sequence_parallel_size > 1 splits its attention (train/sequence_parallel.py)
    draft_vocab: bool = False  # predicts over a reduced draft vocabulary (d2t / t2d), else the target's whole one
    reads_tap_layers: bool = True  # model.tap_layers chooses the target layers it reads
    attn_backend: bool = True  # model.attn_backend chooses its attention (models/attention.py)
    options: str | None = None  # its own config sections, model.<options> and train.<options>
    # drafts a fixed block per verify: decode.depth / topk / total_tokens and train.on_policy.depth unused
    block_drafting: bool = False
    # vLLM's --speculative-config method for its exports, where eval/engine.py checks and serves them; None: not checked
    vllm_method: str | None = None
    # The on-policy stage's rollouts (train/on_policy.py, train/rollout.py), "module:function"; None: not this way.
    # rollout: lossless speculative decoding of one prompt with chains of its drafts against an HF target, the sampled
    # rollouts (eval/spec_decode.py chain_rollout); greedy_drafts: its teacher-forced greedy drafts per (step,
    # position) of a batch, from which the greedy rollouts' verify cycles are replayed (train/ttt.py greedy_drafts).
    # No greedy_drafts: no on-policy stage; no rollout: greedy rollouts only
    rollout: str | None = None
    greedy_drafts: str | None = None

    def _load(self, name: str) -> ModuleType:
        return importlib.import_module(name)

    def _attribute(self, ref: str) -> type:
        module, _, name = ref.partition(":")
        return getattr(self._load(module), name)

    @property
    def objective_cls(self) -> type:
        return self._attribute(self.objective)

    @property
    def drafting_cls(self) -> type:
        return self._attribute(self.drafting)

    @property
    def rollout_fn(self):
        if self.rollout is None:
            raise ValueError(f"{self.label} drafters have no on-policy rollouts")
        return self._attribute(self.rollout)

    @property
    def greedy_drafts_fn(self):
        if self.greedy_drafts is None:
            raise ValueError(f"{self.label} drafters have no on-policy rollouts")
        return self._attribute(self.greedy_drafts)

    @property
    def config_cls(self) -> type:
        return getattr(self._load(self.module), self.config_class)

    @property
    def drafter_cls(self) -> type[nn.Module]:
        return getattr(self._load(self.module), self.drafter_class)

    def save_export(self, drafter: nn.Module, out_dir, **kw):
        return self._load(self.module).save_export(drafter, out_dir, **kw)

    def load_export(self, export_dir, **kw) -> nn.Module:
        return self._load(self.module).load_export(export_dir, **kw)

    def from_state(self, config: dict, params: dict[str, Tensor], buffers: dict[str, Tensor]) -> nn.Module:
        """A CPU drafter from a checkpoint's config + trained tensors; frozen target tensors stay zero."""
        import torch

        config = {RENAMED_FIELDS.get(k, k): v for k, v in config.items()}
        drafter = self.drafter_cls(self.config_cls(**config))
        missing, unexpected = drafter.load_state_dict({**params, **buffers}, strict=False)
        missing = [k for k in missing if k not in self.frozen_keys]
        if missing or unexpected:
            raise KeyError(f"checkpoint does not match the {self.method} drafter: missing {missing}, "
                           f"unexpected {list(unexpected)}")
        with torch.no_grad():
            state = drafter.state_dict()
            for key in self.frozen_keys:
                state[key].zero_()
        return drafter


FAMILIES: dict[str, DrafterFamily] = {
    "eagle3": DrafterFamily(
        "eagle3", "models.eagle3", "Eagle3Config", "Eagle3Drafter",
        tuple(ARCHITECTURE_ALIASES), (EMBED_KEY,),
        "train.eagle3:Eagle3Objective", "eval.drafting:EagleDrafting",
        label="EAGLE-3",
        levers=("draft_vocab_size", "lm_head_init", "freeze_lm_head", "norm_init", "fc_norm", "norm_output"),
        sequence_parallel=True, draft_vocab=True, vllm_method="eagle3", rollout="eval.spec_decode:chain_rollout",
        greedy_drafts="train.ttt:greedy_drafts",
    ),
    "eagle1": DrafterFamily(
        "eagle1", "models.eagle1", "Eagle1Config", "Eagle1Drafter",
        ("LlamaForCausalLM", "EagleLlamaForCausalLM"), EMBED_AND_LM_HEAD,
        "train.eagle1:Eagle1Objective", "eval.drafting:EagleDrafting",
        label="EAGLE-1", reads_tap_layers=False,  # the top-layer feature only
    ),
    "dflash": DrafterFamily(
        "dflash", "models.dflash", "DFlashConfig", "DFlashDrafter",
        ("DFlashDraftModel",), EMBED_AND_LM_HEAD,
        "train.dflash:DFlashObjective", "eval.dflash_drafting:DFlashDrafting",
        label="DFlash", levers=("norm_init",),  # the same final norm before a target head as EAGLE-3's
        attn_backend=False,  # SDPA with explicit block masks on every device
        options="dflash", block_drafting=True, greedy_drafts="train.dflash:greedy_drafts",
    ),
}
METHODS = tuple(FAMILIES)


def family(method: str) -> DrafterFamily:
    if method not in FAMILIES:
        raise ValueError(f"unknown drafter method {method!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[method]


def family_of_export(config: dict) -> DrafterFamily:
    """The family whose export wrote this config.json (by architectures[0])."""
    arch = (config.get("architectures") or [None])[0]
    for fam in FAMILIES.values():
        if arch in fam.architectures:
            return fam
    known = [a for f in FAMILIES.values() for a in f.architectures]
    raise ValueError(f"config.json architectures[0] = {arch!r} is not a known drafter export ({known})")


def family_of_drafter(drafter: nn.Module) -> DrafterFamily:
    """The family whose drafter class `drafter` is."""
    for fam in FAMILIES.values():
        if isinstance(drafter, fam.drafter_cls):
            return fam
    raise TypeError(f"{type(drafter).__name__} is not the drafter class of any family ({list(FAMILIES)})")
