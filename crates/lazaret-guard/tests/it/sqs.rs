//! Amazon SQS against an SQS endpoint (`LAZARET_TEST_SQS_URL`, moto's
//! server in CI, with `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY` and
//! `AWS_REGION` set): the shared scenarios on standard queues, through the
//! [`TestBroker`] below, and what only the SQS adapter has: a FIFO retry
//! held with a visibility change rather than the queue's whole timeout, a
//! deferral that spends no attempt, group order kept while another group
//! moves, a watch of a `RedrivePolicy` dead-letter queue that finds its
//! source queue, and a redrive to a FIFO queue that keeps the group id with
//! a fresh deduplication id. Every queue a test creates is deleted when its
//! [`Sqs`] is dropped (a panicking test included).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName};
use lazaret_core::{DeadLetterReason, Failure, FailureClass};
use lazaret_guard::{BrokerKind, Faults, Host, Mode, Outcome, Settled, SourceSet, SourceSpec};
use lazaret_store::{Held, Stage, Store};
use serde_json::{Map, Value, json};

use crate::common::{self, Log, TestBroker, settled_log, wait_settled};

/// The job type of every source here.
const TYPE: &str = "orders";

/// How long any one wait here may take before it fails.
const PATIENCE: Duration = Duration::from_secs(60);

/// An SQS endpoint, and the queues made on it (deleted on drop).
pub struct Sqs {
    url: String,
    client: Client,
    created: Mutex<Vec<String>>,
}

impl Drop for Sqs {
    fn drop(&mut self) {
        let queues = std::mem::take(&mut *self.created.lock().unwrap_or_else(|p| p.into_inner()));
        if queues.is_empty() {
            return;
        }
        let client = self.client.clone();
        // Drop may run inside the test's runtime: delete from a thread of
        // its own with a runtime of its own, and wait for it.
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime to delete the test queues");
            rt.block_on(async {
                for q in queues {
                    if let Err(e) = client.delete_queue().queue_url(&q).send().await {
                        eprintln!("could not delete the test queue {q}: {e}");
                    }
                }
            });
        });
        let _ = done.join();
    }
}

/// The SQS endpoint, or `None` after saying the tests are skipped.
pub async fn sqs_or_skip() -> Option<Sqs> {
    let url = common::service("LAZARET_TEST_SQS_URL")?;
    let client = lazaret_guard::sqs::client(&url)
        .await
        .expect("an SQS client (AWS_REGION and credentials set?)");
    Some(Sqs {
        url,
        client,
        created: Mutex::new(Vec::new()),
    })
}

impl Sqs {
    /// Creates a queue (`.fifo` names a FIFO queue) with these attributes.
    async fn create(&self, name: &str, attrs: &[(QueueAttributeName, String)]) -> String {
        let mut req = self.client.create_queue().queue_name(name);
        if name.ends_with(".fifo") {
            req = req.attributes(QueueAttributeName::FifoQueue, "true");
        }
        for (k, v) in attrs {
            req = req.attributes(k.clone(), v);
        }
        let url = req
            .send()
            .await
            .expect("create the queue")
            .queue_url()
            .expect("its url")
            .to_owned();
        self.created.lock().unwrap().push(url.clone());
        url
    }

