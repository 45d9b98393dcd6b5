"""Greedy speculative decoding is token-for-token plain greedy decoding (float64), and leaves exactly the
KV state a plain forward over the committed tokens would build, on the target and on the drafter."""

from __future__ import annotations

import pytest
import torch
from tiny_models import check_state

from eval.sampling import SamplingParams
from eval.spec_decode import PHASES, SpecSettings, SpeculativeDecoder, plain_generate
from eval.target import TargetRunner

torch.set_num_threads(1)

GREEDY = SamplingParams()
SETTINGS = [
    SpecSettings(mode="chain", depth=1),
    SpecSettings(mode="chain", depth=4),
    SpecSettings(mode="tree", depth=1, topk=3, total_tokens=3),
    SpecSettings(mode="tree", depth=3, topk=2, total_tokens=5),
    SpecSettings(mode="tree", depth=4, topk=4, total_tokens=12),
    SpecSettings(mode="tree", depth=6, topk=8, total_tokens=60),
]
PROMPTS = [[1], [5, 9, 2, 7], [3, 3, 3, 3, 3, 3, 11, 4, 20, 1]]


@pytest.fixture(scope="module")
def random_pair():
    from tiny_models import tiny_pair

    target, drafter = tiny_pair(vocab=32, seed=0, draft_vocab=20)  # reduced draft vocab exercises d2t
    return TargetRunner(target, drafter.cfg.tap_layers), drafter


@pytest.fixture(scope="module")
def agreeing_pairs():
    from tiny_models import permutation_pair

    pairs = []
    for noise, seed in [(0.2, 0), (0.3, 1), (0.4, 2)]:
        target, drafter, _ = permutation_pair(vocab=16, hidden=32, noise=noise, seed=seed)
        pairs.append((TargetRunner(target, drafter.cfg.tap_layers), drafter))
    return pairs


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.mode}-d{s.depth}-k{s.topk}-m{s.total_tokens}")
def test_greedy_identical_random_drafter(random_pair, settings: SpecSettings) -> None:
    runner, drafter = random_pair
    for prompt in PROMPTS:
        for max_new in (1, 2, 17):
            plain = plain_generate(runner, prompt, max_new, GREEDY)
            dec = SpeculativeDecoder(runner, drafter, settings)
            spec = dec.generate(prompt, max_new, GREEDY)
            assert spec.output_ids == plain.output_ids, (prompt, max_new)
            assert len(spec.output_ids) == max_new and spec.stop_reason == "length"
            # one verify forward per step: the prefill + one per accepted-length entry
            assert spec.target_forwards == 1 + spec.verify_forwards
            check_state(dec, prompt, spec)


@pytest.mark.integration
@pytest.mark.parametrize("settings", [s for s in SETTINGS if s.depth >= 3], ids=lambda s: f"{s.mode}-d{s.depth}-k{s.topk}-m{s.total_tokens}")
def test_greedy_identical_with_long_accepted_paths(agreeing_pairs, settings: SpecSettings) -> None:
    lengths: list[int] = []
    for runner, drafter in agreeing_pairs:
        for prompt in ([1, 2, 3], [7], [4, 4, 9, 0, 15, 2]):
            plain = plain_generate(runner, prompt, 40, GREEDY)
            dec = SpeculativeDecoder(runner, drafter, settings)
            spec = dec.generate(prompt, 40, GREEDY)
            assert spec.output_ids == plain.output_ids
            check_state(dec, prompt, spec)
            lengths += spec.accept_lengths
            # every phase of the cycle is clocked, and the clocks add up to no more than the request's time
            assert set(spec.phase_s) == set(PHASES) and not plain.phase_s
            assert 0 < sum(spec.phase_s.values()) <= spec.time_s
            # steps = 1 prefill token + Σ (accepted + 1), cut to the budget
            assert sum(a + 1 for a in spec.accept_lengths) + 1 >= 40 > sum(a + 1 for a in spec.accept_lengths[:-1]) + 1
    assert max(lengths) == settings.depth, "no fully accepted path: the test would be weak"
    assert sum(a >= 2 for a in lengths) >= 5 and 0 in lengths, sorted(set(lengths))


def test_greedy_stops_at_eos_like_plain(random_pair) -> None:
    runner, drafter = random_pair
    prompt = PROMPTS[2]
    full = plain_generate(runner, prompt, 30, GREEDY).output_ids
    cut = next(i for i in range(8, 30) if full[i] not in full[:i])  # first occurrence of a token
    eos = (full[cut],)
    plain = plain_generate(runner, prompt, 30, GREEDY, eos)
    assert plain.output_ids == full[: cut + 1] and plain.stop_reason == "eos"
    for settings in SETTINGS:
        spec = SpeculativeDecoder(runner, drafter, settings).generate(prompt, 30, GREEDY, eos)
        assert spec.output_ids == plain.output_ids and spec.stop_reason == "eos"


