"""`aiayn train`: the paper's training recipe (Section 5) on parallel text, as a run.

Section 5.1 data and token-bucketed batches, 5.3 Adam (0.9, 0.98, 1e-9) with the warm-up schedule
lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), 5.4 label smoothing 0.1. The
mechanism of a step (loss, precision, DDP, validation, RNG state) is `aiayn.trainer`; this module
is the run around it: its set-up, the loop and its logs. The flags, config files and their checks
are `aiayn.train_options`; the run directory and the resume policy, `aiayn.rundir`.

Exact resume: batches are a deterministic function of (seed, epoch), so the trainer state stores the
epoch and the position in it together with the optimizer, the step and every RNG state; a resumed
run reproduces an uninterrupted one bitwise (CPU, fp32). SIGINT/SIGTERM finish the current step,
write a checkpoint and print the command that resumes.

Data: one path, memory-mapped arrays written by `aiayn prepare` (--data-bin, or the raw text
prepared into the run directory); batches are cut from their length arrays (aiayn.data.corpus).

Distributed: under `torchrun`, each step's batches are shared out so that every rank takes as many
and about as many tokens (aiayn.data.batching), and only rank 0 validates and writes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection

import torch
import torch.distributed as dist

import aiayn.kernels
from aiayn import checkpoint as ckpt
from aiayn import memory
from aiayn.config import PATH_FIELDS, PRECISIONS, PRESETS, ConfigError, ModelConfig, TrainConfig
from aiayn.data.batching import Batches, rank_batches
from aiayn.errors import AiaynError
from aiayn.files import atomic_write_bytes
from aiayn.model import Transformer
from aiayn.rundir import (Log, RunLock, load_newest, open_run_dir, removed_if_left_empty, resume_command,
                          resumed_settings, saved_device, tidy_out)
from aiayn.stops import STOPS, LogStream, away_from_hung_up_terminal, unless_reader_gone
from aiayn.tokenizer import MODEL_TYPES
# add_arguments: the flags of `aiayn train`, which aiayn.cli takes from this module beside `run`
from aiayn.train_options import (DEFAULT_PRESET, FINE_TUNE_FREE, MODEL_FROM_DATA, add_arguments, build_configs,
                                 check_corpus, check_model_options, check_patience, given_options, new_model_config,
                                 with_update_freq)
from aiayn.trainer import (Dist, Prefetch, Trainer, rng_state, set_rng_state, setup_distributed, torch_seed,
                           validate)

if TYPE_CHECKING:  # for the checker only: train imports the rest of the data path where it uses it
    from aiayn.data.corpus import Corpus
    from aiayn.tokenizer import TokenizerPair


# -------------------------------------------------------------------------------------------- data


def load_corpus(tc: TrainConfig, loaded: ckpt.Checkpoint | None, run_dir: Path, d: Dist, source_eos: bool,
                log: Log = print, tokenizers: TokenizerPair | None = None) -> Corpus:
    """The run's prepared data (--data-bin, or the raw text prepared into the run directory) with its
    batch plans (aiayn.data.corpus; sources ending with EOS if `source_eos`). Every rank opens the same
    data (manifest sha256), and a run resumed from checkpoint `loaded` needs the data and tokenizer it
    had. `tokenizers` (fine-tuning) are those the text is encoded with instead of new ones. A failure
    on one rank is one line on every rank."""
    from aiayn.data.corpus import prepare_run_data, prepared_path

    resuming = loaded is not None

    def prepare_here(now: bool, say: Log, replace: bool) -> None:
        if now:
            prepare_run_data(tc, run_dir, say, resuming, replace, tokenizers)

    if not tc.data_bin:  # rank 0 first; then each other machine's first process (a shared --out: done)
        d.agree(lambda: prepare_here(d.main, log, True))
        d.agree(lambda: prepare_here(d.local == 0 and not d.main, lambda m: None, False))
    kept = not (tc.data_bin or resuming)  # prepared by this new run, into its --out
    corpus = d.agree(lambda: _open_corpus(prepared_path(tc, run_dir), tc, source_eos, kept))
    digest = d.from_main(lambda: corpus.digest)
    d.agree(lambda: _same_data(corpus, digest, d.rank))
    if tokenizers is not None and (tokenizers.src, tokenizers.tgt) != (corpus.tokenizers.src, corpus.tokenizers.tgt):
        raise AiaynError(f"--data-bin {corpus.data.path}: its tokenizer is not the one of --init-from {tc.init_from}; "
                         "prepare the text with that checkpoint's tokenizer, or pass the raw text (--train-src ...) instead")
    if loaded is None:
        return corpus
    if (loaded.trainer_state or {}).get("data_sha256", corpus.digest) != corpus.digest:
        raise AiaynError(f"{corpus.data.path}: the data changed since {loaded.path} was written (its manifest "
                         "differs); resume with the data the run started from, or start a new --out")
    tok = loaded.tokenizers
    if (tok.src, tok.tgt) != (corpus.tokenizers.src, corpus.tokenizers.tgt):
        raise AiaynError(f"{corpus.data.path}: its tokenizer is not the one {loaded.path} was trained with; resume "
                         "with the data the run started from")
    return corpus


def _open_corpus(path: Path, tc: TrainConfig, source_eos: bool, kept: bool) -> Corpus:
    """The batch plans show a --max-tokens too small for the data only once it is prepared: where
    this run prepared it (`kept`), the error says how to go on without preparing it again."""
    from aiayn.data.corpus import open_corpus

    try:
        return open_corpus(path, tc, source_eos)
    except AiaynError as e:
        if not kept:
            raise
        raise AiaynError(f"{e}; then add --resume to reuse the text prepared in {path}") from e


def _same_data(corpus: Corpus, digest: str, rank: int) -> None:
    if corpus.digest != digest:
        raise AiaynError(f"{corpus.data.path} (rank {rank}) differs from rank 0's prepared data (manifest sha256); "
                         "give every machine the same --data-bin, or the same text and settings")


# ------------------------------------------------------------------------------------------ set-up


def _set_up(preset_name: str, model_over: dict[str, Any], tc: TrainConfig, loaded: ckpt.Checkpoint | None,
            init: ckpt.Checkpoint | None, d: Dist, info: Log) -> Run:
    """Data, model, trainer and metrics, restored from `loaded` when resuming, else started from
    `init` (--init-from) if given; writes train.json."""
    out = Path(tc.out)
    start = loaded or init
    source_eos = start.model_config.source_eos if start else model_over.get("source_eos", ModelConfig.source_eos)
    corpus = load_corpus(tc, loaded, out, d, source_eos, info, start.tokenizers if tc.init_from and start else None)
    if tc.patience and not corpus.valid_src:  # (a --data-bin without one; text files are checked before)
        raise AiaynError(f"--patience {tc.patience} counts epochs without a better validation BLEU, but "
                         f"{corpus.data.path} holds no validation set; give --patience 0")
    if loaded:
        mcfg = loaded.model_config
    elif init:
        mcfg = fine_tuned_config(init, model_over)
    else:
        mcfg = new_model_config(preset_name, model_over, tc, (corpus.tokenizers.src.vocab_size,
                                                               corpus.tokenizers.tgt.vocab_size))
    torch.manual_seed(torch_seed(tc.seed))
    random.seed(tc.seed)
    model = Transformer(mcfg)
    if start:
        model.load_state_dict(start.model.state_dict())
    if init:
        info(f"fine-tuning from {init.path}")
    if d.rank:  # other ranks draw their own dropout masks
        torch.manual_seed(torch_seed(tc.seed + 1000 * d.rank))
        random.seed(tc.seed + 1000 * d.rank)
    run = Run(tc, preset_name, d, out, corpus, model, Trainer(model, tc, d, _precision(tc, loaded, d)),
              TrainLog(out / "metrics.jsonl", d.main), last_saved=loaded.path if loaded else None)
    if loaded:
        st = loaded.trainer_state
        assert st is not None
        if int(st.get("world", 1)) != d.world:
            raise AiaynError(f"{loaded.path} was written by {st.get('world')} processes; resume with the same number "
                             f"(torchrun --nproc_per_node {st.get('world')})")
        run.restore(st)
    mine = rank_batches(corpus.plan, tc.seed, 1, d.rank, d.world, tc.update_freq)  # as many on every rank
    run.steps_per_epoch = max(1, math.ceil(len(mine) / tc.update_freq))
    run.metrics.truncate_after(run.trainer.step)  # a fresh start (step 0) clears lines of a run killed before its first checkpoint
    if d.main:
        model_options = {k: v for k, v in mcfg.to_dict().items() if k not in MODEL_FROM_DATA}  # the model it holds
        # beside, then renamed: a kill mid-write left a torn train.json that every --resume refused
        try:
            atomic_write_bytes(out / "train.json", (json.dumps({"preset": preset_name, "model": model_options,
                                                                "train": tc.to_dict()}, indent=2) + "\n").encode("utf-8"))
        except OSError as e:
            raise _write_failed(out / "train.json", e) from None
    _describe(run, info)
    return run


def _precision(tc: TrainConfig, loaded: ckpt.Checkpoint | None, d: Dist) -> str:
    """--precision, with `auto` resolved as the run resolved it when it began (kept in its trainer
    state): the machine or the version resuming it may choose otherwise. A trainer state without it
    was trained by the `auto` of its time: with data digests (the same release), today's rule;
    without, the rule before, bf16 autocast on every CPU."""
    if tc.precision != "auto" or loaded is None:
        return tc.precision
    st = loaded.trainer_state or {}
    if st.get("precision") in PRECISIONS and st["precision"] != "auto":
        # a run moved from CUDA to a CPU (--device may change) cannot go on in fp16: auto decides anew
        return st["precision"] if st["precision"] != "fp16" or d.device.type == "cuda" else "auto"
    return "bf16" if d.device.type == "cpu" and "data_sha256" not in st else "auto"


def fine_tuned_config(init: ckpt.Checkpoint, model_over: dict[str, Any]) -> ModelConfig:
    """The --init-from checkpoint's model shape, with new dropout rates if given; any other model
    option given must equal the checkpoint's (one error names it)."""
    for k, v in sorted(model_over.items()):
        if k not in FINE_TUNE_FREE and v != getattr(init.model_config, k):
            raise AiaynError(f"--{k.replace('_', '-')} {v} differs from --init-from {init.path}'s "
                             f"{getattr(init.model_config, k)}: a fine-tuned model keeps its shape; drop the option")
    try:
        return init.model_config.replace(**{k: v for k, v in model_over.items() if k in FINE_TUNE_FREE})
    except ConfigError as e:
        raise AiaynError(str(e)) from e


