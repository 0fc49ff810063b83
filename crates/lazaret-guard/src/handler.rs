//! The team's handler: an HTTP endpoint in any language (`deliver`), or a
//! Rust closure. Both answer with an [`Outcome`]; the runtime does the rest.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use base64::Engine;
use futures_util::future::BoxFuture;
use lazaret_core::bound::{
    ERROR_BODY_BYTES_MAX, HEADERS_LINE_BYTES_MAX, QUOTED_URL_BYTES_MAX, bounded_name,
    is_header_value, mask_url, quote_line,
};
use lazaret_core::{ErrorKind, Failure, FailureClass};
use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
use reqwest::StatusCode;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::message::Delivery;
use crate::spec::DeliverFormat;

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
    /// The W3C `traceparent` to send (the message's, validated, or
    /// lazaret's delivery span in its trace when spans are exported).
    pub traceparent: Option<&'a str>,
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
    /// As [`Call::traceparent`].
    pub traceparent: Option<String>,
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
            traceparent: call.traceparent.map(str::to_owned),
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
    format: DeliverFormat,
    /// The type's `kind_classes`: they override the status table (not a
    /// class the handler's JSON body gives).
    kind_classes: BTreeMap<ErrorKind, FailureClass>,
}

/// The longest wait a handler may ask for (`Retry-After`).
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(12 * 3600);

/// The header that says `Lazaret-Headers` was cut to
/// [`HEADERS_LINE_BYTES_MAX`].
pub const HEADERS_TRUNCATED: &str = "Lazaret-Headers-Truncated";

/// The entry of `Lazaret-Headers` (and of the envelope's `headers`) that
/// keeps a message content type which is not a valid header value, when
/// `Content-Type` says `application/octet-stream` instead.
pub const RAW_CONTENT_TYPE: &str = "x-lazaret-content-type";

impl HttpHandler {
    /// A handler that POSTs to `url`, with connections kept alive. It
    /// never follows a redirect: a 3xx is the handler's answer.
    pub fn new(url: impl Into<String>) -> HttpHandler {
        let url = url.into();
        HttpHandler {
            parsed: reqwest::Url::parse(&url).ok(),
            url,
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(256)
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap_or_default(),
            format: DeliverFormat::Raw,
            kind_classes: BTreeMap::new(),
        }
    }

    /// Classes by kind (the type's `kind_classes`) that override the
    /// status table: `http_301 = "transient"` with a `kinds` budget makes a
    /// redirect retried, like any kind.
    pub fn with_kind_classes(mut self, classes: BTreeMap<ErrorKind, FailureClass>) -> HttpHandler {
        self.kind_classes = classes;
        self
    }

    /// Sends each delivery in `format` (the source's `deliver_format`).
    pub fn with_format(mut self, format: DeliverFormat) -> HttpHandler {
        self.format = format;
        self
    }
}

