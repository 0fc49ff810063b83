//! The HTTP API (see `docs/api.md` and the contract): routes and handlers.
//! Handlers move bytes; the core decides and the store applies.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use lazaret_core::{
    AdmissionRequest, DeadLetterReason, ErrorKind, Event, Failure, FailureClass,
    IDEMPOTENCY_KEY_BYTES_MAX, JobId, JobState, JobType, Lane, NAME_BYTES_MAX, TenantId, Timestamp,
    Transition, Verdict, WorkerId, admit, check_name, payload_preview, payload_sha256,
};
use lazaret_guard::{RedriveError, SourceSet};
use lazaret_store::{
    AdmissionRecord, ApiToken, AuditEntry, AuditId, AuditQuery, Completed, Completion,
    DeadLetterFilter, DeadLetterId, EnqueueOutcome, LeaseRequest, LeaseToken, NewJob, Selector,
    Stage, Store, TokenError,
};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::app::{App, now};
use crate::auth::{Action, Caller, authenticate, check_token_name, forbidden, new_secret};
use crate::config::{Role, TokenConfig, token_sha256};
use crate::error::ApiError;
use crate::{metrics as m, views};

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
    Router::new()
        .fallback_service(routes(app))
        .layer(axum::middleware::from_fn(envelope))
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
/// The body cap of a token request.
pub const TOKEN_BODY_BYTES_MAX: usize = 16 * 1024;

fn routes<S: Store>(app: Arc<App<S>>) -> Router {
    use axum::extract::DefaultBodyLimit as Cap;
    let batch = app.config.batch_bytes_max;
    let body_timeout = Duration::from_millis(app.config.http.body_read_timeout_ms);
    // `/v1/jobs` and `/v1/jobs/batch` read their bodies themselves, capped
    // while they stream (`read_capped`); every other body is buffered by
    // axum up to the cap of its route. Every body's read waits at most
    // `body_read_timeout_ms` for each next piece.
    Router::new()
        .route("/healthz", get(healthz::<S>))
        .route("/metrics", get(metrics::<S>))
        .route("/v1/jobs", post(enqueue::<S>))
        .route("/v1/jobs/batch", post(enqueue_batch::<S>))
        .route("/v1/jobs/{id}", get(job::<S>))
        .route(
            "/v1/jobs/{id}/ack",
            post(ack::<S>).layer(Cap::max(OUTCOME_BODY_BYTES_MAX)),
        )
        .route(
            "/v1/jobs/{id}/fail",
            post(fail::<S>).layer(Cap::max(OUTCOME_BODY_BYTES_MAX)),
        )
        .route(
            "/v1/jobs/{id}/heartbeat",
            post(heartbeat::<S>).layer(Cap::max(OUTCOME_BODY_BYTES_MAX)),
        )
        .route(
            "/v1/leases",
            post(lease::<S>).layer(Cap::max(LEASE_BODY_BYTES_MAX)),
        )
        .route("/v1/acks", post(acks::<S>).layer(Cap::max(batch)))
        .route("/v1/fails", post(fails::<S>).layer(Cap::max(batch)))
        .route("/v1/dead-letters", get(dead_letters::<S>))
        .route("/v1/dead-letters/reasons", get(reasons::<S>))
        .route(
            "/v1/dead-letters/redrive",
            post(redrive::<S>).layer(Cap::max(OPERATE_BODY_BYTES_MAX)),
        )
        .route(
            "/v1/dead-letters/purge",
            post(purge::<S>).layer(Cap::max(OPERATE_BODY_BYTES_MAX)),
        )
        .route("/v1/dead-letters/{id}", get(dead_letter::<S>))
        .route(
            "/v1/dead-letters/{id}/payload",
            get(dead_letter_payload::<S>),
        )
        .route("/v1/stats", get(stats::<S>))
        .route("/v1/breakers", get(breakers::<S>))
        .route(
            "/v1/pause",
            post(pause::<S>).layer(Cap::max(OPERATE_BODY_BYTES_MAX)),
        )
        .route(
            "/v1/resume",
            post(resume::<S>).layer(Cap::max(OPERATE_BODY_BYTES_MAX)),
        )
        .route("/v1/audit", get(audit::<S>))
        .route(
            "/v1/tokens",
            get(tokens::<S>)
                .post(create_token::<S>)
                .layer(Cap::max(TOKEN_BODY_BYTES_MAX)),
        )
        .route("/v1/tokens/{name}", delete(revoke_token::<S>))
        .route_layer(axum::middleware::from_fn_with_state(
            Arc::clone(&app),
            authorize_first::<S>,
        ))
        .fallback(|| async { ApiError::not_found("no such route; see docs/api.md") })
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
            body_timeout,
        ))
        .with_state(app)
}

/// What a request with a body wants to do, from its method and path.
fn body_action(method: &axum::http::Method, path: &str) -> Option<Action> {
    if method != axum::http::Method::POST {
        return None;
    }
    let segs: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    Some(match segs.as_slice() {
        ["v1", "jobs"] | ["v1", "jobs", "batch"] => Action::Produce,
        ["v1", "jobs", _, "ack" | "fail" | "heartbeat"] | ["v1", "leases" | "acks" | "fails"] => {
            Action::Work
        }
        ["v1", "dead-letters", "redrive"] | ["v1", "pause" | "resume"] => Action::Operate,
        ["v1", "dead-letters", "purge"] | ["v1", "tokens"] => Action::Administer,
        _ => return None,
    })
}

/// Authenticates every request, and authorises every request with a body,
/// before a byte of the body is read: an unknown or unauthorised caller is
/// refused (401/403, `Connection: close`) without the server buffering what
/// it sent. The handlers check again (cheaply: tokens are in memory).
async fn authorize_first<S: Store>(
    State(app): Shared<S>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if matches!(req.uri().path(), "/healthz" | "/metrics") {
        return next.run(req).await;
    }
    let checked = match body_action(req.method(), req.uri().path()) {
        Some(action) => allow(&app, req.headers(), action).await.map(|_| ()),
        None => {
            let api = app.api_tokens.read().unwrap_or_else(|p| p.into_inner());
            authenticate(&app.config.tokens, &api, req.headers())
                .map(|_| ())
                .inspect_err(|e| m::rejected(e.code.as_str()))
        }
    };
    match checked {
        Ok(()) => next.run(req).await,
        // Closed after the answer: the unread body is never drained.
        Err(e) => connection_close(e.into_response()),
    }
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
    m::rejected(err.code.as_str());
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

fn ok(v: Value) -> ApiResult {
    Ok(Json(v).into_response())
}

/// Authenticates and authorises; a refused operator action is audited.
async fn allow<S: Store>(
    app: &App<S>,
    headers: &HeaderMap,
    action: Action,
) -> Result<Caller, ApiError> {
    let caller = {
        let api = app.api_tokens.read().unwrap_or_else(|p| p.into_inner());
        authenticate(&app.config.tokens, &api, headers)
    }
    .inspect_err(|e| m::rejected(e.code.as_str()))?;
    if action.allowed_for(caller.role) {
        return Ok(caller);
    }
    if matches!(
        action,
        Action::Operate | Action::Administer | Action::ReadDeadLetters
    ) {
        let entry = AuditEntry {
            at: now(),
            actor: caller.name.clone(),
            action: "denied".into(),
            request: json!({ "wanted": format!("{action:?}") }),
            count: 0,
        };
        let _ = app.store.audit(entry).await;
    }
    m::rejected("FORBIDDEN");
    Err(forbidden(&caller, action))
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
/// balancer or supervisor takes the node out and restarts it.
async fn healthz<S: Store>(State(app): Shared<S>) -> Result<&'static str, ApiError> {
    match app.store.failure() {
        None => Ok("ok"),
        Some(why) => Err(ApiError::unavailable(why)),
    }
}

// ---------------------------------------------------------------- producers

/// A field that is there, even as `null` (`Option`'s own deserializer reads
/// `null` as absent).
fn present<'de: 'a, 'a, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<&'a RawValue>, D::Error> {
    <&'a RawValue>::deserialize(d).map(Some)
}

#[derive(Debug, Deserialize)]
struct EnqueueBody<'a> {
    #[serde(rename = "type")]
    job_type: Option<String>,
    tenant: Option<String>,
    lane: Option<String>,
    /// `None` only when the key is absent: `"payload": null` is a payload.
    #[serde(borrow, default, deserialize_with = "present")]
    payload: Option<&'a RawValue>,
    idempotency_key: Option<String>,
    schema_version: Option<u32>,
    delay_ms: Option<u64>,
}

