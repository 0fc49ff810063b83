//! The one [`Decider`] the server, the guard and the conformance suite
//! share: the core's [`decide`] with each type's policy and a seeded RNG.
//! Callers differ only in the policies and the seed they give it.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use lazaret_core::{Envelope, Event, Policies, SplitMix64, Timestamp, Transition, decide};

use crate::Decider;

/// [`decide`] with the policy of each job's type (`Policies::for_type`)
/// and the jitter of a [`SplitMix64`] behind a lock.
#[derive(Debug)]
pub struct PolicyDecider {
    policies: Policies,
    rng: Mutex<SplitMix64>,
}

impl PolicyDecider {
    /// Jitter seeded from the clock and the process id, so two nodes (or
    /// two restarts) do not draw the same backoffs: the server's.
    pub fn new(policies: Policies) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(32);
        Self::with_seed(policies, seed)
    }

    /// Jitter from `seed`: the same decisions on every run, for tests and
    /// simulations.
    pub fn with_seed(policies: Policies, seed: u64) -> Self {
        PolicyDecider {
            policies,
            rng: Mutex::new(SplitMix64::new(seed)),
        }
    }
}

impl Decider for PolicyDecider {
    fn decide(&self, env: &mut Envelope, event: Event, now: Timestamp) -> Transition {
        let policy = self.policies.for_type(env.job_type.as_str());
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        decide(env, policy, event, now, &mut *rng)
    }
}
