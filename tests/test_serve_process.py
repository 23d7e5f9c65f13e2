"""`aiayn serve` as a real process on 127.0.0.1: start-up on a free port, /health, a burst of concurrent
clients answered as `aiayn translate` answers, SIGTERM and Ctrl-C draining with nothing lost, and
one-line errors for bad flags."""

import contextlib
import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
from serve_model import DE_EN, sentence, tiny_checkpoint  # noqa: E402

from aiayn.memory import ONEDNN_CACHES  # noqa: E402
from aiayn.translator import Translator  # noqa: E402

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.getbasetemp())


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ONEDNN_CACHES:  # the server must cap them itself
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, env.get("PYTHONPATH", "")) if p)
    return env


class Served:
    """`aiayn serve` on a free port; `url` once it has said where it listens, `wait_ready` for /health."""

    def __init__(self, ckpt, *flags):
        self.proc = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", "--checkpoint", str(ckpt), "--port", "0",
                                      *flags], stderr=subprocess.PIPE, text=True, env=_env())
        line = self.proc.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/", line)
        assert m, f"no address in {line!r}"
        self.port = int(m.group(1))
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout=120.0):
        end = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None and time.monotonic() < end, "the server did not become ready"
            time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


@pytest.fixture
def served(ckpt):
    started = []

    def start(*flags):
        started.append(Served(ckpt, *flags))
        return started[-1]

    yield start
    for s in started:
        s.stop()


def _post(url, lines, **kw):
    return httpx.post(f"{url}/v1/translate", json={"text": lines, **kw}, timeout=120)


