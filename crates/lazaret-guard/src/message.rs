//! A broker message as every adapter hands it over, and a republished one
//! as every adapter sends it: the one shape the gates see, whatever the
//! broker.

use base64::Engine;
use lazaret_core::{DeadLetterReason, Failure, Timestamp};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// The header lazaret writes when it republishes a message: the attempts
/// already charged (`0` after a redrive).
pub const ATTEMPT_HEADER: &str = "x-lazaret-attempt";
/// The header carrying a republished message's original id, which wins
/// over whatever id the broker would give it.
pub const MESSAGE_ID_HEADER: &str = "x-lazaret-message-id";

/// Headers a broker writes itself, dropped when lazaret republishes a
/// message (the contract's list; matched case-insensitively, `*` a prefix).
pub const BROKER_OWN_HEADERS: [&str; 7] = [
    "x-death",
    "x-first-death-*",
    "x-last-death-*",
    "x-delivery-count",
    "kafka_dlt-*",
    "nats-*",
    "x-lazaret-*",
];

/// One message taken from a broker, before the gates.
#[derive(Clone, Debug, PartialEq)]
pub struct Delivery {
    /// The id the contract's table derives for this broker (an adapter
    /// sets its own; [`Delivery::resolve_id`] lets `x-lazaret-message-id`
    /// win).
    pub message_id: String,
    /// The body, byte for byte.
    pub body: Vec<u8>,
    /// The message's content type, when it has one.
    pub content_type: Option<String>,
    /// The broker message's own headers as JSON ([`bytes_value`]).
    pub headers: Map<String, Value>,
    /// The broker's count of earlier deliveries that lazaret did not cause
    /// (RabbitMQ quorum `x-delivery-count`; JetStream deliveries − 1; Redis
    /// delivery count − 1).
    pub broker_prior: u32,
    /// Whether the broker may have delivered it before (to lazaret, which
    /// may have crashed between its write and the acknowledgement).
    pub redelivered: bool,
    /// The queue, stream or topic it was consumed from.
    pub queue: String,
    /// The broker's coordinates (`{"stream_seq": 42, "subject": …}`,
    /// `{"entry_id": …}`, `{"exchange": …, "routing_key": …}`).
    pub position: Value,
}

impl Delivery {
    /// Applies the contract's rule that a republished message's
    /// `x-lazaret-message-id` wins over the broker's id.
    pub fn resolve_id(&mut self) {
        if let Some(id) = self.headers.get(MESSAGE_ID_HEADER).and_then(header_text) {
            if !id.is_empty() {
                self.message_id = id;
            }
        }
    }

    /// The message's `traceparent` header (SQS: inside the `lazaret`
    /// attribute, or an attribute of its own), validated: an invalid one
    /// is dropped (`crate::trace::from_header`).
    pub fn traceparent(&self, source: &str) -> Option<lazaret_core::TraceParent> {
        crate::trace::from_header(self.header(crate::trace::TRACEPARENT).as_deref(), source)
    }

    /// The raw `x-lazaret-attempt` header, for `lazaret_core::attempts_spent`.
    pub fn attempt_header(&self) -> Option<Vec<u8>> {
        self.headers
            .get(ATTEMPT_HEADER)
            .and_then(header_text)
            .map(String::into_bytes)
    }

    /// A header's value as text (strings, numbers and `{"base64"}` that
    /// decode to UTF-8), case-insensitively by name.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| header_text(v))
    }
}

/// A message to publish (a redrive): the adapter maps it onto its broker.
#[derive(Clone, Debug, PartialEq)]
pub struct Republish {
    /// Queue, stream subject or Redis stream to publish to.
    pub queue: String,
    /// The body, byte for byte.
    pub body: Vec<u8>,
    /// Content type, when known.
    pub content_type: Option<String>,
    /// Headers to send: the original ones minus the broker's own, plus
    /// `x-lazaret-message-id` and `x-lazaret-attempt`.
    pub headers: Map<String, Value>,
    /// The message's id (kept across the republish).
    pub message_id: String,
    /// A fresh deduplication id, for brokers that drop a repeated one
    /// (JetStream `Nats-Msg-Id`).
    pub dedup_id: String,
    /// Where the message was (its dead letter's `position`), for brokers
    /// that need more than `queue` to publish (a JetStream subject).
    pub position: Value,
}

/// A broker header value as JSON: text as a string, numbers and booleans as
/// themselves, bytes that are not UTF-8 as `{"base64": …}`.
pub fn bytes_value(bytes: &[u8]) -> Value {
    match std::str::from_utf8(bytes) {
        Ok(s) => Value::String(s.to_owned()),
        Err(_) => {
            let mut m = Map::new();
            m.insert(
                "base64".into(),
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes)),
            );
            Value::Object(m)
        }
    }
}

/// The bytes a header value stands for (`{"base64"}` decoded; other JSON
/// as its text).
pub fn value_bytes(v: &Value) -> Vec<u8> {
    match v {
        Value::String(s) => s.clone().into_bytes(),
        Value::Object(m) if m.len() == 1 => match m.get("base64").and_then(Value::as_str) {
            Some(b) => base64::engine::general_purpose::STANDARD
                .decode(b)
                .unwrap_or_default(),
            None => v.to_string().into_bytes(),
        },
        other => other.to_string().into_bytes(),
    }
}

