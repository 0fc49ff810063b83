/** The test mode (lazaret-client/testing), used as a user's unit test would. */

import assert from "node:assert/strict";
import { test } from "node:test";

import { ApiError, Client, Failure, Worker } from "../src/index.js";
import { drain, FakeClient, runJob } from "../src/testing.js";

interface Producer {
  enqueue: FakeClient["enqueue"];
}

/** The code under test: enqueues a welcome e-mail, once per address. */
async function signup(client: Producer, email: string): Promise<void> {
  await client.enqueue({ type: "send_email", tenant: "acme", payload: { to: email }, idempotency_key: `welcome-${email}` });
}

function buildWorker(sent: string[], client: Producer): Worker {
  return new Worker(new Client("http://127.0.0.1:9"))
    .handle<string>("send_email", async (job) => {
      if (!job.payload.includes("@")) throw Failure.permanent("validation", `no @ in ${job.payload}`);
      sent.push(job.payload);
      await client.enqueue({ type: "audit", tenant: "acme", payload: { sent: job.payload } });
    }, {
      parse: (p: any) => {
        if (typeof p.to !== "string") throw new TypeError("to is missing");
        return p.to as string;
      },
    })
    .handle("audit", () => {});
}

test("enqueues are recorded and deduplicated", async () => {
  const fake = new FakeClient();
  await signup(fake, "ada@example.com");
  await signup(fake, "ada@example.com");
  const job = fake.assertEnqueued("send_email", { tenant: "acme", payload: { to: "ada@example.com" }, count: 1 });
  assert.equal(job.idempotency_key, "welcome-ada@example.com");
  const again = await fake.enqueue({ type: "send_email", tenant: "acme", payload: {}, idempotency_key: "welcome-ada@example.com" });
  assert.equal(again.admission, "DUPLICATE");
  assert.throws(() => fake.assertEnqueued("send_email", { payload: { to: "bob@example.com" } }));
  const results = await fake.enqueueBatch([
    { type: "send_email", tenant: "acme", payload: { to: "b@x" } },
    { type: "send_email", tenant: "", payload: {} },
  ]);
  assert.equal((results[0] as { admission: string }).admission, "ADMITTED");
  assert.equal((results[1] as { code: string }).code, "NO_TENANT");
});

test("a traceparent is checked as the server does and reaches the handler", async () => {
  const fake = new FakeClient();
  const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
  await fake.enqueue({ type: "trace", tenant: "acme", payload: {}, traceparent: ` ${tp}` });
  assert.equal(fake.jobs("trace")[0].traceparent, tp);
  for (const bad of ["00-0000", tp.toUpperCase(), `00-${"0".repeat(32)}${tp.slice(35)}`, `${tp.slice(0, 36)}${"0".repeat(16)}${tp.slice(52)}`]) {
    await assert.rejects(
      fake.enqueue({ type: "trace", tenant: "acme", payload: {}, traceparent: bad }),
      (e: unknown) => e instanceof ApiError && e.code === "BAD_REQUEST" && e.status === 400,
      bad,
    );
  }
  const seen: Array<string | null | undefined> = [];
  const worker = new Worker(new Client("http://127.0.0.1:9")).handle("trace", (job) => {
    seen.push(job.traceparent);
  });
  await drain(fake, worker);
  assert.deepEqual(seen, [tp]);
});

test("drain runs jobs through the worker's handlers", async () => {
  const fake = new FakeClient();
  const sent: string[] = [];
  const worker = buildWorker(sent, fake);
  await signup(fake, "ada@example.com");
  await signup(fake, "no-at-sign");
  await fake.enqueue({ type: "send_email", tenant: "acme", payload: { oops: 1 } });
  const ran = await drain(fake, worker);
  assert.deepEqual(sent, ["ada@example.com"]);
  assert.deepEqual(ran.map((r) => [r.job.type, r.failure?.failureClass ?? null, r.failure?.kind ?? null]), [
    ["send_email", null, null],
    ["send_email", "permanent", "validation"],
    ["send_email", "permanent", "parse"],
    ["audit", null, null], // enqueued by a handler, drained too
  ]);
  assert.deepEqual(fake.jobs(), []);
});

test("runJob classifies like the worker", async () => {
  const worker = buildWorker([], new FakeClient());
  assert.ok((await runJob(worker, "send_email", { to: "a@b" })).ok);
  const r = await runJob(worker, "send_email", { to: "nobody" });
  assert.deepEqual([r.failure?.failureClass, r.failure?.kind], ["permanent", "validation"]);
  const u = await runJob(worker, "unknown", {});
  assert.deepEqual([u.failure?.failureClass, u.failure?.kind], ["transient", "no_handler"]);
});
