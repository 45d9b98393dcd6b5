"""Prep's vLLM route in one pass against two (capture.one_pass, data_prep/vllm_capture.py OnePassCapture): wall
times, replies and features of two preps of the same data and seed.

    python bench/one_pass_capture.py run --work <dir> --make NUM_SAMPLES=200        # two `make prep`, compared
    python bench/one_pass_capture.py compare <dir>/one <dir>/two                 # two finished preps

`run` makes the demo's prep (`make prep` with the demo's settings: one vLLM server on both cores regenerates and
captures; DEMO_PREP_ARGS and DEMO_VLLM_ARGS) twice into --work, with capture.one_pass=false (`two`) and =true
(`one`), in the order --order gives, then compares them. `compare` reads two finished preps (one-pass first):

- wall seconds: each summary.json's `wall_s` (the regeneration, the capture stage and the whole launch, slowest
  rank) and the `make prep` wall time when `run` measured it; `capture_pass` (samples per split captured with the
  regeneration or by a prefill);
- replies: per conversation of the regen JSONL, whether both preps' replies are the same token ids (the content's
  ids where the JSONL carries them, else its text);
- features: for every sample both hold with the same tokens, per tensor (each tap layer, the teacher) the max
  absolute difference over the rows an objective reads relative to the two-pass tensor's largest magnitude
  (a one-pass sample's rows from the request's last computed position on are zeros, never read: they are left
  out and counted); quantiles and max over samples, and the share of samples within one bf16 rounding (2^-8).

Results: bench/results/one_pass_capture.json (--out) and a histogram of the relative differences beside it (.png).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_prep.regenerate import read_results  # noqa: E402
from data_prep.shards import ShardSet  # noqa: E402
from infra.strict_json import dumps  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SPLITS = ("train", "eval")
QUANTILES = (0.5, 0.9, 0.99)
BF16_ROUNDING = 2.0 ** -8


def make_prep(prep: Path, one_pass: bool, log: Path, variables: list[str]) -> float:
    """`make prep` with the demo's settings into `prep`; its wall seconds."""
    args = ["make", "prep", f"PREP_DIR={prep}", "NPROC=1", "OMP_NUM_THREADS=2", "VLLM_CPU_NUM_OF_RESERVED_CPU=0",
            "VLLM_CPU_KVCACHE_SPACE=6", *variables,
            f"ARGS=$(DEMO_PREP_ARGS) $(DEMO_VLLM_ARGS) capture.one_pass={str(one_pass).lower()}"]
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(args, cwd=ROOT, env=dict(os.environ), stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def replies(prep: Path) -> dict[str, list]:
    """Per conversation id, its assistant replies as token ids (or text where the JSONL carries no ids)."""
    out = {}
    for path in sorted((prep / "regen").glob("*.jsonl")):
        for cid, rec in read_results(path).items():
            out[cid] = [m.get("token_ids") or m["content"] for m in rec["messages"] if m["role"] == "assistant"]
    return out


def compare_replies(one: Path, two: Path) -> dict:
    a, b = replies(one), replies(two)
    shared = sorted(set(a) & set(b))
    same = [cid for cid in shared if a[cid] == b[cid]]
    return {"conversations": len(shared), "identical": len(same), "only_one_pass": len(set(a) - set(b)),
            "only_two_passes": len(set(b) - set(a)), "different": [cid for cid in shared if a[cid] != b[cid]][:20]}


def zero_tail(sample) -> int:
    """Where a sample's trailing rows of zeros start (len(sample) when it has none)."""
    rows = sample.taps.float().abs().sum(-1) == 0
    if sample.teacher_hidden is not None:
        rows &= sample.teacher_hidden.float().abs().sum(-1) == 0
    start = len(sample)
    while start > 0 and rows[start - 1]:
        start -= 1
    return start


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (0 for two empty or zero tensors)."""
    scale = float(b.float().abs().max()) if b.numel() else 0.0
    return float((a.float() - b.float()).abs().max()) / scale if scale else 0.0


def compare_features(one: Path, two: Path) -> dict:
    n_taps = len(json.loads((one / "train" / "manifest.json").read_text())["tap_layers"])
    diffs: dict[str, list[float]] = {f"tap {i}": [] for i in range(n_taps)} | {"teacher": []}
    compared = tail_rows = different_tokens = 0
    for split in SPLITS:
        ours = {s.sample_id: s for s in ShardSet(one / split)}
        for ref in ShardSet(two / split):
            o = ours.get(ref.sample_id)
            if o is None or not torch.equal(o.input_ids, ref.input_ids):
                different_tokens += 1
                continue
            z = zero_tail(o)
            tail_rows += len(o) - z
            width = o.taps.shape[-1] // n_taps
            for i in range(n_taps):
                cols = slice(i * width, (i + 1) * width)
                diffs[f"tap {i}"].append(rel(o.taps[:z, cols], ref.taps[:z, cols]))
            if o.teacher_hidden is not None:
                diffs["teacher"].append(rel(o.teacher_hidden[:z], ref.teacher_hidden[:z]))
            compared += 1
    stats = {}
    for name, values in diffs.items():
        if not values:
            continue
        t = torch.tensor(values, dtype=torch.float64)
        stats[name] = {**{f"q{int(q * 100)}": float(t.quantile(q)) for q in QUANTILES}, "max": float(t.max()),
                       "within_bf16_rounding": float((t <= BF16_ROUNDING).double().mean())}
    return {"samples_compared": compared, "samples_with_other_tokens": different_tokens,
            "zero_tail_rows_left_out": tail_rows, "rel_diff": stats, "values": diffs}


def compare(one: Path, two: Path, make_wall_s: dict | None = None) -> dict:
    summaries = {name: json.loads((prep / "summary.json").read_text()) for name, prep in (("one", one), ("two", two))}
    features = compare_features(one, two)
    values = features.pop("values")
    return {
        "what": "prep's vLLM route with capture.one_pass=true (one) against false (two), same data and seed",
        "preps": {"one": one.name, "two": two.name},  # names inside --work: no machine paths
        "wall_s": {name: s.get("wall_s") for name, s in summaries.items()},
        "make_prep_wall_s": make_wall_s,
        "capture_pass": {name: s.get("capture_pass") for name, s in summaries.items()},
        "one_pass": summaries["one"].get("one_pass"),
        "samples": {name: s["samples"] for name, s in summaries.items()},
        "dtype": summaries["one"]["dtype"],
        "replies": compare_replies(one, two),
        "features": features,
    }, values


def plot(values: dict[str, list[float]], path: Path, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    floor = 1e-9  # equal tensors (0) drawn at the floor
    for name, v in values.items():
        if v:
            ax.hist([max(x, floor) for x in v], bins=torch.logspace(-9, 0, 46).tolist(), histtype="step", label=name)
    ax.axvline(BF16_ROUNDING, color="grey", linestyle="--", label="bf16 rounding (2^-8)")
    ax.set_xscale("log")
    ax.set_xlabel("max |one - two| / max |two| per sample and tensor (rows read)")
    ax.set_ylabel("samples")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict, values: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(result, indent=1) + "\n")
    plot(values, out.with_suffix(".png"), f"one pass against two ({result['dtype']}, "
                                          f"{result['features']['samples_compared']} samples)")
    print(dumps({k: result[k] for k in ("wall_s", "make_prep_wall_s", "capture_pass", "replies")}, indent=1))
    print(dumps(result["features"]["rel_diff"], indent=1))
    print(f"-> {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="two `make prep` with the demo's settings, then compare")
    r.add_argument("--work", required=True, help="where the two preps go (outside the work tree)")
    r.add_argument("--make", action="append", default=[], metavar="VAR=value",
                   help="a make variable for both `make prep` (repeatable), e.g. NUM_SAMPLES=200")
    r.add_argument("--order", default="two,one", help="which prep runs first: two,one or one,two")
    r.add_argument("--out", default=str(RESULTS / "one_pass_capture.json"))
    c = sub.add_parser("compare", help="compare two finished preps")
    c.add_argument("one", help="the prep made with capture.one_pass=true")
    c.add_argument("two", help="the prep made with capture.one_pass=false")
    c.add_argument("--out", default=str(RESULTS / "one_pass_capture.json"))
    args = p.parse_args()
    if args.cmd == "run":
        work = Path(args.work).resolve()
        work.mkdir(parents=True, exist_ok=True)
        walls = {}
        for name in args.order.split(","):
            walls[name] = make_prep(work / name, name == "one", work / f"prep_{name}.log", args.make)
            print(f"make prep ({name} pass{'es' if name == 'two' else ''}): {walls[name]:.1f} s")
        result, values = compare(work / "one", work / "two", walls)
        result["make"] = args.make
        result["order"] = args.order
    else:
        result, values = compare(Path(args.one), Path(args.two))
    write(result, values, Path(args.out))


if __name__ == "__main__":
    main()
