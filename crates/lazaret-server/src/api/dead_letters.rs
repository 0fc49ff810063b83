//! Dead letters: list, read, reasons, groups, payload, redrive, purge,
//! archive and restore.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use lazaret_core::{DeadLetterReason, JobId};
use lazaret_guard::{RedriveError, SourceSet};
use lazaret_store::{
    AuditEntry, AuditId, DeadLetter, DeadLetterFilter, DeadLetterId, Selector, Stage, Store,
};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::{Value, json};

use crate::app::{App, now};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::{metrics as m, views};

use super::{
    ApiResult, Shared, audit_request, empty_none, ok, page_limit, parse_id, parse_json,
    stored_payload,
};

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct DlQuery {
    #[serde(rename = "type")]
    job_type: Option<String>,
    tenant: Option<String>,
    lane: Option<String>,
    reason: Option<String>,
    source: Option<String>,
    stage: Option<String>,
    job_id: Option<String>,
    group: Option<String>,
    archived: Option<bool>,
    limit: Option<u32>,
    cursor: Option<String>,
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

pub(super) async fn dead_letters<S: Store>(
    State(app): Shared<S>,
    query: Result<Query<DlQuery>, QueryRejection>,
) -> ApiResult {
    // An unknown parameter is refused: a misspelt filter must not list
    // (or, copied into a redrive, move) every dead letter.
    let Query(q) = query.map_err(|e| {
        ApiError::bad_request(format!(
            "{}; the parameters are type, tenant, lane, reason, source, stage, job_id, group, archived, limit and cursor",
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
        group: empty_none(q.group),
        archived: q.archived.unwrap_or(false),
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
        "items": items.iter().map(|d| dead_letter_view(&app, d, None)).collect::<Vec<_>>(),
        "next_cursor": next.map(|c| c.to_string()),
    }))
}

/// The dead letter `id`, or `404 NOT_FOUND` naming it.
async fn existing<S: Store>(app: &App<S>, id: DeadLetterId) -> Result<DeadLetter, ApiError> {
    app.store
        .dead_letter(id)
        .await?
        .ok_or_else(|| no_dead_letter(id))
}

fn no_dead_letter(id: DeadLetterId) -> ApiError {
    ApiError::not_found(format!("no dead letter with id {}", id.0))
}

pub(super) async fn dead_letter<S: Store>(
    State(app): Shared<S>,
    Path(id): Path<String>,
) -> ApiResult {
    let dl = DeadLetterId(parse_id(&id, "dead letter")?);
    let d = existing(&app, dl).await?;
    // One dead letter shows a Celery task's arguments from the whole body.
    let payload = match &d.source {
        Some(s) if views::is_celery(s) => app.store.dead_letter_payload(dl).await?.flatten(),
        _ => None,
    };
    let mut v = dead_letter_view(&app, &d, payload.as_deref());
    // A broker message's redrives are followed through the copies it
    // republished; a lazaret job's through its own redrives.
    let lineage = match (&d.source, d.job_id) {
        (Some(_), _) => app.store.message_lineage(dl).await?,
        (None, Some(job)) => app.store.lineage(job).await?,
        (None, None) => Vec::new(),
    };
    v["lineage"] = lineage_view(&lineage, &d);
    ok(v)
}

/// Whether a dead letter is held for a person: a lazaret job redriven
/// `redrives_max` times or more already (computed when read, from the
/// job's redrive count and the config now).
fn is_held<S: Store>(app: &App<S>, d: &DeadLetter) -> bool {
    d.stage == Stage::Processing && d.redrive_count >= app.config.redrives_max
}

/// A dead letter as the API shows it, with `held`.
fn dead_letter_view<S: Store>(app: &App<S>, d: &DeadLetter, payload: Option<&[u8]>) -> Value {
    let mut v = views::dead_letter(d, payload);
    v["held"] = json!(is_held(app, d));
    v
}

/// A dead letter's lineage: each audited redrive of its job, oldest
/// first, and how it ended: every redrive but the last by the job failing
/// again into the group the next one took it from; the last by the job's
/// state now, which for a dead letter is dead-lettered again, into `d`'s
/// group.
fn lineage_view(entries: &[lazaret_store::LineageEntry], d: &DeadLetter) -> Value {
    let items: Vec<Value> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let outcome = match entries.get(i + 1) {
                Some(next) => json!({
                    "state": "dead_lettered",
                    "failed_again": true,
                    "group": next.from_group,
                    "current": false,
                }),
                None => json!({
                    "state": "dead_lettered",
                    "failed_again": true,
                    "group": d.group_id,
                    "current": true,
                }),
            };
            let to = (e.to_type.is_some() || e.to_lane.is_some())
                .then(|| json!({"type": e.to_type, "lane": e.to_lane}));
            json!({
                "redrive_id": e.redrive_id,
                "at": views::time(e.audit.at),
                "actor": e.audit.actor,
                "from_group": e.from_group,
                "payload_edited": e.edited,
                "to": to,
                "outcome": outcome,
            })
        })
        .collect();
    json!(items)
}

