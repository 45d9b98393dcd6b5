"""TTT alignment, validity, normalisation and evaluation (train/ttt.py) with hand-built stub drafters."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from ttt_stubs import FakeSample, OracleDrafter, StubDrafter, StubHead, random_batch, vocab

import train.ttt as ttt
from train.batch import collate
from train.loss import VocabMaps
from train.ttt import TTTSettings, count_valid, evaluate, reduce_metrics, simulated_tau, ttt_loss

V, VD, H = 48, 20, 6


@pytest.fixture(autouse=True)
def no_attention_cache(monkeypatch):
    monkeypatch.setattr(ttt, "new_ttt_cache", lambda: None)  # the stubs have no attention


def make(seed: int = 0, lengths=(10, 6, 3), kind: str = "hidden"):
    gen = torch.Generator().manual_seed(seed)
    d2t, t2d = vocab(V, VD, gen)
    w = torch.randn(V, H, generator=gen)
    w[t2d] *= 2.0  # most argmaxes in the draft vocab, not all
    head = StubHead(H, V, w)
    drafter = StubDrafter(V, VD, H, 3, d2t, t2d, seed=seed)
    batch = random_batch(kind, list(lengths), V, H, head=head, seed=seed)
    return drafter, head, batch


def brute_force_valid(batch, head, maps, K):
    """valid[k][b][t] straight from the definition in docs/method.md §4.3 / the contract."""
    if batch.teacher_kind == "hidden":
        argmax = head.logits(batch.teacher_hidden).argmax(-1)
    elif batch.teacher_kind == "topk":
        argmax = batch.teacher_topk_ids[..., 0]
    else:
        argmax = batch.teacher_argmax
    B, T = batch.input_ids.shape
    out = torch.zeros(K, B, T, dtype=torch.bool)
    for b in range(B):
        n = int(batch.valid[b].sum())
        for k in range(K):
            for t in range(T):
                j = t + k + 1
                out[k, b, t] = j + 1 < n and bool(batch.loss_mask[b, j + 1]) and bool(maps.t2d[argmax[b, j]])
    return out


def test_step_inputs_ids_positions_and_feedback():
    drafter, head, batch = make()
    K = 4
    outs = ttt.unroll(drafter, batch, TTTSettings(steps=K))
    assert len(drafter.calls) == K
    B, T = batch.input_ids.shape
    torch.testing.assert_close(drafter.calls[0]["hidden"], drafter.fuse(batch.taps))
    for k, call in enumerate(drafter.calls):
        for b in range(B):
            for t in range(T):
                want = (
                    int(batch.input_ids[b, t + k + 1]) if t + k + 1 < T else 0
                )  # e(x_{t+k+1}), pad past the end
                assert int(call["ids"][b, t]) == want
                assert int(call["pos"][b, t]) == t + k  # RoPE position of (t, k)
        if k:
            assert call["hidden"] is outs[k - 1]  # a^{(k-1)} is fed back


class PositionOracle(nn.Module):
    """Predicts the draft id (pos + 1) % Vd: right iff step k at position t is scored on p_{t+k+1}."""

    def __init__(self, d2t, t2d):
        super().__init__()
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.w = nn.Parameter(torch.ones(()))

    def fuse(self, taps):
        return taps[..., :1] * 0

    def forward_step(self, hidden, input_ids, position_ids, cache, attn_mask=None):
        return (
            torch.nn.functional.one_hot((position_ids + 1) % self.d2t.numel(), self.d2t.numel()).float()
            * self.w
        )

    def compute_logits(self, h):
        return h * 10


@pytest.mark.parametrize("shift", [0, 1, -1])
def test_step_k_targets_p_of_t_plus_k_plus_1(shift):
    gen = torch.Generator().manual_seed(3)
    d2t, t2d = vocab(V, VD, gen)
    maps = VocabMaps.build(d2t, t2d)
    T, K = 12, 4  # T < VD: (j % VD) identifies j
    j = torch.arange(T)
    sample = FakeSample(
        "a",
        torch.randint(1, V, (T,), generator=gen),
        torch.ones(T, dtype=torch.bool),
        torch.randn(T, 3),
        teacher_argmax=maps.draft_to_target[(j + shift) % VD],  # shift 0: p_j's argmax "is" j
    )
    batch = collate([sample])
    loss, m = ttt_loss(PositionOracle(d2t, t2d), None, batch, TTTSettings(steps=K))
    assert m["n_valid_k"].tolist() == [T - 2 - k for k in range(K)]  # j = t+k+1 in [k+1, T-2]
    assert m["acc_k"].tolist() == ([1.0] * K if shift == 0 else [0.0] * K)


@pytest.mark.parametrize("kind", ["hidden", "topk", "argmax"])
def test_valid_counts_match_definition(kind):
    drafter, head, batch = make(seed=1, lengths=(11, 7, 4, 2), kind=kind)
    K = 5
    maps = VocabMaps.from_drafter(drafter)
    want = brute_force_valid(batch, head, maps, K)
    assert want.sum() > 10 and (~want).sum() > 10
    settings = TTTSettings(steps=K, chunk_size=5)
    _, m = ttt_loss(drafter, head, batch, settings)
    assert m["n_valid_k"].tolist() == want.sum((1, 2)).tolist()
    assert count_valid(head, batch, settings, drafter).tolist() == want.sum((1, 2)).tolist()


def test_padding_content_is_ignored():
    drafter, head, batch = make(seed=2)
    loss, m = ttt_loss(drafter, head, batch, TTTSettings(steps=3))
    pad = ~batch.valid
    junk = batch.to("cpu")
    junk.input_ids = torch.where(pad, 7, batch.input_ids)
    junk.taps = torch.where(pad[..., None], 1e3, batch.taps)
    junk.teacher_hidden = torch.where(pad[..., None], -5.0, batch.teacher_hidden)
    loss2, m2 = ttt_loss(drafter, head, junk, TTTSettings(steps=3))
    assert torch.equal(loss, loss2) and torch.equal(m["n_valid_k"], m2["n_valid_k"])


def test_split_batch_with_global_normalizer_equals_full_batch():
    drafter, head, full = make(seed=4, lengths=(9, 5, 8, 3))
    settings = TTTSettings(steps=3, chunk_size=4)
    samples = [
        FakeSample(
            full.sample_ids[i],
            full.input_ids[i, :n],
            full.loss_mask[i, :n],
            full.taps[i, :n],
            teacher_hidden=full.teacher_hidden[i, :n],
        )
        for i, n in enumerate(full.lengths.tolist())
    ]
    halves = [collate(samples[:2]), collate(samples[2:])]
    global_n = sum(count_valid(head, b, settings, drafter) for b in halves)
    assert torch.equal(global_n, count_valid(head, full, settings, drafter))

    params = [p for p in drafter.parameters() if p.requires_grad]
    loss_full, m_full = ttt_loss(drafter, head, full, settings)
    g_full = torch.autograd.grad(loss_full, params)
    parts = [ttt_loss(drafter, head, b, settings, normalizer=global_n) for b in halves]
    loss_sum = parts[0][0] + parts[1][0]
    g_sum = torch.autograd.grad(loss_sum, params)
    torch.testing.assert_close(loss_sum, loss_full, rtol=1e-5, atol=0)
    for a, b in zip(g_sum, g_full):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # Each half alone (own normalizer) is a different, larger-weighted loss: the normalizer matters.
    assert not torch.allclose(ttt_loss(drafter, head, halves[0], settings)[0], parts[0][0])
    red = reduce_metrics([parts[0][1], parts[1][1]])
    for key in ("ce_sum", "acc_sum", "min_pq_sum", "n_valid_k", "loss_k", "acc_k", "min_pq_k"):
        torch.testing.assert_close(red[key], m_full[key], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(red["loss"], loss_full.detach().double(), rtol=1e-5, atol=0)


def test_decay_weighting():
    drafter, head, batch = make(seed=5)
    _, m = ttt_loss(drafter, head, batch, TTTSettings(steps=4))
    for decay in (0.0, 0.5, 1.0):
        loss, _ = ttt_loss(drafter, head, batch, TTTSettings(steps=4, decay=decay))
        want = sum(decay**k * m["loss_k"][k] for k in range(4))
        torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=0)
    assert float(m["loss_k"][0]) > 0
    doubled, _ = ttt_loss(drafter, head, batch, TTTSettings(steps=4), normalizer=2 * m["n_valid_k"])
    torch.testing.assert_close(doubled.double(), 0.5 * (0.8 ** torch.arange(4.0)).double() @ m["loss_k"])


def test_simulated_tau_formula():
    assert simulated_tau([1.0] * 7) == 8.0  # K drafts + the bonus token
    assert simulated_tau([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert simulated_tau([0.8, 0.5, 0.0, 1.0]) == pytest.approx(1 + 0.8 + 0.4)
    assert simulated_tau([]) == 1.0


def test_chain_counts_by_hand():
    K, T = 3, 7
    gen = torch.Generator().manual_seed(0)
    valid = torch.rand(K, T, generator=gen) < 0.8
    correct = valid & (torch.rand(K, T, generator=gen) < 0.7)
    j = torch.arange(T)
    num, den = ttt._chain_counts(valid, correct, torch.zeros(T, dtype=torch.long), j, (1, T))
    want_num, want_den = [0] * K, [0] * K
    for t in range(T):
        for k in range(K):
            jj = t + k + 1
            if jj >= T or not valid[k, jj]:
                break
            want_den[k] += 1
            if not correct[k, jj]:
                break
            want_num[k] += 1
    assert num.tolist() == want_num and den.tolist() == want_den
    assert sum(want_den) > sum(want_num) > 0


@pytest.mark.parametrize("kind", ["hidden", "argmax", "topk"])
def test_evaluate_oracle_gives_tau_k_plus_1(kind):
    gen = torch.Generator().manual_seed(6)
    d2t, t2d = vocab(V, VD, gen)
    in_draft = VocabMaps.build(d2t, t2d).draft_to_target
    succ = torch.arange(V)
    succ[in_draft] = in_draft[torch.randperm(VD, generator=gen)]  # a permutation inside the draft vocab
    succ[in_draft[0]], succ[in_draft[1]] = in_draft[1], in_draft[2]  # plus a way out of it
    K, samples = 4, []
    for i, T in enumerate((30, 17)):
        x = [int(in_draft[3 * i + 3])]
        for _ in range(T - 1):
            x.append(int(succ[x[-1]]))
        ids = torch.tensor(x)
        nxt = torch.cat([ids[1:], ids[:1]])  # p_j's argmax = x_{j+1} (last row unused)
        s = FakeSample(f"s{i}", ids, torch.rand(T, generator=gen) < 0.9, torch.randn(T, 2))
        if kind == "hidden":
            s.teacher_hidden = torch.nn.functional.one_hot(nxt, V).float() * 20
        elif kind == "topk":
            s.teacher_topk_ids = torch.stack([nxt, (nxt + 1) % V], -1)
            s.teacher_topk_logits = torch.tensor([30.0, 0.0]).expand(T, 2)
        else:
            s.teacher_argmax = nxt
        samples.append(s)
    head = StubHead(V, V, torch.eye(V))
    drafter = OracleDrafter(V, d2t, t2d, succ)
    drafter.train()
    batches = [collate(samples[:1]), collate(samples[1:])]
    out = evaluate(drafter, head, batches, TTTSettings(steps=K, chunk_size=7))
    assert drafter.training  # mode restored
    assert out["acc_k"] == [1.0] * K and out["alpha_k"] == [1.0] * K
    assert out["sim_tau"] == K + 1 and out["sim_tau_alpha"] == K + 1
    assert out["num_samples"] == 2 and out["num_positions"] == out["n_valid_k"][0] > 10
    assert all(loss < 1e-3 for loss in out["loss_k"]) and all(m > 0.99 for m in out["min_pq_k"])


def test_evaluate_matches_ttt_loss_metrics_and_alpha_definition():
    drafter, head, batch = make(seed=7, lengths=(12, 9))
    settings = TTTSettings(steps=3)
    _, m = ttt_loss(drafter, head, batch, settings)
    out = evaluate(drafter, head, [batch], settings)
    # the loss's metrics are over its rows (in the draft vocabulary); the held-out acc_k over every target row
    torch.testing.assert_close(torch.tensor(out["acc_in_vocab_k"]), m["acc_k"].float(), rtol=1e-6, atol=0)
    n_in, n_all = torch.tensor(out["n_valid_k"]), torch.tensor(out["n_target_k"])
    assert (n_in < n_all).all()  # the stub head puts some argmaxes outside the draft vocabulary
    torch.testing.assert_close(torch.tensor(out["acc_k"], dtype=torch.float64), m["acc_k"].double() * n_in / n_all,
                               rtol=1e-6, atol=0)
    assert out["oov_rate"] == pytest.approx(1 - n_in[0].item() / n_all[0].item())
    torch.testing.assert_close(torch.tensor(out["loss_k"]), m["loss_k"].float(), rtol=1e-5, atol=0)
    assert out["alpha_k"][0] == pytest.approx(out["acc_k"][0])  # step 0 has no earlier steps to condition on


def test_evaluate_counts_targets_outside_the_draft_vocab_as_misses():
    """An oracle that is right on every token it can emit: acc_k, alpha_k and sim τ are exactly what the
    out-of-vocabulary targets leave, counted from the definition (a never-proposable token is a miss)."""
    gen = torch.Generator().manual_seed(3)
    d2t, t2d = vocab(V, VD, gen)
    in_draft = VocabMaps.build(d2t, t2d).draft_to_target
    outside = (~t2d).nonzero().squeeze(1)
    succ = torch.arange(V)
    succ[in_draft] = in_draft.roll(1)  # a cycle inside the draft vocab ...
    succ[in_draft[0]], succ[outside[0]] = outside[0], in_draft[1]  # ... with one detour outside it
    T, K = 40, 3
    x = [int(in_draft[5])]
    for _ in range(T - 1):
        x.append(int(succ[x[-1]]))
    ids = torch.tensor(x)
    mask = torch.ones(T, dtype=torch.bool)
    mask[:4] = False
    s = FakeSample("s", ids, mask, torch.randn(T, 2))
    s.teacher_argmax = torch.cat([ids[1:], ids[:1]])
    out = evaluate(OracleDrafter(V, d2t, t2d, succ), StubHead(V, V, torch.eye(V)), [collate([s])],
                   TTTSettings(steps=K, chunk_size=5))
    hit = lambda j: bool(t2d[ids[j + 1]])  # noqa: E731  the oracle drafts x_{j+1} exactly when it can
    rows = [[j for j in range(T - 1) if mask[j + 1] and j - k - 1 >= 0] for k in range(K)]
    assert 0 < sum(not hit(j) for j in rows[0]) < len(rows[0])  # the data does leave the vocabulary
    want_acc = [sum(map(hit, r)) / len(r) for r in rows]
    num, den = [0] * K, [0] * K
    for t in range(T):
        for k in range(K):
            j = t + k + 1
            if j >= T - 1 or not mask[j + 1]:
                break
            den[k] += 1
            if not hit(j):
                break
            num[k] += 1
    assert out["acc_k"] == pytest.approx(want_acc)
    assert out["alpha_k"] == pytest.approx([a / b for a, b in zip(num, den)])
    assert out["sim_tau"] == pytest.approx(simulated_tau(want_acc))
    assert out["acc_in_vocab_k"] == [1.0] * K
    assert out["oov_rate"] == pytest.approx(1 - want_acc[0])
    assert out["num_positions"] == len(rows[0])
