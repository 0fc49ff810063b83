/**
 * The worker runtime: handlers per job type, `concurrency` jobs at once,
 * heartbeats, classified failures, `next` (the outcome and the next lease
 * in one request) and a graceful shutdown on SIGTERM or SIGINT that charges
 * no attempt to the jobs it hands back. The protocol is docs/workers.md; the
 * Rust SDK's `Worker` (crates/lazaret-client) behaves the same way.
 *
 * How a job moves: the lease loop asks for as many jobs as it has free
 * slots (long-polling `pollWaitMs`); each job runs `parse` then the handler
 * while heartbeating every `leaseMs / 3`, then is acked or failed, asking in
 * the same request for the next job (`next`) while the worker is not
 * stopping, which then runs in the same slot.
 */

import { type Client, type LeasedJob, type LeaseRequest, type Outcome } from "./client.js";
import { ApiError, TransportError } from "./errors.js";
import { classify, Failure, ParseError } from "./failure.js";

/** The `retry_after_ms` of jobs handed back at shutdown (the Rust SDK's default). */
export const HANDBACK_DELAY_MS = 1000;
/** Tries of a report whose request failed in transport or with a 5xx. */
const REPORT_TRIES = 3;
/** Lease errors after which leasing again cannot help. */
const FATAL_LEASE_CODES = new Set(["UNAUTHORIZED", "FORBIDDEN", "BAD_REQUEST"]);

/** A job handed to a handler: its payload (after `parse`) and its envelope. */
export interface Job<T = unknown> {
  readonly payload: T;
  readonly id: string;
  readonly type: string;
  readonly tenant: string;
  readonly lane: string;
  readonly attempt: number;
  readonly idempotency_key: string | null;
  readonly schema_version: number | null;
  /** The W3C trace context the job was enqueued with (`null`: none). */
  readonly traceparent?: string | null;
  readonly created_at: string;
  readonly lease_token: string;
  lease_expires_at: string;
  /** True once a heartbeat learns the job was cancelled: stop, and throw or return. */
  cancelRequested: boolean;
  /** Aborted when the job was cancelled, its lease was lost, or shutdown's grace ended. */
  readonly signal: AbortSignal;
}

export type Handler<T = any> = (job: Job<T>) => unknown;
export type Parse<T> = (payload: unknown) => T;

/** Totals of a worker's run. */
export interface RunReport {
  succeeded: number;
  failed: number;
  panicked: number;
  parse_failed: number;
  handed_back: number;
  lease_lost: number;
  not_reported: number;
}

export type ReportKind = Exclude<keyof RunReport, "panicked" | "parse_failed">;

export interface WorkerOptions {
  /** Recorded in each attempt's history (default `lazaret-node-<pid>`). */
  workerId?: string;
  /** Lanes to lease from (default every lane). */
  lanes?: string[] | null;
  /** Jobs run at once (default 4). */
  concurrency?: number;
  /** Lease length (default 30000); heartbeats every third of it. */
  leaseMs?: number;
  /** Whether running jobs are heartbeaten (default true). */
  heartbeats?: boolean;
  /** How long one lease request waits for work (default 2000); bounds how long stopping takes. */
  pollWaitMs?: number;
  /** How long running handlers may finish after a stop (default 30000). */
  shutdownGraceMs?: number;
  /** The `retry_after_ms` of jobs handed back at shutdown (default 1000). */
  handbackDelayMs?: number;
  /** Ask for the next job in each ack or fail (default true). */
  useNext?: boolean;
  /** Called with every job's end. */
  onReport?: (job: LeasedJob, what: ReportKind, failure: Failure | null, outcome: Outcome | null) => void;
}

/** Leasing failed in a way retrying cannot fix; the worker drained and stopped. */
export class WorkerError extends Error {
  constructor(readonly cause: ApiError) {
    super(`leasing failed for good: ${cause.message}`);
    this.name = "WorkerError";
  }
}

class Running {
  settled = false;
  lost = false;
  readonly abort = new AbortController();
  constructor(readonly leased: LeasedJob) {}

