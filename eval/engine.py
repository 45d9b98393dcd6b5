"""The same prompts through a serving engine: vLLM's own server (`python -m vllm.entrypoints.openai.api_server`,
what `vllm serve` runs) with the target and our export, beside our evaluator (`engine=vllm`, eval/run.py).

- **Per category.** Every turn our evaluator decoded is sent with its exact prompt token ids (a second turn after
  our evaluator's first answer), one request at a time, greedy or with the same sampling settings and stop ids,
  category after category. vLLM's own speculative-decoding counters (`vllm:spec_decode_*` on /metrics) read
  before and after a category give its τ = 1 + accepted / drafts (vLLM counts a draft per verify step, so this is
  our τ's definition) and α per position (vLLM counts P(accepted at n); the conditional α_n = that / P(accepted at
  n-1), as ours). Tokens/s = the category's output tokens / the sum of its requests' wall times, on a server with
  the drafter and on one without.
- **Under load** (`vllm.concurrency`). First turns with `ignore_eos` (every request generates max_new_tokens)
  sent with c requests in flight, streamed: output tokens per wall second of the level, time to first token, and
  inter-token latency = (last token's arrival − first token's) / (tokens − 1) per request.
- **Draft settings** (`vllm.num_speculative_tokens`). Each value served in turn over every category; the best per
  category by tokens/s, 0 (no drafter) included.

Servers are started, watched and stopped by infra/vllm_server.py, as prep's are; prefix caching is off, so a
repeated prompt costs what a new one does.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from infra.strict_json import dumps
from infra.vllm_server import (
    API_KEY_ENV,
    cli_args,
    http_get,
    post_json,
    post_stream,
    resolve_python,
    vllm_server,
)

NO_PREFIX_CACHE = "--no-enable-prefix-caching"


def spec_counters(metrics_text: str) -> dict:
    """Sum the vllm:spec_decode_* counters (all label sets) and the per-position accepted counts."""
    out: dict = {"per_pos": {}}
    for line in metrics_text.splitlines():
        m = re.match(r"vllm:spec_decode_(\w+?)(?:_total)?(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + value
        else:
            out[name] = out.get(name, 0.0) + value
    return out


def acceptance(before: dict, after: dict, k: int) -> dict:
    """τ, conditional α per position and the raw counts between two /metrics reads (τ None without a draft)."""
    drafts = after.get("num_drafts", 0.0) - before.get("num_drafts", 0.0)
    accepted = after.get("num_accepted_tokens", 0.0) - before.get("num_accepted_tokens", 0.0)
    at = [after["per_pos"].get(i, 0.0) - before["per_pos"].get(i, 0.0) for i in range(k)]
    alpha = [(at[i] / (at[i - 1] if i else drafts)) if (at[i - 1] if i else drafts) else None for i in range(k)]
    return {"tau": 1 + accepted / drafts if drafts else None, "alpha": alpha, "drafts": int(drafts),
            "accepted": int(accepted)}


def check_export(drafter: str, preset, tokenizer) -> str:
    """Before vLLM starts: an export with non-finite weights, of a family vLLM does not serve, or trained for another
    target, stops with its reason (ExportError), as our evaluator refuses it (eval/run.py). Returns vLLM's
    speculative method for it (the family table's)."""
    from data_prep.targets import load_target_config
    from eval.target import target_fingerprint
    from models.export import CONFIG_FILE, TARGET_KEY, ExportError, check_tap_layers, check_target
    from models.export import read_weights as read_export_weights
    from models.registry import FAMILIES, family_of_export

    read_export_weights(Path(drafter))
    raw = json.loads((Path(drafter) / CONFIG_FILE).read_text())
    fam = family_of_export(raw)
    if fam.vllm_method is None:
        served = [f.label for f in FAMILIES.values() if f.vllm_method]
        raise ExportError(f"drafter {drafter} is a {fam.label} export; vLLM serves {served} drafters")
    actual = target_fingerprint(load_target_config(preset), tokenizer, preset.name)
    check_target(raw.get(TARGET_KEY), actual, f"drafter {drafter}", f"target {preset.name}")
    try:  # the layer ids vLLM will tap: in range for this target, and the ones the drafter was trained on
        cfg = fam.config_cls.from_hf_dict(raw, target_num_layers=actual["num_layers"])
    except ValueError as e:  # a config.json vLLM's loader cannot take either
        raise ExportError(f"drafter {drafter}: {e}") from None
    check_tap_layers(raw.get(TARGET_KEY), cfg.tap_layers, f"drafter {drafter}")
    return fam.vllm_method


class EngineSession:
    """Servers of one target for one evaluation: `serve(k)` is a server with the drafter drafting k tokens (k = 0:
    without it), each started, checked healthy and stopped by infra.vllm_server."""

    def __init__(self, vcfg, model: str, dtype: str, drafter: str, method: str, log_dir: Path):
        self.vcfg, self.model, self.dtype, self.method, self.log_dir = vcfg, model, dtype, method, log_dir
        self.drafter = str(Path(drafter).resolve())
        self.python = resolve_python(vcfg.python)

    @contextmanager
    def serve(self, k: int) -> Iterator[str]:
        extra = [NO_PREFIX_CACHE, *cli_args(self.vcfg.engine_kwargs)]
        if k:
            extra += ["--speculative-config", dumps({"method": self.method, "model": self.drafter,
                                                     "num_speculative_tokens": k})]
        with vllm_server(self.python, self.model, dtype=self.dtype, max_model_len=self.vcfg.max_model_len,
                         extra_args=extra, log_path=self.log_dir / f"vllm_k{k}.log",
                         timeout_s=self.vcfg.timeout_s) as base:
            yield base

    def complete(self, base: str, body: dict) -> dict:
        return post_json(base + "/v1/completions", {"model": self.model, **body}, timeout_s=self.vcfg.timeout_s,
                         key=os.environ.get(API_KEY_ENV))


def category_pass(session: EngineSession, base: str, turns: dict[tuple[str, str], list[list[int]]], body: dict,
                  k: int) -> dict[tuple[str, str], dict]:
    """Every category's turns, one request at a time -> per category: τ and α from vLLM's counters (k > 0), output
    token ids, tokens/s."""
    out = {}
    for key, prompts in turns.items():
        before = spec_counters(http_get(base + "/metrics"))
        outputs, seconds = [], 0.0
        for ids in prompts:
            t0 = time.perf_counter()
            answer = session.complete(base, {**body, "prompt": ids, "return_token_ids": True})
            seconds += time.perf_counter() - t0
            outputs.append([int(t) for t in answer["choices"][0]["token_ids"]])
        entry = acceptance(before, spec_counters(http_get(base + "/metrics")), k) if k else {}
        tokens = sum(map(len, outputs))
        out[key] = {**entry, "outputs": outputs, "new_tokens": tokens,
                    "tokens_per_s": tokens / seconds if seconds > 0 else None}
    return out


def _stream_one(session: EngineSession, base: str, ids: list[int], max_tokens: int) -> dict:
    body = {"model": session.model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    for arrived, event in post_stream(base + "/v1/completions", body, timeout_s=session.vcfg.timeout_s,
                                      key=os.environ.get(API_KEY_ENV)):
        if any(c.get("text") for c in event.get("choices") or []):
            first = first if first is not None else arrived
            last = arrived
        if event.get("usage"):
            tokens = int(event["usage"]["completion_tokens"])
    if first is None:
        return {"tokens": tokens, "ttft_s": None, "itl_s": None, "latency_s": time.perf_counter() - sent}
    return {"tokens": tokens, "ttft_s": first - sent, "latency_s": last - sent,
            "itl_s": (last - first) / (tokens - 1) if tokens > 1 else None}


def _ms(values: Sequence[float | None]) -> dict:
    xs = sorted(v * 1e3 for v in values if v is not None)
    if not xs:
        return {"mean": None, "p50": None, "p90": None}
    return {"mean": statistics.fmean(xs), "p50": xs[len(xs) // 2], "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))]}


def load_level(session: EngineSession, base: str, prompts: Sequence[list[int]], concurrency: int,
               max_tokens: int, k: int) -> dict:
    """`prompts` with `concurrency` requests in flight: output tokens per wall second, time to first token and
    inter-token latency (ms: mean, p50, p90 over requests), and with a drafter (k > 0) its τ at this load."""
    before = spec_counters(http_get(base + "/metrics"))
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda ids: _stream_one(session, base, ids, max_tokens), prompts))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    tau = acceptance(before, spec_counters(http_get(base + "/metrics")), k)["tau"] if k else None
    return {"concurrency": concurrency, "tau": tau, "requests": len(results), "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall, "ttft_ms": _ms([r["ttft_s"] for r in results]),
            "itl_ms": _ms([r["itl_s"] for r in results])}


def load_prompts_for(first_turns: Sequence[list[int]], concurrency: int, vcfg) -> list[list[int]]:
    """The requests of one load level: the first turns in order, cycled to max(min requests, rounds × c)."""
    n = max(vcfg.load_min_requests, vcfg.load_rounds * concurrency)
    return [first_turns[i % len(first_turns)] for i in range(n)]


def evaluate(session: EngineSession, turns: dict[tuple[str, str], list[list[int]]], first_turns: list[list[int]],
             body: dict, k: int, progress: bool = True) -> dict:
    """Every server this evaluation needs, one at a time: without the drafter, with k drafts, and with each other
    value of the draft-settings sweep -> {"categories": {k: per category}, "load": {k: levels}}."""
    v = session.vcfg
    ks = [0, k, *[x for x in dict.fromkeys(v.num_speculative_tokens) if x != k]]
    out: dict = {"categories": {}, "load": {}}
    for kk in ks:
        if progress:
            print(f"engine: vLLM {'without the drafter' if kk == 0 else f'with {kk} draft tokens'}", flush=True)
        with session.serve(kk) as base:
            out["categories"][kk] = category_pass(session, base, turns, body, kk)
            if v.concurrency and kk in (0, k):
                out["load"][kk] = [load_level(session, base, load_prompts_for(first_turns, c, v), c,
                                              body["max_tokens"], kk) for c in v.concurrency]
    return out
