#!/usr/bin/env python
"""Peer baseline: the public SpecForge package's OWN EAGLE-3 drafter, TTT loop and loss, trained on OUR prep
with OUR batches and schedule, exported in OUR layout and scored by OUR held-out evaluator.

Two halves, two interpreters (SpecForge pins its own dependencies, so it never enters .venv):

    # 1. train: the ignored venv .venv-specforge with specforge==0.2.0 (`make specforge-venv`; `make bench-peer`)
    .venv-specforge/bin/python bench/peer_specforge.py train --prep <prep> --out <peer dir> \
        --exp eagle3_demo --save-every 43 [--steps N] [--threads 1]
    # 2. eval: our .venv; every export of the peer run (and optionally our run's evals beside it)
    .venv/bin/python bench/peer_specforge.py eval --prep <prep> --peer <peer dir> --exp eagle3_demo \
        [--ours <our run dir>] [--drafter label=<export dir> ...]
    # the step alone, on synthetic inputs (bench/train_step.py synthetic --specforge-python runs it per length)
    .venv-specforge/bin/python bench/peer_specforge.py step --seq-len 2048 [--geometry embedded --dtype bf16]

`train` composes OUR training config (conf/train.yaml + `+exp=<exp>` + `--override key=value`), so the
seed, batch size, data.max_len, epochs, lr, warmup, lr schedule (train.schedule, min_lr_ratio), betas, eps, weight
decay, clip, K and λ are the ones `launch/train.py` would use. It reads the prep's train split through
`train.data.ShardBatches` (world size 1): the same global batches in the same order as our trainer. What
runs on them is SpecForge's: `LlamaForCausalLMEagle3` (built by `AutoDraftModel.from_config`, its own
init), `OnlineEagle3Model` (TTT K), `Eagle3TrainStrategy` (offline `target_repr="hidden_state"`: its
`TargetHead.preprocess` shift and frozen `TargetHead`), its KL loss (`specforge.core.loss._compute_loss`,
the package's pure-torch reference of the Triton kernel that cannot run on a CPU), and its `BF16Optimizer`
(AdamW over fp32 masters, clip) or torch AdamW (`--optimizer adamw`). Only the lr schedule and Adam's
betas/eps are replaced by ours (SpecForge's own: cosine with warmup_ratio, betas (0.9, 0.999)). Params are in
our run's precision by default (`--dtype auto`, as our trainer's deepspeed.precision: bf16 on a GPU or a CPU with
bf16 matrix units, else fp32; `--dtype bf16` is SpecForge's GPU recipe, about 14x slower per step on a CPU without
a bf16 matmul unit).

Mapping our prep onto SpecForge's offline sample (what its `normalize_offline_sample` would hold):
  hidden_state = the shards' taps (the drafter's 3 tap layers, bf16), target = the target's FINAL-NORMED
  last hidden state (our shards keep it before the norm; SpecForge's capture stores SGLang's normed one and
  its TargetHead is the bare lm_head), input_ids, attention_mask = real tokens, loss_mask = the shards'
  assistant mask with each sample's last token cleared (as SpecForge does). SpecForge applies that mask at
  the position whose *input* token it marks, two tokens before the predicted one (`--mask-align specforge`,
  the default: its own convention); `--mask-align ours` shifts the mask so it marks the predicted token,
  i.e. SpecForge then trains exactly the rows our loss trains.

Batching: a global batch of B samples, padded to its longest, is one SpecForge batch (its loss: the
masked KL summed over rows / (B x T_pad), Σ_k λ^k over the TTT steps). `--micro-batch m < B` runs it as
B/m micro-batches (each trimmed to its own longest sample, which changes no number: padding rows carry
no loss and attention is causal) with `--norm batch` weights m·T_m / (B·T_pad), so the gradient is the
batch-of-B one, or `--norm accum` weights m / B, i.e. SpecForge's own `batch_size=m,
accumulation_steps=B/m` (its TrainerCore divides each micro-batch's loss by the accumulation steps).

Outputs in --out (never inside the prep): `train_log.jsonl` (one line per optimizer step: loss, per-step
losses and accuracies as SpecForge reports them, lr, grad norm, step seconds, cumulative training
seconds `wall_s` that exclude set-up and exports, tokens, peak RSS), `exports/step_<N>/` (config.json +
model.safetensors with exactly our export keys: what `launch/eval.py drafter=<dir>`, vLLM and SGLang
load) every --save-every steps and at the last one, `export_check.json` (the final export loaded by
`models.eagle3.load_export` reproduces SpecForge's own logits for every TTT step on a held-out sample).
`eval` writes `<peer>/peer_eval.jsonl` (held-out acc_k, α_k, sim τ per export: `train.ttt.evaluate` on
the prep's eval split with our eval batches, K and precision, i.e. the numbers our training's held-out
eval logs) and, with --ours, `<peer>/compare.json` + a printed table at equal steps and equal
training wall-clock.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

# Inductor (SpecForge's @torch.compile decorators) forks one compile worker per core by default, and caches
# kernels in torchinductor_<user> of the system temp directory; keep both small and private unless the caller chose otherwise: the cache
# goes to a fresh directory only this user can open (mkdtemp: unpredictable name, mode 0700; a fixed name in the
# shared temp directory could be created first, or linked elsewhere, by another user), removed at exit.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="peer_specforge_inductor.")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the specforge venv has no editable install of this repo
    sys.path.insert(0, str(ROOT))

from infra.processes import peak_rss_mb  # noqa: E402
from infra.strict_json import dumps  # noqa: E402
from train.config import RunConfig  # noqa: E402

EXPORTS = "exports"
TRAIN_LOG = "train_log.jsonl"
EVAL_LOG = "peer_eval.jsonl"


# ------------------------------------------------------------------------------------------ shared
def run_config(prep: Path, exp: str, overrides: list[str]) -> RunConfig:
    """OUR composed training config for `+exp=<exp>` on this prep: the recipe both drafters follow."""
    from hydra import compose, initialize_config_dir

    from train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        raw = compose("train", overrides=[f"+exp={exp}", f"data.dir={prep}", "out_dir=unused", *overrides])
    return RunConfig.from_omegaconf(raw).validate(world_size=1)


def check_supported(cfg: RunConfig) -> None:
    """The peer is SpecForge's plain EAGLE-3: refuse our levers it has no counterpart for, rather than
    silently comparing against a different recipe."""
    m, t = cfg.model, cfg.train
    bad = {
        "model.method": (m.method, "eagle3"),
        "model.lm_head_init": (m.lm_head_init, "random"),
        "model.freeze_lm_head": (m.freeze_lm_head, False),
        "model.norm_init": (m.norm_init, "ones"),
        "model.fc_norm": (m.fc_norm, False),
        "model.norm_output": (m.norm_output, False),
        "train.feature_noise": (t.feature_noise, 0.0),
        "train.grad_accum": (t.grad_accum, 1),
        "data.overflow": (cfg.data.overflow, "truncate"),
    }
    off = {k: v for k, (v, want) in bad.items() if v != want}
    if off:
        raise SystemExit(f"peer_specforge: not supported for the SpecForge peer: {off}")


def tap_choice(cfg: RunConfig, prep: Path, shard_taps: list[int]) -> tuple[list[int], list[int]]:
    """(tap layers the drafter reads, their columns among the shards' taps): Eagle3Objective's rule."""
    from models.config import target_geometry
    from models.eagle3 import default_tap_layers
    from train.batch import tap_columns
    from train.build import target_config

    default = default_tap_layers(target_geometry(target_config(prep))["target_num_layers"])
    wanted = list(cfg.model.tap_layers or (default if set(default) <= set(shard_taps) else shard_taps))
    if len(wanted) != 3:
        raise SystemExit(f"peer_specforge: SpecForge's fc takes exactly 3 taps, the recipe reads {wanted}")
    return wanted, tap_columns(shard_taps, wanted)


def _jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(dumps(record) + "\n")


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------ train (specforge venv)
def import_specforge(compile_on: bool) -> types.SimpleNamespace:
    """The package's classes, with the two CPU workarounds (no package file is touched):

    * `specforge.core.loss` does `import triton` at import time (for its Triton kernel) and the CPU torch
      wheel ships no triton: a do-nothing stand-in is visible only while that one module imports, so
      torch/Inductor keep seeing "no triton".
    * `OnlineEagle3Model` always calls that Triton `LogSoftmaxLoss`, which cannot launch on a CPU; it is
      pointed at the package's own reference `_compute_loss` (same definition: -Σ mask·p·log_softmax,
      mean over all B·T rows).
    """
    import torch._dynamo

    torch._dynamo.config.disable = not compile_on
    try:
        import triton  # noqa: F401
    except ImportError:
        torch.compile(lambda x: x)  # import Inductor for real first: it probes `import triton` itself
        stub, lang = types.ModuleType("triton"), types.ModuleType("triton.language")
        stub.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)
        stub.next_power_of_2 = lambda n: 1 << (int(n) - 1).bit_length()
        lang.constexpr = object
        stub.language = lang
        saved = {k: sys.modules.pop(k) for k in ("triton", "triton.language") if k in sys.modules}
        sys.modules.update({"triton": stub, "triton.language": lang})
        try:
            import specforge.core.loss  # noqa: F401
        finally:
            for k in ("triton", "triton.language"):
                sys.modules.pop(k, None)
            sys.modules.update(saved)

    import specforge.algorithms.eagle3.model as eagle3_model
    import specforge.core.loss as sf_loss
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.target.target_head import TargetHead
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    class ReferenceLoss:  # same call shape as the autograd Function it replaces
        @staticmethod
        def apply(logits: torch.Tensor, target_p: torch.Tensor, position_mask: torch.Tensor) -> torch.Tensor:
            return sf_loss._compute_loss(logits, target_p, position_mask)

    eagle3_model.LogSoftmaxLoss = ReferenceLoss
    return types.SimpleNamespace(
        OnlineEagle3Model=eagle3_model.OnlineEagle3Model, AutoDraftModel=AutoDraftModel, TargetHead=TargetHead,
        BF16Optimizer=BF16Optimizer, TrainBatch=TrainBatch, Eagle3TrainStrategy=Eagle3TrainStrategy,
    )


def specforge_config(ecfg: Any) -> Any:
    """SpecForge's draft config (a transformers LlamaConfig) with the geometry of OUR drafter config."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        architectures=["LlamaForCausalLMEagle3"],
        hidden_size=ecfg.hidden_size,
        num_attention_heads=ecfg.num_attention_heads,
        num_key_value_heads=ecfg.num_key_value_heads,
        head_dim=ecfg.head_dim,
        intermediate_size=ecfg.intermediate_size,
        vocab_size=ecfg.vocab_size,
        num_hidden_layers=1,
        hidden_act=ecfg.hidden_act,
        rms_norm_eps=ecfg.rms_norm_eps,
        max_position_embeddings=ecfg.max_position_embeddings,
        rope_parameters={"rope_type": "default", **(ecfg.rope_scaling or {}), "rope_theta": ecfg.rope_theta},
        tie_word_embeddings=False,
        pretraining_tp=1,
        pad_token_id=None,
    )
    cfg.draft_vocab_size = ecfg.draft_vocab_size
    cfg.target_hidden_size = ecfg.target_hidden_size
    return cfg


