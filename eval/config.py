"""Typed configuration of `launch/eval.py` (Hydra structured config: unknown keys and bad types fail)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from infra.config_keys import ConfigError
from infra.precision import DTYPES

WARMUP_TOKENS = 8  # `warmup`: the tokens of the untimed request each method (and each engine server) answers first


@dataclass
class DecodeConfig:
    mode: str = "tree"  # tree (EAGLE-2 dynamic tree) | chain (top-1 drafts)
    depth: int = 6  # tree levels = most drafts one step can accept (chain: K)
    topk: int = 8  # tree: children per expanded node and nodes expanded per level
    total_tokens: int = 60  # tree: drafted nodes verified per step (block = total_tokens + 1 root)
    # pick total_tokens: the candidate of the best predicted speedup, m = 0 (plain decoding) among them, from the
    # target's forwards timed at the context decoding reaches and the drafter's acceptance on a probe
    # (eval/budget.py choose_total_tokens)
    auto_total_tokens: bool = False
    total_tokens_candidates: list[int] = field(default_factory=lambda: [4, 8, 16, 32, 60])
    # fixed: verify every drafted node (tree: total_tokens, chain: depth). adaptive: each cycle verifies the
    # best m of them that a cost model fed by the target's timings expects to pay, m = 0 included
    # (eval/budget.py AdaptiveBudget); with a tree, total_tokens (or auto_total_tokens' pick) is the most m.
    budget: str = "fixed"
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    sample_drafts: bool = False  # chain + T > 0: draw drafts from the drafter instead of its argmax
    max_new_tokens: int = 256
    num_prompts: int = 0  # prompts per (suite, category); <= 0: all of them
    max_turns: int = 0  # <= 0: all turns of each record
    seed: int = 0


@dataclass
class EngineVLLMConfig:
    """`engine=vllm`: vLLM's own server (`python -m vllm.entrypoints.openai.api_server`) serving the target with the
    export, the same prompts sent to it (eval/engine.py)."""

    python: str | None = None  # the python of a vLLM install (its own venv); None: this one, if it imports vllm
    # more `vllm serve` flags, e.g. {max_num_seqs: 64, gpu_memory_utilization: 0.5} (a share given here replaces the
    # one computed from the free device memory)
    engine_kwargs: dict = field(default_factory=dict)
    max_model_len: int = 2048
    timeout_s: float = 1200.0  # server start-up and every request
    # --enforce-eager (no CUDA graphs); None: eager only where vLLM sees no CUDA device (its CPU build has none to
    # capture, and eager starts in seconds), CUDA graphs on a GPU
    enforce_eager: bool | None = None
    # requests in flight of the load sweep (tokens/s, time to first token, time per output token, with and without
    # the drafter); [] skips it. Each level sends max(load_min_requests, load_rounds x concurrency) first turns.
    concurrency: list[int] = field(default_factory=list)
    load_rounds: int = 2
    load_min_requests: int = 8
    # draft-settings sweep: vLLM's num_speculative_tokens values served one after the other, each over every
    # category (decode.depth is always served); the best per category by tokens/s, no drafter (0) included
    num_speculative_tokens: list[int] = field(default_factory=list)

    def kwarg(self, name: str):
        """engine_kwargs' value of the engine argument `name` (spelt with _ or -, as `vllm serve` takes it), or None."""
        return next((v for k, v in self.engine_kwargs.items() if k.replace("-", "_") == name), None)


