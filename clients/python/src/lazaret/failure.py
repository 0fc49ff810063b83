"""A failed attempt as data, and how a handler's exception becomes one.

The same table as the Rust SDK (`crates/lazaret-client`, `Failure`), checked
against the shared cases in `clients/classification-cases.json`:

- a `Failure` the handler raises is sent as it is;
- a payload the handler's `parse` refuses: permanent, kind `parse`;
- `urllib.error.HTTPError` (a downstream reply): `from_status` — 429 or 503
  with `Retry-After` deferred by that long; 5xx, 408 and 429 without it
  transient; any other 4xx permanent; kind `http_<status>`;
- `urllib.error.URLError`: a timeout is transient `timeout`, a connection
  that could not be made transient `connect`, anything else transient `http`;
- `TimeoutError` (and `socket.timeout`, `asyncio.TimeoutError`): transient
  `timeout`; any other `OSError`: transient `io` (`timeout` for ETIMEDOUT);
- anything else raised (what a panic is in Rust): transient `panic`, with
  the exception's type, message and traceback, so a flaky bug is retried and
  a deterministic one spends its budget and lands in the dead letters.
"""

from __future__ import annotations

import asyncio
import email.utils
import errno
import http.client
import traceback as _traceback
import urllib.error
from datetime import datetime, timezone
from typing import Any, Dict, Literal, Optional, Tuple, Union

FailureClass = Literal["transient", "permanent", "deferred"]

#: The server keeps at most this much of a message and a traceback
#: (lazaret_core::failure); longer ones are cut here so a runaway traceback
#: never makes the report itself too large.
MESSAGE_BYTES_MAX = 4 * 1024
TRACEBACK_BYTES_MAX = 16 * 1024


def _cut(text: str, limit: int, middle: bool) -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    if not middle:
        return data[:limit].decode("utf-8", "ignore") + f"…[truncated {len(data) - limit} bytes]"
    half = limit // 2
    head = data[:half].decode("utf-8", "ignore")
    tail = data[-half:].decode("utf-8", "ignore")
    return f"{head}\n…[truncated {len(data) - 2 * half} bytes]…\n{tail}"


class Failure(Exception):
    """A failed attempt: raise it from a handler, or let `classify` make one.

    `failure_class` is `"transient"` (retried with backoff), `"permanent"`
    (dead-lettered at once), `"deferred"` (rescheduled after
    `retry_after_ms` without spending an attempt) or `None` (the type's
    `kind_classes` decide by `kind`; an unknown kind is transient).
    """

    def __init__(
        self,
        failure_class: Optional[FailureClass],
        kind: str,
        message: str = "",
        *,
        retry_after_ms: Optional[int] = None,
        traceback: Optional[str] = None,
    ) -> None:
        super().__init__(message)
        if failure_class not in ("transient", "permanent", "deferred", None):
            raise ValueError(
                f"failure class {failure_class!r} is not one of transient, permanent, deferred or None"
            )
        self.failure_class: Optional[FailureClass] = failure_class
        self.kind = kind
        self.message = message
        self.retry_after_ms = retry_after_ms if failure_class == "deferred" else None
        self.traceback = traceback

    @classmethod
    def transient(cls, kind: str, message: str = "") -> "Failure":
        """May work later: retried with backoff."""
        return cls("transient", kind, message)

    @classmethod
    def permanent(cls, kind: str, message: str = "") -> "Failure":
        """Never will work: dead-lettered at once."""
        return cls("permanent", kind, message)

    @classmethod
    def deferred(cls, kind: str, message: str = "", retry_after_ms: Optional[int] = None) -> "Failure":
        """The downstream asked to wait: no attempt is spent."""
        return cls("deferred", kind, message, retry_after_ms=retry_after_ms)

    @classmethod
    def by_kind(cls, kind: str, message: str = "") -> "Failure":
        """No class: the server's `kind_classes` for the type decide."""
        return cls(None, kind, message)

    @classmethod
    def timeout(cls, message: str = "") -> "Failure":
        """A timeout: transient, kind `timeout`."""
        return cls("transient", "timeout", message)

    @classmethod
    def from_status(
        cls, status: int, retry_after: Optional[str] = None, message: str = "", now: Optional[datetime] = None
    ) -> Optional["Failure"]:
        """Classifies an HTTP status and its `Retry-After` header (`None`
        for 1xx-3xx, which are not failures here). Kind `http_<status>`."""
        if status < 400:
            return None
        kind = f"http_{status}"
        message = message or f"answered {status}"
        wait = parse_retry_after(retry_after, now) if retry_after is not None else None
        if status in (429, 503) and wait is not None:
            return cls.deferred(kind, message, wait)
        if 500 <= status <= 599 or status in (408, 429):
            return cls.transient(kind, message)
        return cls.permanent(kind, message)

    @classmethod
    def parse(cls, error: BaseException) -> "Failure":
        """A payload the handler's `parse` refused: permanent, kind `parse`."""
        return cls.permanent(
            "parse", f"the payload does not match the handler's type: {type(error).__name__}: {error}"
        )

    def with_traceback_text(self, text: str) -> "Failure":
        """The same failure with a traceback."""
        self.traceback = text
        return self

    def to_wire(self) -> Dict[str, Any]:
        """The `error` object of `POST /v1/jobs/{id}/fail`, cut to the server's caps."""
        wire: Dict[str, Any] = {
            "class": self.failure_class,
            "kind": self.kind,
            "message": _cut(self.message, MESSAGE_BYTES_MAX, middle=False),
        }
        if self.traceback is not None:
            wire["traceback"] = _cut(self.traceback, TRACEBACK_BYTES_MAX, middle=True)
        if self.retry_after_ms is not None:
            wire["retry_after_ms"] = self.retry_after_ms
        return wire

    def __repr__(self) -> str:
        return f"Failure({self.failure_class!r}, {self.kind!r}, {self.message!r}, retry_after_ms={self.retry_after_ms!r})"


