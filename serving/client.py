"""The one client of vLLM's servers: prep's regeneration and capture, vLLM-fed training, on-policy rollouts.

    with VLLMClient(spec, cfg.vllm, python=..., cuda=..., rank=r, local_rank=l, log_path=out / "vllm.r0.log") as client:
        client.wait_ready()                                   # bounded by vllm.timeout_s
        stream = client.stream()
        stream.submit("a", {"prompt": ids, "max_tokens": 256, ...})   # each request its own max_tokens
        for done in stream.completed():                       # as they complete, whatever their order
            ...; stream.submit(...)                           # more work may go in while results come out
        client.generate([prompt ids, ...], max_tokens=[256, 64], stop_token_ids=[2])   # in order, one call
        for key, path, choice in client.capture([(key, ids), ...]): ...   # in order; each file deleted after

Where the servers come from:
- started by the caller (vllm.urls empty): prep starts one `vllm serve` per prep rank (serving/server.py: guarded,
  dies with prep), on the rank's own block of vllm.tensor_parallel_size x pipeline_parallel_size devices of its
  node (`devices`), on 127.0.0.1 and a free port, with the extraction when the prep captures through it
  (`serve_args`); training starts its node's servers itself and hands them over (`started`).
- the user's (vllm.urls, and only those): servers already running (one per node or more, started with
  `serve_args`' flags, which docs/scaling.md writes out). A rank uses the servers of its own node (`node_urls`: its
  files are node-local), the node's ranks splitting them. A guard started without a server removes the launch's
  scratch once the caller is gone, however it ended.

Every request is `/v1/completions` with token ids in and out (`return_token_ids`). A request that names where the
connector writes its hidden states (`kv_transfer_params.hidden_states_path`: a file in this launch's own directory
of node-local scratch, `vllm.scratch_dir`, new for every launch) is sent whole, since only a whole answer carries
the connector's `kv_transfer_params` (the file it wrote, checked against the one asked); every other request
(regeneration on a server that does not extract, rollouts) is streamed, its tokens arriving as they are generated.

What a stream holds to:
- at most vllm.max_in_flight requests in flight per server, over every stream of the client; a request goes to the
  server with the fewest in flight, and a new one goes out as soon as any is answered;
- at most vllm.scratch_gb of connector files outstanding over every stream of the client (a request's file counted
  from when it is sent until the caller has taken its result and asked for the next), but for one request per
  stream: a stream whose budget the others hold still sends one, so that no stream waits on another's consumer
  (training's held-out stream beside its lookahead): the worst case is scratch_gb + one sample per open stream;
- a deadline per request: a streamed request that shows no progress (no token) for vllm.timeout_s fails naming its
  server, whatever other requests do; a whole request waits as long as its server makes progress (an answer, or a
  rise of its token counters on /metrics, within vllm.timeout_s);
- a stop signal (`should_stop`, the caller's StopSignals) ends the wait at once with Preempted, and a server that
  fails after the signal (SLURM signals every process of the step: vLLM exits on SIGTERM) is the stop, not an error.

The HTTP side is httpx's asynchronous client on one event loop thread per client (a connection pool, streamed
answers, a timeout per request); the caller's thread submits, takes results and checks deadlines and signals.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from infra.config_keys import ConfigError
from infra.preemption import Preempted
from infra.strict_json import dumps
from serving.config import VLLMConfig
from serving.server import (
    API_KEY_ENV,
    VLLMServer,
    VLLMServerError,
    cli_args,
    http_get,
    model_card,
    progress_counters,
)
from serving.states import received_file

VLLM_PLUGIN = "serving.plugin"  # what vLLM's python imports of ours: --check, the CPU hidden-states connector
CONNECTOR = "ExampleHiddenStatesConnector"  # vLLM's own
CPU_CONNECTOR = "CPUHiddenStatesConnector"  # serving/plugin.py: the same without CUDA's pinned memory
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SIGNAL_LAG_S = 2.0  # how long a failed request waits for the stop signal that may have caused it to be seen
POLL_S = 0.5  # how often the caller's thread looks at signals and deadlines while it waits for a result


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

    def file_bytes_per_token(self) -> int:
        """A connector file's bytes per prompt token (hidden states of every extracted layer, and the token id)."""
        return len(self.layer_ids) * self.hidden_size * DTYPE_BYTES.get(self.dtype, 4) + 8


