"""What every launcher imports before any package of ours: this folder off sys.path, and conf/'s path.

`python launch/train.py` (and torchrun's form, the documented one) puts launch/ first on sys.path, where
launch/train.py and launch/eval.py would shadow the `train` and `eval` packages: importing this module
takes the folder off (as `python -m launch.train` or a [project.scripts] console script the folder is not
on sys.path, and this changes nothing). ruff's isort keeps this import first (pyproject.toml, force-to-top).
CONF_DIR is absolute because Hydra resolves a relative config_path against the calling package when a
console script runs the launcher, and conf/ is no package.

A worker started by torchrun dies with the launcher (infra/preemption.py die_with_launcher).
"""

from __future__ import annotations

import sys
from pathlib import Path

LAUNCH_DIR = Path(__file__).resolve().parent
CONF_DIR = LAUNCH_DIR.parent / "conf"

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != LAUNCH_DIR]


from infra.preemption import die_with_launcher  # noqa: E402 - after launch/ is off sys.path

die_with_launcher()
