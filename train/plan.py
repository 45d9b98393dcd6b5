"""A memory plan before launch: per-device bytes of a TTT training run, from configs alone (no weights).

    from train.plan import plan_run
    p = plan_run(cfg, "gpt-oss-120b", world_size=8, device_memory_gb=141)   # cfg: train.config.RunConfig
    print(p.table())

What it counts, per device (data-parallel rank), at the step's peak:
- runtime: the process before any tensor exists (CPU: a measured constant, `CPU_RUNTIME_MB`; CUDA: 0, the
  allocator's count, which leaves out the CUDA context);
- the frozen target's share (data.source=online|hybrid): its weights as data.target_placement keeps them
  (replicate: all of them; zero3: 1/world plus one gathered decoder layer; tp: 1/tp_size), and the working set
  of its capture forward (layer activations, the kept taps; `eager` attention adds the T x T scores);
- the drafter's weights, gradients and optimizer state under deepspeed.zero_stage, as train/engine.py keeps
  them through DeepSpeed (bf16: bf16 weights + fp32 master + fp32 Adam moments; fp32: the weights are fp32
  and ZeRO >= 1 still keeps its own fp32 partition); the frozen target head (norm + LM head + embedding);
- the TTT step at the context: the batch, the K steps' tensors kept for backward (with train.checkpoint_layer
  the layer input and its K/V only), the loss rows, the fused head's per-chunk vocabulary-sized tensors
  (train/loss.py) and the teacher targets the trainer keeps (train/ttt.py count_valid), and the backward's
  recomputed layer. The peak is the larger of the loss pass and the backward.
Target and drafter configs come from the target's config (a preset, a directory with config.json or a hub
id) and the family table (models/registry.py), instantiated on the meta device: parameter counts are exact.
Activation widths are counted from the code's tensor shapes; bench/plan_check.py compares the total with
measured peak memory (docs/training.md, "Memory plan"; docs/results.md).
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.precision import resolve_precision

GiB = 1 << 30
MiB = 1 << 20
# Peak RSS of a CPU training process before it builds anything: Python, torch, DeepSpeed and transformers
# imported, the process group up (measured by bench/plan_check.py, bench/results/plan_check.json "runtime").
CPU_RUNTIME_MB = 279.0
PLACEMENTS = ("none", "replicate", "zero3", "tp")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp32": 4, "bf16": 2}

# Public configs of the presets (conf/targets/*.yaml) whose hub config is not on this machine: the plan works
# offline from the preset. The preset's own layers / hidden size / vocabulary are checked against them.
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "openai/gpt-oss-120b": {"model_type": "gpt_oss"},  # transformers' GptOssConfig defaults are the 120b
    "openai/gpt-oss-20b": {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_local_experts": 32},
    "HuggingFaceTB/SmolLM2-135M-Instruct": {
        "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
        "rope_theta": 100000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5},
    "Qwen/Qwen3-8B": {
        "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "tie_word_embeddings": False, "rope_theta": 1000000.0, "max_position_embeddings": 40960},
    "Qwen/Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936, "tie_word_embeddings": False,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960},
    "meta-llama/Llama-3.1-8B-Instruct": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE, "max_position_embeddings": 131072},
    "meta-llama/Llama-3.3-70B-Instruct": {
        "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
        "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
        "rope_theta": 500000.0, "rope_scaling": _LLAMA3_ROPE, "max_position_embeddings": 131072},
}


class PlanError(ValueError):
    """A plan that cannot be made (unknown target, unsupported family or option); the message says why."""


# ------------------------------------------------------------------------------------------- the target
@dataclass
class TargetInfo:
    name: str
    config: dict  # the HF config dict
    source: str  # where the config came from
    params: int  # parameters (tied counted once)
    largest_layer_params: int  # one decoder layer: what ZeRO-3 gathers for its forward
    dtype_bytes: int
    tap_layers: list[int]
    draft_vocab_size: int
    attn_implementation: str | None


def _hf_config_object(config: dict):
    from transformers import AutoConfig

    cfg = dict(config)
    return AutoConfig.for_model(cfg.pop("model_type"), **{k: v for k, v in cfg.items()
                                                          if not k.startswith("_") and k != "transformers_version"})


def target_config(ref: str) -> tuple[dict, str, Any]:
    """(HF config dict, where it came from, the TargetPreset) of a preset name, a local directory or a hub id,
    without weights and, for a preset, without the network; a preset's geometry checked against that config."""
    from data_prep.targets import PRESET_DIR, check_preset, resolve_target

    try:
        preset = resolve_target(ref)
    except (ValueError, FileNotFoundError) as e:
        raise PlanError(f"target {ref!r}: {e}") from None
    config, source = _find_config(ref, preset)
    if (PRESET_DIR / f"{ref}.yaml").exists():
        try:
            check_preset(preset, config, source)
        except ValueError as e:
            raise PlanError(str(e)) from None
    return config, source, preset


