//! What a source's runtime shares with whatever runs it: the store, the
//! policies, the breakers and pauses, the metrics. `lazaret serve`'s `App`
//! is one host, so its sources share everything with its queue;
//! [`LocalHost`] is one for library users. [`StoreWrites`] is what the
//! sources of one host know of the store's writes: while it refuses them
//! (a full disk), no source takes a message.

use std::collections::BTreeSet;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lazaret_core::{Breakers, Gate, JobType, Lane, Paused, Policies, Timestamp, TypePolicy};
use lazaret_store::{Completed, SourceDeadLetter, Store, StoreError};

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

    /// Whether the store takes writes, shared by every source of this host
    /// (and, for `lazaret serve`, reported by `/healthz` and `/metrics`).
    /// `None`: each source keeps its own.
    fn store_writes(&self) -> Option<&StoreWrites> {
        None
    }

    /// A source handed a message back to its broker (a nack with requeue,
    /// or its equivalent) because lazaret could not write its outcome and
    /// could hold it no longer (the source is stopping). Each such
    /// hand-back raises the broker's delivery count (a quorum queue's
    /// `x-delivery-count`, which its `x-delivery-limit` counts).
    fn given_back(&self, source: &str) {
        let _ = source;
    }

    /// The broker delivered a message again that it had delivered before
    /// without lazaret's acknowledgement (a consumer that died, a lost
    /// connection, a rebalance, an expired visibility or ack wait: the
    /// broker's own at-least-once). `recognised`: lazaret had written its
    /// outcome already (a dead letter, a held retry) and only acknowledged
    /// it; otherwise it went to the handler again, a possible duplicate.
    fn redelivered(&self, source: &str, recognised: bool) {
        let _ = (source, recognised);
    }
}

/// How long a source waits before it tries a refused store write (or read)
/// again, after `tries` tries that failed: 100 ms, doubling, at most 5 s.
/// Meanwhile the message stays unacknowledged with the source (kept from
/// redelivery by in-progress acks where the broker needs them), never
/// handed back at once.
pub fn store_retry_delay(tries: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << tries.min(6))).min(STORE_RETRY_DELAY_MAX)
}

/// The longest wait between two tries of a refused store write.
pub const STORE_RETRY_DELAY_MAX: Duration = Duration::from_secs(5);

/// How often, at most, a store that keeps refusing writes is logged.
pub const STORE_REFUSED_LOG_EVERY: Duration = Duration::from_secs(10);

/// Whether lazaret's store takes writes, as the sources saw it last: it
/// refuses them from a write that failed (a full disk: SQLite's
/// `SQLITE_FULL`, PostgreSQL's `53100`; an I/O error; a rolled-back
/// transaction) until one succeeds. The source that saw the failure keeps
/// trying its write (with [`store_retry_delay`]), so a store that takes
/// writes again is noticed by itself. Logged when it starts refusing, at
/// most once per [`STORE_REFUSED_LOG_EVERY`] while it goes on, and when it
/// takes writes again; never once per message.
#[derive(Debug, Default)]
pub struct StoreWrites {
    /// A fast look for the common case: nothing refused.
    refusing: AtomicBool,
    state: Mutex<Option<Refusal>>,
    /// When the last "not writable" line went out, whatever refusal it
    /// was for: a nearly full disk flaps (a small write gets through, the
    /// next large one fails again), and each flap is no news.
    last_line: Mutex<Option<Instant>>,
}

#[derive(Debug)]
struct Refusal {
    why: String,
    since: Instant,
    logged: Instant,
    /// Refusals since the last line in the log.
    unlogged: u64,
    /// Began within [`STORE_REFUSED_LOG_EVERY`] of the last line, so
    /// neither it nor its end was logged (yet).
    quiet: bool,
}

impl StoreWrites {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Refusal>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A write of `source` failed with `e`: the store refuses writes.
    pub fn refused(&self, source: &str, e: &StoreError) {
        let now = Instant::now();
        let why = e.to_string();
        let mut state = self.lock();
        match state.as_mut() {
            None => {
                let mut last_line = self.last_line.lock().unwrap_or_else(|p| p.into_inner());
                let quiet =
                    last_line.is_some_and(|at| now.duration_since(at) < STORE_REFUSED_LOG_EVERY);
                if !quiet {
                    tracing::warn!(
                        source,
                        "the store is not writable: {why}; the sources take no new message and keep the outcomes they hold (unacknowledged) until it is, trying again every few seconds; free disk space (or fix the database) and they resume by themselves"
                    );
                    *last_line = Some(now);
                }
                *state = Some(Refusal {
                    why,
                    since: now,
                    logged: last_line.unwrap_or(now),
                    unlogged: u64::from(quiet),
                    quiet,
                });
                self.refusing.store(true, Ordering::Release);
            }
            Some(r) => {
                r.unlogged += 1;
                if now.duration_since(r.logged) >= STORE_REFUSED_LOG_EVERY {
                    r.quiet = false;
                    *self.last_line.lock().unwrap_or_else(|p| p.into_inner()) = Some(now);
                    tracing::warn!(
                        source,
                        "the store is still not writable after {:.0?}: {why} ({} more writes refused since the last line); the sources still hold their messages",
                        now.duration_since(r.since),
                        r.unlogged
                    );
                    r.logged = now;
                    r.unlogged = 0;
                }
                r.why = why;
            }
        }
    }

