//! The values that cross the `Store` seam.

use std::fmt;
use std::time::Duration;

use lazaret_core::{
    AttemptRecord, DeadLetterReason, ErrorKind, Failure, JobId, JobState, JobType, Lane, TenantId,
    Timestamp, TraceParent, Transition, WorkerId,
};
use serde::{Deserialize, Serialize};

/// A fencing token: proves a worker holds the job's current lease.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct LeaseToken(pub u64);

impl fmt::Display for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A dead letter's id (its own sequence, distinct from job ids).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DeadLetterId(pub u64);

impl fmt::Display for DeadLetterId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// An audit entry's id: entries are numbered in the order they were
/// written, so a larger id is a later entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AuditId(pub u64);

impl fmt::Display for AuditId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Which audit entries to list: newest first, before a cursor.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AuditQuery {
    /// At most this many.
    pub limit: u32,
    /// Only entries older than this one (the `next_cursor` of the page before).
    pub before: Option<AuditId>,
    /// Only entries of this action (`purge`, `denied`, …).
    pub action: Option<String>,
    /// Only entries of this actor (a token's name).
    pub actor: Option<String>,
}

/// A page of the audit log: entries with their ids, newest first, and the
/// cursor of the next (older) page when there may be one.
pub type AuditPage = (Vec<(AuditId, AuditEntry)>, Option<AuditId>);

/// An admitted job to insert.
#[derive(Clone, Debug)]
pub struct NewJob {
    /// Job type.
    pub job_type: JobType,
    /// Tenant.
    pub tenant: TenantId,
    /// Lane, fixed for life.
    pub lane: Lane,
    /// The payload's raw JSON text, byte for byte as received.
    pub payload: Vec<u8>,
    /// Producer's idempotency key.
    pub idempotency_key: Option<String>,
    /// The schema version it was validated against.
    pub schema_version: Option<u32>,
    /// When it may first run (`now` plus `delay_ms`).
    pub run_at: Timestamp,
    /// Admission time.
    pub now: Timestamp,
    /// Name of the token that enqueued it (`None` when auth is off): a
    /// producer reads only its own jobs.
    pub enqueued_by: Option<String>,
    /// The W3C `traceparent` it was enqueued with (validated).
    pub traceparent: Option<TraceParent>,
}

/// What enqueue did with one job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EnqueueOutcome {
    /// Inserted.
    Created {
        /// The new id.
        id: JobId,
        /// `queued` or `scheduled`.
        state: JobState,
        /// The tenant's leased jobs in that lane now (for `FAIR_QUEUE`).
        inflight: u32,
    },
    /// The same (tenant, type, idempotency key) was admitted before.
    Duplicate {
        /// The existing job.
        id: JobId,
        /// Its state now.
        state: JobState,
    },
    /// Refused: the job's tenant has no jobs ready, and as many tenants as
    /// the bound (`SchedulerConfig::tenants_ready_max`) have; nothing was
    /// written.
    TooManyTenants {
        /// The bound.
        tenants_ready_max: u32,
    },
}

/// A worker's request for work.
#[derive(Clone, Debug)]
pub struct LeaseRequest {
    /// Recorded in the attempt history.
    pub worker_id: WorkerId,
    /// `None`: every lane.
    pub lanes: Option<Vec<Lane>>,
    /// `None`: every type.
    pub types: Option<Vec<JobType>>,
    /// Types parked (breaker open, paused): never leased.
    pub exclude_types: Vec<JobType>,
    /// Lanes parked (paused): never leased.
    pub exclude_lanes: Vec<Lane>,
    /// At most this many jobs of a type (half-open breaker probes).
    pub type_limits: Vec<(JobType, u32)>,
    /// At most this many jobs.
    pub max_jobs: u32,
    /// Lease length.
    pub lease: Duration,
    /// The time of the request.
    pub now: Timestamp,
}

/// A job handed to a worker.
#[derive(Clone, Debug)]
pub struct LeasedJob {
    /// Id.
    pub id: JobId,
    /// Type.
    pub job_type: JobType,
    /// Tenant.
    pub tenant: TenantId,
    /// Lane.
    pub lane: Lane,
    /// Raw JSON text.
    pub payload: Vec<u8>,
    /// The attempt this delivery is charged as.
    pub attempt: u32,
    /// Producer's key.
    pub idempotency_key: Option<String>,
    /// Schema version.
    pub schema_version: Option<u32>,
    /// The fencing token.
    pub lease_token: LeaseToken,
    /// When the lease runs out.
    pub lease_expires_at: Timestamp,
    /// First admission.
    pub created_at: Timestamp,
    /// When it became ready to lease: its enqueue, or the time its delay,
    /// retry or deferral came due (the start of `lazaret_job_wait_seconds`).
    pub ready_at: Timestamp,
    /// The W3C `traceparent` it was enqueued with.
    pub traceparent: Option<TraceParent>,
}

/// A worker's outcome for one leased job.
#[derive(Clone, Debug)]
pub struct Completion {
    /// The job.
    pub id: JobId,
    /// The token the worker holds.
    pub token: LeaseToken,
    /// Ack or fail.
    pub event: lazaret_core::Event,
}

