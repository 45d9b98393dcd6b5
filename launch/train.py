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
    # resume (any world size): the same command plus train.resume=true
    # sweep: every job in <out_dir>/job<N>/, then <out_dir>/sweep_summary.{md,json,png}
    torchrun --nproc_per_node 2 launch/train.py -m +exp=eagle3_ttt data.dir=... out_dir=outputs/sweep \
        train.ttt_steps=1,3,7 train.loss_decay=0.6,0.8,1.0

Outputs under out_dir (a run) or out_dir/job<N> (a sweep job): config.yaml (resolved), train.log,
metrics.jsonl, summary.json, checkpoints/, export/ (config.json + model.safetensors for vLLM/SGLang).
Config schema: train/config.py; groups and presets: conf/. Multi-node needs out_dir and data.dir on a
filesystem every node sees (rank 0 writes checkpoints; every rank reads them on resume).
"""

import os
import sys

# Python puts this script's directory first on sys.path, where this very file would shadow the `train`
# package; the entry point needs the package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402

from train.config import ConfigError, RunConfig, register_configs  # noqa: E402
from train.engine import shutdown_distributed  # noqa: E402
from train.trainer import run  # noqa: E402

register_configs()


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(raw) -> None:
    try:
        cfg = RunConfig.from_omegaconf(raw).validate(world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        raise SystemExit(f"config error: {e}") from None
    run(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0:  # one .hydra/ per run dir, written by rank 0; each rank its own log file
        sys.argv += ["hydra.output_subdir=null",
                     f"hydra.job_logging.handlers.file.filename=${{hydra.runtime.output_dir}}/train.rank{rank}.log"]
    main()
    shutdown_distributed()
