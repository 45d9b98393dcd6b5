"""Weights files written with the mode every other file gets.

safetensors creates its files with mode 0600 whatever the process's umask, while everything the project writes
beside them (config.json, manifests, summaries) follows the umask (0644 under the usual 022): a serving account or
a teammate would read an export's config.json but not its model.safetensors, and a shared prep's shards would be
unreadable to the group. `save_safetensors` writes through safetensors and then gives the file the mode an ordinary
`open()` would have given it, before an atomic write renames it into place.
"""

from __future__ import annotations

import os
from pathlib import Path


def umask() -> int:
    """The process's umask (Linux reports it in /proc; elsewhere it is read by setting it back at once)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | Path) -> None:
    """Give `path` the mode `open()` would have created it with (0o666 less the umask)."""
    os.chmod(path, 0o666 & ~umask())


def save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors.torch.save_file, with the file's mode following the umask."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    follow_umask(path)
