"""Drafter classes by config.json architectures[0] (SpecForge's registry idea: a new architecture is a new file
plus an entry here)."""

from __future__ import annotations

from torch import nn

from models.config import ARCHITECTURE_ALIASES
from models.eagle3 import Eagle3Drafter

DRAFTERS: dict[str, type[nn.Module]] = {name: Eagle3Drafter for name in ARCHITECTURE_ALIASES}
