//! RabbitMQ against a real broker (`LAZARET_TEST_AMQP_URL`, e.g.
//! `amqp://guest:guest@127.0.0.1:5672/%2f`): the shared scenarios, and what
//! only RabbitMQ has — how a delivery's properties and headers map, a quorum
//! queue's `x-delivery-count` as the attempt floor, `x-death` read by a
//! watch source, publisher confirms refusing an unroutable redrive, and a
//! connection that dies under a running guard.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lapin::options::{
    BasicGetOptions, BasicNackOptions, BasicPublishOptions, BasicRejectOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use lazaret_core::{DeadLetterReason, Failure, FailureClass};
use lazaret_guard::message::header_text;
use lazaret_guard::rabbitmq::{json_to_table, table_to_json};
use lazaret_guard::{
    BrokerError, BrokerKind, Delivery, Faults, Host, Incoming, Mode, Outcome, OwnedCall, Republish,
    Settled, SourceSet, SourceSpec, handler_fn,
};
use lazaret_store::Stage;
use serde_json::{Map, Value, json};

use crate::common::{
    self, TestBroker, dead_letters_of, headers, host, policies, settled_log, unique, wait_settled,
};

/// How long any one wait here may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(60);

/// A RabbitMQ the tests produce to and read from directly, as the team's
/// own producers and consumers would.
pub struct Rabbit {
    url: String,
    conn: Connection,
}

/// The broker of `LAZARET_TEST_AMQP_URL`, or `None` (the test is skipped).
pub async fn rabbit_or_skip() -> Option<Rabbit> {
    let url = common::service("LAZARET_TEST_AMQP_URL")?;
    let conn = Connection::connect(&url, props())
        .await
        .unwrap_or_else(|e| panic!("connect to RabbitMQ at {url}: {e}"));
    Some(Rabbit { url, conn })
}

fn props() -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