    async fn arn(&self, url: &str) -> String {
        self.client
            .get_queue_attributes()
            .queue_url(url)
            .attribute_names(QueueAttributeName::QueueArn)
            .send()
            .await
            .expect("the queue's attributes")
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::QueueArn))
            .expect("its arn")
            .clone()
    }

    /// A FIFO queue whose visibility timeout is the whole 12 hours.
    async fn fifo(&self, prefix: &str) -> String {
        self.create(
            &format!("{}.fifo", common::unique(prefix)),
            &[(QueueAttributeName::VisibilityTimeout, "43200".into())],
        )
        .await
    }

    /// A dead-letter queue and a queue that moves a message there after
    /// `max_receives` receives; (dlq, source).
    async fn with_dlq(&self, prefix: &str, fifo: bool, max_receives: u32) -> (String, String) {
        let ext = if fifo { ".fifo" } else { "" };
        let base = common::unique(prefix);
        let dlq = self.create(&format!("{base}-dlq{ext}"), &[]).await;
        let policy =
            json!({"deadLetterTargetArn": self.arn(&dlq).await, "maxReceiveCount": max_receives});
        let source = self
            .create(
                &format!("{base}{ext}"),
                &[(QueueAttributeName::RedrivePolicy, policy.to_string())],
            )
            .await;
        (dlq, source)
    }

    async fn send(
        &self,
        queue: &str,
        message_id: &str,
        group: &str,
        body: &[u8],
        headers: Map<String, Value>,
    ) {
        let attr = |v: &str| {
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(v)
                .build()
                .expect("an attribute")
        };
        let mut req = self
            .client
            .send_message()
            .queue_url(queue)
            .message_body(String::from_utf8(body.to_vec()).expect("a text body"))
            .message_attributes("message_id", attr(message_id));
        for (k, v) in &headers {
            req = req.message_attributes(
                k,
                attr(&lazaret_guard::message::header_text(v).expect("a text header")),
            );
        }
        if queue.ends_with(".fifo") {
            req = req
                .message_group_id(group)
                .message_deduplication_id(message_id);
        }
        req.send().await.expect("send the message");
    }

    /// Receives one message (body, delivery as lazaret maps it, group id)
    /// and deletes it.
    async fn take(
        &self,
        queue: &str,
        wait: Duration,
    ) -> Option<(Vec<u8>, lazaret_guard::Delivery)> {
        let deadline = tokio::time::Instant::now() + wait;
        while tokio::time::Instant::now() < deadline {
            let out = self
                .client
                .receive_message()
                .queue_url(queue)
                .wait_time_seconds(1)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send()
                .await
                .expect("receive");
            if let Some(m) = out.messages.unwrap_or_default().into_iter().next() {
                self.client
                    .delete_message()
                    .queue_url(queue)
                    .receipt_handle(m.receipt_handle().unwrap_or_default())
                    .send()
                    .await
                    .expect("delete");
                let d = lazaret_guard::sqs::message_delivery(queue, &m);
                return Some((d.body.clone(), d));
            }
        }
        None
    }

    async fn count(&self, queue: &str) -> u64 {
        self.client
            .get_queue_attributes()
            .queue_url(queue)
            .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
            .send()
            .await
            .expect("the queue's attributes")
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::ApproximateNumberOfMessages))
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    /// Sends a message to a queue with `maxReceiveCount = 1` and receives it
    /// until SQS moves it to the dead-letter queue.
    async fn dead_letter(
        &self,
        dlq: &str,
        source: &str,
        message_id: &str,
        group: &str,
        body: &[u8],
    ) {
        self.send(
            source,
            message_id,
            group,
            body,
            common::headers(json!({"tenant": "acme"})),
        )
        .await;
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while self.count(dlq).await == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "SQS did not move the message to {dlq}"
            );
            let out = self
                .client
                .receive_message()
                .queue_url(source)
                .visibility_timeout(0)
                .wait_time_seconds(1)
                .send()
                .await
                .expect("receive");
            drop(out);
        }
    }
}

impl TestBroker for Sqs {
    async fn fresh_queue(&self, prefix: &str) -> String {
        self.create(&common::unique(prefix), &[]).await
    }

    fn spec(&self, name: &str, queue: &str, mode: Mode) -> SourceSpec {
        let mut spec = match mode {
            Mode::Guard => SourceSpec::guard(name, BrokerKind::Sqs, &self.url, queue, TYPE),
            Mode::Watch => SourceSpec::watch(name, BrokerKind::Sqs, &self.url, queue, TYPE),
        };
        spec.concurrency = 4;
        // A receive hides a message for twice this (at least 5 s): a message
        // a crashed guard left comes back quickly.
        spec.delivery_timeout = Duration::from_secs(2);
        spec
    }

