"""Prep's side of its vLLM servers (`vllm.*`, data_prep/config.py VLLMConfig): the servers a prep rank uses, and
the requests regeneration (regen.backend=vllm) and capture (capture.engine=vllm) send them.

    with VLLMClient(spec, cfg.vllm, rank=r, world=w, local_rank=l, log_path=out / "vllm.r0.log") as client:
        client.wait_ready()                                   # bounded by vllm.timeout_s
        client.generate([prompt ids, ...], max_tokens=256, temperature=0.0, stop_token_ids=[2])
        for key, path, choice in client.capture([(key, ids), ...]): ...   # in order; each file deleted after

Where the servers come from:
- started by prep (vllm.urls empty): one `vllm serve` per prep rank (infra/vllm_server.py: guarded, dies with
  prep), on the rank's own block of vllm.tensor_parallel_size x pipeline_parallel_size devices of its node
  (local rank l takes devices l*g .. l*g+g-1 of CUDA_VISIBLE_DEVICES, or of the node), on 127.0.0.1 and a free
  port, with the extraction when the prep captures through it (`serve_args`). Start one prep rank per server
  group of a node: 8 GPUs, TP 1 -> 8 ranks; TP 2 -> 4; TP 8 -> 1.
- the user's (vllm.urls): servers already running (one per node or more, started with `serve_args`' flags, which
  docs/scaling.md writes out); prep's ranks split them (`rank_urls`) and send a rank's requests round-robin.

Every request is `/v1/completions` with token ids in and out (`return_token_ids`): a regeneration request
samples the reply; a capture request has max_tokens=1, so its prefill computes every prompt position once, and
names where the connector writes its hidden states (`kv_transfer_params.hidden_states_path`): a file in this
launch's own directory of node-local scratch (`vllm.scratch_dir`, default $TMPDIR), new for every launch, so a
rerun never reads an earlier launch's files. A rank keeps at most vllm.max_in_flight requests in flight and at most
vllm.scratch_gb of their files on disk (a request's file counted from when it is sent until it is read and
deleted); answers are taken in the order sent, so shards are written in capture order.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.config import VLLMConfig
from infra.config_keys import ConfigError
from infra.strict_json import dumps
from infra.vllm_server import (
    API_KEY_ENV,
    VLLMServer,
    VLLMServerError,
    cli_args,
    device_group,
    post_json,
    served_model,
)

CONNECTOR = "ExampleHiddenStatesConnector"  # vLLM's own
CPU_CONNECTOR = "CPUHiddenStatesConnector"  # data_prep/vllm_plugin.py: the same without CUDA's pinned memory
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class ServerSpec:
    """What prep's servers serve: the target, its dtype and length, the extracted layers (vLLM aux layer ids;
    empty: no extraction, regeneration alone), the parallel sizes and any other engine argument."""

    model: str  # an HF directory or hub id vLLM loads
    dtype: str
    max_model_len: int
    hidden_size: int
    layer_ids: list[int] = field(default_factory=list)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    engine_kwargs: dict = field(default_factory=dict)

    def bytes_per_token(self) -> int:
        """A capture file's bytes per prompt token (hidden states of every extracted layer, and the token id)."""
        return len(self.layer_ids) * self.hidden_size * DTYPE_BYTES.get(self.dtype, 4) + 8


def serve_args(spec: ServerSpec, storage: str | Path, cuda: bool) -> list[str]:
    """The `vllm serve` flags of a prep server (host and port aside): the target; no prefix caching (every sample
    computed from its own tokens, as the HF capture does); with layer ids, vLLM's hidden-state extraction and the
    hidden-states connector writing into `storage` unless a request names its own path (`cuda`: vLLM's connector,
    else the CPU one, data_prep/vllm_plugin.py)."""
    args = ["--model", spec.model, "--dtype", spec.dtype, "--max-model-len", str(spec.max_model_len),
            "--tensor-parallel-size", str(spec.tensor_parallel_size),
            "--pipeline-parallel-size", str(spec.pipeline_parallel_size), "--no-enable-prefix-caching"]
    if spec.layer_ids:
        extract = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(spec.layer_ids)}}}
        kv = {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(storage), "allow_custom_save_path": True}}
        if not cuda:
            kv.update(kv_connector=CPU_CONNECTOR, kv_connector_module_path="data_prep.vllm_plugin")
        args += ["--speculative-config", dumps(extract), "--kv-transfer-config", dumps(kv)]
    return args + cli_args(spec.engine_kwargs)


def rank_urls(urls: list[str], rank: int, world: int) -> list[str]:
    """The user's servers a prep rank sends to: urls[rank::world] (each server to one rank), or, with fewer
    servers than ranks, urls[rank % len(urls)] (ranks share one)."""
    return list(urls[rank::world]) if len(urls) >= world else [urls[rank % len(urls)]]


def scratch_root(configured: str | None) -> Path:
    """vllm.scratch_dir, else $TMPDIR, else the system's temporary directory: node-local on a cluster."""
    return Path(configured or os.environ.get("TMPDIR") or tempfile.gettempdir()).expanduser()


