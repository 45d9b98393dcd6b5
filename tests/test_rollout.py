"""On-policy rollouts (train/rollout.py) and the loss on what they visited (Batch.draft_steps in train/ttt.py):
a rollout is lossless (its tokens are plain greedy decoding of the target), the positions it records as rejected
are exactly those a scripted drafter got wrong and the target verified, a greedy rollout replayed along the target's
plain greedy text (greedy_accepts over the drafter's teacher-forced drafts) records the very cycles real chain
decoding does, and the loss over a rollout's batch is the target's distribution against the drafter's at exactly
the (anchor, step) pairs inference visited, by hand."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_pair
from tiny_ttt import VD, tiny
from ttt_stubs import random_batch

from eval.drafting import EagleDrafting
from eval.sampling import SamplingParams
from eval.spec_decode import SpecSettings, SpeculativeDecoder, plain_generate
from eval.target import TargetRunner
from eval.tree import chain_tree
from train.batch import collate
from train.rollout import Rollout, greedy_accepts, rollout
from train.ttt import TTTSettings, ttt_loss, unroll

torch.set_num_threads(1)

GREEDY = SamplingParams()
PROMPTS = [[1], [5, 9, 2, 7], [3, 3, 3, 3, 3, 3, 11, 4, 20, 1]]
DEPTH = 3


@pytest.fixture(scope="module")
def pair():
    target, drafter = tiny_pair(vocab=32)
    return TargetRunner(target, drafter.tap_layers), drafter


def test_cycles_draft_steps_and_rejections_by_hand() -> None:
    """Prompt of 3 (anchor 2), depth 3: cycles accepting 1, 3, 0 drafts anchor at 2, 4, 8; they visit 2, 3, 1 steps;
    the first rejects position 5 (anchor 2 + 1 + 2), the third position 10; the second accepted every draft."""
    r = Rollout(prompt_len=3, tokens=list(range(3 + 9)), accept_lengths=[1, 3, 0, 2], depth=DEPTH)
    assert r.cycles() == [(2, 1), (4, 3), (8, 0), (9, 2)]
    assert r.draft_steps().tolist() == [0, 0, 2, 0, 3, 0, 0, 0, 1, 3, 0, 0]
    assert r.rejected_positions() == [5, 10]  # the 4th cycle's rejection (13) lies past the cut continuation
    assert r.loss_mask().tolist() == [False] * 3 + [True] * 9
    with pytest.raises(ValueError, match="outside 0..3"):
        Rollout(3, list(range(6)), [4], DEPTH)


def test_a_rollout_is_plain_greedy_decoding_of_the_target(pair) -> None:
    """The family's rollout function (models/registry.py: EAGLE-3's is eval/spec_decode.py chain_rollout) gives the
    target's own greedy text, whatever the drafter proposes; every cycle proposed `depth` drafts."""
    from models.registry import family

    runner, drafter = pair
    generate = family("eagle3").rollout_fn
    for prompt in PROMPTS:
        r = rollout(lambda ids, n: generate(runner.model, drafter, ids, n, DEPTH), prompt, 40, DEPTH)
        assert r.tokens == [*prompt, *plain_generate(runner, prompt, 40, GREEDY).output_ids]
        assert r.new_tokens == 40 and sum(a + 1 for a in r.accept_lengths) + 1 >= 40


class ScriptedDrafting(EagleDrafting):
    """Drafts the target's greedy continuation, wrong at the token positions in `wrong` (the real drafter still runs,
    so its cache bookkeeping is the real one)."""

    def __init__(self, drafter, settings, runner: TargetRunner, wrong: set[int]):
        super().__init__(drafter, settings)
        self.runner, self.wrong, self.seq = runner, wrong, []

    def start(self, prompt_ids, taps, root):
        super().start(prompt_ids, taps, root)
        self.seq = [*prompt_ids, root]

    def commit(self, taps, accepted, bonus, prefix_len):
        super().commit(taps, accepted, bonus, prefix_len)
        self.seq = [*self.seq[: prefix_len + 1], *accepted, bonus]

    def draft(self, root, prefix_len, params, generator):
        real = super().draft(root, prefix_len, params, generator)
        truth = plain_generate(self.runner, self.seq, self.settings.depth, GREEDY).output_ids
        vocab = int(self.drafter.t2d.numel())
        # the draft at step k stands at token position prefix_len + 1 + k (the root is at prefix_len)
        tokens = [(x + 1) % vocab if prefix_len + 1 + k in self.wrong else x for k, x in enumerate(truth)]
        return chain_tree(root, tokens, real.values[1:].tolist(), [None] * len(tokens))


