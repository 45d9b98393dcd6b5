"""capture.engine=vllm against capture.engine=hf on the same rendered samples of the embedded target (fp32 both).

    python bench/vllm_capture.py --vllm-python .venv-vllm/bin/python [--samples 40] [--threads 2]

Renders `--samples` ShareGPT conversations (the dataset's own replies, the target's chat template), captures them
with the HF path (data_prep/capture.py: right-padded batches of prep's default capture.batch_tokens) and with
vLLM's hidden-state extraction (data_prep/vllm_capture.py stream_features: one engine, the CPU build), and writes
bench/results/vllm_capture.json (+ .png):

- per tap and for the teacher: max abs difference, and max relative difference (max abs difference over the
  largest magnitude of the HF side: SmolLM2 carries activations of ~2e4 in a few channels);
- argmax agreement of the logits the prep's target head (models/target_head.py) recomputes from each teacher;
- prep's fidelity checks on the first two samples: check_engine_fidelity (against the transformers forward,
  capture.vllm.fidelity=hf) and check_engine_head (the head on vLLM's teacher against vLLM's own top-1 at every
  position, from its prompt logprobs: the default, without a transformers target), and over every sample the
  share whose last position's head argmax is the token vLLM chose (`next_token_agreement`);
- throughput, tokens/s: HF capture (forward + hooks), vLLM capture (wall time from the engine's start-up end to
  the last file read back, i.e. engine + file round trip), vLLM engine alone (its generate calls); vLLM's
  start-up (engine and model load, enforce_eager) reported separately. Both on `--threads` cores (vLLM binds
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

from data_prep.strict_json import dumps

RESULTS = Path(__file__).resolve().parent / "results"
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
    from data_prep.targets import model_path
    from data_prep.vllm_capture import VLLMJob, engine_layer_ids, stream_features
    from data_prep.vllm_engine import EngineSpec, VLLMEngine

    spec = EngineSpec(python=python, model=model_path(preset), dtype="float32", max_model_len=max_len + 1,
                      layer_ids=engine_layer_ids(tap_layers, preset.num_layers),
                      engine_kwargs=ENGINE_KWARGS if engine_kwargs is None else engine_kwargs)
    got = {}
    start = time.perf_counter()
    with VLLMEngine(spec, work_dir / "engine", log_path=work_dir / "vllm_capture.log") as engine:
        engine.wait_ready()
        job = VLLMJob(engine=engine, tap_layers=tap_layers, num_layers=preset.num_layers,
                      hidden_size=preset.hidden_size, work_dir=work_dir / "vllm")
        probe = frozenset(s.conversation_id for s in samples[:PROBE])  # vLLM's top-1 at every position of these
        for key, taps, final, choice in stream_features(job, [(s.conversation_id, s.input_ids) for s in samples],
                                                        logprobs=probe):
            got[key] = (taps, final, choice)
        wall = time.perf_counter() - start
    return got, {"wall_s": wall, "startup_s": engine.startup_s, **job.stats}


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
    capture_s = vl_stats["wall_s"] - vl_stats.get("startup_s", 0.0)
    return {
        "target": TARGET, "dtype": "float32", "samples": len(samples), "tokens": tokens,
        "tap_layers": tap_layers, "vllm": vl_stats.get("vllm"),
        "taps": taps, "teacher": teacher, "argmax_agreement": same / total, "argmax_positions": total,
        "fidelity": fidelity, "engine_head_check": engine_head, "next_token_agreement": next_token / len(ids),
        "throughput_tokens_per_s": {"hf": tokens / hf_s, "vllm": tokens / capture_s,
                                    "vllm_engine_only": tokens / vl_stats["capture_s"]},
        "seconds": {"hf_capture": hf_s, "vllm_capture": capture_s, "vllm_engine": vl_stats["capture_s"],
                    "vllm_startup": vl_stats.get("startup_s")},
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
    b.bar(["HF", "vLLM", "vLLM engine only"], [tp["hf"], tp["vllm"], tp["vllm_engine_only"]],
          color=["tab:gray", "tab:blue", "tab:cyan"])
    b.set_ylabel("tokens/s")
    b.set_title(f"capture throughput (vLLM start-up {result['seconds']['vllm_startup']:.0f} s, excluded)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", required=True)
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "vllm_capture.json"))
    p.add_argument("--engine-only", metavar="ENGINE_KWARGS_JSON",
                   help="time only vLLM's capture with these vllm.LLM arguments (e.g. '{\"max_num_batched_tokens\": "
                        "2048}'), print its throughput, write nothing")
    args = p.parse_args()
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
        print(dumps({"engine_kwargs": kwargs, "tokens": tokens,
                     "capture_tokens_per_s": tokens / (stats["wall_s"] - stats["startup_s"]),
                     "engine_tokens_per_s": tokens / stats["capture_s"], "startup_s": stats["startup_s"]}))
        return
    with tempfile.TemporaryDirectory(prefix="vllm_capture.") as tmp:
        result = compare(samples, args.vllm_python, Path(tmp), args.max_len)
    result["threads"] = args.threads
    result["load_average_1min_at_end"] = os.getloadavg()[0]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(dumps({k: result[k] for k in ("taps", "teacher", "argmax_agreement", "throughput_tokens_per_s",
                                             "seconds", "vllm_over_hf")}, indent=1))


if __name__ == "__main__":
    main()
