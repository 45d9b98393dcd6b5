"""data_prep.conversations: schemas, file formats, bad-record accounting, truncated JSON, splitting."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

import data_prep.conversations as conv_mod
from data_prep.conversations import (
    Conversation,
    Message,
    load_conversations,
    split_conversations,
)


def sharegpt(i: int, n_pairs: int = 1, **extra) -> dict:
    turns = []
    for k in range(n_pairs):
        turns += [
            {"from": "human", "value": f"question {i}.{k}"},
            {"from": "gpt", "value": f"answer {i}.{k}"},
        ]
    return {"id": f"sg{i}", "conversations": turns, **extra}


def openai_rec(i: int) -> dict:
    return {
        "prompt_id": f"oa{i}",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"hi {i}"},
            {"role": "assistant", "content": f"hello {i}"},
        ],
    }


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_sharegpt_json_roles_normalised(tmp_path: Path) -> None:
    rec = {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "sys"},
            {"from": "human", "value": "a"},
            {"from": "chatgpt", "value": "b"},
            {"from": "user", "value": "c"},
            {"from": "bing", "value": "d"},
            {"from": "human", "value": "e"},
            {"from": "bard", "value": "f"},
            {"from": "HUMAN", "value": "g"},
            {"from": "assistant", "value": "h"},
        ],
    }
    path = tmp_path / "d.json"
    path.write_text(json.dumps([rec, sharegpt(1)], indent=2))
    convs, rep = load_conversations(str(path))
    assert [c.id for c in convs] == ["x", "sg1"]
    assert [m.role for m in convs[0].messages] == ["system"] + ["user", "assistant"] * 4
    assert convs[0].messages[0] == Message("system", "sys")
    assert "".join(m.content for m in convs[0].messages[1:]) == "abcdefgh"
    assert convs[0].source == str(path)
    assert (rep.records, rep.kept, sum(rep.skipped.values())) == (2, 2, 0)


def test_openai_jsonl_and_text_parts(tmp_path: Path) -> None:
    parts = {
        "id": "p",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
            {"role": "assistant", "content": "C"},
        ],
    }
    path = write_jsonl(tmp_path / "d.jsonl", [openai_rec(0), parts, openai_rec(1)])
    convs, rep = load_conversations(str(path))
    assert [c.id for c in convs] == ["oa0", "p", "oa1"]
    assert [(m.role, m.content) for m in convs[0].messages] == [
        ("system", "be brief"),
        ("user", "hi 0"),
        ("assistant", "hello 0"),
    ]
    assert convs[1].messages[0].content == "A\nB"
    assert rep.kept == 3


def test_parquet(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [openai_rec(i) for i in range(5)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    convs, rep = load_conversations(str(path))
    assert [c.id for c in convs] == [f"oa{i}" for i in range(5)]
    assert convs[3].messages[2] == Message("assistant", "hello 3")
    assert (rep.records, rep.kept) == (5, 5)


def test_every_bad_record_reason_is_counted(tmp_path: Path) -> None:
    records = [
        sharegpt(0),
        "{not json",
        '"a string"',
        {"id": "nomsg", "text": "hello"},
        {"id": "mal", "conversations": "hello"},
        {"id": "empty", "conversations": []},
        {"id": "turn", "conversations": ["hello"]},
        {"id": "role", "conversations": [{"from": "human", "value": "q"}, {"from": "tool", "value": "t"}]},
        {"id": "img", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        {"id": "nulltext", "messages": [{"role": "user", "content": None}]},
        {"id": "blank", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "  \n"}]},
        {"id": "noasst", "conversations": [{"from": "human", "value": "q"}]},
        {
            "id": "onlyleading",
            "conversations": [{"from": "gpt", "value": "a"}, {"from": "human", "value": "q"}],
        },
        {**sharegpt(0), "id": "dupcontent"},  # same messages as the first record
        # fixes, not skips:
        {
            "id": "lead",
            "conversations": [
                {"from": "gpt", "value": "x"},
                {"from": "human", "value": "q"},
                {"from": "gpt", "value": "a"},
            ],
        },
        {
            "id": "trail",
            "conversations": [
                {"from": "human", "value": "q2"},
                {"from": "gpt", "value": "a2"},
                {"from": "human", "value": "more?"},
            ],
        },
        {"conversations": [{"from": "human", "value": "no id"}, {"from": "gpt", "value": "ok"}]},
        {**sharegpt(5), "id": "sg0"},  # repeated id, different content
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    convs, rep = load_conversations(str(path))
    assert rep.skipped == Counter(
        bad_json=1,
        not_a_dict=1,
        no_messages=1,
        malformed_messages=1,
        empty=1,
        malformed_turn=1,
        unknown_role=1,
        non_text_content=2,
        empty_content=1,
        no_assistant=2,
        duplicate=1,
    )
    assert rep.fixed == Counter(
        dropped_leading_assistant=2, dropped_trailing_user=1, derived_id=1, renamed_duplicate_id=1
    )
    assert rep.records == len(records) and rep.kept == len(convs) == 5
    by_id = {c.id: c for c in convs}
    assert [m.role for m in by_id["lead"].messages] == ["user", "assistant"]
    assert [m.content for m in by_id["trail"].messages] == ["q2", "a2"]
    derived = [c for c in convs if c.id.startswith("h")]
    assert len(derived) == 1 and len(derived[0].id) == 17
    assert "sg0#2" in by_id and by_id["sg0#2"].messages[0].content == "question 5.0"
    ex = {e.reason: e for e in rep.examples}
    assert (ex["bad_json"].index, ex["bad_json"].unit) == (2, "line") and ex["bad_json"].file == str(path)
    assert "at column 2" in ex["bad_json"].detail  # the decoder's message with its place, not cut
    assert ex["unknown_role"].index == 8 and "tool" in ex["unknown_role"].detail  # 1-based line numbers
    assert "bad_json" in rep.summary() and rep.to_dict()["skipped"]["duplicate"] == 1
    # the derived id is stable across loads
    again, _ = load_conversations(str(path))
    assert [c.id for c in again] == [c.id for c in convs]


@pytest.mark.parametrize("chunk", [64, 1 << 22])
def test_truncated_json_array_recovers_complete_records(tmp_path: Path, monkeypatch, chunk: int) -> None:
    monkeypatch.setattr(conv_mod, "_CHUNK", chunk)  # small chunks: records cross buffer ends
    records = [sharegpt(i, n_pairs=1 + i % 3) for i in range(50)]
    text = json.dumps(records, indent=2)
    cut = text.index('"sg37"') + 40  # inside record 37
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    with pytest.raises(json.JSONDecodeError):
        json.loads(path.read_text())
    convs, rep = load_conversations(str(path))
    assert [c.id for c in convs] == [f"sg{i}" for i in range(37)]
    assert convs[36].messages[-1].content == "answer 36.0"
    assert rep.skipped == Counter(truncated_tail=1) and rep.records == 38


def test_directory_and_max_records(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.json").write_text(json.dumps([sharegpt(i) for i in range(3)]))
    write_jsonl(tmp_path / "sub" / "b.jsonl", [openai_rec(i) for i in range(4)])
    (tmp_path / "notes.txt").write_text("ignored")
    convs, rep = load_conversations(str(tmp_path))
    assert len(convs) == 7 and {c.source for c in convs} == {
        str(tmp_path / "a.json"),
        str(tmp_path / "sub" / "b.jsonl"),
    }
    few, rep = load_conversations(str(tmp_path), max_records=4)
    assert [c.id for c in few] == ["sg0", "sg1", "sg2", "oa0"] and rep.kept == 4


def test_missing_sources_fail_clearly(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(FileNotFoundError):
        load_conversations(str(tmp_path / "nope.jsonl"))
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(RuntimeError, match="could not load hub dataset 'nobody-xyz/no-such-data'"):
        load_conversations("nobody-xyz/no-such-data")


def test_conversation_dict_round_trip() -> None:
    c = Conversation("i", [Message("user", "q"), Message("assistant", "a", reasoning="r")], "src")
    assert Conversation.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.messages[1].to_dict() == {
        "role": "assistant",
        "content": "a",
        "reasoning_content": "r",
        "thinking": "r",
    }


def _convs(n: int) -> list[Conversation]:
    return [Conversation(f"id{i}", [Message("user", "q"), Message("assistant", "a")], "s") for i in range(n)]


def test_split_is_deterministic_and_order_and_size_independent() -> None:
    convs = _convs(2000)
    train, evals = split_conversations(convs, eval_fraction=0.1, seed=3)
    assert len(train) + len(evals) == 2000 and 150 < len(evals) < 250
    assert not {c.id for c in train} & {c.id for c in evals}
    assert [c.id for c in train] == [c.id for c in convs if c in train]  # input order kept
    shuffled = convs[:]
    random.Random(0).shuffle(shuffled)
    _, ev2 = split_conversations(shuffled, eval_fraction=0.1, seed=3)
    assert {c.id for c in ev2} == {c.id for c in evals}
    _, ev_sub = split_conversations(convs[:500], eval_fraction=0.1, seed=3)  # fewer samples: same membership
    assert {c.id for c in ev_sub} == {c.id for c in evals if int(c.id[2:]) < 500}
    _, ev_seed = split_conversations(convs, eval_fraction=0.1, seed=4)
    assert {c.id for c in ev_seed} != {c.id for c in evals}


def test_split_by_count() -> None:
    convs = _convs(300)
    train, evals = split_conversations(convs, eval_count=25, seed=0)
    assert len(evals) == 25 and len(train) == 275
    shuffled = list(reversed(convs))
    _, ev2 = split_conversations(shuffled, eval_count=25, seed=0)
    assert {c.id for c in ev2} == {c.id for c in evals}
    with pytest.raises(ValueError):
        split_conversations(convs, eval_fraction=0.1, eval_count=3)


@pytest.mark.integration
def test_embedded_sharegpt_truncated_file() -> None:
    convs, rep = load_conversations("sharegpt-embedded")
    # 17,671 complete records are recovered before the cut; the torn last one is reported
    assert rep.records == 17_672 and rep.skipped["truncated_tail"] == 1
    assert rep.records - rep.skipped["truncated_tail"] == 17_671
    assert rep.kept == len(convs) == 16_579
    assert rep.skipped == Counter(
        duplicate=743, no_assistant=153, empty=126, empty_content=70, truncated_tail=1
    )
    assert len({c.id for c in convs}) == len(convs)
    assert all(c.messages[-1].role == "assistant" for c in convs)
    assert all(next(m.role for m in c.messages if m.role != "system") == "user" for c in convs)
    assert convs[0].id == "QWJhYvA_0" and convs[0].source == "sharegpt-embedded"