/// An applied outcome.
#[derive(Clone, Debug)]
pub struct Completed {
    /// The job.
    pub id: JobId,
    /// Its type (for breakers and metrics).
    pub job_type: JobType,
    /// Its lane.
    pub lane: Lane,
    /// Its tenant.
    pub tenant: TenantId,
    /// The `traceparent` it was enqueued with (for the outcome's span).
    pub traceparent: Option<TraceParent>,
    /// What the core decided.
    pub transition: Transition,
    /// The attempt that just ended.
    pub attempt: u32,
    /// The failure's kind, if it failed.
    pub kind: Option<ErrorKind>,
    /// The failure's class as resolved, if it failed.
    pub class: Option<lazaret_core::FailureClass>,
    /// The dead letter written, if any.
    pub dead_letter: Option<DeadLetterId>,
    /// The failure's message, if it failed (for fingerprints).
    pub message: Option<String>,
    /// Redrives of the job so far (outcomes of redriven jobs are counted).
    pub redrive_count: u32,
    /// The job's tenant was at its in-flight cap in the job's lane and has
    /// jobs ready there: a lease waiting only for that cap can now take one.
    pub freed_slot: bool,
    /// When the attempt that just ended was leased, if the store knows (the
    /// start of `lazaret_job_run_seconds`).
    pub leased_at: Option<Timestamp>,
}

/// Why one item of a call was refused; the rest of the call goes on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ItemError {
    /// No such job.
    #[error("no such job")]
    NotFound,
    /// The token is not the job's current lease token.
    #[error(
        "the lease token is not the job's current one: the lease expired or the job was leased again"
    )]
    LeaseLost,
}

/// Housekeeping done by [`crate::Store::tick`].
#[derive(Clone, Debug, Default)]
pub struct Tick {
    /// Scheduled jobs that became queued.
    pub promoted: u64,
    /// Leases that expired, as applied.
    pub expired: Vec<Completed>,
    /// The earliest `run_at` still scheduled, if any.
    pub next_due: Option<Timestamp>,
}

/// Where a dead letter came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Refused at the gateway: nothing valid was admitted.
    Admission,
    /// Ran and lost.
    Processing,
    /// Dead-lettered by a broker before lazaret saw it, and taken in from
    /// the broker's dead-letter queue by a `watch` source.
    Broker,
}

impl Stage {
    /// The word used in the API.
    pub const fn as_str(self) -> &'static str {
        match self {
            Stage::Admission => "admission",
            Stage::Processing => "processing",
            Stage::Broker => "broker",
        }
    }

    /// The stage a word names (`None` for an unknown word).
    pub fn parse(word: &str) -> Option<Stage> {
        match word {
            "admission" => Some(Stage::Admission),
            "processing" => Some(Stage::Processing),
            "broker" => Some(Stage::Broker),
            _ => None,
        }
    }
}

/// Where a broker message came from: what a dead letter of a source keeps
/// so that it can be read and republished.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceRef {
    /// The `[[sources]]` entry's name.
    pub name: String,
    /// `rabbitmq`, `nats`, `redis`, `kafka` or `sqs`.
    pub broker: String,
    /// The queue, stream or topic the message was originally on (for a
    /// watch source: the original queue the broker dead-lettered it from,
    /// when the message says).
    pub queue: String,
    /// The message's id, as the contract's table derives it per broker.
    pub message_id: String,
    /// The broker message's own headers, as one JSON object (values that
    /// are not UTF-8 as `{"base64": …}`).
    #[serde(default)]
    pub headers: serde_json::Map<String, serde_json::Value>,
    /// The broker's coordinates (`{"stream_seq": 42}`, `{"entry_id": …}`).
    #[serde(default)]
    pub position: serde_json::Value,
    /// The message's content type, when it had one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content_type: Option<String>,
    /// The `x-lazaret-redrive-id` a redriven copy carries: part of the
    /// dead letter's key, so the copy is never taken for the dead letter
    /// it was redriven from (which the redrive removes only after the
    /// broker confirmed the copy).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub redrive_id: Option<String>,
}

/// What identifies a broker message in lazaret's store, its dead letter
/// and its held retry alike: one of each per (source, message id, payload
/// SHA-256, redrive id). A different message reusing a quarantined or held
/// id (another body) is another message; a redriven copy is never the dead
/// letter it came from.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MessageKey {
    /// The `[[sources]]` entry's name.
    pub source: String,
    /// The message's id.
    pub message_id: String,
    /// The SHA-256 of its body, in lower-case hex.
    pub payload_sha256: String,
    /// The `x-lazaret-redrive-id` it carries, if any.
    pub redrive_id: Option<String>,
}

impl MessageKey {
    /// The key of a message with this body.
    pub fn of(
        source: impl Into<String>,
        message_id: impl Into<String>,
        body: &[u8],
        redrive_id: Option<String>,
    ) -> MessageKey {
        MessageKey {
            source: source.into(),
            message_id: message_id.into(),
            payload_sha256: hex::encode(lazaret_core::payload_sha256(body)),
            redrive_id,
        }
    }

    /// The key of the message `source` describes, with this body.
    pub fn of_source(source: &SourceRef, body: &[u8]) -> MessageKey {
        MessageKey::of(
            source.name.clone(),
            source.message_id.clone(),
            body,
            source.redrive_id.clone(),
        )
    }

    /// The redrive id as stored: empty for none (a unique index treats
    /// NULLs as distinct).
    pub fn redrive_column(&self) -> &str {
        self.redrive_id.as_deref().unwrap_or("")
    }
}

