"""vLLM's own OpenAI-compatible server, started, checked and stopped: the one home of the project's vLLM plumbing
(prep's servers, eval's engine evaluation, the benches: each names the module of its own that vLLM's python runs).

vLLM lives in its own virtual environment (it pins its own torch), so a server is `<vllm python> -m
vllm.entrypoints.openai.api_server ...` (what `vllm serve` runs), never imported here.

    server = VLLMServer(python, ["--model", m, ...], log_path=..., devices="2,3")
    with server:                       # started under a guard (below); stopped, with its whole process tree, on exit
        server.wait_healthy(timeout_s)  # /health answers, or VLLMServerError quoting vLLM's own reason from its log
        post_json(server.url + "/v1/completions", {...}, timeout_s=..., key=server.key)

What a started server gets:
- its own devices: `CUDA_VISIBLE_DEVICES` set by the caller (`device_group`: the local rank's block of
  tensor_parallel_size x pipeline_parallel_size devices), and none of torchrun's variables (RANK, WORLD_SIZE,
  MASTER_ADDR, ...: vLLM would read them as its own distributed setup);
- 127.0.0.1 and a free port, and a random API key of its own (in its environment, never on its command line, which
  `ps` shows), sent by our clients;
- a scratch directory of its own (the caller's, or a new temporary one): vLLM's ZMQ socket files go there
  (VLLM_RPC_BASE_PATH and TMPDIR), so none is left in $TMPDIR whatever way the server ends;
- SIGUSR1 ignored: SLURM's `--signal=USR1@N` reaches every process of the job step, and the warning is for the
  caller, which stops at its next boundary (infra/preemption.py) and then stops the server itself. SIGTERM keeps
  vLLM's own meaning (a graceful exit); a caller that received it too stops as preempted (exit 75).
- a guard: `python -m serving.server --guard -- <command>` is the process the caller starts. It leads a process
  group of its own, runs the server in it (the server with the kernel's parent-death signal tied to the guard), and
  reads its standard input, a pipe from the caller: end-of-file means the caller is gone, however it ended (an
  exception, a signal, kill -9), and the guard stops the whole group: SIGTERM, the grace period, SIGKILL, until no
  process of the group is left; then it removes the scratch directory (nothing of the group can recreate it then)
  and writes its last line to the log. vLLM's engine-core and worker processes stay in that group, so none outlives
  the caller: killing the API server alone leaves them running (seen on vLLM 0.32), which is why the parent-death
  signal alone is not enough. A sentinel process in the group does the same if the guard itself is killed, so a
  kill -9 of the guard (and of the caller) leaves nothing running either; the caller, if alive, names the server
  whose guard was killed.
- Started with no command, the guard only removes the scratch directory once the caller is gone (the user's servers,
  `vllm.urls`: prep's files there are its own).

Every wait is bounded: startup by `wait_healthy(timeout_s)`, a request by its caller's deadline, a stop by the grace
period; a server that exits, refuses its settings or never answers raises VLLMServerError naming its URL and log,
with vLLM's own reason: the root cause (the error before vLLM's wrappers such as "Engine core initialization
failed. See root cause above"), or the signal that killed it.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from infra.processes import die_with_parent, free_port
from infra.strict_json import dumps

REPO_ROOT = Path(__file__).resolve().parents[1]
# Where an OpenAI-compatible client's key comes from (never the command line: `ps` shows it): the user's server's
# key for the openai regeneration backend and vllm.urls, and, inside `vllm_server`'s block, the started server's.
API_KEY_ENV = "OPENAI_API_KEY"
API_SERVER = "vllm.entrypoints.openai.api_server"
# torchrun's (and torch.distributed's) variables: a server started from a prep rank must not take them as its own
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
# An error line in vLLM's log ("ValueError: Total number of attention heads (9) must be divisible by ...", possibly
# after vLLM's "(EngineCore pid=12) ERROR 12-05 18:43:48 [core.py:1510] " prefix).
REASON = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")
# argparse's refusal of the command line ("api_server.py: error: unrecognized arguments: --foo")
USAGE = re.compile(r"^\S+: error: (.+)$")
# log lines that only inform or warn (a warning may quote an error it fears: "`OSError: [Errno 24] Too many ...`")
NOT_ERRORS = re.compile(r"\b(?:DEBUG|INFO|WARNING)\s+\d\d-\d\d ")
# vLLM's wrappers around the root cause, which they point to ("See root cause above", "check the stack trace above
# for the root cause")
WRAPPER = re.compile(r"root cause", re.IGNORECASE)
GUARD = "[guard] "  # the guard's own lines in the server's log
SOCKET_DIR = "rpc"  # vLLM's ZMQ socket files, inside the server's scratch directory
MAX_SOCKET_PATH = 100  # a unix socket's path is at most 107 bytes; vLLM appends "/<uuid4>"


class VLLMUnavailable(RuntimeError):
    """No vLLM that can run the server: the python named is missing, has no vLLM or too old a one. A user error
    (launch/errors.py): raised before anything loads."""


class VLLMServerError(RuntimeError):
    """A server exited, refused its settings or a request, did not answer within its deadline, or answered with
    something that is not an answer; the message names its URL and log and quotes vLLM's reason. An engine failure
    (launch/errors.py): printed by the rank that saw it."""


def resolve_python(configured: str | None) -> str:
    """The absolute path of the python that runs vLLM: `configured` (relative to the working directory, as the
    user typed it), else this interpreter if it can import vllm."""
    import importlib.util

    if configured:
        path = Path(configured).expanduser().absolute()  # not resolved: a venv's python is a link to the base one
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise VLLMUnavailable(f"vllm.python={configured!r} is not an executable file ({path})")
        return str(path)
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailable(
            f"vLLM is not importable by {sys.executable} and vllm.python is not set; point vllm.python at the "
            "python of a vLLM install (`make .venv-vllm/bin/python` builds one)")
    return sys.executable


def check_vllm(python: str, plugin: str, timeout_s: float = 600.0) -> dict:
    """What `<python> -m <plugin> --check` says of the vLLM that `python` imports ({"ok", "version", "needed",
    "cuda", "device_count", ...}; `plugin`: the caller's check module, run with the repository importable), or
    VLLMUnavailable naming the version found and needed. Imports vLLM only (no weights): seconds, before anything
    loads."""
    try:
        done = subprocess.run([python, "-m", plugin, "--check"], capture_output=True, text=True, cwd=REPO_ROOT,
                              env=plugin_env(os.environ), timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VLLMUnavailable(f"vllm.python={python}: cannot run it ({e})") from e
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise VLLMUnavailable(f"vllm.python={python}: the vLLM check failed (exit {done.returncode}): "
                              + " | ".join(tail))
    info = json.loads(lines[-1])
    if not info["ok"]:
        raise VLLMUnavailable(f"vllm.python={python} has vLLM {info['version'] or 'none'}; this needs vLLM >= "
                              f"{info['needed']} ({info['reason']})")
    return info


def ready(configured_python: str | None, plugin: str) -> tuple[str, dict]:
    """The vLLM python to run, checked (vLLM importable, new enough: `check_vllm`), and what its check said (`cuda`,
    `device_count`: the devices that vLLM sees on this node): call before anything loads."""
    python = resolve_python(configured_python)
    return python, check_vllm(python, plugin)


def plugin_env(base: dict[str, str]) -> dict[str, str]:
    """`base` with the repository importable: vLLM's processes import the caller's plugin module (its check, a
    connector) by its module path."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def server_env(base: dict[str, str], devices: str | None, key: str, sockets: Path | None = None) -> dict[str, str]:
    """A started server's environment: `base` without torchrun's variables, its devices (None: as `base` has
    them), its API key, the repository importable, vLLM's socket files in `sockets`, and a 2 GiB KV cache on a CPU
    build unless VLLM_CPU_KVCACHE_SPACE says otherwise."""
    env = {k: v for k, v in plugin_env(base).items()
           if k not in TORCHRUN_VARS and not k.startswith(TORCHRUN_PREFIXES)}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    env["VLLM_API_KEY"] = key
    if sockets is not None:
        env["VLLM_RPC_BASE_PATH"] = env["TMPDIR"] = str(sockets)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def device_group(local_rank: int, group_size: int, num_devices: int, visible: str | None = None) -> str | None:
    """The devices of local rank `local_rank`'s server: the rank's block of `group_size` (tensor x pipeline
    parallel) devices of the node, as CUDA_VISIBLE_DEVICES names them (`visible`: the node's own list, e.g.
    SLURM's "4,5,6,7"; None: 0..num_devices-1, the count vLLM's own check reports). None on a node without devices
    (a CPU build). ValueError when the block is past the node's devices (more ranks per node than server groups
    fit)."""
    ids = [d for d in visible.split(",") if d != ""] if visible is not None else [str(i) for i in range(num_devices)]
    if not ids:
        return None
    first = local_rank * group_size
    if first + group_size > len(ids):
        raise ValueError(f"local rank {local_rank}'s vLLM server needs devices {first}..{first + group_size - 1} "
                         f"(groups of {group_size} = vllm.tensor_parallel_size x vllm.pipeline_parallel_size), but "
                         f"this node has {len(ids)} ({','.join(ids)}): start at most {len(ids) // group_size} prep "
                         "ranks per node on the vLLM route")
    return ",".join(ids[first:first + group_size])


def cli_args(kwargs: dict) -> list[str]:
    """vLLM engine arguments as `vllm serve` flags: `enforce_eager: true` -> --enforce-eager, false -> --no-...,
    a dict -> its JSON, a list -> its items."""
    args: list[str] = []
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            args += [flag, dumps(value)]
        elif isinstance(value, (list, tuple)):
            args += [flag, *map(str, value)]
        elif value is not None:
            args += [flag, str(value)]
    return args


def reason_from_log(path: Path | None, lines: int = 600) -> str | None:
    """vLLM's own reason for stopping, from the end of its log: its refusal of the command line, else the root cause
    of its last failure (the last error line before the last of vLLM's wrappers that point to a root cause above, or
    the last error line when there is no wrapper); lines that only inform or warn are not reasons. None: no error
    line there."""
    if path is None or not Path(path).exists():
        return None
    tail = [line for line in Path(path).read_text(errors="replace").splitlines()[-lines:]
            if not line.startswith(GUARD)]
    errors: list[tuple[bool, str]] = []  # (is a wrapper, reason)
    for line in tail:
        usage = USAGE.match(line.strip())
        if usage:
            return f"vLLM refused its command line: {usage.group(1).strip()}"
        m = REASON.search(line)
        if m and not NOT_ERRORS.search(line[: m.start()]):
            reason = f"{m.group(1)}: {m.group(2).strip()}"
            errors.append((bool(WRAPPER.search(reason)), reason))
    if not errors:
        return None
    last_wrapper = max((i for i, (wrapper, _) in enumerate(errors) if wrapper), default=None)
    causes = [r for w, r in (errors if last_wrapper is None else errors[:last_wrapper]) if not w]
    return causes[-1] if causes else errors[-1][1]


def guard_ending(path: Path | None) -> str | None:
    """The guard's last line in a server's log ("the server exited with status 1", "killed by SIGKILL", "the caller
    is gone"): None while it runs or when it was killed before writing one."""
    if path is None or not Path(path).exists():
        return None
    ends = [line[len(GUARD):] for line in Path(path).read_text(errors="replace").splitlines()
            if line.startswith(GUARD + "end: ")]
    return ends[-1][len("end: "):] if ends else None


class VLLMServer:
    """One `vllm serve` on 127.0.0.1 under a guard (the module docstring): `with` starts it (returns at once: it
    builds while the caller goes on) and stops it with its process tree. `args=None`: no server, the guard alone,
    removing `scratch` once the caller is gone (the user's servers write prep's files there)."""

    def __init__(self, python: str | None, args: Sequence[str] | None, *, log_path: Path,
                 devices: str | None = None, grace_s: float = 30.0, scratch: Path | None = None,
                 startup_timeout_s: float | None = None):
        self.python, self.args, self.log_path = python, None if args is None else list(args), Path(log_path)
        self.devices, self.grace_s = devices, grace_s
        self.startup_timeout_s = startup_timeout_s
        self.own_scratch = scratch is None
        self.scratch = Path(scratch) if scratch is not None else Path(tempfile.mkdtemp(prefix="drafters-vllm-"))
        sockets = self.scratch / SOCKET_DIR
        self.removed = [self.scratch]
        if len(str(sockets)) + 37 > MAX_SOCKET_PATH:  # a unix socket path that long cannot be bound
            sockets = Path(tempfile.mkdtemp(prefix="drafters-rpc-", dir="/tmp"))
            self.removed.append(sockets)
        sockets.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = secrets.token_urlsafe(24)
        self.env = server_env(dict(os.environ), devices, self.key, sockets)
        self.guard: subprocess.Popen | None = None
        self.started = self.startup_s = None
        self.guard_status: int | None = None  # the guard's exit status once it ended (negative: killed by a signal)

    @property
    def command(self) -> list[str]:
        if self.args is None:
            return []
        return [str(self.python), "-m", API_SERVER, *self.args, "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self) -> VLLMServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            # stdin: the pipe whose end-of-file tells the guard that this process is gone
            guard = [sys.executable, "-m", "serving.server", "--guard", "--grace-s", str(self.grace_s),
                     *[a for p in self.removed for a in ("--scratch", str(p))], "--", *self.command]
            self.guard = subprocess.Popen(guard, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                          cwd=REPO_ROOT, env=self.env, start_new_session=True)
        self.started = time.perf_counter()
        return self

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def alive(self) -> bool:
        return self.guard is not None and self.guard.poll() is None

    def describe(self) -> str:
        return f"vLLM server {self.url} (log: {self.log_path})"

    def ending(self) -> str:
        """Why the server is gone: the signal that killed it or its guard, else vLLM's reason from its log."""
        status = self.guard.poll() if self.guard is not None else self.guard_status
        ending = guard_ending(self.log_path)
        if status is not None and status < 0:  # the guard ends by itself; killed, the sentinel stopped the rest
            return (f"its guard (pid {self.guard.pid if self.guard else '?'}) was killed by "
                    f"{signal.Signals(-status).name}, and the server with it")
        if ending is not None and "killed by" in ending:
            return f"{ending} (a signal from outside vLLM)"
        reason = reason_from_log(self.log_path)
        if reason is not None:
            return reason
        return f"{ending or 'it exited'}; no error line in its log"

    def raise_if_dead(self, when: str = "") -> None:
        """VLLMServerError if the server has exited, saying why (`ending`)."""
        if self.guard is not None and self.guard.poll() is not None:
            raise VLLMServerError(f"{self.describe()} exited{when}: {self.ending()}")

    def check_starting(self) -> None:
        """VLLMServerError at once if the server has exited, or is still not healthy past its start-up deadline
        (`startup_timeout_s`): for long work done beside its start-up."""
        self.raise_if_dead(" while starting")
        if (self.startup_s is None and self.startup_timeout_s is not None and self.started is not None
                and time.perf_counter() - self.started > self.startup_timeout_s):
            try:
                http_get(self.url + "/health", timeout_s=5.0)
                self.startup_s = time.perf_counter() - self.started
            except OSError:
                raise VLLMServerError(f"{self.describe()} was not healthy within {self.startup_timeout_s:.0f} s of "
                                      "its start (vllm.timeout_s); stopped") from None

    def wait_healthy(self, timeout_s: float | None = None, poll_s: float = 1.0) -> float:
        """Seconds from start to the first healthy /health; VLLMServerError if it exits or is not healthy within
        `timeout_s` (default: startup_timeout_s) of its start."""
        assert self.started is not None, "start() first"
        if self.startup_s is not None:
            return self.startup_s
        timeout_s = timeout_s if timeout_s is not None else self.startup_timeout_s or 600.0
        deadline = self.started + timeout_s
        while True:
            self.raise_if_dead(" while starting")
            try:
                http_get(self.url + "/health", timeout_s=5.0)
                self.startup_s = time.perf_counter() - self.started
                return self.startup_s
            except OSError:
                if time.perf_counter() > deadline:
                    raise VLLMServerError(f"{self.describe()} was not healthy within {timeout_s:.0f} s of its start "
                                          "(vllm.timeout_s); stopped") from None
                time.sleep(poll_s)

    def close(self) -> None:
        """End the guard's pipe (it stops the server's process group and removes the scratch), wait for it (bounded),
        and stop the group ourselves if anything of it is still there; the scratch is removed here too, after the
        group is gone (the guard may have been killed before it could)."""
        guard, self.guard = self.guard, None
        if guard is None:
            return
        if guard.stdin is not None:
            try:
                guard.stdin.close()
            except OSError:
                pass
        try:
            guard.wait(timeout=self.grace_s + 30)
        except subprocess.TimeoutExpired:
            pass
        stop_group(guard.pid, keep=(), grace_s=0.0)  # whatever is left (the guard killed, or stuck)
        try:
            guard.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.guard_status = guard.returncode
        for path in self.removed:
            shutil.rmtree(path, ignore_errors=True)


def group_members(pgid: int) -> set[int]:
    """The live processes of process group `pgid` (zombies are gone: they hold nothing), from /proc."""
    found = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, pgrp, ...
        if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
            found.add(int(entry.name))
    return found


def stop_group(pgid: int, keep: Sequence[int], grace_s: float, wait_s: float = 10.0) -> bool:
    """Stop every process of group `pgid` but `keep`: SIGTERM, up to `grace_s` for them to exit, then SIGKILL, then
    up to `wait_s` until none is left. True when none is."""
    def others() -> set[int]:
        return group_members(pgid) - set(keep)

    def send(sig: int, pids: set[int]) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    if grace_s > 0:
        send(signal.SIGTERM, others())
        deadline = time.monotonic() + grace_s
        while others() and time.monotonic() < deadline:
            time.sleep(0.1)
    deadline = time.monotonic() + wait_s
    while (left := others()) and time.monotonic() < deadline:
        send(signal.SIGKILL, left)
        time.sleep(0.05)
    return not others()


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_get(url: str, timeout_s: float = 5.0, key: str | None = None) -> str:
    req = urllib.request.Request(url, headers=_auth(key))
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return r.read().decode()


def post_json(url: str, body: dict, *, timeout_s: float | None, key: str | None = None, where: str | None = None,
              connections: set | None = None) -> dict:
    """POST `body` as JSON and return the JSON answer; VLLMServerError naming `where` (default: the URL) when the
    server refuses it (its own message), cannot be reached, does not answer within `timeout_s` of silence on the
    connection (None: no limit here, the caller bounds the wait), or sends a torn or non-JSON answer.
    `connections`: a set the open connection is kept in while the request runs (`abort` ends them at once)."""
    where = where or url
    with _answer(url, body, timeout_s, key, where, connections) as r:
        try:
            return json.loads(r.read().decode())
        except (ValueError, http.client.IncompleteRead) as e:  # bad JSON, bad UTF-8, a body cut short
            raise VLLMServerError(f"{where} sent a torn answer ({type(e).__name__}: {str(e)[:200]})") from None


def post_stream(url: str, body: dict, *, timeout_s: float | None, key: str | None = None,
                where: str | None = None) -> Iterator[tuple[float, dict]]:
    """POST `body` (with "stream": true) and yield (time.perf_counter() at arrival, event) for each server-sent
    event of the answer until its `[DONE]`; errors as `post_json`'s."""
    where = where or url
    with _answer(url, {**body, "stream": True}, timeout_s, key, where, None) as r:
        for line in r:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            try:
                event = json.loads(data)
            except ValueError as e:
                raise VLLMServerError(f"{where} sent a torn event ({e})") from None
            yield time.perf_counter(), event


def abort(connections: set) -> None:
    """End every connection of `connections` now: their requests, blocked in another thread, fail at once."""
    import socket

    for conn in list(connections):
        sock = getattr(conn, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@contextmanager
def _answer(url: str, body: dict, timeout_s: float | None, key: str | None, where: str,
            connections: set | None) -> Iterator:
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname or "", parts.port, timeout=timeout_s)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    if connections is not None:
        connections.add(conn)
    try:
        conn.request("POST", path or "/", dumps(body).encode(),
                     {"Content-Type": "application/json", **_auth(key)})
        r = conn.getresponse()
        if r.status >= 400:
            detail = r.read().decode(errors="replace")[:500]
            raise VLLMServerError(f"{where} refused a request with HTTP {r.status}: {detail}")
        yield r
    except VLLMServerError:
        raise
    except TimeoutError:
        raise VLLMServerError(f"{where} did not answer within {timeout_s:.0f} s (vllm.timeout_s)") from None
    except http.client.HTTPException as e:  # a status line or body cut short: the server went away mid-answer
        raise VLLMServerError(f"{where} sent a torn answer ({type(e).__name__}: {str(e)[:200]})") from None
    except OSError as e:  # refused, reset: the server is gone or unreachable
        raise VLLMServerError(f"{where} cannot be reached: {e}") from None
    finally:
        conn.close()
        if connections is not None:
            connections.discard(conn)


def model_card(url: str, key: str | None, timeout_s: float = 30.0) -> dict:
    """The first /v1/models entry of a server: `id`, the name it answers to; vLLM adds `max_model_len`."""
    try:
        return json.loads(http_get(url + "/v1/models", timeout_s, key))["data"][0]
    except (OSError, KeyError, IndexError, ValueError, http.client.HTTPException) as e:
        raise VLLMServerError(f"vLLM server {url}: no model listed at /v1/models ({e}); is it a vLLM server, and "
                              "does it take the key in $OPENAI_API_KEY?") from None


def served_model(url: str, key: str | None, timeout_s: float = 30.0) -> str:
    """The model name a server answers to (its first /v1/models entry)."""
    return str(model_card(url, key, timeout_s)["id"])


def progress_counters(url: str, timeout_s: float = 5.0) -> float | None:
    """The tokens a vLLM server has processed so far (its prompt and generation token counters on /metrics,
    summed): it grows while the server works on requests that have not answered yet. None: no such counters."""
    try:
        text = http_get(url + "/metrics", timeout_s)
    except (OSError, http.client.HTTPException):
        return None
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(r"vllm:(?:prompt|generation)_tokens_total(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            total, found = total + float(m.group(1)), True
    return total if found else None


@contextmanager
def vllm_server(python: str, model: str, *, dtype: str = "bfloat16", max_model_len: int = 2048,
                extra_args: Sequence[str] = (), log_path: str | Path, timeout_s: float = 600.0,
                devices: str | None = None, enforce_eager: bool = True) -> Iterator[str]:
    """A healthy server of `model` for the `with` block, stopped afterwards; yields its base URL: what eval's engine
    check, the vLLM benches and the opt-in tests serve the target with. `enforce_eager` (`--enforce-eager`): no CUDA
    graphs, ready in ~35 s on CPU instead of ~2 min; False where a GPU's speed is what is measured (eval's engine
    evaluation decides per device). Its key is in this process's $OPENAI_API_KEY for the block, where our clients
    read it (the openai regeneration backend, `http_post_json`); the previous value is restored afterwards."""
    args = ["--model", model, "--dtype", dtype, "--max-model-len", str(max_model_len),
            *(["--enforce-eager"] if enforce_eager else []), *extra_args]
    with VLLMServer(python, args, log_path=Path(log_path), devices=devices) as server:
        server.wait_healthy(timeout_s)
        previous = os.environ.get(API_KEY_ENV)
        os.environ[API_KEY_ENV] = server.key
        try:
            yield server.url
        finally:
            if previous is None:
                os.environ.pop(API_KEY_ENV, None)
            else:
                os.environ[API_KEY_ENV] = previous


def http_post_json(url: str, body: dict, timeout_s: float = 600.0) -> dict:
    """`post_json` with the key in $OPENAI_API_KEY (a `vllm_server` block's, or the user's)."""
    return post_json(url, body, timeout_s=timeout_s, key=os.environ.get(API_KEY_ENV))


# ------------------------------------------------------------------------------------------------------------
# The guard (a process of its own: `python -m serving.server --guard -- <server command>`)


GUARD_IGNORES = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
SERVER_DEFAULTS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # the server's own meaning; SIGUSR1 stays ignored


def _server_preexec() -> None:
    """In the server's process, before exec: the signals vLLM gives a meaning back to their defaults (an ignored
    signal stays ignored across exec), SIGUSR1 left ignored (the module docstring), and SIGKILL when the guard dies."""
    for sig in SERVER_DEFAULTS:
        signal.signal(sig, signal.SIG_DFL)
    die_with_parent(signal.SIGKILL)


def _say(line: str) -> None:
    print(GUARD + line, flush=True)


def _remove(paths: Sequence[str], grace_s: float = 0.0) -> None:
    """Remove `paths`, and again whenever one reappears within `grace_s` (a user's server finishing a request
    that was in flight when the caller died)."""
    deadline = time.monotonic() + grace_s
    while True:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        if time.monotonic() >= deadline:
            return
        time.sleep(0.5)


def _watch(parent_gone: threading.Event) -> None:
    # os.read on the descriptor, not sys.stdin's buffered reader: a daemon thread blocked inside that reader holds its
    # lock, and an interpreter that exits meanwhile aborts ("could not acquire lock for <stdin> at shutdown")
    while os.read(0, 1 << 16):
        pass
    parent_gone.set()


def guard(command: list[str], grace_s: float, scratch: Sequence[str] = ()) -> int:
    """Run `command` in this process group until it exits or standard input reaches end-of-file (the caller is gone
    or closed it); then stop every other process of the group (SIGTERM, `grace_s`, SIGKILL, until none is left),
    remove the `scratch` directories, and end: the server's exit status (0 when the caller stopped it). No command:
    wait for the caller to go, then remove `scratch`."""
    for sig in GUARD_IGNORES:
        signal.signal(sig, signal.SIG_IGN)  # the guard outlives its group's signals: it is the one that cleans up
    group = os.getpgid(0)
    parent_gone = threading.Event()
    threading.Thread(target=_watch, args=(parent_gone,), daemon=True).start()
    if not command:
        parent_gone.wait()
        _remove(scratch, grace_s)
        _say("end: the caller is gone; scratch removed")
        return 0
    # the sentinel stops the group if this guard is killed (kill -9): it exits on its own when the guard ends
    sentinel = subprocess.Popen([sys.executable, "-m", "serving.server", "--sentinel", str(os.getpid()),
                                 "--grace-s", str(grace_s), *[a for p in scratch for a in ("--scratch", p)]],
                                stdin=subprocess.DEVNULL, cwd=REPO_ROOT)
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_server_preexec)
    _say(f"server pid {server.pid}, sentinel pid {sentinel.pid}, process group {group}")
    while server.poll() is None and not parent_gone.wait(0.2):
        pass
    status = server.poll()
    if status is None:
        ending = "the caller closed the pipe or is gone: server stopped"
    elif status < 0:
        ending = f"the server was killed by {signal.Signals(-status).name}"
    else:
        ending = f"the server exited with status {status}"
    stopped = stop_group(group, keep=(os.getpid(), sentinel.pid), grace_s=grace_s)
    server.wait(timeout=5) if server.poll() is None else None
    _remove(scratch)
    sentinel.kill()
    sentinel.wait(timeout=10)
    _say(f"end: {ending}" + ("" if stopped else "; some of its processes could not be stopped"))
    return 0 if status is None else (status if status >= 0 else 128 - status)


def sentinel(guard_pid: int, grace_s: float, scratch: Sequence[str]) -> int:
    """In the guard's group: once the guard is gone without having ended the group (it was killed), stop every
    process of the group but this one and remove `scratch`."""
    for sig in GUARD_IGNORES:
        signal.signal(sig, signal.SIG_IGN)
    while os.getppid() == guard_pid:
        time.sleep(0.2)
    stop_group(os.getpgid(0), keep=(os.getpid(),), grace_s=grace_s)
    _remove(scratch)
    _say("end: the guard was killed; the sentinel stopped the server")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description="Run a vLLM server under a guard that stops its process group when "
                                            "standard input closes")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--guard", action="store_true")
    mode.add_argument("--sentinel", type=int, metavar="GUARD_PID")
    p.add_argument("--grace-s", type=float, default=30.0)
    p.add_argument("--scratch", action="append", default=[], help="a directory removed once the server is stopped")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.sentinel is not None:
        return sentinel(args.sentinel, args.grace_s, args.scratch)
    code = guard(command, args.grace_s, args.scratch)
    sys.stdout.flush()
    os._exit(code)  # at once: its stdin watcher is still blocked reading, and nothing is left to clean up


if __name__ == "__main__":
    sys.exit(main())
