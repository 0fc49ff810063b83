"""Producers and workers for lazaret, over its HTTP API, with the standard
library only.

- `Client`: enqueue one job or a batch (idempotency keys), and the worker
  calls (lease, heartbeat, ack, fail, `next`, batched acks and fails);
  errors are `ApiError` with the API's code (`LEASE_LOST`, `SHED`, ...).
- `Worker`: handlers per type, threads, heartbeats, a handler's exception
  classified into class and kind as the Rust SDK does (`classify`), and a
  graceful shutdown on SIGTERM/SIGINT.
- `lazaret.testing`: a fake client and `drain` for your unit tests.
- `lazaret.aio`: `AsyncClient`, the same calls as coroutines.
"""

from .client import OPERATIONS, Client, Enqueued, Heartbeat, LeasedJob, LeaseRequest, NewJob, Outcome
from .errors import ApiError, LazaretError, TransportError
from .failure import Failure, FailureClass, classify, parse_retry_after
from .worker import Job, RunReport, Worker, WorkerError

__all__ = [
    "OPERATIONS",
    "ApiError",
    "Client",
    "Enqueued",
    "Failure",
    "FailureClass",
    "Heartbeat",
    "Job",
    "LazaretError",
    "LeaseRequest",
    "LeasedJob",
    "NewJob",
    "Outcome",
    "RunReport",
    "TransportError",
    "Worker",
    "WorkerError",
    "classify",
    "parse_retry_after",
]
__version__ = "0.1.0"
