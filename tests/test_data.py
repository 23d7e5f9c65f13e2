"""Readers (clear errors), Multi30k paths, collate."""

from __future__ import annotations

import gzip
import hashlib
import os
from pathlib import Path

import pytest
import torch

from aiayn.data import text as data
from aiayn.data.text import (
    LANGS,
    SPLITS,
    collate,
    multi30k_paths,
    read_parallel,
)
from aiayn.errors import AiaynError
from aiayn.files import read_lines
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID

DATA = os.environ.get("AIAYN_DATA")
needs_data = pytest.mark.skipif(
    not DATA or not Path(DATA, "multi30k").is_dir(), reason="AIAYN_DATA (Multi30k) not set"
)


def _write(path: Path, text: str | bytes) -> Path:
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


# ---------------------------------------------------------------------------------------------
# read_lines / read_parallel


@pytest.mark.parametrize("kind, packed, command", [
    ("xz", "lzma", "xz -d"), ("bzip2", "bz2", "bunzip2"), ("zip", "zip", "unzip")])
def test_a_file_compressed_other_than_with_gzip_says_to_unpack_it(tmp_path: Path, kind: str, packed: str,
                                                                   command: str) -> None:
    """An .xz corpus was "invalid UTF-8 (byte 0xfd at column 1); convert the file to UTF-8", which
    sent the user looking for an encoding problem."""
    import bz2
    import io
    import lzma
    import zipfile

    from aiayn.files import iter_lines

    text = b"Ein Hund.\n" * 50
    if packed == "zip":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as z:
            z.writestr("train.de", text)
        data = buf.getvalue()
    else:
        data = {"lzma": lzma, "bz2": bz2}[packed].compress(text)
    path = _write(tmp_path / "train.de", data)
    for read in (read_lines, lambda p: list(iter_lines(p))):
        with pytest.raises(AiaynError) as e:
            read(path)
        assert str(e.value) == f"{path}: a {kind} file; aiayn reads plain or gzip text here: unpack it first ({command})"


def test_a_sentence_that_begins_like_a_bzip2_header_is_text(tmp_path: Path) -> None:
    """Only bzip2's whole header counts: a corpus line "BZh is ..." was refused as a bzip2 file."""
    from aiayn.files import iter_lines

    path = _write(tmp_path / "t.en", "BZh9 is the start of this sentence.\nline two\n")
    assert read_lines(path) == list(iter_lines(path)) == ["BZh9 is the start of this sentence.", "line two"]


def test_plain_and_gzip_read_the_same(tmp_path: Path) -> None:
    text = "Ein Hund.\r\nZwei\u2028Katzen\x1c.\n\ufeffdrei\n"
    plain = _write(tmp_path / "a.txt", "\ufeff" + text)  # a BOM at the start is dropped
    gz = _write(tmp_path / "a.gz", gzip.compress(text.encode()))
    expected = ["Ein Hund.", "Zwei\u2028Katzen\x1c.", "\ufeffdrei"]  # split on \n only; \r\n ends a line
    assert read_lines(plain) == expected
    assert read_lines(gz) == expected
    assert read_lines(_write(tmp_path / "b.txt", "no newline at end")) == ["no newline at end"]


def test_read_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(AiaynError, match=r"missing\.de: no such file"):
        read_lines(tmp_path / "missing.de")
    with pytest.raises(AiaynError, match=r"empty\.de: file is empty"):
        read_lines(_write(tmp_path / "empty.de", ""))
    with pytest.raises(AiaynError, match=r"blanks\.de: file is empty"):
        read_lines(_write(tmp_path / "blanks.de", "\n \n\n"))
    with pytest.raises(AiaynError, match="is a directory"):
        read_lines(tmp_path)
    with pytest.raises(AiaynError, match=r"cut\.gz: corrupt or truncated gzip"):
        read_lines(_write(tmp_path / "cut.gz", gzip.compress(b"a sentence\n" * 100)[:40]))


@pytest.mark.parametrize("compress", [False, True])
def test_invalid_utf8_names_file_and_line(tmp_path: Path, compress: bool) -> None:
    raw = "ok\nauch ok\n".encode() + b"caf\xe9 latin-1\n" + b"fine\n"
    path = _write(tmp_path / "bad.de", gzip.compress(raw) if compress else raw)
    with pytest.raises(AiaynError, match=r"bad\.de:3: invalid UTF-8 \(byte 0xe9 at column 4\)") as e:
        read_lines(path)
    assert "\n" not in str(e.value)


def test_read_parallel(tmp_path: Path) -> None:
    src = _write(tmp_path / "s.de", "eins\nzwei\n")
    tgt = _write(tmp_path / "t.en", "one\ntwo\n")
    assert read_parallel(src, tgt) == (["eins", "zwei"], ["one", "two"])
    short = _write(tmp_path / "short.en", "one\n")
    with pytest.raises(AiaynError, match=r"s\.de has 2 lines but .*short\.en has 1"):
        read_parallel(src, short)


def test_blank_lines_are_an_error_with_the_line(tmp_path: Path) -> None:
    src = _write(tmp_path / "s.de", "eins\nzwei\ndrei\nvier\n")
    tgt = _write(tmp_path / "t.en", "one\n  \nthree\n\n")
    with pytest.raises(AiaynError, match=r"t\.en:2: blank line \(2 blank lines in all\); remove the pair"):
        read_parallel(src, tgt)


