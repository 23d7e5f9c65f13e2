"""`aiayn import --from marian`: a Hugging Face MarianMTModel (the OPUS-MT models) becomes an aiayn
checkpoint directory that translate, evaluate, serve, plot, export and `train --init-from` use.

Marian's Transformer is the paper's (post-norm layers, fixed sinusoidal positions, tied embeddings)
with a few variations. Each is mapped onto aiayn's model exactly (weights are moved, never
recomputed), or refused in one line that names the config field:

- Positions. Marian's table holds every sine, then every cosine; ours interleaves them (Section
  3.5). As `aiayn.export` does in reverse, the hidden features are permuted: our feature perm[k] is
  Marian's feature k, in every matrix that reads or writes the residual stream, every LayerNorm
  and the embeddings. The permuted model computes the same function on our table. A table the
  weights file holds (older OPUS-MT files do) must be that sinusoid: transformers uses the file's.
- Vocabulary. Marian's ids come from vocab.json (typically eos 0, unk 1, pad last); ours are fixed
  (pad 0, unk 1, bos 2, eos 3). Embedding rows, output rows and `final_logits_bias` are reordered
  to our ids. Marian starts decoding from pad: its pad row becomes our BOS row too (one extra row).
- Tokenizers. source.spm and target.spm keep their own segmentation and normalization; each is
  rewritten so that its ids are ours over the whole vocabulary: pieces of the vocabulary that the
  side's model lacks are marked unused (SentencePiece never produces them, as Marian never does).
- `scale_embedding`, the activation (gelu when config.json names none, as in transformers' MarianConfig),
  `final_logits_bias` and untied embeddings are fields of `ModelConfig`; the source ends with </s>
  (`source_eos`), as MarianTokenizer feeds it, unless the directory is an aiayn export of a model
  trained on bare sources (its aiayn.json says so).

Weights are read from model.safetensors, or from pytorch_model.bin with `torch.load(weights_only=True)`.
A hub name is fetched with transformers' own `from_pretrained` (needs a network and `aiayn[export]`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor

from aiayn.checkpoint import CONFIG, WEIGHTS, meta_model, refuse_run_checkpoint, save_checkpoint
from aiayn.config import ConfigError, ModelConfig
from aiayn.errors import AiaynError, first_line, require
from aiayn.export import MARKER, feature_permutation, map_marian_layers
from aiayn.files import refuse_symlink_output
from aiayn.model import Transformer, sinusoidal_table
from aiayn.tokenizer import (BOS_ID, EOS_ID, JOINT_FILE, PAD_ID, PIECES, SRC_FILE, TGT_FILE, UNK_ID, Tokenizer,
                             TokenizerPair, read_varint)

ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}  # Marian's name -> ours
DEFAULT_ACTIVATION = "gelu"  # transformers' MarianConfig default, used when config.json names none
IMPORT_FILES = frozenset({CONFIG, WEIGHTS, JOINT_FILE, SRC_FILE, TGT_FILE})  # all an import writes
IMPORT_CONFIG = frozenset({"train", "step", "imported_from", "model", "tokenizer", "versions"})  # its config's keys
# Marian-family config fields that change the architecture in ways aiayn's model does not have
_UNSUPPORTED = {"normalize_before": True, "normalize_embedding": True, "add_final_layer_norm": True,
                "static_position_embeddings": False, "add_bias_logits": True}


# ------------------------------------------------------------------------------------ the config


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AiaynError(f"{path} is missing; a Marian directory holds config.json, the weights, source.spm, "
                         "target.spm and vocab.json") from None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep
        raise AiaynError(f"{path}: cannot read it as JSON ({first_line(e)})") from None


_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def _read_object(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object: anything else would fail later, far from its name."""
    value = _read_json(path)
    if not isinstance(value, dict):
        raise AiaynError(f"{path}: holds {_JSON_TYPES.get(type(value), 'null')} where a JSON object belongs; "
                         "fix or replace the file")
    return value


