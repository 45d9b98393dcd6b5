"""Prep's vLLM servers (serving/server.py, serving/client.py): what each rank's server gets (devices,
environment, port, flags) on one node and on two, how ranks split the user's servers, the guard that takes the
server's whole process group down with its parent, and bounded waits. The stand-in server (tests/vllm_standin.py)
speaks vLLM's HTTP; prep's behaviour end to end against it is in tests/test_prep_capture_vllm.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_prep.config import PrepConfig, VLLMConfig
from serving.client import ServerSpec, VLLMClient, node_urls, serve_args
from serving.server import (
    TORCHRUN_VARS,
    VLLMServerError,
    VLLMUnavailable,
    device_group,
    reason_from_log,
    resolve_python,
    server_env,
)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_standin import standin_python  # noqa: E402 - tests/ is no package


def torchrun_env(rank: int, world: int, local_rank: int, local_world: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(rank // local_world), "MASTER_ADDR": "node0",
            "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job", "PATH": "/usr/bin", "HF_HOME": "/cache"}


@pytest.mark.parametrize(("ranks_per_node", "tp", "expected"), [
    (8, 1, ["0", "1", "2", "3", "4", "5", "6", "7"]),  # an 8B target on eight GPUs: one server per GPU
    (4, 2, ["0,1", "2,3", "4,5", "6,7"]),
    (1, 8, ["0,1,2,3,4,5,6,7"]),
])
def test_each_rank_of_a_node_gets_its_own_device_group(ranks_per_node: int, tp: int, expected: list[str]) -> None:
    got = [device_group(local, tp, num_devices=8) for local in range(ranks_per_node)]
    assert got == expected
    # two nodes: torchrun numbers the local ranks per node, so the second node's ranks take the same local blocks
    for node in range(2):
        for local in range(ranks_per_node):
            rank = node * ranks_per_node + local
            env = server_env(torchrun_env(rank, 2 * ranks_per_node, local, ranks_per_node),
                             device_group(local, tp, 8), key="k")
            assert env["CUDA_VISIBLE_DEVICES"] == expected[local]
            assert not set(TORCHRUN_VARS) & set(env) and not [k for k in env if k.startswith("TORCHELASTIC")]
            assert env["VLLM_API_KEY"] == "k" and env["PATH"] == "/usr/bin" and env["HF_HOME"] == "/cache"
            assert str(ROOT) in env["PYTHONPATH"].split(os.pathsep)  # vLLM imports the CPU connector from here


def test_device_groups_follow_the_nodes_own_visible_devices_and_refuse_too_many_ranks() -> None:
    assert [device_group(r, 2, 4, visible="4,5,6,7") for r in range(2)] == ["4,5", "6,7"]  # SLURM's share
    with pytest.raises(ValueError, match=r"local rank 4's vLLM server needs devices 8..9 .* this node has 8 .* "
                                         r"at most 4 prep ranks per node"):
        device_group(4, 2, num_devices=8)
    assert device_group(0, 1, num_devices=0) is None  # a CPU build: no devices to name


def test_the_users_servers_are_matched_to_ranks_by_node() -> None:
    """vllm.urls: a rank takes the servers of its own node (by the URL's host, or node=URL), whatever its global
    rank (c10d rendezvous numbers nodes in join order), split over the node's ranks; a node without one is refused."""
    from infra.config_keys import ConfigError

    cfg = VLLMConfig(urls=["http://node-a:8000", "http://node-b:8000", "http://node-b:8001", "gpu7=http://10.9.9.9:80"])
    servers = cfg.servers()
    assert servers[3] == ("gpu7", "http://10.9.9.9:80")
    names_b = {"node-b", "node-b.cluster"}
    assert [node_urls(servers, names_b, r, 2) for r in range(2)] == [["http://node-b:8000"], ["http://node-b:8001"]]
    assert [node_urls(servers, names_b, r, 1) for r in range(1)] == [["http://node-b:8000", "http://node-b:8001"]]
    assert [node_urls(servers, {"node-a"}, r, 3) for r in range(3)] == [["http://node-a:8000"]] * 3  # shared
    assert node_urls(servers, {"gpu7"}, 0, 1) == ["http://10.9.9.9:80"]  # node=URL: the node's name decides
    assert node_urls(VLLMConfig(urls=["http://127.0.0.1:8000"]).servers(), {"any"}, 0, 1) == ["http://127.0.0.1:8000"]
    with pytest.raises(ConfigError, match=r"vllm.urls has no server on this prep rank's node \(node-c\): "
                                          r"http://node-a:8000, .*gpu7=http://10.9.9.9:80"):
        node_urls(servers, {"node-c"}, 0, 1)


def test_the_nodes_own_names_and_addresses_match_its_urls(monkeypatch) -> None:
    import socket

    from serving.client import is_this_node, node_names

    monkeypatch.setattr(socket, "gethostname", lambda: "node-b.cluster")
    monkeypatch.setenv("SLURMD_NODENAME", "nb")
    assert {"node-b", "node-b.cluster", "nb"} <= node_names()
    assert is_this_node("NODE-B", node_names()) and is_this_node("localhost", set())
    assert not is_this_node("node-a.invalid", {"node-b"})


def test_serve_args_extract_the_taps_and_take_the_users_engine_arguments() -> None:
    spec = ServerSpec(model="/m", dtype="bfloat16", max_model_len=1025, hidden_size=8, layer_ids=[2, 15, 30],
                      tensor_parallel_size=2, engine_kwargs={"enforce_eager": True, "gpu_memory_utilization": 0.9,
                                                             "enable_chunked_prefill": False})
    args = serve_args(spec, "/scratch/spool", cuda=True)
    assert args[:12] == ["--model", "/m", "--dtype", "bfloat16", "--max-model-len", "1025", "--tensor-parallel-size",
                         "2", "--pipeline-parallel-size", "1", "--no-enable-prefix-caching", "--speculative-config"]
    extract = json.loads(args[12])
    assert extract["method"] == "extract_hidden_states"
    assert extract["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 30]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in kv
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/scratch/spool", "allow_custom_save_path": True}
    assert args[-4:] == ["--enforce-eager", "--gpu-memory-utilization", "0.9", "--no-enable-chunked-prefill"]
    cpu = json.loads(serve_args(spec, "/s", cuda=False)[args.index("--kv-transfer-config") + 1])
    assert (cpu["kv_connector"], cpu["kv_connector_module_path"]) == ("CPUHiddenStatesConnector",
                                                                      "serving.plugin")
    regen_only = serve_args(ServerSpec(model="/m", dtype="float32", max_model_len=9, hidden_size=8), "/s", cuda=False)
    assert "--speculative-config" not in regen_only and "--kv-transfer-config" not in regen_only


def test_scratch_must_hold_one_sample(tmp_path: Path) -> None:
    from infra.config_keys import ConfigError

    spec = ServerSpec(model="/m", dtype="bfloat16", max_model_len=40_001, hidden_size=2880, layer_ids=[2, 18, 33, 36])
    with pytest.raises(ConfigError, match=r"vllm.scratch_gb=0.5 holds less than one sample of max_len \(40000 tokens"):
        VLLMClient(spec, VLLMConfig(scratch_gb=0.5), python="/x", cuda=False, rank=0, local_rank=0,
                   log_path=tmp_path / "vllm.log")
    # the node's ranks together: scratch_gb x ranks per node must be free on the scratch's filesystem
    client = VLLMClient(spec, VLLMConfig(scratch_gb=2.0, scratch_dir=str(tmp_path)), python="/x", cuda=False, rank=0,
                        local_rank=0, local_world=1_000_000, log_path=tmp_path / "vllm.log")
    with pytest.raises(ConfigError, match=r"vllm.scratch_gb=2.0 per rank x 1000000 ranks on this node = 2e\+06 "
                                          r"GiB of node-local scratch, but .* GiB free"):
        client.start()


def test_a_relative_vllm_python_is_taken_from_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert resolve_python("venv/bin/python") == str(python)  # absolute: the server runs from the repository root
    with pytest.raises(VLLMUnavailable, match=r"vllm.python='nope/python' is not an executable file \(/"):
        resolve_python("nope/python")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("urls", ["n1:8000"], "vllm.urls entry 'n1:8000' is not http"),
    ("urls", ["localhost:8000"], "vllm.urls entry 'localhost:8000' is not http"),
    ("urls", ["http://n1"], r"vllm.urls entry 'http://n1' is not http\(s\)://host:port"),
    ("urls", ["=http://n1:80"], "vllm.urls entry '=http://n1:80'"),
    ("timeout_s", 0, "vllm.timeout_s must be > 0"),
    ("timeout_s", -5, "vllm.timeout_s must be > 0"),
    ("max_in_flight", 0, "vllm.max_in_flight must be >= 1"),
    ("scratch_gb", -1, "vllm.scratch_gb must be > 0"),
    ("capture_fidelity", "x", "vllm.capture_fidelity must be engine|hf"),
    ("engine_kwargs", {"model": "x"}, r"vllm.engine_kwargs sets \['model'\]"),
])
def test_config_refusals_for_the_servers(key: str, value, message: str) -> None:
    """Every bad vllm.* value is a ConfigError naming the key (a user error: exit 2, no traceback)."""
    from infra.config_keys import ConfigError

    cfg = PrepConfig(out="x")
    cfg.capture.engine = "vllm"
    setattr(cfg.vllm, key, value)
    with pytest.raises(ConfigError, match=message):
        cfg.validate()


