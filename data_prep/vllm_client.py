"""Prep's side of its vLLM servers (`vllm.*`, data_prep/config.py VLLMConfig): the servers a prep rank uses, and
the requests regeneration (regen.backend=vllm) and capture (capture.engine=vllm) send them.

    with VLLMClient(spec, cfg.vllm, rank=r, world=w, local_rank=l, devices="2,3", log_path=out / "vllm.r0.log") as client:
        client.wait_ready()                                   # bounded by vllm.timeout_s
        client.generate([prompt ids, ...], max_tokens=256, temperature=0.0, stop_token_ids=[2])
        client.generate([prompt ids, ...], max_tokens=256, keep_states=True)  # + each reply's states file
        for key, path, choice in client.capture([(key, ids), ...]): ...   # in order; each file deleted after

Where the servers come from:
- started by prep (vllm.urls empty): one `vllm serve` per prep rank (infra/vllm_server.py: guarded, dies with
  prep), on the rank's own block of vllm.tensor_parallel_size x pipeline_parallel_size devices of its node
  (`devices`: local rank l takes devices l*g .. l*g+g-1 of CUDA_VISIBLE_DEVICES, or of the devices vLLM's own check
  counts on the node; data_prep/pipeline.py rank_devices), on 127.0.0.1 and a free port, with the extraction when the prep captures through it (`serve_args`).
  Start one prep rank per server group of a node: 8 GPUs, TP 1 -> 8 ranks; TP 2 -> 4; TP 8 -> 1.
- the user's (vllm.urls): servers already running (one per node or more, started with `serve_args`' flags, which
  docs/scaling.md writes out). A rank uses the servers of its own node (`node_urls`: its files are node-local), the
  node's ranks splitting them; a rank sends its requests round-robin over its share. A guard started without a
  server removes the launch's scratch once prep is gone, however it ended.

Every request is `/v1/completions` with token ids in and out (`return_token_ids`): a regeneration request
samples the reply, and on an extracting server with capture.one_pass it also keeps the states of its prompt and
reply (`kv_transfer_params.include_output_tokens`: vLLM's connector then saves every token fed through the model,
the prompt and each generated token but the last); a capture request has max_tokens=1, so its prefill computes every
prompt position once. Each names where the connector writes its hidden states
(`kv_transfer_params.hidden_states_path`): a file in this
launch's own directory of node-local scratch (`vllm.scratch_dir`, default $TMPDIR), new for every launch, so a
rerun never reads an earlier launch's files; an answer naming any other file is refused. A rank keeps at most
vllm.max_in_flight requests in flight and at most vllm.scratch_gb of their files on disk (a request's file counted
from when it is sent until it is read and deleted); answers are taken in the order sent, so shards are written in
capture order.

Deadlines: vllm.timeout_s bounds a server's start-up and its silence: while requests are in flight, an answer or a
rise of the server's token counters (/metrics) within vllm.timeout_s is progress; a request may wait in vLLM's queue
as long as the server makes progress. A stop signal (`should_stop`, prep's StopSignals) ends the wait at once with
Preempted, and a server that fails after the signal (SLURM signals every process of the step: vLLM exits on
SIGTERM) is the stop, not an error.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from data_prep.config import VLLMConfig
from infra.config_keys import ConfigError
from infra.preemption import Preempted
from infra.strict_json import dumps
from infra.vllm_server import (
    API_KEY_ENV,
    VLLMServer,
    VLLMServerError,
    abort,
    cli_args,
    model_card,
    post_json,
    progress_counters,
)

VLLM_PLUGIN = "data_prep.vllm_plugin"  # what vLLM's python imports of ours: --check, the CPU hidden-states connector
CONNECTOR = "ExampleHiddenStatesConnector"  # vLLM's own
CPU_CONNECTOR = "CPUHiddenStatesConnector"  # data_prep/vllm_plugin.py: the same without CUDA's pinned memory
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
SIGNAL_LAG_S = 2.0  # how long a failed request waits for the stop signal that may have caused it to be seen


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


class Silence:
    """vllm.timeout_s as a bound on a server's silence: `answered()` on every answer; `check()` raises
    VLLMServerError once neither an answer nor a rise of the servers' token counters came for `timeout_s`."""

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


