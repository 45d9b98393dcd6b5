"""The end-to-end sampling test has power: deliberately broken acceptance rules FAIL it.

Same setup, statistic, sequence count and seeds as test_eval_sampling_e2e.py; only the rule in
eval.sampling is swapped for a wrong one.
"""

from __future__ import annotations

import pytest
import torch
from test_eval_sampling_e2e import ALPHA, MODES, PARAMS, PROMPT, generate_many, make_pair
from tiny_models import rank_goodness_of_fit

from eval import sampling

torch.set_num_threads(1)


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


@pytest.fixture(scope="module")
def pair():
    return make_pair()


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
