"""Export any training checkpoint as a serving drafter (config.json + model.safetensors), on CPU, offline.

    python launch/export.py checkpoint=outputs/run/checkpoints/step_001000 out=outputs/export_1000
    python launch/export.py checkpoint=outputs/run out=outputs/export   # the run's latest checkpoint
    python launch/export.py checkpoint=outputs/run/checkpoints/latest out=outputs/export   # the same (make export)

The result loads with its family's load_export (models/registry.py) and, for EAGLE-3, in vLLM/SGLang as LlamaForCausalLMEagle3.
"""

from omegaconf import OmegaConf

from launch.paths import CONF_DIR
from launch.errors import hydra_main
from train.config import ExportConfig, register_configs
from train.export import export_checkpoint

register_configs()


@hydra_main(config_path=str(CONF_DIR), config_name="export")
def main(raw) -> None:
    cfg: ExportConfig = OmegaConf.to_object(raw)
    out = export_checkpoint(cfg.checkpoint, cfg.out, cfg.max_position_embeddings)
    print(f"exported {cfg.checkpoint} -> {out}")


if __name__ == "__main__":
    main()
