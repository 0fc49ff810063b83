//! Circuit breakers per (job type, error kind): a sick downstream parks its type, burns no retries.
//!
//! A breaker watches one failure kind of one job type (`send_email` ×
//! `http_503`). It is [`Closed`](BreakerState::Closed) while things are fine,
//! [`Open`](BreakerState::Open) when that kind dominates the type's recent
//! outcomes, and [`HalfOpen`](BreakerState::HalfOpen) once a cooldown has
//! passed, letting a few probe leases find out whether the downstream is back.
//! While any breaker of a type is open, the whole type is *parked*: its jobs
//! wait in the queue (spending no attempt) and admission sheds new ones.
//!
//! ```text
//!          ≥ failures_min failures of the kind, ≥ failure_ratio of all outcomes
//!   Closed ──────────────────────────────────────────────────────────▶ Open
//!     ▲                                                            │   ▲
//!     │                                              now ≥ until   │   │ a failure of
//!     │ a success of the type                                      ▼   │ this kind
//!     └──────────────────────────────────────────────────────── HalfOpen ──┐
//!       a success of the type, or a whole       no probe answered within a ▲ │
//!       cooldown in which no probe was leased   cooldown: probe slots are  └─┘
//!       (nothing of the type left to probe)     handed out again
//! ```
//!
//! Everything here is a pure function of the calls made and the `now` passed
//! in: no clock, no randomness, no I/O.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::decide::Transition;
use crate::failure::FailureClass;
use crate::ids::{ErrorKind, JobType};
use crate::time::{Timestamp, duration_ms};

/// Buckets in a sliding window; each covers `window / WINDOW_BUCKETS`.
///
/// The window therefore looks back between nine and ten bucket widths (the
/// current, partly elapsed bucket plus nine whole ones): with the default
/// 30 s window, between 27 s and 30 s.
pub const WINDOW_BUCKETS: usize = 10;

/// Failure kinds tracked per type; a worker chooses kind names, so they are bounded.
///
/// When a new kind arrives at the cap, closed breakers with no failure left
/// in their window are forgotten first; if none is idle, the new kind gets no
/// breaker (its failures still count as outcomes of the type).
pub const KINDS_PER_TYPE_MAX: usize = 64;

/// Transitions kept for [`Breakers::poll_transition`]; beyond this the oldest is dropped.
pub const TRANSITIONS_MAX: usize = 1024;

/// The smallest `Retry-After` a shed answers with: clients should not spin.
pub const SHED_RETRY_AFTER_MIN: Duration = Duration::from_secs(1);

/// One type's breaker settings (`[types.X.breaker]` in the config file).
///
/// Call [`validate`](BreakerConfig::validate) when loading a config.
/// [`Breakers`] does not panic on an invalid one, but it is not meaningful:
/// zero durations act as 1 ms and zero probes as one.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BreakerConfig {
    /// Failures of one kind within the window before its breaker may open.
    pub failures_min: u32,
    /// And the share of the type's outcomes in the window that must be
    /// failures of that kind, in (0, 1].
    pub failure_ratio: f64,
    /// How far back failures and outcomes are counted.
    #[serde(with = "ms", rename = "window_ms")]
    pub window: Duration,
    /// How long a breaker stays open before it lets probes through; also how
    /// long a half-open breaker waits for a probe's outcome before handing
    /// out probe slots again.
    #[serde(with = "ms", rename = "cooldown_ms")]
    pub cooldown: Duration,
    /// Leases let through per half-open period.
    pub probes: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            failures_min: 20,
            failure_ratio: 0.5,
            window: Duration::from_secs(30),
            cooldown: Duration::from_secs(10),
            probes: 2,
        }
    }
}

/// A breaker setting out of its allowed range.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("breaker.{field} = {value} is out of range: it must be {allowed}")]
pub struct BreakerConfigError {
    /// The setting, as spelled in the config file (`window_ms`).
    pub field: &'static str,
    /// The value given, as text.
    pub value: String,
    /// The allowed range, in words.
    pub allowed: &'static str,
}

impl BreakerConfig {
    /// Checks every setting against its allowed range; the error names the first bad one.
    pub fn validate(&self) -> Result<(), BreakerConfigError> {
        let bad = |field, value: String, allowed| {
            Err(BreakerConfigError {
                field,
                value,
                allowed,
            })
        };
        if self.failures_min == 0 {
            return bad("failures_min", "0".into(), "at least 1");
        }
        // Written so that NaN fails too.
        if !(self.failure_ratio > 0.0 && self.failure_ratio <= 1.0) {
            return bad("failure_ratio", self.failure_ratio.to_string(), "in (0, 1]");
        }
        if self.window.as_millis() == 0 {
            return bad("window_ms", ms_text(self.window), "at least 1 (ms)");
        }
        if self.cooldown.as_millis() == 0 {
            return bad("cooldown_ms", ms_text(self.cooldown), "at least 1 (ms)");
        }
        if self.probes == 0 {
            return bad("probes", "0".into(), "at least 1");
        }
        Ok(())
    }
}

/// A duration under 1 ms, as the config's milliseconds would show it.
fn ms_text(d: Duration) -> String {
    if d.is_zero() {
        "0".to_owned()
    } else {
        format!("{} (under 1 ms)", d.as_secs_f64() * 1000.0)
    }
}

/// Where one breaker is. The words are those of `GET /v1/breakers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BreakerState {
    /// Leases and admission go on as usual.
    Closed,
    /// The type is parked until `until`, when the breaker turns half-open.
    Open {
        /// When the cooldown ends.
        until: Timestamp,
    },
    /// Probe leases may go through; the type is parked once none is left.
    HalfOpen {
        /// Leases that may still go through in this half-open period.
        probes_left: u32,
    },
}

impl BreakerState {
    /// The word used in the API: `closed`, `open` or `half_open`.
    pub const fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open { .. } => "open",
            BreakerState::HalfOpen { .. } => "half_open",
        }
    }

    /// The `until` of the API: when an open breaker turns half-open, else `None`.
    pub const fn until(self) -> Option<Timestamp> {
        match self {
            BreakerState::Open { until } => Some(until),
            _ => None,
        }
    }

    /// Whether `self → to` is an edge of the breaker's state machine.
    ///
    /// `HalfOpen → HalfOpen` is the refill of probe slots after a cooldown
    /// in which no probe answered (lost workers); nothing else loops.
    pub const fn can_become(self, to: BreakerState) -> bool {
        use BreakerState::*;
        matches!(
            (self, to),
            (Closed, Open { .. })
                | (Open { .. }, HalfOpen { .. })
                | (HalfOpen { .. }, Closed)
                | (HalfOpen { .. }, Open { .. })
                | (HalfOpen { .. }, HalfOpen { .. })
        )
    }
}

impl fmt::Display for BreakerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BreakerState::Closed => f.write_str("closed"),
            BreakerState::Open { until } => write!(f, "open until {until}"),
            BreakerState::HalfOpen { probes_left: 1 } => f.write_str("half_open, 1 probe left"),
            BreakerState::HalfOpen { probes_left } => {
                write!(f, "half_open, {probes_left} probes left")
            }
        }
    }
}

/// Leases of one type reserved by [`Breakers::reserve_leases`]; hand it
/// back with [`Breakers::refund`] once they are taken.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use = "unused probe slots stay spent until the reservation is refunded"]
pub struct LeaseReservation {
    ty: JobType,
    granted: u32,
    limited: bool,
    /// The half-open breakers it spent slots of, with their period's end.
    periods: Vec<(ErrorKind, Timestamp)>,
}

impl LeaseReservation {
    /// The type reserved.
    pub fn job_type(&self) -> &JobType {
        &self.ty
    }

    /// How many leases may be taken: all that were asked for unless
    /// [`limited`](Self::limited).
    pub fn granted(&self) -> u32 {
        self.granted
    }

    /// Whether a breaker limits the type now (parked, or half-open and
    /// letting only probes through); an unlimited reservation need not be
    /// refunded.
    pub fn limited(&self) -> bool {
        self.limited
    }
}

/// One non-closed breaker, as `GET /v1/breakers` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BreakerView {
    /// The job type it parks.
    pub ty: JobType,
    /// The failure kind it watches.
    pub kind: ErrorKind,
    /// Where it is now.
    pub state: BreakerState,
}

/// A state change of one breaker, for logs and metrics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BreakerTransition {
    /// The job type.
    pub ty: JobType,
    /// The failure kind.
    pub kind: ErrorKind,
    /// The state before.
    pub from: BreakerState,
    /// The state after; `from.can_become(to)` always holds.
    pub to: BreakerState,
    /// When it happened. For changes the clock makes (open → half-open, a
    /// refill of probe slots) this is the instant it became due, which may
    /// be earlier than the `now` of the call that noticed it.
    pub at: Timestamp,
}

