"""The adaptive verify budget (eval/budget.py): its cost model's choice, the best-m cut of a draft tree, and
greedy speculative decoding that stays token-for-token plain decoding whatever m each cycle picks."""

from __future__ import annotations

import pytest
import torch
from tiny_models import check_state

from eval.budget import AdaptiveBudget, VerifyCost
from eval.sampling import SamplingParams
from eval.spec_decode import SpecSettings, SpeculativeDecoder, plain_generate
from eval.target import TargetRunner
from eval.tree import DraftTree, ancestor_matrix, keep_best

torch.set_num_threads(1)

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def agreeing_pair():
    from tiny_models import permutation_pair

    target, drafter, _ = permutation_pair(vocab=16, hidden=32, noise=0.3, seed=1)
    return TargetRunner(target, drafter.cfg.tap_layers), drafter


def a_tree() -> DraftTree:
    # root -> 1 (v -0.1) -> 3 (-0.5) -> 5 (-0.6); root -> 2 (-0.3) -> 4 (-0.4); 1 -> 6 (-2.0)
    parents = torch.tensor([-1, 0, 0, 1, 2, 3, 1])
    values = torch.tensor([0.0, -0.1, -0.3, -0.5, -0.4, -0.6, -2.0], dtype=torch.float64)
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 2])
    q = [None, *(torch.full((3,), float(i)) for i in range(1, 7))]
    return DraftTree(torch.arange(100, 107), parents, depths, values, q)


def test_keep_best_keeps_the_best_connected_nodes() -> None:
    tree = a_tree()
    assert keep_best(tree, 6) is tree and keep_best(tree, 60) is tree
    root = keep_best(tree, 0)
    assert root.tokens.tolist() == [100] and root.parents.tolist() == [-1] and root.q == [None]
    cut = keep_best(tree, 4)  # values -0.1, -0.3, -0.4, -0.5: nodes 1, 2, 3, 4 (node 5 and 6 dropped)
    assert cut.tokens.tolist() == [100, 101, 102, 103, 104]
    assert cut.parents.tolist() == [-1, 0, 0, 1, 2] and cut.depths.tolist() == [0, 1, 1, 2, 2]
    assert [float(x[0]) for x in cut.q[1:]] == [1.0, 2.0, 3.0, 4.0]
    anc = ancestor_matrix(cut.parents)  # connected: every node's ancestors are kept
    assert bool(anc[:, 0].all())
    chain = DraftTree(torch.arange(4), torch.arange(-1, 3), torch.arange(4),
                      torch.tensor([0.0, -0.2, -0.9, -1.0], dtype=torch.float64))
    assert keep_best(chain, 2).tokens.tolist() == [0, 1, 2]  # a chain keeps a prefix


def test_verify_cost_interpolates_and_extrapolates() -> None:
    cost = VerifyCost({1: 1.0, 3: 2.0, 5: 2.5})
    assert [cost(n) for n in (1, 2, 3, 4, 5, 7)] == [1.0, 1.5, 2.0, 2.25, 2.5, 3.0]
    with pytest.raises(ValueError, match="1-token"):
        VerifyCost({2: 1.0, 3: 1.0})
    with pytest.raises(ValueError, match="positive"):
        VerifyCost({1: 0.0, 3: 1.0})


def test_choice_maximises_the_rate_rule() -> None:
    cost = VerifyCost({1: 1.0, 2: 1.2, 5: 2.0, 9: 4.0})
    budget = AdaptiveBudget(cost, prior_cycles=4)  # c = 1, r = 1 token/s, no overhead yet
    values = torch.tensor([-0.1, -0.7, -1.2, -2.0, -3.0, -0.05], dtype=torch.float64)
    probs = sorted(values.exp().tolist(), reverse=True)
    score = [1 + sum(probs[:m]) - 1.0 * cost(m + 1) for m in range(len(probs) + 1)]
    m, predicted = budget.choose(values)
    assert m == max(range(len(score)), key=lambda i: (score[i], -i)) and predicted == pytest.approx(sum(probs[:m]))
    assert AdaptiveBudget(VerifyCost({1: 1.0, 2: 50.0})).choose(values)[0] == 0  # drafts never pay: a plain step
    assert AdaptiveBudget(VerifyCost({1: 1.0, 2: 1.0})).choose(values)[0] == 6  # free verification: all of them
    # A drafter twice as confident as it is right: the calibration halves what it predicts next.
    budget.observe(m, predicted, accepted=0, cycle_s=cost(m + 1), verify_s=cost(m + 1))
    assert budget.calibration == pytest.approx(4 / (4 + predicted))
    assert budget.overhead == 0.0 and budget.summary()["cycles"] == 1


