//! The lease plan: which jobs, by (lane, tenant) and by type, one lease takes.
//!
//! The store counts ready jobs per (lane, tenant) *and type*
//! ([`PairCounts`]); a lease comes with a [`LeaseFilter`] (the types the
//! worker asked for, the types whose breaker is open, and the probes left
//! for half-open ones). [`plan_lease`] turns both into [`Take`]s: "lease
//! `count` jobs of this (lane, tenant), oldest first, among these types".
//! Fairness across lanes and tenants is the [`FairScheduler`]'s; this
//! module only makes sure the scheduler sees, for each pair, how many jobs
//! *this lease* may take, so it never grants a pair that has nothing of the
//! asked types, and the store never has to look through other types' jobs
//! to find out.
//!
//! Costs: one pass over the pairs and their type counts per round. A round
//! falls short only when several pairs counted the same half-open probes and
//! they ran out; that exhausts at least one probe type, so there are at most
//! one more rounds than probe types.

use std::collections::BTreeMap;

use crate::ids::{JobType, Lane, TenantId};
use crate::scheduler::{Demand, FairScheduler, Grant};

/// What one lease may take.
#[derive(Clone, Copy, Debug, Default)]
pub struct LeaseFilter<'a> {
    /// Only these types (`None`: any).
    pub types: Option<&'a [JobType]>,
    /// Never these (open breakers, paused types).
    pub excluded: &'a [JobType],
    /// Types leased only as probes, at most this many each in this lease
    /// (half-open breakers). They are never taken beyond their number, even
    /// when `types` names them.
    pub probes: &'a [(JobType, u32)],
}

impl LeaseFilter<'_> {
    /// Whether the worker's own filter and the exclusions let `t` through.
    fn admits(&self, t: &JobType) -> bool {
        self.types.is_none_or(|ts| ts.contains(t)) && !self.excluded.contains(t)
    }

    /// Whether `t` may be taken without counting against a probe limit.
    fn admits_freely(&self, t: &JobType) -> bool {
        self.admits(t) && !self.probes.iter().any(|(p, _)| p == t)
    }
}

/// One (lane, tenant)'s counts, as the store keeps them. The store passes
/// every pair with jobs ready or leases held; which of them take part (a
/// pair with nothing ready counts only toward lane reserves) is decided
/// here.
#[derive(Clone, Copy, Debug)]
pub struct PairCounts<'a> {
    /// The lane.
    pub lane: &'a Lane,
    /// The tenant.
    pub tenant: &'a TenantId,
    /// Jobs of this pair leased now.
    pub inflight: u32,
    /// Ready jobs by type (types with none may be there with 0).
    pub ready: &'a BTreeMap<JobType, u32>,
}

/// Which of a pair's ready jobs a take reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Among<'a> {
    /// Any type: the pair's oldest jobs, whatever their type (the filter
    /// lets every type the pair has through).
    AnyType,
    /// Only these types (in name order), oldest first across them.
    Types(Vec<&'a JobType>),
}

/// Lease up to `count` of the oldest ready jobs of pair `pair`, `among`
/// the types given.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Take<'a> {
    /// Index into the `pairs` given to [`plan_lease`].
    pub pair: usize,
    /// Which types.
    pub among: Among<'a>,
    /// How many; at least 1, and never more than the pair's counts hold.
    pub count: u32,
}