impl Handler for HttpHandler {
    fn handle<'a>(&'a self, call: Call<'a>) -> BoxFuture<'a, Outcome> {
        Box::pin(async move {
            let Some(url) = &self.parsed else {
                return Outcome::Failure(
                    Failure::new(
                        "connect",
                        format!(
                            "deliver = {:?} is not a valid URL; fix the source's deliver",
                            mask_url(&self.url)
                        ),
                    )
                    .with_class(FailureClass::Transient),
                );
            };
            let (headers, body) = match request_parts(&call, self.format) {
                Ok(parts) => parts,
                Err(bad) => return Outcome::Failure(bad),
            };
            let req = self.client.post(url.clone()).headers(headers).body(body);
            match req.send().await {
                Ok(resp) => {
                    let status = resp.status();
                    if status.is_success() {
                        return Outcome::Success;
                    }
                    if status.is_redirection() {
                        let to = resp
                            .headers()
                            .get(reqwest::header::LOCATION)
                            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
                        // The body is never read: dropping the answer drops
                        // the connection.
                        let mut f = redirected(status, to.as_deref());
                        if let Some(c) = self.kind_classes.get(&f.kind) {
                            f.class = Some(*c);
                        }
                        return Outcome::Failure(f);
                    }
                    let retry_after = resp
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(parse_retry_after);
                    let body = read_at_most(resp, ERROR_BODY_BYTES_MAX).await;
                    Outcome::Failure(classify_with(
                        status,
                        retry_after,
                        &body,
                        &self.kind_classes,
                    ))
                }
                // reqwest quotes the URL it was given, credentials and all:
                // the message says it masked.
                Err(e) if e.is_timeout() => Outcome::Failure(
                    Failure::new(
                        "timeout",
                        format!("POST {}: {}", mask_url(&self.url), with_causes(e)),
                    )
                    .with_class(FailureClass::Transient),
                ),
                Err(e) if e.is_builder() => Outcome::Failure(bad_message(
                    "request",
                    &format!("the HTTP client cannot build it: {}", with_causes(e)),
                )),
                Err(e) => Outcome::Failure(
                    Failure::new(
                        "connect",
                        format!("POST {}: {}", mask_url(&self.url), with_causes(e)),
                    )
                    .with_class(FailureClass::Transient),
                ),
            }
        })
    }
}

/// A transport error without the URL reqwest quotes (credentials and all),
/// with its causes (`connection refused`), which its own text leaves out.
fn with_causes(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

/// The headers and body POSTed for one delivery. Every value taken from the
/// message goes through the bounds of [`lazaret_core::bound`]: a content
/// type that is not a valid header value is sent as
/// `application/octet-stream` (the raw value kept in `Lazaret-Headers` as
/// [`RAW_CONTENT_TYPE`]), ids are percent-encoded, the broker headers are
/// ASCII JSON cut to [`HEADERS_LINE_BYTES_MAX`]. Whatever still cannot be
/// put on the wire is the message's fault, never the handler's: a permanent
/// failure of kind `bad_message` naming the property, which never feeds the
/// handler's breaker (only transient failures do).
pub fn request_parts(
    call: &Call<'_>,
    format: DeliverFormat,
) -> Result<(HeaderMap, Vec<u8>), Failure> {
    let d = call.delivery;
    let mut broker_headers = d.headers.clone();
    let content_type = match d.content_type.as_deref() {
        Some(ct) if is_header_value(ct) => ct,
        Some(raw) => {
            broker_headers.insert(RAW_CONTENT_TYPE.into(), Value::String(raw.to_owned()));
            "application/octet-stream"
        }
        None => "application/octet-stream",
    };
    let (line, truncated) = headers_line(&broker_headers);
    let mut h = HeaderMap::new();
    let mut put = |name: &'static str, property: &str, value: String| {
        let v = HeaderValue::try_from(value).map_err(|e| {
            bad_message(
                property,
                &format!("it is not a valid HTTP header value ({e})"),
            )
        })?;
        h.insert(HeaderName::from_static(name), v);
        Ok::<(), Failure>(())
    };
    let body = match format {
        DeliverFormat::Raw => {
            put("content-type", "content type", content_type.to_owned())?;
            d.body.clone()
        }
        DeliverFormat::Envelope => {
            put(
                "content-type",
                "content type",
                "application/json".to_owned(),
            )?;
            envelope_body(call)
        }
    };
    put("lazaret-attempt", "attempt", call.attempt.to_string())?;
    put("lazaret-source", "source name", call.source.to_owned())?;
    put(
        "lazaret-message-id",
        "message id",
        utf8_percent_encode(&d.message_id, NON_ALPHANUMERIC).to_string(),
    )?;
    put(
        "lazaret-idempotency-key",
        "idempotency key",
        utf8_percent_encode(call.idempotency_key, NON_ALPHANUMERIC).to_string(),
    )?;
    put("lazaret-headers", "headers", line)?;
    if truncated {
        put("lazaret-headers-truncated", "headers", "true".to_owned())?;
    }
    if let Some(tp) = call.traceparent {
        // Validated (lowercase hex and dashes): always a header value.
        put("traceparent", "traceparent", tp.to_owned())?;
    }
    Ok((h, body))
}

