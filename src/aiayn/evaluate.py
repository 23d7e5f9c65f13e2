"""Scoring with sacreBLEU: cased detokenized BLEU (the standard), lowercased BLEU, and chrF.

The paper reports BLEU (Section 6.1); here it is sacreBLEU's corpus BLEU on detokenized output with
its default 13a tokenization, printed with sacreBLEU's signature so that scores can be compared.

`aiayn evaluate` takes one of three inputs:
  --checkpoint DIR --data multi30k --src de --tgt en --split test_2016_flickr   translate, then score
  --checkpoint DIR --src-file F --ref-file F [F ...]                             translate, then score
  --hyp-file F --ref-file F [F ...]                                              score only
Several --ref-file files are several references for each line, as sacreBLEU takes them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import sacrebleu

from aiayn.errors import AiaynError
from aiayn.files import StreamLines, check_output_path, read_in_step, say


class ScoreError(AiaynError, ValueError):
    """Hypotheses and references that cannot be scored together."""


def corpus_scores(hyps: Sequence[str], refs: Sequence[str], *more: Sequence[str]) -> dict[str, Any]:
    """BLEU, lowercased BLEU and chrF of detokenized hypotheses against one reference each (`refs`),
    or several: each of `more` is another line-aligned set of references."""
    streams = [list(r) for r in (refs, *more)]
    for r in streams:
        if len(hyps) != len(r):
            raise ScoreError(f"{len(hyps)} hypotheses but {len(r)} references; they must be line-aligned")
    if not hyps:
        raise ScoreError("nothing to score: no hypotheses and no references")
    # force: sacreBLEU's own check for tokenized output would warn once per BLEU, advising a `force`
    # parameter aiayn has no flag for; `aiayn evaluate` says it once (`tokenized_note`)
    bleu = sacrebleu.metrics.BLEU(force=True)
    bleu_lc = sacrebleu.metrics.BLEU(lowercase=True, force=True)
    chrf = sacrebleu.metrics.CHRF()
    b, lc, c = (m.corpus_score(list(hyps), streams) for m in (bleu, bleu_lc, chrf))
    return {
        "bleu": round(b.score, 2),
        "bleu_lc": round(lc.score, 2),
        "chrf": round(c.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "bleu_lc_signature": str(bleu_lc.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "n": len(hyps),
    }


def tokenized_note(hyps: Sequence[str], *refs: Sequence[str]) -> str | None:
    """sacreBLEU's check for tokenized output (100 lines or more end in " ."), in aiayn's words. It
    scores detokenized text, tokenizing it itself (13a): a final " ." costs nothing, but the rest of a
    tokenizer's changes ("don 't", "&quot;") are not undone, so the score is lower than it should
    be, or (references tokenized too) not comparable with published ones."""
    n = sum(h.endswith(" .") for h in hyps)
    if n < 100:
        return None
    m = max(sum(r.endswith(" .") for r in stream) for stream in refs)
    if m >= 100:
        return (f'{n} hypotheses and {m} references end in " ." as tokenized text does: these scores are of '
                "tokenized text, not comparable with published sacreBLEU scores; detokenize both (e.g. with "
                "sacremoses) to compare")
    return (f'{n} of the {len(hyps)} hypotheses end in " ." as tokenized text does, the references do not: a final '
            '" ." costs nothing, but other tokenization ("don \'t", "&quot;") lowers BLEU; if the hypotheses are '
            "tokenized, detokenize them (e.g. with sacremoses) and score them again")


def format_scores(s: dict[str, Any]) -> str:
    """Human-readable lines: each score with its sacreBLEU signature."""
    return (f"BLEU = {s['bleu']:.2f}  ({s['bleu_signature']})\n"
            f"BLEU (lowercased) = {s['bleu_lc']:.2f}  ({s['bleu_lc_signature']})\n"
            f"chrF2 = {s['chrf']:.2f}  ({s['chrf_signature']})\n"
            f"sentences: {s['n']}")


# ------------------------------------------------------------------------------------- the CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", help="checkpoint or run directory to translate with")
    p.add_argument("--data", choices=["multi30k"], help="score on a named data set (needs --checkpoint)")
    p.add_argument("--src", help="source language of --data (en, de, fr, cs)")
    p.add_argument("--tgt", help="target language of --data")
    p.add_argument("--split", default="test_2016_flickr", help="split of --data (train, val, test_2016_flickr)")
    p.add_argument("--data-dir", help="folder holding multi30k/ (default: $AIAYN_DATA, else the download cache)")
    p.add_argument("--src-file", help="source sentences to translate, one a line (needs --checkpoint); - for stdin")
    p.add_argument("--hyp-file", help="translations to score, one a line (no model needed); - for stdin")
    p.add_argument("--ref-file", action="extend", nargs="+", metavar="FILE",
                   help="references, one a line, aligned with the source or hypotheses; several files (--ref-file A "
                        "B, or the flag again): several references per line")
    p.add_argument("--save-hyps", help="also write the translations to this file")
    from aiayn.translate import add_engine_argument, add_search_arguments, add_target_language_argument

    before = len(p._actions)
    add_search_arguments(p)
    add_target_language_argument(p)
    add_engine_argument(p)
    # what changes the translations, so that --hyp-file (nothing translated) can refuse it rather than
    # ignore it; where and how fast they are made (--device in a shared script, say) does not matter there
    p.set_defaults(translation_flags={a.dest: (a.option_strings[0], a.default) for a in p._actions[before:]
                                      if a.dest not in ("device", "workers", "batch_size", "max_tokens")})
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _check_names(args: argparse.Namespace) -> None:
    """An empty file name (`--save-hyps "$OUT"` with OUT unset) is an error naming its flag: it was
    taken for a flag not given (the translations went unsaved without a word) or for the folder "."."""
    names = [("--checkpoint", args.checkpoint), ("--src-file", args.src_file), ("--hyp-file", args.hyp_file),
             ("--save-hyps", args.save_hyps), *(("--ref-file", r) for r in args.ref_file or [])]
    for flag, name in names:
        if name == "":
            raise AiaynError(f"{flag} '': an empty name (an unset shell variable?); give a "
                             f"{'directory' if flag == '--checkpoint' else 'file'} name")
    if [args.src_file, args.hyp_file, *(args.ref_file or [])].count("-") > 1:
        raise AiaynError("- (standard input) can be one of the files only; give the others by name")
    if getattr(args, "tgt_lang", None) == "":  # (it was taken for no --tgt-lang)
        raise AiaynError("--tgt-lang '': an empty name (an unset shell variable?); give a language code, or leave it out")


def _refuse_data_flags(args: argparse.Namespace) -> None:
    """--src, --tgt, --split and --data-dir choose --data's files; without --data they were ignored
    without a word (`--src en --tgt de` beside --src-file read as a check of the direction, and was none)."""
    given = [flag for flag, value, default in (("--src", args.src, None), ("--tgt", args.tgt, None),
                                               ("--split", args.split, "test_2016_flickr"),
                                               ("--data-dir", args.data_dir, None)) if value != default]
    if given:
        raise AiaynError(f"{', '.join(given)} {'picks' if len(given) == 1 else 'pick'} the files of --data; without "
                         "--data nothing reads them: add --data multi30k, or drop them")


def _refuse_translation_flags(args: argparse.Namespace) -> None:
    """With --hyp-file nothing is translated: a flag that changes translations, set away from its
    default (--beam 1, --precision int8), was ignored without a word, and the score read as that setting's."""
    given = [flag for dest, (flag, default) in getattr(args, "translation_flags", {}).items()
             if getattr(args, dest, default) != default]
    if given:
        raise AiaynError(f"{', '.join(given)} set how a --checkpoint translates; --hyp-file scores translations "
                         "made already: drop them")


