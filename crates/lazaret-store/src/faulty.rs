//! A store that fails on purpose, beside the seam, for tests of what a
//! caller does when its store fails (as redb's fault-injecting backend).
//!
//! [`StoreOn::with_faults`] wraps any store (SQLite, PostgreSQL) in a
//! [`Faulty`] backend, and hands back the [`Faults`] switch: after a
//! countdown of requests to the writer (every write, housekeeping, and
//! `stats`, which both writers answer), each further one fails in one of
//! two ways ([`Fault`]):
//! - [`Fault::NotApplied`]: refused before the writer sees it, as a group
//!   that was rolled back; nothing of it happened.
//! - [`Fault::AnswerLost`]: applied and committed as usual, but its caller
//!   gets an error, as when the connection drops between COMMIT and its
//!   answer: the outcome is ambiguous to the caller.
//! - [`Fault::Slow`]: applied and answered as usual, but slow: the hook
//!   set with [`Faults::on_slow`] runs first (a simulation advances its
//!   fake clock there, so the commit took that long on its clock).
//!
//! Besides the countdown, [`Faults::at_random`] draws a fault for each
//! request from a seed and [`FaultRates`] (what a seeded simulation
//! wants: the same seed, the same faults on the same requests). A
//! countdown that ran out wins over the draw.
//!
//! Reads, what is the backends' own (close, PostgreSQL's events, switches
//! and leadership) and claims of held retries (which PostgreSQL runs on a
//! reader) pass through untouched.

use std::fmt;
use std::sync::{Arc, Mutex};

use lazaret_core::{Entropy, SplitMix64, Timestamp};

use crate::backend::{Backend, StoreOn, forward_reads, with_reads};
use crate::request::{Claim, Request};
use crate::{ClaimedRetry, Duty, StoreError, StoreEvent, Switch, Tick};

/// How a request fails once the countdown ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Not applied: the caller gets [`StoreError::NotApplied`] and nothing
    /// of the request happened.
    NotApplied,
    /// Applied, but the caller gets a [`StoreError::Db`] instead of the
    /// answer (an answer lost after the commit).
    AnswerLost,
    /// Applied and answered as usual, after the hook of
    /// [`Faults::on_slow`] ran (nothing else without one).
    Slow,
}

/// The chances of each fault per write request, in parts per million,
/// for [`Faults::at_random`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultRates {
    /// [`Fault::NotApplied`].
    pub not_applied: u32,
    /// [`Fault::AnswerLost`].
    pub answer_lost: u32,
    /// [`Fault::Slow`].
    pub slow: u32,
}

/// What [`Fault::Slow`] runs.
type SlowHook = Arc<dyn Fn() + Send + Sync>;

#[derive(Default)]
struct State {
    /// Write requests still to pass before faults start; `None`: no faults.
    countdown: Option<u64>,
    fault: Option<Fault>,
    /// Faults drawn for each request, when set.
    random: Option<(SplitMix64, FaultRates)>,
    slow: Option<SlowHook>,
    /// Requests failed (or slowed) so far.
    injected: u64,
}

impl fmt::Debug for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("State")
            .field("countdown", &self.countdown)
            .field("fault", &self.fault)
            .field("random", &self.random.as_ref().map(|r| r.1))
            .field("slow", &self.slow.is_some())
            .field("injected", &self.injected)
            .finish()
    }
}

/// The switch of a faulty store's faults; clones share it.
#[derive(Clone, Debug, Default)]
pub struct Faults(Arc<Mutex<State>>);

impl Faults {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Lets `n` more write requests through, then fails every next one
    /// with `fault` (until [`Faults::heal`] or another countdown).
    pub fn fail_after(&self, n: u64, fault: Fault) {
        let mut s = self.state();
        s.countdown = Some(n);
        s.fault = Some(fault);
    }

    /// Draws a fault for every next write request (that a countdown does
    /// not fail) from `seed` with `rates`, until [`Faults::heal`].
    pub fn at_random(&self, seed: u64, rates: FaultRates) {
        self.state().random = Some((SplitMix64::new(seed), rates));
    }

    /// What a [`Fault::Slow`] request runs before it goes to the writer.
    pub fn on_slow(&self, hook: impl Fn() + Send + Sync + 'static) {
        self.state().slow = Some(Arc::new(hook));
    }

