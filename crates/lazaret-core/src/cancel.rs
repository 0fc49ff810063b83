//! Cancelling a job: what a cancel does in each state, and what the outcome
//! of a leased job becomes once its cancel was requested.
//!
//! A job that waits (`queued`, `scheduled`) is cancelled at once and never
//! leased again. A leased job is running somewhere: lazaret cannot stop the
//! worker, so the cancel is *requested* (the worker sees `cancel_requested`
//! on its heartbeats) and settled at the job's next outcome: an ack stands
//! (the work is done), while a failure or a lease expiry ends the job
//! `cancelled` instead of retrying or dead-lettering it. A finished job
//! (`succeeded`, `dead_lettered`, `cancelled`) cannot be cancelled.
//!
//! The store applies these decisions in one transaction with the job's row
//! and the audit entry; it decides nothing itself.

use crate::decide::Transition;
use crate::envelope::{AttemptOutcome, Envelope};
use crate::state::JobState;

/// What a cancel request does to a job in a given state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelDecision {
    /// Waiting (`queued` or `scheduled`): it becomes `cancelled` now.
    CancelNow,
    /// Leased: the cancel is recorded on the job and settled at its
    /// outcome or lease expiry ([`settle`]).
    Request,
    /// Leased, and its cancel was requested before: nothing changes.
    AlreadyRequested,
    /// Finished: refused (the API's `409 BAD_STATE`), nothing changes.
    Refuse {
        /// The state that refused it.
        state: JobState,
    },
}

impl CancelDecision {
    /// Whether the decision changes the job.
    pub const fn changes_the_job(self) -> bool {
        matches!(self, CancelDecision::CancelNow | CancelDecision::Request)
    }
}

/// Decides a cancel of a job in `state` (`cancel_requested`: whether a
/// cancel of its current lease was requested already).
pub const fn cancel(state: JobState, cancel_requested: bool) -> CancelDecision {
    match state {
        JobState::Queued | JobState::Scheduled => CancelDecision::CancelNow,
        JobState::Leased if cancel_requested => CancelDecision::AlreadyRequested,
        JobState::Leased => CancelDecision::Request,
        JobState::Succeeded | JobState::DeadLettered | JobState::Cancelled => {
            CancelDecision::Refuse { state }
        }
    }
}

/// Settles the transition `decide` chose for a leased job's outcome when a
/// cancel of the job was requested: a success stands; a retry, a deferral
/// or a dead letter becomes [`Transition::Cancelled`] (no dead letter is
/// written), and the attempt's record says `cancelled`. Without a request
/// the transition is returned unchanged.
///
/// Call it right after `decide`, with the envelope `decide` updated.
pub fn settle(env: &mut Envelope, transition: Transition, cancel_requested: bool) -> Transition {
    if !cancel_requested || transition == Transition::Succeeded {
        return transition;
    }
    if let Some(record) = env.history.last_mut() {
        if record.outcome != AttemptOutcome::Running {
            record.outcome = AttemptOutcome::Cancelled;
        }
    }
    Transition::Cancelled
}

#[cfg(test)]
mod tests {
    use std::fmt::Write as _;
    use std::time::Duration;

    use expect_test::expect;

    use super::*;
    use crate::{
        DeadLetterReason, Event, Failure, FailureClass, JobId, SplitMix64, Timestamp, TypePolicy,
        decide, grant_lease,
    };

    #[test]
    fn what_a_cancel_does_in_each_state() {
        let mut table = String::new();
        for state in JobState::ALL {
            for requested in [false, true] {
                if requested && state != JobState::Leased {
                    continue;
                }
                let d = cancel(state, requested);
                writeln!(
                    table,
                    "{:<13} requested={requested:<5} → {d:?} (changes: {})",
                    state.as_str(),
                    d.changes_the_job()
                )
                .unwrap();
            }
        }
        expect![[r#"
            queued        requested=false → CancelNow (changes: true)
            scheduled     requested=false → CancelNow (changes: true)
            leased        requested=false → Request (changes: true)
            leased        requested=true  → AlreadyRequested (changes: false)
            succeeded     requested=false → Refuse { state: Succeeded } (changes: false)
            dead_lettered requested=false → Refuse { state: DeadLettered } (changes: false)
            cancelled     requested=false → Refuse { state: Cancelled } (changes: false)
        "#]]
        .assert_eq(&table);
    }

    #[test]
    fn a_cancel_never_leaves_the_state_machine() {
        for state in JobState::ALL {
            match cancel(state, false) {
                CancelDecision::CancelNow => assert!(state.can_become(JobState::Cancelled)),
                CancelDecision::Request | CancelDecision::AlreadyRequested => {
                    assert_eq!(state, JobState::Leased);
                    assert!(state.can_become(JobState::Cancelled));
                }
                CancelDecision::Refuse { state: s } => {
                    assert_eq!(s, state);
                    assert!(state.is_terminal());
                }
            }
        }
    }

    fn leased_env() -> Envelope {
        let mut env = Envelope::new(
            JobId(7),
            "resize".into(),
            "acme".into(),
            "default".into(),
            b"{}",
            Timestamp::from_millis(0),
        );
        grant_lease(&mut env, None, Timestamp::from_millis(1));
        env
    }

    /// `decide` then `settle`, as the store applies an outcome.
    fn outcome(event: Event, requested: bool) -> (Transition, Envelope) {
        let mut env = leased_env();
        let policy = TypePolicy::default();
        let mut rng = SplitMix64::new(1);
        let now = Timestamp::from_millis(2);
        let t = decide(&mut env, &policy, event, now, &mut rng);
        (settle(&mut env, t, requested), env)
    }

    fn failed(class: FailureClass) -> Event {
        let mut f = Failure::new("http_503", "upstream down").with_class(class);
        f.retry_after = Some(Duration::from_secs(5));
        Event::Failed(f)
    }

    #[test]
    fn an_ack_stands_even_after_a_cancel_was_requested() {
        let (t, env) = outcome(Event::Succeeded, true);
        assert_eq!(t, Transition::Succeeded);
        assert_eq!(env.history[0].outcome, AttemptOutcome::Succeeded);
    }

    #[test]
    fn every_other_outcome_of_a_cancel_requested_job_cancels_it() {
        for event in [
            failed(FailureClass::Transient),
            failed(FailureClass::Deferred),
            failed(FailureClass::Permanent),
            Event::LeaseExpired,
        ] {
            let (t, env) = outcome(event.clone(), true);
            assert_eq!(t, Transition::Cancelled, "{event:?}");
            assert_eq!(t.next_state(Timestamp::from_millis(2)), JobState::Cancelled);
            let record = &env.history[0];
            assert_eq!(record.outcome, AttemptOutcome::Cancelled, "{event:?}");
            assert!(record.error.is_some(), "the failure is kept: {event:?}");
        }
    }

    #[test]
    fn without_a_request_the_outcome_is_decides_own() {
        assert!(matches!(
            outcome(failed(FailureClass::Transient), false).0,
            Transition::Retry { .. }
        ));
        assert!(matches!(
            outcome(failed(FailureClass::Deferred), false).0,
            Transition::Defer { .. }
        ));
        assert_eq!(
            outcome(failed(FailureClass::Permanent), false).0,
            Transition::DeadLetter {
                reason: DeadLetterReason::Permanent
            }
        );
    }
}
