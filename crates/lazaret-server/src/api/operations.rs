//! Operators: pause and resume, the audit log, breakers, stats and metrics.

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::header;
use axum::response::IntoResponse;
use lazaret_core::NAME_BYTES_MAX;
use lazaret_store::{AuditEntry, AuditId, AuditQuery, PauseTarget, Store};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::app::{App, now};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::{metrics as m, views};

use super::{
    ApiResult, Shared, audit_request, check_field, empty_none, ok, page_limit, parse_json,
};

#[derive(Debug, Deserialize, JsonSchema)]
pub(super) struct PauseBody {
    #[serde(rename = "type")]
    job_type: Option<String>,
    lane: Option<String>,
}

async fn pause_resume<S: Store>(
    app: &App<S>,
    caller: Caller,
    body: &[u8],
    pause: bool,
) -> ApiResult {
    let b: PauseBody = parse_json(body)?;
    check_field("type", b.job_type.as_deref(), NAME_BYTES_MAX)?;
    check_field("lane", b.lane.as_deref(), NAME_BYTES_MAX)?;
    let target = match (b.job_type, b.lane) {
        (Some(t), None) if !t.is_empty() => PauseTarget::Type(t),
        (None, Some(l)) if !l.is_empty() => PauseTarget::Lane(l),
        _ => {
            return Err(ApiError::bad_request(
                "send exactly one of \"type\" or \"lane\"",
            ));
        }
    };
    let action = if pause { "pause" } else { "resume" };
    let entry = AuditEntry {
        at: now(),
        actor: caller.name,
        action: action.into(),
        request: audit_request(body),
        count: 0,
    };
    // Stored (with its audit entry) before it takes effect: what is in
    // force is always what a restart brings back.
    let changed = app.store.set_pause(target.clone(), pause, entry).await?;
    app.set_paused(&target, pause);
    if !pause {
        app.ready.anything();
    }
    // Every node of a cluster pauses (or resumes) too; a store of one
    // process shares nothing.
    let name = target.name().to_owned();
    let switch = match target {
        PauseTarget::Type(_) => lazaret_store::Switch::PauseType {
            name,
            paused: pause,
        },
        PauseTarget::Lane(_) => lazaret_store::Switch::PauseLane {
            name,
            paused: pause,
        },
    };
    app.store.publish(switch).await?;
    ok(json!({ "ok": true, "paused": pause, "changed": changed }))
}

pub(super) async fn pause<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    body: Bytes,
) -> ApiResult {
    pause_resume(&app, caller, &body, true).await
}

pub(super) async fn resume<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    body: Bytes,
) -> ApiResult {
    pause_resume(&app, caller, &body, false).await
}

/// The query of `GET /v1/audit`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct AuditParams {
    limit: Option<u32>,
    cursor: Option<String>,
    action: Option<String>,
    actor: Option<String>,
}

/// The actions the audit log records.
const AUDIT_ACTIONS: [&str; 10] = [
    "redrive",
    "purge",
    "archive",
    "restore",
    "pause",
    "resume",
    "token_create",
    "token_revoke",
    "denied",
    "cancel",
];

