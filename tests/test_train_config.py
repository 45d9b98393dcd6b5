"""Training config: presets compose, bad keys/values fail at once and clearly, the lr schedule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from train.config import ConfigError, RunConfig, register_configs
from train.engine import lr_lambda

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
REQUIRED = ["data.dir=/nonexistent/prep", "out_dir=/nonexistent/out"]


def _compose(overrides: list[str]) -> RunConfig:
    register_configs()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return RunConfig.from_omegaconf(compose("train", overrides=[*REQUIRED, *overrides]))


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF / "exp").glob("*.yaml")))
def test_every_exp_preset_composes_and_validates(preset: str) -> None:
    text = (CONF / "exp" / f"{preset}.yaml").read_text()
    assert text.startswith("# @package _global_"), "experiment presets are global delta files"
    cfg = _compose([f"+exp={preset}"])
    assert cfg.validate(world_size=2) is cfg
    assert cfg.data.dir == "/nonexistent/prep"


@pytest.mark.parametrize("lever", sorted(p.stem for p in (CONF / "lever").glob("*.yaml")))
def test_every_lever_preset_composes_on_the_demo_recipe(lever: str) -> None:
    cfg = _compose(["+exp=eagle3_demo", f"+lever={lever}"])
    assert cfg.validate(world_size=2) is cfg


def test_acceptance_term_reaches_the_training_settings_only() -> None:
    from train.ttt import TTTSettings

    cfg = _compose(["+exp=eagle3_demo", "+lever=lk_tv", "train.accept_loss_weight=0.3"])
    settings = TTTSettings.from_train(cfg.train)
    assert (settings.accept.kind, settings.accept.weight, settings.accept.active) == ("tv", 0.3, True)
    assert not TTTSettings.from_train(cfg.train, held_out=True).accept.active  # held-out loss_k stays CE
    assert not TTTSettings.from_train(_compose([]).train).accept.active
    with pytest.raises(ConfigError, match="train.accept_loss"):
        _compose(["train.accept_loss=kl"]).validate(world_size=1)


def test_presets_are_deltas() -> None:
    base, ttt, debug = _compose([]), _compose(["+exp=eagle3_ttt"]), _compose(["+exp=debug"])
    assert (base.train.ttt_steps, base.train.loss_decay, base.deepspeed.zero_stage) == (7, 0.8, 3)
    assert ttt.train.epochs == 10 and ttt.train.ttt_steps == 7
    assert debug.train.max_steps == 10 and debug.logger.wandb_mode == "disabled"
    assert debug.deepspeed == base.deepspeed  # debug changes only what it lists


# The key that names what a group option selects: it may equal the schema's default (zero3, eagle3, ...).
SELECTOR = {"model": "method", "deepspeed": "zero_stage", "logger": "wandb_mode"}


@pytest.mark.parametrize("option", sorted(f"{p.parent.name}/{p.stem}" for p in CONF.glob("*/*.yaml")
                                          if p.parent.name in SELECTOR))
def test_group_options_hold_choices_not_defaults(option: str) -> None:
    """Defaults live once, in train/config.py's dataclasses: a group option repeats none of them."""
    group = option.split("/")[0]
    defaults = OmegaConf.to_container(OmegaConf.structured(RunConfig)[group])
    values = OmegaConf.to_container(OmegaConf.load(CONF / f"{option}.yaml"))
    assert set(values) <= set(defaults)
    repeated = [k for k, v in values.items() if v == defaults[k] and k != SELECTOR[group]]
    assert not repeated, f"conf/{option}.yaml repeats defaults: {', '.join(f'{group}.{k}' for k in repeated)}"


def _repeats(values: dict, base: dict, prefix: str = "") -> list[str]:
    """The keys of `values` (nested) that only restate `base`'s value."""
    out = []
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            out += _repeats(v, base[k], f"{prefix}{k}.")
        elif k in base and v == base[k]:
            out.append(f"{prefix}{k}")
    return out


@pytest.mark.parametrize("preset", sorted(f"{p.parent.name}/{p.stem}" for d in ("exp", "lever")
                                          for p in (CONF / d).glob("*.yaml")))
def test_exp_and_lever_presets_hold_changes_not_defaults(preset: str) -> None:
    """Defaults live once: an experiment or lever preset restates no value it would have without it (the
    schema's default, or the value of the experiment it builds on)."""
    values = OmegaConf.to_container(OmegaConf.load(CONF / f"{preset}.yaml")) or {}
    parents = [d for d in values.pop("defaults", []) if isinstance(d, str) and d != "_self_"]
    assert len(parents) <= 1
    base = _compose([f"+exp={p}" for p in parents])
    repeated = _repeats(values, OmegaConf.to_container(OmegaConf.structured(base)))
    assert not repeated, f"conf/{preset}.yaml repeats values it would have anyway: {', '.join(repeated)}"


