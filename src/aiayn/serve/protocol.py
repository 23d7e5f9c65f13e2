"""The HTTP connection of `aiayn serve`: uvicorn's h11 protocol with a deadline on the request head.

uvicorn bounds the idle time between two requests of a kept-alive connection (`timeout_keep_alive`,
armed when a response is done, cancelled by the next byte that arrives), and the app bounds the
body (`--body-timeout`), but nothing bounds the head: a client that sends its request line and
headers a byte at a time (slowloris), or opens a connection and sends nothing, holds a connection
for ever, and --max-connections of them lock everyone out. So each request head, from the moment
the connection opens or the first byte of a next request arrives, must be complete within
`--head-timeout` seconds: else a partial head gets a 408 (JSON, `Connection: close`) and the
connection is closed; a connection that sent nothing is closed without a word, as uvicorn closes
an idle kept-alive one.

The same deadline bounds a body the app answered without reading (a GET's, or a POST refused at
once with 411/413), counted from the answer: h11 waits for its end to discard it, and every byte of
it cancels uvicorn's keep-alive timer, so a client trickling it would hold the connection for ever;
once it ends, the connection idles on this timer, not uvicorn's (which that byte cancelled).

And it bounds an answer the client does not read: once the transport holds more of it than its
high-water mark (the socket's buffers are full), the client must take some of it within each
deadline, else the connection is aborted (a slow reader that keeps reading gets it all). Without that, a client that
asks for a large answer and never reads it holds its connection, and the answer's memory, for ever
(`close` waits to send what the transport holds), and --max-connections of them lock everyone out.

A head's size is bounded too: h11 refuses a head still arriving past its 16 KiB, and `HeadLimited`
one that arrived whole (in one read, or queued behind a pipelined request) past the same limit;
both get a 431 in JSON, as every error of the server.

The seam is the protocol class itself (`uvicorn.Config(http=...)`): only it sees bytes arrive
before h11 has a whole request for the app, and the transport's word that its writes are paused.

What it answers or closes itself never reaches the app's middleware, so it tells the app's metrics
(`Counts`): the 408s above, h11's 400 for a malformed head, the connections closed on the deadline,
and the 503 past --max-connections (uvicorn's limit_concurrency, checked here instead of by uvicorn,
whose own 503 no one could count). And its answers carry the CORS headers the app's middleware gives
every other answer (`app.state.cors_headers`, where the app has CORS on, `aiayn.serve.app`), for the
request's Origin as far as its head came: without them a page could not read why it was refused.
"""

from __future__ import annotations

import asyncio
import json
from http import HTTPStatus
from typing import Any, Protocol, cast
from urllib.parse import unquote

import h11
from starlette.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol


class Counts(Protocol):
    """What the protocol reports to the metrics (`aiayn.serve.app.Metrics`)."""

    def answered(self, path: str, status: int) -> None: ...  # a request it answered itself
    def closed(self, reason: str) -> None: ...  # a connection it closed on the deadline: head, idle, body, read


class _Uncounted:
    def answered(self, path: str, status: int) -> None:
        pass

    def closed(self, reason: str) -> None:
        pass


