"""The training corpus as `aiayn train` sees it: one data path, whatever the flags.

`--data-bin DIR` names a directory written by `aiayn prepare`; the raw-text flags (--train-src ...,
--data multi30k) are prepared into `RUN_DIR/data` first, by rank 0, with the same code, so both
routes train from memory-mapped arrays and batches cut from their length arrays.

What a run keeps in memory is independent of the corpus text: the memory maps (page cache, shared
by the ranks of a machine), the sorted order of the pair ids (4 bytes a pair) and one epoch's
shuffled copy of it. Each rank reads the token pages of its own batches only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from aiayn.data import batching, prepare
from aiayn.data.batching import BatchPlan, Batches
from aiayn.data.bindata import Prepared, Split, open_prepared
from aiayn.config import TrainConfig
from aiayn.errors import AiaynError
from aiayn.files import check_input_file
from aiayn.tokenizer import TokenizerPair

RUN_DATA = "data"  # the prepared raw text, inside the run directory


@dataclass
class Corpus:
    data: Prepared
    plan: BatchPlan  # the training pairs kept for this run (--max-len), sorted and cut (--max-tokens)
    valid_plan: BatchPlan | None
    valid_src: list[str]  # validation text, for BLEU
    valid_tgt: list[str]
    truncated: int = 0  # training pairs cut to --max-len, when prepared or at batching time

    @property
    def tokenizers(self) -> TokenizerPair:
        return self.data.tokenizers

    @property
    def train(self) -> Split:
        return self.data.train

    @property
    def valid(self) -> Split | None:
        return self.data.valid

    @property
    def digest(self) -> str:
        """sha256 of the manifest: a resumed run must see the same data."""
        return self.data.digest

    @property
    def n_train_pairs(self) -> int:
        return len(self.plan.order)

    def describe(self, tc: TrainConfig) -> str:
        """One line for the log: pairs kept of lines read, how many of them skipped or truncated (by
        --long, then the other where data prepared with other settings did it), validation pairs."""
        lines = self.data.manifest["splits"]["train"]["lines"]
        counts = {"skipped": lines - self.n_train_pairs, "truncated": self.truncated}
        how = "skipped" if tc.long == "skip" else "truncated"
        shown = [f"{counts[how]:,} of {lines:,} {how}"] + [f"{n:,} {k}" for k, n in counts.items() if k != how and n]
        return (f"{self.n_train_pairs:,} training pairs ({', '.join(shown)} as longer than "
                f"{min(tc.max_len, self.data.manifest['settings']['max_len'])} tokens), {len(self.valid_src):,} "
                f"validation pairs, from {self.data.path}")


def prepared_path(tc: TrainConfig, run_dir: Path) -> Path:
    """The prepared directory of this run: --data-bin, else RUN_DIR/data (`prepare_run_data`)."""
    return Path(tc.data_bin) if tc.data_bin else run_dir / RUN_DATA


def prepare_run_data(tc: TrainConfig, run_dir: Path, log: Callable[[str], None] = print,
                     resuming: bool = False, replace: bool = True, tokenizers: Any = None) -> Path:
    """The raw text prepared into RUN_DIR/data (with `tokenizers` if given, else new ones). Train
    calls it on rank 0, then on the first process of every other machine (whose --out may be its own;
    with a shared one it finds the work done). A resumed run finds it up to date (or missing, and
    prepares it again byte for byte); if the text changed it is refused, never replaced, since the
    run was trained on it."""
    path = run_dir / RUN_DATA
    settings = prepare.Settings(vocab_size=tc.vocab_size, joint_vocab=tc.joint_vocab,
                                spm_model_type=tc.spm_model_type, max_len=tc.max_len, long=tc.long)
    prepare.prepare(_raw_inputs(tc), path, settings, workers=1, log=log, replace=replace and not resuming,
                    tokenizers=tokenizers)
    return path


def _raw_inputs(tc: TrainConfig) -> prepare.Inputs:
    from aiayn.data import text as data

    if tc.data is not None:
        if tc.data != "multi30k":
            raise AiaynError(f"--data {tc.data!r} is not a known corpus; use --data multi30k or --train-src/--train-tgt, "
                             "or prepare it with `aiayn prepare --data` and pass --data-bin")
        if tc.src not in data.LANGS or tc.tgt not in data.LANGS or tc.src == tc.tgt:
            raise AiaynError(f"--src {tc.src} --tgt {tc.tgt} is not a Multi30k language pair; choose two different "
                             f"of {', '.join(data.LANGS)}")
        tr = data.multi30k_paths("train", tc.src, tc.tgt, tc.data_dir)
        va = data.multi30k_paths("val", tc.src, tc.tgt, tc.data_dir)
        return prepare.Inputs(tr[0], tr[1], va[0], va[1])
    if not tc.train_src or not tc.train_tgt:
        raise AiaynError("no training data: pass --data multi30k --src de --tgt en, --train-src and --train-tgt, "
                         "or --data-bin DIR")
    for name in ("train_src", "train_tgt", "valid_src", "valid_tgt"):  # a folder said "no such file"
        if getattr(tc, name):
            check_input_file(getattr(tc, name), "--" + name.replace("_", "-"))
    opt = lambda v: Path(v) if v else None  # noqa: E731
    return prepare.Inputs(Path(tc.train_src), Path(tc.train_tgt), opt(tc.valid_src), opt(tc.valid_tgt))


def _with_eos(lengths: np.ndarray, source_eos: bool) -> np.ndarray:
    """Source lengths with the EOS each source gets, if it does; widened first, as a prepared
    directory of --max-len 255 or less stores them in 8 bits (255 + 1 would wrap to 0)."""
    return lengths.astype(np.int64) + 1 if source_eos else lengths


def open_corpus(path: Path, tc: TrainConfig, source_eos: bool = False) -> Corpus:
    """Open a prepared directory and plan its batches for `tc` (--max-len, --long, --max-tokens); the
    arrays hold bare sentences, and with `source_eos` every source is one token longer (its EOS)."""
    data = open_prepared(path)
    src, tgt = data.train.src.lengths, data.train.tgt.lengths
    keep, shorter = None, tc.max_len < data.manifest["settings"]["max_len"]
    truncated = data.manifest["splits"]["train"].get("truncated", 0)  # by prepare, each to its --max-len
    if tc.long == "skip" and shorter:
        keep, truncated = _within(src, tgt, tc.max_len), 0  # those prepare cut are longer than this
    else:
        if shorter:  # cut now, those prepare cut among them
            truncated = max(truncated, len(src) - int(_within(src, tgt, tc.max_len).sum()))
        src, tgt = data.train.lengths(tc.max_len)
    plan = batching.plan_batches(_with_eos(src, source_eos), tgt, tc.max_tokens, keep)
    if len(plan.order) == 0:
        raise AiaynError(f"every training pair is longer than --max-len {tc.max_len}; raise --max-len")
    valid_plan: BatchPlan | None = None
    vs: list[str] = []
    vt: list[str] = []
    if data.valid is not None:
        vsrc, vtgt = data.valid.lengths(tc.max_len)
        vsrc = _with_eos(vsrc, source_eos)
        # a pair wider than --max-tokens gets a batch of its own: left out, it was missing from the
        # loss (and where all were, the validation loss was 0)
        valid_plan = batching.plan_batches(vsrc, vtgt, tc.max_tokens, alone=True)
        vs, vt = data.valid_text()
    return Corpus(data, plan, valid_plan, vs, vt, truncated)


def _within(src: np.ndarray, tgt: np.ndarray, max_len: int) -> np.ndarray:
    """(N,) bool: both sides at most `max_len` tokens (read in chunks from the memory maps)."""
    keep = np.empty(len(src), bool)
    for s in range(0, len(src), 1 << 20):
        keep[s : s + (1 << 20)] = (src[s : s + (1 << 20)] <= max_len) & (tgt[s : s + (1 << 20)] <= max_len)
    return keep


def valid_batches(corpus: Corpus) -> Batches:
    """The validation batches in length order (empty without a validation set)."""
    if corpus.valid_plan is None:
        return Batches(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int64))
    return batching.epoch_batches(corpus.valid_plan, 0, 0, shuffle=False)
