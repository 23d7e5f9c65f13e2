"""`aiayn prepare`: raw parallel text -> SentencePiece -> memory-mapped token arrays (`bindata`).

The paper's WMT14 corpora (4.5M and 36M pairs) do not fit in memory as Python lists, so this
command streams: one pass checks the files (the same rules and messages as `train`: missing file,
invalid UTF-8 with file and line, line counts, blank lines) and draws a seeded reservoir sample for
SentencePiece; a second pass encodes chunks of pairs in worker processes and appends them, in
order, to the arrays. Memory is bounded by the sample and a few chunks, never by the corpus.

Atomic and repeatable: everything is written into a temporary sibling of --out, which is renamed
into place only when complete (a killed run leaves no directory `train` accepts), and the output
is a function of the input bytes and the settings only (no times, paths or worker counts in it),
so two runs give byte-identical directories.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import hashlib
import itertools
import json
import multiprocessing
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from aiayn.data import bindata
from aiayn.data.lock import OWNER, FolderLock, parse_work_name, stale, work_name
from aiayn.data.text import blank_line_error, cr_line_end_error, cr_line_ends, line_count_error, read_parallel
from aiayn.errors import AiaynError
from aiayn.files import atomic_write_bytes, check_input_file, file_sha256, fsync_path, iter_lines
from aiayn.tokenizer import MODEL_TYPES, Tokenizer, TokenizerPair

CHUNK_PAIRS = 20_000  # pairs per worker task: large enough to amortise pickling, small in memory
TMP_MARK = ".aiayn-prepare"  # a file in each temporary directory: only those are ever cleaned up


@dataclass(frozen=True)
class Settings:
    """Everything besides the input bytes that decides the output."""

    vocab_size: int = 8000
    joint_vocab: bool = True
    spm_model_type: str = "bpe"
    spm_sample: int = 500_000  # pairs (1M sentences) sampled to train SentencePiece; all of them if fewer
    max_len: int = 256  # subword tokens per side; longer training pairs skipped or truncated
    long: str = "skip"
    seed: int = 1

    def check(self) -> None:
        if not 16 <= self.vocab_size <= 1_000_000:
            raise AiaynError(f"--vocab-size must be between 16 and 1,000,000, got {self.vocab_size}")
        if self.spm_model_type not in MODEL_TYPES:
            raise AiaynError(f"--spm-model-type must be one of {', '.join(MODEL_TYPES)}, got {self.spm_model_type!r}")
        if self.spm_sample < 1:
            raise AiaynError(f"--spm-sample must be at least 1, got {self.spm_sample}")
        if not 1 <= self.max_len <= 4096:
            raise AiaynError(f"--max-len must be between 1 and 4096, got {self.max_len}")
        if self.long not in ("skip", "truncate"):
            raise AiaynError(f"--long must be 'skip' or 'truncate', got {self.long!r}")


@dataclass(frozen=True)
class Inputs:
    train_src: Path
    train_tgt: Path
    valid_src: Path | None = None
    valid_tgt: Path | None = None

    def check(self) -> None:
        """The same messages as `aiayn train` for missing files."""
        if (self.valid_src is None) != (self.valid_tgt is None):
            raise AiaynError("pass both --valid-src and --valid-tgt, or neither")
        for name, p in asdict(self).items():
            if p is not None:  # missing, a folder, unreadable: each said as such, naming the flag
                check_input_file(p, f"--{name.replace('_', '-')}")

    def digests(self) -> dict[str, dict[str, str]]:
        """File name and sha256 of each input (names, not paths: the output must not depend on where)."""
        return {name: {"name": Path(p).name, "sha256": file_sha256(p)} for name, p in asdict(self).items() if p}


def _contents(digests: dict[str, Any]) -> dict[str, Any]:
    """The sha256 of each input by its role: what a resumed run's data must match (files may be renamed)."""
    return {name: d.get("sha256") if isinstance(d, dict) else d for name, d in digests.items()}


# ------------------------------------------------------------------------------- pass 1: scanning


@dataclass
class Scan:
    lines: int
    sample: list[tuple[str, str]]  # up to Settings.spm_sample pairs, a uniform seeded sample


