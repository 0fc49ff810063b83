#!/usr/bin/env python3
"""A lazaret worker in plain Python (standard library only).

    python3 examples/python_worker.py --server http://127.0.0.1:7433 \
        [--lanes a,b] [--types t1,t2] [--concurrency N] [--lease-ms MS] [--once]

It leases jobs (long-poll), runs the handler registered for the job's type,
and acks or fails each one with a classified error; a heartbeat thread keeps
each running job's lease alive. The protocol is in docs/workers.md.
A bearer token is read from LAZARET_TOKEN when set.
"""

import argparse, email.utils, json, logging, os, random, signal, socket
import threading, time, traceback, urllib.error, urllib.request

log = logging.getLogger("worker")


class Deferred(Exception):
    """Not now, and not the job's fault: retry after `retry_after_s` without spending an attempt."""

    def __init__(self, retry_after_s=None, kind="deferred", message="deferred"):
        super().__init__(message)
        self.retry_after_s, self.kind = retry_after_s, kind


# ---------------------------------------------------------------- handlers
# A handler gets the payload and the leased job, and returns (ack) or raises
# (fail; see classify; raise Deferred to ask for a later retry at no cost).
# It must be idempotent: a job can be delivered again after a crash or a lost
# ack, so key side effects by job["idempotency_key"] (or job["id"]).
HANDLERS = {}
_deferrals_seen = {}  # job id -> deferrals raised by this process (for the demo only)


def handler(job_type):
    def register(fn):
        HANDLERS[job_type] = fn
        return fn
    return register


@handler("echo")
def echo(payload, job):
    log.info("echo %s: %s", job["id"], json.dumps(payload))


@handler("flaky")
def flaky(payload, job):
    # {"fail_times": N} fails the first N attempts; without it, one time in three.
    n = payload.get("fail_times")
    if (job["attempt"] <= n) if n is not None else random.random() < 1 / 3:
        raise ConnectionError(f"downstream unreachable (attempt {job['attempt']})")


@handler("sleep")
def sleep(payload, job):
    time.sleep(payload.get("seconds", 1))  # long enough to need heartbeats


@handler("strict")
def strict(payload, job):
    payload["to"]  # a missing field: KeyError -> permanent, kind validation


@handler("rate_limited")
def rate_limited(payload, job):
    # {"defer_times": N, "retry_after_s": S}: the "downstream" answers 429 the first N times.
    seen = _deferrals_seen.get(job["id"], 0)
    if seen < payload.get("defer_times", 1):
        _deferrals_seen[job["id"]] = seen + 1
        headers = {"Retry-After": str(payload.get("retry_after_s", 1))}
        raise urllib.error.HTTPError("http://downstream/", 429, "Too Many Requests", headers, None)


