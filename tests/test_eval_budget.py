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


class ScriptedTimer:
    """The target's forwards as a cost table (no real timing): seconds per candidate m, with spikes on chosen calls
    (a load spike on the machine), and the order of the calls kept."""

    def __init__(self, table: dict[int, float], spikes: dict[int, float] | None = None) -> None:
        self.table, self.spikes, self.calls = table, spikes or {}, []

    def __call__(self, m: int) -> float:
        self.calls.append(m)
        return self.table[m] + self.spikes.get(len(self.calls) - 1, 0.0)


def test_costs_are_timed_round_robin_after_a_warm_up_and_a_spike_does_not_decide() -> None:
    from eval.budget import interleaved_costs

    table = {0: 1.0, 4: 1.2, 8: 1.5}
    # call 3 is m=0's first timed sample, call 7 m=4's second: each lands in one sample of its shape
    timer = ScriptedTimer(table, spikes={3: 50.0, 7: 50.0})
    costs = interleaved_costs(timer, [8, 4], passes=3)
    assert costs == table  # the medians drop the spikes
    # every shape warmed up once, then the passes, each starting one shape later than the one before
    assert timer.calls == [0, 4, 8, 0, 4, 8, 4, 8, 0, 8, 0, 4]


# Tokens a tree of the best m nodes emits per cycle, as a drafter would show on the probe, and our decoder's
# overhead per cycle (seconds, in units of a plain step of 1.0).
TAU = {4: 1.45, 8: 1.85, 16: 2.3, 32: 2.45, 60: 2.5}
OVERHEAD = 0.05


def test_the_best_predicted_speedup_is_chosen_on_a_non_monotone_cost_table() -> None:
    from eval.budget import choose_total_tokens, interleaved_costs

    # not monotone: 16 drafted nodes verify faster than 8 (a kernel that suits its shape), and 8 is over the old
    # rule's 1.3x tolerance, so a rule stopping at the first candidate over a tolerance keeps m=4
    table = {0: 1.0, 4: 1.2, 8: 1.55, 16: 1.4, 32: 2.6, 60: 4.0}
    timer = ScriptedTimer(table, spikes={9: 30.0})  # one spike, in the first of m=16's samples
    costs = interleaved_costs(timer, [4, 8, 16, 32, 60], passes=5)
    assert costs == table
    choice = choose_total_tokens(costs, TAU.__getitem__, lambda m: OVERHEAD, context_len=200,
                                 probe={"m": 60, "prompts": 1, "cycles": 70})
    predicted = {c["m"]: c["predicted_speedup"] for c in choice.candidates}
    assert predicted[0] == 1.0
    for m in TAU:
        assert predicted[m] == pytest.approx(TAU[m] * table[0] / (table[m] + OVERHEAD))
    assert choice.chosen == 16 == max(predicted, key=predicted.get)
    assert predicted[16] > predicted[4] > 1 > predicted[32]  # 4 pays too, 16 pays more
    assert [c["m"] for c in choice.candidates] == [0, 4, 8, 16, 32, 60]
    assert choice.timings == table
    d = choice.to_dict()
    assert d["chosen"] == 16 and d["context_len"] == 200 and d["passes"] == 5
    assert all(set(c) >= {"m", "verify_cost", "predicted_speedup"} for c in d["candidates"])
    assert choice.reason.startswith("m=16, the best predicted speedup (m=0 1.00x, m=4 1.16x (τ 1.45), m=8 1.16x (τ 1.85)"), choice.reason


def test_plain_decoding_is_chosen_when_no_candidate_is_predicted_to_pay() -> None:
    from eval.budget import choose_total_tokens

    # a CPU: every verify forward costs well over a plain step, more than the drafts it accepts make up for
    costs = {0: 1.0, 4: 1.6, 8: 2.1, 16: 3.0, 32: 5.0, 60: 9.0}
    choice = choose_total_tokens(costs, TAU.__getitem__, lambda m: OVERHEAD, context_len=200,
                                 probe={"m": 60, "prompts": 1, "cycles": 70})
    assert all(c["predicted_speedup"] < 1 for c in choice.candidates if c["m"])
    assert choice.chosen == 0
    assert choice.reason.startswith("m=0, plain decoding: no candidate is predicted to pay"), choice.reason
    # the best candidate wins over plain decoding as soon as it is predicted to pay at all
    assert choose_total_tokens({**costs, 16: 2.2}, TAU.__getitem__, lambda m: OVERHEAD, 200).chosen == 16
    with pytest.raises(ValueError, match="plain step"):
        choose_total_tokens({4: 1.0}, TAU.__getitem__, lambda m: OVERHEAD, 200)


