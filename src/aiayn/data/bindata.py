"""Binarized parallel text: the directory `aiayn prepare` writes and `aiayn train --data-bin` reads.

For each split (train, valid) and side (src, tgt), three flat little-endian arrays, read as memory
maps, so a process touches only the pages of the pairs it batches and the ranks of a machine share
one copy in the page cache:

    {split}.{side}.tokens   (T,) token ids of every sentence, one after another (no BOS/EOS),
                                 in the smallest unsigned type that holds the vocabulary
    {split}.{side}.offsets  (N,) int64, where sentence i starts in .tokens
    {split}.{side}.lengths  (N,) unsigned, its length in tokens

plus the tokenizer (`spm.model`, or `src.spm.model` and `tgt.spm.model`), the validation text for
BLEU (`valid.src.txt`, `valid.tgt.txt`) and `manifest.json`: format version, settings, input and
output sha256s, counts. The manifest's own sha256 names the data (`Prepared.digest`), so a resumed
run can refuse data that changed under it.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from aiayn.data.text import Batch
from aiayn.files import file_sha256, read_lines
from aiayn.errors import AiaynError
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, TokenizerPair

FORMAT, VERSION = "aiayn-prepared", 1
MANIFEST = "manifest.json"
SIDES = ("src", "tgt")
VALID_TEXT = {"src": "valid.src.txt", "tgt": "valid.tgt.txt"}
OFFSET_DTYPE = np.dtype("<i8")


def smallest_uint(max_value: int) -> np.dtype:
    """The smallest little-endian unsigned integer type that holds 0..max_value."""
    for t in ("<u1", "<u2", "<u4"):
        if max_value <= np.iinfo(np.dtype(t)).max:
            return np.dtype(t)
    return np.dtype("<u8")


# ------------------------------------------------------------------------------------------ writing


class ArrayWriter:
    """Appends chunks to one raw array file and hashes them on the way (nothing kept in memory)."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.count = path, np.dtype(dtype), 0
        self._f: BinaryIO = open(path, "wb")
        self._sha = hashlib.sha256()

    def write(self, values: np.ndarray) -> None:
        data = np.ascontiguousarray(values, dtype=self.dtype).tobytes()
        self._f.write(data)
        self._sha.update(data)
        self.count += len(values)

    def close(self) -> dict[str, Any]:
        """Flush to disk; returns the manifest entry of the file."""
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        return {"dtype": self.dtype.str, "count": self.count, "sha256": self._sha.hexdigest()}


