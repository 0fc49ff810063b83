//! W3C trace context: the `traceparent` a job or a broker message carries,
//! validated before it is trusted, kept as given.
//!
//! Only version `00` is taken (<https://www.w3.org/TR/trace-context/>):
//! `00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>`, lower-case hex,
//! neither id all zeros. Anything else is refused whole: a producer or a
//! broker header cannot make lazaret store or forward text it did not check.
//! (`tracestate` is not kept.)

use std::fmt;

use serde::{Deserialize, Serialize};

/// The length of a version-00 `traceparent`.
pub const TRACEPARENT_LEN: usize = 55;

/// A valid W3C `traceparent` (version 00).
#[derive(Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TraceParent(String);

/// Why a `traceparent` was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceParentError {
    /// Not `00-<32 hex>-<16 hex>-<2 hex>` in lower-case hex.
    #[error(
        "traceparent must be `00-<32 lower-case hex trace id>-<16 lower-case hex parent id>-<2 hex flags>` (W3C trace context, version 00)"
    )]
    Malformed,
    /// The trace id is all zeros.
    #[error("traceparent's trace id must not be all zeros")]
    ZeroTraceId,
    /// The parent id is all zeros.
    #[error("traceparent's parent id must not be all zeros")]
    ZeroParentId,
}

fn lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl TraceParent {
    /// Validates `s` (surrounding blanks allowed, as in an HTTP header).
    pub fn parse(s: &str) -> Result<Self, TraceParentError> {
        let s = s.trim_matches(|c| c == ' ' || c == '\t');
        if s.len() != TRACEPARENT_LEN || !s.is_ascii() {
            return Err(TraceParentError::Malformed);
        }
        let (version, trace_id, parent_id, flags) = (&s[0..2], &s[3..35], &s[36..52], &s[53..55]);
        let dashes = [2, 35, 52].iter().all(|&i| s.as_bytes()[i] == b'-');
        if version != "00"
            || !dashes
            || !lower_hex(trace_id)
            || !lower_hex(parent_id)
            || !lower_hex(flags)
        {
            return Err(TraceParentError::Malformed);
        }
        if trace_id.bytes().all(|b| b == b'0') {
            return Err(TraceParentError::ZeroTraceId);
        }
        if parent_id.bytes().all(|b| b == b'0') {
            return Err(TraceParentError::ZeroParentId);
        }
        Ok(TraceParent(s.to_owned()))
    }

    /// The header value.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The 32-hex trace id.
    pub fn trace_id(&self) -> &str {
        &self.0[3..35]
    }

    /// The 16-hex id of the caller's span (the parent of lazaret's).
    pub fn parent_id(&self) -> &str {
        &self.0[36..52]
    }

    /// The trace flags byte.
    pub fn flags(&self) -> u8 {
        u8::from_str_radix(&self.0[53..55], 16).unwrap_or(0)
    }

    /// Whether the caller sampled the trace (flag bit 0).
    pub fn sampled(&self) -> bool {
        self.flags() & 1 == 1
    }
}

impl fmt::Debug for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for TraceParent {
    type Error = TraceParentError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        TraceParent::parse(&s)
    }
}

impl From<TraceParent> for String {
    fn from(t: TraceParent) -> String {
        t.0
    }
}

impl std::str::FromStr for TraceParent {
    type Err = TraceParentError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TraceParent::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn the_w3c_example_is_taken_and_split() {
        let t = TraceParent::parse(GOOD).unwrap();
        assert_eq!(t.as_str(), GOOD);
        assert_eq!(t.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.parent_id(), "00f067aa0ba902b7");
        assert!(t.sampled());
        assert_eq!(
            TraceParent::parse(&format!(" {GOOD}\t")).unwrap().as_str(),
            GOOD
        );
    }

    #[test]
    fn anything_else_is_refused() {
        let bad = [
            "",
            "garbage",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",
            "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
            "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01",
        ];
        for s in bad {
            assert_eq!(
                TraceParent::parse(s),
                Err(TraceParentError::Malformed),
                "{s:?}"
            );
        }
        assert_eq!(
            TraceParent::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01"),
            Err(TraceParentError::ZeroTraceId)
        );
        assert_eq!(
            TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"),
            Err(TraceParentError::ZeroParentId)
        );
    }

    #[test]
    fn serde_refuses_what_parse_refuses() {
        let t: TraceParent = serde_json::from_str(&format!("\"{GOOD}\"")).unwrap();
        assert_eq!(serde_json::to_string(&t).unwrap(), format!("\"{GOOD}\""));
        assert!(serde_json::from_str::<TraceParent>("\"00-xyz\"").is_err());
    }
}
