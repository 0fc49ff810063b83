/** What can go wrong talking to a lazaret server. */

/** The inner object of an error reply: `{"error": {code, reason, message, ...}}`. */
export interface ErrorObject {
  code: string;
  reason?: string | null;
  message?: string;
  details?: unknown;
  retry_after_ms?: number | null;
}

/**
 * The server answered with one of the API's errors (docs/api.md, "Errors"):
 * `code` is the contract's code (`LEASE_LOST`, `SHED`, `POISON`, ...), `status`
 * the HTTP status (0 for an item of a batch reply).
 */
export class ApiError extends Error {
  readonly code: string;
  readonly status: number;
  readonly reason: string | null;
  readonly details: unknown;
  readonly retryAfterMs: number | null;

  constructor(obj: ErrorObject, status = 0, retryAfterMs: number | null = null) {
    const why = obj.reason ? ` (${obj.reason})` : "";
    super(`${status ? `${status} ` : ""}${obj.code}${why}: ${obj.message ?? ""}`);
    this.name = "ApiError";
    this.code = obj.code;
    this.status = status;
    this.reason = obj.reason ?? null;
    this.details = obj.details ?? null;
    this.retryAfterMs = typeof obj.retry_after_ms === "number" ? obj.retry_after_ms : retryAfterMs;
  }

  /** The lease is no longer ours: drop the job, never resend. */
  get isLeaseLost(): boolean {
    return this.code === "LEASE_LOST";
  }
}

/** The request did not complete, or its reply was not the JSON expected. */
export class TransportError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = "TransportError";
  }
}
