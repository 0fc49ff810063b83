//! Sets a broker up as `docs/brokers.md` describes and puts demo orders on
//! it, for the configs in `examples/brokers/`:
//!
//! ```sh
//! cargo run -p lazaret-guard --example demo_orders -- rabbitmq
//! cargo run -p lazaret-guard --example demo_orders -- nats
//! cargo run -p lazaret-guard --example demo_orders -- redis
//! cargo run -p lazaret-guard --example demo_orders -- sqs
//! cargo run -p lazaret-guard --example demo_orders -- kafka
//! ```
//!
//! Each puts four orders on `orders` (a RabbitMQ quorum queue dead-lettering
//! into `orders.dlq`; the JetStream stream `ORDERS` with its advisories
//! captured in `ORDERS_DEAD`; the Redis stream `orders`; the SQS queue
//! `orders` whose `RedrivePolicy` names `orders-dlq`; the Kafka topic
//! `orders`, keyed by customer, beside `orders.DLT` holding one record as
//! Spring Kafka's `DeadLetterPublishingRecoverer` writes it): a good one, one
//! that fails twice before it succeeds, one that can never succeed (no
//! amount) and one whose downstream is busy. `examples/python_handler.py`
//! answers each as its docstring says.

// What it put where is for the person running it.
#![allow(clippy::print_stdout)]

use std::time::Duration;

use serde_json::json;

const ORDERS: [&str; 4] = [
    r#"{"order_id": "o-1", "amount": 42}"#,
    r#"{"order_id": "o-2", "amount": 7, "fail_attempts": 2}"#,
    r#"{"order_id": "o-3"}"#,
    r#"{"order_id": "o-4", "amount": 5, "busy": true}"#,
];

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let broker = std::env::args().nth(1).unwrap_or_default();
    match broker.as_str() {
        "rabbitmq" => rabbitmq().await?,
        "nats" => nats().await?,
        "redis" => redis().await?,
        "sqs" => sqs().await?,
        "kafka" => kafka().await?,
        _ => return Err("usage: demo_orders rabbitmq|nats|redis|kafka|sqs".into()),
    }
    println!(
        "put {} orders on {broker}; now watch lazaret dlq ls",
        ORDERS.len()
    );
    Ok(())
}

async fn rabbitmq() -> Result<(), Box<dyn std::error::Error>> {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{BasicProperties, Connection, ConnectionProperties};

    let url = std::env::var("AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    let props = ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current());
    let conn = Connection::connect(&url, props).await?;
    let ch = conn.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    ch.queue_declare("orders.dlq", durable, FieldTable::default())
        .await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert("x-delivery-limit".into(), AMQPValue::LongInt(20));
    args.insert(
        "x-dead-letter-exchange".into(),
        AMQPValue::LongString("".into()),
    );
    args.insert(
        "x-dead-letter-routing-key".into(),
        AMQPValue::LongString("orders.dlq".into()),
    );
    ch.queue_declare("orders", durable, args).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    for (i, order) in ORDERS.iter().enumerate() {
        ch.basic_publish(
            "",
            "orders",
            BasicPublishOptions::default(),
            order.as_bytes(),
            BasicProperties::default()
                .with_message_id(format!("order-{}", i + 1).into())
                .with_content_type("application/json".into())
                .with_delivery_mode(2),
        )
        .await?
        .await?;
    }
    Ok(())
}

async fn nats() -> Result<(), Box<dyn std::error::Error>> {
    use async_nats::jetstream::{self, stream};

    let url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let js = jetstream::new(async_nats::connect(&url).await?);
    js.get_or_create_stream(stream::Config {
        name: "ORDERS".into(),
        subjects: vec!["orders".into()],
        ..Default::default()
    })
    .await?;
    js.get_or_create_stream(stream::Config {
        name: "ORDERS_DEAD".into(),
        subjects: vec![
            "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.ORDERS.*".into(),
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.ORDERS.*".into(),
        ],
        ..Default::default()
    })
    .await?;
    for (i, order) in ORDERS.iter().enumerate() {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("order-{}", i + 1).as_str());
        headers.insert("Content-Type", "application/json");
        js.publish_with_headers("orders", headers, order.as_bytes().to_vec().into())
            .await?
            .await?;
    }
    Ok(())
}

async fn redis() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let client = redis::Client::open(url)?;
    let mut con = tokio::time::timeout(
        Duration::from_secs(5),
        client.get_multiplexed_async_connection(),
    )
    .await??;
    for (i, order) in ORDERS.iter().enumerate() {
        let _: String = redis::cmd("XADD")
            .arg("orders")
            .arg("*")
            .arg("body")
            .arg(*order)
            .arg("message_id")
            .arg(format!("order-{}", i + 1))
            .arg("content_type")
            .arg("application/json")
            .arg("shop")
            .arg(json!({"region": "eu"}).to_string())
            .query_async(&mut con)
            .await?;
    }
    Ok(())
}

