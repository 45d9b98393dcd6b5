"""The target split over ranks: transformers' tensor-parallel plan (capture.tensor_parallel_size for prep,
data.target_placement=tp for online training) and a ZeRO-3 target partitioned as it loads (data.target_placement=zero3,
covered with its losses by tests/test_train_online.py).

- Prep on 3 gloo processes with capture.tensor_parallel_size=3 (one group of 3: the embedded SmolLM2's 9 query / 3 KV
  heads allow 1 or 3) writes the samples a 1-process prep writes: the same regenerated replies and token ids, and
  taps and teacher equal up to the fp32 reduction order (the row-wise o_proj/down_proj all-reduce sums in another
  order), as stored in bf16.
- Online training with data.target_placement=tp on 2 processes (the tiny target: 4 query / 2 KV heads) gives the
  losses of data.target_placement=replicate.
- A group size the target's heads do not allow, or one that does not tile the world, is refused from config.json
  alone, before any weight loads.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]
ENV_DROP = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")
PREP = {"num_samples": 4, "eval_samples": 1, "max_len": 128, "dtype": "float32", "draft_vocab_size": 64,
        "regen.max_new_tokens": 8, "regen.batch_size": 4}


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    return env


def _samples(root: Path) -> dict:
    from data_prep.shards import ShardSet

    return {s.sample_id: s for s in ShardSet(root)}


def _bf16_spacing_bound(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """2^-8 x the largest magnitude of each token's hidden vector (per tap): one bf16 rounding step at that scale.
    fp32 reduction-order differences are relative to the sums' scale (the vector's), not to each element, and
    storing in bf16 turns them into at most a step of the element's own bf16 spacing, which is below this."""
    rows = x.float().unflatten(-1, (-1, hidden)).abs().amax(-1, keepdim=True)
    return (rows * 2.0**-8).expand(*rows.shape[:-1], hidden).flatten(-2)


def test_tensor_parallel_prep_writes_the_one_process_samples(tmp_path, smollm2_dir, tiny_sharegpt_file) -> None:
    from conftest import run_prep

    one = tmp_path / "one"
    run_prep(one, "smollm2-135m-instruct", str(tiny_sharegpt_file), **PREP)
    three = tmp_path / "three"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
           str(REPO / "launch" / "prep.py"), "model=smollm2-135m-instruct", f"data={tiny_sharegpt_file}",
           f"out={three}", "capture.tensor_parallel_size=3", *(f"{k}={v}" for k, v in PREP.items())]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # one group: one writer, one set of files, as a 1-process prep
    assert sorted(p.name for p in (three / "train").glob("manifest.r*.json")) == ["manifest.r0.json"]
    assert sorted(p.name for p in (three / "regen").glob("*.jsonl")) == ["eval.r0.jsonl", "train.r0.jsonl"]
    hidden = json.loads((one / "target_config.json").read_text())["hidden_size"]
    assert "distributed_config" not in json.loads((three / "target_config.json").read_text())
    for split in ("train", "eval"):
        a, b = _samples(three / split), _samples(one / split)
        assert sorted(a) == sorted(b) and a
        equal = total = 0
        for sid, x in b.items():
            y = a[sid]
            assert torch.equal(y.input_ids, x.input_ids) and torch.equal(y.loss_mask, x.loss_mask)  # same replies
            for name in ("taps", "teacher_hidden"):
                u, v = getattr(y, name), getattr(x, name)
                assert u.dtype == v.dtype == torch.bfloat16
                diff = (u.float() - v.float()).abs()
                assert bool((diff <= _bf16_spacing_bound(v, hidden)).all()), (split, sid, name, float(diff.max()))
                equal, total = equal + int((diff == 0).sum()), total + diff.numel()
        assert equal >= 0.99 * total  # measured: ~0.1% of the stored values differ, each by one bf16 step
    from safetensors import safe_open

    heads = [safe_open(str(d / "target_head.safetensors"), "pt") for d in (three, one)]
    assert heads[0].metadata() == heads[1].metadata() and sorted(heads[0].keys()) == sorted(heads[1].keys())
    for key in heads[1].keys():  # noqa: SIM118 - safe_open has no items()
        assert torch.equal(heads[0].get_tensor(key), heads[1].get_tensor(key)), key  # gathered whole from the shards


