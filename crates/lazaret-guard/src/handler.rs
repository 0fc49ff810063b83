//! The team's handler: an HTTP endpoint in any language (`deliver`), or a
//! Rust closure. Both answer with an [`Outcome`]; the runtime does the rest.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use futures_util::future::BoxFuture;
use lazaret_core::{ErrorKind, Failure, FailureClass};
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::StatusCode;
use serde::Deserialize;

use crate::message::Delivery;

/// What the handler made of one delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Done: the message is acknowledged.
    Success,
    /// Failed; the class (or the type's policy for the kind) decides what
    /// happens next.
    Failure(Failure),
}

/// One delivery as the handler sees it.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    /// The message.
    pub delivery: &'a Delivery,
    /// 1 on the first delivery.
    pub attempt: u32,
    /// The source's name.
    pub source: &'a str,
    /// `<source>:<message id>`.
    pub idempotency_key: &'a str,
}

/// Runs one delivery. Implemented by [`HttpHandler`] and by closures
/// through [`handler_fn`].
pub trait Handler: Send + Sync {
    /// Handles one delivery; a time limit is the runtime's.
    fn handle<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Outcome>;
}

/// A closure as a [`Handler`]: it gets an owned copy of the call.
pub fn handler_fn<F, Fut>(f: F) -> FnHandler<F>
where
    F: Fn(OwnedCall) -> Fut + Send + Sync,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    FnHandler(f)
}

/// The owned form of a [`Call`], for closures.
#[derive(Clone, Debug)]
pub struct OwnedCall {
    /// The message.
    pub delivery: Delivery,
    /// 1 on the first delivery.
    pub attempt: u32,
    /// The source's name.
    pub source: String,
    /// `<source>:<message id>`.
    pub idempotency_key: String,
}

/// See [`handler_fn`].
pub struct FnHandler<F>(F);

impl<F> fmt::Debug for FnHandler<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnHandler")
    }
}

impl<F, Fut> Handler for FnHandler<F>
where
    F: Fn(OwnedCall) -> Fut + Send + Sync,
    Fut: Future<Output = Outcome> + Send + 'static,
{
    fn handle<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Outcome> {
        Box::pin((self.0)(OwnedCall {
            delivery: call.delivery.clone(),
            attempt: call.attempt,
            source: call.source.to_owned(),
            idempotency_key: call.idempotency_key.to_owned(),
        }))
    }
}

/// POSTs each delivery to a URL, as the contract's guard mode says.
#[derive(Clone, Debug)]
pub struct HttpHandler {
    url: String,
    /// Parsed once: reqwest would parse the string on every request.
    parsed: Option<reqwest::Url>,
    client: reqwest::Client,
}

/// The longest wait a handler may ask for (`Retry-After`).
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(12 * 3600);

impl HttpHandler {
    /// A handler that POSTs to `url`, with connections kept alive.
    pub fn new(url: impl Into<String>) -> HttpHandler {
        let url = url.into();
        HttpHandler {
            parsed: reqwest::Url::parse(&url).ok(),
            url,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .build()
                .unwrap_or_default(),
        }
    }
}

impl Handler for HttpHandler {
    fn handle<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            let d = call.delivery;
            let headers = serde_json::to_string(&d.headers).unwrap_or_else(|_| "{}".into());
            let req = match &self.parsed {
                Some(url) => self.client.post(url.clone()),
                None => self.client.post(&self.url),
            };
            let req = req
                .header(
                    "Content-Type",
                    d.content_type
                        .as_deref()
                        .unwrap_or("application/octet-stream"),
                )
                .header("Lazaret-Attempt", call.attempt.to_string())
                .header("Lazaret-Source", call.source)
                .header(
                    "Lazaret-Message-Id",
                    utf8_percent_encode(&d.message_id, NON_ALPHANUMERIC).to_string(),
                )
                .header(
                    "Lazaret-Idempotency-Key",
                    utf8_percent_encode(call.idempotency_key, NON_ALPHANUMERIC).to_string(),
                )
                .header("Lazaret-Headers", ascii_json(&headers))
                .body(d.body.clone());
            match req.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    if status.is_success() {
                        return Outcome::Success;
                    }
                    let retry_after = resp
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(parse_retry_after);
                    let body = resp.bytes().await.unwrap_or_default();
                    Outcome::Failure(classify(status, retry_after, &body))
                }
                Err(e) if e.is_timeout() => Outcome::Failure(
                    Failure::new("timeout", e.to_string()).with_class(FailureClass::Transient),
                ),
                Err(e) => Outcome::Failure(
                    Failure::new("connect", format!("POST {}: {e}", self.url))
                        .with_class(FailureClass::Transient),
                ),
            }
        })
    }
}

/// JSON in an HTTP header must be visible ASCII: escape everything else as
/// `\uXXXX` (still the same JSON).
fn ascii_json(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if c.is_ascii() && !c.is_ascii_control() {
            out.push(c);
        } else {
            let mut buf = [0u16; 2];
            for u in c.encode_utf16(&mut buf) {
                out.push_str(&format!("\\u{u:04x}"));
            }
        }
    }
    out
}

