//! The job as stored: identity, counters that travel with it, and its attempt history.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::failure::{Failure, FailureClass};
use crate::ids::{ErrorKind, JobId, JobType, Lane, TenantId, WorkerId};
use crate::time::Timestamp;

/// How many attempt records an envelope keeps; older ones are dropped (and
/// counted in [`Envelope::history_dropped`]) so a crash-looping job cannot
/// grow without bound.
pub const HISTORY_MAX: usize = 32;

/// How many replaced payloads an envelope keeps: the first edit (it holds
/// the payload as admitted) and the latest ones; those between are dropped
/// (and counted in [`Envelope::payload_edits_dropped`]), so repeated
/// corrections cannot grow a job without bound.
pub const PAYLOAD_EDITS_MAX: usize = 4;

/// A payload an operator replaced when redriving a dead letter with a
/// corrected one: who, when, why, and the payload as it was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PayloadEdit {
    /// When the corrected payload was put in.
    pub at: Timestamp,
    /// The token's name.
    pub actor: String,
    /// Why, in the operator's words.
    pub reason: String,
    /// The job's redrive count after this redrive (1: its first redrive).
    pub redrive: u32,
    /// The payload it replaced, as its raw JSON text.
    pub previous_payload: String,
    /// Size of the replaced payload in bytes.
    pub previous_size: u64,
    /// SHA-256 of the replaced payload, hex.
    pub previous_sha256: String,
    /// The schema version the replaced payload was admitted under.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_schema_version: Option<u32>,
}

/// How an attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AttemptOutcome {
    /// Leased and not yet answered.
    Running,
    /// Acknowledged.
    Succeeded,
    /// Failed; a retry was scheduled.
    RetryScheduled,
    /// Asked to wait; rescheduled without being charged.
    Deferred,
    /// Failed for good; the job went to the dead letters.
    DeadLettered,
    /// Failed or expired after its job was asked to cancel: the job was
    /// cancelled instead of retried or dead-lettered.
    Cancelled,
}

impl AttemptOutcome {
    /// The word used in the API.
    pub const fn as_str(self) -> &'static str {
        match self {
            AttemptOutcome::Running => "running",
            AttemptOutcome::Succeeded => "succeeded",
            AttemptOutcome::RetryScheduled => "retry_scheduled",
            AttemptOutcome::Deferred => "deferred",
            AttemptOutcome::DeadLettered => "dead_lettered",
            AttemptOutcome::Cancelled => "cancelled",
        }
    }
}

/// One delivery of a job to a worker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptRecord {
    /// The attempt number this delivery was charged as (1 is the first).
    pub attempt: u32,
    /// When the lease was granted.
    pub started_at: Timestamp,
    /// When the outcome arrived (or the lease expired); `None` while running.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<Timestamp>,
    /// Who held the lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_id: Option<WorkerId>,
    /// How it ended.
    pub outcome: AttemptOutcome,
    /// The failure, with its class resolved by the policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Failure>,
}

/// A job as the store keeps it. Counters live here, not in a consumer's
/// memory, so they survive restarts, rebalancing and redelivery.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Envelope {
    /// Assigned at admission; kept across redrives.
    pub id: JobId,
    /// Selects policy and schemas.
    #[serde(rename = "type")]
    pub job_type: JobType,
    /// Unit of fairness.
    pub tenant: TenantId,
    /// Fixed at enqueue; never hops.
    pub lane: Lane,
    /// The schema version the payload was validated against.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema_version: Option<u32>,
    /// Producer's key; (tenant, type, key) is unique among admitted jobs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idempotency_key: Option<String>,
    /// Size of the payload's raw JSON text.
    pub payload_size: u64,
    /// SHA-256 of the payload's raw JSON text, hex.
    pub payload_sha256: String,
    /// First admission.
    pub created_at: Timestamp,
    /// Deliveries charged so far (the attempt number of the latest one).
    pub attempts: u32,
    /// Deferred outcomes so far.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub deferrals: u32,
    /// Lease expiries so far (the crash-loop counter).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub crashes: u32,
    /// How many times an operator redrove it from the dead letters.
    /// Serialized as `redrive_count`; envelopes stored by builds before
    /// store schema SQLite 8 / PostgreSQL 5 call it `redrives`, which
    /// still reads.
    #[serde(default, skip_serializing_if = "is_zero", alias = "redrives")]
    pub redrive_count: u32,
    /// Failures counted per kind, for per-kind budgets. Few entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kind_failures: Vec<(ErrorKind, u32)>,
    /// The latest [`HISTORY_MAX`] attempts, oldest first.
    #[serde(default)]
    pub history: Vec<AttemptRecord>,
    /// Attempt records dropped to keep the history bounded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub history_dropped: u32,
    /// Payloads replaced by redrives with a corrected payload, oldest first
    /// (at most [`PAYLOAD_EDITS_MAX`]; the first is kept).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub payload_edits: Vec<PayloadEdit>,
    /// Payload edits dropped to keep them bounded.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub payload_edits_dropped: u32,
    /// The W3C `traceparent` it was enqueued (or taken from its broker
    /// message) with, validated; the trace its spans join.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<crate::TraceParent>,
}

