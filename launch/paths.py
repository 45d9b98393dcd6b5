"""What every launcher imports before any package of ours: this folder off sys.path, and conf/'s path.

`python launch/train.py` (and torchrun's form, the documented one) puts launch/ first on sys.path, where
launch/train.py and launch/eval.py would shadow the `train` and `eval` packages: importing this module
takes the folder off (as `python -m launch.train` or a [project.scripts] console script the folder is not
on sys.path, and this changes nothing). ruff's isort keeps this import first (pyproject.toml, force-to-top).
CONF_DIR is absolute because Hydra resolves a relative config_path against the calling package when a
console script runs the launcher, and conf/ is no package.

A worker started by torchrun (TORCHELASTIC_RUN_ID set) asks the kernel for SIGKILL when its parent, the launcher,
dies: torchrun starts each worker in a session of its own, so a kill -9 of the launcher would otherwise leave the
workers training (writing checkpoints a resume started afterwards races). Only under torchrun: a plain
`python launch/...` started in the background still outlives its shell.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

LAUNCH_DIR = Path(__file__).resolve().parent
CONF_DIR = LAUNCH_DIR.parent / "conf"

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != LAUNCH_DIR]


def die_with_launcher() -> None:
    """Under torchrun (Linux): SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        return  # best effort: a kernel that refuses it leaves the old behaviour
    if os.getppid() != parent:  # the launcher died between the two calls
        os.kill(os.getpid(), signal.SIGKILL)


die_with_launcher()
