"""The EAGLE-3 quality levers (train/config.py, conf/lever/): what each option changes, and that a run with
them trains, checkpoints, exports and reloads under ZeRO-3."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from ttt_stubs import random_batch, vocab

from models.eagle3 import Eagle3Config, Eagle3Drafter, export_keys, load_export, save_export
from models.target_head import EMBED_KEY, TargetHead
from train.engine import lr_lambda
from train.ttt import TTTSettings, shifted_ids, ttt_loss, unroll

ROOT = Path(__file__).resolve().parents[1]
V, VD, H = 96, 40, 32


def tiny(**flags) -> Eagle3Drafter:
    cfg = Eagle3Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                       vocab_size=V, draft_vocab_size=VD, tap_layers=[1, 2, 3], max_position_embeddings=256,
                       **flags)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(cfg)
    drafter.load_target_embedding(torch.randn(V, H))
    drafter.set_vocab_mapping(*vocab(V, VD, torch.Generator().manual_seed(0)))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return drafter


def test_wsd_schedule_is_flat_then_decays_linearly_to_the_floor() -> None:
    warm, total = 4, 20
    lrs = [lr_lambda(s, warm, total, 0.1, "wsd", 0.25) for s in range(total)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4:15] == [1.0] * 11  # stable until the last 25% (5 steps) of the run
    assert lrs[15:] == pytest.approx([1.0 - 0.9 * i / 4 for i in range(5)])  # linear, ending at the floor
    assert lrs[-1] == pytest.approx(0.1)


def test_warmup_ratio_is_a_fraction_of_the_run() -> None:
    from train.config import ConfigError, RunConfig

    t = RunConfig().train
    assert t.warmup(200) == t.warmup_steps  # unset: the fixed number of steps
    t.warmup_ratio = 0.04
    assert (t.warmup(200), t.warmup(84), t.warmup(10)) == (8, 3, 1)  # never 0 steps of warmup
    cfg = RunConfig()
    cfg.data.dir, cfg.train.warmup_ratio = "/x", 1.0
    with pytest.raises(ConfigError, match="warmup_ratio"):
        cfg.validate(1)


def test_output_head_from_the_target() -> None:
    drafter = tiny()
    head = TargetHead(H, V, 1e-6)
    with torch.no_grad():
        head.lm_head.weight.normal_()
        head.norm.weight.uniform_(1.5, 2.0)
    drafter.init_output_from_target(head.lm_head.weight, head.norm.weight)
    rows = drafter.draft_to_target(torch.arange(VD))
    assert torch.equal(drafter.lm_head.weight, head.lm_head.weight[rows])
    assert torch.equal(drafter.norm.weight, head.norm.weight)
    # the drafter's logit for draft id d is the target's for token d2t(d) on the same hidden state
    h = torch.randn(5, H)
    torch.testing.assert_close(drafter.compute_logits(h), head.logits(h)[:, rows])


def test_fc_norm_normalises_each_tap_and_norm_output_feeds_the_normed_state() -> None:
    plain, variant = tiny(), tiny(fc_norm=True, norm_output=True)
    taps = torch.randn(2, 6, 3 * H)
    scaled = taps.view(2, 6, 3, H) * torch.tensor([1.0, 30.0, 0.2])[:, None]
    with torch.no_grad():  # per-tap RMS norm: each tap's scale no longer matters
        variant.fc_norm.requires_grad_(False)
        for n in variant.fc_norm:
            n.weight.fill_(1.0)
        torch.testing.assert_close(variant.fuse(scaled.view(2, 6, -1)), variant.fuse(taps), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(plain.fuse(scaled.view(2, 6, -1)), plain.fuse(taps))
    batch = random_batch("hidden", [6, 4], V, H, n_taps=3, seed=0)
    outs = unroll(variant, batch, TTTSettings(steps=2))
    with torch.no_grad():  # step 1 takes the NORMED step-0 output (as drafting does), not the raw one
        from models.attention import TTTCache

        cache = TTTCache()
        pos = torch.arange(6).expand(2, 6)
        first = variant.forward_step(variant.fuse(batch.taps), shifted_ids(batch.input_ids, 1), pos, cache)
        second = variant.forward_step(variant.norm(first), shifted_ids(batch.input_ids, 2), pos + 1, cache)
    torch.testing.assert_close(outs[0], first)
    torch.testing.assert_close(outs[1], second)


def test_variant_export_declares_vllm_flags_and_round_trips(tmp_path: Path) -> None:
    d = tiny(fc_norm=True, norm_output=True)
    save_export(d, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["fc_norm"] is True and cfg["norm_output"] is True  # vLLM's llama_eagle3 reads these names
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(tensors) == sorted(export_keys(d.cfg))
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= set(tensors)
    back = load_export(tmp_path, target_weights={EMBED_KEY: d.embed_tokens.weight})
    assert back.cfg == dataclasses.replace(d.cfg, torch_dtype="float32")
    batch = random_batch("hidden", [7], V, H, n_taps=3, seed=1)
    head = TargetHead(H, V, 1e-6)
    with torch.no_grad():
        assert torch.equal(ttt_loss(back, head, batch, TTTSettings(steps=3))[0],
                           ttt_loss(d, head, batch, TTTSettings(steps=3))[0])


def test_feature_noise_scales_with_each_tap() -> None:
    batch = random_batch("hidden", [400], V, H, n_taps=3, seed=2)
    batch.taps = batch.taps * torch.tensor([1.0, 10.0, 100.0]).repeat_interleave(H)
    torch.manual_seed(0)
    noisy = batch.with_feature_noise(0.1, 3)
    rel = ((noisy.taps - batch.taps).view(1, 400, 3, H).pow(2).mean((0, 1, 3)).sqrt()
           / batch.taps.view(1, 400, 3, H).pow(2).mean((0, 1, 3)).sqrt())
    assert rel.tolist() == pytest.approx([0.1, 0.1, 0.1], rel=0.05)
    assert batch.with_feature_noise(0.0, 3) is batch


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "WANDB_MODE": "disabled"}


@pytest.mark.integration
def test_levers_train_checkpoint_and_export_under_zero3(tmp_path: Path) -> None:
    """A frozen target head (not in the optimizer) is still part of the checkpoint and the export, the
    variant flags reach the export, and a smaller draft vocabulary is cut from the prep's ranking."""
    from synthetic_prep import write_synthetic_prep

    prep = write_synthetic_prep(tmp_path / "prep", n_train=8, n_eval=2, min_len=12, max_len=32)
    out = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), "+exp=debug", f"data.dir={prep}", f"out_dir={out}",
           "train.max_steps=2", "train.save_interval=1", "data.max_len=64", "data.eval_batch_size=2",
           "+lever=head_frozen", "model.fc_norm=true", "model.norm_output=true", "model.draft_vocab_size=20",
           "train.schedule=wsd", "train.feature_noise=0.05", "train.accept_loss=log"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-5000:]
    head = load_file(str(prep / "target_head.safetensors"))
    export = load_file(str(out / "export" / "model.safetensors"))
    cfg = json.loads((out / "export" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 20 and cfg["fc_norm"] and cfg["norm_output"]
    rows = torch.arange(20) + export["d2t"]
    torch.testing.assert_close(export["lm_head.weight"].float(), head["lm_head.weight"][rows].to(torch.bfloat16).float())
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    moments = load_file(str(ckpt / "optimizer.safetensors"))
    assert "exp_avg/norm.weight" in moments and "exp_avg/fc_norm.0.weight" in moments
    assert not any("lm_head" in k for k in moments)  # frozen: not optimised ...
    assert "buffer/lm_head.weight" in load_file(str(ckpt / "model.safetensors"))  # ... but carried along
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "export.py"), f"checkpoint={out}",
                        f"out={tmp_path / 'again'}"], capture_output=True, text=True, env=_env(), timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert sorted(again) == sorted(export)
    assert all(torch.equal(again[k], export[k]) for k in export)
