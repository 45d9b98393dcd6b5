"""Regenerate every assistant turn with the frozen target (the EAGLE-3 data recipe).

Turn by turn, in order: the reply to the conversation so far (original user turns + the replies
already regenerated) replaces the dataset's reply. Backends share one small interface
(:class:`Backend`): ``hf`` runs a transformers CausalLM (batched ``generate``, KV cache, left padding,
the conversations of a batch advance one turn index at a time); ``vllm`` sends the same token-id prompts to
prep's vLLM servers (serving/client.py), the ones that capture with capture.engine=vllm; ``openai`` calls any
OpenAI-compatible chat-completions server (vLLM, SGLang, ...) from a thread pool with a timeout and
retries with exponential backoff.

Output: JSONL, one line per conversation, appended and flushed as each conversation finishes::

    {"id", "status": "ok"|"error"|"skipped", "reason", "messages": [{"role", "content"[, "reasoning", "cut",
     "token_ids"]}], "source"}

A regenerated reply carries ``"cut": true`` when it stopped at ``max_new_tokens`` and, from the hf and vllm backends,
``"token_ids"``: the ids the target generated for its content (data_prep/chat.py puts exactly those in the sample).

One pass (vllm backend on an extracting server, capture.one_pass): every request also keeps the target's hidden
states of its prompt and reply (:class:`ReplyStates`); a conversation keeps those of its latest reply, and
``on_finished(conversation, states)`` receives them once its line is written (data_prep/pipeline.py builds its
shard sample from them: no second pass over its tokens). Every other file is deleted as soon as it is superseded
(the next turn's reply) or unused (a failed, skipped or empty reply), and the callback's file after it returns.

- ok: every assistant turn (up to ``max_turns``; the later ones are cut and counted in
  ``later_turns_dropped``) regenerated; a reply cut by ``max_new_tokens`` is kept, marked ``"cut": true``
  (counted in ``truncated_replies``; the prep decides with ``regen.on_length`` what it teaches); an empty
  reply ends the conversation there.
- skipped: nothing to regenerate (prompt too long for the model or for ``prompt_fits``, first reply empty).
  A later turn whose prompt does not fit ends the conversation before it (``ended early: ...``), keeping
  the turns already regenerated: a context limit is not an error.
- error: the backend failed after its retries; ``messages`` holds the turns done so far. Not for
  training. When every request of the run's first backend call fails (a server that is not there, a wrong
  key), :class:`RegenerationError` stops the run instead, naming the backend's URL and the first error, and
  nothing of that batch is written (a rerun sends it again).

Resume: lines already in ``out_path`` are read first and their ids are not redone (``retry_errors``
redoes error lines; readers take the last line per id). A torn last line left by a crash is cut off
before appending. Under torchrun give each rank its own slice and its own ``out_path``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from data_prep.chat import end_of_turn, render_prompt
from data_prep.conversations import Conversation, Message
from infra.preemption import Preempted
from infra.strict_json import dumps
from serving.server import API_KEY_ENV, VLLMServerError

STATUSES = ("ok", "error", "skipped")
CONTEXT_FULL = "prompt leaves no room for a reply (prompt_fits)"


class RegenerationError(RuntimeError):
    """Every request of the first batch failed: the backend cannot be used at all (the message names it)."""


def redact(text: str, secret: str | None) -> str:
    """`text` with `secret` replaced by '***' (error messages of a server may quote the key they refused)."""
    return text.replace(secret, "***") if secret and secret != "EMPTY" else text


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    enable_thinking: bool | None = None  # passed to the chat template when not None


@dataclass(frozen=True)
class ReplyStates:
    """The target's hidden states of one reply's request, kept by the engine that generated it: its connector file
    (vLLM's `include_output_tokens`: the prompt and every generated token but the last, which was never fed through
    the model) and that last generated token (the stop token, or a cut reply's last token)."""

    path: Path
    last_token: int

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


def _release(states: ReplyStates | None) -> None:
    if states is not None:
        states.release()


@dataclass
class Reply:
    content: str | None = None
    reasoning: str | None = None
    error: str | None = None  # the request failed (after retries)
    skip: str | None = None  # the request was not made (e.g. prompt too long)
    truncated: bool = False  # stopped by max_new_tokens (hf: no stop token generated; vllm, openai: finish_reason "length")
    # hf, vllm: the ids generated for `content` where decoding and re-encoding them gives other ids (Message.token_ids)
    token_ids: tuple[int, ...] | None = None
    tokens: int = 0  # tokens the engine generated for this reply, its stop token included (openai: its usage)
    states: ReplyStates | None = None  # vllm with keep_states: the request's hidden states (module doc, one pass)


class Backend(Protocol):
    def generate(self, prompts: Sequence[Sequence[Message]], params: SamplingParams) -> list[Reply]:
        """One reply per prompt (a conversation ending with a user turn), in order. Never raises for
        a single bad prompt: its Reply carries `error` or `skip` instead."""
        ...


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) from raw model text: gpt-oss channels or a Qwen-style <think> block."""
    final = "<|channel|>final<|message|>"
    if final in text:
        head, answer = text.rsplit(final, 1)
        analysis = "<|channel|>analysis<|message|>"
        reasoning = head.split(analysis, 1)[1].split("<|end|>", 1)[0] if analysis in head else None
        return reasoning, answer
    if "</think>" in text:
        head, answer = text.split("</think>", 1)
        return head.split("<think>", 1)[-1].strip("\n") or None, answer.lstrip("\n")
    for opener in ("<|channel|>analysis<|message|>", "<think>"):  # reasoning that never reached an answer
        if text.lstrip().startswith(opener):
            return text.split(opener, 1)[1].split("<|end|>", 1)[0].strip("\n") or None, ""
    return None, text


# ----------------------------------------------------------------------------------------------
# Backends


class TemplateBackend:
    """A backend that renders each prompt with the target's chat template, generates token ids and decodes them
    itself (hf, vllm): the reply's ids are known, so `Reply.token_ids` can carry them. Subclasses give
    `_generate_ids(prompt ids, params, stop ids) -> [(generated ids, stopped by max_new_tokens[, states file])]`."""

    where = "a template backend"  # what RegenerationError names
    fatal: tuple[type[BaseException], ...] = ()  # errors that stop the regeneration instead of failing a batch

    def __init__(
        self,
        tokenizer,
        *,
        eos_token_id: int | list[int] | None = None,
        max_positions: int | None = None,
        chat_template: str | None = None,
        enable_thinking: bool | None = None,
    ):
        self.tok, self.chat_template = tokenizer, chat_template
        self.enable_thinking = enable_thinking  # default for SamplingParams.enable_thinking
        self.eos = eos_token_id
        self.max_positions = max_positions
        self._stop_cache: dict[Any, list[int]] = {}
        self._strip = [s for s in tokenizer.all_special_tokens if s]

    def _stop_ids(self, kw: dict) -> list[int]:
        key = tuple(sorted(kw.items()))
        if key not in self._stop_cache:
            ids = set()
            eot = end_of_turn(self.tok, chat_template=self.chat_template, template_kwargs=kw)
            if eot is not None:
                ids.update(self.tok(eot, add_special_tokens=False)["input_ids"][-1:])
            eos = self.eos
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
            if not ids and self.tok.eos_token_id is not None:
                ids.add(self.tok.eos_token_id)
            self._stop_cache[key] = sorted(ids)
        return self._stop_cache[key]

    def _ids_of(self, ids: list[int], content: str) -> tuple[int, ...] | None:
        """The generated ids whose decoding is exactly `content` (whitespace-only tokens at either end dropped, as
        the reply text is stripped); None if there are none (reasoning split off, control tokens removed)."""
        i, j = 0, len(ids)
        while i < j and not self.tok.decode(ids[i : i + 1]).strip():
            i += 1
        while j > i and not self.tok.decode(ids[j - 1 : j]).strip():
            j -= 1
        return tuple(ids[i:j]) if content and self.tok.decode(ids[i:j], skip_special_tokens=False) == content else None

    def _generate_ids(self, prompts: list[list[int]], params: SamplingParams, stop: list[int],
                      seeds: list[int | None] | None = None) -> list[tuple]:
        raise NotImplementedError

    def encode(self, prompt: Sequence[Message], params: SamplingParams) -> list[int] | Reply:
        """The prompt's token ids, or the Reply that stands for it when none is sent (a template refusing it, a
        prompt too long)."""
        kw = {} if params.enable_thinking is None else {"enable_thinking": params.enable_thinking}
        try:
            ids = render_prompt(self.tok, prompt, chat_template=self.chat_template, template_kwargs=kw)
        except Exception as err:  # noqa: BLE001 - a template may refuse one conversation
            return Reply(error=f"template: {type(err).__name__}: {err}")
        if self.max_positions and len(ids) + params.max_new_tokens > self.max_positions:
            return Reply(skip=f"prompt_too_long ({len(ids)} + {params.max_new_tokens} > {self.max_positions})")
        return ids

    def stop_ids(self, params: SamplingParams) -> list[int]:
        return self._stop_ids({} if params.enable_thinking is None else {"enable_thinking": params.enable_thinking})

    def reply(self, ids: list[int], truncated: bool, stop: list[int], kept: Path | None = None) -> Reply:
        """The Reply of generated ids: cut after the first stop id, decoded, the reasoning split off."""
        states = ReplyStates(Path(kept), int(ids[-1])) if kept is not None else None
        cut = next((j for j, t in enumerate(ids) if t in stop), None)
        generated_tokens = len(ids) if cut is None else cut + 1
        ids = ids if cut is None else ids[:cut]
        text = self.tok.decode(ids, skip_special_tokens=False)
        reasoning, answer = split_reasoning(text)
        for s in self._strip:  # stray control tokens must not reach training text
            answer = answer.replace(s, "")
        content = answer.strip()
        # decode -> re-encode does not always give the generated ids back (data_prep/chat.py, step 5)
        token_ids = self._ids_of(ids, content) if reasoning is None else None
        return Reply(content=content, reasoning=reasoning, truncated=truncated, token_ids=token_ids,
                     tokens=generated_tokens, states=states)

    def generate(self, prompts: Sequence[Sequence[Message]], params: SamplingParams,
                 seeds: Sequence[int | None] | None = None) -> list[Reply]:
        replies: list[Reply | None] = [None] * len(prompts)
        encoded: list[tuple[int, list[int]]] = []
        for i, p in enumerate(prompts):
            ids = self.encode(p, params)
            if isinstance(ids, Reply):
                replies[i] = ids
            else:
                encoded.append((i, ids))
        if encoded:
            stop = self.stop_ids(params)
            try:
                generated = self._generate_ids([ids for _, ids in encoded], params, stop,
                                               [seeds[i] for i, _ in encoded] if seeds is not None else None)
            except self.fatal:
                raise
            except Exception as err:  # noqa: BLE001 - e.g. out of memory: fail this batch, not the job
                for i, _ in encoded:
                    replies[i] = Reply(error=f"generate: {type(err).__name__}: {err}")
            else:
                for (i, _), (ids, truncated, *kept) in zip(encoded, generated):
                    replies[i] = self.reply(ids, truncated, stop, kept[0] if kept else None)
        return [r if r is not None else Reply(error="no reply") for r in replies]


class HFBackend(TemplateBackend):
    """A transformers CausalLM + its tokenizer: left-padded batched `generate` with a KV cache."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        chat_template: str | None = None,
        enable_thinking: bool | None = None,
        generate_kwargs: dict | None = None,
    ):
        cfg = getattr(model, "generation_config", None)
        super().__init__(tokenizer, eos_token_id=getattr(cfg, "eos_token_id", None) if cfg is not None else None,
                         max_positions=getattr(model.config, "max_position_embeddings", None),
                         chat_template=chat_template, enable_thinking=enable_thinking)
        self.model = model
        self.generate_kwargs = dict(generate_kwargs or {})
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.where = f"hf generate on {next(model.parameters()).device}"  # named by RegenerationError

    def _generate_ids(self, prompts: list[list[int]], params: SamplingParams, stop: list[int],
                      seeds: list[int | None] | None = None) -> list[tuple[list[int], bool]]:
        rows = hf_generate_ids(self.model, prompts, params.max_new_tokens, stop, self.pad_id, params.temperature,
                               params.top_p, **self.generate_kwargs)
        return [(ids, not any(t in stop for t in ids)) for ids in rows]  # no stop token: cut at max_new_tokens


