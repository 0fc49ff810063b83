//! The values of the HTTP contract as Rust types: what is sent and what
//! comes back, with ids, times and durations already typed.

use std::fmt;
use std::time::{Duration, SystemTime};

use lazaret_core::{
    AttemptOutcome, DeadLetterReason, JobId, JobState, JobType, Lane, TenantId, WorkerId,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::error::ClientError;
use crate::failure::Failure;
use crate::wire;

/// A job to enqueue (`POST /v1/jobs`, or one item of `/v1/jobs/batch`).
#[derive(Clone, Debug, Serialize)]
pub struct NewJob {
    #[serde(rename = "type")]
    job_type: JobType,
    tenant: TenantId,
    #[serde(skip_serializing_if = "Option::is_none")]
    lane: Option<Lane>,
    payload: Box<RawValue>,
    #[serde(skip_serializing_if = "Option::is_none")]
    idempotency_key: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    schema_version: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    delay_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<String>,
}

impl NewJob {
    /// A job whose payload is `payload` serialised to JSON.
    pub fn new(
        job_type: impl Into<JobType>,
        tenant: impl Into<TenantId>,
        payload: &impl Serialize,
    ) -> Result<Self, ClientError> {
        let raw = serde_json::value::to_raw_value(payload).map_err(ClientError::Encode)?;
        Ok(Self::raw(job_type, tenant, raw))
    }

    /// A job whose payload is this raw JSON, sent byte for byte.
    pub fn raw(
        job_type: impl Into<JobType>,
        tenant: impl Into<TenantId>,
        payload: Box<RawValue>,
    ) -> Self {
        NewJob {
            job_type: job_type.into(),
            tenant: tenant.into(),
            lane: None,
            payload,
            idempotency_key: None,
            schema_version: None,
            delay_ms: None,
            traceparent: None,
        }
    }

    /// The lane (default: `default`).
    pub fn lane(mut self, lane: impl Into<Lane>) -> Self {
        self.lane = Some(lane.into());
        self
    }

    /// The idempotency key: a second job with the same (tenant, type, key)
    /// is answered `DUPLICATE` with the first one's id.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.idempotency_key = Some(key.into());
        self
    }

    /// The payload's schema version (default: the latest).
    pub fn schema_version(mut self, version: u32) -> Self {
        self.schema_version = Some(version);
        self
    }

    /// Run no sooner than `delay` from now.
    pub fn delay(mut self, delay: Duration) -> Self {
        self.delay_ms = Some(wire::ms(delay));
        self
    }

    /// The W3C trace context the job joins
    /// (`00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`): its
    /// handler reads it back ([`crate::Job::traceparent`]) to continue the
    /// producer's trace. The server refuses one that is not valid
    /// (`BAD_REQUEST`).
    pub fn traceparent(mut self, traceparent: impl Into<String>) -> Self {
        self.traceparent = Some(traceparent.into());
        self
    }
}

/// How admission let a job in.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
#[non_exhaustive]
pub enum Admission {
    /// Admitted.
    Admitted,
    /// Admitted, waiting its turn: the tenant is at its in-flight cap.
    FairQueue,
    /// Already admitted under the same idempotency key; `id` is the first job's.
    Duplicate,
    /// A word this client does not know.
    #[serde(other)]
    Other,
}

/// The reply to an enqueue.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
pub struct Enqueued {
    /// The job's id.
    #[serde(with = "wire::job_id")]
    pub id: JobId,
    /// Its state now.
    pub state: JobState,
    /// How it got in.
    pub admission: Admission,
}

/// One delivery of a job, as the history records it.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Attempt {
    /// The attempt it was charged as (a deferred delivery repeats the number).
    pub attempt: u32,
    /// When the lease was granted.
    #[serde(with = "wire::time")]
    pub started_at: SystemTime,
    /// When it ended; `None` while running.
    #[serde(with = "wire::opt_time")]
    pub ended_at: Option<SystemTime>,
    /// Who held the lease.
    pub worker_id: Option<WorkerId>,
    /// How it ended.
    pub outcome: AttemptOutcome,
    /// The failure, with its class as the policy resolved it.
    pub error: Option<Failure>,
}