def test_the_users_servers_take_no_engine_settings() -> None:
    from infra.config_keys import ConfigError

    for extra in ({"tensor_parallel_size": 8}, {"engine_kwargs": {"enforce_eager": True}}):
        cfg = PrepConfig(out="x")
        cfg.capture.engine, cfg.vllm.urls = "vllm", ["http://n1:8000"]
        for k, v in extra.items():
            setattr(cfg.vllm, k, v)
        with pytest.raises(ConfigError, match="vllm.urls names servers already running"):
            cfg.validate()


VLLM_LOGS = Path(__file__).resolve().parent / "data" / "vllm_logs"


@pytest.mark.parametrize(("log", "reason"), [
    # vLLM 0.32's own log of an engine core that failed to start: the root cause, not the wrappers around it
    ("engine_core_failed.log", "ValueError: Available memory on node 0 (21.25/23.54 GiB) on kv cache allocation is "
                               "less than requested memory for kv (500.0 GiB)."),
    # vllm serve refusing an engine argument (`+vllm.engine_kwargs.foo=1`): argparse's line, no Python error
    ("unrecognized_argument.log", "vLLM refused its command line: unrecognized arguments: --foo"),
    # a start-up warning that quotes an error it fears is no reason
    ("warning_only.log", None),
])
def test_vllms_root_cause_is_quoted_from_its_log(log: str, reason: str | None) -> None:
    got = reason_from_log(VLLM_LOGS / log)
    assert (got if reason is None else got[: len(reason)]) == reason, got


