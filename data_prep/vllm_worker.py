"""The vLLM side of prep's vLLM engine (regen.backend=vllm, capture.engine=vllm): run by the python of a vLLM
install (its own venv), never imported by the project's own processes (data_prep/vllm_engine.py starts it as a
subprocess and sends it jobs).

    <vllm python> -m data_prep.vllm_worker --check        # one JSON line: vLLM's version, usable or why not
    <vllm python> -m data_prep.vllm_worker --serve DIR    # one engine (DIR/engine.json), then DIR's jobs in order

One `vllm.LLM` serves every job of a prep rank, so the engine that regenerates the replies is the one that captures
their hidden states. Jobs are files: the project writes `DIR/job.<n>.json` (atomically) and the worker answers with
`DIR/done.<n>.json` ({"ok": true, ...} or {"ok": false, "error"}); `DIR/ready.json` says the engine is built.
- generate: token-id prompts, sampling settings -> each prompt's generated token ids and finish reason (stop |
  length). Regeneration's vLLM backend (data_prep/regenerate.py VLLMBackend) renders and decodes on its side.
- capture: prompts with max_tokens=1 whose hidden states the engine extracts (below), streamed into a directory.
- exit.
The worker exits by itself when the process that started it is gone.

The capture is vLLM's own hidden-state extraction: the `extract_hidden_states` speculative method makes the
target's forward return the residual stream after the layers named in `eagle_aux_hidden_state_layer_ids` (id k
= the output of decoder layer k-1, hidden_states + residual, before the final norm for k = num_layers), the
extractor's cache-only attention layer writes them into a KV cache group, and a hidden-states KV connector
copies a finished request's slots into `<storage>/<request id>.safetensors` (`hidden_states` [T, n_ids, H] in
the target's dtype, ids ascending; `token_ids` [T], the prompt). Each sample is one prompt with max_tokens=1:
its prefill computes every prompt position, and the one sampled token is never fed back, so the file holds
exactly the prompt's T positions. An engine built without layer ids (regeneration alone) has no extraction.

vLLM's own ExampleHiddenStatesConnector copies through pinned memory on a CUDA stream; on a CPU build that
fails ("pin_memory=True requires a CUDA or other accelerator backend"), so on a machine without CUDA the
connector is `CPUHiddenStatesConnector` below: the same connector with the copy done synchronously in host
memory. Everything else (which states, their cache, the file and its keys) is vLLM's.

Capture protocol: the worker renames each finished file to `<out_dir>/<n>.safetensors` and then appends
`{"id", "file", "tokens"}` to `<out_dir>/index.jsonl`, so an indexed file is complete. It waits while
`max_pending_files` captured files are still in out_dir (the reader deletes each once written to a shard), and
ends the index with `{"done": true, ...}` (capture seconds). Each index line also carries vLLM's own greedy next
token (`next_token`), and for a sample marked `logprobs` its top-1 at every position (`top1`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from pathlib import Path

MIN_VLLM = "0.32.0"  # the version this route is built and tested against
CONNECTOR = "ExampleHiddenStatesConnector"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
INDEX = "index.jsonl"
SPOOL = "spool"  # the connector's shared_storage_path, inside out_dir


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check() -> dict:
    """What --check prints: {"ok", "version", "needed", "reason"}; imports vLLM, loads no weights."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means this python cannot capture
        return {"ok": False, "version": None, "needed": MIN_VLLM, "reason": f"import vllm failed: {e!r}"}
    version = getattr(vllm, "__version__", "0")
    out = {"ok": True, "version": version, "needed": MIN_VLLM, "reason": ""}
    if _version_tuple(version) < _version_tuple(MIN_VLLM):
        out.update(ok=False, reason=f"vLLM {version} is older than {MIN_VLLM}")
        return out
    import importlib

    try:
        importlib.import_module(CONNECTOR_MODULE)
        importlib.import_module("vllm.v1.spec_decode.extract_hidden_states")
    except ImportError as e:
        out.update(ok=False, reason=f"vLLM {version} lacks the hidden-state extraction ({e})")
    return out


