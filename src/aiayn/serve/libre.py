"""LibreTranslate's API on `aiayn serve`, field by field, so that its clients work unchanged: its
web page, the Python and JavaScript client libraries, Mastodon's translation service.

    POST /translate          q (a text or a list), source (a code or "auto"), target, format
                             ("text", "html"; null or empty: text), alternatives, api_key
    POST /detect             q -> [{"confidence": percent, "language": code}, ...], best first
    GET  /languages          every served language with the targets it translates to
    GET  /frontend/settings  what LibreTranslate's page asks before it starts
    GET  /spec               the OpenAPI document (LibreTranslate serves its own there)
    POST /suggest, /translate_file   403: disabled on this server, as LibreTranslate says it

Fields come from a JSON object when the body is JSON, else from the query string and the form
(the query string first), as Flask's `request.values` gives them to LibreTranslate. Errors are
`{"error": message}` with LibreTranslate's codes and wording: 400 for a bad or missing field and
for text over a limit, 403 for a bad API key, 429 (with Retry-After) when the queue is full or
the client holds --max-client-lines lines already.

Each text is cut into lines and sentences (`aiayn.sentences`), for the source language, and all
the request's sentences go to the scheduler at once, one batch per language pair; a translation
is its sentences' translations with the text's own spacing and line ends. With `format: "html"`
the sentences are those of the text nodes (`aiayn.serve.markup`) and the markup is kept as written.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from aiayn.sentences import Paragraph, split
from aiayn.serve import markup
from aiayn.serve.batch import DEFAULT_ALPHA, Key
from aiayn.serve.clients import ClientBusy, check_holdable
from aiayn.serve.detect import Detector, as_libre, detect_texts
from aiayn.serve.encode import json_response
from aiayn.serve.errors import ApiError, Busy, renamed_line
from aiayn.serve.scheduler import Limits
from aiayn.serve.unicode import fields_replaced

ALTERNATIVES = 3  # LibreTranslate's default --alternatives-limit
FRONTEND_TIMEOUT_MS = 500  # how long LibreTranslate's page waits after a key press before it translates
LANGUAGE_NAMES = {"en": "English", "de": "German", "fr": "French", "cs": "Czech", "es": "Spanish", "it": "Italian",
                  "nl": "Dutch", "pt": "Portuguese", "ru": "Russian", "ro": "Romanian", "zh": "Chinese",
                  "ja": "Japanese"}


class Served(Protocol):
    """What these routes need of the server (`aiayn.serve.app.Server`)."""

    limits: Limits
    languages: tuple[str, str]  # the first pair: the default
    pairs: dict[tuple[str, str], Any]
    detector: Detector
    api_keys: frozenset[str] | None

    def check_key(self, key: Any, request: Request) -> None: ...
    def check_ready(self) -> None: ...
    def targets(self) -> dict[str, list[str]]: ...
    def served_pairs(self) -> str: ...
    async def translate(self, request: Request, lines: list[str], key: Key,
                        asked: int | None = None) -> tuple[list[list[int]], list[Any]]: ...


def name_of(code: str) -> str:
    return LANGUAGE_NAMES.get(code, code)


def _bad(message: str, status: int = 400) -> ApiError:
    return ApiError(status, message)


# ----------------------------------------------------------------------------- fields


async def fields(request: Request) -> dict[str, Any]:
    """The request's fields: the JSON object if the body is JSON, else the query string and form."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if is_json(request):
        try:
            data = json.loads(await request.body())
        except (ValueError, RecursionError):  # RecursionError: nested too deeply for the parser
            raise _bad("Invalid JSON format") from None
        if not isinstance(data, dict):
            raise _bad("Invalid JSON format")
        return fields_replaced(data)
    out: dict[str, Any] = {}
    if kind in ("application/x-www-form-urlencoded", "multipart/form-data"):
        out = _first_values((await request.form()).multi_items())  # a field given twice: its first value, as Flask
    out.update(_first_values(request.query_params.multi_items()))  # the query string wins, as in request.values
    return out


