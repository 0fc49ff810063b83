/**
 * The shared classification table (clients/classification-cases.json), run
 * through the worker's own path: each case's error is thrown by a handler
 * and `Worker.execute` classifies it.
 */

import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { createServer } from "node:net";
import { test } from "node:test";

import { Client, Failure, type LeasedJob, Worker } from "../src/index.js";
import { CASES, loadJson } from "./support.js";

const IO_CODES: Record<string, [string, number, string]> = {
  timed_out: ["ETIMEDOUT", -110, "connect"],
  connection_reset: ["ECONNRESET", -104, "read"],
  connection_refused: ["ECONNREFUSED", -111, "connect"],
  broken_pipe: ["EPIPE", -32, "write"],
  not_found: ["ENOENT", -2, "open"],
  permission_denied: ["EACCES", -13, "open"],
};

function leased(type: string, payload: unknown = null): LeasedJob {
  return {
    id: "1", type, tenant: "acme", lane: "default", payload, attempt: 1, idempotency_key: null,
    schema_version: null, lease_token: "7", lease_expires_at: "", created_at: "",
  };
}

function worker(): Worker {
  return new Worker(new Client("http://127.0.0.1:9"));
}

async function throwing(make: () => unknown): Promise<Failure | null> {
  const w = worker().handle("t", async () => {
    throw make();
  });
  return w.execute(leased("t"));
}

async function closedPort(): Promise<number> {
  const srv = createServer();
  await new Promise<void>((r) => srv.listen(0, "127.0.0.1", r));
  const port = (srv.address() as { port: number }).port;
  await new Promise((r) => srv.close(r));
  return port;
}

function systemError(name: string): Error {
  if (name === "not_found") {
    try {
      readFileSync("/nonexistent/lazaret");
    } catch (e) {
      return e as Error; // a real one
    }
  }
  const [code, errno, syscall] = IO_CODES[name];
  return Object.assign(new Error(`${syscall} ${code}`), { code, errno, syscall });
}

async function classifyCase(raise: Record<string, any>): Promise<Failure | null> {
  const [[what, arg]] = Object.entries(raise);
  switch (what) {
    case "failure":
      return throwing(() => new Failure(arg.class, arg.kind, arg.message, { retryAfterMs: arg.retry_after_ms }));
    case "http_status": {
      const now = arg.now ? new Date(arg.now) : new Date();
      const direct = Failure.fromStatus(arg.status, arg.retry_after ?? null, "x", now);
      // The same from a Response, and thrown from a handler as a Response.
      const headers: Record<string, string> = arg.retry_after === undefined ? {} : { "retry-after": arg.retry_after };
      const res = new Response(null, { status: arg.status, headers });
      const viaResponse = Failure.fromResponse(res, now);
      assert.deepEqual([viaResponse?.failureClass, viaResponse?.kind, viaResponse?.retryAfterMs], [direct?.failureClass, direct?.kind, direct?.retryAfterMs]);
      if (direct !== null && !arg.now) {
        const thrown = await throwing(() => new Response(null, { status: arg.status, headers }));
        assert.deepEqual([thrown?.failureClass, thrown?.kind, thrown?.retryAfterMs], [direct.failureClass, direct.kind, direct.retryAfterMs]);
      }
      return direct;
    }
    case "io":
      return throwing(() => systemError(arg));
    case "timeout": {
      const w = worker().handle("t", async () => {
        await new Promise((_, reject) => {
          const s = AbortSignal.timeout(1);
          s.addEventListener("abort", () => reject(s.reason));
        });
      });
      return w.execute(leased("t"));
    }
    case "http_client_connect_refused": {
      const port = await closedPort();
      const w = worker().handle("t", async () => {
        await fetch(`http://127.0.0.1:${port}/`);
      });
      return w.execute(leased("t"));
    }
    case "parse": {
      const w = worker().handle("t", async () => {}, {
        parse: (p: any) => {
          if (typeof p.to !== "string") throw new TypeError(`to is ${typeof p.to}, not a string`);
          return p.to as string;
        },
      });
      return w.execute(leased("t", JSON.parse(arg)));
    }
    case "panic":
      return throwing(() => new Error(arg));
    case "no_handler":
      return worker().handle("t", async () => {}).execute(leased(arg));
    case "shutdown":
      return worker().handbackFailure();
    default:
      throw new Error(`the cases file has a raise kind this test does not know: ${what}`);
  }
}

test("every shared classification case", async (t) => {
  const { cases } = loadJson(CASES);
  assert.ok(cases.length > 30);
  for (const c of cases) {
    await t.test(c.name, async () => {
      const got = await classifyCase(c.raise);
      const want = c.expect;
      if (want === null) {
        assert.equal(got, null);
        return;
      }
      assert.ok(got);
      assert.deepEqual([got.failureClass, got.kind, got.retryAfterMs], [want.class, want.kind, want.retry_after_ms]);
      if (want.message_contains) assert.ok(got.message.includes(want.message_contains), got.message);
      if (want.traceback) assert.ok(got.traceback, "a traceback is sent");
      const wire = got.toWire();
      assert.deepEqual([wire.class, wire.kind, wire.retry_after_ms ?? null], [want.class, want.kind, want.retry_after_ms]);
    });
  }
});

test("long messages and tracebacks are cut to the server's caps", () => {
  const wire = Failure.transient("x", "é".repeat(10_000)).withTraceback("frame\n".repeat(100_000)).toWire();
  assert.ok(Buffer.byteLength(wire.message) <= 4096 + 64);
  assert.ok(Buffer.byteLength(wire.traceback!) <= 16384 + 64);
  assert.ok(wire.traceback!.includes("truncated"));
});
