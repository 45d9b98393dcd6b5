"""Prepare drafter training data: conversations → target-regenerated chats → hidden-state shards.

    python launch/prep.py model=smollm2-135m-instruct data=sharegpt-embedded num_samples=200 out=outputs/prep
    torchrun --nproc_per_node 8 launch/prep.py model=gpt-oss-120b data=<jsonl> regen.backend=openai ...

See data_prep/pipeline.py for the output layout and data_prep/shards.py for the shard format. SIGTERM or SIGUSR1
stops it at the next boundary (at once while it waits on vLLM), writes what it captured as a last shard and exits
with status 75 (infra/preemption.py); the same command resumes. Several nodes and SLURM: docs/cluster.md, launch/slurm/prep.sbatch.
"""

from hydra.core.config_store import ConfigStore

from launch.paths import CONF_DIR
from data_prep.config import RENAMED_KEYS, REPLACED_KEYS, PrepConfig, prep_config
from data_prep.pipeline import run
from infra.config_keys import ConfigError
from launch.errors import hydra_main

ConfigStore.instance().store(name="prep_schema", node=PrepConfig)


@hydra_main(config_path=str(CONF_DIR / "prep"), config_name="prep", renamed=RENAMED_KEYS,
            replaced=REPLACED_KEYS)
def main(raw) -> None:
    try:
        cfg = prep_config(raw)
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    run(cfg)


if __name__ == "__main__":
    main()
