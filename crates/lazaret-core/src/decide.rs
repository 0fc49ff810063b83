//! The decision: given a job and what just happened to it, the transition to apply.
//!
//! Inputs are `handle_*`-style events ([`grant_lease`], [`decide`] with an
//! [`Event`], [`redrive`]); each mutates the [`Envelope`] in place (counters,
//! history) and returns a [`Transition`] the store applies atomically with
//! the envelope. Nothing here allocates per job beyond the envelope's own
//! bounded history.

use std::time::Duration;

use crate::envelope::{
    AttemptOutcome, AttemptRecord, Envelope, PayloadEdit, payload_sha256, resolve_class,
};
use crate::failure::{DeadLetterReason, Failure, FailureClass};
use crate::ids::WorkerId;
use crate::policy::TypePolicy;
use crate::rng::Entropy;
use crate::state::JobState;
use crate::time::Timestamp;

/// What happened to a leased job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The worker acknowledged it.
    Succeeded,
    /// The worker reported a failure.
    Failed(Failure),
    /// The lease ran out with no ack or fail: the worker died or stalled.
    LeaseExpired,
}

/// What the store must do with the job, in one transaction with the envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transition {
    /// Done: mark it succeeded.
    Succeeded,
    /// Run it again at `at`; `attempt` is the attempt that just failed.
    Retry {
        /// When it becomes ready again.
        at: Timestamp,
        /// The attempt that failed (charged).
        attempt: u32,
    },
    /// Run it again at `until` without charging an attempt.
    Defer {
        /// When it becomes ready again.
        until: Timestamp,
    },
    /// Move it to the dead letters, with the envelope as its metadata.
    DeadLetter {
        /// Why.
        reason: DeadLetterReason,
    },
    /// Mark it cancelled, with no dead letter: it was asked to cancel while
    /// leased and then failed or lost its lease (see [`crate::cancel()`]).
    /// [`decide`] never returns it; [`crate::cancel::settle`] does.
    Cancelled,
}

impl Transition {
    /// How the attempt it ends is recorded in the job's history.
    pub fn outcome(&self) -> AttemptOutcome {
        match self {
            Transition::Succeeded => AttemptOutcome::Succeeded,
            Transition::Retry { .. } => AttemptOutcome::RetryScheduled,
            Transition::Defer { .. } => AttemptOutcome::Deferred,
            Transition::DeadLetter { .. } => AttemptOutcome::DeadLettered,
            Transition::Cancelled => AttemptOutcome::Cancelled,
        }
    }

    /// Its word on a span or in a log line: its attempt outcome's word
    /// (`retry_scheduled`, `dead_lettered`, ...).
    pub fn as_str(&self) -> &'static str {
        self.outcome().as_str()
    }

    /// The state the job is in after the transition, seen at `now`.
    pub fn next_state(self, now: Timestamp) -> JobState {
        match self {
            Transition::Succeeded => JobState::Succeeded,
            Transition::Retry { at, .. } | Transition::Defer { until: at } => {
                if at <= now {
                    JobState::Queued
                } else {
                    JobState::Scheduled
                }
            }
            Transition::DeadLetter { .. } => JobState::DeadLettered,
            Transition::Cancelled => JobState::Cancelled,
        }
    }
}

/// Charges a delivery to the job and records it as running; returns the
/// attempt number the worker sees (1 on the first delivery).
///
/// The caller must not lease a job whose budget is spent; [`decide`] dead-
/// letters a job on the failure that spends it, so such a job is never
/// leasable.
pub fn grant_lease(env: &mut Envelope, worker: Option<&WorkerId>, now: Timestamp) -> u32 {
    env.attempts = env.attempts.saturating_add(1);
    env.push_history(AttemptRecord {
        attempt: env.attempts,
        started_at: now,
        ended_at: None,
        worker_id: worker.cloned(),
        outcome: AttemptOutcome::Running,
        error: None,
    });
    env.attempts
}

