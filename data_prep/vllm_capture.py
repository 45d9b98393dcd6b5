"""`capture.engine=vllm`: prep's capture stage through vLLM's own hidden-state extraction, written by ShardWriter.

vLLM runs in its own virtual environment (it pins its own torch), so the project drives it as a subprocess:
data_prep/vllm_worker.py, run by `capture.vllm.python`, builds one `vllm.LLM` with the `extract_hidden_states`
speculative method and a hidden-states KV connector, and sends each rendered sample's token ids as a prompt with
max_tokens=1. vLLM records the residual stream after the layers it is asked for (its aux layer id k is the
output of decoder layer k-1; `aux_layer_ids`): each tap layer i (id i+1) and the last layer's output before the
final norm (id num_layers), the hidden teacher. This side reads each file the worker finishes, checks that its
token ids are the sample's and its shape [T, ids, H], builds the shard Sample exactly as the HF capture does
(data_prep/capture.py capture_samples: taps joined in tap order, a compact teacher from the prep's target head),
writes it with the rank's ShardWriter and deletes the file (the worker waits while too many are unread).

Resume: samples already recorded in a split's partial manifests are not sent again; nothing is started when
every sample is recorded. Fidelity: the prep's probe batch goes first through the same engine, before any sample
is written: the prep's target head on vLLM's teacher must give vLLM's own top-1 next token at every probe position
(data_prep/fidelity.py check_engine_head; no transformers copy of the target is loaded: prep reads the head's
tensors alone), and with capture.vllm.fidelity=hf check_engine_fidelity also compares every tap and the teacher
with the target's transformers forward. Every captured sample's last position is checked the same way
(`next_token_agreement` in the summary).

Scaling: `capture.vllm.tensor_parallel_size`, `pipeline_parallel_size` and `engine_kwargs` (any other
`vllm.LLM` argument, e.g. distributed_executor_backend="ray" for one engine over several nodes) pass through.
Under torchrun every prep rank runs its own engine over its share of the samples.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from data_prep.capture import compact_teacher
from data_prep.rendered import Rendered, capture_order
from data_prep.shards import Sample, ShardSpec, ShardWriter, completed_sample_ids
from data_prep.strict_json import dumps
from models.target_head import TargetHead

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = "data_prep.vllm_worker"
INDEX = "index.jsonl"  # data_prep/vllm_worker.py INDEX
# Keys the capture sets itself; engine_kwargs may not override them (the extraction would not be this one).
RESERVED_ENGINE_KWARGS = ("model", "tokenizer", "dtype", "speculative_config", "kv_transfer_config",
                          "enable_prefix_caching", "tensor_parallel_size", "pipeline_parallel_size", "max_model_len")
PROBE = "probe:"
SAMPLE = "sample:"


class VLLMUnavailable(RuntimeError):
    """No vLLM that can run the extraction: missing, too old, or not the python named; raised before any load."""


class VLLMCaptureError(RuntimeError):
    """The worker failed or wrote a file that does not belong to its sample; the message names the file."""


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: the repository importable (the engine processes import the CPU connector from
    data_prep.vllm_worker) and a 2 GiB KV cache on a CPU build unless VLLM_CPU_KVCACHE_SPACE says otherwise."""
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


def resolve_python(configured: str | None) -> str:
    """The python that runs vLLM: `capture.vllm.python`, else this interpreter if it can import vllm."""
    if configured:
        path = Path(configured).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise VLLMUnavailable(f"capture.vllm.python={configured!r} is not an executable file")
        return str(path)
    if importlib.util.find_spec("vllm") is None:
        raise VLLMUnavailable(
            f"capture.engine=vllm: vLLM is not importable by {sys.executable} and capture.vllm.python is not set; "
            "point capture.vllm.python at the python of a vLLM install (`make .venv-vllm/bin/python` builds one)")
    return sys.executable


