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
