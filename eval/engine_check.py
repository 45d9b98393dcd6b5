"""Serve our exported drafter in a real vLLM and compare its acceptance with our own evaluator's.

    python -m eval.engine_check --vllm-python <venv>/bin/python --drafter <export dir> [--k 3] [--prompts 10]

vLLM lives in its OWN virtual environment (it pins its own torch; `make engine-check` builds it). This
starts `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 with the target and
`--speculative-config {"method": <the family table's vllm_method: eagle3>, "model": <export>, ...}`, sends the
evaluation prompts greedily (token ids rendered with the target's chat template, as our evaluator does),
reads the `vllm:spec_decode_*` counters from /metrics, and prints vLLM's mean acceptance length and
per-position acceptance. Compare with `launch/eval.py decode.mode=chain decode.depth=K` on the same prompts.
The server is started, checked and stopped by infra/vllm_server.py (`vllm_server`), as prep's are.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from data_prep.chat import render_prompt
from data_prep.targets import load_tokenizer, model_path, resolve_target
from eval.prompts import load_prompts
from infra.strict_json import dumps
from infra.vllm_server import VLLMServerError, http_get, http_post_json, vllm_server


def spec_counters(metrics_text: str) -> dict:
    """Sum the vllm:spec_decode_* counters (all label sets) and the per-position accepted counts."""
    out: dict = {"per_pos": {}}
    for line in metrics_text.splitlines():
        m = re.match(r"vllm:spec_decode_(\w+?)(?:_total)?(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pos = int(re.search(r'position="(\d+)"', labels).group(1))
            out["per_pos"][pos] = out["per_pos"].get(pos, 0.0) + value
        else:
            out[name] = out.get(name, 0.0) + value
    return out


def check_export(drafter: str, preset, tokenizer) -> str:
    """Before vLLM starts: an export with non-finite weights, of a family this check does not serve, or trained
    for another target, stops the check with its reason (exit status 2, as launch/errors.py gives a user error),
    as our evaluator refuses it (eval/run.py). Returns vLLM's speculative method for it (the family table's)."""
    from data_prep.targets import load_target_config
    from eval.target import target_fingerprint
    from models.export import CONFIG_FILE, TARGET_KEY, ExportError, check_tap_layers, check_target
    from models.export import read_weights as read_export_weights
    from models.registry import FAMILIES, family_of_export

    try:
        read_export_weights(Path(drafter))
        raw = json.loads((Path(drafter) / CONFIG_FILE).read_text())
        fam = family_of_export(raw)
        if fam.vllm_method is None:
            served = [f.label for f in FAMILIES.values() if f.vllm_method]
            raise ExportError(f"drafter {drafter} is a {fam.label} export; this vLLM check serves {served}")
        actual = target_fingerprint(load_target_config(preset), tokenizer, preset.name)
        check_target(raw.get(TARGET_KEY), actual, f"drafter {drafter}", f"target {preset.name}")
        # the layer ids vLLM will tap: in range for this target, and the ones the drafter was trained on
        cfg = fam.config_cls.from_hf_dict(raw, target_num_layers=actual["num_layers"])
        check_tap_layers(raw.get(TARGET_KEY), cfg.tap_layers, f"drafter {drafter}")
    except (ExportError, ValueError) as e:  # ValueError: a config.json vLLM's loader cannot take either
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None  # the user-error status of every launcher (launch/errors.py)
    return fam.vllm_method


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--prompts", default="mtbench")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    preset = resolve_target(args.target)
    tokenizer = load_tokenizer(preset)
    method = check_export(args.drafter, preset, tokenizer)
    records = load_prompts(args.prompts, limit=args.num_prompts)
    prompts = [render_prompt(tokenizer, r.messages(0, [])) for r in records]
    spec = {"method": method, "model": str(Path(args.drafter).resolve()), "num_speculative_tokens": args.k}
    log = Path(args.out).with_suffix(".vllm.log") if args.out else None
    try:
        with vllm_server(args.vllm_python, model_path(preset), log_path=log or Path(tempfile.gettempdir()) / "engine_check.vllm.log",
                         extra_args=["--speculative-config", dumps(spec)]) as base:
            before = spec_counters(http_get(base + "/metrics"))
            for ids in prompts:
                http_post_json(base + "/v1/completions", {"model": model_path(preset), "prompt": ids,
                                                 "max_tokens": args.max_new_tokens, "temperature": 0.0})
            after = spec_counters(http_get(base + "/metrics"))
    except VLLMServerError as err:
        sys.exit(str(err))
    drafts = after.get("num_drafts", 0) - before.get("num_drafts", 0)
    accepted = after.get("num_accepted_tokens", 0) - before.get("num_accepted_tokens", 0)
    per_pos = [(after["per_pos"].get(i, 0) - before["per_pos"].get(i, 0)) / max(drafts, 1) for i in range(args.k)]
    # vLLM's per-position numbers are P(accepted at i); ours are conditional on all before accepted.
    conditional = [per_pos[0]] + [per_pos[i] / per_pos[i - 1] if per_pos[i - 1] else None for i in range(1, args.k)]
    result = {"engine": "vllm", "k": args.k, "num_prompts": len(prompts), "drafts": drafts, "accepted": accepted,
              "mean_acceptance_length": 1 + accepted / max(drafts, 1), "accepted_per_position": per_pos,
              "conditional_acceptance": conditional}
    print(dumps(result))
    if args.out:
        Path(args.out).write_text(dumps(result, indent=1))


if __name__ == "__main__":
    main()
