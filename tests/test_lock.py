"""The lock of a data folder shared by several machines: a live holder, here or on another machine,
is waited for; a dead one here, or one silent for `max_age` seconds anywhere, is taken over."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from aiayn.data.lock import OWNER, FolderLock, parse_work_name, stale, work_name


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _foreign_lock(path: Path, host: str, pid: int, age: float = 0.0) -> None:
    path.mkdir()
    (path / OWNER).write_text(f"{host} {pid}\n")
    if age:
        t = time.time() - age
        os.utime(path / OWNER, (t, t))


def test_a_fresh_lock_of_another_machine_is_waited_for(tmp_path):
    lock = tmp_path / ".bin.lock"
    _foreign_lock(lock, "othermachine", 1)
    said: list[str] = []
    threading.Timer(1.0, lambda: (lock / OWNER).unlink() or lock.rmdir()).start()  # the holder finishes
    t0 = time.monotonic()
    with FolderLock(lock, said.append, poll=0.05):
        assert time.monotonic() - t0 >= 0.9
        assert (lock / OWNER).read_text().split()[1] == str(os.getpid())
    assert said == [f"waiting for othermachine:1, which holds {lock}"]
    assert not lock.exists()


def test_an_abandoned_lock_is_taken_over(tmp_path):
    here = socket.gethostname().replace("-", "_")
    for i, (host, pid, age) in enumerate([("othermachine", 1, 3600.0), (here, _dead_pid(), 0.0)]):
        lock = tmp_path / f".bin{i}.lock"
        _foreign_lock(lock, host, pid, age)
        t0 = time.monotonic()
        with FolderLock(lock, poll=0.05, max_age=600):
            assert time.monotonic() - t0 < 5
        assert not lock.exists()


def test_a_lock_of_another_machine_is_abandoned_after_three_minutes_without_a_touch(tmp_path):
    """A job restarted on new machines after a preemption waits minutes, not ten, for the lock its
    killed run left (the holder touches it every 30 s)."""
    lock = tmp_path / ".bin.lock"
    _foreign_lock(lock, "othermachine", 1, 200.0)
    t0 = time.monotonic()
    with FolderLock(lock, poll=0.05):
        assert time.monotonic() - t0 < 5
    _foreign_lock(lock, "othermachine", 1, 100.0)
    assert not FolderLock(lock).abandoned()


def test_the_heartbeat_keeps_the_holder_and_its_marks_fresh(tmp_path):
    mark = tmp_path / "mark"
    mark.touch()
    old = time.time() - 3600
    os.utime(mark, (old, old))
    with FolderLock(tmp_path / ".x.lock", beat=0.05) as lock:
        lock.marks.append(mark)
        time.sleep(0.3)
        assert not stale(mark, "othermachine", 1, max_age=60)


def test_work_names_carry_host_and_pid():
    name = work_name(".bin.prepare")
    host, pid = parse_work_name(name)
    assert pid == os.getpid() and host and name.startswith(".bin.prepare-")
    assert parse_work_name(".bin.prepare-4242") == (None, 4242)  # an older name: its age decides


def test_a_lock_left_under_our_own_pid_is_taken_over_at_once(tmp_path):
    """A container restarted after a kill gets the same pids: the lock its last life left holds our
    pid, alive because it is us, and must not be waited for until it is STALE."""
    here = socket.gethostname().replace("-", "_")
    lock = tmp_path / ".bin.lock"
    _foreign_lock(lock, here, os.getpid())
    t0 = time.monotonic()
    with FolderLock(lock, poll=0.05):
        assert time.monotonic() - t0 < 5
    assert not lock.exists()


def test_a_lock_whose_owner_cannot_be_written_is_not_left_behind(tmp_path, monkeypatch):
    """A full disk between the lock folder's mkdir and its owner file left a folder with no owner:
    every later holder waited the three minutes a lock of no known owner gets before it is taken."""
    import errno

    import pytest

    lock = tmp_path / ".x.lock"
    write = Path.write_text

    def full(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if self.name == OWNER:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError):
        with FolderLock(lock):
            pass
    assert not lock.exists()