def test_a_plain_error_line_is_its_reason(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\n(APIServer pid=1) Traceback (most recent call last):\n  File x\n"
                   "(APIServer pid=1) ValueError: Total number of attention heads (9) must be divisible by tensor "
                   "parallel size (3).\n")
    assert reason_from_log(log) == ("ValueError: Total number of attention heads (9) must be divisible by tensor "
                                    "parallel size (3).")
    assert reason_from_log(tmp_path / "missing.log") is None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")  # a zombie is gone: it only waits to be reaped


def _wait_gone(pids: list[int], timeout_s: float = 20.0) -> list[int]:
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(map(_alive, pids)):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


SLEEPER = ("import os, subprocess, sys, time\n"
           "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
           "print('pids', os.getpid(), child.pid, flush=True)\n"
           "time.sleep(600)\n")


@pytest.mark.integration
@pytest.mark.parametrize("how", ["close", "kill -9"])
def test_the_guard_stops_the_servers_whole_process_group_when_its_parent_goes(tmp_path: Path, how: str) -> None:
    """A 'server' with a child of its own (as vLLM's API server has its engine core) under the guard: closed, or
    with the process that started it killed by SIGKILL, neither the server nor its child outlives it."""
    log = tmp_path / "server.log"
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    go = tmp_path / "go"
    # the parent: a python that starts the guarded server and then waits (or closes it)
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from serving.server import VLLMServer\n"
        f"s = VLLMServer(sys.executable, [], log_path=Path({str(log)!r}))\n"
        f"s.args = []\n"
        f"s.__class__.command = property(lambda self: [sys.executable, {str(script)!r}])\n"
        "s.start()\n"
        f"while not Path({str(go)!r}).exists(): time.sleep(0.1)\n"
        f"{'s.close()' if how == 'close' else 'time.sleep(600)'}\n")], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.time() + 30
    while not (log.exists() and re.search(r"pids \d+ \d+\n", log.read_text())) and time.time() < deadline:
        time.sleep(0.1)
    server, child = map(int, re.search(r"pids (\d+) (\d+)\n", log.read_text()).groups())
    assert _alive(server) and _alive(child)
    go.touch()
    if how == "kill -9":
        parent.send_signal(signal.SIGKILL)
    parent.wait(timeout=60)
    assert _wait_gone([server, child]) == []


