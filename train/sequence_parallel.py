"""Sequence parallelism (DeepSpeed Ulysses) for TTT: each sample's sequence split over a group of ranks.

Why: the TTT unroll of a 40K-token sample keeps K steps of keys/values and activations, linear in T but
large; P ranks holding a slice each divide that by P (and the attention's work too).

Groups: the world is cut into groups of P = deepspeed.sequence_parallel_size CONSECUTIVE ranks (on one
node where possible: the all-to-alls are the traffic). The ranks of a group hold the same samples (data
parallelism runs over the groups: data-parallel rank = rank // P), and rank r = rank % P of a group owns
positions [r*L, (r+1)*L) of each, L = ceil(T / P) (the batch is padded to P*L; padding is never valid).

The model (torchtitan-style, parallelism applied from outside, `SequenceParallel.apply`): the drafter's
attention core (models.attention.ttt_core, its `attn_core` attribute) is wrapped in DeepSpeed Ulysses'
all-to-all (train/engine.ulysses_attention): a step's q/k/v go from sequence-sharded (all heads) to
head-sharded (whole sequence), so the TTT attention and its TTTCache (step-0 keys for the causal prefix,
the diagonal keys of later steps) see every position of H/P heads; the output goes back. RoPE is applied
before, at global positions (train/ttt.unroll passes start + t + k).

The loss on a slice (train/batch.py, `owned_span`): step k at local position t reads token x_{t0+t+k+1}
and predicts row j = t0 + t + k + 1, whose teacher sits at j and whose mask (valid, loss_mask) at j + 1,
so a rank needs K + 1 columns past its slice: `split_batch` gives it that halo (ids, masks, teacher; no
taps, only owned positions are drafter inputs). A (k, j) pair belongs to the rank owning t = j - k - 1,
so the per-rank counts and loss sums add up to the unsplit batch's, and the trainer's all-reduced
counts stay the global normaliser. Gradients: the all-to-all's backward brings each rank's loss gradient
to the ranks that computed the positions; DeepSpeed, unaware of the groups, averages over all ranks, and
the trainer's loss * world turns that into the sum over ranks, i.e. the gradient of the full loss.

Checked on CPU/gloo against the unsplit loss and gradients (tests/test_long_sequence_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import Tensor, nn

from models.attention import AttnCore
from train.batch import PAD_ID, Batch, owned_span

if TYPE_CHECKING:
    from train.config import RunConfig


@dataclass
class SeqSlice(Batch):
    """One rank's slice of a Batch. Columns are the global positions start .. start + owned + halo - 1:
    the first `owned` are this rank's (their TTT steps run here), the rest the halo (ids, masks, teacher
    only: `taps` covers the owned columns only)."""

    start: int = 0
    owned: int = 0


def _columns(x: Tensor, a: int, b: int, fill: int) -> Tensor:
    """Columns a..b-1 of a [B, T, ...] tensor; `fill` past T."""
    out = x.new_full((x.shape[0], b - a, *x.shape[2:]), fill)
    n = max(0, min(b, x.shape[1]) - a)
    out[:, :n] = x[:, a : a + n]
    return out


def split_batch(batch: Batch, rank: int, size: int, halo: int) -> SeqSlice:
    """Rank `rank`'s slice of `batch` split over `size` ranks, with `halo` (>= K + 1) columns past it."""
    if isinstance(batch, SeqSlice):
        raise ValueError("split_batch takes a whole batch, got a slice")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a group of {size}")
    owned = -(-batch.input_ids.shape[1] // size)
    start = rank * owned

    def take(name: str, x: Any) -> Any:
        if not isinstance(x, Tensor) or x.dim() < 2:
            return x
        end = start + owned + (0 if name == "taps" else halo)
        return _columns(x, start, end, PAD_ID if name == "input_ids" else 0)

    parts = {f.name: take(f.name, getattr(batch, f.name)) for f in fields(batch)}
    return SeqSlice(**parts, start=start, owned=owned)


def owned_tokens(batch: Batch) -> Tensor:
    """Real tokens among the positions `batch` owns (a slice's halo belongs to its neighbour's count)."""
    return batch.valid[:, : owned_span(batch)[1]].sum()


class UlyssesCore:
    """An `attn_core` (the signature of models.attention.ttt_core) for a rank that holds a slice of the
    sequence: all-to-all to the whole sequence for this rank's heads, the wrapped core, and back."""

    def __init__(self, inner: AttnCore, group: dist.ProcessGroup) -> None:
        from train.engine import ulysses_attention

        self.inner = inner
        self.attend = ulysses_attention(self._local, group)

    def _local(self, q: Tensor, k: Tensor, v: Tensor, *, cache: Any, scale: float, backend: str,
               options: dict[str, Any]) -> Tensor:
        # (B, T, H/P, D) here, the core's layout is (B, H, T, D)
        out = self.inner(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache, scale, backend, **options)
        return out.transpose(1, 2)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cache: Any, scale: float, backend: str = "auto",
                 **options: Any) -> Tensor:
        # (B, H, T/P, D) in and out; Ulysses' layout is (B, T/P, H, D)
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), cache=cache, scale=scale,
                          backend=backend, options=options)
        return out.transpose(1, 2)


