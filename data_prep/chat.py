"""Render a conversation with the target's own chat template and build the assistant-only loss mask.

Why not a per-model table of separators: templates rewrite what they render (Llama-3 trims the
content, Qwen3 moves or drops ``<think>`` reasoning depending on the turn's position, gpt-oss puts
reasoning in an ``analysis`` channel and ends the last turn with ``<|return|>`` but earlier ones with
``<|end|>``). So the spans are found on the text the template actually rendered:

1. ``full`` = the whole conversation rendered once (no generation prompt) and tokenized once with
   character offsets (fast tokenizer required).
2. END of each assistant body: the conversation is rendered again with a unique sentinel appended to
   every assistant content; removing the sentinels must give back ``full`` exactly, and the sentinel
   positions are then the body ends (templates that trim are retried with right-stripped contents).
3. START of each assistant turn: the longest common prefix of ``full`` and the prompt the model
   would have been given for that turn (messages before it + generation prompt). Everything after
   it up to the body end is what the model generates in that turn: for gpt-oss that includes the
   ``<|channel|>…<|message|>`` headers and the analysis message, for Qwen3 the ``<think>`` block.
   Fallbacks when the template is not prefix-stable (e.g. Mistral moves the system prompt): the last
   generation-prompt text before the body, then the content itself right before the body end.
4. END OF TURN: optional whitespace and then the special token right after the body
   (``<|im_end|>``, ``<|eot_id|>``, ``<|end|>``/``<|return|>``, ``</s>`` ...), discovered from the
   rendered text; a special token that opens a header (found in the generation prompt) is not one.
   A reply cut at the generation cap (``Message.cut``: the target never generated its end of turn) ends
   its span at the body end, so its end of turn is not taught.
5. GENERATED IDS: a regenerated reply may carry the ids the target generated (``Message.token_ids``, whose
   decoding is its content). Decoding and re-encoding does not always give them back (a byte-level reply cut
   inside a character, a non-canonical split), so where the content sits between token boundaries of
   ``full`` its tokens are replaced by those ids: the sample holds exactly what the target produced.
   Where it does not, the text's own tokens stay (counted in ``RenderedSample.retokenized_turns``).

Mask = 1 on every token overlapping [turn start, end-of-turn end) (a token that starts a little before
the turn start counts only if that part is whitespace); 0 elsewhere: system, user, role headers,
generation prompt. ``assistant_texts`` holds exactly those character spans of ``full``.

Long sequences: ``overflow="truncate"`` keeps the first ``max_len`` tokens and the mask within them
(``truncated=True``), ``overflow="drop"`` drops the conversation (reason ``too_long``). A sample with no
masked token left is dropped (``no_assistant_tokens``). Text that contains one of the tokenizer's
special-token strings is dropped (``control_token_in_text``): it would tokenize into a real control
token and forge turn boundaries.

Counting only (the draft vocabulary's dataset-wide count): ``assistant_token_counts`` gives the loss-masked
token counts of many conversations, equal to their ``render_conversation`` samples counted one by one, with the
texts tokenized in one batch and the mask and count computed on arrays (tests/test_prep_vocab.py checks the two
agree on the embedded dataset).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from data_prep.conversations import Message
from infra.strict_json import dumps

if TYPE_CHECKING:
    import numpy as np

MessageLike = Message | Mapping[str, Any]
_WS = re.compile(r"\s*")


@dataclass
class RenderedSample:
    input_ids: list[int]
    loss_mask: list[int]
    # per assistant turn: the rendered text that is masked in (with its end of turn), before truncation
    assistant_texts: list[str]
    truncated: bool
    full_length: int | None  # tokens before truncation; None if only a prefix was tokenized (long text)
    retokenized_turns: int = 0  # turns with generated ids (Message.token_ids) that kept the text's tokens instead


@dataclass
class Dropped:
    reason: str  # too_long | no_assistant_tokens | no_assistant | template_error | template_mismatch | control_token_in_text
    detail: str = ""


def _role(m: MessageLike) -> str | None:
    return m.role if isinstance(m, Message) else m.get("role")


def _as_dicts(messages: Sequence[MessageLike]) -> list[dict[str, Any]]:
    # a record's own "cut"/"token_ids" (a regeneration line read as dicts) are ours, not the template's
    return [m.to_dict() if isinstance(m, Message) else {k: v for k, v in m.items() if k not in ("cut", "token_ids")}
            for m in messages]


def _generated_ids(m: MessageLike) -> list[int] | None:
    ids = m.token_ids if isinstance(m, Message) else m.get("token_ids")
    return None if ids is None else list(ids)


def _splice_generated(ids, offsets, mask, regions) -> tuple[list[int], list[int], int]:
    """`ids`/`mask` with each region's tokens replaced by its generated ids (module doc, step 5). `regions`:
    (char start, char end, generated ids) in order, each a masked assistant content. Returns (ids, mask, regions
    left as the text's tokens: no token boundary at one of their ends)."""
    out_ids, out_mask, pos, left = [], [], 0, 0
    for a, b, gen in regions:
        i0 = next((t for t in range(pos, len(offsets)) if offsets[t][1] > a), len(offsets))
        i1 = next((t for t in range(i0, len(offsets)) if offsets[t][0] >= b), len(offsets))
        placeable = (i0 < i1 <= len(offsets) and offsets[i0][0] == a and offsets[i1 - 1][1] == b
                     and (i1 == len(offsets) or offsets[i1][0] >= b) and all(mask[i0:i1]))
        if not placeable:
            left += 1
            continue
        out_ids += ids[pos:i0] + gen
        out_mask += mask[pos:i0] + [1] * len(gen)
        pos = i1
    return out_ids + ids[pos:], out_mask + mask[pos:], left


def _render(tok, msgs: list[dict], gen: bool, chat_template: str | None, kw: Mapping[str, Any]) -> str:
    return tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=gen, chat_template=chat_template, **kw
    )