def hf_generate_ids(model, prompts: list[list[int]], max_new_tokens: int, stop: Sequence[int], pad_id: int,
                    temperature: float = 0.0, top_p: float = 1.0, **generate_kwargs) -> list[list[int]]:
    """Each prompt's generated ids from ONE left-padded, batched `model.generate` with a KV cache (greedy at
    temperature 0), cut after its first `stop` id (kept); `generate_kwargs` go to generate as they are (e.g.
    synced_gpus for a ZeRO-3-partitioned model)."""
    import torch

    width = max(len(ids) for ids in prompts)
    device = next(model.parameters()).device
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in prompts], device=device)
    attn = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=device)
    sample = temperature > 0
    gen_kw = dict(max_new_tokens=max_new_tokens, do_sample=sample, eos_token_id=list(stop),
                  pad_token_id=pad_id, use_cache=True)
    if sample:
        gen_kw.update(temperature=temperature, top_p=top_p)
    gen_kw.update(generate_kwargs)
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attn, **gen_kw)
    rows = [out[row, width:].tolist() for row in range(len(prompts))]
    cuts = [next((j + 1 for j, t in enumerate(ids) if t in stop), len(ids)) for ids in rows]
    return [ids[:cut] for ids, cut in zip(rows, cuts)]


class VLLMBackend(TemplateBackend):
    """Prep's vLLM servers (serving/client.py VLLMClient: the servers that also capture with capture.engine=vllm):
    the prompts rendered and the replies decoded here, as hf does, generated by vLLM from token ids. `stream`
    (what `regenerate` uses) sends each reply's request as soon as its conversation is ready for it and hands the
    replies back as they complete; `generate` sends a lockstep batch. `keep_states` (an extracting server,
    capture.one_pass): each Reply carries its request's hidden states (ReplyStates). A sampled reply's seed is its
    own (`request_seed`: the run's seed, the conversation and the turn), the same after any resume."""

    def __init__(
        self,
        client,
        tokenizer,
        *,
        eos_token_id: int | list[int] | None = None,
        chat_template: str | None = None,
        enable_thinking: bool | None = None,
        seed: int | None = None,
        keep_states: bool = False,
    ):
        super().__init__(tokenizer, eos_token_id=eos_token_id, max_positions=client.spec.max_model_len,
                         chat_template=chat_template, enable_thinking=enable_thinking)
        self.client, self.seed, self.keep_states = client, seed, keep_states
        self.where = client.where
        self.fatal = (VLLMServerError,)  # a server gone or stuck is no one conversation's failure

    @property
    def capacity(self) -> int:
        """Replies the servers work on at once: vllm.max_in_flight on each."""
        return self.client.capacity

    def _generate_ids(self, prompts: list[list[int]], params: SamplingParams, stop: list[int],
                      seeds: list[int | None] | None = None) -> list[tuple]:
        outs = self.client.generate(prompts, max_tokens=params.max_new_tokens, temperature=params.temperature,
                                    top_p=params.top_p, seed=list(seeds) if seeds is not None and params.temperature
                                    > 0 else None, stop_token_ids=stop, keep_states=self.keep_states)
        return [(o["token_ids"], o["finish_reason"] == "length", o.get("states")) for o in outs]

    def stream(self, params: SamplingParams) -> ReplyStream:
        return ReplyStream(self, params)


