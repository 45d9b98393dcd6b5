"""Values as strict JSON takes them, for the reports train (offline_report.json) and eval (report.json) write.

In data_prep, the data-file layer, because both train and eval may import it (tests/test_architecture.py).
"""

from __future__ import annotations

import math
from typing import Any


def json_safe(x: Any) -> Any:
    """`x` as strict JSON takes it: non-finite floats as null (NaN marks a step without targets), keys as str."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
