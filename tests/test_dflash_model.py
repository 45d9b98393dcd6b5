"""The DFlash drafter: the training mask against its definition, the grouped attention against a dense
masked attention (outputs and gradients), default taps, and the export format (round trip, keys, config)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from models.dflash import (
    DFlashConfig,
    DFlashDrafter,
    anchored_attention,
    anchored_mask,
    default_tap_layers,
    export_keys,
    load_export,
    open_block_attention,
    save_export,
)

torch.set_num_threads(1)


def naive_mask(anchors: list[list[int]], ctx_len: int, bs: int) -> torch.Tensor:
    """From the definition, one entry at a time: query (block i, offset r) may see context position j iff
    j < anchor_i, and block key (block i', offset r') iff i' == i."""
    B, n = len(anchors), len(anchors[0])
    out = torch.zeros(B, n * bs, ctx_len + n * bs, dtype=torch.bool)
    for b in range(B):
        for i in range(n):
            for r in range(bs):
                for j in range(ctx_len):
                    out[b, i * bs + r, j] = j < anchors[b][i]
                for i2 in range(n):
                    for r2 in range(bs):
                        out[b, i * bs + r, ctx_len + i2 * bs + r2] = i2 == i
    return out


def test_mask_matches_definition() -> None:
    anchors = [[0, 3, 4, 9], [2, 2, 5, 11]]  # a block at 0 sees no context; equal anchors are separate blocks
    for bs in (1, 3):
        got = anchored_mask(torch.tensor(anchors), 12, bs)
        assert torch.equal(got, naive_mask(anchors, 12, bs))


def _dense(q, k, v, kc, vc, anchors, bs):
    """Dense reference: one softmax over [all context | all blocks] with the full mask, in float64."""
    g = q.shape[1] // k.shape[1]
    keys = torch.cat([kc, k], 2).repeat_interleave(g, 1).double()
    vals = torch.cat([vc, v], 2).repeat_interleave(g, 1).double()
    scores = q.double() @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5
    mask = anchored_mask(anchors, kc.shape[2], bs)[:, None]
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vals).to(q.dtype)


@pytest.mark.parametrize("group_rows", [4, 8, 1000])
def test_grouped_attention_equals_dense(group_rows: int) -> None:
    torch.manual_seed(0)
    B, Hq, Hkv, D, T, bs = 2, 4, 2, 8, 20, 4
    anchors = torch.tensor([[1, 4, 6, 13, 17], [0, 2, 9, 9, 0]])  # sorted but for padding (the last 0)
    n = anchors.shape[1]
    q = torch.randn(B, Hq, n * bs, D, requires_grad=True)
    k, v = (torch.randn(B, Hkv, n * bs, D, requires_grad=True) for _ in range(2))
    kc, vc = (torch.randn(B, Hkv, T, D, requires_grad=True) for _ in range(2))
    out = anchored_attention(q, k, v, kc, vc, anchors, bs, group_rows=group_rows)
    ref = _dense(q, k, v, kc, vc, anchors, bs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, kc, vc), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v, kc, vc), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_blocks_do_not_see_each_other_and_match_drafting() -> None:
    """A block's output in the batched training pass = the same block drafted alone after its context."""
    torch.manual_seed(0)
    d = tiny_drafter()
    T, bs = 14, d.block_size
    ctx = d.fuse(torch.randn(1, T, 3 * d.cfg.hidden_size))
    context = d.context_kv(ctx, torch.arange(T)[None])
    anchors = torch.tensor([[2, 5, 9]])
    ids = torch.randint(0, 60, (1, 3, bs))
    pos = anchors[..., None] + torch.arange(bs)

    def attend(*a):
        return anchored_attention(*a, anchors=anchors, block_size=bs, group_rows=bs)

    batched = d.forward(ids.view(1, -1), pos.view(1, -1), context, attend).view(1, 3, bs, -1)
    for i, a in enumerate(anchors[0].tolist()):
        alone = d.forward(ids[:, i], pos[:, i], [(k[:, :, :a], v[:, :, :a]) for k, v in context], open_block_attention)
        torch.testing.assert_close(batched[:, i], alone, rtol=1e-5, atol=1e-5)


def test_default_taps() -> None:
    assert default_tap_layers(30) == [1, 8, 14, 20, 27]  # SmolLM2 (ties round to even, like the engines)
    assert default_tap_layers(36) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_tap_layers(32, 1) == [16]
    with pytest.raises(ValueError):
        default_tap_layers(3)


