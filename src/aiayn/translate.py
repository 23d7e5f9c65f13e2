"""Translation with a trained model: the Python API (`Translator` on torch, `CT2Translator` on a
CTranslate2 export, one interface) and `aiayn translate`.

Raw text in, detokenized text out (Section 6.1's beam search, see `aiayn.search`). The promises,
pinned by tests/test_translate.py:

- exactly one output line per input line (N lines with `--nbest N`), in input order; sentences are
  sorted by length inside for speed and put back in order;
- an empty or blank line gives an empty line; a line longer than the model takes is truncated to
  `max_src_tokens` source tokens with a note on stderr, never dropped;
- input is read in chunks of whatever lines are available, so `... | aiayn translate | ...` streams;
  each chunk is written and flushed before the next is read;
- Ctrl-C (SIGINT), SIGTERM and SIGHUP keep every line already written, line-aligned, and exit
  128 + the signal with a message; `--output` over a file is put in place at the end (`files.ReplacingFile`).

`precision="bf16"` runs search on a bfloat16 copy of the model (faster than autocast: no per-op
casts; same BLEU within noise, a few outputs differ from fp32) (log-probabilities and scores are
still computed in float32).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import json
import math
import os
import select
import signal
import stat
import sys
import threading
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, TypeVar

import torch

import aiayn.kernels
from aiayn.checkpoint import EXPORT_MARKER
from aiayn.config import INFERENCE_PRECISIONS
from aiayn.kernels import ModuleT
from aiayn.errors import AiaynError, require
from aiayn import memory
from aiayn.files import (COMPRESSED_HEAD, ENCODING_HEAD, LineLengthCheck, ReplacingFile, long_line_error,
                         refuse_compressed, refuse_wide_text, silence_stdout)
from aiayn.search import DEFAULT_STOP_RULE, MAX_ALPHA, STOP_RULES, ScoredIds, beam_search, greedy_search
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, PIECES, Tokenizer, TokenizerPair, vocabulary

if TYPE_CHECKING:
    from aiayn.sentences import Paragraph

# Characters that `str.splitlines` treats as line ends: an output line must never contain one.
_LINE_BREAKS = str.maketrans({c: " " for c in "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"})


def one_line(text: str) -> str:
    """`text` with every line-break character replaced by a space (keeps outputs line-aligned)."""
    return text.translate(_LINE_BREAKS)


@dataclass
class Settings:
    """Search settings shared by the API and the CLI, checked once."""

    beam: int = 4
    alpha: float = 0.6
    nbest: int = 1
    max_tokens: int = 4096  # source tokens per batch, padding included
    batch_size: int = 256  # sentences per batch at most
    max_len_a: float = 1.0
    max_len_b: int = 50
    min_len: int = 0
    workers: int = 0  # batches searched at once on the CPU; 0: one per torch thread (see `map_batches`)
    stop_rule: str | None = None  # beam search's stopping rule (`aiayn.search.STOP_RULES`); None: the translator's

    def check(self) -> None:
        if self.beam < 1:
            raise AiaynError(f"--beam must be at least 1, got {self.beam}")
        if not 1 <= self.nbest <= self.beam:
            raise AiaynError(f"--nbest must be between 1 and --beam ({self.beam}), got {self.nbest}")
        if not 0 <= self.alpha <= MAX_ALPHA:  # nan fails the comparison
            raise AiaynError(f"--alpha must be between 0 and {MAX_ALPHA:g} (the paper: 0.6), got {self.alpha}")
        if self.max_tokens < 1:
            raise AiaynError(f"--max-tokens must be positive, got {self.max_tokens}")
        if self.batch_size < 1:
            raise AiaynError(f"--batch-size must be positive, got {self.batch_size}")
        if not (self.max_len_a >= 0 and self.max_len_b >= 0) or math.inf in (self.max_len_a, self.max_len_b):
            raise AiaynError(f"--max-len-a and --max-len-b must be finite numbers >= 0, got {self.max_len_a} and "
                             f"{self.max_len_b}")
        if self.min_len < 0:
            raise AiaynError(f"--min-len must be >= 0, got {self.min_len}")
        if self.workers < 0:
            raise AiaynError(f"--workers must be >= 0 (0: one per CPU thread), got {self.workers}")
        if self.stop_rule is not None and self.stop_rule not in STOP_RULES:
            raise AiaynError(f"--stop-rule must be one of {', '.join(STOP_RULES)}, got {self.stop_rule!r}")


_INVISIBLE = frozenset(("Cc", "Cf", "Zs", "Zl", "Zp"))  # controls, format marks (ZWSP, BOM), spaces


def has_text(line: str) -> bool:
    """False for a line of nothing but whitespace, control and format characters (a NUL, a zero-width
    space, a stray byte-order mark): it is blank and gets an empty translation."""
    return any(unicodedata.category(c) not in _INVISIBLE for c in line)


def source_lines(lines: Sequence[str]) -> list[str]:
    """The lines a translator's `search` was given, as a list: a generator is read once (search goes
    over the lines twice), and one string is refused rather than translated character by character."""
    if isinstance(lines, (str, bytes)):
        raise TypeError(f"lines must be a list of sentences, got one {type(lines).__name__}; pass [text]")
    return list(lines)


def encode_sources(tokenizers: TokenizerPair, lines: Sequence[str], max_src_tokens: int,
                   note: Callable[[str], None], first_line: int = 1, eos: bool = False) -> list[list[int]]:
    """Source ids per line ([] for a blank line), ending with EOS if `eos` (a model trained so:
    `ModelConfig.source_eos`); a line longer than `max_src_tokens` (EOS included) is cut to it and
    `note` says which line (the contract of every translation engine: nothing is dropped)."""
    out: list[list[int]] = []
    room = max(1, max_src_tokens - eos)
    for i, line in enumerate(lines):
        ids = tokenizers.src.encode(line) if has_text(line) else []
        if len(ids) > room:
            note(f"line {first_line + i}: {len(ids)} source tokens, more than the model takes; "
                 f"translated its first {room} tokens only")
            ids = ids[:room]
        out.append(ids + [EOS_ID] if ids and eos else ids)
    return out


def length_batches(encoded: list[list[int]], max_tokens: int, batch_size: int) -> Iterator[list[int]]:
    """Indices of non-empty sentences, longest first, cut so that a batch holds at most `batch_size`
    sentences and `max_tokens` source tokens, padding counted (a longer sentence still goes, alone)."""
    order = sorted((i for i, ids in enumerate(encoded) if ids), key=lambda i: -len(encoded[i]))
    batch: list[int] = []
    for i in order:
        longest = len(encoded[batch[0]]) if batch else len(encoded[i])
        if batch and (len(batch) + 1 > batch_size or (len(batch) + 1) * longest > max_tokens):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


_threads_lock = threading.Lock()
_threads_state = {"users": 0, "saved": 0}  # map_batches calls running, and torch's thread count before them


@contextlib.contextmanager
def _original_thread_count() -> Iterator[int]:
    """torch's thread count as it was before any running `map_batches` call (calls may overlap, from
    several threads or nested), put back as the global count when the last of them ends.

    torch keeps one count per thread, taken from a process-wide one when the thread first runs an
    operation; a worker sets its own (and with it the process-wide one), so the caller's is unchanged
    and only the process-wide count needs putting back."""
    with _threads_lock:
        if _threads_state["users"] == 0:
            _threads_state["saved"] = torch.get_num_threads()
        _threads_state["users"] += 1
        total = _threads_state["saved"]
    try:
        yield total
    finally:
        with _threads_lock:
            _threads_state["users"] -= 1
            if _threads_state["users"] == 0:
                torch.set_num_threads(_threads_state["saved"])


def worker_count(workers: int, n_batches: int, device: torch.device | str = "cpu") -> int:
    """How many batches `map_batches` searches at once: `workers` (0: one per torch thread) on the
    CPU, never more than there are batches; one on other devices."""
    if torch.device(device).type != "cpu":
        return 1
    return max(1, min(workers or torch.get_num_threads(), n_batches))


def map_batches(fn: Callable[[Any], Any], batches: Sequence[Any], workers: int = 0,
                device: torch.device | str = "cpu") -> list[Any]:
    """[fn(b) for b in batches], with up to `workers` batches searched at once on the CPU.

    A decoding step is many small operations (attention over a few keys, layer norms, the per-row
    top-k) that split poorly across intra-op threads, while independent batches need no
    synchronisation at all. So, like Marian's CPU workers and CTranslate2's inter_threads, W workers
    each take the next batch (the longest come first) and run it on T // W of torch's T threads;
    torch releases the GIL inside every operation. 0 means one worker per thread. The results do not
    depend on `workers` (each batch is searched as it would be alone), only the time does; other
    devices take one batch at a time. `fn` runs in worker threads, where grad mode and autocast are
    the thread's own (torch keeps them per thread): the searches set inference mode themselves.

    Measured with bench/decode.py (2 threads, 1000 sentences, beam 4): see the README."""
    n = worker_count(workers, len(batches), device)
    if n == 1:
        return [fn(b) for b in batches]
    with _original_thread_count() as total:
        pool = ThreadPoolExecutor(n, thread_name_prefix="aiayn-search", initializer=torch.set_num_threads,
                                  initargs=(max(1, total // n),))  # each worker on its share of the threads
        try:
            futures = [pool.submit(fn, b) for b in batches]
            return [f.result() for f in futures]
        finally:  # on an error or Ctrl-C, batches not yet started are dropped; running ones end first
            pool.shutdown(wait=True, cancel_futures=True)


def _stderr_note(msg: str) -> None:
    print(f"aiayn translate: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode (no dropout) for the block, then every submodule's own mode back: a model being
    trained can translate a sample and go on training. A model already in eval mode throughout (a
    translator's, which server threads share) is left untouched: no per-call setting of every
    submodule's flag (~1 ms a call, 2-3% of a one-sentence translation)."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        yield
    finally:
        for m in training:
            m.training = True


M = TypeVar("M", bound=torch.nn.Module)


def inference_view(model: M, device: torch.device | str | None = None) -> M:
    """`model` itself if its weights are frozen, on `device` (None: where they are) and it is in
    eval mode; else a copy whose parameters are frozen aliases of the caller's (same storage, no
    copy of the weights), so search takes the packed inference GEMMs and switches only the view's
    mode while the caller's model keeps training (or serves another thread), moved to `device` if
    it is elsewhere (the caller's model stays where it is). A new view per call: the optimizer may
    have changed the weights in place since (fused Adam without bumping their version), so no
    packed copy is reused."""
    params = list(model.parameters())
    elsewhere = device is not None and any(p.device != torch.device(device) for p in params)
    if not any(p.requires_grad for p in params) and not elsewhere and not any(m.training for m in model.modules()):
        return model
    memo: dict[int, Any] = {id(p): torch.nn.Parameter(p.detach(), requires_grad=False) for p in params}
    view = copy.deepcopy(model, memo)
    return view.to(device) if elsewhere else view  # moves the view's own parameter objects only


def int8_model(model: ModuleT, device: torch.device | str = "cpu", own: bool = False) -> ModuleT:
    """`model` with its linear layers in int8 (`kernels.quantize_int8`): a frozen float32 copy, or,
    if the caller hands it over (`own`), the model itself, frozen (no second copy of the weights in
    memory). CPU only: PyTorch's int8 kernels (FBGEMM's, oneDNN's) are CPU kernels."""
    device = torch.device(device)
    if device.type != "cpu":
        raise AiaynError(f"--precision int8 runs on the CPU only (PyTorch's FBGEMM and oneDNN kernels), not on {device}; "
                         "use fp32 or bf16 there")
    if (why := aiayn.kernels.int8_unavailable()) is not None:
        raise AiaynError(f"--precision int8: {why}")
    model = model if own else copy.deepcopy(model)
    return aiayn.kernels.quantize_int8(model.float().requires_grad_(False).to(device).eval())


class BaseTranslator:
    """The interface of both translators, `Translator` (torch) and `CT2Translator` (CTranslate2):
    `search` gives each input line its n-best (translation, score) list, `translate` the texts."""

    note: Callable[[str], None]  # told about each line longer than the model takes
    tokenizers: TokenizerPair

    def search(self, lines: Sequence[str], first_line: int = 1, **settings: Any) -> list[list[tuple[str, float]]]:
        raise NotImplementedError

    def translate(self, lines: Sequence[str], beam: int = 4, alpha: float = 0.6, nbest: int = 1,
                  max_tokens: int = 4096, **settings: Any) -> list[str]:
        """Translations of `lines`, one per line in order (with nbest=N: N consecutive ones per line,
        the best first; fewer only if the search found fewer)."""
        res = self.search(lines, beam=beam, alpha=alpha, nbest=nbest, max_tokens=max_tokens, **settings)
        return [text for nb in res for text, _ in nb[:nbest]]


class Translator(BaseTranslator):
    """A model and its tokenizers, ready to translate lists of raw sentences.

    `max_src_tokens` (default: the model's `max_positions`) caps the source length; longer lines
    are truncated and `note` (default: print on stderr) is told which line and by how much.
    """

    def __init__(self, model: Any, tokenizers: Any, precision: str = "fp32", device: str | torch.device = "cpu",
                 max_src_tokens: int | None = None, note: Callable[[str], None] | None = None,
                 stop_rule: str = DEFAULT_STOP_RULE) -> None:
        if precision not in INFERENCE_PRECISIONS:
            raise AiaynError(f"--precision must be one of {', '.join(INFERENCE_PRECISIONS)}, got {precision!r}")
        self.device = torch.device(device)
        if precision == "int8" and not aiayn.kernels.is_int8(model):  # checked before asking CUDA anything
            model = int8_model(model, self.device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current one, as .to() takes it
            self.device = torch.device("cuda", torch.cuda.current_device())
        if precision == "bf16" and next(model.parameters()).dtype != torch.bfloat16:
            # a copy of our own: frozen, so its linear layers take the packed inference GEMMs
            model = copy.deepcopy(model).to(torch.bfloat16).requires_grad_(False).to(self.device).eval()
        # The caller's model stays as it was (mode, requires_grad, device): `search` runs on
        # `inference_view`, on `device` (a model on another device is copied there per search).
        self.model = model
        self.tokenizers = tokenizers
        self.precision = precision
        self.max_src_tokens = int(max_src_tokens or model.cfg.max_positions)
        self.note = note or _stderr_note
        self.stop_rule = stop_rule  # what a search that names none uses (`aiayn serve --stop-rule`)
        if precision == "bf16" and aiayn.kernels.slow_bf16_on(self.device):
            # on stderr, not through `note`: that is for lines (the server's refuses them)
            print(f"aiayn: warning: {aiayn.kernels.SLOW_BF16}; --precision fp32 is faster here", file=sys.stderr, flush=True)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], precision: str = "fp32", device: str = "cpu",
                        **kwargs: Any) -> "Translator":
        """A checkpoint directory, or a run directory (its best/, else its newest step_N/)."""
        from aiayn.checkpoint import load_checkpoint, resolve_checkpoint

        return cls.from_loaded(load_checkpoint(resolve_checkpoint(path)), precision, device, **kwargs)

    @classmethod
    def from_loaded(cls, ckpt: Any, precision: str = "fp32", device: str = "cpu", **kwargs: Any) -> "Translator":
        """A translator that owns a loaded checkpoint's model: frozen once, so every search runs it as
        it is on weights packed once, not on a fresh view whose weights are packed anew (which made a
        one-line request of `aiayn serve` a third slower; docs/serving.md)."""
        model = ckpt.model.requires_grad_(False)
        model = int8_model(model, device, own=True) if precision == "int8" else model.to(device)
        return cls(model, ckpt.tokenizers, precision=precision, device=device, **kwargs)

    def encode(self, lines: Sequence[str], first_line: int = 1) -> list[list[int]]:
        """Source ids per line ([] for a blank line), truncated to `max_src_tokens` with a note."""
        return encode_sources(self.tokenizers, lines, self.max_src_tokens, self.note, first_line,
                              getattr(self.model.cfg, "source_eos", False))

    @torch.no_grad()
    def search(self, lines: Sequence[str], first_line: int = 1, **settings: Any) -> list[list[tuple[str, float]]]:
        """Per input line, up to `nbest` (translation, score) pairs, best first; a blank line gives
        `nbest` times ("", 0.0), so that n-best lists stay aligned with the input.

        Scores are those of `aiayn.search.beam_search`; greedy search (beam=1) reports nan.

        `settings` are the fields of `Settings` (beam, alpha, nbest, max_tokens, batch_size,
        max_len_a, max_len_b, min_len, workers). `first_line` numbers the lines in notes.
        """
        return [[(one_line(self.tokenizers.tgt.decode(ids)), score) for ids, score in nb]
                for nb in self.search_ids(lines, first_line, **settings)]

    def search_ids(self, lines: Sequence[str], first_line: int = 1,
                   on_line: Callable[[int, list[tuple[list[int], float]]], None] | None = None,
                   **settings: Any) -> list[list[tuple[list[int], float]]]:
        """`search` before detokenizing: per line, its n-best (target ids without BOS/EOS, score);
        the exact tokens the search chose, for callers that show them (the server's attention).

        `on_line(i, n-best)`, if given, is called (in the thread that searched it) as soon as line i
        is done, before the rest of its batch; never for a blank line."""
        s = Settings(**settings)
        s.check()
        lines = source_lines(lines)
        encoded = self.encode(lines, first_line)
        results: list[list[tuple[list[int], float]]] = [[([], 0.0)] * s.nbest for _ in lines]
        model = inference_view(self.model, self.device)
        pad = model.cfg.pad_id

        def run(batch: list[int]) -> list[list[ScoredIds]]:
            S = len(encoded[batch[0]])
            src = torch.full((len(batch), S), pad, dtype=torch.long)  # (B, S) right-padded
            for row, i in enumerate(batch):
                src[row, : len(encoded[i])] = torch.tensor(encoded[i])
            src = src.to(self.device)
            done = None if on_line is None else (lambda row, nb: on_line(batch[row], nb))  # row -> line
            if s.beam == 1:
                greedy_done = None if done is None else (lambda row, ids: done(row, [(ids, float("nan"))]))
                return [[(ids, float("nan"))] for ids in greedy_search(
                    model, src, BOS_ID, EOS_ID, s.max_len_a, s.max_len_b, s.min_len, on_done=greedy_done)]
            return beam_search(model, src, BOS_ID, EOS_ID, beam=s.beam, alpha=s.alpha, max_len_a=s.max_len_a,
                               max_len_b=s.max_len_b, min_len=s.min_len, nbest=s.nbest, on_done=done,
                               stop=s.stop_rule or self.stop_rule)

        batches = list(length_batches(encoded, s.max_tokens, s.batch_size))
        with evaluating(model):
            for batch, hyps in zip(batches, map_batches(run, batches, s.workers, self.device)):
                for i, nb in zip(batch, hyps):
                    results[i] = [([int(t) for t in ids], score) for ids, score in nb]
        return results