/// Plans a lease of up to `max_jobs`: asks `scheduler` to pick among the
/// pairs with jobs this lease may take, counted by type, and says which
/// types each grant is read from.
///
/// Guarantees, given counts that match the store: every take finds its
/// `count` jobs; a type outside `filter.types` or in `filter.excluded` is
/// never read; a probe type is taken at most its number of times in all;
/// the takes add up to `max_jobs` or to everything the lease may take,
/// whichever is smaller (probes by their number); and fairness is the
/// scheduler's, on the counts the filter lets through.
pub fn plan_lease<'a>(
    scheduler: &mut FairScheduler,
    pairs: &[PairCounts<'a>],
    filter: &LeaseFilter<'_>,
    max_jobs: u32,
) -> Vec<Take<'a>> {
    let mut takes: Vec<Take<'a>> = Vec::new();
    if max_jobs == 0 || filter.types.is_some_and(<[JobType]>::is_empty) {
        return takes;
    }
    // Probes that may be taken at all, with what is left of each.
    let mut left: Vec<(&JobType, u32)> = filter
        .probes
        .iter()
        .filter(|(t, n)| *n > 0 && filter.admits(t))
        .map(|(t, n)| (t, *n))
        .collect();
    // Per pair: jobs free of probe limits, the types they are of, and the
    // ready jobs of each probe type (in `left`'s order).
    struct Open<'a> {
        free: u32,
        among: Among<'a>,
        /// Per probe type: the pair's own key for it (borrowed as long as
        /// the counts) and its ready jobs.
        probe_ready: Vec<(Option<&'a JobType>, u32)>,
        inflight: u32,
    }
    let mut open: Vec<Open<'a>> = pairs
        .iter()
        .map(|p| {
            let mut free = 0u32;
            let mut types = Vec::new();
            let mut all = true;
            for (t, &n) in p.ready {
                if n == 0 {
                    continue;
                }
                if filter.admits_freely(t) {
                    free = free.saturating_add(n);
                    types.push(t);
                } else {
                    all = false;
                }
            }
            let probe_ready = left
                .iter()
                .map(|(t, _)| match p.ready.get_key_value(*t) {
                    Some((key, &n)) => (Some(key), n),
                    None => (None, 0),
                })
                .collect();
            Open {
                free,
                among: if all {
                    Among::AnyType
                } else {
                    Among::Types(types)
                },
                probe_ready,
                inflight: p.inflight,
            }
        })
        .collect();

    let mut taken = 0u32;
    let mut rows: Vec<usize> = Vec::new();
    let mut grants: Vec<Grant> = Vec::new();
    let held_too = scheduler.config().has_reserves();
    // Each short round exhausts a probe type (see the module docs).
    for _round in 0..=left.len() {
        let remaining = max_jobs - taken;
        if remaining == 0 {
            break;
        }
        rows.clear();
        let mut demand: Vec<Demand<'a>> = Vec::new();
        for (i, (p, o)) in pairs.iter().zip(&open).enumerate() {
            let probes: u32 = o
                .probe_ready
                .iter()
                .zip(&left)
                .map(|((_, n), (_, l))| (*n).min(*l))
                .sum();
            let ready = o.free.saturating_add(probes);
            // Lane reserves are shares of every lease held, so a pair that
            // holds leases counts even with nothing ready.
            if ready > 0 || (held_too && o.inflight > 0) {
                rows.push(i);
                demand.push(Demand {
                    lane: p.lane,
                    tenant: p.tenant,
                    ready,
                    inflight: o.inflight,
                });
            }
        }
        if demand.is_empty() {
            break;
        }
        scheduler.pick(&demand, remaining, &mut grants);
        let mut short = false;
        for g in &grants {
            let i = rows[g.demand_index];
            let o = &mut open[i];
            let mut want = g.count;
            for ((_, l), (key, ready)) in left.iter_mut().zip(o.probe_ready.iter_mut()) {
                let n = want.min(*ready).min(*l);
                let Some(key) = key.filter(|_| n > 0) else {
                    continue;
                };
                *l -= n;
                *ready -= n;
                want -= n;
                add(&mut takes, i, Among::Types(vec![key]), n);
            }
            let n = want.min(o.free);
            if n > 0 {
                o.free -= n;
                want -= n;
                add(&mut takes, i, o.among.clone(), n);
            }
            let got = g.count - want;
            o.inflight += got;
            taken += got;
            short |= want > 0;
        }
        if !short {
            break;
        }
    }
    takes
}

