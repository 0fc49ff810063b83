//! The JSON shapes of the API: times as RFC 3339 UTC, ids as strings,
//! payloads embedded byte for byte as raw JSON.

use std::time::{Duration, UNIX_EPOCH};

use std::borrow::Cow;

use lazaret_core::{
    AttemptRecord, Failure, JobState, PREVIEW_BYTES_MAX, Timestamp, TraceParent, payload_preview,
    preview_is_binary,
};
use lazaret_guard::celery::{Task, arguments};
use lazaret_store::{ApiToken, DeadLetter, JobView, LeasedJob, ReasonCount, SourceRef};
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use crate::auth::TokenConfig;

/// The last millisecond RFC 3339 can write with four year digits:
/// 9999-12-31T23:59:59.999Z.
pub const TIME_MS_MAX: i64 = 253_402_300_799_999;

/// RFC 3339 with milliseconds, UTC. Never panics: an instant before the
/// epoch is written as the epoch, one after year 9999 as its last
/// millisecond (a reply about a committed job must always be writable).
pub fn time(t: Timestamp) -> String {
    let ms = t.as_millis().clamp(0, TIME_MS_MAX) as u64;
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

/// An optional time, `null` when absent.
pub fn opt_time(t: Option<Timestamp>) -> Value {
    t.map_or(Value::Null, |t| Value::String(time(t)))
}

/// A stored payload as embedded raw JSON (it was valid JSON at admission).
pub fn raw_payload(bytes: &[u8]) -> Box<RawValue> {
    String::from_utf8(bytes.to_vec())
        .ok()
        .and_then(|s| RawValue::from_string(s).ok())
        .unwrap_or_else(|| RawValue::from_string("null".into()).expect("null is JSON"))
}

fn error(e: &Failure) -> Value {
    json!({
        "class": e.class.map(|c| c.as_str()),
        "kind": e.kind.as_str(),
        "message": e.message,
        "traceback": e.traceback,
        "retry_after_ms": e.retry_after.map(|d| d.as_millis() as u64),
    })
}

fn history(h: &[AttemptRecord]) -> Value {
    Value::Array(
        h.iter()
            .map(|r| {
                json!({
                    "attempt": r.attempt,
                    "started_at": time(r.started_at),
                    "ended_at": opt_time(r.ended_at),
                    "worker_id": r.worker_id.as_ref().map(|w| w.as_str()),
                    "outcome": r.outcome.as_str(),
                    "error": r.error.as_ref().map(error),
                })
            })
            .collect(),
    )
}

/// `GET /v1/jobs/{id}`. A struct, not `json!`: `json!` would parse the raw
/// payload into a `Value` and lose its bytes (key order, spacing, numbers).
#[derive(Debug, Serialize)]
pub struct JobBody<'a> {
    id: String,
    #[serde(rename = "type")]
    job_type: &'a str,
    tenant: &'a str,
    lane: &'a str,
    state: &'static str,
    attempt: u32,
    idempotency_key: Option<&'a str>,
    schema_version: Option<u32>,
    /// Left out with [`PayloadShown::Preview`].
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<Box<RawValue>>,
    /// Only with [`PayloadShown::Preview`].
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_preview: Option<Cow<'a, str>>,
    /// Only with [`PayloadShown::Preview`]: whether the preview stands for
    /// bytes that are not text (`lazaret_core::preview_is_binary`).
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_binary: Option<bool>,
    payload_size: u64,
    payload_sha256: &'a str,
    created_at: String,
    run_at: Option<String>,
    lease_expires_at: Option<String>,
    deferrals: u32,
    lease_expiries: u32,
    redrive_count: u32,
    dead_letter_id: Option<String>,
    cancel_requested: bool,
    /// Left out of the items of `GET /v1/jobs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    history: Option<Value>,
    payload_edits: Vec<PayloadEditBody<'a>>,
    payload_edits_dropped: u32,
    traceparent: Option<&'a str>,
}

/// `GET /v1/jobs`: a page of jobs, serialised as is (payloads byte for byte).
#[derive(Debug, Serialize)]
pub struct JobPage<'a> {
    /// The jobs, newest first.
    pub items: Vec<JobBody<'a>>,
    /// The cursor of the next (older) page.
    pub next_cursor: Option<String>,
}

/// How much of a payload a job reply carries (`?payload=` of `GET /v1/jobs`
/// and `GET /v1/jobs/{id}`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PayloadShown {
    /// `payload` byte for byte (the contract's default), and each edit's
    /// `previous_payload`.
    #[default]
    Full,
    /// `payload_preview` instead: the first [`PREVIEW_BYTES_MAX`] as
    /// text (cut at a char boundary), and `previous_payload_preview` for
    /// edits; the whole bytes are at `GET /v1/jobs/{id}/payload`.
    Preview,
}

