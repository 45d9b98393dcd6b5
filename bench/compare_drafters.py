#!/usr/bin/env python
"""Drafters side by side: the same prepared data, the same optimisation budget, the same MT-bench decoding.

    python bench/compare_drafters.py --suite quality --prep outputs/prep/quality --out outputs/bench/quality
    python bench/compare_drafters.py --suite dflash  --prep outputs/prep/smollm2-135m-instruct --out outputs/bench/dflash
    python bench/compare_drafters.py curve --runs <run dir> [<run dir> ...] [--reference <EAGLE-3 run dir>]
    python bench/compare_drafters.py ngram --prep <prep dir>

`curve` draws held-out acc_k against training steps for finished runs; `ngram` gives the unigram and bigram
baselines of a prep's held-out targets (what a drafter reaches without the target's features); each has its own
--help.

Suites (variants = Hydra overrides on top of `+exp=<suite's exp>`, which fixes data, steps and lr for all):
- quality: the EAGLE-3 paper's ablation: EAGLE-1 (top-layer feature, feature regression + token CE), EAGLE-3
  without training-time test (K = 1) and EAGLE-3 with K = 7, λ = 0.8 (docs/method.md §2, §4);
- dflash: DFlash (block diffusion, docs/method.md §5) with its own recipe (+exp=dflash; blocks of 16 and of 8)
  against EAGLE-3 with its own (+exp=eagle3_demo), at equal training wall-clock: EAGLE-3's run sets the
  budget (evaluations left out), each DFlash variant's steps come from a short calibration run of it;
- depth: EAGLE-3's TTT depth K = 3, 2, 4, 7 with the demo recipe (+exp=eagle3_demo) at equal training
  wall-clock: K = 3's run sets the budget, the others' steps are calibrated to it;
- cost: the demo recipe (global batch 8) against the levers that change a step's cost, at equal training wall-clock
  likewise: batch 2, 4 and 16 (same lr), and a loss on every token of a sample (+lever=all_tokens);
- teacher: EAGLE-3 K = 7 trained on the exact teacher vs the compact ones (top-k logits, argmax labels);
- scaling: one recipe on nested subsets of one large prep's training split (`--points`, data.train_samples),
  the budget scaled by the rule "the same number of epochs" (steps proportional to the data); adds
  <out>/scaling.{json,png}: held-out sim τ and online τ against the number of training conversations with
  a log-linear fit τ = a + b·ln(n) and the n it extrapolates to for τ = 2 and τ = 3. `--previous` folds the
  points of an earlier run of the suite (its compare.json, another prep of the same data and held-out split)
  into the record and the fits, each point naming the prep it was trained on.
Per variant: train (torchrun, `--nproc` processes, DeepSpeed as configured) -> the run's export -> launch/eval.py
for every decoding mode x temperature (MT-bench prompts the training never saw; plain decoding of the same
prompts in the same run gives the speedup). Every stage is skipped when its output exists, so an interrupted
benchmark resumes. Writes <out>/compare.json, <out>/compare.md and <out>/per_position.png (all variants,
one panel per mode x temperature), and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from infra.strict_json import dumps

ROOT = Path(__file__).resolve().parents[1]

SUITES: dict[str, dict] = {
    "quality": {
        "exp": "quality",
        "variants": {
            # EAGLE-1's feature regression diverges at EAGLE-3's rate here; 5e-4 is the fastest stable one.
            "eagle1": ["model=eagle1", "train.ttt_steps=1", "train.lr=5e-4"],
            "eagle3_k1": ["train.ttt_steps=1"],
            "eagle3_k7": ["train.ttt_steps=7", "train.loss_decay=0.8"],
        },
    },
    # On ONE prep carrying both drafters' layers (`python -m train.dflash prep-taps <target>` prints them);
    # EAGLE-3 picks its default three out of them. Each family trains with its own recipe (+exp=eagle3_demo,
    # +exp=dflash) for the same wall-clock: EAGLE-3's run sets the budget, DFlash's steps are calibrated to it.
    "dflash": {
        "exp": "eagle3_demo",
        "variants": {
            "eagle3": [],
            "dflash": {"exp": "dflash", "overrides": []},
            "dflash_b8": {"exp": "dflash",
                          "overrides": ["model.dflash.block_size=8", "train.dflash.gamma=4"]},
        },
        "equal_wall": "eagle3",
    },
    # Levers of the demo recipe that change a step's cost, so they are compared at equal wall-clock; held-out
    # metrics unroll 7 steps whatever K (+exp=eagle3_demo's train.eval_ttt_steps).
    "depth": {
        "exp": "eagle3_demo",
        "variants": {f"k{k}": [f"train.ttt_steps={k}"] for k in (3, 2, 4, 7)},  # explicit: the exp's K may change
        "equal_wall": "k3",
    },
    "cost": {
        "exp": "eagle3_demo",
        # explicit batch sizes: the exp's own may change (batch 8 was the recipe these were measured against)
        "variants": {f"b{b}": [f"data.batch_size={b}"] for b in (8, 4, 16, 2)}
        | {"all_tokens": ["data.batch_size=8", "+lever=all_tokens"]},
        "equal_wall": "b8",
    },
    # Compact teachers (issue: long context): the same conversations captured with each teacher kind
    # (`make prep ... capture.teacher=topk` into <prep>-topk, `=argmax` into <prep>-argmax), trained alike;
    # held-out metrics always against the exact teacher: <prep>-topk/eval must be <prep>/eval (a symlink).
    "teacher": {
        "exp": "quality",
        "variants": {
            "hidden": [],
            "topk": ["data.dir={prep}-topk"],
            "argmax": ["data.dir={prep}-argmax"],
        },
    },
    "scaling": {"exp": "quality", "variants": {}},  # filled from --points
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="quality")
    p.add_argument("--prep", required=True, help="a prep output dir (make prep)")
    p.add_argument("--out", required=True)
    p.add_argument("--variants", default=None, help="comma-separated subset of the suite's variants")
    p.add_argument("--nproc", type=int, default=2, help="training processes (torchrun)")
    p.add_argument("--train-args", default="",
                   help="extra Hydra overrides for every training run; a variant's own overrides win over them")
    p.add_argument("--modes", default="tree,chain", help="decoding modes evaluated online ('' = none)")
    p.add_argument("--temperatures", default="0,1")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--eval-args", default="", help="extra overrides for every launch/eval.py run")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the eval runs")
    p.add_argument("--points", default="100,200,400,800,1600", help="scaling suite: training conversations")
    p.add_argument("--previous", default=None,
                   help="an earlier compare.json of the same suite: its variants not re-run here are kept")
    return p.parse_args(argv)


def _run(cmd: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}) after {time.perf_counter() - t0:.0f} s: {' '.join(cmd)}\n"
                         f"see {log}")


CALIBRATION_STEPS = 6  # optimizer steps of the run that times a variant's step for an equal wall-clock budget


def train_seconds(run_dir: Path) -> dict[int, float]:
    from train.metrics import METRICS_FILE, read_metrics, training_clock

    return training_clock(read_metrics(run_dir / METRICS_FILE))


def equal_wall_steps(args: argparse.Namespace, name: str, overrides: list[str], exp: str, budget_s: float) -> int:
    """Optimizer steps of `name` that fit `budget_s` training seconds: a short calibration run of its own
    recipe times its steps (the first left out: it pays one-off costs) per token, and a step of the full run
    costs that times its mean tokens (batch size x the train split's mean sample length, capped at max_len).
    Per token, not per step: length-bucketed batches vary a lot in length, and a variant with another batch
    size draws other samples for its first steps than the budget run did."""
    import yaml

    from data_prep.shards import ShardSet
    from train.metrics import METRICS_FILE, read_metrics, training_clock

    calib = f"{name}_calibration"
    train(args, calib, [*overrides, f"train.max_steps={CALIBRATION_STEPS}", "train.eval_interval=0",
                        "train.save_interval=0", "train.export=false"], exp)
    run_dir = Path(args.out) / calib
    records = read_metrics(run_dir / METRICS_FILE)
    clock = training_clock(records)
    tokens = {r["step"]: r["tokens"] for r in records if r["kind"] == "train"}
    per_token = (clock[CALIBRATION_STEPS] - clock[1]) / sum(tokens[s] for s in range(2, CALIBRATION_STEPS + 1))
    data = yaml.safe_load((run_dir / "config.yaml").read_text())["data"]
    lengths = [min(n, data["max_len"]) for n in ShardSet(Path(data["dir"]) / "train", verify="none").lengths()]
    per_step = per_token * data["batch_size"] * sum(lengths) / len(lengths)
    steps = max(1, int(budget_s / per_step))
    print(f"[{name}] {per_step:.1f} s/step ({1e3 * per_token:.2f} ms/token) -> {steps} steps in {budget_s:.0f} s",
          flush=True)
    return steps


def train(args: argparse.Namespace, name: str, overrides: list[str], exp: str) -> dict:
    from train.metrics import RUN_SUMMARY

    run_dir = Path(args.out) / name
    summary = run_dir / RUN_SUMMARY
    if not (summary.exists() and json.loads(summary.read_text()).get("finished")):
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        prep = str(Path(args.prep).resolve())
        overrides = [o.format(prep=prep) for o in overrides]
        data = [] if any(o.startswith("data.dir=") for o in overrides) else [f"data.dir={prep}"]
        # the variant's own overrides last: they win over the suite-wide --train-args (Hydra keeps the last)
        # an unfinished run left here is trained again from scratch: train.overwrite=true clears it first
        cmd = [torchrun, "--standalone", "--nproc_per_node", str(args.nproc), "launch/train.py", f"+exp={exp}",
               *data, f"out_dir={run_dir.resolve()}", "train.overwrite=true", *args.train_args.split(), *overrides]
        print(f"[{name}] train: {' '.join(cmd)}", flush=True)
        _run(cmd, run_dir / "bench_train.log")
    return json.loads(summary.read_text())


def eval_history(run_dir: Path) -> list[dict]:
    """The run's held-out evaluations in step order (`train.eval_interval` > 0 gives a learning curve)."""
    from train.metrics import METRICS_FILE

    rows = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line.strip()]
    last = {r["step"]: r for r in rows if r.get("kind") == "eval"}  # a resumed run may repeat a step
    return [{"step": s, "sim_tau": r.get("sim_tau"), "acc_0": (r.get("acc_k") or [None])[0]}
            for s, r in sorted(last.items())]


