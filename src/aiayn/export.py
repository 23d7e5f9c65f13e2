"""Export a trained model to Hugging Face `transformers` (MarianMTModel) and to CTranslate2.

Both targets run the architecture of the paper (Sections 3.1-3.5): a post-norm encoder-decoder with
scaled, tied embeddings and fixed sinusoidal positions. What has to be translated between the
conventions, and how:

- Positions. Marian's sinusoidal table puts every sine in the first half of the vector and every
  cosine in the second half; ours interleaves them (sin at even, cos at odd features, Section 3.5).
  `transformers` rebuilds that table when it loads a model and never saves it, so writing our table
  into the checkpoint would not survive a reload. Instead the exported model's hidden features are
  permuted, `marian[k] = ours[perm[k]]` with `perm = [0, 2, 4, ..., 1, 3, 5, ...]`: every matrix
  that reads or writes the residual stream, every LayerNorm and the embeddings are permuted the
  same way. LayerNorm and attention do not care about feature order, so the permuted model computes
  the same function, and its positional table is exactly Marian's own.
  CTranslate2 takes the positional table as a weight, so it gets ours unpermuted.
- Special ids stay ours (pad 0, unk 1, bos 2, eos 3); the decoder starts from BOS (Marian's own
  models start from pad), and PAD and BOS are never generated (as in `aiayn.search`).
- The source ends with EOS and has no BOS (`ModelConfig.source_eos`, the convention of fairseq and
  Marian): `MarianTokenizer`'s default call, `pipeline("translation")`, and CTranslate2 fed the
  SentencePiece pieces plus "</s>" (as its documentation shows) give aiayn's source ids. A model
  trained before that field (bare sources) needs `add_special_tokens=False` and no "</s>".
- Pre-norm models have no Marian equivalent (Marian layers are post-norm): exporting one to `hf`
  is an error; CTranslate2 supports both.

`transformers` and `ctranslate2` are optional (`pip install 'aiayn[export]'`), imported only when used
(`aiayn.errors.require`); `aiayn.translator.CT2Translator` runs a CTranslate2 export.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import torch
from torch import Tensor

from aiayn.checkpoint import CONFIG, EXPORT_MARKER, refuse_run_checkpoint
from aiayn.data.lock import parse_work_name, stale, work_name
from aiayn import stops
from aiayn.errors import AiaynError, require
from aiayn.files import check_output_path, refuse_symlink_output, say, umask
from aiayn.model import Transformer, sinusoidal_table
from aiayn.search import DEFAULT_STOP_RULE
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, PIECES, UNK_ID, TokenizerPair, vocabulary


def feature_permutation(d_model: int) -> Tensor:
    """perm such that Marian's hidden feature k is our feature perm[k]: even features, then odd ones."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


# -------------------------------------------------------------------------------- Hugging Face


def marian_config(model: Transformer) -> Any:
    """A `transformers.MarianConfig` describing `model` (raises AiaynError for what Marian cannot hold)."""
    transformers = require("transformers")
    cfg = model.cfg
    if cfg.norm_first:
        raise AiaynError("this model is pre-norm (norm_first=True); Marian layers are post-norm only, so it cannot "
                         "be exported to Hugging Face; export it with --to ctranslate2 instead")
    if abs(cfg.layer_norm_eps - 1e-5) > 1e-12:
        raise AiaynError(f"this model's layer_norm_eps is {cfg.layer_norm_eps}; Marian's LayerNorm uses 1e-5 only")
    if cfg.pad_id != PAD_ID:
        raise AiaynError(f"this model's pad_id is {cfg.pad_id}; the export needs the tokenizer's pad id {PAD_ID}")
    return transformers.MarianConfig(
        vocab_size=cfg.src_vocab_size,
        decoder_vocab_size=cfg.tgt_vocab_size,
        share_encoder_decoder_embeddings=cfg.share_embeddings,
        tie_word_embeddings=cfg.tie_output,
        d_model=cfg.d_model,
        encoder_layers=cfg.encoder_layers,
        decoder_layers=cfg.decoder_layers,
        encoder_attention_heads=cfg.n_heads,
        decoder_attention_heads=cfg.n_heads,
        encoder_ffn_dim=cfg.d_ff,
        decoder_ffn_dim=cfg.d_ff,
        activation_function=cfg.activation,  # both "gelu"s are the exact erf form; "swish" is SiLU in both
        dropout=cfg.dropout,
        attention_dropout=cfg.attention_dropout,
        activation_dropout=cfg.activation_dropout,
        max_position_embeddings=cfg.max_positions,
        scale_embedding=cfg.scale_embedding,  # embeddings times sqrt(d_model), Section 3.4
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
        decoder_start_token_id=BOS_ID,
        forced_eos_token_id=EOS_ID,  # EOS at max_length: as OPUS-MT models, and aiayn's beam at its limit
    )


