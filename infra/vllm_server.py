"""vLLM's own OpenAI-compatible server, started, checked and stopped: the one home of the project's vLLM plumbing
(prep's servers, data_prep/vllm_client.py; eval's engine evaluation, eval/engine.py; the benches).

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
- a guard: `python -m infra.vllm_server --guard -- <command>` is the process prep starts. It leads a process
  group of its own, runs the server in it (the server with the kernel's parent-death signal tied to the guard), and
  reads its standard input, a pipe from prep: end-of-file means prep is gone, however it ended (an exception, a
  signal, kill -9), and the guard stops the whole group (SIGTERM, then SIGKILL after the grace period). vLLM's
  engine-core and worker processes stay in that group, so none outlives prep: killing the API server alone leaves
  them running (seen on vLLM 0.32), which is why the parent-death signal alone is not enough.

Every wait is bounded: startup by `wait_healthy(timeout_s)`, every request by its timeout; a server that exits,
refuses its settings or never answers raises VLLMServerError naming its URL and log, with vLLM's own reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from infra.strict_json import dumps

REPO_ROOT = Path(__file__).resolve().parents[1]
# Where an OpenAI-compatible client's key comes from (never the command line: `ps` shows it): the user's server's
# key for the openai regeneration backend and vllm.urls, and, inside `vllm_server`'s block, the started server's.
API_KEY_ENV = "OPENAI_API_KEY"
PLUGIN = "data_prep.vllm_plugin"  # what vLLM's python imports of ours: --check, the CPU hidden-states connector
API_SERVER = "vllm.entrypoints.openai.api_server"
# torchrun's (and torch.distributed's) variables: a server started from a prep rank must not take them as its own
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")
TORCHRUN_PREFIXES = ("TORCHELASTIC_", "TORCH_ELASTIC_")
# An error line in vLLM's log ("ValueError: Total number of attention heads (9) must be divisible by ...").
REASON = re.compile(r"\b([A-Z]\w*(?:Error|Exception)): (.+)$")


class VLLMUnavailable(RuntimeError):
    """No vLLM that can run the server: the python named is missing, has no vLLM or too old a one. A user error
    (launch/errors.py): raised before anything loads."""


class VLLMServerError(RuntimeError):
    """A server exited, refused its settings, or did not answer within its deadline; the message names its URL
    and log and quotes vLLM's reason."""


def resolve_python(configured: str | None) -> str:
    """The absolute path of the python that runs vLLM: `configured` (relative to the working directory, as the
    user typed it), else this interpreter if it can import vllm."""
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