/// Every breaker of a runtime: per (type, kind), with a per-type outcome window.
///
/// How to drive it, in the words of the crate's style:
///
/// - **Inputs** — [`observe`](Self::observe): one call per finished
///   attempt, with what the core decided of it; it applies the one mapping
///   every runtime uses (the server's jobs and the guard's broker messages)
///   onto [`record_success`](Self::record_success),
///   [`record_failure`](Self::record_failure) and
///   [`record_other`](Self::record_other): an ack is a success; a
///   *transient* failure of kind K (whether it is retried or dead-lettered on
///   an exhausted budget) and a lease expiry (kind `lease_expired`) are
///   failures of K; a *permanent* failure and a *deferral* are "other": they
///   count among the type's outcomes for the ratio but never trip a breaker
///   (a poison payload is not a sick downstream, and a deferral already
///   waits). A job rejected at admission never ran and is not recorded.
/// - **Mutator** — [`try_lease`](Self::try_lease): ask once per lease of the
///   type, just before handing it out. It refuses while the type is parked,
///   and spends a probe slot while a breaker is half-open. A caller that
///   leases many jobs at once, or runs many leases concurrently, reserves
///   instead: [`reserve_leases`](Self::reserve_leases) before leasing, then
///   [`refund`](Self::refund) what it did not use, so probes never exceed
///   `probes` however many leases run at once.
/// - **Getters** — [`parked_until`](Self::parked_until) (skip a parked type
///   when picking work), [`shed_retry_after`](Self::shed_retry_after)
///   (admission), [`state`](Self::state), [`snapshot`](Self::snapshot). They
///   take `&mut self` because passing time may turn an open breaker half-open.
/// - **Output** — [`poll_transition`](Self::poll_transition): drain after
///   each call (or batch of calls) to log and count state changes.
///
/// Time never runs backwards here: a `now` earlier than one already seen is
/// taken as the latest one seen, so a stepped-back wall clock cannot reopen
/// a window or shorten a cooldown. Parking spends no attempt; not leasing a
/// parked type's jobs (and rescheduling none of them) is the caller's part.
///
/// A breaker cannot tell a probe's outcome from that of a job leased before
/// it opened: an old job finishing while half-open counts as the probe.
#[derive(Clone, Debug)]
pub struct Breakers {
    default: Option<BreakerConfig>,
    per_type: BTreeMap<JobType, BreakerConfig>,
    types: BTreeMap<JobType, TypeBreakers>,
    latest: Timestamp,
    log: TransitionLog,
}

impl Breakers {
    /// Breakers with `per_type` settings, and `default` for every other type
    /// (`None`: types without settings have no breaker and are never parked).
    pub fn new(default: Option<BreakerConfig>, per_type: BTreeMap<JobType, BreakerConfig>) -> Self {
        Breakers {
            default,
            per_type,
            types: BTreeMap::new(),
            latest: Timestamp::from_millis(i64::MIN),
            log: TransitionLog::default(),
        }
    }

    /// The settings that apply to `ty`, if it has a breaker at all.
    pub fn config(&self, ty: &JobType) -> Option<&BreakerConfig> {
        self.per_type.get(ty).or(self.default.as_ref())
    }

    /// An attempt of `ty` succeeded: closes its half-open breakers.
    pub fn record_success(&mut self, ty: &JobType, now: Timestamp) {
        let now = self.see(now);
        let Some((tb, log)) = self.type_entry(ty) else {
            return;
        };
        tb.advance(ty, now, log);
        tb.outcomes.add(tb.epoch(now));
        for (kind, kb) in &mut tb.kinds {
            if let Phase::HalfOpen { .. } = kb.phase {
                let from = kb.public_state();
                kb.phase = Phase::Closed;
                // What tripped it is over; start counting afresh.
                kb.failures.clear();
                log.push(ty, kind, from, BreakerState::Closed, now);
            }
        }
    }

    /// An attempt of `ty` failed with `kind` (in a way that should count; see
    /// the type's docs): may open `kind`'s breaker, or reopen it if half-open.
    pub fn record_failure(&mut self, ty: &JobType, kind: &ErrorKind, now: Timestamp) {
        let now = self.see(now);
        let Some((tb, log)) = self.type_entry(ty) else {
            return;
        };
        tb.advance(ty, now, log);
        let epoch = tb.epoch(now);
        tb.outcomes.add(epoch);
        let outcomes = tb.outcomes.sum(epoch);
        let (config, cooldown_ms) = (tb.config, tb.cooldown_ms);
        let Some(kb) = tb.kind_entry(kind, epoch) else {
            return;
        };
        kb.failures.add(epoch);
        let reopen = match kb.phase {
            Phase::Closed => {
                let failures = kb.failures.sum(epoch);
                failures >= config.failures_min
                    && f64::from(failures) >= config.failure_ratio * f64::from(outcomes)
            }
            Phase::HalfOpen { .. } => true,
            // A job leased before it opened; the cooldown stands.
            Phase::Open { .. } => false,
        };
        if reopen {
            let from = kb.public_state();
            let until = add_ms(now, cooldown_ms);
            kb.phase = Phase::Open { until };
            log.push(ty, kind, from, BreakerState::Open { until }, now);
        }
    }

    /// An attempt of `ty` ended in a way that counts among its outcomes but
    /// says nothing about its downstream (a permanent failure, a deferral).
    pub fn record_other(&mut self, ty: &JobType, now: Timestamp) {
        let now = self.see(now);
        let Some((tb, log)) = self.type_entry(ty) else {
            return;
        };
        tb.advance(ty, now, log);
        tb.outcomes.add(tb.epoch(now));
    }

    /// An attempt of `ty` ended: `transition` is what the core decided of
    /// it, `class` and `kind` the failure's, if it failed. The one rule that
    /// feeds breakers from outcomes:
    ///
    /// - a success is [`record_success`](Self::record_success);
    /// - a *transient* failure of kind K is
    ///   [`record_failure`](Self::record_failure) of K, whatever became of
    ///   the job (retried, dead-lettered on an exhausted budget, cancelled);
    /// - everything else is [`record_other`](Self::record_other): a
    ///   permanent failure, a deferral, and a transient failure whose kind
    ///   is not known. That last one still ran and failed, so it counts
    ///   among the type's outcomes (leaving it out would make the other
    ///   kinds' share look larger than it is), but no breaker can be blamed.
    pub fn observe(
        &mut self,
        ty: &JobType,
        transition: Transition,
        class: Option<FailureClass>,
        kind: Option<&ErrorKind>,
        now: Timestamp,
    ) {
        match (transition, class, kind) {
            (Transition::Succeeded, _, _) => self.record_success(ty, now),
            (_, Some(FailureClass::Transient), Some(kind)) => self.record_failure(ty, kind, now),
            _ => self.record_other(ty, now),
        }
    }

    /// Another node of a cluster opened (`ty`, `kind`) until `until`: this
    /// breaker opens too (closed or half-open → open; an open one keeps
    /// the later end), so this node sheds, parks and later half-opens with
    /// its own probe slots as if the breaker had tripped here. An end
    /// already past changes nothing, and a type without breaker settings
    /// has none to open (every node of a cluster has the same settings).
    /// Whether anything changed.
    pub fn open_elsewhere(
        &mut self,
        ty: &JobType,
        kind: &ErrorKind,
        until: Timestamp,
        now: Timestamp,
    ) -> bool {
        let now = self.see(now);
        if until <= now {
            return false;
        }
        let Some((tb, log)) = self.type_entry(ty) else {
            return false;
        };
        tb.advance(ty, now, log);
        let epoch = tb.epoch(now);
        let Some(kb) = tb.kind_entry(kind, epoch) else {
            return false;
        };
        match kb.phase {
            Phase::Open { until: end } => {
                if until > end {
                    kb.phase = Phase::Open { until };
                }
                until > end
            }
            Phase::Closed | Phase::HalfOpen { .. } => {
                let from = kb.public_state();
                kb.phase = Phase::Open { until };
                log.push(ty, kind, from, BreakerState::Open { until }, now);
                true
            }
        }
    }

