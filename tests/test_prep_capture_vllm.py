"""capture.engine=vllm: prep's capture through vLLM's hidden-state extraction (data_prep/vllm_capture.py).

Without vLLM (every `make test`): the config refusals, the layer-id mapping, the clear error when vLLM is missing
or too old (before any weights load), and the project side (reading the connector's files, checking them,
building the shard samples, ShardWriter, resume after a crash) against tests/vllm_standin.py, which writes the
connector's file layout from a transformers forward.

With vLLM (opt-in, `make capture-check`; DRAFTERS_VLLM_PYTHON names a vLLM install's python, like
tests/test_prep_regen_vllm.py): the embedded target captured by the real engine against the HF capture of the
same samples, both fp32.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_prep
from job_steps import process_tree, signal_step
from vllm_standin import standin_python

from data_prep.config import PrepConfig
from data_prep.shards import ShardSet, completed_sample_ids
from serving.client import VLLM_PLUGIN
from serving.plugin import MIN_VLLM
from serving.server import VLLMUnavailable, check_vllm, resolve_python
from serving.states import VLLMCaptureError, aux_layer_ids

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = os.environ.get("DRAFTERS_VLLM_PYTHON", "")


def standin(tmp_path: Path) -> str:
    return standin_python(tmp_path)


def test_layer_ids_map_taps_and_teacher_to_vllm_aux_ids() -> None:
    # vLLM's id k is the residual stream after k layers: tap i is i+1, the last layer's output is num_layers
    assert aux_layer_ids([1, 14, 26], 30) == ([2, 15, 27, 30], [0, 1, 2], 3)
    assert aux_layer_ids([29, 3], 30) == ([4, 30], [1, 0], 1)  # the last layer as a tap is the teacher's column
    with pytest.raises(ValueError, match=r"tap layers \[30\] out of range for a 30-layer target"):
        aux_layer_ids([1, 30], 30)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"engine": "sglang"}, "capture.engine must be hf|vllm"),
    ({"engine": "vllm", "tensor_parallel_size": 2}, "prep's vLLM engine is split by vllm.tensor_parallel_size"),
])
def test_config_refuses_bad_engine_settings(overrides: dict, message: str) -> None:
    cfg = PrepConfig(out="x")
    for k, v in overrides.items():
        setattr(cfg.capture, k, v)
    with pytest.raises(ValueError, match=message):
        cfg.validate()


def test_config_refuses_engine_kwargs_the_capture_sets_and_bad_sizes() -> None:
    cfg = PrepConfig(out="x")
    cfg.capture.engine = "vllm"
    cfg.vllm.engine_kwargs = {"enforce_eager": True, "speculative_config": {}}
    with pytest.raises(ValueError, match=r"vllm.engine_kwargs sets \['speculative_config'\]"):
        cfg.validate()
    cfg.vllm.engine_kwargs = {"enforce_eager": True}
    cfg.vllm.pipeline_parallel_size = 0
    with pytest.raises(ValueError, match="vllm.pipeline_parallel_size must be >= 1"):
        cfg.validate()
    cfg.vllm.pipeline_parallel_size = 2
    cfg.validate()
    # regeneration on the engine with the transformers target split by capture.tensor_parallel_size: refused
    cfg = PrepConfig(out="x")
    cfg.regen.backend, cfg.capture.tensor_parallel_size = "vllm", 2
    with pytest.raises(ValueError, match="split by vllm.tensor_parallel_size"):
        cfg.validate()


def test_config_keys_are_typed_through_hydra() -> None:
    from omegaconf import OmegaConf

    from data_prep.config import prep_config
    from infra.config_keys import ConfigError, check_keys

    raw = OmegaConf.merge(OmegaConf.structured(PrepConfig), OmegaConf.from_dotlist(
        ["out=x", "capture.engine=vllm", "vllm.tensor_parallel_size=8", "vllm.engine_kwargs={enforce_eager: true}",
         "vllm.max_in_flight=16", "vllm.urls=[http://n1:8000,http://n2:8000]"]))
    cfg = prep_config(raw)
    assert (cfg.capture.engine, cfg.vllm.tensor_parallel_size) == ("vllm", 8)
    assert cfg.vllm.engine_kwargs == {"enforce_eager": True} and cfg.vllm.max_in_flight == 16
    assert cfg.vllm.urls == ["http://n1:8000", "http://n2:8000"]
    with pytest.raises(ConfigError, match="vllm.tensor_parallel"):
        check_keys({"vllm": {"tensor_parallel": 2}}, PrepConfig)
    # the engine's keys moved out of capture.vllm (one engine regenerates and captures): the old names point on
    from data_prep.config import RENAMED_KEYS
    from infra.config_keys import refuse_renamed

    with pytest.raises(ConfigError, match="'capture.vllm.python' is now 'vllm.python'"):
        check_keys({"capture": {"vllm": {"python": "/x"}}}, PrepConfig, renamed=RENAMED_KEYS)
    with pytest.raises(ConfigError, match="pass vllm.tensor_parallel_size=8"):
        refuse_renamed(["capture.vllm.tensor_parallel_size=8"], RENAMED_KEYS)
    from data_prep.config import REPLACED_KEYS

    with pytest.raises(ConfigError, match="'capture.vllm.fidelity' is now 'vllm.capture_fidelity'"):
        check_keys({"capture": {"vllm": {"fidelity": "hf"}}}, PrepConfig, renamed=RENAMED_KEYS)
    # the file queue's flow-control keys are gone: what replaced them is named, on the command line and composed
    with pytest.raises(ConfigError, match="'capture.vllm.max_pending_files' is no longer read: .* vllm.scratch_gb"):
        refuse_renamed(["capture.vllm.max_pending_files=8"], RENAMED_KEYS, REPLACED_KEYS)
    with pytest.raises(ConfigError, match="'capture.vllm.chunk_tokens' is no longer read: .* vllm.max_in_flight"):
        check_keys({"capture": {"vllm": {"chunk_tokens": 8}}}, PrepConfig, renamed=RENAMED_KEYS,
                   replaced=REPLACED_KEYS)


def test_missing_vllm_is_named_before_anything_loads(tmp_path: Path, monkeypatch) -> None:
    if VLLM_PYTHON == sys.executable:
        pytest.skip("this interpreter has vLLM")
    with pytest.raises(VLLMUnavailable, match="not importable by .* vllm.python is not set"):
        resolve_python(None)
    with pytest.raises(VLLMUnavailable, match=r"vllm.python='/nonexistent/python' is not an executable"):
        resolve_python("/nonexistent/python")
    # this venv's python runs the real worker's check: no vllm to import
    with pytest.raises(VLLMUnavailable, match=rf"has vLLM none; this needs vLLM >= {MIN_VLLM}.*import vllm"):
        check_vllm(sys.executable, VLLM_PLUGIN)
    # an older vLLM (a package that says so, first on the path) is named with the version needed
    fake = tmp_path / "site" / "vllm"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "0.10.1"\n')
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    with pytest.raises(VLLMUnavailable, match=rf"has vLLM 0.10.1; this needs vLLM >= {MIN_VLLM}"):
        check_vllm(sys.executable, VLLM_PLUGIN)


def test_prep_refuses_missing_vllm_before_loading_the_target(tmp_path: Path, tiny_target_dir: Path,
                                                            tiny_sharegpt_file: Path, monkeypatch) -> None:
    import data_prep.pipeline as pipeline

    def no_load(*_a, **_k):
        raise AssertionError("the target was loaded before the vLLM check")

    monkeypatch.setattr(pipeline, "load_target", no_load)
    with pytest.raises(VLLMUnavailable, match="vllm.python='/nonexistent/python'"):
        run_prep(tmp_path / "p", str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=4, eval_samples=2,
                 **{"regen.enabled": False, "capture.engine": "vllm", "vllm.python": "/nonexistent/python"})
    with pytest.raises(VLLMUnavailable, match="vLLM 0.9.0; this needs"):
        monkeypatch.setenv("STANDIN_VERSION", "0.9.0")
        run_prep(tmp_path / "q", str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=4, eval_samples=2,
                 **{"regen.enabled": False, "capture.engine": "vllm", "vllm.python": standin(tmp_path)})


def _samples(prep: Path, split: str) -> dict:
    return {s.sample_id: s for s in ShardSet(prep / split)}


def _assert_same_shards(ours_dir: Path, ref_dir: Path, teacher: str, one_pass: bool = False) -> None:
    """`one_pass`: ours made by capture.one_pass, in regeneration order, its rows from the final request's last
    generated token on zeros (no objective reads them: nothing after them is loss-masked); the rows before, equal."""
    for split in ("train", "eval"):
        ours, ref = _samples(ours_dir, split), _samples(ref_dir, split)
        if one_pass:
            assert sorted(ours) == sorted(ref)
        else:
            assert list(ours) == list(ref)  # the same samples in the same (capture) order
        for sid, r in ref.items():
            o = ours[sid]
            assert torch.equal(o.input_ids, r.input_ids) and torch.equal(o.loss_mask, r.loss_mask)
            z = len(o)
            if one_pass:
                while z > 0 and not o.taps[z - 1].any():
                    z -= 1
                assert z < len(o) and not o.loss_mask[z + 1:].any(), (sid, z)
            # fp32 forwards of one sample (here) and of a padded batch (HF capture), stored bf16: a rounding apart
            torch.testing.assert_close(o.taps[:z].float(), r.taps[:z].float(), atol=0, rtol=2 ** -7)
            if teacher == "hidden":
                torch.testing.assert_close(o.teacher_hidden[:z].float(), r.teacher_hidden[:z].float(), atol=0,
                                           rtol=2 ** -7)
            else:
                assert torch.equal(o.teacher_topk_ids[:z, 0], r.teacher_topk_ids[:z, 0])


def test_vllm_engine_prep_writes_the_hf_capture_and_resumes(tmp_path: Path, tiny_target_dir: Path,
                                                             tiny_sharegpt_file: Path, monkeypatch) -> None:
    teacher = "hidden"
    common = {"num_samples": 8, "eval_samples": 2, "regen.enabled": False, "capture.teacher": teacher,
              "capture.tap_layers": [1, 3, 7]}  # 7: the last layer as a tap (the teacher's column)
    hf = run_prep(tmp_path / "hf", str(tiny_target_dir), str(tiny_sharegpt_file), **common)
    python = standin(tmp_path)
    log = tmp_path / "asked.txt"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    # the stand-in crashes after 2 probe files + 3 samples (one request in flight: the server's order is prep's)
    scratch = tmp_path / "scratch"
    vllm_cfg = {**common, "capture.engine": "vllm", "vllm.python": python, "capture.tokens_per_shard": 1,
                "vllm.max_in_flight": 1, "vllm.scratch_dir": str(scratch)}
    out = tmp_path / "vllm"
    # the crash in a process of its own, as `make prep` runs (its exit frees the prep directory's lock)
    args = [f"{k}={v}".replace(" ", "") for k, v in {**vllm_cfg, "model": tiny_target_dir, "data": tiny_sharegpt_file,
                                                     "out": out}.items()]
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "prep.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, "STANDIN_FAIL_AFTER": "5"}, timeout=600)
    # one message by the rank that saw it, naming the server, its log and how it ended; no traceback; an engine error
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.count("engine error on rank 0 of 1") == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert re.search(r"vLLM server http://127.0.0.1:\d+ \(log: .*vllm.r0.log\) exited: the server exited with status 3",
                     proc.stderr), proc.stderr[-3000:]
    written = completed_sample_ids(out / "train") | completed_sample_ids(out / "eval")
    assert len(written) == 3  # one sample per shard: each recorded as soon as it is written
    assert scratch.is_dir() and not list(scratch.iterdir())  # the launch's scratch went with it
    log.unlink()
    import data_prep.pipeline as pipeline

    def no_load(*_a, **_k):
        raise AssertionError("capture.engine=vllm loaded the whole target into the prep process")

    monkeypatch.setattr(pipeline, "load_target", no_load)  # vLLM holds the layers; prep reads the head alone
    summary = run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), **vllm_cfg)
    second = log.read_text().splitlines()
    assert sum(line.startswith("server ") for line in second) == 1  # one server for the rank's splits
    asked = [line for line in second if line == "capture sample"]
    total = sum(hf["samples"].values())
    assert len(asked) == total - 3 and second.count("capture probe") == 2  # the rest only, each once
    assert summary["samples"] == hf["samples"] and summary["tokens"] == hf["tokens"]
    fidelity = summary["fidelity"]["vllm"]  # the head on the engine's teacher against the engine's own top-1
    assert fidelity["engine"] == "vLLM" and fidelity["argmax_agreement"] == 1.0 and fidelity["tokens"] > 50
    assert fidelity["max_logprob_diff"] < 1e-4 and "hf" not in fidelity
    # the head and config prep stores (what training reads) are the HF prep's, byte for byte
    assert summary["target_head_sha256"] == hf["target_head_sha256"]
    assert (out / "target_config.json").read_text() == (tmp_path / "hf" / "target_config.json").read_text()
    _assert_same_shards(out, tmp_path / "hf", teacher)
    # the servers' files went to node-local scratch, gone with the launch: the prep directory has its shards only
    assert not list(scratch.iterdir())
    assert not [p for p in out.rglob("*.safetensors") if not {"shards", "rendered"} & set(p.parts) and p.parent != out]


def test_vllm_engine_compact_teacher_from_the_prep_head(tmp_path: Path, tiny_target_dir: Path,
                                                       tiny_sharegpt_file: Path) -> None:
    common = {"num_samples": 4, "eval_samples": 2, "regen.enabled": False, "capture.teacher": "topk",
              "capture.topk": 4}
    run_prep(tmp_path / "hf", str(tiny_target_dir), str(tiny_sharegpt_file), **common)
    summary = run_prep(tmp_path / "vllm", str(tiny_target_dir), str(tiny_sharegpt_file), **common,
                       **{"capture.engine": "vllm", "vllm.python": standin(tmp_path),
                          "vllm.capture_fidelity": "hf"})
    _assert_same_shards(tmp_path / "vllm", tmp_path / "hf", "topk")
    # fidelity=hf: the transformers target loaded beside the engine, every tap compared with its forward
    against_hf = summary["fidelity"]["vllm"]["hf"]
    assert against_hf["argmax_agreement"] == 1.0 and max(against_hf["max_rel_diff"].values()) < 1e-5


def test_a_head_that_is_not_the_engines_is_refused_before_writing(tmp_path: Path, tiny_target_dir: Path,
                                                                  tiny_sharegpt_file: Path, monkeypatch) -> None:
    from data_prep.fidelity import FidelityError

    monkeypatch.setenv("STANDIN_OTHER_HEAD", "1")  # the engine's next-token choices are not the target head's
    with pytest.raises(FidelityError, match=r"head on vLLM's teacher hidden states does not reproduce vLLM's own "
                                            r"next-token choice .* argmax differs from vLLM's top-1 at \d+ of"):
        run_prep(tmp_path / "p", str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=4, eval_samples=2,
                 **{"regen.enabled": False, "capture.engine": "vllm", "vllm.python": standin(tmp_path)})
    assert not list((tmp_path / "p" / "train").glob("shards/*.safetensors"))


def test_files_that_are_not_the_samples_are_refused(tmp_path: Path, tiny_target_dir: Path,
                                                    tiny_sharegpt_file: Path, monkeypatch) -> None:
    monkeypatch.setenv("STANDIN_BAD_TOKENS", "1")
    with pytest.raises(VLLMCaptureError, match=r"\.safetensors \(sample 'probe:0'\): its token ids .* are not the"):
        run_prep(tmp_path / "p", str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=4, eval_samples=2,
                 **{"regen.enabled": False, "capture.engine": "vllm", "vllm.python": standin(tmp_path)})
    assert not list((tmp_path / "p" / "train").glob("shards/*.safetensors"))


def _replies(prep: Path) -> dict[str, list]:
    from data_prep.regenerate import read_results

    out = {}
    for path in sorted((prep / "regen").glob("*.jsonl")):
        for cid, rec in read_results(path).items():
            out[cid] = [(m["role"], m["content"], m.get("cut", False)) for m in rec["messages"]]
    return out


@pytest.mark.parametrize("capture_engine", ["vllm", "hf"])
def test_one_vllm_engine_regenerates_then_captures(tmp_path: Path, tiny_target_dir: Path, tiny_sharegpt_file: Path,
                                                   monkeypatch, capture_engine: str) -> None:
    """regen.backend=vllm: prep's engine regenerates (the prompts rendered and the replies decoded by prep, as the
    hf backend does), and with capture.engine=vllm the same engine, started once, then captures (two passes:
    capture.one_pass=false; one pass is tests/test_prep_one_pass.py); the replies and shards are the hf backend's
    and the HF capture's (batch 1 greedy on both sides: no padding)."""
    import data_prep.pipeline as pipeline

    common = {"num_samples": 6, "eval_samples": 2, "regen.max_new_tokens": 12, "regen.batch_size": 1,
              "capture.tap_layers": [1, 3, 7], "draft_vocab_count": "train"}
    hf = run_prep(tmp_path / "hf", str(tiny_target_dir), str(tiny_sharegpt_file), **common)
    log = tmp_path / "asked.txt"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    loads = []
    real_load = pipeline.load_target
    monkeypatch.setattr(pipeline, "load_target", lambda *a, **k: loads.append(1) or real_load(*a, **k))
    out = tmp_path / "vllm"
    summary = run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), **common,
                       **{"regen.backend": "vllm", "capture.engine": capture_engine, "vllm.python": standin(tmp_path),
                          "capture.one_pass": False})
    lines = log.read_text().splitlines()
    servers = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("server ")]
    generates = [i for i, line in enumerate(lines) if line == "generate"]
    assert len(servers) == 1 and generates  # one server, started once, regenerated
    if capture_engine == "vllm":
        assert servers[0]["layers"] == [2, 4, 8] and not loads  # it extracts; no transformers target
        captured = [i for i, line in enumerate(lines) if line.startswith("capture ")]
        assert captured and max(generates) < min(captured)  # regenerated first, then captured by the same server
    else:
        assert servers[0]["layers"] == [] and loads == [1]  # regeneration alone; HF capture after it
    def regen_counts(summary: dict) -> list:
        return [{split: {k: v for k, v in c.items() if k not in ("elapsed_s", "out_path")} for split, c in part.items()}
                for part in summary["regen"]]

    assert _replies(out) == _replies(tmp_path / "hf") and regen_counts(summary) == regen_counts(hf)
    assert summary["samples"] == hf["samples"] and summary["tokens"] == hf["tokens"]
    assert summary["capture_pass"] == {split: {"with_regeneration": 0, "prefill": n}
                                       for split, n in hf["samples"].items()}
    _assert_same_shards(out, tmp_path / "hf", "hidden")
    assert (out / "vllm.r0.log").exists()


