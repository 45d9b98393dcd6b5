"""Positions at 40K: the drafter rotates as the target does (llama3 / yarn scaling taken from it), and a run at
data.max_len=40960 exports max_position_embeddings >= 40960 with the target's rope scaling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from synthetic_prep import write_synthetic_prep
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from models.eagle3 import Eagle3Drafter
from train.config import ModelConfig, RunConfig, register_configs
from train.eagle3 import eagle3_config

ROOT = Path(__file__).resolve().parents[1]
LONG = 40960
LLAMA31 = {  # Llama-3.1-8B-Instruct's rope, transformers-4 spelling
    "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}
QWEN3_YARN = {  # Qwen3's documented long-context setting
    "rope_theta": 1000000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
}
YARN_NO_FACTOR = {  # factor derived as max_position_embeddings / original (transformers), target max < 40960
    "rope_theta": 10000.0, "max_position_embeddings": 16384,
    "rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096},
}


def _prep(root: Path, rope: dict) -> Path:
    prep = write_synthetic_prep(root, n_train=4, n_eval=2, min_len=12, max_len=24)
    path = prep / "target_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **rope}))
    return prep


@pytest.mark.parametrize("rope", [LLAMA31, QWEN3_YARN, YARN_NO_FACTOR], ids=["llama3", "yarn", "yarn-no-factor"])
def test_drafter_rotates_as_the_target_at_40k(tmp_path: Path, rope: dict) -> None:
    prep = _prep(tmp_path, rope)
    target = json.loads((prep / "target_config.json").read_text())
    cfg = eagle3_config(ModelConfig(), prep, [1, 3, 4], LONG)
    assert cfg.max_position_embeddings == max(LONG, rope["max_position_embeddings"])
    given = {k: v for k, v in rope["rope_scaling"].items() if v is not None}
    assert cfg.rope_theta == rope["rope_theta"] and given.items() <= cfg.rope_scaling.items()
    pos = torch.tensor([[0, 1, 4095, 8191, 8192, 20000, 32767, 40000, LONG - 1]])
    hf = LlamaConfig(**{k: v for k, v in target.items() if k not in ("architectures", "model_type")})
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1), pos)
    cos, sin = Eagle3Drafter(cfg).rotary(pos, torch.float32)
    torch.testing.assert_close((cos, sin), (ref_cos, ref_sin), atol=2e-5, rtol=1e-5)
    # and exported as the engines read it back
    exported = cfg.to_hf_dict()
    assert exported["rope_scaling"] == cfg.rope_scaling and exported["max_position_embeddings"] >= LONG


def test_40k_preset_keeps_k_and_saves_memory() -> None:
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = RunConfig.from_omegaconf(compose("train", overrides=["+exp=eagle3_ttt_40k", "data.dir=/p", "out_dir=/o"]))
    assert cfg.data.max_len == LONG and cfg.data.overflow == "split" and cfg.train.ttt_steps == 7
    assert cfg.train.checkpoint_layer and cfg.train.chunk_size <= 2048 and cfg.deepspeed.zero_stage == 3
    assert cfg.train.epochs == 10  # eagle3_ttt's schedule, inherited
    assert cfg.validate(world_size=8).data.batch_size == 8  # one sequence per rank on 8 GPUs


@pytest.mark.integration
def test_training_at_40k_exports_long_positions_and_the_target_rope(tmp_path: Path) -> None:
    """The 40K preset end to end on CPU (short synthetic samples, so the run is small)."""
    prep, out = _prep(tmp_path / "prep", LLAMA31), tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "+exp=eagle3_ttt_40k", f"data.dir={prep}",
           f"out_dir={out}", "train.max_steps=1", "data.batch_size=2", "data.eval_batch_size=2",
           "data.eval_max_samples=2", "train.eval_interval=0", "logger.wandb_mode=disabled", "logger.progress=false"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["max_position_embeddings"] >= LONG
    assert config["rope_scaling"] == LLAMA31["rope_scaling"] and config["rope_theta"] == LLAMA31["rope_theta"]
    assert config["rope_parameters"]["rope_type"] == "llama3"
