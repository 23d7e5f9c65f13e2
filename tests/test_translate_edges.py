"""`aiayn translate` at its edges: the CTranslate2 engine's flags at their extremes and the flags it
cannot honour, --split-sentences on blank lines, and a new --output file after a failed start. Each
test failed before its fix."""

import io
import subprocess
import sys

import pytest

from aiayn.cli import main
from serve_model import tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def export(ckpt, tmp_path_factory):
    pytest.importorskip("ctranslate2")
    from aiayn.export import export_ctranslate2

    return export_ctranslate2(str(ckpt), str(tmp_path_factory.mktemp("edges") / "ct2"))


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("ein Mann läuft.\n\nHund\n", encoding="utf-8")
    return path


def _ct2(export, src, out, *flags):
    return main(["translate", "--engine", "ctranslate2", "--checkpoint", str(export), "--input", str(src),
                 "--output", str(out), *flags])


@pytest.mark.parametrize("flags", [
    ["--min-len", "100", "--max-len-a", "0", "--max-len-b", "3"],  # CTranslate2: "minimum ... greater than maximum"
    ["--min-len", "100", "--max-len-a", "0", "--max-len-b", "3", "--beam", "1"],
    ["--max-len-a", "1e308"],  # a finite factor whose product overflows: OverflowError from math.floor(inf)
])
def test_ctranslate2_length_flags_at_their_extremes_translate(export, src, tmp_path, flags, capsys):
    """The torch engine takes these (a minimum above the limit stops at the limit; a huge factor is no
    limit); the ctranslate2 engine raised a traceback."""
    out = tmp_path / "out.txt"
    assert _ct2(export, src, out, *flags) == 0
    lines = out.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 4 and lines[1] == "" and lines[3] == "" and lines[0]
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("flags,words", [
    (["--stop-rule", "first"], "--stop-rule first"),
    (["--workers", "2"], "--workers 2"),
    (["--batch-size", "3"], "--batch-size 3"),
])
def test_ctranslate2_refuses_the_flags_it_cannot_honour(export, src, tmp_path, capsys, flags, words):
    """They were silently ignored: --stop-rule first gave best's translations, --batch-size no bound."""
    out = tmp_path / "out.txt"
    assert _ct2(export, src, out, *flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "ctranslate2" in err
    assert not out.exists()
    # what it does (the defaults, said out loud) still runs
    assert _ct2(export, src, out, "--stop-rule", "best", "--workers", "0", "--batch-size", "256") == 0


def test_evaluate_refuses_them_too(export, src, tmp_path, capsys):
    assert main(["evaluate", "--engine", "ctranslate2", "--checkpoint", str(export), "--src-file", str(src),
                 "--ref-file", str(src), "--stop-rule", "first"]) == 2
    assert "--stop-rule first" in capsys.readouterr().err


def test_split_sentences_gives_a_blank_line_an_empty_line(ckpt, tmp_path):
    """The promise of `aiayn translate` (an empty or blank line gives an empty line) held without
    --split-sentences only: with it, a line of spaces and tabs came back as itself."""
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("ein Mann.  Hund!\n   \t \n\n \u200b \nHund \n", encoding="utf-8")
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out),
                 "--split-sentences", "--max-len-a", "0", "--max-len-b", "4"]) == 0
    lines = out.read_text(encoding="utf-8").split("\n")
    assert len(lines) == 6 and lines[1:4] == ["", "", ""] and lines[5] == ""
    assert lines[0] and "  " in lines[0] and lines[4].endswith(" ")  # a line's own spacing is kept


def test_a_run_that_fails_before_its_first_line_adds_no_output_file(ckpt, tmp_path, capsys):
    """Invalid UTF-8 on line 1 (or Ctrl-C before the first chunk) left an empty new --output file
    behind, which `make` and friends then take for a finished translation."""
    src, out = tmp_path / "in.txt", tmp_path / "new.txt"
    src.write_bytes(b"A\xffB\nein Mann\n")
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out)]) == 2
    assert "in.txt:1: invalid UTF-8" in capsys.readouterr().err
    assert not out.exists()
    # with a line translated first, the new file keeps it
    src.write_bytes(b"ein Mann\nA\xffB\n")
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out),
                 "--max-len-a", "0", "--max-len-b", "4"]) == 2
    assert "the first 1 input line(s) are translated and written" in capsys.readouterr().err
    assert out.read_text(encoding="utf-8").count("\n") == 1


def test_discard_removes_only_the_new_file_it_made(tmp_path):
    from aiayn.files import ReplacingFile

    new = tmp_path / "new.txt"
    f = ReplacingFile(str(new))
    assert new.exists()
    f.discard()
    assert not new.exists()
    theirs = tmp_path / "theirs.txt"
    theirs.write_text("old\n")
    link = tmp_path / "link.txt"
    link.symlink_to(theirs)  # written in place, as open(FILE, "wb") writes it: emptied, but never removed
    ReplacingFile(str(link)).discard()
    assert link.is_symlink() and theirs.exists()
    f = ReplacingFile(str(new))
    new.unlink()
    new.write_text("someone else's\n")  # another file there now: not ours to remove
    f.discard()
    assert new.read_text() == "someone else's\n"


