"""EAGLE-3 (docs/method.md §4.1, §8): its config, its drafter and its engine export, in one file.

The drafter; parameter names are the export keys SGLang/vLLM load:

    g = fc(cat(taps))                                   # fuse the target's taps, step 0 only
                                                        # (fc_norm: each tap RMS-normed first)
    x = cat(input_layernorm(embed(ids)), hidden_norm(h))   # (B, T, 2H): embeds FIRST, then the hidden stream
    h = h + o_proj(attn(q/k/v_proj(x)))                 # residual = the un-normed hidden stream
    h = h + mlp(post_attention_layernorm(h))            # -> forward_step's output, fed back at the next step
    logits = lm_head(norm(h))                           # over the draft vocabulary Vd
    next step's hidden stream = h, or norm(h) with norm_output (`next_input`)

Eagle3Config: the drafter's geometry, built from the target's HF config and written as the engines'
config.json. Layer-id conventions - the one place they are converted:
- `tap_layers` here are 0-based decoder layer ids: the tap is the hidden state AFTER layer i (the same ids
  as the shard manifest's `tap_layers`).
- `eagle_config.eagle_aux_hidden_state_layer_ids` in config.json is in HF `output_hidden_states` indexing
  (entry 0 = embedding output), i.e. 0-based id + 1: vLLM records the input of layer j, which is the output
  of layer j - 1. Engines default to (2, L//2, L-3) there, the same layers as our [1, L//2-1, L-4].

Export = what serving engines load: config.json (LlamaForCausalLMEagle3) + model.safetensors (written by
models/export.py's shared writer). Written keys: fc.weight, midlayer.*, norm.weight, lm_head.weight, d2t,
t2d; never the embedding (engines share the target's). `load_export` also reads public EAGLE-3 drafters:
`layers.0.*` instead of `midlayer.*`, an included embed_tokens.weight, pytorch_model.bin, t2d absent
(derived from d2t), d2t absent when draft_vocab_size == vocab_size (identity). Like vLLM's loader, any
other key is an error.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from infra.config_keys import ConfigError
from models.attention import DecodeCache, TTTCache
from models.config import (
    check_geometry,
    check_layer_ids,
    layer_geometry,
    rope_from_hf,
    rope_keys,
    target_geometry,
)
from models.export import CONFIG_FILE, check_keys, load_tensors, read_weights, write_export
from models.layers import MLP, DraftAttention, RMSNorm
from models.rope import RotaryEmbedding
from models.target_head import EMBED_KEY

ARCHITECTURE = "LlamaForCausalLMEagle3"
# Other names public EAGLE-3 checkpoints use for the same layout.
ARCHITECTURE_ALIASES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")
# eagle_config switches of vLLM's loader that change the forward; only their default (off) is implemented.
_UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc")


def default_tap_layers(num_layers: int) -> list[int]:
    """0-based taps [1, L//2 - 1, L - 4] (= HF hidden_states entries [2, L//2, L - 3]): EAGLE-3's default, and
    the one place its formula is written."""
    if num_layers < 5:
        raise ValueError(f"default EAGLE-3 taps need a target with >= 5 layers, got {num_layers}")
    return [1, num_layers // 2 - 1, num_layers - 4]


@dataclass
class Eagle3Config:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # target vocabulary V (embed_tokens rows, t2d length)
    draft_vocab_size: int  # Vd (lm_head rows, d2t length)
    tap_layers: list[int]  # 0-based target layers tapped, in concat order
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    target_hidden_size: int | None = None  # None -> hidden_size; fc input = n_taps * target_hidden_size
    target_num_layers: int | None = None  # only used to validate tap_layers
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # None = plain RoPE; else has "rope_type"
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"  # dtype recorded in the exported config.json
    # The "EAGLE-3.1" variant (vLLM's keys): an RMSNorm on each tap before fc, and the NORMED hidden state
    # (instead of the un-normed one) fed to the next draft step.
    fc_norm: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.tap_layers = [int(i) for i in self.tap_layers]

    @property
    def n_taps(self) -> int:
        return len(self.tap_layers)

    @property
    def fc_in_features(self) -> int:
        assert self.target_hidden_size is not None
        return self.n_taps * self.target_hidden_size

    def validate(self) -> Eagle3Config:
        check_geometry(self, "Eagle3Config", positive=("draft_vocab_size", "target_hidden_size"))
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(f"Eagle3Config: draft_vocab_size ({self.draft_vocab_size}) > vocab_size "
                              f"({self.vocab_size})")
        check_layer_ids(self.tap_layers, self.target_num_layers, "Eagle3Config", "tap_layers")
        if self.n_taps != 3:
            warnings.warn(f"{self.n_taps} taps: vLLM and SGLang build fc with 3 * target_hidden_size inputs, "
                          "so this drafter will only load in this project", stacklevel=2)
        return self

    # ------------------------------------------------------------------ construction from the target
    @classmethod
    def from_target_config(
        cls,
        hf_config: dict[str, Any],
        draft_vocab_size: int,
        tap_layers: list[int] | None = None,
        **overrides: Any,
    ) -> Eagle3Config:
        """Drafter geometry = the target's (a one-layer Llama block of the same width); `overrides` replace
        any field (e.g. intermediate_size=...)."""
        geometry = target_geometry(hf_config)
        num_layers = geometry.pop("target_num_layers")
        cfg = cls(
            **geometry,
            draft_vocab_size=int(draft_vocab_size),
            tap_layers=list(tap_layers) if tap_layers is not None else default_tap_layers(num_layers),
            target_hidden_size=geometry["hidden_size"],
            target_num_layers=num_layers,
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown Eagle3Config overrides: {sorted(unknown)}")
        return dataclasses.replace(cfg, **overrides).validate()

    # ------------------------------------------------------------------ engine config.json
    def to_hf_dict(self) -> dict[str, Any]:
        eagle_config: dict[str, Any] = {
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in self.tap_layers],  # HF hidden_states index
            "use_aux_hidden_state": True,
        }
        if self.target_num_layers is not None:
            eagle_config["target_num_hidden_layers"] = self.target_num_layers  # ours; engines ignore it
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            **layer_geometry(self, num_hidden_layers=1),
            **rope_keys(self),
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": False,
            "mlp_bias": False,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "eagle_config": eagle_config,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "torch_dtype": self.torch_dtype,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], target_num_layers: int | None = None) -> Eagle3Config:
        """Read an exported (ours or a public drafter's) LlamaForCausalLMEagle3 config.json."""
        arch = (d.get("architectures") or [None])[0]
        if arch not in ARCHITECTURE_ALIASES:
            raise ValueError(f"architectures[0] is {arch!r}; expected one of {ARCHITECTURE_ALIASES}")
        if int(d.get("num_hidden_layers", 1)) != 1:
            raise ValueError(f"only one-layer EAGLE-3 drafters are supported, got {d['num_hidden_layers']} layers")
        eagle = dict(d.get("eagle_config") or {})
        on = [k for k in _UNSUPPORTED_FLAGS if d.get(k) or eagle.get(k)]
        if on or eagle.get("use_aux_hidden_state") is False:
            raise ValueError(f"drafter variant not supported: {on or ['use_aux_hidden_state=false']}")
        target_num_layers = target_num_layers or eagle.get("target_num_hidden_layers")
        hf_ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if hf_ids is not None:
            aux = [int(i) - 1 for i in hf_ids]
        elif target_num_layers is not None:
            aux = default_tap_layers(int(target_num_layers))
        else:
            raise ValueError("config.json has no eagle_config.eagle_aux_hidden_state_layer_ids: pass "
                             "target_num_layers (the target's decoder layer count) to derive the engines' default")
        theta, scaling = rope_from_hf(d)
        hidden = int(d["hidden_size"])
        return cls(
            hidden_size=hidden,
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads") or d["num_attention_heads"]),
            head_dim=d.get("head_dim") or None,
            intermediate_size=int(d["intermediate_size"]),
            vocab_size=int(d["vocab_size"]),
            draft_vocab_size=int(d.get("draft_vocab_size") or d["vocab_size"]),
            tap_layers=aux,
            target_hidden_size=int(d.get("target_hidden_size") or hidden),
            target_num_layers=int(target_num_layers) if target_num_layers is not None else None,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            hidden_act=str(d.get("hidden_act", "silu")),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)),
        ).validate()


