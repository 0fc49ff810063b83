"""The worker runtime: handlers per job type, a pool of threads, heartbeats,
classified failures, `next` (the outcome and the next lease in one request)
and a graceful shutdown on SIGTERM or SIGINT that charges no attempt to the
jobs it hands back. The protocol is docs/workers.md; the Rust SDK's
`Worker` (crates/lazaret-client) behaves the same way.

How a job moves: the lease loop asks for as many jobs as it has free
slots (long-polling `poll_wait_ms`); each job gets a thread that runs
`parse` then the handler while heartbeating every `lease_ms / 3`, then
acks or fails it, asking in the same request for the next job (`next`)
while the worker is not stopping, and runs that one in the same slot.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import random
import signal
import socket
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Generic, List, Optional, TypeVar

from .client import Client, LeasedJob, LeaseRequest, Outcome
from .errors import ApiError, TransportError
from .failure import Failure, ParseError, classify

log = logging.getLogger("lazaret.worker")

T = TypeVar("T")

#: The `retry_after_ms` of jobs handed back at shutdown (the Rust SDK's default).
HANDBACK_DELAY_MS = 1000
#: Tries of a report whose request failed in transport or with a 5xx.
REPORT_TRIES = 3
#: Lease errors after which leasing again cannot help.
FATAL_LEASE_CODES = ("UNAUTHORIZED", "FORBIDDEN", "BAD_REQUEST")


class Job(Generic[T]):
    """A job handed to a handler: its payload (after `parse`, when the
    handler has one) and its envelope. `cancel_requested` turns true when a
    heartbeat learns that the job was cancelled: stop, and raise or return."""

    def __init__(self, leased: LeasedJob, payload: T) -> None:
        self.payload: T = payload
        self.id = leased.id
        self.type = leased.type
        self.tenant = leased.tenant
        self.lane = leased.lane
        self.attempt = leased.attempt
        self.idempotency_key = leased.idempotency_key
        self.schema_version = leased.schema_version
        self.traceparent = leased.traceparent
        self.created_at = leased.created_at
        self.lease_token = leased.lease_token
        self.lease_expires_at = leased.lease_expires_at
        self.cancel_requested = False

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, type={self.type!r}, tenant={self.tenant!r}, attempt={self.attempt})"


Handler = Callable[[Job[Any]], Any]
Parse = Callable[[Any], Any]


@dataclass
class RunReport:
    """Totals of a worker's run."""

    succeeded: int = 0
    failed: int = 0
    panicked: int = 0
    parse_failed: int = 0
    handed_back: int = 0
    lease_lost: int = 0
    not_reported: int = 0


class WorkerError(Exception):
    """Leasing failed in a way retrying cannot fix (bad token, forbidden, bad
    request): the worker drained and stopped. `cause` is the `ApiError`."""

    def __init__(self, cause: ApiError) -> None:
        super().__init__(f"leasing failed for good: {cause}")
        self.cause = cause


class _Running:
    """One job in a slot: settled once, by whoever reports it first (the
    slot when the handler ends, or the shutdown when the grace is over)."""

    def __init__(self, leased: LeasedJob) -> None:
        self.leased = leased
        self.lock = threading.Lock()
        self.settled = False
        self.lost = False

    def settle(self) -> bool:
        with self.lock:
            if self.settled:
                return False
            self.settled = True
            return True


