//! Producers: enqueue one job or a batch, read a job, list jobs, cancel a job.

use std::time::Duration;

use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::IntoResponse;
use futures_util::StreamExt;
use lazaret_core::{
    AdmissionRequest, DeadLetterReason, IDEMPOTENCY_KEY_BYTES_MAX, JobId, JobState, JobType, Lane,
    NAME_BYTES_MAX, PREVIEW_BYTES_MAX, TenantId, Timestamp, TraceParent, Verdict, admit,
    payload_preview, payload_sha256,
};
use lazaret_store::{
    AdmissionRecord, AuditEntry, CancelError, Cancelled, EnqueueOutcome, JobQuery, JobView, NewJob,
    Store,
};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::app::{App, now};
use crate::auth::Caller;
use crate::auth::Role;
use crate::error::{ApiError, Code};
use crate::{metrics as m, views};

use super::routes::StreamCap;
use super::{
    ApiResult, DELAY_MS_MAX, Shared, check_duration, check_field, connection_close, empty_none,
    not_object, ok, page_limit, parse_id, parse_json, stored_payload,
};

/// A field that is there, even as `null` (`Option`'s own deserializer reads
/// `null` as absent).
fn present<'de: 'a, 'a, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<&'a RawValue>, D::Error> {
    <&'a RawValue>::deserialize(d).map(Some)
}

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct EnqueueBody<'a> {
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
    /// A W3C `traceparent` (`00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`):
    /// the trace this job's spans join, handed to its workers and kept on its
    /// dead letter. It wins over the request's `traceparent` header; an invalid
    /// one is `400 BAD_REQUEST`.
    traceparent: Option<String>,
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
            head.extend_from_slice(&chunk[..chunk.len().min(PREVIEW_BYTES_MAX)]);
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
            head.truncate(PREVIEW_BYTES_MAX);
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

async fn record_poison<S: Store>(app: &App<S>, rec: AdmissionRecord) {
    let now = rec.now;
    app.observe_admission(rec.job_type.as_deref(), rec.reason);
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
    header_traceparent: Option<&TraceParent>,
    now: Timestamp,
) -> Result<NewJob, ApiError> {
    if let Err(e) = check_duration("delay_ms", body.delay_ms, DELAY_MS_MAX) {
        m::rejected_code(&e.code);
        return Err(e);
    }
    let traceparent = match body.traceparent.as_deref().map(TraceParent::parse) {
        None => header_traceparent.cloned(),
        Some(Ok(t)) => Some(t),
        Some(Err(e)) => {
            m::rejected("BAD_REQUEST");
            return Err(ApiError::bad_request(format!(
                "{e}; leave `traceparent` out to enqueue the job without a trace"
            )));
        }
    };
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
                        payload_preview: payload_preview(payload, PREVIEW_BYTES_MAX).into_owned(),
                        payload: Some(payload.to_vec()),
                        idempotency_key: body.idempotency_key.clone(),
                        now,
                    },
                )
                .await;
            }
            let e =
                ApiError::from_verdict(other).unwrap_or_else(|| ApiError::bad_request("refused"));
            m::rejected_code(&e.code);
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
        traceparent,
    })
}

/// The request's `traceparent` header, when valid. An invalid one is
/// ignored (the W3C rule for a receiver that cannot parse it: start
/// afresh) and logged; a job's own `traceparent` field is checked strictly.
pub(super) fn header_traceparent(headers: &HeaderMap) -> Option<TraceParent> {
    let value = headers.get("traceparent")?;
    match value.to_str().map(TraceParent::parse) {
        Ok(Ok(t)) => Some(t),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "ignoring the request's invalid traceparent header");
            None
        }
        Err(_) => {
            tracing::warn!("ignoring the request's traceparent header: not visible ASCII");
            None
        }
    }
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
    traceparent: Option<TraceParent>,
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
            traceparent: job.traceparent.clone(),
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
        EnqueueOutcome::TooManyTenants { tenants_ready_max } => {
            let e = ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                Code::TooManyTenants,
                format!(
                    "tenant `{}` has no jobs ready, and {tenants_ready_max} tenants already have jobs ready, \
                     the bound set by `[tenants] ready_max`; nothing was queued. Retry once other tenants' jobs \
                     are done, or raise `[tenants] ready_max` in the server's config",
                    job.tenant
                ),
            );
            m::rejected_code(&e.code);
            (e.status, e.body())
        }
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
            payload_preview: payload_preview(&head, PREVIEW_BYTES_MAX).into_owned(),
            payload: None,
            idempotency_key: None,
            now: now(),
        },
    )
    .await;
    m::rejected("POISON");
    ApiError::too_large(message)
}