/// A broker message to quarantine (guard: the policy dead-lettered it;
/// watch: the broker did).
#[derive(Clone, Debug)]
pub struct SourceDeadLetter {
    /// Where it came from.
    pub source: SourceRef,
    /// The lazaret job type whose policy applied (a Celery task's name in
    /// watch mode).
    pub job_type: Option<String>,
    /// Tenant.
    pub tenant: Option<String>,
    /// Lane.
    pub lane: Option<String>,
    /// Why.
    pub reason: DeadLetterReason,
    /// `Processing` (guard) or `Broker` (watch).
    pub stage: Stage,
    /// Attempts charged (guard) or the broker's delivery count (watch).
    pub attempts: u32,
    /// The last failure, or the error text the broker carried.
    pub error: Option<Failure>,
    /// Counters and attempt history (guard).
    pub envelope: Option<lazaret_core::Envelope>,
    /// `<source>:<message id>`, or a Celery task's id.
    pub idempotency_key: Option<String>,
    /// When the message was first seen (or first dead-lettered by the broker).
    pub created_at: Timestamp,
    /// Quarantine time.
    pub now: Timestamp,
    /// The message body, byte for byte.
    pub payload: Vec<u8>,
    /// `false` only when the message cannot have a retry held for it (a
    /// first delivery from the broker, which the guard did not look up in
    /// the store): the quarantine then skips dropping one. `true` is always
    /// correct.
    pub may_be_held: bool,
}

/// What quarantining a broker message did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quarantined {
    /// The dead letter holding it.
    pub id: DeadLetterId,
    /// `false` when it was there already (a redelivery after a crash
    /// between quarantine and acknowledgement): nothing new was written.
    pub created: bool,
}

/// A broker message whose retry or deferral lazaret holds in its own store
/// until it is due (the broker message was acknowledged once this was
/// durable).
#[derive(Clone, Debug, PartialEq)]
pub struct HeldRetry {
    /// Where it came from (name, queue, id, headers, position).
    pub source: SourceRef,
    /// When it is delivered again.
    pub due_at: Timestamp,
    /// Counters and attempt history so far.
    pub envelope: lazaret_core::Envelope,
    /// The message body, byte for byte.
    pub body: Vec<u8>,
}

impl HeldRetry {
    /// The message's key: a retry is held per key, so another body under
    /// the same message id is held (or delivered) as a message of its own.
    pub fn key(&self) -> MessageKey {
        MessageKey::of_source(&self.source, &self.body)
    }
}

/// A held retry claimed for delivery ([`crate::Store::claim_held_retries`]).
#[derive(Clone, Debug, PartialEq)]
pub struct ClaimedRetry {
    /// The retry.
    pub retry: HeldRetry,
    /// The claimer whose claim on it had expired when this claim took it:
    /// a node that died (or stopped) mid delivery, which left no outcome.
    /// The runtime charges that as a crash (a lease expiry) when it was
    /// another claimer, so a retry that kills node after node ends as
    /// `crash_loop`. `None` when nobody had claimed it.
    pub lapsed_claim: Option<String>,
}

/// What lazaret's store holds of a broker message already.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Held {
    /// Nothing: the message is new to lazaret.
    Nothing,
    /// A retry or deferral held until due: a held retry of the same
    /// [`MessageKey`].
    Retry,
    /// In the dead letters: a dead letter of the same [`MessageKey`].
    Quarantined(DeadLetterId),
}

/// A payload refused at admission, as recorded.
#[derive(Clone, Debug)]
pub struct AdmissionRecord {
    /// When it could be read.
    pub job_type: Option<String>,
    /// When it could be read.
    pub tenant: Option<String>,
    /// When it could be read.
    pub lane: Option<String>,
    /// The POISON reason.
    pub reason: DeadLetterReason,
    /// What was wrong, for the operator.
    pub message: String,
    /// The announced Content-Length, else the bytes read.
    pub payload_size: u64,
    /// SHA-256 hex, when the payload was read whole.
    pub payload_sha256: Option<String>,
    /// At most 4 KiB.
    pub payload_preview: String,
    /// The whole payload when it was read whole (it is then under the cap).
    pub payload: Option<Vec<u8>>,
    /// Producer's key, when it could be read.
    pub idempotency_key: Option<String>,
    /// Time of refusal.
    pub now: Timestamp,
}

/// A quarantined job or refused payload.
#[derive(Clone, Debug)]
pub struct DeadLetter {
    /// Its own id.
    pub id: DeadLetterId,
    /// The job (processing stage only).
    pub job_id: Option<JobId>,
    /// Type, when known.
    pub job_type: Option<String>,
    /// Tenant, when known.
    pub tenant: Option<String>,
    /// Lane, when known.
    pub lane: Option<String>,
    /// Why.
    pub reason: DeadLetterReason,
    /// Where.
    pub stage: Stage,
    /// Attempts charged.
    pub attempts: u32,
    /// The last failure (for admission records: kind = the reason).
    pub error: Option<Failure>,
    /// Every attempt kept.
    pub history: Vec<AttemptRecord>,
    /// Producer's key.
    pub idempotency_key: Option<String>,
    /// First admission (processing) or refusal time (admission).
    pub created_at: Timestamp,
    /// Quarantine time.
    pub dead_lettered_at: Timestamp,
    /// Payload size in bytes.
    pub payload_size: u64,
    /// SHA-256 hex of the payload, when read whole.
    pub payload_sha256: Option<String>,
    /// At most 4 KiB of the payload.
    pub payload_preview: String,
    /// Redrives so far.
    pub redrive_count: u32,
    /// Schema version.
    pub schema_version: Option<u32>,
    /// The broker message it holds (`None` for lazaret's own jobs).
    pub source: Option<SourceRef>,
    /// Its failure group (`lazaret_core::group_of`).
    pub group_id: String,
    /// Its error message's fingerprint (`lazaret_core::group_fingerprint`).
    pub fingerprint: String,
    /// When it was archived (`None`: active).
    pub archived_at: Option<Timestamp>,
    /// The W3C `traceparent` its job was enqueued with, or its broker
    /// message carried.
    pub traceparent: Option<TraceParent>,
}