/// `GET /v1/jobs/{id}`.
#[derive(Clone, Debug, Deserialize)]
pub struct JobInfo {
    /// The id.
    #[serde(with = "wire::job_id")]
    pub id: JobId,
    /// The type.
    #[serde(rename = "type")]
    pub job_type: JobType,
    /// The tenant.
    pub tenant: TenantId,
    /// The lane.
    pub lane: Lane,
    /// Where it is in the state machine.
    pub state: JobState,
    /// Charged deliveries so far.
    pub attempt: u32,
    /// The idempotency key, if one was given.
    pub idempotency_key: Option<String>,
    /// The schema version it was admitted with.
    #[serde(default)]
    pub schema_version: Option<u32>,
    /// The payload, byte for byte as enqueued.
    pub payload: Box<RawValue>,
    /// First admission.
    #[serde(with = "wire::time")]
    pub created_at: SystemTime,
    /// When it runs next (scheduled jobs).
    #[serde(with = "wire::opt_time")]
    pub run_at: Option<SystemTime>,
    /// When the current lease ends (leased jobs).
    #[serde(default, with = "wire::opt_time")]
    pub lease_expires_at: Option<SystemTime>,
    /// Deferred outcomes so far.
    #[serde(default)]
    pub deferrals: u32,
    /// Lease expiries so far.
    #[serde(default)]
    pub lease_expiries: u32,
    /// Times it was redriven from the dead letters.
    #[serde(default)]
    pub redrive_count: u32,
    /// Its dead letter, while it is dead-lettered.
    #[serde(default, deserialize_with = "opt_dead_letter_id")]
    pub dead_letter_id: Option<DeadLetterId>,
    /// A cancel of it was accepted (it is `cancelled`, or leased and ends
    /// `cancelled` at its outcome unless acked).
    #[serde(default)]
    pub cancel_requested: bool,
    /// Every delivery (bounded by the server); empty in the items of
    /// [`crate::Client::jobs`], which leave it out.
    #[serde(default)]
    pub history: Vec<Attempt>,
}

/// `GET /v1/jobs`: which jobs, and which page (newest first).
#[derive(Clone, Debug, Default)]
pub struct JobsQuery {
    /// Only jobs in this state.
    pub state: Option<JobState>,
    /// Only jobs of this type.
    pub job_type: Option<String>,
    /// Only jobs of this tenant.
    pub tenant: Option<String>,
    /// Only jobs of this lane.
    pub lane: Option<String>,
    /// Page size (the server's default when `None`).
    pub limit: Option<u32>,
    /// From a previous page's `next_cursor`.
    pub cursor: Option<String>,
}

/// A page of jobs (without their history).
#[derive(Clone, Debug, Deserialize)]
pub struct JobPage {
    /// The jobs, newest first.
    pub items: Vec<JobInfo>,
    /// Pass as `cursor` for the next page; `None` on the last.
    pub next_cursor: Option<String>,
}

/// The answer to `POST /v1/jobs/{id}/cancel`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct CancelReply {
    /// `cancelled` (it was waiting), or `leased`: it ends `cancelled` at
    /// its outcome or lease expiry unless it is acked.
    pub state: JobState,
    /// `true` for a leased job.
    #[serde(default)]
    pub cancel_requested: bool,
}

/// The answer to a heartbeat.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct Heartbeat {
    /// The lease's new end (server clock).
    #[serde(with = "wire::time")]
    pub lease_expires_at: SystemTime,
    /// A cancel of the job was requested: stop and fail it (it then ends
    /// `cancelled`), or ack it if the work is done.
    #[serde(default)]
    pub cancel_requested: bool,
}

/// A lease token: proves a worker holds a job's current lease.
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LeaseToken(pub String);

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({})", self.0)
    }
}

/// `POST /v1/leases`.
#[derive(Clone, Debug)]
pub struct LeaseRequest {
    /// Recorded in the attempt history.
    pub worker_id: WorkerId,
    /// Lanes to lease from; `None` means every lane.
    pub lanes: Option<Vec<Lane>>,
    /// Types to lease; `None` means any type.
    pub types: Option<Vec<JobType>>,
    /// At most this many jobs (1–1000).
    pub max_jobs: u32,
    /// Lease length.
    pub lease: Duration,
    /// Long-poll: wait up to this long for a job when none is ready.
    pub wait: Duration,
}

