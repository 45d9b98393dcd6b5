"""On-policy rollouts (Draft-OPD, docs/method.md): the current drafter drafts, the target verifies, and the record
of which proposals the target kept says which (anchor, TTT step) pairs inference visited and where it rejected.

A rollout is lossless speculative decoding with chain drafting: every token of the continuation is the target's
(greedy: its argmax; sampled: the lossless rule), so the sequence stays on the target's distribution whatever the
drafter proposes. Two ways to one record:
- sampled (T > 0): real speculative decoding in the rank (`rollout`, with the family's `rollout` function,
  models/registry.py; eval/spec_decode.py chain_rollout for EAGLE-3): which tokens come out depends on the drafts.
- greedy (T = 0): the continuation is the target's greedy decoding whatever the drafts, so whichever engine holds
  the target generates it plainly (in the rank, partitioned or split, or on a vLLM server), and `greedy_accepts`
  replays the chains along it from the drafter's teacher-forced drafts (the family's `greedy_drafts`): a chain's
  drafts up to its first miss are the sequence's own tokens, so the record is the one chain decoding makes
  (tests/test_rollout.py compares the two).

Alignment with the TTT unroll (train/ttt.py): a cycle whose drafter has the target's features up to position t (its
anchor; the bonus token x_{t+1} is its input) drafts x_{t+2}, x_{t+3}, ... at TTT steps 0, 1, ... from position t.
With j of its `depth` drafts accepted, inference visited steps 0..j there on the target's own tokens (step j drafted
the rejected token when j < depth), and the next cycle's anchor is t + j + 1. The first anchor is the prompt's last
position: the prefill's token is the target's, never drafted. So the TTT loss restricted to the visited pairs
(`draft_steps`, train/batch.py Batch.draft_steps) replays exactly the drafting inference did, with the current
drafter, against the target's distribution at each of those states, the rejected proposals' states included.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rollout:
    prompt_len: int
    tokens: list[int]  # the prompt, then the target-verified continuation
    accept_lengths: list[int]  # drafts the target accepted, per verify cycle
    depth: int  # drafts proposed per cycle (chain drafting)

    def __post_init__(self) -> None:
        if not 0 < self.prompt_len <= len(self.tokens):
            raise ValueError(f"a rollout needs a non-empty prompt within its tokens, got {self.prompt_len} of "
                             f"{len(self.tokens)}")
        if any(not 0 <= j <= self.depth for j in self.accept_lengths):
            raise ValueError(f"accepted lengths {self.accept_lengths} outside 0..{self.depth}")

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.prompt_len

    def cycles(self) -> list[tuple[int, int]]:
        """(anchor position t, accepted drafts j) of every verify cycle, in order."""
        t, out = self.prompt_len - 1, []
        for j in self.accept_lengths:
            out.append((t, j))
            t += j + 1
        return out

    def draft_steps(self) -> Tensor:
        """int64 [len(tokens)]: at each cycle's anchor the number of TTT steps inference visited from it,
        min(j + 1, depth); 0 at every other position."""
        out = torch.zeros(len(self.tokens), dtype=torch.int64)
        for t, j in self.cycles():
            if t < len(self.tokens):
                out[t] = min(j + 1, self.depth)
        return out

    def rejected_positions(self) -> list[int]:
        """Token positions whose draft the target rejected (its own token stands there): t + j + 2 of each cycle that
        accepted j < depth drafts, where the continuation reaches."""
        return [t + j + 2 for t, j in self.cycles() if j < self.depth and t + j + 2 < len(self.tokens)]

    def loss_mask(self) -> Tensor:
        """bool [len(tokens)]: the continuation (what the target wrote in this rollout)."""
        mask = torch.zeros(len(self.tokens), dtype=torch.bool)
        mask[self.prompt_len:] = True
        return mask


def rollout(generate: Callable[[list[int], int], Any], prompt_ids: list[int], max_new_tokens: int,
            depth: int) -> Rollout:
    """One target-assisted rollout of `prompt_ids`: `generate(prompt_ids, max_new_tokens)` decodes it speculatively
    with chains of `depth` drafts and no budget (the family's rollout function, eval/spec_decode.py chain_rollout),
    and its record (output_ids, accept_lengths) gives the cycles."""
    rec = generate(list(prompt_ids), max_new_tokens)
    return Rollout(len(prompt_ids), [*prompt_ids, *rec.output_ids], list(rec.accept_lengths), depth)


def greedy_accepts(tokens: list[int], prompt_len: int, drafts: Tensor, depth: int) -> list[int]:
    """The accepted lengths of chain decoding at T=0 along `tokens` (the prompt, then the target's greedy
    continuation): `drafts[k, t]` is the drafter's greedy draft at step k from anchor t, teacher-forced along
    `tokens` (train/ttt.py greedy_drafts). A cycle anchored at t accepts drafts while they equal tokens t+2, t+3, ...
    (at most `depth`); the next is anchored at t + j + 1. Cycles run while the continuation goes on past the bonus
    token (t + 2 < len); the last one counts only the drafts the continuation reaches."""
    got = drafts[:depth].tolist()
    out, t, n = [], prompt_len - 1, len(tokens)
    while t + 2 < n:
        j = 0
        while j < depth and t + 2 + j < n and got[j][t] == tokens[t + 2 + j]:
            j += 1
        out.append(j)
        t += j + 1
    return out
