"""The EAGLE-3 drafter (docs/method.md §4.1, §8): parameter names are the export keys SGLang/vLLM load.

    g = fc(cat(taps))                                   # fuse the target's taps, step 0 only
                                                        # (fc_norm: each tap RMS-normed first)
    x = cat(input_layernorm(embed(ids)), hidden_norm(h))   # (B, T, 2H): embeds FIRST, then the hidden stream
    h = h + o_proj(attn(q/k/v_proj(x)))                 # residual = the un-normed hidden stream
    h = h + mlp(post_attention_layernorm(h))            # -> forward_step's output, fed back at the next step
    logits = lm_head(norm(h))                           # over the draft vocabulary Vd
    next step's hidden stream = h, or norm(h) with norm_output (`next_input`)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.attention import AttnCore, DecodeCache, TTTCache, ttt_core
from models.config import Eagle3Config
from models.rope import RotaryEmbedding, apply_rope

__all__ = ["Eagle3Config", "Eagle3Drafter", "RMSNorm", "next_input"]


def next_input(drafter: nn.Module, out: Tensor) -> Tensor:
    """The next draft step's hidden stream from a step's output, for any drafter: its `next_input`
    (EAGLE-3's norm_output variant normalises it), else the output itself (EAGLE-1, test stubs)."""
    step = getattr(drafter, "next_input", None)
    return out if step is None else step(out)


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


class Eagle3Attention(nn.Module):
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


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config, backend: str, options: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg, backend, options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(
        self, embeds: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor,
        cache: TTTCache | DecodeCache, attn_mask: Tensor | None,
    ) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)
        h = hidden + self.self_attn(x, cos, sin, cache, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: Eagle3Config, attn_backend: str = "auto", **attn_options: Any) -> None:
        """attn_backend: "auto" or a name in models.attention.ATTENTION; attn_options go to that backend
        (e.g. block_size=1024 for "chunked")."""
        super().__init__()
        cfg.validate()
        assert cfg.head_dim is not None
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen; set by load_target_embedding
        if cfg.fc_norm:
            assert cfg.target_hidden_size is not None
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(cfg.n_taps))
        self.fc = nn.Linear(cfg.fc_in_features, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg, attn_backend, attn_options)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # Default mapping: draft id i <-> target id i (valid, so an unmapped drafter is at least consistent).
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[: cfg.draft_vocab_size] = True
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", t2d)

    @property
    def tap_layers(self) -> list[int]:
        """The target layers whose outputs `fuse` takes, in concat order (0-based decoder layers)."""
        return list(self.cfg.aux_layer_ids)

    @property
    def attn_backend(self) -> str:
        return self.midlayer.self_attn.backend

    def set_attn_backend(self, name: str, **options: Any) -> None:
        self.midlayer.self_attn.backend, self.midlayer.self_attn.options = name, options

    @torch.no_grad()
    def load_target_embedding(self, weight: Tensor) -> None:
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"target embedding {tuple(weight.shape)} != expected "
                             f"{tuple(self.embed_tokens.weight.shape)} (vocab_size, hidden_size)")
        self.embed_tokens.weight.copy_(weight)

    @torch.no_grad()
    def set_vocab_mapping(self, d2t: Tensor, t2d: Tensor) -> None:
        """d2t int64[Vd] OFFSETS (target = draft + d2t[draft]); t2d bool[V]; checked for consistency."""
        vd, v = self.cfg.draft_vocab_size, self.cfg.vocab_size
        if tuple(d2t.shape) != (vd,) or tuple(t2d.shape) != (v,):
            raise ValueError(f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} != ({vd},) / ({v},)")
        targets = torch.arange(vd, device=d2t.device) + d2t.long()
        if targets.min() < 0 or targets.max() >= v:
            raise ValueError("d2t maps draft ids outside the target vocabulary (absolute ids instead of offsets?)")
        t2d = t2d.bool()
        if targets.unique().numel() != vd or not t2d.to(targets.device)[targets].all() or int(t2d.sum()) != vd:
            raise ValueError("d2t and t2d disagree: t2d must mark exactly the targets of d2t, each once")
        self.d2t.copy_(d2t.long())
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def fuse(self, taps: Tensor) -> Tensor:
        """[B, T, n_taps * target_hidden] -> [B, T, H] (step-0 hidden stream)."""
        taps = taps.to(self.fc.weight.dtype)
        if self.cfg.fc_norm:
            taps = torch.cat([norm(t) for norm, t in zip(self.fc_norm, taps.chunk(self.cfg.n_taps, dim=-1))], -1)
        return self.fc(taps)

    def next_input(self, hidden: Tensor) -> Tensor:
        """The hidden stream the next draft step takes from this step's output."""
        return self.norm(hidden) if self.cfg.norm_output else hidden

    @torch.no_grad()
    def init_output_from_target(self, lm_head_weight: Tensor | None, norm_weight: Tensor | None) -> None:
        """lm_head = the target LM head's rows at the draft ids (set the vocab mapping first); norm = the
        target's final norm. Either may be None (left as initialised)."""
        if lm_head_weight is not None:
            rows = self.draft_to_target(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))
            self.lm_head.weight.copy_(lm_head_weight.to(self.lm_head.weight.device)[rows])
        if norm_weight is not None:
            self.norm.weight.copy_(norm_weight)

    def forward_step(
        self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor,
        cache: TTTCache | DecodeCache | None = None, attn_mask: Tensor | None = None,
    ) -> Tensor:
        """hidden [B, T, H] (fused taps at step 0, else the previous output); input_ids [B, T] the tokens
        embedded with it; position_ids [B, T] or [T]. cache None = a fresh TTTCache (plain causal).
        Returns the midlayer output [B, T, H], pre final norm."""
        B, T, _ = hidden.shape
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(B, T)
        cos, sin = self.rotary(position_ids, hidden.dtype)  # (B, T, D)
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)  # (B, T, H)
        return self.midlayer(embeds, hidden, cos, sin, TTTCache() if cache is None else cache, attn_mask)

    forward = forward_step  # so wrappers that call module(...) (e.g. a DeepSpeed engine) run one step

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[.., H] -> [.., Vd]"""
        return self.lm_head(self.norm(hidden))
