"""The drafter's attention: one TTT interface with registered backends of identical semantics, and the caches.

TTT semantics (docs/method.md §4.3). `keys[0]`/`values[0]` are the step-0 keys/values (B, Hkv, T, D), `keys[j]`
for j >= 1 the "diagonal" keys of step j. The queries q (B, Hq, T, D) of the current step k = len(keys) - 1
at position t attend to keys[0][..., :t+1, :] (causal) plus keys[1..k][..., t, :] (their own chain), nothing
else. Memory must stay linear in T.

Every backend is `fn(q, keys, values, scale, **options) -> (B, Hq, T, D)`; `ttt_attention` resolves "auto":
  flash   (CUDA + flash_attn importable)  flash_attn's causal kernel + exact log-sum-exp merge of the diagonal
  flex    (CUDA)                          compiled flex_attention with a BlockMask over [K0; K1; ...; Kk]
  fused   (CPU)                           PyTorch's own CPU flash kernel + the same merge (no recomputation)
  chunked (anywhere)                      query blocks through SDPA with a bool mask, checkpointed per block
  reference                               dense (T, (k+1)T) mask; tests only
GQA (Hkv < Hq) is handled by every backend; query head h uses kv head h // (Hq // Hkv).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

AttnFn = Callable[..., Tensor]
ATTENTION: dict[str, AttnFn] = {}


def register(name: str) -> Callable[[AttnFn], AttnFn]:
    def deco(fn: AttnFn) -> AttnFn:
        if name in ATTENTION:
            raise ValueError(f"attention backend {name!r} registered twice")
        ATTENTION[name] = fn
        return fn

    return deco


@functools.cache
def _has_flash_attn() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _has_cpu_flash_kernel() -> bool:
    return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward")


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> str:
    """'auto' -> the best exact, linear-memory backend for `device` (and dtype); other names are checked."""
    if name != "auto":
        if name not in ATTENTION:
            raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(ATTENTION)} or 'auto'")
        return name
    if torch.device(device).type == "cuda":
        half = dtype in (None, torch.float16, torch.bfloat16)  # flash_attn has no fp32 kernels
        return "flash" if half and _has_flash_attn() else "flex"
    return "fused" if _has_cpu_flash_kernel() else "chunked"


def ttt_attention(
    q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], scale: float, backend: str = "auto",
    **options: Any,
) -> Tensor:
    if len(keys) != len(values) or not keys:
        raise ValueError(f"need matching non-empty key/value lists, got {len(keys)} and {len(values)}")
    if q.shape[1] % keys[0].shape[1]:
        raise ValueError(f"{q.shape[1]} query heads is not a multiple of {keys[0].shape[1]} kv heads")
    name = resolve_backend(backend, q.device, q.dtype)
    if options and backend == "auto":  # e.g. block_size is for "chunked" only: drop (and say so) elsewhere
        accepted = inspect.signature(ATTENTION[name]).parameters
        dropped = tuple(sorted(k for k in options if k not in accepted))
        if dropped:
            _warn_dropped(name, dropped)
            options = {k: v for k, v in options.items() if k in accepted}
    return ATTENTION[name](q, keys, values, scale, **options)


@functools.cache
def _warn_dropped(name: str, dropped: tuple[str, ...]) -> None:
    warnings.warn(f"attention 'auto' resolved to {name!r}, which ignores options {list(dropped)}", stacklevel=3)


def ttt_mask(seq_len: int, n_steps: int, device: torch.device | str | None = None) -> Tensor:
    """Bool (T, n_steps*T), True = may attend, over keys laid out [K0; K1; ...]."""
    t = torch.arange(seq_len, device=device)[:, None]
    j = torch.arange(n_steps * seq_len, device=device)[None, :]
    step, pos = j // seq_len, j % seq_len
    return ((step == 0) & (pos <= t)) | ((step > 0) & (pos == t))


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    # (B, Hkv, T, D) -> (B, Hkv*groups, T, D), head h -> kv head h // groups
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


@register("reference")
def reference_attention(q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], scale: float) -> Tensor:
    T, groups = q.shape[2], q.shape[1] // keys[0].shape[1]
    k = _repeat_kv(torch.cat(list(keys), dim=2), groups).float()  # (B, Hq, nT, D)
    v = _repeat_kv(torch.cat(list(values), dim=2), groups).float()
    scores = (q.float() @ k.transpose(-1, -2)) * scale  # (B, Hq, T, nT)
    scores = scores.masked_fill(~ttt_mask(T, len(keys), q.device), float("-inf"))
    return (scores.softmax(-1) @ v).to(q.dtype)


# ---------------------------------------------------------------------------------------------- chunked
def _chunk(q: Tensor, *kv: Tensor, start: int, end: int, scale: float) -> Tensor:
    n = len(kv) // 2
    keys, values = kv[:n], kv[n:]
    m = end - start
    k = torch.cat([keys[0][:, :, :end], *(x[:, :, start:end] for x in keys[1:])], dim=2)  # (B,Hkv,end+(n-1)m,D)
    v = torch.cat([values[0][:, :, :end], *(x[:, :, start:end] for x in values[1:])], dim=2)
    causal = torch.arange(end, device=q.device)[None, :] <= torch.arange(start, end, device=q.device)[:, None]
    diag = torch.eye(m, dtype=torch.bool, device=q.device).repeat(1, n - 1)  # (m, (n-1)m)
    mask = torch.cat([causal, diag], dim=1)  # (m, end + (n-1)m)
    return F.scaled_dot_product_attention(
        q[:, :, start:end], k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


@register("chunked")
def chunked_attention(
    q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], scale: float, block_size: int = 512
) -> Tensor:
    # Each block's keys are a fresh concatenation of length up to T: kept for backward they would add up to
    # O(T^2 / block_size), so every block is checkpointed (its inputs are views of tensors the caller keeps)
    # and recomputed in backward; peak is one block's (block_size x T) scores.
    T = q.shape[2]
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, *keys, *values))
    outs = []
    for start in range(0, T, block_size):
        fn = functools.partial(_chunk, start=start, end=min(T, start + block_size), scale=scale)
        outs.append(checkpoint(fn, q, *keys, *values, use_reentrant=False) if grad else fn(q, *keys, *values))
    return torch.cat(outs, dim=2)


# ------------------------------------------------------------------ causal kernel + log-sum-exp merge
class _AtenCpuKernel:
    """PyTorch's CPU flash kernel (the one SDPA uses); returns the log-sum-exp we need for the merge."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        g = q.shape[1] // k.shape[1]
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _repeat_kv(k, g), _repeat_kv(v, g), 0.0, True, scale=scale
        )
        return out, lse  # (B, Hq, T, D), (B, Hq, T) fp32

    @staticmethod
    def backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        hkv, g = k.shape[1], q.shape[1] // k.shape[1]
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, _repeat_kv(k, g), _repeat_kv(v, g), out, lse, 0.0, True, scale=scale
        )
        return dq, dk.unflatten(1, (hkv, g)).sum(2), dv.unflatten(1, (hkv, g)).sum(2)


