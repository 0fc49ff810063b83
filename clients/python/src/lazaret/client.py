"""The HTTP client: one method per endpoint a producer or a worker calls,
over `urllib` (standard library only).

Every request goes through `Client.call(operation, path_args, body)`, and
the operations are the table `OPERATIONS`, which the package's tests check
against the server's OpenAPI document (`docs/openapi.json`)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from .errors import ApiError, TransportError
from .failure import Failure

#: Every operation this package calls: name -> (method, path template).
OPERATIONS: Dict[str, Tuple[str, str]] = {
    "enqueue": ("POST", "/v1/jobs"),
    "enqueue_batch": ("POST", "/v1/jobs/batch"),
    "job": ("GET", "/v1/jobs/{id}"),
    "cancel": ("POST", "/v1/jobs/{id}/cancel"),
    "lease": ("POST", "/v1/leases"),
    "ack": ("POST", "/v1/jobs/{id}/ack"),
    "fail": ("POST", "/v1/jobs/{id}/fail"),
    "heartbeat": ("POST", "/v1/jobs/{id}/heartbeat"),
    "acks": ("POST", "/v1/acks"),
    "fails": ("POST", "/v1/fails"),
}

#: (status, headers, body bytes) from a transport.
Reply = Tuple[int, Mapping[str, str], bytes]
#: A transport sends (method, url, headers, body or None, timeout seconds).
Transport = Callable[[str, str, Dict[str, str], Optional[bytes], float], Reply]


def urllib_transport(method: str, url: str, headers: Dict[str, str], body: Optional[bytes], timeout: float) -> Reply:
    """The default transport: `urllib.request`, no redirects followed by hand."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers.items()), resp.read()
    except urllib.error.HTTPError as e:
        try:
            data = e.read()
        finally:
            e.close()
        return e.code, dict(e.headers.items()) if e.headers else {}, data
    except (urllib.error.URLError, OSError) as e:
        raise TransportError(f"{method} {url}: {e}", e) from e


@dataclass
class NewJob:
    """A job to enqueue (`POST /v1/jobs`)."""

    type: str
    tenant: str
    payload: Any
    lane: Optional[str] = None
    idempotency_key: Optional[str] = None
    schema_version: Optional[int] = None
    delay_ms: Optional[int] = None
    #: A W3C trace context (`00-<trace id>-<parent id>-<flags>`) the job
    #: joins: its worker sees it on the leased job and can continue the trace.
    traceparent: Optional[str] = None

    def to_wire(self) -> Dict[str, Any]:
        body: Dict[str, Any] = {"type": self.type, "tenant": self.tenant, "payload": self.payload}
        for key in ("lane", "idempotency_key", "schema_version", "delay_ms", "traceparent"):
            value = getattr(self, key)
            if value is not None:
                body[key] = value
        return body


@dataclass
class Enqueued:
    """The reply to an enqueue: `admission` is `ADMITTED`, `FAIR_QUEUE` or `DUPLICATE`."""

    id: str
    state: str
    admission: str

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> "Enqueued":
        return cls(str(reply["id"]), str(reply["state"]), str(reply["admission"]))


@dataclass
class LeaseRequest:
    """What `POST /v1/leases` (and an outcome's `next`) asks for."""

    worker_id: Optional[str] = None
    lanes: Optional[List[str]] = None
    types: Optional[List[str]] = None
    max_jobs: int = 1
    lease_ms: Optional[int] = None
    wait_ms: int = 0

    def to_wire(self) -> Dict[str, Any]:
        body: Dict[str, Any] = {"max_jobs": self.max_jobs, "wait_ms": self.wait_ms}
        for key in ("worker_id", "lanes", "types", "lease_ms"):
            value = getattr(self, key)
            if value is not None:
                body[key] = value
        return body


