"""Train an EAGLE-3 drafter with TTT on prepared shards (DeepSpeed ZeRO, CPU or GPUs).

    # 1 process (no torchrun needed), CPU or one GPU
    python launch/train.py +exp=eagle3_ttt data.dir=outputs/prep out_dir=outputs/run
    # tiny CPU smoke run
    python launch/train.py +exp=debug data.dir=outputs/prep out_dir=outputs/debug
    # N processes on one machine (gloo on CPU, nccl on GPUs); ZeRO stage via the deepspeed group
    torchrun --nproc_per_node 8 launch/train.py +exp=eagle3_ttt deepspeed=zero2 data.dir=... out_dir=...
    # multi-node: torchrun's own rendezvous options, same command on every node
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint <host0>:29500 \
        --rdzv_id run1 launch/train.py +exp=eagle3_ttt data.dir=<shared fs> out_dir=<shared fs>
    # resume (any world size): the same command plus train.resume=true (the sample-order and schedule settings
    # must match the run's); a fresh run refuses an out_dir holding another run: train.overwrite=true clears it
    # the frozen target inside training instead of reading shards (train/online.py); any prep,
    # one made with stage=render (no shards) too
    torchrun --nproc_per_node 8 launch/train.py +exp=eagle3_ttt data.dir=... data.source=online out_dir=...
    # sweep: every job in <out_dir>/job<N>/, then <out_dir>/sweep_summary.{md,json,png}
    torchrun --nproc_per_node 2 launch/train.py -m +exp=eagle3_ttt data.dir=... out_dir=outputs/sweep \
        train.ttt_steps=1,3,7 train.loss_decay=0.6,0.8,1.0

Outputs under out_dir (a run) or out_dir/job<N> (a sweep job): config.yaml (resolved), train.log,
metrics.jsonl, summary.json, checkpoints/, export/ (config.json + model.safetensors for vLLM/SGLang).
Preemption: SIGTERM or SIGUSR1 to any worker (or SIGTERM to torchrun, which forwards it) checkpoints every rank
at the next optimizer step and exits with status 75 (infra/preemption.py); train.resume=true continues.
Several nodes and SLURM: docs/cluster.md, launch/slurm/.
Config schema: train/config.py; groups and presets: conf/. Multi-node needs out_dir and data.dir on a
filesystem every node sees (rank 0 writes checkpoints; every rank reads them on resume).
"""

import os
import sys

from hydra.core.hydra_config import HydraConfig

from launch.paths import CONF_DIR
from infra.preemption import Preempted
from launch.errors import hydra_main
from train.config import ConfigError, RunConfig, register_configs
from train.engine import shutdown_distributed
from train.trainer import run

register_configs()


@hydra_main(config_path=str(CONF_DIR), config_name="train")
def main(raw) -> None:
    try:
        cfg = RunConfig.from_omegaconf(raw).validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    run(cfg, HydraConfig.get().runtime.output_dir)


def cli() -> None:
    """The entry point (this script, `drafters-train`): every rank runs it under torchrun."""
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:  # one .hydra/ per run dir, written by rank 0; each rank its own log file
        sys.argv += ["hydra.output_subdir=null",
                     f"hydra.job_logging.handlers.file.filename=${{hydra.runtime.output_dir}}/train.rank{rank}.log"]
    try:
        main()
    except Preempted:  # checkpointed at the stop step: exit status PREEMPTED (75)
        shutdown_distributed()
        raise
    shutdown_distributed()


if __name__ == "__main__":
    cli()
