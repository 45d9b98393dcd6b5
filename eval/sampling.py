"""Token selection shared by plain and speculative decoding, and the lossless acceptance rules.

Both decoders turn target logits into a distribution with the SAME `target_probs` (temperature, then
top-k, then top-p, as HF's warpers do), so "speculative output is distributed like plain output" is a
statement about the acceptance rule alone (docs/method.md §1). Probabilities are float64: acceptance ratios
and residuals of nearly equal distributions lose too much in float32.

Rules (p = target distribution at a tree node, q = the distribution the candidate x was drawn from):
- accept x with probability min(1, p(x) / q(x));
- after a rejection the next candidate / the bonus token is drawn from norm(max(0, p - q)).
Deterministic drafting (top-1 chain, top-k tree) makes q a point mass on x: accept with probability
p(x), residual = p with p(x) set to 0. Trying several candidates one after another keeps the output
exactly p (each rejection conditions on "not x").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax of the raw logits; top_p / top_k ignored)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def warp_logits(logits: Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Temperature, then top-k, then top-p (HF's order and tie conventions); filtered entries are -inf.

    logits: [..., V]. temperature must be > 0 (greedy never warps). Returns float64 logits.
    """
    if temperature <= 0:
        raise ValueError("warp_logits needs temperature > 0; greedy decoding takes the argmax of raw logits")
    out = logits.to(torch.float64) / temperature
    vocab = out.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(out, dim=-1, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - top_p)
        remove_sorted[..., -1:] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        out = out.masked_fill(remove, float("-inf"))
    return out


def target_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The distribution plain decoding samples from: one-hot at the argmax when greedy. float64 [..., V]."""
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).to(torch.float64)
    return warp_logits(logits, params.temperature, params.top_p, params.top_k).softmax(dim=-1)


def sample(probs: Tensor, generator: torch.Generator | None) -> int:
    """One draw from a 1-D distribution (on the CPU: generators are CPU generators, whatever the device)."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def next_token(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Plain decoding's choice from 1-D logits; the speculative bonus token at a leaf uses the same."""
    if params.greedy:
        return int(logits.argmax().item())
    return sample(target_probs(logits, params), generator)


# --- acceptance -----------------------------------------------------------------------------------


def acceptance_probability(p: Tensor, q: Tensor | None, x: int) -> float:
    """min(1, p(x) / q(x)); q None = point mass on x (deterministic drafting)."""
    if q is None:
        return float(p[x].clamp(max=1.0))
    qx = float(q[x])
    if qx <= 0.0:
        # x was drawn from q, so q(x) > 0 unless q and the drafter disagree; refuse rather than divide.
        raise ValueError(f"candidate {x} has q(x) = 0: it cannot have been drawn from q")
    return min(1.0, float(p[x]) / qx)


def residual_distribution(p: Tensor, q: Tensor | None, x: int) -> Tensor:
    """norm(max(0, p - q)) after rejecting x; q None = point mass on x, i.e. p with p(x) = 0."""
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = (p - q).clamp(min=0.0)
    total = r.sum()
    if total <= 0:
        # Only reachable through rounding (a rejection has probability 0 when the residual is empty);
        # keep p so the caller still samples a valid token.
        return p
    return r / total


@dataclass
class NodeVerdict:
    accepted_child: int | None  # index into `candidates` of the accepted one, None if all rejected
    residual: Tensor | None  # distribution for the bonus token when all were rejected (sampling only)


def verify_candidates(
    p: Tensor,
    candidates: list[int],
    qs: list[Tensor | None],
    generator: torch.Generator | None,
) -> NodeVerdict:
    """Lossless multi-candidate rejection sampling at one node (sampling mode, p float64 [V]).

    Tries the candidates in the given order; the order must not depend on the random draws.
    """
    for i, (x, q) in enumerate(zip(candidates, qs)):
        u = float(torch.rand((), dtype=torch.float64, generator=generator))
        if u < acceptance_probability(p, q, x):
            return NodeVerdict(accepted_child=i, residual=None)
        p = residual_distribution(p, q, x)
    return NodeVerdict(accepted_child=None, residual=p)