/// `Retry-After` as seconds or an HTTP date, capped at 12 h.
pub fn parse_retry_after(v: &str) -> Option<Duration> {
    let v = v.trim();
    let d = if let Ok(secs) = v.parse::<u64>() {
        Duration::from_secs(secs)
    } else {
        let at = httpdate::parse_http_date(v).ok()?;
        at.duration_since(std::time::SystemTime::now())
            .unwrap_or(Duration::ZERO)
    };
    Some(d.min(RETRY_AFTER_MAX))
}

#[derive(Debug, Deserialize)]
struct ErrorBody {
    error: ErrorFields,
}

#[derive(Debug, Deserialize)]
struct ErrorFields {
    class: Option<String>,
    kind: Option<String>,
    message: Option<String>,
    traceback: Option<String>,
    retry_after_ms: Option<u64>,
}

/// The contract's status → class table: 2xx success (not here); 429, or
/// 503 with `Retry-After`, deferred; 408 and other 5xx transient; any other
/// 4xx permanent. A body `{"error": {…}}` sets class, kind, message,
/// traceback and `retry_after_ms` itself.
pub fn classify(status: StatusCode, retry_after: Option<Duration>, body: &[u8]) -> Failure {
    let code = status.as_u16();
    let (mut class, retry) = match code {
        429 => (FailureClass::Deferred, retry_after),
        503 if retry_after.is_some() => (FailureClass::Deferred, retry_after),
        408 | 500..=599 => (FailureClass::Transient, None),
        _ => (FailureClass::Permanent, None),
    };
    let mut failure = Failure::new(
        ErrorKind::from(format!("http_{code}").as_str()),
        format!("the handler answered {status}"),
    );
    let parsed = if body.is_empty() {
        None
    } else {
        serde_json::from_slice::<ErrorBody>(body).ok()
    };
    if let Some(b) = parsed {
        let e = b.error;
        if let Some(c) = e.class.as_deref().and_then(parse_class) {
            class = c;
        }
        if let Some(k) = e.kind.filter(|k| !k.is_empty()) {
            failure.kind = ErrorKind::from(k.as_str());
        }
        if let Some(m) = e.message {
            failure.message = m;
        }
        failure.traceback = e.traceback;
        if let Some(ms) = e.retry_after_ms {
            failure.retry_after = Some(Duration::from_millis(ms).min(RETRY_AFTER_MAX));
        }
    } else if !body.is_empty() {
        let text = String::from_utf8_lossy(&body[..body.len().min(512)]);
        failure.message = format!("the handler answered {status}: {text}");
    }
    if failure.retry_after.is_none() {
        failure.retry_after = retry;
    }
    failure.class = Some(class);
    failure
}

fn parse_class(s: &str) -> Option<FailureClass> {
    match s {
        "transient" => Some(FailureClass::Transient),
        "permanent" => Some(FailureClass::Permanent),
        "deferred" => Some(FailureClass::Deferred),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class_of(code: u16, retry: Option<u64>) -> (FailureClass, String) {
        let f = classify(
            StatusCode::from_u16(code).unwrap_or(StatusCode::IM_A_TEAPOT),
            retry.map(Duration::from_secs),
            b"",
        );
        (
            f.class.unwrap_or(FailureClass::Transient),
            f.kind.to_string(),
        )
    }

    #[test]
    fn statuses_map_to_classes_as_the_contract_says() {
        use FailureClass::*;
        assert_eq!(class_of(429, None), (Deferred, "http_429".into()));
        assert_eq!(class_of(503, Some(5)), (Deferred, "http_503".into()));
        assert_eq!(class_of(503, None), (Transient, "http_503".into()));
        assert_eq!(class_of(408, None), (Transient, "http_408".into()));
        assert_eq!(class_of(500, None), (Transient, "http_500".into()));
        assert_eq!(class_of(400, None), (Permanent, "http_400".into()));
        assert_eq!(class_of(404, None), (Permanent, "http_404".into()));
    }

    #[test]
    fn an_error_body_sets_its_own_fields() {
        let f = classify(
            StatusCode::UNPROCESSABLE_ENTITY,
            None,
            br#"{"error": {"class": "transient", "kind": "db_locked", "message": "try later", "traceback": "tb", "retry_after_ms": 1500}}"#,
        );
        assert_eq!(f.class, Some(FailureClass::Transient));
        assert_eq!(f.kind.as_str(), "db_locked");
        assert_eq!(f.message, "try later");
        assert_eq!(f.traceback.as_deref(), Some("tb"));
        assert_eq!(f.retry_after, Some(Duration::from_millis(1500)));
    }

    #[test]
    fn retry_after_is_seconds_or_a_date_and_capped() {
        assert_eq!(parse_retry_after("7"), Some(Duration::from_secs(7)));
        assert_eq!(parse_retry_after("999999"), Some(RETRY_AFTER_MAX));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
    }

    #[test]
    fn header_json_stays_ascii() {
        assert_eq!(ascii_json(r#"{"a":"é"}"#), r#"{"a":"\u00e9"}"#);
    }
}
