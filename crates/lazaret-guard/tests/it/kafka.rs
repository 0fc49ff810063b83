//! Kafka against a real Kafka-API broker (`LAZARET_TEST_KAFKA_ADDR`, e.g.
//! `127.0.0.1:9092`; `.ci/run` starts tansu there): the shared scenarios,
//! through the [`TestBroker`] below, and what only the Kafka adapter has:
//! an offset committed only once every record before it is settled (across
//! a crash and a restart, nothing lost and nothing skipped), a Spring Kafka
//! dead-letter topic read back with its binary headers, a redrive
//! partitioned as Java's producer would. Every topic and group a test makes
//! is deleted when its [`Kafka`] is dropped.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use lazaret_core::DeadLetterReason;
use lazaret_guard::kafka::{KEY_HEADER, java_partition};
use lazaret_guard::{BrokerKind, Faults, Host, Mode, Outcome, Republish, Settled, SourceSpec};
use lazaret_store::{Held, Store};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer as _, StreamConsumer};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{Map, Value, json};

use crate::common::{self, Log, TestBroker};

/// The job type of every source here.
const TYPE: &str = "orders";
/// How long any one wait here may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(60);

/// A Kafka-API broker for the shared scenarios and the tests below; what it
/// created is deleted on drop.
pub struct Kafka {
    addr: String,
    admin: Option<AdminClient<DefaultClientContext>>,
    producer: Option<FutureProducer>,
    topics: Mutex<Vec<String>>,
    groups: Mutex<Vec<String>>,
}

impl Kafka {
    /// `None` (the test is skipped) without `LAZARET_TEST_KAFKA_ADDR`.
    pub fn new() -> Option<Kafka> {
        let addr = common::service("LAZARET_TEST_KAFKA_ADDR")?;
        let admin = ClientConfig::new()
            .set("bootstrap.servers", &addr)
            .create()
            .expect("an admin client");
        let producer = ClientConfig::new()
            .set("bootstrap.servers", &addr)
            .set("acks", "all")
            .set("partitioner", "murmur2_random")
            .create()
            .expect("a producer");
        Some(Kafka {
            addr,
            admin: Some(admin),
            producer: Some(producer),
            topics: Mutex::new(Vec::new()),
            groups: Mutex::new(Vec::new()),
        })
    }

    /// Creates a topic of `partitions` partitions, deleted on drop.
    async fn topic(&self, prefix: &str, partitions: i32) -> String {
        let name = common::unique(&format!("lz-{prefix}"));
        let created = self
            .admin
            .as_ref()
            .expect("alive until drop")
            .create_topics(
                &[NewTopic::new(&name, partitions, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .expect("create topics");
        for r in created {
            r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
        }
        self.topics.lock().unwrap().push(name.clone());
        name
    }

    /// Produces one record.
    async fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        value: &[u8],
        headers: &[(&str, Vec<u8>)],
    ) -> (i32, i64) {
        let mut h = OwnedHeaders::new();
        for (k, v) in headers {
            h = h.insert(Header {
                key: k,
                value: Some(v.as_slice()),
            });
        }
        let mut rec = FutureRecord::to(topic).payload(value).headers(h);
        if let Some(k) = key {
            rec = rec.key(k);
        }
        let d = self
            .producer
            .as_ref()
            .expect("alive until drop")
            .send(rec, Duration::from_secs(30))
            .await
            .unwrap_or_else(|(e, _)| panic!("produce to {topic}: {e}"));
        (d.partition, d.offset)
    }

    /// The offset `group` committed on partition 0 of `topic` (`None`: none).
    async fn committed(&self, group: &str, topic: &str) -> Option<i64> {
        self.committed_on(group, topic, 0).await
    }

    /// The offset `group` committed on `partition` of `topic`.
    async fn committed_on(&self, group: &str, topic: &str, partition: i32) -> Option<i64> {
        let addr = self.addr.clone();
        let (group, topic) = (group.to_owned(), topic.to_owned());
        tokio::task::spawn_blocking(move || {
            let c: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &addr)
                .set("group.id", &group)
                .create()
                .expect("a consumer");
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&topic, partition);
            let got = c
                .committed_offsets(tpl, Duration::from_secs(10))
                .expect("fetch committed offsets");
            match got.elements()[0].offset() {
                Offset::Offset(o) => Some(o),
                _ => None,
            }
        })
        .await
        .expect("the fetch")
    }