@pytest.mark.integration
@pytest.mark.parametrize("settings", [SpecSettings(mode="chain", depth=4),
                                      SpecSettings(mode="tree", depth=4, topk=4, total_tokens=12)],
                         ids=["chain", "tree"])
@pytest.mark.parametrize("costs", ["measured", "never", "free"])
def test_greedy_identical_whatever_the_budget_picks(agreeing_pair, settings: SpecSettings, costs: str) -> None:
    runner, drafter = agreeing_pair
    most = (settings.total_tokens if settings.mode == "tree" else settings.depth) + 1
    verify = {"measured": VerifyCost.measure(runner, most, context_len=8, repeats=1),
              "never": VerifyCost({1: 1e-3, 2: 1e6}), "free": VerifyCost({1: 1e-12, most: 1e-12})}[costs]
    budget = AdaptiveBudget(verify)
    for prompt in ([1, 2, 3], [7], [4, 4, 9, 0, 15, 2]):
        plain = plain_generate(runner, prompt, 30, GREEDY)
        dec = SpeculativeDecoder(runner, drafter, settings, budget)
        spec = dec.generate(prompt, 30, GREEDY)
        assert spec.output_ids == plain.output_ids, (prompt, costs)
        check_state(dec, prompt, spec)
    ms = [c["m"] for c in budget.log]
    if costs == "never":
        assert set(ms) == {0} and set(budget.summary()) >= {"tau_predicted", "tau_measured", "share_m0"}
    if costs == "free":  # verification costs nothing: every drafted node is verified
        assert min(ms) >= 1 and all(c["m"] == c["drafted"] for c in budget.log)


def test_worth_expanding_weighs_a_forward_against_what_it_can_add() -> None:
    budget = AdaptiveBudget(VerifyCost({1: 0.1, 9: 0.2}), prior_cycles=4)  # rate 10 tokens/s, c = 1
    assert budget.worth_expanding(1e-9)  # no forward timed yet: expand
    budget.observe(2, 1.0, accepted=1, cycle_s=0.3, verify_s=0.15, draft_s=0.02, draft_forwards=2, drafted=4)
    r = budget.rate
    assert r == pytest.approx(6 / 0.7) and budget.calibration == pytest.approx(5 / 5)
    # a forward costs 0.01 s: worth it while c·p > r·0.01
    assert budget.worth_expanding(1.01 * r * 0.01) and not budget.worth_expanding(0.99 * r * 0.01)
    assert budget.log[-1]["drafted"] == 4 and budget.summary()["mean_draft_forwards"] == 2


def test_the_automatic_budget_keeps_the_cheaper_size_on_noisy_timings_and_says_why() -> None:
    from eval.budget import pick_total_tokens

    candidates = [4, 8, 16, 32, 60]
    # noise: 16 is over the tolerance, 32 and 60 (no cheaper in truth) measured under it
    noisy = pick_total_tokens({0: 1.0, 4: 1.05, 8: 1.2, 16: 1.45, 32: 1.25, 60: 1.28}, candidates, 1.3)
    assert (noisy.m, noisy.within_tolerance, noisy.not_monotonic) == (8, True, [32, 60])
    assert noisy.reason.startswith("m=8, the largest candidate whose verify forward is within 1.3x"), noisy.reason
    assert "m=32, m=60 fitted again above m=16, which did not: timings not monotonic" in noisy.reason
    assert noisy.to_dict()["cost_ratio"][16] == pytest.approx(1.45)
    # nothing fits: the smallest, and the choice says so
    none = pick_total_tokens({0: 1.0, 4: 1.8, 8: 2.0, 16: 2.5, 32: 3.0, 60: 4.0}, candidates, 1.3)
    assert (none.m, none.within_tolerance) == (4, False)
    assert "m=4, the smallest candidate: none is within the tolerance 1.3x" in none.reason and "m=4 1.80x" in none.reason
    # monotonic timings: the largest that fits
    clean = pick_total_tokens({0: 1.0, 4: 1.0, 8: 1.05, 16: 1.1, 32: 1.35, 60: 1.9}, candidates, 1.3)
    assert (clean.m, clean.not_monotonic) == (16, [])
