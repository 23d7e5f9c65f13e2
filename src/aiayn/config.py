"""Frozen configuration dataclasses with the paper's defaults (Vaswani et al., 2017, Table 3).

A config is plain data: it round-trips through JSON (`to_dict` / `from_dict`) so that a checkpoint
directory describes the model it holds. Presets: `tiny` (tests), `small`, `base` and `big`.
The learning-rate schedule (Section 5.3) is here too: a formula of the config's numbers that the
trainer and the plots share.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, TypeVar

from aiayn.errors import AiaynError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(AiaynError, ValueError):
    """A configuration value that cannot work; the message names the field."""


def _from_dict(cls: type[T], data: dict[str, Any]) -> T:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{cls.__name__}: unknown field(s) {', '.join(unknown)}")
    return cls(**data)


ACTIVATIONS = ("relu", "gelu", "swish")  # of the feed-forward network; swish is SiLU
MAX_POSITIONS_LIMIT = 100_000  # a sinusoid table of max_positions x d_model floats is built up front

MAX_LAYERS = 1_000  # per stack; each layer is built up front, one by one (~6 ms each even on the meta device)

_KINDS = {bool: "true or false", int: "a whole number", float: "a finite number", str: "a string"}


def _finite(v: int | float) -> bool:
    """Whether `v` is a finite float; an int past float's range (a config file's 400 digits) is not."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _type_errors(obj: Any) -> Iterator[tuple[str, str]]:
    """(field, what it must be) for every field whose value is not of its annotated type (a config
    file can hold anything): an int field a whole number (not a bool), a float field a finite
    number, a bool field a bool, a str field a string; `X | None` fields may also be None."""
    for name, kind in typing.get_type_hints(type(obj)).items():
        v = getattr(obj, name)
        args = typing.get_args(kind)
        if type(None) in args:
            if v is None:
                continue
            kind = next(a for a in args if a is not type(None))
        if kind is bool:
            ok = isinstance(v, bool)
        elif kind is int:
            ok = isinstance(v, int) and not isinstance(v, bool)
        elif kind is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)
        elif kind is str:
            ok = isinstance(v, str)
        else:
            continue
        if not ok:
            yield name, _KINDS[kind]


