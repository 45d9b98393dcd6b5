"""The dtype each stage picks by default: bf16 on a CPU with AMX or AVX-512 BF16 (and on a bf16 GPU), fp32 on a CPU
without them; an explicit setting wins. The CPU's flags are mocked (a cpuinfo file of each kind)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infra import precision
from infra.precision import cpu_flags, cpu_has_bf16, has_native_bf16, resolve_dtype, resolve_precision

ZEN4 = "fpu vme avx2 avx512f avx512bw avx512_bf16 avx512_vnni"
SAPPHIRE_RAPIDS = "fpu vme avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile amx_int8"
AMX_ONLY = "fpu vme avx2 amx_bf16 amx_tile"
SKYLAKE = "fpu vme avx2 avx512f avx512bw avx512_vnni"
KINDS = {"zen4": (ZEN4, True), "sapphire_rapids": (SAPPHIRE_RAPIDS, True), "amx_only": (AMX_ONLY, True),
         "skylake": (SKYLAKE, False)}


def fake_cpu(monkeypatch, tmp_path: Path, flags: str) -> None:
    """This process's CPU replaced by one whose /proc/cpuinfo lists `flags`, and no environment override."""
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    monkeypatch.delenv(precision.CPU_BF16_ENV, raising=False)
    monkeypatch.setattr(precision, "cpu_flags", lambda: cpu_flags(str(info)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_cpu_flags_decide(kind: str, monkeypatch, tmp_path: Path) -> None:
    flags, bf16 = KINDS[kind]
    fake_cpu(monkeypatch, tmp_path, flags)
    assert cpu_has_bf16() is bf16
    assert has_native_bf16("cpu") is bf16 and has_native_bf16() is bf16
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if bf16 else "float32")
    assert resolve_precision("auto", torch.device("cpu")) == ("bf16" if bf16 else "fp32")
    # an explicit setting wins whatever the CPU
    assert resolve_dtype("float32", "cpu") == "float32" and resolve_precision("fp32", "cpu") == "fp32"
    assert resolve_dtype("bfloat16", "cpu") == "bfloat16" and resolve_precision("bf16", "cpu") == "bf16"


def test_the_first_cpu_flags_line_is_read(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {ZEN4}\nbugs\t\t: spectre\n")
    assert "avx512_bf16" in cpu_flags(str(info)) and "spectre" not in cpu_flags(str(info))
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()  # not Linux: no flags, fp32


def test_the_environment_overrides_the_flags(monkeypatch, tmp_path: Path) -> None:
    fake_cpu(monkeypatch, tmp_path, ZEN4)
    monkeypatch.setenv(precision.CPU_BF16_ENV, "0")
    assert resolve_dtype("auto", "cpu") == "float32"
    fake_cpu(monkeypatch, tmp_path, SKYLAKE)
    monkeypatch.setenv(precision.CPU_BF16_ENV, "1")
    assert resolve_dtype("auto", "cpu") == "bfloat16"
    monkeypatch.setenv(precision.CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match="DRAFTERS_CPU_BF16 must be 0 or 1"):
        cpu_has_bf16()


def test_a_gpu_follows_its_bf16_support(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "cuda:3") == "bfloat16" and resolve_precision("auto", "cuda") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)  # a V100
    assert resolve_dtype("auto", "cuda") == "float32"


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64", "cpu")


# ------------------------------------------------------------------------------------ each stage's choice
@pytest.mark.parametrize("kind", ["zen4", "skylake"])
def test_prep_picks_the_dtype_of_the_cpu(kind: str, monkeypatch, tmp_path: Path) -> None:
    """Prep's target (its vLLM server's --dtype, the head, the transformers target, the summary's dtype) is in the
    dtype with_preset_defaults settles on; `dtype=float32` keeps fp32 on any CPU."""
    from data_prep.config import PrepConfig
    from data_prep.pipeline import head_bytes, with_preset_defaults
    from data_prep.targets import resolve_target

    flags, bf16 = KINDS[kind]
    fake_cpu(monkeypatch, tmp_path, flags)
    preset = resolve_target("smollm2-135m-instruct")
    assert preset.dtype == "auto"
    cfg = with_preset_defaults(PrepConfig(model=preset.name, data="x", out="o"), preset)
    assert cfg.dtype == ("bfloat16" if bf16 else "float32")
    assert head_bytes(preset, cfg.dtype) == 2 * 49152 * 576 * (2 if bf16 else 4)
    pinned = with_preset_defaults(PrepConfig(model=preset.name, data="x", out="o", dtype="float32"), preset)
    assert pinned.dtype == "float32"


def test_prep_and_eval_refuse_an_unknown_dtype() -> None:
    from data_prep.config import PrepConfig
    from eval.config import EvalConfig
    from infra.config_keys import ConfigError

    with pytest.raises(ConfigError, match="dtype must be auto"):
        PrepConfig(model="m", data="x", out="o", dtype="fp32").validate()
    with pytest.raises(ValueError, match="dtype must be auto"):
        EvalConfig(drafter="d", out_dir="o", dtype="bf16").validate()


@pytest.mark.parametrize("kind", ["zen4", "skylake"])
def test_training_picks_the_precision_of_the_cpu(kind: str, monkeypatch, tmp_path: Path) -> None:
    """deepspeed.precision=auto: what the plan and the engine (train/engine.py Engine) resolve for a CPU run."""
    from train.config import RunConfig
    from train.plan import settings_from_run

    flags, bf16 = KINDS[kind]
    fake_cpu(monkeypatch, tmp_path, flags)
    cfg = RunConfig(out_dir="o")
    cfg.data.dir = "p"
    assert cfg.deepspeed.precision == "auto"
    assert settings_from_run(cfg, 1, 1024, "cpu").precision == ("bf16" if bf16 else "fp32")
    assert settings_from_run(cfg, 1, 1024, "cuda").precision == "bf16"  # a plan for GPUs, made on any machine
    cfg.deepspeed.precision = "fp32"
    assert settings_from_run(cfg, 1, 1024, "cpu").precision == "fp32"


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["zen4", "skylake"])
def test_the_target_loads_in_the_dtype_of_the_cpu(kind: str, monkeypatch, tmp_path: Path,
                                                  tiny_target_dir: Path) -> None:
    """What evaluation and online training load (data_prep.targets.load_target with no dtype of their own): the
    preset's auto, resolved for the device; an explicit dtype wins."""
    from data_prep.targets import load_target, resolve_target

    flags, bf16 = KINDS[kind]
    fake_cpu(monkeypatch, tmp_path, flags)
    preset = resolve_target(str(tiny_target_dir))  # a float32 checkpoint: storage is not the compute dtype
    assert preset.dtype == "auto"
    model, _ = load_target(preset, device="cpu")
    assert next(model.parameters()).dtype == (torch.bfloat16 if bf16 else torch.float32)
    model, _ = load_target(preset, "float32", device="cpu")
    assert next(model.parameters()).dtype == torch.float32