def _find_config(ref: str, preset: Any) -> tuple[dict, str]:
    from data_prep.targets import PRESET_DIR, cache_dir, list_presets

    if preset.local_path:
        return json.loads((Path(preset.local_path) / "config.json").read_text()), f"{preset.local_path}/config.json"
    if not (PRESET_DIR / f"{ref}.yaml").exists():  # a hub id resolve_target read the config of
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(ref).to_dict(), f"hub {ref}"
    candidates = [cache_dir() / preset.name / "config.json"] if preset.embedded else []
    for path in candidates:
        if path.exists():
            return json.loads(path.read_text()), str(path)
    try:
        from transformers import AutoConfig

        return (AutoConfig.from_pretrained(preset.hf_id, revision=preset.revision, local_files_only=True).to_dict(),
                f"local hub cache {preset.hf_id}")
    except (OSError, ValueError):
        pass
    if preset.hf_id not in KNOWN_CONFIGS:
        raise PlanError(f"target {ref!r} (conf/targets/{ref}.yaml, {preset.hf_id}): its config.json is not on this "
                        f"machine and not among the known public configs; pass model=<a directory with its "
                        f"config.json> (presets: {', '.join(list_presets())})")
    return (_hf_config_object(KNOWN_CONFIGS[preset.hf_id]).to_dict(),
            f"public config of {preset.hf_id} (train/plan.py KNOWN_CONFIGS)")


def describe_target(ref: str) -> TargetInfo:
    """The target's config and exact parameter counts, its model instantiated on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    config, source, preset = target_config(ref)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_hf_config_object(config))
    params = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
    from data_prep.capture import decoder_layers

    largest = max(sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model))
    return TargetInfo(name=preset.name, config=config, source=source, params=params, largest_layer_params=largest,
                      # auto: bf16 (2 bytes), the dtype of a GPU and of a CPU with bf16 units
                      dtype_bytes=DTYPE_BYTES.get(str(preset.dtype), 2), tap_layers=list(preset.tap_layers),
                      draft_vocab_size=int(preset.draft_vocab_size), attn_implementation=preset.attn_implementation)


# ------------------------------------------------------------------------------------------- the drafter
@dataclass
class DrafterInfo:
    method: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int  # the target's (the frozen embedding, the teacher's head)
    draft_vocab: int
    n_taps: int
    trainable: int  # parameters the optimizer holds
    frozen: int  # parameters held but not trained (the target embedding; a frozen LM head)
    head_params: int  # lm_head + final norm: ZeRO-3 keeps them gathered (train/engine.py _keep_gathered)
    buffer_bytes: int
    norm_output: bool = False


def describe_drafter(cfg, target: TargetInfo) -> DrafterInfo:
    """The family's drafter (models/registry.py) for this target and cfg.model, on the meta device."""
    import torch

    from models.config import for_trained_length, target_geometry
    from models.registry import family
    from train.build import GEOMETRY_OVERRIDES

    m = cfg.model
    try:
        fam = family(m.method)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if not _unrolls_ttt(fam.objective_cls):
        raise PlanError(f"model.method={m.method}: the plan models the TTT step (eagle3, eagle1); "
                        f"{m.method}'s own training step is not modelled")
    overrides = {k: getattr(m, k) for k in GEOMETRY_OVERRIDES if getattr(m, k) is not None}
    # model.draft_vocab_size: None = the prep's (the preset's default), <= 0 = the whole vocabulary
    vocab = target_geometry(target.config)["vocab_size"]
    vd = target.draft_vocab_size if m.draft_vocab_size is None else (m.draft_vocab_size if m.draft_vocab_size > 0 else vocab)
    taps = list(m.tap_layers or target.tap_layers)
    wanted = {"draft_vocab_size": min(vd, vocab), "tap_layers": taps,
              "fc_norm": m.fc_norm, "norm_output": m.norm_output}
    # the keywords this family's config takes (its from_target_config's own, or its dataclass fields)
    accepted = set(inspect.signature(fam.config_cls.from_target_config).parameters) | set(
        fam.config_cls.__dataclass_fields__)
    fields_ = {k: v for k, v in wanted.items() if k in accepted}
    dcfg = fam.config_cls.from_target_config(target.config, **fields_, **overrides)
    dcfg = for_trained_length(dcfg, cfg.data.max_len, m.max_position_embeddings)
    with torch.device("meta"):
        drafter = fam.drafter_cls(dcfg)
    named = dict(drafter.named_parameters())
    frozen_names = set(fam.frozen_keys) | ({"lm_head.weight"} if m.freeze_lm_head else set())
    trainable = sum(p.numel() for n, p in named.items() if n not in frozen_names and p.requires_grad)
    frozen = sum(p.numel() for n, p in named.items() if n in frozen_names or not p.requires_grad)
    head = sum(p.numel() for n, p in named.items() if n.startswith(("lm_head.", "norm.")))
    buffers = sum(b.numel() * b.element_size() for b in drafter.buffers())
    geo = target_geometry(target.config)
    heads = dcfg.num_attention_heads
    return DrafterInfo(
        method=m.method, hidden=dcfg.hidden_size, heads=heads, kv_heads=dcfg.num_key_value_heads,
        head_dim=dcfg.head_dim or dcfg.hidden_size // heads, intermediate=dcfg.intermediate_size,
        vocab=geo["vocab_size"], draft_vocab=getattr(dcfg, "draft_vocab_size", geo["vocab_size"]),
        n_taps=len(getattr(dcfg, "tap_layers", None) or [0]), trainable=trainable, frozen=frozen,
        head_params=head, buffer_bytes=buffers, norm_output=bool(getattr(dcfg, "norm_output", False)))


