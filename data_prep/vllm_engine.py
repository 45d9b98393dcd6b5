"""Prep's vLLM engine: one `vllm.LLM` per prep rank, in vLLM's own virtual environment (it pins its own torch),
driven as a subprocess (data_prep/vllm_worker.py --serve). The same engine regenerates the replies
(regen.backend=vllm, data_prep/regenerate.py VLLMBackend) and captures the hidden states of the rendered samples
(capture.engine=vllm, data_prep/vllm_capture.py); it is configured once, at `vllm.*` (data_prep/config.py
VLLMConfig): the python of the vLLM install, tensor/pipeline-parallel sizes and any other vllm.LLM argument.

    with VLLMEngine(EngineSpec(...), work_dir) as engine:
        outs = engine.generate(prompts, max_tokens=256, temperature=0.0, stop_token_ids=[2])
        engine.submit({"op": "capture", ...}); ...

Jobs are files in `work_dir` (job.<n>.json -> done.<n>.json, the worker's docstring); a worker that exits or
fails a job raises VLLMEngineError with the tail of its log.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from data_prep.strict_json import dumps

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = "data_prep.vllm_worker"
# vllm.LLM arguments the engine sets itself; vllm.engine_kwargs may not override them.
RESERVED_ENGINE_KWARGS = ("model", "tokenizer", "dtype", "speculative_config", "kv_transfer_config",
                          "enable_prefix_caching", "tensor_parallel_size", "pipeline_parallel_size", "max_model_len")


class VLLMUnavailable(RuntimeError):
    """No vLLM that can run the engine: missing, too old, or not the python named; raised before any load."""


class VLLMEngineError(RuntimeError):
    """The worker exited or failed a job; the message names its log."""


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: the repository importable (the engine processes import the CPU connector from
    data_prep.vllm_worker) and a 2 GiB KV cache on a CPU build unless VLLM_CPU_KVCACHE_SPACE says otherwise."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def resolve_python(configured: str | None) -> str:
    """The python that runs vLLM: `vllm.python`, else this interpreter if it can import vllm."""
    if configured:
        path = Path(configured).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise VLLMUnavailable(f"vllm.python={configured!r} is not an executable file")
        return str(path)
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailable(
            f"prep's vLLM engine: vLLM is not importable by {sys.executable} and vllm.python is not set; "
            "point vllm.python at the python of a vLLM install (`make .venv-vllm/bin/python` builds one)")
    return sys.executable


def check_vllm(python: str, timeout_s: float = 600.0) -> dict:
    """{"version", ...} of the vLLM `python` imports, or VLLMUnavailable naming the version found and needed.
    Imports vLLM only (no weights): seconds, before prep loads anything."""
    try:
        done = subprocess.run([python, "-m", WORKER, "--check"], capture_output=True, text=True, cwd=REPO_ROOT,
                              env=worker_env(), timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VLLMUnavailable(f"vllm.python={python}: cannot run it ({e})") from e
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise VLLMUnavailable(f"vllm.python={python}: the vLLM check failed (exit {done.returncode}): "
                              + " | ".join(tail))
    info = json.loads(lines[-1])
    if not info["ok"]:
        found = info["version"] or "none"
        raise VLLMUnavailable(f"prep's vLLM engine: {python} has vLLM {found}; prep needs vLLM >= "
                              f"{info['needed']} with the extract_hidden_states speculative method and "
                              f"ExampleHiddenStatesConnector ({info['reason']})")
    return info


def ready(configured_python: str | None) -> str:
    """The vLLM python prep's engine will run, checked (vLLM importable, new enough): call before any load."""
    python = resolve_python(configured_python)
    check_vllm(python)
    return python


@dataclass
class EngineSpec:
    """What the worker builds (its engine.json): the target, dtype and length, the extracted layers (vLLM aux
    layer ids; empty: no extraction, regeneration alone) and the parallel sizes and other vllm.LLM arguments."""

    python: str
    model: str  # an HF directory or hub id vLLM loads
    dtype: str
    max_model_len: int
    layer_ids: list[int] = field(default_factory=list)
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    engine_kwargs: dict = field(default_factory=dict)


