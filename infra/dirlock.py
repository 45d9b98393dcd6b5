"""One writer per output directory: an exclusive lock on `<dir>/.lock`, held by rank 0 of the job that writes it.

Two preps into one directory, or two trainings into one run directory, would interleave their files (the last
writer's samples under the first one's settings, two metrics streams in one metrics.jsonl). `claim` takes
`fcntl.flock(LOCK_EX | LOCK_NB)` on the lock file and writes the holder's host and pid into it; a second job is
refused at once with an error naming them. The kernel drops a flock when its holder's file is closed, which
includes the holder dying (kill -9 too): a stale lock file never blocks. The file itself stays (removing it would
let a third job lock a fresh inode while the second still holds the old one).

Only rank 0 locks (an exclusive lock per directory would refuse a job's own other ranks); the other ranks wait for
its outcome (a broadcast) and stop with it, so nothing is written by a refused job.

Across nodes the lock is only as good as the shared filesystem's flock (`node_local_locks` reads the mount from
/proc/mounts and warns where it is known not to exclude across nodes):
- NFS: the Linux client emulates flock with a POSIX lock held by the server, which does exclude other nodes, but
  is dropped as soon as the holding process closes any descriptor of the lock file (nothing in the project opens
  it twice; a tool that reads `.lock` from inside the holding process would silently free it).
- Lustre: mounted with `flock`, coherent across nodes; with `localflock` it locks this node only, silently; with
  `noflock` the lock fails and is skipped with a warning.
- BeeGFS: node-local unless the client sets `tuneUseGlobalFileLocks`; FUSE filesystems (object-store mounts):
  often no locks at all.
- GPFS, CephFS, local disks: as documented by flock.
Where the lock cannot exclude across nodes, do what it would have enforced by hand: one prep or training job per
directory at a time (a SLURM job dependency, `--dependency=singleton` with one job name per directory).
"""

from __future__ import annotations

import errno
import fcntl
import os
import pickle
import socket
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

LOCK_FILE = ".lock"


def mount_of(directory: Path, mounts: str | None = None) -> tuple[str, str, list[str]]:
    """(mount point, filesystem type, mount options) of the mount holding `directory` (/proc/mounts: the longest
    mount point that is a prefix of its real path); ("", "", []) where /proc/mounts cannot be read."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return "", "", []
    path = str(Path(directory).resolve())
    best = ("", "", [])
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best[0]):
            best = (point, fields[2], fields[3].split(","))
    return best


def node_local_locks(fstype: str, options: list[str]) -> str | None:
    """Why flock on such a mount does not exclude writers on other nodes (None: it does, as far as is known)."""
    if fstype == "lustre" and "localflock" in options:
        return "this Lustre mount uses localflock: its flock locks this node only"
    if fstype == "beegfs":
        return "BeeGFS flock is node-local unless the client sets tuneUseGlobalFileLocks"
    if fstype.startswith("fuse"):
        return f"a FUSE filesystem ({fstype}) may not lock across nodes, or at all"
    return None


class DirLocked(RuntimeError):
    """Another live process holds the directory's lock."""


class DirLock:
    """The held lock on one directory; `release()` (or closing the process) frees it."""

    def __init__(self, directory: Path, what: str):
        self.directory, self.what = Path(directory), what
        self.path = self.directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> DirLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirLocked(f"{self.directory}: another {self.what} writes this directory (held by "
                            f"{_holder(self.path)}, lock file {self.path}); wait for it to end or stop it, "
                            "or choose another directory") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # a filesystem without locks (some NFS mounts): say so rather than refuse every run on it
            warnings.warn(f"{self.directory}: this filesystem does not support flock ({e.strerror}); a second "
                          f"{self.what} into this directory would not be refused", stacklevel=2)
            return self
        point, fstype, options = mount_of(self.directory)
        why = node_local_locks(fstype, options)
        if why is not None:
            warnings.warn(f"{self.directory} (on {point}, {fstype}): {why}, so a second {self.what} started on "
                          "another node would not be refused: run one job per directory at a time (e.g. SLURM's "
                          "--dependency=singleton)", stacklevel=2)
        os.ftruncate(fd, 0)
        os.write(fd, f"host={socket.gethostname()} pid={os.getpid()}\n".encode())
        os.fsync(fd)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def __enter__(self) -> DirLock:
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(path: Path) -> str:
    """The holder's "host=<h> pid=<p>" (it writes the line right after locking: a short retry covers that gap)."""
    for _ in range(20):
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return text
        time.sleep(0.05)
    return "an unknown process"


def holding(directory: str | Path, what: str) -> AbstractContextManager:
    """One process (no ranks): `with holding(dir, what):` holds `dir`'s lock for the block; a directory that does not
    exist is not created (nothing in it to protect: the caller's own check names it)."""
    return DirLock(Path(directory), what) if Path(directory).is_dir() else nullcontext()


def claim(directory: str | Path, what: str, rank: int = 0, world: int = 1,
          check: Callable[[], None] | None = None) -> DirLock | None:
    """Rank 0: lock `directory` for this job, then run `check` (e.g. refuse or clear another run's files) while
    holding it -> the held lock (keep it until the job ends). A refusal (DirLocked, or what `check` raises) is raised
    on every rank: with world > 1 (a process group initialised) the others learn it from a broadcast, so a refused
    job stops on every rank before writing anything."""
    lock, error = None, None
    if rank == 0:
        try:
            lock = DirLock(Path(directory), what).acquire()
            if check is not None:
                check()
        except Exception as e:  # any failure, so the other ranks stop with it instead of waiting forever
            if lock is not None:
                lock.release()
            lock, error = None, e
            try:
                pickle.dumps(error)  # the broadcast pickles it
            except Exception:
                error = RuntimeError(f"{type(e).__name__}: {e}")
    if world > 1:
        import torch.distributed as dist

        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise error
    return lock
