#!/usr/bin/env python3
"""A lazaret worker built on the Python package (clients/python):

    pip install ./clients/python
    python3 examples/python_worker_package.py --server http://127.0.0.1:7433 [--concurrency N]

The same handlers as examples/python_worker.py (which needs nothing but
the standard library), with the package doing the protocol: leasing,
heartbeats, classification of a handler's exception (as the Rust SDK
does), `next`, and a graceful shutdown on SIGTERM or Ctrl-C. A bearer
token is read from LAZARET_TOKEN when set.
"""

import argparse
import json
import logging
import sys
import time
import urllib.error
from email.message import Message

from lazaret import Client, Failure, Job, Worker


def build(worker: Worker) -> Worker:
    @worker.handler("echo")
    def echo(job: Job) -> None:
        logging.info("echo %s: %s", job.id, json.dumps(job.payload))

    @worker.handler("flaky")
    def flaky(job: Job) -> None:
        # {"fail_times": N} fails the first N attempts: transient, kind `io`.
        if job.attempt <= job.payload.get("fail_times", 1):
            raise ConnectionError(f"downstream unreachable (attempt {job.attempt})")

    @worker.handler("sleep")
    def sleep(job: Job) -> None:
        logging.info("sleep %s: started, %s s", job.id, job.payload.get("seconds", 1))
        deadline = time.monotonic() + job.payload.get("seconds", 1)
        while time.monotonic() < deadline and not job.cancel_requested:
            time.sleep(0.05)  # long enough to need heartbeats

    # A payload without "to" never parses: permanent, kind `parse`.
    @worker.handler("strict", parse=lambda p: {"to": str(p["to"])})
    def strict(job: Job) -> None:
        if "@" not in job.payload["to"]:
            raise Failure.permanent("validation", f"no @ in {job.payload['to']!r}")

    @worker.handler("rate_limited")
    def rate_limited(job: Job) -> None:
        # The "downstream" answers 429 with Retry-After: deferred, no attempt spent.
        headers = Message()
        headers["Retry-After"] = str(job.payload.get("retry_after_s", 1))
        raise urllib.error.HTTPError("http://downstream.invalid/", 429, "Too Many Requests", headers, None)

    return worker


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="e.g. http://127.0.0.1:7433")
    p.add_argument("--lanes", help="comma-separated lanes (default: every lane)")
    p.add_argument("--concurrency", type=int, default=1, help="jobs run at once")
    p.add_argument("--lease-ms", type=int, default=30_000, help="lease length; heartbeats every third")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0, help="how long running jobs may finish after SIGTERM")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")
    worker = Worker(
        Client(args.server),
        lanes=args.lanes.split(",") if args.lanes else None,
        concurrency=args.concurrency,
        lease_ms=args.lease_ms,
        poll_wait_ms=1000,
        shutdown_grace_s=args.shutdown_grace_s,
    )
    report = build(worker).run()  # until SIGTERM or Ctrl-C
    print(f"stopped: {report}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
