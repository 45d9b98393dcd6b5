"""Preemption: SIGTERM or SIGUSR1 ends training or prep cleanly, resumable, with exit status PREEMPTED.

SLURM and Kubernetes send SIGTERM some time before SIGKILL; SLURM's `--signal=USR1@N` sends SIGUSR1 N seconds
before the time limit. While `StopSignals` is installed, either signal only sets a flag:

- training (train/trainer.py) all-reduces the flag at every optimizer-step boundary (one int), so a signal seen
  by any one rank stops every rank after the same step: they write a checkpoint at that step, rank 0 writes
  summary.json ("preempted": the signal's name) and every rank exits with PREEMPTED. `train.resume=true` continues
  from that checkpoint as from any other.
- prep (data_prep/pipeline.py) holds one StopSignals for its whole run: the transformers capture finishes the batch
  in flight, a vLLM regeneration or capture stops at once (also when the server got the signal too and exited), any
  other stage at its end; the samples captured go into a last shard (recorded in this rank's manifest) and it exits
  with PREEMPTED; a rerun skips what is recorded, as after a crash.

PREEMPTED is 75, EX_TEMPFAIL of sysexits.h ("a temporary failure; retry"): distinct from success (0), a bug (1) and
a user error (2, launch/errors.py). Each worker exits with it; torchrun itself reports the workers' statuses and
exits 1, so a job script reads the run's own record (summary.json "preempted") to decide on a requeue
(launch/slurm/train.sbatch).

torchrun's agent forwards the signals it handles (its --signals-to-handle, by default SIGTERM, SIGINT, SIGHUP,
SIGQUIT) to its workers and SIGKILLs them after --shutdown-timeout seconds (30 by default). SIGUSR1 is not among
them: by default it kills the launcher (and, through launch/paths.py, its workers) before anything is saved. Add it
(`--signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1`), or signal the workers themselves.
"""

from __future__ import annotations

import logging
import os
import signal
from types import FrameType

PREEMPTED = 75  # EX_TEMPFAIL: the exit status of a run stopped by STOP_SIGNALS, resumable
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

log = logging.getLogger("preemption")


class Preempted(SystemExit):
    """Raised at the end of a stopped run, on every rank: exits with PREEMPTED (no traceback; a sweep stops)."""

    def __init__(self, signum: int):
        super().__init__(PREEMPTED)
        self.signum = signum


class StopSignals:
    """While installed (a context manager), STOP_SIGNALS set `received` (the last signal's number) instead of
    ending the process. Restores the previous handlers on exit, except when Preempted leaves it (the process then
    exits with PREEMPTED, STOP_SIGNALS ignored). In the main thread only (Python's rule)."""

    def __init__(self, what: str):
        self.what, self.received = what, 0
        self._previous: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if not self.received:
            log.warning("%s received by pid %d: %s stops at the next boundary and writes what it has",
                        signal.Signals(signum).name, os.getpid(), self.what)
        self.received = signum

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is not None and issubclass(kind, Preempted):
            # The process is on its way out with PREEMPTED: torchrun SIGTERMs the workers still running when the
            # first one exits, which must not turn a rank's clean exit into a death by signal. Ignored, not left to
            # the handler: Python resets its handlers to the default early in interpreter shutdown.
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def agreed(self, device=None, group=None) -> int:
        """COLLECTIVE when torch.distributed is initialised: the largest signal number any rank (of `group`, default
        all) received (0: none), the same on every rank, so all ranks stop after the same step."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())


def ignore_stop_signals(worker_id: int = 0) -> None:
    """A DataLoader worker's init (worker_init_fn): STOP_SIGNALS ignored. SLURM signals every process of a job step,
    and a loader worker ended by the signal would fail the training step that waits on it instead of letting the
    training process stop at its step boundary; the loader ends its workers itself when training stops."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def signal_name(signum: int) -> str | None:
    return signal.Signals(signum).name if signum else None


def die_with_launcher() -> None:
    """Under torchrun (Linux): SIGKILL this process when its parent, the launcher, dies (infra/processes.py
    die_with_parent): torchrun starts each worker in a session of its own, so a kill -9 of the launcher would
    otherwise leave the workers training (writing checkpoints a resume started afterwards races). Only under
    torchrun: a plain `python launch/...` started in the background still outlives its shell."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from infra.processes import die_with_parent

        die_with_parent(signal.SIGKILL, parent=os.getppid())
