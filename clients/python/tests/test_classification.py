"""The shared classification table (clients/classification-cases.json),
run through the worker's own path: each case's error is raised by a
handler and `Worker.execute` classifies it."""

from __future__ import annotations

import asyncio
import email.utils
import errno
import socket
import unittest
import urllib.error
import urllib.request
from email.message import Message
from typing import Any, Dict, Optional

from lazaret import Client, Failure, LeasedJob, Worker

from .support import CASES, load_json

IO_ERRORS = {
    "timed_out": lambda: TimeoutError(errno.ETIMEDOUT, "timed out"),
    "connection_reset": lambda: ConnectionResetError(errno.ECONNRESET, "connection reset by peer"),
    "connection_refused": lambda: ConnectionRefusedError(errno.ECONNREFUSED, "connection refused"),
    "broken_pipe": lambda: BrokenPipeError(errno.EPIPE, "broken pipe"),
    "not_found": lambda: FileNotFoundError(errno.ENOENT, "no such file", "/nonexistent"),
    "permission_denied": lambda: PermissionError(errno.EACCES, "permission denied", "/root"),
}


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port: int = s.getsockname()[1]
    s.close()
    return port


def leased(job_type: str, payload: Any = None) -> LeasedJob:
    return LeasedJob("1", job_type, "acme", "default", payload, 1, "7", "", "")


def worker() -> Worker:
    return Worker(Client("http://127.0.0.1:9"))


def run_raising(exc_factory: Any) -> Optional[Failure]:
    w = worker()

    def handler(job: Any) -> None:
        raise exc_factory()

    w.handle("t", handler)
    return w.execute(leased("t"))


def http_error(status: int, retry_after: Optional[str]) -> urllib.error.HTTPError:
    headers = Message()
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return urllib.error.HTTPError("http://downstream.invalid/x", status, "status", headers, None)


def classify_case(raise_: Dict[str, Any]) -> Optional[Failure]:
    (what, arg), = raise_.items()
    if what == "failure":
        return run_raising(lambda: Failure(arg["class"], arg["kind"], arg["message"], retry_after_ms=arg.get("retry_after_ms")))
    if what == "http_status":
        now = email.utils.parsedate_to_datetime(arg["now"]) if "now" in arg else None
        direct = Failure.from_status(arg["status"], arg.get("retry_after"), "x", now=now)
        if direct is not None and now is None:
            # The same, raised from a handler as urllib raises it.
            raised = run_raising(lambda: http_error(arg["status"], arg.get("retry_after")))
            assert raised is not None
            assert (raised.failure_class, raised.kind, raised.retry_after_ms) == (
                direct.failure_class, direct.kind, direct.retry_after_ms), (raised, direct)
        return direct
    if what == "io":
        return run_raising(IO_ERRORS[arg])
    if what == "timeout":
        w = worker()

        async def slow(job: Any) -> None:
            await asyncio.wait_for(asyncio.sleep(10), 0.001)

        w.handle("t", slow)
        return w.execute(leased("t"))
    if what == "http_client_connect_refused":
        w = worker()

        def call(job: Any) -> None:
            urllib.request.urlopen(f"http://127.0.0.1:{closed_port()}/", timeout=5)

        w.handle("t", call)
        return w.execute(leased("t"))
    if what == "parse":
        w = worker()

        def parse(payload: Any) -> str:
            if not isinstance(payload["to"], str):
                raise TypeError(f"to is {type(payload['to']).__name__}, not a string")
            return payload["to"]

        w.handle("t", lambda job: None, parse=parse)
        import json
        return w.execute(leased("t", json.loads(arg)))
    if what == "panic":
        return run_raising(lambda: RuntimeError(arg))
    if what == "no_handler":
        w = worker()
        w.handle("t", lambda job: None)
        return w.execute(leased(arg))
    if what == "shutdown":
        return worker().handback_failure()
    raise AssertionError(f"the cases file has a raise kind this test does not know: {what}")


class ClassificationCases(unittest.TestCase):
    def test_every_shared_case(self) -> None:
        cases = load_json(CASES)["cases"]
        self.assertGreater(len(cases), 30)
        for case in cases:
            with self.subTest(case["name"]):
                got = classify_case(case["raise"])
                want = case["expect"]
                if want is None:
                    self.assertIsNone(got)
                    continue
                assert got is not None
                self.assertEqual(
                    (got.failure_class, got.kind, got.retry_after_ms),
                    (want["class"], want["kind"], want["retry_after_ms"]),
                )
                if "message_contains" in want:
                    self.assertIn(want["message_contains"], got.message)
                if want.get("traceback"):
                    self.assertTrue(got.traceback, "a traceback is sent")
                wire = got.to_wire()
                self.assertEqual(wire["class"], want["class"])
                self.assertEqual(wire["kind"], want["kind"])
                self.assertEqual(wire.get("retry_after_ms"), want["retry_after_ms"])

    def test_long_messages_and_tracebacks_are_cut_to_the_servers_caps(self) -> None:
        f = Failure.transient("x", "é" * 10_000).with_traceback_text("frame\n" * 100_000)
        wire = f.to_wire()
        self.assertLessEqual(len(wire["message"].encode()), 4096 + 64)
        self.assertLessEqual(len(wire["traceback"].encode()), 16384 + 64)
        self.assertIn("truncated", wire["traceback"])


if __name__ == "__main__":
    unittest.main()
