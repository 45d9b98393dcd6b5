"""Export any training checkpoint as a serving drafter (config.json + model.safetensors), on CPU, offline.

    python launch/export.py checkpoint=outputs/run/checkpoints/step_001000 out=outputs/export_1000
    python launch/export.py checkpoint=outputs/run out=outputs/export   # the run's latest checkpoint

The result loads with models.export.load_export and in vLLM/SGLang as LlamaForCausalLMEagle3.
"""

import os
import sys

# This script's directory comes first on sys.path, where launch/train.py would shadow the `train` package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]

import hydra  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from train.config import ExportConfig, register_configs  # noqa: E402
from train.export import export_checkpoint  # noqa: E402

register_configs()


@hydra.main(config_path="../conf", config_name="export", version_base="1.3")
def main(raw) -> None:
    cfg: ExportConfig = OmegaConf.to_object(raw)
    out = export_checkpoint(cfg.checkpoint, cfg.out, cfg.max_position_embeddings)
    print(f"exported {cfg.checkpoint} -> {out}")


if __name__ == "__main__":
    main()
