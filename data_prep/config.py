"""Typed configuration of `make prep` / `launch/prep.py` (Hydra structured config: unknown keys fail)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING, DictConfig, OmegaConf

from infra.config_keys import ConfigError, check_keys
from infra.precision import DTYPES
from serving.config import VLLMConfig

# Prep keys renamed so that prep, training and evaluation name each concept once (data.max_len in training):
# old -> new. An old key is refused, naming the new one (`refuse_renamed`, `check_keys`).
RENAMED_KEYS = {"max_length": "max_len",
                # prep's one vLLM engine serves regeneration (regen.backend=vllm) and capture (capture.engine=vllm)
                **{f"capture.vllm.{k}": f"vllm.{k}"
                   for k in ("python", "tensor_parallel_size", "pipeline_parallel_size", "engine_kwargs")},
                "capture.vllm.fidelity": "vllm.capture_fidelity"}
# Keys that went away, with what replaced them: refused naming the replacement (check_keys, refuse_renamed).
REPLACED_KEYS = {
    "capture.vllm.max_pending_files": "the vLLM capture is bounded in bytes of node-local scratch: vllm.scratch_gb",
    "capture.vllm.chunk_tokens": "requests go to vLLM's server one per sample, vllm.max_in_flight at a time",
}


@dataclass
class RegenConfig:
    enabled: bool = True  # False: train on the dataset's own responses
    # hf (batched generate on the target) | vllm (prep's vLLM engine, `vllm.*`: the one that captures with
    # capture.engine=vllm) | openai (any OpenAI-compatible server)
    backend: str = "hf"
    # regenerate the first N assistant turns and cut the rest (counted: later_turns_dropped); None = all
    max_turns: int | None = 1
    max_new_tokens: int = 256
    # a reply cut at max_new_tokens: unmask (kept; the end of turn the template renders after it stays out of the
    # loss mask, as the target never generated it) | drop (the conversation is skipped, counted)
    on_length: str = "unmask"
    temperature: float = 0.0
    top_p: float = 1.0
    # conversations advancing together, one backend call per turn index: hf's batch (and vllm's with stream=false)
    batch_size: int = 16
    # vllm: regenerate as a stream, vllm.max_in_flight requests per server at all times: a conversation's next turn
    # goes out when its reply arrives, a finished conversation's place goes to the next one at once; false: lockstep
    # batches of batch_size, each waiting for its slowest reply
    stream: bool = True
    enable_thinking: bool | None = None  # None: the preset's setting
    base_url: str = "http://127.0.0.1:8000/v1"
    # The server's key is read from this environment variable (unset: "EMPTY"), never from the config: a value on
    # the command line shows in `ps` and in Hydra's error output. regen.api_key is refused (without echoing it).
    api_key_env: str = "OPENAI_API_KEY"
    api_key: str | None = None
    served_model: str | None = None  # model name the server knows; None: the target's hub id
    concurrency: int = 16
    timeout_s: float = 300.0
    max_retries: int = 3


# engine arguments prep sets on the vLLM servers it starts; vllm.engine_kwargs may not override them
RESERVED_ENGINE_KWARGS = ("model", "tokenizer", "dtype", "speculative_config", "kv_transfer_config",
                          "enable_prefix_caching", "tensor_parallel_size", "pipeline_parallel_size", "max_model_len",
                          "host", "port", "api_key", "served_model_name")


@dataclass
class CaptureConfig:
    tap_layers: list[int] | None = None  # None: the preset's taps, [1, L//2 - 1, L - 4]
    teacher: str = "hidden"  # hidden (exact) | topk | argmax
    topk: int = 20
    taps_dtype: str = "bfloat16"  # bfloat16 | float8_e4m3fn
    batch_tokens: int = 8192  # padded tokens per target forward
    tokens_per_shard: int = 1 << 20
    # >1: the target split over groups of this many ranks by transformers' tensor-parallel plan (torchrun); each
    # group captures its share of the samples once, its first rank writes the shards (world % size == 0)
    tensor_parallel_size: int = 1
    engine: str = "hf"  # hf (transformers forward with hooks) | vllm (vLLM's hidden-state extraction, `vllm.*`)
    # regen.backend=vllm with engine=vllm: each regenerated sample's features come from its final regeneration
    # request (vLLM keeps the states of prompt and reply), with no second pass over its tokens; a sample those
    # states do not cover is captured by a prefill. false: every sample captured by a prefill after regenerating
    # (vLLM's decode-time numerics are not a prefill's: the two are compared in bench/one_pass_capture.py)
    one_pass: bool = True


@dataclass
class PrepConfig:
    model: str = "smollm2-135m-instruct"  # preset name | hub id | local HF directory
    # all: the whole prep. vocab: only (re)build <out>/draft_vocab.safetensors of a finished prep from its
    # shards and the dataset (no model is loaded; pass the prep's own data, seed and eval_samples). render: every
    # stage up to the capture (regenerated, rendered samples: <out>/rendered/, draft vocabulary, target files), no
    # shards: train it with data.source=online|hybrid (the target computes the features inside training).
    stage: str = "all"
    data: str = "sharegpt-embedded"  # preset | hub id | local JSON/JSONL/Parquet file or directory
    out: str = MISSING
    num_samples: int = 200  # training conversations (before rendering drops); <= 0: all
    # held-out conversations, never trained on; None: held_out_count (10% of the usable conversations, at least 2,
    # at most 40, at most half of them)
    eval_samples: int | None = None
    max_len: int = 2048
    overflow: str = "truncate"  # truncate: keep the first max_len tokens | drop: skip the sample
    seed: int = 0
    # Vd; None: the target preset's (32000 unless measured otherwise); capped at the distinct tokens counted;
    # <= 0: the whole target vocabulary.
    draft_vocab_size: int | None = None
    # What ranks the draft vocabulary's tokens: "dataset" = the training split's loss-masked tokens mixed
    # with the assistant tokens of every non-held-out conversation of the dataset (tokenised with the
    # target's template, no forward; data_prep/vocab.py selection_scores); "train" = the training split only.
    draft_vocab_count: str = "dataset"
    draft_vocab_train_weight: float = 0.5  # the training split's share of the mixed frequency
    draft_vocab_count_max: int = 0  # dataset conversations counted; <= 0: all
    dtype: str | None = None  # target dtype (auto|float32|bfloat16|float16); None: the preset's
    # The chat template (a file, or the Jinja text itself) replacing the tokenizer's own; base models ship none.
    chat_template: str | None = None
    device: str | None = None  # None: cuda if available, else cpu
    regen: RegenConfig = field(default_factory=RegenConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    def uses_vllm(self) -> bool:
        """Whether prep starts its vLLM engine: regeneration on it, or the capture through it."""
        return (self.regen.enabled and self.regen.backend == "vllm" and self.stage != "vocab") or (
            self.capture.engine == "vllm" and self.stage == "all")

    def validate(self) -> None:
        if self.dtype is not None and self.dtype not in ("auto", *DTYPES):
            raise ConfigError(f"dtype must be auto|{'|'.join(DTYPES)}, got {self.dtype!r}")
        if self.overflow not in ("truncate", "drop"):
            raise ConfigError(f"overflow must be truncate|drop, got {self.overflow!r}")
        if self.regen.backend not in ("hf", "openai", "vllm"):
            raise ConfigError(f"regen.backend must be hf|openai|vllm, got {self.regen.backend!r}")
        if self.regen.on_length not in ("unmask", "drop"):
            raise ConfigError(f"regen.on_length must be unmask|drop, got {self.regen.on_length!r}")
        if self.regen.api_key is not None:  # the value is never printed
            raise ConfigError(f"regen.api_key is not read (a key on the command line shows in `ps` and in error "
                              f"output): export {self.regen.api_key_env}=<key> instead (regen.api_key_env names "
                              "the variable)")
        if self.eval_samples is not None and self.eval_samples < 0:
            raise ConfigError(f"eval_samples must be >= 0 (or null: the default share), got {self.eval_samples}")
        if self.capture.teacher not in ("hidden", "topk", "argmax"):
            raise ConfigError(f"capture.teacher must be hidden|topk|argmax, got {self.capture.teacher!r}")
        if self.capture.taps_dtype not in ("bfloat16", "float8_e4m3fn"):
            raise ConfigError(f"capture.taps_dtype must be bfloat16|float8_e4m3fn, got {self.capture.taps_dtype!r}")
        if self.stage not in ("all", "vocab", "render"):
            raise ConfigError(f"stage must be all|vocab|render, got {self.stage!r}")
        if self.draft_vocab_count not in ("dataset", "train"):
            raise ConfigError(f"draft_vocab_count must be dataset|train, got {self.draft_vocab_count!r}")
        if not 0.0 <= self.draft_vocab_train_weight <= 1.0:
            raise ConfigError(f"draft_vocab_train_weight must be in [0, 1], got {self.draft_vocab_train_weight}")
        if self.capture.tensor_parallel_size < 1:
            raise ConfigError(f"capture.tensor_parallel_size must be >= 1, got {self.capture.tensor_parallel_size}")
        if self.max_len < 8:
            raise ConfigError("max_len must be >= 8")
        self.capture_engine_checks()

    def capture_engine_checks(self) -> None:
        c, v = self.capture, self.vllm
        if c.engine not in ("hf", "vllm"):
            raise ConfigError(f"capture.engine must be hf|vllm, got {c.engine!r}")
        if self.uses_vllm() and c.tensor_parallel_size != 1:
            raise ConfigError("capture.tensor_parallel_size splits the transformers target (capture.engine=hf, "
                             "regen.backend=hf); prep's vLLM engine is split by vllm.tensor_parallel_size")
        if v.capture_fidelity not in ("engine", "hf"):
            raise ConfigError(f"vllm.capture_fidelity must be engine|hf, got {v.capture_fidelity!r}")
        for key in ("tensor_parallel_size", "pipeline_parallel_size", "max_in_flight"):
            if getattr(v, key) < 1:
                raise ConfigError(f"vllm.{key} must be >= 1, got {getattr(v, key)}")
        for key in ("timeout_s", "scratch_gb"):
            if not getattr(v, key) > 0:
                raise ConfigError(f"vllm.{key} must be > 0, got {getattr(v, key)}")
        v.servers()  # each entry a server URL, or node=URL
        if v.urls and (v.tensor_parallel_size, v.pipeline_parallel_size, dict(v.engine_kwargs)) != (1, 1, {}):
            raise ConfigError("vllm.urls names servers already running: their parallel sizes and engine arguments are "
                             "their own `vllm serve` flags; leave vllm.tensor_parallel_size, pipeline_parallel_size "
                             "and engine_kwargs unset")
        taken = sorted(set(v.engine_kwargs) & set(RESERVED_ENGINE_KWARGS))
        if taken:
            raise ConfigError(f"vllm.engine_kwargs sets {taken}, which prep sets itself (the model, dtype, "
                             "max_model_len, host, port and the extraction are prep's; the parallel sizes are vllm's "
                             "own keys)")


HELD_OUT_FRACTION, HELD_OUT_MIN, HELD_OUT_MAX = 0.1, 2, 40


def held_out_count(eval_samples: int | None, usable: int) -> int:
    """Conversations held out of `usable`: `eval_samples` when given, else 10% of them, at least 2 and at most 40
    (40 from 400 conversations on), and never more than half, so a small dataset still leaves most to train on."""
    if eval_samples is not None:
        return eval_samples
    share = max(HELD_OUT_MIN, round(HELD_OUT_FRACTION * usable))
    return min(HELD_OUT_MAX, share, usable // 2)


def prep_config(raw: DictConfig) -> PrepConfig:
    """A composed Hydra config as a typed PrepConfig, every key checked against the schema."""
    check_keys(OmegaConf.to_container(raw, resolve=False), PrepConfig, renamed=RENAMED_KEYS, replaced=REPLACED_KEYS)
    return OmegaConf.to_object(raw)
