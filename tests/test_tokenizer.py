"""SentencePiece tokenizer: fixed ids, round-trip, determinism, caching, safe loading, Multi30k."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from aiayn import files
from aiayn.errors import AiaynError
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer, TokenizerPair, build_tokenizers

CORPUS = [
    "Ein Mann fährt Fahrrad auf der Straße.",
    "Zwei Hunde spielen im Schnee.",
    "A man rides a bicycle on the street.",
    "Two dogs are playing in the snow.",
    "Une femme lit un livre près de la fenêtre.",
    "Žena čte knihu u okna.",
] * 20


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(CORPUS, vocab_size=400)


def test_special_ids_are_fixed(tok: Tokenizer) -> None:
    assert (PAD_ID, UNK_ID, BOS_ID, EOS_ID) == (0, 1, 2, 3)
    assert [tok.id_to_piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    ids = tok.encode("Two dogs")
    assert ids and not {PAD_ID, BOS_ID, EOS_ID} & set(ids)  # encode adds no BOS/EOS


# Text SentencePiece gives back unchanged (see the module docstring): words of any characters but
# spaces, surrogates (not encodable) and U+2581 (SentencePiece's space marker), joined by one space.
_words = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters=" \u2581"), min_size=1, max_size=12
)
_texts = st.lists(_words, min_size=1, max_size=8).map(" ".join)


@settings(max_examples=300, deadline=None)
@given(_texts)
def test_round_trip_any_unicode_text(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert UNK_ID not in ids  # byte fallback spells unseen characters as bytes
    assert tok.decode(ids) == text


def test_documented_normalization(tok: Tokenizer) -> None:
    # Only U+0020 spaces are normalized: trimmed and collapsed. Nothing else changes (no NFKC).
    assert tok.decode(tok.encode("  Two   dogs ")) == "Two dogs"
    assert tok.decode(tok.encode("ﬁ ＡＢ e\u0301")) == "ﬁ ＡＢ e\u0301"
    assert tok.decode(tok.encode("a\tb\u3000c")) == "a\tb\u3000c"
    assert tok.decode(tok.encode("a\u2581b")) == "a b"  # SentencePiece's space marker reads as a space


def test_unseen_characters_use_byte_pieces(tok: Tokenizer) -> None:
    pieces = [tok.id_to_piece(i) for i in tok.encode("猫")]
    assert pieces[-3:] == ["<0xE7>", "<0x8C>", "<0xAB>"]  # the three UTF-8 bytes of 猫


def test_decode_drops_specials_and_takes_tensors(tok: Tokenizer) -> None:
    ids = tok.encode("Two dogs")
    assert tok.decode([BOS_ID, *ids, EOS_ID, PAD_ID, PAD_ID]) == "Two dogs"
    assert tok.decode(torch.tensor([BOS_ID, *ids, EOS_ID])) == "Two dogs"
    with pytest.raises(AiaynError, match="outside the tokenizer's vocabulary"):
        tok.decode([tok.vocab_size + 5])


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    texts = ["Two dogs", "Ein Mann.", "x"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_training_is_deterministic() -> None:
    a = Tokenizer.train(CORPUS, vocab_size=350)
    b = Tokenizer.train(list(CORPUS), vocab_size=350)
    assert a.sha256() == b.sha256() and a == b


def test_training_uses_many_threads_and_the_model_does_not_depend_on_the_machine(monkeypatch) -> None:
    """SentencePiece's merges depend on its thread count, so the count is a constant above one: a
    prepare on a 2-core and on a 64-core machine gives the same model (and so the same data digest)."""
    import aiayn.tokenizer as T

    models = []
    for cores in (1, 64):
        monkeypatch.setattr(os, "cpu_count", lambda: cores)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
        assert T._trainer_options(350, "bpe")["num_threads"] == T.SPM_THREADS > 1
        models.append(Tokenizer.train(CORPUS, vocab_size=350).sha256())
    assert models[0] == models[1]


def test_vocab_size_is_an_upper_bound_and_too_small_is_clear(tok: Tokenizer) -> None:
    assert tok.vocab_size == 400
    assert Tokenizer.train(CORPUS, vocab_size=8000).vocab_size < 8000  # small corpus, smaller vocabulary
    with pytest.raises(AiaynError, match=r"--vocab-size 100 is too small.*at least \d+"):
        Tokenizer.train(CORPUS, vocab_size=100)


def test_unigram_option_and_bad_type() -> None:
    uni = Tokenizer.train(CORPUS, vocab_size=350, model_type="unigram")
    assert uni.model_type == "unigram"
    assert uni.decode(uni.encode("Zwei Hunde spielen.")) == "Zwei Hunde spielen."
    with pytest.raises(AiaynError, match="bpe, unigram"):
        Tokenizer.train(CORPUS, vocab_size=350, model_type="wordpiece")


def test_save_load_is_atomic_and_exact(tok: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "sub" / "spm.model"
    tok.save(path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["spm.model"]  # no temporary left behind
    loaded = Tokenizer.load(path)
    assert loaded.sha256() == tok.sha256() and loaded.model_type == "bpe"
    assert loaded.encode("Two dogs are playing") == tok.encode("Two dogs are playing")


def test_load_errors_are_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(AiaynError, match="not found"):
        Tokenizer.load(tmp_path / "nope.model")
    (tmp_path / "empty.model").write_bytes(b"")
    with pytest.raises(AiaynError, match="empty"):
        Tokenizer.load(tmp_path / "empty.model")
    (tmp_path / "bad.model").write_bytes(b"\x00garbage\xff" * 10)
    with pytest.raises(AiaynError, match="bad.model: not a SentencePiece model") as e:
        Tokenizer.load(tmp_path / "bad.model")
    assert "\n" not in str(e.value)


def test_foreign_special_ids_are_refused(tmp_path: Path) -> None:
    # A SentencePiece model with the library's default ids (unk 0, bos 1, eos 2, no pad).
    path = tmp_path / "foreign"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(path), vocab_size=60, minloglevel=2
    )
    with pytest.raises(AiaynError, match="special ids"):
        Tokenizer.load(f"{path}.model")


def test_pair_save_load_joint_and_separate(tok: Tokenizer, tmp_path: Path) -> None:
    joint = TokenizerPair(tok, tok, joint=True)
    joint.save(tmp_path / "j")
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == ["spm.model"]
    back = TokenizerPair.load(tmp_path / "j")
    assert back.joint and back.src is back.tgt and back.src == tok

    other = Tokenizer.train(CORPUS[:2] * 10, vocab_size=300)
    sep = TokenizerPair(tok, other, joint=False)
    sep.save(tmp_path / "s")
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["src.spm.model", "tgt.spm.model"]
    back = TokenizerPair.load(tmp_path / "s")
    assert not back.joint and back.src == tok and back.tgt == other
    d = back.describe()
    assert d["src_sha256"] == tok.sha256() and d["tgt_vocab_size"] == other.vocab_size and d["model_type"] == "bpe"

    with pytest.raises(AiaynError, match="no tokenizer found"):
        TokenizerPair.load(tmp_path)
    with pytest.raises(AiaynError, match="same model"):
        TokenizerPair(tok, other, joint=True)


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(s + "\n" for s in lines), encoding="utf-8")
    return path


def test_build_tokenizers_caches_by_data_and_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _write(tmp_path / "train.de", [s for s in CORPUS if s[0] in "EZ"])
    tgt = _write(tmp_path / "train.en", [s for s in CORPUS if s[0] in "AT"])
    cache = tmp_path / "cache"
    first = build_tokenizers(src, tgt, 350, cache_dir=cache)
    assert first.joint and first.src is first.tgt

    def no_training(*a: object, **k: object) -> Tokenizer:
        raise AssertionError("trained again although cached")

    with monkeypatch.context() as m:
        m.setattr(Tokenizer, "train", no_training)
        again = build_tokenizers(src, tgt, 350, cache_dir=cache)
    assert again.src.sha256() == first.src.sha256()
    entry = next(cache.iterdir())
    assert sorted(p.name for p in entry.iterdir()) == ["settings.json", "spm.model"]
    (entry / "spm.model").write_bytes(b"half a model")  # a damaged entry is retrained, not trusted
    assert build_tokenizers(src, tgt, 350, cache_dir=cache).src.sha256() == first.src.sha256()

    # Other data or other settings: a new cache entry, not the old model.
    _write(tgt, ["A cat sleeps on a sofa."] * 50)
    changed = build_tokenizers(src, tgt, 350, cache_dir=cache)
    assert changed.src.sha256() != first.src.sha256()
    sep = build_tokenizers(src, tgt, 300, joint=False, cache_dir=cache)
    assert not sep.joint and sep.src != sep.tgt
    assert len(list(cache.iterdir())) == 3


def test_build_tokenizers_default_cache_is_the_user_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    src = _write(tmp_path / "a", CORPUS[:3] * 5)
    tgt = _write(tmp_path / "b", CORPUS[3:6] * 5)
    build_tokenizers(src, tgt, 300)
    assert list((tmp_path / "xdg" / "aiayn" / "spm").glob("*/spm.model"))
    assert files.default_cache_dir() == tmp_path / "xdg" / "aiayn"


def test_build_tokenizers_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AiaynError, match="missing.de: no such file"):
        build_tokenizers(tmp_path / "missing.de", tmp_path / "missing.en", 300, cache_dir=tmp_path)


DATA = os.environ.get("AIAYN_DATA")


@pytest.mark.skipif(not DATA or not Path(DATA, "multi30k").is_dir(), reason="AIAYN_DATA (Multi30k) not set")
def test_multi30k_joint_bpe_8k(tmp_path: Path) -> None:
    from aiayn.data.text import multi30k_paths, read_parallel

    src, tgt = multi30k_paths("train", "de", "en", DATA)
    t0 = time.perf_counter()
    pair = build_tokenizers(src, tgt, 8000, cache_dir=tmp_path)
    seconds = time.perf_counter() - t0
    print(f"8k joint BPE on Multi30k train de+en (58,000 lines): {seconds:.2f} s")
    assert pair.joint and pair.src.vocab_size == 8000
    val_de, val_en = read_parallel(*multi30k_paths("val", "de", "en", DATA))
    for lines in (val_de, val_en):
        ids = pair.src.encode_batch(lines)
        assert all(UNK_ID not in x for x in ids)
        assert [pair.src.decode(x) for x in ids] == [re.sub(" +", " ", s.strip(" ")) for s in lines]
        mean = sum(map(len, ids)) / len(ids)
        assert 10 < mean < 25  # Multi30k captions are ~12 words; subwords add a little


def test_decode_drops_every_special_id_as_transformers_does(tok: Tokenizer) -> None:
    """<unk> in a translation is dropped, not spelled " ⁇ " (transformers' skip_special_tokens)."""
    ids = tok.encode("Two dogs")
    assert tok.decode([BOS_ID, ids[0], UNK_ID, *ids[1:], EOS_ID, PAD_ID]) == tok.decode(ids) == "Two dogs"


def test_a_lone_surrogate_is_a_one_line_error(tok: Tokenizer) -> None:
    """Bytes that are not UTF-8 on a command line reach Python as lone surrogates
    (`plot attention --src $'\\xff'`); SentencePiece's TypeError was a traceback."""
    with pytest.raises(AiaynError, match=r"character 5 is a lone surrogate \(U\+DCFF.*give UTF-8 text") as e:
        tok.encode_batch(["Zwei Hunde", "Ein \udcff Hund"])
    assert "\n" not in str(e.value)
    with pytest.raises(AiaynError, match="lone surrogate"):
        tok.encode("\ud800")
    assert tok.decode(tok.encode("Zwei Hunde")) == "Zwei Hunde"  # the usual path is unchanged

