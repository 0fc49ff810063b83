//! NATS JetStream: the [`TestBroker`] the shared scenarios run on, and the
//! adapter's own tests against a real server (`LAZARET_TEST_NATS_URL`, e.g.
//! `nats://127.0.0.1:4222`, with JetStream on).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use futures_util::StreamExt;
use lazaret_core::{DeadLetterReason, Failure, FailureClass};
use lazaret_guard::{Broker, BrokerKind, Faults, Mode, Outcome, SourceSet, SourceSpec, handler_fn};
use lazaret_store::{Stage, Store};
use serde_json::{Map, Value, json};

use crate::common::{self, Log, TestBroker};

/// The job type every source of these tests files under (the scenarios'
/// policies are for it).
const TYPE: &str = "orders";

/// A JetStream server, with the streams the tests made and the messages
/// they published themselves (so [`TestBroker::take_one`] finds only the
/// ones published by something else: a redrive).
pub struct Nats {
    url: String,
    js: jetstream::Context,
    known: Mutex<HashMap<String, HashSet<u64>>>,
}

impl Nats {
    /// Connects, or `None` (the test is skipped) without
    /// `LAZARET_TEST_NATS_URL`.
    pub async fn connect() -> Option<Nats> {
        let url = common::service("LAZARET_TEST_NATS_URL")?;
        let client = async_nats::connect(url.as_str())
            .await
            .expect("connect to LAZARET_TEST_NATS_URL");
        Some(Nats {
            url,
            js: jetstream::new(client),
            known: Mutex::default(),
        })
    }

    fn remember(&self, stream: &str, seq: u64) {
        self.known
            .lock()
            .unwrap()
            .entry(stream.to_owned())
            .or_default()
            .insert(seq);
    }

    /// A stream named after `prefix` capturing `subjects`.
    async fn stream(&self, prefix: &str, subjects: Vec<String>) -> String {
        let name = stream_name(prefix);
        let subjects = if subjects.is_empty() {
            vec![name.clone()]
        } else {
            subjects
        };
        self.js
            .create_stream(stream::Config {
                name: name.clone(),
                subjects,
                ..Default::default()
            })
            .await
            .expect("create a stream");
        name
    }

    /// Publishes to `subject` and waits for the PubAck; returns (stream,
    /// sequence).
    async fn publish(&self, subject: &str, headers: HeaderMap, body: &[u8]) -> (String, u64) {
        let ack = self
            .js
            .publish_with_headers(subject.to_owned(), headers, body.to_vec().into())
            .await
            .expect("publish")
            .await
            .expect("the PubAck");
        self.remember(&ack.stream, ack.sequence);
        (ack.stream, ack.sequence)
    }
}

/// A unique stream name: no '.', nothing but `[A-Za-z0-9_-]`.
fn stream_name(prefix: &str) -> String {
    common::unique(prefix)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// JSON headers as NATS headers, for the test's producer.
fn nats_headers(h: &Map<String, Value>) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (k, v) in h {
        let values = match v {
            Value::Array(a) => a.clone(),
            v => vec![v.clone()],
        };
        for v in values {
            let text = v.as_str().map_or_else(|| v.to_string(), str::to_owned);
            out.append(k.as_str(), text.as_str());
        }
    }
    out
}

/// NATS headers as JSON, as the adapter maps them.
fn headers_json(h: &HeaderMap) -> Map<String, Value> {
    h.iter()
        .map(|(k, vs)| {
            let k: &str = k.as_ref();
            let v = match vs.as_slice() {
                [one] => Value::String(one.as_str().to_owned()),
                many => Value::Array(
                    many.iter()
                        .map(|v| Value::String(v.as_str().to_owned()))
                        .collect(),
                ),
            };
            (k.to_owned(), v)
        })
        .collect()
}

impl TestBroker for Nats {
    async fn fresh_queue(&self, prefix: &str) -> String {
        self.stream(prefix, Vec::new()).await
    }