/// Which dead letters (every field optional; all given must match).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetterFilter {
    /// Job type.
    #[serde(rename = "type", default)]
    pub job_type: Option<String>,
    /// Tenant.
    #[serde(default)]
    pub tenant: Option<String>,
    /// Lane.
    #[serde(default)]
    pub lane: Option<String>,
    /// Reason word.
    #[serde(default)]
    pub reason: Option<String>,
    /// Source name (`[[sources]]`).
    #[serde(default)]
    pub source: Option<String>,
    /// Stage word (`admission`, `processing`, `broker`).
    #[serde(default)]
    pub stage: Option<String>,
    /// The lazaret job it holds.
    #[serde(default)]
    pub job_id: Option<u64>,
    /// Its failure group's id.
    #[serde(default)]
    pub group: Option<String>,
    /// `false` (the default): active dead letters only; `true`: archived
    /// ones only.
    #[serde(default)]
    pub archived: bool,
}

/// Which failure groups ([`crate::Store::groups`]): the dead letters
/// counted are the active ones (or with `archived`, the archived ones)
/// matching every filter given.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupQuery {
    /// Job type.
    pub job_type: Option<String>,
    /// Reason word.
    pub reason: Option<String>,
    /// Source name.
    pub source: Option<String>,
    /// Tenant.
    pub tenant: Option<String>,
    /// Only dead letters dead-lettered at or after this time.
    pub since: Option<Timestamp>,
    /// Archived dead letters instead of active ones.
    pub archived: bool,
    /// Most groups in the page.
    pub limit: u32,
    /// Where the previous page ended.
    pub cursor: Option<GroupCursor>,
    /// The end of the hour `rate_1h` counts.
    pub now: Timestamp,
    /// With `Some(max)`, each group's [`FailureGroup::held`] counts its
    /// dead letters whose job was redriven `max` times or more already
    /// (held for a person); `None` leaves it 0.
    pub redrives_max: Option<u32>,
}

/// Where a page of groups ended: groups are ordered by their newest dead
/// letter (`last_at`) descending, then by id ascending.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupCursor {
    /// The last group's `last_at`.
    pub last_at: Timestamp,
    /// The last group's id.
    pub id: String,
}

impl GroupCursor {
    /// The cursor as the API shows it: `<last_at ms>.<group id>`.
    pub fn to_text(&self) -> String {
        format!("{}.{}", self.last_at.as_millis(), self.id)
    }

    /// Parses [`GroupCursor::to_text`].
    pub fn parse(s: &str) -> Option<Self> {
        let (at, id) = s.split_once('.')?;
        Some(GroupCursor {
            last_at: Timestamp::from_millis(at.parse().ok()?),
            id: id.to_owned(),
        })
    }
}

/// What a redrive did so far ([`crate::Store::redrive_report`]): its
/// audit entry, the jobs it moved as they stand now, and the broker
/// messages it republished as far as lazaret saw them end. The outcome
/// counts (`succeeded`, `running`, `failed_again`, the groups) hold both.
#[derive(Clone, Debug, PartialEq)]
pub struct RedriveReport {
    /// The redrive id.
    pub id: String,
    /// Its audit entry: who, when, the request, and (`count`) how many
    /// jobs and broker messages it sent.
    pub audit: AuditEntry,
    /// lazaret jobs it moved.
    pub jobs: u64,
    /// Broker messages it republished.
    pub messages: u64,
    /// Of those jobs and messages: succeeded (a message: a guard source
    /// handled its copy).
    pub succeeded: u64,
    /// Jobs queued, scheduled or leased now; messages sent and not seen
    /// back yet (a watch source's stay so unless they fail again).
    pub running: u64,
    /// Dead-lettered again (a message: its copy became a dead letter).
    pub failed_again: u64,
    /// Cancelled.
    pub cancelled: u64,
    /// No longer held: removed by retention once finished (succeeded or
    /// cancelled), or purged after failing again.
    pub gone: u64,
    /// The groups the jobs and messages came from, with how many each.
    pub from_groups: Vec<(String, u64)>,
    /// The groups those that failed again fell into, with how many each.
    pub failed_again_groups: Vec<(String, u64)>,
}

