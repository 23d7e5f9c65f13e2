"""Found by a cold review of the data path: downloads, prepare, the prepared reader."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aiayn import cli
from aiayn.data import text as data
from aiayn.data.lock import FolderLock
from aiayn.errors import AiaynError
from aiayn.files import umask

from test_download import _Server, served  # noqa: F401 - the local HTTP server fixture


def test_a_downloaded_file_gets_the_mode_a_plain_open_gives(served: _Server, tmp_path: Path) -> None:
    """The part was made 0600 and renamed into place so: in a data folder shared by several users or
    machines (docs/wmt14.md), the others could not read the corpus."""
    path = data.download_multi30k("val", "de", tmp_path / "d")
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask()


def test_a_folder_where_the_download_goes_is_one_line_before_any_transfer(served: _Server, tmp_path: Path) -> None:
    """It was found only at the final rename, after the whole transfer (1.7 GB for WMT14), as an OSError
    naming the hidden part file, which it left behind."""
    folder = tmp_path / "d"
    (folder / "val.de.gz").mkdir(parents=True)
    with pytest.raises(AiaynError, match=r"val\.de\.gz is a folder, where the download goes; move it away"):
        data.download_multi30k("val", "de", folder)
    assert served.requests == []
    assert os.listdir(folder) == ["val.de.gz"]  # no part left


def test_download_into_a_users_folder_keeps_a_file_of_theirs_of_that_name(
        served: _Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A corpus of the user's own named val.de.gz in --data-dir (`download_folder` even picks that
    folder for it) was replaced by Multi30k's without a word; the user cache's damaged copies are
    still fetched again (test_download)."""
    mine = tmp_path / "corpus"
    mine.mkdir()
    (mine / "val.de.gz").write_bytes(b"my own sentences\n")
    assert cli.main(["download", "--splits", "val", "--data-dir", str(mine)]) == 2
    note, ok, err = capsys.readouterr().err.splitlines()
    assert note.startswith(f"aiayn download: note: {mine / 'val.de.gz'} is there, but its sha256"), note
    assert "it may be a file of yours, so it is kept: move it away" in note
    assert ok == f"{mine / 'val.en.gz'}  ok (sha256 checked)"  # the other file is still fetched
    assert err == (f"aiayn download: error: 1 file(s) in {mine} kept, not Multi30k's (named above); the others were "
                   "downloaded: move those away, then run the download again")
    assert (mine / "val.de.gz").read_bytes() == b"my own sentences\n"
    assert [r.rsplit("/", 1)[-1] for r in served.requests] == ["val.en.gz"]
    assert sorted(os.listdir(mine)) == ["val.de.gz", "val.en.gz"]


def test_a_file_where_the_lock_goes_is_one_line_and_kept(tmp_path: Path) -> None:
    """A file of the user's at the lock's path (`.NAME.lock` beside --out) was waited on as a lock
    held by "None:None" for 3 minutes, then renamed `..NAME.lock.broken-*` as an abandoned one."""
    mine = tmp_path / ".data.lock"
    mine.write_text("my notes\n")
    with pytest.raises(AiaynError, match=r"\.data\.lock is a file where aiayn keeps a lock .*move it away"):
        with FolderLock(mine, poll=0.01, max_age=0.0):
            pass
    assert sorted(os.listdir(tmp_path)) == [".data.lock"] and mine.read_text() == "my notes\n"


def test_a_users_wmt14_text_in_an_unfinished_folder_is_kept(tmp_path, monkeypatch):
    """`download --data wmt14 --data-dir DIR` where DIR/wmt14 held the user's own train.en (no wmt14.json)
    moved the unpacked text over it; now it is named before anything is fetched, and kept. Files a killed
    unpack of ours was moving into place (its marker there) are still replaced."""
    from aiayn.data import wmt14

    folder = tmp_path / "wmt14"
    folder.mkdir()
    (folder / "train.en").write_text("my own cleaned text\n", encoding="utf-8")
    monkeypatch.setattr(wmt14, "download_file", lambda *a, **k: pytest.fail("fetched"))
    with pytest.raises(AiaynError, match=r"train.en is there, but .*wmt14.json is not: not a finished aiayn download"):
        wmt14.download_wmt14(folder)
    assert (folder / "train.en").read_text(encoding="utf-8") == "my own cleaned text\n"
    (folder / wmt14.MOVING).write_bytes(b"")  # a killed unpack of ours: on to the download
    with pytest.raises(pytest.fail.Exception, match="fetched"):
        wmt14.download_wmt14(folder)


@pytest.mark.parametrize("argv", [
    ["download", "--data-dir", ""],
    ["download", "--data", "wmt14", "--src", "en", "--tgt", "de", "--data-dir", ""],
    ["prepare", "--data", "multi30k", "--data-dir", "", "--out", "OUT"],
    ["evaluate", "--checkpoint", "CKPT", "--data", "multi30k", "--src", "de", "--tgt", "en", "--data-dir", ""],
])
def test_an_empty_data_dir_is_refused_as_train_refuses_it(argv, tmp_path, capsys, monkeypatch):
    """`--data-dir "$DIR"` with DIR unset: train refused it, but prepare and evaluate read the current
    folder and download fetched into the cache or $AIAYN_DATA, each without a word."""
    monkeypatch.chdir(tmp_path)
    args = [str(tmp_path / "out") if a == "OUT" else str(tmp_path / "ckpt") if a == "CKPT" else a for a in argv]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.endswith("error: --data-dir is an empty name (an unset shell variable?); give a path or leave it out, "
                        "got ''\n"), err
    assert list(tmp_path.iterdir()) == []


def test_a_finished_wmt14_folder_that_lost_a_file_is_fetched_again(tmp_path, monkeypatch):
    """A finished download (wmt14.json there) missing one text file is aiayn's own: it is unpacked again,
    not refused as "not a finished aiayn download"."""
    from aiayn.data import wmt14

    folder = tmp_path / "wmt14"
    folder.mkdir()
    for name in [wmt14.DONE, *wmt14._texts()[1:]]:  # train.en gone
        (folder / name).write_text("x\n", encoding="utf-8")
    monkeypatch.setattr(wmt14, "download_file", lambda *a, **k: pytest.fail("fetched"))
    with pytest.raises(pytest.fail.Exception, match="fetched"):
        wmt14.download_wmt14(folder)
