"""Parallel text in, padded batches out (Section 5.1: "sentence pairs were batched together by
approximate sequence length. Each training batch contained a set of sentence pairs containing
approximately 25000 source tokens and 25000 target tokens").

- `read_parallel`: two aligned files, plain or .gz, strict UTF-8 (`aiayn.files.read_lines`). Every
  problem a user can fix is one `AiaynError` line naming the file (and the 1-based line where there is one):
  a missing or empty file, invalid UTF-8, different line counts, a blank line.
  Blank lines are an error, not skipped: in aligned files a blank line is usually a missing
  translation or a shifted alignment, and dropping it silently would hide that.
- `multi30k_paths`: the Multi30k task-1 files from `--data-dir`, `$AIAYN_DATA`, or the user cache
  (downloaded once from the public repository and checked against sha256).
- `collate` pads one batch to its own longest sentence, never to a fixed length (the batches
  themselves are cut by `aiayn.data.batching`).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import http.client
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch import Tensor

from aiayn.data.lock import BEAT, parse_work_name, stale, work_name
from aiayn.errors import AiaynError
from aiayn.files import default_cache_dir, file_sha256, read_lines, umask
from aiayn.kernels import LossPacking
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID

LANGS = ("en", "de", "fr", "cs")
SPLITS = ("train", "val", "test_2016_flickr")
MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw"
URL_ENV = "AIAYN_MULTI30K_URL"  # overrides MULTI30K_URL (a mirror, or a local server in tests)
DATA_ENV = "AIAYN_DATA"

# sha256 of each file as published (data/task1/raw/<split>.<lang>.gz)
MULTI30K_SHA256: dict[str, str] = {
    "test_2016_flickr.cs.gz": "200a4a74cc9560f051924abb9803be008d1908d77f747e9141aeb86dfd2797f1",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "train.cs.gz": "a65adb8b32e3bc664f21ecba7a6e7f6950fd1f405e135f7c312faabdb6255077",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.cs.gz": "b63226e05c4bd5dd6a42897d74b86a1b9d2c31498252c572b1ea7f7996927fcc",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
}

Example = tuple[list[int], list[int]]  # (source ids, EOS-ended if the model says so; target ids without BOS/EOS)


# ---------------------------------------------------------------------------------------------
# Reading text


def read_parallel(src_path: str | os.PathLike[str], tgt_path: str | os.PathLike[str]) -> tuple[list[str], list[str]]:
    """Aligned source and target lines; AiaynError on different line counts or a blank line."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    cr = [next((i for i, s in enumerate(lines, 1) if "\r" in s), 0) for lines in (src, tgt)]  # first \r a side
    for path, lines, other, (mine, theirs) in ((src_path, src, tgt, cr), (tgt_path, tgt, src, cr[::-1])):
        if cr_line_ends(len(lines), mine, len(other), theirs):
            raise cr_line_end_error(path, mine)
    if len(src) != len(tgt):
        raise line_count_error(src_path, len(src), tgt_path, len(tgt))
    for path, lines in ((src_path, src), (tgt_path, tgt)):
        blank = [i for i, s in enumerate(lines) if not s.strip()]
        if blank:
            raise blank_line_error(path, blank[0] + 1, len(blank))
    return src, tgt


def line_count_error(src_path: object, n_src: int, tgt_path: object, n_tgt: int) -> AiaynError:
    """The one message for aligned files of different lengths (read_parallel and `aiayn prepare`)."""
    return AiaynError(
        f"{src_path} has {n_src} lines but {tgt_path} has {n_tgt}; "
        "a parallel corpus needs line i of one file to translate line i of the other"
    )


def cr_line_ends(lines: int, first_cr: int, other_lines: int, other_cr: int) -> bool:
    """Whether a file of `lines` lines, the first holding a carriage return at line `first_cr` (1-based,
    0: none), ends its lines in \\r alone (classic Mac): it reads as fewer lines than its
    translation (`other_lines`, its first \\r at `other_cr`), or both read as one line holding one.
    Only then: a stray \\r inside a sentence is text, a one-sentence pair's too."""
    return bool(first_cr) and (lines < other_lines or lines == other_lines == 1 and bool(other_cr))


def cr_line_end_error(path: object, line: int) -> AiaynError:
    return AiaynError(f"{path}:{line}: a carriage return (\\r) inside the line: the file's lines end in \\r alone "
                      "(classic Mac), which reads as one line; convert its line ends to \\n")


def blank_line_error(path: object, first_line: int, count: int) -> AiaynError:
    """The one message for blank lines in a parallel file; `first_line` is 1-based."""
    more = f" ({count} blank lines in all)" if count > 1 else ""
    return AiaynError(
        f"{path}:{first_line}: blank line{more}; remove the pair from both files (or fill in the missing sentence)"
    )