class HeadTimedH11(H11Protocol):
    """`H11Protocol` whose request heads must arrive within `head_timeout` seconds, and whose
    answers must not stall unread longer (a subclass per value: `with_head_timeout`)."""

    head_timeout: float = 10.0
    counts: Counts = _Uncounted()
    _head_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    _write_left = 0  # what the transport held when the write timer was armed

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.h11_max_incomplete_event_size
        self.conn = HeadLimited(DEFAULT_MAX_INCOMPLETE_EVENT_SIZE if limit is None else limit)
        self._head = bytearray()  # the first bytes (up to the limit) of a head still being read: its Origin, if refused
        # uvicorn's check would answer with an app of its own: `app` checks the same, and counts
        self.max_concurrency, self.limit_concurrency = self.limit_concurrency, None

    @property
    def app(self) -> Any:
        """The app for the request whose head just came in (uvicorn's `handle_events` reads it once per
        request, where it checks limit_concurrency): past --max-connections, a counted 503."""
        limit = self.max_concurrency
        if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
            self.logger.warning("Exceeded concurrency limit.")
            self.counts.answered(self.scope["path"], 503)
            refusal = JSONResponse({"error": f"--max-connections {limit} reached (open connections, this one among "
                                             "them, or requests in flight); retry shortly"},
                                   503, {"Retry-After": "1", "Connection": "close"})
            refusal.raw_headers += self._cors(list(self.scope["headers"]))
            return refusal
        return self._app

    @app.setter
    def app(self, app: Any) -> None:
        self._app = app

    def send_400_response(self, msg: str) -> None:
        """What h11 cannot read, answered as JSON and counted (uvicorn's is a plain-text "Invalid HTTP
        request received."): 431 for a request head over h11's limit, 400 for anything else; where an
        answer has begun already (a bad body after it), none can follow: the connection is closed
        (uvicorn's own call raised there, and logged a traceback)."""
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):  # an answer begun or sent
            self.transport.close()
            return
        conn = cast(HeadLimited, self.conn)
        if conn.too_long:  # h11's "buffer too long", or ours for a whole head
            status, why = 431, f"the request line and headers are over {conn.limit} bytes; send them shorter"
        else:
            status, why = 400, "the request is not valid HTTP/1.1 (its request line, headers or chunked body)"
        body = json.dumps({"error": why}).encode()
        head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)),
                (b"connection", b"close"), *self._cors(self._refused_headers())]
        for event in (h11.Response(status_code=status, reason=HTTPStatus(status).phrase, headers=head),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()
        self.counts.answered("", status)  # no path to name: a head h11 cannot read, or a body after it

    def _refused_headers(self) -> list[tuple[bytes, bytes]]:
        """The headers of a request h11 could not read: uvicorn's, where it read the head and the body failed;
        else those of the head's whole lines as far as they came (its first bytes, up to the limit)."""
        conn = cast(HeadLimited, self.conn)
        if conn.our_state is h11.SEND_RESPONSE and not conn.too_long:
            return list(self.scope["headers"])
        return _header_lines(bytes(self._head))

    def _cors(self, request_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        """The CORS headers the app's answers to a request with `request_headers` carry: those its middleware
        adds, said by the function `aiayn.serve.app` leaves on the app's state (none where CORS is off)."""
        cors_headers = getattr(getattr(self.config.app, "state", None), "cors_headers", None)
        return cors_headers(request_headers) if cors_headers is not None else []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(cast(asyncio.Transport, transport))  # a stream transport: uvicorn's own type
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._waiting() and self._head_timer is None:  # the first byte of a next request (kept alive)
            self._arm()
        if self.conn.their_state is h11.IDLE:  # a head arriving (bounded: h11 refuses one past the limit)
            self._head += data[:cast(HeadLimited, self.conn).limit - len(self._head)]
        super().data_received(data)  # uvicorn cancels its keep-alive timer here, for good
        if self.conn.their_state is not h11.IDLE:  # read (or refused)
            self._head.clear()
        if not self._waiting():  # a head is in (or the connection has failed)
            self._disarm()
        elif self._head_timer is None:  # a late body ended: the connection idles, on our timer only
            self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer, which any byte cancels
        if not self.transport.is_closing() and self._waiting() and self.conn.their_state is not h11.IDLE:
            self._arm()  # a body the app did not read: it must end within the deadline, trickled or not

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._write_resumed()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()  # the client takes the answer slower than it is written, or not at all
        self._write_resumed()
        self._arm_write_timer()

    def _arm_write_timer(self) -> None:
        self._write_left = self.transport.get_write_buffer_size()
        self._write_timer = self.loop.call_later(self.head_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        self._write_resumed()
        super().resume_writing()

    def _write_resumed(self) -> None:
        _cancel(self._write_timer)
        self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if self.transport.get_write_buffer_size() < self._write_left:  # read since: a slow client, not a gone one
            self._arm_write_timer()
            return
        self.counts.closed("read")
        self.transport.abort()  # not close(): that waits to send what the buffer holds, for ever

    def _waiting(self) -> bool:
        """Whether the connection waits on the client alone: for a request head, or for the rest of a
        body the app answered without reading (a GET's; a POST refused at once), to be discarded."""
        our, their = self.conn.our_state, self.conn.their_state
        return their is h11.IDLE or (our is h11.DONE and their is h11.SEND_BODY)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        _cancel(self._head_timer)
        self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._waiting():
            return
        head = self.conn.trailing_data[0]
        if self.conn.their_state is not h11.IDLE:  # the rest of a body answered unread
            self.counts.closed("body")
        elif not head:  # nothing sent: closed without a word
            self.counts.closed("idle")
        else:  # a head begun: say why
            self.counts.answered(_target(bytes(head)), 408)
            self.counts.closed("head")
            body = json.dumps({"error": f"the request head was not sent within --head-timeout "
                                        f"{self.head_timeout:g} s"}).encode()
            cors = b"".join(b"%s: %s\r\n" % field for field in self._cors(_header_lines(bytes(head))))
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), cors, body))
        self.transport.close()


