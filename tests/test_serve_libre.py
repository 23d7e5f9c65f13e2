"""LibreTranslate's API on `aiayn serve`, as its clients call it: fields from JSON, forms and the query
string; its status codes and messages; source "auto" and /detect; format "html"; paragraphs cut into
sentences; API keys; CORS; /frontend/settings and /spec; several language pairs from one server."""

import json

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from aiayn.sentences import split  # noqa: E402
from aiayn.serve.app import Model, create_app  # noqa: E402
from aiayn.serve.scheduler import Limits, QueueFull  # noqa: E402
from aiayn.translator import Translator  # noqa: E402
from serve_model import tiny_checkpoint  # noqa: E402
from test_serve import ready  # noqa: E402

DE = "ein Mann läuft auf der Straße"
FORTY = ["Der Hund spielt mit dem Ball.", "Ein Mann läuft auf der Straße.", "Eine Frau sitzt im Park.",
         "Ein Kind spielt."] * 10


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    return tiny_checkpoint(base), tiny_checkpoint(base, reverse=True)


@pytest.fixture(scope="module")
def de_en(ckpts):
    return Translator.from_checkpoint(ckpts[0])


@pytest.fixture(scope="module")
def en_de(ckpts):
    return Translator.from_checkpoint(ckpts[1])


def two_pair_app(ckpts, **kw):
    models = [Model(Translator.from_checkpoint(ckpts[0]), "de", "en", str(ckpts[0])),
              Model(Translator.from_checkpoint(ckpts[1]), "en", "de", str(ckpts[1]))]
    limits = Limits(max_wait_ms=5, max_chars=kw.pop("max_chars", 3000), max_lines=200, beam=kw.pop("beam", 4))
    return create_app(models, limits, **kw)


@pytest.fixture(scope="module")
def client(ckpts):
    with TestClient(two_pair_app(ckpts)) as c:
        yield ready(c)


def post(client, fields, **kw):
    return client.post("/translate", json=fields, **kw)


def sentences_translated(translator, text, lang="de"):
    """What a paragraph should come back as: each sentence translated alone, the spacing kept."""
    p = split(text, lang)
    return p.join(translator.translate(list(p.sentences)))


# ------------------------------------------------------------------------------ fields and errors


@pytest.mark.parametrize("body,message", [
    ({"source": "de", "target": "en"}, "Invalid request: missing q parameter"),
    ({"q": "", "source": "de", "target": "en"}, "Invalid request: missing q parameter"),
    ({"q": [], "source": "de", "target": "en"}, "Invalid request: missing q parameter"),
    ({"q": "a", "target": "en"}, "Invalid request: missing source parameter"),
    ({"q": "a", "source": "de", "target": ""}, "Invalid request: missing target parameter"),
    ({"q": 3, "source": "de", "target": "en"}, "Invalid request: q parameter must be a text or a list of texts"),
    ({"q": ["a", 3], "source": "de", "target": "en"}, "Invalid request: q parameter must be a text or a list of texts"),
    ({"q": "a", "source": "de", "target": "en", "format": "xml"}, "xml format is not supported"),
    ({"q": "a", "source": "de", "target": "en", "alternatives": "two"},
     "Invalid request: alternatives parameter is not a number"),
    ({"q": "a", "source": "de", "target": "en", "alternatives": 9}, "Invalid request: alternatives parameter must be <= 3"),
    ({"q": "a", "source": "fr", "target": "en"}, "fr is not supported; it translates de to en, en to de"),
    ({"q": "a", "source": "de", "target": "fr"}, "fr is not supported; it translates de to en, en to de"),
    ({"q": "a", "source": "de", "target": "de"},
     "German (de) is not available as a target language from German (de); it translates de to en, en to de"),
    ({"q": "x" * 3001, "source": "de", "target": "en"}, "Invalid request: request (3001) exceeds text limit (3000)"),
    ({"q": ["a"] * 201, "source": "de", "target": "en"}, "Invalid request: request (201) exceeds text limit (200)"),
])
def test_bad_fields_are_400_in_libretranslates_words(client, body, message):
    r = post(client, body)
    assert r.status_code == 400 and r.json() == {"error": message}


