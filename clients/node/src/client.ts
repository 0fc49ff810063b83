/**
 * The HTTP client: one method per endpoint a producer or a worker calls,
 * over the global `fetch` (no runtime dependency). Every request goes
 * through `Client.call(operation, ...)`, and the operations are the table
 * `OPERATIONS`, which the package's tests check against the server's
 * OpenAPI document (docs/openapi.json).
 */

import { ApiError, type ErrorObject, TransportError } from "./errors.js";
import type { Failure } from "./failure.js";

/** Every operation this package calls: name -> [method, path template]. */
export const OPERATIONS = {
  enqueue: ["POST", "/v1/jobs"],
  enqueueBatch: ["POST", "/v1/jobs/batch"],
  job: ["GET", "/v1/jobs/{id}"],
  cancel: ["POST", "/v1/jobs/{id}/cancel"],
  lease: ["POST", "/v1/leases"],
  ack: ["POST", "/v1/jobs/{id}/ack"],
  fail: ["POST", "/v1/jobs/{id}/fail"],
  heartbeat: ["POST", "/v1/jobs/{id}/heartbeat"],
  acks: ["POST", "/v1/acks"],
  fails: ["POST", "/v1/fails"],
} as const satisfies Record<string, readonly ["GET" | "POST", string]>;

export type Operation = keyof typeof OPERATIONS;

/** A job to enqueue (`POST /v1/jobs`). */
export interface NewJob {
  type: string;
  tenant: string;
  payload: unknown;
  lane?: string;
  idempotency_key?: string;
  schema_version?: number;
  delay_ms?: number;
  /**
   * A W3C trace context (`00-<trace id>-<parent id>-<flags>`) the job joins:
   * its worker sees it on the leased job and can continue the trace. One
   * that is not valid is refused (`ApiError` `BAD_REQUEST`).
   */
  traceparent?: string;
}

/** The reply to an enqueue. */
export interface Enqueued {
  id: string;
  state: string;
  admission: "ADMITTED" | "FAIR_QUEUE" | "DUPLICATE";
}

/** What `POST /v1/leases` (and an outcome's `next`) asks for. */
export interface LeaseRequest {
  worker_id?: string;
  lanes?: string[] | null;
  types?: string[] | null;
  max_jobs?: number;
  lease_ms?: number;
  wait_ms?: number;
}

/** A leased job as `POST /v1/leases` hands it over. */
export interface LeasedJob {
  id: string;
  type: string;
  tenant: string;
  lane: string;
  payload: unknown;
  attempt: number;
  idempotency_key: string | null;
  schema_version: number | null;
  lease_token: string;
  lease_expires_at: string;
  created_at: string;
  /** The W3C trace context it was enqueued with (`null`: none; absent from servers before it). */
  traceparent?: string | null;
}

/**
 * The reply to an ack or fail: `state` (`succeeded`, `scheduled`,
 * `dead_lettered`, `cancelled`) and the reply's other fields; with `next`,
 * the jobs leased in the same request (or `nextError`).
 */
export interface Outcome {
  state: string;
  fields: Record<string, unknown>;
  jobs: LeasedJob[];
  nextError: ApiError | null;
}

/** The reply to a heartbeat. */
export interface Heartbeat {
  lease_expires_at: string;
  cancel_requested: boolean;
}

export interface ClientOptions {
  /** Sent as `Authorization: Bearer`; default `process.env.LAZARET_TOKEN`. */
  token?: string;
  /** Bounds each request (a long-poll adds its wait); default 30000. */
  timeoutMs?: number;
  /** The `fetch` to use (tests pass a recorder); default the global one. */
  fetch?: typeof fetch;
}

function outcomeOf(reply: Record<string, unknown>): Outcome {
  const { jobs, next_error, ...fields } = reply;
  return {
    state: String(reply.state),
    fields,
    jobs: (jobs as LeasedJob[] | undefined) ?? [],
    nextError: next_error && typeof next_error === "object" ? new ApiError(next_error as ErrorObject) : null,
  };
}

function itemOf<T>(r: Record<string, unknown>, ok: (r: Record<string, unknown>) => T): T | ApiError {
  const e = r.error;
  return e && typeof e === "object" ? new ApiError(e as ErrorObject) : ok(r);
}

/** A client of one lazaret server. */
export class Client {
  readonly server: string;
  readonly token: string | undefined;
  readonly timeoutMs: number;
  private readonly fetchImpl: typeof fetch;

  constructor(server = "http://127.0.0.1:7433", options: ClientOptions = {}) {
    let url: URL;
    try {
      url = new URL(server);
    } catch {
      throw new TypeError(`server ${JSON.stringify(server)} is not a URL; pass e.g. http://127.0.0.1:7433`);
    }
    if (url.protocol !== "http:" && url.protocol !== "https:") {
      throw new TypeError(`server ${JSON.stringify(server)} is not an http:// or https:// URL`);
    }
    this.server = server.replace(/\/+$/, "");
    this.token = options.token ?? (process.env.LAZARET_TOKEN || undefined);
    this.timeoutMs = options.timeoutMs ?? 30_000;
    this.fetchImpl = options.fetch ?? fetch;
  }