impl LeaseRequest {
    /// One job from any lane and type, 30 s lease, no waiting.
    pub fn new(worker_id: impl Into<WorkerId>) -> Self {
        LeaseRequest {
            worker_id: worker_id.into(),
            lanes: None,
            types: None,
            max_jobs: 1,
            lease: Duration::from_secs(30),
            wait: Duration::ZERO,
        }
    }
}

#[derive(Serialize)]
pub(crate) struct LeaseBody<'a> {
    pub(crate) worker_id: &'a WorkerId,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) lanes: Option<&'a [Lane]>,
    pub(crate) types: Option<&'a [JobType]>,
    pub(crate) max_jobs: u32,
    pub(crate) lease_ms: u64,
    pub(crate) wait_ms: u64,
}

/// A leased job. The payload stays raw JSON: the handler's typed
/// deserialisation is the only parse it gets.
#[derive(Clone, Debug, Deserialize)]
pub struct LeasedJob {
    /// The id.
    #[serde(with = "wire::job_id")]
    pub id: JobId,
    /// The type.
    #[serde(rename = "type")]
    pub job_type: JobType,
    /// The tenant.
    pub tenant: TenantId,
    /// The lane.
    pub lane: Lane,
    /// The payload, byte for byte as enqueued.
    pub payload: Box<RawValue>,
    /// 1 on the first delivery; counts every charged delivery.
    pub attempt: u32,
    /// The idempotency key, if one was given.
    pub idempotency_key: Option<String>,
    /// The schema version it was admitted with.
    #[serde(default)]
    pub schema_version: Option<u32>,
    /// Ack, fail and heartbeat with this.
    pub lease_token: LeaseToken,
    /// When the lease ends unless extended (server clock).
    #[serde(with = "wire::time")]
    pub lease_expires_at: SystemTime,
    /// First admission.
    #[serde(with = "wire::time")]
    pub created_at: SystemTime,
    /// The W3C trace context it was enqueued with (`None`: none).
    #[serde(default)]
    pub traceparent: Option<String>,
}

#[derive(Deserialize)]
pub(crate) struct Leased {
    pub(crate) jobs: Vec<LeasedJob>,
}

/// The reply of an ack or fail that asked for the next lease
/// ([`Client::ack_next`](crate::Client::ack_next),
/// [`Client::fail_next`](crate::Client::fail_next)).
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct OutcomeAndLease {
    /// What happened to the job reported on; it stands whatever became of
    /// the lease.
    pub outcome: Outcome,
    /// The next jobs, as [`Client::lease`](crate::Client::lease) would
    /// have answered (empty when none was ready, or the lease was refused).
    pub jobs: Vec<LeasedJob>,
    /// Why the lease part was refused (a bad request, the store
    /// unavailable): lease again with [`Client::lease`](crate::Client::lease).
    pub next_error: Option<crate::error::ItemError>,
}

/// The lease part of an ack or fail's reply (the outcome is read apart).
#[derive(Deserialize)]
pub(crate) struct NextPart {
    #[serde(default)]
    pub(crate) jobs: Vec<LeasedJob>,
    #[serde(default)]
    pub(crate) next_error: Option<crate::error::ErrorObject>,
}

/// What happened to a job after an ack or a fail.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Outcome {
    /// Acked.
    Succeeded,
    /// Will run again at `retry_at`.
    Scheduled {
        /// When.
        #[serde(with = "wire::time")]
        retry_at: SystemTime,
        /// The attempt that just failed.
        #[serde(default)]
        attempt: Option<u32>,
        /// A deferral: no attempt was spent.
        #[serde(default)]
        deferred: bool,
    },
    /// In the dead letters.
    DeadLettered {
        /// Why.
        reason: DeadLetterReason,
        /// The dead letter's id.
        #[serde(default, deserialize_with = "opt_dead_letter_id")]
        dead_letter_id: Option<DeadLetterId>,
    },
    /// Cancelled: a cancel was requested while it ran, and it failed (no
    /// retry, no dead letter).
    Cancelled,
}

fn opt_dead_letter_id<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<DeadLetterId>, D::Error> {
    Ok(wire::parse_opt_u64(d)?.map(DeadLetterId))
}

