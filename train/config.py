"""Typed training configuration: the schema behind conf/train.yaml.

Every group (model, data, train, deepspeed, logger) is a dataclass; the root `RunConfig` is stored in
Hydra's ConfigStore as `run_schema` and listed first in conf/train.yaml's defaults, so composing a
config with a misspelt key (`train.lrr=1`) or an ill-typed value (`train.lr=abc`) fails at once with
Hydra's own message naming the key. `validate()` then checks what types cannot express (ranges,
enumerations, combinations); launch/train.py calls it before any process group exists.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from infra.config_keys import ConfigError, check_keys
from models.dflash import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_LAYERS
from serving.config import VLLMConfig

PRECISIONS = ("auto", "bf16", "fp32")
DIST_BACKENDS = ("auto", "nccl", "gloo")
WANDB_MODES = ("offline", "online", "disabled")
OVERFLOW = ("truncate", "split")
SOURCES = ("offline", "online", "hybrid", "vllm")  # data.source: train/online.py, train/served.py
PLACEMENTS = ("replicate", "zero3", "tp")  # data.target_placement
LOSS_TOKENS = ("assistant", "all")  # data.loss_tokens
SCHEDULES = ("cosine", "wsd")
ACCEPT_KINDS = ("none", "tv", "log")  # train.accept_loss: train/loss.py AcceptTerm


@dataclass
class DFlashModelConfig:
    """model.dflash: the DFlash drafter's own shape (model.method=dflash, models/dflash.py)."""

    num_layers: int = DEFAULT_NUM_LAYERS  # drafter decoder layers
    block_size: int = DEFAULT_BLOCK_SIZE  # B = [last accepted token, MASK x (B - 1)]
    # A reserved target token id for MASK; None = "<|MASK|>" if the tokenizer has it, else the first
    # embedding row past the tokenizer (Qwen3: 151669), else its highest special token the chat template
    # does not use (SmolLM2: 16 "<empty_output>").
    mask_token_id: int | None = None


@dataclass
class ModelConfig:
    method: str = "eagle3"  # the drafter family: a name in models/registry.py FAMILIES (eagle3 | eagle1 | dflash)
    attn_backend: str = "auto"  # "auto" (best exact backend for the device) or a name in models.attention
    # Drafter geometry overrides; None = take the value from the target's config (the usual EAGLE-3 choice).
    # hidden_size is not overridable: the frozen target embedding and the taps fix it.
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = None
    # max_position_embeddings written into the export; None = max(data.max_len, target's).
    max_position_embeddings: int | None = None
    dflash: DFlashModelConfig = field(default_factory=DFlashModelConfig)  # model.method=dflash only
    # Levers (presets in conf/lever/, compared by a multirun); which family takes which: its `levers` in
    # models/registry.py. draft_vocab_size: None = the prep's draft vocabulary;
    # else that many ids cut from the prep's own ranking (data_prep/vocab.py; <= 0: the whole vocabulary).
    draft_vocab_size: int | None = None
    lm_head_init: str = "random"  # random | target: the target LM head's rows at the draft ids
    freeze_lm_head: bool = False  # with lm_head_init=target: those rows stay the target's (not trained)
    # ones | target | zeros: the final norm starts at ones, as the target's final norm, or at zero (logits 0 at
    # step 0: train.build.initial_norm_weight says why) (EAGLE-3, DFlash)
    norm_init: str = "ones"
    fc_norm: bool = False  # "EAGLE-3.1": an RMSNorm on each tap before fc (vLLM's fc_norm)
    norm_output: bool = False  # "EAGLE-3.1": the next draft step takes norm(h), not h (vLLM's norm_output)
    # Target layers the drafter reads, in concat order; they must be in the shards (a prep may carry more:
    # the objective takes its columns). None = EAGLE-3: every tap of the shards; DFlash: 5 layers evenly
    # spaced in [1, L - 3]. EAGLE-1 reads the top-layer feature only.
    tap_layers: list[int] | None = None


# Every model.* lever and its default; a family takes those its `levers` name (models/registry.py).
LEVERS = {k: getattr(ModelConfig, k) for k in
          ("draft_vocab_size", "lm_head_init", "freeze_lm_head", "norm_init", "fc_norm", "norm_output")}