def test_the_demos_vllm_prep_composes() -> None:
    """`make demo`'s prep overrides (the Makefile's DEMO_PREP_ARGS + DEMO_VLLM_ARGS) compose and validate: one
    vLLM engine regenerates and captures, eager, from the repository's .venv-vllm."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from data_prep.config import prep_config

    shown = subprocess.run(["make", "-s", "--eval=print-%: ; @echo $($*)", "print-DEMO_PREP_ARGS",
                            "print-DEMO_VLLM_ARGS"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    ConfigStore.instance().store(name="prep_schema", node=PrepConfig)
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "prep"), version_base="1.3"):
        cfg = prep_config(compose(config_name="prep", overrides=["out=x", *shown.split()]))
    cfg.validate()
    assert (cfg.regen.backend, cfg.capture.engine, cfg.max_len, cfg.regen.batch_size) == ("vllm", "vllm", 1024, 256)
    assert cfg.vllm.engine_kwargs == {"enforce_eager": True}
    assert cfg.vllm.python == str(ROOT / ".venv-vllm" / "bin" / "python")


# ------------------------------------------------------------------------------------------------------------
# Opt-in: the real vLLM engine (CPU build) on the embedded target

needs_vllm = pytest.mark.skipif(
    not (VLLM_PYTHON and os.access(VLLM_PYTHON, os.X_OK)),
    reason="opt-in: set DRAFTERS_VLLM_PYTHON to the python of a vLLM install (make capture-check)",
)
# Tolerances the real engine is held to (fp32 both sides): max abs difference relative to the largest magnitude
# of each tap / the teacher, and the argmax of the logits the prep's head recomputes from the teacher. Measured
# (bench/results/vllm_capture.json, 40 samples): at most 1.5e-6 relative, every argmax the same.
REL_TOL = 1e-5
ARGMAX_AGREEMENT = 0.999


@needs_vllm
def test_real_vllm_capture_matches_hf_capture(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_vllm_capture", ROOT / "bench" / "vllm_capture.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    compare, rendered_samples = bench.compare, bench.rendered_samples
    samples = rendered_samples(num=12, max_len=512)
    result = compare(samples, VLLM_PYTHON, tmp_path)
    print(result)
    for name, d in result["taps"].items():
        assert d["max_rel_diff"] <= REL_TOL, (name, d)
    assert result["teacher"]["max_rel_diff"] <= REL_TOL, result["teacher"]
    assert result["argmax_agreement"] >= ARGMAX_AGREEMENT, result
    assert result["fidelity"]["argmax_agreement"] >= ARGMAX_AGREEMENT
    # the default check, without a transformers target: the head on vLLM's teacher gives vLLM's own top-1
    assert result["engine_head_check"]["argmax_agreement"] >= ARGMAX_AGREEMENT, result["engine_head_check"]
    assert result["next_token_agreement"] >= ARGMAX_AGREEMENT, result


@needs_vllm
def test_real_vllm_prep_regenerates_and_captures_on_one_engine(tmp_path: Path, monkeypatch) -> None:
    """`make prep ... regen.backend=vllm capture.engine=vllm` on the embedded target: one vLLM engine regenerates the
    replies and captures their samples, the prep process reads the head's tensors alone, the engine-side fidelity
    check passes, the shards are complete, and the replies are the hf backend's (greedy, fp32 both)."""
    import data_prep.pipeline as pipeline

    common = {"num_samples": 6, "eval_samples": 2, "max_len": 384, "dtype": "float32", "draft_vocab_count": "train",
              "regen.max_new_tokens": 48}
    hf = tmp_path / "hf"
    run_prep(hf, "smollm2-135m-instruct", "sharegpt-embedded", **common, **{"stage": "render"})

    def no_load(*_a, **_k):
        raise AssertionError("regen.backend=vllm capture.engine=vllm loaded the whole target into the prep process")

    monkeypatch.setattr(pipeline, "load_target", no_load)
    out = tmp_path / "p"
    summary = run_prep(out, "smollm2-135m-instruct", "sharegpt-embedded", **common,
                       **{"regen.backend": "vllm", "capture.engine": "vllm", "vllm.python": VLLM_PYTHON,
                          "vllm.engine_kwargs": {"enforce_eager": True}})
    print(summary["fidelity"])
    log = (out / "vllm.r0.log").read_text()
    assert log.count("Starting to load model") == 1  # one engine, built once, for both stages
    assert summary["fidelity"]["vllm"]["argmax_agreement"] >= ARGMAX_AGREEMENT
    for split in ("train", "eval"):  # every rendered sample captured (a conversation over max_len is skipped)
        assert 0 < len(ShardSet(out / split)) == summary["samples"][split]
    ours, ref = _replies(out), _replies(hf)
    same = sum(ours[c] == ref[c] for c in ref if c in ours)
    print(f"replies identical to the hf backend's: {same}/{len(ref)}")
    assert set(ours) == set(ref) and same >= len(ref) - 1  # fp32 greedy: a near-tie may differ in one