# ---------------------------------------------------------------------------------------------
# Multi30k


def check_pair(src: str, tgt: str) -> None:
    """AiaynError unless src and tgt are two different Multi30k languages."""
    for flag, lang in (("--src", src), ("--tgt", tgt)):
        if lang not in LANGS:
            raise AiaynError(f"{flag} {lang!r}: Multi30k has {', '.join(LANGS)}")
    if src == tgt:
        raise AiaynError(f"--src and --tgt are both {src!r}; choose two different languages of {', '.join(LANGS)}")


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise AiaynError(f"unknown Multi30k split {split!r}; choose one of {', '.join(SPLITS)}")


def _multi30k_folder(root: Path) -> Path:
    """A data root may hold multi30k/ or be the multi30k folder itself."""
    return root / "multi30k" if (root / "multi30k").is_dir() else root


def download_folder(root: Path) -> Path:
    """Where `aiayn download` puts Multi30k under a data root: where `multi30k_paths` reads, the root
    itself where it already holds Multi30k's files (a multi30k/ made beside them would hide them),
    else root/multi30k/."""
    holds = any(_find(root, split, lang) for split in SPLITS for lang in LANGS)
    return root if holds and not (root / "multi30k").is_dir() else root / "multi30k"


def _find(folder: Path, split: str, lang: str) -> Path | None:
    for name in (f"{split}.{lang}.gz", f"{split}.{lang}"):
        if (folder / name).is_file():
            return folder / name
    return None


def check_data_dir(data_dir: str | Path | None) -> None:
    """--data-dir "" (an unset shell variable) is refused, as train refuses it: `prepare` and `evaluate`
    read the current folder for it and `download` the cache or $AIAYN_DATA, each without a word."""
    if data_dir is not None and not str(data_dir):
        raise AiaynError("--data-dir is an empty name (an unset shell variable?); give a path or leave it out, got ''")


def multi30k_paths(split: str, src: str, tgt: str, data_dir: str | Path | None = None) -> tuple[Path, Path]:
    """The (source, target) files of a Multi30k split.

    Looked for in `data_dir` (the --data-dir flag), else `$AIAYN_DATA`, else the user cache,
    where missing files are downloaded once (sha256-checked). Files may be `.gz` or plain.
    """
    check_split(split)
    check_pair(src, tgt)
    check_data_dir(data_dir)
    if data_dir is not None or os.environ.get(DATA_ENV):
        origin = "--data-dir" if data_dir is not None else f"${DATA_ENV}"
        root = Path(data_dir if data_dir is not None else os.environ[DATA_ENV]).expanduser()
        if not root.is_dir():
            raise AiaynError(f"{origin} {root}: no such folder")
        folder = _multi30k_folder(root)
        found: list[Path] = []
        for lang in (src, tgt):
            p = _find(folder, split, lang)
            if p is None:
                raise AiaynError(
                    f"{origin} {root}: no {split}.{lang}.gz in {folder}; "
                    f"run `aiayn download --src {src} --tgt {tgt} --data-dir {root}` or point {origin} elsewhere"
                )
            found.append(p)
        return found[0], found[1]
    folder = multi30k_cache_dir()
    return download_multi30k(split, src, folder), download_multi30k(split, tgt, folder)


def multi30k_cache_dir() -> Path:
    return default_cache_dir() / "multi30k"


def download_multi30k(split: str, lang: str, folder: str | Path, timeout: float = 60.0, replace: bool = True) -> Path:
    """`folder/<split>.<lang>.gz`, downloaded unless already there with the right sha256 (a file of
    other bytes there is replaced only where `replace`: the cache's, not a user's folder's)."""
    check_split(split)
    if lang not in LANGS:
        raise AiaynError(f"unknown Multi30k language {lang!r}; choose one of {', '.join(LANGS)}")
    name = f"{split}.{lang}.gz"
    url = f"{os.environ.get(URL_ENV) or MULTI30K_URL}".rstrip("/") + f"/{name}"
    return download_file(url, Path(folder) / name, MULTI30K_SHA256[name], URL_ENV, timeout, replace)


class KeptFile(AiaynError):
    """A file of other bytes where a download goes, in a user's folder: kept (`download_file`)."""