class _RawStdout(io.RawIOBase):
    """sys.stdout.buffer under `python -u` or PYTHONUNBUFFERED=1: a raw stream, whose write takes part of
    the bytes when a signal comes mid-write (to a pipe) and says so only in the count it returns."""

    def __init__(self):
        self.data = bytearray()

    def writable(self):
        return True

    def write(self, b):
        self.data += bytes(b[:7])
        return min(7, len(b))


def test_a_raw_standard_output_gets_every_line(ckpt, src, monkeypatch, capsys):
    """Only the first 7 bytes of each chunk reached standard output (a SIGTERM with the reader behind cut
    13107 of 20000 lines, mid-line), and the message said every line was written."""
    raw = _RawStdout()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw))
    flags = ["translate", "--checkpoint", str(ckpt), "--input", str(src), "--max-len-a", "0", "--max-len-b", "4"]
    assert main(flags) == 0
    monkeypatch.undo()
    assert main(flags) == 0
    assert bytes(raw.data).decode("utf-8") == capsys.readouterr().out
    assert raw.data.count(b"\n") == 3


@pytest.mark.parametrize("flags", [["--max-tokens", str(2 ** 31)], ["--max-tokens", str(10 ** 20)]])
def test_ctranslate2_takes_a_huge_max_tokens(export, src, tmp_path, flags, capsys):
    """The torch engine takes any --max-tokens; CTranslate2 reserves room for that many sentences
    before it batches (std::bad_alloc from 2**31, a TypeError past 2**64, 3x slower at 10**9)."""
    out = tmp_path / "out.txt"
    assert _ct2(export, src, out, *flags) == 0
    assert out.read_text(encoding="utf-8").count("\n") == 3
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("beam", [10 ** 4, 10 ** 20])
def test_ctranslate2_refuses_a_beam_wider_than_the_vocabulary(export, src, tmp_path, beam, capsys):
    """As the torch engine does; CTranslate2 searched minutes before failing to allocate (10**6) or
    raised a TypeError (10**20), tracebacks both (10**4: past the tiny model's vocabulary)."""
    out = tmp_path / "out.txt"
    assert _ct2(export, src, out, "--beam", str(beam)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--beam {beam} is larger than the target vocabulary" in err, err


@pytest.mark.parametrize("stdin", [False, True])
def test_standard_output_appended_to_the_input_is_refused(ckpt, tmp_path, stdin):
    """`aiayn translate --input FILE >> FILE` (or `< FILE >> FILE`) read its own translations back and
    translated them forever, the file growing until the disk was full (cat refuses it too)."""
    src = tmp_path / "in.txt"
    src.write_text("ein Mann\n" * 3, encoding="utf-8")
    argv = [sys.executable, "-m", "aiayn", "translate", "--checkpoint", str(ckpt), "--chunk-lines", "1",
            "--max-len-a", "0", "--max-len-b", "2", *([] if stdin else ["--input", str(src)])]
    with open(src, "rb") as i, open(src, "ab") as o:
        r = subprocess.run(argv, stdin=i if stdin else subprocess.DEVNULL, stdout=o, stderr=subprocess.PIPE,
                           timeout=120)
    assert r.returncode == 2 and b"standard output is the input file" in r.stderr, r.stderr
    assert src.read_text(encoding="utf-8") == "ein Mann\n" * 3


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
@pytest.mark.parametrize("b", [10 ** 30, 10 ** 400], ids=["1e30", "1e400"])
def test_a_max_len_b_past_any_int64_translates(ckpt, request, src, tmp_path, engine, b, capsys):
    """`--max-len-b 1000000000000000000000000000000` gave OverflowError tracebacks (the torch engine: a
    tensor met the int; CTranslate2's and both checks, past float's range: int too large to convert).
    A limit past any length is no limit but the model's own."""
    path = request.getfixturevalue("export") if engine == "ctranslate2" else ckpt
    out = tmp_path / "out.txt"
    assert main(["translate", "--engine", engine, "--checkpoint", str(path), "--input", str(src), "--output",
                 str(out), "--max-len-a", "0", "--max-len-b", str(b)]) == 0
    assert out.read_text(encoding="utf-8").count("\n") == 3
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--max-len-a", "inf"], ["--max-len-a", "nan"], ["--max-len-a", "-1"],
                                   ["--max-len-b", "-1"]])
def test_a_max_len_that_is_no_limit_is_refused_in_one_line(ckpt, src, tmp_path, flags, capsys):
    out = tmp_path / "out.txt"
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-len-a and --max-len-b must be finite numbers >= 0" in err, err
    assert not out.exists()