pub(super) async fn enqueue<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    StreamCap(cap): StreamCap,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
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
                    payload_preview: payload_preview(&bytes, PREVIEW_BYTES_MAX).into_owned(),
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
    // Debug level, as every per-job span: exported with `otlp`, and at the
    // default `info` disabled at the cost of a level check.
    let span = tracing::debug_span!(
        "lazaret.admission",
        "job.id" = tracing::field::Empty,
        "job.type" = parsed.job_type.as_deref(),
        "job.tenant" = parsed.tenant.as_deref(),
        "job.lane" = parsed.lane.as_deref().unwrap_or("default"),
        "job.attempt" = 0u32,
        otel.status_code = tracing::field::Empty,
    );
    let traceparent = header_traceparent(&headers);
    let job = match admit_one(
        &app,
        &parsed,
        enqueuer(&app, &caller),
        traceparent.as_ref(),
        now,
    )
    .await
    {
        Ok(job) => job,
        Err(e) => {
            span.record("otel.status_code", "ERROR");
            return Err(e);
        }
    };
    lazaret_guard::trace::follow(&span, job.traceparent.as_ref());
    let admitted = Admitted::of(&job);
    let stored = app.store.enqueue(vec![job]);
    tokio::pin!(stored);
    // The first poll hands the command to the store. Where the store runs
    // it before any lease sent later, a long-poll woken now leases the job
    // right after its insert, and the worker can start while the
    // producer's answer waits for the disk. A power loss in that window
    // takes the job back and the producer, unanswered, sends it again: at
    // least once, as always. Woken for nothing (a duplicate, a refusal), a
    // long-poll looks once and waits again.
    let first = futures_util::poll!(stored.as_mut());
    let woken = first.is_pending()
        && parsed.delay_ms.unwrap_or(0) == 0
        && app.store.orders_one_job_commands();
    if woken {
        app.ready.jobs([(&admitted.lane, &admitted.job_type)]);
    }
    let outcome = match first {
        std::task::Poll::Ready(r) => r,
        std::task::Poll::Pending => stored.await,
    }?;
    if let EnqueueOutcome::Created { id, .. } | EnqueueOutcome::Duplicate { id, .. } = &outcome[0] {
        span.record("job.id", id.0);
    }
    let (status, body) = enqueue_reply(&app, &admitted, &outcome[0]);
    if !woken && made_ready(&outcome[0]) {
        app.ready.jobs([(&admitted.lane, &admitted.job_type)]);
    }
    Ok((status, Json(body)).into_response())
}

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct BatchBody<'a> {
    /// Each job as `POST /v1/jobs` takes it; one bad job is one error in the reply.
    #[serde(borrow)]
    #[schemars(with = "Vec<EnqueueBody<'static>>")]
    jobs: Vec<&'a RawValue>,
}

pub(super) async fn enqueue_batch<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    StreamCap(cap): StreamCap,
    headers: HeaderMap,
    body: Body,
) -> ApiResult {
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
    let traceparent = header_traceparent(&headers);
    if bytes.len() <= BULK_BODY_BYTES {
        return admit_batch(&app, &caller, traceparent.as_ref(), &bytes).await;
    }
    let on = std::sync::Arc::clone(&app);
    app.run_bulk(async move { admit_batch(&on, &caller, traceparent.as_ref(), &bytes).await })
        .await
        .unwrap_or_else(|| {
            Err(ApiError::unavailable(
                "the server is stopping; send the batch again once it is back, or to another node",
            ))
        })
}

/// A batch body larger than this is parsed, admitted and handed to the
/// store on the bulk runtime ([`App::run_bulk`]): about 150 jobs of
/// 100-byte payloads. Smaller ones cost less than the hand-over.
const BULK_BODY_BYTES: usize = 32 * 1024;

