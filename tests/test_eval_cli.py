"""launch/eval.py end to end on a tiny target (real SmolLM2 tokenizer + chat template), prompts, config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eval.prompts import PromptsError, load_prompts

REPO = Path(__file__).resolve().parents[1]


def test_mtbench_preset_has_80_two_turn_questions() -> None:
    recs = load_prompts("mtbench")
    assert len(recs) == 80 and all(len(r.turns) == 2 for r in recs)
    assert len({r.id for r in recs}) == 80 and recs[0].category
    three = load_prompts("mtbench", per_category=3, max_turns=1)
    assert len(three) == 24 and three[0].turns == recs[0].turns[:1]


def test_jsonl_prompts(tmp_path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text('{"id": "a", "turns": ["hi", "more"]}\n\n{"prompt": "solo"}\n')
    recs = load_prompts(str(f))
    assert [(r.id, r.turns) for r in recs] == [("a", ["hi", "more"]), ("3", ["solo"])]
    f.write_text('{"text": "no turns"}\n')
    with pytest.raises(ValueError, match="turns"):
        load_prompts(str(f))
    with pytest.raises(PromptsError, match="neither a suite .* nor a JSONL file"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_config_rejects_unknown_keys_and_missing_drafter() -> None:
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    from eval.config import EvalConfig, register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf" / "eval"), version_base="1.3"):
        with pytest.raises(ConfigCompositionException):
            compose("eval", overrides=["drafter=x", "out_dir=y", "decode.bogus=1"])
        with pytest.raises(ConfigCompositionException):
            compose("eval", overrides=["drafter=x", "out_dir=y", "decode.depth=deep"])
        cfg = compose("eval", overrides=["drafter=x", "out_dir=y", "decode.mode=chain", "decode.temperature=0.7"])
        obj: EvalConfig = OmegaConf.to_object(cfg)
        assert obj.decode.mode == "chain" and obj.decode.temperature == 0.7 and obj.prompts == "mtbench"
        with pytest.raises(MissingMandatoryValue):
            OmegaConf.to_object(compose("eval", overrides=["out_dir=y"]))
    bad = EvalConfig(drafter="x", out_dir="y")
    bad.decode.mode = "beam"
    with pytest.raises(ValueError, match="mode"):
        bad.validate()


@pytest.fixture(scope="module")
def exported_drafter(tmp_path_factory, tiny_target_dir: Path) -> Path:
    from tiny_models import tiny_drafter
    from transformers import AutoModelForCausalLM

    from models.eagle3 import save_export

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = sorted(torch.randperm(target.config.vocab_size, generator=g)[:256].tolist())
    drafter = tiny_drafter(target, tap_layers=[0, 2, 4], draft_token_ids=ids)
    out = tmp_path_factory.mktemp("export")
    save_export(drafter, out, dtype=torch.float32)
    return out


def test_launch_eval_writes_report(tmp_path, tiny_target_dir: Path, exported_drafter: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "q1", "turns": ["What is 2 + 2?", "And 3 + 3?"]}) + "\n"
                       + json.dumps({"id": "q2", "prompt": "Name a colour."}) + "\n"
                       + json.dumps({"id": "q3", "prompt": "Not evaluated (num_prompts=2)."}) + "\n")
    out = tmp_path / "out"
    cmd = [sys.executable, str(REPO / "launch" / "eval.py"), f"drafter={exported_drafter}",
           f"target={tiny_target_dir}", f"prompts={prompts}", f"out_dir={out}", "dtype=float32",
           "decode.mode=tree", "decode.temperature=0", "decode.max_new_tokens=12", "decode.num_prompts=2",
           "decode.depth=3", "decode.topk=2", "decode.total_tokens=5", "prompt_lookup=true", "threads=1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "speedup=" in res.stdout and "tau pooled=" in res.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["num_prompts"] == 2 and report["num_requests"] == 3
    d = report["decode"]
    assert (d["mode"], d["depth"], d["topk"], d["total_tokens"], d["temperature"]) == ("tree", 3, 2, 5, 0.0)
    assert len(report["per_position_acceptance"]) == 3
    assert 1.0 <= report["tau_pooled"] <= 4.0 and 1.0 <= report["tau_per_request_mean"] <= 4.0
    assert report["tokens_per_s"]["speculative"] > 0 and report["tokens_per_s"]["baseline"] > 0
    assert report["speedup"] > 0 and report["prompt_lookup"]["tokens_per_s"] > 0
    samples = report["samples"]
    assert [(s["id"], s["turn"]) for s in samples] == [("q1", 0), ("q1", 1), ("q2", 0)]
    assert all(1 <= len(s["output_token_ids"]) <= 12 for s in samples)
    # the second turn's prompt contains the first turn's prompt (it follows the model's own answer)
    assert len(samples[1]["prompt_token_ids"]) > len(samples[0]["prompt_token_ids"]) + len(samples[0]["output_token_ids"]) - 2
    # greedy in float32: speculative output is the plain output
    assert report["outputs_identical_to_baseline"]["count"] == 3
    assert all(s["output_token_ids"] == s["baseline_output_token_ids"] for s in samples)
    for png in ("per_position_acceptance.png", "accept_length_histogram.png"):
        assert (out / png).stat().st_size > 1000


def test_run_eval_in_process_sampling_auto_budget(tmp_path, tiny_target_dir: Path, exported_drafter: Path) -> None:
    """Other branches: tree with the verify budget chosen by timing, T > 0, no baseline, no plots."""
    from eval.config import DecodeConfig, EvalConfig
    from eval.run import format_summary, run_eval

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello there"}) + "\n")
    cfg = EvalConfig(drafter=str(exported_drafter), target=str(tiny_target_dir), prompts=str(prompts),
                     out_dir=str(tmp_path / "o"), dtype="float32", baseline=False, plots=False, warmup=False,
                     decode=DecodeConfig(mode="tree", depth=2, topk=2, auto_total_tokens=True,
                                         total_tokens_candidates=[2, 3], temperature=0.8, top_p=0.9,
                                         max_new_tokens=6))
    report = run_eval(cfg, progress=False)
    saved = json.loads((tmp_path / "o" / "report.json").read_text())
    choice = saved["decode"]["total_tokens_choice"]  # what was chosen and why, in the report and the summary
    assert [c["m"] for c in choice["candidates"]] == [0, 2, 3]  # plain decoding is a candidate
    for c in choice["candidates"]:
        assert c["verify_cost"] > 0 and c["predicted_speedup"] > 0 and c["tau"] >= 1
        assert c["predicted_speedup"] == pytest.approx(
            c["tau"] * choice["candidates"][0]["verify_cost"] / (c["verify_cost"] + c["overhead_s"]))
    best = max(choice["candidates"], key=lambda c: (c["predicted_speedup"], -c["m"]))
    assert choice["chosen"] == best["m"] == saved["decode"]["total_tokens"]
    assert choice["candidates"][0]["predicted_speedup"] == 1.0
    assert choice["probe"]["m"] == 3 and choice["probe"]["cycles"] >= 1 and choice["passes"] == 5
    # the verifies' context: the prompt and half the generation budget
    assert choice["context_len"] == len(report["samples"][0]["prompt_token_ids"]) + 3
    assert choice["reason"].startswith(f"m={choice['chosen']}") and "predicted speedup" in choice["definition"]
    assert saved["decode"]["total_tokens_timings_s"] == {str(c["m"]): c["verify_cost"] for c in choice["candidates"]}
    assert f"auto total_tokens: {choice['reason']}" in format_summary(report)
    assert report["speedup"] is None and "outputs_identical_to_baseline" not in report
    assert len(report["samples"]) == 1 and 1 <= len(report["samples"][0]["output_token_ids"]) <= 6
    assert saved["tokens_per_s"]["baseline"] is None  # NaN is written as null
    assert not (tmp_path / "o" / "per_position_acceptance.png").exists()
    assert "speedup=None" in format_summary(report)


def test_run_eval_decodes_plainly_when_no_tree_is_predicted_to_pay(tmp_path, tiny_target_dir: Path,
                                                                   exported_drafter: Path) -> None:
    """decode.auto_total_tokens on a machine where every verify forward costs far more than a plain step (a scripted
    cost table in place of the target's timed forwards): m = 0 is chosen and the speculative side decodes plainly."""
    from eval.config import DecodeConfig, EvalConfig
    from eval.run import format_summary, run_eval

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello there"}) + "\n")
    cfg = EvalConfig(drafter=str(exported_drafter), target=str(tiny_target_dir), prompts=str(prompts),
                     out_dir=str(tmp_path / "o"), dtype="float32", plots=False, warmup=False,
                     decode=DecodeConfig(mode="tree", depth=2, topk=2, auto_total_tokens=True,
                                         total_tokens_candidates=[2, 3], max_new_tokens=6))
    report = run_eval(cfg, progress=False, timer=lambda m: 1.0 + 10.0 * m)
    saved = json.loads((tmp_path / "o" / "report.json").read_text())
    choice = saved["decode"]["total_tokens_choice"]
    assert [c["verify_cost"] for c in choice["candidates"]] == [1.0, 21.0, 31.0]
    assert choice["chosen"] == 0 == saved["decode"]["total_tokens"]
    assert all(c["predicted_speedup"] < 1 for c in choice["candidates"][1:])
    assert saved["drafting"] == {"mode": "plain", "total_tokens": 0}
    assert saved["verify_forwards"] == 0 and saved["tau_pooled"] is None  # no speculative cycle at all
    assert saved["outputs_identical_to_baseline"]["count"] == 1 and saved["speedup"] > 0
    assert "auto total_tokens: m=0, plain decoding" in format_summary(report)
    assert "tau pooled=n/a" in format_summary(saved)  # the report read back, as make demo's summary reads it


def test_run_eval_adaptive_budget_reports_its_forecast(tmp_path, tiny_target_dir: Path, exported_drafter: Path) -> None:
    """decode.budget=adaptive: greedy outputs still equal the baseline's; the report carries the cost model's
    predicted τ and speedup beside the measured ones, and its verify-time table."""
    from eval.config import DecodeConfig, EvalConfig
    from eval.run import format_summary, run_eval

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello there"}) + "\n" + json.dumps({"prompt": "Tell me more"}) + "\n")
    cfg = EvalConfig(drafter=str(exported_drafter), target=str(tiny_target_dir), prompts=str(prompts),
                     out_dir=str(tmp_path / "o"), dtype="float32", plots=False,
                     decode=DecodeConfig(mode="tree", depth=3, topk=2, total_tokens=5, budget="adaptive",
                                         max_new_tokens=10))
    report = run_eval(cfg, progress=False)
    a = report["adaptive_budget"]
    assert report["outputs_identical_to_baseline"]["count"] == 2
    assert set(a["verify_cost_s"]) == {1, 2, 3, 5, 6} and 0 <= a["mean_m"] <= 5
    assert a["cycles"] == sum(report["accept_length_histogram"])  # one decision per verify forward
    assert a["tau_measured"] == pytest.approx(report["tau_pooled"])
    assert a["speedup_predicted"] > 0 and "adaptive budget: mean m=" in format_summary(report)
    bad = EvalConfig(drafter="x", out_dir="y")
    bad.decode.budget = "greedy"
    with pytest.raises(ValueError, match="decode.budget"):
        bad.validate()


# ---------------------------------------------------------------------------------------------------------------
# a broken or foreign export is refused before decoding, naming the tensor or both targets


def _copy_export(src: Path, dst: Path, edit_config=None) -> Path:
    import shutil

    shutil.copytree(src, dst)
    if edit_config is not None:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_launch_eval_refuses_non_finite_weights(tmp_path, tiny_target_dir: Path, exported_drafter: Path) -> None:
    from safetensors.torch import load_file, save_file

    export = _copy_export(exported_drafter, tmp_path / "export")
    tensors = load_file(str(export / "model.safetensors"))
    tensors["fc.weight"][0, 1] = float("nan")
    save_file(tensors, str(export / "model.safetensors"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(REPO / "launch" / "eval.py"), f"drafter={export}",
                          f"target={tiny_target_dir}", f"prompts={prompts}", f"out_dir={out}", "dtype=float32",
                          "threads=1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"error: {export / 'model.safetensors'}: tensor fc.weight (32, 96) holds 1 NaN" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (out / "report.json").exists()


@pytest.fixture(scope="module")
def tiny_target(tiny_target_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(tiny_target_dir))


def _stamped(tmp_path: Path, exported_drafter: Path, tiny_target, **changes) -> Path:
    """The export with its target recorded as the tiny target's (with `changes`), as training writes it."""
    from eval.target import target_fingerprint
    from models.export import stamp_target

    model, tok = tiny_target
    fp = target_fingerprint(model.config.to_dict(), tok, "tiny")
    export = _copy_export(exported_drafter, tmp_path / "export")
    stamp_target(export, {**fp, "tap_layers": [0, 2, 4], **changes})
    return export


def test_the_export_of_the_target_loads(tmp_path, exported_drafter: Path, tiny_target) -> None:
    from eval.run import load_drafter

    model, tok = tiny_target
    drafter = load_drafter(str(_stamped(tmp_path, exported_drafter, tiny_target)), model, "cpu", torch.float32, tok,
                           "tiny")
    assert drafter.tap_layers == [0, 2, 4]


@pytest.mark.parametrize(("changes", "edit", "message"), [
    ({"id": "org/big", "num_layers": 32, "hidden_size": 4096}, None,
     "was trained for org/big (architecture LlamaForCausalLM, num_layers 32, hidden_size 4096"),
    ({"tokenizer_hash": "0123456789abcdef"}, None, "they differ in tokenizer_hash"),
    ({}, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 4, 6]),
     "layer ids give tap layers [1, 3, 5], but the drafter was trained on tap layers [0, 2, 4]"),
    ({}, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 16, 29]),
     "out of range for a 8-layer target"),
], ids=["another-target", "another-tokenizer", "layer-ids-edited", "layer-ids-of-a-deeper-target"])
def test_a_foreign_or_edited_export_is_refused(tmp_path, exported_drafter: Path, tiny_target, changes, edit,
                                               message: str) -> None:
    from eval.run import load_drafter
    from models.export import ExportError

    model, tok = tiny_target
    export = _stamped(tmp_path, exported_drafter, tiny_target, **changes)
    if edit is not None:
        config = json.loads((export / "config.json").read_text())
        edit(config)
        (export / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError) as e:
        load_drafter(str(export), model, "cpu", torch.float32, tok, "tiny")
    assert message in str(e.value) and str(export) in str(e.value), str(e.value)


