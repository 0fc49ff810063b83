//! Every broker header parser of the guard, one target: the first byte
//! picks the parser (`R`, `K`, `C`, `S`, `J`, `D`; any other byte by its
//! value), the rest is the message as JSON (byte values in lazaret's
//! convention: a string, or `{"base64": …}`).
//!
//! - `R` RabbitMQ: the headers object, with `x-death` and
//!   `x-first-death-*` (`rabbitmq::dead_lettered`), also after the AMQP
//!   table round trip the adapter makes (`json_to_table`, `table_to_json`).
//! - `K` Kafka, Spring's dead-letter topics: `{"topic", "partition",
//!   "offset", "timestamp", "key", "value", "headers": [[name, value]]}`
//!   with `kafka_dlt-*` headers (`record_delivery`, `interpret`).
//! - `C` Celery protocol 2: `{"headers", "content_type", "body"}`
//!   (`Task::recognise`, `arguments`).
//! - `S` SQS: `{"queue_url", "message_id", "body", "attributes",
//!   "message_attributes": {name: {"string"} | {"binary"}}, "source_queue",
//!   "redrive_policy"}` (`message_delivery`, `interpret`,
//!   `max_receive_count`).
//! - `J` NATS JetStream: `{"stream", "subject", "reply", "payload",
//!   "headers"}`: the `$JS.ACK.…` reply subject's metadata as a pull reads
//!   it, then the watch's advisory and copied-message parsers.
//! - `D` Redis Streams: `{"headers"}`, a dead entry's fields
//!   (`redis::interpret`).
//!
//! Properties beyond no panic: what the parsers promise (headers without
//! `x-death` give nothing; Spring's headers never reach the original;
//! a recognised Celery task has a name and an id; an SQS dead letter is
//! `max_receives` with at least the receives it had; a JetStream delivery
//! has its stream and sequence; a Kafka key survives its header).
#![no_main]

use std::collections::HashMap;
use std::sync::OnceLock;

use async_nats::jetstream;
use lazaret_core::DeadLetterReason;
use lazaret_guard::message::{value_bytes, TakenIn};
use lazaret_guard::sqs::sdk::types::{Message, MessageAttributeValue, MessageSystemAttributeName};
use lazaret_guard::{celery, kafka, nats, rabbitmq, redis, sqs, Delivery};
use libfuzzer_sys::fuzz_target;
use serde_json::{json, Map, Value};

fuzz_target!(|data: &[u8]| {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let Ok(v) = serde_json::from_slice::<Value>(rest) else {
        return;
    };
    match which {
        b'R' => rabbit(&v),
        b'K' => spring(&v),
        b'C' => celery_task(&v),
        b'S' => sqs_message(&v),
        b'J' => jetstream_message(&v),
        b'D' => redis_entry(&v),
        other => match other % 6 {
            0 => rabbit(&v),
            1 => spring(&v),
            2 => celery_task(&v),
            3 => sqs_message(&v),
            4 => jetstream_message(&v),
            _ => redis_entry(&v),
        },
    }
});

fn object(v: &Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

fn text(v: &Value, key: &str) -> Option<String> {
    v.get(key).and_then(Value::as_str).map(str::to_owned)
}

/// A delivery carrying `headers` and `body`, as the watch gets it.
fn delivery(headers: Map<String, Value>, body: Vec<u8>) -> Delivery {
    Delivery {
        message_id: "m-1".into(),
        body,
        content_type: None,
        headers,
        broker_prior: 0,
        redelivered: false,
        queue: "dead".into(),
        position: Value::Null,
    }
}

/// What holds for every broker's reading of a dead letter.
fn check(t: &TakenIn) {
    if let Some(e) = &t.error {
        assert!(
            !e.kind.to_string().is_empty(),
            "a failure without a kind: {t:?}"
        );
    }
}

fn has(h: &Map<String, Value>, name: &str) -> bool {
    h.keys().any(|k| k.eq_ignore_ascii_case(name))
}

fn rabbit(v: &Value) {
    let h = object(v);
    let t = rabbitmq::dead_lettered(&h);
    check(&t);
    if !has(&h, "x-death") && !has(&h, "x-first-death-queue") && !has(&h, "x-first-death-reason") {
        assert_eq!(
            t,
            TakenIn::default(),
            "no death headers, yet {t:?} from {h:?}"
        );
    }
    if let Some(Value::Array(deaths)) = h
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("x-death"))
        .map(|(_, v)| v)
    {
        if deaths.iter().any(Value::is_object) {
            assert!(
                t.reason.is_some() && t.error.is_some(),
                "x-death read as nothing: {h:?}"
            );
        }
    }
    // As the adapter carries it: JSON to an AMQP table and back.
    let table = rabbitmq::json_to_table(&h);
    let back = rabbitmq::table_to_json(&table);
    check(&rabbitmq::dead_lettered(&back));
}