def check_vllm(python: str, timeout_s: float = 600.0) -> dict:
    """{"version", ...} of the vLLM `python` imports, or VLLMUnavailable naming the version found and needed.
    Imports vLLM only (no weights): seconds, before anything loads."""
    try:
        done = subprocess.run([python, "-m", PLUGIN, "--check"], capture_output=True, text=True, cwd=REPO_ROOT,
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
        raise VLLMUnavailable(f"vllm.python={python} has vLLM {info['version'] or 'none'}; prep needs vLLM >= "
                              f"{info['needed']} with the extract_hidden_states speculative method and "
                              f"ExampleHiddenStatesConnector ({info['reason']})")
    return info


def ready(configured_python: str | None) -> tuple[str, dict]:
    """The vLLM python to run, checked (vLLM importable, new enough), and what its check said (`cuda`): call
    before anything loads."""
    python = resolve_python(configured_python)
    return python, check_vllm(python)


def plugin_env(base: dict[str, str]) -> dict[str, str]:
    """`base` with the repository importable: vLLM's processes import the CPU connector (data_prep/vllm_plugin.py)
    by its module path."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def server_env(base: dict[str, str], devices: str | None, key: str) -> dict[str, str]:
    """A started server's environment: `base` without torchrun's variables, its devices (None: as `base` has
    them), its API key, the repository importable, and a 2 GiB KV cache on a CPU build unless
    VLLM_CPU_KVCACHE_SPACE says otherwise."""
    env = {k: v for k, v in plugin_env(base).items()
           if k not in TORCHRUN_VARS and not k.startswith(TORCHRUN_PREFIXES)}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    env["VLLM_API_KEY"] = key
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def device_group(local_rank: int, group_size: int, num_devices: int, visible: str | None = None) -> str | None:
    """The devices of local rank `local_rank`'s server: the rank's block of `group_size` (tensor x pipeline
    parallel) devices of the node, as CUDA_VISIBLE_DEVICES names them (`visible`: the node's own list, e.g.
    SLURM's "4,5,6,7"; None: 0..num_devices-1). None on a node without devices (a CPU build). ValueError when the
    block is past the node's devices (more ranks per node than server groups fit)."""
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def reason_from_log(path: Path | None, lines: int = 400) -> str | None:
    """vLLM's own reason for stopping: the last `SomeError: message` line of its log (None: none there)."""
    if path is None or not Path(path).exists():
        return None
    tail = Path(path).read_text(errors="replace").splitlines()[-lines:]
    for line in reversed(tail):
        m = REASON.search(line)
        if m:
            return f"{m.group(1)}: {m.group(2).strip()}"
    return None


class VLLMServer:
    """One `vllm serve` on 127.0.0.1 under a guard (the module docstring): `with` starts it (returns at once: it
    builds while the caller goes on) and stops it with its process tree."""

    def __init__(self, python: str, args: Sequence[str], *, log_path: Path, devices: str | None = None,
                 grace_s: float = 30.0, scratch: Path | None = None):
        self.python, self.args, self.log_path = python, list(args), Path(log_path)
        self.devices, self.grace_s, self.scratch = devices, grace_s, scratch
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = secrets.token_urlsafe(24)
        self.env = server_env(dict(os.environ), devices, self.key)
        self.guard: subprocess.Popen | None = None
        self.started = self.startup_s = None

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", API_SERVER, *self.args, "--host", "127.0.0.1", "--port", str(self.port)]

    def start(self) -> VLLMServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "w") as log:
            # stdin: the pipe whose end-of-file tells the guard that this process is gone
            guard = [sys.executable, "-m", "infra.vllm_server", "--guard", "--grace-s", str(self.grace_s),
                     *(["--scratch", str(self.scratch)] if self.scratch else []), "--", *self.command]
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

    def raise_if_dead(self, when: str = "") -> None:
        """VLLMServerError if the server has exited, quoting vLLM's reason from its log."""
        if self.guard is not None and self.guard.poll() is not None:
            reason = reason_from_log(self.log_path) or "no error line in its log"
            raise VLLMServerError(f"{self.describe()} exited{when}: {reason}")

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> float:
        """Seconds from start to the first healthy /health; VLLMServerError if it exits or is not healthy within
        `timeout_s` of its start."""
        assert self.started is not None, "start() first"
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
        """End the guard's pipe (it stops the server's process group), wait for it, and stop the group ourselves
        if it is still there after the grace period."""
        guard, self.guard = self.guard, None
        if guard is None:
            return
        if guard.stdin is not None:
            guard.stdin.close()
        try:
            guard.wait(timeout=self.grace_s + 10)
        except subprocess.TimeoutExpired:
            pass
        kill_group(guard.pid)
        guard.wait()


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_get(url: str, timeout_s: float = 5.0, key: str | None = None) -> str:
    req = urllib.request.Request(url, headers=_auth(key))
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return r.read().decode()


def post_json(url: str, body: dict, *, timeout_s: float, key: str | None = None, where: str | None = None) -> dict:
    """POST `body` as JSON and return the JSON answer; VLLMServerError naming `where` (default: the URL) when the
    server refuses it (its own message), cannot be reached, or does not answer within `timeout_s`."""
    with _answer(url, body, timeout_s, key, where) as r:
        return json.loads(r.read().decode())


def post_stream(url: str, body: dict, *, timeout_s: float, key: str | None = None,
                where: str | None = None) -> Iterator[tuple[float, dict]]:
    """POST `body` (with "stream": true) and yield (time.perf_counter() at arrival, event) for each server-sent
    event of the answer until its `[DONE]`; errors as `post_json`'s."""
    with _answer(url, {**body, "stream": True}, timeout_s, key, where) as r:
        for line in r:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield time.perf_counter(), json.loads(data)


@contextmanager
def _answer(url: str, body: dict, timeout_s: float, key: str | None, where: str | None) -> Iterator:
    where = where or url
    headers = {"Content-Type": "application/json", **_auth(key)}
    req = urllib.request.Request(url, dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            yield r
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        raise VLLMServerError(f"{where} refused a request with HTTP {e.code}: {detail}") from None
    except TimeoutError:
        raise VLLMServerError(f"{where} did not answer within {timeout_s:.0f} s (vllm.timeout_s)") from None
    except OSError as e:  # URLError, connection reset: the server is gone or unreachable
        reason = getattr(e, "reason", e)
        if isinstance(reason, TimeoutError):
            raise VLLMServerError(f"{where} did not answer within {timeout_s:.0f} s (vllm.timeout_s)") from None
        raise VLLMServerError(f"{where} cannot be reached: {reason}") from None


def served_model(url: str, key: str | None, timeout_s: float = 30.0) -> str:
    """The model name a server answers to (its first /v1/models entry)."""
    try:
        return json.loads(http_get(url + "/v1/models", timeout_s, key))["data"][0]["id"]
    except (OSError, KeyError, IndexError, ValueError) as e:
        raise VLLMServerError(f"vLLM server {url}: no model listed at /v1/models ({e}); is it a vLLM server, and "
                              "does it take the key in $OPENAI_API_KEY?") from None


@contextmanager
def vllm_server(python: str, model: str, *, dtype: str = "bfloat16", max_model_len: int = 2048,
                extra_args: Sequence[str] = (), log_path: str | Path, timeout_s: float = 600.0,
                devices: str | None = None) -> Iterator[str]:
    """A healthy server of `model` for the `with` block (eager: ready in ~35 s on CPU instead of ~2 min), stopped
    afterwards; yields its base URL: what eval's engine check, the vLLM benches and the opt-in tests serve the target
    with. Its key is in this process's $OPENAI_API_KEY for the block, where our clients read it (the openai
    regeneration backend, `http_post_json`); the previous value is restored afterwards."""
    args = ["--model", model, "--dtype", dtype, "--max-model-len", str(max_model_len), "--enforce-eager",
            *extra_args]
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
# The guard (a process of its own: `python -m infra.vllm_server --guard -- <server command>`)


GUARD_IGNORES = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


def _server_preexec() -> None:
    """In the server's process, before exec: the signals the guard ignores back to their defaults (an ignored
    signal stays ignored across exec), and SIGKILL when the guard dies (PR_SET_PDEATHSIG)."""
    import ctypes

    for sig in GUARD_IGNORES:
        signal.signal(sig, signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def guard(command: list[str], grace_s: float, scratch: str | None = None) -> int:
    """Run `command` in this process group until it exits or standard input reaches end-of-file (the process that
    started the guard is gone or closed it); then stop the group: SIGTERM, `grace_s` for the server to exit, the
    launch's `scratch` directory removed (its files are no later launch's), then SIGKILL to whatever is left (this
    guard included)."""
    for sig in GUARD_IGNORES:
        signal.signal(sig, signal.SIG_IGN)  # the guard outlives its group's signals: it is the one that cleans up
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=_server_preexec)
    parent_gone = threading.Event()

    def watch_stdin() -> None:
        while sys.stdin.buffer.read(1 << 16):
            pass
        parent_gone.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while server.poll() is None and not parent_gone.wait(0.2):
        pass
    try:
        os.killpg(0, signal.SIGTERM)  # the server, vLLM's engine-core and worker processes; ignored by this guard
    except ProcessLookupError:
        pass
    try:
        server.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    if scratch:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    sys.stdout.flush()
    os.killpg(0, signal.SIGKILL)  # whatever is left of the group, this guard last
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description="Run a vLLM server under a guard that stops its process group when "
                                            "standard input closes")
    p.add_argument("--guard", action="store_true", required=True)
    p.add_argument("--grace-s", type=float, default=30.0)
    p.add_argument("--scratch", help="a directory removed once the server is stopped")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if not command:
        p.error("no command after --")
    return guard(command, args.grace_s, args.scratch)


if __name__ == "__main__":
    sys.exit(main())