/// An item of `GET /v1/jobs`: the job as `GET /v1/jobs/{id}` shows it,
/// without `history`.
pub fn job_item(j: &JobView, now: Timestamp, shown: PayloadShown) -> JobBody<'_> {
    JobBody {
        history: None,
        ..job_body(j, now, shown)
    }
}

/// A payload replaced by a redrive with a corrected payload, as
/// `GET /v1/jobs/{id}` shows it: the replaced payload byte for byte.
#[derive(Debug, Serialize)]
pub struct PayloadEditBody<'a> {
    at: String,
    actor: &'a str,
    reason: &'a str,
    redrive: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    previous_payload: Option<Box<RawValue>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    previous_payload_preview: Option<Cow<'a, str>>,
    previous_payload_size: u64,
    previous_payload_sha256: &'a str,
    previous_schema_version: Option<u32>,
}

/// The body of `GET /v1/jobs/{id}`.
pub fn job(j: &JobView, now: Timestamp, shown: PayloadShown) -> JobBody<'_> {
    JobBody {
        history: Some(history(&j.envelope.history)),
        ..job_body(j, now, shown)
    }
}

fn job_body(j: &JobView, now: Timestamp, shown: PayloadShown) -> JobBody<'_> {
    let full = shown == PayloadShown::Full;
    fn preview(bytes: &[u8]) -> Cow<'_, str> {
        payload_preview(bytes, PREVIEW_BYTES_MAX)
    }
    let shown_preview = (!full).then(|| preview(&j.payload));
    let e = &j.envelope;
    let state = match (j.state, j.run_at) {
        (JobState::Scheduled, Some(at)) if at <= now => JobState::Queued,
        (s, _) => s,
    };
    JobBody {
        id: e.id.to_string(),
        job_type: e.job_type.as_str(),
        tenant: e.tenant.as_str(),
        lane: e.lane.as_str(),
        state: state.as_str(),
        attempt: e.attempts,
        idempotency_key: e.idempotency_key.as_deref(),
        schema_version: e.schema_version,
        payload: full.then(|| raw_payload(&j.payload)),
        payload_binary: shown_preview.as_deref().map(preview_is_binary),
        payload_preview: shown_preview,
        payload_size: e.payload_size,
        payload_sha256: &e.payload_sha256,
        created_at: time(e.created_at),
        run_at: j.run_at.map(time),
        lease_expires_at: j.lease_expires_at.map(time),
        deferrals: e.deferrals,
        lease_expiries: e.crashes,
        redrive_count: e.redrive_count,
        dead_letter_id: j.dead_letter_id.map(|d| d.to_string()),
        cancel_requested: j.cancel_requested,
        traceparent: e.traceparent.as_ref().map(TraceParent::as_str),
        history: None,
        payload_edits: e
            .payload_edits
            .iter()
            .map(|p| PayloadEditBody {
                at: time(p.at),
                actor: &p.actor,
                reason: &p.reason,
                redrive: p.redrive,
                previous_payload: full.then(|| raw_payload(p.previous_payload.as_bytes())),
                previous_payload_preview: (!full).then(|| preview(p.previous_payload.as_bytes())),
                previous_payload_size: p.previous_size,
                previous_payload_sha256: &p.previous_sha256,
                previous_schema_version: p.previous_schema_version,
            })
            .collect(),
        payload_edits_dropped: e.payload_edits_dropped,
    }
}

/// One job in a lease reply (a struct for the same reason as [`JobBody`]).
#[derive(Debug, Serialize)]
pub struct LeasedBody<'a> {
    id: String,
    #[serde(rename = "type")]
    job_type: &'a str,
    tenant: &'a str,
    lane: &'a str,
    payload: Box<RawValue>,
    attempt: u32,
    idempotency_key: Option<&'a str>,
    schema_version: Option<u32>,
    lease_token: String,
    lease_expires_at: String,
    created_at: String,
    /// The W3C `traceparent` it was enqueued with (`null`: none).
    traceparent: Option<&'a str>,
}

/// A leased job as the worker sees it.
pub fn leased(j: &LeasedJob) -> LeasedBody<'_> {
    LeasedBody {
        id: j.id.to_string(),
        job_type: j.job_type.as_str(),
        tenant: j.tenant.as_str(),
        lane: j.lane.as_str(),
        payload: raw_payload(&j.payload),
        attempt: j.attempt,
        idempotency_key: j.idempotency_key.as_deref(),
        schema_version: j.schema_version,
        lease_token: j.lease_token.to_string(),
        lease_expires_at: time(j.lease_expires_at),
        created_at: time(j.created_at),
        traceparent: j.traceparent.as_ref().map(TraceParent::as_str),
    }
}