def test_two_tensor_parallel_groups_split_the_samples(tmp_path, tiny_target_dir, tiny_sharegpt_file) -> None:
    """4 processes, capture.tensor_parallel_size=2 (the tiny target's 4 query / 2 KV heads): two groups of 2, each
    capturing half of the samples and writing them as ranks 0 and 1 of 2; together the 1-process prep's samples."""
    from conftest import run_prep

    opts = {**PREP, "num_samples": 8, "eval_samples": 2, "draft_vocab_size": 32}
    one = tmp_path / "one"
    run_prep(one, str(tiny_target_dir), str(tiny_sharegpt_file), **opts)
    four = tmp_path / "four"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(REPO / "launch" / "prep.py"), f"model={tiny_target_dir}", f"data={tiny_sharegpt_file}",
           f"out={four}", "capture.tensor_parallel_size=2", *(f"{k}={v}" for k, v in opts.items())]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert sorted(p.name for p in (four / "train").glob("manifest.r*.json")) == ["manifest.r0.json", "manifest.r1.json"]
    hidden = json.loads((one / "target_config.json").read_text())["hidden_size"]
    for split in ("train", "eval"):
        a, b = _samples(four / split), _samples(one / split)
        assert sorted(a) == sorted(b) and a
        for sid, x in b.items():
            y = a[sid]
            assert torch.equal(y.input_ids, x.input_ids)
            for name in ("taps", "teacher_hidden"):
                u, v = getattr(y, name), getattr(x, name)
                assert bool(((u.float() - v.float()).abs() <= _bf16_spacing_bound(v, hidden)).all()), (sid, name)


@pytest.mark.parametrize("size, world, words", [
    (2, 2, ["9 query / 3 KV heads", "num_attention_heads 9", "num_key_value_heads 3", "[1]"]),
    (3, 2, ["larger than it"]),
    (3, 4, ["does not divide it"]),
])
def test_prep_refuses_a_tensor_parallel_size_before_any_weight_loads(tmp_path, monkeypatch, smollm2_dir,
                                                                    tiny_sharegpt_file, size, world, words) -> None:
    from transformers import AutoModelForCausalLM

    from data_prep.config import PrepConfig
    from data_prep.pipeline import preflight
    from data_prep.targets import resolve_target

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = PrepConfig(model="smollm2-135m-instruct", data=str(tiny_sharegpt_file), out=str(tmp_path))
    cfg.capture.tensor_parallel_size = size
    preset = resolve_target(cfg.model)
    with pytest.raises(ValueError, match="capture.tensor_parallel_size") as e:
        preflight(cfg, preset, preset.tap_layers)
    for w in words:
        assert w in str(e.value)


def test_online_training_with_a_tensor_parallel_target_gives_the_replicated_losses(tmp_path, tiny_prep_dir) -> None:
    """2 processes, fp32: the target split over both (one group of 2, each rank's samples gathered into one forward)
    against a whole copy per rank (one forward per sample). The features differ by the fp32 reduction order of the
    row-wise all-reduce and of the padded batch, so the losses agree to fp32 rounding, not bit for bit."""
    from train_runs import FOUR, ONLINE_COMMON, assert_close_curves, torchrun

    online = ["data.source=online"]
    torchrun(tmp_path / "replicate", tiny_prep_dir, *FOUR, *online, common=ONLINE_COMMON)
    torchrun(tmp_path / "tp", tiny_prep_dir, *FOUR, *online, "data.target_placement=tp", common=ONLINE_COMMON)
    assert_close_curves(tmp_path / "tp", tmp_path / "replicate", rtol=1e-5)


