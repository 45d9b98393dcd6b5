"""Evaluate an exported EAGLE-3 drafter: speculative vs plain decoding of the target on prompts.

    python launch/eval.py drafter=outputs/export target=smollm2-135m-instruct prompts=mtbench \
        out_dir=outputs/eval decode.mode=tree decode.temperature=0 decode.max_new_tokens=128 decode.num_prompts=8

Writes <out_dir>/report.json (τ pooled and per request, α_n, tokens/s, speedup, samples) and PNG plots.
Schema: eval/config.py (EvalConfig); decoding: eval/spec_decode.py.
"""

import sys
from pathlib import Path

# Run as a script, this file's folder is sys.path[0] and this very file would shadow the `eval` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import hydra  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from eval.config import EvalConfig, register_configs  # noqa: E402
from eval.run import format_summary, run_eval  # noqa: E402

register_configs()


@hydra.main(config_path="../conf/eval", config_name="eval", version_base="1.3")
def main(raw) -> None:
    cfg: EvalConfig = OmegaConf.to_object(raw)
    report = run_eval(cfg)
    print(format_summary(report))
    print(f"report: {cfg.out_dir}/report.json")


if __name__ == "__main__":
    main()