/// Reads a body up to `cap` bytes; over it, returns what was read so far
/// and the size seen (announced or counted) without reading the rest.
enum Read {
    Whole(Bytes),
    TooLarge {
        head: Vec<u8>,
        size: u64,
        announced: bool,
    },
}

async fn read_capped(headers: &HeaderMap, body: Body, cap: usize) -> Result<Read, ApiError> {
    let announced: Option<u64> = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    let mut stream = body.into_data_stream();
    if let Some(len) = announced.filter(|l| *l > cap as u64) {
        // Refuse before reading the body; keep at most a preview's worth.
        let mut head = Vec::new();
        if let Ok(Some(Ok(chunk))) =
            tokio::time::timeout(Duration::from_millis(200), stream.next()).await
        {
            head.extend_from_slice(&chunk[..chunk.len().min(4096)]);
        }
        return Ok(Read::TooLarge {
            head,
            size: len,
            announced: true,
        });
    }
    let mut buf = Vec::with_capacity(announced.unwrap_or(0).min(cap as u64) as usize);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk
            .map_err(|e| ApiError::bad_request(format!("could not read the request body: {e}")))?;
        if buf.len() + chunk.len() > cap {
            let size = (buf.len() + chunk.len()) as u64;
            let mut head = buf;
            head.truncate(4096);
            return Ok(Read::TooLarge {
                head,
                size,
                announced: false,
            });
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Read::Whole(Bytes::from(buf)))
}

fn connection_close(mut resp: Response) -> Response {
    resp.headers_mut().insert(
        header::CONNECTION,
        header::HeaderValue::from_static("close"),
    );
    resp
}

async fn record_poison<S: Store>(app: &App<S>, rec: AdmissionRecord) {
    let now = rec.now;
    app.observe_admission(rec.job_type.as_deref(), rec.reason, &rec.message, now);
    if app.admission_record_allowed(rec.tenant.as_deref(), now) {
        if let Err(e) = app.store.record_admission(rec).await {
            tracing::error!(error = %e, "could not record an admission dead letter");
        }
    } else {
        m::admission_record_dropped();
    }
}

/// Admission of one parsed job; `Ok(NewJob)` or the error answer (and the
/// poison record when it is one).
async fn admit_one<S: Store>(
    app: &App<S>,
    body: &EnqueueBody<'_>,
    enqueued_by: Option<&str>,
    now: Timestamp,
) -> Result<NewJob, ApiError> {
    if let Err(e) = check_duration("delay_ms", body.delay_ms, DELAY_MS_MAX) {
        m::rejected(e.code.as_str());
        return Err(e);
    }
    check_field("type", body.job_type.as_deref(), NAME_BYTES_MAX)?;
    check_field("tenant", body.tenant.as_deref(), NAME_BYTES_MAX)?;
    check_field("lane", body.lane.as_deref(), NAME_BYTES_MAX)?;
    check_field(
        "idempotency_key",
        body.idempotency_key.as_deref(),
        IDEMPOTENCY_KEY_BYTES_MAX,
    )?;
    let payload = body.payload.map(|p| p.get().as_bytes()).unwrap_or_default();
    let lane = body.lane.clone().unwrap_or_else(|| "default".to_owned());
    let shed = body
        .job_type
        .as_deref()
        .and_then(|ty| app.shed(ty, &lane, now));
    let verdict = if body.payload.is_none() {
        Verdict::BadRequest {
            message: "payload is required: send \"payload\": <any JSON value>".into(),
        }
    } else if lane.trim().is_empty() {
        Verdict::BadRequest {
            message: "lane must not be empty; leave it out to use the default lane".into(),
        }
    } else {
        admit(
            &app.config.admission,
            &AdmissionRequest {
                job_type: body.job_type.as_deref(),
                tenant: body.tenant.as_deref(),
                schema_version: body.schema_version,
                payload,
                declared_size: None,
                shed,
            },
        )
    };
    let schema_version = match verdict {
        Verdict::Admitted { schema_version } => schema_version,
        other => {
            if let Verdict::Poison {
                reason, message, ..
            } = &other
            {
                let reason = DeadLetterReason::from_poison(*reason);
                record_poison(
                    app,
                    AdmissionRecord {
                        job_type: body.job_type.clone(),
                        tenant: body.tenant.clone(),
                        lane: Some(lane.clone()),
                        reason,
                        message: message.clone(),
                        payload_size: payload.len() as u64,
                        payload_sha256: Some(hex::encode(payload_sha256(payload))),
                        payload_preview: payload_preview(payload, 4096).to_owned(),
                        payload: Some(payload.to_vec()),
                        idempotency_key: body.idempotency_key.clone(),
                        now,
                    },
                )
                .await;
            }
            let e =
                ApiError::from_verdict(other).unwrap_or_else(|| ApiError::bad_request("refused"));
            m::rejected(e.code.as_str());
            return Err(e);
        }
    };
    Ok(NewJob {
        job_type: JobType::new(body.job_type.clone().unwrap_or_default()),
        tenant: TenantId::new(body.tenant.clone().unwrap_or_default()),
        lane: Lane::new(lane),
        payload: payload.to_vec(),
        idempotency_key: body.idempotency_key.clone(),
        schema_version,
        run_at: now.saturating_add(Duration::from_millis(body.delay_ms.unwrap_or(0))),
        now,
        enqueued_by: enqueued_by.map(str::to_owned),
    })
}

/// The name recorded as a job's `enqueued_by`: the caller's token, or
/// nothing when auth is off (everyone is `anonymous` then).
fn enqueuer<'a, S: Store>(app: &App<S>, caller: &'a Caller) -> Option<&'a str> {
    app.auth_on().then_some(caller.name.as_str())
}

/// What a reply to an enqueue needs of the job (not its payload).
struct Admitted {
    job_type: JobType,
    lane: Lane,
    tenant: TenantId,
}

/// Whether an enqueue put a job in the queue now (not a duplicate, not
/// scheduled for later: promotion wakes the waiters then).
fn made_ready(outcome: &EnqueueOutcome) -> bool {
    matches!(
        outcome,
        EnqueueOutcome::Created {
            state: JobState::Queued,
            ..
        }
    )
}

impl Admitted {
    fn of(job: &NewJob) -> Self {
        Admitted {
            job_type: job.job_type.clone(),
            lane: job.lane.clone(),
            tenant: job.tenant.clone(),
        }
    }
}