def serve_args(spec: ServerSpec, storage: str | Path, cuda: bool) -> list[str]:
    """The `vllm serve` flags of a server the project starts (host and port aside): the target; with layer ids, no
    prefix caching (every sample's states computed from its own tokens, as the HF capture does; a server that only
    generates keeps vLLM's prefix caching: a conversation's next turn reuses its earlier turns), vLLM's hidden-state
    extraction and the
    hidden-states connector writing into `storage` unless a request names its own path (`cuda`: vLLM's connector,
    else the CPU one, serving/plugin.py)."""
    args = ["--model", spec.model, "--dtype", spec.dtype, "--max-model-len", str(spec.max_model_len),
            "--tensor-parallel-size", str(spec.tensor_parallel_size),
            "--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
    if spec.layer_ids:
        args.append("--no-enable-prefix-caching")
        extract = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(spec.layer_ids)}}}
        kv = {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(storage), "allow_custom_save_path": True}}
        if not cuda:
            kv.update(kv_connector=CPU_CONNECTOR, kv_connector_module_path=VLLM_PLUGIN)
        args += ["--speculative-config", dumps(extract), "--kv-transfer-config", dumps(kv)]
    return args + cli_args(spec.engine_kwargs)


def node_names() -> set[str]:
    """The names this node answers to, lower-case: its hostname, short and fully qualified, and SLURM's name of it."""
    host = socket.gethostname()
    names = {host, host.split(".")[0], socket.getfqdn(), os.environ.get("SLURMD_NODENAME", "")}
    return {n.lower() for n in names if n}


