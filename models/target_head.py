"""The frozen pieces of the target that training needs: final RMSNorm, lm_head, and the input embedding.

Target next-token distribution at j = softmax(head.logits(teacher_hidden[j])) (the shard contract).
File layout (`<prep>/target_head.safetensors`): embed_tokens.weight [V, H], norm.weight [H], lm_head.weight [V, H].
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from models.eagle3 import RMSNorm

KEYS = ("embed_tokens.weight", "norm.weight", "lm_head.weight")


class TargetHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rms_norm_eps: float, tie_word_embeddings: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        self.tied = tie_word_embeddings
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)

    @property
    def embed_tokens_weight(self) -> Tensor:
        return self.embed_tokens.weight

    def logits(self, hidden: Tensor) -> Tensor:
        """[.., H] (pre final norm) -> [.., V]"""
        return self.lm_head(self.norm(hidden))

    @classmethod
    def _from_tensors(cls, t: dict[str, Tensor], cfg: dict[str, Any]) -> TargetHead:
        cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
        tied = bool(cfg.get("tie_word_embeddings", False))
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
        head = cls(hidden, vocab, float(cfg.get("rms_norm_eps", 1e-6)), tie_word_embeddings=same)
        head.to(t["embed_tokens.weight"].dtype)
        head.load_state_dict({k: t[k] for k in KEYS}, strict=True)
        return head

    @classmethod
    def from_file(
        cls, path: str | Path, target_config: dict[str, Any], dtype: torch.dtype | None = None
    ) -> TargetHead:
        """dtype None keeps the stored dtype."""
        head = cls._from_tensors(load_file(str(path)), target_config)
        return head if dtype is None else head.to(dtype)

    @classmethod
    def from_hf_model(cls, model: nn.Module) -> TargetHead:
        """From a loaded transformers CausalLM (Llama/Qwen/Mistral-style: model.model.norm)."""
        inner = getattr(model, "model", None)
        norm = getattr(inner, "norm", None)
        if not isinstance(norm, nn.Module) or getattr(norm, "weight", None) is None:
            raise ValueError(f"cannot find the final norm of {type(model).__name__} at .model.norm")
        out = model.get_output_embeddings()  # type: ignore[operator]
        emb = model.get_input_embeddings()  # type: ignore[operator]
        t = {"embed_tokens.weight": emb.weight, "norm.weight": norm.weight, "lm_head.weight": out.weight}
        cfg = model.config.to_dict()  # type: ignore[union-attr]
        cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
        cfg["tie_word_embeddings"] = out.weight is emb.weight
        return cls._from_tensors({k: v.detach() for k, v in t.items()}, cfg)

    def save(self, path: str | Path) -> None:
        # safetensors refuses shared storage, so a tied lm_head is written as its own copy
        t = {k: v.detach().contiguous().clone() for k, v in self.state_dict().items()}
        save_file({k: t[k] for k in KEYS}, str(path))
