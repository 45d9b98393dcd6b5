"""Host memory per rank of the online target (data.source=online) under each data.target_placement.

    python bench/target_memory.py [--prep DIR] [--out bench/results/target_memory.json]

For each (placement, processes): replicate, zero3 and tp at 2 and at 3 processes (the embedded SmolLM2's 9 query /
3 KV heads let transformers' tensor-parallel plan split it over 1 or 3 ranks only: tp at 2 is refused, and that
refusal is recorded), torchrun starts that many workers (gloo, 1 thread each). Each worker initialises the process
group, loads the frozen target exactly as online training does (train/online.py load_frozen_target: a whole copy,
partitioned as it loads by ZeRO-3, or split by tensor parallelism), runs one capture forward over a rendered sample,
and reads /proc/self/status: RSS (VmRSS) and its private part RssAnon (copies of weights; the memory-mapped
checkpoint's pages are RssFile) before the load, after it and after the forward, the peak RSS of its life (VmHWM),
and the peak of RssAnon, sampled every 5 ms. A weightless run ("none": the same worker loading the tokenizer,
config, modules on the meta device and hooks, not the weights) gives what loading costs besides the weights; the
weights' share of a run is its increase over the load (after the forward, and at the peak) less the weightless
run's, on the largest rank, and vs_replicate its ratio to replicate's at the same process count. Each rank also
reports the bytes of the parameters it keeps (local_weights_mib: its ZeRO-3 partition, its tensor-parallel shard or
the whole tensor; rank 0's summed per tensor kind in rank0_local_weights_mib), and share_beyond_local_weights_mib
is what the share holds besides them (the loader's and DeepSpeed's own memory, the allocator's slack). The target
is loaded in bf16 from its fp32 checkpoint, so each process holds its own copy of what it keeps (an fp32 load would
memory-map the file instead); glibc returns freed large blocks at once (MALLOC_MMAP_THRESHOLD_) and the load ends
by trimming the heap (train/engine.py release_freed_memory, the weightless run's too), so that RSS is live memory. The target's weight bytes (its parameters at that dtype) are computed from its config. RSS is not a timing:
it may be measured while others use the CPU. The prep is made first (stage=render, 4 conversations, 1 process)
unless --prep gives one. Writes the JSON and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from infra.strict_json import dumps

ROOT = Path(__file__).resolve().parents[1]
# "none": the same worker without the weights (tokenizer, config, the model's modules on the meta device, the
# capture hooks): what loading costs besides the weights, subtracted to give the weights' share
SHARE_KEYS = ("target_rss_mib", "target_peak_rss_mib", "target_anon_mib", "target_peak_anon_mib")
RUNS = [("none", 2), ("replicate", 2), ("zero3", 2), ("tp", 2), ("none", 3), ("replicate", 3), ("zero3", 3), ("tp", 3)]


def status_kb(*keys: str) -> dict[str, int]:
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in keys:
            found[name] = int(value.split()[0])
    return found


class AnonPeak:
    """The peak of RssAnon, sampled every 5 ms by a thread (the kernel keeps a peak of the total RSS only)."""

    def __init__(self) -> None:
        self.peak_kb, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kb = max(self.peak_kb, status_kb("RssAnon")["RssAnon"])
            time.sleep(0.005)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak_kb, status_kb("RssAnon")["RssAnon"])


def worker(prep: Path, placement: str, out: Path) -> None:
    """One rank (under torchrun): load the target as online training does, one forward, memory at each point."""
    import functools

    import torch

    from data_prep.rendered import RenderedSet
    from train.config import DataConfig, DeepSpeedConfig
    from train.engine import device, init_distributed, partition_frozen
    from train.online import load_frozen_target

    rank, world = init_distributed("gloo")
    peak = AnonPeak()
    keys = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
    points = {"before_load": status_kb(*keys)}
    rendered = RenderedSet(prep, "train")
    ds_cfg = DeepSpeedConfig()
    partition = functools.partial(partition_frozen, ds_cfg=ds_cfg) if placement == "zero3" else None
    if placement == "none":
        skeleton(rendered)
    else:
        target = load_frozen_target(rendered, DataConfig(dir=str(prep), source="online", target_placement=placement),
                                    device(), partition, ds_cfg)
    points["after_load"] = status_kb(*keys)
    sample = rendered[rank % len(rendered)]
    if placement != "none":
        with torch.no_grad():
            target.samples([sample])
    torch.distributed.barrier()
    points["after_forward"] = status_kb(*keys)
    report = {"rank": rank, "world": world, "placement": placement, "points_kb": points,
              "peak_rss_kb": points["after_forward"]["VmHWM"], "peak_anon_kb": peak.stop(),
              "local_weights": local_weights(target.model) if placement != "none" else {}}
    (out / f"rank{rank}.json").write_text(dumps(report))
    torch.distributed.barrier()


def local_weights(model) -> dict[str, int]:
    """The bytes of each of the target's parameters this rank keeps: its ZeRO-3 partition (ds_tensor), its
    tensor-parallel shard (a DTensor's local tensor) or the whole tensor; a tied LM head counted once."""
    found = {}
    for name, p in model.named_parameters():
        local = getattr(p, "ds_tensor", None)
        if local is None:
            local = p.to_local() if hasattr(p, "to_local") else p.data
        found[name] = local.numel() * local.element_size()
    return found


def skeleton(rendered) -> None:
    """What load_frozen_target does besides reading weights: the tokenizer, the config, the model's modules (on the
    meta device: no storage), the capture hooks and the heap's trim at the end."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from data_prep.capture import HiddenStateCapture
    from data_prep.targets import load_tokenizer, model_path, resolve_target
    from train.engine import release_freed_memory

    source = rendered.target_source
    preset = resolve_target(source.model)
    load_tokenizer(preset, source.chat_template)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path(preset)))
    HiddenStateCapture(model, rendered.spec.tap_layers).__enter__()
    release_freed_memory()


def weight_bytes(prep: Path) -> dict:
    """The target's parameters (from its config, materialised on the meta device) and their bytes at its dtype."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from data_prep.rendered import RenderedSet
    from data_prep.targets import model_path, resolve_target, target_dtype

    source = RenderedSet(prep, "train").target_source
    preset = resolve_target(source.model)
    dtype = getattr(torch, target_dtype(preset, source.dtype, "cpu"))
    config = AutoConfig.from_pretrained(model_path(preset))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    params = sum(p.numel() for p in model.parameters())  # a tied LM head counted once
    name, largest = max(((n, p.numel()) for n, p in model.named_parameters()), key=lambda x: x[1])
    return {"target": preset.name, "dtype": str(dtype).removeprefix("torch."), "parameters": params,
            "bytes": params * dtype.itemsize, "largest_tensor": name, "largest_tensor_mib": largest * dtype.itemsize / 2**20}


def make_prep(work: Path) -> Path:
    prep = work / "prep"
    # bf16: the target's weights are a private copy in each process (its checkpoint is fp32), as for any target
    # converted while it loads (gpt-oss' MXFP4 experts dequantised to bf16); an fp32 load would memory-map the file
    cmd = [sys.executable, str(ROOT / "launch" / "prep.py"), f"out={prep}", "stage=render", "num_samples=4",
           "eval_samples=1", "max_len=256", "regen.enabled=false", "draft_vocab_count=train", "dtype=bfloat16"]
    subprocess.run(cmd, check=True, cwd=ROOT, env=_env())
    return prep


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore",
               # freed blocks go back to the system at once, so RSS is the live memory, not what glibc's heap kept
               # from transient allocations (ZeRO-3 builds each layer whole before partitioning it)
               MALLOC_MMAP_THRESHOLD_="65536")
    return env


