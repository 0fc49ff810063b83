//! SQS (moto) under faults: moto's client sockets destroyed (`ss -K`), moto
//! stopped (SIGSTOP) past the visibility timeout the guard asks for, and a
//! restart. moto keeps everything in memory: a restart loses the queue and
//! its messages; the battery creates the queue again (same name, same URL),
//! as the team's setup would. Messages the guard had not received by then
//! are lost by the broker and counted apart.
//!
//! The guard receives 10 at a time and deletes in `DeleteMessageBatch`es
//! (`src/sqs.rs`); on moto, a single-threaded Python server, the producer
//! here (`SendMessageBatch` of 10) is the slower side, so when a fault
//! strikes the guard has caught up with what was published but for the
//! messages in its hands (its `concurrency`, 16, plus deletes in flight):
//! those are what each fault tests. 10,000 messages take under 2 minutes.

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use lazaret_guard::{BrokerKind, SourceSpec};
use lazaret_testkit::faults::{Service, kill_sockets};

use crate::battery::{self, DELIVERY_TIMEOUT, FaultBroker, TYPE};

struct Sqs {
    url: String,
    client: Client,
}

impl Sqs {
    async fn create(&self, name: &str) -> String {
        self.client
            .create_queue()
            .queue_name(name)
            .send()
            .await
            .expect("create the queue")
            .queue_url()
            .expect("its url")
            .to_owned()
    }
}

impl FaultBroker for Sqs {
    const SERVICE: Service = Service::Moto;
    const RESTART_KEEPS: bool = false;
    // moto (5.2) serves requests on threads, and its receive checks a
    // message's visibility and marks it received without a lock: the
    // guard's two receives in flight (its default) can both take the same
    // message, one copy with receive count 1, the other 2, arriving in
    // either order. One receive in flight avoids it but did not get
    // through 10,000 messages in 400 s (docs/reliability.md).
    const COPIES_AT_ONCE: bool = true;

    async fn queue(&self, name: &str) -> String {
        self.create(name).await
    }

    fn spec(&self, name: &str, queue: &str) -> SourceSpec {
        let mut spec = SourceSpec::guard(name, BrokerKind::Sqs, &self.url, queue, TYPE);
        spec.delivery_timeout = DELIVERY_TIMEOUT;
        spec
    }

    async fn publish(
        &self,
        queue: &str,
        batch: &[(String, Vec<u8>)],
        confirmed: &mut dyn FnMut(usize),
    ) -> Result<(), String> {
        for (n, part) in batch.chunks(10).enumerate() {
            let mut req = self.client.send_message_batch().queue_url(queue);
            for (i, (id, body)) in part.iter().enumerate() {
                let attr = MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value(id)
                    .build()
                    .map_err(|e| e.to_string())?;
                req = req.entries(
                    SendMessageBatchRequestEntry::builder()
                        .id(i.to_string())
                        .message_body(String::from_utf8_lossy(body))
                        .message_attributes("message_id", attr)
                        .build()
                        .map_err(|e| e.to_string())?,
                );
            }
            let out = req
                .send()
                .await
                .map_err(|e| format!("SendMessageBatch: {e:?}"))?;
            if !out.failed().is_empty() {
                return Err(format!("SendMessageBatch failed: {:?}", out.failed()));
            }
            for ok in out.successful() {
                let i: usize = ok.id().parse().map_err(|_| "an entry id".to_owned())?;
                confirmed(n * 10 + i);
            }
        }
        Ok(())
    }

    fn kill_connections(&self, _source: &str) -> Result<usize, String> {
        kill_sockets(Service::Moto.port())
    }

    async fn after_restart(&self, queue: &str) {
        let name = queue.rsplit('/').next().expect("a queue url");
        self.create(name).await;
    }

    async fn remove(&self, queue: &str) {
        let _ = self.client.delete_queue().queue_url(queue).send().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqs_under_socket_kills_a_pause_and_a_restart() {
    if !battery::enabled("sqs_under_socket_kills_a_pause_and_a_restart") {
        return;
    }
    let Some(url) = lazaret_testkit::service(
        "LAZARET_TEST_SQS_URL",
        "http://127.0.0.1:4566",
        "the SQS fault battery",
    ) else {
        return;
    };
    let client = lazaret_guard::sqs::client(&url)
        .await
        .expect("an SQS client (AWS_REGION and credentials set?)");
    battery::run(&Sqs { url, client }, "sqs").await;
}