@pytest.mark.parametrize("group, key, value", [("deepspeed=zero2", "deepspeed.zero_stage", 2),
                                               ("deepspeed=zero0", "deepspeed.zero_stage", 0),
                                               ("logger=jsonl", "logger.wandb_mode", "disabled")])
def test_group_options_compose(group: str, key: str, value) -> None:
    cfg = _compose([group])
    assert cfg.validate(world_size=1) is cfg  # validate raises on a bad config and returns it for chaining
    section, field = key.split(".")
    assert getattr(getattr(cfg, section), field) == value  # the group was applied


def test_misspelt_key_fails_with_its_name() -> None:
    with pytest.raises(ConfigCompositionException, match="train.lrr"):
        _compose(["train.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.lrr'.*did you mean 'train\.lr'"):
        _compose(["+train.lrr=1"])  # `+` bypasses Hydra's struct check; our key check catches it


def test_ill_typed_value_fails_with_its_name() -> None:
    with pytest.raises(ConfigCompositionException) as e:
        _compose(["train.lr=abc"])
    text = str(e.value) + str(e.value.__cause__)
    assert "train.lr" in text and "Float" in text
    with pytest.raises(ConfigCompositionException):
        _compose(["train.ttt_steps=1.5"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("deepspeed.zero_stage=4", "deepspeed.zero_stage"),
        ("deepspeed.precision=fp16", "deepspeed.precision"),
        ("train.loss_decay=0", "train.loss_decay"),
        ("train.ttt_steps=0", "train.ttt_steps"),
        ("model.attn_backend=nope", "model.attn_backend"),
        ("data.batch_size=3", "multiple of the world size"),
        ("data.loss_tokens=prompt", "data.loss_tokens"),
    ],
)
def test_validate_rejects_bad_values(override: str, message: str) -> None:
    cfg = _compose([override])
    with pytest.raises(ConfigError, match=message):
        cfg.validate(world_size=2)


@pytest.mark.integration
def test_entry_point_reports_config_errors_before_any_work(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(ROOT / "launch" / "train.py"), f"data.dir={tmp_path}", f"out_dir={tmp_path / 'o'}"]
    bad = subprocess.run([*cmd, "+train.lrr=1"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0
    assert "did you mean 'train.lr'" in bad.stderr
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_lr_schedule_warmup_then_cosine() -> None:
    warm, total = 4, 20
    lrs = [lr_lambda(s, warm, total, 0.1) for s in range(total)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))  # monotone decay after warmup
    assert lr_lambda(total, warm, total, 0.1) == pytest.approx(0.1)  # floor = min_lr_ratio
    assert lrs[12] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine


# A non-default setting of each lever (train/config.py LEVERS), to see which families take it.
LEVER_SETTINGS = {"draft_vocab_size": ["model.draft_vocab_size=4096"], "lm_head_init": ["model.lm_head_init=target"],
                  "freeze_lm_head": ["model.lm_head_init=target", "model.freeze_lm_head=true"],
                  "norm_init": ["model.norm_init=zeros"], "fc_norm": ["model.fc_norm=true"],
                  "norm_output": ["model.norm_output=true"]}


@pytest.mark.integration
@pytest.mark.parametrize("method", ["eagle3", "eagle1", "dflash"])
def test_the_family_table_decides_what_a_method_accepts(method: str) -> None:
    """Validation reads the family's facts (models/registry.py): its levers and sequence parallelism."""
    import warnings

    from models.registry import family
    from train.config import LEVERS

    fam = family(method)
    assert set(LEVER_SETTINGS) == set(LEVERS) and set(fam.levers) <= set(LEVERS)
    assert fam.objective_cls.method == method  # the objective the table names is the family's own
    for lever, settings in LEVER_SETTINGS.items():
        cfg = _compose([f"model={method}", *settings])
        if lever in fam.levers:
            assert cfg.validate(world_size=2) is cfg
        else:
            with pytest.raises(ConfigError, match=rf"model\.{lever}\b.*not a lever of model.method={method}"):
                cfg.validate(world_size=2)
    cfg = _compose([f"model={method}", "deepspeed.sequence_parallel_size=2"])
    if fam.sequence_parallel:
        assert cfg.validate(world_size=2) is cfg
    else:
        with pytest.raises(ConfigError, match="sequence_parallel_size=2 needs a drafter"):
            cfg.validate(world_size=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _compose([f"model={method}", "model.attn_backend=reference", "model.tap_layers=[1,2,3]"]).validate(world_size=1)
    unused = " ".join(str(w.message) for w in caught if "not used by" in str(w.message))
    assert ("model.attn_backend" in unused) is not fam.attn_backend
    assert ("model.tap_layers" in unused) is not fam.reads_tap_layers