    /// Another node of a cluster closed (`ty`, `kind`) (a probe succeeded
    /// there): this breaker closes too and counts afresh. An open one goes
    /// through half-open on the way (the state machine has no open →
    /// closed edge). Whether anything changed.
    pub fn close_elsewhere(&mut self, ty: &JobType, kind: &ErrorKind, now: Timestamp) -> bool {
        let now = self.see(now);
        let Some(tb) = self.types.get_mut(ty) else {
            return false;
        };
        tb.advance(ty, now, &mut self.log);
        let probes = tb.probes;
        let Some(kb) = tb.kinds.get_mut(kind) else {
            return false;
        };
        if kb.phase == Phase::Closed {
            return false;
        }
        if let Phase::Open { .. } = kb.phase {
            let to = BreakerState::HalfOpen {
                probes_left: probes,
            };
            self.log.push(ty, kind, kb.public_state(), to, now);
            kb.phase = Phase::HalfOpen {
                probes_left: probes,
                period_end: now,
            };
        }
        self.log
            .push(ty, kind, kb.public_state(), BreakerState::Closed, now);
        kb.phase = Phase::Closed;
        kb.failures.clear();
        true
    }

    /// Whether one job of `ty` may be leased now; when it may and a breaker
    /// is half-open, the lease is a probe and spends one slot of each
    /// half-open breaker of the type.
    pub fn try_lease(&mut self, ty: &JobType, now: Timestamp) -> bool {
        let now = self.see(now);
        let Some(tb) = self.types.get_mut(ty) else {
            return true;
        };
        tb.advance(ty, now, &mut self.log);
        if tb.hold_until().is_some() {
            return false;
        }
        for kb in tb.kinds.values_mut() {
            if let Phase::HalfOpen { probes_left, .. } = &mut kb.phase {
                *probes_left -= 1;
            }
        }
        true
    }

    /// Reserves up to `want` leases of `ty` *before* they are taken, for a
    /// caller that cannot ask [`try_lease`](Self::try_lease) one job at a
    /// time (a store leasing a batch, many requests leasing at once).
    ///
    /// While the type is parked the reservation is of none; while a breaker
    /// is half-open it takes up to what is left of the probe slots (spending
    /// them now, so concurrent reservations never add up past `probes`);
    /// otherwise it is unlimited and grants all of `want`. Hand the
    /// reservation back with [`refund`](Self::refund) once the leases are
    /// taken, saying how many were used: the unused slots return.
    pub fn reserve_leases(&mut self, ty: &JobType, want: u32, now: Timestamp) -> LeaseReservation {
        let now = self.see(now);
        let unlimited = LeaseReservation {
            ty: ty.clone(),
            granted: want,
            limited: false,
            periods: Vec::new(),
        };
        let Some(tb) = self.types.get_mut(ty) else {
            return unlimited;
        };
        tb.advance(ty, now, &mut self.log);
        if tb.hold_until().is_some() {
            return LeaseReservation {
                granted: 0,
                limited: true,
                ..unlimited
            };
        }
        let left = tb
            .kinds
            .values()
            .filter_map(|kb| match kb.phase {
                Phase::HalfOpen { probes_left, .. } => Some(probes_left),
                _ => None,
            })
            .min();
        let Some(left) = left else {
            return unlimited;
        };
        let granted = want.min(left);
        let mut periods = Vec::new();
        for (kind, kb) in &mut tb.kinds {
            if let Phase::HalfOpen {
                probes_left,
                period_end,
            } = &mut kb.phase
            {
                *probes_left -= granted;
                periods.push((kind.clone(), *period_end));
            }
        }
        LeaseReservation {
            granted,
            limited: true,
            periods,
            ..unlimited
        }
    }

    /// Returns what a [`reserve_leases`](Self::reserve_leases) reservation
    /// did not use: `used` of its leases were taken, the other probe slots
    /// go back to the breakers that gave them, as long as those are still
    /// in the same half-open period (a breaker since closed, reopened or
    /// refilled owes nothing back).
    pub fn refund(&mut self, reservation: LeaseReservation, used: u32) {
        let unused = reservation.granted.saturating_sub(used);
        if unused == 0 || reservation.periods.is_empty() {
            return;
        }
        let Some(tb) = self.types.get_mut(&reservation.ty) else {
            return;
        };
        let probes = tb.probes;
        for (kind, period) in &reservation.periods {
            let Some(kb) = tb.kinds.get_mut(kind) else {
                continue;
            };
            if let Phase::HalfOpen {
                probes_left,
                period_end,
            } = &mut kb.phase
            {
                if period_end == period {
                    *probes_left = probes_left.saturating_add(unused).min(probes);
                }
            }
        }
    }

    /// `Some(t)` while `ty` is parked: a breaker is open, or half-open with
    /// no probe slot left, so none of its jobs may be leased.
    ///
    /// `t` is when the clock alone may unpark it (every open breaker turned
    /// half-open, every spent half-open one refilled); a probe's success may
    /// unpark it sooner. `None` does not promise a lease: ask
    /// [`try_lease`](Self::try_lease) for each one.
    pub fn parked_until(&mut self, ty: &JobType, now: Timestamp) -> Option<Timestamp> {
        let now = self.see(now);
        let tb = self.types.get_mut(ty)?;
        tb.advance(ty, now, &mut self.log);
        tb.hold_until()
    }

    /// `Some(retry_after)` when admission must answer `SHED` for `ty`: while
    /// any of its breakers is open or half-open (half-open admits like open
    /// and only lets probes through, as the API contract says).
    ///
    /// The `Retry-After` is the time until the clock alone changes the last
    /// of those breakers (open → half-open, or the end of the current
    /// half-open period), and at least [`SHED_RETRY_AFTER_MIN`].
    pub fn shed_retry_after(&mut self, ty: &JobType, now: Timestamp) -> Option<Duration> {
        let now = self.see(now);
        let tb = self.types.get_mut(ty)?;
        tb.advance(ty, now, &mut self.log);
        let next = tb
            .kinds
            .values()
            .filter_map(|kb| match kb.phase {
                Phase::Closed => None,
                Phase::Open { until } => Some(until),
                Phase::HalfOpen { period_end, .. } => Some(period_end),
            })
            .max()?;
        Some(next.saturating_since(now).max(SHED_RETRY_AFTER_MIN))
    }

    /// The state of the breaker of (`ty`, `kind`); `Closed` if it has none.
    pub fn state(&mut self, ty: &JobType, kind: &ErrorKind, now: Timestamp) -> BreakerState {
        let now = self.see(now);
        let Some(tb) = self.types.get_mut(ty) else {
            return BreakerState::Closed;
        };
        tb.advance(ty, now, &mut self.log);
        tb.kinds
            .get(kind)
            .map_or(BreakerState::Closed, KindBreaker::public_state)
    }

    /// Every breaker that is not closed, ordered by type then kind.
    pub fn snapshot(&mut self, now: Timestamp) -> Vec<BreakerView> {
        let now = self.see(now);
        let mut views = Vec::new();
        for (ty, tb) in &mut self.types {
            tb.advance(ty, now, &mut self.log);
            for (kind, kb) in &tb.kinds {
                let state = kb.public_state();
                if state != BreakerState::Closed {
                    views.push(BreakerView {
                        ty: ty.clone(),
                        kind: kind.clone(),
                        state,
                    });
                }
            }
        }
        views
    }

    /// The oldest state change not yet taken, if any.
    pub fn poll_transition(&mut self) -> Option<BreakerTransition> {
        self.log.queue.pop_front()
    }

    /// How many transitions were dropped because nobody polled them in time
    /// (more than [`TRANSITIONS_MAX`] waiting).
    pub fn transitions_dropped(&self) -> u64 {
        self.log.dropped
    }

    /// `now`, or the latest `now` seen if that is later: time never runs backwards.
    fn see(&mut self, now: Timestamp) -> Timestamp {
        self.latest = self.latest.max(now);
        self.latest
    }

    /// The type's breakers, created on its first outcome if it has settings.
    fn type_entry(&mut self, ty: &JobType) -> Option<(&mut TypeBreakers, &mut TransitionLog)> {
        if !self.types.contains_key(ty) {
            let config = *self.config(ty)?;
            self.types.insert(ty.clone(), TypeBreakers::new(config));
        }
        Some((self.types.get_mut(ty)?, &mut self.log))
    }
}

#[derive(Clone, Debug, Default)]
struct TransitionLog {
    queue: VecDeque<BreakerTransition>,
    dropped: u64,
}

impl TransitionLog {
    fn push(
        &mut self,
        ty: &JobType,
        kind: &ErrorKind,
        from: BreakerState,
        to: BreakerState,
        at: Timestamp,
    ) {
        debug_assert!(from.can_become(to), "{from:?} → {to:?}");
        if self.queue.len() >= TRANSITIONS_MAX {
            self.queue.pop_front();
            self.dropped = self.dropped.saturating_add(1);
        }
        self.queue.push_back(BreakerTransition {
            ty: ty.clone(),
            kind: kind.clone(),
            from,
            to,
            at,
        });
    }
}

