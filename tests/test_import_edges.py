"""Edges of `aiayn import --from marian` and of the Hugging Face / CTranslate2 exports that a bug
hunt found: each test failed before its fix.

Marian directories are built offline from the kept fixture (tests/marian_models.py) with
transformers' own classes; the reference is always what transformers itself computes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import marian_models as mm  # noqa: E402

from aiayn.errors import AiaynError  # noqa: E402
from aiayn.importer import convert  # noqa: E402
from aiayn.search import greedy_search  # noqa: E402
from aiayn.tokenizer import BOS_ID, EOS_ID, PAD_ID  # noqa: E402
from aiayn.translator import Translator  # noqa: E402

MAX_B = 30


def _sentences(n: int = 20) -> list[str]:
    if not mm.have_data():
        pytest.skip("Multi30k is not in AIAYN_DATA")
    return [s for s in mm.multi30k("val", "de", 300) if len(s.split()) <= mm.SHORT][:n]


def _hf_greedy(d: Path, lines: list[str]) -> list[list[int]]:
    """transformers' greedy target ids (Marian's), start, pad and EOS left out."""
    from transformers import MarianMTModel, MarianTokenizer

    hf, tok = MarianMTModel.from_pretrained(str(d)).eval(), MarianTokenizer.from_pretrained(str(d))
    with torch.no_grad():
        out = hf.generate(**tok(lines, return_tensors="pt", padding=True), do_sample=False, num_beams=1,
                          max_length=MAX_B + 2)
    special = {tok.pad_token_id, tok.eos_token_id, hf.config.decoder_start_token_id}
    return [[i for i in row.tolist() if i not in special] for row in out]


def _aiayn_greedy(d: Path, lines: list[str]) -> list[list[int]]:
    """The imported model's greedy target ids, mapped to Marian's through the directory's vocabulary."""
    from transformers import MarianTokenizer

    model, toks = convert(d, warn=lambda m: None)
    enc = Translator(model, toks).encode(lines)
    src = torch.full((len(enc), max(map(len, enc))), PAD_ID)
    for i, ids in enumerate(enc):
        src[i, :len(ids)] = torch.tensor(ids)
    vocab = MarianTokenizer.from_pretrained(str(d)).get_vocab()
    return [[vocab[toks.tgt.id_to_piece(i)] for i in ids] for ids in greedy_search(model, src, BOS_ID, EOS_ID, 0.0, MAX_B)]


def _with_positions(d: Path, noise: float) -> Path:
    """The fixture with position tables written into its weights (older OPUS-MT files hold them):
    Marian's own sinusoid, plus `noise`."""
    from safetensors.torch import load_file, save_file
    from transformers import MarianMTModel

    shutil.copytree(mm.FIXTURE, d)
    sd = load_file(str(d / "model.safetensors"))
    table = MarianMTModel.from_pretrained(str(mm.FIXTURE)).model.encoder.embed_positions.weight.detach().clone()
    g = torch.Generator().manual_seed(0)
    for side in ("encoder", "decoder"):
        sd[f"model.{side}.embed_positions.weight"] = table + noise * torch.randn(table.shape, generator=g)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_position_tables_in_the_weights_are_used_by_transformers_so_they_are_checked(tmp_path):
    """transformers loads a position table the weights file holds (it does not rebuild it): a table
    that is Marian's sinusoid imports and translates alike, any other one is refused in one line
    naming the tensor (it was ignored, and the import translated differently from transformers)."""
    lines = _sentences()
    same = _with_positions(tmp_path / "sinusoid", 0.0)
    assert _aiayn_greedy(same, lines) == _hf_greedy(same, lines)
    other = _with_positions(tmp_path / "learned", 0.5)
    assert _hf_greedy(other, lines) != _hf_greedy(same, lines)  # transformers does use the file's table
    with pytest.raises(AiaynError, match="embed_positions") as e:
        convert(other, warn=pytest.fail)
    assert "\n" not in str(e.value)