    fn spec(&self, name: &str, queue: &str, mode: Mode) -> SourceSpec {
        let mut spec = match mode {
            Mode::Guard => SourceSpec::guard(name, BrokerKind::Nats, &self.url, queue, TYPE),
            Mode::Watch => SourceSpec::watch(name, BrokerKind::Nats, &self.url, queue, TYPE),
        };
        spec.delivery_timeout = Duration::from_secs(5);
        spec
    }

    async fn produce(
        &self,
        queue: &str,
        message_id: &str,
        body: &[u8],
        headers: Map<String, Value>,
    ) {
        let mut h = nats_headers(&headers);
        h.insert("Nats-Msg-Id", message_id);
        // The fresh queues capture one subject of their own name.
        self.publish(queue, h, body).await;
    }

    async fn broker_dead_letter(
        &self,
        prefix: &str,
        message_id: &str,
        body: &[u8],
    ) -> (String, String) {
        let original = self.stream(&format!("{prefix}-orig"), Vec::new()).await;
        let dead = self
            .stream(
                &format!("{prefix}-dlq"),
                vec![format!(
                    "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{original}.*"
                )],
            )
            .await;
        let consumer = self
            .js
            .get_stream(&original)
            .await
            .expect("the original stream")
            .create_consumer(pull::Config {
                durable_name: Some("workers".into()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_millis(500),
                max_deliver: 1,
                ..Default::default()
            })
            .await
            .expect("a consumer with MaxDeliver 1");
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", message_id);
        h.insert("x-origin", "test");
        self.publish(&original, h, body).await;
        // Take it without acknowledging, then keep asking: JetStream gives up
        // on it after the ack wait and publishes the advisory.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let mut batch = consumer
                .fetch()
                .max_messages(1)
                .expires(Duration::from_millis(300))
                .messages()
                .await
                .expect("fetch");
            while let Some(m) = batch.next().await {
                m.expect("a message");
            }
            let info = self
                .js
                .get_stream(&dead)
                .await
                .expect("the dead-letter stream")
                .get_info()
                .await
                .expect("its info");
            if info.state.messages > 0 {
                return (dead, original);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no MAX_DELIVERIES advisory in {dead} within 20 s"
            );
        }
    }

    fn broker_reason(&self) -> DeadLetterReason {
        DeadLetterReason::MaxDeliveries
    }