def next_input(drafter: nn.Module, out: Tensor) -> Tensor:
    """The next draft step's hidden stream from a step's output, for any drafter: its `next_input`
    (EAGLE-3's norm_output variant normalises it), else the output itself (EAGLE-1, test stubs)."""
    step = getattr(drafter, "next_input", None)
    return out if step is None else step(out)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, cfg: Eagle3Config, backend: str, options: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg, backend, options)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

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
        return list(self.cfg.tap_layers)

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


# ------------------------------------------------------------------ engine export
def export_keys(cfg: Eagle3Config | None = None) -> list[str]:
    """The exact tensor names save_export writes (+ vLLM's `fc_norm.{i}.weight` for the fc_norm variant)."""
    layer = [f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"]
    layer += [f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    layer += [f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")]
    fc_norm = [f"fc_norm.{i}.weight" for i in range(cfg.n_taps)] if cfg is not None and cfg.fc_norm else []
    return [*fc_norm, "fc.weight", *layer, "norm.weight", "lm_head.weight", "d2t", "t2d"]


def save_export(drafter: Eagle3Drafter, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    return write_export(drafter.state_dict(), export_keys(drafter.cfg), drafter.cfg.to_hf_dict(), out_dir, dtype)


def normalize_keys(tensors: dict[str, Tensor], cfg: Eagle3Config) -> dict[str, Tensor]:
    """Public layouts -> our parameter names; fills d2t/t2d where they may be derived; errors on the rest."""
    t = {(f"midlayer.{k[len('layers.0.'):]}" if k.startswith("layers.0.") else k): v for k, v in tensors.items()}
    if "d2t" not in t:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise ValueError(f"no d2t but draft_vocab_size ({cfg.draft_vocab_size}) != vocab_size "
                             f"({cfg.vocab_size}): the draft->target mapping is lost")
        t["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in t:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(cfg.draft_vocab_size) + t["d2t"].long()] = True
        t["t2d"] = t2d
    check_keys({k: v for k, v in t.items() if k != EMBED_KEY}, export_keys(cfg),
               "an EAGLE-3 LlamaForCausalLMEagle3 checkpoint")
    return t


def load_export(
    export_dir: str | Path,
    *,
    target_weights: dict[str, Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
    attn_backend: str = "auto",
    target_num_layers: int | None = None,
) -> Eagle3Drafter:
    """The drafter of an export, ready for decoding. target_weights: the target's tensors by name; EAGLE-3
    takes its [V, H] embedding ("embed_tokens.weight", which wins over one stored in the checkpoint) and no
    other. target_num_layers: needed only for configs without eagle_aux_hidden_state_layer_ids."""
    embed_weight = (target_weights or {}).get(EMBED_KEY)
    d = Path(export_dir)
    raw = json.loads((d / CONFIG_FILE).read_text())
    cfg = Eagle3Config.from_hf_dict(raw, target_num_layers=target_num_layers)  # refuses another architecture
    tensors = normalize_keys(read_weights(d), cfg)
    drafter = Eagle3Drafter(cfg, attn_backend=attn_backend).to(dtype)
    stored_embed = tensors.pop(EMBED_KEY, None)
    load_tensors(drafter, tensors)
    embed = embed_weight if embed_weight is not None else stored_embed
    if embed is not None:
        drafter.load_target_embedding(embed.to(dtype))
    else:
        warnings.warn("no target embedding given or stored: embed_tokens stays random until "
                      "load_target_embedding()", stacklevel=2)
    drafter.set_vocab_mapping(drafter.d2t.clone(), drafter.t2d.clone())  # re-check the loaded mapping
    return drafter