def test_the_engine_refuses_a_foreign_export_before_vllm_starts(tmp_path, tiny_target_dir: Path,
                                                                exported_drafter: Path, tiny_target) -> None:
    from data_prep.targets import load_tokenizer, resolve_target
    from eval.run import check_export
    from models.export import ExportError

    preset = resolve_target(str(tiny_target_dir))
    tokenizer = load_tokenizer(preset)
    assert check_export(str(_stamped(tmp_path / "ok", exported_drafter, tiny_target)), preset, tokenizer) == "eagle3"
    export = _stamped(tmp_path / "foreign", exported_drafter, tiny_target, id="org/big", vocab_size=128256)
    with pytest.raises(ExportError) as e:
        check_export(str(export), preset, tokenizer)
    assert "was trained for org/big" in str(e.value) and "differ in vocab_size" in str(e.value), str(e.value)


def test_the_recorded_target_id_must_name_the_target(tmp_path) -> None:
    """Prep records the target's hub id; a model of the same shape and tokenizer under another id (SmolLM2-135M,
    the base model of SmolLM2-135M-Instruct) is refused naming both, case aside; a local directory on either side
    is compared by shape and tokenizer only (models.export.check_target)."""
    from data_prep.targets import resolve_target
    from eval.run import check_target_id
    from models.export import TARGET_KEY, ExportError

    preset = resolve_target("smollm2-135m-instruct")
    with pytest.raises(ExportError) as e:
        check_target_id({TARGET_KEY: {"id": "HuggingFaceTB/SmolLM2-135M", "num_layers": 30}}, preset, "exp")
    assert str(e.value).startswith("drafter exp was trained for target HuggingFaceTB/SmolLM2-135M, not for target "
                                   "smollm2-135m-instruct (HuggingFaceTB/SmolLM2-135M-Instruct)"), str(e.value)
    assert "target=HuggingFaceTB/SmolLM2-135M" in str(e.value)
    for same in ("HuggingFaceTB/SmolLM2-135M-Instruct", "huggingfacetb/smollm2-135m-instruct", "smollm2-135m-instruct",
                 "/data/models/smollm2", "./smollm2", str(tmp_path), None):
        check_target_id({TARGET_KEY: {"id": same}}, preset, "exp")
    check_target_id({}, preset, "exp")
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 10}))
    check_target_id({TARGET_KEY: {"id": "org/other"}}, resolve_target(str(tmp_path)), "exp")