def _special_strings(tok) -> tuple[str, ...]:
    found = set(tok.all_special_tokens)
    found.update(t.content for t in tok.added_tokens_decoder.values() if t.special)
    return tuple(sorted((s for s in found if s), key=len, reverse=True))


@functools.lru_cache(maxsize=16)
def _special_regex(strings: tuple[str, ...]) -> re.Pattern | None:
    return re.compile("|".join(map(re.escape, strings))) if strings else None


def _generation_suffix(tok, chat_template: str | None, kw: Mapping[str, Any]) -> str:
    """The text add_generation_prompt appends (e.g. '<|im_start|>assistant\\n'); '' if none/unknown."""
    probe = [{"role": "user", "content": "Hi"}]
    try:
        with_gen = _render(tok, probe, True, chat_template, kw)
        without = _render(tok, probe, False, chat_template, kw)
    except Exception:  # noqa: BLE001 - a template may refuse the probe; the fallback just gets weaker
        return ""
    return with_gen[len(without) :] if with_gen.startswith(without) else ""


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on the first mismatch: rendered prompts are long
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _body_ends(tok, msgs, asst, full, chat_template, kw) -> list[int] | None:
    """Character offset in `full` where each assistant body ends (sentinel rendering, see module doc)."""
    base = next((c for c in ("\ue000", "\ue010", "\ue020") if c not in full), None)  # private-use chars
    if base is None:
        return None
    sentinels = [f"{base}{k}{base}" for k in range(len(asst))]
    for strip in (False, True):
        marked = [dict(m) for m in msgs]
        for k, i in enumerate(asst):
            content = marked[i]["content"].rstrip() if strip else marked[i]["content"]
            marked[i]["content"] = content + sentinels[k]
        try:
            text = _render(tok, marked, False, chat_template, kw)
        except Exception:  # noqa: BLE001
            continue
        ends, pieces, cur, removed = [], [], 0, 0
        for s in sentinels:
            p = text.find(s, cur)
            if p < 0 or text.count(s) != 1:
                break
            pieces.append(text[cur:p])
            ends.append(p - removed)
            removed += len(s)
            cur = p + len(s)
        pieces.append(text[cur:])
        if len(ends) == len(asst) and "".join(pieces) == full:
            return ends
    return None


