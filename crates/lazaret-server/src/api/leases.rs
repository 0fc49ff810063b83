//! Workers: leases, outcomes (ack, fail, batched), heartbeats.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::IntoResponse;
use lazaret_core::{
    ErrorKind, Event, Failure, FailureClass, JobId, JobType, Lane, NAME_BYTES_MAX, Transition,
    WorkerId,
};
use lazaret_store::{Completed, Completion, LeaseRequest, LeaseToken, LeasedJob, Store};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::app::{App, now};
use crate::config::millis;
use crate::error::ApiError;
use crate::{metrics as m, views};

use super::{
    ApiResult, DELAY_MS_MAX, LEASE_JOBS_MAX, LEASE_NAMES_MAX, Shared, WAIT_MS_MAX, check_duration,
    check_field, ok, parse_id, parse_json,
};

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct LeaseBody {
    worker_id: Option<String>,
    lanes: Option<Vec<String>>,
    types: Option<Vec<String>>,
    max_jobs: Option<u32>,
    lease_ms: Option<u64>,
    wait_ms: Option<u64>,
}

pub(super) async fn lease<S: Store>(State(app): Shared<S>, body: Bytes) -> ApiResult {
    let b: LeaseBody = parse_json(&body)?;
    let jobs = lease_jobs(&app, b).await?;
    Ok(Json(views::LeaseReply {
        jobs: jobs.iter().map(views::leased).collect(),
    })
    .into_response())
}

