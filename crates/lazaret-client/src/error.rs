//! What can go wrong when talking to a lazaret server: the contract's error
//! codes as a type, and one error enum for every client call.

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

/// The `code` of an API error body: the server's own enum
/// (`lazaret_core::ErrorCode`), so the two cannot drift apart.
pub use lazaret_core::ErrorCode;

/// One item's error inside a batch reply (`/v1/jobs/batch`, `/v1/acks`,
/// `/v1/fails`): the same body as a single call's error, without a status.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{code}{}: {message}", reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default())]
pub struct ItemError {
    /// The contract's code.
    pub code: ErrorCode,
    /// For `POISON`: which check refused it.
    pub reason: Option<String>,
    /// What was wrong and what to do.
    pub message: String,
    /// Schema violations, when there are some.
    pub details: Option<Value>,
    /// For `SHED`: how long to wait.
    pub retry_after: Option<Duration>,
}

/// The JSON error object `{"code", "reason", "message", "details"?, "retry_after_ms"?}`.
#[derive(Debug, Deserialize)]
pub(crate) struct ErrorObject {
    code: ErrorCode,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    message: String,
    #[serde(default)]
    details: Option<Value>,
    #[serde(default)]
    retry_after_ms: Option<u64>,
}

impl From<ErrorObject> for ItemError {
    fn from(e: ErrorObject) -> Self {
        ItemError {
            code: e.code,
            reason: e.reason,
            message: e.message,
            details: e.details.filter(|d| !d.is_null()),
            retry_after: e.retry_after_ms.map(Duration::from_millis),
        }
    }
}

/// `{"error": {...}}`.
#[derive(Debug, Deserialize)]
pub(crate) struct ErrorEnvelope {
    pub(crate) error: ErrorObject,
}

/// Every way a client call can fail.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The server answered with one of the contract's errors.
    #[error("{status} {code}{}: {message}", reason.as_deref().map(|r| format!(" ({r})")).unwrap_or_default())]
    Api {
        /// HTTP status.
        status: reqwest::StatusCode,
        /// The contract's code.
        code: ErrorCode,
        /// For `POISON`: which check refused it.
        reason: Option<String>,
        /// What was wrong and what to do.
        message: String,
        /// Schema violations, when there are some (boxed: errors stay small).
        details: Option<Box<Value>>,
        /// From `Retry-After` (or the body's `retry_after_ms`), for `SHED`.
        retry_after: Option<Duration>,
        /// The error body as the server sent it (for tools that print it as is).
        body: Box<[u8]>,
    },
    /// The request did not complete: connection refused, reset, timed out…
    #[error("HTTP transport error: {0}")]
    Http(#[from] reqwest::Error),
    /// A 2xx reply whose body is not the JSON this call expects.
    #[error("the server's {status} reply is not the JSON expected: {source}; body starts {body:?}")]
    Decode {
        /// HTTP status.
        status: reqwest::StatusCode,
        /// Why it did not parse.
        source: serde_json::Error,
        /// The first bytes of the body.
        body: String,
    },
    /// A non-2xx reply that is not an API error (a proxy's page, say).
    #[error("the server answered {status} without an API error body: {body:?}")]
    Unexpected {
        /// HTTP status.
        status: reqwest::StatusCode,
        /// The first bytes of the body.
        body: String,
    },
    /// A request could not be encoded (a payload that does not serialise).
    #[error("could not encode the request: {0}")]
    Encode(#[source] serde_json::Error),
    /// The base URL or token given to the builder is unusable.
    #[error("invalid client configuration: {0}")]
    Config(String),
}

impl ClientError {
    /// The contract's code, when the server sent one.
    pub fn code(&self) -> Option<&ErrorCode> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            _ => None,
        }
    }

    /// Whether this is `LEASE_LOST`: the job is someone else's now; drop it.
    pub fn is_lease_lost(&self) -> bool {
        self.code() == Some(&ErrorCode::LeaseLost)
    }

    /// Whether the server could not be reached at all: the connection was
    /// refused, the name did not resolve, or the TLS handshake failed (an
    /// untrusted certificate, say). Nothing was sent.
    pub fn is_connect(&self) -> bool {
        matches!(self, ClientError::Http(e) if e.is_connect())
    }

    /// The innermost cause of a transport error ("Connection refused (os
    /// error 111)", "invalid peer certificate: UnknownIssuer"), which says
    /// more than "error sending request for url (…)".
    pub fn cause(&self) -> Option<String> {
        match self {
            ClientError::Http(e) => Some(root_cause(e)),
            _ => None,
        }
    }

    /// Whether this is `NOT_FOUND`.
    pub fn is_not_found(&self) -> bool {
        self.code() == Some(&ErrorCode::NotFound)
    }

    /// Whether trying again later may help: transport errors, 5xx, `SHED`.
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Http(_) => true,
            ClientError::Api { status, code, .. } => {
                status.is_server_error() || *code == ErrorCode::Shed
            }
            ClientError::Unexpected { status, .. } => status.is_server_error(),
            _ => false,
        }
    }

    /// An API error from a non-2xx reply's parts.
    pub(crate) fn from_reply(
        status: reqwest::StatusCode,
        retry_after_header: Option<Duration>,
        body: &[u8],
    ) -> Self {
        match serde_json::from_slice::<ErrorEnvelope>(body) {
            Ok(env) => {
                let item = ItemError::from(env.error);
                ClientError::Api {
                    status,
                    code: item.code,
                    reason: item.reason,
                    message: item.message,
                    details: item.details.map(Box::new),
                    retry_after: retry_after_header.or(item.retry_after),
                    body: body.into(),
                }
            }
            Err(_) => ClientError::Unexpected {
                status,
                body: head(body),
            },
        }
    }
}