pub(super) async fn dead_letter_payload<S: Store>(
    State(app): Shared<S>,
    Path(id): Path<String>,
) -> ApiResult {
    let dl = DeadLetterId(parse_id(&id, "dead letter")?);
    let d = existing(&app, dl).await?;
    let own_type = d.source.as_ref().and_then(|s| s.content_type.as_deref());
    match app.store.dead_letter_payload(dl).await? {
        None => Err(no_dead_letter(dl)),
        Some(None) => Err(ApiError::not_found(format!(
            "dead letter {id} has no stored payload: it was refused before it was read whole; its preview is in the dead letter"
        ))),
        Some(Some(bytes)) => Ok(stored_payload(
            bytes,
            own_type,
            &format!("dead-letter-{}", dl.0),
        )),
    }
}

pub(super) async fn reasons<S: Store>(State(app): Shared<S>) -> ApiResult {
    let r = app.store.reasons().await?;
    ok(json!({ "reasons": r.iter().map(views::reason).collect::<Vec<_>>() }))
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct GroupsQuery {
    #[serde(rename = "type")]
    job_type: Option<String>,
    reason: Option<String>,
    source: Option<String>,
    tenant: Option<String>,
    /// RFC 3339: only dead letters dead-lettered at or after it.
    since: Option<String>,
    archived: Option<bool>,
    limit: Option<u32>,
    cursor: Option<String>,
}

/// `GET /v1/dead-letters/groups`: failure groups, the newest `last_at`
/// first (ties by id); `next_cursor` continues after the page's last group.
pub(super) async fn groups<S: Store>(
    State(app): Shared<S>,
    query: Result<Query<GroupsQuery>, QueryRejection>,
) -> ApiResult {
    let Query(q) = query.map_err(|e| {
        ApiError::bad_request(format!(
            "{}; the parameters are type, reason, source, tenant, since, archived, limit and cursor",
            e.body_text()
        ))
    })?;
    let reason = empty_none(q.reason);
    check_reason(&reason)?;
    let since = match empty_none(q.since) {
        Some(t) => Some(
            humantime::parse_rfc3339_weak(&t)
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| lazaret_core::Timestamp::from_millis(d.as_millis() as i64))
                .ok_or_else(|| {
                    ApiError::bad_request(format!(
                        "since {t:?} is not an RFC 3339 time (e.g. 2026-01-02T10:00:00Z)"
                    ))
                })?,
        ),
        None => None,
    };
    let cursor = match empty_none(q.cursor) {
        Some(c) => Some(lazaret_store::GroupCursor::parse(&c).ok_or_else(|| {
            ApiError::bad_request(format!("cursor {c:?} is not one this server gave"))
        })?),
        None => None,
    };
    let (items, next) = app
        .store
        .groups(lazaret_store::GroupQuery {
            job_type: empty_none(q.job_type),
            reason,
            source: empty_none(q.source),
            tenant: empty_none(q.tenant),
            since,
            archived: q.archived.unwrap_or(false),
            limit: page_limit(q.limit, 50, 1000)?,
            cursor,
            now: now(),
            redrives_max: Some(app.config.redrives_max),
        })
        .await?;
    // The alerts' verdict: a group is `systemic` when it is the failure
    // surging in its type now (the `reason_surge` rule, with the server's
    // `surge_min` and `surge_share`), else `scattered`.
    if let Err(e) = crate::alerts::catch_up(&app).await {
        tracing::warn!(error = %e, "groups: cannot read the newest dead letters; the verdicts are as last read");
    }
    let surging: Vec<lazaret_core::FailureKey> = {
        let (failures, recent) = app.alerts.cluster_view();
        lazaret_core::type_surges(
            &failures,
            &recent,
            now(),
            app.config.surge_min,
            app.config.surge_share,
        )
        .into_iter()
        .map(|t| t.surge.key)
        .collect()
    };
    let items: Vec<Value> = items
        .iter()
        .map(|g| {
            let kind = g.kind.as_deref().map(lazaret_core::ErrorKind::new);
            let key = lazaret_core::FailureKey::new(
                &lazaret_core::JobType::new(g.job_type.as_deref().unwrap_or("")),
                g.reason,
                kind.as_ref(),
                g.sample_error.as_deref().unwrap_or(""),
            );
            let mut v = views::group(g);
            v["verdict"] = json!(if surging.contains(&key) {
                "systemic"
            } else {
                "scattered"
            });
            v
        })
        .collect();
    ok(json!({
        "items": items,
        "next_cursor": next.map(|c| c.to_text()),
    }))
}

/// The body of a redrive or purge. Unknown keys are refused: a misspelt
/// `dry_run` must not turn a rehearsal into the real thing.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SelectBody {
    ids: Option<Vec<Value>>,
    filter: Option<SelectFilter>,
    #[serde(default)]
    all: bool,
    #[serde(default)]
    dry_run: bool,
    rate_per_sec: Option<u32>,
    #[serde(default)]
    confirm: bool,
    /// Redrive only: send the jobs to another type and/or lane instead of
    /// back where they were.
    to: Option<RedirectBody>,
}