/// Checks a lease request and leases: what `POST /v1/leases` does after
/// authorization, and the `next` of an ack or fail.
async fn lease_jobs<S: Store>(app: &App<S>, b: LeaseBody) -> Result<Vec<LeasedJob>, ApiError> {
    let max_jobs = b.max_jobs.unwrap_or(1);
    if max_jobs == 0 || max_jobs > LEASE_JOBS_MAX {
        return Err(ApiError::bad_request(format!(
            "max_jobs must be between 1 and {LEASE_JOBS_MAX} (got {max_jobs})"
        )));
    }
    let (lease_ms_default, lease_ms_max) = (
        millis(app.config.lease_default),
        millis(app.config.lease_max),
    );
    let lease_ms = b.lease_ms.unwrap_or(lease_ms_default);
    if lease_ms == 0 || lease_ms > lease_ms_max {
        return Err(ApiError::bad_request(format!(
            "lease_ms must be between 1 and {lease_ms_max} (lease_ms_max; got {lease_ms})"
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
        // Probe slots of half-open breakers are reserved before the store
        // leases and the unused ones refunded after, so that concurrent
        // leases never let more than `probes` through.
        let filters = app.lease_filters(types.as_deref(), max_jobs, now);
        let req = LeaseRequest {
            worker_id: worker_id.clone(),
            lanes: lanes.clone(),
            types: types.clone(),
            exclude_types: filters.exclude_types,
            exclude_lanes: filters.exclude_lanes,
            type_limits: filters.type_limits,
            max_jobs,
            lease: Duration::from_millis(lease_ms),
            now,
        };
        let leased = app.store.lease(req).await;
        app.refund_probes(filters.reservations, leased.as_deref().unwrap_or_default());
        let jobs = leased?;
        for j in &jobs {
            m::job_waited(j.lane.as_str(), now.saturating_since(j.ready_at));
            lease_span(j, &worker_id);
        }
        if !jobs.is_empty() || tokio::time::Instant::now() >= deadline || app.is_stopping() {
            return Ok(jobs);
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

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct AckBody {
    lease_token: String,
    /// A lease request answered in the same reply, once the outcome stands.
    #[schemars(with = "Option<LeaseBody>")]
    next: Option<Box<RawValue>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct ErrorBody {
    class: Option<String>,
    kind: Option<String>,
    message: Option<String>,
    traceback: Option<String>,
    retry_after_ms: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct FailBody {
    lease_token: String,
    error: ErrorBody,
    /// As in [`AckBody`].
    #[schemars(with = "Option<LeaseBody>")]
    next: Option<Box<RawValue>>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct ItemBody {
    id: String,
    lease_token: String,
    error: Option<ErrorBody>,
}

/// The span of one job's lease (`lazaret.lease`): debug level, one per
/// leased job, in the job's trace. At the default `info` it is disabled
/// and costs a level check; it is exported with the `otlp` feature.
fn lease_span(j: &LeasedJob, worker: &WorkerId) {
    let span = tracing::debug_span!(
        "lazaret.lease",
        "job.id" = j.id.0,
        "job.type" = %j.job_type,
        "job.tenant" = %j.tenant,
        "job.lane" = %j.lane,
        "job.attempt" = j.attempt,
        "worker.id" = %worker,
    );
    lazaret_guard::trace::follow(&span, j.traceparent.as_ref());
}

/// The span of an outcome (`lazaret.outcome`) and, when the job was
/// dead-lettered, of its dead-lettering (`lazaret.dead_letter`, a child).
fn outcome_span(c: &Completed) {
    let span = tracing::debug_span!(
        "lazaret.outcome",
        "job.id" = c.id.0,
        "job.type" = %c.job_type,
        "job.tenant" = %c.tenant,
        "job.lane" = %c.lane,
        "job.attempt" = c.attempt,
        outcome = c.transition.as_str(),
        "error.kind" = c.kind.as_ref().map(|k| k.as_str()),
    );
    lazaret_guard::trace::follow(&span, c.traceparent.as_ref());
    if let Transition::DeadLetter { reason } = c.transition {
        let _dl = tracing::debug_span!(
            parent: &span,
            "lazaret.dead_letter",
            "job.id" = c.id.0,
            "job.type" = %c.job_type,
            "job.tenant" = %c.tenant,
            "job.lane" = %c.lane,
            "job.attempt" = c.attempt,
            reason = reason.as_str(),
            "dead_letter.id" = c.dead_letter.map(|d| d.0),
        );
    }
}

fn token(t: &str) -> Result<LeaseToken, ApiError> {
    // A token that is not even a number cannot be anyone's current lease.
    Ok(LeaseToken(t.trim().parse().unwrap_or(0)))
}

fn failure(e: ErrorBody) -> Result<Failure, ApiError> {
    check_duration("error.retry_after_ms", e.retry_after_ms, DELAY_MS_MAX)?;
    check_field("error.kind", e.kind.as_deref(), NAME_BYTES_MAX)?;
    let class = e
        .class
        .as_deref()
        .map(str::parse::<FailureClass>)
        .transpose()
        .map_err(|e| {
            ApiError::bad_request(format!(
                "error.class {e} (or leave it out to classify by kind)"
            ))
        })?;
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
        // A cancel was requested while it ran: no retry, no dead letter.
        Transition::Cancelled => json!({ "state": "cancelled", "attempt": c.attempt }),
    }
}

async fn complete<S: Store>(
    app: &Arc<App<S>>,
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
    for c in results.iter().flatten() {
        outcome_span(c);
    }
    app.count_redrive_outcomes(results.iter().filter_map(|r| r.as_ref().ok()));
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

/// One outcome, then, when the worker asked for it, the next lease.
///
/// The outcome is applied first and stands whatever becomes of the lease:
/// a lease that is refused (a bad `next`, an unavailable store) answers
/// `200` with the outcome, `"jobs": []` and the refusal as `next_error`.
/// An outcome that is itself refused (`LEASE_LOST`, `NOT_FOUND`) answers
/// that error and leases nothing, so no job is handed out on a reply the
/// worker reads as an error.
async fn single<S: Store>(
    app: &Arc<App<S>>,
    id: String,
    c: Result<Completion, ApiError>,
    next: Option<Box<RawValue>>,
) -> ApiResult {
    let mut r = complete(app, vec![(id, c)]).await?;
    let outcome = r
        .pop()
        .unwrap_or_else(|| Err(ApiError::bad_request("empty")))?;
    with_next(app, outcome, next).await
}

/// The reply to outcomes already applied: `outcome` alone, or with the
/// lease `next` asks for (`jobs`, and `next_error` when it was refused).
async fn with_next<S: Store>(
    app: &App<S>,
    outcome: Value,
    next: Option<Box<RawValue>>,
) -> ApiResult {
    let Some(next) = next else {
        return Ok(Json(outcome).into_response());
    };
    let leased = match parse_json::<LeaseBody>(next.get().as_bytes()) {
        Ok(b) => lease_jobs(app, b).await,
        Err(e) => Err(e),
    };
    let (jobs, next_error) = match &leased {
        Ok(jobs) => (jobs.iter().map(views::leased).collect(), None),
        Err(e) => {
            let mut body = e.body();
            (Vec::new(), Some(body["error"].take()))
        }
    };
    Ok(Json(views::OutcomeReply {
        outcome,
        jobs,
        next_error,
    })
    .into_response())
}

pub(super) async fn ack<S: Store>(
    State(app): Shared<S>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let b: AckBody = parse_json(&body)?;
    let c = completion(&id, &b.lease_token, None);
    single(&app, id, c, b.next).await
}

pub(super) async fn fail<S: Store>(
    State(app): Shared<S>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let b: FailBody = parse_json(&body)?;
    let c = completion(&id, &b.lease_token, Some(b.error));
    single(&app, id, c, b.next).await
}

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct ItemsBody {
    items: Vec<ItemBody>,
    /// As in [`AckBody`]: leased once the outcomes are applied.
    #[schemars(with = "Option<LeaseBody>")]
    next: Option<Box<RawValue>>,
}

/// What a batch of outcomes makes of each item's `error`.
#[derive(Clone, Copy, Debug)]
enum Outcomes {
    /// `/v1/acks`: every item succeeded (an `error` is ignored).
    Acks,
    /// `/v1/fails`: every item failed; one without `error` is refused.
    Fails,
    /// `/v1/outcomes`: an item with `error` failed, one without succeeded.
    Mixed,
}

async fn batch_outcomes<S: Store>(app: &Arc<App<S>>, body: &[u8], kind: Outcomes) -> ApiResult {
    let b: ItemsBody = parse_json(body)?;
    let items = b
        .items
        .into_iter()
        .map(|i| {
            let error = match (kind, i.error) {
                (Outcomes::Acks, _) => None,
                (Outcomes::Fails | Outcomes::Mixed, Some(e)) => Some(e),
                (Outcomes::Mixed, None) => None,
                (Outcomes::Fails, None) => {
                    return (
                        i.id.clone(),
                        Err(ApiError::bad_request(
                            "each item of /v1/fails needs an error (use /v1/outcomes to ack and fail in one request)",
                        )),
                    );
                }
            };
            let c = completion(&i.id, &i.lease_token, error);
            (i.id, c)
        })
        .collect();
    let results = complete(app, items).await?;
    let results: Vec<Value> = results
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| e.body()))
        .collect();
    with_next(app, json!({ "results": results }), b.next).await
}

pub(super) async fn acks<S: Store>(State(app): Shared<S>, body: Bytes) -> ApiResult {
    batch_outcomes(&app, &body, Outcomes::Acks).await
}

pub(super) async fn fails<S: Store>(State(app): Shared<S>, body: Bytes) -> ApiResult {
    batch_outcomes(&app, &body, Outcomes::Fails).await
}

/// `POST /v1/outcomes`: acks and fails of one worker's batch in one
/// request (and, with `next`, its next lease).
pub(super) async fn outcomes<S: Store>(State(app): Shared<S>, body: Bytes) -> ApiResult {
    batch_outcomes(&app, &body, Outcomes::Mixed).await
}

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct HeartbeatBody {
    lease_token: String,
    extend_ms: Option<u64>,
}

pub(super) async fn heartbeat<S: Store>(
    State(app): Shared<S>,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let b: HeartbeatBody = parse_json(&body)?;
    let job = JobId(parse_id(&id, "job")?);
    let (lease_ms_default, lease_ms_max) = (
        millis(app.config.lease_default),
        millis(app.config.lease_max),
    );
    let extend = b.extend_ms.unwrap_or(lease_ms_default);
    if extend == 0 || extend > lease_ms_max {
        return Err(ApiError::bad_request(format!(
            "extend_ms must be between 1 and {lease_ms_max} (lease_ms_max; got {extend}); the lease then ends extend_ms from now"
        )));
    }
    let at = now();
    let until = at.saturating_add(Duration::from_millis(extend));
    match app
        .store
        .heartbeat(job, token(&b.lease_token)?, until, at)
        .await?
    {
        Ok(h) => ok(json!({
            "lease_expires_at": views::time(h.lease_expires_at),
            "cancel_requested": h.cancel_requested,
        })),
        Err(e) => Err(ApiError::item(e, id)),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use axum::body::Body;
    use axum::http::Request;
    use http_body_util::BodyExt;
    use lazaret_core::{FairScheduler, Timestamp};
    use lazaret_store::{Durability, SqliteStore};
    use tower::ServiceExt;

    use super::*;
    use crate::config::ServerConfig;
    use lazaret_store::PolicyDecider;

    fn app(dir: &std::path::Path, config: &str) -> Arc<App<SqliteStore>> {
        let config = ServerConfig::from_toml_str(config, dir).expect("a valid config");
        let scheduler = FairScheduler::new(config.scheduler.clone()).expect("a valid scheduler");
        let decider = Arc::new(PolicyDecider::new(config.policies.clone()));
        let store = SqliteStore::open(dir, Durability::Normal, scheduler, decider).expect("store");
        App::new(store, config)
    }

    async fn post(router: axum::Router, path: &str, body: Value) -> (u16, Value) {
        let req = Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .expect("a request");
        let resp = router.oneshot(req).await.expect("infallible");
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        (
            status,
            serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        )
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn half_open_probes_never_exceed_probes_under_concurrent_long_polls() {
        let dir = tempfile::tempdir().expect("tempdir");
        let app = app(
            dir.path(),
            "[types.fragile.breaker]\nfailures_min = 2\nfailure_ratio = 0.5\n\
             window_ms = 600000\ncooldown_ms = 600000\nprobes = 2\n",
        );
        let router = crate::api::router(app.clone());
        for n in 0..40 {
            let (status, body) = post(
                router.clone(),
                "/v1/jobs",
                json!({"type": "fragile", "tenant": format!("t{}", n % 4), "payload": {"n": n}}),
            )
            .await;
            assert_eq!(status, 201, "{body}");
        }
        // Open the breaker one cooldown ago: it is half-open now, for a
        // whole cooldown more (ten minutes), with two probe slots.
        let fragile = JobType::new("fragile");
        let opened = Timestamp::from_millis(now().as_millis() - 600_001);
        {
            // Fresh breakers: the enqueues above showed these ones the
            // present, and a breaker never lets time run backwards.
            let mut b = app.breakers.lock().unwrap();
            *b = lazaret_core::Breakers::new(
                app.config.breaker_default,
                app.config.breakers.clone(),
            );
            for _ in 0..2 {
                b.record_failure(&fragile, &ErrorKind::new("http_503"), opened);
            }
            assert_eq!(
                b.state(&fragile, &ErrorKind::new("http_503"), now()),
                lazaret_core::BreakerState::HalfOpen { probes_left: 2 }
            );
        }

        let polls: Vec<_> = (0..20)
            .map(|w| {
                let router = router.clone();
                tokio::spawn(async move {
                    post(
                        router,
                        "/v1/leases",
                        json!({"worker_id": format!("w-{w}"), "max_jobs": 5,
                               "lease_ms": 60_000, "wait_ms": 200}),
                    )
                    .await
                })
            })
            .collect();
        let mut leased = 0;
        for p in polls {
            let (status, body) = p.await.expect("the poll ran");
            assert_eq!(status, 200, "{body}");
            leased += body["jobs"].as_array().expect("jobs").len();
        }
        assert_eq!(
            leased, 2,
            "two probes in all, however many polls run at once"
        );

        // The slots are spent, not lost: none is left for a later lease.
        let (_, body) = post(router.clone(), "/v1/leases", json!({"max_jobs": 5})).await;
        assert_eq!(body["jobs"], json!([]));
        assert_eq!(
            app.breakers
                .lock()
                .unwrap()
                .state(&fragile, &ErrorKind::new("http_503"), now()),
            lazaret_core::BreakerState::HalfOpen { probes_left: 0 }
        );
    }
}