@dataclass
class DataConfig:
    dir: str = MISSING  # a prep output dir: train/, eval/, draft_vocab.safetensors, target_head.safetensors
    max_len: int = 2048  # tokens per sample; longer samples are cut per `overflow`
    # truncate: keep the first max_len tokens (the rest is never trained). split: consecutive windows of
    # max_len tokens, each later one overlapping the previous by split_overlap tokens, whose loss it does
    # not count again (train/data.py `windows`: every target is trained once, none is lost).
    overflow: str = "truncate"
    split_overlap: int = 256  # >= train.ttt_steps + 1, or (token, TTT step) pairs at window starts are lost
    # Samples per GLOBAL micro-batch, split evenly over the ranks: the sequence of global batches does
    # not depend on the world size, which is what makes 1-vs-N runs and N->M resumes line up.
    batch_size: int = 8
    bucket: bool = True  # length bucketing: batches of similar lengths (less padding)
    bucket_pool: int = 64  # batches per bucketing pool (sorted by length inside a pool, then shuffled)
    eval_batch_size: int = 8  # global, like batch_size
    eval_max_samples: int | None = None  # None = the whole held-out split
    # None = the whole train split; n = a fixed subset of n samples (the n smallest sha256 of the sample
    # ids): the same for every run, seed and world size, and nested (n < m: the n samples are among the m),
    # so one large prep serves a data-scaling curve.
    train_samples: int | None = None
    num_workers: int = 0  # DataLoader worker processes per rank
    verify: str = "lazy"  # shard checksum policy: lazy | eager | none
    # Where the target features come from (train/online.py). offline: the prep's shards. online: the frozen target
    # runs inside training on the prep's rendered samples (<prep>/rendered/, written before its capture; no shard
    # is read or written). hybrid: online in the first epoch, which writes the shards as prep does
    # (<out_dir>/captured/train/), read by the later epochs. vllm: vLLM servers compute them (train/served.py:
    # the `vllm` group's servers, started by training or the user's vllm.urls); nothing is written.
    source: str = "offline"
    # data.source=vllm without vllm.urls: the servers training starts on each node, each on vllm.tensor_parallel_size
    # x pipeline_parallel_size devices after the node's training ranks' (or on the CPU)
    vllm_servers_per_node: int = 1
    # data.source=vllm: host memory per rank for the features the servers computed, kept so that later epochs and
    # every held-out evaluation read them instead of asking again; beyond it a sample is asked for again each time
    # (summary.json data.samples_recomputed). 0: nothing kept.
    vllm_cache_gb: float = 16.0
    # online|hybrid: the target to run; None = the one the prep loaded (<prep>/rendered/spec.json). Another copy
    # (a path on this machine) must match the prep: architecture, geometry, tokenizer and chat template.
    target: str | None = None
    # online|hybrid: where the frozen target lives. replicate: a whole copy on every rank's device. zero3: DeepSpeed
    # ZeRO-3 partitions its weights over the ranks and gathers each layer for its forward (every rank runs every
    # forward: one per micro-batch), loaded already partitioned. tp: transformers' tensor-parallel plan over groups of
    # data.target_tp_size ranks; a group's ranks gather their samples and run one forward over them together.
    target_placement: str = "replicate"
    target_tp_size: int | None = None  # data.target_placement=tp: ranks per group; None = the whole world
    # data.source=hybrid: tokens per shard it writes (prep's capture.tokens_per_shard), and what computes epoch 0's
    # features: online (the frozen target in each rank) or vllm (the `vllm` group's servers, as data.source=vllm)
    hybrid_tokens_per_shard: int = 1 << 20
    hybrid_from: str = "online"
    # Which rows of the TRAIN split are loss targets. assistant: the prep's loss mask (the assistant's replies).
    # all: every real token, the user's turns and the template's too: the stored teacher is the target's own
    # prediction at every position, so each row still distils the target, at no prep cost. Held-out evaluation
    # always scores the assistant rows (what decoding drafts).
    loss_tokens: str = "assistant"


@dataclass
class DFlashTrainConfig:
    """train.dflash: DFlash's block training (train/dflash.py)."""

    anchors: int = 512  # blocks drawn per sequence, capped by the response positions it has
    # block position k's CE is weighted exp(-(k - 1) / gamma) (7 for B = 16; the paper: 5 for B = 10)
    gamma: float = 7.0


