#!/usr/bin/env python
"""Speculative decoding's speed on this machine: where a cycle's time goes, what the target's matrix products cost
against the tokens, and our decoder against plain decoding and transformers' prompt lookup (the same export served by
vLLM: `launch/eval.py engine=vllm`, docs/evaluation.md). One subcommand per measurement; nothing else may share the
machine while one runs.

    python bench/decode_profile.py profile --drafter outputs/runs/demo/export [--threads 2 --context 256 --prompts 1]
    python bench/decode_profile.py gemm [--target smollm2-135m-instruct --threads 2 --repeats 7]
    python bench/decode_profile.py speed --drafter outputs/runs/demo/export [--num-prompts 2 --temperatures 0,1]

`profile` (bench/results/decode_profile_<name>.{json,png}), in ONE process on the decoder's own code paths:
1. target forward seconds against the number of tokens t = 1..64 after a `--context`-token prefix, on the verify
   path (eval.target.TargetRunner.forward with a 4D tree mask and the taps), beside the same t tokens with no mask
   (causal) and without taps, and the plain-decoding step (1 token, no mask, no taps); the ratios to that plain
   step are what the tree budget m is chosen by (eval/budget.py);
2. the tree mask's construction (eval.tree.tree_attention_allowed + TargetRunner.tree_mask) per t;
3. one drafter step (forward_step + its log-probs over the draft vocabulary) against the number of nodes 1..64
   over the same prefix, as a fraction of the plain target step;
4. the operator breakdown (torch.profiler, self CPU time per op) of the plain step and of a 9-token verify;
5. with --prompts N > 0: speculative decoding runs (eval.run.run_eval, tree, T=0) over N MT-bench prompts per
   category, one per
   --budgets entry (fixed: m picked once by timing; adaptive: m per cycle by the cost model, whose predicted τ and
   speedup are reported beside the measured ones), each with its own plain baseline; each report splits the
   cycle's wall time by phase (GenerationRecord.phase_s).

`gemm` (bench/results/projection_gemm.json): what a verify of M tokens costs in the target's matrix products alone,
by GEMM path. The verify forward is mostly `aten::mm` (the profile's operator breakdown), so its cost against M is
set by how the BLAS handles a [M, in] x [in, out] product at small M. It times the target's own projections (every
decoder layer's q, k, v, o, gate, up, down at the sizes of the target's config; random weights, fp32) and its LM
head, at M = 1 ... 33, three ways: `linear` (nn.Linear as transformers calls it: the path the decoder runs),
`pretransposed` (W^T materialised contiguous [in, out]) and `onednn` (torch.utils.mkldnn's Linear, input and output
converted per call). Medians of --repeats passes over the whole stack.

`speed` (bench/results/spec_decode_speed.{json,png}): our speculative decoding side by side with plain decoding and
with transformers' prompt-lookup assisted decoding, at T=0 and T=1, in ONE process. One *pass* = one
`eval.run.run_eval` call (one speculative mode at one temperature) over the SAME first turns of the SAME MT-bench
prompts with the same max new tokens and seeds; inside a pass every prompt is decoded by each method back to back
(speculative, plain, and in the first pass of a temperature also `model.generate` with and without prompt lookup),
so machine noise hits them alike; every speedup is a ratio to the plain decoding of its own pass (docs/method.md
§6). Tree's verify budget m is picked once by timing the target (docs/method.md §3) in the first tree pass and
reused by the later ones. Sampling (T=1) uses eval's defaults top_p=1, top_k=0 and the lossless rules of
docs/method.md §1; prompt lookup at T=1 is transformers' assisted decoding with `do_sample=True`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from infra.strict_json import dumps

RESULTS = Path(__file__).resolve().parent / "results"
TOKENS = (1, 2, 3, 5, 9, 17, 33, 64)
GEMM_TOKENS = (1, 2, 3, 4, 5, 9, 17, 33)


# ------------------------------------------------------------------------------------------------ profile
def median_seconds(fn, repeats: int) -> float:
    fn()  # first call: allocations and kernel selection
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _target_forward(runner, cache, ids, pos, allowed, want_taps: bool) -> None:
    runner.forward(ids, cache, pos, allowed, want_taps=want_taps)
    cache.crop(-len(ids))  # back to the prefix


def _build_mask(runner, parents, context: int, pos) -> None:
    from eval.tree import tree_attention_allowed

    runner.tree_mask(tree_attention_allowed(parents, context), pos)


def target_costs(runner, context: int, repeats: int, vocab: int) -> dict:
    from eval.tree import tree_attention_allowed

    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (context,), generator=gen).tolist()
    cache = runner.new_cache()
    runner.forward(prefix, cache, want_taps=False)
    rows = []
    for t in TOKENS:
        ids = torch.randint(0, vocab, (t,), generator=gen)
        pos = torch.arange(context, context + t)
        parents = torch.arange(-1, t - 1)  # a chain: the mask a verify of t tokens builds, any shape costs alike
        allowed = tree_attention_allowed(parents, context)
        verify = partial(_target_forward, runner, cache, ids, pos, allowed, True)
        causal = partial(_target_forward, runner, cache, ids, pos, None, False)
        rows.append({"tokens": t, "verify_s": median_seconds(verify, repeats),
                     "causal_no_taps_s": median_seconds(causal, repeats),
                     "mask_build_s": median_seconds(partial(_build_mask, runner, parents, context, pos), repeats)})
    plain = next(r["causal_no_taps_s"] for r in rows if r["tokens"] == 1)
    for r in rows:
        r["verify_over_plain"] = r["verify_s"] / plain
        r["causal_over_plain"] = r["causal_no_taps_s"] / plain
    return {"plain_step_s": plain, "rows": rows}


@torch.no_grad()
def _drafter_step(drafter, cache, hidden, ids, pos, mask, context: int) -> None:
    out = drafter.forward_step(hidden, ids, pos, cache, attn_mask=mask)
    torch.log_softmax(drafter.compute_logits(out[0]).double(), dim=-1)
    cache.truncate(context)


def drafter_costs(drafter, context: int, repeats: int, vocab: int, plain_s: float) -> list[dict]:
    """One EAGLE drafter step over n nodes after a `context`-position DecodeCache (the tree's expansion)."""
    from models.attention import DecodeCache

    gen = torch.Generator().manual_seed(1)
    H = drafter.cfg.hidden_size
    prefix_ids = torch.randint(0, vocab, (1, context), generator=gen)
    taps = torch.randn(1, context, drafter.fc.in_features, generator=gen)
    cache = DecodeCache()
    with torch.no_grad():
        drafter.forward_step(drafter.fuse(taps), prefix_ids, torch.arange(context)[None], cache)
    rows = []
    for n in TOKENS:
        hidden = torch.randn(1, n, H, generator=gen)
        ids = torch.randint(0, vocab, (1, n), generator=gen)
        pos = torch.full((1, n), context, dtype=torch.long)
        mask = torch.ones(1, 1, n, context + n, dtype=torch.bool)
        s = median_seconds(partial(_drafter_step, drafter, cache, hidden, ids, pos, mask, context), repeats)
        rows.append({"nodes": n, "step_s": s, "over_plain_target_step": s / plain_s})
    return rows


def op_breakdown(runner, context: int, vocab: int, top: int = 12) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from eval.tree import tree_attention_allowed

    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, vocab, (context,), generator=gen).tolist()
    cache = runner.new_cache()
    runner.forward(prefix, cache, want_taps=False)
    out = {}
    for name, t, verify in (("plain_step", 1, False), ("verify_9", 9, True)):
        ids = torch.randint(0, vocab, (t,), generator=gen)
        pos = torch.arange(context, context + t)
        allowed = tree_attention_allowed(torch.arange(-1, t - 1), context) if verify else None
        for _ in range(2):  # warm
            runner.forward(ids, cache, pos, allowed, want_taps=verify)
            cache.crop(-t)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                runner.forward(ids, cache, pos, allowed, want_taps=verify)
                cache.crop(-t)
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) or 1.0
        out[name] = [{"op": e.key, "self_share": e.self_cpu_time_total / total, "calls": e.count // 3}
                     for e in events[:top]]
    return out


def cycle_profile(args: argparse.Namespace, budget: str) -> dict:
    from eval.config import DecodeConfig, EvalConfig
    from eval.run import run_eval

    with tempfile.TemporaryDirectory() as tmp:
        cfg = EvalConfig(drafter=args.drafter, target=args.target, out_dir=tmp, threads=args.threads,
                         decode=DecodeConfig(mode="tree", temperature=0.0, num_prompts=args.prompts,
                                             max_new_tokens=args.max_new_tokens, max_turns=1,
                                             auto_total_tokens=budget == "fixed", budget=budget))
        rep = run_eval(cfg, progress=False)
    keep = ("tau_pooled", "speedup", "tokens_per_s", "cycle_time_share", "outputs_identical_to_baseline",
            "adaptive_budget")
    return {**{k: rep.get(k) for k in keep}, "budget": budget, "total_tokens": rep["decode"]["total_tokens"],
            "depth": rep["decode"]["depth"]}


def plot_profile(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if result.get("cycles") else 2
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 3.8))
    rows = result["target"]["rows"]
    ts = [r["tokens"] for r in rows]
    ax = axes[0]
    ax.plot(ts, [r["verify_over_plain"] for r in rows], marker="o", label="verify (tree mask + taps)")
    ax.plot(ts, [r["causal_over_plain"] for r in rows], marker="s", label="causal, no taps")
    ax.axhline(1.2, ls="--", color="grey", lw=0.8, label="1.2 × plain step")
    ax.set(xscale="log", xlabel="tokens in the forward", ylabel="time / plain 1-token step",
           title=f"target (plain step {1e3 * result['target']['plain_step_s']:.1f} ms)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    d = result["drafter"]
    ax.plot([r["nodes"] for r in d], [r["over_plain_target_step"] for r in d], marker="o")
    ax.axhline(0.1, ls="--", color="grey", lw=0.8, label="10% of a target step")
    ax.set(xscale="log", xlabel="drafter nodes in one step", ylabel="time / plain target step", title="drafter step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    if panels == 3:
        ax = axes[2]
        width = 0.8 / len(result["cycles"])
        for i, cyc in enumerate(result["cycles"]):
            share = cyc["cycle_time_share"]
            ax.bar([j + i * width for j in range(len(share))], [100 * v for v in share.values()], width,
                   label=f"{cyc['budget']}: τ {cyc['tau_pooled']:.2f}, ×{cyc['speedup']:.2f}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(share))], list(share))
        ax.set(ylabel="% of speculative wall time", title="cycle phases")
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_profile(args: argparse.Namespace) -> dict:
    from data_prep.targets import load_target, resolve_target
    from eval.run import load_drafter
    from eval.target import TargetRunner

    torch.set_num_threads(args.threads)
    model, _ = load_target(resolve_target(args.target), device="cpu")
    drafter = load_drafter(args.drafter, model, "cpu", next(model.parameters()).dtype)
    runner = TargetRunner(model, drafter.tap_layers)
    vocab = int(model.config.get_text_config().vocab_size)
    result: dict = {"threads": args.threads, "context": args.context, "dtype": str(next(model.parameters()).dtype),
                    "torch": torch.__version__}
    result["target"] = target_costs(runner, args.context, args.repeats, vocab)
    result["drafter"] = drafter_costs(drafter, args.context, args.repeats, vocab,
                                      result["target"]["plain_step_s"])
    result["ops"] = op_breakdown(runner, args.context, vocab)
    if args.prompts > 0:
        result["cycles"] = [cycle_profile(args, b) for b in args.budgets.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result, indent=1) + "\n")
    plot_profile(result, out.with_suffix(".png"))
    print(dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------------------------- gemm
def projection_shapes(text_cfg) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's projections: q, k, v, o, gate, up, down."""
    h, inter = text_cfg.hidden_size, text_cfg.intermediate_size
    head_dim = getattr(text_cfg, "head_dim", None) or h // text_cfg.num_attention_heads
    q, kv = text_cfg.num_attention_heads * head_dim, text_cfg.num_key_value_heads * head_dim
    return [(h, q), (h, kv), (h, kv), (q, h), (h, inter), (h, inter), (inter, h)]


def stack_seconds(fns: list[Callable], in_sizes: list[int], m: int, repeats: int) -> float:
    inputs = {size: torch.randn(m, size) for size in set(in_sizes)}

    def once() -> None:
        for fn, size in zip(fns, in_sizes):
            fn(inputs[size])

    return median_seconds(once, repeats)


def cmd_gemm(args: argparse.Namespace) -> dict:
    from torch.utils import mkldnn
    from transformers import AutoConfig

    from data_prep.targets import load_target_config, resolve_target

    torch.set_num_threads(args.threads)
    raw = load_target_config(resolve_target(args.target))
    text_cfg = AutoConfig.for_model(**raw).get_text_config()
    shapes = projection_shapes(text_cfg) * int(text_cfg.num_hidden_layers)
    in_sizes = [i for i, _ in shapes]
    layers = [nn.Linear(i, o, bias=False) for i, o in shapes]
    head = nn.Linear(text_cfg.hidden_size, text_cfg.vocab_size, bias=False)

    def pretransposed(linear: nn.Linear) -> Callable:
        weight_t = linear.weight.detach().t().contiguous()
        return lambda x: x @ weight_t

    def onednn(linear: nn.Linear) -> Callable:
        packed = mkldnn.to_mkldnn(linear)
        return lambda x: packed(x.to_mkldnn()).to_dense()

    paths = {
        "linear": [layer.forward for layer in layers],
        "pretransposed": [pretransposed(layer) for layer in layers],
        "onednn": [onednn(layer) for layer in layers],
    }
    result: dict = {
        "target": args.target, "threads": args.threads, "dtype": "float32", "projections": len(shapes),
        "definition": "median seconds of one pass over every decoder layer's projections (and, separately, "
                      "the LM head) at M tokens; ratio = seconds(M) / seconds(1) of the same path",
        "tokens": list(GEMM_TOKENS),
    }
    with torch.no_grad():
        for name, fns in paths.items():
            secs = [stack_seconds(fns, in_sizes, m, args.repeats) for m in GEMM_TOKENS]
            result[name] = {"seconds": secs, "ratio_to_1": [s / secs[0] for s in secs]}
        secs = [stack_seconds([head.forward], [text_cfg.hidden_size], m, args.repeats) for m in GEMM_TOKENS]
        result["lm_head"] = {"seconds": secs, "ratio_to_1": [s / secs[0] for s in secs]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(dumps(result, indent=1))
    print(dumps(result, indent=1))
    return result


# --------------------------------------------------------------------------------------------------- speed
PLAIN, HF_PLAIN, PROMPT_LOOKUP = "plain", "hf_generate", "hf_prompt_lookup"


def pass_config(args: argparse.Namespace, mode: str, temperature: float, total_tokens: int | None,
                with_peer: bool, out_dir: Path):
    from eval.config import DecodeConfig, EvalConfig

    decode = DecodeConfig(
        mode=mode,
        depth=args.depth if mode == "tree" else args.chain_depth,
        topk=args.topk,
        temperature=temperature,
        max_new_tokens=args.max_new_tokens,
        num_prompts=args.num_prompts,
        max_turns=1,  # first turns only: a second turn would follow each method's own first answer
        seed=args.seed,
    )
    if mode == "tree":
        if total_tokens is None:
            decode.auto_total_tokens = True
        else:
            decode.total_tokens = total_tokens
    return EvalConfig(drafter=args.drafter, target=args.target, prompts=args.prompts, out_dir=str(out_dir),
                      threads=args.threads, baseline=True, prompt_lookup=with_peer,
                      prompt_lookup_num_tokens=args.prompt_lookup_num_tokens, plots=False, decode=decode)


def spec_row(report: dict, temperature: float) -> dict:
    d = report["decode"]
    tps = report["tokens_per_s"]
    same = report.get("outputs_identical_to_baseline")
    return {
        "temperature": temperature, "method": d["mode"], "tokens_per_s": tps["speculative"],
        "speedup_vs_plain": report["speedup"], "plain_tokens_per_s_same_pass": tps["baseline"],
        "tau_pooled": report["tau_pooled"], "tau_per_request_mean": report["tau_per_request_mean"],
        "tau_per_request": [s["tau"] for s in report["samples"]],
        "per_position_acceptance": report["per_position_acceptance"],
        "accept_length_histogram": report["accept_length_histogram"],
        "verify_forwards": report["verify_forwards"], "new_tokens": report["new_tokens"],
        "drafting": report.get("drafting"),  # what the drafter really did (a DFlash export ignores mode/depth)
        "depth": d["depth"], "topk": d["topk"] if d["mode"] == "tree" else None,
        "total_tokens_m": d["total_tokens"] if d["mode"] == "tree" else None,
        "outputs_identical_to_plain": same or None,  # expected_all: greedy only (T>0 draws other streams)
    }


def plain_row(reports: list[dict], temperature: float) -> dict:
    """Plain decoding ran once per pass on the same prompts; pool those runs (Σ tokens / Σ seconds)."""
    tokens = [sum(len(s["baseline_output_token_ids"]) for s in r["samples"]) for r in reports]
    seconds = [n / r["tokens_per_s"]["baseline"] for n, r in zip(tokens, reports)]
    return {"temperature": temperature, "method": PLAIN, "tokens_per_s": sum(tokens) / sum(seconds),
            "speedup_vs_plain": 1.0, "tokens_per_s_by_pass": {r["decode"]["mode"]: r["tokens_per_s"]["baseline"]
                                                              for r in reports}}


def peer_rows(report: dict, temperature: float) -> list[dict]:
    p = report["prompt_lookup"]
    base = report["tokens_per_s"]["baseline"]
    return [
        {"temperature": temperature, "method": HF_PLAIN, "tokens_per_s": p["hf_generate_plain_tokens_per_s"],
         "speedup_vs_plain": p["hf_generate_plain_tokens_per_s"] / base, "plain_tokens_per_s_same_pass": base},
        {"temperature": temperature, "method": PROMPT_LOOKUP, "tokens_per_s": p["tokens_per_s"],
         "speedup_vs_plain": p["speedup"], "speedup_vs_hf_generate": p["speedup_vs_hf_generate_plain"],
         "plain_tokens_per_s_same_pass": base, "prompt_lookup_num_tokens": p["num_tokens"]},
    ]


def plot_speed(rows: list[dict], path: Path) -> None:
    from eval.plots import draw_alpha_lines, pyplot

    plt = pyplot()
    temps = sorted({r["temperature"] for r in rows})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["temperature"], r["method"]): r for r in rows}
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [t_i + (i - (len(methods) - 1) / 2) * width for t_i in range(len(temps))]
        vals = [(by.get((t, m)) or {}).get("tokens_per_s") or 0.0 for t in temps]
        bars = ax.bar(xs, vals, width, label=m)
        for bar, t in zip(bars, temps):
            s = (by.get((t, m)) or {}).get("speedup_vs_plain")
            if s is not None:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{s:.2f}×", ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(range(len(temps)), [f"T={t:g}" for t in temps])
    ax.set_ylabel("tokens/s (label: speedup vs plain, same pass)")
    ax.set_title("decoding speed per method")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.25)  # headroom: the legend sits above the bars
    ax.legend(fontsize=7, ncol=3, loc="upper center")
    draw_alpha_lines(ax2, [(f"{r['method']} T={r['temperature']:g} (τ={r['tau_pooled']:.2f})",
                            r["per_position_acceptance"], None) for r in rows if r.get("per_position_acceptance")],
                     "per-position acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cmd_speed(args: argparse.Namespace) -> dict:
    from eval.config import DecodeConfig
    from eval.run import run_eval
    from infra.strict_json import json_safe

    temps = [float(t) for t in args.temperatures.split(",")]
    modes = args.modes.split(",")

    t0 = time.perf_counter()
    rows: list[dict] = []
    total_tokens = args.total_tokens
    m_timings = None
    with tempfile.TemporaryDirectory() as tmp:
        for temp in temps:
            reports = []
            for i, mode in enumerate(modes):
                cfg = pass_config(args, mode, temp, total_tokens, with_peer=i == 0,
                                  out_dir=Path(tmp) / f"T{temp:g}_{mode}")
                report = run_eval(cfg, progress=sys.stderr.isatty())
                if mode == "tree" and total_tokens is None:
                    total_tokens = report["decode"]["total_tokens"]
                    m_timings = report["decode"]["total_tokens_timings_s"]
                reports.append(report)
            rows += [plain_row(reports, temp), *(spec_row(r, temp) for r in reports), *peer_rows(reports[0], temp)]
    result = {
        "args": {k: v for k, v in vars(args).items() if k != "cmd"},
        "target": reports[0]["target"], "drafter": args.drafter, "prompts": args.prompts,
        "num_prompts": reports[0]["num_prompts"], "first_turns_only": True,
        "dtype": reports[0]["dtype"], "device": reports[0]["device"], "torch_threads": torch.get_num_threads(),
        "sampling": {"top_p": DecodeConfig.top_p, "top_k": DecodeConfig.top_k},
        "tree_total_tokens_m": total_tokens, "tree_m_timings_s": m_timings,
        "protocol": "each pass = one run_eval call; per prompt: speculative, plain (and in the first pass of a "
                    "temperature HF generate with and without prompt lookup) back to back; speedup_vs_plain = "
                    "tokens/s / plain tokens/s of the same pass; the plain row pools the passes",
        "wall_s": time.perf_counter() - t0,
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    safe = json_safe(result)
    out.write_text(dumps(safe, indent=1))
    plot_speed(safe["rows"], out.with_suffix(".png"))
    print(dumps({k: v for k, v in safe.items() if k != "rows"} | {"rows": [
        {k: v for k, v in r.items() if k not in ("tau_per_request", "accept_length_histogram")} for r in safe["rows"]
    ]}))
    print(f"results: {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from eval.config import DecodeConfig, EvalConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("profile", help="target/drafter cost against tokens, ops, cycle phases")
    s.add_argument("--drafter", required=True, help="an EAGLE-3 export")
    s.add_argument("--target", default="smollm2-135m-instruct")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--context", type=int, default=256)
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--prompts", type=int, default=1, help="MT-bench prompts per category of the phase split (0 = skip)")
    s.add_argument("--max-new-tokens", type=int, default=96)
    s.add_argument("--budgets", default="fixed,adaptive", help="decode.budget of each speculative run")
    s.add_argument("--out", default=str(RESULTS / "decode_profile.json"))

    s = sub.add_parser("gemm", help="the target's projections alone against M tokens, by GEMM path")
    s.add_argument("--target", default="smollm2-135m-instruct")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--repeats", type=int, default=7)
    s.add_argument("--out", default=str(RESULTS / "projection_gemm.json"))

    s = sub.add_parser("speed", help="tree/chain vs plain decoding and HF prompt lookup, T=0 and T=1")
    s.add_argument("--drafter", required=True, help="engine-format export dir")
    s.add_argument("--target", default="smollm2-135m-instruct")
    s.add_argument("--prompts", default="mtbench")
    s.add_argument("--num-prompts", type=int, default=2, help="per category (MT-bench: 8 categories)")
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--temperatures", default="0,1")
    s.add_argument("--modes", default="tree,chain")
    s.add_argument("--depth", type=int, default=DecodeConfig.depth, help="tree depth")
    s.add_argument("--topk", type=int, default=DecodeConfig.topk)
    s.add_argument("--total-tokens", type=int, default=None, help="tree m; default: picked by timing the target")
    # Chain pays one verify slot and one drafter step per depth whatever the drafter's confidence; K=3 is
    # also what `make engine-check` compares with vLLM.
    s.add_argument("--chain-depth", type=int, default=3)
    s.add_argument("--prompt-lookup-num-tokens", type=int, default=EvalConfig.prompt_lookup_num_tokens)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", default=str(RESULTS / "spec_decode_speed.json"))

    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    return {"profile": cmd_profile, "gemm": cmd_gemm, "speed": cmd_speed}[args.cmd](args)


if __name__ == "__main__":
    main()
