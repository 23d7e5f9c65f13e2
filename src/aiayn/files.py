"""Files: reading text, writing atomically (whole files, and streams put in place at the end),
fingerprints, and where aiayn keeps its cache.

Every module that reads a corpus or writes a file goes through here, so that the rules hold
everywhere: text is UTF-8 (strict), plain or gzip, split on "\\n" only; a written file appears
whole or not at all, with the mode a plain `open()` would give it.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import os
import re
import select
import stat
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Iterator, cast

from aiayn.errors import AiaynError


def _open_file(path: Path, name: str, expected: str) -> io.BufferedReader:
    """`path` opened for reading bytes; the one-line errors of a missing, unreadable or folder path."""
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise AiaynError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise AiaynError(f"{name}: is a directory, expected {expected}") from None
    except OSError as e:
        raise AiaynError(f"{name}: cannot read ({e.strerror or e})") from None


def _open_text_file(path: Path, flag: str = "") -> io.BufferedReader:
    """`_open_file` for a text file (named with the `flag` that gave it, if any)."""
    return _open_file(path, f"{flag} {path}" if flag else str(path),
                      "a text file (one sentence a line); give the file's path")


def check_input_file(path: str | os.PathLike[str], flag: str) -> None:
    """A text file named by `flag` opens, else one line naming the flag says why (missing, a
    folder, no permission, a pipe): before any work, where a folder read as "no such file". A corpus
    is read more than once (its sha256, then its lines), which a pipe cannot give; and opening a
    named pipe no one writes to waits for ever."""
    p = Path(path)
    with contextlib.suppress(OSError):  # (a missing or unreadable path: said below, as it opens)
        if not (stat.S_ISREG(mode := p.stat().st_mode) or stat.S_ISDIR(mode)):
            raise AiaynError(f"{flag} {p}: not a regular file (a pipe or a device?); give a file's path: "
                             "a corpus is read more than once")
    _open_text_file(p, flag).close()


# Compressed files' headers -> (name, the command that unpacks them): read as text they were "invalid
# UTF-8 ... convert the file to UTF-8", advice that does not help. bzip2's is matched whole (its
# block or end-of-stream magic after "BZh1".."BZh9"): a sentence may begin "BZh".
_COMPRESSED = ((re.compile(rb"\x1f\x8b"), "gzip", "gunzip"), (re.compile(rb"\xfd7zXZ\x00"), "xz", "xz -d"),
               (re.compile(rb"BZh[1-9](1AY&SY|\x17rE8P)"), "bzip2", "bunzip2"),
               (re.compile(rb"\x28\xb5\x2f\xfd"), "zstd", "zstd -d"), (re.compile(rb"PK\x03\x04"), "zip", "unzip"),
               (re.compile(rb"7z\xbc\xaf\x27\x1c"), "7z", "7z x"))
COMPRESSED_HEAD = 10  # bytes `refuse_compressed` looks at


def refuse_compressed(name: str | os.PathLike[str], head: bytes | bytearray, gzip_ok: bool = True) -> None:
    """A compressed file that the reader cannot read (gzip, where `gzip_ok`) is one line saying how
    to unpack it. `head`: the file's first COMPRESSED_HEAD bytes."""
    reads = "plain or gzip text" if gzip_ok else "plain UTF-8 text"
    for magic, kind, command in _COMPRESSED:
        if magic.match(head) and not (kind == "gzip" and gzip_ok):
            raise AiaynError(f"{name}: a {kind} file; aiayn reads {reads} here: unpack it first ({command})")


# The longest line read, in bytes. A sentence is a few hundred bytes and a paragraph a few thousand;
# what has no newline in 16 MiB is not text one sentence a line (/dev/zero, a binary file, text with
# another line end), and reading on would hold it all in memory, without limit on a stream.
MAX_LINE_BYTES = 16 << 20
_WINDOW = 1 << 20  # bytes `LineLengthCheck` and `read_lines` take at a time (under MAX_LINE_BYTES)


