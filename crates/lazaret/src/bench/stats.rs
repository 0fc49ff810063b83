//! Latency percentiles and the exactly-once check, kept pure so they are easy to test.

use std::collections::{HashMap, HashSet};

use serde::Serialize;

/// The nearest-rank percentile `p` (0–100) of an ascending slice: the
/// smallest sample such that at least `p` % of the samples are at most it.
/// `None` for an empty slice; `p` outside 0–100 is clamped.
pub fn percentile(sorted: &[u64], p: f64) -> Option<u64> {
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    let p = if p.is_nan() { 0.0 } else { p.clamp(0.0, 100.0) };
    // The rank is 1-based; p = 0 means the minimum.
    let rank = ((p / 100.0) * n as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, n) - 1])
}

/// Percentiles of one kind of request, in microseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Latency {
    pub count: u64,
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
    pub mean_us: u64,
}

impl Latency {
    /// Summarizes samples in microseconds (any order; sorted in place).
    pub fn from_samples(samples: &mut [u64]) -> Self {
        samples.sort_unstable();
        let n = samples.len() as u64;
        if n == 0 {
            return Self::default();
        }
        let sum: u128 = samples.iter().map(|&s| u128::from(s)).sum();
        let at = |p| percentile(samples, p).unwrap_or(0);
        Latency {
            count: n,
            p50_us: at(50.0),
            p90_us: at(90.0),
            p99_us: at(99.0),
            max_us: at(100.0),
            mean_us: u64::try_from(sum / u128::from(n)).unwrap_or(u64::MAX),
        }
    }
}

/// The outcome of checking that every enqueued job was acked exactly once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Verify {
    /// Ids the server returned for the enqueues.
    pub enqueued: u64,
    /// Successful acks, duplicates included.
    pub acked: u64,
    /// Ids the server handed out for two different enqueues.
    pub duplicate_ids: u64,
    /// Ids acked more than once (each such id counted once).
    pub acked_twice: u64,
    /// Enqueued ids that were never acked.
    pub missing: u64,
    /// Acked ids this run never enqueued.
    pub unexpected: u64,
    /// Ack requests or items the server refused.
    pub ack_errors: u64,
}

impl Verify {
    /// Compares the enqueued ids against the acked ones.
    pub fn check(enqueued: &[String], acked: &[String], ack_errors: u64) -> Self {
        let mut expected: HashSet<&str> = HashSet::with_capacity(enqueued.len());
        let mut duplicate_ids = 0;
        for id in enqueued {
            if !expected.insert(id) {
                duplicate_ids += 1;
            }
        }
        let mut seen: HashMap<&str, u32> = HashMap::with_capacity(acked.len());
        for id in acked {
            *seen.entry(id).or_default() += 1;
        }
        let acked_twice = seen.values().filter(|&&c| c > 1).count() as u64;
        let unexpected = seen.keys().filter(|id| !expected.contains(*id)).count() as u64;
        let missing = expected.iter().filter(|id| !seen.contains_key(*id)).count() as u64;
        Verify {
            enqueued: enqueued.len() as u64,
            acked: acked.len() as u64,
            duplicate_ids,
            acked_twice,
            missing,
            unexpected,
            ack_errors,
        }
    }

    /// Whether every enqueued job was acked exactly once and nothing else happened.
    pub fn ok(&self) -> bool {
        self.duplicate_ids == 0
            && self.acked_twice == 0
            && self.missing == 0
            && self.unexpected == 0
            && self.ack_errors == 0
            && self.enqueued == self.acked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_of_one_to_hundred_is_the_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 90.0), Some(90));
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&v, 99.9), Some(100));
        assert_eq!(percentile(&v, 100.0), Some(100));
        assert_eq!(percentile(&v, 0.0), Some(1));
        assert_eq!(percentile(&v, 0.5), Some(1));
        assert_eq!(percentile(&v, 1.0), Some(1));
        assert_eq!(percentile(&v, 1.01), Some(2));
    }

    #[test]
    fn percentile_edge_cases() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[7], 0.0), Some(7));
        assert_eq!(percentile(&[7], 50.0), Some(7));
        assert_eq!(percentile(&[7], 100.0), Some(7));
        // Ten samples: p50 is the 5th, p90 the 9th, p99 the 10th.
        let v = [10, 20, 30, 40, 50, 60, 70, 80, 90, 1000];
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 90.0), Some(90));
        assert_eq!(percentile(&v, 99.0), Some(1000));
        // Out of range is clamped rather than panicking.
        assert_eq!(percentile(&v, -5.0), Some(10));
        assert_eq!(percentile(&v, 250.0), Some(1000));
        assert_eq!(percentile(&v, f64::NAN), Some(10));
    }

    #[test]
    fn latency_summary_sorts_its_input() {
        let mut v = vec![5, 1, 4, 2, 3];
        let l = Latency::from_samples(&mut v);
        assert_eq!(v, vec![1, 2, 3, 4, 5]);
        assert_eq!(
            l,
            Latency {
                count: 5,
                p50_us: 3,
                p90_us: 5,
                p99_us: 5,
                max_us: 5,
                mean_us: 3
            }
        );
        assert_eq!(Latency::from_samples(&mut []), Latency::default());
    }

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn verify_counts_each_kind_of_mistake() {
        let good = Verify::check(&ids(&["1", "2", "3"]), &ids(&["3", "1", "2"]), 0);
        assert!(good.ok(), "{good:?}");

        let bad = Verify::check(&ids(&["1", "2", "3", "3"]), &ids(&["1", "1", "9"]), 2);
        assert_eq!(
            bad,
            Verify {
                enqueued: 4,
                acked: 3,
                duplicate_ids: 1,
                acked_twice: 1,
                missing: 2,
                unexpected: 1,
                ack_errors: 2,
            }
        );
        assert!(!bad.ok());
        assert!(!Verify::check(&ids(&["1"]), &[], 0).ok());
    }
}
