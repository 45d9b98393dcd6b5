"""Stand-in for the vLLM side of prep's vLLM engine (data_prep/vllm_worker.py) where no vLLM is installed: the same
command line and job protocol (the worker's own `serve` loop), generate jobs answered by transformers' greedy
generate, capture files in the hidden-states connector's layout (`hidden_states` [T, n_ids, H] for vLLM's aux
layer ids, ascending: id k = the output of decoder layer k-1, id num_layers before the final norm; `token_ids`
[T]), computed by a transformers forward of the target. It lets `make test` run the project side (the engine
session, regeneration, reading, mapping, checks, shard writing, resume) without vLLM; the real engine is
tests/test_prep_capture_vllm.py's opt-in test.

    standin -m data_prep.vllm_worker --check | --serve DIR

Environment: STANDIN_VERSION (what --check reports, default the version the route needs), STANDIN_FAIL_AFTER=n
(exit 3 after n files: a crash mid-capture), STANDIN_LOG (append the ids asked for, one per line, and
"engine <pid>" for each engine built, "generate <n>" for each generate job), STANDIN_BAD_TOKENS=1 (write the
wrong token ids in every file), STANDIN_OTHER_HEAD=1 (report next-token choices that are not the target head's:
the engine-side fidelity check must refuse them). Each index line carries the engine's greedy next token, and for
a sample marked "logprobs" its top-1 at every position, as the worker's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from data_prep.vllm_worker import INDEX, MIN_VLLM, serve


def log(line: str) -> None:
    if os.environ.get("STANDIN_LOG"):
        with open(os.environ["STANDIN_LOG"], "a") as f:
            f.write(line + "\n")


class StandinEngine:
    def __init__(self, spec: dict, control: Path):
        log(f"engine {os.getpid()} layers {spec['layer_ids']}")
        self.spec = spec
        self.model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"])).eval()
        self.seen: dict = {}
        self.model.model.norm.register_forward_pre_hook(lambda _m, args: self.seen.__setitem__("norm_in", args[0]))

    @torch.no_grad()
    def generate(self, job: dict) -> dict:
        log(f"generate {len(job['prompts'])}")
        stop = list(job["stop_token_ids"])
        outputs = []
        for prompt in job["prompts"]:
            ids = torch.tensor([prompt])
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=job["max_tokens"], eos_token_id=stop, pad_token_id=stop[0])
            new = out[0, len(prompt):].tolist()
            end = next((j for j, t in enumerate(new) if t in stop), None)
            outputs.append({"token_ids": new if end is None else new[: end + 1],
                            "finish_reason": "length" if end is None else "stop"})
        return {"outputs": outputs}

    @torch.no_grad()
    def capture(self, job: dict) -> dict:
        if not self.spec["layer_ids"]:
            raise RuntimeError("this engine was built without layer ids: it cannot capture hidden states")
        out = Path(job["out_dir"])
        out.mkdir(parents=True, exist_ok=True)
        samples = [json.loads(line) for line in Path(job["samples_file"]).read_text().splitlines() if line]
        for s in samples:
            log(s["id"])
        num_layers = self.model.config.num_hidden_layers
        fail_after = int(os.environ.get("STANDIN_FAIL_AFTER", -1))
        with open(out / INDEX, "a") as index:
            for n, s in enumerate(samples):
                if n == fail_after:
                    os._exit(3)
                ids = torch.tensor(s["input_ids"])
                out_ = self.model(input_ids=ids[None], output_hidden_states=True)
                hs = out_.hidden_states
                logp = out_.logits[0].float().log_softmax(-1)
                if os.environ.get("STANDIN_OTHER_HEAD"):  # an engine whose own logits are not the prep head's
                    logp = logp.roll(1, dims=-1)
                top = logp.max(-1)
                choice = {"next_token": int(top.indices[-1]), "next_logprob": float(top.values[-1])}
                if s.get("logprobs"):
                    choice.update(top1=top.indices.tolist(), top1_logprob=top.values.tolist())
                states = [hs[k][0] if k < num_layers else self.seen["norm_in"][0] for k in self.spec["layer_ids"]]
                if os.environ.get("STANDIN_BAD_TOKENS"):
                    ids = ids + 1
                name = f"{n:08d}.safetensors"
                save_file({"hidden_states": torch.stack(states, dim=1).contiguous(), "token_ids": ids},
                          str(out / (name + ".tmp")))
                os.replace(out / (name + ".tmp"), out / name)
                index.write(json.dumps({"id": s["id"], "file": name, "tokens": len(ids), **choice}) + "\n")
                index.flush()
            done = {"done": True, "samples": len(samples), "capture_s": 0.0}
            index.write(json.dumps(done) + "\n")
        return done


def main(argv: list[str]) -> int:
    if "--check" in argv:
        version = os.environ.get("STANDIN_VERSION", MIN_VLLM)
        ok = tuple(map(int, version.split("."))) >= tuple(map(int, MIN_VLLM.split(".")))
        print(json.dumps({"ok": ok, "version": version, "needed": MIN_VLLM,
                          "reason": "" if ok else f"vLLM {version} is older than {MIN_VLLM}"}))
        return 0
    return serve(Path(argv[argv.index("--serve") + 1]), StandinEngine)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