class _FlashAttnKernel:
    """flash_attn (GPU, fp16/bf16). Its autograd ignores d(lse), so the merge calls its backward directly."""

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        from flash_attn import flash_attn_func

        out, lse, _ = flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),  # (B, T, H, D)
            softmax_scale=scale, causal=True, return_attn_probs=True,
        )
        return out.transpose(1, 2), lse[..., : q.shape[2]]

    @staticmethod
    def backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        from flash_attn.flash_attn_interface import _flash_attn_backward

        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # (B, T, H, D)
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        args: dict[str, Any] = dict(
            dout=dout.transpose(1, 2).contiguous(), q=qt, k=kt, v=vt, out=out.transpose(1, 2).contiguous(),
            softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale, causal=True,
            window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
            deterministic=False, rng_state=None,
        )
        params = inspect.signature(_flash_attn_backward).parameters  # differs between flash_attn 2.6 and 2.7+
        _flash_attn_backward(**{name: val for name, val in args.items() if name in params})
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class _CausalPlusDiagonal(torch.autograd.Function):
    """out = softmax over [causal K0 | diagonal K1..Ks] from a causal kernel's (out0, lse0) and s explicit
    diagonal scores. Backward of the causal part: with alpha = exp(lse0 - lse) and O the MERGED output, the
    kernel's own backward called as bwd(dout = alpha * dO, out = O, lse = lse0) is exact: it forms
    dS = P * (alpha dO V^T - rowsum(alpha dO * O)) = P_merged * (dO V^T - rowsum(dO * O)); no lse gradient
    is needed. The diagonal part is s dot products per query, differentiated by hand."""

    @staticmethod
    def forward(ctx: Any, kernel: Any, scale: float, q: Tensor, k0: Tensor, v0: Tensor, *diag: Tensor) -> Tensor:
        s_steps = len(diag) // 2
        hkv, g = k0.shape[1], q.shape[1] // k0.shape[1]
        out0, lse0 = kernel.forward(q, k0, v0, scale)
        qg = q.float().unflatten(1, (hkv, g))  # (B, Hkv, G, T, D)
        lse0g = lse0.float().unflatten(1, (hkv, g))  # (B, Hkv, G, T)
        s = [(qg * kj.float()[:, :, None]).sum(-1) * scale for kj in diag[:s_steps]]  # each (B, Hkv, G, T)
        scores = torch.stack([lse0g, *s], dim=-1)  # (B, Hkv, G, T, 1 + s)
        lse = scores.logsumexp(-1)
        w = (scores - lse[..., None]).exp()  # merge weights: alpha = w[..., 0], beta_j = w[..., j]
        out = w[..., 0, None] * out0.float().unflatten(1, (hkv, g))
        for j, vj in enumerate(diag[s_steps:], start=1):
            out = out + w[..., j, None] * vj.float()[:, :, None]
        out = out.flatten(1, 2).to(q.dtype)  # (B, Hq, T, D)
        ctx.save_for_backward(q, k0, v0, out, lse0, w, *diag)
        ctx.kernel, ctx.scale = kernel, scale
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k0, v0, out, lse0, w, *diag = ctx.saved_tensors
        scale, s_steps = ctx.scale, len(diag) // 2
        hkv, g = k0.shape[1], q.shape[1] // k0.shape[1]
        d_o = dout.float().unflatten(1, (hkv, g))  # (B, Hkv, G, T, D)
        alpha_do = (w[..., 0, None] * d_o).flatten(1, 2).to(q.dtype)
        dq, dk0, dv0 = ctx.kernel.backward(alpha_do, q, k0, v0, out, lse0, scale)
        dq = dq.float().unflatten(1, (hkv, g))
        rowdot = (d_o * out.float().unflatten(1, (hkv, g))).sum(-1)  # (B, Hkv, G, T)
        qg = q.float().unflatten(1, (hkv, g))
        dks, dvs = [], []
        for j in range(s_steps):
            kj, vj = diag[j].float()[:, :, None], diag[s_steps + j].float()[:, :, None]  # (B, Hkv, 1, T, D)
            beta = w[..., j + 1]
            dvs.append((beta[..., None] * d_o).sum(2).to(diag[s_steps + j].dtype))
            ds = beta * ((d_o * vj).sum(-1) - rowdot)  # d loss / d score_j
            dq = dq + scale * ds[..., None] * kj
            dks.append((scale * ds[..., None] * qg).sum(2).to(diag[j].dtype))
        return None, None, dq.flatten(1, 2).to(q.dtype), dk0, dv0, *dks, *dvs