def _addresses(host: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def is_this_node(host: str, names: set[str]) -> bool:
    """Whether `host` (a URL's host) is this node: one of its names, a loopback address, or an address its own
    hostname resolves to."""
    host = host.lower()
    if host in names or host.split(".")[0] in names or host in ("localhost", "::1") or host.startswith("127."):
        return True
    mine = set().union(*(_addresses(n) for n in names)) - {""}
    return bool(_addresses(host) & mine)


def node_urls(servers: list[tuple[str | None, str]], names: set[str], local_rank: int, local_world: int) -> list[str]:
    """The user's servers a prep rank sends to: those of its node (an entry node=URL whose node is one of `names`,
    or a URL whose host is this node), split over the node's ranks (local rank l takes mine[l::local_world], or
    mine[l % len] when the node has fewer servers than ranks). ConfigError when the node has none: a server's
    files are written on its own node, where only that node's ranks can read them."""
    from urllib.parse import urlsplit

    mine = [url for node, url in servers
            if (node.lower() in names or node.lower().split(".")[0] in names if node is not None
                else is_this_node(urlsplit(url).hostname or "", names))]
    if not mine:
        listed = ", ".join(f"{n}={u}" if n else u for n, u in servers)
        raise ConfigError(f"vllm.urls has no server on this prep rank's node ({', '.join(sorted(names))}): {listed}. "
                          "A server writes its hidden-state files on its own node, so each node's ranks need a "
                          "server there: list one per node (its URL by the node's name or address, or node=URL)")
    return list(mine[local_rank::local_world]) if len(mine) >= local_world else [mine[local_rank % len(mine)]]


def scratch_root(configured: str | None) -> Path:
    """vllm.scratch_dir, else $TMPDIR, else the system's temporary directory: node-local on a cluster."""
    return Path(configured or os.environ.get("TMPDIR") or tempfile.gettempdir()).expanduser()


@dataclass
class Endpoint:
    url: str
    key: str | None
    model: str = ""  # the name it answers to (its /v1/models), known once ready
    where: str = ""  # what an error names: the URL and, for a started server, its log
    server: VLLMServer | None = None  # the process, where this rank started it: its exit is seen with its reason
    in_flight: int = 0  # requests of this client on it now, over every stream
    whole: int = 0  # of those, the ones sent whole (their deadline is the server's progress: `Silence`)
    silence: Silence | None = None


class Silence:
    """vllm.timeout_s as a bound on a server's silence while it has whole requests in flight: `answered()` on every
    answer; `check()` raises VLLMServerError once neither an answer nor a rise of the server's token counters came
    for `timeout_s`."""

    def __init__(self, timeout_s: float, counters: Callable[[], float | None], where: str):
        self.timeout_s, self.counters, self.where = timeout_s, counters, where
        self.answered()

    def answered(self) -> None:
        self.since, self.seen = time.monotonic(), None

    def check(self) -> None:
        quiet = time.monotonic() - self.since
        if self.seen is None and quiet >= self.timeout_s / 2:
            self.seen = self.counters()  # the baseline a later reading is compared with
        if quiet < self.timeout_s:
            return
        now = self.counters()
        if now is not None and self.seen is not None and now != self.seen:
            self.since, self.seen = time.monotonic(), now  # working on requests that have not answered yet
            return
        raise VLLMServerError(f"{self.where}: no answer and no progress for {self.timeout_s:.0f} s with requests in "
                              "flight (vllm.timeout_s)")


class ScratchBudget:
    """Bytes of connector files outstanding, over every stream of a client, against vllm.scratch_gb."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self._lock = threading.Lock()

    def take(self, n: int, force: bool = False) -> bool:
        with self._lock:
            if not force and self.used + n > self.limit:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


@dataclass
class Completion:
    """One finished request: its tag, the server's answer in the shape of a whole /v1/completions answer
    ({"choices": [{"token_ids", "finish_reason", ...}], "kv_transfer_params"?}), the server that answered and the
    connector-file bytes it held in the budget."""

    tag: Any
    answer: dict
    endpoint: Endpoint
    file_bytes: int = 0

    @property
    def choice(self) -> dict:
        return self.answer["choices"][0]


@dataclass
class _Sent:
    tag: Any
    endpoint: Endpoint
    file_bytes: int
    whole: bool


class _Loop:
    """One asyncio event loop on a thread of its own, running every request of a client on httpx's async client."""

    def __init__(self):
        import httpx  # lazy: installed with the openai package; only a client of servers needs it

        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the progress bars
        self.httpx = httpx
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-client", daemon=True)
        self.thread.start()
        # a connection per request, none kept alive: a kept one that the server closes as it is reused (its keep-alive
        # timeout) would fail a request that never reached it; a local connect costs nothing beside a forward
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
        self.http = self.call(self._make(limits)).result()

    async def _make(self, limits):
        return self.httpx.AsyncClient(limits=limits, timeout=None)

    def call(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        async def shut() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.http.aclose()

        try:
            self.call(shut()).result(timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)
            self.loop.close()

    async def request(self, endpoint: Endpoint, body: dict, whole: bool, timeout_s: float) -> dict:
        """One /v1/completions request; VLLMServerError naming the server for a refusal, a connection lost, a torn
        answer or, streamed, no token for timeout_s."""
        httpx = self.httpx
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {endpoint.key}"}
                                                           if endpoint.key else {})}
        url = endpoint.url + "/v1/completions"
        payload = {"model": endpoint.model, **body}
        where = endpoint.where
        try:
            if whole:  # no read deadline here: the server's progress bounds the wait (Silence)
                r = await self.http.post(url, content=dumps(payload).encode(), headers=headers,
                                         timeout=httpx.Timeout(30.0, read=None, pool=None))
                if r.status_code >= 400:
                    raise VLLMServerError(f"{where} refused a request with HTTP {r.status_code}: {r.text[:500]}")
                try:
                    return json.loads(r.content.decode())
                except ValueError as e:
                    raise VLLMServerError(f"{where} sent a torn answer ({type(e).__name__}: {str(e)[:200]})") from None
            payload.update(stream=True)
            # the read deadline is the request's own: no bytes (no token) for timeout_s fails this request alone
            timeout = httpx.Timeout(30.0, read=timeout_s, pool=None)
            async with self.http.stream("POST", url, content=dumps(payload).encode(), headers=headers,
                                        timeout=timeout) as r:
                if r.status_code >= 400:
                    detail = (await r.aread()).decode(errors="replace")[:500]
                    raise VLLMServerError(f"{where} refused a request with HTTP {r.status_code}: {detail}")
                return await _gather_stream(r, where)
        except httpx.ReadTimeout:
            raise VLLMServerError(f"{where}: a request showed no progress for {timeout_s:.0f} s "
                                  "(vllm.timeout_s)") from None
        except httpx.TimeoutException as e:
            raise VLLMServerError(f"{where} cannot be reached in time ({type(e).__name__})") from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:  # the server went away mid-answer
            raise VLLMServerError(f"{where} sent a torn answer ({type(e).__name__}: {str(e)[:200]})") from None
        except httpx.HTTPError as e:  # refused, reset: the server is gone or unreachable
            raise VLLMServerError(f"{where} cannot be reached: {type(e).__name__}: {str(e)[:200]}") from None


