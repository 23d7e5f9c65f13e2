"""`aiayn translate`: the command line over `aiayn.translator` (the Python API: `Translator`,
`CT2Translator`), and the pieces of it that `aiayn evaluate` and `aiayn serve` share: the search
flags, `--device` and `--engine`, `load_translator`, `--tgt-lang`.

Raw text in, detokenized text out. The promises, pinned by tests/test_translate.py:

- exactly one output line per input line (N lines with `--nbest N`), in input order (the
  translator's promise, `aiayn.translator`), a blank line an empty line, a long one truncated with
  a note on stderr, never dropped;
- input is read in chunks of whatever lines are available, so `... | aiayn translate | ...` streams;
  each chunk is written and flushed before the next is read;
- Ctrl-C (SIGINT), SIGTERM and SIGHUP keep every line already written, line-aligned, and exit
  128 + the signal with a message; `--output` over a file is put in place at the end (`files.ReplacingFile`).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import select
import signal
import stat
import sys
from collections.abc import Iterator, Sequence
from typing import IO, TYPE_CHECKING, Any, BinaryIO

import torch

from aiayn.checkpoint import is_ct2_export
from aiayn.config import INFERENCE_PRECISIONS
from aiayn.errors import AiaynError
from aiayn import memory, stops
from aiayn.files import (COMPRESSED_HEAD, ENCODING_HEAD, LineLengthCheck, ReplacingFile, check_output_path,
                         long_line_error, refuse_compressed, refuse_wide_text, silence_stdout)
from aiayn.search import DEFAULT_STOP_RULE, STOP_RULES
from aiayn.tokenizer import Tokenizer
# (load_translator uses both; tests/test_export.py still imports Translator and CT2Translator from here)
from aiayn.translator import BaseTranslator, CT2Translator, Settings, Translator, has_text, one_line, source_lines

if TYPE_CHECKING:
    from aiayn.sentences import Paragraph


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
    if is_ct2_export(args.checkpoint):
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
    `Tokenizer.language_code`) goes before each sentence and stays out of the layout put back, as does
    the one space after it (`--tgt-lang`'s): the line's own leading spaces stay, as without a token."""
    from aiayn.sentences import Paragraph, split  # (sentencex on first use only)

    code, rest = tokenizer.language_code(text)
    if not code:
        return split(text, language)
    p = split(rest[1:] if rest.startswith(" ") else rest, language)
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
    """Before the model loads: standard output must be open, --output a file that can be written
    (`files.check_output_path`), and the output must not be the input (opening --output for writing would
    empty the file before a line of it is read; standard output appended to it, `>> FILE`, would
    have its own translations read back and translated forever)."""
    if name == "-" and sys.stdout is None:
        raise AiaynError("standard output is closed; give --output FILE")
    if name != "-":
        check_output_path(name, "--output")
    with contextlib.suppress(OSError, ValueError):  # (a captured standard output has no file number)
        have = os.fstat(src.fileno())
        want = os.fstat(sys.stdout.fileno()) if name == "-" else os.stat(name)
        if stat.S_ISREG(want.st_mode) and (have.st_dev, have.st_ino) == (want.st_dev, want.st_ino):
            if name == "-":
                raise AiaynError("standard output is the input file; write the translations to another file")
            raise AiaynError(f"{name}: is also the input; write the translations to another file (--output)")


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


def _kept(f: ReplacingFile | None, done: int, size: int) -> str:
    """After a failure or Ctrl-C: where the `done` finished lines (`size` bytes) are (" to FILE.partial;
    FILE is as it was" when they could not go to FILE), or "" where they are in the output itself."""
    if f is None:
        return ""
    if not done:
        f.discard()
        return ""
    kept = f.keep()
    _cut(kept, size)
    return "" if kept == f.path else f" to {kept} ({f.path} is as it was)"


def _cut(path: str, size: int) -> None:
    """The file we wrote, cut back to the `size` bytes of the chunks written whole: a chunk that failed
    part-way (a full disk) left lines the message does not count, the last one cut short, and a rerun
    on the rest (`tail -n +N`) appended after them."""
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode) and st.st_size > size:
            os.truncate(path, size)


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


def run(args: argparse.Namespace) -> int:
    with stops.interrupts():  # a `kill` or `timeout` keeps the finished lines as Ctrl-C does
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
    done = size = 0  # input lines translated and written, and the bytes written for them
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
            with stops.deferred():  # a chunk is written and counted whole, so the Ctrl-C message is exact
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
                size += len(text)
        if out_file is not None:
            try:
                out_file.commit()
            except OSError as e:
                raise AiaynError(f"{args.output}: cannot write ({e.strerror or e})") from None
            out_file = None
    except AiaynError as e:
        kept = _kept(out_file, done, size)
        if done:  # say what is already there, as for Ctrl-C
            raise AiaynError(f"{e}; the first {done} input line(s) are translated and written{kept}") from None
        raise
    except KeyboardInterrupt as e:
        if out is not None:
            with contextlib.suppress(OSError):
                out.flush()
        kept = _kept(out_file, done, size)
        how = f"stopped by {signal.Signals(e.signum).name}" if isinstance(e, stops.Stopped) else "interrupted"
        print(f"aiayn translate: {how}; the first {done} input line(s) are translated and written{kept}, "
              f"line-aligned; rerun on the rest with `tail -n +{done + 1}`", file=sys.stderr, flush=True)
        return 128 + e.signum if isinstance(e, stops.Stopped) else 130
    except BaseException:
        _kept(out_file, done, size)  # a broken pipe or a bug: the lines finished are kept all the same
        raise
    finally:
        if close_in:
            src.close()
    return 0