    /// No more faults (the hook of [`Faults::on_slow`] stays).
    pub fn heal(&self) {
        let mut s = self.state();
        s.countdown = None;
        s.fault = None;
        s.random = None;
    }

    /// Requests failed on purpose so far.
    pub fn injected(&self) -> u64 {
        self.state().injected
    }

    /// The fault for the next write request, if it gets one, and the
    /// hook to run for a slow one.
    fn next(&self) -> (Option<Fault>, Option<SlowHook>) {
        let mut s = self.state();
        let counted = match s.countdown {
            None => None,
            Some(0) => s.fault,
            Some(n) => {
                s.countdown = Some(n - 1);
                None
            }
        };
        let fault = counted.or_else(|| {
            let (rng, rates) = s.random.as_mut()?;
            let draw = rng.below_inclusive(999_999);
            let rates = *rates;
            let mut edge = u64::from(rates.not_applied);
            if draw < edge {
                return Some(Fault::NotApplied);
            }
            edge += u64::from(rates.answer_lost);
            if draw < edge {
                return Some(Fault::AnswerLost);
            }
            edge += u64::from(rates.slow);
            (draw < edge).then_some(Fault::Slow)
        });
        if fault.is_some() {
            s.injected += 1;
        }
        let hook = match fault {
            Some(Fault::Slow) => s.slow.clone(),
            _ => None,
        };
        (fault, hook)
    }
}

/// A backend whose write requests fail on purpose ([`Faults`]).
#[derive(Debug)]
pub struct Faulty<B> {
    inner: B,
    faults: Faults,
}

/// A store whose writes fail on purpose: see [`StoreOn::with_faults`].
pub type FaultyStore<B> = StoreOn<Faulty<B>>;

impl<B> StoreOn<B> {
    /// This store, with faults injected as the returned switch says (none
    /// until it is set).
    pub fn with_faults(self) -> (FaultyStore<B>, Faults) {
        let faults = Faults::default();
        let store = StoreOn::new(Faulty {
            inner: self.backend,
            faults: faults.clone(),
        });
        (store, faults)
    }
}

impl<B> FaultyStore<B> {
    /// The switch of this store's faults.
    pub fn faults(&self) -> &Faults {
        &self.backend.faults
    }
}

impl<B: Backend> Backend for Faulty<B> {
    // Reads go through untouched.
    with_reads!(forward_reads, inner);
    fn submit(&self, r: Request) -> Result<(), StoreError> {
        let (fault, slow) = self.faults.next();
        match fault {
            None => self.inner.submit(r),
            Some(Fault::Slow) => {
                if let Some(hook) = slow {
                    hook();
                }
                self.inner.submit(r)
            }
            Some(Fault::NotApplied) => Err(StoreError::NotApplied(
                "a fault injected by the test (the group was not applied)".into(),
            )),
            Some(Fault::AnswerLost) => self.inner.submit(r.lose_answer(
                "a fault injected by the test: the answer was lost after the commit, so the request may have been applied".into(),
            )),
        }
    }

    fn gone(&self) -> StoreError {
        self.inner.gone()
    }

    fn tick_skip(&self, now: Timestamp) -> Option<Tick> {
        self.inner.tick_skip(now)
    }

    fn ticked(&self, now: Timestamp, t: &Tick) {
        self.inner.ticked(now, t);
    }

    async fn signal_readings(
        &self,
        now: Timestamp,
    ) -> Result<crate::signals::Readings, StoreError> {
        self.inner.signal_readings(now).await
    }

    async fn claim_held_retries(&self, claim: Claim) -> Result<Vec<ClaimedRetry>, StoreError> {
        self.inner.claim_held_retries(claim).await
    }

    fn orders_one_job_commands(&self) -> bool {
        self.inner.orders_one_job_commands()
    }

    fn failure(&self) -> Option<String> {
        self.inner.failure()
    }

    fn events(&self) -> Option<tokio::sync::broadcast::Receiver<StoreEvent>> {
        self.inner.events()
    }

    async fn publish(&self, switch: Switch) -> Result<(), StoreError> {
        self.inner.publish(switch).await
    }

    async fn switches(&self) -> Result<Vec<Switch>, StoreError> {
        self.inner.switches().await
    }

    async fn lead(&self, duty: Duty) -> Result<bool, StoreError> {
        self.inner.lead(duty).await
    }

    async fn close(&self) -> Result<(), StoreError> {
        self.inner.close().await
    }
}