fn enqueue_reply<S: Store>(
    app: &App<S>,
    job: &Admitted,
    outcome: &EnqueueOutcome,
) -> (StatusCode, Value) {
    match outcome {
        EnqueueOutcome::Created {
            id,
            state,
            inflight,
        } => {
            m::enqueued(job.job_type.as_str(), job.lane.as_str());
            let admission = if app.config.scheduler.at_cap(&job.tenant, *inflight) {
                "FAIR_QUEUE"
            } else {
                "ADMITTED"
            };
            (
                StatusCode::CREATED,
                json!({ "id": id.to_string(), "state": state.as_str(), "admission": admission }),
            )
        }
        EnqueueOutcome::Duplicate { id, state } => (
            StatusCode::OK,
            json!({ "id": id.to_string(), "state": state.as_str(), "admission": "DUPLICATE" }),
        ),
    }
}

async fn too_large_body<S: Store>(
    app: &App<S>,
    head: Vec<u8>,
    size: u64,
    announced: bool,
    cap: usize,
    what: &str,
) -> ApiError {
    let message = format!(
        "the request body is {}{size} bytes; the cap is {cap} bytes ({what}). Store large blobs elsewhere and enqueue a reference",
        if announced { "announced as " } else { "over " }
    );
    record_poison(
        app,
        AdmissionRecord {
            job_type: None,
            tenant: None,
            lane: None,
            reason: DeadLetterReason::PayloadTooLarge,
            message: message.clone(),
            payload_size: size,
            payload_sha256: None,
            payload_preview: payload_preview(&head, 4096).to_owned(),
            payload: None,
            idempotency_key: None,
            now: now(),
        },
    )
    .await;
    m::rejected("POISON");
    ApiError::too_large(message)
}

async fn enqueue<S: Store>(State(app): Shared<S>, headers: HeaderMap, body: Body) -> ApiResult {
    let caller = allow(&app, &headers, Action::Produce).await?;
    let cap = app.config.admission.body_bytes_max();
    let bytes = match read_capped(&headers, body, cap).await? {
        Read::Whole(b) => b,
        Read::TooLarge {
            head,
            size,
            announced,
        } => {
            let e = too_large_body(
                &app,
                head,
                size,
                announced,
                cap,
                "payload_bytes_max + 16 KiB",
            )
            .await;
            return Ok(connection_close(e.into_response()));
        }
    };
    let now = now();
    let parsed: EnqueueBody<'_> = match serde_json::from_slice(&bytes) {
        Ok(b) => b,
        Err(e) if e.is_syntax() || e.is_eof() => {
            let message = format!(
                "the request body is not valid JSON: {e}; send a JSON object with type, tenant and payload"
            );
            record_poison(
                &app,
                AdmissionRecord {
                    job_type: None,
                    tenant: None,
                    lane: None,
                    reason: DeadLetterReason::InvalidJson,
                    message: message.clone(),
                    payload_size: bytes.len() as u64,
                    payload_sha256: Some(hex::encode(payload_sha256(&bytes))),
                    payload_preview: payload_preview(&bytes, 4096).to_owned(),
                    payload: Some(bytes.to_vec()),
                    idempotency_key: None,
                    now,
                },
            )
            .await;
            m::rejected("POISON");
            let mut err = ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                crate::error::Code::Poison,
                message,
            );
            err.reason = Some("invalid_json");
            return Err(err);
        }
        Err(e) => {
            return Err(ApiError::bad_request(format!(
                "the job is not valid: {}",
                not_object(&bytes, &e)
            )));
        }
    };
    let job = admit_one(&app, &parsed, enqueuer(&app, &caller), now).await?;
    let admitted = Admitted::of(&job);
    let outcome = app.store.enqueue(vec![job]).await?;
    let (status, body) = enqueue_reply(&app, &admitted, &outcome[0]);
    if made_ready(&outcome[0]) {
        app.ready.jobs([(&admitted.lane, &admitted.job_type)]);
    }
    Ok((status, Json(body)).into_response())
}

#[derive(Debug, Deserialize)]
struct BatchBody<'a> {
    #[serde(borrow)]
    jobs: Vec<&'a RawValue>,
}

async fn enqueue_batch<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
    let caller = allow(&app, &headers, Action::Produce).await?;
    let cap = app.config.batch_bytes_max;
    let bytes = match read_capped(&headers, body, cap).await? {
        Read::Whole(b) => b,
        Read::TooLarge {
            head,
            size,
            announced,
        } => {
            let e = too_large_body(&app, head, size, announced, cap, "batch_bytes_max").await;
            return Ok(connection_close(e.into_response()));
        }
    };
    let batch: BatchBody<'_> = parse_json(&bytes)?;
    let now = now();
    let mut results: Vec<Option<Value>> = vec![None; batch.jobs.len()];
    let mut admitted: Vec<(usize, Admitted)> = Vec::new();
    let mut jobs: Vec<NewJob> = Vec::new();
    for (i, raw) in batch.jobs.iter().enumerate() {
        let item: Result<EnqueueBody<'_>, _> = serde_json::from_str(raw.get());
        match item {
            Ok(item) => match admit_one(&app, &item, enqueuer(&app, &caller), now).await {
                Ok(job) => {
                    admitted.push((i, Admitted::of(&job)));
                    jobs.push(job);
                }
                Err(e) => results[i] = Some(e.body()),
            },
            Err(e) => {
                results[i] =
                    Some(ApiError::bad_request(format!("job {i} is not valid: {e}")).body())
            }
        }
    }
    if !admitted.is_empty() {
        let outcomes = app.store.enqueue(jobs).await?;
        for ((i, job), outcome) in admitted.iter().zip(&outcomes) {
            results[*i] = Some(enqueue_reply(&app, job, outcome).1);
        }
        app.ready.jobs(
            admitted
                .iter()
                .zip(&outcomes)
                .filter(|(_, o)| made_ready(o))
                .map(|((_, job), _)| (&job.lane, &job.job_type)),
        );
    }
    ok(json!({ "results": results }))
}

async fn job<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    let caller = allow(&app, &headers, Action::ReadJob).await?;
    let id = parse_id(&id, "job")?;
    let view = app
        .store
        .job(JobId(id))
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no job with id {id}")))?;
    if !caller.may_read_job(view.enqueued_by.as_deref()) {
        m::rejected("FORBIDDEN");
        return Err(ApiError::forbidden(format!(
            "job {id} was enqueued by another token; a producer reads only the jobs it enqueued. \
             Read it with the token that enqueued it, or ask an operator"
        )));
    }
    Ok(Json(views::job(&view, now())).into_response())
}

// ---------------------------------------------------------------- workers

#[derive(Debug, Deserialize)]
struct LeaseBody {
    worker_id: Option<String>,
    lanes: Option<Vec<String>>,
    types: Option<Vec<String>>,
    max_jobs: Option<u32>,
    lease_ms: Option<u64>,
    wait_ms: Option<u64>,
}