impl RedriveReport {
    /// Counts the jobs of a redrive from (group it came from, its state
    /// now — `None` when retention removed it —, the group of its dead
    /// letter when it has one), and its broker messages from (group it
    /// came from, outcome — `None` while sent, `succeeded`,
    /// `failed_again` —, the group it fell into when it failed again), as
    /// both backends read them.
    pub(crate) fn tally(
        id: &str,
        audit: AuditEntry,
        rows: Vec<(String, Option<String>, Option<String>)>,
        messages: Vec<(String, Option<String>, Option<String>)>,
    ) -> Self {
        use std::collections::BTreeMap;
        let mut r = RedriveReport {
            id: id.to_owned(),
            audit,
            jobs: rows.len() as u64,
            messages: messages.len() as u64,
            succeeded: 0,
            running: 0,
            failed_again: 0,
            cancelled: 0,
            gone: 0,
            from_groups: Vec::new(),
            failed_again_groups: Vec::new(),
        };
        let mut from: BTreeMap<String, u64> = BTreeMap::new();
        let mut again: BTreeMap<String, u64> = BTreeMap::new();
        for (from_group, state, group) in rows {
            *from.entry(from_group).or_default() += 1;
            match state.as_deref() {
                Some("succeeded") => r.succeeded += 1,
                None => r.gone += 1,
                Some("cancelled") => r.cancelled += 1,
                Some("dead_lettered") => {
                    r.failed_again += 1;
                    *again.entry(group.unwrap_or_default()).or_default() += 1;
                }
                Some(_) => r.running += 1,
            }
        }
        for (from_group, outcome, group) in messages {
            *from.entry(from_group).or_default() += 1;
            match outcome.as_deref() {
                Some("succeeded") => r.succeeded += 1,
                Some("failed_again") => {
                    r.failed_again += 1;
                    *again.entry(group.unwrap_or_default()).or_default() += 1;
                }
                _ => r.running += 1,
            }
        }
        r.from_groups = from.into_iter().collect();
        r.failed_again_groups = again.into_iter().collect();
        r
    }
}

/// Most tenants (and sources) a group lists.
pub const GROUP_NAMES_MAX: usize = 20;

/// A failure group: dead letters of one type, reason, kind, message
/// fingerprint and first traceback frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailureGroup {
    /// `lazaret_core::group_id`.
    pub id: String,
    /// Dead letters in it.
    pub count: u64,
    /// Type, when known.
    pub job_type: Option<String>,
    /// Reason.
    pub reason: DeadLetterReason,
    /// The failures' kind, when there was one.
    pub kind: Option<String>,
    /// The message fingerprint.
    pub fingerprint: String,
    /// The newest dead letter's error message.
    pub sample_error: Option<String>,
    /// The newest dead letter's id.
    pub sample_id: DeadLetterId,
    /// Oldest.
    pub first_at: Timestamp,
    /// Newest.
    pub last_at: Timestamp,
    /// Dead letters of the hour before the query's `now`.
    pub rate_1h: u64,
    /// Tenants affected (at most [`GROUP_NAMES_MAX`], in order).
    pub tenants: Vec<String>,
    /// Sources affected (at most [`GROUP_NAMES_MAX`], in order).
    pub sources: Vec<String>,
    /// Of its dead letters, the lazaret jobs held for a person: redriven
    /// [`GroupQuery::redrives_max`] times or more already (0 without it).
    pub held: u64,
}

/// Where a redrive sends its jobs when not back where they were: another
/// type and/or lane (a repair handler). The caller has admitted each job's
/// payload for the new type (byte cap, schema) before asking.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Redirect {
    /// The type the jobs become (`None`: they keep theirs).
    pub job_type: Option<String>,
    /// The lane they are queued in (`None`: they keep theirs).
    pub lane: Option<String>,
    /// With a new type: the schema version its admission chose (`None`
    /// when the type has no schemas).
    pub schema_version: Option<u32>,
}

impl Redirect {
    /// Whether it changes anything.
    pub fn is_empty(&self) -> bool {
        self.job_type.is_none() && self.lane.is_none()
    }

    /// Gives a redriven job's envelope its new type, schema version and
    /// lane (both backends, before they write the row from it).
    pub(crate) fn apply(&self, env: &mut lazaret_core::Envelope) {
        if let Some(t) = &self.job_type {
            env.job_type = lazaret_core::JobType::new(t);
            env.schema_version = self.schema_version;
        }
        if let Some(l) = &self.lane {
            env.lane = lazaret_core::Lane::new(l);
        }
    }
}

/// One redrive of a job, as its lineage shows it ([`crate::Store::lineage`]).
#[derive(Clone, Debug, PartialEq)]
pub struct LineageEntry {
    /// The redrive id (`None` for a redrive recorded without one).
    pub redrive_id: Option<String>,
    /// The redrive's audit entry (who, when, what was asked).
    pub audit: AuditEntry,
    /// The failure group of the dead letter it was redriven from.
    pub from_group: String,
    /// Whether the payload was replaced (a corrected redrive).
    pub edited: bool,
    /// The type it was sent to, when redirected.
    pub to_type: Option<String>,
    /// The lane it was sent to, when redirected.
    pub to_lane: Option<String>,
}

/// A corrected payload for one dead letter's job, admitted by the caller
/// (byte cap, schema) exactly as a new enqueue would be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PayloadFix {
    /// The corrected payload's raw JSON text.
    pub payload: Vec<u8>,
    /// The schema version it was admitted under.
    pub schema_version: Option<u32>,
    /// Who corrected it (the token's name).
    pub actor: String,
    /// Why, in the operator's words.
    pub reason: String,
}

