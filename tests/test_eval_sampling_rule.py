"""The warp and the acceptance rule at one node, many draws: exact target marginals, and broken rules fail.

The end-to-end decoder test (test_eval_sampling_e2e.py) needs real model forwards per draw; here the
rule alone is drawn tens of thousands of times, so even subtle biases show.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from eval import sampling
from eval.sampling import SamplingParams, target_probs, verify_candidates, warp_logits

N = 20000
ALPHA = 1e-3  # a lossless rule fails once per thousand seeds; a broken one must give p << ALPHA


def chi2_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() * len(samples)
    assert counts[expected == 0].sum() == 0, "drew a token the target gives probability 0"
    keep = expected > 0
    return float(stats.chisquare(counts[keep].numpy(), expected[keep].numpy()).pvalue)


def test_warp_matches_transformers_logits_processors() -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g, dtype=torch.float64)
    logits[0, :5] = 3.0  # ties at the top-k boundary
    for t, p, k in [(0.7, 1.0, 0), (1.0, 0.9, 0), (1.3, 1.0, 5), (0.5, 0.8, 10), (1.0, 0.05, 0)]:
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        ours = warp_logits(logits, t, p, k)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref))
        torch.testing.assert_close(ours[~torch.isinf(ours)], ref[~torch.isinf(ref)])
    probs = target_probs(logits, SamplingParams(0.0, 0.5, 3))  # greedy ignores top-p / top-k
    assert torch.equal(probs.argmax(-1), logits.argmax(-1)) and bool((probs.sum(-1) == 1).all())


def _target_p(seed: int, vocab: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 1.5, -1)


def _draw_tree_node(p: torch.Tensor, candidates: list[int], n: int, seed: int) -> list[int]:
    """Output token of one tree node with point-mass candidates (accepted candidate or residual bonus)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        v = verify_candidates(p, candidates, [None] * len(candidates), gen)
        out.append(candidates[v.accepted_child] if v.accepted_child is not None else sampling.sample(v.residual, gen))
    return out


def _draw_chain_node(p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> list[int]:
    """Output of one chain node whose draft is SAMPLED from q (classic speculative sampling)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = sampling.sample(q, gen)
        v = verify_candidates(p, [x], [q], gen)
        out.append(x if v.accepted_child is not None else sampling.sample(v.residual, gen))
    return out


@pytest.mark.integration
def test_multi_candidate_rule_reproduces_p() -> None:
    p = _target_p(1)
    candidates = [int(i) for i in torch.argsort(p, descending=True)[[1, 0, 5]]]  # not in p's order
    assert chi2_pvalue(_draw_tree_node(p, candidates, N, seed=2), p) > ALPHA


def test_sampled_draft_rule_reproduces_p() -> None:
    p, q = _target_p(3), _target_p(4)
    assert chi2_pvalue(_draw_chain_node(p, q, N, seed=5), p) > ALPHA


def test_accepting_is_certain_when_p_is_one_hot() -> None:
    p = torch.zeros(6, dtype=torch.float64)
    p[2] = 1.0
    gen = torch.Generator().manual_seed(0)
    assert verify_candidates(p, [2], [None], gen).accepted_child == 0
    v = verify_candidates(p, [1, 3], [None, None], gen)
    assert v.accepted_child is None and int(v.residual.argmax()) == 2 and float(v.residual[2]) == 1.0


def _residual_without_subtracting(p, q, x):
    return p


def _accept_all(p, q, x):
    return 1.0


def _ratio_without_q(p, q, x):
    return float(p[x])  # ignores q: wrong whenever drafts are sampled


@pytest.mark.parametrize("broken", ["residual_without_subtracting", "accept_all"])
def test_broken_rules_fail_the_same_test_tree(monkeypatch, broken: str) -> None:
    if broken == "accept_all":
        monkeypatch.setattr(sampling, "acceptance_probability", _accept_all)
    else:
        monkeypatch.setattr(sampling, "residual_distribution", _residual_without_subtracting)
    p = _target_p(1)
    candidates = [int(i) for i in torch.argsort(p, descending=True)[[1, 0, 5]]]
    assert chi2_pvalue(_draw_tree_node(p, candidates, N, seed=2), p) < ALPHA


@pytest.mark.integration
@pytest.mark.parametrize("broken", ["residual_without_subtracting", "ratio_without_q"])
def test_broken_rules_fail_the_same_test_chain(monkeypatch, broken: str) -> None:
    if broken == "ratio_without_q":
        monkeypatch.setattr(sampling, "acceptance_probability", _ratio_without_q)
    else:
        monkeypatch.setattr(sampling, "residual_distribution", _residual_without_subtracting)
    p, q = _target_p(3), _target_p(4)
    assert chi2_pvalue(_draw_chain_node(p, q, N, seed=5), p) < ALPHA
