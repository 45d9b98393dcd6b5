"""DFlash block drafting (docs/method.md §5) as a SpeculativeDecoder strategy (eval/drafting.py).

Position convention: with N tokens committed in the target's KV cache and root = x_N (the target's last
emitted token), the drafter's context cache holds the target features of positions 0..N-1, and ONE
drafter forward over the block [root, MASK x (B-1)] at positions N..N+B-1 yields a distribution for each
of x_{N+1}..x_{N+B-1}. The block is verified as a chain (eval/tree.chain_tree): greedy drafting takes
each position's argmax (q a point mass); at T > 0 each position is drawn from the drafter's softmax at
the target temperature and q is recorded, so eval/sampling's min(1, p/q) rule keeps the output exactly
the target's (each draw depends only on the context, fixed before the verify). After the verify the
target features of the root and the accepted drafts (positions N..) join the context cache; the bonus
token is the next root. decode.depth / topk / total_tokens do not apply (the block size does), nor does
decode.sample_drafts (at T > 0 DFlash always draws; the report's "drafting" entry says what was used).
"""

from __future__ import annotations

import torch
from torch import Tensor

from eval.sampling import SamplingParams
from eval.tree import DraftTree, chain_tree
from infra.config_keys import ConfigError


class DFlashDrafting:
    def __init__(self, drafter, settings) -> None:
        if settings.mode != "chain":
            # a user's choice, found once the drafter's family is known: a config error, not a bug
            raise ConfigError(f"decode.mode={settings.mode}: a DFlash drafter drafts one block per step, verified as "
                              "a chain: use decode.mode=chain")
        self.drafter = drafter
        self.depth = drafter.block_size - 1
        self.cache = None

    def _taps(self, taps: Tensor) -> Tensor:
        w = self.drafter.fc.weight
        return taps.to(device=w.device, dtype=w.dtype)[None]

    def start(self, prompt_ids: list[int], taps: Tensor, root: int) -> None:
        from models.dflash import DFlashCache

        self.cache = DFlashCache()
        self.drafter.extend_context(self.cache, self._taps(taps), 0)

    def block_logits(self, root: int, prefix_len: int) -> Tensor:
        """[B - 1, V] drafter logits of positions prefix_len + 1 .. prefix_len + B - 1."""
        if self.cache is None or self.cache.length != prefix_len:
            raise ValueError("the context cache must hold exactly the committed positions before the root")
        return self.drafter.compute_logits(self.drafter.draft_block(self.cache, root))

    def draft(self, root: int, prefix_len: int, params: SamplingParams, generator: torch.Generator | None) -> DraftTree:
        logits = self.block_logits(root, prefix_len).to(torch.float64)
        logp = torch.log_softmax(logits, dim=-1)
        if params.greedy:
            tokens = logp.argmax(-1).cpu()
            qs: list[Tensor | None] = [None] * len(tokens)
        else:
            q = torch.softmax(logits / params.temperature, dim=-1).cpu()
            tokens = torch.multinomial(q, 1, generator=generator).squeeze(1)
            qs = list(q)
        values = logp.cpu().gather(1, tokens[:, None]).squeeze(1).cumsum(0)  # path log-prob under the drafter
        return chain_tree(root, tokens.tolist(), values.tolist(), qs)

    def commit(self, taps: Tensor, accepted: list[int], bonus: int, prefix_len: int) -> None:
        self.drafter.extend_context(self.cache, self._taps(taps), prefix_len)

    def describe(self) -> dict:
        from models.registry import family_of_drafter

        return {"method": family_of_drafter(self.drafter).method, "mode": "chain", "block_size": self.drafter.block_size,
                "draft_tokens_per_step": self.depth}
