"""The answers `aiayn.serve.protocol` writes itself (a 408 for a late head, the 503 past --max-connections,
h11's 400 for a head it cannot read, a 431 for one too long) carry the CORS headers of every other answer
of the server: they had none, and a page of an allowed origin read a network error instead of why it was
refused."""

import socket
import time

import httpx
import pytest

pytest.importorskip("fastapi")
from aiayn.serve.app import create_app  # noqa: E402
from aiayn.serve.scheduler import Limits  # noqa: E402
from test_serve_edges import _replies, _served_as_cli, de_en  # noqa: E402,F401  (de_en: a fixture)
from test_serve_libre import _one_thread  # noqa: E402,F401 (autouse: one thread)

ORIGIN = "https://social.example"


def _answer(port: int, data: bytes) -> tuple[int, dict[str, str]]:
    """Sends `data` and reads the answer to the connection's end (each refusal closes it): status and headers."""
    head = _replies(port, data).partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    fields = (line.partition(":") for line in head[1:])
    return int(head[0].split()[1]), {k.strip().lower(): v.strip() for k, _, v in fields}


def _cors(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.startswith("access-control-") or k == "vary"}


@pytest.mark.parametrize("origins", [[ORIGIN], ["*"], []])
def test_the_protocols_own_answers_carry_the_apps_cors_headers(de_en, origins):
    """The same headers as the app's answer to a request with the same Origin (an allowed one, another, none),
    with CORS on for one origin, for all, or off (none, as the app's)."""
    limits = Limits(max_wait_ms=5, max_connections=3, head_timeout_s=0.5)
    app = create_app(de_en, limits, ("de", "en"), cors_origins=origins)
    with _served_as_cli(app, limits) as (base, port):
        for origin in (ORIGIN, "https://other.example", None):
            sent = f"Origin: {origin}\r\n".encode() if origin else b""
            want = _cors(httpx.get(f"{base}/health", headers={"Origin": origin} if origin else {}).headers)
            assert bool(want) == bool(origins)  # (a Vary at least, where CORS is on)
            if origin == ORIGIN and origins:
                assert want["access-control-allow-origin"] == origins[0]
            got = {}
            got[408] = _answer(port, b"POST /translate HTTP/1.1\r\nHost: t\r\n" + sent)  # a head never ended
            got[400] = _answer(port, b"GET /health HTTP/1.1\r\nHost: t\r\n" + sent + b"no field\r\n\r\n")
            held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # with the request's: 3
            try:
                time.sleep(0.1)
                got[503] = _answer(port, b"GET /health HTTP/1.1\r\nHost: t\r\n" + sent + b"\r\n")
            finally:
                for sock in held:
                    sock.close()
            got[431] = _answer(port, b"GET /health HTTP/1.1\r\nHost: t\r\n" + sent + b"X-Long: " + b"x" * 20_000
                               + b"\r\n\r\n")  # a head over h11's limit
            assert {s: (a, _cors(h)) for s, (a, h) in got.items()} == {s: (s, want) for s in got}, origin
            time.sleep(0.2)  # the held connections seen closed: --max-connections free again