    /// The partition of `topic` (of `n`) that holds exactly one record.
    async fn partition_holding_one(&self, topic: &str, n: i32) -> i32 {
        let addr = self.addr.clone();
        let topic = topic.to_owned();
        tokio::task::spawn_blocking(move || {
            let c: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &addr)
                .create()
                .expect("a consumer");
            let holding: Vec<i32> = (0..n)
                .filter(|&p| {
                    let (lo, hi) = c
                        .fetch_watermarks(&topic, p, Duration::from_secs(10))
                        .expect("fetch watermarks");
                    hi - lo > 0
                })
                .collect();
            assert_eq!(holding.len(), 1, "partitions holding records: {holding:?}");
            holding[0]
        })
        .await
        .expect("the fetch")
    }
}

impl Drop for Kafka {
    /// Deletes the topics and groups the test made, even when it failed,
    /// once no client of this process knows them any more: librdkafka
    /// 2.12 crashes (a NULL topic name in its metadata cache) when tansu
    /// answers a metadata refresh for a topic deleted under a live client.
    fn drop(&mut self) {
        drop(self.producer.take());
        drop(self.admin.take());
        // Consumers leave their group synchronously when dropped; this
        // covers one still closing on another thread (a watch's last read).
        std::thread::sleep(Duration::from_millis(300));
        let topics = std::mem::take(&mut *self.topics.lock().unwrap_or_else(|p| p.into_inner()));
        let groups = std::mem::take(&mut *self.groups.lock().unwrap_or_else(|p| p.into_inner()));
        let addr = self.addr.clone();
        let done = std::thread::spawn(move || {
            let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                .set("bootstrap.servers", &addr)
                .create()
                .expect("an admin client");
            let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
            let t: Vec<&str> = topics.iter().map(String::as_str).collect();
            let g: Vec<&str> = groups.iter().map(String::as_str).collect();
            futures_executor_block_on(async {
                if !g.is_empty() {
                    let _ = admin.delete_groups(&g, &opts).await;
                }
                if !t.is_empty() {
                    if let Err(e) = admin.delete_topics(&t, &opts).await {
                        eprintln!("could not delete test topics {t:?}: {e}");
                    }
                }
            });
        });
        let _ = done.join();
    }
}

/// Runs a future to completion on a small runtime of its own (in `Drop`,
/// outside the test's runtime).
fn futures_executor_block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime")
        .block_on(f)
}

/// The broker of `LAZARET_TEST_KAFKA_ADDR`, or `None` (the test is
/// skipped): what `scenario_suite!` needs.
pub async fn kafka_or_skip() -> Option<Kafka> {
    Kafka::new()
}

/// Record headers as the adapter maps them (the key in `Lazaret-Kafka-Key`).
fn record_headers(m: &impl rdkafka::message::Message) -> Map<String, Value> {
    let mut out = Map::new();
    if let Some(hs) = m.headers() {
        for h in hs.iter() {
            out.insert(
                h.key.to_owned(),
                h.value
                    .map_or(Value::Null, lazaret_guard::message::bytes_value),
            );
        }
    }
    if let Some(k) = m.key() {
        out.insert(
            KEY_HEADER.into(),
            Value::String(lazaret_guard::kafka::encode_key(k)),
        );
    }
    out
}

impl TestBroker for Kafka {
    async fn fresh_queue(&self, prefix: &str) -> String {
        self.topic(prefix, 1).await
    }

    fn spec(&self, name: &str, queue: &str, mode: Mode) -> SourceSpec {
        let mut spec = match mode {
            Mode::Guard => SourceSpec::guard(name, BrokerKind::Kafka, &self.addr, queue, TYPE),
            Mode::Watch => SourceSpec::watch(name, BrokerKind::Kafka, &self.addr, queue, TYPE),
        };
        // A group per topic: one group shared by every test would rebalance
        // at each test's join. The same topic gives the same group, so a
        // restarted guard resumes from its predecessor's offsets.
        spec.group = format!("g-{queue}");
        self.groups.lock().unwrap().push(spec.group.clone());
        spec.concurrency = 4;
        spec
    }