@dataclass
class Endpoint:
    url: str
    key: str | None
    model: str = ""  # the name it answers to (its /v1/models), known once ready
    where: str = ""  # what an error names: the URL and, for a started server, its log


class VLLMClient:
    """A prep rank's vLLM servers (started here, or the user's vllm.urls) and its scratch directory; `with` starts
    them (returns at once: they build while prep goes on) and stops what it started, deleting the scratch."""

    def __init__(self, spec: ServerSpec, cfg: VLLMConfig, *, python: str | None, cuda: bool, rank: int, world: int,
                 local_rank: int, num_devices: int, log_path: Path):
        self.spec, self.cfg, self.log_path = spec, cfg, Path(log_path)
        self.rank, self.timeout_s = rank, cfg.timeout_s
        self.budget = int(cfg.scratch_gb * 2**30)
        if spec.layer_ids and spec.max_model_len * spec.bytes_per_token() > self.budget:
            need = spec.max_model_len * spec.bytes_per_token() / 2**30
            raise ConfigError(f"vllm.scratch_gb={cfg.scratch_gb} holds less than one sample of max_len "
                              f"({spec.max_model_len - 1} tokens: {need:.2f} GiB of hidden states); raise it")
        self.server: VLLMServer | None = None
        self.startup_s: float | None = None
        self.devices: str | None = None
        self.scratch: Path | None = None
        if cfg.urls:
            key = os.environ.get(API_KEY_ENV) or None
            self.endpoints = [Endpoint(u.rstrip("/"), key, where=f"vLLM server {u}")
                              for u in rank_urls(list(cfg.urls), rank, world)]
        else:
            if python is None:
                raise ValueError("a started server needs vllm.python")
            self.devices = device_group(local_rank, spec.tensor_parallel_size * spec.pipeline_parallel_size,
                                        num_devices, os.environ.get("CUDA_VISIBLE_DEVICES"))
            self.python, self.cuda = python, cuda
            self.endpoints = []
        self._sent = self._files = 0
        self._pool: ThreadPoolExecutor | None = None

    # -- lifetime ---------------------------------------------------------------------------------------------

    def start(self) -> VLLMClient:
        root = scratch_root(self.cfg.scratch_dir)
        root.mkdir(parents=True, exist_ok=True)
        self.scratch = Path(tempfile.mkdtemp(prefix=f"drafters-vllm-r{self.rank}-", dir=root))  # this launch's own
        if not self.cfg.urls:
            self.server = VLLMServer(self.python, serve_args(self.spec, self.scratch / "spool", self.cuda),
                                     log_path=self.log_path, devices=self.devices, scratch=self.scratch).start()
            self.endpoints = [Endpoint(self.server.url, self.server.key, where=self.server.describe())]
        self._pool = ThreadPoolExecutor(max_workers=self.cfg.max_in_flight, thread_name_prefix="vllm-request")
        return self

    def __enter__(self) -> VLLMClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()  # first: requests still in flight fail at once instead of waiting out their deadline
            self.server = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def check_alive(self) -> None:
        """VLLMServerError at once if a server prep started has exited (vLLM's reason quoted): for long work done
        beside its startup."""
        if self.server is not None:
            self.server.raise_if_dead(" while starting")

    def wait_ready(self) -> float:
        """Seconds a started server took to become healthy (0 for the user's), once every server answers."""
        self.startup_s = self.server.wait_healthy(self.timeout_s) if self.server is not None else 0.0
        for e in self.endpoints:
            e.model = served_model(e.url, e.key)
        return self.startup_s

    @property
    def where(self) -> str:
        return "; ".join(e.where for e in self.endpoints)

    # -- requests ---------------------------------------------------------------------------------------------

    def _post(self, endpoint: Endpoint, body: dict) -> dict:
        try:
            return post_json(endpoint.url + "/v1/completions", {"model": endpoint.model, **body},
                             timeout_s=self.timeout_s, key=endpoint.key, where=endpoint.where)
        except VLLMServerError as e:
            if self.server is not None:  # a connection dropped by a server on its way out: say that it exited
                deadline = time.perf_counter() + 10.0
                while self.server.alive() and time.perf_counter() < deadline:
                    time.sleep(0.1)
                self.server.raise_if_dead()  # its own message: exited, with vLLM's reason
            raise e from None

    def _file(self, name: str) -> str:
        assert self.scratch is not None, "start() first"
        return str(self.scratch / f"{name}.safetensors")

    def _stream(self, bodies: Iterable[tuple[dict, int]]) -> Iterator[dict]:
        """Send each (request body, bytes its file will take) and yield the answers in the order sent. At most
        vllm.max_in_flight requests are unanswered at a time (a new one goes out as soon as any is answered, not
        only the oldest), and at most the scratch budget's bytes are outstanding, a request counted from when it is
        sent until its answer is taken (always at least one request)."""
        assert self._pool is not None, "start() first"
        pending: deque[tuple[Future, int]] = deque()
        outstanding = 0
        todo = iter(bodies)
        nxt = next(todo, None)
        try:
            while pending or nxt is not None:
                unanswered = [f for f, _ in pending if not f.done()]
                while nxt is not None and len(unanswered) < self.cfg.max_in_flight and (
                        not pending or outstanding + nxt[1] <= self.budget):
                    endpoint = self.endpoints[self._sent % len(self.endpoints)]
                    self._sent += 1
                    future = self._pool.submit(self._post, endpoint, nxt[0])
                    pending.append((future, nxt[1]))
                    unanswered.append(future)
                    outstanding += nxt[1]
                    nxt = next(todo, None)
                if not pending[0][0].done():
                    wait(unanswered, return_when=FIRST_COMPLETED)  # each request is bounded by vllm.timeout_s
                    continue
                future, size = pending.popleft()
                yield future.result()
                outstanding -= size
        finally:
            for future, _ in pending:
                future.cancel()

    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_token_ids: list[int] | None = None) -> list[dict]:
        """Each prompt's {"token_ids", "finish_reason"} (stop | length), sampled by the servers."""
        bodies = []
        for ids in prompts:
            body = {"prompt": list(ids), "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                    "stop_token_ids": list(stop_token_ids or []), "return_token_ids": True,
                    "skip_special_tokens": False}
            if seed is not None:
                body["seed"] = seed
            size = 0
            if self.spec.layer_ids:  # an extracting server saves every request's prompt states: here, then deleted
                self._files += 1
                body["kv_transfer_params"] = {"hidden_states_path": self._file(f"gen-{self._files}")}
                size = len(ids) * self.spec.bytes_per_token()
            bodies.append((body, size))
        out = []
        for answer in self._stream(bodies):
            take_file(answer, delete=True)
            choice = answer["choices"][0]
            out.append({"token_ids": list(map(int, choice["token_ids"])), "finish_reason": choice["finish_reason"]})
        return out

    def capture(self, items: list[tuple[str, list[int]]],
                logprobs: frozenset[str] = frozenset()) -> Iterator[tuple[str, Path, dict]]:
        """Capture each (key, token ids) in order: yields (key, its hidden-states file, vLLM's own next-token
        choice: `next_token`, and for the keys in `logprobs` its top-1 at every position) and deletes the file once
        the consumer takes the next one."""
        if not self.spec.layer_ids:
            raise ValueError("these vLLM servers were started without layer ids: they cannot capture")
        bodies = []
        for key, ids in items:
            self._files += 1
            body = {"prompt": list(ids), "max_tokens": 1, "temperature": 0.0, "logprobs": 1,
                    "return_token_ids": True,
                    "kv_transfer_params": {"hidden_states_path": self._file(f"cap-{self._files}")}}
            if key in logprobs:
                body["prompt_logprobs"] = 1
            bodies.append((body, len(ids) * self.spec.bytes_per_token()))
        for (key, _), answer in zip(items, self._stream(bodies)):
            path = take_file(answer)
            if path is None:
                raise VLLMServerError(f"{self.where}: no hidden_states_path in its answer for sample {key!r}: is it "
                                      "serving with the hidden-state extraction (docs/scaling.md)?")
            try:
                yield key, path, next_tokens(answer)
            finally:
                path.unlink(missing_ok=True)


