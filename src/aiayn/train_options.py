"""The options of `aiayn train`: its flags, --config files (TOML or JSON, or a run's own train.json),
and the checks made on them before anything is written or prepared.

Preset < --config file < flags (`build_configs`); `given_options` names what the command set, which
`--resume` compares with the run's saved settings (aiayn.rundir). A new run's model is built from these
options on the meta device here (`check_model_options`), since a shape no machine holds should be refused
before its data is prepared (hours for a large corpus). Kept apart from aiayn.train so that the loop
reads in one sitting; it imports neither train nor rundir.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tomllib
from pathlib import Path
from typing import Any

from aiayn import checkpoint as ckpt
from aiayn import memory
from aiayn.config import PATH_FIELDS, PRESETS, ConfigError, ModelConfig, TrainConfig, preset
from aiayn.errors import AiaynError


# Model fields the tokenizer decides; they are not flags.
MODEL_FROM_DATA = ("src_vocab_size", "tgt_vocab_size", "pad_id")

_HELP = {
    "data": "named corpus: multi30k (with --src/--tgt); or give --train-src/--train-tgt",
    "src": "source language of --data (en, de, fr, cs)",
    "tgt": "target language of --data",
    "data_dir": "folder holding multi30k/ (else $AIAYN_DATA, else the user cache)",
    "train_src": "training source file (plain or .gz, UTF-8, one sentence a line)",
    "train_tgt": "training target file, aligned with --train-src",
    "valid_src": "validation source file",
    "valid_tgt": "validation target file",
    "data_bin": "a directory written by `aiayn prepare` (instead of the data flags above)",
    "init_from": "fine-tune: start from this checkpoint's weights, tokenizer and model shape (an imported one too); "
                 "only the dropout options may differ from it",
    "vocab_size": "SentencePiece vocabulary size (an upper bound)",
    "joint_vocab": "one vocabulary for both languages (lets all embeddings be tied)",
    "spm_model_type": "SentencePiece model: bpe or unigram",
    "max_tokens": "tokens per batch, padding counted",
    "max_len": "longest pair in subword tokens per side",
    "long": "what to do with longer pairs: skip or truncate",
    "update_freq": "batches accumulated per optimizer step",
    "tokens_per_update": "padded positions per optimizer step over all processes: sets --update-freq to "
                         "N / (--max-tokens x processes), rounded: the same step on any number of GPUs (0: off)",
    "lr_factor": "factor in lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)",
    "warmup": "warm-up steps of the learning-rate schedule",
    "cooldown": "the last N steps up to --max-steps ramp the learning rate linearly down (to 1/N of it on the "
                "last step; 0: off)",
    "adam_beta1": "Adam beta1",
    "adam_beta2": "Adam beta2",
    "adam_eps": "Adam epsilon",
    "label_smoothing": "label smoothing of the cross entropy",
    "clip_norm": "clip the gradient norm to this value (0: off)",
    "precision": "auto (bf16 autocast on a CPU with oneDNN bf16 kernels (AVX-512 or AVX2-VNNI-2), else fp32; bf16 or fp16 + "
                 "gradient scaler on CUDA), fp32, bf16, fp16",
    "device": "auto, cpu or cuda[:N]",
    "compile": "torch.compile each encoder and decoder layer: fused element-wise work, compiled once per stack "
               "(tens of seconds at the start; docs/gpu.md)",
    "max_epochs": "stop after this many epochs (0: no limit)",
    "max_steps": "stop after this many optimizer steps (0: no limit)",
    "max_minutes": "stop after this many minutes of training (0: no limit)",
    "patience": "stop after this many epochs without a better validation BLEU (0: off)",
    "keep_last": "step checkpoints kept (plus best/, where validation BLEU is scored)",
    "save_every": "write a checkpoint every N steps (0: only at epoch ends)",
    "valid_bleu": "validation sentences translated greedily for BLEU each epoch and at a mid-epoch stop (0: loss only, "
                  "and no best/)",
    "log_every": "append a train line to metrics.jsonl every N steps",
    "seed": "random seed (weights, dropout, batch order)",
    "out": "run directory: step_<N>/ checkpoints, best/ (the best validation BLEU's) and metrics.jsonl",
    "threads": "CPU threads for torch (0: torch's default)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default=None, choices=list(PRESETS),
                   help="model size (default: the --config file's preset, else small)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="TOML or JSON file of options: top-level keys, or [model] and [train] tables; flags override it")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    g = p.add_argument_group("model (defaults from --preset; the vocabulary sizes come from the tokenizer)")
    small = PRESETS["small"]
    for f in dataclasses.fields(ModelConfig):
        if f.name in MODEL_FROM_DATA:
            continue
        default = small.get(f.name, f.default)
        _add_field(g, f.name, f.default, f"(default: {default} for small; see --preset)")
    g = p.add_argument_group("training")
    for f in dataclasses.fields(TrainConfig):
        shown = "" if f.default is None else f" (default: {f.default})"  # None: not given; the help says what then
        _add_field(g, f.name, f.default, f"{_HELP.get(f.name, f.name)}{shown}")


def _add_field(g: Any, name: str, default: Any, help_text: str) -> None:
    flag = "--" + name.replace("_", "-")
    if isinstance(default, bool):
        g.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
    else:
        kind = str if default is None else type(default)
        metavar = {int: "N", float: "X"}.get(kind, name.split("_")[-1].upper())
        g.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS, help=help_text, metavar=metavar)


def _read_config_file(path: str) -> dict[str, Any]:
    """The --config file's table; utf-8-sig since Windows editors save a BOM that TOML would reject."""
    file = Path(path)
    try:
        raw = file.read_bytes()
    except OSError as e:
        raise AiaynError(f"--config {file}: cannot read it ({e.strerror or e})") from e
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise AiaynError(f"--config {file}: line {line} is not UTF-8 (byte {raw[e.start]:#04x}); "
                         "save it as UTF-8") from e
    try:
        data = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
    except ValueError as e:  # JSONDecodeError, TOMLDecodeError, and an int of over 4,300 digits (Python's limit)
        if "digits" in str(e) and not isinstance(e, (json.JSONDecodeError, tomllib.TOMLDecodeError)):
            raise AiaynError(f"--config {file}: a number of more than {sys.get_int_max_str_digits():,} digits; "
                             "give one that fits its option") from None
        raise AiaynError(f"--config {file}: not valid {'JSON' if file.suffix == '.json' else 'TOML'} ({e})") from e
    if not isinstance(data, dict):
        raise AiaynError(f"--config {file}: expected a table of options")
    return data


