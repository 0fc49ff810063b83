//! What went wrong: failure classes, kinds, and the reasons a job is dead-lettered.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::ids::ErrorKind;

/// How a failure is treated. A class is a budget rule, not a boolean.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureClass {
    /// May succeed later: retried with backoff while budgets last.
    Transient,
    /// Will never succeed: dead-lettered at once, never retried.
    Permanent,
    /// Asked to wait (rate limit, `Retry-After`, breaker): rescheduled
    /// without spending an attempt, up to `deferrals_max` times.
    Deferred,
}

impl FailureClass {
    /// The word used in the API.
    pub const fn as_str(self) -> &'static str {
        match self {
            FailureClass::Transient => "transient",
            FailureClass::Permanent => "permanent",
            FailureClass::Deferred => "deferred",
        }
    }
}

/// A word that is not a failure class.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not one of transient, permanent, deferred")]
pub struct UnknownFailureClass(pub String);

impl FailureClass {
    /// Every class, in the order the docs list them.
    pub const ALL: [FailureClass; 3] = [
        FailureClass::Transient,
        FailureClass::Permanent,
        FailureClass::Deferred,
    ];
}

/// The API's word (`transient`, `permanent`, `deferred`), exactly: the one
/// parser of the server's fail bodies, the guard's handler replies and the
/// client's.
impl FromStr for FailureClass {
    type Err = UnknownFailureClass;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        FailureClass::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| UnknownFailureClass(s.to_owned()))
    }
}

impl fmt::Display for FailureClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Longest error message kept, in bytes; longer ones are cut at a char boundary.
pub const MESSAGE_BYTES_MAX: usize = 4 * 1024;
/// Longest traceback kept, in bytes; longer ones keep their head and tail.
pub const TRACEBACK_BYTES_MAX: usize = 16 * 1024;

/// A failed attempt as a worker reports it: data, not a Rust error.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// The class the worker chose; `None` lets the type's policy classify by kind.
    pub class: Option<FailureClass>,
    /// What kind of failure this was; selects a per-kind budget.
    pub kind: ErrorKind,
    /// A one-line human message.
    pub message: String,
    /// A traceback or backtrace, if the worker sent one.
    pub traceback: Option<String>,
    /// For deferrals: how long the downstream asked us to wait.
    #[serde(with = "opt_ms", rename = "retry_after_ms")]
    pub retry_after: Option<Duration>,
}

impl Failure {
    /// A failure of `kind` with a message and no class (the policy decides).
    pub fn new(kind: impl Into<ErrorKind>, message: impl Into<String>) -> Self {
        Failure {
            class: None,
            kind: kind.into(),
            message: message.into(),
            traceback: None,
            retry_after: None,
        }
    }

    /// The same failure with an explicit class.
    pub fn with_class(mut self, class: FailureClass) -> Self {
        self.class = Some(class);
        self
    }

    /// The same failure with a `Retry-After`.
    pub fn with_retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    /// The same failure with a traceback.
    pub fn with_traceback(mut self, tb: impl Into<String>) -> Self {
        self.traceback = Some(tb.into());
        self
    }

    /// Cuts message and traceback to their documented caps, in place.
    pub fn truncate_to_caps(&mut self) {
        truncate_head(&mut self.message, MESSAGE_BYTES_MAX);
        if let Some(tb) = &mut self.traceback {
            truncate_middle(tb, TRACEBACK_BYTES_MAX);
        }
    }

