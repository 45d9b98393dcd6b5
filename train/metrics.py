"""Rank-0 metrics: always a local metrics.jsonl, optionally wandb (offline by default), tqdm progress.

Every record is one JSON line `{"kind": "train"|"eval"|"summary", "step": n, ...}` so a loss curve,
a resume check or a sweep summary is a few lines of reading, with or without wandb.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from data_prep.conversations import json_error
from data_prep.shards import writing
from infra.strict_json import dumps
from train.config import LoggerConfig

log = logging.getLogger("train")

METRICS_FILE = "metrics.jsonl"  # a run's records, one JSON object a line
RUN_SUMMARY = "summary.json"  # a run's last record, written when it finishes


def memory_stats() -> dict[str, float]:
    """Current and peak host RSS (MB) and, on CUDA, peak allocated device memory (MB)."""
    out = {"rss_mb": _rss_mb(), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        out["cuda_max_alloc_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return out


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:  # not Linux: the peak is the best we have
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def flatten(metrics: dict[str, Any]) -> dict[str, Any]:
    """{"acc": [a0, a1]} -> {"acc_0": a0, "acc_1": a1}: per-step lists as scalar series (wandb, tables)."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, list):
            out.update({f"{k}_{i}": x for i, x in enumerate(v)})
        else:
            out[k] = v
    return out


class MetricsLogger:
    """No-op on ranks other than 0, so the trainer can call it unconditionally."""

    def __init__(
        self, cfg: LoggerConfig, run_dir: Path, rank: int, config: dict, total_steps: int, start_step: int
    ):
        """`start_step` > 0 (a resume) drops records after that step left by the interrupted run, so the
        file reads as one uninterrupted run."""
        self.enabled = rank == 0
        self.path = run_dir / METRICS_FILE
        self._wandb = None
        self._bar = None
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            kept = [r for r in read_metrics(self.path) if start_step > 0 and r["step"] <= start_step]
            kept = [r for r in kept if r["kind"] != "summary"]
            self.path.write_text("".join(dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a")
        if cfg.wandb_mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=cfg.project,
                name=cfg.name or run_dir.name,
                dir=str(run_dir),
                mode=cfg.wandb_mode,
                config=config,
                reinit="finish_previous",  # a sweep runs several jobs in one process
            )
        if cfg.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True, file=sys.stderr)

    def log(self, kind: str, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        record = {"kind": kind, "step": step, "time": time.time(), **_plain(metrics)}
        if not self.enabled:
            return record
        with writing(self.path):
            self._file.write(dumps(record) + "\n")
            self._file.flush()
        if self._wandb is not None:
            self._wandb.log({f"{kind}/{k}": v for k, v in flatten(_plain(metrics)).items()}, step=step)
        if self._bar is not None and kind == "train":
            self._bar.set_postfix(
                loss=f"{record.get('loss', float('nan')):.4f}", lr=f"{record.get('lr', 0):.2e}"
            )
        return record

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def write(self, line: str) -> None:
        """A human-readable line on rank 0 that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file.close()


def read_metrics(path: Path, kind: str | None = None) -> list[dict]:
    """The records of a metrics.jsonl, optionally of one kind. A torn last line (no newline: a crash while it
    was written) is dropped with a warning; a bad line anywhere else is an error naming it."""
    text = Path(path).read_text()
    lines = text.split("\n")
    rows = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if line_no == len(lines):  # after the last newline: the record was never completed
                log.warning("%s:%d: torn last line dropped (a crash while it was written): %.60r", path, line_no,
                            line)
                continue
            raise ValueError(f"{path}:{line_no}: not a JSON record ({json_error(e)})") from None
    return [r for r in rows if kind is None or r["kind"] == kind]


def training_clock(records: list[dict]) -> dict[int, float]:
    """Training wall seconds at each optimizer step that has a train record, held-out evaluations left out:
    the clock starts when the step-0 evaluation ends (or at the first record) and stops while an evaluation
    runs (its record is written when it ends, after the train record of its step). Checkpoint saves stay in.
    A resumed run's repeated steps keep their first time."""
    train_t: dict[int, float] = {}
    for r in records:
        if r["kind"] == "train":
            train_t.setdefault(r["step"], r["time"])
    if not train_t:
        return {}
    first_eval = next((r for r in records if r["kind"] == "eval"), None)
    start = first_eval["time"] if first_eval is not None and first_eval["step"] == 0 else records[0]["time"]
    paused: list[tuple[int, float]] = []  # (step, seconds its evaluation took)
    for r in records:
        if r["kind"] == "eval" and r["step"] > 0 and r["step"] in train_t:
            paused.append((r["step"], r["time"] - train_t[r["step"]]))
    clock = {}
    for step, t in sorted(train_t.items()):
        spent = sum(s for at, s in paused if at < step)
        clock[step] = t - start - spent
    return clock