/// The innermost source of an error.
pub(crate) fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = e;
    while let Some(next) = cur.source() {
        cur = next;
    }
    cur.to_string()
}

/// The first bytes of a body, for error messages.
pub(crate) fn head(body: &[u8]) -> String {
    let cut = body.len().min(512);
    String::from_utf8_lossy(&body[..cut]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_unknown_codes_are_kept() {
        for c in [
            "POISON",
            "NO_TENANT",
            "UNKNOWN_TYPE",
            "SHED",
            "LEASE_LOST",
            "NOT_FOUND",
            "UNAUTHORIZED",
            "FORBIDDEN",
            "BAD_REQUEST",
            "CONFLICT",
            "BAD_STATE",
            "INTERNAL",
            "UNAVAILABLE",
            "TOO_MANY_TENANTS",
        ] {
            assert_eq!(ErrorCode::parse(c).as_str(), c);
            assert!(!matches!(ErrorCode::parse(c), ErrorCode::Other(_)));
        }
        assert_eq!(
            ErrorCode::parse("NEW_ONE"),
            ErrorCode::Other("NEW_ONE".into())
        );
    }

    #[test]
    fn errors_stay_small_enough_to_return_by_value() {
        // clippy's result_large_err fires at 128 bytes, in users' code too.
        assert!(
            std::mem::size_of::<ClientError>() < 128,
            "{} bytes",
            std::mem::size_of::<ClientError>()
        );
    }

    #[test]
    fn an_error_body_becomes_a_typed_error() {
        let body = br#"{"error":{"code":"SHED","reason":null,"message":"breaker open","retry_after_ms":3000}}"#;
        let e = ClientError::from_reply(reqwest::StatusCode::SERVICE_UNAVAILABLE, None, body);
        match &e {
            ClientError::Api {
                code, retry_after, ..
            } => {
                assert_eq!(*code, ErrorCode::Shed);
                assert_eq!(*retry_after, Some(Duration::from_secs(3)));
            }
            other => panic!("not an API error: {other:?}"),
        }
        assert!(e.is_retryable());
        let proxy = ClientError::from_reply(reqwest::StatusCode::BAD_GATEWAY, None, b"<html>");
        assert!(matches!(proxy, ClientError::Unexpected { .. }));
    }
}