_MODEL_NAMES = frozenset(f.name for f in dataclasses.fields(ModelConfig)) - set(MODEL_FROM_DATA)
DEFAULT_PRESET = "small"


def _file_options(path: str) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """(preset or None, model options, train options) of a --config file."""
    train_names = {f.name for f in dataclasses.fields(TrainConfig)}
    flat: dict[str, Any] = {}
    for k, v in _read_config_file(path).items():
        for name, value in (v.items() if k in ("model", "train") and isinstance(v, dict) else [(k, v)]):
            if name in flat and flat[name] != value:  # top-level and in a table: one of them was dropped unsaid
                raise AiaynError(f"--config {path}: {name} is set twice, to {flat[name]!r} and {value!r}; keep one")
            flat[name] = value
    name = flat.pop("preset", None)
    unknown = [k for k in flat if k not in _MODEL_NAMES | train_names]
    if unknown:
        raise AiaynError(f"--config {path}: unknown option {unknown[0]!r}")
    return (name, {k: v for k, v in flat.items() if k in _MODEL_NAMES},
            {k: v for k, v in flat.items() if k in train_names})


def _options_given(args: argparse.Namespace) -> tuple[str | None, dict[str, Any], dict[str, Any]]:
    """(preset, model options, train options) set by the --config file or flags, flags winning."""
    train_names = {f.name for f in dataclasses.fields(TrainConfig)}
    if args.config == "":  # `--config "$RECIPE"` with RECIPE unset trained on the defaults without a word
        raise AiaynError("--config is an empty name (an unset shell variable?); give a file or leave it out")
    recorded = None if args.config else _recorded_settings(args)
    config = args.config or recorded
    name, model_over, train_over = _file_options(config) if config else (None, {}, {})
    if recorded:  # the folder it is in, whatever it says (a run moved)
        train_over["out"] = str(Path(recorded).parent)
    if getattr(args, "resume", False):  # a run's own train.json, from before "" was refused
        train_over = empty_paths_as_read(train_over)
    if args.preset is not None:  # an explicit flag beats the file
        name = args.preset
    for k in _MODEL_NAMES:
        if hasattr(args, k):
            model_over[k] = getattr(args, k)
    flagged = {k for k in train_names if hasattr(args, k)}
    for k in flagged:
        train_over[k] = getattr(args, k)
    _flagged_corpus_wins(train_over, flagged)
    return name, model_over, train_over


