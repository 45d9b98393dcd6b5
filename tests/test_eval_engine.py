"""The engine evaluation (`engine=vllm`) without vLLM: the servers' flags (sampling stated in full, the model's
generation_config.json ignored, eager only where asked or without CUDA, the device memory share), the warm-up
before anything is timed, time per output token under load, and a whole evaluation whose target is released before
the first server starts. The HTTP side is a fake in this process (`FakeServers`); the real server is
tests/test_eval_engine_vllm.py's opt-in test."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from eval import engine
from eval.config import WARMUP_TOKENS, EngineVLLMConfig, EvalConfig
from serving.server import VLLMServerError

GIB = 1 << 30


def _session(tmp_path: Path, cuda: bool = False, warmup: bool = True, **vcfg) -> engine.EngineSession:
    return engine.EngineSession(EngineVLLMConfig(**vcfg), "/opt/vllm/bin/python", {"version": "0.32.0", "cuda": cuda},
                                "target-dir", "float32", str(tmp_path / "export"), "eagle3", tmp_path, warmup=warmup)


def test_both_sides_sample_with_every_parameter_stated() -> None:
    greedy = engine.sampling(0.0, 1.0, 0, seed=7)
    assert greedy == {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                      "presence_penalty": 0.0, "frequency_penalty": 0.0}  # no seed: nothing is sampled
    assert engine.sampling(0.7, 0.9, 20, seed=7) == {**greedy, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
                                                      "seed": 7}


def test_a_server_command_ignores_generation_config_and_is_eager_only_without_cuda(tmp_path, monkeypatch) -> None:
    """The full command line vllm_server builds for each server (VLLMServer replaced by a recorder)."""
    import serving.server as vs

    commands: list[list[str]] = []

    class Recorder:
        url, key = "http://127.0.0.1:1", "k"

        def __init__(self, python, args, **kw):
            commands.append([python, *args])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def wait_healthy(self, timeout_s):
            return 0.0

    monkeypatch.setattr(vs, "VLLMServer", Recorder)
    for cuda, configured in ((False, None), (True, None), (True, True), (False, False)):
        with _session(tmp_path, cuda=cuda, enforce_eager=configured).serve(3):
            pass
    cpu, gpu, gpu_eager, cpu_graphs = commands
    for cmd in commands:
        at = cmd.index("--generation-config")
        assert cmd[at + 1] == "vllm" and "--no-enable-prefix-caching" in cmd
        spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
        assert spec == {"method": "eagle3", "model": str((tmp_path / "export").resolve()), "num_speculative_tokens": 3}
    assert "--enforce-eager" in cpu and "--enforce-eager" not in gpu  # CUDA graphs on a GPU, unless asked
    assert "--enforce-eager" in gpu_eager and "--enforce-eager" not in cpu_graphs
    assert _session(tmp_path).eager_reason.startswith("no CUDA device")
    assert "--speculative-config" not in _session(tmp_path).server_args(0)


def test_engine_kwargs_cannot_undo_the_comparison() -> None:
    from eval.config import DecodeConfig

    for key in ("enforce_eager", "generation-config"):
        cfg = EvalConfig(drafter="d", out_dir="o", engine="vllm", decode=DecodeConfig(mode="chain"),
                         vllm=EngineVLLMConfig(engine_kwargs={key: "auto"}))
        with pytest.raises(ValueError, match="vllm.engine_kwargs cannot set"):
            cfg.validate()


def test_the_memory_share_follows_the_free_memory() -> None:
    # 70 of 80 GiB free: (70 - 1) / 80 = 0.8625, rounded down
    got = engine.memory_share(70 * GIB, 80 * GIB)
    assert got["share"] == 0.86 and (got["free_gib"], got["total_gib"]) == (70.0, 80.0) and "free memory" in got["reason"]
    assert engine.memory_share(79 * GIB, 80 * GIB)["share"] == 0.9  # never above vLLM's default
    assert engine.memory_share(3 * GIB, 80 * GIB, configured=0.5)["share"] == 0.5  # the user's, as given
    with pytest.raises(VLLMServerError, match=r"3\.0 GiB of the device's 80\.0 GiB are free"):
        engine.memory_share(3 * GIB, 80 * GIB)  # (3 - 1) / 80 = 0.025: no target fits


def test_the_session_places_its_servers_on_the_free_memory(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(engine, "device_memory", lambda: (40 * GIB, 80 * GIB))
    gpu = _session(tmp_path, cuda=True)
    assert gpu.place()["share"] == 0.48  # (40 - 1) / 80 = 0.4875
    args = gpu.server_args(0)
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.48"
    mine = _session(tmp_path, cuda=True, engine_kwargs={"gpu_memory_utilization": 0.3})
    assert mine.place()["share"] == 0.3 and mine.server_args(0).count("--gpu-memory-utilization") == 1
    cpu = _session(tmp_path, cuda=False)  # vLLM's CPU build: no share, its KV cache is VLLM_CPU_KVCACHE_SPACE
    assert cpu.place() is None and "--gpu-memory-utilization" not in cpu.server_args(0)


class FakeServers:
    """vLLM's HTTP side for `engine.evaluate`: a server per `serve(k)` (`on_start(k)` called as it starts), whose
    first request takes `cold_s`; each request answers `tokens` tokens and, with a drafter, adds one draft with one
    accepted token to /metrics (τ 2). The last test runs a whole evaluation against it."""

    def __init__(self, monkeypatch, cold_s: float = 0.0, tokens: int = 4, on_start=None):
        self.log: list[tuple] = []
        self.cold_s, self.tokens, self.k, self.served, self.on_start = cold_s, tokens, None, 0, on_start
        self.counters = {"drafts": 0, "accepted": 0}
        monkeypatch.setattr(engine, "post_json", self.post_json)
        monkeypatch.setattr(engine, "http_get", self.http_get)
        monkeypatch.setattr(engine, "post_stream", self.post_stream)
        monkeypatch.setattr(engine.EngineSession, "serve", lambda session, k: self.serve(k))

    @contextmanager
    def serve(self, k: int):
        self.k, self.served = k, 0
        self.log.append(("start", k))
        if self.on_start is not None:
            self.on_start(k)
        yield f"http://fake/{k}"

    def _answer(self, body: dict) -> None:
        if self.served == 0:
            time.sleep(self.cold_s)  # the cold start
        self.served += 1
        if self.k:
            self.counters["drafts"] += 1
            self.counters["accepted"] += 1

    def post_json(self, url: str, body: dict, **kw) -> dict:
        self.log.append(("request", self.k, body))
        self._answer(body)
        return {"choices": [{"token_ids": list(range(self.tokens))}]}

    def http_get(self, url: str, **kw) -> str:
        self.log.append(("metrics", self.k))
        return (f"vllm:spec_decode_num_drafts_total {self.counters['drafts']}\n"
                f"vllm:spec_decode_num_accepted_tokens_total {self.counters['accepted']}\n")

    def post_stream(self, url: str, body: dict, **kw):
        self.log.append(("stream", self.k, body))
        self._answer(body)
        start = time.perf_counter()
        for i in range(self.tokens):  # the first token after 50 ms, then one every 20 ms
            yield start + 0.05 + 0.02 * i, {"choices": [{"text": "x"}]}
        yield start + 0.2, {"choices": [], "usage": {"completion_tokens": self.tokens}}


TURNS = {("s", "a"): [[1, 2], [3, 4]], ("s", "b"): [[5, 6]]}
BODY = {"max_tokens": 32, **engine.sampling(0.0, 1.0, 0, 0), "stop_token_ids": [9], "skip_special_tokens": False}


def test_every_server_answers_an_untimed_request_before_it_is_timed(tmp_path, monkeypatch) -> None:
    fake = FakeServers(monkeypatch, cold_s=0.2)
    session = _session(tmp_path, concurrency=[2], num_speculative_tokens=[1])
    res = engine.evaluate(session, TURNS, [[1, 2], [5, 6]], BODY, k=3, progress=False)
    starts = [i for i, e in enumerate(fake.log) if e[0] == "start"]
    assert [fake.log[i][1] for i in starts] == [0, 3, 1]  # no drafter, decode.depth, the sweep
    for i in starts:  # right after each start, before the first read of the counters: the warm-up
        kind, _, body = fake.log[i + 1]
        assert kind == "request" and body["prompt"] == [1, 2] and body["max_tokens"] == WARMUP_TOKENS
        assert fake.log[i + 2][0] == "metrics"
    for k in (0, 3, 1):
        for key, entry in res["categories"][k].items():
            # the cold 0.2 s is in no category: 4 tokens a request in microseconds, not 8 / 0.2 s = 40 tokens/s
            assert entry["tokens_per_s"] > 1000, (k, key, entry)
            if k:
                assert entry["tau"] == 2.0 and entry["drafts"] == len(TURNS[key])  # the warm-up's draft not counted
    cold = FakeServers(monkeypatch, cold_s=0.2)
    unwarmed = engine.evaluate(_session(tmp_path, warmup=False), TURNS, [[1, 2]], BODY, k=3, progress=False)
    assert not any(e[0] == "request" and e[2]["max_tokens"] == WARMUP_TOKENS for e in cold.log)
    assert unwarmed["categories"][0][("s", "a")]["tokens_per_s"] < 50  # the cold start timed: 8 tokens / ≥ 0.2 s


def test_the_load_sweep_reports_time_per_output_token_and_samples_as_the_categories(tmp_path, monkeypatch) -> None:
    fake = FakeServers(monkeypatch)
    res = engine.evaluate(_session(tmp_path, concurrency=[1, 2]), TURNS, [[1, 2], [5, 6]], BODY, k=3, progress=False)
    for k in (0, 3):
        levels = res["load"][k]
        assert [lv["concurrency"] for lv in levels] == [1, 2] and [lv["requests"] for lv in levels] == [8, 8]
        for lv in levels:
            assert "itl_ms" not in lv
            # 4 tokens, the first at 50 ms and one every 20 ms after it: (110 - 50) / 3 = 20 ms per output token
            assert lv["tpot_ms"]["mean"] == pytest.approx(20.0) and lv["tpot_ms"]["p90"] == pytest.approx(20.0)
            assert lv["ttft_ms"]["mean"] >= 50.0 and lv["output_tokens"] == 32
    streamed = [e[2] for e in fake.log if e[0] == "stream"]
    assert len(streamed) == 32 and all(b["ignore_eos"] and "stop_token_ids" not in b for b in streamed)
    assert all({k: b[k] for k in engine.sampling(0.0, 1.0, 0, 0)} == engine.sampling(0.0, 1.0, 0, 0)
               for b in streamed)


def test_load_table_names_tpot() -> None:
    from eval.categories import load_markdown

    side = {"output_tokens_per_s": 10.0, "tau": 1.5, "ttft_ms": {"mean": 50.0}, "tpot_ms": {"mean": 20.0}}
    table = load_markdown([{"concurrency": 4, "plain": side, "speculative": side, "speedup": 1.0,
                            "speedup_predicted": 1.1}])
    assert "TPOT ms plain / EAGLE" in table and "ITL" not in table and table.endswith("| 50 / 50 | 20.0 / 20.0 |")


@pytest.fixture(scope="module")
def random_export(tmp_path_factory, tiny_target_dir: Path) -> Path:
    """A random EAGLE-3 export of the tiny target (tests/tiny_models.py): what the evaluation below serves."""
    import torch
    from tiny_models import tiny_drafter
    from transformers import AutoModelForCausalLM

    from models.eagle3 import save_export

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    out = tmp_path_factory.mktemp("export")
    save_export(tiny_drafter(target, tap_layers=[0, 2, 4]), out, dtype=torch.float32)
    return out


def test_engine_run_checks_vllm_first_releases_our_models_and_states_how_it_ran(
        tmp_path, tiny_target_dir: Path, random_export: Path, monkeypatch) -> None:
    """run_eval with engine=vllm against the fake servers: vLLM checked before the target loads, the target
    released before the first server starts, every server warmed up, both sides' sampling and the execution mode in
    the report, no interval (and no gap verdict) for categories of 2 prompts."""
    import weakref

    import data_prep.targets as targets
    import eval.run as run
    from eval.config import DecodeConfig

    order: list[str] = []
    models: list[weakref.ref] = []
    load = targets.load_target

    def load_target(*a, **kw):
        order.append("target loaded")
        model, tokenizer = load(*a, **kw)
        models.append(weakref.ref(model))
        return model, tokenizer

    monkeypatch.setattr(targets, "load_target", load_target)
    monkeypatch.setattr(run, "engine_ready", lambda python: order.append(f"vLLM checked: {python}") or (
        "/opt/vllm/bin/python", {"version": "0.32.0", "cuda": False}))
    fake = FakeServers(monkeypatch, on_start=lambda k: order.append(
        f"server {k}, our target {'held' if models[0]() is not None else 'released'}"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"{c}{i}", "category": c, "prompt": f"{c} {i}?"}) + "\n"
                               for c in ("x", "y") for i in range(2)))
    out = tmp_path / "out"
    cfg = EvalConfig(drafter=str(random_export), target=str(tiny_target_dir), prompts=str(prompts),
                     out_dir=str(out), dtype="float32", plots=False, engine="vllm",
                     decode=DecodeConfig(mode="chain", depth=2, max_new_tokens=10),
                     vllm=EngineVLLMConfig(python="venv/bin/python", concurrency=[1]))
    report = run.run_eval(cfg, progress=False)
    assert order == ["vLLM checked: venv/bin/python", "target loaded", "server 0, our target released",
                     "server 2, our target released"]
    eng = report["engine"]
    assert eng["sampling"] == engine.sampling(0.0, 1.0, 0, 0) and eng["generation_config"] == "vllm"
    assert eng["mode"]["enforce_eager"] is True and eng["mode"]["reason"].startswith("no CUDA device")
    assert eng["warmup"] == {"requests_per_server": 1, "max_tokens": 8} and eng["device_memory"] is None
    requests = [e for e in fake.log if e[0] == "request"]
    assert len(requests) == 2 * (1 + 4)  # per server: the warm-up, then the 4 turns
    assert [e[2]["max_tokens"] for e in requests] == [8, 10, 10, 10, 10] * 2
    assert all(e[2]["stop_token_ids"] == report["stop_token_ids"] and e[2]["top_k"] == 0 for e in requests)
    for c in report["categories"]:
        assert c["prompts"] == 2 and c["tau_ci95"] is None
        assert c["engine"]["tau"] == 2.0 and c["engine"]["tau_outside_ci"] is None  # not judged without an interval
    assert eng["load"][0]["plain"]["tpot_ms"]["mean"] == pytest.approx(20.0)
    table = (out / "categories.md").read_text()
    assert "1 [n<5] |" not in table and table.count("[n<5] |") == 2 and "| n<5 |" in table
    assert "(servers: --generation-config vllm)" in table and "eager (no CUDA device" in table and "TPOT ms" in table
    saved = json.loads((out / "report.json").read_text())
    assert saved["categories"][0]["tau_ci95"] is None and saved["engine"]["sampling"]["repetition_penalty"] == 1.0