def _read_vocab(path: Path) -> dict[str, int]:
    """vocab.json (or target_vocab.json): piece -> id, every id a whole number."""
    pieces = _read_object(path)
    for piece, i in pieces.items():
        if not _is_int(i):
            raise AiaynError(f"{path.name}: the id of {piece!r} is {i!r}, not a whole number; it is not a "
                             "Marian vocabulary")
    return pieces


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(hf: dict[str, Any], name: str, default: Any = None) -> Any:
    value = hf.get(name, default)
    if value is None:
        raise AiaynError(f"config.json has no {name}; it is not a MarianMTModel config")
    return value


def _whole(name: str, value: Any) -> int:
    """A config.json number that must be whole (int() would take "917" and fail on a list)."""
    if not _is_int(value):
        raise AiaynError(f"config.json: {name} is {value!r}, not a whole number")
    return int(value)


def _token_id(hf: dict[str, Any], name: str) -> int:
    """A special token's id; transformers also takes a list for eos_token_id: one id is that id."""
    value = _field(hf, name)
    if isinstance(value, list) and name == "eos_token_id":
        if len(value) != 1:
            raise AiaynError(f"config.json: {name} is {value!r}; aiayn's model has one such token, give one id")
        value = value[0]
    return _whole(name, value)


def _fraction(hf: dict[str, Any], name: str, default: float) -> float:
    value = hf.get(name, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise AiaynError(f"config.json: {name} is {value!r}, not a number")
    return float(value)


def model_config(hf: dict[str, Any], src_vocab: int, tgt_vocab: int, output_bias: bool,
                 source_eos: bool = True) -> ModelConfig:
    """Our ModelConfig for a Marian config.json (raises AiaynError naming the field aiayn cannot hold)."""
    if hf.get("model_type") != "marian":
        raise AiaynError(f"config.json: model_type is {hf.get('model_type')!r}; only 'marian' (MarianMTModel) "
                         "models can be imported")
    for name, bad in _UNSUPPORTED.items():
        if name in hf and bool(hf[name]) == bad:
            raise AiaynError(f"config.json: {name} = {hf[name]!r} is a variation aiayn's model does not have")
    heads = _field(hf, "encoder_attention_heads")
    if _field(hf, "decoder_attention_heads") != heads:
        raise AiaynError(f"config.json: decoder_attention_heads ({hf['decoder_attention_heads']}) differs from "
                         f"encoder_attention_heads ({heads}); aiayn's model has one head count (n_heads)")
    d_ff = _field(hf, "encoder_ffn_dim")
    if _field(hf, "decoder_ffn_dim") != d_ff:
        raise AiaynError(f"config.json: decoder_ffn_dim ({hf['decoder_ffn_dim']}) differs from encoder_ffn_dim "
                         f"({d_ff}); aiayn's model has one feed-forward size (d_ff)")
    act = str(hf.get("activation_function", DEFAULT_ACTIVATION))
    if act not in ACTIVATIONS:
        raise AiaynError(f"config.json: activation_function {act!r} is not one aiayn has (choose from "
                         f"{', '.join(ACTIVATIONS)})")
    share = bool(hf.get("share_encoder_decoder_embeddings", True))
    try:
        return ModelConfig(
            src_vocab_size=src_vocab, tgt_vocab_size=tgt_vocab, d_model=_field(hf, "d_model"), n_heads=heads,
            encoder_layers=_field(hf, "encoder_layers"), decoder_layers=_field(hf, "decoder_layers"), d_ff=d_ff,
            dropout=_fraction(hf, "dropout", 0.1), attention_dropout=_fraction(hf, "attention_dropout", 0.0),
            activation_dropout=_fraction(hf, "activation_dropout", 0.0), activation=ACTIVATIONS[act],
            norm_first=False, share_embeddings=share, tie_output=bool(hf.get("tie_word_embeddings", True)),
            max_positions=_field(hf, "max_position_embeddings", 1024), pad_id=PAD_ID, layer_norm_eps=1e-5,
            source_eos=source_eos, scale_embedding=bool(hf.get("scale_embedding", False)), output_bias=output_bias)
    except ConfigError as e:
        raise AiaynError(f"config.json: {e}") from None


# -------------------------------------------------------------------------------- the vocabulary


@dataclass
class Side:
    """One side's vocabulary: Marian's piece -> id, and its order under our ids."""

    pieces: dict[str, int]  # vocab.json (or target_vocab.json)
    order: list[int]  # our id i is Marian's id order[i]


def _special_name(value: Any, default: str) -> str:
    if isinstance(value, dict):  # tokenizer_config.json may hold an AddedToken as a dict
        value = value.get("content")
    return value if isinstance(value, str) else default


def _special_names(d: Path, tk: dict[str, Any]) -> dict[str, str]:
    """The pad, unk and eos names as MarianTokenizer reads them: tokenizer_config.json's, where an
    older directory's special_tokens_map.json overrides them (transformers reads that file when the
    config has no added_tokens_decoder); MarianTokenizer's default names are ours."""
    given = dict(tk)
    if "added_tokens_decoder" not in tk and (d / "special_tokens_map.json").is_file():
        given.update(_read_object(d / "special_tokens_map.json"))
    return {role: _special_name(given.get(f"{role}_token"), PIECES[i]) for role, i in
            (("pad", PAD_ID), ("unk", UNK_ID), ("eos", EOS_ID))}


def _side(pieces: dict[str, int], file: str, names: dict[str, str], start: int | None, size: int) -> Side:
    """Our id order over a Marian vocabulary: pad, unk, bos (`start`, or pad's row again), eos, then
    the rest in Marian's order."""
    if sorted(pieces.values()) != list(range(len(pieces))):
        raise AiaynError(f"{file}: its ids are not 0..{len(pieces) - 1}, each once; it is not a Marian vocabulary")
    if len(pieces) != size:
        raise AiaynError(f"{file} has {len(pieces)} pieces but config.json's vocabulary size is {size}")
    ids = {}
    for role in ("pad", "unk", "eos"):
        if names[role] not in pieces:
            raise AiaynError(f"{file} has no {names[role]!r}, the {role} token the tokenizer's config names")
        ids[role] = pieces[names[role]]
    bos = ids["pad"] if start is None else start
    head = [ids["pad"], ids["unk"], bos, ids["eos"]]
    return Side(pieces, head + [i for i in range(len(pieces)) if i not in set(head)])


# ------------------------------------------------------------------- SentencePiece model protobuf

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # SentencePiece piece types


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 values are 10-byte two's complement
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _fields(buf: bytes) -> Iterator[tuple[int, int, bytes]]:
    """(field number, wire type, the field's whole encoding) of a protobuf message, in order."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = read_varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = read_varint(buf, pos)
        elif wire == 2:
            size, pos = read_varint(buf, pos)
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"protobuf wire type {wire}")
        if pos > len(buf):
            raise ValueError("truncated protobuf")
        yield key >> 3, wire, buf[start:pos]


def _payload(wire: int, raw: bytes) -> bytes:
    """A field's value as bytes: a length-delimited one's content, a fixed-size one's bytes."""
    _, pos = read_varint(raw, 0)
    if wire == 2:
        size, pos = read_varint(raw, pos)
        return raw[pos:pos + size]
    return raw[pos:]


def _payload_int(raw: bytes) -> int:
    """A varint field's value."""
    _, pos = read_varint(raw, 0)
    return read_varint(raw, pos)[0]


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _piece(name: str, score: float, kind: int) -> bytes:
    return (_bytes_field(1, name.encode("utf-8")) + _varint(2 << 3 | 5) + struct.pack("<f", score)
            + _varint(3 << 3) + _varint(kind))


# TrainerSpec fields of the special ids (unk 40, bos 41, eos 42, pad 43) and pieces (45-48)
_SPECIAL_IDS = {40: UNK_ID, 41: BOS_ID, 42: EOS_ID, 43: PAD_ID}
_SPECIAL_PIECES = {45: UNK_ID, 46: BOS_ID, 47: EOS_ID, 48: PAD_ID}


def rewrite_spm(model: bytes, side: Side, file: str) -> tuple[bytes, int]:
    """The SentencePiece model `model` with our ids over `side`'s whole vocabulary; returns the new
    model and how many of its pieces the vocabulary lacks (Marian maps those to <unk>; here they
    are dropped, so text holding them segments differently)."""
    try:
        fields = list(_fields(model))
        own: dict[str, tuple[float, int]] = {}
        for number, wire, raw in fields:
            if number == 1:
                name, score, kind = "", 0.0, NORMAL
                for n, w, r in _fields(_payload(wire, raw)):
                    if n == 1:
                        name = _payload(w, r).decode("utf-8")
                    elif n == 2:
                        score = struct.unpack("<f", _payload(w, r))[0]
                    elif n == 3:
                        kind = _payload_int(r)
                own[name] = (score, kind)
    except (ValueError, IndexError, UnicodeDecodeError, struct.error):
        raise AiaynError(f"{file}: not a SentencePiece model") from None
    if not own:  # an empty file parses as a message without fields: every sentence would be one <unk>
        raise AiaynError(f"{file}: not a SentencePiece model (it holds no pieces); fetch the file again")
    marian = {i: p for p, i in side.pieces.items()}
    reserved = set(PIECES.values())
    pieces = []
    for ours, mid in enumerate(side.order):
        if ours in PIECES:
            pieces.append(_piece(PIECES[ours], 0.0, UNKNOWN if ours == UNK_ID else CONTROL))
        elif marian[mid] in reserved or own.get(marian[mid], (0, NORMAL))[1] in (CONTROL, UNKNOWN):
            pieces.append(_piece(f"<marian:{mid}>", 0.0, CONTROL))  # a second copy of a special name
        elif marian[mid] in own:
            pieces.append(_piece(marian[mid], *own[marian[mid]]))
        else:  # the other side's piece: never produced. A character (or run) this side's model lacks is
            # one unknown piece, which MarianTokenizer looks up by its text, and so does `Tokenizer.encode`.
            pieces.append(_piece(marian[mid], 0.0, UNUSED))
    dropped = sum(1 for p, (_, kind) in own.items() if p not in side.pieces and kind not in (CONTROL, UNKNOWN))
    out = b"".join(_bytes_field(1, p) for p in pieces)
    for number, wire, raw in fields:
        if number == 2:  # TrainerSpec: our special ids and names
            spec = b"".join(r for n, _, r in _fields(_payload(wire, raw)) if n not in _SPECIAL_IDS
                            and n not in _SPECIAL_PIECES)
            spec += b"".join(_varint(n << 3) + _varint(i) for n, i in _SPECIAL_IDS.items())
            spec += b"".join(_bytes_field(n, PIECES[i].encode()) for n, i in _SPECIAL_PIECES.items())
            out += _bytes_field(2, spec)
        elif number not in (1, 4):  # 4: self-test samples, written for the old ids
            out += raw
    return out, dropped


def _tokenizer(model: bytes, side: Side, file: str, warn: Any) -> Tokenizer:
    """Our Tokenizer for one side: the original bytes when they already have our ids (a model that
    aiayn exported), else the rewritten model."""
    try:
        tok = Tokenizer(model, file)
        if tok.vocab_size == len(side.order) and side.order == list(range(len(side.order))) and all(
                tok.id_to_piece(i) == p for p, i in side.pieces.items()):
            return tok
    except AiaynError:
        pass
    new, dropped = rewrite_spm(model, side, file)
    if dropped:
        warn(f"{file}: {dropped} of its pieces are not in the vocabulary (Marian reads them as <unk>); they are "
             "left out, so text holding them is segmented into other pieces")
    return Tokenizer(new, file)


# ----------------------------------------------------------------------------------- the weights


def read_weights(d: Path) -> dict[str, Tensor]:
    """model.safetensors, else pytorch_model.bin (tensors only: torch.load(weights_only=True))."""
    if (d / "model.safetensors").is_file():
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(d / "model.safetensors"))
        except (SafetensorError, OSError, ValueError) as e:
            raise AiaynError(f"{d / 'model.safetensors'} is corrupt ({first_line(e)})") from None
    if (d / "pytorch_model.bin").is_file():
        try:
            sd = torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # unpickling fails in many types; none is trusted
            raise AiaynError(f"{d / 'pytorch_model.bin'}: cannot load it as tensors only ({first_line(e)})") from None
        if isinstance(sd, dict) and all(isinstance(v, Tensor) for v in sd.values()):
            return sd
        raise AiaynError(f"{d / 'pytorch_model.bin'} does not hold a state dict of tensors")
    if any(d.glob("*.index.json")):
        raise AiaynError(f"{d}: the weights are sharded; save the model as one file (save_pretrained with a "
                         "larger max_shard_size) and import that")
    raise AiaynError(f"{d} has no model.safetensors or pytorch_model.bin")