def _inputs(args: argparse.Namespace) -> tuple[str, str, list[str]]:
    """(mode, source path, reference paths); one-line errors for incomplete flag sets."""
    _check_names(args)
    _refuse_a_stream_twice(args)
    if not args.data:
        _refuse_data_flags(args)
    if args.hyp_file:
        if args.checkpoint or args.src_file or args.data:
            raise AiaynError("--hyp-file scores existing translations: drop --checkpoint, --src-file and --data")
        if args.save_hyps:  # (it was ignored without a word)
            raise AiaynError("--save-hyps saves the translations a --checkpoint makes; with --hyp-file they are "
                             "in that file already")
        if not args.ref_file:
            raise AiaynError("--hyp-file needs --ref-file (the references, line-aligned)")
        _refuse_translation_flags(args)
        return "hyp", args.hyp_file, args.ref_file
    if not args.checkpoint:
        raise AiaynError("give --checkpoint with --data or --src-file/--ref-file, or --hyp-file with --ref-file")
    if args.data:
        if args.src_file or args.ref_file:
            raise AiaynError("--data picks the files itself: drop --src-file/--ref-file")
        if not args.src or not args.tgt:
            raise AiaynError("--data multi30k needs --src and --tgt (e.g. --src de --tgt en)")
        _check_direction(args)  # before the files are looked for (or downloaded) for the wrong direction
        from aiayn.data.text import multi30k_paths

        src, ref = multi30k_paths(args.split, args.src, args.tgt, args.data_dir)
        return "translate", str(src), [str(ref)]
    if not args.src_file or not args.ref_file:
        raise AiaynError("--checkpoint needs --data multi30k, or --src-file and --ref-file")
    return "translate", args.src_file, args.ref_file