@register("fused")
def fused_attention(q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], scale: float) -> Tensor:
    if q.is_cuda:
        raise ValueError("the 'fused' backend uses PyTorch's CPU flash kernel; use 'flash' or 'flex' on CUDA")
    return _CausalPlusDiagonal.apply(_AtenCpuKernel, scale, q, keys[0], values[0], *keys[1:], *values[1:])


@register("flash")
def flash_attention(q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], scale: float) -> Tensor:
    if not (q.is_cuda and _has_flash_attn()):
        raise ValueError("the 'flash' backend needs CUDA tensors and the flash_attn package")
    return _CausalPlusDiagonal.apply(_FlashAttnKernel, scale, q, keys[0], values[0], *keys[1:], *values[1:])


# ------------------------------------------------------------------------------------------------ flex
@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    # Each distinct T is a new BlockMask/mask_mod closure and may recompile; length bucketing keeps that bounded.
    return torch.compile(flex_attention)


@functools.lru_cache(maxsize=32)
def _flex_block_mask(seq_len: int, n_steps: int, device: torch.device) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        causal = (kv_idx < seq_len) & (kv_idx <= q_idx)
        diagonal = (kv_idx >= seq_len) & (kv_idx % seq_len == q_idx)
        return causal | diagonal

    return create_block_mask(mask_mod, None, None, seq_len, n_steps * seq_len, device=device)


