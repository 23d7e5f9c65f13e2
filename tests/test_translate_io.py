"""`aiayn translate` at its files: names left empty by an unset shell variable, and an input that
fails part-way through. Each test failed before its fix."""

import errno
import os
import random

import pytest
import torch

from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.config import preset
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair

WORDS = "a man woman dog runs the in on blue red street child plays ball Mann Hund läuft ein".split()
FAST = ["--beam", "1", "--max-len-a", "0", "--max-len-b", "3"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    rng = random.Random(0)
    tok = Tokenizer.train([" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(200)], 300)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size)).eval()
    path = tmp_path_factory.mktemp("run") / "best"
    save_checkpoint(path, model, TokenizerPair(tok, tok, joint=True), {"train": {}, "step": 1})
    return path


@pytest.fixture
def src(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("ein Mann läuft\nder Hund\nein Kind spielt\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("flag", ["--checkpoint", "--input", "--output", "--tgt-lang"])
def test_an_empty_name_is_refused_naming_its_flag(ckpt, src, flag, monkeypatch, capsys):
    """`--checkpoint "$RUN"` with RUN unset translated with whatever checkpoint the current folder
    held, without a word; an empty --tgt-lang was no --tgt-lang; --input/--output said ": no such file"."""
    monkeypatch.chdir(ckpt)  # a folder that is a checkpoint: "" was taken for it
    argv = {"--checkpoint": str(ckpt), "--input": str(src), "--output": "-"}
    argv[flag] = ""
    assert main(["translate", *[x for kv in argv.items() for x in kv], *FAST]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"{flag} '': an empty name (an unset shell variable?)" in err, err


def test_a_failed_read_keeps_the_lines_before_it_and_says_where(ckpt, src, tmp_path, monkeypatch, capsys):
    """An input that fails part-way (a disk or network error) was `error: Input/output error`: no file,
    no count of the lines written, and over an existing --output the finished lines went to a
    hidden .partial file the message did not name."""
    out = tmp_path / "out.txt"
    out.write_text("old\n")
    real_read = os.read
    calls = []

    def read(fd, n):
        if os.path.realpath(f"/proc/self/fd/{fd}") != str(src.resolve()):
            return real_read(fd, n)
        calls.append(n)
        if len(calls) == 1:
            return b"ein Mann\nder Hund\nein Ki"  # two lines and part of a third, then the error
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "read", read)
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{src}: cannot read (Input/output error) after line 2 (--input)" in err
    assert f"the first 2 input line(s) are translated and written to {out}.partial ({out} is as it was)" in err
    assert out.read_text() == "old\n"
    assert len((tmp_path / "out.txt.partial").read_text(encoding="utf-8").split("\n")) == 3  # two lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt", "out.txt.partial"]


def test_line_chunks_hand_out_every_complete_line_before_a_failed_read(tmp_path, monkeypatch):
    """Chunk by chunk (one line each here), then the error; the line the failed read cut short is not
    handed out as if it were whole."""
    from aiayn.errors import AiaynError
    from aiayn.translate import LineChunks

    path = tmp_path / "in.txt"
    path.write_bytes(b"")
    real_read, reads = os.read, []

    def read(fd, n):
        if os.path.realpath(f"/proc/self/fd/{fd}") != str(path.resolve()):
            return real_read(fd, n)
        reads.append(n)
        if len(reads) == 1:
            return b"one\ntwo\nthree\nfou"
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "read", read)
    got = []
    with open(path, "rb") as f, pytest.raises(AiaynError, match=r"in.txt: cannot read \(Input/output error\) after line 3"):
        for chunk in LineChunks(f, "in.txt", max_lines=1):
            got.append(chunk)
    assert got == [["one"], ["two"], ["three"]]


def test_an_output_folder_that_is_not_there_is_refused_before_the_model_loads(ckpt, src, tmp_path, monkeypatch,
                                                                               capsys):
    """`--output missing/folder/out.txt` (or a file as the folder, or a folder as --output) was said only
    once the model had loaded; now before, in the words `plot -o` and `evaluate --save-hyps` use."""
    import aiayn.translate

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(aiayn.translate, "load_translator", load)
    (tmp_path / "afile").write_text("x\n")
    for out, why in [(tmp_path / "missing" / "folder" / "out.txt",
                      f"no folder {tmp_path / 'missing' / 'folder'}; make it first, or choose another path"),
                     (tmp_path / "afile" / "out.txt", f"{tmp_path / 'afile'} is a file, not a folder; choose another path"),
                     (tmp_path, "is a folder; give a file's path (in it, or elsewhere)")]:
        assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out), *FAST]) == 2
        assert capsys.readouterr().err == f"aiayn translate: error: --output {out}: {why}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "in.txt"]


def test_utf16_input_is_refused_before_a_line_is_written(ckpt, tmp_path, capsys):
    """UTF-16 without a byte-order mark read as UTF-8 with NULs: every "\\n\\0" made an extra line of
    output, and the translations were of garbled text."""
    path = tmp_path / "in.txt"
    path.write_bytes("ein Mann läuft\nder Hund\n".encode("utf-16-le"))
    out = tmp_path / "out.txt"
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(path), "--output", str(out), *FAST]) == 2
    assert capsys.readouterr().err == (f"aiayn translate: error: {path}: UTF-16LE text (every other byte is NUL), "
                                       "not UTF-8; convert the input to UTF-8 (iconv -f UTF-16LE -t UTF-8)\n")
    assert not out.exists()