def download_file(url: str, target: Path, want: str, mirror_env: str, timeout: float = 60.0,
                  replace: bool = True) -> Path:
    """`target`, downloaded from `url` unless already there with sha256 `want`.

    The file is written to a partial name, checked, and only then renamed into place, so an
    interrupted or corrupt download never looks like a finished one. What an interrupted one
    received is kept (WMT14's archives are ~1.7 GB, over links that drop): the next try goes on from
    it with an HTTP Range request, or starts over where the server ignores Range or the file's
    sha256 then fails. `mirror_env` is the variable that points the download elsewhere (named in
    the messages). A `target` of other bytes is replaced (a damaged earlier download in aiayn's own
    folder), or without `replace` refused: in a user's data folder it may be their own corpus.
    """
    folder, name = target.parent, target.name
    have = file_sha256(target) if target.is_file() else None
    if have == want:
        return target
    if have is not None and not replace:
        raise KeptFile(f"{target} is there, but its sha256 {have[:16]}... is not the published file's {want[:16]}...; "
                       "it may be a file of yours, so it is kept: move it away, then run the download again")
    if os.path.lexists(target) and not target.is_file():  # found only after the whole download (1.7 GB for WMT14)
        what = "a folder" if target.is_dir() else "not a file"
        raise AiaynError(f"{target} is {what}, where the download goes; move it away, or choose another --data-dir")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AiaynError(f"cannot create {folder} ({e.strerror or e}); choose a writable folder (--data-dir, or "
                         f"${DATA_ENV} for Multi30k)") from None
    part = _claim_part(folder, name)
    try:
        got, kept = _fetch(url, part, timeout)
        if got != want and kept:  # a part of another version of the file, or damaged: once more from the start
            os.truncate(part, 0)
            got, _ = _fetch(url, part, timeout)
    except BaseException as e:  # a dropped link, a timeout, Ctrl-C: keep what came for the next try
        received = _release(part, name)
        if isinstance(e, (urllib.error.URLError, OSError, http.client.HTTPException, ValueError)):  # ValueError: bad URL
            raise _download_error(url, e, received) from None
        raise
    if got != want:
        part.unlink(missing_ok=True)
        raise AiaynError(
            f"{url}: sha256 {got[:16]}... does not match the expected {want[:16]}...; "
            f"the download was removed, try again later or set ${mirror_env} to another mirror"
        )
    os.chmod(part, 0o666 & ~umask())  # made 0600 (`_claim_part`): the mode a plain open() gives, as other outputs
    os.replace(part, target)
    return target


def _fetch(url: str, part: Path, timeout: float) -> tuple[str, int]:
    """Append the rest of `url` to `part`, asking for the bytes past its end (Range); a server that
    ignores Range sends the whole file, which replaces the part. Returns (sha256 of the part, bytes
    kept from before)."""
    offset = part.stat().st_size
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-"} if offset else {})
    try:
        resp = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code != 416 or not offset:
            raise
        e.close()  # nothing past the part's end: it may be the whole file (killed before its rename)
        with open(part, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest(), offset
    with resp:
        kept = offset if resp.status == 206 else 0
        if kept and not (resp.headers.get("Content-Range") or "").startswith(f"bytes {offset}-"):
            resp.close()  # another range than the one asked for: the whole file instead
            os.truncate(part, 0)
            return _fetch(url, part, timeout)
        length = (resp.headers.get("Content-Length") or "").strip()
        expected = int(length) if length.isdigit() else -1  # a garbled header: the sha256 decides
        with open(part, "r+b") as out:
            h = hashlib.file_digest(out, "sha256") if kept else hashlib.sha256()  # reads the kept bytes
            out.seek(kept)
            out.truncate()
            size = 0
            try:
                for chunk in iter(lambda: resp.read(1 << 16), b""):
                    out.write(chunk)
                    h.update(chunk)
                    size += len(chunk)
            finally:
                out.flush()
                os.fsync(out.fileno())
    if 0 <= expected != size:  # a dropped connection can end the stream early without an error
        raise http.client.IncompleteRead(b"", expected - size)
    return h.hexdigest(), kept


def _download_error(url: str, e: BaseException, received: int) -> AiaynError:
    reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e) or type(e).__name__
    if isinstance(e, http.client.IncompleteRead):
        reason = f"the transfer stopped {e.expected} bytes short"
    again = f"check the connection and run it again: it goes on from the {received:,} bytes received; or " if received \
        else "check the connection, or "
    return AiaynError(f"could not download {url} ({reason}); {again}get the files another way and pass --data-dir "
                      f"or set ${DATA_ENV}")


def _resume_name(folder: Path, name: str) -> Path:
    """Where a try that ended leaves its part for the next: no process writes it."""
    return folder / f".{name}.resume.part"


def _release(part: Path, name: str) -> int:
    """Leave `part` for the next try (its size), or remove it if empty."""
    with contextlib.suppress(OSError):
        size = part.stat().st_size
        if size:
            os.replace(part, _resume_name(part.parent, name))
            return size
    part.unlink(missing_ok=True)
    return 0


