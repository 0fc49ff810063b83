//! Retry policy per job type: attempt budgets, per-kind budgets, backoff.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use crate::failure::FailureClass;
use crate::ids::{ErrorKind, JobType};
use crate::rng::Entropy;

/// Capped exponential backoff with full jitter.
///
/// After attempt `n` (1-based) fails, the delay is drawn uniformly from
/// `[0, min(cap, base · 2^(n-1))]` and then raised to `floor`. With a
/// `schedule`, attempt `n` waits exactly `schedule[n-1]` (the last entry
/// repeats), still clamped to `[floor, cap]`: a schedule is for people who
/// want to know the exact delays, so it is not jittered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backoff {
    /// The first ceiling.
    pub base: Duration,
    /// No delay is longer (a `Retry-After` from the server may be).
    pub cap: Duration,
    /// No delay is shorter.
    pub floor: Duration,
    /// Exact delays per attempt, replacing the exponential curve when not empty.
    pub schedule: Vec<Duration>,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            base: Duration::from_secs(1),
            cap: Duration::from_secs(300),
            floor: Duration::ZERO,
            schedule: Vec::new(),
        }
    }
}

impl Backoff {
    /// The largest delay attempt `attempt` may draw (before the floor).
    pub fn ceiling(&self, attempt: u32) -> Duration {
        if !self.schedule.is_empty() {
            let i = (attempt.max(1) as usize - 1).min(self.schedule.len() - 1);
            return self.schedule[i].min(self.cap);
        }
        if self.base.is_zero() {
            return Duration::ZERO;
        }
        // 2^exp overflows past 31 doublings, and any realistic cap is reached
        // long before: saturate instead of wrapping.
        let exp = attempt.max(1) - 1;
        match 1u32.checked_shl(exp) {
            Some(factor) => self
                .base
                .checked_mul(factor)
                .unwrap_or(Duration::MAX)
                .min(self.cap),
            None => self.cap,
        }
    }

    /// The delay after attempt `attempt` failed, in `[floor, cap]`.
    pub fn delay(&self, attempt: u32, rng: &mut impl Entropy) -> Duration {
        let ceiling = self.ceiling(attempt);
        let drawn = if self.schedule.is_empty() {
            let ceiling_ms = u64::try_from(ceiling.as_millis()).unwrap_or(u64::MAX);
            Duration::from_millis(rng.below_inclusive(ceiling_ms))
        } else {
            ceiling
        };
        drawn.max(self.floor).min(self.cap.max(self.floor))
    }
}

/// Everything the core needs to decide about one job type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TypePolicy {
    /// Deliveries in all, the first included.
    pub attempts_max: u32,
    /// Delay between attempts.
    pub backoff: Backoff,
    /// Lease expiries before the job is dead-lettered as `crash_loop`.
    pub crash_loop_max: u32,
    /// Deferred outcomes before it is dead-lettered as `deferrals_exhausted`.
    pub deferrals_max: u32,
    /// Attempts a failure of a kind may spend (`parse = 2`: retry once).
    pub kinds: BTreeMap<ErrorKind, u32>,
    /// Class for failures reported without one, by kind (default transient).
    pub kind_classes: BTreeMap<ErrorKind, FailureClass>,
}

impl Default for TypePolicy {
    fn default() -> Self {
        TypePolicy {
            attempts_max: 5,
            backoff: Backoff::default(),
            crash_loop_max: 3,
            deferrals_max: 50,
            kinds: BTreeMap::new(),
            kind_classes: BTreeMap::new(),
        }
    }
}

/// A policy value outside what the core can honour.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// A count that must be at least 1 was 0.
    #[error("{field} must be at least 1 (got 0); it counts deliveries, the first included")]
    ZeroCount {
        /// The key, as in the config file.
        field: String,
    },
    /// `backoff_floor_ms` is above `backoff_cap_ms`.
    #[error(
        "backoff_floor_ms ({floor_ms}) is above backoff_cap_ms ({cap_ms}); lower the floor or raise the cap"
    )]
    FloorAboveCap {
        /// The floor.
        floor_ms: u128,
        /// The cap.
        cap_ms: u128,
    },
}

impl TypePolicy {
    /// Checks the values the decision relies on.
    pub fn validate(&self) -> Result<(), PolicyError> {
        let zero = |field: &str| PolicyError::ZeroCount {
            field: field.to_owned(),
        };
        if self.attempts_max == 0 {
            return Err(zero("attempts_max"));
        }
        if self.crash_loop_max == 0 {
            return Err(zero("crash_loop_max"));
        }
        if self.deferrals_max == 0 {
            return Err(zero("deferrals_max"));
        }
        if let Some((kind, _)) = self.kinds.iter().find(|(_, n)| **n == 0) {
            return Err(zero(&format!("kinds.{kind}")));
        }
        if self.backoff.floor > self.backoff.cap {
            return Err(PolicyError::FloorAboveCap {
                floor_ms: self.backoff.floor.as_millis(),
                cap_ms: self.backoff.cap.as_millis(),
            });
        }
        Ok(())
    }

    /// The budget of a kind, if the policy sets one.
    pub fn kind_budget(&self, kind: &ErrorKind) -> Option<u32> {
        self.kinds.get(kind).copied()
    }

    /// The class of a kind reported without a class.
    pub fn class_of_kind(&self, kind: &ErrorKind) -> Option<FailureClass> {
        self.kind_classes.get(kind).copied()
    }
}

/// The policies of every type: `defaults` for the unlisted ones.
#[derive(Clone, Debug, Default)]
pub struct Policies {
    /// For types with no section of their own.
    pub defaults: TypePolicy,
    /// Per type, already merged over the defaults.
    pub types: HashMap<JobType, TypePolicy>,
}

impl Policies {
    /// The policy that governs `ty`.
    pub fn for_type(&self, ty: &str) -> &TypePolicy {
        self.types.get(ty).unwrap_or(&self.defaults)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    #[test]
    fn ceiling_doubles_then_caps_without_overflow() {
        let b = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(2),
            ..Backoff::default()
        };
        let ceilings: Vec<u128> = [1, 2, 3, 4, 5, 6, 31, 32, 33, 64, u32::MAX]
            .into_iter()
            .map(|n| b.ceiling(n).as_millis())
            .collect();
        assert_eq!(
            ceilings,
            [100, 200, 400, 800, 1600, 2000, 2000, 2000, 2000, 2000, 2000]
        );
        assert_eq!(b.ceiling(0).as_millis(), 100);
    }

    #[test]
    fn schedule_is_exact_and_last_entry_repeats() {
        let b = Backoff {
            schedule: vec![Duration::from_secs(1), Duration::from_secs(10)],
            ..Backoff::default()
        };
        let mut rng = SplitMix64::new(3);
        assert_eq!(b.delay(1, &mut rng), Duration::from_secs(1));
        assert_eq!(b.delay(2, &mut rng), Duration::from_secs(10));
        assert_eq!(b.delay(9, &mut rng), Duration::from_secs(10));
    }

    #[test]
    fn validate_names_the_bad_key() {
        let mut p = TypePolicy::default();
        p.kinds.insert("parse".into(), 0);
        assert_eq!(
            p.validate().unwrap_err().to_string(),
            "kinds.parse must be at least 1 (got 0); it counts deliveries, the first included"
        );
        let p = TypePolicy {
            backoff: Backoff {
                floor: Duration::from_secs(9),
                cap: Duration::from_secs(1),
                ..Backoff::default()
            },
            ..TypePolicy::default()
        };
        assert!(matches!(
            p.validate(),
            Err(PolicyError::FloorAboveCap { .. })
        ));
    }
}