def _start(preset_name: str, model_over: dict[str, Any], tc: TrainConfig, given: Collection[str] | None,
           note: Log) -> tuple[str, TrainConfig, ckpt.Checkpoint | None]:
    """A new run's (preset, settings, --init-from checkpoint), checked before its data is prepared."""
    if tc.init_from:
        return _fine_tune_start(tc.init_from, preset_name, model_over, tc, given, note)
    check_model_options(preset_name, model_over, tc)
    return preset_name, tc, None


# TrainConfig options that --init-from's checkpoint decides: its tokenizer is the run's
_FROM_INIT = ("vocab_size", "joint_vocab", "spm_model_type")


def _options_set(tc: TrainConfig, preset_name: str, given: Collection[str] | None) -> set[str]:
    """`given`, or where it is None (a library call), the options that differ from their defaults."""
    if given is not None:
        return set(given)
    defaults = TrainConfig()
    changed = {k for k in tc.to_dict() if getattr(tc, k) != getattr(defaults, k)}
    return changed | ({"preset"} if preset_name != DEFAULT_PRESET else set())


def _fine_tune_start(init_from: str, preset_name: str, model_over: dict[str, Any], tc: TrainConfig,
                     given: Collection[str] | None, note: Log = print) -> tuple[str, TrainConfig, ckpt.Checkpoint]:
    """--init-from `init_from`: the checkpoint, which decides the model and tokenizer: an option for them is
    refused (it would be ignored, yet recorded in the run's settings) unless it is the checkpoint's own
    (a run's recipe file, as `configs/multi30k.toml`, fine-tuning that run)."""
    typed = _options_set(tc, preset_name, given)
    init = ckpt.load_checkpoint(init_from)
    own = _init_settings(init)
    for k in ("preset", *_FROM_INIT):
        value = preset_name if k == "preset" else getattr(tc, k)
        if k in typed and own[k] != value:
            flag = "--no-joint-vocab" if value is False else f"--{k.replace('_', '-')}"
            shown = flag if isinstance(value, bool) else f"{flag} {value}"
            raise AiaynError(f"{shown} (a flag, or the --config file's {k}) cannot be used with --init-from "
                             f"{init_from}: the model, its shape and tokenizer are the checkpoint's; drop it")
    fine_tuned_config(init, model_over)
    tc = _within_positions(tc, init, init_from, "max_len" in typed, note)
    # recorded absolute, as the data paths are: --resume from another folder compares it with the one given there
    return own.pop("preset"), tc.replace(init_from=os.path.abspath(init_from), **own), init


