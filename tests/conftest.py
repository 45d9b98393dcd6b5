"""Shared fixtures: the real embedded target, a tiny random target with the same tokenizer, tiny data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The dtype "auto" picks on a CPU follows its bf16 units (infra/precision.py); the tests pin fp32 so that their
# numbers do not depend on the machine that runs them (tests/test_precision.py mocks both kinds of CPU).
os.environ["DRAFTERS_CPU_BF16"] = "0"
torch.set_num_threads(min(2, torch.get_num_threads()))

# Test tiers (tests/README.md). A test is `integration` when it spawns processes (torchrun, a launcher, a CLI),
# runs DeepSpeed, loads the real embedded model or a real prep, or takes over ~2 s; everything else is the unit
# tier that `make test-fast` runs (`-m "not integration"`). Modules and tests say so with
# `pytest.mark.integration`; a test that requests one of these fixtures is marked here, so a new one cannot
# slip into the unit tier.
INTEGRATION_FIXTURES = frozenset({"smollm2_dir", "tiny_target_dir", "tiny_prep_dir", "smollm2_prep_dir"})


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--durations-file", default=None, metavar="PATH",
                     help="write every test's duration (setup + call + teardown, seconds) to PATH as JSON")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)


_DURATIONS: dict[str, dict] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    entry = _DURATIONS.setdefault(report.nodeid, {"seconds": 0.0, "outcome": "passed"})
    entry["seconds"] += report.duration
    if report.outcome == "failed" or (report.outcome == "skipped" and entry["outcome"] == "passed"):
        entry["outcome"] = report.outcome


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """`--durations-file`: the run's per-test durations, slowest first, written atomically."""
    path = session.config.getoption("--durations-file")
    if not path or not _DURATIONS:
        return
    marked = {item.nodeid for item in session.items if item.get_closest_marker("integration")}
    tests = [{"test": nodeid, "seconds": round(d["seconds"], 3), "outcome": d["outcome"],
              "tier": "integration" if nodeid in marked else "unit"}
             for nodeid, d in sorted(_DURATIONS.items(), key=lambda kv: -kv[1]["seconds"])]
    totals = {tier: round(sum(t["seconds"] for t in tests if t["tier"] == tier), 1) for tier in ("unit", "integration")}
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps({"exit_status": int(exitstatus), "total_seconds": totals, "tests": tests}, indent=1))
    os.replace(tmp, out)

TINY_CONVERSATIONS = [
    {"id": f"c{i}", "conversations": [
        {"from": "system", "value": "You are terse."} if i % 3 == 0 else None,
        {"from": "human", "value": q},
        {"from": "gpt", "value": a},
        {"from": "human", "value": "And why?"},
        {"from": "gpt", "value": f"Because {a.lower()}"},
    ]}
    for i, (q, a) in enumerate([
        ("What is 2 + 2?", "It is 4."),
        ("Name a colour.", "Blue."),
        ("Capital of France?", "Paris is the capital of France."),
        ("Say hello.", "Hello there!"),
        ("Largest planet?", "Jupiter."),
        ("Opposite of hot?", "Cold."),
        ("A prime number?", "Seven is prime."),
        ("Spell cat.", "C, A, T."),
        ("Water formula?", "H2O."),
        ("Fastest land animal?", "The cheetah."),
        ("Author of Hamlet?", "William Shakespeare."),
        ("Boiling point of water?", "100 degrees Celsius at sea level."),
    ])
]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a plain HF directory (converted once, cached)."""
    from data_prep.targets import materialise_embedded, resolve_target

    return materialise_embedded(resolve_target("smollm2-135m-instruct"))


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory, smollm2_dir: Path) -> Path:
    """An 8-layer random Llama with SmolLM2's real tokenizer and chat template (fast, deterministic)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_target")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_sharegpt_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("data") / "tiny_sharegpt.json"
    records = [{"id": r["id"], "conversations": [t for t in r["conversations"] if t]} for r in TINY_CONVERSATIONS]
    out.write_text(json.dumps(records))
    return out


def run_prep(out: Path, model: str, data: str, **overrides) -> dict:
    """Run the prep pipeline in-process with typed config overrides (no Hydra)."""
    from data_prep.config import PrepConfig
    from data_prep.pipeline import run

    cfg = PrepConfig(model=model, data=data, out=str(out))
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = getattr(node, p)
        setattr(node, leaf, value)
    return run(cfg)


def run_train(out: Path, *overrides: str) -> list[dict]:
    """`python launch/train.py <overrides> out_dir=<out>` in a fresh single process (no torchrun env leaking
    in); returns the run's metrics.jsonl records."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, str(root / "launch" / "train.py"), *overrides, f"out_dir={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=600,
                          env={**env, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_prep_dir(tmp_path_factory, tiny_target_dir: Path, tiny_sharegpt_file: Path) -> Path:
    """Real shards from the tiny target, replies regenerated by it (so its argmax is mostly the next
    token and in the draft vocab, as with a real target): what training and eval tests read."""
    out = tmp_path_factory.mktemp("prep")
    run_prep(out, str(tiny_target_dir), str(tiny_sharegpt_file), num_samples=10, eval_samples=2,
             **{"regen.max_new_tokens": 24, "regen.max_turns": 2})
    return out


@pytest.fixture(scope="session")
def smollm2_prep_dir(tmp_path_factory, smollm2_dir: Path, tiny_sharegpt_file: Path) -> Path:
    """Real prep output from the real embedded target, replies regenerated by it (short)."""
    out = tmp_path_factory.mktemp("prep_smollm2")
    run_prep(out, "smollm2-135m-instruct", str(tiny_sharegpt_file), num_samples=10, eval_samples=2,
             **{"regen.max_new_tokens": 40, "regen.batch_size": 6})
    return out