/// Ids or a filter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Selector {
    /// These dead letters.
    Ids(Vec<DeadLetterId>),
    /// Every dead letter matching.
    Filter(DeadLetterFilter),
}

/// A (reason, type) group of dead letters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReasonCount {
    /// Reason.
    pub reason: DeadLetterReason,
    /// Type, when known.
    pub job_type: Option<String>,
    /// How many.
    pub count: u64,
    /// Oldest.
    pub first_at: Timestamp,
    /// Newest.
    pub last_at: Timestamp,
}

/// One line of the audit log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AuditEntry {
    /// When.
    pub at: Timestamp,
    /// The token's name.
    pub actor: String,
    /// `redrive`, `purge`, `pause`, `resume`, `token_create`, `token_revoke`, `denied`, `cancel`.
    pub action: String,
    /// The request as received.
    pub request: serde_json::Value,
    /// Jobs or dead letters affected.
    pub count: u64,
}

/// A bearer token created through the API (`[[tokens]]` from the config file
/// are not stored). Only the SHA-256 of its secret is kept, never the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiToken {
    /// The actor named in the audit log; unique among tokens.
    pub name: String,
    /// The role word (`producer`, `worker`, `operator`, `admin`); the server
    /// gives it meaning, the store keeps it as written.
    pub role: String,
    /// Lower-case hex SHA-256 of the secret; unique among tokens.
    pub token_sha256: String,
    /// When it was created.
    pub created_at: Timestamp,
    /// The name of the token that created it.
    pub created_by: String,
}

impl fmt::Debug for ApiToken {
    // A hash of a short secret can be brute-forced: logs get a fingerprint only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiToken")
            .field("name", &self.name)
            .field("role", &self.role)
            .field(
                "token_sha256",
                &format_args!("{}…", self.token_sha256.get(..8).unwrap_or("")),
            )
            .field("created_at", &self.created_at)
            .field("created_by", &self.created_by)
            .finish()
    }
}

/// Why a token was not created; nothing was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// Another stored token has this name.
    #[error("a token with this name exists already; pick another name, or revoke that token first")]
    NameTaken,
    /// Another stored token has this secret.
    #[error("a token with this secret exists already; generate a new secret")]
    SecretTaken,
}

/// A job as `GET /v1/jobs/{id}` shows it.
#[derive(Clone, Debug)]
pub struct JobView {
    /// The envelope (counters, history).
    pub envelope: lazaret_core::Envelope,
    /// State as stored (`scheduled` whose time passed reads as `queued`).
    pub state: JobState,
    /// When it may run next.
    pub run_at: Option<Timestamp>,
    /// Raw JSON text.
    pub payload: Vec<u8>,
    /// Lease expiry, while leased.
    pub lease_expires_at: Option<Timestamp>,
    /// Name of the token that enqueued it (`None` when auth is off).
    pub enqueued_by: Option<String>,
    /// Its dead letter, while it is dead-lettered.
    pub dead_letter_id: Option<DeadLetterId>,
    /// A cancel of the job was accepted: it is `cancelled`, or leased and
    /// cancelled at its outcome unless acked (an ack leaves it `succeeded`
    /// with this still set).
    pub cancel_requested: bool,
}

/// Which jobs to list, newest first (every filter optional; all given
/// must match).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobQuery {
    /// State as stored (a `scheduled` job whose time passed moments ago
    /// counts as `scheduled` until the store promotes it).
    pub state: Option<JobState>,
    /// Type.
    pub job_type: Option<String>,
    /// Tenant.
    pub tenant: Option<String>,
    /// Lane.
    pub lane: Option<String>,
    /// Only jobs enqueued by this token (a producer's own).
    pub enqueued_by: Option<String>,
    /// At most this many.
    pub limit: u32,
    /// Only jobs older than this one (the `next_cursor` of the page before).
    pub before: Option<JobId>,
}

/// A page of jobs, newest first, and the cursor of the next (older) page
/// when there may be one.
pub type JobPage = (Vec<JobView>, Option<JobId>);

/// A heartbeat as applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Heartbeat {
    /// The lease's new end.
    pub lease_expires_at: Timestamp,
    /// A cancel of the job was requested: the worker should stop, and the
    /// job ends `cancelled` at its next outcome unless it is acked.
    pub cancel_requested: bool,
}

/// What a cancel did (see `lazaret_core::cancel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancelled {
    /// The job was waiting and is `cancelled` now; it is never leased again.
    Now,
    /// The job is leased: it ends `cancelled` at its outcome or lease
    /// expiry unless it is acked. `already`: an earlier request did this.
    Requested {
        /// A cancel was requested before: nothing changed.
        already: bool,
    },
}

/// Why a cancel was refused; nothing was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CancelError {
    /// No such job.
    #[error("no such job")]
    NotFound,
    /// The job is finished (`succeeded`, `dead_lettered`, `cancelled`).
    #[error("the job is {0} already: a finished job cannot be cancelled")]
    Finished(JobState),
}

/// What a pause or resume names.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PauseTarget {
    /// Every job of a type.
    Type(String),
    /// Every job of a lane.
    Lane(String),
}

