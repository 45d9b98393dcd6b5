"""Prep's vLLM servers (infra/vllm_server.py, data_prep/vllm_client.py): what each rank's server gets (devices,
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
from data_prep.vllm_client import ServerSpec, VLLMClient, rank_urls, serve_args
from infra.vllm_server import (
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


def test_the_users_servers_are_split_over_the_ranks() -> None:
    urls = [f"http://n{i}:8000" for i in range(4)]
    assert [rank_urls(urls, r, 2) for r in range(2)] == [urls[0::2], urls[1::2]]
    assert [rank_urls(urls, r, 4) for r in range(4)] == [[u] for u in urls]
    assert [rank_urls(urls[:1], r, 3) for r in range(3)] == [urls[:1]] * 3  # fewer servers than ranks: shared


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
                                                                      "data_prep.vllm_plugin")
    regen_only = serve_args(ServerSpec(model="/m", dtype="float32", max_model_len=9, hidden_size=8), "/s", cuda=False)
    assert "--speculative-config" not in regen_only and "--kv-transfer-config" not in regen_only


def test_scratch_must_hold_one_sample(tmp_path: Path) -> None:
    from infra.config_keys import ConfigError

    spec = ServerSpec(model="/m", dtype="bfloat16", max_model_len=40_001, hidden_size=2880, layer_ids=[2, 18, 33, 36])
    with pytest.raises(ConfigError, match=r"vllm.scratch_gb=0.5 holds less than one sample of max_len \(40000 tokens"):
        VLLMClient(spec, VLLMConfig(scratch_gb=0.5), python="/x", cuda=False, rank=0, world=1, local_rank=0,
                   num_devices=0, log_path=tmp_path / "vllm.log")


def test_a_relative_vllm_python_is_taken_from_the_working_directory(tmp_path: Path, monkeypatch) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert resolve_python("venv/bin/python") == str(python)  # absolute: the server runs from the repository root
    with pytest.raises(VLLMUnavailable, match=r"vllm.python='nope/python' is not an executable file \(/"):
        resolve_python("nope/python")


def test_config_refusals_for_the_servers() -> None:
    for key, value, message in [("urls", ["n1:8000"], "vllm.urls must be http"),
                                ("timeout_s", 0, "vllm.timeout_s must be > 0"),
                                ("max_in_flight", 0, "vllm.max_in_flight must be >= 1"),
                                ("scratch_gb", -1, "vllm.scratch_gb must be > 0"),
                                ("capture_fidelity", "x", "vllm.capture_fidelity must be engine|hf")]:
        cfg = PrepConfig(out="x")
        cfg.capture.engine = "vllm"
        setattr(cfg.vllm, key, value)
        with pytest.raises(ValueError, match=message):
            cfg.validate()
    cfg = PrepConfig(out="x")
    cfg.capture.engine, cfg.vllm.urls, cfg.vllm.tensor_parallel_size = "vllm", ["http://n1:8000"], 8
    with pytest.raises(ValueError, match="vllm.urls names servers already running"):
        cfg.validate()


def test_vllms_own_reason_is_quoted_from_its_log(tmp_path: Path) -> None:
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
        "from infra.vllm_server import VLLMServer\n"
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


def _client(tmp_path: Path, model: Path, env_log: Path, **cfg) -> VLLMClient:
    spec = ServerSpec(model=str(model), dtype="float32", max_model_len=256, hidden_size=64,
                      tensor_parallel_size=cfg.pop("tp", 1))
    return VLLMClient(spec, VLLMConfig(scratch_dir=str(tmp_path / "scratch"), **cfg), python=standin_python(tmp_path),
                      cuda=False, rank=int(os.environ.get("RANK", 0)), world=int(os.environ.get("WORLD_SIZE", 1)),
                      local_rank=int(os.environ.get("LOCAL_RANK", 0)), num_devices=0, log_path=tmp_path / "vllm.log")


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
    with _client(tmp_path, tiny_target_dir, log, tp=2) as client:
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
    monkeypatch.setenv("STANDIN_HANG", "1")
    with _client(tmp_path, tiny_target_dir, tmp_path / "standin.log") as client:
        client.wait_ready()
        client.timeout_s = 3  # vllm.timeout_s bounds each request (here shorter than the stand-in's start-up)
        start = time.perf_counter()
        with pytest.raises(VLLMServerError, match=r"vLLM server http://127.0.0.1:\d+ \(log: .*vllm.log\) did not "
                                                  r"answer within 3 s \(vllm.timeout_s\)"):
            client.generate([[1, 2, 3]] * 4, max_tokens=3)
        assert time.perf_counter() - start < 30  # the deadline, not the stand-in's hour


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
            client.check_alive()
            time.sleep(0.1)
    client.close()


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
