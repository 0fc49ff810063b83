/**
 * Against a real `lazaret serve` ($LAZARET_BIN; skipped with a message when
 * it is unset, failing under CI=true): enqueue one and batch with
 * idempotency keys, lease, heartbeat, ack, fail, `next`, batched outcomes,
 * the Worker end to end, and a graceful shutdown on SIGTERM.
 */

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { after, before, test } from "node:test";
import { fileURLToPath } from "node:url";

import { ApiError, Client, type Enqueued, Failure, Worker } from "../src/index.js";
import { eventually, Server, serverBin } from "./support.js";

const binary = serverBin();
let server: Server;
let c: Client;

before(async () => {
  if (binary === null) return;
  server = await new Server(binary).start();
  c = new Client(server.url, { timeoutMs: 10_000 });
});

after(async () => {
  await server?.close();
});

const live = { skip: binary === null ? "LAZARET_BIN is not set" : false };

test("enqueue one and batch with idempotency keys", live, async () => {
  const first = await c.enqueue({ type: "node-idem", tenant: "acme", payload: { n: 1 }, idempotency_key: "order-1", lane: "interactive" });
  assert.deepEqual([first.state, first.admission], ["queued", "ADMITTED"]);
  const again = await c.enqueue({ type: "node-idem", tenant: "acme", payload: { n: 2 }, idempotency_key: "order-1", lane: "interactive" });
  assert.deepEqual([again.id, again.admission], [first.id, "DUPLICATE"]);
  assert.equal((await c.enqueue({ type: "node-idem", tenant: "acme", payload: null, delay_ms: 60_000 })).state, "scheduled");
  const results = await c.enqueueBatch([
    { type: "node-idem", tenant: "acme", payload: { n: 3 }, idempotency_key: "order-2" },
    { type: "node-idem", tenant: "", payload: { n: 4 } },
    { type: "node-idem", tenant: "acme", payload: { n: 5 }, idempotency_key: "order-2" },
  ]);
  const [ok, bad, dup] = results;
  assert.equal((ok as Enqueued).admission, "ADMITTED");
  assert.ok(bad instanceof ApiError);
  assert.equal(bad.code, "NO_TENANT");
  assert.deepEqual([(dup as Enqueued).id, (dup as Enqueued).admission], [(ok as Enqueued).id, "DUPLICATE"]);
  const job = await c.job(first.id);
  assert.deepEqual([job.payload, job.idempotency_key, job.lane], [{ n: 1 }, "order-1", "interactive"]);
  await assert.rejects(c.enqueue({ type: "node-idem", tenant: "", payload: {} }), (e: unknown) => e instanceof ApiError && e.code === "NO_TENANT" && e.status === 400);
});

test("a traceparent goes from the enqueue to the leased job and the handler", live, async () => {
  const t = "node-trace";
  const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  const traced = await c.enqueue({ type: t, tenant: "acme", payload: { n: 1 }, traceparent: tp });
  const [batched] = await c.enqueueBatch([{ type: t, tenant: "acme", payload: { n: 2 }, traceparent: tp }]);
  await c.enqueue({ type: t, tenant: "acme", payload: { n: 3 } });
  await assert.rejects(
    c.enqueue({ type: t, tenant: "acme", payload: {}, traceparent: "00-0000" }),
    (e: unknown) => e instanceof ApiError && e.code === "BAD_REQUEST" && e.status === 400 && e.message.includes("traceparent"),
  );
  assert.equal((await c.job(traced.id)).traceparent, tp);
  const jobs = await c.lease({ worker_id: "node-w", types: [t], max_jobs: 3, wait_ms: 5000 });
  const byId = new Map(jobs.map((j) => [j.id, j.traceparent]));
  assert.equal(byId.size, 3);
  assert.equal(byId.get(traced.id), tp);
  assert.equal(byId.get((batched as Enqueued).id), tp);
  byId.delete(traced.id);
  byId.delete((batched as Enqueued).id);
  assert.deepEqual([...byId.values()], [null]);
  await c.acks(jobs.map((j) => [j.id, j.lease_token] as [string, string]));
  // A handler sees it on its job.
  const again = await c.enqueue({ type: t, tenant: "acme", payload: { n: 4 }, traceparent: tp });
  const seen: Array<string | null | undefined> = [];
  const worker = new Worker(c, { workerId: "node-trace-w" }).handle(t, (job) => {
    seen.push(job.traceparent);
  });
  const [leased] = await c.lease({ worker_id: "node-trace-w", types: [t], wait_ms: 5000 });
  assert.equal(leased.id, again.id);
  assert.equal(await worker.execute(leased), null);
  assert.deepEqual(seen, [tp]);
});

