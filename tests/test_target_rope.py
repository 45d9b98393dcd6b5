"""Every drafter family rotates as its target does, up to the trained length (40,960 positions): the llama3 and yarn
scalings pinned as training exports them (a yarn factor the target derives from its own max_position_embeddings
stays the target's), and for targets with per-layer-type rotary settings (Gemma-3: sliding and full attention) the
full-attention layers' settings, checked against transformers' own rotary embedding for those layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from synthetic_prep import TAP_LAYERS, write_synthetic_prep
from transformers import Gemma3TextConfig, LlamaConfig
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from models.config import FULL_ATTENTION, rope_from_hf
from train.build import load_head
from train.config import RunConfig
from train.objective import make_objective

LONG = 40960
POSITIONS = torch.tensor([[0, 1, 4095, 8191, 8192, 20000, 32767, 40000, LONG - 1]])
ROPES = {  # transformers-4 spellings for the Llama-layout targets
    "llama3": {"rope_theta": 500000.0, "max_position_embeddings": 131072,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}},
    "yarn-no-factor": {"rope_theta": 10000.0, "max_position_embeddings": 16384,
                       "rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}},
    "gemma3": {},  # per-layer-type rope_parameters, transformers 5 (gemma3_config)
}


def gemma3_config() -> Gemma3TextConfig:
    return Gemma3TextConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=32768,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})


def _prep(root: Path, rope: str) -> tuple[Path, dict]:
    prep = write_synthetic_prep(root, n_train=4, n_eval=2, min_len=12, max_len=24)
    path = prep / "target_config.json"
    target = json.loads(path.read_text())
    target = {**target, **ROPES[rope]} if rope != "gemma3" else {**gemma3_config().to_dict(), "hidden_size": 32}
    path.write_text(json.dumps(target))
    return prep, target


def reference_rotation(rope: str, target: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of transformers' own rotary embedding at POSITIONS (Gemma-3: its full-attention layers')."""
    x = torch.zeros(1, dtype=torch.float32)
    if rope == "gemma3":
        return Gemma3RotaryEmbedding(gemma3_config())(x, POSITIONS, FULL_ATTENTION)
    hf = LlamaConfig(**{k: v for k, v in target.items() if k not in ("architectures", "model_type")})
    return LlamaRotaryEmbedding(hf)(x, POSITIONS)


def test_per_layer_type_rope_takes_the_full_attention_layers() -> None:
    cfg = gemma3_config().to_dict()
    assert set(cfg["rope_parameters"]) == {"full_attention", "sliding_attention"}
    assert rope_from_hf(cfg) == (1e6, {"rope_type": "linear", "factor": 8.0})
    without = {**cfg, "rope_parameters": {"sliding_attention": cfg["rope_parameters"]["sliding_attention"],
                                          "chunked_attention": {"rope_type": "default"}}}
    with pytest.raises(ValueError, match="without 'full_attention' settings"):
        rope_from_hf(without)


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("method", ["eagle3", "eagle1", "dflash"])
def test_every_drafter_family_rotates_as_the_target(tmp_path: Path, method: str, rope: str) -> None:
    prep, target = _prep(tmp_path, rope)
    cfg = RunConfig(out_dir=str(tmp_path / "run"))
    cfg.model.method, cfg.data.max_len = method, LONG
    if method == "dflash":
        cfg.model.tap_layers = list(TAP_LAYERS)
        cfg.model.dflash.num_layers, cfg.model.dflash.mask_token_id = 1, 0
    drafter = make_objective(cfg).build_drafter(prep, list(TAP_LAYERS), load_head(prep))
    assert drafter.cfg.max_position_embeddings == max(LONG, target["max_position_embeddings"])
    cos, sin = drafter.rotary(POSITIONS, torch.float32)
    torch.testing.assert_close((cos, sin), reference_rotation(rope, target), atol=2e-5, rtol=1e-5)
    # the export says the same: its config read back gives the same rotation
    again = type(drafter.cfg).from_hf_dict(drafter.cfg.to_hf_dict())
    assert (again.rope_theta, again.rope_scaling) == (drafter.cfg.rope_theta, drafter.cfg.rope_scaling)
    if rope == "yarn-no-factor":  # pinned to the target's own 16384 / 4096, not the trained 40960 / 4096
        assert drafter.cfg.rope_scaling["factor"] == 4.0
