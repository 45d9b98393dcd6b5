"""Strict JSON for every file and line the project writes: reports, summaries, manifests, metrics lines, state.

`dumps` is json.dumps of `json_safe(obj)` with allow_nan=False, so no NaN or Infinity ever reaches a file: a
non-finite float is written as null, meaning "not defined for this run" (docs/evaluation.md, Metrics).
`write_json` writes such a file atomically (a temporary file in the same directory, renamed into place).
Every json.dump(s) in infra/, data_prep/, train/, eval/, launch/ and bench/ goes through here
(tests/test_strict_json.py); models/ writes finite geometry only.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

_NATIVE = (str, int, float, bool, type(None))


def json_safe(x: Any, default: Callable[[Any], Any] | None = None) -> Any:
    """`x` as strict JSON takes it: non-finite floats as null, keys as str, tuples as lists; any other object
    through `default` (as json.dumps' `default`), whose result is made safe in turn."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v, default) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v, default) for v in x]
    if default is not None and not isinstance(x, _NATIVE):
        return json_safe(default(x), default)
    return x


def dumps(obj: Any, *, default: Callable[[Any], Any] | None = None, **kwargs: Any) -> str:
    """json.dumps(obj, **kwargs) with every non-finite float as null; raises rather than write NaN/Infinity."""
    return json.dumps(json_safe(obj, default), allow_nan=False, **kwargs)


def write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 1, newline: bool = False,
               default: Callable[[Any], Any] | None = None, **kwargs: Any) -> Path:
    """Write `dumps(obj)` to `path` atomically: a reader sees the old file or the new one, never a torn one."""
    path = Path(path)
    text = dumps(obj, indent=indent, default=default, **kwargs) + ("\n" if newline else "")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
