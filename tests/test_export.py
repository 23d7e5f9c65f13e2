"""Exports to Hugging Face (Marian) and CTranslate2 translate exactly as aiayn does.

A tiny model is trained for a few seconds on a synthetic task (translate words through a fixed
dictionary and reverse their order), so that it stops by itself with EOS and its outputs vary;
exports of it must give the same token ids as aiayn's own greedy search, and (HF) beam search,
when used the way their users use them: the exported tokenizer's default call, `pipeline`, and
CTranslate2 fed SentencePiece pieces plus "</s>" (the source ends with EOS, as aiayn feeds it).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch

from aiayn.checkpoint import save_checkpoint
from aiayn.cli import main
from aiayn.config import preset
from aiayn.errors import AiaynError
from aiayn.model import Transformer, sinusoidal_table
from aiayn.search import beam_search, greedy_search
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID, Tokenizer, TokenizerPair
from aiayn.translate import Translator

import lexicon

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint dir, model, tokenizers, test source lines): about 10 s of training on one thread."""
    ckpt = tmp_path_factory.mktemp("export") / "ckpt"
    model, pair, lines = lexicon.train(ckpt, d_model=32, d_ff=64, steps=150, lr=1e-2, n_lines=24, train_meta={})
    yield ckpt, model, pair, lines


def _src(tok: Tokenizer, lines: list[str]) -> torch.Tensor:
    """The padded source aiayn feeds a model with `source_eos`: subwords, then EOS."""
    ids = [row + [EOS_ID] for row in tok.encode_batch(lines)]
    src = torch.full((len(ids), max(map(len, ids))), PAD_ID)
    for i, row in enumerate(ids):
        src[i, : len(row)] = torch.tensor(row)
    return src


def _strip(row: list[int]) -> list[int]:
    """HF output row -> ids without the start token, cut at EOS."""
    row = row[1:]
    return row[: row.index(EOS_ID)] if EOS_ID in row else row


# ------------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("shared,tied,activation", [(True, True, "relu"), (False, False, "gelu")])
def test_marian_computes_the_same_logits_after_save_and_load(tmp_path, shared, tied, activation):
    transformers = pytest.importorskip("transformers")
    from aiayn.export import to_marian

    cfg = preset("tiny", src_vocab_size=40, tgt_vocab_size=40 if shared else 37, share_embeddings=shared,
                 tie_output=tied, activation=activation, max_positions=64)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # non-zero biases and norms, so a wrongly permuted vector would show
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    hf = to_marian(model)
    hf.save_pretrained(tmp_path)
    reloaded = transformers.MarianMTModel.from_pretrained(tmp_path).eval()
    src = torch.randint(4, 40, (3, 9))
    src[0, 6:] = PAD_ID
    tgt = torch.randint(4, cfg.tgt_vocab_size, (3, 7))
    tgt[:, 0] = BOS_ID
    with torch.no_grad():
        ours = model(src, tgt)
        for m in (hf, reloaded):
            theirs = m(input_ids=src, attention_mask=src.ne(PAD_ID), decoder_input_ids=tgt).logits
            assert theirs.shape == ours.shape
            assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)


def test_feature_permutation_maps_our_sinusoids_onto_marians():
    pytest.importorskip("transformers")
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    from aiayn.export import feature_permutation

    emb = MarianSinusoidalPositionalEmbedding(50, 16)
    marian = emb.create_weight()
    assert torch.allclose(sinusoidal_table(50, 16)[:, feature_permutation(16)], marian, atol=1e-6)
    assert not torch.allclose(sinusoidal_table(50, 16), marian, atol=1e-2)  # the layouts do differ


def test_the_exports_generate_stops_as_aiayns_default_rule():
    """generate's early_stopping=False is aiayn's default --stop-rule best (it was True, the rule
    aiayn had before, so the export's default beam search stopped differently)."""
    from aiayn.export import generation_config
    from aiayn.search import DEFAULT_STOP_RULE

    model = Transformer(preset("tiny", src_vocab_size=40, tgt_vocab_size=40))
    assert DEFAULT_STOP_RULE == "best" and generation_config(model).early_stopping is False