def _first_values(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """Each name's first value, in one pass (`getlist` per name scans them all: quadratic time)."""
    out: dict[str, Any] = {}
    for k, v in items:
        out.setdefault(k, v)
    return out


def _text(value: Any, name: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _bad(f"Invalid request: {name} parameter must be a string")
    return value


def _texts(f: dict[str, Any], is_json: bool) -> list[str] | str:
    q = f.get("q")
    if not q:
        raise _bad("Invalid request: missing q parameter")
    if isinstance(q, list):
        if not all(isinstance(t, str) for t in q):
            raise _bad("Invalid request: q parameter must be a text or a list of texts")
        return q
    if not isinstance(q, str):
        raise _bad("Invalid request: q parameter must be a text or a list of texts")
    return q if is_json else q.replace("\r\n", "\n")  # a form's CRLF line ends count as one character


def _alternatives(f: dict[str, Any], limit: int, flag: str = "") -> int:
    value = f.get("alternatives", 0)
    try:
        n = max(0, int(value if value not in (None, "") else 0))
    except (TypeError, ValueError, OverflowError):  # OverflowError: JSON's Infinity
        raise _bad("Invalid request: alternatives parameter is not a number") from None
    if n > limit:
        raise _bad(f"Invalid request: alternatives parameter must be <= {limit}"
                   + (f" (--max-nbest {limit + 1})" if flag and limit < ALTERNATIVES else ""))
    return n


# ----------------------------------------------------------------------------- texts as sentences


@dataclass
class Piece:
    """One text of a request: its paragraphs (one per HTML text node, or the text itself)."""

    pair: tuple[str, str]
    paragraphs: list[Paragraph]
    fragment: markup.Fragment | None  # the HTML, when format is html

    def sentences(self) -> list[str]:
        return [s for p in self.paragraphs for s in p.sentences]

    def render(self, translations: Sequence[str]) -> str:
        """The text with its sentences' translations in place (`translations` in sentence order)."""
        at, joined = 0, []
        for p in self.paragraphs:
            joined.append(p.join(translations[at:at + len(p.sentences)]))
            at += len(p.sentences)
        return self.fragment.render(joined) if self.fragment is not None else joined[0]


def piece(text: str, pair: tuple[str, str], html: bool) -> Piece:
    """400 for HTML that the tokenizer cannot read."""
    if html:
        try:
            fragment = markup.parse(text)
        except markup.NotHtml as e:
            raise _bad(f"Invalid request: q is not HTML that can be read ({e}); send it with format text") from None
        return Piece(pair, [split(t, pair[0]) for t in fragment.texts], fragment)
    return Piece(pair, [split(text, pair[0])], None)


async def translate_pieces(srv: Served, request: Request, pieces: list[Piece], nbest: int) -> list[list[str]]:
    """Per piece, its `nbest` renderings (best first; the k-th takes each sentence's k-th hypothesis,
    or its last when it has fewer). All the sentences of a language pair go to the scheduler at once."""
    # --max-lines counts the client's texts, as on /v1 (their sentences are priced by --max-work and
    # bounded by --max-chars), in one bound for the request, whatever pairs it spans
    limits = srv.limits
    if len(pieces) > limits.max_lines:
        raise ApiError(413, f"{len(pieces)} texts in one request, more than --max-lines {limits.max_lines}")
    check_holdable(limits, sum(len(p.sentences()) for p in pieces), f"{len(pieces)} texts")
    groups: dict[tuple[str, str], list[int]] = {}
    for i, p in enumerate(pieces):
        groups.setdefault(p.pair, []).append(i)

    async def run(pair: tuple[str, str], members: list[int]) -> None:
        lines = [s for i in members for s in pieces[i].sentences()]
        try:
            _, results = await srv.translate(request, lines, Key(srv.limits.beam, DEFAULT_ALPHA, nbest, False, pair),
                                             asked=len(members))
        except ApiError as e:
            raise _in_text(e, [(i, len(pieces[i].sentences())) for i in members], len(pieces)) from None
        at = 0
        for i in members:
            n = len(pieces[i].sentences())
            mine = results[at:at + n]
            at += n
            out[i] = [pieces[i].render([nb[min(k, len(nb) - 1)]["text"] for nb in mine]) for k in range(nbest)]

    out: list[list[str]] = [[] for _ in pieces]
    await _all_or_none([run(pair, members) for pair, members in groups.items()])
    return out


def _in_text(e: ApiError, counts: list[tuple[int, int]], texts: int) -> ApiError:
    """An error about line n of one pair's sentences as the sentence of the client's text it is:
    `counts` holds (text index, its sentences) of that pair's texts, in order (with source auto, a
    pair's sentences are not the request's)."""
    return renamed_line(e, [c for _, c in counts],
                        lambda j, n: (f"text {counts[j][0]}, " if texts > 1 else "") + f"sentence {n}")


async def _all_or_none(runs: list[Any]) -> None:
    """Runs the pairs' searches at once; once one fails, the others are cancelled (and done with)
    before its error is raised: their lines would be searched, and held against the client's
    --max-client-lines, for an answer no one reads (`gather` alone leaves them running)."""
    tasks = [asyncio.ensure_future(r) for r in runs]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _words(text: str) -> str:
    """What an HTML text says: its text nodes to translate, one a line (its language is theirs, not
    that of its tags, links and mentions); HTML that cannot be read as it is (`piece` refuses it)."""
    try:
        return "\n".join(markup.parse(text).texts)
    except markup.NotHtml:
        return text


def libre_error(e: Exception) -> Exception:
    """An error of the scheduler's path as LibreTranslate answers it: 400 for a text over a limit,
    429 "Slowdown" when the server is busy or the client holds --max-client-lines; anything else as it was."""
    if isinstance(e, Busy):
        return ApiError(429, f"Slowdown: {e.message}", {"Retry-After": e.retry_after})
    if isinstance(e, ClientBusy):
        return ApiError(429, f"Slowdown: {e.message}", e.headers)
    if isinstance(e, ApiError) and e.status in (413, 422):  # the scheduler's lines are this request's sentences
        return ApiError(400, f"Invalid request: {e.message.replace('line ', 'sentence ', 1)}")
    return e


def _unique(alternatives: list[str], best: str) -> list[str]:
    """Distinct alternatives, in order, none equal to the translation itself."""
    seen = {best}
    out = []
    for a in alternatives:
        if a not in seen:
            seen.add(a)
            out.append(a)
    return out


# ----------------------------------------------------------------------------- routes


def routes(app: FastAPI, srv: Served) -> None:
    @app.post("/translate", openapi_extra=_body("q", "source", "target", "format", "alternatives", "api_key"),
              tags=["LibreTranslate"])
    async def translate(request: Request) -> Response:
        """LibreTranslate's translation: `{"translatedText", "detectedLanguage" (with source auto),
        "alternatives" (when asked)}`, each a list when `q` is one."""
        f = await fields(request)
        srv.check_key(f.get("api_key"), request)
        q = _texts(f, is_json(request))
        source, target = _text(f.get("source"), "source"), _text(f.get("target"), "target")
        if not source:
            raise _bad("Invalid request: missing source parameter")
        if not target:
            raise _bad("Invalid request: missing target parameter")
        srv.check_ready()  # before the texts are parsed, split or their language detected
        texts = q if isinstance(q, list) else [q]
        _within_limits(texts, srv.limits)
        # LibreTranslate's limit is 3 (its page always asks for 3), --max-nbest's over it; a beam of b has
        # b - 1 to give
        asked = _alternatives(f, min(max(ALTERNATIVES, srv.limits.beam - 1), srv.limits.max_nbest - 1), "--max-nbest")
        alternatives = min(asked, srv.limits.beam - 1)
        form = _text(f.get("format"), "format") or "text"
        if form not in ("text", "html"):
            raise _bad(f"{form} format is not supported")
        html = form == "html"
        # parsing and splitting a large request is work: off the event loop
        shown = await asyncio.to_thread(lambda: [_words(t) for t in texts]) if html and source == "auto" else texts
        detected = await _sources(srv, shown, source, target)
        pieces = await asyncio.to_thread(
            lambda: [piece(t, (lang, target), html) for t, (lang, _) in zip(texts, detected)])
        try:
            found = await translate_pieces(srv, request, pieces, alternatives + 1)
        except Exception as e:
            raise libre_error(e) from None
        best = [nb[0] for nb in found]
        body: dict[str, Any] = {"translatedText": best if isinstance(q, list) else best[0]}
        if source == "auto":
            langs = [{"confidence": round(100 * p, 1), "language": lang} for lang, p in detected]
            body["detectedLanguage"] = langs if isinstance(q, list) else langs[0]
        if asked:
            alts = [_unique(nb[1:], nb[0]) for nb in found]
            body["alternatives"] = alts if isinstance(q, list) else alts[0]
        return await json_response(body)  # megabytes, at times

    @app.post("/detect", openapi_extra=_body("q", "api_key"), tags=["LibreTranslate"])
    async def detect(request: Request) -> JSONResponse:
        """The served source languages, most likely first: `[{"confidence": percent, "language"}]`."""
        f = await fields(request)
        srv.check_key(f.get("api_key"), request)
        q = f.get("q")
        if not q:
            raise _bad("Invalid request: missing q parameter")
        texts = q if isinstance(q, list) and all(isinstance(t, str) for t in q) else [q]
        if not isinstance(texts[0], str):
            raise _bad("Invalid request: q parameter must be a text or a list of texts")
        _within_limits(texts, srv.limits)  # as /translate's: detecting megabytes would hold a worker thread
        text = "\n".join(texts)
        ranked = await asyncio.to_thread(srv.detector.rank, text)
        return JSONResponse(as_libre(ranked))

    @app.get("/languages", tags=["LibreTranslate"])
    async def languages() -> list[dict[str, Any]]:
        """Every served language with the languages it translates to (sources first)."""
        return [{"code": code, "name": name_of(code), "targets": targets} for code, targets in srv.targets().items()]

    @app.get("/frontend/settings", tags=["LibreTranslate"])
    async def frontend_settings() -> dict[str, Any]:
        """What LibreTranslate's page reads before it starts: limits, keys, default languages."""
        src, tgt = srv.languages
        return {"charLimit": srv.limits.max_chars, "frontendTimeout": FRONTEND_TIMEOUT_MS,
                "apiKeys": srv.api_keys is not None, "keyRequired": srv.api_keys is not None,
                "suggestions": False, "filesTranslation": False, "supportedFilesFormat": [],
                "language": {"source": {"code": "auto", "name": "Auto Detect"},
                             "target": {"code": tgt, "name": name_of(tgt)}}}

    @app.get("/spec", tags=["LibreTranslate"])
    async def spec() -> JSONResponse:
        """The OpenAPI document of this server (LibreTranslate serves its Swagger document here)."""
        return JSONResponse(app.openapi())

    @app.post("/suggest", tags=["LibreTranslate"])
    async def suggest() -> JSONResponse:
        """Suggestions are not collected here."""
        raise _bad("Suggestions are disabled on this server.", 403)

    @app.post("/translate_file", tags=["LibreTranslate"])
    async def translate_file() -> JSONResponse:
        """Files are not translated here."""
        raise _bad("Files translation are disabled on this server.", 403)


def _within_limits(texts: list[str], limits: Limits) -> None:
    """LibreTranslate's 400s for more texts than --max-lines or a text over --max-chars."""
    if len(texts) > limits.max_lines:
        raise _bad(f"Invalid request: request ({len(texts)}) exceeds text limit ({limits.max_lines})")
    for t in texts:
        if len(t) > limits.max_chars:
            raise _bad(f"Invalid request: request ({len(t)}) exceeds text limit ({limits.max_chars})")


def is_json(request: Request) -> bool:
    """Whether the body is sent as JSON (its Content-Type), as Flask's `is_json` and FastAPI read it."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


async def _sources(srv: Served, texts: list[str], source: str, target: str) -> list[tuple[str, float]]:
    """(source language, probability) per text: `source` itself (probability 1), or with "auto" the
    most likely of the languages the server translates into `target`. 400 for a pair not served."""
    served = srv.targets()
    if target not in served:
        raise _bad(f"{target} is not supported; {srv.served_pairs()}")
    if source == "auto":
        among = [s for s, targets in served.items() if target in targets]
        if not among:
            raise _bad(f"{name_of(target)} ({target}) is not available as a target language; {srv.served_pairs()}")
        return await asyncio.to_thread(detect_texts, srv.detector, texts, among)
    if source not in served:
        raise _bad(f"{source} is not supported; {srv.served_pairs()}")
    if (source, target) not in srv.pairs:
        raise _bad(f"{name_of(target)} ({target}) is not available as a target language from {name_of(source)} "
                   f"({source}); {srv.served_pairs()}")
    return [(source, 1.0)] * len(texts)


_DESCRIPTIONS = {
    "q": ("text or a list of texts to translate (a text may hold paragraphs and lines)", True),
    "source": ("source language code, or auto to detect it among the served sources", True),
    "target": ("target language code", True),
    "format": ("text (the default; null or empty too) or html (text nodes translated, markup kept)", False),
    "alternatives": ("how many alternative translations to add (at most the beam size - 1)", False),
    "api_key": ("API key, when the server has --api-keys (or an Authorization: Bearer KEY or X-API-Key header, "
                "which wins)", False),
}


def _body(*names: str) -> dict[str, Any]:
    """The OpenAPI request body of a LibreTranslate endpoint: the same fields as JSON or as a form."""
    props: dict[str, Any] = {}
    for n in names:
        description, _ = _DESCRIPTIONS[n]
        props[n] = ({"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]} if n == "q"
                    else {"type": "integer"} if n == "alternatives" else {"type": "string"})
        props[n]["description"] = description
    schema = {"type": "object", "properties": props, "required": [n for n in names if _DESCRIPTIONS[n][1]]}
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}, "application/x-www-form-urlencoded": {"schema": schema},
        "multipart/form-data": {"schema": schema}}}}
