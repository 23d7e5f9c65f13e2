"""`aiayn serve` at its edges, as real clients reach them: a POST without a body, form-encoded texts
with their line ends, and HTML whose language is detected (`source: auto`)."""

import asyncio
import contextlib
import re
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi import Request  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from aiayn.serve import libre  # noqa: E402
from aiayn.serve.app import Model, create_app  # noqa: E402
from aiayn.serve.scheduler import Limits  # noqa: E402
from aiayn.translator import Translator  # noqa: E402
from serve_model import tiny_checkpoint  # noqa: E402
from test_serve import ready, served  # noqa: E402
from test_serve_libre import _one_thread  # noqa: E402,F401 (autouse: one thread)


@pytest.fixture(scope="module")
def de_en(tmp_path_factory):
    return Translator.from_checkpoint(tiny_checkpoint(tmp_path_factory.getbasetemp()))


@pytest.fixture(scope="module")
def client(de_en):
    with TestClient(create_app(de_en, Limits(max_wait_ms=5), ("de", "en"))) as c:
        yield ready(c)


def _raw(port: int, head: bytes) -> tuple[int, bytes]:
    """Sends `head` (a request without a body) and returns the answer's status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        top, _, body = data.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in top.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(65536)
        return int(top.split()[1]), body


def test_a_post_without_a_body_reads_its_fields_from_the_query_string(de_en):
    """`curl -X POST 'host/translate?q=...&source=de&target=en'` sends neither Content-Length nor
    Transfer-Encoding: a request so has no body (RFC 9112, 6.3), which LibreTranslate (Flask) reads
    from the query string; a chunked body, whose length is unknown, is still a 411."""
    app = create_app(de_en, Limits(max_wait_ms=5), ("de", "en"))
    with served(app) as (base, port):
        status, body = _raw(port, b"POST /translate?q=ein%20Mann&source=de&target=en HTTP/1.1\r\nHost: x\r\n"
                                   b"Connection: close\r\n\r\n")
        want = httpx.post(f"{base}/translate", json={"q": "ein Mann", "source": "de", "target": "en"}).json()
        assert (status, httpx.Response(200, content=body).json()) == (200, want)
        status, _ = _raw(port, b"POST /translate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                               b"Connection: close\r\n\r\n")
        assert status == 411


@pytest.mark.parametrize("text", ["ein Mann läuft\n", "ein Mann läuft\n\n", "ein Mann\u2028eine Frau sitzt",
                                  "ein Mann\x0ceine Frau"])
def test_a_form_text_is_translated_as_the_same_text_in_json(client, text):
    """A form sends its line ends as CRLF (browsers do): they read as "\\n", and nothing else of the
    text changes: a trailing line end stays, a line separator is not made a line end."""
    want = client.post("/translate", json={"q": text, "source": "de", "target": "en"}).json()
    form = {"q": text.replace("\n", "\r\n"), "source": "de", "target": "en"}
    assert client.post("/translate", data=form).json() == want
    assert client.post("/translate", files={k: (None, v) for k, v in form.items()}).json() == want


MASTODON_POST = ('<p>Guten Morgen! <a href="https://mastodon.social/@anne" class="u-url mention">@<span>anne</span>'
                 '</a> <a href="https://mastodon.social/tags/Katze" class="mention hashtag" rel="tag">#<span>Katze'
                 '</span></a></p>')


def test_auto_detects_the_language_of_an_html_texts_words_not_of_its_markup(de_en):
    """Mastodon sends a post as HTML with source auto: its language is that of the text the server
    translates (the text nodes), not that of the tags, addresses and mentions around them."""
    app = create_app([Model(de_en, "de", "en"), Model(de_en, "fr", "en")], Limits(max_wait_ms=5))
    with TestClient(app) as c:
        ready(c)
        r = c.post("/translate", json={"q": MASTODON_POST, "source": "auto", "target": "en", "format": "html"})
        assert r.status_code == 200 and r.json()["detectedLanguage"]["language"] == "de"
        text = c.post("/translate", json={"q": "Guten Morgen! ", "source": "auto", "target": "en"}).json()
        assert r.json()["detectedLanguage"] == text["detectedLanguage"]


def test_many_fields_in_the_query_string_are_read_in_linear_time(monkeypatch):
    """Each field of the query string (and form) is read once: a lookup per name (`getlist`, which
    scans every field) took time quadratic in their number, on the event loop, so one request of
    some 60 kB (as much as a request head may hold) held every other client (/health included) for
    seconds (20,000 fields: 21 s). Counted rather than timed: no lookup per name."""
    from starlette.datastructures import ImmutableMultiDict

    lookups = []
    getlist = ImmutableMultiDict.getlist
    monkeypatch.setattr(ImmutableMultiDict, "getlist", lambda self, key: lookups.append(key) or getlist(self, key))
    query = "&".join(f"k{i}" for i in range(2_000)) + "&q=ein+Mann&source=de&target=en&q=zwei"
    request = Request({"type": "http", "method": "POST", "path": "/translate", "headers": [],
                       "query_string": query.encode()})
    f = asyncio.run(libre.fields(request))
    assert f["q"] == "ein Mann" and len(f) == 2_003  # a field given twice: its first value
    assert len(lookups) < 10


@contextlib.contextmanager
def _served_as_cli(app, limits):
    """`app` on uvicorn with `aiayn serve`'s settings (`uvicorn_config`), in a thread on a free
    loopback port, once ready: yields (base URL, port)."""
    import uvicorn

    from aiayn.serve.cli import _bind, uvicorn_config

    sock = _bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, limits))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{port}"
        end = time.monotonic() + 60
        while not server.started or httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < end and thread.is_alive(), "the server never became ready"
            time.sleep(0.05)
        yield base, port
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _metric(base: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{base}/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def test_refusals_the_http_protocol_makes_itself_are_counted(de_en, caplog):
    """Past --max-connections uvicorn answered 503 before the app ran, and a late request head got
    its 408 from the protocol: neither reached the middleware that counts requests, so /metrics
    showed no client turned away. Now both are in aiayn_requests_total (and h11's 400 for a head
    that is not HTTP), and every connection closed
    on --head-timeout in aiayn_timeout_closes_total by reason; the 503 is JSON naming the flag (and
    saying what it counts: 3 connections open is --max-connections 3 reached, not more than 3). A body
    h11 cannot read after the app's answer gets no 400 (none can follow the answer): none is counted,
    and the connection is closed without uvicorn's traceback in the log."""
    limits = Limits(max_wait_ms=5, max_connections=3, head_timeout_s=0.5)
    with _served_as_cli(create_app(de_en, limits, ("de", "en")), limits) as (base, port):
        warming = _metric(base, 'aiayn_requests_total{path="/health",status="503"}')  # the app's, while warming up
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # with the request's: 3
        try:
            time.sleep(0.1)
            r = httpx.get(f"{base}/health")
        finally:
            for sock in held:
                sock.close()
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == ("--max-connections 3 reached (open connections, this one among them, or requests "
                                     "in flight); retry shortly")  # not "more than 3": 3 were open
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # a head begun, never ended
            sock.sendall(b"POST /translate HTTP/1.1\r\nHost: t\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 408 ")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # not HTTP: h11's 400
            sock.sendall(b"HELLO\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 400 ")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:  # a bad body after the answer:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
            reply = b""
            while not reply.endswith(b'{"status":"ok"}'):
                reply += sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200 ")
            sock.sendall(b"zz\r\n")  # h11 fails on it, and no 400 can follow the 200: none is sent, none counted
            with contextlib.suppress(ConnectionError):
                assert sock.recv(65536) == b""
        time.sleep(0.7)  # the held connections, closed on the deadline too (idle) if not gone already
        assert _metric(base, 'aiayn_requests_total{path="/health",status="503"}') == warming + 1
        assert _metric(base, 'aiayn_requests_total{path="/translate",status="408"}') == 1
        assert _metric(base, 'aiayn_requests_total{path="other",status="400"}') == 1
        assert _metric(base, 'aiayn_timeout_closes_total{reason="head"}') == 1
    assert not [r for r in caplog.records if r.exc_info or "Fatal error" in r.getMessage()]


