//! The HTTP API (see `docs/api.md` and the contract): routes and handlers.
//! Handlers move bytes; the core decides and the store applies. One module
//! per resource; `routes` holds the route table (each route's role and
//! body cap, declared once); this one builds the router and holds what
//! every handler shares.

mod browser;
mod dashboard;
mod dead_letters;
mod jobs;
mod leases;
pub mod openapi;
mod operations;
pub mod routes;
mod series;
mod tokens;

use std::sync::Arc;

use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use lazaret_core::check_name;
use lazaret_store::Store;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::app::App;
use crate::error::ApiError;
use crate::metrics as m;

type Shared<S> = State<Arc<App<S>>>;
type ApiResult = Result<Response, ApiError>;

/// Jobs in one lease at most.
const LEASE_JOBS_MAX: u32 = 1000;
/// Longest long-poll.
const WAIT_MS_MAX: u64 = 60_000;
/// Longest `delay_ms` (enqueue) and `retry_after_ms` (a fail's error): 366
/// days. Anything longer is refused before it is written, so every time the
/// server keeps stays far inside what it can format and compute with.
pub const DELAY_MS_MAX: u64 = 366 * 24 * 60 * 60 * 1000;

/// `400 BAD_REQUEST` when a client's duration is over `max`.
fn check_duration(name: &str, ms: Option<u64>, max: u64) -> Result<(), ApiError> {
    match ms {
        Some(ms) if ms > max => Err(ApiError::bad_request(format!(
            "{name} must be at most {max} (366 days; got {ms}); for a longer wait, \
             keep the job outside lazaret and enqueue it nearer the time"
        ))),
        _ => Ok(()),
    }
}

/// Most lanes or types one lease request may name.
const LEASE_NAMES_MAX: usize = 256;

/// `400 BAD_REQUEST` naming the field and its limit when a client-chosen
/// name is longer than `max` bytes or holds a control character; counted
/// as a rejection.
fn check_field(field: &str, value: Option<&str>, max: usize) -> Result<(), ApiError> {
    match value.map(|v| check_name(field, v, max)) {
        Some(Err(e)) => {
            m::rejected("BAD_REQUEST");
            Err(ApiError::bad_request(format!(
                "{e}; these names travel on every job and attempt record (see docs/api.md, Limits on names)"
            )))
        }
        _ => Ok(()),
    }
}

/// A list endpoint's `limit`: 1 to `max` (over `max` is clamped), `default`
/// when absent; 0 is refused rather than quietly read as "some".
fn page_limit(limit: Option<u32>, default: u32, max: u32) -> Result<u32, ApiError> {
    match limit {
        None => Ok(default),
        Some(0) => Err(ApiError::bad_request(format!(
            "limit must be at least 1 (at most {max}; leave it out for {default})"
        ))),
        Some(n) => Ok(n.min(max)),
    }
}

/// The router, with every route of the API.
pub fn router<S: Store>(app: Arc<App<S>>) -> Router {
    // The envelope wraps the whole router, outside axum's method routing,
    // so that a 405 already carries its `Allow` header when it is mapped.
    // The Host and Origin rules come first, before any body is read, on
    // every route (`browser`).
    let guard = axum::middleware::from_fn_with_state(Arc::clone(&app), browser::guard::<S>);
    Router::new()
        .fallback_service(routes(app))
        .layer(axum::middleware::from_fn(envelope))
        .layer(guard)
}

/// The body cap of a single outcome (`ack`, `fail`, `heartbeat`): 4 MiB,
/// so a worker's 3 MB traceback arrives whole and is truncated as
/// documented (`MESSAGE_BYTES_MAX`, `TRACEBACK_BYTES_MAX`) rather than
/// refused.
pub const OUTCOME_BODY_BYTES_MAX: usize = 4 * 1024 * 1024;
/// The body cap of a lease request.
pub const LEASE_BODY_BYTES_MAX: usize = 64 * 1024;
/// The body cap of operator requests (redrive, purge, pause, resume): room
/// for thousands of ids.
pub const OPERATE_BODY_BYTES_MAX: usize = 1024 * 1024;
/// The body cap of a cancel (an optional reason for the audit log).
pub const CANCEL_BODY_BYTES_MAX: usize = 16 * 1024;
/// The body cap of a token request.
pub const TOKEN_BODY_BYTES_MAX: usize = 16 * 1024;

fn routes<S: Store>(app: Arc<App<S>>) -> Router {
    let body_timeout = app.config.http.body_read_timeout;
    // Every body's read waits at most `body_read_timeout_ms` for each next
    // piece; each route's cap is in the table (`routes::table`).
    routes::router(&app)
        .fallback(|| async { ApiError::not_found("no such route; see docs/api.md") })
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            body_timeout,
        ))
        .with_state(app)
}

/// Whether a path has a `%` not followed by two hex digits.
fn bad_percent_encoding(path: &str) -> bool {
    let b = path.as_bytes();
    b.iter().enumerate().any(|(i, &c)| {
        c == b'%'
            && !(b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit))
    })
}