# One pass against two on the real engine (fp32): the states vLLM computed while decoding against a prefill of the
# same tokens, per tensor over the rows an objective reads (bench/one_pass_capture.py's measure).
ONE_PASS_REL_TOL = 1e-4


@needs_vllm
def test_real_vllm_one_pass_matches_two_passes(tmp_path: Path) -> None:
    """capture.one_pass on the real engine: vLLM's connector with `include_output_tokens` saves the prompt's and the
    reply's states, the samples come from them with no prefill, the replies are the two-pass prep's and the features
    a prefill's within ONE_PASS_REL_TOL."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_one_pass", ROOT / "bench" / "one_pass_capture.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    common = {"num_samples": 6, "eval_samples": 2, "max_len": 384, "dtype": "float32", "draft_vocab_count": "train",
              "regen.max_new_tokens": 48, "regen.backend": "vllm", "capture.engine": "vllm",
              "vllm.python": VLLM_PYTHON, "vllm.engine_kwargs": {"enforce_eager": True}}
    run_prep(tmp_path / "two", "smollm2-135m-instruct", "sharegpt-embedded", **common, **{"capture.one_pass": False})
    one = run_prep(tmp_path / "one", "smollm2-135m-instruct", "sharegpt-embedded", **common)
    result, _ = bench.compare(tmp_path / "one", tmp_path / "two")
    print(json.dumps({k: result[k] for k in ("wall_s", "capture_pass", "one_pass", "replies", "features")}, indent=1))
    for split, n in one["samples"].items():
        assert one["capture_pass"][split]["with_regeneration"] + one["capture_pass"][split]["prefill"] == n > 0
    assert sum(c["with_regeneration"] for c in one["capture_pass"].values()) >= sum(one["samples"].values()) - 1
    assert result["replies"]["identical"] >= result["replies"]["conversations"] - 1  # a near-tie may differ in one
    assert result["features"]["samples_compared"] >= sum(one["samples"].values()) - 1
    for name, d in result["features"]["rel_diff"].items():
        assert d["max"] <= ONE_PASS_REL_TOL, (name, d)
    assert one["one_pass"]["next_token_agreement"] >= ARGMAX_AGREEMENT


@needs_vllm
def test_real_vllm_prep_loads_no_transformers_target(tmp_path: Path, monkeypatch) -> None:
    """`make prep ... capture.engine=vllm` on the embedded target: vLLM holds the layers, the prep process reads the
    head's tensors alone, the engine-side fidelity check passes, and the shards are complete."""
    import data_prep.pipeline as pipeline

    def no_load(*_a, **_k):
        raise AssertionError("capture.engine=vllm loaded the whole target into the prep process")

    monkeypatch.setattr(pipeline, "load_target", no_load)
    summary = run_prep(tmp_path / "p", "smollm2-135m-instruct", "sharegpt-embedded", num_samples=6, eval_samples=2,
                       max_len=256, dtype="float32", draft_vocab_count="train",
                       **{"regen.enabled": False, "capture.engine": "vllm", "vllm.python": VLLM_PYTHON,
                          "vllm.engine_kwargs": {"enforce_eager": True}})
    print(summary["fidelity"])
    assert summary["fidelity"]["vllm"]["argmax_agreement"] >= ARGMAX_AGREEMENT
    for split in ("train", "eval"):  # every rendered sample captured (a conversation over max_len is skipped)
        assert 0 < len(ShardSet(tmp_path / "p" / split)) == summary["samples"][split]


