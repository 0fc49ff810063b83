//! A failed attempt as data: the class and kind a handler chooses, and the
//! ready-made classifications of common errors (I/O, timeouts, HTTP).
//!
//! The rule of thumb, from the seeds' classification: what may work later is
//! transient (retried with backoff while budgets last), what never will is
//! permanent (dead-lettered at once), and a downstream that asked us to wait
//! is deferred (rescheduled without spending an attempt).

use std::fmt;
use std::time::{Duration, SystemTime};

use lazaret_core::{ErrorKind, FailureClass};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// How the server should treat a failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// May succeed later: retried with backoff while budgets last.
    Transient,
    /// Will never succeed: dead-lettered at once.
    Permanent,
    /// Asked to wait: rescheduled after `retry_after` (the type's backoff
    /// when `None`) without spending an attempt, up to `deferrals_max`.
    Deferred {
        /// How long the downstream asked us to wait.
        retry_after: Option<Duration>,
    },
    /// No class: the type's policy classifies by kind (`kind_classes`),
    /// and an unknown kind is transient.
    ByKind,
}

impl Class {
    /// The API's word, `None` for [`Class::ByKind`].
    pub fn as_str(&self) -> Option<&'static str> {
        match self {
            Class::Transient => Some("transient"),
            Class::Permanent => Some("permanent"),
            Class::Deferred { .. } => Some("deferred"),
            Class::ByKind => None,
        }
    }
}

/// A failed attempt: data a handler returns, not a Rust error to bubble up.
///
/// Build one with [`Failure::transient`], [`Failure::permanent`],
/// [`Failure::deferred`] or [`Failure::by_kind`], or convert a common error
/// with `?`: [`std::io::Error`] and [`tokio::time::error::Elapsed`] are
/// transient, a [`reqwest::Error`] is classified by what went wrong (see
/// [`Failure::from_reqwest`]), and an HTTP reply by its status with
/// [`Failure::from_status`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// How the server should treat it.
    pub class: Class,
    /// What kind of failure (`timeout`, `http_503`, `parse`, …): selects a
    /// per-kind budget and a breaker.
    pub kind: ErrorKind,
    /// One human line.
    pub message: String,
    /// A traceback or backtrace, when there is one.
    pub traceback: Option<String>,
}

impl Failure {
    /// A failure with an explicit class.
    pub fn new(class: Class, kind: impl Into<ErrorKind>, message: impl Into<String>) -> Self {
        Failure {
            class,
            kind: kind.into(),
            message: message.into(),
            traceback: None,
        }
    }

    /// May work later: retried with backoff.
    pub fn transient(kind: impl Into<ErrorKind>, message: impl Into<String>) -> Self {
        Self::new(Class::Transient, kind, message)
    }

    /// Never will work: dead-lettered at once.
    pub fn permanent(kind: impl Into<ErrorKind>, message: impl Into<String>) -> Self {
        Self::new(Class::Permanent, kind, message)
    }

    /// The downstream asked to wait `retry_after`: no attempt is spent.
    pub fn deferred(
        kind: impl Into<ErrorKind>,
        message: impl Into<String>,
        retry_after: Duration,
    ) -> Self {
        Self::new(
            Class::Deferred {
                retry_after: Some(retry_after),
            },
            kind,
            message,
        )
    }

    /// Let the type's policy classify by `kind`.
    pub fn by_kind(kind: impl Into<ErrorKind>, message: impl Into<String>) -> Self {
        Self::new(Class::ByKind, kind, message)
    }

    /// The same failure with a traceback.
    pub fn with_traceback(mut self, traceback: impl Into<String>) -> Self {
        self.traceback = Some(traceback.into());
        self
    }

    /// A payload that does not deserialise into the handler's type:
    /// permanent, kind `parse` (the same bytes will never parse).
    pub fn parse(error: impl fmt::Display) -> Self {
        Self::permanent(
            "parse",
            format!("the payload does not match the handler's type: {error}"),
        )
    }

    /// A handler that panicked: transient, kind `panic`, so a flaky panic
    /// is retried but a deterministic one spends its budget and lands in the
    /// dead letters with the message and the backtrace.
    pub fn panic(message: impl Into<String>, backtrace: impl Into<String>) -> Self {
        Self::transient("panic", message).with_traceback(backtrace)
    }

