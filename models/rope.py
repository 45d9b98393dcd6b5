"""Rotary position embeddings for the drafter, with the target's scaling (default, linear, llama3, yarn).

Written here rather than borrowed from transformers' ROPE_INIT_FUNCTIONS because those take a
PreTrainedConfig object and their signature changed between transformers 4 and 5; the test suite checks
these frequencies against transformers' own, so the drafter rotates exactly as the target does.
Layout is the HF/NeoX "rotate_half" one (vLLM's is_neox_style=True for Llama).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
) -> tuple[Tensor, float]:
    """Inverse frequencies [head_dim/2] (fp32) and the cos/sin multiplier ("attention factor")."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq, 1.0
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling, max_position_embeddings)
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")


def _llama3(inv_freq: Tensor, s: dict[str, Any]) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn(head_dim: int, theta: float, s: dict[str, Any], max_pos: int) -> tuple[Tensor, float]:
    orig = s.get("original_max_position_embeddings") or max_pos
    factor = s.get("factor") or max_pos / orig

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        m, m_all = s.get("mscale"), s.get("mscale_all_dim")
        attn_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolate = 1 - ramp  # 1 = keep the original frequency, 0 = interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """position_ids [B, T] -> (cos, sin) [B, T, head_dim], computed in fp32."""

    def __init__(
        self, head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position_embeddings: int
    ) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(head_dim, theta, scaling, max_position_embeddings)
        # Not persistent: derived from the config, must not appear among the exported weights.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # (B, T, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (B, T, D)
        cos, sin = emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, heads, T, D); cos/sin (B, T, D)."""
    cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, D): broadcast over heads
    return x * cos + _rotate_half(x) * sin