/// Adds `count` to the take of (`pair`, `among`), or a new take.
fn add<'a>(takes: &mut Vec<Take<'a>>, pair: usize, among: Among<'a>, count: u32) {
    match takes
        .iter_mut()
        .find(|t| t.pair == pair && t.among == among)
    {
        Some(t) => t.count += count,
        None => takes.push(Take { pair, among, count }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use proptest::prelude::*;

    use crate::scheduler::SchedulerConfig;

    fn types(pairs: &[(&str, u32)]) -> BTreeMap<JobType, u32> {
        pairs.iter().map(|(t, n)| (JobType::from(*t), *n)).collect()
    }

    fn scheduler() -> FairScheduler {
        FairScheduler::new(SchedulerConfig::new(u32::MAX)).unwrap()
    }

    fn jt(names: &[&str]) -> Vec<JobType> {
        names.iter().map(|n| JobType::from(*n)).collect()
    }

    #[test]
    fn a_pair_with_nothing_of_the_asked_types_is_never_picked() {
        let (lane, acme, globex) = (Lane::from("default"), "acme".into(), "globex".into());
        let bulk = types(&[("bulk", 100_000)]);
        let mixed = types(&[("bulk", 10), ("email", 3)]);
        let pairs = [
            PairCounts {
                lane: &lane,
                tenant: &acme,
                inflight: 0,
                ready: &bulk,
            },
            PairCounts {
                lane: &lane,
                tenant: &globex,
                inflight: 0,
                ready: &mixed,
            },
        ];
        let only = jt(&["email"]);
        let filter = LeaseFilter {
            types: Some(&only),
            ..LeaseFilter::default()
        };
        let email = JobType::from("email");
        assert_eq!(
            plan_lease(&mut scheduler(), &pairs, &filter, 10),
            [Take {
                pair: 1,
                among: Among::Types(vec![&email]),
                count: 3
            }]
        );
        // Unfiltered, every type goes: any type, oldest first.
        let all = plan_lease(&mut scheduler(), &pairs, &LeaseFilter::default(), 4);
        assert_eq!(
            all,
            [
                Take {
                    pair: 0,
                    among: Among::AnyType,
                    count: 2
                },
                Take {
                    pair: 1,
                    among: Among::AnyType,
                    count: 2
                },
            ]
        );
        // A filter naming every type the pair has reads it as any type.
        let both = jt(&["bulk", "email"]);
        let filter = LeaseFilter {
            types: Some(&both),
            ..LeaseFilter::default()
        };
        let plan = plan_lease(&mut scheduler(), &pairs[1..], &filter, 4);
        assert_eq!(plan[0].among, Among::AnyType);
    }

    #[test]
    fn excluded_types_are_left_out_and_probes_are_counted_across_pairs() {
        let (lane, a, b) = (Lane::from("default"), "a".into(), "b".into());
        let ready = types(&[("email", 5), ("sms", 5), ("push", 5)]);
        let pairs = [
            PairCounts {
                lane: &lane,
                tenant: &a,
                inflight: 0,
                ready: &ready,
            },
            PairCounts {
                lane: &lane,
                tenant: &b,
                inflight: 0,
                ready: &ready,
            },
        ];
        let excluded = jt(&["sms"]);
        let probes = [(JobType::from("push"), 3)];
        let filter = LeaseFilter {
            types: None,
            excluded: &excluded,
            probes: &probes,
        };
        let plan = plan_lease(&mut scheduler(), &pairs, &filter, 100);
        let (email, push) = (JobType::from("email"), JobType::from("push"));
        let count = |among: &Among<'_>| -> u32 {
            plan.iter()
                .filter(|t| &t.among == among)
                .map(|t| t.count)
                .sum()
        };
        assert_eq!(count(&Among::Types(vec![&push])), 3, "{plan:?}");
        assert_eq!(count(&Among::Types(vec![&email])), 10, "{plan:?}");
        assert_eq!(plan.iter().map(|t| t.count).sum::<u32>(), 13);
    }

    #[test]
    fn an_empty_type_list_takes_nothing() {
        let (lane, a) = (Lane::from("default"), "a".into());
        let ready = types(&[("email", 5)]);
        let pairs = [PairCounts {
            lane: &lane,
            tenant: &a,
            inflight: 0,
            ready: &ready,
        }];
        let filter = LeaseFilter {
            types: Some(&[]),
            ..LeaseFilter::default()
        };
        assert!(plan_lease(&mut scheduler(), &pairs, &filter, 5).is_empty());
    }

    const TYPES: [&str; 4] = ["a", "b", "c", "d"];

    proptest! {
        /// Takes stay within the counts, the filter and the probes, and add
        /// up to everything the lease may take (or `max_jobs`).
        #[test]
        fn takes_respect_counts_filters_and_probes(
            counts in prop::collection::vec(prop::collection::vec(0u32..6, TYPES.len()), 1..6),
            only in prop::option::of(prop::collection::btree_set(0..TYPES.len(), 0..=TYPES.len())),
            excluded in prop::collection::btree_set(0..TYPES.len(), 0..=2),
            probes in prop::collection::btree_map(0..TYPES.len(), 0u32..4, 0..=2),
            max_jobs in 0u32..40,
        ) {
            let lane = Lane::from("default");
            let tenants: Vec<TenantId> = (0..counts.len()).map(|i| TenantId::new(format!("t{i}"))).collect();
            let ready: Vec<BTreeMap<JobType, u32>> = counts
                .iter()
                .map(|c| TYPES.iter().zip(c).map(|(t, n)| (JobType::from(*t), *n)).collect())
                .collect();
            let pairs: Vec<PairCounts<'_>> = tenants
                .iter()
                .zip(&ready)
                .map(|(tenant, ready)| PairCounts { lane: &lane, tenant, inflight: 0, ready })
                .collect();
            let only: Option<Vec<JobType>> = only.map(|s| s.iter().map(|&i| JobType::from(TYPES[i])).collect());
            let excluded: Vec<JobType> = excluded.iter().map(|&i| JobType::from(TYPES[i])).collect();
            let probes: Vec<(JobType, u32)> = probes.iter().map(|(&i, &n)| (JobType::from(TYPES[i]), n)).collect();
            let filter = LeaseFilter { types: only.as_deref(), excluded: &excluded, probes: &probes };

            let plan = plan_lease(&mut scheduler(), &pairs, &filter, max_jobs);
            let admits = |t: &JobType| only.as_ref().is_none_or(|o| o.contains(t)) && !excluded.contains(t);
            let mut used: Vec<BTreeMap<JobType, u32>> = vec![BTreeMap::new(); pairs.len()];
            let mut total = 0;
            for take in &plan {
                prop_assert!(take.count > 0);
                total += take.count;
                let ready = &ready[take.pair];
                let allowed: Vec<&JobType> = match &take.among {
                    Among::AnyType => ready.iter().filter(|(_, n)| **n > 0).map(|(t, _)| t).collect(),
                    Among::Types(ts) => ts.clone(),
                };
                let there: u32 = allowed.iter().map(|t| ready[*t]).sum();
                prop_assert!(take.count <= there, "{take:?} of {ready:?}");
                for t in &allowed {
                    prop_assert!(admits(t), "{t} read against the filter: {take:?}");
                }
                // Charge the take to its types, oldest-first being the store's business.
                let mut n = take.count;
                for t in allowed {
                    let free = ready[t] - used[take.pair].get(t).copied().unwrap_or(0);
                    let k = n.min(free);
                    *used[take.pair].entry(t.clone()).or_default() += k;
                    n -= k;
                }
                prop_assert_eq!(n, 0, "the take does not fit its types");
            }
            for (t, limit) in &probes {
                let n: u32 = plan
                    .iter()
                    .filter(|k| k.among == Among::Types(vec![t]))
                    .map(|k| k.count)
                    .sum();
                prop_assert!(n <= *limit, "{t}: {n} probes over {limit}");
            }
            let free: u32 = ready
                .iter()
                .map(|r| r.iter().filter(|(t, _)| admits(t) && !probes.iter().any(|(p, _)| p == *t)).map(|(_, n)| n).sum::<u32>())
                .sum();
            let probe_room: u32 = probes
                .iter()
                .filter(|(t, _)| admits(t))
                .map(|(t, l)| (*l).min(ready.iter().map(|r| r[t]).sum()))
                .sum();
            prop_assert_eq!(total, max_jobs.min(free + probe_room));
        }
    }
}