@register("flex")
def flex_attention(q: Tensor, keys: Sequence[Tensor], values: Sequence[Tensor], scale: float) -> Tensor:
    # Keys are concatenated [K0; K1; ...; Kk]: O(k T) memory, still linear in T. No backward on CPU.
    block_mask = _flex_block_mask(q.shape[2], len(keys), q.device)
    k, v = torch.cat(list(keys), dim=2), torch.cat(list(values), dim=2)
    if not torch.is_grad_enabled():  # flex rejects inputs that require grad on CPU even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    return _compiled_flex()(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


# ------------------------------------------------------------------------------------------ the core hook
AttnCore = Callable[..., Tensor]


def ttt_core(
    q: Tensor, k: Tensor, v: Tensor, cache: TTTCache, scale: float, backend: str = "auto", **options: Any
) -> Tensor:
    """One TTT step's attention core: append this step's k/v (B, Hkv, T, D) to `cache`, attend q (B, Hq, T, D).

    A drafter calls it through an attribute (`attn_core`) rather than by name, so that parallelism can be
    applied from outside by replacing that attribute (train/sequence_parallel.py wraps it in an all-to-all
    that hands it the whole sequence for a subset of heads); the model itself never learns about it.
    """
    cache.append(k, v)
    return ttt_attention(q, cache.keys, cache.values, scale, backend, **options)


# ---------------------------------------------------------------------------------------------- caches
class TTTCache:
    """Per-step keys/values of one TTT unroll: entry 0 from step 0 (causal), entry j from step j (diagonal)."""

    def __init__(self) -> None:
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def append(self, k: Tensor, v: Tensor) -> None:
        if self.keys and k.shape != self.keys[0].shape:
            raise ValueError(f"TTT step keys {tuple(k.shape)} differ from step 0 {tuple(self.keys[0].shape)}")
        self.keys.append(k)
        self.values.append(v)

    def __len__(self) -> int:
        return len(self.keys)


class DecodeCache:
    """Inference cache of rotated keys/values (B, Hkv, L, D). `attend` appends the new ones and attends the new
    queries over [cached | new]."""

    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float, attn_mask: Tensor | None = None) -> Tensor:
        """attn_mask: bool (B or 1, 1, Tq, length + Tq), True = may attend; None = all cached + causal new."""
        cached, tq = self.length, q.shape[2]
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        if attn_mask is None:
            cols = torch.arange(cached + tq, device=q.device)[None, :]
            attn_mask = cols <= torch.arange(cached, cached + tq, device=q.device)[:, None]  # (Tq, L)
        elif attn_mask.dtype != torch.bool or attn_mask.shape[-2:] != (tq, cached + tq) or attn_mask.dim() != 4:
            raise ValueError(f"attn_mask must be bool (B|1, 1, {tq}, {cached + tq}); got "
                             f"{attn_mask.dtype} {tuple(attn_mask.shape)}")
        return F.scaled_dot_product_attention(
            q, self.k, self.v, attn_mask=attn_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )

    def keep(self, indices: Tensor) -> None:
        """Keep only these cache positions, in this order: LongTensor [n] (all rows) or [B, n] (per row)."""
        if self.k is None or self.v is None:
            raise ValueError("keep() on an empty DecodeCache")
        if indices.dim() == 1:
            self.k, self.v = self.k[:, :, indices], self.v[:, :, indices]
            return
        idx = indices[:, None, :, None].to(self.k.device)  # (B, 1, n, 1)
        idx = idx.expand(-1, self.k.shape[1], -1, self.k.shape[3])
        self.k, self.v = self.k.gather(2, idx), self.v.gather(2, idx)

    def truncate(self, n: int) -> None:
        """Keep the first n positions."""
        if self.k is not None and self.v is not None:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]
