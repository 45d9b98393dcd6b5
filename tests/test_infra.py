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


# ---------------------------------------------------------------------------------- infra/processes.py
def _processes_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def test_free_port_is_one_that_can_be_bound() -> None:
    import socket

    from infra.processes import free_port

    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_peak_rss_mb_is_positive_and_grows_with_memory_touched() -> None:
    """50 MiB written raise the peak, in a fresh small process: Linux carries the peak of the process that forked
    across exec, so the measuring process is started by a small intermediate one, not by pytest (whose peak is
    hundreds of MiB)."""
    import json
    import subprocess
    import sys

    code = ("import json; from infra.processes import peak_rss_mb\n"
            "before = peak_rss_mb()\n"
            "buf = bytearray(50 * 2**20)\n"
            "buf[::4096] = b'\\x01' * len(range(0, len(buf), 4096))  # every page written: resident\n"
            "print(json.dumps([before, peak_rss_mb()]))\n")
    via = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]]).returncode)"
    r = subprocess.run([sys.executable, "-c", via, code], capture_output=True, text=True, env=_processes_env(),
                       timeout=60)
    assert r.returncode == 0, r.stderr
    before, after = json.loads(r.stdout)
    assert before > 0
    assert after - before >= 40, (before, after)


def _process_gone(pid: int) -> bool:
    """No process `pid`, or a zombie (dead, not yet reaped by whoever inherited it)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat_line.rsplit(")", 1)[1].split()[0] in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")
def test_a_child_that_calls_die_with_parent_dies_when_its_parent_is_killed(tmp_path: Path) -> None:
    """The test starts P; P starts C, which arms die_with_parent and says so; SIGKILL to P takes C with it."""
    import contextlib
    import signal
    import subprocess
    import sys
    import time

    armed = tmp_path / "armed"
    child = ("import os, signal, sys, time\n"
             "from infra.processes import die_with_parent\n"
             "assert die_with_parent(signal.SIGKILL, parent=os.getppid())\n"
             "open(sys.argv[1], 'w').close()\n"
             "time.sleep(120)\n")
    parent = ("import subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]])\n"
              "print(c.pid, flush=True)\n"
              "time.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", parent, child, str(armed)], stdout=subprocess.PIPE, text=True,
                         env=_processes_env())
    c_pid = None
    try:
        c_pid = int(p.stdout.readline())
        deadline = time.monotonic() + 30
        while not armed.exists():
            assert p.poll() is None and not _process_gone(c_pid), "the child died before arming die_with_parent"
            assert time.monotonic() < deadline, "the child never armed die_with_parent"
            time.sleep(0.05)
        assert not _process_gone(c_pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        deadline = time.monotonic() + 10
        while not _process_gone(c_pid):
            assert time.monotonic() < deadline, f"child {c_pid} outlived its SIGKILLed parent by 10 s"
            time.sleep(0.05)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()
        if c_pid is not None and not _process_gone(c_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(c_pid, signal.SIGKILL)
