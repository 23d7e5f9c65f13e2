"""From a cold review of `aiayn translate` and `Translator` as a user drives them (search workers,
output that fails part-way). Each test failed before its fix."""

import errno
import random
import time

import pytest
import torch

import aiayn.translate
import aiayn.translator
from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.config import preset
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair
from aiayn.translator import Settings, Translator

WORDS = "a man woman dog runs the in on blue red street child plays ball Mann Hund läuft ein".split()
FAST = ["--beam", "1", "--max-len-a", "0", "--max-len-b", "3"]


@pytest.fixture(scope="module")
def parts():
    rng = random.Random(0)
    tok = Tokenizer.train([" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(200)], 300)
    torch.manual_seed(0)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size)).eval()
    return model, TokenizerPair(tok, tok, joint=True)


@pytest.fixture(scope="module")
def ckpt(parts, tmp_path_factory):
    path = tmp_path_factory.mktemp("run") / "best"
    save_checkpoint(path, *parts, {"train": {}, "step": 1})
    return path


@pytest.mark.parametrize("workers", [2.5, 1.5, float("nan"), "2"])
def test_workers_that_is_no_whole_number_is_refused(workers):
    with pytest.raises(AiaynError, match=r"--workers must be a whole number"):
        Settings(workers=workers).check()


def test_a_search_with_workers_2_5_is_refused_at_once_not_after_a_wait(parts, monkeypatch):
    """workers=2.5 made a barrier of 3.5 parties that never filled: every search waited
    `STARTED_WAIT_S` (a minute) for a worker that never came, then went on."""
    monkeypatch.setattr(aiayn.translator, "STARTED_WAIT_S", 5.0)
    translator = Translator(*parts)
    lines = ["ein Mann läuft", "der Hund", "a man runs on the street with a ball", "blue"] * 2
    t0 = time.monotonic()
    with pytest.raises(AiaynError, match="--workers"):
        translator.search(lines, workers=2.5, max_tokens=4, beam=1, max_len_a=0.0, max_len_b=2)
    assert time.monotonic() - t0 < 4
    fast = dict(max_tokens=4, beam=1, max_len_a=0.0, max_len_b=2)
    assert translator.translate(lines, workers=2.0, **fast) == translator.translate(lines, workers=1, **fast)


@pytest.mark.parametrize("existing", [True, False])
def test_a_chunk_that_fails_part_way_is_not_left_in_the_output(ckpt, tmp_path, monkeypatch, capsys, existing):
    """A full disk in the middle of a chunk left the lines of it that fit, the last one cut short,
    after the lines the message counted ("the first 2 input line(s) are translated and written"):
    a rerun on the rest (`tail -n +3`) appended after them."""
    src = tmp_path / "in.txt"
    src.write_text("ein Mann läuft\nder Hund\nein Kind\nblue ball\nthe man\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    if existing:
        out.write_text("old\n")
    real = aiayn.translate._write_all
    calls = []

    def write_all(stream, data):
        calls.append(data)
        if len(calls) == 2:  # the second chunk: some of it fits, then the disk is full
            stream.write(data[: len(data) // 2 + 1])
            stream.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        real(stream, data)

    monkeypatch.setattr(aiayn.translate, "_write_all", write_all)
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out),
                 "--chunk-lines", "2", *FAST]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and "the first 2 input line(s) are translated and written" in err, err
    kept = tmp_path / "out.txt.partial" if existing else out
    assert kept.read_bytes() == calls[0]  # the first chunk's two lines, nothing of the second
    if existing:
        assert out.read_text() == "old\n"


@pytest.mark.parametrize("field", ["max_tokens", "batch_size"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 2.5])
def test_batch_limits_that_are_no_whole_numbers_are_refused(field, value):
    """The Python API's batch limits must be whole numbers: nan passed the range checks and lifted the
    cap (every sentence in one batch), inf and 2.5 met an int conversion or a range later."""
    flag = "--" + field.replace("_", "-")
    with pytest.raises(AiaynError, match=f"{flag} must be a whole number"):
        Settings(**{field: value}).check()
    Settings(**{field: 64.0}).check()  # a whole number as a float is fine
