"""LibreTranslate's API on `aiayn serve`, from a cold review: a sentence too long for the model is
named by the text it is in, and a bug's 500 reaches a page of an allowed origin."""

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from aiayn.serve.app import Model, create_app  # noqa: E402
from aiayn.serve.scheduler import Limits  # noqa: E402
from test_serve import ready  # noqa: E402
from test_serve_libre import _one_thread, ckpts, de_en, en_de  # noqa: E402, F401 (fixtures)

LONG_FR = "Le chat est sur la table et le chien est dans le jardin avec une balle rouge " * 4  # > 64 tokens
DE = "ein Mann läuft auf der Straße mit dem Ball im Park"  # over 40 characters: detected on its own


@pytest.fixture(scope="module")
def client(de_en):
    """de->en and fr->en (the same tiny model twice: what is tested here is where errors point)."""
    models = [Model(de_en, "de", "en"), Model(de_en, "fr", "en")]
    with TestClient(create_app(models, Limits(max_wait_ms=5)), raise_server_exceptions=False) as c:
        yield ready(c)


@pytest.mark.parametrize("q,source,where", [
    ([DE, LONG_FR], "auto", "text 1, sentence 0"),  # fr's sentences are a pair of their own: was "sentence 0"
    (["ein Mann. Ein Hund.", LONG_FR], "de", "text 1, sentence 0"),  # was "sentence 2", of a list of 2 texts
    ("ein Mann. Ein Hund. " + LONG_FR, "de", "sentence 2"),  # one text: its own sentences, as before
])
def test_a_sentence_too_long_is_named_by_its_text(client, q, source, where):
    """The scheduler counts the sentences of one language pair; the client sent texts. The error
    named the index among the pair's sentences: with source auto and two pairs, a sentence of another
    text, and with a list, a number the client cannot map to what it sent."""
    r = client.post("/translate", json={"q": q, "source": source, "target": "en"})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == f"Invalid request: {where}: more source tokens than the model takes (64)"


def test_a_bugs_500_carries_cors_headers(de_en, monkeypatch):
    """With --cors-origins, every answer carries Access-Control-Allow-Origin, so that a page of that
    origin can read it; a bug's 500 did not (answered outside the CORS middleware), and the page saw
    a network error instead of `{"error": "internal error ..."}`."""
    from aiayn.serve import libre

    def boom(ranked):
        raise RuntimeError("a bug")

    monkeypatch.setattr(libre, "as_libre", boom)
    app = create_app([Model(de_en, "de", "en")], Limits(max_wait_ms=5), cors_origins=["https://a.example"])
    with TestClient(app, raise_server_exceptions=False) as c:
        r = ready(c).post("/detect", json={"q": "der Hund"}, headers={"Origin": "https://a.example"})
        assert r.status_code == 500
        assert r.json() == {"error": "internal error (RuntimeError); the server's log has the details"}
        assert r.headers.get("access-control-allow-origin") == "https://a.example"
        metrics = c.get("/metrics").text
    assert 'aiayn_requests_total{path="/detect",status="500"} 1.0' in metrics  # counted once, as a 500
