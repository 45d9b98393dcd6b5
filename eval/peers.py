"""Peer baseline: transformers' own assisted decoding with prompt lookup (n-gram drafts from the prompt).

Timed through `model.generate`, so it is compared against `model.generate` without assistance as well:
HF's generate loop has its own per-token overhead, which the speedup over our plain loop would mix in.
"""

from __future__ import annotations

import time

import torch

from eval.sampling import SamplingParams


@torch.no_grad()
def hf_generate(
    model,
    prompt_ids: list[int],
    max_new_tokens: int,
    params: SamplingParams,
    eos_token_ids: tuple[int, ...],
    prompt_lookup_num_tokens: int | None = None,
    seed: int = 0,
) -> tuple[list[int], float]:
    """Returns (new token ids, seconds)."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], device=device)
    kwargs: dict = dict(
        max_new_tokens=max_new_tokens,
        do_sample=not params.greedy,
        eos_token_id=list(eos_token_ids) or None,
        pad_token_id=(eos_token_ids[0] if eos_token_ids else 0),
        attention_mask=torch.ones_like(ids),
    )
    if not params.greedy:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    elapsed = time.perf_counter() - t0
    return out[0, len(prompt_ids):].tolist(), elapsed
