"""data_prep.regenerate: hf backend on a tiny random Llama, openai backend on a local HTTP server,
status accounting, resume, torn-line recovery."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from text_fixtures import template, tiny_tokenizer

from data_prep.conversations import Conversation, Message
from data_prep.regenerate import (
    HFBackend,
    OpenAIBackend,
    load_regenerated,
    read_results,
    regenerate,
    split_reasoning,
)

torch.set_num_threads(1)

# ChatML that refuses one marked conversation: a per-conversation template error
BOOM_TEMPLATE = "{% for m in messages %}{% if 'BOOM' in m['content'] %}{{ raise_exception('boom') }}{% endif %}{% endfor %}"


def conv(i: int, turns: int = 2, user: str = "Hello there!") -> Conversation:
    msgs = [Message("system", "You are a helpful assistant.")]
    for k in range(turns):
        msgs += [Message("user", f"{user} {i}.{k}"), Message("assistant", f"ORIGINAL {i}.{k}")]
    return Conversation(f"c{i}", msgs, "test")


@pytest.fixture(scope="module")
def tiny_model():
    tok = tiny_tokenizer(None)
    tok.chat_template = BOOM_TEMPLATE + template("chatml_smollm2")
    torch.manual_seed(0)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=160,
        initializer_range=0.5,
    )
    return LlamaForCausalLM(cfg).eval(), tok


class CountingModel(torch.nn.Module):
    """Wraps the model to record every generate call (batch prompts as text)."""

    def __init__(self, model, tok):
        super().__init__()
        self.model, self.tok, self.calls = model, tok, []
        self.config, self.generation_config = model.config, model.generation_config

    def generate(self, input_ids, attention_mask, **kw):
        self.calls.append([self.tok.decode(row[m.bool()]) for row, m in zip(input_ids, attention_mask)])
        return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, **kw)


def backend(tiny_model) -> HFBackend:
    model, tok = tiny_model
    special = sorted({tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens})
    # random weights: suppress control tokens so every reply is non-empty and the counts are exact
    return HFBackend(CountingModel(model, tok), tok, generate_kwargs={"suppress_tokens": special})


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_hf_statuses_and_contents(tiny_model, tmp_path: Path) -> None:
    be = backend(tiny_model)
    convs = [
        conv(0),
        conv(1, turns=1),
        conv(2, user="BOOM"),
        conv(3, user="long " * 200),
        Conversation("c4", [Message("user", "only a question")], "test"),
        conv(5, turns=3),
    ]
    out = tmp_path / "regen.jsonl"
    s = regenerate(convs, be, out, max_new_tokens=5, batch_size=8, progress=False)
    assert (s.total, s.ok, s.error, s.skipped) == (6, 3, 1, 2)
    # control tokens are suppressed, so no reply stops before max_new_tokens
    assert s.generated_turns == 2 + 1 + 3 and s.truncated_replies == 6
    res = read_results(out)
    assert {k: v["status"] for k, v in res.items()} == {
        "c0": "ok",
        "c1": "ok",
        "c2": "error",
        "c3": "skipped",
        "c4": "skipped",
        "c5": "ok",
    }
    assert "boom" in res["c2"]["reason"] and res["c3"]["reason"].startswith("prompt_too_long")
    assert res["c4"]["reason"] == "no assistant turn"
    for cid, n in (("c0", 2), ("c1", 1), ("c5", 3)):
        msgs = res[cid]["messages"]
        assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * n
        assert [m["content"] for m in msgs if m["role"] == "user"] == [
            f"Hello there! {cid[1:]}.{k}" for k in range(n)
        ]
        assert all("ORIGINAL" not in m["content"] and m["content"] for m in msgs if m["role"] == "assistant")
    # one generate call per turn index: turn 0 has c0, c1, c5 (c2 failed to render, c3 is too long),
    # turn 1 has c0, c5, turn 2 has c5
    assert [len(c) for c in be.model.calls] == [3, 2, 1]
    # turn 2's prompt holds the regenerated replies of turns 0 and 1, not the originals
    assert (
        "ORIGINAL" not in be.model.calls[2][0] and res["c5"]["messages"][4]["content"] in be.model.calls[2][0]
    )
    assert sorted(c.id for c in load_regenerated(out)) == ["c0", "c1", "c5"]  # file (completion) order


def test_hf_max_turns_and_left_padding(tiny_model, tmp_path: Path) -> None:
    be = backend(tiny_model)
    short, long = conv(0, turns=1), conv(1, turns=1, user="a much longer question " * 6)
    alone = regenerate([short], be, tmp_path / "a.jsonl", max_new_tokens=6, batch_size=1, progress=False)
    both = regenerate([long, short], be, tmp_path / "b.jsonl", max_new_tokens=6, batch_size=2, progress=False)
    assert alone.ok == 1 and both.ok == 2
    # left padding + attention mask: the short prompt's greedy reply does not change inside a batch
    b = read_results(tmp_path / "b.jsonl")
    assert read_results(tmp_path / "a.jsonl")["c0"] == b["c0"]
    assert (
        b["c0"]["messages"][-1]["content"] != b["c1"]["messages"][-1]["content"]
    )  # replies depend on the prompt
    three = regenerate(
        [conv(5, turns=3)],
        be,
        tmp_path / "c.jsonl",
        max_new_tokens=3,
        batch_size=1,
        max_turns=2,
        progress=False,
    )
    assert three.generated_turns == 2
    assert [m["role"] for m in read_results(tmp_path / "c.jsonl")["c5"]["messages"]].count("assistant") == 2


def test_hf_resume_does_not_redo_finished_work(tiny_model, tmp_path: Path) -> None:
    be = backend(tiny_model)
    convs = [conv(i, turns=1 + i % 2) for i in range(8)]
    out = tmp_path / "r.jsonl"
    first = regenerate(convs[:4], be, out, max_new_tokens=4, batch_size=2, progress=False)
    assert first.ok == 4 and first.resumed == 0
    before = out.read_text()
    n_calls = len(be.model.calls)
    second = regenerate(convs, be, out, max_new_tokens=4, batch_size=2, progress=False)
    assert (second.ok, second.resumed, second.generated_turns) == (8, 4, sum(1 + i % 2 for i in range(4, 8)))
    new_prompts = [p for call in be.model.calls[n_calls:] for p in call]
    assert all(f"Hello there! {i}." not in p for p in new_prompts for i in range(4))  # first half not redone
    assert out.read_text().startswith(before) and len(lines(out)) == 8
    third = regenerate(convs, be, out, max_new_tokens=4, batch_size=2, progress=False)
    assert third.resumed == 8 and third.generated_turns == 0 and len(lines(out)) == 8


def test_torn_last_line_is_redone(tiny_model, tmp_path: Path) -> None:
    be = backend(tiny_model)
    convs = [conv(i, turns=1) for i in range(4)]
    out = tmp_path / "t.jsonl"
    regenerate(convs, be, out, max_new_tokens=4, batch_size=4, progress=False)
    text = out.read_text()
    last_start = text.rstrip("\n").rfind("\n") + 1
    torn = text[: last_start + 25]  # a crash in the middle of writing the last line
    out.write_text(torn)
    s = regenerate(convs, be, out, max_new_tokens=4, batch_size=4, progress=False)
    assert s.torn_bytes_cut == 25 and s.resumed == 3 and s.generated_turns == 1 and s.ok == 4
    recs = lines(out)  # every line parses: the fragment was cut before appending
    assert len(recs) == 4 and sorted(r["id"] for r in recs) == ["c0", "c1", "c2", "c3"]
    assert read_results(out)["c3"] == json.loads(text[last_start:])  # greedy: the same reply again


def test_error_lines_can_be_retried(tiny_model, tmp_path: Path) -> None:
    out = tmp_path / "e.jsonl"
    out.write_text(json.dumps({"id": "c0", "status": "error", "reason": "x", "messages": []}) + "\n")
    be = backend(tiny_model)
    kept = regenerate([conv(0, turns=1)], be, out, max_new_tokens=3, batch_size=1, progress=False)
    assert (kept.error, kept.resumed, kept.generated_turns) == (1, 1, 0)
    redo = regenerate(
        [conv(0, turns=1)], be, out, max_new_tokens=3, batch_size=1, retry_errors=True, progress=False
    )
    assert (redo.ok, redo.error, redo.generated_turns) == (1, 0, 1) and read_results(out)["c0"][
        "status"
    ] == "ok"
    with pytest.raises(ValueError):
        regenerate([conv(0), conv(0)], be, tmp_path / "dup.jsonl", max_new_tokens=2, progress=False)


def test_split_reasoning() -> None:
    harmony = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>answer"
    assert split_reasoning(harmony) == ("think", "answer")
    assert split_reasoning("<think>\nhmm\n</think>\n\nyes") == ("hmm", "yes")
    assert split_reasoning("plain") == (None, "plain")
    assert split_reasoning("<think>\nstill thinking") == ("still thinking", "")  # cut before the answer
    assert split_reasoning("<|channel|>analysis<|message|>hmm") == ("hmm", "")


# ----------------------------------------------------------------------------------------------
# openai backend against a local chat-completions server


class FakeServer:
    def __init__(self):
        self.requests: list[dict] = []
        self.failures: dict[str, int] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # keep test output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append(body)
                last = body["messages"][-1]["content"]
                key = last.split()[0]
                if key == "flaky" and outer.failures.get(last, 0) < 1:
                    outer.failures[last] = outer.failures.get(last, 0) + 1
                    return self._send(500, {"error": {"message": "try again"}})
                if key == "fatal":
                    return self._send(400, {"error": {"message": "bad request"}})
                if key == "down":
                    return self._send(503, {"error": {"message": "overloaded"}})
                msg = {"role": "assistant", "content": f"reply to {last}"}
                if key == "think":
                    msg["reasoning_content"] = "pondering"
                finish = "length" if key == "long" else "stop"
                return self._send(
                    200,
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "created": 0,
                        "model": body["model"],
                        "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
                    },
                )

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(monkeypatch):
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    srv = FakeServer()
    yield srv
    srv.close()


def oa_conv(cid: str, *users: str) -> Conversation:
    msgs = []
    for u in users:
        msgs += [Message("user", u), Message("assistant", "ORIGINAL")]
    return Conversation(cid, msgs, "t")


def test_openai_backend_retries_and_errors(server, tmp_path: Path) -> None:
    be = OpenAIBackend(
        server.url, "target", concurrency=4, max_retries=2, backoff=0.01, timeout_s=10, enable_thinking=False
    )
    convs = [
        oa_conv("ok", "hello a", "hello b"),
        oa_conv("flaky", "flaky one", "flaky two"),
        oa_conv("fatal", "fatal x"),
        oa_conv("down", "down x"),
        oa_conv("think", "think q"),
        oa_conv("long", "long q"),
    ]
    out = tmp_path / "oa.jsonl"
    s = regenerate(
        convs,
        be,
        out,
        max_new_tokens=7,
        temperature=0.6,
        top_p=0.9,
        batch_size=3,
        progress=False,
    )
    assert (s.ok, s.error, s.skipped) == (4, 2, 0) and s.truncated_replies == 1
    res = read_results(out)
    assert [m["content"] for m in res["ok"]["messages"]] == [
        "hello a",
        "reply to hello a",
        "hello b",
        "reply to hello b",
    ]
    assert res["flaky"]["status"] == "ok" and res["flaky"]["messages"][3]["content"] == "reply to flaky two"
    assert "400" in res["fatal"]["reason"] and "503" in res["down"]["reason"]
    assert res["think"]["messages"][1] == {
        "role": "assistant",
        "content": "reply to think q",
        "reasoning": "pondering",
    }
    per_prompt = {}
    for r in server.requests:
        per_prompt[r["messages"][-1]["content"]] = per_prompt.get(r["messages"][-1]["content"], 0) + 1
    assert per_prompt["flaky one"] == 2 and per_prompt["flaky two"] == 2  # one 500, then success
    assert per_prompt["fatal x"] == 1  # 400 is permanent: no retry
    assert per_prompt["down x"] == 3  # 503 retried max_retries times
    r0 = server.requests[0]
    assert r0["max_tokens"] == 7 and r0["temperature"] == 0.6 and r0["top_p"] == 0.9
    assert r0["chat_template_kwargs"] == {"enable_thinking": False} and r0["model"] == "target"
    second_turn = next(r for r in server.requests if r["messages"][-1]["content"] == "hello b")
    assert second_turn["messages"][1] == {"role": "assistant", "content": "reply to hello a"}


class ScriptedBackend:
    """Replies from a script keyed by the last user message."""

    def __init__(self, script: dict):
        self.script = script

    def generate(self, prompts, params):
        return [self.script[p[-1].content] for p in prompts]


def test_empty_or_unfinished_replies_end_the_conversation(tmp_path: Path) -> None:
    from data_prep.regenerate import Reply

    be = ScriptedBackend(
        {
            "a1": Reply(content="A1"),
            "a2": Reply(content=""),
            "b1": Reply(content="", truncated=True),
            "c1": Reply(content="C1", reasoning="r", truncated=True),
            "c2": Reply(content="C2"),
        }
    )
    convs = [oa_conv("a", "a1", "a2"), oa_conv("b", "b1"), oa_conv("c", "c1", "c2")]
    s = regenerate(convs, be, tmp_path / "s.jsonl", max_new_tokens=4, batch_size=2, progress=False)
    assert (s.ok, s.skipped, s.error, s.generated_turns, s.truncated_replies) == (2, 1, 0, 3, 1)
    res = read_results(tmp_path / "s.jsonl")
    assert res["a"]["reason"] == "ended early: empty reply" and len(res["a"]["messages"]) == 2
    assert res["b"] == {
        "status": "skipped",
        "reason": "no answer within max_new_tokens",
        "id": "b",
        "source": "t",
        "messages": [],
    }
    assert res["c"]["messages"][1] == {"role": "assistant", "content": "C1", "reasoning": "r", "cut": True}


def test_hf_thinking_flag_reaches_the_template(tiny_model, tmp_path: Path) -> None:
    model, _ = tiny_model
    tok = tiny_tokenizer("qwen3")  # same vocabulary as the fixture's tokenizer
    special = sorted({tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens})
    be = HFBackend(
        CountingModel(model, tok), tok, enable_thinking=False, generate_kwargs={"suppress_tokens": special}
    )
    regenerate([conv(0, turns=1)], be, tmp_path / "q.jsonl", max_new_tokens=2, batch_size=1, progress=False)
    regenerate(
        [conv(1, turns=1)], be, tmp_path / "q.jsonl", max_new_tokens=2, enable_thinking=True, progress=False
    )
    off, on = (call[0] for call in be.model.calls)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n")


def test_a_turn_without_room_ends_the_conversation_before_it(tmp_path: Path) -> None:
    """prompt_fits False: nothing is sent for that prompt; the turns before it are kept (ok, ended early) and a
    first turn without room skips the conversation. Sending it instead made a server whose context is the
    prep's max_len refuse it (HTTP 400), and the whole conversation was lost as an error."""
    from data_prep.regenerate import CONTEXT_FULL, Reply

    sent: list[str] = []

    class Recording(ScriptedBackend):
        def generate(self, prompts, params):
            sent.extend(p[-1].content for p in prompts)
            return super().generate(prompts, params)

    be = Recording({u: Reply(content=u.upper()) for u in ("a1", "a2", "a3", "b1")})
    convs = [oa_conv("a", "a1", "a2", "a3"), oa_conv("b", "b1"), oa_conv("c", "c1 long")]

    def fits(prompt: list[Message]) -> bool:  # a1 (1 message) and a2 (3) fit, a3 (5) does not
        return len(prompt) < 4 and "long" not in prompt[-1].content

    s = regenerate(convs, be, tmp_path / "f.jsonl", max_new_tokens=4, batch_size=3, progress=False, prompt_fits=fits)
    assert sent == ["a1", "b1", "a2"]
    res = read_results(tmp_path / "f.jsonl")
    assert res["a"]["status"] == "ok" and res["a"]["reason"] == f"ended early: {CONTEXT_FULL}"
    assert [m["content"] for m in res["a"]["messages"]] == ["a1", "A1", "a2", "A2"]
    assert res["b"]["status"] == "ok" and res["b"]["reason"] == ""
    assert res["c"]["status"] == "skipped" and res["c"]["reason"] == CONTEXT_FULL
    assert (s.ok, s.skipped, s.error, s.generated_turns) == (2, 1, 0, 3)


