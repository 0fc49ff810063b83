//! What the store is asked for: `durability` and `[retention]`.

use std::time::Duration;

use lazaret_store::Durability;
use serde::Deserialize;

use super::{ConfigError, Ctx, Ms, root};

/// `[retention]`: how long finished work is kept and how the cleaner paces itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RetentionConfig {
    /// How long a succeeded job is kept (`succeeded_ms`).
    pub succeeded: Duration,
    /// Rows deleted per cleaner transaction.
    pub cleaner_batch: u32,
    /// Pause between cleaner passes (`cleaner_interval_ms`).
    pub cleaner_interval: Duration,
    /// How often the charts' signals are sampled (`series_sample_ms`);
    /// their samples are kept 25 hours.
    pub series_sample: Duration,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            succeeded: Duration::from_millis(86_400_000),
            cleaner_batch: 500,
            cleaner_interval: Duration::from_millis(1000),
            series_sample: Duration::from_millis(15_000),
        }
    }
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a table with succeeded_ms, cleaner_batch, cleaner_interval_ms, series_sample_ms"
)]
pub(super) struct RawRetention {
    succeeded_ms: Option<Ms>,
    cleaner_batch: Option<u32>,
    cleaner_interval_ms: Option<Ms>,
    series_sample_ms: Option<Ms>,
}

impl Ctx<'_> {
    pub(super) fn durability(&self, d: &str) -> Result<Durability, ConfigError> {
        Ok(match d {
            "full" => Durability::Full,
            "normal" => Durability::Normal,
            other => {
                return Err(self.invalid(
                    &root("durability"),
                    format!(
                        "unknown durability \"{other}\": use \"full\" (survives power loss) or \"normal\" (faster; survives a process crash)"
                    ),
                ));
            }
        })
    }

    pub(super) fn retention(
        &self,
        r: &RawRetention,
        retention: &mut RetentionConfig,
    ) -> Result<(), ConfigError> {
        let path = root("retention");
        if let Some(v) = r.succeeded_ms {
            retention.succeeded = v.duration();
        }
        if let Some(v) = r.cleaner_batch {
            if v == 0 {
                return Err(self.invalid(
                    &path.key("cleaner_batch"),
                    "cleaner_batch must be at least 1 (got 0), or the cleaner never deletes anything",
                ));
            }
            retention.cleaner_batch = v;
        }
        if let Some(Ms(v)) = r.cleaner_interval_ms {
            if v == 0 {
                return Err(self.invalid(
                    &path.key("cleaner_interval_ms"),
                    "cleaner_interval_ms must be at least 1 (got 0), or the cleaner spins",
                ));
            }
            retention.cleaner_interval = Duration::from_millis(v);
        }
        if let Some(Ms(v)) = r.series_sample_ms {
            if !(100..=60_000).contains(&v) {
                return Err(self.invalid(
                    &path.key("series_sample_ms"),
                    format!(
                        "series_sample_ms must be between 100 and 60000 (got {v}): the charts \
                         sample at least once a minute, and no more than ten times a second"
                    ),
                ));
            }
            retention.series_sample = Duration::from_millis(v);
        }
        Ok(())
    }
}