class VLLMEngine:
    """The worker process and its job files; `with` starts it (returns at once: the engine builds while the
    caller goes on) and stops it."""

    def __init__(self, spec: EngineSpec, work_dir: Path, log_path: Path | None = None, poll_s: float = 0.05):
        self.spec, self.work_dir, self.poll_s = spec, Path(work_dir), poll_s
        self.log_path = log_path or self.work_dir / "vllm.log"
        self.proc: subprocess.Popen | None = None
        self.jobs = 0
        self.startup_s: float | None = None

    def start(self) -> VLLMEngine:
        import shutil

        shutil.rmtree(self.work_dir, ignore_errors=True)  # a crashed run's jobs and files: redone
        self.work_dir.mkdir(parents=True)
        spec = {k: v for k, v in asdict(self.spec).items() if k != "python"}
        (self.work_dir / "engine.json").write_text(dumps(spec, indent=1))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([self.spec.python, "-m", WORKER, "--serve", str(self.work_dir)], cwd=REPO_ROOT,
                                     env=worker_env(), stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)  # its own group: vLLM's engine processes stop with it
        return self

    def __enter__(self) -> VLLMEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close(clean=exc[0] is None)

    def alive_or_raise(self, what: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise VLLMEngineError(f"the vLLM worker exited with {self.proc.returncode} {what} (log: {self.log_path}): "
                                  + " | ".join(self.log_tail()))

    def log_tail(self, n: int = 5) -> list[str]:
        return self.log_path.read_text().strip().splitlines()[-n:] if self.log_path.exists() else []

    def wait_ready(self) -> float:
        """Seconds the engine took to build, once built."""
        path = self.work_dir / "ready.json"
        while not path.exists():
            self.alive_or_raise("while building its engine")
            time.sleep(self.poll_s)
        self.startup_s = json.loads(path.read_text())["startup_s"]
        return self.startup_s

    def submit(self, job: dict) -> int:
        """Queue a job; returns its number for `result`."""
        n, self.jobs = self.jobs, self.jobs + 1
        path = self.work_dir / f"job.{n:06d}.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(dumps(job))
        os.replace(tmp, path)
        return n

    def poll(self, n: int) -> dict | None:
        """Job n's answer if it is done (VLLMEngineError if it failed or the worker is gone), else None."""
        path = self.work_dir / f"done.{n:06d}.json"
        if not path.exists():
            self.alive_or_raise(f"before finishing job {n}")
            return None
        done = json.loads(path.read_text())
        if not done.get("ok"):
            raise VLLMEngineError(f"the vLLM worker failed job {n}: {done.get('error')} (log: {self.log_path})")
        return done

    def result(self, n: int) -> dict:
        while (done := self.poll(n)) is None:
            time.sleep(self.poll_s)
        return done

    def generate(self, prompts: list[list[int]], *, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_token_ids: list[int] | None = None) -> list[dict]:
        """Each prompt's {"token_ids", "finish_reason"} (stop | length)."""
        return self.result(self.submit({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                                        "temperature": temperature, "top_p": top_p, "seed": seed,
                                        "stop_token_ids": stop_token_ids or []}))["outputs"]

    def close(self, clean: bool = True, grace_s: float = 60.0) -> None:
        """Ask the worker to exit (after its queued jobs, if `clean`), else stop its process group."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if clean and proc.poll() is None:
                self.submit({"op": "exit"})
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    pass
            stop_group(proc, grace_s)
        finally:
            self._log.close()
        if clean:  # the job files and the connector's spool; the log stays
            import shutil

            shutil.rmtree(self.work_dir, ignore_errors=True)


def stop_group(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM, then SIGKILL, to the worker's process group (vLLM's engine processes with it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
