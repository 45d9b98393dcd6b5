"""Chunked teacher + loss (train/loss.py) against a dense reference, for every teacher kind."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from ttt_stubs import StubHead, vocab

from train.loss import TeacherRows, VocabMaps, chunked_terms

V, VD, H, K, N = 40, 12, 8, 3, 11


class RecordingHead(StubHead):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.rows_seen: list[int] = []

    def logits(self, h):
        self.rows_seen.append(h.shape[0])
        return super().logits(h)


class Compute(nn.Module):  # drafter.compute_logits only (norm + lm_head)
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.lm_head = nn.Linear(H, VD, bias=False)

    def compute_logits(self, h):
        return self.lm_head(self.norm(h))


def setup(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    d2t, t2d = vocab(V, VD, gen)
    # A head whose argmax lands in the draft vocab often: boost the draft rows.
    w = torch.randn(V, H, generator=gen)
    w[t2d] *= 2.5
    head = RecordingHead(H, V, w)
    hidden = torch.randn(N, H, generator=gen) * 2
    full = head.logits(hidden)
    head.rows_seen.clear()
    if kind == "hidden":
        rows = TeacherRows(kind, hidden=hidden)
    elif kind == "topk":
        top = full.topk(5, dim=-1)
        rows = TeacherRows(kind, topk_ids=top.indices, topk_logits=top.values)
    else:
        rows = TeacherRows(kind, argmax=full.argmax(-1))
    reachable = torch.rand(K, N, generator=gen) < 0.8
    hiddens = [torch.randn(N, H, generator=gen, requires_grad=True) for _ in range(K)]
    return VocabMaps.build(d2t, t2d), head, rows, reachable, hiddens, Compute()


def dense_reference(kind, maps, head, rows, reachable, hiddens, drafter):
    """The definitions of docs/method.md §4.3 written densely over the full vocab, no chunking."""
    if kind == "hidden":
        p_full = head.logits(rows.hidden).softmax(-1)
        argmax = p_full.argmax(-1)
    elif kind == "topk":
        p_full = torch.zeros(N, V).scatter(1, rows.topk_ids, rows.topk_logits.softmax(-1))
        argmax = rows.topk_ids[:, 0]
    else:
        p_full = torch.nn.functional.one_hot(rows.argmax, V).float()
        argmax = rows.argmax
    tids = maps.draft_to_target
    p_draft = p_full[:, tids]
    p_tilde = p_draft / p_draft.sum(-1, keepdim=True).clamp_min(1e-30)
    valid = reachable & maps.t2d[argmax]
    out = {"ce": [], "acc": [], "min_pq": []}
    for k in range(K):
        logq = drafter.compute_logits(hiddens[k]).log_softmax(-1)
        q_full = torch.zeros(N, V).index_copy(1, tids, logq.exp())
        m = valid[k]
        out["ce"].append(-(p_tilde * logq).sum(-1)[m].sum())
        out["acc"].append((tids[logq.argmax(-1)] == argmax)[m].sum().double())
        out["min_pq"].append(torch.minimum(p_full, q_full).sum(-1)[m].sum().double())
    return {k: torch.stack(v) for k, v in out.items()}, valid


def grads(loss, params):
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("kind", ["hidden", "topk", "argmax"])
def test_chunked_matches_dense_reference_and_gradients(kind):
    maps, head, rows, reachable, hiddens, drafter = setup(kind)
    ref, ref_valid = dense_reference(kind, maps, head, rows, reachable, hiddens, drafter)
    assert ref_valid.sum() > K * 3, "setup should give enough valid rows to mean something"
    params = [*hiddens, *drafter.parameters()]
    weights = torch.tensor([1.0, 0.8, 0.64])
    ref_grads = grads((weights * ref["ce"]).sum(), params)
    for chunk in (1, 3, 4, N, 2 * N):  # 3 and 4 do not divide N = 11
        for ckpt in (True, False):
            head.rows_seen.clear()
            ce, acc, min_pq, _, valid, correct = chunked_terms(
                drafter, head, hiddens, rows, reachable, maps, chunk, ckpt
            )
            torch.testing.assert_close(ce, ref["ce"], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(acc, ref["acc"])
            torch.testing.assert_close(min_pq, ref["min_pq"], rtol=1e-5, atol=1e-6)
            assert torch.equal(valid, ref_valid)
            assert int(correct.sum()) == int(acc.sum()) and not (correct & ~valid).any()
            got = grads((weights * ce).sum(), params)
            for g, r in zip(got, ref_grads):
                torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
            if kind == "hidden":  # the teacher sees one chunk at a time; checkpointing recomputes it once
                n_chunks = -(-N // chunk)
                assert max(head.rows_seen) == min(chunk, N)
                assert len(head.rows_seen) == n_chunks * (2 if ckpt else 1)


def test_masked_rows_get_no_gradient_and_empty_input_is_zero():
    maps, head, rows, reachable, hiddens, drafter = setup("hidden", seed=1)
    reachable[:, :4] = False
    ce, *_ = chunked_terms(drafter, head, hiddens, rows, reachable, maps, 3)
    g = grads(ce.sum(), hiddens)
    assert all(float(x[:4].abs().sum()) == 0.0 for x in g)
    assert all(float(x[4:].abs().sum()) > 0.0 for x in g)

    empty = TeacherRows("hidden", hidden=torch.zeros(0, H))
    hs = [torch.zeros(0, H, requires_grad=True) for _ in range(K)]
    ce, acc, min_pq, _, valid, correct = chunked_terms(
        drafter, head, hs, empty, torch.zeros(K, 0, dtype=torch.bool), maps, 4
    )
    assert ce.shape == (K,) and float(ce.detach().abs().sum()) == 0.0 and valid.shape == (K, 0)
    ce.sum().backward()  # still connected to the drafter: every rank runs the same backward
    assert drafter.lm_head.weight.grad is not None


def test_vocab_maps_offsets():
    d2t = torch.tensor([0, 1, 1, 3])  # draft ids 0..3 -> target 0, 2, 3, 6
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[[0, 2, 3, 6]] = True
    maps = VocabMaps.build(d2t, t2d)
    assert maps.draft_to_target.tolist() == [0, 2, 3, 6]
    assert maps.target_to_draft.tolist() == [0, -1, 1, 2, -1, -1, 3, -1]


def test_argmax_teacher_by_hand():
    """CE = -log q(draft id of the argmax); min_pq = q(argmax); acc by d2t-mapped argmax."""
    d2t, t2d = torch.tensor([0, 1, 1]), torch.tensor([True, False, True, True, False])  # draft -> 0, 2, 3
    maps = VocabMaps.build(d2t, t2d)
    logits = torch.tensor([[2.0, 0.0, 1.0], [0.0, 3.0, 0.0], [1.0, 1.0, 5.0]])

    class Fixed(nn.Module):
        def compute_logits(self, h):
            return h

    rows = TeacherRows("argmax", argmax=torch.tensor([0, 3, 4]))  # target 4 is not in the draft vocab
    h = logits.clone().requires_grad_(True)
    ce, acc, min_pq, _, valid, correct = chunked_terms(
        Fixed(), None, [h], rows, torch.ones(1, 3, dtype=torch.bool), maps, 2
    )
    q = logits.softmax(-1)
    assert valid.tolist() == [[True, True, False]]
    torch.testing.assert_close(ce, -(q[0, 0].log() + q[1, 2].log()).reshape(1))
    torch.testing.assert_close(min_pq, (q[0, 0] + q[1, 2]).double().reshape(1))
    assert acc.tolist() == [1.0] and correct.tolist() == [[True, False, False]]