/// The body of `POST /v1/leases`.
#[derive(Debug, Serialize)]
pub struct LeaseReply<'a> {
    /// The leased jobs.
    pub jobs: Vec<LeasedBody<'a>>,
}

/// The body of an ack or fail that carried `next`: the outcome's fields,
/// then the lease's `jobs` and, when the lease was refused, `next_error`
/// (the contract's error object, without the `{"error": ...}` around it).
#[derive(Debug, Serialize)]
pub struct OutcomeReply<'a> {
    /// The outcome, as the ack or fail answers it without `next`.
    #[serde(flatten)]
    pub outcome: Value,
    /// The leased jobs, as `POST /v1/leases` answers them.
    pub jobs: Vec<LeasedBody<'a>>,
    /// Why the lease part was refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_error: Option<Value>,
}

/// A dead letter. `payload` is its whole body when the caller read it (a
/// Celery task's arguments are then read from it); otherwise the preview
/// stands in.
pub fn dead_letter(d: &DeadLetter, payload: Option<&[u8]>) -> Value {
    let body = payload.unwrap_or(d.payload_preview.as_bytes());
    json!({
        "id": d.id.to_string(),
        "job_id": d.job_id.map(|j| j.to_string()),
        "type": d.job_type,
        "tenant": d.tenant,
        "lane": d.lane,
        "reason": d.reason.as_str(),
        "stage": d.stage.as_str(),
        "attempts": d.attempts,
        "error": d.error.as_ref().map(error),
        "history": history(&d.history),
        "idempotency_key": d.idempotency_key,
        "schema_version": d.schema_version,
        "created_at": time(d.created_at),
        "dead_lettered_at": time(d.dead_lettered_at),
        "payload_size": d.payload_size,
        "payload_sha256": d.payload_sha256,
        "payload_preview": d.payload_preview,
        "payload_binary": preview_is_binary(&d.payload_preview),
        "redrive_count": d.redrive_count,
        "source": d.source.as_ref().map(source),
        "celery": d.source.as_ref().and_then(|s| celery(s, body)),
        "group_id": d.group_id,
        "fingerprint": d.fingerprint,
        "archived": d.archived_at.is_some(),
        "archived_at": d.archived_at.map(time),
        "traceparent": d.traceparent.as_ref().map(TraceParent::as_str),
    })
}

/// A failure group (`GET /v1/dead-letters/groups`).
pub fn group(g: &lazaret_store::FailureGroup) -> Value {
    json!({
        "id": g.id,
        "count": g.count,
        "type": g.job_type,
        "reason": g.reason.as_str(),
        "kind": g.kind,
        "fingerprint": g.fingerprint,
        "sample_error": g.sample_error,
        "sample_dead_letter_id": g.sample_id.to_string(),
        "first_at": time(g.first_at),
        "last_at": time(g.last_at),
        "rate_1h": g.rate_1h,
        "held": g.held,
        "tenants": g.tenants,
        "sources": g.sources,
    })
}

/// Where a broker dead letter came from (`null` for lazaret's own).
fn source(s: &SourceRef) -> Value {
    json!({
        "name": s.name,
        "broker": s.broker,
        "queue": s.queue,
        "message_id": s.message_id,
        "headers": s.headers,
        "position": s.position,
        "content_type": s.content_type,
        "redrive_id": s.redrive_id,
    })
}

/// Whether a broker message is a Celery task (protocol 2 headers).
pub fn is_celery(s: &SourceRef) -> bool {
    Task::recognise(&s.headers).is_some()
}

/// A Celery task's name, id, retries and readable arguments; `None` for
/// any other message. A body that is not JSON is never deserialised.
fn celery(s: &SourceRef, body: &[u8]) -> Option<Value> {
    let t = Task::recognise(&s.headers)?;
    Some(json!({
        "task": t.name,
        "id": t.id,
        "retries": t.retries,
        "arguments": arguments(&s.headers, s.content_type.as_deref(), body),
    }))
}

/// A reason group.
pub fn reason(r: &ReasonCount) -> Value {
    json!({
        "reason": r.reason.as_str(),
        "type": r.job_type,
        "count": r.count,
        "first_at": time(r.first_at),
        "last_at": time(r.last_at),
    })
}

/// A `[[tokens]]` entry in `GET /v1/tokens`: never its secret or hash.
pub fn config_token(t: &TokenConfig) -> Value {
    json!({
        "name": t.name, "role": t.role.as_str(), "source": "config",
        "created_at": null, "created_by": null,
    })
}

