"""Evaluate an exported EAGLE-3 drafter: speculative vs plain decoding of the target on prompts.

    python launch/eval.py drafter=outputs/export target=smollm2-135m-instruct prompts=all \
        out_dir=outputs/eval decode.mode=tree decode.temperature=0 decode.max_new_tokens=128 decode.num_prompts=2

Writes <out_dir>/report.json (τ pooled and per request, per suite and category with intervals, α_n, tokens/s,
speedup, samples), categories.md and PNG plots; engine=vllm puts vLLM's own figures beside ours (eval/engine.py).
Schema: eval/config.py (EvalConfig); decoding: eval/spec_decode.py.
"""

from omegaconf import OmegaConf

from launch.paths import CONF_DIR
from eval.config import EvalConfig, register_configs
from eval.run import format_summary, run_eval
from launch.errors import hydra_main

register_configs()


@hydra_main(config_path=str(CONF_DIR / "eval"), config_name="eval")
def main(raw) -> None:
    cfg: EvalConfig = OmegaConf.to_object(raw)
    report = run_eval(cfg)
    print(format_summary(report))
    print(f"report: {cfg.out_dir}/report.json")


if __name__ == "__main__":
    main()
