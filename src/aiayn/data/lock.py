"""Work on one data folder shared by several machines: a lock that needs no common process table.

`bench/wmt14.sh` runs the same download and prepare on every machine of a job, maybe against one
network folder. A process id names a process on one machine only, so neither the lock nor the
clean-up of a killed run's temporaries may trust `kill(pid, 0)` alone:

- `FolderLock` is a directory made with `mkdir` (atomic on local and network file systems) holding
  `owner` (host, pid); its holder touches `owner` every `BEAT` seconds. A waiter takes the lock
  over when the holder is a dead process on its own host, or when `owner` has not been touched for
  `STALE` seconds (a holder on another machine that was killed).
- `stale(path)` says the same of a marked temporary directory (`work_name` names it after host and
  pid; the holder's heartbeat touches its mark too).

The lock saves the second machine the work, it is not what keeps the data safe: writers use their
own temporaries and rename into place, so two holders at once (a lock taken over just as its
holder came back) still give one correct result.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Callable

from aiayn.errors import AiaynError

BEAT = 30.0  # seconds between the holder's touches of its files
# Seconds without a touch after which a lock or temporary counts as abandoned: 6 missed beats, and
# 3x the 60 s for which NFS clients may cache a file's times. (It was 10 minutes: a job restarted on
# new machines after a preemption was refused that long.)
STALE = 180.0
OWNER = "owner"


def _host() -> str:
    return socket.gethostname().replace("-", "_") or "host"


def work_name(prefix: str) -> str:
    """`prefix-HOST-PID-RANDOM`: a temporary name no other process, here or on another machine, picks."""
    return f"{prefix}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def stale(mark: Path, host: str | None, pid: int | None, max_age: float = STALE) -> bool:
    """Whether the work that `mark` (a file its writer keeps touching) belongs to is abandoned: its
    writer is a dead process on this host, or `mark` was not touched for `max_age` seconds. A writer
    of this host with our own pid is dead too: a restarted container reuses its pids (often 1), and
    no lock or temporary of ours is older than this call."""
    try:
        age = time.time() - mark.stat().st_mtime
    except FileNotFoundError:
        return True
    if host == _host() and pid is not None and (pid == os.getpid() or not _pid_alive(pid)):
        return True
    return age > max_age


def parse_work_name(name: str) -> tuple[str | None, int | None]:
    """(host, pid) from a name `work_name` made, (None, pid) from an older `prefix-PID` one."""
    parts = name.rsplit("-", 3)
    if len(parts) == 4 and parts[2].isdigit():
        return parts[1], int(parts[2])
    tail = name.rsplit("-", 1)[-1]
    return None, int(tail) if tail.isdigit() else None


class FolderLock:
    """`with FolderLock(path):` holds `path` (a directory) against every process that shares the folder."""

    def __init__(self, path: Path, log: Callable[[str], None] = lambda m: None, poll: float = 1.0,
                 max_age: float = STALE, beat: float = BEAT) -> None:
        self.path, self.log, self.poll, self.max_age, self.beat = path, log, poll, max_age, beat
        self.marks: list[Path] = []  # more files the heartbeat keeps fresh (the holder's temporaries)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "FolderLock":
        said = False
        while True:
            try:
                self.path.mkdir(parents=True)
            except FileExistsError:
                if self.path.exists() and not self.path.is_dir():  # (gone meanwhile: the next mkdir takes it)
                    raise AiaynError(f"{self.path} is a file where aiayn keeps a lock (a folder), so not aiayn's; "
                                     "move it away, then run it again") from None
                if self.abandoned():
                    self._break()
                    continue
                if not said:
                    host, pid = self._owner()
                    self.log(f"waiting for {host}:{pid}, which holds {self.path}")
                    said = True
                time.sleep(self.poll)
                continue
            try:
                (self.path / OWNER).write_text(f"{_host()} {os.getpid()}\n", encoding="utf-8")
            except BaseException:  # (a full disk, Ctrl-C): an ownerless lock kept the next holder waiting
                shutil.rmtree(self.path, ignore_errors=True)
                raise
            break
        self._thread = threading.Thread(target=self._heartbeat, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()
        shutil.rmtree(self.path, ignore_errors=True)

    def break_abandoned(self) -> None:
        """Remove the lock folder if it is `abandoned`, without waiting for a live holder."""
        if self.abandoned():
            self._break()

    def abandoned(self) -> bool:
        """Whether the lock folder there is held by no live process: its owner is a dead process of
        this host, or it is untouched for `max_age` (the owner of another machine cannot be asked)."""
        host, pid = self._owner()
        mark = self.path / OWNER if host else self.path  # owner not yet written: the folder's age
        return stale(mark, host, pid, self.max_age)

    def _owner(self) -> tuple[str | None, int | None]:
        try:
            host, pid = (self.path / OWNER).read_text(encoding="utf-8").split()
            return host, int(pid)
        except (OSError, ValueError):
            return None, None  # being written, or gone: its age decides

    def _break(self) -> None:
        """Move the abandoned lock aside under a name of our own (only one taker's rename succeeds), then remove it."""
        aside = self.path.with_name(work_name(f".{self.path.name}.broken"))
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        self.log(f"took over {self.path}: its holder is gone")
        shutil.rmtree(aside, ignore_errors=True)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.beat):
            for f in [self.path / OWNER, *self.marks]:
                try:
                    os.utime(f)
                except OSError:
                    pass