def map_marian_layers(model: Transformer, reads: Callable[[str, torch.nn.Linear, slice], None],
                      writes: Callable[[str, torch.nn.Linear], None],
                      norm: Callable[[str, torch.nn.LayerNorm], None]) -> None:
    """Every encoder and decoder layer's parameters under their MarianMTModel names: `reads` gets the
    linear layers whose input side is the residual stream (with the rows of a fused projection),
    `writes` those whose output side is, `norm` the LayerNorms. The exporter and the importer walk
    this one map, in opposite directions."""
    d = model.cfg.d_model
    q, k, v = slice(0, d), slice(d, 2 * d), slice(2 * d, 3 * d)
    every = slice(None)
    for i, layer in enumerate(model.encoder.layers):
        pre = f"model.encoder.layers.{i}"
        for proj, rows in (("q", q), ("k", k), ("v", v)):
            reads(f"{pre}.self_attn.{proj}_proj", layer.self_attn.qkv_proj, rows)
        writes(f"{pre}.self_attn.out_proj", layer.self_attn.out_proj)
        norm(f"{pre}.self_attn_layer_norm", layer.norm1)
        reads(f"{pre}.fc1", layer.ff.w1, every)
        writes(f"{pre}.fc2", layer.ff.w2)
        norm(f"{pre}.final_layer_norm", layer.norm2)
    for i, layer in enumerate(model.decoder.layers):
        pre = f"model.decoder.layers.{i}"
        for proj, rows in (("q", q), ("k", k), ("v", v)):
            reads(f"{pre}.self_attn.{proj}_proj", layer.self_attn.qkv_proj, rows)
        writes(f"{pre}.self_attn.out_proj", layer.self_attn.out_proj)
        norm(f"{pre}.self_attn_layer_norm", layer.norm1)
        reads(f"{pre}.encoder_attn.q_proj", layer.cross_attn.q_proj, every)
        reads(f"{pre}.encoder_attn.k_proj", layer.cross_attn.kv_proj, slice(0, d))
        reads(f"{pre}.encoder_attn.v_proj", layer.cross_attn.kv_proj, slice(d, 2 * d))
        writes(f"{pre}.encoder_attn.out_proj", layer.cross_attn.out_proj)
        norm(f"{pre}.encoder_attn_layer_norm", layer.norm2)
        reads(f"{pre}.fc1", layer.ff.w1, every)
        writes(f"{pre}.fc2", layer.ff.w2)
        norm(f"{pre}.final_layer_norm", layer.norm3)


