//! A Kafka `[[sources]]` entry end to end: `lazaret serve` guarding a topic
//! (`broker = "kafka"`, `url` host:port, `queue` the topic, `group` the
//! group id) and delivering to a handler in this test; the record's key and
//! headers as the contract maps them, a refused record quarantined with
//! its partition and offset, and a redrive through the API that produces it
//! back to the topic with the same key.
//!
//! Needs `LAZARET_TEST_KAFKA_ADDR` (`127.0.0.1:9092`; `.ci/run` starts
//! tansu there); without it the test is skipped with a message, and fails
//! under `CI=true`. The topic and group it makes are deleted at the end.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer as _, StreamConsumer};
use rdkafka::message::{Header, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{Value, json};

use crate::harness::{EVENTUALLY, QUICK, Server};
use crate::team_handler::{Handler, ORDER_1, ORDER_2, service};

const SOURCE: &str = "orders";

/// The broker's address, or `None` after saying the test is skipped.
fn kafka_addr(test: &str) -> Option<String> {
    service(
        "LAZARET_TEST_KAFKA_ADDR",
        "127.0.0.1:9092, a Kafka-API broker",
        test,
    )
}

/// A topic of its own (one partition) and a group, deleted when dropped.
struct Topic {
    addr: String,
    name: String,
    group: String,
}

impl Topic {
    async fn new(addr: &str) -> Topic {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_nanos();
        let name = format!("lz-sources-{}-{nanos}", std::process::id());
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", addr)
            .create()
            .expect("an admin client");
        for r in admin
            .create_topics(
                &[NewTopic::new(&name, 1, TopicReplication::Fixed(1))],
                &AdminOptions::new(),
            )
            .await
            .expect("create the topic")
        {
            r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
        }
        Topic {
            addr: addr.to_owned(),
            group: format!("{name}-g"),
            name,
        }
    }

    /// Produces as the team's producer would: a key, a JSON value, a
    /// message id header and one header of the team's own.
    async fn produce(&self, key: &str, message_id: &str, body: &str) {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &self.addr)
            .set("acks", "all")
            .create()
            .expect("a producer");
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "message_id",
                value: Some(message_id),
            })
            .insert(Header {
                key: "content-type",
                value: Some("application/json"),
            })
            .insert(Header {
                key: "tenant",
                value: Some("acme"),
            });
        producer
            .send(
                FutureRecord::to(&self.name)
                    .key(key)
                    .payload(body)
                    .headers(headers),
                Duration::from_secs(30),
            )
            .await
            .unwrap_or_else(|(e, _)| panic!("produce: {e}"));
    }

    /// The keys of every record on the topic, in order, once there are `n`.
    async fn keys(&self, n: usize) -> Vec<Vec<u8>> {
        let c: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.addr)
            .set("group.id", format!("{}-reader", self.name))
            .set("enable.auto.commit", "false")
            .create()
            .expect("a consumer");
        let mut tpl = TopicPartitionList::new();
        tpl.add_partition_offset(&self.name, 0, Offset::Beginning)
            .expect("a partition");
        c.assign(&tpl).expect("assign");
        let mut keys = Vec::new();
        while keys.len() < n {
            let m = tokio::time::timeout(EVENTUALLY, c.recv())
                .await
                .expect("the records arrive")
                .expect("read");
            keys.push(m.key().unwrap_or_default().to_vec());
        }
        keys
    }
}

impl Drop for Topic {
    fn drop(&mut self) {
        let (addr, name, group) = (self.addr.clone(), self.name.clone(), self.group.clone());
        crate::harness::clean_up(move || async move {
            let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                .set("bootstrap.servers", &addr)
                .create()
                .expect("an admin client");
            let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
            let reader = format!("{name}-reader");
            let _ = admin.delete_groups(&[&group, &reader], &opts).await;
            let _ = admin.delete_topics(&[&name], &opts).await;
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_kafka_topic_delivers_quarantines_and_redrives() {
    let test = "a_guarded_kafka_topic_delivers_quarantines_and_redrives";
    let Some(addr) = kafka_addr(test) else { return };
    let topic = Topic::new(&addr).await;
    let handler = Handler::broken();
    let deliver = handler.start().await;
    let config = format!(
        r#"{QUICK}
[[sources]]
name = "{SOURCE}"
broker = "kafka"
url = "{addr}"
queue = "{queue}"
group = "{group}"
deliver = "{deliver}"
tenant_header = "tenant"
"#,
        queue = topic.name,
        group = topic.group,
    );
    let server = Server::start(&config).await;
    let api = server.api();
    // The line comes once the broker answered (a metadata request).
    server
        .wait_output(&format!("source {SOURCE}: guard kafka "))
        .await;

    // A healthy record: its value, its headers and its key.
    topic.produce("customer 7", "m1", ORDER_1).await;
    let seen = handler.deliveries_of_body(ORDER_1, 1, &server).await;
    let d = &seen[0];
    assert_eq!(d.header("content-type"), "application/json");
    assert_eq!(d.header("lazaret-attempt"), "1");
    assert_eq!(d.header("lazaret-message-id"), "m1");
    let broker_headers: Value =
        serde_json::from_str(&d.header("lazaret-headers")).expect("Lazaret-Headers is JSON");
    assert_eq!(
        broker_headers,
        json!({"message_id": "m1", "tenant": "acme", "Lazaret-Kafka-Key": "customer%207"})
    );

    // A refused record: one dead letter with its partition and offset.
    topic.produce("customer 9", "m2", ORDER_2).await;
    let deadline = Instant::now() + EVENTUALLY;
    let dl = loop {
        let items = api.dead_letters(&format!("source={SOURCE}")).await;
        if let Some(dl) = items.first() {
            break dl.clone();
        }
        assert!(
            Instant::now() < deadline,
            "no dead letter within {EVENTUALLY:?}\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(dl["reason"], "permanent", "{dl}");
    assert_eq!(dl["tenant"], "acme", "{dl}");
    assert_eq!(dl["idempotency_key"], format!("{SOURCE}:m2"), "{dl}");
    let source = &dl["source"];
    assert_eq!(source["broker"], "kafka", "{dl}");
    assert_eq!(source["queue"], topic.name.as_str(), "{dl}");
    assert_eq!(source["message_id"], "m2", "{dl}");
    assert_eq!(source["position"]["partition"], 0, "{dl}");
    assert_eq!(source["position"]["offset"], 1, "{dl}");
    assert!(source["position"]["timestamp"].is_i64(), "{dl}");
    assert_eq!(
        source["headers"]["Lazaret-Kafka-Key"], "customer%209",
        "{dl}"
    );

    // Fixed: a redrive through the API produces it back with its key; the
    // handler sees it afresh and the dead letter is gone.
    handler.mend();
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"ids": [dl["id"].clone()]}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["redriven"], 1, "{body}");
    let again = handler.deliveries_of_body(ORDER_2, 2, &server).await;
    assert_eq!(again[1].header("lazaret-attempt"), "1", "a fresh budget");
    assert_eq!(again[1].header("lazaret-message-id"), "m2");
    assert!(
        api.dead_letters(&format!("source={SOURCE}"))
            .await
            .is_empty()
    );
    let keys = topic.keys(3).await;
    assert_eq!(keys[2], b"customer 9", "the redrive keeps the key");
}