#[derive(Serialize)]
pub(crate) struct TokenBody<'a> {
    pub(crate) lease_token: &'a LeaseToken,
}

#[derive(Serialize)]
pub(crate) struct FailBody<'a> {
    pub(crate) lease_token: &'a LeaseToken,
    pub(crate) error: &'a Failure,
}

/// An ack (`error: None`) or fail that asks for the next lease too.
#[derive(Serialize)]
pub(crate) struct OutcomeNextBody<'a> {
    pub(crate) lease_token: &'a LeaseToken,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<&'a Failure>,
    pub(crate) next: LeaseBody<'a>,
}

#[derive(Serialize)]
pub(crate) struct HeartbeatBody<'a> {
    pub(crate) lease_token: &'a LeaseToken,
    pub(crate) extend_ms: u64,
}

/// One item of `POST /v1/acks`.
#[derive(Clone, Debug, Serialize)]
pub struct AckItem {
    /// The job.
    #[serde(with = "wire::job_id")]
    pub id: JobId,
    /// Its lease token.
    pub lease_token: LeaseToken,
}

/// One item of `POST /v1/fails`.
#[derive(Clone, Debug, Serialize)]
pub struct FailItem {
    /// The job.
    #[serde(with = "wire::job_id")]
    pub id: JobId,
    /// Its lease token.
    pub lease_token: LeaseToken,
    /// What went wrong.
    pub error: Failure,
}

#[derive(Serialize)]
pub(crate) struct Items<'a, T> {
    pub(crate) items: &'a [T],
}

/// A dead letter's id (not the job's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeadLetterId(pub u64);

impl fmt::Display for DeadLetterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl Serialize for DeadLetterId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for DeadLetterId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        wire::parse_u64(d).map(DeadLetterId)
    }
}

/// Where a dead letter was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Refused at the door as poison (cannot be redriven).
    Admission,
    /// Failed while being processed.
    Processing,
}

/// A dead letter: everything needed to understand and replay a job.
#[derive(Clone, Debug, Deserialize)]
pub struct DeadLetter {
    /// The dead letter's id.
    pub id: DeadLetterId,
    /// The job's id (`None` for admission records).
    #[serde(default, deserialize_with = "wire::opt_job_id::deserialize")]
    pub job_id: Option<JobId>,
    /// The type, when it could be read.
    #[serde(rename = "type")]
    pub job_type: Option<String>,
    /// The tenant, when it could be read.
    pub tenant: Option<String>,
    /// The lane, when it could be read.
    pub lane: Option<String>,
    /// Why it is here.
    pub reason: DeadLetterReason,
    /// Where it was made.
    pub stage: Stage,
    /// Charged deliveries.
    pub attempts: u32,
    /// The last failure.
    pub error: Option<Failure>,
    /// Every delivery.
    #[serde(default)]
    pub history: Vec<Attempt>,
    /// The idempotency key, if one was given.
    pub idempotency_key: Option<String>,
    /// The schema version, if known.
    #[serde(default)]
    pub schema_version: Option<u32>,
    /// First admission.
    #[serde(with = "wire::time")]
    pub created_at: SystemTime,
    /// When it was dead-lettered.
    #[serde(with = "wire::time")]
    pub dead_lettered_at: SystemTime,
    /// Payload bytes.
    pub payload_size: u64,
    /// SHA-256 of the payload (hex); `None` when it was not read whole.
    pub payload_sha256: Option<String>,
    /// The first bytes of the payload (at most 4 KiB).
    pub payload_preview: String,
    /// Times the job was redriven.
    #[serde(default)]
    pub redrive_count: u32,
}

/// `GET /v1/dead-letters`: which dead letters, and which page.
#[derive(Clone, Debug, Default)]
pub struct DeadLetterQuery {
    /// The same filter redrive and purge take.
    pub filter: DeadLetterFilter,
    /// Page size.
    pub limit: Option<u32>,
    /// From a previous page's `next_cursor`.
    pub cursor: Option<String>,
}

/// A page of dead letters.
#[derive(Clone, Debug, Deserialize)]
pub struct DeadLetterPage {
    /// The dead letters.
    pub items: Vec<DeadLetter>,
    /// Pass as `cursor` for the next page; `None` on the last.
    pub next_cursor: Option<String>,
}

