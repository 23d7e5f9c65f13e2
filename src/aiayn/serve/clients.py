"""How much of the server one client holds: the lines of its requests that are being tokenized,
wait for a batch or are searched, so that one client cannot fill the queue (--max-queue) that all
share and leave the others only 503s; and the large bodies held before they are read, so that
strangers cannot take the memory for them (--max-body-memory) from the clients that name a key.

A client is its API key when the server asks for keys (`--api-keys`), else its IP address (the
one uvicorn reports: behind a reverse proxy on this host, the address the proxy forwards in
X-Forwarded-For). Past `--max-client-lines` a request is refused at once with 429 and
Retry-After; it holds nothing, so the client may retry once its earlier requests are answered.

A body over `SMALL_BODY` bytes holds its Content-Length from before it is read until its request
is answered (`BodyMemory`); past --max-body-memory it is refused unread (503, Retry-After), else
--max-connections uploads of the largest body could hold gigabytes. With --api-keys, a LibreTranslate
client's key is inside that body, unread when the memory is held: strangers uploading large bodies
(slowly, up to --body-timeout) could fill it all and leave the clients with keys only 503s. So a
key may come in the request head too (`head_key`: `Authorization: Bearer KEY`, `X-API-Key: KEY`,
`?api_key=KEY`; one of ours there is the request's key, the body's is not read): a body whose head
names a valid key holds against the whole budget, any other against the strangers' share (half,
and never so much that a known client's largest body would not fit beside it), which it leaves once
its body names a valid key (`BodyMemory.vouch`: its request may be searched a while). A head's key
that is not ours counts as none (a gateway in front may add its own Bearer token), and a body the
share can never hold is refused at once (401: name the key in the head). Without --api-keys every
sender is a known client.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

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


# ------------------------------------------------------------------ large bodies, by the key in the head

HEADER = b"x-api-key"
IN_HEAD = "Authorization: Bearer KEY, X-API-Key: KEY or ?api_key=KEY"


def head_key(scope: Mapping[str, Any], keys: Collection[str] | None = None) -> str | None:
    """The key the head of the ASGI request `scope` names: `Authorization: Bearer KEY`, else
    `X-API-Key: KEY`, else the query string's first `api_key` (None when it names none). Given the
    server's `keys`, the first of those three that is one of them: a gateway in front may add a Bearer
    of its own beside the client's X-API-Key or ?api_key= (the Bearer alone was read: every such client
    got 403)."""
    bearer = other = query = None
    for name, value in scope.get("headers", ()):
        text = value.decode("utf-8", "replace").strip()
        if name == b"authorization" and bearer is None:
            scheme, _, key = text.partition(" ")
            bearer = key.strip() if scheme.lower() == "bearer" else None
        elif name == HEADER and other is None:
            other = text
    for name, value in parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True):
        if name == "api_key":
            query = value
            break
    named = [k for k in (bearer, other, query) if k]
    ours = [k for k in named if keys is not None and k in keys]
    return (ours or named or [None])[0]


SCOPE_KEY = "aiayn.body_hold"  # where the middleware leaves a request's `Hold` in its ASGI scope


@dataclass
class Hold:
    """The bytes one body holds, and whether its sender is still a stranger."""

    length: int
    stranger: bool


class BodyMemory:
    """The large bodies held at once (on the event loop only: no lock)."""

    def __init__(self, budget: int, largest: int, keys: frozenset[str] | None = None) -> None:
        self.budget, self.keys = budget, keys
        self.share = budget if keys is None else max(0, min(budget // 2, budget - largest))
        self.held = 0  # bytes of all the large bodies held
        self.strangers = 0  # of those, the bytes of bodies whose sender named no key yet

    def hold(self, scope: MutableMapping[str, Any], length: int) -> Hold:
        """Holds `length` bytes for the body of `scope` (left in it, for `vouch`); an `ApiError`
        (the body unread) where it may not."""
        # a head's key that is not ours may be a gateway's own Bearer token: the body's key decides
        stranger = self.keys is not None and head_key(scope, self.keys) not in self.keys
        if stranger and length > self.share:
            raise ApiError(401, f"a body of {length} bytes must name its API key in the request head ({IN_HEAD}): "
                                f"this server holds at most {self.share} bytes of bodies over 64 KiB from senders "
                                "it does not know yet", {"WWW-Authenticate": "Bearer"})
        mib = self.budget / 2**20
        if stranger and self.strangers + length > self.share:
            raise ApiError(503, f"the server holds {self.strangers} bytes of request bodies whose head names no API "
                                f"key and this one's {length} would pass their share ({self.share / 2**20:g} MiB of "
                                f"--max-body-memory {mib:g} MiB); retry shortly, or name the key in the request head "
                                f"({IN_HEAD})", {"Retry-After": "1"})
        if self.held + length > self.budget:
            raise ApiError(503, f"the server holds {self.held} bytes of request bodies and this one's {length} would "
                                f"pass --max-body-memory {mib:g} MiB; retry shortly", {"Retry-After": "1"})
        self.held += length
        self.strangers += length if stranger else 0
        scope[SCOPE_KEY] = hold = Hold(length, stranger)
        return hold

    def vouch(self, scope: MutableMapping[str, Any]) -> None:
        """The body of `scope` named a valid key: its hold leaves the strangers' share."""
        hold = scope.get(SCOPE_KEY)
        if isinstance(hold, Hold) and hold.stranger:
            hold.stranger = False
            self.strangers -= hold.length

    def release(self, hold: Hold | None) -> None:
        """Its request is answered: the body's bytes are free again."""
        if hold is not None:
            self.held -= hold.length
            self.strangers -= hold.length if hold.stranger else 0
            hold.length, hold.stranger = 0, False