    async fn produce(
        &self,
        queue: &str,
        message_id: &str,
        body: &[u8],
        headers: Map<String, Value>,
    ) {
        self.send(queue, message_id, "g", body, headers).await;
    }

    async fn broker_dead_letter(
        &self,
        prefix: &str,
        message_id: &str,
        body: &[u8],
    ) -> (String, String) {
        let (dlq, source) = self.with_dlq(prefix, false, 1).await;
        self.dead_letter(&dlq, &source, message_id, "g", body).await;
        (dlq, source)
    }

    fn broker_reason(&self) -> DeadLetterReason {
        DeadLetterReason::MaxReceives
    }

    async fn take_one(&self, queue: &str, wait: Duration) -> Option<(Vec<u8>, Map<String, Value>)> {
        self.take(queue, wait).await.map(|(b, d)| (b, d.headers))
    }
}

crate::scenarios::scenario_suite!(crate::sqs::sqs_or_skip());

fn transient(msg: &str) -> Outcome {
    Outcome::Failure(Failure::new("http_503", msg).with_class(FailureClass::Transient))
}

/// A FIFO message that fails is held on the queue for its backoff
/// (`ChangeMessageVisibility`), not the queue's 12-hour visibility timeout;
/// a deferral spends no attempt, and the receives lazaret caused count as
/// neither crashes nor attempts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_retry_waits_its_backoff_not_the_visibility_timeout() {
    let Some(b) = sqs_or_skip().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fifo("fifo-backoff").await;
    let name = common::unique("fifo-backoff");
    let spec = b.spec(&name, &queue, Mode::Guard);
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 5, Duration::from_millis(500)),
    );
    b.produce(&queue, "m-1", b"{\"n\": 1}", common::headers(json!({})))
        .await;
    let log = Log::default();
    let calls = Arc::new(Mutex::new(0u32));
    let c = Arc::clone(&calls);
    let handler = common::recording(&log, move |_| {
        let mut n = c.lock().unwrap();
        *n += 1;
        match *n {
            1 => Outcome::Failure(
                Failure::new("http_429", "slow down")
                    .with_class(FailureClass::Deferred)
                    .with_retry_after(Duration::from_secs(1)),
            ),
            2 => transient("busy"),
            _ => Outcome::Success,
        }
    });
    let (faults, settled) = settled_log();
    let g = common::start_guard(&b, spec, Arc::clone(&host), handler, faults).await;
    let seen = log.wait_for(PATIENCE, |s| s.len() >= 3).await;
    wait_settled(&settled, "m-1", Settled::Succeeded, PATIENCE).await;
    assert_eq!(
        seen.iter().map(|s| s.attempt).collect::<Vec<_>>(),
        vec![1, 1, 2],
        "the deferral spent nothing, the retry one attempt, and lazaret's own receives no crash: {seen:#?}"
    );
    assert_eq!(
        settled
            .lock()
            .unwrap()
            .iter()
            .map(|(_, h)| *h)
            .collect::<Vec<_>>(),
        vec![Settled::HeldRetry, Settled::HeldRetry, Settled::Succeeded]
    );
    assert_eq!(
        host.store()
            .message_held(lazaret_store::MessageKey::of(
                name.clone(),
                "m-1",
                b"{\"n\": 1}",
                None
            ))
            .await
            .unwrap(),
        Held::Nothing,
        "a success drops the record of what lazaret charged"
    );
    assert_eq!(b.count(&queue).await, 0, "the success deleted the message");
    g.stop().await.unwrap();
}

