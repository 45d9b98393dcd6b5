"""Drafting strategies behind SpeculativeDecoder, and EAGLE's: catch-up on verified tokens, then a chain
or an EAGLE-2 dynamic tree.

A strategy owns the drafter's state across one generation: `start` (after the prefill), `draft` (a
DraftTree rooted at the last emitted token), `commit` (after a verify: the accepted tokens' target
features). `make_strategy` picks EAGLE's (`EagleDrafting`, below) or DFlash's block drafting
(eval/dflash_drafting.py) from the drafter.

Position convention (docs/method.md §4.2/§4.3): drafter position t holds (feature of x_t, embedding of
x_{t+1}) and predicts x_{t+2}. With N tokens committed in the target's KV cache and root = x_N (the
target's last emitted token), the drafter cache holds positions 0..N-1 and its output at N-1 gives the
distribution of x_{N+1}, the depth-1 candidates. A node at depth d >= 1 is fed at drafter position
N - 1 + d with its parent's output vector as `hidden` (features of unverified tokens do not exist).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from eval.sampling import SamplingParams
from eval.tree import DraftTree, chain_tree, select_top_m
from models.eagle3 import next_input


class DraftingStrategy(Protocol):
    """How SpeculativeDecoder drafts; N = tokens in the target's KV cache, root = x_N (not in it yet)."""

    depth: int  # the most draft tokens one step can accept (per-position acceptance has this length)
    cache: object  # the drafter's KV cache (tests compare it with a fresh catch-up)

    def start(self, prompt_ids: list[int], taps: Tensor, root: int) -> None:
        """After the prefill: taps [N, n*H] are the target features of the prompt, root its next token."""
        ...

    def draft(self, root: int, prefix_len: int, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        ...

    def commit(self, taps: Tensor, accepted: list[int], bonus: int, prefix_len: int) -> None:
        """After a verify that kept the root and `accepted` (taps [1 + len(accepted), n*H], positions
        prefix_len..) and emitted `bonus`, the next root."""
        ...

    def describe(self) -> dict:
        """What the report records about how it drafted."""
        ...


def make_strategy(drafter, settings) -> DraftingStrategy:
    """The drafting strategy the family table names for this drafter's family."""
    from models.registry import family_of_drafter

    return family_of_drafter(drafter).drafting_cls(drafter, settings)


def _log_probs(drafter, h: Tensor) -> Tensor:
    """h [..., H] -> drafter log-probs over the draft vocab [..., Vd], float64 (values are summed)."""
    return torch.log_softmax(drafter.compute_logits(h).to(torch.float64), dim=-1)


def catch_up(drafter, cache, taps: Tensor, next_ids: Tensor, start_pos: int) -> Tensor:
    """Append verified positions start_pos.. to the drafter cache; return the last output vector [H].

    taps: [T, n*Ht] target features of the committed tokens x_start..; next_ids: [T] the tokens one
    place later (x_{start+1}..), i.e. the accepted drafts followed by the bonus token.
    """
    t = int(next_ids.numel())
    hidden = drafter.fuse(taps[None])  # [1, T, H]
    pos = torch.arange(start_pos, start_pos + t, device=hidden.device)[None]
    h = drafter.forward_step(hidden, next_ids.to(hidden.device)[None], pos, cache)
    return h[0, -1]


def draft_chain(
    drafter,
    cache,
    root_out: Tensor,
    root_token: int,
    prefix_len: int,
    steps: int,
    sample_params: SamplingParams | None = None,
    generator: torch.Generator | None = None,
    worth: Callable[[float], bool] | None = None,
) -> DraftTree:
    """K = steps tokens, one drafter forward each after the first (which reuses the catch-up output).

    Greedy drafting (sample_params None or greedy) takes the draft argmax: q is a point mass. Sampled
    drafting draws from the drafter's softmax at the target temperature and records q (target vocab),
    which the acceptance rule then divides by. `worth(p)`, given the drafter's probability of the path so
    far, says whether one more drafter forward is worth it (an adaptive budget); None: always.
    """
    sampled = sample_params is not None and not sample_params.greedy
    vocab = int(drafter.t2d.numel())
    tokens: list[int] = []
    values: list[float] = []
    qs: list[Tensor | None] = []
    h, value = root_out, 0.0
    forwards = 0
    for k in range(steps):
        logp = _log_probs(drafter, h)  # [Vd]
        if sampled:
            q_draft = torch.softmax(drafter.compute_logits(h).to(torch.float64) / sample_params.temperature, -1)
            d = int(torch.multinomial(q_draft.cpu(), 1, generator=generator).item())
            q = torch.zeros(vocab, dtype=torch.float64)
            q[drafter.draft_to_target(torch.arange(q_draft.numel(), device=q_draft.device)).cpu()] = q_draft.cpu()
            qs.append(q)
        else:
            d = int(logp.argmax().item())
            qs.append(None)
        x = int(drafter.draft_to_target(torch.tensor([d], device=logp.device)).item())
        value += float(logp[d])
        tokens.append(x)
        values.append(value)
        if k + 1 < steps:
            if worth is not None and not worth(math.exp(value)):
                break
            pos = torch.tensor([[prefix_len + k]], device=h.device)
            h = drafter.forward_step(next_input(drafter, h)[None, None], torch.tensor([[x]], device=h.device), pos,
                                     cache)[0, 0]
            forwards += 1
    tree = chain_tree(root_token, tokens, values, qs)
    tree.draft_forwards = forwards
    return tree


def draft_tree(
    drafter, cache, root_out: Tensor, root_token: int, prefix_len: int, depth: int, topk: int, total_tokens: int,
    worth: Callable[[float], bool] | None = None,
) -> DraftTree:
    """EAGLE-2 dynamic tree (docs/method.md §3) with `depth` levels, at most depth - 1 drafter forwards.

    Per level: the top-k nodes of the current layer by value (sum of log-probs along the root path) are
    run through the drafter together, each attending to the prefix, its expanded ancestors and itself;
    each yields its top-k children. Finally the top-m nodes over ALL levels are kept (select_top_m).
    Levels deeper than m are never drafted: the kept set is a connected tree of m nodes (a child never
    outranks its parent), so no node below depth m could be in it. `worth(p)`, given the summed path
    probability of the nodes about to be expanded (an upper bound on what their children can add), says
    whether that level's forward is worth it (an adaptive budget); None: always.
    """
    depth = min(depth, total_tokens)
    device = root_out.device
    logp = _log_probs(drafter, root_out)  # [Vd]
    k = min(topk, int(logp.numel()))
    top = torch.topk(logp, k)
    # All drafted nodes in creation order (depth-major); parents as creation indices, -1 = root.
    draft_ids = [top.indices.cpu()]
    values = [top.values.cpu()]
    parents = [torch.full((k,), -1, dtype=torch.long)]
    depths = [torch.ones(k, dtype=torch.long)]
    layer_start = 0  # creation index of the current layer's first node
    layer_hidden = root_out[None].expand(k, -1)  # hidden fed with each current-layer node: its parent's output
    # Cache slots of each current-layer node's expanded ancestors (the root's ancestors are the prefix).
    layer_anc: list[list[int]] = [[] for _ in range(k)]
    forwards = 0
    for d in range(1, depth):
        cur_vals = values[-1]
        # A stable sort rather than topk: on ties the earlier node wins, deterministically.
        sel = torch.sort(-cur_vals, stable=True).indices[: min(k, int(cur_vals.numel()))]
        if worth is not None and not worth(float(cur_vals[sel].double().exp().sum())):
            break
        forwards += 1
        n_sel = int(sel.numel())
        sel_draft = draft_ids[-1][sel]
        ids = drafter.draft_to_target(sel_draft.to(device))
        base = cache.length
        allowed = torch.zeros(n_sel, base + n_sel, dtype=torch.bool)
        allowed[:, :prefix_len] = True
        for i, s in enumerate(sel.tolist()):
            allowed[i, layer_anc[s]] = True
            allowed[i, base + i] = True
        pos = torch.full((1, n_sel), prefix_len - 1 + d, dtype=torch.long, device=device)
        out = drafter.forward_step(next_input(drafter, layer_hidden[sel])[None], ids[None], pos, cache,
                                   attn_mask=allowed[None, None].to(device))
        child_logp = _log_probs(drafter, out[0])  # [n_sel, Vd]
        ctop = torch.topk(child_logp, k, dim=-1)
        draft_ids.append(ctop.indices.reshape(-1).cpu())
        values.append((cur_vals[sel][:, None] + ctop.values.cpu()).reshape(-1))
        parents.append((layer_start + sel).repeat_interleave(k))
        depths.append(torch.full((n_sel * k,), d + 1, dtype=torch.long))
        layer_start += int(cur_vals.numel())
        layer_hidden = out[0].repeat_interleave(k, dim=0)
        layer_anc = [layer_anc[s] + [base + i] for i, s in enumerate(sel.tolist()) for _ in range(k)]
    all_draft = torch.cat(draft_ids)
    tokens = drafter.draft_to_target(all_draft.to(device)).cpu()
    tree = select_top_m(torch.cat(values), torch.cat(parents), torch.cat(depths), tokens, root_token, total_tokens)
    tree.draft_forwards = forwards
    return tree


class EagleDrafting:
    """EAGLE-3's drafting (SpecSettings.mode chain | tree), its DecodeCache and last output vector."""

    def __init__(self, drafter, settings) -> None:
        self.drafter, self.settings = drafter, settings
        self.depth = settings.depth
        self.cache = None
        self.root_out: Tensor | None = None
        self.worth: Callable[[float], bool] | None = None  # set by an adaptive budget (eval/budget.py)

    def _taps(self, taps: Tensor) -> Tensor:
        w = self.drafter.fc.weight
        return taps.to(device=w.device, dtype=w.dtype)

    def start(self, prompt_ids: list[int], taps: Tensor, root: int) -> None:
        from models.attention import DecodeCache

        self.cache = DecodeCache()
        next_ids = torch.tensor([*prompt_ids[1:], root], device=taps.device)
        self.root_out = catch_up(self.drafter, self.cache, self._taps(taps), next_ids, 0)

    def draft(self, root: int, prefix_len: int, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        s = self.settings
        if s.mode == "chain":
            return draft_chain(
                self.drafter, self.cache, self.root_out, root, prefix_len, s.depth,
                params if s.sample_drafts else None, generator, self.worth,
            )
        return draft_tree(self.drafter, self.cache, self.root_out, root, prefix_len, s.depth, s.topk, s.total_tokens,
                          self.worth)

    def commit(self, taps: Tensor, accepted: list[int], bonus: int, prefix_len: int) -> None:
        self.cache.truncate(prefix_len)  # drop the drafted nodes: their features were the drafter's own
        next_ids = torch.tensor([*accepted, bonus], device=taps.device)
        self.root_out = catch_up(self.drafter, self.cache, self._taps(taps), next_ids, prefix_len)

    def describe(self) -> dict:
        from models.registry import family_of_drafter

        s = self.settings
        out = {"method": family_of_drafter(self.drafter).method, "mode": s.mode, "depth": s.depth}
        if s.mode == "tree":
            out.update(topk=s.topk, total_tokens=s.total_tokens)
        return out