def _client(tmp_path: Path, model: Path, env_log: Path, devices: str | None = None, **cfg) -> VLLMClient:
    spec = ServerSpec(model=str(model), dtype="float32", max_model_len=256, hidden_size=64,
                      tensor_parallel_size=cfg.pop("tp", 1))
    return VLLMClient(spec, VLLMConfig(scratch_dir=str(tmp_path / "scratch"), **cfg), python=standin_python(tmp_path),
                      cuda=False, rank=int(os.environ.get("RANK", 0)),
                      local_rank=int(os.environ.get("LOCAL_RANK", 0)), log_path=tmp_path / "vllm.log",
                      devices=devices)


@pytest.mark.integration
def test_a_started_server_gets_its_rank_devices_and_no_torchrun_variables(tmp_path: Path, tiny_target_dir: Path,
                                                                          monkeypatch) -> None:
    """Rank 1 of 4 on a node of 8 GPUs, TP 2: its server sees GPUs 2,3 alone, none of torchrun's variables, a key of
    its own and 127.0.0.1 on a free port; it answers, and is gone with its child once the client closes."""
    log = tmp_path / "standin.log"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    for k, v in torchrun_env(1, 4, 1, 4).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    from data_prep.pipeline import rank_devices

    cfg, plan = _plan_cfg(tp=2)  # the layout prep computes: vLLM counts 8 devices, prep's own torch none
    layout = rank_devices(cfg, plan, local_rank=1, local_world=4, prep_devices=0, node_devices=8,
                          visible=os.environ["CUDA_VISIBLE_DEVICES"])
    assert layout.head == "cpu"
    with _client(tmp_path, tiny_target_dir, log, devices=layout.server, tp=2) as client:
        client.wait_ready()
        port = client.server.port
        out = client.generate([[1, 2, 3]], max_tokens=3, stop_token_ids=[0])
        assert len(out[0]["token_ids"]) <= 3 and out[0]["finish_reason"] in ("stop", "length")
    server = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("server "))[7:])
    assert server["devices"] == "2,3" and server["tp"] == 2 and server["port"] == port and server["key"]
    assert not set(TORCHRUN_VARS) & set(server["env"]) and "TORCHELASTIC_RUN_ID" not in server["env"]
    assert _wait_gone([server["pid"], server["child"]]) == []
    assert not list((tmp_path / "scratch").iterdir())  # the launch's scratch went with it


@pytest.mark.integration
def test_a_server_that_accepts_and_never_answers_fails_within_the_deadline(tmp_path: Path, tiny_target_dir: Path,
                                                                          monkeypatch) -> None:
    """vllm.timeout_s bounds a server's silence: requests in flight, no answer and no progress on its counters (a
    request sent whole, as every request that asks for a states file is), or no token (a streamed one)."""
    monkeypatch.setenv("STANDIN_HANG", "1")
    with _client(tmp_path, tiny_target_dir, tmp_path / "standin.log") as client:
        client.wait_ready()
        client.timeout_s = 3  # vllm.timeout_s (here shorter than the stand-in's start-up)
        start = time.perf_counter()
        with pytest.raises(VLLMServerError, match=r"vLLM server http://127.0.0.1:\d+ \(log: .*vllm.log\): a request "
                                                  r"showed no progress for 3 s \(vllm.timeout_s\)"):
            client.generate([[1, 2, 3]] * 4, max_tokens=3)
        assert time.perf_counter() - start < 30  # the deadline, not the stand-in's hour
        client.spec = ServerSpec(model="m", dtype="float32", max_model_len=256, hidden_size=64, layer_ids=[2, 4, 8])
        start = time.perf_counter()
        with pytest.raises(VLLMServerError, match=r"vLLM server http://127.0.0.1:\d+ \(log: .*vllm.log\): no answer "
                                                  r"and no progress for 3 s with requests in flight \(vllm.timeout_s\)"):
            list(client.capture([(str(i), [1, 2, 3]) for i in range(4)]))
        assert time.perf_counter() - start < 30