@pytest.mark.parametrize("data,max_lines,want", [
    (b"", 3, []),
    (b"\n", 3, [[""]]),
    (b"a\r\nb\n\nc", 3, [["a", "b", ""], ["c"]]),  # the last line without its newline; CRLF
    (b"a\nb\nc\n", 2, [["a", "b"], ["c"]]),
    (b"a\nb\n", 2, [["a", "b"]]),
    (b"\xef\xbb\xbfa\n\xef\xbb\xbfb\n", 1, [["a"], ["\ufeffb"]]),  # a byte-order mark only starts the text
])
def test_line_chunks_cut_the_input_into_its_lines(tmp_path, data, max_lines, want):
    from aiayn.translate import LineChunks

    path = tmp_path / "in.txt"
    path.write_bytes(data)
    with open(path, "rb") as f:
        assert list(LineChunks(f, "in.txt", max_lines)) == want


@pytest.mark.parametrize("max_lines", [1, 7, 500])
def test_line_chunks_read_long_lines_and_many_short_ones(tmp_path, max_lines):
    """A line of megabytes across many reads, and thousands of short lines in one read at
    --chunk-lines 1. Both were quadratic (the buffer rescanned, or split and joined again, at every
    read or chunk): a single 32 MB line took 18 s to read, 131072 short lines at --chunk-lines 1 159 s."""
    from aiayn.translate import LineChunks

    lines = ["x" * (3 << 20), *(f"{i}" for i in range(20000)), "y" * 100_000, "é"]
    path = tmp_path / "in.txt"
    path.write_bytes("\n".join(lines).encode("utf-8") + b"\n")
    with open(path, "rb") as f:
        chunks = list(LineChunks(f, "in.txt", max_lines))
    assert [line for chunk in chunks for line in chunk] == lines
    assert all(0 < len(c) <= max_lines for c in chunks)


@pytest.mark.parametrize("engine", ["torch", "ctranslate2"])
def test_a_translator_refuses_one_string_and_reads_lines_given_as_a_generator(ckpt, request, engine):
    """One string was translated character by character (a list of one translation per letter), and
    lines from a generator gave the torch engine an IndexError (it reads them twice) while the
    ctranslate2 engine, of the same interface, translated them."""
    from aiayn.translator import CT2Translator, Translator

    if engine == "torch":
        t = Translator.from_checkpoint(ckpt)
    else:
        t = CT2Translator(request.getfixturevalue("export"))
    lines = ["ein Mann läuft.", "", "Hund"]
    want = t.translate(lines, beam=2, max_len_a=0, max_len_b=4)
    assert t.translate((line for line in lines), beam=2, max_len_a=0, max_len_b=4) == want
    with pytest.raises(TypeError, match=r"pass \[text\]"):
        t.translate("ein Mann läuft.", beam=2)
    from aiayn.translate import search_paragraphs  # --split-sentences: it too went over the lines twice

    want = search_paragraphs(t, lines, "de", beam=2, max_len_a=0, max_len_b=4)
    assert search_paragraphs(t, (line for line in lines), "de", beam=2, max_len_a=0, max_len_b=4) == want


@pytest.mark.parametrize("packed", ["gzip", "xz"])
def test_a_compressed_input_is_one_line_saying_to_unpack_it(ckpt, tmp_path, capsys, packed):
    """`aiayn translate --input corpus.xz` (or .gz, which translate does not unpack) said "invalid
    UTF-8 (byte 0xfd at column 1); convert the input to UTF-8", sending the user after an encoding."""
    import gzip
    import lzma

    path = tmp_path / f"in.{packed}"
    path.write_bytes({"gzip": gzip, "xz": lzma}[packed].compress("ein Mann läuft.\n".encode()))
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(path), "--beam", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (f"aiayn translate: error: {path}: a {packed} file; aiayn reads plain UTF-8 text here: unpack it "
                   f"first ({'gunzip' if packed == 'gzip' else 'xz -d'})\n"), err


def test_line_chunks_wait_on_a_non_blocking_input(tmp_path):
    """A standard input left non-blocking (O_NONBLOCK on a pipe or terminal shared with another
    program) failed at once with 'aiayn translate: error: Resource temporarily unavailable'."""
    import fcntl
    import os
    import threading
    import time

    from aiayn.translate import LineChunks

    r, w = os.pipe()
    fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_NONBLOCK)

    def write() -> None:
        time.sleep(0.3)
        os.write(w, b"a\nb")
        time.sleep(0.3)
        os.write(w, b"\nc\n")
        os.close(w)

    threading.Thread(target=write, daemon=True).start()
    with os.fdopen(r, "rb") as f:
        assert [line for chunk in LineChunks(f, "<stdin>", 500) for line in chunk] == ["a", "b", "c"]