/// The permanent failure of a message lazaret cannot send: its `property`
/// is named, and why.
fn bad_message(property: &str, why: &str) -> Failure {
    Failure::new(
        "bad_message",
        format!("the message's {property} cannot be sent to the handler: {why}"),
    )
    .with_class(FailureClass::Permanent)
}

/// `deliver_format = "envelope"`: the message as one JSON object, its
/// headers whole (never cut), the body as text when it is UTF-8 and as
/// base64 otherwise.
fn envelope_body(call: &Call<'_>) -> Vec<u8> {
    let d = call.delivery;
    let mut m = Map::new();
    m.insert("message_id".into(), Value::String(d.message_id.clone()));
    m.insert("source".into(), Value::String(call.source.to_owned()));
    m.insert("attempt".into(), Value::from(call.attempt));
    m.insert(
        "content_type".into(),
        d.content_type.clone().map_or(Value::Null, Value::String),
    );
    m.insert("headers".into(), Value::Object(d.headers.clone()));
    match std::str::from_utf8(&d.body) {
        Ok(text) => m.insert("body".into(), Value::String(text.to_owned())),
        Err(_) => m.insert(
            "body_base64".into(),
            Value::String(base64::engine::general_purpose::STANDARD.encode(&d.body)),
        ),
    };
    serde_json::to_vec(&Value::Object(m)).unwrap_or_default()
}

/// The broker headers as one `Lazaret-Headers` line: ASCII JSON of at most
/// [`HEADERS_LINE_BYTES_MAX`] bytes. When the whole map is longer, entries
/// are kept in name order while they fit and the others are left out
/// whole (the line stays valid JSON); `true` says some were left out.
pub fn headers_line(headers: &Map<String, Value>) -> (String, bool) {
    let full = ascii_json(&Value::Object(headers.clone()).to_string());
    if full.len() <= HEADERS_LINE_BYTES_MAX {
        return (full, false);
    }
    let mut kept = Map::new();
    // `{}`, then each entry `"name":value` with a comma before all but the first.
    let mut len = 2;
    for (k, v) in headers {
        let entry = ascii_json(&format!("{}:{v}", Value::String(k.clone()))).len();
        let add = entry + usize::from(!kept.is_empty());
        if len + add <= HEADERS_LINE_BYTES_MAX {
            kept.insert(k.clone(), v.clone());
            len += add;
        }
    }
    (ascii_json(&Value::Object(kept).to_string()), true)
}