def _unrolls_ttt(objective: type) -> bool:
    """Whether a family's objective trains with the TTT unroll of train/ttt.py (what the plan models)."""
    import sys

    module = sys.modules[objective.__module__]
    return getattr(module, "unroll_terms", None) is not None or getattr(module, "ttt_loss", None) is not None


# ------------------------------------------------------------------------------------------- the plan
@dataclass
class Settings:
    """What the plan needs of a run, resolved (see `settings_from_run`)."""

    context: int  # tokens per sample (data.max_len unless given)
    world_size: int
    zero_stage: int
    precision: str  # bf16 | fp32
    device: str  # cuda | cpu
    attn_backend: str  # resolved
    ttt_steps: int
    chunk_size: int
    checkpoint_layer: bool
    samples_per_rank: int  # data.batch_size / data-parallel ranks
    sequence_parallel: int
    placement: str  # none (offline) | replicate | zero3 | tp
    tp_size: int
    reduce_bucket: int
    teacher_cache_mb: int = 1024  # train/ttt.py TTTSettings.teacher_cache_mb
    loss_fraction: float = 1.0  # share of tokens that are loss targets (upper bound 1)
    optimizer: str = "deepspeed"  # deepspeed (train/engine.py) | torch (a plain AdamW on the module, bench scripts)
    runtime_mb: float | None = None  # None: CPU_RUNTIME_MB on cpu, 0 on cuda
    head_tied: bool | None = None  # the frozen head's LM head shares the embedding; None: the target config says
    # a process's first step (a one-step benchmark): the optimizer state does not exist yet at its peak
    first_step: bool = False

    @property
    def tokens(self) -> int:
        """Tokens one rank holds per micro-step."""
        return self.samples_per_rank * math.ceil(self.context / self.sequence_parallel)


def settings_from_run(cfg, world_size: int = 1, context: int | None = None, device: str = "cuda",
                      tp_size: int | None = None, **extra: Any) -> Settings:
    """A run config's (train.config.RunConfig) settings for the plan; `context` None = data.max_len."""
    from models.attention import resolve_backend

    d, t, ds = cfg.data, cfg.train, cfg.deepspeed
    if device not in ("cuda", "cpu"):
        raise PlanError(f"device={device!r} is not one of ['cuda', 'cpu']")
    if world_size < 1 or world_size % ds.sequence_parallel_size:
        raise PlanError(f"world_size={world_size} must be >= 1 and a multiple of deepspeed.sequence_parallel_size="
                        f"{ds.sequence_parallel_size}")
    dp = world_size // ds.sequence_parallel_size
    if d.batch_size % dp:
        raise PlanError(f"data.batch_size={d.batch_size} must be a multiple of the data-parallel size {dp}")
    # On a CUDA device the plan assumes bf16 support; on a CPU it asks this machine's (infra.precision).
    precision = "bf16" if ds.precision == "auto" and device == "cuda" else resolve_precision(ds.precision, device)
    placement = "none" if d.source in ("offline", "vllm") else d.target_placement  # vllm: the target is served
    if placement not in PLACEMENTS:
        raise PlanError(f"data.target_placement={placement!r} is not one of {list(PLACEMENTS[1:])}")
    tp = tp_size or getattr(d, "target_tp_size", None) or world_size
    try:
        backend = resolve_backend(cfg.model.attn_backend, device)
    except ValueError as e:
        raise PlanError(str(e)) from None
    ctx = int(context or d.max_len)
    if ctx < 2:
        raise PlanError(f"context={ctx} must be >= 2 tokens")
    return Settings(context=ctx, world_size=world_size, zero_stage=ds.zero_stage, precision=precision,
                    device=device, attn_backend=backend, ttt_steps=t.ttt_steps, chunk_size=t.chunk_size,
                    checkpoint_layer=t.checkpoint_layer, samples_per_rank=d.batch_size // dp,
                    sequence_parallel=ds.sequence_parallel_size, placement=placement, tp_size=int(tp),
                    reduce_bucket=ds.reduce_bucket_size, **extra)


