"""Chunked teacher + loss (train/loss.py) against a dense reference, for every teacher kind; the fused output
head (train/loss.py fused_terms) equals the autograd path in loss, metrics and gradients."""

from __future__ import annotations

import pytest
import torch
from tiny_ttt import H as H_TINY
from tiny_ttt import V as V_TINY
from tiny_ttt import tiny, trainable
from torch import nn
from ttt_stubs import StubHead, random_batch, vocab

from models.layers import RMSNorm
from train.loss import NO_ACCEPT, AcceptTerm, TeacherRows, VocabMaps, chunked_terms, fused_terms
from train.ttt import TTTSettings, count_valid, ttt_loss

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


# ---------------------------------------------------------------------------------------------------------------
# The fused output head equals the autograd path

KINDS = ["hidden", "topk", "argmax"]
CHUNKS = (1, 3, 4, N, 2 * N)  # 3 and 4 do not divide N = 11


def close(a, b, what=""):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


ACCEPTS = {"none": NO_ACCEPT, "tv": AcceptTerm("tv", 0.7), "log": AcceptTerm("log", 0.4, floor=0.05)}


def autograd_path(drafter, head, hiddens, rows, reachable, maps, scale, accept=NO_ACCEPT):
    ce, acc, min_pq, term, valid, correct = chunked_terms(drafter, head, hiddens, rows, reachable, maps, N,
                                                          accept=accept)
    return (scale * (ce + accept.weight * term)).sum(), ce, acc, min_pq, valid, correct


def make_loss_case(kind, norm_kind="layer"):
    maps, head, rows, reachable, hiddens, drafter = setup(kind)
    reachable[:, :4] = False  # chunk sizes 1..4 then get chunks without a single valid row
    if norm_kind == "rms":
        drafter.norm = RMSNorm(hiddens[0].shape[1], 1e-6)
    with torch.no_grad():  # non-trivial norm parameters, so their gradients mean something
        for p in drafter.norm.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)) * 0.3)
    scale = torch.tensor([1.0, 0.8, 0.64]) / torch.tensor([7.0, 6.0, 5.0])
    return maps, head, rows, reachable, hiddens, drafter, scale


# The acceptance term does not depend on the norm's kind: the layer-norm case covers it.
@pytest.mark.parametrize(("norm_kind", "accept"), [("layer", "none"), ("rms", "none"), ("layer", "tv"), ("layer", "log")])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_terms_equal_autograd_terms_and_grads(kind, norm_kind, accept):
    """The fused gradient of CE (+ the acceptance term, derived by hand there) against autograd's."""
    accept = ACCEPTS[accept]
    maps, head, rows, reachable, hiddens, drafter, scale = make_loss_case(kind, norm_kind)
    params = [*hiddens, drafter.lm_head.weight, *drafter.norm.parameters()]
    ref = autograd_path(drafter, head, hiddens, rows, reachable, maps, scale, accept)
    assert 0 < int(ref[4].sum()) < K * N and not ref[4][:, :4].any()
    ref_grads = torch.autograd.grad(ref[0], params)
    for chunk in CHUNKS:
        head.rows_seen.clear()
        out = fused_terms(drafter.norm, drafter.lm_head.weight, hiddens, head, rows, reachable, maps, chunk, scale,
                          accept=accept)
        if kind == "hidden":  # the teacher runs once per chunk: no recompute
            assert head.rows_seen == [min(chunk, N - s) for s in range(0, N, chunk)]
        for name, got, want in zip(("loss", "ce", "acc", "min_pq"), out, ref):
            close(got, want, f"{name} chunk={chunk}")
        assert torch.equal(out[4], ref[4]) and torch.equal(out[5], ref[5])
        grads = torch.autograd.grad(out[0], params)
        for i, (g, r) in enumerate(zip(grads, ref_grads)):
            close(g, r, f"grad {i} chunk={chunk}")
        assert all(float(g[:4].abs().sum()) == 0.0 for g in grads[:K])  # rows valid at no step


