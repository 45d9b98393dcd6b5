"""Short real training runs on shards of the real embedded target (launch/train.py, DeepSpeed ZeRO-3).

EAGLE-3: held-out loss falls, acc_0 rises. DFlash: held-out loss falls; the end-of-run export loads through
eval's generic loader and decodes losslessly. The fixture's shards carry EAGLE-3's taps [1, 14, 26] only, so the
DFlash drafter reads those (model.tap_layers); a real prep for both drafters carries the union
(`python -m train.dflash prep-taps`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import run_train


def test_short_run_on_embedded_target_learns(smollm2_prep_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rows = run_train(out, "+exp=debug", f"data.dir={smollm2_prep_dir}", "train.max_steps=40", "train.epochs=100",
                     "train.ttt_steps=3", "train.lr=3e-3", "train.warmup_steps=4", "train.eval_interval=40",
                     "train.save_interval=0", "data.batch_size=2", "data.eval_max_samples=2")
    evals = [r for r in rows if r["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and last["step"] == 40
    assert last["loss_k"][0] < 0.7 * first["loss_k"][0]
    assert last["acc_k"][0] > first["acc_k"][0] + 0.1
    assert last["sim_tau"] > first["sim_tau"]
    assert (out / "export" / "model.safetensors").exists()


def test_short_dflash_run_on_embedded_target_learns(smollm2_prep_dir: Path, smollm2_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rows = run_train(out, "+exp=debug", "model=dflash", "model.tap_layers=[1,14,26]",
                     "model.dflash.num_layers=2", "model.dflash.block_size=8", f"data.dir={smollm2_prep_dir}",
                     "train.max_steps=12", "train.epochs=100", "train.lr=2e-3", "train.warmup_steps=2", "train.dflash.anchors=16", "train.dflash.gamma=4",
                     "train.eval_interval=12", "train.save_interval=0", "data.batch_size=2",
                     "data.eval_max_samples=2", "train.chunk_size=512")
    evals = [r for r in rows if r["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    print(f"held-out loss_k sum {sum(first['loss_k']):.2f} -> {sum(last['loss_k']):.2f}, acc_1 "
          f"{first['acc_k'][0]:.3f} -> {last['acc_k'][0]:.3f}, sim_tau {first['sim_tau']:.3f} -> {last['sim_tau']:.3f}")
    assert first["step"] == 0 and last["step"] == 12
    assert len(last["loss_k"]) == 7 and first["n_valid_k"] == last["n_valid_k"]  # deterministic held-out blocks
    assert sum(last["loss_k"]) < 0.8 * sum(first["loss_k"])
    assert last["sim_tau"] >= first["sim_tau"]
    export = out / "export"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == [1, 14, 26]
    assert config["dflash_config"]["mask_token_id"] == 16  # SmolLM2's default (train.dflash.default_mask_token_id)

    from transformers import AutoModelForCausalLM

    from eval.run import load_drafter
    from eval.sampling import SamplingParams
    from eval.spec_decode import SpecSettings, SpeculativeDecoder, plain_generate
    from eval.target import TargetRunner

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    drafter = load_drafter(str(export), model, "cpu", torch.float32)
    assert drafter.tap_layers == [1, 14, 26] and drafter.block_size == 8
    runner = TargetRunner(model, drafter.tap_layers)
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 2, 198, 1, 4093, 198]
    plain = plain_generate(runner, prompt, 24, SamplingParams())
    spec = SpeculativeDecoder(runner, drafter, SpecSettings(mode="chain")).generate(prompt, 24, SamplingParams())
    assert spec.output_ids == plain.output_ids
