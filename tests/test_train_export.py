"""Export from a training checkpoint (launch/export.py, CPU, offline) and from the end of a run: the
exported weights are the checkpoint's, and the export reloads as a working drafter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from synthetic_prep import write_synthetic_prep

from models.eagle3 import export_keys, load_export
from models.target_head import EMBED_KEY

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled"}


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 0, f"{cmd}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("export")
    prep = write_synthetic_prep(base / "prep", n_train=8, n_eval=2, min_len=12, max_len=32)
    out = base / "run"
    _run([sys.executable, str(ROOT / "launch" / "train.py"), "+exp=debug", f"data.dir={prep}", f"out_dir={out}",
          "train.max_steps=2", "train.save_interval=1", "train.keep_checkpoints=1", "data.max_len=64",
          "data.eval_batch_size=2", "deepspeed.zero_stage=2"])
    return prep, out


def test_export_from_checkpoint_matches_checkpoint_and_reloads(run_dir, tmp_path: Path) -> None:
    prep, run = run_dir
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_000002"]  # keep=1 rotated
    out = tmp_path / "exported"
    _run([sys.executable, str(ROOT / "launch" / "export.py"), f"checkpoint={run}", f"out={out}",
          "max_position_embeddings=4096"])
    tensors = load_file(str(out / "model.safetensors"))
    assert sorted(tensors) == sorted(export_keys())  # no embedding, no optimizer state
    ckpt = load_file(str(run / "checkpoints" / "step_000002" / "model.safetensors"))
    for key in export_keys():
        src = ckpt[f"param/{key}"] if f"param/{key}" in ckpt else ckpt[f"buffer/{key}"]
        expected = src.to(torch.bfloat16) if src.is_floating_point() else src
        assert torch.equal(tensors[key], expected), key
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["max_position_embeddings"] == 4096
    tap_layers = json.loads((prep / "train" / "manifest.json").read_text())["tap_layers"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in tap_layers]

    embed = load_file(str(prep / "target_head.safetensors"))["embed_tokens.weight"]
    drafter = load_export(out, target_weights={EMBED_KEY: embed})
    d2t = load_file(str(prep / "draft_vocab.safetensors"))["d2t"]
    assert torch.equal(drafter.d2t, d2t)
    taps = torch.randn(1, 5, drafter.cfg.fc_in_features)
    with torch.no_grad():
        logits = drafter.compute_logits(drafter.forward_step(drafter.fuse(taps), torch.arange(5)[None], torch.arange(5)))
    assert logits.shape == (1, 5, d2t.numel()) and torch.isfinite(logits).all()


def test_end_of_run_export_equals_final_checkpoint_export(run_dir, tmp_path: Path) -> None:
    _, run = run_dir
    from train.export import export_checkpoint

    again = export_checkpoint(run / "checkpoints" / "step_000002", tmp_path / "again")
    final, redo = load_file(str(run / "export" / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert final.keys() == redo.keys() and all(torch.equal(final[k], redo[k]) for k in final)
    assert json.loads((run / "export" / "config.json").read_text()) == json.loads((again / "config.json").read_text())


def test_the_export_records_its_target_and_a_re_export_against_another_is_refused(run_dir, tmp_path: Path) -> None:
    """config.json keeps the prep's target (engines ignore the key); the checkpoint recorded it when saved, and a
    re-export whose prep directory now holds another target's prep is refused, naming both."""
    import shutil

    from models.export import TARGET_KEY, ExportError
    from train.export import export_checkpoint

    prep, run = run_dir
    manifest = json.loads((prep / "train" / "manifest.json").read_text())
    recorded = json.loads((run / "export" / "config.json").read_text())[TARGET_KEY]
    assert recorded == {**{k: manifest["target"][k] for k in ("id", "architecture", "num_layers", "hidden_size",
                                                              "vocab_size")},
                        "tokenizer_hash": manifest["tokenizer_hash"] or None, "tap_layers": manifest["tap_layers"]}
    step = run / "checkpoints" / "step_000002"
    assert json.loads((step / "state.json").read_text())["target"]["id"] == manifest["target"]["id"]
    # the prep directory re-made for another target (another vocabulary), the checkpoint copied beside it
    other_prep, other_step = tmp_path / "prep", tmp_path / "ckpt" / "step_000002"
    shutil.copytree(prep, other_prep)
    shutil.copytree(step, other_step)
    m = json.loads((other_prep / "train" / "manifest.json").read_text())
    m["target"].update(id="org/other", vocab_size=m["target"]["vocab_size"] + 64)
    (other_prep / "train" / "manifest.json").write_text(json.dumps(m))
    state = json.loads((other_step / "state.json").read_text())
    (other_step / "state.json").write_text(json.dumps({**state, "data_dir": str(other_prep)}))
    with pytest.raises(ExportError) as e:
        export_checkpoint(other_step, tmp_path / "out")
    assert "was trained for synthetic" in str(e.value) and "is now for org/other" in str(e.value), str(e.value)
    assert "differ in vocab_size" in str(e.value)