def _turn_start(tok, msgs, i, full, lo, body_end, gen_suffix, chat_template, kw) -> int | None:
    partial = None
    # The prompt with the template's defaults is tried too: a generation prompt that forces a prefix
    # (Qwen3 enable_thinking=False adds an empty <think></think>) does not match turns the template
    # renders without it, while the bare role header does.
    for variant in (kw, {}) if kw else (kw,):
        try:
            prompt = _render(tok, msgs[:i], True, chat_template, variant) if i > 0 else None
        except Exception:  # noqa: BLE001
            prompt = None
        if prompt is None:
            continue
        s = _common_prefix(prompt, full)
        if s == len(prompt) and lo <= s <= body_end:
            return s
        # a partial match is usable only if it diverges inside the generation-prompt part
        if partial is None and lo <= s <= body_end and len(prompt) - s <= len(gen_suffix):
            partial = s
    if partial is not None:
        return partial
    if gen_suffix:
        p = full.rfind(gen_suffix, lo, body_end)
        if p >= 0:
            return p + len(gen_suffix)
    content = msgs[i]["content"]
    for c in (content, content.rstrip(), content.strip()):
        if c and body_end - len(c) >= lo and full[body_end - len(c) : body_end] == c:
            return body_end - len(c)
    return None


def _assistant_spans(tok, msgs, full, chat_template, kw, special_re, cut: Sequence[bool] = (),
                     gen_suffix: str | None = None) -> list[tuple[int, int, int]] | str:
    """Per assistant turn, (start, end, body end) in `full`: the turn is [start, end); a turn whose `cut` is True
    ends at its body end. `gen_suffix`: `_generation_suffix`'s answer when the caller has it already (a batch)."""
    asst = [i for i, m in enumerate(msgs) if m.get("role") == "assistant"]
    ends = _body_ends(tok, msgs, asst, full, chat_template, kw)
    if ends is None:
        return "assistant contents not found in the rendered text"
    if gen_suffix is None:
        gen_suffix = _generation_suffix(tok, chat_template, kw)
    header_tokens = set(special_re.findall(gen_suffix)) if special_re else set()
    spans, lo = [], 0
    for k, i in enumerate(asst):
        start = _turn_start(tok, msgs, i, full, lo, ends[k], gen_suffix, chat_template, kw)
        if start is None:
            return f"start of assistant turn {k} not found"
        stop = ends[k]
        ws = _WS.match(full, stop).end()
        m = special_re.match(full, ws) if special_re else None
        if m and m.group(0) not in header_tokens and not (k < len(cut) and cut[k]):
            stop = m.end()
        spans.append((start, stop, ends[k]))
        lo = stop
    return spans


def _mask_from_spans(offsets, spans, full) -> np.ndarray:
    """bool [tokens]: the tokens overlapping a span [start, end) (module doc: a token that starts before its span
    counts only if that part is whitespace). The tokens go through the spans with one pointer that never moves
    back: token t looks at the first span ending after the start of any token up to t (a running maximum)."""
    import numpy as np

    offs = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not spans or not len(offs):
        return np.zeros(len(offs), dtype=bool)
    a, b = offs[:, 0], offs[:, 1]
    starts = np.array([s for s, _, _ in spans], dtype=np.int64)
    ends = np.array([e for _, e, _ in spans], dtype=np.int64)
    j = np.maximum.accumulate(np.searchsorted(ends, a, side="right"))
    inside = j < len(spans)
    j = np.minimum(j, len(spans) - 1)
    s, e = starts[j], ends[j]
    mask = inside & (b > s) & (a < e)
    for t in np.flatnonzero(mask & (a < s)):  # starts before its span: only over whitespace
        mask[t] = not full[a[t]:s[t]].strip()
    return mask


@dataclass
class _LaidOut:
    """A conversation as rendered, before tokenization: its text, its assistant turns' (start, end, body end) in it,
    the generated ids to splice in as (char start, char end, ids), and the turns whose ids found no place."""
    full: str
    spans: list[tuple[int, int, int]]
    regions: list[tuple[int, int, list[int]]]
    missing: int


