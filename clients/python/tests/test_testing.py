"""The test mode (lazaret.testing), used as a user's unit test would."""

from __future__ import annotations

import unittest
from typing import Any, List

from lazaret import ApiError, Client, Failure, NewJob, Worker
from lazaret.testing import FakeClient, drain, run_job


def signup(client: Any, email: str) -> None:
    """The code under test: enqueues a welcome e-mail, once per address."""
    client.enqueue("send_email", "acme", {"to": email}, idempotency_key=f"welcome-{email}")


def build_worker(sent: List[str], client: Any) -> Worker:
    worker = Worker(Client("http://127.0.0.1:9"))

    @worker.handler("send_email", parse=lambda p: str(p["to"]))
    def send_email(job: Any) -> None:
        if "@" not in job.payload:
            raise Failure.permanent("validation", f"no @ in {job.payload}")
        sent.append(job.payload)
        client.enqueue("audit", "acme", {"sent": job.payload})

    @worker.handler("audit")
    def audit(job: Any) -> None:
        pass

    return worker


class TestMode(unittest.TestCase):
    def test_enqueues_are_recorded_and_deduplicated(self) -> None:
        fake = FakeClient()
        signup(fake, "ada@example.com")
        signup(fake, "ada@example.com")
        job = fake.assert_enqueued("send_email", tenant="acme", payload={"to": "ada@example.com"}, count=1)
        self.assertEqual(job.idempotency_key, "welcome-ada@example.com")
        again = fake.enqueue("send_email", "acme", {}, idempotency_key="welcome-ada@example.com")
        self.assertEqual(again.admission, "DUPLICATE")
        with self.assertRaises(AssertionError):
            fake.assert_enqueued("send_email", payload={"to": "bob@example.com"})
        results = fake.enqueue_batch([NewJob("send_email", "acme", {"to": "b@x"}), NewJob("send_email", "", {})])
        self.assertEqual(results[0].admission, "ADMITTED")  # type: ignore[union-attr]
        self.assertEqual(results[1].code, "NO_TENANT")  # type: ignore[union-attr]

    def test_a_traceparent_is_checked_as_the_server_does_and_reaches_the_handler(self) -> None:
        fake = FakeClient()
        tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        fake.enqueue("trace", "acme", {}, traceparent=" " + tp)
        self.assertEqual(fake.jobs("trace")[0].traceparent, tp)
        for bad in ("00-0000", tp.upper(), "00-" + "0" * 32 + tp[35:], tp[:36] + "0" * 16 + tp[52:]):
            with self.assertRaises(ApiError) as e:
                fake.enqueue("trace", "acme", {}, traceparent=bad)
            self.assertEqual((e.exception.code, e.exception.status), ("BAD_REQUEST", 400), bad)
        seen: List[Any] = []
        worker = Worker(Client("http://127.0.0.1:9"))

        @worker.handler("trace")
        def handle(job: Any) -> None:
            seen.append(job.traceparent)

        drain(fake, worker)
        self.assertEqual(seen, [tp])

    def test_drain_runs_jobs_through_the_workers_handlers(self) -> None:
        fake = FakeClient()
        sent: List[str] = []
        worker = build_worker(sent, fake)
        signup(fake, "ada@example.com")
        signup(fake, "no-at-sign")
        fake.enqueue("send_email", "acme", {"oops": 1})
        ran = drain(fake, worker)
        self.assertEqual(sent, ["ada@example.com"])
        by = [(r.job.type, r.failure.failure_class if r.failure else None, r.failure.kind if r.failure else None) for r in ran]
        self.assertEqual(by, [
            ("send_email", None, None),
            ("send_email", "permanent", "validation"),
            ("send_email", "permanent", "parse"),
            ("audit", None, None),  # enqueued by a handler, drained too
        ])
        self.assertEqual(fake.jobs(), [])

    def test_run_job_classifies_like_the_worker(self) -> None:
        worker = build_worker([], FakeClient())
        self.assertTrue(run_job(worker, "send_email", {"to": "a@b"}).ok)
        r = run_job(worker, "send_email", {"to": "nobody"})
        assert r.failure is not None
        self.assertEqual((r.failure.failure_class, r.failure.kind), ("permanent", "validation"))
        r = run_job(worker, "unknown", {})
        assert r.failure is not None
        self.assertEqual((r.failure.failure_class, r.failure.kind), ("transient", "no_handler"))


if __name__ == "__main__":
    unittest.main()