@pytest.mark.integration
def test_a_long_queue_that_makes_progress_is_not_silence(tmp_path: Path, tiny_target_dir: Path, monkeypatch) -> None:
    """Requests answered one at a time, each after 1.5 s of work, 4 in flight: the last answer comes ~6 s after it was
    sent, past vllm.timeout_s=3, but the server's token counters rise all along: no error, every answer."""
    monkeypatch.setenv("STANDIN_SLOW_S", "1.5")
    spec = ServerSpec(model=str(tiny_target_dir), dtype="float32", max_model_len=256, hidden_size=64,
                      layer_ids=[2, 4, 8])
    client = VLLMClient(spec, VLLMConfig(scratch_dir=str(tmp_path / "scratch"), max_in_flight=4, timeout_s=3),
                        python=standin_python(tmp_path), cuda=False, rank=0, local_rank=0,
                        log_path=tmp_path / "vllm.log")
    with client:
        client.timeout_s = 120
        client.wait_ready()
        client.timeout_s = 3
        start = time.perf_counter()
        got = [key for key, _, _ in client.capture([(str(i), [1, 2, 3, i + 4]) for i in range(4)])]
        assert got == ["0", "1", "2", "3"] and time.perf_counter() - start > 5


@pytest.mark.integration
@pytest.mark.parametrize("how", ["torn", "another path"])
def test_a_torn_answer_or_a_foreign_file_is_an_error_naming_the_server(tmp_path: Path, tiny_target_dir: Path,
                                                                      monkeypatch, how: str) -> None:
    """An answer cut short is an engine error naming the server (not a raw IncompleteRead); a server that wrote its
    file elsewhere than asked (no allow_custom_save_path) is refused, its file left alone."""
    from serving.client import received_file

    if how == "torn":
        monkeypatch.setenv("STANDIN_TORN", "1")
    spec = ServerSpec(model=str(tiny_target_dir), dtype="float32", max_model_len=256, hidden_size=64,
                      layer_ids=[2, 4, 8])
    with _client(tmp_path, tiny_target_dir, tmp_path / "standin.log") as client:
        client.spec = spec
        client.wait_ready()
        if how == "torn":
            with pytest.raises(VLLMServerError, match=r"vLLM server http://127.0.0.1:\d+ \(log: .*\) sent a torn "
                                                      r"answer"):
                list(client.capture([("a", [1, 2, 3])]))
            return
    elsewhere = tmp_path / "server-dir" / "x.safetensors"
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(b"x")
    with pytest.raises(VLLMServerError, match=r"vLLM server u wrote hidden states to .*server-dir/x.safetensors, not to "
                                              r".*asked.safetensors as asked for sample 'a'"):
        received_file({"kv_transfer_params": {"hidden_states_path": str(elsewhere)}}, str(tmp_path / "asked.safetensors"),
                      "vLLM server u", "a")
    assert elsewhere.exists()  # not ours to delete


@pytest.mark.integration
def test_a_server_that_refuses_its_settings_fails_at_once_with_vllms_reason(tmp_path: Path, tiny_target_dir: Path,
                                                                           monkeypatch) -> None:
    reason = "Total number of attention heads (9) must be divisible by tensor parallel size (3)."
    monkeypatch.setenv("STANDIN_FAIL_AT_START", reason)
    client = _client(tmp_path, tiny_target_dir, tmp_path / "standin.log", timeout_s=600)
    with client, pytest.raises(VLLMServerError, match=r"exited while starting: ValueError: Total number of "
                                                      r"attention heads \(9\)"):
        start = time.perf_counter()
        client.wait_ready()
    assert time.perf_counter() - start < 60  # noticed when it exits, not at the startup deadline
    # the same check, called beside other work (prep's vocabulary count), raises as soon as the server is gone
    with pytest.raises(VLLMServerError, match="Total number of attention heads"):
        client.start()
        for _ in range(200):
            client.check_starting()
            time.sleep(0.1)
    client.close()