class Worker:
    """Leases jobs of the types it has handlers for and runs them.

    >>> worker = Worker(Client("http://127.0.0.1:7433"), concurrency=4)
    >>> @worker.handler("send_email")
    ... def send_email(job):
    ...     ...  # return: ack; raise: fail, classified (see lazaret.failure)
    >>> worker.run()  # until SIGTERM or Ctrl-C, then a graceful shutdown
    """

    def __init__(
        self,
        client: Client,
        *,
        worker_id: Optional[str] = None,
        lanes: Optional[List[str]] = None,
        concurrency: int = 4,
        lease_ms: int = 30_000,
        heartbeats: bool = True,
        poll_wait_ms: int = 2_000,
        shutdown_grace_s: float = 30.0,
        handback_delay_ms: int = HANDBACK_DELAY_MS,
        use_next: bool = True,
        on_report: Optional[Callable[[LeasedJob, str, Optional[Failure], Optional[Outcome]], None]] = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency is {concurrency}; give it at least 1")
        if lease_ms < 30:
            raise ValueError(f"a lease of {lease_ms} ms is too short to heartbeat; use at least 30 ms")
        self.client = client
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.lanes = lanes
        self.concurrency = concurrency
        self.lease_ms = lease_ms
        self.heartbeats = heartbeats
        self.poll_wait_ms = poll_wait_ms
        self.shutdown_grace_s = shutdown_grace_s
        self.handback_delay_ms = handback_delay_ms
        self.use_next = use_next
        self.on_report = on_report
        self.handlers: Dict[str, Handler] = {}
        self.parsers: Dict[str, Optional[Parse]] = {}
        self.report = RunReport()
        self._stop = threading.Event()
        self._abort = threading.Event()
        self._cond = threading.Condition()
        self._running: Dict[str, _Running] = {}
        self._report_lock = threading.Lock()

    # ------------------------------------------------------------ handlers
    def handle(self, job_type: str, handler: Handler, *, parse: Optional[Parse] = None) -> "Worker":
        """Runs jobs of `job_type` with `handler(job)`: returning acks, raising
        fails (see `lazaret.failure.classify`). `async def` handlers run on an
        event loop of their own in the job's thread. With `parse`, the payload
        goes through it first, and a payload it refuses (any exception) fails
        as permanent `parse` without the handler running."""
        self.handlers[job_type] = handler
        self.parsers[job_type] = parse
        return self

    def handler(self, job_type: str, *, parse: Optional[Parse] = None) -> Callable[[Handler], Handler]:
        """`handle` as a decorator."""

        def register(fn: Handler) -> Handler:
            self.handle(job_type, fn, parse=parse)
            return fn

        return register

    def execute(self, leased: LeasedJob, job_ref: Optional[List[Job[Any]]] = None) -> Optional[Failure]:
        """Runs one job's parse and handler here, without the server: `None`
        when it succeeded, else the classified failure. The worker calls it
        for each job; `lazaret.testing` calls it to run jobs in unit tests."""
        handler = self.handlers.get(leased.type)
        if handler is None:
            return Failure.transient(
                "no_handler", f"worker {self.worker_id} has no handler for type {leased.type}"
            )
        try:
            parse = self.parsers.get(leased.type)
            try:
                payload = parse(leased.payload) if parse is not None else leased.payload
            except Exception as e:  # noqa: BLE001 - any refusal of the payload is a parse failure
                raise ParseError(e) from e
            job: Job[Any] = Job(leased, payload)
            if job_ref is not None:
                job_ref.append(job)
            result = handler(job)
            if inspect.isawaitable(result):
                asyncio.run(_await(result))
            return None
        except Exception as e:  # noqa: BLE001 - every exception is classified, as a panic is in Rust
            return classify(e)

    # ------------------------------------------------------------ running
    def stop(self) -> None:
        """Asks the worker to stop: no more leases, running handlers finish
        within `shutdown_grace_s`, jobs not started are handed back."""
        self._stop.set()

    def run(self) -> RunReport:
        """Runs until SIGTERM or SIGINT (or `stop()`), then shuts down
        gracefully; a second signal ends the grace at once. Signal handlers
        are installed only when called from the main thread."""
        previous: Dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            return self.run_until_stopped()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self._stop.is_set():
            log.warning("signal %d again: handing back running jobs now", signum)
            self._abort.set()
            with self._cond:
                self._cond.notify_all()
        else:
            log.info("signal %d: stopping after the running jobs", signum)
            self._stop.set()

    def run_until_stopped(self) -> RunReport:
        """Runs until `stop()`, then shuts down gracefully and returns the totals."""
        if not self.handlers:
            raise ValueError('no handlers: add one with worker.handle("type", fn)')
        types = sorted(self.handlers)
        backoff = 0.1
        error: Optional[ApiError] = None
        while not self._stop.is_set():
            with self._cond:
                while len(self._running) >= self.concurrency and not self._stop.is_set():
                    self._cond.wait(0.25)
                free = self.concurrency - len(self._running)
            if self._stop.is_set():
                break
            req = LeaseRequest(self.worker_id, self.lanes, types, free, self.lease_ms, self.poll_wait_ms)
            try:
                jobs = self.client.lease(req)
                backoff = 0.1
            except ApiError as e:
                if e.code in FATAL_LEASE_CODES:
                    log.error("leasing refused (%s); stopping the worker", e)
                    error = e
                    self._stop.set()
                    break
                log.warning("leasing failed (%s); trying again in %.1f s", e, backoff)
                self._stop.wait(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, 5.0)
                continue
            except TransportError as e:
                log.warning("leasing failed (%s); trying again in %.1f s", e, backoff)
                self._stop.wait(backoff * random.uniform(0.5, 1.0))
                backoff = min(backoff * 2, 5.0)
                continue
            if self._stop.is_set():
                self._hand_back(jobs, "the worker is shutting down; handed back before it started")
                break
            for leased in jobs:
                self._start(leased)
        self._drain()
        if error is not None:
            raise WorkerError(error)
        return self.report

    def _start(self, leased: LeasedJob) -> None:
        running = _Running(leased)
        with self._cond:
            self._running[leased.id] = running
        threading.Thread(target=self._slot, args=(running,), name=f"lazaret-job-{leased.id}", daemon=True).start()

    def _drain(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._running or self._abort.is_set(), timeout=self.shutdown_grace_s)
            left = list(self._running.values())
        if left:
            log.warning("shutdown grace over: handing back %d running job(s)", len(left))
            mine = [r.leased for r in left if r.settle()]
            self._hand_back(mine, "the worker shut down before the handler finished")

    def _slot(self, running: _Running) -> None:
        current: Optional[_Running] = running
        while current is not None:
            leased = current.leased
            failure = self._run_one(current)
            nxt: Optional[_Running] = None
            if current.lost:
                if current.settle():
                    self._count("lease_lost", leased, None, None)
            elif current.settle():
                ask = self.use_next and not self._stop.is_set()
                request = LeaseRequest(self.worker_id, self.lanes, sorted(self.handlers), 1, self.lease_ms, 0) if ask else None
                outcome = self._report(leased, failure, request)
                if outcome is not None and outcome.jobs:
                    nxt = _Running(outcome.jobs[0])
            with self._cond:
                self._running.pop(leased.id, None)
                if nxt is not None:
                    if self._stop.is_set():
                        handback, nxt = nxt, None
                    else:
                        self._running[nxt.leased.id] = nxt
                        handback = None
                else:
                    handback = None
                self._cond.notify_all()
            if handback is not None:
                self._hand_back([handback.leased], "the worker is shutting down; handed back before it started")
            current = nxt

    def _run_one(self, running: _Running) -> Optional[Failure]:
        leased = running.leased
        done = threading.Event()
        ref: List[Job[Any]] = []
        if self.heartbeats:
            threading.Thread(
                target=self._heartbeat, args=(running, ref, done), name=f"lazaret-beat-{leased.id}", daemon=True
            ).start()
        try:
            return self.execute(leased, ref)
        finally:
            done.set()

    def _heartbeat(self, running: _Running, ref: List[Job[Any]], done: threading.Event) -> None:
        leased = running.leased
        while not done.wait(self.lease_ms / 3 / 1000):
            try:
                beat = self.client.heartbeat(leased.id, leased.lease_token, self.lease_ms)
                leased.lease_expires_at = beat.lease_expires_at
                if ref:
                    ref[0].lease_expires_at = beat.lease_expires_at
                    ref[0].cancel_requested = beat.cancel_requested
            except ApiError as e:
                if e.code in ("LEASE_LOST", "NOT_FOUND"):
                    log.warning("job %s: lease lost during the run; its result will be dropped", leased.id)
                    running.lost = True
                    return
                log.warning("job %s: heartbeat failed: %s", leased.id, e)
            except TransportError as e:
                log.warning("job %s: heartbeat failed: %s", leased.id, e)

    def _report(self, leased: LeasedJob, failure: Optional[Failure], nxt: Optional[LeaseRequest]) -> Optional[Outcome]:
        for attempt in range(REPORT_TRIES):
            try:
                if failure is None:
                    outcome = self.client.ack(leased.id, leased.lease_token, next=nxt)
                else:
                    outcome = self.client.fail(leased.id, leased.lease_token, failure, next=nxt)
            except ApiError as e:
                if e.is_lease_lost:
                    again = " (a resend: the first report may have landed)" if attempt else ""
                    log.warning("job %s: lease lost; outcome dropped%s", leased.id, again)
                    self._count("lease_lost", leased, failure, None)
                    return None
                if e.status >= 500 and attempt + 1 < REPORT_TRIES:
                    self._stop.wait(0.2 * 2**attempt)
                    continue
                log.error("job %s: could not report its outcome: %s", leased.id, e)
                self._count("not_reported", leased, failure, None)
                return None
            except TransportError as e:
                if attempt + 1 < REPORT_TRIES:
                    self._stop.wait(0.2 * 2**attempt)
                    continue
                log.error("job %s: could not report its outcome: %s", leased.id, e)
                self._count("not_reported", leased, failure, None)
                return None
            if outcome.next_error is not None:
                log.warning("job %s: reported; the next lease was refused: %s", leased.id, outcome.next_error)
            self._count("succeeded" if failure is None else "failed", leased, failure, outcome)
            return outcome
        return None

    def _hand_back(self, jobs: List[LeasedJob], message: str) -> None:
        """Fails jobs as deferred `shutdown`: leasable again after the
        hand-back delay, with no attempt spent."""
        if not jobs:
            return
        failure = self.handback_failure(message)
        try:
            results = self.client.fails([(j.id, j.lease_token, failure) for j in jobs])
        except (ApiError, TransportError) as e:
            log.warning("could not hand back %d job(s); their leases will expire: %s", len(jobs), e)
            for j in jobs:
                self._count("not_reported", j, failure, None)
            return
        for j, r in zip(jobs, results):
            if isinstance(r, ApiError):
                self._count("lease_lost" if r.is_lease_lost else "not_reported", j, failure, None)
            else:
                self._count("handed_back", j, failure, r)

    def handback_failure(self, message: str = "the worker is shutting down") -> Failure:
        """What a job handed back at shutdown is failed with: deferred, kind
        `shutdown`, after `handback_delay_ms`."""
        return Failure.deferred("shutdown", message, self.handback_delay_ms)

    def _count(self, what: str, leased: LeasedJob, failure: Optional[Failure], outcome: Optional[Outcome]) -> None:
        with self._report_lock:
            setattr(self.report, what, getattr(self.report, what) + 1)
            if what == "failed" and failure is not None:
                if failure.kind == "panic":
                    self.report.panicked += 1
                elif failure.kind == "parse" and failure.failure_class == "permanent":
                    self.report.parse_failed += 1
        if self.on_report is not None:
            try:
                self.on_report(leased, what, failure, outcome)
            except Exception:  # noqa: BLE001 - a watcher's bug must not stop the worker
                log.exception("on_report raised")


async def _await(awaitable: Any) -> Any:
    return await awaitable
