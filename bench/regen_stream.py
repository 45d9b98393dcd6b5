"""Regeneration on a vLLM server as a stream against lockstep batches (regen.stream, data_prep/regenerate.py).

    python bench/regen_stream.py --work <dir> [--sweep 32,256] [--make NUM_SAMPLES=200]

Each arm is the demo's `make prep` (one vLLM server on both cores regenerates and captures in one pass:
DEMO_PREP_ARGS and DEMO_VLLM_ARGS) into its own directory under --work, one after the other, nothing else running:

- `lockstep`: regen.stream=false at the default regen.batch_size (16): batches of 16 conversations, each batch
  waiting for its slowest reply before the next is sent (the route before the stream);
- `lockstep_demo`: regen.stream=false at the demo's regen.batch_size (256): the whole split in one batch;
- `stream`: regen.stream=true (the default): vllm.max_in_flight (128) requests on the server at all times, a
  finished conversation's place taken at once by the next one;
- `stream_<n>`: the stream at vllm.max_in_flight=n (--sweep), where the server saturates.

Per arm: reply tokens/s (summary.json's regen_tokens_per_s: the tokens the target generated for the replies,
stop tokens included, over the regeneration's wall seconds, which with the one pass include writing the shards of
the conversations it finished), the regeneration's and the whole `make prep`'s wall seconds; `speedup`: the
stream's reply tokens/s over each lockstep arm's; `replies_identical`: per lockstep arm, whether every
conversation's regenerated replies are the same token ids in both (T=0). Results: bench/results/regen_stream.json
(--out) and a bar plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.one_pass_capture import replies  # noqa: E402
from infra.strict_json import dumps  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def make_prep(prep: Path, settings: str, log: Path, variables: list[str]) -> float:
    """The demo's `make prep` into `prep` with `settings` added; its wall seconds."""
    args = ["make", "prep", f"PREP_DIR={prep}", "NPROC=1", "OMP_NUM_THREADS=2", "VLLM_CPU_NUM_OF_RESERVED_CPU=0",
            "VLLM_CPU_KVCACHE_SPACE=6", *variables, f"ARGS=$(DEMO_PREP_ARGS) $(DEMO_VLLM_ARGS) {settings}"]
    start = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(args, cwd=ROOT, env=dict(os.environ), stdout=f, stderr=subprocess.STDOUT)
    if done.returncode:
        raise SystemExit(f"{' '.join(args)} failed (exit {done.returncode}); see {log}")
    return time.perf_counter() - start


def arm(prep: Path, make_wall_s: float, settings: str) -> dict:
    summary = json.loads((prep / "summary.json").read_text())
    return {"settings": settings, "reply_tokens_per_s": summary["regen_tokens_per_s"],
            "regen_wall_s": summary["wall_s"]["regen"], "prep_wall_s": summary["wall_s"]["prep"],
            "make_prep_wall_s": make_wall_s,
            "replies": sum(len(v) for v in replies(prep).values()),
            "samples": summary["samples"]}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["arms"])
    rates = [result["arms"][n]["reply_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, rates, color=["#999" if n.startswith("lockstep") else "#2a6" for n in names])
    ax.set_ylabel("reply tokens/s")
    ax.set_title("demo prep on one vLLM server: regeneration throughput")
    for i, r in enumerate(rates):
        ax.text(i, r, f"{r:.0f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, required=True, help="where the preps go (outside the work tree)")
    p.add_argument("--sweep", default="32,256", help="vllm.max_in_flight values of the extra stream arms")
    p.add_argument("--make", nargs="*", default=[], help="make variables for every arm, e.g. NUM_SAMPLES=200")
    p.add_argument("--out", type=Path, default=RESULTS / "regen_stream.json")
    a = p.parse_args()
    arms = {"lockstep": "regen.stream=false regen.batch_size=16",
            "lockstep_demo": "regen.stream=false regen.batch_size=256",
            "stream": "regen.stream=true"}
    arms.update({f"stream_{n}": f"regen.stream=true vllm.max_in_flight={n}" for n in a.sweep.split(",") if n})
    a.work.mkdir(parents=True, exist_ok=True)
    result: dict = {"what": __doc__.split("\n\n")[2].strip(), "make": a.make, "arms": {}}
    for name, settings in arms.items():
        prep = a.work / name
        if (prep / "summary.json").exists():  # a finished arm of an earlier, stopped run
            wall = json.loads((a.work / f"{name}.wall").read_text())
        else:
            wall = make_prep(prep, settings, a.work / f"{name}.log", a.make)
            (a.work / f"{name}.wall").write_text(dumps(wall))
        result["arms"][name] = arm(prep, wall, settings)
        print(f"{name:>14}: {result['arms'][name]['reply_tokens_per_s']:.1f} reply tokens/s, regeneration "
              f"{result['arms'][name]['regen_wall_s']:.1f} s, make prep {wall:.0f} s", flush=True)
    stream = result["arms"]["stream"]
    ours = replies(a.work / "stream")
    for name in ("lockstep", "lockstep_demo"):
        other = replies(a.work / name)
        result[f"speedup_over_{name}"] = stream["reply_tokens_per_s"] / result["arms"][name]["reply_tokens_per_s"]
        result[f"replies_identical_{name}"] = ours == other
        result[f"replies_differing_{name}"] = sum(ours.get(k) != v for k, v in other.items())
    result["speedup"] = result["speedup_over_lockstep"]
    result["replies_identical"] = result["replies_identical_lockstep"]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(dumps(result, indent=1) + "\n")
    plot(result, a.out.with_suffix(".png"))
    print(f"stream over lockstep (batch 16): {result['speedup']:.2f}x, replies identical: {result['replies_identical']}; "
          f"over lockstep at the demo's batch 256: {result['speedup_over_lockstep_demo']:.2f}x, replies identical: "
          f"{result['replies_identical_lockstep_demo']} -> {a.out}")


if __name__ == "__main__":
    main()
