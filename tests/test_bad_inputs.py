"""Hostile but realistic inputs: each stops early with a message naming the file, the line and the
reason, or is skipped and counted under its own reason; nothing is published before it is complete.

Every case writes its own small files; none loads a real model (the tiny random target at most).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_CONVERSATIONS, run_prep
from synthetic_prep import write_synthetic_prep

from data_prep import pipeline
from data_prep.config import PrepConfig
from data_prep.conversations import load_conversations
from data_prep.shards import PREP_SUMMARY, ShardError, finished_prep
from train.data import held_out_split

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}


def good(i: int) -> dict:
    return {"id": f"g{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}


def jsonl(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def parquet(path: Path, columns: dict[str, list]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        if name.endswith(".parquet"):
            parquet(root / name, data)
        else:
            (root / name).write_bytes(data)
    return root / next(iter(files)) if len(files) == 1 else root


# ---------------------------------------------------------------------------------------------------------------
# prep: unknown keys (Hydra's `+key=value` opens the struct flag)


@pytest.mark.integration
@pytest.mark.parametrize(("override", "hint"), [
    ("+max_lenght=64", "did you mean 'max_len'"),
    ("+regen.max_turn=2", "did you mean 'regen.max_turns'"),
])
def test_prep_rejects_an_appended_unknown_key(tmp_path: Path, override: str, hint: str) -> None:
    out = tmp_path / "prep"
    r = subprocess.run([sys.executable, str(REPO / "launch" / "prep.py"), override, f"out={out}"],
                       capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "unknown config key" in r.stderr and hint in r.stderr, r.stderr[-2000:]
    assert not (out / "train").exists()


@pytest.mark.integration
@pytest.mark.parametrize(("overrides", "message"), [
    (["vllm.max_in_flight=0"], "vllm.max_in_flight must be >= 1, got 0"),
    (["vllm.timeout_s=0"], "vllm.timeout_s must be > 0, got 0"),
    (["vllm.timeout_s=-5"], "vllm.timeout_s must be > 0, got -5"),
    (["vllm.urls=[localhost:8000]"], "vllm.urls entry 'localhost:8000' is not http(s)://host:port"),
    (["vllm.urls=[http://n1:8000]", "+vllm.engine_kwargs.enforce_eager=true"], "vllm.urls names servers already"),
])
def test_prep_refuses_a_bad_vllm_value_naming_the_key(tmp_path: Path, overrides: list[str], message: str) -> None:
    """Every bad vllm.* value: one message naming the key, exit 2, no traceback, before anything loads."""
    out = tmp_path / "prep"
    r = subprocess.run([sys.executable, str(REPO / "launch" / "prep.py"), "capture.engine=vllm", *overrides,
                        f"out={out}"], capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
    assert r.returncode == 2 and f"config error: {message}" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (out / "train").exists()


@pytest.mark.integration
@pytest.mark.parametrize("override", ["max_length=64", "+max_length=64"])
def test_prep_refuses_a_renamed_key_naming_the_new_one(tmp_path: Path, override: str) -> None:
    """One name per concept (training's data.max_len): prep's old key stops before any work, naming the new."""
    out = tmp_path / "prep"
    r = subprocess.run([sys.executable, str(REPO / "launch" / "prep.py"), override, f"out={out}"],
                       capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "config error: 'max_length' is now 'max_len'" in r.stderr, r.stderr[-2000:]
    assert "max_len=64" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# prep: data with no conversation to train on stops right after loading, before the target is loaded

NO_CONVERSATION = [
    ("empty_jsonl", {"d.jsonl": b""}, {}, ["no usable conversation", "records read 0, kept 0"]),
    ("empty_json", {"d.json": b""}, {}, ["no usable conversation", "records read 0, kept 0"]),
    ("wrong_schema_parquet", {"d.parquet": {"label": [0, 1, 1], "text": ["a", "b", "c"]}}, {},
     ["records read 3, kept 0, skipped 3", "skipped       3  no_messages", "d.parquet row 0: keys ['label', 'text']"]),
    ("every_line_bad", {"d.jsonl": jsonl(b'{"id": 1,', b"[1, 2]")}, {},
     ["records read 2, kept 0, skipped 2", "bad_json", "d.jsonl line 1: Expecting", "not_a_dict"]),
    ("all_held_out", {"d.jsonl": jsonl(good(0), good(1), good(2))}, {"eval_samples": 40},
     ["all 3 usable conversations are held out (eval_samples=40)"]),
]


@pytest.mark.parametrize(("files", "overrides", "expected"), [c[1:] for c in NO_CONVERSATION],
                         ids=[c[0] for c in NO_CONVERSATION])
def test_no_usable_conversation_stops_before_the_target_loads(tmp_path, monkeypatch, files, overrides,
                                                               expected) -> None:
    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the data was checked")

    monkeypatch.setattr(pipeline, "load_target", no_target)
    data = write(tmp_path, files)
    out = tmp_path / "prep"
    cfg = PrepConfig(data=str(data), out=str(out), **overrides)
    with pytest.raises(ValueError) as e:
        pipeline.run(cfg)
    for text in expected:
        assert text in str(e.value), str(e.value)
    assert not (out / "train").exists() and not (out / PREP_SUMMARY).exists()


# ---------------------------------------------------------------------------------------------------------------
# prep: bad records are skipped and counted under their own reason, the example naming file and line

BAD_RECORDS = [
    ("torn_last_line", {"d.jsonl": jsonl(good(0), good(1)) + b'{"id": "t", "conversations": [{"fr'},
     "bad_json", "d.jsonl line 3: Unterminated string starting at column 32"),
    ("control_character", {"d.jsonl": jsonl(good(0), b'{"id": "c", "conversations": "a\x01b"}')},
     "bad_json", "d.jsonl line 2: Invalid control character at column 32"),
    ("non_utf8_jsonl", {"d.jsonl": jsonl(good(0), b'{"id": "u", "conversations": [{"from": "human", "value": '
                                                  b'"caf\xe9 cr\xe8me"}, {"from": "gpt", "value": "ok"}]}')},
     "invalid_utf8", "d.jsonl line 2: not UTF-8: b'caf\\xe9 cr\\xe8me'"),
    ("non_utf8_json_array", {"d.json": b"[" + json.dumps(good(0)).encode() + b", {\"id\": \"caf\xc3\", "
                                       b"\"conversations\": []}]"},
     "invalid_utf8", "d.json record 1: not UTF-8: b'caf\\xc3'"),
    ("lone_surrogate_escape", {"d.jsonl": jsonl(good(0), {"id": "s", "conversations": [
        {"from": "human", "value": "x\ud800"}, {"from": "gpt", "value": "ok"}]})},
     "invalid_utf8", "d.jsonl line 2: not UTF-8: 'x\\ud800'"),
]


@pytest.mark.parametrize(("files", "reason", "example"), [c[1:] for c in BAD_RECORDS], ids=[c[0] for c in BAD_RECORDS])
def test_bad_record_is_skipped_under_its_reason(tmp_path: Path, files, reason: str, example: str) -> None:
    convs, rep = load_conversations(str(write(tmp_path, files)))
    assert [c.id for c in convs][:1] == ["g0"] and rep.skipped[reason] == 1, rep.summary()
    assert example in rep.summary(), rep.summary()
    assert not any("\ufffd" in m.content for c in convs for m in c.messages)  # never kept with replacements


def test_other_files_in_a_data_directory_are_reported(tmp_path: Path) -> None:
    write(tmp_path, {"a.jsonl": jsonl(good(0)), "notes.txt": b"x", "b.csv": b"q,a\n"})
    convs, rep = load_conversations(str(tmp_path))
    assert len(convs) == 1
    assert rep.ignored_files == [str(tmp_path / "b.csv"), str(tmp_path / "notes.txt")]
    assert "ignored 2 file(s)" in rep.summary() and "notes.txt" in rep.summary()


def test_console_summary_shows_fixes_examples_and_an_interrupted_prep_is_unfinished(
        tmp_path, monkeypatch, capsys, tiny_target_dir: Path) -> None:
    """A prep killed by a full disk while writing the target files looks unfinished (to training too); the rerun
    finishes it and prints what summary.json has: fixed counts and per-reason examples."""
    records = [{"id": r["id"], "conversations": [t for t in r["conversations"] if t]} for r in TINY_CONVERSATIONS]
    lead = {"id": "lead", "conversations": [{"from": "gpt", "value": "hi"}, *records[0]["conversations"][:2]]}
    data = tmp_path / "d.jsonl"
    data.write_bytes(jsonl(*records, lead, b"{torn"))
    out = tmp_path / "prep"
    opts = {"regen.enabled": False, "eval_samples": 2, "draft_vocab_size": 32}

    def disk_full(*args) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pipeline, "save_target_files", disk_full)
    with pytest.raises(OSError, match="No space left"):
        run_prep(out, str(tiny_target_dir), str(data), **opts)
    assert (out / "train" / "manifest.json").exists() and not (out / "target_config.json").exists()
    with pytest.raises(ShardError, match="an unfinished prep .*rerun the same prep command"):
        held_out_split(out)
    monkeypatch.undo()
    capsys.readouterr()
    run_prep(out, str(tiny_target_dir), str(data), **opts)
    assert finished_prep(out)["eval_samples_requested"] == 2 and held_out_split(out) == out / "eval"
    console = capsys.readouterr().out
    assert "fixed         1  dropped_leading_assistant (kept)" in console, console
    assert f"e.g. bad_json: {data} line 14: Expecting property name" in console, console


# ---------------------------------------------------------------------------------------------------------------
# evaluation prompts: every line is checked; the first bad one stops with file, line and reason

BAD_PROMPTS = [
    ("torn_line", b'{"turns": ["What is', "not valid JSON (Unterminated string starting at column 12)"),
    ("plain_string", b'"What is 2 + 2?"', "a record must be a JSON object, got str"),
    ("number", b"42", "a record must be a JSON object, got int"),
    ("turns_a_string", '{"turns": "What is…"}'.encode(),
     "'turns' must be a non-empty list of non-empty strings, got \"What is…\""),
    ("turns_empty", b'{"turns": []}', "'turns' must be a non-empty list of non-empty strings, got []"),
    ("turn_not_a_string", b'{"turns": ["ok", 3]}', "'turns' must be a non-empty list"),
    ("turn_blank", b'{"turns": ["ok", "  "]}', "'turns' must be a non-empty list"),
    ("prompt_blank", b'{"prompt": ""}', "'prompt' must be a non-empty string"),
    ("no_prompt_key", b'{"text": "x"}', "a record needs 'turns' (a list of user messages), 'prompt' (a string) or "
     "a conversation (messages / conversations / conversation, as prep reads them)"),
    ("non_utf8", b'{"prompt": "caf\xe9"}', "not UTF-8 (byte 16 of the line"),
    ("messages_without_user", b'{"messages": [{"role": "system", "content": "Be brief."}]}',
     "not a conversation prep would read (no_user: )"),
    ("messages_unknown_role", b'{"messages": [{"role": "narrator", "content": "x"}]}',
     "not a conversation prep would read (unknown_role: 'narrator')"),
    ("sharegpt_late_system", b'{"conversations": [{"from": "human", "value": "q"}, {"from": "system", "value": "s"}]}',
     "one system message, before the first user turn, is what a prompt can have; roles ['user', 'system']"),
]


@pytest.mark.parametrize(("line", "reason"), [c[1:] for c in BAD_PROMPTS], ids=[c[0] for c in BAD_PROMPTS])
def test_bad_prompt_line_is_named(tmp_path: Path, line: bytes, reason: str) -> None:
    from eval.prompts import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"turns": ["fine", "also fine"]}\n\n' + line + b'\n{"prompt": "after"}\n')
    with pytest.raises(ValueError) as e:
        load_prompts(str(path), per_category=1)  # a cap does not skip the check of the later lines
    assert str(e.value).startswith(f"{path}:3: {reason}"), str(e.value)


def test_bad_prompts_stop_before_the_target_loads(tmp_path: Path, monkeypatch) -> None:
    import data_prep.targets
    from eval.config import EvalConfig
    from eval.run import run_eval

    def no_target(*args, **kwargs):
        raise AssertionError("the target was loaded before the prompts were checked")

    monkeypatch.setattr(data_prep.targets, "load_target", no_target)
    path = tmp_path / "p.jsonl"
    path.write_text('{"turns": "What is"}\n')
    with pytest.raises(ValueError, match=f"{path}:1: 'turns' must be"):
        run_eval(EvalConfig(drafter=str(tmp_path), prompts=str(path), out_dir=str(tmp_path / "o")), progress=False)


# ---------------------------------------------------------------------------------------------------------------
# training: an unfinished prep, a missing held-out split, a run without one


def _without(path: Path) -> None:
    path.unlink()


def _eval_emptied(prep: Path) -> None:  # a prep asked for held-out samples that all were dropped
    write_synthetic_prep(prep.parent / "empty_eval", n_train=8, n_eval=0)
    for f in ("manifest.json", "manifest.r0.json"):
        (prep / "eval" / f).write_text((prep.parent / "empty_eval" / "eval" / f).read_text())


BAD_PREPS = [
    ("no_summary", lambda p: _without(p / PREP_SUMMARY), f"an unfinished prep (no {PREP_SUMMARY}"),
    ("no_eval_manifest", lambda p: _without(p / "eval" / "manifest.json"),
     "eval/manifest.json: missing, but the prep was asked for 4 held-out samples"),
    ("eval_split_empty", _eval_emptied, "eval: no held-out sample, but the prep was asked for 4"),
]


@pytest.mark.parametrize(("damage", "message"), [c[1:] for c in BAD_PREPS], ids=[c[0] for c in BAD_PREPS])
def test_training_names_a_bad_prep(tmp_path: Path, damage, message: str) -> None:
    prep = write_synthetic_prep(tmp_path / "prep", n_train=8, n_eval=4)
    assert held_out_split(prep) == prep / "eval"
    damage(prep)
    with pytest.raises(ShardError, match=message.replace("(", r"\(")):
        held_out_split(prep)


@pytest.mark.integration
def test_a_prep_without_held_out_split_trains_and_says_so_once(tmp_path: Path) -> None:
    from conftest import run_train

    prep = write_synthetic_prep(tmp_path / "prep", n_train=8, n_eval=0)
    assert held_out_split(prep) is None
    out = tmp_path / "run"
    run_train(out, "+exp=debug", f"data.dir={prep}", "train.max_steps=1", "data.batch_size=4",
              "train.export=false")
    log = (out / "train.log").read_text()
    assert log.count("prepared without a held-out split (eval_samples=0)") == 1, log
    assert json.loads((out / "summary.json").read_text())["eval"] is None


# ---------------------------------------------------------------------------------------------------------------
# training: a torn metrics.jsonl tail (a crash mid-write) is tolerated and reported; elsewhere it is an error


def test_torn_metrics_tail_is_dropped_and_reported(tmp_path: Path, caplog) -> None:
    from train.metrics import read_metrics

    path = tmp_path / "metrics.jsonl"
    rows = [{"kind": "train", "step": s, "loss": 1.0} for s in (1, 2)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "train", "st')
    with caplog.at_level(logging.WARNING, logger="train"):
        assert read_metrics(path) == rows
    assert f"{path}:3: torn last line dropped" in caplog.text
    path.write_text(json.dumps(rows[0]) + '\n{"kind": "tr\n' + json.dumps(rows[1]) + "\n")
    with pytest.raises(ValueError, match=f"{path}:2: not a JSON record \\(Unterminated string starting at column 10\\)"):
        read_metrics(path)


# ---------------------------------------------------------------------------------------------------------------
# a full disk: the error names the file being written


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what write() raises: no file name


def _safetensors_enospc(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                          '"No space left on device" })')


def _write_shard(root: Path) -> None:
    import torch

    from data_prep.shards import Sample, ShardSpec, ShardWriter

    spec = ShardSpec(target={"id": "t", "num_layers": 4, "hidden_size": 4, "vocab_size": 16}, tap_layers=[1])
    w = ShardWriter(root, spec)
    w.add(Sample("s", torch.arange(3), torch.ones(3, dtype=torch.bool), torch.zeros(3, 4), torch.zeros(3, 4)))
    w.close()


def _write_checkpoint(root: Path) -> None:
    import torch

    from train import checkpoint

    state = {"params": {"w": torch.zeros(2)}, "exp_avg": {"w": torch.zeros(2)}, "exp_avg_sq": {"w": torch.zeros(2)},
             "adam_step": 1, "scheduler": {}}
    checkpoint.save(root, 1, state, {}, {}, {}, keep=2)


DISK_FULL = [
    ("shard", "safetensors.torch.save_file", _safetensors_enospc, _write_shard, "shards/r000-000000.safetensors.tmp"),
    ("partial_manifest", "pathlib.Path.write_text", _enospc, _write_shard, "manifest.r0.json.tmp"),
    ("checkpoint", "safetensors.torch.save_file", _safetensors_enospc, _write_checkpoint, ".tmp-step_000001"),
]


@pytest.mark.parametrize(("target", "fail", "write_it", "named"), [c[1:] for c in DISK_FULL],
                         ids=[c[0] for c in DISK_FULL])
def test_disk_full_names_the_file(tmp_path: Path, monkeypatch, target: str, fail, write_it, named: str) -> None:
    monkeypatch.setattr(target, fail)
    with pytest.raises(OSError) as e:
        write_it(tmp_path)
    assert f"writing {tmp_path}/{named} failed" in str(e.value) and "No space left on device" in str(e.value)


# ---------------------------------------------------------------------------------------------------------------
# a target preset whose hub id cannot be reached


def test_unreachable_preset_names_preset_hub_id_and_remedy(tmp_path: Path) -> None:
    from huggingface_hub import constants

    if not constants.HF_HUB_OFFLINE:
        pytest.skip("needs HF_HUB_OFFLINE=1 (it would download gpt-oss-120b)")
    data = write(tmp_path, {"d.jsonl": jsonl(*(good(i) for i in range(4)))})
    with pytest.raises(OSError) as e:
        run_prep(tmp_path / "prep", "gpt-oss-120b", str(data), eval_samples=1)
    text = str(e.value)
    assert "target 'gpt-oss-120b' resolves to the hub id 'openai/gpt-oss-120b'" in text, text
    assert "make MODEL=<dir>" in text and "HF_HUB_OFFLINE=0" in text


# ---------------------------------------------------------------------------------------------------------------
# prep: what training would refuse about the target, and a base model without a chat template, stop before the
# target's weights load; `chat_template=` (a file or the template itself) supplies one, in prep and eval


def _config_only_target(tmp_path: Path, tiny_target_dir: Path, edit=None, template: bool = True) -> Path:
    """The tiny target's config and tokenizer without its weights: enough for everything before they load."""
    import shutil

    out = tmp_path / "target"
    out.mkdir()
    for f in tiny_target_dir.iterdir():
        if f.name != "model.safetensors" and (template or not f.name.startswith("chat_template")):
            shutil.copy(f, out / f.name)
    if not template:
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg.pop("chat_template", None)
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    if edit is not None:
        config = json.loads((out / "config.json").read_text())
        edit(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


def _partial_rotary(config: dict) -> None:
    config["rope_parameters"]["partial_rotary_factor"] = 0.5


PREFLIGHT = [
    ("tap_out_of_range", None, {"capture.tap_layers": [1, 3, 8]},
     ["capture.tap_layers=[1, 3, 8]", "tap_layers [1, 3, 8] out of range for a 8-layer target",
      "Training would refuse this prep"]),
    ("duplicate_taps", None, {"capture.tap_layers": [1, 1, 4]}, ["duplicate tap_layers [1, 1, 4]"]),
    ("partial_rotary", _partial_rotary, {}, ["(llama)", "partial_rotary_factor != 1 is not supported"]),
]


@pytest.mark.parametrize(("edit", "overrides", "expected"), [c[1:] for c in PREFLIGHT], ids=[c[0] for c in PREFLIGHT])
def test_what_training_refuses_stops_the_prep_before_the_target_loads(tmp_path, monkeypatch, tiny_target_dir,
                                                                       tiny_sharegpt_file, edit, overrides,
                                                                       expected) -> None:
    from data_prep import targets

    def no_weights(*args, **kwargs):
        raise AssertionError("the target's weights were loaded before its config was checked")

    monkeypatch.setattr(targets, "_load_model", no_weights)
    target = _config_only_target(tmp_path, tiny_target_dir, edit)
    out = tmp_path / "prep"
    with pytest.raises(ValueError) as e:
        run_prep(out, str(target), str(tiny_sharegpt_file), eval_samples=2, **overrides)
    for text in expected:
        assert text in str(e.value), str(e.value)
    assert not (out / "train").exists()


def test_a_base_model_without_chat_template_names_the_option(tmp_path, monkeypatch, tiny_target_dir,
                                                             tiny_sharegpt_file) -> None:
    from data_prep import targets
    from eval.config import EvalConfig
    from eval.run import run_eval

    def no_weights(*args, **kwargs):
        raise AssertionError("the target's weights were loaded before its chat template was checked")

    monkeypatch.setattr(targets, "_load_model", no_weights)
    base = _config_only_target(tmp_path, tiny_target_dir, template=False)
    with pytest.raises(ValueError, match="has no chat template .*chat_template=<file or template string>"):
        run_prep(tmp_path / "prep", str(base), str(tiny_sharegpt_file), eval_samples=2)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="has no chat template .*chat_template="):
        run_eval(EvalConfig(drafter=str(tmp_path), target=str(base), prompts=str(prompts),
                            out_dir=str(tmp_path / "eval")), progress=False)
    with pytest.raises(FileNotFoundError, match="chat_template='templates/chatml.jinja': no such file"):
        run_prep(tmp_path / "prep", str(base), str(tiny_sharegpt_file), eval_samples=2,
                 chat_template="templates/chatml.jinja")


def test_chat_template_option_takes_a_file_or_the_template(tmp_path, tiny_target_dir) -> None:
    from transformers import AutoTokenizer

    from data_prep.chat import resolve_chat_template
    from data_prep.targets import load_tokenizer, resolve_target

    template = AutoTokenizer.from_pretrained(tiny_target_dir).chat_template
    base = _config_only_target(tmp_path, tiny_target_dir, template=False)
    (tmp_path / "t.jinja").write_text(template)
    assert resolve_chat_template(str(tmp_path / "t.jinja")) == template == resolve_chat_template(template)
    assert resolve_chat_template(None) is None
    for given in (str(tmp_path / "t.jinja"), template):
        tok = load_tokenizer(resolve_target(str(base)), given)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")