    async fn produce(
        &self,
        queue: &str,
        message_id: &str,
        body: &[u8],
        headers: Map<String, Value>,
    ) {
        let mut hs: Vec<(&str, Vec<u8>)> = vec![("message_id", message_id.as_bytes().to_vec())];
        for (k, v) in &headers {
            hs.push((k.as_str(), lazaret_guard::message::value_bytes(v)));
        }
        let key = format!("key-{message_id}");
        self.send(queue, Some(key.as_bytes()), body, &hs).await;
    }

    /// What Spring Kafka's `DeadLetterPublishingRecoverer` writes to
    /// `<topic>.DLT` after the listener threw: the record's key, value and
    /// headers, plus `kafka_dlt-*` headers (partition and offset as
    /// big-endian binary integers).
    async fn broker_dead_letter(
        &self,
        prefix: &str,
        message_id: &str,
        body: &[u8],
    ) -> (String, String) {
        let original = self.topic(prefix, 1).await;
        let dlt = self.topic(&format!("{prefix}-dlt"), 1).await;
        let key = format!("key-{message_id}");
        let now = lazaret_guard::guard::now().as_millis();
        self.send(
            &dlt,
            Some(key.as_bytes()),
            body,
            &[
                ("message_id", message_id.as_bytes().to_vec()),
                ("tenant", b"acme".to_vec()),
                ("kafka_dlt-original-topic", original.as_bytes().to_vec()),
                ("kafka_dlt-original-partition", 0i32.to_be_bytes().to_vec()),
                ("kafka_dlt-original-offset", 41i64.to_be_bytes().to_vec()),
                (
                    "kafka_dlt-original-timestamp",
                    (now - 60_000).to_be_bytes().to_vec(),
                ),
                ("kafka_dlt-original-timestamp-type", b"CreateTime".to_vec()),
                ("kafka_dlt-original-consumer-group", b"shop".to_vec()),
                (
                    "kafka_dlt-exception-fqcn",
                    b"org.springframework.kafka.listener.ListenerExecutionFailedException"
                        .to_vec(),
                ),
                (
                    "kafka_dlt-exception-cause-fqcn",
                    b"java.lang.IllegalStateException".to_vec(),
                ),
                (
                    "kafka_dlt-exception-message",
                    b"Listener method 'pay' threw exception: card expired".to_vec(),
                ),
                (
                    "kafka_dlt-exception-stacktrace",
                    b"java.lang.IllegalStateException: card expired\n\tat shop.Payments.pay(Payments.java:42)"
                        .to_vec(),
                ),
            ],
        )
        .await;
        (dlt, original)
    }

    fn broker_reason(&self) -> DeadLetterReason {
        DeadLetterReason::ListenerFailed
    }

    async fn take_one(&self, queue: &str, wait: Duration) -> Option<(Vec<u8>, Map<String, Value>)> {
        let c: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.addr)
            .set("group.id", common::unique("take"))
            .set("enable.auto.commit", "false")
            .create()
            .expect("a consumer");
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(queue, 0, Offset::Beginning)
            .expect("a partition");
        c.assign(&tpl).expect("assign");
        let m = tokio::time::timeout(wait, c.recv()).await.ok()?.ok()?;
        Some((m.payload().unwrap_or_default().to_vec(), record_headers(&m)))
    }
}

crate::scenarios::scenario_suite!(crate::kafka::kafka_or_skip());

