"""TTT attention backends: every backend available here matches the reference (outputs and q/k/v gradients),
and the reference itself matches a per-query brute force of docs/method.md §4.3."""

from __future__ import annotations

import pytest
import torch

from models.attention import ATTENTION, DecodeCache, TTTCache, resolve_backend, ttt_attention, ttt_mask

torch.set_num_threads(1)
CUDA = torch.cuda.is_available()


def _inputs(B, hq, hkv, T, D, n, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype).requires_grad_()

    return rnd(B, hq, T, D), [rnd(B, hkv, T, D) for _ in range(n)], [rnd(B, hkv, T, D) for _ in range(n)]


def _run(backend, q, ks, vs, **opts):
    """Forward + backward of a fixed random projection of the output; returns (out, dq, dks, dvs)."""
    q, ks, vs = q.detach().clone().requires_grad_(), [k.detach().clone().requires_grad_() for k in ks], [
        v.detach().clone().requires_grad_() for v in vs]
    out = ttt_attention(q, ks, vs, q.shape[-1] ** -0.5, backend=backend, **opts)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    (out * w).sum().backward()
    return out.detach(), q.grad, [k.grad for k in ks], [v.grad for v in vs]


def _max_err(a, b):
    flat_a = [a[0], a[1], *a[2], *a[3]]
    flat_b = [b[0], b[1], *b[2], *b[3]]
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(flat_a, flat_b))


def test_reference_matches_brute_force_semantics():
    B, hq, hkv, T, D, n = 1, 4, 2, 6, 8, 4
    q, ks, vs = _inputs(B, hq, hkv, T, D, n)
    out = ttt_attention(q, ks, vs, 0.3, backend="reference")
    for h in range(hq):
        kv = h // (hq // hkv)
        for t in range(T):
            # step-0 keys at positions <= t, then the diagonal (t, 1..k)
            keys = [ks[0][0, kv, j] for j in range(t + 1)] + [ks[s][0, kv, t] for s in range(1, n)]
            vals = [vs[0][0, kv, j] for j in range(t + 1)] + [vs[s][0, kv, t] for s in range(1, n)]
            p = torch.softmax(torch.stack([q[0, h, t] @ k for k in keys]) * 0.3, 0)
            expected = sum(pi * v for pi, v in zip(p, vals))
            torch.testing.assert_close(out[0, h, t], expected, atol=1e-6, rtol=1e-5)


def test_ttt_mask_counts():
    m = ttt_mask(5, 3)
    assert m.shape == (5, 15)
    assert m.sum(1).tolist() == [t + 1 + 2 for t in range(5)]  # causal t+1 keys + 2 diagonal keys


CPU_BACKENDS = [("chunked", {"block_size": 16}), ("chunked", {}), ("fused", {})]


@pytest.mark.parametrize("backend,opts", CPU_BACKENDS)
@pytest.mark.parametrize("T", [1, 7, 64, 300])
@pytest.mark.parametrize("n_steps", [1, 2, 4, 8])  # keys of step 0 plus k = 0, 1, 3, 7 diagonal steps
def test_cpu_backends_match_reference(backend, opts, T, n_steps):
    if T == 300 and n_steps == 8 and not opts:
        pytest.skip("covered by the block_size=16 case")
    q, ks, vs = _inputs(2, 6, 2, T, 16, n_steps, seed=T + n_steps)  # GQA 6 query / 2 kv heads
    ref = _run("reference", q, ks, vs)
    got = _run(backend, q, ks, vs, **opts)
    assert _max_err(got, ref) < 1e-5


@pytest.mark.parametrize("backend", ["chunked", "fused"])
def test_cpu_backends_without_gqa_and_no_grad(backend):
    q, ks, vs = _inputs(1, 3, 3, 33, 8, 3)
    with torch.no_grad():
        a = ttt_attention(q, ks, vs, 0.5, backend=backend)
        b = ttt_attention(q, ks, vs, 0.5, backend="reference")
    assert not a.requires_grad
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["chunked", "fused"])
def test_cpu_backends_bf16_close_to_fp32_reference(backend):
    q, ks, vs = _inputs(1, 4, 2, 50, 16, 3)
    ref = _run("reference", q, ks, vs)
    low = _run(backend, q.bfloat16(), [k.bfloat16() for k in ks], [v.bfloat16() for v in vs])
    assert low[0].dtype == torch.bfloat16 and low[1].dtype == torch.bfloat16
    assert _max_err(low, ref) < 5e-2