/// One failing message holds only its own group: the other group moves
/// while it waits, and the message behind it in its group waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_fifo_message_holds_its_group_and_no_other() {
    let Some(b) = sqs_or_skip().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fifo("fifo-groups").await;
    let name = common::unique("fifo-groups");
    let spec = b.spec(&name, &queue, Mode::Guard);
    // A backoff long enough for group b's three messages to go through
    // first even when each waits out a receive (moto's long poll does not
    // see a group freed during it).
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 5, Duration::from_secs(10)),
    );
    for (id, group) in [
        ("a-1", "a"),
        ("a-2", "a"),
        ("b-1", "b"),
        ("b-2", "b"),
        ("b-3", "b"),
    ] {
        b.send(&queue, id, group, b"{}", common::headers(json!({})))
            .await;
    }
    let log = Log::default();
    let handler = common::recording(&log, |s| {
        if s.message_id == "a-1" && s.attempt == 1 {
            transient("downstream refused it")
        } else {
            Outcome::Success
        }
    });
    let g = common::start_guard(&b, spec, Arc::clone(&host), handler, Faults::default()).await;
    let seen = log
        .wait_for(PATIENCE, |s| s.iter().any(|x| x.message_id == "a-2"))
        .await;
    let order: Vec<(&str, u32)> = seen
        .iter()
        .map(|s| (s.message_id.as_str(), s.attempt))
        .collect();
    let at = |id: &str, attempt: u32| {
        order
            .iter()
            .position(|x| *x == (id, attempt))
            .unwrap_or_else(|| panic!("{id} attempt {attempt} not seen: {order:?}"))
    };
    assert!(
        at("a-1", 2) < at("a-2", 1),
        "a-2 ran before a-1 was done: {order:?}"
    );
    for b_id in ["b-1", "b-2", "b-3"] {
        assert!(
            at(b_id, 1) < at("a-1", 2),
            "group b waited for group a's retry: {order:?}"
        );
    }
    assert!(
        at("b-1", 1) < at("b-2", 1) && at("b-2", 1) < at("b-3", 1),
        "{order:?}"
    );
    g.stop().await.unwrap();
}

/// A watch of a queue that is another FIFO queue's `RedrivePolicy` target
/// finds that queue through `ListDeadLetterSourceQueues`; a redrive goes
/// back to it with the message's group id and a fresh deduplication id, so
/// a second redrive within SQS's five minutes is not dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_dead_letter_is_watched_and_redriven_into_its_group() {
    let Some(b) = sqs_or_skip().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let (dlq, source) = b.with_dlq("fifo-dlq", true, 1).await;
    b.dead_letter(&dlq, &source, "m-g", "group-7", b"{\"g\": 7}")
        .await;
    let name = common::unique("fifo-watch");
    let mut spec = b.spec(&name, &dlq, Mode::Watch);
    // The original queue comes from the message: allowed as the server
    // allows its config's own queues.
    spec.redrive_allow = vec![source.clone()];
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(100)),
    );
    let w = common::start_watch_on(&b, spec.clone(), Arc::clone(&host), Faults::default()).await;
    let dl = common::wait_dead_letters(host.store(), &name, 1, PATIENCE)
        .await
        .remove(0);
    w.stop().await.unwrap();
    assert_eq!(dl.stage, Stage::Broker);
    assert_eq!(dl.reason, DeadLetterReason::MaxReceives);
    assert!(dl.attempts >= 1, "{dl:#?}");
    let src = dl.source.as_ref().expect("source");
    assert_eq!(
        src.queue, source,
        "the source queue, from ListDeadLetterSourceQueues"
    );
    assert_eq!(src.message_id, "m-g");
    assert_eq!(src.headers.get("tenant"), Some(&Value::from("acme")));
    assert_eq!(src.position.get("group_id"), Some(&Value::from("group-7")));
    assert_eq!(
        b.count(&dlq).await,
        0,
        "the watch deleted it from the dead-letter queue"
    );

    let mut set = SourceSet::default();
    set.insert(spec.clone(), common::TestBroker::connect(&b, &spec).await);
    let payload = b"{\"g\": 7}".to_vec();
    for _ in 0..2 {
        set.redrive(&dl, payload.clone())
            .await
            .expect("SQS takes it");
    }
    for _ in 0..2 {
        let (body, d) = b
            .take(&source, PATIENCE)
            .await
            .expect("each redrive is on the source queue");
        assert_eq!(body, payload);
        assert_eq!(d.position.get("group_id"), Some(&Value::from("group-7")));
        assert_eq!(d.header("x-lazaret-attempt").as_deref(), Some("0"));
        assert_eq!(d.header("x-lazaret-message-id").as_deref(), Some("m-g"));
    }
}