/// Records settle out of order; the group's offset moves only over the
/// settled prefix. Then lazaret crashes after holding a record's retry and
/// before its acknowledgement, with a later record already settled: the
/// restarted guard resumes before the held record, recognises it, delivers the
/// later one again (nothing skipped) and commits past both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offset_is_committed_only_after_every_record_before_it_settled() {
    let Some(k) = Kafka::new() else { return };
    let dir = tempfile::tempdir().unwrap();
    let topic = k.topic("prefix", 1).await;
    let name = common::unique("prefix");
    let spec = k.spec(&name, &topic, Mode::Guard);
    let group = spec.group.clone();
    let pol = common::policies(TYPE, 5, Duration::from_secs(1));
    for i in 0..4 {
        k.produce(&topic, &format!("m-{i}"), b"{}", Map::new())
            .await;
    }

    let first = common::host(dir.path(), pol.clone());
    let log1 = Log::default();
    let hold = Arc::new(tokio::sync::Notify::new());
    let release_m4 = Arc::new(tokio::sync::Notify::new());
    let settled: Arc<Mutex<Vec<(String, Settled)>>> = Arc::default();
    let s = Arc::clone(&settled);
    let faults = Faults {
        // m-4's retry is held, then lazaret "dies" before acknowledging it.
        crash_after_write: Some(Arc::new(|d| d.message_id == "m-4")),
        settled: Some(Arc::new(move |d, how| {
            s.lock().unwrap().push((d.message_id.clone(), how));
        })),
        ..Faults::default()
    };
    let (h0, h4) = (Arc::clone(&hold), Arc::clone(&release_m4));
    let l1 = log1.clone();
    let handler = Arc::new(lazaret_guard::handler_fn(
        move |call: lazaret_guard::OwnedCall| {
            let id = call.delivery.message_id.clone();
            l1.push(common::Seen {
                message_id: id.clone(),
                attempt: call.attempt,
                body: call.delivery.body.clone(),
            });
            let (h0, h4) = (Arc::clone(&h0), Arc::clone(&h4));
            async move {
                match id.as_str() {
                    "m-0" => {
                        h0.notified().await;
                        Outcome::Success
                    }
                    "m-4" => {
                        h4.notified().await;
                        Outcome::Failure(
                            lazaret_core::Failure::new("http_503", "busy")
                                .with_class(lazaret_core::FailureClass::Transient),
                        )
                    }
                    _ => Outcome::Success,
                }
            }
        },
    ));
    let g1 = common::start_guard(&k, spec.clone(), Arc::clone(&first), handler, faults).await;

    let is_settled = |id: &str| settled.lock().unwrap().iter().any(|(i, _)| i == id);
    wait_until(|| ["m-1", "m-2", "m-3"].iter().all(|id| is_settled(id))).await;
    assert_eq!(
        k.committed(&group, &topic).await,
        None,
        "m-0 still runs: no offset may be committed past it"
    );
    hold.notify_one();
    wait_until(|| is_settled("m-0")).await;
    assert_eq!(k.committed(&group, &topic).await, Some(4));

    k.produce(&topic, "m-4", b"{}", Map::new()).await;
    k.produce(&topic, "m-5", b"{}", Map::new()).await;
    wait_until(|| is_settled("m-5")).await;
    assert_eq!(
        k.committed(&group, &topic).await,
        Some(4),
        "m-5 is settled but m-4 before it is not"
    );
    release_m4.notify_one();
    assert!(matches!(
        g1.join().await,
        Err(lazaret_guard::GuardError::Crashed)
    ));
    assert_eq!(
        first
            .store()
            .message_held(lazaret_store::MessageKey::of(
                name.clone(),
                "m-4",
                b"{}",
                None
            ))
            .await
            .unwrap(),
        Held::Retry
    );
    assert_eq!(k.committed(&group, &topic).await, Some(4));
    first.store().close().await.unwrap();
    drop(first);

    let second = common::host(dir.path(), pol);
    let log2 = Log::default();
    let settled2: Arc<Mutex<Vec<(String, Settled)>>> = Arc::default();
    let s2 = Arc::clone(&settled2);
    let faults = Faults {
        settled: Some(Arc::new(move |d, how| {
            s2.lock().unwrap().push((d.message_id.clone(), how));
        })),
        ..Faults::default()
    };
    let g2 = common::start_guard(
        &k,
        spec,
        Arc::clone(&second),
        common::recording(&log2, |_| Outcome::Success),
        faults,
    )
    .await;
    let seen = log2
        .wait_for(PATIENCE, |s| {
            s.iter().any(|x| x.message_id == "m-5")
                && s.iter().any(|x| x.message_id == "m-4" && x.attempt == 2)
        })
        .await;
    wait_until(|| {
        settled2
            .lock()
            .unwrap()
            .contains(&("m-4".to_owned(), Settled::HeldAlready))
    })
    .await;
    wait_until_async(|| async { k.committed(&group, &topic).await == Some(6) }).await;
    assert!(
        seen.iter().all(|s| !s.message_id.starts_with("m-0")
            && !["m-1", "m-2", "m-3"].contains(&s.message_id.as_str())),
        "records before the committed offset came again: {seen:#?}"
    );
    g2.stop().await.unwrap();
}