def test_a_run_of_characters_this_sides_model_lacks_is_one_piece_as_in_marian_tokenizer():
    """source.spm of the fixture lacks "2", "'" and "Y" (target.spm has them, so vocab.json does): a
    lone "2" is that piece; a run such as "22" is one unknown piece to SentencePiece, which
    MarianTokenizer looks up whole (<unk>). The import made every such character a piece of the
    source model, which split the run into two "2"s."""
    from transformers import MarianTokenizer

    tok = MarianTokenizer.from_pretrained(str(mm.FIXTURE))
    model, toks = convert(mm.FIXTURE, warn=pytest.fail)
    vocab = tok.get_vocab()
    lines = ["Der Bus 2 fährt.", "Der Bus 22 fährt.", "''Hallo'' Y2 und 2Y", "Y", "2 2 22 222"]
    ours = [[vocab[toks.src.id_to_piece(i)] for i in ids] for ids in Translator(model, toks).encode(lines)]
    assert ours == tok(lines)["input_ids"]


def test_the_hf_export_of_an_imported_model_generates_as_the_original_at_max_length(tmp_path):
    """OPUS-MT configs force EOS at max_length (forced_eos_token_id); the export dropped it, so the
    export's generate kept one more token of every sentence cut there, and beam search ranked the cut
    hypotheses differently. transformers' texts must be the original's, greedy and beam."""
    from transformers import MarianMTModel, MarianTokenizer

    from aiayn.export import export_hf
    from aiayn.importer import import_marian

    lines = _sentences()
    export_hf(import_marian(mm.FIXTURE, tmp_path / "imported", warn=pytest.fail), tmp_path / "hf")

    def generate(d: Path, beams: int) -> list[str]:
        hf, tok = MarianMTModel.from_pretrained(str(d)).eval(), MarianTokenizer.from_pretrained(str(d))
        with torch.no_grad():
            out = hf.generate(**tok(lines, return_tensors="pt", padding=True), do_sample=False, num_beams=beams,
                              length_penalty=1.0, early_stopping=False, max_length=8)
        return tok.batch_decode(out, skip_special_tokens=True)

    for beams in (1, 4):
        assert generate(tmp_path / "hf", beams) == generate(mm.FIXTURE, beams), beams