/// At most `max` bytes of an answer's body; the rest is never read (the
/// answer is dropped, and its connection with it).
async fn read_at_most(mut resp: reqwest::Response, max: usize) -> Vec<u8> {
    let mut out = Vec::new();
    while out.len() < max {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                let room = max - out.len();
                out.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    out
}

/// A 3xx: lazaret never follows it (a 301 would turn the POST into a
/// body-less GET that "succeeds"; a 307 would send the message to whatever
/// host `Location` names). A permanent failure of kind `http_<status>`,
/// which a `kinds` budget can turn into retries.
pub fn redirected(status: StatusCode, location: Option<&str>) -> Failure {
    let to = location.map_or_else(
        || "no Location".to_owned(),
        |l| quote_line(l, QUOTED_URL_BYTES_MAX),
    );
    Failure::new(
        ErrorKind::from(format!("http_{}", status.as_u16()).as_str()),
        format!("the handler redirected to {to}; point `deliver` at the final URL"),
    )
    .with_class(FailureClass::Permanent)
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
    classify_with(status, retry_after, body, &BTreeMap::new())
}

/// [`classify`], with the type's `kind_classes` overriding the status
/// table (a class in the body still wins).
pub fn classify_with(
    status: StatusCode,
    retry_after: Option<Duration>,
    body: &[u8],
    kind_classes: &BTreeMap<ErrorKind, FailureClass>,
) -> Failure {
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
    let mut body_class = None;
    if let Some(b) = parsed {
        let e = b.error;
        body_class = e.class.as_deref().and_then(|c| c.parse().ok());
        // A kind keys breakers and metrics: the name rule, else `http_<status>`.
        if let Some(k) = e.kind.as_deref().and_then(bounded_name) {
            failure.kind = ErrorKind::from(k);
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
    if let Some(c) = body_class.or_else(|| kind_classes.get(&failure.kind).copied()) {
        class = c;
    }
    if failure.retry_after.is_none() {
        failure.retry_after = retry;
    }
    // The message and traceback caps of every failure (4 KiB, 16 KiB).
    failure.truncate_to_caps();
    failure.class = Some(class);
    failure
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
    fn the_types_kind_classes_override_the_status_table_but_not_the_body() {
        let classes: BTreeMap<ErrorKind, FailureClass> = [
            (ErrorKind::from("http_404"), FailureClass::Transient),
            (ErrorKind::from("db_locked"), FailureClass::Deferred),
        ]
        .into();
        let f = classify_with(StatusCode::NOT_FOUND, None, b"", &classes);
        assert_eq!(f.class, Some(FailureClass::Transient));
        let f = classify_with(
            StatusCode::INTERNAL_SERVER_ERROR,
            None,
            br#"{"error": {"kind": "db_locked"}}"#,
            &classes,
        );
        assert_eq!(f.class, Some(FailureClass::Deferred));
        let f = classify_with(
            StatusCode::NOT_FOUND,
            None,
            br#"{"error": {"class": "permanent"}}"#,
            &classes,
        );
        assert_eq!(f.class, Some(FailureClass::Permanent), "the body wins");
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

    fn delivery(content_type: Option<&str>, headers: Value) -> Delivery {
        Delivery {
            message_id: "m\r\n1".into(),
            body: b"\xff\x00body".to_vec(),
            content_type: content_type.map(str::to_owned),
            headers: headers.as_object().cloned().unwrap_or_default(),
            broker_prior: 0,
            redelivered: false,
            queue: "q".into(),
            position: Value::Null,
        }
    }

    fn call(d: &Delivery) -> Call<'_> {
        Call {
            delivery: d,
            attempt: 1,
            source: "orders",
            idempotency_key: "orders:m\r\n1",
            traceparent: None,
        }
    }

    #[test]
    fn the_traceparent_goes_as_its_own_header() {
        let d = delivery(None, serde_json::json!({"traceparent": "not checked here"}));
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = Call {
            traceparent: Some(tp),
            ..call(&d)
        };
        let (h, _) = request_parts(&c, DeliverFormat::Raw).expect("sendable");
        assert_eq!(h["traceparent"], tp);
        let (h, _) = request_parts(&call(&d), DeliverFormat::Raw).expect("sendable");
        assert!(h.get("traceparent").is_none());
    }

    #[test]
    fn a_content_type_that_is_no_header_value_goes_as_octet_stream_and_is_kept() {
        let d = delivery(
            Some("text/plain\r\nX-Evil: 1\0"),
            serde_json::json!({"a": "b"}),
        );
        let (h, body) = request_parts(&call(&d), DeliverFormat::Raw).expect("sendable");
        assert_eq!(h["content-type"], "application/octet-stream");
        assert!(h.get("x-evil").is_none());
        let kept: Value = serde_json::from_slice(h["lazaret-headers"].as_bytes()).unwrap();
        assert_eq!(
            kept,
            serde_json::json!({"a": "b", "x-lazaret-content-type": "text/plain\r\nX-Evil: 1\0"})
        );
        assert_eq!(h["lazaret-message-id"], "m%0D%0A1");
        assert_eq!(body, d.body, "the body byte for byte");
        assert!(h.get(HEADERS_TRUNCATED).is_none());
    }

    #[test]
    fn a_source_name_that_is_no_header_value_is_a_bad_message_not_a_handler_failure() {
        let d = delivery(None, Value::Null);
        let c = Call {
            source: "bad\nname",
            ..call(&d)
        };
        let f = request_parts(&c, DeliverFormat::Raw).expect_err("unsendable");
        assert_eq!(f.kind.as_str(), "bad_message");
        assert_eq!(f.class, Some(FailureClass::Permanent));
        assert!(f.message.contains("source name"), "{}", f.message);
    }

    #[test]
    fn lazaret_headers_are_cut_at_6_kib_and_say_so() {
        let big = "x".repeat(120 * 1024);
        let d = delivery(
            Some("application/json"),
            serde_json::json!({"a": "small", "big": big, "z": "é"}),
        );
        let (h, _) = request_parts(&call(&d), DeliverFormat::Raw).expect("sendable");
        let line = h["lazaret-headers"].as_bytes();
        assert!(line.len() <= HEADERS_LINE_BYTES_MAX, "{}", line.len());
        let kept: Value = serde_json::from_slice(line).unwrap();
        assert_eq!(kept, serde_json::json!({"a": "small", "z": "é"}));
        assert_eq!(h[HEADERS_TRUNCATED], "true");
        // The envelope carries them whole, and the body as base64 when it is
        // not UTF-8.
        let (h, body) = request_parts(&call(&d), DeliverFormat::Envelope).expect("sendable");
        assert_eq!(h["content-type"], "application/json");
        let env: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            env["headers"]["big"].as_str().map(str::len),
            Some(120 * 1024)
        );
        assert_eq!(env["body_base64"], "/wBib2R5");
        assert_eq!(env["content_type"], "application/json");
        assert_eq!(env["message_id"], "m\r\n1");
        assert_eq!(env["attempt"], 1);
        assert!(env.get("body").is_none());
    }

    #[test]
    fn a_redirect_is_permanent_and_names_where_it_pointed() {
        let f = redirected(StatusCode::MOVED_PERMANENTLY, Some("https://h/orders/\r\n"));
        assert_eq!(f.kind.as_str(), "http_301");
        assert_eq!(f.class, Some(FailureClass::Permanent));
        assert_eq!(
            f.message,
            "the handler redirected to https://h/orders/\\r\\n; point `deliver` at the final URL"
        );
    }

    #[test]
    fn a_handlers_kind_follows_the_name_rule_and_its_traceback_is_cut() {
        let body = serde_json::json!({"error": {
            "kind": "k".repeat(100_000),
            "message": "m".repeat(100_000),
            "traceback": "t".repeat(100_000),
        }})
        .to_string();
        let f = classify(StatusCode::INTERNAL_SERVER_ERROR, None, body.as_bytes());
        assert_eq!(f.kind.as_str(), "http_500", "an over-long kind falls back");
        let tb = f.traceback.map_or(0, |t| t.len());
        assert!(tb <= lazaret_core::bound::TRACEBACK_BYTES_MAX + 64, "{tb}");
        assert!(f.message.len() <= lazaret_core::bound::MESSAGE_BYTES_MAX + 64);
        let f = classify(
            StatusCode::BAD_REQUEST,
            None,
            br#"{"error": {"kind": "bad\nkind"}}"#,
        );
        assert_eq!(
            f.kind.as_str(),
            "http_400",
            "a control character falls back"
        );
    }

    #[test]
    fn header_json_stays_ascii() {
        assert_eq!(ascii_json(r#"{"a":"é"}"#), r#"{"a":"\u00e9"}"#);
    }
}