def check_vllm(python: str, timeout_s: float = 600.0) -> dict:
    """{"version", ...} of the vLLM `python` imports, or VLLMUnavailable naming the version found and needed.
    Imports vLLM only (no weights): seconds, before prep loads anything."""
    try:
        done = subprocess.run([python, "-m", WORKER, "--check"], capture_output=True, text=True, cwd=REPO_ROOT,
                              env=worker_env(), timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VLLMUnavailable(f"capture.vllm.python={python}: cannot run it ({e})") from e
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise VLLMUnavailable(f"capture.vllm.python={python}: the vLLM check failed (exit {done.returncode}): "
                              + " | ".join(tail))
    info = json.loads(lines[-1])
    if not info["ok"]:
        found = info["version"] or "none"
        raise VLLMUnavailable(f"capture.engine=vllm: {python} has vLLM {found}; the capture needs vLLM >= "
                              f"{info['needed']} with the extract_hidden_states speculative method and "
                              f"ExampleHiddenStatesConnector ({info['reason']})")
    return info


def aux_layer_ids(tap_layers: list[int], num_layers: int) -> tuple[list[int], list[int], int]:
    """(vLLM aux layer ids to extract, ascending and distinct; the column of each tap in their order; the teacher's
    column). Tap i (output of decoder layer i) is vLLM's id i+1, the teacher (last layer's output) is num_layers."""
    bad = [i for i in tap_layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"tap layers {bad} out of range for a {num_layers}-layer target")
    ids = sorted({i + 1 for i in tap_layers} | {num_layers})
    return ids, [ids.index(i + 1) for i in tap_layers], ids.index(num_layers)


def features_from_file(path: Path, input_ids: torch.Tensor, sample_id: str, columns: list[int], teacher: int,
                       num_ids: int, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(taps [T, n_taps*H] in tap order, teacher hidden [T, H]) from one connector file, after checking that it
    holds exactly this sample's tokens and the extracted layers' shape."""
    try:
        data = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise VLLMCaptureError(f"{path} (sample {sample_id!r}): unreadable ({e})") from e
    missing = [k for k in ("hidden_states", "token_ids") if k not in data]
    if missing:
        raise VLLMCaptureError(f"{path} (sample {sample_id!r}): no {missing} (not a hidden-states connector file)")
    hs, ids = data["hidden_states"], data["token_ids"]
    n = len(input_ids)
    if ids.shape != (n,) or not torch.equal(ids.long(), input_ids.long()):
        raise VLLMCaptureError(f"{path} (sample {sample_id!r}): its token ids ({tuple(ids.shape)}) are not the "
                               f"sample's {n} tokens")
    if hs.shape != (n, num_ids, hidden_size):
        raise VLLMCaptureError(f"{path} (sample {sample_id!r}): hidden_states {tuple(hs.shape)}, expected "
                               f"{(n, num_ids, hidden_size)} (tokens, extracted layers, hidden size)")
    taps = torch.cat([hs[:, c] for c in columns], dim=-1)
    return taps, hs[:, teacher]


def build_sample(rendered: Rendered, taps: torch.Tensor, final_hidden: torch.Tensor, spec: ShardSpec,
                 head: TargetHead) -> Sample:
    """The shard Sample data_prep/capture.py capture_samples builds for the same features."""
    teacher = {}
    if spec.teacher != "hidden":
        device = head.lm_head.weight.device
        got = compact_teacher(head, final_hidden[None].to(device), spec.teacher, spec.teacher_topk)
        teacher = {k: v[0].cpu() for k, v in got.items()}
    return Sample(sample_id=rendered.conversation_id, input_ids=rendered.input_ids, loss_mask=rendered.loss_mask,
                  taps=taps, teacher_hidden=final_hidden if spec.teacher == "hidden" else None, **teacher)


@dataclass
class VLLMJob:
    """What one capture run through vLLM does: the target, the layers, the engine's settings and the work dir."""

    python: str
    model: str  # an HF directory or hub id vLLM loads
    dtype: str
    max_model_len: int
    tap_layers: list[int]
    num_layers: int
    hidden_size: int
    work_dir: Path
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    engine_kwargs: dict = field(default_factory=dict)
    max_pending_files: int = 64
    chunk_tokens: int = 1 << 16
    log_path: Path | None = None
    stats: dict = field(default_factory=dict)  # the worker's last index line (start-up and capture seconds)


def stream_features(job: VLLMJob, items: list[tuple[str, torch.Tensor]], poll_s: float = 0.05,
                    logprobs: frozenset[str] = frozenset()):
    """Run the worker on `items` ((key, token ids), in order) and yield (key, taps, teacher hidden, engine) as its
    files arrive, deleting each once yielded; `engine`: vLLM's own next-token choice (data_prep/vllm_worker.py
    next_tokens: its greedy next token, and for the keys in `logprobs` its top-1 at every position). The worker
    is stopped if the consumer stops early or fails."""
    ids, columns, teacher = aux_layer_ids(job.tap_layers, job.num_layers)
    shutil.rmtree(job.work_dir, ignore_errors=True)  # a crashed run's unread files: not recorded, redone
    job.work_dir.mkdir(parents=True)
    samples_file = job.work_dir / "samples.jsonl"
    samples_file.write_text("".join(dumps({"id": k, "input_ids": t.tolist(), "logprobs": k in logprobs}) + "\n"
                                    for k, t in items))
    request = {"model": job.model, "dtype": job.dtype, "max_model_len": job.max_model_len, "layer_ids": ids,
               "out_dir": str(job.work_dir / "out"), "samples_file": str(samples_file),
               "tensor_parallel_size": job.tensor_parallel_size, "pipeline_parallel_size": job.pipeline_parallel_size,
               "engine_kwargs": job.engine_kwargs, "max_pending_files": job.max_pending_files,
               "chunk_tokens": job.chunk_tokens}
    (job.work_dir / "request.json").write_text(dumps(request, indent=1))
    out = job.work_dir / "out"
    out.mkdir()
    log_path = job.log_path or job.work_dir / "vllm.log"
    tokens = dict(items)
    with open(log_path, "w") as log:
        proc = subprocess.Popen([job.python, "-m", WORKER, "--request", str(job.work_dir / "request.json")],
                                cwd=REPO_ROOT, env=worker_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: vLLM's engine processes stop with it
        try:
            offset, pending = 0, ""
            while True:
                index = out / INDEX
                chunk = ""
                if index.exists():
                    with open(index) as f:
                        f.seek(offset)
                        chunk = f.read()
                        offset = f.tell()
                lines = (pending + chunk).split("\n")
                pending = lines.pop()  # a line without its newline yet
                for line in filter(None, lines):
                    entry = json.loads(line)
                    if entry.get("done"):
                        job.stats = entry
                        proc.wait()
                        return
                    key, path = entry["id"], out / entry["file"]
                    taps, final = features_from_file(path, tokens[key], key, columns, teacher, len(ids),
                                                     job.hidden_size)
                    yield key, taps, final, {k: v for k, v in entry.items() if k not in ("id", "file", "tokens")}
                    path.unlink()
                if not lines and proc.poll() is not None:
                    tail = log_path.read_text().strip().splitlines()[-5:] if log_path.exists() else []
                    raise VLLMCaptureError(f"the vLLM capture worker exited with {proc.returncode} before finishing "
                                           f"(log: {log_path}): " + " | ".join(tail))
                if not lines:
                    time.sleep(poll_s)
        finally:
            _stop(proc)


def _stop(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    if proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def capture_splits(job: VLLMJob, spec: ShardSpec, head: TargetHead,
                   splits: dict[str, tuple[list[Rendered], Path]], rank: int, tokens_per_shard: int,
                   probe: list[torch.Tensor] | None = None,
                   check_probe: Callable[[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[dict]],
                                         dict] | None = None) -> tuple[dict[str, dict], dict | None]:
    """Capture every split's samples not yet recorded (split -> (rendered samples, shard set root)) through ONE
    vLLM engine, each written by its split's ShardWriter in capture order. `probe` (token id sequences) goes
    first; `check_probe(probe, taps, teachers, engine)` judges it before any sample is written (its result is
    returned; `engine`: vLLM's own top-1 per position, stream_features). Per split: samples, tokens, seconds,
    skipped_already_done, bytes_written, as pipeline.capture_split, and `next_token_agreement`: of the samples
    captured, the share whose last position's teacher gives, through `head`, the token vLLM itself chose."""
    writers, todo, stats = {}, {}, {}
    for split, (samples, root) in splits.items():
        writers[split] = ShardWriter(root, spec, rank=rank, tokens_per_shard=tokens_per_shard)
        done = completed_sample_ids(root)
        todo[split] = {s.conversation_id: s for s in capture_order(samples) if s.conversation_id not in done}
        stats[split] = {"samples": len(todo[split]), "tokens": 0, "seconds": 0.0,
                        "skipped_already_done": len(samples) - len(todo[split]), "bytes_written": 0}
    items = [(f"{PROBE}{i}", ids) for i, ids in enumerate(probe or [])]
    probe_keys = frozenset(k for k, _ in items)
    items += [(f"{SAMPLE}{split}:{sid}", s.input_ids) for split in todo for sid, s in todo[split].items()]
    fidelity = None
    if any(todo.values()):
        got_probe: dict[str, tuple[torch.Tensor, torch.Tensor, dict]] = {}
        agreed = {split: 0 for split in todo}
        start = time.perf_counter()
        for key, taps, final, engine in stream_features(job, items, logprobs=probe_keys):
            if key.startswith(PROBE):
                got_probe[key] = (taps, final, engine)
                if len(got_probe) == len(probe) and check_probe is not None:
                    order = [got_probe[f"{PROBE}{i}"] for i in range(len(probe))]
                    fidelity = check_probe(probe, *map(list, zip(*order)))
                continue
            split, sid = key[len(SAMPLE):].split(":", 1)
            sample = build_sample(todo[split][sid], taps, final, spec, head)
            writers[split].add(sample)
            stats[split]["tokens"] += len(sample)
            agreed[split] += int(head_choice(head, final[-1]) == engine["next_token"])
        # one engine serves every split: its wall time (start-up excluded) is shared by their tokens
        elapsed = time.perf_counter() - start - (job.stats.get("startup_s") or 0.0)
        total = sum(s["tokens"] for s in stats.values()) or 1
        for split, s in stats.items():
            s["seconds"] = elapsed * s["tokens"] / total
            s["vllm_startup_s"] = job.stats.get("startup_s")
            s["next_token_agreement"] = agreed[split] / s["samples"] if s["samples"] else None
    for split, writer in writers.items():
        writer.close()
        stats[split]["bytes_written"] = writer.bytes_written
    return stats, fidelity


@torch.no_grad()
def head_choice(head: TargetHead, teacher_row: torch.Tensor) -> int:
    """The target's greedy token after a position, from its teacher hidden state through the prep's head."""
    return int(head.logits(teacher_row.to(head.lm_head.weight.device)[None]).argmax(-1)[0])


def ready(configured_python: str | None) -> str:
    """The vLLM python prep's capture will run, checked (vLLM importable, new enough): call before any load."""
    python = resolve_python(configured_python)
    check_vllm(python)
    return python


def capture_prep(cfg, preset, model, head, spec: ShardSpec, tap_layers: list[int],
                 splits: dict[str, tuple[list[Rendered], Path]], part: int, probe: tuple[torch.Tensor, torch.Tensor],
                 out: Path, python: str) -> tuple[dict[str, dict], dict]:
    """Prep's capture stage through vLLM (data_prep/pipeline.py run, capture.engine=vllm): every split of this
    rank in one engine, the probe batch checked first: the head against vLLM's own top-1 at every position
    (data_prep/fidelity.py check_engine_head), and, where prep loaded the transformers target (`model` not None:
    capture.vllm.fidelity=hf or regeneration on it), every tap against its forward (check_engine_fidelity).
    Returns (stats per split, the probe's fidelity result or {} when nothing was left)."""
    from data_prep.fidelity import check_engine_fidelity, check_engine_head
    from data_prep.targets import model_path

    v = cfg.capture.vllm
    job = VLLMJob(python=python, model=model_path(preset), dtype=cfg.dtype or preset.dtype,
                  max_model_len=cfg.max_len + 1, tap_layers=tap_layers, num_layers=preset.num_layers,
                  hidden_size=preset.hidden_size, work_dir=out / f".vllm_capture.r{part}",
                  tensor_parallel_size=v.tensor_parallel_size, pipeline_parallel_size=v.pipeline_parallel_size,
                  engine_kwargs=dict(v.engine_kwargs), max_pending_files=v.max_pending_files,
                  chunk_tokens=v.chunk_tokens, log_path=out / f"vllm_capture.r{part}.log")
    ids, mask = probe
    sequences = [ids[i][mask[i].bool()] for i in range(ids.shape[0])]

    def judge(seqs, taps, teachers, engine) -> dict:
        result = check_engine_head(head, seqs, teachers, engine)
        print(f"vLLM capture fidelity ({result['dtype']}, {result['tokens']} probe tokens): the prep's head on vLLM's "
              f"teacher gives vLLM's own top-1 at {result['argmax_agreement']:.4f} of the positions, log-probability "
              f"of that token within {result['max_logprob_diff']:.3g}")
        if model is not None:
            result["hf"] = check_engine_fidelity(model, head, tap_layers, seqs, taps, teachers)
            rel = max(v for k, v in result["hf"]["max_rel_diff"].items() if k.startswith("tap "))
            print(f"vLLM capture against the transformers forward: max relative difference taps {rel:.3g}, teacher "
                  f"{result['hf']['max_rel_diff']['teacher']:.3g}; argmax agreement "
                  f"{result['hf']['argmax_agreement']:.3f}")
        return result

    stats, fidelity = capture_splits(job, spec, head, splits, part, cfg.capture.tokens_per_shard, sequences, judge)
    shutil.rmtree(job.work_dir, ignore_errors=True)
    return stats, fidelity or {}