_CT2_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8", "float16": "fp16", "int16": "int16"}


def _check_ct2_precision(ct2: Any, precision: str) -> None:
    """--precision bf16 (or int8) where CTranslate2 has no kernels for it on this CPU (its own test,
    `get_supported_compute_types`: 4.8 has no bfloat16 on a CPU, AVX-512 BF16 or not) is one line
    naming the precisions that run here, before the model loads."""
    try:
        have = {p for c, p in _CT2_PRECISION.items() if c in ct2.get_supported_compute_types("cpu")}
    except (AttributeError, RuntimeError, ValueError):  # (a CTranslate2 that cannot tell: loading the model says)
        return
    if precision != "fp32" and precision not in have:
        other = " or ".join(p for p in INFERENCE_PRECISIONS if p == "fp32" or p in have)
        raise AiaynError(f"--precision {precision}: CTranslate2 does not run {precision} on this CPU; "
                         f"use --precision {other}")


class CT2Translator(BaseTranslator):
    """Translates text with a CTranslate2 export (`aiayn export --to ctranslate2`).

    The same contract as `Translator` (`search` and `translate` take the same settings): one output
    per input line, in order; a blank line gives an empty translation; a line longer than the
    model's `max_positions` is truncated with a note. The maximum length per
    sentence is aiayn's floor(max_len_a * source length + max_len_b) tokens, and at most
    `max_positions` (the export's table of positions ends there, where aiayn's grows); PAD and BOS are never
    generated. Greedy search gives aiayn's translations; CTranslate2's beam search divides scores by
    len**alpha where aiayn divides by ((5 + len) / 6)**alpha, and it stops a hypothesis at the
    batch's longest length limit (cut to the sentence's own limit afterwards) instead of forcing EOS.
    `precision` "fp32" computes in the export's own weight type (float32 or int8); "bf16" in bfloat16;
    "int8" quantizes a float export to int8 as it loads.
    """

    def __init__(self, path: str | Path, precision: str = "fp32", threads: int = 0,
                 note: Any = None) -> None:
        ct2 = require("ctranslate2", "--engine ctranslate2")
        path = Path(path)
        if not (path / "model.bin").is_file():
            raise AiaynError(f"{path} is not a CTranslate2 export (no model.bin); create one with "
                             "`aiayn export --checkpoint DIR --to ctranslate2 OUT`")
        if precision not in INFERENCE_PRECISIONS:
            raise AiaynError(f"--precision must be one of {', '.join(INFERENCE_PRECISIONS)}, got {precision!r}")
        _check_ct2_precision(ct2, precision)
        self.path = path
        self.tokenizers = TokenizerPair.load(path)
        self._src_vocab = vocabulary(self.tokenizers.src)
        self._tgt_index = {p: i for i, p in enumerate(vocabulary(self.tokenizers.tgt))}
        try:
            meta = json.loads((path / "aiayn.json").read_text(encoding="utf-8"))
            self.max_positions = int(meta["model"]["max_positions"])  # the export's table of positions
            self.max_src_tokens = self.max_positions  # the same cap on the way in (the `Translator` contract)
            self.source_eos = bool(meta["model"].get("source_eos", False))  # older exports: bare sources
        except (OSError, ValueError, KeyError, TypeError):
            raise AiaynError(f"{path}/aiayn.json is missing or damaged; export the checkpoint again") from None
        self.note = note or _stderr_note
        compute = {"fp32": "default", "bf16": "bfloat16", "int8": "int8"}[precision]
        try:
            self.engine = ct2.Translator(str(path), device="cpu", compute_type=compute, intra_threads=threads)
        except (RuntimeError, ValueError) as e:
            raise AiaynError(f"{path}: CTranslate2 cannot load it with precision {precision} "
                             f"({str(e).splitlines()[0]})") from e
        # what runs: fp32 is the export's own type ("default"), int8 for an `--quantization int8` export
        self.precision = _CT2_PRECISION.get(self.engine.compute_type.split("_")[0], self.engine.compute_type)

    @classmethod
    def from_path(cls, path: str | Path, precision: str = "fp32", **kwargs: Any) -> "CT2Translator":
        return cls(path, precision, **kwargs)

    def translate_ids(self, src_ids: Sequence[Sequence[int]], beam: int = 4, alpha: float = 0.6, nbest: int = 1,
                      max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 0,
                      max_tokens: int = 4096) -> list[list[tuple[list[int], float]]]:
        """Per sentence, up to `nbest` (ids, score) pairs, best first; ids without BOS/EOS.

        An empty source gives `nbest` times ([], 0.0). Greedy scores are nan (as in aiayn).
        """
        if beam > len(self._tgt_index):  # (as the torch engine says it; CTranslate2 would try to allocate it)
            raise AiaynError(f"--beam {beam} is larger than the target vocabulary ({len(self._tgt_index)} tokens)")
        out: list[list[tuple[list[int], float]]] = [[([], 0.0)] * int(nbest) for _ in src_ids]
        todo = [i for i, s in enumerate(src_ids) if len(s)]
        if not todo:
            return out
        # (the product can overflow to inf: the table of positions is the limit then)
        # (and b past float's range, an int of 400 digits, cannot meet a float: capped first)
        b = min(max_len_b, self.max_positions)
        limits = [max(1, math.floor(min(len(src_ids[i]) * max_len_a + b, self.max_positions))) for i in todo]
        results = self.engine.translate_batch(
            [[self._src_vocab[t] for t in src_ids[i]] for i in todo],
            beam_size=int(beam), num_hypotheses=int(nbest), length_penalty=float(alpha) if beam > 1 else 0.0,
            max_decoding_length=max(limits), min_decoding_length=min(int(min_len), max(limits)), max_input_length=0,
            suppress_sequences=[[PIECES[PAD_ID]], [PIECES[BOS_ID]]], return_scores=beam > 1,
            # no more than all of them: CTranslate2 reserves room for max_batch_size sentences
            max_batch_size=min(int(max_tokens), sum(len(src_ids[i]) for i in todo)), batch_type="tokens",
        )
        for i, limit, r in zip(todo, limits, results):
            scores = r.scores if beam > 1 else [float("nan")] * len(r.hypotheses)
            out[i] = [([self._tgt_index[p] for p in h][:limit], float(sc)) for h, sc in zip(r.hypotheses, scores)]
        return out

    def search(self, lines: Sequence[str], first_line: int = 1, **settings: Any) -> list[list[tuple[str, float]]]:
        """Per input line, up to `nbest` (translation, score) pairs, as `Translator.search`."""
        s = Settings(**settings)
        s.check()
        lines = source_lines(lines)
        ids = encode_sources(self.tokenizers, lines, self.max_src_tokens, self.note, first_line, self.source_eos)
        hyps = self.translate_ids(ids, s.beam, s.alpha, s.nbest, s.max_len_a, s.max_len_b, s.min_len, s.max_tokens)
        return [[(one_line(self.tokenizers.tgt.decode(h)), sc) for h, sc in nb] for nb in hyps]


