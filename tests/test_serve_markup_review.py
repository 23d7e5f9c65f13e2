"""HTML whose bytes `aiayn.serve.markup` once changed without a word: a tag left open at the end, a
reference to no character, a NUL in a tag. Markup is kept as written; what cannot be is a 400."""

import pytest

from aiayn.serve.markup import NotHtml, parse


@pytest.mark.parametrize("source,pieces,texts", [
    ("<p>ein</p", ("<p>", "ein", "</p"), ("ein",)),  # once the text "ein</p", whose end the model dropped
    ("<p>ein <b", ("<p>", "ein ", "<b"), ("ein ",)),
    ("<p>ein</", ("<p>", "ein", "</"), ("ein",)),
    ('ein <a href="x>Hund</a>', ("ein ", '<a href="x>Hund</a>'), ("ein ",)),  # a quote left open: a tag to the end
    ("ein<!-- offen <b>Hund", ("ein", "<!-- offen <b>Hund"), ("ein",)),
])
def test_markup_left_open_at_the_end_is_kept_as_written(source, pieces, texts):
    f = parse(source)
    assert f.pieces == pieces and f.texts == texts
    assert f.render([t.upper() for t in f.texts]) == "".join(p.upper() if p in texts else p for p in pieces)


@pytest.mark.parametrize("source", ["&#xD800;ein", "ein &#55296; Hund", "ein&#xDFFF", "&#0;ein", "&#x110000;ein"])
def test_a_reference_to_no_character_in_a_text_is_refused(source):
    """HTML reads it as U+FFFD, which the model drops: the reference was lost from the answer."""
    with pytest.raises(NotHtml, match="refers to no character"):
        parse(source)


@pytest.mark.parametrize("source", ["ein &#1; Hund", "&#x7F;ein", "ein&#xFFFE;", "ein &#11; Hund", "ein &#x1"])
def test_a_reference_to_a_control_character_in_a_text_is_refused(source):
    """The text is read with `html.unescape`, which drops such a character: the reference went from the answer."""
    with pytest.raises(NotHtml, match="refers to a control character or a noncharacter"):
        parse(source)


@pytest.mark.parametrize("source", ["ein &#9; Hund", "<code>&#1;</code>ein", "&#1; 12"])
def test_a_control_character_that_is_kept_is_not_refused(source):
    """A tab is a character a text keeps; one in markup that is not translated, or in a text with no letter, is kept."""
    assert "".join(parse(source).pieces) == source


@pytest.mark.parametrize("source", ["&#xFFFD;ein", "<code>&#xD800;</code>ein", "&#xD800; 12", "&#xD800ein"])
def test_a_reference_that_is_kept_is_not_refused(source):
    """U+FFFD itself; one in markup that is not translated, or in a text with no letter (kept as it is);
    `&#xD800e` (U+D800E, a character)."""
    assert "".join(parse(source).pieces) == source


def test_a_nul_in_a_tag_keeps_the_tag_markup():
    """HTML reads a NUL in a tag name as U+FFFD; the tokenizer ended the tag at it and sent `<p\\x00>` to the model."""
    f = parse("<p\x00>ein</p>")
    assert f.pieces == ("<p\x00>", "ein", "</p>") and f.texts == ("ein",)
    assert f.render(["a"]) == "<p\x00>a</p>"
    assert parse("ein\x00 Hund").texts == ("ein\x00 Hund",)  # in a text: the text as it was


# ------------------------------------------------------------------------------ through the API, with a model

pytest.importorskip("fastapi")
from test_serve_libre import _one_thread, ckpts, client, de_en, post  # noqa: E402,F401  (fixtures)


def test_the_api_keeps_a_tag_left_open_and_refuses_a_lost_reference(client, de_en):
    r = post(client, {"q": ["<p>ein Hund</p", "<p\x00>ein Hund</p>"], "source": "de", "target": "en", "format": "html"})
    dog = de_en.translate(["ein Hund"])[0]
    assert r.status_code == 200 and r.json()["translatedText"] == [f"<p>{dog}</p", f"<p\x00>{dog}</p>"]
    r = post(client, {"q": "&#xD800;ein Hund", "source": "de", "target": "en", "format": "html"})
    assert r.status_code == 400 and r.json()["error"] == (
        "Invalid request: q is not HTML that can be read (&#xD800; refers to no character, which HTML reads as "
        "U+FFFD: write the character itself); send it with format text")