async def _gather_stream(r, where: str) -> dict:
    """A streamed answer's server-sent events gathered into a whole answer's shape: every event's token ids in
    order, the last finish_reason seen."""
    token_ids: list[int] = []
    finish = None
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        try:
            event = json.loads(data)
        except ValueError as e:
            raise VLLMServerError(f"{where} sent a torn event ({e})") from None
        if "error" in event:
            raise VLLMServerError(f"{where} failed a request: {str(event['error'])[:300]}")
        for c in event.get("choices") or []:
            token_ids += c.get("token_ids") or []
            finish = c.get("finish_reason") or finish
    return {"choices": [{"token_ids": token_ids, "finish_reason": finish}]}


class RequestStream:
    """One caller's requests: `submit` queues one (sent as soon as a server has room and the byte budget allows),
    `feed` queues an iterable of them lazily, `completed()` yields each result as it completes until nothing is
    queued or in flight (the caller may submit more while iterating). A request's file bytes go back to the budget
    when the caller asks for the next result. `close()` (also on leaving a `with`) cancels what is in flight."""

    def __init__(self, client: VLLMClient):
        self.client = client
        self._queued: deque[tuple[Any, dict, int]] = deque()
        self._feed: Iterator[tuple[Any, dict, int]] | None = None
        self._sent: dict[Future, _Sent] = {}
        self._done: queue.SimpleQueue[Future] = queue.SimpleQueue()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, tag: Any, body: dict, file_bytes: int = 0) -> None:
        self._queued.append((tag, body, file_bytes))

    def feed(self, requests: Iterable[tuple[Any, dict, int]]) -> None:
        """(tag, body, file bytes) triples, taken one at a time as there is room (after what `submit` queued)."""
        self._feed = iter(requests)

    @property
    def in_flight(self) -> int:
        return len(self._sent)

    def _next_queued(self) -> tuple[Any, dict, int] | None:
        if self._queued:
            return self._queued[0]
        if self._feed is not None:
            nxt = next(self._feed, None)
            if nxt is None:
                self._feed = None
                return None
            self._queued.append(nxt)
            return nxt
        return None

    def _dispatch(self) -> None:
        client = self.client
        while (nxt := self._next_queued()) is not None:
            endpoint = min(client.endpoints, key=lambda e: e.in_flight)
            if endpoint.in_flight >= client.cfg.max_in_flight:
                return
            tag, body, size = nxt
            if not client.budget.take(size, force=not self._sent):  # always at least one request of this stream
                return
            self._queued.popleft()
            whole = "kv_transfer_params" in body
            future = client.loop.call(client.loop.request(endpoint, body, whole, client.timeout_s))
            self._sent[future] = _Sent(tag, endpoint, size, whole)
            future.add_done_callback(self._done.put)
            endpoint.in_flight += 1
            if whole:
                if endpoint.whole == 0:
                    endpoint.silence = Silence(client.timeout_s, lambda e=endpoint: progress_counters(e.url), endpoint.where)
                endpoint.whole += 1

    def _watch(self) -> None:
        for e in {s.endpoint.url: s.endpoint for s in self._sent.values() if s.whole}.values():
            if e.silence is not None:
                e.silence.check()

    def completed(self) -> Iterator[Completion]:
        client = self.client
        while True:
            self._dispatch()
            if not self._sent:
                if self._next_queued() is None:
                    return
                continue
            if client.stop_ends_waits and client.stopped():
                raise Preempted(client.stopped())
            try:
                future = self._done.get(timeout=POLL_S)
            except queue.Empty:
                try:
                    self._watch()
                except VLLMServerError as e:
                    raise client.engine_error(e) from None
                continue
            sent = self._sent.pop(future)
            e = sent.endpoint
            e.in_flight -= 1
            if sent.whole:
                e.whole -= 1
                if e.silence is not None:
                    e.silence.answered()
            try:
                answer = client.answer(future, e)
            except BaseException:
                client.budget.give(sent.file_bytes)
                raise
            done = Completion(sent.tag, answer, e, sent.file_bytes)
            try:
                yield done
            finally:  # a caller that keeps the file longer set file_bytes to 0 and gives them back itself
                client.budget.give(done.file_bytes)

    def close(self) -> None:
        for future, sent in list(self._sent.items()):
            future.cancel()
            sent.endpoint.in_flight -= 1
            sent.endpoint.whole -= sent.whole
            self.client.budget.give(sent.file_bytes)
        self._sent.clear()
        self._queued.clear()
        self._feed = None


