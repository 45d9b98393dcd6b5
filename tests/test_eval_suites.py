"""Evaluation per suite and category: the shipped suites, their validation, the per-category report with its
bootstrap intervals, the predicted speedup, and the engine's counters read as ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eval.prompts import SUITES, PromptsError, Suite, load_prompts
from infra.config_keys import ConfigError

REPO = Path(__file__).resolve().parents[1]

EXPECTED = {  # suite -> {category: prompts}, as each package ships them
    "mtbench": {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                "humanities")},
    "humaneval": {"python": 164},
    "gsm8k": {"grade_school": 100},
    "math": {"AIME2024": 30, "AIME2025": 15, "CNMO": 18, "MATH500": 311},
    "squad": {"answerable": 5928, "unanswerable": 5945},
    "hotpotqa": {"comparison": 1487, "bridge": 5918},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_suite_loads_from_its_package_with_its_categories(name: str) -> None:
    recs = load_prompts(name)
    counts: dict[str, int] = {}
    for r in recs:
        counts[r.category] = counts.get(r.category, 0) + 1
    assert counts == EXPECTED[name]
    assert {r.suite for r in recs} == {name} and all(r.turns and all(t.strip() for t in r.turns) for r in recs)
    assert len({r.id for r in recs}) == len(recs)  # ids name prompts within a suite
    assert all(len(r.turns) == (2 if name == "mtbench" else 1) for r in recs)


def test_suite_prompts_carry_the_problem() -> None:
    he = load_prompts("humaneval", per_category=1)[0]
    assert he.id == "HumanEval/0" and "def has_close_elements" in he.turns[0] and "```python" in he.turns[0]
    sq = load_prompts("squad", per_category=1)
    assert [r.category for r in sq] == ["answerable", "unanswerable"]
    assert "Passage: " in sq[0].turns[0] and "Question: In what country is Normandy located?" in sq[0].turns[0]
    hp = load_prompts("hotpotqa", per_category=1)[0]
    assert hp.turns[0].count("\n## ") >= 2 and hp.turns[0].endswith("?")


def test_num_prompts_caps_every_category_and_lists_and_all_combine() -> None:
    two = load_prompts("mtbench", per_category=2, max_turns=1)
    assert len(two) == 16 and all(len(r.turns) == 1 for r in two)
    assert [r.category for r in two][:4] == ["writing", "writing", "roleplay", "roleplay"]
    both = load_prompts("gsm8k,humaneval", per_category=3)
    assert [r.suite for r in both] == ["gsm8k"] * 3 + ["humaneval"] * 3
    every = load_prompts("all", per_category=1)
    assert [(r.suite, r.category) for r in every] == [(s, c) for s, cats in EXPECTED.items() for c in cats]


def test_unknown_suites_are_named() -> None:
    with pytest.raises(PromptsError, match=r"\['nope'\] are not suites"):
        load_prompts("mtbench,nope")
    with pytest.raises(PromptsError, match="neither a suite"):
        load_prompts("nope")


def _fake_suite(tmp_path: Path, monkeypatch, name: str, file: str, content: bytes, **kw) -> None:
    pkg = tmp_path / f"fakesuite_{name}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / file).write_bytes(content)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(SUITES, name, Suite(name, pkg.name, "fakesuite", file, "test", **kw))


def test_a_broken_suite_record_names_its_file_and_line(tmp_path, monkeypatch) -> None:
    from eval.prompts import _humaneval

    good = [json.dumps({"task_id": t, "prompt": "def f():\n"}) for t in "ab"]
    _fake_suite(tmp_path, monkeypatch, "codex", "data.jsonl",
                f"{good[0]}\n{good[1]}\n{json.dumps({'task_id': 'c', 'prompt': '  '})}\n".encode(), to_record=_humaneval)
    with pytest.raises(PromptsError, match=r"data\.jsonl:3: 'prompt' must be a non-empty string"):
        load_prompts("codex", per_category=1)  # a cap does not skip the check of later records
    from eval.prompts import _listed, _math

    _fake_suite(tmp_path, monkeypatch, "mathx", "en.json",
                json.dumps([{"gid": 1, "data_source": "X", "question": "1+1?"}, {"gid": 2, "data_source": "X"}]).encode(),
                to_record=_math, records=_listed)
    with pytest.raises(PromptsError, match=r"en\.json record 1: 'prompt' must be a non-empty string"):
        load_prompts("mathx")
    _fake_suite(tmp_path, monkeypatch, "mathy", "en.json", b'{"not": "a list"}', to_record=_math, records=_listed)
    with pytest.raises(PromptsError, match=r"en\.json: not the mathy file this loader reads"):
        load_prompts("mathy")
    monkeypatch.setitem(SUITES, "gone", Suite("gone", "no_such_package_here", "gone==1", "x.jsonl", "test"))
    with pytest.raises(PromptsError, match="pip install --no-deps gone==1"):
        load_prompts("gone")


def test_a_repeated_prompt_id_is_refused_naming_file_and_lines(tmp_path, monkeypatch) -> None:
    f = tmp_path / "mine.jsonl"
    f.write_text('{"id": "a", "prompt": "x"}\n\n{"id": "b", "prompt": "y"}\n{"id": "a", "prompt": "z"}\n')
    with pytest.raises(PromptsError, match=rf"{f}:4: prompt id 'a' is already that of line 1"):
        load_prompts(str(f))
    f.write_text('{"id": 3, "prompt": "x"}\n{"prompt": "y"}\n{"prompt": "z"}\n')  # no id: named by its line
    with pytest.raises(PromptsError, match=rf"{f}:3: prompt id '3' is already that of line 1"):
        load_prompts(str(f))
    from eval.prompts import _listed, _math

    _fake_suite(tmp_path, monkeypatch, "mathz", "en.json", json.dumps(
        [{"gid": 1, "data_source": "X", "question": "1+1?"}, {"gid": 1, "data_source": "Y", "question": "2+2?"}]
    ).encode(), to_record=_math, records=_listed)
    with pytest.raises(PromptsError, match=r"en\.json record 1: prompt id '1' is already that of record 0"):
        load_prompts("mathz")


@pytest.mark.parametrize(("record", "message"), [
    ({"prompt": "x", "category": ["math", "code"]}, """'category' must be a non-empty string, got ["math", "code"]"""),
    ({"prompt": "x", "category": 3}, "'category' must be a non-empty string, got 3"),
    ({"prompt": "x", "category": " "}, "'category' must be a non-empty string"),
    ({"prompt": "x", "id": {"n": 1}}, "a prompt's id must be a non-empty string or an integer"),
], ids=["list", "number", "blank", "dict-id"])
def test_a_category_or_id_that_is_no_name_is_refused(tmp_path, record: dict, message: str) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": "ok", "prompt": "fine", "category": "c"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(PromptsError) as e:
        load_prompts(str(f))
    assert str(e.value).startswith(f"{f}:2: ") and message in str(e.value), str(e.value)


def test_bootstrap_interval() -> None:
    from eval.categories import bootstrap_tau_ci

    assert bootstrap_tau_ci([(30, 10)] * 5) == pytest.approx([3.0, 3.0])  # no spread between prompts
    # τ 1, 2, 3, 4, 5 with equal weight: pooled 3; the resampled means spread about ± 1.96 · 1.41 / sqrt(5) = ± 1.24
    lo, hi = bootstrap_tau_ci([(10 * t, 10) for t in (1, 2, 3, 4, 5)])
    assert 1.7 < lo < 2.0 and 4.0 < hi < 4.3
    # pooled 2.15; prompts 1.2 .. 3.1: standard error 0.577 / sqrt(20) = 0.129, so about 2.15 ± 0.25
    lo, hi = bootstrap_tau_ci([(12 + i, 10) for i in range(20)])
    assert 1.85 < lo < 1.95 and 2.35 < hi < 2.45
    assert bootstrap_tau_ci([(12 + i, 10) for i in range(20)]) == [lo, hi]  # seeded
    assert bootstrap_tau_ci([]) is None and bootstrap_tau_ci([(0, 0)] * 5) is None
    # under 5 prompts, no interval: two prompts (τ 1 and 4) have 3 distinct resamples, whose "percentiles" are
    # the two prompts' own τ; four have 35
    assert bootstrap_tau_ci([(10, 10), (40, 10)]) is None and bootstrap_tau_ci([(30, 10)] * 4) is None


def test_a_category_of_few_prompts_has_no_interval_and_no_gap_verdict() -> None:
    from eval.categories import acceptance_of, categories_markdown
    from eval.spec_decode import GenerationRecord

    def rec(accepts: list[int]) -> GenerationRecord:
        return GenerationRecord(0, [1] * (sum(accepts) + len(accepts)), "length", 1.0, len(accepts) + 1, accepts,
                                [len(accepts)], [sum(a > 0 for a in accepts)])

    samples = [{"suite": "s", "category": "c", "id": str(i), "turn": 0} for i in range(5)]
    spec = [rec([a, a]) for a in (0, 1, 2, 1, 0)]
    five = acceptance_of(samples, spec, range(5), 1)
    four = acceptance_of(samples, spec, range(4), 1)
    assert five["prompts"] == 5 and five["tau_ci95"] is not None and five["tau_ci95"][0] <= five["tau"]
    assert four["prompts"] == 4 and four["tau_ci95"] is None and four["tau"] == pytest.approx(2.0)
    entry = {"suite": "s", "category": "c", "turns": 4, **four, "identical": None, "oov_rate": 0.0,
             "tokens_per_s": {"speculative": 1.0, "baseline": 1.0}, "speedup": 1.0,
             "engine": {"tau": 9.0, "alpha": [0.5], "tokens_per_s": {"speculative": 1.0, "baseline": 1.0}}}
    row = categories_markdown([entry]).splitlines()[2]
    assert row.startswith("| s | c | 4 | 2.000 [n<5] |") and row.endswith("| n<5 |") and "outside CI" not in row


def test_engine_counters_read_as_our_definitions() -> None:
    from eval.engine import acceptance, spec_counters

    text = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 100.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 300.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 90.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 50.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 30.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 10.0',
    ])
    before = spec_counters("")
    got = acceptance(before, spec_counters(text), 3)
    # τ = 1 + 90 / 100; α_0 = 50/100, α_1 = 30/50, α_2 = 10/30 (conditional on every earlier draft accepted)
    assert got["tau"] == pytest.approx(1.9) and got["alpha"] == pytest.approx([0.5, 0.6, 1 / 3])
    assert (got["drafts"], got["accepted"]) == (100, 90)
    assert acceptance(spec_counters(text), spec_counters(text), 3) == {"tau": None, "alpha": [None] * 3,
                                                                      "drafts": 0, "accepted": 0}


def test_gap_flag_and_tables() -> None:
    from eval.categories import categories_markdown, tau_outside_interval

    entry = {"suite": "s", "category": "c", "turns": 4, "tau": 1.5, "tau_ci95": [1.4, 1.6], "alpha": [0.5, None],
             "identical": {"count": 4, "of": 4}, "oov_rate": 0.1, "tokens_per_s": {"speculative": 10.0, "baseline": 12.0},
             "speedup": 10 / 12, "speedup_predicted": 0.9, "engine": {"tau": 1.55, "alpha": [0.55, 0.3],
                                                                        "tokens_per_s": {"speculative": 9.0, "baseline": 8.0}}}
    assert tau_outside_interval(entry) is False
    assert tau_outside_interval({**entry, "tau_ci95": [1.55 + 1e-12, 1.55 + 1e-12]}) is False  # equal, but for rounding
    far = {**entry, "engine": {**entry["engine"], "tau": 1.7}}
    assert tau_outside_interval(far) is True
    assert tau_outside_interval({**far, "tau_ci95": None}) is None  # no interval: not judged
    assert tau_outside_interval({**entry, "engine": {**entry["engine"], "tau": None}}) is None
    table = categories_markdown([entry, far]).splitlines()
    assert table[2].startswith("| s | c | 4 | 1.500 [1.40, 1.60] | 0.50 – | 4/4 | 0.100 | 10.0 | 12.0 | 0.833 (0.900) ")
    assert table[2].endswith("| 9.0 / 8.0 |  |") and table[3].endswith("**outside CI** |")


def test_predicted_speedup_from_the_verify_cost() -> None:
    from eval.budget import CycleCost

    cost = CycleCost({1: 0.010, 4: 0.012, 16: 0.030, 64: 0.100}, overhead_s=0.004)
    # τ 2 per cycle of verify(4) + overhead = 0.016 s against 0.010 s a plain token
    assert cost.predicted_speedup(2.0, 4) == pytest.approx(2.0 * 0.010 / 0.016)
    # 4 sequences: 16 tokens a verify; the overhead scaled by T(4)/T(1)
    assert cost.predicted_speedup(2.0, 4, concurrency=4) == pytest.approx(2.0 * 0.012 / (0.030 + 0.004 * 1.2))
    assert cost.predicted_speedup(2.0, 4, concurrency=16) == pytest.approx(2.0 * 0.030 / (0.100 + 0.004 * 3.0))
    assert cost.predicted_speedup(2.0, 4, concurrency=64) is None  # T(256) was not measured
    assert cost.predicted_speedup(2.0, 4, concurrency=4, drafting=False) == pytest.approx(2.0 * 0.012 / 0.030)
    assert cost.predicted_speedup(None, 4) is None


def test_engine_needs_a_chain_and_sweeps_need_the_engine() -> None:
    from eval.config import DecodeConfig, EngineVLLMConfig, EvalConfig

    with pytest.raises(ValueError, match="decode.mode=chain"):
        EvalConfig(drafter="d", out_dir="o", engine="vllm").validate()
    with pytest.raises(ValueError, match="set engine=vllm"):
        EvalConfig(drafter="d", out_dir="o", vllm=EngineVLLMConfig(concurrency=[1, 4])).validate()
    with pytest.raises(ValueError, match="engine must be none|vllm"):
        EvalConfig(drafter="d", out_dir="o", engine="sglang").validate()
    EvalConfig(drafter="d", out_dir="o", engine="vllm", decode=DecodeConfig(mode="chain", depth=3),
               vllm=EngineVLLMConfig(concurrency=[1, 4, 16, 64], num_speculative_tokens=[1, 2])).validate()


def test_load_requests_cycle_the_first_turns() -> None:
    from eval.config import EngineVLLMConfig
    from eval.engine import load_prompts_for

    first = [[1], [2], [3]]
    assert load_prompts_for(first, 1, EngineVLLMConfig()) == [[1], [2], [3], [1], [2], [3], [1], [2]]
    assert len(load_prompts_for(first, 64, EngineVLLMConfig())) == 128
    assert torch.tensor([len(x) for x in load_prompts_for(first, 4, EngineVLLMConfig(load_rounds=3))]).sum() == 12


def test_a_prompt_too_long_for_the_engine_stops_before_decoding(smollm2_dir: Path) -> None:
    from transformers import AutoTokenizer

    from eval.prompts import PromptRecord
    from eval.run import check_engine_lengths

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    short = PromptRecord("a", ["Hi", "More"], "c", suite="s")
    check_engine_lengths([short], tok, {}, 100, 1024)
    long = PromptRecord("b", ["word " * 1500], "c", suite="s")  # about 1,500 tokens before its answer
    with pytest.raises(ConfigError, match=r"prompt s/b \(c\) needs up to \d+ tokens .* vllm.max_model_len=1024"):
        check_engine_lengths([short, long], tok, {}, 100, 1024)