def _recorded_settings(args: argparse.Namespace) -> str | None:
    """RUN/train.json for `--out RUN --resume` without --config where RUN holds no checkpoint but a run's
    train.json (stopped before its first: a second Ctrl-C, a kill): the new start takes every setting recorded
    there, as `--config RUN/train.json --resume` does (it started from the defaults: "no training data")."""
    if not getattr(args, "resume", False):
        return None
    out = Path(getattr(args, "out", TrainConfig.out))
    path = out / "train.json"
    if ckpt.step_checkpoints(out, moved_aside=True) or not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # `rundir._check_early_files` names it
    return str(path) if is_train_json(saved) else None


# Fields every train.json holds ({"preset", "model", "train": TrainConfig.to_dict()}).
_TRAIN_JSON_FIELDS = frozenset({"out", "seed", "max_tokens", "label_smoothing", "warmup"})


def is_train_json(saved: Any) -> bool:
    """Whether `saved` (a train.json's JSON) is recognisably a run's own: a preset, a model and its settings."""
    settings = saved.get("train") if isinstance(saved, dict) else None
    return (isinstance(saved, dict) and isinstance(saved.get("preset"), str) and isinstance(saved.get("model"), dict)
            and isinstance(settings, dict) and _TRAIN_JSON_FIELDS <= set(settings))


CORPUS_KINDS = (("data",), ("data_bin",), ("train_src", "train_tgt", "valid_src", "valid_tgt"))  # one per run


def _flagged_corpus_wins(train_over: dict[str, Any], flagged: set[str]) -> None:
    """A corpus named by flags replaces the --config file's (`configs/demo.toml`'s Multi30k, say, with
    --train-src and --train-tgt: the recipe on one's own text), as other flags replace file values."""
    kinds = [kind for kind in CORPUS_KINDS if flagged & set(kind)]
    if len(kinds) == 1:
        for k in {k for kind in CORPUS_KINDS if kind is not kinds[0] for k in kind} - flagged:
            train_over.pop(k, None)


def build_configs(args: argparse.Namespace) -> tuple[str, dict[str, Any], TrainConfig]:
    """Preset < --config file < flags. Returns (preset name, model overrides, TrainConfig)."""
    name, model_over, train_over = _options_given(args)
    name = DEFAULT_PRESET if name is None else name
    if not isinstance(name, str) or name not in PRESETS:
        raise AiaynError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    try:
        tc = TrainConfig(**train_over)
    except TypeError as e:
        raise AiaynError(f"bad option type: {e}") from e
    except ConfigError:
        _blame_config_file(args, train_over)
        raise
    unflagged = {k: v for k, v in model_over.items() if not hasattr(args, k)}  # the file's, no flag over them
    if not (args.resume or tc.init_from):  # `train` checks again; here an error can name the --config file
        check_model_options(name, model_over, tc, (args.config, unflagged) if args.config else None)
    elif tc.init_from and not args.resume and args.config:
        _check_file_shape(args.config, tc.init_from, unflagged)
    return name, model_over, tc


FINE_TUNE_FREE = ("dropout", "attention_dropout", "activation_dropout")  # the model options --init-from may change


def _check_file_shape(config: str, init_from: str, unflagged: dict[str, Any]) -> None:
    """A --config file's model options beside --init-from (a recipe for a model trained from scratch, say):
    one that differs from the checkpoint's shape is named with the file; `train.fine_tuned_config` named it
    as a flag to drop, which the command did not hold."""
    try:
        own = ModelConfig.from_dict(ckpt.read_config(ckpt.resolve_checkpoint(init_from))["model"])
    except (AiaynError, KeyError, TypeError):
        return  # `train` says what is wrong with the checkpoint
    for k, v in sorted(unflagged.items()):
        if k not in FINE_TUNE_FREE and v != getattr(own, k):
            raise AiaynError(f"--config {config}: {k} = {v!r} differs from --init-from {init_from}'s {getattr(own, k)!r}: "
                             f"a fine-tuned model keeps its shape; remove {k} from the file")


