//! Kafka (tansu) under faults: the broker's client sockets destroyed
//! (`ss -K`), a pause past the group's session timeout, and a restart.
//! After the pause tansu 0.6's group coordinator names the expired member
//! as the group's leader for good; the guard's consumer notices that the
//! group owes it a partition and joins again as a new member, which gets
//! the group going (`src/kafka.rs`, "Stalled groups"). The machine's tansu
//! keeps everything in memory: a restart loses the topic, its records and
//! the group's committed offsets; the battery creates the topic again, as
//! the team's setup would. Records the guard had not received by then are
//! lost by the broker and counted apart.

use std::time::Duration;

use futures_util::future::join_all;
use lazaret_guard::{BrokerKind, SourceSpec};
use lazaret_testkit::faults::{Service, kill_sockets};
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::battery::{self, DELIVERY_TIMEOUT, FaultBroker, TYPE};

struct Kafka {
    addr: String,
}

impl Kafka {
    fn admin(&self) -> AdminClient<DefaultClientContext> {
        ClientConfig::new()
            .set("bootstrap.servers", &self.addr)
            .create()
            .expect("an admin client")
    }

    async fn create(&self, topic: &str) {
        let created = self
            .admin()
            .create_topics(
                &[NewTopic::new(topic, 1, TopicReplication::Fixed(1))],
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await
            .expect("create the topic");
        for r in created {
            r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
        }
    }
}

impl FaultBroker for Kafka {
    const SERVICE: Service = Service::Tansu;
    const RESTART_KEEPS: bool = false;

    async fn queue(&self, name: &str) -> String {
        self.create(name).await;
        name.to_owned()
    }

    fn spec(&self, name: &str, queue: &str) -> SourceSpec {
        let mut spec = SourceSpec::guard(name, BrokerKind::Kafka, &self.addr, queue, TYPE);
        spec.group = format!("g-{queue}");
        spec.delivery_timeout = DELIVERY_TIMEOUT;
        spec
    }

    async fn publish(
        &self,
        queue: &str,
        batch: &[(String, Vec<u8>)],
        confirmed: &mut dyn FnMut(usize),
    ) -> Result<(), String> {
        let producer: FutureProducer = ClientConfig::new()
            .set("bootstrap.servers", &self.addr)
            .set("acks", "all")
            .create()
            .map_err(|e| format!("a producer: {e}"))?;
        for (n, part) in batch.chunks(500).enumerate() {
            let sends = part.iter().map(|(id, body)| {
                let headers = OwnedHeaders::new().insert(Header {
                    key: "message_id",
                    value: Some(id.as_bytes()),
                });
                producer.send(
                    FutureRecord::<(), _>::to(queue)
                        .payload(body.as_slice())
                        .headers(headers),
                    Duration::from_secs(30),
                )
            });
            for (i, r) in join_all(sends).await.into_iter().enumerate() {
                r.map_err(|(e, _)| format!("produce {}: {e}", part[i].0))?;
                confirmed(n * 500 + i);
            }
        }
        Ok(())
    }

    fn kill_connections(&self, _source: &str) -> Result<usize, String> {
        kill_sockets(Service::Tansu.port())
    }

    async fn after_restart(&self, queue: &str) {
        self.create(queue).await;
    }

    async fn remove(&self, queue: &str) {
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
        let admin = self.admin();
        let _ = admin.delete_groups(&[&format!("g-{queue}")], &opts).await;
        let _ = admin.delete_topics(&[queue], &opts).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kafka_under_socket_kills_a_pause_and_a_restart() {
    if !battery::enabled("kafka_under_socket_kills_a_pause_and_a_restart") {
        return;
    }
    let Some(addr) = lazaret_testkit::service(
        "LAZARET_TEST_KAFKA_ADDR",
        "127.0.0.1:9092",
        "the Kafka fault battery",
    ) else {
        return;
    };
    battery::run(&Kafka { addr }, "kafka").await;
}
