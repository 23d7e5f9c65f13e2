"""Marian (OPUS-MT style) model directories built offline with transformers' own classes, for the
import tests: SentencePiece models trained on Multi30k text (one per side, unigram, Marian's NFKC
normalization), one joint vocab.json in Marian's order (</s> 0, <unk> 1, ..., <pad> last), pad as
the decoder start, and a tiny MarianMTModel trained for a few seconds so that its outputs vary and
end by themselves. Variations of it (activation, embedding scale, final_logits_bias, untied
embeddings, pytorch_model.bin) are written from the trained weights.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
from pathlib import Path
from typing import Any

import sentencepiece as spm
import torch

SHORT = 10  # words per sentence at most, in the fixture's training data and the sentences it is tested on
DATA = Path(os.environ.get("AIAYN_DATA", "/work/shared/data")) / "multi30k"


def multi30k(split: str, lang: str, n: int) -> list[str]:
    with gzip.open(DATA / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.strip() for _, line in zip(range(n), f)]


def have_data() -> bool:
    return (DATA / "train.de.gz").is_file()


def _spm(lines: list[str], vocab: int, model_type: str = "unigram") -> bytes:
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab,
                                   model_type=model_type, unk_id=1, bos_id=-1, eos_id=0, pad_id=-1,
                                   hard_vocab_limit=False, num_threads=1, minloglevel=2)
    return buf.getvalue()


def _pieces(model: bytes) -> list[str]:
    sp = spm.SentencePieceProcessor(model_proto=model)
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def write_tokenizer(d: Path, src: bytes, tgt: bytes) -> dict[str, int]:
    """source.spm, target.spm, one joint vocab.json (Marian's order) and MarianTokenizer's config."""
    from transformers import MarianTokenizer

    vocab = {"</s>": 0, "<unk>": 1}
    for p in _pieces(src) + _pieces(tgt):
        vocab.setdefault(p, len(vocab))
    vocab["<pad>"] = len(vocab)
    tmp = d / "tok"  # MarianTokenizer reads its files from paths; save_pretrained copies them into d
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "source.spm").write_bytes(src)
    (tmp / "target.spm").write_bytes(tgt)
    (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tok = MarianTokenizer(source_spm=str(tmp / "source.spm"), target_spm=str(tmp / "target.spm"),
                          vocab=str(tmp / "vocab.json"), source_lang="de", target_lang="en")
    tok.save_pretrained(str(d))
    return vocab


def marian_config(V: int, **over: Any) -> Any:
    from transformers import MarianConfig

    kw: dict[str, Any] = dict(
        vocab_size=V, decoder_vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        activation_function="swish", max_position_embeddings=256, scale_embedding=True, dropout=0.0,
        pad_token_id=V - 1, eos_token_id=0, decoder_start_token_id=V - 1, forced_eos_token_id=0,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    kw.update(over)
    return MarianConfig(**kw)


def train_tiny(d: Path, n_pairs: int = 3000, steps: int = 300, seed: int = 0, lr: float = 3e-3, batch_size: int = 64,
               vocab: int = 1000, max_words: int = 0) -> tuple[Any, Any]:
    """A Marian directory at `d` holding a tiny de->en model trained for `steps` (a few seconds):
    returns (model, tokenizer) as transformers loads them."""
    from transformers import MarianMTModel, MarianTokenizer

    de, en = multi30k("train", "de", n_pairs), multi30k("train", "en", n_pairs)
    if max_words:  # short sentences: a tiny model learns to end them within a few hundred steps
        de, en = map(list, zip(*[(s, t) for s, t in zip(de, en) if len(s.split()) <= max_words
                                 and len(t.split()) <= max_words]))
    vocab = write_tokenizer(d, _spm(de, vocab), _spm(en, vocab))
    tok = MarianTokenizer.from_pretrained(str(d))
    torch.manual_seed(seed)
    model = MarianMTModel(marian_config(len(vocab)))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    rng = random.Random(seed)
    src_ids = tok(de)["input_ids"]
    tgt_ids = tok(text_target=en)["input_ids"]
    pairs = list(zip(src_ids, tgt_ids))
    pad = tok.pad_token_id
    for _ in range(steps):
        batch = rng.sample(pairs, batch_size)
        S, T = max(len(s) for s, _ in batch), max(len(t) for _, t in batch)
        src = torch.tensor([s + [pad] * (S - len(s)) for s, _ in batch])
        labels = torch.tensor([t + [-100] * (T - len(t)) for _, t in batch])
        loss = model(input_ids=src, attention_mask=src.ne(pad), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.generation_config.bad_words_ids = None
    model.generation_config.suppress_tokens = [tok.pad_token_id]  # pad is the start token, never generated
    model.save_pretrained(str(d))
    return model, tok


def variation(base: Path, d: Path, kind: str) -> Path:
    """A copy of the Marian directory `base` in one variation: swish -> gelu or relu, scale_embedding
    off, a final_logits_bias, untied embeddings (separate source, target and output matrices), or
    the weights as pytorch_model.bin."""
    from transformers import MarianMTModel

    model = MarianMTModel.from_pretrained(str(base))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = model.config.to_dict()
    g = torch.Generator().manual_seed(1)
    if kind in ("gelu", "relu"):
        cfg["activation_function"] = kind
    elif kind == "noscale":
        cfg["scale_embedding"] = False
        for k in ("model.shared.weight", "model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                  "lm_head.weight"):
            sd[k] = sd[k] * 32 ** 0.5  # the same inputs as before, so outputs still vary
    elif kind == "bias":
        sd["final_logits_bias"] = torch.randn(sd["final_logits_bias"].shape, generator=g) * 0.5
    elif kind == "untied":
        cfg.update(share_encoder_decoder_embeddings=False, tie_word_embeddings=False)
        for k in ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"):
            sd[k] = sd["model.shared.weight"] + 0.01 * torch.randn(sd[k].shape, generator=g)
    from transformers import MarianConfig

    new = MarianMTModel(MarianConfig(**{k: v for k, v in cfg.items() if k not in ("transformers_version",)}))
    missing = new.load_state_dict({k: v for k, v in sd.items() if k in new.state_dict()}, strict=False)
    assert not [k for k in missing.missing_keys if "embed_positions" not in k], missing
    new.eval()
    new.generation_config = model.generation_config
    d.mkdir(parents=True, exist_ok=True)
    new.save_pretrained(str(d))
    if kind == "bin":  # the older format of the hub's OPUS-MT models
        from safetensors.torch import load_file

        torch.save(load_file(str(d / "model.safetensors")), d / "pytorch_model.bin")
        (d / "model.safetensors").unlink()
    for f in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / f).is_file():
            (d / f).write_bytes((base / f).read_bytes())
    return d


def multilingual(base: Path, d: Path, codes: list[str]) -> Path:
    """A copy of `base` as a multilingual model: `codes` (target-language tokens such as ">>fr<<")
    join vocab.json before <pad>, with embedding rows of the others' spread, so that the code a
    sentence starts with changes its translation."""
    from transformers import MarianMTModel, MarianTokenizer

    model = MarianMTModel.from_pretrained(str(base))
    vocab = json.loads((base / "vocab.json").read_text(encoding="utf-8"))
    V, k = len(vocab), len(codes)
    pad = vocab.pop("<pad>")
    vocab.update({c: V - 1 + i for i, c in enumerate(codes)})
    vocab["<pad>"] = V - 1 + k
    g = torch.Generator().manual_seed(2)
    old = model.get_input_embeddings().weight.detach()  # (V, d), pad last
    rows = torch.cat([old[:pad], torch.randn(k, old.size(1), generator=g) * old.std(), old[pad:]])  # (V + k, d)
    model.resize_token_embeddings(V + k, mean_resizing=False)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(rows)
    model.final_logits_bias = torch.zeros(1, V + k)
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = cfg.decoder_start_token_id = V - 1 + k
    model.config.vocab_size = model.config.decoder_vocab_size = V + k
    model.generation_config.suppress_tokens = [V - 1 + k]
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(d))
    tmp = d / "tok"  # MarianTokenizer reads its files from paths; save_pretrained copies them into d
    tmp.mkdir()
    for f in ("source.spm", "target.spm"):
        (tmp / f).write_bytes((base / f).read_bytes())
    (tmp / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    MarianTokenizer(source_spm=str(tmp / "source.spm"), target_spm=str(tmp / "target.spm"),
                    vocab=str(tmp / "vocab.json"), source_lang="de", target_lang="en").save_pretrained(str(d))
    return d


def separate_shared(base: Path, d: Path) -> Path:
    """A copy of `base` whose tokenizer has separate vocabularies (separate_vocabs: vocab.json for the
    source, target_vocab.json for the target) that order their ids differently (the target's puts
    <pad> first, every other id one later), while the model keeps one shared embedding matrix,
    which each side indexes with its own ids."""
    from transformers import MarianMTModel, MarianTokenizer

    vocab = json.loads((base / "vocab.json").read_text(encoding="utf-8"))
    V = len(vocab)
    target = {p: (i + 1) % V for p, i in vocab.items()}  # <pad> (last) becomes 0
    pad, eos = target["<pad>"], target["</s>"]
    tmp = d / "tok"  # MarianTokenizer reads its files from paths; save_pretrained copies them into d
    tmp.mkdir(parents=True)
    for f in ("source.spm", "target.spm", "vocab.json"):
        (tmp / f).write_bytes((base / f).read_bytes())
    (tmp / "target_vocab.json").write_text(json.dumps(target, ensure_ascii=False), encoding="utf-8")
    MarianTokenizer(source_spm=str(tmp / "source.spm"), target_spm=str(tmp / "target.spm"),
                    vocab=str(tmp / "vocab.json"), target_vocab_file=str(tmp / "target_vocab.json"),
                    separate_vocabs=True, source_lang="de", target_lang="en").save_pretrained(str(d))
    model = MarianMTModel.from_pretrained(str(base))
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = cfg.decoder_start_token_id = pad
        cfg.eos_token_id = cfg.forced_eos_token_id = eos
    model.generation_config.suppress_tokens = [pad]
    model.save_pretrained(str(d))
    return d


FIXTURE = Path(__file__).resolve().parent / "data" / "marian-tiny"  # train_tiny's output, kept in the repository

if __name__ == "__main__":  # regenerate the kept fixture (a few minutes on one core)
    import shutil
    import sys

    out = Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE
    shutil.rmtree(out, ignore_errors=True)
    train_tiny(out, n_pairs=29000, steps=700, vocab=500, max_words=SHORT, batch_size=32, lr=5e-3)
    shutil.rmtree(out / "tok")