  /** True for whoever settles the job first (its slot, or the shutdown). */
  settle(): boolean {
    if (this.settled) return false;
    this.settled = true;
    return true;
  }
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/**
 * Leases jobs of the types it has handlers for and runs them.
 *
 * ```ts
 * const worker = new Worker(new Client("http://127.0.0.1:7433"), { concurrency: 4 });
 * worker.handle("send_email", async (job) => { ... }); // resolve: ack; throw: fail, classified
 * await worker.run(); // until SIGTERM or Ctrl-C, then a graceful shutdown
 * ```
 */
export class Worker {
  readonly workerId: string;
  readonly report: RunReport = { succeeded: 0, failed: 0, panicked: 0, parse_failed: 0, handed_back: 0, lease_lost: 0, not_reported: 0 };
  private readonly opts: Required<Omit<WorkerOptions, "onReport" | "lanes" | "workerId">>;
  private readonly lanes: string[] | null;
  private readonly onReport: WorkerOptions["onReport"];
  private readonly handlers = new Map<string, { handler: Handler; parse?: Parse<unknown> }>();
  private readonly running = new Map<string, Running>();
  private stopping = false;
  private aborting = false;
  private wakers: Array<() => void> = [];

  constructor(readonly client: Client, options: WorkerOptions = {}) {
    const concurrency = options.concurrency ?? 4;
    const leaseMs = options.leaseMs ?? 30_000;
    if (!(concurrency >= 1)) throw new RangeError(`concurrency is ${concurrency}; give it at least 1`);
    if (!(leaseMs >= 30)) throw new RangeError(`a lease of ${leaseMs} ms is too short to heartbeat; use at least 30 ms`);
    this.workerId = options.workerId ?? `lazaret-node-${process.pid}`;
    this.lanes = options.lanes ?? null;
    this.onReport = options.onReport;
    this.opts = {
      concurrency,
      leaseMs,
      heartbeats: options.heartbeats ?? true,
      pollWaitMs: options.pollWaitMs ?? 2000,
      shutdownGraceMs: options.shutdownGraceMs ?? 30_000,
      handbackDelayMs: options.handbackDelayMs ?? HANDBACK_DELAY_MS,
      useNext: options.useNext ?? true,
    };
  }

  /**
   * Runs jobs of `type` with `handler(job)`: resolving acks, throwing fails
   * (see `classify`). With `parse`, the payload goes through it first, and a
   * payload it refuses (anything thrown) fails as permanent `parse` without
   * the handler running.
   */
  handle<T = any>(type: string, handler: Handler<T>, options: { parse?: Parse<T> } = {}): this {
    this.handlers.set(type, { handler: handler as Handler, parse: options.parse });
    return this;
  }

  /**
   * Runs one job's parse and handler here, without the server: `null` when
   * it succeeded, else the classified failure. The worker calls it for each
   * job; `testing` calls it to run jobs in unit tests.
   */
  async execute(leased: LeasedJob, options: { signal?: AbortSignal; onJob?: (job: Job) => void } = {}): Promise<Failure | null> {
    const entry = this.handlers.get(leased.type);
    if (!entry) return Failure.transient("no_handler", `worker ${this.workerId} has no handler for type ${leased.type}`);
    try {
      let payload: unknown;
      try {
        payload = entry.parse ? entry.parse(leased.payload) : leased.payload;
      } catch (e) {
        throw new ParseError(e);
      }
      const job: Job = {
        ...leased,
        payload,
        cancelRequested: false,
        signal: options.signal ?? new AbortController().signal,
      };
      options.onJob?.(job);
      await entry.handler(job);
      return null;
    } catch (e) {
      return classify(e);
    }
  }

  /** What a job handed back at shutdown is failed with: deferred, kind `shutdown`. */
  handbackFailure(message = "the worker is shutting down"): Failure {
    return Failure.deferred("shutdown", message, this.opts.handbackDelayMs);
  }

  /** Asks the worker to stop: no more leases; running handlers finish within the grace. */
  stop(): void {
    this.stopping = true;
    this.wake();
  }