class LineLengthCheck:
    """Watches bytes as they are read, piece after piece, for a line longer than MAX_LINE_BYTES."""

    def __init__(self) -> None:
        self.open = 0  # bytes of the line not yet ended

    def past_cap(self, data: bytes | bytearray, start: int = 0) -> int | None:
        """Where in `data` (read after what came before; from `start`) a line past the cap shows: the
        offset of a window with no newline between that line's start and it, so that the line's number
        is `data.count(b"\\n", 0, offset) + 1` when `data` holds all that was read; None if none does."""
        for a in range(start, len(data), _WINDOW):
            b = min(a + _WINDOW, len(data))
            first = data.find(b"\n", a, b)
            if first < 0:
                self.open += b - a
            elif self.open + first - a > MAX_LINE_BYTES:
                return a
            else:
                self.open = b - data.rfind(b"\n", a, b) - 1
            if self.open > MAX_LINE_BYTES:
                return a
        return None


def long_line_error(name: str | os.PathLike[str], line: int, what: str = "file", flag: str = "") -> AiaynError:
    """The one line for a line past MAX_LINE_BYTES: `name`:`line`, and what to do."""
    return AiaynError(f"{name}:{line}: no end of line in {MAX_LINE_BYTES >> 20} MiB; aiayn reads text, one sentence "
                      f"a line: check that the {what} is text, or break the line{f' ({flag})' if flag else ''}")


def read_error(name: str | os.PathLike[str], e: OSError) -> AiaynError:
    """A read that failed part-way (EIO from a failing disk, a dropped network share), in one line."""
    return AiaynError(f"{name}: cannot read ({e.strerror or e}); check the disk or network share it is on, "
                      "then try again")


# UTF-16 and UTF-32 text: with a byte-order mark it is invalid UTF-8 at byte 1, and without one, where it
# is ASCII, valid UTF-8 with a NUL in every other byte (UTF-32: three in four): read so, each "\n\0" made
# a line of a NUL more (translate wrote extra lines, evaluate called the files misaligned).
ENCODING_HEAD = 4096  # bytes `refuse_wide_text` looks at
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32LE", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32BE", "UTF-32"),
         (b"\xff\xfe", "UTF-16LE", "UTF-16"), (b"\xfe\xff", "UTF-16BE", "UTF-16"))


def wide_encoding(head: bytes | bytearray) -> tuple[str, str, str] | None:
    """(encoding, the sign of it, its name for iconv) when a text's first bytes are UTF-16 or UTF-32:
    a byte-order mark, or NUL bytes where ASCII in that encoding has them (at least two, in half the
    places or more) and hardly any (a tenth at most) where it has its letters."""
    for bom, kind, iconv in _BOMS:
        if head.startswith(bom):
            return kind, f"it starts with a {iconv} byte-order mark", iconv
    if head.count(0) < 2:
        return None  # (UTF-8 text: the common case, at once)
    for width, sign in ((4, "three bytes in four are NUL"), (2, "every other byte is NUL")):
        columns = [head[k::width] for k in range(width)]  # byte k of each code unit
        nuls = [c.count(0) for c in columns]
        for order, letters in (("LE", 0), ("BE", width - 1)):
            if (nuls[letters] * 10 <= len(columns[letters])
                    and all(2 <= nuls[k] and 2 * nuls[k] >= len(columns[k]) for k in range(width) if k != letters)):
                return f"UTF-{8 * width}{order}", sign, f"UTF-{8 * width}{order}"
    return None


def refuse_wide_text(name: str | os.PathLike[str], head: bytes | bytearray, what: str = "file") -> None:
    """UTF-16 or UTF-32 text (`wide_encoding` of its first ENCODING_HEAD bytes) is one line saying
    how to convert it; `what` is "file" or "input"."""
    found = wide_encoding(head)
    if found is not None:
        kind, sign, iconv = found
        raise AiaynError(f"{name}: {kind} text ({sign}), not UTF-8; convert the {what} to UTF-8 "
                         f"(iconv -f {iconv} -t UTF-8)")