def tiny_drafter(dtype=torch.float32) -> DFlashDrafter:
    cfg = DFlashConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, vocab_size=64,
                       tap_layers=[1, 3, 5], mask_token_id=63, num_hidden_layers=2, block_size=4,
                       target_num_layers=8, rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0})
    d = DFlashDrafter(cfg).to(dtype)
    torch.nn.init.normal_(d.embed_tokens.weight)
    torch.nn.init.normal_(d.lm_head.weight)
    for name, p in d.named_parameters():  # norms away from 1, so a swapped norm would show
        if name.endswith("norm.weight"):
            torch.nn.init.uniform_(p, 0.5, 1.5)
    return d


def test_export_round_trip(tmp_path) -> None:
    torch.manual_seed(1)
    d = tiny_drafter()
    target = {"embed_tokens.weight": d.embed_tokens.weight.detach().clone(),
              "lm_head.weight": d.lm_head.weight.detach().clone()}
    for dtype in (torch.float32, torch.bfloat16):
        out = save_export(d, tmp_path / str(dtype), dtype=dtype)
        tensors = load_file(str(out / "model.safetensors"))
        assert sorted(tensors) == sorted(export_keys(d.cfg))
        assert not any(k.startswith(("embed_tokens", "lm_head")) for k in tensors)
        assert all(t.dtype == dtype for t in tensors.values())
        loaded = load_export(out, target_weights=target, dtype=torch.float32)
        ref = DFlashDrafter(d.cfg)  # the original with its weights rounded through the export dtype
        ref.load_state_dict({k: v.to(dtype).float() if k in tensors else v for k, v in d.state_dict().items()})
        assert loaded.tap_layers == [1, 3, 5] and loaded.block_size == 4 and loaded.mask_token_id == 63
        from models.dflash import DFlashCache

        for model in (ref, loaded):
            model.eval()
        torch.manual_seed(2)
        taps = torch.randn(1, 7, 3 * 32)
        logits = []
        for model in (ref, loaded):
            cache = DFlashCache()
            model.extend_context(cache, taps, 0)
            logits.append(model.compute_logits(model.draft_block(cache, 5)))
        assert torch.equal(logits[0], logits[1])


def test_export_config_is_the_public_format(tmp_path) -> None:
    d = tiny_drafter()
    cfg = json.loads((save_export(d, tmp_path) / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": 63, "block_size": 4}
    assert cfg["block_size"] == 4 and cfg["num_target_layers"] == 8 and cfg["num_hidden_layers"] == 2
    assert cfg["tie_word_embeddings"] is False and cfg["layer_types"] == ["full_attention"] * 2
    assert cfg["rope_parameters"]["rope_theta"] == 5e5 and cfg["rope_scaling"]["factor"] == 2.0
    # what a public checkpoint without tap_layers means: the engines' default for its layer count
    public = {**cfg, "dflash_config": {"mask_token_id": 151669}, "num_target_layers": 36, "num_hidden_layers": 5,
              "layer_types": ["full_attention"] * 5, "vocab_size": 151936}
    parsed = DFlashConfig.from_hf_dict(public)
    assert parsed.tap_layers == [1, 9, 17, 25, 33] and parsed.block_size == 4 and parsed.mask_token_id == 151669
    with pytest.raises(ValueError, match="not supported"):
        DFlashConfig.from_hf_dict({**cfg, "dflash_config": {**cfg["dflash_config"], "selector_rank": 8}})
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.from_hf_dict({**cfg, "dflash_config": {"target_layer_ids": [1]}})


def test_registry_finds_dflash(tmp_path) -> None:
    from models.registry import family_of_export

    d = tiny_drafter()
    cfg = json.loads((save_export(d, tmp_path) / "config.json").read_text())
    fam = family_of_export(cfg)
    assert fam.method == "dflash" and (fam.drafter_cls, fam.config_cls) == (DFlashDrafter, DFlashConfig)
    import dataclasses

    params = {k: p.detach() for k, p in d.named_parameters() if p.requires_grad}
    assert not any(k in params for k in fam.frozen_keys)
    rebuilt = fam.from_state(dataclasses.asdict(d.cfg), params, {})
    assert torch.equal(rebuilt.fc.weight, d.fc.weight)
    assert float(rebuilt.lm_head.weight.abs().sum()) == 0.0  # the target's: never in a checkpoint