@pytest.mark.integration
def test_the_startup_deadline_holds_beside_other_work(tmp_path: Path, tiny_target_dir: Path, monkeypatch) -> None:
    """check_starting (what prep's vocabulary count calls) raises once the server is past vllm.timeout_s unhealthy."""
    monkeypatch.setenv("STANDIN_FAIL_AT_START", "")
    client = _client(tmp_path, tiny_target_dir, tmp_path / "standin.log", timeout_s=1)
    with client:
        with pytest.raises(VLLMServerError, match=r"was not healthy within 1 s of its start \(vllm.timeout_s\)"):
            for _ in range(100):
                client.check_starting()
                time.sleep(0.1)


def _members(pgid: int) -> set[int]:
    from serving.server import group_members

    return group_members(pgid)


@pytest.mark.integration
@pytest.mark.parametrize("killed", ["guard", "guard and caller", "api server"])
def test_killing_the_guard_or_the_server_leaves_nothing_running(tmp_path: Path, tiny_target_dir: Path,
                                                                 monkeypatch, killed: str) -> None:
    """kill -9 of the guard alone: the caller's next request names the server and says its guard was killed, and
    nothing of the group is left once it closes. kill -9 of the guard and of its caller together: the sentinel stops
    the group. kill -9 of the API server: the reason is the signal, not a line of its log (vLLM 0.32 logs a warning
    quoting "OSError: [Errno 24] Too many open files" at every start). The server's scratch, its socket files
    included, is gone each time."""
    log = tmp_path / "standin.log"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    spec = ServerSpec(model=str(tiny_target_dir), dtype="float32", max_model_len=256, hidden_size=64)
    if killed == "guard and caller":
        scratch = tmp_path / "scratch" / "launch"
        scratch.mkdir(parents=True)
        caller = subprocess.Popen([sys.executable, "-c", (
            "import sys, time\nfrom pathlib import Path\nfrom serving.client import ServerSpec, serve_args\n"
            "from serving.server import VLLMServer\n"
            f"s = VLLMServer({standin_python(tmp_path)!r}, ['--model', {str(tiny_target_dir)!r}], "
            f"log_path=Path({str(tmp_path / 'vllm.log')!r}), scratch=Path({str(scratch)!r}), grace_s=2).start()\n"
            "s.wait_healthy(120)\nprint(s.guard.pid, s.env['VLLM_RPC_BASE_PATH'], flush=True)\ntime.sleep(600)\n")],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
        guard, sockets = caller.stdout.readline().split()
        guard = int(guard)
        server = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("server "))[7:])
        assert Path(sockets).is_dir() and server["pid"] in _members(guard)
        os.kill(guard, signal.SIGKILL)
        caller.kill()
        caller.wait()
        deadline = time.time() + 30
        while _members(guard) and time.time() < deadline:
            time.sleep(0.2)
        assert not _members(guard) and not scratch.exists() and not Path(sockets).exists()
        return
    client = VLLMClient(spec, VLLMConfig(scratch_dir=str(tmp_path / "scratch")), python=standin_python(tmp_path),
                        cuda=False, rank=0, local_rank=0, log_path=tmp_path / "vllm.log")
    with client:
        client.wait_ready()
        guard = client.server.guard.pid
        server = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("server "))[7:])
        os.kill(guard if killed == "guard" else server["pid"], signal.SIGKILL)
        expected = (r"its guard \(pid \d+\) was killed by SIGKILL, and the server with it" if killed == "guard" else
                    r"the server was killed by SIGKILL \(a signal from outside vLLM\)")
        with pytest.raises(VLLMServerError, match=r"vLLM server http://127.0.0.1:\d+ \(log: .*vllm.log\) exited: "
                                                  + expected):
            client.generate([[1, 2, 3]], max_tokens=2)
        launch = client.scratch
    assert _wait_gone([server["pid"], server["child"]]) == [] and not _members(guard)
    assert not launch.exists() and not list((tmp_path / "scratch").iterdir())


