"""The `aiayn` command line: one subcommand per job, each defined in the module that does the job.

A subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only when
its subcommand runs, so `aiayn --help` is quick. Problems the user can fix (`AiaynError`) are printed
as one line on stderr, exit status 2, no traceback.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import re
import sys

from aiayn import __version__, memory
from aiayn.errors import AiaynError
from aiayn.files import silence_stdout, stdout_errors

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("aiayn.data.prepare", "binarize parallel text for training (SentencePiece + memory-mapped arrays)"),
    "train": ("aiayn.train", "train a translation model on parallel text"),
    "translate": ("aiayn.translate", "translate text with a trained model"),
    "evaluate": ("aiayn.evaluate", "score translations with sacreBLEU (BLEU, chrF)"),
    "average": ("aiayn.checkpoint", "average the weights of the last N checkpoints"),
    "plot": ("aiayn.plot", "draw positional encodings, attention maps, learning curves, LR schedules"),
    "serve": ("aiayn.serve.cli", "serve a model over HTTP (LibreTranslate-compatible API, batching, attention page)"),
    "export": ("aiayn.export", "export a model to Hugging Face (Marian) or CTranslate2"),
    "import": ("aiayn.importer", "import a Hugging Face Marian model (OPUS-MT) as an aiayn checkpoint"),
    "download": ("aiayn.data.download", "download Multi30k or WMT14 into the cache (sha256-checked)"),
    "demo": ("aiayn.copytask", "train a tiny model on the copy task and show its output"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help ends with its default, except a default of None or "": such an option is
    decided at run time (its help says how) or off, and "(default: None)" after "(default: the
    checkpoint's source language)" contradicted it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default == "":
            return action.help
        return super()._get_help_string(action)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aiayn",
        description="The Transformer of 'Attention Is All You Need': train, translate, score, plot.",
    )
    parser.add_argument("--version", action="version", version=f"aiayn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name, help=help_text, description=help_text, formatter_class=HelpFormatter
        )
        if name == command:  # only the chosen subcommand's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    try:  # importing the subcommand (torch) takes a moment; Ctrl-C then is an interrupt like any other
        parser = build_parser(command if command in COMMANDS else None)
    except KeyboardInterrupt:
        print(f"aiayn {command}: interrupted" if command in COMMANDS else "aiayn: interrupted", file=sys.stderr)
        return 130
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        rc = int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
        _flush_stdout()
        return rc
    except AiaynError as e:
        print(f"aiayn {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"aiayn {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say
        silence_stdout()
        return 0
    except OSError as e:  # a file system problem no module turned into a message of its own
        where = f"{e.filename}: " if e.filename else ""
        print(f"aiayn {args.command}: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as e:  # torch's allocators raise RuntimeError (CUDA's a subclass of it)
        line = out_of_memory(e, args.command)
        if line is None:
            raise
        print(f"aiayn {args.command}: error: {line}", file=sys.stderr)
        return 2


# The flags that size a command's memory, for its out-of-memory line.
MEMORY_FLAGS = {"translate": "--max-tokens, --batch-size or --beam", "evaluate": "--max-tokens, --batch-size or --beam",
                "train": "--max-tokens (--update-freq keeps the step's tokens)", "serve": "--max-batch-tokens or --beam"}
_ASKED = re.compile(r"(?:tried to allocate|Tried to allocate) ([0-9.]+) ?(bytes|[KMGT]iB)")


def out_of_memory(e: BaseException, command: str) -> str | None:
    """One line for running out of memory on the CPU (MemoryError, or torch's "DefaultCPUAllocator:
    can't allocate memory" RuntimeError) or a GPU (torch.OutOfMemoryError): how much was asked for,
    and the flags that size it; None for any other error. A user's extreme settings (a beam of
    thousands over a large batch) got a traceback."""
    if not memory.out_of_memory(e):
        return None
    asked = _ASKED.search(str(e))
    size = ""
    if asked:
        n, unit = asked.groups()
        size = f" ({float(n) / 2**30:.1f} GiB asked for)" if unit == "bytes" else f" ({n} {unit} asked for)"
    flags = MEMORY_FLAGS.get(command)
    return f"out of memory{size}; " + (f"lower {flags}, or free memory" if flags else "free memory, or give it less at once")


def _flush_stdout() -> None:
    """What the command printed last (`plot` its file, `average`, `import`, `prepare` theirs) is
    written here, not at the interpreter's exit: a reader gone there (`| true`) was "Exception
    ignored ... BrokenPipeError", exit 120, and a full disk the same. A full disk is one line here; a
    reader gone is quiet, and the command's exit status stands (130 after Ctrl-C was 0)."""
    if sys.stdout is None:  # (started with it closed: `>&-`; a command that prints refuses that itself)
        return
    try:
        with stdout_errors():
            sys.stdout.flush()
    except BrokenPipeError:  # (the reader went away: nothing left to say)
        silence_stdout()


def entry() -> None:
    """The `aiayn` executable: `main`, then exit. Before the interpreter's shutdown, everything
    alive is frozen out of the garbage collector, whose last full pass over torch's and the
    model's objects took 1-2 s after every command (0.2 s frozen; docs/speed.md, Exit). Not in `main`,
    which tests and scripts call many times in one process."""
    try:
        rc = main()
    finally:
        gc.freeze()
    raise SystemExit(rc)
