"""capture.engine=vllm against capture.engine=hf on the same rendered samples of the embedded target (fp32 both).

    python bench/vllm_capture.py --vllm-python .venv-vllm/bin/python [--samples 40] [--threads 2]
    python bench/vllm_capture.py --vllm-python .venv-vllm/bin/python --prep   # the demo's whole prep, both routes

Renders `--samples` ShareGPT conversations (the dataset's own replies, the target's chat template), captures them
with the HF path (data_prep/capture.py: right-padded batches of prep's default capture.batch_tokens) and with
vLLM's hidden-state extraction (data_prep/vllm_capture.py stream_features: one engine, the CPU build), and writes
bench/results/vllm_capture.json (+ .png):

- per tap and for the teacher: max abs difference, and max relative difference (max abs difference over the
  largest magnitude of the HF side: SmolLM2 carries activations of ~2e4 in a few channels);
- argmax agreement of the logits the prep's target head (models/target_head.py) recomputes from each teacher;
- prep's fidelity checks on the first two samples: check_engine_fidelity (against the transformers forward,
  vllm.capture_fidelity=hf) and check_engine_head (the head on vLLM's teacher against vLLM's own top-1 at every
  position, from its prompt logprobs: the default, without a transformers target), and over every sample the
  share whose last position's head argmax is the token vLLM chose (`next_token_agreement`);
- throughput, tokens/s: HF capture (forward + hooks), vLLM capture (wall time from the server's health to the
  last file read back: the server, HTTP and the file round trip, vllm.max_in_flight requests in flight); vLLM's
  start-up (server and model load, enforce_eager) reported separately. Both on `--threads` cores (vLLM binds
  its OpenMP threads to the cores it finds; HF torch.set_num_threads).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from infra.strict_json import dumps

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PROBE = 2  # samples checked as prep checks its probe batch
ENGINE_KWARGS = {"enforce_eager": True}
TARGET = "smollm2-135m-instruct"


def rendered_samples(num: int = 40, max_len: int = 1024, data: str = "sharegpt-embedded") -> list:
    """The first `num` conversations of `data` that render under the target's chat template (their own replies)."""
    from data_prep.chat import Dropped, render_conversation
    from data_prep.conversations import load_conversations
    from data_prep.rendered import Rendered
    from data_prep.targets import load_tokenizer, resolve_target

    tok = load_tokenizer(resolve_target(TARGET))
    convs, _ = load_conversations(data, max_records=num * 3)
    out = []
    for c in convs:
        r = render_conversation(tok, c.messages, max_len=max_len)
        if not isinstance(r, Dropped):
            out.append(Rendered(c.id, torch.tensor(r.input_ids), torch.tensor(r.loss_mask, dtype=torch.bool)))
        if len(out) == num:
            break
    return out


def _hf_capture(model, head, tap_layers, samples, batch_tokens: int = 8192) -> tuple[dict, float]:
    from data_prep.capture import HiddenStateCapture, capture_samples
    from data_prep.pipeline import length_batches
    from data_prep.shards import ShardSpec

    spec = ShardSpec(target={"hidden_size": head.lm_head.in_features, "vocab_size": head.lm_head.out_features},
                     tap_layers=tap_layers)
    got = {}
    with HiddenStateCapture(model, tap_layers) as capture:
        start = time.perf_counter()
        for batch in length_batches(samples, batch_tokens):
            for s in capture_samples(capture, head, spec, batch, "cpu"):
                got[s.sample_id] = (s.taps, s.teacher_hidden)
        seconds = time.perf_counter() - start
    return got, seconds


