"""How much of the server one client holds: the lines of its requests that are being tokenized,
wait for a batch or are searched, so that one client cannot fill the queue (--max-queue) that all
share and leave the others only 503s.

A client is its API key when the server asks for keys (`--api-keys`), else its IP address (the
one uvicorn reports: behind a reverse proxy on this host, the address the proxy forwards in
X-Forwarded-For). Past `--max-client-lines` a request is refused at once with 429 and
Retry-After; it holds nothing, so the client may retry once its earlier requests are answered.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import Request

from aiayn.serve.errors import ApiError
from aiayn.serve.scheduler import Limits


class ClientBusy(ApiError):
    """The client holds --max-client-lines lines already: 429 with Retry-After (both APIs)."""

    def __init__(self, message: str) -> None:
        super().__init__(429, message, {"Retry-After": "1"})


def check_holdable(limits: Limits, sentences: int, within: str, hint: str = "") -> None:
    """A request of more sentences than one client may ever hold (--max-client-lines, or the whole
    --max-queue) could never be queued: 413 at once, not a 429 or 503 that no retry passes.
    `within` says what they came in ("3 lines"), `hint` what to do ("; send fewer lines")."""
    most, flag = min((limits.max_client_lines, "--max-client-lines"), (limits.max_queue, "--max-queue"))
    if sentences > most:
        raise ApiError(413, f"{sentences} sentences in {within}, more than the server may hold for one request "
                            f"({flag} {most}){hint}")


def _identity(request: Request) -> tuple[str, str]:
    """Who sends `request` and how a message names it: its API key (recorded by `Server.check_key`
    when keys are asked; a message says "this API key", never the key), else its IP address."""
    key = getattr(request.state, "api_key", None)
    if key:
        return f"key:{key}", "this API key"
    host = request.client.host if request.client else ""
    return f"ip:{host}", f"IP address {host}"


class ClientLines:
    """Lines held per client, at most `limit` each (on the event loop only: no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held: dict[str, int] = {}

    @contextmanager
    def hold(self, request: Request, lines: int) -> Iterator[None]:
        """Holds `lines` for the client of `request` while the block runs; 429 past the limit."""
        who, named = _identity(request)
        held = self.held.get(who, 0)
        if held + lines > self.limit:
            raise ClientBusy(f"{named} has {held} lines in the server and asks for {lines} more, over "
                             f"--max-client-lines {self.limit} per client; retry once its requests are answered")
        self.held[who] = held + lines
        try:
            yield
        finally:
            left = self.held[who] - lines
            if left:
                self.held[who] = left
            else:
                del self.held[who]

