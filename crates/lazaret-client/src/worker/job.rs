//! What a handler sees: the typed payload and the job's envelope.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use lazaret_core::{JobId, JobType, Lane, TenantId};

use crate::model::LeasedJob;

/// The envelope of a leased job, shared between its handler and the
/// runtime (which moves `lease_expires_at` on each heartbeat).
#[derive(Debug)]
pub(crate) struct Meta {
    pub(crate) id: JobId,
    pub(crate) job_type: JobType,
    pub(crate) tenant: TenantId,
    pub(crate) lane: Lane,
    pub(crate) attempt: u32,
    pub(crate) idempotency_key: Option<String>,
    pub(crate) schema_version: Option<u32>,
    pub(crate) traceparent: Option<String>,
    pub(crate) created_at: SystemTime,
    pub(crate) lease_expires_at: Mutex<SystemTime>,
}

impl Meta {
    pub(crate) fn of(j: &LeasedJob) -> Self {
        Meta {
            id: j.id,
            job_type: j.job_type.clone(),
            tenant: j.tenant.clone(),
            lane: j.lane.clone(),
            attempt: j.attempt,
            idempotency_key: j.idempotency_key.clone(),
            schema_version: j.schema_version,
            traceparent: j.traceparent.clone(),
            created_at: j.created_at,
            lease_expires_at: Mutex::new(j.lease_expires_at),
        }
    }

    pub(crate) fn set_lease_expires_at(&self, t: SystemTime) {
        *self
            .lease_expires_at
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = t;
    }
}

/// A job handed to a handler: its payload, deserialised into `T`, and its
/// envelope.
#[derive(Debug)]
pub struct Job<T> {
    /// The payload.
    pub payload: T,
    meta: Arc<Meta>,
}

impl<T> Job<T> {
    pub(crate) fn new(payload: T, meta: Arc<Meta>) -> Self {
        Job { payload, meta }
    }

    /// The job's id.
    pub fn id(&self) -> JobId {
        self.meta.id
    }

    /// Its type.
    pub fn job_type(&self) -> &JobType {
        &self.meta.job_type
    }

    /// Its tenant.
    pub fn tenant(&self) -> &TenantId {
        &self.meta.tenant
    }

    /// Its lane.
    pub fn lane(&self) -> &Lane {
        &self.meta.lane
    }

    /// 1 on the first delivery; counts every charged delivery (a deferral
    /// is not charged, so the next delivery repeats the number).
    pub fn attempt(&self) -> u32 {
        self.meta.attempt
    }

    /// The producer's idempotency key: pass it downstream so a redelivery
    /// (after a crash between the side effect and the ack) is harmless.
    pub fn idempotency_key(&self) -> Option<&str> {
        self.meta.idempotency_key.as_deref()
    }

    /// The schema version the payload was admitted with.
    pub fn schema_version(&self) -> Option<u32> {
        self.meta.schema_version
    }

    /// The W3C trace context it was enqueued with, to continue the
    /// producer's trace (`None`: none).
    pub fn traceparent(&self) -> Option<&str> {
        self.meta.traceparent.as_deref()
    }

    /// When the job was first enqueued.
    pub fn created_at(&self) -> SystemTime {
        self.meta.created_at
    }

    /// When the lease ends unless extended (server clock; heartbeats move it).
    pub fn lease_expires_at(&self) -> SystemTime {
        *self
            .meta
            .lease_expires_at
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The payload, without the envelope.
    pub fn into_payload(self) -> T {
        self.payload
    }
}