def _vllm_capture(python: str, preset, tap_layers, samples, work_dir: Path, max_len: int,
                  engine_kwargs: dict | None = None) -> tuple[dict, dict]:
    from data_prep.config import VLLMConfig
    from data_prep.targets import model_path
    from data_prep.vllm_capture import stream_features
    from serving.client import VLLM_PLUGIN, ServerSpec, VLLMClient
    from serving.server import check_vllm
    from serving.states import engine_layer_ids

    spec = ServerSpec(model=model_path(preset), dtype="float32", max_model_len=max_len + 1,
                      hidden_size=preset.hidden_size, layer_ids=engine_layer_ids(tap_layers, preset.num_layers),
                      engine_kwargs=ENGINE_KWARGS if engine_kwargs is None else engine_kwargs)
    cfg = VLLMConfig(scratch_dir=str(work_dir))
    got = {}
    start = time.perf_counter()
    with VLLMClient(spec, cfg, python=python, cuda=bool(check_vllm(python, VLLM_PLUGIN).get("cuda")), rank=0,
                    local_rank=0, log_path=work_dir / "vllm_capture.log") as client:
        startup = client.wait_ready()
        capture_start = time.perf_counter()
        probe = frozenset(s.conversation_id for s in samples[:PROBE])  # vLLM's top-1 at every position of these
        for key, taps, final, choice in stream_features(client, tap_layers, preset.num_layers, preset.hidden_size,
                                                        [(s.conversation_id, s.input_ids) for s in samples],
                                                        logprobs=probe):
            got[key] = (taps, final, choice)
        capture_s = time.perf_counter() - capture_start
        wall = time.perf_counter() - start
    return got, {"wall_s": wall, "startup_s": startup, "capture_s": capture_s}


