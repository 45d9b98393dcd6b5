"""Regeneration throughput: the `hf` backend (batched generate) against the `openai` backend on a real vLLM
CPU server, on the same conversations, through `make prep`'s own code (data_prep.pipeline.regenerate_split).

    python bench/regen_throughput.py --conversations 48 --hf-batch-sizes 16,48 --vllm-concurrency 16,48 \
        --vllm-python .venv-vllm/bin/python

Each configuration regenerates the first turns of the same `--conversations` ShareGPT conversations (the
prep's plan: shortest first prompts first, none too long to answer under max_length) greedily with
`--max-new-tokens`; the figure is generated reply tokens (the target's tokenizer) per wall second. One
configuration at a time, nothing else should share the machine. The vLLM server (eval.engine_check) is
started once per dtype and its start-up time is reported apart. Writes bench/results/regen_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def reply_tokens(tokenizer, convs) -> int:
    return sum(len(tokenizer(m.content, add_special_tokens=False)["input_ids"])
               for c in convs for m in c.messages if m.role == "assistant")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--hf-batch-sizes", default="16,48")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default="")
    ap.add_argument("--vllm-concurrency", default="16,48")
    ap.add_argument("--vllm-dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default="bench/results/regen_throughput.json")
    a = ap.parse_args()

    import torch

    from data_prep.config import PrepConfig
    from data_prep.conversations import load_conversations
    from data_prep.pipeline import plan_regeneration, regenerate_split
    from data_prep.targets import load_target, model_path, resolve_target

    torch.set_num_threads(a.threads)
    preset = resolve_target("smollm2-135m-instruct")
    model, tok = load_target(preset)
    cfg = PrepConfig(model=preset.name, data="sharegpt-embedded", out="unused", max_length=a.max_length)
    cfg.regen.max_new_tokens, cfg.regen.max_turns = a.max_new_tokens, 1
    pool, _ = load_conversations("sharegpt-embedded", max_records=6 * a.conversations)
    convs, _ = plan_regeneration(cfg, preset, tok, pool)
    # every n-th of the length-sorted plan: prompts of all lengths, as in a real prep
    convs = convs[:: max(1, len(convs) // a.conversations)][: a.conversations]
    rows = []

    def measure(name: str, **settings) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            done, summary = regenerate_split(cfg, preset, model if cfg.regen.backend == "hf" else None, tok, convs,
                                             Path(tmp) / "regen.jsonl")
            wall = time.perf_counter() - t0
        n = reply_tokens(tok, done)
        row = {"config": name, **settings, "conversations": len(convs), "ok": summary["ok"],
               "reply_tokens": n, "wall_s": wall, "reply_tokens_per_s": n / wall,
               "truncated_replies": summary["truncated_replies"]}
        rows.append(row)
        print(json.dumps(row), flush=True)

    for bs in [int(x) for x in a.hf_batch_sizes.split(",") if x]:
        cfg.regen.backend, cfg.regen.batch_size = "hf", bs
        measure(f"hf batch {bs}", backend="hf", batch_size=bs, threads=a.threads, dtype=preset.dtype)
    if a.vllm_python:
        from eval.engine_check import vllm_server

        logs = Path(tempfile.mkdtemp(prefix="regen_throughput."))  # private (0700), an unpredictable name
        print(f"vLLM server logs: {logs}", flush=True)
        for dtype in a.vllm_dtypes.split(","):
            t0 = time.perf_counter()
            with vllm_server(a.vllm_python, model_path(preset), dtype=dtype, max_model_len=a.max_length,
                             extra_args=["--served-model-name", preset.hf_id],
                             log_path=logs / f"vllm_{dtype}.log") as base:
                startup = time.perf_counter() - t0
                cfg.regen.backend, cfg.regen.base_url = "openai", base + "/v1"
                for c in [int(x) for x in a.vllm_concurrency.split(",") if x]:
                    cfg.regen.batch_size = cfg.regen.concurrency = c
                    measure(f"vllm {dtype} concurrency {c}", backend="openai", concurrency=c, dtype=dtype,
                            server_startup_s=startup)
    result = {"what": "reply tokens regenerated per wall second, first turns, greedy", "max_new_tokens":
              a.max_new_tokens, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