async fn lease<S: Store>(State(app): Shared<S>, headers: HeaderMap, body: Bytes) -> ApiResult {
    allow(&app, &headers, Action::Work).await?;
    let b: LeaseBody = parse_json(&body)?;
    let max_jobs = b.max_jobs.unwrap_or(1);
    if max_jobs == 0 || max_jobs > LEASE_JOBS_MAX {
        return Err(ApiError::bad_request(format!(
            "max_jobs must be between 1 and {LEASE_JOBS_MAX} (got {max_jobs})"
        )));
    }
    let lease_ms = b.lease_ms.unwrap_or(app.config.lease_ms_default);
    if lease_ms == 0 || lease_ms > app.config.lease_ms_max {
        return Err(ApiError::bad_request(format!(
            "lease_ms must be between 1 and {} (lease_ms_max; got {lease_ms})",
            app.config.lease_ms_max
        )));
    }
    check_field("worker_id", b.worker_id.as_deref(), NAME_BYTES_MAX)?;
    for (field, names) in [("lanes", &b.lanes), ("types", &b.types)] {
        let names = names.as_deref().unwrap_or_default();
        if names.len() > LEASE_NAMES_MAX {
            return Err(ApiError::bad_request(format!(
                "{field} names {} entries; a lease may name at most {LEASE_NAMES_MAX}",
                names.len()
            )));
        }
        for n in names {
            check_field(&format!("{field}[]"), Some(n), NAME_BYTES_MAX)?;
        }
    }
    let wait = Duration::from_millis(b.wait_ms.unwrap_or(0).min(WAIT_MS_MAX));
    let deadline = tokio::time::Instant::now() + wait;
    let worker_id = WorkerId::new(b.worker_id.unwrap_or_else(|| "anonymous".into()));
    let lanes = b
        .lanes
        .map(|ls| ls.into_iter().map(Lane::new).collect::<Vec<_>>());
    let types = b
        .types
        .map(|ts| ts.into_iter().map(JobType::new).collect::<Vec<_>>());
    let interest = crate::ready::Interest {
        lanes: lanes.as_deref(),
        types: types.as_deref(),
    };
    loop {
        let notified = app.ready.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let mut seen = app.ready.seq();
        let now = now();
        let (exclude_types, exclude_lanes, type_limits) = app.lease_filters(now);
        let req = LeaseRequest {
            worker_id: worker_id.clone(),
            lanes: lanes.clone(),
            types: types.clone(),
            exclude_types,
            exclude_lanes,
            type_limits: type_limits.clone(),
            max_jobs,
            lease: Duration::from_millis(lease_ms),
            now,
        };
        let jobs = app.store.lease(req).await?;
        if !jobs.is_empty() || tokio::time::Instant::now() >= deadline || app.is_stopping() {
            if !type_limits.is_empty() {
                let mut br = app.breakers.lock().unwrap_or_else(|p| p.into_inner());
                for j in &jobs {
                    if type_limits.iter().any(|(t, _)| t == &j.job_type) {
                        br.try_lease(&j.job_type, now);
                    }
                }
            }
            return Ok(Json(views::LeaseReply {
                jobs: jobs.iter().map(views::leased).collect(),
            })
            .into_response());
        }
        // Sleep until something may have made a job this lease takes
        // ready (or the wait ends): an enqueue of other lanes or types
        // costs this waiter no store call.
        loop {
            // A shutdown ends the wait at once: the worker gets no jobs
            // and polls again (another node, or this one restarted).
            let woken = tokio::select! {
                r = tokio::time::timeout_at(deadline, notified.as_mut()) => r.is_ok(),
                () = app.stopping() => false,
            };
            if !woken {
                break;
            }
            // Re-armed before looking, so an event after the look wakes it.
            notified.set(app.ready.notified());
            notified.as_mut().enable();
            let (relevant, newest) = app.ready.relevant_since(seen, interest);
            if relevant {
                break;
            }
            seen = newest;
        }
    }
}

#[derive(Debug, Deserialize)]
struct AckBody {
    lease_token: String,
}

#[derive(Debug, Deserialize)]
struct ErrorBody {
    class: Option<String>,
    kind: Option<String>,
    message: Option<String>,
    traceback: Option<String>,
    retry_after_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct FailBody {
    lease_token: String,
    error: ErrorBody,
}

#[derive(Debug, Deserialize)]
struct ItemBody {
    id: String,
    lease_token: String,
    error: Option<ErrorBody>,
}

fn token(t: &str) -> Result<LeaseToken, ApiError> {
    // A token that is not even a number cannot be anyone's current lease.
    Ok(LeaseToken(t.trim().parse().unwrap_or(0)))
}

fn failure(e: ErrorBody) -> Result<Failure, ApiError> {
    check_duration("error.retry_after_ms", e.retry_after_ms, DELAY_MS_MAX)?;
    check_field("error.kind", e.kind.as_deref(), NAME_BYTES_MAX)?;
    let class = match e.class.as_deref() {
        None => None,
        Some("transient") => Some(FailureClass::Transient),
        Some("permanent") => Some(FailureClass::Permanent),
        Some("deferred") => Some(FailureClass::Deferred),
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "error.class {other:?} is not one of transient, permanent, deferred (or leave it out to classify by kind)"
            )));
        }
    };
    let kind = e
        .kind
        .filter(|k| !k.trim().is_empty())
        .unwrap_or_else(|| "error".into());
    Ok(Failure {
        class,
        kind: ErrorKind::new(kind),
        message: e.message.unwrap_or_default(),
        traceback: e.traceback,
        retry_after: e.retry_after_ms.map(Duration::from_millis),
    })
}

fn outcome_reply(c: &Completed) -> Value {
    match c.transition {
        Transition::Succeeded => json!({ "state": "succeeded" }),
        Transition::Retry { at, attempt } => {
            json!({ "state": "scheduled", "retry_at": views::time(at), "attempt": attempt })
        }
        Transition::Defer { until } => {
            json!({ "state": "scheduled", "retry_at": views::time(until), "attempt": c.attempt, "deferred": true })
        }
        Transition::DeadLetter { reason } => json!({
            "state": "dead_lettered", "reason": reason.as_str(), "attempt": c.attempt,
            "dead_letter_id": c.dead_letter.map(|d| d.to_string()),
        }),
    }
}

async fn complete<S: Store>(
    app: &App<S>,
    items: Vec<(String, Result<Completion, ApiError>)>,
) -> Result<Vec<Result<Value, ApiError>>, ApiError> {
    let now = now();
    let mut ids = Vec::with_capacity(items.len());
    let mut valid = Vec::new();
    let mut slots: Vec<Result<usize, ApiError>> = Vec::with_capacity(items.len());
    for (id, item) in items {
        ids.push(id);
        match item {
            Ok(c) => {
                slots.push(Ok(valid.len()));
                valid.push(c);
            }
            Err(e) => slots.push(Err(e)),
        }
    }
    let results = if valid.is_empty() {
        Vec::new()
    } else {
        app.store.complete(valid, now).await?
    };
    app.observe(results.iter().filter_map(|r| r.as_ref().ok()), now);
    // A job queued again, or a slot freed for a tenant held at its cap
    // with jobs waiting, may let a waiting lease take something.
    if results.iter().flatten().any(|c| {
        c.freed_slot || matches!(c.transition.next_state(now), lazaret_core::JobState::Queued)
    }) {
        app.ready.anything();
    }
    Ok(slots
        .into_iter()
        .zip(&ids)
        .map(|(slot, id)| match slot {
            Ok(i) => match &results[i] {
                Ok(c) => Ok(outcome_reply(c)),
                Err(e) => Err(ApiError::item(*e, id)),
            },
            Err(e) => Err(e),
        })
        .collect())
}

fn completion(
    id: &str,
    lease_token: &str,
    error: Option<ErrorBody>,
) -> Result<Completion, ApiError> {
    let job = JobId(parse_id(id, "job")?);
    let token = token(lease_token)?;
    let event = match error {
        None => Event::Succeeded,
        Some(e) => Event::Failed(failure(e)?),
    };
    Ok(Completion {
        id: job,
        token,
        event,
    })
}

