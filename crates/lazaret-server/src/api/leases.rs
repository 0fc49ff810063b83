//! Workers: leases, outcomes (ack, fail, batched), heartbeats.

use std::time::Duration;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::IntoResponse;
use lazaret_core::{
    ErrorKind, Event, Failure, FailureClass, JobId, JobType, Lane, NAME_BYTES_MAX, Transition,
    WorkerId,
};
use lazaret_store::{Completed, Completion, LeaseRequest, LeaseToken, Store};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::app::{App, now};
use crate::auth::Action;
use crate::error::ApiError;
use crate::{metrics as m, views};

use super::{
    ApiResult, DELAY_MS_MAX, LEASE_JOBS_MAX, LEASE_NAMES_MAX, Shared, WAIT_MS_MAX, allow,
    check_duration, check_field, ok, parse_id, parse_json,
};

#[derive(Debug, Deserialize)]
struct LeaseBody {
    worker_id: Option<String>,
    lanes: Option<Vec<String>>,
    types: Option<Vec<String>>,
    max_jobs: Option<u32>,
    lease_ms: Option<u64>,
    wait_ms: Option<u64>,
}

pub(super) async fn lease<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
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
        for j in &jobs {
            m::job_waited(j.lane.as_str(), now.saturating_since(j.ready_at));
        }
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

pub(super) async fn ack<S: Store>(
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

pub(super) async fn fail<S: Store>(
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

pub(super) async fn acks<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
    allow(&app, &headers, Action::Work).await?;
    batch_outcomes(&app, &body, false).await
}

pub(super) async fn fails<S: Store>(
    State(app): Shared<S>,
    headers: HeaderMap,
    body: Bytes,
) -> ApiResult {
    allow(&app, &headers, Action::Work).await?;
    batch_outcomes(&app, &body, true).await
}

#[derive(Debug, Deserialize)]
struct HeartbeatBody {
    lease_token: String,
    extend_ms: Option<u64>,
}

pub(super) async fn heartbeat<S: Store>(
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
