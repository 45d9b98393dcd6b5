"""The frozen pieces of the target that training and evaluation need: final norm, LM head, input embedding.

Target next-token distribution at j = softmax(head.logits(teacher_hidden[j])) (the shard contract).
File layout (`<prep>/target_head.safetensors`): embed_tokens.weight [V, H], norm.weight [H] (and any other
tensor of the target's norm), lm_head.weight [V, H] (not stored when the target ties it to the embedding: the
metadata then says `tied_lm_head`), header keys sorted (the same head, the same bytes), and in the safetensors
metadata what differs between target families (`HeadSpec`, format 2):

- the final norm is the target's own transformers class, recorded by its path: Llama's x·w (cast before
  scaling), Gemma's x·(1 + w) in fp32, gpt-oss's (w·x) in fp32, ... — rebuilt, never re-implemented;
- the LM head applies the target's `final_logit_softcapping` (Gemma-2/3: tanh(z / c) · c);
- the input embedding carries the scale the target's embedding module multiplies by (Gemma: sqrt(hidden),
  rounded to the embedding dtype as the target rounds it), wherever a drafter or the evaluator embeds
  tokens with the target's table (`embed_tokens_weight`, `scaled_embedding_weight`).

A file without that metadata (format 1, preps from before it) is a Llama-style head: x·w, no capping, no
scale — byte-identical to what it always computed.
"""

from __future__ import annotations

import copy
import importlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor, nn

from models.layers import RMSNorm

# The names of the target's own tensors, everywhere a drafter holds, checkpoints, exports or loads them.
EMBED_KEY, NORM_KEY, LM_HEAD_KEY = "embed_tokens.weight", "norm.weight", "lm_head.weight"
KEYS = (EMBED_KEY, NORM_KEY, LM_HEAD_KEY)
# What a drafter that reuses the target's LM head (EAGLE-1, DFlash) holds frozen of it.
EMBED_AND_LM_HEAD = (EMBED_KEY, LM_HEAD_KEY)
FORMAT = 2
# Metadata of a head whose LM head is its embedding: lm_head.weight is not stored (files before it store both).
TIED_KEY = "tied_lm_head"
# Norm classes are imported by the path a prep file names; only from these packages, so that a data file
# can never make the loader import arbitrary code.
NORM_PACKAGES = ("transformers.",)
# A row whose every entry is 2**12 has a mean square of 2**24, to which fp32 adds nothing of any usual eps:
# an RMS of exactly 1, so a norm's output on it is its per-channel multiplier (`norm_weight_equivalent`).
_UNIT_RMS_PROBE = 4096.0


@dataclass(frozen=True)
class HeadSpec:
    """What a target family does differently in its final norm, LM head and input embedding."""

    family: str = "llama"  # the target's model_type, named in errors
    norm_class: str | None = None  # "<module>:<class>" of the target's final norm; None: Llama's x·w (format 1)
    norm_eps: float | None = None  # that norm's epsilon; None: the target config's rms_norm_eps
    final_logit_softcapping: float | None = None  # logits = tanh(z / c) · c
    embed_scale: float = 1.0  # the target's embedding output = table[ids] · embed_scale
    embed_dtype: str | None = None  # the dtype in which the target applies embed_scale (its table's dtype)

    def to_metadata(self) -> dict[str, str]:
        """safetensors metadata (str -> str); None values are left out."""
        meta = {"format": str(FORMAT)}
        meta.update({k: repr(v) if isinstance(v, float) else str(v) for k, v in asdict(self).items() if v is not None})
        return meta

    @classmethod
    def from_metadata(cls, meta: dict[str, str] | None) -> HeadSpec:
        if not meta or "format" not in meta:
            return cls()  # format 1: Llama-style
        if int(meta["format"]) > FORMAT:
            raise ValueError(f"target head format {meta['format']} is newer than this code's ({FORMAT}): update it")
        kinds = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, text in meta.items():
            if key == "format" or key not in kinds:
                continue
            values[key] = float(text) if "float" in str(kinds[key]) else text
        return cls(**values)

    @classmethod
    def from_hf_model(cls, model: nn.Module) -> HeadSpec:
        """Read from a loaded transformers CausalLM: its final norm's class and epsilon, its embedding module's
        scale and its config's soft-capping."""
        text = model.config.get_text_config()  # type: ignore[union-attr, operator]
        norm = final_norm(model)
        emb = model.get_input_embeddings()  # type: ignore[operator]
        scale = getattr(emb, "embed_scale", None)
        cap = getattr(text, "final_logit_softcapping", None)
        return cls(
            family=str(getattr(text, "model_type", None) or type(model).__name__),
            norm_class=f"{type(norm).__module__}:{type(norm).__qualname__}",
            norm_eps=_norm_eps(norm),
            final_logit_softcapping=float(cap) if cap else None,
            embed_scale=1.0 if scale is None else float(scale),
            embed_dtype=str(emb.weight.dtype).removeprefix("torch."),
        )

    def build_norm(self, hidden_size: int, eps: float) -> nn.Module:
        eps = self.norm_eps if self.norm_eps is not None else eps
        if self.norm_class is None:
            return RMSNorm(hidden_size, eps)
        module, _, name = self.norm_class.partition(":")
        if not module.startswith(NORM_PACKAGES):
            raise ValueError(f"target head names the norm class {self.norm_class!r}, outside {NORM_PACKAGES}")
        try:
            norm_cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"the {self.family} target's final norm class {self.norm_class!r} is not importable "
                             f"with this transformers ({e}); use the version the prep was made with") from e
        return norm_cls(hidden_size, eps=eps)


