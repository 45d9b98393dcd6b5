"""The dtype a stage computes in by default: bf16 where the device has bf16 matrix units, fp32 elsewhere.

A GPU that supports bf16 runs it natively. So does a CPU with AMX (`amx_bf16`: Sapphire Rapids and later) or
AVX-512 BF16 (`avx512_bf16`: Cooper Lake, Zen 4 and later), the CPUs vLLM's CPU backend targets: their bf16
matrix products run at 2-5x the fp32 rate (bench/results/stage_dtypes.json measures this machine). A CPU without
either emulates bf16 slower than fp32, so it keeps fp32.

Every stage asks here when its setting is `auto` (prep's and eval's `dtype`, the target presets' `dtype`,
training's `deepspeed.precision`); an explicit value always wins, so fp32 is one setting away. The environment
variable DRAFTERS_CPU_BF16=0/1 overrides what the CPU's flags say (tests pin it, so their numbers do not depend
on the machine that runs them).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
CPU_BF16_ENV = "DRAFTERS_CPU_BF16"
DTYPES = ("float32", "bfloat16", "float16")


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags (Linux's /proc/cpuinfo); empty where there is no such file."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bf16 matrix products natively (AMX or AVX-512 BF16), or what
    DRAFTERS_CPU_BF16 says."""
    forced = os.environ.get(CPU_BF16_ENV)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{CPU_BF16_ENV} must be 0 or 1, got {forced!r}")
        return forced == "1"
    return any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)


def compute_device() -> str:
    """Where this process computes: "cuda" when a GPU is visible, else "cpu"."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def has_native_bf16(device: str | torch.device | None = None) -> bool:
    """Whether `device` (default: `compute_device()`) computes bf16 natively."""
    kind = torch.device(device or compute_device()).type
    if kind == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return kind == "cpu" and cpu_has_bf16()


def resolve_dtype(dtype: str, device: str | torch.device | None = None) -> str:
    """A dtype name (`DTYPES`) for a setting that may be "auto": bfloat16 where `device` has native bf16,
    float32 elsewhere."""
    if dtype == "auto":
        return "bfloat16" if has_native_bf16(device) else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {dtype!r}")
    return dtype


def resolve_precision(precision: str, device: str | torch.device | None = None) -> str:
    """Training's `deepspeed.precision`: "auto" -> "bf16" where `device` has native bf16, else "fp32"."""
    if precision != "auto":
        return precision
    return "bf16" if has_native_bf16(device) else "fp32"
