"""The client checked against the server's OpenAPI document
(docs/openapi.json): every operation it calls exists there with that
method, and every field of every body it sends is a property the
document's schema for that body names (recursively: `next`, `error`,
`items`, `jobs`)."""

from __future__ import annotations

import json
import re
import unittest
from typing import Any, Dict, List, Mapping, Optional, Tuple

from lazaret import OPERATIONS, Client, Failure, LeaseRequest, NewJob

from .support import OPENAPI, load_json

LEASED = {"id": "1", "type": "t", "tenant": "a", "lane": "default", "payload": {}, "attempt": 1,
          "idempotency_key": None, "schema_version": None, "lease_token": "9",
          "lease_expires_at": "2026-01-01T00:00:00.000Z", "created_at": "2026-01-01T00:00:00.000Z"}

#: A canned 2xx reply per operation, enough for the client to decode.
REPLIES: Dict[str, Any] = {
    "enqueue": {"id": "1", "state": "queued", "admission": "ADMITTED"},
    "enqueue_batch": {"results": [{"id": "1", "state": "queued", "admission": "ADMITTED"}]},
    "job": {"id": "1", "state": "queued"},
    "cancel": {"state": "cancelled"},
    "lease": {"jobs": [LEASED]},
    "ack": {"state": "succeeded", "jobs": [LEASED]},
    "fail": {"state": "scheduled", "retry_at": "2026-01-01T00:00:00.000Z", "attempt": 1, "jobs": []},
    "heartbeat": {"lease_expires_at": "2026-01-01T00:00:00.000Z", "cancel_requested": False},
    "acks": {"results": [{"state": "succeeded"}]},
    "fails": {"results": [{"state": "scheduled"}]},
}


class Recorder:
    """A transport that records each request and answers the canned reply."""

    def __init__(self) -> None:
        self.sent: List[Tuple[str, str, Optional[Any]]] = []

    def __call__(
        self, method: str, url: str, headers: Dict[str, str], body: Optional[bytes], timeout: float
    ) -> Tuple[int, Dict[str, str], bytes]:
        path = url.split("://", 1)[1].split("/", 1)[1]
        path = "/" + path
        self.sent.append((method, path, json.loads(body) if body else None))
        for name, (m, template) in OPERATIONS.items():
            if m == method and re.fullmatch(template.replace("{id}", "[^/]+"), path):
                return 200, {}, json.dumps(REPLIES[name]).encode()
        raise AssertionError(f"the client sent {method} {path}, which is not in OPERATIONS")


def exercise(client: Client) -> None:
    """Calls every method of the client with every optional field set."""
    nxt = LeaseRequest("w", ["default"], ["t"], 2, 30000, 100)
    client.enqueue("t", "a", {"x": 1}, lane="l", idempotency_key="k", schema_version=1, delay_ms=5,
                   traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    client.enqueue_batch([NewJob("t", "a", 1, "l", "k", 2, 3, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"), NewJob("t", "b", None)])
    client.job("1")
    client.cancel("1")
    client.lease(nxt)
    client.ack("1", "9", next=nxt)
    failure = Failure.deferred("http_429", "m", 10).with_traceback_text("tb")
    client.fail("1", "9", failure, next=nxt)
    client.heartbeat("1", "9", 1000)
    client.acks([("1", "9")])
    client.fails([("1", "9", failure)])


def resolve(doc: Mapping[str, Any], schema: Mapping[str, Any]) -> Mapping[str, Any]:
    while "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        schema = doc["components"]["schemas"][name]
    return schema


def check_fields(doc: Mapping[str, Any], schema: Mapping[str, Any], value: Any, where: str) -> None:
    """Fails unless every key of `value` is named by `schema` (and so on down)."""
    schema = resolve(doc, schema)
    if "anyOf" in schema:
        options = [resolve(doc, s) for s in schema["anyOf"]]
        if value is None:
            return
        objects = [s for s in options if "properties" in s or s.get("type") in ("object", "array")]
        assert objects, f"{where}: no schema in anyOf takes {value!r}"
        return check_fields(doc, objects[0], value, where)
    if isinstance(value, dict) and "properties" in schema:
        props = schema["properties"]
        for key, sub in value.items():
            assert key in props, f"{where}: field {key!r} is not in the document's schema (it has {sorted(props)})"
            check_fields(doc, props[key], sub, f"{where}.{key}")
        for key in schema.get("required", []):
            assert key in value, f"{where}: the document requires {key!r}"
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            check_fields(doc, schema["items"], item, f"{where}[{i}]")


class OpenApi(unittest.TestCase):
    doc: Dict[str, Any]

    @classmethod
    def setUpClass(cls) -> None:
        cls.doc = load_json(OPENAPI)

    def test_every_operation_is_in_the_document(self) -> None:
        for name, (method, template) in OPERATIONS.items():
            with self.subTest(name):
                self.assertIn(template, self.doc["paths"], f"{name}: {template} is not a path of docs/openapi.json")
                self.assertIn(method.lower(), self.doc["paths"][template], f"{name}: {template} takes no {method}")

    def test_every_request_sent_matches_the_documents_schema(self) -> None:
        rec = Recorder()
        exercise(Client("http://127.0.0.1:7433", transport=rec))
        called = set()
        for method, path, body in rec.sent:
            template = next(t for m, t in OPERATIONS.values()
                            if m == method and re.fullmatch(t.replace("{id}", "[^/]+"), path))
            called.add((method, template))
            op = self.doc["paths"][template][method.lower()]
            if body is None:
                self.assertNotIn("requestBody", op, f"{method} {template} sent no body")
                continue
            schema = op["requestBody"]["content"]["application/json"]["schema"]
            check_fields(self.doc, schema, body, f"{method} {template}")
        self.assertEqual(called, set(OPERATIONS.values()), "every operation is exercised")

    def test_the_check_sees_a_field_the_document_does_not_name(self) -> None:
        schema = self.doc["paths"]["/v1/leases"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        with self.assertRaises(AssertionError):
            check_fields(self.doc, schema, {"worker_id": "w", "max_job": 1}, "lease")
        schema = self.doc["paths"]["/v1/jobs/{id}/fail"]["post"]["requestBody"]["content"]["application/json"]["schema"]
        with self.assertRaises(AssertionError):
            check_fields(self.doc, schema, {"lease_token": "1", "error": {"klass": "x"}}, "fail")


if __name__ == "__main__":
    unittest.main()
