"""capture.one_pass: on the vLLM route with regeneration (regen.backend=vllm capture.engine=vllm), each regenerated
sample's features come from its final regeneration request (vLLM's `include_output_tokens`: the states of the
prompt and of every generated token but the last), with no prefill pass over it (data_prep/vllm_capture.py
OnePassCapture, one_pass_features).

Against tests/vllm_standin.py (every `make test`): the one-pass prep gives the two-pass prep's replies, samples and
features (fp32, stored bf16: a rounding apart) at every row an objective reads; the rows past the request's
last computed position are zeros and nothing after them is loss-masked; summary.json's `capture_pass` counts; a
sample the states do not cover (a multi-turn sample whose earlier reply the prompt re-tokenized) captured by the
prefill; a crash mid-regeneration resumed without a duplicate. The real engine: tests/test_prep_capture_vllm.py
test_real_vllm_one_pass_matches_two_passes (`make capture-check`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_prep
from vllm_standin import standin_python

from data_prep.rendered import Rendered
from data_prep.shards import ShardSet, completed_sample_ids
from data_prep.vllm_capture import one_pass_features
from infra.config_keys import ConfigError
from train.config import DataConfig
from train.data import check_loss_tokens

ROOT = Path(__file__).resolve().parents[1]
COMMON = {"num_samples": 6, "eval_samples": 2, "regen.max_new_tokens": 12, "regen.batch_size": 4,
          "capture.tap_layers": [1, 3, 7], "draft_vocab_count": "train", "dtype": "float32"}


@pytest.fixture
def data(tiny_target_dir: Path, tiny_sharegpt_file: Path) -> tuple[str, str]:
    return str(tiny_target_dir), str(tiny_sharegpt_file)


def _vllm(tmp_path: Path, **more) -> dict:
    return {**COMMON, "regen.backend": "vllm", "capture.engine": "vllm", "vllm.python": standin_python(tmp_path),
            **more}


def _samples(prep: Path, split: str) -> dict:
    return {s.sample_id: s for s in ShardSet(prep / split)}


def _replies(prep: Path) -> dict[str, list]:
    from data_prep.regenerate import read_results

    out = {}
    for path in sorted((prep / "regen").glob("*.jsonl")):
        for cid, rec in read_results(path).items():
            out[cid] = [(m["role"], m["content"], m.get("cut", False), m.get("token_ids")) for m in rec["messages"]]
    return out


def _zero_tail(sample) -> int:
    """Where the trailing rows of zeros start (len(sample) when there are none)."""
    rows = (sample.taps.float().abs().sum(-1) + sample.teacher_hidden.float().abs().sum(-1)) == 0
    start = len(sample)
    while start > 0 and rows[start - 1]:
        start -= 1
    return start


def _assert_read_rows_equal(one: Path, two: Path) -> int:
    """One-pass shards against two-pass shards: the same samples (ids, tokens, masks); every row an objective reads
    equal (fp32 forwards of other lengths, stored bf16: a rounding apart); the rows after them zeros, with nothing
    loss-masked past their first. Returns how many samples had such a tail."""
    tails = 0
    for split in ("train", "eval"):
        ours, ref = _samples(one, split), _samples(two, split)
        assert sorted(ours) == sorted(ref) and ours
        for sid, r in ref.items():
            o = ours[sid]
            assert torch.equal(o.input_ids, r.input_ids) and torch.equal(o.loss_mask, r.loss_mask)
            z = _zero_tail(o)
            # train/ttt.py: position j's teacher and the taps before it are read where loss_mask[j+1]
            assert not o.loss_mask[z + 1:].any(), (sid, z, o.loss_mask.tolist())
            tails += z < len(o)
            torch.testing.assert_close(o.taps[:z].float(), r.taps[:z].float(), atol=0, rtol=2 ** -7)
            torch.testing.assert_close(o.teacher_hidden[:z].float(), r.teacher_hidden[:z].float(), atol=0,
                                       rtol=2 ** -7)
    return tails


def test_one_pass_features_cover_what_the_objectives_read() -> None:
    hs = torch.arange(5 * 3 * 2, dtype=torch.float32).view(5, 3, 2) + 1  # 5 tokens, 3 aux ids, H=2
    ids = torch.tensor([10, 11, 12, 13, 14])  # prompt 10 11 12, reply 13 14 (and a last token never fed)
    columns, teacher = [0, 1], 2
    # the request's tokens, its last generated token (end of turn, masked) and a template tail (unmasked)
    sample = Rendered("a", torch.tensor([10, 11, 12, 13, 14, 2, 7]), torch.tensor([0, 0, 0, 1, 1, 1, 0]).bool())
    taps, final = one_pass_features(hs, ids, sample, columns, teacher)
    assert taps.shape == (7, 4) and final.shape == (7, 2)
    assert torch.equal(taps[:5], torch.cat([hs[:, 0], hs[:, 1]], -1)) and torch.equal(final[:5], hs[:, 2])
    assert not taps[5:].any() and not final[5:].any()  # not computed by the request: never read
    # cut by max_len inside the request's tokens: covered whole
    cut = Rendered("b", ids[:4], torch.tensor([0, 0, 0, 1]).bool())
    taps, final = one_pass_features(hs, ids, cut, columns, teacher)
    assert torch.equal(final, hs[:4, 2]) and taps.shape == (4, 4)
    # another token where the request had its own (a prompt that rendered an earlier turn otherwise): not covered
    other = Rendered("c", torch.tensor([10, 99, 12, 13, 14, 2, 7]), sample.loss_mask)
    assert one_pass_features(hs, ids, other, columns, teacher) is None
    # a loss-masked token past the request's last generated one: its teacher row would be read, not covered
    later = Rendered("d", sample.input_ids, torch.tensor([0, 0, 0, 1, 1, 1, 1]).bool())
    assert one_pass_features(hs, ids, later, columns, teacher) is None


def test_one_pass_equals_two_passes(tmp_path: Path, data, monkeypatch) -> None:
    two = tmp_path / "two"
    run_prep(two, *data, **_vllm(tmp_path, **{"capture.one_pass": False}))
    log = tmp_path / "asked.txt"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    one = tmp_path / "one"
    summary = run_prep(one, *data, **_vllm(tmp_path))
    lines = log.read_text().splitlines()
    # one request per reply; the probe's prefills, judged before the regeneration writes anything; no sample prefilled
    assert lines.count("capture sample") == 0 and lines.count("capture probe") == 2
    assert max(i for i, line in enumerate(lines) if line == "capture probe") < lines.index("generate")
    assert _replies(one) == _replies(two) and _replies(one)
    assert summary["capture_pass"] == {split: {"with_regeneration": n, "prefill": 0}
                                       for split, n in summary["samples"].items()}
    assert summary["one_pass"]["next_token_agreement"] == 1.0  # greedy: the head's choice is what vLLM generated
    assert summary["one_pass"]["not_covered"] == {"train": 0, "eval": 0}
    two_summary = json.loads((two / "summary.json").read_text())
    assert two_summary["capture_pass"] == {split: {"with_regeneration": 0, "prefill": n}
                                           for split, n in two_summary["samples"].items()}
    assert not two_summary["one_pass"]["enabled"]
    assert summary["samples"] == two_summary["samples"] and summary["tokens"] == two_summary["tokens"]
    # every sample ends with the end of turn and the template's newline, which the request never fed: zeros there
    assert _assert_read_rows_equal(one, two) == sum(summary["samples"].values())
    # so training refuses to make those rows loss rows (data.loss_tokens=all) on the one-pass prep alone
    with pytest.raises(ConfigError, match=rf"data.loss_tokens=all on {one}: {summary['samples']['train']} of its"):
        check_loss_tokens(DataConfig(dir=str(one), loss_tokens="all"))
    check_loss_tokens(DataConfig(dir=str(two), loss_tokens="all"))


def test_a_sample_the_states_do_not_cover_is_prefilled(tmp_path: Path, data, monkeypatch) -> None:
    """Two regenerated turns: the final request's prompt holds the first reply as text, re-tokenized, while the
    sample holds the ids the target generated; where they differ the states do not cover the sample, and the
    prefill captures it."""
    from data_prep.chat import render_prompt
    from data_prep.regenerate import load_regenerated
    from data_prep.targets import load_tokenizer, resolve_target

    more = {"regen.max_turns": 2, "max_len": 512}
    two = tmp_path / "two"
    run_prep(two, *data, **_vllm(tmp_path, **{"capture.one_pass": False}, **more))
    log = tmp_path / "asked.txt"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    one = tmp_path / "one"
    summary = run_prep(one, *data, **_vllm(tmp_path, **more))
    tok = load_tokenizer(resolve_target(data[0]), None)
    expected = {}
    for split in ("train", "eval"):
        convs = {c.id: c for path in (one / "regen").glob(f"{split}.r*.jsonl") for c in load_regenerated(path)}
        covered = 0
        for sid, s in _samples(one, split).items():
            last = max(i for i, m in enumerate(convs[sid].messages) if m.role == "assistant")
            prompt = render_prompt(tok, convs[sid].messages[:last])
            covered += s.input_ids[:len(prompt)].tolist() == prompt
        expected[split] = {"with_regeneration": covered, "prefill": summary["samples"][split] - covered}
    assert summary["capture_pass"] == expected
    prefilled = sum(e["prefill"] for e in expected.values())
    assert 0 < prefilled < sum(summary["samples"].values())  # both ways in one prep
    assert log.read_text().splitlines().count("capture sample") == prefilled
    assert summary["one_pass"]["not_covered"] == {split: e["prefill"] for split, e in expected.items()}
    assert _replies(one) == _replies(two)
    _assert_read_rows_equal(one, two)
    # the rendered set lists the samples in the shards' order (one pass's first, then the prefilled ones), so
    # online and vLLM-fed training draw the offline run's batches
    from data_prep.rendered import RenderedSet
    from data_prep.shards import ShardSet

    for split in ("train", "eval"):
        assert RenderedSet(one, split).sample_ids() == ShardSet(one / split).sample_ids(), split


def test_a_crash_mid_regeneration_resumes_without_duplicates(tmp_path: Path, data) -> None:
    two = tmp_path / "two"
    run_prep(two, *data, **_vllm(tmp_path, **{"capture.one_pass": False}))
    out = tmp_path / "one"
    cfg = _vllm(tmp_path, **{"regen.batch_size": 1, "vllm.max_in_flight": 1, "capture.tokens_per_shard": 1})
    model, paths = data
    args = [f"{k}={v}".replace(" ", "") for k, v in {**cfg, "model": model, "data": paths, "out": out}.items()]
    # the server exits at its 4th regeneration request: 3 conversations of the train split finished and written
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "prep.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "STANDIN_FAIL_AFTER_GENERATE": "3"}, timeout=600)
    assert proc.returncode == 3, proc.stderr[-3000:]
    first = completed_sample_ids(out / "train")
    assert len(first) == 3 and not (out / "summary.json").exists()
    summary = run_prep(out, *data, **cfg)
    for split in ("train", "eval"):
        ids = [s.sample_id for s in ShardSet(out / split)]
        assert len(ids) == len(set(ids)) == summary["samples"][split]  # each sample once
    assert summary["capture_pass"] == {split: {"with_regeneration": n, "prefill": 0}
                                       for split, n in summary["samples"].items()}
    assert _replies(out) == _replies(two)
    _assert_read_rows_equal(out, two)


@pytest.mark.parametrize(("regen", "capture", "stage", "flag", "expected"), [
    ("vllm", "vllm", "all", True, True),
    ("vllm", "vllm", "all", False, False),  # two passes, on request
    ("vllm", "hf", "all", True, False),  # the transformers capture: no states from the server
    ("hf", "vllm", "all", True, False),  # regenerated elsewhere
    ("vllm", "vllm", "render", True, False),  # no shards
])
def test_one_pass_is_planned_where_the_server_regenerates_and_captures(regen, capture, stage, flag, expected) -> None:
    from data_prep.config import PrepConfig
    from data_prep.pipeline import plan_prep

    cfg = PrepConfig(out="x", stage=stage)
    cfg.regen.backend, cfg.capture.engine, cfg.capture.one_pass = regen, capture, flag
    cfg.validate()
    assert plan_prep(cfg).one_pass is expected