/// One type's breakers and the window of all its outcomes.
#[derive(Clone, Debug)]
struct TypeBreakers {
    config: BreakerConfig,
    bucket_ms: i64,
    cooldown_ms: i64,
    probes: u32,
    outcomes: Window,
    kinds: BTreeMap<ErrorKind, KindBreaker>,
}

impl TypeBreakers {
    fn new(config: BreakerConfig) -> Self {
        let window_ms = duration_ms(config.window).max(1);
        // ≤ u64::MAX / 10, so it fits an i64.
        let bucket_ms = window_ms.div_ceil(WINDOW_BUCKETS as u64) as i64;
        let cooldown_ms = i64::try_from(duration_ms(config.cooldown))
            .unwrap_or(i64::MAX)
            .max(1);
        TypeBreakers {
            config,
            bucket_ms,
            cooldown_ms,
            probes: config.probes.max(1),
            outcomes: Window::default(),
            kinds: BTreeMap::new(),
        }
    }

    fn epoch(&self, now: Timestamp) -> i64 {
        now.as_millis().div_euclid(self.bucket_ms)
    }

    /// Lets the clock act: open → half-open at `until`, and a half-open
    /// breaker whose period ended gets its probe slots back.
    fn advance(&mut self, ty: &JobType, now: Timestamp, log: &mut TransitionLog) {
        for (kind, kb) in &mut self.kinds {
            if let Phase::Open { until } = kb.phase {
                if now >= until {
                    let from = kb.public_state();
                    kb.phase = Phase::HalfOpen {
                        probes_left: self.probes,
                        period_end: add_ms(until, self.cooldown_ms),
                    };
                    log.push(ty, kind, from, kb.public_state(), until);
                }
            }
            let Phase::HalfOpen {
                probes_left,
                period_end,
            } = &mut kb.phase
            else {
                continue;
            };
            if now < *period_end {
                continue;
            }
            // The period in which `now` falls, counted from the first one, so
            // that the answer does not depend on how often we are asked.
            let cd = i128::from(self.cooldown_ms);
            let start = i128::from(period_end.as_millis());
            let passed = (i128::from(now.as_millis()) - start) / cd;
            let probed = *probes_left < self.probes;
            if probed && passed == 0 {
                // Probes went out and none answered: their slots again.
                let from = BreakerState::HalfOpen {
                    probes_left: *probes_left,
                };
                *probes_left = self.probes;
                *period_end = clamp_ms(start + cd);
                let to = BreakerState::HalfOpen {
                    probes_left: self.probes,
                };
                log.push(ty, kind, from, to, clamp_ms(start));
                continue;
            }
            // A whole period went by without a probe leased (every lease
            // asks the clock first, so none came since): no job of the type
            // is there to probe with (its last ones dead-lettered, and
            // admission sheds new ones while half-open). Staying half-open
            // would shed the type for good; it closes, and the next outcomes
            // decide afresh.
            let mut at = start;
            if probed {
                log.push(
                    ty,
                    kind,
                    BreakerState::HalfOpen {
                        probes_left: *probes_left,
                    },
                    BreakerState::HalfOpen {
                        probes_left: self.probes,
                    },
                    clamp_ms(start),
                );
                at += cd;
            }
            let at = clamp_ms(at);
            let from = BreakerState::HalfOpen {
                probes_left: self.probes,
            };
            kb.phase = Phase::Closed;
            kb.failures.clear();
            log.push(ty, kind, from, BreakerState::Closed, at);
        }
    }

    /// When the last breaker that holds leases lets go by the clock alone.
    fn hold_until(&self) -> Option<Timestamp> {
        self.kinds
            .values()
            .filter_map(|kb| match kb.phase {
                Phase::Open { until } => Some(until),
                Phase::HalfOpen {
                    probes_left: 0,
                    period_end,
                } => Some(period_end),
                _ => None,
            })
            .max()
    }

    /// The breaker of `kind`, created on its first failure if under the cap.
    fn kind_entry(&mut self, kind: &ErrorKind, epoch: i64) -> Option<&mut KindBreaker> {
        if !self.kinds.contains_key(kind) {
            if self.kinds.len() >= KINDS_PER_TYPE_MAX {
                self.kinds
                    .retain(|_, kb| kb.phase != Phase::Closed || kb.failures.sum(epoch) > 0);
            }
            if self.kinds.len() >= KINDS_PER_TYPE_MAX {
                return None;
            }
            self.kinds.insert(
                kind.clone(),
                KindBreaker {
                    failures: Window::default(),
                    phase: Phase::Closed,
                },
            );
        }
        self.kinds.get_mut(kind)
    }
}

#[derive(Clone, Debug)]
struct KindBreaker {
    failures: Window,
    phase: Phase,
}

impl KindBreaker {
    fn public_state(&self) -> BreakerState {
        match self.phase {
            Phase::Closed => BreakerState::Closed,
            Phase::Open { until } => BreakerState::Open { until },
            Phase::HalfOpen { probes_left, .. } => BreakerState::HalfOpen { probes_left },
        }
    }
}

/// [`BreakerState`] plus what only the breaker needs to know.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Closed,
    Open {
        until: Timestamp,
    },
    HalfOpen {
        probes_left: u32,
        /// When unanswered probes are given up on and slots handed out again.
        period_end: Timestamp,
    },
}

/// A count per bucket of time, fixed memory however many events.
#[derive(Clone, Copy, Debug)]
struct Window {
    buckets: [Bucket; WINDOW_BUCKETS],
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    /// Which bucket-width slice of time this count is for.
    epoch: i64,
    count: u32,
}

impl Default for Window {
    fn default() -> Self {
        Window {
            buckets: [Bucket {
                epoch: i64::MIN,
                count: 0,
            }; WINDOW_BUCKETS],
        }
    }
}

impl Window {
    fn slot(epoch: i64) -> usize {
        epoch.rem_euclid(WINDOW_BUCKETS as i64) as usize
    }

    /// Counts one event in `epoch`, the latest epoch seen (time never runs backwards).
    fn add(&mut self, epoch: i64) {
        let b = &mut self.buckets[Self::slot(epoch)];
        if b.epoch != epoch {
            *b = Bucket { epoch, count: 0 };
        }
        b.count = b.count.saturating_add(1);
    }

    /// Events in the window that ends with `epoch`.
    fn sum(&self, epoch: i64) -> u32 {
        let oldest = epoch.saturating_sub(WINDOW_BUCKETS as i64 - 1);
        self.buckets
            .iter()
            .filter(|b| (oldest..=epoch).contains(&b.epoch))
            .fold(0u32, |n, b| n.saturating_add(b.count))
    }

    fn clear(&mut self) {
        *self = Window::default();
    }
}

fn add_ms(t: Timestamp, ms: i64) -> Timestamp {
    Timestamp::from_millis(t.as_millis().saturating_add(ms))
}

fn clamp_ms(ms: i128) -> Timestamp {
    Timestamp::from_millis(ms.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64)
}