def _diff(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> dict:
    a, b = torch.cat(ours).float(), torch.cat(ref).float()
    abs_diff = float((a - b).abs().max())
    scale = float(b.abs().max())
    return {"max_abs_diff": abs_diff, "max_abs_reference": scale, "max_rel_diff": abs_diff / scale,
            "mean_abs_diff": float((a - b).abs().mean())}


@torch.no_grad()
def compare(samples: list, python: str, work_dir: Path, max_len: int = 1024) -> dict:
    """Both captures of `samples` and every difference (module docstring); the result dict the JSON holds."""
    from data_prep.fidelity import check_engine_fidelity, check_engine_head
    from data_prep.targets import load_target, resolve_target
    from models.target_head import TargetHead

    preset = resolve_target(TARGET)
    tap_layers = list(preset.tap_layers)
    model, _ = load_target(preset, "float32", "cpu")
    head = TargetHead.from_hf_model(model)
    hf, hf_s = _hf_capture(model, head, tap_layers, samples)
    vl, vl_stats = _vllm_capture(python, preset, tap_layers, samples, work_dir, max_len)
    ids = [s.conversation_id for s in samples]
    hidden = preset.hidden_size
    taps = {}
    for j, layer in enumerate(tap_layers):
        cols = slice(j * hidden, (j + 1) * hidden)
        taps[f"tap {layer}"] = _diff([vl[i][0][:, cols] for i in ids], [hf[i][0][:, cols] for i in ids])
    teacher = _diff([vl[i][1] for i in ids], [hf[i][1] for i in ids])
    same = total = 0
    for i in ids:
        a, b = head.logits(vl[i][1]).argmax(-1), head.logits(hf[i][1]).argmax(-1)
        same += int((a == b).sum())
        total += a.numel()
    probe = ids[:PROBE]
    fidelity = check_engine_fidelity(model, head, tap_layers, [s.input_ids for s in samples[:PROBE]],
                                     [vl[i][0] for i in probe], [vl[i][1] for i in probe])
    engine_head = check_engine_head(head, [s.input_ids for s in samples[:PROBE]], [vl[i][1] for i in probe],
                                    [vl[i][2] for i in probe])
    next_token = sum(int(head.logits(vl[i][1][-1:]).argmax(-1)[0]) == vl[i][2]["next_token"] for i in ids)
    tokens = sum(len(s.input_ids) for s in samples)
    capture_s = vl_stats["capture_s"]
    return {
        "target": TARGET, "dtype": "float32", "samples": len(samples), "tokens": tokens,
        "tap_layers": tap_layers, "vllm": vl_stats.get("vllm"),
        "taps": taps, "teacher": teacher, "argmax_agreement": same / total, "argmax_positions": total,
        "fidelity": fidelity, "engine_head_check": engine_head, "next_token_agreement": next_token / len(ids),
        "throughput_tokens_per_s": {"hf": tokens / hf_s, "vllm": tokens / capture_s},
        "seconds": {"hf_capture": hf_s, "vllm_capture": capture_s, "vllm_startup": vl_stats.get("startup_s")},
        "vllm_over_hf": (tokens / capture_s) / (tokens / hf_s),
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [*result["taps"], "teacher"]
    rel = [*(d["max_rel_diff"] for d in result["taps"].values()), result["teacher"]["max_rel_diff"]]
    a.bar(names, rel, color="tab:blue")
    a.set_yscale("log")
    a.set_ylabel("max |vLLM - HF| / max |HF|")
    a.set_title(f"vLLM vs HF capture, fp32 ({result['tokens']} tokens)\nargmax agreement "
                f"{result['argmax_agreement']:.4f}")
    tp = result["throughput_tokens_per_s"]
    b.bar(["HF", "vLLM server"], [tp["hf"], tp["vllm"]],
          color=["tab:gray", "tab:blue", "tab:cyan"])
    b.set_ylabel("tokens/s")
    b.set_title(f"capture throughput (vLLM start-up {result['seconds']['vllm_startup']:.0f} s, excluded)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _reply_tokens(prep: Path, tokenizer) -> tuple[int, dict[str, list]]:
    """Reply tokens regenerated in a prep (the generated ids where kept, else the reply re-encoded) and each
    conversation's assistant replies."""
    from data_prep.regenerate import read_results

    tokens, replies = 0, {}
    for path in sorted((prep / "regen").glob("*.jsonl")):
        for cid, rec in read_results(path).items():
            mine = [m for m in rec["messages"] if m["role"] == "assistant"]
            replies[cid] = [m["content"] for m in mine]
            tokens += sum(len(m.get("token_ids") or tokenizer(m["content"], add_special_tokens=False)["input_ids"])
                          for m in mine)
    return tokens, replies


def prep_engines(vllm_python: str, out_json: Path, work: Path) -> dict:
    """The demo's prep (`make prep ARGS=max_len=1024`, the embedded target, 200 conversations) twice, one after
    the other: the transformers route (2 ranks: HF generate, HF capture) and prep's vLLM engine (1 rank, both
    cores: one engine regenerates, then captures). Wall time of each `make prep`, its regeneration and capture
    seconds, reply tokens per regeneration second, and how many replies are identical."""
    import subprocess

    from data_prep.targets import load_tokenizer, resolve_target

    routes = {
        # the demo's own vLLM prep (the Makefile's DEMO_PREP_ARGS and DEMO_VLLM_ARGS)
        "vllm": ["NPROC=1", "OMP_NUM_THREADS=2", "VLLM_CPU_NUM_OF_RESERVED_CPU=0", "VLLM_CPU_KVCACHE_SPACE=6",
                 f"ARGS=max_len=1024 regen.backend=vllm regen.batch_size=256 capture.engine=vllm "
                 f"vllm.python={vllm_python} +vllm.engine_kwargs.enforce_eager=true"],
        "hf": ["NPROC=2", "ARGS=max_len=1024"],
    }
    tok = load_tokenizer(resolve_target(TARGET))
    result: dict = {"what": "make prep of the demo (embedded target, 200 ShareGPT conversations, max_len 1024, "
                            "greedy replies of <= 256 tokens, fp32) on each route, one after the other, nothing "
                            "else running; regen_s: the slowest rank's regeneration seconds; reply tokens per "
                            "regeneration second over the ranks together", "routes": {}}
    replies = {}
    for name, args in routes.items():
        prep = work / name
        start = time.perf_counter()
        done = subprocess.run(["make", "prep", f"PREP_DIR={prep}", *args], cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"make prep ({name}) failed: {done.stderr[-2000:]}")
        summary = json.loads((prep / "summary.json").read_text())
        regen_s = max(sum(split["elapsed_s"] for split in part.values()) for part in summary["regen"])
        tokens, replies[name] = _reply_tokens(prep, tok)
        shown = " ".join(args).replace(vllm_python, os.path.relpath(vllm_python, ROOT))  # no machine paths
        result["routes"][name] = {"command": f"make prep {shown}", "wall_s": wall, "regen_s": regen_s,
                                  "reply_tokens": tokens, "reply_tokens_per_regen_s": tokens / regen_s,
                                  "capture_tokens_per_s": summary["capture_tokens_per_s"], "samples": summary["samples"],
                                  "tokens": summary["tokens"]}
        print(name, dumps(result["routes"][name]))
    common = set(replies["hf"]) & set(replies["vllm"])
    result["replies_identical"] = {"count": sum(replies["hf"][c] == replies["vllm"][c] for c in common),
                                   "of": len(common)}
    r = result["routes"]
    result["vllm_over_hf"] = {"wall": r["vllm"]["wall_s"] / r["hf"]["wall_s"],
                              "regen_s": r["vllm"]["regen_s"] / r["hf"]["regen_s"]}
    out_json.write_text(dumps(result, indent=1))
    print(dumps({k: result[k] for k in ("replies_identical", "vllm_over_hf")}))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "vllm_capture.json"))
    p.add_argument("--engine-only", metavar="ENGINE_KWARGS_JSON",
                   help="time only vLLM's capture with these engine arguments of vllm serve (e.g. '{\"max_num_batched_tokens\": "
                        "2048}'), print its throughput, write nothing")
    p.add_argument("--prep", action="store_true",
                   help="the demo's whole make prep on the transformers route and on prep's vLLM engine (one engine "
                        "regenerates and captures), side by side: bench/results/prep_engines.json")
    args = p.parse_args()
    # vLLM's CPU build keeps one core for its API server unless told otherwise: on 2 cores that halves the model's
    # share; both sides get both cores (HF: torch threads)
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if args.prep:
        with tempfile.TemporaryDirectory(prefix="prep_engines.") as tmp:
            # absolute, not resolved: a venv's python is a link to the base interpreter, which lacks vLLM
            prep_engines(str(Path(args.vllm_python).absolute()), RESULTS / "prep_engines.json", Path(tmp))
        return
    torch.set_num_threads(args.threads)
    samples = rendered_samples(args.samples, args.max_len)
    if args.engine_only is not None:
        from data_prep.targets import resolve_target

        preset = resolve_target(TARGET)
        kwargs = json.loads(args.engine_only)
        with tempfile.TemporaryDirectory(prefix="vllm_capture.") as tmp:
            _, stats = _vllm_capture(args.vllm_python, preset, list(preset.tap_layers), samples, Path(tmp),
                                     args.max_len, kwargs)
        tokens = sum(len(s.input_ids) for s in samples)
        print(dumps({"engine_kwargs": kwargs, "tokens": tokens, "capture_tokens_per_s": tokens / stats["capture_s"],
                     "startup_s": stats["startup_s"]}))
        return
    with tempfile.TemporaryDirectory(prefix="vllm_capture.") as tmp:
        result = compare(samples, args.vllm_python, Path(tmp), args.max_len)
    result["threads"] = args.threads
    result["vllm_cpu_num_of_reserved_cpu"] = os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"]
    from data_prep.config import VLLMConfig

    result["vllm_max_in_flight"] = VLLMConfig().max_in_flight
    result["load_average_1min_at_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(dumps({k: result[k] for k in ("taps", "teacher", "argmax_agreement", "throughput_tokens_per_s",
                                             "seconds", "vllm_over_hf")}, indent=1))


if __name__ == "__main__":
    main()
