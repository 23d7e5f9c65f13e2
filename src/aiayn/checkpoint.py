"""Self-describing checkpoint directories, written atomically and loaded without trusting them.

A checkpoint is a directory:

    config.json          {"model": ModelConfig, "train": TrainConfig, "tokenizer": {...},
                          "versions": {...}, "step": N}
    model.safetensors    the weights; tied tensors are stored once and re-tied on load
    spm.model            the joint SentencePiece model (or src.spm.model + tgt.spm.model)
    trainer_state.pt     optional: optimizer, step, RNG states, position in the data; tensors and
                         primitives only, read back with torch.load(weights_only=True)

A run directory (`aiayn train --out`) holds `step_<N>/` checkpoints, `best/` and `metrics.jsonl`.

Saving writes every file into a hidden temporary directory next to the target, fsyncs the files
and the directory, then renames it into place, so a checkpoint is either complete or absent:
a run killed mid-save leaves only a `.tmp-*` directory, which is never taken as a checkpoint.
Ctrl-C removes its own at once; after a kill, the next `train` in that run directory (or `average`
to that -o) removes those it wrote: `.tmp-[old-|pruned-]NAME-XXXXXXXX` (8 hex digits), where NAME is
a checkpoint's folder name. Any such folder is safe to remove by hand while no aiayn process writes
there, except a `.tmp-old-NAME-*` whose NAME is missing: that is the previous checkpoint, which the
next start moves back.
`aiayn average` averages the weights of the last N checkpoints (Section 6.1 averages 5); one average
writes an -o at a time (a `.NAME.lock` folder beside it), so that its clean-up never takes another's
temporaries for a killed one's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from aiayn.config import ConfigError, ModelConfig
from aiayn.errors import AiaynError, first_line
from aiayn.files import fsync_path, refuse_symlink_output, umask
from aiayn.model import Transformer
from aiayn.tokenizer import JOINT_FILE, SRC_FILE, TGT_FILE

CONFIG, WEIGHTS, TRAINER_STATE = "config.json", "model.safetensors", "trainer_state.pt"
TMP_PREFIX = ".tmp-"
_STEP_RE = re.compile(r"^step_(0|[1-9]\d*)$")  # as a run names them: a user's step_05 is not one (nor pruned)
_AVERAGE_FILES = frozenset({CONFIG, WEIGHTS, JOINT_FILE, SRC_FILE, TGT_FILE})  # all that an average holds


METRIC_KINDS = ("train", "valid")  # the records of a run's metrics.jsonl


def is_metrics_record(rec: Any) -> bool:
    """Whether a parsed metrics.jsonl line is a run's record: an object of a `METRIC_KINDS` kind with
    an integer step. `aiayn train --resume` (before rewriting the file) and `aiayn plot` apply it."""
    return isinstance(rec, dict) and rec.get("kind") in METRIC_KINDS and type(rec.get("step")) is int


def package_versions() -> dict[str, str]:
    import safetensors
    import sentencepiece

    from aiayn import __version__

    return {"aiayn": __version__, "torch": torch.__version__, "sentencepiece": sentencepiece.__version__,
            "safetensors": safetensors.__version__, "python": sys.version.split()[0]}


# ---------------------------------------------------------------------------------------- saving


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """State-dict names grouped by the storage they share (tied embeddings appear under 2-3 names)."""
    groups: dict[tuple[int, int, tuple[int, ...]], list[str]] = {}
    for name, t in model.state_dict(keep_vars=False).items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def _unique_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    return {g[0]: sd[g[0]].detach().cpu().contiguous() for g in _tied_groups(model)}


def write_dir_atomic(path: Path, fill, flag: str = "--out", in_run: bool = False) -> None:
    """Calls `fill(tmp_dir)` to write the files, then moves the finished directory to `path`.

    An existing `path` is replaced only after the new directory is complete. Any OSError (a full
    disk) removes the temporary directory and leaves what was at `path` untouched. `in_run`: `path`
    is a training run's checkpoint, whose run's step checkpoints remain to resume from.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise AiaynError(f"could not write checkpoint {path}: it exists and is not a directory; choose another {flag}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file in the way, no permission
        raise AiaynError(f"could not write checkpoint {path}: cannot make the folder {path.parent} "
                         f"({e.strerror or e}); choose another {flag}") from None
    tmp = path.parent / f"{TMP_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}"
    left = _left_after_failure(path, in_run)
    old = None
    try:
        tmp.mkdir()
        fill(tmp)
        mask = umask()
        for f in tmp.iterdir():
            f.chmod(0o666 & ~mask)  # the usual mode (safetensors writes its files 0600)
            fsync_path(f)
        fsync_path(tmp)
        if path.exists():  # a directory cannot be os.replace'd over a non-empty one: swap in two steps
            old = path.parent / f"{TMP_PREFIX}old-{path.name}-{uuid.uuid4().hex[:8]}"
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_path(path.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except (OSError, SafetensorError, RuntimeError) as e:  # safetensors and torch.save report a full disk in their own types
        _undo_write(tmp, old, path)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip().splitlines()[0][:200]
        raise AiaynError(f"could not write checkpoint {path}: {why}; {left}; free space or choose another {flag}") from e
    except BaseException:  # Ctrl-C (a second one in `train`): the temporaries stayed behind for good
        _undo_write(tmp, old, path)
        raise


def _undo_write(tmp: Path, old: Path | None, path: Path) -> None:
    """Removes a failed write's temporary directory and puts back the checkpoint it was replacing
    where it had already been moved aside."""
    shutil.rmtree(tmp, ignore_errors=True)
    if old is not None and old.is_dir() and not path.exists():
        os.rename(old, path)


def _left_after_failure(path: Path, in_run: bool) -> str:
    """What a failed save leaves, said only where true: a run's first save has no earlier checkpoint
    to fall back on, and an average's step checkpoints beside -o are not an earlier average."""
    if (path / CONFIG).is_file() or (in_run and step_checkpoints(path.parent)):
        return "the previous checkpoint is intact"
    return "nothing was written (there is no earlier checkpoint)" if in_run else "nothing was written"


def save_checkpoint(path: str | Path, model: Transformer, tokenizers: Any, config: dict[str, Any],
                    trainer_state: dict[str, Any] | None = None, flag: str = "--out", in_run: bool = False) -> None:
    """Writes a complete checkpoint directory atomically (see the module docstring).

    `config` holds at least "train" (a TrainConfig dict) and "step"; "model", "tokenizer" and
    "versions" are filled in from the model and the tokenizers when missing.
    """
    model = getattr(model, "module", model)  # a DDP wrapper saves its inner module
    cfg = dict(config)
    cfg.setdefault("model", model.cfg.to_dict())
    cfg.setdefault("tokenizer", tokenizer_info(tokenizers))
    cfg.setdefault("versions", package_versions())
    cfg.setdefault("step", 0)
    tensors = _unique_state_dict(model)

    def fill(tmp: Path) -> None:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        tokenizers.save(tmp)
        if trainer_state is not None:
            torch.save(trainer_state, tmp / TRAINER_STATE)
        (tmp / CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    write_dir_atomic(Path(path), fill, flag, in_run)  # `flag` names the option in messages


def tokenizer_info(tokenizers: Any) -> dict[str, Any]:
    if hasattr(tokenizers, "describe"):
        return dict(tokenizers.describe())
    return {"joint": bool(tokenizers.joint), "src_vocab_size": tokenizers.src.vocab_size,
            "tgt_vocab_size": tokenizers.tgt.vocab_size, "src_sha256": tokenizers.src.sha256(),
            "tgt_sha256": tokenizers.tgt.sha256()}


# --------------------------------------------------------------------------------------- loading


@dataclass
class Checkpoint:
    path: Path
    model: Transformer  # eval mode, on the CPU
    model_config: ModelConfig
    tokenizers: Any  # aiayn.tokenizer.TokenizerPair
    config: dict[str, Any]
    trainer_state: dict[str, Any] | None


def read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG
    if not path.is_dir():
        raise AiaynError(f"checkpoint {path} does not exist or is not a directory")
    if not file.is_file():
        raise AiaynError(f"{file} is missing; {path} is not a complete checkpoint directory")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    # ValueError: JSONDecodeError, and an int past Python's 4,300 digits; RecursionError: nested too deep
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise AiaynError(f"{file} is corrupt ({e}); use another checkpoint") from e
    except OSError as e:
        raise AiaynError(f"{file}: cannot read ({e.strerror or e})") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        if isinstance(cfg, dict) and cfg.get("model_type") == "marian":  # (translate, train --init-from, serve ...)
            raise AiaynError(f"{path} is a Hugging Face Marian model, not an aiayn checkpoint; import it first: "
                             f"aiayn import --from marian {path} --out DIR, then give DIR")
        if is_ct2_export(path):  # (serve, train --init-from ...)
            raise AiaynError(f"{path} is an aiayn export to CTranslate2, not a checkpoint: give the checkpoint it was "
                             "made from (translate and evaluate run the export with --engine ctranslate2)")
        raise AiaynError(f"{file} has no \"model\" section; it is not an aiayn checkpoint config")
    for section in ("tokenizer", "train"):  # read as objects by translate, train --init-from and export
        if not isinstance(cfg.get(section) or {}, dict):
            raise AiaynError(f"{file}: \"{section}\" must be an object; use another checkpoint")
    return cfg


def _unreadable(file: Path, e: Exception) -> AiaynError:
    if isinstance(e, OSError) and e.strerror:
        return AiaynError(f"{file}: cannot read ({e.strerror}); use another checkpoint")
    return AiaynError(f"{file} is corrupt or truncated ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                      "use another checkpoint")


def check_weights_header(file: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Checks the names, shapes and dtypes that `file`'s header lists against `shapes` (a model's state
    dict shapes) before any weight is allocated: a config.json whose sizes are wrong (a digit too
    many) is reported against the weights instead of allocating a model of its size first."""
    if not file.is_file():
        raise AiaynError(f"{file} is missing; the checkpoint is incomplete")
    try:
        with safe_open(str(file), framework="pt") as f:
            header = {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise _unreadable(file, e) from None
    unknown = sorted(set(header) - set(shapes))
    if unknown:
        raise AiaynError(f"{file} holds tensors the model does not have ({', '.join(unknown[:3])}); "
                         "the config does not fit the weights")
    for name, (shape, dtype) in sorted(header.items()):
        if shape != shapes[name]:
            raise AiaynError(f"{file}: tensor {name!r} has shape {shape} but config.json's model needs {shapes[name]}; "
                             "the config does not fit the weights")
        if not dtype.startswith(("F", "BF")):  # F16, BF16, F32, F64, F8_*
            raise AiaynError(f"{file}: tensor {name!r} has dtype {dtype}, not floating point; it does not hold "
                             "model weights")


def meta_model(mcfg: ModelConfig) -> Transformer:
    """`mcfg`'s model on the meta device: its shapes and size with nothing allocated, to check a
    config before a real model is built. Raises ConfigError (the reason, one line) where torch
    cannot build it: sizes past what it can index."""
    try:
        with torch.device("meta"):
            return Transformer(mcfg)
    except (RuntimeError, TypeError, ValueError, OverflowError) as e:
        raise ConfigError(first_line(e, 120)) from None


def load_weights(model: Transformer, file: Path) -> None:
    """Loads safetensors weights into `model`, checking names, shapes and dtypes against its config."""
    if not file.is_file():
        raise AiaynError(f"{file} is missing; the checkpoint is incomplete")
    try:
        loaded = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise _unreadable(file, e) from e
    sd = model.state_dict()
    full: dict[str, torch.Tensor] = {}
    for group in _tied_groups(model):
        present = [n for n in group if n in loaded]
        if not present:
            raise AiaynError(f"{file} has no tensor {group[0]!r} that config.json's model needs; "
                             "the config does not fit the weights")
        t = loaded[present[0]]
        if not t.is_floating_point():  # an integer or bool tensor would be cast into the weights without a word
            raise AiaynError(f"{file}: tensor {present[0]!r} has dtype {t.dtype}, not floating point; it does not "
                             "hold model weights")
        if tuple(t.shape) != tuple(sd[group[0]].shape):
            raise AiaynError(f"{file}: tensor {present[0]!r} has shape {tuple(t.shape)} but config.json's model "
                             f"needs {tuple(sd[group[0]].shape)}; the config does not fit the weights")
        for n in group:
            full[n] = t
    unknown = sorted(set(loaded) - set(full))
    if unknown:
        raise AiaynError(f"{file} holds tensors the model does not have ({', '.join(unknown[:3])}); "
                         "the config does not fit the weights")
    model.load_state_dict(full, strict=True)


def load_trainer_state(file: Path) -> dict[str, Any]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise AiaynError(f"{file} is missing; resume from a checkpoint written by `aiayn train`") from e
    except Exception as e:  # unpickling errors come in many types; none of them is trusted
        raise AiaynError(f"{file} is corrupt or holds more than tensors and plain values ({first_line(e)})") from e
    if not isinstance(state, dict):
        raise AiaynError(f"{file} does not hold a trainer state dictionary")
    return state


def load_checkpoint(path: str | Path, with_trainer_state: bool = False) -> Checkpoint:
    """Loads a checkpoint directory (or a run directory's best/newest one), trusting nothing in it."""
    from aiayn.tokenizer import TokenizerPair

    path = resolve_checkpoint(path)
    cfg = read_config(path)
    try:
        mcfg = ModelConfig.from_dict(cfg["model"])
    except (ConfigError, TypeError) as e:
        raise AiaynError(f"{path / CONFIG}: invalid model config ({e})") from e
    tokenizers = TokenizerPair.load(path)
    for side, want in (("src", mcfg.src_vocab_size), ("tgt", mcfg.tgt_vocab_size)):
        have = getattr(tokenizers, side).vocab_size
        if have != want:
            raise AiaynError(f"{path}: the {side} tokenizer has {have} pieces but the model's {side}_vocab_size is "
                             f"{want}; the tokenizer does not fit the model")
    info = cfg.get("tokenizer") or {}
    for side in ("src", "tgt"):
        want_sha = info.get(f"{side}_sha256")
        if want_sha and getattr(tokenizers, side).sha256() != want_sha:
            raise AiaynError(f"{path}: the {side} SentencePiece model is not the one this model was trained with "
                             "(sha256 differs from config.json)")
    try:  # the shapes the config asks for, without allocating them
        shapes = {k: tuple(v.shape) for k, v in meta_model(mcfg).state_dict().items()}
    except ConfigError as e:
        raise AiaynError(f"{path / CONFIG}: invalid model config (cannot build it: {e})") from None
    check_weights_header(path / WEIGHTS, shapes)
    model = Transformer(mcfg)
    load_weights(model, path / WEIGHTS)
    model.eval()
    state = load_trainer_state(path / TRAINER_STATE) if with_trainer_state else None
    return Checkpoint(path, model, mcfg, tokenizers, cfg, state)


def step_checkpoints(run_dir: str | Path, moved_aside: bool = False) -> list[tuple[int, Path]]:
    """Complete `step_<N>` checkpoints of a run directory, oldest first; with `moved_aside`, also those a
    kill left moved aside (`_moved_aside`), at that path: for a look before `restore_replaced` ran."""
    run_dir = Path(run_dir)
    found = []
    if run_dir.is_dir():
        for d in run_dir.iterdir():
            m = _STEP_RE.match((_moved_aside(d) if moved_aside else None) or d.name)
            if m and (d / CONFIG).is_file():
                found.append((int(m.group(1)), d))
    return sorted(found)


_RUN_CHECKPOINT = re.compile(r"best|step_(0|[1-9]\d*)")  # the names `aiayn train` gives a run's checkpoints


def refuse_run_checkpoint(out: Path, flag: str) -> None:
    """A folder that `flag` names (an export's, an average's, an import's) may neither lie inside a
    training run's checkpoint, which the run replaces (best/) or prunes (step_<N>/) whole, deleting it,
    nor take such a name in a run's folder, where `translate --checkpoint RUN` and `train --resume`
    read it as the run's own checkpoint (and the run's next best replaces it)."""
    out = Path(os.path.abspath(out))
    for d in (out, *out.parents):
        if _RUN_CHECKPOINT.fullmatch(d.name) and is_run_dir(d.parent):
            if d == out:
                raise AiaynError(f"{flag} {out}: {d.parent} is a training run, where {d.name} names a checkpoint of the "
                                 "run (translate and train --resume would read this one as the run's); choose another name")
            raise AiaynError(f"{flag} {out} is inside {d}, a checkpoint of the training run {d.parent}, which the run "
                             "replaces or prunes whole (and this with it); choose a path outside it")


def is_run_dir(d: Path) -> bool:
    """Whether `d` is a training run's folder: its train.json, or a step checkpoint with trainer state
    (an export or an average has neither). A folder that may be entered but not listed (mode 0711) has
    its train.json looked at only: the listing's PermissionError refused an export under `d/best/`."""
    if (d / "train.json").is_file():
        return True
    try:
        return any((p / TRAINER_STATE).is_file() for _, p in step_checkpoints(d))
    except OSError:
        return False


def language_pair(cfg: dict[str, Any]) -> tuple[str, str] | None:
    """The (source, target) languages a checkpoint's config records (train.src, train.tgt), if it
    names both."""
    train = cfg.get("train")
    src, tgt = (train.get("src"), train.get("tgt")) if isinstance(train, dict) else (None, None)
    return (src, tgt) if isinstance(src, str) and src and isinstance(tgt, str) and tgt else None


EXPORT_MARKER = "aiayn.json"  # what an export (`aiayn.export`) records of the checkpoint it was made from


def is_ct2_export(path: str | Path) -> bool:
    """Whether `path` is an aiayn export to CTranslate2 (its model.bin and aiayn.json), not a checkpoint."""
    return (Path(path) / "model.bin").is_file() and (Path(path) / EXPORT_MARKER).is_file()


def recorded_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The config that a checkpoint (or run directory) records, or an export's aiayn.json, which
    records its checkpoint's languages and corpus (`train`); raises AiaynError, OSError or ValueError."""
    marker = Path(path) / EXPORT_MARKER
    try:
        cfg = json.loads(marker.read_text(encoding="utf-8")) if marker.is_file() else read_config(resolve_checkpoint(path))
    except RecursionError:  # JSON nested too deep
        raise ValueError(f"{marker}: nested too deep to be an export's record") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{marker}: not a JSON object")
    return cfg


def resolve_checkpoint(path: str | os.PathLike[str]) -> Path:
    """A checkpoint directory -> itself; a run directory -> its best/, else its newest step_<N>/."""
    path = Path(path)
    if (path / CONFIG).is_file():
        return path
    if path.exists() and not path.is_dir():
        raise AiaynError(f"checkpoint {path} is a file, not a folder; pass a checkpoint or run directory")
    if not path.is_dir():
        raise AiaynError(f"checkpoint {path} does not exist; pass a checkpoint or run directory")
    if (path / "best" / CONFIG).is_file():
        return path / "best"
    steps = step_checkpoints(path)
    if steps:
        return steps[-1][1]
    raise AiaynError(f"{path} holds no checkpoint (no config.json, best/ or step_<N>/); "
                     "pass the --out directory of `aiayn train` or a checkpoint inside it")


def prune_checkpoints(run_dir: str | Path, keep_last: int, upto: int | None = None) -> None:
    """Removes all but the newest `keep_last` step checkpoints up to step `upto` (the one just
    written; only ever after it is complete). Later ones are left alone: a run that resumed past an
    unreadable newer checkpoint would otherwise keep that one and delete what it just saved.

    Each is first renamed to a `.tmp-` name, so a run killed while deleting leaves no half-deleted
    `step_<N>/` that would still look complete; the next start removes the leftover.
    """
    older = [d for n, d in step_checkpoints(run_dir) if upto is None or n <= upto]
    for d in older[:-keep_last]:
        gone = d.parent / f"{TMP_PREFIX}pruned-{d.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(d, gone)
        except OSError:
            continue
        shutil.rmtree(gone, ignore_errors=True)


def _temporaries(names: str, kinds: str = "old-|pruned-", kind_needed: bool = False) -> re.Pattern[str]:
    """The names of the temporaries `write_dir_atomic` (old: a replaced checkpoint; none: the one being
    written, unless `kind_needed`) and `prune_checkpoints` (pruned) make for checkpoints named by the
    regex `names`: the prefix, the kind, the checkpoint's name and 8 hex digits."""
    return re.compile(re.escape(TMP_PREFIX) + f"({kinds}){'' if kind_needed else '?'}({names})-[0-9a-f]{{8}}")


_OURS = _temporaries(r"step_\d+|best")  # those of a training run's directory


def is_own_temporary(name: str) -> bool:
    """Whether a run directory entry's name proves it is a temporary of this program."""
    return _OURS.fullmatch(name) is not None


def _moved_aside(d: Path, ours: re.Pattern[str] = _OURS) -> str | None:
    """The name of the checkpoint that `d` is, where `d` is a replaced one whose successor never arrived
    (`.tmp-old-NAME-*` with no NAME: a kill between `write_dir_atomic`'s two renames); else None."""
    m = ours.fullmatch(d.name)
    if m and m.group(1) == "old-" and not (d.parent / m.group(2)).exists() and (d / CONFIG).is_file():
        return m.group(2)
    return None


def restore_replaced(run_dir: str | Path, ours: re.Pattern[str] = _OURS) -> None:
    """Puts back the checkpoints a kill left moved aside (`_moved_aside`). One process does it, before any
    lists the checkpoints: a `--resume` that listed first found nothing to resume from."""
    run_dir = Path(run_dir)
    for d in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        name = _moved_aside(d, ours)  # (asked anew each time: of two for one name, the first goes back)
        if name:
            os.rename(d, run_dir / name)


def remove_stale_temporaries(run_dir: str | Path, ours: re.Pattern[str] = _OURS) -> None:
    """Removes the temporary directories a killed save or prune left behind (only names that prove
    they are ours, `ours`: a user's `.tmp-notes` stays), once a replaced checkpoint whose successor
    never arrived went back (`restore_replaced`)."""
    run_dir = Path(run_dir)
    restore_replaced(run_dir, ours)
    for d in run_dir.iterdir() if run_dir.is_dir() else []:
        if ours.fullmatch(d.name) and d.is_dir():
            shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------- averaging


def average_checkpoints(paths: list[Path], out: str | Path) -> Path:
    """Averages the weights of checkpoints that share one model config into a new checkpoint.

    One checkpoint at a time in memory, beside a float64 running sum: the paper's big model averages
    20 checkpoints of ~0.85 GB each, which held all at once came to ~17 GB.
    """
    if not paths:
        raise AiaynError("no checkpoints to average")
    first = load_checkpoint(paths[0])
    mcfg, first_path, shas = first.model_config, first.path, [t.sha256() for t in (first.tokenizers.src,
                                                                                  first.tokenizers.tgt)]
    sums = {k: v.double() for k, v in first.model.state_dict().items()}  # a new float64 copy each
    last_config, last_tokenizers, sources = first.config, first.tokenizers, [str(first.path)]
    del first
    for p in paths[1:]:
        c = load_checkpoint(p)
        if c.model_config != mcfg:
            raise AiaynError(f"{c.path} has a different model config from {first_path}; only checkpoints of "
                             "one run can be averaged")
        for side, sha in zip(("src", "tgt"), shas):
            if getattr(c.tokenizers, side).sha256() != sha:
                raise AiaynError(f"{c.path} has another {side} tokenizer than {first_path}; only checkpoints of "
                                 "one run can be averaged")
        for k, v in c.model.state_dict().items():
            sums[k] += v.double()
        last_config, last_tokenizers = c.config, c.tokenizers
        sources.append(str(c.path))
        del c  # before the next one loads
    model = Transformer(mcfg)
    # Tied names sum the same tensor, so copying each name writes the same average into the shared storage.
    model.load_state_dict({k: (v / len(paths)).float() for k, v in sums.items()})
    cfg = {k: v for k, v in last_config.items() if k not in ("versions",)}
    cfg["averaged_from"] = sources
    save_checkpoint(out, model, last_tokenizers, cfg, flag="-o")
    return Path(out)


def _check_average_output(out: Path, inputs: list[Path]) -> None:
    """-o may name a new path, an empty folder or an earlier average (replaced); never an input, a
    folder holding one (a run directory), the current directory or anything else: replacing it would
    delete it."""
    real, here = out.resolve(), Path.cwd().resolve()
    if real == here or real in here.parents:
        raise AiaynError(f"-o {out} is (or holds) the current directory; choose a new path")
    for p in inputs:
        if real == p.resolve() or real in p.resolve().parents:
            raise AiaynError(f"-o {out} is (or holds) {p}, one of the checkpoints being averaged; choose a new path")
        if p.resolve() in real.parents:  # a checkpoint's folder is replaced whole when saved again, or pruned
            raise AiaynError(f"-o {out} is inside {p}, one of the checkpoints being averaged; choose a path outside it")
    if _STEP_RE.match(out.name):  # a run would take the average for a checkpoint of its own, resume from it, prune it
        raise AiaynError(f"-o {out}: step_<N> is how aiayn train names its checkpoints; choose another name")
    refuse_run_checkpoint(out, "-o")  # (best/ of a run, which its next best replaces; inside a run's checkpoint)
    refuse_symlink_output(out, "-o")
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    try:
        cfg = json.loads((out / CONFIG).read_text(encoding="utf-8"))
        earlier = isinstance(cfg, dict) and "averaged_from" in cfg
    except (OSError, ValueError, TypeError, RecursionError):  # RecursionError: JSON nested too deep
        earlier = False
    if not out.is_dir() or not earlier:
        raise AiaynError(f"-o {out} exists and is not an earlier average; choose a new path (it would be replaced)")
    other = next((p.name for p in sorted(out.iterdir()) if p.name not in _AVERAGE_FILES or not p.is_file()), None)
    if other is not None:  # (an export of the average inside it, say: gone with the replace)
        raise AiaynError(f"-o {out} holds {other}, which an average did not write (replacing the folder would delete "
                         "it); move it away or choose a new path")


def _remove_average_leftovers(out: Path) -> None:
    """The temporaries of an earlier average to `out` that was killed mid-write (the average it was
    replacing goes back first, to be replaced again): they stayed beside -o for good. A name a
    training run's checkpoints take is left to that run, which may be writing it now."""
    if _OURS.fullmatch(f"{TMP_PREFIX}{out.name}-00000000"):
        return
    # `.tmp-old-X-*` is as well the average to X moved aside: X's, not ours to remove
    ours = _temporaries(re.escape(out.name), "old-", kind_needed=out.name.startswith("old-"))
    remove_stale_temporaries(out.parent, ours)


def _write_average(paths: list[Path], out: Path) -> Path:
    """The average of `paths` written to `out`, by one `aiayn average` to that -o at a time (a lock beside
    it; the next waits, then replaces it): the second of two at once removed the first's temporary as a
    killed one's leftover, and the first, writing on into a folder made anew, left -o without weights."""
    from aiayn.data.lock import FolderLock

    _check_average_output(out, paths)  # first: a refusal makes no folder (the lock's parent)
    with contextlib.ExitStack() as held:
        lock = FolderLock(out.parent / f".{out.name}.lock", log=lambda m: print(f"aiayn average: {m}", file=sys.stderr))
        try:
            held.enter_context(lock)
        except OSError as e:
            raise AiaynError(f"could not write checkpoint {out}: cannot make the folder {out.parent} or the lock "
                             f"{lock.path.name} in it ({e.strerror or e}); choose another -o") from None
        _check_average_output(out, paths)  # again: the average it waited for is at -o now
        _remove_average_leftovers(out)
        return average_checkpoints(paths, out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="RUN_DIR", help="a run directory; its last -n step checkpoints are averaged")
    src.add_argument("--inputs", nargs="+", metavar="DIR", help="checkpoint directories to average")
    p.add_argument("-n", "--num", type=int, default=5, help="how many of the newest step checkpoints to average")
    p.add_argument("-o", "--output", required=True, help="the new checkpoint directory")


def run(args: argparse.Namespace) -> int:
    if args.inputs:
        paths = [Path(p) for p in args.inputs]
        seen: set[Path] = set()
        for p in paths:
            if not (p / CONFIG).is_file():
                raise AiaynError(f"--inputs: {p} is not a checkpoint directory (no {CONFIG})")
            if p.resolve() in seen:  # it would count twice in the average
                raise AiaynError(f"--inputs: {p} is named twice; name each checkpoint once")
            seen.add(p.resolve())
    else:
        if args.num < 1:
            raise AiaynError(f"-n must be at least 1, got {args.num}")
        steps = step_checkpoints(args.checkpoint)
        if not steps:
            raise AiaynError(f"--checkpoint {args.checkpoint} holds no step_<N>/ checkpoints")
        paths = [d for _, d in steps[-args.num:]]
    out = _write_average(paths, Path(args.output))
    print(f"averaged {len(paths)} checkpoint{'s' if len(paths) > 1 else ''} ({', '.join(p.name for p in paths)}) into {out}")
    return 0
