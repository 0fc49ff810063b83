/**
 * Producers and workers for lazaret, over its HTTP API, with `fetch` only.
 *
 * - `Client`: enqueue one job or a batch (idempotency keys), and the worker
 *   calls (lease, heartbeat, ack, fail, `next`, batched acks and fails);
 *   errors are `ApiError` with the API's code (`LEASE_LOST`, `SHED`, ...).
 * - `Worker`: async handlers per type, heartbeats, a handler's error
 *   classified into class and kind as the Rust SDK does (`classify`), and a
 *   graceful shutdown on SIGTERM/SIGINT.
 * - `lazaret-client/testing`: a fake client and `drain` for your unit tests.
 */

export { Client, OPERATIONS } from "./client.js";
export type { ClientOptions, Enqueued, Heartbeat, LeasedJob, LeaseRequest, NewJob, Operation, Outcome } from "./client.js";
export { ApiError, TransportError } from "./errors.js";
export type { ErrorObject } from "./errors.js";
export { classify, Failure, parseRetryAfter, ParseError } from "./failure.js";
export type { FailureClass, WireFailure } from "./failure.js";
export { HANDBACK_DELAY_MS, Worker, WorkerError } from "./worker.js";
export type { Handler, Job, Parse, ReportKind, RunReport, WorkerOptions } from "./worker.js";
