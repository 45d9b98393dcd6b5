"""Every command of the large-target recipes (docs/scaling.md), checked as written against this project's own
schemas, no weights loaded: the prep and training overrides compose and validate, tensor-parallel group sizes split
the target's heads in the world the torchrun flags make, and the memory plans run from the presets' public configs.
Nothing here needs a GPU; what it cannot check (that the GPUs run it) docs/scaling.md says."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "docs" / "scaling.md"
SECTION = "## Large targets"


def recipe_commands() -> list[list[str]]:
    """The commands of the fenced bash blocks of docs/scaling.md's large-target section (up to its next heading),
    continuation lines joined, comments and shell-only lines (exports, servers) kept out."""
    text = RECIPES.read_text()
    start = text.index(SECTION)
    end = min(i for i in (text.find("\n## ", start + 1), text.find("\n### ", start + 1)) if i > 0)
    blocks = re.findall(r"```bash\n(.*?)```", text[start:end], flags=re.S)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = line.split(" #", 1)[0].strip()
            if line.startswith(("torchrun", "python launch/")):
                commands.append(shlex.split(line.replace("$HEAD", "head0")))
    return commands


def split_command(argv: list[str]) -> tuple[str, int, list[str]]:
    """(the launch script, the world size its torchrun flags make, the script's overrides)."""
    script = next(a for a in argv if a.startswith("launch/"))
    i = argv.index(script)
    flags, overrides = argv[:i], argv[i + 1:]

    def flag(name: str, default: int) -> int:
        return int(flags[flags.index(name) + 1]) if name in flags else default

    world = flag("--nnodes", 1) * flag("--nproc_per_node", 1) if flags and flags[0] == "torchrun" else 1
    return script, world, overrides


def prep_config(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from data_prep.config import PrepConfig
    from data_prep.config import prep_config as typed

    ConfigStore.instance().store(name="prep_schema", node=PrepConfig)
    with initialize_config_dir(config_dir=str(ROOT / "conf" / "prep"), version_base="1.3"):
        cfg = typed(compose(config_name="prep", overrides=overrides))
    cfg.validate()
    return cfg


def test_the_recipes_hold_every_kind_of_command():
    scripts = [split_command(c)[0] for c in recipe_commands()]
    assert scripts.count("launch/prep.py") >= 3 and scripts.count("launch/train.py") >= 3
    assert scripts.count("launch/plan.py") >= 3


@pytest.mark.parametrize("argv", recipe_commands(), ids=lambda a: " ".join(a)[:90])
def test_recipe_command_holds_as_written(argv, capsys):
    from data_prep.targets import check_tensor_parallel
    from launch.plan import main as plan_main
    from launch.plan import run_config
    from train.plan import plan_run, target_config

    script, world, overrides = split_command(argv)
    if script == "launch/plan.py":
        assert plan_main(overrides) == 0
        assert "per device" in capsys.readouterr().out.lower()
        return
    if script == "launch/prep.py":
        cfg = prep_config(overrides)
        config, _, _ = target_config(cfg.model)
        check_tensor_parallel(config, cfg.capture.tensor_parallel_size, world, "recipe")
        if cfg.capture.engine == "vllm":
            assert cfg.capture.tensor_parallel_size == 1  # vLLM's own parallelism instead
        return
    assert script == "launch/train.py"
    cfg = run_config(overrides)
    cfg.validate(world)
    preps = {}
    for command in recipe_commands():
        other, _, prep_overrides = split_command(command)
        if other == "launch/prep.py":
            given = dict(o.split("=", 1) for o in prep_overrides)
            preps[given["out"]] = given["model"]
    model = preps[cfg.data.dir]  # every training command reads a prep the recipe makes
    if cfg.data.target_placement == "tp":
        config, _, _ = target_config(model)
        check_tensor_parallel(config, cfg.data.target_tp_size or world, world, "recipe")
    plan_run(cfg, model, world_size=world)