def test_a_checkpoint_that_does_not_name_its_family_is_refused(run_dir, tmp_path: Path) -> None:
    """No fallback family: a checkpoint whose state.json lacks `method` is not exported as some default."""
    import shutil

    from models.export import ExportError
    from train.export import export_checkpoint

    _, run = run_dir
    step = tmp_path / "ckpt" / "step_000002"
    shutil.copytree(run / "checkpoints" / "step_000002", step)
    state = json.loads((step / "state.json").read_text())
    (step / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "method"}))
    with pytest.raises(ExportError, match="does not record its drafter family"):
        export_checkpoint(step, tmp_path / "out")
    (step / "state.json").write_text(json.dumps({**state, "method": "medusa"}))
    with pytest.raises(ValueError, match="unknown drafter method 'medusa'"):
        export_checkpoint(step, tmp_path / "out")


def _fresh_drafter(prep: Path, *overrides: tuple[str, object]):
    """The drafter a run on `prep` builds (model.* overrides as (key, value)), and the prep's head."""
    from data_prep.shards import Manifest
    from train.build import load_head
    from train.config import DataConfig, RunConfig
    from train.objective import make_objective

    cfg = RunConfig(out_dir="unused", data=DataConfig(dir=str(prep), max_len=64))
    for key, value in overrides:
        setattr(cfg.model, key, value)
    head = load_head(prep)
    torch.manual_seed(0)
    tap_layers = Manifest.from_file(prep / "train" / "manifest.json").tap_layers
    return make_objective(cfg).build_drafter(prep, tap_layers, head), head


def test_init_from_loads_every_trained_tensor_of_the_export(run_dir) -> None:
    """train.init_from: the drafter starts with the export's weights and draft vocabulary mapping (bf16 in the export,
    so equal to its bf16 values), the target's frozen embedding untouched."""
    from train.build import init_from_export
    from train.export import prep_target

    prep, run = run_dir
    drafter, head = _fresh_drafter(prep)
    embed = drafter.embed_tokens.weight.clone()
    info = init_from_export(drafter, run / "export", prep, head, prep_target(prep))
    exported = load_file(str(run / "export" / "model.safetensors"))
    state = drafter.state_dict()
    for key in export_keys():
        assert torch.equal(state[key].to(exported[key].dtype), exported[key]), key
    assert torch.equal(drafter.embed_tokens.weight, embed)
    assert info["family"] == "eagle3" and info["draft_vocab_shared"] == 1.0