def test_an_export_for_another_model_of_the_same_shape_stops_before_anything_loads(tmp_path, exported_drafter: Path,
                                                                                   tiny_target) -> None:
    """The hostile case end to end: an export recording another model's id, evaluated with engine=vllm: exit 2
    naming both, before the target (or vLLM's check: vllm.python names nothing) is touched."""
    export = _stamped(tmp_path, exported_drafter, tiny_target, id="HuggingFaceTB/SmolLM2-135M")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    res = subprocess.run([sys.executable, str(REPO / "launch" / "eval.py"), f"drafter={export}",
                          "target=smollm2-135m-instruct", f"prompts={prompts}", f"out_dir={tmp_path / 'out'}",
                          "engine=vllm", "decode.mode=chain", "vllm.python=/nonexistent/python"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert (f"error: drafter {export} was trained for target HuggingFaceTB/SmolLM2-135M, not for target "
            "smollm2-135m-instruct (HuggingFaceTB/SmolLM2-135M-Instruct)") in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_a_damaged_export_is_refused_naming_its_file(tmp_path, tiny_target_dir: Path, exported_drafter: Path,
                                                    tiny_target, monkeypatch) -> None:
    from data_prep.targets import resolve_target
    from eval.config import EvalConfig
    from eval.run import check_export, load_drafter, read_export_weights, run_eval
    from models.export import ExportError

    model, tok = tiny_target
    truncated = _copy_export(exported_drafter, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # a copy cut short
    for load in (lambda: load_drafter(str(truncated), model, "cpu", torch.float32, tok, "tiny"),
                 lambda: check_export(str(truncated), resolve_target(str(tiny_target_dir)), tok)):
        with pytest.raises(ExportError, match=rf"^{weights}: cannot be read \(Error while deserializing header"):
            load()
    pickled = _copy_export(exported_drafter, tmp_path / "pickled")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"not a torch file")
    with pytest.raises(ExportError, match=rf"^{pickled / 'pytorch_model.bin'}: cannot be read"):
        read_export_weights(str(pickled))
    for text in ('{"architectures": ["LlamaForCausalLMEagle3"], ', "[1, 2]", '{"drafters_target": "tiny"}'):
        broken = _copy_export(exported_drafter, tmp_path / f"json{len(text)}")
        (broken / "config.json").write_text(text)
        prompts = tmp_path / "p.jsonl"
        prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
        monkeypatch.setattr("data_prep.targets.load_target", lambda *a, **k: pytest.fail("the target loaded"))
        with pytest.raises(ExportError, match=rf"^{broken / 'config.json'}: "):
            run_eval(EvalConfig(drafter=str(broken), target=str(tiny_target_dir), prompts=str(prompts),
                                out_dir=str(tmp_path / "o")), progress=False)
    # and through the launcher: exit 2, the file named, no traceback
    res = subprocess.run([sys.executable, str(REPO / "launch" / "eval.py"), f"drafter={truncated}",
                          f"target={tiny_target_dir}", f"prompts={prompts}", f"out_dir={tmp_path / 'out'}",
                          "dtype=float32", "threads=1"], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2 and f"error: {weights}: cannot be read (" in res.stderr, res.stderr[-3000:]
    assert "Traceback" not in res.stderr


def test_engine_vllm_without_vllm_stops_before_anything_decodes(tmp_path, tiny_target_dir: Path,
                                                                exported_drafter: Path) -> None:
    """vllm.python naming a python without vLLM (this suite's own): exit 2, named, before the target loads."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(REPO / "launch" / "eval.py"), f"drafter={exported_drafter}",
                          f"target={tiny_target_dir}", f"prompts={prompts}", f"out_dir={out}", "dtype=float32",
                          "threads=1", "engine=vllm", "decode.mode=chain", f"vllm.python={sys.executable}"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"error: engine=vllm: vllm.python={sys.executable} has vLLM none" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and "eval chain" not in res.stderr and not (out / "report.json").exists()


def test_a_trained_drafter_evaluates_on_its_target_and_is_refused_on_another(
        tmp_path, tiny_prep_dir: Path, tiny_target_dir: Path, smollm2_dir: Path) -> None:
    """prep -> train -> export records the prep's target; eval on that target runs, on another (SmolLM2 itself:
    the same tokenizer, a deeper and wider model) stops before decoding, naming both."""
    from conftest import run_train

    from models.export import TARGET_KEY

    run = tmp_path / "run"
    run_train(run, "+exp=debug", f"data.dir={tiny_prep_dir}", "train.max_steps=1", "data.batch_size=2",
              "data.eval_batch_size=2")
    recorded = json.loads((run / "export" / "config.json").read_text())[TARGET_KEY]
    assert (recorded["num_layers"], recorded["hidden_size"]) == (8, 32) and len(recorded["tokenizer_hash"]) == 16
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")

    def evaluate(target: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(REPO / "launch" / "eval.py"), f"drafter={run / 'export'}",
                               f"target={target}", f"prompts={prompts}", f"out_dir={tmp_path / target.name}",
                               "dtype=float32", "threads=1", "plots=false", "decode.max_new_tokens=4"],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path)

    ok = evaluate(tiny_target_dir)
    assert ok.returncode == 0, ok.stderr[-3000:]
    foreign = evaluate(smollm2_dir)
    assert foreign.returncode == 2, foreign.stderr[-3000:]
    assert f"was trained for {recorded['id']} (" in foreign.stderr and "differ in num_layers, hidden_size" in (
        foreign.stderr), foreign.stderr


# ---------------------------------------------------------------------------------------------------------------
# prompts in prep's forms (OpenAI messages, ShareGPT), system prompts included; decoded outputs in the report


PREP_FORMS = [
    {"id": "oa", "messages": [{"role": "system", "content": "You answer in French."},
                              {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]},
                              {"role": "assistant", "content": "not used"},
                              {"role": "user", "content": "And another?"}]},
    {"id": "sg", "conversations": [{"from": "system", "value": "You are terse."}, {"from": "human", "value": "Hi"},
                                   {"from": "gpt", "value": "not used either"}]},
    {"question_id": 7, "messages": [{"role": "user", "content": "No system prompt."}]},
]


def test_prompts_in_prep_forms(tmp_path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in PREP_FORMS))
    recs = load_prompts(str(f))
    assert [(r.id, r.turns, r.system) for r in recs] == [
        ("oa", ["Name a colour.", "And another?"], "You answer in French."), ("sg", ["Hi"], "You are terse."),
        ("7", ["No system prompt."], None)]
    assert recs[0].messages(1, ["Rouge."]) == [
        {"role": "system", "content": "You answer in French."}, {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Rouge."}, {"role": "user", "content": "And another?"}]


def test_run_eval_on_prep_forms_reports_decoded_outputs(tmp_path, tiny_target_dir: Path,
                                                        exported_drafter: Path) -> None:
    from transformers import AutoTokenizer

    from eval.config import DecodeConfig, EvalConfig
    from eval.run import run_eval

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in PREP_FORMS[:2]))
    cfg = EvalConfig(drafter=str(exported_drafter), target=str(tiny_target_dir), prompts=str(prompts),
                     out_dir=str(tmp_path / "o"), dtype="float32", plots=False, warmup=False,
                     decode=DecodeConfig(mode="chain", depth=2, max_new_tokens=6))
    report = run_eval(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    samples = json.loads((tmp_path / "o" / "report.json").read_text())["samples"]
    assert [(s["id"], s["turn"]) for s in samples] == [("oa", 0), ("oa", 1), ("sg", 0)]
    for s in samples:
        assert s["output_text"] == tok.decode(s["output_token_ids"], skip_special_tokens=True)
        assert s["baseline_output_text"] == tok.decode(s["baseline_output_token_ids"], skip_special_tokens=True)
    shown = [tok.decode(s["prompt_token_ids"]) for s in samples]
    assert "You answer in French." in shown[0] and "You answer in French." in shown[1] and "terse" in shown[2]
    assert samples[0]["output_text"] in shown[1] and "not used" not in shown[1]  # turn 2 follows the model's answer
    assert report["num_requests"] == 3


def test_eval_reports_every_category_with_intervals(tmp_path, tiny_target_dir: Path, exported_drafter: Path) -> None:
    """launch/eval.py on a prompts file with categories: report.json `categories` and `suites`, the printed
    table, categories.md and categories.png; each entry's figures recomputed from its own samples."""
    lines = [{"id": f"w{i}", "category": "writing", "turns": [f"Write a line about {w}.", "Shorter."]}
             for i, w in enumerate(["rain", "snow", "wind"])]
    lines += [{"id": f"m{i}", "category": "math", "prompt": f"What is {i} + {i}?"} for i in range(4)]
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, str(REPO / "launch" / "eval.py"), f"drafter={exported_drafter}",
                          f"target={tiny_target_dir}", f"prompts={prompts}", f"out_dir={out}", "dtype=float32",
                          "decode.mode=chain", "decode.depth=3", "decode.max_new_tokens=10", "decode.num_prompts=3",
                          "threads=1"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    cats = report["categories"]
    assert [(c["suite"], c["category"], c["prompts"], c["turns"]) for c in cats] == [
        ("mine", "writing", 3, 6), ("mine", "math", 3, 3)]
    samples = report["samples"]
    for c in cats:
        mine = [s for s in samples if s["category"] == c["category"]]
        assert len(mine) == c["turns"] and c["identical"] == {"count": c["turns"], "of": c["turns"]}
        assert c["new_tokens"] == sum(len(s["output_token_ids"]) for s in mine)
        assert len(c["alpha"]) == 3 and c["tokens_per_s"]["speculative"] > 0 and c["tokens_per_s"]["baseline"] > 0
        assert c["speedup"] == pytest.approx(c["tokens_per_s"]["speculative"] / c["tokens_per_s"]["baseline"])
        assert c["speedup_predicted"] > 0 and 0.0 <= c["oov_rate"] <= 1.0
        assert c["prompts"] == 3 and c["tau_ci95"] is None  # fewer than 5 prompts: no interval
    # the pooled τ is the turns' pooled τ; the suite's entry pools its categories, 6 prompts: an interval
    suite = report["suites"]["mine"]
    assert suite["turns"] == 9 and suite["prompts"] == 6 and suite["tau"] == pytest.approx(report["tau_pooled"])
    assert suite["tau_ci95"][0] <= suite["tau"] <= suite["tau_ci95"][1] and report["tau_ci95"] == suite["tau_ci95"]
    assert report["cycle_cost"]["verified_tokens"] == 4 and set(report["cycle_cost"]["forward_s"]) == {"1", "4"}
    table = (out / "categories.md").read_text()
    assert "| mine | writing | 6 |" in table and "| mine | math | 3 |" in table and "bootstrap" in table
    assert table.count(" [n<5] |") == 2
    assert "| mine | writing | 6 |" in res.stdout  # the same table printed at the end
    assert (out / "categories.png").stat().st_size > 1000