def _blame_config_file(args: argparse.Namespace, train_over: dict[str, Any]) -> None:
    """A bad train option that the --config file sets (no flag over it) is named with the file: the
    message named a flag the command did not hold (a run's own train.json with "" for a path, say)."""
    unflagged = {k: v for k, v in train_over.items() if not hasattr(args, k)}
    if args.config and unflagged:
        try:
            TrainConfig(**unflagged)
        except ConfigError as e:
            raise AiaynError(f"--config {args.config}: {e}; fix it there") from None


def check_model_options(name: str, model_over: dict[str, Any], tc: TrainConfig,
                        config: tuple[str, dict[str, Any]] | None = None) -> None:
    """A new run's model, built before its data is prepared (hours for a large corpus, and its data/
    in --out would block the corrected command). The error names `config` (its path and the options
    it sets that no flag overrides) where those options alone fail, else the model options given."""
    try:
        mcfg = new_model_config(name, model_over, tc, (tc.vocab_size, tc.vocab_size))
    except ConfigError as e:
        why = str(e).removeprefix("ModelConfig: ")
        if config and config[1]:
            try:
                new_model_config(name, config[1], tc, (tc.vocab_size, tc.vocab_size))
            except ConfigError:
                raise AiaynError(f"--config {config[0]}: {why}; fix it there") from e
        raise AiaynError(f"{why} ({_model_flags(name, model_over)}); change these model options") from e
    _check_positions(mcfg.max_positions, tc.max_len)
    _check_model_fits(mcfg, name, model_over)


def _check_positions(positions: int, max_len: int) -> None:
    """A new run's pairs within its model's table of positions, as `train._within_positions` keeps a
    fine-tuning's: P positions hold pairs of P - 1 tokens a side (the source's EOS, the target's BOS), as
    `translate` cuts sources and an export decodes. Past it, the run trained on positions the model never
    translates."""
    fits = positions - 1
    if max_len > fits:
        shorter = f"--max-len {fits} or less, or " if fits else ""
        raise AiaynError(f"--max-len {max_len} is past --max-positions {positions}: a table of {positions} positions "
                         f"holds pairs of at most {fits} tokens a side (the source's EOS, the target's BOS), as "
                         f"translate and an export read them; give {shorter}--max-positions {max_len + 1} or more")


def _model_flags(name: str, model_over: dict[str, Any]) -> str:
    return f"--preset {name}" + "".join(f" --{k.replace('_', '-')} {v}" for k, v in sorted(model_over.items()))


def _check_model_fits(mcfg: ModelConfig, name: str, model_over: dict[str, Any]) -> None:
    """Sizes that pass the config's checks but no machine holds (a digit too many) are refused here,
    from the model's shapes on the meta device, rather than by the allocator after the data is
    prepared: its float32 weights alone must fit in this machine's memory."""
    memory.cap_onednn_caches()  # before any model is built, as `train` does (this one on meta)
    try:
        n = ckpt.meta_model(mcfg).num_parameters()
    except ConfigError as e:
        raise AiaynError(f"cannot build a model of these options ({e}; {_model_flags(name, model_over)}); "
                         "change them") from None
    have = memory.physical_bytes()
    if have and 4 * n > have:
        raise AiaynError(f"the model would have {n:,} parameters, {4 * n / 2**30:,.1f} GiB of float32 weights "
                         f"alone, more than this machine's {have / 2**30:,.1f} GiB of memory "
                         f"({_model_flags(name, model_over)}); change these model options")


def given_options(args: argparse.Namespace) -> set[str]:
    """Names of the TrainConfig fields (and "preset") that the --config file or a flag set: on
    --resume, the others take the run's saved values. A file's update_freq beside tokens_per_update
    is not one (a run's train.json records the value derived then; `with_update_freq` derives it again)."""
    name, _, train_over = _options_given(args)
    given = set(train_over) | ({"preset"} if name is not None else set())
    if train_over.get("tokens_per_update") and not hasattr(args, "update_freq"):
        given.discard("update_freq")
    return given