def test_resolve_backend():
    assert resolve_backend("auto", "cpu") in ("fused", "chunked")
    assert resolve_backend("chunked", "cpu") == "chunked"
    assert resolve_backend("auto", "cuda", torch.float32) == "flex"  # flash_attn has no fp32 kernels
    assert set(ATTENTION) >= {"reference", "chunked", "fused", "flex", "flash"}
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("sdpa_dense", "cpu")
    q, ks, vs = _inputs(1, 2, 2, 5, 4, 2)
    with pytest.warns(UserWarning, match="ignores options \\['block_size'\\]"):
        out = ttt_attention(q, ks, vs, 0.5, backend="auto", block_size=2)
    if resolve_backend("auto", "cpu") == "fused":
        torch.testing.assert_close(out, ttt_attention(q, ks, vs, 0.5, backend="reference"))
    with pytest.raises(ValueError, match="multiple"):
        ttt_attention(torch.zeros(1, 3, 2, 4), [torch.zeros(1, 2, 2, 4)], [torch.zeros(1, 2, 2, 4)], 1.0)


def test_caches():
    cache = TTTCache()
    cache.append(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))
    with pytest.raises(ValueError, match="differ from step 0"):
        cache.append(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4))
    dc = DecodeCache()
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 3, 8), torch.randn(2, 2, 3, 8)
    out = dc.attend(q, k, v, 0.35)  # empty cache: plain causal == TTT step 0
    torch.testing.assert_close(out, ttt_attention(q, [k], [v], 0.35, backend="reference"), atol=1e-6, rtol=1e-5)
    assert dc.length == 3
    with pytest.raises(ValueError, match="attn_mask must be bool"):
        dc.attend(q[:, :, :1], k[:, :, :1], v[:, :, :1], 0.35, attn_mask=torch.ones(1, 1, 1, 3, dtype=torch.bool))
    dc.truncate(2)
    assert dc.length == 2
    dc.keep(torch.tensor([[1], [0]]))  # per-row gather
    assert dc.length == 1 and torch.equal(dc.k[0, :, 0], k[0, :, 1]) and torch.equal(dc.k[1, :, 0], k[1, :, 0])


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("backend", ["flex", "flash"])
@pytest.mark.parametrize("T,n_steps", [(1, 1), (7, 4), (300, 8), (1000, 3)])
def test_gpu_backends_match_reference(backend, T, n_steps):
    if backend == "flash":
        pytest.importorskip("flash_attn")
    dtype = torch.bfloat16  # flash_attn has no fp32 kernels; compare to an fp32 reference
    q, ks, vs = _inputs(2, 8, 2, T, 64, n_steps, device="cuda")
    ref = _run("reference", q, ks, vs)
    got = _run(backend, q.to(dtype), [k.to(dtype) for k in ks], [v.to(dtype) for v in vs])
    assert _max_err(got, ref) < 5e-2


@pytest.mark.integration  # compiling flex_attention for CPU takes ~30 s
def test_flex_forward_on_cpu_matches_reference():
    q, ks, vs = _inputs(1, 4, 2, 7, 16, 4)
    with torch.no_grad():
        got = ttt_attention(q, ks, vs, 0.25, backend="flex")
        ref = ttt_attention(q, ks, vs, 0.25, backend="reference")
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def _fake_flash_attn(old_signature: bool):
    """flash_attn's API (B, T, H, D layout, lse (B, H, T), native GQA, in-place dq/dk/dv) on the CPU kernel, to
    check the 'flash' plumbing here; numerics of the real kernel are the GPU test's job."""
    import types

    from models.attention import _AtenCpuKernel

    def t(x):
        return x.transpose(1, 2)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False):
        assert causal and return_attn_probs and dropout_p == 0.0
        out, lse = _AtenCpuKernel.forward(t(q), t(k), t(v), softmax_scale)
        return t(out), lse, None

    def backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, **kw):
        assert kw["window_size" if old_signature else "window_size_left"] in ((-1, -1), -1)
        for x in (dout, q, k, v, out):
            assert x.is_contiguous()
        grads = _AtenCpuKernel.backward(t(dout), t(q), t(k), t(v), t(out), softmax_lse, softmax_scale)
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(t(g))

    if old_signature:  # flash_attn 2.6
        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size, softcap, alibi_slopes, deterministic, rng_state=None):
            backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                     window_size=window_size)
    else:  # flash_attn 2.7+
        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                 rng_state=None):
            backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                     window_size_left=window_size_left)

    pkg, iface = types.ModuleType("flash_attn"), types.ModuleType("flash_attn.flash_attn_interface")
    pkg.flash_attn_func, iface._flash_attn_backward = flash_attn_func, _flash_attn_backward
    return pkg, iface


@pytest.mark.parametrize("old_signature", [False, True])
def test_flash_merge_plumbing_with_fake_flash_attn(monkeypatch, old_signature):
    import sys

    from models.attention import _CausalPlusDiagonal, _FlashAttnKernel

    pkg, iface = _fake_flash_attn(old_signature)
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)
    q, ks, vs = _inputs(2, 6, 2, 37, 16, 4)

    def flash_on_cpu(q, keys, values, scale):
        return _CausalPlusDiagonal.apply(_FlashAttnKernel, scale, q, keys[0], values[0], *keys[1:], *values[1:])

    monkeypatch.setitem(ATTENTION, "fake_flash", flash_on_cpu)
    assert _max_err(_run("fake_flash", q, ks, vs), _run("reference", q, ks, vs)) < 1e-5
