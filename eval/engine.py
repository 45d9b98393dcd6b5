"""The same prompts through a serving engine: vLLM's own server (`python -m vllm.entrypoints.openai.api_server`,
what `vllm serve` runs) with the target and our export, beside our evaluator (`engine=vllm`, eval/run.py).

- **Per category.** Every turn our evaluator decoded is sent with its exact prompt token ids (a second turn after
  our evaluator's first answer), one request at a time, with our sampling settings stated in full (`sampling`:
  vLLM's neutral values for what our evaluator does not apply, and `--generation-config vllm` on every server, so
  no default of the model's generation_config.json, such as its top_k or repetition penalty, slips in) and our stop
  ids, category after category. vLLM's own speculative-decoding counters (`vllm:spec_decode_*` on /metrics) read
  before and after a category give its τ = 1 + accepted / drafts (vLLM counts a draft per verify step, so this is
  our τ's definition) and α per position (vLLM counts P(accepted at n); the conditional α_n = that / P(accepted at
  n-1), as ours). Tokens/s = the category's output tokens / the sum of its requests' wall times, on a server with
  the drafter and on one without.
- **Warm-up.** Every server answers one untimed request (the first prompt, `WARMUP_TOKENS` tokens) before its first
  timed category: a cold server's first request (allocation, kernel selection, the drafter's first step) would
  otherwise count in the first category's tokens/s, and so in the choice of the best draft setting.
- **Under load** (`vllm.concurrency`). First turns with `ignore_eos` (every request generates max_new_tokens)
  sent with c requests in flight, streamed: output tokens per wall second of the level, time to first token (TTFT),
  and time per output token (TPOT) = (last token's arrival − first token's) / (tokens − 1) per request.
- **Draft settings** (`vllm.num_speculative_tokens`). Each value served in turn over every category; the best per
  category by tokens/s, 0 (no drafter) included.
- **Execution mode** (`vllm.enforce_eager`). Unset: eager (`--enforce-eager`) where vLLM sees no CUDA device (its
  CPU build has no CUDA graphs to capture, and eager starts in ~35 s instead of ~2 min), CUDA graphs on a GPU, as
  vLLM serves in production; the report names the mode.
- **Device memory.** On a GPU our evaluator's target and drafter are released before the first server starts
  (eval/run.py), and each server gets `--gpu-memory-utilization` from the memory then free (`memory_share`):
  vLLM refuses to start when less than its share of the whole device is free.

Servers are started, watched and stopped by serving/server.py, as prep's are; prefix caching is off, so a
repeated prompt costs what a new one does.
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from eval.config import WARMUP_TOKENS
from infra.strict_json import dumps
from serving.server import (
    API_KEY_ENV,
    VLLMServerError,
    cli_args,
    http_get,
    post_json,
    post_stream,
    vllm_server,
)

NO_PREFIX_CACHE = "--no-enable-prefix-caching"
# vLLM's neutral sampling defaults instead of the model's generation_config.json (its top_k, repetition penalty...)
GENERATION_CONFIG = ["--generation-config", "vllm"]
# What our evaluator does not apply (eval/sampling.py: temperature, top-p, top-k only), stated in every request
NEUTRAL_SAMPLING = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
DEFAULT_MEMORY_SHARE = 0.9  # vLLM's own --gpu-memory-utilization
MEMORY_HEADROOM = 1 << 30  # bytes left free beyond the share: the server's own CUDA context and allocator
MIN_MEMORY_SHARE = 0.05  # below this no target's weights and KV cache fit: stop rather than start a doomed server
GIB = float(1 << 30)


def sampling(temperature: float, top_p: float, top_k: int, seed: int) -> dict:
    """Our evaluator's sampling settings as vLLM request parameters, every one stated (top_k 0: off on both sides,
    vLLM >= 0.32), so that neither a server default nor the model's generation_config.json decides one; the seed
    only where something is sampled."""
    out = {"temperature": temperature, "top_p": top_p, "top_k": top_k, **NEUTRAL_SAMPLING}
    if temperature > 0:
        out["seed"] = seed
    return out


def eager_mode(configured: bool | None, cuda: bool) -> tuple[bool, str]:
    """(enforce eager, why): `vllm.enforce_eager` as set, else eager only where vLLM sees no CUDA device."""
    if configured is not None:
        return configured, f"vllm.enforce_eager={str(configured).lower()}"
    if cuda:
        return False, "a CUDA device: CUDA graphs, as vLLM serves in production"
    return True, "no CUDA device, vLLM's CPU build: nothing to capture, and eager starts in seconds, not minutes"


def memory_share(free: int, total: int, configured: float | None = None) -> dict:
    """vLLM's `--gpu-memory-utilization` for a device with `free` of `total` bytes free, and why. vLLM takes that
    share of the *whole* device and refuses to start when less is free, so the share is what is free less
    `MEMORY_HEADROOM`, rounded down to a hundredth, at most vLLM's default 0.9; a configured share is kept as given.
    VLLMServerError when less than `MIN_MEMORY_SHARE` would be left (another process holds the device)."""
    base = {"free_gib": round(free / GIB, 2), "total_gib": round(total / GIB, 2)}
    if configured is not None:
        return {"share": float(configured), **base, "reason": "vllm.engine_kwargs.gpu_memory_utilization"}
    share = min(DEFAULT_MEMORY_SHARE, math.floor(100 * (free - MEMORY_HEADROOM) / total) / 100)
    if share < MIN_MEMORY_SHARE:
        raise VLLMServerError(
            f"engine=vllm: {free / GIB:.1f} GiB of the device's {total / GIB:.1f} GiB are free once our evaluator has "
            "released its target and drafter: too little for vLLM's server; free the device (another process holds "
            "it) or set vllm.engine_kwargs.gpu_memory_utilization")
    return {"share": share, **base,
            "reason": "vLLM's default 0.9" if share == DEFAULT_MEMORY_SHARE else
            f"the free memory less {MEMORY_HEADROOM / GIB:.0f} GiB for the server's own context"}


def device_memory() -> tuple[int, int] | None:
    """(free, total) bytes of the current CUDA device as the driver reports them (every process's use counted);
    None where this process's torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


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


class EngineSession:
    """Servers of one target for one evaluation: `serve(k)` is a server with the drafter drafting k tokens (k = 0:
    without it), each started, checked healthy, warmed up and stopped by serving.server. `python` and `check`:
    the vLLM install checked before anything loaded and what its check said (serving.server.ready: `version`,
    `cuda`, whether it sees a CUDA device)."""

    def __init__(self, vcfg, python: str, check: dict, model: str, dtype: str, drafter: str, method: str,
                 log_dir: Path, warmup: bool = True):
        self.vcfg, self.python, self.model, self.dtype = vcfg, python, model, dtype
        self.version, self.cuda = check.get("version"), bool(check.get("cuda"))
        self.method, self.log_dir, self.warmup = method, log_dir, warmup
        self.drafter = str(Path(drafter).resolve())
        self.eager, self.eager_reason = eager_mode(vcfg.enforce_eager, self.cuda)
        self.memory: dict | None = None  # set by place(): the device memory share and why

    def place(self) -> dict | None:
        """The device memory share of every server, decided once our evaluator has released the device (None
        without a CUDA device on either side: vLLM's CPU build sizes its KV cache by VLLM_CPU_KVCACHE_SPACE)."""
        found = device_memory() if self.cuda else None
        if found is not None:
            self.memory = memory_share(*found, self.vcfg.kwarg("gpu_memory_utilization"))
        return self.memory

    def server_args(self, k: int) -> list[str]:
        """The flags of the server with k draft tokens (0: without the drafter), beside the model, dtype and length."""
        extra = [NO_PREFIX_CACHE, *GENERATION_CONFIG, *cli_args(self.vcfg.engine_kwargs)]
        if self.memory is not None and self.vcfg.kwarg("gpu_memory_utilization") is None:
            extra += ["--gpu-memory-utilization", str(self.memory["share"])]
        if k:
            extra += ["--speculative-config", dumps({"method": self.method, "model": self.drafter,
                                                     "num_speculative_tokens": k})]
        return extra

    @contextmanager
    def serve(self, k: int) -> Iterator[str]:
        with vllm_server(self.python, self.model, dtype=self.dtype, max_model_len=self.vcfg.max_model_len,
                         extra_args=self.server_args(k), log_path=self.log_dir / f"vllm_k{k}.log",
                         timeout_s=self.vcfg.timeout_s, enforce_eager=self.eager) as base:
            yield base

    def complete(self, base: str, body: dict) -> dict:
        return post_json(base + "/v1/completions", {"model": self.model, **body}, timeout_s=self.vcfg.timeout_s,
                         key=os.environ.get(API_KEY_ENV))

    def warm_up(self, base: str, body: dict, prompt: list[int]) -> None:
        """One untimed request (`WARMUP_TOKENS` tokens of `prompt`), so a cold server's first request is not timed."""
        if self.warmup:
            self.complete(base, {**body, "prompt": prompt, "max_tokens": min(WARMUP_TOKENS, body["max_tokens"])})


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


def _stream_one(session: EngineSession, base: str, ids: list[int], body: dict) -> dict:
    """One streamed request: its output tokens, time to first token, time per output token after the first
    (TPOT) and latency, in seconds."""
    body = {"model": session.model, **body, "prompt": ids, "ignore_eos": True,
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
        return {"tokens": tokens, "ttft_s": None, "tpot_s": None, "latency_s": time.perf_counter() - sent}
    return {"tokens": tokens, "ttft_s": first - sent, "latency_s": last - sent,
            "tpot_s": (last - first) / (tokens - 1) if tokens > 1 else None}


def _ms(values: Sequence[float | None]) -> dict:
    xs = sorted(v * 1e3 for v in values if v is not None)
    if not xs:
        return {"mean": None, "p50": None, "p90": None}
    return {"mean": statistics.fmean(xs), "p50": xs[len(xs) // 2], "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))]}


def load_level(session: EngineSession, base: str, prompts: Sequence[list[int]], concurrency: int, body: dict,
               k: int) -> dict:
    """`prompts` with `concurrency` requests in flight, each generating body's max_tokens with its sampling: output
    tokens per wall second, time to first token and time per output token (ms: mean, p50, p90 over requests), and
    with a drafter (k > 0) its τ at this load."""
    before = spec_counters(http_get(base + "/metrics"))
    with ThreadPoolExecutor(concurrency) as pool:
        t0 = time.perf_counter()
        results = list(pool.map(lambda ids: _stream_one(session, base, ids, body), prompts))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    tau = acceptance(before, spec_counters(http_get(base + "/metrics")), k)["tau"] if k else None
    return {"concurrency": concurrency, "tau": tau, "requests": len(results), "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall, "ttft_ms": _ms([r["ttft_s"] for r in results]),
            "tpot_ms": _ms([r["tpot_s"] for r in results])}


def load_prompts_for(first_turns: Sequence[list[int]], concurrency: int, vcfg) -> list[list[int]]:
    """The requests of one load level: the first turns in order, cycled to max(min requests, rounds × c)."""
    n = max(vcfg.load_min_requests, vcfg.load_rounds * concurrency)
    return [first_turns[i % len(first_turns)] for i in range(n)]


def evaluate(session: EngineSession, turns: dict[tuple[str, str], list[list[int]]], first_turns: list[list[int]],
             body: dict, k: int, progress: bool = True) -> dict:
    """Every server this evaluation needs, one at a time, each warmed up before it is timed: without the drafter,
    with k drafts, and with each other value of the draft-settings sweep -> {"categories": {k: per category},
    "load": {k: levels}}. The device memory share is decided first (`EngineSession.place`)."""
    v = session.vcfg
    session.place()
    ks = [0, k, *[x for x in dict.fromkeys(v.num_speculative_tokens) if x != k]]
    load_body = {key: value for key, value in body.items() if key != "stop_token_ids"}  # every request in full
    out: dict = {"categories": {}, "load": {}}
    for kk in ks:
        if progress:
            print(f"engine: vLLM {'without the drafter' if kk == 0 else f'with {kk} draft tokens'}", flush=True)
        with session.serve(kk) as base:
            session.warm_up(base, body, first_turns[0])
            out["categories"][kk] = category_pass(session, base, turns, body, kk)
            if v.concurrency and kk in (0, k):
                out["load"][kk] = [load_level(session, base, load_prompts_for(first_turns, c, v), c, load_body, kk)
                                   for c in v.concurrency]
    return out