def _within_positions(tc: TrainConfig, init: ckpt.Checkpoint, init_from: str, given: bool, note: Log) -> TrainConfig:
    """--max-len within the table of positions --init-from's model keeps (a fine-tuned model keeps its shape): P
    positions hold pairs of P - 1 tokens a side (the source's EOS, the target's BOS), as `translate` cuts sources
    and an export decodes. Past it (an imported Marian model's 40, say), the run trained on positions the model
    never translates, without a word: a --max-len given (`given`) is refused, the default one capped."""
    positions = init.model_config.max_positions
    fits = max(1, positions - 1)
    if tc.max_len <= fits:
        return tc
    if given:
        raise AiaynError(f"--max-len {tc.max_len}: --init-from {init_from} has a table of {positions} positions, which "
                         f"holds pairs of at most {fits} tokens a side (the source's EOS, the target's BOS); give "
                         f"--max-len {fits} or less")
    note(f"note: --max-len {fits}, not {tc.max_len}: the model of --init-from {init_from} has {positions} positions; "
         f"longer pairs are {'cut' if tc.long == 'truncate' else 'skipped'}")
    return tc.replace(max_len=fits)


def _init_settings(init: ckpt.Checkpoint) -> dict[str, Any]:
    """The preset and _FROM_INIT options --init-from's checkpoint was trained with, which its fine-tuning
    records in turn (its train.json is then a recipe that works); for those its config lacks (an imported
    model's), what its tokenizer is (`_tokenizer_settings`), else the defaults."""
    saved, defaults, facts = init.config.get("train") or {}, TrainConfig(), _tokenizer_settings(init)
    own: dict[str, Any] = {k: saved[k] if type(saved.get(k)) is type(getattr(defaults, k)) else
                           facts.get(k, getattr(defaults, k)) for k in _FROM_INIT}
    name = init.config.get("preset")
    return {"preset": name if isinstance(name, str) and name in PRESETS else DEFAULT_PRESET, **own}


