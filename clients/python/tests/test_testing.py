"""The test mode (lazaret.testing), used as a user's unit test would."""

from __future__ import annotations

import unittest
from typing import Any, List

from lazaret import Client, Failure, NewJob, Worker
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
