"""Paragraphs into sentences and back (aiayn.sentences) and `aiayn translate --split-sentences`."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiayn.cli import main
from aiayn.errors import AiaynError
from aiayn.sentences import Paragraph, split
from aiayn.translate import search_paragraphs
from aiayn.translator import Translator
from serve_model import tiny_checkpoint

FORTY = ["Der Hund spielt mit dem Ball.", "Ein Mann läuft auf der Straße.", "Eine Frau sitzt im Park.",
         "Ein Kind spielt."] * 10


@pytest.mark.parametrize("text,sentences,lead,gaps", [
    ("Dr. Müller kam um 10 Uhr.  Er sagte: Hallo! Dann ging er.", ("Dr. Müller kam um 10 Uhr.", "Er sagte: Hallo!",
                                                                   "Dann ging er."), "", ("  ", " ", "")),
    ("  Eins.\r\nZwei? \n\nDrei", ("Eins.", "Zwei?", "Drei"), "  ", ("\r\n", " \n\n", "")),
    ("z.B. ein Satz.", ("z.B. ein Satz.",), "", ("",)),  # an abbreviation does not end a sentence
    ("", (), "", ()),
    ("Z\xa0.", ("Z\xa0.",), "", ("",)),  # the splitter panicked here (found by the property below)
    ("Ein Hund\u202f. Eine Katze\xa0!", ("Ein Hund\u202f.", "Eine Katze\xa0!"), "", (" ", "")),  # wide spaces kept
    (" \n ", (), " \n ", ()),
])
def test_split_keeps_every_character_around_the_sentences(text, sentences, lead, gaps):
    p = split(text, "de")
    assert p == Paragraph(lead, sentences, gaps)
    assert p.join(list(p.sentences)) == text
    assert p.join([s.upper() for s in p.sentences]) == lead + "".join(s.upper() + g for s, g in zip(sentences, gaps))


def test_the_splitter_is_not_left_to_panic_on_wide_spaces(capfd):
    """A Rust panic inside the splitter was caught, but Rust printed it on stderr first."""
    for text in ("Z\xa0.", "Z\u2009.", "Z \u3000.", "Z\u202f."):
        assert split(text, "de").sentences == (text,)
    assert capfd.readouterr().err == ""


def test_split_knows_the_language_and_falls_back_for_an_unknown_one():
    assert split("Mr. Smith came. He left.", "en").sentences == ("Mr. Smith came.", "He left.")
    assert split("One. Two.", "qq").sentences == ("One.", "Two.")
    with pytest.raises(ValueError, match="1 translations for 2 sentences"):
        split("One. Two.", "en").join(["x"])


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab .!?\n\r\t\u00a0\u202f\u2028Zz,")), max_size=60))
def test_split_then_join_gives_the_text_back(text):
    p = split(text, "en")
    assert p.join(list(p.sentences)) == text
    assert all(s == s.strip() and s for s in p.sentences)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.getbasetemp())


def test_translate_split_sentences_joins_each_lines_sentences(ckpt, tmp_path, capsys):
    reference = Translator.from_checkpoint(ckpt)
    line40 = " ".join(FORTY)  # 40 sentences, ~300 tokens; the model takes 64
    lines = ["ein Mann läuft.  Rot blau!", "", line40, "Hund"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out),
                 "--split-sentences"]) == 0
    got = out.read_text(encoding="utf-8").split("\n")[:-1]
    want = []
    for line in lines:
        p = split(line, "de")
        want.append(p.join(reference.translate(list(p.sentences))))
    assert got == want and got[0].count("  ") >= 1
    assert "more than the model takes" not in capsys.readouterr().err  # nothing truncated
    # without it, the long line is cut at the model's 64 tokens (with a note)
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--output", str(out)]) == 0
    assert "line 3: " in capsys.readouterr().err


def test_a_note_about_a_sentence_names_its_input_line(ckpt):
    notes = []
    t = Translator.from_checkpoint(ckpt, note=notes.append)
    long = " ".join(["rot"] * 80)
    out = search_paragraphs(t, ["ein Mann.", f"Hund. {long}"], "de", first_line=7)
    assert len(out) == 2 and notes and notes[0].startswith("line 8 (a sentence of it): ")
    assert t.note == notes.append  # the translator's own note is back


def test_split_sentences_with_nbest_is_refused(ckpt, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("a\n", encoding="utf-8")
    assert main(["translate", "--checkpoint", str(ckpt), "--input", str(src), "--split-sentences", "--nbest", "2",
                 "--beam", "2"]) == 2
    assert "--split-sentences gives one translation per line" in capsys.readouterr().err
    with pytest.raises(AiaynError, match="names no source language"):
        from argparse import Namespace

        from aiayn.translate import _source_language

        _source_language(Namespace(split_sentences="", checkpoint=str(tmp_path)))


def test_a_start_refused_for_want_of_a_language_leaves_the_old_output(ckpt, tmp_path, capsys):
    """--split-sentences without LANG on a checkpoint that names no source language: the one-line
    error comes before the output is opened, so an old file there keeps its text."""
    import json
    import shutil

    ck = Path(shutil.copytree(ckpt, tmp_path / "ck"))
    cfg = json.loads((ck / "config.json").read_text())
    cfg["train"] = {}
    (ck / "config.json").write_text(json.dumps(cfg))
    src, out = tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("Ein Satz. Noch einer.\n", encoding="utf-8")
    out.write_text("OLD\n", encoding="utf-8")
    assert main(["translate", "--checkpoint", str(ck), "--input", str(src), "--output", str(out),
                 "--split-sentences"]) == 2
    assert "names no source language" in capsys.readouterr().err
    assert out.read_text(encoding="utf-8") == "OLD\n"


def test_a_ctranslate2_export_names_its_source_language(ckpt, tmp_path):
    """`translate --engine ctranslate2 --split-sentences` finds the language in the export."""
    from argparse import Namespace

    pytest.importorskip("ctranslate2")
    from aiayn.export import export_ctranslate2
    from aiayn.translate import _source_language

    export_ctranslate2(str(ckpt), str(tmp_path / "ct2"))
    assert _source_language(Namespace(split_sentences="", checkpoint=str(tmp_path / "ct2"))) == "de"
