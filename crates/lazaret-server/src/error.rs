//! One error type for the HTTP API, mapped to the contract's JSON body.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use lazaret_core::{PoisonReason, Verdict, Violation};
use lazaret_store::{ItemError, StoreError};
use serde_json::json;

/// How often the log says that requests' transactions were not applied:
/// a full disk refuses every write, and a busy producer would otherwise
/// write a line per request.
const NOT_APPLIED_LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

static NOT_APPLIED_LOG: LogEvery = LogEvery::new(NOT_APPLIED_LOG_EVERY);

/// Lets one log line through per interval and counts the ones held back.
#[derive(Debug)]
struct LogEvery {
    every: std::time::Duration,
    /// When the last line went out, and how many were held back since.
    state: std::sync::Mutex<(Option<std::time::Instant>, u64)>,
}

impl LogEvery {
    const fn new(every: std::time::Duration) -> Self {
        LogEvery {
            every,
            state: std::sync::Mutex::new((None, 0)),
        }
    }

    /// `Some(held back since the last line)` when a line may go out now.
    fn admit(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = std::time::Instant::now();
        match state.0 {
            Some(last) if now.duration_since(last) < self.every => {
                state.1 += 1;
                None
            }
            _ => {
                let held = std::mem::take(&mut state.1);
                state.0 = Some(now);
                Some(held)
            }
        }
    }
}

/// The contract's error codes: `lazaret_core::ErrorCode`, the one enum the
/// client reads too. The server answers only its named codes, never
/// `Other`.
pub use lazaret_core::ErrorCode as Code;