/// The queues `examples/brokers/sqs.toml` names, on `SQS_URL` (moto's
/// server on 127.0.0.1:4566 by default), then the orders.
async fn sqs() -> Result<(), Box<dyn std::error::Error>> {
    use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName};
    let url = std::env::var("SQS_URL").unwrap_or_else(|_| "http://127.0.0.1:4566".into());
    let client = lazaret_guard::sqs::client(&url).await?;
    let dlq = client
        .create_queue()
        .queue_name("orders-dlq")
        .send()
        .await?;
    let dlq_url = dlq.queue_url().ok_or("no queue url")?;
    let arn = client
        .get_queue_attributes()
        .queue_url(dlq_url)
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await?
        .attributes()
        .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
        .ok_or("no queue arn")?;
    // Above crash_loop_max: on a standard queue only crashes are receives.
    let policy = json!({"deadLetterTargetArn": arn, "maxReceiveCount": 10});
    let orders = client
        .create_queue()
        .queue_name("orders")
        .attributes(QueueAttributeName::RedrivePolicy, policy.to_string())
        .send()
        .await?;
    let queue = orders.queue_url().ok_or("no queue url")?;
    let text = |v: &str| {
        MessageAttributeValue::builder()
            .data_type("String")
            .string_value(v)
            .build()
    };
    for (i, order) in ORDERS.iter().enumerate() {
        client
            .send_message()
            .queue_url(queue)
            .message_body(*order)
            .message_attributes("message_id", text(&format!("order-{}", i + 1))?)
            .message_attributes("content_type", text("application/json")?)
            .message_attributes("shop", text(&json!({"region": "eu"}).to_string())?)
            .send()
            .await?;
    }
    println!("queues: {queue} (guarded) and {dlq_url} (watched)");
    Ok(())
}

/// The topics `examples/brokers/kafka.toml` names, on `KAFKA_ADDR`
/// (127.0.0.1:9092 by default), then the orders and one Spring dead letter.
async fn kafka() -> Result<(), Box<dyn std::error::Error>> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use rdkafka::config::ClientConfig;
    use rdkafka::message::{Header, OwnedHeaders};
    use rdkafka::producer::{FutureProducer, FutureRecord};

    let addr = std::env::var("KAFKA_ADDR").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &addr)
        .create()?;
    // Either may exist from an earlier run: that is fine.
    let _ = admin
        .create_topics(
            &[
                NewTopic::new("orders", 3, TopicReplication::Fixed(1)),
                NewTopic::new("orders.DLT", 1, TopicReplication::Fixed(1)),
            ],
            &AdminOptions::new(),
        )
        .await?;
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &addr)
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .create()?;
    let send = |topic: &'static str, key: String, value: &'static str, headers: OwnedHeaders| {
        let producer = producer.clone();
        async move {
            producer
                .send(
                    FutureRecord::to(topic)
                        .key(&key)
                        .payload(value)
                        .headers(headers),
                    Duration::from_secs(30),
                )
                .await
                .map_err(|(e, _)| e)
        }
    };
    let region = json!({"region": "eu"}).to_string();
    for (i, order) in ORDERS.iter().enumerate() {
        let id = format!("order-{}", i + 1);
        let headers = OwnedHeaders::new()
            .insert(Header {
                key: "message_id",
                value: Some(&id),
            })
            .insert(Header {
                key: "content-type",
                value: Some("application/json"),
            })
            .insert(Header {
                key: "shop",
                value: Some(&region),
            });
        send("orders", format!("customer-{}", i % 2), order, headers).await?;
    }
    // What Spring Kafka writes to the dead-letter topic after a listener threw.
    let headers = OwnedHeaders::new()
        .insert(Header { key: "message_id", value: Some("order-0") })
        .insert(Header { key: "content-type", value: Some("application/json") })
        .insert(Header { key: "kafka_dlt-original-topic", value: Some("orders") })
        .insert(Header { key: "kafka_dlt-original-partition", value: Some(&0i32.to_be_bytes()[..]) })
        .insert(Header { key: "kafka_dlt-original-offset", value: Some(&0i64.to_be_bytes()[..]) })
        .insert(Header {
            key: "kafka_dlt-exception-fqcn",
            value: Some("org.springframework.kafka.listener.ListenerExecutionFailedException"),
        })
        .insert(Header { key: "kafka_dlt-exception-cause-fqcn", value: Some("java.lang.IllegalStateException") })
        .insert(Header { key: "kafka_dlt-exception-message", value: Some("Listener method 'pay' threw exception: card expired") })
        .insert(Header {
            key: "kafka_dlt-exception-stacktrace",
            value: Some("java.lang.IllegalStateException: card expired\n\tat shop.Payments.pay(Payments.java:42)"),
        });
    send(
        "orders.DLT",
        "customer-0".into(),
        r#"{"order_id": "o-0", "amount": 1}"#,
        headers,
    )
    .await?;
    Ok(())
}
