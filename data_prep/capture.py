"""One forward pass of the frozen target per batch, keeping only what the drafter trains on.

Forward hooks on the tap layers (and the last decoder layer, for the teacher) collect those hidden
states and nothing else: no `output_hidden_states=True` (which would keep every layer) and no LM head
over the whole sequence unless a compact teacher asks for it, and then in chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layer list of an HF CausalLM (Llama, Qwen, gpt-oss, Mistral, ... all use model.layers)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None and hasattr(base, "language_model"):
        layers = base.language_model.layers
    if layers is None:
        raise TypeError(f"{type(model).__name__}: cannot find its decoder layers (expected .model.layers)")
    return layers


def base_model(model: nn.Module) -> nn.Module:
    return getattr(model, "model", model)


@dataclass
class Captured:
    taps: torch.Tensor  # [B, T, n_taps * H]
    final_hidden: torch.Tensor  # [B, T, H], last decoder layer output, before the final norm


class HiddenStateCapture:
    """Context manager: while active, forwards of `model` record the tap layers and the last layer."""

    def __init__(self, model: nn.Module, tap_layers: list[int]):
        layers = decoder_layers(model)
        bad = [i for i in tap_layers if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"tap layers {bad} out of range for a {len(layers)}-layer target")
        self.model, self.tap_layers = model, list(tap_layers)
        self._wanted = sorted(set(tap_layers) | {len(layers) - 1})
        self._layers = layers
        self._store: dict[int, torch.Tensor] = {}
        self._handles: list = []

    def __enter__(self) -> HiddenStateCapture:
        for i in self._wanted:
            self._handles.append(self._layers[i].register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, index: int):
        def hook(_module, _inputs, output):
            self._store[index] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Captured:
        self._store.clear()
        # The base model only: the LM head over [B, T, V] is not needed for the hidden teacher.
        base_model(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self._collect()

    @torch.no_grad()
    def with_reference(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """What `__call__` captures, from ONE forward of the whole target, and that forward's own output (logits,
        output_hidden_states): the two sides data_prep/fidelity.py compares."""
        self._store.clear()
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                         output_hidden_states=True)
        return self._collect(), out

    def _collect(self) -> Captured:
        taps = torch.cat([self._store[i] for i in self.tap_layers], dim=-1)
        final = self._store[len(self._layers) - 1]
        self._store.clear()
        return Captured(taps=taps, final_hidden=final)

    @property
    def num_layers(self) -> int:
        return len(self._layers)


def pad_right(sequences: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [B, T] of right-padded token id sequences, as capture batches them."""
    width = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        ids[i, : len(s)] = s
        attn[i, : len(s)] = 1
    return ids, attn


@torch.no_grad()
def compact_teacher(
    head: nn.Module, final_hidden: torch.Tensor, kind: str, k: int = 0, chunk: int = 1024
) -> dict[str, torch.Tensor]:
    """Top-k logits or argmax labels from the target head (models.target_head.TargetHead: the family's final
    norm, LM head and soft-capping, as the hidden teacher's logits are recomputed), `chunk` tokens at a time."""
    flat = final_hidden.reshape(-1, final_hidden.shape[-1])  # (B*T, H)
    ids, vals = [], []
    for part in flat.split(chunk):
        logits = head.logits(part).float()  # (chunk, V)
        if kind == "argmax":
            ids.append(logits.argmax(-1))
        else:
            top = logits.topk(k, dim=-1)
            ids.append(top.indices)
            vals.append(top.values)
    lead = final_hidden.shape[:-1]
    if kind == "argmax":
        return {"teacher_argmax": torch.cat(ids).view(lead)}
    return {
        "teacher_topk_ids": torch.cat(ids).view(*lead, k),
        "teacher_topk_logits": torch.cat(vals).view(*lead, k),
    }


def capture_samples(capture: HiddenStateCapture, head: nn.Module | None, spec, batch: list, device) -> list:
    """The shard samples (data_prep.shards.Sample, as captured: the target's dtype) of `batch` (rendered samples:
    conversation_id, input_ids, loss_mask), from ONE right-padded forward of the target: the tap layers' outputs
    and the teacher of `spec.teacher` (the last layer's output for "hidden", else `compact_teacher` on `head`).
    Prep's capture stage and online training (train/online.py) both call this."""
    from data_prep.shards import Sample

    ids, attn = pad_right([s.input_ids for s in batch])
    got = capture(ids.to(device), attn.to(device))
    teacher = {}
    if spec.teacher != "hidden":
        teacher = compact_teacher(head, got.final_hidden, spec.teacher, spec.teacher_topk)
    samples = []
    for i, s in enumerate(batch):
        n = len(s.input_ids)
        samples.append(Sample(
            sample_id=s.conversation_id,
            input_ids=s.input_ids,
            loss_mask=s.loss_mask,
            taps=got.taps[i, :n].cpu(),
            teacher_hidden=got.final_hidden[i, :n].cpu() if spec.teacher == "hidden" else None,
            **{k: v[i, :n].cpu() for k, v in teacher.items()},
        ))
    return samples