/// An error answer: `{"error": {"code", "reason", "message", ...}}`.
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Code.
    pub code: Code,
    /// Reason word (POISON reasons), else null.
    pub reason: Option<&'static str>,
    /// What was wrong and what to do.
    pub message: String,
    /// Schema violations.
    pub details: Vec<Violation>,
    /// For SHED and UNAVAILABLE after a rolled-back transaction: seconds to
    /// wait.
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    /// An error with a status, code and message.
    pub fn new(status: StatusCode, code: Code, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            reason: None,
            message: message.into(),
            details: Vec::new(),
            retry_after_s: None,
        }
    }

    /// 503 UNAVAILABLE: the store takes no work now; the message says why
    /// and whether to retry.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable, message)
    }

    /// 500 INTERNAL: the server itself failed, not the request.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, Code::Internal, message)
    }

    /// 400 BAD_REQUEST.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, Code::BadRequest, message)
    }

    /// 404 NOT_FOUND.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, Code::NotFound, message)
    }

    /// 409 CONFLICT.
    pub fn conflict(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, Code::Conflict, message)
    }

    /// 409 BAD_STATE: the job's state does not allow it.
    pub fn bad_state(message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, Code::BadState, message)
    }

    /// 403 FORBIDDEN.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, Code::Forbidden, message)
    }

    /// 413 POISON payload_too_large.
    pub fn too_large(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::PAYLOAD_TOO_LARGE, Code::Poison, message);
        e.reason = Some(PoisonReason::PayloadTooLarge.as_str());
        e
    }

    /// 409 LEASE_LOST or 404 NOT_FOUND for one item.
    pub fn item(e: ItemError, id: impl std::fmt::Display) -> Self {
        match e {
            ItemError::NotFound => Self::not_found(format!("no job with id {id}")),
            ItemError::LeaseLost => Self::new(
                StatusCode::CONFLICT,
                Code::LeaseLost,
                format!(
                    "the lease token is not job {id}'s current one: its lease expired or it was leased again. \
                     Drop the job without acking; its current holder will finish it"
                ),
            ),
        }
    }

    /// The error of a refusing admission verdict (`None` when admitted).
    pub fn from_verdict(v: Verdict) -> Option<Self> {
        Some(match v {
            Verdict::Admitted { .. } => return None,
            Verdict::Poison {
                reason,
                message,
                details,
            } => {
                let status = if reason == PoisonReason::PayloadTooLarge {
                    StatusCode::PAYLOAD_TOO_LARGE
                } else {
                    StatusCode::UNPROCESSABLE_ENTITY
                };
                let mut e = Self::new(status, Code::Poison, message);
                e.reason = Some(reason.as_str());
                e.details = details;
                e
            }
            Verdict::NoTenant { message } => {
                Self::new(StatusCode::BAD_REQUEST, Code::NoTenant, message)
            }
            Verdict::UnknownType { message } => {
                Self::new(StatusCode::UNPROCESSABLE_ENTITY, Code::UnknownType, message)
            }
            Verdict::Shed {
                retry_after,
                message,
            } => {
                let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, Code::Shed, message);
                e.retry_after_s = Some(retry_after.as_millis().div_ceil(1000).max(1) as u64);
                e
            }
            Verdict::BadRequest { message } => Self::bad_request(message),
        })
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let mut err =
            json!({ "code": self.code.as_str(), "reason": self.reason, "message": self.message });
        if !self.details.is_empty() {
            err["details"] = serde_json::to_value(&self.details).unwrap_or_default();
        }
        if let Some(s) = self.retry_after_s {
            err["retry_after_ms"] = json!(s * 1000);
        }
        json!({ "error": err })
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Closed => Self::unavailable(e.to_string()),
            // Nothing of the request happened: say so, and when to retry.
            StoreError::NotApplied(_) => {
                if let Some(since_last) = NOT_APPLIED_LOG.admit() {
                    tracing::warn!(
                        error = %e,
                        "a request's transaction was not applied ({since_last} more since the last line; at most one line per {}s)",
                        NOT_APPLIED_LOG_EVERY.as_secs()
                    );
                }
                let mut err = Self::unavailable(e.to_string());
                err.retry_after_s = Some(1);
                err
            }
            // Backpressure: the store's command queue is full. Say when
            // to come back instead of queueing without bound; no log line
            // per refusal (an overload would flood the log).
            // The disk is full (or failing): nothing was written; the
            // same request may succeed once there is room again.
            StoreError::Db(ref d) if d.is_out_of_room() => {
                tracing::debug!(error = %e, "refused: the store cannot write");
                let mut err = Self::unavailable(format!(
                    "the store is not writable: {e}; nothing of this request was applied, retry later"
                ));
                err.retry_after_s = Some(1);
                err
            }
            StoreError::Overloaded { .. } => {
                tracing::debug!(error = %e, "refused: the store's command queue is full");
                let mut err = Self::unavailable(e.to_string());
                err.retry_after_s = Some(1);
                err
            }
            other => {
                tracing::error!(error = %other, "store error");
                Self::internal(other.to_string())
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            if let Ok(v) = HeaderValue::from_str(&s.to_string()) {
                resp.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_flood_of_refusals_logs_one_line_per_interval_and_counts_the_rest() {
        let log = super::LogEvery::new(std::time::Duration::from_secs(3600));
        assert_eq!(log.admit(), Some(0), "the first goes out");
        for _ in 0..5 {
            assert_eq!(log.admit(), None, "the rest of the interval is held back");
        }
        let zero = super::LogEvery::new(std::time::Duration::ZERO);
        assert_eq!(zero.admit(), Some(0));
        assert_eq!(
            zero.admit(),
            Some(0),
            "a new interval lets the next one out"
        );
        assert_eq!(
            log.state.lock().unwrap().1,
            5,
            "and the held-back ones are counted"
        );
    }

    use super::*;

    #[test]
    fn store_errors_say_whether_to_retry() {
        let undone = ApiError::from(StoreError::NotApplied(
            "another request in the same transaction failed, so none of it was applied; retry"
                .into(),
        ));
        assert_eq!(undone.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(undone.code.as_str(), "UNAVAILABLE");
        assert_eq!(undone.retry_after_s, Some(1));
        let resp = undone.into_response();
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");

        let busy = ApiError::from(StoreError::Overloaded { waiting: 10_000 });
        assert_eq!(
            (busy.status, busy.code.as_str(), busy.retry_after_s),
            (StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE", Some(1))
        );
        assert!(busy.message.contains("overloaded"), "{}", busy.message);

        let full = ApiError::from(StoreError::Db(lazaret_store::DbError {
            message: "SQLite: database or disk is full".into(),
            code: Some("DiskFull".into()),
        }));
        assert_eq!(
            (full.status, full.code.as_str(), full.retry_after_s),
            (StatusCode::SERVICE_UNAVAILABLE, "UNAVAILABLE", Some(1))
        );
        assert!(full.message.contains("not writable"), "{}", full.message);

        let closed = ApiError::from(StoreError::Closed);
        assert_eq!(closed.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(closed.retry_after_s, None);

        // Committed but maybe not durable: the outcome is unknown, so no
        // blanket "retry"; the message says what happened.
        let unknown = ApiError::from(StoreError::NotDurable("committed, but …".into()));
        assert_eq!(unknown.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(unknown.code.as_str(), "INTERNAL");
    }
}