class SplitWriter:
    """The six arrays of one split, written a chunk of pairs at a time."""

    def __init__(self, folder: Path, split: str, token_dtype: np.dtype, length_dtype: np.dtype) -> None:
        self.split = split
        self._arrays = {f"{split}.{side}.{kind}": ArrayWriter(folder / f"{split}.{side}.{kind}", dtype)
                        for side in SIDES
                        for kind, dtype in (("tokens", token_dtype), ("offsets", OFFSET_DTYPE), ("lengths", length_dtype))}
        self._next = {side: 0 for side in SIDES}  # offset of the next sentence in each side's tokens

    def add(self, side: str, lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Append sentences: `lengths` (n,), `tokens` (sum(lengths),) ids, one sentence after another."""
        starts = self._next[side] + np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)[:-1]))
        self._arrays[f"{self.split}.{side}.offsets"].write(starts[: len(lengths)])
        self._arrays[f"{self.split}.{side}.lengths"].write(lengths)
        self._arrays[f"{self.split}.{side}.tokens"].write(tokens)
        self._next[side] += int(np.sum(lengths, dtype=np.int64))

    def close(self) -> dict[str, dict[str, Any]]:
        return {name: w.close() for name, w in self._arrays.items()}


# ------------------------------------------------------------------------------------------ reading


@dataclass
class Side:
    """One side of a split: (T,) tokens, (N,) int64 offsets, (N,) lengths, all memory maps."""

    tokens: np.ndarray
    offsets: np.ndarray
    lengths: np.ndarray

    def padded(self, rows: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """Sentences `rows` cut to `max_len`, right-padded: ((B, W) int64 ids, (B,) int64 lengths)."""
        lens = np.minimum(self.lengths[rows].astype(np.int64), max_len)  # (B,)
        width = int(lens.max(initial=0))
        cols = np.arange(width)  # (W,)
        inside = cols[None, :] < lens[:, None]  # (B, W)
        where = np.where(inside, self.offsets[rows][:, None] + cols[None, :], 0)  # (B, W)
        ids = np.where(inside, self.tokens[where] if len(self.tokens) else 0, PAD_ID)  # reads only these pages
        return ids.astype(np.int64), lens


@dataclass
class Split:
    """The pairs of one split; `collate` pads a batch of them as `data.collate` does."""

    src: Side
    tgt: Side

    def __len__(self) -> int:
        return len(self.src.lengths)

    def pair(self, i: int) -> tuple[list[int], list[int]]:
        return tuple(s.tokens[s.offsets[i] : s.offsets[i] + s.lengths[i]].tolist() for s in (self.src, self.tgt))

    def collate(self, rows: np.ndarray | list[int], max_len: int, source_eos: bool = False,
                packing: bool = True) -> Batch:
        """Batch of pairs `rows`, each side cut to `max_len` tokens (a no-op for data prepared with it);
        with `source_eos` each source ends with EOS, after the cut; `packing`: see `Batch.of`."""
        rows = np.asarray(rows, np.int64)
        if not len(rows):
            raise AiaynError("cannot collate an empty batch")
        src, slen = self.src.padded(rows, max_len)  # (B, S)
        if source_eos:
            src = np.concatenate([src, np.full((len(rows), 1), PAD_ID, np.int64)], 1)  # (B, S + 1)
            src[np.arange(len(rows)), slen] = EOS_ID
        tgt, tlen = self.tgt.padded(rows, max_len)  # (B, T - 1)
        B, T = len(rows), tgt.shape[1] + 1
        src = src if src.shape[1] else np.full((B, 1), PAD_ID, np.int64)
        tgt_in = np.full((B, T), PAD_ID, np.int64)
        tgt_in[:, 0], tgt_in[:, 1:] = BOS_ID, tgt  # BOS + target
        tgt_out = np.full((B, T), PAD_ID, np.int64)
        tgt_out[:, :-1] = tgt
        tgt_out[np.arange(B), tlen] = EOS_ID  # target + EOS
        return Batch.of(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out), rows.tolist(),
                        int(tlen.sum() + B), packing=packing)

    def lengths(self, max_len: int) -> tuple[np.ndarray, np.ndarray]:
        """(N,) source and target lengths as batches see them (cut to `max_len`); memory maps if uncut."""
        s, t = self.src.lengths, self.tgt.lengths
        if len(s) and max(int(s.max()), int(t.max())) > max_len:
            return np.minimum(s, max_len), np.minimum(t, max_len)
        return s, t


@dataclass
class Prepared:
    """An opened prepared directory."""

    path: Path
    manifest: dict[str, Any]
    digest: str  # sha256 of manifest.json
    tokenizers: TokenizerPair
    train: Split
    valid: Split | None

    def valid_text(self) -> tuple[list[str], list[str]]:
        """The validation sentences as text (for BLEU); empty lists when there is no validation set."""
        if self.valid is None:
            return [], []
        return self._valid_lines("src"), self._valid_lines("tgt")

    def _valid_lines(self, side: str) -> list[str]:
        """One side's validation text, checked against the manifest's sha256: a file edited or replaced
        since `prepare` no longer matches the arrays, and scoring BLEU on it failed (or misaligned
        sentences) at the first validation, hours in, instead of now."""
        name = VALID_TEXT[side]
        path = self.path / name
        entry = self.manifest["files"].get(name)
        want = entry.get("sha256") if isinstance(entry, dict) else None  # a manifest without one: nothing to check
        if isinstance(want, str) and file_sha256(path) != want:
            raise AiaynError(f"{path} is not the validation text {self.path} was prepared with (changed since?); "
                             "prepare the data again")
        return read_lines(path)


def open_prepared(path: str | os.PathLike[str], flag: str = "--data-bin") -> Prepared:
    """Open a directory written by `aiayn prepare`; a clear one-line error for anything else, including
    a directory a killed `prepare` left (it has no manifest, and is never at the final name)."""
    path = Path(path)
    if not path.is_dir():
        raise AiaynError(f"{flag} {path}: no such directory; make it with `aiayn prepare --out {path} ...`")
    try:
        raw = (path / MANIFEST).read_bytes()
        manifest = json.loads(raw)
    except FileNotFoundError:
        raise AiaynError(f"{flag} {path}: not a prepared data directory (no {MANIFEST}); make it with "
                         f"`aiayn prepare --out {path} ...`") from None
    except (OSError, ValueError) as e:
        raise AiaynError(f"{flag} {path}: unreadable {MANIFEST} ({e}); prepare the data again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise AiaynError(f"{flag} {path}: {MANIFEST} is not an aiayn prepare manifest; prepare the data again")
    if manifest.get("version") != VERSION:
        raise AiaynError(f"{flag} {path}: format version {manifest.get('version')}, this aiayn reads {VERSION}; "
                         "prepare the data again")
    files = manifest.get("files")
    if not isinstance(files, dict) or "train.src.tokens" not in files:
        raise AiaynError(f"{flag} {path}: {MANIFEST} lists no training arrays (damaged?); prepare the data again")
    if not (_is_int(manifest, "settings", "max_len") and _is_int(manifest, "splits", "train", "lines")):
        raise AiaynError(f"{flag} {path}: {MANIFEST} lacks its settings or training counts (damaged?); "  # a KeyError
                         "prepare the data again")
    tokenizers = _tokenizers(path, manifest, flag)
    vocab = {"src": tokenizers.src.vocab_size, "tgt": tokenizers.tgt.vocab_size}
    splits = {name: _open_split(path, name, files, flag, vocab) for name in ("train", "valid")
              if f"{name}.src.tokens" in files}
    return Prepared(path, manifest, hashlib.sha256(raw).hexdigest(), tokenizers, splits["train"], splits.get("valid"))


def _tokenizers(folder: Path, manifest: dict[str, Any], flag: str) -> TokenizerPair:
    """The tokenizer in `folder`, checked against the sha256 the manifest holds: another one (copied
    over it) read the arrays as other words without a sign."""
    tok = TokenizerPair.load(folder)
    want = manifest.get("tokenizer")
    want = want.get("files") if isinstance(want, dict) else None
    for name, sha in (want.items() if isinstance(want, dict) else ()):
        if (folder / name).is_file() and file_sha256(folder / name) != sha:
            raise AiaynError(f"{flag} {folder}: {name} is not the tokenizer {folder} was prepared with (replaced "
                             "since?); prepare the data again")
    return tok


def _is_int(manifest: dict[str, Any], *keys: str) -> bool:
    """Whether manifest[keys[0]][keys[1]]... is an int (what `corpus` reads from it without a check)."""
    value: Any = manifest
    for k in keys:
        value = value.get(k) if isinstance(value, dict) else None
    return isinstance(value, int) and not isinstance(value, bool)


def _open_split(folder: Path, split: str, files: dict[str, Any], flag: str, vocab: dict[str, int]) -> Split:
    sides = []
    for side in SIDES:
        arrays = [_open_array(folder, f"{split}.{side}.{kind}", files, flag) for kind in ("tokens", "offsets", "lengths")]
        sides.append(_checked(Side(*arrays), f"{flag} {folder}: {split}.{side}", vocab[side]))
    return Split(*sides)


def _checked(side: Side, where: str, vocab: int, chunk: int = 1 << 20) -> Side:
    """`side`, once its offsets are known to place the sentences one after another within its tokens,
    and its ids to lie within the `vocab` pieces of its tokenizer: damaged arrays would otherwise index
    out of range hours into training (in the embedding, on CUDA a device-side assert). Reads the
    offsets and lengths in chunks, and the tokens once (a max over the memory map: 0.04 s for WMT14's
    126M tokens a side in the page cache, a read of its 250 MB from disk when not)."""
    start = 0
    for s in range(0, len(side.lengths), chunk):
        lengths = np.asarray(side.lengths[s : s + chunk], np.int64)
        ends = start + np.cumsum(lengths)  # (n,)
        if not np.array_equal(side.offsets[s : s + chunk], ends - lengths):
            raise AiaynError(f"{where}.offsets does not match its lengths (a damaged file); prepare the data again")
        start = int(ends[-1])
    if start != len(side.tokens):
        raise AiaynError(f"{where}.lengths add up to {start} tokens, .tokens holds {len(side.tokens)} (a damaged "
                         "file); prepare the data again")
    top = int(side.tokens.max(initial=0))
    if top >= vocab:
        raise AiaynError(f"{where}.tokens holds id {top}, past the {vocab} pieces of its tokenizer (a damaged file, "
                         "or arrays of another tokenizer); prepare the data again")
    return side


def _open_array(folder: Path, name: str, files: dict[str, Any], flag: str) -> np.ndarray:
    entry = files.get(name) or {}
    try:
        dtype, count = np.dtype(entry.get("dtype", "<u1")), int(entry.get("count", -1))
    except (TypeError, ValueError, AttributeError):
        raise AiaynError(f"{flag} {folder}: {MANIFEST} has a damaged entry for {name}; prepare the data again") from None
    try:
        size = (folder / name).stat().st_size
    except OSError:
        size = -1
    if size != count * dtype.itemsize:
        raise AiaynError(f"{flag} {folder}: {name} is {'missing' if size < 0 else f'{size} bytes'}, the manifest "
                         f"says {count * dtype.itemsize}; prepare the data again")
    if count == 0:  # numpy cannot map an empty file
        return np.zeros(0, dtype)
    return np.memmap(folder / name, dtype=dtype, mode="r", shape=(count,))