@dataclass
class MemoryPlan:
    target: TargetInfo
    drafter: DrafterInfo
    settings: Settings
    rows: dict[str, float]  # bytes per device, by component (the peak's composition)
    phases: dict[str, float]  # bytes of the step's transient at each phase (the peak is the largest)
    device_memory_gb: float | None = None
    max_context: int | None = None  # the longest context that fits device_memory_gb (None: not asked)
    notes: list[str] = field(default_factory=list)
    at_context: float = 0.0  # bytes of one step at exactly the context (`rows`: the run's peak up to it)
    serving: dict | None = None  # data.source=vllm: what a node's devices hold (`serving_layout`)

    @property
    def total(self) -> float:
        return sum(self.rows.values())

    @property
    def fits(self) -> bool | None:
        return None if self.device_memory_gb is None else self.total <= self.device_memory_gb * GiB

    def as_dict(self) -> dict:
        s = self.settings
        return {"target": self.target.name, "target_config": self.target.source, "method": self.drafter.method,
                "context": s.context, "tokens_per_rank": s.tokens, "world_size": s.world_size,
                "zero_stage": s.zero_stage, "precision": s.precision, "device": s.device,
                "attn_backend": s.attn_backend, "placement": s.placement, "ttt_steps": s.ttt_steps,
                "chunk_size": s.chunk_size, "checkpoint_layer": s.checkpoint_layer,
                "drafter_trainable_params": self.drafter.trainable, "target_params": self.target.params,
                "rows_mb": {k: round(v / MiB, 1) for k, v in self.rows.items()},
                "phases_mb": {k: round(v / MiB, 1) for k, v in self.phases.items()},
                "total_mb": round(self.total / MiB, 1), "at_context_mb": round(self.at_context / MiB, 1),
                "device_memory_gb": self.device_memory_gb,
                "fits": self.fits, "max_context": self.max_context, "serving": self.serving}

    def table(self) -> str:
        s, t, dr = self.settings, self.target, self.drafter
        head = (f"memory plan per device: target {t.name} ({t.params / 1e9:.2f}B params, {t.source}); "
                f"{dr.method} drafter H={dr.hidden} I={dr.intermediate} heads {dr.heads}/{dr.kv_heads} "
                f"Vd={dr.draft_vocab} ({dr.trainable / 1e6:.1f}M trained)\n"
                f"context {s.context} x {s.samples_per_rank} sample(s)/rank = {s.tokens} tokens/rank, world {s.world_size}"
                f"{f', sequence parallel {s.sequence_parallel}' if s.sequence_parallel > 1 else ''}, ZeRO-{s.zero_stage}, "
                f"{s.precision}, {s.device}, attention {s.attn_backend}, K={s.ttt_steps}, chunk {s.chunk_size}, "
                f"checkpoint_layer={s.checkpoint_layer}, target placement {s.placement}")
        width = max(len(k) for k in self.rows) + 2
        lines = [head, f"{'component':<{width}}{'GiB':>10}"]
        lines += [f"{k:<{width}}{v / GiB:>10.3f}" for k, v in self.rows.items()]
        lines.append(f"{'total (peak)':<{width}}{self.total / GiB:>10.3f}")
        lines.append("step activations by phase (GiB): " + ", ".join(f"{k} {v / GiB:.3f}" for k, v in self.phases.items()))
        if abs(self.at_context - self.total) > 0.5 * MiB:
            lines.append(f"{'a step at the context':<{width}}{self.at_context / GiB:>10.3f}")
        if self.device_memory_gb is not None:
            lines.append(f"device memory {self.device_memory_gb:g} GiB: {'fits' if self.fits else 'does NOT fit'}")
            lines.append(f"longest context that fits: {self.max_context if self.max_context else 'none'} tokens"
                         f" ({s.samples_per_rank} sample(s)/rank)")
        lines += [f"note: {n}" for n in self.notes]
        if self.serving is not None:
            lines += serving_lines(self.serving)
        return "\n".join(lines)


def _act_bytes(s: Settings) -> int:
    return 2 if s.precision == "bf16" else 4


