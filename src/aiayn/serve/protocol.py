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

The seam is the protocol class itself (`uvicorn.Config(http=...)`): only it sees bytes arrive
before h11 has a whole request for the app.
"""

from __future__ import annotations

import asyncio
import json
from typing import cast

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadTimedH11(H11Protocol):
    """`H11Protocol` whose request heads must arrive within `head_timeout` seconds (a subclass per
    value: `with_head_timeout`)."""

    head_timeout: float = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = False  # bytes of the awaited head have arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(cast(asyncio.Transport, transport))  # a stream transport: uvicorn's own type
        self._arm()

    def data_received(self, data: bytes) -> None:
        waiting = self.conn.their_state is h11.IDLE  # the bytes start or continue a request head
        if waiting:
            if self._head_timer is None:  # the first byte of a next request on a kept-alive connection
                self._arm()
            self._head_bytes = self._head_bytes or bool(data)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection has failed)
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._head_bytes = False

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._head_bytes:  # a head begun and not finished: say why before closing
            body = json.dumps({"error": f"the request head was not sent within --head-timeout "
                                        f"{self.head_timeout:g} s"}).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        self.transport.close()


def with_head_timeout(seconds: float) -> type[HeadTimedH11]:
    """The protocol class to give `uvicorn.Config(http=...)`: request heads within `seconds`."""
    return type("HeadTimedH11", (HeadTimedH11,), {"head_timeout": float(seconds)})