/// A watch of a dead-letter queue that two queues name cannot tell where a
/// message came from: without `redrive_to` it refuses to start, saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_queue_of_two_queues_needs_redrive_to() {
    let Some(b) = sqs_or_skip().await else { return };
    let (dlq, _) = b.with_dlq("shared-dlq", false, 3).await;
    let policy = json!({"deadLetterTargetArn": b.arn(&dlq).await, "maxReceiveCount": 3});
    b.create(
        &common::unique("second-source"),
        &[(QueueAttributeName::RedrivePolicy, policy.to_string())],
    )
    .await;
    let name = common::unique("shared-watch");
    let mut spec = b.spec(&name, &dlq, Mode::Watch);
    let err = lazaret_guard::connect(&spec).await.expect_err("refused");
    assert!(err.to_string().contains("redrive_to"), "{err}");
    spec.redrive_to = Some("orders".into());
    assert!(lazaret_guard::connect(&spec).await.is_ok());
}

/// lazaret dies after recording a FIFO retry and before holding the
/// message: the message comes back at the receive's visibility timeout,
/// the restarted guard resumes the recorded envelope, and the receive
/// lazaret caused is not charged as a crash (attempt 2, not 3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_record_and_the_hold_charges_nothing_more() {
    let Some(b) = sqs_or_skip().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fifo("fifo-crash").await;
    let name = common::unique("fifo-crash");
    let spec = b.spec(&name, &queue, Mode::Guard);
    let pol = common::policies(TYPE, 5, Duration::from_millis(200));
    b.produce(&queue, "m-c", b"{}", common::headers(json!({})))
        .await;

    let first = common::host(dir.path(), pol.clone());
    let log1 = Log::default();
    let crash = Faults {
        crash_after_write: Some(Arc::new(|d| d.message_id == "m-c")),
        ..Faults::default()
    };
    let g1 = common::start_guard(
        &b,
        spec.clone(),
        Arc::clone(&first),
        common::recording(&log1, |_| transient("busy")),
        crash,
    )
    .await;
    assert!(matches!(
        g1.join().await,
        Err(lazaret_guard::GuardError::Crashed)
    ));
    assert_eq!(
        first
            .store()
            .message_held(lazaret_store::MessageKey::of(
                name.clone(),
                "m-c",
                b"{}",
                None
            ))
            .await
            .unwrap(),
        Held::Retry,
        "the record was written before the crash"
    );
    first.store().close().await.unwrap();
    drop(first);

    let second = common::host(dir.path(), pol);
    let log2 = Log::default();
    let g2 = common::start_guard(
        &b,
        spec,
        Arc::clone(&second),
        common::recording(&log2, |_| Outcome::Success),
        Faults::default(),
    )
    .await;
    let seen = log2.wait_for(PATIENCE, |s| !s.is_empty()).await;
    assert_eq!((seen[0].message_id.as_str(), seen[0].attempt), ("m-c", 2));
    g2.stop().await.unwrap();
}

/// A FIFO queue whose `maxReceiveCount` is at most `attempts_max` would
/// dead-letter a message lazaret is still retrying: a warning says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_max_receive_count_below_the_budget_is_warned_about() {
    let Some(b) = sqs_or_skip().await else { return };
    let (_, fifo) = b.with_dlq("fifo-limit", true, 3).await;
    let (_, standard) = b.with_dlq("std-limit", false, 3).await;
    let spec = b.spec(&common::unique("limit"), &fifo, Mode::Guard);
    let broker = common::TestBroker::connect(&b, &spec).await;
    let warnings = broker.check_limits(5).await;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("maxReceiveCount 3"), "{warnings:?}");
    assert!(broker.check_limits(2).await.is_empty());
    let spec = b.spec(&common::unique("limit"), &standard, Mode::Guard);
    let broker = common::TestBroker::connect(&b, &spec).await;
    assert!(
        broker.check_limits(5).await.is_empty(),
        "a standard queue's retries are not receives"
    );
}