def drafter_state_bytes(dr: DrafterInfo, s: Settings) -> dict[str, float]:
    """Weights (trained + frozen + buffers), gradients and optimizer state of the drafter on one rank.

    DeepSpeed (train/engine.py: client torch AdamW under deepspeed.initialize) keeps: ZeRO-0 fp32: the module's
    fp32 weights are the masters, fp32 grads, 2 fp32 moments; ZeRO-0 bf16: bf16 weights + grads, an fp32 master
    and an fp32 gradient accumulator per parameter; ZeRO-1/2: the module's full weights, a flat fp32 master
    partition (a copy even in fp32) and fp32 moments of 1/world, gradients full (1) or partitioned (2) plus the
    reduce bucket; ZeRO-3: weights partitioned too, the output head (lm_head + norm) kept gathered, and each
    module's weights gathered while it runs (the embedding, the largest, counted gathered)."""
    n, a, w = dr.trainable, _act_bytes(s), s.world_size
    frozen = dr.frozen * a + dr.buffer_bytes
    if s.optimizer == "torch":  # plain torch AdamW on the module: state in the parameters' dtype
        return {"drafter weights": n * a + frozen, "drafter gradients": n * a, "drafter optimizer": 2 * n * a}
    bucket = min(n, s.reduce_bucket) * a
    if s.zero_stage == 0:
        if a == 4:
            return {"drafter weights": n * 4 + frozen, "drafter gradients": n * 4, "drafter optimizer": 8 * n}
        return {"drafter weights": n * a + frozen, "drafter gradients": n * a + n * 4,
                "drafter optimizer": 4 * n + 8 * n}
    if s.zero_stage in (1, 2):
        grads = n * a + 4 * n / w if s.zero_stage == 1 else 4 * n / w + bucket
        return {"drafter weights": n * a + frozen, "drafter gradients": grads, "drafter optimizer": 12 * n / w}
    # gathered copies beside the partitions (a full buffer even at world 1): the output head, kept gathered, and
    # the embedding while a step runs
    gathered = (dr.head_params + dr.frozen) * a
    return {"drafter weights": (n + dr.frozen) * a / w + gathered + dr.buffer_bytes,
            "drafter gradients": 4 * n / w + bucket, "drafter optimizer": 12 * n / w}


def target_bytes(t: TargetInfo, s: Settings) -> float:
    """The frozen target's weights on one rank (offline: none)."""
    full = t.params * t.dtype_bytes
    if s.placement == "none":
        return 0.0
    if s.placement == "replicate":
        return float(full)
    if s.placement == "zero3":
        return full / s.world_size + t.largest_layer_params * t.dtype_bytes * (1 - 1 / s.world_size)
    return full / s.tp_size


def target_forward_bytes(t: TargetInfo, dr: DrafterInfo, s: Settings) -> float:
    """Working set of the online capture forward (data_prep.capture): the kept tap and last-layer outputs, one
    decoder layer's activations (MoE: the active experts' intermediates), eager attention's T x T scores."""
    if s.placement == "none":
        return 0.0
    from models.config import target_geometry

    g = target_geometry(t.config)
    cfg = t.config.get("text_config", t.config)
    tp = s.tp_size if s.placement == "tp" else 1
    T, H, a = s.tokens * tp, g["hidden_size"], t.dtype_bytes  # tp: a group runs its ranks' samples together
    hq, hkv = g["num_attention_heads"], g["num_key_value_heads"]
    d = g["head_dim"] or H // hq
    experts = int(cfg.get("num_experts_per_tok") or 0)
    inter = (int(cfg.get("moe_intermediate_size") or g["intermediate_size"]) * experts) if experts else g["intermediate_size"]
    kept = (len(t.tap_layers) + 1) * T * H * a
    layer = T * (6 * H + 2 * (hq * d) / tp + 4 * (hkv * d) / tp + 4 * inter / tp) * a
    if (t.attn_implementation or "sdpa") == "eager":
        layer += 2 * (hq / tp) * s.context ** 2 * max(a, 4) * s.samples_per_rank * tp  # scores + probabilities
    return kept + layer