impl PauseTarget {
    /// `type` or `lane`, the word the API and the database use.
    pub const fn kind(&self) -> &'static str {
        match self {
            PauseTarget::Type(_) => "type",
            PauseTarget::Lane(_) => "lane",
        }
    }

    /// The type's or lane's name.
    pub fn name(&self) -> &str {
        match self {
            PauseTarget::Type(n) | PauseTarget::Lane(n) => n,
        }
    }
}

/// A type or lane paused now, as stored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pause {
    /// What is paused.
    pub target: PauseTarget,
    /// Since when.
    pub paused_at: Timestamp,
    /// The token's name that paused it.
    pub paused_by: String,
}

/// Counters kept by the store.
#[derive(Clone, Debug, Default)]
pub struct StoreStats {
    /// Per lane: (queued, scheduled, leased).
    pub lanes: Vec<(Lane, LaneCounts)>,
    /// Dead letters held now, per (type, reason).
    pub dead_letters: Vec<(Option<String>, DeadLetterReason, u64)>,
    /// Succeeded jobs still kept (retention).
    pub succeeded: u64,
    /// Cancelled jobs still kept (retention, as for succeeded ones).
    pub cancelled: u64,
    /// Per lane with jobs ready now: when its longest-waiting ready job
    /// became ready (`lazaret_oldest_job_age_seconds` is now minus this).
    pub oldest_ready: Vec<(Lane, Timestamp)>,
    /// Broker messages whose retry or deferral lazaret holds now, per
    /// source name (sorted by name; sources holding none left out).
    pub held_retries: Vec<(String, u64)>,
    /// Which backend: `sqlite` or `postgres`.
    pub backend: &'static str,
    /// What only some backends count (SQLite's group commit and fsyncs);
    /// `None` for a backend that keeps no such counters.
    pub group_commit: Option<GroupCommitStats>,
}

/// Counters of a backend that groups concurrent requests into one
/// transaction (and, for SQLite, one fsync): how much sharing it achieved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GroupCommitStats {
    /// Transactions this process committed (group commit: one per group).
    pub commits: u64,
    /// Commands those transactions carried; `commands / commits` is how
    /// many requests shared each transaction.
    pub commands: u64,
    /// fsyncs that made those transactions durable, when the store makes
    /// them itself (SQLite with `durability = "full"`; 0 otherwise): one can
    /// cover several transactions, so `commands / syncs` is how many
    /// requests shared each.
    pub syncs: u64,
    /// Time those fsyncs took, in microseconds: `sync_micros / syncs` is
    /// what the disk makes every durable request wait, on average.
    pub sync_micros: u64,
    /// Lease commands run since start (each long-poll look is one).
    pub leases: u64,
    /// What those leases' reads cost the database, in its own unit (SQLite:
    /// virtual-machine steps of the lease statements; 0 where a store does
    /// not count): grows with the rows a lease looks at, not only those it
    /// returns, so `lease_steps / leases` shows a lease that scans.
    pub lease_steps: u64,
    /// (lane, tenant) pairs those leases looked at to plan: about as many
    /// as they lease, never every tenant with jobs ready (0 where a store
    /// does not count).
    pub lease_pairs: u64,
    /// Groups the database rolled back for a deadlock or a serialization
    /// failure (PostgreSQL; their requests then ran again one by one, so
    /// nothing failed, but each such group waited for the database's
    /// `deadlock_timeout`, one second by default). Nodes take the counts'
    /// rows in one order, so this stays at or near 0; a climbing figure
    /// is worth a report.
    pub conflicts: u64,
}

/// Job counts in one lane.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaneCounts {
    /// Ready now.
    pub queued: u64,
    /// Waiting for their time.
    pub scheduled: u64,
    /// Held by workers.
    pub leased: u64,
}

/// A store failure: the operation did not happen.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database refused or failed (the message says which backend and
    /// what to check).
    #[error("database error: {0}")]
    Db(DbError),
    /// The store was closed (shutting down).
    #[error("the store is closed (the server is shutting down); retry against a running server")]
    Closed,
    /// Opening the data directory failed.
    #[error(
        "cannot open the data directory {path}: {source}; check that it exists and is writable"
    )]
    Open {
        /// The directory.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Another store holds the data directory's lock (`lazaret.lock`): two
    /// stores on one directory would issue the same ids and lease tokens.
    #[error(
        "another lazaret is using {path}{}; stop it or use another --data directory",
        pid.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    InUse {
        /// The data directory.
        path: String,
        /// The process holding it, when its lock file says.
        pid: Option<u32>,
    },
    /// A stored row could not be read back.
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    /// The request's transaction was rolled back, for the reason given;
    /// nothing of it happened.
    #[error("not applied: {0}")]
    NotApplied(String),
    /// The store's command queue is full (the server takes requests faster
    /// than the database writes them): nothing of the request was applied.
    #[error(
        "the server is overloaded: {waiting} requests are waiting for the database already (the bound); nothing of this request was applied, retry in a moment"
    )]
    Overloaded {
        /// Commands waiting when this one was refused.
        waiting: usize,
    },
    /// The change was committed but could not be made durable (a failed
    /// fsync); the store takes no more writes.
    #[error("{0}")]
    NotDurable(String),
}

/// A backend's own error, as text and code: the seam carries no backend's
/// error type, so a caller never depends on which database it runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DbError {
    /// What the database said, and what to check.
    pub message: String,
    /// The backend's code for it, when it has one (SQLite's error code
    /// name such as `SQLITE_FULL`, PostgreSQL's SQLSTATE such as `40P01`).
    pub code: Option<String>,
}

