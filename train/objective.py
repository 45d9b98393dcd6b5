"""What the train loop needs from a drafter family: one small interface, one implementation per method.

The loop (train/trainer.py) knows nothing about a drafter's internals. Per micro-batch it calls
`count` (this rank's number of loss targets per position, all-reduced by the loop into the global
normaliser), then `loss` (differentiable scalar + additive metric sums), and for held-out data
`eval_sums` (additive, all-reduced) then `summarize` (floats, must contain "sim_tau"). Metric sums are
1-D tensors of length `positions` (TTT step k, or position k inside a DFlash block) keyed "<name>_sum",
plus the denominator "n_valid_k"; the loop reports "<name>_k" = sum / n_valid_k. So a new drafter
(docs/method.md §2, §4, §5) is a new model file + a new objective, never a new train loop.

Which objective a method uses is the family table's (models/registry.py): "eagle3" train/eagle3.py and
"eagle1" train/eagle1.py (both on the TTT unroll of train/ttt.py), "dflash" train/dflash.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor, nn

from train.batch import Batch
from train.config import RunConfig


class Objective(Protocol):
    method: str
    positions: int  # length of the per-position metric vectors
    # Sub-modules of the drafter the loss calls a data-dependent number of times (kept gathered by ZeRO-3).
    keep_gathered: tuple[str, ...]

    def build_drafter(self, prep_dir: Path, tap_layers: list[int], head: nn.Module) -> nn.Module:
        """A freshly initialised drafter (the caller seeds first) with the target's frozen pieces set."""
        ...

    def start_batch(self, epoch: int, index: int) -> None:
        """Called before each micro-batch with its global batch's place in training, so whatever the
        objective draws at random (DFlash's anchors) is a function of it: identical on every rank and
        replayed exactly by a resumed run."""
        ...

    def count(self, module: nn.Module, head: nn.Module, batch: Batch) -> tuple[Tensor, Any]:
        """(int64 [positions] loss-target counts of this batch, state handed to `loss` for this batch)."""
        ...

    def loss(
        self, module: nn.Module, head: nn.Module, batch: Batch, normalizer: Tensor, state: Any
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(scalar loss normalised by the global `normalizer` [positions], additive metric sums)."""
        ...

    def eval_sums(self, module: nn.Module, head: nn.Module, batches: Iterable[Batch]) -> dict[str, Tensor]:
        """Additive held-out counts (CPU tensors); the loop adds them over ranks."""
        ...

    def summarize(self, sums: dict[str, Tensor]) -> dict:
        """Floats from `eval_sums` (at least "sim_tau" and "acc_k")."""
        ...


def make_objective(cfg: RunConfig) -> Objective:
    """The objective of `cfg.model.method` (the family table's), configured from the run config."""
    from models.registry import family

    return family(cfg.model.method).objective_cls.from_config(cfg)