# ---------------------------------------------------------------------------------------------
# Multi30k paths


def _fake_root(root: Path, splits: tuple[str, ...] = ("val",), langs: tuple[str, ...] = ("de", "en")) -> Path:
    (root / "multi30k").mkdir(parents=True)
    for s in splits:
        for lang in langs:
            _write(root / "multi30k" / f"{s}.{lang}.gz", gzip.compress(f"{lang} line\n".encode()))
    return root


def test_multi30k_paths_from_flag_env_and_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_root(tmp_path / "root")
    want = (root / "multi30k" / "val.de.gz", root / "multi30k" / "val.en.gz")
    monkeypatch.delenv("AIAYN_DATA", raising=False)
    assert multi30k_paths("val", "de", "en", root) == want
    assert multi30k_paths("val", "de", "en", root / "multi30k") == want  # the multi30k folder itself
    monkeypatch.setenv("AIAYN_DATA", str(root))
    assert multi30k_paths("val", "de", "en") == want
    # --data-dir wins over $AIAYN_DATA
    other = _fake_root(tmp_path / "other")
    assert multi30k_paths("val", "de", "en", other)[0] == other / "multi30k" / "val.de.gz"
    # plain (uncompressed) files are found too
    _write(root / "multi30k" / "val.fr", "fr line\n")
    assert multi30k_paths("val", "fr", "en", root)[0] == root / "multi30k" / "val.fr"


def test_multi30k_paths_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_root(tmp_path / "root")
    with pytest.raises(AiaynError, match=r"--src 'xx': Multi30k has en, de, fr, cs"):
        multi30k_paths("val", "xx", "en", root)
    with pytest.raises(AiaynError, match=r"--tgt 'EN'"):
        multi30k_paths("val", "de", "EN", root)
    with pytest.raises(AiaynError, match=r"both 'de'"):
        multi30k_paths("val", "de", "de", root)
    with pytest.raises(AiaynError, match=r"split 'dev'.*train, val, test_2016_flickr"):
        multi30k_paths("dev", "de", "en", root)
    with pytest.raises(AiaynError, match=r"--data-dir .*root: no train\.de\.gz .*aiayn download --src de --tgt en"):
        multi30k_paths("train", "de", "en", root)
    with pytest.raises(AiaynError, match=r"--data-dir .*nowhere: no such folder"):
        multi30k_paths("val", "de", "en", tmp_path / "nowhere")
    monkeypatch.setenv("AIAYN_DATA", str(tmp_path / "nowhere"))
    with pytest.raises(AiaynError, match=r"\$AIAYN_DATA .*nowhere: no such folder"):
        multi30k_paths("val", "de", "en")


@needs_data
def test_sha256_table_matches_the_real_files() -> None:
    folder = Path(DATA, "multi30k")  # type: ignore[arg-type]
    assert len(data.MULTI30K_SHA256) == len(SPLITS) * len(LANGS)
    for name, digest in data.MULTI30K_SHA256.items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, name


@needs_data
def test_real_multi30k_line_counts() -> None:
    for split, n in (("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)):
        src, tgt = read_parallel(*multi30k_paths(split, "cs", "fr", DATA))
        assert len(src) == len(tgt) == n


# ---------------------------------------------------------------------------------------------
# collate


def test_collate_pads_to_the_batch_only() -> None:
    examples = [([7, 8, 9], [10]), ([11], [12, 13, 14]), ([99], [99])]
    b = collate(examples, [1, 0])
    P, B, E = PAD_ID, BOS_ID, EOS_ID
    assert b.src.tolist() == [[11, P, P], [7, 8, 9]]
    assert b.tgt_in.tolist() == [[B, 12, 13, 14], [B, 10, P, P]]
    assert b.tgt_out.tolist() == [[12, 13, 14, E], [10, E, P, P]]
    assert b.indices == [1, 0] and b.n_tgt_tokens == 6 == int(b.tgt_out.ne(P).sum())
    assert b.src.dtype == torch.long and len(b) == 2
    moved = b.to("cpu")
    assert torch.equal(moved.tgt_out, b.tgt_out) and moved.n_tgt_tokens == 6
    with pytest.raises(AiaynError, match="empty batch"):
        collate(examples, [])


def test_file_sha256_of_a_folder_or_an_unreadable_file_is_one_line(tmp_path, monkeypatch) -> None:
    """Only a missing file was an AiaynError: a folder's path raised a bare IsADirectoryError to every
    caller (`build_tokenizers` on a folder given as a corpus file: a traceback from a library call)."""
    from aiayn.files import file_sha256
    from aiayn.tokenizer import build_tokenizers

    with pytest.raises(AiaynError, match=rf"^{tmp_path}: is a directory, expected a file$"):
        file_sha256(tmp_path)
    (tmp_path / "a.txt").write_text("a b\n", encoding="utf-8")
    with pytest.raises(AiaynError, match="is a directory"):
        build_tokenizers(tmp_path, tmp_path / "a.txt", vocab_size=50, cache_dir=tmp_path / "cache")

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(args[0]))

    monkeypatch.setattr("aiayn.files.open", denied, raising=False)  # (root reads any file: no chmod)
    with pytest.raises(AiaynError, match=r"a\.txt: cannot read \(Permission denied\)$"):
        file_sha256(tmp_path / "a.txt")
