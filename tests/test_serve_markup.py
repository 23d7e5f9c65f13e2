"""HTML text nodes translated, markup kept as written (aiayn.serve.markup), and language
identification among the served sources (aiayn.serve.detect)."""

import html

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiayn.serve.detect import Detector, as_libre, detect_texts
from aiayn.serve.markup import escape_like, parse


@pytest.mark.parametrize("source,texts,upper", [
    ('<p class="a">Hallo <b>Welt</b>!</p>', ("Hallo ", "Welt"), '<p class="a">HALLO <b>WELT</b>!</p>'),
    ("Tom &amp; Jerry&nbsp;gehen &#8217;s", ("Tom & Jerry\xa0gehen \u2019s",), "TOM &amp; JERRY&nbsp;GEHEN &#8217;S"),
    ("<br/>x<img src=a alt='Bild'><!-- Kommentar --> y", ("x", " y"), "<br/>X<img src=a alt='Bild'><!-- Kommentar --> Y"),
    ("<script>var text = 'a';</script><style>p {}</style><code>der Code</code><pre>Text</pre>z",
     ("z",), "<script>var text = 'a';</script><style>p {}</style><code>der Code</code><pre>Text</pre>Z"),
    ('<p translate="no">Name</p><span class="notranslate">Name</span><a class="mention">@<span>ich</span></a>ok',
     ("ok",), '<p translate="no">Name</p><span class="notranslate">Name</span><a class="mention">@<span>ich</span></a>OK'),
    ("<p>offen <i>kursiv", ("offen ", "kursiv"), "<p>OFFEN <i>KURSIV"),
    ("<p>1 &lt; 2</p> ... ", (), "<p>1 &lt; 2</p> ... "),  # no letters: nothing to translate
    ("a < b", ("a < b",), "A &lt; B"),
    ("", (), ""),
])
def test_text_nodes_and_markup(source, texts, upper):
    f = parse(source)
    assert "".join(f.pieces) == source and f.texts == texts
    assert f.render([t.upper() for t in f.texts]) == upper


def test_escape_writes_entities_as_the_source_did():
    assert escape_like("a\xa0b & <c>", "x&nbsp;y") == "a&nbsp;b &amp; &lt;c&gt;"
    assert escape_like("it\u2019s", "&#x2019;") == "it&#x2019;s"
    with pytest.raises(ValueError, match="1 translations for 2 text nodes"):
        parse("<p>a</p>b").render(["x"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list("ab <>/=\"'&;#x1!-p") + ["<p>", "</p>", "&amp;", "<br>", "<!--", "<b x=1>"]),
                max_size=30).map("".join))
def test_any_markup_comes_back_as_it_was(source):
    f = parse(source)
    assert "".join(f.pieces) == source
    assert html.unescape(f.render(list(f.texts))) == html.unescape(source)  # texts put back: the same document


@pytest.fixture(scope="module")
def detector():
    d = Detector(["de", "en", "qq"])  # qq: a code the model does not know, never chosen
    d.load()
    return d


def test_detect_among_the_served_languages(detector):
    ranked = detector.rank("Der Hund spielt mit dem Ball im Park.")
    assert ranked[0][0] == "de" and ranked[0][1] > 0.9 and ranked[-1] == ("qq", 0.0)
    assert abs(sum(p for _, p in ranked) - 1) < 1e-6
    assert detector.rank("The dog plays with the ball in the park.", among=["de", "en"])[0][0] == "en"
    assert detector.rank("anything at all", among=["de"]) == [("de", 1.0)]
    assert detector.rank("1234 !!", among=["de", "en"]) == [("de", 0.5), ("en", 0.5)]  # no letters: no opinion
    assert as_libre([("de", 0.98765), ("en", 0.01235)]) == [{"confidence": 98.8, "language": "de"},
                                                            {"confidence": 1.2, "language": "en"}]


def test_short_texts_take_the_language_of_the_whole_request(detector):
    texts = ["Hund", "Der Mann läuft mit dem Hund auf der Straße und die Frau sitzt im Park"]
    got = detect_texts(detector, texts, ["de", "en"])
    assert [lang for lang, _ in got] == ["de", "de"]
    assert got[0] == detector.rank("\n".join(texts), ["de", "en"])[0]  # judged with the rest
