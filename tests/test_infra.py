"""The floor (infra/): weights files follow the umask like every other file, and the directory lock says where
the shared filesystem's flock does not reach across nodes."""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import pytest
import torch

from infra.dirlock import DirLock, mount_of, node_local_locks
from infra.files import save_safetensors

MOUNTS = """/dev/sda1 / ext4 rw,relatime 0 0
10.0.0.1@tcp:/scratch /lustre lustre rw,localflock 0 0
10.0.0.1@tcp:/proj /lustre/proj lustre rw,flock 0 0
nfs:/home /shared nfs4 rw,vers=4.2 0 0
beegfs_nodev /beegfs beegfs rw 0 0
bucket /buckets/b1 fuse.gcsfuse rw 0 0
"""


@pytest.mark.parametrize(("path", "mount", "node_local"), [
    ("/lustre/prep/m1", ("/lustre", "lustre"), True),  # localflock: this node only
    ("/lustre/proj/prep", ("/lustre/proj", "lustre"), False),  # the longest mount point wins; flock: coherent
    ("/shared/runs/r1", ("/shared", "nfs4"), False),
    ("/beegfs/prep", ("/beegfs", "beegfs"), True),
    ("/buckets/b1/prep", ("/buckets/b1", "fuse.gcsfuse"), True),
    ("/data/prep", ("/", "ext4"), False),
])
def test_filesystems_whose_flock_stays_on_one_node_are_named(path: str, mount: tuple, node_local: bool) -> None:
    point, fstype, options = mount_of(Path(path), MOUNTS)
    assert (point, fstype) == mount
    assert (node_local_locks(fstype, options) is not None) == node_local


def test_a_lock_on_a_node_local_mount_warns_naming_it(tmp_path: Path, monkeypatch) -> None:
    import infra.dirlock as dirlock

    monkeypatch.setattr(dirlock, "mount_of", lambda d: ("/lustre", "lustre", ["rw", "localflock"]))
    with pytest.warns(UserWarning, match=r"on /lustre, lustre\): this Lustre mount uses localflock.*"
                                         r"--dependency=singleton"), DirLock(tmp_path, "prep"):
        pass
    monkeypatch.setattr(dirlock, "mount_of", lambda d: ("/", "ext4", ["rw"]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with DirLock(tmp_path, "prep"):
            pass


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_weights_files_follow_the_umask(tmp_path: Path, mask: int) -> None:
    old = os.umask(mask)
    try:
        save_safetensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
        (tmp_path / "config.json").write_text("{}")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "model.safetensors").stat().st_mode)
    assert mode == 0o666 & ~mask == stat.S_IMODE((tmp_path / "config.json").stat().st_mode)


def test_a_preps_files_are_readable_as_its_config_is(tiny_prep_dir: Path) -> None:
    """Shards, the draft vocabulary, the target head and the rendered samples get the mode of summary.json beside
    them (the umask's), not safetensors' own 0600: a shared prep is readable by the group."""
    expected = stat.S_IMODE((tiny_prep_dir / "summary.json").stat().st_mode)
    files = sorted(tiny_prep_dir.rglob("*.safetensors"))
    assert len(files) >= 4
    assert {str(f.relative_to(tiny_prep_dir)): stat.S_IMODE(f.stat().st_mode) for f in files} == {
        str(f.relative_to(tiny_prep_dir)): expected for f in files}
