//! The writer's counts per (lane, tenant), with the ordered sets a lease walks.
//!
//! Each lane keeps its tenants with jobs ready in name order (all types,
//! and per type), and those holding leases. A lease walks a lane from the
//! round's cursor (`FairScheduler::resume_after`) and offers the pairs to
//! the core's `LaneWindow`, which says when it has enough: a lease looks at
//! about as many pairs as it leases jobs, whatever the number of tenants
//! waiting (issue 32). Which pairs it takes, and in what order, stays the
//! core's decision; this module only keeps the counts in order.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;

use lazaret_core::{FairScheduler, JobType, Lane, LaneWindow, LeaseFilter, PairCounts, TenantId};

/// One (lane, tenant)'s counts.
#[derive(Clone, Debug, Default)]
pub(super) struct Pair {
    /// Ready jobs, all types.
    pub(super) ready: u32,
    /// Ready jobs by type (types with none are dropped).
    pub(super) by_type: BTreeMap<JobType, u32>,
    pub(super) inflight: u32,
}

/// One lane's pairs and its ordered sets.
#[derive(Debug, Default)]
struct LanePairs {
    pairs: HashMap<TenantId, Pair>,
    /// Tenants with jobs ready, in name order.
    ready: BTreeSet<TenantId>,
    /// Per type: tenants with jobs of it ready, in name order (walked by
    /// leases that do not take every type).
    by_type: HashMap<JobType, BTreeSet<TenantId>>,
    /// Tenants holding leases (lane reserves count every lease held).
    busy: BTreeSet<TenantId>,
}

/// Counts per (lane, tenant); a pair with nothing ready and nothing
/// leased is dropped, so the sets hold only what a lease may need.
#[derive(Debug, Default)]
pub(super) struct Pairs {
    lanes: HashMap<Lane, LanePairs>,
    /// Per tenant with jobs ready: in how many lanes (`tenants_ready_max`).
    tenants_ready: HashMap<TenantId, u32>,
}

impl Pairs {
    pub(super) fn clear(&mut self) {
        self.lanes.clear();
        self.tenants_ready.clear();
    }

    pub(super) fn get(
        &self,
        lane: &(impl AsRef<str> + ?Sized),
        tenant: &(impl AsRef<str> + ?Sized),
    ) -> Option<&Pair> {
        self.lanes.get(lane.as_ref())?.pairs.get(tenant.as_ref())
    }

    /// Distinct tenants with jobs ready, in any lane.
    pub(super) fn tenants_ready(&self) -> usize {
        self.tenants_ready.len()
    }

    /// Whether `tenant` has jobs ready in some lane.
    pub(super) fn has_ready(&self, tenant: &str) -> bool {
        self.tenants_ready.contains_key(tenant)
    }

    /// Every lane and its pairs (for stats).
    pub(super) fn iter(&self) -> impl Iterator<Item = (&Lane, &HashMap<TenantId, Pair>)> {
        self.lanes.iter().map(|(l, p)| (l, &p.pairs))
    }

    /// Changes one pair with `f`, which may change the ready count of
    /// `job_type` only, and keeps the sets in step.
    fn change(
        &mut self,
        lane: &str,
        tenant: &str,
        job_type: Option<&str>,
        f: impl FnOnce(&mut Pair),
    ) {
        if !self.lanes.contains_key(lane) {
            self.lanes.insert(Lane::new(lane), LanePairs::default());
        }
        let l = self.lanes.get_mut(lane).expect("inserted above");
        if !l.pairs.contains_key(tenant) {
            l.pairs.insert(TenantId::new(tenant), Pair::default());
        }
        let p = l.pairs.get_mut(tenant).expect("inserted above");
        let of_type = |p: &Pair| {
            job_type
                .and_then(|t| p.by_type.get(t))
                .copied()
                .unwrap_or(0)
        };
        let before = (p.ready, p.inflight, of_type(p));
        f(p);
        let after = (p.ready, p.inflight, of_type(p));
        let key = || TenantId::new(tenant);
        if let Some(t) = job_type {
            match (before.2 > 0, after.2 > 0) {
                (false, true) => {
                    l.by_type.entry(JobType::new(t)).or_default().insert(key());
                }
                (true, false) => {
                    p.by_type.remove(t);
                    if let Some(set) = l.by_type.get_mut(t) {
                        set.remove(tenant);
                        if set.is_empty() {
                            l.by_type.remove(t);
                        }
                    }
                }
                _ => {}
            }
        }
        match (before.0 > 0, after.0 > 0) {
            (false, true) => {
                l.ready.insert(key());
                *self.tenants_ready.entry(key()).or_default() += 1;
            }
            (true, false) => {
                l.ready.remove(tenant);
                if let Some(n) = self.tenants_ready.get_mut(tenant) {
                    *n -= 1;
                    if *n == 0 {
                        self.tenants_ready.remove(tenant);
                    }
                }
            }
            _ => {}
        }
        match (before.1 > 0, after.1 > 0) {
            (false, true) => {
                l.busy.insert(key());
            }
            (true, false) => {
                l.busy.remove(tenant);
            }
            _ => {}
        }
        if after.0 == 0 && after.1 == 0 {
            l.pairs.remove(tenant);
            if l.pairs.is_empty() {
                self.lanes.remove(lane);
            }
        }
    }

