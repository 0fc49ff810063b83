//! lazaret's policy core: every decision about a job, pure and deterministic.
//!
//! This crate decides; it does not do. Given a job's [`Envelope`], its type's
//! [`TypePolicy`] and an event (a lease, a success, a failure, a lease
//! expiry), it returns the [`Transition`] the store must apply in one
//! transaction. It also decides admission (poison at the door), which jobs to
//! lease next (weighted lanes, round-robin tenants, in-flight caps), breaker
//! state, and failure statistics.
//!
//! What it deliberately does not do: I/O of any kind, read a clock
//! (`now: Timestamp` is an argument everywhere) or draw randomness of its own
//! (an [`Entropy`] source is passed in). It does not depend on tokio, axum,
//! rusqlite or sqlx; `tests/it/tidy.rs` keeps it that way. That is what makes
//! every decision testable with property tests and a seeded simulation.

pub mod failure;
pub mod ids;
pub mod rng;
pub mod state;
pub mod stats;
pub mod time;

pub use failure::{DeadLetterReason, Failure, FailureClass, PoisonReason};
pub use ids::{ErrorKind, JobId, JobType, Lane, TenantId, WorkerId};
pub use rng::{Entropy, SplitMix64};
pub use state::JobState;
pub use stats::{
    DeadLetterSeries, FailureCause, FailureKey, FailureStats, KeyCount, StatsConfig,
    StatsConfigError, Surge, fingerprint,
};
pub use time::Timestamp;