def _check_renderable(tokenizer, chat_template: str | None) -> None:
    """Setup errors, not bad records: a slow tokenizer (no character offsets) or no chat template at all."""
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError("render_conversation needs a fast tokenizer (character offsets)")
    tokenizer.get_chat_template(chat_template)


def _lay_out(tokenizer, messages: Sequence[MessageLike], chat_template: str | None, kw: dict[str, Any],
             special_re: re.Pattern | None, gen_suffix: str | None = None) -> _LaidOut | Dropped:
    """Steps 1-5 of the module doc up to the tokenization: the rendered text and where its assistant turns are."""
    msgs = _as_dicts(messages)
    if not any(m.get("role") == "assistant" for m in msgs):
        return Dropped("no_assistant")
    if special_re:
        for m in msgs:
            for key in ("content", "reasoning_content", "thinking"):
                hit = special_re.search(m.get(key) or "")
                if hit:
                    return Dropped("control_token_in_text", f"{m['role']} contains {hit.group(0)!r}")
    try:
        full = _render(tokenizer, msgs, False, chat_template, kw)
    except Exception as err:  # noqa: BLE001 - templates raise on inputs they refuse
        return Dropped("template_error", f"{type(err).__name__}: {err}")
    cut = [bool(m.cut if isinstance(m, Message) else m.get("cut")) for m in messages if _role(m) == "assistant"]
    spans = _assistant_spans(tokenizer, msgs, full, chat_template, kw, special_re, cut, gen_suffix)
    if isinstance(spans, str):
        return Dropped("template_mismatch", spans)
    generated = [(k, _generated_ids(m)) for k, m in enumerate(m for m in messages if _role(m) == "assistant")]
    asst = [m for m in msgs if m.get("role") == "assistant"]
    regions = [(e - len(asst[k]["content"]), e, g) for k, g in generated if g
               for e in [spans[k][2]] if full[e - len(asst[k]["content"]):e] == asst[k]["content"]]
    missing = sum(1 for _, g in generated if g) - len(regions)  # content not found as rendered (a trimming template)
    return _LaidOut(full, spans, regions, missing)


