"""Hostile but realistic inputs (issue 17): each stops early with a message naming the file, the line and the
reason, or is skipped and counted under its own reason; nothing is published before it is complete.

Every case writes its own small files; none loads a real model (the tiny random target at most).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}


def good(i: int) -> dict:
    return {"id": f"g{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}


def jsonl(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def parquet(path: Path, columns: dict[str, list]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)


def write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        if name.endswith(".parquet"):
            parquet(root / name, data)
        else:
            (root / name).write_bytes(data)
    return root / next(iter(files)) if len(files) == 1 else root


# ---------------------------------------------------------------------------------------------------------------
# prep: unknown keys (Hydra's `+key=value` opens the struct flag)


@pytest.mark.parametrize(("override", "hint"), [
    ("+max_lenght=64", "did you mean 'max_length'"),
    ("+regen.max_turn=2", "did you mean 'regen.max_turns'"),
])
def test_prep_rejects_an_appended_unknown_key(tmp_path: Path, override: str, hint: str) -> None:
    out = tmp_path / "prep"
    r = subprocess.run([sys.executable, str(REPO / "launch" / "prep.py"), override, f"out={out}"],
                       capture_output=True, text=True, env=ENV, timeout=120, cwd=REPO)
    assert r.returncode != 0 and "unknown config key" in r.stderr and hint in r.stderr, r.stderr[-2000:]
    assert not (out / "train").exists()
