"""Drafter side: tree attention inside the drafter equals running each node's root path as a chain."""

from __future__ import annotations

import pytest
import torch

from eval.drafting import catch_up, draft_chain, draft_tree
from eval.target import TargetRunner

torch.set_num_threads(1)

PREFIX = [4, 17, 9, 30, 2, 11]


@pytest.fixture(scope="module")
def setup():
    from tiny_models import tiny_pair

    target, drafter = tiny_pair(vocab=32, seed=3, draft_vocab=24)
    runner = TargetRunner(target, drafter.cfg.tap_layers)
    pre = runner.forward(PREFIX, runner.new_cache())
    root = int(pre.logits[-1].argmax())
    return runner, drafter, pre.taps, root


def _fresh(drafter, taps, root):
    from models.attention import DecodeCache

    cache = DecodeCache()
    out = catch_up(drafter, cache, taps.to(drafter.fc.weight.dtype), torch.tensor([*PREFIX[1:], root]), 0)
    return cache, out


def _path_value(drafter, taps, root, path_tokens: list[int]) -> float:
    """Σ log q along the path, feeding it one node at a time with the default causal mask."""
    target_to_draft = {int(t): d for d, t in enumerate(drafter.draft_to_target(torch.arange(drafter.cfg.draft_vocab_size)))}
    cache, h = _fresh(drafter, taps, root)
    n, value = len(PREFIX), 0.0
    for depth, tok in enumerate(path_tokens, start=1):
        logp = torch.log_softmax(drafter.compute_logits(h).double(), -1)
        value += float(logp[target_to_draft[tok]])
        if depth < len(path_tokens):
            pos = torch.tensor([[n - 1 + depth]])
            h = drafter.forward_step(h[None, None], torch.tensor([[tok]]), pos, cache)[0, 0]
    return value


@pytest.mark.parametrize(("depth", "topk"), [(2, 3), (4, 3), (3, 5)])
def test_tree_values_equal_per_path_chains(setup, depth: int, topk: int) -> None:
    runner, drafter, taps, root = setup
    cache, root_out = _fresh(drafter, taps, root)
    tree = draft_tree(drafter, cache, root_out, root, len(PREFIX), depth, topk, total_tokens=10**6)
    n_nodes = topk + (depth - 1) * topk * topk
    assert len(tree) == 1 + n_nodes  # everything drafted was kept (m is huge)
    assert cache.length == len(PREFIX) + (depth - 1) * topk  # one row per expanded node
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    for i in range(1, len(tree)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        # RMSNorm inside the drafter runs in float32, hence the tolerance
        assert abs(_path_value(drafter, taps, root, path[::-1]) - float(tree.values[i])) < 1e-4
    kids = tree.children()
    assert all(len(kids[i]) in (0, topk) for i in range(len(tree)))


def test_chain_is_the_top1_tree(setup) -> None:
    runner, drafter, taps, root = setup
    c1, out1 = _fresh(drafter, taps, root)
    chain = draft_chain(drafter, c1, out1, root, len(PREFIX), steps=4)
    c2, out2 = _fresh(drafter, taps, root)
    tree = draft_tree(drafter, c2, out2, root, len(PREFIX), depth=4, topk=1, total_tokens=4)
    assert chain.tokens.tolist() == tree.tokens.tolist()
    assert chain.parents.tolist() == tree.parents.tolist() == [-1, 0, 1, 2, 3]
    torch.testing.assert_close(chain.values, tree.values, rtol=0, atol=1e-6)
    assert all(bool(drafter.t2d[t]) for t in chain.tokens[1:].tolist())  # drafts are in the draft vocab


def test_tree_drafts_no_level_deeper_than_its_budget(setup) -> None:
    """With m < depth the levels below m cannot be kept: not drafting them gives the same tree, cheaper."""
    runner, drafter, taps, root = setup
    c_full, out_full = _fresh(drafter, taps, root)
    full = draft_tree(drafter, c_full, out_full, root, len(PREFIX), depth=6, topk=3, total_tokens=10**6)
    for m in (1, 2, 4):
        cache, out = _fresh(drafter, taps, root)
        tree = draft_tree(drafter, cache, out, root, len(PREFIX), depth=6, topk=3, total_tokens=m)
        assert cache.length == len(PREFIX) + (min(6, m) - 1) * 3  # m - 1 drafter forwards, not 5
        # the same m nodes the unrestricted tree's top-m are
        top = sorted(range(1, len(full)), key=lambda i: (-float(full.values[i]), int(full.depths[i]), i))[:m]
        assert sorted(tree.tokens[1:].tolist()) == sorted(full.tokens[top].tolist())
        assert int(tree.depths.max()) <= m


def test_forward_timer_runs_each_shape_at_its_context(setup) -> None:
    from eval.budget import ForwardTimer

    runner, *_ = setup
    timer = ForwardTimer(runner, context_len=16)
    assert timer.cache.get_seq_length() == 16
    for m in (0, 2, 8, 0):  # the plain step and verifies of 3 and 9 tokens, each after the same 16 tokens
        assert timer(m) > 0
        assert timer.cache.get_seq_length() == 16  # the timed tokens are cut again: the context stays put