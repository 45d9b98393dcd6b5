"""Cost of hidden-state capture + shard writing relative to the bare target forward (issue: prep).

    python bench/prep_overhead.py [--samples 48] [--batch-tokens 8192] [--reps 3]

On the embedded target and the SAME batches of real ShareGPT conversations, interleaved per batch:
  (a) bare forward: the target's base model (no LM head), no hooks — the floor any capture pays;
  (a') full CausalLM forward with logits (what a naive `model(input_ids)` dump costs);
  (b) forward with tap hooks + writing every sample into shards (safetensors, sha256, manifest).
Prints one JSON object (ratios b/a and b/a', bytes per token of each storage option) and writes it
to bench/results/prep_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from data_prep.capture import HiddenStateCapture, base_model
from data_prep.chat import Dropped, render_conversation
from data_prep.conversations import load_conversations
from data_prep.pipeline import Rendered, length_batches
from data_prep.shards import Sample, ShardSpec, ShardWriter, bytes_per_token
from data_prep.targets import load_target, resolve_target


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/prep_overhead.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    preset = resolve_target(None)
    model, tok = load_target(preset)
    convs, _ = load_conversations("sharegpt-embedded", max_records=args.samples * 2)
    rendered = []
    for c in convs:
        r = render_conversation(tok, c.messages, max_length=args.max_length, overflow="truncate")
        if not isinstance(r, Dropped):
            rendered.append(Rendered(c.id, torch.tensor(r.input_ids), torch.tensor(r.loss_mask, dtype=torch.bool)))
        if len(rendered) == args.samples:
            break
    batches = length_batches(rendered, args.batch_tokens)
    inputs = []
    for b in batches:
        width = max(len(s.input_ids) for s in b)
        ids = torch.zeros(len(b), width, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, s in enumerate(b):
            ids[i, : len(s.input_ids)], attn[i, : len(s.input_ids)] = s.input_ids, 1
        inputs.append((b, ids, attn))
    tokens = sum(len(s.input_ids) for s in rendered)

    spec = ShardSpec(
        target={"id": preset.hf_id, "revision": "main", "num_layers": preset.num_layers,
                "hidden_size": preset.hidden_size, "vocab_size": preset.vocab_size},
        tap_layers=preset.tap_layers,
    )
    times: dict[str, list[float]] = {"bare": [], "full": [], "capture_write": []}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for rep in range(args.reps + 1):  # rep 0 warms up
            t = {k: 0.0 for k in times}
            writer = ShardWriter(Path(tmp) / f"rep{rep}", spec)
            for b, ids, attn in inputs:
                t0 = time.perf_counter()
                base_model(model)(input_ids=ids, attention_mask=attn, use_cache=False)
                t1 = time.perf_counter()
                model(input_ids=ids, attention_mask=attn, use_cache=False)
                t2 = time.perf_counter()
                with HiddenStateCapture(model, preset.tap_layers) as cap:
                    got = cap(ids, attn)
                for i, s in enumerate(b):
                    n = len(s.input_ids)
                    writer.add(Sample(s.conversation_id, s.input_ids, s.loss_mask, got.taps[i, :n],
                                      teacher_hidden=got.final_hidden[i, :n]))
                t3 = time.perf_counter()
                t["bare"] += t1 - t0
                t["full"] += t2 - t1
                t["capture_write"] += t3 - t2
            writer.close()
            if rep:
                for k, v in t.items():
                    times[k].append(v)
    med = {k: statistics.median(v) for k, v in times.items()}
    options = {
        "hidden+bf16": bytes_per_token(spec)["total"],
        "hidden+fp8": bytes_per_token(replace(spec, taps_dtype="float8_e4m3fn"))["total"],
        "top20+fp8": bytes_per_token(replace(spec, taps_dtype="float8_e4m3fn", teacher="topk", teacher_topk=20))["total"],
        "argmax+fp8": bytes_per_token(replace(spec, taps_dtype="float8_e4m3fn", teacher="argmax"))["total"],
    }
    result = {
        "target": preset.name, "samples": len(rendered), "tokens": tokens, "batches": len(inputs),
        "threads": args.threads, "reps": args.reps,
        "seconds": med,
        "ratio_capture_write_vs_bare_forward": med["capture_write"] / med["bare"],
        "ratio_capture_write_vs_full_forward": med["capture_write"] / med["full"],
        "capture_tokens_per_s": tokens / med["capture_write"],
        "bytes_per_token": options,
    }
    print(json.dumps(result))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