def scan_parallel(src_path: Path, tgt_path: Path, sample_size: int, seed: int) -> Scan:
    """Check two aligned files as `data.read_parallel` does, streaming, and draw a reservoir sample
    of pairs (Vitter's algorithm R: each pair kept with equal probability, the same ones for a seed)."""
    rng = random.Random(f"spm-sample:{seed}")  # a str seed hashes the same in every process
    count = {src_path: 0, tgt_path: 0}
    blank: dict[Path, list[int]] = {src_path: [0, 0], tgt_path: [0, 0]}  # first blank line (1-based), how many
    cr = {src_path: 0, tgt_path: 0}  # first line holding a carriage return (`cr_line_ends`)
    sample: list[tuple[str, str]] = []
    for i, (s, t) in enumerate(itertools.zip_longest(iter_lines(src_path), iter_lines(tgt_path))):
        for path, line in ((src_path, s), (tgt_path, t)):
            if line is not None:
                count[path] += 1
                if not cr[path] and "\r" in line:
                    cr[path] = count[path]
                if not line.strip():
                    blank[path][0] = blank[path][0] or count[path]
                    blank[path][1] += 1
        if s is None or t is None:
            continue
        if i < sample_size:
            sample.append((s, t))
        else:
            j = rng.randrange(i + 1)
            if j < sample_size:
                sample[j] = (s, t)
    for path, other in ((src_path, tgt_path), (tgt_path, src_path)):
        if count[path] == blank[path][1]:
            raise AiaynError(f"{path}: file is empty")
        if cr_line_ends(count[path], cr[path], count[other], cr[other]):
            raise cr_line_end_error(path, cr[path])
    if count[src_path] != count[tgt_path]:
        raise line_count_error(src_path, count[src_path], tgt_path, count[tgt_path])
    for path in (src_path, tgt_path):
        if blank[path][1]:
            raise blank_line_error(path, *blank[path])
    return Scan(count[src_path], sample)


def train_tokenizers(sample: list[tuple[str, str]], settings: Settings) -> TokenizerPair:
    """SentencePiece on the sample: one joint model on both sides, or one per side."""
    src = [s for s, _ in sample]
    tgt = [t for _, t in sample]
    if settings.joint_vocab:
        tok = Tokenizer.train(src + tgt, settings.vocab_size, settings.spm_model_type)
        return TokenizerPair(tok, tok, joint=True)
    return TokenizerPair(Tokenizer.train(src, settings.vocab_size, settings.spm_model_type),
                         Tokenizer.train(tgt, settings.vocab_size, settings.spm_model_type), joint=False)


# ------------------------------------------------------------------------------- pass 2: encoding

_worker: dict[str, Any] = {}  # each worker process's tokenizers and settings


def _init_worker(src_model: bytes, tgt_model: bytes, token_dtype: str, max_len: int, long: str) -> None:
    _worker.update(src=Tokenizer(src_model), tgt=Tokenizer(tgt_model), dtype=np.dtype(token_dtype), max_len=max_len,
                   long=long)