# ---------------------------------------------------------------- classification
def retry_after_s(value):
    """A Retry-After header (seconds or an HTTP date) in seconds, or None."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def classify(exc):
    """The `error` object of /fail for an exception (without message and traceback)."""
    if isinstance(exc, Deferred):
        return {"class": "deferred", "kind": exc.kind, "retry_after_s": exc.retry_after_s}
    if isinstance(exc, urllib.error.HTTPError):  # before OSError: it is one
        kind, wait = f"http_{exc.code}", retry_after_s(exc.headers and exc.headers.get("Retry-After"))
        if exc.code == 429 or (exc.code == 503 and wait is not None):
            return {"class": "deferred", "kind": kind, "retry_after_s": wait}
        return {"class": "transient" if exc.code >= 500 or exc.code == 408 else "permanent", "kind": kind}
    if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError)):
        return {"class": "permanent", "kind": "parse"}
    if isinstance(exc, (ValueError, KeyError, TypeError)):
        return {"class": "permanent", "kind": "validation"}
    if isinstance(exc, TimeoutError):
        return {"class": "transient", "kind": "timeout"}
    if isinstance(exc, ConnectionError):
        return {"class": "transient", "kind": "connection"}
    if isinstance(exc, OSError):
        return {"class": "transient", "kind": "io"}
    # Unknown: no class, so the server's policy decides by kind (unknown kinds are transient).
    return {"kind": type(exc).__name__}


# ---------------------------------------------------------------- HTTP
class ApiError(Exception):
    def __init__(self, status, body):
        err = body.get("error", {}) if isinstance(body, dict) else {}
        super().__init__(f"HTTP {status} {err.get('code')}: {err.get('message')}")
        self.status, self.code = status, err.get("code")


def call(server, path, body, timeout=10.0):
    """POSTs JSON; returns the decoded reply or raises ApiError / OSError."""
    req = urllib.request.Request(server + path, json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    if os.environ.get("LAZARET_TOKEN"):
        req.add_header("Authorization", "Bearer " + os.environ["LAZARET_TOKEN"])
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        try:
            body = json.load(e)
        except ValueError:
            body = None
        raise ApiError(e.code, body) from None


# ---------------------------------------------------------------- the worker
class Worker:
    def __init__(self, args):
        self.server, self.once = args.server.rstrip("/"), args.once
        self.lanes = args.lanes.split(",") if args.lanes else None  # None: every lane
        # Lease only the types we have handlers for, so no other type is ever delivered here.
        self.types = args.types.split(",") if args.types else sorted(HANDLERS)
        unknown = set(self.types) - set(HANDLERS)
        if unknown:
            raise SystemExit(f"no handler for type(s) {', '.join(sorted(unknown))}")
        self.concurrency, self.lease_ms = args.concurrency, args.lease_ms
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}"
        self.stopping = threading.Event()
        self.idle = threading.Condition()
        self.running = 0

    def run(self):
        failures, status = 0, 0
        while not self.stopping.is_set():
            with self.idle:  # wait for a free slot
                while self.running >= self.concurrency and not self.stopping.is_set():
                    self.idle.wait(0.5)
                free = self.concurrency - self.running
            if self.stopping.is_set():
                break
            wait_ms = 2_000 if self.once else 5_000  # a long-poll also bounds how fast we stop
            try:
                jobs = call(self.server, "/v1/leases", {
                    "worker_id": self.worker_id, "lanes": self.lanes, "types": self.types,
                    "max_jobs": free, "lease_ms": self.lease_ms, "wait_ms": wait_ms,
                }, timeout=wait_ms / 1000 + 10)["jobs"]
                failures = 0
            except (ApiError, OSError) as e:
                failures += 1
                if self.once and failures >= 3:
                    log.error("lease failed 3 times (%s); giving up", e)
                    status = 1
                    break
                log.warning("lease failed (%s); retrying", e)
                self.stopping.wait(min(30, 2 ** failures) * random.uniform(0.5, 1))
                continue
            if self.stopping.is_set():
                self.hand_back(jobs)  # leased while we were asked to stop
                break
            if not jobs and self.once and self.running == 0:
                break
            for job in jobs:
                with self.idle:
                    self.running += 1
                threading.Thread(target=self.process, args=(job,), name=f"job-{job['id']}").start()
        log.info("stopped leasing; finishing %d running job(s)", self.running)
        with self.idle:
            while self.running:
                self.idle.wait()
        return status

    def process(self, job):
        done = threading.Event()
        threading.Thread(target=self.heartbeat, args=(job, done), daemon=True).start()
        outcome = None  # None: ack
        try:
            HANDLERS[job["type"]](job["payload"], job)
        except Exception as exc:
            outcome = classify(exc)
            outcome["message"] = f"{type(exc).__name__}: {exc}"[:4000]
            outcome["traceback"] = traceback.format_exc()
        finally:
            done.set()  # stops the heartbeats
        if job.get("lost"):
            log.warning("job %s: finished after its lease was lost; result dropped", job["id"])
        else:
            self.complete(job, outcome)
        with self.idle:
            self.running -= 1
            self.idle.notify_all()

    def complete(self, job, error):
        if error is None:
            path, body = f"/v1/jobs/{job['id']}/ack", {"lease_token": job["lease_token"]}
        else:
            wait = error.pop("retry_after_s", None)
            if wait is not None:
                error["retry_after_ms"] = int(wait * 1000)
            path, body = f"/v1/jobs/{job['id']}/fail", {"lease_token": job["lease_token"], "error": error}
        for attempt in range(3):  # only the network is retried; the server's answer is final
            try:
                reply = call(self.server, path, body)
                log.info("job %s (%s, attempt %s): %s", job["id"], job["type"], job["attempt"], reply)
                return
            except ApiError as e:
                if e.code == "LEASE_LOST":  # someone else holds the job now: drop it, never retry
                    again = " (a resend: the first report may have landed)" if attempt else ""
                    log.warning("job %s: lease lost; dropped%s", job["id"], again)
                else:
                    log.error("job %s: %s", job["id"], e)
                return
            except OSError as e:
                log.warning("job %s: could not report (%s)%s", job["id"], e, "; retrying" if attempt < 2 else "")
                time.sleep(0.5 * 2 ** attempt)
        # Given up: the lease will expire and the job will be delivered again.

    def heartbeat(self, job, done):
        while not done.wait(self.lease_ms / 3 / 1000):  # a third of the lease
            try:
                call(self.server, f"/v1/jobs/{job['id']}/heartbeat",
                     {"lease_token": job["lease_token"], "extend_ms": self.lease_ms})
            except ApiError as e:
                if e.code == "LEASE_LOST":
                    log.warning("job %s: lease lost during the run; its result will be dropped", job["id"])
                    job["lost"] = True
                    return
                log.warning("job %s: heartbeat: %s", job["id"], e)
            except OSError as e:
                log.warning("job %s: heartbeat: %s", job["id"], e)

    def hand_back(self, jobs):
        """Returns unstarted jobs as deferred: the next delivery spends no attempt."""
        if jobs:
            items = [{"id": j["id"], "lease_token": j["lease_token"], "error": {
                "class": "deferred", "kind": "shutdown", "message": "worker stopping", "retry_after_ms": 0}}
                for j in jobs]
            try:
                results = call(self.server, "/v1/fails", {"items": items})["results"]
                log.info("handed back %d job(s) unstarted: %s", len(jobs), results)
            except (ApiError, OSError) as e:
                log.warning("could not hand back %d job(s): their leases will expire (%s)", len(jobs), e)

    def stop(self, signum, _frame):
        if self.stopping.is_set():
            log.warning("second signal: exiting now; running leases will expire")
            os._exit(1)
        log.info("signal %d: stopping after the running jobs", signum)
        self.stopping.set()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="e.g. http://127.0.0.1:7433")
    p.add_argument("--lanes", help="comma-separated lanes (default: every lane)")
    p.add_argument("--types", help="comma-separated job types (default: every type with a handler)")
    p.add_argument("--concurrency", type=int, default=1, help="jobs run at once")
    p.add_argument("--lease-ms", type=int, default=30_000, help="lease length; heartbeats every third")
    p.add_argument("--once", action="store_true", help="exit once a lease finds nothing to do")
    args = p.parse_args()
    if args.concurrency < 1 or args.lease_ms < 3:
        p.error("--concurrency must be at least 1 and --lease-ms at least 3")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(message)s")
    worker = Worker(args)
    signal.signal(signal.SIGTERM, worker.stop)
    signal.signal(signal.SIGINT, worker.stop)
    raise SystemExit(worker.run())


if __name__ == "__main__":
    main()
