"""From a cold review of `aiayn export` and the CTranslate2 engine: what the engine cannot do is
refused through the Python API too, as the command refuses it, not ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from aiayn.checkpoint import save_checkpoint
from aiayn.config import preset
from aiayn.errors import AiaynError
from aiayn.model import Transformer
from aiayn.tokenizer import Tokenizer, TokenizerPair

import lexicon


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A CTranslate2 export of an untrained tiny checkpoint."""
    pytest.importorskip("ctranslate2")
    from aiayn.export import export_ctranslate2

    root = tmp_path_factory.mktemp("export-review")
    tok = Tokenizer.train([f"{w} {v}" for w in lexicon.SRC for v in lexicon.TGT], 300)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size))
    save_checkpoint(root / "ckpt", model, TokenizerPair(tok, tok, joint=True), {"train": {}, "step": 1})
    return export_ctranslate2(root / "ckpt", root / "ct2")


def test_the_ctranslate2_translator_refuses_a_stop_rule_it_cannot_keep(export):
    """stop_rule="first" was taken and ignored: CTranslate2 searched on as "best" does, without a
    word (the command's --engine ctranslate2 --stop-rule first is refused)."""
    from aiayn.translator import CT2Translator

    t = CT2Translator(export, threads=1)
    with pytest.raises(AiaynError, match="stop_rule 'first'.*torch engine"):
        t.translate(["a dog runs"], beam=4, stop_rule="first", max_len_b=3)
    assert len(t.translate(["a dog runs"], beam=4, stop_rule="best", max_len_b=3)) == 1
    assert len(t.translate(["a dog runs"], beam=4, max_len_b=3)) == 1


def test_a_ctranslate2_export_given_as_a_checkpoint_says_what_to_give(tmp_path, capsys):
    """`aiayn serve --checkpoint export/ct2` (or train --init-from it) said 'config.json has no "model"
    section; it is not an aiayn checkpoint config'; export alone named it."""
    from aiayn.cli import main

    ct2 = tmp_path / "ct2"
    ct2.mkdir()
    (ct2 / "model.bin").write_bytes(b"\0")
    (ct2 / "config.json").write_text('{"add_source_bos": false}')
    (ct2 / "aiayn.json").write_text('{"aiayn_checkpoint": "runs/x/best"}')
    assert main(["train", "--init-from", str(ct2), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"aiayn train: error: {ct2} is an aiayn export to CTranslate2, not a "
                                       "checkpoint: give the checkpoint it was made from (translate and evaluate run "
                                       "the export with --engine ctranslate2)\n")


def test_ctranslate2_searches_each_sentence_within_its_own_length_limit(export):
    """CTranslate2 took one max_decoding_length per batch (the longest sentence's limit) and cut each
    hypothesis to its sentence's limit afterwards: a short sentence's n-best then held the same ids
    twice, with the scores of the longer hypotheses that were cut, unlike searching it alone."""
    from aiayn.translator import CT2Translator

    t = CT2Translator(export, threads=1)
    sources = [list(range(10, 10 + n)) for n in (1, 3, 14, 0, 6, 2, 9)]  # limits 1, 2, 8, -, 4, 2, 5
    for settings in (dict(beam=4, nbest=4), dict(beam=1, min_len=3)):  # greedy: one search, each cut
        settings.update(max_len_a=0.5, max_len_b=1)
        batch = t.translate_ids(sources, **settings)
        for src, nbest in zip(sources, batch):
            limit = max(1, int(len(src) * 0.5 + 1))
            ids = [tuple(h) for h, _ in nbest]
            assert len(nbest) == settings.get("nbest", 1) and all(len(h) <= limit for h in ids)
            if src:
                assert len(set(ids)) == len(ids), f"duplicate hypotheses for a source of {len(src)}: {ids}"
            assert str(nbest) == str(t.translate_ids([src], **settings)[0])  # as searched alone (str: nan)
