#!/usr/bin/env python
"""Where speculative decoding's time goes on this machine: the cost profile behind the decoder's choices.

    python bench/decode_profile.py --drafter outputs/runs/demo/export [--threads 2 --context 256 --repeats 5]

In ONE process, on the decoder's own code paths (nothing else may share the machine while it runs):
1. target forward seconds against the number of tokens t = 1..64 after a `--context`-token prefix, on the
   verify path (eval.target.TargetRunner.forward with a 4D tree mask and the taps), beside the same t
   tokens with no mask (causal) and without taps, and the plain-decoding step (1 token, no mask, no taps);
   the ratios to that plain step are what the tree budget m is chosen by (eval/budget.py);
2. the tree mask's construction (eval.tree.tree_attention_allowed + TargetRunner.tree_mask) per t;
3. one drafter step (forward_step + its log-probs over the draft vocabulary) against the number of nodes
   1..64 over the same prefix, as a fraction of the plain target step;
4. the operator breakdown (torch.profiler, self CPU time per op) of the plain step and of a 9-token verify;
5. with --prompts N > 0: speculative decoding runs (eval.run.run_eval, tree, T=0) over N MT-bench
   prompts, one per --budgets entry (fixed: m picked once by timing; adaptive: m per cycle by the cost
   model, whose predicted τ and speedup are reported beside the measured ones), each with its own plain
   baseline; each report splits the cycle's wall time by phase (GenerationRecord.phase_s).
Writes --out (JSON) and a PNG beside it, and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

TOKENS = (1, 2, 3, 5, 9, 17, 33, 64)


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


def plot(result: dict, path: Path) -> None:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", required=True, help="an EAGLE-3 export")
    ap.add_argument("--target", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=4, help="MT-bench prompts of the phase split (0 = skip)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--budgets", default="fixed,adaptive", help="decode.budget of each speculative run")
    ap.add_argument("--out", default="bench/results/decode_profile.json")
    args = ap.parse_args()

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
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
