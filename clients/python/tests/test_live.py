"""Against a real `lazaret serve` ($LAZARET_BIN; skipped with a message
when it is unset, failing under CI=true): enqueue one and batch with
idempotency keys, lease, heartbeat, ack, fail, `next`, batched outcomes,
the Worker end to end, and a graceful shutdown on SIGTERM of
examples/python_worker_package.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
from email.message import Message
from typing import Any, Dict, List, Optional

from lazaret import ApiError, Client, Failure, LeaseRequest, NewJob, Worker
from lazaret.client import Reply, urllib_transport
from lazaret.aio import AsyncClient

from .support import REPO, ServerTest, eventually


class Live(ServerTest):
    def client(self) -> Client:
        return Client(self.server.url, timeout=10)

    def test_enqueue_one_and_batch_with_idempotency_keys(self) -> None:
        c = self.client()
        first = c.enqueue("py-idem", "acme", {"n": 1}, idempotency_key="order-1", lane="interactive")
        self.assertEqual((first.state, first.admission), ("queued", "ADMITTED"))
        again = c.enqueue("py-idem", "acme", {"n": 2}, idempotency_key="order-1", lane="interactive")
        self.assertEqual((again.id, again.admission), (first.id, "DUPLICATE"))
        later = c.enqueue("py-idem", "acme", None, delay_ms=60_000)
        self.assertEqual(later.state, "scheduled")
        results = c.enqueue_batch([
            NewJob("py-idem", "acme", {"n": 3}, idempotency_key="order-2"),
            NewJob("py-idem", "", {"n": 4}),
            NewJob("py-idem", "acme", {"n": 5}, idempotency_key="order-2"),
        ])
        self.assertEqual(results[0].admission, "ADMITTED")  # type: ignore[union-attr]
        self.assertIsInstance(results[1], ApiError)
        self.assertEqual(results[1].code, "NO_TENANT")  # type: ignore[union-attr]
        self.assertEqual((results[2].id, results[2].admission), (results[0].id, "DUPLICATE"))  # type: ignore[union-attr]
        job = c.job(first.id)
        self.assertEqual((job["payload"], job["idempotency_key"], job["lane"]), ({"n": 1}, "order-1", "interactive"))
        with self.assertRaises(ApiError) as e:
            c.enqueue("py-idem", "", {})
        self.assertEqual((e.exception.code, e.exception.status), ("NO_TENANT", 400))
        aio = asyncio.run(AsyncClient(c).enqueue("py-idem", "acme", {"n": 6}))
        self.assertEqual(aio.admission, "ADMITTED")

    def test_a_traceparent_goes_from_the_enqueue_to_the_leased_job_and_the_handler(self) -> None:
        c = self.client()
        t = "py-trace"
        tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        traced = c.enqueue(t, "acme", {"n": 1}, traceparent=tp)
        [batched] = c.enqueue_batch([NewJob(t, "acme", {"n": 2}, traceparent=tp)])
        c.enqueue(t, "acme", {"n": 3})
        with self.assertRaises(ApiError) as e:
            c.enqueue(t, "acme", {}, traceparent="00-0000")
        self.assertEqual((e.exception.code, e.exception.status), ("BAD_REQUEST", 400))
        self.assertIn("traceparent", e.exception.message)
        self.assertEqual(c.job(traced.id)["traceparent"], tp)
        jobs = c.lease(LeaseRequest("py-w", None, [t], 3, 5000, 5000))
        by_id = {j.id: j.traceparent for j in jobs}
        self.assertEqual(len(by_id), 3, jobs)
        self.assertEqual(by_id.pop(traced.id), tp)
        self.assertEqual(by_id.pop(batched.id), tp)  # type: ignore[union-attr]
        self.assertEqual(list(by_id.values()), [None])
        c.acks([(j.id, j.lease_token) for j in jobs])
        # A handler sees it on its job.
        again = c.enqueue(t, "acme", {"n": 4}, traceparent=tp)
        seen: List[Optional[str]] = []
        worker = Worker(c, worker_id="py-trace-w")

        @worker.handler(t)
        def handle(job: Any) -> None:
            seen.append(job.traceparent)

        [leased] = c.lease(LeaseRequest("py-trace-w", None, [t], 1, 5000, 5000))
        self.assertEqual(leased.id, again.id)
        self.assertIsNone(worker.execute(leased))
        self.assertEqual(seen, [tp])

    def test_lease_heartbeat_fail_ack_next_and_batched_outcomes(self) -> None:
        c = self.client()
        t = "py-proto"
        a = c.enqueue(t, "acme", {"job": "a"})
        [job] = c.lease(LeaseRequest("py-w", None, [t], 1, 5000, 5000))
        self.assertEqual((job.id, job.attempt, job.payload), (a.id, 1, {"job": "a"}))
        beat = c.heartbeat(job.id, job.lease_token, 60_000)
        self.assertGreater(beat.lease_expires_at, job.lease_expires_at)
        self.assertFalse(beat.cancel_requested)
        out = c.fail(job.id, job.lease_token, Failure.transient("http_503", "upstream down"))
        self.assertEqual((out.state, out.fields["attempt"]), ("scheduled", 1))
        [job] = c.lease(worker_id="py-w", types=[t], wait_ms=5000)
        self.assertEqual((job.id, job.attempt), (a.id, 2))
        b = c.enqueue(t, "acme", {"job": "b"})
        out = c.ack(job.id, job.lease_token, next=LeaseRequest("py-w", None, [t], 1, 5000, 5000))
        self.assertEqual(out.state, "succeeded")
        self.assertEqual([j.id for j in out.jobs], [b.id])
        nb = out.jobs[0]
        out = c.fail(nb.id, nb.lease_token, Failure.permanent("validation", "bad"))
        self.assertEqual((out.state, out.fields["reason"]), ("dead_lettered", "permanent"))
        with self.assertRaises(ApiError) as e:
            c.ack(nb.id, nb.lease_token)
        self.assertTrue(e.exception.is_lease_lost)
        self.assertEqual(c.job(a.id)["state"], "succeeded")
        # Batched outcomes: one result per item, in order.
        ids = [c.enqueue(t, "acme", {"job": n}).id for n in ("c", "d")]
        jobs = c.lease(worker_id="py-w", types=[t], max_jobs=2, wait_ms=5000)
        self.assertEqual(sorted(j.id for j in jobs), sorted(ids))
        acked = c.acks([(jobs[0].id, jobs[0].lease_token), ("999999999", "1")])
        self.assertEqual(acked[0].state, "succeeded")  # type: ignore[union-attr]
        self.assertEqual(acked[1].code, "NOT_FOUND")  # type: ignore[union-attr]
        failed = c.fails([(jobs[1].id, jobs[1].lease_token, Failure.deferred("http_429", "slow down", 10))])
        self.assertEqual((failed[0].state, failed[0].fields.get("deferred")), ("scheduled", True))  # type: ignore[union-attr]

    def test_worker_runs_handlers_and_reports_classified_outcomes(self) -> None:
        via_next: List[str] = []

        def transport(method: str, url: str, headers: Dict[str, str], body: Optional[bytes], timeout: float) -> Reply:
            reply = urllib_transport(method, url, headers, body, timeout)
            if body and b'"next"' in body and reply[0] == 200:
                via_next.extend(j["id"] for j in json.loads(reply[2]).get("jobs", []))
            return reply

        c = Client(self.server.url, timeout=10, transport=transport)
        seen: Dict[str, int] = {}
        worker = Worker(c, worker_id="py-e2e", concurrency=3, lease_ms=3000, poll_wait_ms=200, shutdown_grace_s=5)

        @worker.handler("py-ok")
        def ok(job: Any) -> None:
            seen[job.id] = job.attempt

        @worker.handler("py-flaky")
        def flaky(job: Any) -> None:
            if job.attempt == 1:
                raise ConnectionResetError("reset by peer")

        @worker.handler("py-bad")
        def bad(job: Any) -> None:
            raise Failure.permanent("validation", "no @ in the address")

        @worker.handler("py-parse", parse=lambda p: int(p["n"]))
        def parse(job: Any) -> None:
            pass

        @worker.handler("py-panic")
        def panic(job: Any) -> None:
            raise RuntimeError("boom 42")

        @worker.handler("py-defer")
        def defer(job: Any) -> None:
            if job.id not in seen:
                seen[job.id] = 0
                headers = Message()
                headers["Retry-After"] = "0"
                raise urllib.error.HTTPError("http://downstream.invalid/", 429, "Too Many", headers, None)

        @worker.handler("py-async")
        async def coroutine(job: Any) -> None:
            await asyncio.sleep(0.01)

        ids = {t: c.enqueue(t, "acme", p).id for t, p in [
            ("py-ok", {}), ("py-flaky", {}), ("py-bad", {}), ("py-parse", {"n": "x"}),
            ("py-panic", {}), ("py-defer", {}), ("py-async", {})]}
        run = threading.Thread(target=worker.run_until_stopped)
        run.start()
        try:
            final = ("succeeded", "dead_lettered")
            jobs: Dict[str, Dict[str, Any]] = eventually(
                lambda: (lambda js: js if all(j["state"] in final for j in js.values()) else None)(
                    {t: c.job(i) for t, i in ids.items()}),
                "every job to finish")
        finally:
            worker.stop()
            run.join(30)
        self.assertFalse(run.is_alive())

        def last_error(t: str) -> Dict[str, Any]:
            errors: List[Dict[str, Any]] = [h["error"] for h in jobs[t]["history"] if h.get("error")]
            return errors[-1]

        self.assertEqual(jobs["py-ok"]["state"], "succeeded")
        self.assertEqual((jobs["py-flaky"]["state"], jobs["py-flaky"]["attempt"]), ("succeeded", 2))
        self.assertEqual((last_error("py-flaky")["class"], last_error("py-flaky")["kind"]), ("transient", "io"))
        self.assertEqual(jobs["py-bad"]["state"], "dead_lettered")
        self.assertEqual((last_error("py-bad")["class"], last_error("py-bad")["kind"]), ("permanent", "validation"))
        self.assertEqual((last_error("py-parse")["class"], last_error("py-parse")["kind"]), ("permanent", "parse"))
        self.assertEqual(jobs["py-panic"]["state"], "dead_lettered")  # transient, its 3 attempts spent
        self.assertEqual(jobs["py-panic"]["attempt"], 3)
        self.assertEqual(last_error("py-panic")["kind"], "panic")
        self.assertIn("boom 42", last_error("py-panic")["message"])
        self.assertIn("RuntimeError", last_error("py-panic")["traceback"])
        self.assertEqual((jobs["py-defer"]["state"], jobs["py-defer"]["attempt"], jobs["py-defer"]["deferrals"]),
                         ("succeeded", 1, 1))
        self.assertEqual(jobs["py-async"]["state"], "succeeded")
        self.assertTrue(via_next, "some jobs came in the reply to an ack or fail (next)")
        r = worker.report
        self.assertEqual((r.succeeded, r.panicked, r.parse_failed, r.lease_lost, r.not_reported), (4, 3, 1, 0, 0))
        self.assertEqual(r.failed, 1 + 1 + 1 + 3 + 1)  # flaky, bad, parse, panic x3, defer

    def example(self, *args: str) -> "subprocess.Popen[str]":
        return subprocess.Popen(
            [sys.executable, str(REPO / "examples" / "python_worker_package.py"), "--server", self.server.url,
             "--lease-ms", "3000", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ))

    def sigterm_once_started(self, job_id: str, *args: str) -> str:
        """Runs the example until its handler started `job_id`, sends SIGTERM,
        and returns its output once it exited 0."""
        proc = self.example(*args)
        lines: List[str] = []
        stdout = proc.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: lines.extend(iter(stdout.readline, "")), daemon=True)
        reader.start()
        try:
            eventually(lambda: any(f"sleep {job_id}: started" in line for line in list(lines)), "the handler to start")
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
            reader.join(10)
        finally:
            if proc.poll() is None:
                proc.kill()
            stdout.close()
        out = "".join(lines)
        self.assertEqual(proc.returncode, 0, out)
        return out

    def test_sigterm_lets_the_running_job_finish(self) -> None:
        c = self.client()
        job = c.enqueue("sleep", "acme", {"seconds": 1.5})
        out = self.sigterm_once_started(job.id)
        self.assertIn("stopped: RunReport(succeeded=1", out)
        self.assertEqual(c.job(job.id)["state"], "succeeded")

    def test_sigterm_hands_back_what_the_grace_did_not_finish(self) -> None:
        c = self.client()
        job = c.enqueue("sleep", "globex", {"seconds": 60})
        out = self.sigterm_once_started(job.id, "--shutdown-grace-s", "0.2")
        self.assertIn("handed_back=1", out)
        info = c.job(job.id)
        self.assertIn(info["state"], ("scheduled", "queued"))
        self.assertEqual((info["attempt"], info["deferrals"]), (0, 1))  # no attempt spent
        last = info["history"][-1]
        self.assertEqual((last["outcome"], last["error"]["kind"], last["error"]["class"]), ("deferred", "shutdown", "deferred"))
        c.cancel(job.id)
