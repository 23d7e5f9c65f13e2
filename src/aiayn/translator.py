"""Translation with a trained model, the Python API: `Translator` (torch, fp32/bf16/int8) and
`CT2Translator` (a CTranslate2 export) behind one interface (`BaseTranslator`), their search
settings (`Settings`) and how sentences become batches searched by CPU workers (`map_batches`).

Apart from the command (`aiayn translate`, `aiayn.translate`: flags, streams, signals) because it is
what every caller shares: the command, `aiayn evaluate`, `aiayn serve`, the benches and a user's
own code import it without the command's file and signal handling.

Raw text in, detokenized text out (Section 6.1's beam search, see `aiayn.search`). The promises,
pinned by tests/test_translate.py:

- exactly one output per input line (N with `nbest=N`), in input order; sentences are sorted by
  length inside for speed and put back in order;
- an empty or blank line gives an empty translation; a line longer than the model takes is
  truncated to `max_src_tokens` source tokens with a note (`note`, by default on stderr), never dropped.

`precision="bf16"` runs search on a bfloat16 copy of the model (faster than autocast: no per-op
casts; same BLEU within noise, a few outputs differ from fp32) (log-probabilities and scores are
still computed in float32).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import threading
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

import aiayn.kernels
from aiayn.config import INFERENCE_PRECISIONS
from aiayn.errors import AiaynError, require
from aiayn.kernels import ModuleT
from aiayn.search import (DEFAULT_STOP_RULE, MAX_ALPHA, STOP_RULES, ScoredIds, beam_search, check_whole,
                          greedy_search)
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, PIECES, TokenizerPair, vocabulary

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
        for flag, n in (("--max-tokens", self.max_tokens), ("--batch-size", self.batch_size)):
            check_whole(flag, n)  # (nan passed the checks below and lifted the cap; inf, 2.5 met a range later)
        if self.max_tokens < 1:
            raise AiaynError(f"--max-tokens must be positive, got {self.max_tokens}")
        if self.batch_size < 1:
            raise AiaynError(f"--batch-size must be positive, got {self.batch_size}")
        if not (self.max_len_a >= 0 and self.max_len_b >= 0) or math.inf in (self.max_len_a, self.max_len_b):
            raise AiaynError(f"--max-len-a and --max-len-b must be finite numbers >= 0, got {self.max_len_a} and "
                             f"{self.max_len_b}")
        if self.min_len < 0:
            raise AiaynError(f"--min-len must be >= 0, got {self.min_len}")
        check_whole("--workers", self.workers)  # (2.5 waited a minute for a worker that never came)
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
    return max(1, min(int(workers) or torch.get_num_threads(), n_batches))


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
        # the n workers (each submit starts one: none is idle) and us; the workers search once the
        # process-wide count is back (`_set_process_threads`)
        started = threading.Barrier(n + 1, action=lambda: _set_process_threads(total))

        def start_worker() -> None:
            try:
                torch.get_num_threads()  # the thread's first call takes the process-wide count: now, not later
                torch.set_num_threads(max(1, total // n))  # each worker on its share of the threads
            finally:  # (whatever happened: the others never wait for this one in vain)
                with contextlib.suppress(threading.BrokenBarrierError):  # we stopped first (an error, Ctrl-C)
                    started.wait()

        pool = ThreadPoolExecutor(n, thread_name_prefix="aiayn-search", initializer=start_worker)
        ready = False
        try:
            futures = [pool.submit(fn, b) for b in batches]
            with contextlib.suppress(threading.BrokenBarrierError):  # (a worker that never came: the count
                started.wait(timeout=STARTED_WAIT_S)  # is put back late, costing speed only, never a hang)
            ready = True
            return [f.result() for f in futures]
        finally:  # on an error or Ctrl-C, batches not yet started are dropped; running ones end first
            if not ready:  # (a worker still starting goes on, rather than waiting for us for ever)
                started.abort()
            pool.shutdown(wait=True, cancel_futures=True)


STARTED_WAIT_S = 60.0  # `map_batches`' wait for its workers' start: moments, unless something is wrong


def _set_process_threads(count: int) -> None:
    """torch's process-wide thread count, the one a thread takes at its first operation, set back to
    `count` once the workers have their own: `torch.set_num_threads` in a worker sets it too, and a
    thread of the caller's that began while a search ran kept a worker's share for good (1 of 2).
    Set from a thread of its own: `torch.set_num_threads` sets the calling thread's count as well."""
    setter = threading.Thread(target=torch.set_num_threads, args=(count,), name="aiayn-threads")
    setter.start()
    setter.join()


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