async fn single<S: Store>(app: &App<S>, id: String, c: Result<Completion, ApiError>) -> ApiResult {
    let mut r = complete(app, vec![(id, c)]).await?;
    r.pop()
        .unwrap_or_else(|| Err(ApiError::bad_request("empty")))
        .map(|v| Json(v).into_response())
}

async fn ack<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    allow(&app, &headers, Action::Work).await?;
    let b: AckBody = parse_json(&body)?;
    let c = completion(&id, &b.lease_token, None);
    single(&app, id, c).await
}

async fn fail<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    allow(&app, &headers, Action::Work).await?;
    let b: FailBody = parse_json(&body)?;
    let c = completion(&id, &b.lease_token, Some(b.error));
    single(&app, id, c).await
}

#[derive(Debug, Deserialize)]
struct ItemsBody {
    items: Vec<ItemBody>,
}

async fn batch_outcomes<S: Store>(app: &App<S>, body: &[u8], failing: bool) -> ApiResult {
    let b: ItemsBody = parse_json(body)?;
    let items = b
        .items
        .into_iter()
        .map(|i| {
            let error = if failing {
                match i.error {
                    Some(e) => Some(e),
                    None => {
                        return (
                            i.id.clone(),
                            Err(ApiError::bad_request(
                                "each item of /v1/fails needs an error",
                            )),
                        );
                    }
                }
            } else {
                None
            };
            let c = completion(&i.id, &i.lease_token, error);
            (i.id, c)
        })
        .collect();
    let results = complete(app, items).await?;
    ok(
        json!({ "results": results.into_iter().map(|r| r.unwrap_or_else(|e| e.body())).collect::<Vec<_>>() }),
    )
}

async fn acks<S: Store>(State(app): Shared<S>, headers: HeaderMap, body: Bytes) -> ApiResult {
    allow(&app, &headers, Action::Work).await?;
    batch_outcomes(&app, &body, false).await
}

async fn fails<S: Store>(State(app): Shared<S>, headers: HeaderMap, body: Bytes) -> ApiResult {
    allow(&app, &headers, Action::Work).await?;
    batch_outcomes(&app, &body, true).await
}

#[derive(Debug, Deserialize)]
struct HeartbeatBody {
    lease_token: String,
    extend_ms: Option<u64>,
}

async fn heartbeat<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    allow(&app, &headers, Action::Work).await?;
    let b: HeartbeatBody = parse_json(&body)?;
    let job = JobId(parse_id(&id, "job")?);
    let extend = b.extend_ms.unwrap_or(app.config.lease_ms_default);
    if extend == 0 || extend > app.config.lease_ms_max {
        return Err(ApiError::bad_request(format!(
            "extend_ms must be between 1 and {} (lease_ms_max; got {extend}); the lease then ends extend_ms from now",
            app.config.lease_ms_max
        )));
    }
    let at = now();
    let until = at.saturating_add(Duration::from_millis(extend));
    match app
        .store
        .heartbeat(job, token(&b.lease_token)?, until, at)
        .await?
    {
        Ok(t) => ok(json!({ "lease_expires_at": views::time(t) })),
        Err(e) => Err(ApiError::item(e, id)),
    }
}

// ---------------------------------------------------------------- dead letters

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DlQuery {
    #[serde(rename = "type")]
    job_type: Option<String>,
    tenant: Option<String>,
    lane: Option<String>,
    reason: Option<String>,
    source: Option<String>,
    stage: Option<String>,
    job_id: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
}

fn empty_none(s: Option<String>) -> Option<String> {
    s.filter(|v| !v.is_empty())
}

fn check_reason(r: &Option<String>) -> Result<(), ApiError> {
    if let Some(r) = r {
        r.parse::<DeadLetterReason>()
            .map_err(|e| ApiError::bad_request(e.to_string()))?;
    }
    Ok(())
}

/// A stage word as the store keeps it; an unknown one is refused, never
/// matched against nothing.
fn stage_word(s: Option<String>) -> Result<Option<String>, ApiError> {
    empty_none(s)
        .map(|s| {
            Stage::parse(&s)
                .map(|st| st.as_str().to_owned())
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "unknown stage {s:?}; expected admission, processing or broker"
                    ))
                })
        })
        .transpose()
}

async fn dead_letters<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    query: Result<Query<DlQuery>, QueryRejection>,
) -> ApiResult {
    allow(&app, &headers, Action::ReadDeadLetters).await?;
    // An unknown parameter is refused: a misspelt filter must not list
    // (or, copied into a redrive, move) every dead letter.
    let Query(q) = query.map_err(|e| {
        ApiError::bad_request(format!(
            "{}; the parameters are type, tenant, lane, reason, source, stage, job_id, limit and cursor",
            e.body_text()
        ))
    })?;
    let filter = DeadLetterFilter {
        job_type: empty_none(q.job_type),
        tenant: empty_none(q.tenant),
        lane: empty_none(q.lane),
        reason: empty_none(q.reason),
        source: empty_none(q.source),
        stage: stage_word(q.stage)?,
        job_id: match empty_none(q.job_id) {
            Some(j) => Some(parse_id(&j, "job")?),
            None => None,
        },
    };
    check_reason(&filter.reason)?;
    let limit = page_limit(q.limit, 50, 1000)?;
    let cursor = match empty_none(q.cursor) {
        Some(c) => Some(DeadLetterId(c.parse().map_err(|_| {
            ApiError::bad_request(format!("cursor {c:?} is not one this server gave"))
        })?)),
        None => None,
    };
    let (items, next) = app.store.dead_letters(filter, limit, cursor).await?;
    ok(json!({
        // A list shows a Celery task's arguments from the payload preview.
        "items": items.iter().map(|d| views::dead_letter(d, None)).collect::<Vec<_>>(),
        "next_cursor": next.map(|c| c.to_string()),
    }))
}

async fn dead_letter<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    allow(&app, &headers, Action::ReadDeadLetters).await?;
    let dl = DeadLetterId(parse_id(&id, "dead letter")?);
    let d = app
        .store
        .dead_letter(dl)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no dead letter with id {id}")))?;
    // One dead letter shows a Celery task's arguments from the whole body.
    let payload = match &d.source {
        Some(s) if views::is_celery(s) => app.store.dead_letter_payload(dl).await?.flatten(),
        _ => None,
    };
    ok(views::dead_letter(&d, payload.as_deref()))
}

async fn dead_letter_payload<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult {
    allow(&app, &headers, Action::ReadDeadLetters).await?;
    let dl = DeadLetterId(parse_id(&id, "dead letter")?);
    let d = app
        .store
        .dead_letter(dl)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no dead letter with id {id}")))?;
    // A broker message's body is whatever its producer sent: answer it as
    // the message's own content type, never as JSON it may not be.
    let content_type = match &d.source {
        Some(s) => s
            .content_type
            .clone()
            .filter(|c| HeaderValue::from_str(c).is_ok())
            .unwrap_or_else(|| "application/octet-stream".to_owned()),
        None => "application/json".to_owned(),
    };
    match app.store.dead_letter_payload(dl).await? {
        None => Err(ApiError::not_found(format!("no dead letter with id {id}"))),
        Some(None) => Err(ApiError::not_found(format!(
            "dead letter {id} has no stored payload: it was refused before it was read whole; its preview is in the dead letter"
        ))),
        Some(Some(bytes)) => {
            Ok(([(header::CONTENT_TYPE, content_type)], Body::from(bytes)).into_response())
        }
    }
}

