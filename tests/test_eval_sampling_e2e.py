"""Speculative SAMPLING end to end: generated sequences are distributed like the target's own samples.

Plain sampling draws each token x_t from p_t = the target's warped distribution at its prefix. The
test (tiny_models.rank_goodness_of_fit) recomputes every p_t with one full forward per sequence and
checks the ranks of the generated tokens under p_t against their exact expected counts, pooled over
all positions of all sequences: every token of long multi-step generations is used, so a lossy step
anywhere - acceptance ratio, residual, logits from the wrong tree node, a KV cache holding the wrong
positions, the cut at EOS - shows up. Plain sampling must pass (the test's own check); every
speculative mode must pass. The test has power: deliberately broken acceptance rules (the rule in eval.sampling
swapped for a wrong one; the same statistic, sequence count and seeds) FAIL it. test_eval_sampling_rule.py
checks the rule alone with many draws.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import rank_goodness_of_fit

from eval import sampling
from eval.sampling import SamplingParams
from eval.spec_decode import SpecSettings, SpeculativeDecoder, plain_generate
from eval.target import TargetRunner

pytestmark = pytest.mark.integration

torch.set_num_threads(1)

VOCAB, EOS = 8, 0
PROMPT = [3, 5, 1]
SEQS, NEW = 60, 24  # sequences per test, max new tokens each
ALPHA = 1e-3  # a lossless decoder fails once per thousand seeds; seeds are fixed
PARAMS = SamplingParams(temperature=1.0, top_p=0.95, top_k=0)

MODES = {
    "chain": SpecSettings(mode="chain", depth=3),
    "chain_sampled_drafts": SpecSettings(mode="chain", depth=3, sample_drafts=True),
    "tree": SpecSettings(mode="tree", depth=3, topk=2, total_tokens=6),
}


def make_pair():
    from tiny_models import permutation_pair

    target, drafter, _ = permutation_pair(vocab=VOCAB, hidden=16, noise=0.3, sharpness=1.0, seed=1)
    return TargetRunner(target, drafter.cfg.tap_layers), drafter


def generate_many(runner, drafter, settings: SpecSettings | None, seed: int, n: int = SEQS,
                  eos: tuple[int, ...] = (), params: SamplingParams = PARAMS):
    gen = torch.Generator().manual_seed(seed)
    if settings is None:
        return [plain_generate(runner, PROMPT, NEW, params, eos, gen) for _ in range(n)]
    return [SpeculativeDecoder(runner, drafter, settings).generate(PROMPT, NEW, params, eos, gen) for _ in range(n)]


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def test_plain_sampling_passes(pair) -> None:
    runner, drafter = pair
    recs = generate_many(runner, drafter, None, seed=1)
    assert rank_goodness_of_fit(runner, PROMPT, [r.output_ids for r in recs], PARAMS) > ALPHA


@pytest.mark.parametrize("mode", list(MODES))
def test_speculative_sampling_is_lossless(pair, mode: str) -> None:
    runner, drafter = pair
    recs = generate_many(runner, drafter, MODES[mode], seed=3)
    assert all(len(r.output_ids) == NEW for r in recs)
    assert rank_goodness_of_fit(runner, PROMPT, [r.output_ids for r in recs], PARAMS) > ALPHA
    # the test must exercise acceptance and rejection, including fully accepted depth-3 paths
    lengths = {a for r in recs for a in r.accept_lengths}
    assert {0, 1, 2, 3} <= lengths, f"accepted lengths seen: {sorted(lengths)}"


def test_tree_sampling_with_eos_and_top_k_is_lossless(pair) -> None:
    """EOS (here a frequent token) ends samples early, exactly where plain sampling would stop."""
    runner, drafter = pair
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=5)
    recs = generate_many(runner, drafter, MODES["tree"], seed=5, n=90, eos=(EOS,), params=params)
    outs = [r.output_ids for r in recs]
    assert all(len(o) == NEW or (o[-1] == EOS and EOS not in o[:-1]) for o in outs)
    assert sum(o[-1] == EOS for o in outs) > 30 and sum(len(o) for o in outs) > 400
    assert rank_goodness_of_fit(runner, PROMPT, outs, params) > ALPHA


# ---------------------------------------------------------------------------------------------------------------
# Broken acceptance rules fail the same test

def _residual_without_subtracting(p, q, x):
    return p  # after a rejection, resample from p: the rejected draft keeps its mass


def _accept_all(p, q, x):
    return 1.0


def _ratio_without_q(p, q, x):
    return float(p[x])  # forgets to divide by q(x): wrong whenever drafts are sampled


BROKEN = {
    "residual_without_subtracting": ("residual_distribution", _residual_without_subtracting),
    "accept_all": ("acceptance_probability", _accept_all),
    "ratio_without_q": ("acceptance_probability", _ratio_without_q),
}


@pytest.mark.parametrize(("mode", "broken"), [
    ("tree", "residual_without_subtracting"),
    ("chain", "residual_without_subtracting"),
    ("tree", "accept_all"),
    ("chain_sampled_drafts", "ratio_without_q"),
])
def test_broken_rule_fails(pair, monkeypatch, mode: str, broken: str) -> None:
    runner, drafter = pair
    monkeypatch.setattr(sampling, *BROKEN[broken])
    recs = generate_many(runner, drafter, MODES[mode], seed=3)
    assert rank_goodness_of_fit(runner, PROMPT, [r.output_ids for r in recs], PARAMS) < ALPHA