/// A held retry that succeeds before the offset passes its record (a record
/// before it still runs) is not forgotten: after a crash the group reads the
/// record again, and the restarted guard recognises it and only
/// acknowledges it. Before the trace (`Broker::may_come_again`) the store
/// no longer knew it and the handler got it again from attempt 1, after
/// attempt 2: the attempt went backwards (the kill -9 battery's finding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_read_again_after_its_held_retry_succeeded_is_not_delivered_again() {
    let Some(k) = Kafka::new() else { return };
    let dir = tempfile::tempdir().unwrap();
    let topic = k.topic("trace", 1).await;
    let name = common::unique("trace");
    let spec = k.spec(&name, &topic, Mode::Guard);
    let group = spec.group.clone();
    let pol = common::policies(TYPE, 5, Duration::from_millis(200));
    k.produce(&topic, "m-0", b"{}", Map::new()).await;
    k.produce(&topic, "m-1", b"{}", Map::new()).await;

    let first = common::host(dir.path(), pol.clone());
    let log1 = Log::default();
    let hold = Arc::new(tokio::sync::Notify::new());
    let (faults, settled) = common::settled_log();
    let faults = Faults {
        // m-2's retry is held, then lazaret "dies" before acknowledging it.
        crash_after_write: Some(Arc::new(|d| d.message_id == "m-2")),
        ..faults
    };
    let h0 = Arc::clone(&hold);
    let l1 = log1.clone();
    let handler = Arc::new(lazaret_guard::handler_fn(
        move |call: lazaret_guard::OwnedCall| {
            let id = call.delivery.message_id.clone();
            let attempt = call.attempt;
            l1.push(common::Seen {
                message_id: id.clone(),
                attempt,
                body: call.delivery.body.clone(),
            });
            let h0 = Arc::clone(&h0);
            let busy = || {
                Outcome::Failure(
                    lazaret_core::Failure::new("http_503", "busy")
                        .with_class(lazaret_core::FailureClass::Transient),
                )
            };
            async move {
                match id.as_str() {
                    "m-0" => {
                        h0.notified().await;
                        Outcome::Success
                    }
                    "m-1" if attempt == 1 => busy(),
                    "m-2" => busy(),
                    _ => Outcome::Success,
                }
            }
        },
    ));
    let g1 = common::start_guard(&k, spec.clone(), Arc::clone(&first), handler, faults).await;
    log1.wait_for(PATIENCE, |s| {
        s.iter().any(|x| x.message_id == "m-1" && x.attempt == 2)
    })
    .await;
    wait_until(|| {
        settled
            .lock()
            .unwrap()
            .contains(&("m-1".to_owned(), Settled::Succeeded))
    })
    .await;
    assert_eq!(
        k.committed(&group, &topic).await,
        None,
        "m-0 still runs: no offset may be committed past it"
    );
    let m1 = lazaret_store::MessageKey::of(name.clone(), "m-1", b"{}", None);
    let held_at_crash = first.store().message_held(m1.clone()).await.unwrap();
    // The crash: m-0 never finishes on this guard, nothing is committed.
    k.produce(&topic, "m-2", b"{}", Map::new()).await;
    assert!(matches!(
        g1.join().await,
        Err(lazaret_guard::GuardError::Crashed)
    ));
    hold.notify_one();
    assert_eq!(k.committed(&group, &topic).await, None);
    first.store().close().await.unwrap();
    drop(first);

    let second = common::host(dir.path(), pol);
    let log2 = Log::default();
    let (faults, settled2) = common::settled_log();
    let g2 = common::start_guard(
        &k,
        spec,
        Arc::clone(&second),
        common::recording(&log2, |_| Outcome::Success),
        faults,
    )
    .await;
    log2.wait_for(PATIENCE, |s| {
        s.iter().any(|x| x.message_id == "m-0")
            && s.iter().any(|x| x.message_id == "m-2" && x.attempt == 2)
    })
    .await;
    wait_until_async(|| async { k.committed(&group, &topic).await == Some(3) }).await;
    let again: Vec<_> = log2
        .all()
        .into_iter()
        .filter(|s| s.message_id == "m-1")
        .collect();
    assert!(
        again.is_empty(),
        "m-1 succeeded at attempt 2 and was delivered again: {again:#?}\nfirst guard: {:#?}",
        log1.all()
    );
    assert!(
        settled2
            .lock()
            .unwrap()
            .contains(&("m-1".to_owned(), Settled::HeldAlready)),
        "m-1 read again is acknowledged as held already"
    );
    assert_eq!(
        held_at_crash,
        Held::Retry,
        "m-1's retry succeeded, but the group could read it again: its trace was kept"
    );
    // Once the offset passed it, the trace goes.
    wait_until_async(|| async {
        second.store().message_held(m1.clone()).await.unwrap() == Held::Nothing
    })
    .await;
    g2.stop().await.unwrap();
}

