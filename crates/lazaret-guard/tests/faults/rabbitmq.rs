//! RabbitMQ under faults: a quorum queue of persistent messages; the
//! guard's connections closed by `rabbitmqctl close_connection`, the node's
//! Erlang VM stopped (SIGSTOP) past the 5 s heartbeat the guard's URL asks
//! for, and `rabbitmqctl stop_app` / `start_app` (the queue and its
//! messages survive: nothing may be lost).

use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use lazaret_guard::{BrokerKind, SourceSpec};
use lazaret_testkit::faults::{Service, kill_rabbitmq_connections};

use crate::battery::{self, DELIVERY_TIMEOUT, FaultBroker, TYPE};

struct Rabbit {
    url: String,
}

fn props() -> ConnectionProperties {
    ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current())
}

impl Rabbit {
    async fn connection(&self) -> Result<Connection, String> {
        Connection::connect(&self.url, props())
            .await
            .map_err(|e| format!("connect to RabbitMQ at {}: {e}", self.url))
    }
}

impl FaultBroker for Rabbit {
    const SERVICE: Service = Service::RabbitMq;
    const RESTART_KEEPS: bool = true;

    async fn queue(&self, name: &str) -> String {
        let conn = self.connection().await.expect("connect");
        let mut args = FieldTable::default();
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        // Gone by itself 15 minutes after a run that died before removing it.
        args.insert("x-expires".into(), AMQPValue::LongInt(15 * 60 * 1000));
        conn.create_channel()
            .await
            .expect("a channel")
            .queue_declare(
                name,
                QueueDeclareOptions {
                    durable: true,
                    ..QueueDeclareOptions::default()
                },
                args,
            )
            .await
            .expect("declare a quorum queue");
        let _ = conn.close(200, "done").await;
        name.to_owned()
    }

    fn spec(&self, name: &str, queue: &str) -> SourceSpec {
        // A 5 s heartbeat: the pause (12 s) outlasts two of them, so the
        // guard's side gives the connection up as the timeouts say.
        let sep = if self.url.contains('?') { '&' } else { '?' };
        let url = format!("{}{sep}heartbeat=5", self.url);
        let mut spec = SourceSpec::guard(name, BrokerKind::RabbitMq, url, queue, TYPE);
        spec.delivery_timeout = DELIVERY_TIMEOUT;
        spec
    }

    async fn publish(
        &self,
        queue: &str,
        batch: &[(String, Vec<u8>)],
        confirmed: &mut dyn FnMut(usize),
    ) -> Result<(), String> {
        let conn = self.connection().await?;
        let ch = conn
            .create_channel()
            .await
            .map_err(|e| format!("open a channel: {e}"))?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| format!("confirm mode: {e}"))?;
        let mut confirms = Vec::with_capacity(batch.len());
        for (id, body) in batch {
            let props = BasicProperties::default()
                .with_message_id(id.as_str().into())
                .with_delivery_mode(2);
            let c = ch
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
                .map_err(|e| format!("publish {id}: {e}"))?;
            confirms.push(c);
        }
        for (i, c) in confirms.into_iter().enumerate() {
            match c
                .await
                .map_err(|e| format!("confirm of {}: {e}", batch[i].0))?
            {
                lapin::publisher_confirm::Confirmation::Ack(None) => confirmed(i),
                other => return Err(format!("{} not confirmed: {other:?}", batch[i].0)),
            }
        }
        let _ = conn.close(200, "done").await;
        Ok(())
    }

    fn kill_connections(&self, source: &str) -> Result<usize, String> {
        kill_rabbitmq_connections(&format!("lazaret source {source}"))
    }

    async fn remove(&self, queue: &str) {
        if let Ok(conn) = self.connection().await {
            if let Ok(ch) = conn.create_channel().await {
                let _ = ch.queue_delete(queue, QueueDeleteOptions::default()).await;
            }
            let _ = conn.close(200, "done").await;
        }
    }
}

/// The machine's RabbitMQ, or `None` (the test skips) without one.
fn rabbit() -> Option<Rabbit> {
    let url = lazaret_testkit::service(
        "LAZARET_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        "the RabbitMQ fault battery",
    )?;
    Some(Rabbit { url })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_under_connection_kills_a_pause_and_a_restart() {
    if !battery::enabled("rabbitmq_under_connection_kills_a_pause_and_a_restart") {
        return;
    }
    let Some(rabbit) = rabbit() else {
        return;
    };
    battery::run(&rabbit, "rabbitmq").await;
}

/// The battery's deliberately broken build (issue 29 part 7: each battery
/// must fail on one): a guard that acknowledges a poison message before its
/// dead letter is written, and crashes in between, loses it; the battery's
/// checker must say so. No broker fault: the broken order alone loses
/// messages once the guard dies (it is started again at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rabbitmq_battery_fails_on_a_guard_that_acks_before_its_dead_letter() {
    if !battery::enabled("rabbitmq_battery_fails_on_a_guard_that_acks_before_its_dead_letter") {
        return;
    }
    let Some(rabbit) = rabbit() else {
        return;
    };
    battery::run_broken(&rabbit, "rabbitmq").await;
}
