"""A SLURM job step seen from a test: the processes it holds, and a signal delivered to all of them at once."""

from __future__ import annotations

import os
from pathlib import Path


def process_tree(pid: int) -> list[int]:
    """`pid` and every process descended from it (the processes a SLURM job step holds)."""
    children: dict[int, list[int]] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(proc.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def signal_step(pid: int, sig: int) -> list[int]:
    """SLURM's way: `sig` to every process of the step at once (the job, its guards, servers and their engines)."""
    pids = process_tree(pid)
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return pids