def _tokenizer_settings(init: ckpt.Checkpoint) -> dict[str, Any]:
    """The _FROM_INIT options that `init`'s tokenizer answers: one vocabulary or two, the larger size
    (vocab_size is a bound), the SentencePiece type where it is one training knows. An imported Marian
    model (two unigram vocabularies) was recorded as the defaults (one joint bpe one of 8000)."""
    tok = init.tokenizers
    kind = tok.src.model_type
    return {"joint_vocab": tok.joint, "vocab_size": max(tok.src.vocab_size, tok.tgt.vocab_size),
            **({"spm_model_type": kind} if kind in MODEL_TYPES else {})}


def _init_language_pair(init_from: str, tc: TrainConfig, preset_name: str,
                        given: Collection[str] | None) -> TrainConfig:
    """With --init-from and neither --data, --src nor --tgt: the checkpoint's language pair, which
    serve, sentence splitting and export read from the run's checkpoints (not TrainConfig's de-en)."""
    if {"data", "src", "tgt"} & _options_set(tc, preset_name, given):
        return tc
    try:
        pair = ckpt.language_pair(ckpt.read_config(ckpt.resolve_checkpoint(init_from)))
    except AiaynError:  # a new run reports it when it loads the checkpoint; a resumed one saved its pair
        return tc
    return tc if pair is None else tc.replace(src=pair[0], tgt=pair[1])


def _warn_default_pair(tc: TrainConfig, preset_name: str, given: Collection[str] | None, info: Log) -> None:
    """Text files of one's own without --src/--tgt: the run records TrainConfig's de-en as its pair,
    which `serve` announces and --split-sentences splits by, whatever the files hold."""
    if tc.train_src and not tc.init_from and not {"src", "tgt"} & _options_set(tc, preset_name, given):
        info(f"warning: the run records its language pair as {tc.src} -> {tc.tgt} (the defaults); if the files "
             "hold another, start again with --src and --tgt (any codes): serve announces the pair and "
             "--split-sentences splits by it")


def _describe(run: Run, info: Log) -> None:
    tc, mcfg, corpus, tok = run.tc, run.model.cfg, run.corpus, run.corpus.tokenizers
    info(f"model: {mcfg.encoder_layers}+{mcfg.decoder_layers} layers, d_model {mcfg.d_model}, "
         f"{run.model.num_parameters():,} parameters; vocabulary {tok.src.vocab_size}"
         f"{'' if tok.joint else '/' + str(tok.tgt.vocab_size)} ({'joint' if tok.joint else 'separate'})")
    info(f"data: {corpus.describe(tc)}; ~{run.steps_per_epoch} steps/epoch")
    if not (tc.valid_bleu and corpus.valid_src):  # (the docs promised best/ without saying when)
        why = "--valid-bleu 0" if corpus.valid_src else "no validation set"
        info(f"no best/ checkpoint: it is kept by validation BLEU, and none is scored ({why}); the run keeps "
             f"its last {tc.keep_last} step_<N>/")
    info(f"device {run.d.device} x{run.d.world}, precision {run.trainer.precision}, max {tc.max_tokens} tokens x "
         f"{tc.update_freq} batches x {run.d.world} ranks per step; output {run.out}")
    if run.trainer.precision == "bf16" and aiayn.kernels.slow_bf16_on(run.d.device):
        info(f"warning: {aiayn.kernels.SLOW_BF16}; fp32 trains faster here (start a run with --precision fp32 "
             "or auto; --resume keeps the run's own precision)")


def _total_steps(run: Run) -> int | None:
    tc = run.tc
    return tc.max_steps or (tc.max_epochs * run.steps_per_epoch if tc.max_epochs else None)


# ---------------------------------------------------------------------------------------- the loop