@pytest.mark.integration
def test_eos_inside_an_accepted_path(agreeing_pairs) -> None:
    """EOS accepted mid-path: the tokens after it in the same step are dropped."""
    checked = 0
    for runner, drafter in agreeing_pairs:
        for prompt in ([1, 2, 3], [7], [4, 4, 9, 0, 15, 2]):
            dec = SpeculativeDecoder(runner, drafter, SpecSettings(mode="chain", depth=4))
            free = dec.generate(prompt, 40, GREEDY)
            inner, emitted = [], 1  # output index 0 is the prefill's token
            for a in free.accept_lengths:
                inner += range(emitted, emitted + a)  # accepted drafts of this step (its bonus excluded)
                emitted += a + 1
            out = free.output_ids
            firsts = [i for i in inner if i < len(out) and out[i] not in out[:i]]
            if not firsts:
                continue
            eos = (out[firsts[0]],)
            spec = dec.generate(prompt, 40, GREEDY, eos)
            assert spec.output_ids == out[: firsts[0] + 1] == plain_generate(runner, prompt, 40, GREEDY, eos).output_ids
            assert spec.stop_reason == "eos"
            checked += 1
    assert checked >= 2


@pytest.fixture(scope="module")
def sliding_pair():
    """A hybrid target (Qwen2, layers 1-2 with a 4-token sliding window) and a random drafter."""
    from tiny_models import tiny_drafter
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      initializer_range=0.2, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    torch.manual_seed(0)
    target = Qwen2ForCausalLM(cfg).double().eval()
    drafter = tiny_drafter(target, tap_layers=[0, 1, 2])
    return TargetRunner(target, drafter.cfg.tap_layers), drafter


def test_plain_baseline_equals_transformers_generate(random_pair, sliding_pair) -> None:
    for runner, _ in (random_pair, sliding_pair):
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            ref = runner.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False,
                                        min_new_tokens=20, pad_token_id=0)
            assert plain_generate(runner, prompt, 20, GREEDY).output_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("settings", SETTINGS[1::2], ids=lambda s: f"{s.mode}-d{s.depth}-k{s.topk}-m{s.total_tokens}")
def test_greedy_identical_sliding_window_target(sliding_pair, settings: SpecSettings) -> None:
    runner, drafter = sliding_pair
    assert runner.sliding_window == 4
    for prompt in PROMPTS:
        plain = plain_generate(runner, prompt, 25, GREEDY)
        dec = SpeculativeDecoder(runner, drafter, settings)
        spec = dec.generate(prompt, 25, GREEDY)
        assert spec.output_ids == plain.output_ids
        check_state(dec, prompt, spec)


def test_plain_decoding_records_the_top2_gap_where_outputs_part(random_pair) -> None:
    """plain_generate keeps, per emitted token, the target's relative top-2 gap (what a bf16 difference is judged
    by: eval/spec_decode.py NEAR_TIE_RTOL); first_difference gives where another output parts and that gap."""
    from eval.spec_decode import first_difference, relative_top2_gap

    runner, _ = random_pair
    prompt = PROMPTS[1]
    plain = plain_generate(runner, prompt, 6, GREEDY)
    assert len(plain.top2_gaps) == len(plain.output_ids) == 6
    logits = runner.forward(prompt + plain.output_ids[:3], runner.new_cache(), want_taps=False).logits[-1]
    top = logits.double().topk(2).values
    assert plain.top2_gaps[3] == pytest.approx(float(top[0] - top[1]) / max(1.0, abs(float(top[0]))), rel=1e-6)
    assert relative_top2_gap(torch.tensor([3.0, 5.0, -1.0])) == pytest.approx(2.0 / 5.0)
    assert relative_top2_gap(torch.tensor([0.5, 0.25])) == pytest.approx(0.25)  # scale max(1, |top-1|)
    assert first_difference(list(plain.output_ids), plain) is None
    other = [*plain.output_ids[:4], plain.output_ids[4] + 1, 0]
    assert first_difference(other, plain) == (4, plain.top2_gaps[4])
    assert first_difference(plain.output_ids[:2], plain) == (2, plain.top2_gaps[2])  # a prefix parts where it ends