def __getattr__(name: str):
    # The CPU connector subclasses vLLM's, so it is built on first use: this module stays importable without vLLM
    # (vLLM's engine processes import it by kv_connector_module_path and look the class up by name).
    if name == "CPUHiddenStatesConnector":
        cls = _cpu_connector()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _cpu_connector():
    import importlib

    import torch

    base = importlib.import_module(CONNECTOR_MODULE)

    class _Done:  # what get_finished polls: the copy below is complete when the write is submitted
        def query(self) -> bool:
            return True

        def synchronize(self) -> None:
            pass

    class CPUHiddenStatesConnector(base.ExampleHiddenStatesConnector):
        """ExampleHiddenStatesConnector with its device-to-host copy (pinned memory, CUDA stream and event)
        replaced by a plain host copy; the file written, its keys and its lock are the parent's."""

        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
            offsets = torch.arange(self._block_size, dtype=torch.long)
            slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
            # A copy: the request's blocks are freed (and reused) once get_finished reports it.
            hidden = base.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
            tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            lock_fd = self._lock_fds.pop(pending.req_id, None)
            if lock_fd is None and self.use_lock:
                lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(lock_fd, fcntl.LOCK_EX)
            done = _Done()
            future = self._executor.submit(self._write_tensors, tensors, done, pending.filename, lock_fd)
            self._req_copy_events[pending.req_id] = done
            self._req_futures[pending.req_id] = future
            future.add_done_callback(lambda f, rid=pending.req_id: self._on_write_done(rid, f))

    return CPUHiddenStatesConnector


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False


def build_llm(req: dict, storage: Path):
    """The engine of `req` (DIR/engine.json): the target, its dtype and length, the parallel sizes, any other
    vllm.LLM argument; with `layer_ids`, the hidden-state extraction writing into `storage`."""
    from vllm import LLM

    kwargs = {
        "model": req["model"],
        "tokenizer": req.get("tokenizer") or req["model"],
        "dtype": req["dtype"],
        "max_model_len": req["max_model_len"],
        "tensor_parallel_size": req.get("tensor_parallel_size", 1),
        "pipeline_parallel_size": req.get("pipeline_parallel_size", 1),
        # Every sample computed from its own tokens, as the HF capture does (no blocks shared between samples).
        "enable_prefix_caching": False,
    }
    if req.get("layer_ids"):
        kv = {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        if not _cuda():
            kv.update(kv_connector="CPUHiddenStatesConnector", kv_connector_module_path="data_prep.vllm_worker")
        kwargs.update(
            speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                "draft_model_config": {"hf_config": {
                                    "eagle_aux_hidden_state_layer_ids": list(req["layer_ids"])}}},
            kv_transfer_config=kv)
    return LLM(**kwargs, **req.get("engine_kwargs", {}))


def _pending(out_dir: Path) -> int:
    return sum(1 for p in out_dir.glob("*.safetensors"))


def _chunks(samples: list[dict], chunk_tokens: int) -> list[list[dict]]:
    out: list[list[dict]] = []
    size = 0
    for s in samples:
        if out and size + len(s["input_ids"]) <= chunk_tokens:
            out[-1].append(s)
            size += len(s["input_ids"])
        else:
            out.append([s])
            size = len(s["input_ids"])
    return out


def next_tokens(output) -> dict:
    """vLLM's own next-token choice for one prompt: `next_token` (what it sampled at temperature 0 after the last
    position) and its log-probability; with prompt logprobs, `top1` / `top1_logprob` at every position j (the
    rank-1 entry of position j+1's prompt logprobs, then the sampled token)."""
    sampled = output.outputs[0]
    token = int(sampled.token_ids[0])
    logprob = float(sampled.logprobs[0][token].logprob) if sampled.logprobs else None
    out: dict = {"next_token": token, "next_logprob": logprob}
    if output.prompt_logprobs is not None:
        top = [next(lp for lp in d.values() if lp.rank == 1) for d in output.prompt_logprobs[1:]]
        ids = [next(t for t, lp in d.items() if lp.rank == 1) for d in output.prompt_logprobs[1:]]
        out["top1"] = [*map(int, ids), token]
        out["top1_logprob"] = [*(float(lp.logprob) for lp in top), logprob]
    return out


def _take_file(output) -> str | None:
    """The connector file of a finished request, once its writer has released it (None: no extraction)."""
    path = (output.kv_transfer_params or {}).get("hidden_states_path")
    if path is not None:
        with open(path + ".lock") as lock:  # the connector's writer holds it exclusively until written
            fcntl.flock(lock, fcntl.LOCK_SH)
        os.unlink(path + ".lock")
    return path


