"""From a review of `aiayn evaluate` given inputs that are all streams (`--hyp-file <(yes a) --ref-file
<(yes a)`): with no file to measure them by, the first was read whole before the others, so two that
never end filled the memory (here: "out of memory" under the child's address-space limit), one that
ends was not seen while another went on, and one writer of both waited for ever on a reader of one.
They are read together as their bytes come, each to MAX_STREAM_LINES or MAX_STREAM_BYTES at most,
until one ends; the others then to its count and a line."""

import io
import os
import re
import subprocess
import sys

import pytest
from test_evaluate_streams import LINED_UP, _evaluate, endless, files  # noqa: F401 (fixtures)

PAST = ("goes on past 1,000,000 lines or 256 MiB, as far as evaluate reads a stream when all its inputs are streams "
        "(pipes, devices): give one of them as a file (the others are read to its count)\n")


@pytest.mark.parametrize("line", ["a", "a" * 1000], ids=["short lines", "long lines"])
def test_two_endless_streams_are_refused_at_the_limit(endless, line):
    """Short lines reach MAX_STREAM_LINES (2 MB of `yes a`), long ones MAX_STREAM_BYTES first."""
    h, r = endless(f"yes {line}"), endless(f"yes {line}")
    got = _evaluate("--hyp-file", h, "--ref-file", r)
    assert got.returncode == 2, got.stderr[-500:]
    assert re.fullmatch(f"aiayn evaluate: error: (--hyp-file {h}|--ref-file {r}) {re.escape(PAST)}", got.stderr), \
        got.stderr[-500:]


@pytest.mark.parametrize("pack", ["", " | gzip -1"], ids=["plain", "gzip"])
def test_endless_hypotheses_are_measured_against_a_reference_stream_that_ends(files, endless, pack):
    h, r = files
    endless_h, ref = endless(f"yes a{pack}"), endless(f"cat {r}{pack}")
    got = _evaluate("--hyp-file", endless_h, "--ref-file", ref)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: --hyp-file {endless_h} has more than 2 "
                                               f"hypotheses but {ref} has 2 references; {LINED_UP}\n")


def test_endless_hypotheses_on_standard_input_beside_a_reference_stream(files, endless):
    h, r = files
    source = subprocess.Popen(["sh", "-c", "yes a"], stdout=subprocess.PIPE, start_new_session=True)
    try:
        got = _evaluate("--hyp-file", "-", "--ref-file", ref := endless(f"cat {r}"), stdin=source.stdout)
    finally:
        os.killpg(source.pid, 9)
        source.wait()
        source.stdout.close()
    assert (got.returncode, got.stderr) == (2, "aiayn evaluate: error: --hyp-file - (standard input) has more than 2 "
                                               f"hypotheses but {ref} has 2 references; {LINED_UP}\n")


def test_a_stream_that_goes_on_slowly_is_refused_once_another_has_ended(files, endless):
    """Three lines, then the writer waits (a log followed): it was read first, whole, for ever."""
    h, r = files
    slow = endless("""sh -c 'printf "a\\nb\\nc\\n"; exec sleep 600'""")
    ref = endless(f"cat {r}")
    got = _evaluate("--hyp-file", slow, "--ref-file", ref)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: --hyp-file {slow} has more than 2 "
                                               f"hypotheses but {ref} has 2 references; {LINED_UP}\n")


def test_streams_from_one_writer_are_read_together(tmp_path):
    """One writer, a line to each in turn (more than a pipe holds): reading one whole first, the writer
    waited on the other, and both for ever."""
    h, r = tmp_path / "h", tmp_path / "r"
    os.mkfifo(h)
    os.mkfifo(r)
    writer = subprocess.Popen(["sh", "-c", f'exec 3>{h} 4>{r}; i=0; while [ $i -lt 4000 ]; do '
                                           f'echo "line $i of the test" >&3; echo "line $i of the test" >&4; '
                                           'i=$((i+1)); done'], start_new_session=True)
    try:
        got = _evaluate("--hyp-file", str(h), "--ref-file", str(r), "--json")
    finally:
        os.killpg(writer.pid, 9)
        writer.wait()
    assert got.returncode == 0 and got.stderr == "", got.stderr[-500:]
    assert '"bleu": 100.0' in got.stdout and '"n": 4000' in got.stdout


