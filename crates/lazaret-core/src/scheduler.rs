//! Fair scheduling: which lanes and tenants get the next leases, decided from counts alone.
//!
//! The store reports one [`Demand`] row per (lane, tenant): how many jobs are
//! ready and how many are leased. [`FairScheduler::pick`] answers with
//! [`Grant`]s (how many of each row to lease) under three rules:
//!
//! 1. **Lanes by weight, idle shares lent.** A lane's weight is its share of
//!    leases among the lanes that have leasable work *now*. Lanes are chosen
//!    by start-time fair queuing (stride scheduling with a virtual clock):
//!    each lease costs a lane `STRIDE_UNIT / weight` of virtual time, and the
//!    candidate lane with the earliest virtual time goes next (ties: heavier
//!    lane first, then name order). A lane with nothing leasable is not a
//!    candidate, so its share goes to the others and no slot idles while work
//!    waits. A lane that comes back starts no earlier than the virtual time of
//!    the last lease: it cannot bank its idle time into a burst that would
//!    shut the other lanes out, and it gains at most one lease on its return.
//!    A lane may also hold a **reserve** (`lane_reserves`): a share of the
//!    leases held, counted over the lanes of the demand, kept for it while
//!    it has leasable work. A lane that holds less than its reserve of the
//!    leases in flight (counting the one being granted) goes before every
//!    lane that does not, whatever the weights say; among several such
//!    lanes the virtual clock decides. A lane with nothing leasable claims
//!    nothing, so its reserve is lent to the others, and it takes it back
//!    lease by lease as capacity frees up (leases are never taken away).
//!    A lease granted on a reserve still costs the lane its stride, so the
//!    reserve is a floor under the lane's share, not a share on top of it.
//! 2. **Tenants round-robin inside a lane.** Tenants are visited in name order
//!    starting after the last one served (deficit round robin with a quantum
//!    of one job). A tenant with 10,000 ready jobs gets one lease per round
//!    like everyone else, so another tenant's first job waits at most one round.
//! 3. **In-flight caps.** A tenant never holds more than its cap of leases in
//!    one lane; a tenant at its cap is skipped, it does not block the round.
//!
//! Starvation-freedom: inside a lane, the round-robin cursor only moves
//! forward in the cyclic name order and passes a tenant only by serving it or
//! by finding it with nothing leasable. So a tenant that keeps leasable work
//! is served within *n* picks of its lane, *n* being the number of tenants of
//! that lane in the demand (or the number with leasable work, if no tenant
//! regains capacity meanwhile). Across lanes, a candidate lane `l` is at most
//! one of its strides ahead of the virtual clock, so before it is served each
//! other lane `j` gets at most `w_j / w_l + 1` leases.
//!
//! The soft state (each lane's virtual time and last served tenant) may be
//! lost on restart: the caller rebuilds the demand from the store and fairness
//! resumes from there. The cursor is kept as the tenant's *name*, so it stays
//! meaningful when demand rows appear, disappear or come in another order.
//!
//! Picking allocates nothing per job: the scheduler sorts indices into scratch
//! buffers it keeps between calls, so once warmed up a call allocates only
//! when a lane is seen for the first time or the demand outgrows the buffers.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::fmt;

use crate::ids::{Lane, TenantId};

/// Virtual time one lease costs a lane of weight 1; weight `w` pays `STRIDE_UNIT / w`.
///
/// 2^64 keeps the rounding error of every `u32` weight's stride below one part
/// in 2^32, and a `u128` virtual time cannot overflow before 2^64 leases.
const STRIDE_UNIT: u128 = 1 << 64;

/// How many lanes' soft state is kept before lanes absent from the demand are forgotten.
///
/// Lane names come from enqueued jobs; this bounds the memory a stream of
/// one-off lane names could take. Forgetting a lane only costs it its place
/// in the round (it restarts at the current virtual time).
const LANE_STATES_MAX: usize = 1024;

/// A share of lease capacity in millionths: `Share::from_fraction(0.2)` is
/// 200,000 parts of [`Share::PARTS`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Share(u32);

impl Share {
    /// The parts of a whole.
    pub const PARTS: u32 = 1_000_000;

    /// The share `fraction` of a whole, rounded to the nearest millionth;
    /// `None` unless `0 <= fraction <= 1`.
    pub fn from_fraction(fraction: f64) -> Option<Share> {
        (0.0..=1.0)
            .contains(&fraction)
            .then(|| Share((fraction * f64::from(Self::PARTS)).round() as u32))
    }

    /// `parts` millionths; `None` over [`Share::PARTS`].
    pub const fn from_parts(parts: u32) -> Option<Share> {
        if parts <= Self::PARTS {
            Some(Share(parts))
        } else {
            None
        }
    }

    /// The millionths.
    pub const fn parts(self) -> u32 {
        self.0
    }

    /// As a fraction of 1.
    pub fn as_fraction(self) -> f64 {
        f64::from(self.0) / f64::from(Self::PARTS)
    }
}

impl fmt::Display for Share {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.as_fraction())
    }
}

/// How leases are shared: lane weights and reserves, tenants' in-flight caps.
///
/// Check it with [`SchedulerConfig::validate`]; [`FairScheduler::new`] does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Each lane's weight: its share of leases while several lanes have
    /// leasable work. Must be at least 1.
    pub lane_weights: BTreeMap<Lane, u32>,
    /// The weight of a lane not named in `lane_weights`. Must be at least 1.
    pub default_lane_weight: u32,
    /// Each lane's reserve: the share of the leases held that is kept for
    /// it while it has leasable work (see the [module docs](self)). Lanes
    /// not named reserve nothing; the reserves may add up to 1 at most.
    pub lane_reserves: BTreeMap<Lane, Share>,
    /// How many jobs one tenant may hold leased in one lane, unless
    /// overridden. Must be at least 1.
    pub inflight_max: u32,
    /// Per-tenant overrides of `inflight_max`. An override of 0 is allowed
    /// and pauses that tenant: it is never granted a lease.
    pub tenant_inflight_max: BTreeMap<TenantId, u32>,
    /// How many distinct tenants may have jobs ready at once (`None`: no
    /// bound). A job of a tenant with none ready is refused at the bound
    /// ([`SchedulerConfig::admits_tenant`]).
    pub tenants_ready_max: Option<u32>,
}

