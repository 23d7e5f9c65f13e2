"""aiayn's own translation API, `POST /v1/translate`: per line the n-best translations with scores,
the subwords on both sides and, on request, each hypothesis's cross-attention.

A line may hold several sentences: with `split_sentences` (the default) it is cut into sentences
(`aiayn.sentences`, rules for the source language), each is searched on its own, and the line comes
back with its sentences' translations joined by its own spacing, as LibreTranslate's /translate
does; a line of 40 sentences is 40 searches, none cut at the model's length. Such a line also lists
`sentences`, each with its subwords, n-best and attention. A line of one sentence (or none) is
searched as it is, spacing and all: it answers exactly as with `split_sentences: false`, which
takes each line as one sentence (`aiayn translate`). --max-lines counts the client's lines either
way; the sentences of a request are priced by --max-work and bounded by --max-chars per line.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from aiayn.search import MAX_ALPHA
from aiayn.sentences import split
from aiayn.serve.batch import DEFAULT_ALPHA, Key
from aiayn.serve.clients import check_holdable
from aiayn.serve.encode import json_response
from aiayn.serve.errors import ApiError, renamed_line
from aiayn.serve.scheduler import Limits
from aiayn.serve.unicode import fields_replaced


class TranslateRequest(BaseModel):
    # strict: a wrong type is a 422, as documented; lax mode read `"beam": true` as 1 (greedy search),
    # `"split_sentences": "no"` as false and "4" as 4 (an int still passes as a float: JSON's 1 for 1.0)
    model_config = ConfigDict(extra="forbid", strict=True)
    text: list[str] = Field(min_length=1, description="lines to translate")
    beam: int | None = Field(None, ge=1, description="beam size (default: the server's; at most its --max-beam)")
    alpha: float = Field(DEFAULT_ALPHA, ge=0, le=MAX_ALPHA, allow_inf_nan=False, description="length penalty")
    nbest: int = Field(1, ge=1, description="hypotheses per line, at most beam and the server's --max-nbest")
    attention: bool = Field(False, description="add each hypothesis's cross-attention (layers x target x source)")
    source: str | None = Field(None, description="source language (default: the first model's)")
    target: str | None = Field(None, description="target language (default: the first model's)")
    api_key: str | None = Field(None, description="API key, when the server has --api-keys (LibreTranslate's field; "
                                                   "or an Authorization: Bearer KEY or X-API-Key header, which wins)")
    split_sentences: bool = Field(True, description="cut each line into sentences, translate each and join them "
                                                    "with the line's spacing (false: a line is one sentence)")

    @model_validator(mode="before")
    @classmethod
    def _screened(cls, data: Any) -> Any:
        """Lone UTF-16 surrogates read as U+FFFD (`aiayn.serve.unicode`); a body cut after its first
        wrong text and first unknown field (`_first_errors`)."""
        return fields_replaced(_first_errors(data, cls.model_fields)) if isinstance(data, dict) else data


def _first_errors(data: dict[str, Any], known: Mapping[str, Any]) -> dict[str, Any]:
    """`data` without what would add errors after the first of their kind: the texts after the first
    one that is no string, the unknown fields after the first. pydantic makes an error of each and
    FastAPI copies them all, while the answer names the first (they come in this order): a 2 MB
    list of numbers held the event loop 11 s and 1.2 GB, a body of the largest size would have
    exhausted the memory."""
    out: dict[str, Any] = {}
    extra = False
    for k, v in data.items():
        if k not in known:
            if extra:
                continue
            extra = True
        out[k] = v
    text = out.get("text")
    if isinstance(text, list):
        wrong = next((i for i, t in enumerate(text) if not isinstance(t, str)), None)
        if wrong is not None:
            out["text"] = text[:wrong + 1]
    return out


class Hypothesis(BaseModel):
    text: str
    score: float | None = Field(description="log-probability / length penalty (a split line: the sum over its "
                                            "sentences); null for greedy search")
    tokens: list[str] = Field(description="target subwords")
    attention: list[list[list[float]]] | None = Field(None, description="per layer, target x source, head mean")


class SentenceResult(BaseModel):
    source: str = Field(description="the sentence as cut from the line")
    source_tokens: list[str]
    hypotheses: list[Hypothesis]


class LineResult(BaseModel):
    source_tokens: list[str]
    hypotheses: list[Hypothesis]
    sentences: list[SentenceResult] | None = Field(None, description="a line of several sentences: each of them")


class TranslateResponse(BaseModel):
    translations: list[LineResult]
    beam: int
    alpha: float


class Served(Protocol):
    """What this route needs of the server (`aiayn.serve.app.Server`)."""

    limits: Limits
    languages: tuple[str, str]  # the first pair: the default

    def check_key(self, key: Any, request: Request) -> None: ...
    def check_ready(self) -> None: ...
    def model(self, pair: tuple[str, str] | None) -> Any: ...
    async def translate(self, request: Request, lines: list[str], key: Key,
                        asked: int | None = None) -> tuple[list[list[int]], list[Any]]: ...


def routes(app: FastAPI, srv: Served) -> None:
    @app.post("/v1/translate", response_model=None, responses={200: {"model": TranslateResponse}})
    async def translate(req: TranslateRequest, request: Request) -> Response:
        """Per line: the n-best translations with scores, the subwords on both sides and, with
        `attention`, each hypothesis's cross-attention (per layer, target x source subwords); a line
        of several sentences is translated sentence by sentence (`split_sentences`)."""
        srv.check_key(req.api_key, request)  # a key in the head wins (`aiayn.serve.clients`)
        beam = _beam(req, srv.limits)
        model = srv.model((req.source or srv.languages[0], req.target or srv.languages[1]))
        key = Key(beam, req.alpha, req.nbest, req.attention, model.pair)
        srv.check_ready()  # before the lines are cut into sentences, as without split_sentences
        piece = model.translator.tokenizers.src.id_to_piece
        if req.split_sentences:
            lines = await _by_sentences(srv, request, req.text, key, model.source, piece)
        else:
            ids, results = await srv.translate(request, req.text, key)
            lines = [_result([piece(i) for i in src], hyps) for src, hyps in zip(ids, results)]
        return await json_response({"translations": lines, "beam": beam, "alpha": req.alpha})  # megabytes, at times


def _beam(req: TranslateRequest, limits: Limits) -> int:
    """The request's beam (the server's by default); 422 over --max-beam, or an n-best over it or --max-nbest."""
    beam = req.beam or limits.beam
    if beam > limits.max_beam:
        raise ApiError(422, f"beam: at most --max-beam {limits.max_beam}, got {beam}", field="beam")
    if req.nbest > min(beam, limits.max_nbest):
        raise ApiError(422, f"nbest: at most the beam size ({beam}) and --max-nbest {limits.max_nbest}, "
                            f"got {req.nbest}", field="nbest")
    return beam


async def _by_sentences(srv: Served, request: Request, text: list[str], key: Key, language: str,
                        piece: Callable[[int], str]) -> list[dict[str, Any]]:
    """Each line's result, its sentences searched one by one (all of the request's at once)."""
    limits = srv.limits
    if len(text) > limits.max_lines:
        raise ApiError(413, f"{len(text)} lines in one request, more than --max-lines {limits.max_lines}")
    for i, line in enumerate(text):  # a line, not a sentence, is what --max-chars bounds
        if len(line) > limits.max_chars:
            raise ApiError(413, f"line {i}: {len(line)} characters, more than --max-chars {limits.max_chars}")
    paragraphs = await asyncio.to_thread(lambda: [split(t, language) for t in text])  # off the event loop
    # a line of one sentence or none: the line itself, untouched (its spacing changes its subwords)
    units = [list(p.sentences) if len(p.sentences) > 1 else [t] for p, t in zip(paragraphs, text)]
    flat = [s for u in units for s in u]
    check_holdable(limits, len(flat), f"{len(text)} lines", "; send fewer lines or split_sentences: false")
    try:
        ids, results = await srv.translate(request, flat, key, asked=len(text))
    except ApiError as e:
        raise _by_line(e, units) from None
    out, at = [], 0
    for p, u in zip(paragraphs, units):
        mine = [_result([piece(i) for i in src], hyps)
                for src, hyps in zip(ids[at:at + len(u)], results[at:at + len(u)])]
        at += len(u)
        out.append(_joined(p.join, u, mine))
    return out


def _result(source_tokens: list[str], hypotheses: list[dict[str, Any]]) -> dict[str, Any]:
    return {"source_tokens": source_tokens, "hypotheses": hypotheses}


def _joined(join: Any, sentences: list[str], results: list[dict[str, Any]]) -> dict[str, Any]:
    """One line's result from its sentences' (`join`: the paragraph's, putting the spacing back; a
    line searched whole is its own result). The k-th hypothesis takes each sentence's k-th (or its
    last, when it has fewer)."""
    if len(results) == 1:
        return results[0]
    hyps = []
    for k in range(max(len(r["hypotheses"]) for r in results)):
        picked = [r["hypotheses"][min(k, len(r["hypotheses"]) - 1)] for r in results]
        scores = [h["score"] for h in picked]
        hyps.append({"text": join([h["text"] for h in picked]),
                     "score": None if None in scores else round(sum(scores), 6),
                     "tokens": [t for h in picked for t in h["tokens"]]})
    return {"source_tokens": [t for r in results for t in r["source_tokens"]], "hypotheses": hyps,
            "sentences": [{"source": s, **r} for s, r in zip(sentences, results)]}


def _by_line(e: ApiError, units: Sequence[list[str]]) -> ApiError:
    """An error about sentence n of the request as the line and sentence of the client's text."""
    return renamed_line(e, [len(u) for u in units],
                        lambda i, n: f"line {i}" + (f", sentence {n}" if len(units[i]) > 1 else ""))