/// The jobs of a batch body, admitted and enqueued: its answer.
async fn admit_batch<S: Store>(
    app: &App<S>,
    caller: &Caller,
    traceparent: Option<&TraceParent>,
    bytes: &[u8],
) -> ApiResult {
    let batch: BatchBody<'_> = parse_json(bytes)?;
    let now = now();
    let mut results: Vec<Option<Value>> = vec![None; batch.jobs.len()];
    let mut admitted: Vec<(usize, Admitted)> = Vec::new();
    let mut jobs: Vec<NewJob> = Vec::new();
    for (i, raw) in batch.jobs.iter().enumerate() {
        let item: Result<EnqueueBody<'_>, _> = serde_json::from_str(raw.get());
        match item {
            Ok(item) => {
                match admit_one(app, &item, enqueuer(app, caller), traceparent, now).await {
                    Ok(job) => {
                        admitted.push((i, Admitted::of(&job)));
                        jobs.push(job);
                    }
                    Err(e) => results[i] = Some(e.body()),
                }
            }
            Err(e) => {
                results[i] =
                    Some(ApiError::bad_request(format!("job {i} is not valid: {e}")).body())
            }
        }
    }
    if !admitted.is_empty() {
        // One store command per chunk, all sent at once: they share the
        // store's transactions as one command would, but its single writer
        // can run another request's enqueue, lease or ack between them, and
        // a chunk that fails fails only its own jobs.
        let mut chunks = Vec::with_capacity(jobs.len().div_ceil(ENQUEUE_CHUNK));
        let mut rest = jobs.into_iter();
        loop {
            let chunk: Vec<NewJob> = rest.by_ref().take(ENQUEUE_CHUNK).collect();
            if chunk.is_empty() {
                break;
            }
            chunks.push(app.store.enqueue(chunk));
        }
        let answers = futures_util::future::join_all(chunks).await;
        if answers.iter().all(Result::is_err) {
            // Nothing was applied: the request fails as a whole, with the
            // store's status (503 and Retry-After when it is overloaded).
            if let Some(Err(e)) = answers.into_iter().next() {
                return Err(e.into());
            }
        } else {
            let mut ready: Vec<(&Lane, &JobType)> = Vec::new();
            for (chunk, answer) in admitted.chunks(ENQUEUE_CHUNK).zip(answers) {
                match answer {
                    Ok(outcomes) => {
                        for ((i, job), outcome) in chunk.iter().zip(&outcomes) {
                            batch_admission_span(job, outcome);
                            results[*i] = Some(enqueue_reply(app, job, outcome).1);
                            let pair = (&job.lane, &job.job_type);
                            if made_ready(outcome) && !ready.contains(&pair) {
                                ready.push(pair);
                            }
                        }
                    }
                    Err(e) => {
                        let body = ApiError::from(e).body();
                        for (i, _) in chunk {
                            results[*i] = Some(body.clone());
                        }
                    }
                }
            }
            app.ready.jobs(ready);
        }
    }
    ok(json!({ "results": results }))
}

/// The admission span of one job of a batch (`lazaret.admission`, as one
/// enqueue's), once the store answered.
fn batch_admission_span(job: &Admitted, outcome: &EnqueueOutcome) {
    let id = match outcome {
        EnqueueOutcome::Created { id, .. } | EnqueueOutcome::Duplicate { id, .. } => Some(id.0),
        _ => None,
    };
    let span = tracing::debug_span!(
        "lazaret.admission",
        "job.id" = id,
        "job.type" = %job.job_type,
        "job.tenant" = %job.tenant,
        "job.lane" = %job.lane,
        "job.attempt" = 0u32,
        batch = true,
    );
    lazaret_guard::trace::follow(&span, job.traceparent.as_ref());
}

/// Jobs of a batch per store command (`enqueue_batch`).
const ENQUEUE_CHUNK: usize = 10;

/// The query of `GET /v1/jobs/{id}`; any other parameter is refused.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct JobParams {
    payload: Option<String>,
}

/// `?payload=full` (the default) or `?payload=preview`.
fn payload_shown(word: Option<String>) -> Result<views::PayloadShown, ApiError> {
    match empty_none(word).as_deref() {
        None | Some("full") => Ok(views::PayloadShown::Full),
        Some("preview") => Ok(views::PayloadShown::Preview),
        Some(other) => Err(ApiError::bad_request(format!(
            "payload={other:?} is not one of full (the whole payload, the default) and \
             preview (its first {} bytes; the whole one is at /v1/jobs/{{id}}/payload)",
            PREVIEW_BYTES_MAX
        ))),
    }
}

/// The job `id` if the caller may read it (a producer only its own).
async fn readable<S: Store>(app: &App<S>, caller: &Caller, id: &str) -> Result<JobView, ApiError> {
    let id = parse_id(id, "job")?;
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
    Ok(view)
}

pub(super) async fn job<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    Path(id): Path<String>,
    query: Result<Query<JobParams>, QueryRejection>,
) -> ApiResult {
    let Query(q) = query.map_err(|e| {
        ApiError::bad_request(format!("{}; the only parameter is payload", e.body_text()))
    })?;
    let shown = payload_shown(q.payload)?;
    let view = readable(&app, &caller, &id).await?;
    Ok(Json(views::job(&view, now(), shown)).into_response())
}

