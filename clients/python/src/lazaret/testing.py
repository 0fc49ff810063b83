"""A test mode for your own unit tests, as `Sidekiq::Testing` (fake) and
River's `rivertest` give: no server, no network.

- `FakeClient` stands in for `lazaret.Client` in the code under test: it
  records every enqueue (idempotency keys deduplicate as on the server:
  the second enqueue of a (tenant, type, key) answers `DUPLICATE`), and
  `assert_enqueued` / `jobs` read them back.
- `drain(worker)` runs the recorded jobs through a `Worker`'s handlers,
  with the worker's own parse and classification (jobs those handlers
  enqueue are run too), and tells how each ended.
- `run_job(worker, type, payload)` runs one job through its handler, as
  `rivertest.Worker.Work` does.

    fake = FakeClient()
    signup(fake, "ada@example.com")            # your code, given the fake
    fake.assert_enqueued("send_email", tenant="acme", payload={"to": "ada@example.com"})
    ran = drain(fake, worker)                  # the worker built as in production
    assert all(r.ok for r in ran)
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .client import Enqueued, LeasedJob, NewJob
from .errors import ApiError
from .failure import Failure
from .worker import Worker

_ANY = object()

#: A `traceparent` the server takes (W3C trace context, version 00).
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def _check_traceparent(value: str) -> str:
    """`value` as the server keeps it, or the `ApiError` it answers."""
    value = value.strip(" \t")
    m = _TRACEPARENT.fullmatch(value)
    if m is None or set(m.group(1)) == {"0"} or set(m.group(2)) == {"0"}:
        raise ApiError(
            "BAD_REQUEST",
            "traceparent must be `00-<32 lower-case hex trace id>-<16 lower-case hex parent id>-<2 hex flags>`"
            " (W3C trace context, version 00), neither id all zeros;"
            " leave `traceparent` out to enqueue the job without a trace",
            status=400,
        )
    return value


@dataclass
class Ran:
    """One job run in test mode: `failure` is `None` when the handler succeeded."""

    job: LeasedJob
    failure: Optional[Failure]

    @property
    def ok(self) -> bool:
        return self.failure is None


class FakeClient:
    """Records enqueues instead of sending them (the producer half of `Client`)."""

    def __init__(self) -> None:
        self.enqueued: List[Tuple[str, NewJob]] = []  # (id, job), oldest first, not yet drained
        self.all_enqueued: List[Tuple[str, NewJob]] = []  # every admitted job, drained or not
        self._keys: Dict[Tuple[str, str, str], str] = {}
        self._ids = itertools.count(1)

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
        return self._admit(NewJob(type, tenant, payload, lane, idempotency_key, schema_version, delay_ms, traceparent))

    def enqueue_batch(self, jobs: Sequence[NewJob]) -> List[Union[Enqueued, ApiError]]:
        out: List[Union[Enqueued, ApiError]] = []
        for job in jobs:
            try:
                out.append(self._admit(job))
            except ApiError as e:
                out.append(e)
        return out

    def _admit(self, job: NewJob) -> Enqueued:
        if not job.tenant:
            raise ApiError("NO_TENANT", 'tenant is missing or empty; set "tenant" on every job', status=400)
        if not job.type:
            raise ApiError("BAD_REQUEST", "type is missing or empty", status=400)
        if job.traceparent is not None:
            job = dataclasses.replace(job, traceparent=_check_traceparent(job.traceparent))
        if job.idempotency_key is not None:
            key = (job.tenant, job.type, job.idempotency_key)
            if key in self._keys:
                return Enqueued(self._keys[key], "queued", "DUPLICATE")
        id = str(next(self._ids))
        if job.idempotency_key is not None:
            self._keys[(job.tenant, job.type, job.idempotency_key)] = id
        self.enqueued.append((id, job))
        self.all_enqueued.append((id, job))
        return Enqueued(id, "scheduled" if job.delay_ms else "queued", "ADMITTED")

    def jobs(self, type: Optional[str] = None, *, tenant: Optional[str] = None) -> List[NewJob]:
        """The jobs enqueued and not drained yet, oldest first."""
        return [j for _, j in self.enqueued if (type is None or j.type == type) and (tenant is None or j.tenant == tenant)]

    def assert_enqueued(
        self,
        type: str,
        *,
        tenant: Optional[str] = None,
        payload: Any = _ANY,
        lane: Optional[str] = None,
        idempotency_key: Optional[str] = None,
        count: Optional[int] = None,
    ) -> NewJob:
        """Fails (AssertionError) unless a job matching every given field was
        enqueued and not drained (exactly `count` of them, when given);
        returns the first match."""
        matches = [
            j
            for j in self.jobs(type, tenant=tenant)
            if (payload is _ANY or j.payload == payload)
            and (lane is None or (j.lane or "default") == lane)
            and (idempotency_key is None or j.idempotency_key == idempotency_key)
        ]
        if not matches or (count is not None and len(matches) != count):
            seen = ", ".join(f"{j.type}/{j.tenant} {j.payload!r}" for j in self.jobs()) or "nothing"
            want = f"{count} " if count is not None else ""
            raise AssertionError(f"expected {want}{type} job(s) matching; {len(matches)} matched; enqueued: {seen}")
        return matches[0]

    def clear(self) -> None:
        """Forgets every recorded job (and idempotency key)."""
        self.enqueued.clear()
        self.all_enqueued.clear()
        self._keys.clear()


def _leased(id: str, job: NewJob, attempt: int) -> LeasedJob:
    now = datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    return LeasedJob(
        id=id,
        type=job.type,
        tenant=job.tenant,
        lane=job.lane or "default",
        payload=job.payload,
        attempt=attempt,
        lease_token=f"test-{id}-{attempt}",
        lease_expires_at=now,
        created_at=now,
        idempotency_key=job.idempotency_key,
        schema_version=job.schema_version,
        traceparent=job.traceparent,
    )


def drain(fake: FakeClient, worker: Worker, *, type: Optional[str] = None, rounds_max: int = 100) -> List[Ran]:
    """Runs the recorded jobs (of `type`, or all) through `worker`'s handlers,
    oldest first, until none is left; jobs the handlers enqueue into `fake`
    run too, up to `rounds_max` rounds. Each job runs once, as attempt 1:
    a failure is reported in its `Ran`, not retried."""
    ran: List[Ran] = []
    for _ in range(rounds_max):
        batch = [(i, j) for i, j in fake.enqueued if type is None or j.type == type]
        if not batch:
            return ran
        fake.enqueued = [(i, j) for i, j in fake.enqueued if not (type is None or j.type == type)]
        for id, job in batch:
            leased = _leased(id, job, 1)
            ran.append(Ran(leased, worker.execute(leased)))
    raise AssertionError(f"drain: jobs still enqueued after {rounds_max} rounds; do the handlers enqueue forever?")


def run_job(
    worker: Worker,
    type: str,
    payload: Any,
    *,
    tenant: str = "test",
    lane: Optional[str] = None,
    attempt: int = 1,
    idempotency_key: Optional[str] = None,
) -> Ran:
    """Runs one job through `worker`'s handler for `type` (parse and
    classification included), without a server."""
    job = NewJob(type, tenant, payload, lane, idempotency_key)
    return Ran(_leased("1", job, attempt), worker.execute(_leased("1", job, attempt)))
