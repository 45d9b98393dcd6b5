"""The target side of decoding: an HF CausalLM forward that also returns the drafter's feature taps,
and KV-cache surgery that keeps only the committed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Tap id of the target's top-layer feature AFTER its final norm, the vector its LM head reads (EAGLE-1's input).
FINAL_FEATURE = -1


def target_fingerprint(config: dict, tokenizer, name: str) -> dict:
    """What an export records of its target (models.export.target_fingerprint), read from a target's HF config
    (a dict) and tokenizer, as prep records it (data_prep.pipeline: the LM head has vocab_size rows)."""
    from data_prep.chat import tokenizer_hash
    from models.export import target_fingerprint as fingerprint

    text = config.get("text_config", config) if "num_hidden_layers" not in config else config
    arch = (config.get("architectures") or [None])[0]
    return fingerprint({"id": name, "architecture": arch, "num_layers": text.get("num_hidden_layers"),
                        "hidden_size": text.get("hidden_size"), "vocab_size": text.get("vocab_size")},
                       tokenizer_hash(tokenizer) if tokenizer is not None else None)


@dataclass
class TargetOutput:
    logits: Tensor  # [T, V] (batch 1 squeezed); [1, V] with last_logits_only
    taps: Tensor | None  # [T, n_taps * H] hidden states after the tap layers, concatenated in tap order


class TargetRunner:
    """Wraps a transformers CausalLM for batch-1 decoding with an explicit cache, positions and mask."""

    def __init__(self, model, tap_layers: list[int] | None = None):
        self.model = model
        self.tap_layers = list(tap_layers) if tap_layers is not None else None
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        text = model.config.get_text_config()
        self.num_layers = num_layers = int(text.num_hidden_layers)
        for i in self.tap_layers or []:
            if not (0 <= i < num_layers or i == FINAL_FEATURE):
                raise ValueError(f"tap layer {i} outside the target's {num_layers} decoder layers")
        # Hybrid targets (gpt-oss, Gemma-2/3, Qwen2 with sliding layers) take a {layer type: mask} dict for custom
        # masks; targets without layer types whose config sets a window (Mistral, Phi-3) slide in every layer.
        layer_types = list(getattr(text, "layer_types", None) or [])
        window = getattr(text, "sliding_window", None)
        self.hybrid = "sliding_attention" in layer_types
        slides = self.hybrid or (not layer_types and bool(window) and getattr(text, "use_sliding_window", True))
        self.sliding_window: int | None = int(window) if slides and window else None

    def new_cache(self):
        """A cache of full layers only: a sliding-window layer drops old keys that tree verification and
        keep_kv address by absolute position (the window is enforced by the mask instead)."""
        from transformers import DynamicCache

        return DynamicCache()

    def tree_mask(self, allowed: Tensor, position_ids: Tensor):
        """bool [Tq, past + Tq] (True = may attend; the cache holds positions 0..past-1) -> the model's
        attention_mask: a 4D additive mask (windowed for a target sliding in every layer), or a per-layer-type
        dict of them for hybrid targets."""
        from eval.tree import additive_mask

        impl = getattr(self.model.config, "_attn_implementation", None)
        if impl not in ("eager", "sdpa"):
            # flash-attention kernels take no arbitrary mask: the tree mask would be silently dropped
            raise ValueError(f"tree verification needs the target loaded with attn_implementation 'sdpa' or "
                             f"'eager' (got {impl!r})")
        full = additive_mask(allowed, self.dtype, self.device)
        if self.sliding_window is None:
            return full
        past = allowed.shape[1] - allowed.shape[0]
        q_pos = position_ids.reshape(-1).cpu()
        k_pos = torch.cat([torch.arange(past), q_pos])
        in_window = (q_pos[:, None] - k_pos[None, :]) < self.sliding_window  # HF: kv > q - window
        windowed = additive_mask(allowed & in_window, self.dtype, self.device)
        return {"full_attention": full, "sliding_attention": windowed} if self.hybrid else windowed

    @torch.no_grad()
    def forward(
        self,
        input_ids: list[int] | Tensor,
        cache,
        position_ids: Tensor | None = None,
        allowed: Tensor | None = None,
        want_taps: bool = True,
        last_logits_only: bool = False,
    ) -> TargetOutput:
        """Appends the new tokens' K/V to `cache`. allowed: None (causal) or bool [T, past + T] (tree mask).
        last_logits_only: the LM head runs on the last token only (a prefill needs no logits for the prompt's
        other tokens, and the head over a 200-token prompt costs as much as several decode steps)."""
        ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device).reshape(1, -1)
        pos = None if position_ids is None else position_ids.to(self.device).reshape(1, -1)
        mask = None
        if allowed is not None:
            if position_ids is None:
                raise ValueError("a tree mask needs explicit position ids")
            mask = self.tree_mask(allowed, position_ids)
        want_taps = want_taps and self.tap_layers is not None
        # HF hidden_states[0] is the embedding output, so decoder layer i's output is entry i + 1, except the last
        # layer's: that entry is after the final norm (the LM head's input: FINAL_FEATURE). A tap of the last layer
        # is its output before the norm, as a capture records it (data_prep/capture.py), so a hook takes it.
        last = self.num_layers - 1
        top: list[Tensor] = []
        hook = None
        if want_taps and last in self.tap_layers:
            from data_prep.capture import decoder_layers

            hook = decoder_layers(self.model)[last].register_forward_hook(
                lambda _m, _i, o: top.append(o[0] if isinstance(o, tuple) else o))
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                cache=cache,
                use_cache=True,
                output_hidden_states=want_taps,
                logits_to_keep=1 if last_logits_only else 0,
            )
        finally:
            if hook is not None:
                hook.remove()
        taps = None
        if want_taps:
            rows = {FINAL_FEATURE: out.hidden_states[-1][0], **({last: top[0][0]} if top else {})}
            taps = torch.cat([rows[i] if i in rows else out.hidden_states[i + 1][0] for i in self.tap_layers], dim=-1)
        return TargetOutput(logits=out.logits[0], taps=taps)


def keep_kv(cache, prefix_len: int, new_indices: Tensor) -> None:
    """Keep cache positions [0, prefix_len) plus prefix_len + new_indices, in that order; drop the rest.

    After a verify forward the cache holds the whole drafted block; only the accepted path survives.
    `new_indices` ascend (a path's nodes come after their parents in the flattened block), so the kept
    entries are gathered into place behind the prefix and the cache is cut to a view: nothing but the
    accepted entries is copied (a chain's accepted prefix: nothing at all).
    Works on full-attention DynamicCache layers (keys/values [B, heads, T, D]), as TargetRunner.new_cache makes.
    """
    idx = new_indices.to(torch.long).reshape(-1)
    kept = idx.numel()
    if kept and bool((idx[1:] <= idx[:-1]).any()):
        raise ValueError(f"keep_kv: new_indices must ascend, got {idx.tolist()}")
    in_place = bool((idx == torch.arange(kept)).all())
    for layer in cache.layers:
        if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys"):
            raise NotImplementedError(f"keep_kv supports full-attention DynamicCache layers, got {type(layer)}")
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        end = prefix_len + kept
        if not in_place:
            src = (prefix_len + idx).to(layer.keys.device)
            # index_select copies the kept rows first, so overwriting the rows they came from is safe
            layer.keys[..., prefix_len:end, :] = layer.keys.index_select(-2, src)
            layer.values[..., prefix_len:end, :] = layer.values.index_select(-2, src)
        layer.keys = layer.keys[..., :end, :]
        layer.values = layer.values[..., :end, :]