impl SchedulerConfig {
    /// Every lane weighs 1 and every tenant may hold `inflight_max` leases per lane.
    pub fn new(inflight_max: u32) -> Self {
        SchedulerConfig {
            lane_weights: BTreeMap::new(),
            default_lane_weight: 1,
            lane_reserves: BTreeMap::new(),
            inflight_max,
            tenant_inflight_max: BTreeMap::new(),
            tenants_ready_max: None,
        }
    }

    /// The same config with `lane` weighing `weight`.
    pub fn with_lane_weight(mut self, lane: impl Into<Lane>, weight: u32) -> Self {
        self.lane_weights.insert(lane.into(), weight);
        self
    }

    /// The same config with `lane` reserving `share` of the leases held.
    pub fn with_lane_reserve(mut self, lane: impl Into<Lane>, share: Share) -> Self {
        self.lane_reserves.insert(lane.into(), share);
        self
    }

    /// Whether any lane holds a reserve: the demand must then list the
    /// (lane, tenant) pairs that hold leases but have nothing ready too,
    /// since the reserves are shares of every lease held.
    pub fn has_reserves(&self) -> bool {
        self.lane_reserves.values().any(|r| r.parts() > 0)
    }

    /// The same config with `tenant`'s in-flight cap set to `inflight_max`.
    pub fn with_tenant_inflight_max(
        mut self,
        tenant: impl Into<TenantId>,
        inflight_max: u32,
    ) -> Self {
        self.tenant_inflight_max.insert(tenant.into(), inflight_max);
        self
    }

    /// Checks that every weight and the default cap are at least 1.
    ///
    /// A weight of 0 is rejected rather than read as 1 (or as "paused", or as
    /// "only when the others are idle"): each reading is plausible, so the
    /// config must say what it means instead of the scheduler guessing.
    pub fn validate(&self) -> Result<(), SchedulerConfigError> {
        if let Some((lane, _)) = self.lane_weights.iter().find(|(_, w)| **w == 0) {
            return Err(SchedulerConfigError::ZeroLaneWeight { lane: lane.clone() });
        }
        if self.default_lane_weight == 0 {
            return Err(SchedulerConfigError::ZeroDefaultLaneWeight);
        }
        if self.inflight_max == 0 {
            return Err(SchedulerConfigError::ZeroInflightMax);
        }
        let total: u64 = self
            .lane_reserves
            .values()
            .map(|r| u64::from(r.parts()))
            .sum();
        if total > u64::from(Share::PARTS) {
            return Err(SchedulerConfigError::ReservesOverOne { total_parts: total });
        }
        Ok(())
    }

    /// `lane`'s reserve (nothing unless configured).
    pub fn lane_reserve(&self, lane: &Lane) -> Share {
        self.lane_reserves.get(lane).copied().unwrap_or_default()
    }

    fn lane_weight(&self, lane: &Lane) -> u32 {
        self.lane_weights
            .get(lane)
            .copied()
            .unwrap_or(self.default_lane_weight)
    }

    /// The in-flight cap of `tenant` in each lane: its override, else the default.
    pub fn inflight_max_for(&self, tenant: &TenantId) -> u32 {
        self.tenant_inflight_max
            .get(tenant)
            .copied()
            .unwrap_or(self.inflight_max)
    }

    /// Whether a tenant holding `inflight` leases in a lane is at its cap
    /// there (the gateway then answers `FAIR_QUEUE`).
    pub fn at_cap(&self, tenant: &TenantId, inflight: u32) -> bool {
        inflight >= self.inflight_max_for(tenant)
    }

    /// Whether a new job of a tenant may be queued, given whether the
    /// tenant has jobs ready already (`has_ready`, in any lane) and how many
    /// distinct tenants have jobs ready (`tenants_ready`): a tenant already
    /// in the ready set always may; a new one only below
    /// `tenants_ready_max`. Tenant names are chosen by producers, and
    /// every ready tenant is a place in the round-robin, so the bound is
    /// how an operator caps that set.
    pub fn admits_tenant(&self, has_ready: bool, tenants_ready: usize) -> bool {
        has_ready
            || self
                .tenants_ready_max
                .is_none_or(|max| tenants_ready < max as usize)
    }

    /// Whether one of `tenant`'s leases in a lane ending frees a slot that
    /// someone waits for: the tenant held `inflight` leases there (this one
    /// included), so it was at its cap, and has `ready` jobs that the cap
    /// kept back. Long-polls should then look again; any other lease end
    /// changes nothing a waiting lease could take.
    pub fn frees_slot(&self, tenant: &TenantId, inflight: u32, ready: u32) -> bool {
        self.at_cap(tenant, inflight) && ready > 0
    }
}

/// A [`SchedulerConfig`] that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SchedulerConfigError {
    /// A lane is configured with weight 0.
    #[error(
        "lane `{lane}` has weight 0; a weight is the lane's share of leases while lanes compete, so it must be at least 1 (to shrink this lane's share, raise the other lanes' weights)"
    )]
    ZeroLaneWeight {
        /// The lane whose weight is 0.
        lane: Lane,
    },
    /// `default_lane_weight` is 0.
    #[error(
        "default_lane_weight is 0; lanes without a configured weight need a share of leases, so set it to at least 1"
    )]
    ZeroDefaultLaneWeight,
    /// `inflight_max` is 0.
    #[error(
        "inflight_max is 0, so no tenant could ever lease a job; set it to at least 1 (to pause one tenant, set its entry in tenant_inflight_max to 0)"
    )]
    ZeroInflightMax,
    /// The lanes' reserves add up to more than the whole capacity.
    #[error(
        "the lanes' reserves add up to {}; each reserve is a share of the leases held, so together they can keep at most all of them (1): lower some reserves",
        *.total_parts as f64 / f64::from(Share::PARTS)
    )]
    ReservesOverOne {
        /// What they add up to, in millionths.
        total_parts: u64,
    },
}