  /** Runs until SIGTERM or SIGINT (or `stop()`), then shuts down gracefully; a second signal ends the grace. */
  async run(): Promise<RunReport> {
    const onSignal = (sig: NodeJS.Signals) => {
      if (this.stopping) {
        console.warn(`lazaret worker: ${sig} again: handing back running jobs now`);
        this.aborting = true;
        this.wake();
      } else {
        console.info(`lazaret worker: ${sig}: stopping after the running jobs`);
        this.stop();
      }
    };
    process.on("SIGTERM", onSignal);
    process.on("SIGINT", onSignal);
    try {
      return await this.runUntilStopped();
    } finally {
      process.off("SIGTERM", onSignal);
      process.off("SIGINT", onSignal);
    }
  }

  /** Runs until `stop()`, then shuts down gracefully and resolves to the totals. */
  async runUntilStopped(): Promise<RunReport> {
    if (this.handlers.size === 0) throw new Error('no handlers: add one with worker.handle("type", fn)');
    let backoff = 100;
    let error: ApiError | null = null;
    while (!this.stopping) {
      if (this.running.size >= this.opts.concurrency) {
        await this.changed();
        continue;
      }
      const free = this.opts.concurrency - this.running.size;
      let jobs: LeasedJob[];
      try {
        jobs = await this.client.lease(this.leaseRequest(free, this.opts.pollWaitMs));
        backoff = 100;
      } catch (e) {
        if (e instanceof ApiError && FATAL_LEASE_CODES.has(e.code)) {
          console.error(`lazaret worker: leasing refused (${e.message}); stopping`);
          error = e;
          this.stopping = true;
          break;
        }
        console.warn(`lazaret worker: leasing failed (${e instanceof Error ? e.message : e}); trying again in ${backoff} ms`);
        await this.changedOr(backoff * (0.5 + Math.random() / 2));
        backoff = Math.min(backoff * 2, 5000);
        continue;
      }
      if (this.stopping) {
        await this.handBack(jobs, "the worker is shutting down; handed back before it started");
        break;
      }
      for (const leased of jobs) this.start(new Running(leased));
    }
    await this.drain();
    if (error) throw new WorkerError(error);
    return this.report;
  }

  private leaseRequest(max: number, waitMs: number): LeaseRequest {
    return {
      worker_id: this.workerId,
      lanes: this.lanes,
      types: [...this.handlers.keys()].sort(),
      max_jobs: max,
      lease_ms: this.opts.leaseMs,
      wait_ms: waitMs,
    };
  }

  private wake(): void {
    const w = this.wakers;
    this.wakers = [];
    for (const f of w) f();
  }

  private changed(): Promise<void> {
    return new Promise((resolve) => this.wakers.push(resolve));
  }

  /** Resolves on the next change or after `ms`, leaving no timer behind to hold the process open. */
  private async changedOr(ms: number): Promise<void> {
    let timer: ReturnType<typeof setTimeout> | undefined;
    await Promise.race([this.changed(), new Promise<void>((resolve) => (timer = setTimeout(resolve, ms)))]);
    clearTimeout(timer);
  }

  private start(r: Running): void {
    this.running.set(r.leased.id, r);
    void this.slot(r);
  }

  private async drain(): Promise<void> {
    const deadline = Date.now() + this.opts.shutdownGraceMs;
    while (this.running.size > 0 && !this.aborting && Date.now() < deadline) {
      await this.changedOr(Math.max(0, deadline - Date.now()));
    }
    const left = [...this.running.values()];
    if (left.length > 0) {
      console.warn(`lazaret worker: shutdown grace over: handing back ${left.length} running job(s)`);
      const mine = left.filter((r) => r.settle());
      for (const r of mine) r.abort.abort(new Error("shutdown grace over"));
      await this.handBack(mine.map((r) => r.leased), "the worker shut down before the handler finished");
    }
  }

  private async slot(first: Running): Promise<void> {
    let current: Running | null = first;
    while (current !== null) {
      const leased: LeasedJob = current.leased;
      const failure = await this.runOne(current);
      let next: Running | null = null;
      if (current.lost) {
        if (current.settle()) this.count("lease_lost", leased, null, null);
      } else if (current.settle()) {
        const ask = this.opts.useNext && !this.stopping;
        const outcome = await this.reportOutcome(leased, failure, ask ? this.leaseRequest(1, 0) : undefined);
        if (outcome && outcome.jobs.length > 0) next = new Running(outcome.jobs[0]);
      }
      this.running.delete(leased.id);
      if (next !== null && this.stopping) {
        await this.handBack([next.leased], "the worker is shutting down; handed back before it started");
        next = null;
      }
      if (next !== null) this.running.set(next.leased.id, next);
      this.wake();
      current = next;
    }
  }