def parse_retry_after(value: Optional[str], now: Optional[datetime] = None) -> Optional[int]:
    """A `Retry-After` value (delay-seconds or an HTTP date; a past date
    means now) in milliseconds, or `None` when it is neither."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return int(value) * 1000
    try:
        at = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if at is None:
        return None
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    now = now or datetime.now(timezone.utc)
    return max(0, int((at - now).total_seconds() * 1000))


class ParseError(Exception):
    """Raised by the worker when a handler's `parse` refuses the payload."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _timeout_types() -> Tuple[type, ...]:
    # asyncio.TimeoutError is TimeoutError from 3.11 on; before, its own class.
    return (TimeoutError, asyncio.TimeoutError)


def classify(exc: BaseException) -> Failure:
    """The failure a handler's exception is reported as (see the module doc)."""
    if isinstance(exc, Failure):
        return exc
    if isinstance(exc, ParseError):
        return Failure.parse(exc.cause)
    if isinstance(exc, urllib.error.HTTPError):  # before URLError and OSError: it is both
        headers = exc.headers
        retry_after = headers.get("Retry-After") if headers is not None else None
        f = Failure.from_status(exc.code, retry_after, f"{exc.url or 'a downstream'} answered {exc.code} {exc.reason}")
        return f or Failure.transient("http", str(exc))
    if isinstance(exc, urllib.error.URLError):
        reason = exc.reason
        if isinstance(reason, _timeout_types()):
            return Failure.timeout(str(exc))
        if isinstance(reason, OSError):
            return Failure.transient("connect", str(exc))
        return Failure.transient("http", str(exc))
    if isinstance(exc, _timeout_types()):
        return Failure.timeout(str(exc) or type(exc).__name__)
    if isinstance(exc, OSError):
        kind = "timeout" if exc.errno == errno.ETIMEDOUT else "io"
        return Failure.transient(kind, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, http.client.HTTPException):
        return Failure.transient("http", f"{type(exc).__name__}: {exc}")
    text = "".join(_traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Failure.transient("panic", f"handler raised {type(exc).__name__}: {exc}").with_traceback_text(text)


FailureLike = Union[Failure, BaseException]