/// One (lane, tenant) pair's counts, as the store reports them.
///
/// Rows may come in any order. There should be one row per (lane, tenant);
/// if a pair appears twice, its rows are pooled (their `inflight` add up
/// against the one cap), so a duplicate can never lift a tenant over its cap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand<'a> {
    /// The lane the jobs wait in.
    pub lane: &'a Lane,
    /// The tenant the jobs belong to.
    pub tenant: &'a TenantId,
    /// Jobs ready to be leased now.
    pub ready: u32,
    /// Jobs of this tenant currently leased in this lane.
    pub inflight: u32,
}

/// Lease `count` jobs of the demand row at `demand_index`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Grant {
    /// Index of the row in the slice passed to [`FairScheduler::pick`].
    pub demand_index: usize,
    /// How many of its ready jobs to lease; at least 1.
    pub count: u32,
}

/// Chooses which lanes and tenants get the next leases; see the [module docs](self).
///
/// Input: [`pick`](Self::pick) with the current demand. Getters:
/// [`at_cap`](Self::at_cap), [`inflight_max`](Self::inflight_max),
/// [`lane_weight`](Self::lane_weight), [`config`](Self::config). The caller
/// applies the grants (leases the jobs) and reports the new counts next time;
/// the scheduler keeps only soft state between calls.
#[derive(Clone)]
pub struct FairScheduler {
    config: SchedulerConfig,
    /// The virtual time of the last lease granted; lanes never start behind it.
    vtime: u128,
    /// Soft state of lanes that were served at least once.
    lanes: BTreeMap<Lane, LaneState>,
    // Scratch buffers, reused across calls so that picking does not allocate.
    order: Vec<usize>,
    tenants: Vec<TenantSlot>,
    spans: Vec<LaneSpan>,
    granted: Vec<u32>,
    /// Leases held over the demand's lanes during a pick.
    held: u64,
}

impl fmt::Debug for FairScheduler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FairScheduler")
            .field("config", &self.config)
            .field("vtime", &self.vtime)
            .field("lanes", &self.lanes)
            .finish_non_exhaustive()
    }
}

#[derive(Clone, Debug, Default)]
struct LaneState {
    /// The lane's virtual time: when it may next be served.
    pass: u128,
    /// Name of the last tenant served. A `String`, not a `TenantId`, so the
    /// buffer is reused instead of reallocated on every pick.
    last_served: Option<String>,
}

/// One (lane, tenant) pair during a pick: a run of `order`.
#[derive(Clone, Copy, Debug)]
struct TenantSlot {
    rows_start: usize,
    rows_end: usize,
    leasable: u32,
}

/// One lane during a pick: a run of `tenants`.
#[derive(Clone, Copy, Debug)]
struct LaneSpan {
    tenants_start: usize,
    tenants_end: usize,
    /// A demand row of this lane, to name it.
    row: usize,
    weight: u32,
    /// The lane's reserve, in millionths.
    reserve: u32,
    /// Leases the lane holds, those granted during this pick included.
    held: u64,
    pass: u128,
    leasable: u64,
    /// The tenant slot the round resumes at.
    next: usize,
    /// The last tenant slot served during this pick.
    served: Option<usize>,
}

impl FairScheduler {
    /// A scheduler with no history, or the config's error.
    pub fn new(config: SchedulerConfig) -> Result<Self, SchedulerConfigError> {
        config.validate()?;
        Ok(FairScheduler {
            config,
            vtime: 0,
            lanes: BTreeMap::new(),
            order: Vec::new(),
            tenants: Vec::new(),
            spans: Vec::new(),
            granted: Vec::new(),
            held: 0,
        })
    }

    /// The config this scheduler was built with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The tenant `lane`'s round resumes after: the last one served
    /// (`None`: the round starts at the first tenant in name order). A
    /// lease needs only the lane's pairs that come next in the cyclic name
    /// order from here ([`crate::LaneWindow`]).
    pub fn resume_after(&self, lane: &Lane) -> Option<&str> {
        self.lanes.get(lane)?.last_served.as_deref()
    }

    /// `lane`'s weight: configured, or the default.
    pub fn lane_weight(&self, lane: &Lane) -> u32 {
        self.config.lane_weight(lane)
    }

    /// `lane`'s reserve: configured, or nothing.
    pub fn lane_reserve(&self, lane: &Lane) -> Share {
        self.config.lane_reserve(lane)
    }

    /// How many leases `tenant` may hold in one lane.
    pub fn inflight_max(&self, tenant: &TenantId) -> u32 {
        self.config.inflight_max_for(tenant)
    }

    /// Whether a tenant holding `inflight` leases in a lane is at its cap
    /// there (the gateway then answers `FAIR_QUEUE`).
    pub fn at_cap(&self, tenant: &TenantId, inflight: u32) -> bool {
        self.config.at_cap(tenant, inflight)
    }

    /// Whether a lease of `tenant` ending frees a capped slot with jobs
    /// waiting ([`SchedulerConfig::frees_slot`]); `inflight` counts the
    /// ending lease. Both stores ask this when a lease ends.
    pub fn frees_slot(&self, tenant: &TenantId, inflight: u32, ready: u32) -> bool {
        self.config.frees_slot(tenant, inflight, ready)
    }