class ReplyStream:
    """One regeneration's requests on a VLLMBackend: `submit(key, prompt, seed)` sends (or answers at once with the
    Reply of a prompt not sent), `replies()` yields (key, Reply) as they complete, more submitted meanwhile."""

    def __init__(self, backend: VLLMBackend, params: SamplingParams):
        self.backend, self.params = backend, params
        self.stop = backend.stop_ids(params)
        self.requests = backend.client.stream()
        self.ready: list[tuple[Any, Reply]] = []  # replies known without a request

    def submit(self, key: Any, prompt: Sequence[Message], seed: int | None) -> None:
        ids = self.backend.encode(prompt, self.params)
        if isinstance(ids, Reply):
            self.ready.append((key, ids))
            return
        p = self.params
        body, size = self.backend.client.generation_request(
            ids, max_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
            seed=seed if p.temperature > 0 else None, stop_token_ids=self.stop, keep_states=self.backend.keep_states)
        self.requests.submit((key, body), body, size)

    def replies(self) -> Iterator[tuple[Any, Reply]]:
        client = self.backend.client
        completed = None  # one pass of the request stream; a new one once it ran dry and more was submitted
        while True:
            while self.ready:
                yield self.ready.pop(0)
            if completed is None:
                completed = self.requests.completed()
            done = next(completed, None)
            if done is None:
                completed = None
                if not self.ready:
                    return
                continue
            key, body = done.tag
            out = client.generated(done, body, self.backend.keep_states)
            yield key, self.backend.reply(out["token_ids"], out["finish_reason"] == "length", self.stop,
                                          out.get("states"))

    def close(self) -> None:
        self.requests.close()