def _groups(rows: Sequence[int], key: Callable[[int], int]) -> list[tuple[int, list[int]]]:
    """(key, the rows with it, in order) for each key, in the order keys first come."""
    groups: dict[int, list[int]] = {}
    for i in rows:
        groups.setdefault(key(i), []).append(i)
    return list(groups.items())


class CT2Translator(BaseTranslator):
    """Translates text with a CTranslate2 export (`aiayn export --to ctranslate2`).

    The same contract as `Translator` (`search` and `translate` take the same settings): one output
    per input line, in order; a blank line gives an empty translation; a line longer than the
    model's `max_positions` is truncated with a note. The maximum length per
    sentence is aiayn's floor(max_len_a * source length + max_len_b) tokens, and at most
    `max_positions` (the export's table of positions ends there, where aiayn's grows); PAD and BOS are never
    generated. Greedy search gives aiayn's translations; CTranslate2's beam search divides scores by
    len**alpha where aiayn divides by ((5 + len) / 6)**alpha, and it stops a hypothesis at its
    sentence's length limit where aiayn forces EOS.
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
        limit_of = {i: max(1, math.floor(min(len(src_ids[i]) * max_len_a + b, self.max_positions))) for i in todo}
        # CTranslate2 takes one max_decoding_length per call. Beam search runs once per limit: a longer
        # search cut afterwards keeps duplicates and the scores of what was cut. Greedy's tokens do not
        # depend on where it stops: one search at the longest limit, each cut to its own, is the same.
        longest = max(limit_of.values())
        for limit, rows in _groups(todo, lambda i: limit_of[i] if beam > 1 else longest):
            results = self.engine.translate_batch(
                [[self._src_vocab[t] for t in src_ids[i]] for i in rows],
                beam_size=int(beam), num_hypotheses=int(nbest), length_penalty=float(alpha) if beam > 1 else 0.0,
                max_decoding_length=limit, min_decoding_length=min(int(min_len), limit), max_input_length=0,
                suppress_sequences=[[PIECES[PAD_ID]], [PIECES[BOS_ID]]], return_scores=beam > 1,
                # no more than all of them: CTranslate2 reserves room for max_batch_size sentences
                max_batch_size=min(int(max_tokens), sum(len(src_ids[i]) for i in rows)), batch_type="tokens",
            )
            for i, r in zip(rows, results):
                scores = r.scores if beam > 1 else [float("nan")] * len(r.hypotheses)
                out[i] = [([self._tgt_index[p] for p in h][:limit_of[i]], float(sc))
                          for h, sc in zip(r.hypotheses, scores)]
        return out

    def search(self, lines: Sequence[str], first_line: int = 1, **settings: Any) -> list[list[tuple[str, float]]]:
        """Per input line, up to `nbest` (translation, score) pairs, as `Translator.search`."""
        s = Settings(**settings)
        s.check()
        if s.stop_rule not in (None, "best"):  # refused, as `--engine ctranslate2 --stop-rule first` is: not ignored
            raise AiaynError(f"stop_rule {s.stop_rule!r}: CTranslate2's beam search stops as 'best' does; leave it "
                             "out, or use the torch engine (Translator)")
        lines = source_lines(lines)
        ids = encode_sources(self.tokenizers, lines, self.max_src_tokens, self.note, first_line, self.source_eos)
        hyps = self.translate_ids(ids, s.beam, s.alpha, s.nbest, s.max_len_a, s.max_len_b, s.min_len, s.max_tokens)
        return [[(one_line(self.tokenizers.tgt.decode(h)), sc) for h, sc in nb] for nb in hyps]

