"""The DFlash block-diffusion drafter (docs/method.md §5); parameter names are the keys of z-lab's public
`DFlashDraftModel` export, which SGLang's DFLASH worker loads.

    c  = hidden_norm(fc(cat(taps)))                     # fused target features, one row per committed position
    x  = embed([x_a, MASK, ..., MASK])                  # a block of B tokens at positions a .. a+B-1
    per decoder layer (Qwen3 style: q_norm / k_norm on every head before RoPE):
        h  = input_layernorm(x)
        q  = rope(q_norm(q_proj(h)));  k = rope(k_norm(k_proj(h)));  v = v_proj(h)          # the block's
        kc = rope(k_norm(k_proj(c)));  vc = v_proj(c)               # the context's: same projections, un-normed c
        x  = x + o_proj(attend(q, [kc | k], [vc | v]))   # context strictly before a, the whole block both ways
        x  = x + mlp(post_attention_layernorm(x))
    logits = lm_head(norm(x))                            # the target's frozen LM head; position k predicts x_{a+k}

The context keys/values depend on the target features only (not on earlier drafter layers), so at
inference they are computed once per committed token and cached (`DFlashCache`): that cache is the
drafter's KV cache. `attend` is the one thing training and drafting do differently:
`anchored_attention` (many blocks of a training sequence at once, each seeing the context before its
own anchor) and `open_block_attention` (one block after the whole cached context).

Export (`save_export` / `load_export`): config.json with `architectures: ["DFlashDraftModel"]`,
`model_type: "qwen3"`, the Qwen3 geometry fields, `block_size`, `num_target_layers` and
`dflash_config: {target_layer_ids, mask_token_id, block_size}` (0-based target layers, the hidden state
AFTER each, in concat order: what z-lab's `build_target_layer_ids` and SGLang's `dflash_utils` read);
model.safetensors with `fc.weight, hidden_norm.weight, layers.{i}.*, norm.weight` and neither the
embedding nor the LM head (the target's, supplied by `load_export(target_weights=...)`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from infra.config_keys import ConfigError
from models.config import (
    check_geometry,
    check_layer_ids,
    layer_geometry,
    rope_from_hf,
    rope_keys,
    target_geometry,
)
from models.export import CONFIG_FILE, check_keys, load_tensors, read_weights, write_export
from models.layers import MLP, RMSNorm
from models.rope import RotaryEmbedding, apply_rope
from models.target_head import EMBED_AND_LM_HEAD, EMBED_KEY, LM_HEAD_KEY

__all__ = ["DFlashCache", "DFlashConfig", "DFlashDrafter", "default_tap_layers", "load_export", "save_export"]

ARCHITECTURE = "DFlashDraftModel"
# dflash_config switches of other DFlash variants (SGLang's parser knows them); only their absence is implemented.
_UNSUPPORTED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "projector_type",
                "attention_sink_bias", "final_logit_softcapping")

# (q, k, v, k_ctx, v_ctx) -> out: q (B, Hq, N, D), k/v (B, Hkv, N, D) of the block rows, k_ctx/v_ctx
# (B, Hkv, L, D) of the context rows; returns (B, Hq, N, D).
Attend = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


# The public DFlash drafters' shape (z-lab): the defaults of every config and setting that names them.
DEFAULT_NUM_LAYERS = 5
DEFAULT_BLOCK_SIZE = 16


def default_tap_layers(target_num_layers: int, n_taps: int = DEFAULT_NUM_LAYERS) -> list[int]:
    """`n_taps` target layers evenly spaced between layer 1 and L - 3 (0-based, output after the layer),
    rounded as z-lab's and SGLang's build_target_layer_ids round (Python's round: ties to even), so the
    engines derive the same ids when an export omits them. One tap: the middle layer."""
    if n_taps == 1:
        return [target_num_layers // 2]
    start, end = 1, target_num_layers - 3
    if end < start:
        raise ValueError(f"DFlash taps need a target with >= 4 layers, got {target_num_layers}")
    return [int(round(start + i * (end - start) / (n_taps - 1))) for i in range(n_taps)]


@dataclass
class DFlashConfig:
    hidden_size: int  # = the target's (embedding and LM head are the target's)
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's V: the drafter predicts over the full vocabulary
    tap_layers: list[int]  # 0-based target layers tapped, in concat order (fc input = n * hidden_size)
    mask_token_id: int  # a reserved target token id filling the B - 1 positions to predict
    num_hidden_layers: int = DEFAULT_NUM_LAYERS
    block_size: int = DEFAULT_BLOCK_SIZE  # B: [last accepted token, MASK x (B - 1)]
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    target_num_layers: int | None = None  # the target's L (engines derive default taps from it)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None = plain RoPE; else has "rope_type"
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # dtype recorded in the exported config.json

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.tap_layers = [int(i) for i in self.tap_layers]

    def validate(self) -> DFlashConfig:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"DFlashConfig: {msg}")

        check_geometry(self, "DFlashConfig", positive=("num_hidden_layers",))
        need(self.block_size >= 2, f"block_size must be >= 2 (one known token + predictions), got {self.block_size}")
        need(0 <= self.mask_token_id < self.vocab_size,
             f"mask_token_id {self.mask_token_id} is not a target token id (vocab_size {self.vocab_size})")
        check_layer_ids(self.tap_layers, self.target_num_layers, "DFlashConfig", "tap_layers")
        return self

    @classmethod
    def from_target_config(
        cls, hf_config: dict[str, Any], mask_token_id: int, tap_layers: Sequence[int] | None = None,
        num_hidden_layers: int = DEFAULT_NUM_LAYERS, block_size: int = DEFAULT_BLOCK_SIZE, **overrides: Any,
    ) -> DFlashConfig:
        """Geometry = the target's (layers as wide as its own); taps default to `default_tap_layers`
        with one tap per drafter layer, as the public drafters have; `overrides` replace any field."""
        geo = target_geometry(hf_config)
        ids = list(tap_layers) if tap_layers is not None else default_tap_layers(
            geo["target_num_layers"], num_hidden_layers)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown DFlashConfig overrides: {sorted(unknown)}")
        cfg = cls(**geo, tap_layers=ids, mask_token_id=mask_token_id, num_hidden_layers=num_hidden_layers,
                  block_size=block_size)
        return dataclasses.replace(cfg, **overrides).validate()

    # ------------------------------------------------------------------ engine config.json
    def to_hf_dict(self) -> dict[str, Any]:
        dflash = {"target_layer_ids": list(self.tap_layers), "mask_token_id": self.mask_token_id,
                  "block_size": self.block_size}
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            **layer_geometry(self, num_hidden_layers=self.num_hidden_layers),
            **rope_keys(self),
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "layer_types": ["full_attention"] * self.num_hidden_layers,
            "use_sliding_window": False,
            "sliding_window": None,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "is_causal": False,
            # Top level as well as in dflash_config: the first public checkpoints keep block_size here.
            "block_size": self.block_size,
            "num_target_layers": self.target_num_layers,
            "dflash_config": dflash,
            "torch_dtype": self.torch_dtype,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], target_num_layers: int | None = None) -> DFlashConfig:
        """Read an exported (ours or a public drafter's) DFlashDraftModel config.json."""
        arch = (d.get("architectures") or [None])[0]
        if arch != ARCHITECTURE:
            raise ValueError(f"architectures[0] is {arch!r}; expected {ARCHITECTURE!r}")
        dflash = dict(d.get("dflash_config") or {})
        on = [k for k in _UNSUPPORTED if dflash.get(k)]
        if on or "sliding_attention" in (d.get("layer_types") or []):
            raise ValueError(f"DFlash variant not supported: {on or ['sliding_attention layers']}")
        layers = int(d["num_hidden_layers"])
        num_target = d.get("num_target_layers") or dflash.get("num_target_layers") or target_num_layers
        ids = dflash.get("target_layer_ids", d.get("target_layer_ids"))
        if ids is None:
            if num_target is None:
                raise ValueError("config.json has no dflash_config.target_layer_ids nor num_target_layers: pass "
                                 "target_num_layers (the target's decoder layer count)")
            ids = default_tap_layers(int(num_target), layers)
        mask = dflash.get("mask_token_id", d.get("mask_token_id"))
        if mask is None:
            raise ValueError("config.json has no dflash_config.mask_token_id (a token-string mask is not supported)")
        theta, scaling = rope_from_hf(d)
        return cls(
            hidden_size=int(d["hidden_size"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            tap_layers=[int(i) for i in ids],
            mask_token_id=int(mask),
            num_hidden_layers=layers,
            block_size=int(dflash.get("block_size") or d.get("block_size") or DEFAULT_BLOCK_SIZE),
            head_dim=d.get("head_dim") or None,
            target_num_layers=int(num_target) if num_target is not None else None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            hidden_act=str(d.get("hidden_act", "silu")),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
        ).validate()


# ---------------------------------------------------------------------------------------------- attention
def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != k.shape[1]
    )


def open_block_attention(q: Tensor, k: Tensor, v: Tensor, k_ctx: Tensor, v_ctx: Tensor) -> Tensor:
    """Drafting: the block's queries see the whole cached context (all of it precedes the block) and the
    whole block, in both directions: no mask."""
    return _sdpa(q, torch.cat([k_ctx, k], dim=2), torch.cat([v_ctx, v], dim=2), None)


def anchored_mask(anchors: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """bool [B, n*bs, ctx_len + n*bs], True = may attend, for blocks opened at `anchors` [B, n]:
    keys laid out [context 0..ctx_len-1 | block 0 | block 1 | ...]; a query of block i sees the context
    positions strictly before anchors[:, i] and every position of block i; nothing of another block."""
    n = anchors.shape[1]
    block_of = torch.arange(n * block_size, device=anchors.device) // block_size  # query / block-key row -> block
    ctx = torch.arange(ctx_len, device=anchors.device) < anchors[:, block_of, None]  # [B, n*bs, ctx_len]
    own = (block_of[:, None] == block_of[None, :]).expand(anchors.shape[0], -1, -1)  # [B, n*bs, n*bs]
    return torch.cat([ctx, own], dim=-1)


def _group(q: Tensor, k: Tensor, v: Tensor, k_ctx: Tensor, v_ctx: Tensor, anchors: Tensor, *,
           first: int, last: int, block_size: int) -> Tensor:
    rows = slice(first * block_size, last * block_size)
    group = anchors[:, first:last]
    ctx_len = int(group.max())  # every query of the group sees at most this much context
    mask = anchored_mask(group, ctx_len, block_size)[:, None]  # (B, 1, g*bs, ctx_len + g*bs)
    return _sdpa(q[:, :, rows], torch.cat([k_ctx[:, :, :ctx_len], k[:, :, rows]], dim=2),
                 torch.cat([v_ctx[:, :, :ctx_len], v[:, :, rows]], dim=2), mask)


def anchored_attention(
    q: Tensor, k: Tensor, v: Tensor, k_ctx: Tensor, v_ctx: Tensor, anchors: Tensor, block_size: int,
    group_rows: int = 512,
) -> Tensor:
    """Training: n blocks per sequence in one pass (rows = block-major), masked as `anchored_mask`.

    Blocks are processed in groups of about `group_rows` query rows, each group over the context up to
    its largest anchor only, so the peak is one group's scores, never [n*bs, T] for the whole sequence;
    with anchors sorted, the groups' context lengths grow with the group. A group's keys are a fresh
    concatenation that backward would keep (O(T) per group), so each group is checkpointed and
    recomputed in backward, as the chunked TTT backend does."""
    n = anchors.shape[1]
    per = max(1, group_rows // block_size)
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, k_ctx, v_ctx))
    outs = []
    for first in range(0, n, per):
        fn = functools.partial(_group, first=first, last=min(n, first + per), block_size=block_size)
        outs.append(checkpoint(fn, q, k, v, k_ctx, v_ctx, anchors, use_reentrant=False) if grad
                    else fn(q, k, v, k_ctx, v_ctx, anchors))
    return torch.cat(outs, dim=2)


# ---------------------------------------------------------------------------------------------- layers
class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        assert cfg.head_dim is not None
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x (B, T, H) -> rotated keys, values (B, Hkv, T, D); used for block rows and context rows alike."""
        B, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, k_ctx: Tensor, v_ctx: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)  # (B, Hq, T, D)
        k, v = self.keys_values(x, cos, sin)
        out = attend(apply_rope(q, cos, sin), k, v, k_ctx, v_ctx)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, k_ctx: Tensor, v_ctx: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), k_ctx, v_ctx, cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------------- drafter
class DFlashCache:
    """Inference: each layer's context keys/values (1, Hkv, L, D) for the committed positions 0..L-1.
    Block keys/values are never stored: the next block is drafted afresh after the next verify."""

    def __init__(self) -> None:
        self.layers: list[tuple[Tensor, Tensor]] = []

    @property
    def length(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    def extend(self, kv: Sequence[tuple[Tensor, Tensor]]) -> None:
        if not self.layers:
            self.layers = list(kv)
            return
        self.layers = [(torch.cat([k0, k], dim=2), torch.cat([v0, v], dim=2))
                       for (k0, v0), (k, v) in zip(self.layers, kv)]


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DFlashConfig, attn_backend: str = "auto") -> None:
        """attn_backend: accepted for the registry's uniform signature and ignored: DFlash attends through
        PyTorch's SDPA with explicit masks on every device (`anchored_attention`, `open_block_attention`)."""
        super().__init__()
        cfg.validate()
        assert cfg.head_dim is not None
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)  # the target's, frozen (load_target_weights)
        self.fc = nn.Linear(len(cfg.tap_layers) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)  # the drafter's own final norm: trained
        self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)  # the target's, frozen
        self.embed_tokens.weight.requires_grad_(False)
        self.lm_head.weight.requires_grad_(False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.checkpoint_layers = False  # training: recompute each layer in backward (memory ~ its input only)
        self.attn_group_rows = 512  # training: query rows per attention group (anchored_attention)

    @property
    def tap_layers(self) -> list[int]:
        """The target layers whose outputs `fuse` takes, in concat order (0-based decoder layers)."""
        return list(self.cfg.tap_layers)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    @torch.no_grad()
    def load_target_weights(self, embed: Tensor, lm_head: Tensor) -> None:
        """The target's input embedding and LM head, both [V, H]."""
        for name, dst, src in (("embedding", self.embed_tokens.weight, embed), ("LM head", self.lm_head.weight, lm_head)):
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"target {name} {tuple(src.shape)} != expected {tuple(dst.shape)} (vocab, hidden)")
            dst.copy_(src)

    def fuse(self, taps: Tensor) -> Tensor:
        """[B, T, n_taps * H] target features -> [B, T, H] context rows."""
        return self.hidden_norm(self.fc(taps.to(self.fc.weight.dtype)))

    def context_kv(self, ctx: Tensor, position_ids: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Every layer's rotated keys and values (B, Hkv, T, D) of context rows `ctx` [B, T, H]."""
        cos, sin = self.rotary(position_ids.expand(ctx.shape[0], -1), ctx.dtype)
        return [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, context: Sequence[tuple[Tensor, Tensor]], attend: Attend
    ) -> Tensor:
        """Block rows input_ids / position_ids [B, N] through every layer against `context` (per layer
        keys/values from `context_kv` or a DFlashCache); returns [B, N, H] before the final norm."""
        x = self.embed_tokens(input_ids).to(self.fc.weight.dtype)  # (B, N, H)
        cos, sin = self.rotary(position_ids, x.dtype)
        ckpt = self.checkpoint_layers and torch.is_grad_enabled()
        for layer, (k_ctx, v_ctx) in zip(self.layers, context, strict=True):
            if ckpt:
                x = checkpoint(layer, x, k_ctx, v_ctx, cos, sin, attend, use_reentrant=False)
            else:
                x = layer(x, k_ctx, v_ctx, cos, sin, attend)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """[.., H] -> [.., V]"""
        return self.lm_head(self.norm(hidden))

    # ------------------------------------------------------------------ drafting (inference)
    def extend_context(self, cache: DFlashCache, taps: Tensor, start: int) -> None:
        """Append committed positions start.. (their target features taps [1, t, n*H]) to the cache."""
        if cache.length != start:
            raise ValueError(f"context cache holds {cache.length} positions, new ones start at {start}")
        pos = torch.arange(start, start + taps.shape[1], device=taps.device)[None]
        cache.extend(self.context_kv(self.fuse(taps), pos))

    def draft_block(self, cache: DFlashCache, root: int) -> Tensor:
        """One denoising step for the block [root, MASK x (B-1)] at positions L.. (L = cache.length):
        the hidden states [B - 1, H] of the masked positions, position k predicting the token at L + k."""
        device = self.fc.weight.device
        ids = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = root
        pos = torch.arange(cache.length, cache.length + self.block_size, device=device)[None]
        return self.forward(ids, pos, cache.layers, open_block_attention)[0, 1:]


# ---------------------------------------------------------------------------------------------- export
def export_keys(cfg: DFlashConfig) -> list[str]:
    """The exact tensor names save_export writes."""
    layer = [f"self_attn.{p}_proj.weight" for p in "qkvo"] + ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    layer += [f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    layer += ["input_layernorm.weight", "post_attention_layernorm.weight"]
    per_layer = [f"layers.{i}.{name}" for i in range(cfg.num_hidden_layers) for name in layer]
    return ["fc.weight", "hidden_norm.weight", *per_layer, "norm.weight"]


def save_export(drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    return write_export(drafter.state_dict(), export_keys(drafter.cfg), drafter.cfg.to_hf_dict(), out_dir, dtype)


def load_export(
    export_dir: str | Path,
    *,
    target_weights: dict[str, Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    attn_backend: str = "auto",
    target_num_layers: int | None = None,
) -> DFlashDrafter:
    """A drafter ready for decoding. target_weights: the target's "embed_tokens.weight" and
    "lm_head.weight" [V, H] (a tied target may give the embedding only). target_num_layers: needed only
    for configs without dflash_config.target_layer_ids. Weights other than export_keys are an error."""
    d = Path(export_dir)
    cfg = DFlashConfig.from_hf_dict(json.loads((d / CONFIG_FILE).read_text()), target_num_layers)
    tensors = read_weights(d)
    stored = {k: tensors.pop(k) for k in EMBED_AND_LM_HEAD if k in tensors}  # some public exports carry them
    check_keys(tensors, export_keys(cfg), f"a {ARCHITECTURE} checkpoint of this config")
    drafter = DFlashDrafter(cfg, attn_backend=attn_backend).to(dtype)
    load_tensors(drafter, tensors)
    given = {**stored, **(target_weights or {})}
    embed = given.get(EMBED_KEY)
    head = given.get(LM_HEAD_KEY, embed)  # tied targets share one matrix
    if embed is not None and head is not None:
        drafter.load_target_weights(embed.to(dtype), head.to(dtype))
    else:
        warnings.warn("no target embedding / LM head given or stored: they stay random until "
                      "load_target_weights()", stacklevel=2)
    return drafter
