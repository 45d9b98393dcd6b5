"""The one client of vLLM's servers (serving/client.py) against the stand-in server (tests/vllm_standin.py): results
as they complete, vllm.max_in_flight per server, a deadline per request whatever the others do, each request's own
max_tokens, and one byte budget over every stream of the client."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from vllm_standin import standin_python

from serving.client import ServerSpec, VLLMClient
from serving.config import VLLMConfig
from serving.server import VLLMServerError

pytestmark = pytest.mark.integration


def _client(tmp_path: Path, model: Path, layer_ids: list[int] | None = None, **cfg) -> VLLMClient:
    spec = ServerSpec(model=str(model), dtype="float32", max_model_len=256, hidden_size=64,
                      layer_ids=list(layer_ids or []))
    return VLLMClient(spec, VLLMConfig(scratch_dir=str(tmp_path / "scratch"), **cfg), python=standin_python(tmp_path),
                      rank=0, log_path=tmp_path / "vllm.log")


def _most_in_flight(log: Path) -> int:
    return max(int(m) for m in re.findall(r"^in flight (\d+)$", log.read_text(), re.M))


def test_results_come_as_they_complete_each_with_its_own_max_tokens(tmp_path: Path, tiny_target_dir: Path,
                                                                    monkeypatch) -> None:
    """Three streamed requests sent together, 8, 2 and 4 tokens each: the short ones come back first, each with
    exactly its own number of tokens (no stop id: finish_reason "length")."""
    monkeypatch.setenv("STANDIN_TOKEN_S", "0.15")
    with _client(tmp_path, tiny_target_dir) as client:
        client.wait_ready()
        order = []
        with client.stream() as stream:
            for tag, n in (("eight", 8), ("two", 2), ("four", 4)):
                body, _ = client.generation_request([1, 2, 3], max_tokens=n)
                stream.submit(tag, body)
            for done in stream.completed():
                order.append((done.tag, len(done.choice["token_ids"]), done.choice["finish_reason"]))
        assert order == [("two", 2, "length"), ("four", 4, "length"), ("eight", 8, "length")]
        # the in-order call takes one budget per prompt too
        out = client.generate([[1, 2, 3], [4, 5], [6]], max_tokens=[1, 5, 3])
        assert [len(o["token_ids"]) for o in out] == [1, 5, 3]


def test_at_most_max_in_flight_requests_per_server(tmp_path: Path, tiny_target_dir: Path, monkeypatch) -> None:
    """vllm.max_in_flight=3 and 10 requests queued: the server never holds more than 3 at once, and does hold 3."""
    log = tmp_path / "standin.log"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    monkeypatch.setenv("STANDIN_TOKEN_S", "0.05")
    with _client(tmp_path, tiny_target_dir, max_in_flight=3) as client:
        client.wait_ready()
        out = client.generate([[1, 2, i + 3] for i in range(10)], max_tokens=6)
        assert len(out) == 10 and all(len(o["token_ids"]) == 6 for o in out)
    assert _most_in_flight(log) <= 3


def test_a_stuck_request_fails_on_its_own_deadline_while_another_progresses(tmp_path: Path, tiny_target_dir: Path,
                                                                           monkeypatch) -> None:
    """vllm.timeout_s=3: one request stalls after its first token while the server streams another's tokens every
    0.4 s (its counters rise: the server as a whole makes progress). A short request completes; the stuck one fails
    at its own deadline, ~3 s, naming its server, long before the progressing one would end (~8 s)."""
    monkeypatch.setenv("STANDIN_TOKEN_S", "0.4")
    monkeypatch.setenv("STANDIN_STALL_TOKEN", "7")
    with _client(tmp_path, tiny_target_dir) as client:
        client.timeout_s = 120
        client.wait_ready()
        client.timeout_s = 3
        seen = []
        start = time.perf_counter()
        with client.stream() as stream:
            stream.submit("stuck", client.generation_request([7, 1, 2], max_tokens=20)[0])
            stream.submit("slow", client.generation_request([1, 2, 3], max_tokens=20)[0])
            stream.submit("quick", client.generation_request([1, 2, 4], max_tokens=2)[0])
            with pytest.raises(VLLMServerError, match=r"vLLM server http://127.0.0.1:\d+ \(log: .*vllm.log\): a request "
                                                      r"showed no progress for 3 s \(vllm.timeout_s\)"):
                for done in stream.completed():
                    seen.append((done.tag, len(done.choice["token_ids"])))
        assert seen == [("quick", 2)] and 3 < time.perf_counter() - start < 7


def test_one_byte_budget_over_every_stream_of_the_client(tmp_path: Path, tiny_target_dir: Path, monkeypatch) -> None:
    """Two streams of one client, each with 4 capture requests, a budget that holds two requests' files: the two
    streams share it (a stream whose budget the other holds all of still sends one request, so that neither waits
    on the other: at most one file over), every answer comes and the budget is whole again at the end."""
    log = tmp_path / "standin.log"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    monkeypatch.setenv("STANDIN_SLOW_S", "0.3")
    with _client(tmp_path, tiny_target_dir, layer_ids=[1, 2], max_in_flight=8) as client:
        client.wait_ready()
        per_file = 4 * client.spec.file_bytes_per_token()
        client.budget.limit = 2 * per_file
        streams = [client.stream(), client.stream()]
        for s, stream in enumerate(streams):
            for i in range(4):
                client._files += 1
                body = {"prompt": [1, 2, 3, 4 + i], "max_tokens": 1, "temperature": 0.0, "return_token_ids": True,
                        "kv_transfer_params": {"hidden_states_path": client._file(f"s{s}-{i}")}}
                stream.submit((s, i), body, per_file)
        runs = [stream.completed() for stream in streams]
        got, most_used = [], 0
        while runs:
            for run in list(runs):
                done = next(run, None)
                if done is None:
                    runs.remove(run)
                    continue
                most_used = max(most_used, client.budget.used)
                got.append(done.tag)
                Path(done.answer["kv_transfer_params"]["hidden_states_path"]).unlink()
        assert sorted(got) == [(s, i) for s in range(2) for i in range(4)]
        assert most_used <= 3 * per_file and client.budget.used == 0
    assert _most_in_flight(log) <= 3
