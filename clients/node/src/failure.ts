/**
 * A failed attempt as data, and how a handler's error becomes one: the
 * same table as the Rust SDK (crates/lazaret-client, `Failure`), checked
 * against the shared cases in clients/classification-cases.json.
 *
 * - a `Failure` the handler throws is sent as it is;
 * - a payload the handler's `parse` refuses: permanent, kind `parse`;
 * - a downstream reply: `Failure.fromResponse(res)` / `fromStatus` — 429 or
 *   503 with `Retry-After` deferred by that long; 5xx, 408 and 429 without
 *   it transient; any other 4xx permanent; kind `http_<status>` (throw it,
 *   or throw the `Response` itself);
 * - `fetch` refused or unable to connect: transient `connect`; a
 *   `TimeoutError` (AbortSignal.timeout) or a connect/headers/body timeout of
 *   fetch: transient `timeout`; any other failed fetch: transient `http`;
 * - a Node system error (`err.code` such as ECONNRESET): transient `io`
 *   (`timeout` for ETIMEDOUT);
 * - anything else thrown (what a panic is in Rust): transient `panic`, with
 *   the error's name, message and stack.
 */

export type FailureClass = "transient" | "permanent" | "deferred";

/** The server keeps at most this much of a message and a traceback. */
export const MESSAGE_BYTES_MAX = 4 * 1024;
export const TRACEBACK_BYTES_MAX = 16 * 1024;

/** The `error` object of `POST /v1/jobs/{id}/fail`. */
export interface WireFailure {
  class: FailureClass | null;
  kind: string;
  message: string;
  traceback?: string;
  retry_after_ms?: number;
}

function cut(text: string, limit: number, middle: boolean): string {
  const data = Buffer.from(text, "utf8");
  if (data.length <= limit) return text;
  if (!middle) {
    return `${data.subarray(0, limit).toString("utf8").replace(/\uFFFD+$/, "")}…[truncated ${data.length - limit} bytes]`;
  }
  const half = Math.floor(limit / 2);
  const head = data.subarray(0, half).toString("utf8").replace(/\uFFFD+$/, "");
  const tail = data.subarray(data.length - half).toString("utf8").replace(/^\uFFFD+/, "");
  return `${head}\n…[truncated ${data.length - 2 * half} bytes]…\n${tail}`;
}

/** A failed attempt: throw it from a handler, or let `classify` make one. */
export class Failure extends Error {
  /** `null`: the type's `kind_classes` decide by kind (unknown kinds are transient). */
  readonly failureClass: FailureClass | null;
  readonly kind: string;
  readonly retryAfterMs: number | null;
  traceback: string | null;

  constructor(
    failureClass: FailureClass | null,
    kind: string,
    message = "",
    options: { retryAfterMs?: number | null; traceback?: string | null } = {},
  ) {
    super(message);
    if (failureClass !== null && !["transient", "permanent", "deferred"].includes(failureClass)) {
      throw new TypeError(`failure class ${JSON.stringify(failureClass)} is not one of transient, permanent, deferred or null`);
    }
    this.name = "Failure";
    this.failureClass = failureClass;
    this.kind = kind;
    this.retryAfterMs = failureClass === "deferred" ? (options.retryAfterMs ?? null) : null;
    this.traceback = options.traceback ?? null;
  }

  /** May work later: retried with backoff. */
  static transient(kind: string, message = ""): Failure {
    return new Failure("transient", kind, message);
  }

  /** Never will work: dead-lettered at once. */
  static permanent(kind: string, message = ""): Failure {
    return new Failure("permanent", kind, message);
  }

  /** The downstream asked to wait: no attempt is spent. */
  static deferred(kind: string, message = "", retryAfterMs: number | null = null): Failure {
    return new Failure("deferred", kind, message, { retryAfterMs });
  }

  /** No class: the server's `kind_classes` for the type decide. */
  static byKind(kind: string, message = ""): Failure {
    return new Failure(null, kind, message);
  }

  /** A timeout: transient, kind `timeout`. */
  static timeout(message = ""): Failure {
    return new Failure("transient", "timeout", message);
  }

  /**
   * Classifies an HTTP status and its `Retry-After` header (`null` for
   * 1xx-3xx, which are not failures here). Kind `http_<status>`.
   */
  static fromStatus(status: number, retryAfter: string | null = null, message = "", now: Date = new Date()): Failure | null {
    if (status < 400) return null;
    const kind = `http_${status}`;
    const text = message || `answered ${status}`;
    const wait = retryAfter === null ? null : parseRetryAfter(retryAfter, now);
    if ((status === 429 || status === 503) && wait !== null) return Failure.deferred(kind, text, wait);
    if ((status >= 500 && status <= 599) || status === 408 || status === 429) return Failure.transient(kind, text);
    return Failure.permanent(kind, text);
  }

