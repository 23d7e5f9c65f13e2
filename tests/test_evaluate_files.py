"""`aiayn evaluate` at its files: a read that fails, UTF-16 text, a line with no end, standard input
that is a socket or non-blocking. Each test but the last failed before its fix."""

import errno
import io
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

import aiayn.files
from aiayn import cli
from aiayn.files import MAX_LINE_BYTES

HYPS = "a dog runs in the park\ntwo men play football\n"
REFS = "A dog is running in the park\ntwo men are playing soccer\n"


@pytest.fixture
def files(tmp_path):
    h, r = tmp_path / "h.txt", tmp_path / "r.txt"
    h.write_text(HYPS, encoding="utf-8")
    r.write_text(REFS, encoding="utf-8")
    return h, r


def test_a_read_that_fails_names_the_file(files, monkeypatch, capsys):
    """EIO while reading --ref-file was `aiayn evaluate: error: Input/output error`: no file, nothing to do."""
    h, r = files
    real_open = aiayn.files._open_text_file

    class Failing(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, b):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    def open_text(path, *args):
        return io.BufferedReader(Failing()) if str(path) == str(r) else real_open(path, *args)

    monkeypatch.setattr(aiayn.files, "_open_text_file", open_text)
    assert cli.main(["evaluate", "--hyp-file", str(h), "--ref-file", str(r)]) == 2
    assert capsys.readouterr().err == (f"aiayn evaluate: error: {r}: cannot read (Input/output error); check the "
                                       "disk or network share it is on, then try again\n")


def test_utf16_hypotheses_are_refused_not_called_misaligned(files, capsys):
    """UTF-16LE without a byte-order mark read as UTF-8 with NULs, one line more per "\\n\\0":
    "h.txt has 3 hypotheses but r.txt has 2 references; the files must be line-aligned"."""
    h, r = files
    h.write_bytes(HYPS.encode("utf-16-le"))
    assert cli.main(["evaluate", "--hyp-file", str(h), "--ref-file", str(r)]) == 2
    assert capsys.readouterr().err == (f"aiayn evaluate: error: {h}: UTF-16LE text (every other byte is NUL), not "
                                       "UTF-8; convert the file to UTF-8 (iconv -f UTF-16LE -t UTF-8)\n")


def test_a_line_with_no_end_is_refused(files, capsys):
    """A reference file of NULs with no newline (/dev/zero as --ref-file grew without limit) was read
    whole, then called misaligned."""
    h, r = files
    r.write_bytes(b"A dog\n" + b"\x00" * (MAX_LINE_BYTES + 1))
    assert cli.main(["evaluate", "--hyp-file", str(h), "--ref-file", str(r)]) == 2
    assert capsys.readouterr().err == (f"aiayn evaluate: error: {r}:2: no end of line in 16 MiB; aiayn reads text, "
                                       "one sentence a line: check that the file is text, or break the line\n")


def _evaluate(stdin, *argv):
    return subprocess.run([sys.executable, "-m", "aiayn", "evaluate", *argv, "--json"], stdin=stdin,
                          capture_output=True, text=True, timeout=300)


def test_standard_input_that_is_a_socket_is_read(files):
    """`--hyp-file -` opened /dev/stdin anew, which fails where standard input is a socket (a child of
    Node.js, of inetd or systemd): "/dev/stdin: cannot read (No such device or address)"."""
    h, r = files
    a, b = socket.socketpair()
    with a, b:
        a.sendall(h.read_bytes())
        a.shutdown(socket.SHUT_WR)
        got = _evaluate(b, "--hyp-file", "-", "--ref-file", str(r))
    assert got.returncode == 0 and got.stderr == "", got.stderr
    assert '"n": 2' in got.stdout


def test_standard_input_left_non_blocking_is_waited_for(files):
    """Read as it is (not opened anew), a standard input left non-blocking (O_NONBLOCK on a pipe shared
    with another program) must still be read whole."""
    import fcntl

    h, r = files
    rd, wr = os.pipe()
    fcntl.fcntl(rd, fcntl.F_SETFL, fcntl.fcntl(rd, fcntl.F_GETFL) | os.O_NONBLOCK)

    def write() -> None:  # a line at once, the other once the reader has found nothing more there
        first, second = h.read_bytes().split(b"\n", 1)
        os.write(wr, first + b"\n")
        time.sleep(3)
        os.write(wr, second)
        os.close(wr)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        got = _evaluate(rd, "--hyp-file", "-", "--ref-file", str(r))
    finally:
        os.close(rd)
        writer.join(timeout=60)
    assert got.returncode == 0 and got.stderr == "", got.stderr
    assert '"n": 2' in got.stdout