  private async runOne(r: Running): Promise<Failure | null> {
    let job: Job | null = null;
    const beat = async () => {
      try {
        const hb = await this.client.heartbeat(r.leased.id, r.leased.lease_token, this.opts.leaseMs);
        if (job) {
          job.lease_expires_at = hb.lease_expires_at;
          if (hb.cancel_requested && !job.cancelRequested) {
            job.cancelRequested = true;
            r.abort.abort(new Error("the job was cancelled"));
          }
        }
      } catch (e) {
        if (e instanceof ApiError && (e.code === "LEASE_LOST" || e.code === "NOT_FOUND")) {
          console.warn(`lazaret worker: job ${r.leased.id}: lease lost during the run; its result will be dropped`);
          r.lost = true;
          r.abort.abort(new Error("lease lost"));
          clearInterval(timer);
        } else {
          console.warn(`lazaret worker: job ${r.leased.id}: heartbeat failed: ${e instanceof Error ? e.message : e}`);
        }
      }
    };
    const timer = this.opts.heartbeats ? setInterval(() => void beat(), this.opts.leaseMs / 3) : undefined;
    try {
      return await this.execute(r.leased, { signal: r.abort.signal, onJob: (j) => (job = j) });
    } finally {
      clearInterval(timer);
    }
  }

  private async reportOutcome(leased: LeasedJob, failure: Failure | null, next?: LeaseRequest): Promise<Outcome | null> {
    for (let attempt = 0; attempt < REPORT_TRIES; attempt++) {
      try {
        const outcome = failure === null
          ? await this.client.ack(leased.id, leased.lease_token, next)
          : await this.client.fail(leased.id, leased.lease_token, failure, next);
        if (outcome.nextError) console.warn(`lazaret worker: job ${leased.id}: reported; the next lease was refused: ${outcome.nextError.message}`);
        this.count(failure === null ? "succeeded" : "failed", leased, failure, outcome);
        return outcome;
      } catch (e) {
        if (e instanceof ApiError && e.isLeaseLost) {
          console.warn(`lazaret worker: job ${leased.id}: lease lost; outcome dropped${attempt ? " (a resend: the first report may have landed)" : ""}`);
          this.count("lease_lost", leased, failure, null);
          return null;
        }
        const retry = e instanceof TransportError || (e instanceof ApiError && e.status >= 500);
        if (retry && attempt + 1 < REPORT_TRIES) {
          await sleep(200 * 2 ** attempt);
          continue;
        }
        console.error(`lazaret worker: job ${leased.id}: could not report its outcome: ${e instanceof Error ? e.message : e}`);
        this.count("not_reported", leased, failure, null);
        return null;
      }
    }
    return null;
  }

  private async handBack(jobs: LeasedJob[], message: string): Promise<void> {
    if (jobs.length === 0) return;
    const failure = this.handbackFailure(message);
    let results: Array<Outcome | ApiError>;
    try {
      results = await this.client.fails(jobs.map((j) => [j.id, j.lease_token, failure]));
    } catch (e) {
      console.warn(`lazaret worker: could not hand back ${jobs.length} job(s); their leases will expire: ${e instanceof Error ? e.message : e}`);
      for (const j of jobs) this.count("not_reported", j, failure, null);
      return;
    }
    jobs.forEach((j, i) => {
      const r = results[i];
      if (r instanceof ApiError) this.count(r.isLeaseLost ? "lease_lost" : "not_reported", j, failure, null);
      else this.count("handed_back", j, failure, r);
    });
  }

  private count(what: ReportKind, leased: LeasedJob, failure: Failure | null, outcome: Outcome | null): void {
    this.report[what] += 1;
    if (what === "failed" && failure) {
      if (failure.kind === "panic") this.report.panicked += 1;
      else if (failure.kind === "parse" && failure.failureClass === "permanent") this.report.parse_failed += 1;
    }
    try {
      this.onReport?.(leased, what, failure, outcome);
    } catch (e) {
      console.error("lazaret worker: onReport threw", e);
    }
  }
}
