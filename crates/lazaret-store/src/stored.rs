//! A job row as stored, and the envelope it stands for (both backends store
//! jobs this way).
//!
//! The hot path writes no JSON. A lease writes only columns (`attempts`,
//! `leases`, `lease_token`, `lease_expires_at`, `lease_started_at`,
//! `worker_id`) and a success only `state` and `finished_at`; the envelope
//! column is written when a failure, a lease expiry or a redrive changes
//! counters or history, and is NULL until the first of those.
//!
//! The envelope a reader sees is rebuilt here, in one place, for the reader
//! and the writer alike (and so across restarts):
//! - the stored envelope, or while it is NULL a fresh one from the columns,
//!   exactly as admission would have made it;
//! - plus, while `lease_started_at` is set, the running attempt, added by
//!   `lazaret_core::grant_lease` as the lease would have added it;
//! - closed by `lazaret_core::record_success` when the job succeeded.
//!
//! Rows written by schema version 1 hold the whole envelope and no
//! `lease_started_at`; they read unchanged.

use lazaret_core::{
    Envelope, JobId, JobState, JobType, Lane, TenantId, Timestamp, WorkerId, grant_lease,
    record_success,
};

use crate::StoreError;

/// A stored `traceparent` column: written only after validation, so one
/// that no longer parses (edited by hand) reads as none rather than
/// failing the read.
pub(crate) fn stored_traceparent(column: Option<String>) -> Option<lazaret_core::TraceParent> {
    column.and_then(|s| lazaret_core::TraceParent::parse(&s).ok())
}

/// One `jobs` row, as far as the envelope goes.
pub(crate) struct StoredJob {
    pub id: i64,
    pub job_type: String,
    pub tenant: String,
    pub lane: String,
    pub state: JobState,
    /// Authoritative: the stored envelope's count lags by the running attempt.
    pub attempts: i64,
    pub lease_started_at: Option<i64>,
    pub worker_id: Option<String>,
    pub idempotency_key: Option<String>,
    pub schema_version: Option<i64>,
    pub created_at: i64,
    pub finished_at: Option<i64>,
    pub envelope: Option<String>,
    pub payload: Vec<u8>,
    /// The `traceparent` column, where the query read it (by name: a query
    /// that did not select it reads none).
    pub traceparent: Option<String>,
}

impl StoredJob {
    /// The envelope as `grant_lease` and `decide` would have left it.
    pub(crate) fn envelope(&self) -> Result<Envelope, StoreError> {
        let mut env = match &self.envelope {
            Some(json) => Envelope::from_json(json).map_err(|e| {
                StoreError::Corrupt(format!("job {}: stored envelope: {e}", self.id))
            })?,
            None => {
                let mut env = Envelope::new(
                    JobId(self.id as u64),
                    JobType::new(self.job_type.clone()),
                    TenantId::new(self.tenant.clone()),
                    Lane::new(self.lane.clone()),
                    &self.payload,
                    Timestamp::from_millis(self.created_at),
                );
                env.idempotency_key = self.idempotency_key.clone();
                env.schema_version = self.schema_version.map(|v| v as u32);
                env
            }
        };
        if env.traceparent.is_none() {
            env.traceparent = stored_traceparent(self.traceparent.clone());
        }
        let Some(started) = self.lease_started_at else {
            return Ok(env);
        };
        if i64::from(env.attempts) + 1 != self.attempts {
            return Err(StoreError::Corrupt(format!(
                "job {}: {} attempts stored but its envelope counts {} before the running one",
                self.id, self.attempts, env.attempts
            )));
        }
        let worker = self.worker_id.clone().map(WorkerId::new);
        grant_lease(&mut env, worker.as_ref(), Timestamp::from_millis(started));
        if self.state == JobState::Succeeded {
            let ended = self.finished_at.unwrap_or(started);
            record_success(&mut env, Timestamp::from_millis(ended));
        }
        Ok(env)
    }
}
