"""The DeepSpeed wrapper: the ONLY module of the project that imports deepspeed.

Shape of SpecForge's TrainingBackend: `prepare` (model -> DeepSpeed engine with client AdamW and a
cosine-with-warmup schedule), `backward`, `step` (-> True at an accumulation boundary, i.e. when an
optimizer step happened), and a *portable* state for save/load: `portable_state()` (consolidated full
fp32 parameters + full Adam moments + scheduler, independent of ZeRO stage and world size; written by
train/checkpoint.py) and `prepare(model, state=...)` to load it. The trainer never touches DeepSpeed.

Why a portable state instead of DeepSpeed's own checkpoint: DeepSpeed's checkpoint stores per-rank
partitions and resumes only at the same world size. The safe_get/set_full_* utilities work under
ZeRO 1/2/3 and the bf16 optimizer, so the full state can be written once and re-sharded on load.

Exactness on load (bf16 included): the fp32 values are copied into the module BEFORE
deepspeed.initialize, so the low-precision copies DeepSpeed makes are exactly bf16(fp32 master), as
after any optimizer step; the fp32 masters and Adam moments are then set through safe_set_full_*.

Where this file reaches past DeepSpeed's public API (pinned by tests/test_train_distributed.py):
- `_materialise_adam_state`: torch creates Adam's state lazily at the first step, so a load first
  creates it (zeros + step count) in the inner torch optimizer, then sets it through safe_set_*;
- `_master`: ZeRO-0 + bf16 keeps per-parameter fp32 copies that safe_get/set_* do not map;
- `_keep_gathered`: ZeRO-3 parameter persistence for the output head (see its docstring);
- `init_distributed`: marks DeepSpeed's CPU shared-memory comm op unavailable (avoids a ~50 s JIT build).

Sequence parallelism (train/sequence_parallel.py) takes DeepSpeed Ulysses' all-to-all attention from here
(`ulysses_attention`). DeepSpeed itself is not told about the sequence-parallel groups: it treats every
rank as data parallel and averages gradients over all of them, which with the trainer's loss * world
scaling is the sum over ranks that a sequence split over ranks needs (each rank's gradient is its share).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from infra.precision import resolve_precision
from infra.processes import free_port
from train.config import DeepSpeedConfig, TrainConfig

# DeepSpeed 0.19 calls collectives that torch 2.13 deprecates; the warning would repeat on every step.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


# ----------------------------------------------------------------------------------------- process group
def dist_backend(name: str) -> str:
    if name != "auto":
        return name
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str = "auto", cpu_shm_comm: bool = False) -> tuple[int, int]:
    """Create the process group once per process (a sweep reuses it across jobs); -> (rank, world size).

    Without torchrun (plain `python launch/train.py`) this is a 1-process group on a free local port.
    """
    import deepspeed

    if not torch.distributed.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        # The op probe below compiles test programs and logs each compiler call at INFO.
        logging.getLogger("compilers.C.base").setLevel(logging.WARNING)
        if not cpu_shm_comm and not torch.cuda.is_available():
            # The shm all-reduce op is JIT-compiled (~50 s) on first use; gloo is enough here. DeepSpeed
            # decides op availability from this cached dict (its comment: edits to it persist), and
            # TorchBackend skips the op when it is marked incompatible.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        backend = dist_backend(backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


def shutdown_distributed() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def ulysses_attention(local_attention: Callable[..., Tensor], group: Any) -> Callable[..., Tensor]:
    """DeepSpeed Ulysses (deepspeed.sequence.layer.DistributedAttention) around `local_attention`.

    The result is called as fn(q, k, v, **kwargs) with q/k/v (B, S/P, H, D) sharded by sequence over the P
    ranks of `group` (rank r holds positions r*S/P..); it all-to-alls them to (B, S, H/P, D), the whole
    sequence for rank r's heads r*H/P.. (contiguous blocks, so a GQA query head keeps its kv head when P
    divides the kv head count), calls local_attention(q, k, v, **kwargs) on those and all-to-alls the
    output back to (B, S/P, H, D). Backward runs the reverse all-to-alls: a collective, every rank of
    `group` must run the same forward and backward.
    """
    from deepspeed.sequence.layer import DistributedAttention

    # scatter heads (dim 2), gather sequence (dim 1); batch dim 0; RoPE is applied by the model beforehand.
    attention = DistributedAttention(local_attention, group, scatter_idx=2, gather_idx=1)
    return functools.partial(attention, batch_dim_idx=0)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def lr_lambda(step: int, warmup: int, total: int, min_ratio: float, kind: str = "cosine",
              decay_ratio: float = 0.2) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based): linear warmup, then `kind`:
    cosine to min_ratio at the last step, or wsd: constant until the last decay_ratio of the steps, then
    linear to min_ratio at the last step (train.schedule)."""
    if step < warmup:
        return (step + 1) / warmup
    last = max(total - 1, warmup)
    if kind == "wsd":
        decay_start = max(warmup, total - max(1, round(decay_ratio * total)))
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / max(1, last - decay_start))
        return 1.0 - (1.0 - min_ratio) * progress
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class _Schedule:  # a picklable lr lambda (LambdaLR keeps callable objects' __dict__ in its state)
    warmup: int
    total: int
    min_ratio: float
    kind: str = "cosine"
    decay_ratio: float = 0.2

    def __call__(self, step: int) -> float:
        return lr_lambda(step, self.warmup, self.total, self.min_ratio, self.kind, self.decay_ratio)