def _past_64_bits(obj: Any) -> Iterator[str]:
    """Int fields that no 64-bit number holds: checked after each field's own bounds, for those with
    none (a config file's 400 digits for --max-steps overflowed tqdm's float arithmetic)."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, int) and not -(2**63) <= v < 2**64:
            yield f.name


@dataclass(frozen=True)
class ModelConfig:
    """The encoder-decoder Transformer's shape (Section 3).

    `share_embeddings` ties the source and target embeddings (needs a joint vocabulary);
    `tie_output` ties the pre-softmax projection to the target embedding (Section 3.4).
    """

    src_vocab_size: int = 8000
    tgt_vocab_size: int = 8000
    d_model: int = 512
    n_heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1  # residual and embedding dropout, P_drop (Section 5.4)
    attention_dropout: float = 0.0  # on attention weights; not in the paper, off by default
    activation_dropout: float = 0.0  # inside the feed-forward network; not in the paper, off by default
    activation: str = "relu"  # "relu" (the paper), "gelu" or "swish" (x * sigmoid(x), Marian's)
    norm_first: bool = False  # False: post-norm as in the paper; True: pre-norm
    share_embeddings: bool = True
    tie_output: bool = True
    max_positions: int = 1024  # positional table size; it grows if a longer input comes
    pad_id: int = 0  # tokenizer.PAD_ID; config stands below tokenizer, so tests/test_layout.py pins the two equal
    layer_norm_eps: float = 1e-5
    # The source ends with EOS, as fairseq and Marian (and every Hugging Face pipeline) feed it. A
    # config without this field is from a model trained on bare sources: `from_dict` gives it False.
    source_eos: bool = True
    # Two variations of Marian (OPUS-MT) models, for `aiayn import`: embeddings not scaled by
    # sqrt(d_model), and a bias on the pre-softmax projection (Marian's final_logits_bias).
    scale_embedding: bool = True
    output_bias: bool = False

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"ModelConfig: {msg}")

        for name, kind in _type_errors(self):
            need(False, f"{name} must be {kind}, got {getattr(self, name)!r}")
        for name in ("src_vocab_size", "tgt_vocab_size", "d_model", "n_heads", "d_ff", "max_positions"):
            need(int(getattr(self, name)) > 0, f"{name} must be positive, got {getattr(self, name)}")
        need(self.max_positions <= MAX_POSITIONS_LIMIT,
             f"max_positions must be at most {MAX_POSITIONS_LIMIT:,} (the table grows by itself for longer "
             f"inputs), got {self.max_positions}")
        for name in ("encoder_layers", "decoder_layers"):
            need(1 <= getattr(self, name) <= MAX_LAYERS,
                 f"{name} must be between 1 and {MAX_LAYERS:,}, got {getattr(self, name)}")
        need(self.d_model % self.n_heads == 0, f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        need(self.d_model % 2 == 0, f"d_model must be even for the sinusoidal encoding, got {self.d_model}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            need(0.0 <= getattr(self, name) < 1.0, f"{name} must be in [0, 1), got {getattr(self, name)}")
        need(self.layer_norm_eps > 0, f"layer_norm_eps must be positive, got {self.layer_norm_eps}")  # else NaN
        need(self.activation in ACTIVATIONS, f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        need(
            not self.share_embeddings or self.src_vocab_size == self.tgt_vocab_size,
            "share_embeddings needs a joint vocabulary (src_vocab_size == tgt_vocab_size)",
        )
        need(0 <= self.pad_id < min(self.src_vocab_size, self.tgt_vocab_size), f"pad_id {self.pad_id} outside vocabulary")
        for name in _past_64_bits(self):
            need(False, f"{name} must be a whole number that fits in 64 bits, got {getattr(self, name)}")

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelConfig":
        """A recorded config (a checkpoint's config.json). Every field the first checkpoints held must be
        there: a default would build another model without a word (a 2-head model lost its "n_heads" and
        loaded with 8, weights of the same shapes, translating nonsense). Fields added since take the
        value that rebuilds a model written before them."""
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data and f.name not in _ADDED_LATER]
        if missing and not set(data) - {f.name for f in dataclasses.fields(cls)}:  # (unknown fields: said first)
            raise ConfigError(f"ModelConfig: {', '.join(missing)} not recorded; the checkpoint does not say its "
                              "shape: restore its config.json (or add the value it was trained with)")
        return _from_dict(cls, {**_ADDED_LATER, **data})


# ModelConfig fields newer than the checkpoint format, with the value a checkpoint without them was
# trained with: bare sources (no EOS), embeddings scaled by sqrt(d_model), no output bias.
_ADDED_LATER: dict[str, Any] = {"source_eos": False, "scale_embedding": True, "output_bias": False}


# Table 3 of the paper: base and big; small and tiny are sizes that train on a laptop CPU.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=32, n_heads=4, encoder_layers=2, decoder_layers=2, d_ff=64, dropout=0.0),
    "small": dict(d_model=256, n_heads=4, encoder_layers=3, decoder_layers=3, d_ff=1024, dropout=0.1),
    "base": dict(d_model=512, n_heads=8, encoder_layers=6, decoder_layers=6, d_ff=2048, dropout=0.1),
    "big": dict(d_model=1024, n_heads=16, encoder_layers=6, decoder_layers=6, d_ff=4096, dropout=0.3),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """A ModelConfig from a named preset, with field overrides (for example the vocabulary sizes)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig(**{**PRESETS[name], **overrides})


def learning_rate(step: int, d_model: int, warmup: int, factor: float = 1.0, cooldown: int = 0,
                  max_steps: int = 0) -> float:
    """Section 5.3: linear warm-up for `warmup` steps, then decay with the inverse square root.

    With `cooldown` = N > 0 the last N steps up to `max_steps` also ramp the rate linearly down, to
    1/N of the schedule on the last step (0 after it): a run with a fixed budget of steps ends on a
    low rate instead of mid-schedule.
    """
    step = max(step, 1)
    lr = factor * d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    if cooldown:
        lr *= min(1.0, max(max_steps + 1 - step, 0) / cooldown)
    return lr


PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # training: autocast dtypes (`TrainConfig.precision`)
INFERENCE_PRECISIONS = ("fp32", "bf16", "int8")  # search: the weights' dtype (`Translator`, `CT2Translator`)


# TrainConfig's file and directory names
PATH_FIELDS = ("data_dir", "train_src", "train_tgt", "valid_src", "valid_tgt", "data_bin", "init_from", "out")


@dataclass(frozen=True)
class TrainConfig:
    """Data, tokenizer, batching, the paper's recipe (Section 5) and the loop's limits.

    Learning rate (Section 5.3): lr = lr_factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5),
    times a linear ramp down over the last `cooldown` steps up to `max_steps` (off by default).
    A zero limit (max_epochs, max_steps, max_minutes, patience, save_every, clip_norm, valid_bleu,
    threads) means "off". The messages name the command-line flag of each field.
    """

    # data: a named corpus (multi30k + languages) or four files
    data: str | None = None
    src: str = "de"
    tgt: str = "en"
    data_dir: str | None = None
    train_src: str | None = None
    train_tgt: str | None = None
    valid_src: str | None = None
    valid_tgt: str | None = None
    data_bin: str | None = None  # a directory written by `aiayn prepare` (instead of the above)
    init_from: str | None = None  # fine-tuning: a checkpoint whose weights, tokenizer and shape the run starts from
    # tokenizer
    vocab_size: int = 8000
    joint_vocab: bool = True
    spm_model_type: str = "bpe"
    # batching
    max_tokens: int = 4096  # per batch, padding counted
    max_len: int = 256  # subword tokens per side; longer pairs are skipped or truncated
    long: str = "skip"
    update_freq: int = 1  # batches accumulated per optimizer step
    tokens_per_update: int = 0  # padded positions per step over all processes; sets update_freq (0: off)
    # the recipe
    lr_factor: float = 1.0
    warmup: int = 4000
    cooldown: int = 0  # last steps up to max_steps on a linear ramp down (0: the paper's schedule)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-9
    label_smoothing: float = 0.1
    clip_norm: float = 0.0
    precision: str = "auto"  # auto: bf16 on a CPU with oneDNN bf16 kernels, else fp32; bf16 (fp16 + scaler) on CUDA
    device: str = "auto"
    compile: bool = False  # torch.compile each encoder/decoder layer (`trainer.compile_layers`)
    # the loop
    max_epochs: int = 30
    max_steps: int = 0
    max_minutes: float = 0.0
    patience: int = 0  # epochs without a better validation BLEU before stopping
    keep_last: int = 5
    save_every: int = 1000  # steps; a checkpoint is also written at the end of each epoch
    valid_bleu: int = 1000  # validation sentences translated (greedy) for BLEU each epoch and at a mid-epoch stop
    log_every: int = 50  # steps between train lines in metrics.jsonl
    seed: int = 1
    out: str = "runs/train"
    threads: int = 0

    def __post_init__(self) -> None:
        def need(cond: bool, field: str, msg: str) -> None:
            if not cond:
                flag = "--" + field.replace("_", "-")
                raise ConfigError(f"{flag} {msg}, got {getattr(self, field)!r}")

        for name, kind in _type_errors(self):
            need(False, name, f"must be {kind}")
        # "" was taken for a flag not given (or for "."): `--init-from "$BASE"` with BASE unset trained
        # from scratch, an empty --valid-src without validation
        for name in PATH_FIELDS:
            need(getattr(self, name) != "", name, "is an empty name (an unset shell variable?); give a path or leave it out")
        # a run records them as its language pair, which `serve` needs (it refused an empty one only once
        # the run had trained) and announces, and --split-sentences splits by
        for name in ("src", "tgt"):
            code = getattr(self, name)
            need(code != "" and not any(c.isspace() or not c.isprintable() for c in code), name,
                 "must be a language code such as de or pt-BR (any code, without spaces)")
        need(16 <= self.vocab_size <= 1_000_000, "vocab_size", "must be between 16 and 1,000,000")
        need(self.spm_model_type in ("bpe", "unigram"), "spm_model_type", "must be 'bpe' or 'unigram'")
        need(self.max_tokens >= 2, "max_tokens", "must be at least 2 (tokens per batch, padding counted)")
        need(self.max_len >= 1, "max_len", "must be at least 1")
        need(self.long in ("skip", "truncate"), "long", "must be 'skip' or 'truncate'")
        need(self.update_freq >= 1, "update_freq", "must be at least 1")
        need(self.tokens_per_update >= 0, "tokens_per_update", "must be 0 (off) or positive")
        need(self.lr_factor > 0, "lr_factor", "must be positive")
        need(self.warmup >= 1, "warmup", "must be a positive number of steps")
        need(self.warmup <= 10**12, "warmup", "must be at most 10^12 steps")
        need(0.0 <= self.adam_beta1 < 1.0, "adam_beta1", "must be in [0, 1)")
        need(0.0 <= self.adam_beta2 < 1.0, "adam_beta2", "must be in [0, 1)")
        need(self.adam_eps > 0, "adam_eps", "must be positive")
        need(0.0 <= self.label_smoothing < 1.0, "label_smoothing", "must be in [0, 1)")
        need(self.clip_norm >= 0, "clip_norm", "must be 0 (off) or positive")
        need(self.precision != "int8", "precision", "int8 is for decoding only (translate, evaluate, serve); train "
             f"in one of {', '.join(PRECISIONS)}")
        need(self.precision in PRECISIONS, "precision", f"must be one of {', '.join(PRECISIONS)}")
        need(self.device in ("auto", "cpu") or re.fullmatch(r"cuda(:(0|[1-9][0-9]*))?", self.device) is not None,
             "device", "must be auto, cpu or cuda[:N]")  # torch.device("cuda:x") is a RuntimeError traceback
        for name in ("max_epochs", "max_steps", "patience", "save_every", "valid_bleu", "log_every", "threads"):
            need(getattr(self, name) >= 0, name, "must be 0 (off) or positive")
        need(self.max_minutes >= 0, "max_minutes", "must be 0 (off) or positive")
        need(self.cooldown >= 0, "cooldown", "must be 0 (off) or a positive number of steps")
        need(self.keep_last >= 1, "keep_last", "must be at least 1")
        need(-(2**63) <= self.seed < 2**64, "seed", "must fit in 64 bits")
        need(self.threads <= 4096, "threads", "must be at most 4096")
        for name in _past_64_bits(self):
            need(False, name, "must be a whole number that fits in 64 bits")

    def check_cooldown(self) -> None:
        """The ramp needs a step budget to end at; checked on the final settings (a resumed run
        takes --max-steps from its checkpoint when only --cooldown is given anew)."""
        if self.cooldown > self.max_steps:
            raise ConfigError(f"--cooldown {self.cooldown} needs --max-steps of at least as many steps (the ramp "
                              f"ends there); --max-steps is {self.max_steps}")

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        return _from_dict(cls, data)