class Stopper:
    """Ctrl-C, SIGTERM and SIGHUP (a closed terminal, which killed the run unsaved) set a flag; the loop
    finishes its step, saves and exits. A second Ctrl-C or SIGTERM kills; a second SIGHUP does not: a
    closed terminal sends its foreground job two (the shell's, then the kernel's as the shell exits),
    and the second killed the save the first began. A signal the process was started with ignored (a
    script's background job, `nohup`) stays ignored, as `aiayn.stops` leaves it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> "Stopper":
        for s in STOPS:
            try:
                if signal.getsignal(s) != signal.SIG_IGN:
                    self._old[s] = signal.signal(s, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = signum
        if signum == signal.SIGHUP:
            away_from_hung_up_terminal()
            return  # (no user's "now": the terminal is gone)
        signal.signal(signum, self._old.get(signum) or signal.SIG_DFL)

    def __exit__(self, *exc: Any) -> None:
        for s, h in self._old.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)  # None: a handler set from C, not restorable


class TrainLog:
    """Appends JSON lines to run_dir/metrics.jsonl (rank 0 only)."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write(self, record: dict[str, Any]) -> None:
        """One record; a value that is not a finite number (the loss of a diverged step) is written
        as null, since NaN is not JSON and strict readers (jq, other languages) refuse the line."""
        if self.enabled:
            clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(clean, allow_nan=False) + "\n")
            except OSError as e:
                raise _write_failed(self.path, e) from None

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines logged after the checkpoint (and a torn last line)."""
        if not (self.enabled and self.path.exists()):
            return
        keep = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", 0) <= step:
                keep.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        try:
            tmp.write_text("".join(x + "\n" for x in keep), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _write_failed(self.path, e) from None


def _write_failed(path: Path, e: OSError) -> AiaynError:
    """A run's own small file that could not be written (a full disk, a quota): it was a bare "error: No
    space left on device", naming neither the file nor what to do."""
    return AiaynError(f"could not write {path} ({e.strerror or e}); free space, then run the same command with "
                      "--resume (it continues from the last checkpoint)")


@dataclass
class Run:
    """One run's state: what `train`'s steps share and the loop advances (saved in trainer_state.pt)."""

    tc: TrainConfig
    preset: str
    d: Dist
    out: Path
    corpus: Corpus
    model: Transformer
    trainer: Trainer
    metrics: TrainLog
    epoch: int = 1
    pos: int = 0  # batches of this rank's epoch already taken
    elapsed: float = 0.0  # seconds trained by earlier processes of the run
    best_bleu: float = -1.0
    bad_epochs: int = 0
    tokens_seen: int = 0
    stop_reason: str = ""
    last_saved: Path | None = None
    steps_per_epoch: int = 1
    t0: float = field(default_factory=time.time)  # when this process began training
    window: tuple[int, float] = (0, 0.0)  # (tokens, since when) behind the tokens/s shown

    def seconds(self) -> float:
        """Training time of the whole run so far."""
        return self.elapsed + time.time() - self.t0

    def restore(self, st: dict[str, Any]) -> None:
        """The loop's position and counters from a trainer state (`save` writes them)."""
        self.trainer.load_state(st)
        self.epoch, self.pos, self.elapsed = int(st["epoch"]), int(st["position"]), float(st["elapsed_s"])
        self.best_bleu, self.bad_epochs, self.tokens_seen = (float(st["best_bleu"]), int(st["bad_epochs"]),
                                                             int(st["tokens_seen"]))
        set_rng_state(st["rng"][self.d.rank])

    def save(self, best: bool = False) -> Path:
        """step_<N>/ with the trainer state at (epoch, pos), best/ too if `best` (first: the step's
        trainer state records the new best BLEU, so a kill between the two must leave best/ written,
        not a resume that never writes it); prunes old ones."""
        d, tc = self.d, self.tc
        rngs = [rng_state()]
        if d.world > 1:
            rngs = [None] * d.world
            dist.all_gather_object(rngs, rng_state())
        path = self.out / f"step_{self.trainer.step}"
        if d.main:
            state = {**self.trainer.state(), "epoch": self.epoch, "position": self.pos, "elapsed_s": self.seconds(),
                     "best_bleu": self.best_bleu, "bad_epochs": self.bad_epochs, "tokens_seen": self.tokens_seen,
                     "rng": rngs, "world": d.world, "seed": tc.seed, "data_sha256": self.corpus.digest,
                     "precision": self.trainer.precision}
            config = {"model": self.model.cfg.to_dict(), "train": tc.to_dict(), "preset": self.preset,
                      "step": self.trainer.step, "epoch": self.epoch}
            if best:
                ckpt.save_checkpoint(self.out / "best", self.model, self.corpus.tokenizers, config, in_run=True)
            ckpt.save_checkpoint(path, self.model, self.corpus.tokenizers, config, state, in_run=True)
            ckpt.prune_checkpoints(self.out, tc.keep_last, upto=self.trainer.step)
        d.barrier()
        self.last_saved = path
        return path


