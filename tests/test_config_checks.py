"""Every check of every config class is a user error: each `validate()` of a dataclass in our packages (found by
reading the source, so a new config class is covered the day it appears) is given a bad value per check, and
each refusal must be a ConfigError (launch/errors.py: one line, exit status 2) naming the key. Which checks a
`validate` runs is read from its source too: every `raise`, and every call of a function of ours that raises
(a helper such as `_one_of`, a nested `need()`, another method), in it and in what it calls; the test fails
naming the line of a check no bad value reached. Then each launcher, given one bad value, says it in one line
and exits 2 before it loads any model."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import typing
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FunctionType

import pytest

from infra.config_keys import ConfigError
from launch.errors import USER_ERROR, user_error_classes

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests")


def config_classes() -> list[str]:
    """"module:Class" of every dataclass with a `validate` method in our packages, from their source."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text())
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and _is_dataclass(node) and any(
                        isinstance(f, ast.FunctionDef) and f.name == "validate" for f in node.body):
                    found.append(f"{module}:{node.name}")
    return found


def _is_dataclass(node: ast.ClassDef) -> bool:
    for d in node.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if (isinstance(target, ast.Name) and target.id == "dataclass") or (
                isinstance(target, ast.Attribute) and target.attr == "dataclass"):
            return True
    return False


def _load(ref: str) -> type:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------------------------------------
# the checks a validate runs, read from its source

Site = tuple[str, str, int, int]  # (file, function qualname, first line, last line)


def check_sites(cls: type) -> dict[Site, str]:
    """Every check `cls.validate` runs -> its source line: each raise statement and each call of a function of ours
    that raises, in validate and (recursively) in the functions of ours it calls."""
    sites: set[Site] = set()
    seen: set[object] = set()

    def visit(fn: FunctionType, owner: type | None) -> bool:
        """Records fn's sites; whether fn can raise."""
        if fn in seen:
            return any(s[0] == _file(fn) and s[1] == fn.__qualname__ for s in sites)
        seen.add(fn)
        lines, first = inspect.getsourcelines(fn)
        node = ast.parse(textwrap.dedent("".join(lines))).body[0]
        return _visit_body(node, fn, owner, first - 1, fn.__qualname__)

    def _visit_body(node: ast.AST, fn: FunctionType, owner: type | None, offset: int, qualname: str) -> bool:
        nested = {n.name: n for n in ast.iter_child_nodes(node) if isinstance(n, ast.FunctionDef)}
        nested_raises = {name: _visit_body(n, fn, owner, offset, f"{qualname}.<locals>.{name}")
                         for name, n in nested.items()}
        raises = False
        for n in _own_nodes(node):
            if not isinstance(n, (ast.Raise, ast.Call)):
                continue
            site = (_file(fn), qualname, n.lineno + offset, (n.end_lineno or n.lineno) + offset)
            if isinstance(n, ast.Raise):
                sites.add(site)
                raises = True
            elif isinstance(n, ast.Call):
                name = n.func.id if isinstance(n.func, ast.Name) else None
                if name in nested:
                    callee_raises = nested_raises[name]
                else:
                    callee = _resolve(n.func, fn, owner)
                    callee_raises = callee is not None and visit(*callee)
                if callee_raises:
                    sites.add(site)
                    raises = True
        return raises

    visit(cls.validate, cls)
    return {s: _line(s) for s in sites}


