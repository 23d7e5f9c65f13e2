"""WMT14 English-German, the paper's corpus (Section 5.1): downloaded sha256-checked, unpacked into
plain aligned text that `aiayn prepare --data wmt14` reads.

- training: Europarl v7, Common Crawl and News Commentary v9 (about 4.5M pairs); pairs with a blank
  side (Europarl has some) or bytes that are not UTF-8 are left out and counted;
- validation: newstest2013; test: newstest2014 (the 3003-sentence "full" set, from its SGML).

The archives come from statmt.org (or `$AIAYN_WMT14_URL`, a mirror holding the same file names)
and are checked against the sha256 sums published with TensorFlow Datasets' WMT14 builder. Every
output is written under a temporary name and renamed when complete; `wmt14.json` is written last.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Iterator

from aiayn.data.lock import FolderLock, parse_work_name, stale, work_name
from aiayn.data.text import DATA_ENV, check_data_dir, download_file
from aiayn.errors import AiaynError
from aiayn.files import atomic_write_bytes, default_cache_dir

URL_ENV = "AIAYN_WMT14_URL"
LANGS = ("en", "de")
DONE = "wmt14.json"

# name -> (URL, sha256)
ARCHIVES: dict[str, tuple[str, str]] = {
    "training-parallel-europarl-v7.tgz": (
        "http://www.statmt.org/wmt13/training-parallel-europarl-v7.tgz",
        "0224c7c710c8a063dfd893b0cc0830202d61f4c75c17eb8e31836103d27d96e7"),
    "training-parallel-commoncrawl.tgz": (
        "http://www.statmt.org/wmt13/training-parallel-commoncrawl.tgz",
        "c7a74e2ea01ac6c920123108627e35278d4ccb5701e15428ffa34de86fa3a9e5"),
    "training-parallel-nc-v9.tgz": (
        "http://www.statmt.org/wmt14/training-parallel-nc-v9.tgz",
        "cb8953f292298e6877ae433c98912b927cb0766b303f4540512ddd286c748485"),
    "dev.tgz": (  # WMT19's dev archive holds newstest2013 as text and newstest2014 as SGML
        "http://data.statmt.org/wmt19/translation-task/dev.tgz",
        "7a7deccf82ebb05ba508dba5eb21356492224e8f630ec4f992132b029b4b25e7"),
}
TRAIN = [  # (archive, member with {lang})
    ("training-parallel-europarl-v7.tgz", "training/europarl-v7.de-en.{lang}"),
    ("training-parallel-commoncrawl.tgz", "commoncrawl.de-en.{lang}"),
    ("training-parallel-nc-v9.tgz", "training/news-commentary-v9.de-en.{lang}"),
]
VALID = ("dev.tgz", "dev/newstest2013.{lang}")
TEST = ("dev.tgz", "dev/newstest2014-deen-{role}.{lang}.sgm")  # role: src (English side) or ref


def wmt14_folder(data_dir: str | Path | None = None) -> Path:
    """Where the unpacked files live: DATA_DIR/wmt14, else $AIAYN_DATA/wmt14, else the user cache."""
    check_data_dir(data_dir)
    root = data_dir if data_dir is not None else os.environ.get(DATA_ENV)
    return Path(root).expanduser() / "wmt14" if root else default_cache_dir() / "wmt14"


def wmt14_paths(src: str, tgt: str, data_dir: str | Path | None = None) -> tuple[tuple[Path, Path], tuple[Path, Path]]:
    """((train src, train tgt), (newstest2013 src, tgt)), downloading and unpacking them once."""
    check_pair(src, tgt)
    folder = wmt14_folder(data_dir)
    download_wmt14(folder)  # returns at once where it is done
    return (folder / f"train.{src}", folder / f"train.{tgt}"), (folder / f"newstest2013.{src}", folder / f"newstest2013.{tgt}")


def check_pair(src: str, tgt: str) -> None:
    if {src, tgt} != set(LANGS):
        raise AiaynError(f"--src {src} --tgt {tgt}: WMT14 here is English-German; use --src en --tgt de or the reverse")


def download_wmt14(folder: Path, timeout: float = 120.0) -> Path:
    """Download the archives into `folder/archives` (sha256-checked, kept for a later run) and unpack,
    once: a folder with `wmt14.json` and its text is done. Machines that share the folder take turns
    (`FolderLock`), so the same command on each downloads and unpacks once."""
    if _unpacked(folder):
        return folder
    with FolderLock(folder.parent / f".{folder.name}.lock", lambda m: print(m, file=sys.stderr)) as lock:
        if _unpacked(folder):  # another machine finished while this one waited
            return folder
        _refuse_others(folder)
        base = os.environ.get(URL_ENV)
        archives = folder / "archives"
        for name, (url, sha) in ARCHIVES.items():
            download_file(f"{base.rstrip('/')}/{name}" if base else url, archives / name, sha, URL_ENV, timeout)
        counts = unpack(archives, folder, lock.marks)
        atomic_write_bytes(folder / DONE, (json.dumps(counts, indent=2, sort_keys=True) + "\n").encode())
        (folder / MOVING).unlink(missing_ok=True)
    return folder


MOVING = ".unpack-moving"  # written before `unpack` moves its text into place, removed once DONE is


def _texts() -> list[str]:
    """The text files `unpack` writes."""
    texts = [f"train.{x}" for x in LANGS] + [f"newstest2013.{x}" for x in LANGS]
    return texts + [f"newstest2014.{s}-{t}.{x}" for s, t in (("en", "de"), ("de", "en")) for x in LANGS]


def _unpacked(folder: Path) -> bool:
    """`wmt14.json` (written last) and every text file `unpack` writes are there."""
    return all((folder / name).is_file() for name in [DONE, *_texts()])


def _refuse_others(folder: Path) -> None:
    """A text file of `unpack`'s names in an unfinished folder (no DONE) is a user's own (their copy of
    WMT14, cleaned, say), which the unpack's moves replaced; unless MOVING says that a killed unpack of
    ours was moving its own files there. Refused before the download (1.7 GB)."""
    if (folder / MOVING).exists() or (folder / DONE).is_file():  # (a finished download that lost a file: ours)
        return
    theirs = next((folder / n for n in _texts() if os.path.lexists(folder / n)), None)
    if theirs is not None:
        raise AiaynError(f"{theirs} is there, but {folder / DONE} is not: not a finished aiayn download, so it may be a "
                         "file of yours, which the unpack would replace; move it away (or use your files: --train-src "
                         "and --train-tgt), then run the download again")


def unpack(archives: Path, folder: Path, marks: list[Path] | None = None) -> dict[str, int]:
    """Write train.{en,de}, newstest2013.{en,de} and newstest2014.{en-de,de-en}.* into `folder`, through
    a temporary folder there (added to `marks`, the holder's heartbeat: it shows the work is alive);
    the ones killed runs left (~1.5 GB each) are removed first."""
    counts = {"train_pairs": 0, "train_left_out": 0}
    for old in folder.glob(".unpack-*"):
        if old.is_dir() and stale(old, *parse_work_name(old.name)):
            shutil.rmtree(old, ignore_errors=True)
    work = folder / work_name(".unpack")
    work.mkdir()
    if marks is not None:
        marks.append(work)
    try:
        outs = {lang: open(work / f"train.{lang}", "w", encoding="utf-8") for lang in LANGS}
        try:
            for archive, member in TRAIN:
                files = [_extract(archives / archive, member.format(lang=lang), work) for lang in LANGS]
                kept, dropped = _append_pairs(files, [outs[lang] for lang in LANGS])
                counts["train_pairs"] += kept
                counts["train_left_out"] += dropped
                for f in files:
                    f.unlink()
        finally:
            for f in outs.values():
                f.close()
        for lang in LANGS:
            valid = _extract(archives / VALID[0], VALID[1].format(lang=lang), work)
            os.replace(valid, work / f"newstest2013.{lang}")
            for src, tgt in (("en", "de"), ("de", "en")):
                role = "src" if lang == src else "ref"
                sgm = _extract(archives / TEST[0], TEST[1].format(role=role, lang=lang), work)
                text = "".join(s + "\n" for s in _sgm_segments(sgm))
                (work / f"newstest2014.{src}-{tgt}.{lang}").write_text(text, encoding="utf-8")
                sgm.unlink()
        atomic_write_bytes(folder / MOVING, b"")  # from here, the text files in `folder` are ours (`_refuse_others`)
        for p in sorted(work.iterdir()):
            os.replace(p, folder / p.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return counts


def _extract(archive: Path, member: str, dest: Path) -> Path:
    """One member of a .tgz, copied into `dest` (streamed, never all in memory)."""
    try:
        with tarfile.open(archive, "r:gz") as tar:
            src = tar.extractfile(member)
            if src is None:
                raise KeyError(member)
            out = dest / Path(member).name
            with src, open(out, "wb") as f:
                shutil.copyfileobj(src, f, 1 << 20)
            return out
    except KeyError:
        raise AiaynError(f"{archive}: no {member} in it; remove the archive and download again") from None
    except (tarfile.TarError, OSError, EOFError) as e:
        raise AiaynError(f"{archive}: cannot unpack it ({e}); remove the archive and download again") from None


def _append_pairs(files: list[Path], outs: list) -> tuple[int, int]:
    """Append the aligned lines of two files to `outs`, leaving out pairs with a blank side or
    bytes that are not UTF-8: (pairs kept, pairs left out)."""
    kept = dropped = 0
    with open(files[0], "rb") as a, open(files[1], "rb") as b:
        for n, (x, y) in enumerate(itertools.zip_longest(a, b), 1):
            if x is None or y is None:
                raise AiaynError(f"{files[0].name} and {files[1].name} differ in length at line {n}; the archive is "
                                 "not the published one")
            try:
                pair = [line.decode("utf-8").rstrip("\r\n") for line in (x, y)]
            except UnicodeDecodeError:
                pair = []
            if not pair or not all(s.strip() for s in pair):
                dropped += 1
                continue
            for out, s in zip(outs, pair):
                out.write(s + "\n")
            kept += 1
    return kept, dropped


_SEG = re.compile(r"<seg[^>]*>(.*)</seg>")


def _sgm_segments(path: Path) -> Iterator[str]:
    """The sentences of a WMT SGML file, in order (tags stripped, text kept as it is)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            m = _SEG.search(line)
            if m:
                yield m.group(1).strip()
