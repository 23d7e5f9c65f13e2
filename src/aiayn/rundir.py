"""The run directory of `aiayn train` (--out) and what a run resumes from.

One `train` at a time runs in --out (`RunLock`); what a killed process left is put right (`tidy_out`); a
new run needs an empty or new --out and --resume one with a checkpoint or only what a run leaves before
its first, so that a run never deletes or rewrites what it did not write (`open_run_dir`). The newest
readable checkpoint is loaded (`load_newest`), and the resume policy decides which settings a resumed
run may take anew (`resumed_settings`, FREE_ON_RESUME). Kept apart from aiayn.train (which drives it)
so that each reads in one sitting; it imports train_options, never train.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import itertools
import json
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Collection, Iterator

from aiayn import checkpoint as ckpt
from aiayn.config import ConfigError, TrainConfig
from aiayn.data.lock import STALE
from aiayn.errors import AiaynError
from aiayn.train_options import CORPUS_KINDS, empty_paths_as_read, is_train_json
from aiayn.trainer import Dist, check_optimizer_state

Log = Callable[[str], None]


# What a run leaves in --out before its first checkpoint: --resume starts such a run again.
_EARLY_FILES = frozenset({"train.json", "metrics.jsonl", "metrics.jsonl.tmp", "tokenizer", "data"})  # data: corpus.RUN_DATA
# `files.atomic_write_bytes`'s temporary for train.json (mkstemp's 8 characters), torn where a kill left it
_TRAIN_JSON_TMP = re.compile(r"\.train\.json\.[a-z0-9_]{8}\.tmp")


def tidy_out(out: Path, resume: bool, d: Dist) -> None:
    """What a killed process left in --out is put right before any rank looks at it: an interrupted
    preparation's abandoned lock and temporaries go, each machine's own (a rank that looked meanwhile would
    see a lock being taken over), and on --resume rank 0 puts back a checkpoint moved aside by a kill
    mid-save (listed first, it was not there: "nothing to resume"). An --out it cannot write is named later."""
    from aiayn.data import prepare
    from aiayn.data.corpus import RUN_DATA

    if d.local == 0:
        prepare.remove_abandoned(out / RUN_DATA)
    if resume and d.main:
        with contextlib.suppress(OSError):
            ckpt.restore_replaced(out)


class RunBusy(AiaynError):
    """Another `train` holds --out (`RunLock`): what this one found there is that one's, never removed."""


class RunLock:
    """One `aiayn train` at a time in --out (`takes`: rank 0's). A second one started while the first
    trained (the resume command run twice, a job started again by its scheduler) trained beside it: their
    metrics lines interleaved, and its clean-up of temporaries could remove the checkpoint the first was
    writing. An flock on the folder itself: no file of its own in --out, and the kernel lets it go when
    the process dies (`kill -9` leaves nothing to clear). Where the file system has no flock, unlocked."""

    def __init__(self, out: Path, takes: bool) -> None:
        self.out, self.takes = out, takes
        self._fd: int | None = None

    def take(self) -> None:
        """Locks --out if it is a folder and not locked yet (a new --out: once it is made)."""
        if not self.takes or self._fd is not None:
            return
        try:
            fd = os.open(self.out, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:  # none yet, or not a folder (named where it is made)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunBusy(f"--out {self.out}: another aiayn train is running there; let it finish or stop it "
                          "(Ctrl-C saves it), then resume, or choose another --out") from None
        except OSError:  # no flock here (some network file systems)
            os.close(fd)
            return
        self._fd = fd

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._fd is not None:  # unlocked first: a process forked meanwhile holds the descriptor too
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def open_run_dir(out: Path, resume: bool, d: Dist) -> list[tuple[int, Path]]:
    """Makes --out and returns its step checkpoints. A new run needs an empty or new --out, and
    --resume one with a checkpoint or only what a run leaves before its first: a run never deletes
    or rewrites what it did not write."""
    from aiayn.data import prepare
    from aiayn.data.corpus import RUN_DATA

    existing = ckpt.step_checkpoints(out)
    if existing and not resume:
        raise AiaynError(f"--out {out} already holds checkpoints (newest {existing[-1][1].name}); add --resume to "
                         "continue that run, or choose another --out")
    left = prepare.leftovers(out / RUN_DATA)  # an interrupted preparation's lock and temporaries
    held = sorted(p.name for p in out.iterdir() if not left.get(p.name)) if not existing and out.is_dir() else []
    busy = [n for n in held if n in left]
    if busy:
        raise AiaynError(f"--out {out} holds {busy[0]}: another aiayn process is preparing the data there; let it "
                         f"finish (if it was killed on another machine, retry in {STALE / 60:.0f} minutes), "
                         "or choose another --out")
    if held and not resume:
        raise AiaynError(f"--out {out} is not empty (it holds {', '.join(held[:3])}{', ...' if len(held) > 3 else ''}); "
                         "use --resume to continue the run there, or choose another --out")
    others = [n for n in held if n not in _EARLY_FILES and not ckpt.is_own_temporary(n) and not _TRAIN_JSON_TMP.fullmatch(n)]
    if others:
        raise AiaynError(f"--out {out} holds {', '.join(others[:3])} but no step_<N>/ checkpoint to resume from; "
                         "choose another --out")
    if held:
        _check_early_files(out, held)
    if d.local == 0:  # each machine's first process: --out may be a folder of every machine's own
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise AiaynError(f"--out {out}: cannot make the run directory ({e.strerror or e}); choose another --out") from None
        _check_writable(out, resume)
    if d.main and existing:
        _check_metrics_readable(out / "metrics.jsonl")
    if d.main:
        ckpt.remove_stale_temporaries(out)
        for p in out.glob(".train.json.*.tmp"):
            if _TRAIN_JSON_TMP.fullmatch(p.name):
                p.unlink(missing_ok=True)
    return existing


