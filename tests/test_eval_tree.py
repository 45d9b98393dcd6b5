"""Tree construction and tree attention on the target side (no drafter needed)."""

from __future__ import annotations

import pytest
import torch

from eval.target import TargetRunner, keep_kv
from eval.tree import additive_mask, ancestor_matrix, select_top_m, tree_attention_allowed

torch.set_num_threads(1)


def _eagle_like_nodes(depth: int, k: int, seed: int, tie_every: int = 0):
    """Drafted nodes as EAGLE-2 creates them: k at depth 1; per deeper level the top-k of the previous
    level each get k children with value = parent value + log-prob. Returns creation-order tensors."""
    g = torch.Generator().manual_seed(seed)
    vals = torch.log_softmax(torch.randn(k, generator=g, dtype=torch.float64) * 2, -1).sort(descending=True).values
    values, parents, depths = [vals], [torch.full((k,), -1)], [torch.ones(k, dtype=torch.long)]
    start = 0
    for d in range(2, depth + 1):
        cur = values[-1]
        sel = torch.sort(-cur, stable=True).indices[:k]
        lp = torch.log_softmax(torch.randn(len(sel), k, generator=g, dtype=torch.float64) * 2, -1)
        lp = lp.sort(dim=-1, descending=True).values
        if tie_every:
            lp[::tie_every, 0] = 0.0  # a certain child: value equals its parent's (a tie across depths)
        values.append((cur[sel][:, None] + lp).reshape(-1))
        parents.append((start + sel).repeat_interleave(k))
        depths.append(torch.full((len(sel) * k,), d))
        start += len(cur)
    return torch.cat(values), torch.cat(parents), torch.cat(depths)


@pytest.mark.parametrize("tie_every", [0, 2])
@pytest.mark.parametrize("m", [1, 5, 17, 40, 1000])
def test_top_m_is_connected_tree_with_best_values(m: int, tie_every: int) -> None:
    values, parents, depths = _eagle_like_nodes(depth=4, k=4, seed=m + tie_every, tie_every=tie_every)
    tokens = torch.arange(100, 100 + len(values))  # token = creation index + 100, to map back
    tree = select_top_m(values, parents, depths, tokens, root_token=7, m=m)
    n = min(m, len(values))
    assert len(tree) == n + 1 and tree.tokens[0] == 7 and tree.parents[0] == -1 and tree.depths[0] == 0
    created = (tree.tokens[1:] - 100).tolist()
    # exactly the n best values (ties: earlier creation = shallower first)
    expected = sorted(range(len(values)), key=lambda i: (-float(values[i]), i))[:n]
    assert sorted(created) == sorted(expected)
    for b in range(1, n + 1):  # parents precede children and point at the node's real parent
        par = int(tree.parents[b])
        assert 0 <= par < b
        true_parent = int(parents[created[b - 1]])
        assert (par == 0) if true_parent < 0 else (created[par - 1] == true_parent)
        assert tree.depths[b] == tree.depths[par] + 1
        assert torch.isclose(tree.values[b], values[created[b - 1]])


def test_ties_prefer_shallower_nodes() -> None:
    # depth-1 node 0 has value -1; its child (creation 2) also -1 (log-prob 0); depth-1 node 1 has -1 too.
    values = torch.tensor([-1.0, -1.0, -1.0, -3.0], dtype=torch.float64)
    parents = torch.tensor([-1, -1, 0, 0])
    depths = torch.tensor([1, 1, 2, 2])
    tree = select_top_m(values, parents, depths, torch.tensor([10, 11, 12, 13]), root_token=0, m=2)
    assert tree.tokens.tolist() == [0, 10, 11]


def test_mask_is_exactly_ancestors_and_positions() -> None:
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, 2])
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 2])
    anc = ancestor_matrix(parents)
    for i in range(len(parents)):
        chain, j = {i}, i
        while parents[j] >= 0:
            j = int(parents[j])
            chain.add(j)
        assert set(torch.nonzero(anc[i]).flatten().tolist()) == chain
    allowed = tree_attention_allowed(parents, prefix_len=5)
    assert allowed.shape == (7, 12) and bool(allowed[:, :5].all())
    assert torch.equal(allowed[:, 5:], anc)
    mask = additive_mask(allowed, torch.float32)
    assert mask.shape == (1, 1, 7, 12)
    assert bool((mask[0, 0][allowed] == 0).all()) and bool((mask[0, 0][~allowed] == torch.finfo(torch.float32).min).all())
    from eval.tree import DraftTree

    tree = DraftTree(torch.arange(7), parents, depths, torch.zeros(7))
    assert tree.position_ids(5).tolist() == [5, 6, 6, 7, 7, 8, 7]