# ----------------------------------------------------------------------------------------------
# replies cut at max_new_tokens, later turns, a backend that cannot be reached, the server's key


@pytest.mark.parametrize("name", ["chatml_smollm2", "llama3_1", "qwen3", "gpt_oss"])
def test_a_cut_reply_does_not_teach_end_of_turn(name: str) -> None:
    """The template renders an end of turn after every reply; after a reply the target stopped at the cap it was
    never generated, so it stays out of the mask. The turn's own text is masked as before, and an uncut turn
    keeps its end of turn."""
    from text_fixtures import masked_runs

    from data_prep.chat import end_of_turn, render_conversation

    tok = tiny_tokenizer(name)
    msgs = [Message("user", "Hello there!"), Message("assistant", "The capital of France is"),
            Message("user", "What is the capital of France?"), Message("assistant", "Paris is the capital")]
    eot = tok.convert_tokens_to_ids(end_of_turn(tok))
    whole = render_conversation(tok, msgs, max_len=512)
    for k in range(2):
        cut = [*msgs]
        cut[2 * k + 1] = Message("assistant", msgs[2 * k + 1].content, cut=True)
        r = render_conversation(tok, cut, max_len=512)
        assert r.input_ids == whole.input_ids  # the text is the same: only what is taught differs
        before, after = masked_runs(whole.input_ids, whole.loss_mask), masked_runs(r.input_ids, r.loss_mask)
        assert len(before) == len(after) == 2
        assert all(run[-1] in tok.all_special_ids for run in before), name  # each turn's end of turn
        assert after[k] == before[k][:-1], (name, tok.convert_ids_to_tokens(before[k]))  # the end of turn left
        assert after[1 - k] == before[1 - k]
        assert tok.decode(after[k]).endswith(msgs[2 * k + 1].content)
    assert masked_runs(whole.input_ids, whole.loss_mask)[-1][-1] == eot


