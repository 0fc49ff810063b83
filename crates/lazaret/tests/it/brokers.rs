//! A queue of its own on any of the five brokers, for the scenarios run on
//! each of them (`source_nodes.rs`): made fresh, given as a `[[sources]]`
//! entry, published to as a team's producer would, and removed when
//! dropped. RabbitMQ's queues remove themselves (`x-expires`).
//!
//! Each broker is found through its `LAZARET_TEST_*` variable; without it
//! the test is skipped with a message (a failure under `CI=true`).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lazaret_guard::sqs::sdk::Client as SqsClient;
use lazaret_guard::sqs::sdk::types::MessageAttributeValue;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

use crate::team_handler::service;

/// The brokers lazaret guards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    RabbitMq,
    Redis,
    Nats,
    Kafka,
    Sqs,
}

impl Kind {
    /// The `broker` word of the config.
    pub fn word(self) -> &'static str {
        match self {
            Kind::RabbitMq => "rabbitmq",
            Kind::Redis => "redis",
            Kind::Nats => "nats",
            Kind::Kafka => "kafka",
            Kind::Sqs => "sqs",
        }
    }

    /// The broker's URL from its variable, or `None` after saying `test`
    /// is skipped.
    fn url(self, test: &str) -> Option<String> {
        let (var, how) = match self {
            Kind::RabbitMq => (
                "LAZARET_TEST_AMQP_URL",
                "amqp://guest:guest@127.0.0.1:5672/%2f",
            ),
            Kind::Redis => ("LAZARET_TEST_REDIS_URL", "redis://127.0.0.1:6379"),
            Kind::Nats => (
                "LAZARET_TEST_NATS_URL",
                "nats://127.0.0.1:4222, with JetStream",
            ),
            Kind::Kafka => (
                "LAZARET_TEST_KAFKA_ADDR",
                "127.0.0.1:9092, a Kafka-API broker",
            ),
            Kind::Sqs => (
                "LAZARET_TEST_SQS_URL",
                "http://127.0.0.1:4566, moto_server, with the AWS_* variables",
            ),
        };
        service(var, how, test)
    }
}

/// How the test talks to the broker.
enum Conn {
    /// The connection is kept for its channel's sake.
    RabbitMq {
        _conn: Box<lapin::Connection>,
        ch: lapin::Channel,
    },
    Redis(redis::aio::MultiplexedConnection),
    Nats(async_nats::jetstream::Context),
    Kafka(FutureProducer),
    Sqs(SqsClient),
}

/// A fresh queue (RabbitMQ quorum queue, Redis stream, JetStream stream
/// with one subject of its name, Kafka topic, SQS standard queue).
pub struct Queue {
    pub kind: Kind,
    /// The source's `url`.
    pub url: String,
    /// The source's `queue`: the queue, stream, topic or queue URL.
    pub name: String,
    /// The source's `group` (JetStream durable, Redis or Kafka group).
    pub group: String,
    conn: Conn,
}