def _target(kind: str):
    """Tiny fp64 targets: Llama (sdpa / eager kernels), a hybrid Qwen2 whose layers 1-2 use a sliding
    window of 3 tokens, shorter than prefix + tree, so the per-layer-type mask dict is exercised, and a Mistral
    whose config window (no layer types) slides in every layer."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    geo = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2,
               num_key_value_heads=1, max_position_embeddings=256, initializer_range=0.2)
    torch.manual_seed(0)
    if kind == "qwen2-sliding":
        cfg = Qwen2Config(**geo, use_sliding_window=True, sliding_window=3, max_window_layers=1)
        assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
        return Qwen2ForCausalLM(cfg).eval().double()
    if kind == "mistral-sliding":
        return MistralForCausalLM(MistralConfig(**geo, sliding_window=3)).eval().double()
    cfg = LlamaConfig(**geo)
    cfg._attn_implementation = kind.split("-")[1]
    return LlamaForCausalLM(cfg).eval().double()


@pytest.mark.parametrize("kind", ["llama-sdpa", "llama-eager", "qwen2-sliding", "mistral-sliding"])
def test_tree_verify_forward_equals_per_path_forward(kind: str) -> None:
    """One tree forward gives every node the logits and taps of a plain forward over prefix + its path,
    and keep_kv leaves exactly the cache a plain forward over prefix + accepted path would build."""
    tiny_target = _target(kind)
    runner = TargetRunner(tiny_target, tap_layers=[0, 1, 2])
    prefix = [3, 1, 4, 1, 5, 9, 2]
    tokens = torch.tensor([6, 5, 3, 5, 8, 9, 7, 9])
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, 2, 6])
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 2, 3])
    cache = runner.new_cache()
    runner.forward(prefix, cache)
    n = len(prefix)
    out = runner.forward(tokens, cache, depths + n, tree_attention_allowed(parents, n))
    anc = ancestor_matrix(parents)
    # transformers' eager kernel takes its softmax in float32 whatever the model dtype: fp32 rounding there
    atol = 1e-6 if kind.endswith("eager") else 1e-10
    for i in range(len(tokens)):
        path = torch.nonzero(anc[i]).flatten().tolist()  # ancestors are in block order = root path order
        ref = runner.forward(prefix + tokens[path].tolist(), runner.new_cache())
        torch.testing.assert_close(out.logits[i], ref.logits[-1], rtol=0, atol=atol)
        torch.testing.assert_close(out.taps[i], ref.taps[-1], rtol=0, atol=atol)
    accepted = [0, 1, 3, 5]
    keep_kv(cache, n, torch.tensor(accepted))
    ref_cache = runner.new_cache()
    runner.forward(prefix + tokens[accepted].tolist(), ref_cache)
    assert cache.get_seq_length() == n + len(accepted)
    for a, b in zip(cache.layers, ref_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=atol)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=atol)
    # decoding continues correctly from the surgically kept cache
    nxt = runner.forward([2], cache).logits[-1]
    ref_nxt = runner.forward([2], ref_cache).logits[-1]
    torch.testing.assert_close(nxt, ref_nxt, rtol=0, atol=atol)
    if kind == "qwen2-sliding":  # the window matters here: a full-attention forward differs
        tiny_target.config.layer_types = ["full_attention"] * 3
        no_window = runner.forward(prefix + tokens[accepted].tolist() + [2], runner.new_cache()).logits[-1]
        assert (no_window - ref_nxt).abs().max() > 1e-3


@pytest.mark.parametrize("accepted", [[0], [0, 1], [0, 2, 6]])
def test_keep_kv_keeps_exactly_the_accepted_entries(accepted: list[int]) -> None:
    """A chain's accepted prefix is kept as a view (nothing copied), a tree path is gathered into place;
    both leave the cache a fresh forward over prefix + path builds."""
    runner = TargetRunner(_target("llama-sdpa"))
    prefix, tokens = [3, 1, 4, 1, 5], torch.tensor([6, 5, 3, 5, 8, 9, 7, 9])
    parents = torch.tensor([-1, 0, 0, 1, 1, 3, 2, 6])
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 2, 3])
    cache = runner.new_cache()
    runner.forward(prefix, cache)
    n = len(prefix)
    runner.forward(tokens, cache, depths + n, tree_attention_allowed(parents, n))
    storage = cache.layers[0].keys.untyped_storage().data_ptr()
    keep_kv(cache, n, torch.tensor(accepted))
    assert cache.layers[0].keys.untyped_storage().data_ptr() == storage  # cut and compacted in place
    ref = runner.new_cache()
    runner.forward(prefix + tokens[accepted].tolist(), ref)
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=1e-10)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=1e-10)
    with pytest.raises(ValueError, match="ascend"):
        keep_kv(cache, n, torch.tensor([0, 2, 1]))


def test_the_runners_taps_are_what_a_capture_records_the_last_layer_before_the_norm() -> None:
    """Decoding's taps equal prep's and training's capture at every layer, the last one included (its output before
    the final norm, which HF's hidden_states list replaces with the normed one); FINAL_FEATURE is the normed one."""
    from tiny_models import tiny_llama

    from data_prep.capture import HiddenStateCapture
    from eval.target import FINAL_FEATURE

    target = tiny_llama(vocab=32, layers=3, seed=0)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with HiddenStateCapture(target, [0, 1, 2]) as capture:
        captured = capture(torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long))
    runner = TargetRunner(target, [0, 1, 2, FINAL_FEATURE])
    taps = runner.forward(ids, runner.new_cache()).taps.view(len(ids), 4, -1)
    torch.testing.assert_close(taps[:, :3].reshape(len(ids), -1), captured.taps[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(taps[:, 3], target.model.norm(captured.final_hidden[0]), rtol=0, atol=1e-12)
    assert not torch.allclose(taps[:, 2], taps[:, 3])