def test_pre_norm_model_is_refused_for_hf_with_a_clear_error():
    pytest.importorskip("transformers")
    from aiayn.export import to_marian

    model = Transformer(preset("tiny", src_vocab_size=30, tgt_vocab_size=30, norm_first=True))
    with pytest.raises(AiaynError, match="pre-norm.*ctranslate2"):
        to_marian(model)


def test_hf_export_translates_like_aiayn_greedy_and_beam(trained, tmp_path, monkeypatch, capfd):
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ckpt, model, pair, lines = trained
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", str(ckpt), "--to", "hf", str(out)]) == 0
    assert capfd.readouterr().err == ""  # no progress bar of transformers' for a save of one file
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # and left as it was
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(tok, transformers.MarianTokenizer)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    assert (hf.config.pad_token_id, hf.config.eos_token_id, hf.config.decoder_start_token_id) == (0, 3, 2)

    enc = tok(lines, padding=True, return_tensors="pt")  # the default call, as every user makes it
    src = _src(pair.src, lines)
    assert torch.equal(enc["input_ids"], src)  # the same source ids aiayn feeds, EOS included
    limits = (src.ne(PAD_ID).sum(1) + 50).tolist()  # aiayn's default max length: source length + 50
    with torch.no_grad():
        ours = greedy_search(model, src, BOS_ID, EOS_ID)
        theirs = hf.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=max(limits))
    theirs_ids = [_strip(r)[:n] for r, n in zip(theirs.tolist(), limits)]
    assert theirs_ids == ours
    assert len({len(h) for h in ours}) > 3  # varied outputs, not a degenerate model
    texts = tok.batch_decode(theirs, skip_special_tokens=True)
    assert texts == [pair.tgt.decode(h) for h in ours]
    assert texts == Translator(model, pair).translate(lines, beam=1)  # aiayn's own text-in, text-out path

    # Beam 4: transformers divides by len**alpha, aiayn by ((5 + len) / 6)**alpha; with alpha = 0 both
    # rank by the summed log-probability, under which no longer hypothesis can beat a finished one, so
    # generate's early stopping and aiayn's rules (both) end at the same place.
    with torch.no_grad():
        ours_b = beam_search(model, src, BOS_ID, EOS_ID, beam=4, alpha=0.0, nbest=4)
        theirs_b = hf.generate(**enc, num_beams=4, length_penalty=0.0, early_stopping=True,
                               max_new_tokens=max(limits) + 1)
    # Compare sentences whose search never reached the length limit (where aiayn forces EOS).
    free = [i for i, hyps in enumerate(ours_b) if all(len(h) < limits[i] for h, _ in hyps)]
    assert len(free) >= len(lines) // 2
    for i in free:
        assert _strip(theirs_b[i].tolist()) == ours_b[i][0][0], lines[i]


HF4 = Path(sys.prefix) / "hf4"  # transformers 4.x beside the venv's 5.x (`make install-test` puts it there)
_PIPELINE = """
import json, sys
import transformers
from aiayn.cli import main
ckpt, out, lines, result = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
assert main(["export", "--checkpoint", ckpt, "--to", "hf", out]) == 0
pipe = transformers.pipeline("translation", model=out, device="cpu")
got = pipe(lines, num_beams=1, do_sample=False, max_new_tokens=64)
with open(result, "w") as f:
    json.dump({"version": transformers.__version__, "texts": [r["translation_text"] for r in got]}, f)
"""