# ------------------------------------------------------------------------------------- the CLI


class LineChunks:
    """Reads lines from a binary stream in chunks of whatever is available (at most `max_lines`).

    It blocks only when no complete line is waiting, so one sentence typed into a pipe is
    translated at once, while a file or a fast producer fills whole chunks. Lines end in "\\n";
    a "\\r" before it (Windows) is dropped; the text must be UTF-8 (UTF-16 is refused at once), and a
    line no longer than `files.MAX_LINE_BYTES`: past it the lines before it are handed out, then the
    error (/dev/zero grew the buffer without limit).
    """

    def __init__(self, stream: BinaryIO, name: str, max_lines: int = 500) -> None:
        self.fd, self.name, self.max_lines = stream.fileno(), name, max_lines
        self.buf = bytearray()  # grown in place: bytes += copied the whole of a long line at every read
        self.newlines = 0  # b"\n" in buf, counted as bytes arrive: a rescan per read was quadratic in a line
        self.eof = False
        self.failed: AiaynError | None = None  # a read that failed: raised once the complete lines before it are out
        self.line_no = 0  # lines handed out so far
        self.lengths = LineLengthCheck()

    def _ready(self) -> bool:
        try:
            return bool(select.select([self.fd], [], [], 0)[0])
        except (OSError, ValueError):
            return True

    def _fill(self, block: bool) -> None:
        if self.eof or (not block and not self._ready()):
            return
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:  # a non-blocking input (O_NONBLOCK left on a shared pipe or terminal) with nothing yet
            if block:
                select.select([self.fd], [], [])  # wait for it, as a blocking read would
            return
        except OSError as e:  # (a disk or network error): the lines read so far are still translated
            self.failed = AiaynError(f"{self.name}: cannot read ({e.strerror or e}) after line {self.line_no + self.newlines}"
                                     " (--input)")
            self.eof = True
            return
        if not data:
            self.eof = True
            return
        if self.line_no == 0 and len(self.buf) < ENCODING_HEAD:  # the input's first bytes: not an archive, not UTF-16
            head = bytes(self.buf[:ENCODING_HEAD] + data[:ENCODING_HEAD])
            refuse_compressed(self.name, head[:COMPRESSED_HEAD], gzip_ok=False)
            refuse_wide_text(self.name, head[:ENCODING_HEAD], "input")
        if self.lengths.past_cap(data) is not None:  # (a read is shorter than the cap: the line began before it)
            del self.buf[self.buf.rfind(b"\n") + 1:]  # its start: not a line to translate
            self.failed = long_line_error(self.name, self.line_no + self.newlines + 1, "input", "--input")
            self.eof = True
            return
        self.buf += data
        self.newlines += data.count(b"\n")

    def _take(self) -> list[bytearray]:
        """Up to `max_lines` lines off the front of the buffer (at the end, the last one without its
        newline). Each search starts where the last line ended and the rest is not copied (a bytearray
        drops its front in place): --chunk-lines 1 on a read of thousands of short lines is linear too."""
        lines: list[bytearray] = []
        pos = 0
        while len(lines) < self.max_lines and (end := self.buf.find(b"\n", pos)) >= 0:
            lines.append(self.buf[pos:end])
            pos = end + 1
        del self.buf[:pos]
        self.newlines -= len(lines)
        if self.eof and self.buf and len(lines) < self.max_lines and self.failed is None:
            lines.append(self.buf)  # the last line, without a newline (after a failed read: a line cut short)
            self.buf = bytearray()
        return lines

    def _decode(self, raw: bytes | bytearray, line_no: int) -> str:
        if line_no == 1 and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]  # a byte-order mark is not text
        if raw.endswith(b"\r"):
            raw = raw[:-1]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise AiaynError(f"{self.name}:{line_no}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                             f"{e.start + 1}); convert the input to UTF-8") from None

    def __iter__(self) -> Iterator[list[str]]:
        while True:
            while not self.newlines and not self.eof:
                self._fill(block=True)
            while self.newlines < self.max_lines and not self.eof and self._ready():
                self._fill(block=False)  # take what is already there, without waiting for more
            complete = self._take()
            if complete:
                first = self.line_no + 1
                self.line_no += len(complete)
                lines: list[str] = []
                for k, raw in enumerate(complete):
                    try:
                        lines.append(self._decode(raw, first + k))
                    except AiaynError:
                        if lines:  # the lines before the bad one are still translated and written
                            yield lines
                        raise
                yield lines
            if self.eof and (not self.buf or (self.failed is not None and not self.newlines)):
                if self.failed is not None:
                    raise self.failed
                return