def test_backward_scales_by_grad_output_and_no_grad_path_agrees():
    maps, head, rows, reachable, hiddens, drafter, scale = make_loss_case("hidden")
    w = drafter.lm_head.weight
    loss, *sums = fused_terms(drafter.norm, w, hiddens, head, rows, reachable, maps, 4, scale)
    g1 = torch.autograd.grad(loss, [hiddens[1], w], retain_graph=True)
    g3 = torch.autograd.grad(-3.0 * loss, [hiddens[1], w])
    for a, b in zip(g1, g3):
        close(-3.0 * a, b)
    with torch.no_grad():
        loss_ng, *sums_ng = fused_terms(drafter.norm, w, hiddens, head, rows, reachable, maps, 4, scale)
    _, *sums_eval = fused_terms(drafter.norm, w, hiddens, head, rows, reachable, maps, 4, None)
    torch.testing.assert_close(loss_ng, loss.detach())
    for a, b, c in zip(sums, sums_ng, sums_eval):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_empty_input_still_gives_connected_zero_grads():
    maps, head, _, _, _, drafter, scale = make_loss_case("hidden")
    H = drafter.lm_head.weight.shape[1]
    hs = [torch.zeros(0, H, requires_grad=True) for _ in range(K)]
    empty = TeacherRows("hidden", hidden=torch.zeros(0, H))
    loss, ce, acc, min_pq, valid, correct = fused_terms(
        drafter.norm, drafter.lm_head.weight, hs, head, empty, torch.zeros(K, 0, dtype=torch.bool), maps, 4, scale
    )
    assert float(loss.detach()) == 0.0 and valid.shape == (K, 0) and correct.shape == (K, 0)
    loss.backward()  # every rank runs the same backward, even without targets
    assert drafter.lm_head.weight.grad is not None and float(drafter.lm_head.weight.grad.abs().sum()) == 0.0


def loss_and_grads(drafter, head, batch, settings, normalizer=None):
    drafter.zero_grad(set_to_none=True)
    loss, m = ttt_loss(drafter, head, batch, settings, normalizer)
    loss.backward()
    return loss.detach(), m, {n: p.grad.clone() for n, p in trainable(drafter)}


@pytest.mark.parametrize("kind", KINDS)
def test_ttt_loss_fused_equals_autograd_through_a_real_unroll(kind):
    drafter, head = tiny()
    batch = random_batch(kind, [13, 9], V_TINY, H_TINY, head=head, seed=3)
    ref_settings = TTTSettings(steps=3, chunk_size=10**6, fused_head=False, checkpoint_chunks=False)
    counts = count_valid(head, batch, ref_settings, drafter)
    n_rows = int(counts[0])
    assert n_rows > 8
    for normalizer in (None, counts + 3):  # own counts, and a "global" one as a trainer passes
        ref = loss_and_grads(drafter, head, batch, ref_settings, normalizer)
        for chunk in (5, 7, n_rows, 10**6):  # 5 and 7 need not divide the row count
            got = loss_and_grads(drafter, head, batch, TTTSettings(steps=3, chunk_size=chunk), normalizer)
            close(got[0], ref[0], f"loss chunk={chunk}")
            for key in ("ce_sum", "acc_sum", "min_pq_sum", "n_valid_k"):
                torch.testing.assert_close(got[1][key], ref[1][key], rtol=1e-5, atol=1e-6, msg=key)
            assert set(got[2]) == set(ref[2]) and {"lm_head.weight", "norm.weight", "fc.weight"} <= set(got[2])
            for name, g in got[2].items():
                assert float(g.abs().sum()) > 0, name
                close(g, ref[2][name], f"{name} chunk={chunk} normalizer={normalizer}")


def test_fused_path_calls_no_output_head_module():
    """ZeRO-3 gathers a module's parameters per call: the per-chunk head must not be a module call."""
    drafter, head = tiny()
    calls = []
    for name in ("norm", "lm_head"):
        getattr(drafter, name).register_forward_pre_hook(lambda mod, args, name=name: calls.append(name))
    batch = random_batch("hidden", [13, 9], V_TINY, H_TINY, seed=3)
    loss, _ = ttt_loss(drafter, head, batch, TTTSettings(steps=3, chunk_size=4), normalizer=torch.tensor([9, 8, 7]))
    loss.backward()
    assert calls == [] and drafter.lm_head.weight.grad is not None
    ttt_loss(drafter, head, batch, TTTSettings(steps=3, chunk_size=4, fused_head=False))
    assert calls  # the autograd path does call them, once per chunk and step


def test_bf16_fused_is_close_to_bf16_autograd():
    drafter, head = tiny()
    drafter.to(torch.bfloat16)
    head.to(torch.bfloat16)
    batch = random_batch("hidden", [13, 9], V_TINY, H_TINY, seed=3).to("cpu", torch.bfloat16)
    ref = loss_and_grads(drafter, head, batch, TTTSettings(steps=3, chunk_size=6, fused_head=False))
    got = loss_and_grads(drafter, head, batch, TTTSettings(steps=3, chunk_size=6))
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=2e-2, atol=0)
    for name, g in got[2].items():
        assert g.dtype == torch.bfloat16, name
        cos = torch.nn.functional.cosine_similarity(g.float().flatten(), ref[2][name].float().flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))