class VLLMClient:
    """A prep rank's vLLM servers (started here, or the user's vllm.urls) and its scratch directory; `with` starts
    them (returns at once: they build while prep goes on) and stops what it started, deleting the scratch."""

    def __init__(self, spec: ServerSpec, cfg: VLLMConfig, *, python: str | None, cuda: bool, rank: int, world: int,
                 local_rank: int, log_path: Path, local_world: int = 1, devices: str | None = None,
                 should_stop: Callable[[], int] | None = None):
        self.spec, self.cfg, self.log_path = spec, cfg, Path(log_path)
        self.rank, self.local_world, self.timeout_s = rank, local_world, cfg.timeout_s
        self.should_stop = should_stop  # the stop signal received, if any (prep's StopSignals)
        self.budget = int(cfg.scratch_gb * 2**30)
        if spec.layer_ids and spec.max_model_len * spec.file_bytes_per_token() > self.budget:
            need = spec.max_model_len * spec.file_bytes_per_token() / 2**30
            raise ConfigError(f"vllm.scratch_gb={cfg.scratch_gb} holds less than one sample of max_len "
                              f"({spec.max_model_len - 1} tokens: {need:.2f} GiB of hidden states); raise it")
        self.server: VLLMServer | None = None
        self.guard: VLLMServer | None = None  # with vllm.urls: the guard alone, removing the scratch
        self.startup_s: float | None = None
        self.devices: str | None = None
        self.scratch: Path | None = None
        if cfg.urls:
            key = os.environ.get(API_KEY_ENV) or None
            self.endpoints = [Endpoint(u, key, where=f"vLLM server {u}")
                              for u in node_urls(cfg.servers(), node_names(), local_rank, local_world)]
        else:
            if python is None:
                raise ValueError("a started server needs vllm.python")
            self.devices = devices  # the rank's block of the node's devices (data_prep/pipeline.py rank_devices)
            self.python, self.cuda = python, cuda
            self.endpoints = []
        self._sent = self._files = 0
        self._pool: ThreadPoolExecutor | None = None
        self._open: set = set()  # the HTTP connections of requests in flight (aborted on close)

    # -- lifetime ---------------------------------------------------------------------------------------------

    def start(self) -> VLLMClient:
        root = scratch_root(self.cfg.scratch_dir)
        root.mkdir(parents=True, exist_ok=True)
        if self.spec.layer_ids:
            free = shutil.disk_usage(root).free
            if free < self.budget * self.local_world:
                raise ConfigError(
                    f"vllm.scratch_gb={self.cfg.scratch_gb} per prep rank x {self.local_world} ranks on this node = "
                    f"{self.cfg.scratch_gb * self.local_world:g} GiB of node-local scratch, but {root} "
                    f"(vllm.scratch_dir, else $TMPDIR) has {free / 2**30:.1f} GiB free: lower vllm.scratch_gb or "
                    "point vllm.scratch_dir at a larger node-local disk")
        self.scratch = Path(tempfile.mkdtemp(prefix=f"drafters-vllm-r{self.rank}-", dir=root))  # this launch's own
        if not self.cfg.urls:
            self.server = VLLMServer(self.python, serve_args(self.spec, self.scratch / "spool", self.cuda),
                                     log_path=self.log_path, devices=self.devices, scratch=self.scratch,
                                     startup_timeout_s=self.timeout_s).start()
            self.endpoints = [Endpoint(self.server.url, self.server.key, where=self.server.describe())]
        else:
            self.guard = VLLMServer(None, None, log_path=Path(os.devnull), scratch=self.scratch,
                                    grace_s=min(30.0, self.timeout_s)).start()
        self._pool = ThreadPoolExecutor(max_workers=self.cfg.max_in_flight, thread_name_prefix="vllm-request")
        return self

    def __enter__(self) -> VLLMClient:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        abort(self._open)  # requests in flight to the user's servers fail at once instead of being waited for
        for started in (self.server, self.guard):
            if started is not None:
                started.close()  # a started server first: its requests still in flight fail at once
        self.server = self.guard = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def check_starting(self) -> None:
        """VLLMServerError at once if a server prep started has exited or is past its start-up deadline (vLLM's
        reason quoted): for long work done beside its start-up."""
        if self.server is not None:
            self.server.check_starting()

    def wait_ready(self) -> float:
        """Seconds a started server took to become healthy (0 for the user's), once every server answers and
        serves at least prep's max_model_len."""
        self.startup_s = self.server.wait_healthy(self.timeout_s) if self.server is not None else 0.0
        for e in self.endpoints:
            card = model_card(e.url, e.key)
            e.model = str(card["id"])
            served = card.get("max_model_len")
            if served is not None and int(served) < self.spec.max_model_len:
                raise ConfigError(f"{e.where} serves max_model_len {served}, but prep needs {self.spec.max_model_len} "
                                  "(max_len + 1): start it with --max-model-len of at least that")
        return self.startup_s

    @property
    def where(self) -> str:
        return "; ".join(e.where for e in self.endpoints)

    # -- requests ---------------------------------------------------------------------------------------------

    def _stopped(self) -> int:
        return self.should_stop() if self.should_stop is not None else 0

    def _post(self, endpoint: Endpoint, body: dict) -> dict:
        try:
            # no deadline on the connection: the client's Silence bounds the wait (a request may queue in vLLM)
            return post_json(endpoint.url + "/v1/completions", {"model": endpoint.model, **body}, timeout_s=None,
                             key=endpoint.key, where=endpoint.where, connections=self._open)
        except VLLMServerError as e:
            if self.server is not None:  # a connection dropped by a server on its way out: say that it exited
                deadline = time.perf_counter() + 10.0
                while self.server.alive() and time.perf_counter() < deadline:
                    time.sleep(0.1)
                self.server.raise_if_dead()  # its own message: exited, and why
            raise e from None

    def _file(self, name: str) -> str:
        assert self.scratch is not None, "start() first"
        return str(self.scratch / f"{name}.safetensors")

    def _progress(self) -> float | None:
        readings = [progress_counters(e.url) for e in self.endpoints]
        return None if any(r is None for r in readings) else sum(readings)  # type: ignore[misc]

    def _result(self, future: Future, where: str) -> dict:
        """A finished request's answer: VLLMServerError for a request the server aborted (vLLM answers what is in
        flight with finish_reason "abort" as it shuts down), and Preempted instead of any engine error once a stop
        signal came (`stop_instead`)."""
        try:
            answer = future.result()
            reason = ((answer.get("choices") or [{}])[0]).get("finish_reason")
            if reason not in ("stop", "length"):
                raise VLLMServerError(f"{where} ended a request with finish_reason {reason!r}")
            return answer
        except VLLMServerError as e:
            raise self.stop_instead(e) from None

    def stop_instead(self, error: VLLMServerError) -> BaseException:
        """What to raise for an engine error: Preempted when a stop signal came with it (SLURM signals the servers
        as well as prep: vLLM exits on SIGTERM, aborting what is in flight, and its files may not be written), else
        the error itself."""
        deadline = time.monotonic() + SIGNAL_LAG_S
        while not self._stopped() and time.monotonic() < deadline:
            time.sleep(0.05)
        return Preempted(self._stopped()) if self._stopped() else error

    def _stream(self, bodies: Iterable[tuple[dict, int]]) -> Iterator[dict]:
        """Send each (request body, bytes its file will take) and yield the answers in the order sent. At most
        vllm.max_in_flight requests are unanswered at a time (a new one goes out as soon as any is answered, not
        only the oldest), and at most the scratch budget's bytes are outstanding, a request counted from when it is
        sent until its answer is taken (always at least one request). Waits are bounded by the servers' silence
        (`Silence`) and end at once on a stop signal (Preempted)."""
        assert self._pool is not None, "start() first"
        pending: deque[tuple[Future, int]] = deque()
        outstanding = 0
        todo = iter(bodies)
        nxt = next(todo, None)
        silence = Silence(self.timeout_s, self._progress, self.where)
        try:
            while pending or nxt is not None:
                if self._stopped():
                    raise Preempted(self._stopped())
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
                    done, _ = wait(unanswered, timeout=1.0, return_when=FIRST_COMPLETED)
                    if done:
                        silence.answered()
                    else:
                        silence.check()
                    continue
                future, size = pending.popleft()
                yield self._result(future, self.where)
                silence.answered()
                outstanding -= size
        finally:
            for future, _ in pending:
                future.cancel()

    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_token_ids: list[int] | None = None,
                 keep_states: bool = False) -> list[dict]:
        """Each prompt's {"token_ids", "finish_reason"} (stop | length), sampled by the servers. On an extracting
        server every request's states are written; `keep_states` (capture.one_pass) asks for those of the prompt
        and of every generated token but the last (`include_output_tokens`: the last sampled token is never fed
        through the model) and returns the file as "states" (the caller deletes it); without it the file, the
        prompt's states alone, is deleted here. The kept files of one call are not counted against
        vllm.scratch_gb once answered: a caller holds at most one call's files (data_prep/pipeline.py bounds the
        regeneration batch by the budget)."""
        if keep_states and not self.spec.layer_ids:
            raise ValueError("these vLLM servers were started without layer ids: they write no states to keep")
        bodies = []
        for ids in prompts:
            body = {"prompt": list(ids), "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                    "stop_token_ids": list(stop_token_ids or []), "return_token_ids": True,
                    "skip_special_tokens": False}
            if seed is not None:
                body["seed"] = seed
            size = 0
            if self.spec.layer_ids:  # an extracting server saves every request's states: here, kept or deleted
                self._files += 1
                body["kv_transfer_params"] = {"hidden_states_path": self._file(f"gen-{self._files}")}
                if keep_states:
                    body["kv_transfer_params"]["include_output_tokens"] = True
                size = (len(ids) + (max_tokens if keep_states else 0)) * self.spec.file_bytes_per_token()
            bodies.append((body, size))
        out: list[dict] = []
        try:
            for (body, _), answer in zip(bodies, self._stream(bodies)):
                asked = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
                path = None
                if asked is not None:
                    try:
                        path = received_file(answer, asked, self.where, timeout_s=self.timeout_s)
                    except VLLMServerError as e:
                        raise self.stop_instead(e) from None
                    if not keep_states:
                        path.unlink()  # the prompt's states alone: the capture pass computes the sample's
                        path = None
                choice = answer["choices"][0]
                out.append({"token_ids": list(map(int, choice["token_ids"])),
                            "finish_reason": choice["finish_reason"]})
                if path is not None:
                    out[-1]["states"] = path
        except BaseException:
            for o in out:  # a call that fails hands no file on: the kept ones go at once
                if "states" in o:
                    o["states"].unlink(missing_ok=True)
            raise
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
            bodies.append((body, len(ids) * self.spec.file_bytes_per_token()))
        for (key, _), (body, _), answer in zip(items, bodies, self._stream(bodies)):
            try:
                path = received_file(answer, body["kv_transfer_params"]["hidden_states_path"], self.where, key,
                                     self.timeout_s)
            except VLLMServerError as e:
                raise self.stop_instead(e) from None
            try:
                yield key, path, next_tokens(answer)
            finally:
                path.unlink(missing_ok=True)


