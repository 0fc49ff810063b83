#!/usr/bin/env python3
"""A guard-mode handler in plain Python (standard library only).

    python3 examples/python_handler.py [--port 8080]

With a source such as

    [[sources]]
    name = "orders"
    broker = "rabbitmq"
    url = "amqp://guest:guest@127.0.0.1:5672/%2f"
    queue = "orders"
    mode = "guard"
    deliver = "http://127.0.0.1:8080/orders"
    type = "orders"

lazaret POSTs each message of the queue here: the body is the message body
byte for byte, and the headers say which delivery it is (Lazaret-Attempt,
Lazaret-Source, Lazaret-Message-Id, Lazaret-Idempotency-Key, and
Lazaret-Headers: the broker message's own headers as one JSON object).

The answer decides: 2xx success; 429, or 503 with Retry-After, a deferral
(no attempt spent); 408 and other 5xx transient (retried with backoff); any
other 4xx permanent (dead-lettered at once). A body {"error": {"class",
"kind", "message", "traceback", "retry_after_ms"}} names the failure. The
demo orders are JSON: {"order_id": "o-1", "amount": 42}, and optionally
"fail_attempts": N (fail the first N attempts) or "busy": true (always 429).
"""

import argparse, json, logging, traceback, urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("handler")
done = set()  # idempotency keys already charged: a message may come twice


def charge(order, attempt, key):
    """The work. Raises to fail; returns to succeed."""
    if key in done:
        return {"duplicate": True}
    if attempt <= order.get("fail_attempts", 0):
        raise ConnectionError(f"payment gateway unreachable (attempt {attempt})")
    done.add(key)
    return {"charged": order["amount"], "order_id": order["order_id"]}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: lazaret reuses its connections

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        attempt = int(self.headers.get("Lazaret-Attempt", "1"))
        key = self.headers.get("Lazaret-Idempotency-Key", "")
        msg_id = urllib.parse.unquote(self.headers.get("Lazaret-Message-Id", ""))
        broker_headers = json.loads(self.headers.get("Lazaret-Headers") or "{}")
        log.info("%s %s attempt %d from %s (broker headers: %s)", self.path, msg_id,
                 attempt, self.headers.get("Lazaret-Source"), sorted(broker_headers))
        try:
            order = json.loads(body)
            if not (isinstance(order, dict) and isinstance(order.get("order_id"), str)
                    and isinstance(order.get("amount"), int)):
                raise ValueError("an order needs a string order_id and an integer amount")
        except ValueError as e:  # bad data never gets better: permanent
            return self.answer(422, error("permanent", "validation", e))
        if order.get("busy"):  # not the message's fault: come back later, for free
            return self.answer(429, error("deferred", "rate_limited", "busy", 2000), {"Retry-After": "2"})
        try:
            return self.answer(200, charge(order, attempt, key))
        except ConnectionError as e:  # may work next time: transient
            return self.answer(503, error("transient", "gateway_unreachable", e))
        except Exception as e:  # a bug: permanent, with the traceback for the dead letter
            return self.answer(500, error("permanent", type(e).__name__, e))

    def answer(self, status, body, headers=None):
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, fmt, *args):
        log.debug(fmt, *args)


def error(cls, kind, exc, retry_after_ms=None):
    tb = traceback.format_exc() if isinstance(exc, BaseException) else None
    return {"error": {"class": cls, "kind": kind, "message": str(exc),
                      "traceback": tb if tb and tb != "NoneType: None\n" else None,
                      "retry_after_ms": retry_after_ms}}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    log.info("handler listening on http://%s:%d", args.host, args.port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