def evaluate(args: argparse.Namespace, name: str, mode: str, temperature: float) -> dict:
    from eval.run import REPORT_FILE

    out = Path(args.out) / name / f"eval_{mode}_t{temperature:g}"
    report = out / REPORT_FILE
    if not report.exists():
        cmd = [sys.executable, "launch/eval.py", f"drafter={(Path(args.out) / name / 'export').resolve()}",
               f"out_dir={out.resolve()}", f"decode.mode={mode}", f"decode.temperature={temperature}",
               f"decode.num_prompts={args.num_prompts}", f"decode.max_new_tokens={args.max_new_tokens}",
               f"threads={args.threads}", *args.eval_args.split()]
        print(f"[{name}] eval {mode} T={temperature:g}", flush=True)
        _run(cmd, out.with_suffix(".log"))
    return json.loads(report.read_text())


def _panels(results: dict) -> list[tuple[str, str, str, tuple | None, list]]:
    """(title, x label, y label, y limits, [(label, xs, ys)]) per panel: held-out sim τ over training, held-out
    acc_k (teacher-forced), then α_n per decoding mode x temperature."""
    def points(values: list) -> tuple[list, list]:
        xs = [i for i, v in enumerate(values) if v is not None]
        return xs, [values[i] for i in xs]

    learning = []
    for name, r in results.items():
        curve = [h for h in r["eval_history"] if h["sim_tau"] is not None]
        learning.append((name, [h["step"] for h in curve], [h["sim_tau"] for h in curve]))
    held_out = [(f"{name} (sim τ {r['sim_tau'] or float('nan'):.2f})", *points(r["acc_k"] or []))
                for name, r in results.items()]
    panels = [("held-out simulated τ during training", "optimizer step", "sim τ", None, learning),
              ("held-out acc_k (teacher-forced)", "TTT step k", "acc_k", (0, 1.02), held_out)]
    for key in sorted({key for r in results.values() for key in r["decode"]}):
        curves = [(f"{name} (τ {r['decode'][key]['tau_pooled']:.2f})",
                   *points(r["decode"][key]["per_position_acceptance"]))
                  for name, r in results.items() if key in r["decode"]]
        panels.append((key, "draft depth n", "α_n = P(accept | all before accepted)", (0, 1.02), curves))
    return panels


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (title, xlabel, ylabel, ylim, curves) in zip(axes[0], panels):
        for label, xs, ys in curves:
            ax.plot(xs, ys, marker="o", label=label)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(results: dict) -> str:
    panels = sorted({key for r in results.values() for key in r["decode"]})
    head = ["variant", "held-out sim τ", "held-out acc_0..", *(f"{c} {p}" for p in panels for c in ("τ", "speedup"))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        acc = " ".join(f"{a:.2f}" for a in r["acc_k"] or [])
        cells = [name, f"{r['sim_tau']:.3f}" if r["sim_tau"] is not None else "-", acc]
        for p in panels:
            rep = r["decode"].get(p)
            speedup = rep.get("speedup") if rep else None  # None: evaluated without the plain baseline
            cells += [f"{rep['tau_pooled']:.3f}", "-" if speedup is None else f"{speedup:.2f}x"] if rep else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def log_linear_fit(ns: list[float], taus: list[float]) -> dict:
    """Least squares τ = a + b·ln(n), and the n where the fit reaches τ = 2 and 3 (None if b <= 0)."""
    import math

    xs = [math.log(n) for n in ns]
    mx, my = sum(xs) / len(xs), sum(taus) / len(taus)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, taus)) / sxx if sxx else 0.0
    a = my - b * mx
    reach = {str(t): (math.exp((t - a) / b) if b > 0 else None) for t in (2, 3)}
    return {"a": a, "b": b, "n_for_tau": reach}


