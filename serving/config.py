"""The `vllm.*` keys: the vLLM servers a prep, a vLLM-fed training run or an on-policy stage sends its requests to
(serving/client.py), the same keys with the same meaning wherever they appear (data_prep/config.py PrepConfig.vllm,
train/config.py RunConfig.vllm)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infra.config_keys import ConfigError


@dataclass
class VLLMConfig:
    """Prep's vLLM engine (serving/client.py): vLLM's own OpenAI-compatible server. It regenerates with
    regen.backend=vllm and captures with capture.engine=vllm, the same server for both. Prep starts one per prep
    rank, on the rank's own group of tensor_parallel_size x pipeline_parallel_size devices of its node, or uses the
    servers already running at `urls`."""

    python: str | None = None  # the python of a vLLM install (its own venv); None: this one, if it imports vllm
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # any other engine argument of the servers prep starts, as `vllm serve` takes it (enforce_eager: true ->
    # --enforce-eager; gpu_memory_utilization: 0.9; distributed_executor_backend: ray)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    # Servers already running, started with the command docs/scaling.md gives: prep starts none. Each entry is
    # http(s)://host:port (the server of the node whose name or address `host` is) or node=http(s)://host:port (the
    # server of node `node`, as its hostname or SLURM names it); a rank uses its own node's servers (node-local
    # scratch), the node's ranks splitting them (serving/client.py node_urls).
    urls: list[str] = field(default_factory=list)
    # bounds every wait: a server's startup and each request's silence (streamed: no token for that long; sent whole,
    # as a request for a states file is: no answer and no progress on its server's token counters), not how long a
    # request waits in its queue
    timeout_s: float = 1200.0
    max_in_flight: int = 128  # requests in flight on each server, over every stream of a rank (vLLM batches them)
    # Node-local scratch for the hidden-state files the server writes (None: $TMPDIR, else the system's temporary
    # directory), bounded to scratch_gb per prep rank (a node's ranks together: scratch_gb x ranks per node, which
    # must be free there): only finished shards go to the prep directory.
    scratch_dir: str | None = None
    scratch_gb: float = 8.0
    # What the probe batch's vLLM capture is checked against before any sample is written. engine: the prep's
    # target head on vLLM's teacher reproduces vLLM's own next-token choice at every probe position (its prompt
    # logprobs), and no transformers copy of the target loads (a target larger than one device stays in vLLM).
    # hf: additionally the target's transformers forward, tap by tap (loads the whole target in each prep rank).
    capture_fidelity: str = "engine"

    def servers(self) -> list[tuple[str | None, str]]:
        """`urls` as (node or None, base URL without a trailing slash); ConfigError naming the entry that is neither
        http(s)://host:port nor node=http(s)://host:port."""
        from urllib.parse import urlsplit

        out = []
        for entry in self.urls:
            node, sep, url = str(entry).partition("=")
            if not sep:
                node, url = None, str(entry)
            try:
                parts = urlsplit(url)
                port = parts.port
            except ValueError:
                parts, port = None, None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None or (
                    node is not None and not node.strip()):
                raise ConfigError(f"vllm.urls entry {entry!r} is not http(s)://host:port or node=http(s)://host:port "
                                  "of a running vLLM server")
            out.append((node.strip() if node else None, url.rstrip("/")))
        return out