def test_the_probe_reads_each_smaller_trees_greedy_acceptance_off_the_largest() -> None:
    from eval.budget import TreeProbe
    from eval.spec_decode import accept_path

    tree = a_tree()  # ranks by value: 1, 2, 4, 3, 5, 6
    follow = {100: 101, 101: 103, 103: 105, 105: 0}  # the target's greedy next token after each node's token
    vocab = 110

    def logits_for(t: DraftTree) -> torch.Tensor:
        out = torch.zeros(len(t), vocab)
        for i, tok in enumerate(t.tokens.tolist()):
            out[i, follow.get(tok, 1)] = 1.0
        return out

    path, _ = accept_path(tree, logits_for(tree), GREEDY, None)
    assert path == [0, 1, 3, 5]  # the best node, the 4th best, the 5th best
    probe = TreeProbe(largest=6)
    probe.record(tree, path)
    probe.record(tree, [0, 2])  # a cycle that accepted the second-best node alone
    assert probe.ranks == [[0, 3, 4], [1]]
    for m in range(8):  # what verifying the best m nodes of the same tree accepts
        cut = keep_best(tree, m)
        got = len(accept_path(cut, logits_for(cut), GREEDY, None)[0]) - 1
        assert probe.accepted(m)[0] == got, m
    assert [probe.accepted(m) for m in (0, 1, 2, 4, 5)] == [[0, 0], [1, 0], [1, 1], [2, 1], [3, 1]]
    assert probe.tau(4) == pytest.approx(1 + 3 / 2) and probe.tau(0) == 1.0
    assert probe.alpha(4, 3) == [1.0, 0.5, 0.0]  # depth 0: both cycles; depth 1: one of two; depth 2: none of one


def test_the_overhead_scales_its_drafting_with_the_levels_a_tree_drafts() -> None:
    from eval.budget import CycleOverhead
    from eval.spec_decode import GenerationRecord

    rec = GenerationRecord(5, [1] * 9, "length", time_s=1.0, target_forwards=5, accept_lengths=[1, 1, 2, 0],
                           phase_s={"prefill": 0.2, "draft": 0.24, "verify": 0.4})
    over = CycleOverhead.from_records([rec], depth=6, largest=60)
    assert over.draft_s == pytest.approx(0.06) and over.other_s == pytest.approx((1.0 - 0.2 - 0.4 - 0.24) / 4)
    assert over(60) == over(6) == pytest.approx(0.06 + 0.04)
    assert over(3) == pytest.approx(0.04 + 0.06 * 3 / 6)  # three levels' drafting of six
    assert over(0) == 0.0  # plain decoding: no cycle


@pytest.mark.integration
def test_the_probe_sees_every_cycle_decoding_accepted(agreeing_pair) -> None:
    from eval.budget import TreeProbe

    runner, drafter = agreeing_pair
    dec = SpeculativeDecoder(runner, drafter, SpecSettings(mode="tree", depth=4, topk=4, total_tokens=12))
    probe = TreeProbe(largest=12)
    dec.on_cycle = probe.record
    spec = dec.generate([1, 2, 3], 30, GREEDY)
    assert spec.output_ids == plain_generate(runner, [1, 2, 3], 30, GREEDY).output_ids  # the hook changes nothing
    assert probe.accepted(12) == spec.accept_lengths and max(spec.accept_lengths) >= 1
    per_m = [probe.accepted(m) for m in range(13)]  # a larger tree accepts at least what a smaller one does
    assert all(a <= b for small, large in zip(per_m, per_m[1:]) for a, b in zip(small, large))
    assert per_m[0] == [0] * probe.cycles