def test_a_large_answer_is_encoded_without_holding_the_event_loop(de_en):
    """A /v1 answer with attention is megabytes of numbers: `JSONResponse` encoded it in one call on
    the event loop (~0.5 s for 4 MB), and /health and every other client waited meanwhile. Now it is
    encoded in pieces, the loop's turn between them: a task that ticks each millisecond is never
    held 0.25 s while a 14 MB answer (searched here at once) is encoded, and the body is the same."""
    import json

    app = create_app(de_en, Limits(max_wait_ms=5, max_work=10**9), ("de", "en"))
    srv = app.state.server
    row = [0.123456789 + i for i in range(48)]  # 3 layers x 48 target x 48 source per hypothesis
    hypothesis = {"text": "a man", "score": -1.25, "tokens": ["▁a", "▁man"], "attention": [[row] * 48] * 3}

    async def main():
        async with app.router.lifespan_context(app):
            while not srv.ready:
                await asyncio.sleep(0.01)
            srv.scheduler.run = lambda key, lines, early: [[hypothesis] * key.nbest for _ in lines]
            gaps, done = [], asyncio.Event()

            async def tick():
                last = time.perf_counter()
                while not done.is_set():
                    await asyncio.sleep(0.001)
                    gaps.append(time.perf_counter() - last)
                    last = time.perf_counter()

            ticker = asyncio.ensure_future(tick())
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                r = await c.post("/v1/translate", json={"text": ["ein Mann"] * 40, "beam": 4, "nbest": 4,
                                                        "attention": True, "split_sentences": False}, timeout=60)
            done.set()
            await ticker
            return r, gaps

    r, gaps = asyncio.run(main())
    assert r.status_code == 200 and len(r.content) > 10_000_000
    want = {"translations": [{"source_tokens": r.json()["translations"][0]["source_tokens"],
                              "hypotheses": [hypothesis] * 4}] * 40, "beam": 4, "alpha": 0.6}
    assert r.content == json.dumps(want, ensure_ascii=False, separators=(",", ":")).encode()
    assert max(gaps) < 0.25, f"the event loop was held {max(gaps):.3f} s"