/// Where a redrive sends its jobs (`"to": {"type": T, "lane": L}`, either
/// or both): a repair handler's type, a lane of its own.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct RedirectBody {
    /// The type the jobs become; admission is applied again for it
    /// (schema of its newest version, payload byte cap).
    #[serde(rename = "type")]
    job_type: Option<String>,
    /// The lane they are queued in.
    lane: Option<String>,
}

/// A body's `to`, checked: `None` when absent.
fn redirect(b: &SelectBody) -> Result<Option<lazaret_store::Redirect>, ApiError> {
    let Some(to) = &b.to else { return Ok(None) };
    for (field, v) in [("to.type", &to.job_type), ("to.lane", &to.lane)] {
        if let Some(v) = v {
            if v.trim().is_empty() {
                return Err(ApiError::bad_request(format!(
                    "{field} must not be empty; leave it out to keep the jobs' own"
                )));
            }
            super::check_field(field, Some(v), lazaret_core::NAME_BYTES_MAX)?;
        }
    }
    if to.job_type.is_none() && to.lane.is_none() {
        return Err(ApiError::bad_request(
            "\"to\" names neither a type nor a lane: send {\"type\": T} and/or {\"lane\": L}, or leave it out to redrive the jobs where they were",
        ));
    }
    Ok(Some(lazaret_store::Redirect {
        job_type: to.job_type.clone(),
        lane: to.lane.clone(),
        schema_version: None,
    }))
}

/// `to` is a redrive's: refused elsewhere rather than ignored.
fn no_redirect(b: &SelectBody, action: &str) -> Result<(), ApiError> {
    if b.to.is_some() {
        return Err(ApiError::bad_request(format!(
            "\"to\" is for redrive only; a {action} has nowhere to send dead letters: remove it"
        )));
    }
    Ok(())
}

/// The filter of a redrive or purge: the contract's keys, no others.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct SelectFilter {
    #[serde(rename = "type")]
    job_type: Option<String>,
    tenant: Option<String>,
    lane: Option<String>,
    reason: Option<String>,
    source: Option<String>,
    stage: Option<String>,
    group: Option<String>,
}

/// The dead letters a body selects: its ids, or its filter over the
/// active dead letters (`archived: true`: the archived ones, as a restore
/// reads them).
fn selector(b: &SelectBody) -> Result<Selector, ApiError> {
    selector_in(b, false)
}

fn selector_in(b: &SelectBody, archived: bool) -> Result<Selector, ApiError> {
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
                group: empty_none(f.group.clone()),
                archived: false,
            };
            check_reason(&f.reason)?;
            if f == DeadLetterFilter::default() && !b.all {
                return Err(ApiError::bad_request(
                    "an empty filter matches every dead letter: send \"all\": true to mean that, or name a type, tenant, lane, reason, source, stage or group",
                ));
            }
            let f = DeadLetterFilter { archived, ..f };
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
    /// A broker message: the queue it would be republished to, or why it
    /// may not be (a watch source's refused target).
    queue: Option<Result<String, String>>,
    /// A redirect: the schema version the new type's admission chose, or
    /// why it refused the job (or why the dead letter cannot be sent).
    admitted: Option<Result<Option<u32>, Refused>>,
    /// What its span needs (`lazaret.redrive`): type, tenant, lane and
    /// the trace it joins.
    job_type: Option<String>,
    tenant: Option<String>,
    lane: Option<String>,
    traceparent: Option<lazaret_core::TraceParent>,
}

/// Why a redirect's admission refused a job: the error a new enqueue of
/// its payload as the new type would get.
#[derive(Debug, Clone)]
struct Refused {
    code: &'static str,
    reason: Option<&'static str>,
    message: String,
}

impl Refused {
    fn view(&self) -> Value {
        json!({"code": self.code, "reason": self.reason, "message": cut(&self.message, ITEM_ERROR_BYTES_MAX)})
    }
}

/// Admission applied again for a redirect's new type (a lane alone changes
/// no admission): the schema version chosen, or why it is refused. Only
/// lazaret jobs can be redirected.
async fn admit_redirect<S: Store>(
    app: &App<S>,
    d: &DeadLetter,
    to: &lazaret_store::Redirect,
) -> Result<Result<Option<u32>, Refused>, ApiError> {
    if d.source.is_some() {
        return Ok(Err(Refused {
            code: "BAD_REQUEST",
            reason: None,
            message: "a broker message cannot be redirected: it goes back to its broker; redrive it without \"to\"".into(),
        }));
    }
    let Some(job_type) = &to.job_type else {
        return Ok(Ok(d.schema_version));
    };
    let Some(Some(payload)) = app.store.dead_letter_payload(d.id).await? else {
        return Ok(Err(Refused {
            code: "NOT_FOUND",
            reason: None,
            message: "its payload is not stored, so it cannot be admitted as the new type".into(),
        }));
    };
    let verdict = lazaret_core::admit(
        &app.config.admission,
        &lazaret_core::AdmissionRequest {
            job_type: Some(job_type),
            tenant: d.tenant.as_deref(),
            // The new type's own newest schema: the old type's version
            // numbers mean nothing to it.
            schema_version: None,
            payload: &payload,
            declared_size: None,
            shed: None,
        },
    );
    Ok(match verdict {
        lazaret_core::Verdict::Admitted { schema_version } => Ok(schema_version),
        other => {
            let e = ApiError::from_verdict(other)
                .unwrap_or_else(|| ApiError::bad_request("refused by admission"));
            Err(Refused {
                code: e.code.word().unwrap_or("BAD_REQUEST"),
                reason: e.reason,
                message: format!(
                    "type {job_type:?} refuses its payload as a new enqueue would: {}",
                    e.message
                ),
            })
        }
    })
}