def render_conversation(
    tokenizer,
    messages: Sequence[MessageLike],
    *,
    max_len: int,
    overflow: Literal["truncate", "drop"] = "truncate",
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> RenderedSample | Dropped:
    """Tokenize a conversation with the template and mask its assistant turns (see module doc).

    `template_kwargs` go to the template (e.g. ``{"enable_thinking": False}`` for Qwen3,
    ``{"reasoning_effort": "low"}`` for gpt-oss).
    """
    if overflow not in ("truncate", "drop"):
        raise ValueError(f"overflow must be 'truncate' or 'drop', got {overflow!r}")
    _check_renderable(tokenizer, chat_template)
    kw = dict(template_kwargs or {})
    laid_out = _lay_out(tokenizer, messages, chat_template, kw, _special_regex(_special_strings(tokenizer)))
    if isinstance(laid_out, Dropped):
        return laid_out
    full, spans, regions, missing = laid_out.full, laid_out.spans, laid_out.regions, laid_out.missing
    # the whole text when ids are spliced in: the prefix shortcut's count would not hold after the splice
    ids, offsets, n = _tokenize(tokenizer, full, max_len if not regions else None)
    mask = _mask_from_spans(offsets, spans, full).astype(int).tolist()
    if regions:
        ids, mask, left = _splice_generated(ids, offsets, mask, regions)
        missing, n = missing + left, len(ids)
    if n is None or n > max_len:
        if overflow == "drop":
            return Dropped("too_long", f"{n or 'more than ' + str(max_len)} tokens > {max_len}")
        ids, mask = ids[:max_len], mask[:max_len]
    if not any(mask):
        return Dropped("no_assistant_tokens", f"no assistant token within the first {max_len} tokens")
    truncated = n is None or n > max_len
    return RenderedSample(ids, mask, [full[s:e] for s, e, _ in spans], truncated=truncated, full_length=n,
                          retokenized_turns=missing)


def assistant_token_counts(
    tokenizer,
    conversations: Sequence[Sequence[MessageLike]],
    *,
    max_len: int,
    vocab_size: int,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    one_by_one: bool = False,
) -> np.ndarray:
    """int64 [vocab_size] numpy array: how often each id occurs among the loss-masked tokens of `conversations`
    rendered by `render_conversation(..., max_len=max_len, overflow="truncate")`; a conversation it drops counts
    nothing. The draft vocabulary's dataset-wide count (data_prep/pipeline.py dataset_token_counts).

    The same text, spans, tokens and mask as render_conversation, for the whole batch at once: the generation
    prompt's text and the special-token pattern are found once, the texts are tokenized in one call, the mask and
    the count are computed on arrays. A conversation with generated ids (Message.token_ids) goes through
    render_conversation itself. `one_by_one`: render_conversation for every conversation and a torch bincount of
    each sample (the per-conversation path this count replaced, kept as its reference).
    """
    import numpy as np

    kw = dict(template_kwargs or {})
    counts = np.zeros(vocab_size, dtype=np.int64)
    if one_by_one:
        import torch

        for messages in conversations:
            sample = render_conversation(tokenizer, messages, max_len=max_len, chat_template=chat_template,
                                         template_kwargs=kw)
            if not isinstance(sample, Dropped):
                ids = torch.tensor(sample.input_ids)[torch.tensor(sample.loss_mask, dtype=torch.bool)]
                counts += torch.bincount(ids, minlength=vocab_size).numpy()
        return counts
    _check_renderable(tokenizer, chat_template)
    special_re = _special_regex(_special_strings(tokenizer))
    gen_suffix = _generation_suffix(tokenizer, chat_template, kw)
    laid_out, spliced = [], []
    for messages in conversations:
        one = _lay_out(tokenizer, messages, chat_template, kw, special_re, gen_suffix)
        if isinstance(one, Dropped):
            continue
        if one.regions:  # generated ids to splice in: the whole text is tokenized, by render_conversation
            sample = render_conversation(tokenizer, messages, max_len=max_len, chat_template=chat_template,
                                         template_kwargs=kw)
            if not isinstance(sample, Dropped):
                spliced.append(np.asarray(sample.input_ids)[np.asarray(sample.loss_mask, dtype=bool)])
            continue
        laid_out.append(one)
    masked = [np.asarray(ids[:max_len], dtype=np.int64)[_mask_from_spans(offsets[:max_len], one.spans, one.full)]
              for one, (ids, offsets, _) in zip(laid_out, _tokenize_many(tokenizer, [o.full for o in laid_out],
                                                                          max_len))]
    if masked or spliced:
        counts += np.bincount(np.concatenate(masked + spliced), minlength=vocab_size)
    return counts


def _tokenize(tok, text: str, max_len: int | None) -> tuple[list[int], list[tuple[int, int]], int | None]:
    """(ids, offsets, total token count or None if only a long-enough prefix was tokenized).

    Long conversations are truncated anyway, so only a prefix of the text is tokenized when that
    provably gives the same first `max_len` tokens: every token before the prefix's last
    pre-token (word) is unaffected by where the text was cut. `max_len` None: the whole text.
    """
    return _tokenize_many(tok, [text], max_len)[0]


def _tokenize_many(tok, texts: Sequence[str],
                   max_len: int | None) -> list[tuple[list[int], list[tuple[int, int]], int | None]]:
    """`_tokenize` of each text, in one call of the fast tokenizer per pass (the long texts' prefixes, then
    the texts tokenized whole): a batch costs one crossing into the tokenizer's Rust, not one per text."""
    cut = 6 * (max_len or 0) + 256  # chars; typical text has 3-5 chars per token
    out: list[tuple[list[int], list[tuple[int, int]], int | None] | None] = [None] * len(texts)
    long = [i for i, text in enumerate(texts) if max_len is not None and len(text) > cut + cut // 2]
    if long:
        enc = tok([texts[i][:cut] for i in long], add_special_tokens=False, return_offsets_mapping=True)
        for k, i in enumerate(long):
            words = enc.word_ids(k)
            if words and words[-1] is not None and words.index(words[-1]) > max_len:
                out[i] = (list(enc["input_ids"][k]), list(enc["offset_mapping"][k]), None)
    whole = [i for i, o in enumerate(out) if o is None]
    if whole:
        enc = tok([texts[i] for i in whole], add_special_tokens=False, return_offsets_mapping=True)
        for k, i in enumerate(whole):
            ids = list(enc["input_ids"][k])
            out[i] = (ids, list(enc["offset_mapping"][k]), len(ids))
    return out


def render_prompt(
    tokenizer,
    messages: Sequence[MessageLike],
    *,
    chat_template: str | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of `messages` + the generation prompt: what the model continues from."""
    text = _render(tokenizer, _as_dicts(messages), True, chat_template, dict(template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def end_of_turn(
    tokenizer, *, chat_template: str | None = None, template_kwargs: Mapping[str, Any] | None = None
) -> str | None:
    """The text the template puts after a FINAL assistant turn (e.g. '<|im_end|>', '<|return|>').

    Discovered by rendering a probe; this is the token a model emits to stop, so generation can use
    it as a stop token. None when the template ends turns with no special token.
    """
    probe = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
    ]
    kw = dict(template_kwargs or {})
    full = _render(tokenizer, probe, False, chat_template, kw)
    special_re = _special_regex(_special_strings(tokenizer))
    spans = _assistant_spans(tokenizer, probe, full, chat_template, kw, special_re)
    if isinstance(spans, str) or not special_re:
        return None
    start, stop, _ = spans[-1]
    m = special_re.search(full, start, stop)
    last = None
    while m:  # the last special token inside the span is the end of turn
        last, m = m.group(0), special_re.search(full, m.end(), stop)
    return last if last and full[start:stop].endswith(last) else None


def template_hash(tokenizer, chat_template: str | None = None) -> str:
    """Short sha256 of the chat template text and the special tokens it can refer to."""
    template = tokenizer.get_chat_template(chat_template)
    payload = dumps({"template": template, "special": tokenizer.special_tokens_map}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tokenizer_hash(tokenizer) -> str:
    """Short sha256 of the tokenizer's vocabulary and rules (what a prep's shards and an export record)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    payload = backend.to_str() if backend is not None else dumps(tokenizer.get_vocab(), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def resolve_chat_template(value: str | None) -> str | None:
    """The `chat_template=` option of prep and eval: the text of the file it names, or the template itself
    (None: not given). Text that names no file and holds no Jinja tag is a mistyped path, not a template."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except (OSError, ValueError):  # a long template is no valid path
        pass
    if "{{" not in value and "{%" not in value:
        raise FileNotFoundError(f"chat_template={value!r}: no such file, and not a Jinja template either "
                                "(no '{{' or '{%')")
    return value


def use_chat_template(tokenizer, value: str | None, owner: str):
    """`tokenizer` with the `chat_template=` option (`resolve_chat_template`) as its template; a tokenizer
    left without one (a base model's) is an error that names the option. Returns the tokenizer."""
    template = resolve_chat_template(value)
    if template is not None:
        tokenizer.chat_template = template
    if not tokenizer.chat_template:
        raise ValueError(f"{owner}: the tokenizer has no chat template (a base model?). Give one with "
                         "chat_template=<file or template string> (launch/prep.py and launch/eval.py; make prep/eval "
                         "ARGS=\"chat_template=<file>\")")
    return tokenizer


def stop_token_ids(model, tokenizer, template_kwargs: dict | None = None) -> tuple[int, ...]:
    """Where a reply of `model` ends, for decoding that is not prep's regeneration (evaluation, on-policy rollouts):
    the generation config's and the tokenizer's EOS ids, and the chat template's end-of-turn token."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for src in (gen_eos, tokenizer.eos_token_id):
        if src is None:
            continue
        ids.extend(src if isinstance(src, (list, tuple)) else [src])
    try:
        eot = end_of_turn(tokenizer, template_kwargs=template_kwargs)
    except ValueError:
        eot = None
    if eot:
        eot_ids = tokenizer.convert_tokens_to_ids([eot])
        if eot_ids and eot_ids[0] is not None and eot_ids[0] != tokenizer.unk_token_id:
            ids.append(eot_ids[0])
    return tuple(dict.fromkeys(int(i) for i in ids))
