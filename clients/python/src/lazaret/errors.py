"""What can go wrong talking to a lazaret server: the API's error envelope
`{"error": {"code", "reason", "message", ...}}` as an exception."""

from __future__ import annotations

from typing import Any, Dict, Optional


class LazaretError(Exception):
    """Base of every error this package raises about the server."""


class ApiError(LazaretError):
    """The server answered with one of the API's errors (docs/api.md, "Errors").

    `code` is the contract's code (`LEASE_LOST`, `SHED`, `POISON`, ...),
    `status` the HTTP status (0 for an item of a batch reply), `reason` the
    POISON reason, `retry_after_ms` the wait a SHED or UNAVAILABLE asks for.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int = 0,
        reason: Optional[str] = None,
        details: Any = None,
        retry_after_ms: Optional[int] = None,
        body: Optional[Dict[str, Any]] = None,
    ) -> None:
        where = f"{status} " if status else ""
        why = f" ({reason})" if reason else ""
        super().__init__(f"{where}{code}{why}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.reason = reason
        self.details = details
        self.retry_after_ms = retry_after_ms
        self.body = body

    @classmethod
    def from_object(
        cls, obj: Dict[str, Any], status: int = 0, retry_after_ms: Optional[int] = None
    ) -> "ApiError":
        """From the inner `error` object of an error reply or batch item."""
        ms = obj.get("retry_after_ms")
        return cls(
            str(obj.get("code", "UNKNOWN")),
            str(obj.get("message", "")),
            status=status,
            reason=obj.get("reason"),
            details=obj.get("details"),
            retry_after_ms=ms if isinstance(ms, int) else retry_after_ms,
            body={"error": obj},
        )

    @property
    def is_lease_lost(self) -> bool:
        """The lease is no longer ours: drop the job, never resend."""
        return self.code == "LEASE_LOST"


class TransportError(LazaretError):
    """The request did not complete (connection refused, reset, timed out),
    or the reply was not the JSON expected. `cause` is the underlying error."""

    def __init__(self, message: str, cause: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.cause = cause
