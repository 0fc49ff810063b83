//! Durations as the file writes them: integer milliseconds (`30000`) or a
//! duration string (`"30s"`, `"5m"`, `"1h 30m"`, `"250ms"`).

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer};

/// A duration in milliseconds, written as an integer or as a string
/// `humantime` reads. A string is refused (at the key's span, as an integer
/// of the wrong kind is) when it is not a duration, is finer than a
/// millisecond, or does not fit in a `u64` of milliseconds.
#[derive(Clone, Copy, Debug)]
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

    /// `"30s"` as milliseconds, or what is wrong with it.
    fn parse(text: &str) -> Result<Ms, String> {
        let d = humantime::parse_duration(text.trim()).map_err(|e| {
            format!(
                "\"{text}\" is not a duration ({e}): write integer milliseconds (30000) \
                 or a number with a unit (\"30s\", \"5m\", \"250ms\", \"1h 30m\")"
            )
        })?;
        if d.subsec_nanos() % 1_000_000 != 0 {
            return Err(format!(
                "\"{text}\" is finer than a millisecond: durations are whole milliseconds"
            ));
        }
        u64::try_from(d.as_millis())
            .map(Ms)
            .map_err(|_| format!("\"{text}\" is too long: at most {} ms", u64::MAX))
    }
}

impl<'de> Deserialize<'de> for Ms {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = Ms;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("integer milliseconds or a duration such as \"30s\"")
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
                Ms::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::Ms;

    #[test]
    fn strings_with_units_read_as_milliseconds() {
        for (text, ms) in [
            ("30s", 30_000),
            ("5m", 300_000),
            ("250ms", 250),
            ("1h 30m", 5_400_000),
            ("0s", 0),
            (" 2s ", 2_000),
        ] {
            assert_eq!(Ms::parse(text).map(|m| m.0), Ok(ms), "{text}");
        }
    }

    #[test]
    fn strings_that_are_no_whole_milliseconds_are_refused_with_what_to_write() {
        for (text, says) in [
            ("thirty", "not a duration"),
            ("30", "not a duration"),
            ("", "not a duration"),
            ("1500us", "finer than a millisecond"),
            ("-5s", "not a duration"),
        ] {
            let e = Ms::parse(text)
                .err()
                .unwrap_or_else(|| panic!("{text:?} accepted"));
            assert!(e.contains(says), "{text:?}: {e}");
        }
        assert!(Ms::parse("30").unwrap_err().contains("\"30s\""));
    }
}