def with_update_freq(tc: TrainConfig, world: int, given_update_freq: bool = False) -> TrainConfig:
    """--tokens-per-update N: update_freq = N / (max_tokens x world) to the nearest whole number (at
    least 1), so a step holds about N padded positions on any number of processes. Where one batch
    per process already holds more than N, the step would grow with the world: refused, naming the
    --max-tokens that fits. A --update-freq also given (`given_update_freq`) must be the derived one."""
    if not tc.tokens_per_update:
        return tc
    per_round = tc.max_tokens * world
    if per_round > tc.tokens_per_update:
        raise AiaynError(f"--tokens-per-update {tc.tokens_per_update}: {world} processes x --max-tokens "
                         f"{tc.max_tokens} already take {per_round} per step; use --max-tokens "
                         f"{max(2, tc.tokens_per_update // world)} or less (or a larger --tokens-per-update)")
    derived = max(1, math.floor(tc.tokens_per_update / per_round + 0.5))
    if given_update_freq and tc.update_freq != derived:  # a flag or --config value that would be overridden
        raise AiaynError(f"--update-freq {tc.update_freq} disagrees with --tokens-per-update {tc.tokens_per_update}, "
                         f"which sets it to {derived} here ({tc.tokens_per_update} / ({world} processes x --max-tokens "
                         f"{tc.max_tokens})); drop one of them")
    return tc.replace(update_freq=derived)


def check_patience(tc: TrainConfig) -> None:
    """--patience counts epochs without a better validation BLEU: refused where no BLEU is scored (it
    would never stop the run). A --data-bin without a validation set shows once it is opened."""
    if not tc.patience:
        return
    if not tc.valid_bleu:
        raise AiaynError(f"--patience {tc.patience} counts epochs without a better validation BLEU, but --valid-bleu "
                         "is 0 (no BLEU is scored); give --valid-bleu N or --patience 0")
    if not (tc.data or tc.data_bin) and tc.train_src and not tc.valid_src:
        raise AiaynError(f"--patience {tc.patience} counts epochs without a better validation BLEU, but there is no "
                         "validation set; give --valid-src and --valid-tgt or --patience 0")


def check_corpus(tc: TrainConfig) -> None:
    """One corpus per run: --data, --data-bin and the text files (--train-src ... --valid-tgt) each name
    one, and given together (as flags, or in one --config file) all but one were ignored without a word."""
    files = [f"--{k.replace('_', '-')}" for k in CORPUS_KINDS[2] if getattr(tc, k)]
    named = [flag for flag, given in (("--data", tc.data), ("--data-bin", tc.data_bin), (" ".join(files), files)) if given]
    if len(named) > 1:
        raise AiaynError(f"{named[0]} and {named[1]} each name the training corpus; give one of them")


def empty_paths_as_read(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved train config's "" paths (and languages) as the code that wrote them read them: a run
    from before "" was refused recorded them, and every one of its checkpoints then failed to resume.
    "" was a path not given (the default), but for data_dir the current directory (as Path("") is);
    an empty language recorded no pair, which the default (de, en) stands for, as for any run's own files."""
    empty = {k for k in (*PATH_FIELDS, "src", "tgt") if saved.get(k) == ""}
    return {k: v for k, v in saved.items() if k not in empty} | ({"data_dir": "."} if "data_dir" in empty else {})


def new_model_config(preset_name: str, model_over: dict[str, Any], tc: TrainConfig,
                      vocab: tuple[int, int]) -> ModelConfig:
    """The model of a new run with `vocab` (source, target) pieces; before the data is prepared,
    --vocab-size stands in for both (the checks hold for any positive sizes)."""
    over = dict(model_over)
    if not tc.joint_vocab:
        if over.get("share_embeddings"):
            raise AiaynError("--share-embeddings needs a joint vocabulary; drop --no-joint-vocab")
        over["share_embeddings"] = False
    return preset(preset_name, src_vocab_size=vocab[0], tgt_vocab_size=vocab[1], **over)