def _attention_bytes(dr: DrafterInfo, s: Settings, T: int, k: int, saved: bool) -> float:
    """The attention's own tensors at TTT step k (0-based) for T tokens: what it saves for backward (`saved`) or
    its transient (the recomputed or no-grad forward)."""
    a, hq, d = _act_bytes(s), dr.heads, dr.head_dim
    f32 = 4
    if s.attn_backend in ("fused", "flash"):
        # kernel out0 + lse0, the merge weights (1 + k per head) and the fp32 merged output (models/attention.py)
        saved_b = T * (hq * d * a + hq * f32 + hq * (1 + k) * f32 + hq * d * a)
        temp = T * (hq * d * f32 * (2 if a != 4 else 1) + hq * (1 + k) * f32 * 2 + k * hq * f32)
        return saved_b if saved else saved_b + temp
    if s.attn_backend == "flex":
        return T * (hq * d * a + hq * f32) * (1 if saved else 2)
    if s.attn_backend == "chunked":
        block = min(512, T)
        scores = hq * block * (T + k * block) * f32 * 2  # one block's scores and probabilities
        return T * hq * d * a + (0 if saved else scores)
    # reference: the dense (T, (k+1) T) scores, saved for the softmax backward
    return hq * T * (k + 1) * T * f32 * 2 + (0 if saved else hq * T * (k + 1) * T * f32)


def _norm_bytes(width: int, a: int) -> int:
    """What models/layers.py RMSNorm keeps for its backward per token: the fp32 copy of a bf16 input and the
    normalised rows in the activation dtype (in fp32 the input itself is the copy)."""
    return width * ((4 if a != 4 else 0) + a)


def _layer_tensors(dr: DrafterInfo, s: Settings, T: int) -> float:
    """One drafter step's layer tensors (models/eagle3.py Eagle3DecoderLayer) kept for its backward, besides the
    attention core's own: the two input norms, their concat (q/k/v_proj's input), the RoPE'd queries, the step's
    keys and values, the post-attention norm and its output, and the MLP's gate, up, activation and product."""
    H, inter, a = dr.hidden, dr.intermediate, _act_bytes(s)
    q, kv = dr.heads * dr.head_dim, dr.kv_heads * dr.head_dim
    per_token = 3 * _norm_bytes(H, a) + a * (2 * H + q + 2 * kv + H + 4 * inter)
    return T * per_token


def _layer_grads(dr: DrafterInfo, s: Settings, T: int) -> float:
    """The backward's largest simultaneous gradients in one layer: the MLP's (the product's, the activation's
    and up's) and the residual stream's."""
    return T * _act_bytes(s) * (3 * dr.intermediate + 2 * dr.hidden)


def teacher_chunk_bytes(V: int, Vd: int, c: int, a: int) -> int:
    """The exact teacher of c rows (train/loss.py draft_logits, DraftLogits.target): the full-vocab logits in fp32
    (after the head's own output in the activation dtype), logsumexp's [c, V] temporary beside them and the draft
    columns; then the columns, p_tilde, p_draft and their temporary."""
    return c * max(V * (a + 4), V * 8 + Vd * 4, Vd * 16)


def step_bytes(dr: DrafterInfo, s: Settings) -> tuple[dict[str, float], dict[str, float]]:
    """({component: bytes} live at the TTT step's peak, {phase: transient bytes}) for one rank's micro-batch."""
    T = s.tokens
    N = max(1, int(T * s.loss_fraction))
    K, H, a, V, Vd = s.ttt_steps, dr.hidden, _act_bytes(s), dr.vocab, dr.draft_vocab
    kv = dr.kv_heads * dr.head_dim
    c = min(s.chunk_size, N)
    batch = T * (dr.n_taps * H * a + H * a + 8 + 2)  # taps, the hidden teacher, ids, masks
    # kept for backward per step: checkpointed, the layer input and the K/V it appends to the cache; else every
    # layer tensor and the attention's saved tensors
    per_step = []
    for k in range(K):
        if s.checkpoint_layer:
            per_step.append(T * (H + 2 * kv) * a)
        else:
            per_step.append(_layer_tensors(dr, s, T) + _attention_bytes(dr, s, T, k, saved=True))
    unroll = sum(per_step) + T * H * a  # + fc's output (the step-0 stream)
    rows = K * N * H * a  # each step's outputs at the loss rows
    cached_targets = N * Vd * 8 if N * Vd * 8 <= s.teacher_cache_mb * MiB else 0  # p_tilde + p_draft, fp32
    # the fused head per chunk of c rows (train/loss.py _head_pass): the teacher's full-vocab logits (and their fp32
    # copy) with their draft columns, unless kept; then per step the chunk's target, the fp32 logits and log q (q,
    # then the logits' gradient, in place; its bf16 copy), the head-gradient product; normed rows and their grads
    chunk_teacher = 0 if cached_targets else teacher_chunk_bytes(V, Vd, c, a)
    chunk_step = (0 if cached_targets else c * Vd * 8) + c * Vd * (8 + (a if a != 4 else 0)) + Vd * H * 4
    chunk = max(chunk_teacher, chunk_step) + 2 * K * c * H * a
    grad_w = Vd * H * 4  # the fp32 head-gradient accumulator
    # the loss pass: the rows list, their stack and the gradient w.r.t. them, the head gradient, one chunk
    loss_phase = unroll + rows * 3 + grad_w + cached_targets + chunk
    # the backward: the last step's layer recomputed (checkpointed) and its gradients, the saved loss gradients
    # (its attention's saved tensors; the forward's own temporaries are gone by then)
    att = _attention_bytes(dr, s, T, K - 1, saved=True)
    recompute = _layer_tensors(dr, s, T) + att if s.checkpoint_layer else 0
    bwd_phase = unroll + rows + grad_w + recompute + _layer_grads(dr, s, T)
    phases = {"loss pass": loss_phase, "backward": bwd_phase}
    if cached_targets:  # the count pass (count_valid) forms them chunk by chunk before the unroll
        phases["teacher targets"] = cached_targets - c * Vd * 8 + teacher_chunk_bytes(V, Vd, c, a)
    return {"batch (taps, teacher, ids)": batch, "TTT step activations": max(phases.values())}, phases