    pub(super) fn add_ready(
        &mut self,
        lane: &(impl AsRef<str> + ?Sized),
        tenant: &(impl AsRef<str> + ?Sized),
        job_type: &(impl AsRef<str> + ?Sized),
        n: u32,
    ) {
        let job_type = job_type.as_ref();
        self.change(lane.as_ref(), tenant.as_ref(), Some(job_type), |p| {
            p.ready += n;
            match p.by_type.get_mut(job_type) {
                Some(c) => *c += n,
                None => {
                    p.by_type.insert(JobType::new(job_type), n);
                }
            }
        });
    }

    pub(super) fn take_ready(
        &mut self,
        lane: &(impl AsRef<str> + ?Sized),
        tenant: &(impl AsRef<str> + ?Sized),
        job_type: &(impl AsRef<str> + ?Sized),
        n: u32,
    ) {
        let job_type = job_type.as_ref();
        self.change(lane.as_ref(), tenant.as_ref(), Some(job_type), |p| {
            p.ready = p.ready.saturating_sub(n);
            if let Some(c) = p.by_type.get_mut(job_type) {
                *c = c.saturating_sub(n);
            }
        });
    }

    pub(super) fn add_inflight(
        &mut self,
        lane: &(impl AsRef<str> + ?Sized),
        tenant: &(impl AsRef<str> + ?Sized),
        n: u32,
    ) {
        self.change(lane.as_ref(), tenant.as_ref(), None, |p| p.inflight += n);
    }

    /// One lease of the pair ends: its in-flight count and ready jobs before.
    pub(super) fn release(
        &mut self,
        lane: &(impl AsRef<str> + ?Sized),
        tenant: &(impl AsRef<str> + ?Sized),
    ) -> (u32, u32) {
        let (mut inflight, mut ready) = (0, 0);
        self.change(lane.as_ref(), tenant.as_ref(), None, |p| {
            (inflight, ready) = (p.inflight, p.ready);
            p.inflight = p.inflight.saturating_sub(1);
        });
        (inflight, ready)
    }

    /// The pairs a lease of `max_jobs` through `filter` needs, in (lane,
    /// tenant) order: per lane that `lane_ok` lets through, its pairs with
    /// jobs ready walked in cyclic name order from the round's cursor
    /// until the core's [`LaneWindow`] has enough, plus, when lanes hold
    /// reserves, the pairs holding leases. `looked` counts the pairs
    /// looked at (`GroupCommitStats::lease_pairs`).
    pub(super) fn window<'a>(
        &'a self,
        scheduler: &FairScheduler,
        filter: &LeaseFilter<'_>,
        lane_ok: impl Fn(&Lane) -> bool,
        max_jobs: u32,
        looked: &mut u64,
    ) -> Vec<PairCounts<'a>> {
        let every_type =
            filter.types.is_none() && filter.excluded.is_empty() && filter.probes.is_empty();
        let reserves = scheduler.config().has_reserves();
        let mut out: Vec<PairCounts<'a>> = Vec::new();
        for (lane, l) in &self.lanes {
            if !lane_ok(lane) {
                continue;
            }
            let counts = |tenant: &'a TenantId| {
                let p = &l.pairs[tenant.as_str()];
                PairCounts {
                    lane,
                    tenant,
                    inflight: p.inflight,
                    ready: &p.by_type,
                }
            };
            // The sets to walk, merged by name: every tenant with jobs
            // ready, or those with jobs of a type the lease may take.
            let sets: Vec<&BTreeSet<TenantId>> = if every_type {
                vec![&l.ready]
            } else {
                l.by_type
                    .iter()
                    .filter(|(t, _)| filter.admits(t))
                    .map(|(_, s)| s)
                    .collect()
            };
            let first = out.len();
            let mut window = LaneWindow::new(filter, max_jobs);
            let after = scheduler.resume_after(lane);
            // From the cursor to the end, then from the start to the cursor.
            let passes: &[(Bound<&str>, Bound<&str>)] = match after {
                Some(a) => &[
                    (Bound::Excluded(a), Bound::Unbounded),
                    (Bound::Unbounded, Bound::Included(a)),
                ],
                None => &[(Bound::Unbounded, Bound::Unbounded)],
            };
            'walk: for &(mut lo, hi) in passes {
                while !window.is_full() {
                    let next = sets
                        .iter()
                        .filter_map(|s| s.range::<str, _>((lo, hi)).next())
                        .min();
                    let Some(tenant) = next else {
                        continue 'walk;
                    };
                    *looked += 1;
                    let pair = counts(tenant);
                    if window.offer(scheduler, &pair) {
                        out.push(pair);
                    }
                    if hi == Bound::Included(tenant.as_str()) {
                        continue 'walk;
                    }
                    lo = Bound::Excluded(tenant.as_str());
                }
                break;
            }
            if reserves {
                for tenant in &l.busy {
                    if !out[first..].iter().any(|p| p.tenant == tenant) {
                        *looked += 1;
                        out.push(counts(tenant));
                    }
                }
            }
        }
        // In key order, as the whole demand would be: which of several
        // pairs counting the same half-open probes gets them goes by order.
        out.sort_unstable_by(|a, b| (a.lane, a.tenant).cmp(&(b.lane, b.tenant)));
        out
    }
}
