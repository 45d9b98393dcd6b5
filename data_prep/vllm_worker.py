"""The vLLM side of `capture.engine=vllm`: run by the python of a vLLM install (its own venv), never imported
by the project's own processes (data_prep/vllm_capture.py starts it as a subprocess).

    <vllm python> -m data_prep.vllm_worker --check            # one JSON line: vLLM's version, usable or why not
    <vllm python> -m data_prep.vllm_worker --request req.json  # capture (req.json: vllm_capture.worker_request)

The capture is vLLM's own hidden-state extraction: the `extract_hidden_states` speculative method makes the
target's forward return the residual stream after the layers named in `eagle_aux_hidden_state_layer_ids` (id k
= the output of decoder layer k-1, hidden_states + residual, before the final norm for k = num_layers), the
extractor's cache-only attention layer writes them into a KV cache group, and a hidden-states KV connector
copies a finished request's slots into `<storage>/<request id>.safetensors` (`hidden_states` [T, n_ids, H] in
the target's dtype, ids ascending; `token_ids` [T], the prompt). Each sample is one prompt with max_tokens=1:
its prefill computes every prompt position, and the one sampled token is never fed back, so the file holds
exactly the prompt's T positions.

vLLM's own ExampleHiddenStatesConnector copies through pinned memory on a CUDA stream; on a CPU build that
fails ("pin_memory=True requires a CUDA or other accelerator backend"), so on a machine without CUDA the
connector is `CPUHiddenStatesConnector` below: the same connector with the copy done synchronously in host
memory. Everything else (which states, their cache, the file and its keys) is vLLM's.

Protocol with the project side: the worker renames each finished file to `<out_dir>/<n>.safetensors` and then
appends `{"id", "file", "tokens"}` to `<out_dir>/index.jsonl`, so an indexed file is complete. It waits while
`max_pending_files` captured files are still in out_dir (the reader deletes each once written to a shard), and
ends the index with `{"done": true, ...}` (start-up and capture seconds). Each index line also carries vLLM's
own greedy next token (`next_token`), and for a sample marked `logprobs` its top-1 at every position (`top1`).
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
    from vllm import LLM

    kv = {"kv_connector": CONNECTOR, "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    if not _cuda():
        kv.update(kv_connector="CPUHiddenStatesConnector", kv_connector_module_path="data_prep.vllm_worker")
    kwargs = {
        "model": req["model"],
        "tokenizer": req.get("tokenizer") or req["model"],
        "dtype": req["dtype"],
        "max_model_len": req["max_model_len"],
        "tensor_parallel_size": req.get("tensor_parallel_size", 1),
        "pipeline_parallel_size": req.get("pipeline_parallel_size", 1),
        # Every sample computed from its own tokens, as the HF capture does (no blocks shared between samples).
        "enable_prefix_caching": False,
        "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                               "draft_model_config": {"hf_config": {
                                   "eagle_aux_hidden_state_layer_ids": list(req["layer_ids"])}}},
        "kv_transfer_config": kv,
        **req.get("engine_kwargs", {}),
    }
    return LLM(**kwargs)


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


def run(req: dict) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out_dir = Path(req["out_dir"])
    storage = out_dir / SPOOL
    storage.mkdir(parents=True, exist_ok=True)
    samples = [json.loads(line) for line in Path(req["samples_file"]).read_text().splitlines() if line.strip()]
    start = time.perf_counter()
    llm = build_llm(req, storage)
    startup_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1)
    # A sample marked "logprobs" (the prep's probe) also returns vLLM's top-1 at every prompt position: what the
    # project side checks its target head against (vllm_capture.check_probe) without a transformers target.
    probe_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=1, prompt_logprobs=1)
    index = open(out_dir / INDEX, "a")
    serial, tokens, busy = 0, 0, 0.0
    for chunk in _chunks(samples, int(req.get("chunk_tokens", 1 << 16))):
        while _pending(out_dir) >= int(req.get("max_pending_files", 256)):
            time.sleep(0.05)  # the reader has not caught up yet: bounded disk use
        t = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=s["input_ids"]) for s in chunk],
                            [probe_params if s.get("logprobs") else params for s in chunk], use_tqdm=False)
        for s, o in zip(chunk, outs):
            path = (o.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError(f"sample {s['id']!r}: vLLM returned no hidden_states_path ({o.kv_transfer_params})")
            with open(path + ".lock") as lock:  # the connector's writer holds it exclusively until written
                fcntl.flock(lock, fcntl.LOCK_SH)
            os.unlink(path + ".lock")
            name = f"{serial:08d}.safetensors"
            os.replace(path, out_dir / name)
            index.write(json.dumps({"id": s["id"], "file": name, "tokens": len(s["input_ids"]), **next_tokens(o)})
                        + "\n")
            index.flush()
            serial += 1
            tokens += len(s["input_ids"])
        busy += time.perf_counter() - t
    index.write(json.dumps({"done": True, "samples": serial, "tokens": tokens, "startup_s": startup_s,
                            "capture_s": busy, "vllm": __import__("vllm").__version__}) + "\n")
    index.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    p.add_argument("--request")
    args = p.parse_args(argv)
    if args.check:
        print(json.dumps(check()))
        return 0
    run(json.loads(Path(args.request).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