  /** Classifies a downstream reply by its status and `Retry-After` (`null` when it is no error). */
  static fromResponse(res: Response, now: Date = new Date()): Failure | null {
    return Failure.fromStatus(res.status, res.headers.get("retry-after"), `${res.url || "a downstream"} answered ${res.status}`, now);
  }

  /** A payload the handler's `parse` refused: permanent, kind `parse`. */
  static parse(error: unknown): Failure {
    const text = error instanceof Error ? `${error.name}: ${error.message}` : String(error);
    return Failure.permanent("parse", `the payload does not match the handler's type: ${text}`);
  }

  /** The same failure with a traceback. */
  withTraceback(text: string): this {
    this.traceback = text;
    return this;
  }

  /** The `error` object of a fail, cut to the server's caps. */
  toWire(): WireFailure {
    const wire: WireFailure = { class: this.failureClass, kind: this.kind, message: cut(this.message, MESSAGE_BYTES_MAX, false) };
    if (this.traceback !== null) wire.traceback = cut(this.traceback, TRACEBACK_BYTES_MAX, true);
    if (this.retryAfterMs !== null) wire.retry_after_ms = this.retryAfterMs;
    return wire;
  }
}

/**
 * A `Retry-After` value (delay-seconds or an HTTP date; a past date means
 * now) in milliseconds, or `null` when it is neither.
 */
export function parseRetryAfter(value: string, now: Date = new Date()): number | null {
  const v = value.trim();
  if (/^[0-9]+$/.test(v)) return Number(v) * 1000;
  if (!/^[A-Za-z]{3}, \d{2} [A-Za-z]{3} \d{4} \d{2}:\d{2}:\d{2} GMT$/.test(v)) return null;
  const at = Date.parse(v);
  if (Number.isNaN(at)) return null;
  return Math.max(0, at - now.getTime());
}

/** Thrown by the worker when a handler's `parse` refuses the payload. */
export class ParseError extends Error {
  constructor(readonly cause: unknown) {
    super(cause instanceof Error ? cause.message : String(cause));
    this.name = "ParseError";
  }
}

const CONNECT_CODES = new Set(["ECONNREFUSED", "ENOTFOUND", "EAI_AGAIN", "EHOSTUNREACH", "ENETUNREACH"]);
const TIMEOUT_CODES = new Set(["ETIMEDOUT", "UND_ERR_CONNECT_TIMEOUT", "UND_ERR_HEADERS_TIMEOUT", "UND_ERR_BODY_TIMEOUT"]);

function codeOf(e: unknown): string | undefined {
  const code = (e as { code?: unknown } | null)?.code;
  return typeof code === "string" ? code : undefined;
}

/** The failure a handler's thrown value is reported as (see the module doc). */
export function classify(err: unknown): Failure {
  if (err instanceof Failure) return err;
  if (err instanceof ParseError) return Failure.parse(err.cause);
  if (typeof Response !== "undefined" && err instanceof Response) {
    return Failure.fromResponse(err) ?? Failure.transient("http", `${err.url} answered ${err.status}`);
  }
  const name = (err as { name?: unknown } | null)?.name;
  const message = err instanceof Error ? err.message : String(err);
  if (name === "TimeoutError") return Failure.timeout(message);
  if (err instanceof TypeError && message === "fetch failed") {
    const code = codeOf(err.cause) ?? codeOf((err.cause as { cause?: unknown } | undefined)?.cause);
    const detail = err.cause instanceof Error ? `${message}: ${err.cause.message}` : message;
    if (code !== undefined && TIMEOUT_CODES.has(code)) return Failure.timeout(detail);
    if (code !== undefined && CONNECT_CODES.has(code)) return Failure.transient("connect", detail);
    return Failure.transient("http", detail);
  }
  const code = codeOf(err);
  if (err instanceof Error && code !== undefined && ("syscall" in err || "errno" in err)) {
    return Failure.transient(code === "ETIMEDOUT" ? "timeout" : "io", `${code}: ${message}`);
  }
  const label = err instanceof Error ? err.name : typeof err;
  const stack = err instanceof Error && err.stack ? err.stack : `${label}: ${message}`;
  return Failure.transient("panic", `handler threw ${label}: ${message}`).withTraceback(stack);
}