def test_hf_translation_pipeline_translates_like_aiayn(trained, tmp_path):
    """`pipeline("translation")` on a folder exported with transformers 4 (version 5 removed the
    task): run in a subprocess with $VENV/hf4 first on the path, so the venv keeps transformers 5."""
    if not HF4.is_dir():
        if os.environ.get("CI") == "true":
            pytest.fail(f"{HF4} is missing; run `make install-test`")
        pytest.skip(f"{HF4} (transformers 4) is missing; `make install-test` installs it")
    ckpt, model, pair, lines = trained
    result = tmp_path / "result.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(
        [str(HF4), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", _PIPELINE, str(ckpt), str(tmp_path / "hf"), json.dumps(lines),
                           str(result)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(result.read_text())
    assert got["version"].startswith("4.")
    assert got["texts"] == Translator(model, pair).translate(lines, beam=1, max_len_a=0.0, max_len_b=64)


def test_hf_tokenizer_reproduces_aiayn_ids_and_text(trained, tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from aiayn.export import save_hf_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, _, pair, _ = trained
    save_hf_tokenizer(pair, tmp_path)
    tok = transformers.MarianTokenizer.from_pretrained(tmp_path)
    texts = ["a dog runs in the park", "Zürich café — 東京 ✓", "the  big   ball"]  # unseen characters: byte pieces
    for text in texts:
        ids = pair.src.encode(text)
        assert tok(text)["input_ids"] == ids + [EOS_ID]  # the default call: aiayn's source, EOS ended
        assert tok(text, add_special_tokens=False)["input_ids"] == ids  # a model trained on bare sources
        assert tok.decode([BOS_ID, *ids, EOS_ID, PAD_ID], skip_special_tokens=True) == pair.tgt.decode(ids)


def test_hf_tokenizer_with_separate_vocabularies(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from aiayn.export import save_hf_tokenizer

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = Tokenizer.train([" ".join(lexicon.SRC[i:] + lexicon.SRC[:i]) for i in range(len(lexicon.SRC))], 300)
    tgt = Tokenizer.train([" ".join(lexicon.TGT[i:] + lexicon.TGT[:i]) for i in range(len(lexicon.TGT))], 290)
    pair = TokenizerPair(src, tgt, joint=False)
    save_hf_tokenizer(pair, tmp_path)
    assert (tmp_path / "target_vocab.json").is_file()
    tok = transformers.MarianTokenizer.from_pretrained(tmp_path)
    assert tok("the dog plays", add_special_tokens=False)["input_ids"] == src.encode("the dog plays")
    ids = tgt.encode("der hund spielt")
    assert ids != src.encode("der hund spielt")  # the two vocabularies really differ
    assert tok(text_target="der hund spielt", add_special_tokens=False)["input_ids"] == ids
    assert tok.decode(ids + [EOS_ID], skip_special_tokens=True) == "der hund spielt"


def test_hf_tokenizer_truncates_to_the_models_positions(tmp_path, monkeypatch):
    """Marian's table of positions does not grow: the exported tokenizer's model_max_length was 1024
    whatever the model's max_positions, so `truncation=True` let a long source through and
    `generate` failed with an IndexError (an imported OPUS-MT model had 512, its tokenizer too)."""
    transformers = pytest.importorskip("transformers")
    from aiayn.export import export_hf

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tok = Tokenizer.train([f"{w} {v}" for w in lexicon.SRC for v in lexicon.TGT], 300)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, max_positions=48))
    save_checkpoint(tmp_path / "ckpt", model, TokenizerPair(tok, tok, joint=True), {"train": {}, "step": 1})
    export_hf(tmp_path / "ckpt", tmp_path / "hf")
    hf_tok = transformers.MarianTokenizer.from_pretrained(tmp_path / "hf")
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    enc = hf_tok([" ".join(lexicon.SRC * 4)], truncation=True, return_tensors="pt")
    assert enc["input_ids"].shape == (1, 48)
    with torch.no_grad():
        hf.generate(**enc, num_beams=1, max_length=8)


# -------------------------------------------------------------------------------- CTranslate2


def test_ctranslate2_export_greedy_is_identical(trained, tmp_path):
    pytest.importorskip("ctranslate2")
    from aiayn.translate import CT2Translator

    ckpt, model, pair, lines = trained
    out = tmp_path / "ct2"
    assert main(["export", "--checkpoint", str(ckpt), "--to", "ctranslate2", str(out)]) == 0
    assert (out / "model.bin").is_file() and (out / "spm.model").is_file()
    ct2 = CT2Translator(out, threads=1)

    def best(nbests):  # type: ignore[no-untyped-def]
        return [nb[0][0] for nb in nbests]

    src = _src(pair.src, lines)
    with torch.no_grad():
        ours = greedy_search(model, src, BOS_ID, EOS_ID)
        ours_short = greedy_search(model, src, BOS_ID, EOS_ID, max_len_a=0.5, max_len_b=1)
    ids = [row + [EOS_ID] for row in pair.src.encode_batch(lines)]
    assert best(ct2.translate_ids(ids, beam=1)) == ours
    assert best(ct2.translate_ids(ids, beam=1, max_len_a=0.5, max_len_b=1)) == ours_short  # aiayn's length limit
    texts = ct2.translate(lines + ["", "   "], beam=1)
    assert texts == [pair.tgt.decode(h) for h in ours] + ["", ""]
    # CTranslate2 alone, as its documentation shows: SentencePiece pieces, then "</s>"
    import ctranslate2
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "spm.model"))
    plain = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    res = plain.translate_batch([sp.encode(line, out_type=str) + ["</s>"] for line in lines], beam_size=1)
    assert [sp.decode(r.hypotheses[0]) for r in res] == texts[: len(lines)]
    # The Translator contract: nbest lines per input, scores best first; beam 4 mostly agrees with aiayn's.
    res = ct2.search(lines[:4] + [""], beam=4, alpha=0.6, nbest=2)
    assert [len(nb) for nb in res] == [2, 2, 2, 2, 2] and res[-1] == [("", 0.0)] * 2  # nbest for a blank line too
    assert all(nb[0][1] >= nb[1][1] for nb in res[:4])
    assert len(ct2.translate(lines[:3], beam=4, nbest=2)) == 6
    with torch.no_grad():
        ours_b = [nb[0][0] for nb in beam_search(model, src, BOS_ID, EOS_ID, beam=4, alpha=0.6)]
    assert sum(h == o for h, o in zip(best(ct2.translate_ids(ids, beam=4)), ours_b)) >= len(lines) * 3 // 4