def marian_state_dict(model: Transformer) -> dict[str, Tensor]:
    """Our weights under MarianMTModel's names, hidden features permuted (see the module docstring)."""
    cfg, d = model.cfg, model.cfg.d_model
    p = feature_permutation(d)
    sd: dict[str, Tensor] = {}

    def reads(name: str, lin: torch.nn.Linear, rows: slice = slice(None)) -> None:  # input side is the residual
        sd[f"{name}.weight"] = lin.weight[rows][:, p]
        sd[f"{name}.bias"] = lin.bias[rows]

    def writes(name: str, lin: torch.nn.Linear) -> None:  # output side is the residual
        sd[f"{name}.weight"] = lin.weight[p]
        sd[f"{name}.bias"] = lin.bias[p]

    def norm(name: str, ln: torch.nn.LayerNorm) -> None:
        sd[f"{name}.weight"], sd[f"{name}.bias"] = ln.weight[p], ln.bias[p]

    map_marian_layers(model, reads, writes, norm)
    sd["model.encoder.embed_tokens.weight"] = model.src_embed.weight[:, p]
    sd["model.decoder.embed_tokens.weight"] = model.tgt_embed.weight[:, p]
    if cfg.share_embeddings:
        sd["model.shared.weight"] = model.tgt_embed.weight[:, p]
    sd["lm_head.weight"] = model.output_weight[:, p]
    sd["final_logits_bias"] = (torch.zeros(cfg.tgt_vocab_size) if model.out_bias is None else model.out_bias)[None]
    return {name: t.detach().float().contiguous() for name, t in sd.items()}


@torch.no_grad()
def to_marian(model: Transformer, tokenizers: TokenizerPair | None = None) -> Any:
    """A `transformers.MarianMTModel` (eval mode, CPU, fp32) computing the same function as `model`.

    `tokenizers` is only checked against the model's vocabulary sizes (the weights need nothing else).
    """
    transformers = require("transformers")
    if tokenizers is not None:
        for side, size in (("src", model.cfg.src_vocab_size), ("tgt", model.cfg.tgt_vocab_size)):
            if getattr(tokenizers, side).vocab_size != size:
                raise AiaynError(f"the {side} tokenizer has {getattr(tokenizers, side).vocab_size} pieces but the "
                                 f"model's {side}_vocab_size is {size}")
    hf = transformers.MarianMTModel(marian_config(model)).eval()
    params = dict(hf.named_parameters(remove_duplicate=False))
    params.update(dict(hf.named_buffers()))
    state = marian_state_dict(model)
    missing = sorted(n for n in params if n not in state and "embed_positions" not in n)
    if missing:
        raise AiaynError(f"internal: no aiayn weight for Marian's {missing[0]} (transformers {transformers.__version__})")
    for name, t in state.items():
        if name not in params:  # e.g. model.shared when embeddings are not shared
            continue
        params[name].copy_(t)
    # Marian builds its own table; it must equal ours under the feature permutation.
    ours = sinusoidal_table(model.cfg.max_positions, model.cfg.d_model)[:, feature_permutation(model.cfg.d_model)]
    for table in (hf.model.encoder.embed_positions.weight, hf.model.decoder.embed_positions.weight):
        if not torch.allclose(table.float(), ours, atol=1e-5, rtol=0):
            raise AiaynError(f"transformers {transformers.__version__}: Marian's positional table differs from the "
                             "expected sinusoid layout; this transformers version is not supported")
    return hf


# transformers' early_stopping for aiayn's default stopping rule ("best", searching on while a live
# hypothesis could still win, is its False): the export's generation config, and the benches' HF peer
HF_EARLY_STOPPING = DEFAULT_STOP_RULE == "first"


def generation_config(model: Transformer) -> Any:
    """Defaults for `generate`: aiayn's beam 4, PAD/BOS never generated, starts from BOS, EOS forced at
    `max_length` (as aiayn's beam search forces it at its limit, and every OPUS-MT model's config does).

    `length_penalty` in transformers divides by len**alpha, not aiayn's ((5 + len) / 6)**alpha; 0.6 is
    kept as the nearest setting; `early_stopping` follows aiayn's default stopping rule (`--stop-rule
    best`: searching on while a live hypothesis could still win, which is transformers' False).
    """
    transformers = require("transformers")
    return transformers.GenerationConfig(
        decoder_start_token_id=BOS_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        suppress_tokens=[PAD_ID, BOS_ID],
        forced_eos_token_id=EOS_ID,  # as config.json's; generate reads it here
        num_beams=4,
        length_penalty=0.6,
        early_stopping=HF_EARLY_STOPPING,
        max_length=min(model.cfg.max_positions, 256),
    )


