//! How many jobs to lease: pure arithmetic, so the bound can be tested.
//!
//! A worker leases for its free slots plus a small prefetch, so a slot that
//! frees up finds its next job already here instead of waiting a round trip.
//! But a prefetched job's lease clock runs while it waits: a worker that
//! hoards jobs it cannot start lets their leases expire, and every expiry is
//! a charged attempt (and, repeated, a `crash_loop` dead letter) for a job
//! that never ran. So the prefetch is bounded by what the slots can start
//! within half a lease at the observed handler duration — a queued job then
//! starts with at least half its lease left (and is heartbeaten at once if
//! it waited past a third) — and nothing is prefetched before a duration
//! has been observed.

use std::time::Duration;

/// The server refuses more than this in one lease.
pub const LEASE_JOBS_MAX: u32 = 1000;

/// Jobs that may wait leased-but-not-started in a pool of `concurrency`
/// slots: at most `prefetch_max`, and no more than the slots can start
/// within `lease / 2` when a handler takes `avg_run` on average.
///
/// `avg_run` is `None` until a handler has finished: no evidence, no prefetch.
pub fn prefetch_bound(
    concurrency: usize,
    lease: Duration,
    avg_run: Option<Duration>,
    prefetch_max: usize,
) -> usize {
    let Some(avg) = avg_run else { return 0 };
    if avg.is_zero() {
        return prefetch_max;
    }
    // Queued jobs start at `concurrency / avg` per unit of time.
    let startable = (concurrency as u128).saturating_mul((lease / 2).as_nanos()) / avg.as_nanos();
    prefetch_max.min(usize::try_from(startable).unwrap_or(usize::MAX))
}

/// How many to ask for now: room for every slot plus the prefetch bound,
/// minus what is already held (running or waiting), capped at what the
/// server allows in one lease.
pub fn lease_count(concurrency: usize, bound: usize, held: usize) -> u32 {
    let room = concurrency.saturating_add(bound).saturating_sub(held);
    u32::try_from(room).unwrap_or(u32::MAX).min(LEASE_JOBS_MAX)
}

/// The smallest lease worth a round trip while jobs already wait here: a
/// quarter of the pool, so a busy worker leases in batches, not one by one.
pub fn batch_min(concurrency: usize, bound: usize) -> u32 {
    u32::try_from((concurrency.saturating_add(bound) / 4).max(1)).unwrap_or(u32::MAX)
}

/// An exponentially weighted moving average of handler run times (1/8 new).
pub fn ewma(avg: Option<Duration>, sample: Duration) -> Duration {
    match avg {
        None => sample,
        Some(a) => (a * 7 + sample) / 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn nothing_is_prefetched_before_a_duration_is_known() {
        assert_eq!(prefetch_bound(8, 30 * S, None, 8), 0);
        assert_eq!(lease_count(8, 0, 0), 8);
    }

    #[test]
    fn fast_handlers_prefetch_up_to_the_configured_max() {
        assert_eq!(prefetch_bound(8, 30 * S, Some(Duration::ZERO), 8), 8);
        assert_eq!(
            prefetch_bound(8, 30 * S, Some(Duration::from_millis(5)), 8),
            8
        );
    }

    #[test]
    fn slow_handlers_shrink_the_prefetch_to_what_can_start_in_half_a_lease() {
        // 2 slots, 10 s lease, 2 s per job: 2 * 5 s / 2 s = 5 can start in time.
        assert_eq!(prefetch_bound(2, 10 * S, Some(2 * S), 50), 5);
        // A job longer than half the lease: nothing may wait.
        assert_eq!(prefetch_bound(1, 10 * S, Some(6 * S), 50), 0);
        assert_eq!(prefetch_bound(4, 10 * S, Some(60 * S), 50), 0);
    }

    #[test]
    fn queued_jobs_always_start_within_half_a_lease() {
        // The property the bound exists for, over a grid of shapes.
        for concurrency in [1usize, 2, 3, 8, 64] {
            for lease_ms in [100u64, 1_000, 30_000] {
                for avg_ms in [1u64, 7, 100, 999, 5_000, 40_000] {
                    let lease = Duration::from_millis(lease_ms);
                    let avg = Duration::from_millis(avg_ms);
                    let bound = prefetch_bound(concurrency, lease, Some(avg), 1_000);
                    // The last queued job starts after ceil(bound / concurrency) rounds.
                    let rounds = bound.div_ceil(concurrency) as u32;
                    assert!(
                        avg * rounds <= lease / 2 + avg,
                        "c={concurrency} lease={lease_ms} avg={avg_ms}: bound {bound}"
                    );
                    assert!(
                        bound as u128 * avg.as_nanos()
                            <= concurrency as u128 * (lease / 2).as_nanos()
                    );
                }
            }
        }
    }

    #[test]
    fn the_lease_count_fills_free_slots_and_the_bound_and_no_more() {
        assert_eq!(lease_count(8, 4, 0), 12);
        assert_eq!(lease_count(8, 4, 10), 2);
        assert_eq!(lease_count(8, 4, 12), 0);
        assert_eq!(lease_count(8, 0, 20), 0);
        assert_eq!(lease_count(5000, 0, 0), LEASE_JOBS_MAX);
    }

    #[test]
    fn batches_are_a_quarter_of_the_pool() {
        assert_eq!(batch_min(1, 0), 1);
        assert_eq!(batch_min(64, 64), 32);
    }

    #[test]
    fn the_average_moves_an_eighth_toward_each_sample() {
        assert_eq!(ewma(None, S), S);
        assert_eq!(ewma(Some(S), 9 * S), 2 * S);
    }
}