@dataclass
class LeasedJob:
    """A leased job as `POST /v1/leases` hands it over."""

    id: str
    type: str
    tenant: str
    lane: str
    payload: Any
    attempt: int
    lease_token: str
    lease_expires_at: str
    created_at: str
    idempotency_key: Optional[str] = None
    schema_version: Optional[int] = None
    #: The W3C trace context it was enqueued with (`None`: none).
    traceparent: Optional[str] = None

    @classmethod
    def of(cls, j: Mapping[str, Any]) -> "LeasedJob":
        return cls(
            id=str(j["id"]),
            type=j["type"],
            tenant=j["tenant"],
            lane=j["lane"],
            payload=j.get("payload"),
            attempt=int(j["attempt"]),
            lease_token=str(j["lease_token"]),
            lease_expires_at=j.get("lease_expires_at", ""),
            created_at=j.get("created_at", ""),
            idempotency_key=j.get("idempotency_key"),
            schema_version=j.get("schema_version"),
            traceparent=j.get("traceparent"),
        )


@dataclass
class Outcome:
    """The reply to an ack or fail: `state` (`succeeded`, `scheduled`,
    `dead_lettered`, `cancelled`), the rest of the reply in `fields`, and
    with `next` the jobs leased in the same request (or `next_error`)."""

    state: str
    fields: Dict[str, Any]
    jobs: List[LeasedJob] = field(default_factory=list)
    next_error: Optional[ApiError] = None

    @classmethod
    def of(cls, reply: Mapping[str, Any]) -> "Outcome":
        nxt = reply.get("next_error")
        return cls(
            state=str(reply.get("state")),
            fields={k: v for k, v in reply.items() if k not in ("jobs", "next_error")},
            jobs=[LeasedJob.of(j) for j in reply.get("jobs") or []],
            next_error=ApiError.from_object(nxt) if isinstance(nxt, dict) else None,
        )


@dataclass
class Heartbeat:
    """The reply to a heartbeat."""

    lease_expires_at: str
    cancel_requested: bool


