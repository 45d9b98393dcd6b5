#!/usr/bin/env python
"""The GPU check: what this project's GPU code paths compute, in ONE run on one GPU (docs/gpu-check.md).

    python3 bench/gpu_check.py [--out FILE] [--sections attention,zero3,...]   # one CUDA GPU, bf16
    DRY_RUN=1 python bench/gpu_check.py                                        # CPU: the plumbing, tiny sizes

Sections, each in its own process with its own time budget (a failure, crash or timeout in one is recorded
and the others still run):
  attention   the TTT attention backends of models/attention.py that run on CUDA (flex; flash when flash_attn
              imports) against `reference` on fp32 copies of the same inputs, forward and backward, at 2K and
              8K tokens: ||out - ref|| / ||ref|| for the output and every input gradient;
  zero3       a few ZeRO-3 training steps (DeepSpeed through train/engine.py, nccl, world size 1: NCCL refuses
              two ranks on one GPU) of a tiny drafter in fp32 and in bf16, against the same steps run in fp32
              on this machine's CPU with gloo, started beside them: losses (and fp32 grad norms) compared;
  spec_decode greedy speculative decoding (eval/spec_decode.py, chain and tree) of tiny random targets and
              drafters on the GPU against plain greedy decoding: identical outputs in fp32; in bf16 a
              difference must sit at a near-tie of the plain run's logits;
  train_step  one bf16 ZeRO-3 training step (train.trainer.micro_step + optimizer step, K=7, loss chunks of
              1024, the drafter layer recomputed: the 40K recipe's settings) of the gpt-oss-120b and the
              embedded (SmolLM2-135M) drafter geometries on synthetic inputs at 2K/8K/40K tokens: tokens/s
              and peak GPU memory, with the memory plan's prediction of the same step beside each (train/plan.py);
  verify      verify(m)/step (eval/budget.py): a target forward over m tokens with the tree mask and taps
              against one token, for random bf16 targets of the embedded and the Llama-3.1-8B geometry.
With DRY_RUN=1 (or --dry-run) the same sections run on the CPU at tiny sizes in fp32, gloo instead of nccl
and the CPU backends (chunked, fused) instead of flex/flash; the JSON then goes to a temporary directory.
A short table is printed last; the JSON goes to --out, else bench/results/gpu/gpu_check.json. Exit status 1
when a section did not pass.

Runs under a plain python3 with torch, transformers and the wheels of `make gpu-wheels` (deepspeed, hydra-core,
...) on PYTHONPATH; it needs nothing else of the project's environment (docs/gpu-check.md).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import importlib
import importlib.metadata
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the project's packages from the checkout
    sys.path.insert(0, str(ROOT))

from infra.strict_json import dumps  # noqa: E402

SECTIONS = ("attention", "zero3", "spec_decode", "train_step", "verify")
BF16_TOL = 2e-2  # relative error of bf16 operands against an fp32 reference (bf16 keeps 8 mantissa bits)
FP32_TOL = 1e-4  # fp32 against fp32 computed another way (another device, kernel or reduction order)


@dataclass(frozen=True)
class Config:
    """Every size the sections use, for the GPU run and for the dry run."""

    dry_run: bool
    device: str
    dtype: str  # the low-precision dtype under test
    tol: float
    budgets_s: dict[str, float]
    # attention: (T, TTT steps in the cache) cases, q heads / kv heads / head dim, backends under test
    attn_cases: tuple[tuple[int, int], ...]
    attn_heads: tuple[int, int, int]
    attn_backends: tuple[str, ...]
    # zero3: the tiny drafter's target geometry, tokens, TTT steps, loss chunk, optimizer steps, runs
    zero3_geometry: dict[str, int]
    zero3_seq: int
    zero3_ttt: int
    zero3_chunk: int
    zero3_steps: int
    zero3_runs: tuple[tuple[str, str, str, str], ...]  # (name, device, precision, dist backend)
    # spec_decode: dtypes that must give identical outputs / where near-ties may differ, tokens per prompt
    spec_exact_dtypes: tuple[str, ...]
    spec_tie_dtypes: tuple[str, ...]
    spec_new_tokens: int
    spec_pairs: tuple[str, ...]  # "random" and/or "permutation-<noise>"
    spec_settings: tuple[tuple[str, int, int, int], ...]  # (mode, depth, topk, total_tokens)
    # train_step: geometries (bench/train_step.py GEOMETRIES) x lengths, TTT steps, loss chunk, repeats
    train_geometries: tuple[str, ...]
    train_lengths: tuple[int, ...]
    train_ttt: int
    train_chunk: int
    train_repeats: int
    # verify: target geometries, verified block sizes (root + m drafts), context before the block
    verify_targets: tuple[str, ...]
    verify_blocks: tuple[int, ...]
    verify_context: int
    verify_repeats: int


def make_config(dry_run: bool) -> Config:
    if dry_run:
        return Config(
            dry_run=True, device="cpu", dtype="float32", tol=FP32_TOL,
            budgets_s={s: 300.0 for s in SECTIONS},  # backstops only: a loaded 2-core machine
            attn_cases=((64, 3), (96, 1)), attn_heads=(4, 2, 16), attn_backends=("chunked", "fused"),
            zero3_geometry=dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                intermediate_size=128, vocab_size=512, num_hidden_layers=8, draft_vocab_size=128),
            zero3_seq=48, zero3_ttt=2, zero3_chunk=32, zero3_steps=3,
            zero3_runs=(("cpu-fp32-gloo", "cpu", "fp32", "gloo"), ("device-fp32-gloo", "cpu", "fp32", "gloo")),
            spec_exact_dtypes=("float32",), spec_tie_dtypes=(), spec_new_tokens=24,
            spec_pairs=("random", "permutation-0.2"), spec_settings=(("chain", 4, 1, 4), ("tree", 4, 4, 12)),
            train_geometries=("tiny",), train_lengths=(64, 128), train_ttt=2, train_chunk=32, train_repeats=1,
            verify_targets=("tiny",), verify_blocks=(1, 5), verify_context=16, verify_repeats=1,
        )
    # Budgets add up to 470 s: the whole check fits in 8 minutes on the GPU, whatever hangs.
    return Config(
        dry_run=False, device="cuda", dtype="bfloat16", tol=BF16_TOL,
        budgets_s={"attention": 100.0, "zero3": 70.0, "spec_decode": 45.0, "train_step": 220.0, "verify": 35.0},
        attn_cases=((2048, 7), (8192, 3)), attn_heads=(9, 3, 64), attn_backends=("flex", "flash"),
        zero3_geometry=dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            intermediate_size=512, vocab_size=4096, num_hidden_layers=8, draft_vocab_size=1024),
        zero3_seq=512, zero3_ttt=3, zero3_chunk=256, zero3_steps=4,
        zero3_runs=(("cpu-fp32-gloo", "cpu", "fp32", "gloo"), ("gpu-fp32-nccl", "cuda", "fp32", "nccl"),
                    ("gpu-bf16-nccl", "cuda", "bf16", "nccl")),
        spec_exact_dtypes=("float32",), spec_tie_dtypes=("bfloat16",), spec_new_tokens=32,
        spec_pairs=("random", "permutation-0.2", "permutation-0.4"),
        spec_settings=(("chain", 4, 1, 4), ("tree", 4, 4, 12), ("tree", 6, 8, 60)),
        train_geometries=("gpt-oss-120b", "embedded"), train_lengths=(2048, 8192, 40960), train_ttt=7,
        train_chunk=1024, train_repeats=2,
        verify_targets=("embedded", "llama-3.1-8b"), verify_blocks=(1, 2, 3, 5, 9, 17, 33, 61, 128),
        verify_context=512, verify_repeats=5,
    )


# Target geometries of the verify section (random weights; tap layers as EAGLE-3 picks them).
VERIFY_TARGETS: dict[str, dict[str, int]] = {
    "embedded": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3),  # SmolLM2-135M-Instruct
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
}


# --------------------------------------------------------------------------------------------- recording
@dataclass
class Recorder:
    """A section's result, rewritten (atomically) after every row, so a killed section leaves what it did."""

    path: Path
    data: dict[str, Any] = field(default_factory=lambda: {"checks": {}, "rows": [], "summary": ""})

    def check(self, name: str, ok: bool, value: Any = None, limit: Any = None) -> bool:
        self.data["checks"][name] = {"ok": bool(ok), "value": _round(value), "limit": limit}
        self.flush()
        return bool(ok)

    def row(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(_round(row))
        self.flush()

    def flush(self) -> None:
        _write_json(self.path, self.data)


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return x if not math.isfinite(x) or x == 0 else float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    return x


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _rel(a, b) -> float:
    """||a - b|| / ||b||, in fp32 (NaN if either holds a non-finite value)."""
    a, b = a.float(), b.float()
    if not (bool(a.isfinite().all()) and bool(b.isfinite().all())):
        return float("nan")
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _peak_mb(device: str) -> float | None:
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _reset_peak(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _exact_matmuls() -> None:
    """fp32 comparisons must be fp32: no TF32 in matrix products or convolutions."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# -------------------------------------------------------------------------------------------- attention
def section_attention(cfg: Config, rec: Recorder, deadline: float) -> None:
    import torch

    from models.attention import ATTENTION, _has_flash_attn, resolve_backend, ttt_attention

    _exact_matmuls()
    dev, low = cfg.device, _torch_dtype(cfg.dtype)
    hq, hkv, d = cfg.attn_heads
    rec.data.update(registry=sorted(ATTENTION), auto=resolve_backend("auto", dev, low), skipped={},
                    heads=dict(q=hq, kv=hkv, head_dim=d), dtype=cfg.dtype, reference_dtype="float32")
    backends = []
    for name in cfg.attn_backends:
        if name not in ATTENTION:
            rec.check(f"{name}_registered", False, value=sorted(ATTENTION))
        elif name == "flash" and not _has_flash_attn():
            rec.data["skipped"][name] = "flash_attn is not importable"
        else:
            backends.append(name)
    scale = d ** -0.5

    def run(name: str, inputs: list, dout, timed: bool) -> tuple[Any, list, float | None, float | None]:
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        n = (len(leaves) - 1) // 2
        _reset_peak(dev)
        out = ttt_attention(leaves[0], leaves[1:1 + n], leaves[1 + n:], scale, backend=name)
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        _sync(dev)
        peak = _peak_mb(dev) if dev == "cuda" else None
        ms = None
        if timed:  # median of 3 forward+backward passes after the one above (compilation, autotuning)
            times = []
            for _ in range(3):
                _sync(dev)
                t0 = time.perf_counter()
                o = ttt_attention(leaves[0], leaves[1:1 + n], leaves[1 + n:], scale, backend=name)
                torch.autograd.grad(o, leaves, dout.to(o.dtype))
                _sync(dev)
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3
        return out.detach(), [g.detach() for g in grads], peak, ms

    for T, steps in cfg.attn_cases:
        if time.time() > deadline:
            rec.check(f"T{T}_k{steps}_ran", False, value="section time budget spent")
            continue
        g = torch.Generator().manual_seed(1000 * steps + T)
        shapes = [(1, hq, T, d)] + [(1, hkv, T, d)] * (2 * steps)
        inputs32 = [torch.randn(s, generator=g).to(dev) for s in shapes]
        dout = torch.randn(1, hq, T, d, generator=g).to(dev)
        names = ["out", "dq"] + [f"dk{j}" for j in range(steps)] + [f"dv{j}" for j in range(steps)]
        ref_out, ref_grads, ref_peak, _ = run("reference", inputs32, dout, timed=False)
        refs = [ref_out, *ref_grads]
        low_inputs = [x.to(low) for x in inputs32]
        candidates = list(backends)
        if low != torch.float32:
            candidates = ["reference", *candidates]  # the same math in bf16: the floor any bf16 kernel meets
        for name in candidates:
            label = "reference_lowp" if name == "reference" else name
            try:
                out, grads, peak, ms = run(name, low_inputs, dout, timed=name != "reference")
            except Exception as e:  # a kernel's failure is this backend's finding; the others still run
                rec.row({"backend": label, "seq_len": T, "ttt_steps": steps, "error": f"{type(e).__name__}: {e}"[:800]})
                rec.check(f"{name}_T{T}_k{steps}", False, value=f"{type(e).__name__}: {str(e)[:300]}")
                _reset_peak(dev)
                continue
            errs = {k: _rel(t, r) for k, t, r in zip(names, [out, *grads], refs)}
            worst = max(errs.values(), key=lambda e: (not math.isfinite(e), e))
            rec.row({"backend": label, "seq_len": T, "ttt_steps": steps, "max_rel_err": worst, "rel_err": errs,
                     "fwd_bwd_ms": ms, "peak_mb": peak, "reference_peak_mb": ref_peak})
            if name != "reference":
                rec.check(f"{name}_T{T}_k{steps}", math.isfinite(worst) and worst <= cfg.tol, value=worst,
                          limit=cfg.tol)
            del out, grads
        del refs, ref_out, ref_grads, inputs32, low_inputs
        _reset_peak(dev)
    if not backends:
        rec.check("some_backend_ran", False)
    worst = max((r["max_rel_err"] for r in rec.data["rows"] if r["backend"] != "reference_lowp" and "error" not in r),
                default=None)
    rec.data["summary"] = f"{'/'.join(backends) or 'none'} vs reference: worst rel err {worst}"


# ---------------------------------------------------------------------------------------------- zero3
def _build_drafter(geo: dict[str, int], seq_len: int, ttt: int, attn: str):
    """A random EAGLE-3 drafter of the target geometry `geo` (draft vocabulary a random subset) and the
    target's frozen output head, built on the current default device."""
    import torch

    from models.eagle3 import Eagle3Config, Eagle3Drafter
    from models.target_head import TargetHead

    geo = dict(geo)
    vd, V, H = geo.pop("draft_vocab_size"), geo["vocab_size"], geo["hidden_size"]
    hf = {**geo, "max_position_embeddings": max(seq_len + ttt + 1, 2048), "rope_theta": 10000.0}
    torch.manual_seed(0)
    drafter = Eagle3Drafter(Eagle3Config.from_target_config(hf, draft_vocab_size=vd), attn_backend=attn)
    draft_ids = torch.randperm(V)[:vd].sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[draft_ids] = True
    drafter.load_target_embedding(torch.randn(V, H) * 0.02)
    drafter.set_vocab_mapping(draft_ids - torch.arange(vd), t2d)
    head = TargetHead(H, V, rms_norm_eps=1e-5)
    with torch.no_grad():
        head.lm_head.weight.normal_(0, 0.02)
    return drafter, head


def _synthetic_batch(drafter, seq_len: int, seed: int, device: str = "cpu"):
    import torch

    from train.batch import Batch

    g = torch.Generator(device=device).manual_seed(seed)
    V, H, n_taps = drafter.cfg.vocab_size, drafter.cfg.hidden_size, len(drafter.cfg.tap_layers)
    return Batch(
        input_ids=torch.randint(1, V, (1, seq_len), generator=g, device=device),
        loss_mask=torch.ones(1, seq_len, dtype=torch.bool, device=device),
        valid=torch.ones(1, seq_len, dtype=torch.bool, device=device),
        taps=torch.randn(1, seq_len, n_taps * H, generator=g, device=device),
        teacher_hidden=torch.randn(1, seq_len, H, generator=g, device=device) * 4,
        sample_ids=["synthetic"],
    )


def zero3_run(cfg: Config, name: str) -> dict:
    """One run of the zero3 section, in a process of its own (its own process group)."""
    import torch

    from train.config import DeepSpeedConfig, TrainConfig
    from train.eagle3 import Eagle3Objective
    from train.engine import Engine, init_distributed, shutdown_distributed
    from train.trainer import micro_step
    from train.ttt import TTTSettings

    _, device, precision, backend = next(r for r in cfg.zero3_runs if r[0] == name)
    _exact_matmuls()
    if (device == "cuda") != torch.cuda.is_available():
        raise RuntimeError(f"run {name} wants device {device}; torch.cuda.is_available() = "
                           f"{torch.cuda.is_available()}")
    # "chunked" (SDPA) on every device: this section checks distribution and precision, the attention
    # section the kernels.
    drafter, head = _build_drafter(cfg.zero3_geometry, cfg.zero3_seq, cfg.zero3_ttt, attn="chunked")
    batches = [_synthetic_batch(drafter, cfg.zero3_seq, seed=100 + i) for i in range(cfg.zero3_steps)]
    rank, world = init_distributed(backend)
    train_cfg = TrainConfig(ttt_steps=cfg.zero3_ttt, chunk_size=cfg.zero3_chunk, warmup_steps=0, lr=1e-3)
    engine = Engine(DeepSpeedConfig(zero_stage=3, precision=precision, dist_backend=backend), train_cfg,
                    cfg.zero3_steps)
    head.to(engine.device, engine.dtype)
    module = engine.prepare(drafter, keep_gathered=Eagle3Objective.keep_gathered)
    objective = Eagle3Objective(TTTSettings(steps=cfg.zero3_ttt, chunk_size=cfg.zero3_chunk))
    losses, norms = [], []
    for batch in batches:
        packed, _ = micro_step(engine, module, head, batch, objective, world)
        engine.step()
        losses.append(float(packed[0]))
        norms.append(engine.grad_norm)
    out = {"run": name, "device": str(engine.device), "precision": engine.precision,
           "dist_backend": torch.distributed.get_backend(), "world_size": world, "zero_stage": 3,
           "attn_backend": module.attn_backend, "losses": losses, "grad_norms": norms,
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None}
    engine.destroy()
    shutdown_distributed()
    return out


def section_zero3(cfg: Config, rec: Recorder, deadline: float) -> None:
    rec.data.update(geometry=cfg.zero3_geometry, seq_len=cfg.zero3_seq, ttt_steps=cfg.zero3_ttt,
                    optimizer_steps=cfg.zero3_steps,
                    note="world size 1 on the GPU: NCCL refuses two ranks on one device")
    outdir = rec.path.parent / "zero3_runs"
    outdir.mkdir(parents=True, exist_ok=True)

    def start(name: str, device: str) -> tuple[subprocess.Popen, Path]:
        path = outdir / f"{name}.json"
        env = _child_env(cfg)
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        if device == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""  # the fp32 reference: this machine's CPU, gloo
            env["OMP_NUM_THREADS"] = "1" if cfg.dry_run else "4"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--zero3-run", name, "--result", str(path)]
        if cfg.dry_run:
            cmd.append("--dry-run")
        return subprocess.Popen(cmd, env=env, cwd=ROOT), path

    def collect(proc: subprocess.Popen, path: Path, name: str) -> dict | None:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rec.data.setdefault("run_errors", {})[name] = "section time budget spent"
            return None
        data = json.loads(path.read_text()) if path.exists() else {}
        if proc.returncode != 0 or "error" in data:
            rec.data.setdefault("run_errors", {})[name] = data.get("error", f"exit {proc.returncode}")
            return None
        return data

    # The CPU reference runs beside the device runs (its own cores); the device runs one after another.
    ref_name = cfg.zero3_runs[0][0]
    ref_proc = start(ref_name, cfg.zero3_runs[0][1])
    results = {}
    for name, device, _, _ in cfg.zero3_runs[1:]:
        proc, path = start(name, device)
        results[name] = collect(proc, path, name)
    ref = collect(*ref_proc, ref_name)
    rec.data["runs"] = {ref_name: ref, **results}
    if ref is None:
        rec.check("cpu_reference_ran", False)
        return
    summary = []
    for name, _, precision, _ in cfg.zero3_runs[1:]:
        run = results[name]
        if run is None:
            rec.check(f"{name}_ran", False)
            continue
        tol = cfg.tol if precision == "bf16" else FP32_TOL
        loss_err = max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"]))
        rec.check(f"{name}_losses", len(run["losses"]) == len(ref["losses"]) and loss_err <= tol,
                  value=loss_err, limit=tol)
        if precision == "fp32":
            norm_err = max(abs(a - b) / abs(b) for a, b in zip(run["grad_norms"], ref["grad_norms"]))
            rec.check(f"{name}_grad_norms", norm_err <= 10 * FP32_TOL, value=norm_err, limit=10 * FP32_TOL)
        rec.row({"run": name, "dist_backend": run["dist_backend"], "precision": precision,
                 "max_rel_loss_diff": loss_err, "losses": run["losses"], "reference_losses": ref["losses"]})
        summary.append(f"{name} {loss_err:.1e}")
    rec.data["summary"] = "loss rel diff vs CPU fp32: " + ", ".join(summary)


# ----------------------------------------------------------------------------------------- spec_decode
SPEC_PROMPTS = ([1, 2, 3], [7], [4, 4, 9, 0, 15, 2])


@dataclass
class _Tie:
    gap: float  # top-1 minus top-2 logit of the plain run where the outputs first differ
    scale: float  # max(1, |top-1 logit|)


def _first_difference_tie(runner, prompt: list[int], plain: list[int], spec: list[int]) -> _Tie | None:
    """Where the speculative output first differs from the plain one, the plain run's top-2 logit gap."""
    i = next((j for j, (a, b) in enumerate(zip(plain, spec)) if a != b), None)
    if i is None:
        return None
    logits = runner.forward(prompt + plain[:i], runner.new_cache(), want_taps=False, last_logits_only=True).logits
    top = logits[-1].float().topk(2).values
    return _Tie(float(top[0] - top[1]), max(1.0, abs(float(top[0]))))


def section_spec_decode(cfg: Config, rec: Recorder, deadline: float) -> None:
    sys.path.insert(0, str(ROOT / "tests"))  # the tiny random models the tests decode with
    from tiny_models import permutation_pair, tiny_pair

    from eval.sampling import SamplingParams
    from eval.spec_decode import SpecSettings, SpeculativeDecoder, plain_generate
    from eval.target import TargetRunner

    _exact_matmuls()
    greedy = SamplingParams()

    def make_pair(name: str):
        if name == "random":  # a random drafter: rare acceptance, a reduced draft vocabulary
            return tiny_pair(vocab=64, seed=0, draft_vocab=40)
        noise = float(name.split("-")[1])  # a drafter that agrees with the target: long accepted paths
        return permutation_pair(vocab=16, hidden=32, noise=noise, seed=int(10 * noise))[:2]

    all_settings = [SpecSettings(mode=m, depth=d, topk=k, total_tokens=n) for m, d, k, n in cfg.spec_settings]
    rec.data.update(device=cfg.device, new_tokens=cfg.spec_new_tokens, prompts=list(SPEC_PROMPTS))
    counts = collections.Counter()
    accepted: list[int] = []
    for dtype_name in (*cfg.spec_exact_dtypes, *cfg.spec_tie_dtypes):
        exact = dtype_name in cfg.spec_exact_dtypes
        dtype = _torch_dtype(dtype_name)
        for pair_name in cfg.spec_pairs:
            if time.time() > deadline:
                rec.check(f"{dtype_name}_{pair_name}_ran", False, value="section time budget spent")
                continue
            try:
                target, drafter = make_pair(pair_name)
                target, drafter = target.to(cfg.device, dtype), drafter.to(cfg.device, dtype)
                runner = TargetRunner(target, drafter.cfg.tap_layers)
                rec.check(f"on_{cfg.device}", runner.device.type == cfg.device, value=str(runner.device))
                plains = [plain_generate(runner, p, cfg.spec_new_tokens, greedy).output_ids for p in SPEC_PROMPTS]
            except Exception as e:  # plain decoding itself failed: recorded, the other pairs still run
                rec.check(f"{dtype_name}_{pair_name}_plain", False, value=f"{type(e).__name__}: {str(e)[:300]}")
                continue
            for settings in all_settings:
                same = ties = 0
                lengths: list[int] = []
                worst_tie: float | None = None
                label = f"{dtype_name}_{pair_name}_{settings.mode}-d{settings.depth}-m{settings.total_tokens}"
                n = len(SPEC_PROMPTS)
                try:
                    for prompt, plain in zip(SPEC_PROMPTS, plains):
                        spec = SpeculativeDecoder(runner, drafter, settings).generate(prompt, cfg.spec_new_tokens,
                                                                                      greedy)
                        lengths += spec.accept_lengths
                        if spec.output_ids == plain:
                            same += 1
                            continue
                        tie = _first_difference_tie(runner, prompt, plain, spec.output_ids)
                        rel_gap = tie.gap / tie.scale if tie else float("inf")
                        worst_tie = rel_gap if worst_tie is None else max(worst_tie, rel_gap)
                        ties += rel_gap <= cfg.tol
                except Exception as e:  # recorded; the other settings and pairs still run
                    error = f"{type(e).__name__}: {str(e)[:300]}"
                    rec.check(label, False, value=error)
                    rec.row({"dtype": dtype_name, "pair": pair_name, "mode": settings.mode, "error": error})
                    continue
                if exact:
                    rec.check(label, same == n, value=f"{same}/{n} identical")
                    accepted += lengths if pair_name.startswith("permutation") else []
                else:  # bf16: a verify over m tokens rounds differently from m single-token steps
                    rec.check(label, same + ties == n, value=f"{same}/{n} identical, {ties} at near-ties",
                              limit=f"top-2 gap <= {cfg.tol} x max(1, |top-1 logit|)")
                counts["identical"] += same
                counts["runs"] += n
                rec.row({"dtype": dtype_name, "pair": pair_name, "mode": settings.mode, "depth": settings.depth,
                         "topk": settings.topk, "total_tokens": settings.total_tokens, "identical": same,
                         "prompts": n, "near_tie_differences": ties, "worst_relative_gap": worst_tie,
                         "mean_accepted": statistics.mean(lengths) if lengths else 0.0,
                         "max_accepted": max(lengths, default=0)})
    # Identical outputs with nothing ever accepted would prove little: the agreeing pairs must accept paths.
    rec.check("long_paths_accepted", bool(accepted) and max(accepted) >= 4 and sum(a >= 2 for a in accepted) >= 5,
              value=f"max {max(accepted, default=0)}, {sum(a >= 2 for a in accepted)} paths of >= 2")
    rec.data["summary"] = f"{counts['identical']}/{counts['runs']} identical to plain greedy"


# ------------------------------------------------------------------------------------------ train_step
# The target presets (conf/targets/) whose drafters the train_step geometries are: what the memory plan reads.
PLAN_TARGETS = {"embedded": "smollm2-135m-instruct", "gpt-oss-120b": "gpt-oss-120b"}


def _plan_prediction(geometry: str, geo: dict, seq_len: int, cfg: Config) -> Any:
    """The memory plan's bytes (train/plan.py) of this very step: one rank, ZeRO-3 through DeepSpeed, this
    precision and device, the section's TTT settings, an untied random head; None without a planner or a
    preset for the geometry, {"error": ...} when the planner fails (a finding, not this section's failure)."""
    target = PLAN_TARGETS.get(geometry)
    if target is None:
        return None
    try:
        from train.plan import components, describe_drafter, describe_target, settings_from_run
    except ModuleNotFoundError as e:
        if e.name == "train.plan":
            return None
        return {"error": f"{type(e).__name__}: {e}"}
    try:
        from train.config import RunConfig

        run = RunConfig(out_dir="plan")
        run.data.dir, run.data.batch_size, run.data.max_len = "plan", 1, seq_len
        run.model.draft_vocab_size = geo["draft_vocab_size"]
        run.train.ttt_steps, run.train.chunk_size, run.train.checkpoint_layer = cfg.train_ttt, cfg.train_chunk, True
        run.deepspeed.zero_stage, run.deepspeed.precision = 3, "fp32" if cfg.dry_run else "bf16"
        info = describe_target(target)
        s = settings_from_run(run, 1, seq_len, cfg.device, head_tied=False)
        rows, _ = components(info, describe_drafter(run, info), s)  # a step at exactly seq_len tokens
        return {"target": target, "plan_mb": round(sum(rows.values()) / 2**20, 1),
                "rows_mb": {k: round(v / 2**20, 1) for k, v in rows.items()}}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far (flex attention compiles per shape)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def section_train_step(cfg: Config, rec: Recorder, deadline: float) -> None:
    from bench.train_step import GEOMETRIES
    from train.engine import init_distributed

    dev = cfg.device
    precision = "fp32" if cfg.dry_run else "bf16"
    _, world = init_distributed("gloo" if dev == "cpu" else "nccl")
    rec.data.update(precision=precision, zero_stage=3, world_size=world, ttt_steps=cfg.train_ttt,
                    chunk_size=cfg.train_chunk, checkpoint_layer=True, teacher="hidden (full vocabulary)",
                    peak_mem_kind="cuda max_memory_allocated" if dev == "cuda" else "peak RSS")
    rate: dict[str, float] = {}  # seconds per token of the last timed step (the skip estimate)
    for geometry in cfg.train_geometries:
        if time.time() > deadline - 60:  # building, compiling and one short step take about a minute
            rec.data.setdefault("skipped", []).append({"geometry": geometry, "reason": "section time budget spent"})
            continue
        try:
            _train_geometry(cfg, rec, deadline, geometry, GEOMETRIES[geometry], precision, world, rate)
        except Exception as e:  # this geometry's failure is recorded; the next one still runs
            rec.data.setdefault("geometry_errors", {})[geometry] = traceback.format_exc()[-3000:]
            rec.check(f"{geometry}_built_and_stepped", False, value=f"{type(e).__name__}: {str(e)[:300]}")
        _reset_peak(dev)
    ran = [r for r in rec.data["rows"] if "tokens_per_s" in r]
    rec.check("some_step_ran", bool(ran), value=len(ran))
    skipped = [f"{r['geometry']}@{r['seq_len']}" for r in rec.data["rows"] if "skipped" in r]
    skipped += [x["geometry"] for x in rec.data.get("skipped", [])]
    rec.data["summary"] = ", ".join([f"{r['geometry']}@{r['seq_len']}: {r['tokens_per_s']:.0f} tok/s "
                                     f"{r['peak_mem_mb'] / 1024:.1f} GiB" for r in ran]
                                    + ([f"skipped (budget): {' '.join(skipped)}"] if skipped else []))


def _train_geometry(cfg: Config, rec: Recorder, deadline: float, geometry: str, geo: dict, precision: str,
                    world: int, rate: dict[str, float]) -> None:
    """The train_step rows of one drafter geometry: one engine, the lengths in increasing order."""
    import torch

    from models.attention import resolve_backend
    from train.config import DeepSpeedConfig, TrainConfig
    from train.eagle3 import Eagle3Objective
    from train.engine import Engine
    from train.trainer import micro_step
    from train.ttt import TTTSettings

    dev = cfg.device
    t0 = time.perf_counter()
    with torch.device(dev):  # random init on the device: the 120b geometry's vocabulary is 201,088 rows
        drafter, head = _build_drafter(geo, max(cfg.train_lengths), cfg.train_ttt, attn="auto")
    engine = Engine(DeepSpeedConfig(zero_stage=3, precision=precision), TrainConfig(
        ttt_steps=cfg.train_ttt, chunk_size=cfg.train_chunk, warmup_steps=0), 1000)
    head.to(engine.device, engine.dtype)
    module = engine.prepare(drafter, keep_gathered=Eagle3Objective.keep_gathered)
    objective = Eagle3Objective(TTTSettings(steps=cfg.train_ttt, chunk_size=cfg.train_chunk, checkpoint_layer=True))
    rec.data.setdefault("build_s", {})[geometry] = time.perf_counter() - t0
    for T in cfg.train_lengths:
        repeats = 1 if T > 10_000 else cfg.train_repeats
        # attention is quadratic in T, the rest linear: the steps at the last rate, plus a recompilation of
        # the attention kernels for the new length (tens of seconds)
        if "s_per_token" in rate:
            guess = (1 + repeats) * rate["s_per_token"] * T * max(1.0, T / 8192) + 40
            if time.time() + guess > deadline:
                rec.row({"geometry": geometry, "seq_len": T, "skipped": f"section time budget (~{guess:.0f} s)"})
                continue
        row: dict[str, Any] = {"geometry": geometry, "seq_len": T, "draft_vocab_size": geo["draft_vocab_size"],
                               "hidden_size": geo["hidden_size"], "vocab_size": geo["vocab_size"]}
        batch = None
        try:
            batch = _synthetic_batch(drafter, T, seed=T, device=dev)
            t1 = time.perf_counter()
            packed, _ = micro_step(engine, module, head, batch, objective, world)  # warm-up: compilation
            engine.step()
            _sync(dev)
            row["first_step_s"] = time.perf_counter() - t1
            _reset_peak(dev)
            base = torch.cuda.memory_allocated() / 2**20 if dev == "cuda" else None
            times, losses = [], []
            for _ in range(repeats):
                _sync(dev)
                t1 = time.perf_counter()
                packed, _ = micro_step(engine, module, head, batch, objective, world)
                engine.step()
                _sync(dev)
                times.append(time.perf_counter() - t1)
                losses.append(float(packed[0]))
            step_s = statistics.median(times)
            rate["s_per_token"] = step_s / T
            row.update(tokens_per_s=T / step_s, step_s=step_s, step_s_all=times, peak_mem_mb=_peak_mb(dev),
                       mem_before_step_mb=base, loss=losses[-1],
                       attn_backend=resolve_backend(module.attn_backend, engine.device, engine.dtype))
            rec.check(f"{geometry}_T{T}_loss_finite", math.isfinite(losses[-1]), value=losses[-1])
        except Exception as e:  # out of memory, a kernel's failure: recorded, the next length still tried
            row["error"] = f"{type(e).__name__}: {str(e)[:500]}"
            rec.check(f"{geometry}_T{T}_stepped", False, value=row["error"])
        row["compiled_graphs"] = _compiled_graphs()  # a recompilation storm shows as a jump here
        row["plan_prediction"] = plan = _plan_prediction(geometry, geo, T, cfg)
        if isinstance(plan, dict) and "plan_mb" in plan and row.get("peak_mem_mb"):
            row["measured_over_plan"] = row["peak_mem_mb"] / plan["plan_mb"]
        rec.row(row)
        del batch
        _reset_peak(dev)
    engine.destroy()


# ---------------------------------------------------------------------------------------------- verify
def _random_target(geo: dict[str, int], device: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**geo, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=None, pad_token_id=None)
    cfg._attn_implementation = "sdpa"  # tree verification needs an explicit-mask attention
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return model.eval().requires_grad_(False)


def section_verify(cfg: Config, rec: Recorder, deadline: float) -> None:
    from eval.budget import time_verify_forward
    from eval.target import TargetRunner

    dtype = _torch_dtype(cfg.dtype)
    rec.data.update(context=cfg.verify_context, dtype=cfg.dtype, repeats=cfg.verify_repeats,
                    meaning="median seconds of a verify forward of `block` tokens (root + m drafts, tree mask, "
                            "taps) after `context` tokens, over the same with 1 token")
    summary = []
    for name in cfg.verify_targets:
        if time.time() > deadline - 10:
            rec.data.setdefault("skipped", []).append({"target": name, "reason": "section time budget spent"})
            continue
        geo = VERIFY_TARGETS[name]
        L = geo["num_hidden_layers"]
        try:
            runner = TargetRunner(_random_target(geo, cfg.device, dtype), [1, L // 2 - 1, L - 4])
            time_verify_forward(runner, 1, cfg.verify_context, 1)  # first-call costs land here
            step = time_verify_forward(runner, 1, cfg.verify_context, cfg.verify_repeats)
            ratios = {}
            for block in cfg.verify_blocks:
                s = step if block == 1 else time_verify_forward(runner, block, cfg.verify_context, cfg.verify_repeats)
                ratios[block] = s / step
                rec.row({"target": name, "block": block, "m": block - 1, "verify_s": s, "over_step": s / step})
            rec.check(f"{name}_timed", all(math.isfinite(r) and r > 0 for r in ratios.values()), value=len(ratios))
            summary.append(f"{name} step {step * 1e3:.2f} ms, m={cfg.verify_blocks[-1] - 1}: "
                           f"{ratios[cfg.verify_blocks[-1]]:.2f}x")
        except Exception as e:  # recorded; the next target still runs
            rec.check(f"{name}_timed", False, value=f"{type(e).__name__}: {str(e)[:300]}")
        runner = None
        _reset_peak(cfg.device)
    rec.check("some_target_timed", bool(summary))
    skipped = [x["target"] for x in rec.data.get("skipped", [])]
    rec.data["summary"] = "; ".join(summary + ([f"skipped (budget): {', '.join(skipped)}"] if skipped else []))


SECTION_FNS: dict[str, Callable[[Config, Recorder, float], None]] = {
    "attention": section_attention, "zero3": section_zero3, "spec_decode": section_spec_decode,
    "train_step": section_train_step, "verify": section_verify,
}


# ------------------------------------------------------------------------------------------ the driver
def _child_env(cfg: Config) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("PYTHONWARNINGS", "ignore")
    env["HF_HUB_OFFLINE"] = "1"
    env["WANDB_MODE"] = "disabled"
    env.setdefault("OMP_NUM_THREADS", "1" if cfg.dry_run else "8")
    if cfg.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is the CPU pass, also on a machine with a GPU
    return env


def run_section(name: str, cfg: Config, workdir: Path) -> dict:
    """Run one section in a process of its own (process group: a timeout ends its children too)."""
    budget = cfg.budgets_s[name]
    result_path = workdir / f"{name}.json"
    deadline = time.time() + budget - 5
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--result", str(result_path),
           "--deadline", str(deadline)] + (["--dry-run"] if cfg.dry_run else [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=_child_env(cfg), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)

    def relay() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            print(f"[{name}] {line.rstrip()}", flush=True)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    reader.join(timeout=5)
    seconds = time.perf_counter() - t0
    data = json.loads(result_path.read_text()) if result_path.exists() else {"checks": {}, "rows": []}
    checks = data.get("checks", {})
    if timed_out:
        status = "timeout"
    elif proc.returncode != 0 or "error" in data:
        status = "error"
    elif not checks or not all(c["ok"] for c in checks.values()):
        status = "failed"
    else:
        status = "passed"
    out = {"status": status, "seconds": round(seconds, 1), "budget_s": budget, **data}
    if status != "passed":
        out["log_tail"] = list(tail)
    return out


def environment() -> dict[str, Any]:
    import platform

    import torch

    versions = {}
    for pkg in ("torch", "transformers", "deepspeed", "hydra-core", "omegaconf", "pydantic", "flash-attn", "triton"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "versions": versions,
        "cuda_available": cuda,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
        "cpus": os.cpu_count(),
    }


def default_out(dry_run: bool) -> Path:
    if dry_run:  # a dry run is no GPU result: never under bench/results/gpu/
        return Path(tempfile.mkdtemp(prefix="gpu_check_dry_")) / "gpu_check.json"
    return ROOT / "bench" / "results" / "gpu" / "gpu_check.json"


def print_table(report: dict) -> None:
    print(f"\n{'section':<12} {'status':<8} {'time':>11}  summary", flush=True)
    for name, sec in report["sections"].items():
        t = f"{sec['seconds']:.0f}/{sec['budget_s']:.0f} s"
        failed = [k for k, c in sec.get("checks", {}).items() if not c["ok"]]
        text = sec.get("summary") or ""
        if sec["status"] != "passed":
            err = (sec.get("error") or "").strip().splitlines()
            text = "; ".join(filter(None, [f"failed: {', '.join(failed[:4])}" if failed else "",
                                           err[-1][:160] if err else "", text]))
        print(f"{name:<12} {sec['status']:<8} {t:>11}  {text[:220]}", flush=True)
    mode = "DRY RUN (CPU, fp32)" if report["dry_run"] else report["environment"].get("gpu")
    print(f"total {report['total_s']:.0f} s, {mode}; all passed: {report['passed']}; JSON: {report['out']}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", default=os.environ.get("DRY_RUN", "") not in ("", "0"),
                   help="CPU pass at tiny sizes (default: the DRY_RUN environment variable)")
    p.add_argument("--out", default=None, help="the JSON report (see the module doc for the default)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--budget", action="append", default=[], metavar="SECTION=SECONDS",
                   help="override a section's time budget (e.g. a rerun of one section with more time)")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # internal: run one section
    p.add_argument("--zero3-run", default=None, help=argparse.SUPPRESS)  # internal: one run of zero3
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    cfg = make_config(args.dry_run)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in SECTIONS or not seconds:
            p.error(f"--budget {item!r}: want SECTION=SECONDS with SECTION in {list(SECTIONS)}")
        cfg = dataclasses.replace(cfg, budgets_s={**cfg.budgets_s, name: float(seconds)})

    if args.zero3_run:
        try:
            data = zero3_run(cfg, args.zero3_run)
        except Exception:
            data = {"error": traceback.format_exc()[-4000:]}
        _write_json(Path(args.result), data)
        return 1 if "error" in data else 0
    if args.section:
        rec = Recorder(Path(args.result))
        rc = 0
        try:
            SECTION_FNS[args.section](cfg, rec, args.deadline or time.time() + cfg.budgets_s[args.section])
        except Exception:
            rec.data["error"] = traceback.format_exc()[-4000:]
            print(rec.data["error"], file=sys.stderr, flush=True)
            rc = 1
        rec.flush()
        return rc

    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    env = environment()
    if not cfg.dry_run and not env["cuda_available"]:
        print("bench/gpu_check.py: no CUDA device here; DRY_RUN=1 runs the CPU pass", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else default_out(cfg.dry_run)
    t0 = time.perf_counter()
    report: dict[str, Any] = {"dry_run": cfg.dry_run, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "environment": env, "config": asdict(cfg), "tolerances": {"bf16": BF16_TOL, "fp32": FP32_TOL},
                              "sections": {}, "out": str(out)}
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        for name in wanted:
            print(f"== {name} (budget {cfg.budgets_s[name]:.0f} s)", flush=True)
            report["sections"][name] = run_section(name, cfg, Path(tmp))
            report["total_s"] = round(time.perf_counter() - t0, 1)
            report["passed"] = all(s["status"] == "passed" for s in report["sections"].values())
            _write_json(out, report)  # after every section: a killed run keeps what finished
    print_table(report)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
