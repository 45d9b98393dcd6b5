"""The closing summary of `make demo`: what each stage produced, the measured numbers, where things lie.

    python launch/demo_summary.py <prep_dir> <run_dir>
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from launch.paths import CONF_DIR  # noqa: F401  (first: takes launch/ off sys.path)
from data_prep.shards import PREP_SUMMARY
from eval.run import REPORT_FILE, format_summary
from train.metrics import RUN_SUMMARY


def main(prep_dir: str, run_dir: str) -> None:
    prep, run = Path(prep_dir), Path(run_dir)
    prep_summary = json.loads((prep / PREP_SUMMARY).read_text())
    train_summary = json.loads((run / RUN_SUMMARY).read_text())
    report = json.loads((run / "eval" / REPORT_FILE).read_text())
    held_out = train_summary.get("eval") or {}
    print("\n================ demo summary ================")
    print(f"prep   {prep_summary['samples']['train']} train / {prep_summary['samples']['eval']} held-out samples, "
          f"{prep_summary['tokens']['train']} train tokens, draft vocab {prep_summary['draft_vocab_size']}  → {prep}")
    print(f"train  {train_summary['steps']} steps on {train_summary['world_size']} processes "
          f"(ZeRO-{train_summary['zero_stage']}, K={train_summary['ttt_steps']}) in {train_summary['wall_s']:.0f} s; "
          f"held-out simulated τ {held_out.get('sim_tau', float('nan')):.3f} (a target outside the draft vocab is a miss; "
          f"{held_out.get('oov_rate', float('nan')):.1%} of them are)  → {run}")
    print(f"export {run / 'export'} (LlamaForCausalLMEagle3: config.json + model.safetensors)")
    print(format_summary(report))
    print(f"plots  {run / 'eval' / 'per_position_acceptance.png'}, {run / 'eval' / 'accept_length_histogram.png'}")
    print(f"report {run / 'eval' / 'report.json'}; training metrics {run / 'metrics.jsonl'}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