@dataclass
class OnPolicyConfig:
    """train.on_policy: Draft-OPD's on-policy stage (train/on_policy.py): the drafter rolls out against the target
    on prep's prompts and trains on the drafting those rollouts visited, against the target's distribution."""

    enabled: bool = False
    # drafts per rollout cycle (chain drafting); train.ttt_steps >= depth trains every visited step. A block drafter
    # (DFlash) drafts its block: model.dflash.block_size - 1
    depth: int = 3
    max_new_tokens: int = 256  # tokens each rollout generates (cut at data.max_len, and at the target's EOS)
    temperature: float = 0.0  # 0: greedy rollouts (the target's argmax); > 0: lossless sampling at this temperature
    refresh_interval: int = 10  # optimizer steps between copies of the trained weights into the rollout drafter
    # greedy rollouts: where prep's reply to the prompt is the target's greedy text (checked on its capture: the
    # target's argmax gives it token by token), it is the rollout's text and the target does not generate it
    reuse_prep_replies: bool = True


@dataclass
class TrainConfig:
    ttt_steps: int = 7  # K: TTT unroll length
    eval_ttt_steps: int | None = None  # steps unrolled by held-out evals; None = ttt_steps
    loss_decay: float = 0.8  # lambda: weight of step k is lambda**k
    lr: float = 1e-4
    min_lr_ratio: float = 0.0  # the schedule's floor as a fraction of lr
    warmup_steps: int = 50  # linear warmup (optimizer steps)
    # When set, the warmup is this fraction of the run's optimizer steps instead (warmup_steps ignored): a
    # recipe that keeps its shape whatever the data size.
    warmup_ratio: float | None = None
    # cosine: warmup, then cosine to min_lr_ratio * lr at the last step. wsd (warmup-stable-decay): warmup,
    # constant lr, then a linear decay to min_lr_ratio * lr over the last decay_ratio of the steps.
    schedule: str = "cosine"
    decay_ratio: float = 0.2
    # Gaussian noise on the target features while training (held-out evals see clean ones): std as a
    # fraction of each tap row's RMS, so one value suits every target width. 0 = off.
    feature_noise: float = 0.0
    # An acceptance term added to every row's CE (train/loss.py AcceptTerm, docs/method.md §4.7): none | tv
    # (β·(1 − α)) | log (β·(−log α)), α = Σ min(p, q) the row's acceptance probability; β the weight.
    accept_loss: str = "none"
    accept_loss_weight: float = 1.0
    # The exact teacher's rows of every sample kept in memory across epochs (train/teacher_cache.py): its
    # full-vocab head matmul then runs once per sample. MB per process (a row: 4·Vd + 20 bytes; the demo's
    # 34K loss rows at Vd 8,192 take 1.1 GB); 0 = recompute.
    teacher_epoch_cache_mb: int = 0
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; the run stops at whichever of epochs/max_steps ends first
    # Stop once the run reaches this optimizer step (checkpointed; continue with train.resume=true and
    # without this key), without changing the schedule: time-limited allocations, and how tests interrupt.
    stop_after_steps: int | None = None
    grad_accum: int = 1  # micro-batches per optimizer step
    clip: float = 0.5  # global grad-norm clip; 0 disables
    chunk_size: int = 2048  # target positions per loss chunk (bounds vocab-sized memory)
    # Activation-checkpoint the drafter layer of each TTT step: memory linear in T with a smaller slope
    # (long context), at the cost of recomputing the layer in backward.
    checkpoint_layer: bool = False
    eval_interval: int = 500  # optimizer steps between held-out evals; 0 = only at the end
    save_interval: int = 1000  # optimizer steps between checkpoints; 0 = only at the end
    keep_checkpoints: int = 2  # newest checkpoints kept (the final one is always kept)
    resume: bool = False  # continue from <out_dir>/checkpoints/latest if it exists
    # With resume: continue the run past its end on purpose, with a larger max_steps or epochs (the lr schedule is
    # recomputed for the new length from the step resumed; recorded as "extensions" in checkpoints and summary).
    extend: bool = False
    # A run dir belongs to one run: a fresh run (resume=false) refuses an out_dir holding another run's files
    # (checkpoints, metrics, summary, export); overwrite=true removes them first (train/trainer.py RUN_OUTPUTS).
    overwrite: bool = False
    seed: int = 0
    # An export dir (ours, or a public drafter of the same family in the engine layout) whose weights start the run
    # instead of a fresh initialisation: checked against the prep's target and this run's drafter config before
    # training starts (train/build.py init_from_export). None = a fresh drafter.
    init_from: str | None = None
    log_interval: int = 1  # optimizer steps between metrics.jsonl lines
    dflash: DFlashTrainConfig = field(default_factory=DFlashTrainConfig)  # model.method=dflash only
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)  # Draft-OPD's stage (off: supervised)
    export: bool = True  # write <run_dir>/export/ at the end

    def warmup(self, total_steps: int) -> int:
        """Warmup length in optimizer steps for a run of `total_steps`."""
        if self.warmup_ratio is None:
            return self.warmup_steps
        return max(1, round(self.warmup_ratio * total_steps))


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 3  # 0 | 1 | 2 | 3
    precision: str = "auto"  # auto: bf16 where the device computes it natively (infra/precision.py), else fp32
    dist_backend: str = "auto"  # auto = nccl on CUDA, gloo on CPU
    # DeepSpeed JIT-builds a shared-memory all-reduce op on CPU the first time (~50 s); gloo does
    # the job, so it is skipped unless asked for.
    cpu_shm_comm: bool = False
    reduce_bucket_size: int = 50_000_000
    # ZeRO-3 prefetching and parameter reuse follow a per-rank trace of module calls. The loss calls the
    # output head once per chunk of loss positions, a count that differs between ranks, so the traces
    # differ and trace-driven all-gathers would mismatch across ranks (a hang). Off by default: params
    # are gathered on demand in call order (the head itself is kept gathered; see Engine._keep_gathered).
    stage3_prefetch_bucket_size: int = 0
    stage3_max_reuse_distance: int = 0
    stage3_param_persistence_threshold: int = 100_000
    # Ulysses sequence parallelism (train/sequence_parallel.py): each sample's sequence is split over groups
    # of this many consecutive ranks; data parallelism runs over the world / this groups. It must divide
    # the world size and the drafter's attention and kv head counts. 1 = off.
    sequence_parallel_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)  # merged last into the DeepSpeed config dict