def test_an_answer_is_encoded_in_pieces_whatever_its_first_line_and_its_keys():
    """`encode._size` judged a list of lines by its first: a short first line (a heading, say) before
    long ones made the whole answer one piece, encoded in one call with the event loop held; and an
    object split in pieces wrote its keys as values (1, not "1"), unlike `JSONResponse`."""
    import json

    from starlette.responses import JSONResponse

    from aiayn.serve import encode

    row = [0.123456789] * 48
    long = {"source_tokens": ["▁a"] * 48, "hypotheses": [{"text": "ein", "attention": [[row] * 48] * 3}] * 4}
    short = {"source_tokens": ["▁a"], "hypotheses": [{"text": "ein", "attention": [[[0.5]]] * 3}]}
    body = {"translations": [short] + [long] * 10, "beam": 4, "alpha": 0.6}
    pieces = list(encode._pieces(body))
    assert b"".join(pieces) == json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    assert max(map(len, pieces)) < 100_000, f"a piece of {max(map(len, pieces))} bytes"
    keyed = {1: row * 30, None: "ü", True: [row] * 30, 2.5: {}, "k": []}
    assert asyncio.run(encode.json_response(keyed)).body == JSONResponse(keyed).body


def test_the_texts_of_a_large_body_are_checked_for_lone_surrogates_in_one_pass(monkeypatch):
    """Lone surrogates are looked for in a request's texts on the event loop, before --max-lines is
    checked: a regex call per text held the loop ~1 s for a body of 2,000,000 one-letter lines (8 MB,
    under the body limit), 12 times what json.loads took. Now one pass over the texts joined, unless
    one is there (then each text is mended, as before): no text is looked at alone."""
    from aiayn.serve import unicode
    from aiayn.serve.unicode import fields_replaced

    fields = {"text": ["a"] * 100_000, "beam": 4}
    alone: list[str] = []
    mend = unicode.replaced
    monkeypatch.setattr(unicode, "replaced", lambda t: alone.append(t) or mend(t))
    assert fields_replaced(fields) == fields and alone == []
    assert fields_replaced({"text": ["a", "b\ud800", 5], "q": "\udfff"}) == {"text": ["a", "b\ufffd", 5], "q": "\ufffd"}


