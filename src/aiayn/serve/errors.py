"""The errors the handlers of `aiayn serve` answer with: `{"error": message}` and a status."""

from __future__ import annotations


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
