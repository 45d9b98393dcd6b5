"""DFlash block drafting inside SpeculativeDecoder: lossless greedy (token-for-token plain greedy, float64)
and sampling, the drafter's context cache after a generation, and the report's block size.

A random DFlash drafter rarely agrees with a random target, so multi-token acceptance is exercised by an
"oracle" strategy: the real drafter still runs every step (its cache bookkeeping is what is tested), but
the block's logits are replaced by the target's own greedy continuation with some positions corrupted."""

from __future__ import annotations

import pytest
import torch
from tiny_models import rank_goodness_of_fit, tiny_dflash_drafter, tiny_llama

from eval.dflash_drafting import DFlashDrafting
from eval.sampling import SamplingParams
from eval.spec_decode import SpecSettings, SpeculativeDecoder, plain_generate
from eval.target import TargetRunner

torch.set_num_threads(1)

GREEDY = SamplingParams()
CHAIN = SpecSettings(mode="chain")
PROMPTS = [[1], [5, 9, 2, 7], [3, 3, 3, 3, 3, 3, 11, 4, 20, 1]]


class OracleDrafting(DFlashDrafting):
    """Drafts the target's greedy continuation, wrong wherever (prefix_len * 7 + k) % wrong_every == 0."""

    def __init__(self, drafter, settings, runner: TargetRunner, wrong_every: int = 5, sharp: float = 4.0):
        super().__init__(drafter, settings)
        self.runner, self.wrong_every, self.sharp = runner, wrong_every, sharp
        self.seq: list[int] = []

    def start(self, prompt_ids, taps, root):
        super().start(prompt_ids, taps, root)
        self.seq = [*prompt_ids, root]

    def commit(self, taps, accepted, bonus, prefix_len):
        super().commit(taps, accepted, bonus, prefix_len)
        self.seq = [*self.seq[: prefix_len + 1], *accepted, bonus]

    def block_logits(self, root, prefix_len):
        real = super().block_logits(root, prefix_len)  # the real drafter runs on the real cache
        assert self.seq[prefix_len] == root and len(self.seq) == prefix_len + 1
        truth = plain_generate(self.runner, self.seq, real.shape[0], GREEDY).output_ids
        vocab = real.shape[-1]
        logits = torch.zeros_like(real)
        for k, x in enumerate(truth):
            wrong = (prefix_len * 7 + k) % self.wrong_every == 0
            logits[k, (x + 1) % vocab if wrong else x] = self.sharp
        return logits


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=32, seed=0)
    drafter = tiny_dflash_drafter(target, tap_layers=[0, 2], block_size=5, num_layers=2, mask_token_id=31)
    return TargetRunner(target, drafter.tap_layers), drafter


def check_context_cache(dec: SpeculativeDecoder, prompt: list[int], rec) -> None:
    """The drafter's context cache = a fresh extend over the committed tokens' target features."""
    from models.dflash import DFlashCache

    if not rec.accept_lengths:
        return
    runner, drafter = dec.target, dec.drafter
    seq = prompt + rec.output_ids
    n = dec.drafter_cache.length
    fresh = runner.forward(seq[:n], runner.new_cache())
    ref = DFlashCache()
    drafter.extend_context(ref, fresh.taps[None].to(drafter.fc.weight.dtype), 0)
    for (k, v), (rk, rv) in zip(dec.drafter_cache.layers, ref.layers):
        # the drafter's RMSNorm computes in float32: chunked vs one-shot differs at float32 rounding
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)


def test_greedy_identical_random_drafter(pair) -> None:
    runner, drafter = pair
    for prompt in PROMPTS:
        for max_new in (1, 2, 17):
            plain = plain_generate(runner, prompt, max_new, GREEDY)
            dec = SpeculativeDecoder(runner, drafter, CHAIN)
            spec = dec.generate(prompt, max_new, GREEDY)
            assert spec.output_ids == plain.output_ids, (prompt, max_new)
            assert spec.target_forwards == 1 + spec.verify_forwards
            assert len(spec.depth_attempts) == drafter.block_size - 1
            check_context_cache(dec, prompt, spec)


@pytest.mark.integration
def test_greedy_identical_with_long_accepted_paths(pair) -> None:
    runner, drafter = pair
    lengths: list[int] = []
    for wrong_every in (3, 5, 9):
        for prompt in PROMPTS:
            plain = plain_generate(runner, prompt, 40, GREEDY)
            dec = SpeculativeDecoder(runner, drafter, CHAIN)
            dec.strategy = OracleDrafting(drafter, CHAIN, runner, wrong_every)
            spec = dec.generate(prompt, 40, GREEDY)
            assert spec.output_ids == plain.output_ids
            check_context_cache(dec, prompt, spec)
            lengths += spec.accept_lengths
            assert sum(a + 1 for a in spec.accept_lengths) + 1 >= 40 > sum(a + 1 for a in spec.accept_lengths[:-1]) + 1
    assert max(lengths) == drafter.block_size - 1, "no fully accepted block: the test would be weak"
    assert 0 in lengths and sum(a >= 2 for a in lengths) >= 5, sorted(set(lengths))