def _expected_rejections(prompt_len: int, new_tokens: int, wrong: set[int]) -> list[int]:
    """The script's rejections, simulated: a cycle anchored at t drafts positions t+2..t+K+1; the first wrong one is
    rejected (the next anchor is just before it), else the next anchor is t+K+1 (its bonus is never drafted)."""
    end, t, out = prompt_len + new_tokens, prompt_len - 1, []
    while t + 2 < end:
        bad = next((p for p in range(t + 2, t + 2 + DEPTH) if p in wrong), None)
        if bad is None:
            t += DEPTH + 1
        else:
            if bad < end:
                out.append(bad)
            t = bad - 1
    return out


def test_rejections_are_exactly_the_scripted_drafters_wrong_drafts(pair) -> None:
    runner, drafter = pair
    prompt = PROMPTS[1]
    wrong = {5, 6, 12, 13, 14, 21, 30, 33}  # 13 and 14 follow rejections; some fall on never-drafted bonus positions
    dec = SpeculativeDecoder(runner, drafter, SpecSettings(mode="chain", depth=DEPTH))
    dec.strategy = ScriptedDrafting(drafter, dec.settings, runner, wrong)
    r = rollout(lambda ids, n: dec.generate(ids, n, GREEDY), prompt, 32, DEPTH)
    assert r.tokens == [*prompt, *plain_generate(runner, prompt, 32, GREEDY).output_ids]  # lossless whatever drafts
    expected = _expected_rejections(len(prompt), 32, wrong)
    assert r.rejected_positions() == expected and len(expected) >= 5
    assert set(expected) <= wrong
    visited = r.draft_steps()
    for p in expected:  # each rejected draft is the last step its cycle visited: step p - t - 2 from anchor t
        t = max(a for a, _ in r.cycles() if a + 2 <= p)
        assert visited[t] == p - t - 1


def test_greedy_accepts_walks_the_chains_by_hand() -> None:
    """Prompt of 3 (anchor 2), depth 3, 12 tokens: drafts from anchor 2 match tokens 4 and 5, not 6 (j=2); from 5
    none (j=0); from 6 tokens 8 and 9, not 10 (j=2); from 9 the one token left (11): the last cycle counts what it
    reaches. Accepting all three from 6 instead ends the rollout there: anchor 10's bonus is the last token."""
    tokens = list(range(100, 112))
    drafts = torch.full((DEPTH, 12), -1)
    drafts[0, 2], drafts[1, 2] = 104, 105
    drafts[:2, 6] = torch.tensor([108, 109])
    drafts[:, 9] = torch.tensor([111, 112, 113])
    got = greedy_accepts(tokens, 3, drafts, DEPTH)
    assert got == [2, 0, 2, 1]
    assert Rollout(3, tokens, got, DEPTH).cycles() == [(2, 2), (5, 0), (6, 2), (9, 1)]
    drafts[2, 6] = 110
    assert greedy_accepts(tokens, 3, drafts, DEPTH) == [2, 0, 3]
    assert greedy_accepts(tokens[:4], 3, drafts, DEPTH) == []  # only the prefill's token: no verify cycle


