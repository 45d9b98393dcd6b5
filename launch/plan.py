"""Memory plan before launch: per-device memory of a training run, from configs alone (train/plan.py).

    python launch/plan.py model=gpt-oss-120b world_size=8 device_memory_gb=141 +exp=eagle3_ttt_40k
    python launch/plan.py model=smollm2-135m-instruct context=8192 device=cpu deepspeed=zero2
    make plan MODEL=gpt-oss-120b ARGS="world_size=8 device_memory_gb=80"

Its own keys: model (the target: a preset of conf/targets/, a directory with config.json, or a hub id; no
weights are read), context (tokens per sample; default data.max_len), world_size (training ranks, default 1),
nodes (default 1: with data.source=vllm, the layout of each node's devices: training ranks, then servers), device (cuda |
cpu; default cuda), device_memory_gb (then: fits or not, and the longest context that fits), drafter (the
conf/model/ group: eagle3 | eagle1) and json (a path: the plan as JSON too). Everything else is a training override, exactly as launch/train.py takes it
(conf/train.yaml, +exp=..., deepspeed=zero2, train.checkpoint_layer=true, data.source=online ...), checked by
the same schema; data.dir and out_dir are not needed.
"""

from launch.paths import CONF_DIR  # noqa: I001 (first: takes launch/ off sys.path)

from infra.strict_json import dumps
import sys
from pathlib import Path

PLAN_KEYS = ("model", "context", "world_size", "nodes", "device", "device_memory_gb", "drafter", "json")


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """(the plan's own key=value pairs, the training overrides)."""
    own, overrides = {}, []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in PLAN_KEYS:
            own[key] = value
        else:
            overrides.append(arg)
    return own, overrides


def run_config(overrides: list[str], drafter: str | None = None):
    """The training run config these overrides compose (conf/train.yaml), as launch/train.py builds it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from train.config import RunConfig, register_configs

    register_configs()
    given = {o.lstrip("+").partition("=")[0] for o in overrides}
    fill = [f"{k}=plan" for k in ("out_dir", "data.dir") if k not in given]  # required by the schema, unused here
    group = [f"model={drafter}"] if drafter else []
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            raw = compose(config_name="train", overrides=[*group, *fill, *overrides])
    except (HydraException, OmegaConfBaseException) as e:
        from infra.config_keys import ConfigError

        raise ConfigError(f"config error: {e}") from None
    return RunConfig.from_omegaconf(raw)


def positive(own: dict[str, str], key: str, cast: type):
    """The plan key `key` as a number > 0 (None when not given); ConfigError naming the key otherwise."""
    from infra.config_keys import ConfigError

    if key not in own:
        return None
    try:
        value = cast(own[key])
    except ValueError:
        raise ConfigError(f"{key}={own[key]!r} is not a number") from None
    if not value > 0:
        raise ConfigError(f"{key} must be > 0, got {own[key]}")
    return value


def main(argv: list[str] | None = None) -> int:
    from infra.config_keys import ConfigError
    from train.plan import PlanError, plan_run

    own, overrides = parse(sys.argv[1:] if argv is None else argv)
    try:
        world = positive(own, "world_size", int) or 1
        nodes = positive(own, "nodes", int) or 1
        context = positive(own, "context", int)
        memory = positive(own, "device_memory_gb", float)
        cfg = run_config(overrides, own.get("drafter")).validate(world_size=world)
        p = plan_run(cfg, own.get("model", "smollm2-135m-instruct"), world_size=world, context=context,
                     device_memory_gb=memory, device=own.get("device", "cuda"), nodes=nodes)
    except (ConfigError, PlanError, ValueError) as e:  # ValueError: a number that is not one
        print(f"plan error: {e}", file=sys.stderr)
        return 2  # the user-error status of every launcher (launch/errors.py)
    print(p.table())
    if "json" in own:
        path = Path(own["json"])
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(dumps(p.as_dict(), indent=1))
        tmp.replace(path)
    return 0 if p.fits in (None, True) else 3


if __name__ == "__main__":
    sys.exit(main())
