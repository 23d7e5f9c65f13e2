"""`aiayn serve --api-keys` and the memory of large bodies: strangers cannot take it from the clients
that name their keys, and LibreTranslate's clients, whose key is in the body, still get in."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

from aiayn.serve.app import create_app  # noqa: E402
from aiayn.serve.clients import BodyMemory, head_key  # noqa: E402
from aiayn.serve.scheduler import Limits  # noqa: E402
from test_serve import model_held, ready  # noqa: E402
from test_serve_edges import _served_as_cli, de_en  # noqa: E402,F401 (de_en: a fixture)
from test_serve_libre import _one_thread  # noqa: E402,F401 (autouse: one thread)

LARGE = b'{"text": ["ein Mann"]' + b" " * 150_000 + b"}"  # a body over 64 KiB


def _upload_begun(port, length, head=b""):
    """A POST that promises `length` bytes of body and sends 10 (a slow upload, or a stalled one)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n%s"
                 b"Content-Length: %d\r\n\r\n{\"text\": [" % (head, length))
    return sock


def _answer_or_none(sock, wait=1.0):
    """What the server sent before closing `sock`; None if it still waits for the body."""
    sock.settimeout(wait)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        return None
    return data


def _until(check, timeout=30.0):
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end
        time.sleep(0.01)


def test_strangers_large_bodies_hold_a_share_and_clients_with_keys_still_get_in(de_en):
    """With --api-keys, a large body held --max-body-memory before its key (in the body) was read:
    six stalled uploads without a key filled 1 MiB, and a client with a key got 503s. Now a body
    whose head names no key holds against the strangers' share (half), the ones past it are refused
    unread naming where to put the key, and a head's key (Bearer, X-API-Key, ?api_key=) gets the
    rest; a key there that is not one of ours counts as none, a small body with its key inside passes as
    before."""
    limits = Limits(max_wait_ms=5, max_lines=10, max_chars=1000, max_body_memory_mib=1, body_timeout_s=60)
    app = create_app(de_en, limits, ("de", "en"), api_keys=frozenset({"k1"}))  # one body: at most 185,536 bytes
    srv = app.state.server
    with _served_as_cli(app, limits) as (base, port):
        uploads = []
        for _ in range(6):  # one after the other: 512 KiB holds 3 of 150,000 (1 MiB would hold 6)
            uploads.append(_upload_begun(port, 150_000))
            time.sleep(0.05)
        try:
            answers = [_answer_or_none(sock) for sock in uploads]
            assert [a is None for a in answers] == [True] * 3 + [False] * 3, answers
            for reply in answers[3:]:
                head, _, body = reply.partition(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), reply
                assert b"connection: close" in head.lower(), reply
                assert json.loads(body)["error"] == (
                    "the server holds 450000 bytes of request bodies whose head names no API key and this one's "
                    "150000 would pass their share (0.5 MiB of --max-body-memory 1 MiB); retry shortly, or name "
                    "the key in the request head (Authorization: Bearer KEY, X-API-Key: KEY or ?api_key=KEY)")
            assert (srv.bodies.held, srv.bodies.strangers) == (450_000, 450_000)
            json_ = {"Content-Type": "application/json"}
            for headers, params in [({"Authorization": "Bearer k1"}, {}), ({"X-API-Key": "k1"}, {}),
                                    ({}, {"api_key": "k1"})]:
                r = httpx.post(f"{base}/v1/translate", content=LARGE, headers={**json_, **headers}, params=params,
                               timeout=60)
                assert r.status_code == 200, r.text
            with _upload_begun(port, 150_000, b"Authorization: Bearer k2\r\n") as sock:  # not ours: a stranger's
                head, _, body = _answer_or_none(sock).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ") and b"connection: close" in head.lower(), head
            r = httpx.post(f"{base}/translate", json={"q": "ein Mann", "source": "de", "target": "en",
                                                      "api_key": "k1"}, timeout=60)  # LibreTranslate's way
            assert r.status_code == 200 and r.json()["translatedText"]
        finally:
            for sock in uploads:
                sock.close()
        _until(lambda: srv.bodies.held == 0)

        # a stranger's large body that names a valid key leaves the share while it is searched
        libre = json.dumps({"q": "ein Mann", "source": "de", "target": "en", "api_key": "k1"}).encode()
        libre = libre[:-1] + b" " * 150_000 + b"}"
        with ThreadPoolExecutor(1) as pool:
            with model_held(srv):
                asked = pool.submit(httpx.post, f"{base}/translate", content=libre, headers=json_, timeout=60)
                _until(lambda: srv.bodies.held == len(libre) and srv.scheduler.waiting + srv.scheduler.busy)
                assert srv.bodies.strangers == 0
            assert asked.result().status_code == 200
        _until(lambda: srv.bodies.held == 0)
        assert srv.bodies.strangers == 0