def test_translate_cli_with_ctranslate2_engine_matches_torch(trained, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    from aiayn.export import export_ctranslate2

    ckpt, _, _, lines = trained
    export_ctranslate2(ckpt, tmp_path / "ct2")
    (tmp_path / "in.txt").write_text("\n".join(lines[:8] + ["", lines[8]]) + "\n", encoding="utf-8")
    common = ["--input", str(tmp_path / "in.txt"), "--beam", "1"]
    assert main(["translate", "--checkpoint", str(ckpt), *common, "--output", str(tmp_path / "torch.txt")]) == 0
    assert main(["translate", "--engine", "ctranslate2", "--checkpoint", str(tmp_path / "ct2"), *common,
                 "--output", str(tmp_path / "ct2.txt")]) == 0
    torch_out = (tmp_path / "torch.txt").read_text(encoding="utf-8")
    assert (tmp_path / "ct2.txt").read_text(encoding="utf-8") == torch_out and len(torch_out.splitlines()) == 10
    capsys.readouterr()
    assert main(["translate", "--engine", "ctranslate2", "--checkpoint", str(ckpt), *common]) == 2
    assert "not a CTranslate2 export" in capsys.readouterr().err


def test_evaluate_scores_a_ctranslate2_export_with_its_engine(trained, tmp_path, capsys):
    """evaluate --engine ctranslate2 translates with the export as translate --engine does, then
    scores; without the flag an export is a one-line hint, as in translate."""
    pytest.importorskip("ctranslate2")
    import json

    from aiayn.export import export_ctranslate2

    ckpt, _, _, lines = trained
    export_ctranslate2(ckpt, tmp_path / "ct2")
    (tmp_path / "src.txt").write_text("\n".join(lines[:8]) + "\n", encoding="utf-8")
    (tmp_path / "ref.txt").write_text("\n".join(lines[:8]) + "\n", encoding="utf-8")
    files = ["--src-file", str(tmp_path / "src.txt"), "--ref-file", str(tmp_path / "ref.txt"), "--beam", "1"]
    assert main(["evaluate", "--engine", "ctranslate2", "--checkpoint", str(tmp_path / "ct2"), *files, "--json",
                 "--save-hyps", str(tmp_path / "hyps.txt")]) == 0
    got = json.loads(capsys.readouterr().out)
    assert main(["translate", "--engine", "ctranslate2", "--checkpoint", str(tmp_path / "ct2"), "--beam", "1",
                 "--input", str(tmp_path / "src.txt"), "--output", str(tmp_path / "want.txt")]) == 0
    assert (tmp_path / "hyps.txt").read_text(encoding="utf-8") == (tmp_path / "want.txt").read_text(encoding="utf-8")
    assert got["precision"] == "fp32" and "bleu" in got
    export_ctranslate2(ckpt, tmp_path / "int8", quantization="int8")  # runs int8 by default: so it says
    assert main(["evaluate", "--engine", "ctranslate2", "--checkpoint", str(tmp_path / "int8"), *files, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "int8"
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(tmp_path / "ct2"), *files]) == 2
    err = capsys.readouterr().err
    assert "is a CTranslate2 export" in err and "--engine ctranslate2" in err and err.count("\n") == 1


def test_ctranslate2_translator_truncates_long_lines_with_a_note(trained, tmp_path):
    pytest.importorskip("ctranslate2")
    from aiayn.export import export_ctranslate2
    from aiayn.translate import CT2Translator

    ckpt, _, pair, _ = trained
    export_ctranslate2(ckpt, tmp_path / "ct2")
    notes: list[str] = []
    ct2 = CT2Translator(tmp_path / "ct2", threads=1, note=notes.append)
    long_line = " ".join(["dog"] * 200)  # 200 tokens > max_positions 128
    out = ct2.translate(["a dog", long_line], beam=1, max_len_b=3)
    assert len(out) == 2 and len(notes) == 1 and notes[0].startswith("line 2: 200 source tokens")
    with pytest.raises(AiaynError, match="not a CTranslate2 export"):
        CT2Translator(ckpt)


def test_ctranslate2_int8_and_pre_norm(tmp_path):
    pytest.importorskip("ctranslate2")
    from aiayn.export import export_ctranslate2
    from aiayn.translate import CT2Translator

    tok = Tokenizer.train([f"{w} {v}" for w in lexicon.SRC for v in lexicon.TGT], 300)
    pair = TokenizerPair(tok, tok, joint=True)
    cfg = preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, norm_first=True,
                 activation="gelu", max_positions=64)
    model = Transformer(cfg).eval()
    save_checkpoint(tmp_path / "ckpt", model, pair, {"train": {}, "step": 0})
    lines = ["a dog runs", "the big red ball plays with a girl in the park", "boy"]
    src = _src(tok, lines)
    with torch.no_grad():
        ours = greedy_search(model, src, BOS_ID, EOS_ID, max_len_b=8)  # random weights: runs to the limit
    ids = [row + [EOS_ID] for row in tok.encode_batch(lines)]
    export_ctranslate2(tmp_path / "ckpt", tmp_path / "fp32")
    got = CT2Translator(tmp_path / "fp32", threads=1).translate_ids(ids, 1, max_len_b=8)
    assert [nb[0][0] for nb in got] == ours
    export_ctranslate2(tmp_path / "ckpt", tmp_path / "int8", quantization="int8")
    assert (tmp_path / "int8" / "model.bin").stat().st_size < (tmp_path / "fp32" / "model.bin").stat().st_size
    got = CT2Translator(tmp_path / "int8", threads=1).translate_ids(ids, 1, max_len_b=8)
    assert [len(nb[0][0]) for nb in got] == [len(h) for h in ours]  # random weights: only the lengths hold


