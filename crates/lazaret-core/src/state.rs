//! The job state machine: one closed enum, the same words in code, SQL and API.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Where a job is in its life. See `docs/state-machine.md`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Ready to be leased now.
    Queued,
    /// Waiting for its `run_at` (a delay, a retry backoff or a deferral).
    Scheduled,
    /// Held by a worker under a lease.
    Leased,
    /// Acknowledged; terminal until retention removes it.
    Succeeded,
    /// Moved to the dead letters; leaves only by redrive (or purge).
    DeadLettered,
    /// Cancelled by an operator or its producer (see `crate::cancel`);
    /// terminal until retention removes it, like `Succeeded`.
    Cancelled,
}

impl JobState {
    /// Every state, in documentation order.
    pub const ALL: [JobState; 6] = [
        JobState::Queued,
        JobState::Scheduled,
        JobState::Leased,
        JobState::Succeeded,
        JobState::DeadLettered,
        JobState::Cancelled,
    ];

    /// The word used in the API, the CLI and the database.
    pub const fn as_str(self) -> &'static str {
        match self {
            JobState::Queued => "queued",
            JobState::Scheduled => "scheduled",
            JobState::Leased => "leased",
            JobState::Succeeded => "succeeded",
            JobState::DeadLettered => "dead_lettered",
            JobState::Cancelled => "cancelled",
        }
    }

    /// Whether `self → to` is an edge of the documented state machine.
    ///
    /// `Scheduled → Queued` is the clock passing `run_at`; `DeadLettered →
    /// Queued` is a redrive. A queued or scheduled job is cancelled at once;
    /// a leased one at its outcome or lease expiry (unless it is acked).
    /// Nothing leaves `Succeeded` or `Cancelled`.
    pub const fn can_become(self, to: JobState) -> bool {
        use JobState::*;
        matches!(
            (self, to),
            (Queued, Leased)
                | (Queued, DeadLettered) // purge of an active job is not offered; admission poison never enters
                | (Scheduled, Queued)
                | (Leased, Succeeded)
                | (Leased, Scheduled)
                | (Leased, Queued)
                | (Leased, DeadLettered)
                | (DeadLettered, Queued)
                | (Queued, Cancelled)
                | (Scheduled, Cancelled)
                | (Leased, Cancelled)
        )
    }

    /// Whether the job will never run again without an operator.
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            JobState::Succeeded | JobState::DeadLettered | JobState::Cancelled
        )
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A word that names no state.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown job state {0:?}; expected one of queued, scheduled, leased, succeeded, dead_lettered, cancelled"
)]
pub struct UnknownState(pub String);

impl FromStr for JobState {
    type Err = UnknownState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        JobState::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for st in JobState::ALL {
            assert_eq!(st.as_str().parse::<JobState>().unwrap(), st);
            assert_eq!(serde_json::to_string(&st).unwrap(), format!("\"{st}\""));
        }
        assert!("running".parse::<JobState>().is_err());
    }

    #[test]
    fn nothing_leaves_succeeded_or_cancelled() {
        for to in JobState::ALL {
            assert!(!JobState::Succeeded.can_become(to));
            assert!(!JobState::Cancelled.can_become(to));
        }
    }

    #[test]
    fn only_live_jobs_can_be_cancelled() {
        let cancellable: Vec<JobState> = JobState::ALL
            .into_iter()
            .filter(|s| s.can_become(JobState::Cancelled))
            .collect();
        assert_eq!(
            cancellable,
            [JobState::Queued, JobState::Scheduled, JobState::Leased]
        );
    }

    #[test]
    fn the_unknown_state_message_names_every_state() {
        let message = "running".parse::<JobState>().unwrap_err().to_string();
        for st in JobState::ALL {
            assert!(message.contains(st.as_str()), "{st} missing from {message}");
        }
    }
}
