"""The EAGLE-1 drafter (docs/method.md §2): feature-level drafting from the target's top-layer feature.

    f_t = the target's top-layer feature AFTER its final norm (what its LM head reads)
    x = fc(cat(embed(x_{t+1}), f_t))                    # Linear(2H -> H) with bias; embeds FIRST (EAGLE's order)
    h = x + o_proj(attn(q/k/v_proj(x)))                 # layer 0 of EAGLE-1 has no input_layernorm
    f̂_{t+1} = h + mlp(post_attention_layernorm(h))     # the predicted next feature, fed back when drafting on
    logits = lm_head(f̂)                                 # the target's frozen LM head over the full vocabulary

Export = the public EAGLE-1 layout (yuhuili/EAGLE-* drafters, vLLM's/SGLang's "eagle" method): a one-layer
LlamaForCausalLM config.json and the tensors fc.weight, fc.bias, layers.0.* (no input_layernorm); the target's
embedding and LM head are not part of it. The drafter has the decoding interface of Eagle3Drafter (fuse,
forward_step, compute_logits, draft_to_target, d2t/t2d = identity maps, tap_layers) so the same speculative
decoder and TTT unroll run it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from models.attention import DecodeCache, TTTCache
from models.config import layer_geometry, rope_from_hf, target_geometry
from models.export import CONFIG_FILE, check_keys, load_tensors, read_weights, write_export
from models.layers import MLP, DraftAttention, RMSNorm
from models.rope import RotaryEmbedding
from models.target_head import EMBED_KEY, LM_HEAD_KEY

ARCHITECTURE = "LlamaForCausalLM"  # what public EAGLE-1 drafters declare (vLLM maps it to its Eagle class)
FINAL_FEATURE = -1  # tap id of the target's post-norm top-layer feature (eval.target.FINAL_FEATURE)


@dataclass
class Eagle1Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    @property
    def draft_vocab_size(self) -> int:
        return self.vocab_size  # the target's LM head: no reduced draft vocabulary

    @classmethod
    def from_target_config(cls, hf: dict[str, Any], **overrides: Any) -> Eagle1Config:
        geometry = target_geometry(hf)
        geometry.pop("target_num_layers")
        cfg = cls(**geometry)
        return dataclasses.replace(cfg, **overrides)

    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            **layer_geometry(self, num_hidden_layers=1),
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "bias": True,  # EAGLE-1's fc has a bias
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> Eagle1Config:
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"only one-layer EAGLE-1 drafters are supported, got {d['num_hidden_layers']} layers")
        theta, scaling = rope_from_hf(d)
        return cls(
            hidden_size=int(d["hidden_size"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            head_dim=d.get("head_dim") or None,
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            torch_dtype=str(d.get("torch_dtype") or "bfloat16"),
        )


class Eagle1Layer(nn.Module):
    def __init__(self, cfg: Eagle1Config, backend: str, options: dict[str, Any]) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, backend, options, in_features=cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache, attn_mask: Tensor | None) -> Tensor:
        h = x + self.self_attn(x, cos, sin, cache, attn_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle1Drafter(nn.Module):
    def __init__(self, cfg: Eagle1Config, attn_backend: str = "auto", **attn_options: Any) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.cfg = cfg
        H, V = cfg.hidden_size, cfg.vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.lm_head = nn.Linear(H, V, bias=False)
        for frozen in (self.embed_tokens, self.lm_head):
            frozen.weight.requires_grad_(False)  # the target's; set by load_target_weights
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.layers = nn.ModuleList([Eagle1Layer(cfg, attn_backend, attn_options)])
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        # Identity vocab maps: the shared code (losses, drafting) speaks draft ids; here they are target ids.
        self.register_buffer("d2t", torch.zeros(V, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(V, dtype=torch.bool))

    @property
    def tap_layers(self) -> list[int]:
        return [FINAL_FEATURE]

    @property
    def attn_backend(self) -> str:
        return self.layers[0].self_attn.backend

    @torch.no_grad()
    def load_target_weights(self, embed: Tensor, lm_head: Tensor) -> None:
        for name, module, w in (("embedding", self.embed_tokens, embed), ("lm_head", self.lm_head, lm_head)):
            if tuple(w.shape) != tuple(module.weight.shape):
                raise ValueError(f"target {name} {tuple(w.shape)} != expected {tuple(module.weight.shape)}")
            module.weight.copy_(w)

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids

    def fuse(self, features: Tensor) -> Tensor:
        """The feature stream is the target's top-layer feature itself (nothing to fuse)."""
        return features.to(self.fc.weight.dtype)

    def forward_step(
        self, hidden: Tensor, input_ids: Tensor, position_ids: Tensor,
        cache: TTTCache | DecodeCache | None = None, attn_mask: Tensor | None = None,
    ) -> Tensor:
        """hidden [B, T, H] (target features, or the previous predicted features); returns f̂ [B, T, H]."""
        B, T, _ = hidden.shape
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(B, T)
        cos, sin = self.rotary(position_ids, hidden.dtype)
        x = self.fc(torch.cat([self.embed_tokens(input_ids).to(hidden.dtype), hidden], dim=-1))
        return self.layers[0](x, cos, sin, TTTCache() if cache is None else cache, attn_mask)

    forward = forward_step

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(hidden)


def export_keys(cfg: Eagle1Config) -> list[str]:
    layer = [f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    layer += [f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return ["fc.weight", "fc.bias", *layer, "layers.0.post_attention_layernorm.weight"]


def save_export(drafter: Eagle1Drafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    return write_export(drafter.state_dict(), export_keys(drafter.cfg), drafter.cfg.to_hf_dict(), out_dir, dtype)


def load_export(
    export_dir: str | Path,
    *,
    target_weights: dict[str, Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    attn_backend: str = "auto",
    target_num_layers: int | None = None,
) -> Eagle1Drafter:
    """Our export or a public EAGLE-1 drafter (its embed_tokens.weight, if stored, is the target's and is
    replaced by target_weights). target_weights: {"embed_tokens.weight", "lm_head.weight"} of the target.
    target_num_layers: not needed (EAGLE-1 reads no tap layers); every family's loader takes it."""
    d = Path(export_dir)
    cfg = Eagle1Config.from_hf_dict(json.loads((d / CONFIG_FILE).read_text()))
    tensors = read_weights(d)
    stored_embed = tensors.pop(EMBED_KEY, None)
    check_keys(tensors, export_keys(cfg), "an EAGLE-1 drafter")
    drafter = Eagle1Drafter(cfg, attn_backend=attn_backend).to(dtype)
    load_tensors(drafter, tensors)
    weights = dict(target_weights or {})
    embed = weights.get(EMBED_KEY, stored_embed)
    if embed is None or LM_HEAD_KEY not in weights:
        raise ValueError("EAGLE-1 decodes with the target's embedding and LM head: pass target_weights")
    drafter.load_target_weights(embed.to(dtype), weights[LM_HEAD_KEY].to(dtype))
    return drafter
