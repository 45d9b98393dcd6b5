"""What vLLM's own processes import from this repository (run by the python of a vLLM install, its own venv; never
imported by the project's processes): the version check and the hidden-states connector for a CPU build.

    <vllm python> -m serving.plugin --check     # one JSON line: vLLM's version, usable or why not

Prep's vLLM server (serving/client.py) captures with vLLM's own hidden-state extraction: the
`extract_hidden_states` speculative method makes the target's forward return the residual stream after the layers
named in `eagle_aux_hidden_state_layer_ids` (id k = the output of decoder layer k-1, hidden_states + residual,
before the final norm for k = num_layers), the extractor's cache-only attention layer writes them into a KV cache
group, and a hidden-states KV connector copies a finished request's slots into a safetensors file
(`hidden_states` [T, n_ids, H] in the target's dtype, ids ascending; `token_ids` [T], the prompt) at the path the
request names (`kv_transfer_params.hidden_states_path`, with the connector's `allow_custom_save_path`), holding an
exclusive flock on `<file>.lock` until written.

vLLM's own ExampleHiddenStatesConnector copies through pinned memory on a CUDA stream; on a CPU build that
fails ("pin_memory=True requires a CUDA or other accelerator backend"), so on a machine without CUDA the server
names `CPUHiddenStatesConnector` below (`kv_connector_module_path=serving.plugin`): the same connector with
the copy done synchronously in host memory. Everything else (which states, their cache, the file, its keys and its
lock) is vLLM's.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys

MIN_VLLM = "0.32.0"  # the version this route is built and tested against
CONNECTOR = "ExampleHiddenStatesConnector"
CONNECTOR_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check() -> dict:
    """What --check prints: {"ok", "version", "needed", "reason", "cuda", "device_count"}; imports vLLM, loads no
    weights. `cuda`: whether this vLLM sees a CUDA device (else its server captures through CPUHiddenStatesConnector);
    `device_count`: how many."""
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means this python cannot capture
        return {"ok": False, "version": None, "needed": MIN_VLLM, "reason": f"import vllm failed: {e!r}"}
    version = getattr(vllm, "__version__", "0")
    count = _cuda_devices()
    out = {"ok": True, "version": version, "needed": MIN_VLLM, "reason": "", "cuda": count > 0, "device_count": count}
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


def _cuda_devices() -> int:
    """The CUDA devices vLLM's own torch sees on this node (0: none, a CPU build): where prep's servers go, whatever
    torch prep itself runs with (a CPU-only prep venv sees none)."""
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", required=True)
    p.parse_args(argv)
    print(json.dumps(check()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