pub(super) async fn audit<S: Store>(
    State(app): Shared<S>,
    query: Result<Query<AuditParams>, QueryRejection>,
) -> ApiResult {
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

pub(super) async fn breakers<S: Store>(State(app): Shared<S>) -> ApiResult {
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
        &s.oldest_ready
            .iter()
            .map(|(l, at)| (l.to_string(), now.saturating_since(*at)))
            .collect::<Vec<_>>(),
        &s.dead_letters
            .iter()
            .map(|(t, r, n)| (t.clone().unwrap_or_default(), r.as_str().to_owned(), *n))
            .collect::<Vec<_>>(),
        &open_types,
        dl_total > app.config.dead_letters_warn,
    );
    // Every node's dead letters, read from the store up to now (the
    // cluster's on PostgreSQL; on SQLite the same as this node's).
    if let Err(e) = crate::alerts::catch_up(app).await {
        tracing::warn!(error = %e, "stats: cannot read the newest dead letters; reporting the failure statistics as last read");
    }
    let now = crate::app::now();
    let (failures, recent) = app.alerts.cluster_view();
    let surge = failures.surge(now).map(|s| {
        json!({
            "key": s.key.to_string(), "count": s.count, "total": s.total, "share": s.share,
        })
    });
    // Per type, the rule the alerts' `reason_surge` applies (with the
    // server's thresholds), each with the dead-letter reason it carries:
    // the rows the dashboard marks. `surge` above stays the cross-type one.
    let surges: Vec<Value> = {
        lazaret_core::type_surges(
            &failures,
            &recent,
            now,
            app.config.surge_min,
            app.config.surge_share,
        )
        .iter()
        .map(|t| {
            let s = &t.surge;
            json!({
                "type": s.key.job_type().as_str(),
                "reason": t.reason.map(|r| r.as_str()),
                "cause": s.key.cause().to_string(),
                "fingerprint": s.key.fingerprint(),
                "key": s.key.to_string(), "count": s.count, "total": s.total, "share": s.share,
            })
        })
        .collect()
    };
    let top: Vec<Value> = failures
        .top(10)
        .iter()
        .map(|k| json!({ "type": k.key.job_type().as_str(), "cause": k.key.cause().to_string(), "fingerprint": k.key.fingerprint(), "count": k.count }))
        .collect();
    let paused = {
        let p = app.paused.lock().unwrap_or_else(|p| p.into_inner());
        json!({ "types": p.types, "lanes": p.lanes })
    };
    // Broker messages whose retries lazaret holds: off the broker, so only
    // lazaret can say how many wait.
    let held_of = |name: &str| {
        s.held_retries
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, c)| *c)
    };
    for src in &app.config.sources {
        m::source_held(&src.name, held_of(&src.name));
    }
    let held_retries = json!({
        "total": s.held_retries.iter().map(|(_, n)| n).sum::<u64>(),
        "by_source": s.held_retries.iter().map(|(n, c)| (n.clone(), json!(c)))
            .collect::<serde_json::Map<_, _>>(),
    });
    Ok(json!({
        "paused": paused,
        "lanes": s.lanes.iter().map(|(l, c)| (l.to_string(), json!({
            "queued": c.queued, "scheduled": c.scheduled, "leased": c.leased,
            "oldest_age_ms": s.oldest_ready.iter().find(|(o, _)| o == l)
                .map_or(0, |(_, at)| lazaret_core::time::duration_ms(now.saturating_since(*at))),
        }))).collect::<serde_json::Map<_, _>>(),
        "succeeded_kept": s.succeeded,
        "store": store_section(&s),
        "dead_letters": {
            "total": dl_total,
            "warn_at": app.config.dead_letters_warn,
            "by_type_reason": s.dead_letters.iter().map(|(t, r, n)| json!({ "type": t, "reason": r.as_str(), "count": n })).collect::<Vec<_>>(),
            "rate_per_min": failures.rate_per_min(now),
            "top_failures": top,
            "other_failures": failures.other(),
            "surge": surge,
            "surges": surges,
        },
        "breakers": breakers.iter().map(|b| json!({ "type": b.ty.as_str(), "kind": b.kind.as_str(), "state": b.state.as_str() })).collect::<Vec<_>>(),
        "cancelled_kept": s.cancelled,
        "held_retries": held_retries,
    }))
}

/// `/v1/stats`'s `store` object: which backend, and its group-commit
/// counters when it keeps them (both stores do; another might not).
fn store_section(s: &lazaret_store::StoreStats) -> Value {
    let mut out = json!({ "backend": s.backend });
    if let Some(g) = s.group_commit {
        let ratio = |n: u64, d: u64| if d == 0 { 0.0 } else { n as f64 / d as f64 };
        let extra = json!({
            "commits": g.commits,
            "commands": g.commands,
            "commands_per_commit": ratio(g.commands, g.commits),
            "syncs": g.syncs,
            "commands_per_sync": ratio(g.commands, g.syncs),
            "sync_avg_ms": ratio(g.sync_micros, g.syncs) / 1000.0,
            "leases": g.leases,
            "lease_steps_per_lease": ratio(g.lease_steps, g.leases),
            "conflicts": g.conflicts,
        });
        if let (Some(o), Value::Object(e)) = (out.as_object_mut(), extra) {
            o.extend(e);
        }
    }
    out
}

pub(super) async fn stats<S: Store>(State(app): Shared<S>) -> ApiResult {
    ok(snapshot(&app).await?)
}

pub(super) async fn metrics<S: Store>(State(app): Shared<S>) -> ApiResult {
    m::store_writable(app.store_writes.refusal().is_none());
    snapshot(&app).await?;
    let text = m::render();
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}
