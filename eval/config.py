"""Typed configuration of `launch/eval.py` (Hydra structured config: unknown keys and bad types fail)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING


@dataclass
class DecodeConfig:
    mode: str = "tree"  # tree (EAGLE-2 dynamic tree) | chain (top-1 drafts)
    depth: int = 6  # tree levels = most drafts one step can accept (chain: K)
    topk: int = 8  # tree: children per expanded node and nodes expanded per level
    total_tokens: int = 60  # tree: drafted nodes verified per step (block = total_tokens + 1 root)
    auto_total_tokens: bool = False  # time the target (choose_total_tokens) and pick total_tokens
    total_tokens_candidates: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 60])
    auto_tolerance: float = 1.3  # the largest m before the first whose verify forward > tolerance x a 1-token one
    # fixed: verify every drafted node (tree: total_tokens, chain: depth). adaptive: each cycle verifies the
    # best m of them that a cost model fed by the target's timings expects to pay, m = 0 included
    # (eval/budget.py AdaptiveBudget); with a tree, total_tokens (or auto_total_tokens' pick) is the most m.
    budget: str = "fixed"
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    sample_drafts: bool = False  # chain + T > 0: draw drafts from the drafter instead of its argmax
    max_new_tokens: int = 256
    num_prompts: int = 0  # <= 0: all prompts
    max_turns: int = 0  # <= 0: all turns of each record
    seed: int = 0


@dataclass
class EvalConfig:
    drafter: str = MISSING  # engine-format export dir (config.json + model.safetensors)
    target: str = "smollm2-135m-instruct"  # preset | hub id | local HF dir (data_prep.targets.resolve_target)
    prompts: str = "mtbench"  # preset | JSONL with `turns` or `prompt` per record
    out_dir: str = MISSING
    dtype: str | None = None  # target/drafter dtype; None: the preset's
    # The chat template (a file, or the Jinja text itself) replacing the tokenizer's own; base models ship none.
    chat_template: str | None = None
    device: str | None = None  # None: cuda if available, else cpu
    threads: int = 0  # torch CPU threads; <= 0: leave torch's default
    baseline: bool = True  # plain target decoding of the same prompts (for speedup)
    prompt_lookup: bool = False  # peer: transformers' assisted decoding with prompt lookup
    prompt_lookup_num_tokens: int = 10
    warmup: bool = True  # one short untimed generate per method first
    plots: bool = True
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def validate(self) -> None:
        d = self.decode
        if d.mode not in ("tree", "chain"):
            raise ValueError(f"decode.mode must be tree|chain, got {d.mode!r}")
        if d.depth < 1 or d.topk < 1 or d.total_tokens < 1:
            raise ValueError("decode.depth, decode.topk and decode.total_tokens must be >= 1")
        if d.max_new_tokens < 1:
            raise ValueError("decode.max_new_tokens must be >= 1")
        if d.temperature < 0 or not 0 < d.top_p <= 1 or d.top_k < 0:
            raise ValueError("need decode.temperature >= 0, 0 < decode.top_p <= 1, decode.top_k >= 0")
        if d.budget not in ("fixed", "adaptive"):
            raise ValueError(f"decode.budget must be fixed|adaptive, got {d.budget!r}")
        if d.sample_drafts and d.mode != "chain":
            raise ValueError("decode.sample_drafts applies to chain mode only (tree drafts are top-k)")
        if d.auto_total_tokens and (not d.total_tokens_candidates or min(d.total_tokens_candidates) < 1):
            raise ValueError("decode.total_tokens_candidates must be positive sizes")
        if d.mode == "chain" and (d.auto_total_tokens or d.total_tokens != DecodeConfig.total_tokens):
            import warnings

            warnings.warn("decode.total_tokens / auto_total_tokens have no effect in chain mode", stacklevel=2)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)