@pytest.mark.parametrize("seed", [0, 1])
def test_a_replayed_greedy_rollout_records_the_cycles_chain_decoding_does(seed: int) -> None:
    """Real chain decoding at T=0 (the family's rollout function) against the replay: the target's plain greedy
    text, one capture, the drafter's teacher-forced drafts, greedy_accepts. Same tokens, same accepted lengths
    (the last cycle's up to what the text reaches), with a drafter that accepts often and misses often."""
    from tiny_models import permutation_pair

    from data_prep.capture import HiddenStateCapture
    from models.registry import family

    target, drafter, _ = permutation_pair(vocab=16, hidden=32, noise=0.25, seed=seed)
    runner = TargetRunner(target, drafter.tap_layers)
    decode, drafts_of = family("eagle3").rollout_fn, family("eagle3").greedy_drafts_fn
    accepted = cycles = 0
    for prompt in PROMPTS:
        prompt = [t % 16 for t in prompt]
        real = rollout(lambda ids, n: decode(target, drafter, ids, n, DEPTH), prompt, 40, DEPTH)
        tokens = [*prompt, *plain_generate(runner, prompt, 40, GREEDY).output_ids]
        assert real.tokens == tokens
        with HiddenStateCapture(target, drafter.tap_layers) as capture:
            taps = capture(torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long)).taps[0]

        class Captured:  # what collate reads of a shard sample
            input_ids, loss_mask, teacher_hidden = torch.tensor(tokens), Rollout(len(prompt), tokens, [],
                                                                                 DEPTH).loss_mask(), None

        Captured.taps = taps
        drafts = drafts_of(drafter, collate([Captured]), DEPTH)[0]
        replayed = greedy_accepts(tokens, len(prompt), drafts, DEPTH)
        assert replayed[:-1] == real.accept_lengths[:-1] and len(replayed) == len(real.accept_lengths)
        assert replayed[-1] <= real.accept_lengths[-1]
        assert Rollout(len(prompt), tokens, replayed, DEPTH).draft_steps()[:-DEPTH - 1].tolist() == \
            real.draft_steps()[:-DEPTH - 1].tolist()
        accepted, cycles = accepted + sum(real.accept_lengths), cycles + len(real.accept_lengths)
    print(f"{cycles} cycles, {accepted} drafts accepted")
    assert cycles > 20 and 0.3 < accepted / (DEPTH * cycles) < 0.9  # the comparison sees hits and misses


def _hand_loss(drafter, head, batch, settings: TTTSettings) -> torch.Tensor:
    """Σ_k λ^k · mean over the visited valid pairs (t, k) of −Σ_x p̃(x) log q_k(x | t): p̃ the target's softmax over the
    draft vocabulary at row j = t + k + 1, q_k the drafter's at step k of the unroll from t."""
    hiddens = unroll(drafter, batch, settings)
    ids = torch.arange(VD) + drafter.d2t
    B, T = batch.input_ids.shape
    per_step = []
    for k in range(settings.steps):
        logq = torch.log_softmax(drafter.compute_logits(hiddens[k]).double(), -1)
        terms = []
        for b in range(B):
            n = int(batch.valid[b].sum())
            for t in range(T):
                j = t + k + 1
                if int(batch.draft_steps[b, t]) <= k or j + 1 >= n or not batch.loss_mask[b, j + 1]:
                    continue
                full = head.logits(batch.teacher_hidden[b, j]).double()
                if not drafter.t2d[full.argmax()]:
                    continue  # the teacher's argmax outside the draft vocabulary: not a target
                p = torch.softmax(full[ids], -1)
                terms.append(-(p * logq[b, t]).sum())
        per_step.append(torch.stack(terms).mean() if terms else torch.zeros((), dtype=torch.float64))
    return sum(settings.decay ** k * x for k, x in enumerate(per_step))


def test_the_loss_of_a_rollouts_batch_is_the_target_against_the_drafter_at_the_visited_pairs_only() -> None:
    drafter, head = tiny()
    drafter.double()
    head.double()
    settings = TTTSettings(steps=3, decay=0.8, chunk_size=16)
    batch = random_batch("hidden", [20, 14], 96, 32, seed=3)
    batch.loss_mask[:] = batch.valid
    batch.loss_mask[:, :4] = False  # a prompt
    steps = torch.zeros_like(batch.input_ids)
    steps[0, [3, 5, 9, 12]] = torch.tensor([2, 3, 1, 3])
    steps[1, [3, 4, 8]] = torch.tensor([1, 3, 2])
    batch.draft_steps = steps
    batch = batch.to("cpu", torch.float64)
    with torch.no_grad():
        loss, metrics = ttt_loss(drafter, head, batch, settings)
        expected = _hand_loss(drafter, head, batch, settings)
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)  # the loss computes in float32
    counts = metrics["n_valid_k"].tolist()
    assert counts[0] >= counts[1] >= counts[2] > 0  # fewer pairs at later steps: cycles stop at rejections

    everywhere = torch.full_like(steps, 3)
    with torch.no_grad():
        masked_all, _ = ttt_loss(drafter, head, batch, settings)
        batch.draft_steps = everywhere
        supervised_like, m_all = ttt_loss(drafter, head, batch, settings)
        batch.draft_steps = None
        supervised, m_sup = ttt_loss(drafter, head, batch, settings)
    assert float(supervised_like) == pytest.approx(float(supervised), rel=1e-12)  # every pair visited = supervised
    assert m_all["n_valid_k"].tolist() == m_sup["n_valid_k"].tolist()
    assert float(masked_all) != pytest.approx(float(supervised), rel=1e-3)