/// `GET /v1/jobs/{id}/payload`: the job's payload bytes as they were
/// admitted (or as a corrected redrive replaced them), for whoever may read
/// the job: what the dashboard downloads instead of loading a large
/// payload into the page.
pub(super) async fn job_payload<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    Path(id): Path<String>,
) -> ApiResult {
    let view = readable(&app, &caller, &id).await?;
    let name = format!("job-{}", view.envelope.id);
    Ok(stored_payload(view.payload, None, &name))
}

/// The query of `GET /v1/jobs`; any other parameter is refused.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct ListParams {
    state: Option<String>,
    #[serde(rename = "type")]
    job_type: Option<String>,
    tenant: Option<String>,
    lane: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
    payload: Option<String>,
}

/// `GET /v1/jobs`: a page of jobs, newest first. A producer sees only the
/// jobs it enqueued.
pub(super) async fn list<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    query: Result<Query<ListParams>, QueryRejection>,
) -> ApiResult {
    let Query(q) = query.map_err(|e| {
        ApiError::bad_request(format!(
            "{}; the parameters are state, type, tenant, lane, limit, cursor and payload",
            e.body_text()
        ))
    })?;
    let shown = payload_shown(q.payload)?;
    let state = match empty_none(q.state) {
        Some(word) => Some(
            word.parse::<JobState>()
                .map_err(|e| ApiError::bad_request(e.to_string()))?,
        ),
        None => None,
    };
    let before = match empty_none(q.cursor) {
        Some(c) => Some(JobId(c.parse().map_err(|_| {
            ApiError::bad_request(format!(
                "cursor {c:?} is not one this server gave (use next_cursor)"
            ))
        })?)),
        None => None,
    };
    let enqueued_by = (caller.role == Role::Producer).then(|| caller.name.clone());
    let (items, next) = app
        .store
        .jobs(JobQuery {
            state,
            job_type: empty_none(q.job_type),
            tenant: empty_none(q.tenant),
            lane: empty_none(q.lane),
            enqueued_by,
            limit: page_limit(q.limit, 100, 1000)?,
            before,
        })
        .await?;
    let now = now();
    // A struct, not `json!`: the payloads stay byte for byte (see `views::JobBody`).
    Ok(Json(views::JobPage {
        items: items
            .iter()
            .map(|j| views::job_item(j, now, shown))
            .collect(),
        next_cursor: next.map(|c| c.to_string()),
    })
    .into_response())
}

/// The optional body of a cancel.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct CancelBody {
    /// Why, for the audit log.
    reason: Option<String>,
}

/// The longest cancel reason kept, in bytes.
const CANCEL_REASON_BYTES_MAX: usize = 1024;

/// `POST /v1/jobs/{id}/cancel`: a waiting job now, a leased one at its
/// outcome unless acked (`lazaret_core::cancel`); audited.
pub(super) async fn cancel<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let b: CancelBody = if body.iter().all(u8::is_ascii_whitespace) {
        CancelBody::default()
    } else {
        parse_json(&body)?
    };
    if b.reason
        .as_ref()
        .is_some_and(|r| r.len() > CANCEL_REASON_BYTES_MAX)
    {
        return Err(ApiError::bad_request(format!(
            "reason must be at most {CANCEL_REASON_BYTES_MAX} bytes; it is kept in the audit log"
        )));
    }
    let job = parse_id(&id, "job")?;
    let view = app
        .store
        .job(JobId(job))
        .await?
        .ok_or_else(|| ApiError::not_found(format!("no job with id {job}")))?;
    if !caller.may_read_job(view.enqueued_by.as_deref()) {
        m::rejected("FORBIDDEN");
        return Err(ApiError::forbidden(format!(
            "job {job} was enqueued by another token; a producer cancels only the jobs it enqueued. \
             Cancel it with the token that enqueued it, or ask an operator"
        )));
    }
    let entry = AuditEntry {
        at: now(),
        actor: caller.name,
        action: "cancel".into(),
        request: json!({ "job_id": job.to_string(), "reason": b.reason }),
        count: 0,
    };
    match app.store.cancel(JobId(job), now(), entry).await? {
        Ok(Cancelled::Now) => ok(json!({ "state": "cancelled" })),
        Ok(Cancelled::Requested { .. }) => {
            ok(json!({ "state": "leased", "cancel_requested": true }))
        }
        Err(CancelError::NotFound) => Err(ApiError::not_found(format!("no job with id {job}"))),
        Err(CancelError::Finished(state)) => Err(ApiError::bad_state(format!(
            "job {job} is {state}: a finished job cannot be cancelled (only queued, scheduled and leased ones can)"
        ))),
    }
}