def scaling_report(results: dict, out: Path) -> dict:
    """Held-out sim τ and every online τ against n (training conversations), fits, PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = {name: int(name[1:]) for name in results}
    series = {"held-out sim τ": {name: r["sim_tau"] for name, r in results.items()}}
    for key in sorted({k for r in results.values() for k in r["decode"]}):
        series[f"online τ, {key}"] = {name: r["decode"][key]["tau_pooled"] for name, r in results.items()
                                      if key in r["decode"]}
    report = {}
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for label, values in series.items():
        pts = sorted((ns[name], tau) for name, tau in values.items() if tau is not None)
        if len(pts) < 2:
            continue
        fit = log_linear_fit([n for n, _ in pts], [t for _, t in pts])
        report[label] = {"points": pts, "fit": fit}
        line = ax.plot([n for n, _ in pts], [t for _, t in pts], marker="o", label=f"{label} (b = {fit['b']:.3f})")
        grid = [pts[0][0] * (pts[-1][0] / pts[0][0]) ** (i / 20) for i in range(21)]
        import math

        ax.plot(grid, [fit["a"] + fit["b"] * math.log(n) for n in grid], ls="--", color=line[0].get_color())
    ax.set_xscale("log")
    ax.set(xlabel="training conversations (log)", ylabel="τ", title="data scaling: τ = a + b·ln(n) fits")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    plt.close(fig)
    (out / "scaling.json").write_text(dumps(report, indent=1) + "\n")
    return report


CURVE_DOC = """Held-out accuracy per position against training steps, for one or more runs, beside a reference run's
acc_0. Reads each run's metrics.jsonl eval records (the in-training held-out eval: acc_k = correct / every
loss-masked target that position reaches, out-of-vocabulary targets counted as misses). Position k is TTT step k
for EAGLE, block position k + 1 for DFlash (the anchor itself is given, not predicted). With --reference, the
reference run's final acc_0 and 0.8 x it are drawn and reported, with the first step at which each run's acc_0
reaches 0.8 x it (null when it never does). Writes --out (JSON) and a PNG beside it."""
NGRAM_DOC = """What a drafter reaches without the target's features: unigram and bigram predictors of a prep's
held-out targets, counted on the train split's loss-masked tokens: top-1 accuracy and cross-entropy (nats) of
predicting x_{t+1} from nothing (unigram) and from x_t alone (bigram, add-one smoothing over the vocabulary, backing
off to the unigram for an unseen x_t). For DFlash, x_t is the block's anchor and x_{t+1} block position 1; for
EAGLE-3, x_t the last token it embeds. Prints and writes JSON."""


# ------------------------------------------------------------------------------------------ curve, ngram
REFERENCE_SHARE = 0.8  # the DFlash issue's bar: block position 1 >= 0.8 x EAGLE-3's acc_0 on the same data


def eval_curve(run_dir: Path) -> list[dict]:
    from train.metrics import METRICS_FILE, read_metrics

    return [{"step": r["step"], "acc_k": r["acc_k"], "sim_tau": r.get("sim_tau")}
            for r in read_metrics(run_dir / METRICS_FILE, kind="eval")]


def first_step_reaching(points: list[dict], bar: float) -> int | None:
    return next((p["step"] for p in points if p["acc_k"] and p["acc_k"][0] >= bar), None)


def cmd_curve(argv: list[str]) -> dict:
    """`curve`: held-out accuracy per position against training steps, for one or more runs."""
    ap = argparse.ArgumentParser(prog="compare_drafters.py curve", description=CURVE_DOC)
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--labels", nargs="*", default=None, help="one per run (default: the directory names)")
    ap.add_argument("--reference", default=None, help="a run whose final acc_0 sets the bar")
    ap.add_argument("--positions", default="0,1,2,6", help="acc_k indices drawn")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "learning_curve.json"))
    args = ap.parse_args(argv)

    labels = args.labels or [Path(r).name for r in args.runs]
    if len(labels) != len(args.runs):
        raise SystemExit(f"--labels: {len(labels)} labels for {len(args.runs)} runs")
    positions = [int(k) for k in args.positions.split(",")]
    result: dict = {"definition": "held-out acc_k per eval step (honest: out-of-vocabulary targets are misses)",
                    "runs": {}}
    bar = None
    if args.reference:
        ref = eval_curve(Path(args.reference))
        if not ref:
            raise SystemExit(f"{args.reference}: no eval records in its metrics file")
        bar = REFERENCE_SHARE * ref[-1]["acc_k"][0]
        result["reference"] = {"run": args.reference, "final_step": ref[-1]["step"], "acc_0": ref[-1]["acc_k"][0],
                               "bar": bar, "bar_definition": f"{REFERENCE_SHARE} x the reference's final acc_0"}
    for label, run in zip(labels, args.runs):
        points = eval_curve(Path(run))
        if not points:
            raise SystemExit(f"{run}: no eval records in its metrics file")
        result["runs"][label] = {"run": run, "points": points,
                                 "first_step_at_bar": first_step_reaching(points, bar) if bar else None}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(labels), figsize=(4.5 * len(labels), 3.6), squeeze=False)
    for ax, label in zip(axes[0], labels):
        points = result["runs"][label]["points"]
        for k in positions:
            steps = [p["step"] for p in points if k < len(p["acc_k"])]
            ax.plot(steps, [p["acc_k"][k] for p in points if k < len(p["acc_k"])], marker="o", ms=3,
                    label=f"position {k}")
        if bar is not None:
            ax.axhline(result["reference"]["acc_0"], color="black", lw=0.8, label="reference acc_0")
            ax.axhline(bar, color="grey", ls="--", lw=0.8, label=f"{REFERENCE_SHARE} x reference")
        ax.set(title=label, xlabel="optimizer step", ylabel="held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    out.write_text(dumps(result, indent=1))
    print(dumps({k: v for k, v in result.items() if k != "runs"} |
                     {"first_step_at_bar": {k: v["first_step_at_bar"] for k, v in result["runs"].items()}}, indent=1))
    return result


def pairs(split_dir: Path):
    """(previous token, target token) for every loss-masked target of a shard split."""
    from data_prep.shards import ShardSet

    shards = ShardSet(split_dir)
    for i in range(len(shards)):
        s = shards[i]
        ids, mask = s.input_ids.tolist(), s.loss_mask.tolist()
        for t in range(1, len(ids)):
            if mask[t]:
                yield ids[t - 1], ids[t]


def cmd_ngram(argv: list[str]) -> dict:
    """`ngram`: unigram and bigram predictors of a prep's held-out targets."""
    ap = argparse.ArgumentParser(prog="compare_drafters.py ngram", description=NGRAM_DOC)
    ap.add_argument("--prep", required=True)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "ngram_baselines.json"))
    args = ap.parse_args(argv)
    prep = Path(args.prep)
    vocab = int(json.loads((prep / "summary.json").read_text())["target"]["vocab_size"])

    unigram: Counter = Counter()
    bigram: dict[int, Counter] = defaultdict(Counter)
    for prev, tok in pairs(prep / "train"):
        unigram[tok] += 1
        bigram[prev][tok] += 1
    total = sum(unigram.values())
    top_unigram = unigram.most_common(1)[0][0]
    best_after = {prev: c.most_common(1)[0][0] for prev, c in bigram.items()}

    n = uni_hits = bi_hits = 0
    uni_nll = bi_nll = 0.0
    for prev, tok in pairs(prep / "eval"):
        n += 1
        p_uni = (unigram[tok] + 1) / (total + vocab)
        uni_nll -= math.log(p_uni)
        uni_hits += tok == top_unigram
        after = bigram.get(prev)
        if after is None:
            bi_nll -= math.log(p_uni)
            bi_hits += tok == top_unigram
        else:
            bi_nll -= math.log((after[tok] + p_uni * vocab) / (sum(after.values()) + vocab))
            bi_hits += tok == best_after[prev]
    result = {
        "prep": prep.name, "train_targets": total, "held_out_targets": n,
        "definition": "top-1 accuracy / cross-entropy (nats) on the held-out split's loss-masked targets; counts "
                      "from the train split's; bigram add-one smoothed toward the unigram",
        "unigram": {"accuracy": uni_hits / n, "cross_entropy": uni_nll / n},
        "bigram": {"accuracy": bi_hits / n, "cross_entropy": bi_nll / n},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(dumps(result, indent=1))
    print(dumps(result, indent=1))
    return result


# ----------------------------------------------------------------------------------------------- suites
def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("curve", "ngram"):
        return {"curve": cmd_curve, "ngram": cmd_ngram}[argv[0]](argv[1:])
    args = parse_args(argv)
    suite = SUITES[args.suite]
    earlier = json.loads(Path(args.previous).read_text()) if args.previous else {"suite": args.suite, "results": {}}
    if earlier["suite"] != args.suite:
        raise SystemExit(f"--previous {args.previous}: suite {earlier['suite']!r}, not {args.suite!r}")
    variants = suite["variants"]
    if args.suite == "scaling":
        variants = {f"n{n}": [f"data.train_samples={n}"] for n in map(int, args.points.split(","))}
    if args.variants:
        variants = {k: variants[k] for k in args.variants.split(",")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    reference = suite.get("equal_wall")
    budget_s = None
    for name, spec in variants.items():
        exp, overrides = (spec["exp"], list(spec["overrides"])) if isinstance(spec, dict) else (suite["exp"], spec)
        if reference is not None and name != reference:
            if budget_s is None:
                raise SystemExit(f"--suite {args.suite}: the budget variant {reference!r} must run first")
            # many epochs: the calibrated max_steps ends the run and its schedule
            overrides += [f"train.max_steps={equal_wall_steps(args, name, overrides, exp, budget_s)}",
                          "train.epochs=10000"]
        summary = train(args, name, overrides, exp)
        train_s = max(train_seconds(Path(args.out) / name).values())
        if name == reference:
            budget_s = train_s
        ev = summary.get("eval") or {}
        results[name] = {"prep": str(args.prep), "exp": exp, "overrides": overrides,
                         "train_wall_s": summary.get("wall_s"),
                         "train_s": train_s, "steps": summary.get("steps"),
                         "sim_tau": ev.get("sim_tau"), "acc_k": ev.get("acc_k"), "alpha_k": ev.get("alpha_k"),
                         "oov_rate": ev.get("oov_rate"), "eval_history": eval_history(Path(args.out) / name),
                         "decode": {}}
        for mode in filter(None, args.modes.split(",")):
            for temperature in map(float, args.temperatures.split(",")):
                rep = evaluate(args, name, mode, temperature)
                keep = ("tau_pooled", "tau_per_request_mean", "per_position_acceptance", "speedup", "tokens_per_s",
                        "num_prompts", "outputs_identical_to_baseline", "oov_rate")
                results[name]["decode"][f"{mode} T={temperature:g}"] = {k: rep.get(k) for k in keep}
    for name, result in earlier["results"].items():
        results.setdefault(name, {"prep": earlier["prep"], **result})
    record = {"suite": args.suite, "prep": str(args.prep), "nproc": args.nproc, "train_args": args.train_args,
              "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "results": results}
    (out / "compare.json").write_text(dumps(record, indent=1) + "\n")
    (out / "compare.md").write_text(table(results))
    plot(results, out / "per_position.png")
    if args.suite == "scaling":
        record["scaling"] = scaling_report(results, out)
    print(dumps(record))
    print(table(results))
    return record


if __name__ == "__main__":
    main()