def test_collate_carries_draft_steps_of_rollout_samples_only() -> None:
    batch = random_batch("hidden", [6, 4], 96, 32)
    assert batch.draft_steps is None

    class WithSteps:
        def __init__(self, n: int, steps: list[int]):
            self.input_ids = torch.arange(n)
            self.loss_mask = torch.ones(n, dtype=torch.bool)
            self.taps = torch.zeros(n, 6)
            self.teacher_argmax = torch.zeros(n, dtype=torch.long)
            self.draft_steps = torch.tensor(steps)

    got = collate([WithSteps(4, [0, 2, 0, 1]), WithSteps(2, [1, 0])])
    assert got.draft_steps.tolist() == [[0, 2, 0, 1], [1, 0, 0, 0]]
    plain = WithSteps(3, [0, 0, 0])
    del plain.draft_steps
    with pytest.raises(ValueError, match="rollouts or supervised samples"):
        collate([WithSteps(4, [0, 2, 0, 1]), plain])


@pytest.mark.parametrize("seed", [0, 1])
def test_a_replayed_dflash_rollout_drafts_the_blocks_dflash_decoding_does(seed: int) -> None:
    """DFlash: real chain decoding at T=0 with the drafter's blocks recorded, against the teacher-forced blocks
    (train.dflash.greedy_drafts) along the same text: every cycle's whole block equal, and greedy_accepts gives the
    decoder's accepted lengths. A small vocabulary so that a random drafter's blocks are accepted now and then."""
    from tiny_models import tiny_dflash_drafter, tiny_llama

    from data_prep.capture import HiddenStateCapture
    from eval.dflash_drafting import DFlashDrafting
    from models.registry import family

    target = tiny_llama(vocab=6, seed=seed)
    drafter = tiny_dflash_drafter(target, tap_layers=[0, 2], block_size=4, num_layers=2, seed=seed)
    depth = drafter.block_size - 1
    runner, chain = TargetRunner(target, drafter.tap_layers), SpecSettings(mode="chain")
    drafts_of = family("dflash").greedy_drafts_fn

    class Recorded(DFlashDrafting):
        def draft(self, root, prefix_len, params, generator):
            tree = super().draft(root, prefix_len, params, generator)
            blocks[prefix_len] = self.block_logits(root, prefix_len).argmax(-1).tolist()
            return tree

    accepted = cycles = 0
    for prompt in PROMPTS:
        prompt = [t % 6 for t in prompt]
        blocks: dict[int, list[int]] = {}
        dec = SpeculativeDecoder(runner, drafter, chain)
        dec.strategy = Recorded(drafter, chain)
        rec = dec.generate(prompt, 40, GREEDY)
        tokens = [*prompt, *rec.output_ids]
        assert rec.output_ids == plain_generate(runner, prompt, 40, GREEDY).output_ids
        with HiddenStateCapture(target, drafter.tap_layers) as capture:
            taps = capture(torch.tensor([tokens]), torch.ones(1, len(tokens), dtype=torch.long)).taps[0]

        class Captured:  # what collate reads of a shard sample
            input_ids, loss_mask, teacher_hidden = torch.tensor(tokens), Rollout(len(prompt), tokens, [],
                                                                                 depth).loss_mask(), None

        Captured.taps = taps
        drafts = drafts_of(drafter, collate([Captured]), depth)[0]
        for root_at, block in blocks.items():  # the cycle rooted at n is anchored at t = n - 1
            assert drafts[:, root_at - 1].tolist() == block, (prompt, root_at)
        replayed = greedy_accepts(tokens, len(prompt), drafts, depth)
        assert replayed[:-1] == rec.accept_lengths[:-1] and len(replayed) == len(rec.accept_lengths)
        assert replayed[-1] <= rec.accept_lengths[-1]
        accepted, cycles = accepted + sum(rec.accept_lengths), cycles + len(rec.accept_lengths)
    print(f"{cycles} cycles, {accepted} drafts accepted")
    assert cycles > 40 and 0 < accepted < depth * cycles  # hits and misses
