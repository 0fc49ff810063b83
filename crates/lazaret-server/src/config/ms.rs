//! Durations as the file writes them: integer milliseconds.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer};

/// Integer milliseconds; a string like `"30s"` is refused with the number to write.
#[derive(Clone, Copy)]
pub(super) struct Ms(pub(super) u64);

/// A duration the config holds, back in the integer milliseconds the API
/// and the file speak (every one came from a `u64` of milliseconds).
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Ms {
    pub(super) fn duration(self) -> Duration {
        Duration::from_millis(self.0)
    }
}

impl<'de> Deserialize<'de> for Ms {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Ms;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("integer milliseconds")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Ms, E> {
                Ok(Ms(v))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Ms, E> {
                u64::try_from(v).map(Ms).map_err(|_| {
                    E::custom(format!(
                        "{v} is negative; a duration in milliseconds is 0 or more"
                    ))
                })
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Ms, E> {
                Err(E::custom(match humantime::parse_duration(v) {
                    Ok(d) => format!(
                        "durations are integer milliseconds: write {} instead of \"{v}\"",
                        d.as_millis()
                    ),
                    Err(_) => format!(
                        "durations are integer milliseconds (30000 for 30 s), not the string \"{v}\""
                    ),
                }))
            }
        }
        d.deserialize_any(V)
    }
}