def measure(prep: Path, placement: str, nproc: int, work: Path) -> dict:
    out = work / f"{placement}_{nproc}"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(Path(__file__).resolve()), "--worker", "--prep", str(prep), "--placement", placement, "--dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode:  # the refusal's own line (ValueError: ...), else the last one
        lines = [line.split("]: ", 1)[-1] for line in proc.stderr.splitlines() if "Error: " in line]  # [rankN]: ...
        error = (lines or proc.stderr.splitlines()[-1:])[0].replace(str(prep), "<prep>")
        return {"placement": placement, "processes": nproc, "error": error}
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    mib = 1 / 1024

    def delta(r: dict, key: str, point: str) -> float:
        return (r["points_kb"][point][key] - r["points_kb"]["before_load"][key]) * mib

    per_rank = [{
        "rank": r["rank"],
        "rss_before_load_mib": r["points_kb"]["before_load"]["VmRSS"] * mib,
        "rss_after_forward_mib": r["points_kb"]["after_forward"]["VmRSS"] * mib,
        "peak_rss_mib": r["peak_rss_kb"] * mib,
        "target_rss_mib": delta(r, "VmRSS", "after_forward"),
        "target_peak_rss_mib": (r["peak_rss_kb"] - r["points_kb"]["before_load"]["VmRSS"]) * mib,
        "target_anon_mib": delta(r, "RssAnon", "after_forward"),
        "target_peak_anon_mib": (r["peak_anon_kb"] - r["points_kb"]["before_load"]["RssAnon"]) * mib,
        "target_file_mib": delta(r, "RssFile", "after_forward"),
        "local_weights_mib": sum(r["local_weights"].values()) * mib / 1024,
    } for r in ranks]
    worst = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k != "rank"}
    result = {"placement": placement, "processes": nproc, "per_rank": per_rank, "max_over_ranks": worst}
    if ranks[0]["local_weights"]:  # rank 0's share of each tensor, grouped: the embedding, each kind of layer weight
        groups: dict[str, float] = {}
        for name, size in ranks[0]["local_weights"].items():
            kind = ".".join(part for part in name.split(".") if not part.isdigit())  # layers.N.x -> layers.x
            groups[kind] = groups.get(kind, 0.0) + size / 2**20
        result["rank0_local_weights_mib"] = groups
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if "weights_share_mib" in r]
    labels = [f"{r['placement']}\n{r['processes']} proc" for r in runs]
    keys = [("target_peak_rss_mib", "peak RSS"), ("target_rss_mib", "RSS after the forward"),
            ("target_anon_mib", "RssAnon after the forward")]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(keys)
    for i, (key, name) in enumerate(keys):
        ax.bar([x + i * width for x in range(len(runs))], [r["weights_share_mib"][key] for r in runs], width,
               label=name)
    ax.axhline(result["weights"]["bytes"] / 2**20, color="k", ls="--", lw=1, label="the target's weights")
    ax.set_xticks([x + width for x in range(len(runs))], labels)
    ax.set_ylabel("MiB: the weights' share (vs a weightless load), largest rank")
    ax.set_title(f"Online target's host memory per rank: {result['weights']['target']} ({result['weights']['dtype']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prep", type=Path)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "target_memory.json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--placement", help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.worker:
        worker(args.prep, args.placement, args.dir)
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prep = args.prep or make_prep(work)
        weights = weight_bytes(prep)
        runs = [measure(prep, placement, n, work) for placement, n in RUNS]
    # the weights' share: each run's deltas less the weightless run's (same process count), the largest rank's
    none = {r["processes"]: r["max_over_ranks"] for r in runs if r["placement"] == "none" and "error" not in r}
    for r in runs:
        if "error" not in r and r["placement"] != "none" and r["processes"] in none:
            r["weights_share_mib"] = {k: r["max_over_ranks"][k] - none[r["processes"]][k] for k in SHARE_KEYS}
    base = {r["processes"]: r["weights_share_mib"] for r in runs if r["placement"] == "replicate" and
            "weights_share_mib" in r}
    for r in runs:
        if "weights_share_mib" in r and r["processes"] in base:
            r["vs_replicate"] = {k: r["weights_share_mib"][k] / base[r["processes"]][k] for k in SHARE_KEYS}
        if "weights_share_mib" in r:  # what the share holds besides the weights this rank keeps
            local = r["max_over_ranks"]["local_weights_mib"]
            r["share_beyond_local_weights_mib"] = {k: r["weights_share_mib"][k] - local
                                                   for k in ("target_rss_mib", "target_anon_mib")}
    result = {"weights": weights, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(dumps(result, indent=1))


if __name__ == "__main__":
    main()