def save_hf_tokenizer(tokenizers: TokenizerPair, out: Path, langs: tuple[str | None, str | None] = (None, None),
                      max_positions: int = 1024) -> None:
    """source.spm, target.spm, vocab.json (and target_vocab.json when the vocabularies are separate)
    and the tokenizer config (with the language pair `langs` if known), so that MarianTokenizer /
    AutoTokenizer load them offline. `truncation=True` cuts a source to `max_positions` tokens, the
    model's table of positions: Marian's does not grow, and a longer source is an IndexError there."""
    transformers = require("transformers")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        tokenizers.src.save(t / "source.spm")
        tokenizers.tgt.save(t / "target.spm")
        src_vocab = {piece: i for i, piece in enumerate(vocabulary(tokenizers.src))}
        (t / "vocab.json").write_text(json.dumps(src_vocab, ensure_ascii=False, indent=1), encoding="utf-8")
        kwargs: dict[str, Any] = {}
        if not tokenizers.joint:
            tgt_vocab = {piece: i for i, piece in enumerate(vocabulary(tokenizers.tgt))}
            (t / "target_vocab.json").write_text(json.dumps(tgt_vocab, ensure_ascii=False, indent=1), encoding="utf-8")
            kwargs = dict(target_vocab_file=str(t / "target_vocab.json"), separate_vocabs=True)
        tok = transformers.MarianTokenizer(
            source_spm=str(t / "source.spm"), target_spm=str(t / "target.spm"), vocab=str(t / "vocab.json"),
            unk_token=PIECES[UNK_ID], eos_token=PIECES[EOS_ID], pad_token=PIECES[PAD_ID], bos_token=PIECES[BOS_ID],
            model_max_length=max_positions, source_lang=langs[0], target_lang=langs[1], **kwargs,
        )
        tok.save_pretrained(str(out))


@contextlib.contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers 5 draws a "Writing model shards" bar for a save of one small file, on stderr
    between the command's own lines; off while saving, as it was."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def export_hf(checkpoint: str | Path, out: str | Path) -> Path:
    """Writes a MarianMTModel directory (config, safetensors, generation config, tokenizer) to `out`."""
    ck = _checkpoint_to_export(checkpoint, out)
    hf = to_marian(ck.model, ck.tokenizers)
    hf.generation_config = generation_config(ck.model)
    out = Path(os.path.abspath(out))
    with _export_dir(out) as tmp:
        with _no_progress_bar():
            hf.save_pretrained(str(tmp), safe_serialization=True)
        train = ck.config.get("train") or {}
        save_hf_tokenizer(ck.tokenizers, tmp, (train.get("src"), train.get("tgt")), ck.model.cfg.max_positions)
        info = {"format": "hf", "aiayn_checkpoint": os.path.abspath(ck.path), "model": ck.model.cfg.to_dict(),
                "tokenizer": ck.tokenizers.describe()}
        _write_marker(tmp, info)
    return out


# --------------------------------------------------------------------------------- CTranslate2


def _np(t: Tensor) -> Any:
    # a copy: CTranslate2 quantizes and fuses its arrays in place, which must not reach our weights
    return t.detach().float().cpu().clone().numpy()