/// A quorum queue that RabbitMQ deletes by itself once it has gone unused
/// for 15 minutes, so the queues of a test that failed (or of a run that
/// was killed) do not pile up on a broker that CI shares with later runs.
fn quorum() -> FieldTable {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert("x-expires".into(), AMQPValue::LongInt(15 * 60 * 1000));
    args
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

impl Rabbit {
    async fn channel(&self) -> Channel {
        self.conn.create_channel().await.expect("open a channel")
    }

    /// Publishes with confirms, as a careful producer does.
    pub async fn publish(&self, queue: &str, props: BasicProperties, body: &[u8]) {
        let ch = self.channel().await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        let confirm = ch
            .basic_publish(
                "",
                queue,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirmation");
        assert_eq!(
            confirm,
            lapin::publisher_confirm::Confirmation::Ack(None),
            "published to {queue}"
        );
    }

    /// Takes one message with `basic.get`, polling until `wait` ends.
    async fn get(
        &self,
        queue: &str,
        no_ack: bool,
        wait: Duration,
    ) -> Option<(Channel, lapin::message::Delivery)> {
        let ch = self.channel().await;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(m) = ch
                .basic_get(queue, BasicGetOptions { no_ack })
                .await
                .expect("basic.get")
            {
                return Some((ch, m.delivery));
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The number of messages ready in `queue`.
    async fn ready(&self, queue: &str) -> u32 {
        self.channel()
            .await
            .queue_declare(
                queue,
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("the queue exists")
            .message_count()
    }
}

impl TestBroker for Rabbit {
    async fn fresh_queue(&self, prefix: &str) -> String {
        let queue = unique(prefix);
        self.channel()
            .await
            .queue_declare(&queue, durable(), quorum())
            .await
            .expect("declare a quorum queue");
        queue
    }

    fn spec(&self, name: &str, queue: &str, mode: Mode) -> SourceSpec {
        let mut spec = SourceSpec::guard(
            name,
            BrokerKind::RabbitMq,
            self.url.clone(),
            queue,
            "orders",
        );
        spec.mode = mode;
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
        let props = BasicProperties::default()
            .with_message_id(message_id.into())
            .with_delivery_mode(2)
            .with_headers(json_to_table(&headers));
        self.publish(queue, props, body).await;
    }

    async fn broker_dead_letter(
        &self,
        prefix: &str,
        message_id: &str,
        body: &[u8],
    ) -> (String, String) {
        let dlq = unique(&format!("{prefix}-dlq"));
        let original = unique(prefix);
        let ch = self.channel().await;
        ch.queue_declare(&dlq, durable(), quorum())
            .await
            .expect("declare the dead-letter queue");
        let mut args = quorum();
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(dlq.as_str().into()),
        );
        ch.queue_declare(&original, durable(), args)
            .await
            .expect("declare the original queue");
        self.produce(
            &original,
            message_id,
            body,
            headers(json!({"x-app": "shop"})),
        )
        .await;
        let (_ch, d) = self
            .get(&original, false, PATIENCE)
            .await
            .expect("the message is on the original queue");
        // The team's consumer rejects it: RabbitMQ dead-letters it with x-death.
        assert!(
            d.acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .expect("basic.reject")
        );
        (dlq, original)
    }

    fn broker_reason(&self) -> DeadLetterReason {
        DeadLetterReason::Rejected
    }

    async fn take_one(&self, queue: &str, wait: Duration) -> Option<(Vec<u8>, Map<String, Value>)> {
        let (_ch, d) = self.get(queue, true, wait).await?;
        let h = d
            .properties
            .headers()
            .as_ref()
            .map(table_to_json)
            .unwrap_or_default();
        Some((d.data, h))
    }
}

/// What a handler saw: the delivery as the gates hand it over, the attempt.
#[derive(Clone, Default)]
struct Calls(Arc<Mutex<Vec<OwnedCall>>>);

impl Calls {
    fn handler(&self, answer: fn(&OwnedCall) -> Outcome) -> Arc<dyn lazaret_guard::Handler> {
        let calls = self.clone();
        Arc::new(handler_fn(move |call: OwnedCall| {
            let out = answer(&call);
            calls.0.lock().unwrap().push(call);
            async move { out }
        }))
    }

    async fn wait(&self, n: usize) -> Vec<OwnedCall> {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let seen = self.0.lock().unwrap().clone();
            if seen.len() >= n {
                return seen;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{n} calls not seen: {seen:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn of(&self, id: &str) -> Delivery {
        let seen = self.0.lock().unwrap();
        seen.iter()
            .find(|c| c.delivery.message_id == id)
            .map(|c| c.delivery.clone())
            .unwrap_or_else(|| panic!("{id} not delivered: {seen:#?}"))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_carries_its_id_headers_and_content_type() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("mapping").await;
    let name = unique("mapping");
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );

    // The message_id property, with headers of every shape.
    let mut h = json_to_table(&headers(json!({
        "x-app": "shop", "n": 3, "ok": true, "ratio": 0.5,
        "nested": {"list": [1, "two", {"three": 3}]}
    })));
    h.insert(
        "raw".into(),
        AMQPValue::LongString(LongString::from(vec![0xffu8, 0x00])),
    );
    h.insert("at".into(), AMQPValue::Timestamp(1_700_000_000));
    let props = BasicProperties::default()
        .with_message_id("m-props".into())
        .with_content_type("application/json".into())
        .with_headers(h);
    b.publish(&queue, props, b"{\"a\": 1}").await;
    // No message_id: a Celery task's id header.
    let celery = json_to_table(&headers(
        json!({"task": "tasks.add", "id": "celery-7", "retries": 0}),
    ));
    b.publish(
        &queue,
        BasicProperties::default().with_headers(celery),
        b"[[1, 2], {}, {}]",
    )
    .await;
    // Neither: a hash of the body and the headers that are not x- ones.
    b.publish(&queue, BasicProperties::default(), b"anonymous")
        .await;

    let calls = Calls::default();
    let spec = b.spec(&name, &queue, Mode::Guard);
    let g = common::start_guard(
        &b,
        spec,
        host,
        calls.handler(|_| Outcome::Success),
        Faults::default(),
    )
    .await;
    let seen = calls.wait(3).await;
    assert!(seen.iter().all(|c| c.attempt == 1), "{seen:#?}");

    let d = calls.of("m-props");
    assert_eq!(d.body, b"{\"a\": 1}");
    assert_eq!(d.content_type.as_deref(), Some("application/json"));
    assert_eq!(
        Value::Object(d.headers.clone()),
        json!({
            "x-app": "shop", "n": 3, "ok": true, "ratio": 0.5,
            "nested": {"list": [1, "two", {"three": 3}]},
            "raw": {"base64": "/wA="}, "at": 1_700_000_000
        })
    );
    assert_eq!(d.broker_prior, 0);
    assert!(!d.redelivered);
    assert_eq!(d.queue, queue);
    assert_eq!(d.position, json!({"exchange": "", "routing_key": queue}));

    assert_eq!(calls.of("celery-7").body, b"[[1, 2], {}, {}]");
    let anon = seen
        .iter()
        .find(|c| c.delivery.body == b"anonymous")
        .expect("the anonymous message");
    assert!(anon.delivery.message_id.starts_with("sha256:"), "{anon:#?}");
    assert_eq!(anon.delivery.content_type, None);
    g.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_failure_is_one_dead_letter_and_leaves_the_queue() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("permanent").await;
    let name = unique("permanent");
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    b.produce(
        &queue,
        "m-p",
        b"{\"customer\": 9}",
        headers(json!({"x-app": "shop", "trace": "t-9"})),
    )
    .await;
    let calls = Calls::default();
    let (faults, log) = settled_log();
    let g = common::start_guard(
        &b,
        b.spec(&name, &queue, Mode::Guard),
        Arc::clone(&host),
        calls.handler(|_| {
            Outcome::Failure(
                Failure::new("http_422", "no such customer").with_class(FailureClass::Permanent),
            )
        }),
        faults,
    )
    .await;
    wait_settled(&log, "m-p", Settled::Quarantined, PATIENCE).await;
    g.stop().await.unwrap();

    let dls = dead_letters_of(host.store(), &name).await;
    assert_eq!(dls.len(), 1, "{dls:#?}");
    let dl = &dls[0];
    assert_eq!(dl.reason, DeadLetterReason::Permanent);
    assert_eq!(dl.stage, Stage::Processing);
    assert_eq!(dl.attempts, 1);
    let src = dl.source.as_ref().expect("the source");
    assert_eq!(src.name, name);
    assert_eq!(src.broker, "rabbitmq");
    assert_eq!(src.queue, queue);
    assert_eq!(src.message_id, "m-p");
    assert_eq!(
        Value::Object(src.headers.clone()),
        json!({"x-app": "shop", "trace": "t-9"})
    );
    assert_eq!(src.position, json!({"exchange": "", "routing_key": queue}));
    // Acknowledged: with the guard's connection closed nothing came back.
    assert_eq!(b.ready(&queue).await, 0);
    assert_eq!(calls.wait(1).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_another_consumer_gave_back_arrives_as_attempt_2() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("given-back").await;
    let name = unique("given-back");
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    b.produce(&queue, "m-g", b"{}", headers(json!({}))).await;
    {
        // A plain consumer takes it and hands it back (as one that died would).
        let (_ch, d) = b.get(&queue, false, PATIENCE).await.expect("the message");
        assert!(
            d.acker
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true
                })
                .await
                .expect("basic.nack")
        );
    }
    let calls = Calls::default();
    let g = common::start_guard(
        &b,
        b.spec(&name, &queue, Mode::Guard),
        host,
        calls.handler(|_| Outcome::Success),
        Faults::default(),
    )
    .await;
    let seen = calls.wait(1).await;
    assert_eq!(
        seen[0].attempt, 2,
        "the quorum queue's x-delivery-count is the floor"
    );
    let d = &seen[0].delivery;
    assert_eq!(d.broker_prior, 1);
    assert!(d.redelivered);
    assert_eq!(d.headers.get("x-delivery-count"), Some(&json!(1)));
    g.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_source_reads_x_death_and_a_redrive_goes_back_persistent() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (dlq, original) = b.broker_dead_letter("xdeath", "m-x", b"{\"x\": 1}").await;
    let name = unique("xdeath");
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    let mut spec = b.spec(&name, &dlq, Mode::Watch);
    // The original queue comes from the message: allowed as the server
    // allows its config's own queues.
    spec.redrive_allow = vec![original.clone()];
    let w = common::start_watch(spec.clone(), Arc::clone(&host), Faults::default()).await;
    let dl = common::wait_dead_letters(host.store(), &name, 1, PATIENCE)
        .await
        .remove(0);
    w.stop().await.unwrap();
    assert_eq!(b.ready(&dlq).await, 0, "the watch acknowledged it");

    assert_eq!(dl.stage, Stage::Broker);
    assert_eq!(dl.reason, DeadLetterReason::Rejected);
    assert_eq!(dl.attempts, 1);
    let e = dl.error.as_ref().expect("the broker's reason as the error");
    assert_eq!(e.kind.as_str(), "rejected");
    assert_eq!(
        e.message,
        format!("RabbitMQ dead-lettered it from queue {original} (rejected, once)")
    );
    let src = dl.source.as_ref().expect("the source");
    assert_eq!(src.broker, "rabbitmq");
    assert_eq!(src.queue, original);
    assert_eq!(src.message_id, "m-x");
    assert_eq!(
        src.position,
        json!({"exchange": "", "routing_keys": [original]})
    );
    assert!(src.headers.contains_key("x-death"), "{:#?}", src.headers);
    assert!(dl.created_at.as_millis() > 0);

    let mut set = SourceSet::default();
    set.insert(spec.clone(), b.connect(&spec).await);
    let sent = set
        .redrive(&dl, b"{\"x\": 2}".to_vec())
        .await
        .expect("confirmed");
    assert_eq!(sent, "m-x");
    let (_ch, d) = b
        .get(&original, true, PATIENCE)
        .await
        .expect("the redriven message");
    assert_eq!(d.data, b"{\"x\": 2}");
    assert_eq!(
        d.properties.message_id().as_ref().map(|s| s.as_str()),
        Some("m-x")
    );
    assert_eq!(*d.properties.delivery_mode(), Some(2), "persistent");
    let h = d
        .properties
        .headers()
        .as_ref()
        .map(table_to_json)
        .unwrap_or_default();
    let text = |k: &str| h.get(k).and_then(header_text);
    assert_eq!(text("x-lazaret-attempt").as_deref(), Some("0"));
    assert_eq!(text("x-lazaret-message-id").as_deref(), Some("m-x"));
    assert_eq!(text("x-app").as_deref(), Some("shop"));
    assert!(
        !h.keys()
            .any(|k| k.starts_with("x-death") || k.starts_with("x-first-death")),
        "{h:#?}"
    );
}

/// A message an application published straight into the watched queue has
/// no death information: `unknown_origin`, never an invented `rejected`,
/// and its redrive would go back to the watched queue (where the copy was
/// taken for the dead letter and lost): refused, asking for `redrive_to`.
/// A queue named by the message's `x-death` is redriven to only when
/// allowed, and one RabbitMQ cannot take (100,000 bytes: it closed the
/// connection with FRAME_ERROR) is refused before anything is published,
/// in a message of readable length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_redrives_only_to_allowed_queues_and_never_to_its_own() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dlq = b.fresh_queue("plain-dlq").await;
    let other = b.fresh_queue("other-team").await;
    let death = |queue: &str| {
        headers(json!({"x-death": [{"queue": queue, "reason": "rejected", "count": 1}]}))
    };
    b.produce(&dlq, "p-1", b"{\"p\": 1}", headers(json!({})))
        .await;
    b.produce(&dlq, "p-2", b"{\"p\": 2}", death(&other)).await;
    b.produce(&dlq, "p-3", b"{\"p\": 3}", death(&"q".repeat(100_000)))
        .await;
    let name = unique("plain-watch");
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    let spec = b.spec(&name, &dlq, Mode::Watch);
    let w = common::start_watch(spec.clone(), Arc::clone(&host), Faults::default()).await;
    let dls = common::wait_dead_letters(host.store(), &name, 3, PATIENCE).await;
    let by_id = |id: &str| {
        dls.iter()
            .find(|d| d.source.as_ref().is_some_and(|s| s.message_id == id))
            .cloned()
            .unwrap_or_else(|| panic!("the dead letter of {id}: {dls:#?}"))
    };
    let (p1, p2, p3) = (by_id("p-1"), by_id("p-2"), by_id("p-3"));
    assert_eq!(p1.reason, DeadLetterReason::UnknownOrigin);
    assert_eq!(p2.reason, DeadLetterReason::Rejected);

    let mut set = SourceSet::default();
    set.insert(spec.clone(), b.connect(&spec).await);
    let own = set
        .redrive(&p1, b"{}".to_vec())
        .await
        .unwrap_err()
        .to_string();
    assert!(own.contains("redrive_to") && own.contains(&dlq), "{own}");
    let not_allowed = set
        .redrive(&p2, b"{}".to_vec())
        .await
        .unwrap_err()
        .to_string();
    assert!(
        not_allowed.contains("redrive_allow") && not_allowed.contains(&other),
        "{not_allowed}"
    );
    let huge = set
        .redrive(&p3, b"{}".to_vec())
        .await
        .unwrap_err()
        .to_string();
    assert!(huge.contains("100000 bytes"), "{huge}");
    assert!(
        huge.len() < 600,
        "cut to a readable length: {} bytes",
        huge.len()
    );
    assert_eq!(b.ready(&dlq).await, 0, "nothing was published back");

    // Allowed, it goes; and the watch's connection lived through all this.
    let mut allowed = spec.clone();
    allowed.redrive_allow = vec![other.clone()];
    let mut set = SourceSet::default();
    set.insert(allowed.clone(), b.connect(&allowed).await);
    set.redrive(&p2, b"{\"p\": 2}".to_vec())
        .await
        .expect("confirmed");
    let (_ch, d) = b.get(&other, true, PATIENCE).await.expect("the redrive");
    let h = d
        .properties
        .headers()
        .as_ref()
        .map(table_to_json)
        .unwrap_or_default();
    let text = |k: &str| h.get(k).and_then(header_text);
    assert_eq!(text("x-lazaret-attempt").as_deref(), Some("0"));
    assert!(
        text("x-lazaret-redrive-id").is_some_and(|id| !id.is_empty()),
        "{h:#?}"
    );
    b.produce(&dlq, "p-4", b"{\"p\": 4}", headers(json!({})))
        .await;
    common::wait_dead_letters(host.store(), &name, 4, PATIENCE).await;
    w.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_to_a_missing_queue_is_not_confirmed() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let queue = b.fresh_queue("exists").await;
    let spec = b.spec(&unique("missing"), &queue, Mode::Guard);
    let broker = b.connect(&spec).await;
    let missing = unique("no-such-queue");
    let msg = |queue: &str| Republish {
        queue: queue.to_owned(),
        body: b"{}".to_vec(),
        content_type: Some("application/json".into()),
        headers: headers(json!({"x-lazaret-attempt": "0", "bin": {"base64": "/wA="}})),
        message_id: "m-1".into(),
        dedup_id: "m-1:redrive".into(),
        position: Value::Null,
    };
    match broker.publish(msg(&missing)).await {
        Err(BrokerError::NotConfirmed { queue, why, .. }) => {
            assert_eq!(queue, missing);
            assert!(why.contains("unroutable"), "{why}");
        }
        other => panic!("expected NotConfirmed, got {other:?}"),
    }
    // The same channel still publishes where the queue exists.
    broker.publish(msg(&queue)).await.expect("confirmed");
    let (body, h) = b.take_one(&queue, PATIENCE).await.expect("published");
    assert_eq!(body, b"{}");
    assert_eq!(h.get("bin"), Some(&json!({"base64": "/wA="})));
}

#[tokio::test]
async fn an_unreachable_broker_is_a_connect_error_without_the_password() {
    // Port 1 on loopback refuses: no broker needed.
    let spec = SourceSpec::guard(
        "nowhere",
        BrokerKind::RabbitMq,
        "amqp://guest:s3cret@127.0.0.1:1/%2f",
        "orders",
        "orders",
    );
    match lazaret_guard::connect(&spec).await {
        Err(e @ BrokerError::Connect { .. }) => {
            let text = e.to_string();
            assert!(text.contains("amqp://***@127.0.0.1:1/%2f"), "{text}");
            assert!(!text.contains("s3cret"), "{text}");
        }
        Err(other) => panic!("expected a connect error, got {other}"),
        Ok(_) => panic!("connected to port 1"),
    }
}

#[tokio::test]
async fn an_amqps_url_says_this_build_has_no_tls() {
    let spec = SourceSpec::guard(
        "tls",
        BrokerKind::RabbitMq,
        "amqps://guest:s3cret@127.0.0.1:5671/%2f",
        "orders",
        "orders",
    );
    match lazaret_guard::connect(&spec).await {
        Err(e @ BrokerError::Config(_)) => {
            let text = e.to_string();
            assert!(text.contains("TLS"), "{text}");
            assert!(!text.contains("s3cret"), "{text}");
        }
        Err(other) => panic!("expected a config error, got {other}"),
        Ok(_) => panic!("connected without TLS support"),
    }
}

/// Closes the connections RabbitMQ knows by this client-given name, with
/// `rabbitmqctl`; `false` when there is no `rabbitmqctl` to do it with.
/// (RabbitMQ before 3.11 has no `user_provided_name` column: the name is
/// then read from `client_properties`.)
fn close_connections_named(name: &str) -> bool {
    let list = |columns: &[&str]| {
        std::process::Command::new("rabbitmqctl")
            .args(["list_connections", "-q", "--no-table-headers"])
            .args(columns)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let pids: Vec<String> = if let Some(text) = list(&["pid", "user_provided_name"]) {
        text.lines()
            .filter_map(|l| l.split_once('\t'))
            .filter(|(_, n)| n.trim() == name)
            .map(|(pid, _)| pid.trim().to_owned())
            .collect()
    } else if let Some(text) = list(&["pid", "client_properties"]) {
        let needle = format!("{{\"connection_name\",\"{name}\"}}");
        text.lines()
            .filter(|l| l.contains(&needle))
            .filter_map(|l| l.split_once('\t'))
            .map(|(pid, _)| pid.trim().to_owned())
            .collect()
    } else {
        return false;
    };
    let mut closed = 0;
    for pid in pids {
        let ok = std::process::Command::new("rabbitmqctl")
            .args(["close_connection", &pid, "closed by a lazaret test"])
            .status()
            .is_ok_and(|s| s.success());
        closed += usize::from(ok);
    }
    assert!(
        closed > 0,
        "no connection named {name:?} to close among {:?}",
        list(&["pid", "client_properties"])
    );
    true
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_and_a_redrive_reconnect_after_the_connection_died() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("reconnect").await;
    let name = unique("reconnect");
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    let spec = b.spec(&name, &queue, Mode::Guard);
    let broker = b.connect(&spec).await;
    let calls = Calls::default();
    let (stop, rx) = tokio::sync::watch::channel(false);
    let guard = lazaret_guard::Guard::new(
        spec.clone(),
        host,
        Arc::clone(&broker),
        calls.handler(|_| Outcome::Success),
    );
    let task = tokio::spawn(guard.run(rx));
    b.produce(&queue, "before", b"{}", headers(json!({}))).await;
    calls.wait(1).await;

    if !tokio::task::spawn_blocking(move || {
        close_connections_named(&format!("lazaret source {name}"))
    })
    .await
    .unwrap()
    {
        lazaret_testkit::skip(
            "the reconnect",
            "no rabbitmqctl here to close the connection",
        );
        let _ = stop.send(true);
        task.await.unwrap().unwrap();
        return;
    }
    b.produce(&queue, "after", b"{}", headers(json!({}))).await;
    calls.wait(2).await;
    assert_eq!(calls.of("after").message_id, "after");
    // The redrive publishes on the reopened connection too.
    let msg = Republish {
        queue: queue.clone(),
        body: b"{}".to_vec(),
        content_type: None,
        headers: headers(json!({"x-lazaret-message-id": "again", "x-lazaret-attempt": "0"})),
        message_id: "again".into(),
        dedup_id: String::new(),
        position: Value::Null,
    };
    broker
        .publish(msg)
        .await
        .expect("confirmed after the reconnect");
    calls.wait(3).await;
    assert_eq!(calls.of("again").message_id, "again");
    let _ = stop.send(true);
    task.await.unwrap().unwrap();
}

/// Takes `n` messages from a consumer of the adapter, in delivery order.
async fn take_n(consumer: &mut Box<dyn lazaret_guard::Consumer>, n: usize) -> Vec<Incoming> {
    let mut taken = Vec::new();
    for _ in 0..n {
        let next = tokio::time::timeout(PATIENCE, consumer.next())
            .await
            .expect("a message within the patience")
            .expect("consume")
            .expect("the consumer is open");
        taken.push(next);
    }
    taken
}

/// Acknowledges these together (on one task, so that they are all ready
/// before the first is sent: the adapter may send them as one
/// `multiple=true` frame).
async fn ack_together(acks: Vec<Incoming>) {
    for r in futures_util::future::join_all(acks.into_iter().map(|i| i.ack.ack())).await {
        r.expect("acknowledged");
    }
}

/// The message ids (and whether redelivered) of the `n` or more messages
/// `queue` holds once it holds `n` ready, taken until it has none for a
/// second.
async fn drain_ids(b: &Rabbit, queue: &str, n: u32) -> Vec<(String, bool)> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while b.ready(queue).await < n {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{queue} never held {n} messages ready"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut ids = Vec::new();
    while let Some((_ch, d)) = b.get(queue, true, Duration::from_secs(1)).await {
        let id = d
            .properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str().to_owned())
            .unwrap_or_default();
        ids.push((id, d.redelivered));
    }
    ids.sort();
    ids
}

/// Acks ready together go out coalesced, yet never over a message still
/// being handled or being handed back: after the consumer's channel
/// closes, exactly those come back, redelivered, and every acknowledged
/// one is gone.
#[tokio::test]
async fn an_ack_never_covers_a_message_still_being_handled_or_handed_back() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let queue = b.fresh_queue("acks").await;
    for i in 1..=6 {
        b.produce(&queue, &format!("m-{i}"), b"{}", headers(json!({})))
            .await;
    }
    let spec = b.spec(&unique("acks"), &queue, Mode::Guard);
    let broker = b.connect(&spec).await;
    let mut consumer = broker.consume().await.expect("consume");
    let mut taken = take_n(&mut consumer, 6).await.into_iter();
    let mut next = |id: &str| {
        let i = taken.next().expect("six taken");
        assert_eq!(i.delivery.message_id, id, "delivered in queue order");
        i
    };
    let (m1, m2, m3, m4, m5, m6) = (
        next("m-1"),
        next("m-2"),
        next("m-3"),
        next("m-4"),
        next("m-5"),
        next("m-6"),
    );
    // 1 and 2 ready together: one frame may acknowledge both.
    ack_together(vec![m2, m1]).await;
    // 3 is still being handled; 5 is handed back, and 4 and 6 acked
    // while its nack may not be sent yet.
    let release = m5.ack.release();
    let (released, ()) = tokio::join!(release, ack_together(vec![m6, m4]));
    released.expect("handed back");
    // The guard dies with 3 unsettled: channel and connection go.
    drop((m3, consumer, broker));
    assert_eq!(
        drain_ids(&b, &queue, 2).await,
        vec![("m-3".to_owned(), true), ("m-5".to_owned(), true)],
        "only what was being handled or was handed back comes back"
    );
}

/// Many acks ready at once go as few frames as RabbitMQ accepts, and it
/// forgets every message they cover: with a prefetch of 20, the next 20
/// come only once all of the first 20 are acknowledged.
#[tokio::test]
async fn acks_ready_together_acknowledge_every_message() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let queue = b.fresh_queue("acks-all").await;
    for i in 0..60 {
        b.produce(&queue, &format!("m-{i:02}"), b"{}", headers(json!({})))
            .await;
    }
    let mut spec = b.spec(&unique("acks-all"), &queue, Mode::Guard);
    spec.concurrency = 10;
    spec.settling = Some(10);
    let broker = b.connect(&spec).await;
    let mut consumer = broker.consume().await.expect("consume");
    let mut first = take_n(&mut consumer, 20).await;
    // Out of order, as handlers finish.
    first.reverse();
    ack_together(first).await;
    // Taking these needs all 20 prefetch slots back.
    let second = take_n(&mut consumer, 20).await;
    let (early, late) = {
        let mut second = second;
        let late = second.split_off(10);
        (second, late)
    };
    ack_together(late).await;
    ack_together(early).await;
    let third = take_n(&mut consumer, 20).await;
    ack_together(third).await;
    drop((consumer, broker));
    b.produce(&queue, "end", b"{}", headers(json!({}))).await;
    assert_eq!(
        drain_ids(&b, &queue, 1).await,
        vec![("end".to_owned(), false)],
        "all acknowledged"
    );
}

// The behaviours every broker must show (tests/it/scenarios.rs).
crate::scenarios::scenario_suite!(crate::rabbitmq::rabbit_or_skip());

/// A connection lost under a backlog (the prefetch full) duplicates at
/// most the handler calls in flight at that moment: the deliveries lapin
/// had buffered, or the guard had taken and not yet handed to the handler,
/// are not delivered on a dead channel (their acks could only fail, and
/// RabbitMQ hands them out again anyway). Before, the guard went on POSTing
/// them for tens of milliseconds, and each came back a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_duplicates_at_most_the_calls_in_flight() {
    use std::collections::HashMap;

    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("lost-conn").await;
    let name = unique("lost-conn");
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    let mut spec = b.spec(&name, &queue, Mode::Guard);
    spec.concurrency = 4;
    const N: usize = 1500;
    for i in 0..N {
        b.produce(&queue, &format!("m-{i}"), b"{}", headers(json!({})))
            .await;
    }
    let counts: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let c = Arc::clone(&counts);
    let handler = Arc::new(handler_fn(move |call: OwnedCall| {
        *c.lock()
            .unwrap()
            .entry(call.delivery.message_id.clone())
            .or_default() += 1;
        async move {
            // Slow enough that the prefetch (64) stays full, and that
            // the backlog outlasts rabbitmqctl's start.
            tokio::time::sleep(Duration::from_millis(30)).await;
            Outcome::Success
        }
    }));
    let broker = b.connect(&spec).await;
    let (stop, rx) = tokio::sync::watch::channel(false);
    let task = tokio::spawn(lazaret_guard::Guard::new(spec.clone(), host, broker, handler).run(rx));
    let handled = |n: usize| {
        let counts = Arc::clone(&counts);
        async move {
            let deadline = tokio::time::Instant::now() + PATIENCE;
            while counts.lock().unwrap().len() < n {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{n} messages not handled"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    };
    handled(40).await;
    let conn_name = format!("lazaret source {name}");
    if !tokio::task::spawn_blocking(move || close_connections_named(&conn_name))
        .await
        .unwrap()
    {
        lazaret_testkit::skip(
            "the lost connection",
            "no rabbitmqctl here to close the connection",
        );
        let _ = stop.send(true);
        task.await.unwrap().unwrap();
        return;
    }
    handled(N).await;
    let _ = stop.send(true);
    task.await.unwrap().unwrap();
    let counts = counts.lock().unwrap();
    let twice: Vec<(&String, &usize)> = counts.iter().filter(|(_, n)| **n > 1).collect();
    let duplicates: usize = twice.iter().map(|(_, n)| **n - 1).sum();
    eprintln!("{duplicates} duplicate calls after one connection loss");
    // In flight: the calls running (`concurrency`) and those just finished
    // whose ack had not reached RabbitMQ yet (an ack above a running call
    // waits up to 2 ms to go with it as one frame: at most one per slot).
    // Before, the whole prefetch (64 here) was delivered twice.
    let in_flight = 2 * spec.concurrency as usize;
    assert!(
        duplicates <= in_flight,
        "{duplicates} duplicate calls after one connection loss, more than the {in_flight} in flight: {twice:?}"
    );
}