/// Puts every error answer in the contract's envelope: axum's own answers
/// (405, and the rejections of its extractors: a query string, a path or a
/// body it could not read) are plain text; they become
/// `{"error": {"code", "reason", "message"}}`, keeping their status and
/// `Allow` header.
async fn envelope(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    if bad_percent_encoding(&path) {
        m::rejected("BAD_REQUEST");
        return ApiError::bad_request(format!(
            "the path {path:?} has a `%` not followed by two hex digits; percent-encode it (`%` is `%25`)"
        ))
        .into_response();
    }
    let resp = next.run(req).await;
    let status = resp.status();
    let json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 16 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let allow = parts.headers.get(header::ALLOW).cloned();
    let mut err = match status {
        StatusCode::METHOD_NOT_ALLOWED => {
            let methods = allow
                .as_ref()
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            ApiError::new(
                status,
                crate::error::Code::BadRequest,
                format!(
                    "{method} is not allowed on {path}; it takes {methods} (the Allow header lists them)"
                ),
            )
        }
        StatusCode::PAYLOAD_TOO_LARGE => {
            ApiError::too_large(format!("{text}; the request body is too large for {path}"))
        }
        StatusCode::NOT_FOUND => ApiError::not_found(format!("{text}; see docs/api.md")),
        s if s.is_server_error() => ApiError::new(
            s,
            crate::error::Code::Internal,
            format!("{text}; the server failed"),
        ),
        s => ApiError::new(
            s,
            crate::error::Code::BadRequest,
            format!("{text}; see docs/api.md for {method} {path}"),
        ),
    };
    if err.message.starts_with(';') {
        err.message = err.message.trim_start_matches(';').trim_start().to_owned();
    }
    m::rejected_code(&err.code);
    let mut out = err.into_response();
    if let Some(allow) = allow {
        out.headers_mut().insert(header::ALLOW, allow);
    }
    out
}

/// The longest request text an audit entry keeps, in bytes.
pub const AUDIT_REQUEST_BYTES_MAX: usize = 16 * 1024;

/// A request as its audit entry keeps it: the JSON body as received when
/// it reads as JSON (nested at most 128 deep, serde_json's limit) and is at
/// most [`AUDIT_REQUEST_BYTES_MAX`] bytes; otherwise its text, cut at that
/// size: `{"raw": TEXT, "bytes": N, "truncated": BOOL}`. Never `null` for a
/// request that was acted on.
pub fn audit_request(body: &[u8]) -> Value {
    if body.len() <= AUDIT_REQUEST_BYTES_MAX {
        if let Ok(v) = serde_json::from_slice::<Value>(body) {
            return v;
        }
    }
    let head = &body[..body.len().min(AUDIT_REQUEST_BYTES_MAX)];
    // Cut on a character boundary; bytes that are not UTF-8 become U+FFFD.
    let text = match std::str::from_utf8(head) {
        Ok(t) => t.to_owned(),
        Err(e) if e.error_len().is_none() => {
            String::from_utf8_lossy(&head[..e.valid_up_to()]).into_owned()
        }
        Err(_) => String::from_utf8_lossy(head).into_owned(),
    };
    json!({ "raw": text, "bytes": body.len(), "truncated": head.len() < body.len() })
}

/// The policy of a stored payload: nothing in it may load or run, and a
/// browser that opens it anyway treats it as a page of its own origin.
pub const PAYLOAD_CSP: &str = "default-src 'none'; sandbox";

/// A stored payload (a job's or a dead letter's) as the answer: its bytes,
/// byte for byte, as a download that can never run in lazaret's origin.
/// A broker message's body is whatever its producer sent (an HTML page, an
/// SVG with script), so it is never served as its own type: `application/json`
/// when it parses as JSON, `application/octet-stream` otherwise, the
/// message's own type in `Lazaret-Content-Type`, with `Content-Disposition:
/// attachment`, `nosniff` and [`PAYLOAD_CSP`].
fn stored_payload(bytes: Vec<u8>, own_type: Option<&str>, name: &str) -> Response {
    let json = serde_json::from_slice::<serde::de::IgnoredAny>(&bytes).is_ok();
    let (content_type, ext) = if json {
        ("application/json", "json")
    } else {
        ("application/octet-stream", "bin")
    };
    let mut resp = axum::body::Body::from(bytes).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    if let Ok(v) = header::HeaderValue::from_str(&format!("attachment; filename=\"{name}.{ext}\""))
    {
        h.insert(header::CONTENT_DISPOSITION, v);
    }
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        header::HeaderValue::from_static(PAYLOAD_CSP),
    );
    if let Some(v) = own_type.and_then(|t| header::HeaderValue::from_str(t).ok()) {
        h.insert("lazaret-content-type", v);
    }
    resp
}

fn ok(v: Value) -> ApiResult {
    Ok(Json(v).into_response())
}

fn parse_json<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        ApiError::bad_request(format!(
            "the request body is not valid: {}",
            not_object(bytes, &e)
        ))
    })
}

/// A parse error, saying so first when the body is JSON but not an object.
fn not_object(bytes: &[u8], e: &serde_json::Error) -> String {
    let first = bytes.iter().find(|b| !b.is_ascii_whitespace());
    match first {
        Some(b'{') | None => e.to_string(),
        Some(_) if e.is_data() => format!("it must be a JSON object ({{...}}): {e}"),
        Some(_) => e.to_string(),
    }
}

fn parse_id(id: &str, what: &str) -> Result<u64, ApiError> {
    id.parse()
        .map_err(|_| ApiError::not_found(format!("no {what} with id {id:?}")))
}

/// 200 while the store takes work; once it has stopped writing for good (a
/// commit could not be made durable), 503 `UNAVAILABLE` with why, so a load
/// balancer or supervisor takes the node out and restarts it. Also 503
/// while the store refuses writes (a full disk: "the store is not
/// writable: …"), until a write succeeds again.
async fn healthz<S: Store>(State(app): Shared<S>) -> Result<&'static str, ApiError> {
    match app.store.failure().or_else(|| app.store_writes.refusal()) {
        None => Ok("ok"),
        Some(why) => Err(ApiError::unavailable(why)),
    }
}

fn empty_none(s: Option<String>) -> Option<String> {
    s.filter(|v| !v.is_empty())
}

fn connection_close(mut resp: Response) -> Response {
    resp.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    resp
}