def train(preset_name: str, model_over: dict[str, Any], tc: TrainConfig, resume: bool = False,
          log: Log = print, given: Collection[str] | None = None) -> dict[str, Any]:
    """Trains per `tc` and returns a summary (step, epoch, best BLEU, stop reason, last checkpoint).

    With `resume`, continues the newest checkpoint in `tc.out` with the run's saved settings (see
    `resumed_settings`; `given` names the options set on the command line, None: all of `tc`).
    """
    init = None
    notes: list[str] = []  # of the checks made before the processes know which one is the main one
    if tc.init_from:
        tc = _init_language_pair(tc.init_from, tc, preset_name, given)
    if not resume:
        tc.check_cooldown()  # before anything is written
        check_corpus(tc)
        check_patience(tc)
        preset_name, tc, init = _start(preset_name, model_over, tc, given, notes.append)
    memory.cap_onednn_caches()  # before the first bf16 matmul
    if resume and given is not None and "device" not in given:  # not given anew: where the run ran
        tc = tc.replace(device=saved_device(Path(tc.out)) or tc.device)
    d = setup_distributed(tc.device)
    if not resume and tc.precision == "fp16" and d.device.type != "cuda":  # before the data is prepared (minutes)
        raise AiaynError("--precision fp16 needs a CUDA device; use bf16 or fp32 on the CPU")
    info = (lambda msg: _said(log, msg)) if d.main else (lambda msg: None)
    for msg in notes:
        info(msg)
    with RunLock(Path(tc.out), d.main) as lock:  # one `train` at a time in --out
        d.agree(lock.take)  # before tidy_out, which puts right what a dead process left there
        d.agree(lambda: tidy_out(Path(tc.out), resume, d))
        with removed_if_left_empty(Path(tc.out), d.local == 0):  # a refusal found below leaves no empty --out
            existing = d.agree(lambda: open_run_dir(Path(tc.out), resume, d))
            d.agree(lock.take)  # a new --out, made just now
            # Rank 0 decides what the run resumes from and sends it to every rank: the machines may not share
            # --out, and only rank 0 writes checkpoints (DDP then copies rank 0's weights at start-up anyway).
            loaded = d.from_main(lambda: load_newest(existing, info) if resume and existing else None)
            if loaded:
                preset_name, tc = resumed_settings(loaded, preset_name, model_over, tc, given)
                info(f"resuming from {loaded.path}")
            elif resume:
                info(f"nothing to resume in {tc.out}; starting a new run")
                preset_name, model_over, tc, given = _main_settings(d, preset_name, model_over, tc, given)
                preset_name, tc, init = _start(preset_name, model_over, tc, given, info)
            if resume:
                tc.check_cooldown()  # on the settings the run continues with (a fresh run was checked above)
                check_patience(tc)
            tc = with_update_freq(_absolute_data_paths(tc), d.world, given is not None and "update_freq" in given)
            if tc.threads:
                torch.set_num_threads(tc.threads)
            run = _set_up(preset_name, model_over, tc, loaded, init, d, info)
        if not loaded:
            _warn_default_pair(tc, preset_name, given, info)
        with Stopper() as stopper:
            bar = _progress(_total_steps(run), run.trainer.step, d.main)
            run.t0 = time.time()
            run.window = (0, run.t0)
            _stop_if_done(run)  # a resumed run that already met a limit takes no step
            try:  # out of GPU memory: one line naming --max-tokens, below the closed progress bar
                with memory.batch_fits(tc.max_tokens, d.device):
                    while not run.stop_reason:
                        _train_epoch(run, stopper, bar)
            finally:
                bar.close()
    interrupted = _left_to_resume(run)
    summary = {"step": run.trainer.step, "epoch": run.epoch, "best_bleu": run.best_bleu if run.best_bleu >= 0 else None,
               "stop": run.stop_reason, "checkpoint": str(run.last_saved) if run.last_saved else None,
               "elapsed_s": run.seconds(), "signal": stopper.signum if interrupted else None}
    skipped = f" ({run.trainer.skipped} fp16 updates skipped for overflow)" if run.trainer.skipped else ""
    info(f"stopped: {run.stop_reason}; step {run.trainer.step}{skipped}; last checkpoint {run.last_saved}")
    if interrupted:  # (on every rank: a signal to another rank stops this one too)
        info(f"to resume, run: {resume_command(run.out, d.world)}")
    if d.world > 1:
        dist.destroy_process_group()
    return summary


def _main_settings(d: Dist, preset_name: str, model_over: dict[str, Any], tc: TrainConfig,
                   given: Collection[str] | None) -> tuple[str, dict[str, Any], TrainConfig, Collection[str] | None]:
    """Rank 0's settings on every rank, for a --resume with nothing to resume from: rank 0 took them from
    --out's train.json (`train_options._recorded_settings`), which machines that share no --out lack, and they began
    from the defaults (another model, no data). Each keeps its own --out, device and options it was given."""
    if d.world == 1:
        return preset_name, model_over, tc, given
    main_preset, main_model, main_tc, main_given = d.from_main(lambda: (preset_name, model_over, tc, given))
    if given is None or main_given is None:  # a library call: every option was given
        return preset_name, model_over, tc, given
    own = set(given) | {"out", "device"}
    tc = main_tc.replace(**{k: getattr(tc, k) for k in own & set(tc.to_dict())})
    return (preset_name if "preset" in given else main_preset), {**main_model, **model_over}, tc, {*main_given, *given}


