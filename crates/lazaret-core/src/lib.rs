//! lazaret's policy core: every decision about a job, pure and deterministic.
//!
//! This crate decides; it does not do. Given a job's [`Envelope`], its type's
//! [`TypePolicy`] and an event (a lease, a success, a failure, a lease
//! expiry), it returns the [`Transition`] the store must apply in one
//! transaction. It also decides admission (poison at the door), which jobs to
//! lease next (weighted lanes, round-robin tenants, in-flight caps), breaker
//! state (fed by one rule, `Breakers::observe`), whether a type or lane is
//! held back now (the [`Gate`]), and failure statistics; it also names the
//! API's error codes ([`ErrorCode`]) for the server and the client.
//!
//! What it deliberately does not do: I/O of any kind, read a clock
//! (`now: Timestamp` is an argument everywhere) or draw randomness of its own
//! (an [`Entropy`] source is passed in). It does not depend on tokio, axum,
//! rusqlite or sqlx; `tests/it/tidy.rs` keeps it that way. That is what makes
//! every decision testable with property tests and a seeded simulation.

pub mod admission;
pub mod alerts;
pub mod bound;
pub mod breaker;
pub mod cancel;
pub mod decide;
pub mod envelope;
pub mod error_code;
pub mod failure;
pub mod foreign;
pub mod gate;
pub mod groups;
pub mod ids;
pub mod lease_plan;
pub mod policy;
pub mod rng;
pub mod scheduler;
pub mod series;
pub mod state;
pub mod stats;
pub mod time;
pub mod trace;

pub use admission::{
    AdmissionConfig, AdmissionRequest, PREVIEW_BYTES_MAX, SchemaError, TypeSchemas, Verdict,
    Violation, admit, check_body_size, check_size, payload_preview, preview_is_binary,
};
pub use alerts::{
    Alert, AlertEvent, AlertRule, AlertRuleError, Alerts, Observation, RecentDeadLetters,
    TopReason, TypeSurge, type_surges,
};
pub use bound::{
    ERROR_BODY_BYTES_MAX, HEADERS_LINE_BYTES_MAX, bounded_name, is_header_value, mask_url,
    mask_url_in, normalize_attempt_header,
};
pub use breaker::{
    BreakerConfig, BreakerConfigError, BreakerState, BreakerTransition, BreakerView, Breakers,
    LeaseReservation,
};
pub use cancel::{CancelDecision, cancel, settle};
pub use decide::{
    CorrectedPayload, Event, Transition, decide, grant_lease, record_success, redrive,
    redrive_corrected,
};
pub use envelope::{
    AttemptOutcome, AttemptRecord, Envelope, HISTORY_MAX, PAYLOAD_EDITS_MAX, PayloadEdit,
    payload_sha256,
};
pub use error_code::ErrorCode;
pub use failure::{DeadLetterReason, Failure, FailureClass, PoisonReason, UnknownFailureClass};
pub use foreign::{absorb_earlier_deliveries, attempts_spent};
pub use gate::{Gate, LeaseGate, Paused};
pub use groups::{Group, group_fingerprint, group_id, group_of};
pub use ids::{
    ErrorKind, IDEMPOTENCY_KEY_BYTES_MAX, JobId, JobType, Lane, NAME_BYTES_MAX, NameError,
    TenantId, WorkerId, check_name,
};
pub use lease_plan::{Among, LaneWindow, LeaseFilter, PairCounts, Take, plan_lease};
pub use policy::{Backoff, Policies, PolicyError, TypePolicy};
pub use rng::{Entropy, SplitMix64};
pub use scheduler::{Demand, FairScheduler, Grant, SchedulerConfig, SchedulerConfigError, Share};
pub use state::JobState;
pub use stats::{
    DeadLetterSeries, FailureCause, FailureKey, FailureStats, KeyCount, StatsConfig,
    StatsConfigError, Surge, fingerprint,
};
pub use time::Timestamp;
pub use trace::{TRACEPARENT_LEN, TraceParent, TraceParentError};