/// A proxy in front of the SQS endpoint that counts the requests of each
/// action (the `X-Amz-Target` header of SQS's JSON protocol).
struct CountingProxy {
    url: String,
    counts: Arc<Mutex<std::collections::BTreeMap<String, u64>>>,
    /// When set, the next `ReceiveMessage` is held until this is answered
    /// (or dropped).
    hold_receive: Arc<Mutex<Option<tokio::sync::oneshot::Receiver<()>>>>,
}

impl CountingProxy {
    async fn start(upstream: &str) -> CountingProxy {
        use axum::body::{Body, Bytes};
        use axum::http::{HeaderMap, Method, Uri};
        use axum::response::Response;

        let counts = Arc::new(Mutex::new(std::collections::BTreeMap::new()));
        let c = Arc::clone(&counts);
        let hold_receive = Arc::new(Mutex::new(None));
        let hold = Arc::clone(&hold_receive);
        let upstream = upstream.trim_end_matches('/').to_owned();
        let http = reqwest::Client::new();
        let forward = move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let (c, http, upstream) = (Arc::clone(&c), http.clone(), upstream.clone());
            let hold = Arc::clone(&hold);
            async move {
                let action = headers
                    .get("x-amz-target")
                    .and_then(|v| v.to_str().ok())
                    .map_or("other", |t| t.trim_start_matches("AmazonSQS."))
                    .to_owned();
                if action == "ReceiveMessage" {
                    let held = hold.lock().unwrap().take();
                    if let Some(until) = held {
                        let _ = until.await;
                    }
                }
                *c.lock().unwrap().entry(action).or_insert(0) += 1;
                let path = uri.path_and_query().map_or("/", |p| p.as_str());
                let mut req = http.request(method, format!("{upstream}{path}"));
                for (k, v) in &headers {
                    if k != "host" && k != "content-length" {
                        req = req.header(k, v);
                    }
                }
                let resp = req
                    .body(body)
                    .send()
                    .await
                    .expect("the SQS endpoint answers");
                let mut out = Response::builder().status(resp.status());
                for (k, v) in resp.headers() {
                    if k != "transfer-encoding" && k != "content-length" {
                        out = out.header(k, v);
                    }
                }
                out.body(Body::from(resp.bytes().await.expect("the answer's body")))
                    .expect("a response")
            }
        };
        let app = axum::Router::new().fallback(forward);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        CountingProxy {
            url: format!("http://{addr}"),
            counts,
            hold_receive,
        }
    }

    /// Requests that receive, delete or change visibility, and all of them
    /// by action.
    fn message_requests(&self) -> (u64, std::collections::BTreeMap<String, u64>) {
        let counts = self.counts.lock().unwrap().clone();
        let n = counts
            .iter()
            .filter(|(a, _)| {
                a.starts_with("ReceiveMessage")
                    || a.starts_with("DeleteMessage")
                    || a.starts_with("ChangeMessageVisibility")
            })
            .map(|(_, n)| n)
            .sum();
        (n, counts)
    }
}