# the data paths a run records, which it reads again on --resume (the text is checked against its prepared copy)
_DATA_PATHS = tuple(k for k in PATH_FIELDS if k not in ("init_from", "out"))


def _absolute_data_paths(tc: TrainConfig) -> TrainConfig:
    """The data paths made absolute before the run records them: recorded as typed, relative to the
    folder the run started in, `aiayn train --out DIR --resume` from any other failed on a
    "--train-src ...: no such file" it was not given. A --data-dir's "~" is expanded first, as its
    reader expands it."""
    def absolute(k: str, v: str) -> str:
        return os.path.abspath(os.path.expanduser(v) if k == "data_dir" else v)

    return tc.replace(**{k: absolute(k, getattr(tc, k)) for k in _DATA_PATHS if getattr(tc, k)})


def _stop_if_done(run: Run) -> None:
    """The loop checks its limits after a step; a resumed run that already met one must take none
    (else resuming a finished run trains, saves and logs one step past --max-steps)."""
    run.stop_reason = _limit_met(run, bool(run.tc.max_minutes) and run.elapsed >= 60 * run.tc.max_minutes)


def _limit_met(run: Run, out_of_time: bool) -> str:
    """The limit the run has met, "" if none: a resume of it would take no step."""
    tc = run.tc
    if tc.max_steps and run.trainer.step >= tc.max_steps:
        return f"reached --max-steps {tc.max_steps}"
    if out_of_time:
        return f"reached --max-minutes {tc.max_minutes}"
    if tc.patience and run.bad_epochs >= tc.patience:
        return f"no better validation BLEU for {tc.patience} epochs (--patience)"
    if tc.max_epochs and run.epoch > tc.max_epochs:
        return f"reached --max-epochs {tc.max_epochs}"
    return ""


def _left_to_resume(run: Run) -> bool:
    """Whether a run stopped by a signal has work left. One that came as the run ended (its last
    epoch's last step, its final validation) stopped a finished run: its stop is the limit met, not
    the signal, and a hint to resume would resume nothing."""
    if not run.stop_reason.startswith("interrupted"):
        return False
    tc = run.tc
    out_of_time, = run.d.any(bool(tc.max_minutes) and run.seconds() >= 60 * tc.max_minutes)  # the ranks agree
    run.stop_reason = _limit_met(run, out_of_time) or run.stop_reason
    return run.stop_reason.startswith("interrupted")


def _train_epoch(run: Run, stopper: Stopper, bar: Any) -> None:
    """This rank's batches of the current epoch from `run.pos` on, until the epoch ends or a limit
    is met; a complete epoch is closed by `_end_epoch`."""
    tc, trainer, d = run.tc, run.trainer, run.d
    mine = rank_batches(run.corpus.plan, tc.seed, run.epoch, d.rank, d.world, tc.update_freq)
    source_eos = run.model.cfg.source_eos
    groups = (mine[p : p + tc.update_freq] for p in range(run.pos, len(mine), tc.update_freq))
    feed = Prefetch(([run.corpus.train.collate(idx, tc.max_len, source_eos) for idx in g] for g in groups),
                    pin=d.device.type == "cuda")
    try:
        _take_steps(run, stopper, bar, mine, feed)
    finally:
        feed.close()
    if run.pos >= len(mine):
        _end_epoch(run, bar)
        # time may run out while validating: stop with the model just scored, not one step after it
        run.stop_reason = run.stop_reason or _stop_reason_after_step(run, stopper)


def _take_steps(run: Run, stopper: Stopper, bar: Any, mine: Batches, feed: Prefetch) -> None:
    """Steps on the prefetched batch groups of the epoch until it ends or a limit is met."""
    tc, trainer, d = run.tc, run.trainer, run.d
    while run.pos < len(mine) and not run.stop_reason:
        batches = next(feed)
        loss, ntok = trainer.train_step(batches)
        run.pos += len(batches)
        run.tokens_seen += ntok
        now, (window_tokens, window_t) = time.time(), run.window
        window_tokens += ntok
        tps = window_tokens / max(now - window_t, 1e-9)
        run.window = (0, now) if now - window_t > 10 else (window_tokens, window_t)
        if trainer.applied:
            bar.update(1)
        elif d.main and trainer.scaler:
            bar.write(f"step {trainer.step + 1}: fp16 gradients overflowed, update skipped (loss scale now "
                      f"{trainer.scaler.get_scale():g}; {trainer.skipped} skipped in all)", file=LogStream(sys.stdout))
        bar.set_postfix(epoch=run.epoch, loss=f"{loss:.3f}", lr=f"{trainer.lr(trainer.step):.2e}",
                        tok_s=f"{tps:,.0f}", refresh=False)
        if tc.log_every and trainer.applied and trainer.step % tc.log_every == 0:
            skipped = {"skipped": trainer.skipped} if trainer.scaler else {}  # fp16 updates skipped so far
            run.metrics.write({"kind": "train", "step": trainer.step, "epoch": run.epoch, "loss": round(loss, 5),
                               "lr": trainer.lr(trainer.step), "tokens_per_s": round(tps, 1),
                               "elapsed_s": round(run.seconds(), 2), **skipped})
        if not math.isfinite(loss):
            raise _diverged(run, loss)
        run.stop_reason = _stop_reason_after_step(run, stopper)
        periodic = trainer.applied and tc.save_every and trainer.step % tc.save_every == 0
        if run.pos < len(mine) and (run.stop_reason or periodic):
            # a run stopped by a limit ends with the model it translates with: score that one too
            run.save(best=run.stop_reason.startswith("reached") and _validate(run, bar, epoch_end=False))