    /// Chooses up to `max_jobs` leases among `demand`.
    ///
    /// Clears `out`, then appends one [`Grant`] per row that gets any, in
    /// ascending `demand_index`. Grants never exceed a row's `ready` nor lift
    /// a tenant over its cap, and add up to `max_jobs` or to everything
    /// leasable, whichever is smaller. The result depends on the rows'
    /// contents and the soft state, not on the rows' order (except, for
    /// duplicate rows of one pair, which of them a grant is drawn from).
    ///
    /// Cost: sorting the rows, then per lease a scan of the lanes and an
    /// amortised step of the lane's round.
    pub fn pick(&mut self, demand: &[Demand<'_>], max_jobs: u32, out: &mut Vec<Grant>) {
        out.clear();
        self.granted.clear();
        self.granted.resize(demand.len(), 0);
        if max_jobs == 0 || demand.is_empty() {
            return;
        }
        self.prepare(demand);

        let mut remaining = max_jobs;
        while remaining > 0 {
            let Some((s, on_reserve)) = self.next_lane() else {
                break;
            };
            let span = &mut self.spans[s];
            // `max`: a lane returning from idle starts at the current virtual time.
            let start = span.pass.max(self.vtime);
            // A lease on a reserve jumps the weighted order: it moves the
            // lane's own clock, not everyone's.
            if !on_reserve {
                self.vtime = start;
            }
            span.pass = start + STRIDE_UNIT / u128::from(span.weight);
            span.leasable -= 1;
            span.held += 1;
            self.held += 1;

            // The lane has leasable work, so some tenant of its round does.
            let mut t = span.next;
            while self.tenants[t].leasable == 0 {
                t = if t + 1 == span.tenants_end {
                    span.tenants_start
                } else {
                    t + 1
                };
            }
            span.next = if t + 1 == span.tenants_end {
                span.tenants_start
            } else {
                t + 1
            };
            span.served = Some(t);

            let slot = &mut self.tenants[t];
            slot.leasable -= 1;
            let row = self.order[slot.rows_start..slot.rows_end]
                .iter()
                .copied()
                .find(|&r| self.granted[r] < demand[r].ready)
                .expect("a leasable tenant has a row with ready jobs left");
            self.granted[row] += 1;
            remaining -= 1;
        }

        self.write_back(demand);
        out.extend(
            self.granted
                .iter()
                .enumerate()
                .filter(|(_, c)| **c > 0)
                .map(|(demand_index, &count)| Grant {
                    demand_index,
                    count,
                }),
        );
    }

    /// Sorts the rows by (lane, tenant) and fills `tenants` and `spans`.
    fn prepare(&mut self, demand: &[Demand<'_>]) {
        self.order.clear();
        self.order.extend(0..demand.len());
        self.order.sort_unstable_by(|&a, &b| {
            let (x, y) = (&demand[a], &demand[b]);
            x.lane
                .cmp(y.lane)
                .then_with(|| x.tenant.cmp(y.tenant))
                .then(a.cmp(&b))
        });

        self.tenants.clear();
        let mut i = 0;
        while i < self.order.len() {
            let first = &demand[self.order[i]];
            let (mut ready, mut inflight) = (0u64, 0u64);
            let mut j = i;
            while j < self.order.len() {
                let d = &demand[self.order[j]];
                if d.lane != first.lane || d.tenant != first.tenant {
                    break;
                }
                ready += u64::from(d.ready);
                inflight += u64::from(d.inflight);
                j += 1;
            }
            let room =
                u64::from(self.config.inflight_max_for(first.tenant)).saturating_sub(inflight);
            self.tenants.push(TenantSlot {
                rows_start: i,
                rows_end: j,
                // `room` fits in u32: it is at most a u32 cap.
                leasable: ready.min(room) as u32,
            });
            i = j;
        }

        self.spans.clear();
        self.held = 0;
        let mut i = 0;
        while i < self.tenants.len() {
            let row = self.order[self.tenants[i].rows_start];
            let lane = demand[row].lane;
            let mut leasable = 0u64;
            let mut held = 0u64;
            let mut j = i;
            while j < self.tenants.len()
                && demand[self.order[self.tenants[j].rows_start]].lane == lane
            {
                let t = &self.tenants[j];
                leasable += u64::from(t.leasable);
                held += self.order[t.rows_start..t.rows_end]
                    .iter()
                    .map(|&r| u64::from(demand[r].inflight))
                    .sum::<u64>();
                j += 1;
            }
            self.held += held;
            let state = self.lanes.get(lane);
            // Resume the round after the last tenant served, found by name.
            let next = match state.and_then(|s| s.last_served.as_deref()) {
                None => i,
                Some(last) => {
                    let after = self.tenants[i..j].partition_point(|t| {
                        demand[self.order[t.rows_start]].tenant.as_str() <= last
                    });
                    if i + after == j { i } else { i + after }
                }
            };
            self.spans.push(LaneSpan {
                tenants_start: i,
                tenants_end: j,
                row,
                weight: self.config.lane_weight(lane),
                reserve: self.config.lane_reserve(lane).parts(),
                held,
                pass: state.map_or(0, |s| s.pass),
                leasable,
                next,
                served: None,
            });
            i = j;
        }
    }

    /// The lane with leasable work that holds less than its reserve, or
    /// else any lane with leasable work; the earliest virtual time first,
    /// ties to the heavier lane, then to the lane first in name order.
    /// `true` with it when the lease is granted on the lane's reserve.
    fn next_lane(&self) -> Option<(usize, bool)> {
        // Below its reserve: holding `held` of `self.held + 1` leases (the
        // one being granted counted) is less than `reserve` of them.
        let total = u128::from(self.held) + 1;
        let below = |s: &LaneSpan| {
            u128::from(s.held) * u128::from(Share::PARTS) < u128::from(s.reserve) * total
        };
        let key = |(i, s): &(usize, &LaneSpan)| (s.pass.max(self.vtime), Reverse(s.weight), *i);
        let candidates = || {
            self.spans
                .iter()
                .enumerate()
                .filter(|(_, s)| s.leasable > 0)
        };
        if let Some((i, _)) = candidates().filter(|(_, s)| below(s)).min_by_key(key) {
            return Some((i, true));
        }
        candidates().min_by_key(key).map(|(i, _)| (i, false))
    }

    /// Saves the served lanes' virtual time and last tenant.
    fn write_back(&mut self, demand: &[Demand<'_>]) {
        for span in &self.spans {
            let Some(t) = span.served else { continue };
            let lane = demand[span.row].lane;
            let tenant = demand[self.order[self.tenants[t].rows_start]]
                .tenant
                .as_str();
            let state = match self.lanes.get_mut(lane) {
                Some(state) => state,
                None => self.lanes.entry(lane.clone()).or_default(),
            };
            state.pass = span.pass;
            match &mut state.last_served {
                Some(name) => {
                    name.clear();
                    name.push_str(tenant);
                }
                None => state.last_served = Some(tenant.to_owned()),
            }
        }
        if self.lanes.len() > LANE_STATES_MAX {
            let spans = &self.spans;
            self.lanes.retain(|lane, _| {
                spans
                    .binary_search_by(|s| demand[s.row].lane.cmp(lane))
                    .is_ok()
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::collections::BTreeSet;
    use std::fmt::Write as _;

    use expect_test::expect;
    use proptest::prelude::*;

    use crate::rng::{Entropy, SplitMix64};

    /// An owned demand row, so tests can apply grants and pick again.
    #[derive(Clone, Debug)]
    struct Row {
        lane: Lane,
        tenant: TenantId,
        ready: u32,
        inflight: u32,
    }

    #[test]
    fn a_lease_end_frees_a_slot_only_for_a_tenant_at_its_cap_with_jobs_ready() {
        let s = FairScheduler::new(
            SchedulerConfig::new(2).with_tenant_inflight_max(TenantId::from("big"), 5),
        )
        .unwrap();
        let (acme, big) = (TenantId::from("acme"), TenantId::from("big"));
        // (tenant, in flight with the ending lease, ready) → freed
        let cases = [
            (&acme, 2, 1, true),
            (&acme, 3, 7, true),
            (&acme, 2, 0, false),
            (&acme, 1, 9, false),
            (&acme, 0, 9, false),
            (&big, 2, 9, false),
            (&big, 5, 1, true),
        ];
        for (tenant, inflight, ready, freed) in cases {
            assert_eq!(
                s.frees_slot(tenant, inflight, ready),
                freed,
                "{tenant} holding {inflight} with {ready} ready"
            );
        }
    }

    fn row(lane: &str, tenant: &str, ready: u32, inflight: u32) -> Row {
        Row {
            lane: lane.into(),
            tenant: tenant.into(),
            ready,
            inflight,
        }
    }

    fn demand_of(rows: &[Row]) -> Vec<Demand<'_>> {
        rows.iter()
            .map(|r| Demand {
                lane: &r.lane,
                tenant: &r.tenant,
                ready: r.ready,
                inflight: r.inflight,
            })
            .collect()
    }

    /// Picks and leases: the grants' jobs move from ready to in flight.
    fn pick_and_apply(s: &mut FairScheduler, rows: &mut [Row], max_jobs: u32) -> Vec<Grant> {
        let mut out = Vec::new();
        s.pick(&demand_of(rows), max_jobs, &mut out);
        for g in &out {
            rows[g.demand_index].ready -= g.count;
            rows[g.demand_index].inflight += g.count;
        }
        out
    }

    fn leasable(s: &FairScheduler, r: &Row) -> u32 {
        r.ready
            .min(s.inflight_max(&r.tenant).saturating_sub(r.inflight))
    }

    fn interactive_and_batch(inflight_max: u32) -> FairScheduler {
        FairScheduler::new(
            SchedulerConfig::new(inflight_max)
                .with_lane_weight("interactive", 4)
                .with_lane_weight("batch", 1),
        )
        .unwrap()
    }

    fn granted_to(rows: &[Row], grants: &[Grant], lane: &str) -> u32 {
        grants
            .iter()
            .filter(|g| rows[g.demand_index].lane.as_str() == lane)
            .map(|g| g.count)
            .sum()
    }

    #[test]
    fn an_idle_lane_lends_its_share() {
        let mut s = interactive_and_batch(100);
        let mut rows = vec![
            row("interactive", "acme", 0, 0),
            row("batch", "acme", 50, 0),
        ];
        let grants = pick_and_apply(&mut s, &mut rows, 10);
        assert_eq!(granted_to(&rows, &grants, "batch"), 10);

        // Both lanes busy: interactive gets 4 leases in 5, give or take the
        // one lease its return may win (batch was served ahead, alone).
        rows[0].ready = 100;
        let grants = pick_and_apply(&mut s, &mut rows, 50);
        let interactive = granted_to(&rows, &grants, "interactive");
        assert!(interactive.abs_diff(40) <= 1, "{interactive}");
        assert_eq!(granted_to(&rows, &grants, "batch"), 50 - interactive);

        // Interactive has one job: it takes it, batch takes the rest.
        rows[0].ready = 1;
        let grants = pick_and_apply(&mut s, &mut rows, 10);
        assert_eq!(granted_to(&rows, &grants, "interactive"), 1);
        assert_eq!(granted_to(&rows, &grants, "batch"), 9);
    }

    #[test]
    fn a_tenant_at_its_cap_is_skipped_not_blocking() {
        let mut s =
            FairScheduler::new(SchedulerConfig::new(3).with_tenant_inflight_max("paused", 0))
                .unwrap();
        let mut rows = vec![
            row("default", "acme", 100, 2),
            row("default", "globex", 100, 0),
            row("default", "paused", 100, 0),
        ];
        let grants = pick_and_apply(&mut s, &mut rows, 100);
        assert_eq!(
            grants,
            [
                Grant {
                    demand_index: 0,
                    count: 1
                },
                Grant {
                    demand_index: 1,
                    count: 3
                },
            ]
        );
        assert!(s.at_cap(&"acme".into(), 3));
        assert!(!s.at_cap(&"acme".into(), 2));
        assert!(s.at_cap(&"paused".into(), 0));
        // Everyone is at the cap now: nothing more, however much is asked.
        assert!(pick_and_apply(&mut s, &mut rows, 100).is_empty());
    }

    #[test]
    fn a_big_backlog_does_not_delay_a_small_tenants_first_job() {
        let mut s = FairScheduler::new(SchedulerConfig::new(1_000_000)).unwrap();
        let mut rows = vec![row("default", "zeta", 10_000, 0)];
        for _ in 0..100 {
            pick_and_apply(&mut s, &mut rows, 1);
        }
        // "acme" sorts before "zeta" and "zeta" was served last: acme goes next.
        rows.push(row("default", "acme", 1, 0));
        let grants = pick_and_apply(&mut s, &mut rows, 1);
        assert_eq!(
            grants,
            [Grant {
                demand_index: 1,
                count: 1
            }]
        );

        // Same in one batch: the first round serves both.
        let mut s = FairScheduler::new(SchedulerConfig::new(1_000_000)).unwrap();
        let mut rows = vec![
            row("default", "acme", 10_000, 0),
            row("default", "zeta", 1, 0),
        ];
        let grants = pick_and_apply(&mut s, &mut rows, 2);
        assert_eq!(
            grants,
            [
                Grant {
                    demand_index: 0,
                    count: 1
                },
                Grant {
                    demand_index: 1,
                    count: 1
                },
            ]
        );
    }

    #[test]
    fn duplicate_rows_share_one_cap() {
        let mut s = FairScheduler::new(SchedulerConfig::new(4)).unwrap();
        let mut rows = vec![row("default", "acme", 10, 1), row("default", "acme", 10, 1)];
        let grants = pick_and_apply(&mut s, &mut rows, 10);
        assert_eq!(
            grants,
            [Grant {
                demand_index: 0,
                count: 2
            }]
        );
    }

    #[test]
    fn zero_weights_are_rejected_with_a_reason() {
        let err =
            FairScheduler::new(SchedulerConfig::new(1).with_lane_weight("batch", 0)).unwrap_err();
        assert_eq!(
            err,
            SchedulerConfigError::ZeroLaneWeight {
                lane: "batch".into()
            }
        );
        assert!(
            err.to_string().contains("lane `batch` has weight 0"),
            "{err}"
        );

        let mut config = SchedulerConfig::new(1);
        config.default_lane_weight = 0;
        assert_eq!(
            config.validate(),
            Err(SchedulerConfigError::ZeroDefaultLaneWeight)
        );
        assert_eq!(
            SchedulerConfig::new(0).validate(),
            Err(SchedulerConfigError::ZeroInflightMax)
        );
        assert_eq!(
            SchedulerConfig::new(1)
                .with_tenant_inflight_max("t", 0)
                .validate(),
            Ok(())
        );
    }

    #[test]
    fn pick_order_two_lanes_three_tenants() {
        // globex has one interactive job; initech is one lease from its batch cap.
        let mut s = interactive_and_batch(3);
        let mut rows = vec![
            row("interactive", "acme", 9, 0),
            row("interactive", "globex", 1, 0),
            row("interactive", "initech", 9, 0),
            row("batch", "acme", 9, 0),
            row("batch", "globex", 9, 0),
            row("batch", "initech", 9, 2),
        ];
        let mut table =
            String::from("pick  lane         tenant  (interactive 4, batch 1, cap 3)\n");
        for n in 1..=12 {
            let grants = pick_and_apply(&mut s, &mut rows, 1);
            let line = match grants.as_slice() {
                [g] => {
                    let r = &rows[g.demand_index];
                    format!("{:<12} {}", r.lane.as_str(), r.tenant)
                }
                [] => "-".to_owned(),
                _ => unreachable!("one slot, one grant"),
            };
            writeln!(table, "{n:>4}  {line}").unwrap();
        }
        expect![[r#"
            pick  lane         tenant  (interactive 4, batch 1, cap 3)
               1  interactive  acme
               2  batch        acme
               3  interactive  globex
               4  interactive  initech
               5  interactive  acme
               6  interactive  initech
               7  batch        globex
               8  interactive  acme
               9  interactive  initech
              10  batch        initech
              11  batch        acme
              12  batch        globex
        "#]]
        .assert_eq(&table);
    }

    fn share(f: f64) -> Share {
        Share::from_fraction(f).unwrap()
    }

    fn held_by(rows: &[Row], lane: &str) -> u32 {
        rows.iter()
            .filter(|r| r.lane.as_str() == lane)
            .map(|r| r.inflight)
            .sum()
    }

    /// Ends one lease, chosen by `rng` among all held, so that the next
    /// pick has one slot of a fixed capacity to fill.
    fn release_one(rows: &mut [Row], rng: &mut SplitMix64) {
        let held: u32 = rows.iter().map(|r| r.inflight).sum();
        let mut k = rng.below_inclusive(u64::from(held) - 1) as u32;
        for r in rows.iter_mut() {
            if k < r.inflight {
                r.inflight -= 1;
                return;
            }
            k -= r.inflight;
        }
    }

    #[test]
    fn a_reserve_holds_its_share_of_capacity_under_contention() {
        // batch outweighs interactive 9 to 1, but interactive reserves 0.3
        // of the leases held: with ten worker slots, three stay its own.
        let config = |reserve: Option<f64>| {
            let c = SchedulerConfig::new(1000)
                .with_lane_weight("interactive", 1)
                .with_lane_weight("batch", 9);
            match reserve {
                Some(r) => c.with_lane_reserve("interactive", share(r)),
                None => c,
            }
        };
        for (reserve, least) in [(Some(0.3), 3), (None, 0)] {
            let mut s = FairScheduler::new(config(reserve)).unwrap();
            let mut rows = vec![
                row("interactive", "acme", 10_000, 0),
                row("batch", "acme", 10_000, 0),
                row("batch", "globex", 10_000, 0),
            ];
            let mut rng = SplitMix64::new(7);
            pick_and_apply(&mut s, &mut rows, 10);
            let mut fewest = held_by(&rows, "interactive");
            for _ in 0..500 {
                release_one(&mut rows, &mut rng);
                assert_eq!(pick_and_apply(&mut s, &mut rows, 1).len(), 1);
                fewest = fewest.min(held_by(&rows, "interactive"));
            }
            if reserve.is_some() {
                assert_eq!(fewest, least, "the reserve holds after every pick");
            } else {
                assert!(fewest <= 1, "by weight alone interactive holds ~1 in 10");
            }
        }
    }

    #[test]
    fn an_idle_lane_lends_its_reserve_and_takes_it_back_as_leases_end() {
        let mut s = FairScheduler::new(
            SchedulerConfig::new(1000)
                .with_lane_weight("batch", 9)
                .with_lane_reserve("interactive", share(0.4)),
        )
        .unwrap();
        let mut rows = vec![
            row("interactive", "acme", 0, 0),
            row("batch", "acme", 10_000, 0),
        ];
        // Idle: batch takes all ten slots, none kept empty.
        let grants = pick_and_apply(&mut s, &mut rows, 10);
        assert_eq!(granted_to(&rows, &grants, "batch"), 10);

        // Interactive has work again: each slot batch frees goes to it
        // until it holds its four in ten, then batch has the rest.
        rows[0].ready = 100;
        let mut trace = Vec::new();
        for _ in 0..6 {
            rows[1].inflight -= 1;
            let grants = pick_and_apply(&mut s, &mut rows, 1);
            trace.push(rows[grants[0].demand_index].lane.as_str().to_owned());
        }
        assert_eq!(
            trace,
            [
                "interactive",
                "interactive",
                "interactive",
                "interactive",
                "batch",
                "batch"
            ]
        );
        assert_eq!(held_by(&rows, "interactive"), 4);

        // One pick of many slots honours the reserve the same way.
        let mut s = FairScheduler::new(
            SchedulerConfig::new(1000)
                .with_lane_weight("batch", 9)
                .with_lane_reserve("interactive", share(0.4)),
        )
        .unwrap();
        let mut rows = vec![
            row("interactive", "acme", 100, 0),
            row("batch", "acme", 10_000, 0),
        ];
        let grants = pick_and_apply(&mut s, &mut rows, 10);
        assert_eq!(granted_to(&rows, &grants, "interactive"), 4);
    }

    #[test]
    fn reserves_adding_up_past_one_are_rejected() {
        let config = SchedulerConfig::new(1)
            .with_lane_reserve("a", share(0.6))
            .with_lane_reserve("b", share(0.5));
        let err = config.validate().unwrap_err();
        assert_eq!(
            err,
            SchedulerConfigError::ReservesOverOne {
                total_parts: 1_100_000
            }
        );
        assert!(err.to_string().contains("add up to 1.1"), "{err}");
        assert!(
            SchedulerConfig::new(1)
                .with_lane_reserve("a", share(0.6))
                .with_lane_reserve("b", share(0.4))
                .validate()
                .is_ok()
        );
        assert_eq!(Share::from_fraction(1.5), None);
        assert_eq!(Share::from_fraction(-0.1), None);
        assert_eq!(share(0.2).parts(), 200_000);
    }

    // ---- properties ----

    const LANES: [&str; 3] = ["batch", "default", "interactive"];
    const TENANTS: [&str; 4] = ["acme", "globex", "initech", "umbrella"];

    fn config_strategy() -> impl Strategy<Value = SchedulerConfig> {
        (
            prop::collection::btree_map(0..LANES.len(), 1u32..=6, 0..=LANES.len()),
            1u32..=3,
            1u32..=5,
            prop::collection::btree_map(0..TENANTS.len(), 0u32..=5, 0..=2),
        )
            .prop_map(|(weights, default_weight, inflight_max, caps)| {
                let mut config = SchedulerConfig::new(inflight_max);
                config.default_lane_weight = default_weight;
                for (l, w) in weights {
                    config = config.with_lane_weight(LANES[l], w);
                }
                for (t, c) in caps {
                    config = config.with_tenant_inflight_max(TENANTS[t], c);
                }
                config
            })
    }

    /// Unique (lane, tenant) rows in any order.
    fn rows_strategy(ready_max: u32) -> impl Strategy<Value = Vec<Row>> {
        prop::collection::btree_map(
            (0..LANES.len(), 0..TENANTS.len()),
            (0..=ready_max, 0u32..=6),
            0..=12,
        )
        .prop_map(|m| {
            m.into_iter()
                .map(|((l, t), (ready, inflight))| row(LANES[l], TENANTS[t], ready, inflight))
                .collect::<Vec<_>>()
        })
        .prop_shuffle()
    }

    /// A config as [`config_strategy`] makes, with reserves for some lanes
    /// (at most 1 in all).
    fn reserves_strategy() -> impl Strategy<Value = SchedulerConfig> {
        (
            config_strategy(),
            prop::collection::btree_map(0..LANES.len(), 0u32..=500_000, 0..=2),
        )
            .prop_map(|(mut config, reserves)| {
                for (l, parts) in reserves {
                    config = config.with_lane_reserve(LANES[l], Share::from_parts(parts).unwrap());
                }
                config
            })
    }

    proptest! {
        /// A closed system: `capacity` slots, every one held; each step
        /// ends one lease at random and picks one. While the reserved lane
        /// has work it never loses ground below its reserve, gains a slot
        /// each time another lane frees one, and once it holds
        /// floor(reserve × capacity) it keeps at least that many.
        #[test]
        fn a_reserve_is_lent_while_idle_and_held_once_taken_back(
            capacity in 1u32..=40,
            parts in 1u32..=1_000_000,
            weights in prop::collection::vec(1u32..=9, 3),
            seed in any::<u64>(),
        ) {
            let mut config = SchedulerConfig::new(u32::MAX)
                .with_lane_reserve("interactive", Share::from_parts(parts).unwrap());
            for (lane, w) in LANES.iter().zip(&weights) {
                config = config.with_lane_weight(*lane, *w);
            }
            let mut s = FairScheduler::new(config).unwrap();
            let mut rng = SplitMix64::new(seed);
            let mut rows = vec![
                row("interactive", "acme", 0, 0),
                row("interactive", "globex", 0, 0),
                row("batch", "acme", u32::MAX / 2, 0),
                row("default", "initech", u32::MAX / 2, 0),
            ];
            // Idle: the others take every slot.
            let grants = pick_and_apply(&mut s, &mut rows, capacity);
            prop_assert_eq!(grants.iter().map(|g| g.count).sum::<u32>(), capacity);
            prop_assert_eq!(held_by(&rows, "interactive"), 0);

            rows[0].ready = u32::MAX / 2;
            rows[1].ready = u32::MAX / 2;
            let goal = (u64::from(parts) * u64::from(capacity) / u64::from(Share::PARTS)) as u32;
            let mut reached = false;
            for _ in 0..200 {
                let before = held_by(&rows, "interactive");
                let snapshot: Vec<u32> = rows.iter().map(|r| r.inflight).collect();
                release_one(&mut rows, &mut rng);
                let from_other = held_by(&rows, "interactive") == before;
                prop_assert_eq!(pick_and_apply(&mut s, &mut rows, 1).len(), 1);
                let after = held_by(&rows, "interactive");
                if reached {
                    prop_assert!(after >= goal, "fell to {} below {} ({:?})", after, goal, snapshot);
                } else if before < goal {
                    prop_assert!(after >= before);
                    if from_other {
                        prop_assert_eq!(after, before + 1);
                    }
                }
                reached |= after >= goal;
            }
            prop_assert!(reached || goal == 0 || capacity == 0);
        }

        #[test]
        fn grants_stay_within_ready_caps_and_max_and_conserve_work(
            config in reserves_strategy(),
            mut rows in rows_strategy(20),
            max_jobs in prop::collection::vec(0u32..=30, 1..=4),
        ) {
            let mut s = FairScheduler::new(config).unwrap();
            let mut out = Vec::new();
            for max_jobs in max_jobs {
                let capacity: u64 = rows.iter().map(|r| u64::from(leasable(&s, r))).sum();
                s.pick(&demand_of(&rows), max_jobs, &mut out);
                let mut total = 0u64;
                let mut last = None;
                for g in &out {
                    prop_assert!(g.count > 0);
                    prop_assert!(last < Some(g.demand_index), "one grant per row, ascending");
                    last = Some(g.demand_index);
                    let r = &mut rows[g.demand_index];
                    prop_assert!(g.count <= r.ready);
                    prop_assert!(r.inflight + g.count <= s.inflight_max(&r.tenant));
                    r.ready -= g.count;
                    r.inflight += g.count;
                    total += u64::from(g.count);
                }
                prop_assert_eq!(total, capacity.min(u64::from(max_jobs)));
            }
        }

        #[test]
        fn grants_do_not_depend_on_row_order(
            config in reserves_strategy(),
            rows in rows_strategy(20),
            max_jobs in 0u32..=30,
            seed in any::<u64>(),
        ) {
            let mut shuffled = rows.clone();
            let mut rng = SplitMix64::new(seed);
            for i in (1..shuffled.len()).rev() {
                shuffled.swap(i, rng.below_inclusive(i as u64) as usize);
            }
            let by_pair = |rows: &[Row]| {
                let mut s = FairScheduler::new(config.clone()).unwrap();
                let mut out = Vec::new();
                s.pick(&demand_of(rows), max_jobs, &mut out);
                out.iter()
                    .map(|g| (rows[g.demand_index].lane.clone(), rows[g.demand_index].tenant.clone(), g.count))
                    .collect::<BTreeSet<_>>()
            };
            prop_assert_eq!(by_pair(&rows), by_pair(&shuffled));
        }

        /// Every tenant with leasable work is served within n picks of its
        /// lane: n = tenants with leasable work there (which only shrinks
        /// without releases), or all the lane's tenants when releases let
        /// capped tenants come back. Lanes wait a bounded number of leases.
        #[test]
        fn no_tenant_or_lane_starves(
            config in config_strategy(),
            mut rows in rows_strategy(40),
            release in any::<bool>(),
            seed in any::<u64>(),
        ) {
            let mut s = FairScheduler::new(config).unwrap();
            let mut rng = SplitMix64::new(seed);
            let mut waited = vec![0u32; rows.len()];
            let mut bound = vec![0u32; rows.len()];
            let mut lane_waits = BTreeMap::<Lane, BTreeMap<Lane, u32>>::new();
            for _ in 0..300 {
                if release && rng.below_inclusive(2) > 0 {
                    let busy: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].inflight > 0).collect();
                    if !busy.is_empty() {
                        let i = busy[rng.below_inclusive(busy.len() as u64 - 1) as usize];
                        rows[i].inflight -= 1;
                    }
                }
                let can: Vec<bool> = rows.iter().map(|r| leasable(&s, r) > 0).collect();
                let grants = pick_and_apply(&mut s, &mut rows, 1);
                let Some(g) = grants.first() else {
                    prop_assert!(!can.contains(&true), "work-conserving");
                    lane_waits.clear();
                    continue;
                };
                let lane = rows[g.demand_index].lane.clone();

                // While lane l waits with leasable work, each other lane j
                // gets at most w_j / w_l + 1 leases.
                for l in LANES.map(Lane::from) {
                    let candidate = (0..rows.len()).any(|i| can[i] && rows[i].lane == l);
                    let counts = lane_waits.entry(l.clone()).or_default();
                    if !candidate || l == lane {
                        counts.clear();
                        continue;
                    }
                    let count = counts.entry(lane.clone()).or_default();
                    *count += 1;
                    let bound = f64::from(s.lane_weight(&lane)) / f64::from(s.lane_weight(&l)) + 1.0;
                    prop_assert!(
                        f64::from(*count) <= bound,
                        "{} waited through {} leases of {}", l, count, lane
                    );
                }

                let in_lane: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].lane == lane).collect();
                let n = if release {
                    in_lane.len() as u32
                } else {
                    in_lane.iter().filter(|&&i| can[i]).count() as u32
                };
                for &i in &in_lane {
                    if !can[i] {
                        waited[i] = 0;
                        bound[i] = 0;
                        continue;
                    }
                    bound[i] = bound[i].max(n);
                    if i == g.demand_index {
                        prop_assert!(waited[i] < bound[i]);
                        waited[i] = 0;
                        bound[i] = 0;
                    } else {
                        waited[i] += 1;
                        prop_assert!(
                            waited[i] < bound[i],
                            "{} in {} waited {} picks of its lane", rows[i].tenant, lane, waited[i]
                        );
                    }
                }
            }
        }

        #[test]
        fn busy_lanes_share_by_weight(
            weights in prop::collection::btree_map(0..LANES.len(), 1u32..=8, 1..=LANES.len()),
            tenants in 1usize..=TENANTS.len(),
        ) {
            let mut config = SchedulerConfig::new(u32::MAX);
            for (&l, &w) in &weights {
                config = config.with_lane_weight(LANES[l], w);
            }
            let mut s = FairScheduler::new(config).unwrap();
            let mut rows: Vec<Row> = weights
                .keys()
                .flat_map(|&l| TENANTS[..tenants].iter().map(move |t| row(LANES[l], t, u32::MAX / 2, 0)))
                .collect();
            let total_weight: u32 = weights.values().sum();
            let picks = 50 * total_weight;
            let mut served = BTreeMap::<Lane, u32>::new();
            for _ in 0..picks {
                let grants = pick_and_apply(&mut s, &mut rows, 1);
                prop_assert_eq!(grants.len(), 1);
                *served.entry(rows[grants[0].demand_index].lane.clone()).or_default() += 1;
            }
            for (&l, &w) in &weights {
                let got = f64::from(served.get(&Lane::from(LANES[l])).copied().unwrap_or(0));
                let want = f64::from(picks) * f64::from(w) / f64::from(total_weight);
                prop_assert!((got - want).abs() <= 1.0, "lane {} weight {}: {} picks, want {}", LANES[l], w, got, want);
            }
        }
    }
}