def ct2_spec(model: Transformer, tokenizers: TokenizerPair) -> Any:
    """A CTranslate2 TransformerSpec holding our weights, vocabularies and start token (BOS)."""
    ct2 = require("ctranslate2")
    from ctranslate2.specs import common_spec, transformer_spec

    cfg = model.cfg
    act = {"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU,
           "swish": common_spec.Activation.SWISH}[cfg.activation]
    spec = transformer_spec.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers), cfg.n_heads, pre_norm=cfg.norm_first, activation=act
    )

    def linear(s: Any, lin: Any) -> None:
        s.weight = _np(lin.weight)
        if getattr(lin, "bias", None) is not None:
            s.bias = _np(lin.bias)

    def norm(s: Any, ln: torch.nn.LayerNorm) -> None:
        s.gamma, s.beta = _np(ln.weight), _np(ln.bias)

    table = _np(sinusoidal_table(cfg.max_positions, cfg.d_model))  # ours, unpermuted
    enc, dec = spec.encoder, spec.decoder
    enc.embeddings[0].weight = _np(model.src_embed.weight)
    enc.scale_embeddings = cfg.scale_embedding  # times sqrt(d_model)
    enc.position_encodings.encodings = table
    for s, layer in zip(enc.layer, model.encoder.layers):
        linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)  # fused q, k, v: the same layout as ours
        linear(s.self_attention.linear[1], layer.self_attn.out_proj)
        norm(s.self_attention.layer_norm, layer.norm1)
        linear(s.ffn.linear_0, layer.ff.w1)
        linear(s.ffn.linear_1, layer.ff.w2)
        norm(s.ffn.layer_norm, layer.norm2)
    dec.embeddings.weight = _np(model.tgt_embed.weight)
    dec.scale_embeddings = cfg.scale_embedding
    dec.position_encodings.encodings = table
    dec.projection.weight = _np(model.output_weight)
    if model.out_bias is not None:
        dec.projection.bias = _np(model.out_bias)
    for s, layer in zip(dec.layer, model.decoder.layers):
        linear(s.self_attention.linear[0], layer.self_attn.qkv_proj)
        linear(s.self_attention.linear[1], layer.self_attn.out_proj)
        norm(s.self_attention.layer_norm, layer.norm1)
        linear(s.attention.linear[0], layer.cross_attn.q_proj)
        linear(s.attention.linear[1], layer.cross_attn.kv_proj)  # fused k, v
        linear(s.attention.linear[2], layer.cross_attn.out_proj)
        norm(s.attention.layer_norm, layer.norm2)
        linear(s.ffn.linear_0, layer.ff.w1)
        linear(s.ffn.linear_1, layer.ff.w2)
        norm(s.ffn.layer_norm, layer.norm3)
    if model.encoder.norm is not None and model.decoder.norm is not None:  # pre-norm (cfg.norm_first)
        norm(enc.layer_norm, model.encoder.norm)
        norm(dec.layer_norm, model.decoder.norm)
    spec.register_source_vocabulary(vocabulary(tokenizers.src))
    spec.register_target_vocabulary(vocabulary(tokenizers.tgt))
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = PIECES[UNK_ID], PIECES[BOS_ID], PIECES[EOS_ID]
    spec.config.decoder_start_token = PIECES[BOS_ID]
    # CTranslate2 adds nothing: its callers append "</s>" themselves (its documented usage)
    spec.config.add_source_bos = spec.config.add_source_eos = False
    spec.config.layer_norm_epsilon = cfg.layer_norm_eps
    del ct2
    return spec


QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16", "float32")


def to_ctranslate2(model: Transformer, tokenizers: TokenizerPair, out: str | Path, quantization: str | None = None,
                   meta: dict[str, Any] | None = None) -> Path:
    """Writes a CTranslate2 model directory for an in-memory model: model.bin, the vocabularies,
    CTranslate2's config.json, our SentencePiece model(s) and aiayn.json (for `aiayn.translator.CT2Translator`)."""
    ct2 = require("ctranslate2")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise AiaynError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    spec = ct2_spec(model, tokenizers)

    converter: Any = ct2.converters.Converter  # imported at run time: an optional dependency

    class _Given(converter):
        def _load(self) -> Any:
            return spec

    out = Path(os.path.abspath(out))
    with _export_dir(out) as tmp:
        _Given().convert(str(tmp), quantization=quantization, force=True)
        tokenizers.save(tmp)
        info = {**(meta or {}), "quantization": quantization or "float32", "model": model.cfg.to_dict(),
                "tokenizer": tokenizers.describe()}
        _write_marker(tmp, info)
    return out


