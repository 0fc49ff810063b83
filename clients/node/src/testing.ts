/**
 * A test mode for your own unit tests, as `Sidekiq::Testing` (fake) and
 * River's `rivertest` give: no server, no network.
 *
 * - `FakeClient` stands in for `Client` in the code under test: it records
 *   every enqueue (idempotency keys deduplicate as on the server: the second
 *   enqueue of a (tenant, type, key) answers `DUPLICATE`), and
 *   `assertEnqueued` / `jobs` read them back.
 * - `drain(fake, worker)` runs the recorded jobs through a `Worker`'s
 *   handlers, with the worker's own parse and classification (jobs those
 *   handlers enqueue run too), and tells how each ended.
 * - `runJob(worker, type, payload)` runs one job through its handler.
 *
 * ```ts
 * const fake = new FakeClient();
 * await signup(fake, "ada@example.com");          // your code, given the fake
 * fake.assertEnqueued("send_email", { tenant: "acme" });
 * const ran = await drain(fake, worker);          // the worker built as in production
 * assert.ok(ran.every((r) => r.ok));
 * ```
 */

import { isDeepStrictEqual } from "node:util";

import type { Enqueued, LeasedJob, NewJob } from "./client.js";
import { ApiError } from "./errors.js";
import type { Failure } from "./failure.js";
import type { Worker } from "./worker.js";

/** One job run in test mode: `failure` is `null` when the handler succeeded. */
export interface Ran {
  job: LeasedJob;
  failure: Failure | null;
  ok: boolean;
}

/** Records enqueues instead of sending them (the producer half of `Client`). */
export class FakeClient {
  /** Enqueued and not drained yet, oldest first. */
  enqueued: Array<{ id: string; job: NewJob }> = [];
  /** Every admitted job, drained or not. */
  readonly allEnqueued: Array<{ id: string; job: NewJob }> = [];
  private readonly keys = new Map<string, string>();
  private nextId = 1;

  async enqueue(job: NewJob): Promise<Enqueued> {
    return this.admit(job);
  }

  async enqueueBatch(jobs: NewJob[]): Promise<Array<Enqueued | ApiError>> {
    return jobs.map((j) => {
      try {
        return this.admit(j);
      } catch (e) {
        if (e instanceof ApiError) return e;
        throw e;
      }
    });
  }

  private admit(job: NewJob): Enqueued {
    if (!job.tenant) throw new ApiError({ code: "NO_TENANT", message: 'tenant is missing or empty; set "tenant" on every job' }, 400);
    if (!job.type) throw new ApiError({ code: "BAD_REQUEST", message: "type is missing or empty" }, 400);
    if (job.traceparent !== undefined) job = { ...job, traceparent: checkTraceparent(job.traceparent) };
    const key = job.idempotency_key === undefined ? null : JSON.stringify([job.tenant, job.type, job.idempotency_key]);
    if (key !== null && this.keys.has(key)) return { id: this.keys.get(key)!, state: "queued", admission: "DUPLICATE" };
    const id = String(this.nextId++);
    if (key !== null) this.keys.set(key, id);
    this.enqueued.push({ id, job });
    this.allEnqueued.push({ id, job });
    return { id, state: job.delay_ms ? "scheduled" : "queued", admission: "ADMITTED" };
  }

  /** The jobs enqueued and not drained yet, oldest first. */
  jobs(type?: string, filter: { tenant?: string } = {}): NewJob[] {
    return this.enqueued
      .map((e) => e.job)
      .filter((j) => (type === undefined || j.type === type) && (filter.tenant === undefined || j.tenant === filter.tenant));
  }