async fn reasons<S: Store>(State(app): Shared<S>, headers: HeaderMap) -> ApiResult {
    allow(&app, &headers, Action::ReadDeadLetters).await?;
    let r = app.store.reasons().await?;
    ok(json!({ "reasons": r.iter().map(views::reason).collect::<Vec<_>>() }))
}

/// The body of a redrive or purge. Unknown keys are refused: a misspelt
/// `dry_run` must not turn a rehearsal into the real thing.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SelectBody {
    ids: Option<Vec<Value>>,
    filter: Option<SelectFilter>,
    #[serde(default)]
    all: bool,
    #[serde(default)]
    dry_run: bool,
    rate_per_sec: Option<u32>,
    #[serde(default)]
    confirm: bool,
}

/// The filter of a redrive or purge: the contract's keys, no others.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SelectFilter {
    #[serde(rename = "type")]
    job_type: Option<String>,
    tenant: Option<String>,
    lane: Option<String>,
    reason: Option<String>,
    source: Option<String>,
    stage: Option<String>,
}

fn selector(b: &SelectBody) -> Result<Selector, ApiError> {
    match (&b.ids, &b.filter) {
        (Some(ids), None) if !b.all => {
            let ids = ids
                .iter()
                .map(|v| match v {
                    Value::String(s) => s.parse().ok(),
                    Value::Number(n) => n.as_u64(),
                    _ => None,
                })
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| {
                    ApiError::bad_request("ids must be dead-letter ids (strings or numbers)")
                })?;
            Ok(Selector::Ids(ids.into_iter().map(DeadLetterId).collect()))
        }
        (None, filter) if filter.is_some() || b.all => {
            let none = SelectFilter::default();
            let f = filter.as_ref().unwrap_or(&none);
            let f = DeadLetterFilter {
                job_type: empty_none(f.job_type.clone()),
                tenant: empty_none(f.tenant.clone()),
                lane: empty_none(f.lane.clone()),
                reason: empty_none(f.reason.clone()),
                source: empty_none(f.source.clone()),
                stage: stage_word(f.stage.clone())?,
                job_id: None,
            };
            check_reason(&f.reason)?;
            if f == DeadLetterFilter::default() && !b.all {
                return Err(ApiError::bad_request(
                    "an empty filter matches every dead letter: send \"all\": true to mean that, or name a type, tenant, lane, reason, source or stage",
                ));
            }
            Ok(Selector::Filter(f))
        }
        _ => Err(ApiError::bad_request(
            "send exactly one of \"ids\" or \"filter\" (or \"all\": true for every dead letter)",
        )),
    }
}

/// One dead letter a redrive moves: a lazaret job, or a broker message.
#[derive(Debug)]
struct Target {
    id: DeadLetterId,
    job_id: Option<JobId>,
    /// (source name, message id) of a broker message.
    source: Option<(String, String)>,
}

/// What became of one target.
#[derive(Debug)]
struct Done {
    redriven: bool,
    error: Option<String>,
}

fn redrive_item(t: &Target, done: Option<&Done>) -> Value {
    json!({
        "dead_letter_id": t.id.to_string(),
        "job_id": t.job_id.map(|j| j.to_string()),
        "source": t.source.as_ref().map(|s| &s.0),
        "message_id": t.source.as_ref().map(|s| &s.1),
        "redriven": done.is_some_and(|d| d.redriven),
        "error": done.and_then(|d| d.error.as_deref()),
    })
}

async fn redrive<S: Store>(State(app): Shared<S>, headers: HeaderMap, body: Bytes) -> ApiResult {
    let caller = allow(&app, &headers, Action::Operate).await?;
    let b: SelectBody = parse_json(&body)?;
    let sel = selector(&b)?;
    if b.rate_per_sec == Some(0) {
        return Err(ApiError::bad_request(
            "rate_per_sec must be at least 1 (leave it out for no limit)",
        ));
    }
    let requested = match &sel {
        Selector::Ids(ids) => ids.clone(),
        Selector::Filter(_) => Vec::new(),
    };
    // The entry is written before anything moves and each batch adds what
    // it moved in its own transaction: a client gone or a process killed
    // halfway leaves an entry that says exactly what was redriven.
    let entry = app
        .store
        .audit(AuditEntry {
            at: now(),
            actor: caller.name,
            action: "redrive".into(),
            request: audit_request(&body),
            count: 0,
        })
        .await?;
    let matched = app.store.match_dead_letters(sel).await?;
    let mut skipped = 0usize;
    let mut targets = Vec::new();
    for (id, stage) in matched {
        if stage == Stage::Admission {
            // Nothing valid was admitted: there is nothing to run again.
            skipped += 1;
            continue;
        }
        // Only the dead letter itself says whether it holds a job or a
        // broker message; one gone meanwhile was redriven or purged.
        if let Some(d) = app.store.dead_letter(id).await? {
            targets.push(Target {
                id,
                job_id: d.job_id.filter(|_| d.source.is_none()),
                source: d.source.map(|s| (s.name, s.message_id)),
            });
        }
    }
    let mut not_found: Vec<String> = Vec::new();
    for id in &requested {
        let text = id.to_string();
        if !targets.iter().any(|t| t.id == *id) && !not_found.contains(&text) {
            not_found.push(text);
        }
    }

    let mut job_ids = Vec::new();
    let mut items = Vec::with_capacity(targets.len());
    let mut redriven = 0u64;
    let mut interrupted = false;
    if b.dry_run {
        items.extend(targets.iter().map(|t| redrive_item(t, None)));
    } else {
        let sources = app.source_set();
        // `rate_per_sec` paces jobs and broker messages alike, in the
        // order they were dead-lettered.
        let chunk = b.rate_per_sec.map_or(targets.len().max(1), |r| r as usize);
        for (n, part) in targets.chunks(chunk).enumerate() {
            if n > 0 {
                // A shutdown stops the redrive between batches: what was
                // redriven so far stands, is answered and audited.
                let stopped = tokio::select! {
                    () = tokio::time::sleep(Duration::from_secs(1)) => false,
                    () = app.stopping() => true,
                };
                if stopped || app.is_stopping() {
                    interrupted = true;
                    break;
                }
            }
            let jobs: Vec<DeadLetterId> = part
                .iter()
                .filter(|t| t.source.is_none())
                .map(|t| t.id)
                .collect();
            let moved: Vec<JobId> = if jobs.is_empty() {
                Vec::new()
            } else {
                let moved = app.store.redrive(jobs, now(), Some(entry)).await?;
                app.ready.anything();
                moved
            };
            for t in part {
                let done = match (&t.source, t.job_id) {
                    (None, Some(job)) if moved.contains(&job) => {
                        job_ids.push(job);
                        Done {
                            redriven: true,
                            error: None,
                        }
                    }
                    (None, _) => Done {
                        redriven: false,
                        error: Some(
                            "its job is no longer dead-lettered: it was redriven or purged meanwhile"
                                .into(),
                        ),
                    },
                    (Some(_), _) => redrive_message(&app, &sources, t.id, entry).await,
                };
                if done.redriven {
                    redriven += 1;
                }
                items.push(redrive_item(t, Some(&done)));
            }
        }
        m::redriven(redriven);
    }
    ok(json!({
        "matched": targets.len(),
        "redriven": redriven,
        "job_ids": job_ids.iter().map(|j| j.to_string()).collect::<Vec<_>>(),
        "items": items,
        "not_found": not_found,
        "dry_run": b.dry_run,
        "skipped_admission_records": skipped,
        "interrupted": interrupted,
    }))
}