    /// A timeout: transient, kind `timeout`.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::transient("timeout", message)
    }

    /// An I/O error: transient (kind `timeout` for timeouts, else `io`).
    pub fn from_io(e: &std::io::Error) -> Self {
        let kind = match e.kind() {
            std::io::ErrorKind::TimedOut => "timeout",
            _ => "io",
        };
        Self::transient(kind, e.to_string())
    }

    /// Classifies an HTTP status (`None` for 1xx–3xx, which are not
    /// failures here). Kind `http_<status>`.
    ///
    /// - 429 or 503 with a `Retry-After`: deferred by that long;
    /// - 5xx, 408 (request timeout) and 429 without `Retry-After`: transient;
    /// - any other 4xx: permanent (the request itself is wrong).
    pub fn from_status(
        status: u16,
        retry_after: Option<Duration>,
        message: impl Into<String>,
    ) -> Option<Self> {
        let kind = format!("http_{status}");
        let message = message.into();
        Some(match (status, retry_after) {
            (0..=399, _) => return None,
            (429 | 503, Some(after)) => Self::deferred(kind, message, after),
            (500..=599 | 408 | 429, _) => Self::transient(kind, message),
            _ => Self::permanent(kind, message),
        })
    }

    /// Classifies a downstream HTTP reply by its status and `Retry-After`
    /// (`None` when it is not an error).
    pub fn from_response(response: &reqwest::Response) -> Option<Self> {
        let status = response.status();
        let retry_after = response
            .headers()
            .get(reqwest::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        Self::from_status(
            status.as_u16(),
            retry_after,
            format!("{} answered {status}", response.url()),
        )
    }

    /// Classifies a `reqwest` error: timeouts and connection errors are
    /// transient; an error status is classified by [`Failure::from_status`];
    /// anything else (a body that would not decode, a redirect loop) is
    /// transient with kind `http`.
    pub fn from_reqwest(e: &reqwest::Error) -> Self {
        if e.is_timeout() {
            return Self::timeout(e.to_string());
        }
        if let Some(status) = e.status() {
            if let Some(f) = Self::from_status(status.as_u16(), None, e.to_string()) {
                return f;
            }
        }
        if e.is_connect() {
            return Self::transient("connect", e.to_string());
        }
        Self::transient("http", e.to_string())
    }

    /// For deferrals: how long to wait.
    pub fn retry_after(&self) -> Option<Duration> {
        match self.class {
            Class::Deferred { retry_after } => retry_after,
            _ => None,
        }
    }

    /// The failure with message and traceback cut to the server's caps, so a
    /// runaway backtrace never makes the report itself too large.
    pub(crate) fn capped(self) -> Self {
        let mut core = lazaret_core::Failure::new(self.kind.clone(), self.message);
        core.traceback = self.traceback;
        core.truncate_to_caps();
        Failure {
            class: self.class,
            kind: self.kind,
            message: core.message,
            traceback: core.traceback,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.class {
            Class::ByKind => write!(f, "{}: {}", self.kind, self.message),
            Class::Deferred {
                retry_after: Some(d),
            } => write!(
                f,
                "deferred {} for {} ms: {}",
                self.kind,
                d.as_millis(),
                self.message
            ),
            c => write!(
                f,
                "{} {}: {}",
                c.as_str().unwrap_or_default(),
                self.kind,
                self.message
            ),
        }
    }
}

impl From<std::io::Error> for Failure {
    fn from(e: std::io::Error) -> Self {
        Self::from_io(&e)
    }
}

impl From<tokio::time::error::Elapsed> for Failure {
    fn from(e: tokio::time::error::Elapsed) -> Self {
        Self::timeout(e.to_string())
    }
}

impl From<reqwest::Error> for Failure {
    fn from(e: reqwest::Error) -> Self {
        Self::from_reqwest(&e)
    }
}

/// Reads a `Retry-After` value: delay-seconds or an HTTP-date (a date in
/// the past means "now").
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The API's error object.
#[derive(Serialize, Deserialize)]
struct Wire {
    #[serde(default)]
    class: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    traceback: Option<String>,
    #[serde(default)]
    retry_after_ms: Option<u64>,
}

impl Serialize for Failure {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        Wire {
            class: self.class.as_str().map(str::to_owned),
            kind: Some(self.kind.as_str().to_owned()),
            message: Some(self.message.clone()),
            traceback: self.traceback.clone(),
            retry_after_ms: self.retry_after().map(crate::wire::ms),
        }
        .serialize(s)
    }
}