@pytest.mark.parametrize("value", [b"Infinity", b"-Infinity", b"NaN", b"1e999"])
def test_alternatives_beyond_any_number_are_400_not_500(client, value):
    """JSON as Python reads it takes Infinity and NaN: int() of them must not become a 500."""
    raw = b'{"q": "ein Mann", "source": "de", "target": "en", "alternatives": ' + value + b"}"
    r = client.post("/translate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json() == {"error": "Invalid request: alternatives parameter is not a number"}


@pytest.mark.parametrize("raw", [b"[1, 2", b'["q"]', b'"text"', b'{"q": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"])
def test_a_body_that_is_not_a_json_object_is_400(client, raw):
    r = client.post("/translate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json() == {"error": "Invalid JSON format"}


def test_form_query_string_and_json_give_the_same_answer(client, de_en):
    want = {"translatedText": de_en.translate([DE])[0]}
    fields = {"q": DE, "source": "de", "target": "en"}
    assert post(client, fields).json() == want
    assert client.post("/translate", data=fields).json() == want  # libretranslatepy: a urlencoded form
    assert client.post("/translate", files={k: (None, v) for k, v in fields.items()}).json() == want  # its page
    assert client.post("/translate", params=fields).json() == want  # the query string alone
    # the query string before the form, as Flask's request.values has it
    r = client.post("/translate", params={"target": "en"}, data={**fields, "target": "xx"})
    assert r.json() == want
    # null or empty format is text; null alternatives are none
    assert post(client, {**fields, "format": None, "alternatives": None}).json() == want
    assert client.post("/translate", data={**fields, "format": "", "alternatives": ""}).json() == want


def test_alternatives_are_distinct_and_never_the_translation(client, de_en):
    r = post(client, {"q": ["rot blau", DE], "source": "de", "target": "en", "alternatives": 3})
    body = r.json()
    for best, alts, line in zip(body["translatedText"], body["alternatives"], ["rot blau", DE]):
        assert best == de_en.translate([line])[0]
        assert best not in alts and len(set(alts)) == len(alts) and 1 <= len(alts) <= 3
        nbest = [t for t, _ in de_en.search([line], beam=4, nbest=4)[0]]
        assert alts == [t for t in dict.fromkeys(nbest[1:]) if t != best]


def test_the_pages_three_alternatives_on_a_narrow_beam(ckpts, de_en):
    """LibreTranslate's page always asks for 3: a beam of 2 gives what it has, not a 400."""
    with TestClient(two_pair_app(ckpts, beam=2)) as c:
        r = ready(c).post("/translate", data={"q": DE, "source": "de", "target": "en", "alternatives": "3"})
        body = r.json()
        assert r.status_code == 200 and body["translatedText"] == de_en.translate([DE], beam=2)[0]
        assert len(body["alternatives"]) <= 1 and body["translatedText"] not in body["alternatives"]
        r = c.post("/translate", json={"q": DE, "source": "de", "target": "en", "alternatives": 4})
        assert r.status_code == 400 and r.json() == {"error": "Invalid request: alternatives parameter must be <= 3"}


def test_a_full_queue_is_429_with_retry_after_and_a_long_sentence_400(ckpts, monkeypatch):
    app = two_pair_app(ckpts)
    with TestClient(app) as c:
        ready(c)
        sched = app.state.server.scheduler

        def full(*a, **k):
            raise QueueFull("1024 lines are waiting, at most 1024")

        monkeypatch.setattr(sched, "submit", full)
        r = post(c, {"q": DE, "source": "de", "target": "en"})
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"].startswith("Slowdown: the server is busy")
        r = c.post("/v1/translate", json={"text": [DE]})  # aiayn's own API keeps its 503
        assert r.status_code == 503 and r.headers["retry-after"] == "1"


# ------------------------------------------------------------------------------ paragraphs


def test_a_paragraph_is_translated_sentence_by_sentence_with_its_own_spacing(client, de_en):
    text = "ein Mann läuft.  Der Hund spielt im Park!\nrot blau?\n\n  eine Frau sitzt. "
    r = post(client, {"q": text, "source": "de", "target": "en"})
    want = sentences_translated(de_en, text)
    assert r.json() == {"translatedText": want}
    assert want.count("\n") == 3 and want.startswith(de_en.translate(["ein Mann läuft."])[0] + "  ")


def test_a_line_of_40_sentences_is_not_cut_at_the_models_length(client, de_en):
    line = " ".join(FORTY)  # 40 sentences, ~300 tokens; the model takes 64
    assert len(de_en.tokenizers.src.encode(line)) > 4 * de_en.max_src_tokens
    r = post(client, {"q": line, "source": "de", "target": "en"})
    assert r.status_code == 200
    got = r.json()["translatedText"]
    assert got == sentences_translated(de_en, line) and len(split(line, "de").sentences) == 40


# ------------------------------------------------------------------------------ source auto, /detect


def test_auto_detects_among_the_sources_of_the_target(client, de_en, en_de):
    r = post(client, {"q": DE, "source": "auto", "target": "en"})
    assert r.json() == {"translatedText": de_en.translate([DE])[0],
                        "detectedLanguage": {"confidence": 100.0, "language": "de"}}
    english = "a man runs on the street with the dog"
    r = post(client, {"q": [DE + " und der Hund spielt", english], "source": "auto", "target": "de"})
    body = r.json()  # only en translates to de: the candidates are the target's sources
    assert [d["language"] for d in body["detectedLanguage"]] == ["en", "en"]
    assert body["translatedText"][1] == en_de.translate([english])[0]


def test_detect_ranks_the_served_sources(client):
    r = client.post("/detect", json={"q": "der Hund spielt mit dem Ball im Park und der Mann läuft"})
    ranked = r.json()
    assert r.status_code == 200 and [d["language"] for d in ranked] == ["de", "en"]
    assert ranked[0]["confidence"] > 90 and abs(sum(d["confidence"] for d in ranked) - 100) < 0.2
    assert client.post("/detect", data={"q": "the dog plays with the ball in the park"}).json()[0]["language"] == "en"
    r = client.post("/detect", json={"q": ""})
    assert r.status_code == 400 and r.json() == {"error": "Invalid request: missing q parameter"}


def test_detect_is_bounded_as_translate(client):
    """/detect takes --max-chars and --max-lines as /translate does: megabytes would hold a worker thread."""
    for q, message in (("x" * 3001, "Invalid request: request (3001) exceeds text limit (3000)"),
                       (["a"] * 201, "Invalid request: request (201) exceeds text limit (200)")):
        r = client.post("/detect", json={"q": q})
        assert r.status_code == 400 and r.json() == {"error": message}


def test_lone_surrogates_read_as_replacement_characters(client, de_en):
    """A JavaScript client that cuts a string through an emoji sends half of a surrogate pair:
    a text holding one is translated as if it held U+FFFD, and a field echoed in an error comes back
    with U+FFFD (both once gave a plain-text 500)."""
    raw = b'{"q": ["\\ud800 ein Mann", "ein Mann"], "source": "de", "target": "en"}'
    r = client.post("/translate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["translatedText"] == de_en.translate(["\ufffd ein Mann", "ein Mann"])
    raw = b'{"q": "ein Mann", "source": "de", "target": "\\udc00"}'
    r = client.post("/translate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"].startswith("\ufffd is not supported")
    raw = b'{"text": ["\\ud800 ein Mann"], "source": "\\udc00"}'
    r = client.post("/v1/translate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"].startswith("this server does not translate \ufffd to en")
    raw = b'{"text": ["\\ud800 ein Mann"]}'
    r = client.post("/v1/translate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 200
    assert r.json()["translations"][0]["hypotheses"][0]["text"] == de_en.translate(["\ufffd ein Mann"])[0]


def test_a_bug_is_a_json_500(ckpts, monkeypatch):
    from aiayn.serve import libre

    def boom(ranked):
        raise RuntimeError("a bug")

    monkeypatch.setattr(libre, "as_libre", boom)
    with TestClient(two_pair_app(ckpts), raise_server_exceptions=False) as c:
        r = ready(c).post("/detect", json={"q": "der Hund"})
    assert r.status_code == 500 and r.json() == {"error": "internal error (RuntimeError); the server's log has the details"}


# ------------------------------------------------------------------------------ html


def test_html_the_tokenizer_cannot_read_is_400(client):
    r = post(client, {"q": "Hallo <![#", "source": "de", "target": "en", "format": "html"})
    if r.status_code == 200:  # a Python whose tokenizer reads it
        return
    assert r.status_code == 400 and r.json()["error"].startswith("Invalid request: q is not HTML that can be read (")


def test_html_keeps_the_markup_and_translates_the_text_nodes(client, de_en):
    html = ('<p class="x">ein Mann läuft &amp; der Hund spielt</p><p>rot&nbsp;blau <a href="https://e.org/@a" '
            'class="u-url mention">@<span>Hund</span></a> <b>eine Frau</b> sitzt<br/></p><code>der Hund</code>')
    r = post(client, {"q": [html], "source": "de", "target": "en", "format": "html"})
    got = r.json()["translatedText"][0]

    def t(text):
        return de_en.translate([text])[0]

    NBSP = "rot\xa0blau"  # &nbsp; read as the character it stands for

    want = (f'<p class="x">{t("ein Mann läuft & der Hund spielt").replace("&", "&amp;")}</p>'
            f'<p>{t(NBSP)} <a href="https://e.org/@a" class="u-url mention">@<span>Hund'
            f'</span></a> <b>{t("eine Frau")}</b> {t("sitzt")}<br/></p><code>der Hund</code>')
    assert got == want


def test_mastodons_request(client, de_en):
    """Mastodon's LibreTranslate service: JSON, q a list of HTML, source auto, format html, api_key null;
    it reads translatedText[i] and detectedLanguage[i].language."""
    posts = ["<p>ein Mann läuft auf der Straße mit dem Hund</p>", "<p>der Hund spielt im Park</p>"]
    r = client.post("/translate", content=json.dumps({"q": posts, "source": "auto", "target": "en", "format": "html",
                                                      "api_key": None}),
                    headers={"content-type": "application/json"})
    body = r.json()
    assert r.status_code == 200 and [d["language"] for d in body["detectedLanguage"]] == ["de", "de"]
    assert body["translatedText"][1] == f"<p>{de_en.translate(['der Hund spielt im Park'])[0]}</p>"
    langs = {x["code"]: x["targets"] for x in client.get("/languages").json()}  # Mastodon's language map
    assert langs == {"de": ["en"], "en": ["de"]}


# ------------------------------------------------------------------------------ several pairs


def test_several_pairs_route_to_their_model(client, de_en, en_de):
    r = post(client, {"q": "a man runs", "source": "en", "target": "de"})
    assert r.json() == {"translatedText": en_de.translate(["a man runs"])[0]}
    assert r.json()["translatedText"].startswith("ein Mann")  # the en->de model learnt its words
    r = client.post("/v1/translate", json={"text": ["a man runs"], "source": "en", "target": "de"})
    assert r.json()["translations"][0]["hypotheses"][0]["text"] == en_de.translate(["a man runs"])[0]
    r = client.post("/v1/translate", json={"text": [DE]})  # the first model is the default
    assert r.json()["translations"][0]["hypotheses"][0]["text"] == de_en.translate([DE])[0]
    r = client.post("/v1/translate", json={"text": [DE], "source": "de", "target": "fr"})
    assert r.status_code == 400 and r.json()["error"].endswith("it translates de to en, en to de")
    info = client.get("/v1/info").json()
    assert [(m["languages"]["source"], m["languages"]["target"]) for m in info["models"]] == [("de", "en"), ("en", "de")]
    for m in info["models"]:
        assert m["memory_mib"] > 0 and m["checkpoint"] and m["model"]["parameters"] > 0
    assert info["languages"] == {"source": "de", "target": "en"}  # the page's fields: the first model


# ------------------------------------------------------------------------------ keys, CORS, settings, spec


def test_api_keys(ckpts):
    with TestClient(two_pair_app(ckpts, api_keys=frozenset({"k1", "k2"}))) as c:
        ready(c)
        fields = {"q": DE, "source": "de", "target": "en"}
        r = post(c, fields)
        assert r.status_code == 400 and r.json() == {"error": "Please contact the server operator to get an API key"}
        r = post(c, {**fields, "api_key": "nope"})
        assert r.status_code == 403 and r.json() == {"error": "Invalid API key"}
        assert post(c, {**fields, "api_key": "k2"}).status_code == 200
        assert c.post("/translate", data={**fields, "api_key": "k1"}).status_code == 200
        assert c.post("/translate", params={"api_key": "k1"}, data=fields).status_code == 200
        assert c.post("/detect", json={"q": "ein Mann", "api_key": "x"}).status_code == 403
        assert c.post("/v1/translate", json={"text": ["rot"]}).status_code == 400
        assert c.post("/v1/translate", json={"text": ["rot"]}, headers={"Authorization": "Bearer k9"}).status_code == 403
        assert c.post("/v1/translate", json={"text": ["rot"]}, headers={"Authorization": "Bearer k1"}).status_code == 200
        assert c.post("/v1/translate", json={"text": ["rot"], "api_key": "k2"}).status_code == 200  # the page's way
        assert c.post("/v1/translate", json={"text": ["rot"], "api_key": "k9"}).json() == {"error": "Invalid API key"}
        assert c.get("/languages").status_code == 200  # asks for no key, as LibreTranslate
        settings = c.get("/frontend/settings").json()
        assert settings["apiKeys"] is True and settings["keyRequired"] is True


def test_cors_is_off_by_default_and_on_for_the_given_origins(client, ckpts):
    head = {"Origin": "https://example.org", "Access-Control-Request-Method": "POST"}
    assert "access-control-allow-origin" not in client.options("/translate", headers=head).headers
    assert "access-control-allow-origin" not in client.get("/languages", headers={"Origin": "https://example.org"}).headers
    with TestClient(two_pair_app(ckpts, cors_origins=["https://example.org"])) as c:
        ready(c)
        r = c.options("/translate", headers={**head, "Access-Control-Request-Headers": "content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://example.org"
        r = c.get("/languages", headers={"Origin": "https://example.org"})
        assert r.headers["access-control-allow-origin"] == "https://example.org"
        assert r.headers["access-control-expose-headers"] == "Retry-After"  # a page reads a 429's hint
        r = c.get("/languages", headers={"Origin": "https://elsewhere.org"})
        assert "access-control-allow-origin" not in r.headers


def test_frontend_settings_spec_and_disabled_endpoints(client):
    s = client.get("/frontend/settings").json()
    assert s == {"charLimit": 3000, "frontendTimeout": 500, "apiKeys": False, "keyRequired": False,
                 "suggestions": False, "filesTranslation": False, "supportedFilesFormat": [],
                 "language": {"source": {"code": "auto", "name": "Auto Detect"},
                              "target": {"code": "en", "name": "English"}}}
    spec = client.get("/spec").json()
    assert spec["openapi"].startswith("3.") and {"/translate", "/detect", "/languages", "/frontend/settings"} <= set(
        spec["paths"])
    body = spec["paths"]["/translate"]["post"]["requestBody"]["content"]
    assert {"application/json", "application/x-www-form-urlencoded"} <= set(body)
    assert client.post("/suggest", data={"q": "a", "s": "b"}).json() == {"error": "Suggestions are disabled on this server."}
    r = client.post("/translate_file", data={"source": "de"})
    assert r.status_code == 403 and r.json() == {"error": "Files translation are disabled on this server."}


# ------------------------------------------------------------------------------ the real process


def test_a_real_server_of_two_pairs_with_keys_answers_libretranslates_clients(ckpts, tmp_path, de_en, en_de):
    """`aiayn serve --checkpoint A --checkpoint B --api-keys FILE --cors-origins ...` on a free port, called
    as libretranslatepy calls it (urllib, a urlencoded form) and as Mastodon does (JSON)."""
    import urllib.parse
    import urllib.request

    from test_serve_process import Served

    keys = tmp_path / "keys.txt"
    keys.write_text("# operators' keys\nsecret-1\n\nsecret-2  # the page\n", encoding="utf-8")
    server = Served(ckpts[0], "--checkpoint", str(ckpts[1]), "--api-keys", str(keys),
                    "--cors-origins", "https://a.example, https://b.example")
    try:
        server.wait_ready()
        form = urllib.parse.urlencode({"q": "ein Mann läuft", "source": "de", "target": "en", "api_key": "secret-2"})
        with urllib.request.urlopen(urllib.request.Request(server.url + "/translate", data=form.encode())) as r:
            assert json.loads(r.read()) == {"translatedText": de_en.translate(["ein Mann läuft"])[0]}
        import httpx

        r = httpx.post(server.url + "/translate", json={"q": ["<p>a man runs</p>"], "source": "auto", "target": "de",
                                                        "format": "html", "api_key": "secret-1"},
                       headers={"Origin": "https://b.example"})
        assert r.json() == {"translatedText": [f"<p>{en_de.translate(['a man runs'])[0]}</p>"],
                            "detectedLanguage": [{"confidence": 100.0, "language": "en"}]}
        assert r.headers["access-control-allow-origin"] == "https://b.example"
        r = httpx.post(server.url + "/translate", json={"q": "a", "source": "en", "target": "de", "api_key": "x"})
        assert r.status_code == 403
    finally:
        server.stop()


@pytest.mark.parametrize("flags,message", [
    (["--checkpoint", "{0}"], "translates de to en, as --checkpoint {0} does; serve one model per language pair"),
    (["--api-keys", "{tmp}/none.txt"], "--api-keys {tmp}/none.txt: cannot read"),
    (["--api-keys", "{tmp}/empty.txt"], "--api-keys {tmp}/empty.txt: no key in it"),
])
def test_bad_flags_are_one_line_errors(ckpts, tmp_path, flags, message):
    import subprocess
    import sys

    from test_serve_process import _env

    (tmp_path / "empty.txt").write_text("# nothing\n\n", encoding="utf-8")
    fill = {"tmp": tmp_path}
    args = [f.format(str(ckpts[0]), **fill) for f in flags]
    p = subprocess.run([sys.executable, "-m", "aiayn", "serve", "--checkpoint", str(ckpts[0]), "--port", "0", *args],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == 2 and message.format(str(ckpts[0]), **fill) in p.stderr and "Traceback" not in p.stderr


def test_one_request_over_several_pairs_is_bounded_as_a_whole():
    """`source: auto` may send a request's texts to several models; --max-lines bounds the request,
    not each pair's share of it (with P pairs it could queue P times the bound)."""
    import asyncio
    from types import SimpleNamespace

    from aiayn.serve.errors import ApiError
    from aiayn.serve.libre import piece, translate_pieces

    asked: list[tuple[int, int]] = []

    async def translate(request, lines, key, asked_lines):
        asked.append((len(lines), asked_lines))
        return [], [[{"text": s.upper()}] for s in lines]

    srv = SimpleNamespace(limits=Limits(max_lines=2, beam=1),
                          translate=lambda request, lines, key, asked: translate(request, lines, key, asked))
    pieces = [piece("Eins. Zwei.", ("de", "en"), False), piece("Un. Deux.", ("fr", "en"), False),
              piece("Drei.", ("de", "en"), False)]
    with pytest.raises(ApiError, match="3 texts in one request, more than --max-lines 2"):
        asyncio.run(translate_pieces(srv, None, pieces, 1))
    assert asked == []  # refused before any pair's model is asked
    # --max-lines counts texts, as on /v1, not their sentences: two texts of two sentences each fit
    out = asyncio.run(translate_pieces(srv, None, pieces[:2], 1))
    assert out == [["EINS. ZWEI."], ["UN. DEUX."]] and sorted(asked) == [(2, 1), (2, 1)]
    # more sentences than one client may hold could never be queued: refused, not a 429 to retry
    srv.limits = Limits(max_lines=2, max_client_lines=3, beam=1)
    with pytest.raises(ApiError, match=r"4 sentences in 2 texts, more than the server may hold for one request "
                                       r"\(--max-client-lines 3\)"):
        asyncio.run(translate_pieces(srv, None, pieces[:2], 1))


def test_a_pair_that_fails_cancels_the_other_pairs_of_its_request():
    """`source: auto` sent a request's texts to two models; one pair's 413 answered the request while
    the other pair's lines went on being searched, held against the client's --max-client-lines,
    for an answer no one would read. Now they are cancelled, and gone, before the error is raised."""
    import asyncio
    from types import SimpleNamespace

    from aiayn.serve.errors import ApiError
    from aiayn.serve.libre import piece, translate_pieces

    searching: dict[str, str] = {}

    async def translate(request, lines, key, asked):
        if key.pair[0] == "fr":
            await asyncio.sleep(0.01)  # the other pair's lines are in the scheduler by now
            raise ApiError(413, "line 0: more source tokens than the model takes (64)")
        searching["de"] = "searched"
        try:
            await asyncio.sleep(30)  # a long search
        except asyncio.CancelledError:
            searching["de"] = "cancelled"
            raise
        return [], [[{"text": s}] for s in lines]

    srv = SimpleNamespace(limits=Limits(beam=1), translate=translate)
    pieces = [piece("Eins.", ("de", "en"), False), piece("Un.", ("fr", "en"), False)]

    async def main():
        with pytest.raises(ApiError, match="more source tokens"):
            await translate_pieces(srv, None, pieces, 1)
        return dict(searching)  # as the error is answered, before anything else runs

    assert asyncio.run(asyncio.wait_for(main(), 10)) == {"de": "cancelled"}