def export_ctranslate2(checkpoint: str | Path, out: str | Path, quantization: str | None = None) -> Path:
    """`aiayn export --to ctranslate2`: a checkpoint (or run directory) to a CTranslate2 directory."""
    require("ctranslate2")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise AiaynError(f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}")
    ck = _checkpoint_to_export(checkpoint, out)
    train = ck.config.get("train") or {}
    # the languages (`translate --split-sentences`) and the corpus (`evaluate --data`'s direction check)
    pair = {k: train[k] for k in ("src", "tgt", "data") if isinstance(train.get(k), str)}
    meta = {"aiayn_checkpoint": os.path.abspath(ck.path), "train": pair}
    if "imported_from" in ck.config:  # an import's pair is its Marian directory's: the direction check trusts it
        meta["imported_from"] = ck.config["imported_from"]
    return to_ctranslate2(ck.model, ck.tokenizers, out, quantization, meta)


# ------------------------------------------------------------------------------------- helpers


MARKER = EXPORT_MARKER  # written into every export: what it was made from, and the files it wrote
# the files of either kind before aiayn.json listed them
_OLD_EXPORT_FILES = frozenset({
    MARKER, "config.json", "generation_config.json", "model.safetensors", "source.spm", "target.spm", "vocab.json",
    "target_vocab.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "model.bin",
    "shared_vocabulary.json", "source_vocabulary.json", "target_vocabulary.json", "shared_vocabulary.txt",
    "source_vocabulary.txt", "target_vocabulary.txt", "spm.model", "src.spm.model", "tgt.spm.model"})