def test_a_line_with_no_end_stops_the_run_keeping_the_lines_before_it(ckpt, tmp_path, capsys):
    """A line of more than 16 MiB (a file with no newlines, `< /dev/zero`) grew the line buffer without
    limit; now the lines before it are translated and kept, as after a failed read."""
    from aiayn.files import MAX_LINE_BYTES

    path = tmp_path / "in.txt"
    with open(path, "wb") as f:
        f.write(b"ein Mann\nder Hund\n" + b"\x00" * (MAX_LINE_BYTES + 1) + b"\nein Kind\n")
    out = tmp_path / "out.txt"
    out.write_text("old\n")
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(path), "--output", str(out), *FAST]) == 2
    err = capsys.readouterr().err
    assert err == (f"aiayn translate: error: {path}:3: no end of line in 16 MiB; aiayn reads text, one sentence a "
                   "line: check that the input is text, or break the line (--input); the first 2 input line(s) are "
                   f"translated and written to {out}.partial ({out} is as it was)\n"), err
    assert out.read_text() == "old\n"
    assert (tmp_path / "out.txt.partial").read_text(encoding="utf-8").count("\n") == 2


@pytest.fixture(scope="module")
def export(ckpt, tmp_path_factory):
    pytest.importorskip("ctranslate2")
    from aiayn.export import export_ctranslate2

    return export_ctranslate2(str(ckpt), str(tmp_path_factory.mktemp("io") / "ct2"))


@pytest.mark.parametrize("supported, others", [({"float32", "int8_float32", "int8"}, "fp32 or int8"),
                                               ({"float32"}, "fp32")])
def test_ctranslate2_names_the_precisions_this_cpu_runs(export, src, supported, others, monkeypatch, capsys):
    """`--engine ctranslate2 --precision bf16` where CTranslate2 has no bfloat16 for the CPU said why
    (its own words) but not what to use instead."""
    import ctranslate2

    monkeypatch.setattr(ctranslate2, "get_supported_compute_types", lambda device, device_index=0: set(supported))
    for precision in ["bf16", "int8"] if others == "fp32" else ["bf16"]:
        assert main(["translate", "--engine", "ctranslate2", "--checkpoint", str(export), "--input", str(src),
                     "--precision", precision, *FAST]) == 2
        err = capsys.readouterr().err
        assert err == (f"aiayn translate: error: --precision {precision}: CTranslate2 does not run {precision} on "
                       f"this CPU; use --precision {others}\n"), err