def read_lines(path: str | os.PathLike[str], blank_ok: bool = False) -> list[str]:
    """The lines of a plain or gzip UTF-8 text file, without line endings ("\\n" or "\\r\\n").

    A file with no text is an error, unless `blank_ok` (hypotheses: an empty translation is one),
    where only a file with no lines at all is.

    Lines are split on "\\n" only: `str.splitlines` would also split on characters such as
    U+2028 or U+001C that can occur inside a sentence, and shift the alignment.
    """
    path = Path(path)
    with _open_text_file(path) as f:
        return read_stream_lines(f, str(path), blank_ok)


def read_stream_lines(f: BinaryIO, name: str, blank_ok: bool = False) -> list[str]:
    """`read_lines` of an open binary stream (standard input: opening /dev/stdin fails where it is a
    socket), named `name` in messages."""
    raw = _read_all(f, name)
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called; unpacked under the line cap
        raw = _read_all(cast(BinaryIO, _Gunzip(io.BytesIO(raw), name)), name)  # (9 MB of zeros unpack to 2 GB)
    refuse_compressed(name, raw[:COMPRESSED_HEAD])
    refuse_wide_text(name, raw[:ENCODING_HEAD])
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]  # a UTF-8 byte-order mark is not part of the first sentence
    if not raw or (not blank_ok and raw.isspace()):  # (isspace: no copy of a corpus, as strip made)
        raise AiaynError(f"{name}: file is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise AiaynError(
            f"{name}:{line}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at column {col}); convert the file to UTF-8"
        ) from None
    del raw  # (the bytes, before the lines are made)
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    return [s[:-1] if s.endswith("\r") else s for s in lines]


def _read_all(f: BinaryIO, name: str) -> bytearray:
    """All of `f`, read a window at a time: a read that fails is one line naming `name`, and bytes
    with no newline in MAX_LINE_BYTES (/dev/zero) are refused before they fill the memory (gzip's
    text is checked once unpacked; its packed bytes hold a newline every 256 or so). A non-blocking
    stream with nothing yet is waited for."""
    data = bytearray()
    check = LineLengthCheck()
    while True:
        try:
            piece = _wait_read(f, _WINDOW)
        except OSError as e:
            raise read_error(name, e) from None
        if not piece:
            return data
        data += piece
        if (at := check.past_cap(data, len(data) - len(piece))) is not None:
            raise long_line_error(name, data.count(b"\n", 0, at) + 1)


_ASCII_SPACE = " \t\n\r\x0b\x0c"  # what bytes.isspace() counts as space


def read_stream_lines_upto(f: BinaryIO, name: str, most: int, blank_ok: bool = False) -> tuple[list[str], bool]:
    """The first `most` lines of `f`, as `read_stream_lines` reads them, and whether more follow: for
    a caller that can use no more (references line-aligned with hypotheses), where the rest of a
    stream that never ends (`--ref-file <(yes a)`) would fill the memory."""
    upto = _UpTo(f, name, most)
    lines = read_stream_lines(cast(BinaryIO, upto), name, blank_ok=True)  # (read() is all it needs)
    _refuse_no_text(lines, name, upto.more, blank_ok)
    return lines, upto.more


def _refuse_no_text(lines: list[str], name: str, more: bool, blank_ok: bool) -> None:
    """First lines that are blank (and nothing after them) are no text, unless `blank_ok`."""
    if not blank_ok and not more and all(not s.strip(_ASCII_SPACE) for s in lines):  # (then more: not empty)
        raise AiaynError(f"{name}: file is empty")  # (as `read_stream_lines` says of one blank line: "" is no text)


