"""An `&#` that starts no character reference in HTML (`aiayn.serve.markup`): the tokenizer gave up at it
and sent the rest of the text, tags and all, to the model as words. It is text, as HTML reads it, and
the markup after it stays markup, in time linear in the text."""

import time

import pytest

from aiayn.serve.markup import parse


@pytest.mark.parametrize("source,pieces,texts", [
    ("&#xyz <b>Hallo</b> Welt", ("&#xyz ", "<b>", "Hallo", "</b>", " Welt"), ("&#xyz ", "Hallo", " Welt")),
    ("ein &# <i>Hund</i>", ("ein &# ", "<i>", "Hund", "</i>"), ("ein &# ", "Hund")),
    ("ein &#x <i>Hund</i>", ("ein &#x ", "<i>", "Hund", "</i>"), ("ein &#x ", "Hund")),
    ("ein &#<i>Hund</i>", ("ein &#", "<i>", "Hund", "</i>"), ("ein &#", "Hund")),
    ("ein &#; <i>Hund</i>;", ("ein &#; ", "<i>", "Hund", "</i>", ";"), ("ein &#; ", "Hund")),  # a ";" after it
    ("ein &#; <i>Hund</i> &#; <b>da</b>;", ("ein &#; ", "<i>", "Hund", "</i>", " &#; ", "<b>", "da", "</b>", ";"),
     ("ein &#; ", "Hund", "da")),  # the tokenizer read on after one such, not two
    ("&#12e <i>Hund</i>", ("&#12e ", "<i>", "Hund", "</i>"), ("\x0ce ", "Hund")),  # digits run on into a hex letter
    ("<p>ein</p>&#", ("<p>", "ein", "</p>", "&#"), ("ein",)),
])
def test_an_ampersand_hash_that_is_no_reference_is_text_and_the_tags_after_it_stay_markup(source, pieces, texts):
    f = parse(source)
    assert (f.pieces, f.texts) == (pieces, texts) and "".join(f.pieces) == source


def test_the_markup_after_one_comes_back_as_written():
    f = parse('&#xyz <b class="x">Hallo</b> Welt')
    assert f.render(["&#xyz ", "Hello", " world"]) == '&amp;#xyz <b class="x">Hello</b> world'


@pytest.mark.parametrize("source,text", [("&#228;pfel <b>x</b>", "äpfel "), ("&#xE4;pfel <b>x</b>", "äpfel "),
                                         ("&#xE4 <b>x</b>", "ä "), ("&#228", "ä")])
def test_a_character_reference_still_reads_as_its_character(source, text):
    assert parse(source).texts[0] == text


def test_many_of_them_are_read_in_linear_time():
    """One pass over the text, however many there are (re-reading the rest after each made it quadratic):
    20,000 of them, each before a tag, in well under a second, every tag markup."""
    source = "&#x <b>y</b> " * 20_000
    best = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        f = parse(source)
        best = min(best, time.perf_counter() - start)
    assert f.texts[:4] == ("&#x ", "y", " &#x ", "y") and len(f.texts) == 40_000
    assert f.pieces.count("<b>") == 20_000 and "".join(f.pieces) == source
    assert best < 1.0, best