fn spring(v: &Value) {
    let headers: Vec<kafka::RecordHeader> = v
        .get("headers")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|pair| {
            let name = pair.get(0)?.as_str()?.to_owned();
            let value = pair.get(1).filter(|v| !v.is_null()).map(value_bytes);
            Some((name, value))
        })
        .collect();
    let key = v.get("key").filter(|k| !k.is_null()).map(value_bytes);
    let value = v.get("value").filter(|k| !k.is_null()).map(value_bytes);
    let topic = text(v, "topic").unwrap_or_else(|| "orders.DLT".into());
    let record = kafka::Record {
        topic: &topic,
        partition: v.get("partition").and_then(Value::as_i64).unwrap_or(0) as i32,
        offset: v.get("offset").and_then(Value::as_i64).unwrap_or(0),
        timestamp: v.get("timestamp").and_then(Value::as_i64),
        key: key.as_deref(),
        headers: &headers,
        value: value.as_deref(),
    };
    let d = kafka::record_delivery(&record);
    if let Some(k) = &key {
        let carried = d.header(kafka::KEY_HEADER).expect("the key's header");
        assert_eq!(
            &kafka::decode_key(&carried),
            k,
            "the key does not survive its header"
        );
    }
    let t = kafka::interpret(&d);
    check(&t);
    let original = t
        .original
        .as_ref()
        .expect("Spring's reading keeps the original");
    assert!(
        !original
            .headers
            .keys()
            .any(|k| k.to_ascii_lowercase().starts_with("kafka_dlt-")),
        "Spring's headers reached the original: {:?}",
        original.headers
    );
    assert_eq!(t.reason.is_some(), t.error.is_some(), "{t:?}");
    if t.original_position.is_some() {
        assert!(
            t.original_queue.is_some(),
            "a position without its topic: {t:?}"
        );
    }
}

fn celery_task(v: &Value) {
    let h = object(v.get("headers").unwrap_or(&Value::Null));
    if let Some(task) = celery::Task::recognise(&h) {
        assert!(!task.name.is_empty() && !task.id.is_empty(), "{task:?}");
    }
    let body = v.get("body").map(value_bytes).unwrap_or_default();
    let content_type = text(v, "content_type");
    let args = celery::arguments(&h, content_type.as_deref(), &body);
    let o = args.as_object().expect("the arguments are an object");
    assert!(
        (o.contains_key("args") && o.contains_key("kwargs"))
            || (o.contains_key("argsrepr") && o.contains_key("kwargsrepr")),
        "{args}"
    );
}

fn sqs_message(v: &Value) {
    let mut m = Message::builder();
    if let Some(id) = text(v, "message_id") {
        m = m.message_id(id);
    }
    if let Some(body) = text(v, "body") {
        m = m.body(body);
    }
    let attributes: HashMap<MessageSystemAttributeName, String> =
        object(v.get("attributes").unwrap_or(&Value::Null))
            .into_iter()
            .filter_map(|(k, v)| {
                Some((
                    MessageSystemAttributeName::from(k.as_str()),
                    v.as_str()?.to_owned(),
                ))
            })
            .collect();
    let receives = attributes
        .get(&MessageSystemAttributeName::ApproximateReceiveCount)
        .and_then(|c| c.parse::<u32>().ok());
    m = m.set_attributes(Some(attributes));
    for (name, a) in object(v.get("message_attributes").unwrap_or(&Value::Null)) {
        let mut b = MessageAttributeValue::builder();
        if let Some(s) = a.get("string").and_then(Value::as_str) {
            b = b.data_type("String").string_value(s);
        } else if let Some(bytes) = a.get("binary") {
            b = b
                .data_type("Binary")
                .binary_value(value_bytes(bytes).into());
        } else {
            b = b.data_type("String");
        }
        if let Ok(attr) = b.build() {
            m = m.message_attributes(name, attr);
        }
    }
    let queue_url = text(v, "queue_url").unwrap_or_else(|| "http://127.0.0.1:4566/q".into());
    let d = sqs::message_delivery(&queue_url, &m.build());
    if let Some(n) = receives {
        assert_eq!(
            d.broker_prior,
            n.saturating_sub(1),
            "ApproximateReceiveCount {n}"
        );
    }
    let max = text(v, "redrive_policy").and_then(|p| sqs::max_receive_count(&p));
    let source = text(v, "source_queue");
    let t = sqs::interpret(&d, source.as_deref(), max);
    check(&t);
    assert_eq!(t.reason, Some(DeadLetterReason::MaxReceives));
    assert!(
        t.attempts >= d.broker_prior && t.attempts >= max.unwrap_or(0),
        "{t:?}"
    );
    assert_eq!(t.original_queue, source);
}