def final_norm(model: nn.Module) -> nn.Module:
    """The final norm of a transformers CausalLM (model.model.norm, or its language model's in a multimodal one)."""
    base = getattr(model, "model", model)
    norm = getattr(base, "norm", None)
    if norm is None and hasattr(base, "language_model"):
        norm = getattr(base.language_model, "norm", None)
    if not isinstance(norm, nn.Module) or getattr(norm, "weight", None) is None:
        raise ValueError(f"cannot find the final norm of {type(model).__name__} at .model.norm")
    return norm


def _norm_eps(norm: nn.Module) -> float | None:
    for name in ("eps", "variance_epsilon"):  # the two spellings of transformers' RMSNorms
        value = getattr(norm, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return None


def _embed_scale(spec: HeadSpec, dtype: torch.dtype) -> Tensor:
    # As the target does it: the scale cast to the dtype of its table (bf16 turns sqrt(3072) into 55.5).
    return torch.tensor(spec.embed_scale).to(getattr(torch, spec.embed_dtype) if spec.embed_dtype else dtype)


def scaled_embedding_weight(model: nn.Module) -> Tensor:
    """The input embedding table of a loaded transformers CausalLM as the target applies it: rows times its
    embedding module's scale (Gemma), in the table's dtype."""
    emb = model.get_input_embeddings()  # type: ignore[operator]
    scale = getattr(emb, "embed_scale", None)
    weight = emb.weight.detach()
    return weight if scale is None else weight * scale.to(weight.dtype)


class TargetHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rms_norm_eps: float, tie_word_embeddings: bool = False,
                 spec: HeadSpec | None = None):
        super().__init__()
        self.spec = spec or HeadSpec()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.norm = self.spec.build_norm(hidden_size, rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.tied = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)

    @property
    def family(self) -> str:
        return self.spec.family

    @property
    def embed_tokens_weight(self) -> Tensor:
        """The embedding table as the target applies it (times its scale, in its dtype): what drafters embed with."""
        weight = self.embed_tokens.weight
        if self.spec.embed_scale == 1.0:
            return weight
        scale = _embed_scale(self.spec, weight.dtype)
        return weight.to(scale.dtype) * scale.to(weight.device)

    def embed(self, input_ids: Tensor) -> Tensor:
        """The target's input embedding of `input_ids` (what its first decoder layer receives)."""
        out = self.embed_tokens(input_ids)
        if self.spec.embed_scale == 1.0:
            return out
        scale = _embed_scale(self.spec, out.dtype)
        return out.to(scale.dtype) * scale.to(out.device)

    def logits(self, hidden: Tensor) -> Tensor:
        """[.., H] (pre final norm) -> [.., V]"""
        logits = self.lm_head(self.norm(hidden))
        cap = self.spec.final_logit_softcapping
        if cap is not None:  # the op order of transformers' Gemma-2/3 heads
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        return logits

    @torch.no_grad()
    def norm_weight_equivalent(self) -> Tensor:
        """The final norm as the weight of a Llama-style (x·w) norm, fp32: w for Llama, 1 + w for Gemma; its
        output on a row of RMS exactly 1, so no formula of the target's norm is re-implemented here."""
        norm = copy.deepcopy(self.norm).float()
        probe = torch.full((1, self.lm_head.in_features), _UNIT_RMS_PROBE, device=self.lm_head.weight.device)
        return norm(probe)[0]

    @classmethod
    def from_tensors(cls, t: dict[str, Tensor], cfg: dict[str, Any], spec: HeadSpec | None = None,
                      tied: bool = False) -> TargetHead:
        """The head from its tensors (KEYS, the norm's under norm.*) and the target's text config. tied: the LM head
        is the embedding whatever the config says (a file that stores it once says so)."""
        cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
        tied = tied or bool(cfg.get("tie_word_embeddings", False))
        if "lm_head.weight" not in t and tied:
            t = {**t, "lm_head.weight": t["embed_tokens.weight"]}
        missing = [k for k in KEYS if k not in t]
        if missing:
            raise ValueError(f"target head tensors missing {missing}")
        vocab, hidden = t["embed_tokens.weight"].shape
        if (hidden, vocab) != (cfg["hidden_size"], cfg["vocab_size"]):
            raise ValueError(f"embed_tokens {tuple(t['embed_tokens.weight'].shape)} does not match the target "
                             f"config (vocab_size={cfg['vocab_size']}, hidden_size={cfg['hidden_size']})")
        # Tie only if the tensors are really the same (a tied config whose file holds two equal copies still works).
        same = tied and torch.equal(t["lm_head.weight"], t["embed_tokens.weight"])
        with torch.device("meta"):  # no random init of [V, H] tables that are replaced at once
            head = cls(hidden, vocab, float(cfg.get("rms_norm_eps", 1e-6)), tie_word_embeddings=same, spec=spec)
        wanted = head.state_dict().keys()
        extra = sorted(set(t) - set(wanted) - {"lm_head.weight"})
        if extra:
            raise ValueError(f"target head tensors {extra} do not belong to a {head.family} head")
        head.load_state_dict({k: t[k] for k in wanted}, strict=True, assign=True)
        if same:
            head.lm_head.weight = head.embed_tokens.weight
        return head.requires_grad_(False)

    @classmethod
    def from_file(
        cls, path: str | Path, target_config: dict[str, Any], dtype: torch.dtype | None = None
    ) -> TargetHead:
        """dtype None keeps the stored dtype."""
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            spec = HeadSpec.from_metadata(meta)
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no items()
        tied = (meta or {}).get(TIED_KEY) == "true" and LM_HEAD_KEY not in tensors  # stored once
        head = cls.from_tensors(tensors, target_config, spec, tied=tied)
        return head if dtype is None else head.to(dtype)

    @classmethod
    def from_hf_model(cls, model: nn.Module) -> TargetHead:
        """From a loaded transformers CausalLM, sharing its tensors (no copy)."""
        spec = HeadSpec.from_hf_model(model)
        out = model.get_output_embeddings()  # type: ignore[operator]
        emb = model.get_input_embeddings()  # type: ignore[operator]
        t = {"embed_tokens.weight": emb.weight, "lm_head.weight": out.weight}
        t.update({f"norm.{k}": v for k, v in final_norm(model).state_dict().items()})
        cfg = model.config.get_text_config().to_dict()  # type: ignore[union-attr, operator]
        cfg["tie_word_embeddings"] = out.weight is emb.weight
        # a tensor-parallel target (DTensor parameters) gives its whole tensors: a collective over its group
        whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in t.items()}
        return cls.from_tensors({k: v.detach() for k, v in whole.items()}, cfg, spec)

    def save(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Every tensor once, `dtype` None: as held. A tied LM head is the embedding (stored once; the metadata
        says `tied_lm_head`), and the header's keys are sorted, so that one head always gives the same bytes (the
        prep summary's sha256): safetensors writes its metadata in a hash map's order, different per process."""
        state = self.state_dict()
        meta = self.spec.to_metadata()
        if self.tied:
            del state[LM_HEAD_KEY]
            meta[TIED_KEY] = "true"
        t = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in state.items()}
        Path(path).write_bytes(canonical_safetensors(save(t, metadata=meta)))  # open(): the umask's mode


def canonical_safetensors(data: bytes) -> bytes:
    """A safetensors file's bytes with its JSON header in sorted key order (the tensors' bytes as they are: the
    data offsets are relative to the end of the header)."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the 8-byte alignment safetensors pads its header to, with spaces
    return len(header).to_bytes(8, "little") + header + data[8 + n:]