  /**
   * Sends one of `OPERATIONS`; resolves to the decoded reply, or rejects with
   * `ApiError` (an error reply) or `TransportError`.
   */
  async call(operation: Operation, body?: unknown, id?: string, extraMs = 0): Promise<any> {
    const [method, template] = OPERATIONS[operation];
    const path = id === undefined ? template : template.replace("{id}", encodeURIComponent(id));
    const headers: Record<string, string> = { accept: "application/json" };
    if (body !== undefined) headers["content-type"] = "application/json";
    if (this.token) headers.authorization = `Bearer ${this.token}`;
    let res: Response;
    let text: string;
    try {
      res = await this.fetchImpl(this.server + path, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: AbortSignal.timeout(this.timeoutMs + extraMs),
        redirect: "manual",
      });
      text = await res.text();
    } catch (e) {
      throw new TransportError(`${method} ${path}: ${e instanceof Error ? e.message : String(e)}`, { cause: e });
    }
    let decoded: any = null;
    try {
      decoded = text ? JSON.parse(text) : null;
    } catch (e) {
      if (res.ok) throw new TransportError(`the server's ${res.status} reply to ${method} ${path} is not JSON: ${text.slice(0, 200)}`, { cause: e });
    }
    if (res.ok) return decoded;
    if (decoded && typeof decoded === "object" && decoded.error && typeof decoded.error === "object") {
      const ra = res.headers.get("retry-after");
      throw new ApiError(decoded.error as ErrorObject, res.status, ra && /^\d+$/.test(ra.trim()) ? Number(ra.trim()) * 1000 : null);
    }
    throw new TransportError(`${method} ${path}: the server answered ${res.status} without an API error body: ${text.slice(0, 200)}`);
  }

  // ---------------------------------------------------------------- producers

  /**
   * `POST /v1/jobs`. With an `idempotency_key`, a second enqueue of the same
   * (tenant, type, key) answers `DUPLICATE` with the first job's id.
   */
  async enqueue(job: NewJob): Promise<Enqueued> {
    return (await this.call("enqueue", job)) as Enqueued;
  }

  /** `POST /v1/jobs/batch`: one result per job, in order; a refused job is an `ApiError` in its place. */
  async enqueueBatch(jobs: NewJob[]): Promise<Array<Enqueued | ApiError>> {
    const reply = await this.call("enqueueBatch", { jobs });
    return (reply.results as Record<string, unknown>[]).map((r) => itemOf(r, (x) => x as unknown as Enqueued));
  }

  /** `GET /v1/jobs/{id}`: the job, its state and history. */
  async job(id: string): Promise<Record<string, any>> {
    return await this.call("job", undefined, id);
  }

  /** `POST /v1/jobs/{id}/cancel`. */
  async cancel(id: string): Promise<Record<string, unknown>> {
    return await this.call("cancel", {}, id);
  }

  // ---------------------------------------------------------------- workers

  /** `POST /v1/leases`; long-polls up to `wait_ms` when nothing is ready. */
  async lease(req: LeaseRequest = {}): Promise<LeasedJob[]> {
    const reply = await this.call("lease", req, undefined, req.wait_ms ?? 0);
    return reply.jobs as LeasedJob[];
  }

  /** `POST /v1/jobs/{id}/ack`; with `next`, the reply also carries the next lease. */
  async ack(id: string, leaseToken: string, next?: LeaseRequest): Promise<Outcome> {
    const body: Record<string, unknown> = { lease_token: leaseToken };
    if (next) body.next = next;
    return outcomeOf(await this.call("ack", body, id, next?.wait_ms ?? 0));
  }

  /** `POST /v1/jobs/{id}/fail` with the failure's class and kind. */
  async fail(id: string, leaseToken: string, failure: Failure, next?: LeaseRequest): Promise<Outcome> {
    const body: Record<string, unknown> = { lease_token: leaseToken, error: failure.toWire() };
    if (next) body.next = next;
    return outcomeOf(await this.call("fail", body, id, next?.wait_ms ?? 0));
  }

  /** `POST /v1/jobs/{id}/heartbeat`: the lease now ends `extendMs` from now. */
  async heartbeat(id: string, leaseToken: string, extendMs?: number): Promise<Heartbeat> {
    const body: Record<string, unknown> = { lease_token: leaseToken };
    if (extendMs !== undefined) body.extend_ms = extendMs;
    const reply = await this.call("heartbeat", body, id);
    return { lease_expires_at: String(reply.lease_expires_at), cancel_requested: Boolean(reply.cancel_requested) };
  }

  /** `POST /v1/acks` with [id, lease token] pairs: one result per item. */
  async acks(items: Array<[string, string]>): Promise<Array<Outcome | ApiError>> {
    const reply = await this.call("acks", { items: items.map(([id, t]) => ({ id, lease_token: t })) });
    return (reply.results as Record<string, unknown>[]).map((r) => itemOf(r, outcomeOf));
  }

  /** `POST /v1/fails` with [id, lease token, failure]: one result per item. */
  async fails(items: Array<[string, string, Failure]>): Promise<Array<Outcome | ApiError>> {
    const reply = await this.call("fails", { items: items.map(([id, t, f]) => ({ id, lease_token: t, error: f.toWire() })) });
    return (reply.results as Record<string, unknown>[]).map((r) => itemOf(r, outcomeOf));
  }
}