def _encode_chunk(chunk: tuple[list[str], list[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """(source lengths (n,), source ids (sum,), target lengths, target ids, pairs too long) of a chunk,
    with the too-long pairs skipped or truncated."""
    w = _worker
    sides = [_flatten(w[side].encode_batch(lines), w["dtype"]) for side, lines in zip(("src", "tgt"), chunk)]
    (s_len, s_ids), (t_len, t_ids) = sides
    too_long = (s_len > w["max_len"]) | (t_len > w["max_len"])  # (n,)
    keep = ~too_long if w["long"] == "skip" else np.ones(len(s_len), bool)
    s_len, s_ids = _select(s_len, s_ids, keep, w["max_len"])
    t_len, t_ids = _select(t_len, t_ids, keep, w["max_len"])
    return s_len, s_ids, t_len, t_ids, int(too_long.sum())


def _flatten(ids: list[list[int]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))  # (n,)
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype, count=int(lengths.sum()))  # (sum,)
    return lengths, flat


def _select(lengths: np.ndarray, flat: np.ndarray, keep: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Keep the sentences `keep`, each cut to `max_len` tokens: (lengths (m,), ids (sum,))."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)  # (sum,) where each token's sentence starts
    inside = (np.arange(len(flat)) - starts) < max_len
    flat = flat[inside & np.repeat(keep, lengths)]
    return np.minimum(lengths[keep], max_len), flat


def _chunks(src_path: Path, tgt_path: Path, size: int) -> Iterator[tuple[list[str], list[str]]]:
    pairs = zip(iter_lines(src_path), iter_lines(tgt_path))
    while chunk := list(itertools.islice(pairs, size)):
        yield [s for s, _ in chunk], [t for _, t in chunk]


def _ordered_map(fn: Callable, tasks: Iterable, workers: int, init: Callable, initargs: tuple) -> Iterator:
    """`map(fn, tasks)` in order over `workers` processes, with at most 2 tasks per worker in flight
    (Pool.imap would read the whole input ahead and hold it in memory)."""
    if workers <= 1:
        init(*initargs)
        yield from map(fn, tasks)
        return
    with multiprocessing.get_context("fork").Pool(workers, _in_worker, (init, *initargs)) as pool:
        pending: collections.deque = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(fn, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _in_worker(init: Callable, *initargs: Any) -> None:
    """A pool worker's start. Ctrl-C reaches the whole process group: the parent alone answers it (its
    `with` tears the pool down); a worker that took it too would print a traceback of its own."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    init(*initargs)


def encode_split(split: str, src_path: Path, tgt_path: Path, tok: TokenizerPair, settings: Settings, folder: Path,
                 workers: int, long: str, log: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Encode one split into its arrays in `folder`: (counts for the manifest, file entries)."""
    token_dtype = bindata.smallest_uint(max(tok.src.vocab_size, tok.tgt.vocab_size) - 1)
    writer = bindata.SplitWriter(folder, split, token_dtype, bindata.smallest_uint(settings.max_len))
    lines = pairs = too_long = 0
    t0, last = time.time(), time.time()
    init_args = (tok.src.to_bytes(), tok.tgt.to_bytes(), token_dtype.str, settings.max_len, long)
    for s_len, s_ids, t_len, t_ids, n_long in _ordered_map(_encode_chunk, _chunks(src_path, tgt_path, CHUNK_PAIRS),
                                                           workers, _init_worker, init_args):
        writer.add("src", s_len, s_ids)
        writer.add("tgt", t_len, t_ids)
        lines += len(s_len) + (n_long if long == "skip" else 0)
        pairs += len(s_len)
        too_long += n_long
        if time.time() - last > 30:
            last = time.time()
            log(f"  {split}: {lines:,} pairs encoded ({lines / (last - t0):,.0f}/s)")
    files = writer.close()
    counts = {"lines": lines, "pairs": pairs, "skipped" if long == "skip" else "truncated": too_long,
              "src_tokens": files[f"{split}.src.tokens"]["count"], "tgt_tokens": files[f"{split}.tgt.tokens"]["count"]}
    return counts, files


# ------------------------------------------------------------------------------------- the command


def prepare(inputs: Inputs, out: str | os.PathLike[str], settings: Settings = Settings(), workers: int = 0,
            log: Callable[[str], None] = lambda m: print(m, file=sys.stderr), replace: bool = True,
            tokenizers: TokenizerPair | None = None) -> Path:
    """Write the prepared directory `out`; returns it. Does nothing if `out` already holds the output
    of these inputs and settings (restart after an interruption costs only the hashing). An earlier
    output of other inputs or settings is replaced, or with `replace=False` refused (then renamed
    inputs of the same bytes count as the same: a resumed run keeps its data as it is). `tokenizers`
    (fine-tuning) encode the text instead of new ones trained on it (the vocabulary settings are
    then unused)."""
    inputs.check()
    settings.check()
    out = _named(out)  # the lock and temporaries go beside it
    _check_out(out, ours_at_all=True)  # before hashing the inputs (gigabytes for WMT14)
    digests = inputs.digests()
    if _up_to_date(out, digests, settings, tokenizers, replace):
        remove_abandoned(out)  # a killed later run's, which would otherwise stay as long as `out` is current
        log(f"{out}: already prepared from these files and settings")
        return out
    _check_out(out)  # only a folder prepare would replace must hold nothing else
    # Several machines may run this on one shared folder: one prepares, the others wait and find it done.
    with FolderLock(_lock_path(out), log) as lock:
        if _up_to_date(out, digests, settings, tokenizers, replace):
            log(f"{out}: prepared meanwhile by another process from these files and settings")
            return out
        if not replace and (out / bindata.MANIFEST).is_file():
            raise AiaynError(f"{_changed(out, inputs, digests)} is not what {out} was prepared from (the data changed "
                             "since the run started); resume with the run's data, or start a new run with another --out")
        workers = workers or len(os.sched_getaffinity(0))
        _remove_stale_temporaries(out)
        tmp = out.parent / work_name(f".{out.name}.prepare")
        tmp.mkdir(parents=True)
        (tmp / TMP_MARK).touch()
        lock.marks.append(tmp / TMP_MARK)  # the heartbeat shows the other machines it is alive
        try:
            manifest = _write(inputs, tmp, settings, digests, workers, log, tokenizers)
            atomic_write_bytes(tmp / bindata.MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())
            (tmp / TMP_MARK).unlink()  # after the manifest: `leftovers` knows it by one or the other
            fsync_path(tmp)
            _replace(tmp, out, digests, settings, tokenizers)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return out


def _write(inputs: Inputs, tmp: Path, settings: Settings, digests: dict[str, Any], workers: int,
           log: Callable[[str], None], tokenizers: TokenizerPair | None = None) -> dict[str, Any]:
    t0 = time.time()
    valid = None  # read first: a bad validation pair must not wait for the training set's hours of work
    if inputs.valid_src and inputs.valid_tgt:
        valid = read_parallel(inputs.valid_src, inputs.valid_tgt)  # validation sets are small
    scan = scan_parallel(inputs.train_src, inputs.train_tgt, settings.spm_sample, settings.seed)
    log(f"checked {scan.lines:,} training pairs in {time.time() - t0:.0f}s; " + (
        "encoding them with the given tokenizer" if tokenizers else
        f"training SentencePiece on {len(scan.sample):,} of them"))
    tok = tokenizers if tokenizers is not None else train_tokenizers(scan.sample, settings)
    del scan.sample[:]  # the workers are forked next: do not copy the sample into each
    tok.save(tmp)
    log(f"tokenizer: vocabulary {tok.src.vocab_size:,} ({time.time() - t0:.0f}s); encoding with {workers} processes")
    splits, files = {}, {}
    splits["train"], f = encode_split("train", inputs.train_src, inputs.train_tgt, tok, settings, tmp, workers,
                                      settings.long, log)
    files.update(f)
    if splits["train"]["pairs"] == 0:
        raise AiaynError(f"every training pair is longer than --max-len {settings.max_len}; raise --max-len")
    if valid is not None:
        for side, lines in zip(("src", "tgt"), valid):
            data = "".join(s + "\n" for s in lines).encode()
            atomic_write_bytes(tmp / bindata.VALID_TEXT[side], data)
            files[bindata.VALID_TEXT[side]] = {"sha256": hashlib.sha256(data).hexdigest()}
        # validation pairs are truncated, never skipped: the arrays stay aligned with the text
        splits["valid"], f = encode_split("valid", tmp / bindata.VALID_TEXT["src"], tmp / bindata.VALID_TEXT["tgt"], tok,
                                          settings, tmp, 1, "truncate", log)
        files.update(f)
    log(f"encoded {splits['train']['pairs']:,} training pairs in {time.time() - t0:.0f}s")
    tokenizer = {**tok.describe(), "files": {p.name: file_sha256(p) for p in sorted(tmp.glob("*.model"))}}
    return {"format": bindata.FORMAT, "version": bindata.VERSION, "settings": asdict(settings), "inputs": digests,
            "tokenizer": tokenizer, "splits": splits, "files": files}


def _check_out(out: Path, ours_at_all: bool = False) -> None:
    """--out may be new, an empty directory, or an earlier `prepare` output (replaced when done).
    `ours_at_all`: only that it is one (a user's file added to an up-to-date one is not refused)."""
    if out.exists() and not out.is_dir():
        raise AiaynError(f"--out {out} is a file; choose a new directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    written = _written(out)
    foreign = not written if ours_at_all else bool({p.name for p in out.iterdir()} - written)
    if foreign:
        raise AiaynError(f"--out {out} holds files that `aiayn prepare` did not write; choose a new or empty directory")


def _written(out: Path) -> set[str]:
    """The names an earlier `prepare` wrote in `out`, as its manifest lists them (none without one: a
    `manifest.json` of another tool does not make a folder ours to replace)."""
    try:
        m = json.loads((out / bindata.MANIFEST).read_text(encoding="utf-8"))
        if m.get("format") == bindata.FORMAT:
            return {bindata.MANIFEST, *m["files"], *m["tokenizer"]["files"]}
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    return set()


def _changed(out: Path, inputs: Inputs, digests: dict[str, Any]) -> str:
    """What differs from the manifest in `out`: the first changed input file, else the settings."""
    try:
        was = json.loads((out / bindata.MANIFEST).read_text(encoding="utf-8")).get("inputs", {})
    except (OSError, ValueError):
        was = {}
    was, now = _contents(was if isinstance(was, dict) else {}), _contents(digests)
    for name in ("train_src", "train_tgt", "valid_src", "valid_tgt"):
        if was.get(name) != now.get(name):
            return str(getattr(inputs, name) or f"--{name.replace('_', '-')}")
    return "--vocab-size/--joint-vocab/--spm-model-type/--max-len/--long"


def _up_to_date(out: Path, digests: dict[str, Any], settings: Settings, tokenizers: TokenizerPair | None = None,
                replace: bool = True) -> bool:
    """Whether `out` holds the output of these inputs and settings. Without `replace` (a resumed run,
    whose checkpoint holds the manifest's sha256) the inputs' bytes decide, not their names."""
    try:
        m = json.loads((out / bindata.MANIFEST).read_text(encoding="utf-8"))
        bindata.open_prepared(out)
    except (OSError, ValueError, AiaynError):
        return False
    same_tok = tokenizers is None or all(m.get("tokenizer", {}).get(k) == v for k, v in tokenizers.describe().items())
    was = m.get("inputs")
    same_inputs = was == digests or (not replace and isinstance(was, dict) and _contents(was) == _contents(digests))
    return same_inputs and m.get("settings") == asdict(settings) and same_tok


def _replace(tmp: Path, out: Path, digests: dict[str, Any], settings: Settings,
             tokenizers: TokenizerPair | None = None) -> None:
    """Rename `tmp` to `out`; an existing `out` (empty, or an earlier output) is moved aside first
    and removed only after the new one is in place. An `out` of these very inputs that another
    process put there meanwhile is kept (and `tmp` dropped): readers may have it open."""
    _check_out(out)  # again: something may have appeared meanwhile
    if out.is_dir() and not any(out.iterdir()):
        with contextlib.suppress(OSError):  # another process may have just filled it
            out.rmdir()
    if not out.exists():
        try:
            os.rename(tmp, out)
            return
        except OSError:  # another process renamed its own into place first
            pass
    if _up_to_date(out, digests, settings, tokenizers):
        return
    old = out.parent / work_name(f".{out.name}.old")
    os.rename(out, old)
    os.utime(old)  # its age says it is in use (`leftovers`: a rename leaves a folder's time as it was)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temporaries(out: Path, left: dict[str, bool] | None = None) -> None:
    """Temporary directories of earlier, killed runs for the same --out: only those we marked, and
    only if abandoned (`leftovers`, or `left` if already found: the directory may be the work of a
    live process on another machine that shares the folder)."""
    lock = _lock_path(out).name
    for name, abandoned in (leftovers(out) if left is None else left).items():
        if abandoned and name != lock:
            shutil.rmtree(out.parent / name, ignore_errors=True)


def leftovers(out: str | os.PathLike[str]) -> dict[str, bool]:
    """What interrupted runs of `prepare` for `out` left beside it, by name: the lock (a directory
    holding at most its `owner` file), the marked temporaries, a finished one (its mark already
    removed, its manifest written) and an earlier output moved aside by `_replace`, each True if
    abandoned (a dead process of this host, or untouched for `lock.STALE` seconds), False if a live
    process, maybe on another machine, may still use it. `train` tells them from a user's files in
    its run directory."""
    out = _named(out)
    found = {}
    lock = _lock_path(out)
    try:
        is_lock = {p.name for p in lock.iterdir()} <= {OWNER}
    except OSError:  # none, or released meanwhile
        is_lock = False
    if is_lock:
        found[lock.name] = FolderLock(lock).abandoned()
    name = glob.escape(out.name)  # "data[v2]" is a name, not a pattern
    for p in out.parent.glob(f".{name}.prepare-*"):
        if (p / TMP_MARK).is_file():
            found[p.name] = stale(p / TMP_MARK, *parse_work_name(p.name))
        elif _ours(p):  # finished: its manifest written, then its mark removed
            found[p.name] = stale(p / bindata.MANIFEST, *parse_work_name(p.name))
    for p in out.parent.glob(f".{name}.old-*"):
        if _ours(p):  # touched when moved aside
            found[p.name] = stale(p, *parse_work_name(p.name))
    return found


def _ours(p: Path) -> bool:
    """Whether `p` is a folder `prepare` wrote under a `work_name` of its own (a user's copy of a
    prepared folder under a name of its own is not)."""
    return parse_work_name(p.name)[0] is not None and bool(_written(p))


def _lock_path(out: Path) -> Path:
    """The lock of `out`'s preparation, beside it (several machines may share the folder)."""
    return out.parent / f".{out.name}.lock"


def _named(out: str | os.PathLike[str]) -> Path:
    """`out` as a path with a name (`Path(".").name` is empty) in its real folder: ".." after a link
    is where the OS goes ("link/../x" is beside the link's target, not beside the link). A link as
    `out` stands for its target, which is what gets replaced (renamed aside, the link itself was lost)."""
    path = Path(out).absolute()
    return path.resolve() if path.name == ".." or path.is_symlink() else path.parent.resolve() / path.name


def remove_abandoned(out: str | os.PathLike[str]) -> None:
    """Removes the abandoned `leftovers` of `out`: the temporaries, and the lock as a waiter takes it
    over (moved aside first: of two processes taking it over, one succeeds), without waiting for a
    live process that took it meanwhile."""
    out = _named(out)
    left = leftovers(out)
    _remove_stale_temporaries(out, left)
    if left.get(_lock_path(out).name):
        FolderLock(_lock_path(out)).break_abandoned()


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--out", required=True, help="the directory to write (replaced only if an earlier prepare wrote it)")
    p.add_argument("--data", choices=("multi30k", "wmt14"), default=None,
                   help="a named corpus (with --src/--tgt), instead of --train-src/--train-tgt")
    p.add_argument("--src", default="de", help="source language of --data")
    p.add_argument("--tgt", default="en", help="target language of --data")
    p.add_argument("--data-dir", default=None, help="folder holding the --data files (else $AIAYN_DATA or the cache)")
    for name in ("train-src", "train-tgt", "valid-src", "valid-tgt"):
        p.add_argument(f"--{name}", default=None, metavar="FILE", help="plain or .gz UTF-8 text, one sentence a line")
    p.add_argument("--vocab-size", type=int, default=d.vocab_size, help="SentencePiece vocabulary size (an upper bound)")
    p.add_argument("--joint-vocab", action=argparse.BooleanOptionalAction, default=d.joint_vocab,
                   help="one vocabulary for both languages")
    p.add_argument("--spm-model-type", default=d.spm_model_type, choices=MODEL_TYPES)
    p.add_argument("--spm-sample", type=int, default=d.spm_sample, metavar="N",
                   help="pairs sampled (seeded) to train SentencePiece")
    p.add_argument("--max-len", type=int, default=d.max_len, help="longest training pair in subword tokens per side")
    p.add_argument("--long", default=d.long, choices=("skip", "truncate"), help="what to do with longer pairs")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the SentencePiece sample")
    p.add_argument("--workers", type=int, default=0, help="encoding processes (0: one per CPU)")


def inputs_from_args(args: argparse.Namespace) -> Inputs:
    from aiayn.data import text as data

    files = [f"--{k.replace('_', '-')}" for k in ("train_src", "train_tgt", "valid_src", "valid_tgt") if getattr(args, k)]
    if args.data and files:  # as train refuses them: the files were ignored without a word
        raise AiaynError(f"--data {args.data} and {' '.join(files)} each name the training corpus; give one of them")
    if args.data == "multi30k":
        tr = data.multi30k_paths("train", args.src, args.tgt, args.data_dir)
        va = data.multi30k_paths("val", args.src, args.tgt, args.data_dir)
        return Inputs(tr[0], tr[1], va[0], va[1])
    if args.data == "wmt14":
        from aiayn.data.wmt14 import wmt14_paths

        tr, va = wmt14_paths(args.src, args.tgt, args.data_dir)
        return Inputs(tr[0], tr[1], va[0], va[1])
    if not args.train_src or not args.train_tgt:
        raise AiaynError("no training data: pass --train-src and --train-tgt, or --data multi30k|wmt14")
    opt = lambda v: Path(v) if v else None  # noqa: E731
    return Inputs(Path(args.train_src), Path(args.train_tgt), opt(args.valid_src), opt(args.valid_tgt))


def run(args: argparse.Namespace) -> int:
    if args.workers < 0:
        raise AiaynError(f"--workers must be 0 (one per CPU) or positive, got {args.workers}")
    settings = Settings(args.vocab_size, args.joint_vocab, args.spm_model_type, args.spm_sample, args.max_len,
                        args.long, args.seed)
    out = prepare(inputs_from_args(args), args.out, settings, args.workers)
    print(out)
    return 0