  /**
   * Throws unless a job matching every given field was enqueued and not
   * drained (exactly `count` of them, when given); returns the first match.
   */
  assertEnqueued(
    type: string,
    want: { tenant?: string; payload?: unknown; lane?: string; idempotency_key?: string; count?: number } = {},
  ): NewJob {
    const matches = this.jobs(type, { tenant: want.tenant }).filter(
      (j) =>
        (!("payload" in want) || isDeepStrictEqual(j.payload, want.payload)) &&
        (want.lane === undefined || (j.lane ?? "default") === want.lane) &&
        (want.idempotency_key === undefined || j.idempotency_key === want.idempotency_key),
    );
    if (matches.length === 0 || (want.count !== undefined && matches.length !== want.count)) {
      const seen = this.jobs().map((j) => `${j.type}/${j.tenant} ${JSON.stringify(j.payload)}`).join(", ") || "nothing";
      throw new Error(`expected ${want.count ?? ""} ${type} job(s) matching; ${matches.length} matched; enqueued: ${seen}`.replace("  ", " "));
    }
    return matches[0];
  }

  /** Forgets every recorded job (and idempotency key). */
  clear(): void {
    this.enqueued = [];
    this.allEnqueued.length = 0;
    this.keys.clear();
  }
}

/** A `traceparent` the server takes (W3C trace context, version 00). */
const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$/;

/** `value` as the server keeps it, or the `ApiError` it answers. */
function checkTraceparent(value: string): string {
  const trimmed = value.replace(/^[ \t]+|[ \t]+$/g, "");
  const m = TRACEPARENT.exec(trimmed);
  if (m === null || /^0+$/.test(m[1]) || /^0+$/.test(m[2])) {
    throw new ApiError(
      {
        code: "BAD_REQUEST",
        message:
          "traceparent must be `00-<32 lower-case hex trace id>-<16 lower-case hex parent id>-<2 hex flags>` (W3C trace context, version 00), " +
          "neither id all zeros; leave `traceparent` out to enqueue the job without a trace",
      },
      400,
    );
  }
  return trimmed;
}

function leasedOf(id: string, job: NewJob, attempt: number): LeasedJob {
  const now = new Date().toISOString();
  return {
    id,
    type: job.type,
    tenant: job.tenant,
    lane: job.lane ?? "default",
    payload: job.payload,
    attempt,
    idempotency_key: job.idempotency_key ?? null,
    schema_version: job.schema_version ?? null,
    traceparent: job.traceparent ?? null,
    lease_token: `test-${id}-${attempt}`,
    lease_expires_at: now,
    created_at: now,
  };
}

/**
 * Runs the recorded jobs (of `type`, or all) through `worker`'s handlers,
 * oldest first, until none is left; jobs the handlers enqueue into `fake`
 * run too, up to `roundsMax` rounds. Each job runs once, as attempt 1.
 */
export async function drain(fake: FakeClient, worker: Worker, options: { type?: string; roundsMax?: number } = {}): Promise<Ran[]> {
  const ran: Ran[] = [];
  const pick = (j: NewJob) => options.type === undefined || j.type === options.type;
  for (let round = 0; round < (options.roundsMax ?? 100); round++) {
    const batch = fake.enqueued.filter((e) => pick(e.job));
    if (batch.length === 0) return ran;
    fake.enqueued = fake.enqueued.filter((e) => !pick(e.job));
    for (const { id, job } of batch) {
      const leased = leasedOf(id, job, 1);
      const failure = await worker.execute(leased);
      ran.push({ job: leased, failure, ok: failure === null });
    }
  }
  throw new Error(`drain: jobs still enqueued after ${options.roundsMax ?? 100} rounds; do the handlers enqueue forever?`);
}

/** Runs one job through `worker`'s handler for `type` (parse and classification included), without a server. */
export async function runJob(
  worker: Worker,
  type: string,
  payload: unknown,
  options: { tenant?: string; lane?: string; attempt?: number; idempotency_key?: string } = {},
): Promise<Ran> {
  const leased = leasedOf("1", { type, tenant: options.tenant ?? "test", payload, lane: options.lane, idempotency_key: options.idempotency_key }, options.attempt ?? 1);
  const failure = await worker.execute(leased);
  return { job: leased, failure, ok: failure === null };
}