/// Republishes one broker dead letter and, only once the broker confirmed
/// it, removes the dead letter. A failure leaves the dead letter where it
/// is and says why.
async fn redrive_message<S: Store>(
    app: &App<S>,
    sources: &SourceSet,
    id: DeadLetterId,
    entry: AuditId,
) -> Done {
    let failed = |error: String| Done {
        redriven: false,
        error: Some(error),
    };
    // Two redrives of one message at once would publish it twice.
    let Some(_claim) = app.claim_redrive(id) else {
        return failed("another redrive is republishing this message now".into());
    };
    let dl = match app.store.dead_letter(id).await {
        Ok(Some(dl)) => dl,
        Ok(None) => return failed("it was redriven or purged meanwhile".into()),
        Err(e) => return failed(e.to_string()),
    };
    let payload = match app.store.dead_letter_payload(id).await {
        Ok(Some(Some(p))) => p,
        Ok(_) => return failed("its body is not stored, so it cannot be republished".into()),
        Err(e) => return failed(e.to_string()),
    };
    if let Err(e) = sources.redrive(&dl, payload).await {
        let configured = dl
            .source
            .as_ref()
            .is_some_and(|s| app.config.sources.iter().any(|c| c.name == s.name));
        return failed(match e {
            RedriveError::UnknownSource { name, .. } if configured => format!(
                "source {name:?} is not connected to its broker yet (see the server log); redrive again once it is"
            ),
            e => e.to_string(),
        });
    }
    match app.store.purge(vec![id], Some(entry)).await {
        Ok(_) => Done {
            redriven: true,
            error: None,
        },
        Err(e) => {
            tracing::error!(dead_letter = %id, "a redriven message was republished but its dead letter could not be removed: {e}");
            Done {
                redriven: true,
                error: Some(format!(
                    "republished, but the dead letter could not be removed ({e}); purge it (lazaret dlq purge --id {id} --confirm) so that it is not redriven twice"
                )),
            }
        }
    }
}

async fn purge<S: Store>(State(app): Shared<S>, headers: HeaderMap, body: Bytes) -> ApiResult {
    let caller = allow(&app, &headers, Action::Administer).await?;
    let b: SelectBody = parse_json(&body)?;
    let sel = selector(&b)?;
    if !b.confirm {
        return Err(ApiError::bad_request(
            "purge deletes dead letters for good: send \"confirm\": true",
        ));
    }
    let ids: Vec<DeadLetterId> = app
        .store
        .match_dead_letters(sel)
        .await?
        .into_iter()
        .map(|(i, _)| i)
        .collect();
    // Written first; the purge adds its count in its own transaction.
    let entry = app
        .store
        .audit(AuditEntry {
            at: now(),
            actor: caller.name,
            action: "purge".into(),
            request: audit_request(&body),
            count: 0,
        })
        .await?;
    let purged = app.store.purge(ids, Some(entry)).await?;
    ok(json!({ "purged": purged }))
}

// ---------------------------------------------------------------- operators

#[derive(Debug, Deserialize)]
struct PauseBody {
    #[serde(rename = "type")]
    job_type: Option<String>,
    lane: Option<String>,
}

async fn pause_resume<S: Store>(
    app: &App<S>,
    headers: &HeaderMap,
    body: &[u8],
    pause: bool,
) -> ApiResult {
    let caller = allow(app, headers, Action::Operate).await?;
    let b: PauseBody = parse_json(body)?;
    check_field("type", b.job_type.as_deref(), NAME_BYTES_MAX)?;
    check_field("lane", b.lane.as_deref(), NAME_BYTES_MAX)?;
    {
        let mut p = app.paused.lock().unwrap_or_else(|p| p.into_inner());
        match (&b.job_type, &b.lane) {
            (Some(t), None) if !t.is_empty() => {
                if pause {
                    p.types.insert(t.clone())
                } else {
                    p.types.remove(t)
                };
            }
            (None, Some(l)) if !l.is_empty() => {
                if pause {
                    p.lanes.insert(l.clone())
                } else {
                    p.lanes.remove(l)
                };
            }
            _ => {
                return Err(ApiError::bad_request(
                    "send exactly one of \"type\" or \"lane\"",
                ));
            }
        }
    }
    if !pause {
        app.ready.anything();
    }
    let action = if pause { "pause" } else { "resume" };
    app.store
        .audit(AuditEntry {
            at: now(),
            actor: caller.name,
            action: action.into(),
            request: audit_request(body),
            count: 0,
        })
        .await?;
    ok(json!({ "ok": true, "paused": pause }))
}

async fn pause<S: Store>(State(app): Shared<S>, headers: HeaderMap, body: Bytes) -> ApiResult {
    pause_resume(&app, &headers, &body, true).await
}

async fn resume<S: Store>(State(app): Shared<S>, headers: HeaderMap, body: Bytes) -> ApiResult {
    pause_resume(&app, &headers, &body, false).await
}

/// The query of `GET /v1/audit`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AuditParams {
    limit: Option<u32>,
    cursor: Option<String>,
    action: Option<String>,
    actor: Option<String>,
}

/// The actions the audit log records.
const AUDIT_ACTIONS: [&str; 8] = [
    "redrive",
    "purge",
    "pause",
    "resume",
    "token_create",
    "token_revoke",
    "denied",
    "cancel",
];

async fn audit<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    query: Result<Query<AuditParams>, QueryRejection>,
) -> ApiResult {
    allow(&app, &headers, Action::ReadDeadLetters).await?;
    let Query(q) = query.map_err(|e| {
        ApiError::bad_request(format!(
            "{}; the parameters are limit, cursor, action and actor",
            e.body_text()
        ))
    })?;
    let action = empty_none(q.action);
    if let Some(a) = &action {
        if !AUDIT_ACTIONS.contains(&a.as_str()) {
            return Err(ApiError::bad_request(format!(
                "unknown action {a:?}; the audit log records {}",
                AUDIT_ACTIONS.join(", ")
            )));
        }
    }
    let before = match empty_none(q.cursor) {
        Some(c) => Some(AuditId(c.parse().map_err(|_| {
            ApiError::bad_request(format!(
                "cursor {c:?} is not one this server gave (use next_cursor)"
            ))
        })?)),
        None => None,
    };
    let (items, next) = app
        .store
        .audit_page(AuditQuery {
            limit: page_limit(q.limit, 100, 1000)?,
            before,
            action,
            actor: empty_none(q.actor),
        })
        .await?;
    ok(json!({
        "items": items.iter().map(|(id, e)| json!({
            "id": id.to_string(), "at": views::time(e.at), "actor": e.actor, "action": e.action,
            "request": e.request, "count": e.count,
        })).collect::<Vec<_>>(),
        "next_cursor": next.map(|c| c.to_string()),
    }))
}

async fn breakers<S: Store>(State(app): Shared<S>, headers: HeaderMap) -> ApiResult {
    allow(&app, &headers, Action::Observe).await?;
    let now = now();
    let views = app
        .breakers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .snapshot(now);
    ok(json!({ "breakers": views.iter().map(|v| json!({
        "type": v.ty.as_str(), "kind": v.kind.as_str(), "state": v.state.as_str(), "until": views::opt_time(v.state.until()),
    })).collect::<Vec<_>>() }))
}

