"""Strict JSON everywhere (infra/strict_json.py): a NaN or an infinity reaches every writer family (a metrics
line, a run's and a prep's summary.json, eval's report.json) as null, and no module writes JSON around the helper."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import pytest
import torch

from infra.strict_json import dumps, json_safe, write_json

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_prep", "train", "eval", "launch", "bench")
# models/ may not import data_prep (tests/test_architecture.py) and writes finite geometry only (export config.json,
# the target head's header). serving/plugin.py runs under vLLM's own Python, outside this package, and its
# index lines are the private protocol with data_prep/vllm_capture.py (logprobs may be -inf there).
EXEMPT = {"infra/strict_json.py", "serving/plugin.py"}
NON_FINITE = {"sim_tau_alpha": float("nan"), "alpha_k": [0.5, float("nan")], "up": float("inf"),
              "down": -float("inf"), "fine": 1.5, 3: "int key"}


def strict_loads(text: str):
    def refuse(name: str):
        raise ValueError(f"not strict JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_dumps_writes_null_for_nan_and_infinity_and_stays_json_dumps_otherwise() -> None:
    got = strict_loads(dumps(NON_FINITE))
    assert got == {"sim_tau_alpha": None, "alpha_k": [0.5, None], "up": None, "down": None, "fine": 1.5, "3": "int key"}
    finite = {"b": [1, 2.5, "x", None, True], "a": {"c": (1, 2)}}
    assert dumps(finite, indent=1, sort_keys=True) == json.dumps(finite, indent=1, sort_keys=True)
    with pytest.raises(TypeError):
        dumps({"t": torch.tensor(1.0)})  # as json.dumps: an unknown type needs a `default`
    assert strict_loads(dumps({"t": torch.tensor(float("nan"))}, default=float)) == {"t": None}
    assert json_safe([math.nan, (1, math.inf)]) == [None, [1, None]]


def test_write_json_is_atomic_and_strict(tmp_path: Path) -> None:
    path = write_json(tmp_path / "result.json", NON_FINITE, newline=True)
    assert strict_loads(path.read_text())["sim_tau_alpha"] is None and path.read_text().endswith("}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temporary file left


def test_a_metrics_line_is_strict(tmp_path: Path) -> None:
    from train.config import LoggerConfig
    from train.metrics import METRICS_FILE, MetricsLogger

    logger = MetricsLogger(LoggerConfig(wandb_mode="disabled", progress=False), tmp_path, 0, {}, 4, 0)
    logger.log("eval", 2, {"sim_tau_alpha": float("nan"), "acc_k": torch.tensor([0.25, float("nan")])})
    line = strict_loads((tmp_path / METRICS_FILE).read_text().splitlines()[-1])
    assert line["sim_tau_alpha"] is None and line["acc_k"] == [0.25, None]


def test_run_and_prep_summaries_are_strict(tmp_path: Path) -> None:
    from data_prep.shards import PREP_SUMMARY, write_prep_summary
    from train.trainer import _json

    run = strict_loads(_json({"finished": True, "held_out": {"sim_tau_alpha": torch.tensor(float("nan"))}}))
    assert run == {"finished": True, "held_out": {"sim_tau_alpha": None}}
    write_prep_summary(tmp_path, {"samples": 3, "mean_len": float("nan")})
    assert strict_loads((tmp_path / PREP_SUMMARY).read_text()) == {"samples": 3, "mean_len": None}


def test_an_eval_report_is_strict(tmp_path: Path) -> None:
    from eval.run import write_report

    path = write_report({"tau_pooled": float("nan"), "speedup": float("inf"), "per_position_acceptance": [1.0, None]},
                        tmp_path, plots=False)
    assert strict_loads(path.read_text()) == {"tau_pooled": None, "speedup": None, "per_position_acceptance": [1.0, None]}


def _direct_json_writes(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr in ("dump", "dumps") and isinstance(node.value, ast.Name)
                and node.value.id == "json"):
            found.append(f"json.{node.attr} (line {node.lineno})")
        elif isinstance(node, ast.ImportFrom) and node.module == "json":
            found += [f"from json import {a.name} (line {node.lineno})" for a in node.names if a.name in ("dump", "dumps")]
    return found


def test_no_module_writes_json_around_the_helper() -> None:
    files = [f for p in PACKAGES for f in sorted((ROOT / p).rglob("*.py"))]
    assert len(files) > 60
    offenders = {str(f.relative_to(ROOT)): hits for f in files
                 if str(f.relative_to(ROOT)) not in EXEMPT and (hits := _direct_json_writes(f))}
    assert not offenders, f"write JSON through infra.strict_json (dumps / write_json): {offenders}"


def test_the_check_finds_a_direct_write(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import json\nfrom json import dumps as d\n\ndef w(p, x):\n    p.write_text(json.dumps(x))\n")
    assert _direct_json_writes(f) == ["from json import dumps (line 2)", "json.dumps (line 5)"]


def test_committed_results_are_strict_json() -> None:
    """What bench/results holds (the docs' raw figures) parses with a strict parser: no NaN or Infinity."""
    def refuse(token: str):
        raise ValueError(f"non-standard JSON constant {token}")

    files = sorted((ROOT / "bench" / "results").rglob("*.json"))
    assert len(files) > 20
    bad = {}
    for f in files:
        try:
            json.loads(f.read_text(), parse_constant=refuse)
        except ValueError as e:
            bad[str(f.relative_to(ROOT))] = str(e)
    assert not bad, bad
