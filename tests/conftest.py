"""Shared fixtures: the real embedded target, a tiny random target with the same tokenizer, tiny data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

TINY_CONVERSATIONS = [
    {"id": f"c{i}", "conversations": [
        {"from": "system", "value": "You are terse."} if i % 3 == 0 else None,
        {"from": "human", "value": q},
        {"from": "gpt", "value": a},
        {"from": "human", "value": "And why?"},
        {"from": "gpt", "value": f"Because {a.lower()}"},
    ]}
    for i, (q, a) in enumerate([
        ("What is 2 + 2?", "It is 4."),
        ("Name a colour.", "Blue."),
        ("Capital of France?", "Paris is the capital of France."),
        ("Say hello.", "Hello there!"),
        ("Largest planet?", "Jupiter."),
        ("Opposite of hot?", "Cold."),
        ("A prime number?", "Seven is prime."),
        ("Spell cat.", "C, A, T."),
        ("Water formula?", "H2O."),
        ("Fastest land animal?", "The cheetah."),
        ("Author of Hamlet?", "William Shakespeare."),
        ("Boiling point of water?", "100 degrees Celsius at sea level."),
    ])
]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a plain HF directory (converted once, cached)."""
    from data_prep.targets import materialise_embedded, resolve_target

    return materialise_embedded(resolve_target("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    """A 4-layer random Llama with SmolLM2's real tokenizer and chat template (fast, deterministic)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_target")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_sharegpt_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "tiny_sharegpt.json"
    records = [{"id": r["id"], "conversations": [t for t in r["conversations"] if t]} for r in TINY_CONVERSATIONS]
    out.write_text(json.dumps(records))
    return out


def run_prep(out: Path, model: str, data: str, **overrides) -> dict:
    """Run the prep pipeline in-process with typed config overrides (no Hydra)."""
    from data_prep.config import PrepConfig
    from data_prep.pipeline import run

    cfg = PrepConfig(model=model, data=data, out=str(out))
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = getattr(node, p)
        setattr(node, leaf, value)
    return run(cfg)


@pytest.fixture(scope="session")
def tiny_prep_dir(tmp_path_factory, tiny_target_dir: Path, tiny_sharegpt_file: Path) -> Path:
    """Real shards from the tiny target (no regeneration): what training and eval tests read."""
    out = tmp_path_factory.mktemp("prep")
    run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=10, eval_samples=2,
             draft_vocab_size=64, **{"regen.enabled": False})
    return out