/// The stats summary shared by `/v1/stats` and the gauges of `/metrics`.
async fn snapshot<S: Store>(app: &App<S>) -> Result<Value, ApiError> {
    let s = app.store.stats().await?;
    let now = now();
    let dl_total: u64 = s.dead_letters.iter().map(|d| d.2).sum();
    let breakers = app
        .breakers
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .snapshot(now);
    let open_types: Vec<(String, bool)> = breakers
        .iter()
        .map(|b| {
            (
                b.ty.to_string(),
                matches!(b.state, lazaret_core::BreakerState::Open { .. }),
            )
        })
        .collect();
    m::set_gauges(
        &s.lanes
            .iter()
            .map(|(l, c)| (l.to_string(), c.queued, c.scheduled, c.leased))
            .collect::<Vec<_>>(),
        &s.dead_letters
            .iter()
            .map(|(t, r, n)| (t.clone().unwrap_or_default(), r.as_str().to_owned(), *n))
            .collect::<Vec<_>>(),
        &open_types,
        dl_total > app.config.dead_letters_warn,
    );
    let failures = app.failures.lock().unwrap_or_else(|p| p.into_inner());
    let surge = failures.surge(now).map(|s| {
        json!({
            "key": s.key.to_string(), "count": s.count, "total": s.total, "share": s.share,
        })
    });
    let top: Vec<Value> = failures
        .top(10)
        .iter()
        .map(|k| json!({ "type": k.key.job_type().as_str(), "cause": k.key.cause().to_string(), "fingerprint": k.key.fingerprint(), "count": k.count }))
        .collect();
    Ok(json!({
        "lanes": s.lanes.iter().map(|(l, c)| (l.to_string(), json!({
            "queued": c.queued, "scheduled": c.scheduled, "leased": c.leased,
        }))).collect::<serde_json::Map<_, _>>(),
        "succeeded_kept": s.succeeded,
        "store": {
            "commits": s.commits,
            "commands": s.commands,
            "commands_per_commit": if s.commits == 0 { 0.0 } else { s.commands as f64 / s.commits as f64 },
            "syncs": s.syncs,
            "commands_per_sync": if s.syncs == 0 { 0.0 } else { s.commands as f64 / s.syncs as f64 },
            "sync_avg_ms": if s.syncs == 0 { 0.0 } else { s.sync_micros as f64 / s.syncs as f64 / 1000.0 },
        },
        "dead_letters": {
            "total": dl_total,
            "warn_at": app.config.dead_letters_warn,
            "by_type_reason": s.dead_letters.iter().map(|(t, r, n)| json!({ "type": t, "reason": r.as_str(), "count": n })).collect::<Vec<_>>(),
            "rate_per_min": failures.rate_per_min(now),
            "top_failures": top,
            "other_failures": failures.other(),
            "surge": surge,
        },
        "breakers": breakers.iter().map(|b| json!({ "type": b.ty.as_str(), "kind": b.kind.as_str(), "state": b.state.as_str() })).collect::<Vec<_>>(),
    }))
}

async fn stats<S: Store>(State(app): Shared<S>, headers: HeaderMap) -> ApiResult {
    allow(&app, &headers, Action::Observe).await?;
    ok(snapshot(&app).await?)
}

async fn metrics<S: Store>(State(app): Shared<S>) -> ApiResult {
    snapshot(&app).await?;
    let text = m::render();
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}

// ---------------------------------------------------------------- tokens

/// Token endpoints need auth on: with no `[[tokens]]` every caller is an
/// anonymous admin, and a token created then would lock nobody out and
/// protect nothing.
fn tokens_need_auth<S: Store>(app: &App<S>) -> Result<(), ApiError> {
    if app.auth_on() {
        return Ok(());
    }
    Err(ApiError::bad_request(
        "auth is off (no [[tokens]] in the config file), so there are no tokens to manage: \
         configure at least one admin token in [[tokens]] and restart the server first",
    ))
}

async fn tokens<S: Store>(State(app): Shared<S>, headers: HeaderMap) -> ApiResult {
    allow(&app, &headers, Action::Administer).await?;
    tokens_need_auth(&app)?;
    let stored = app.store.tokens().await?;
    let items: Vec<Value> = app
        .config
        .tokens
        .iter()
        .map(views::config_token)
        .chain(stored.iter().map(views::api_token))
        .collect();
    ok(json!({ "items": items }))
}

#[derive(Debug, Deserialize)]
struct CreateTokenBody {
    name: Option<String>,
    role: Option<String>,
}

async fn create_token<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
    let caller = allow(&app, &headers, Action::Administer).await?;
    tokens_need_auth(&app)?;
    let b: CreateTokenBody = parse_json(&body)?;
    let name = b.name.unwrap_or_default();
    check_token_name(&name).map_err(ApiError::bad_request)?;
    let role: Role = b
        .role
        .as_deref()
        .ok_or_else(|| {
            ApiError::bad_request(
                "role is required: send \"role\": \"producer\", \"worker\", \"operator\" or \"admin\"",
            )
        })?
        .parse()
        .map_err(|e: crate::config::UnknownRole| ApiError::bad_request(e.to_string()))?;
    if app.config.tokens.iter().any(|t| t.name == name) {
        return Err(ApiError::conflict(format!(
            "token name {name:?} is used by a token in the config file ([[tokens]]); \
             names identify the actor in the audit log, so pick another"
        )));
    }
    let secret = new_secret().map_err(|e| {
        ApiError::internal(format!(
            "the operating system's random generator failed ({e}); retry"
        ))
    })?;
    let sha256 = token_sha256(&secret);
    let now = now();
    let stored = ApiToken {
        name: name.clone(),
        role: role.as_str().to_owned(),
        token_sha256: hex::encode(sha256),
        created_at: now,
        created_by: caller.name.clone(),
    };
    // The audit entry records what was asked, never the secret.
    let entry = AuditEntry {
        at: now,
        actor: caller.name,
        action: "token_create".into(),
        request: json!({ "name": name, "role": role.as_str() }),
        count: 1,
    };
    let changing = app.token_changes.lock().await;
    match app.store.create_token(stored, entry).await? {
        Ok(()) => {}
        Err(TokenError::NameTaken) => {
            return Err(ApiError::conflict(format!(
                "a token named {name:?} exists already (created through the API); \
                 pick another name, or revoke it first with DELETE /v1/tokens/{name}"
            )));
        }
        Err(e) => {
            return Err(ApiError::internal(format!(
                "the new token was not stored: {e}"
            )));
        }
    }
    // In force before the 201 leaves: the caller may use it at once.
    app.api_tokens
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(TokenConfig {
            name: name.clone(),
            role,
            sha256,
        });
    drop(changing);
    tracing::info!(token = %name, role = %role, "token created");
    Ok((
        StatusCode::CREATED,
        Json(json!({
            "name": name,
            "role": role.as_str(),
            "token": secret,
            "created_at": views::time(now),
        })),
    )
        .into_response())
}

async fn revoke_token<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult {
    let caller = allow(&app, &headers, Action::Administer).await?;
    tokens_need_auth(&app)?;
    if app.config.tokens.iter().any(|t| t.name == name) {
        return Err(ApiError::bad_request(format!(
            "token {name:?} comes from the config file ([[tokens]]): remove it there and restart \
             the server to revoke it"
        )));
    }
    let entry = AuditEntry {
        at: now(),
        actor: caller.name,
        action: "token_revoke".into(),
        request: json!({ "name": name }),
        count: 1,
    };
    let changing = app.token_changes.lock().await;
    if !app.store.revoke_token(name.clone(), entry).await? {
        return Err(ApiError::not_found(format!(
            "no token named {name:?} was created through the API; GET /v1/tokens lists them"
        )));
    }
    app.api_tokens
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&name);
    drop(changing);
    tracing::info!(token = %name, "token revoked");
    ok(json!({ "name": name, "revoked": true }))
}
