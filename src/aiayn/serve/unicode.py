"""Text as a JSON body can carry it and UTF-8 cannot: a lone UTF-16 surrogate (`"\\ud800"`), which
a JavaScript client sends when it cuts a string through an emoji (`substring` at a length limit).
Python's `json` and pydantic decode it into a `str` that the tokenizer, and the JSON encoder of the
answer, then refuse. Each one is read as U+FFFD, the replacement character, as a UTF-8 decoder
reads a broken byte sequence; form fields and query strings never hold one (they are decoded from
bytes so already)."""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def replaced(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD."""
    return _SURROGATE.sub("\ufffd", text)


def fields_replaced(fields: dict[str, Any]) -> dict[str, Any]:
    """A request's fields with lone surrogates replaced in each text and each text of a list (the
    shapes a field of these APIs takes; deeper values are refused by their field's type check)."""
    def clean(v: Any) -> Any:
        if isinstance(v, str):
            return replaced(v)
        if isinstance(v, list) and not _in_texts(v):  # the usual case, without a loop in Python over 10^6 texts
            return v
        if isinstance(v, list):
            return [replaced(t) if isinstance(t, str) else t for t in v]
        return v
    return {k: clean(v) for k, v in fields.items()}


def _in_texts(texts: list[Any]) -> bool:
    """Whether a list (of texts, else of anything) may hold a lone surrogate: one pass in C."""
    try:
        return _SURROGATE.search("".join(texts)) is not None
    except TypeError:  # not all texts: the caller looks at each
        return True