/// What became of one target.
#[derive(Debug)]
struct Done {
    redriven: bool,
    error: Option<String>,
    /// The error is a refused target (the watched queue, one not allowed,
    /// a name the broker does not take): redriving again cannot help.
    refused: bool,
}

/// The longest item error a redrive answers with: a broker's error can
/// quote a whole queue name taken from the message.
const ITEM_ERROR_BYTES_MAX: usize = 1024;

/// At most `max` bytes of `s` (on a character boundary), with `…` when cut.
fn cut(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

fn redrive_item(t: &Target, done: Option<&Done>, to: Option<&lazaret_store::Redirect>) -> Value {
    let refused = match &t.admitted {
        Some(Err(r)) => Some(r),
        _ => None,
    };
    let error = done
        .and_then(|d| d.error.as_deref())
        .or(match (&t.queue, done) {
            (Some(Err(why)), None) => Some(why.as_str()),
            _ => None,
        })
        .or(refused.map(|r| r.message.as_str()))
        .map(|e| cut(e, ITEM_ERROR_BYTES_MAX));
    json!({
        "to": to.map(|to| json!({"type": to.job_type, "lane": to.lane})),
        "refused": refused.map(Refused::view),
        "dead_letter_id": t.id.to_string(),
        "job_id": t.job_id.map(|j| j.to_string()),
        "source": t.source.as_ref().map(|s| &s.0),
        "message_id": t.source.as_ref().map(|s| &s.1),
        "target_queue": t.queue.as_ref().and_then(|q| q.as_ref().ok()),
        "redriven": done.is_some_and(|d| d.redriven),
        "error": error,
    })
}

pub(super) async fn redrive<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    body: Bytes,
) -> ApiResult {
    let b: SelectBody = parse_json(&body)?;
    let sel = selector(&b)?;
    let to = redirect(&b)?;
    if b.rate_per_sec == Some(0) {
        return Err(ApiError::bad_request(
            "rate_per_sec must be at least 1 (leave it out for no limit)",
        ));
    }
    let requested = match &sel {
        Selector::Ids(ids) => ids.clone(),
        Selector::Filter(_) => Vec::new(),
    };
    // A redrive that names ids is explicit: it moves held dead letters too.
    let explicit = matches!(sel, Selector::Ids(_));
    let matched = app.store.match_dead_letters(sel).await?;
    let sources = app.source_set();
    let mut skipped = 0usize;
    let mut held_skipped = 0usize;
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
            if !explicit && is_held(&app, &d) {
                // Failed again after `redrives_max` redrives: a person
                // decides, by naming it.
                held_skipped += 1;
                continue;
            }
            let queue = d.source.is_some().then(|| {
                sources
                    .target(&d)
                    .map_err(|e| not_connected(&app, &d, e).unwrap_or_else(|e| e.to_string()))
            });
            let admitted = match &to {
                Some(to) => Some(admit_redirect(&app, &d, to).await?),
                None => None,
            };
            targets.push(Target {
                id,
                job_id: d.job_id.filter(|_| d.source.is_none()),
                source: d.source.map(|s| (s.name, s.message_id)),
                queue,
                admitted,
                job_type: d.job_type,
                tenant: d.tenant,
                lane: d.lane,
                traceparent: d.traceparent,
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
    let refused: Vec<Value> = targets
        .iter()
        .filter_map(|t| match &t.admitted {
            Some(Err(r)) => {
                let mut v = r.view();
                v["dead_letter_id"] = json!(t.id.to_string());
                v["job_id"] = json!(t.job_id.map(|j| j.to_string()));
                Some(v)
            }
            _ => None,
        })
        .collect();
    // The entry is written before anything moves and each batch adds what
    // it moved in its own transaction: a client gone or a process killed
    // halfway leaves an entry that says exactly what was redriven. It
    // says how many held dead letters the selection skipped.
    let mut request = audit_request(&body);
    if let Value::Object(m) = &mut request {
        m.insert("held_skipped".into(), json!(held_skipped));
    }
    let entry = app
        .store
        .audit(AuditEntry {
            at: now(),
            actor: caller.name,
            action: "redrive".into(),
            request,
            count: 0,
        })
        .await?;
    // Every broker message this request republishes carries this id, and
    // its report (`GET /v1/redrives/{id}`) is found by it.
    let redrive_id = lazaret_guard::redrive::new_redrive_id();
    app.store.record_redrive(redrive_id.clone(), entry).await?;

    let mut job_ids = Vec::new();
    let mut items = Vec::with_capacity(targets.len());
    let mut redriven = 0u64;
    let mut interrupted = false;
    if b.dry_run {
        items.extend(targets.iter().map(|t| redrive_item(t, None, to.as_ref())));
    } else {
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
            // Jobs by the schema version their new type admitted them
            // under (one group without a redirect).
            let mut batches: Vec<(Option<u32>, Vec<DeadLetterId>)> = Vec::new();
            for t in part.iter().filter(|t| t.source.is_none()) {
                let version = match &t.admitted {
                    None => None,
                    Some(Ok(v)) => *v,
                    Some(Err(_)) => continue,
                };
                match batches.iter_mut().find(|(v, _)| *v == version) {
                    Some((_, ids)) => ids.push(t.id),
                    None => batches.push((version, vec![t.id])),
                }
            }
            let mut moved: Vec<JobId> = Vec::new();
            for (version, ids) in batches {
                let redirect =
                    to.clone()
                        .map_or_else(Default::default, |to| lazaret_store::Redirect {
                            schema_version: version,
                            ..to
                        });
                moved.extend(
                    app.store
                        .redrive_to(ids, redirect, now(), Some(entry))
                        .await?,
                );
                app.ready.anything();
            }
            for t in part {
                let done = match (&t.source, t.job_id, &t.admitted) {
                    (_, _, Some(Err(r))) => Done {
                        redriven: false,
                        error: Some(r.message.clone()),
                        refused: true,
                    },
                    (None, Some(job), _) if moved.contains(&job) => {
                        let span = tracing::debug_span!(
                            "lazaret.redrive",
                            "job.id" = job.0,
                            "job.type" = t.job_type.as_deref(),
                            "job.tenant" = t.tenant.as_deref(),
                            "job.lane" = t.lane.as_deref(),
                            "dead_letter.id" = t.id.0,
                            "redrive.id" = %redrive_id,
                        );
                        lazaret_guard::trace::follow(&span, t.traceparent.as_ref());
                        drop(span);
                        job_ids.push(job);
                        Done {
                            redriven: true,
                            error: None,
                            refused: false,
                        }
                    }
                    (None, _, _) => Done {
                        redriven: false,
                        error: Some(match to.as_ref().and_then(|to| to.job_type.as_deref()) {
                            Some(t) => format!(
                                "its job is no longer dead-lettered (redriven or purged meanwhile), \
                                 or type {t:?} already has a job with its idempotency key in its tenant"
                            ),
                            None => "its job is no longer dead-lettered: it was redriven or purged meanwhile"
                                .into(),
                        }),
                        refused: false,
                    },
                    (Some(_), _, _) => {
                        redrive_message(&app, &sources, t.id, entry, &redrive_id).await
                    }
                };
                if done.redriven {
                    redriven += 1;
                }
                items.push(redrive_item(t, Some(&done), to.as_ref()));
            }
        }
        m::redriven(redriven);
        app.alerts.touch();
    }
    ok(json!({
        "redrive_id": redrive_id,
        "matched": targets.len(),
        "redriven": redriven,
        "job_ids": job_ids.iter().map(|j| j.to_string()).collect::<Vec<_>>(),
        "items": items,
        "not_found": not_found,
        "dry_run": b.dry_run,
        "skipped_admission_records": skipped,
        "held_skipped": held_skipped,
        "refused": refused,
        "to": to.as_ref().map(|to| json!({"type": to.job_type, "lane": to.lane})),
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
    redrive_id: &str,
) -> Done {
    redrive_message_with(app, sources, id, entry, None, redrive_id).await
}

/// A redrive error about a source that is configured but not connected
/// yet, said so; other errors are given back.
fn not_connected<S: Store>(
    app: &App<S>,
    dl: &lazaret_store::DeadLetter,
    e: RedriveError,
) -> Result<String, RedriveError> {
    let configured = dl
        .source
        .as_ref()
        .is_some_and(|s| app.config.sources.iter().any(|c| c.name == s.name));
    match e {
        RedriveError::UnknownSource { name, .. } if configured => Ok(format!(
            "source {name:?} is not connected to its broker yet (see the server log); redrive again once it is"
        )),
        e => Err(e),
    }
}

/// [`redrive_message`] with the body to republish: the stored one, or a
/// corrected one (`Some`).
async fn redrive_message_with<S: Store>(
    app: &App<S>,
    sources: &SourceSet,
    id: DeadLetterId,
    entry: AuditId,
    corrected: Option<Vec<u8>>,
    redrive_id: &str,
) -> Done {
    let failed = |error: String| Done {
        redriven: false,
        error: Some(error),
        refused: false,
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
    let stored = match corrected {
        Some(body) => Ok(Some(Some(body))),
        None => app.store.dead_letter_payload(id).await,
    };
    let payload = match stored {
        Ok(Some(Some(p))) => p,
        Ok(_) => return failed("its body is not stored, so it cannot be republished".into()),
        Err(e) => return failed(e.to_string()),
    };
    // The copy is noted before it goes: a guard source may handle it, and
    // write how it ended, before the dead letter below leaves.
    if let Err(e) = app
        .store
        .note_redrive_copy(id, redrive_id.to_owned(), now())
        .await
    {
        return failed(e.to_string());
    }
    if let Err(e) = sources.redrive_as(&dl, payload, redrive_id).await {
        if let Err(forget) = app
            .store
            .forget_redrive_copy(id, redrive_id.to_owned())
            .await
        {
            tracing::warn!(dead_letter = %id, redrive = redrive_id, "a republish failed and its note in the redrive's report could not be removed (the report counts it as running): {forget}");
        }
        let refused = matches!(
            e,
            RedriveError::OwnQueue { .. }
                | RedriveError::NotAllowed { .. }
                | RedriveError::BadQueue { .. }
        );
        let error = not_connected(app, &dl, e).unwrap_or_else(|e| e.to_string());
        return Done {
            refused,
            ..failed(error)
        };
    }
    // The broker has the copy: the dead letter leaves (its note kept).
    match app
        .store
        .redrove_message(id, redrive_id.to_owned(), now(), Some(entry))
        .await
    {
        Ok(_) => Done {
            redriven: true,
            error: None,
            refused: false,
        },
        Err(e) => {
            tracing::error!(dead_letter = %id, "a redriven message was republished but its dead letter could not be removed: {e}");
            Done {
                redriven: true,
                error: Some(format!(
                    "republished, but the dead letter could not be removed ({e}); purge it (lazaret dlq purge --id {id} --confirm) so that it is not redriven twice"
                )),
                refused: false,
            }
        }
    }
}

pub(super) async fn purge<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    body: Bytes,
) -> ApiResult {
    let b: SelectBody = parse_json(&body)?;
    let sel = selector(&b)?;
    no_redirect(&b, "purge")?;
    if !b.confirm && !b.dry_run {
        return Err(ApiError::bad_request(
            "purge deletes dead letters for good: send \"confirm\": true (or \"dry_run\": true to see what it would delete)",
        ));
    }
    let requested = match &sel {
        Selector::Ids(ids) => ids.clone(),
        Selector::Filter(_) => Vec::new(),
    };
    let ids: Vec<DeadLetterId> = app
        .store
        .match_dead_letters(sel)
        .await?
        .into_iter()
        .map(|(i, _)| i)
        .collect();
    // Ids that match nothing: named, as redrive names them.
    let not_found = not_found(&requested, &ids);
    // A rehearsal deletes nothing and is not audited, as an archive's.
    if b.dry_run {
        return ok(json!({
            "purged": 0,
            "matched": ids.len(),
            "ids": ids.iter().map(|i| i.to_string()).collect::<Vec<_>>(),
            "not_found": not_found,
            "dry_run": true,
        }));
    }
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
    app.alerts.touch();
    ok(json!({ "purged": purged, "not_found": not_found }))
}

/// `GET /v1/redrives/{id}`: what a redrive did so far. `sent` is what it
/// moved or republished (its audit entry's count), `jobs` and `messages`
/// of which lazaret jobs and broker messages; jobs are counted by where
/// they stand now, messages by what lazaret saw of their copies:
/// `succeeded` (a guard source handled it), `running` (queued, scheduled
/// or leased; a message not seen back), `failed_again` (with the groups
/// they fell into), `cancelled`, and `gone` (jobs removed by retention or
/// purged since).
pub(super) async fn redrive_report<S: Store>(
    State(app): Shared<S>,
    Path(id): Path<String>,
) -> ApiResult {
    let Some(r) = app.store.redrive_report(id.clone()).await? else {
        return Err(ApiError::not_found(format!(
            "no redrive with id {:?}; a redrive's answer gives its redrive_id",
            cut(&id, 128)
        )));
    };
    let groups = |g: &[(String, u64)]| {
        g.iter()
            .map(|(group, count)| json!({"group": group, "count": count}))
            .collect::<Vec<_>>()
    };
    ok(json!({
        "id": r.id,
        "at": views::time(r.audit.at),
        "actor": r.audit.actor,
        "request": r.audit.request,
        "sent": r.audit.count,
        "jobs": r.jobs,
        "messages": r.messages,
        "succeeded": r.succeeded,
        "running": r.running,
        "failed_again": r.failed_again,
        "cancelled": r.cancelled,
        "gone": r.gone,
        "from_groups": groups(&r.from_groups),
        "failed_again_groups": groups(&r.failed_again_groups),
    }))
}

/// `POST /v1/dead-letters/archive`.
pub(super) async fn archive<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    body: Bytes,
) -> ApiResult {
    set_archived(&app, caller, &body, true).await
}

/// `POST /v1/dead-letters/restore`.
pub(super) async fn restore<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    body: Bytes,
) -> ApiResult {
    set_archived(&app, caller, &body, false).await
}

/// Archives (or restores) the dead letters a body selects, as a purge
/// selects them (ids, or a filter: over the active dead letters for an
/// archive, the archived ones for a restore), with `dry_run` and
/// `rate_per_sec` as a redrive has them. The audit entry (`archive`,
/// `restore`) is written first and counts what each batch changed.
async fn set_archived<S: Store>(
    app: &App<S>,
    caller: Caller,
    body: &Bytes,
    archived: bool,
) -> ApiResult {
    let b: SelectBody = parse_json(body)?;
    let sel = selector_in(&b, !archived)?;
    no_redirect(&b, if archived { "archive" } else { "restore" })?;
    if b.rate_per_sec == Some(0) {
        return Err(ApiError::bad_request(
            "rate_per_sec must be at least 1 (leave it out for no limit)",
        ));
    }
    let (action, done_word) = if archived {
        ("archive", "archived")
    } else {
        ("restore", "restored")
    };
    let requested = match &sel {
        Selector::Ids(ids) => ids.clone(),
        Selector::Filter(_) => Vec::new(),
    };
    let mut ids: Vec<DeadLetterId> = Vec::new();
    if !requested.is_empty() {
        // By id: only those in the other state are changed.
        for id in &requested {
            if let Some(d) = app.store.dead_letter(*id).await?
                && d.archived_at.is_some() != archived
                && !ids.contains(id)
            {
                ids.push(*id);
            }
        }
    } else {
        ids = app
            .store
            .match_dead_letters(sel)
            .await?
            .into_iter()
            .map(|(i, _)| i)
            .collect();
    }
    let not_found = not_found(&requested, &ids);
    let reply = |changed: u64, interrupted: bool| {
        let mut r = json!({
            "matched": ids.len(),
            "ids": ids.iter().map(|i| i.to_string()).collect::<Vec<_>>(),
            "not_found": not_found,
            "dry_run": b.dry_run,
            "interrupted": interrupted,
        });
        r[done_word] = json!(changed);
        r
    };
    if b.dry_run {
        return ok(reply(0, false));
    }
    let entry = app
        .store
        .audit(AuditEntry {
            at: now(),
            actor: caller.name,
            action: action.into(),
            request: audit_request(body),
            count: 0,
        })
        .await?;
    let chunk = b.rate_per_sec.map_or(ids.len().max(1), |r| r as usize);
    let mut changed = 0u64;
    let mut interrupted = false;
    for (n, part) in ids.chunks(chunk).enumerate() {
        if n > 0 {
            let stopped = tokio::select! {
                () = tokio::time::sleep(Duration::from_secs(1)) => false,
                () = app.stopping() => true,
            };
            if stopped || app.is_stopping() {
                interrupted = true;
                break;
            }
        }
        changed += app
            .store
            .archive(part.to_vec(), archived, now(), Some(entry))
            .await?;
    }
    app.alerts.touch();
    ok(reply(changed, interrupted))
}

/// Longest `reason` of a corrected redrive, in bytes.
pub const EDIT_REASON_BYTES_MAX: usize = 1024;

/// A field that is there, even as `null`.
fn present_raw<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Box<serde_json::value::RawValue>>, D::Error> {
    Box::<serde_json::value::RawValue>::deserialize(d).map(Some)
}

/// The body of `POST /v1/dead-letters/{id}/redrive`.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub(super) struct CorrectedBody {
    #[serde(default, deserialize_with = "present_raw")]
    payload: Option<Box<serde_json::value::RawValue>>,
    reason: Option<String>,
    /// The schema version to admit the payload under; the dead letter's
    /// when absent.
    schema_version: Option<u32>,
}

/// `POST /v1/dead-letters/{id}/redrive`: one dead letter redriven with a
/// corrected payload. The payload passes admission as a new enqueue would
/// (byte cap, type, tenant, schema; nothing is recorded as poison when it
/// does not: the operator is answered instead); the audit entry is written
/// first and says the payload was edited, by whom and why. A lazaret job
/// keeps its id, key and history and keeps the payload it had in
/// `payload_edits`; a broker message is republished with the corrected
/// body and leaves the quarantine once the broker confirmed it.
pub(super) async fn redrive_corrected<S: Store>(
    State(app): Shared<S>,
    caller: Caller,
    Path(id): Path<String>,
    body: Bytes,
) -> ApiResult {
    let dl = DeadLetterId(parse_id(&id, "dead letter")?);
    let b: CorrectedBody = parse_json(&body)?;
    let Some(payload) = b.payload else {
        return Err(ApiError::bad_request(
            "payload is required: send \"payload\": <the corrected JSON value> and \"reason\": \"why\" \
             (to redrive the payload as it is, use POST /v1/dead-letters/redrive)",
        ));
    };
    let reason = b.reason.unwrap_or_default();
    if reason.trim().is_empty() {
        return Err(ApiError::bad_request(
            "reason is required: say why the payload was corrected (the audit log keeps it)",
        ));
    }
    if reason.len() > EDIT_REASON_BYTES_MAX {
        return Err(ApiError::bad_request(format!(
            "reason is {} bytes; keep it to {EDIT_REASON_BYTES_MAX} (link a ticket for more)",
            reason.len()
        )));
    }
    let d = existing(&app, dl).await?;
    if d.stage == Stage::Admission {
        return Err(ApiError::bad_request(format!(
            "dead letter {id} is an admission record: nothing was admitted, so there is no job to redrive; \
             enqueue the corrected payload as a new job (POST /v1/jobs)"
        )));
    }
    let new = payload.get().as_bytes();
    let schema_version = b.schema_version.or(d.schema_version);
    let verdict = lazaret_core::admit(
        &app.config.admission,
        &lazaret_core::AdmissionRequest {
            job_type: d.job_type.as_deref(),
            tenant: d.tenant.as_deref(),
            schema_version,
            payload: new,
            declared_size: None,
            shed: None,
        },
    );
    let schema_version = match verdict {
        lazaret_core::Verdict::Admitted { schema_version } => schema_version,
        other => {
            let mut e = ApiError::from_verdict(other)
                .unwrap_or_else(|| ApiError::bad_request("the corrected payload was refused"));
            e.message = format!(
                "the corrected payload is refused as a new enqueue would be: {}; nothing was redriven",
                e.message.trim_end_matches('.')
            );
            m::rejected_code(&e.code);
            return Err(e);
        }
    };
    let sha = hex::encode(lazaret_core::payload_sha256(new));
    let entry = app
        .store
        .audit(AuditEntry {
            at: now(),
            actor: caller.name.clone(),
            action: "redrive".into(),
            request: json!({
                "dead_letter_id": dl.to_string(),
                "job_id": d.job_id.filter(|_| d.source.is_none()).map(|j| j.to_string()),
                "source": d.source.as_ref().map(|s| &s.name),
                "message_id": d.source.as_ref().map(|s| &s.message_id),
                "payload_edited": true,
                "reason": reason,
                "edited_by": caller.name,
                "payload_size": new.len(),
                "payload_sha256": sha,
                "schema_version": schema_version,
                "previous_payload_size": d.payload_size,
                "previous_payload_sha256": d.payload_sha256,
            }),
            count: 0,
        })
        .await?;
    let redrive_id = lazaret_guard::redrive::new_redrive_id();
    app.store.record_redrive(redrive_id.clone(), entry).await?;
    let reply = |job_id: Option<String>| {
        json!({
            "redrive_id": redrive_id,
            "redriven": true,
            "dead_letter_id": dl.to_string(),
            "job_id": job_id,
            "source": d.source.as_ref().map(|s| &s.name),
            "message_id": d.source.as_ref().map(|s| &s.message_id),
            "payload_size": new.len(),
            "payload_sha256": sha,
            "previous_payload_sha256": d.payload_sha256,
        })
    };
    if d.source.is_none() {
        let fix = lazaret_store::PayloadFix {
            payload: new.to_vec(),
            schema_version,
            actor: caller.name,
            reason,
        };
        return match app
            .store
            .redrive_corrected(dl, fix, now(), Some(entry))
            .await?
        {
            Some(job) => {
                app.ready.anything();
                m::redriven(1);
                ok(reply(Some(job.to_string())))
            }
            None => Err(ApiError::not_found(format!(
                "dead letter {id} is gone: it was redriven or purged meanwhile; nothing was changed"
            ))),
        };
    }
    let done = redrive_message_with(
        &app,
        &app.source_set(),
        dl,
        entry,
        Some(new.to_vec()),
        &redrive_id,
    )
    .await;
    if done.refused {
        return Err(ApiError::conflict(format!(
            "the corrected message was not republished: {}; the dead letter stays as it was",
            done.error.unwrap_or_default()
        )));
    }
    match (done.redriven, done.error) {
        (true, None) => {
            m::redriven(1);
            ok(reply(None))
        }
        (true, Some(warning)) => {
            m::redriven(1);
            let mut r = reply(None);
            r["warning"] = json!(warning);
            ok(r)
        }
        (false, error) => Err(ApiError::unavailable(format!(
            "the corrected message was not republished: {}; the dead letter stays as it was",
            error.unwrap_or_default()
        ))),
    }
}

/// The ids asked for that match nothing (a typo, or gone already), each
/// once, in the order asked: named in the answer, so that a client can say
/// the action did not do all it named.
fn not_found(requested: &[DeadLetterId], matched: &[DeadLetterId]) -> Vec<String> {
    let mut missing: Vec<String> = Vec::new();
    for id in requested {
        let text = id.0.to_string();
        if !matched.contains(id) && !missing.contains(&text) {
            missing.push(text);
        }
    }
    missing
}