/// At steady state, with the source's default settings, a message costs
/// at most 0.25 requests (receive, delete and visibility changes): deletes
/// go as `DeleteMessageBatch` and receives take 10 messages. Counted by a
/// proxy in front of the endpoint, over 500 messages that all succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_costs_at_most_a_quarter_request_at_steady_state() {
    const MESSAGES: usize = 500;
    let Some(b) = sqs_or_skip().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("sqs-requests").await;
    for chunk in (0..MESSAGES).collect::<Vec<_>>().chunks(10) {
        let entries = chunk.iter().map(|i| {
            aws_sdk_sqs::types::SendMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .message_body(format!("{{\"n\": {i}}}"))
                .message_attributes(
                    "message_id",
                    MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(format!("m-{i}"))
                        .build()
                        .unwrap(),
                )
                .build()
                .unwrap()
        });
        b.client
            .send_message_batch()
            .queue_url(&queue)
            .set_entries(Some(entries.collect()))
            .send()
            .await
            .expect("send the messages");
    }
    let proxy = CountingProxy::start(&b.url).await;
    let name = common::unique("sqs-requests");
    // The contract's defaults (16 in flight, 2 receives in flight), through
    // the proxy.
    let spec = SourceSpec::guard(&name, BrokerKind::Sqs, &proxy.url, &queue, TYPE);
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 5, Duration::from_millis(500)),
    );
    let log = Log::default();
    let handler = common::recording(&log, |_| Outcome::Success);
    let (faults, settled) = settled_log();
    let g = common::start_guard(&b, spec, Arc::clone(&host), handler, faults).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let n = settled
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, how)| *how == Settled::Succeeded)
            .count();
        if n >= MESSAGES {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} of {MESSAGES} messages settled in {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (requests, by_action) = proxy.message_requests();
    g.stop().await.unwrap();
    let per_message = requests as f64 / MESSAGES as f64;
    eprintln!(
        "{requests} requests for {MESSAGES} messages: {per_message:.3} per message ({by_action:?})"
    );
    assert!(
        requests * 4 <= MESSAGES as u64,
        "{requests} receive, delete and visibility requests for {MESSAGES} messages ({per_message:.3} per message, at most 0.25 allowed): {by_action:?}"
    );
    assert_eq!(b.count(&queue).await, 0, "every message was deleted");
}

/// Acks that share a `DeleteMessageBatch` are answered one by one: the
/// entries SQS reports failed (here two messages purged from the queue)
/// are retried alone and fail as `DeleteMessage` would, while the third
/// message of the batch is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_delete_that_fails_in_part_answers_each_ack() {
    let Some(b) = sqs_or_skip().await else { return };
    let queue = b.fresh_queue("sqs-partial").await;
    let proxy = CountingProxy::start(&b.url).await;
    let mut spec = b.spec(&common::unique("sqs-partial"), &queue, Mode::Guard);
    spec.url.clone_from(&proxy.url);
    let broker = lazaret_guard::sqs::connect(&spec).await.unwrap();
    let mut consumer = broker.consume().await.unwrap();
    let mut take = async || {
        tokio::time::timeout(PATIENCE, consumer.next())
            .await
            .expect("a message within the patience")
            .unwrap()
            .expect("a message")
    };
    for id in ["m-1", "m-2"] {
        b.produce(&queue, id, b"{}", common::headers(json!({})))
            .await;
    }
    let (first, second) = (take().await, take().await);
    b.client
        .purge_queue()
        .queue_url(&queue)
        .send()
        .await
        .unwrap();
    b.produce(&queue, "m-3", b"{}", common::headers(json!({})))
        .await;
    let third = take().await;
    assert_eq!(third.delivery.message_id, "m-3");
    let (r1, r2, r3) = tokio::join!(first.ack.ack(), second.ack.ack(), third.ack.ack());
    for r in [r1, r2] {
        let e = r.expect_err("a purged message's delete fails").to_string();
        assert!(e.contains("DeleteMessage from"), "{e}");
        assert!(e.contains("ReceiptHandleIsInvalid"), "{e}");
    }
    r3.expect("the third message's delete succeeds");
    let (_, by_action) = proxy.message_requests();
    assert_eq!(
        (
            by_action.get("DeleteMessageBatch"),
            by_action.get("DeleteMessage")
        ),
        (Some(&1), Some(&2)),
        "one batch for the three, then the two failed entries alone: {by_action:?}"
    );
    assert!(
        b.take(&queue, Duration::from_secs(2)).await.is_none(),
        "the third message was deleted"
    );
}

