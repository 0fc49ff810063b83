"""Shared by the tests: the repository's files, and a real `lazaret serve`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import unittest
from pathlib import Path
from typing import Any, Callable, Dict, Optional

REPO = Path(__file__).resolve().parents[3]
CASES = REPO / "clients" / "classification-cases.json"
OPENAPI = REPO / "docs" / "openapi.json"

#: Short backoffs so retried jobs come back at once.
CONFIG = """
[defaults]
attempts_max = 3
backoff_base_ms = 20
backoff_cap_ms = 100
"""


def load_json(path: Path) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        doc: Dict[str, Any] = json.load(f)
    return doc


def server_bin() -> Optional[str]:
    """`$LAZARET_BIN`, or None after a visible skip message; under CI=true a
    missing binary fails instead of skipping."""
    path = os.environ.get("LAZARET_BIN")
    if path and os.access(path, os.X_OK):
        return path
    why = f"LAZARET_BIN={path!r} is not an executable" if path else "LAZARET_BIN is not set"
    if os.environ.get("CI") == "true":
        raise AssertionError(f"{why}: these tests need the lazaret binary (cargo build -p lazaret) under CI=true")
    print(f"\nSKIPPED: {why}; the tests against a real server need the lazaret binary (set LAZARET_BIN)", flush=True)
    return None


class Server:
    """`lazaret serve` on a free loopback port with a temporary data directory."""

    def __init__(self, binary: str, config: str = CONFIG) -> None:
        self.dir = tempfile.mkdtemp(prefix="lazaret-py-")
        cfg = os.path.join(self.dir, "lazaret.toml")
        with open(cfg, "w", encoding="utf-8") as f:
            f.write(config)
        self.log = open(os.path.join(self.dir, "server.log"), "wb")
        self.proc = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", "--data", os.path.join(self.dir, "data"), "--config", cfg],
            stdout=subprocess.PIPE,
            stderr=self.log,
        )
        assert self.proc.stdout is not None
        first = self.proc.stdout.readline().decode().strip()
        prefix = "lazaret listening on "
        if not first.startswith(prefix):
            self.close()
            raise AssertionError(f"unexpected first line from lazaret serve: {first!r}")
        self.url = first[len(prefix):]
        # Keep reading stdout so the server never writes into a full pipe.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class ServerTest(unittest.TestCase):
    """A test class with one server for all its tests (skipped without LAZARET_BIN)."""

    server: Server

    @classmethod
    def setUpClass(cls) -> None:
        binary = server_bin()
        if binary is None:
            raise unittest.SkipTest("LAZARET_BIN is not set")
        cls.server = Server(binary)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.server.close()


def eventually(check: Callable[[], Any], what: str, seconds: float = 20.0) -> Any:
    """Polls `check` until it returns something truthy; fails after `seconds`
    (a bound on a broken run, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {seconds} s for {what}")
        time.sleep(0.02)
