"""The HTTP app of `aiayn serve` (FastAPI): validate, count tokens, enqueue, answer.

Endpoints: LibreTranslate's (`aiayn.serve.libre`: /translate, /detect, /languages, ...), so its
clients work unchanged; `POST /v1/translate` (`aiayn.serve.v1`: n-best lists with scores, subword
tokens on both sides, cross-attention on request); `GET /health` (200 once the model is warmed up), `GET /v1/info`,
`GET /metrics` (Prometheus), `/docs` (OpenAPI) and `GET /`, the page in src/aiayn/serve/static/.

Handlers never touch the model: lines go to `aiayn.serve.scheduler.Scheduler`, whose model thread runs
`aiayn.serve.batch.run_batch` on `Translator.search`, so a line gets the translation `aiayn translate` gives it with the
same settings, whatever shares its batch. One server may hold several models, one per language pair
(`Model`); a request goes to the model of its pair (the first is the default of /v1). Errors are JSON
bodies `{"error": message}` (LibreTranslate's endpoints use its codes, `aiayn.serve.libre`): 400 a
language pair not served or JSON nested too deeply, 403 a bad API key and 401 a large body whose head names
no key of ours where strangers' bodies never fit (with --api-keys, `aiayn.serve.clients`), 408 a body not sent within
--body-timeout, 411/413 a body without length (or chunked) or too large, 413 a line over
--max-chars or the model's length, more lines than --max-lines or more work than --max-work, 422 a
malformed body (naming the field) or a beam / n-best over --max-beam / --max-nbest, 429 a client
with --max-client-lines lines in the server (`aiayn.serve.clients`), 503 a full queue, a model
still warming up or a large body past --max-body-memory (all with Retry-After). Lines are tokenized in a worker thread,
not on the event loop: /health answers while a long request is read or tokenized.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import platform
import sys
import time
from collections.abc import AsyncIterator, Callable, Hashable, Mapping, MutableMapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from aiayn import __version__, memory
from aiayn.serve import libre, v1
from aiayn.serve.batch import Key, LineTooLong, price, refuse_long, run_batch, warm_up
from aiayn.serve.clients import BodyMemory, ClientLines, Hold, head_key
from aiayn.serve.detect import Detector
from aiayn.serve.errors import ApiError, Busy
from aiayn.serve.libre import LANGUAGE_NAMES
from aiayn.serve.scheduler import SMALL_BODY, Limits, QueueFull, Scheduler
from aiayn.serve.unicode import replaced
from aiayn.translate import with_target_token

__all__ = ["ApiError", "Busy", "LANGUAGE_NAMES", "Model", "create_app"]
PATHS = ("/", "/translate", "/detect", "/languages", "/frontend/settings", "/spec", "/suggest", "/translate_file",
         "/v1/translate", "/v1/info", "/health", "/metrics", "/docs")
log = logging.getLogger("aiayn.serve")


@dataclass(frozen=True)
class Model:
    """One served model: its translator (`aiayn.translator.Translator`), language pair and checkpoint;
    for one target of a multilingual model, the token ">>xx<<" that leads each line (one `Model` per
    target, sharing the translator)."""

    translator: Any
    source: str
    target: str
    checkpoint: str = ""
    token: str = ""

    @property
    def pair(self) -> tuple[str, str]:
        return self.source, self.target


# ------------------------------------------------------------------------------------ metrics


class Metrics:
    """Prometheus metrics of one app (its own registry, so several apps can live in one process)."""

    def __init__(self, scheduler: Scheduler) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("aiayn_requests", "HTTP requests by path and status", ["path", "status"], registry=r)
        self.latency = Histogram("aiayn_request_seconds", "HTTP request latency", ["path"], registry=r,
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        sizes = tuple(2.0 ** k for k in range(14))
        self.batch_lines = Histogram("aiayn_batch_lines", "lines per batch", registry=r, buckets=sizes)
        self.batch_tokens = Histogram("aiayn_batch_source_tokens", "source tokens per batch", registry=r, buckets=sizes)
        self.batch_seconds = Histogram("aiayn_batch_seconds", "time the model thread spent on a batch", registry=r,
                                       buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30))
        self.target_tokens = Counter("aiayn_target_tokens", "target subwords of the best translations", registry=r)
        self.tokens_per_s = Gauge("aiayn_tokens_per_second", "target subwords per second in the last batch", registry=r)
        self.dropped = Counter("aiayn_dropped_lines", "lines dropped unsearched: their client went away", registry=r)
        self.closes = Counter("aiayn_timeout_closes", "connections closed on --head-timeout, by what the client had "
                              "not done: head (answered 408), idle, body (of a request answered), read (an answer)",
                              ["reason"], registry=r)
        Gauge("aiayn_queue_lines", "lines waiting for a batch", registry=r).set_function(lambda: scheduler.waiting)

    def answered(self, path: str, status: int) -> None:
        """A request the HTTP protocol answered before the app could (`aiayn.serve.protocol`: a 503 past
        --max-connections, a 408 past --head-timeout, a 400 for a malformed head): counted as the app's."""
        self.requests.labels(_label(path), str(status)).inc()

    def closed(self, reason: str) -> None:
        """A connection the HTTP protocol closed on --head-timeout (`aiayn.serve.protocol`)."""
        self.closes.labels(reason).inc()


