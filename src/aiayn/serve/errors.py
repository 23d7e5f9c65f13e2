"""The errors the handlers of `aiayn serve` answer with: `{"error": message}` and a status."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence


class ApiError(Exception):
    """An error answered as `{"error": message}` (and `"field"` for a 422)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None, field: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.headers, self.field = status, message, headers, field


class Busy(ApiError):
    """The queue is full: 503 on aiayn's API, 429 on LibreTranslate's (both with Retry-After)."""

    def __init__(self, message: str, retry_after: str = "1") -> None:
        super().__init__(503, message, {"Retry-After": retry_after})
        self.retry_after = retry_after


def renamed_line(e: ApiError, counts: Sequence[int], name: Callable[[int, int], str]) -> ApiError:
    """An error about line n of what the server searched ("line n: ...", as it counts them), the lines
    being units of `counts[i]` sentences each in order, named `name(unit, sentence within it)` for the
    client; any other error as it is."""
    m = re.match(r"line (\d+): ", e.message)
    if not m:
        return e
    n = int(m.group(1))
    for i, count in enumerate(counts):
        if n < count:
            return ApiError(e.status, f"{name(i, n)}: {e.message[m.end():]}", e.headers, e.field)
        n -= count
    return e
