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