def _check_writable(out: Path, resume: bool) -> None:
    """Fails now, in one line, where --out takes no new file (read-only, not the user's): the run writes
    its metrics, train.json and checkpoints there, and a --resume found out at metrics.jsonl.tmp after
    loading everything, with no hint. The probe has no name (O_TMPFILE) or loses it at once."""
    try:
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        fix = (f"copy the run to a folder you can write (cp -r {out} NEW) and resume there with --out NEW" if resume
               else "choose another --out")
        how = f" (chmod u+w {out})" if e.errno == errno.EACCES else ""  # (not on a read-only file system)
        raise AiaynError(f"--out {out} is not writable ({e.strerror or e}): a run writes its checkpoints there; "
                         f"make it writable{how} or {fix}") from None


def _check_metrics_readable(path: Path) -> None:
    """--resume reads the run's metrics.jsonl (dropping lines past the checkpoint) and rewrites it: one
    it cannot read, or a line that is not a run's record (a list, invalid UTF-8: a traceback), stopped
    the run after the checkpoint and data were loaded, and a line that was not JSON was dropped
    without a word. A read-only one is fine (it is replaced, as train.json is)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        how = f" (chmod u+r {path})" if isinstance(e, OSError) and e.errno == errno.EACCES else ""
        why = (e.strerror or e) if isinstance(e, OSError) else f"not UTF-8 text: {e}"
        raise AiaynError(f"{path}: cannot read it ({why}); --resume keeps the run's metrics there: make "
                         f"it a readable file{how}, or move it away to start the metrics afresh") from None
    bad = _foreign_metrics_line(text)
    if bad:
        raise AiaynError(f"{path}: line {bad} is not a train or valid record of aiayn train; --resume rewrites the "
                         "file: remove that line, or move the file away to start the metrics afresh")


def _foreign_metrics_line(text: str) -> int | None:
    """The number of the first line of a metrics.jsonl's `text` that is not a run's record (an object
    of kind train or valid with an integer step) nor blank; the text after the last newline may be a
    line torn by a kill."""
    for n, line in enumerate(text.split("\n")[:-1], 1):
        if not line.strip():  # a blank line (a hand edit) holds no record and is dropped on resume, as plot skips it
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not ckpt.is_metrics_record(rec):
            return n
    return None


def _check_early_files(out: Path, held: list[str]) -> None:
    """Starting again rewrites train.json and metrics.jsonl: refuse unless both are recognisably a
    run's own (train.json with its fields; metrics lines of kind train/valid with a step, the last
    one possibly torn by a kill), so that a file aiayn did not write is never rewritten."""
    def foreign(path: Path, why: str) -> AiaynError:
        return AiaynError(f"{path} was not written by aiayn train ({why}); --resume would rewrite it: "
                          "move it away or choose another --out")

    train_json = out / "train.json"
    if "train.json" in held or any(n.startswith("metrics.jsonl") for n in held):
        try:
            saved = json.loads(train_json.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise foreign(out / next(n for n in held if n.startswith("metrics.jsonl")), "no train.json beside it") from None
        except (OSError, ValueError) as e:
            raise foreign(train_json, f"not readable JSON: {e}") from None
        if not is_train_json(saved):
            raise foreign(train_json, "no preset, model and train settings")
    for name in ("metrics.jsonl", "metrics.jsonl.tmp"):
        if name not in held:
            continue
        try:
            text = (out / name).read_text(encoding="utf-8")
        except (OSError, ValueError) as e:
            raise foreign(out / name, f"unreadable: {e}") from None
        bad = _foreign_metrics_line(text)
        if bad:
            raise foreign(out / name, f"line {bad} is not a train or valid record")


def saved_device(out: Path) -> str | None:
    """The --device of the run in `out` (its newest step checkpoint's), None if there is none to read:
    the processes start on a device before the checkpoint is loaded."""
    steps = ckpt.step_checkpoints(out, moved_aside=True)
    try:
        device = json.loads((steps[-1][1] / ckpt.CONFIG).read_text(encoding="utf-8"))["train"]["device"]
    except (IndexError, OSError, ValueError, KeyError, TypeError):
        return None
    return device if isinstance(device, str) else None


def load_newest(existing: list[tuple[int, Path]], info: Log) -> ckpt.Checkpoint:
    """The newest readable step checkpoint with a complete trainer state that fits its model (an
    unreadable newest one falls back to the one before); the first error if none is."""
    first_error: AiaynError | None = None
    for _, path in reversed(existing):
        try:
            loaded = ckpt.load_checkpoint(path, with_trainer_state=True)
            state = loaded.trainer_state or {}
            missing = sorted(RESUME_KEYS - set(state))
            if missing:
                raise AiaynError(f"{path / ckpt.TRAINER_STATE} lacks {', '.join(missing)}")
            try:
                check_optimizer_state(state["optimizer"], loaded.model)  # (a copy from another run)
            except AiaynError as e:
                raise AiaynError(f"{path / ckpt.TRAINER_STATE} does not fit the model ({e}); it is another run's") from None
            return loaded
        except AiaynError as e:
            first_error = first_error or e
            info(f"warning: cannot resume from {path}: {e}")
    assert first_error is not None, "called with no checkpoints"
    raise first_error


# Options that cannot change what a run has computed so far: a resumed run may take new values.
# The data files and a --data-bin directory may move (their sha256 is checked: a manifest's against
# the checkpoint's); `out` and `device` always come from the command.
FREE_ON_RESUME = frozenset({"max_epochs", "max_steps", "cooldown", "max_minutes", "patience", "keep_last", "save_every",
                            "valid_bleu", "log_every", "threads", "device", "out", "compile",
                            "data_dir", "train_src", "train_tgt", "valid_src", "valid_tgt", "data_bin"})


# what a trainer_state.pt must hold to resume from it (`Trainer.state` and the loop's position)
RESUME_KEYS = frozenset({"optimizer", "step", "epoch", "position", "elapsed_s", "best_bleu", "bad_epochs",
                         "tokens_seen", "rng"})


def resumed_settings(loaded: ckpt.Checkpoint, preset_name: str, model_over: dict[str, Any], tc: TrainConfig,
                     given: Collection[str] | None) -> tuple[str, TrainConfig]:
    """The run's saved settings, with the given values of FREE_ON_RESUME options; any other given
    option (`given`: names set on the command line; None: every field of `tc`) must equal the saved
    value, else one error names it."""
    saved = loaded.config.get("train")
    if not isinstance(saved, dict):
        saved = {}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        base = TrainConfig.from_dict(empty_paths_as_read({k: v for k, v in saved.items() if k in names}))
    except (ConfigError, TypeError) as e:
        raise AiaynError(f"{loaded.path / ckpt.CONFIG}: invalid train config ({e}); resume from another checkpoint") from e
    typed = names | {"preset"} if given is None else set(given)
    before = {"preset": loaded.config.get("preset", preset_name), **base.to_dict()}
    now = {"preset": preset_name, **tc.to_dict()}
    changed = [(k, now[k], before[k]) for k in sorted(typed - FREE_ON_RESUME) if not _same_setting(k, now[k], before[k])]
    changed += [(k, v, getattr(loaded.model_config, k)) for k, v in sorted(model_over.items())
                if v != getattr(loaded.model_config, k)]
    if changed:
        name, value, was = changed[0]
        flag = "--" + name.replace("_", "-")
        raise AiaynError(f"{flag} {value} differs from the run's {was}: --resume continues the run with its own "
                         f"settings; drop {flag}, or start a new run with another --out")
    _check_same_corpus(base, tc, typed)
    keep = (typed & FREE_ON_RESUME) | {"out", "device"}
    return before["preset"], base.replace(**{k: getattr(tc, k) for k in keep})


def _same_setting(name: str, now: Any, before: Any) -> bool:
    """Whether a setting given on resume is the run's: --init-from names a folder, which `runs/x`,
    `./runs/x/` and its absolute path all name (compared as text, each was refused as another run's)."""
    if now == before:
        return True
    if name != "init_from" or not (isinstance(now, str) and isinstance(before, str)):
        return False
    if os.path.abspath(now) == os.path.abspath(before):
        return True
    try:
        return os.path.samefile(now, before)
    except OSError:  # one of them is gone: no longer the same folder to tell
        return False


def _check_same_corpus(base: TrainConfig, tc: TrainConfig, typed: Collection[str]) -> None:
    """The data paths a resumed run may take anew (files moved) must name its own kind of corpus: text
    files given to a --data-bin run were ignored without a word, yet recorded beside it, so that the
    run's settings named two corpora."""
    kinds = ((CORPUS_KINDS[0], "--data"), (CORPUS_KINDS[1], "--data-bin"), (CORPUS_KINDS[2], "--train-src"))
    own = next(((fields, flag) for fields, flag in kinds if getattr(base, fields[0])), None)
    for fields, _ in kinds:
        given = [k for k in fields if k in typed and getattr(tc, k) and k in FREE_ON_RESUME]
        if own and given and fields is not own[0]:
            flag = "--" + given[0].replace("_", "-")
            raise AiaynError(f"{flag} {getattr(tc, given[0])}: the run trains on its {own[1]} "
                             f"{getattr(base, own[0][0])}; --resume continues on the run's own corpus (a moved "
                             f"file may be given anew, not another corpus): drop {flag}, or start a new run with "
                             "another --out")


def resume_command(out: Path, world: int) -> str:
    argv = sys.argv[1:]
    if argv[:1] == ["train"]:
        args = argv + ([] if "--resume" in argv else ["--resume"])
    else:  # called as a library: the run directory's train.json has every option
        args = ["train", "--config", str(out / "train.json"), "--resume"]
    prefix = "aiayn" if world == 1 else f"torchrun --nproc_per_node {world} -m aiayn"
    return f"{prefix} {shlex.join(args)}"


@contextlib.contextmanager
def removed_if_left_empty(out: Path, makes: bool) -> Iterator[None]:
    """The folders up to --out that this process will make (`makes`: each machine's first), removed
    again, deepest first, where a run that fails before its first file leaves them empty: a missing
    data file, a --data-bin that is none or a --tokens-per-update too small shows only once --out was
    made, and left it behind (a folder that was there stays; one holding anything is never touched)."""
    made = list(itertools.takewhile(lambda p: not os.path.lexists(p), (out, *out.parents))) if makes else []
    try:
        yield
    except RunBusy:  # another run made --out meanwhile and holds it: its folder, not this one's
        raise
    except BaseException:
        for p in made:
            try:
                p.rmdir()
            except OSError:  # not empty (the data prepared for --resume), or not made after all
                break
        raise
