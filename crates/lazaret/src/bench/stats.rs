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
    pub p95_us: u64,
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
            p95_us: at(95.0),
            p99_us: at(99.0),
            max_us: at(100.0),
            mean_us: u64::try_from(sum / u128::from(n)).unwrap_or(u64::MAX),
        }
    }
}

/// The outcome of checking that every enqueued job was acked exactly once,
/// or, for the jobs a run meant to fail, dead-lettered with the right reason.
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
    /// Enqueued ids meant to succeed that were never acked.
    pub missing: u64,
    /// Acked ids this run never enqueued, or meant to dead-letter.
    pub unexpected: u64,
    /// Ack requests or items the server refused.
    pub ack_errors: u64,
    /// Jobs the run meant to end in the dead letters.
    pub dead_expected: u64,
    /// Of those, found there with the reason meant.
    pub dead_right: u64,
    /// Found there with another reason.
    pub dead_wrong_reason: u64,
    /// Not found there.
    pub dead_missing: u64,
    /// Dead letters of this run's jobs that were meant to succeed (a job
    /// with two dead letters counts once more).
    pub dead_unexpected: u64,
}

impl Verify {
    /// Compares the enqueued ids against the acked ones (every job meant to succeed).
    pub fn check(enqueued: &[String], acked: &[String], ack_errors: u64) -> Self {
        Self::check_outcomes(enqueued, acked, ack_errors, &HashMap::new(), &[])
    }

    /// Compares the enqueued ids against the acked ones and the dead
    /// letters: the jobs in `expected_dead` (id → reason) must be in `dead`
    /// (job id, reason) with that reason and never acked; every other
    /// enqueued job must be acked exactly once and not dead-lettered.
    /// Dead letters of jobs this run did not enqueue are ignored.
    pub fn check_outcomes(
        enqueued: &[String],
        acked: &[String],
        ack_errors: u64,
        expected_dead: &HashMap<String, String>,
        dead: &[(String, String)],
    ) -> Self {
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
        let meant_to_succeed = |id: &str| expected.contains(id) && !expected_dead.contains_key(id);
        let acked_twice = seen.values().filter(|&&c| c > 1).count() as u64;
        let unexpected = seen.keys().filter(|id| !meant_to_succeed(id)).count() as u64;
        let missing = expected
            .iter()
            .filter(|id| meant_to_succeed(id) && !seen.contains_key(*id))
            .count() as u64;

        let mut found: HashMap<&str, &str> = HashMap::with_capacity(dead.len());
        let mut dead_unexpected = 0;
        for (id, reason) in dead {
            if !expected.contains(id.as_str()) {
                continue;
            }
            if found.insert(id, reason).is_some() || !expected_dead.contains_key(id) {
                dead_unexpected += 1;
            }
        }
        let (mut dead_right, mut dead_wrong_reason, mut dead_missing) = (0, 0, 0);
        for (id, reason) in expected_dead {
            match found.get(id.as_str()) {
                Some(r) if r == reason => dead_right += 1,
                Some(_) => dead_wrong_reason += 1,
                None => dead_missing += 1,
            }
        }
        Verify {
            enqueued: enqueued.len() as u64,
            acked: acked.len() as u64,
            duplicate_ids,
            acked_twice,
            missing,
            unexpected,
            ack_errors,
            dead_expected: expected_dead.len() as u64,
            dead_right,
            dead_wrong_reason,
            dead_missing,
            dead_unexpected,
        }
    }

    /// Whether every job meant to succeed was acked exactly once, every
    /// job meant to fail is in the dead letters with its reason, and
    /// nothing else happened.
    pub fn ok(&self) -> bool {
        self.duplicate_ids == 0
            && self.acked_twice == 0
            && self.missing == 0
            && self.unexpected == 0
            && self.ack_errors == 0
            && self.enqueued == self.acked + self.dead_expected
            && self.dead_right == self.dead_expected
            && self.dead_unexpected == 0
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
                p95_us: 5,
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
                ..Verify::default()
            }
        );
        assert!(!bad.ok());
        assert!(!Verify::check(&ids(&["1"]), &[], 0).ok());
    }

    #[test]
    fn verify_expects_the_bad_jobs_in_the_dead_letters_with_their_reason() {
        let meant: HashMap<String, String> = [("2", "permanent"), ("3", "crash_loop")]
            .iter()
            .map(|(id, r)| ((*id).to_owned(), (*r).to_owned()))
            .collect();
        let letters = |v: &[(&str, &str)]| -> Vec<(String, String)> {
            v.iter()
                .map(|(id, r)| ((*id).to_owned(), (*r).to_owned()))
                .collect()
        };
        let enqueued = ids(&["1", "2", "3", "4"]);
        // Another run's dead letter (id 99) is not this run's business.
        let good = Verify::check_outcomes(
            &enqueued,
            &ids(&["4", "1"]),
            0,
            &meant,
            &letters(&[("3", "crash_loop"), ("99", "permanent"), ("2", "permanent")]),
        );
        assert!(good.ok(), "{good:?}");
        assert_eq!((good.dead_expected, good.dead_right), (2, 2));

        let bad = Verify::check_outcomes(
            &enqueued,
            &ids(&["1", "2"]),
            0,
            &meant,
            &letters(&[("3", "exhausted"), ("4", "permanent")]),
        );
        assert_eq!(
            bad,
            Verify {
                enqueued: 4,
                acked: 2,
                // 2 was meant to fail, 4 to succeed.
                unexpected: 1,
                missing: 1,
                dead_expected: 2,
                dead_wrong_reason: 1,
                dead_missing: 1,
                dead_unexpected: 1,
                ..Verify::default()
            }
        );
        assert!(!bad.ok());
    }
}