def _read(path: str, blank_ok: bool = False, most: int | None = None) -> tuple[list[str], bool]:
    """`files.read_lines`, where "-" is standard input (`aiayn translate ... | aiayn evaluate --hyp-file -`;
    it was "-: no such file"), read as it is: opening /dev/stdin anew fails where it is a socket (a
    child of Node.js or of a service manager: "/dev/stdin: cannot read (No such device or address)").
    With `most` (a pipe or a device: `_endless`), its first `most` lines only, and whether more follow,
    read as the bytes come (`_stream`)."""
    from aiayn.files import read_lines, read_stream_lines, read_stream_lines_upto

    if most is None:
        stream = _standard_input() if path == "-" else None
        if stream is not None:
            return read_stream_lines(stream, "standard input", blank_ok), False
        return read_lines("/dev/stdin" if path == "-" else path, blank_ok), False
    with contextlib.ExitStack() as opened:
        return read_stream_lines_upto(*_stream(path, opened), most, blank_ok)


def _standard_input() -> BinaryIO | None:
    """Standard input's bytes; None where a text stream was put in its place (/dev/stdin is read then)."""
    if sys.stdin is None:
        raise AiaynError("standard input is closed; give a file name instead of -")
    return getattr(sys.stdin, "buffer", None)


def _stream(path: str, opened: contextlib.ExitStack) -> tuple[BinaryIO, str]:
    """A pipe or device (`_endless`), read without a buffer, and its name in messages; "-" is standard
    input's own. A buffered read waits for all it asks (1 MiB), and a stream that goes on slowly (a log
    followed, a line a second) was waited on for days before it was refused, its extra line long since there."""
    stream = _standard_input() if path == "-" else None
    if stream is not None:
        return getattr(stream, "raw", stream), "standard input"
    path = "/dev/stdin" if path == "-" else path
    try:
        return opened.enter_context(io.FileIO(path, "r")), path
    except OSError as e:
        raise AiaynError(f"{path}: cannot read ({e.strerror or e})") from None


def _endless(path: str) -> bool:
    """Whether reading `path` might never end: a pipe, a socket or a device (`<(yes a)`, /dev/zero),
    not a file, nor a name that cannot be read (that says so at once)."""
    st = _stat(path)
    return st is not None and _is_stream(st)


def _is_stream(st: os.stat_result) -> bool:
    return not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))


def _stat(path: str) -> os.stat_result | None:
    """`os.stat` of `path` ("-": of standard input), or None where it cannot be had."""
    try:
        return os.fstat(sys.stdin.fileno()) if path == "-" else os.stat(path)
    except (OSError, AttributeError, ValueError):  # (missing; standard input closed or replaced)
        return None


def _refuse_a_stream_twice(args: argparse.Namespace) -> None:
    """One pipe or device named twice (a FIFO as --hyp-file and --ref-file, or - and /dev/stdin): a stream
    is read once, so one of the two got all of it and the other nothing, said as "file is empty"."""
    seen: dict[tuple[int, int], str] = {}
    for flag, path in (("--src-file", args.src_file), ("--hyp-file", args.hyp_file),
                       *(("--ref-file", r) for r in args.ref_file or [])):
        st = _stat(path) if path else None
        if st is None or not _is_stream(st):
            continue
        if (st.st_dev, st.st_ino) in seen:
            raise AiaynError(f"{_flagged(flag, path)} is the stream {seen[st.st_dev, st.st_ino]} names too: a pipe or "
                             "device is read once; give the text as a file to read it twice")
        seen[st.st_dev, st.st_ino] = _flagged(flag, path)


