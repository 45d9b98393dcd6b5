"""The package layering: what each of our packages may import of the others (every import, lazy ones too).

    infra      -> nothing of ours: the floor (strict JSON, directory locks, preemption, config keys)
    serving    -> infra: the engine floor (vLLM's server, the one client, the connector's files)
    models     -> infra, models (no distributed, pipeline, config or logging code either)
    data_prep  -> infra, serving, models
    eval       -> infra, serving, models, data_prep
    train      -> infra, serving, models, data_prep
    launch     -> anything (the entry points)

The family table (models/registry.py) names objectives and drafting strategies as "module:attribute"
strings imported on demand, which is what lets models/ stay at the bottom.

Within and across packages, no module imports itself through others (no import cycle). An import inside a
function counts as an edge too: a lazy import hides a cycle from the interpreter, not from the reader, and
it breaks the moment someone hoists it to the top.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("infra", "serving", "models", "data_prep", "train", "eval", "launch")
BANNED = {
    "infra": ("serving", "models", "data_prep", "train", "eval", "launch", "bench"),
    "serving": ("models", "data_prep", "train", "eval", "launch", "bench"),
    "models": ("serving", "data_prep", "train", "eval", "launch", "torch.distributed", "deepspeed", "wandb", "hydra"),
    "data_prep": ("train", "eval", "launch"),
    "eval": ("train", "launch"),
    "train": ("eval", "launch"),
}


def imported_modules(path: Path) -> list[str]:
    """Every absolute module name `path` imports, at the top or inside a function (`from pkg import mod`
    names both pkg and pkg.mod)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (anywhere in the file), over every package in OURS."""
    files = {f"{p}.{f.stem}": f for p in OURS for f in sorted((root / p).glob("*.py"))}
    return {mod: {n for n in imported_modules(f) if n in files and n != mod} for mod, f in files.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one cycle through it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(_cycle_through(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _cycle_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One closed path a -> ... -> a inside a strongly connected component (to name in the failure)."""
    start = min(component)
    path, seen = [start], {start}
    while True:
        nxt = sorted(graph[path[-1]] & component)
        back = [n for n in nxt if n == start]
        if back and len(path) > 1:
            return [*path, start]
        fresh = [n for n in nxt if n not in seen]
        if not fresh:  # revisit: close at the first repeated module
            n = nxt[0]
            return [*path[path.index(n):], n]
        path.append(fresh[0])
        seen.add(fresh[0])


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


def test_no_import_cycles() -> None:
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle(tmp_path: Path) -> None:
    """The check itself: a lazy import closing a three-module loop is found and named."""
    for package in OURS:
        (tmp_path / package).mkdir()
    (tmp_path / "models" / "a.py").write_text("from models.b import x\n")
    (tmp_path / "models" / "b.py").write_text("from models import c\n")
    (tmp_path / "models" / "c.py").write_text("def f():\n    import models.a\n")
    (tmp_path / "train" / "d.py").write_text("from models.a import y\n")
    assert import_cycles(import_graph(tmp_path)) == [["models.a", "models.b", "models.c", "models.a"]]


def test_test_modules_import_helpers_only_from_helper_modules() -> None:
    """A test module takes what it shares from a helper module (tests/README.md), never from another test_*."""
    tests = ROOT / "tests"
    for f in sorted(tests.glob("*.py")):
        borrowed = [n for n in imported_modules(f) if n.split(".")[0].startswith("test_")]
        assert not borrowed, f"tests/{f.name} imports {borrowed[0]}: move it to a helper module"