def _label(path: str) -> str:
    return path if path in PATHS else "other"  # bounded label values


class _Middleware:
    """Counts every request (status, latency), answers HEAD as GET, refuses bodies over the size limit
    and reads a POST body whole within `body_timeout` seconds (ASGI): a client that stalls mid-body
    gets a 408 and its connection closed, instead of holding a handler (and a graceful shutdown) for ever.

    The bodies held at once are bounded too (`aiayn.serve.clients`): a body over `SMALL_BODY` bytes
    holds its Content-Length from before it is read until its request is answered, and past
    --max-body-memory (or, with --api-keys and no key in its head, past the strangers' share) it is
    refused unread, its connection closed. Small bodies (the page's, a LibreTranslate client's) are
    never refused for it: large uploads cannot lock them out, and --max-connections bounds them."""

    def __init__(self, app: Any, metrics: Metrics, max_body: int, body_timeout: float, bodies: BodyMemory) -> None:
        self.app, self.metrics, self.max_body, self.body_timeout = app, metrics, max_body, body_timeout
        self.bodies = bodies

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "HEAD":  # as GET (FastAPI's GET routes answer HEAD 405); the server sends no body
            scope = {**scope, "method": "GET"}
        path = _label(scope["path"])
        status = [0]  # 0 until the response starts

        async def counted(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        start = time.perf_counter()
        held = None
        try:
            refused, length = self._too_large(scope)
            if refused is None and length > SMALL_BODY:
                refused, held = self._hold(scope, length)
            if refused is None and scope["method"] == "POST":
                refused, receive = await self._read_body(receive)
            await (refused or self.app)(scope, receive, counted)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still in flight --shutdown-timeout after SIGTERM (a stalled
            # upload, say) and says so in one line; answered here, the client learns why and the log
            # gets no traceback of the cancelled task (the process is exiting: nothing to propagate to)
            if not status[0]:
                await _error(503, "the server stopped before this request was done (--shutdown-timeout)",
                             {"Connection": "close"})(scope, receive, counted)
        except Exception as e:
            # a bug's 500, answered here, inside the CORS middleware: answered outside it (Starlette's
            # ServerErrorMiddleware), it had no Access-Control-Allow-Origin, and a page of an allowed
            # origin read a network error instead of this body
            if not status[0]:
                await _error(500, _internal_error(e))(scope, receive, counted)
            raise  # on to uvicorn, which logs the traceback (the response is sent: nothing more is)
        finally:
            self.bodies.release(held)
            self.metrics.requests.labels(path, str(status[0] or 500)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)

    def _too_large(self, scope: dict) -> tuple[Response | None, int]:
        """A refusal for a POST body without a length or over the limit, else None; and the body's length."""
        if scope["method"] != "POST":
            return None, 0
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if b"transfer-encoding" in headers:  # chunked: h11 reads it whatever Content-Length says, so no size is known
            return _error(411, "send the body with a Content-Length header, not chunked", {"Connection": "close"}), 0
        if length is None:  # no body at all (RFC 9112, 6.3): fields in the query string
            return None, 0
        if not length.isdigit() or int(length) > self.max_body:  # answered unread: the connection cannot go on
            return _error(413, f"the body is over {self.max_body} bytes", {"Connection": "close"}), 0
        return None, int(length)

    def _hold(self, scope: dict, length: int) -> tuple[Response | None, Hold | None]:
        """Holds `length` bytes of --max-body-memory for a body about to be read (to give back once
        answered); else its refusal, the body unread (the connection cannot go on)."""
        try:
            return None, self.bodies.hold(scope, length)
        except ApiError as e:
            return _error(e.status, e.message, {**(e.headers or {}), "Connection": "close"}), None

    async def _read_body(self, receive: Any) -> tuple[Response | None, Any]:
        """The whole body within `body_timeout` seconds, and a `receive` that gives it to the app
        (then passes on to the connection's, for the disconnect); else a 408 that closes it."""
        chunks: list[bytes] = []
        end = time.monotonic() + self.body_timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, end - time.monotonic()))
            except TimeoutError:
                return _error(408, f"the body was not sent within --body-timeout {self.body_timeout:g} s",
                              {"Connection": "close"}), receive
            if message["type"] != "http.request":  # the client went away: nobody to answer
                return Response(status_code=499), receive
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> dict[str, Any]:
            return replay.pop() if replay else await receive()

        return None, replayed