/// Two receives are in flight by default: while the first
/// `ReceiveMessage` hangs (held by the proxy), the second one brings the
/// message to a handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receive_does_not_idle_the_handlers() {
    let Some(b) = sqs_or_skip().await else { return };
    let queue = b.fresh_queue("sqs-slow-receive").await;
    let proxy = CountingProxy::start(&b.url).await;
    let (release, held) = tokio::sync::oneshot::channel();
    *proxy.hold_receive.lock().unwrap() = Some(held);
    let mut spec = b.spec(&common::unique("sqs-slow-receive"), &queue, Mode::Guard);
    spec.url.clone_from(&proxy.url);
    assert_eq!(spec.receives_in_flight, 2, "the default");
    b.produce(&queue, "m-1", b"{}", common::headers(json!({})))
        .await;
    let broker = lazaret_guard::sqs::connect(&spec).await.unwrap();
    let mut consumer = broker.consume().await.unwrap();
    let incoming = tokio::time::timeout(PATIENCE, consumer.next())
        .await
        .expect("the message, through the receive that is not held")
        .unwrap()
        .expect("a message");
    assert_eq!(incoming.delivery.message_id, "m-1");
    incoming.ack.ack().await.unwrap();
    let _ = release.send(());
}

/// Visibility changes due together share one
/// `ChangeMessageVisibilityBatch`: three deliveries' extensions, then
/// their hand-backs, after which SQS hands the three out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn visibility_changes_due_together_share_a_batch() {
    let Some(b) = sqs_or_skip().await else { return };
    let queue = b.fresh_queue("sqs-visibility").await;
    let proxy = CountingProxy::start(&b.url).await;
    let mut spec = b.spec(&common::unique("sqs-visibility"), &queue, Mode::Guard);
    spec.url.clone_from(&proxy.url);
    for id in ["m-1", "m-2", "m-3"] {
        b.produce(&queue, id, b"{}", common::headers(json!({})))
            .await;
    }
    let broker = lazaret_guard::sqs::connect(&spec).await.unwrap();
    let mut consumer = broker.consume().await.unwrap();
    let mut taken = Vec::new();
    while taken.len() < 3 {
        let incoming = tokio::time::timeout(PATIENCE, consumer.next())
            .await
            .expect("a message within the patience")
            .unwrap()
            .expect("a message");
        taken.push(incoming);
    }
    let (a, b2, c) = (&taken[0].ack, &taken[1].ack, &taken[2].ack);
    let (r1, r2, r3) = tokio::join!(a.progress(), b2.progress(), c.progress());
    for r in [r1, r2, r3] {
        r.expect("the extension succeeds");
    }
    let mut acks = taken.into_iter().map(|i| i.ack);
    let (x, y, z) = (
        acks.next().unwrap(),
        acks.next().unwrap(),
        acks.next().unwrap(),
    );
    let (r1, r2, r3) = tokio::join!(x.release(), y.release(), z.release());
    for r in [r1, r2, r3] {
        r.expect("the hand-back succeeds");
    }
    let (_, by_action) = proxy.message_requests();
    assert_eq!(
        (
            by_action.get("ChangeMessageVisibilityBatch"),
            by_action.get("ChangeMessageVisibility")
        ),
        (Some(&2), None),
        "one batch for the extensions, one for the hand-backs: {by_action:?}"
    );
    let mut again = Vec::new();
    while again.len() < 3 {
        let incoming = tokio::time::timeout(PATIENCE, consumer.next())
            .await
            .expect("the handed-back messages come back")
            .unwrap()
            .expect("a message");
        again.push(incoming.delivery.message_id.clone());
        incoming.ack.ack().await.unwrap();
    }
    again.sort();
    assert_eq!(again, vec!["m-1", "m-2", "m-3"]);
}