/// A token created through the API in `GET /v1/tokens`: never its hash.
pub fn api_token(t: &ApiToken) -> Value {
    json!({
        "name": t.name, "role": t.role, "source": "api",
        "created_at": time(t.created_at), "created_by": t.created_by,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_utc_with_millis() {
        assert_eq!(
            time(Timestamp::from_millis(1_700_000_000_123)),
            "2023-11-14T22:13:20.123Z"
        );
    }

    #[test]
    fn times_past_year_9999_are_clamped_not_panicking() {
        assert_eq!(
            time(Timestamp::from_millis(i64::MAX)),
            "9999-12-31T23:59:59.999Z"
        );
        assert_eq!(
            time(Timestamp::from_millis(TIME_MS_MAX + 1)),
            "9999-12-31T23:59:59.999Z"
        );
        assert_eq!(
            time(Timestamp::from_millis(i64::MIN)),
            "1970-01-01T00:00:00.000Z"
        );
    }

    fn dead_letter_of(source: Option<SourceRef>, preview: &str) -> DeadLetter {
        DeadLetter {
            id: lazaret_store::DeadLetterId(3),
            job_id: None,
            job_type: Some("tasks.add".into()),
            tenant: Some("default".into()),
            lane: Some("default".into()),
            reason: lazaret_core::DeadLetterReason::DeliveryLimit,
            stage: lazaret_store::Stage::Broker,
            attempts: 3,
            error: None,
            history: Vec::new(),
            idempotency_key: Some("5f1c".into()),
            created_at: Timestamp::from_millis(0),
            dead_lettered_at: Timestamp::from_millis(0),
            payload_size: preview.len() as u64,
            payload_sha256: None,
            payload_preview: preview.into(),
            redrive_count: 0,
            schema_version: None,
            source,
            group_id: String::new(),
            fingerprint: String::new(),
            archived_at: None,
            traceparent: None,
        }
    }

    #[test]
    fn a_broker_dead_letter_names_its_source_and_celery_task() {
        let headers =
            json!({"task": "tasks.add", "id": "5f1c", "retries": 2, "argsrepr": "(1, 2)"});
        let source = SourceRef {
            name: "celery".into(),
            broker: "rabbitmq".into(),
            queue: "celery".into(),
            message_id: "5f1c".into(),
            headers: headers.as_object().cloned().unwrap_or_default(),
            position: json!({"delivery_tag": 1}),
            content_type: Some("application/json".into()),
            redrive_id: None,
        };
        let body = br#"[[1, 2], {"x": 3}, {}]"#;
        let v = dead_letter(
            &dead_letter_of(Some(source.clone()), "[[1, 2], {"),
            Some(body),
        );
        assert_eq!(
            v["source"],
            json!({"name": "celery", "broker": "rabbitmq", "queue": "celery", "message_id": "5f1c",
                   "headers": headers, "position": {"delivery_tag": 1}, "content_type": "application/json",
                   "redrive_id": null})
        );
        assert_eq!(
            v["celery"],
            json!({"task": "tasks.add", "id": "5f1c", "retries": 2,
                   "arguments": {"args": [1, 2], "kwargs": {"x": 3}}})
        );
        // Without the body, a cut preview is not JSON: Celery's reprs stand in.
        let v = dead_letter(&dead_letter_of(Some(source), "[[1, 2], {"), None);
        assert_eq!(
            v["celery"]["arguments"],
            json!({"argsrepr": "(1, 2)", "kwargsrepr": null})
        );
        let own = dead_letter(&dead_letter_of(None, "{}"), None);
        assert!(own["source"].is_null() && own["celery"].is_null(), "{own}");
    }

    #[test]
    fn payload_is_embedded_byte_for_byte() {
        let bytes = br#"{ "z": 1.50,  "a":[2] }"#;
        let j = LeasedJob {
            id: lazaret_core::JobId(7),
            job_type: "t".into(),
            tenant: "acme".into(),
            lane: "default".into(),
            payload: bytes.to_vec(),
            attempt: 1,
            idempotency_key: None,
            schema_version: None,
            lease_token: lazaret_store::LeaseToken(9),
            lease_expires_at: Timestamp::from_millis(0),
            created_at: Timestamp::from_millis(0),
            ready_at: Timestamp::from_millis(0),
            traceparent: None,
        };
        let text = serde_json::to_string(&LeaseReply {
            jobs: vec![leased(&j)],
        })
        .unwrap();
        assert!(
            text.contains(r#""payload":{ "z": 1.50,  "a":[2] }"#),
            "{text}"
        );
    }
}
