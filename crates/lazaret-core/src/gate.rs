//! The gate: whether jobs of a type in a lane may go ahead now, from the
//! types and lanes an operator paused, the breakers and the lanes that park.
//!
//! One rule, four questions, each asked by one caller:
//!
//! - [`Gate::shed`] — admission: is an enqueue refused (`503 SHED`), and
//!   with what `Retry-After`? A pause sheds in every lane; an open or
//!   half-open breaker sheds except in a *park* lane, which takes the job
//!   and lets it wait until the breaker closes.
//! - [`Gate::lease_filter`] — a lease: which types and lanes it leaves out,
//!   and how many jobs of a half-open type it may take (probe slots are
//!   reserved here; hand the unused ones back with [`Breakers::refund`]).
//! - [`Gate::try_deliver`] — a broker source, about to deliver a message:
//!   may it go now (a half-open breaker's probe slot is then spent)?
//! - [`Gate::held_back`] — a broker source, holding a message it took: must
//!   it wait, without spending a probe?
//!
//! A paused type or lane is parked like an open breaker (the contract's
//! words). Pure: `now` is passed in, nothing is locked or read here; the
//! caller holds the pauses and the breakers and lends them for one question.

use std::collections::BTreeSet;
use std::time::Duration;

use crate::breaker::{Breakers, LeaseReservation};
use crate::ids::{JobType, Lane};
use crate::time::Timestamp;

/// The `Retry-After` of an enqueue shed because its type or lane is paused:
/// a pause lasts until an operator resumes, which no clock foretells.
pub const PAUSED_RETRY_AFTER: Duration = Duration::from_secs(30);

/// How long a source waits on a paused type or lane before it asks again
/// (a resume is noticed within this).
pub const PAUSED_RECHECK: Duration = Duration::from_secs(1);

/// The shortest wait a source is told while its type is parked: it must
/// not spin.
pub const PARKED_WAIT_MIN: Duration = Duration::from_millis(10);

/// The wait a source is told when every probe slot of a half-open breaker
/// is spent, and the clock alone says nothing sooner.
pub const PROBES_SPENT_WAIT: Duration = Duration::from_millis(100);

/// Types and lanes an operator paused (names, as the API and the store
/// keep them).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Paused {
    /// Paused types.
    pub types: BTreeSet<String>,
    /// Paused lanes.
    pub lanes: BTreeSet<String>,
}

impl Paused {
    /// Whether jobs of `ty` in `lane` are paused.
    pub fn holds(&self, ty: &str, lane: &str) -> bool {
        self.types.contains(ty) || self.lanes.contains(lane)
    }
}

/// What a lease must leave out or limit now (see [`Gate::lease_filter`]).
#[derive(Debug, Default)]
pub struct LeaseGate {
    /// Types parked: paused, an open breaker, or no probe slot left.
    pub exclude_types: Vec<JobType>,
    /// Lanes paused.
    pub exclude_lanes: Vec<Lane>,
    /// Half-open types and the probe slots reserved for this lease.
    pub type_limits: Vec<(JobType, u32)>,
    /// The reservations behind `type_limits`, to refund what the lease did
    /// not use ([`Breakers::refund`]).
    pub reservations: Vec<LeaseReservation>,
}

/// The pauses, breakers and park lanes of one runtime, lent for one
/// question.
#[derive(Debug)]
pub struct Gate<'a> {
    /// What an operator paused.
    pub paused: &'a Paused,
    /// The breakers (asking may move them on with the clock, or spend a
    /// probe slot).
    pub breakers: &'a mut Breakers,
    /// Lanes that take jobs of a type whose breaker is open and let them
    /// wait (`on_breaker_open = "park"`); they shed on a pause all the same.
    pub park_lanes: &'a BTreeSet<Lane>,
}