@pytest.mark.integration
def test_the_users_servers_scratch_goes_when_prep_is_killed(tmp_path: Path) -> None:
    """vllm.urls: no server of prep's, but a guard that removes the launch's scratch once its caller is gone, kill -9
    included."""
    caller = subprocess.Popen([sys.executable, "-c", (
        "import time\nfrom pathlib import Path\nfrom data_prep.config import VLLMConfig\n"
        "from serving.client import ServerSpec, VLLMClient\n"
        "spec = ServerSpec(model='m', dtype='float32', max_model_len=9, hidden_size=8, layer_ids=[1])\n"
        f"c = VLLMClient(spec, VLLMConfig(urls=['http://127.0.0.1:9'], scratch_dir={str(tmp_path / 's')!r}), "
        "python=None, cuda=False, rank=0, local_rank=0, log_path=Path('x')).start()\n"
        "(c.scratch / 'cap-1.safetensors').write_bytes(b'x')\nprint(c.scratch, flush=True)\ntime.sleep(600)\n")],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    launch = Path(caller.stdout.readline().strip())
    assert (launch / "cap-1.safetensors").exists()
    caller.kill()
    caller.wait()
    deadline = time.time() + 30
    while launch.exists() and time.time() < deadline:
        time.sleep(0.2)
    assert not launch.exists()


@pytest.mark.integration
@pytest.mark.parametrize(("overrides", "nproc"), [
    ([], "8"),  # the transformers route: one rank per GPU
    (["regen.backend=vllm", "capture.engine=vllm"], "8"),  # TP 1: one server per GPU
    (["capture.engine=vllm", "vllm.tensor_parallel_size=2"], "4"),
    (["regen.backend=vllm", "capture.engine=vllm", "vllm.tensor_parallel_size=8"], "1"),
    (["capture.engine=vllm", "vllm.urls=[http://n1:8000]"], "1"),
])
def test_the_slurm_prep_script_starts_one_rank_per_server_group(tmp_path: Path, overrides: list[str],
                                                                nproc: str) -> None:
    """launch/slurm/prep.sbatch under stand-ins for srun and scontrol, submitted from elsewhere: the repository's
    own torchrun, and ranks per node from the engine chosen."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "srun.args"}\n')
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho node0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PREP_DIR": str(tmp_path / "prep"),
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[0-1]", "SLURM_GPUS_ON_NODE": "8", "SLURM_SUBMIT_DIR": str(ROOT)}
    done = subprocess.run(["bash", str(ROOT / "launch" / "slurm" / "prep.sbatch"), *overrides], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    args = (tmp_path / "srun.args").read_text().split()
    assert args[1] == str(ROOT / ".venv" / "bin" / "torchrun"), (args, done.stderr)
    assert args[args.index("--nproc_per_node") + 1] == nproc and args[args.index("--nnodes") + 1] == "2"


def _plan_cfg(**kw):
    from data_prep.pipeline import plan_prep

    cfg = PrepConfig(out="x")
    cfg.regen.backend, cfg.capture.engine = kw.pop("regen", "vllm"), kw.pop("capture", "vllm")
    cfg.vllm.tensor_parallel_size = kw.pop("tp", 1)
    for k, v in kw.items():
        setattr(cfg.vllm, k, v)
    return cfg, plan_prep(cfg)


@pytest.mark.parametrize(("ranks", "tp"), [(8, 1), (4, 2), (1, 8)])
def test_each_ranks_head_target_and_server_devices(ranks: int, tp: int) -> None:
    """8 GPUs a node, 8 x TP1, 4 x TP2, 1 x TP8: each rank's head on its own server's first device; a transformers
    target loaded after the servers stopped takes that device; one loaded beside them finds every GPU held and is
    refused before anything loads; prep's own torch without CUDA puts the head in host memory while the servers
    still take the node's devices (vLLM's own count)."""
    from data_prep.pipeline import rank_devices
    from infra.config_keys import ConfigError

    blocks = [",".join(str(d) for d in range(r * tp, (r + 1) * tp)) for r in range(ranks)]
    cfg, plan = _plan_cfg(tp=tp)
    for r in range(ranks):
        got = rank_devices(cfg, plan, local_rank=r, local_world=ranks, prep_devices=8, node_devices=8)
        assert (got.head, got.hf_target, got.server) == (f"cuda:{r * tp}", None, blocks[r])
        cpu_prep = rank_devices(cfg, plan, local_rank=r, local_world=ranks, prep_devices=0, node_devices=8)
        assert (cpu_prep.head, cpu_prep.server) == ("cpu", blocks[r])
        assert got.describe() == f"vLLM server on devices {blocks[r]}; head cuda:{r * tp}; transformers target not loaded"
    cfg, plan = _plan_cfg(tp=tp, capture="hf")  # vLLM regenerates, then the transformers target captures
    assert plan.hf_target == "after_regen"
    for r in range(ranks):
        got = rank_devices(cfg, plan, local_rank=r, local_world=ranks, prep_devices=8, node_devices=8)
        assert (got.head, got.hf_target, got.server) == (f"cuda:{r * tp}", f"cuda:{r * tp}", blocks[r])
    for kw in ({"regen": "hf"}, {"capture_fidelity": "hf"}):
        cfg, plan = _plan_cfg(tp=tp, **kw)
        with pytest.raises(ConfigError, match=r"the transformers target \((regen.backend|vllm.capture_fidelity)=hf\) "
                                              r"would share a GPU with a vLLM server"):
            rank_devices(cfg, plan, local_rank=0, local_world=ranks, prep_devices=8, node_devices=8)


def test_a_transformers_target_beside_the_servers_takes_a_device_none_holds() -> None:
    from data_prep.pipeline import rank_devices

    cfg, plan = _plan_cfg(regen="hf")
    got = [rank_devices(cfg, plan, local_rank=r, local_world=4, prep_devices=8, node_devices=8) for r in range(4)]
    assert [(d.server, d.hf_target, d.head) for d in got] == [(str(r), f"cuda:{4 + r}", f"cuda:{4 + r}")
                                                              for r in range(4)]


def test_a_head_that_does_not_fit_beside_the_server_stays_in_host_memory() -> None:
    from data_prep.pipeline import rank_devices

    cfg, plan = _plan_cfg()
    big = rank_devices(cfg, plan, local_rank=0, local_world=1, prep_devices=1, node_devices=1,
                       head_bytes=4 << 30, device_bytes=40 << 30)  # 4 GiB + context > 10% of 40 GiB
    assert big.head == "cpu" and "gpu_memory_utilization=0.9" in big.note
    cfg.vllm.engine_kwargs = {"gpu_memory_utilization": 0.8}
    fits = rank_devices(cfg, plan, local_rank=0, local_world=1, prep_devices=1, node_devices=1,
                        head_bytes=4 << 30, device_bytes=40 << 30)
    assert fits.head == "cuda:0"


def test_the_users_servers_leave_prep_in_host_memory_or_where_device_says() -> None:
    from data_prep.pipeline import rank_devices
    from infra.config_keys import ConfigError

    cfg, plan = _plan_cfg(urls=["http://127.0.0.1:8000"])
    got = rank_devices(cfg, plan, local_rank=0, local_world=1, prep_devices=8)
    assert (got.head, got.hf_target, got.server) == ("cpu", None, None)
    cfg, plan = _plan_cfg(urls=["http://127.0.0.1:8000"], capture_fidelity="hf")
    with pytest.raises(ConfigError, match="prep cannot know which GPUs the user's servers hold"):
        rank_devices(cfg, plan, local_rank=0, local_world=1, prep_devices=8)
    cfg.device = "cuda:7"
    assert rank_devices(cfg, plan, local_rank=0, local_world=1, prep_devices=8).hf_target == "cuda:7"


def test_the_slurm_prep_script_passes_a_batch_signal_on_to_the_step(tmp_path: Path) -> None:
    """--signal=B:USR1@N signals the batch script alone: it passes SIGUSR1 on to srun (which signals the step's
    tasks) and waits for srun's own status."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    got = tmp_path / "srun.got"
    (bin_dir / "srun").write_text(f"#!/bin/bash\ntrap 'echo USR1 >> {got}; exit 75' USR1\n"
                                  f"echo started > {got}\nwhile :; do sleep 0.1; done\n")
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.args'}\necho node0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PREP_DIR": str(tmp_path / "prep"),
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node0", "SLURM_SUBMIT_DIR": str(ROOT)}
    script = subprocess.Popen(["bash", str(ROOT / "launch" / "slurm" / "prep.sbatch"), "capture.engine=vllm"],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (got.exists() and "started" in got.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    script.send_signal(signal.SIGUSR1)
    out, err = script.communicate(timeout=30)
    assert got.read_text().split() == ["started", "USR1"] and script.returncode == 75, err
    assert "requeue 7" in (tmp_path / "scontrol.args").read_text()  # unfinished: requeued
