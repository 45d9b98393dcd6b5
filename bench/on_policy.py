#!/usr/bin/env python
"""The on-policy stage (train.on_policy, Draft-OPD) against continued supervised training at equal compute, from one
supervised drafter, evaluated on every shipped suite with intervals. One quiet run per arm:

    python bench/on_policy.py --prep <prep dir> --start <export of a supervised drafter> --work <dir> \
        --name demo [--opd-steps 60 --temperature 0 --seed 0 --num-prompts 10]   # resumable: a finished stage is
                                                                                  # read back

  on_policy   --opd-steps optimizer steps of `+exp=eagle3_opd` from --start (train.init_from): the prep's train
              prompts rolled out by the drafter against the target in each rank (chains of 3, 64 new tokens, at
              --temperature: 0 greedy, the chains replayed along the target's greedy text; > 0 sampled by
              speculative decoding; the rollout drafter refreshed every 10 steps), trained on the drafting they
              visited
  supervised  `+exp=eagle3_demo` (the demo's supervised recipe, K=2, offline shards) from --start, for as many steps
              as fill the on-policy arm's training-loop seconds (from a short timing run of the same recipe)
Both: 2 ranks (ZeRO-3, 1 thread each), global batches of 4, lr 2e-4 (wsd: warmup 5, decay over the last half to a
tenth), seed --seed, no evaluation during training (each arm's compute is its training loop). Equal compute =
equal training-loop seconds (train/trainer.py: evals and saves left out; the on-policy loop includes its rollouts).

Then --start and both arms' exports through launch/eval.py on every shipped suite (eval/prompts.py SUITES),
--num-prompts first turns per category: tree (depth 6, top-k 8, 16 nodes a verify), T=0, 64 new tokens; and on MT-bench,
chain (3 drafts) at T=0 and at T=1 (seeded). τ = (accepted drafts + 1) per verify forward, pooled over a category's
prompts, with its 95% bootstrap interval over the prompts (eval/categories.py); α per draft position.
Writes bench/results/on_policy_<name>.{json,png}; the runs and the full reports stay in --work.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from infra.strict_json import dumps

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SCHEDULE = ["train.lr=2.0e-4", "train.warmup_steps=5", "train.schedule=wsd", "train.decay_ratio=0.5",
            "train.min_lr_ratio=0.1", "train.eval_interval=0", "train.save_interval=1000", "data.batch_size=4",
            "data.max_len=1024", "data.eval_max_samples=38", "logger.wandb_mode=disabled", "logger.progress=false"]
ARMS = {
    "supervised": ["+exp=eagle3_demo"],
    "on_policy": ["+exp=eagle3_opd", "train.on_policy.max_new_tokens=64"],
}
EVALS = {  # name: launch/eval.py overrides
    # 16 nodes a verify, not eval's default 60: a prompt decodes in ~7 s on 2 CPU cores with 16 (the 180 prompts of
    # an arm in ~20 min); 60 took ~34 s a prompt, though while other jobs shared the cores
    "tree_t0": ["prompts=all", "decode.mode=tree", "decode.depth=6", "decode.topk=8", "decode.total_tokens=16"],
    "chain_t0_mtbench": ["prompts=mtbench", "decode.mode=chain", "decode.depth=3"],
    "chain_t1_mtbench": ["prompts=mtbench", "decode.mode=chain", "decode.depth=3", "decode.temperature=1.0"],
}


def run(cmd: list[str], log: Path, threads: int) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def train(out: Path, prep: Path, start: Path, arm: str, steps: int, seed: int, extra: tuple[str, ...] = ()) -> dict:
    """One arm's run (skipped when out/summary.json says it finished); what its summary says."""
    summary = out / "summary.json"
    if not (summary.exists() and json.loads(summary.read_text())["finished"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
               str(ROOT / "launch" / "train.py"), *ARMS[arm], *SCHEDULE, f"data.dir={prep}", f"out_dir={out}",
               f"train.init_from={start}", f"train.max_steps={steps}", "train.epochs=100", f"train.seed={seed}",
               "train.overwrite=true", *extra]
        run(cmd, out.with_suffix(".log"), 1)
    s = json.loads(summary.read_text())
    data = s["data"]
    loop_s = data["feature_wait_s"] / data["feature_wait_share"] if data["feature_wait_share"] else None
    out_rec = {"steps": s["steps"], "loop_s": loop_s, "wall_s": s["wall_s"], "tokens": s["tokens"],
               "samples": s["steps"] * 4, "held_out_sim_tau": s["eval"]["sim_tau"],
               "held_out_acc_k": s["eval"]["acc_k"], "source": data["source"], "precision": s["precision"]}
    if arm == "on_policy":  # metrics.jsonl's per-step counters are over the ranks
        from train.on_policy import COUNTERS, summary

        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        totals = {k: sum(r[k] for r in steps if r["kind"] == "train") for k in COUNTERS}
        out_rec["rollouts"] = {**totals, **summary(totals)}
    return out_rec


def evaluate(out: Path, drafter: Path, mode: str, num_prompts: int, seed: int, threads: int) -> dict:
    report = out / "report.json"
    if not report.exists():
        cmd = [sys.executable, str(ROOT / "launch" / "eval.py"), f"drafter={drafter}", f"out_dir={out}",
               *EVALS[mode], f"decode.num_prompts={num_prompts}", "decode.max_new_tokens=64", "decode.max_turns=1",
               f"decode.seed={seed}", "baseline=false", "warmup=false", "plots=false", f"threads={threads}"]
        out.mkdir(parents=True, exist_ok=True)
        run(cmd, out.parent / f"{out.name}.log", threads)
    r = json.loads(report.read_text())
    keep = ("suite", "category", "prompts", "turns", "tau", "tau_ci95", "alpha", "oov_rate", "new_tokens")
    return {"tau": r["tau_pooled"], "tau_ci95": r["tau_ci95"], "prompts": r["num_prompts"],
            "alpha": r["per_position_acceptance"] if "per_position_acceptance" in r else None,
            "suites": r["suites"], "categories": [{k: e[k] for k in keep} for e in r["categories"]]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"start": "0.6", "supervised": "tab:blue", "on_policy": "tab:orange"}
    tree = {arm: result["evals"][arm]["tree_t0"]["categories"] for arm in colors
            if "tree_t0" in result["evals"].get(arm, {})}
    labels = [f"{e['suite']}/{e['category']}" for e in tree["supervised"]]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(labels)), 4.5))
    width = 0.8 / len(tree)
    for i, arm in enumerate(tree):
        taus = [e["tau"] for e in tree[arm]]
        lo = [e["tau"] - e["tau_ci95"][0] for e in tree[arm]]
        hi = [e["tau_ci95"][1] - e["tau"] for e in tree[arm]]
        xs = [x + (i - (len(tree) - 1) / 2) * width for x in range(len(labels))]
        ax.bar(xs, taus, width, yerr=[lo, hi], color=colors[arm], label=arm, capsize=2)
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("τ (tree, T=0, 64 new tokens), 95% CI")
    ax.set_ylim(1.0, None)
    pooled = {a: result["evals"][a]["tree_t0"]["tau"] for a in tree}
    ax.set_title(f"{result['name']}: equal training-loop seconds from one drafter; pooled τ "
                 + ", ".join(f"{a} {t:.3f}" for a, t in pooled.items()), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", required=True, help="a prep dir with shards and rendered samples")
    p.add_argument("--start", required=True, help="the supervised drafter's export both arms continue")
    p.add_argument("--work", required=True, help="where the runs and reports go (outside the work tree)")
    p.add_argument("--name", required=True)
    p.add_argument("--opd-steps", type=int, default=60)
    p.add_argument("--temperature", type=float, default=0.0, help="the rollouts' (train.on_policy.temperature)")
    p.add_argument("--timing-steps", type=int, default=20, help="the supervised recipe's timing run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-prompts", type=int, default=10, help="first turns per category")
    p.add_argument("--evals", default=",".join(EVALS), help="which evaluations (default: all three)")
    p.add_argument("--drafters", default="start,supervised,on_policy", help="which drafters to evaluate")
    p.add_argument("--start-evals", default=None, help="the start drafter's evaluations (default: --evals)")
    p.add_argument("--jobs", type=int, default=1, help="evaluations at a time (2 CPU threads shared among them)")
    args = p.parse_args()
    work, prep, start = Path(args.work), Path(args.prep).resolve(), Path(args.start).resolve()
    work.mkdir(parents=True, exist_ok=True)

    rollouts = (f"train.on_policy.temperature={args.temperature}",)
    arms = {"on_policy": train(work / "on_policy", prep, start, "on_policy", args.opd_steps, args.seed, rollouts)}
    timing = train(work / "supervised_timing", prep, start, "supervised", args.timing_steps, args.seed)
    per_step = timing["loop_s"] / timing["steps"]
    sup_steps = max(1, round(arms["on_policy"]["loop_s"] / per_step))
    arms["supervised"] = train(work / "supervised", prep, start, "supervised", sup_steps, args.seed)
    print(f"on_policy {arms['on_policy']['steps']} steps in {arms['on_policy']['loop_s']:.0f} s; supervised "
          f"{arms['supervised']['steps']} steps in {arms['supervised']['loop_s']:.0f} s", flush=True)

    exports = {"start": start, "supervised": work / "supervised" / "export", "on_policy": work / "on_policy" / "export"}
    drafters = {arm: exports[arm] for arm in args.drafters.split(",")}
    modes = args.evals.split(",")
    threads = max(1, 2 // args.jobs)
    with ThreadPoolExecutor(args.jobs) as pool:  # each evaluation is its own process
        futures = {(arm, mode): pool.submit(evaluate, work / f"eval_{arm}_{mode}", d, mode, args.num_prompts,
                                            args.seed, threads)
                   for arm, d in drafters.items()
                   for mode in (args.start_evals.split(",") if arm == "start" and args.start_evals else modes)}
    evals: dict[str, dict] = {}
    for (arm, mode), future in futures.items():
        evals.setdefault(arm, {})[mode] = future.result()
    opd, sup = arms["on_policy"], arms["supervised"]
    result = {
        "name": args.name,
        "what": "the on-policy stage (train.on_policy) against continued supervised training from one supervised "
                "drafter, at equal training-loop seconds, evaluated on every shipped suite",
        "command": f"python bench/on_policy.py --prep <prep> --start <export> --work <dir> --name {args.name} "
                   f"--opd-steps {args.opd_steps} --temperature {args.temperature} --seed {args.seed} --num-prompts {args.num_prompts} "
                   f"--evals {args.evals} --drafters {args.drafters} --jobs {args.jobs}"
                   + (f" --start-evals {args.start_evals}" if args.start_evals else ""),
        "seed": args.seed,
        "schedule": SCHEDULE,
        "arms": {"supervised": {"overrides": ARMS["supervised"], **sup},
                 "on_policy": {"overrides": [*ARMS["on_policy"], *rollouts], **opd}},
        "compute_ratio": opd["loop_s"] / sup["loop_s"],
        "cost": {"supervised_step_s": sup["loop_s"] / sup["steps"], "on_policy_step_s": opd["loop_s"] / opd["steps"],
                 "rollout_s_per_sample": opd["rollouts"]["rollout_s"] / max(opd["rollouts"]["rollouts"], 1),
                 "definition": "training-loop seconds per optimizer step of 4 samples (2 ranks); a rollout's "
                               "seconds per sample (greedy: the target's generation and the chains' replay; "
                               "sampled: speculative decoding), its capture not included"},
        "evals": evals,
        "eval_settings": {m: EVALS[m] + ["decode.max_new_tokens=64", "decode.max_turns=1",
                                         f"decode.num_prompts={args.num_prompts}"] for m in modes},
        "tau_definition": "(accepted drafts + 1) per verify forward, pooled; tau_ci95: 95% bootstrap interval over "
                          "the prompts",
    }
    tree = {a: evals[a]["tree_t0"] for a in evals if "tree_t0" in evals[a]}
    if {"supervised", "on_policy"} <= set(tree):
        opd_tree, sup_tree = tree["on_policy"], tree["supervised"]
        result["goal"] = {"on_policy_tau": opd_tree["tau"], "supervised_tau": sup_tree["tau"],
                          "supervised_tau_ci95": sup_tree["tau_ci95"],
                          "met": opd_tree["tau"] > sup_tree["tau_ci95"][1],
                          "gain_per_suite": {s: opd_tree["suites"][s]["tau"] - sup_tree["suites"][s]["tau"]
                                             for s in sup_tree["suites"]}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"on_policy_{args.name}.json").write_text(dumps(result, indent=1) + "\n")
    if "goal" in result:
        plot(result, RESULTS / f"on_policy_{args.name}.png")
        print(dumps(result["goal"], indent=1))


if __name__ == "__main__":
    main()