impl Gate<'_> {
    /// `Some(retry_after)` when an enqueue of `ty` in `lane` must be shed
    /// now: [`PAUSED_RETRY_AFTER`] while either is paused; otherwise, unless
    /// `lane` parks, while a breaker of `ty` is open or half-open
    /// ([`Breakers::shed_retry_after`]).
    pub fn shed(&mut self, ty: &JobType, lane: &Lane, now: Timestamp) -> Option<Duration> {
        if self.paused.holds(ty.as_str(), lane.as_str()) {
            return Some(PAUSED_RETRY_AFTER);
        }
        if self.park_lanes.contains(lane) {
            return None;
        }
        self.breakers.shed_retry_after(ty, now)
    }

    /// What a lease of at most `max_jobs` jobs of `types` (`None`: any)
    /// leaves out or limits now: paused types and lanes, parked types, and
    /// the probe slots of half-open types, reserved for it (a type the
    /// lease cannot take costs no slot).
    pub fn lease_filter(
        &mut self,
        types: Option<&[JobType]>,
        max_jobs: u32,
        now: Timestamp,
    ) -> LeaseGate {
        let mut exclude_types: Vec<JobType> = self
            .paused
            .types
            .iter()
            .map(|t| JobType::new(t.as_str()))
            .collect();
        let exclude_lanes: Vec<Lane> = self
            .paused
            .lanes
            .iter()
            .map(|l| Lane::new(l.as_str()))
            .collect();
        let mut type_limits: Vec<(JobType, u32)> = Vec::new();
        let mut reservations = Vec::new();
        for view in self.breakers.snapshot(now) {
            let ty = view.ty;
            if exclude_types.contains(&ty) || type_limits.iter().any(|(t, _)| t == &ty) {
                continue;
            }
            if types.is_some_and(|ts| !ts.contains(&ty)) {
                continue;
            }
            let r = self.breakers.reserve_leases(&ty, max_jobs, now);
            if !r.limited() {
                continue;
            }
            if r.granted() == 0 {
                exclude_types.push(ty);
            } else {
                type_limits.push((ty, r.granted()));
                reservations.push(r);
            }
        }
        LeaseGate {
            exclude_types,
            exclude_lanes,
            type_limits,
            reservations,
        }
    }

    /// `Ok` when one message of `ty` in `lane` may be delivered now (a
    /// half-open breaker's probe slot is then spent); otherwise how long to
    /// wait before asking again: [`PAUSED_RECHECK`] while paused, until the
    /// clock may unpark the type (at least [`PARKED_WAIT_MIN`]), or
    /// [`PROBES_SPENT_WAIT`] when the probe slots are spent.
    pub fn try_deliver(
        &mut self,
        ty: &JobType,
        lane: &Lane,
        now: Timestamp,
    ) -> Result<(), Duration> {
        if self.paused.holds(ty.as_str(), lane.as_str()) {
            return Err(PAUSED_RECHECK);
        }
        if let Some(until) = self.breakers.parked_until(ty, now) {
            return Err(until.saturating_since(now).max(PARKED_WAIT_MIN));
        }
        if self.breakers.try_lease(ty, now) {
            Ok(())
        } else {
            Err(PROBES_SPENT_WAIT)
        }
    }

    /// `Some(wait)` while a message of `ty` in `lane` must be held back
    /// (paused: [`PAUSED_RECHECK`]; parked: until the clock may unpark it),
    /// without spending a probe slot.
    pub fn held_back(&mut self, ty: &JobType, lane: &Lane, now: Timestamp) -> Option<Duration> {
        if self.paused.holds(ty.as_str(), lane.as_str()) {
            return Some(PAUSED_RECHECK);
        }
        self.breakers
            .parked_until(ty, now)
            .map(|until| until.saturating_since(now))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::breaker::{BreakerConfig, BreakerState};
    use crate::ids::ErrorKind;

    fn t(ms: i64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn cfg() -> BreakerConfig {
        BreakerConfig {
            failures_min: 2,
            failure_ratio: 0.5,
            window: Duration::from_secs(10),
            cooldown: Duration::from_secs(5),
            probes: 1,
        }
    }

    fn breakers() -> Breakers {
        Breakers::new(Some(cfg()), BTreeMap::new())
    }

    fn open(b: &mut Breakers, ty: &str, at: Timestamp) {
        for _ in 0..2 {
            b.record_failure(&JobType::new(ty), &ErrorKind::new("http_503"), at);
        }
    }

    fn paused(types: &[&str], lanes: &[&str]) -> Paused {
        Paused {
            types: types.iter().map(|s| (*s).to_owned()).collect(),
            lanes: lanes.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    #[test]
    fn nothing_paused_or_open_lets_everything_through() {
        let mut b = breakers();
        let (p, park) = (Paused::default(), BTreeSet::new());
        let mut g = Gate {
            paused: &p,
            breakers: &mut b,
            park_lanes: &park,
        };
        let (ty, lane) = (JobType::new("a"), Lane::new("default"));
        assert_eq!(g.shed(&ty, &lane, t(0)), None);
        assert_eq!(g.held_back(&ty, &lane, t(0)), None);
        assert_eq!(g.try_deliver(&ty, &lane, t(0)), Ok(()));
        let f = g.lease_filter(None, 10, t(0));
        assert!(f.exclude_types.is_empty() && f.exclude_lanes.is_empty());
        assert!(f.type_limits.is_empty() && f.reservations.is_empty());
    }

    #[test]
    fn a_pause_holds_its_type_or_lane_everywhere_even_in_a_park_lane() {
        let mut b = breakers();
        let p = paused(&["a"], &["slow"]);
        let park = BTreeSet::from([Lane::new("slow"), Lane::new("parked")]);
        let mut g = Gate {
            paused: &p,
            breakers: &mut b,
            park_lanes: &park,
        };
        for (ty, lane) in [("a", "default"), ("a", "parked"), ("b", "slow")] {
            let (ty, lane) = (JobType::new(ty), Lane::new(lane));
            assert_eq!(g.shed(&ty, &lane, t(0)), Some(PAUSED_RETRY_AFTER));
            assert_eq!(g.held_back(&ty, &lane, t(0)), Some(PAUSED_RECHECK));
            assert_eq!(g.try_deliver(&ty, &lane, t(0)), Err(PAUSED_RECHECK));
        }
        let (b_ty, lane) = (JobType::new("b"), Lane::new("default"));
        assert_eq!(g.try_deliver(&b_ty, &lane, t(0)), Ok(()));
        let f = g.lease_filter(None, 10, t(0));
        assert_eq!(f.exclude_types, [JobType::new("a")]);
        assert_eq!(f.exclude_lanes, [Lane::new("slow")]);
    }

    #[test]
    fn an_open_breaker_sheds_except_in_a_park_lane_and_holds_back_everywhere() {
        let mut b = breakers();
        open(&mut b, "a", t(0));
        let p = Paused::default();
        let park = BTreeSet::from([Lane::new("parked")]);
        let mut g = Gate {
            paused: &p,
            breakers: &mut b,
            park_lanes: &park,
        };
        let ty = JobType::new("a");
        let (lane, parked) = (Lane::new("default"), Lane::new("parked"));
        assert_eq!(g.shed(&ty, &lane, t(1_000)), Some(Duration::from_secs(4)));
        assert_eq!(
            g.shed(&ty, &parked, t(1_000)),
            None,
            "the park lane takes it"
        );
        // Held back and not delivered in every lane, park lanes included.
        for l in [&lane, &parked] {
            assert_eq!(g.held_back(&ty, l, t(1_000)), Some(Duration::from_secs(4)));
            assert_eq!(g.try_deliver(&ty, l, t(1_000)), Err(Duration::from_secs(4)));
        }
        // A wait about to end is still a wait: never zero.
        assert_eq!(
            g.try_deliver(&ty, &lane, t(4_999)),
            Err(Duration::from_millis(10))
        );
        let f = g.lease_filter(None, 10, t(1_000));
        assert_eq!(f.exclude_types, [ty]);
    }

    #[test]
    fn half_open_lets_one_probe_through_per_slot() {
        let mut b = breakers();
        open(&mut b, "a", t(0));
        let p = Paused::default();
        let park = BTreeSet::new();
        let mut g = Gate {
            paused: &p,
            breakers: &mut b,
            park_lanes: &park,
        };
        let (ty, lane) = (JobType::new("a"), Lane::new("default"));
        // Half-open: not held back (a probe may go), but admission sheds.
        assert_eq!(g.held_back(&ty, &lane, t(5_000)), None);
        assert!(g.shed(&ty, &lane, t(5_000)).is_some());
        // A lease that cannot take type a reserves nothing.
        let other = [JobType::new("b")];
        let f = g.lease_filter(Some(&other), 10, t(5_000));
        assert!(f.type_limits.is_empty() && f.exclude_types.is_empty());
        assert_eq!(g.try_deliver(&ty, &lane, t(5_000)), Ok(()));
        // Its one slot spent, the type is parked again until the period ends.
        assert!(g.try_deliver(&ty, &lane, t(5_000)).is_err());
        assert!(g.held_back(&ty, &lane, t(5_000)).is_some());
        // Its one slot spent, a lease leaves the type out.
        let f = g.lease_filter(None, 10, t(5_000));
        assert_eq!(f.exclude_types, std::slice::from_ref(&ty));
        assert_eq!(
            b.state(&ty, &ErrorKind::new("http_503"), t(5_000)),
            BreakerState::HalfOpen { probes_left: 0 }
        );
    }

    #[test]
    fn a_lease_reserves_the_probe_slots_of_half_open_types() {
        let mut b = breakers();
        open(&mut b, "a", t(0));
        let p = Paused::default();
        let park = BTreeSet::new();
        let mut g = Gate {
            paused: &p,
            breakers: &mut b,
            park_lanes: &park,
        };
        let f = g.lease_filter(None, 10, t(5_000));
        assert_eq!(f.type_limits, [(JobType::new("a"), 1)]);
        assert_eq!(f.reservations.len(), 1);
        // Reserved: a second lease meanwhile finds none left.
        let f2 = g.lease_filter(None, 10, t(5_000));
        assert_eq!(f2.exclude_types, [JobType::new("a")]);
        // Refunded unused, the slot is there again.
        for r in f.reservations {
            b.refund(r, 0);
        }
        let mut g = Gate {
            paused: &p,
            breakers: &mut b,
            park_lanes: &park,
        };
        assert_eq!(g.lease_filter(None, 10, t(5_000)).type_limits.len(), 1);
    }
}

#[cfg(test)]
mod props {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;
    use crate::breaker::BreakerConfig;
    use crate::ids::ErrorKind;

    const TYPES: [&str; 3] = ["a", "b", "c"];
    const LANES: [&str; 3] = ["default", "slow", "parked"];

    proptest! {
        /// Whatever is paused, open or parked: a held-back message is never
        /// delivered, a paused one is refused by every question, a lease
        /// leaves out every type it may not take, and a park lane is shed
        /// only by a pause.
        #[test]
        fn the_four_answers_agree(
            paused_types in prop::collection::btree_set(0..TYPES.len(), 0..=2),
            paused_lanes in prop::collection::btree_set(0..LANES.len(), 0..=2),
            failures in prop::collection::vec((0..TYPES.len(), 0i64..20_000), 0..20),
            ask in 0i64..40_000,
            ty in 0..TYPES.len(),
            lane in 0..LANES.len(),
        ) {
            let config = BreakerConfig {
                failures_min: 2,
                failure_ratio: 0.5,
                window: Duration::from_secs(10),
                cooldown: Duration::from_secs(5),
                probes: 1,
            };
            let mut b = Breakers::new(Some(config), BTreeMap::new());
            let mut at = failures.clone();
            at.sort_by_key(|(_, ms)| *ms);
            for (t, ms) in at {
                b.record_failure(&JobType::new(TYPES[t]), &ErrorKind::new("x"), Timestamp::from_millis(ms));
            }
            let p = Paused {
                types: paused_types.iter().map(|i| TYPES[*i].to_owned()).collect(),
                lanes: paused_lanes.iter().map(|i| LANES[*i].to_owned()).collect(),
            };
            let park = BTreeSet::from([Lane::new("parked")]);
            let now = Timestamp::from_millis(ask);
            let (ty, lane) = (JobType::new(TYPES[ty]), Lane::new(LANES[lane]));
            let is_paused = p.holds(ty.as_str(), lane.as_str());
            let mut g = Gate { paused: &p, breakers: &mut b, park_lanes: &park };

            let held = g.held_back(&ty, &lane, now);
            let shed = g.shed(&ty, &lane, now);
            let f = g.lease_filter(None, 1, now);
            let delivered = g.try_deliver(&ty, &lane, now);
            if held.is_some() {
                prop_assert!(delivered.is_err());
                prop_assert!(shed.is_some() || park.contains(&lane));
            }
            if let Err(wait) = delivered {
                prop_assert!(wait > Duration::ZERO);
            }
            if is_paused {
                prop_assert_eq!(held, Some(PAUSED_RECHECK));
                prop_assert_eq!(shed, Some(PAUSED_RETRY_AFTER));
                prop_assert_eq!(delivered, Err(PAUSED_RECHECK));
                prop_assert!(
                    f.exclude_types.contains(&ty) || f.exclude_lanes.contains(&lane)
                );
            } else if park.contains(&lane) {
                prop_assert_eq!(shed, None);
            }
            // No type is both left out and limited.
            for (t, n) in &f.type_limits {
                prop_assert!(!f.exclude_types.contains(t));
                prop_assert!(*n >= 1);
            }
        }
    }
}