/// Decides what happens after `event`, updating the envelope's counters and
/// the running attempt's record.
///
/// Order of the rules (the first that applies wins):
/// 1. success → [`Transition::Succeeded`];
/// 2. lease expiry: the `crash_loop_max`-th expiry → `crash_loop`; it is
///    otherwise a transient failure of kind `lease_expired`;
/// 3. class (the worker's, else the policy's for the kind, else transient):
///    permanent → `permanent`; deferred → [`Transition::Defer`] without
///    charging the attempt for the first `deferrals_max` deferrals, and
///    `deferrals_exhausted` on the one after them;
/// 4. transient: the kind's budget spent → `kind_exhausted`; `attempts_max`
///    spent → `exhausted`; else [`Transition::Retry`] after the backoff (a
///    longer `Retry-After` wins).
pub fn decide(
    env: &mut Envelope,
    policy: &TypePolicy,
    event: Event,
    now: Timestamp,
    rng: &mut impl Entropy,
) -> Transition {
    let expired = matches!(event, Event::LeaseExpired);
    let mut failure = match event {
        Event::Succeeded => {
            record_success(env, now);
            return Transition::Succeeded;
        }
        Event::Failed(failure) => failure,
        Event::LeaseExpired => {
            env.crashes = env.crashes.saturating_add(1);
            Failure::lease_expired()
        }
    };
    failure.truncate_to_caps();
    let class = resolve_class(&failure, |k| policy.class_of_kind(k));
    failure.class = Some(class);

    let transition = match class {
        FailureClass::Permanent => dead_letter(DeadLetterReason::Permanent),
        FailureClass::Deferred => {
            // A deferral is not charged: the next delivery shows the same attempt.
            env.attempts = env.attempts.saturating_sub(1);
            env.deferrals = env.deferrals.saturating_add(1);
            // `deferrals_max` deferrals reschedule; the next dead-letters.
            if env.deferrals > policy.deferrals_max {
                dead_letter(DeadLetterReason::DeferralsExhausted)
            } else {
                let wait = failure
                    .retry_after
                    .unwrap_or_else(|| policy.backoff.delay(env.attempts.max(1), rng));
                Transition::Defer {
                    until: now.saturating_add(wait),
                }
            }
        }
        FailureClass::Transient => {
            let kind_count = env.count_kind_failure(&failure.kind);
            if expired && env.crashes >= policy.crash_loop_max {
                dead_letter(DeadLetterReason::CrashLoop)
            } else if policy
                .kind_budget(&failure.kind)
                .is_some_and(|budget| kind_count >= budget)
            {
                dead_letter(DeadLetterReason::KindExhausted)
            } else if env.attempts >= policy.attempts_max {
                dead_letter(DeadLetterReason::Exhausted)
            } else {
                let mut wait = policy.backoff.delay(env.attempts, rng);
                if let Some(asked) = failure.retry_after {
                    wait = wait.max(asked);
                }
                Transition::Retry {
                    at: now.saturating_add(wait),
                    attempt: env.attempts,
                }
            }
        }
    };

    close_record(env, now, transition.outcome(), Some(failure));
    transition
}

/// Puts a dead-lettered job back in line with a fresh budget, keeping its id,
/// idempotency key and history. Returns the state it re-enters.
pub fn redrive(env: &mut Envelope) -> JobState {
    env.attempts = 0;
    env.deferrals = 0;
    env.crashes = 0;
    env.kind_failures.clear();
    env.redrive_count = env.redrive_count.saturating_add(1);
    JobState::Queued
}

/// An operator's correction of a dead letter's payload, already admitted
/// (byte cap, schema) by the caller.
#[derive(Clone, Copy, Debug)]
pub struct CorrectedPayload<'a> {
    /// The payload it replaces, byte for byte.
    pub previous: &'a [u8],
    /// The corrected payload's raw JSON text.
    pub payload: &'a [u8],
    /// The schema version it was admitted under.
    pub schema_version: Option<u32>,
    /// The token's name.
    pub actor: &'a str,
    /// Why, in the operator's words.
    pub reason: &'a str,
    /// When.
    pub now: Timestamp,
}

/// [`redrive`] with a corrected payload: the envelope describes the new
/// payload (size, SHA-256, schema version) and keeps the one it replaced,
/// with who replaced it, when and why, in `payload_edits`. Id, idempotency
/// key and attempt history stay.
pub fn redrive_corrected(env: &mut Envelope, c: CorrectedPayload<'_>) -> JobState {
    let state = redrive(env);
    let previous_sha256 = std::mem::replace(
        &mut env.payload_sha256,
        hex::encode(payload_sha256(c.payload)),
    );
    let edit = PayloadEdit {
        at: c.now,
        actor: c.actor.to_owned(),
        reason: c.reason.to_owned(),
        redrive: env.redrive_count,
        previous_payload: String::from_utf8_lossy(c.previous).into_owned(),
        previous_size: env.payload_size,
        previous_sha256,
        previous_schema_version: env.schema_version,
    };
    env.push_payload_edit(edit);
    env.payload_size = c.payload.len() as u64;
    env.schema_version = c.schema_version;
    state
}

/// The delay a transition imposes from `now`, for metrics and logs.
pub fn wait_of(transition: Transition, now: Timestamp) -> Duration {
    match transition {
        Transition::Retry { at, .. } | Transition::Defer { until: at } => at.saturating_since(now),
        _ => Duration::ZERO,
    }
}

fn dead_letter(reason: DeadLetterReason) -> Transition {
    Transition::DeadLetter { reason }
}

/// What [`decide`] does with the envelope on success, which it decides
/// without policy or randomness: closes the running attempt as succeeded.
///
/// For stores that write a success as columns and rebuild the envelope when
/// it is read: `grant_lease` then `record_success` gives the same envelope
/// as `grant_lease` then `decide(.., Event::Succeeded, ..)`.
pub fn record_success(env: &mut Envelope, now: Timestamp) {
    close_record(env, now, AttemptOutcome::Succeeded, None);
}

/// Ends the running attempt's record, or appends one when none is running
/// (an outcome for a job whose lease the store granted before history was
/// kept, or a foreign broker's message).
fn close_record(
    env: &mut Envelope,
    now: Timestamp,
    outcome: AttemptOutcome,
    error: Option<Failure>,
) {
    if let Some(record) = env.running_record() {
        record.ended_at = Some(now);
        record.outcome = outcome;
        record.error = error;
        return;
    }
    let attempt = env.attempts;
    env.push_history(AttemptRecord {
        attempt,
        started_at: now,
        ended_at: Some(now),
        worker_id: None,
        outcome,
        error,
    });
}
