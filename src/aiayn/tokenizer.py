"""Subword tokenization with SentencePiece (the paper's byte-pair encoding, Section 5.1).

The paper uses a shared source-target BPE vocabulary of about 37,000 tokens for English-German,
which is what lets the two embedding matrices and the pre-softmax projection share one weight
matrix (Section 3.4). `build_tokenizers` trains such a joint model by default (BPE, or unigram as
an option) from the training text, in memory, and caches it under a key made from the data and the
settings.

Choices, and what they guarantee:
- Fixed ids: pad 0, unk 1, bos 2, eos 3, so a model and its tokenizer agree without lookups.
- `byte_fallback`: a character never seen in training is spelled as UTF-8 byte pieces instead of
  <unk>, so any text can be encoded and decoded back.
- `normalization_rule_name="identity"`: no Unicode normalization (NFKC would turn "ﬁ" into "fi"
  and full-width forms into ASCII, so decoded output would differ from the reference text).
  SentencePiece still removes leading and trailing spaces and collapses repeated spaces.
  Round-trip guarantee: decode(encode(t)) == t for any text without leading, trailing or
  repeated U+0020 spaces and without U+2581 ("▁", SentencePiece's own space marker).
- `hard_vocab_limit=False`: `vocab_size` is an upper bound; a small corpus gets a smaller
  vocabulary instead of an error (read the actual size from `Tokenizer.vocab_size`).
- A fixed count of training threads (`SPM_THREADS`, 16, not the machine's cores): BPE's merges and
  the model file depend on the count, so a fixed one makes the model bytes (and `sha256()`)
  identical on every machine for the same data and settings.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import sentencepiece as spm

from aiayn.errors import AiaynError, first_line
from aiayn.files import atomic_write_bytes, default_cache_dir, file_sha256, read_lines

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
PIECES = {PAD_ID: "<pad>", UNK_ID: "<unk>", BOS_ID: "<s>", EOS_ID: "</s>"}  # their fixed piece names
MODEL_TYPES = ("bpe", "unigram")
JOINT_FILE, SRC_FILE, TGT_FILE = "spm.model", "src.spm.model", "tgt.spm.model"
_CACHE_VERSION = 2  # bump when the training options below change, so stale cache entries are not reused
SPM_THREADS = 16  # SentencePiece training threads: a constant, since the model depends on it


def _trainer_options(vocab_size: int, model_type: str) -> dict[str, Any]:
    return dict(
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_piece=PIECES[PAD_ID],
        unk_piece=PIECES[UNK_ID],
        bos_piece=PIECES[BOS_ID],
        eos_piece=PIECES[EOS_ID],
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=True,
        hard_vocab_limit=False,
        input_sentence_size=0,  # use every sentence: sampling would make the model depend on a seed
        # Threads change the merges SentencePiece picks (BPE: each count gives another model), so the
        # count is fixed, not the machine's: every machine trains the same model, on all its cores up to 16.
        num_threads=SPM_THREADS,
        minloglevel=2,  # SentencePiece logs every step to stderr otherwise
    )


class Tokenizer:
    """One SentencePiece model with the fixed special ids (pad 0, unk 1, bos 2, eos 3)."""

    def __init__(self, model_bytes: bytes, source: str = "<memory>") -> None:
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        except (RuntimeError, OSError, TypeError) as e:
            raise AiaynError(f"{source}: not a SentencePiece model ({first_line(e)}); retrain it or use the checkpoint's own") from None
        got = (self._sp.pad_id(), self._sp.unk_id(), self._sp.bos_id(), self._sp.eos_id())
        if got != (PAD_ID, UNK_ID, BOS_ID, EOS_ID):
            raise AiaynError(
                f"{source}: special ids pad/unk/bos/eos are {got}, aiayn needs {(PAD_ID, UNK_ID, BOS_ID, EOS_ID)}; "
                "train the tokenizer with aiayn"
            )
        self._bytes = bytes(model_bytes)

    @classmethod
    def train(cls, lines: Iterable[str], vocab_size: int, model_type: str = "bpe") -> "Tokenizer":
        """Train on `lines` in memory (no files written). `vocab_size` is an upper bound."""
        if model_type not in MODEL_TYPES:
            raise AiaynError(f"unknown tokenizer model type {model_type!r}; choose one of {', '.join(MODEL_TYPES)}")
        if int(vocab_size) <= 0:
            raise AiaynError(f"--vocab-size must be positive, got {vocab_size}")
        sentences = [s for s in lines if s.strip()]
        if not sentences:
            raise AiaynError("cannot train a tokenizer on empty text")
        buf = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_writer=buf, **_trainer_options(int(vocab_size), model_type)
            )
        except RuntimeError as e:
            m = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", str(e))
            if m:
                raise AiaynError(
                    f"--vocab-size {m.group(1)} is too small for this text: it needs at least {m.group(2)} "
                    "(4 special ids, 256 byte pieces and every distinct character); raise --vocab-size"
                ) from None
            if "!sentences_.empty()" in str(e):  # SentencePiece skips lines over max_sentence_length (4192 bytes)
                raise AiaynError("cannot train a tokenizer: every line is longer than SentencePiece's limit of 4192 "
                                 "bytes; split the text into sentences, one a line") from None
            raise AiaynError(f"SentencePiece training failed: {first_line(e)}") from None
        return cls(buf.getvalue())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        path = Path(path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise AiaynError(f"{path}: tokenizer model not found") from None
        except OSError as e:
            raise AiaynError(f"{path}: cannot read tokenizer model ({e.strerror or e})") from None
        if not data:
            raise AiaynError(f"{path}: tokenizer model is empty (an interrupted write?); retrain it")
        return cls(data, source=str(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        atomic_write_bytes(path, self._bytes)

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def model_type(self) -> str:
        return {1: "unigram", 2: "bpe", 3: "word", 4: "char"}.get(self._trainer_spec_model_type(), "unknown")

    def _trainer_spec_model_type(self) -> int:
        # ModelProto field 2 is the TrainerSpec, whose field 3 is model_type (sentencepiece_model.proto);
        # read it by hand rather than depend on protobuf for one label.
        spec = _proto_field(self._bytes, 2)
        value = _proto_field(spec, 3) if isinstance(spec, bytes) else None
        return value if isinstance(value, int) else 0

    def encode(self, text: str) -> list[int]:
        """Subword ids of `text`, without BOS/EOS."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        parts = [self.language_code(t) for t in texts]  # (code, rest)
        try:
            ids = self._sp.encode([rest for _, rest in parts], out_type=int)
        except TypeError:  # SentencePiece's "List elements must be str or bytes", for a lone surrogate too
            _check_encodable([rest for _, rest in parts])
            raise
        return [([self.language_codes.get(code, UNK_ID)] if code else []) + self._looked_up(rest, list(row))
                for (code, rest), row in zip(parts, ids, strict=True)]

    def language_code(self, text: str) -> tuple[str, str]:
        """(code, rest): the target-language token that a multilingual model's source starts with
        (">>fr<< Ein Mann ..."), split off as MarianTokenizer does, up to the first "<<", to be one
        token (<unk> if the vocabulary lacks it); ("", text) where there is none, or where the
        vocabulary holds no such tokens (a model of one target language reads ">>" as text)."""
        end = text.find("<<") if text.startswith(">>") else -1
        if end < 0 or not self.language_codes:
            return "", text
        return text[:end + 2], text[end + 2:]

    @cached_property
    def language_codes(self) -> dict[str, int]:
        """The vocabulary's target-language tokens (">>fr<<": an imported multilingual model's), by piece."""
        return {p: i for i in range(self.vocab_size) if (p := self.id_to_piece(i)).startswith(">>") and p.endswith("<<")}

    def _looked_up(self, text: str, ids: list[int]) -> list[int]:
        """`ids` with each unknown piece looked up by its text, as MarianTokenizer does: an imported
        model's vocabulary holds characters (and runs of them) that its SentencePiece model lacks,
        as pieces it never produces (`aiayn.importer.rewrite_spm`). Our own models spell unknown
        characters in bytes, so they never get here."""
        if UNK_ID not in ids:
            return ids
        pieces = self._sp.encode(text, out_type=str)
        return [int(self._sp.piece_to_id(p)) if i == UNK_ID else i for i, p in zip(ids, pieces, strict=True)]

    def decode(self, ids: Iterable[int] | Any) -> str:
        """Text of `ids` (a list or a 1-D tensor); the special ids (pad, unk, bos, eos) are dropped
        wherever they are, as transformers' `skip_special_tokens` does (SentencePiece would spell
        <unk> " ⁇ ", which an imported model's translations then had and `generate`'s had not)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        n = self.vocab_size
        keep = [int(i) for i in ids if int(i) not in PIECES]
        bad = [i for i in keep if not 0 <= i < n]
        if bad:
            raise AiaynError(f"token id {bad[0]} is outside the tokenizer's vocabulary of {n}; model and tokenizer do not match")
        return str(self._sp.decode(keep))

    def id_to_piece(self, i: int) -> str:
        return str(self._sp.id_to_piece(int(i)))

    def sha256(self) -> str:
        return hashlib.sha256(self._bytes).hexdigest()

    def to_bytes(self) -> bytes:
        """The serialized SentencePiece model: what `prepare` hands its worker processes."""
        return self._bytes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Tokenizer) and other._bytes == self._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, sha256={self.sha256()[:12]})"


def vocabulary(tok: Tokenizer) -> list[str]:
    """The pieces of a tokenizer in id order (id i -> piece i); special pieces have fixed names."""
    pieces = [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    for i, name in PIECES.items():
        if pieces[i] != name:
            raise AiaynError(f"tokenizer piece {i} is {pieces[i]!r}, expected {name!r}; train the tokenizer with aiayn")
    if len(set(pieces)) != len(pieces):
        raise AiaynError("the tokenizer has duplicate pieces; it cannot be mapped to a vocabulary file")
    return pieces


@dataclass
class TokenizerPair:
    """Source and target tokenizers; with `joint`, both are the same model (a shared vocabulary)."""

    src: Tokenizer
    tgt: Tokenizer
    joint: bool

    def __post_init__(self) -> None:
        if self.joint and self.src != self.tgt:
            raise AiaynError("a joint TokenizerPair needs the same model on both sides")

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write `spm.model` (joint) or `src.spm.model` and `tgt.spm.model` into `directory`."""
        d = Path(directory)
        if self.joint:
            self.src.save(d / JOINT_FILE)
        else:
            self.src.save(d / SRC_FILE)
            self.tgt.save(d / TGT_FILE)

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> "TokenizerPair":
        d = Path(directory)
        if (d / JOINT_FILE).is_file():
            tok = Tokenizer.load(d / JOINT_FILE)
            return cls(tok, tok, joint=True)
        if (d / SRC_FILE).is_file() or (d / TGT_FILE).is_file():
            return cls(Tokenizer.load(d / SRC_FILE), Tokenizer.load(d / TGT_FILE), joint=False)
        raise AiaynError(f"{d}: no tokenizer found (expected {JOINT_FILE}, or {SRC_FILE} and {TGT_FILE})")

    def describe(self) -> dict[str, Any]:
        """Plain data for a checkpoint's config.json: sizes, type and fingerprints."""
        return {
            "joint": self.joint,
            "model_type": self.src.model_type,
            "src_vocab_size": self.src.vocab_size,
            "tgt_vocab_size": self.tgt.vocab_size,
            "src_sha256": self.src.sha256(),
            "tgt_sha256": self.tgt.sha256(),
            "pad_id": PAD_ID,
            "unk_id": UNK_ID,
            "bos_id": BOS_ID,
            "eos_id": EOS_ID,
        }