def inference_device(name: str, precision: str = "fp32", flag: str = "--device") -> torch.device:
    """`--device`: auto (the GPU where there is one, else the CPU; the CPU for int8, which runs only
    there), cpu, cuda or cuda:N; a device this machine lacks is one line, before any model is loaded."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() and precision != "int8" else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise AiaynError(f"{flag} {name}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise AiaynError(f"{flag} {name}: no CUDA device is available; use {flag} cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise AiaynError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def add_device_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto",
                   help="auto (a GPU where there is one), cpu, cuda or cuda:N; the torch engine only")


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    """The search flags shared by `aiayn translate` and `aiayn evaluate`."""
    p.add_argument("--beam", type=int, default=4, help="beam size (1 = greedy)")
    p.add_argument("--alpha", type=float, default=0.6, help="length penalty ((5+len)/6)^alpha")
    p.add_argument("--max-tokens", type=int, default=4096, help="source tokens per batch (padding included)")
    p.add_argument("--batch-size", type=int, default=256, help="sentences per batch at most; the torch engine only")
    p.add_argument("--max-len-a", type=float, default=1.0, help="output length limit a*source_length+b: a")
    p.add_argument("--max-len-b", type=int, default=50, help="output length limit a*source_length+b: b")
    p.add_argument("--min-len", type=int, default=0, help="minimum output length in tokens")
    add_stop_rule_argument(p)
    p.add_argument("--workers", type=int, default=0,
                   help="batches searched at once on the CPU, each on its share of the threads (0: one per thread); "
                        "translate takes them from one --chunk-lines chunk at a time; the torch engine only")
    p.add_argument("--precision", choices=INFERENCE_PRECISIONS, default="fp32",
                   help="bf16: a bfloat16 copy of the model, faster on CPUs with AVX512-BF16; int8: linear layers "
                        "on int8 weights (CPU only) (docs/speed.md)")
    add_device_argument(p)


def add_stop_rule_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stop-rule", choices=STOP_RULES, default=DEFAULT_STOP_RULE,
                   help="when beam search ends a sentence: first = once --beam hypotheses have finished (fairseq); "
                        "best = while a live one could still beat them (transformers, CTranslate2); torch engine only")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory, or a run directory (uses best/)")
    p.add_argument("--input", default="-", help="text file to translate, one sentence a line; - for stdin")
    p.add_argument("--output", default="-", help="where to write translations; - for stdout")
    add_search_arguments(p)
    p.add_argument("--nbest", type=int, default=1, help="print N hypotheses per line as 'i ||| hyp ||| score'")
    p.add_argument("--chunk-lines", type=int, default=500, help="lines read, translated and flushed at a time")
    p.add_argument("--split-sentences", nargs="?", const="", default=None, metavar="LANG",
                   help="a line may be a paragraph: translate its sentences (split for language LANG, by default "
                        "the checkpoint's source language) as one batch and join them with the line's own spacing")
    add_target_language_argument(p)
    add_engine_argument(p)


def add_target_language_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tgt-lang", metavar="LANG",
                   help="a multilingual model's target language: each line starts with its >>LANG<< token (a line "
                        "that starts with a >>xx<< token of its own keeps that one)")


def target_token(tok: Tokenizer, lang: str) -> str:
    """`--tgt-lang LANG` as the multilingual model's target-language token, ">>LANG<<"; a one-line
    error where the model has no such token."""
    codes, token = tok.language_codes, f">>{lang}<<"
    if not codes:
        raise AiaynError(f"--tgt-lang {lang}: this model translates into one language (its vocabulary has no "
                         ">>xx<< tokens); leave --tgt-lang out")
    if token not in codes:
        some = sorted(codes)
        raise AiaynError(f"--tgt-lang {lang}: the model has no {token} token; it has {len(some)}: "
                         f"{' '.join(some[:10])}{' ...' if len(some) > 10 else ''}")
    return token


def with_target_token(lines: Sequence[str], token: str, tok: Tokenizer) -> list[str]:
    """Each line with text, and no language token of its own, led by `token` (`target_token`)."""
    return [f"{token} {line}" if has_text(line) and not tok.language_code(line)[0] else line for line in lines]


def add_engine_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=("torch", "ctranslate2"), default="torch",
                   help="ctranslate2: --checkpoint is a directory from `aiayn export --to ctranslate2` "
                        "(needs pip install 'aiayn[export]')")


def engine_device(args: argparse.Namespace) -> torch.device | None:
    """The device --device names for --engine (None: CTranslate2's, the CPU), or a one-line error;
    checked before any file is read."""
    if getattr(args, "engine", "torch") == "ctranslate2":
        if args.device not in ("auto", "cpu"):
            raise AiaynError(f"--device {args.device}: the ctranslate2 engine runs on the CPU here; use --engine torch")
        # what CTranslate2 cannot do is refused, not ignored (its beam search stops as --stop-rule best does)
        if getattr(args, "stop_rule", None) not in (None, "best"):  # (CTranslate2's rule, whatever the default)
            raise AiaynError(f"--stop-rule {args.stop_rule}: the ctranslate2 engine stops as --stop-rule best does; "
                             "leave it out or use --engine torch")
        if getattr(args, "workers", Settings.workers) != Settings.workers:
            raise AiaynError(f"--workers {args.workers}: the torch engine only; leave it out with --engine ctranslate2")
        if getattr(args, "batch_size", Settings.batch_size) != Settings.batch_size:
            raise AiaynError(f"--batch-size {args.batch_size}: the ctranslate2 engine cuts its batches by "
                             "--max-tokens only; use --max-tokens, or --engine torch")
        return None
    return inference_device(args.device, args.precision)


def load_translator(args: argparse.Namespace, device: torch.device | None) -> Any:
    """The translator --checkpoint and --engine name (`Translator`, or `CT2Translator` on an export),
    at --precision on `device` (`engine_device`'s); a CTranslate2 export without --engine ctranslate2
    is a one-line error."""
    def note(msg: str) -> None:  # in the words of the command running (evaluate's notes said "aiayn translate")
        print(f"aiayn {getattr(args, 'command', None) or 'translate'}: {msg}", file=sys.stderr, flush=True)

    if device is None:
        return CT2Translator.from_path(args.checkpoint, precision=args.precision, note=note)
    if all(os.path.isfile(os.path.join(args.checkpoint, f)) for f in ("model.bin", EXPORT_MARKER)):
        raise AiaynError(f"{args.checkpoint} is a CTranslate2 export (aiayn export --to ctranslate2); "
                         "add --engine ctranslate2")
    return Translator.from_checkpoint(args.checkpoint, precision=args.precision, device=str(device), note=note)


def refuse_empty_names(names: Sequence[tuple[str, str | None, str]]) -> None:
    """(flag, value, what it names): an empty value (`--checkpoint "$RUN"` with RUN unset) is an error
    naming its flag. An empty --checkpoint was the current folder (a run started there was used without
    a word), an empty --tgt-lang no language at all."""
    for flag, value, what in names:
        if value == "":
            raise AiaynError(f"{flag} '': an empty name (an unset shell variable?); give {what}")


def _settings(args: argparse.Namespace) -> Settings:
    s = Settings(beam=args.beam, alpha=args.alpha, nbest=args.nbest, max_tokens=args.max_tokens,
                 batch_size=args.batch_size, max_len_a=args.max_len_a, max_len_b=args.max_len_b, min_len=args.min_len,
                 workers=args.workers, stop_rule=args.stop_rule)
    s.check()
    if args.chunk_lines < 1:
        raise AiaynError(f"--chunk-lines must be positive, got {args.chunk_lines}")
    if getattr(args, "split_sentences", None) is not None and s.nbest != 1:
        raise AiaynError("--split-sentences gives one translation per line; use it with --nbest 1")
    return s


def _source_language(args: argparse.Namespace) -> str:
    """The language `--split-sentences` splits for: its LANG, else the checkpoint's source language."""
    if args.split_sentences:
        return str(args.split_sentences)
    from aiayn.checkpoint import language_pair, recorded_config

    with contextlib.suppress(AiaynError, OSError, ValueError):
        pair = language_pair(recorded_config(args.checkpoint))
        if pair is not None:
            return pair[0]
    raise AiaynError(f"{args.checkpoint} names no source language; give it: --split-sentences LANG (e.g. de)")


def search_paragraphs(translator: BaseTranslator, lines: Sequence[str], language: str, first_line: int = 1,
                      **settings: Any) -> list[str]:
    """One translation per line, where a line may hold a paragraph: its sentences are translated as one
    batch (so a line of 40 sentences is not cut at the model's length) and joined with the line's own
    spacing. A note about a sentence names its input line."""
    lines = source_lines(lines)  # read twice below
    paragraphs = [split_coded(translator.tokenizers.src, line, language) for line in lines]
    owner = [first_line + k for k, p in enumerate(paragraphs) for _ in p.sentences]  # sentence -> input line
    note = translator.note
    translator.note = lambda msg: note(_renumbered(msg, owner))
    try:
        found = translator.search([s for p in paragraphs for s in p.sentences], **settings)
    finally:
        translator.note = note
    out, at = [], 0
    for line, p in zip(lines, paragraphs):  # a blank line gives an empty line, as without splitting
        out.append(one_line(p.join([nb[0][0] for nb in found[at:at + len(p.sentences)]])) if has_text(line) else "")
        at += len(p.sentences)
    return out


def split_coded(tokenizer: Tokenizer, text: str, language: str) -> Paragraph:
    """`sentences.split`, where a multilingual model's leading target-language token (">>fr<< ...",
    `Tokenizer.language_code`) goes before each sentence and stays out of the layout put back."""
    from aiayn.sentences import Paragraph, split  # (sentencex on first use only)

    code, rest = tokenizer.language_code(text)
    if not code:
        return split(text, language)
    p = split(rest.lstrip(" "), language)
    return Paragraph(p.lead, tuple(f"{code} {s}" for s in p.sentences), p.gaps)


def _renumbered(message: str, owner: Sequence[int]) -> str:
    """A note about sentence k ("line k: ...", counted from 1) as one about its input line."""
    head, sep, rest = message.partition(": ")
    if sep and head.startswith("line ") and head[5:].isdigit() and 1 <= int(head[5:]) <= len(owner):
        return f"line {owner[int(head[5:]) - 1]} (a sentence of it): {rest}"
    return message


def _open_input(name: str) -> tuple[BinaryIO, bool]:
    if name == "-":
        if sys.stdin is None:
            raise AiaynError("standard input is closed; give --input FILE")
        return sys.stdin.buffer, False
    try:
        return open(name, "rb"), True
    except FileNotFoundError:
        raise AiaynError(f"{name}: no such file (--input)") from None
    except OSError as e:
        raise AiaynError(f"{name}: cannot read ({e.strerror or e}) (--input)") from None


def _check_output(name: str, src: BinaryIO) -> None:
    """Before the model loads: standard output must be open, --output's folder must be there (and
    --output no folder), and the output must not be the input (opening --output for writing would
    empty the file before a line of it is read; standard output appended to it, `>> FILE`, would
    have its own translations read back and translated forever)."""
    if name == "-" and sys.stdout is None:
        raise AiaynError("standard output is closed; give --output FILE")
    if name != "-":
        _check_output_folder(name)
    with contextlib.suppress(OSError, ValueError):  # (a captured standard output has no file number)
        have = os.fstat(src.fileno())
        want = os.fstat(sys.stdout.fileno()) if name == "-" else os.stat(name)
        if stat.S_ISREG(want.st_mode) and (have.st_dev, have.st_ino) == (want.st_dev, want.st_ino):
            if name == "-":
                raise AiaynError("standard output is the input file; write the translations to another file")
            raise AiaynError(f"{name}: is also the input; write the translations to another file (--output)")


def _check_output_folder(name: str) -> None:
    """--output in a folder that is missing (or is a file), or --output a folder: the error opening it
    gives, before the model loads rather than after."""
    try:
        st = os.stat(name)
    except FileNotFoundError:  # a new file: its folder must be there
        try:
            if stat.S_ISDIR(os.stat(os.path.dirname(name) or ".").st_mode):
                return
            why = os.strerror(errno.ENOTDIR)
        except OSError as e:
            why = e.strerror or str(e)
    except NotADirectoryError as e:  # (a file on the way)
        why = e.strerror or str(e)
    except OSError:  # (a path we may not look into: opening it says why)
        return
    else:
        if not stat.S_ISDIR(st.st_mode):
            return
        why = os.strerror(errno.EISDIR)
    raise AiaynError(f"{name}: cannot write ({why}) (--output)")


def _open_output(name: str) -> tuple[IO[bytes], ReplacingFile | None]:
    """Standard output, or --output FILE written beside it and put in place once every line is in
    (`files.ReplacingFile`: a failed or stopped run leaves an existing FILE as it was)."""
    if name == "-":
        return sys.stdout.buffer, None
    try:
        f = ReplacingFile(name)
    except OSError as e:
        raise AiaynError(f"{name}: cannot write ({e.strerror or e}) (--output)") from None
    return f.stream, f


def _kept(f: ReplacingFile | None, done: int) -> str:
    """After a failure or Ctrl-C: where the `done` finished lines are (" to FILE.partial; FILE is
    as it was" when they could not go to FILE), or "" where they are in the output itself."""
    if f is None:
        return ""
    if not done:
        f.discard()
        return ""
    kept = f.keep()
    return "" if kept == f.path else f" to {kept} ({f.path} is as it was)"


def _write_all(out: IO[bytes], data: bytes) -> None:
    """`out.write(data)`, all of it: standard output under `python -u` or PYTHONUNBUFFERED=1 is a raw
    stream, whose write takes only part of the bytes when a signal comes mid-write (to a pipe) and
    says so only in the count it returns."""
    view = memoryview(data)
    while view:
        n = out.write(view)
        if n is None:  # a full non-blocking stream, refused as a buffered one refuses it
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        view = view[n:]


def _format(i: int, nb: list[tuple[str, float]], nbest: int) -> bytes:
    if nbest == 1:
        return (nb[0][0] + "\n").encode("utf-8")
    return "".join(f"{i} ||| {text} ||| {score:.4f}\n" for text, score in nb[:nbest]).encode("utf-8")


class _Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (a `kill`, `timeout`, a closed terminal), taken as Ctrl-C is: the lines
    finished so far are kept and counted."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _stops_interrupt() -> Iterator[None]:
    """SIGTERM and SIGHUP raise `_Stopped` while the block runs (where their handler is the default,
    in the main thread); Ctrl-C raises KeyboardInterrupt as always."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {s: signal.getsignal(s) for s in _STOPS[1:]}

    def stop(signum: int, frame: Any) -> None:
        raise _Stopped(signum)

    for s, handler in previous.items():
        if handler == signal.SIG_DFL:
            signal.signal(s, stop)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def _stops_deferred() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP back while the block runs, then raise as `_stops_interrupt`
    would if one came.

    A Python-level handler, not a signal mask: torch's worker threads would still take a masked
    signal and interrupt the main thread anywhere inside the block. A signal that the process was
    started with ignored (a background job of a script, `nohup`) stays ignored, as everywhere else.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    hits: list[int] = []
    previous: dict[int, Any] = {s: signal.getsignal(s) for s in _STOPS}
    for s, handler in previous.items():
        if handler != signal.SIG_IGN:
            signal.signal(s, lambda signum, frame: hits.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if hits:
        handler = previous[hits[0]]
        if callable(handler):  # Ctrl-C's raises KeyboardInterrupt, `_stops_interrupt`'s `_Stopped`
            handler(hits[0], None)
        elif handler == signal.SIG_DFL:
            raise KeyboardInterrupt if hits[0] == signal.SIGINT else _Stopped(hits[0])


def run(args: argparse.Namespace) -> int:
    with _stops_interrupt():  # a `kill` or `timeout` keeps the finished lines as Ctrl-C does
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    refuse_empty_names([("--checkpoint", args.checkpoint, "a checkpoint or run directory"),
                        ("--input", args.input, "a file name, or - for standard input"),
                        ("--output", args.output, "a file name, or - for standard output"),
                        ("--tgt-lang", getattr(args, "tgt_lang", None), "a language code, or leave it out")])
    s = _settings(args)  # flags are checked before the model is loaded
    memory.keep_freed_memory()  # a job that decodes and ends: no page faults for every new activation
    device = engine_device(args)  # a flag error before any file is opened
    src, close_in = _open_input(args.input)
    out: IO[bytes] | None = None
    out_file: ReplacingFile | None = None
    done = 0
    try:
        _check_output(args.output, src)
        translator = load_translator(args, device)
        token = target_token(translator.tokenizers.src, args.tgt_lang) if getattr(args, "tgt_lang", None) else ""
        language = _source_language(args) if getattr(args, "split_sentences", None) is not None else None
        out, out_file = _open_output(args.output)  # only now: a failed start adds no file
        name = "<stdin>" if args.input == "-" else args.input
        for chunk in LineChunks(src, name, args.chunk_lines):
            if token:
                chunk = with_target_token(chunk, token, translator.tokenizers.src)
            if language is not None:
                paragraphs = search_paragraphs(translator, chunk, language, done + 1, **vars(s))
                text = "".join(p + "\n" for p in paragraphs).encode("utf-8")
            else:
                results = translator.search(chunk, first_line=done + 1, **vars(s))
                text = b"".join(_format(done + k, nb, s.nbest) for k, nb in enumerate(results))
            with _stops_deferred():  # a chunk is written and counted whole, so the Ctrl-C message is exact
                try:
                    _write_all(out, text)
                    out.flush()
                except BrokenPipeError:
                    raise
                except OSError as e:
                    if out_file is None:
                        silence_stdout()
                    where = "standard output" if args.output == "-" else args.output
                    raise AiaynError(f"{where}: cannot write ({e.strerror or e})") from None
                done += len(chunk)
        if out_file is not None:
            try:
                out_file.commit()
            except OSError as e:
                raise AiaynError(f"{args.output}: cannot write ({e.strerror or e})") from None
            out_file = None
    except AiaynError as e:
        kept = _kept(out_file, done)
        if done:  # say what is already there, as for Ctrl-C
            raise AiaynError(f"{e}; the first {done} input line(s) are translated and written{kept}") from None
        raise
    except KeyboardInterrupt as e:
        if out is not None:
            with contextlib.suppress(OSError):
                out.flush()
        kept = _kept(out_file, done)
        how = f"stopped by {signal.Signals(e.signum).name}" if isinstance(e, _Stopped) else "interrupted"
        print(f"aiayn translate: {how}; the first {done} input line(s) are translated and written{kept}, "
              f"line-aligned; rerun on the rest with `tail -n +{done + 1}`", file=sys.stderr, flush=True)
        return 128 + e.signum if isinstance(e, _Stopped) else 130
    except BaseException:
        _kept(out_file, done)  # a broken pipe or a bug: the lines finished are kept all the same
        raise
    finally:
        if close_in:
            src.close()
    return 0

