"""The layers drafter families share: Llama's RMSNorm, its SwiGLU MLP and its attention over the drafters'
caches (EAGLE-3's and EAGLE-1's layer; DFlash's attention is its own). Parameter names are the engines'."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import AttnCore, DecodeCache, TTTCache, ttt_core
from models.rope import apply_rope


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalise in fp32, cast back, then scale (same op order as transformers)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DraftAttention(nn.Module):
    """Llama attention over a TTTCache (training) or a DecodeCache (drafting). `in_features`: the width of
    its input stream, 2H for EAGLE-3's [embeds, hidden] (the default), H for EAGLE-1."""

    def __init__(self, cfg: Any, backend: str, options: dict[str, Any], in_features: int | None = None) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.backend, self.options = backend, options
        # Replaceable from outside (e.g. sequence parallelism); see models.attention.ttt_core.
        self.attn_core: AttnCore = ttt_core
        d_in = in_features or 2 * cfg.hidden_size
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: TTTCache | DecodeCache, attn_mask: Tensor | None
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, Hq, T, D)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if isinstance(cache, DecodeCache):
            out = cache.attend(q, k, v, self.scale, attn_mask)
        else:
            if attn_mask is not None:
                raise ValueError("attn_mask is only meaningful with a DecodeCache; TTT masks are implicit")
            out = self.attn_core(q, k, v, cache, self.scale, self.backend, **self.options)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, Hq*D)
        return self.o_proj(out)


class MLP(nn.Module):
    """Llama's SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