class VLLMClient:
    """A rank's vLLM servers (started here, handed over by the caller, or the user's vllm.urls) and its scratch
    directory; `with` starts them (returns at once: they build while the caller goes on) and stops what it started,
    deleting the scratch."""

    def __init__(self, spec: ServerSpec, cfg: VLLMConfig, *, python: str | None = None, cuda: bool = False,
                 rank: int, log_path: Path, local_rank: int = 0, local_world: int = 1, devices: str | None = None,
                 started: list[Endpoint] | None = None, should_stop: Callable[[], int] | None = None,
                 stop_ends_waits: bool = True):
        self.spec, self.cfg, self.log_path = spec, cfg, Path(log_path)
        self.rank, self.local_world, self.timeout_s = rank, local_world, cfg.timeout_s
        self.should_stop = should_stop  # the stop signal received, if any (the caller's StopSignals)
        # False: a signal alone does not end a wait (training stops at its next step boundary, its step's features
        # answered by a server still running); a server failing after one is still the stop
        self.stop_ends_waits = stop_ends_waits
        self.budget = ScratchBudget(int(cfg.scratch_gb * 2**30))
        if spec.layer_ids and spec.max_model_len * spec.file_bytes_per_token() > self.budget.limit:
            need = spec.max_model_len * spec.file_bytes_per_token() / 2**30
            raise ConfigError(f"vllm.scratch_gb={cfg.scratch_gb} holds less than one sample of max_len "
                              f"({spec.max_model_len - 1} tokens: {need:.2f} GiB of hidden states); raise it")
        self.server: VLLMServer | None = None
        self.guard: VLLMServer | None = None  # servers not started here: the guard alone, removing the scratch
        self.startup_s: float | None = None
        self.devices: str | None = None
        self.scratch: Path | None = None
        self.loop: _Loop | None = None
        self._files = 0
        if started is not None:  # the caller's own servers (training starts its node's)
            self.endpoints = list(started)
        elif cfg.urls:
            key = os.environ.get(API_KEY_ENV) or None
            self.endpoints = [Endpoint(u, key, where=f"vLLM server {u}")
                              for u in node_urls(cfg.servers(), node_names(), local_rank, local_world)]
        else:
            if python is None:
                raise ValueError("a started server needs vllm.python")
            self.devices = devices  # the rank's block of the node's devices (data_prep/pipeline.py rank_devices)
            self.python, self.cuda = python, cuda
            self.endpoints = []
        self.starts_server = started is None and not cfg.urls

    # -- lifetime ---------------------------------------------------------------------------------------------

    def start(self) -> VLLMClient:
        root = scratch_root(self.cfg.scratch_dir)
        root.mkdir(parents=True, exist_ok=True)
        if self.spec.layer_ids:
            free = shutil.disk_usage(root).free
            if free < self.budget.limit * self.local_world:
                raise ConfigError(
                    f"vllm.scratch_gb={self.cfg.scratch_gb} per rank x {self.local_world} ranks on this node = "
                    f"{self.cfg.scratch_gb * self.local_world:g} GiB of node-local scratch, but {root} "
                    f"(vllm.scratch_dir, else $TMPDIR) has {free / 2**30:.1f} GiB free: lower vllm.scratch_gb or "
                    "point vllm.scratch_dir at a larger node-local disk")
        self.scratch = Path(tempfile.mkdtemp(prefix=f"drafters-vllm-r{self.rank}-", dir=root))  # this launch's own
        if self.starts_server:
            self.server = VLLMServer(self.python, serve_args(self.spec, self.scratch / "spool", self.cuda),
                                     log_path=self.log_path, devices=self.devices, scratch=self.scratch,
                                     startup_timeout_s=self.timeout_s).start()
            self.endpoints = [Endpoint(self.server.url, self.server.key, where=self.server.describe(),
                                       server=self.server)]
        else:
            self.guard = VLLMServer(None, None, log_path=Path(os.devnull), scratch=self.scratch,
                                    grace_s=min(30.0, self.timeout_s)).start()
        self.loop = _Loop()
        return self

    def __enter__(self) -> VLLMClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self.loop is not None:  # requests in flight fail at once instead of being waited for
            self.loop.close()
            self.loop = None
        for started in (self.server, self.guard):
            if started is not None:
                started.close()
        self.server = self.guard = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def check_starting(self) -> None:
        """VLLMServerError at once if a server this client started has exited or is past its start-up deadline
        (vLLM's reason quoted): for long work done beside its start-up."""
        if self.server is not None:
            self.server.check_starting()

    def wait_ready(self) -> float:
        """Seconds until every server answers /health (a server this rank started is watched for its exit, its
        reason quoted; the others are polled), all within vllm.timeout_s, and serves at least the spec's
        max_model_len; Preempted at once on a stop signal."""
        start = time.monotonic()
        for e in self.endpoints:
            if e.server is not None:
                e.server.wait_healthy(self.timeout_s)
                continue
            while True:
                if self.stopped():
                    raise Preempted(self.stopped())
                try:
                    http_get(e.url + "/health", timeout_s=5.0)
                    break
                except OSError:
                    if time.monotonic() - start > self.timeout_s:
                        raise VLLMServerError(f"{e.where} was not healthy within {self.timeout_s:.0f} s "
                                              "(vllm.timeout_s)") from None
                    time.sleep(1.0)
        self.startup_s = time.monotonic() - start
        for e in self.endpoints:
            card = model_card(e.url, e.key)
            e.model = str(card["id"])
            served = card.get("max_model_len")
            if served is not None and int(served) < self.spec.max_model_len:
                raise ConfigError(f"{e.where} serves max_model_len {served}, but {self.spec.max_model_len} is needed "
                                  "(the longest request + 1): start it with --max-model-len of at least that")
        return self.startup_s

    @property
    def where(self) -> str:
        return "; ".join(e.where for e in self.endpoints)

    @property
    def capacity(self) -> int:
        """Requests the client keeps in flight at most: vllm.max_in_flight on each of its servers."""
        return self.cfg.max_in_flight * max(1, len(self.endpoints))

    # -- requests ---------------------------------------------------------------------------------------------

    def stream(self) -> RequestStream:
        assert self.loop is not None, "start() first"
        return RequestStream(self)

    def stopped(self) -> int:
        return self.should_stop() if self.should_stop is not None else 0

    def answer(self, future: Future, endpoint: Endpoint) -> dict:
        """A finished request's answer: VLLMServerError for a request the server aborted (vLLM answers what is in
        flight with finish_reason "abort" as it shuts down) or failed, and Preempted instead once a stop signal
        came (`engine_error`)."""
        try:
            answer = future.result()
            reason = ((answer.get("choices") or [{}])[0]).get("finish_reason")
            if reason not in ("stop", "length"):
                raise VLLMServerError(f"{endpoint.where} ended a request with finish_reason {reason!r}")
            return answer
        except VLLMServerError as e:
            raise self.engine_error(e) from None

    def engine_error(self, error: VLLMServerError) -> BaseException:
        """What to raise for an engine error: Preempted when a stop signal came with it (SLURM signals the servers
        as well as the caller: vLLM exits on SIGTERM, aborting what is in flight, and its files may not be
        written); else, for a connection lost with a server this rank started, that server's own message once it
        has exited (vLLM's reason); else the error itself."""
        deadline = time.monotonic() + SIGNAL_LAG_S
        while not self.stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.stopped():
            return Preempted(self.stopped())
        for e in self.endpoints:
            if e.server is None or e.url not in str(error) or self._lost_only(error):
                continue
            deadline = time.monotonic() + 10.0
            while e.server.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            try:
                e.server.raise_if_dead()
            except VLLMServerError as exited:
                return exited
        return error

    @staticmethod
    def _lost_only(error: VLLMServerError) -> bool:
        """An error that is the request's own (a refusal, a deadline), not a connection lost with the server."""
        text = str(error)
        return "refused a request" in text or "no progress" in text or "finish_reason" in text

    def _file(self, name: str) -> str:
        assert self.scratch is not None, "start() first"
        return str(self.scratch / f"{name}.safetensors")

    def generation_request(self, ids: list[int], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                           seed: int | None = None, stop_token_ids: list[int] | None = None,
                           keep_states: bool = False) -> tuple[dict, int]:
        """(body, file bytes) of one generation request. On an extracting server every request's states are
        written (a file is asked for: the request is sent whole); `keep_states` asks for those of the prompt and of
        every generated token but the last (`include_output_tokens`: the last sampled token is never fed through
        the model)."""
        if keep_states and not self.spec.layer_ids:
            raise ValueError("these vLLM servers were started without layer ids: they write no states to keep")
        body: dict = {"prompt": list(ids), "max_tokens": int(max_tokens), "temperature": temperature, "top_p": top_p,
                      "stop_token_ids": list(stop_token_ids or []), "return_token_ids": True,
                      "skip_special_tokens": False}
        if seed is not None:
            body["seed"] = int(seed)
        size = 0
        if self.spec.layer_ids:  # an extracting server saves every request's states: here, kept or deleted
            self._files += 1
            body["kv_transfer_params"] = {"hidden_states_path": self._file(f"gen-{self._files}")}
            if keep_states:
                body["kv_transfer_params"]["include_output_tokens"] = True
            size = (len(ids) + (max_tokens if keep_states else 0)) * self.spec.file_bytes_per_token()
        return body, size

    def generated(self, done: Completion, body: dict, keep_states: bool) -> dict:
        """A generation request's result: {"token_ids", "finish_reason"}, and with `keep_states` its states file
        as "states" (the caller deletes it); without it an extracting server's file, the prompt's states alone, is
        deleted here."""
        choice = done.choice
        out = {"token_ids": list(map(int, choice["token_ids"])), "finish_reason": choice["finish_reason"]}
        asked = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
        if asked is not None:
            try:
                path = received_file(done.answer, asked, done.endpoint.where, timeout_s=self.timeout_s)
            except VLLMServerError as e:
                raise self.engine_error(e) from None
            if keep_states:
                out["states"] = path
            else:
                path.unlink()  # the prompt's states alone: the capture pass computes the sample's
        return out

    def generate(self, prompts: list[list[int]], *, max_tokens: int | list[int], temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | list[int] | None = None, stop_token_ids: list[int] | None = None,
                 keep_states: bool = False) -> list[dict]:
        """Each prompt's `generated` result, in order, from one stream of concurrent requests; `max_tokens` and
        `seed` one for all or one per prompt. A call that fails hands no kept file on."""
        n = len(prompts)
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * n
        seeds = seed if isinstance(seed, list) else [seed] * n
        bodies = [self.generation_request(ids, max_tokens=m, temperature=temperature, top_p=top_p, seed=s,
                                          stop_token_ids=stop_token_ids, keep_states=keep_states)
                  for ids, m, s in zip(prompts, budgets, seeds)]
        out: list[dict | None] = [None] * n
        try:
            with self.stream() as stream:
                for i, (body, size) in enumerate(bodies):
                    stream.submit(i, body, size)
                for done in stream.completed():
                    out[done.tag] = self.generated(done, bodies[done.tag][0], keep_states)
        except BaseException:
            for o in out:
                if o is not None and "states" in o:
                    o["states"].unlink(missing_ok=True)
            raise
        return out  # type: ignore[return-value]

    def capture(self, items: Iterable[tuple[str, list[int]]],
                logprobs: frozenset[str] = frozenset()) -> Iterator[tuple[str, Path, dict]]:
        """Capture each (key, token ids) in order: yields (key, its hidden-states file, vLLM's own next-token
        choice: `next_token`, and for the keys in `logprobs` its top-1 at every position) and deletes the file once
        the consumer takes the next one. Requests go out ahead of the consumer (bounded by vllm.max_in_flight and
        the byte budget); answers that come early wait, their files counted, until their turn."""
        if not self.spec.layer_ids:
            raise ValueError("these vLLM servers were started without layer ids: they cannot capture")

        def requests():
            for i, (key, ids) in enumerate(items):
                self._files += 1
                body = {"prompt": list(ids), "max_tokens": 1, "temperature": 0.0, "logprobs": 1,
                        "return_token_ids": True,
                        "kv_transfer_params": {"hidden_states_path": self._file(f"cap-{self._files}")}}
                if key in logprobs:
                    body["prompt_logprobs"] = 1
                yield (i, key, body), body, len(ids) * self.spec.file_bytes_per_token()

        early: dict[int, tuple[str, dict, dict, int]] = {}
        turn = 0
        with self.stream() as stream:
            stream.feed(requests())
            for done in stream.completed():
                i, key, body = done.tag
                early[i] = (key, body, done.answer, done.file_bytes)
                done.file_bytes = 0  # counted until the consumer is done with the file, below
                while turn in early:
                    key, body, answer, size = early.pop(turn)
                    turn += 1
                    try:
                        path = received_file(answer, body["kv_transfer_params"]["hidden_states_path"], self.where,
                                             key, self.timeout_s)
                    except VLLMServerError as e:
                        self.budget.give(size)
                        raise self.engine_error(e) from None
                    try:
                        yield key, path, next_tokens(answer)
                    finally:
                        path.unlink(missing_ok=True)
                        self.budget.give(size)


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