/// A reason group of `GET /v1/dead-letters/reasons`.
#[derive(Clone, Debug, Deserialize)]
pub struct ReasonCount {
    /// The reason.
    pub reason: DeadLetterReason,
    /// The type, when known.
    #[serde(rename = "type")]
    pub job_type: Option<String>,
    /// How many dead letters.
    pub count: u64,
    /// The oldest.
    #[serde(with = "wire::time")]
    pub first_at: SystemTime,
    /// The newest.
    #[serde(with = "wire::time")]
    pub last_at: SystemTime,
}

#[derive(Deserialize)]
pub(crate) struct Reasons {
    pub(crate) reasons: Vec<ReasonCount>,
}

/// A filter over dead letters (redrive, purge).
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeadLetterFilter {
    /// Only this type.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub job_type: Option<String>,
    /// Only this tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tenant: Option<String>,
    /// Only this lane.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lane: Option<String>,
    /// Only this reason.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<DeadLetterReason>,
}

/// Which dead letters an operation is about.
#[derive(Clone, Debug)]
pub enum Selection {
    /// These ones.
    Ids(Vec<DeadLetterId>),
    /// Every one matching.
    Filter(DeadLetterFilter),
}

#[derive(Serialize)]
pub(crate) struct SelectionBody<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ids: Option<&'a [DeadLetterId]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) filter: Option<&'a DeadLetterFilter>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) dry_run: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) rate_per_sec: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) confirm: Option<bool>,
}

impl<'a> SelectionBody<'a> {
    pub(crate) fn new(sel: &'a Selection) -> Self {
        let (ids, filter) = match sel {
            Selection::Ids(ids) => (Some(ids.as_slice()), None),
            Selection::Filter(f) => (None, Some(f)),
        };
        SelectionBody {
            ids,
            filter,
            dry_run: None,
            rate_per_sec: None,
            confirm: None,
        }
    }
}

/// `POST /v1/dead-letters/redrive`.
#[derive(Clone, Debug)]
pub struct Redrive {
    /// Which dead letters.
    pub selection: Selection,
    /// Only count what would be redriven.
    pub dry_run: bool,
    /// At most this many per second (`None`: no limit).
    pub rate_per_sec: Option<u32>,
}

impl Redrive {
    /// Redrive these, now, at full speed.
    pub fn new(selection: Selection) -> Self {
        Redrive {
            selection,
            dry_run: false,
            rate_per_sec: None,
        }
    }
}

/// The reply to a redrive.
#[derive(Clone, Debug, Deserialize)]
pub struct Redriven {
    /// Dead letters that matched (admission records excluded).
    pub matched: u64,
    /// Jobs put back in line.
    pub redriven: u64,
    /// Their ids (kept across the redrive).
    #[serde(deserialize_with = "job_ids")]
    pub job_ids: Vec<JobId>,
}

fn job_ids<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<JobId>, D::Error> {
    #[derive(Deserialize)]
    struct W(#[serde(with = "wire::job_id")] JobId);
    Ok(Vec::<W>::deserialize(d)?.into_iter().map(|w| w.0).collect())
}

#[derive(Deserialize)]
pub(crate) struct Purged {
    pub(crate) purged: u64,
}

/// A breaker's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerStatus {
    /// Passing.
    Closed,
    /// Refusing: the type is parked.
    Open,
    /// Letting a few probes through.
    HalfOpen,
}

/// One breaker of `GET /v1/breakers`.
#[derive(Clone, Debug, Deserialize)]
pub struct Breaker {
    /// The type.
    #[serde(rename = "type")]
    pub job_type: JobType,
    /// The error kind.
    pub kind: String,
    /// Its state.
    pub state: BreakerStatus,
    /// Until when (open breakers).
    #[serde(with = "wire::opt_time")]
    pub until: Option<SystemTime>,
}

#[derive(Deserialize)]
pub(crate) struct Breakers {
    pub(crate) breakers: Vec<Breaker>,
}

/// What `pause`/`resume` apply to.
#[derive(Clone, Debug)]
pub enum PauseTarget {
    /// Every job of this type.
    Type(JobType),
    /// Every job in this lane.
    Lane(Lane),
}

#[derive(Serialize)]
pub(crate) struct PauseBody<'a> {
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub(crate) job_type: Option<&'a JobType>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) lane: Option<&'a Lane>,
}

