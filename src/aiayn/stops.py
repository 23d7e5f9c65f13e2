"""Signals that end a command as Ctrl-C does.

SIGTERM (a `kill`, `timeout`) and SIGHUP (a closed terminal) raise `Stopped`, a KeyboardInterrupt,
so that a command's clean-up runs on the way out (`aiayn translate` keeps and counts the lines it
finished, `aiayn export` removes its unfinished folder), where their default action ended the
process mid-write (`interrupts`). A block that must not be cut in two (a chunk written and counted,
the two renames of a replace) holds all three back and raises the first once it ends (`deferred`).

Handlers are Python's, set in the main thread only (the only one that may), and never where the
process was started with the signal ignored (a background job of a script, `nohup`): that stays so.
A Python handler, not a signal mask: torch's worker threads would still take a masked signal and
interrupt the main thread anywhere inside the block.

Output whose reader is gone (a closed terminal, a `tee` ended by the same Ctrl-C) goes to /dev/null
(`away_from_hung_up_terminal`, `LogStream`) rather than stopping a run before it saves.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP, taken as Ctrl-C is; `signum` names it (a command exits 128 + signum)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def interrupts() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `Stopped` while the block runs, where their handler is the default;
    Ctrl-C raises KeyboardInterrupt as always."""
    replaced = [s for s in STOPS[1:] if _main_thread() and signal.getsignal(s) == signal.SIG_DFL]

    def stop(signum: int, frame: Any) -> None:
        if signum == signal.SIGHUP:
            away_from_hung_up_terminal()
        raise Stopped(signum)

    for s in replaced:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s in replaced:
            signal.signal(s, signal.SIG_DFL)


def away_from_hung_up_terminal() -> None:
    """On SIGHUP: stdout and stderr that are a terminal (the one just closed) go to /dev/null, so that
    the clean-up's closing lines do not fail with "Input/output error" and turn a saved stop into an
    error (train saved, then exited 1)."""
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if _terminal(fd):
                _to_null(fd)


def _to_null(fd: int) -> None:
    """Point descriptor `fd` at /dev/null."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _terminal(fd: int) -> bool:
    """Whether `fd` is a terminal, or was one: a hung-up terminal is no tty any more (isatty: False), and
    even an empty write to it fails with EIO; a file or pipe takes an empty write."""
    if os.isatty(fd):
        return True
    try:
        os.write(fd, b"")
    except OSError as e:
        return e.errno == errno.EIO
    return False


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held back while the block runs; the first that came is then raised
    as its handler would have (`interrupts`' `Stopped`, KeyboardInterrupt for Ctrl-C)."""
    if not _main_thread():
        yield
        return
    hits: list[int] = []
    previous: dict[int, Any] = {s: h for s in STOPS if (h := signal.getsignal(s)) not in (signal.SIG_IGN, None)}
    for s in previous:
        signal.signal(s, lambda signum, frame: hits.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if hits:
        handler = previous[hits[0]]
        if callable(handler):  # Ctrl-C's raises KeyboardInterrupt, `interrupts`' `Stopped`
            handler(hits[0], None)
        elif handler == signal.SIG_DFL:  # (the default's action: stop)
            raise KeyboardInterrupt if hits[0] == signal.SIGINT else Stopped(hits[0])


class LogStream:
    """The run's progress and log lines on `stream`, sent nowhere once its reader is gone: `aiayn train ... |& tee
    log` stopped by Ctrl-C or a closed terminal loses its tee to the same signal, and the broken pipe then ended
    the run before it saved, with exit 0. A log no one reads is no reason to stop training."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        unless_reader_gone(self.stream, self.stream.write, text)

    def flush(self) -> None:
        unless_reader_gone(self.stream, self.stream.flush)

    def __getattr__(self, name: str) -> Any:  # (isatty, fileno, encoding: as tqdm asks)
        return getattr(self.stream, name)

    def __eq__(self, other: object) -> bool:  # tqdm clears its bar before a line to the same stream or the other
        return bool(self.stream == getattr(other, "stream", other))  # standard one (the terminal they share)

    def __hash__(self) -> int:
        return hash(self.stream)


def unless_reader_gone(stream: Any, call: Any, *args: Any) -> None:
    """`call(*args)`, which writes to `stream`; a broken pipe or a hung-up terminal (EIO) points the stream's
    descriptor at /dev/null."""
    try:
        call(*args)
    except OSError as e:
        if e.errno not in (errno.EPIPE, errno.EIO):
            raise
        with contextlib.suppress(OSError, ValueError, AttributeError):  # (a stream with no descriptor: nothing to do)
            _to_null(stream.fileno())
