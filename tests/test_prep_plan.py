"""Prep computes its plan once (data_prep/pipeline.py plan_prep): which backend regenerates, which engine captures,
and whether and when the transformers target loads, for every combination the config allows; the combinations it
does not allow are refused by validation before anything runs."""

from __future__ import annotations

import pytest

from data_prep.config import PrepConfig
from data_prep.pipeline import plan_prep


def config(regen: str | None, capture: str, stage: str, fidelity: str, tp: int = 1) -> PrepConfig:
    cfg = PrepConfig(out="x", stage=stage)
    cfg.regen.enabled = regen is not None
    cfg.regen.backend = regen or "hf"
    cfg.capture.engine, cfg.vllm.capture_fidelity, cfg.capture.tensor_parallel_size = capture, fidelity, tp
    return cfg


# (regen backend or None, capture engine, stage, vllm.capture_fidelity) -> (regenerates, captures, when the
# transformers target loads, vLLM servers, which extract). stage=render captures nothing (the fidelity probe runs on
# the transformers target); vllm.capture_fidelity=hf loads the target beside the servers for the comparison.
EXPECTED = {
    (None, "hf", "all", "engine"): (None, "hf", "first", False, False),
    (None, "hf", "all", "hf"): (None, "hf", "first", False, False),
    (None, "vllm", "all", "engine"): (None, "vllm", None, True, True),  # the head alone: vLLM holds the layers
    (None, "vllm", "all", "hf"): (None, "vllm", "first", True, True),
    (None, "hf", "render", "engine"): (None, None, "first", False, False),
    (None, "hf", "render", "hf"): (None, None, "first", False, False),
    (None, "vllm", "render", "engine"): (None, None, "first", False, False),
    (None, "vllm", "render", "hf"): (None, None, "first", False, False),
    ("hf", "hf", "all", "engine"): ("hf", "hf", "first", False, False),
    ("hf", "hf", "all", "hf"): ("hf", "hf", "first", False, False),
    ("hf", "vllm", "all", "engine"): ("hf", "vllm", "first", True, True),
    ("hf", "vllm", "all", "hf"): ("hf", "vllm", "first", True, True),
    ("hf", "hf", "render", "engine"): ("hf", None, "first", False, False),
    ("hf", "hf", "render", "hf"): ("hf", None, "first", False, False),
    ("hf", "vllm", "render", "engine"): ("hf", None, "first", False, False),
    ("hf", "vllm", "render", "hf"): ("hf", None, "first", False, False),
    ("vllm", "hf", "all", "engine"): ("vllm", "hf", "after_regen", True, False),  # servers stopped, then it loads
    ("vllm", "hf", "all", "hf"): ("vllm", "hf", "after_regen", True, False),
    ("vllm", "vllm", "all", "engine"): ("vllm", "vllm", None, True, True),  # one server regenerates and captures
    ("vllm", "vllm", "all", "hf"): ("vllm", "vllm", "first", True, True),
    ("vllm", "hf", "render", "engine"): ("vllm", None, "after_regen", True, False),
    ("vllm", "hf", "render", "hf"): ("vllm", None, "after_regen", True, False),
    ("vllm", "vllm", "render", "engine"): ("vllm", None, "after_regen", True, False),
    ("vllm", "vllm", "render", "hf"): ("vllm", None, "after_regen", True, False),
    ("openai", "hf", "all", "engine"): ("openai", "hf", "first", False, False),
    ("openai", "hf", "all", "hf"): ("openai", "hf", "first", False, False),
    ("openai", "vllm", "all", "engine"): ("openai", "vllm", None, True, True),
    ("openai", "vllm", "all", "hf"): ("openai", "vllm", "first", True, True),
    ("openai", "hf", "render", "engine"): ("openai", None, "first", False, False),
    ("openai", "hf", "render", "hf"): ("openai", None, "first", False, False),
    ("openai", "vllm", "render", "engine"): ("openai", None, "first", False, False),
    ("openai", "vllm", "render", "hf"): ("openai", None, "first", False, False),
}


@pytest.mark.parametrize("combo", list(EXPECTED), ids=lambda c: "-".join(map(str, c)))
def test_every_combination_has_one_plan(combo: tuple) -> None:
    cfg = config(*combo)
    cfg.validate()
    plan = plan_prep(cfg)
    assert (plan.regen, plan.capture, plan.hf_target, plan.vllm, plan.vllm_extracts) == EXPECTED[combo], combo


def test_the_table_has_every_combination() -> None:
    assert len(EXPECTED) == 4 * 2 * 2 * 2  # regeneration backend or none, capture engine, stage, capture fidelity


def test_a_target_loaded_after_a_vllm_regeneration_never_overlaps_its_servers() -> None:
    # "after_regen" is only planned when the servers do not capture: they are stopped before the target loads
    for combo in EXPECTED:
        plan = plan_prep(config(*combo))
        if plan.hf_target == "after_regen":
            assert plan.regen == "vllm" and not plan.vllm_extracts


@pytest.mark.parametrize(("regen", "capture", "message"), [
    ("vllm", "hf", "split by vllm.tensor_parallel_size"),  # transformers' TP with a vLLM regeneration
    (None, "vllm", "split by vllm.tensor_parallel_size"),
])
def test_combinations_the_config_does_not_allow_are_refused(regen, capture, message) -> None:
    with pytest.raises(ValueError, match=message):
        config(regen, capture, "all", "engine", tp=2).validate()
