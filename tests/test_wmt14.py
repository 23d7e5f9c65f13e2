"""The WMT14 download and unpacking, against a local HTTP server on 127.0.0.1 serving small archives
with the published member names (nothing reaches the internet); then `aiayn prepare --data wmt14`."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
from pathlib import Path
from typing import Iterator

import pytest
from test_download import _no_proxy, _Server

from aiayn import cli
from aiayn.data import wmt14
from aiayn.data.bindata import open_prepared
from aiayn.data.text import read_lines
from aiayn.errors import AiaynError

EN = ["A house.", "The dog runs.", "", "Two cats.", "Rain today.", "Bad bytes.", "Last one."]
DE = ["Ein Haus.", "Der Hund läuft.", "Leer.", "Zwei Katzen.", "Heute Regen.", None, "Das letzte."]


def _tgz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _lines(lines: list[str | None]) -> bytes:
    return b"".join(b"Kaputt \xff.\n" if s is None else s.encode() + b"\n" for s in lines)


def _sgm(lines: list[str]) -> bytes:
    segs = "".join(f'<seg id="{i}">{s}</seg>\n' for i, s in enumerate(lines, 1))
    return f'<srcset setid="newstest2014">\n<doc docid="x">\n{segs}</doc>\n</srcset>\n'.encode()


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[_Server]:
    _no_proxy(monkeypatch)
    www = tmp_path / "www" / "wmt"
    www.mkdir(parents=True)
    blobs = {
        "training-parallel-europarl-v7.tgz": _tgz({"training/europarl-v7.de-en.en": _lines(EN[:4]),
                                                   "training/europarl-v7.de-en.de": _lines(DE[:4])}),
        "training-parallel-commoncrawl.tgz": _tgz({"commoncrawl.de-en.en": _lines(EN[4:6]),
                                                   "commoncrawl.de-en.de": _lines(DE[4:6])}),
        "training-parallel-nc-v9.tgz": _tgz({"training/news-commentary-v9.de-en.en": _lines(EN[6:]),
                                             "training/news-commentary-v9.de-en.de": _lines(DE[6:])}),
        "dev.tgz": _tgz({"dev/newstest2013.en": b"Hello.\nGood bye.\n", "dev/newstest2013.de": "Hallo.\nTschüss.\n".encode(),
                         "dev/newstest2014-deen-src.en.sgm": _sgm(["One & two.", "Three."]),
                         "dev/newstest2014-deen-ref.de.sgm": _sgm(["Eins & zwei.", "Drei."]),
                         "dev/newstest2014-deen-src.de.sgm": _sgm(["Vier.", "Fünf."]),
                         "dev/newstest2014-deen-ref.en.sgm": _sgm(["Four.", "Five."])}),
    }
    table = {}
    for name, blob in blobs.items():
        (www / name).write_bytes(blob)
        table[name] = (wmt14.ARCHIVES[name][0], hashlib.sha256(blob).hexdigest())
    monkeypatch.setattr(wmt14, "ARCHIVES", table)
    monkeypatch.delenv("AIAYN_DATA", raising=False)
    server = _Server(tmp_path / "www")
    monkeypatch.setenv(wmt14.URL_ENV, server.url.replace("/task1/raw", "/wmt"))
    yield server
    server.close()


def test_download_unpacks_aligned_text_and_leaves_out_bad_pairs(served, tmp_path):
    (src, tgt), (vs, vt) = wmt14.wmt14_paths("en", "de", tmp_path / "d")
    # the blank English line and the German line that is not UTF-8 are left out, with their partners
    assert read_lines(src) == ["A house.", "The dog runs.", "Two cats.", "Rain today.", "Last one."]
    assert read_lines(tgt) == ["Ein Haus.", "Der Hund läuft.", "Zwei Katzen.", "Heute Regen.", "Das letzte."]
    assert (read_lines(vs), read_lines(vt)) == (["Hello.", "Good bye."], ["Hallo.", "Tschüss."])
    folder = tmp_path / "d" / "wmt14"  # newstest2014 per direction, as bench/wmt14.sh reads it
    assert [read_lines(folder / f"newstest2014.en-de.{x}") for x in ("en", "de")] == [["One & two.", "Three."],
                                                                                   ["Eins & zwei.", "Drei."]]
    assert [read_lines(folder / f"newstest2014.de-en.{x}") for x in ("de", "en")] == [["Vier.", "Fünf."],
                                                                                   ["Four.", "Five."]]
    assert '"train_left_out": 2' in (tmp_path / "d" / "wmt14" / "wmt14.json").read_text()
    n = len(served.requests)
    assert n == 4 and wmt14.wmt14_paths("de", "en", tmp_path / "d")[0] == (tgt, src)
    assert len(served.requests) == n  # unpacked once: no second download


def test_a_tampered_archive_is_refused_and_nothing_is_unpacked(served, tmp_path, monkeypatch):
    name = "training-parallel-nc-v9.tgz"
    monkeypatch.setitem(wmt14.ARCHIVES, name, (wmt14.ARCHIVES[name][0], "0" * 64))
    with pytest.raises(AiaynError, match=rf"{name}: sha256 [0-9a-f]{{16}}\.\.\. does not match .*AIAYN_WMT14_URL"):
        wmt14.wmt14_paths("en", "de", tmp_path / "d")
    folder = tmp_path / "d" / "wmt14"
    assert sorted(p.name for p in folder.iterdir()) == ["archives"]  # no text, no wmt14.json
    assert name not in [p.name for p in (folder / "archives").iterdir()]


def test_cli_download_then_prepare(served, tmp_path, capsys):
    d = tmp_path / "d"
    assert cli.main(["download", "--data", "wmt14", "--src", "en", "--tgt", "de", "--data-dir", str(d)]) == 0
    assert capsys.readouterr().out.strip() == str(d / "wmt14")
    out = tmp_path / "bin"
    assert cli.main(["prepare", "--data", "wmt14", "--src", "en", "--tgt", "de", "--data-dir", str(d), "--out", str(out),
                     "--vocab-size", "300", "--workers", "1"]) == 0
    prepared = open_prepared(out)
    assert len(prepared.train) == 5 and prepared.valid_text()[0] == ["Hello.", "Good bye."]
    assert cli.main(["download", "--data", "wmt14", "--src", "en", "--tgt", "fr"]) == 2
    assert "WMT14 here is English-German" in capsys.readouterr().err


def test_a_second_download_neither_downloads_nor_unpacks_again(served, tmp_path, monkeypatch, capsys):
    """The same command on every machine of a job (bench/wmt14.sh) finds the work done."""
    d = tmp_path / "d"
    assert cli.main(["download", "--data", "wmt14", "--src", "en", "--tgt", "de", "--data-dir", str(d)]) == 0
    n = len(served.requests)

    def unpack(*a: object) -> None:
        raise AssertionError("unpacked again")

    monkeypatch.setattr(wmt14, "unpack", unpack)
    assert cli.main(["download", "--data", "wmt14", "--src", "en", "--tgt", "de", "--data-dir", str(d)]) == 0
    assert len(served.requests) == n
    assert not [p.name for p in d.iterdir() if p.name.startswith(".")]  # no lock left behind


def test_what_a_killed_unpack_left_is_removed_by_the_next(served, tmp_path):
    """A killed unpack left its temporary folder (~1.5 GB of text at full size) for good; the next
    removes those of dead processes and old ones, never a fresh one another machine may be filling."""
    from aiayn.data.lock import _host

    folder = tmp_path / "d" / "wmt14"
    dead, old, fresh = (folder / n for n in (f".unpack-{_host()}-999999999-0000abcd", ".unpack-k2j_x9a1",
                                             ".unpack-otherhost-12-0000abcd"))
    for d in (dead, old, fresh):
        d.mkdir(parents=True)
        (d / "train.en").write_text("half\n")
    os.utime(old, (0, 0))
    wmt14.wmt14_paths("en", "de", tmp_path / "d")
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == [fresh.name]