def build_peer(sf: types.SimpleNamespace, cfg: RunConfig, prep: Path, taps: list[int], head: Any,
               dtype: torch.dtype, compact_teacher: bool) -> tuple[Any, Any, Any, Any]:
    """(OnlineEagle3Model, its LlamaForCausalLMEagle3, Eagle3TrainStrategy, our Eagle3Config) - the sequence
    of specforge.algorithms.model_providers.build_eagle3_draft, with the target's tensors from our prep."""
    from train.build import draft_vocab, target_config
    from train.eagle3 import eagle3_config

    ecfg = eagle3_config(cfg.model, prep, taps, cfg.data.max_len)
    torch.manual_seed(cfg.train.seed)
    draft = sf.AutoDraftModel.from_config(specforge_config(ecfg), attention_backend="sdpa", torch_dtype=dtype)
    d2t, t2d = draft_vocab(prep, cfg.model.draft_vocab_size)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        draft.embed_tokens.weight.copy_(head.embed_tokens.weight.to(dtype))
    draft.freeze_embedding()
    model = sf.OnlineEagle3Model(draft_model=draft, length=cfg.train.ttt_steps, attention_backend="sdpa").to(dtype)

    # SpecForge's TargetHead reads the target's config.json from a directory; its weight is the lm_head.
    tmp = Path(tempfile.mkdtemp(prefix="peer_sf_target_"))
    try:
        (tmp / "config.json").write_text(dumps(target_config(prep)))
        target_head = sf.TargetHead(str(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    with torch.no_grad():
        target_head.fc.weight.copy_(head.lm_head.weight)
    target_head.freeze_weights()
    target_head = target_head.eval().to(dtype)  # TargetHead.from_pretrained's own cast
    strategy = sf.Eagle3TrainStrategy(model, target_head=target_head, ploss_decay=cfg.train.loss_decay,
                                      compact_teacher=compact_teacher)
    return model, draft, strategy, ecfg


def make_optimizer(sf: types.SimpleNamespace, model: Any, cfg: RunConfig, total: int, kind: str) -> tuple[Any, Any]:
    """(optimizer, torch optimizer inside it) with OUR schedule (train.engine.lr_lambda), betas and eps."""
    from train.engine import lr_lambda

    t = cfg.train
    if kind == "bf16opt":
        opt = sf.BF16Optimizer(model, lr=t.lr, weight_decay=t.weight_decay, max_grad_norm=t.clip,
                               total_steps=total, warmup_ratio=t.warmup(total) / total, lr_scheduler="cosine")
        inner = opt.optimizer
    else:
        inner = opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=t.lr,
                                        weight_decay=t.weight_decay)
    for group in inner.param_groups:  # SpecForge's scheduler already moved lr; restart from the base lr
        group.update(lr=t.lr, initial_lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    schedule = partial(lr_lambda, warmup=t.warmup(total), total=total, min_ratio=t.min_lr_ratio, kind=t.schedule,
                       decay_ratio=t.decay_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, schedule)
    if kind == "bf16opt":
        opt.scheduler = scheduler  # BF16Optimizer.step() steps whatever scheduler it holds
    else:
        opt.peer_scheduler = scheduler
    return opt, inner


def optimizer_step(kind: str, opt: Any, inner: Any, params: list[torch.nn.Parameter], clip: float) -> float:
    """One optimizer step; returns the gradient norm before clipping."""
    if kind == "bf16opt":  # BF16Optimizer.step: clip, fp32-master AdamW, schedule, copy back, clear grads
        return float(opt.step())
    norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    inner.step()
    opt.peer_scheduler.step()
    inner.zero_grad(set_to_none=True)
    return float(norm)


def specforge_mask(loss_mask: torch.Tensor, valid: torch.Tensor, align: str) -> torch.Tensor:
    """Per-sample loss mask as SpecForge's offline sample holds it (see the module docstring)."""
    mask = loss_mask & valid
    if align == "ours":  # mark position t when the token SpecForge predicts there (t + 2) is a loss token
        shifted = torch.zeros_like(mask)
        shifted[:, :-2] = mask[:, 2:]
        mask = shifted
    last = valid.sum(1) - 1  # normalize_offline_sample clears each sample's last token
    mask[torch.arange(mask.shape[0]), last.clamp_min(0)] = False
    return mask.long()


def micro_batches(batch: Any, m: int, columns: list[int], n_src: int, head: Any, dtype: torch.dtype,
                  align: str, sf: types.SimpleNamespace) -> Iterator[tuple[Any, int, int]]:
    """SpecForge TrainBatches of m samples from one of our global batches: (batch, samples, padded length)."""
    batch = batch.select_taps(columns, n_src)
    for s in range(0, len(batch), m):
        valid = batch.valid[s : s + m]
        T = int(valid.sum(1).max())
        with torch.no_grad():
            target = head.norm(batch.teacher_hidden[s : s + m, :T].float()).to(dtype)
        tensors = {
            "input_ids": batch.input_ids[s : s + m, :T],
            "attention_mask": valid[:, :T].long(),
            "loss_mask": specforge_mask(batch.loss_mask[s : s + m, :T], valid[:, :T], align),
            "hidden_state": batch.taps[s : s + m, :T].to(dtype),
            "target": target,
        }
        ids = (batch.sample_ids or [])[s : s + m]
        yield (sf.TrainBatch(sample_ids=ids, strategy="eagle3", tensors=tensors,
                             metadata={"target_repr": "hidden_state"}), valid.shape[0], T)


def save_peer_export(draft: Any, ecfg: Any, out: Path) -> Path:
    """SpecForge's draft state dict under OUR export keys (its names are ours already: fc, midlayer.*, norm,
    lm_head, d2t, t2d) through our writer; anything trainable that the layout would drop is an error."""
    from models.eagle3 import export_keys
    from models.export import write_export

    state = draft.state_dict()
    keys = export_keys(ecfg)
    missing = [k for k in keys if k not in state]
    dropped = [n for n, p in draft.named_parameters() if p.requires_grad and n not in keys]
    if missing or dropped:
        raise RuntimeError(f"SpecForge draft does not map onto our export: missing {missing}, dropped {dropped}")
    return write_export(state, keys, ecfg.to_hf_dict(), out, torch.bfloat16)


@torch.no_grad()
def check_export(draft: Any, export_dir: Path, head: Any, sample: Any, columns: list[int], n_src: int,
                 steps: int, max_len: int) -> dict:
    """Load `export_dir` with our loader and run SpecForge's own TTT unroll and ours side by side (fp32,
    eager) on one sample: the export carries SpecForge's drafter exactly when every step's logits agree.
    SpecForge's side gets the export's bf16 rounding of its weights, so only layout or math can differ."""
    import copy

    from models.attention import TTTCache
    from models.eagle3 import load_export
    from models.target_head import EMBED_KEY
    from train.batch import collate
    from train.ttt import shifted_ids

    batch = collate([sample], max_len=max_len).select_taps(columns, n_src)
    T = batch.input_ids.shape[1]
    peer = copy.deepcopy(draft).to(torch.bfloat16).float()
    peer.embed_tokens.weight.copy_(head.embed_tokens.weight)  # not exported: both sides take the target's
    # The bf16 cast also rounded the rotary frequencies and their cos/sin cache (buffers, not exported: our
    # loader computes them exactly, as SpecForge's trained model had them); a frequency f rounded to bf16 turns
    # position p by up to p·f·2^-9 radians off, 1-2% of the logits on a 238-token probe. Restore them, then
    # rebuild the cache.
    rope = peer.midlayer.self_attn.rotary_emb
    rope.inv_freq.copy_(draft.midlayer.self_attn.rotary_emb.inv_freq)
    rope._set_cos_sin_cache(seq_len=rope.max_seq_len_cached, device=rope.inv_freq.device, dtype=torch.float32)
    ours = load_export(export_dir, target_weights={EMBED_KEY: head.embed_tokens.weight.float()}, dtype=torch.float32).eval()
    # peer's TTT unroll, as OnlineEagle3Model.forward runs it (sdpa backend)
    taps = batch.taps.float()
    pos = torch.arange(T)[None]
    h_peer, cache_peer = peer.project_hidden_states(taps), [[], []]
    mask = peer.prepare_decoder_attention_mask(torch.ones(1, T, dtype=torch.long), h_peer, 1, T, 0)
    h_ours, cache_ours = ours.fuse(taps), TTTCache()
    out: dict[str, list] = {"max_abs_diff": [], "argmax_agree": [], "logit_scale": []}
    with torch.compiler.set_stance("force_eager"):
        for k in range(steps):
            ids = shifted_ids(batch.input_ids, k + 1)
            h_peer = peer.backbone(input_embeds=peer.embed_input_ids(ids), hidden_states=h_peer,
                                   cache_hidden=cache_peer, attention_mask=mask, position_ids=pos)
            h_ours = ours.forward_step(h_ours, ids, pos[0] + k, cache_ours)
            a, b = peer.compute_logits(h_peer), ours.compute_logits(h_ours)
            out["max_abs_diff"].append(float((a - b).abs().max()))
            out["argmax_agree"].append(float((a.argmax(-1) == b.argmax(-1)).float().mean()))
            out["logit_scale"].append(float(a.abs().max()))
    out["tokens"] = T
    out["ok"] = min(out["argmax_agree"]) >= 0.995 and max(
        d / max(s, 1e-6) for d, s in zip(out["max_abs_diff"], out["logit_scale"])) < 1e-3
    return out


def cmd_train(args: argparse.Namespace) -> None:
    from infra.precision import resolve_precision
    from train.build import load_head
    from train.data import ShardBatches
    from train.trainer import total_steps

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    prep, out = Path(args.prep).resolve(), Path(args.out).resolve()
    if out == prep or prep in out.parents:
        raise SystemExit("peer_specforge: --out must not be inside the prep dir (it is read-only input)")
    if (out / TRAIN_LOG).exists():
        raise SystemExit(f"peer_specforge: {out / TRAIN_LOG} exists; use a fresh --out")
    out.mkdir(parents=True, exist_ok=True)
    cfg = run_config(prep, args.exp, args.override)
    check_supported(cfg)
    t, d = cfg.train, cfg.data
    if d.batch_size % args.micro_batch:
        raise SystemExit(f"--micro-batch {args.micro_batch} must divide data.batch_size {d.batch_size}")
    t0 = time.perf_counter()
    sf = import_specforge(args.compile == "on")
    train_data = ShardBatches(prep / "train", d, d.batch_size, 0, 1, seed=t.seed, subset=d.train_samples)
    if train_data.manifest.teacher != "hidden":
        raise SystemExit("peer_specforge: SpecForge's offline EAGLE-3 needs the full teacher (capture.teacher=hidden)")
    n_src = len(train_data.manifest.tap_layers)
    taps, columns = tap_choice(cfg, prep, train_data.manifest.tap_layers)
    total = total_steps(cfg, train_data.batches_per_epoch)
    stop = min(total, args.steps or total)
    head = load_head(prep).float()
    # "auto" follows our run (infra.precision: bf16 where the device has native bf16, fp32 elsewhere): bf16
    # matmuls without a native bf16 unit are an order of magnitude slower (14x per SpecForge step measured).
    precision = resolve_precision(cfg.deepspeed.precision) if args.dtype == "auto" else args.dtype
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    model, draft, strategy, ecfg = build_peer(sf, cfg, prep, taps, head, dtype, args.compact_teacher)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt, inner = make_optimizer(sf, model, cfg, total, args.optimizer)
    meta = {
        "kind": "config", "prep": str(prep), "exp": args.exp, "overrides": args.override,
        "total_steps": total, "stop_after": stop, "batches_per_epoch": train_data.batches_per_epoch,
        "batch_size": d.batch_size, "micro_batch": args.micro_batch, "norm": args.norm, "max_len": d.max_len,
        "seed": t.seed, "epochs": t.epochs, "lr": t.lr, "warmup_steps": t.warmup_steps, "schedule": t.schedule,
        "min_lr_ratio": t.min_lr_ratio, "betas": list(t.betas), "eps": t.eps, "clip": t.clip,
        "ttt_steps": t.ttt_steps, "loss_decay": t.loss_decay, "tap_layers": taps,
        "draft_vocab_size": ecfg.draft_vocab_size, "dtype": precision, "optimizer": args.optimizer,
        "compile": args.compile, "mask_align": args.mask_align, "compact_teacher": args.compact_teacher,
        "threads": torch.get_num_threads(), "trainable_params": sum(p.numel() for p in params),
        "torch": torch.__version__, "specforge": _version("specforge"), "transformers": _version("transformers"),
        "build_s": round(time.perf_counter() - t0, 2),
    }
    _jsonl(out / TRAIN_LOG, meta)
    print(dumps(meta), flush=True)

    def export(step: int, wall: float) -> Path:
        path = save_peer_export(draft, ecfg, out / EXPORTS / f"step_{step}")
        _jsonl(out / TRAIN_LOG, {"kind": "export", "step": step, "wall_s": wall, "dir": str(path)})
        return path

    step, wall, epoch, last = 0, 0.0, 0, None
    if args.save_every:
        export(0, 0.0)  # the untrained drafter: the curves' common origin
    while step < stop:
        for batch in train_data.epoch(epoch):
            tic = time.perf_counter()
            lr = float(inner.param_groups[0]["lr"])
            B, T_pad = len(batch), batch.input_ids.shape[1]
            K = t.ttt_steps
            ploss, correct, denom = torch.zeros(K, dtype=torch.float64), torch.zeros(K), torch.zeros(K)
            loss_sum, tokens, n_micro = 0.0, int(batch.valid.sum()), 0
            for tb, m, T in micro_batches(batch, args.micro_batch, columns, n_src, head, dtype, args.mask_align, sf):
                w = m * T / (B * T_pad) if args.norm == "batch" else m / B
                res = strategy.forward_loss(tb)
                (res.loss * w).backward()
                loss_sum += float(res.loss.detach()) * w
                ploss += torch.tensor([float(p) for p in res.metrics["plosses"]], dtype=torch.float64) * w
                correct += torch.tensor([float(c) for c in res.metrics["acc_corrects"]])
                denom += torch.tensor([float(c) for c in res.metrics["acc_denoms"]])
                n_micro += 1
            grad_norm = optimizer_step(args.optimizer, opt, inner, params, t.clip)
            step_s = time.perf_counter() - tic
            step, wall = step + 1, wall + step_s
            rec = {"kind": "train", "step": step, "loss": loss_sum, "ploss_k": ploss.tolist(),
                   "acc_k": (correct / denom.clamp_min(1)).tolist(), "lr": lr, "grad_norm": grad_norm,
                   "step_s": round(step_s, 3), "wall_s": round(wall, 3), "tokens": tokens, "padded_len": T_pad,
                   "micro_batches": n_micro, "epoch": epoch, "peak_rss_mb": round(peak_rss_mb(), 1)}
            _jsonl(out / TRAIN_LOG, rec)
            print(dumps({k: rec[k] for k in ("step", "loss", "lr", "grad_norm", "step_s", "tokens")}), flush=True)
            if not math.isfinite(loss_sum):
                raise SystemExit(f"peer_specforge: non-finite loss at step {step}")
            if (args.save_every and step % args.save_every == 0) or step == stop:
                last = export(step, wall)
            if step >= stop:
                break
        epoch += 1

    if args.check_export and last is not None:
        from data_prep.shards import ShardSet

        split = ShardSet(prep / "eval" if (prep / "eval" / "manifest.json").exists() else prep / "train")
        lengths = split.lengths()  # a held-out sample of ~256 tokens: cheap, yet long enough to mean something
        probe = split[min(range(len(lengths)), key=lambda i: abs(lengths[i] - 256))]
        check = check_export(draft, last, head, probe, columns, n_src, t.ttt_steps, d.max_len)
        (out / "export_check.json").write_text(dumps(check, indent=1))
        print(dumps({"export_check": check}), flush=True)
        if not check["ok"]:
            raise SystemExit("peer_specforge: the export does not reproduce SpecForge's logits (export_check.json)")


# -------------------------------------------------------------------------------------- step (specforge venv)
def cmd_step(args: argparse.Namespace) -> dict:
    """ONE SpecForge offline TTT training step on synthetic inputs of a drafter geometry (bench/train_step.py's
    GEOMETRIES: random weights, random taps and target hidden states, every position but the last a loss row),
    --warmup untimed steps then --repeats timed: the package's own TargetHead -> OnlineEagle3Model (TTT K) ->
    LlamaForCausalLMEagle3 -> its reference loss -> BF16Optimizer (AdamW over fp32 masters, clip 0.5). Prints one
    JSON line; bench/train_step.py synthetic --specforge-python runs it in a fresh process per length."""
    import statistics

    from transformers import LlamaConfig

    from bench.train_step import GEOMETRIES
    from models.eagle3 import Eagle3Config

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    sf = import_specforge(args.compile == "on")
    geo = dict(GEOMETRIES[args.geometry])
    vd, V, H = geo.pop("draft_vocab_size"), geo["vocab_size"], geo["hidden_size"]
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    hf = {**geo, "max_position_embeddings": max(args.seq_len + args.ttt_steps + 1, 2048), "rope_theta": 10000.0}
    ecfg = Eagle3Config.from_target_config(hf, draft_vocab_size=vd)
    torch.manual_seed(0)
    draft = sf.AutoDraftModel.from_config(specforge_config(ecfg), attention_backend="sdpa", torch_dtype=dtype)
    used = torch.randperm(V)[:vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    with torch.no_grad():
        draft.d2t.copy_(used - torch.arange(vd))
        draft.t2d.copy_(t2d)
    draft.freeze_embedding()
    model = sf.OnlineEagle3Model(draft_model=draft, length=args.ttt_steps, attention_backend="sdpa").to(dtype)
    tmp = Path(tempfile.mkdtemp(prefix="peer_sf_target_"))
    try:  # TargetHead reads the target's config.json from a directory; its random fc stands in for the lm_head
        LlamaConfig(**{k: v for k, v in hf.items() if k != "draft_vocab_size"}, tie_word_embeddings=True,
                    rms_norm_eps=1e-5).save_pretrained(tmp)
        target_head = sf.TargetHead(str(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    target_head.freeze_weights()
    target_head = target_head.eval().to(dtype)
    strategy = sf.Eagle3TrainStrategy(model, target_head=target_head, ploss_decay=0.8)
    opt = sf.BF16Optimizer(model, lr=1e-4, max_grad_norm=0.5, total_steps=1000, warmup_ratio=0.015,
                           lr_scheduler="cosine")
    T = args.seq_len
    loss_mask = torch.ones(1, T, dtype=torch.long)
    loss_mask[:, -1] = 0  # as normalize_offline_sample does
    tensors = {"input_ids": torch.randint(1, V, (1, T)), "attention_mask": torch.ones(1, T, dtype=torch.long),
               "loss_mask": loss_mask, "hidden_state": torch.randn(1, T, 3 * H).to(dtype),
               "target": (torch.randn(1, T, H) * 4).to(dtype)}
    batch = sf.TrainBatch(sample_ids=["synthetic"], strategy="eagle3", tensors=tensors,
                          metadata={"target_repr": "hidden_state"})
    build_s = time.perf_counter() - t0
    losses, times = [], []
    for i in range(args.warmup + args.repeats):
        tic = time.perf_counter()
        res = strategy.forward_loss(batch)
        res.loss.backward()
        opt.step()  # clip, fp32-master AdamW, schedule, copy back, clear grads
        losses.append(float(res.loss.detach().float()))
        if i >= args.warmup:
            times.append(time.perf_counter() - tic)
    out = {"seq_len": T, "geometry": args.geometry, "step_s": round(statistics.median(times), 4),
           "step_s_all": [round(x, 4) for x in times], "peak_rss_mb": round(peak_rss_mb(), 1),
           "loss": round(losses[args.warmup], 5), "losses": [round(x, 5) for x in losses],
           "build_s": round(build_s, 2), "ttt_steps": args.ttt_steps, "dtype": args.dtype, "compile": args.compile,
           "attn": "sdpa", "threads": torch.get_num_threads(), "torch": torch.__version__,
           "specforge": _version("specforge")}
    print(dumps(out), flush=True)
    return out


def _version(pkg: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


# ---------------------------------------------------------------------------------------- eval (.venv)
def evaluate_export(export_dir: Path, cfg: RunConfig, prep: Path, head: Any) -> dict:
    """Held-out metrics of an export, computed as our trainer's held-out eval computes them (train.trainer
    .evaluate on 1 rank): the eval split through ShardBatches (data.eval_batch_size, eval_max_samples,
    data.max_len, length order), fp32 on the CPU, K = train.eval_ttt_steps or ttt_steps, honest acc_k."""
    from models.eagle3 import load_export
    from models.target_head import EMBED_KEY
    from train.data import ShardBatches
    from train.ttt import TTTSettings, evaluate

    d, t = cfg.data, cfg.train
    eval_data = ShardBatches(prep / "eval", d, d.eval_batch_size, 0, 1, max_samples=d.eval_max_samples)
    n_src = len(eval_data.manifest.tap_layers)
    _, columns = tap_choice(cfg, prep, eval_data.manifest.tap_layers)
    drafter = load_export(export_dir, target_weights={EMBED_KEY: head.embed_tokens.weight}, dtype=torch.float32,
                          attn_backend=cfg.model.attn_backend)
    settings = TTTSettings.from_train(t, held_out=True)
    batches = (b.select_taps(columns, n_src).to("cpu", torch.float32) for b in eval_data.epoch(0, shuffle=False))
    return evaluate(drafter, head, batches, settings)


def our_curve(run_dir: Path) -> list[dict]:
    """Our run's held-out evals (metrics.jsonl) with the training wall-clock at each (train.metrics
    .training_clock: evaluations left out, checkpoint saves in; seconds on this data)."""
    from train.metrics import METRICS_FILE, training_clock

    recs = _read_jsonl(run_dir / METRICS_FILE)
    evals = [r for r in recs if r["kind"] == "eval"]
    if not evals or evals[0]["step"] != 0:
        raise SystemExit(f"{run_dir}/metrics.jsonl: no step-0 eval to start the clock from")
    clock = training_clock(recs)
    return [{"step": r["step"], "wall_s": round(clock[r["step"]] if r["step"] else 0.0, 2), "sim_tau": r["sim_tau"],
             "acc_k": r["acc_k"]} for r in evals]


def _at_wall(curve: list[dict], wall: float) -> dict | None:
    done = [c for c in curve if c["wall_s"] <= wall + 1e-9]
    return max(done, key=lambda c: c["wall_s"]) if done else None


def cmd_eval(args: argparse.Namespace) -> None:
    from train.build import load_head

    torch.set_num_threads(args.threads)
    prep = Path(args.prep).resolve()
    cfg = run_config(prep, args.exp, args.override)
    head = load_head(prep).float()
    targets: list[tuple[str, Path, int | None, float | None]] = []
    peer = Path(args.peer).resolve() if args.peer else None
    if peer is not None:
        for r in _read_jsonl(peer / TRAIN_LOG):
            if r["kind"] == "export" and (args.steps is None or r["step"] in args.steps):
                targets.append(("specforge", Path(r["dir"]), r["step"], r["wall_s"]))
    for spec in args.drafter:
        label, _, path = spec.partition("=")
        targets.append((label, Path(path), None, None))
    if not targets:
        raise SystemExit("peer_specforge eval: nothing to evaluate (--peer with exports, or --drafter label=dir)")
    done = {(r["label"], r["dir"]) for r in _read_jsonl(peer / EVAL_LOG)} if peer else set()
    results = []
    for label, path, step, wall in targets:
        if (label, str(path)) in done and not args.redo:
            results += [r for r in _read_jsonl(peer / EVAL_LOG) if (r["label"], r["dir"]) == (label, str(path))][-1:]
            continue
        tic = time.perf_counter()
        rep = evaluate_export(path, cfg, prep, head)
        rec = {"label": label, "dir": str(path), "step": step, "wall_s": wall, "sim_tau": rep["sim_tau"],
               "sim_tau_alpha": rep["sim_tau_alpha"], "acc_k": rep["acc_k"], "alpha_k": rep["alpha_k"],
               "acc_in_vocab_k": rep["acc_in_vocab_k"], "loss_k": rep["loss_k"], "oov_rate": rep["oov_rate"],
               "num_samples": rep["num_samples"], "num_positions": rep["num_positions"],
               "eval_s": round(time.perf_counter() - tic, 2)}
        results.append(rec)
        if peer is not None:
            _jsonl(peer / EVAL_LOG, rec)
        print(dumps({k: rec[k] for k in ("label", "step", "wall_s", "sim_tau", "acc_k")}), flush=True)
    if args.ours and peer is not None:
        compare(Path(args.ours), [r for r in results if r["label"] == "specforge"], peer / "compare.json")


def compare(run_dir: Path, theirs: list[dict], out: Path) -> None:
    """Held-out sim τ at equal optimizer steps and at equal training wall-clock (ours: the run's own held-out
    evals; theirs: the peer exports). Wall-clock depends on the cores each side had: see train_log.jsonl's
    `threads` and the run's world size."""
    ours = our_curve(run_dir)
    theirs = sorted((r for r in theirs if r["step"] is not None), key=lambda r: r["step"])
    by_step = {r["step"]: r for r in theirs}
    steps = [{"step": o["step"], "ours": o["sim_tau"], "theirs": by_step[o["step"]]["sim_tau"]}
             for o in ours if o["step"] in by_step]
    walls = []
    for o in ours:
        p = _at_wall(theirs, o["wall_s"])
        walls.append({"wall_s": o["wall_s"], "ours_step": o["step"], "ours": o["sim_tau"],
                      "theirs_step": None if p is None else p["step"], "theirs": None if p is None else p["sim_tau"]})
    result = {"ours_run": str(run_dir), "equal_steps": steps, "equal_wall": walls, "ours_curve": ours,
              "theirs_curve": [{k: r[k] for k in ("step", "wall_s", "sim_tau", "acc_k")} for r in theirs]}
    out.write_text(dumps(result, indent=1))
    print("held-out sim τ at equal steps   (step: ours | SpecForge)")
    for s in steps:
        print(f"  {s['step']:>5}: {s['ours']:.4f} | {s['theirs']:.4f}")
    print("held-out sim τ at equal wall-clock (ours at its eval; SpecForge's latest export by then)")
    last = theirs[-1]["step"] if theirs else None
    for w in walls:
        theirs_txt = "-" if w["theirs"] is None else f"{w['theirs']:.4f} (step {w['theirs_step']}" + (
            ", its last export)" if w["theirs_step"] == last else ")")
        print(f"  {w['wall_s']:>8.1f} s: {w['ours']:.4f} (step {w['ours_step']}) | {theirs_txt}")
    print(f"wrote {out}")


# ------------------------------------------------------------------------------------------------ cli
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    step = sub.add_parser("step", help="time one SpecForge training step on synthetic inputs")
    step.add_argument("--seq-len", type=int, required=True)
    step.add_argument("--geometry", default="embedded", help="bench/train_step.py GEOMETRIES")
    step.add_argument("--ttt-steps", type=int, default=7)
    step.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="params (bf16: fp32 masters)")
    step.add_argument("--compile", choices=["on", "off"], default="on")
    step.add_argument("--threads", type=int, default=1)
    step.add_argument("--warmup", type=int, default=1)
    step.add_argument("--repeats", type=int, default=1)
    for name in ("train", "eval"):
        s = sub.add_parser(name)
        s.add_argument("--prep", required=True, help="our prep dir (read only)")
        s.add_argument("--exp", default="eagle3_demo", help="our conf/exp preset the recipe comes from")
        s.add_argument("--override", action="append", default=[], help="an extra Hydra override, e.g. train.lr=1e-3")
        s.add_argument("--threads", type=int, default=1)
        if name == "train":
            s.add_argument("--out", required=True, help="peer run dir (train_log.jsonl, exports/)")
            s.add_argument("--steps", type=int, default=None,
                           help="stop after this many optimizer steps; the schedule still spans the recipe's total")
            s.add_argument("--save-every", type=int, default=0, help="export every N steps (and step 0); 0 = last only")
            s.add_argument("--micro-batch", type=int, default=1,
                           help="samples per SpecForge forward (divides data.batch_size; = it: one padded batch)")
            s.add_argument("--norm", choices=["batch", "accum"], default="batch",
                           help="micro-batch weights: batch = the padded batch's own loss; accum = SpecForge's "
                                "batch_size=m, accumulation_steps=B/m")
            s.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                           help="SpecForge's params: auto = our run's precision (deepspeed.precision: bf16 on "
                                "a bf16 GPU or CPU, else fp32); bf16 = SpecForge's GPU recipe (fp32 masters)")
            s.add_argument("--optimizer", choices=["bf16opt", "adamw"], default="bf16opt")
            s.add_argument("--compile", choices=["on", "off"], default="on",
                           help="the package's own @torch.compile decorators (Inductor, needs a C++ compiler)")
            s.add_argument("--mask-align", choices=["specforge", "ours"], default="specforge")
            s.add_argument("--compact-teacher", action="store_true",
                           help="SpecForge's training.compact_teacher (teacher streamed in vocab chunks)")
            s.add_argument("--check-export", action=argparse.BooleanOptionalAction, default=True,
                           help="after training, check that our loader reproduces SpecForge's logits")
        else:
            s.add_argument("--peer", default=None, help="peer run dir: evaluate every export its train_log lists")
            s.add_argument("--steps", type=lambda x: [int(v) for v in x.split(",")], default=None,
                           help="only these peer steps, e.g. 0,21,42,63,84")
            s.add_argument("--drafter", action="append", default=[], help="label=<export dir>, evaluated too")
            s.add_argument("--ours", default=None, help="our run dir (metrics.jsonl): print the comparison")
            s.add_argument("--redo", action="store_true", help="re-evaluate exports already in peer_eval.jsonl")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    {"train": cmd_train, "eval": cmd_eval, "step": cmd_step}[args.cmd](args)


if __name__ == "__main__":
    main()