def test_a_head_key_that_is_not_ours_leaves_the_bodys_key_to_decide(de_en):
    """A gateway in front of the server may add an `Authorization: Bearer` of its own: the head's key
    won over a valid `api_key` in the body, and the client got 403 (LibreTranslate reads no header).
    A key in the head counts only where it is one of ours; else the body's decides, and a head's
    key alone that is not ours is a 403 as before."""
    limits = Limits(max_wait_ms=5, max_lines=10, max_chars=1000, max_body_memory_mib=1)
    with TestClient(create_app(de_en, limits, ("de", "en"), api_keys=frozenset({"k1"}))) as c:
        ready(c)
        gateway = {"Authorization": "Bearer gateway-token"}
        libre = {"q": "ein Mann", "source": "de", "target": "en", "api_key": "k1"}
        assert c.post("/translate", json=libre, headers=gateway).status_code == 200
        assert c.post("/translate", data=libre, headers=gateway).status_code == 200  # a form, as clients send
        r = c.post("/v1/translate", json={"text": ["ein Mann"], "api_key": "k1"}, headers={"X-API-Key": "nope"})
        assert r.status_code == 200, r.text
        large = json.dumps({**libre, "q": "ein Mann"}).encode()[:-1] + b" " * 150_000 + b"}"
        r = c.post("/translate", content=large, headers={**gateway, "Content-Type": "application/json"})
        assert r.status_code == 200, r.text  # held as a stranger's, then vouched for by its body
        r = c.post("/v1/translate", json={"text": ["ein Mann"]}, headers={"X-API-Key": "nope"})
        assert (r.status_code, r.json()) == (403, {"error": "Invalid API key"})
        assert c.post("/translate", json={**libre, "api_key": "no"}, headers=gateway).status_code == 403


def test_a_large_body_that_strangers_share_never_holds_is_a_401_naming_the_head(de_en):
    """Where --max-body-memory barely holds a largest body, strangers get no share of it: a large body
    whose head names no key would be a 503 "retry shortly" for ever; it is a 401 saying where the key
    goes (the body unread), and with the key there it passes."""
    limits = Limits(max_wait_ms=5, max_lines=40, max_chars=2000, max_body_memory_mib=1)  # largest: 1,025,536 bytes
    with TestClient(create_app(de_en, limits, ("de", "en"), api_keys=frozenset({"k1"}))) as c:
        ready(c)
        r = c.post("/v1/translate", content=LARGE, headers={"Content-Type": "application/json"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        assert r.json()["error"].startswith(f"a body of {len(LARGE)} bytes must name its API key in the request "
                                            "head (Authorization: Bearer KEY, X-API-Key: KEY or ?api_key=KEY)")
        r = c.post("/v1/translate", content=LARGE, headers={"Content-Type": "application/json", "X-API-Key": "k1"})
        assert r.status_code == 200, r.text
        small = {"q": "ein Mann", "source": "de", "target": "en", "api_key": "k1"}
        assert c.post("/translate", json=small).status_code == 200  # a small body: as ever
    with TestClient(create_app(de_en, limits, ("de", "en"))) as c:  # no keys asked: no strangers
        r = ready(c).post("/v1/translate", content=LARGE, headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text


def test_the_heads_key_is_the_requests_key():
    """Bearer first, then X-API-Key, then the query string's first api_key; another scheme or an
    empty value names none."""
    def scope(headers=(), query=b""):
        return {"headers": list(headers), "query_string": query}

    assert head_key(scope([(b"authorization", b"Bearer  k1 "), (b"x-api-key", b"k2")], b"api_key=k3")) == "k1"
    assert head_key(scope([(b"authorization", b"Basic abc"), (b"x-api-key", b"k2")])) == "k2"
    assert head_key(scope(query=b"q=1&api_key=k%203&api_key=k4")) == "k 3"
    assert head_key(scope([(b"authorization", b"Bearer ")], b"api_key=")) is None
    memory = BodyMemory(1000, 300, frozenset({"k"}))
    assert memory.share == 500
    hold = memory.hold({"headers": [], "query_string": b""}, 400)
    assert (memory.held, memory.strangers, hold.stranger) == (400, 400, True)
    memory.release(hold)
    memory.release(hold)  # once only
    assert (memory.held, memory.strangers) == (0, 0)