    /// The failure a lease expiry is recorded as.
    pub fn lease_expired() -> Self {
        Failure::new(
            ErrorKind::lease_expired(),
            "lease expired before ack or fail (the worker died or stalled)",
        )
        .with_class(FailureClass::Transient)
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    if i >= s.len() {
        return s.len();
    }
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil_char_boundary(s: &str, mut i: usize) -> usize {
    while i < s.len() && !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

/// Keeps the first `max` bytes (at a char boundary) and marks the cut.
pub(crate) fn truncate_head(s: &mut String, max: usize) {
    if s.len() <= max {
        return;
    }
    let cut = floor_char_boundary(s, max);
    let dropped = s.len() - cut;
    s.truncate(cut);
    s.push_str(&format!("…[truncated {dropped} bytes]"));
}

/// Keeps the head and the tail (where the innermost frame usually is).
pub(crate) fn truncate_middle(s: &mut String, max: usize) {
    if s.len() <= max {
        return;
    }
    let half = max / 2;
    let head_end = floor_char_boundary(s, half);
    let tail_start = ceil_char_boundary(s, s.len() - half);
    let dropped = tail_start - head_end;
    *s = format!(
        "{}\n…[truncated {dropped} bytes]…\n{}",
        &s[..head_end],
        &s[tail_start..]
    );
}

/// Why admission refused a payload as poison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoisonReason {
    /// Over the byte cap.
    PayloadTooLarge,
    /// Not valid JSON.
    InvalidJson,
    /// Valid JSON that violates the type's schema for its version.
    SchemaInvalid,
    /// A schema version the type does not know.
    UnknownSchemaVersion,
}

impl PoisonReason {
    /// The word used in the API.
    pub const fn as_str(self) -> &'static str {
        DeadLetterReason::from_poison(self).as_str()
    }
}

/// Why a job (or an admission record) is in the dead letters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterReason {
    /// A permanent failure.
    Permanent,
    /// `attempts_max` spent.
    Exhausted,
    /// A kind's own budget spent.
    KindExhausted,
    /// `crash_loop_max` lease expiries.
    CrashLoop,
    /// `deferrals_max` deferrals.
    DeferralsExhausted,
    /// Admission: over the byte cap.
    PayloadTooLarge,
    /// Admission: not JSON.
    InvalidJson,
    /// Admission: schema violation.
    SchemaInvalid,
    /// Admission: unknown schema version.
    UnknownSchemaVersion,
    /// Broker (RabbitMQ `x-death`, a JetStream `AckTerm`): rejected or
    /// negatively acknowledged without requeue.
    Rejected,
    /// Broker (RabbitMQ): its message TTL ran out.
    Expired,
    /// Broker (RabbitMQ): dropped from the head of a queue at its length limit.
    Maxlen,
    /// Broker (RabbitMQ quorum queue): `x-delivery-limit` reached.
    DeliveryLimit,
    /// Broker (SQS): `maxReceiveCount` reached.
    MaxReceives,
    /// Broker (NATS JetStream): the consumer's `MaxDeliver` reached.
    MaxDeliveries,
    /// Broker (a Kafka dead-letter topic): the listener failed; the
    /// exception's class is the error kind.
    ListenerFailed,
    /// Broker: a message in a watched dead-letter queue that carries no
    /// death information (published there by an application, or its
    /// `x-death` empty or unreadable): how it got there is unknown.
    UnknownOrigin,
}

impl DeadLetterReason {
    /// Every reason, in documentation order.
    pub const ALL: [DeadLetterReason; 17] = [
        DeadLetterReason::Permanent,
        DeadLetterReason::Exhausted,
        DeadLetterReason::KindExhausted,
        DeadLetterReason::CrashLoop,
        DeadLetterReason::DeferralsExhausted,
        DeadLetterReason::PayloadTooLarge,
        DeadLetterReason::InvalidJson,
        DeadLetterReason::SchemaInvalid,
        DeadLetterReason::UnknownSchemaVersion,
        DeadLetterReason::Rejected,
        DeadLetterReason::Expired,
        DeadLetterReason::Maxlen,
        DeadLetterReason::DeliveryLimit,
        DeadLetterReason::MaxReceives,
        DeadLetterReason::MaxDeliveries,
        DeadLetterReason::ListenerFailed,
        DeadLetterReason::UnknownOrigin,
    ];

    /// The dead-letter reason of a poison verdict.
    pub const fn from_poison(p: PoisonReason) -> Self {
        match p {
            PoisonReason::PayloadTooLarge => DeadLetterReason::PayloadTooLarge,
            PoisonReason::InvalidJson => DeadLetterReason::InvalidJson,
            PoisonReason::SchemaInvalid => DeadLetterReason::SchemaInvalid,
            PoisonReason::UnknownSchemaVersion => DeadLetterReason::UnknownSchemaVersion,
        }
    }

