"""Eagle3Config, RoPE, and the drafter: layout, TTT unroll across backends, TTT == inference, DecodeCache."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from models.attention import DecodeCache, TTTCache
from models.eagle3 import Eagle3Config, Eagle3Drafter, default_tap_layers
from models.layers import RMSNorm
from models.rope import rope_inv_freq

torch.set_num_threads(1)

TARGET = {  # a transformers-5 style target config dict (rope in rope_parameters)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "num_attention_heads": 4,
    "num_key_value_heads": 2, "intermediate_size": 48, "num_hidden_layers": 12, "vocab_size": 97,
    "rms_norm_eps": 1e-5, "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
}


def tiny_drafter(backend="reference", seed=0, **opts) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = Eagle3Config.from_target_config(TARGET, draft_vocab_size=40)
    d = Eagle3Drafter(cfg, attn_backend=backend, **opts)
    d.load_target_embedding(torch.randn(cfg.vocab_size, cfg.hidden_size))
    with torch.no_grad():  # non-trivial norm weights so a swapped norm would show
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d


# ---------------------------------------------------------------------------------------------- config
def test_from_target_config_reads_geometry_and_defaults():
    cfg = Eagle3Config.from_target_config(TARGET, draft_vocab_size=40)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 2, 8)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.draft_vocab_size, cfg.target_hidden_size) == (48, 97, 40, 32)
    assert cfg.tap_layers == [1, 5, 8] == default_tap_layers(12)  # [1, L//2-1, L-4]
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.fc_in_features == 96 and cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 256
    custom = Eagle3Config.from_target_config(TARGET, 40, tap_layers=[0, 3, 11], intermediate_size=64)
    assert custom.tap_layers == [0, 3, 11] and custom.intermediate_size == 64


def test_from_target_config_legacy_rope_keys():
    legacy = {k: v for k, v in TARGET.items() if k != "rope_parameters"}
    legacy |= {"rope_theta": 1e6, "head_dim": 16,
               "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}
    cfg = Eagle3Config.from_target_config(legacy, draft_vocab_size=97)
    assert cfg.rope_theta == 1e6 and cfg.head_dim == 16
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    plain = {k: v for k, v in legacy.items() if k != "rope_scaling"}
    assert Eagle3Config.from_target_config(plain, 97).rope_scaling is None


@pytest.mark.parametrize("override,match", [
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"vocab_size": 39}, "draft_vocab_size"),
    ({"tap_layers": [1, 5, 12]}, "out of range"),
    ({"tap_layers": [1, 1, 5]}, "duplicate"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type"),
    ({"hidden_act": "gelu"}, "silu"),
])
def test_validate_errors(override, match):
    with pytest.raises(ValueError, match=match):
        Eagle3Config.from_target_config(TARGET, 40, **override)


def test_unknown_override_and_partial_rotary_rejected():
    with pytest.raises(TypeError, match="unknown Eagle3Config overrides"):
        Eagle3Config.from_target_config(TARGET, 40, hidden_sise=3)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        Eagle3Config.from_target_config({**TARGET, "partial_rotary_factor": 0.5}, 40)
    with pytest.warns(UserWarning, match="3 \\* target_hidden_size"):
        Eagle3Config.from_target_config(TARGET, 40, tap_layers=[1, 5])


def test_hf_dict_round_trip_and_layer_id_convention():
    cfg = Eagle3Config.from_target_config(TARGET, draft_vocab_size=40)
    d = cfg.to_hf_dict()
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 6, 9]  # = (2, L//2, L-3), HF indexing
    assert Eagle3Config.from_hf_dict(d) == cfg
    hf = LlamaConfig.from_dict(d)  # what the engines build from config.json
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["rope_theta"] == 5000.0
    assert (hf.head_dim, hf.num_hidden_layers, hf.tie_word_embeddings) == (8, 1, False)
    no_ids = {**d, "eagle_config": {}}
    with pytest.raises(ValueError, match="target_num_layers"):
        Eagle3Config.from_hf_dict(no_ids)
    assert Eagle3Config.from_hf_dict(no_ids, target_num_layers=12).tap_layers == [1, 5, 8]
    with pytest.raises(ValueError, match="not supported"):
        Eagle3Config.from_hf_dict({**d, "norm_before_residual": True})
    with pytest.raises(ValueError, match="architectures"):
        Eagle3Config.from_hf_dict({**d, "architectures": ["LlamaForCausalLM"]})


# ------------------------------------------------------------------------------------------------ rope
ROPES = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "mscale": 0.7,
     "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
]


@pytest.mark.parametrize("scaling", ROPES)
def test_rope_matches_transformers(scaling):
    hf = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=1024,
                     rope_parameters={"rope_theta": 50000.0, **(scaling or {"rope_type": "default"})})
    rope_type = hf.rope_parameters["rope_type"]
    if rope_type == "default":  # not in ROPE_INIT_FUNCTIONS in transformers 5
        ref_inv, ref_factor = 1.0 / (50000.0 ** (torch.arange(0, 64, 2).float() / 64)), 1.0
    else:
        ref_inv, ref_factor = ROPE_INIT_FUNCTIONS[rope_type](hf, None)
    inv, factor = rope_inv_freq(64, 50000.0, scaling, 1024)
    torch.testing.assert_close(inv, ref_inv.float(), atol=0, rtol=1e-6)
    assert math.isclose(factor, ref_factor, rel_tol=1e-9)
    # end to end through the drafter's config: cos/sin equal transformers' LlamaRotaryEmbedding
    pos = torch.arange(0, 900, 7)[None]
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), pos)
    cfg = Eagle3Config.from_target_config({**hf.to_dict(), "num_hidden_layers": 8, "vocab_size": 11,
                                           "intermediate_size": 8}, draft_vocab_size=11)
    cos, sin = Eagle3Drafter(cfg).rotary(pos, torch.float32)
    torch.testing.assert_close((cos, sin), (ref_cos, ref_sin), atol=1e-5, rtol=1e-5)


def test_rmsnorm_matches_transformers():
    x = torch.randn(3, 5, 16, dtype=torch.bfloat16)
    ours, ref = RMSNorm(16, 1e-5), LlamaRMSNorm(16, eps=1e-5)
    with torch.no_grad():
        ours.weight.uniform_(0.5, 1.5)
        ref.weight.copy_(ours.weight)
    assert torch.equal(ours.to(torch.bfloat16)(x), ref.to(torch.bfloat16)(x))


# --------------------------------------------------------------------------------------------- drafter
def test_parameter_names_and_frozen_embedding():
    d = tiny_drafter()
    names = {n for n, _ in d.named_parameters()}
    expected = {"embed_tokens.weight", "fc.weight", "norm.weight", "lm_head.weight"} | {
        f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"} | {
        f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")} | {
        f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    assert names == expected
    assert set(d.state_dict()) == expected | {"d2t", "t2d"}  # rotary inv_freq is not persistent
    assert not d.embed_tokens.weight.requires_grad
    assert d.midlayer.self_attn.q_proj.weight.shape == (4 * 8, 64)  # q/k/v read 2H
    assert d.fc.weight.shape == (32, 96)


def test_step0_matches_hand_written_layout():
    """Step 0 by hand (dense causal attention, transformers' RoPE): embeds first in the concat, residual is the
    un-normed hidden stream, final norm only in compute_logits."""
    d = tiny_drafter()
    B, T = 2, 9
    taps, ids = torch.randn(B, T, 96), torch.randint(0, 97, (B, T))
    pos = torch.arange(T)[None].expand(B, T)
    out = d.forward_step(d.fuse(taps), ids, pos)

    m = d.midlayer
    h = taps @ d.fc.weight.T

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    x = torch.cat([rms(d.embed_tokens.weight[ids], m.input_layernorm.weight), rms(h, m.hidden_norm.weight)], -1)
    q = (x @ m.self_attn.q_proj.weight.T).view(B, T, 4, 8).transpose(1, 2)
    k = (x @ m.self_attn.k_proj.weight.T).view(B, T, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
    v = (x @ m.self_attn.v_proj.weight.T).view(B, T, 2, 8).transpose(1, 2).repeat_interleave(2, 1)
    cos, sin = LlamaRotaryEmbedding(LlamaConfig.from_dict(d.cfg.to_hf_dict()))(x, pos)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    att = (q @ k.transpose(-1, -2)) / math.sqrt(8) + torch.full((T, T), float("-inf")).triu(1)
    a = (att.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32) @ m.self_attn.o_proj.weight.T
    h2 = h + a
    y = rms(h2, m.post_attention_layernorm.weight)
    expected = h2 + (F.silu(y @ m.mlp.gate_proj.weight.T) * (y @ m.mlp.up_proj.weight.T)) @ m.mlp.down_proj.weight.T
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(d.compute_logits(out), rms(expected, d.norm.weight) @ d.lm_head.weight.T,
                               atol=1e-5, rtol=1e-5)


def _unroll(d, taps, ids, K):
    """TTT: step k at position t embeds x_{t+k+1} (here ids[:, t+k]) and sits at RoPE position t+k."""
    T = taps.shape[1]
    h, cache, outs = d.fuse(taps), TTTCache(), []
    for k in range(K):
        h = d.forward_step(h, ids[:, k:k + T], torch.arange(T) + k, cache)
        outs.append(h)
    return outs


@pytest.mark.parametrize("backend,opts", [("chunked", {"block_size": 4}), ("fused", {})])
def test_ttt_unroll_backend_matches_reference(backend, opts):
    ref, other = tiny_drafter("reference"), tiny_drafter(backend, **opts)
    other.load_state_dict(ref.state_dict())
    B, T, K = 2, 11, 4
    taps, ids = torch.randn(B, T, 96), torch.randint(0, 97, (B, T + K))
    results = []
    for d in (ref, other):
        outs = _unroll(d, taps, ids, K)
        logits = [d.compute_logits(h) for h in outs]
        loss = sum(0.8**k * F.cross_entropy(lg.flatten(0, 1), ids[:, k + 1:k + 1 + T].flatten() % 40)
                   for k, lg in enumerate(logits))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad}
        results.append((torch.stack(logits), grads))
        assert d.embed_tokens.weight.grad is None
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-4)
    assert results[0][1].keys() == results[1][1].keys() and len(results[0][1]) == 13
    for name, g in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_ttt_equals_chained_inference():
    """Query (t, k) of TTT sees exactly what drafting sees: the prefix 0..t from step 0, then its own chain."""
    d = tiny_drafter("fused")
    T, K = 8, 3
    taps, ids = torch.randn(1, T, 96), torch.randint(0, 97, (1, T + K))
    outs = _unroll(d, taps, ids, K)
    g = d.fuse(taps)
    for t in (0, 4, 7):
        cache = DecodeCache()
        d.forward_step(g[:, : t + 1], ids[:, : t + 1], torch.arange(t + 1), cache)
        for k in range(1, K):  # draft step k feeds back its own previous output at position t
            h = d.forward_step(outs[k - 1][:, t:t + 1], ids[:, t + k:t + k + 1], torch.tensor([t + k]), cache)
            torch.testing.assert_close(h[:, 0], outs[k][:, t], atol=1e-5, rtol=1e-4)


def test_decode_cache_incremental_equals_full_sequence():
    d = tiny_drafter("reference")
    B, T = 2, 9
    hidden, ids = torch.randn(B, T, 32), torch.randint(0, 97, (B, T))
    full = d.forward_step(hidden, ids, torch.arange(T))
    cache = DecodeCache()
    parts = [d.forward_step(hidden[:, :4], ids[:, :4], torch.arange(4), cache)]  # prefill, then one by one
    parts += [d.forward_step(hidden[:, t:t + 1], ids[:, t:t + 1], torch.tensor([t]), cache) for t in range(4, T)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-4)
    assert cache.length == T
    cache.truncate(5)  # roll back, replay
    again = d.forward_step(hidden[:, 5:], ids[:, 5:], torch.arange(5, T), cache)
    torch.testing.assert_close(again, full[:, 5:], atol=1e-5, rtol=1e-4)


def test_decode_cache_tree_mask_and_keep():
    """Three sibling candidates at position 5 (each sees the prefix and itself); keep the right one."""
    d = tiny_drafter("reference")
    T = 9
    hidden, ids = torch.randn(1, T, 32), torch.randint(0, 97, (1, T))
    full = d.forward_step(hidden, ids, torch.arange(T))
    cache = DecodeCache()
    d.forward_step(hidden[:, :5], ids[:, :5], torch.arange(5), cache)
    cand_ids = torch.tensor([[3, int(ids[0, 5]), 7]])
    cand_h = torch.stack([torch.randn(32), hidden[0, 5], torch.randn(32)])[None]
    mask = torch.cat([torch.ones(3, 5, dtype=torch.bool), torch.eye(3, dtype=torch.bool)], 1)[None, None]
    out = d.forward_step(cand_h, cand_ids, torch.full((3,), 5), cache, attn_mask=mask)
    torch.testing.assert_close(out[:, 1], full[:, 5], atol=1e-5, rtol=1e-4)
    cache.keep(torch.tensor([0, 1, 2, 3, 4, 6]))  # prefix + accepted candidate
    rest = d.forward_step(hidden[:, 6:], ids[:, 6:], torch.arange(6, T), cache)
    torch.testing.assert_close(rest, full[:, 6:], atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="DecodeCache"):
        d.forward_step(hidden, ids, torch.arange(T), TTTCache(), attn_mask=mask)


def test_vocab_mapping():
    d = tiny_drafter()
    targets = torch.sort(torch.randperm(97)[:40]).values
    t2d = torch.zeros(97, dtype=torch.bool)
    t2d[targets] = True
    d.set_vocab_mapping(targets - torch.arange(40), t2d)
    assert torch.equal(d.draft_to_target(torch.arange(40)), targets)
    assert torch.equal(d.draft_to_target(torch.tensor([[0, 39]])), targets[[0, 39]][None])
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        d.set_vocab_mapping(targets, t2d)  # absolute ids instead of offsets
    bad = t2d.clone()
    bad[targets[0]] = False
    with pytest.raises(ValueError, match="disagree"):
        d.set_vocab_mapping(targets - torch.arange(40), bad)
    with pytest.raises(ValueError, match="target embedding"):
        d.load_target_embedding(torch.zeros(97, 31))


def test_a_checkpoint_config_with_earlier_field_names_rebuilds() -> None:
    """A checkpoint's drafter_config.json written with aux_layer_ids / num_target_layers rebuilds (registry)."""
    import dataclasses

    from models.registry import family

    d = tiny_drafter()
    config = dataclasses.asdict(d.cfg)
    config["aux_layer_ids"] = config.pop("tap_layers")
    state = d.state_dict()
    params = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    again = family("eagle3").from_state(config, params, {k: state[k] for k in ("d2t", "t2d")})
    assert again.cfg.tap_layers == d.cfg.tap_layers == [1, 5, 8]