    async fn take_one(&self, queue: &str, wait: Duration) -> Option<(Vec<u8>, Map<String, Value>)> {
        // A stream keeps what was consumed: the message taken is the first
        // one the tests did not publish (or take) themselves.
        let stream = self.js.get_stream(queue).await.expect("the stream");
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let state = stream.get_info().await.expect("stream info").state;
            let known = self
                .known
                .lock()
                .unwrap()
                .get(queue)
                .cloned()
                .unwrap_or_default();
            for seq in state.first_sequence.max(1)..=state.last_sequence {
                if known.contains(&seq) {
                    continue;
                }
                if let Ok(m) = stream.get_raw_message(seq).await {
                    self.remember(queue, seq);
                    return Some((m.payload.to_vec(), headers_json(&m.headers)));
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// What a handler saw of one delivery, headers included.
#[derive(Clone, Debug)]
struct Call {
    message_id: String,
    attempt: u32,
    headers: Map<String, Value>,
    content_type: Option<String>,
    position: Value,
}

fn capturing(calls: &Arc<Mutex<Vec<Call>>>) -> Arc<dyn lazaret_guard::Handler> {
    let calls = Arc::clone(calls);
    Arc::new(handler_fn(move |call| {
        calls.lock().unwrap().push(Call {
            message_id: call.delivery.message_id.clone(),
            attempt: call.attempt,
            headers: call.delivery.headers.clone(),
            content_type: call.delivery.content_type.clone(),
            position: call.delivery.position.clone(),
        });
        async { Outcome::Success }
    }))
}

async fn wait_calls(calls: &Arc<Mutex<Vec<Call>>>, n: usize) -> Vec<Call> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let seen = calls.lock().unwrap().clone();
        if seen.len() >= n || tokio::time::Instant::now() >= deadline {
            assert_eq!(seen.len(), n, "calls: {seen:#?}");
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_guard_delivers_with_the_ids_headers_and_attempt_of_the_table() {
    let Some(b) = Nats::connect().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let queue = b.fresh_queue("nats-deliver").await;
    b.produce(
        &queue,
        "order-1",
        b"{\"n\":1}",
        common::headers(
            json!({"x-tenant": "acme", "tags": ["a", "b"], "Content-Type": "application/json"}),
        ),
    )
    .await;
    // No Nats-Msg-Id: the id is stream and sequence.
    let (_, seq) = b.publish(&queue, HeaderMap::new(), b"plain").await;
    let calls = Arc::new(Mutex::new(Vec::new()));
    let running = common::start_guard(
        &b,
        b.spec("nats-deliver", &queue, Mode::Guard),
        common::host(
            dir.path(),
            common::policies(TYPE, 3, Duration::from_millis(50)),
        ),
        capturing(&calls),
        Faults::default(),
    )
    .await;
    let seen = wait_calls(&calls, 2).await;
    running.stop().await.expect("a clean stop");

    assert_eq!(seen[0].message_id, "order-1");
    assert_eq!(seen[0].attempt, 1);
    assert_eq!(seen[0].headers.get("x-tenant"), Some(&json!("acme")));
    assert_eq!(seen[0].headers.get("tags"), Some(&json!(["a", "b"])));
    assert_eq!(seen[0].headers.get("Nats-Msg-Id"), Some(&json!("order-1")));
    assert_eq!(seen[0].content_type.as_deref(), Some("application/json"));
    assert_eq!(seen[0].position, json!({"stream_seq": 1, "subject": queue}));
    assert_eq!(seen[1].message_id, format!("{queue}:{seq}"));
    assert_eq!(seen[1].attempt, 1);
    assert_eq!(seen[1].content_type, None);

    // Both acknowledged: nothing pending on the durable consumer.
    let info =
        b.js.get_stream(&queue)
            .await
            .expect("the stream")
            .consumer_info("lazaret")
            .await
            .expect("the durable consumer lazaret created");
    assert_eq!((info.num_ack_pending, info.num_pending), (0, 0));
    assert_eq!(info.config.max_deliver, -1);
    assert_eq!(info.config.ack_wait, Duration::from_secs(10));
}

#[tokio::test]
async fn a_message_nakked_once_by_another_consumer_arrives_with_attempt_2() {
    let Some(b) = Nats::connect().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let queue = b.fresh_queue("nats-nak").await;
    b.produce(&queue, "m-nak", b"x", Map::new()).await;
    // The team's own worker on the same durable consumer took it and gave it
    // back (or died holding it).
    let consumer =
        b.js.get_stream(&queue)
            .await
            .expect("the stream")
            .create_consumer(pull::Config {
                durable_name: Some("lazaret".into()),
                ack_wait: Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .expect("a durable consumer");
    let mut batch = consumer
        .fetch()
        .max_messages(1)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .expect("fetch");
    let m = batch.next().await.expect("one message").expect("a message");
    m.ack_with(AckKind::Nak(None)).await.expect("nak");
    drop(batch);

    let log = Log::default();
    let running = common::start_guard(
        &b,
        b.spec("nats-nak", &queue, Mode::Guard),
        common::host(
            dir.path(),
            common::policies(TYPE, 5, Duration::from_millis(50)),
        ),
        common::recording(&log, |_| Outcome::Success),
        Faults::default(),
    )
    .await;
    let seen = log
        .wait_for(Duration::from_secs(20), |s| !s.is_empty())
        .await;
    running.stop().await.expect("a clean stop");
    assert_eq!(seen[0].message_id, "m-nak");
    assert_eq!(
        seen[0].attempt, 2,
        "the broker's earlier delivery is charged"
    );
}

#[tokio::test]
async fn a_permanent_failure_is_one_dead_letter_with_its_source_and_a_redrive_sends_it_back() {
    let Some(b) = Nats::connect().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let queue = b.fresh_queue("nats-perm").await;
    b.produce(
        &queue,
        "bad-1",
        b"{\"bad\":true}",
        common::headers(json!({"x-tenant": "acme"})),
    )
    .await;
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(50)),
    );
    let log = Log::default();
    let spec = b.spec("nats-perm", &queue, Mode::Guard);
    let running = common::start_guard(
        &b,
        spec.clone(),
        Arc::clone(&host),
        common::recording(&log, |_| {
            Outcome::Failure(Failure::new("bad_input", "no").with_class(FailureClass::Permanent))
        }),
        Faults::default(),
    )
    .await;
    let store = lazaret_guard::Host::store(&*host);
    let dls = common::wait_dead_letters(store, "nats-perm", 1, Duration::from_secs(20)).await;
    running.stop().await.expect("a clean stop");
    assert_eq!(log.all().len(), 1, "a permanent failure is not retried");
    let dl = &dls[0];
    assert_eq!(dl.reason, DeadLetterReason::Permanent);
    assert_eq!(dl.stage, Stage::Processing);
    let src = dl.source.as_ref().expect("a source");
    assert_eq!(src.broker, "nats");
    assert_eq!(src.queue, queue);
    assert_eq!(src.message_id, "bad-1");
    assert_eq!(src.position["stream_seq"], json!(1));
    assert_eq!(src.position["subject"], json!(queue));
    let info =
        b.js.get_stream(&queue)
            .await
            .expect("the stream")
            .consumer_info("lazaret")
            .await
            .expect("the consumer");
    assert_eq!(info.num_ack_pending, 0, "acknowledged after the quarantine");

    // Redrive: back to the stream's subject, with lazaret's headers, none of
    // JetStream's own and a fresh Nats-Msg-Id (twice: the duplicate window
    // must not drop the second).
    let broker: Arc<dyn Broker> = lazaret_guard::connect(&spec).await.expect("connect").into();
    let mut set = SourceSet::default();
    set.insert(spec, broker);
    for round in 0..2 {
        let id = set
            .redrive(dl, b"{\"bad\":false}".to_vec())
            .await
            .expect("the redrive is confirmed");
        assert_eq!(id, "bad-1");
        let (body, headers) = b
            .take_one(&queue, Duration::from_secs(5))
            .await
            .unwrap_or_else(|| panic!("redrive {round} published nothing"));
        assert_eq!(body, b"{\"bad\":false}");
        assert_eq!(headers.get("x-lazaret-attempt"), Some(&json!("0")));
        assert_eq!(headers.get("x-lazaret-message-id"), Some(&json!("bad-1")));
        assert_eq!(headers.get("x-tenant"), Some(&json!("acme")));
        let msg_id = headers
            .get("Nats-Msg-Id")
            .and_then(Value::as_str)
            .expect("a Nats-Msg-Id");
        assert_ne!(msg_id, "bad-1", "a fresh deduplication id");
        let nats_headers: Vec<&String> = headers
            .keys()
            .filter(|k| k.to_ascii_lowercase().starts_with("nats-"))
            .collect();
        assert_eq!(nats_headers, vec!["Nats-Msg-Id"]);
    }
}

#[tokio::test]
async fn a_watch_turns_a_max_deliveries_advisory_into_the_original_message() {
    let Some(b) = Nats::connect().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let (dlq, original) = b
        .broker_dead_letter("nats-watch", "lost-1", b"payload-1")
        .await;
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(50)),
    );
    let mut spec = b.spec("nats-watch", &dlq, Mode::Watch);
    // The original queue comes from the message: allowed as the server
    // allows its config's own queues.
    spec.redrive_allow = vec![original.clone()];
    let running = common::start_watch(spec.clone(), Arc::clone(&host), Faults::default()).await;
    let store = lazaret_guard::Host::store(&*host);
    let dls = common::wait_dead_letters(store, "nats-watch", 1, Duration::from_secs(20)).await;
    running.stop().await.expect("a clean stop");
    let dl = &dls[0];
    assert_eq!(dl.stage, Stage::Broker);
    assert_eq!(dl.reason, DeadLetterReason::MaxDeliveries);
    assert_eq!(dl.attempts, 1);
    let error = dl.error.as_ref().expect("the advisory's account");
    assert_eq!(error.kind.to_string(), "max_deliveries");
    assert!(error.message.contains(&original), "{}", error.message);
    assert!(error.message.contains("workers"), "{}", error.message);
    let src = dl.source.as_ref().expect("a source");
    assert_eq!(src.broker, "nats");
    assert_eq!(src.queue, original);
    assert_eq!(src.message_id, "lost-1");
    assert_eq!(src.position, json!({"stream_seq": 1, "subject": original}));
    assert_eq!(src.headers.get("x-origin"), Some(&json!("test")));
    let payload = store
        .dead_letter_payload(dl.id)
        .await
        .expect("read the payload")
        .flatten();
    assert_eq!(payload.as_deref(), Some(&b"payload-1"[..]));
    // The advisory was acknowledged on the dead-letter stream.
    let info =
        b.js.get_stream(&dlq)
            .await
            .expect("the dead-letter stream")
            .consumer_info("lazaret")
            .await
            .expect("the watch's consumer");
    assert_eq!((info.num_ack_pending, info.num_pending), (0, 0));

    // Its redrive goes back to the original stream's subject.
    let broker: Arc<dyn Broker> = lazaret_guard::connect(&spec).await.expect("connect").into();
    let mut set = SourceSet::default();
    set.insert(spec, broker);
    set.redrive(dl, b"payload-1".to_vec())
        .await
        .expect("the redrive is confirmed");
    let (body, headers) = b
        .take_one(&original, Duration::from_secs(5))
        .await
        .expect("the redriven message");
    assert_eq!(body, b"payload-1");
    assert_eq!(headers.get("x-lazaret-message-id"), Some(&json!("lost-1")));
    assert_eq!(headers.get("x-origin"), Some(&json!("test")));
}

#[tokio::test]
async fn a_max_deliver_below_the_policy_is_warned_about() {
    let Some(b) = Nats::connect().await else {
        return;
    };
    let queue = b.fresh_queue("nats-limits").await;
    b.js.get_stream(&queue)
        .await
        .expect("the stream")
        .create_consumer(pull::Config {
            durable_name: Some("lazaret".into()),
            max_deliver: 3,
            ..Default::default()
        })
        .await
        .expect("a consumer with MaxDeliver 3");
    let broker = lazaret_guard::connect(&b.spec("nats-limits", &queue, Mode::Guard))
        .await
        .expect("connect");
    let warnings = broker.check_limits(5).await;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("MaxDeliver = 3"), "{}", warnings[0]);
    assert!(broker.check_limits(2).await.is_empty());

    // An AckWait the in-progress acks cannot keep up with.
    let queue = b.fresh_queue("nats-ackwait").await;
    b.js.get_stream(&queue)
        .await
        .expect("the stream")
        .create_consumer(pull::Config {
            durable_name: Some("lazaret".into()),
            ack_wait: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .expect("a consumer with AckWait 1 s");
    let broker = lazaret_guard::connect(&b.spec("nats-ackwait", &queue, Mode::Guard))
        .await
        .expect("connect");
    let warnings = broker.check_limits(5).await;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("AckWait = 1s"), "{}", warnings[0]);
}

#[tokio::test]
async fn a_stream_that_does_not_exist_is_a_config_error_that_says_so() {
    let Some(b) = Nats::connect().await else {
        return;
    };
    let broker = lazaret_guard::connect(&b.spec("nats-missing", "NO_SUCH_STREAM_X", Mode::Guard))
        .await
        .expect("connect");
    let err = broker.consume().await.err().expect("no stream");
    assert!(
        err.to_string().contains("no stream \"NO_SUCH_STREAM_X\""),
        "{err}"
    );
}

#[tokio::test]
async fn a_watch_files_terminated_messages_and_keeps_the_advisory_of_one_gone() {
    let Some(b) = Nats::connect().await else {
        return;
    };
    let dir = tempfile::tempdir().expect("a temp dir");
    let original = b.stream("nats-term-orig", Vec::new()).await;
    let dlq = b
        .stream(
            "nats-term-dlq",
            vec![format!(
                "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{original}.*"
            )],
        )
        .await;
    let stream = b.js.get_stream(&original).await.expect("the stream");
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("workers".into()),
            ..Default::default()
        })
        .await
        .expect("a consumer");
    for id in ["kept", "gone"] {
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", id);
        b.publish(&original, h, id.as_bytes()).await;
    }
    // The team's worker gives up on both (AckTerm).
    let mut batch = consumer
        .fetch()
        .max_messages(2)
        .expires(Duration::from_secs(2))
        .messages()
        .await
        .expect("fetch");
    while let Some(m) = batch.next().await {
        m.expect("a message")
            .double_ack_with(AckKind::Term)
            .await
            .expect("term");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while b
        .js
        .get_stream(&dlq)
        .await
        .expect("the dead-letter stream")
        .get_info()
        .await
        .expect("its info")
        .state
        .messages
        < 2
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no MSG_TERMINATED advisories"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Retention took one of them away before lazaret looked.
    assert!(stream.delete_message(2).await.expect("delete message 2"));

    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(50)),
    );
    let running = common::start_watch(
        b.spec("nats-term", &dlq, Mode::Watch),
        Arc::clone(&host),
        Faults::default(),
    )
    .await;
    let store = lazaret_guard::Host::store(&*host);
    let dls = common::wait_dead_letters(store, "nats-term", 2, Duration::from_secs(20)).await;
    running.stop().await.expect("a clean stop");
    for dl in &dls {
        assert_eq!(dl.stage, Stage::Broker);
        assert_eq!(dl.reason, DeadLetterReason::Rejected);
        let error = dl.error.as_ref().expect("the advisory's account");
        assert_eq!(error.kind.to_string(), "terminated");
        assert!(error.message.contains("AckTerm"), "{}", error.message);
        assert_eq!(dl.source.as_ref().expect("a source").queue, original);
    }
    let kept = dls
        .iter()
        .find(|d| d.source.as_ref().is_some_and(|s| s.message_id == "kept"))
        .expect("the message still in its stream, filed under its own id");
    assert_eq!(
        store
            .dead_letter_payload(kept.id)
            .await
            .expect("read")
            .flatten()
            .as_deref(),
        Some(&b"kept"[..])
    );
    let gone = dls
        .iter()
        .find(|d| d.source.as_ref().is_some_and(|s| s.message_id != "kept"))
        .expect("the one gone");
    let error = gone.error.as_ref().expect("an error");
    assert!(
        error.message.contains("gone from the stream"),
        "{}",
        error.message
    );
    assert_eq!(
        gone.source.as_ref().expect("a source").position,
        json!({"stream_seq": 2})
    );
    let body = store
        .dead_letter_payload(gone.id)
        .await
        .expect("read")
        .flatten()
        .unwrap_or_default();
    let advisory: Value = serde_json::from_slice(&body).expect("the advisory's JSON");
    assert_eq!(
        advisory["type"],
        json!("io.nats.jetstream.advisory.v1.terminated")
    );
}

