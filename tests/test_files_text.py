"""Reading text (`files.read_lines`, `files.iter_lines`, `translate.LineChunks`) where it is not what
it should be: a read that fails (EIO), UTF-16 or UTF-32 text, a line with no end. Each test failed
before its fix."""

import errno
import io
import os
import threading

import pytest

import aiayn.files
from aiayn.errors import AiaynError
from aiayn.files import MAX_LINE_BYTES, file_sha256, iter_lines, read_lines
from aiayn.translate import LineChunks

TEXT = "ein Mann läuft\nder Hund\nein Kind spielt\n"


class _FailingRaw(io.RawIOBase):
    """A file whose reads give `data`, then fail with EIO (a failing disk, a dropped network share)."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        if not self.data:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        n = min(len(b), len(self.data))
        b[:n] = self.data[:n]
        self.data = self.data[n:]
        return n


@pytest.fixture
def failing_open(monkeypatch):
    """Every file aiayn.files opens reads the first line of TEXT, then fails with EIO."""
    def fail(path, *args, **kwargs):
        return io.BufferedReader(_FailingRaw(TEXT.split("\n")[0].encode() + b"\n"), 4)

    monkeypatch.setattr(aiayn.files, "_open_text_file", fail)
    monkeypatch.setattr(aiayn.files, "_open_file", fail)


def test_a_read_that_fails_is_one_line_naming_the_file(tmp_path, failing_open):
    """read_lines let the bare OSError out (`aiayn evaluate: error: Input/output error`: no file), and
    iter_lines called a plain file's EIO "corrupt or truncated gzip file"."""
    path = tmp_path / "ref.en"
    path.write_text(TEXT, encoding="utf-8")
    want = f"{path}: cannot read (Input/output error); check the disk or network share it is on, then try again"
    with pytest.raises(AiaynError) as e:
        read_lines(path)
    assert str(e.value) == want
    with pytest.raises(AiaynError) as e:
        list(iter_lines(path))
    assert str(e.value) == want
    with pytest.raises(AiaynError) as e:
        file_sha256(path)
    assert str(e.value) == want


WIDE = [("utf-16-le", "UTF-16LE", "every other byte is NUL", "UTF-16LE"),
        ("utf-16-be", "UTF-16BE", "every other byte is NUL", "UTF-16BE"),
        ("utf-32-le", "UTF-32LE", "three bytes in four are NUL", "UTF-32LE"),
        ("utf-32-be", "UTF-32BE", "three bytes in four are NUL", "UTF-32BE"),
        ("utf-16", "UTF-16LE", "it starts with a UTF-16 byte-order mark", "UTF-16"),  # (Python writes LE)
        ("utf-32", "UTF-32LE", "it starts with a UTF-32 byte-order mark", "UTF-32")]


@pytest.mark.parametrize("codec, kind, sign, iconv", WIDE)
def test_utf16_and_utf32_text_is_refused_saying_how_to_convert_it(tmp_path, codec, kind, sign, iconv):
    """Without a byte-order mark, ASCII in UTF-16 (every other byte a NUL) read as valid UTF-8 with
    NULs: each "\\n\\0" made a line more (evaluate: "misaligned"); with one, it was "invalid UTF-8
    (byte 0xff at column 1)", naming no encoding."""
    path = tmp_path / "in.txt"
    path.write_bytes(TEXT.encode(codec))
    want = f"{path}: {kind} text ({sign}), not UTF-8; convert the file to UTF-8 (iconv -f {iconv} -t UTF-8)"
    with pytest.raises(AiaynError) as e:
        read_lines(path)
    assert str(e.value) == want
    with pytest.raises(AiaynError) as e:
        list(iter_lines(path))
    assert str(e.value) == want
    with open(path, "rb") as f, pytest.raises(AiaynError) as e:
        list(LineChunks(f, "in.txt"))
    assert str(e.value) == (f"in.txt: {kind} text ({sign}), not UTF-8; convert the input to UTF-8 "
                            f"(iconv -f {iconv} -t UTF-8)")