@torch.no_grad()
def load_marian_weights(model: Transformer, sd: dict[str, Tensor], src: Side, tgt: Side, file: str,
                        shared: bool | None = None) -> None:
    """Marian's tensors into `model`, hidden features and vocabulary rows permuted to ours. `shared`:
    Marian's encoder and decoder read one matrix (default: as `model` does); with separate
    vocabularies that order their ids differently, ours are two, each row reordered by its side."""
    cfg, d = model.cfg, model.cfg.d_model
    p = feature_permutation(d)
    used: set[str] = set()

    def get(name: str, shape: tuple[int, ...]) -> Tensor:
        if name not in sd:
            raise AiaynError(f"{file} has no tensor {name}; config.json does not fit the weights")
        t = sd[name]
        if tuple(t.shape) != shape:
            raise AiaynError(f"{file}: {name} has shape {tuple(t.shape)}, config.json says {shape}")
        used.add(name)
        return t.float()

    def reads(name: str, lin: Any, rows: slice = slice(None)) -> None:  # the input side is the residual
        n = lin.weight[rows].size(0)
        lin.weight[rows][:, p] = get(f"{name}.weight", (n, d))
        lin.bias[rows] = get(f"{name}.bias", (n,))

    def writes(name: str, lin: Any) -> None:  # the output side is the residual
        lin.weight[p] = get(f"{name}.weight", tuple(lin.weight.shape))
        lin.bias[p] = get(f"{name}.bias", (d,))

    def norm(name: str, ln: torch.nn.LayerNorm) -> None:
        ln.weight[p], ln.bias[p] = get(f"{name}.weight", (d,)), get(f"{name}.bias", (d,))

    map_marian_layers(model, reads, writes, norm)

    def table(names: list[str], rows: int) -> Tensor:
        """The first of `names` present (a tied matrix is saved under one of its names)."""
        name = next((n for n in names if n in sd), names[0])
        return get(name, (rows, d))

    V_src, V_tgt = len(src.pieces), len(tgt.pieces)
    tgt_table = table(["model.decoder.embed_tokens.weight", "model.shared.weight"], V_tgt)
    model.tgt_embed.weight[:, p] = tgt_table[tgt.order]
    if not cfg.share_embeddings:
        model.src_embed.weight[:, p] = table(["model.encoder.embed_tokens.weight", "model.shared.weight"], V_src)[src.order]
    if cfg.share_embeddings if shared is None else shared:
        for name in ("model.shared.weight", "model.encoder.embed_tokens.weight"):
            if name in sd and not torch.equal(sd[name].float(), tgt_table):
                raise AiaynError(f"{file}: {name} differs from the decoder's embeddings, but config.json's "
                                 "share_encoder_decoder_embeddings is true")
            used.add(name)
    head = sd.get("lm_head.weight")
    if model.out_proj is not None:
        model.out_proj.weight[:, p] = get("lm_head.weight", (V_tgt, d))[tgt.order]
    elif head is not None:
        if not torch.equal(head.float(), tgt_table):
            raise AiaynError(f"{file}: lm_head.weight differs from the decoder's embeddings, but config.json's "
                             "tie_word_embeddings is true; set it to false to import the two matrices")
        used.add("lm_head.weight")
    if model.out_bias is not None:
        model.out_bias.copy_(get("final_logits_bias", (1, V_tgt))[0, tgt.order])
    used.add("final_logits_bias")
    marian_table = sinusoidal_table(cfg.max_positions, d)[:, p]
    for name in sorted(n for n in sd if "embed_positions" in n):  # transformers uses a table the file holds
        t = sd[name]
        tol = max(1e-5, torch.finfo(t.dtype).eps) if t.is_floating_point() else 0.0  # a half-precision file's rounding
        if not torch.allclose(get(name, (cfg.max_positions, d)), marian_table, atol=tol, rtol=0):
            raise AiaynError(f"{file}: {name} is not Marian's sinusoidal table, and transformers uses the table the "
                             "file holds; aiayn's positions are sinusoidal only")
    unknown = sorted(set(sd) - used)
    if unknown:
        raise AiaynError(f"{file} holds {unknown[0]}, which aiayn's model has no place for (a Marian variation it "
                         "does not have)")