def test_online_training_refuses_a_tensor_parallel_size_before_any_weight_loads(monkeypatch, tiny_prep_dir) -> None:
    from transformers import AutoModelForCausalLM

    from data_prep.rendered import RenderedSet
    from train.config import ConfigError, DataConfig, RunConfig
    from train.online import load_frozen_target

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_weights)
    data = DataConfig(dir=str(tiny_prep_dir), source="online", target_placement="tp", target_tp_size=3)
    with pytest.raises(ConfigError, match="larger than it"):
        RunConfig(out_dir="unused", data=data).validate(2)
    with pytest.raises(ConfigError, match="does not divide it"):
        RunConfig(out_dir="unused", data=data).validate(4)
    # heads: the tiny target has 4 query / 2 KV heads, so 4 ranks in a group cannot split it
    data.target_tp_size = 4
    with pytest.raises(ValueError, match=r"4 query / 2 KV heads.*num_key_value_heads 2"):
        load_frozen_target(RenderedSet(tiny_prep_dir, "train"), data, torch.device("cpu"))


ZERO3_WORKER = r"""
import functools, json, sys
import torch
import transformers.modeling_utils as mu
from transformers.integrations import is_deepspeed_zero3_enabled
from data_prep.rendered import RenderedSet
from train.config import DataConfig, DeepSpeedConfig
from train.engine import device, init_distributed, partition_frozen
from train.online import load_frozen_target

calls, inits = [], []
loader = mu._load_state_dict_into_zero3_model
mu._load_state_dict_into_zero3_model = lambda *a, **k: calls.append(1) or loader(*a, **k)
import deepspeed
enter = deepspeed.zero.Init.__enter__
deepspeed.zero.Init.__enter__ = lambda self: inits.append(1) or enter(self)
prep, out = sys.argv[1], sys.argv[2]
rank, world = init_distributed("gloo")
ds = DeepSpeedConfig(stage3_param_persistence_threshold=0)
rendered = RenderedSet(prep, "train")
target = load_frozen_target(rendered, DataConfig(dir=prep, source="online", target_placement="zero3"), device(),
                            functools.partial(partition_frozen, ds_cfg=ds), ds)
params = list(target.model.parameters())
sample = target.samples([rendered[rank]])[0]
torch.save({"taps": sample.taps, "teacher": sample.teacher_hidden}, f"{out}/r{rank}.pt")
json.dump({"zero3_loads": len(calls), "zero_inits": len(inits), "partitioned": all(hasattr(p, "ds_id") for p in params),
           "local": sum(p.ds_tensor.numel() for p in params), "whole": sum(p.ds_numel for p in params),
           "tensors": len(params),
           "still_enabled": is_deepspeed_zero3_enabled()}, open(f"{out}/r{rank}.json", "w"))
"""


def test_zero3_target_is_partitioned_as_it_loads(tmp_path, tiny_prep_dir) -> None:
    """2 processes: transformers loads the checkpoint into ZeRO-3 partitioned parameters (its zero3 loader runs, each
    rank holds half of every tensor), drops its DeepSpeed config afterwards, and the features are a whole copy's."""
    from data_prep.rendered import RenderedSet
    from infra.processes import free_port
    from train.config import DataConfig
    from train.online import load_frozen_target

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           "--no-python", sys.executable, "-c", ZERO3_WORKER, str(tiny_prep_dir), str(tmp_path)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rendered = RenderedSet(tiny_prep_dir, "train")
    whole = load_frozen_target(rendered, DataConfig(dir=str(tiny_prep_dir), source="online"), torch.device("cpu"))
    for rank in range(2):
        got = json.loads((tmp_path / f"r{rank}.json").read_text())
        assert got["zero3_loads"] == 1 and got["partitioned"] and not got["still_enabled"], got
        assert got["zero_inits"] >= 1, got  # the modules built under deepspeed.zero.Init: partitioned as each is made
        assert got["local"] * 2 <= got["whole"] + 2 * got["tensors"], got  # half of each tensor (+ its padding)
        ref = whole.samples([rendered[rank]])[0]
        feats = torch.load(tmp_path / f"r{rank}.pt")
        assert torch.equal(feats["taps"], ref.taps) and torch.equal(feats["teacher"], ref.teacher_hidden)