impl DbError {
    /// An error with a message and no code.
    pub fn new(message: impl Into<String>) -> Self {
        DbError {
            message: message.into(),
            code: None,
        }
    }

    /// Whether the database refused to write for want of room or a
    /// working disk (SQLite `SQLITE_FULL`, `SQLITE_IOERR`,
    /// `SQLITE_READONLY`, `SQLITE_CANTOPEN`; PostgreSQL class 53,
    /// insufficient resources such as `53100` disk full, and `58030` I/O
    /// error): nothing was written, and the same request may succeed once
    /// the disk has room again.
    pub fn is_out_of_room(&self) -> bool {
        matches!(
            self.code.as_deref(),
            Some("DiskFull" | "SystemIoFailure" | "ReadOnly" | "CannotOpen" | "58030")
        ) || self.code.as_deref().is_some_and(|c| c.starts_with("53"))
    }
}

impl fmt::Display for DbError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// What another node on the same store did, announced at its commit.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreEvent {
    /// Jobs may have become leasable: long-polls should look again. With
    /// `jobs`, only these (lane, type) pairs did (enqueues); `None`: any
    /// job may have (a promotion, a retry, an expiry, a redrive, a freed
    /// slot), or too many pairs to name.
    Ready {
        /// The (lane, type) pairs made ready, when known.
        jobs: Option<Vec<(lazaret_core::Lane, lazaret_core::JobType)>>,
    },
    /// API tokens were created or revoked: reload them.
    TokensChanged,
    /// A shared switch changed.
    Switch(Switch),
}

/// A piece of live state every node of a cluster shares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "switch", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Switch {
    /// A type paused (`paused: false`: resumed).
    PauseType {
        /// The type.
        name: String,
        /// Paused or resumed.
        paused: bool,
    },
    /// A lane paused (`paused: false`: resumed).
    PauseLane {
        /// The lane.
        name: String,
        /// Paused or resumed.
        paused: bool,
    },
    /// A breaker opened on some node: every node sheds the type until
    /// `until_ms` (ms since the epoch).
    BreakerOpen {
        /// The job type.
        job_type: String,
        /// The error kind that tripped it.
        kind: String,
        /// Open until.
        until_ms: i64,
    },
    /// A breaker closed on some node (a probe succeeded there): every node
    /// closes it too.
    BreakerClosed {
        /// The job type.
        job_type: String,
        /// The error kind.
        kind: String,
    },
}

/// A duty one node of a cluster does for all of them at a time
/// ([`crate::Store::lead`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Duty {
    /// Deciding and sending the `[[alerts]]` webhooks.
    Alerts,
    /// Removing succeeded and cancelled jobs past their retention.
    Retention,
}

impl Duty {
    /// Every duty.
    pub const ALL: [Duty; 2] = [Duty::Alerts, Duty::Retention];

    /// The duty's name, for logs.
    pub const fn as_str(self) -> &'static str {
        match self {
            Duty::Alerts => "alerts",
            Duty::Retention => "retention",
        }
    }

    /// A small number of its own (the PostgreSQL advisory lock's second key).
    pub const fn number(self) -> i32 {
        match self {
            Duty::Alerts => 1,
            Duty::Retention => 2,
        }
    }
}

/// A dead letter as the alerts read it ([`crate::Store::dead_letters_after`]):
/// what it is about, not what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecentDeadLetter {
    /// Its id.
    pub id: DeadLetterId,
    /// When it was written (`dead_lettered_at`).
    pub at: Timestamp,
    /// Type, when known.
    pub job_type: Option<String>,
    /// Why.
    pub reason: DeadLetterReason,
    /// The last failure's kind, when there was one.
    pub kind: Option<String>,
    /// The last failure's message (empty without one).
    pub message: String,
}

impl RecentDeadLetter {
    /// From a `dead_letters` row's columns, as both backends keep them
    /// (`error` is the [`Failure`] as JSON).
    pub(crate) fn from_columns(
        id: i64,
        at: i64,
        job_type: Option<String>,
        reason: &str,
        error: Option<&str>,
    ) -> Result<Self, StoreError> {
        let error: Option<Failure> = error
            .map(serde_json::from_str)
            .transpose()
            .map_err(|e| StoreError::Corrupt(format!("dead letter {id}: its error: {e}")))?;
        Ok(RecentDeadLetter {
            id: DeadLetterId(id as u64),
            at: Timestamp::from_millis(at),
            job_type,
            reason: reason
                .parse()
                .map_err(|e| StoreError::Corrupt(format!("dead letter {id}: {e}")))?,
            kind: error.as_ref().map(|f| f.kind.as_str().to_owned()),
            message: error.map(|f| f.message).unwrap_or_default(),
        })
    }
}

/// The charts' stored samples of some minutes ([`crate::Store::signal_samples`]):
/// the values, and the minutes that were sampled (a name missing from a
/// sampled minute was 0 then; a minute not sampled is a gap).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SignalSamples {
    /// Every value stored for those minutes, by minute, signal, axis and name.
    pub samples: Vec<lazaret_core::series::Sample>,
    /// The minutes sampled, oldest first.
    pub sampled: Vec<Timestamp>,
}