class HeadLimited(h11.Connection):
    """h11's server connection with its limit on a request head (`limit` bytes) kept for a head that
    came whole too: h11 checks only a head still arriving (its buffer past the limit with no end of
    head in it), so one that arrived in one read (asyncio reads up to 256 KiB at once), or behind a
    pipelined request, passed whatever its size, and its headers went to the app."""

    def __init__(self, limit: int) -> None:
        super().__init__(h11.SERVER, limit)
        self.limit = limit
        self.too_long = False  # the error just raised is a head over the limit: a 431

    def next_event(self) -> Any:
        before = self._buffered() if self.their_state is h11.IDLE else 0  # (their next event: a request head)
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as e:
            self.too_long = e.error_status_hint == 431
            raise
        if isinstance(event, h11.Request) and before - self._buffered() > self.limit:
            self.too_long = True
            raise h11.RemoteProtocolError("request head too long", error_status_hint=431)
        return event

    def _buffered(self) -> int:
        """Bytes in h11's own buffer: its private `_receive_buffer` (the public `trailing_data` copies the
        buffer, on every byte of a trickled head), else, should a release rename it, `trailing_data`."""
        buffer = getattr(self, "_receive_buffer", None)
        return len(buffer) if buffer is not None else len(self.trailing_data[0])


def with_head_timeout(seconds: float, counts: Counts | None = None) -> type[HeadTimedH11]:
    """The protocol class to give `uvicorn.Config(http=...)`: request heads within `seconds`; what it
    answers or closes itself reported to `counts`."""
    return type("HeadTimedH11", (HeadTimedH11,), {"head_timeout": float(seconds), "counts": counts or _Uncounted()})


def _target(head: bytes) -> str:
    """The path of a partial request head, once its request line is whole ("" before)."""
    line, end, _ = head.partition(b"\r\n")
    parts = line.split(b" ")
    return unquote(parts[1].partition(b"?")[0].decode("latin-1")) if end and len(parts) == 3 else ""


def _header_lines(head: bytes) -> list[tuple[bytes, bytes]]:
    """The fields of a request head's whole header lines (its request line, and a line cut off at the end,
    left out), names in lower case as uvicorn gives them; a line that is no field is passed over."""
    fields = []
    for line in head.split(b"\n")[1:-1]:
        line = line.removesuffix(b"\r")
        if not line:  # the end of the head
            break
        name, colon, value = line.partition(b":")
        if colon and name and name == name.strip() and not any(c < 32 and c != 9 for c in value):
            fields.append((name.lower(), value.strip(b" \t")))
    return fields


def _cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()