    /// The word used in the API, metrics and the database.
    pub const fn as_str(self) -> &'static str {
        match self {
            DeadLetterReason::Permanent => "permanent",
            DeadLetterReason::Exhausted => "exhausted",
            DeadLetterReason::KindExhausted => "kind_exhausted",
            DeadLetterReason::CrashLoop => "crash_loop",
            DeadLetterReason::DeferralsExhausted => "deferrals_exhausted",
            DeadLetterReason::PayloadTooLarge => "payload_too_large",
            DeadLetterReason::InvalidJson => "invalid_json",
            DeadLetterReason::SchemaInvalid => "schema_invalid",
            DeadLetterReason::UnknownSchemaVersion => "unknown_schema_version",
            DeadLetterReason::Rejected => "rejected",
            DeadLetterReason::Expired => "expired",
            DeadLetterReason::Maxlen => "maxlen",
            DeadLetterReason::DeliveryLimit => "delivery_limit",
            DeadLetterReason::MaxReceives => "max_receives",
            DeadLetterReason::MaxDeliveries => "max_deliveries",
            DeadLetterReason::ListenerFailed => "listener_failed",
            DeadLetterReason::UnknownOrigin => "unknown_origin",
        }
    }

    /// Whether this reason comes from the gateway rather than a worker.
    pub const fn is_admission(self) -> bool {
        matches!(
            self,
            DeadLetterReason::PayloadTooLarge
                | DeadLetterReason::InvalidJson
                | DeadLetterReason::SchemaInvalid
                | DeadLetterReason::UnknownSchemaVersion
        )
    }

    /// Whether this reason is a broker's own, for dead letters taken in
    /// from a broker's dead-letter queue (`stage: "broker"`).
    pub const fn is_broker(self) -> bool {
        matches!(
            self,
            DeadLetterReason::Rejected
                | DeadLetterReason::Expired
                | DeadLetterReason::Maxlen
                | DeadLetterReason::DeliveryLimit
                | DeadLetterReason::MaxReceives
                | DeadLetterReason::MaxDeliveries
                | DeadLetterReason::ListenerFailed
                | DeadLetterReason::UnknownOrigin
        )
    }
}

impl fmt::Display for DeadLetterReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A word that names no dead-letter reason.
#[derive(Debug, thiserror::Error)]
#[error(
    "unknown dead-letter reason {0:?}; expected one of permanent, exhausted, kind_exhausted, crash_loop, deferrals_exhausted, payload_too_large, invalid_json, schema_invalid, unknown_schema_version, rejected, expired, maxlen, delivery_limit, max_receives, max_deliveries, listener_failed, unknown_origin"
)]
pub struct UnknownReason(pub String);

impl FromStr for DeadLetterReason {
    type Err = UnknownReason;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DeadLetterReason::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownReason(s.to_owned()))
    }
}

mod opt_ms {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&crate::time::duration_ms(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<u64>::deserialize(d)?.map(Duration::from_millis))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_classes_round_trip_and_nothing_else_parses() {
        for c in FailureClass::ALL {
            assert_eq!(c.as_str().parse::<FailureClass>(), Ok(c));
            // The serde word is the same one.
            assert_eq!(
                serde_json::to_value(c).unwrap(),
                serde_json::json!(c.as_str())
            );
        }
        for bad in [
            "",
            "Transient",
            " transient",
            "transient ",
            "retry",
            "deferred\0",
        ] {
            let e = bad.parse::<FailureClass>().unwrap_err();
            assert_eq!(e, UnknownFailureClass(bad.to_owned()));
            assert!(e.to_string().contains("transient, permanent, deferred"));
        }
    }

    #[test]
    fn reasons_round_trip() {
        for r in DeadLetterReason::ALL {
            assert_eq!(r.as_str().parse::<DeadLetterReason>().unwrap(), r);
        }
    }

    #[test]
    fn truncation_respects_char_boundaries_and_caps() {
        let mut f = Failure::new("x", "é".repeat(MESSAGE_BYTES_MAX))
            .with_traceback("ü".repeat(TRACEBACK_BYTES_MAX));
        f.truncate_to_caps();
        assert!(f.message.len() <= MESSAGE_BYTES_MAX + 40);
        assert!(f.message.ends_with("bytes]"));
        let tb = f.traceback.unwrap();
        assert!(tb.len() <= TRACEBACK_BYTES_MAX + 40);
        assert!(tb.contains("…[truncated"));
    }

    #[test]
    fn short_text_is_left_alone() {
        let mut f = Failure::new("x", "short").with_traceback("tb");
        f.truncate_to_caps();
        assert_eq!(f.message, "short");
        assert_eq!(f.traceback.as_deref(), Some("tb"));
    }
}