def components(target: TargetInfo, drafter: DrafterInfo, s: Settings) -> tuple[dict[str, float], dict[str, float]]:
    runtime = s.runtime_mb if s.runtime_mb is not None else (CPU_RUNTIME_MB if s.device == "cpu" else 0.0)
    rows: dict[str, float] = {"runtime": runtime * MiB, "target weights": target_bytes(target, s)}
    rows.update(drafter_state_bytes(drafter, s))
    if s.first_step:
        rows["drafter optimizer"] = 0.0
    tied = target.config.get("tie_word_embeddings") if s.head_tied is None else s.head_tied
    head_bytes = drafter.vocab * drafter.hidden * _act_bytes(s) * (1 if tied else 2)
    rows["target head (frozen)"] = head_bytes + drafter.hidden * _act_bytes(s)
    step, phases = step_bytes(drafter, s)
    rows.update(step)
    fwd = target_forward_bytes(target, drafter, s)
    if s.placement != "none":  # the capture hooks hold the last forward's tap and last-layer outputs
        tp = s.tp_size if s.placement == "tp" else 1
        rows["target capture outputs"] = (len(target.tap_layers) + 1) * s.tokens * tp * drafter.hidden * target.dtype_bytes
    if fwd:  # the capture forward runs before the drafter's step: the larger transient sets the peak
        phases["target forward"] = fwd
        rows["TTT step activations"] = max(rows["TTT step activations"], fwd)
    return rows, phases


def _cached_edge(drafter: DrafterInfo, s: Settings) -> int | None:
    """The longest context below s.context whose loss rows still get their teacher targets kept (train/ttt.py
    count_valid: when they take <= teacher_cache_mb), if s.context's do not: a shorter sample of the run can
    then take more memory than a full-length one."""
    rows = s.teacher_cache_mb * MiB // (drafter.draft_vocab * 8)
    if rows < 1 or s.tokens * s.loss_fraction <= rows:
        return None
    ctx = int(rows / s.loss_fraction) // s.samples_per_rank * s.sequence_parallel
    return ctx if 2 <= ctx < s.context else None


def plan(target: TargetInfo, drafter: DrafterInfo, s: Settings, device_memory_gb: float | None = None,
         search: bool = True) -> MemoryPlan:
    """The per-device plan for these settings; with device_memory_gb also the longest context that fits.

    `rows` are the run's peak over every sample length up to s.context (a run at data.max_len sees shorter
    samples too); `at_context` the bytes of a step at exactly s.context (what one such step measures)."""
    from dataclasses import replace

    rows, phases = components(target, drafter, s)
    at_context = sum(rows.values())
    notes = []
    edge = _cached_edge(drafter, s)
    if edge is not None:
        rows_e, phases_e = components(target, drafter, replace(s, context=edge))
        if sum(rows_e.values()) > at_context:
            rows, phases = rows_e, phases_e
            notes.append(f"the peak is a {edge}-token sample's: up to that length the trainer keeps its teacher "
                         f"targets (train.ttt TTTSettings.teacher_cache_mb={s.teacher_cache_mb})")
    step_phases = [v for k, v in phases.items() if k != "target forward"]
    if (target.attn_implementation or "sdpa") == "eager" and phases.get("target forward", 0) > max(step_phases):
        notes.append("the target's capture forward sets the peak: its attn_implementation=eager keeps T x T scores "
                     "per head (an sdpa/flash forward would not)")
    if s.device == "cuda":
        notes.append("CUDA: the allocator's bytes; the CUDA context and fragmentation come on top (~1-2 GiB)")
    if s.placement == "tp":
        notes.append(f"target placement tp: weights / tp_size ({s.tp_size})")
    p = MemoryPlan(target, drafter, s, rows, phases, device_memory_gb, notes=notes, at_context=at_context)
    if device_memory_gb is not None and search:
        p.max_context = longest_context(target, drafter, s, device_memory_gb)
    return p