def test_cut_flag_survives_the_regeneration_file(tmp_path: Path) -> None:
    from data_prep.regenerate import Reply

    be = ScriptedBackend({"q1": Reply(content="A1 cut", truncated=True), "q2": Reply(content="A2")})
    s = regenerate([oa_conv("a", "q1", "q2"), oa_conv("b", "q2")], be, tmp_path / "c.jsonl", max_new_tokens=4,
                   max_turns=None, progress=False)
    assert s.truncated_replies == 1
    back = {c.id: c for c in load_regenerated(tmp_path / "c.jsonl")}
    assert [m.cut for m in back["a"].messages] == [False, True, False, False]
    assert not any(m.cut for m in back["b"].messages)


def test_later_turns_cut_by_max_turns_are_counted(tmp_path: Path) -> None:
    from data_prep.regenerate import Reply

    be = ScriptedBackend({u: Reply(content=u.upper()) for u in ("a1", "b1", "c1")})
    convs = [oa_conv("a", "a1", "a2", "a3"), oa_conv("b", "b1", "b2"), oa_conv("c", "c1")]
    s = regenerate(convs, be, tmp_path / "t.jsonl", max_new_tokens=4, max_turns=1, progress=False)
    assert (s.max_turns, s.later_turns_dropped, s.conversations_with_later_turns_dropped) == (1, 3, 2)
    again = regenerate(convs, be, tmp_path / "t.jsonl", max_new_tokens=4, max_turns=1, progress=False)
    assert (again.resumed, again.later_turns_dropped, again.conversations_with_later_turns_dropped) == (3, 3, 2)
    every = regenerate(convs, ScriptedBackend({}), tmp_path / "t2.jsonl", max_new_tokens=4, max_turns=None,
                       progress=False, prompt_fits=lambda p: False)
    assert (every.later_turns_dropped, every.conversations_with_later_turns_dropped) == (0, 0)