@pytest.mark.parametrize("kind", KINDS)
def test_teacher_targets_from_count_valid_give_the_same_loss_and_grads(kind):
    """The trainer computes the teacher once (count_valid keeps it) instead of twice: nothing changes."""
    drafter, head = tiny()
    batch = random_batch(kind, [13, 9], V_TINY, H_TINY, head=head, seed=5)
    for chunk in (5, 10**6):
        settings = TTTSettings(steps=3, chunk_size=chunk)
        counts, targets = count_valid(head, batch, settings, drafter, return_targets=True)
        assert targets is not None
        assert torch.equal(counts, count_valid(head, batch, settings, drafter))
        ref = loss_and_grads(drafter, head, batch, settings, counts)
        drafter.zero_grad(set_to_none=True)
        loss, m = ttt_loss(drafter, head, batch, settings, counts, teacher_targets=targets)
        loss.backward()
        assert torch.equal(loss.detach(), ref[0])
        for name, p in trainable(drafter):
            assert torch.equal(p.grad, ref[2][name]), name
    tight = TTTSettings(steps=3, chunk_size=5, teacher_cache_mb=0)
    assert count_valid(head, batch, tight, drafter, return_targets=True)[1] is None  # too big: recomputed


def test_acceptance_term_is_its_definition_and_changes_the_loss():
    """Σ over valid rows of 1 − Σ min(p, q) and −log α, from a naive loop; the loss moves by β times it."""
    maps, head, rows, reachable, hiddens, drafter, scale = make_loss_case("hidden")
    with torch.no_grad():
        ce, acc, min_pq, term_tv, valid, _ = chunked_terms(drafter, head, hiddens, rows, reachable, maps, N,
                                                           accept=AcceptTerm("tv", 1.0))
        term_log = chunked_terms(drafter, head, hiddens, rows, reachable, maps, N, accept=AcceptTerm("log", 1.0))[3]
        full = head.logits(rows.hidden).softmax(-1)  # [N, V] the target's p
        want_tv, want_log = torch.zeros(K), torch.zeros(K)
        for k in range(K):
            q = drafter.compute_logits(hiddens[k]).softmax(-1)  # [N, Vd]
            for i in range(N):
                if valid[k, i]:
                    alpha = sum(min(float(full[i, int(maps.draft_to_target[v])]), float(q[i, v])) for v in range(q.shape[1]))
                    want_tv[k] += 1 - alpha
                    want_log[k] += -torch.log(torch.tensor(max(alpha, 1e-3)))
        torch.testing.assert_close(term_tv, want_tv, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(term_log, want_log, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(term_tv, valid.sum(-1).double().float() - min_pq.float(), rtol=1e-5, atol=1e-5)
        plain = fused_terms(drafter.norm, drafter.lm_head.weight, hiddens, head, rows, reachable, maps, 4, scale)[0]
        tv = fused_terms(drafter.norm, drafter.lm_head.weight, hiddens, head, rows, reachable, maps, 4, scale,
                         accept=AcceptTerm("tv", 0.5))[0]
        torch.testing.assert_close(tv - plain, 0.5 * (scale * want_tv).sum(), rtol=1e-5, atol=1e-6)
    assert float(want_tv.sum()) > 0 and not AcceptTerm("tv", 0.0).active and not NO_ACCEPT.active
    with pytest.raises(ValueError, match="kind"):
        AcceptTerm("kl", 1.0)


def test_ttt_loss_with_the_acceptance_term_fused_equals_autograd():
    drafter, head = tiny()
    batch = random_batch("hidden", [13, 9], V_TINY, H_TINY, head=head, seed=3)
    accept = AcceptTerm("log", 0.5)
    ref_settings = TTTSettings(steps=3, chunk_size=10**6, fused_head=False, checkpoint_chunks=False, accept=accept)
    ref = loss_and_grads(drafter, head, batch, ref_settings)
    plain = loss_and_grads(drafter, head, batch, TTTSettings(steps=3, chunk_size=5))
    got = loss_and_grads(drafter, head, batch, TTTSettings(steps=3, chunk_size=5, accept=accept))
    close(got[0], ref[0], "loss")
    assert float(got[0]) > float(plain[0])  # −log α > 0 is added
    torch.testing.assert_close(got[1]["ce_sum"], plain[1]["ce_sum"])  # the reported CE stays CE
    for name, g in got[2].items():
        close(g, ref[2][name], name)