/// One entry of the audit log.
#[derive(Clone, Debug, Deserialize)]
pub struct AuditEntry {
    /// Its id (`None` from a server older than the audit cursor).
    #[serde(default)]
    pub id: Option<String>,
    /// When.
    #[serde(with = "wire::time")]
    pub at: SystemTime,
    /// The token's name.
    pub actor: String,
    /// `redrive`, `purge`, `pause`, `resume`, `token_create`, `token_revoke`, `denied`, `cancel`.
    pub action: String,
    /// The request as received (or `{"raw", "bytes", "truncated"}` when it
    /// was longer than 16 KiB or not readable as JSON).
    pub request: Value,
    /// Jobs or dead letters affected.
    pub count: u64,
}

/// One page of the audit log, newest first.
#[derive(Clone, Debug, Deserialize)]
pub struct AuditPage {
    /// The entries.
    pub items: Vec<AuditEntry>,
    /// Pass it as `cursor` for the next (older) page; `None` on the last.
    #[serde(default)]
    pub next_cursor: Option<String>,
}

/// Which page of the audit log to read (`GET /v1/audit`).
#[derive(Clone, Debug, Default)]
pub struct AuditRequest {
    /// At most this many (1 to 1000; the server's default when `None`).
    pub limit: Option<u32>,
    /// The `next_cursor` of the page before.
    pub cursor: Option<String>,
    /// Only this action (`purge`, `denied`, …).
    pub action: Option<String>,
    /// Only this actor (a token's name).
    pub actor: Option<String>,
}

/// A batch reply: one result per item, in order.
#[derive(Deserialize)]
pub(crate) struct Results<T> {
    pub(crate) results: Vec<ItemResult<T>>,
}

/// One item of a batch reply: a value or `{"error": {...}}`.
#[derive(Deserialize)]
#[serde(untagged)]
pub(crate) enum ItemResult<T> {
    Err(crate::error::ErrorEnvelope),
    Ok(T),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_parse_every_reply_shape() {
        let ok: Outcome = serde_json::from_str(r#"{"state":"succeeded"}"#).unwrap();
        assert_eq!(ok, Outcome::Succeeded);
        let s: Outcome = serde_json::from_str(
            r#"{"state":"scheduled","retry_at":"2024-01-01T00:00:00.000Z","attempt":2,"deferred":true}"#,
        )
        .unwrap();
        assert!(matches!(
            s,
            Outcome::Scheduled {
                attempt: Some(2),
                deferred: true,
                ..
            }
        ));
        let d: Outcome = serde_json::from_str(
            r#"{"state":"dead_lettered","reason":"kind_exhausted","attempt":1,"dead_letter_id":"9"}"#,
        )
        .unwrap();
        assert_eq!(
            d,
            Outcome::DeadLettered {
                reason: DeadLetterReason::KindExhausted,
                dead_letter_id: Some(DeadLetterId(9))
            }
        );
    }

    #[test]
    fn a_leased_job_keeps_its_payload_raw() {
        let j: LeasedJob = serde_json::from_str(
            r#"{"id":"5","type":"t","tenant":"a","lane":"default","payload":{ "b":1,  "a":2 },
                "attempt":1,"idempotency_key":null,"schema_version":null,"lease_token":"77",
                "lease_expires_at":"2024-01-01T00:00:30.000Z","created_at":"2024-01-01T00:00:00.000Z"}"#,
        )
        .unwrap();
        assert_eq!(j.id, JobId(5));
        assert_eq!(j.payload.get(), r#"{ "b":1,  "a":2 }"#);
        assert_eq!(j.lease_token, LeaseToken("77".into()));
    }

    #[test]
    fn new_jobs_serialise_to_the_contract_shape() {
        let j = NewJob::new("send_email", "acme", &serde_json::json!({"to": "x"}))
            .unwrap()
            .lane("interactive")
            .idempotency_key("order-42")
            .delay(Duration::from_secs(2));
        assert_eq!(
            serde_json::to_value(&j).unwrap(),
            serde_json::json!({"type": "send_email", "tenant": "acme", "lane": "interactive",
                "payload": {"to": "x"}, "idempotency_key": "order-42", "delay_ms": 2000})
        );
    }
}
