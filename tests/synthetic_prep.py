"""A tiny, learnable synthetic prep dir in the real format, for tests and smoke runs.

    python tests/synthetic_prep.py <out_dir> [--train 64] [--eval 16] [--hidden 32] [--vocab 256]

Writes exactly what data_prep produces (train/ and eval/ shard sets through data_prep.shards'
ShardWriter, draft_vocab.safetensors, target_head.safetensors, target_config.json, and last a minimal
summary.json) for a made-up
8-layer Llama target. The data is learnable, so a few hundred steps show the loss fall: token
sequences follow a fixed random successor table, the taps carry the current token's embedding plus
noise, and the teacher hidden state at t is the embedding of x_{t+1} (lm_head = embedding, so the
teacher's argmax is the true next token).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from data_prep.shards import Sample, ShardSpec, ShardWriter, merge_manifests, write_prep_summary
from data_prep.vocab import VOCAB_FILE, build_draft_vocab, count_tokens, save_draft_vocab

NUM_LAYERS = 8
TAP_LAYERS = [1, NUM_LAYERS // 2 - 1, NUM_LAYERS - 4]


def target_config(hidden: int, vocab: int, heads: int = 4, kv_heads: int = 2) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }


def write_synthetic_prep(
    out: str | Path,
    n_train: int = 64,
    n_eval: int = 16,
    hidden: int = 32,
    vocab: int = 256,
    draft_vocab: int = 64,
    alphabet: int = 48,
    min_len: int = 16,
    max_len: int = 48,
    seed: int = 0,
    one_pass: bool = False,
) -> Path:
    """Write the prep dir; tokens come from `alphabet` ids spread over the vocab (all in the draft vocab
    when alphabet <= draft_vocab). one_pass: as a prep with capture.one_pass writes it (data_prep/vllm_capture.py
    OnePassCapture): each sample ends with two unmasked tokens (an end of turn and the template's newline) whose
    rows are zeros, the regeneration request never having computed them, and the shards are listed as captured
    with the regeneration (capture_pass.r0.jsonl, summary.json's capture_pass)."""
    out = Path(out)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(vocab, hidden, generator=g)
    ids = torch.randperm(vocab, generator=g)[:alphabet]
    successor = torch.randint(0, alphabet, (alphabet,), generator=g)
    spec = ShardSpec(
        target={"id": "synthetic", "revision": "0", "architecture": "LlamaForCausalLM",
                "num_layers": NUM_LAYERS, "hidden_size": hidden, "vocab_size": vocab},
        tap_layers=TAP_LAYERS,
        teacher="hidden",
        max_len=max_len,
    )

    def sample(name: str) -> Sample:
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        seq = torch.empty(n, dtype=torch.long)
        seq[0] = int(torch.randint(0, alphabet, (1,), generator=g))
        for t in range(1, n):  # mostly the successor, sometimes a random jump
            jump = torch.rand(1, generator=g).item() < 0.1
            seq[t] = int(torch.randint(0, alphabet, (1,), generator=g)) if jump else successor[seq[t - 1]]
        input_ids = ids[seq]
        loss_mask = torch.zeros(n, dtype=torch.bool)
        loss_mask[n // 3 :] = True  # a "prompt" third, then the "assistant" tokens
        e = embed[input_ids]
        taps = torch.cat([e + 0.1 * torch.randn(n, hidden, generator=g) for _ in TAP_LAYERS], dim=-1)
        nxt = torch.cat([e[1:], e[-1:]])  # teacher at t: the next token's embedding
        teacher = 4 * nxt
        if one_pass:
            loss_mask[-2:] = False
            taps[-2:], teacher[-2:] = 0, 0
        return Sample(name, input_ids, loss_mask, taps.bfloat16(), teacher_hidden=teacher.bfloat16())

    for split, count in (("train", n_train), ("eval", n_eval)):
        writer = ShardWriter(out / split, spec, rank=0, tokens_per_shard=max(1, count * max_len // 3))
        for i in range(count):
            writer.add(sample(f"{split}-{i}"))
        writer.close()
        merge_manifests(out / split)

    from data_prep.shards import ShardSet

    counts = count_tokens(((s.input_ids, s.loss_mask) for s in ShardSet(out / "train")), vocab)
    d2t, t2d = build_draft_vocab(counts, draft_vocab)
    save_draft_vocab(out / VOCAB_FILE, d2t, t2d, counts)
    save_file(
        {"embed_tokens.weight": embed.contiguous(), "norm.weight": torch.ones(hidden),
         "lm_head.weight": embed.clone().contiguous()},
        str(out / "target_head.safetensors"),
    )
    (out / "target_config.json").write_text(json.dumps(target_config(hidden, vocab), indent=1))
    summary = {"target": spec.target, "samples": {"train": n_train, "eval": n_eval}, "eval_samples_requested": n_eval}
    if one_pass:
        summary.update(_one_pass_record(out))
    write_prep_summary(out, summary)
    return out


def _one_pass_record(out: Path) -> dict:
    """Every shard listed as OnePassCapture lists what it writes, and the summary's record of it, counted by the
    prep's own capture_passes."""
    from data_prep.shards import Manifest
    from data_prep.vllm_capture import CAPTURE_PASS_FILE, WITH_REGENERATION, capture_passes

    passes = {}
    for split in ("train", "eval"):
        shards = Manifest.from_file(out / split / "manifest.json").shards
        (out / split / CAPTURE_PASS_FILE.format(rank=0)).write_text("".join(
            json.dumps({"shard": s.file, "samples": len(s.sample_ids), "capture_pass": WITH_REGENERATION}) + "\n"
            for s in shards))
        passes[split] = capture_passes(out / split, shards)
    return {"capture_pass": passes,
            "one_pass": {"enabled": True, "not_covered": {"train": 0, "eval": 0}, "next_token_agreement": None}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--train", type=int, default=64)
    ap.add_argument("--eval", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    write_synthetic_prep(a.out, a.train, a.eval, a.hidden, a.vocab, a.draft_vocab, max_len=a.max_len, seed=a.seed)
    print(a.out)


if __name__ == "__main__":
    main()