def _read_aligned(first: str, ref_paths: Sequence[str], kind: str, flag: str) -> tuple[list[str], list[list[str]]]:
    """The source lines or hypotheses (`kind`) of `first` and the lines of each reference file, as many
    or refused. One input, the lead, is read whole: a file if there is one (a pipe, `<(yes a)`, may never
    end), else the stream that ends first (`_read_in_step`). Each other stream is read up to its count
    and a line, so that one that goes on is refused in one line, not held in memory until there is
    none (a file is read whole, its count said exactly). `flag`: the flag that gave `first` ("" for
    --data, which gives the files)."""
    paths = [first, *ref_paths]
    blank = [i == 0 and kind == "hypotheses" for i in range(len(paths))]  # (an empty translation is one)
    endless = [_endless(p) for p in paths]
    texts: list[list[str]] = [[] for _ in paths]
    if all(endless):
        lead, texts[lead], streams = _read_in_step(paths, blank, flag)
    else:
        lead, streams = endless.index(False), []
        texts[lead], _ = _read(paths[lead], blank[lead])
    n = len(texts[lead])
    for i in (i for i in range(len(paths)) if i != lead):  # (a stream: its first n lines, and whether more follow)
        texts[i], more = ((streams[i].lines(blank[i]), streams[i].more) if streams else
                          _read(paths[i], blank[i], most=n if endless[i] else None))
        if not more and len(texts[i]) == n:
            continue
        counted = f"more than {n}" if more else str(len(texts[i]))
        if i == 0:  # (the reference read whole is the measure)
            named = _flagged(flag, first) if more and flag else _shown(first)
            raise AiaynError(f"{named} has {counted} {kind} but {_shown(paths[lead])} has {n} references; "
                             "the files must be line-aligned")
        named = _flagged("--ref-file", paths[i]) if more and flag else _shown(paths[i])
        raise AiaynError(f"{_shown(first)} has {n} {kind} but {named} has {counted} references; "
                         "the files must be line-aligned")
    return texts[0], texts[1:]


# Inputs that are all streams (pipes, devices) have no file to measure them by: they are read together,
# each this far at most, until one ends. Two that never end (`--hyp-file <(yes a) --ref-file <(yes a)`)
# were read one after the other, the first until the memory ran out. (A test set is some thousands of lines.)
MAX_STREAM_LINES = 1_000_000
MAX_STREAM_BYTES = 256 << 20


def _read_in_step(paths: Sequence[str], blank: Sequence[bool], flag: str) -> tuple[int, list[str], list[StreamLines]]:
    """(the lead, its lines, the streams) of inputs that are all streams, read together as their bytes
    come until one ends, the lead (of those that end at one read, the first given); the others then to
    its count and a line. One that goes past MAX_STREAM_LINES or MAX_STREAM_BYTES first is refused."""
    lead, lines = None, []
    with contextlib.ExitStack() as opened:
        streams = [StreamLines(*_stream(p, opened), MAX_STREAM_LINES) for p in paths]
        while not all(s.done for s in streams):
            read_in_step(streams)
            for i, s in enumerate(streams):
                if s.size > MAX_STREAM_BYTES:
                    raise _past_stream_limit(paths[i], i, flag)
            if lead is None and any(s.ended for s in streams):
                lead = next(i for i, s in enumerate(streams) if s.ended)
                lines = streams[lead].lines(blank[lead])
                for s in streams:
                    if not s.ended:
                        s.lower(len(lines))
            if lead is None and (past := next((i for i, s in enumerate(streams) if s.more), None)) is not None:
                raise _past_stream_limit(paths[past], past, flag)
    assert lead is not None  # (all done, none past the limit: one ended first)
    return lead, lines, streams


def _past_stream_limit(path: str, i: int, flag: str) -> AiaynError:
    named = _flagged(flag if i == 0 else "--ref-file", path) if flag else _shown(path)
    return AiaynError(f"{named} goes on past {MAX_STREAM_LINES:,} lines or {MAX_STREAM_BYTES >> 20} MiB, as far as "
                      "evaluate reads a stream when all its inputs are streams (pipes, devices): give one of them as "
                      "a file (the others are read to its count)")


def _shown(path: str) -> str:
    return "standard input" if path == "-" else path


def _flagged(flag: str, path: str) -> str:
    return f"{flag} - (standard input)" if path == "-" else f"{flag} {path}"