def test_streams_that_end_are_scored_and_counted_exactly(files, endless):
    h, r = files
    got = _evaluate("--hyp-file", endless(f"cat {h}"), "--ref-file", endless(f"cat {r}"), "--json")
    assert got.returncode == 0 and got.stderr == "" and '"n": 2' in got.stdout, got.stderr
    hyps, short = endless(f"cat {h}"), endless(f"head -1 {r}")
    got = _evaluate("--hyp-file", hyps, "--ref-file", endless(f"cat {r}"), short)
    # the stream that ends first is the measure: whether the hypotheses' end is seen before the short
    # reference's is the writers' timing, and so is the wording (both true)
    assert got.returncode == 2 and got.stderr in (
        f"aiayn evaluate: error: {hyps} has 2 hypotheses but {short} has 1 references; {LINED_UP}\n",
        f"aiayn evaluate: error: --hyp-file {hyps} has more than 1 hypotheses but {short} has 1 references; {LINED_UP}\n",
    ), got.stderr


class _Chunks(io.RawIOBase):
    """A stream that gives the pieces it was made with, one a read."""

    def __init__(self, *pieces: bytes) -> None:
        self.pieces = list(pieces)

    def readable(self):
        return True

    def read(self, n=-1):
        return self.pieces.pop(0) if self.pieces else b""


def _read_all(s) -> None:
    while not s.done:
        s.step()


def test_stream_lines_lowered_keeps_the_lines_asked_for():
    """`lower` drops the lines read past its count, and calls them more; with none past it yet, one
    read more tells; a stream found longer than its first count stays longer at the same count."""
    from aiayn.files import StreamLines  # (here: the module's other tests run on the code before it)

    s = StreamLines(_Chunks(b"a\nb\n", b"c\n"), "s", 10)
    s.step()
    s.step()
    s.lower(1)
    assert (s.done, s.more, s.lines()) == (True, True, ["a"])
    s = StreamLines(_Chunks(b"a\nb\n"), "s", 10)
    s.step()
    s.lower(2)
    _read_all(s)
    assert (s.ended, s.lines()) == (True, ["a", "b"])
    s = StreamLines(_Chunks(b"a\nb\n", b"c"), "s", 10)
    s.step()
    s.lower(2)
    _read_all(s)
    assert (s.more, s.lines()) == (True, ["a", "b"])
    s = StreamLines(_Chunks(b"a\nb\nc"), "s", 2)  # (at its count; the "c" after it read, and gone)
    s.step()
    s.lower(2)
    assert (s.done, s.more, s.lines()) == (True, True, ["a", "b"])


def test_one_stream_named_twice_is_refused(files, endless):
    """A FIFO as --hyp-file and --ref-file, or - and /dev/stdin: one reader got all of the stream and the
    other nothing, said as "file is empty" (or, the FIFO's writer gone, a wait). Refused before any read."""
    h, r = files
    fifo = endless(f"cat {r}")
    got = _evaluate("--hyp-file", fifo, "--ref-file", fifo)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: --ref-file {fifo} is the stream --hyp-file "
                                               f"{fifo} names too: a pipe or device is read once; give the text as a "
                                               "file to read it twice\n")
    with open(r, "rb") as text:
        source = subprocess.Popen(["cat"], stdin=text, stdout=subprocess.PIPE)
        try:
            got = _evaluate("--hyp-file", "-", "--ref-file", "/dev/stdin", stdin=source.stdout)
        finally:
            source.stdout.close()
            source.wait()
    assert got.returncode == 2 and got.stderr.startswith(
        "aiayn evaluate: error: --ref-file /dev/stdin is the stream --hyp-file - (standard input) names too"), got.stderr