def _prep_process(out: Path, model: Path, data: Path, env: dict, **overrides) -> subprocess.Popen:
    """`python launch/prep.py ...` in a process of its own (as `make prep` runs it)."""
    args = [f"{k}={v}".replace(" ", "") for k, v in {**overrides, "model": model, "data": data, "out": out}.items()]
    return subprocess.Popen([sys.executable, str(ROOT / "launch" / "prep.py"), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **env})


def _wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    import time

    deadline = time.time() + timeout_s
    while not (path.exists() and text in path.read_text()):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)


def _gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    import time

    def alive(pid: int) -> bool:
        stat = Path(f"/proc/{pid}/stat")
        return stat.exists() and stat.read_text().split()[2] not in ("Z", "X")

    deadline = time.time() + timeout_s
    while time.time() < deadline and any(map(alive, pids)):
        time.sleep(0.2)
    return not any(map(alive, pids))


def test_kill_9_of_prep_leaves_no_server_and_sigterm_resumes_equal(tmp_path: Path, tiny_target_dir: Path,
                                                                  tiny_sharegpt_file: Path) -> None:
    """kill -9 of prep mid-capture: its server and the server's own child are gone within seconds, and the rerun's
    launch reads none of its files. SIGTERM mid-capture: the samples written are recorded in a last shard, exit 75,
    and the resume gives the uninterrupted prep's shards, every sample once."""
    import signal

    common = {"num_samples": 8, "eval_samples": 2, "regen.enabled": False, "capture.tap_layers": [1, 3, 7],
              "draft_vocab_count": "train"}
    hf = run_prep(tmp_path / "hf", str(tiny_target_dir), str(tiny_sharegpt_file), **common)
    log = tmp_path / "standin.log"
    vllm_cfg = {**common, "capture.engine": "vllm", "vllm.python": standin(tmp_path), "capture.tokens_per_shard": 1,
                "vllm.max_in_flight": 2, "vllm.scratch_dir": str(tmp_path / "scratch")}
    env = {"STANDIN_LOG": str(log), "STANDIN_SLOW_S": "0.3"}
    out = tmp_path / "vllm"
    proc = _prep_process(out, tiny_target_dir, tiny_sharegpt_file, env, **vllm_cfg)
    _wait_for(log, "capture sample", proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    server = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("server "))[7:])
    assert _gone([server["pid"], server["child"]]), "prep's vLLM server outlived kill -9 of prep"

    log.unlink()
    proc = _prep_process(out, tiny_target_dir, tiny_sharegpt_file, env, **vllm_cfg)
    _wait_for(log, "capture sample\ncapture sample\ncapture sample", proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]  # preempted: resumable
    server = json.loads(next(line for line in log.read_text().splitlines() if line.startswith("server "))[7:])
    assert _gone([server["pid"], server["child"]])
    written = completed_sample_ids(out / "train") | completed_sample_ids(out / "eval")
    assert 0 < len(written) < sum(hf["samples"].values())
    summary = run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), **vllm_cfg)
    assert summary["samples"] == hf["samples"] and summary["tokens"] == hf["tokens"]
    _assert_same_shards(out, tmp_path / "hf", "hidden")  # every sample once, equal to the HF capture's
    assert not list((tmp_path / "scratch").iterdir())