def partition_frozen(module: nn.Module, ds_cfg: DeepSpeedConfig) -> Any:
    """ZeRO-3 inference for a frozen module (data.target_placement=zero3: the online target): DeepSpeed's engine
    without an optimizer partitions its weights over the ranks and gathers each layer's for its forward, on this
    rank's device. Every rank must run every forward (train/online.py keeps their number equal). The module keeps
    its dtype; DeepSpeed's hooks on it do the gathering. Returns the DeepSpeed engine, which the caller must keep:
    a collected engine removes those hooks (DeepSpeedEngine.__del__)."""
    import deepspeed

    config = _frozen_config(next(module.parameters()).dtype, ds_cfg)
    engine, *_ = deepspeed.initialize(model=module.to(device()), config=config, dist_init_required=False)
    engine.eval()
    return engine


def _frozen_config(dtype: torch.dtype, ds_cfg: DeepSpeedConfig) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0,
                              "stage3_param_persistence_threshold": ds_cfg.stage3_param_persistence_threshold},
        "bf16": {"enabled": dtype == torch.bfloat16},  # DeepSpeed checks the params' dtype; buffers stay as they are
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 1 << 30,
    }


@contextlib.contextmanager
def partitioned_at_load(dtype: torch.dtype, ds_cfg: DeepSpeedConfig) -> Iterator[None]:
    """Inside, transformers' from_pretrained builds the model under deepspeed.zero.Init and loads its checkpoint
    straight into ZeRO-3 partitioned parameters (its DeepSpeed integration: an HfDeepSpeedConfig with a stage-3
    config, alive while it loads), so no rank ever holds the whole target; `partition_frozen` then wraps it. The
    config is dropped on exit: later from_pretrained calls load whole copies again."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    alive = HfDeepSpeedConfig(_frozen_config(dtype, ds_cfg))  # transformers keeps only a weak reference
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del alive


def release_freed_memory() -> None:
    """Hand the pages the heap keeps after frees back to the system (glibc's malloc_trim; nothing elsewhere).
    Loading a target builds and drops many temporaries (ZeRO-3 builds each layer whole, then partitions it, then
    gathers and re-partitions it to copy the checkpoint in): their freed chunks stay resident in the allocator's
    arenas, counted in the process's RSS for the whole run, unless trimmed once the load is done."""
    import ctypes
    import gc

    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


@contextlib.contextmanager
def gathered(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """ZeRO-3 partitioned parameters whole inside (a collective); plain tensors pass through."""
    import deepspeed

    partitioned = [p for p in params if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None) if partitioned else contextlib.nullcontext():
        yield


def full_shape(param: Tensor) -> torch.Size:
    """A parameter's shape, also when ZeRO-3 partitioned it (its local tensor is then empty)."""
    return getattr(param, "ds_shape", param.shape)


# ----------------------------------------------------------------------------------------- the engine
class Engine:
    def __init__(self, ds_cfg: DeepSpeedConfig, train_cfg: TrainConfig, total_steps: int):
        self.ds_cfg, self.train_cfg, self.total_steps = ds_cfg, train_cfg, total_steps
        self.device = device()
        self.precision = resolve_precision(ds_cfg.precision, self.device)
        self.dtype = torch.bfloat16 if self.precision == "bf16" else torch.float32
        self.rank, self.world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
        self.ds = None

    def ds_config(self) -> dict:
        c, t = self.ds_cfg, self.train_cfg
        zero: dict = {"stage": c.zero_stage, "reduce_bucket_size": c.reduce_bucket_size}
        if c.zero_stage == 3:
            zero.update(
                stage3_prefetch_bucket_size=c.stage3_prefetch_bucket_size,
                stage3_max_reuse_distance=c.stage3_max_reuse_distance,
                stage3_param_persistence_threshold=c.stage3_param_persistence_threshold,
            )
        cfg = {
            # The trainer feeds micro-batches itself; DeepSpeed only needs a consistent product.
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": t.grad_accum,
            "gradient_clipping": t.clip,
            "zero_optimization": zero,
            "bf16": {"enabled": self.precision == "bf16"},
            "zero_allow_untested_optimizer": True,  # client torch AdamW: no CPU-Adam JIT build
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }
        return _deep_merge(cfg, dict(c.extra))

    def prepare(
        self, model: nn.Module, state: dict | None = None, keep_gathered: Sequence[str] = ()
    ) -> nn.Module:
        """Wrap `model`; trainable = requires_grad params only (the frozen target embedding stays out of
        the optimizer). `state` (from `portable_state`) restores params, Adam and the schedule exactly.
        `keep_gathered`: sub-modules called a data-dependent number of times per step (ZeRO-3)."""
        import deepspeed

        t = self.train_cfg
        if state is not None:
            _copy_params_into(model, state["params"])
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=t.weight_decay
        )
        schedule = _Schedule(t.warmup(self.total_steps), self.total_steps, t.min_lr_ratio, t.schedule, t.decay_ratio)
        # bf16 casts the whole module, buffers included; derived fp32 buffers (RoPE inv_freq) must stay fp32.
        float_buffers = {n: b.detach().clone() for n, b in model.named_buffers() if b.is_floating_point()}
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            config=self.ds_config(),
            dist_init_required=False,
        )
        for name, value in float_buffers.items():
            owner, _, leaf = name.rpartition(".")
            setattr(self.ds.module.get_submodule(owner), leaf, value.to(self.device))
        self._keep_gathered(keep_gathered)
        if state is not None:
            self._load_state(state)
        return self.ds.module

    def _keep_gathered(self, module_names: Sequence[str]) -> None:
        """ZeRO-3 all-gathers a module's parameters at each call and releases them after it; each gather is
        a collective, so every rank must call every module equally often. The loss calls the output head
        (norm + lm_head) once per chunk of loss positions, a count that depends on each rank's data. So
        those parameters are gathered once here and kept: persistent (DeepSpeed re-gathers persistent
        parameters after each optimizer step) and flagged external (its module hooks never release
        them). Their gradients and optimizer state stay partitioned."""
        if self.ds_cfg.zero_stage != 3 or not module_names:
            return
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        params = [p for n in module_names for p in self.ds.module.get_submodule(n).parameters()]
        persistent = self.optimizer.persistent_parameters
        for p in params:
            p.ds_persist = True
            p.is_external_param = True
            if not any(p is q for q in persistent):
                persistent.append(p)
        params[0].all_gather([p for p in params if p.ds_status == ZeroParamStatus.NOT_AVAILABLE])

    @property
    def module(self) -> nn.Module:
        return self.ds.module

    def backward(self, loss: Tensor) -> None:
        self.ds.backward(loss)

    def step(self) -> bool:
        """One micro-step of the engine; True when it was an accumulation boundary (optimizer stepped)."""
        boundary = self.ds.is_gradient_accumulation_boundary()
        self.ds.step()
        return boundary

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @property
    def grad_norm(self) -> float | None:
        norm = self.ds.get_global_grad_norm()
        return None if norm is None else float(norm)

    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()

    def destroy(self) -> None:
        if self.ds is not None:
            self.ds.destroy()
            self.ds = None

    # ---------------------------------------------------------------- portable state
    def _trainable(self) -> Iterator[tuple[str, nn.Parameter]]:
        wanted = set(self.names)
        for name, p in self.ds.module.named_parameters():
            if name in wanted:
                yield name, p

    def full_params(self, all_ranks: bool = False) -> dict[str, Tensor]:
        """Full fp32 trainable parameters as CPU tensors. COLLECTIVE under ZeRO: every rank must call;
        only rank 0 (or every rank with all_ranks) gets the values, the others an empty dict."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        for name, p in self._trainable():
            full = safe_get_full_fp32_param(p) if not _is_plain(p) else self._master(p)
            if all_ranks or self.rank == 0:
                out[name] = full.detach().float().cpu().clone()
        return out

    def portable_state(self) -> dict:
        """Everything to resume the optimisation at any world size, as CPU tensors. COLLECTIVE: every rank
        must call; the tensors are filled on rank 0 only."""
        from deepspeed.utils import safe_get_full_optimizer_state

        inner = self._inner_optimizer()
        moments: dict[str, dict[str, Tensor]] = {k: {} for k in ADAM_KEYS}
        started = any(inner.state.values())
        for name, p in self._trainable():
            for key in ADAM_KEYS:
                if not started:
                    value = torch.zeros(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
                elif _is_plain(p):
                    value = inner.state[self._master(p)][key]
                else:
                    value = safe_get_full_optimizer_state(p, key)
                if self.rank == 0:
                    moments[key][name] = value.float().cpu().clone()
        steps = [float(s["step"]) for s in inner.state.values() if "step" in s]
        sched = self.scheduler.state_dict()
        sched.pop("lr_lambdas", None)
        return {
            "params": self.full_params(),
            **moments,
            "adam_step": int(max(steps)) if steps else 0,
            "scheduler": sched,
        }

    def _master(self, p: nn.Parameter) -> Tensor:
        """The fp32 master of a parameter DeepSpeed does not map itself (ZeRO-0: p itself, or the bf16
        wrapper's per-parameter fp32 copy in `fp32_groups`)."""
        opt = self.optimizer
        if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):
            for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups):
                for lp, hp in zip(lp_group, hp_group):
                    if lp is p:
                        return hp
        return p

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        opt = self.optimizer
        # ZeRO / bf16 wrappers hold the torch optimizer (over flat fp32 partitions) as `.optimizer`.
        return opt.optimizer if hasattr(opt, "optimizer") else opt

    def _load_state(self, state: dict) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        self._materialise_adam_state(state["adam_step"])
        inner = self._inner_optimizer()
        missing = set(self.names) - set(state["params"])
        if missing:
            raise KeyError(f"checkpoint lacks trainable parameters {sorted(missing)}")
        for name, p in self._trainable():
            if _is_plain(p):  # no ZeRO: the module parameter or a per-parameter fp32 copy is the master
                master = self._master(p)
                with torch.no_grad():
                    master.copy_(state["params"][name].view_as(master))
                for key in ADAM_KEYS:
                    inner.state[master][key].copy_(state[key][name].view_as(master))
                continue
            safe_set_full_fp32_param(p, state["params"][name].to(self.device))
            for key in ADAM_KEYS:
                safe_set_full_optimizer_state(p, state[key][name].to(self.device), key)
        sched = dict(state["scheduler"])
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **sched})
        # LambdaLR.load_state_dict restores its counters but not the optimizer's current lr.
        for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

    def _materialise_adam_state(self, step: int) -> None:
        inner = self._inner_optimizer()
        flats = [p for group in inner.param_groups for p in group["params"]]
        # ZeRO-3 keeps its flat fp32 partitions out of param_groups between steps.
        flats += list(getattr(self.optimizer, "fp32_partitioned_groups_flat", []))
        for p in flats:
            inner.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        # ZeRO-1/2 and the bf16 optimizer link per-parameter views of the state after the first step.
        link = getattr(self.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            self.optimizer._hp_optimizer_states_linked = False
            link()


def _is_plain(p: nn.Parameter) -> bool:
    return not hasattr(p, "ds_id") and not hasattr(p, "_hp_mapping")


def _copy_params_into(model: nn.Module, params: dict[str, Tensor]) -> None:
    own = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in params.items():
            if name not in own:
                raise KeyError(f"checkpoint parameter {name!r} is not in the model")
            own[name].copy_(value.view_as(own[name]))


def _deep_merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