class _UpTo:
    """A binary stream that ends after the first `most` lines of `f`, gzip unpacked here (its lines
    are what is counted); `more`: something followed them, unread."""

    def __init__(self, f: BinaryIO, name: str, most: int) -> None:
        self.f, self.name, self.left, self.more, self.done = f, name, most, False, False
        self.unpacked: _Gunzip | None = None
        self.first = True

    def read(self, n: int) -> bytes:
        if self.done:
            return b""
        piece = self._next(n)
        ends = piece.count(b"\n")
        if ends < self.left or not piece:
            self.left -= ends
            self.done = not piece
            return piece
        cut = -1
        for _ in range(self.left):  # (to the end of line `most`)
            cut = piece.index(b"\n", cut + 1)
        self.left = 0  # (whether more follows: the next read says, not one here that may wait on the stream)
        self.done = self.more = len(piece) > cut + 1
        return piece[:cut + 1]

    def _next(self, n: int) -> bytes:
        if self.first:
            self.first = False
            head = _wait_read(self.f, n)
            # (one byte come, gzip's first: the next tells; after another, none is waited for here, where the
            # writer may wait on a reader of another stream)
            while head == b"\x1f" and (piece := _wait_read(self.f, n)):
                head += piece
            if head[:2] != b"\x1f\x8b":  # gzip magic, whatever the file is called
                return head
            self.unpacked = _Gunzip(self.f, self.name, head)
        if self.unpacked is None:
            return _wait_read(self.f, n)
        return self.unpacked.read(n)


class StreamLines:
    """The first `most` lines of a stream, read a piece at a time (`read_in_step`), for several streams
    read together: one read whole first may never end (`--hyp-file <(yes a) --ref-file <(yes a)`), or
    wait for ever on a writer that waits on another. `lower` reads less once it is known how many."""

    def __init__(self, f: BinaryIO, name: str, most: int) -> None:
        self.upto, self.name, self.check = _UpTo(f, name, most), name, LineLengthCheck()
        self.pieces: list[bytes] = []  # what was read (gzip: unpacked), to the end of line `most` at most
        self.ends = self.size = 0  # line ends and bytes in `pieces`

    @property
    def done(self) -> bool:
        """Read to its end, or as far as asked (then `more`)."""
        return self.upto.done

    @property
    def more(self) -> bool:
        """Something followed the lines asked for, unread."""
        return self.upto.more

    @property
    def ended(self) -> bool:
        """Read to its end."""
        return self.upto.done and not self.upto.more

    @property
    def held(self) -> bool:
        """gzip: its unpacker holds bytes or text already read, which the stream's readiness does not show."""
        return self.upto.unpacked is not None and self.upto.unpacked.held

    def fileno(self) -> int:
        return self.upto.f.fileno()

    def step(self) -> None:
        """One read of what has come (a window at most)."""
        try:
            piece = self.upto.read(_WINDOW)
        except OSError as e:
            raise read_error(self.name, e) from None
        if (at := self.check.past_cap(piece)) is not None:
            raise long_line_error(self.name, self.ends + piece.count(b"\n", 0, at) + 1)
        if piece:
            self.pieces.append(piece)
            self.ends += piece.count(b"\n")
            self.size += len(piece)

    def lower(self, most: int) -> None:
        """Read no further than line `most` of a stream not `ended` (fewer than asked before): lines
        read past it are dropped, and are more."""
        if self.ends < most:
            self.upto.left = most - self.ends
            return
        kept, seen = [], 0
        for piece in self.pieces:
            if seen + piece.count(b"\n") >= most:  # (the piece that holds the end of line `most`)
                cut = -1
                for _ in range(most - seen):
                    cut = piece.index(b"\n", cut + 1)
                if cut >= 0:
                    kept.append(piece[:cut + 1])
                break
            kept.append(piece)
            seen += piece.count(b"\n")
        size = sum(map(len, kept))
        more = self.upto.more or size < self.size  # (else nothing past it is read yet: one read more tells)
        self.upto.left, self.upto.done, self.upto.more = 0, more, more
        self.pieces, self.ends, self.size = kept, most, size

    def lines(self, blank_ok: bool = False) -> list[str]:
        """The lines read, as `read_stream_lines_upto` gives them (its checks, its messages); once."""
        pieces, self.pieces = self.pieces, []
        lines = read_stream_lines(cast(BinaryIO, _Replay(pieces)), self.name, blank_ok=True)
        _refuse_no_text(lines, self.name, self.more, blank_ok)
        return lines