def test_prep_on_the_users_servers(tmp_path: Path, tiny_target_dir: Path, tiny_sharegpt_file: Path,
                                   monkeypatch) -> None:
    """vllm.urls: a server already running (started with the flags docs/scaling.md gives; its key in
    $OPENAI_API_KEY) regenerates and captures; prep starts none and gives the HF route's replies and shards."""
    from serving.client import ServerSpec, serve_args
    from serving.server import VLLMServer
    from serving.states import engine_layer_ids

    common = {"num_samples": 6, "eval_samples": 2, "regen.max_new_tokens": 12, "regen.batch_size": 1,
              "capture.tap_layers": [1, 3, 7], "draft_vocab_count": "train"}
    run_prep(tmp_path / "hf", str(tiny_target_dir), str(tiny_sharegpt_file), **common)
    log = tmp_path / "standin.log"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    spec = ServerSpec(model=str(tiny_target_dir), dtype="float32", max_model_len=2049, hidden_size=64,
                      layer_ids=engine_layer_ids([1, 3, 7], 8))
    with VLLMServer(standin(tmp_path), serve_args(spec, tmp_path / "server-spool", cuda=False),
                    log_path=tmp_path / "server.log") as server:
        server.wait_healthy(120)
        monkeypatch.setenv("OPENAI_API_KEY", server.key)
        out = tmp_path / "vllm"
        run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), **common,
                 **{"regen.backend": "vllm", "capture.engine": "vllm", "vllm.urls": [server.url]})
    assert sum(line.startswith("server ") for line in log.read_text().splitlines()) == 1  # the user's, only
    assert _replies(out) == _replies(tmp_path / "hf")
    _assert_same_shards(out, tmp_path / "hf", "hidden", one_pass=True)  # the user's server keeps the states too
    assert not (out / "vllm.r0.log").exists()  # prep started no server