def _own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """The nodes of a function's body, not those of the functions it defines."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        yield child
        yield from _own_nodes(child)


def _resolve(func: ast.expr, fn: FunctionType, owner: type | None) -> tuple[FunctionType, type | None] | None:
    """The function of ours a call names: f(...) (fn's module), self.m(...), self.field.m(...) (by the field's type)."""
    if isinstance(func, ast.Name):
        target = fn.__globals__.get(func.id)
        return (target, None) if _ours(target) else None
    if not isinstance(func, ast.Attribute) or owner is None:
        return None
    base = func.value
    cls: type | None = None
    if isinstance(base, ast.Name) and base.id == "self":
        cls = owner
    elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id == "self":
        hint = typing.get_type_hints(owner).get(base.attr)
        cls = hint if isinstance(hint, type) else None
    target = getattr(cls, func.attr, None) if cls is not None else None
    return (target, cls) if _ours(target) else None


def _ours(fn: object) -> bool:
    return isinstance(fn, FunctionType) and fn.__module__.split(".")[0] in PACKAGES


def _file(fn: FunctionType) -> str:
    return str(Path(inspect.getsourcefile(fn) or "").resolve())


def _line(site: Site) -> str:
    return Path(site[0]).read_text().splitlines()[site[2] - 1].strip()


def reached(err: BaseException) -> set[tuple[str, str, int]]:
    """(file, function qualname, line) of every frame the error passed through."""
    out = set()
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        out.add((str(Path(code.co_filename).resolve()), code.co_qualname, tb.tb_lineno))
        tb = tb.tb_next
    return out


# ------------------------------------------------------------------------------------------------------------
# a bad value per check, on a config that validates


@dataclasses.dataclass(frozen=True)
class Bad:
    settings: dict[str, object]  # dotted field -> value, set on a config that validates
    named: str = ""  # what the message must name; "": the first key
    world_size: int | None = None  # RunConfig.validate's

    def key(self) -> str:
        return self.named or next(iter(self.settings))


def _eval() -> object:
    from eval.config import EvalConfig

    return EvalConfig(drafter="d", out_dir="o")


def _run() -> object:
    from train.config import DataConfig, RunConfig

    return RunConfig(out_dir="o", data=DataConfig(dir="/nonexistent/prep"))


def _prep() -> object:
    from data_prep.config import PrepConfig

    return PrepConfig(out="o")


TARGET = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 48,
          "num_hidden_layers": 10, "vocab_size": 97, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 128}


def _eagle3() -> object:
    from models.eagle3 import Eagle3Config

    return Eagle3Config.from_target_config(TARGET, draft_vocab_size=40)


def _dflash() -> object:
    from models.dflash import DFlashConfig

    return DFlashConfig.from_target_config(TARGET, mask_token_id=5)


VLLM_ON = {"data.source": "vllm"}  # where training's vllm.* keys are read
ON_POLICY = {"train.on_policy.enabled": True, "data.source": "online"}
# Geometry and tap checks the model configs share (models/config.py), as each family's validate runs them.
GEOMETRY = [Bad({"hidden_size": 0}), Bad({"num_attention_heads": 3}, "num_key_value_heads"),
            Bad({"head_dim": 7}), Bad({"hidden_act": "gelu"}), Bad({"rms_norm_eps": 0.0}),
            Bad({"rope_scaling": {"rope_type": "nope"}}, "rope_type"), Bad({"tap_layers": []}),
            Bad({"tap_layers": [1, 1, 2]}, "tap_layers"), Bad({"tap_layers": [-1, 2, 3]}, "tap_layers"),
            Bad({"tap_layers": [1, 2, 10]}, "tap_layers")]

CASES: dict[str, tuple[Callable[[], object], list[Bad]]] = {
    "eval.config:EvalConfig": (_eval, [
        Bad({"dtype": "fp32"}), Bad({"decode.mode": "beam"}), Bad({"decode.depth": 0}), Bad({"decode.topk": 0}),
        Bad({"decode.total_tokens": 0}), Bad({"decode.max_new_tokens": 0}), Bad({"decode.temperature": -1.0}),
        Bad({"decode.top_p": 0.0}), Bad({"decode.top_p": 1.5}), Bad({"decode.top_k": -1}),
        Bad({"decode.budget": "greedy"}), Bad({"decode.sample_drafts": True}),
        Bad({"decode.auto_total_tokens": True, "decode.total_tokens_candidates": [0, 4]}, "total_tokens_candidates"),
        Bad({"engine": "sglang"}), Bad({"engine": "vllm"}, "decode.mode=chain"),
        Bad({"engine": "vllm", "decode.mode": "chain", "decode.budget": "adaptive"}, "decode.budget=fixed"),
        Bad({"vllm.concurrency": [1, 4]}, "engine=vllm"), Bad({"vllm.num_speculative_tokens": [2]}, "engine=vllm"),
        Bad({"engine": "vllm", "decode.mode": "chain", "vllm.engine_kwargs": {"enforce-eager": True}},
            "vllm.engine_kwargs"),
        Bad({"engine": "vllm", "decode.mode": "chain", "vllm.concurrency": [0]}, "vllm.concurrency"),
        Bad({"engine": "vllm", "decode.mode": "chain", "vllm.num_speculative_tokens": [0]},
            "vllm.num_speculative_tokens"),
        Bad({"vllm.load_rounds": 0}),
    ]),
    "train.config:RunConfig": (_run, [
        Bad({"model.method": "medusa"}), Bad({"model.attn_backend": "magic"}), Bad({"model.lm_head_init": "zeros"}),
        Bad({"model.norm_init": "twos"}), Bad({"train.schedule": "step"}),
        Bad({"model.freeze_lm_head": True}, "model.lm_head_init=target"), Bad({"train.decay_ratio": 0.0}),
        Bad({"train.extend": True}, "train.resume=true"), Bad({"train.resume": True, "train.overwrite": True}),
        Bad({"train.feature_noise": -0.1}), Bad({"train.accept_loss": "kl"}),
        Bad({"train.teacher_epoch_cache_mb": -1}), Bad({"train.init_from": "/nonexistent/export"}),
        Bad({"train.accept_loss_weight": -1.0}),
        Bad({"model.method": "eagle1", "model.fc_norm": True}, "model.fc_norm"),
        Bad({"deepspeed.precision": "fp16"}), Bad({"deepspeed.dist_backend": "mpi"}),
        Bad({"deepspeed.zero_stage": 4}), Bad({"logger.wandb_mode": "always"}), Bad({"data.verify": "sometimes"}),
        Bad({"data.overflow": "wrap"}), Bad({"data.source": "disk"}), Bad({"data.target_placement": "spread"}),
        Bad({"data.target_placement": "tp", "deepspeed.sequence_parallel_size": 2}, "data.target_placement=tp"),
        Bad({"data.target_tp_size": 2}), Bad({"data.loss_tokens": "some"}),
        Bad({"data.num_workers": 2, "data.source": "online"}, "data.num_workers"),
        Bad({"data.source": "hybrid", "deepspeed.sequence_parallel_size": 2}, "data.source=hybrid"),
        Bad({"data.hybrid_from": "disk"}), Bad({**VLLM_ON, "vllm.urls": ["localhost"]}, "vllm.urls"),
        Bad({**VLLM_ON, "data.vllm_servers_per_node": 0}, "data.vllm_servers_per_node"),
        Bad({**VLLM_ON, "data.vllm_cache_gb": -1}, "data.vllm_cache_gb"),
        Bad({**VLLM_ON, "vllm.timeout_s": 0.0}, "vllm.timeout_s"),
        Bad({**VLLM_ON, "vllm.max_in_flight": 0}, "vllm.max_in_flight"),
        Bad({"data.hybrid_tokens_per_shard": 0}),
        Bad({"data.max_len": 0}), Bad({"data.batch_size": 0}), Bad({"train.ttt_steps": 0}),
        Bad({"train.grad_accum": 0}), Bad({"deepspeed.sequence_parallel_size": 0}),
        Bad({"train.warmup_steps": -1}), Bad({"train.clip": -1.0}), Bad({"data.num_workers": -1}),
        Bad({"train.warmup_ratio": 1.0}), Bad({"train.max_steps": 0}), Bad({"train.eval_ttt_steps": 0}),
        Bad({"train.loss_decay": 1.5}), Bad({"train.lr": 0.0}), Bad({"train.min_lr_ratio": 2.0}),
        Bad({"train.betas": [0.9]}), Bad({"model.intermediate_size": 0}), Bad({"data.train_samples": 0}),
        Bad({"model.num_attention_heads": 6, "model.num_key_value_heads": 4}, "model.num_key_value_heads"),
        Bad({"data.target_placement": "tp", "data.source": "online", "data.target_tp_size": 3}, "data.target_tp_size",
            world_size=2),
        Bad({"deepspeed.sequence_parallel_size": 2}, world_size=3),
        Bad({"data.batch_size": 3}, world_size=2), Bad({"data.eval_batch_size": 3}, world_size=2),
        Bad({"data.overflow": "split", "data.split_overlap": 2048}, "data.split_overlap"),
        Bad({"model.method": "eagle1", "deepspeed.sequence_parallel_size": 2}, "deepspeed.sequence_parallel_size"),
        Bad({"deepspeed.sequence_parallel_size": 2, "model.num_attention_heads": 3}, "model.num_attention_heads"),
        Bad({"model.dflash.num_layers": 0}), Bad({"model.dflash.block_size": 1}),
        Bad({"model.dflash.mask_token_id": -1}), Bad({"model.tap_layers": [1, 1]}),
        Bad({"train.dflash.anchors": 0}), Bad({"train.dflash.gamma": 0.0}),
        Bad({"train.on_policy.depth": 0}), Bad({"train.on_policy.max_new_tokens": 0}),
        Bad({"train.on_policy.refresh_interval": 0}), Bad({"train.on_policy.temperature": -1.0}),
        Bad({**ON_POLICY, "model.method": "eagle1"}, "model.method=eagle1"),
        Bad({"train.on_policy.enabled": True}, "data.source=offline"),
        Bad({**ON_POLICY, "data.loss_tokens": "all"}, "data.loss_tokens=all"),
    ]),
    "data_prep.config:PrepConfig": (_prep, [
        Bad({"dtype": "fp32"}), Bad({"overflow": "wrap"}), Bad({"regen.backend": "sglang"}),
        Bad({"regen.on_length": "cut"}), Bad({"regen.api_key": "sk-secret"}), Bad({"eval_samples": -1}),
        Bad({"capture.teacher": "logits"}), Bad({"capture.taps_dtype": "float16"}), Bad({"stage": "train"}),
        Bad({"draft_vocab_count": "eval"}), Bad({"draft_vocab_train_weight": 1.5}),
        Bad({"capture.tensor_parallel_size": 0}), Bad({"max_len": 4}), Bad({"capture.engine": "sglang"}),
        Bad({"capture.engine": "vllm", "capture.tensor_parallel_size": 2}, "capture.tensor_parallel_size"),
        Bad({"vllm.capture_fidelity": "exact"}), Bad({"vllm.tensor_parallel_size": 0}),
        Bad({"vllm.max_in_flight": 0}), Bad({"vllm.timeout_s": 0.0}), Bad({"vllm.scratch_gb": -1.0}),
        Bad({"vllm.urls": ["localhost:8000"]}),
        Bad({"vllm.urls": ["http://h:8000"], "vllm.tensor_parallel_size": 2}, "vllm.urls"),
        Bad({"vllm.engine_kwargs": {"port": 9}}),
    ]),
    "models.eagle3:Eagle3Config": (_eagle3, [
        *GEOMETRY, Bad({"draft_vocab_size": 0}), Bad({"target_hidden_size": 0}), Bad({"draft_vocab_size": 98}),
    ]),
    "models.dflash:DFlashConfig": (_dflash, [
        *GEOMETRY, Bad({"num_hidden_layers": 0}), Bad({"block_size": 1}), Bad({"mask_token_id": 97}),
    ]),
}


def _set(cfg: object, dotted: str, value: object) -> None:
    *path, name = dotted.split(".")
    for part in path:
        cfg = getattr(cfg, part)
    setattr(cfg, name, value)


def refusal(factory: Callable[[], object], bad: Bad) -> BaseException | None:
    cfg = factory()
    for key, value in bad.settings.items():
        _set(cfg, key, value)
    kwargs = {} if bad.world_size is None else {"world_size": bad.world_size}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a setting that only warns is not what these cases are about
            cfg.validate(**kwargs)  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 - every refusal is asserted below, whatever its type
        return e
    return None


def test_every_config_class_with_a_validate_has_its_bad_values() -> None:
    found = config_classes()
    assert "train.config:RunConfig" in found and "eval.config:EvalConfig" in found  # the scan finds them
    missing = sorted(set(found) - set(CASES))
    assert not missing, f"config classes whose checks no test gives a bad value: {missing} (add them to CASES)"
    assert not set(CASES) - set(found), "CASES names a class that no longer has a validate()"


@pytest.mark.parametrize("ref", sorted(CASES))
def test_every_check_refuses_its_bad_value_as_a_user_error(ref: str) -> None:
    cls = _load(ref)
    factory, cases = CASES[ref]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        factory().validate()  # type: ignore[attr-defined]  # the base config is a good one
    hit: set[tuple[str, str, int]] = set()
    wrong = []
    for bad in cases:
        err = refusal(factory, bad)
        if err is None:
            wrong.append(f"{bad.settings}: accepted")
            continue
        hit |= reached(err)
        if not isinstance(err, ConfigError) or not isinstance(err, user_error_classes()):
            wrong.append(f"{bad.settings}: {type(err).__name__}, not a ConfigError: {err}")
        elif bad.key() not in str(err) or "\n" in str(err):
            wrong.append(f"{bad.settings}: the message does not name {bad.key()!r} in one line: {err}")
    assert not wrong, "\n".join(wrong)
    unreached = [f"{Path(f).relative_to(ROOT)}:{first} ({name}): {text}"
                 for (f, name, first, last), text in sorted(check_sites(cls).items())
                 if not any(h[0] == f and h[1] == name and first <= h[2] <= last for h in hit)]
    assert not unreached, "checks no bad value reached (add one to CASES):\n" + "\n".join(unreached)


# ------------------------------------------------------------------------------------------------------------
# each launcher: one bad value, one line, exit status 2, before any model loads


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "PYTHONWARNINGS", "HYDRA_FULL_ERROR")}
    return {**env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1"}


@pytest.mark.integration
@pytest.mark.parametrize(("script", "overrides", "named"), [
    ("eval.py", ["decode.depth=0"], "decode.depth"),
    ("eval.py", ["engine=vllm"], "decode.mode=chain"),
    ("eval.py", ["prompts={tmp}/missing.jsonl"], "prompts"),
    ("eval.py", ["prompts={tmp}/bad.jsonl"], "bad.jsonl:2"),
    ("eval.py", ["prompts=nosuchsuite"], "nosuchsuite"),
    ("train.py", ["data.dir={tmp}/prep", "train.lr=0"], "train.lr"),
    ("prep.py", ["max_len=4"], "max_len"),
], ids=["eval-depth", "eval-vllm-tree", "eval-missing-prompts", "eval-bad-prompts", "eval-unknown-suite",
        "train-lr", "prep-max-len"])
def test_a_bad_value_ends_each_launcher_in_one_line_with_exit_2(tmp_path: Path, script: str, overrides: list[str],
                                                                named: str) -> None:
    (tmp_path / "bad.jsonl").write_text('{"prompt": "fine"}\n{"turns": []}\n')
    out = {"eval.py": "out_dir", "train.py": "out_dir", "prep.py": "out"}[script]
    # drafter and target name nothing that exists: the refusal must come before either is read
    first = {"eval.py": [f"drafter={tmp_path}/no-export", f"target={tmp_path}/no-target"]}.get(script, [])
    r = subprocess.run([sys.executable, str(ROOT / "launch" / script), *first, f"{out}={tmp_path}/out",
                        *(o.format(tmp=tmp_path) for o in overrides)],
                       capture_output=True, text=True, env=_env(), timeout=120, cwd=ROOT)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == USER_ERROR, r.stdout + r.stderr
    assert len(lines) == 1 and named in lines[0], lines
    assert lines[0].startswith(("config error: ", "error: ")), lines


@pytest.mark.integration
def test_loss_tokens_all_on_a_one_pass_prep_stops_training_before_it_starts(tmp_path: Path) -> None:
    """data.loss_tokens=all on a prep whose shards a one-pass capture wrote (zero rows past the loss mask): one line
    naming the key, the prep and why, exit status 2, nothing of a run written."""
    from synthetic_prep import write_synthetic_prep

    prep = write_synthetic_prep(tmp_path / "prep", n_train=4, n_eval=2, min_len=8, max_len=24, one_pass=True)
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "+exp=debug", f"data.dir={prep}",
                        f"out_dir={run}", "data.loss_tokens=all"],
                       capture_output=True, text=True, env=_env(), timeout=120, cwd=ROOT)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == USER_ERROR, r.stdout + r.stderr
    assert len(lines) == 1 and lines[0].startswith(f"config error: data.loss_tokens=all on {prep}: "), lines
    assert "capture.one_pass" in lines[0], lines
    assert not (run / "config.yaml").exists() and not (run / "checkpoints").exists()
