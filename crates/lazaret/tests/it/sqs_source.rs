//! `lazaret serve` guarding an SQS queue end to end (`LAZARET_TEST_SQS_URL`,
//! moto's server in CI, with the AWS variables set): a healthy message is
//! delivered with the contract's headers and deleted, a refused one becomes
//! exactly one dead letter readable through the API, and a redrive through
//! the API sends it back to the queue, where it succeeds under the same id.
//! A watch source on the queue's dead-letter queue files what SQS moved
//! there, with the source queue it found.

use lazaret_guard::sqs::sdk::Client;
use lazaret_guard::sqs::sdk::types::{MessageAttributeValue, QueueAttributeName};
use serde_json::{Value, json};

use crate::harness::{QUICK, Server, id_text};
use crate::team_handler::{Handler, ORDER_1, ORDER_2, dead_letters, service};

/// The SQS endpoint, or `None` after saying the test is skipped (with
/// `AWS_REGION`, `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY` set too).
fn sqs_url(test: &str) -> Option<String> {
    service(
        "LAZARET_TEST_SQS_URL",
        "http://127.0.0.1:4566, moto_server, with the AWS_* variables",
        test,
    )
}

/// A queue and its dead-letter queue, deleted when dropped.
struct Queues {
    client: Client,
    queue: String,
    dlq: String,
}

impl Queues {
    async fn new(url: &str) -> Queues {
        let client = lazaret_guard::sqs::client(url)
            .await
            .expect("an SQS client");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let base = format!("serve-{}-{nanos}", std::process::id());
        let dlq = client
            .create_queue()
            .queue_name(format!("{base}-dlq"))
            .send()
            .await
            .expect("create the dead-letter queue")
            .queue_url()
            .expect("its url")
            .to_owned();
        let arn = client
            .get_queue_attributes()
            .queue_url(&dlq)
            .attribute_names(QueueAttributeName::QueueArn)
            .send()
            .await
            .expect("its attributes")
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
            .expect("its arn");
        let policy = json!({"deadLetterTargetArn": arn, "maxReceiveCount": 1});
        let queue = client
            .create_queue()
            .queue_name(&base)
            .attributes(QueueAttributeName::RedrivePolicy, policy.to_string())
            .send()
            .await
            .expect("create the queue")
            .queue_url()
            .expect("its url")
            .to_owned();
        Queues { client, queue, dlq }
    }

    async fn produce(&self, queue: &str, message_id: &str, body: &str) {
        let text = |v: &str| {
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(v)
                .build()
                .expect("an attribute")
        };
        self.client
            .send_message()
            .queue_url(queue)
            .message_body(body)
            .message_attributes("message_id", text(message_id))
            .message_attributes("tenant", text("acme"))
            .send()
            .await
            .expect("send");
    }
}

impl Drop for Queues {
    fn drop(&mut self) {
        let client = self.client.clone();
        let queues = [self.queue.clone(), self.dlq.clone()];
        crate::harness::clean_up(move || async move {
            for q in queues {
                let _ = client.delete_queue().queue_url(q).send().await;
            }
        });
    }
}

/// Each delivery's headers and body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_sqs_queue_delivers_quarantines_and_redrives_and_its_dlq_is_watched() {
    let test = "a_guarded_sqs_queue_delivers_quarantines_and_redrives_and_its_dlq_is_watched";
    let Some(url) = sqs_url(test) else { return };
    let q = Queues::new(&url).await;
    let handler = Handler::broken();
    let deliver = handler.start().await;
    let config = format!(
        r#"{QUICK}
[[sources]]
name = "orders"
broker = "sqs"
url = "{url}"
queue = "{queue}"
deliver = "{deliver}"
tenant_header = "tenant"
delivery_timeout_ms = 5000

[[sources]]
name = "orders-dlq"
broker = "sqs"
url = "{url}"
queue = "{dlq}"
mode = "watch"
"#,
        queue = q.queue,
        dlq = q.dlq,
    );
    let server = Server::start(&config).await;
    let api = server.api();

    // A healthy message: delivered once with the contract's headers.
    q.produce(&q.queue, "m1", ORDER_1).await;
    let seen = handler.deliveries("m1", 1, &server).await;
    assert_eq!(seen[0].header("lazaret-attempt"), "1");
    assert_eq!(seen[0].header("lazaret-source"), "orders");
    let broker_headers: Value =
        serde_json::from_str(&seen[0].header("lazaret-headers")).expect("JSON");
    assert_eq!(broker_headers["tenant"], "acme", "{broker_headers}");

    // A refused one: one dead letter, its source and bytes readable.
    q.produce(&q.queue, "m2", ORDER_2).await;
    let items = dead_letters(&server, "source=orders", 1).await;
    let dl = &items[0];
    assert_eq!(dl["reason"], "permanent", "{dl}");
    assert_eq!(dl["tenant"], "acme", "{dl}");
    assert_eq!(dl["source"]["broker"], "sqs", "{dl}");
    assert_eq!(dl["source"]["queue"], q.queue.as_str(), "{dl}");
    assert_eq!(dl["source"]["message_id"], "m2", "{dl}");
    let id = id_text(&dl["id"]);
    let payload = api.get(&format!("/v1/dead-letters/{id}/payload")).await;
    assert_eq!(payload.bytes, ORDER_2.as_bytes());

    // Fixed; a dry run moves nothing, the redrive sends it back to the
    // queue, where it succeeds as attempt 1 under the same id.
    handler.mend();
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"source": "orders"}, "dry_run": true}),
        )
        .await;
    assert_eq!(r.expect(200)["matched"], 1);
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"source": "orders"}}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["redriven"], 1, "{body}");
    let again = handler.deliveries("m2", 2, &server).await;
    assert_eq!(again[1].header("lazaret-attempt"), "1", "a fresh budget");
    assert!(api.dead_letters("source=orders").await.is_empty());

    // A message on the dead-letter queue, as SQS moves one there: the
    // watch files it with the source queue.
    q.produce(&q.dlq, "m3", ORDER_1).await;
    let items = dead_letters(&server, "source=orders-dlq", 1).await;
    let dl = &items[0];
    assert_eq!(dl["reason"], "max_receives", "{dl}");
    assert_eq!(dl["stage"], "broker", "{dl}");
    assert_eq!(
        dl["source"]["queue"],
        q.queue.as_str(),
        "the queue ListDeadLetterSourceQueues names: {dl}"
    );
    assert_eq!(dl["source"]["message_id"], "m3", "{dl}");
}