def test_ctranslate2_int8_of_a_trained_model_translates_as_fp32(tmp_path_factory):
    """Random weights run to the length cap whatever int8 does to them; a trained model's ids must
    match the fp32 export's (and ours), sentence by sentence, nearly always; on a CPU without VNNI,
    where CTranslate2's int8 saturates (`lexicon.ct2_int8_drifts`), come close to them."""
    pytest.importorskip("ctranslate2")
    from serve_model import sentence, tiny_checkpoint

    from aiayn.export import export_ctranslate2
    from aiayn.translate import CT2Translator

    ckpt = tiny_checkpoint(tmp_path_factory.getbasetemp())  # the serve tests' word-by-word de->en model
    out = tmp_path_factory.mktemp("ct2-int8")
    rng = random.Random(7)
    lines = [sentence(rng)[0] for _ in range(40)]
    ours = Translator.from_checkpoint(ckpt)
    ids = ours.encode(lines)
    want = [nb[0][0] for nb in ours.search_ids(lines, beam=1, max_len_b=20)]
    export_ctranslate2(ckpt, out / "fp32")
    export_ctranslate2(ckpt, out / "int8", quantization="int8")
    fp32 = [nb[0][0] for nb in CT2Translator(out / "fp32", threads=1).translate_ids(ids, 1, max_len_b=20)]
    int8 = [nb[0][0] for nb in CT2Translator(out / "int8", threads=1).translate_ids(ids, 1, max_len_b=20)]
    assert fp32 == want
    if lexicon.ct2_int8_drifts():  # close to fp32's ids (AVX2-only Zen 3: BLEU 71, 10 of 40 equal), not equal
        said = [" ".join(map(str, ids)) for ids in int8]
        score = sacrebleu.corpus_bleu(said, [[" ".join(map(str, ids)) for ids in fp32]], tokenize="none").score
        assert score >= 50, list(zip(int8, fp32))
    else:
        assert sum(a == b for a, b in zip(int8, fp32)) >= 0.9 * len(lines), list(zip(int8, fp32))