def _error(status: int, message: str, headers: Mapping[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": replaced(message), **extra}, status_code=status, headers=headers)  # (echoed text)


_UNION_TAGS = ("str", "list[str]", "int", "none")


def _field(loc: Sequence[Any]) -> str:
    """A pydantic error location as a field name: ("body", "text", 2) -> "text[2]"."""
    parts = list(loc[1:] if len(loc) > 1 and loc[0] == "body" else loc)
    name = ""
    for p in parts:
        if p in _UNION_TAGS:  # pydantic names the union member tried: ("q", "list[str]", 0)
            continue
        name += f"[{p}]" if isinstance(p, int) else (f".{p}" if name else str(p))
    return name or "body"


def _invalid(errors: Sequence[Any], as_json: bool = True) -> JSONResponse:
    """The first error of a body that does not fit its model; `as_json`: whether the body was sent as
    JSON (else FastAPI did not parse it, and every such body is "not an object": say what to send)."""
    first = errors[0]
    if not as_json and tuple(first.get("loc", ())) == ("body",):  # `curl -d` sends a form's Content-Type
        return _error(422, "body: not sent as JSON; send a JSON object with the header Content-Type: "
                           "application/json", field="body")
    if first.get("type") == "json_invalid":  # loc is ("body", character position)
        where = first.get("loc", ())[-1]
        return _error(422, f"body: not valid JSON ({first.get('ctx', {}).get('error', 'decode error')} at "
                           f"character {where})", field="body")
    field = _field(first.get("loc", ()))
    return _error(422, f"{field}: {first.get('msg', 'invalid')}", field=field)


# ------------------------------------------------------------------------------------ the app


class Server:
    """What the handlers share: the models (read-only here), limits, keys, scheduler and metrics."""

    def __init__(self, models: Sequence[Model], limits: Limits, api_keys: frozenset[str] | None = None) -> None:
        self.pairs = {m.pair: m for m in models}
        for m in models:
            m.translator.note = refuse_long  # the server refuses a line the translator would truncate
        first = models[0]
        self.translator, self.languages, self.checkpoint = first.translator, first.pair, first.checkpoint
        self.limits, self.api_keys = limits, api_keys
        self.bodies = BodyMemory(limits.max_body_memory_mib << 20, limits.max_body, api_keys)
        self.detector = Detector([m.source for m in models])
        self.scheduler = Scheduler(self._work, limits.max_batch_tokens, limits.max_wait_ms / 1000, limits.max_queue,
                                   limits.max_share)
        self.metrics = Metrics(self.scheduler)
        self.clients = ClientLines(limits.max_client_lines)
        self.scheduler.stats.on_batch = self._on_batch
        self.scheduler.stats.on_drop = self.metrics.dropped.inc
        self.ready = False
        self.failure = ""

    def model(self, pair: tuple[str, str] | None) -> Model:
        """The model of `pair` (None or ("", ""): the first one); 400 naming the served pairs for another."""
        if pair is None or pair == ("", ""):
            return self.pairs[self.languages]
        if pair not in self.pairs:
            raise ApiError(400, f"this server does not translate {pair[0]} to {pair[1]}; {self.served_pairs()}")
        return self.pairs[pair]

    def served_pairs(self) -> str:
        return "it translates " + ", ".join(f"{s} to {t}" for s, t in self.pairs)

    def targets(self) -> dict[str, list[str]]:
        """Every served language -> the languages it translates to (sources first, then target-only ones)."""
        out: dict[str, list[str]] = {}
        for s, t in self.pairs:
            out.setdefault(s, []).append(t)
        for _, t in self.pairs:
            out.setdefault(t, [])
        return {lang: sorted(targets) for lang, targets in out.items()}

    def check_key(self, key: Any, request: Request) -> None:
        """With --api-keys: 400 without a key, 403 with one not in the file (LibreTranslate's answers);
        `key` is the body's; a valid one in the request head wins (`aiayn.serve.clients.head_key`), another
        there counts only where the body names none (a gateway may add its own Bearer token). A good key
        is recorded on the request: it names the client, and its body is no stranger's (`BodyMemory`)."""
        if self.api_keys is None:
            return
        head = head_key(request.scope, self.api_keys)
        key = head if head in self.api_keys or not key else key
        if not key:
            raise ApiError(400, "Please contact the server operator to get an API key")
        if not isinstance(key, str) or key not in self.api_keys:
            raise ApiError(403, "Invalid API key")
        request.state.api_key = key
        self.bodies.vouch(request.scope)

    def _work(self, key: Hashable, lines: list[str], early: Callable[[int, Any], None]) -> list[list[dict[str, Any]]]:
        assert isinstance(key, Key)  # the scheduler hands back the keys the handlers submitted
        start = time.perf_counter()
        out = run_batch(self.pairs.get(key.pair, self.pairs[self.languages]).translator, key, lines, early)
        n = sum(len(nb[0]["tokens"]) for nb in out if nb)
        self.metrics.target_tokens.inc(n)
        self.metrics.tokens_per_s.set(n / max(time.perf_counter() - start, 1e-9))
        return out

    def _on_batch(self, lines: int, tokens: int, seconds: float) -> None:
        self.metrics.batch_lines.observe(lines)
        self.metrics.batch_tokens.observe(tokens)
        self.metrics.batch_seconds.observe(seconds)

    async def warm_up(self) -> None:
        try:
            for translator in {id(m.translator): m.translator for m in self.pairs.values()}.values():
                await self.scheduler.call(warm_up, translator, self.limits.beam)  # (a multilingual one once)
            self.ready = True
        except Exception as e:  # reported by /health; the process stays up to say so
            log.exception("warm-up failed")
            self.failure = f"warm-up failed: {type(e).__name__}: {e}"

    def check_ready(self) -> None:
        """503 until the warm-up is done (the handlers ask before they cut texts into sentences or
        detect their language: work that would be thrown away)."""
        if not self.ready:
            raise ApiError(503, self.failure or "the model is warming up; retry shortly", self.retry_after())

    def retry_after(self) -> dict[str, str]:
        """A 503's Retry-After while warming up; none once warm-up failed (a retry would not help)."""
        return {} if self.failure else {"Retry-After": "1"}

    def check_chars(self, lines: Sequence[str]) -> None:
        """413 for a line over --max-chars (the client's line: before a target token is added)."""
        for i, line in enumerate(lines):
            if len(line) > self.limits.max_chars:
                raise ApiError(413, f"line {i}: {len(line)} characters, more than --max-chars {self.limits.max_chars}")

    def source_ids(self, lines: Sequence[str], translator: Any = None) -> list[list[int]]:
        """Source ids per line; 413 for a line over the model's length."""
        translator = translator or self.translator
        out = []
        for i, line in enumerate(lines):
            try:
                out.append(translator.encode([line])[0])
            except LineTooLong:
                raise ApiError(413, f"line {i}: more source tokens than the model takes "
                                    f"({translator.max_src_tokens})") from None
        return out

    def check_work(self, ids: Sequence[list[int]], key: Key, translator: Any = None) -> None:
        """413 for a request that asks for more work than --max-work (`aiayn.serve.batch.price`)."""
        layers = (translator or self.translator).model.cfg.decoder_layers
        work = sum(price(len(x), key, layers) for x in ids)
        if work > self.limits.max_work:
            raise ApiError(413, f"the request asks for {work} token slots of work, more than --max-work "
                                f"{self.limits.max_work} (lines x beam x (source + output tokens), attention: "
                                "n-best x layers x output x source); send fewer or shorter lines, a smaller beam, "
                                "or no attention")

    async def translate(self, request: Request, lines: list[str], key: Key,
                        asked: int | None = None) -> tuple[list[list[int]], list[Any]]:
        """Source ids and results per line, once the scheduler has them (or the client has gone);
        `asked`: the client's lines, when `lines` are their sentences (what --max-lines counts)."""
        self.check_ready()
        asked = len(lines) if asked is None else asked
        if asked > self.limits.max_lines:
            raise ApiError(413, f"{asked} lines in one request, more than --max-lines {self.limits.max_lines}")
        with self.clients.hold(request, len(lines)):  # 429 past --max-client-lines
            return await self._translate(request, lines, key)

    async def _translate(self, request: Request, lines: list[str], key: Key) -> tuple[list[list[int]], list[Any]]:
        model = self.model(key.pair)
        translator = model.translator
        self.check_chars(lines)  # as the client sent them: a line of --max-chars passes with the token added
        if model.token:  # a multilingual model's target: its token leads each line without one
            lines = with_target_token(lines, model.token, translator.tokenizers.src)
        gone = asyncio.ensure_future(_disconnected(request))  # watched from the start, tokenization included
        try:
            ids = await asyncio.to_thread(self.source_ids, lines, translator)  # a long request's: not on the loop
            self.check_work(ids, key, translator)
            try:
                job = self.scheduler.submit(key, lines, [len(x) for x in ids])
            except QueueFull as e:
                raise Busy(f"the server is busy ({e}); retry shortly") from None
            try:
                if not gone.done():  # gone already: dropped now (`wait` would first let a batch take them)
                    await asyncio.wait({job.future, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self.scheduler.cancel(job)  # a no-op once answered; drops unstarted lines otherwise
        finally:
            gone.cancel()
        if job.future.cancelled():
            raise ApiError(499, "the client closed the request")
        if job.future.exception() is not None:
            log.error("translation failed", exc_info=job.future.exception())
            raise ApiError(500, f"translation failed ({type(job.future.exception()).__name__})")
        return ids, job.future.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has been read: the next message is a disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(models: Any, limits: Limits, languages: tuple[str, str] | None = None, checkpoint: str = "", *,
               api_keys: frozenset[str] | None = None, cors_origins: Sequence[str] = ()) -> FastAPI:
    """The app serving `models` (`Model`s, one per language pair), or one translator (a
    `aiayn.translator.Translator`) for the pair `languages`. `api_keys`: the keys a request must
    name (None: none asked); `cors_origins`: the web origins whose pages may call the API."""
    if not isinstance(models, (list, tuple)):
        if languages is None:
            raise ValueError("create_app(translator, ...) needs the pair it translates: languages=(source, target)")
        models = [Model(models, languages[0], languages[1], checkpoint)]
    if not limits.holds_largest_body():  # else every large body is a 503 "retry shortly", for ever
        raise ValueError(f"Limits.max_body_memory_mib ({limits.max_body_memory_mib}) must hold the largest body "
                         f"({limits.max_body} bytes: max_lines x max_chars x 12 + 64 KiB)")
    srv = Server(models, limits, api_keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        warming = asyncio.create_task(srv.warm_up())
        yield
        await asyncio.gather(warming, return_exceptions=True)
        await srv.scheduler.close()  # uvicorn has drained the requests in flight by now

    pairs = ", ".join(f"{s}->{t}" for s, t in srv.pairs)
    app = FastAPI(title="aiayn", version=__version__, lifespan=lifespan,
                  description=f"Translation {pairs} with a Transformer; batches across clients.")
    app.state.server = srv
    app.add_middleware(_Middleware, metrics=srv.metrics, max_body=limits.max_body, body_timeout=limits.body_timeout_s,
                       bodies=srv.bodies)
    if cors_origins:  # off by default: a page of another origin may not call the API
        _allow_cors(app, cors_origins)
    _handlers(app)
    libre.routes(app, srv)
    v1.routes(app, srv)
    _info_routes(app, srv)
    return app


def _allow_cors(app: FastAPI, origins: Sequence[str]) -> None:
    """Pages of `origins` may call the API: the CORS middleware adds its headers to the app's answers, and
    `app.state.cors_headers` the same to those the HTTP protocol writes itself (`aiayn.serve.protocol`: a
    408, a 400, a 503 past --max-connections), which a page could not read without them."""
    options: dict[str, Any] = dict(allow_origins=list(origins), allow_methods=["GET", "POST"],
                                   allow_headers=["Authorization", "Content-Type", "X-API-Key"], max_age=600,
                                   expose_headers=["Retry-After"])  # a page must read a 429/503's hint too
    app.add_middleware(CORSMiddleware, **options)
    app.state.cors_headers = functools.partial(_cors_headers, options)


def _cors_headers(options: dict[str, Any], request_headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The headers `CORSMiddleware(**options)` adds to an answer (not a preflight's) to a request with
    `request_headers`: the middleware itself run on a bare answer, so that an answer written elsewhere
    gets the very same."""
    added: list[tuple[bytes, bytes]] = []

    async def bare(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def kept(message: MutableMapping[str, Any]) -> None:
        added.extend(message["headers"])

    async def nothing() -> dict[str, Any]:  # (never asked: a bare answer reads no body)
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "GET", "path": "/", "headers": request_headers}
    run = CORSMiddleware(bare, **options)(scope, nothing, kept)
    try:
        run.send(None)  # it awaits nothing but `kept`: done in this one step, without an event loop
    except StopIteration:
        return added
    run.close()
    raise RuntimeError("the CORS middleware awaited something: its headers cannot be had at once")


DEEP_JSON = "body: JSON nested too deeply for the parser; send the texts as a list of strings"


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return _error(e.status, e.message, e.headers, **({"field": e.field} if e.field else {}))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _invalid(e.errors(), libre.is_json(request))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        if isinstance(e.__cause__, RecursionError):  # FastAPI's "error parsing the body", from json.loads
            return _error(400, DEEP_JSON, field="body")
        if isinstance(e.__cause__, ValueError) and (why := _unreadable(e.__cause__)):  # bytes, or a number
            return _error(422, why, field="body")
        return _error(e.status_code, str(e.detail), e.headers)

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception) -> JSONResponse:
        """A bug's 500 as JSON too (the traceback goes to the log, as uvicorn writes it); `_Middleware`
        answers it first where it can."""
        return _error(500, _internal_error(e))


def _internal_error(e: Exception) -> str:
    """A bug's 500 message: its kind only (the details go to the log, not to a client)."""
    return f"internal error ({type(e).__name__}); the server's log has the details"


def _unreadable(e: ValueError) -> str:
    """Why json.loads could not read a body that is not malformed JSON text (those are `json_invalid`):
    bytes that are not UTF-8, or a number past int()'s limit on digits ("" for another error)."""
    if isinstance(e, UnicodeDecodeError):
        return (f"body: not valid JSON (not UTF-8: byte 0x{e.object[e.start]:02x} at byte {e.start}); "
                "send it encoded as UTF-8")
    if "integer string conversion" in str(e):
        return f"body: not valid JSON (a number of more than {sys.get_int_max_str_digits()} digits)"
    return ""


def _describe(m: Model) -> dict[str, Any]:
    """A served model for /v1/info: its pair, checkpoint, shape, precision and memory."""
    model = m.translator.model
    tensors = [*model.parameters(), *model.buffers()]
    return {"languages": {"source": m.source, "target": m.target}, "checkpoint": m.checkpoint,
            "model": {**asdict(model.cfg), "parameters": model.num_parameters()}, "precision": m.translator.precision,
            "memory_mib": round(sum(t.numel() * t.element_size() for t in tensors) / 2**20, 2)}


def _info_routes(app: FastAPI, srv: Server) -> None:
    import torch

    models = [_describe(m) for m in srv.pairs.values()]
    info = {**models[0], "models": models, "limits": asdict(srv.limits),
            "versions": {"aiayn": __version__, "torch": torch.__version__, "python": platform.python_version()},
            "runtime": {"torch_threads": torch.get_num_threads(),
                        **{k.lower(): os.environ.get(k) for k in memory.ONEDNN_CACHES}}}
    page = resources.files("aiayn.serve") / "static"

    @app.get("/health")  # HEAD too, as every GET route (`_Middleware`): uptime monitors ask with it
    async def health() -> JSONResponse:
        """200 once the model is loaded and warmed up; 503 before (or if warm-up failed)."""
        if srv.ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "failed" if srv.failure else "warming up", "error": srv.failure or None},
                            status_code=503, headers=srv.retry_after())

    @app.get("/v1/info")
    async def v1_info() -> dict[str, Any]:
        """Languages, model shape, checkpoint, limits and versions."""
        return info

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus metrics: requests by status, latency, batch sizes, queue depth, tokens/s."""
        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse((page / "index.html").read_text(encoding="utf-8"), headers=REVALIDATE)

    app.mount("/static", _PageFiles(packages=[("aiayn.serve", "static")]), name="static")


# The page's files are asked again (a 304 where unchanged) rather than cached by a browser's own
# guess: after an upgrade, a kept app.js ran against the new index.html.
REVALIDATE = {"Cache-Control": "no-cache"}


class _PageFiles(StaticFiles):
    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(REVALIDATE)
        return response
