"""Stand-in for the vLLM side of capture.engine=vllm (data_prep/vllm_worker.py) where no vLLM is installed: the same
command line, request and output protocol, the files in the hidden-states connector's layout (`hidden_states`
[T, n_ids, H] for vLLM's aux layer ids, ascending: id k = the output of decoder layer k-1, id num_layers before
the final norm; `token_ids` [T]), computed by a transformers forward of the target. It lets `make test` run the
project side (reading, mapping, checks, shard writing, resume) without vLLM; the real engine is
tests/test_prep_capture_vllm.py's opt-in test.

    standin -m data_prep.vllm_worker --check | --request req.json

Environment: STANDIN_VERSION (what --check reports, default the version the route needs), STANDIN_FAIL_AFTER=n
(exit 3 after n files: a crash mid-capture), STANDIN_LOG (append the ids asked for, one per line),
STANDIN_BAD_TOKENS=1 (write the wrong token ids in every file), STANDIN_OTHER_HEAD=1 (report next-token choices
that are not the target head's: the engine-side fidelity check must refuse them). Each index line carries the
engine's greedy next token, and for a sample marked "logprobs" its top-1 at every position, as the worker's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from data_prep.vllm_worker import INDEX, MIN_VLLM


def main(argv: list[str]) -> int:
    if "--check" in argv:
        version = os.environ.get("STANDIN_VERSION", MIN_VLLM)
        ok = tuple(map(int, version.split("."))) >= tuple(map(int, MIN_VLLM.split(".")))
        print(json.dumps({"ok": ok, "version": version, "needed": MIN_VLLM,
                          "reason": "" if ok else f"vLLM {version} is older than {MIN_VLLM}"}))
        return 0
    req = json.loads(Path(argv[argv.index("--request") + 1]).read_text())
    out = Path(req["out_dir"])
    out.mkdir(parents=True, exist_ok=True)
    samples = [json.loads(line) for line in Path(req["samples_file"]).read_text().splitlines() if line]
    if os.environ.get("STANDIN_LOG"):
        with open(os.environ["STANDIN_LOG"], "a") as f:
            f.write("".join(s["id"] + "\n" for s in samples))
    model = AutoModelForCausalLM.from_pretrained(req["model"], dtype=getattr(torch, req["dtype"])).eval()
    num_layers = model.config.num_hidden_layers
    seen = {}
    model.model.norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("norm_in", args[0]))
    fail_after = int(os.environ.get("STANDIN_FAIL_AFTER", -1))
    with open(out / INDEX, "a") as index:
        for n, s in enumerate(samples):
            if n == fail_after:
                return 3
            ids = torch.tensor(s["input_ids"])
            with torch.no_grad():
                out_ = model(input_ids=ids[None], output_hidden_states=True)
                hs = out_.hidden_states
            logp = out_.logits[0].float().log_softmax(-1)
            if os.environ.get("STANDIN_OTHER_HEAD"):  # an engine whose own logits are not the prep head's
                logp = logp.roll(1, dims=-1)
            top = logp.max(-1)
            choice = {"next_token": int(top.indices[-1]), "next_logprob": float(top.values[-1])}
            if s.get("logprobs"):
                choice.update(top1=top.indices.tolist(), top1_logprob=top.values.tolist())
            states = [hs[k][0] if k < num_layers else seen["norm_in"][0] for k in req["layer_ids"]]
            if os.environ.get("STANDIN_BAD_TOKENS"):
                ids = ids + 1
            name = f"{n:08d}.safetensors"
            save_file({"hidden_states": torch.stack(states, dim=1).contiguous(), "token_ids": ids},
                      str(out / (name + ".tmp")))
            os.replace(out / (name + ".tmp"), out / name)
            index.write(json.dumps({"id": s["id"], "file": name, "tokens": len(ids), **choice}) + "\n")
            index.flush()
        index.write(json.dumps({"done": True, "samples": len(samples), "startup_s": 0.0, "capture_s": 0.0}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
