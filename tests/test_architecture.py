"""The package layering: what each of our packages may import of the others (every import, lazy ones too).

    models     -> nothing of ours but models (no distributed, pipeline, config or logging code either)
    data_prep  -> models
    eval       -> models, data_prep
    train      -> models, data_prep
    launch     -> anything (the entry points)

The family table (models/registry.py) names objectives and drafting strategies as "module:attribute"
strings imported on demand, which is what lets models/ stay at the bottom.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("models", "data_prep", "train", "eval", "launch")
BANNED = {
    "models": ("data_prep", "train", "eval", "launch", "torch.distributed", "deepspeed", "wandb", "hydra"),
    "data_prep": ("train", "eval", "launch"),
    "eval": ("train", "launch"),
    "train": ("eval", "launch"),
}


def imported_modules(path: Path) -> list[str]:
    """Every absolute module name `path` imports, at the top or inside a function."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("package", sorted(BANNED))
def test_no_package_imports_above_its_layer(package: str) -> None:
    files = sorted((ROOT / package).glob("*.py"))
    assert len(files) >= 6
    for f in files:
        for name in imported_modules(f):
            assert not any(name == b or name.startswith(b + ".") for b in BANNED[package]), \
                f"{package}/{f.name} imports {name}"


def test_no_relative_imports() -> None:
    """Absolute imports only, so the rule above sees every edge."""
    for package in OURS:
        for f in sorted((ROOT / package).glob("*.py")):
            relative = [n for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ImportFrom) and n.level]
            assert not relative, f"{package}/{f.name} has a relative import"