def _write_marker(tmp: Path, info: dict[str, Any]) -> None:
    """aiayn.json, listing every file of the export: a later export replaces only a folder of those."""
    files = sorted({p.name for p in tmp.iterdir()} | {MARKER})
    (tmp / MARKER).write_text(json.dumps({**info, "files": files}, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _read_json(f: Path) -> Any:
    """The JSON in file `f`, or None where there is none to read (nested past Python's recursion
    limit too: that was a traceback)."""
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def _read_marker(d: Path) -> Any:
    """Folder `d`'s aiayn.json, or None where there is none to read."""
    return _read_json(d / MARKER)


def _not_ours(d: Path) -> str | None:
    """Why replacing folder `d` would lose something an export did not write, or None: `d` is empty,
    or an earlier export holding nothing but the files its aiayn.json lists."""
    entries = sorted(d.iterdir())
    if not entries:
        return None
    info = _read_marker(d)
    if info is None:
        return f"is not an earlier aiayn export (no {MARKER})"
    files = info.get("files") if isinstance(info, dict) else None
    written = ({f for f in files if isinstance(f, str)} | {MARKER}) if isinstance(files, list) else _OLD_EXPORT_FILES
    other = next((p.name for p in entries if p.name not in written or p.is_symlink() or not p.is_file()), None)
    return None if other is None else f"holds {other}, which no aiayn export wrote there"


def _checkpoint_to_export(checkpoint: str | Path, out: str | Path) -> Any:
    """The checkpoint (or a run directory's), loaded once OUT is known to lose nothing."""
    from aiayn.checkpoint import load_checkpoint, resolve_checkpoint

    if not str(checkpoint):  # (Path("") is the current folder)
        raise AiaynError("--checkpoint '': an empty name (an unset shell variable?); give a checkpoint or run directory")
    path = resolve_checkpoint(checkpoint)
    check_out(out, path)  # a run directory holds the checkpoint it resolves to
    _refuse_other_models(path)
    return load_checkpoint(path)


def _refuse_other_models(path: Path) -> None:
    """An export, or a Hugging Face Marian model, given as the checkpoint is named as one, with what
    to give instead (it was "config.json has no "model" section")."""
    made = _read_marker(path)
    if made is not None:
        source = made.get("aiayn_checkpoint") if isinstance(made, dict) else None
        source = f"the checkpoint it was made from ({source})" if isinstance(source, str) else "its checkpoint"
        if (path / "model.bin").is_file():
            raise AiaynError(f"--checkpoint {path} is an aiayn export to CTranslate2, not a checkpoint: export "
                             f"{source}; the export translates as it is (translate --engine ctranslate2)")
        raise AiaynError(f"--checkpoint {path} is an aiayn export to Hugging Face, not a checkpoint: export {source}; "
                         f"or import the export (aiayn import --from marian {path} --out DIR) and export that")
    cfg = _read_json(path / CONFIG)  # (None: load_checkpoint says what is wrong)
    if isinstance(cfg, dict) and "model" not in cfg and cfg.get("model_type") == "marian":
        raise AiaynError(f"--checkpoint {path} is a Hugging Face Marian model, not an aiayn checkpoint; import it "
                         f"first (aiayn import --from marian {path} --out DIR) and export that")


def check_out(out: str | Path, source: str | Path | None = None) -> Path:
    """OUT as an absolute path, refused (one line) if replacing it would lose anything: a file, a
    folder holding anything but an earlier export's own files, or the checkpoint being exported (or
    a folder holding it); or if a training run would (`checkpoint.refuse_run_checkpoint`); or if it cannot be
    written (`files.check_output_path`: a file on the way, a folder that may not be written in)."""
    if not str(out):  # (Path("") is the current folder)
        raise AiaynError("OUT '': an empty name (an unset shell variable?); name the folder to write the export to")
    out = Path(os.path.abspath(out))
    for inside, what in ((source, f"the checkpoint {source}"), (os.getcwd(), "the current directory")):
        if inside is not None:
            there = Path(os.path.abspath(inside))
            if out == there or out in there.parents:
                raise AiaynError(f"OUT {out} is (or holds) {what}; choose a new OUT")
    refuse_run_checkpoint(out, "OUT")
    refuse_symlink_output(out, "OUT")  # (refused by `_replace_dir` too, but only after the whole export was written)
    check_output_path(out, "OUT", folder=True)  # (a file on the way was found once the model was converted)
    if out.exists():
        why = _not_ours(out)
        if why is not None:
            raise AiaynError(f"OUT {out} exists and {why}; choose a new OUT (replacing it would delete that)")
        _check_aside(out)
    return out


def _aside(out: Path) -> Path:
    """Where an existing OUT is moved while the new export takes its place."""
    return out.parent / f".tmp-old-{out.name}"


def _check_aside(out: Path) -> None:
    """A leftover aside folder is removed only if it is export's own (an interrupted replace leaves one)."""
    old = _aside(out)
    if not (old.exists() or old.is_symlink()):
        return
    why = "is not a folder" if old.is_symlink() or not old.is_dir() else _not_ours(old)
    if why is not None:
        raise AiaynError(f"{old} is in the way of replacing OUT and {why}; move it away or choose another OUT")


def _remove_export(d: Path) -> None:
    """Removes an export's folder (or an aside one), its aiayn.json last: stopped part-way, what is
    left is still known for an export's own, and goes next time (it was refused, "no aiayn.json")."""
    if d.is_symlink() or not d.is_dir():
        return
    for f in sorted(d.iterdir(), key=lambda f: f.name == MARKER):
        with contextlib.suppress(OSError):
            f.unlink()
    with contextlib.suppress(OSError):
        d.rmdir()


_IN_FLIGHT: set[str] = set()  # this process's temporary folders being written (by other threads, maybe)


def _temporary_names(out: Path) -> re.Pattern[str]:
    """The names of the temporary folders of exports to `out`: `work_name`'s, after host and process."""
    return re.compile(re.escape(f".tmp-{out.name}") + r"-[^-]+-\d+-[0-9a-f]{8}")


def _remove_abandoned(out: Path) -> None:
    """The temporary folders of exports to `out` that were killed (kill -9, a power cut) go once their
    process is known dead: one of this host's. Another machine's process cannot be asked; its stay."""
    names = _temporary_names(out)
    with contextlib.suppress(OSError):
        for d in out.parent.iterdir():
            if names.fullmatch(d.name) and str(d) not in _IN_FLIGHT and d.is_dir() and not d.is_symlink():
                if stale(d, *parse_work_name(d.name), max_age=math.inf):
                    shutil.rmtree(d, ignore_errors=True)


def _fresh_dir(out: Path) -> Path:
    out = check_out(out)
    tmp = out.parent / work_name(f".tmp-{out.name}")
    _IN_FLIGHT.add(str(tmp))  # before it is made: another thread's `_remove_abandoned` would take it for a dead one's
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(out)
        tmp.mkdir(mode=0o700)
    except OSError as e:
        _IN_FLIGHT.discard(str(tmp))
        raise AiaynError(f"cannot write to {out.parent} ({e.strerror or e}); choose another OUT") from None
    return tmp


@contextlib.contextmanager
def _export_dir(out: Path) -> Iterator[Path]:
    """A new temporary folder beside OUT for the block to write the export into, put in OUT's place
    (an earlier export there replaced) when the block ends; removed if it fails or is stopped."""
    tmp = _fresh_dir(out)
    try:
        yield tmp
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        _IN_FLIGHT.discard(str(tmp))


def _replace_dir(tmp: Path, out: Path) -> None:
    """Moves a finished export into place; an existing export at `out` is replaced only then. The
    files get the usual modes (the temporary folder is private; safetensors writes 0600)."""
    mask = umask()
    for f in [tmp, *tmp.rglob("*")]:
        f.chmod((0o777 if f.is_dir() else 0o666) & ~mask)
    old = _aside(out)
    with stops.deferred():  # stopped between the renames, OUT was gone and its earlier export hidden aside
        if out.exists() or out.is_symlink():
            _check_aside(out)  # again: it may have appeared while the export was written
            why = _not_ours(out) if out.is_dir() and not out.is_symlink() else "is not a folder"
            if why is not None:  # and files may have been added to OUT meanwhile
                raise AiaynError(f"OUT {out} {why} (since the export started); it was left as it is, choose a new OUT")
            _remove_export(old)
            out.rename(old)
        tmp.rename(out)
        if old.is_dir() and not old.is_symlink() and _not_ours(old) is None:
            _remove_export(old)  # the export replaced, or one a kill between the renames left aside


# ----------------------------------------------------------------------------------------- CLI


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, metavar="DIR", help="a checkpoint or run directory (its best/)")
    p.add_argument("--to", required=True, choices=("hf", "ctranslate2"), help="the target format")
    p.add_argument("out", metavar="OUT", help="the output directory (an earlier export there is replaced)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="CTranslate2 only: weight type of the export (none given: float32)")


def run(args: argparse.Namespace) -> int:
    try:
        with stops.interrupts():  # a `kill` or `timeout` removes the unfinished export as Ctrl-C does
            return _run(args)
    except stops.Stopped as e:
        print(f"aiayn export: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum


def _run(args: argparse.Namespace) -> int:
    if args.to == "hf":
        if args.quantization:
            raise AiaynError("--quantization applies to --to ctranslate2 only")
        out = export_hf(args.checkpoint, args.out)
        bare = not json.loads((out / MARKER).read_text(encoding="utf-8"))["model"].get("source_eos", False)
        say(f"wrote a Hugging Face MarianMTModel to {out}; load it with MarianMTModel.from_pretrained and "
             "MarianTokenizer.from_pretrained (their default call feeds the source as aiayn does)" + (
                 "; this model was trained on sources without EOS: tokenize with add_special_tokens=False"
                 if bare else ""), f"; the export is complete in {out}")
    else:
        out = export_ctranslate2(args.checkpoint, args.out, args.quantization)
        bare = not json.loads((out / MARKER).read_text(encoding="utf-8"))["model"].get("source_eos", False)
        say(f"wrote a CTranslate2 model ({args.quantization or 'float32'}) to {out}; "
             f"translate with `aiayn translate --engine ctranslate2 --checkpoint {out}`" + (
                 '; this model was trained on sources without EOS: called directly, it wants the pieces '
                 'without "</s>"' if bare else ""), f"; the export is complete in {out}")
    return 0