test("lease, heartbeat, fail, ack, next and batched outcomes", live, async () => {
  const t = "node-proto";
  const a = await c.enqueue({ type: t, tenant: "acme", payload: { job: "a" } });
  let [job] = await c.lease({ worker_id: "node-w", types: [t], lease_ms: 5000, wait_ms: 5000 });
  assert.deepEqual([job.id, job.attempt, job.payload], [a.id, 1, { job: "a" }]);
  const beat = await c.heartbeat(job.id, job.lease_token, 60_000);
  assert.ok(beat.lease_expires_at > job.lease_expires_at);
  assert.equal(beat.cancel_requested, false);
  let out = await c.fail(job.id, job.lease_token, Failure.transient("http_503", "upstream down"));
  assert.deepEqual([out.state, out.fields.attempt], ["scheduled", 1]);
  [job] = await c.lease({ worker_id: "node-w", types: [t], wait_ms: 5000 });
  assert.deepEqual([job.id, job.attempt], [a.id, 2]);
  const b = await c.enqueue({ type: t, tenant: "acme", payload: { job: "b" } });
  out = await c.ack(job.id, job.lease_token, { worker_id: "node-w", types: [t], wait_ms: 5000 });
  assert.equal(out.state, "succeeded");
  assert.deepEqual(out.jobs.map((j) => j.id), [b.id]);
  const nb = out.jobs[0];
  out = await c.fail(nb.id, nb.lease_token, Failure.permanent("validation", "bad"));
  assert.deepEqual([out.state, out.fields.reason], ["dead_lettered", "permanent"]);
  await assert.rejects(c.ack(nb.id, nb.lease_token), (e: unknown) => e instanceof ApiError && e.isLeaseLost);
  assert.equal((await c.job(a.id)).state, "succeeded");
  const ids = [(await c.enqueue({ type: t, tenant: "acme", payload: "c" })).id, (await c.enqueue({ type: t, tenant: "acme", payload: "d" })).id];
  const jobs = await c.lease({ worker_id: "node-w", types: [t], max_jobs: 2, wait_ms: 5000 });
  assert.deepEqual(jobs.map((j) => j.id).sort(), ids.sort());
  const acked = await c.acks([[jobs[0].id, jobs[0].lease_token], ["999999999", "1"]]);
  assert.equal((acked[0] as { state: string }).state, "succeeded");
  assert.equal((acked[1] as ApiError).code, "NOT_FOUND");
  const failed = await c.fails([[jobs[1].id, jobs[1].lease_token, Failure.deferred("http_429", "slow down", 10)]]);
  assert.deepEqual([(failed[0] as { state: string }).state, (failed[0] as { fields: Record<string, unknown> }).fields.deferred], ["scheduled", true]);
});

