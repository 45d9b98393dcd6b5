"""EAGLE-1 (docs/method.md §2): its feature tap, loss, lossless decoding, export round trip and a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import run_train
from tiny_models import tiny_llama

from eval.sampling import SamplingParams
from eval.spec_decode import SpecSettings, SpeculativeDecoder, plain_generate
from eval.target import TargetRunner
from models.eagle1 import Eagle1Config, Eagle1Drafter, export_keys, load_export, save_export
from models.target_head import TargetHead
from train.batch import Batch
from train.eagle1 import TOKEN_WEIGHT, Eagle1Objective
from train.ttt import TTTSettings

torch.set_num_threads(1)


def _drafter_for(target, seed: int = 0) -> Eagle1Drafter:
    torch.manual_seed(seed)
    drafter = Eagle1Drafter(Eagle1Config.from_target_config(target.config.to_dict()))
    drafter.to(target.dtype)
    drafter.load_target_weights(target.get_input_embeddings().weight, target.get_output_embeddings().weight)
    return drafter.eval().requires_grad_(False)


def _target_head(target) -> TargetHead:
    cfg = target.config
    head = TargetHead(cfg.hidden_size, cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps).to(target.dtype)
    with torch.no_grad():
        head.norm.weight.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight)
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
    return head


def test_final_feature_tap_is_the_normed_last_layer_output() -> None:
    """Decoding feeds the runner's FINAL_FEATURE tap; training feeds head.norm(teacher_hidden), where
    teacher_hidden is the last decoder layer's output before the final norm (data_prep/capture.py)."""
    target = tiny_llama(vocab=32, seed=1)
    grabbed = {}
    target.model.layers[-1].register_forward_hook(lambda m, i, o: grabbed.update(h=o[0] if isinstance(o, tuple) else o))
    ids = [3, 7, 1, 9, 4]
    runner = TargetRunner(target, _drafter_for(target).tap_layers)
    out = runner.forward(ids, runner.new_cache())
    expected = _target_head(target).norm(grabbed["h"][0])
    torch.testing.assert_close(out.taps, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(target.lm_head(out.taps), out.logits, rtol=0, atol=1e-12)


@pytest.mark.parametrize("settings", [SpecSettings(mode="chain", depth=4),
                                      SpecSettings(mode="tree", depth=4, topk=3, total_tokens=10)])
def test_greedy_speculative_decoding_is_lossless(settings: SpecSettings) -> None:
    target = tiny_llama(vocab=32, seed=0)
    drafter = _drafter_for(target, seed=2)
    runner = TargetRunner(target, drafter.tap_layers)
    decoder = SpeculativeDecoder(runner, drafter, settings)
    for prompt in ([1], [5, 9, 2, 7], [3, 3, 3, 11, 4, 20, 1]):
        spec = decoder.generate(prompt, 24, SamplingParams())
        plain = plain_generate(runner, prompt, 24, SamplingParams())
        assert spec.output_ids == plain.output_ids
        assert spec.target_forwards <= plain.target_forwards


def test_export_round_trip_and_public_layout(tmp_path: Path) -> None:
    target = tiny_llama(vocab=32, seed=0, dtype=torch.float32)
    drafter = _drafter_for(target, seed=3)
    save_export(drafter, tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == set(export_keys(drafter.cfg))
    assert "layers.0.input_layernorm.weight" not in keys and "fc.bias" in keys  # EAGLE-1's layer 0
    weights = {"embed_tokens.weight": target.get_input_embeddings().weight,
               "lm_head.weight": target.get_output_embeddings().weight}
    loaded = load_export(tmp_path, target_weights=weights)
    h = torch.randn(1, 5, drafter.cfg.hidden_size)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    for m in (drafter, loaded):
        m.float()
    torch.testing.assert_close(loaded.compute_logits(loaded.forward_step(h, ids, torch.arange(5))),
                               drafter.compute_logits(drafter.forward_step(h, ids, torch.arange(5))),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="target_weights"):
        load_export(tmp_path)


def _batch(target, T: int = 12, B: int = 2, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 32, (B, T), generator=g)
    loss_mask = torch.rand(B, T, generator=g) > 0.3
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, T - 3 :] = False
    loss_mask &= valid
    H = target.config.hidden_size
    return Batch(input_ids=ids, loss_mask=loss_mask, valid=valid, taps=torch.zeros(B, T, H),
                 teacher_hidden=torch.randn(B, T, H, generator=g, dtype=torch.float64))


def test_loss_matches_the_definition_and_splits_exactly() -> None:
    target = tiny_llama(vocab=32, seed=0, dtype=torch.float64)
    head = _target_head(target)
    drafter = _drafter_for(target, seed=4).requires_grad_(True)
    for p in (drafter.embed_tokens.weight, drafter.lm_head.weight):
        p.requires_grad_(False)
    batch = _batch(target)
    obj = Eagle1Objective(TTTSettings(steps=1, chunk_size=5))
    counts, _ = obj.count(drafter, head, batch)
    loss, sums = obj.loss(drafter, head, batch, counts)

    # The definition, written naively: rows j with j+1 a real, loss-masked token, predicted from t = j-1.
    f = head.norm(batch.teacher_hidden)
    pred = drafter.forward_step(f, torch.roll(batch.input_ids, -1, 1), torch.arange(12))
    feat, ce, n = 0.0, 0.0, 0
    for b in range(2):
        for j in range(1, 11):
            if batch.valid[b, j + 1] and batch.loss_mask[b, j + 1]:
                n += 1
                feat = feat + F.smooth_l1_loss(pred[b, j - 1], f[b, j])
                p = torch.softmax(head.lm_head(f[b, j]), -1)
                ce = ce - (p * torch.log_softmax(drafter.compute_logits(pred[b, j - 1]), -1)).sum()
    assert int(counts[0]) == n == int(sums["n_valid_k"][0])
    # (the CE path of train/loss.py accumulates in fp32)
    torch.testing.assert_close(loss, (feat + TOKEN_WEIGHT * ce) / n, rtol=1e-7, atol=1e-9)

    halves = [Batch(**{k: (v[i : i + 1] if isinstance(v, torch.Tensor) else v) for k, v in vars(batch).items()})
              for i in range(2)]
    split = sum(obj.loss(drafter, head, h, counts)[0] for h in halves)
    torch.testing.assert_close(split, loss, rtol=1e-10, atol=1e-12)


def test_short_real_run_on_embedded_target_learns(smollm2_prep_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    rows = run_train(out, "+exp=debug", "model=eagle1", f"data.dir={smollm2_prep_dir}", "train.max_steps=30",
                     "train.epochs=100", "train.ttt_steps=1", "train.eval_ttt_steps=3", "train.lr=5e-4",
                     "train.warmup_steps=3", "train.eval_interval=30", "train.save_interval=0", "data.batch_size=2",
                     "data.eval_max_samples=2")
    evals = [r for r in rows if r["kind"] == "eval"]
    first, last = evals[0], evals[-1]
    assert len(last["acc_k"]) == 3  # held-out unrolls eval_ttt_steps
    # EAGLE-1 learns tokens slowly (the CE has weight 0.1; lr 5e-4 is the fastest stable one here)
    assert last["loss_k"][0] < 0.85 * first["loss_k"][0]
    assert last["acc_k"][0] > first["acc_k"][0] + 0.03
    assert any("feat_k" in r for r in rows if r["kind"] == "train")
    config = json.loads((out / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_eagle3_reads_its_taps_out_of_a_wider_prep() -> None:
    """One prep with the union of EAGLE-3's and DFlash's layers serves EAGLE-3: model.tap_layers picks the
    columns, and the loss equals the loss on a prep with exactly those taps."""
    import dataclasses

    from tiny_models import tiny_drafter

    from train.eagle3 import Eagle3Objective

    target = tiny_llama(vocab=32, seed=0, dtype=torch.float64)
    drafter = tiny_drafter(target, tap_layers=[0, 2, 1]).requires_grad_(True)
    head = _target_head(target)
    H = target.config.hidden_size
    g = torch.Generator().manual_seed(5)
    batch = dataclasses.replace(_batch(target), taps=torch.randn(2, 12, 3 * H, generator=g, dtype=torch.float64))
    source = [2, 0, 5, 1]  # the shards' tap layers; the drafter wants [0, 2, 1]
    cols = {0: 1, 2: 0, 1: 3}
    wide = torch.zeros(2, 12, 4 * H, dtype=torch.float64)
    for i, layer in enumerate([0, 2, 1]):
        wide[..., cols[layer] * H : (cols[layer] + 1) * H] = batch.taps[..., i * H : (i + 1) * H]
    wide[..., 2 * H : 3 * H] = torch.randn(2, 12, H, generator=g, dtype=torch.float64)
    obj = Eagle3Objective(TTTSettings(steps=2, chunk_size=7))
    obj.columns, obj.n_source_taps = [cols[layer] for layer in [0, 2, 1]], 4
    narrow = Eagle3Objective(TTTSettings(steps=2, chunk_size=7))
    counts, state = narrow.count(drafter, head, batch)
    expected, _ = narrow.loss(drafter, head, batch, counts, state)
    got, _ = obj.loss(drafter, head, dataclasses.replace(batch, taps=wide), counts, state)
    assert torch.equal(got, expected)
    from train.batch import tap_columns

    assert tap_columns(source, [0, 2, 1]) == obj.columns
    with pytest.raises(ValueError, match="capture.tap_layers"):
        tap_columns(source, [3])