/// A JetStream context for messages that are never acknowledged: the
/// client never reaches a server (port 1 on loopback, nothing listens, and
/// the runtime that would retry is never driven again).
fn context() -> &'static jetstream::Context {
    static CTX: OnceLock<(tokio::runtime::Runtime, jetstream::Context)> = OnceLock::new();
    &CTX.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        let client = rt
            .block_on(
                async_nats::ConnectOptions::new()
                    .retry_on_initial_connect()
                    .connect("nats://127.0.0.1:1"),
            )
            .expect("a client that connects later");
        // The context spawns its acker task: on this runtime, never driven.
        let ctx = {
            let _in = rt.enter();
            jetstream::new(client)
        };
        (rt, ctx)
    })
    .1
}

fn jetstream_message(v: &Value) {
    let stream = text(v, "stream").unwrap_or_else(|| "ORDERS".into());
    let payload = v.get("payload").map(value_bytes).unwrap_or_default();
    let mut headers = async_nats::HeaderMap::new();
    for (name, value) in object(v.get("headers").unwrap_or(&Value::Null)) {
        let Ok(n) = name.parse::<async_nats::HeaderName>() else {
            continue;
        };
        let values = match value {
            Value::Array(a) => a,
            one => vec![one],
        };
        for value in values {
            if let Some(Ok(hv)) = value.as_str().map(str::parse::<async_nats::HeaderValue>) {
                headers.append(n.clone(), hv);
            }
        }
    }
    let reply = text(v, "reply");
    let message = async_nats::Message {
        subject: text(v, "subject")
            .unwrap_or_else(|| "orders.new".into())
            .into(),
        reply: reply.clone().map(Into::into),
        payload: payload.clone().into(),
        headers: Some(headers),
        status: None,
        description: None,
        length: 0,
    };
    let m = jetstream::Message {
        message,
        context: context().clone(),
    };
    match nats::fuzz_pulled(&stream, m) {
        Ok(d) => {
            let reply = reply.expect("a pulled message has a reply subject");
            assert!(reply.starts_with("$JS.ACK."), "{reply}");
            assert_eq!(d.queue, stream);
            assert_eq!(d.body, payload);
            assert!(d.position["stream_seq"].is_u64(), "{}", d.position);
            assert!(!d.message_id.is_empty());
            assert_eq!(d.redelivered, d.broker_prior > 0);
            check(&nats::fuzz_interpret(&d));
        }
        Err(why) => assert!(!why.is_empty()),
    }
    // An advisory (or a copied message) in a dead-message stream.
    let d = delivery(object(v.get("headers").unwrap_or(&Value::Null)), payload);
    check(&nats::fuzz_interpret(&d));
}

fn redis_entry(v: &Value) {
    let mut d = delivery(object(v.get("headers").unwrap_or(&json!({}))), Vec::new());
    d.position = v.get("position").cloned().unwrap_or(Value::Null);
    let t = redis::interpret(&d);
    check(&t);
    let original = t
        .original
        .as_ref()
        .expect("a dead entry keeps its original");
    for field in [
        "reason",
        "error",
        "original_stream",
        "original_id",
        "delivery_count",
        "failed_at",
    ] {
        assert!(
            !has(&original.headers, field),
            "{field} reached the original: {t:?}"
        );
    }
}