# ---------------------------------------------------------------------------------------- import


HUB_LOGGERS = ("huggingface_hub", "transformers")  # quiet while a hub model is fetched


@contextlib.contextmanager
def _errors_only() -> Iterator[None]:
    """The hub libraries' loggers at ERROR: without a network they printed a dozen lines of retries
    ("Retrying in 1s [Retry 1/5]") before the one line that says what to do."""
    loggers = [logging.getLogger(n) for n in HUB_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _hub(name: str, tmp: Path) -> Path:
    """A hub model fetched and saved by transformers' own classes (needs a network)."""
    transformers = require("transformers")
    try:
        with _errors_only():
            transformers.MarianMTModel.from_pretrained(name).save_pretrained(str(tmp), safe_serialization=True)
            transformers.MarianTokenizer.from_pretrained(name).save_pretrained(str(tmp))
    except (OSError, ValueError) as e:
        raise AiaynError(f"{name}: not a local directory, and transformers could not load it from the hub "
                         f"({str(e).strip().splitlines()[0][:200]}); fetch it where there is a network "
                         "(save_pretrained) and import the directory") from None
    return tmp


def local_source(source: str | Path) -> Path | None:
    """The directory `source` names, or None for a hub name (NAME or OWNER/NAME). A value that can only
    be a path (it starts with '.', '/' or '~', has two '/' or more, or is a file) is refused at once:
    the hub would answer it after many seconds with "Repo id must be in the form ..."."""
    path, name = Path(source), str(source)
    if path.is_dir():
        return path
    if path.exists():
        raise AiaynError(f"{name} is a file; name the Marian model's directory (the folder holding config.json)")
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise AiaynError(f"{name}: no such directory; name a Marian model's directory, or a hub name such as "
                         "Helsinki-NLP/opus-mt-de-en")
    return None


def import_marian(source: str | Path, out: str | Path, warn: Any = print, src: str | None = None,
                  tgt: str | None = None) -> Path:
    """Writes the aiayn checkpoint of a Marian directory (or hub name) to `out`; returns `out`.
    The language pair (for `aiayn serve`) is `src`/`tgt`, else tokenizer_config.json's, else the
    name's (opus-mt-SRC-TGT)."""
    for flag, given in (("DIR_OR_NAME", source), ("--out", out)):
        if not str(given):  # (Path("") is the current folder)
            raise AiaynError(f"{flag} '': an empty name (an unset shell variable?); name the Marian model and the "
                             "folder to write")
    out, local = Path(out), local_source(source)
    _check_out(out, local)
    with tempfile.TemporaryDirectory() as tmp:
        d = local or _hub(str(source), Path(tmp))
        model, tokenizers = convert(d, warn)
        tk = _read_object(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
        m = re.search(r"opus-mt-([a-z]+)-([a-z]+)$", str(source).rstrip("/"))
        src = src or tk.get("source_lang") or (m.group(1) if m else None)
        tgt = tgt or tk.get("target_lang") or (m.group(2) if m else None)
        langs = {"src": src, "tgt": tgt} if isinstance(src, str) and isinstance(tgt, str) else {}
        if not langs:
            warn(_no_pair(src, tgt))
        info = {"from": "marian", "source": str(source)}
        _check_out(out, local)  # again: files may have appeared there while the model was read
        save_checkpoint(out, model, tokenizers, {"train": langs, "step": 0, "imported_from": info})
    return out


def _no_pair(src: Any, tgt: Any) -> str:
    """The warning for a checkpoint without a language pair. `aiayn serve` takes no --src/--tgt (it
    refuses such a checkpoint), so the remedy is this command's flags, and a side that was found
    is not called missing."""
    missing = " and ".join(f"--{flag}" for flag, v in (("src", src), ("tgt", tgt)) if not isinstance(v, str))
    return (f"no language pair recorded: {missing} not given and not found (tokenizer_config.json's "
            "source_lang/target_lang); `aiayn serve` and `translate --split-sentences` need it: import again with "
            "--src LANG --tgt LANG")


def convert(d: Path, warn: Any = print) -> tuple[Transformer, TokenizerPair]:
    """The model (eval mode) and tokenizers of a Marian directory."""
    hf = _read_object(d / "config.json")
    tk = _read_object(d / "tokenizer_config.json") if (d / "tokenizer_config.json").is_file() else {}
    names = _special_names(d, tk)
    share = bool(hf.get("share_encoder_decoder_embeddings", True))
    separate = bool(tk.get("separate_vocabs", False)) or (d / "target_vocab.json").is_file() and not share
    V = _whole("vocab_size", _field(hf, "vocab_size"))
    V_tgt = V if share or not hf.get("decoder_vocab_size") else _whole("decoder_vocab_size", hf["decoder_vocab_size"])
    src_pieces = _read_vocab(d / "vocab.json")
    tgt_pieces = _read_vocab(d / "target_vocab.json") if separate else src_pieces
    pad, eos, start = (_token_id(hf, k) for k in ("pad_token_id", "eos_token_id", "decoder_start_token_id"))
    tgt_file = "target_vocab.json" if separate else "vocab.json"
    for role, value in (("pad", pad), ("eos", eos)):
        if tgt_pieces.get(names[role]) != value:
            raise AiaynError(f"config.json: {role}_token_id is {value}, but {tgt_file} gives {names[role]!r} the id "
                             f"{tgt_pieces.get(names[role])}")
    if not 0 <= start < V_tgt:
        raise AiaynError(f"config.json: decoder_start_token_id {start} is outside the target vocabulary")
    tgt = _side(tgt_pieces, tgt_file, names, None if start == pad else start, V_tgt)
    start_piece = {i: p for p, i in tgt_pieces.items()}[start]
    src = tgt if not separate else _side(src_pieces, "vocab.json", names,  # BOS as the target's, if it has one
                                         None if start == pad else src_pieces.get(start_piece), V)
    if start in (tgt_pieces[names["unk"]], eos):
        raise AiaynError(f"config.json: decoder_start_token_id {start} is the unk or eos token; aiayn needs a "
                         "start token of its own (pad, as Marian, or a bos)")
    sd = read_weights(d)
    file = "model.safetensors" if (d / "model.safetensors").is_file() else "pytorch_model.bin"
    bias = sd.get("final_logits_bias")
    shared = share and src.order == tgt.order  # else Marian's one matrix is indexed by two vocabularies
    cfg = model_config({**hf, "share_encoder_decoder_embeddings": shared}, len(src.order), len(tgt.order),
                       bias is not None and bool(bias.float().abs().sum() > 0), _source_eos(d))
    try:  # config.json's sizes against the weights first: a digit too many was a model of that size allocated
        load_marian_weights(meta_model(cfg), sd, src, tgt, file, share)
    except ConfigError as e:
        raise AiaynError(f"config.json: cannot build its model ({e})") from None
    model = Transformer(cfg)
    load_marian_weights(model, sd, src, tgt, file, share)
    for f in ("source.spm", "target.spm"):
        if not (d / f).is_file():
            raise AiaynError(f"{d / f} is missing; a Marian directory holds source.spm and target.spm")
    src_tok = _tokenizer((d / "source.spm").read_bytes(), src, "source.spm", warn)
    tgt_tok = _tokenizer((d / "target.spm").read_bytes(), tgt, "target.spm", warn)
    joint = src_tok == tgt_tok
    return model.eval(), TokenizerPair(src_tok, tgt_tok if not joint else src_tok, joint=joint)


def _source_eos(d: Path) -> bool:
    """False only for an aiayn export of a model trained on bare sources: its aiayn.json says so
    (Marian's config has no such field, and MarianTokenizer always appends </s>)."""
    if not (d / MARKER).is_file():
        return True
    model = _read_object(d / MARKER).get("model") or {}
    value = model.get("source_eos", True) if isinstance(model, dict) else model
    if not isinstance(value, bool):
        raise AiaynError(f"{d / MARKER}: model.source_eos is {value!r}, not true or false; export the model again "
                         f"or remove {MARKER}")
    return value


def _check_out(out: Path, source: Path | None) -> None:
    """--out may be new, empty, or an earlier import holding nothing but what an import writes: it is
    replaced whole, so anything else there (a user's file, a folder, the input) would be lost. Refused
    too: the current directory (the swap fails on ".": "Device or resource busy") and a symbolic link
    (it would become a folder, the link left behind under a `.tmp-old-` name)."""
    real = out.resolve()
    if source is not None and (real == source.resolve() or real in source.resolve().parents):
        raise AiaynError(f"--out {out} is (or holds) the input {source}; choose a new directory")
    here = Path.cwd().resolve()
    if real == here or real in here.parents:
        raise AiaynError(f"--out {out} is (or holds) the current directory; run the import from another "
                         "directory, or choose a new --out")
    refuse_run_checkpoint(out, "--out")
    refuse_symlink_output(out, "--out")
    if out.exists() and not out.is_dir():
        raise AiaynError(f"--out {out} is a file; choose a new directory")
    if out.is_dir() and any(out.iterdir()):
        try:  # `aiayn average` of imports copies imported_from (and adds averaged_from): not an import's
            cfg = json.loads((out / CONFIG).read_text(encoding="utf-8"))
            earlier = isinstance(cfg, dict) and "imported_from" in cfg and set(cfg) <= IMPORT_CONFIG
        except (OSError, ValueError, TypeError, RecursionError):
            earlier = False
        if not earlier:
            raise AiaynError(f"--out {out} exists and is not an earlier import; choose a new directory")
        other = next((p.name for p in sorted(out.iterdir())
                      if p.name not in IMPORT_FILES or p.is_symlink() or not p.is_file()), None)
        if other is not None:
            raise AiaynError(f"--out {out} holds {other}, which an import did not write (replacing the folder would "
                             "delete it); move it away or choose a new directory")


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="kind", required=True, choices=("marian",),
                   help="the model's format: marian (a Hugging Face MarianMTModel, e.g. the OPUS-MT models)")
    p.add_argument("source", metavar="DIR_OR_NAME",
                   help="a MarianMTModel directory, or a hub name such as Helsinki-NLP/opus-mt-de-en (needs a network)")
    p.add_argument("--out", required=True, help="the aiayn checkpoint directory to write")
    p.add_argument("--src", default=None, help="source language code (default: the tokenizer config's source_lang)")
    p.add_argument("--tgt", default=None, help="target language code (default: the tokenizer config's target_lang)")


def run(args: argparse.Namespace) -> int:
    out = import_marian(args.source, args.out, lambda m: print(f"aiayn import: warning: {m}", file=sys.stderr),
                        args.src, args.tgt)
    print(f"wrote an aiayn checkpoint to {out}; translate with `aiayn translate --checkpoint {out}`, fine-tune "
          f"with `aiayn train --init-from {out} ...`")
    return 0