def test_before_the_warm_up_texts_are_neither_split_nor_detected_and_both_paths_answer_503(de_en, monkeypatch):
    """/v1 cut its lines into sentences (and LibreTranslate's /translate detected a language with
    source auto, parsed and split its texts) before it asked whether the model was warm: work thrown
    away, and errors unlike those of the same request without split_sentences (a 413 for --max-lines,
    where that one is a 503). Now every translation is a 503 before any of it."""
    from aiayn.serve import v1

    done = []
    for module, name in ((v1, "split"), (libre, "split"), (libre, "detect_texts")):
        monkeypatch.setattr(module, name, lambda *a, f=getattr(module, name), n=name: done.append(n) or f(*a))
    c = TestClient(create_app(de_en, Limits(max_lines=2), ("de", "en")))  # no lifespan: never warmed up
    for body in ({"text": ["Ein Mann läuft. Eine Frau sitzt."]}, {"text": ["ein Mann"] * 3},
                 {"text": ["ein Mann"] * 3, "split_sentences": False}):
        r = c.post("/v1/translate", json=body)
        assert (r.status_code, r.json()["error"]) == (503, "the model is warming up; retry shortly"), body
    for source in ("de", "auto"):
        r = c.post("/translate", json={"q": "Ein Mann läuft. Eine Frau sitzt.", "source": source, "target": "en"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert done == []


def test_a_chunked_body_with_a_content_length_is_refused_unread_not_read_past_the_body_limit(de_en):
    """With both Transfer-Encoding: chunked and a Content-Length, h11 reads the body chunked (RFC 9112,
    6.3) while the size check trusted the Content-Length: `Content-Length: 5` let a body of any size
    through, read whole into memory (200 MB took the server's peak memory from 0.57 to 0.84 GB).
    Now any chunked body is a 411, unread, its connection closed."""
    app = create_app(de_en, Limits(max_wait_ms=5, max_lines=1, max_chars=10), ("de", "en"))  # body: 65,656 bytes
    body = b'{"text": ["ein Mann"]' + b" " * 200_000 + b"}"
    with served(app) as (_, port), socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n")
        with contextlib.suppress(ConnectionError):  # the server may close before the body is all sent
            sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        reply = b""
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(65536):
                reply += chunk
    assert reply.startswith(b"HTTP/1.1 411 ") and b"connection: close" in reply.lower(), reply[:300]
    assert reply.endswith(b'{"error":"send the body with a Content-Length header, not chunked"}'), reply[-300:]


def test_a_request_head_h11_cannot_read_is_answered_in_json_and_a_long_one_is_a_431(de_en):
    """uvicorn answered what h11 cannot read with a plain-text 400 `Invalid HTTP request received.`
    (the one error of the server not in JSON), a head over h11's 16 KiB limit too. Now a JSON 400
    saying what was wrong, and a 431 naming the limit for a head too long (as h11 hints); both counted.
    (h11 bounds a head still coming: one that arrives whole in one read may be longer.)"""
    limits = Limits(max_wait_ms=5)
    with _served_as_cli(create_app(de_en, limits, ("de", "en")), limits) as (base, port):
        for head, status, words in [(b"HELLO\r\n\r\n", 400, "not valid HTTP/1.1"),
                                    (b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20_000, 431,  # and more
                                     "the request line and headers are over 16384 bytes")]:
            reply = _replies(port, head)
            top, _, body = reply.partition(b"\r\n\r\n")
            assert top.startswith(b"HTTP/1.1 %d " % status) and b"content-type: application/json" in top.lower(), reply
            assert words in httpx.Response(status, content=body).json()["error"], reply
        assert _metric(base, 'aiayn_requests_total{path="other",status="431"}') == 1


def _replies(port: int, data: bytes) -> bytes:
    """Sends `data` in one write and returns all the server sends until it closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        reply = b""
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(65536):
                reply += chunk
    return reply


def test_a_request_head_over_16_kib_is_a_431_when_it_arrives_whole_too(de_en):
    """h11 bounds a head still arriving (its buffer past 16 KiB without an end of head), not one that
    arrives whole: a 20 KB head in one write, or queued behind a pipelined request, was served (200),
    its headers handed to the app. Now a 431 in JSON, counted, the connection closed; a head under
    the limit still passes."""
    limits = Limits(max_wait_ms=5)
    health = b"GET /health HTTP/1.1\r\nHost: t\r\n"
    with _served_as_cli(create_app(de_en, limits, ("de", "en")), limits) as (base, port):
        under = _replies(port, health + b"X-Big: " + b"a" * 16_000 + b"\r\nConnection: close\r\n\r\n")
        assert under.startswith(b"HTTP/1.1 200 "), under[:200]
        whole = health + b"X-Big: " + b"a" * 20_000 + b"\r\n\r\n"
        for data, answers in [(whole, 1), (health + b"\r\n" + whole, 2)]:  # alone; behind a pipelined request
            reply = _replies(port, data)
            assert reply.count(b"HTTP/1.1 ") == answers and (answers == 1 or reply.startswith(b"HTTP/1.1 200 ")), reply
            top, _, body = reply[reply.rindex(b"HTTP/1.1 "):].partition(b"\r\n\r\n")
            assert top.startswith(b"HTTP/1.1 431 ") and b"content-type: application/json" in top.lower(), reply
            assert b"connection: close" in top.lower(), reply
            assert httpx.Response(431, content=body).json() == {
                "error": "the request line and headers are over 16384 bytes; send them shorter"}
        assert _metric(base, 'aiayn_requests_total{path="other",status="431"}') == 2
        assert httpx.get(f"{base}/health").status_code == 200


def test_a_body_of_many_wrong_values_makes_the_errors_it_answers_not_one_per_value(de_en):
    """pydantic makes an error of each wrong value (a number in `text`, an unknown field) and FastAPI
    copies them all, while the answer names the first: a 2 MB list of numbers held the event loop
    11 s and 1.2 GB, and a body of the largest size (24 MB) would have exhausted the memory. Now the
    body is cut after its first wrong text and its first unknown field: the same answer, from the
    errors of those alone."""
    from fastapi.exceptions import RequestValidationError

    app = create_app(de_en, Limits(max_wait_ms=5), ("de", "en"))
    made, handler = [], app.exception_handlers[RequestValidationError]

    async def counted(request, e):
        made.append(len(e.errors()))
        return await handler(request, e)

    app.exception_handlers[RequestValidationError] = counted
    many = ",".join(f'"x{i}": 1' for i in range(50_000))
    cases = [('{"text": ["ein Mann", ' + "1, " * 100_000 + '"rot"]}', "text[1]: Input should be a valid string", 1),
             ('{"text": ["ein Mann"], ' + many + "}", "x0: Extra inputs are not permitted", 1),
             ('{"z": 0, "text": [[], {}], "beam": "4", ' + many + "}", "text[0]: Input should be a valid string", 3)]
    with TestClient(app) as c:
        ready(c)
        for body, error, errors in cases:
            r = c.post("/v1/translate", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 422 and r.json()["error"] == error, r.text
            assert made.pop() == errors
        assert c.post("/v1/translate", json={"text": ["ein Mann", "rot"]}).status_code == 200


def test_an_app_whose_body_memory_cannot_hold_its_largest_body_is_refused_when_made(de_en):
    """Built without the command line (which checks --max-body-memory), such limits answered every
    large body with a 503 "retry shortly" for ever."""
    with pytest.raises(ValueError, match="max_body_memory_mib"):
        create_app(de_en, Limits(max_lines=100, max_chars=300_000, max_body_memory_mib=256), ("de", "en"))
    create_app(de_en, Limits(max_lines=100, max_chars=200_000, max_body_memory_mib=256), ("de", "en"))


def test_the_head_limit_counts_h11s_buffer_even_if_a_release_renames_it():
    """`HeadLimited` reads h11's private `_receive_buffer` (the public `trailing_data` copies it on
    every byte); h11 is not pinned, and without that field every connection failed with an
    AttributeError that uvicorn does not catch. Both ways count the same bytes."""
    from types import SimpleNamespace

    from aiayn.serve.protocol import HeadLimited

    conn = HeadLimited(100)
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: a")
    assert conn._buffered() == 23 == len(conn.trailing_data[0])
    renamed = SimpleNamespace(trailing_data=(b"GET / HTTP/1.1\r\nHost: a", False))  # no _receive_buffer
    assert HeadLimited._buffered(renamed) == 23  # type: ignore[arg-type]