@dataclass
class EvalConfig:
    drafter: str = MISSING  # engine-format export dir (config.json + model.safetensors)
    target: str = "smollm2-135m-instruct"  # preset | hub id | local HF dir (data_prep.targets.resolve_target)
    prompts: str = "mtbench"  # a suite | suite,suite,... | all | a JSONL file (eval/prompts.py)
    out_dir: str = MISSING
    dtype: str | None = None  # target/drafter dtype (auto|float32|bfloat16|float16); None: the preset's
    # The chat template (a file, or the Jinja text itself) replacing the tokenizer's own; base models ship none.
    chat_template: str | None = None
    device: str | None = None  # None: cuda if available, else cpu
    threads: int = 0  # torch CPU threads; <= 0: leave torch's default
    baseline: bool = True  # plain target decoding of the same prompts (for speedup)
    prompt_lookup: bool = False  # peer: transformers' assisted decoding with prompt lookup
    prompt_lookup_num_tokens: int = 10
    warmup: bool = True  # one short untimed generate per method first (and one request per engine server)
    plots: bool = True
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    engine: str = "none"  # none | vllm: the same prompts through vLLM's server too, its acceptance beside ours
    vllm: EngineVLLMConfig = field(default_factory=EngineVLLMConfig)

    def validate(self) -> None:
        """ConfigError, a user error naming the key, for values the types cannot refuse (ranges, choices,
        combinations); launch/eval.py reports it in one line with exit status 2 before anything loads."""
        if self.dtype is not None and self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be auto|{'|'.join(DTYPES)}, got {self.dtype!r}")
        d = self.decode
        if d.mode not in ("tree", "chain"):
            raise ConfigError(f"decode.mode must be tree|chain, got {d.mode!r}")
        for key in ("depth", "topk", "total_tokens", "max_new_tokens"):
            if getattr(d, key) < 1:
                raise ConfigError(f"decode.{key} must be >= 1, got {getattr(d, key)}")
        if d.temperature < 0:
            raise ConfigError(f"decode.temperature must be >= 0, got {d.temperature}")
        if not 0 < d.top_p <= 1:
            raise ConfigError(f"decode.top_p must be in (0, 1], got {d.top_p}")
        if d.top_k < 0:
            raise ConfigError(f"decode.top_k must be >= 0, got {d.top_k}")
        if d.budget not in ("fixed", "adaptive"):
            raise ConfigError(f"decode.budget must be fixed|adaptive, got {d.budget!r}")
        if d.sample_drafts and d.mode != "chain":
            raise ConfigError("decode.sample_drafts applies to chain mode only (tree drafts are top-k)")
        if d.auto_total_tokens and (not d.total_tokens_candidates or min(d.total_tokens_candidates) < 1):
            raise ConfigError(f"decode.total_tokens_candidates must be positive sizes, got {d.total_tokens_candidates}")
        if self.engine not in ("none", "vllm"):
            raise ConfigError(f"engine must be none|vllm, got {self.engine!r}")
        v = self.vllm
        if self.engine == "vllm" and (d.mode != "chain" or d.budget != "fixed"):
            raise ConfigError("engine=vllm compares vLLM's EAGLE chain of decode.depth drafts with ours: it needs "
                              f"decode.mode=chain and decode.budget=fixed, got decode.mode={d.mode} and "
                              f"decode.budget={d.budget}")
        if (v.concurrency or v.num_speculative_tokens) and self.engine != "vllm":
            raise ConfigError("vllm.concurrency / vllm.num_speculative_tokens are sweeps through the engine: set "
                              "engine=vllm")
        fixed = [k for k in ("enforce_eager", "generation_config") if v.kwarg(k) is not None]
        if fixed:
            raise ConfigError(f"vllm.engine_kwargs cannot set {fixed}: vllm.enforce_eager sets the mode, and the "
                              "servers ignore the model's generation_config.json so that both sides sample alike")
        for key in ("concurrency", "num_speculative_tokens"):
            if min([*getattr(v, key), 1]) < 1:
                raise ConfigError(f"vllm.{key} must be sizes >= 1, got {getattr(v, key)}")
        if v.load_rounds < 1:
            raise ConfigError(f"vllm.load_rounds must be >= 1, got {v.load_rounds}")
        if d.mode == "chain" and (d.auto_total_tokens or d.total_tokens != DecodeConfig.total_tokens):
            import warnings

            warnings.warn("decode.total_tokens / auto_total_tokens have no effect in chain mode", stacklevel=2)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)