/// Two guards in one group. The first takes every record and, past its
/// fifth, holds them unfinished until the second guard has been given a
/// partition by the rebalance its joining causes and delivered from it.
/// Every record is delivered (at least once), and in the end each
/// partition's committed offset is its end: nothing lost, nothing skipped,
/// whatever the first guard acknowledged after it lost the partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebalance_loses_and_skips_no_record() {
    let Some(k) = Kafka::new() else { return };
    let (dir_a, dir_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let topic = k.topic("rebalance", 2).await;
    let mut spec = k.spec(&common::unique("rebalance"), &topic, Mode::Guard);
    let group = spec.group.clone();
    let mut ends = [0i64; 2];
    for i in 0..40 {
        let (p, _) = k
            .send(
                &topic,
                Some(format!("k-{i}").as_bytes()),
                b"{}",
                &[("message_id", format!("r-{i}").into_bytes())],
            )
            .await;
        ends[usize::try_from(p).expect("partition 0 or 1")] += 1;
    }
    assert!(
        ends.iter().all(|&n| n > 0),
        "both partitions hold records: {ends:?}"
    );
    let pol = common::policies(TYPE, 3, Duration::from_millis(100));
    let (all, log_b) = (Log::default(), Log::default());
    let (b_delivered, b_rx) = tokio::sync::watch::channel(false);
    let seen_by_a = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (l, n) = (all.clone(), Arc::clone(&seen_by_a));
    let handler_a = Arc::new(lazaret_guard::handler_fn(
        move |call: lazaret_guard::OwnedCall| {
            l.push(common::Seen {
                message_id: call.delivery.message_id.clone(),
                attempt: call.attempt,
                body: call.delivery.body.clone(),
            });
            let hold = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst) >= 5;
            let mut rx = b_rx.clone();
            async move {
                if hold {
                    let _ = rx.wait_for(|b| *b).await;
                }
                Outcome::Success
            }
        },
    ));
    // Free slots keep the first guard reading, and so taking part in the
    // rebalance, while it holds its records.
    spec.concurrency = 64;
    let a = common::start_guard(
        &k,
        spec.clone(),
        common::host(dir_a.path(), pol.clone()),
        handler_a,
        Faults::default(),
    )
    .await;
    all.wait_for(PATIENCE, |s| s.len() >= 6).await;
    let both = all.clone();
    let b = common::start_guard(
        &k,
        spec,
        common::host(dir_b.path(), pol),
        common::recording(&log_b, move |s| {
            both.push(s.clone());
            Outcome::Success
        }),
        Faults::default(),
    )
    .await;
    log_b.wait_for(PATIENCE, |s| !s.is_empty()).await;
    let _ = b_delivered.send(true);
    all.wait_for(PATIENCE, |s| common::counts(s).len() == 40)
        .await;
    for (p, end) in ends.iter().enumerate() {
        let p = i32::try_from(p).expect("0 or 1");
        wait_until_async(|| async { k.committed_on(&group, &topic, p).await == Some(*end) }).await;
    }
    a.stop().await.unwrap();
    b.stop().await.unwrap();
}