@pytest.mark.integration
def test_greedy_stops_at_eos_inside_an_accepted_block(pair) -> None:
    runner, drafter = pair
    checked = 0
    for prompt in PROMPTS:
        full = plain_generate(runner, prompt, 30, GREEDY).output_ids
        for cut in range(2, 25):
            if full[cut] in full[:cut]:
                continue  # EOS must be the first occurrence of its token
            dec = SpeculativeDecoder(runner, drafter, CHAIN)
            dec.strategy = OracleDrafting(drafter, CHAIN, runner, wrong_every=50)
            spec = dec.generate(prompt, 30, GREEDY, (full[cut],))
            assert spec.output_ids == full[: cut + 1] and spec.stop_reason == "eos"
            checked += 1
    assert checked >= 3


def test_tree_mode_is_refused(pair) -> None:
    runner, drafter = pair
    with pytest.raises(ValueError, match="decode.mode=chain"):
        SpeculativeDecoder(runner, drafter, SpecSettings(mode="tree"))


@pytest.mark.integration
def test_sampling_is_lossless() -> None:
    """Drafts drawn from q at the target temperature, min(1, p/q) acceptance: the outputs pass the same
    rank goodness-of-fit test as plain sampling (tests/tiny_models.py; test_eval_sampling_e2e.py shows that
    lossy rules fail it with this many sequences)."""
    target = tiny_llama(vocab=8, hidden=16, intermediate=32, seed=1, init_std=0.4)
    drafter = tiny_dflash_drafter(target, tap_layers=[0, 1, 2], block_size=4, num_layers=1, mask_token_id=7)
    runner = TargetRunner(target, drafter.tap_layers)
    prompt, params = [3, 5, 1], SamplingParams(temperature=1.0, top_p=0.95)

    class WrongQ(OracleDrafting):  # records a q the drafts were NOT drawn from: lossy, must fail the test
        def draft(self, *args):
            tree = super().draft(*args)
            tree.q = [None, *((q**3) / (q**3).sum() for q in tree.q[1:])]
            return tree

    def p_value(strategy) -> tuple[float, set[int]]:
        gen = torch.Generator().manual_seed(3)
        recs = []
        for _ in range(60):
            dec = SpeculativeDecoder(runner, drafter, CHAIN)
            if strategy is not None:
                dec.strategy = strategy(drafter, CHAIN, runner, wrong_every=4, sharp=2.0)
            recs.append(dec.generate(prompt, 20, params, (), gen))
        lengths = {a for r in recs for a in r.accept_lengths}
        return rank_goodness_of_fit(runner, prompt, [r.output_ids for r in recs], params), lengths

    assert p_value(None)[0] > 1e-3  # the real (random) drafter
    p, lengths = p_value(OracleDrafting)
    assert p > 1e-3 and {0, 1, 2, 3} <= lengths, (p, sorted(lengths))
    assert p_value(WrongQ)[0] < 1e-6


def test_report_says_block_size(pair, tmp_path) -> None:
    from eval import metrics
    from eval.run import format_summary

    runner, drafter = pair
    dec = SpeculativeDecoder(runner, drafter, CHAIN)
    recs = [dec.generate(p, 12, GREEDY) for p in PROMPTS]
    assert dec.strategy.describe() == {"method": "dflash", "mode": "chain", "block_size": 5, "draft_tokens_per_step": 4}
    summary = metrics.summarize(recs, dec.depth)
    assert len(summary["per_position_acceptance"]) == 4
    report = {"target": "t", "drafter": "d", "prompts": "p", "num_prompts": 3, "num_requests": 3,
              "decode": {"mode": "chain", "depth": 6, "topk": 8, "total_tokens": 60, "temperature": 0.0,
                         "max_new_tokens": 12},
              "drafting": dec.strategy.describe(), **summary,
              "tokens_per_s": {"speculative": 1.0, "baseline": 1.0}, "speedup": 1.0}
    text = format_summary(report)
    assert "dflash block_size=5" in text and "(block=5)" in text


def test_run_eval_with_a_dflash_export(tmp_path, tiny_target_dir) -> None:
    """eval/run.py unchanged for users: the generic loader takes the DFlash export, the report names the block."""
    import json

    from transformers import AutoModelForCausalLM

    from eval.config import DecodeConfig, EvalConfig
    from eval.run import format_summary, run_eval
    from models.dflash import save_export

    target = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    drafter = tiny_dflash_drafter(target, tap_layers=[0, 2, 4], block_size=4, mask_token_id=16)
    save_export(drafter, tmp_path / "export", dtype=torch.float32)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "q1", "turns": ["What is 2 + 2?", "And 3 + 3?"]}) + "\n")
    cfg = EvalConfig(drafter=str(tmp_path / "export"), target=str(tiny_target_dir), prompts=str(prompts),
                     out_dir=str(tmp_path / "eval"), dtype="float32", warmup=False, threads=1,
                     decode=DecodeConfig(mode="chain", max_new_tokens=10))
    report = run_eval(cfg, progress=False)
    assert report["drafting"] == {"method": "dflash", "mode": "chain", "block_size": 4, "draft_tokens_per_step": 3}
    assert len(report["per_position_acceptance"]) == 3 and report["num_requests"] == 2
    assert report["outputs_identical_to_baseline"]["count"] == 2
    assert "dflash block_size=4" in format_summary(report)
    assert (tmp_path / "eval" / "per_position_acceptance.png").stat().st_size > 1000
    cfg.decode.mode = "tree"
    with pytest.raises(ValueError, match="decode.mode=chain"):
        run_eval(cfg, progress=False)