/// A name no other test, or earlier run, uses: letters, digits and `-`.
fn unique(prefix: &str) -> String {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos();
    format!(
        "lz-{prefix}-{}-{}-{nanos}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

impl Queue {
    /// A fresh queue on `kind`'s broker (a Kafka topic of `partitions`
    /// partitions), or `None` after saying `test` is skipped.
    pub async fn fresh(kind: Kind, prefix: &str, partitions: i32, test: &str) -> Option<Queue> {
        let url = kind.url(test)?;
        let name = unique(prefix);
        let group = format!("{name}-g");
        let (name, conn) = match kind {
            Kind::RabbitMq => {
                let (conn, ch, queue) = crate::sources::amqp_queue(&url, prefix).await;
                (
                    queue,
                    Conn::RabbitMq {
                        _conn: Box::new(conn),
                        ch,
                    },
                )
            }
            Kind::Redis => {
                let client = redis::Client::open(url.as_str()).expect("a valid Redis URL");
                let con = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("Redis answers");
                (name, Conn::Redis(con))
            }
            Kind::Nats => {
                let client = async_nats::connect(url.as_str())
                    .await
                    .expect("connect to NATS");
                let js = async_nats::jetstream::new(client);
                js.create_stream(async_nats::jetstream::stream::Config {
                    name: name.clone(),
                    subjects: vec![name.clone()],
                    ..Default::default()
                })
                .await
                .expect("create the stream");
                (name, Conn::Nats(js))
            }
            Kind::Kafka => {
                let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
                    .set("bootstrap.servers", &url)
                    .create()
                    .expect("an admin client");
                for r in admin
                    .create_topics(
                        &[NewTopic::new(&name, partitions, TopicReplication::Fixed(1))],
                        &AdminOptions::new(),
                    )
                    .await
                    .expect("create the topic")
                {
                    r.unwrap_or_else(|(t, e)| panic!("create topic {t}: {e}"));
                }
                let producer: FutureProducer = ClientConfig::new()
                    .set("bootstrap.servers", &url)
                    .set("acks", "all")
                    .set("linger.ms", "1")
                    .create()
                    .expect("a producer");
                (name, Conn::Kafka(producer))
            }
            Kind::Sqs => {
                let client = lazaret_guard::sqs::client(&url)
                    .await
                    .expect("an SQS client");
                let queue = client
                    .create_queue()
                    .queue_name(&name)
                    .send()
                    .await
                    .expect("create the queue")
                    .queue_url()
                    .expect("its url")
                    .to_owned();
                (queue, Conn::Sqs(client))
            }
        };
        Some(Queue {
            kind,
            url,
            name,
            group,
            conn,
        })
    }

    /// The `[[sources]]` keys naming this queue: `broker`, `url`, `queue`
    /// and `group`.
    pub fn source_keys(&self) -> String {
        format!(
            "broker = \"{}\"\nurl = \"{}\"\nqueue = \"{}\"\ngroup = \"{}\"\n",
            self.kind.word(),
            self.url,
            self.name,
            self.group
        )
    }

    /// Publishes `body` with the message id `id` the broker's own way
    /// (RabbitMQ `message_id`, the Redis field `message_id`, `Nats-Msg-Id`,
    /// the Kafka header `message_id` with the id as key, the SQS attribute
    /// `message_id`), and waits for the broker to have it.
    pub async fn publish(&self, id: &str, body: &str) {
        match &self.conn {
            Conn::RabbitMq { ch, .. } => {
                ch.basic_publish(
                    "",
                    &self.name,
                    lapin::options::BasicPublishOptions::default(),
                    body.as_bytes(),
                    lapin::BasicProperties::default()
                        .with_message_id(id.into())
                        .with_content_type("application/json".into()),
                )
                .await
                .expect("publish")
                .await
                .expect("published");
            }
            Conn::Redis(con) => {
                let mut con = con.clone();
                let _: String = redis::cmd("XADD")
                    .arg(&self.name)
                    .arg("*")
                    .arg("body")
                    .arg(body)
                    .arg("message_id")
                    .arg(id)
                    .query_async(&mut con)
                    .await
                    .expect("XADD");
            }
            Conn::Nats(js) => {
                let mut headers = async_nats::HeaderMap::new();
                headers.insert("Nats-Msg-Id", id);
                js.publish_with_headers(self.name.clone(), headers, body.to_owned().into())
                    .await
                    .expect("publish")
                    .await
                    .expect("the PubAck");
            }
            Conn::Kafka(producer) => {
                let headers = OwnedHeaders::new().insert(Header {
                    key: "message_id",
                    value: Some(id),
                });
                producer
                    .send(
                        FutureRecord::to(&self.name)
                            .key(id)
                            .payload(body)
                            .headers(headers),
                        Duration::from_secs(30),
                    )
                    .await
                    .unwrap_or_else(|(e, _)| panic!("produce: {e}"));
            }
            Conn::Sqs(client) => {
                client
                    .send_message()
                    .queue_url(&self.name)
                    .message_body(body)
                    .message_attributes(
                        "message_id",
                        MessageAttributeValue::builder()
                            .data_type("String")
                            .string_value(id)
                            .build()
                            .expect("an attribute"),
                    )
                    .send()
                    .await
                    .expect("send");
            }
        }
    }

    /// Whether a node whose log is `output` has its source of this queue
    /// taking messages: connected, and on Kafka holding partitions of the
    /// topic after the group's last rebalance (the group settled with this
    /// node in it).
    pub fn ready(&self, output: &str) -> bool {
        match self.kind {
            Kind::Kafka => output
                .lines()
                .rev()
                .find(|l| l.contains("the group assigned this node partitions"))
                .is_some_and(|l| !l.contains("partitions []")),
            k => output.contains(&format!("connected to {}", k.word())),
        }
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        let (kind, url, name, group) = (
            self.kind,
            self.url.clone(),
            self.name.clone(),
            self.group.clone(),
        );
        let sqs = match &self.conn {
            Conn::Sqs(c) => Some(c.clone()),
            _ => None,
        };
        if kind == Kind::RabbitMq {
            return; // `x-expires` removes it.
        }
        crate::harness::clean_up(move || async move {
            match kind {
                Kind::RabbitMq => {}
                Kind::Redis => {
                    if let Ok(client) = redis::Client::open(url.as_str()) {
                        if let Ok(mut con) = client.get_multiplexed_async_connection().await {
                            let _: Result<i64, _> =
                                redis::cmd("DEL").arg(&name).query_async(&mut con).await;
                        }
                    }
                }
                Kind::Nats => {
                    if let Ok(client) = async_nats::connect(url.as_str()).await {
                        let _ = async_nats::jetstream::new(client)
                            .delete_stream(&name)
                            .await;
                    }
                }
                Kind::Kafka => {
                    let admin: Result<AdminClient<DefaultClientContext>, _> =
                        ClientConfig::new().set("bootstrap.servers", &url).create();
                    if let Ok(admin) = admin {
                        let opts =
                            AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
                        let _ = admin.delete_groups(&[&group], &opts).await;
                        let _ = admin.delete_topics(&[&name], &opts).await;
                    }
                }
                Kind::Sqs => {
                    if let Some(client) = sqs {
                        let _ = client.delete_queue().queue_url(&name).send().await;
                    }
                }
            }
        });
    }
}