/// A Spring Kafka dead-letter record, binary headers and all, becomes a
/// readable dead letter: the cause's class as its kind, the stack trace,
/// the original coordinates; its redrive goes to the original topic with
/// the same key and without Spring's headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spring_dead_letter_topic_is_read_with_its_exception_and_coordinates() {
    let Some(k) = Kafka::new() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (dlt, original) = k
        .broker_dead_letter("spring", "order-9", b"{\"n\": 9}")
        .await;
    let name = common::unique("spring");
    let mut spec = k.spec(&name, &dlt, Mode::Watch);
    // The original queue comes from the message: allowed as the server
    // allows its config's own queues.
    spec.redrive_allow = vec![original.clone()];
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(100)),
    );
    let w = common::start_watch_on(&k, spec.clone(), Arc::clone(&host), Faults::default()).await;
    let dl = common::wait_dead_letters(host.store(), &name, 1, PATIENCE)
        .await
        .remove(0);
    w.stop().await.unwrap();
    assert_eq!(dl.reason, DeadLetterReason::ListenerFailed);
    let e = dl.error.as_ref().expect("the exception");
    assert_eq!(e.kind.as_str(), "java.lang.IllegalStateException");
    assert_eq!(
        e.message,
        "Listener method 'pay' threw exception: card expired"
    );
    assert!(
        e.traceback
            .as_deref()
            .is_some_and(|t| t.contains("Payments.java:42")),
        "{e:?}"
    );
    let src = dl.source.as_ref().expect("source");
    assert_eq!(src.broker, "kafka");
    assert_eq!(src.queue, original);
    assert_eq!(src.message_id, "order-9");
    assert_eq!(src.position["topic"], json!(original));
    assert_eq!(src.position["partition"], json!(0));
    assert_eq!(src.position["offset"], json!(41));
    assert_eq!(src.headers.get(KEY_HEADER), Some(&json!("key-order-9")));
    assert_eq!(src.headers.get("tenant"), Some(&json!("acme")));
    assert!(
        src.headers.keys().all(|h| !h.starts_with("kafka_dlt-")),
        "{:?}",
        src.headers
    );

    let mut set = lazaret_guard::SourceSet::default();
    set.insert(spec.clone(), k.connect(&spec).await);
    set.redrive(&dl, b"{\"n\": 9}".to_vec())
        .await
        .expect("acks=all");
    let c: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &k.addr)
        .set("group.id", common::unique("take"))
        .create()
        .expect("a consumer");
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&original, 0, Offset::Beginning)
        .unwrap();
    c.assign(&tpl).unwrap();
    let m = tokio::time::timeout(PATIENCE, c.recv())
        .await
        .expect("the redrive arrives")
        .expect("read");
    assert_eq!(m.key(), Some(&b"key-order-9"[..]));
    assert_eq!(m.payload(), Some(&b"{\"n\": 9}"[..]));
    let hs = record_headers(&m);
    assert_eq!(hs.get("x-lazaret-attempt"), Some(&json!("0")));
    assert_eq!(hs.get("x-lazaret-message-id"), Some(&json!("order-9")));
    assert_eq!(hs.get("tenant"), Some(&json!("acme")));
    assert!(hs.keys().all(|h| !h.starts_with("kafka_dlt-")), "{hs:?}");
}

/// A redrive's record lands on the partition Java's producer picks for its
/// key: the partitions below are Java's, from the murmur2 values of
/// `UtilsTest.testMurmur2` (`toPositive(h) % 6`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_lands_on_the_partition_java_would_pick() {
    let Some(k) = Kafka::new() else { return };
    let spec_topic = k.topic("keyed-src", 1).await;
    let spec = k.spec(&common::unique("keyed"), &spec_topic, Mode::Guard);
    let broker = k.connect(&spec).await;
    // (key, Java's murmur2 of it, its partition of 6).
    let cases: [(&str, i32, i32); 4] = [
        ("foobar", -790_332_482, 0),
        ("a-little-bit-long-string", -985_981_536, 2),
        ("abc", 479_470_107, 3),
        ("a-little-bit-longer-string", -1_486_304_829, 5),
    ];
    for (key, hash, want) in cases {
        assert_eq!(
            (hash & 0x7fff_ffff) % 6,
            want,
            "the table itself, for {key}"
        );
        assert_eq!(java_partition(key.as_bytes(), 6), want, "{key}");
        let topic = k.topic("keyed", 6).await;
        let mut headers = Map::new();
        headers.insert(
            KEY_HEADER.into(),
            json!(lazaret_guard::kafka::encode_key(key.as_bytes())),
        );
        broker
            .publish(Republish {
                queue: topic.clone(),
                body: b"{}".to_vec(),
                content_type: None,
                headers,
                message_id: format!("m-{key}"),
                dedup_id: String::new(),
                position: Value::Null,
            })
            .await
            .expect("acks=all");
        assert_eq!(
            k.partition_holding_one(&topic, 6).await,
            want,
            "key {key:?}"
        );
    }
}

/// Waits until `f` holds (at most [`PATIENCE`]).
async fn wait_until(f: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until `f` holds (at most [`PATIENCE`]).
async fn wait_until_async<F: std::future::Future<Output = bool>>(f: impl Fn() -> F) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !f().await {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {PATIENCE:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