def longest_context(target: TargetInfo, drafter: DrafterInfo, s: Settings, device_memory_gb: float,
                    granularity: int = 64) -> int:
    """The longest context (tokens per sample, a multiple of `granularity`) whose plan fits; 0 if none does.
    The plan grows with the context, so a doubling then a bisection finds it."""
    from dataclasses import replace

    def fits(ctx: int) -> bool:
        return plan(target, drafter, replace(s, context=ctx), device_memory_gb, search=False).fits

    if not fits(granularity):
        return 0
    lo, hi = granularity, granularity * 2
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1 << 26:  # 64M tokens: beyond any config
            return lo
    while hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def serving_layout(cfg, target: TargetInfo, world_size: int, nodes: int, device: str,
                   device_memory_gb: float | None) -> dict:
    """data.source=vllm with servers training starts: what each device of a node holds. The node's training ranks
    (world_size / nodes) take its first devices, then data.vllm_servers_per_node servers take
    vllm.tensor_parallel_size x pipeline_parallel_size devices each (train/served.py); a server's device holds
    its share of the target's weights (in the target's dtype; a quantized checkpoint holds less) and, up to vLLM's
    gpu_memory_utilization of the device, its activations and KV cache."""
    v, d = cfg.vllm, cfg.data
    if world_size % nodes:
        raise PlanError(f"world_size={world_size} is not a multiple of nodes={nodes}")
    ranks = world_size // nodes
    group = v.tensor_parallel_size * v.pipeline_parallel_size
    share = float(v.engine_kwargs.get("gpu_memory_utilization", 0.9))  # vLLM's default
    weights = target.params * target.dtype_bytes / group
    servers = [{"server": i, "devices": list(range(ranks + i * group, ranks + (i + 1) * group)),
                "weights_gib": weights / GiB,
                "kv_cache_gib": None if device_memory_gb is None else share * device_memory_gb - weights / GiB}
               for i in range(d.vllm_servers_per_node)]
    return {"nodes": nodes, "devices_per_node": ranks + group * d.vllm_servers_per_node, "training_ranks": ranks,
            "device": device, "gpu_memory_utilization": share, "tensor_parallel_size": v.tensor_parallel_size,
            "pipeline_parallel_size": v.pipeline_parallel_size, "servers": servers,
            "fits": None if device_memory_gb is None else all(x["kv_cache_gib"] > 0 for x in servers)}


def serving_lines(layout: dict) -> list[str]:
    r = layout["training_ranks"]
    lines = [f"serving layout (data.source=vllm), each of {layout['nodes']} node(s), {layout['devices_per_node']} "
             f"devices: devices 0-{r - 1} the training ranks above (no target), then per server "
             f"{layout['tensor_parallel_size']} x {layout['pipeline_parallel_size']} devices (tensor x pipeline)"]
    for x in layout["servers"]:
        kv = ("" if x["kv_cache_gib"] is None else
              f", {x['kv_cache_gib']:.1f} GiB left for activations and KV cache at gpu_memory_utilization "
              f"{layout['gpu_memory_utilization']:g}" if x["kv_cache_gib"] > 0 else
              f": does NOT fit at gpu_memory_utilization {layout['gpu_memory_utilization']:g}: raise "
              "vllm.tensor_parallel_size")
        lines.append(f"  vLLM server {x['server']}: devices {x['devices'][0]}-{x['devices'][-1]}, target weights "
                     f"{x['weights_gib']:.1f} GiB per device{kv}")
    if layout["device"] == "cpu":
        lines.append("  on a machine without devices the servers share the CPU with the training ranks")
    return lines


def plan_run(cfg, target: str, world_size: int = 1, context: int | None = None,
             device_memory_gb: float | None = None, device: str = "cuda", tp_size: int | None = None,
             describe: Callable[[str], TargetInfo] = describe_target, nodes: int = 1, **extra: Any) -> MemoryPlan:
    """The plan of a training run config (train.config.RunConfig) on `target` (a preset, a directory or a hub id);
    with data.source=vllm and servers started by training, also what each of the `nodes` nodes' devices hold."""
    s = settings_from_run(cfg, world_size, context, device, tp_size, **extra)
    t = describe(target)
    p = plan(t, describe_drafter(cfg, t), s, device_memory_gb)
    if cfg.data.source == "vllm" and not cfg.vllm.urls:
        p.serving = serving_layout(cfg, t, world_size, nodes, device, device_memory_gb)
    return p