test("the worker runs handlers and reports classified outcomes", live, async () => {
  const deferred = new Set<string>();
  const viaNext: string[] = [];
  const recording = (async (input: string | URL | Request, init?: RequestInit) => {
    const res = await fetch(input, init);
    if (typeof init?.body === "string" && init.body.includes('"next"') && res.ok) {
      const body = await res.clone().json();
      viaNext.push(...(body.jobs ?? []).map((j: { id: string }) => j.id));
    }
    return res;
  }) as typeof fetch;
  const worker = new Worker(new Client(server.url, { fetch: recording }), { workerId: "node-e2e", concurrency: 3, leaseMs: 3000, pollWaitMs: 200, shutdownGraceMs: 5000 });
  worker
    .handle("node-ok", () => {})
    .handle("node-flaky", (job) => {
      if (job.attempt === 1) throw Object.assign(new Error("read ECONNRESET"), { code: "ECONNRESET", errno: -104, syscall: "read" });
    })
    .handle("node-bad", () => {
      throw Failure.permanent("validation", "no @ in the address");
    })
    .handle("node-parse", () => {}, { parse: (p: any) => { if (typeof p.n !== "number") throw new TypeError("n is not a number"); return p.n as number; } })
    .handle("node-panic", () => {
      throw new Error("boom 42");
    })
    .handle("node-defer", (job) => {
      if (!deferred.has(job.id)) {
        deferred.add(job.id);
        throw new Response(null, { status: 429, headers: { "retry-after": "0" } });
      }
    });
  const ids: Record<string, string> = {};
  for (const [t, p] of [["node-ok", {}], ["node-flaky", {}], ["node-bad", {}], ["node-parse", { n: "x" }], ["node-panic", {}], ["node-defer", {}]] as const) {
    ids[t] = (await c.enqueue({ type: t, tenant: "acme", payload: p })).id;
  }
  const run = worker.runUntilStopped();
  let jobs: Record<string, Record<string, any>>;
  try {
    jobs = await eventually(async () => {
      const js: Record<string, Record<string, any>> = {};
      for (const [t, id] of Object.entries(ids)) js[t] = await c.job(id);
      return Object.values(js).every((j) => ["succeeded", "dead_lettered"].includes(j.state)) ? js : null;
    }, "every job to finish");
  } finally {
    worker.stop();
  }
  const report = await run;
  assert.ok(viaNext.length > 0, "some jobs came in the reply to an ack or fail (next)");
  const lastError = (t: string) => jobs[t].history.filter((h: any) => h.error).at(-1).error;
  assert.equal(jobs["node-ok"].state, "succeeded");
  assert.deepEqual([jobs["node-flaky"].state, jobs["node-flaky"].attempt], ["succeeded", 2]);
  assert.deepEqual([lastError("node-flaky").class, lastError("node-flaky").kind], ["transient", "io"]);
  assert.equal(jobs["node-bad"].state, "dead_lettered");
  assert.deepEqual([lastError("node-bad").class, lastError("node-bad").kind], ["permanent", "validation"]);
  assert.deepEqual([lastError("node-parse").class, lastError("node-parse").kind], ["permanent", "parse"]);
  assert.deepEqual([jobs["node-panic"].state, jobs["node-panic"].attempt], ["dead_lettered", 3]);
  assert.equal(lastError("node-panic").kind, "panic");
  assert.ok(lastError("node-panic").message.includes("boom 42"));
  assert.ok(lastError("node-panic").traceback.includes("Error: boom 42"));
  assert.deepEqual([jobs["node-defer"].state, jobs["node-defer"].attempt, jobs["node-defer"].deferrals], ["succeeded", 1, 1]);
  assert.deepEqual(
    [report.succeeded, report.failed, report.panicked, report.parse_failed, report.lease_lost, report.not_reported],
    [3, 1 + 1 + 1 + 3 + 1, 3, 1, 0, 0],
  );
});

async function sigterm(graceMs: number, sleepMs: number, tenant: string): Promise<{ out: string; code: number | null; id: string }> {
  const { id } = await c.enqueue({ type: "node-sleep", tenant, payload: { ms: sleepMs } });
  const script = fileURLToPath(new URL("./worker-process.js", import.meta.url));
  const proc = spawn(process.execPath, [script, server.url, String(graceMs)], { stdio: ["ignore", "pipe", "pipe"] });
  let out = "";
  proc.stdout.on("data", (d) => (out += d));
  proc.stderr.on("data", (d) => (out += d));
  // "close", not "exit": it comes once stdout and stderr are read to the end.
  const exited = new Promise<number | null>((resolve) => proc.once("close", resolve));
  try {
    await eventually(async () => out.includes(`node-sleep ${id}: started`), "the handler to start");
    proc.kill("SIGTERM");
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<never>((_, reject) => (timer = setTimeout(() => reject(new Error(`no exit after SIGTERM: ${out}`)), 30_000)));
    try {
      const code = await Promise.race([exited, late]);
      return { out, code, id };
    } finally {
      clearTimeout(timer); // or it holds this test file's process for 30 s
    }
  } finally {
    if (proc.exitCode === null) proc.kill("SIGKILL");
  }
}

test("SIGTERM lets the running job finish", live, async () => {
  const { out, code, id } = await sigterm(30_000, 1500, "acme");
  assert.equal(code, 0, out);
  assert.ok(out.includes('stopped: {"succeeded":1'), out);
  assert.equal((await c.job(id)).state, "succeeded");
});

test("SIGTERM hands back what the grace did not finish", live, async () => {
  const { out, code, id } = await sigterm(200, 60_000, "globex");
  assert.equal(code, 0, out);
  assert.ok(out.includes('"handed_back":1'), out);
  const info = await c.job(id);
  assert.ok(["scheduled", "queued"].includes(info.state), info.state);
  assert.deepEqual([info.attempt, info.deferrals], [0, 1]); // no attempt spent
  const last = info.history.at(-1);
  assert.deepEqual([last.outcome, last.error.kind, last.error.class], ["deferred", "shutdown", "deferred"]);
  await c.cancel(id);
});