def _check_direction(args: argparse.Namespace) -> None:
    """--data multi30k --src/--tgt against the pair a Multi30k checkpoint (or its CTranslate2 export)
    was trained on, or the reverse of an import's (its languages come from the Marian directory or
    --src/--tgt): the other way round it would be scored, near 0 BLEU, without a word. Other checkpoints are not
    checked (a run from raw text records the defaults de/en when it was given no languages)."""
    from aiayn.checkpoint import language_pair, recorded_config

    try:
        cfg = recorded_config(args.checkpoint)
    except (AiaynError, OSError, ValueError):
        return  # loading it reports what is wrong with it
    train = cfg.get("train")
    if not isinstance(train, dict):
        return
    pair = language_pair(cfg)
    # an import is held to the reverse of its pair only: a multilingual model's pair names one of its
    # targets (--tgt picks another by its >>xx<< token), or "mul" for many sources
    how = "trained on Multi30k" if train.get("data") == "multi30k" else "imported" if "imported_from" in cfg else None
    wrong = pair != (args.src, args.tgt) if how == "trained on Multi30k" else pair == (args.tgt, args.src) != (args.src, args.tgt)
    if pair is not None and how and wrong:
        raise AiaynError(f"{args.checkpoint} translates {pair[0]} to {pair[1]} ({how}), "
                         f"not {args.src} to {args.tgt}; use --src {pair[0]} --tgt {pair[1]}")


def _check_save_path(path: str, inputs: Sequence[str]) -> None:
    """--save-hyps must be writable and must not be one of the input files; checked before translating."""
    if path == "-":  # (it made a file named "-")
        raise AiaynError("--save-hyps -: the scores go to standard output; give a file name for the translations")
    target = Path(path)
    for other in inputs:
        with contextlib.suppress(OSError):  # ("-": what standard input reads, `--src-file - < s.txt`)
            if target.exists() and target.samefile("/dev/stdin" if other == "-" else other):
                raise AiaynError(f"{path}: is also an input file; save the translations elsewhere (--save-hyps)")
    check_output_path(path, "--save-hyps")


def run(args: argparse.Namespace) -> int:
    from aiayn import memory
    from aiayn.translate import engine_device

    memory.keep_freed_memory()  # as `aiayn translate`

    if sys.stdout is None:  # (the scores were printed nowhere, exit 0, after all the translating)
        raise AiaynError("standard output is closed; the scores are printed there: redirect it to a file instead")
    mode, first, ref_paths = _inputs(args)  # flag errors first, before any file is read
    device = engine_device(args) if mode == "translate" else None  # (scoring a file needs no device)
    if args.save_hyps and mode == "translate":
        _check_save_path(args.save_hyps, [first, *ref_paths])
    lines, refs = _read_aligned(first, ref_paths, "hypotheses" if mode == "hyp" else "source lines",
                                "" if args.data else "--hyp-file" if mode == "hyp" else "--src-file")
    info: dict[str, Any] = {"references": ref_paths[0], "reference_files": ref_paths}  # (the first: as before)
    if mode == "hyp":
        hyps, info["hypotheses"] = lines, first
    else:
        from aiayn.translate import load_translator, target_token, with_target_token
        from aiayn.translator import Settings

        settings = Settings(beam=args.beam, alpha=args.alpha, max_tokens=args.max_tokens, batch_size=args.batch_size,
                            max_len_a=args.max_len_a, max_len_b=args.max_len_b, min_len=args.min_len,
                            workers=args.workers, stop_rule=args.stop_rule)
        settings.check()
        translator = load_translator(args, device)
        src_tok = translator.tokenizers.src
        lang = args.tgt_lang  # a multilingual model: --tgt-lang, else --data's --tgt where the model has its token
        if not lang and args.data and f">>{args.tgt}<<" in src_tok.language_codes:
            lang = args.tgt
        if lang:
            lines = with_target_token(lines, target_token(src_tok, lang), src_tok)
        hyps = translator.translate(lines, **vars(settings))
        info.update(source=first, checkpoint=args.checkpoint, beam=args.beam, alpha=args.alpha,
                    precision=translator.precision)  # CTranslate2's: an int8 export's by default
        if args.save_hyps:
            from aiayn.files import write_output_bytes

            try:
                write_output_bytes(args.save_hyps, "".join(h + "\n" for h in hyps).encode("utf-8"))
            except OSError as e:
                raise AiaynError(f"{args.save_hyps}: cannot write ({e.strerror or e}) (--save-hyps)") from None
    scores = corpus_scores(hyps, *refs)
    note = tokenized_note(hyps, *refs)
    if note:
        print(f"aiayn evaluate: warning: {note}", file=sys.stderr)
    if args.json:
        text = json.dumps({**scores, **info}, sort_keys=True)
    else:
        text = format_scores(scores)
        if mode == "translate":
            text += f"\ncheckpoint: {args.checkpoint}  beam: {args.beam}  alpha: {args.alpha}  precision: {info['precision']}"
    saved = args.save_hyps if mode == "translate" else None  # (a full disk's message says where they are)
    say(text, f"; the translations are saved in {saved}" if saved else "", what="the scores")
    return 0