/// A header value as text, when it is a string, a number, or base64 of
/// UTF-8.
pub fn header_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Object(_) => String::from_utf8(value_bytes(v)).ok(),
        _ => None,
    }
}

/// Whether a header is the broker's own (dropped on republish).
pub fn is_broker_own(name: &str) -> bool {
    let name = name.to_ascii_lowercase();
    BROKER_OWN_HEADERS
        .iter()
        .any(|p| match p.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == *p,
        })
}

/// The headers a republish carries: the original ones minus the broker's
/// own, then `x-lazaret-message-id` and `x-lazaret-attempt: 0`.
pub fn republish_headers(original: &Map<String, Value>, message_id: &str) -> Map<String, Value> {
    let mut h: Map<String, Value> = original
        .iter()
        .filter(|(k, _)| !is_broker_own(k))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    h.insert(MESSAGE_ID_HEADER.into(), Value::String(message_id.into()));
    h.insert(ATTEMPT_HEADER.into(), Value::String("0".into()));
    h
}

/// Puts the validated `traceparent` a republished message goes with in
/// place of whatever the original headers held under that name (an
/// invalid one is not passed on); none removes it.
pub fn set_traceparent(headers: &mut Map<String, Value>, traceparent: Option<String>) {
    headers.retain(|k, _| !k.eq_ignore_ascii_case(crate::trace::TRACEPARENT));
    if let Some(tp) = traceparent {
        headers.insert(crate::trace::TRACEPARENT.into(), Value::String(tp));
    }
}

/// The id of a message that names none: a hash of its body and of its
/// headers other than `x-` ones (RabbitMQ's last resort), so the same
/// message redelivered gets the same id.
pub fn content_id(body: &[u8], headers: &Map<String, Value>) -> String {
    let mut h = Sha256::new();
    h.update(body);
    let mut names: Vec<&String> = headers
        .keys()
        .filter(|k| !k.to_ascii_lowercase().starts_with("x-"))
        .collect();
    names.sort();
    for k in names {
        h.update([0]);
        h.update(k.as_bytes());
        h.update([0]);
        h.update(headers[k].to_string().as_bytes());
    }
    format!("sha256:{}", &hex::encode(h.finalize())[..32])
}

/// What a broker's dead-letter message says of itself; the adapter reads
/// it (`Broker::interpret`), the watch runtime files it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TakenIn {
    /// The broker's reason (`None`: the message carries no death
    /// information, `unknown_origin`).
    pub reason: Option<DeadLetterReason>,
    /// The error text the broker or framework carried.
    pub error: Option<Failure>,
    /// The queue the broker dead-lettered it from.
    pub original_queue: Option<String>,
    /// Its coordinates there.
    pub original_position: Option<Value>,
    /// How often the broker delivered or dead-lettered it.
    pub attempts: u32,
    /// When the broker first dead-lettered it.
    pub first_at: Option<Timestamp>,
    /// The message itself, when the dead-letter message only points at it
    /// (a JetStream advisory): body, headers, content type, id.
    pub original: Option<Delivery>,
}

/// An empty header map (for adapters that build a [`TakenIn`]).
pub fn no_headers() -> Map<String, Value> {
    Map::new()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_republished_id_wins_over_the_brokers() {
        let mut d = Delivery {
            message_id: "broker-7".into(),
            body: vec![],
            content_type: None,
            headers: json!({"x-lazaret-message-id": "orig-1"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            broker_prior: 0,
            redelivered: false,
            queue: "q".into(),
            position: Value::Null,
        };
        d.resolve_id();
        assert_eq!(d.message_id, "orig-1");
    }

    #[test]
    fn bytes_that_are_not_utf8_travel_as_base64() {
        let v = bytes_value(&[0xff, 0x00]);
        assert_eq!(v, json!({"base64": "/wA="}));
        assert_eq!(value_bytes(&v), vec![0xff, 0x00]);
        assert_eq!(header_text(&json!(3)), Some("3".into()));
    }

    #[test]
    fn a_republish_drops_the_brokers_own_headers() {
        let orig = json!({
            "x-death": [], "x-first-death-queue": "q", "x-delivery-count": 3,
            "kafka_dlt-original-topic": "t", "Nats-Msg-Id": "n", "x-lazaret-attempt": "4",
            "task": "tasks.add", "id": "abc"
        });
        let h = republish_headers(orig.as_object().unwrap_or(&Map::new()), "abc");
        assert_eq!(
            Value::Object(h),
            json!({"task": "tasks.add", "id": "abc", "x-lazaret-message-id": "abc", "x-lazaret-attempt": "0"})
        );
    }

    #[test]
    fn the_content_id_ignores_x_headers_and_header_order() {
        let a = json!({"a": 1, "b": "x", "x-death": [1]});
        let b = json!({"b": "x", "a": 1});
        let empty = Map::new();
        assert_eq!(
            content_id(b"body", a.as_object().unwrap_or(&empty)),
            content_id(b"body", b.as_object().unwrap_or(&empty))
        );
        assert_ne!(content_id(b"body", &empty), content_id(b"other", &empty));
    }
}
