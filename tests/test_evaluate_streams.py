"""`aiayn evaluate` given a stream that never ends (`--ref-file <(yes a)`, a FIFO, standard input):
each input but one is read to one line past the count it must match, and refused in one line; it
was read until the memory ran out. The commands run in a child whose address space is held to 1 GiB
over what it needs, so that the old code failed (MemoryError) instead of filling the machine."""

import gzip
import io
import os
import subprocess
import sys

import pytest

from aiayn.files import read_stream_lines_upto

HYPS = "a dog runs in the park\ntwo men play football\n"
REFS = "A dog is running in the park\ntwo men are playing soccer\n"
LINED_UP = "the files must be line-aligned"

# The child: aiayn evaluate, its address space limited once the modules it loads (torch) are in
_CHILD = """
import resource, sys
import aiayn.evaluate, aiayn.translate
from aiayn import cli
with open("/proc/self/status") as f:
    size = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
sys.exit(cli.main(["evaluate", *sys.argv[1:]]))
"""


@pytest.fixture
def files(tmp_path):
    h, r = tmp_path / "h.txt", tmp_path / "r.txt"
    h.write_text(HYPS, encoding="utf-8")
    r.write_text(REFS, encoding="utf-8")
    return str(h), str(r)


@pytest.fixture
def endless(tmp_path):
    """`endless(command)`: a FIFO that `command` (a shell line) writes to until it is killed."""
    started = []

    def start(command="yes a"):
        fifo = tmp_path / f"endless{len(started)}"
        os.mkfifo(fifo)
        # (the shell waits to open the FIFO until evaluate opens it; killed below if it never does)
        started.append(subprocess.Popen(["sh", "-c", f"exec {command} > {fifo}"], start_new_session=True))
        return str(fifo)

    yield start
    for p in started:
        os.killpg(p.pid, 9)
        p.wait()


def _evaluate(*argv, stdin=subprocess.DEVNULL):
    return subprocess.run([sys.executable, "-c", _CHILD, *argv], stdin=stdin, capture_output=True, text=True,
                          timeout=60)


def _endless_stdin(command="yes a"):
    return subprocess.Popen(["sh", "-c", command], stdout=subprocess.PIPE, start_new_session=True)


def test_an_endless_reference_file_is_refused(files, endless):
    h, r = files
    fifo = endless()
    got = _evaluate("--hyp-file", h, "--ref-file", fifo)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: {h} has 2 hypotheses but --ref-file {fifo} "
                                               f"has more than 2 references; {LINED_UP}\n")


def test_an_endless_gzip_reference_stream_is_refused(files, endless):
    h, r = files
    fifo = endless("yes a | gzip -1")
    got = _evaluate("--hyp-file", h, "--ref-file", fifo)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: {h} has 2 hypotheses but --ref-file {fifo} "
                                               f"has more than 2 references; {LINED_UP}\n")


def test_an_endless_second_reference_file_is_refused(files, endless):
    h, r = files
    fifo = endless()
    got = _evaluate("--hyp-file", h, "--ref-file", r, fifo)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: {h} has 2 hypotheses but --ref-file {fifo} "
                                               f"has more than 2 references; {LINED_UP}\n")


def test_endless_references_on_standard_input_are_refused(files):
    h, r = files
    source = _endless_stdin()
    try:
        got = _evaluate("--hyp-file", h, "--ref-file", r, "-", stdin=source.stdout)
    finally:
        os.killpg(source.pid, 9)
        source.wait()
        source.stdout.close()
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: {h} has 2 hypotheses but --ref-file - "
                                               f"(standard input) has more than 2 references; {LINED_UP}\n")


def test_endless_hypotheses_are_measured_against_a_reference_file(files, endless):
    """The references are a file, the hypotheses a stream: the file is read first, the stream to its
    count and a line."""
    h, r = files
    fifo = endless()
    got = _evaluate("--hyp-file", fifo, "--ref-file", r)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: --hyp-file {fifo} has more than 2 hypotheses "
                                               f"but {r} has 2 references; {LINED_UP}\n")