def unused_port() -> int:
    import socket

    with socket.socket() as s:  # bound, never listening: a connection is refused
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_server_stops_at_the_first_batch(tmp_path: Path, monkeypatch) -> None:
    """Nothing listens at the URL: the run stops after the first batch, naming the URL and the error, instead of
    writing an error line per conversation and failing later for want of any sample; nothing is written, so a
    rerun against a running server sends everything."""
    from data_prep.regenerate import RegenerationError

    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    url = f"http://127.0.0.1:{unused_port()}/v1"
    be = OpenAIBackend(url, "target", max_retries=1, backoff=0.01, timeout_s=5)
    sent = []

    class Counting:
        where = be.where

        def generate(self, prompts, params):
            sent.append(len(prompts))
            return be.generate(prompts, params)

    out = tmp_path / "u.jsonl"
    with pytest.raises(RegenerationError) as e:
        regenerate([oa_conv(f"c{i}", f"q{i}") for i in range(12)], Counting(), out, max_new_tokens=4, batch_size=4,
                   progress=False)
    assert url in str(e.value) and "APIConnectionError" in str(e.value) and "all 4 requests" in str(e.value)
    assert sent == [4] and (not out.exists() or out.read_text() == "")


def test_some_failed_requests_do_not_stop_the_run(server, tmp_path: Path) -> None:
    be = OpenAIBackend(server.url, "target", max_retries=0, timeout_s=10)
    s = regenerate([oa_conv("a", "fatal a"), oa_conv("b", "hello b"), oa_conv("c", "fatal c")], be,
                   tmp_path / "p.jsonl", max_new_tokens=4, batch_size=3, progress=False)
    assert (s.ok, s.error) == (1, 2)