/// A `Duration` as integer milliseconds, the unit of the config file.
mod ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(crate::time::duration_ms(*d))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn ty() -> JobType {
        JobType::new("send_email")
    }

    fn k503() -> ErrorKind {
        ErrorKind::new("http_503")
    }

    /// min 5 failures, ratio 0.5, window 10 s, cooldown 5 s, 2 probes.
    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failures_min: 5,
            failure_ratio: 0.5,
            window: Duration::from_secs(10),
            cooldown: Duration::from_secs(5),
            probes: 2,
        }
    }

    fn breakers(config: BreakerConfig) -> Breakers {
        Breakers::new(None, BTreeMap::from([(ty(), config)]))
    }

    /// Trips `send_email`/`http_503` at `at` with exactly `failures_min` failures.
    fn open_at(b: &mut Breakers, at: Timestamp) {
        for _ in 0..cfg().failures_min {
            b.record_failure(&ty(), &k503(), at);
        }
        assert_eq!(
            b.state(&ty(), &k503(), at),
            BreakerState::Open {
                until: add_ms(at, 5_000)
            }
        );
    }

    fn transitions(b: &mut Breakers) -> Vec<(BreakerState, BreakerState, Timestamp)> {
        std::iter::from_fn(|| b.poll_transition())
            .map(|tr| (tr.from, tr.to, tr.at))
            .collect()
    }

    #[test]
    fn a_breaker_opened_elsewhere_opens_here_half_opens_with_its_probes_and_closes_elsewhere() {
        let mut b = breakers(cfg());
        let until = t(10_000);
        assert!(b.open_elsewhere(&ty(), &k503(), until, t(1_000)));
        assert_eq!(
            b.state(&ty(), &k503(), t(1_000)),
            BreakerState::Open { until }
        );
        assert_eq!(b.parked_until(&ty(), t(1_000)), Some(until));
        // The same opening again, or an earlier end: nothing new.
        assert!(!b.open_elsewhere(&ty(), &k503(), until, t(1_100)));
        assert!(!b.open_elsewhere(&ty(), &k503(), t(5_000), t(1_100)));
        assert_eq!(
            transitions(&mut b),
            vec![(BreakerState::Closed, BreakerState::Open { until }, t(1_000))]
        );
        // Its own probes once the end comes.
        assert!(b.try_lease(&ty(), t(10_000)));
        assert!(b.try_lease(&ty(), t(10_000)));
        assert!(!b.try_lease(&ty(), t(10_000)), "two probes, then parked");
        // Closed through another node's probe.
        assert!(b.close_elsewhere(&ty(), &k503(), t(10_500)));
        assert!(!b.close_elsewhere(&ty(), &k503(), t(10_600)));
        assert_eq!(b.state(&ty(), &k503(), t(10_600)), BreakerState::Closed);
        assert!(b.try_lease(&ty(), t(10_600)));
        // An end already past, or a type without settings: nothing.
        assert!(!b.open_elsewhere(&ty(), &k503(), t(10_000), t(10_600)));
        assert!(!b.open_elsewhere(&JobType::new("other"), &k503(), t(99_000), t(10_600)));
        // Closed while still open here: through half-open, edges only.
        assert!(b.open_elsewhere(&ty(), &k503(), t(30_000), t(20_000)));
        assert!(b.close_elsewhere(&ty(), &k503(), t(21_000)));
        let steps = transitions(&mut b);
        assert!(
            steps.iter().all(|(from, to, _)| from.can_become(*to)),
            "{steps:?}"
        );
        assert_eq!(steps.last().map(|s| s.1), Some(BreakerState::Closed));
    }

    #[test]
    fn default_config_is_valid_and_matches_the_contract() {
        let d = BreakerConfig::default();
        assert_eq!(d.validate(), Ok(()));
        let json = serde_json::to_value(d).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"failures_min": 20, "failure_ratio": 0.5,
                "window_ms": 30000, "cooldown_ms": 10000, "probes": 2})
        );
        let partial: BreakerConfig = serde_json::from_str(r#"{"probes": 3}"#).unwrap();
        assert_eq!(partial, BreakerConfig { probes: 3, ..d });
        assert!(serde_json::from_str::<BreakerConfig>(r#"{"window": 3}"#).is_err());
    }

    #[test]
    fn validate_names_the_field_and_the_range() {
        let d = BreakerConfig::default();
        let cases = [
            (
                BreakerConfig {
                    failures_min: 0,
                    ..d
                },
                "failures_min",
            ),
            (
                BreakerConfig {
                    failure_ratio: 0.0,
                    ..d
                },
                "failure_ratio",
            ),
            (
                BreakerConfig {
                    failure_ratio: 1.5,
                    ..d
                },
                "failure_ratio",
            ),
            (
                BreakerConfig {
                    failure_ratio: f64::NAN,
                    ..d
                },
                "failure_ratio",
            ),
            (
                BreakerConfig {
                    window: Duration::ZERO,
                    ..d
                },
                "window_ms",
            ),
            (
                BreakerConfig {
                    window: Duration::from_micros(10),
                    ..d
                },
                "window_ms",
            ),
            (
                BreakerConfig {
                    cooldown: Duration::ZERO,
                    ..d
                },
                "cooldown_ms",
            ),
            (BreakerConfig { probes: 0, ..d }, "probes"),
        ];
        for (config, field) in cases {
            assert_eq!(config.validate().unwrap_err().field, field);
        }
        assert_eq!(
            BreakerConfig {
                failure_ratio: 1.0,
                ..d
            }
            .validate(),
            Ok(())
        );
        assert_eq!(
            BreakerConfig {
                failure_ratio: 1.5,
                ..d
            }
            .validate()
            .unwrap_err()
            .to_string(),
            "breaker.failure_ratio = 1.5 is out of range: it must be in (0, 1]"
        );
    }

    #[test]
    fn opens_only_when_both_thresholds_are_passed() {
        let mut b = breakers(cfg());
        for _ in 0..10 {
            b.record_success(&ty(), t(0));
        }
        // Ten failures among twenty outcomes is the first time 50 % is reached.
        for i in 1..=10 {
            b.record_failure(&ty(), &k503(), t(100));
            let open = b.state(&ty(), &k503(), t(100)) != BreakerState::Closed;
            assert_eq!(open, i == 10, "after {i} failures");
        }
        assert_eq!(b.parked_until(&ty(), t(100)), Some(t(5_100)));
        assert!(!b.try_lease(&ty(), t(100)));
    }

    #[test]
    fn failing_at_100_percent_below_failures_min_stays_closed() {
        let mut b = breakers(cfg());
        for _ in 0..4 {
            b.record_failure(&ty(), &k503(), t(0));
        }
        assert_eq!(b.state(&ty(), &k503(), t(0)), BreakerState::Closed);
        assert_eq!(b.parked_until(&ty(), t(0)), None);
        assert!(b.try_lease(&ty(), t(0)));
    }

    #[test]
    fn other_outcomes_count_for_the_ratio_but_never_trip() {
        let mut b = breakers(cfg());
        for _ in 0..100 {
            b.record_other(&ty(), t(0));
        }
        for _ in 0..50 {
            b.record_failure(&ty(), &k503(), t(0));
        }
        // 50 / 150 < 0.5
        assert_eq!(b.state(&ty(), &k503(), t(0)), BreakerState::Closed);
    }

    #[test]
    fn observe_feeds_each_outcome_by_the_one_rule() {
        use crate::failure::{DeadLetterReason, FailureClass::*};
        let retry = Transition::Retry {
            at: t(1),
            attempt: 1,
        };
        let dead = Transition::DeadLetter {
            reason: DeadLetterReason::Exhausted,
        };
        // A transient failure of a kind trips that kind, retried or not.
        for end in [retry, dead, Transition::Cancelled] {
            let mut b = breakers(cfg());
            for _ in 0..cfg().failures_min {
                b.observe(&ty(), end, Some(Transient), Some(&k503()), t(0));
            }
            assert!(
                matches!(b.state(&ty(), &k503(), t(0)), BreakerState::Open { .. }),
                "{end:?}"
            );
        }
        // Permanent failures and deferrals never trip, whatever their kind.
        for class in [Permanent, Deferred] {
            let mut b = breakers(cfg());
            for _ in 0..20 {
                b.observe(&ty(), dead, Some(class), Some(&k503()), t(0));
            }
            assert_eq!(b.state(&ty(), &k503(), t(0)), BreakerState::Closed);
        }
        // A success closes a half-open breaker.
        let mut b = breakers(cfg());
        open_at(&mut b, t(0));
        assert!(matches!(
            b.state(&ty(), &k503(), t(5_000)),
            BreakerState::HalfOpen { .. }
        ));
        b.observe(&ty(), Transition::Succeeded, None, None, t(5_000));
        assert_eq!(b.state(&ty(), &k503(), t(5_000)), BreakerState::Closed);
    }

    #[test]
    fn a_transient_failure_without_a_kind_counts_as_an_outcome_only() {
        let retry = Transition::Retry {
            at: t(1),
            attempt: 1,
        };
        let transient = Some(crate::FailureClass::Transient);
        // Five failures of http_503 alone are 100 % of the outcomes: open.
        let mut b = breakers(cfg());
        for _ in 0..5 {
            b.observe(&ty(), retry, transient, Some(&k503()), t(0));
        }
        assert!(matches!(
            b.state(&ty(), &k503(), t(0)),
            BreakerState::Open { .. }
        ));
        // Six failures of no known kind before them: 5 / 11 < 0.5, closed;
        // and none of them opened a breaker of its own.
        let mut b = breakers(cfg());
        for _ in 0..6 {
            b.observe(&ty(), retry, transient, None, t(0));
        }
        for _ in 0..5 {
            b.observe(&ty(), retry, transient, Some(&k503()), t(0));
        }
        assert_eq!(b.state(&ty(), &k503(), t(0)), BreakerState::Closed);
        assert!(b.snapshot(t(0)).is_empty());
    }

    #[test]
    fn old_failures_slide_out_of_the_window() {
        let mut b = breakers(cfg());
        for _ in 0..4 {
            b.record_failure(&ty(), &k503(), t(0));
        }
        // Buckets are 1 s wide; at 10 s the bucket of t = 0 has left the window.
        b.record_failure(&ty(), &k503(), t(10_000));
        assert_eq!(b.state(&ty(), &k503(), t(10_000)), BreakerState::Closed);

        let mut b = breakers(cfg());
        for _ in 0..4 {
            b.record_failure(&ty(), &k503(), t(0));
        }
        // …but at 9.999 s it is still in it.
        b.record_failure(&ty(), &k503(), t(9_999));
        assert!(matches!(
            b.state(&ty(), &k503(), t(9_999)),
            BreakerState::Open { .. }
        ));
    }

    #[test]
    fn cooldown_then_half_open_then_a_success_closes_and_resets_the_window() {
        let mut b = breakers(cfg());
        open_at(&mut b, t(0));
        assert!(!b.try_lease(&ty(), t(4_999)));
        assert_eq!(
            b.state(&ty(), &k503(), t(5_000)),
            BreakerState::HalfOpen { probes_left: 2 }
        );
        assert!(b.try_lease(&ty(), t(5_000)));
        b.record_success(&ty(), t(5_200));
        assert_eq!(b.state(&ty(), &k503(), t(5_200)), BreakerState::Closed);
        // The five failures of t = 0 are still inside 10 s, but forgotten.
        b.record_failure(&ty(), &k503(), t(5_300));
        assert_eq!(b.state(&ty(), &k503(), t(5_300)), BreakerState::Closed);
        assert_eq!(
            transitions(&mut b),
            [
                (
                    BreakerState::Closed,
                    BreakerState::Open { until: t(5_000) },
                    t(0)
                ),
                (
                    BreakerState::Open { until: t(5_000) },
                    BreakerState::HalfOpen { probes_left: 2 },
                    t(5_000)
                ),
                (
                    BreakerState::HalfOpen { probes_left: 1 },
                    BreakerState::Closed,
                    t(5_200)
                ),
            ]
        );
    }

    #[test]
    fn a_failure_while_half_open_reopens_with_a_fresh_cooldown() {
        let mut b = breakers(cfg());
        open_at(&mut b, t(0));
        assert!(b.try_lease(&ty(), t(6_000)));
        b.record_failure(&ty(), &k503(), t(6_500));
        assert_eq!(
            b.state(&ty(), &k503(), t(6_500)),
            BreakerState::Open { until: t(11_500) }
        );
        assert!(!b.try_lease(&ty(), t(11_499)));
        assert!(b.try_lease(&ty(), t(11_500)));
    }

    #[test]
    fn a_failure_of_another_kind_while_half_open_does_not_reopen() {
        let mut b = breakers(cfg());
        open_at(&mut b, t(0));
        assert!(b.try_lease(&ty(), t(5_000)));
        b.record_failure(&ty(), &ErrorKind::lease_expired(), t(5_100));
        b.record_other(&ty(), t(5_100));
        assert_eq!(
            b.state(&ty(), &k503(), t(5_100)),
            BreakerState::HalfOpen { probes_left: 1 }
        );
    }

    #[test]
    fn reservations_never_add_up_past_the_probes_and_unused_slots_come_back() {
        let mut b = breakers(BreakerConfig { probes: 3, ..cfg() });
        let other = JobType::new("other");
        let free = b.reserve_leases(&other, 7, t(0));
        assert_eq!((free.granted(), free.limited()), (7, false));
        open_at(&mut b, t(0));
        let parked = b.reserve_leases(&ty(), 7, t(4_999));
        assert_eq!((parked.granted(), parked.limited()), (0, true));
        b.refund(parked, 0);

        // Twenty leases under way at once, each asking for two: three in all.
        let held: Vec<LeaseReservation> = (0..20)
            .map(|_| b.reserve_leases(&ty(), 2, t(5_000)))
            .collect();
        let granted: Vec<u32> = held.iter().map(LeaseReservation::granted).collect();
        assert_eq!(granted.iter().sum::<u32>(), 3, "{granted:?}");
        assert_eq!(granted[..2], [2, 1]);
        assert_eq!(b.parked_until(&ty(), t(5_000)), Some(t(10_000)));

        // The first used one of its two, the second none: two slots back.
        let mut held = held.into_iter();
        b.refund(held.next().unwrap(), 1);
        b.refund(held.next().unwrap(), 0);
        for r in held {
            b.refund(r, 0);
        }
        assert_eq!(
            b.state(&ty(), &k503(), t(5_000)),
            BreakerState::HalfOpen { probes_left: 2 }
        );

        // A reservation from an earlier half-open period owes nothing back.
        let late = b.reserve_leases(&ty(), 2, t(5_000));
        assert_eq!(late.granted(), 2);
        assert_eq!(
            b.state(&ty(), &k503(), t(10_000)),
            BreakerState::HalfOpen { probes_left: 3 }
        );
        let current = b.reserve_leases(&ty(), 1, t(10_000));
        b.refund(late, 0);
        assert_eq!(
            b.state(&ty(), &k503(), t(10_000)),
            BreakerState::HalfOpen { probes_left: 2 }
        );
        b.refund(current, 0);
        assert_eq!(
            b.state(&ty(), &k503(), t(10_000)),
            BreakerState::HalfOpen { probes_left: 3 }
        );
    }

    #[test]
    fn half_open_lets_exactly_probes_leases_through() {
        for probes in [1, 2, 5] {
            let mut b = breakers(BreakerConfig { probes, ..cfg() });
            open_at(&mut b, t(0));
            assert_eq!(b.parked_until(&ty(), t(5_000)), None);
            for _ in 0..probes {
                assert!(b.try_lease(&ty(), t(5_000)));
            }
            assert!(!b.try_lease(&ty(), t(5_000)));
            assert_eq!(b.parked_until(&ty(), t(5_000)), Some(t(10_000)));
        }
    }

    #[test]
    fn a_stuck_half_open_breaker_hands_out_probes_again_after_a_cooldown() {
        let mut b = breakers(cfg());
        open_at(&mut b, t(0));
        assert!(b.try_lease(&ty(), t(5_000)));
        assert!(b.try_lease(&ty(), t(5_000)));
        // Both probe workers die; their leases never come back.
        assert!(!b.try_lease(&ty(), t(9_999)));
        assert!(b.try_lease(&ty(), t(10_000)));
        // Periods are counted from the first, whenever we look: 15 s–20 s.
        assert!(b.try_lease(&ty(), t(15_001)));
        assert!(b.try_lease(&ty(), t(15_002)));
        assert!(!b.try_lease(&ty(), t(19_999)));
        assert_eq!(b.parked_until(&ty(), t(19_999)), Some(t(20_000)));
        let log = transitions(&mut b);
        assert_eq!(
            log[2..],
            [
                (
                    BreakerState::HalfOpen { probes_left: 0 },
                    BreakerState::HalfOpen { probes_left: 2 },
                    t(10_000)
                ),
                (
                    BreakerState::HalfOpen { probes_left: 1 },
                    BreakerState::HalfOpen { probes_left: 2 },
                    t(15_000)
                ),
            ]
        );
    }

    #[test]
    fn a_half_open_breaker_with_nothing_to_probe_closes_after_a_whole_period() {
        // Found by the simulation on the real store (issue 29 part 5): the
        // type's last jobs opened the breaker and were dead-lettered; new
        // ones are shed while it is half-open, so no probe could ever run
        // and the type was refused for good.
        let mut b = breakers(cfg());
        open_at(&mut b, t(0));
        assert!(
            b.shed_retry_after(&ty(), t(9_999)).is_some(),
            "half-open sheds"
        );
        assert_eq!(b.shed_retry_after(&ty(), t(10_000)), None);
        assert_eq!(
            b.state(&ty(), &k503(), t(10_000)),
            BreakerState::Closed,
            "no probe leased in the period 5 s-10 s"
        );
        assert!(b.try_lease(&ty(), t(10_001)));
        assert!(b.try_lease(&ty(), t(10_001)));
        assert!(b.try_lease(&ty(), t(10_001)), "closed: no probe slots");
        let log = transitions(&mut b);
        assert_eq!(
            log.last(),
            Some(&(
                BreakerState::HalfOpen { probes_left: 2 },
                BreakerState::Closed,
                t(10_000)
            ))
        );

        // Probes that went out and never answered get their slots back
        // once; a whole period after that with none leased closes it too.
        let mut b = breakers(cfg());
        open_at(&mut b, t(0));
        assert!(b.try_lease(&ty(), t(5_000)));
        assert_eq!(b.state(&ty(), &k503(), t(15_000)), BreakerState::Closed);
        let log = transitions(&mut b);
        assert_eq!(
            log[log.len() - 2..],
            [
                (
                    BreakerState::HalfOpen { probes_left: 1 },
                    BreakerState::HalfOpen { probes_left: 2 },
                    t(10_000)
                ),
                (
                    BreakerState::HalfOpen { probes_left: 2 },
                    BreakerState::Closed,
                    t(15_000)
                ),
            ]
        );
    }

    #[test]
    fn shed_answers_while_open_or_half_open_with_at_least_a_second() {
        let mut b = breakers(cfg());
        assert_eq!(b.shed_retry_after(&ty(), t(0)), None);
        open_at(&mut b, t(0));
        assert_eq!(
            b.shed_retry_after(&ty(), t(1_000)),
            Some(Duration::from_secs(4))
        );
        assert_eq!(
            b.shed_retry_after(&ty(), t(4_700)),
            Some(SHED_RETRY_AFTER_MIN)
        );
        // Half-open admits like open; the hint is the end of the probe period.
        assert_eq!(
            b.shed_retry_after(&ty(), t(6_000)),
            Some(Duration::from_secs(4))
        );
        b.record_success(&ty(), t(6_000));
        assert_eq!(b.shed_retry_after(&ty(), t(6_000)), None);
    }

    #[test]
    fn one_open_kind_parks_the_whole_type_and_kinds_are_independent() {
        let mut b = breakers(cfg());
        let other = JobType::new("resize_image");
        b.record_failure(&ty(), &ErrorKind::new("timeout"), t(0));
        open_at(&mut b, t(0));
        assert_eq!(
            b.state(&ty(), &ErrorKind::new("timeout"), t(0)),
            BreakerState::Closed
        );
        assert!(!b.try_lease(&ty(), t(1)));
        assert!(b.try_lease(&other, t(1)));
        assert_eq!(
            b.snapshot(t(1)),
            [BreakerView {
                ty: ty(),
                kind: k503(),
                state: BreakerState::Open { until: t(5_000) }
            }]
        );
    }

    #[test]
    fn a_type_without_config_never_parks() {
        let mut b = Breakers::new(None, BTreeMap::from([(ty(), cfg())]));
        let free = JobType::new("free");
        for i in 0..1_000 {
            b.record_failure(&free, &k503(), t(i));
        }
        assert_eq!(b.parked_until(&free, t(1_000)), None);
        assert_eq!(b.shed_retry_after(&free, t(1_000)), None);
        assert!(b.try_lease(&free, t(1_000)));
        assert!(b.snapshot(t(1_000)).is_empty());
        assert_eq!(b.poll_transition(), None);

        // With a default, the same type gets a breaker.
        let mut b = Breakers::new(Some(cfg()), BTreeMap::new());
        for _ in 0..5 {
            b.record_failure(&free, &k503(), t(0));
        }
        assert!(!b.try_lease(&free, t(1)));
    }

    #[test]
    fn time_never_runs_backwards() {
        let mut b = breakers(cfg());
        open_at(&mut b, t(10_000));
        assert!(b.try_lease(&ty(), t(15_000)));
        // A clock stepped back does not reopen it.
        assert_eq!(
            b.state(&ty(), &k503(), t(0)),
            BreakerState::HalfOpen { probes_left: 1 }
        );
    }

    #[test]
    fn kinds_per_type_are_bounded_and_idle_ones_are_forgotten() {
        let mut b = breakers(BreakerConfig {
            failures_min: 1,
            ..cfg()
        });
        for _ in 0..1_000 {
            b.record_success(&ty(), t(0));
        }
        for i in 0..200 {
            b.record_failure(&ty(), &ErrorKind::new(format!("k{i}")), t(0));
        }
        assert_eq!(b.types[&ty()].kinds.len(), KINDS_PER_TYPE_MAX);
        // Ten seconds later the first 64 are idle and make room.
        b.record_failure(&ty(), &ErrorKind::new("late"), t(10_000));
        assert_eq!(b.types[&ty()].kinds.len(), 1);
    }

    #[test]
    fn the_transition_log_is_bounded() {
        let mut b = breakers(BreakerConfig {
            failures_min: 1,
            failure_ratio: 1.0,
            ..cfg()
        });
        // Each failure while half-open reopens it: two transitions per round.
        for round in 0..TRANSITIONS_MAX as i64 {
            b.record_failure(&ty(), &k503(), t(round * 5_000));
        }
        assert_eq!(b.log.queue.len(), TRANSITIONS_MAX);
        assert_eq!(b.transitions_dropped(), TRANSITIONS_MAX as u64 - 1);
    }

    /// A readable trace of one breaker: send_email × http_503.
    #[test]
    fn trace() {
        let config = BreakerConfig {
            failures_min: 3,
            failure_ratio: 0.5,
            window: Duration::from_secs(10),
            cooldown: Duration::from_secs(5),
            probes: 2,
        };
        let mut b = breakers(config);
        let (ty, kind) = (ty(), k503());
        let mut out = format!(
            "{:>6}  {:<18} {:<26} {:<18} {}\n",
            "t (ms)", "event", "state", "leases", "admission"
        );
        let mut row = |b: &mut Breakers, at: i64, event: &str| {
            let state = b.state(&ty, &kind, t(at)).to_string();
            let leases = match b.parked_until(&ty, t(at)) {
                Some(until) => format!("parked to {until}"),
                None => "go".to_owned(),
            };
            let admission = match b.shed_retry_after(&ty, t(at)) {
                Some(d) => format!("SHED, retry {:.1} s", d.as_secs_f64()),
                None => "admit".to_owned(),
            };
            out += &format!("{at:>6}  {event:<18} {state:<26} {leases:<18} {admission}\n");
        };
        let lease = |b: &mut Breakers, at: i64| {
            if b.try_lease(&ty, t(at)) {
                "lease: granted"
            } else {
                "lease: refused"
            }
        };
        b.record_success(&ty, t(0));
        row(&mut b, 0, "success");
        b.record_success(&ty, t(100));
        row(&mut b, 100, "success");
        for at in [200, 300, 400] {
            b.record_failure(&ty, &kind, t(at));
            row(&mut b, at, "failure http_503");
        }
        let ev = lease(&mut b, 1_000);
        row(&mut b, 1_000, ev);
        for _ in 0..3 {
            let ev = lease(&mut b, 5_400);
            row(&mut b, 5_400, ev);
        }
        row(&mut b, 9_000, "(probes lost)");
        let ev = lease(&mut b, 10_400);
        row(&mut b, 10_400, ev);
        b.record_failure(&ty, &kind, t(11_000));
        row(&mut b, 11_000, "failure http_503");
        let ev = lease(&mut b, 16_000);
        row(&mut b, 16_000, ev);
        b.record_success(&ty, t(16_500));
        row(&mut b, 16_500, "success");
        let ev = lease(&mut b, 16_600);
        row(&mut b, 16_600, ev);
        expect_test::expect![[r#"
            t (ms)  event              state                      leases             admission
                 0  success            closed                     go                 admit
               100  success            closed                     go                 admit
               200  failure http_503   closed                     go                 admit
               300  failure http_503   closed                     go                 admit
               400  failure http_503   open until 5400ms          parked to 5400ms   SHED, retry 5.0 s
              1000  lease: refused     open until 5400ms          parked to 5400ms   SHED, retry 4.4 s
              5400  lease: granted     half_open, 1 probe left    go                 SHED, retry 5.0 s
              5400  lease: granted     half_open, 0 probes left   parked to 10400ms  SHED, retry 5.0 s
              5400  lease: refused     half_open, 0 probes left   parked to 10400ms  SHED, retry 5.0 s
              9000  (probes lost)      half_open, 0 probes left   parked to 10400ms  SHED, retry 1.4 s
             10400  lease: granted     half_open, 1 probe left    go                 SHED, retry 5.0 s
             11000  failure http_503   open until 16000ms         parked to 16000ms  SHED, retry 5.0 s
             16000  lease: granted     half_open, 1 probe left    go                 SHED, retry 5.0 s
             16500  success            closed                     go                 admit
             16600  lease: granted     closed                     go                 admit
        "#]].assert_eq(&out);
    }
}

#[cfg(test)]
mod props {
    use proptest::prelude::*;

    use super::*;

    const TYPES: [&str; 2] = ["a", "b"];
    const KINDS: [&str; 3] = ["timeout", "http_503", "lease_expired"];

    #[derive(Clone, Debug)]
    enum Op {
        Advance(i64),
        Success(usize),
        Failure(usize, usize),
        Other(usize),
        Lease(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            2 => (0i64..3_000).prop_map(Op::Advance),
            2 => (0..TYPES.len()).prop_map(Op::Success),
            4 => (0..TYPES.len(), 0..KINDS.len()).prop_map(|(t, k)| Op::Failure(t, k)),
            1 => (0..TYPES.len()).prop_map(Op::Other),
            4 => (0..TYPES.len()).prop_map(Op::Lease),
        ]
    }

    fn config() -> impl Strategy<Value = BreakerConfig> {
        (1u32..6, 1u32..=10, 1u64..20_000, 1u64..10_000, 1u32..4).prop_map(
            |(failures_min, tenths, window, cooldown, probes)| BreakerConfig {
                failures_min,
                failure_ratio: f64::from(tenths) / 10.0,
                window: Duration::from_millis(window),
                cooldown: Duration::from_millis(cooldown),
                probes,
            },
        )
    }

    fn same_kind(a: BreakerState, b: BreakerState) -> bool {
        std::mem::discriminant(&a) == std::mem::discriminant(&b)
    }

    /// What the test knows about one breaker from its transitions.
    #[derive(Clone, Copy, Debug)]
    struct Seen {
        state: BreakerState,
        /// Probe leases granted since its half-open period began.
        grants: u32,
    }

    fn run(
        start: i64,
        config_a: BreakerConfig,
        config_b: BreakerConfig,
        ops: &[Op],
    ) -> Vec<BreakerTransition> {
        let types: Vec<JobType> = TYPES.iter().map(|&s| JobType::new(s)).collect();
        let kinds: Vec<ErrorKind> = KINDS.iter().map(|&s| ErrorKind::new(s)).collect();
        let probes = |ty: &JobType| {
            if ty.as_str() == "a" {
                config_a.probes
            } else {
                config_b.probes
            }
        };
        let mut b = Breakers::new(
            Some(config_b),
            BTreeMap::from([(types[0].clone(), config_a)]),
        );
        let mut seen: BTreeMap<(JobType, ErrorKind), Seen> = BTreeMap::new();
        let mut all = Vec::new();
        let mut now = start;
        for op in ops {
            match *op {
                Op::Advance(ms) => now = now.saturating_add(ms),
                Op::Success(t) => b.record_success(&types[t], Timestamp::from_millis(now)),
                Op::Failure(t, k) => {
                    b.record_failure(&types[t], &kinds[k], Timestamp::from_millis(now))
                }
                Op::Other(t) => b.record_other(&types[t], Timestamp::from_millis(now)),
                Op::Lease(t) => {
                    let ty = &types[t];
                    let at = Timestamp::from_millis(now);
                    let parked = b.parked_until(ty, at);
                    let before = b.snapshot(at);
                    // Bring the model up to date with the clock's transitions.
                    absorb(&mut b, &mut seen, &mut all);
                    let granted = b.try_lease(ty, at);
                    // (1) a parked type gets no lease.
                    if let Some(until) = parked {
                        assert!(!granted, "lease granted while parked until {until}");
                        assert!(until > at);
                    }
                    let mine = before.iter().filter(|v| &v.ty == ty);
                    for v in mine {
                        match v.state {
                            // (2) an open breaker never lets a lease through.
                            BreakerState::Open { .. } => assert!(!granted),
                            BreakerState::HalfOpen { .. } if granted => {
                                let s = seen.get_mut(&(v.ty.clone(), v.kind.clone())).unwrap();
                                s.grants += 1;
                                // (1) at most `probes` per half-open period.
                                assert!(s.grants <= probes(ty), "{s:?}");
                            }
                            _ => {}
                        }
                    }
                }
            }
            absorb(&mut b, &mut seen, &mut all);
            // The model built from transitions alone agrees with the breakers.
            let snapshot = b.snapshot(Timestamp::from_millis(now));
            absorb(&mut b, &mut seen, &mut all);
            for ((ty, kind), s) in &seen {
                let state = b.state(ty, kind, Timestamp::from_millis(now));
                assert!(same_kind(s.state, state), "{ty}/{kind}: {s:?} vs {state:?}");
                let listed = snapshot.iter().find(|v| &v.ty == ty && &v.kind == kind);
                assert_eq!(
                    listed.map(|v| v.state),
                    (state != BreakerState::Closed).then_some(state)
                );
            }
            for v in &snapshot {
                assert!(seen.contains_key(&(v.ty.clone(), v.kind.clone())), "{v:?}");
            }
            assert_eq!(b.poll_transition(), None);
        }
        all
    }

    /// Takes the pending transitions, checking (3): only edges of the state machine.
    fn absorb(
        b: &mut Breakers,
        seen: &mut BTreeMap<(JobType, ErrorKind), Seen>,
        all: &mut Vec<BreakerTransition>,
    ) {
        while let Some(tr) = b.poll_transition() {
            assert!(tr.from.can_become(tr.to), "{tr:?}");
            let s = seen
                .entry((tr.ty.clone(), tr.kind.clone()))
                .or_insert(Seen {
                    state: BreakerState::Closed,
                    grants: 0,
                });
            assert!(same_kind(s.state, tr.from), "{s:?} then {tr:?}");
            if let BreakerState::HalfOpen { .. } = tr.to {
                s.grants = 0;
            }
            s.state = tr.to;
            all.push(tr);
        }
    }

    proptest! {
        #[test]
        fn leases_probes_and_edges_follow_the_rules(
            start in -1_000_000_000i64..1_000_000_000,
            config_a in config(),
            config_b in config(),
            ops in prop::collection::vec(op(), 0..300),
        ) {
            let first = run(start, config_a, config_b, &ops);
            // Deterministic: the same calls give the same transitions.
            prop_assert_eq!(first, run(start, config_a, config_b, &ops));
        }

        /// Whatever outcomes arrive, a breaker opens only for a kind that
        /// had a transient failure, and a permanent or deferred one, or a
        /// transient one of no known kind, never opens anything.
        #[test]
        fn only_transient_failures_of_a_kind_open_its_breaker(
            config in config(),
            steps in prop::collection::vec((0i64..2_000, 0usize..4, 0usize..4, 0..=KINDS.len()), 0..200),
        ) {
            use crate::failure::{DeadLetterReason, FailureClass};
            let ty = JobType::new(TYPES[0]);
            let mut b = Breakers::new(None, BTreeMap::from([(ty.clone(), config)]));
            let mut blamed = std::collections::BTreeSet::new();
            let mut now = 0i64;
            for (jump, end, class, k) in steps {
                now += jump;
                let at = Timestamp::from_millis(now);
                let transition = match end {
                    0 => Transition::Succeeded,
                    1 => Transition::Retry { at, attempt: 1 },
                    2 => Transition::Defer { until: at },
                    _ => Transition::DeadLetter { reason: DeadLetterReason::Exhausted },
                };
                let class = [None, Some(FailureClass::Transient), Some(FailureClass::Permanent), Some(FailureClass::Deferred)][class];
                let kind = KINDS.get(k).map(|k| ErrorKind::new(*k));
                if transition != Transition::Succeeded && class == Some(FailureClass::Transient) {
                    if let Some(kind) = &kind {
                        blamed.insert(kind.clone());
                    }
                }
                b.observe(&ty, transition, class, kind.as_ref(), at);
                while let Some(tr) = b.poll_transition() {
                    if matches!(tr.to, BreakerState::Open { .. }) {
                        prop_assert!(blamed.contains(&tr.kind), "{:?} opened", tr.kind);
                    }
                }
            }
        }

        #[test]
        fn extreme_timestamps_and_settings_do_not_panic(
            start in prop_oneof![Just(i64::MIN), Just(i64::MAX), Just(i64::MAX - 1), Just(-1i64), any::<i64>()],
            window in prop_oneof![Just(Duration::ZERO), Just(Duration::MAX), Just(Duration::from_nanos(1)), (0u64..u64::MAX).prop_map(Duration::from_millis)],
            cooldown in prop_oneof![Just(Duration::ZERO), Just(Duration::MAX), (0u64..u64::MAX).prop_map(Duration::from_millis)],
            failures_min in prop_oneof![Just(0u32), Just(1), Just(u32::MAX)],
            failure_ratio in prop_oneof![Just(0.0f64), Just(1.0), Just(f64::NAN), Just(f64::INFINITY), Just(-1.0)],
            probes in prop_oneof![Just(0u32), Just(1), Just(u32::MAX)],
            steps in prop::collection::vec((any::<i64>(), 0usize..5, 0..KINDS.len()), 0..100),
        ) {
            let config = BreakerConfig { failures_min, failure_ratio, window, cooldown, probes };
            let ty = JobType::new("a");
            let mut b = Breakers::new(Some(config), BTreeMap::new());
            let mut now = start;
            for (jump, what, k) in steps {
                now = now.saturating_add(jump);
                let at = Timestamp::from_millis(now);
                let kind = ErrorKind::new(KINDS[k]);
                match what {
                    0 => b.record_success(&ty, at),
                    1 => { b.record_failure(&ty, &kind, at); b.record_failure(&ty, &kind, at); }
                    2 => b.record_other(&ty, at),
                    3 => { b.try_lease(&ty, at); }
                    _ => { b.shed_retry_after(&ty, at); b.parked_until(&ty, at); }
                }
                b.snapshot(at);
                while let Some(tr) = b.poll_transition() {
                    prop_assert!(tr.from.can_become(tr.to));
                }
            }
        }
    }
}