def request_seed(seed: int, conversation_id: str, turn: int) -> int:
    """A sampled reply's own seed: the same (run seed, conversation, turn) gives the same draws after any resume,
    and two conversations never share their random numbers."""
    digest = hashlib.sha256(f"{seed}:{conversation_id}:{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class OpenAIBackend:
    """Any OpenAI-compatible chat-completions server, called from `concurrency` threads."""

    RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        concurrency: int = 16,
        timeout_s: float = 600.0,
        max_retries: int = 4,
        backoff: float = 1.0,
        enable_thinking: bool | None = None,
        extra_body: dict | None = None,
    ):
        import openai  # lazy: only this backend needs it

        # one INFO line per request would bury the prep's progress bar and summary
        for name in ("httpx", "httpx2", "openai"):
            logging.getLogger(name).setLevel(logging.WARNING)

        # None: $OPENAI_API_KEY, else "EMPTY" (a server started without a key accepts any)
        self._key = api_key if api_key is not None else os.environ.get(API_KEY_ENV) or "EMPTY"
        self.where = base_url  # named by RegenerationError
        self.hint = "; check that the server runs there (regen.base_url) and accepts the key (regen.api_key_env)"
        # retries are ours (below), so the client's own are off
        self.client = openai.OpenAI(base_url=base_url, api_key=self._key, timeout=timeout_s, max_retries=0)
        self.enable_thinking = enable_thinking  # default for SamplingParams.enable_thinking
        self.model, self.concurrency = model, concurrency
        self.max_retries, self.backoff = max_retries, backoff
        self.extra_body = dict(extra_body or {})
        self._openai = openai

    def _retryable(self, err: Exception) -> bool:
        o = self._openai
        if isinstance(err, (o.APITimeoutError, o.APIConnectionError)):
            return True
        return isinstance(err, o.APIStatusError) and err.status_code in self.RETRY_STATUS

    def _one(self, prompt: Sequence[Message], params: SamplingParams) -> Reply:
        body = dict(self.extra_body)
        if params.enable_thinking is not None:
            body["chat_template_kwargs"] = {
                **body.get("chat_template_kwargs", {}),
                "enable_thinking": params.enable_thinking,
            }
        messages = [{"role": m.role, "content": m.content} for m in prompt]
        for attempt in range(self.max_retries + 1):
            try:
                resp = self.client.chat.completions.create(
                    model=self.model,
                    messages=messages,
                    max_tokens=params.max_new_tokens,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    extra_body=body or None,
                )
                choice = resp.choices[0]
                msg = choice.message
                reasoning = getattr(msg, "reasoning_content", None) or getattr(msg, "reasoning", None)
                inline_reasoning, content = split_reasoning(msg.content or "")
                return Reply(
                    content=content.strip(),
                    reasoning=reasoning or inline_reasoning,
                    truncated=choice.finish_reason == "length",
                    tokens=int(getattr(getattr(resp, "usage", None), "completion_tokens", 0) or 0),
                )
            except Exception as err:  # noqa: BLE001
                if attempt == self.max_retries or not self._retryable(err):
                    return Reply(error=redact(f"{type(err).__name__}: {err}", self._key)[:300])
                time.sleep(self.backoff * 2**attempt * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def generate(self, prompts: Sequence[Sequence[Message]], params: SamplingParams) -> list[Reply]:
        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            return list(pool.map(lambda p: self._one(p, params), prompts))


def make_backend(kind: str, **kwargs) -> Backend:
    """`make_backend("hf", model=..., tokenizer=...)`, `make_backend("openai", base_url=..., model=...)` or
    `make_backend("vllm", client=..., tokenizer=...)`."""
    backends = {"hf": HFBackend, "openai": OpenAIBackend, "vllm": VLLMBackend}
    if kind not in backends:
        raise ValueError(f"unknown regeneration backend {kind!r} (hf | openai | vllm)")
    return backends[kind](**kwargs)


# ----------------------------------------------------------------------------------------------
# Output file


def read_results(path: str | Path) -> dict[str, dict]:
    """Last valid line per id of a regeneration JSONL (torn or corrupt lines are ignored)."""
    results: dict[str, dict] = {}
    p = Path(path)
    if not p.exists():
        return results
    with open(p, encoding="utf-8") as f:
        for line in f:
            rec = _parse_line(line)
            if rec is not None:
                results[rec["id"]] = rec
    return results


def load_regenerated(path: str | Path, statuses: Iterable[str] = ("ok",)) -> list[Conversation]:
    """The regenerated conversations with one of `statuses`, ready for rendering/capture.

    In file order, which is completion order (not the input order); sort or split by id if needed.
    """
    keep = set(statuses)
    return [Conversation.from_dict(r) for r in read_results(path).values() if r["status"] in keep]


def _parse_line(line: str) -> dict | None:
    if not line.endswith("\n"):
        return None
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    if isinstance(rec, dict) and isinstance(rec.get("id"), str) and rec.get("status") in STATUSES:
        return rec
    return None


def _repair_tail(path: Path) -> int:
    """Cut a torn last line (crash mid-write) so appending starts on a clean line. Returns bytes cut."""
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        tail = data[keep:]
        if tail:
            f.truncate(keep)
        return len(tail)


# ----------------------------------------------------------------------------------------------
# Driver


@dataclass
class RegenSummary:
    total: int = 0
    ok: int = 0
    error: int = 0
    skipped: int = 0
    resumed: int = 0  # already finished in out_path before this run
    generated_turns: int = 0  # replies generated by this run
    generated_tokens: int = 0  # the tokens of those replies, as the engine generated them (stop tokens included)
    truncated_replies: int = 0  # of those, cut at max_new_tokens (marked "cut" in out_path)
    # assistant turns after the first max_turns, cut from the conversations (all of them, resumed ones too)
    max_turns: int | None = None
    later_turns_dropped: int = 0
    conversations_with_later_turns_dropped: int = 0
    torn_bytes_cut: int = 0
    reasons: Counter = field(default_factory=Counter)
    elapsed_s: float = 0.0
    out_path: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["reasons"] = dict(self.reasons)
        return d


@dataclass
class _Work:
    conv: Conversation
    todo: list[list[Message]]  # per assistant turn: the original non-assistant messages before it
    done: list[Message] = field(default_factory=list)  # regenerated conversation so far
    status: str = "ok"
    reason: str = ""
    finished: bool = False
    states: ReplyStates | None = None  # the hidden states of the latest reply kept (one pass)


def _plan(conv: Conversation, max_turns: int | None) -> _Work:
    todo, pending = [], []
    for m in conv.messages:
        if m.role == "assistant":
            todo.append(pending)
            pending = []
        else:
            pending.append(m)
    w = _Work(conv, todo[:max_turns] if max_turns is not None else todo)
    if not w.todo:
        w.status, w.reason = "skipped", "no assistant turn"
    return w


def regenerate(
    conversations: Sequence[Conversation],
    backend: Backend,
    out_path: str | Path,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    batch_size: int = 8,
    max_turns: int | None = None,
    enable_thinking: bool | None = None,
    retry_errors: bool = False,
    progress: bool = True,
    prompt_fits: Callable[[list[Message]], bool] | None = None,
    should_stop: Callable[[], int] | None = None,
    on_finished: Callable[[Conversation, ReplyStates | None], None] | None = None,
    stream: bool = True,
    seed: int = 0,
) -> RegenSummary:
    """Regenerate `conversations` into `out_path` (JSONL, resumable); see the module doc.

    A backend that streams (vllm) runs as a stream when `stream` is on: up to `batch_size` conversations are open
    at once, each with its next request in flight; a conversation's next turn goes out as soon as its reply
    arrives, and a finished conversation's place goes at once to the next pending one. Otherwise (hf, openai, or
    `stream` off) `batch_size` conversations advance together, one turn index per backend call (for the openai
    backend it bounds the requests in flight together with the backend's `concurrency`). `seed`: a sampled
    reply's seed is `request_seed(seed, conversation, turn)`.
    `enable_thinking` None falls back to the backend's own `enable_thinking`. `prompt_fits(prompt)` False:
    no room for a whole reply after that prompt (the prep's max_len); nothing is sent for it. `should_stop()`: the
    stop signal received (prep's StopSignals), checked before every backend call (a backend may also raise
    Preempted while it waits): the conversations finished are in the file, the batch in flight is not, and
    Preempted (exit 75) ends the regeneration; a rerun regenerates the rest. `on_finished(conversation, states)`:
    called for every ok conversation right after its line is written, with the hidden states of its last reply
    when the backend kept them (module doc, one pass; None otherwise); the file is deleted once it returns.
    """
    from tqdm import tqdm

    t0 = time.time()
    ids = [c.id for c in conversations]
    if len(set(ids)) != len(ids):
        raise ValueError("conversation ids must be unique (resume keys on them)")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = RegenSummary(total=len(conversations), out_path=str(out), max_turns=max_turns)
    if max_turns is not None:
        beyond = [n - max_turns for n in (sum(m.role == "assistant" for m in c.messages) for c in conversations)]
        summary.later_turns_dropped = sum(b for b in beyond if b > 0)
        summary.conversations_with_later_turns_dropped = sum(b > 0 for b in beyond)
    summary.torn_bytes_cut = _repair_tail(out)
    previous = read_results(out)
    final: dict[str, str] = {}
    pending: list[Conversation] = []
    for c in conversations:
        rec = previous.get(c.id)
        if rec is not None and not (retry_errors and rec["status"] == "error"):
            final[c.id] = rec["status"]
            summary.reasons[rec.get("reason") or rec["status"]] += 1
            summary.resumed += 1
        else:
            pending.append(c)
    if enable_thinking is None:
        enable_thinking = getattr(backend, "enable_thinking", None)
    params = SamplingParams(max_new_tokens, temperature, top_p, enable_thinking)
    bar = tqdm(total=len(conversations), initial=summary.resumed, disable=not progress, desc="regenerate")
    first_call = True
    with open(out, "a", encoding="utf-8") as f:

        def finish(w: _Work) -> None:
            line = {
                "status": w.status,
                "reason": w.reason,
                **Conversation(w.conv.id, w.done, w.conv.source).to_dict(),
            }
            text = dumps(line, ensure_ascii=False)
            f.write(text + "\n")
            f.flush()  # a crash loses at most the line being written
            w.finished = True
            final[w.conv.id] = w.status
            summary.reasons[w.reason or w.status] += 1
            bar.update(1)
            if on_finished is not None and w.status == "ok":
                # the conversation as the file gives it back (load_regenerated), so its sample is the one rendered later
                on_finished(Conversation.from_dict(json.loads(text)), w.states)
            _release(w.states)
            w.states = None

        def run_batch(batch: list[_Work]) -> None:
            nonlocal first_call
            turn = 0
            while active := [w for w in batch if w.status == "ok" and turn < len(w.todo)]:
                if should_stop is not None and should_stop():
                    raise Preempted(should_stop())
                prompts = [w.done + w.todo[turn] for w in active]
                fits = [prompt_fits is None or prompt_fits(p) for p in prompts]
                sent = [(w, p) for w, p, ok in zip(active, prompts, fits) if ok]
                seeds = [request_seed(seed, w.conv.id, turn) for w, _ in sent]
                replies = (backend.generate([p for _, p in sent], params, seeds) if isinstance(backend, TemplateBackend)
                           else backend.generate([p for _, p in sent], params)) if sent else []
                if first_call and replies and all(r.error is not None for r in replies):
                    bar.close()
                    where = getattr(backend, "where", type(backend).__name__)
                    raise RegenerationError(
                        f"regeneration stopped: all {len(replies)} requests of the first batch failed at {where}; "
                        f"the first error: {replies[0].error}. Nothing of this batch was written"
                        + getattr(backend, "hint", ""))
                first_call = first_call and not replies
                sent = iter(replies)
                for w, prompt, ok in zip(active, prompts, fits):
                    _apply(w, prompt, next(sent) if ok else Reply(skip=CONTEXT_FULL), summary)
                turn += 1
                for w in active:
                    if w.status != "ok" or turn >= len(w.todo):
                        finish(w)
            for w in batch:
                if not w.finished:
                    finish(w)

        def run_stream(works: Iterator[_Work], open_at_once: int) -> None:
            """Every conversation of `works` through the backend's stream, `open_at_once` of them open at a time."""
            nonlocal first_call
            replies = backend.stream(params)
            open_: dict[str, tuple[_Work, list[Message]]] = {}
            held: list[_Work] = []  # failed before any reply came: written once one comes (RegenerationError)

            def advance(w: _Work) -> None:  # the conversation's next turn out, or its line written
                turn = sum(m.role == "assistant" for m in w.done)
                while w.status == "ok" and turn < len(w.todo):
                    prompt = w.done + w.todo[turn]
                    if prompt_fits is None or prompt_fits(prompt):
                        open_[w.conv.id] = (w, prompt)
                        replies.submit(w.conv.id, prompt, request_seed(seed, w.conv.id, turn))
                        return
                    _apply(w, prompt, Reply(skip=CONTEXT_FULL), summary)
                    turn = sum(m.role == "assistant" for m in w.done)
                finish(w)

            def fill() -> None:
                while len(open_) < open_at_once and (w := next(works, None)) is not None:
                    advance(w)

            try:
                fill()
                for key, reply in replies.replies():
                    if should_stop is not None and should_stop():
                        raise Preempted(should_stop())
                    w, prompt = open_.pop(key)
                    _apply(w, prompt, reply, summary)
                    if first_call and w.status == "error":
                        held.append(w)
                        if len(held) >= min(open_at_once, summary.total - summary.resumed):
                            bar.close()
                            raise RegenerationError(
                                f"regeneration stopped: the first {len(held)} requests all failed at {backend.where}; "
                                f"the first error: {held[0].reason}. Nothing of them was written"
                                + getattr(backend, "hint", ""))
                        fill()
                        continue
                    if first_call:
                        first_call = False
                        for h in held:
                            finish(h)
                        held.clear()
                    advance(w)
                    fill()
                for h in held:
                    finish(h)
            finally:  # stopped or failed: the states still held are not handed on
                replies.close()
                for w, _ in open_.values():
                    _release(w.states)
                    w.states = None

        if stream and hasattr(backend, "stream"):
            run_stream((_plan(c, max_turns) for c in pending), batch_size)
        else:
            for b in range(0, len(pending), batch_size):
                batch = [_plan(c, max_turns) for c in pending[b : b + batch_size]]
                try:
                    run_batch(batch)
                finally:  # stopped or failed: the states still held are not handed on
                    for w in batch:
                        _release(w.states)
                        w.states = None
        os.fsync(f.fileno())
    bar.close()
    counts = Counter(final[c.id] for c in conversations)
    summary.ok, summary.error, summary.skipped = counts["ok"], counts["error"], counts["skipped"]
    assert summary.ok + summary.error + summary.skipped == summary.total, summary
    summary.elapsed_s = time.time() - t0
    return summary


def _apply(w: _Work, prompt: list[Message], r: Reply, summary: RegenSummary) -> None:
    if r.error is not None:
        w.status, w.reason = "error", r.error
        _release(r.states)
        return
    if r.skip is not None or not (r.content or "").strip():
        _release(r.states)
        reason = r.skip or ("no answer within max_new_tokens" if r.truncated else "empty reply")
        n_done = sum(m.role == "assistant" for m in w.done)
        if n_done:  # keep what was regenerated: the conversation just ends earlier (its last reply's states kept)
            w.todo, w.reason = w.todo[:n_done], f"ended early: {reason}"
        else:
            w.status, w.reason = "skipped", reason
        return
    summary.generated_turns += 1
    summary.generated_tokens += r.tokens
    summary.truncated_replies += r.truncated
    w.done = [*prompt, Message("assistant", r.content, r.reasoning or None, r.truncated, r.token_ids)]
    _release(w.states)  # the previous turn's request: this one's prompt holds that turn
    w.states = r.states