def test_burst_of_clients_matches_aiayn_translate_then_sigterm_drains(ckpt, served, tmp_path):
    rng = random.Random(1)
    lines = [sentence(rng)[0] for _ in range(48)]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    want = subprocess.run([sys.executable, "-m", "aiayn", "translate", "--checkpoint", str(ckpt), "--input", str(src)],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert want.returncode == 0, want.stderr
    want = want.stdout.splitlines()

    s = served("--max-wait-ms", "3000", "--max-batch-tokens", "100000").wait_ready()  # lines wait for company
    with ThreadPoolExecutor(48) as pool:  # one line per request, all at once
        got = list(pool.map(lambda line: _post(s.url, [line]), lines))
    assert [r.status_code for r in got] == [200] * len(lines)
    assert [r.json()["translations"][0]["hypotheses"][0]["text"] for r in got] == want
    batches = re.search(r"^aiayn_batch_lines_count (\S+)$", httpx.get(f"{s.url}/metrics").text, re.M)
    assert 1 <= float(batches.group(1)) < len(lines) // 4  # the warm-up is not counted; clients shared batches

    # SIGTERM while requests wait for their batch: they are answered, then the server exits 0
    assert _post(s.url, lines[:10]).status_code == 200  # after a batch of 10 lines, fewer wait up to 3 s
    with ThreadPoolExecutor(8) as pool:
        inflight = [pool.submit(_post, s.url, [line]) for line in lines[:8]]
        end = time.monotonic() + 30
        while "aiayn_queue_lines 8.0" not in httpx.get(f"{s.url}/metrics").text:
            assert time.monotonic() < end
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
        _wait_until_refused(s.port)  # it stops listening at once ...
        with pytest.raises(httpx.ConnectError):  # ... so new work is refused
            _post(s.url, ["ein Mann"])
        # ... while the lines in flight still wait for their batch (not refused only once they were answered)
        assert not any(f.done() for f in inflight), "new connections were refused only after the drain"
        answers = [f.result() for f in inflight]
    assert [r.status_code for r in answers] == [200] * 8
    assert [r.json()["translations"][0]["hypotheses"][0]["text"] for r in answers] == want[:8]
    assert s.proc.wait(60) == 0
    assert "stopped" in s.proc.stderr.read()


def _wait_until_refused(port, timeout=30.0):
    """Until a connection to `port` is refused (a socket still listening, even unserved, accepts it)."""
    end = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            return
        assert time.monotonic() < end, f"port {port} still accepts connections {timeout:.0f} s after SIGTERM"
        time.sleep(0.01)


def test_ctrl_c_exits_0_libretranslate_form_and_capped_kernel_caches(ckpt, served):
    s = served().wait_ready()
    runtime = httpx.get(f"{s.url}/v1/info").json()["runtime"]  # oneDNN's kernel caches are capped (flat RSS)
    assert runtime["onednn_primitive_cache_capacity"] == runtime["lru_cache_capacity"] == "64"
    r = httpx.post(f"{s.url}/translate", data={"q": "ein Mann läuft", "source": "de", "target": "en"})
    want = Translator.from_checkpoint(ckpt).translate(["ein Mann läuft"], beam=4)[0]  # the server's default beam
    assert r.status_code == 200 and r.json() == {"translatedText": want} and want.startswith("a man")
    # kept-alive connections answer as fast as fresh ones: no 40 ms stall of Nagle's algorithm and
    # delayed ACKs (a fresh connection starts in quick-ACK mode, so it is the stall-free baseline,
    # measured here on the same loaded machine)
    kept, fresh = _health_times(s.port, keep_alive=True), _health_times(s.port, keep_alive=False)
    assert _median(kept) < 3 * _median(fresh) + 0.010, (kept, fresh)
    s.proc.send_signal(signal.SIGINT)
    assert s.proc.wait(60) == 0


def _health_times(port, keep_alive, n=21):
    """Seconds per GET /health, over one kept-alive connection or a new connection each."""
    took = []
    conn = None
    for _ in range(n):
        start = time.perf_counter()
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.connect()
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b'{"status":"ok"}'
        took.append(time.perf_counter() - start)
        if not keep_alive:
            conn.close()
            conn = None
    if conn is not None:
        conn.close()
    return took


def _median(xs):
    return sorted(xs)[len(xs) // 2]


def test_bad_flags_and_checkpoints_are_one_line_errors(ckpt, tmp_path):
    def serve(*argv):
        return subprocess.run([sys.executable, "-m", "aiayn", "serve", *argv], capture_output=True, text=True,
                              env=_env(), timeout=120)

    for argv, words in [(["--checkpoint", str(ckpt), "--beam", "0"], "--beam must be between 1 and --max-beam (16)"),
                        (["--checkpoint", str(ckpt), "--max-queue", "0"], "--max-queue must be positive"),
                        (["--checkpoint", str(ckpt), "--max-lines", "5000"], "--max-lines (5000) must be at most"),
                        (["--checkpoint", str(ckpt), "--max-share", "0"], "--max-share must be in (0, 1]"),
                        (["--checkpoint", str(ckpt), "--max-client-lines", "100", "--max-lines", "200"],
                         "--max-client-lines (100) must be at least --max-lines (200)"),
                        (["--checkpoint", str(ckpt), "--body-timeout", "nan"], "--body-timeout must be between"),
                        (["--checkpoint", str(ckpt), "--max-chars", "30000"],
                         "--max-body-memory (256 MiB) must hold the largest body"),
                        (["--checkpoint", str(ckpt), "--head-timeout", "0"], "--head-timeout must be between"),
                        (["--checkpoint", str(ckpt), "--port", "70000"], "--port must be between"),
                        (["--checkpoint", str(tmp_path / "none")], "does not exist")]:
        r = serve(*argv)
        assert r.returncode == 2 and words in r.stderr and r.stderr.count("\n") == 1, r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        r = serve("--checkpoint", str(ckpt), "--port", str(taken.getsockname()[1]))
    assert r.returncode == 2 and "choose another --port" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    no_lang = tmp_path / "nolang"
    no_lang.mkdir()
    for f in os.listdir(ckpt):
        (no_lang / f).write_bytes((ckpt / f).read_bytes())
    cfg = json.loads((no_lang / "config.json").read_text())
    cfg.pop("train")
    (no_lang / "config.json").write_text(json.dumps(cfg))
    r = serve("--checkpoint", str(no_lang))
    assert r.returncode == 2 and "names no source and target language" in r.stderr, r.stderr
    assert '"train": {"src": "de", "tgt": "en"' in r.stderr and r.stderr.count("\n") == 1  # what to do about it



def test_a_host_that_is_no_address_of_this_machine_is_named_as_the_flag_to_change():
    """A --host not on this machine: "choose another --host", not "choose another --port"."""
    from aiayn.errors import AiaynError
    from aiayn.serve.cli import _bind

    with pytest.raises(AiaynError, match=r"cannot listen on 192\.0\.2\.1:0 \(.*\); --host 192\.0\.2\.1 is not an "
                                         r"address of this machine: choose another --host"):
        _bind("192.0.2.1", 0)  # TEST-NET-1: never a local address


def test_an_ipv6_host_is_printed_as_a_url_that_works(ckpt):
    """--host ::1: the address printed is http://[::1]:PORT/ (it was http://::1:PORT/, no URL)."""
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    proc = subprocess.Popen([sys.executable, "-m", "aiayn", "serve", "--checkpoint", str(ckpt), "--host", "::1",
                             "--port", "0"], stderr=subprocess.PIPE, text=True, env=_env())
    try:
        m = re.search(r"on (http://\S+/) ", proc.stderr.readline())
        assert m and re.fullmatch(r"http://\[::1\]:\d+/", m.group(1)), m
        end = time.monotonic() + 120
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(m.group(1) + "health").status_code == 200:
                    break
            assert proc.poll() is None and time.monotonic() < end, "the server did not become ready"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait(30)


def test_the_server_searches_its_model_as_it_is_not_a_view_per_batch(ckpt):
    """A trainable model gets a fresh frozen view (and freshly packed weights) at every search; the
    server's own model is frozen once, so batches reuse the packed weights."""
    from aiayn.checkpoint import load_checkpoint
    from aiayn.serve.cli import load
    from aiayn.translator import inference_view

    model = load_checkpoint(ckpt).model
    assert inference_view(model) is not model  # as loaded: trainable
    translator, pair, _ = load(str(ckpt), "fp32")
    assert pair == ("de", "en") and inference_view(translator.model) is translator.model


def _stalled_upload(port):
    """A POST that promises 100 bytes of body, sends 7 and stalls (a slow or hostile client)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"text\"")
    return sock


def _until_closed(sock):
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_a_stalled_upload_gets_408_and_connections_are_limited(served):
    s = served("--body-timeout", "1", "--max-connections", "3").wait_ready()
    start = time.monotonic()
    with _stalled_upload(s.port) as sock:
        reply = _until_closed(sock)  # the server closes the connection after its answer
    assert reply.startswith(b"HTTP/1.1 408 ") and b"--body-timeout 1 s" in reply and 0.8 < time.monotonic() - start < 20
    idle = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(3)]  # connections held open
    try:
        time.sleep(0.3)
        r = httpx.get(f"{s.url}/health")
        assert r.status_code == 503  # over --max-connections: refused before the app runs
    finally:
        for sock in idle:
            sock.close()
    end = time.monotonic() + 20
    while httpx.get(f"{s.url}/health").status_code != 200:
        assert time.monotonic() < end, "the server did not take connections again"
        time.sleep(0.1)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(60) == 0
    log = s.proc.stderr.read()
    assert "Traceback" not in log and set(log.splitlines()) <= {"WARNING:  Exceeded concurrency limit.",
                                                                "aiayn serve: stopped"}, log


def _slow_head(port, seconds, kept_alive=False):
    """A client that sends a request head one byte per 0.2 s (slowloris) for at most `seconds`, after a
    request answered on the same connection if `kept_alive`; returns (what the server answered since,
    seconds until it closed the connection, or None if it never did)."""
    head = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 1000 + b"\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as sock:
        reply = b""
        if kept_alive:
            sock.settimeout(10)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
            while not reply.endswith(b'{"status":"ok"}'):
                reply += sock.recv(65536)
            sock.settimeout(0.2)
            reply = b""
        start = time.monotonic()
        for byte in head:
            if time.monotonic() - start > seconds:
                return reply, None
            try:
                sock.sendall(bytes([byte]))
                chunk = sock.recv(65536)  # waits 0.2 s: the pace of the client
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return reply, time.monotonic() - start
            if not chunk:
                return reply, time.monotonic() - start
            reply += chunk
    return reply, None


def test_a_slow_request_head_gets_408_and_an_idle_connection_is_closed(served):
    s = served("--head-timeout", "1").wait_ready()
    reply, closed = _slow_head(s.port, seconds=8)
    assert closed is not None, "the server still held a connection sending its head after 8 s"
    assert 0.8 < closed < 4 and reply.startswith(b"HTTP/1.1 408 "), (closed, reply)
    assert reply.endswith(b'{"error": "the request head was not sent within --head-timeout 1 s"}')
    reply, closed = _slow_head(s.port, seconds=8, kept_alive=True)  # the next head of a kept-alive connection
    assert closed is not None and 0.8 < closed < 4 and reply.startswith(b"HTTP/1.1 408 "), (closed, reply)
    with socket.create_connection(("127.0.0.1", s.port), timeout=8) as idle:  # sends nothing at all
        start = time.monotonic()
        assert idle.recv(65536) == b"" and 0.8 < time.monotonic() - start < 4  # closed, without a word
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    with contextlib.closing(conn):  # kept alive: each head in time
        for _ in range(3):
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b'{"status":"ok"}'
            time.sleep(0.6)  # 1.8 s on one connection, more than --head-timeout
    assert s.proc.poll() is None and httpx.get(f"{s.url}/health").status_code == 200


def test_sigterm_ends_the_server_despite_a_stalled_upload_and_logs_one_line(served):
    s = served("--body-timeout", "300", "--shutdown-timeout", "1").wait_ready()
    with _stalled_upload(s.port) as sock:
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)  # without --shutdown-timeout, uvicorn waits for the body for ever
        assert s.proc.wait(120) == 0
        reply = _until_closed(sock)
    log = s.proc.stderr.read().splitlines()  # after the line that said where it listens
    assert log == ["ERROR:    Cancel 1 running task(s), timeout graceful shutdown exceeded", "aiayn serve: stopped"], log
    assert reply.startswith(b"HTTP/1.1 503 ") and reply.endswith(
        b'{"error":"the server stopped before this request was done (--shutdown-timeout)"}')


def _answered_unread(port, length=10):
    """A connection whose `GET /health` promises `length` body bytes and has its answer (the app reads
    no body of a GET): the server waits for the body it will discard."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % length)
    reply = b""
    while not reply.endswith(b'{"status":"ok"}'):
        reply += sock.recv(65536)
    return sock


def _closed_within(sock, seconds, trickle=False):
    """Seconds until the server closes `sock` (None if not within `seconds`), sending a byte each 0.2 s
    if `trickle`; what it reads must be nothing (it answered already)."""
    sock.settimeout(0.2)
    start = time.monotonic()
    with contextlib.closing(sock):
        while time.monotonic() - start < seconds:
            try:
                if trickle:
                    sock.sendall(b"x")
                data = sock.recv(65536)
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - start
            assert data == b"", data
            return time.monotonic() - start
    return None


def test_a_connection_with_an_unread_body_is_closed_after_its_answer(served):
    """The app answers a GET without reading its body (or a POST too large, at once): the connection
    waits for the rest of the body, which it may not do for longer than --head-timeout, whatever
    trickles in; nor may it idle for ever once a late body is complete."""
    s = served("--head-timeout", "1", "--max-connections", "8").wait_ready()
    socks = [_answered_unread(s.port) for _ in range(7)]  # 7 of 8 connections, then one body byte each
    for sock in socks:
        sock.sendall(b"x")
    times = [_closed_within(sock, 8) for sock in socks]
    assert all(t is not None and t < 4 for t in times), times
    assert httpx.get(f"{s.url}/health").status_code == 200  # not locked out by --max-connections
    for path in ("/", "/health"):  # uptime monitors ask with HEAD (once a 405)
        r = httpx.head(f"{s.url}{path}")
        assert r.status_code == 200 and r.content == b""

    closed = _closed_within(_answered_unread(s.port, 1000), 8, trickle=True)  # a byte per 0.2 s: a deadline
    assert closed is not None and closed < 4, closed

    late = _answered_unread(s.port)
    late.sendall(b"0123456789")  # the whole body, late: then an idle kept-alive connection
    closed = _closed_within(late, 8)
    assert closed is not None and closed < 4, closed

    with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:  # 413 at once: Connection: close
        sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 999999999999\r\n\r\n{\"text\"")
        start = time.monotonic()
        reply = _until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 413 ") and b"connection: close" in reply.lower(), reply
    assert time.monotonic() - start < 0.8

    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    with contextlib.closing(conn):  # a GET whose body comes with its head, then the next request: kept alive
        for _ in range(3):
            conn.request("GET", "/health", body=b"0123456789")
            assert conn.getresponse().read() == b'{"status":"ok"}'
            time.sleep(0.6)
        assert conn.sock is not None
    assert s.proc.poll() is None


def test_a_slow_reader_that_keeps_reading_gets_the_whole_answer():
    """The deadline on an answer is for a client that stops reading: one that takes a large answer
    slowly (longer than --head-timeout in all, some of it within each) gets every byte."""
    import threading

    import uvicorn

    from aiayn.serve.protocol import with_head_timeout

    body = b"x" * 12_000_000  # more than the kernel's buffers hold (localhost: up to ~4 MB)

    async def app(scope, receive, send):  # type: ignore[no-untyped-def]
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, http=with_head_timeout(1.0),
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        end = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < end, "the server never started"
            time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
            sock.settimeout(30)
            got, start = 0, time.monotonic()
            with contextlib.suppress(ConnectionResetError):
                while chunk := sock.recv(65536):  # at most ~3 MB/s: 4 s or more in all, 4 deadlines
                    got += len(chunk)
                    time.sleep(0.02)
            assert got > len(body) and time.monotonic() - start > 2.0, (got, time.monotonic() - start)
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_answer_left_unread_loses_its_connection_after_head_timeout(served):
    """A client that asks for megabytes (attention) and never reads them held its connection, and
    the answer's memory, for ever (the transport's close waits to send it all): --max-connections of
    them locked everyone out. Now a stalled answer is aborted after --head-timeout; one that is read
    comes whole."""
    s = served("--head-timeout", "1", "--max-connections", "2", "--max-work", "100000000").wait_ready()
    rng = random.Random(0)
    # 120 lines: megabytes past what the sockets' buffers hold (weights go out with 4 decimals)
    lines = [" ".join(rng.choice(list(DE_EN)) for _ in range(16)) for _ in range(120)]
    body = json.dumps({"text": lines, "attention": True, "nbest": 4}).encode()
    read = httpx.post(f"{s.url}/v1/translate", content=body, headers={"Content-Type": "application/json"}, timeout=120)
    assert read.status_code == 200 and len(read.content) > 4_000_000 and len(read.json()["translations"]) == 120
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, then nothing read
        sock.connect(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        sock.settimeout(120)
        assert sock.recv(12) == b"HTTP/1.1 200"
        end = time.monotonic() + 20
        while httpx.get(f"{s.url}/health").status_code != 200:  # 503: the unread answer held one of 2
            assert time.monotonic() < end, "a client that reads nothing still holds its connection"
            time.sleep(0.2)
        got = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
        assert got < len(read.content)  # aborted, not sent whole
    assert s.proc.poll() is None


def test_an_ipv6_address_in_use_is_named_with_brackets():
    """"cannot listen on ::1:8000" read as one address; it is [::1]:8000, as a URL writes it."""
    from aiayn.errors import AiaynError
    from aiayn.serve.cli import _bind

    with socket.socket(socket.AF_INET6) as held:
        try:
            held.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(AiaynError) as e:
            _bind("::1", port)
    assert str(e.value).startswith(f"cannot listen on [::1]:{port} (") and str(e.value).endswith("choose another --port")


def _upload_begun(port, length):
    """A POST that promises `length` bytes of body and sends 10 (a slow upload, or a stalled one)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(b"POST /v1/translate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n{\"text\": [" % length)
    return sock


def test_large_bodies_past_max_body_memory_are_refused_unread_and_small_ones_still_pass(served):
    """Every POST body was read whole, each up to --max-lines x --max-chars x 12 + 64 KiB (24.6 MB
    by default), and --max-connections (512) uploads at once could hold ~12 GB. Now the bodies over
    64 KiB hold their Content-Length against --max-body-memory from before they are read until
    answered: past it a 503 JSON with Retry-After, the body unread, the connection closed; the
    page's small bodies still pass, and a large one does again once the held bodies are gone."""
    s = served("--max-lines", "10", "--max-chars", "1000", "--max-body-memory", "1", "--body-timeout", "60",
               "--max-connections", "64").wait_ready()  # one body: at most 185,536 bytes; 1 MiB holds 6 of 150,000
    uploads = []
    for _ in range(12):  # one after the other: each is held (or refused) before the next begins
        uploads.append(_upload_begun(s.port, 150_000))
        time.sleep(0.05)
    refused, stalled = [], []
    for sock in uploads:
        sock.settimeout(1.0)
        try:
            refused.append((sock, _until_closed(sock)))
        except socket.timeout:
            stalled.append(sock)
    try:
        assert (len(refused), len(stalled)) == (6, 6), [r for _, r in refused]
        for _, reply in refused:
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in head.lower(), reply
            assert b"connection: close" in head.lower(), reply
            assert b"--max-body-memory 1 MiB; retry shortly" in body, reply
        assert _post(s.url, ["ein Mann"]).status_code == 200  # a small body: never refused for it
    finally:
        for sock in uploads:
            sock.close()
    large = b'{"text": ["ein Mann"]' + b" " * 150_000 + b"}"
    end = time.monotonic() + 20
    while (r := httpx.post(f"{s.url}/v1/translate", content=large, headers={"Content-Type": "application/json"},
                           timeout=60)).status_code == 503:  # until the closed uploads are given back
        assert time.monotonic() < end, r.text
        time.sleep(0.1)
    assert r.status_code == 200 and r.json()["translations"][0]["hypotheses"][0]["text"]
    assert 'aiayn_requests_total{path="/v1/translate",status="503"} 6.0' in httpx.get(f"{s.url}/metrics").text
    assert s.proc.poll() is None
