//! NATS JetStream under faults: the server's client sockets destroyed
//! (`ss -K`: NATS has no command that closes a client's connection), the
//! server stopped (SIGSTOP) past the consumer's ack wait (the delivery
//! timeout plus 5 s), and a restart (SIGTERM, then the machine's command).
//! The stream is on file storage in /var/lib/nats-server and survives the
//! restart with its consumer: nothing may be lost.

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream};
use lazaret_guard::{BrokerKind, SourceSpec};
use lazaret_testkit::faults::{Service, kill_sockets};

use crate::battery::{self, DELIVERY_TIMEOUT, FaultBroker, TYPE};

struct Nats {
    url: String,
}

impl Nats {
    async fn js(&self) -> Result<jetstream::Context, String> {
        let client = async_nats::connect(self.url.as_str())
            .await
            .map_err(|e| format!("connect to NATS at {}: {e}", self.url))?;
        Ok(jetstream::new(client))
    }
}

impl FaultBroker for Nats {
    const SERVICE: Service = Service::Nats;
    const RESTART_KEEPS: bool = true;

    async fn queue(&self, name: &str) -> String {
        let js = self.js().await.expect("connect");
        js.create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![name.to_owned()],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .expect("create a stream");
        name.to_owned()
    }

    fn spec(&self, name: &str, queue: &str) -> SourceSpec {
        let mut spec = SourceSpec::guard(name, BrokerKind::Nats, &self.url, queue, TYPE);
        spec.delivery_timeout = DELIVERY_TIMEOUT;
        spec
    }

    async fn publish(
        &self,
        queue: &str,
        batch: &[(String, Vec<u8>)],
        confirmed: &mut dyn FnMut(usize),
    ) -> Result<(), String> {
        let js = self.js().await?;
        for (n, part) in batch.chunks(500).enumerate() {
            let mut acks = Vec::with_capacity(part.len());
            for (id, body) in part {
                let mut h = HeaderMap::new();
                h.insert("Nats-Msg-Id", id.as_str());
                acks.push(
                    js.publish_with_headers(queue.to_owned(), h, body.clone().into())
                        .await
                        .map_err(|e| format!("publish {id}: {e}"))?,
                );
            }
            for (i, ack) in acks.into_iter().enumerate() {
                ack.await
                    .map_err(|e| format!("the PubAck of {}: {e}", part[i].0))?;
                confirmed(n * 500 + i);
            }
        }
        Ok(())
    }

    fn kill_connections(&self, _source: &str) -> Result<usize, String> {
        kill_sockets(Service::Nats.port())
    }

    async fn remove(&self, queue: &str) {
        if let Ok(js) = self.js().await {
            let _ = js.delete_stream(queue).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nats_under_socket_kills_a_pause_and_a_restart() {
    if !battery::enabled("nats_under_socket_kills_a_pause_and_a_restart") {
        return;
    }
    let Some(url) = lazaret_testkit::service(
        "LAZARET_TEST_NATS_URL",
        "nats://127.0.0.1:4222",
        "the NATS fault battery",
    ) else {
        return;
    };
    battery::run(&Nats { url }, "nats").await;
}