    /// A write succeeded: the store takes writes (again).
    pub fn wrote(&self) {
        if !self.refusing.load(Ordering::Acquire) {
            return;
        }
        if let Some(r) = self.lock().take() {
            self.refusing.store(false, Ordering::Release);
            // A flap whose refusal went unsaid is not worth a line either.
            if !r.quiet {
                tracing::info!(
                    "the store takes writes again after {:.0?}; the sources resume",
                    r.since.elapsed()
                );
            }
        }
    }

    /// Why the store refuses writes, while it does.
    pub fn refusal(&self) -> Option<String> {
        if !self.refusing.load(Ordering::Acquire) {
            return None;
        }
        self.lock()
            .as_ref()
            .map(|r| format!("the store is not writable: {}", r.why))
    }
}

/// A host of its own, for a library user running sources without
/// `lazaret serve`: a store, policies, and breakers kept in memory.
#[derive(Debug)]
pub struct LocalHost<S> {
    store: S,
    policies: Policies,
    breakers: Mutex<Breakers>,
    writes: StoreWrites,
}

impl<S: Store> LocalHost<S> {
    /// A host with these policies and breakers.
    pub fn new(store: S, policies: Policies, breakers: Breakers) -> LocalHost<S> {
        LocalHost {
            store,
            policies,
            breakers: Mutex::new(breakers),
            writes: StoreWrites::default(),
        }
    }

    /// Asks the gate with this host's breakers: nothing is paused here and
    /// no lane parks (those are `lazaret serve`'s).
    fn gate<T>(&self, f: impl FnOnce(&mut Gate<'_>) -> T) -> T {
        let (paused, park_lanes) = (Paused::default(), BTreeSet::new());
        let mut breakers = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut Gate {
            paused: &paused,
            breakers: &mut breakers,
            park_lanes: &park_lanes,
        })
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

    fn try_deliver(&self, ty: &JobType, lane: &Lane, now: Timestamp) -> Result<(), Duration> {
        self.gate(|g| g.try_deliver(ty, lane, now))
    }

    fn held_back(&self, ty: &JobType, lane: &Lane, now: Timestamp) -> Option<Duration> {
        self.gate(|g| g.held_back(ty, lane, now))
    }

    fn observe(&self, _source: &str, done: &Completed, now: Timestamp) {
        let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        b.observe(
            &done.job_type,
            done.transition,
            done.class,
            done.kind.as_ref(),
            now,
        );
    }

    fn store_writes(&self) -> Option<&StoreWrites> {
        Some(&self.writes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_write_is_tried_again_later_and_later() {
        let delays: Vec<u128> = (0..9).map(|n| store_retry_delay(n).as_millis()).collect();
        assert_eq!(delays, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
        assert_eq!(store_retry_delay(u32::MAX), STORE_RETRY_DELAY_MAX);
    }

    #[test]
    fn a_flapping_store_is_said_once_per_interval() {
        let w = StoreWrites::default();
        let full = StoreError::NotApplied("the commit failed (database or disk is full)".into());
        w.refused("orders", &full);
        let first = w
            .last_line
            .lock()
            .unwrap()
            .expect("the first refusal is said");
        assert!(!w.lock().as_ref().expect("refused").quiet);
        // A small write gets through, the next large one fails again.
        w.wrote();
        w.refused("orders", &full);
        assert!(
            w.lock().as_ref().expect("refused again").quiet,
            "a refusal within the interval of the last line is not said again"
        );
        assert_eq!(w.last_line.lock().unwrap().expect("a line"), first);
        assert!(w.refusal().is_some(), "but /healthz still says it");
    }

    #[test]
    fn writes_are_refused_from_a_failure_until_a_success() {
        let w = StoreWrites::default();
        assert_eq!(w.refusal(), None);
        w.wrote();
        w.refused(
            "orders",
            &StoreError::NotApplied("the commit failed (database or disk is full)".into()),
        );
        let why = w.refusal().expect("refused");
        assert!(why.starts_with("the store is not writable: "), "{why}");
        assert!(why.contains("disk is full"), "{why}");
        w.refused("orders", &StoreError::Overloaded { waiting: 1 });
        assert!(w.refusal().expect("still refused").contains("overloaded"));
        w.wrote();
        assert_eq!(w.refusal(), None);
    }
}