def test_init_from_takes_a_public_layout_and_refuses_what_does_not_fit(run_dir, tmp_path: Path) -> None:
    """A released drafter in the engine layout (layers.0.* keys, pytorch_model.bin, no target record) loads the same
    weights; an export for another target, another draft vocabulary size or another family is refused before
    training, naming the export and what differs (with the key that sets it)."""
    from models.export import TARGET_KEY, ExportError
    from train.build import init_from_export
    from train.export import prep_target

    prep, run = run_dir
    target = prep_target(prep)
    public = tmp_path / "public"
    public.mkdir()
    tensors = load_file(str(run / "export" / "model.safetensors"))
    torch.save({k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}, public / "pytorch_model.bin")
    config = json.loads((run / "export" / "config.json").read_text())
    (public / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != TARGET_KEY}))
    drafter, head = _fresh_drafter(prep)
    init_from_export(drafter, public, prep, head, target)
    assert torch.equal(drafter.fc.weight.to(torch.bfloat16), tensors["fc.weight"])

    other = tmp_path / "other_target"
    other.mkdir()
    (other / "model.safetensors").write_bytes((run / "export" / "model.safetensors").read_bytes())
    (other / "config.json").write_text(json.dumps({**config, TARGET_KEY: {**config[TARGET_KEY], "hidden_size": 4096}}))
    with pytest.raises(ExportError, match=r"train.init_from=.*other_target was trained for .* differ in hidden_size"):
        init_from_export(_fresh_drafter(prep)[0], other, prep, head, target)

    smaller, _ = _fresh_drafter(prep, ("draft_vocab_size", 16))
    with pytest.raises(ExportError, match=r"draft_vocab_size \d+ \(this run: 16, set model.draft_vocab_size\)"):
        init_from_export(smaller, run / "export", prep, head, target)

    dflash = tmp_path / "dflash"
    dflash.mkdir()
    (dflash / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    with pytest.raises(ExportError, match=r"is a DFlash drafter; this run trains model.method=eagle3"):
        init_from_export(_fresh_drafter(prep)[0], dflash, prep, head, target)


def test_init_from_an_export_for_another_target_id_warns_once_naming_both(tmp_path: Path) -> None:
    """An export of the same shape and tokenizer recorded for another model id than the prep's: training starts from
    it (a user may mean it) with one warning naming both ids; one recorded for the prep's own id, none."""
    import warnings

    from models.export import stamp_target, target_fingerprint
    from models.registry import family
    from train.build import init_from_export
    from train.export import prep_target

    prep = write_synthetic_prep(tmp_path / "prep", n_train=4, n_eval=2, min_len=12, max_len=32)
    target = prep_target(prep)
    assert target is not None and target["id"] == "synthetic"
    drafter, head = _fresh_drafter(prep)
    for name, recorded in (("same", "Synthetic"), ("other", "someone/other-model")):  # ids compare case aside
        out = family("eagle3").save_export(drafter, tmp_path / name)
        stamp_target(out, target_fingerprint({**target, "id": recorded}, target["tokenizer_hash"],
                                             drafter.tap_layers))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        init_from_export(_fresh_drafter(prep)[0], tmp_path / "same", prep, head, target)
        assert not seen, [str(w.message) for w in seen]
        info = init_from_export(_fresh_drafter(prep)[0], tmp_path / "other", prep, head, target)
    said = [str(w.message) for w in seen]
    assert len(said) == 1, said
    assert "trained for target someone/other-model" in said[0] and f"prep {prep} is for target synthetic" in said[0]
    assert info["export"] == str(tmp_path / "other")  # loaded all the same


def test_a_run_started_from_an_export_begins_where_the_export_ended(run_dir, tmp_path: Path) -> None:
    """End to end: the held-out loss of a run started with train.init_from is, before its first step, the exporting
    run's final one (to the export's bf16 rounding), not a fresh drafter's."""
    prep, run = run_dir
    first = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in first if r.get("kind") == "eval"]
    out = tmp_path / "continued"
    _run([sys.executable, str(ROOT / "launch" / "train.py"), "+exp=debug", f"data.dir={prep}", f"out_dir={out}",
          "train.max_steps=1", "data.max_len=64", "data.eval_batch_size=2", "deepspeed.zero_stage=2",
          f"train.init_from={run / 'export'}", "train.eval_interval=1", "train.export=false"])
    second = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in second if r.get("kind") == "eval" and r["step"] == 0)
    fresh, ended = evals[0], evals[-1]
    assert ended["step"] == 2 and fresh["step"] == 0
    assert start["loss_k"][0] == pytest.approx(ended["loss_k"][0], rel=2e-2)
    assert abs(start["loss_k"][0] - ended["loss_k"][0]) < abs(fresh["loss_k"][0] - ended["loss_k"][0]) / 4


def test_a_resume_from_another_export_is_refused(run_dir, tmp_path: Path) -> None:
    """train.init_from decides the weights a run started from: a resume naming another export is another run."""
    from train.config import DataConfig, RunConfig
    from train.trainer import RunDirError, check_resume, resume_settings

    prep, run = run_dir
    cfg = RunConfig(out_dir=str(tmp_path), data=DataConfig(dir=str(prep)))
    cfg.train.init_from = str(run / "export")
    state = {"settings": resume_settings(cfg)}
    assert check_resume(cfg, state, tmp_path) == []
    cfg.train.init_from = str(tmp_path)
    with pytest.raises(RunDirError, match=r"train.init_from: .*export.* -> "):
        check_resume(cfg, state, tmp_path)