impl<'de> Deserialize<'de> for Failure {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let w = Wire::deserialize(d)?;
        let class = match w.class.as_deref().map(str::parse::<FailureClass>) {
            None => Class::ByKind,
            Some(Ok(FailureClass::Transient)) => Class::Transient,
            Some(Ok(FailureClass::Permanent)) => Class::Permanent,
            Some(Ok(FailureClass::Deferred)) => Class::Deferred {
                retry_after: w.retry_after_ms.map(Duration::from_millis),
            },
            Some(Err(e)) => {
                return Err(serde::de::Error::custom(format!(
                    "unknown failure class: {e}"
                )));
            }
        };
        Ok(Failure {
            class,
            kind: ErrorKind::new(w.kind.unwrap_or_else(|| "error".into())),
            message: w.message.unwrap_or_default(),
            traceback: w.traceback,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class_of(status: u16, retry_after: Option<u64>) -> Option<(Class, String)> {
        Failure::from_status(status, retry_after.map(Duration::from_secs), "x")
            .map(|f| (f.class, f.kind.to_string()))
    }

    #[test]
    fn http_statuses_are_classified_like_the_seed_says() {
        let deferred = |s| Class::Deferred {
            retry_after: Some(Duration::from_secs(s)),
        };
        assert_eq!(class_of(200, None), None);
        assert_eq!(class_of(204, Some(5)), None);
        assert_eq!(
            class_of(500, None),
            Some((Class::Transient, "http_500".into()))
        );
        assert_eq!(
            class_of(502, Some(9)),
            Some((Class::Transient, "http_502".into()))
        );
        assert_eq!(
            class_of(503, None),
            Some((Class::Transient, "http_503".into()))
        );
        assert_eq!(
            class_of(503, Some(7)),
            Some((deferred(7), "http_503".into()))
        );
        assert_eq!(
            class_of(429, Some(2)),
            Some((deferred(2), "http_429".into()))
        );
        assert_eq!(
            class_of(429, None),
            Some((Class::Transient, "http_429".into()))
        );
        assert_eq!(
            class_of(408, None),
            Some((Class::Transient, "http_408".into()))
        );
        for s in [400, 401, 403, 404, 409, 410, 422] {
            assert_eq!(
                class_of(s, Some(1)),
                Some((Class::Permanent, format!("http_{s}")))
            );
        }
    }

    #[test]
    fn io_errors_and_timeouts_are_transient() {
        let f: Failure = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset").into();
        assert_eq!((f.class, f.kind.as_str()), (Class::Transient, "io"));
        let f: Failure = std::io::Error::from(std::io::ErrorKind::TimedOut).into();
        assert_eq!((f.class, f.kind.as_str()), (Class::Transient, "timeout"));
        let f = Failure::timeout("slow");
        assert_eq!((f.class, f.kind.as_str()), (Class::Transient, "timeout"));
    }

    #[tokio::test]
    async fn elapsed_is_a_transient_timeout() {
        let elapsed = tokio::time::timeout(Duration::ZERO, std::future::pending::<()>())
            .await
            .unwrap_err();
        let f = Failure::from(elapsed);
        assert_eq!((f.class, f.kind.as_str()), (Class::Transient, "timeout"));
    }

    #[test]
    fn parse_and_panic_failures() {
        let e = serde_json::from_str::<u32>("\"x\"").unwrap_err();
        let f = Failure::parse(e);
        assert_eq!((f.class, f.kind.as_str()), (Class::Permanent, "parse"));
        let f = Failure::panic("boom", "0: frame");
        assert_eq!((f.class, f.kind.as_str()), (Class::Transient, "panic"));
        assert_eq!(f.traceback.as_deref(), Some("0: frame"));
    }

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        assert_eq!(
            parse_retry_after(" 120 ", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:50:07 GMT", now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon", now), None);
    }

    #[test]
    fn the_wire_shape_round_trips() {
        let f = Failure::deferred("http_429", "slow down", Duration::from_millis(1500));
        let v = serde_json::to_value(&f).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"class": "deferred", "kind": "http_429", "message": "slow down",
                "traceback": null, "retry_after_ms": 1500})
        );
        assert_eq!(serde_json::from_value::<Failure>(v).unwrap(), f);
        let by_kind: Failure =
            serde_json::from_str(r#"{"class":null,"kind":"x","message":"m"}"#).unwrap();
        assert_eq!(by_kind.class, Class::ByKind);
    }

    #[test]
    fn huge_tracebacks_are_capped() {
        let f = Failure::panic("p", "frame\n".repeat(100_000)).capped();
        assert!(f.traceback.unwrap().len() <= lazaret_core::failure::TRACEBACK_BYTES_MAX + 64);
    }
}