def _diverged(run: Run, loss: float) -> AiaynError:
    """What to do once the loss is not finite: --resume keeps the run's own --lr-factor and precision,
    so the way on is a new --out, from scratch or from an earlier checkpoint's weights."""
    fp32 = "" if run.trainer.precision == "fp32" else " (or --precision fp32)"
    return AiaynError(f"the loss became {loss} at step {run.trainer.step}; train with a lower --lr-factor{fp32} in a new "
                      f"--out, from scratch or from an earlier checkpoint of this run with --init-from "
                      f"{run.out / 'step_N'} (not --resume, which keeps the run's settings)")


def _stop_reason_after_step(run: Run, stopper: Stopper) -> str:
    """Why to stop after this step ("" to go on); every rank takes the same decision."""
    tc, d, signum = run.tc, run.d, stopper.signum
    out_of_time = bool(tc.max_minutes) and run.seconds() >= 60 * tc.max_minutes
    signalled, out_of_time = d.any(signum is not None, out_of_time)  # one all-reduce: a host read on a GPU
    if tc.max_steps and run.trainer.step >= tc.max_steps:  # the last step, signal or not: it is validated (and
        return f"reached --max-steps {tc.max_steps}"      # best/ kept) as ever, since a resume takes no step
    if signalled:
        return f"interrupted by {signal.Signals(signum).name if signum else 'a signal'}"
    if out_of_time:
        return f"reached --max-minutes {tc.max_minutes}"
    return ""


def _validate(run: Run, bar: Any, epoch_end: bool = True) -> bool:
    """Validates (rank 0), logs a `valid` line and keeps the best BLEU; True if it improved
    (every rank gets the answer). At an epoch end it also counts epochs without one (--patience)."""
    d, improved = run.d, False
    if d.main:
        v = validate(run.model, run.corpus, run.tc, run.trainer.autocast, d.device)
        if "bleu" in v:
            improved = v["bleu"] > run.best_bleu
            if epoch_end:
                run.bad_epochs = 0 if improved else run.bad_epochs + 1
            run.best_bleu = max(run.best_bleu, v["bleu"])
        run.metrics.write({"kind": "valid", "step": run.trainer.step, "epoch": run.epoch,
                           **{k: round(x, 4) for k, x in v.items()}, "elapsed_s": round(run.seconds(), 2)})
        bar.write(f"epoch {run.epoch} step {run.trainer.step}: " + ", ".join(
            f"valid {k} {x:.2f}" if k in ("bleu", "bleu_lc", "chrf") else f"valid {k} {x:.3f}" for k, x in v.items()),
            file=LogStream(sys.stdout))
    if d.world > 1:
        flags = torch.tensor([float(improved), float(run.bad_epochs), run.best_bleu], dtype=torch.float64,
                             device=d.device)
        dist.broadcast(flags, 0)
        improved, run.bad_epochs, run.best_bleu = bool(flags[0]), int(flags[1]), float(flags[2])
    return improved


def _end_epoch(run: Run, bar: Any) -> None:
    """The epoch is complete: validate, keep the best, count patience, save, move on."""
    tc = run.tc
    improved = _validate(run, bar)
    if tc.patience and run.bad_epochs >= tc.patience and not run.stop_reason:
        run.stop_reason = f"no better validation BLEU for {tc.patience} epochs (--patience)"
    run.epoch, run.pos = run.epoch + 1, 0
    run.save(best=improved)
    if tc.max_epochs and run.epoch > tc.max_epochs and not run.stop_reason:
        run.stop_reason = f"reached --max-epochs {tc.max_epochs}"


def _progress(total: int | None, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, mininterval=1.0,
                file=LogStream(sys.stderr))


def _said(log: Log, msg: str) -> None:
    """One line of the run's log (print: standard output), as `LogStream` writes."""
    unless_reader_gone(sys.stdout, log, msg)


def run(args: argparse.Namespace) -> int:
    name, model_over, tc = build_configs(args)
    summary = train(name, model_over, tc, resume=args.resume, given=given_options(args))
    if summary["signal"] is not None:
        return 128 + int(summary["signal"])
    return 0