def test_an_unusable_vllm_python_is_one_message_and_exit_2(tmp_path: Path, tiny_target_dir: Path,
                                                           tiny_sharegpt_file: Path) -> None:
    proc = _prep_process(tmp_path / "p", tiny_target_dir, tiny_sharegpt_file, {}, num_samples=4, eval_samples=2,
                         **{"regen.enabled": False, "capture.engine": "vllm", "vllm.python": "venv/bin/python"})
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "vllm.python='venv/bin/python' is not an executable file" in err


def _vllm_processes(python: str) -> list[int]:
    """Processes of the vLLM install at `python` (the API server, its engine core and workers, by command line
    or by vLLM's own process titles)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if state not in ("Z", "X") and (python in cmdline or cmdline.startswith("VLLM::")):
            found.append(int(proc.name))
    return found


def _real_capture_prep(tmp_path: Path) -> dict:
    """The real-vLLM capture prep's overrides (12 samples, fp32, one sample a shard), after the HF prep of the same
    samples in tmp_path/hf; none of vLLM may be running (the tests count its processes)."""
    assert not _vllm_processes(VLLM_PYTHON), "another vLLM is running: this test counts its processes"
    common = {"num_samples": 12, "eval_samples": 2, "max_len": 384, "dtype": "float32", "draft_vocab_count": "train",
              "regen.enabled": False}
    run_prep(tmp_path / "hf", "smollm2-135m-instruct", "sharegpt-embedded", **common)
    return {**common, "capture.engine": "vllm", "vllm.python": VLLM_PYTHON, "capture.tokens_per_shard": 1,
            "vllm.max_in_flight": 2, "vllm.scratch_dir": str(tmp_path / "scratch")}


def _started_until_a_shard(out: Path, vllm_cfg: dict, env: dict) -> subprocess.Popen:
    """The real-vLLM prep in a process of its own, returned once it has written one more shard."""
    import time

    proc = _prep_process(out, "smollm2-135m-instruct", "sharegpt-embedded", env, **vllm_cfg,
                         **{"+vllm.engine_kwargs.enforce_eager": "true"})
    deadline = time.time() + 600
    before = len(completed_sample_ids(out / "train")) if (out / "train").exists() else 0
    while (len(completed_sample_ids(out / "train")) if (out / "train").exists() else 0) <= before:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.5)
    return proc


@needs_vllm
def test_real_vllm_kill_9_leaves_no_vllm_process_and_sigterm_resumes_equal(tmp_path: Path) -> None:
    """The real server under prep: kill -9 of prep mid-capture leaves no vLLM process (API server, engine core,
    worker); SIGTERM mid-capture exits 75 with what it wrote recorded, and the resume completes the shards, every
    sample once, equal to the HF capture of the same samples (fp32 both)."""
    import signal
    import time

    vllm_cfg = _real_capture_prep(tmp_path)
    out = tmp_path / "vllm"

    def start_and_wait_for_a_shard() -> subprocess.Popen:
        return _started_until_a_shard(out, vllm_cfg, {})

    proc = start_and_wait_for_a_shard()
    assert _vllm_processes(VLLM_PYTHON)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.time() + 60
    while _vllm_processes(VLLM_PYTHON) and time.time() < deadline:
        time.sleep(0.5)
    assert not _vllm_processes(VLLM_PYTHON), "vLLM processes outlived kill -9 of prep"

    proc = start_and_wait_for_a_shard()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    assert not _vllm_processes(VLLM_PYTHON)
    summary = run_prep(out, "smollm2-135m-instruct", "sharegpt-embedded", **vllm_cfg,
                       **{"vllm.engine_kwargs": {"enforce_eager": True}})
    hf = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert summary["samples"] == hf["samples"] and summary["tokens"] == hf["tokens"]
    for split in ("train", "eval"):  # every sample once, in capture order, its features the HF capture's
        ours, ref = _samples(out, split), _samples(tmp_path / "hf", split)
        assert list(ours) == list(ref)
        for sid, r in ref.items():
            o = ours[sid]
            assert torch.equal(o.input_ids, r.input_ids) and torch.equal(o.loss_mask, r.loss_mask)
            # another implementation of the forward, fp32, stored bf16: within a rounding of each value, or of the
            # tensor's scale for values near zero (measured: 1.1e-6 of the scale, bench/results/vllm_capture.json)
            for a, b in ((o.taps, r.taps), (o.teacher_hidden, r.teacher_hidden)):
                torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=REL_TOL * float(b.abs().max()))
    assert not list((tmp_path / "scratch").iterdir())


@pytest.mark.integration
@pytest.mark.parametrize(("stage", "signame"), [("capture", "SIGUSR1"), ("capture", "SIGTERM"),
                                                ("regeneration", "SIGUSR1"), ("regeneration", "SIGTERM")])
def test_a_step_wide_signal_stops_prep_cleanly_and_the_rerun_is_equal(tmp_path: Path, tiny_target_dir: Path,
                                                                      tiny_sharegpt_file: Path, stage: str,
                                                                      signame: str) -> None:
    """SIGUSR1 or SIGTERM to every process of the step during a vLLM regeneration or capture (SLURM's --signal=USR1@N,
    or its SIGTERM at the time limit): the server ignores SIGUSR1 and exits on SIGTERM, as vLLM does; prep exits 75
    either way, with what it finished recorded, nothing of its servers left running and its scratch gone; the rerun
    gives the uninterrupted prep's replies and shards, every sample once."""
    import signal

    common = {"num_samples": 6, "eval_samples": 2, "regen.max_new_tokens": 12, "regen.batch_size": 1,
              "capture.tap_layers": [1, 3, 7], "draft_vocab_count": "train", "capture.tokens_per_shard": 1}
    hf = run_prep(tmp_path / "hf", str(tiny_target_dir), str(tiny_sharegpt_file), **common)
    log = tmp_path / "standin.log"
    scratch = tmp_path / "scratch"
    # the capture stage's prefills: two passes; a stop mid-regeneration: one pass, its samples written as it goes
    one_pass = stage == "regeneration"
    cfg = {**common, "regen.backend": "vllm", "capture.engine": "vllm", "vllm.python": standin(tmp_path),
           "vllm.max_in_flight": 2, "vllm.scratch_dir": str(scratch), "capture.one_pass": one_pass}
    out = tmp_path / "vllm"
    proc = _prep_process(out, tiny_target_dir, tiny_sharegpt_file, {"STANDIN_LOG": str(log), "STANDIN_SLOW_S": "0.4"},
                         **cfg)
    _wait_for(log, "capture sample\ncapture sample" if stage == "capture" else "generate\ngenerate", proc)
    pids = signal_step(proc.pid, getattr(signal, signame))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-3000:]
    assert "Traceback" not in err and "engine error" not in err, err[-3000:]
    assert _gone(pids), "a process of prep's step outlived its stop"
    assert not list(scratch.iterdir())
    summary = run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), **cfg)
    assert _replies(out) == _replies(tmp_path / "hf")
    assert summary["samples"] == hf["samples"] and summary["tokens"] == hf["tokens"]
    _assert_same_shards(out, tmp_path / "hf", "hidden", one_pass)  # every sample once


