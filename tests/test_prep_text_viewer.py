"""data_prep.viewer: trained spans highlighted, CLI on a JSONL and on a prep dir of shards."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from text_fixtures import tiny_tokenizer

from data_prep.chat import render_conversation
from data_prep.conversations import Message
from data_prep.viewer import OFF, ON, format_sample, main

CONV = [
    Message("user", "Hello there!"),
    Message("assistant", "Hi!"),
    Message("user", "Bye"),
    Message("assistant", "Ciao"),
]
BRACKETED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n⟦Hi!<|im_end|>⟧\n"
    "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n⟦Ciao<|im_end|>⟧\n"
)


def test_format_sample_marks_exactly_the_trained_tokens() -> None:
    tok = tiny_tokenizer("chatml_smollm2")
    s = render_conversation(tok, CONV, max_len=512)
    assert format_sample(tok, s.input_ids, s.loss_mask, color=False) == BRACKETED
    colored = format_sample(tok, s.input_ids, s.loss_mask, color=True)
    assert colored.count(ON) == 2 and colored.count(OFF) == 2
    assert colored.replace(ON, "⟦").replace(OFF, "⟧") == BRACKETED
    assert format_sample(tok, [], [], color=False) == ""


def test_cli_on_jsonl(tmp_path: Path, capsys) -> None:
    tok = tiny_tokenizer("chatml_smollm2")
    tok.save_pretrained(tmp_path / "tokenizer")
    s = render_conversation(tok, CONV, max_len=512)
    other = render_conversation(tok, CONV[:2], max_len=512)
    path = tmp_path / "samples.jsonl"
    path.write_text(
        "\n".join(json.dumps({"input_ids": r.input_ids, "loss_mask": r.loss_mask}) for r in (other, s))
    )
    assert main([str(path), "--index", "1", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert out == f"# sample 1: {len(s.input_ids)} tokens, {sum(s.loss_mask)} trained\n{BRACKETED}\n"


def test_cli_on_prep_dir(tmp_path: Path, capsys) -> None:
    from data_prep.shards import Sample, ShardSpec, ShardWriter, merge_manifests

    tok = tiny_tokenizer("chatml_smollm2")
    tok.save_pretrained(tmp_path / "tokenizer")
    s = render_conversation(tok, CONV, max_len=512)
    n = len(s.input_ids)
    spec = ShardSpec(
        target={"id": "t", "revision": "r", "num_layers": 4, "hidden_size": 4, "vocab_size": len(tok)},
        tap_layers=[1],
        teacher="argmax",
    )
    w = ShardWriter(tmp_path / "eval", spec)
    w.add(
        Sample(
            "conv-7",
            torch.tensor(s.input_ids),
            torch.tensor(s.loss_mask, dtype=torch.bool),
            torch.zeros(n, 4, dtype=torch.bfloat16),
            teacher_argmax=torch.zeros(n, dtype=torch.long),
        )
    )
    w.close()
    merge_manifests(tmp_path / "eval")
    assert main([str(tmp_path), "--split", "eval", "--no-color"]) == 0
    assert (
        capsys.readouterr().out == f"# sample conv-7: {n} tokens, {sum(s.loss_mask)} trained\n{BRACKETED}\n"
    )