class Engine:
    """One vllm.LLM and the jobs it runs (serve): generate and capture."""

    def __init__(self, spec: dict, control: Path):
        self.storage = control / SPOOL
        self.storage.mkdir(parents=True, exist_ok=True)
        self.llm = build_llm(spec, self.storage)
        self.extracts = bool(spec.get("layer_ids"))

    def generate(self, job: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=int(job["max_tokens"]), temperature=float(job["temperature"]),
                                top_p=float(job.get("top_p", 1.0)), seed=job.get("seed"),
                                stop_token_ids=list(job.get("stop_token_ids") or []))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in job["prompts"]], params, use_tqdm=False)
        replies = []
        for o in outs:
            path = _take_file(o)
            if path is not None:  # an extracting engine also saved this prompt's states: not wanted here
                os.unlink(path)
            c = o.outputs[0]
            replies.append({"token_ids": list(map(int, c.token_ids)), "finish_reason": c.finish_reason})
        return {"outputs": replies}

    def capture(self, job: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not self.extracts:
            raise RuntimeError("this engine was built without layer ids: it cannot capture hidden states")
        out_dir = Path(job["out_dir"])
        out_dir.mkdir(parents=True, exist_ok=True)
        samples = [json.loads(line) for line in Path(job["samples_file"]).read_text().splitlines() if line.strip()]
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)
        # A sample marked "logprobs" (the prep's probe) also returns vLLM's top-1 at every prompt position: what
        # the project side checks its target head against (vllm_capture.check_probe) without a transformers target.
        probe_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1)
        serial, tokens, busy = 0, 0, 0.0
        with open(out_dir / INDEX, "a") as index:
            for chunk in _chunks(samples, int(job.get("chunk_tokens", 1 << 16))):
                while _pending(out_dir) >= int(job.get("max_pending_files", 256)):
                    time.sleep(0.05)  # the reader has not caught up yet: bounded disk use
                t = time.perf_counter()
                outs = self.llm.generate([TokensPrompt(prompt_token_ids=s["input_ids"]) for s in chunk],
                                         [probe_params if s.get("logprobs") else params for s in chunk],
                                         use_tqdm=False)
                for s, o in zip(chunk, outs):
                    path = _take_file(o)
                    if path is None:
                        raise RuntimeError(f"sample {s['id']!r}: vLLM returned no hidden_states_path "
                                           f"({o.kv_transfer_params})")
                    name = f"{serial:08d}.safetensors"
                    os.replace(path, out_dir / name)
                    index.write(json.dumps({"id": s["id"], "file": name, "tokens": len(s["input_ids"]),
                                            **next_tokens(o)}) + "\n")
                    index.flush()
                    serial += 1
                    tokens += len(s["input_ids"])
                busy += time.perf_counter() - t
            done = {"done": True, "samples": serial, "tokens": tokens, "capture_s": busy}
            index.write(json.dumps(done) + "\n")
        return done


def write_atomic(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def job_path(control: Path, n: int, kind: str = "job") -> Path:
    return control / f"{kind}.{n:06d}.json"


def serve(control: Path, make_engine, poll_s: float = 0.02) -> int:
    """Build the engine (`make_engine(spec, control)`, spec: control/engine.json), then answer control's jobs in
    order until an exit job, or until the process that started this one is gone."""
    parent = os.getppid()
    start = time.perf_counter()
    engine = make_engine(json.loads((control / "engine.json").read_text()), control)
    write_atomic(control / "ready.json", {"startup_s": time.perf_counter() - start, "engine": engine_version()})
    n = 0
    while True:
        path = job_path(control, n)
        if not path.exists():
            if os.getppid() != parent:
                return 1  # orphaned: whoever sent the jobs is gone
            time.sleep(poll_s)
            continue
        job = json.loads(path.read_text())
        if job["op"] == "exit":
            write_atomic(job_path(control, n, "done"), {"ok": True})
            return 0
        try:
            result = {"ok": True, **getattr(engine, job["op"])(job)}
        except Exception as e:  # noqa: BLE001 - reported to the project side, which raises it with the log
            import traceback

            traceback.print_exc()
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        write_atomic(job_path(control, n, "done"), result)
        n += 1


def engine_version() -> str:
    try:
        return __import__("vllm").__version__
    except ImportError:
        return "none"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--serve", metavar="DIR", help="build DIR/engine.json's engine and answer DIR's jobs")
    args = p.parse_args(argv)
    if args.check:
        print(json.dumps(check()))
        return 0
    return serve(Path(args.serve), Engine)


if __name__ == "__main__":
    sys.exit(main())
