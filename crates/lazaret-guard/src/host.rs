//! What a source's runtime shares with whatever runs it: the store, the
//! policies, the breakers and pauses, the metrics. `lazaret serve`'s `App`
//! is one host, so its sources share everything with its queue;
//! [`LocalHost`] is one for library users.

use std::sync::Mutex;
use std::time::Duration;

use lazaret_core::{
    Breakers, FailureClass, JobType, Lane, Policies, Timestamp, Transition, TypePolicy,
};
use lazaret_store::{Completed, SourceDeadLetter, Store};

/// A source's window on the rest of lazaret.
pub trait Host: Send + Sync + 'static {
    /// The store dead letters and held retries go to.
    type Store: Store;

    /// The store.
    fn store(&self) -> &Self::Store;

    /// The policy that governs `ty`.
    fn policy(&self, ty: &JobType) -> TypePolicy;

    /// `Ok` when one message of `ty` in `lane` may be delivered now (a
    /// half-open breaker's probe is then spent); otherwise how long the type
    /// or lane stays parked (breaker open, paused), at most as a hint.
    fn try_deliver(&self, ty: &JobType, lane: &Lane, now: Timestamp) -> Result<(), Duration>;

    /// `Some(wait)` while `ty` or `lane` is parked (paused, breaker open),
    /// without spending a half-open probe: a message taken from the broker
    /// just before a pause waits here instead of being delivered.
    fn held_back(&self, ty: &JobType, lane: &Lane, now: Timestamp) -> Option<Duration> {
        let _ = (ty, lane, now);
        None
    }

    /// An attempt ended as `done` says (breakers, statistics, metrics).
    /// Called once its outcome is decided, before lazaret writes it (a
    /// held retry, a dead letter) and before the handler slot is given
    /// back, so a breaker this outcome opens stops the next take; the
    /// write may still fail (the message then goes back to the broker).
    fn observe(&self, source: &str, done: &Completed, now: Timestamp);

    /// The outcome [`Host::observe`] saw is written: a dead letter is
    /// durable now and `done.dead_letter` names it (alerts that read the
    /// store look again).
    fn recorded(&self, source: &str, done: &Completed, now: Timestamp) {
        let _ = (source, done, now);
    }

    /// A watch source took in a broker's dead letter.
    fn observe_taken_in(&self, source: &str, dl: &SourceDeadLetter, now: Timestamp) {
        let _ = (source, dl, now);
    }
}

/// A host of its own, for a library user running sources without
/// `lazaret serve`: a store, policies, and breakers kept in memory.
#[derive(Debug)]
pub struct LocalHost<S> {
    store: S,
    policies: Policies,
    breakers: Mutex<Breakers>,
}

impl<S: Store> LocalHost<S> {
    /// A host with these policies and breakers.
    pub fn new(store: S, policies: Policies, breakers: Breakers) -> LocalHost<S> {
        LocalHost {
            store,
            policies,
            breakers: Mutex::new(breakers),
        }
    }

    /// Runs `f` on the breakers (tests and tools look at them).
    pub fn with_breakers<T>(&self, f: impl FnOnce(&mut Breakers) -> T) -> T {
        f(&mut self.breakers.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl<S: Store> Host for LocalHost<S> {
    type Store = S;

    fn store(&self) -> &S {
        &self.store
    }

    fn policy(&self, ty: &JobType) -> TypePolicy {
        self.policies.for_type(ty.as_str()).clone()
    }

    fn try_deliver(&self, ty: &JobType, _lane: &Lane, now: Timestamp) -> Result<(), Duration> {
        let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        try_breakers(&mut b, ty, now)
    }

    fn held_back(&self, ty: &JobType, _lane: &Lane, now: Timestamp) -> Option<Duration> {
        let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        b.parked_until(ty, now)
            .map(|until| until.saturating_since(now))
    }

    fn observe(&self, _source: &str, done: &Completed, now: Timestamp) {
        let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        record(&mut b, done, now);
    }
}

/// [`Host::try_deliver`] as breakers alone decide it.
pub fn try_breakers(b: &mut Breakers, ty: &JobType, now: Timestamp) -> Result<(), Duration> {
    if let Some(until) = b.parked_until(ty, now) {
        return Err(until.saturating_since(now).max(Duration::from_millis(10)));
    }
    if b.try_lease(ty, now) {
        Ok(())
    } else {
        Err(Duration::from_millis(100))
    }
}

/// Feeds one outcome to the breakers, as the server does for its jobs.
pub fn record(b: &mut Breakers, done: &Completed, now: Timestamp) {
    match (done.transition, done.class) {
        (Transition::Succeeded, _) => b.record_success(&done.job_type, now),
        (_, Some(FailureClass::Transient)) => match &done.kind {
            Some(kind) => b.record_failure(&done.job_type, kind, now),
            None => b.record_other(&done.job_type, now),
        },
        _ => b.record_other(&done.job_type, now),
    }
}