def _claim_part(folder: Path, name: str) -> Path:
    """A partial download of `name` of this process's own: the part an earlier try left, else the
    largest abandoned one (`_abandoned_parts`; the others removed), else a new empty one. Renamed
    to a name of our own first: of several processes claiming one part, one gets it."""
    mine = folder / f"{work_name(f'.{name}')}.part"  # host and pid in the name: `_abandoned_parts`
    for old in [_resume_name(folder, name), *_abandoned_parts(folder, name)]:
        with contextlib.suppress(OSError):  # (gone meanwhile: another process claimed or removed it)
            if mine.exists():
                old.unlink()
            else:
                os.rename(old, mine)
    if not mine.exists():
        os.close(os.open(mine, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    return mine


def _abandoned_parts(folder: Path, name: str) -> list[Path]:
    """Partial downloads of `name` left by a killed process (kill -9, SIGTERM), largest first:
    `lock.stale` ones (a dead process of this host, or untouched for `lock.STALE` seconds) that are
    also untouched for two beats. A live download writes all the time, so its part is never that
    old, even where another container shares this host's name but not its pids."""
    found = []
    for part in folder.glob(f".{glob.escape(name)}[.-]*.part"):
        with contextlib.suppress(OSError):  # (gone meanwhile: another process removed or finished it)
            st = part.stat()
            if part != _resume_name(folder, name) and time.time() - st.st_mtime > 2 * BEAT and \
                    stale(part, *parse_work_name(part.name[:-5])):
                found.append((st.st_size, part))
    return [p for _, p in sorted(found, reverse=True)]


# ---------------------------------------------------------------------------------------------
# Batches


@dataclass
class Batch:
    """One padded batch. Shape: src (B, S); tgt_in, tgt_out (B, T)."""

    src: Tensor  # (B, S) source ids, right-padded
    tgt_in: Tensor  # (B, T) BOS + target, the decoder's input
    tgt_out: Tensor  # (B, T) target + EOS, what the decoder must predict
    indices: list[int]  # example ids, in row order
    n_tgt_tokens: int  # non-pad tokens in tgt_out, the loss normaliser
    packing: LossPacking | None = None  # where the real tokens sit, found on the host (`Transformer.loss`)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            self.src.to(device, non_blocking=non_blocking),
            self.tgt_in.to(device, non_blocking=non_blocking),
            self.tgt_out.to(device, non_blocking=non_blocking),
            self.indices,
            self.n_tgt_tokens,
            None if self.packing is None else self.packing.to(device, non_blocking),
        )

    def pin_memory(self) -> "Batch":
        """The batch in page-locked memory, so that a copy to a GPU can run beside the compute."""
        return Batch(self.src.pin_memory(), self.tgt_in.pin_memory(), self.tgt_out.pin_memory(), self.indices,
                     self.n_tgt_tokens, None if self.packing is None else self.packing.pin_memory())

    @classmethod
    def of(cls, src: Tensor, tgt_in: Tensor, tgt_out: Tensor, indices: list[int], n_tgt_tokens: int,
           pad_id: int = PAD_ID, packing: bool = True) -> "Batch":
        """A batch of host tensors with its packing (found here, on the host: no GPU to wait for), or
        none if not `packing` (validation's full forward does not use it)."""
        return cls(src, tgt_in, tgt_out, indices, n_tgt_tokens,
                   LossPacking.of(src, tgt_in, tgt_out, pad_id) if packing else None)

    def __len__(self) -> int:
        return int(self.src.size(0))


def collate(
    examples: Sequence[Example],
    indices: Sequence[int],
    pad_id: int = PAD_ID,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
) -> Batch:
    """Pad the chosen examples to the batch's own longest source and target."""
    if not indices:
        raise AiaynError("cannot collate an empty batch")
    chosen = [examples[i] for i in indices]
    B = len(chosen)
    S = max(len(s) for s, _ in chosen)
    T = max(len(t) for _, t in chosen) + 1
    src = torch.full((B, max(S, 1)), pad_id, dtype=torch.long)  # (B, S)
    tgt_in = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    tgt_out = torch.full((B, T), pad_id, dtype=torch.long)  # (B, T)
    for row, (s, t) in enumerate(chosen):
        if s:
            src[row, : len(s)] = torch.tensor(s, dtype=torch.long)
        tgt_in[row, : len(t) + 1] = torch.tensor([bos_id, *t], dtype=torch.long)
        tgt_out[row, : len(t) + 1] = torch.tensor([*t, eos_id], dtype=torch.long)
    n_tgt = sum(len(t) + 1 for _, t in chosen)
    return Batch.of(src, tgt_in, tgt_out, list(indices), n_tgt, pad_id)


# ---------------------------------------------------------------------------------------------
# `aiayn download`