@pytest.mark.parametrize("data, want", [
    (b"ein\x00Mann\nder Hund\x00\x00\n", ["ein\x00Mann", "der Hund\x00\x00"]),  # a few NULs in UTF-8 text
    (b"\x00\n", ["\x00"]),  # one NUL: too little to tell
    ("Čeština ĀĂĄ\n".encode(), ["Čeština ĀĂĄ"]),
])
def test_utf8_text_with_nul_bytes_is_read_as_before(tmp_path, data, want):
    path = tmp_path / "in.txt"
    path.write_bytes(data)
    assert read_lines(path) == list(iter_lines(path)) == want
    with open(path, "rb") as f:
        assert [line for chunk in LineChunks(f, "in.txt") for line in chunk] == want


def _long_input(path, length):
    with open(path, "wb") as f:
        f.write(b"one\ntwo\n")
        f.write(b"x" * length)
        f.write(b"\nthree\n")


def test_a_line_past_the_cap_is_refused_by_number(tmp_path):
    """A line of more than MAX_LINE_BYTES (a file with no newlines; /dev/zero) was read whole into
    memory, without limit on a stream."""
    path = tmp_path / "in.txt"
    _long_input(path, MAX_LINE_BYTES + 1)
    want = (f"{path}:3: no end of line in 16 MiB; aiayn reads text, one sentence a line: check that the file is "
            "text, or break the line")
    with pytest.raises(AiaynError) as e:
        read_lines(path)
    assert str(e.value) == want
    with pytest.raises(AiaynError) as e:
        list(iter_lines(path))
    assert str(e.value) == want
    got = []
    with open(path, "rb") as f, pytest.raises(AiaynError) as e:
        for chunk in LineChunks(f, "in.txt", max_lines=1):
            got.append(chunk)
    assert got == [["one"], ["two"]]  # the lines before it are handed out first
    assert str(e.value) == ("in.txt:3: no end of line in 16 MiB; aiayn reads text, one sentence a line: check that "
                            "the input is text, or break the line (--input)")


def test_a_line_at_the_cap_is_read(tmp_path):
    path = tmp_path / "in.txt"
    _long_input(path, MAX_LINE_BYTES)
    want = ["one", "two", "x" * MAX_LINE_BYTES, "three"]
    assert read_lines(path) == want
    assert list(iter_lines(path)) == want
    with open(path, "rb") as f:
        assert [line for chunk in LineChunks(f, "in.txt") for line in chunk] == want


def test_a_gzip_file_is_held_to_the_cap_once_unpacked(tmp_path):
    import gzip

    path = tmp_path / "in.txt.gz"
    path.write_bytes(gzip.compress(b"one\n" + b"x" * (MAX_LINE_BYTES + 1)))
    with pytest.raises(AiaynError, match=r"in.txt.gz:2: no end of line in 16 MiB"):
        read_lines(path)
    with pytest.raises(AiaynError, match=r"in.txt.gz:2: no end of line in 16 MiB"):
        list(iter_lines(path))


def test_an_endless_stream_of_nuls_stops_at_the_cap(tmp_path):
    """`aiayn translate < /dev/zero`: the buffer grew until the memory ran out (here a pipe fed 4x
    the cap, then closed)."""
    r, w = os.pipe()

    def feed() -> None:
        block = b"\x00" * (1 << 20)
        try:
            for _ in range(4 * MAX_LINE_BYTES // len(block)):
                os.write(w, block)
        except BrokenPipeError:
            pass
        finally:
            os.close(w)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        with open(r, "rb", closefd=False) as f, pytest.raises(AiaynError, match=r"^<stdin>:1: no end of line"):
            list(LineChunks(f, "<stdin>"))
    finally:
        os.close(r)
        writer.join(timeout=60)
    assert not writer.is_alive()