def received_file(answer: dict, asked: str, where: str, key: str | None = None, timeout_s: float = 600.0) -> Path:
    """The connector file a finished request asked for (`asked`), once its writer has released it. VLLMServerError
    when the answer names no file or another one (a server without `allow_custom_save_path` writes into its own
    directory, outside this launch's scratch and its byte budget: that file is not this prep's to read or delete),
    or when the file is not there (a server on another node), or still locked by its writer after `timeout_s`."""
    path = (answer.get("kv_transfer_params") or {}).get("hidden_states_path")
    sample = f" for sample {key!r}" if key is not None else ""
    if path is None:
        raise VLLMServerError(f"{where}: no hidden_states_path in its answer{sample}: is it serving with the "
                              "hidden-state extraction (docs/scaling.md)?")
    if os.path.abspath(path) != os.path.abspath(asked):
        raise VLLMServerError(f"{where} wrote hidden states to {path}, not to {asked} as asked{sample}: start it with "
                              "the connector's allow_custom_save_path (docs/scaling.md); the file was left alone")
    lock = Path(path + ".lock")
    if lock.exists():
        with open(lock) as f:  # the connector's writer holds it exclusively until the file is written
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise VLLMServerError(f"{where} did not finish writing {path} within {timeout_s:.0f} s "
                                              "(vllm.timeout_s)") from None
                    time.sleep(0.01)
        lock.unlink(missing_ok=True)
    if not Path(path).exists():
        raise VLLMServerError(f"{where} wrote its hidden states to {path}, which this prep rank cannot read: a server "
                              "of vllm.urls must run on the prep rank's node (its files are node-local)")
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
