"""`aiayn serve` in process: every endpoint and error code, LibreTranslate's shapes, translations equal
to `Translator.translate` alone and under concurrent requests, batching across clients, and the
scheduler's rules (token-bounded batches, settings kept apart, cancelled work dropped)."""

import asyncio
import contextlib
import json
import math
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from aiayn.serve.scheduler import Limits, QueueFull, Scheduler  # noqa: E402
from aiayn.serve.app import DEEP_JSON, create_app  # noqa: E402
from aiayn.translator import Translator  # noqa: E402
from serve_model import tiny_checkpoint  # noqa: E402

LINES = ["ein Mann läuft auf der Straße", "", "Hund und Kind spielt im Park mit Ball", "rot blau",
         "eine Frau sitzt", "   ", "der Hund spielt mit dem roten Ball im Park und der Mann läuft"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; a tiny model gains nothing from more
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def reference(ckpt):
    return Translator.from_checkpoint(ckpt)


def test_bf16_on_a_cpu_without_bf16_kernels_loads_and_warns(ckpt, monkeypatch, capsys):
    """The slow-bf16 warning goes to stderr; through the server's `note` it would refuse to start."""
    import aiayn.kernels
    from aiayn.serve import cli as serve

    monkeypatch.setattr(aiayn.kernels, "cpu_has_fast_bf16", lambda: False)
    translator, pair, _ = serve.load(str(ckpt), "bf16")
    assert translator.precision == "bf16" and pair == ("de", "en")
    assert "slow fallback code" in capsys.readouterr().err


def make_app(ckpt, **limits):
    return create_app(Translator.from_checkpoint(ckpt), Limits(**limits), ("de", "en"), checkpoint=str(ckpt))


def ready(client, timeout=60.0):
    end = time.monotonic() + timeout
    while client.get("/health").status_code != 200:
        assert time.monotonic() < end, "the server never became ready"
        time.sleep(0.02)
    return client


@pytest.fixture(scope="module")
def client(ckpt):
    with TestClient(make_app(ckpt, max_wait_ms=20, max_chars=300)) as c:
        yield ready(c)


# ---------------------------------------------------------------------------------------- health


def test_health_is_503_until_warmed_up_and_translate_refuses_meanwhile(ckpt):
    c = TestClient(make_app(ckpt))  # no lifespan: the model is never warmed up
    r = c.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "warming up" and r.headers["retry-after"] == "1"
    r = c.post("/v1/translate", json={"text": ["ein Mann"]})
    assert r.status_code == 503 and "warming up" in r.json()["error"]
    with TestClient(make_app(ckpt)) as c:
        assert ready(c).get("/health").json() == {"status": "ok"}


def test_a_failed_warm_up_is_503_without_a_retry_hint(ckpt, monkeypatch):
    """Warm-up failed: /health and requests say why, and no Retry-After (a retry would not help)."""
    import aiayn.serve.app as A

    def broken(*a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of memory")

    monkeypatch.setattr(A, "warm_up", broken)
    with TestClient(make_app(ckpt)) as c:
        end = time.monotonic() + 30
        while c.get("/health").json()["status"] != "failed":
            assert time.monotonic() < end
            time.sleep(0.02)
        for r in (c.get("/health"), c.post("/v1/translate", json={"text": ["ein Mann"]})):
            assert r.status_code == 503 and "out of memory" in r.text and "retry-after" not in r.headers


# ------------------------------------------------------------------------------- /v1/translate


def test_v1_translate_equals_translator(client, reference):
    r = client.post("/v1/translate", json={"text": LINES})
    assert r.status_code == 200
    body = r.json()
    assert body["beam"] == 4 and body["alpha"] == 0.6
    got = [t["hypotheses"][0]["text"] for t in body["translations"]]
    assert got == reference.translate(LINES, beam=4)
    assert got[0].startswith("a man runs on")  # the toy model has learnt something
    first = body["translations"][0]
    src_ids = reference.encode(LINES[:1])[0]  # as the model reads it (ending with EOS for a new model)
    assert first["source_tokens"] == [reference.tokenizers.src.id_to_piece(i) for i in src_ids]
    chosen = reference.search_ids(LINES[:1], beam=4)[0][0][0]  # the subwords the search chose, exactly
    assert first["hypotheses"][0]["tokens"] == [reference.tokenizers.tgt.id_to_piece(i) for i in chosen]
    assert "".join(first["hypotheses"][0]["tokens"]).replace("\u2581", " ").strip() == got[0]
    assert body["translations"][1] == {"source_tokens": [], "hypotheses": [{"text": "", "score": 0.0, "tokens": []}]}


@pytest.mark.parametrize("beam,nbest,alpha", [(1, 1, 0.6), (3, 3, 0.0), (5, 2, 1.0), (2, 1, 1)])  # 1: as JS writes 1.0
def test_v1_settings_equal_translator(client, reference, beam, nbest, alpha):
    r = client.post("/v1/translate", json={"text": LINES, "beam": beam, "nbest": nbest, "alpha": alpha})
    assert r.status_code == 200, r.text
    got = r.json()["translations"]
    want = reference.search(LINES, beam=beam, nbest=nbest, alpha=alpha)
    assert [[h["text"] for h in t["hypotheses"]] for t in got] == [[text for text, _ in nb] for nb in want]
    for t, nb in zip(got, want):
        for h, (_, score) in zip(t["hypotheses"], nb):
            assert h["score"] is None if math.isnan(score) else h["score"] == pytest.approx(score, abs=1e-5)
    if beam == 1:
        assert got[0]["hypotheses"][0]["score"] is None  # greedy search has no score


def test_v1_attention_is_target_by_source_per_layer(client):
    r = client.post("/v1/translate", json={"text": ["ein Mann läuft", ""], "attention": True, "nbest": 2})
    assert r.status_code == 200
    line = r.json()["translations"][0]
    S = len(line["source_tokens"])
    for h in line["hypotheses"]:
        att = h["attention"]
        assert len(att) == 2  # the tiny model's decoder layers
        for layer in att:
            assert len(layer) == len(h["tokens"]) and all(len(row) == S for row in layer)
            assert all(abs(sum(row) - 1) < 1e-2 for row in layer)  # each row a distribution over the source
    assert r.json()["translations"][1]["hypotheses"][0]["attention"] == []


def test_v1_cuts_a_line_into_sentences_keeps_its_spacing_and_truncates_no_long_line(ckpt, reference):
    from aiayn.sentences import split

    forty = " ".join(["Der Hund spielt mit dem Ball.", "Ein Mann läuft auf der Straße.", "Eine Frau sitzt im Park.",
                      "Ein Kind spielt."] * 10)  # 40 sentences, ~300 tokens: the model takes 64
    assert len(reference.tokenizers.src.encode(forty)) > 4 * reference.max_src_tokens
    two = " ein Mann läuft.  Der Hund spielt im Park! "
    with TestClient(make_app(ckpt, max_chars=3000)) as c:
        r = ready(c).post("/v1/translate", json={"text": [forty, two, "rot blau", ""], "nbest": 2, "attention": True})
        assert r.status_code == 200, r.text
        long, short, one, blank = r.json()["translations"]
        for line, got in ((forty, long), (two, short)):
            p = split(line, "de")
            want = reference.search(list(p.sentences), beam=4, nbest=2)
            assert [h["text"] for h in got["hypotheses"]] == [p.join([nb[k][0] for nb in want]) for k in range(2)]
            assert [s["source"] for s in got["sentences"]] == list(p.sentences)
            assert [[h["text"] for h in s["hypotheses"]] for s in got["sentences"]] == [[t for t, _ in nb] for nb in want]
            assert got["hypotheses"][0]["score"] == pytest.approx(sum(nb[0][1] for nb in want), abs=1e-4)
            assert all(len(h["attention"]) == 2 for s in got["sentences"] for h in s["hypotheses"])
        assert len(long["sentences"]) == 40 and short["hypotheses"][0]["text"].startswith(" ")  # its own spacing
        assert "sentences" not in one and one["hypotheses"][0]["text"] == reference.translate(["rot blau"])[0]
        assert blank == {"source_tokens": [], "hypotheses": [{"text": "", "score": 0.0, "tokens": [], "attention": []},
                                                             {"text": "", "score": 0.0, "tokens": [], "attention": []}]}
        r = c.post("/v1/translate", json={"text": [forty], "split_sentences": False})  # a line is one sentence
        assert r.status_code == 413 and "more source tokens than the model takes" in r.json()["error"]
        too_long = "Ein Mann läuft. Eine Frau sitzt. " + "Hund " * 80 + "."
        assert len(split(too_long, "de").sentences) == 3
        r = c.post("/v1/translate", json={"text": ["rot", too_long]})
        assert r.status_code == 413 and r.json()["error"].startswith("line 1, sentence 2: more source tokens")



def test_v1_a_line_of_one_sentence_is_searched_as_it_is_and_max_lines_counts_lines(ckpt, reference):
    """A line that splits into one sentence or none answers exactly as with split_sentences: false
    (its spacing is part of what is searched); --max-lines counts the client's lines, sentences are
    priced by --max-work and bounded by --max-chars and what one request may queue."""
    lines = ["  ein mann fährt .  ", "ein mann fährt .\t", "ein Mann läuft.", "  ", "...", "rot blau"]
    with TestClient(make_app(ckpt, max_chars=3000, max_lines=3)) as c:
        for line in lines:
            body = {"text": [line], "nbest": 2, "attention": True}
            split = ready(c).post("/v1/translate", json=body)
            whole = c.post("/v1/translate", json={**body, "split_sentences": False})
            assert split.status_code == whole.status_code == 200, (split.text, whole.text)
            assert split.json() == whole.json(), line
        two = ["Ein Mann läuft. Eine Frau sitzt."] * 3  # 3 lines, 6 sentences: within --max-lines 3
        r = c.post("/v1/translate", json={"text": two})
        assert r.status_code == 200 and all(len(t["sentences"]) == 2 for t in r.json()["translations"]), r.text
        r = c.post("/v1/translate", json={"text": two + ["rot"]})
        assert r.status_code == 413 and r.json()["error"] == "4 lines in one request, more than --max-lines 3"
    forty = " ".join(["Ein Kind spielt."] * 40)
    with TestClient(make_app(ckpt, max_chars=3000, max_lines=3, max_work=5000)) as c:  # one line, much work
        r = ready(c).post("/v1/translate", json={"text": [forty]})
        assert r.status_code == 413 and "more than --max-work 5000" in r.json()["error"], r.text
    with TestClient(make_app(ckpt, max_chars=300, max_lines=3)) as c:
        r = ready(c).post("/v1/translate", json={"text": [forty]})
        assert r.status_code == 413 and r.json()["error"].startswith("line 0: 679 characters, more than --max-chars")
    with TestClient(make_app(ckpt, max_chars=3000, max_lines=3, max_client_lines=39)) as c:
        r = ready(c).post("/v1/translate", json={"text": [forty]})  # could never be queued: 413, not 429 for ever
        assert r.status_code == 413 and r.json()["error"].startswith(
            "40 sentences in 1 lines, more than the server may hold for one request (--max-client-lines 39)")


def test_v1_attention_builds_only_the_cross_attention_it_returns(reference, monkeypatch):
    """The maps are cross-attention only: the encoder and decoder self-attention weights were built
    too and thrown away (their `need_weights` calls are counted)."""
    from aiayn.serve.batch import cross_attention
    from reference import count_weight_requests

    calls = count_weight_requests(monkeypatch)
    src, hyp = reference.encode(["ein Mann läuft"])[0], reference.search_ids(["ein Mann läuft"], beam=2)[0][0][0]
    maps = cross_attention(reference.model, src, [hyp])
    assert sum(calls) == reference.model.cfg.decoder_layers and len(maps[0]) == reference.model.cfg.decoder_layers


def test_v1_attention_weights_are_sent_with_four_decimals(reference):
    """Rounded in float32, a weight of 0.0163 went out as 0.016300000250339508: 2.5x the bytes."""
    import json

    from aiayn.serve.batch import cross_attention

    src, hyp = reference.encode(["ein Mann läuft"])[0], reference.search_ids(["ein Mann läuft"], beam=2)[0][0][0]
    weights = [w for layer in cross_attention(reference.model, src, [hyp])[0] for row in layer for w in row]
    assert weights and all(len(json.dumps(w).partition(".")[2]) <= 4 for w in weights), weights[:5]


# ---------------------------------------------------------------------------------- LibreTranslate


def test_libre_string_list_and_alternatives(client, reference):
    r = client.post("/translate", json={"q": "ein Mann läuft", "source": "de", "target": "en"})
    assert r.status_code == 200 and r.json() == {"translatedText": reference.translate(["ein Mann läuft"])[0]}
    r = client.post("/translate", json={"q": ["rot blau", "eine Frau sitzt"], "source": "de", "target": "en",
                                        "alternatives": 2})
    body = r.json()
    nbest = reference.search(["rot blau", "eine Frau sitzt"], beam=4, nbest=3)
    assert body["translatedText"] == [nb[0][0] for nb in nbest]
    # distinct, and never a copy of the translation itself
    assert body["alternatives"] == [list(dict.fromkeys(t for t, _ in nb[1:] if t != nb[0][0])) for nb in nbest]
    r = client.post("/translate", json={"q": "ein Mann läuft\nrot blau", "source": "de", "target": "en",
                                        "api_key": "ignored", "alternatives": 1})
    assert r.json()["translatedText"] == "\n".join(reference.translate(["ein Mann läuft", "rot blau"]))
    assert len(r.json()["alternatives"]) == 1


def test_libre_html_form_urlencoded_and_multipart(client, reference):
    want = reference.translate(["der Hund spielt"])[0]
    fields = {"q": "der Hund spielt", "source": "de", "target": "en"}
    assert client.post("/translate", data=fields).json() == {"translatedText": want}
    r = client.post("/translate", files={k: (None, v) for k, v in fields.items()})
    assert r.json() == {"translatedText": want}


def test_libre_languages(client):
    assert client.get("/languages").json() == [{"code": "de", "name": "German", "targets": ["en"]},
                                               {"code": "en", "name": "English", "targets": []}]


def test_libre_wrong_pair_is_400_naming_the_served_pair(client):
    r = client.post("/translate", json={"q": "hallo", "source": "en", "target": "fr"})
    assert r.status_code == 400 and r.json() == {"error": "fr is not supported; it translates de to en"}
    r = client.post("/translate", json={"q": "hallo", "source": "en", "target": "de"})
    assert r.status_code == 400 and r.json()["error"].endswith("; it translates de to en")


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("path,body,field", [
    ("/v1/translate", b'{"text": ["a"', "body"),  # malformed JSON
    ("/v1/translate", {"text": "not a list"}, "text"),
    ("/v1/translate", {"text": ["ok", 5]}, "text[1]"),
    ("/v1/translate", {"text": []}, "text"),
    ("/v1/translate", {"text": ["a"], "beam": 0}, "beam"),
    ("/v1/translate", {"text": ["a"], "beam": 2, "nbest": 3}, "nbest"),
    ("/v1/translate", {"text": ["a"], "alpha": -1}, "alpha"),
    ("/v1/translate", {"text": ["a"], "colour": "red"}, "colour"),
    ("/v1/translate", '{"text": ["Straße"]}'.encode("latin-1"), "body"),  # not UTF-8
    ("/v1/translate", b'{"text": ["a"], "beam": 1' + b"0" * 5000 + b"}", "body"),  # past int()'s 4300 digits
    # a wrong type is a 422, not read as pydantic's lax mode would: true as beam 1 (greedy), "no" as false
    ("/v1/translate", {"text": ["a"], "beam": True}, "beam"),
    ("/v1/translate", {"text": ["a"], "beam": "4"}, "beam"),
    ("/v1/translate", {"text": ["a"], "beam": 4.0}, "beam"),
    ("/v1/translate", {"text": ["a"], "nbest": "1"}, "nbest"),
    ("/v1/translate", {"text": ["a"], "alpha": "0.5"}, "alpha"),
    ("/v1/translate", {"text": ["a"], "alpha": True}, "alpha"),
    ("/v1/translate", {"text": ["a"], "attention": 1}, "attention"),
    ("/v1/translate", {"text": ["a"], "split_sentences": "no"}, "split_sentences"),
])
def test_422_names_the_field(client, path, body, field):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    r = client.post(path, **kw)
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith(f"{field}:"), r.json()


def test_a_body_json_cannot_read_says_why_not_there_was_an_error_parsing_the_body(client):
    """Bytes that are not UTF-8 (a client that sent Latin-1) and a number too long for int() were
    FastAPI's 400 "There was an error parsing the body": now the 422 of any malformed JSON, saying what."""
    headers = {"content-type": "application/json; charset=latin-1"}
    r = client.post("/v1/translate", content='{"text": ["Straße"]}'.encode("latin-1"), headers=headers)
    assert r.json() == {"error": "body: not valid JSON (not UTF-8: byte 0xdf at byte 15); send it encoded as UTF-8",
                        "field": "body"}
    r = client.post("/v1/translate", content=b'{"text": ["a"], "alpha": 1' + b"0" * 5000 + b"}",
                    headers={"content-type": "application/json"})
    assert r.json()["error"] == "body: not valid JSON (a number of more than 4300 digits)"


def test_a_body_within_max_lines_and_max_chars_is_not_too_large_however_it_is_encoded(ckpt):
    """Lines of --max-chars non-ASCII characters as Python's json.dumps (and so `requests`) writes
    them, each escaped as \\uXXXX (6 bytes, 12 for an emoji's surrogate pair), pass the body's size
    check: they were a 413 "the body is over N bytes" (4 bytes a character assumed), though within
    every limit. Here they get as far as the model's length."""
    with TestClient(make_app(ckpt, max_lines=2, max_chars=20_000)) as c:
        ready(c)
        for line in ("ж" * 20_000, "\U0001F600" * 20_000):
            body = json.dumps({"text": [line, line]}).encode()  # ensure_ascii
            r = c.post("/v1/translate", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 413 and "more source tokens than the model takes" in r.json()["error"], r.text


def test_413_for_long_lines_and_bodies_411_without_length(client, ckpt):
    r = client.post("/v1/translate", json={"text": ["ok", "x" * 301]})
    assert r.status_code == 413 and r.json()["error"].startswith("line 1: 301 characters")
    r = client.post("/v1/translate", json={"text": [" ".join(["rot"] * 70)]})  # max_positions is 64
    assert r.status_code == 413 and "more source tokens than the model takes (64)" in r.json()["error"]
    r = client.post("/translate", json={"q": " ".join(["rot"] * 70), "source": "de", "target": "en"})
    assert r.status_code == 400 and r.json()["error"].startswith("Invalid request: sentence 0: more source tokens")
    with TestClient(make_app(ckpt, max_lines=3)) as c:
        r = ready(c).post("/v1/translate", json={"text": ["a"] * 4})
        assert r.status_code == 413 and "more than --max-lines 3" in r.json()["error"]
        r = c.post("/v1/translate", content=b"x" * 200_000, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "bytes" in r.json()["error"]
        r = c.post("/v1/translate", content=iter([b'{"text": ["a"]}']), headers={"content-type": "application/json"})
        assert r.status_code == 411 and "Content-Length" in r.json()["error"]  # chunked: no length to check


def test_unknown_path_and_method_are_json(client):
    r = client.get("/nowhere")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get("/v1/translate")
    assert r.status_code == 405 and "error" in r.json()


def test_503_with_retry_after_when_the_queue_is_full(ckpt):
    # a long wait and a huge batch: after a batch of 4, the first request's 3 lines sit in the queue 1.5 s
    app = make_app(ckpt, max_queue=4, max_wait_ms=1500, max_batch_tokens=100_000)
    with TestClient(app) as c, ThreadPoolExecutor(1) as pool:
        ready(c)
        assert c.post("/v1/translate", json={"text": ["rot"] * 4}).status_code == 200  # a batch of 4 lines,
        first = pool.submit(c.post, "/v1/translate", json={"text": ["ein Mann", "rot", "blau"]})  # so 3 wait
        end = time.monotonic() + 10
        while app.state.server.scheduler.waiting < 3:
            assert time.monotonic() < end
            time.sleep(0.005)
        r = c.post("/v1/translate", json={"text": ["Hund", "Kind"]})
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and "busy" in r.json()["error"]
        assert first.result().status_code == 200  # the waiting request is not hurt
        assert c.post("/v1/translate", json={"text": ["Hund", "Kind"]}).status_code == 200


def test_a_fault_in_the_search_is_a_500_json_and_the_server_goes_on(ckpt):
    app = make_app(ckpt)
    with TestClient(app) as c:
        ready(c)
        srv = app.state.server
        work = srv.scheduler.run
        srv.scheduler.run = lambda key, lines, early: 1 / 0
        r = c.post("/v1/translate", json={"text": ["ein Mann"]})
        assert r.status_code == 500 and r.json() == {"error": "translation failed (ZeroDivisionError)"}
        srv.scheduler.run = work
        assert c.post("/v1/translate", json={"text": ["ein Mann"]}).status_code == 200


# ------------------------------------------------------------------------------ bounded work


def test_beam_and_nbest_are_bounded_by_the_servers_flags(ckpt):
    with TestClient(make_app(ckpt, max_beam=20, max_nbest=2)) as c:
        ready(c)
        r = c.post("/v1/translate", json={"text": ["rot"], "beam": 20})  # over the old fixed bound of 16
        assert r.status_code == 200 and r.json()["beam"] == 20
        r = c.post("/v1/translate", json={"text": ["rot"], "beam": 21})
        assert r.status_code == 422 and r.json() == {"error": "beam: at most --max-beam 20, got 21", "field": "beam"}
        r = c.post("/v1/translate", json={"text": ["rot"], "beam": 4, "nbest": 3})
        assert r.status_code == 422 and "--max-nbest 2" in r.json()["error"] and r.json()["field"] == "nbest"
        r = c.post("/translate", json={"q": "rot", "source": "de", "target": "en", "alternatives": 2})
        assert r.status_code == 400 and "--max-nbest 2" in r.json()["error"]  # LibreTranslate's code for a bad field


def test_a_request_is_priced_by_its_work_and_refused_at_once_over_max_work(ckpt, reference):
    from aiayn.serve.batch import Key, price

    key = Key(4, 0.6, 1, False)
    S = len(reference.encode(["ein Mann läuft"])[0])
    assert price(S, key, 2) == 4 * (S + S + 51) and price(0, key, 2) == 0  # a blank line is not searched
    assert price(S, key._replace(attention=True, nbest=2), 2) == 4 * (S + S + 51) + 2 * 2 * (S + 51) * S
    budget = 3 * price(S, key, 2)
    app = make_app(ckpt, max_work=budget)
    with TestClient(app) as c:
        ready(c)
        batches = app.state.server.scheduler.stats.batches
        assert c.post("/v1/translate", json={"text": ["ein Mann läuft"] * 3 + [""]}).status_code == 200
        r = c.post("/v1/translate", json={"text": ["ein Mann läuft"] * 4})  # one line too many
        assert r.status_code == 413 and f"more than --max-work {budget}" in r.json()["error"]
        r = c.post("/v1/translate", json={"text": ["ein Mann läuft"], "beam": 16})  # a wide beam
        assert r.status_code == 413 and "--max-work" in r.json()["error"]
        r = c.post("/v1/translate", json={"text": ["ein Mann läuft"], "attention": True})  # weights are work too
        assert r.status_code == 413 and "--max-work" in r.json()["error"]
        r = c.post("/translate", json={"q": "ein Mann läuft\n" * 4, "source": "de", "target": "en"})
        assert r.status_code == 400 and "--max-work" in r.json()["error"]  # LibreTranslate's code for a limit
        assert app.state.server.scheduler.stats.batches == batches + 1  # refused before the queue


def test_deeply_nested_json_is_a_400_with_a_json_body(client):
    deep = b"[" * 100_000 + b"]" * 100_000
    for path, body in [("/translate", deep), ("/translate", b'{"q": ' + deep + b"}"), ("/v1/translate", deep),
                       ("/v1/translate", b'{"text": ' + deep + b"}")]:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json(), (path, r.status_code, r.text[:100])
        if path == "/v1/translate":  # was FastAPI's "There was an error parsing the body"
            assert r.json() == {"error": DEEP_JSON, "field": "body"} and "nested too deeply" in DEEP_JSON


def test_health_answers_while_a_long_request_is_tokenized(ckpt):
    """Tokenization runs off the event loop: while a 1,024-line request's lines are being encoded
    (held here until /health has answered, at most 10 s), /health answers."""
    import anyio

    app = make_app(ckpt)
    srv = app.state.server
    encode, release, started, released = srv.translator.encode, threading.Event(), threading.Event(), []

    def slow_encode(lines, *a, **k):
        if lines == ["lang 0"]:
            started.set()
            released.append(release.wait(10))  # False: /health never answered while it waited
        return encode(lines, *a, **k)

    text = [f"lang {i}" for i in range(1023)] + [" ".join(["rot"] * 70)]  # the last line: over the model's length

    async def main():  # so the long request is refused once tokenized: it needs no search
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            long = asyncio.ensure_future(c.post("/v1/translate", json={"text": text}, timeout=60))
            await anyio.to_thread.run_sync(started.wait, 10)
            health = await asyncio.wait_for(c.get("/health"), 30)
            release.set()  # /health has answered: the tokenization may go on
            return health.status_code, (await long).status_code

    async def with_lifespan():
        async with app.router.lifespan_context(app):
            while not srv.ready:
                await asyncio.sleep(0.01)
            srv.translator.encode = slow_encode
            return await main()

    status, long_status = asyncio.run(with_lifespan())
    assert status == 200 and released == [True] and long_status == 413


# ------------------------------------------------------------------------------ concurrency


def test_concurrent_requests_share_batches_and_match_translator(ckpt, reference):
    app = make_app(ckpt, max_wait_ms=100)
    lines = [f"{w} {v} läuft" for w in ("ein Mann", "eine Frau", "der Hund", "ein Kind") for v in ("rot", "blau", "und")]
    settings = [{"beam": 4}, {"beam": 2, "nbest": 2}]  # two settings: they never share a batch
    with TestClient(app) as c, ThreadPoolExecutor(16) as pool:
        ready(c)
        before = app.state.server.scheduler.stats.batches
        jobs = [(line, s, pool.submit(c.post, "/v1/translate", json={"text": [line], **s}))
                for line in lines for s in settings]
        for line, s, job in jobs:
            r = job.result()
            assert r.status_code == 200
            want = reference.search([line], beam=s["beam"], nbest=s.get("nbest", 1))[0]
            assert [h["text"] for h in r.json()["translations"][0]["hypotheses"]] == [t for t, _ in want]
        batches = app.state.server.scheduler.stats.batches - before
        assert 2 <= batches < len(jobs) // 2  # lines of different clients were merged
        metrics = _samples(c.get("/metrics").text)
    # /metrics counts the same batches and lines (the warm-up is not a batch)
    assert metrics["aiayn_batch_lines_count"] == batches and metrics["aiayn_batch_lines_sum"] == len(jobs)


# ------------------------------------------------------------------------------ the other endpoints


@pytest.mark.parametrize("threads, parts", [(1, 1), (2, 2)])
def test_the_model_thread_cuts_a_batch_into_one_part_per_torch_thread(reference, monkeypatch, threads, parts):
    """Padding counted: lines of very different lengths are one part on one thread, not several."""
    import aiayn.translator
    from aiayn.serve.batch import Key, run_batch

    searched = []
    search = aiayn.translator.beam_search
    monkeypatch.setattr(aiayn.translator, "beam_search", lambda model, src, *a, **k: searched.append(src.size(0))
                        or search(model, src, *a, **k))
    lines = [w for w in LINES if w.strip()] * 4 + [""]  # 20 lines of 2 to 15 source tokens, a blank one
    early = []
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = run_batch(reference, Key(2, 0.6, 1, False), lines, lambda i, hyps: early.append((i, hyps)))
    finally:
        torch.set_num_threads(old)
    assert len(searched) == parts and sum(searched) == len(lines) - 1
    assert [nb[0]["text"] for nb in out] == reference.translate(lines, beam=2)
    # every searched line was handed over early (from the worker that searched it), as returned
    assert sorted(i for i, _ in early) == list(range(len(lines) - 1))
    assert all(out[i] == hyps for i, hyps in early)


def _samples(text):
    """/metrics as {name or name{labels}: value} (labels sorted, as `name{k="v",...}`)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_info_and_metrics_count_what_was_done(ckpt, reference):
    """The metrics' values after known requests, not only their names (they print 0.0 from the start)."""
    lines = ["ein Mann läuft auf der Straße", "rot blau", ""]
    with TestClient(make_app(ckpt, max_wait_ms=20, max_chars=300)) as client:
        info = ready(client).get("/v1/info").json()
        assert info["languages"] == {"source": "de", "target": "en"} and info["model"]["d_model"] == 32
        assert info["limits"]["beam"] == 4 and info["limits"]["max_chars"] == 300 and "torch" in info["versions"]
        before = _samples(client.get("/metrics").text)
        r = client.post("/v1/translate", json={"text": lines})  # one request: one batch
        assert r.status_code == 200
        assert client.post("/v1/translate", json={"text": ["x" * 301]}).status_code == 413
        metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    got = _samples(metrics.text)
    best = [t["hypotheses"][0]["tokens"] for t in r.json()["translations"]]
    assert got["aiayn_target_tokens_total"] - before["aiayn_target_tokens_total"] == sum(map(len, best)) > 0
    assert got["aiayn_batch_source_tokens_sum"] == sum(len(ids) for ids in reference.encode(lines[:2])) > 0
    assert got["aiayn_batch_lines_count"] == got["aiayn_batch_source_tokens_count"] == 1  # warm-up not counted
    assert got["aiayn_batch_lines_sum"] == 3  # the blank line rides along (it is answered without a search)
    assert got["aiayn_batch_seconds_count"] == 1 and 0 < got["aiayn_batch_seconds_sum"] < 60
    assert got["aiayn_tokens_per_second"] > 0 and got["aiayn_queue_lines"] == 0
    assert got["aiayn_dropped_lines_total"] == 0
    assert got['aiayn_requests_total{path="/v1/translate",status="200"}'] == 1
    assert got['aiayn_requests_total{path="/v1/translate",status="413"}'] == 1
    assert got['aiayn_request_seconds_count{path="/v1/translate"}'] == 2


def test_docs_and_page(client):
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/translate", "/v1/translate", "/languages", "/health", "/v1/info", "/metrics"} <= set(paths)
    page = client.get("/")
    assert page.status_code == 200 and "<textarea" in page.text
    assert page.headers["cache-control"] == "no-cache"  # asked again after an upgrade, not guessed fresh
    for asset in ("/static/app.js", "/static/style.css"):
        r = client.get(asset)
        assert r.status_code == 200 and r.headers["cache-control"] == "no-cache", asset
        again = client.get(asset, headers={"if-none-match": r.headers["etag"]})
        assert again.status_code == 304 and again.headers["cache-control"] == "no-cache", asset


# ------------------------------------------------------------------------------ disconnects


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def served(app):
    """`app` on uvicorn in a thread on a free loopback port, once ready: yields (base URL, port)."""
    import uvicorn

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < end
            time.sleep(0.05)
        yield base, port
    finally:
        server.should_exit = True
        thread.join(30)


def test_client_disconnect_drops_its_unstarted_lines(ckpt):
    # after a batch of 4 lines, fewer lines wait up to 3 s for company
    app = make_app(ckpt, max_wait_ms=3000, max_batch_tokens=100_000)
    with served(app) as (base, port):
        end = time.monotonic() + 60
        srv = app.state.server
        assert httpx.post(f"{base}/v1/translate", json={"text": ["rot"] * 4}, timeout=60).status_code == 200
        body = json.dumps({"text": ["ein Mann", "rot blau"]}).encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            while srv.scheduler.waiting < 2:
                assert time.monotonic() < end
                time.sleep(0.005)
        # the client is gone before its lines' batch started: they are dropped, never searched
        while srv.scheduler.stats.dropped < 2:
            assert time.monotonic() < end, "the lines of a closed connection were not dropped"
            time.sleep(0.005)
        assert srv.scheduler.waiting == 0 and srv.scheduler.stats.lines == 4  # the priming batch only
        assert "aiayn_dropped_lines_total 2.0" in httpx.get(f"{base}/metrics").text
        assert httpx.post(f"{base}/v1/translate", json={"text": ["rot"]}, timeout=30).status_code == 200


def test_a_client_gone_while_its_lines_are_tokenized_gets_none_of_them_searched(ckpt):
    """docs/serving.md: a client that disconnects before its batch starts has its lines dropped,
    never searched; one that went while its 1,024 lines were tokenized got a whole batch searched."""
    app = make_app(ckpt)
    srv = app.state.server
    gate, tokenize = threading.Event(), srv.source_ids

    def slow(*args):
        gate.wait(60)
        return tokenize(*args)

    srv.source_ids = slow
    with served(app) as (base, port):
        body = json.dumps({"text": ["ein Mann", "rot blau"]}).encode()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            _held_by(srv, "ip:127.0.0.1", 2)  # its lines are being tokenized
        time.sleep(0.5)  # the server sees the connection closed
        gate.set()
        end = time.monotonic() + 30
        while srv.scheduler.stats.dropped < 2:
            assert time.monotonic() < end, f"searched {srv.scheduler.stats.lines} lines of a client gone"
            time.sleep(0.01)
        assert srv.scheduler.stats.lines == 0 and srv.scheduler.waiting == 0
        assert "aiayn_dropped_lines_total 2.0" in httpx.get(f"{base}/metrics").text
        assert httpx.post(f"{base}/v1/translate", json={"text": ["rot"]}, timeout=30).status_code == 200


@contextlib.contextmanager
def model_held(srv):
    """Holds the model thread at its next batch until the block ends (the scheduler's lines stay in)."""
    gate, run = threading.Event(), srv.scheduler.run

    def held(*args):
        gate.wait(60)
        return run(*args)

    srv.scheduler.run = held
    try:
        yield
    finally:
        gate.set()


def _held_by(srv, who, lines, timeout=30.0):
    end = time.monotonic() + timeout
    while srv.clients.held.get(who, 0) != lines:
        assert time.monotonic() < end, f"{who} holds {srv.clients.held}"
        time.sleep(0.01)


def test_one_client_holds_at_most_max_client_lines_by_ip_or_api_key(ckpt):
    """A client (IP address, or API key with --api-keys) with --max-client-lines lines in the server
    gets LibreTranslate's 429 naming the flag; other clients are served meanwhile, and so is it
    once its lines are answered."""
    app = make_app(ckpt, max_lines=3, max_client_lines=4)
    srv = app.state.server
    other = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=60)
    with served(app) as (base, _), ThreadPoolExecutor(5) as pool, other:
        with model_held(srv):
            first = pool.submit(httpx.post, f"{base}/v1/translate", json={"text": ["rot", "blau", "Hund"]}, timeout=60)
            _held_by(srv, "ip:127.0.0.1", 3)
            r = httpx.post(f"{base}/v1/translate", json={"text": ["ein Mann", "eine Frau"]})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert r.json() == {"error": "IP address 127.0.0.1 has 3 lines in the server and asks for 2 more, over "
                                         "--max-client-lines 4 per client; retry once its requests are answered"}
            r = httpx.post(f"{base}/translate", json={"q": "ein Mann. Eine Frau.", "source": "de", "target": "en"})
            assert r.status_code == 429 and r.json()["error"].startswith("Slowdown: IP address 127.0.0.1 has 3 lines")
            one_more = pool.submit(httpx.post, f"{base}/v1/translate", json={"text": ["Kind"]}, timeout=60)  # 3 + 1 fit
            elsewhere = pool.submit(other.post, f"{base}/v1/translate", json={"text": ["rot", "blau", "Hund"]})
            proxied = pool.submit(httpx.post, f"{base}/v1/translate", json={"text": ["rot"]},  # a proxy on this host
                                  headers={"X-Forwarded-For": "10.0.0.9"}, timeout=60)
            _held_by(srv, "ip:127.0.0.1", 4)
            _held_by(srv, "ip:127.0.0.2", 3)
            _held_by(srv, "ip:10.0.0.9", 1)
        assert [f.result().status_code for f in (first, one_more, elsewhere, proxied)] == [200] * 4
        assert srv.clients.held == {}
        assert httpx.post(f"{base}/v1/translate", json={"text": ["rot", "blau", "Hund"]}).status_code == 200
    keyed = create_app(Translator.from_checkpoint(ckpt), Limits(max_lines=3, max_client_lines=3), ("de", "en"),
                       api_keys=frozenset({"k1", "k2"}))
    srv = keyed.state.server
    with served(keyed) as (base, _), ThreadPoolExecutor(2) as pool:
        with model_held(srv):
            first = pool.submit(httpx.post, f"{base}/translate", json={"q": ["rot", "blau"], "source": "de",
                                                                        "target": "en", "api_key": "k1"}, timeout=60)
            _held_by(srv, "key:k1", 2)
            r = httpx.post(f"{base}/v1/translate", json={"text": ["rot", "blau"]}, headers={"Authorization": "Bearer k1"})
            assert r.status_code == 429 and r.json()["error"].startswith("this API key has 2 lines in the server")
            assert "k1" not in r.text  # a message never shows the key
            second = pool.submit(httpx.post, f"{base}/v1/translate", json={"text": ["rot", "blau"]},
                                 headers={"Authorization": "Bearer k2"}, timeout=60)  # the same IP, another key
            _held_by(srv, "key:k2", 2)
        assert first.result().status_code == 200 and second.result().status_code == 200


def test_a_client_that_disconnects_frees_its_client_lines_while_its_batch_is_searched(ckpt):
    """docs/serving.md: the count is freed at once, the batch already searched finishes."""
    app = make_app(ckpt, max_lines=3, max_client_lines=3)
    srv = app.state.server
    with served(app) as (base, port), ThreadPoolExecutor(1) as pool:
        with model_held(srv):  # the model thread has taken the batch and is "searching" it
            body = json.dumps({"text": ["rot", "blau", "Hund"]}).encode()
            with socket.create_connection(("127.0.0.1", port)) as sock:
                sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                _held_by(srv, "ip:127.0.0.1", 3)
                end = time.monotonic() + 30
                while not srv.scheduler.busy:
                    assert time.monotonic() < end
                    time.sleep(0.01)
            _held_by(srv, "ip:127.0.0.1", 0)  # gone: freed while its batch is still running
            assert srv.scheduler.busy
            again = pool.submit(httpx.post, f"{base}/v1/translate", json={"text": ["ein Mann", "rot", "blau"]},
                                timeout=60)
            _held_by(srv, "ip:127.0.0.1", 3)  # its reconnection is let in: one batch more than the limit, briefly
        assert again.result().status_code == 200


# ------------------------------------------------------------------------------ the scheduler


def _run_scheduler(coro_fn, **kw):
    async def main():
        calls = []

        def run(key, lines, early):
            calls.append((key, list(lines)))
            if "boom" in lines:
                raise RuntimeError("boom")
            return [f"{key}:{line}" for line in lines]

        s = Scheduler(run, **kw)
        try:
            return await coro_fn(s, calls)
        finally:
            await s.close()

    return asyncio.run(main())


def test_scheduler_cuts_token_bounded_fair_batches_and_keeps_settings_apart():
    async def go(s, calls):
        a = s.submit("k1", ["a1", "a2", "a3"], [4, 4, 4])
        b = s.submit("k2", ["b1"], [1])
        c = s.submit("k1", ["c1"], [4])
        results = await asyncio.gather(a.future, b.future, c.future)
        return results, calls

    results, calls = _run_scheduler(go, max_batch_tokens=8, max_wait=0.05)
    assert results == [["k1:a1", "k1:a2", "k1:a3"], ["k2:b1"], ["k1:c1"]]
    # a line of a and of c (a's share while others wait: 2 tokens, but at least a line), then b, the
    # least recently served, then a alone takes the whole batch
    assert calls == [("k1", ["a1", "c1"]), ("k2", ["b1"]), ("k1", ["a2", "a3"])]


def test_scheduler_drops_cancelled_work_bounds_the_queue_and_survives_faults():
    async def go(s, calls):
        a = s.submit("k", ["a1", "a2"], [1, 1])
        with pytest.raises(QueueFull):
            s.submit("k", ["x", "y"], [1, 1])
        s.cancel(a)
        assert s.waiting == 0 and s.stats.dropped == 2
        bad = s.submit("k", ["boom"], [1])
        with pytest.raises(RuntimeError):
            await bad.future
        ok = s.submit("k", ["fine"], [1])
        return await ok.future, calls

    result, calls = _run_scheduler(go, max_queue=3, max_wait=0.05)
    assert result == ["k:fine"] and calls == [("k", ["boom"]), ("k", ["fine"])]


def test_scheduler_waits_for_the_lines_the_last_batch_answered_at_most_max_wait():
    async def go(s, calls):
        start = time.monotonic()
        await s.submit("k", ["a", "b", "c"], [1, 1, 1]).future  # the first batch goes at once
        first = time.monotonic() - start
        start = time.monotonic()
        await s.submit("k", ["d"], [1]).future  # one line, after a batch of three: waits for company
        second = time.monotonic() - start
        s.submit("k", ["e", "f"], [1, 1])
        start = time.monotonic()
        await s.submit("k", ["g"], [1]).future  # three lines waiting: more than the last batch answered
        return first, second, time.monotonic() - start, calls

    first, second, third, calls = _run_scheduler(go, max_wait=0.3, max_batch_tokens=100)
    assert first < 0.2 and 0.25 <= second < 2.0 and third < 0.2
    assert calls == [("k", ["a", "b", "c"]), ("k", ["d"]), ("k", ["e", "g", "f"])]  # a line of each request in turn
    full, *_ = _run_scheduler(go, max_wait=10.0, max_batch_tokens=1)  # a full batch goes at once
    assert full < 2.0


def test_scheduler_waits_for_the_lines_it_answered_so_that_clients_stay_one_cohort():
    async def main():
        calls = []

        def run(key, lines, early):
            calls.append(list(lines))
            time.sleep(0.5 if lines == ["a"] else 0)
            return lines

        s = Scheduler(run, max_wait=1.0, max_batch_tokens=100)
        try:
            a = s.submit("k", ["a"], [1])  # client A's line runs at once ...
            await asyncio.sleep(0.05)
            b = s.submit("k", ["b"], [1])  # ... and client B's waits for it
            await a.future  # A sends again as soon as it is answered: B's batch waits for it
            start = time.monotonic()
            await asyncio.gather(b.future, s.submit("k", ["c"], [1]).future)
            return calls, time.monotonic() - start
        finally:
            await s.close()

    calls, seconds = asyncio.run(main())
    assert calls == [["a"], ["b", "c"]] and seconds < 0.5  # not [b] then [c]: one batch of both clients


def test_scheduler_answers_a_line_when_it_is_done_and_the_next_batch_still_waits_for_the_rest():
    """Client A's line is done early in a batch of A and B: A is answered while B's line still
    runs, sends again at once, and its new line waits for B's client, so both stay one cohort."""
    async def main():
        calls, a_answered = [], []

        def run(key, lines, early):
            calls.append(list(lines))
            if lines == ["a", "b"]:
                early(0, "a!")  # a is done; b takes 0.5 s more
                time.sleep(0.5)
                a_answered.append(a.future.done())
            return [f"{line}!" for line in lines]

        s = Scheduler(run, max_wait=1.0, max_batch_tokens=100)
        try:
            a, b = s.submit("k", ["a"], [1]), s.submit("k", ["b"], [1])
            assert await a.future == ["a!"]
            c = s.submit("k", ["c"], [1])  # A again, while b runs
            assert await b.future == ["b!"]
            start = time.monotonic()
            await asyncio.gather(c.future, s.submit("k", ["d"], [1]).future)  # B again
            return calls, a_answered, time.monotonic() - start
        finally:
            await s.close()

    calls, a_answered, seconds = asyncio.run(main())
    assert a_answered == [True]  # before its batch was back
    assert calls == [["a", "b"], ["c", "d"]] and seconds < 0.5  # not [c] then [d]


def test_scheduler_waits_for_no_line_cancelled_while_a_batch_ran():
    async def main():
        def run(key, lines, early):
            time.sleep(0.3 if lines == ["a"] else 0)
            return lines

        s = Scheduler(run, max_wait=1.0, max_batch_tokens=2)
        try:
            a = s.submit("k", ["a"], [2])  # a full batch alone ...
            r = s.submit("k", ["r1", "r2", "r3"], [1, 1, 1])  # ... while these wait
            await asyncio.sleep(0.1)
            s.cancel(r)  # r's client goes away during a's batch
            await a.future
            start = time.monotonic()
            await s.submit("k", ["b"], [1]).future  # a's client again: nobody else to wait for
            return time.monotonic() - start
        finally:
            await s.close()

    assert asyncio.run(main()) < 0.5


def test_scheduler_waits_for_no_client_that_cannot_come_back():
    async def go(s, calls):
        start = time.monotonic()
        a, x = s.submit("k1", ["a", "b"], [1, 1]), s.submit("k2", ["x"], [1])
        await asyncio.gather(a.future, x.future)  # x's settings differ: nobody of batch [a, b] joins it
        mixed = time.monotonic() - start
        start = time.monotonic()
        await s.submit("k1", ["c", "d", "e"], [1, 1, 1]).future  # cut in two: the rest is all there is
        return mixed, time.monotonic() - start, calls

    mixed, split, calls = _run_scheduler(go, max_wait=1.0, max_batch_tokens=2, max_share=1.0)  # no share cap
    assert mixed < 0.5 and split < 0.5
    assert calls == [("k1", ["a", "b"]), ("k2", ["x"]), ("k1", ["c", "d"]), ("k1", ["e"])]


def test_a_fault_in_the_scheduler_fails_the_waiting_requests_instead_of_hanging_them():
    async def go(s, calls):
        cut = s._cut
        s._cut = lambda: (_ for _ in ()).throw(RuntimeError("bug"))
        bad = s.submit("k", ["a"], [1])
        with pytest.raises(RuntimeError, match="bug"):
            await asyncio.wait_for(bad.future, 5)
        s._cut = cut
        return await asyncio.wait_for(s.submit("k", ["b"], [1]).future, 5), s.waiting

    assert _run_scheduler(go) == (["k:b"], 0)


def test_scheduler_interleaves_a_long_request_with_short_ones_and_caps_its_share():
    """A 40-line request alone fills every batch; a one-line request (of any settings) arriving
    during one of its batches goes in the next, beside at most `max_share` of the long one's tokens."""
    async def main():
        calls = []

        def run(key, lines, early):
            calls.append((key, list(lines)))
            time.sleep(0.05)
            return lines

        s = Scheduler(run, max_wait=0.0, max_batch_tokens=8, max_share=0.25)
        try:
            long = s.submit("k", [f"L{i}" for i in range(40)], [1] * 40)
            await asyncio.sleep(0.02)  # the first batch of 8 runs
            short = s.submit("k", ["s"], [1])
            other = s.submit("k2", ["o"], [1])  # other settings: a batch of its own, not after all 40
            await asyncio.gather(short.future, other.future, long.future)
            return calls
        finally:
            await s.close()

    calls = asyncio.run(main())
    assert calls[0] == ("k", [f"L{i}" for i in range(8)])  # alone: a full batch
    assert calls[1] == ("k", ["s", "L8", "L9"])  # it waited longest; 2 of 8 tokens (the share) of the long one
    assert calls[2] == ("k2", ["o"])
    assert all(len(lines) == 8 for _, lines in calls[3:-1])  # alone again: full batches
    assert [line for _, lines in calls for line in lines if line.startswith("L")] == [f"L{i}" for i in range(40)]


def test_scheduler_waits_for_the_short_client_it_answered_before_a_long_request_fills_a_batch():
    """Alone for a moment after a batch that answered a short request, a long request does not fill
    the next batch: that batch waits (at most max_wait) for the short client to come back."""
    async def main():
        calls = []

        def run(key, lines, early):
            calls.append(list(lines))
            time.sleep(0.05)
            return lines

        s = Scheduler(run, max_wait=0.5, max_batch_tokens=8, max_share=0.25)
        try:
            long = s.submit("k", [f"L{i}" for i in range(40)], [1] * 40)
            await asyncio.sleep(0.02)
            await s.submit("k", ["s1"], [1]).future
            await s.submit("k", ["s2"], [1]).future  # the client sends again at once
            await long.future
            return calls
        finally:
            await s.close()

    calls = asyncio.run(main())
    assert calls[:3] == [[f"L{i}" for i in range(8)], ["s1", "L8", "L9"], ["L10", "s2", "L11"]]
    assert all(len(lines) == 8 for lines in calls[3:-1])


def test_a_gpu_batch_is_not_cut_into_one_part_per_cpu_thread():
    """On the CPU the model thread cuts a batch into one part per torch thread (searched side by side);
    a GPU searches one part at a time, so there the batch stays whole, up to translate's 4096."""
    from types import SimpleNamespace

    from aiayn.serve.batch import _split_tokens

    lines = ["ein Satz"] * 64
    encode = lambda xs: [[5] * 10 for _ in xs]  # noqa: E731
    on = lambda device: SimpleNamespace(model=torch.nn.Linear(2, 2, device=device), encode=encode)  # noqa: E731
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        assert _split_tokens(on("cpu"), lines) == math.ceil(64 * 10 * 1.05 / 4)
        assert _split_tokens(on("meta"), lines) == 4096  # any device that is not the CPU
    finally:
        torch.set_num_threads(threads)


def test_head_is_answered_as_get_without_a_body_on_every_get_route(client):
    """Uptime monitors and link checkers ask with HEAD (RFC 9110: every GET resource answers it);
    FastAPI's GET routes, unlike Starlette's, answered it 405."""
    routes = [r.path for r in client.app.routes if "GET" in (getattr(r, "methods", None) or ())]
    assert {"/languages", "/frontend/settings", "/spec", "/v1/info", "/metrics", "/health", "/"} <= set(routes)
    for path in [*routes, "/static/app.js"]:
        get, head = client.get(path), client.head(path)
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers["content-type"] == get.headers["content-type"], path
    assert client.head("/languages").headers["content-length"] == client.get("/languages").headers["content-length"]
    r = client.head("/v1/translate")  # a POST route: still 405, naming the method it takes
    assert r.status_code == 405 and r.headers["allow"] == "POST"
