"""From a second review of `aiayn evaluate` given streams. A gzip stream was unpacked by GzipFile, whose read
waits for a whole window (1 MiB of text) or the end: one that goes on slowly (a line, then a writer that waits)
was waited on for ever, beside streams or a file that had ended, and read together with other streams it held
them all up. And a stream found to hold exactly the lines asked for read one byte more at once, waiting on it
alone, as did a stream whose first byte came alone (to see whether it is gzip): a writer that feeds another pipe
first waited on a reader waiting on it."""

import gzip
import io
import subprocess
import sys

import pytest
from test_evaluate_streams import _CHILD, LINED_UP, endless  # noqa: F401 (a fixture)

from aiayn.errors import AiaynError
from aiayn.files import read_stream_lines

# Lines packed as gzip and flushed (as a writer that syncs does), then a writer that goes on waiting
_SLOW_GZIP = """
import sys, time, zlib
packer = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
sys.stdout.buffer.write(packer.compress(sys.argv[1].encode()) + packer.flush(zlib.Z_SYNC_FLUSH))
sys.stdout.buffer.flush()
time.sleep(600)
"""

# One writer of three pipes: the hypotheses, whole; a while later the first reference's lines, as many; then the
# second's, more than a pipe holds (its size set to a page), before it closes the first
_ONE_WRITER = """
import fcntl, sys, time
h, r1, r2 = (open(p, "wb", buffering=0) for p in sys.argv[1:4])
fcntl.fcntl(r2, fcntl.F_SETPIPE_SZ, 4096)
h.write(b"a b\\nc d\\n")
h.close()
time.sleep(1)  # (the hypotheses seen to end: the references are read to their count)
r1.write(b"a b\\nc d\\n")
r2.write(b"a b\\nc d\\n" + b"e\\n" * 2500)  # (waits until evaluate reads this pipe)
r1.close()
r2.close()
"""


def _evaluate(*argv):
    return subprocess.run([sys.executable, "-c", _CHILD, *argv], stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=30)


@pytest.fixture
def slow_gzip(endless, tmp_path):
    script = tmp_path / "slow_gzip.py"
    script.write_text(_SLOW_GZIP, encoding="utf-8")
    return lambda text: endless(f"{sys.executable} {script} '{text}'")


def test_a_gzip_stream_that_goes_on_slowly_is_refused_once_a_reference_stream_has_ended(endless, slow_gzip):
    slow, ref = slow_gzip("a b\nc d\ne f\n"), endless("printf 'a b\\nc d\\n'")
    got = _evaluate("--hyp-file", slow, "--ref-file", ref)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: --hyp-file {slow} has more than 2 "
                                               f"hypotheses but {ref} has 2 references; {LINED_UP}\n")


def test_a_gzip_stream_that_goes_on_slowly_is_refused_beside_a_reference_file(slow_gzip, tmp_path):
    (ref := tmp_path / "r.txt").write_text("a b\nc d\n", encoding="utf-8")
    slow = slow_gzip("a b\nc d\ne f\n")
    got = _evaluate("--hyp-file", slow, "--ref-file", str(ref))
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: --hyp-file {slow} has more than 2 "
                                               f"hypotheses but {ref} has 2 references; {LINED_UP}\n")


def test_a_slow_gzip_reference_does_not_hold_up_another_stream(endless, slow_gzip):
    """The gzip reference has given three lines and waits; the hypotheses' stream ends a while later, at two."""
    slow = slow_gzip("a b\nc d\ne f\n")
    hyps = endless("""sh -c 'printf "a b\\n"; sleep 1; printf "c d\\n"'""")
    got = _evaluate("--hyp-file", hyps, "--ref-file", slow)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: {hyps} has 2 hypotheses but --ref-file "
                                               f"{slow} has more than 2 references; {LINED_UP}\n")


def test_a_stream_at_its_count_is_not_waited_on_alone(tmp_path):
    fifos = [str(tmp_path / name) for name in ("h", "r1", "r2")]
    for fifo in fifos:
        subprocess.run(["mkfifo", fifo], check=True)
    (script := tmp_path / "writer.py").write_text(_ONE_WRITER, encoding="utf-8")
    writer = subprocess.Popen([sys.executable, str(script), *fifos])
    try:
        got = _evaluate("--hyp-file", fifos[0], "--ref-file", fifos[1], fifos[2])
    finally:
        writer.kill()
        writer.wait()
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: {fifos[0]} has 2 hypotheses but --ref-file "
                                               f"{fifos[2]} has more than 2 references; {LINED_UP}\n")


def test_a_first_line_come_alone_does_not_hold_up_another_stream(endless):
    """The hypotheses' first line is empty, one byte, and the writer waits: a second byte was waited for (to see
    whether the stream is gzip) before the reference, empty, was read."""
    hyps = endless("""sh -c 'printf "\\n"; exec sleep 600'""")
    ref = endless("""sh -c 'sleep 0.5; exec printf ""'""")
    got = _evaluate("--hyp-file", hyps, "--ref-file", ref)
    assert (got.returncode, got.stderr) == (2, f"aiayn evaluate: error: {ref}: file is empty\n")


def _members(*texts: bytes) -> bytes:
    return b"".join(gzip.compress(t) for t in texts)


@pytest.mark.parametrize("packed, lines", [
    (_members(b"a\nb\n", b"c\n"), ["a", "b", "c"]),  # (cat a.gz b.gz)
    (_members(b"a\nb\n") + b"\0" * 5 + _members(b"c\n"), ["a", "b", "c"]),  # (padding between members)
    (_members(b"a\n" * 3_000_000), ["a"] * 3_000_000),  # (a window's text held in the unpacker, its input used up)
], ids=["members", "padding", "held text"])
def test_gzip_text_is_unpacked_whole(packed, lines):
    assert read_stream_lines(io.BytesIO(packed), "x.gz") == lines


@pytest.mark.parametrize("packed", [gzip.compress(b"a\n")[:-3], gzip.compress(b"a\n") + b"junk"],
                         ids=["truncated", "trailing junk"])
def test_a_corrupt_gzip_stream_is_one_line(packed):
    with pytest.raises(AiaynError, match=r"^x\.gz: corrupt or truncated gzip file \(.+\); download or copy it again$"):
        read_stream_lines(io.BytesIO(packed), "x.gz")