def test_ctranslate2_output_stops_at_the_exports_last_position(tmp_path):
    # a 60-token source with max_len_b 50 would run past position 64, where the export's table of
    # positions ends (CTranslate2 raised there); min_len 64 keeps greedy from stopping at an EOS first
    pytest.importorskip("ctranslate2")
    from aiayn.export import export_ctranslate2
    from aiayn.translate import CT2Translator

    tok = Tokenizer.train([f"{w} {v}" for w in lexicon.SRC for v in lexicon.TGT], 300)
    cfg = preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size, max_positions=64)
    torch.manual_seed(0)
    save_checkpoint(tmp_path / "ckpt", Transformer(cfg).eval(), TokenizerPair(tok, tok, joint=True),
                    {"train": {}, "step": 0})
    export_ctranslate2(tmp_path / "ckpt", tmp_path / "ct2")
    ids = [(tok.encode_batch(["dog"])[0] * 60)[:59] + [EOS_ID]]
    ct2 = CT2Translator(tmp_path / "ct2", threads=1)
    assert len(ct2.translate_ids(ids, 1, max_len_b=50, min_len=64)[0][0][0]) == 64  # ran to the cap
    assert 0 < len(ct2.translate_ids(ids, 2, max_len_b=50)[0][0][0]) <= 64


