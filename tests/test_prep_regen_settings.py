"""Prep settings that change what is trained on without an error: replies cut at regen.max_new_tokens
(regen.on_length), later turns cut by regen.max_turns, a regeneration server that is not there, the server's key,
the default held-out share of a small dataset, and stage=vocab rewriting a finished prep. Each is refused or
counted in summary.json and on the console; the tiny random target, no real model."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_prep
from safetensors.torch import load_file

from data_prep import pipeline
from data_prep.config import PrepConfig, held_out_count
from data_prep.rendered import RenderedSet
from data_prep.shards import PREP_SUMMARY
from data_prep.vocab import VOCAB_FILE

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
FAST = {"stage": "render", "eval_samples": 2, "draft_vocab_size": 32, "draft_vocab_count": "train",
        "regen.max_new_tokens": 4}


def regen_lines(out: Path) -> dict[str, dict]:
    return {r["id"]: r for split in ("train", "eval")
            for r in map(json.loads, (out / "regen" / f"{split}.r0.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory, tiny_target_dir: Path, tiny_sharegpt_file: Path) -> Path:
    """The tiny target's replies (4 new tokens of a random model: every one reaches the cap), then the first half of
    each split marked as finished in time, as a prep resumed from them reads them: cut and uncut replies side by
    side."""
    out = tmp_path_factory.mktemp("regen")
    run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), **FAST)
    for split in ("train", "eval"):
        path = out / "regen" / f"{split}.r0.jsonl"
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        assert all(any(m.get("cut") for m in r["messages"]) for r in lines)
        for r in lines[: len(lines) // 2]:
            for m in r["messages"]:
                m.pop("cut", None)
        path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return out / "regen"


def prep_from(regen: Path, out: Path, tiny_target_dir: Path, data: Path, **overrides) -> dict:
    shutil.copytree(regen, out / "regen")
    return run_prep(out, str(tiny_target_dir), str(data), **FAST, **overrides)


@pytest.fixture(scope="module")
def unmasked(tmp_path_factory, regenerated: Path, tiny_target_dir: Path, tiny_sharegpt_file: Path):
    out, console = tmp_path_factory.mktemp("unmask"), io.StringIO()
    with contextlib.redirect_stdout(console):
        summary = prep_from(regenerated, out, tiny_target_dir, tiny_sharegpt_file)
    return out, summary, console.getvalue()


def test_cut_replies_keep_their_end_of_turn_out_of_the_mask(unmasked, tiny_target_dir: Path) -> None:
    from transformers import AutoTokenizer

    out, summary, console = unmasked
    eot = AutoTokenizer.from_pretrained(tiny_target_dir).convert_tokens_to_ids("<|im_end|>")
    lines = regen_lines(out)
    cut = {i for i, r in lines.items() if any(m.get("cut") for m in r["messages"])}
    assert len(cut) == 6, lines  # the regenerated fixture's second halves
    checked = 0
    for split in ("train", "eval"):
        for s in RenderedSet(out, split):
            taught = s.input_ids[s.loss_mask].tolist()
            assert (eot in taught) == (s.conversation_id not in cut), (s.conversation_id, taught)
            checked += 1
    assert checked == summary["samples"]["train"] + summary["samples"]["eval"] == 12
    assert summary["regen_cut_replies"] == {"on_length": "unmask", "max_new_tokens": 4,
                                            "kept_end_of_turn_unmasked": len(cut), "conversations_dropped": 0}
    assert "replies cut at max_new_tokens=4, regen.on_length=unmask: 6 kept with the end of turn unmasked, " \
           "0 conversations dropped" in console, console


def test_later_turns_cut_by_max_turns_are_counted(unmasked) -> None:
    out, summary, console = unmasked
    assert "12 later assistant turns of 12 conversations not trained on (regen.max_turns=1)" in console, console
    # every tiny conversation has two assistant turns; max_turns=1 (the default) keeps the first
    assert summary["regen_later_turns_dropped"] == {"max_turns": 1, "turns": 12, "conversations": 12}
    assert all(sum(m["role"] == "assistant" for m in r["messages"]) == 1 for r in regen_lines(out).values())


def test_on_length_drop_skips_the_conversations_and_says_so(tmp_path: Path, regenerated: Path, tiny_target_dir: Path,
                                                            tiny_sharegpt_file: Path, capsys) -> None:
    out = tmp_path / "drop"
    summary = prep_from(regenerated, out, tiny_target_dir, tiny_sharegpt_file, **{"regen.on_length": "drop"})
    console = capsys.readouterr().out
    cut = {i for i, r in regen_lines(out).items() if any(m.get("cut") for m in r["messages"])}
    reason = "regen: reply cut at regen.max_new_tokens (regen.on_length=drop)"
    assert summary["skipped"][reason] == len(cut) == 6
    assert summary["samples"]["train"] + summary["samples"]["eval"] == 12 - len(cut)
    assert summary["regen_cut_replies"]["conversations_dropped"] == len(cut)
    assert f"skipped {len(cut):>7}  {reason}" in console, console
    assert "regen.on_length=drop: 0 kept with the end of turn unmasked, 6 conversations dropped" in console
    assert "12 later assistant turns of 12 conversations not trained on (regen.max_turns=1)" in console, console


def test_an_unreachable_regeneration_server_stops_the_prep(tmp_path: Path, tiny_target_dir: Path,
                                                          tiny_sharegpt_file: Path, monkeypatch) -> None:
    from data_prep.regenerate import RegenerationError

    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"  # bound, not listening: refused
    with pytest.raises(RegenerationError) as e:
        run_prep(tmp_path / "p", str(tiny_target_dir), str(tiny_sharegpt_file), **FAST,
                 **{"regen.backend": "openai", "regen.base_url": url, "regen.max_retries": 0})
    assert f"at {url}" in str(e.value) and "Connection error" in str(e.value), str(e.value)
    assert not (tmp_path / "p" / PREP_SUMMARY).exists()


@pytest.mark.integration
def test_an_api_key_in_the_config_is_refused_without_echoing_it(tmp_path: Path) -> None:
    secret = "sk-do-not-print-4242"
    out = tmp_path / "prep"
    r = subprocess.run([sys.executable, str(REPO / "launch" / "prep.py"), f"regen.api_key={secret}", f"out={out}"],
                       capture_output=True, text=True, env=ENV, timeout=300, cwd=REPO)
    assert r.returncode != 0 and "regen.api_key is not read" in r.stderr and "OPENAI_API_KEY" in r.stderr, r.stderr
    assert secret not in r.stdout + r.stderr
    written = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert not [p for p in written if secret in p.read_text(errors="replace")], written


@pytest.mark.parametrize(("asked", "usable", "held"), [
    (None, 24, 2), (None, 3, 1), (None, 1, 0), (None, 200, 20), (None, 400, 40), (None, 5000, 40), (7, 24, 7),
])
def test_held_out_default_scales_with_the_dataset(asked, usable: int, held: int) -> None:
    assert held_out_count(asked, usable) == held


def test_a_small_dataset_keeps_most_conversations_for_training(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": f"g{i}", "conversations": [
        {"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}) + "\n" for i in range(24)))
    splits, _ = pipeline.select_conversations(PrepConfig(data=str(data), out=str(tmp_path / "p")))
    assert (len(splits["train"]), len(splits["eval"])) == (22, 2)
    assert not {c.id for c in splits["train"]} & {c.id for c in splits["eval"]}


def test_stage_vocab_replaces_its_files_whole(unmasked, tmp_path: Path, tiny_target_dir: Path,
                                              tiny_sharegpt_file: Path, monkeypatch) -> None:
    """A rebuild that dies while writing leaves the finished prep as it was (not a torn vocabulary under a summary
    that calls the prep finished); one that completes replaces both files."""
    out = tmp_path / "prep"  # a copy: the fixture's prep holds its directory's lock while this process runs
    shutil.copytree(unmasked[0], out, ignore=shutil.ignore_patterns(".lock"))
    vocab, summary = out / VOCAB_FILE, out / PREP_SUMMARY
    before_vocab, before_summary = vocab.read_bytes(), summary.read_bytes()
    cfg = PrepConfig(model=str(tiny_target_dir), data=str(tiny_sharegpt_file), out=str(out), stage="vocab",
                     eval_samples=2, draft_vocab_size=8, draft_vocab_count="train")

    def disk_full(path, *args) -> None:
        Path(path).write_bytes(before_vocab[: len(before_vocab) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pipeline, "save_draft_vocab", disk_full)
    with pytest.raises(OSError, match="No space left"):
        pipeline.run(cfg)
    assert vocab.read_bytes() == before_vocab and summary.read_bytes() == before_summary
    monkeypatch.undo()
    rebuilt = pipeline.run(cfg)
    assert rebuilt["draft_vocab_size"] == 8 == load_file(vocab)["d2t"].numel()
    assert json.loads(summary.read_text())["draft_vocab_size"] == 8
    assert not list(out.glob("*.tmp"))


STAND_IN = r'''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

port = int(sys.argv[sys.argv.index("--port") + 1])
key = os.environ.get("VLLM_API_KEY")
with open(os.environ["STAND_IN_RECORD"], "w") as f:
    json.dump({"argv": sys.argv, "key": key}, f)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):  # vLLM serves /health and /metrics without the key
        self.send(200 if self.path == "/health" else 404, {})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.headers.get("Authorization") != f"Bearer {key}":
            return self.send(401, {"error": "Unauthorized"})
        msg = {"role": "assistant", "content": "served " + body["messages"][-1]["content"]}
        self.send(200, {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                        "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}]})

    def send(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


HTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


@pytest.mark.integration
def test_the_servers_we_start_take_a_key_of_their_own(tmp_path: Path, monkeypatch) -> None:
    """serving.server.vllm_server (behind make regen-check, engine-check, the vLLM benches) starts its server with
    a random key in the server's environment, never on its command line, and our clients use it for the block.
    The server here is a stand-in speaking vLLM's protocol (vLLM has its own venv, not the suite's)."""
    from data_prep.conversations import Conversation, Message
    from data_prep.regenerate import OpenAIBackend, RegenerationError, read_results, regenerate
    from serving.server import http_post_json, vllm_server

    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "OPENAI_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    record = tmp_path / "record.json"
    monkeypatch.setenv("STAND_IN_RECORD", str(record))
    (tmp_path / "server.py").write_text(STAND_IN)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "server.py"} "$@"\n')
    python.chmod(0o755)
    convs = [Conversation("a", [Message("user", "hi"), Message("assistant", "x")], "t")]
    with vllm_server(str(python), "target", log_path=tmp_path / "log", timeout_s=60) as base:
        s = regenerate(convs, OpenAIBackend(base + "/v1", "target"), tmp_path / "r.jsonl", max_new_tokens=4,
                       progress=False)
        reply = http_post_json(base + "/v1/chat/completions", {"model": "target", "messages": [
            {"role": "user", "content": "there"}]})
        with pytest.raises(RegenerationError, match="401"):
            regenerate(convs, OpenAIBackend(base + "/v1", "target", api_key="guessed"), tmp_path / "w.jsonl",
                       max_new_tokens=4, progress=False)
    seen = json.loads(record.read_text())
    assert seen["key"] and len(seen["key"]) >= 24 and not any(seen["key"] in a for a in seen["argv"])
    assert s.ok == 1 and read_results(tmp_path / "r.jsonl")["a"]["messages"][1]["content"] == "served hi"
    assert reply["choices"][0]["message"]["content"] == "served there"
    assert "OPENAI_API_KEY" not in os.environ  # the block's key does not outlive it


def test_a_sampled_reply_has_its_own_seed_the_same_after_a_resume() -> None:
    """request_seed: one seed per (run seed, conversation, turn), a pure function of them (a resumed prep sends the
    same), distinct across conversations and turns (two conversations never share their random numbers)."""
    from data_prep.regenerate import request_seed

    seeds = {(c, t): request_seed(0, c, t) for c in ("a", "b", "c") for t in range(3)}
    assert len(set(seeds.values())) == len(seeds)
    assert all(request_seed(0, c, t) == s for (c, t), s in seeds.items())
    assert request_seed(1, "a", 0) != seeds["a", 0] and all(0 <= s < 2**31 for s in seeds.values())
