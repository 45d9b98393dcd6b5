"""The memory plan (train/plan.py, launch/plan.py): exact state arithmetic, monotone growth with the context,
ZeRO-3 partitioning, the longest context that fits, the CLI offline from a preset, and a clear error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from train.config import RunConfig
from train.plan import MiB, PlanError, components, describe_drafter, describe_target, plan, settings_from_run

ROOT = Path(__file__).resolve().parents[1]
TARGET = "smollm2-135m-instruct"


def run_config(**data) -> RunConfig:
    cfg = RunConfig(out_dir="plan")
    cfg.data.dir = "plan"
    cfg.model.draft_vocab_size = 32000
    cfg.train.checkpoint_layer, cfg.train.chunk_size = True, 1024
    for k, v in data.items():
        setattr(cfg.data, k, v)
    return cfg


@pytest.fixture(scope="module")
def embedded():
    target = describe_target(TARGET)
    return target, describe_drafter(run_config(), target)


def test_drafter_state_is_exact_arithmetic_on_the_meta_drafter(embedded) -> None:
    target, drafter = embedded
    from models.eagle3 import Eagle3Config, Eagle3Drafter

    cfg = Eagle3Config.from_target_config(target.config, draft_vocab_size=32000, tap_layers=[1, 14, 26])
    with torch.device("meta"):
        model = Eagle3Drafter(cfg)
    trained = sum(p.numel() for n, p in model.named_parameters() if n != "embed_tokens.weight")
    H, q, kv, inter = 576, 9 * 64, 3 * 64, 1536
    by_hand = 3 * H * H + 2 * H * (q + 2 * kv) + q * H + 3 * H * inter + 4 * H + 32000 * H
    assert drafter.trainable == trained == by_hand
    assert drafter.frozen == 49152 * H  # the target embedding
    s = settings_from_run(run_config(batch_size=1), 1, 2048, "cpu")  # fp32 on CPU, ZeRO-3 (the default)
    rows, _ = components(target, drafter, s)
    assert rows["drafter optimizer"] == 12 * trained  # fp32 master + two fp32 Adam moments
    assert rows["drafter gradients"] == 4 * trained + 4 * trained  # the fp32 partition + the reduce bucket
    bf16 = replace(s, precision="bf16", zero_stage=0)
    rows, _ = components(target, drafter, bf16)
    assert rows["drafter optimizer"] == 12 * trained and rows["drafter gradients"] == 6 * trained


def test_grows_with_the_context(embedded) -> None:
    target, drafter = embedded
    for placement in ("offline", "online"):
        cfg = run_config(batch_size=1, source=placement)
        totals = [plan(target, drafter, settings_from_run(cfg, 1, t, "cpu")).total
                  for t in (256, 1024, 2048, 4096, 8192, 16384, 40960)]
        assert all(a < b for a, b in zip(totals, totals[1:])), totals
    online = plan(target, drafter, settings_from_run(run_config(batch_size=1, source="online"), 1, 2048, "cpu"))
    assert online.rows["target weights"] == target.params * target.dtype_bytes


def test_zero3_divides_the_state_by_the_world_size(embedded) -> None:
    target, drafter = embedded
    one = components(target, drafter, settings_from_run(run_config(batch_size=4), 1, 2048))[0]
    four = components(target, drafter, settings_from_run(run_config(batch_size=4), 4, 2048))[0]
    assert four["drafter optimizer"] * 4 == pytest.approx(one["drafter optimizer"])
    assert four["drafter weights"] < one["drafter weights"]
    zero3 = run_config(batch_size=4, source="online", target_placement="zero3")
    rows = components(target, drafter, settings_from_run(zero3, 4, 2048))[0]
    full = target.params * target.dtype_bytes
    assert rows["target weights"] == pytest.approx(full / 4 + target.largest_layer_params * target.dtype_bytes * 3 / 4)


def test_longest_context_agrees_with_the_fit_flag(embedded) -> None:
    target, drafter = embedded
    s = settings_from_run(run_config(batch_size=1), 1, 8192, "cpu")
    budget = plan(target, drafter, s).total / 2**30 * 1.5
    p = plan(target, drafter, s, device_memory_gb=budget)
    assert p.fits and p.max_context > 8192 and p.max_context % 64 == 0
    assert plan(target, drafter, replace(s, context=p.max_context), budget, search=False).fits
    assert not plan(target, drafter, replace(s, context=p.max_context + 64), budget, search=False).fits
    tight = plan(target, drafter, s, device_memory_gb=plan(target, drafter, s).total / 2**30 * 0.9)
    assert not tight.fits and tight.max_context < 8192
    assert plan(target, drafter, s, device_memory_gb=0.1).max_context == 0


def test_a_shorter_sample_with_kept_teacher_targets_sets_the_peak(embedded) -> None:
    # 4,194 loss rows x 32,000 draft ids x 8 bytes fit train/ttt.py's 1 GiB of kept teacher targets; 8K do not
    target, drafter = embedded
    p = plan(target, drafter, settings_from_run(run_config(batch_size=1), 1, 8192, "cpu"))
    assert p.total > p.at_context and "teacher targets" in " ".join(p.notes)
    assert p.at_context == pytest.approx(sum(components(target, drafter, p.settings)[0].values()))


@pytest.mark.integration
def test_module_does_not_import_deepspeed() -> None:
    code = "import sys, train.plan; assert 'deepspeed' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "launch/plan.py", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300)


@pytest.mark.integration
def test_cli_plans_gpt_oss_120b_offline_from_its_preset() -> None:
    out = _cli("model=gpt-oss-120b", "world_size=8", "device_memory_gb=141", "+exp=eagle3_ttt_40k")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "gpt-oss-120b" in text and "116.83B params" in text and "context 40960" in text
    for row in ("drafter weights", "drafter gradients", "drafter optimizer", "TTT step activations", "total (peak)"):
        assert row in text
    assert "device memory 141 GiB: fits" in text and "longest context that fits:" in text


@pytest.mark.integration
def test_cli_rejects_an_unknown_target_and_a_bad_override() -> None:
    out = _cli("model=no-such-target")
    assert out.returncode != 0 and "plan error" in out.stderr and "no-such-target" in out.stderr
    out = _cli("model=gpt-oss-120b", "train.ttt_stepz=3")
    assert out.returncode != 0 and "config error" in out.stderr and "ttt_stepz" in out.stderr


def test_bad_settings_fail_clearly(embedded) -> None:
    with pytest.raises(PlanError, match="batch_size=8 must be a multiple of the data-parallel size 3"):
        settings_from_run(run_config(batch_size=8), 3, 2048)
    with pytest.raises(PlanError, match="device='tpu'"):
        settings_from_run(run_config(), 1, 2048, "tpu")
    assert MiB == 2**20


@pytest.mark.parametrize(("arg", "message"), [
    ("world_size=0", "world_size must be > 0, got 0"),
    ("device_memory_gb=0", "device_memory_gb must be > 0, got 0"),
    ("device_memory_gb=-5", "device_memory_gb must be > 0, got -5"),
    ("context=0", "context must be > 0, got 0"),  # not the default's 2048 in disguise
    ("context=-1", "context must be > 0, got -1"),
    ("world_size=two", "world_size='two' is not a number"),
])
def test_cli_refuses_non_positive_sizes_naming_the_key(arg: str, message: str, capsys) -> None:
    from launch.plan import main as plan_main

    assert plan_main([arg]) == 2  # the user-error status, one message, no traceback
    assert capsys.readouterr().err.strip() == f"plan error: {message}"


def test_cli_lays_out_training_ranks_and_vllm_servers_per_node() -> None:
    """data.source=vllm: the training ranks hold no target; each server's devices hold its share of the weights
    (bf16: 2 bytes x 116.83B / 4 devices) and what vLLM's gpu_memory_utilization leaves of the device."""
    out = _cli("model=gpt-oss-120b", "world_size=8", "nodes=2", "device_memory_gb=80", "+exp=eagle3_ttt",
               "data.source=vllm", "vllm.tensor_parallel_size=4")
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    assert "target placement none" in text and re.search(r"\ntarget weights +0\.000\n", text)
    weights = 116.83e9 * 2 / 4 / 2**30
    assert "each of 2 node(s), 8 devices: devices 0-3 the training ranks" in text
    assert f"vLLM server 0: devices 4-7, target weights {weights:.1f} GiB per device, {0.9 * 80 - weights:.1f} GiB" in text
    out = _cli("model=gpt-oss-120b", "world_size=8", "nodes=2", "device_memory_gb=80", "+exp=eagle3_ttt",
               "data.source=vllm", "vllm.tensor_parallel_size=2")
    assert "does NOT fit at gpu_memory_utilization 0.9: raise vllm.tensor_parallel_size" in out.stdout
    out = _cli("model=gpt-oss-120b", "world_size=8", "nodes=3", "data.source=vllm")
    assert out.returncode == 2 and "world_size=8 is not a multiple of nodes=3" in out.stderr