def test_an_endless_source_file_is_refused_before_a_model_is_loaded(files, endless, tmp_path):
    h, r = files
    fifo = endless()
    got = _evaluate("--checkpoint", str(tmp_path), "--src-file", fifo, "--ref-file", r)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: --src-file {fifo} has more than 2 source "
                                               f"lines but {r} has 2 references; {LINED_UP}\n")


def test_streams_that_end_are_read_and_scored(files, endless):
    """Hypotheses on standard input, references from a FIFO (all streams: the hypotheses are read
    whole, the references to their count); a short one is still counted exactly."""
    h, r = files
    with open(h, "rb") as stdin:
        got = _evaluate("--hyp-file", "-", "--ref-file", endless(f"cat {r}"), "--json", stdin=stdin)
    assert got.returncode == 0 and got.stderr == "" and '"n": 2' in got.stdout, got.stderr
    with open(h, "rb") as stdin:
        got = _evaluate("--hyp-file", "-", "--ref-file", fifo := endless(f"head -1 {r}"), stdin=stdin)
    assert (got.returncode, got.stderr) == (2, "aiayn evaluate: error: standard input has 2 hypotheses but "
                                               f"{fifo} has 1 references; {LINED_UP}\n")


class _Trickle(io.RawIOBase):
    """A stream that gives a byte a read: each line's end falls at the end of a piece."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def readable(self):
        return True

    def read(self, n=-1):
        piece, self.data = self.data[:1], self.data[1:]
        return piece


@pytest.mark.parametrize("data, most, want", [
    (b"a\nb\n", 2, (["a", "b"], False)),
    (b"a\nb", 2, (["a", "b"], False)),
    (b"a\nb\nc", 2, (["a", "b"], True)),
    (b"a\nb\n\n", 2, (["a", "b"], True)),  # (an empty line is a line)
    (b"a\r\nb\r\nc\r\n", 5, (["a", "b", "c"], False)),
    ("\ufeffä\nb\n".encode(), 1, (["ä"], True)),
])
def test_read_stream_lines_upto(data, most, want):
    assert read_stream_lines_upto(io.BytesIO(data), "s", most) == want
    assert read_stream_lines_upto(_Trickle(data), "s", most) == want
    assert read_stream_lines_upto(io.BytesIO(gzip.compress(data)), "s", most) == want
    assert read_stream_lines_upto(_Trickle(gzip.compress(data)), "s", most) == want


def test_references_that_begin_with_blank_lines_are_counted_not_called_empty(tmp_path, endless, capsys):
    """A reference whose first lines (as many as the hypotheses) are blank, with text after them, was
    called empty once read only that far ("r.txt: file is empty"): a stream of them (`yes ''`) is more
    lines than the hypotheses, a file of them has its count said exactly (it is read whole), and one
    of blank lines alone is empty."""
    from aiayn.cli import main

    h = tmp_path / "h.txt"
    h.write_text(HYPS, encoding="utf-8")
    r, blank = tmp_path / "r.txt", tmp_path / "blank.txt"
    r.write_text("\n\nx y\n", encoding="utf-8")
    blank.write_text("\n\n", encoding="utf-8")
    for ref, said in ((r, "has 3 references"), (blank, "blank.txt: file is empty")):
        assert main(["evaluate", "--hyp-file", str(h), "--ref-file", str(ref)]) == 2
        assert said in capsys.readouterr().err
    r = _evaluate("--hyp-file", str(h), "--ref-file", endless("yes ''"))
    assert r.returncode == 2 and "has more than 2 references" in r.stderr and LINED_UP in r.stderr, r.stderr


def test_a_gzip_file_of_one_endless_line_is_refused_as_it_unpacks(tmp_path, files):
    """A gzip file read whole was unpacked whole before any line was checked: 2 MB of gzip members
    that unpack to 2 GiB of zeros (no newline) took 4.4 GB (here: MemoryError under the child's
    limit). It is unpacked a window at a time under the 16 MiB line cap."""
    bomb = tmp_path / "h.gz"
    member = gzip.compress(bytes(16 << 20), compresslevel=1)
    with open(bomb, "wb") as f:
        for _ in range(128):
            f.write(member)
    r = _evaluate("--hyp-file", str(bomb), "--ref-file", files[1])
    assert r.returncode == 2 and "h.gz:1: no end of line in 16 MiB" in r.stderr, r.stderr[-500:]