def read_in_step(streams: list[StreamLines]) -> None:
    """One read of each stream not done that has something (or its end) to give, waiting for the first
    that has: so that none waits on another that goes on for ever, or on a writer held by another."""
    waiting = [s for s in streams if not s.done]
    held = [s for s in waiting if s.held]  # (these give at once: the others are not waited for)
    polled = [s for s in waiting if not s.held]
    ready = select.select(polled, [], [], 0 if held else None)[0] if polled else []
    for s in waiting:
        if s in held or s in ready:
            s.step()


class _Replay:
    """Pieces read already, as a stream, each let go once given."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces[::-1]
        pieces.clear()

    def read(self, n: int) -> bytes:
        return self.pieces.pop() if self.pieces else b""


class _Gunzip:
    """gzip's text of the stream `packed` (after `head`, its first bytes, read to see what it is), members
    one after another as `cat a.gz b.gz` gives them: a read gives what is unpacked of the bytes come (a
    window at most), waiting on `packed` only while they unpack to nothing, so that a stream that goes on
    slowly gives its lines as they come (GzipFile's read waited for a whole window, or the end). A corrupt
    or truncated stream is one line naming `name`."""

    def __init__(self, packed: Any, name: str, head: bytes = b"") -> None:
        self.packed, self.name, self.rest = packed, name, head  # rest: bytes read, not yet unpacked
        self.z = zlib.decompressobj(16 + zlib.MAX_WBITS)
        self.full = False  # the last read gave all it was asked: the unpacker may hold more of its text

    @property
    def held(self) -> bool:
        """A read may give text without waiting on the stream: bytes read wait to be unpacked, or text."""
        return bool(self.rest) or self.full

    def read(self, n: int) -> bytes:
        while True:
            if self.z.eof:  # a member ended: NUL padding, another member, or the end
                data, self.rest = self.rest or _wait_read(self.packed, _WINDOW), b""
                if not data:
                    return b""
                if not (data := data.lstrip(b"\0")):
                    continue
                self.z = zlib.decompressobj(16 + zlib.MAX_WBITS)
            else:
                data = self.rest if self.rest or self.full else _wait_read(self.packed, _WINDOW)
                if not data and not self.full:
                    raise AiaynError(f"{self.name}: corrupt or truncated gzip file (it ends before its end-of-stream "
                                     "marker); download or copy it again")
            try:
                text = self.z.decompress(data, n)  # (`n` at most: 9 MB of zeros unpack to 9 GB)
            except zlib.error as e:
                raise AiaynError(f"{self.name}: corrupt or truncated gzip file ({e}); download or copy it again") \
                    from None
            self.rest, self.full = self.z.unconsumed_tail or self.z.unused_data, len(text) == n
            if text:
                return text


def _wait_read(f: BinaryIO, n: int) -> bytes:
    """`f.read(n)`, waiting where `f` is non-blocking and has nothing yet."""
    while True:
        try:
            piece = f.read(n)
        except BlockingIOError:
            piece = None
        if piece is not None:
            return piece
        select.select([f], [], [])


def iter_lines(path: str | os.PathLike[str]) -> Iterator[str]:
    """The lines of a plain or gzip UTF-8 file, one at a time: `read_lines` for files larger than memory.

    Same rules and messages as `read_lines` (split on "\\n" only, "\\r\\n" accepted, a leading BOM
    dropped, invalid UTF-8 named by line and column, UTF-16 and a line past MAX_LINE_BYTES refused),
    except that an empty file is the caller's check: it sees no lines, or only blank ones.
    """
    path = Path(path)
    with _open_text_file(path) as raw_file:
        is_gzip = False
        number = 0
        try:
            is_gzip = raw_file.peek(2)[:2] == b"\x1f\x8b"  # gzip magic, whatever the file is called
            refuse_compressed(path, raw_file.peek(COMPRESSED_HEAD)[:COMPRESSED_HEAD])
            f = io.BufferedReader(gzip.GzipFile(fileobj=raw_file), 1 << 20) if is_gzip else raw_file
            refuse_wide_text(path, f.peek(ENCODING_HEAD)[:ENCODING_HEAD])
            readline, cap = f.readline, MAX_LINE_BYTES + 1  # (locals: once per line of a corpus)
            while raw := readline(cap):  # (a line past the cap: its first bytes only)
                number += 1
                if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
                    raise long_line_error(path, number)
                if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                    raw = raw[3:]
                raw = raw[:-1] if raw.endswith(b"\n") else raw
                raw = raw[:-1] if raw.endswith(b"\r") else raw
                try:
                    yield raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise AiaynError(
                        f"{path}:{number}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                        "convert the file to UTF-8"
                    ) from None
        except (OSError, EOFError, zlib.error) as e:
            if isinstance(e, OSError) and (not is_gzip or e.errno is not None):  # the disk's error, not gzip's
                raise read_error(path, e) from None
            raise AiaynError(f"{path}: corrupt or truncated gzip file ({e}); download or copy it again") from None


def refuse_symlink_output(out: Path, flag: str) -> None:
    """An output folder named by `flag` that is a symbolic link is refused: replacing it whole (the
    new folder swapped in, the old one moved aside) would leave the link renamed `.tmp-old-*` and the
    folder it points to untouched."""
    if out.is_symlink():
        raise AiaynError(f"{flag} {out} is a symbolic link; name the folder it points to, or choose a new {flag}")


def check_output_path(path: str | os.PathLike[str], flag: str, folder: bool = False) -> None:
    """The output `flag` names can be written: checked before any work, as one line naming the flag
    and the path (it showed once the model had loaded, or the picture was drawn, in four wordings).
    A file's path that is not a folder, in a folder that is there (none is made: a mistyped folder
    is a mistake) and takes a new file, or naming a file that may be written (in place, where its
    folder takes no new file). `folder`: the output is a folder replaced whole (export's OUT); one
    there is the caller's to judge, and missing folders above it are made as `mkdir -p` makes them,
    in the nearest one that is there."""
    name = os.fspath(path)
    if not folder and os.path.islink(name) and not os.path.exists(name):
        _check_link_to_nothing(name, flag)
        return
    with contextlib.suppress(OSError):  # (not there, or not to be reached: the folders above say why)
        is_dir = stat.S_ISDIR(os.stat(name).st_mode)
        if is_dir and not folder:
            raise AiaynError(f"{flag} {name}: is a folder; give a file's path (in it, or elsewhere)")
        if folder and not is_dir:
            raise AiaynError(f"{flag} {name}: is not a folder; choose another path")
        if not folder:  # a file of the user's, a device, a pipe: written in place if need be
            if not os.access(name, os.W_OK):
                raise AiaynError(f"{flag} {name}: cannot write it ({_no_write(name)}); choose another path")
            return
    _check_output_folder(name, flag, folder)


def _check_link_to_nothing(name: str, flag: str) -> None:
    """A link to no file yet is written through (the file made where it points): that folder is the
    one to check, and a loop of links is refused (both showed only once the work was done)."""
    try:
        os.stat(name)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise AiaynError(f"{flag} {name}: a loop of symbolic links; choose another path") from None
    _check_output_folder(os.path.realpath(name), f"{flag} {name} ->", missing_ok=False)


def _check_output_folder(name: str, flag: str, missing_ok: bool) -> None:
    """The folder that takes `name` is there (or, where `missing_ok`, the nearest one above it is),
    is a folder, not a file or a link to nothing, and may be written in."""
    parent = there = os.path.dirname(name) or "."
    while not os.path.lexists(there) and (up := os.path.dirname(there) or ".") != there:
        there = up  # the nearest of the folders above that is there
    if os.path.islink(there) and not os.path.exists(there):
        raise AiaynError(f"{flag} {name}: {there} is a symbolic link to nothing ({os.readlink(there)}); "
                         "choose another path")
    if not os.path.isdir(there):
        what = "a file, not a folder" if os.path.isfile(there) else "not a folder"
        raise AiaynError(f"{flag} {name}: {there} is {what}; choose another path")
    if not os.access(there, os.X_OK):  # (a folder not to be looked into: whether `parent` is there is unknown)
        raise AiaynError(f"{flag} {name}: cannot write in {there} ({_no_write(there)}); choose another path")
    if there != parent and not missing_ok:
        raise AiaynError(f"{flag} {name}: no folder {parent}; make it first, or choose another path")
    if not os.access(there, os.W_OK):
        raise AiaynError(f"{flag} {name}: cannot write in {there} ({_no_write(there)}); choose another path")


def _no_write(path: str) -> str:
    """Why `path` may not be written, as far as can be told without trying."""
    with contextlib.suppress(OSError):
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return "a read-only file system"
    return "no permission"


def fsync_path(path: Path) -> None:
    """Flush a file or a folder (its entries) to disk: what an atomic rename needs to survive a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, read in chunks; AiaynError if it is missing, a folder or
    unreadable (a tokenizer built from a folder's path got a bare IsADirectoryError)."""
    h = hashlib.sha256()
    with _open_file(Path(path), str(path), "a file") as f:
        try:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        except OSError as e:
            raise read_error(path, e) from None
    return h.hexdigest()


def default_cache_dir() -> Path:
    """The user cache for aiayn: $XDG_CACHE_HOME/aiayn, else ~/.cache/aiayn."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "aiayn"


def umask() -> int:
    """The process's umask, read without changing it where Linux tells it (os.umask can only be read
    by setting it, which races with threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_output_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to a file the user named, as `translate --output` writes (`ReplacingFile`): a
    plain file of theirs replaced whole, anything a new file would not stand for (a link, a device
    such as /dev/stdout, a FIFO, someone else's file, one in a folder that takes no new file) written
    in place; a new file atomically (`atomic_write_bytes`), in a folder that is there (none is made)."""
    if not os.path.lexists(path):
        atomic_write_bytes(path, data, make_parents=False)
        return
    out = ReplacingFile(str(path))
    try:
        out.stream.write(data)
        out.commit()  # (a full disk may first show here, at the flush: no hidden file left behind)
    except BaseException:
        out.discard()
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, make_parents: bool = True) -> None:
    """Write `data` to `path` through a temporary file in the same folder, fsync, then rename; the
    folders on the way made first, if `make_parents`."""
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    # (the name's first 64 bytes: a name near the 255-byte limit failed for its temporary's 14 bytes more)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{os.fsdecode(os.fsencode(path.name)[:64])}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600 files; give the mode a plain open() would
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ReplacingFile:
    """A file written as a stream, for `--output`. A file of the user's already at `path` (a plain
    file, not a link, theirs, of one name, writable, without an access control list) is written beside
    it and renamed over it by `commit`, so a run that fails or is stopped leaves it as it was, and
    `keep` saves what was written beside it. Anything else is written in place, as `open(path, "wb")`
    does: a new file (nothing to protect, and a killed run leaves its lines there; `discard` removes
    it), a device or pipe (/dev/null, /dev/stdout), a link, someone else's file, a folder that takes
    no new file."""

    def __init__(self, path: str) -> None:
        self.path, self.tmp = path, None
        self.created: os.stat_result | None = None  # the new file this made at `path`, if it made one
        if _replaceable(path):
            with contextlib.suppress(OSError):  # e.g. no right to add a file to the folder: in place
                self.stream, self.tmp = _beside(path)
                return
        try:  # a new file, known to be ours: `discard` takes it away again
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            self.stream = open(path, "wb")
            return
        self.stream = os.fdopen(fd, "wb")
        self.created = os.fstat(fd)

    def commit(self) -> None:
        """Close, and put the new file in place (on disk first: a crash then leaves one or the other)."""
        if self.tmp is not None:
            self.stream.flush()
            os.fsync(self.stream.fileno())
        self.stream.close()
        if self.tmp is not None:
            os.replace(self.tmp, self.path)

    def keep(self) -> str:
        """Close after a failure; keep what was written. Returns where it is: `path`, or a new
        `path`.partial (numbered if taken) when `path` held a file, which stays as it was."""
        with contextlib.suppress(OSError):
            self.stream.close()
        if self.tmp is None:
            return self.path
        for n in range(1000):
            kept = f"{self.path}.partial" + (f".{n}" if n else "")
            try:
                os.link(self.tmp, kept)  # never over a file of the user's
            except FileExistsError:
                continue
            except OSError:  # a file system without links: the hidden name, said in the message
                return self.tmp
            os.unlink(self.tmp)
            return kept
        return self.tmp

    def discard(self) -> None:
        """Close after a failure before anything was written: `path` as it was, no file added."""
        with contextlib.suppress(OSError):
            self.stream.close()
        if self.tmp is not None:
            Path(self.tmp).unlink(missing_ok=True)
        if self.created is not None:  # the empty file this made, if it is still the one at `path`
            with contextlib.suppress(OSError):
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == (self.created.st_dev, self.created.st_ino):
                    os.unlink(self.path)


def _beside(path: str) -> tuple[BinaryIO, str]:
    """A new hidden file beside `path` that can stand for it: its mode and its group (a file shared
    through a group must stay readable by it); OSError, and nothing left behind, where it cannot."""
    st = os.stat(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix=f".{os.path.basename(path)}.", suffix=".partial")
    try:
        if os.fstat(fd).st_gid != st.st_gid:
            os.fchown(fd, -1, st.st_gid)  # (a group the user is not in: refused, and written in place)
        os.fchmod(fd, stat.S_IMODE(st.st_mode))  # (after the group: a change of group clears set-group-ID)
        return os.fdopen(fd, "wb"), tmp
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise


def _replaceable(path: str) -> bool:
    """Whether a new file renamed over `path` would be the same to its user: a plain file (not a
    link), theirs, of one name, writable, without an access control list a new file would lack."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    acl = False
    with contextlib.suppress(OSError, AttributeError):  # (no extended attributes here: no ACL)
        acl = "system.posix_acl_access" in os.listxattr(path)
    return (stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1 and not acl
            and os.access(path, os.W_OK))


def say(text: str, kept: str = "", what: str = "") -> None:
    """`text` as a line on standard output, flushed at once: to a pipe, Python holds lines until
    exit, where a reader gone (`| head`) or a full disk was "Exception ignored" and exit 120. A
    reader gone raises BrokenPipeError (`aiayn.cli`: a quiet end), a full disk is one line naming
    standard output (and `what` was written), then `kept` (what stays safe). Nothing is said with
    standard output closed."""
    if sys.stdout is None:
        return
    with stdout_errors(what, kept):
        print(text, flush=True)


@contextlib.contextmanager
def stdout_errors(what: str = "", kept: str = "") -> Iterator[None]:
    """A write to standard output that fails for want of room (a full disk) as one line naming it
    (and `what` was written, then `kept`), standard output silenced so that the interpreter's last
    flush cannot fail again; a reader gone (BrokenPipeError) is the caller's."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        silence_stdout()
        raise AiaynError(f"standard output: cannot write{' ' + what if what else ''} ({e.strerror or e}){kept}") from None


def silence_stdout() -> None:
    """Point standard output at /dev/null, so that the interpreter's last flush of what is still
    buffered (after a closed pipe or a full disk) cannot fail again at exit."""
    with contextlib.suppress(OSError, AttributeError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
