"""Processes and ports: the one home of a free local port, of dying with one's parent, and of the peak memory a
process reached.

    port = free_port()            # a port nobody listens on now (torchrun's master, a vLLM server)
    die_with_parent()             # SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG)
    peak_rss_mb()                 # this process's peak resident memory so far
"""

from __future__ import annotations

import os
import signal
import socket
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (another process may take it before it is used: callers that bind it retry
    or fail clearly)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> bool:
    """Linux: `sig` is sent to this process when the thread that forked it exits (prctl PR_SET_PDEATHSIG). `parent`:
    the parent's pid as seen before the call; if it is already gone, this process gets `sig` at once (the race the
    prctl cannot close by itself). Safe between fork and exec (no allocation beyond ctypes' own). False where the
    kernel does not offer it (the old behaviour stays)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def peak_rss_mb() -> float:
    """This process's peak resident set size in MiB (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
