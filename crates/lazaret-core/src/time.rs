//! Time as an input: a UTC instant in milliseconds, never read from a clock here.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// A UTC instant, in milliseconds since the Unix epoch.
///
/// The core never reads a clock: every entry point that needs "now" takes a
/// `Timestamp` argument, so that tests and the simulator drive time.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Timestamp(i64);

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);

    /// The instant `ms` milliseconds after the Unix epoch.
    pub const fn from_millis(ms: i64) -> Self {
        Timestamp(ms)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// `self + d`, saturating at the largest representable instant.
    pub fn saturating_add(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_add(ms))
    }

    /// `self - d`, saturating at the smallest representable instant.
    pub fn saturating_sub(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Timestamp(self.0.saturating_sub(ms))
    }

    /// How long after `earlier` this instant is; zero when it is not after it.
    pub fn saturating_since(self, earlier: Timestamp) -> Duration {
        let ms = self.0.saturating_sub(earlier.0).max(0);
        Duration::from_millis(ms as u64)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0)
    }
}

/// Milliseconds of a duration as `u64`, saturating; for the JSON/SQL edge.
pub fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_saturates_instead_of_overflowing() {
        let t = Timestamp::from_millis(i64::MAX - 1);
        assert_eq!(
            t.saturating_add(Duration::from_secs(10)),
            Timestamp::from_millis(i64::MAX)
        );
        assert_eq!(
            t.saturating_add(Duration::MAX),
            Timestamp::from_millis(i64::MAX)
        );
        assert_eq!(
            Timestamp::from_millis(5).saturating_since(Timestamp::from_millis(9)),
            Duration::ZERO
        );
        assert_eq!(
            Timestamp::from_millis(9).saturating_since(Timestamp::from_millis(5)),
            Duration::from_millis(4)
        );
    }
}