/// A durable consumer on a fresh stream holding `n` messages, with this
/// AckWait, and an adapter consuming it `concurrency` at a time.
async fn pulled(b: &Nats, prefix: &str, ack_wait: Duration, n: usize) -> (String, Box<dyn Broker>) {
    let queue = b.fresh_queue(prefix).await;
    b.js.get_stream(&queue)
        .await
        .expect("the stream")
        .create_consumer(pull::Config {
            durable_name: Some("lazaret".into()),
            ack_wait,
            ..Default::default()
        })
        .await
        .expect("a consumer");
    for i in 0..n {
        b.produce(&queue, &format!("p-{i}"), b"x", Map::new()).await;
    }
    let mut spec = b.spec(prefix, &queue, Mode::Guard);
    spec.concurrency = 3;
    let broker = lazaret_guard::connect(&spec).await.expect("connect");
    (queue, broker)
}

#[tokio::test]
async fn pulled_messages_not_started_yet_are_kept_from_redelivery_and_handed_back_on_drop() {
    let Some(b) = Nats::connect().await else {
        return;
    };
    // One batch of three; the runtime starts one and waits (a breaker, a
    // pause) for longer than the AckWait.
    let (queue, broker) = pulled(&b, "nats-keep", Duration::from_secs(1), 3).await;
    let mut consumer = broker.consume().await.expect("consume");
    let first = consumer.next().await.expect("next").expect("a message");
    assert_eq!(first.delivery.message_id, "p-0");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    // Another worker on the same consumer gets what JetStream gave up on:
    // the started message (its handler sent no in-progress ack here), not
    // the two lazaret holds.
    let consumer_of_others =
        b.js.get_stream(&queue)
            .await
            .expect("the stream")
            .get_consumer::<pull::Config>("lazaret")
            .await
            .expect("the consumer");
    let mut batch = consumer_of_others
        .fetch()
        .max_messages(3)
        .expires(Duration::from_millis(500))
        .messages()
        .await
        .expect("fetch");
    let mut redelivered = Vec::new();
    while let Some(m) = batch.next().await {
        let m = m.expect("a message");
        redelivered.push(
            m.headers
                .as_ref()
                .map(headers_json)
                .and_then(|h| h.get("Nats-Msg-Id").cloned()),
        );
        m.double_ack().await.expect("ack");
    }
    assert_eq!(redelivered, vec![Some(json!("p-0"))]);
    drop(first);
    for id in ["p-1", "p-2"] {
        let i = consumer.next().await.expect("next").expect("a message");
        assert_eq!(i.delivery.message_id, id);
        i.ack.ack().await.expect("ack");
    }

    // Dropped with two pulled and never started: they come back at once,
    // not after the AckWait (35 s).
    let (_, broker) = pulled(&b, "nats-drop", Duration::from_secs(30), 3).await;
    let mut consumer = broker.consume().await.expect("consume");
    let first = consumer.next().await.expect("next").expect("a message");
    first.ack.ack().await.expect("ack");
    drop(consumer);
    let mut consumer = broker.consume().await.expect("consume again");
    let mut ids = Vec::new();
    for _ in 0..2 {
        let i = tokio::time::timeout(Duration::from_secs(10), consumer.next())
            .await
            .expect("handed back at once")
            .expect("next")
            .expect("a message");
        ids.push(i.delivery.message_id.clone());
        i.ack.ack().await.expect("ack");
    }
    ids.sort();
    assert_eq!(ids, vec!["p-1", "p-2"]);

    // Shutdown while a pull waits on the server: a message arriving for
    // that pull is handed back, not left to wait out the AckWait.
    let (queue, broker) = pulled(&b, "nats-abandon", Duration::from_secs(30), 0).await;
    let mut consumer = broker.consume().await.expect("consume");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), consumer.next())
            .await
            .is_err(),
        "an empty stream"
    );
    drop(consumer);
    b.produce(&queue, "late", b"x", Map::new()).await;
    let mut consumer = broker.consume().await.expect("consume again");
    let i = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("handed back at once")
        .expect("next")
        .expect("a message");
    assert_eq!(i.delivery.message_id, "late");
    i.ack.ack().await.expect("ack");
}

crate::scenarios::scenario_suite!(crate::nats::Nats::connect());
