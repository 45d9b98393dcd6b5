"""Draft trees as flat tensors: top-m selection, ancestor masks, position ids (docs/method.md §3).

Block layout, shared by the drafter's tree steps and the target's verify forward: index 0 is the root
(the last token the target emitted, not yet in its KV cache), indices 1..m the drafted nodes with
every parent before its children. `parents[i]` is a block index (-1 for the root), `depths[i]` the
distance from the root, so a node's position id is prefix_len + depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DraftTree:
    tokens: Tensor  # int64 [n] target ids, block order; tokens[0] = root
    parents: Tensor  # int64 [n], parents[0] = -1
    depths: Tensor  # int64 [n], depths[0] = 0
    values: Tensor  # float64 [n] path log-prob under the drafter (0 for the root)
    # Distribution each node was drawn from (target vocab), only when drafts are sampled; None = point
    # mass (deterministic top-k drafting).
    q: list[Tensor | None] | None = None
    draft_forwards: int = 0  # drafter forwards spent building it after the root's (the cost model's count)

    def __len__(self) -> int:
        return int(self.tokens.numel())

    def children(self) -> list[list[int]]:
        """Children of every block index, in block order (for one parent: decreasing drafter value)."""
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, par in enumerate(self.parents.tolist()):
            if par >= 0:
                kids[par].append(i)
        return kids

    def position_ids(self, prefix_len: int) -> Tensor:
        return self.depths + prefix_len


def select_top_m(
    values: Tensor, parents: Tensor, depths: Tensor, tokens: Tensor, root_token: int, m: int
) -> DraftTree:
    """Keep the m best drafted nodes by value and flatten them into a block.

    Inputs describe ALL drafted nodes in creation order (depth-major, so every parent precedes its
    children); `parents` are creation indices, -1 for children of the root. Ties go to the earlier
    (shallower) node: a stable sort on -value. Because a child's value <= its parent's and the parent
    was created first, the parent always ranks before the child, so the kept set is a connected tree.
    """
    n = int(values.numel())
    m = min(m, n)
    order = torch.sort(-values, stable=True).indices[:m]
    keep = torch.sort(order).values  # back to creation order: parents before children
    new_index = torch.full((n,), -1, dtype=torch.long)
    new_index[keep] = torch.arange(1, m + 1)  # block index; 0 is the root
    old_par = parents[keep]
    block_par = torch.where(old_par >= 0, new_index[old_par.clamp(min=0)], torch.zeros_like(old_par))
    if bool((block_par < 0).any()):
        raise AssertionError("top-m selection is not a connected tree (a parent ranked below its child)")
    return DraftTree(
        tokens=torch.cat([torch.tensor([root_token]), tokens[keep]]),
        parents=torch.cat([torch.tensor([-1]), block_par]),
        depths=torch.cat([torch.tensor([0]), depths[keep]]),
        values=torch.cat([torch.zeros(1, dtype=torch.float64), values[keep].to(torch.float64)]),
    )


def keep_best(tree: DraftTree, m: int) -> DraftTree:
    """The tree cut to its m best drafted nodes by value (ties: the earlier node), still connected: a
    child's value never exceeds its parent's. m >= len(tree) - 1 returns `tree` itself; m = 0 the root alone."""
    n = len(tree) - 1
    if m >= n:
        return tree
    order = torch.sort(-tree.values[1:], stable=True).indices[:m] + 1
    keep = torch.cat([torch.zeros(1, dtype=torch.long), torch.sort(order).values])  # block order, root first
    new_index = torch.full((n + 1,), -1, dtype=torch.long)
    new_index[keep] = torch.arange(m + 1)
    parents = tree.parents[keep]
    block_par = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
    if bool((block_par[1:] < 0).any()):
        raise AssertionError("best-m cut is not a connected tree (a parent ranked below its child)")
    q = None if tree.q is None else [tree.q[i] for i in keep.tolist()]
    return DraftTree(tree.tokens[keep], block_par, tree.depths[keep], tree.values[keep], q, tree.draft_forwards)


def chain_tree(root_token: int, tokens: list[int], values: list[float], qs: list[Tensor | None]) -> DraftTree:
    """A chain is the tree in which node i's parent is node i - 1."""
    k = len(tokens)
    return DraftTree(
        tokens=torch.tensor([root_token, *tokens], dtype=torch.long),
        parents=torch.arange(-1, k, dtype=torch.long),
        depths=torch.arange(0, k + 1, dtype=torch.long),
        values=torch.tensor([0.0, *values], dtype=torch.float64),
        q=[None, *qs],
    )


def ancestor_matrix(parents: Tensor) -> Tensor:
    """bool [n, n]: row i is True at i and at every ancestor of i (parents precede children)."""
    n = int(parents.numel())
    anc = torch.eye(n, dtype=torch.bool)
    for i, par in enumerate(parents.tolist()):
        if par >= 0:
            anc[i] |= anc[par]
    return anc


def tree_attention_allowed(parents: Tensor, prefix_len: int) -> Tensor:
    """bool [n, prefix_len + n]: every node sees the committed prefix and its own ancestors (and itself)."""
    n = int(parents.numel())
    return torch.cat([torch.ones(n, prefix_len, dtype=torch.bool), ancestor_matrix(parents)], dim=1)


def additive_mask(allowed: Tensor, dtype: torch.dtype, device: torch.device | str | None = None) -> Tensor:
    """[Tq, Tk] bool -> [1, 1, Tq, Tk] additive float mask (0 / dtype min).

    transformers 5 passes a ready 4D mask through untouched (masking_utils._preprocess_mask_arguments);
    an additive float mask is what both its eager kernel (scores + mask) and SDPA accept.
    """
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed.to(device), torch.finfo(dtype).min)
    return mask[None, None]