@pytest.mark.integration
def test_a_failing_server_of_rank_1_is_named_by_rank_1(tmp_path: Path, tiny_target_dir: Path,
                                                       tiny_sharegpt_file: Path) -> None:
    """Two ranks, each with its own server (GPUs 0 and 1 as vLLM counts them); rank 1's crashes: rank 1 prints one
    message naming itself, the server, its log and vLLM's reason, and exits with the engine-error status; no other
    rank claims the error."""
    env = {**os.environ, "STANDIN_DEVICES": "2", "STANDIN_FAIL_DEVICES": "1", "OMP_NUM_THREADS": "1"}
    args = [f"{k}={v}" for k, v in {"num_samples": 6, "eval_samples": 2, "regen.max_new_tokens": 8,
                                    "regen.backend": "vllm", "capture.engine": "vllm", "draft_vocab_count": "train",
                                    "vllm.python": standin(tmp_path), "capture.tap_layers": "[1,3,7]",
                                    "model": tiny_target_dir, "data": tiny_sharegpt_file,
                                    "out": tmp_path / "p"}.items()]
    from infra.processes import free_port

    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(ROOT / "launch" / "prep.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    err = done.stderr
    assert done.returncode != 0
    assert err.count("engine error on rank 1 of 2") == 1 and "engine error on rank 0" not in err, err[-4000:]
    line = next(x for x in err.splitlines() if "engine error on rank 1 of 2" in x)
    assert re.search(r"vLLM server http://127.0.0.1:\d+ \(log: .*/p/vllm.r1.log\) exited: RuntimeError: CUDA error: "
                     r"an illegal memory access was encountered", line), line
    assert "exitcode  : 3" in err  # torchrun's report of rank 1: the engine-error status


@pytest.mark.integration
def test_a_users_server_in_another_dtype_is_refused_naming_both(tmp_path: Path, tiny_target_dir: Path,
                                                                tiny_sharegpt_file: Path, monkeypatch) -> None:
    from serving.client import ServerSpec, serve_args
    from serving.server import VLLMServer
    from serving.states import engine_layer_ids

    spec = ServerSpec(model=str(tiny_target_dir), dtype="bfloat16", max_model_len=2049, hidden_size=64,
                      layer_ids=engine_layer_ids([1, 3, 7], 8))
    with VLLMServer(standin(tmp_path), serve_args(spec, tmp_path / "spool", cuda=False),
                    log_path=tmp_path / "server.log") as server:
        server.wait_healthy(120)
        proc = _prep_process(tmp_path / "p", tiny_target_dir, tiny_sharegpt_file, {"OPENAI_API_KEY": server.key},
                             num_samples=4, eval_samples=2, dtype="float32", draft_vocab_count="train",
                             **{"regen.enabled": False, "capture.engine": "vllm", "capture.tap_layers": "[1,3,7]",
                                "vllm.urls": f"[{server.url}]"})
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3 and "Traceback" not in err, err[-3000:]
    assert re.search(r"vLLM server http://127.0.0.1:\d+ computes in bfloat16, prep in float32 .*start it with --dtype "
                     r"float32", err), err[-3000:]


def _socket_files(root: Path) -> set[str]:
    import stat

    return {p.name for p in root.iterdir() if stat.S_ISSOCK(p.lstat().st_mode)} if root.is_dir() else set()


@needs_vllm
def test_real_vllm_step_wide_signals_and_a_killed_guard(tmp_path: Path) -> None:
    """The real server under prep, signalled SLURM's way (every process of the step: prep, the guard, vLLM's API
    server, engine core and worker): SIGUSR1 mid-capture exits 75 (vLLM ignores it, prep stops), SIGTERM mid-capture
    exits 75 (vLLM exits on it, prep stops all the same); kill -9 of the guard alone mid-capture is one engine error
    naming the server and its guard; nothing of vLLM is left running and no socket file of its is left in $TMPDIR
    after any of them; the resume completes the shards, every sample once, equal to the HF capture."""
    import signal
    import time

    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    vllm_cfg = _real_capture_prep(tmp_path)
    out = tmp_path / "vllm"

    def start_and_wait_for_a_shard() -> subprocess.Popen:
        return _started_until_a_shard(out, vllm_cfg, {"TMPDIR": str(tmpdir)})

    def nothing_left() -> None:
        deadline = time.time() + 60
        while _vllm_processes(VLLM_PYTHON) and time.time() < deadline:
            time.sleep(0.5)
        assert not _vllm_processes(VLLM_PYTHON), "vLLM processes outlived the stop"
        assert not _socket_files(tmpdir), "vLLM's socket files were left in $TMPDIR"

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        proc = start_and_wait_for_a_shard()
        assert len(process_tree(proc.pid)) >= 4  # prep, the guard, the sentinel, vLLM's API server and its engine
        signal_step(proc.pid, sig)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 75 and "Traceback" not in err, err[-3000:]
        nothing_left()
    proc = start_and_wait_for_a_shard()
    guard = next(p for p in process_tree(proc.pid) if "--guard" in Path(f"/proc/{p}/cmdline").read_bytes().decode(
        errors="replace").replace("\0", " "))
    os.kill(guard, signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 3 and err.count("engine error on rank 0 of 1") == 1, err[-3000:]
    assert re.search(r"vLLM server http://127.0.0.1:\d+ \(log: .*vllm.r0.log\) exited: its guard \(pid \d+\) was killed "
                     r"by SIGKILL", err), err[-3000:]
    nothing_left()
    summary = run_prep(out, "smollm2-135m-instruct", "sharegpt-embedded", **vllm_cfg,
                       **{"vllm.engine_kwargs": {"enforce_eager": True}})
    hf = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert summary["samples"] == hf["samples"] and summary["tokens"] == hf["tokens"]
    for split in ("train", "eval"):
        assert list(_samples(out, split)) == list(_samples(tmp_path / "hf", split))  # every sample once, in order
    assert not list((tmp_path / "scratch").iterdir())