@dataclass
class LoggerConfig:
    wandb_mode: str = "offline"  # offline | online | disabled; metrics.jsonl is written regardless
    project: str = "eagle3-drafter"
    name: str | None = None  # None = the run directory's name
    progress: bool = True  # tqdm bar on rank 0


@dataclass
class RunConfig:
    out_dir: str = MISSING  # everything of a run goes here (a sweep: one sub-directory per job)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # data.source=vllm: the servers that compute the features, prep's `vllm` keys with prep's meanings
    # (data_prep/config.py VLLMConfig; capture_fidelity is prep's alone)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)

    @classmethod
    def from_omegaconf(cls, raw: DictConfig) -> RunConfig:
        """A composed Hydra config (hydra keys dropped) as a plain, typed RunConfig."""
        raw = OmegaConf.masked_copy(raw, [k for k in raw.keys() if k != "hydra"])
        # Hydra's `+key=value` opens the struct flag, so an appended key can slip past the schema.
        check_keys(OmegaConf.to_container(raw, resolve=False), cls)
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cls), raw))
        assert isinstance(cfg, cls)
        return cfg

    def to_yaml(self) -> str:
        return OmegaConf.to_yaml(OmegaConf.structured(self))

    def validate(self, world_size: int | None = None) -> RunConfig:
        """Raise ConfigError for values that would fail (or silently misbehave) later. Returns self."""
        self._validate_choices()
        self._validate_levers()
        self._validate_data()
        self._validate_ranges()
        self._validate_long_context()
        if world_size is not None:
            self._validate_world(world_size)
        self._validate_dflash()
        self._validate_on_policy()
        self._warn_ineffective()
        return self

    def _validate_choices(self) -> None:
        """Names that must be one of a set, and settings that only make sense together."""
        m, t = self.model, self.train
        from models.attention import ATTENTION  # the registry decides which backend names exist
        from models.registry import METHODS

        _one_of("model.method", m.method, METHODS)
        _one_of("model.attn_backend", m.attn_backend, ("auto", *sorted(ATTENTION)))
        _one_of("model.lm_head_init", m.lm_head_init, ("random", "target"))
        _one_of("model.norm_init", m.norm_init, ("ones", "target", "zeros"))
        _one_of("train.schedule", t.schedule, SCHEDULES)
        if m.freeze_lm_head and m.lm_head_init != "target":
            raise ConfigError("model.freeze_lm_head=true needs model.lm_head_init=target (a frozen random head "
                              "would never learn)")
        if not 0.0 < t.decay_ratio <= 1.0:
            raise ConfigError(f"train.decay_ratio must be in (0, 1], got {t.decay_ratio}")
        if t.extend and not t.resume:
            raise ConfigError("train.extend=true continues a run past its end: it needs train.resume=true")
        if t.resume and t.overwrite:
            raise ConfigError("train.resume=true and train.overwrite=true: continue the run in out_dir, or clear it "
                              "and start a new one, not both")
        if t.feature_noise < 0:
            raise ConfigError(f"train.feature_noise must be >= 0, got {t.feature_noise}")
        _one_of("train.accept_loss", t.accept_loss, ACCEPT_KINDS)
        if t.teacher_epoch_cache_mb < 0:
            raise ConfigError(f"train.teacher_epoch_cache_mb must be >= 0, got {t.teacher_epoch_cache_mb}")
        if t.init_from is not None and not (Path(t.init_from) / "config.json").is_file():
            raise ConfigError(f"train.init_from={t.init_from}: no config.json there (an export dir holds config.json "
                              "and model.safetensors: launch/export.py writes one, a run writes <out_dir>/export)")
        if t.accept_loss_weight < 0:
            raise ConfigError(f"train.accept_loss_weight must be >= 0, got {t.accept_loss_weight}")

    def _validate_levers(self) -> None:
        """A model lever (LEVERS) set away from its default must be one the drafter family takes."""
        m = self.model
        from models.registry import family

        fam = family(m.method)
        changed = [k for k, default in LEVERS.items() if getattr(m, k) != default and k not in fam.levers]
        if changed:
            takes = f"model.{', model.'.join(fam.levers)}" if fam.levers else "none"
            raise ConfigError(f"model.{', model.'.join(changed)}: not a lever of model.method={m.method} "
                              f"({fam.label} takes: {takes})")

    def _validate_data(self) -> None:
        """DeepSpeed's and the logger's choices, and the data settings that exclude each other."""
        d, ds, lg = self.data, self.deepspeed, self.logger
        _one_of("deepspeed.precision", ds.precision, PRECISIONS)
        _one_of("deepspeed.dist_backend", ds.dist_backend, DIST_BACKENDS)
        _one_of("deepspeed.zero_stage", ds.zero_stage, (0, 1, 2, 3))
        _one_of("logger.wandb_mode", lg.wandb_mode, WANDB_MODES)
        _one_of("data.verify", d.verify, ("lazy", "eager", "none"))
        _one_of("data.overflow", d.overflow, OVERFLOW)
        _one_of("data.source", d.source, SOURCES)
        _one_of("data.target_placement", d.target_placement, PLACEMENTS)
        if d.target_placement == "tp" and ds.sequence_parallel_size > 1:
            raise ConfigError("data.target_placement=tp with deepspeed.sequence_parallel_size > 1 is not supported: "
                              "a tensor-parallel group gathers the samples of data-parallel ranks")
        if d.target_tp_size is not None and d.target_placement != "tp":
            raise ConfigError(f"data.target_tp_size={d.target_tp_size} is for data.target_placement=tp, not "
                              f"{d.target_placement}")
        _one_of("data.loss_tokens", d.loss_tokens, LOSS_TOKENS)
        if d.source != "offline" and d.num_workers:
            raise ConfigError(f"data.num_workers={d.num_workers} with data.source={d.source}: the target runs in the "
                              "training process (set data.num_workers=0)")
        if d.source == "hybrid" and ds.sequence_parallel_size > 1:
            raise ConfigError("data.source=hybrid with deepspeed.sequence_parallel_size > 1 is not supported: the ranks of "
                              "a sequence-parallel group read the same samples and would write the same shards")
        _one_of("data.hybrid_from", d.hybrid_from, ("online", "vllm"))
        if d.source == "vllm" or d.source == "hybrid" and d.hybrid_from == "vllm":
            self.vllm.servers()  # ConfigError naming an entry of vllm.urls that is not a server's address
            if d.vllm_servers_per_node < 1:
                raise ConfigError(f"data.vllm_servers_per_node must be >= 1, got {d.vllm_servers_per_node}")
            if d.vllm_cache_gb < 0:
                raise ConfigError(f"data.vllm_cache_gb must be >= 0, got {d.vllm_cache_gb}")
            for key in ("timeout_s", "max_in_flight", "scratch_gb", "tensor_parallel_size", "pipeline_parallel_size"):
                if not getattr(self.vllm, key) > 0:
                    raise ConfigError(f"vllm.{key} must be > 0, got {getattr(self.vllm, key)}")
        if d.hybrid_tokens_per_shard < 1:
            raise ConfigError(f"data.hybrid_tokens_per_shard must be >= 1, got {d.hybrid_tokens_per_shard}")

    def _validate_ranges(self) -> None:
        """Counts, sizes and rates within their ranges."""
        m, d, t, ds = self.model, self.data, self.train, self.deepspeed
        for key, value in [
            ("data.max_len", d.max_len),
            ("data.batch_size", d.batch_size),
            ("data.bucket_pool", d.bucket_pool),
            ("data.eval_batch_size", d.eval_batch_size),
            ("train.ttt_steps", t.ttt_steps),
            ("train.epochs", t.epochs),
            ("train.grad_accum", t.grad_accum),
            ("train.chunk_size", t.chunk_size),
            ("train.log_interval", t.log_interval),
            ("train.keep_checkpoints", t.keep_checkpoints),
            ("deepspeed.sequence_parallel_size", ds.sequence_parallel_size),
        ]:
            if value < 1:
                raise ConfigError(f"{key} must be >= 1, got {value}")
        for key, value in [
            ("train.warmup_steps", t.warmup_steps),
            ("train.eval_interval", t.eval_interval),
            ("train.save_interval", t.save_interval),
            ("train.clip", t.clip),
            ("train.weight_decay", t.weight_decay),
            ("data.num_workers", d.num_workers),
        ]:
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if t.warmup_ratio is not None and not 0 <= t.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {t.warmup_ratio}")
        for key, value in [("train.max_steps", t.max_steps), ("train.stop_after_steps", t.stop_after_steps),
                           ("train.eval_ttt_steps", t.eval_ttt_steps)]:
            if value is not None and value < 1:
                raise ConfigError(f"{key} must be >= 1 or null, got {value}")
        if not 0.0 < t.loss_decay <= 1.0:
            raise ConfigError(f"train.loss_decay must be in (0, 1], got {t.loss_decay}")
        if not t.lr > 0:
            raise ConfigError(f"train.lr must be > 0, got {t.lr}")
        if not 0.0 <= t.min_lr_ratio <= 1.0:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {t.min_lr_ratio}")
        if len(t.betas) != 2 or not all(0.0 <= b < 1.0 for b in t.betas):
            raise ConfigError(f"train.betas must be two values in [0, 1), got {t.betas}")
        for key, value in [
            ("model.intermediate_size", m.intermediate_size),
            ("model.num_attention_heads", m.num_attention_heads),
            ("model.num_key_value_heads", m.num_key_value_heads),
            ("model.head_dim", m.head_dim),
            ("model.max_position_embeddings", m.max_position_embeddings),
            ("data.eval_max_samples", d.eval_max_samples),
            ("data.train_samples", d.train_samples),
        ]:
            if value is not None and value < 1:
                raise ConfigError(f"{key} must be >= 1 or null, got {value}")
        if m.num_attention_heads and m.num_key_value_heads and m.num_attention_heads % m.num_key_value_heads:
            raise ConfigError(
                f"model.num_attention_heads ({m.num_attention_heads}) must be a multiple of "
                f"model.num_key_value_heads ({m.num_key_value_heads})"
            )

    def _validate_world(self, world_size: int) -> None:
        """What depends on the world size: the target's tensor-parallel groups and the batches' split."""
        d, ds = self.data, self.deepspeed
        if d.target_placement == "tp" and d.source != "offline":
            from data_prep.targets import check_world

            try:  # the heads are checked against the target's config.json when the target is resolved
                check_world(d.target_tp_size or world_size, world_size, "data.target_tp_size")
            except ValueError as e:
                raise ConfigError(str(e)) from e
        sp = ds.sequence_parallel_size
        if world_size % sp:
            raise ConfigError(f"deepspeed.sequence_parallel_size={sp} must divide the world size {world_size}")
        data_ranks = world_size // sp
        what = f"the world size {world_size}" if sp == 1 else f"the data-parallel size {data_ranks}"
        for key, value in [
            ("data.batch_size", d.batch_size),
            ("data.eval_batch_size", d.eval_batch_size),
        ]:
            if value % data_ranks:
                raise ConfigError(
                    f"{key}={value} must be a multiple of {what}: each global batch "
                    "is split evenly over the ranks"
                )

    def _warn_ineffective(self) -> None:
        """Settings that take no effect in this combination: a warning, not an error."""
        t, ds = self.train, self.deepspeed
        if ds.cpu_shm_comm and ds.dist_backend == "nccl":
            warnings.warn("deepspeed.cpu_shm_comm has no effect with the nccl backend", stacklevel=2)
        if t.eval_interval and t.max_steps and t.eval_interval > t.max_steps:
            warnings.warn(
                f"train.eval_interval={t.eval_interval} > train.max_steps={t.max_steps}: only the final eval runs",
                stacklevel=2,
            )

    def _validate_long_context(self) -> None:
        """data.overflow=split and deepspeed.sequence_parallel_size (the parts without a world size)."""
        m, d, t, sp = self.model, self.data, self.train, self.deepspeed.sequence_parallel_size
        if d.overflow == "split":
            if not 0 <= d.split_overlap < d.max_len:
                raise ConfigError(f"data.split_overlap={d.split_overlap} must be in [0, data.max_len={d.max_len})")
            if d.split_overlap < t.ttt_steps + 1:
                warnings.warn(f"data.split_overlap={d.split_overlap} < train.ttt_steps + 1: the first TTT steps "
                              "of targets at the start of each later window are never trained", stacklevel=3)
        if sp > 1:
            from models.registry import FAMILIES, family

            if not family(m.method).sequence_parallel:
                able = [name for name, f in FAMILIES.items() if f.sequence_parallel]
                raise ConfigError(f"deepspeed.sequence_parallel_size={sp} needs a drafter whose attention it "
                                  f"parallelises (model.method={' | '.join(able)}), got {m.method!r}")
            for key, heads in [("model.num_attention_heads", m.num_attention_heads),
                               ("model.num_key_value_heads", m.num_key_value_heads)]:
                if heads is not None and heads % sp:  # None: the target's, checked when the drafter is built
                    raise ConfigError(f"deepspeed.sequence_parallel_size={sp} must divide {key}={heads}")

    def _validate_dflash(self) -> None:
        """The DFlash keys: ranges, and a warning where they are set for a method that ignores them."""
        m, t = self.model, self.train
        dm = m.dflash
        if dm.num_layers < 1:
            raise ConfigError(f"model.dflash.num_layers must be >= 1, got {dm.num_layers}")
        if dm.block_size < 2:
            raise ConfigError(f"model.dflash.block_size must be >= 2, got {dm.block_size}")
        if dm.mask_token_id is not None and dm.mask_token_id < 0:
            raise ConfigError(f"model.dflash.mask_token_id must be >= 0 or null, got {dm.mask_token_id}")
        if m.tap_layers is not None and (not m.tap_layers or min(m.tap_layers) < 0
                                         or len(set(m.tap_layers)) != len(m.tap_layers)):
            raise ConfigError(f"model.tap_layers must be distinct 0-based layer ids or null, got {m.tap_layers}")
        if t.dflash.anchors < 1:
            raise ConfigError(f"train.dflash.anchors must be >= 1, got {t.dflash.anchors}")
        if not t.dflash.gamma > 0:
            raise ConfigError(f"train.dflash.gamma must be > 0, got {t.dflash.gamma}")
        from models.registry import FAMILIES, family

        fam = family(m.method)
        unused = []
        for section in sorted({f.options for f in FAMILIES.values() if f.options} - {fam.options}):
            mine, default = getattr(m, section), type(getattr(m, section))()  # another family's model.<section>
            unused += [f"model.{section}.{f.name}" for f in fields(mine)
                       if getattr(mine, f.name) != getattr(default, f.name)]
        if not fam.reads_tap_layers and m.tap_layers is not None:
            unused.append("model.tap_layers")
        if not fam.attn_backend and m.attn_backend != "auto":
            unused.append("model.attn_backend")
        if unused:
            warnings.warn(f"{', '.join(unused)}: not used by model.method={m.method} (ignored)", stacklevel=3)


    def _validate_on_policy(self) -> None:
        """train.on_policy: its ranges, and what its rollouts need (a target in the ranks or on vLLM's servers; for
        sampled rollouts a whole copy in the rank and a family that decodes them; a family with rollouts; whole samples)."""
        op, d, t = self.train.on_policy, self.data, self.train
        for key in ("depth", "max_new_tokens", "refresh_interval"):
            if getattr(op, key) < 1:
                raise ConfigError(f"train.on_policy.{key} must be >= 1, got {getattr(op, key)}")
        if op.temperature < 0:
            raise ConfigError(f"train.on_policy.temperature must be >= 0, got {op.temperature}")
        if not op.enabled:
            return
        from models.registry import family

        fam = family(self.model.method)
        sampled = op.temperature > 0
        need = [
            (fam.greedy_drafts is None, f"model.method={self.model.method}: {fam.label} drafters have no rollouts "
             "(model.method=eagle3 or dflash)"),
            (sampled and fam.greedy_drafts is not None and fam.rollout is None,
             f"train.on_policy.temperature={op.temperature} with model.method={self.model.method}: {fam.label} "
             "rollouts are greedy (train.on_policy.temperature=0)"),
            (d.source not in ("online", "vllm"), f"data.source={d.source}: rollouts run against the target in the "
             "ranks or on vLLM's servers (data.source=online or vllm)"),
            (sampled and d.source == "vllm", f"train.on_policy.temperature={op.temperature} with data.source=vllm: "
             "sampled rollouts decode speculatively with the target in the rank (data.source=online, or "
             "train.on_policy.temperature=0)"),
            (sampled and d.source == "online" and d.target_placement != "replicate",
             f"train.on_policy.temperature={op.temperature} with data.target_placement={d.target_placement}: a "
             "sampled rollout runs its own number of target forwards, which a ZeRO-3 or tensor-parallel target "
             "cannot (data.target_placement=replicate, or train.on_policy.temperature=0)"),
            (d.overflow != "truncate", "data.overflow=split: a rollout is one window (data.overflow=truncate)"),
            (d.loss_tokens != "assistant", "data.loss_tokens=all: a rollout trains its continuation only"),
            (self.deepspeed.sequence_parallel_size > 1, "deepspeed.sequence_parallel_size > 1: not with rollouts"),
            (d.num_workers > 0, "data.num_workers > 0: rollouts run in the training process"),
        ]
        refused = [why for bad, why in need if bad]
        if refused:
            raise ConfigError("train.on_policy.enabled=true: " + "; ".join(refused))
        if not fam.block_drafting and t.ttt_steps < op.depth:  # a block drafter's rollouts draft its whole block
            warnings.warn(f"train.ttt_steps={t.ttt_steps} < train.on_policy.depth={op.depth}: the visited steps past "
                          f"{t.ttt_steps} are not trained", stacklevel=3)
        if t.init_from is None:
            warnings.warn("train.on_policy.enabled=true without train.init_from: the rollouts start from a fresh "
                          "drafter (the stage continues a supervised one)", stacklevel=3)


def _one_of(key: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}")


@dataclass
class ExportConfig:
    """launch/export.py: write a serving export from a training checkpoint (CPU, offline)."""

    checkpoint: str = (
        MISSING  # a checkpoint dir (…/checkpoints/step_000100), a `latest` file, or a run or checkpoints/ dir
    )
    out: str = MISSING
    max_position_embeddings: int | None = None  # None = what the checkpoint recorded


def register_configs() -> None:
    """Put the schemas into Hydra's ConfigStore (idempotent; called by the entry points)."""
    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    cs.store(name="export_schema", node=ExportConfig)
