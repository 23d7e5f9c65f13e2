"""Answers encoded as JSON without holding the event loop.

`json.dumps` of a whole answer is one call into C that holds the GIL from start to end: for a large
answer (a /v1 answer with attention is megabytes of numbers; 1,024 long texts with alternatives)
that is up to ~0.5 s in which /health and every other client wait. A worker thread would not help
(the loop cannot run while another thread holds the GIL). So an answer is encoded piece by piece
(a large object member by member, a large list element by element or, for numbers or strings,
about a thousand at a time) and the event loop gets its turn every `SLICE_S`: a small answer is
one piece, done before its first turn, as inline as `json.dumps`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

from starlette.responses import Response

SLICE_S = 0.005  # the longest the encoding holds the loop at a time (and a piece more)
PIECE = 1024  # numbers (or runs of 16 characters) per piece: a millisecond or less to encode


async def json_response(content: Any) -> Response:
    """`content` as a 200 JSON response, byte for byte what `JSONResponse(content)` sends."""
    out: list[bytes] = []
    due = time.perf_counter() + SLICE_S
    for piece in _pieces(content):
        out.append(piece)
        if time.perf_counter() > due:
            await asyncio.sleep(0)  # the loop's turn: other clients, /health
            due = time.perf_counter() + SLICE_S
    return Response(b"".join(out), media_type="application/json")


def _pieces(value: Any) -> Iterator[bytes]:
    """`value` as JSON (compact, UTF-8, as `JSONResponse`), in pieces of about `PIECE` each."""
    if not isinstance(value, (dict, list)) or _size(value) <= PIECE:
        yield _dumps(value)
    elif isinstance(value, dict):
        sep = b"{"
        for k, v in value.items():
            yield sep + _dumps({k: 0})[1:-2]  # the key as json.dumps writes it (1 -> "1"), and its colon
            yield from _pieces(v)
            sep = b","
        yield b"}"
    elif isinstance(value[0], (dict, list)):
        sep = b"["
        for v in value:
            yield sep
            yield from _pieces(v)
            sep = b","
        yield b"]"
    else:  # numbers or strings, some at a time
        step = max(1, PIECE // _size(value[0]))
        for i in range(0, len(value), step):
            yield (b"," if i else b"[") + _dumps(value[i:i + step])[1:-1]  # (the elements, without brackets)
        yield b"]"


def _size(value: Any, cap: int = PIECE) -> int:
    """About how many numbers, or runs of 16 characters, `value` holds, counted until past `cap` (a list
    of numbers or strings judged by its first element; a list of lists or objects element by element:
    a short first line says nothing of the next)."""
    if isinstance(value, list) and value and not isinstance(value[0], (dict, list)):
        return len(value) * _size(value[0])
    if isinstance(value, (dict, list)) and value:
        n = 0
        for v in value.values() if isinstance(value, dict) else value:
            n += _size(v, cap - n)
            if n > cap:
                break
        return n
    return 1 + len(value) // 16 if isinstance(value, str) else 1


_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))  # JSONResponse's


def _dumps(value: Any) -> bytes:
    return _ENCODER.encode(value).encode("utf-8")
