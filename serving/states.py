"""The hidden-states connector's files, as the client receives them: vLLM's extraction writes, for each request
that names a path (`kv_transfer_params.hidden_states_path`), a safetensors file holding the residual stream after
the layers it extracts (`hidden_states` [T, n_ids, H] in the server's dtype, ids ascending) and the tokens fed
(`token_ids` [T]), under an exclusive flock on `<file>.lock` until written (serving/plugin.py).

vLLM's aux layer id k is the output of decoder layer k-1: tap layer i is id i+1, and the last layer's output before
the final norm (the hidden teacher) is id num_layers (`aux_layer_ids`).
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from serving.server import VLLMServerError


class VLLMCaptureError(RuntimeError):
    """The engine wrote a file that does not belong to its sample; the message names the file."""


def aux_layer_ids(tap_layers: list[int], num_layers: int) -> tuple[list[int], list[int], int]:
    """(vLLM aux layer ids to extract, ascending and distinct; the column of each tap in their order; the teacher's
    column). Tap i (output of decoder layer i) is vLLM's id i+1, the teacher (last layer's output) is num_layers."""
    bad = [i for i in tap_layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"tap layers {bad} out of range for a {num_layers}-layer target")
    ids = sorted({i + 1 for i in tap_layers} | {num_layers})
    return ids, [ids.index(i + 1) for i in tap_layers], ids.index(num_layers)


def read_states(path: Path, sample_id: str, num_ids: int, hidden_size: int, dtype: str | None = None,
                where: str = "the vLLM server") -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_states [n, num_ids, H], token_ids [n]) of one connector file, after checking its keys, its shape
    against the extracted layers and, given `dtype`, prep's dtype (the connector writes the server's own: a user's
    server started with another --dtype computes other features)."""
    try:
        data = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise VLLMCaptureError(f"{path} (sample {sample_id!r}): unreadable ({e})") from e
    missing = [k for k in ("hidden_states", "token_ids") if k not in data]
    if missing:
        raise VLLMCaptureError(f"{path} (sample {sample_id!r}): no {missing} (not a hidden-states connector file)")
    hs, ids = data["hidden_states"], data["token_ids"]
    n = ids.shape[0] if ids.dim() == 1 else -1
    if hs.shape != (n, num_ids, hidden_size):
        raise VLLMCaptureError(f"{path} (sample {sample_id!r}): hidden_states {tuple(hs.shape)}, expected "
                               f"{(n, num_ids, hidden_size)} (tokens, extracted layers, hidden size)")
    if dtype is not None and hs.dtype != getattr(torch, dtype):
        raise VLLMCaptureError(f"{where} computes in {str(hs.dtype).removeprefix('torch.')}, prep in {dtype} "
                               f"({path}, sample {sample_id!r}): start it with --dtype {dtype}, or give prep "
                               f"dtype={str(hs.dtype).removeprefix('torch.')}")
    return hs, ids.long()


def features_from_file(path: Path, input_ids: torch.Tensor, sample_id: str, columns: list[int], teacher: int,
                       num_ids: int, hidden_size: int, dtype: str | None = None,
                       where: str = "the vLLM server") -> tuple[torch.Tensor, torch.Tensor]:
    """(taps [T, n_taps*H] in tap order, teacher hidden [T, H]) from one connector file, after checking that it
    holds exactly this sample's tokens (read_states checks the rest)."""
    n = len(input_ids)
    hs, ids = read_states(path, sample_id, num_ids, hidden_size, dtype, where)
    if ids.shape != (n,) or not torch.equal(ids, input_ids.long()):
        raise VLLMCaptureError(f"{path} (sample {sample_id!r}): its token ids ({tuple(ids.shape)}) are not the "
                               f"sample's {n} tokens")
    taps = torch.cat([hs[:, c] for c in columns], dim=-1)
    return taps, hs[:, teacher]


def engine_layer_ids(tap_layers: list[int], num_layers: int) -> list[int]:
    """The aux layer ids a server that captures for these taps extracts."""
    return aux_layer_ids(tap_layers, num_layers)[0]


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