class Client:
    """A client of one lazaret server.

    >>> client = Client("http://127.0.0.1:7433", token=os.environ.get("LAZARET_TOKEN"))
    >>> client.enqueue("send_email", "acme", {"to": "ada@example.com"}, idempotency_key="welcome-ada")

    `timeout` (seconds) bounds each request; a long-poll adds its wait.
    Thread-safe: the worker shares one client between its threads.
    """

    def __init__(
        self,
        server: str = "http://127.0.0.1:7433",
        *,
        token: Optional[str] = None,
        timeout: float = 30.0,
        transport: Optional[Transport] = None,
    ) -> None:
        parsed = urllib.parse.urlsplit(server)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"server {server!r} is not an http:// or https:// URL; pass e.g. http://127.0.0.1:7433")
        self.server = server.rstrip("/")
        self.token = token if token is not None else os.environ.get("LAZARET_TOKEN") or None
        self.timeout = timeout
        self.transport: Transport = transport or urllib_transport

    # ------------------------------------------------------------ plumbing
    def call(
        self,
        operation: str,
        body: Optional[Mapping[str, Any]] = None,
        *,
        id: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        """Sends one of `OPERATIONS`; returns the decoded reply or raises
        `ApiError` (an error reply) or `TransportError`."""
        method, template = OPERATIONS[operation]
        path = template.replace("{id}", urllib.parse.quote(str(id), safe="")) if "{id}" in template else template
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":")).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        status, reply_headers, raw = self.transport(method, self.server + path, headers, data, timeout or self.timeout)
        try:
            decoded = json.loads(raw) if raw else None
        except ValueError as e:
            if 200 <= status < 300:
                raise TransportError(f"the server's {status} reply to {method} {path} is not JSON: {raw[:200]!r}", e) from e
            decoded = None
        if 200 <= status < 300:
            return decoded
        if isinstance(decoded, dict) and isinstance(decoded.get("error"), dict):
            retry = _retry_after_ms(reply_headers)
            raise ApiError.from_object(decoded["error"], status=status, retry_after_ms=retry)
        raise TransportError(f"{method} {path}: the server answered {status} without an API error body: {raw[:200]!r}")

    # ------------------------------------------------------------ producers
    def enqueue(
        self,
        type: str,
        tenant: str,
        payload: Any,
        *,
        lane: Optional[str] = None,
        idempotency_key: Optional[str] = None,
        schema_version: Optional[int] = None,
        delay_ms: Optional[int] = None,
        traceparent: Optional[str] = None,
    ) -> Enqueued:
        """`POST /v1/jobs`. With an `idempotency_key`, a second enqueue of the
        same (tenant, type, key) answers `DUPLICATE` with the first job's id.
        With a `traceparent` (W3C trace context) the job joins that trace; one
        that is not valid is refused (`ApiError` `BAD_REQUEST`)."""
        job = NewJob(type, tenant, payload, lane, idempotency_key, schema_version, delay_ms, traceparent)
        return Enqueued.of(self.call("enqueue", job.to_wire()))

    def enqueue_batch(self, jobs: Sequence[NewJob]) -> List[Union[Enqueued, ApiError]]:
        """`POST /v1/jobs/batch`: one result per job, in order; a refused job
        is an `ApiError` in its place, not a failed batch."""
        reply = self.call("enqueue_batch", {"jobs": [j.to_wire() for j in jobs]})
        return [_item(r, Enqueued.of) for r in reply["results"]]

    def job(self, id: str) -> Dict[str, Any]:
        """`GET /v1/jobs/{id}`: the job, its state and history."""
        return dict(self.call("job", id=id))

    def cancel(self, id: str) -> Dict[str, Any]:
        """`POST /v1/jobs/{id}/cancel`."""
        return dict(self.call("cancel", {}, id=id))

    # ------------------------------------------------------------ workers
    def lease(self, request: Optional[LeaseRequest] = None, **fields: Any) -> List[LeasedJob]:
        """`POST /v1/leases`; long-polls up to `wait_ms` when nothing is ready."""
        req = request or LeaseRequest(**fields)
        reply = self.call("lease", req.to_wire(), timeout=self.timeout + req.wait_ms / 1000)
        return [LeasedJob.of(j) for j in reply["jobs"]]

    def ack(self, id: str, lease_token: str, *, next: Optional[LeaseRequest] = None) -> Outcome:
        """`POST /v1/jobs/{id}/ack`; with `next`, the reply also carries the
        next lease. `ApiError` with `is_lease_lost`: drop the job."""
        body: Dict[str, Any] = {"lease_token": lease_token}
        wait = 0.0
        if next is not None:
            body["next"] = next.to_wire()
            wait = next.wait_ms / 1000
        return Outcome.of(self.call("ack", body, id=id, timeout=self.timeout + wait))

    def fail(self, id: str, lease_token: str, failure: Failure, *, next: Optional[LeaseRequest] = None) -> Outcome:
        """`POST /v1/jobs/{id}/fail` with the failure's class and kind."""
        body: Dict[str, Any] = {"lease_token": lease_token, "error": failure.to_wire()}
        wait = 0.0
        if next is not None:
            body["next"] = next.to_wire()
            wait = next.wait_ms / 1000
        return Outcome.of(self.call("fail", body, id=id, timeout=self.timeout + wait))

    def heartbeat(self, id: str, lease_token: str, extend_ms: Optional[int] = None) -> Heartbeat:
        """`POST /v1/jobs/{id}/heartbeat`: the lease now ends `extend_ms` from now."""
        body: Dict[str, Any] = {"lease_token": lease_token}
        if extend_ms is not None:
            body["extend_ms"] = extend_ms
        reply = self.call("heartbeat", body, id=id)
        return Heartbeat(str(reply["lease_expires_at"]), bool(reply.get("cancel_requested", False)))

    def acks(self, items: Sequence[Tuple[str, str]]) -> List[Union[Outcome, ApiError]]:
        """`POST /v1/acks` with (id, lease_token) pairs: one result per item."""
        reply = self.call("acks", {"items": [{"id": str(i), "lease_token": t} for i, t in items]})
        return [_item(r, Outcome.of) for r in reply["results"]]

    def fails(self, items: Sequence[Tuple[str, str, Failure]]) -> List[Union[Outcome, ApiError]]:
        """`POST /v1/fails` with (id, lease_token, failure): one result per item."""
        body = {"items": [{"id": str(i), "lease_token": t, "error": f.to_wire()} for i, t, f in items]}
        reply = self.call("fails", body)
        return [_item(r, Outcome.of) for r in reply["results"]]


def _item(r: Mapping[str, Any], ok: Callable[[Mapping[str, Any]], Any]) -> Any:
    if isinstance(r.get("error"), dict):
        return ApiError.from_object(r["error"])
    return ok(r)


def _retry_after_ms(headers: Mapping[str, str]) -> Optional[int]:
    for k, v in headers.items():
        if k.lower() == "retry-after" and v.strip().isdigit():
            return int(v.strip()) * 1000
    return None