def build_tokenizers(
    train_src: Path,
    train_tgt: Path,
    vocab_size: int,
    joint: bool = True,
    model_type: str = "bpe",
    cache_dir: Path | None = None,
) -> TokenizerPair:
    """Train (or fetch from the cache) the tokenizers for a parallel training corpus.

    The cache key is the sha256 of both files' bytes and of the settings, so changed data or
    settings retrain. `cache_dir` defaults to `default_cache_dir() / "spm"`.
    """
    if model_type not in MODEL_TYPES:
        raise AiaynError(f"unknown tokenizer model type {model_type!r}; choose one of {', '.join(MODEL_TYPES)}")
    train_src, train_tgt = Path(train_src), Path(train_tgt)
    settings = {
        "v": _CACHE_VERSION,
        "spm": spm.__version__,
        "vocab_size": int(vocab_size),
        "joint": bool(joint),
        "model_type": model_type,
        "src": file_sha256(train_src),
        "tgt": file_sha256(train_tgt),
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:24]
    folder = Path(cache_dir if cache_dir is not None else default_cache_dir() / "spm") / key
    try:
        return TokenizerPair.load(folder)
    except AiaynError:
        pass  # not cached yet (or a broken entry): train and overwrite
    src_lines, tgt_lines = read_lines(train_src), read_lines(train_tgt)
    if joint:
        tok = Tokenizer.train(src_lines + tgt_lines, vocab_size, model_type)
        pair = TokenizerPair(tok, tok, joint=True)
    else:
        pair = TokenizerPair(
            Tokenizer.train(src_lines, vocab_size, model_type), Tokenizer.train(tgt_lines, vocab_size, model_type), joint=False
        )
    try:
        pair.save(folder)
        atomic_write_bytes(folder / "settings.json", json.dumps(settings, indent=2, sort_keys=True).encode())
    except OSError:
        pass  # a read-only cache only costs retraining next time
    return pair


def _check_encodable(texts: Iterable[str]) -> None:
    """A one-line error for the first text that UTF-8 cannot hold: a lone surrogate, which is how
    Python reads bytes that are not UTF-8 on a command line (`plot attention --src $'\\xff'`)."""
    for text in texts:
        if not isinstance(text, str):
            return  # a caller's bug: SentencePiece's TypeError stands
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise AiaynError(f"{text[:60]!r}: character {e.start + 1} is a lone surrogate (U+{ord(text[e.start]):04X}: "
                             "bytes that are not UTF-8?); give UTF-8 text") from None


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A protobuf varint at `pos` of `buf`: (value, the position after it)."""
    value = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, pos


def _proto_field(buf: bytes, number: int) -> bytes | int | None:
    """The first value of field `number` in a serialized protobuf message (varint or bytes)."""
    pos = 0
    try:
        while pos < len(buf):
            key, pos = read_varint(buf, pos)
            field, wire = key >> 3, key & 7
            if wire == 0:
                value, pos = read_varint(buf, pos)
                if field == number:
                    return value
            elif wire == 2:
                size, pos = read_varint(buf, pos)
                if field == number:
                    return buf[pos : pos + size]
                pos += size
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                return None
    except IndexError:
        return None
    return None