@pytest.mark.parametrize("file", ["source.spm", "target.spm"])
def test_an_empty_sentencepiece_model_is_refused_in_one_line(tmp_path, capsys, file):
    """An empty source.spm (a failed download) parses as a model without pieces: the import
    succeeded and every sentence became one <unk> ("Children are are are ...")."""
    from aiayn.cli import main

    d = tmp_path / "bad"
    shutil.copytree(mm.FIXTURE, d)
    (d / file).write_bytes(b"")
    assert main(["import", "--from", "marian", str(d), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and file in err and "no pieces" in err, err
    assert not (tmp_path / "out").exists()


def _import(argv: list[str], capsys) -> tuple[int, str]:
    from aiayn.cli import main

    rc = main(["import", "--from", "marian", *argv])
    return rc, capsys.readouterr().err.strip()


def test_a_path_that_names_no_directory_is_refused_at_once_and_a_hub_name_goes_to_the_hub(tmp_path, capsys,
                                                                                           monkeypatch):
    """A mistyped local path (`./not/a/dir`) was sent to the hub, which answered after ~12 s with
    "Repo id must be in the form ...". A value that can only be a path is refused before any hub
    call; NAME and OWNER/NAME still go to the hub (here a stand-in: no network in tests)."""
    import aiayn.importer as importer

    asked = []

    def hub(name: str, tmp: Path) -> Path:
        asked.append(name)
        raise AiaynError(f"{name}: the hub (stand-in)")

    monkeypatch.setattr(importer, "_hub", hub)
    (tmp_path / "file").write_text("x")
    out = str(tmp_path / "out")
    for source, words in (("./not/a/dir", "no such directory"), (str(tmp_path / "missing"), "no such directory"),
                          ("models/opus/de-en", "no such directory"), ("~/opus-mt-de-en", "no such directory"),
                          (str(tmp_path / "file"), "is a file")):
        rc, err = _import([source, "--out", out], capsys)
        assert rc == 2 and words in err and source in err and "\n" not in err, (source, err)
    assert asked == []
    for name in ("Helsinki-NLP/opus-mt-de-en", "opus-mt-de-en"):
        assert importer.local_source(name) is None
        rc, err = _import([name, "--out", out], capsys)
        assert rc == 2 and "stand-in" in err, err
    assert asked == ["Helsinki-NLP/opus-mt-de-en", "opus-mt-de-en"]
    assert not (tmp_path / "out").exists()


def test_out_that_is_or_holds_the_current_directory_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """`aiayn import --out .` inside an earlier import's folder failed after the whole conversion with
    "Device or resource busy ...; free space or choose another --out": no space was missing."""
    rc, _ = _import([str(mm.FIXTURE), "--out", str(tmp_path / "imp")], capsys)
    assert rc == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "imp").iterdir()}
    monkeypatch.chdir(tmp_path / "imp")
    for out in (".", "../imp", ".."):
        rc, err = _import([str(mm.FIXTURE), "--out", out], capsys)
        assert rc == 2 and "current directory" in err and "free space" not in err and "\n" not in err, (out, err)
    assert {p.name: p.read_bytes() for p in (tmp_path / "imp").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["imp"]


def test_a_symlinked_out_is_refused_and_left_as_it_was(tmp_path, capsys):
    """`--out LINK` (a link to a folder) replaced the link with a new folder and left the link behind
    as `.tmp-old-LINK-...` (rmtree refuses a link, quietly); the folder it pointed to stayed empty."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    (tmp_path / "dangling").symlink_to("nowhere")
    for out in ("link", "dangling"):
        rc, err = _import([str(mm.FIXTURE), "--out", str(tmp_path / out)], capsys)
        assert rc == 2 and err == (f"aiayn import: error: --out {tmp_path / out} is a symbolic link; name the folder "
                                   "it points to, or choose a new --out"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "link", "real"]
    assert (tmp_path / "link").is_symlink() and os.readlink(tmp_path / "link") == "real"
    assert not any((tmp_path / "real").iterdir())


def test_special_token_names_of_an_older_directory_are_read_from_special_tokens_map(tmp_path):
    """Older Marian directories name their special tokens in special_tokens_map.json only (their
    tokenizer_config.json has just the languages), and transformers reads that file: a pad token
    named there ("<blank>") was looked up as "<pad>", and the import refused a model that transformers
    loads ("vocab.json gives '<pad>' the id None")."""
    import json

    from transformers import MarianTokenizer

    d = tmp_path / "old"
    shutil.copytree(mm.FIXTURE, d)
    vocab = json.loads((d / "vocab.json").read_text(encoding="utf-8"))
    vocab["<blank>"] = vocab.pop("<pad>")
    (d / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps({"source_lang": "de", "target_lang": "en"}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>",
                                                           "pad_token": "<blank>"}))
    tok = MarianTokenizer.from_pretrained(str(d))
    assert (tok.pad_token, tok.pad_token_id) == ("<blank>", vocab["<blank>"])  # what transformers reads
    lines = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "Eine Frau liest ein Buch."]
    assert _aiayn_greedy(d, lines) == _hf_greedy(d, lines)


def test_a_full_disk_while_importing_beside_step_checkpoints_says_nothing_was_written(tmp_path, capsys, monkeypatch):
    """`aiayn import --out run/imported` on a full disk said "the previous checkpoint is intact"
    because step checkpoints sat beside --out: there was no earlier import there."""
    import errno

    import aiayn.checkpoint as ckpt

    (tmp_path / "run" / "step_1").mkdir(parents=True)
    (tmp_path / "run" / "step_1" / ckpt.CONFIG).write_text("{}")  # a step checkpoint, as far as a save looks

    def full_disk(*a, **kw):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "save_file", full_disk)
    rc, err = _import([str(mm.FIXTURE), "--out", str(tmp_path / "run" / "imported")], capsys)
    assert rc == 2 and "No space left on device" in err and "nothing was written" in err, err
    assert "previous checkpoint" not in err and "\n" not in err, err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step_1"]


def test_a_hub_name_without_a_network_is_one_line_without_the_hubs_retry_messages(tmp_path, capsys, caplog,
                                                                                   monkeypatch):
    """Offline, `aiayn import --from marian Helsinki-NLP/opus-mt-de-en` printed huggingface_hub's
    retry warnings ("Retrying in 1s [Retry 1/5]", eleven lines) before its one-line error."""
    import logging

    import transformers

    def offline(name, *a, **kw):
        logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load the files of {name}.")

    monkeypatch.setattr(transformers.MarianMTModel, "from_pretrained", offline)
    level = logging.getLogger("huggingface_hub").level
    rc, err = _import(["Helsinki-NLP/opus-mt-de-en", "--out", str(tmp_path / "out")], capsys)
    assert rc == 2 and "\n" not in err and "couldn't connect" in err, err
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub")]  # logged: printed to stderr
    assert logging.getLogger("huggingface_hub").level == level


def test_a_directory_without_languages_warns_to_import_again_with_src_and_tgt(tmp_path, capsys):
    """Without source_lang/target_lang the warning said "pass --src and --tgt for `aiayn serve`", which
    refuses those flags ("unrecognized arguments"); and `--src de` alone was dropped under a warning
    that no pair was found. It names the missing side and this command's flags."""
    import json

    d = tmp_path / "nolang"
    shutil.copytree(mm.FIXTURE, d)
    tk = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
    del tk["source_lang"], tk["target_lang"]
    (d / "tokenizer_config.json").write_text(json.dumps(tk), encoding="utf-8")
    for flags, missing in (([], "--src and --tgt not given"), (["--src", "de"], "--tgt not given")):
        rc, err = _import([str(d), "--out", str(tmp_path / "out"), *flags], capsys)
        assert rc == 0 and err.count("\n") == 0, err
        assert missing in err and "import again with --src LANG --tgt LANG" in err, err
        assert "pass --src and --tgt for `aiayn serve`" not in err
    rc, err = _import([str(d), "--out", str(tmp_path / "out"), "--src", "de", "--tgt", "en"], capsys)
    assert rc == 0 and err == "", err


def test_separate_vocabularies_over_one_shared_matrix_each_index_it_with_their_own_ids(tmp_path):
    """separate_vocabs with share_encoder_decoder_embeddings: Marian's one matrix is read by source
    ids on the encoder side and target ids on the decoder side. Where the two vocabularies order
    their ids differently, the import shared one matrix in the target's order on both sides, so the
    encoder read the wrong rows (logits 0.1 off on a random model, other translations here). The
    matrix becomes two, each row reordered by its side; translations equal `generate`'s."""
    from transformers import MarianMTModel, MarianTokenizer

    d = mm.separate_shared(mm.FIXTURE, tmp_path / "sep")
    hf, tok = MarianMTModel.from_pretrained(str(d)).eval(), MarianTokenizer.from_pretrained(str(d))
    assert tok.separate_vocabs and hf.config.share_encoder_decoder_embeddings
    lines = _sentences()
    with torch.no_grad():
        out = hf.generate(**tok(lines, return_tensors="pt", padding=True), do_sample=False, num_beams=1,
                          max_length=MAX_B + 2)
    special = {hf.config.pad_token_id, hf.config.eos_token_id}
    want = [[i for i in row.tolist() if i not in special] for row in out]
    model, toks = convert(d, warn=pytest.fail)
    enc = Translator(model, toks).encode(lines)
    src = torch.full((len(enc), max(map(len, enc))), PAD_ID)
    for i, ids in enumerate(enc):
        src[i, :len(ids)] = torch.tensor(ids)
    got = [[tok.target_encoder[toks.tgt.id_to_piece(i)] for i in ids]
           for ids in greedy_search(model, src, BOS_ID, EOS_ID, 0.0, MAX_B)]
    assert got == want
    assert not model.cfg.share_embeddings and model.cfg.tie_output