impl Envelope {
    /// A fresh envelope for an admitted payload.
    pub fn new(
        id: JobId,
        job_type: JobType,
        tenant: TenantId,
        lane: Lane,
        payload: &[u8],
        now: Timestamp,
    ) -> Self {
        Envelope {
            id,
            job_type,
            tenant,
            lane,
            schema_version: None,
            idempotency_key: None,
            payload_size: payload.len() as u64,
            payload_sha256: hex::encode(payload_sha256(payload)),
            created_at: now,
            attempts: 0,
            deferrals: 0,
            crashes: 0,
            redrive_count: 0,
            kind_failures: Vec::new(),
            history: Vec::new(),
            history_dropped: 0,
            payload_edits: Vec::new(),
            payload_edits_dropped: 0,
            traceparent: None,
        }
    }

    /// Failures of `kind` counted so far.
    pub fn kind_failures(&self, kind: &ErrorKind) -> u32 {
        self.kind_failures
            .iter()
            .find(|(k, _)| k == kind)
            .map_or(0, |(_, n)| *n)
    }

    /// Counts one more failure of `kind` and returns the new count.
    pub(crate) fn count_kind_failure(&mut self, kind: &ErrorKind) -> u32 {
        if let Some((_, n)) = self.kind_failures.iter_mut().find(|(k, _)| k == kind) {
            *n = n.saturating_add(1);
            *n
        } else {
            self.kind_failures.push((kind.clone(), 1));
            1
        }
    }

    /// The most recent failure, if any: what a dead letter shows as its error.
    pub fn last_error(&self) -> Option<&Failure> {
        self.history.iter().rev().find_map(|r| r.error.as_ref())
    }

    /// Appends an attempt record, dropping the oldest past [`HISTORY_MAX`].
    pub(crate) fn push_history(&mut self, record: AttemptRecord) {
        if self.history.len() >= HISTORY_MAX {
            self.history.remove(0);
            self.history_dropped = self.history_dropped.saturating_add(1);
        }
        self.history.push(record);
    }

    /// Keeps a replaced payload, dropping the oldest edit but the first
    /// past [`PAYLOAD_EDITS_MAX`]: the payload as admitted stays readable.
    pub(crate) fn push_payload_edit(&mut self, edit: PayloadEdit) {
        if self.payload_edits.len() >= PAYLOAD_EDITS_MAX {
            self.payload_edits.remove(1);
            self.payload_edits_dropped = self.payload_edits_dropped.saturating_add(1);
        }
        self.payload_edits.push(edit);
    }

    /// The record of the delivery now running, if the last one is running.
    pub(crate) fn running_record(&mut self) -> Option<&mut AttemptRecord> {
        self.history
            .last_mut()
            .filter(|r| r.outcome == AttemptOutcome::Running)
    }

    /// Serialises to JSON (lossless: [`Envelope::from_json`] gives it back).
    pub fn to_json(&self) -> String {
        // Serialising plain data with string keys cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses an envelope serialised by [`Envelope::to_json`].
    pub fn from_json(s: &str) -> Result<Self, EnvelopeError> {
        serde_json::from_str(s).map_err(EnvelopeError::Malformed)
    }
}

/// An envelope that could not be read back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// The stored JSON is not an envelope.
    #[error(
        "stored job envelope is not valid: {0}; the row was written by an incompatible version or corrupted"
    )]
    Malformed(#[source] serde_json::Error),
}

// Empty fields are left out of the stored JSON: it is written on every
// transition, and smaller rows mean fewer pages per commit.
fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// SHA-256 of a payload's raw bytes.
pub fn payload_sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The class a failure ends up with: the worker's, else the policy's for the
/// kind, else transient.
pub(crate) fn resolve_class(
    failure: &Failure,
    by_kind: impl FnOnce(&ErrorKind) -> Option<FailureClass>,
) -> FailureClass {
    failure
        .class
        .or_else(|| by_kind(&failure.kind))
        .unwrap_or(FailureClass::Transient)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn history_is_bounded() {
        let mut env = Envelope::new(
            JobId(1),
            "t".into(),
            "acme".into(),
            Lane::default_lane(),
            b"{}",
            Timestamp::EPOCH,
        );
        for n in 0..(HISTORY_MAX as u32 + 5) {
            env.push_history(AttemptRecord {
                attempt: n + 1,
                started_at: Timestamp::from_millis(n.into()),
                ended_at: None,
                worker_id: None,
                outcome: AttemptOutcome::Running,
                error: None,
            });
        }
        assert_eq!(env.history.len(), HISTORY_MAX);
        assert_eq!(env.history_dropped, 5);
        assert_eq!(env.history[0].attempt, 6);
    }

    /// Envelopes stored before the counter was renamed call it `redrives`:
    /// they still read, and are written back under `redrive_count`.
    #[test]
    fn an_envelope_with_the_old_redrives_key_still_reads() {
        let mut old: serde_json::Value = serde_json::from_str(
            &Envelope::new(
                JobId(1),
                "t".into(),
                "acme".into(),
                Lane::default_lane(),
                b"{}",
                Timestamp::EPOCH,
            )
            .to_json(),
        )
        .unwrap();
        old["redrives"] = serde_json::json!(2);
        let env = Envelope::from_json(&old.to_string()).unwrap();
        assert_eq!(env.redrive_count, 2);

        let written: serde_json::Value = serde_json::from_str(&env.to_json()).unwrap();
        assert_eq!(written["redrive_count"], serde_json::json!(2));
        assert!(written.get("redrives").is_none());
    }
}