def apply_ulysses(model: nn.Module, group: dist.ProcessGroup | None, size: int) -> nn.Module:
    """Wrap every replaceable attention core of `model` (in place); checks the head counts first."""
    attentions = [m for m in model.modules() if hasattr(m, "attn_core")]
    if not attentions:
        raise ValueError(f"{type(model).__name__} has no replaceable attention core (attn_core): sequence "
                         "parallelism supports the EAGLE-3 drafter")
    for m in attentions:
        for key, heads in (("num_attention_heads", m.n_heads), ("num_key_value_heads", m.n_kv)):
            if heads % size:
                raise ValueError(f"deepspeed.sequence_parallel_size={size} must divide the drafter's {key} "
                                 f"({heads}): Ulysses gives each rank whole heads")
    for m in attentions:
        if isinstance(m.attn_core, UlyssesCore):
            raise ValueError("sequence parallelism is already applied to this model")
        m.attn_core = UlyssesCore(m.attn_core, group)
    return model


@dataclass
class SequenceParallel:
    """This rank's place in the sequence-parallel layout; size 1 = off (every method is then a no-op)."""

    size: int = 1
    rank: int = 0  # rank inside the group
    group: dist.ProcessGroup | None = None
    halo: int = 1  # columns past the slice: the largest TTT K (train or eval) + 1

    @classmethod
    def create(cls, size: int, max_steps: int) -> SequenceParallel:
        """COLLECTIVE (every rank creates every group, in the same order). `max_steps`: the largest K unrolled
        (training or held-out eval)."""
        if size < 1:
            raise ValueError(f"deepspeed.sequence_parallel_size must be >= 1, got {size}")
        if size == 1:
            return cls(halo=max_steps + 1)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % size:
            raise ValueError(f"deepspeed.sequence_parallel_size={size} must divide the world size {world}")
        mine = None
        for first in range(0, world, size):
            ranks = list(range(first, first + size))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return cls(size, rank % size, mine, max_steps + 1)

    @classmethod
    def from_config(cls, cfg: RunConfig) -> SequenceParallel:
        """From a RunConfig (COLLECTIVE, see `create`)."""
        t = cfg.train
        return cls.create(cfg.deepspeed.sequence_parallel_size, max(t.ttt_steps, t.eval_ttt_steps or t.ttt_steps))

    def data_parallel(self, rank: int, world: int) -> tuple[int, int]:
        """(data-parallel rank, data-parallel world size) of global `rank` in a `world`-rank job: what the
        data loader shards over (the ranks of a group read the same samples)."""
        return rank // self.size, world // self.size

    def shard(self, batch: Batch) -> Batch:
        """This rank's slice of a batch its whole group holds (the batch itself when off)."""
        return batch if self.size == 1 else split_batch(batch, self.rank, self.size, self.halo)

    def apply(self, model: nn.Module) -> nn.Module:
        """Parallelise `model`'s attention over the group, in place (before the DeepSpeed engine wraps it)."""
        return model if self.size == 1 else apply_ulysses(model, self.group, self.size)