def take_file(answer: dict, delete: bool = False) -> Path | None:
    """The connector file of a finished request, once its writer has released it (None: no extraction); `delete`:
    removed at once (a regeneration request's prompt states)."""
    path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
    if path is None:
        return None
    lock = Path(path + ".lock")
    if lock.exists():
        with open(lock) as f:  # the connector's writer holds it exclusively until the file is written
            fcntl.flock(f, fcntl.LOCK_SH)
        lock.unlink(missing_ok=True)
    if not Path(path).exists():
        raise VLLMServerError(f"the vLLM server wrote its hidden states to {path}, which this prep rank cannot read: "
                              "a server of vllm.urls must run on the prep rank's node (its files are node-local)")
    if delete:
        Path(path).unlink()
    return Path(path)


def next_tokens(answer: dict) -> dict:
    """vLLM's own next-token choice for one capture request: `next_token` (what it sampled at temperature 0 after
    the last position) and its log-probability; with prompt logprobs, `top1` / `top1_logprob` at every position j
    (the rank-1 entry of position j+1's prompt logprobs, then the sampled token)."""
    choice = answer["choices"][0]
    token = int(choice["token_ids"][0])
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or [None]
    out: dict = {"next_token": token, "next_logprob": logprobs[0]}
    if choice.get("prompt_logprobs") is not None:
        top = [next((int(t), lp["logprob"]) for t, lp in d.items() if lp["rank"] == 1)
               for d in choice["prompt_logprobs"][1:]]
        out["top1"] = [*(t for t, _ in top), token]
        out["top1_logprob"] = [*(lp for _, lp in top), logprobs[0]]
    return out