def test_the_key_comes_from_the_environment_and_is_never_echoed(tmp_path: Path, monkeypatch) -> None:
    """The key reaches the server from $OPENAI_API_KEY (no default overrides it); a server that refuses it and
    quotes it back in its error has the key redacted from what is printed and saved."""
    from data_prep.regenerate import RegenerationError

    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    secret = "sk-test-0123456789abcdef"
    seen: list[str | None] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(self.headers.get("Authorization"))
            data = json.dumps({"error": {"message": f"Incorrect API key provided: {secret[3:]}"}}).encode()
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("OPENAI_API_KEY", secret[3:])
        be = OpenAIBackend(f"http://127.0.0.1:{httpd.server_address[1]}/v1", "target", max_retries=0)
        with pytest.raises(RegenerationError) as e:
            regenerate([oa_conv("a", "q")], be, tmp_path / "k.jsonl", max_new_tokens=4, progress=False)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert seen == [f"Bearer {secret[3:]}"]
    assert "401" in str(e.value) and "***" in str(e.value) and secret[3:] not in str(e.value)


def test_training_tokens_are_the_generated_ids(tiny_model, tmp_path: Path) -> None:
    """What the sample teaches for a regenerated reply is exactly the ids the target generated (then its end of
    turn unless the reply was cut), even where decoding them and encoding the text again gives other ids: a random
    target picks token splits the tokenizer would not make."""
    from text_fixtures import masked_runs

    from data_prep.chat import render_conversation

    model, tok = tiny_model
    outputs: list[list[int]] = []

    class Recording(CountingModel):
        def generate(self, input_ids, attention_mask, **kw):
            out = super().generate(input_ids, attention_mask, **kw)
            outputs.extend(row[input_ids.shape[1]:].tolist() for row in out)
            return out

    special = sorted({tok.convert_tokens_to_ids(t) for t in tok.all_special_tokens if t != "<|im_end|>"})
    be = HFBackend(Recording(model, tok), tok, generate_kwargs={"suppress_tokens": special})
    convs = [conv(i, turns=1, user="Hello there! " * (1 + i % 3)) for i in range(12)]
    regenerate(convs, be, tmp_path / "g.jsonl", max_new_tokens=12, batch_size=12, progress=False)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    stopped = [ids[: ids.index(eot)] if eot in ids else ids for ids in outputs]
    done = {c.id: c for c in load_regenerated(tmp_path / "g.jsonl")}
    assert len(done) == 12
    differs = kept = 0
    for c in convs:
        reply = done[c.id].messages[-1]
        if reply.token_ids is None:  # a whitespace the stripped text drops sits inside a token: the text's own ids
            continue
        kept += 1
        gen, full = list(reply.token_ids), stopped[int(c.id[1:])]
        # the generated ids, less whitespace-only tokens at either end (the reply text is stripped)
        i = next(i for i in range(len(full)) if full[i : i + len(gen)] == gen)
        assert not tok.decode(full[:i]).strip() and not tok.decode(full[i + len(gen):]).strip(), (c.id, full, gen)
        assert tok.decode(gen) == reply.content, (c.id, gen, reply)
        r = render_conversation(tok, done[c.id].messages, max_len=512)
        run = masked_runs(r.input_ids, r.loss_mask)[-1]
        assert run == gen + ([] if reply.cut else [eot]), (c.id, run, gen)
        assert r.retokenized_turns == 0
        text_only = render_conversation(tok, [*done[c.id].messages[:-1], Message("assistant", reply.content)],
                                        max_len=512)
        differs += masked_runs(text_only.input_ids, text_only.loss_mask)[-1][: len(gen)] != gen
    assert kept >= 6 and differs >= 3, (kept, differs)  # re-encoding the text alone would teach other ids