def test_ctranslate2_export_leaves_the_model_untouched(tmp_path):
    pytest.importorskip("ctranslate2")
    from aiayn.export import to_ctranslate2, to_marian

    tok = Tokenizer.train([f"{w} {v}" for w in lexicon.SRC for v in lexicon.TGT], 300)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    to_ctranslate2(model, TokenizerPair(tok, tok, joint=True), tmp_path / "int8", quantization="int8")
    if importlib.util.find_spec("transformers"):
        to_marian(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_ctranslate2_export_of_a_model_on_bare_sources_says_so(tmp_path, capsys):
    """A checkpoint from before `source_eos` wants its source without "</s>" in plain CTranslate2 (as
    the README says, `aiayn export` says so), and `CT2Translator` feeds it bare, as aiayn does."""
    pytest.importorskip("ctranslate2")
    import json

    from aiayn.translate import CT2Translator

    tok = Tokenizer.train([f"{w} {v}" for w in lexicon.SRC for v in lexicon.TGT], 300)
    pair = TokenizerPair(tok, tok, joint=True)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size)).eval()
    ckpt = tmp_path / "old"
    save_checkpoint(ckpt, model, pair, {"train": {}, "step": 1})
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["model"]["source_eos"]  # as written before the field existed
    (ckpt / "config.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(ckpt), "--to", "ctranslate2", str(tmp_path / "ct2")]) == 0
    said = capsys.readouterr().out
    assert "without EOS" in said and '"</s>"' in said, said
    assert CT2Translator(tmp_path / "ct2", threads=1).source_eos is False


def test_export_never_replaces_the_checkpoint_or_a_folder_that_is_not_an_export(trained, tmp_path, capsys):
    pytest.importorskip("ctranslate2")
    import os
    import shutil
    import stat

    ckpt = tmp_path / "run" / "best"
    shutil.copytree(trained[0], ckpt)
    before = sorted(p.name for p in ckpt.iterdir())
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep")
    afile = tmp_path / "afile"
    afile.write_text("keep")
    opus = tmp_path / "opus"  # somebody else's Marian model
    opus.mkdir()
    (opus / "config.json").write_text('{"model_type": "marian"}')
    for out, words in ((ckpt, "is (or holds) the checkpoint"), (tmp_path / "run", "is (or holds) the checkpoint"),
                       (precious, "is not an earlier aiayn export"), (opus, "is not an earlier aiayn export"),
                       (afile / "out", "is a file, not a folder")):
        assert main(["export", "--checkpoint", str(tmp_path / "run"), "--to", "ctranslate2", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err
    assert sorted(p.name for p in ckpt.iterdir()) == before and (precious / "notes.txt").read_text() == "keep"
    assert (opus / "config.json").is_file()
    cwd = os.getcwd()
    try:
        os.chdir(precious)
        assert main(["export", "--checkpoint", str(ckpt), "--to", "ctranslate2", "."]) == 2
        assert "the current directory" in capsys.readouterr().err
    finally:
        os.chdir(cwd)
    out = tmp_path / "ct2"
    out.mkdir()  # an empty folder is taken
    for _ in range(2):  # an earlier export is replaced
        assert main(["export", "--checkpoint", str(ckpt), "--to", "ctranslate2", str(out)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's private 0700
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o666 & ~umask for f in out.iterdir())


def test_a_symlink_out_is_refused_before_the_export_is_written(tmp_path, capsys, monkeypatch):
    """OUT as a symbolic link (to an earlier export) was refused only after the whole export was
    written, saying it had become one "since the export started"; now before the model loads."""
    import aiayn.checkpoint

    tok = Tokenizer.train([f"{w} {v}" for w in lexicon.SRC for v in lexicon.TGT], 300)
    model = Transformer(preset("tiny", src_vocab_size=tok.vocab_size, tgt_vocab_size=tok.vocab_size))
    save_checkpoint(tmp_path / "ckpt", model, TokenizerPair(tok, tok, joint=True), {"train": {}, "step": 1})
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    monkeypatch.setattr(aiayn.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("the model was loaded"))
    for out in ("link", "dangling"):
        for target in ("hf", "ctranslate2"):
            assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--to", target, str(tmp_path / out)]) == 2
            err = capsys.readouterr().err
            assert err == (f"aiayn export: error: OUT {tmp_path / out} is a symbolic link; name the folder it points "
                           "to, or choose a new OUT\n"), err
    assert (tmp_path / "link").is_symlink() and (tmp_path / "dangling").is_symlink()


def test_export_never_deletes_a_tmp_old_folder_it_did_not_write(trained, tmp_path, capsys):
    """The folder an existing OUT is moved aside to is removed only if it is an export's own."""
    pytest.importorskip("ctranslate2")
    out = tmp_path / "ct2"
    assert main(["export", "--checkpoint", str(trained[0]), "--to", "ctranslate2", str(out)]) == 0
    old = tmp_path / ".tmp-old-ct2"
    old.mkdir()
    (old / "thesis.tex").write_text("keep")
    assert main(["export", "--checkpoint", str(trained[0]), "--to", "ctranslate2", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(old) in err and "not an earlier aiayn export" in err, err
    assert (old / "thesis.tex").read_text() == "keep" and (out / "aiayn.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-ct2")] == []  # no half export left
    (old / "thesis.tex").unlink()
    (old / "aiayn.json").write_text("{}")  # a copy an interrupted export moved aside: its own, removed
    assert main(["export", "--checkpoint", str(trained[0]), "--to", "ctranslate2", str(out)]) == 0
    assert not old.exists() and (out / "aiayn.json").is_file()


@pytest.mark.parametrize("target,package", [("hf", "transformers"), ("ctranslate2", "ctranslate2")])
def test_reexport_never_deletes_what_it_did_not_write(trained, tmp_path, capsys, monkeypatch, target, package):
    """An earlier export is replaced whole, so OUT is taken only when it holds nothing but the files
    that export wrote: a README or a folder added to it since is refused, and kept."""
    pytest.importorskip(package)
    out = tmp_path / "imported" / target  # e.g. an export kept inside the checkpoint folder of an import
    argv = ["export", "--checkpoint", str(trained[0]), "--to", target, str(out)]
    assert main(argv) == 0
    capsys.readouterr()  # transformers' progress bars
    for extra in ("README.md", "sub"):
        (out / extra).mkdir() if extra == "sub" else (out / extra).write_text("keep")
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and extra in err and str(out) in err, err
        assert (out / extra).exists()
        shutil.rmtree(out / extra) if extra == "sub" else (out / extra).unlink()
    assert main(argv) == 0  # its own files only: replaced
    import aiayn.export as export

    checked = export._check_aside

    def meanwhile(folder):  # a file added to OUT while the export is written: seen before the swap
        if calls.append(1) or len(calls) == 2:
            (out / "notes.txt").write_text("keep")
        return checked(folder)

    calls: list[int] = []
    monkeypatch.setattr(export, "_check_aside", meanwhile)
    assert main(argv) == 2
    assert "notes.txt" in capsys.readouterr().err and (out / "notes.txt").read_text() == "keep"


# ------------------------------------------------------------------------------ without extras


@pytest.mark.parametrize("target,package", [("hf", "transformers"), ("ctranslate2", "ctranslate2")])
def test_missing_extra_says_what_to_install(trained, tmp_path, monkeypatch, capsys, target, package):
    real_import_module = importlib.import_module

    def no_extra(name, package=None):  # type: ignore[no-untyped-def]
        if name.split(".")[0] == package_name:
            raise ImportError(f"No module named {package_name!r}")
        return real_import_module(name, package)

    package_name = package
    monkeypatch.setattr(importlib, "import_module", no_extra)
    assert main(["export", "--checkpoint", str(trained[0]), "--to", target, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and package in err and "pip install 'aiayn[export]'" in err
    assert not (tmp_path / "out").exists()


def test_a_ctranslate2_export_of_an_import_records_it(trained, tmp_path):
    """An import's language pair is its Marian directory's, which evaluate's direction check trusts:
    the export says it is one (it recorded only the pair, and the check passed it by)."""
    pytest.importorskip("ctranslate2")
    import json
    import shutil

    from aiayn.export import export_ctranslate2

    ckpt = tmp_path / "imported"
    shutil.copytree(trained[0], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["imported_from"] = {"kind": "marian", "source": "opus-mt-de-en"}
    cfg["train"] = {"src": "de", "tgt": "en"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    export_ctranslate2(ckpt, tmp_path / "ct2")
    meta = json.loads((tmp_path / "ct2" / "aiayn.json").read_text())
    assert meta["imported_from"] == cfg["imported_from"] and meta["train"] == {"src": "de", "tgt": "en"}
