//! `lazaret serve` guarding an SQS queue end to end (`LAZARET_TEST_SQS_URL`,
//! moto's server in CI, with the AWS variables set): a healthy message is
//! delivered with the contract's headers and deleted, a refused one becomes
//! exactly one dead letter readable through the API, and a redrive through
//! the API sends it back to the queue, where it succeeds under the same id.
//! A watch source on the queue's dead-letter queue files what SQS moved
//! there, with the source queue it found.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use lazaret_guard::sqs::sdk::Client;
use lazaret_guard::sqs::sdk::types::{MessageAttributeValue, QueueAttributeName};
use serde_json::{Value, json};

use crate::harness::{EVENTUALLY, QUICK, Server, id_text};

/// The SQS endpoint, or `None` after saying the test is skipped (a failure
/// under `CI=true`, where `.ci/run` must start moto and set it).
fn sqs_url(test: &str) -> Option<String> {
    match std::env::var("LAZARET_TEST_SQS_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ => {
            let why = format!(
                "{test}: set LAZARET_TEST_SQS_URL (http://127.0.0.1:4566, moto_server) and AWS_REGION, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY to run it against SQS"
            );
            assert!(
                std::env::var("CI").map_or(true, |v| v != "true"),
                "under CI=true this test must run: {why}"
            );
            let _ = writeln!(std::io::stderr(), "SKIPPED {why}");
            None
        }
    }
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
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async {
                for q in queues {
                    let _ = client.delete_queue().queue_url(q).send().await;
                }
            });
        })
        .join();
    }
}

/// Each delivery's headers and body.
type Deliveries = Arc<Mutex<Vec<(HeaderMap, Vec<u8>)>>>;

/// The handler: records every delivery; while `broken`, refuses the order
/// "bad" as a permanent failure (400).
#[derive(Clone, Default)]
struct Handler {
    seen: Deliveries,
    broken: Arc<AtomicBool>,
}

impl Handler {
    async fn start(&self) -> String {
        async fn handle(State(h): State<Handler>, headers: HeaderMap, body: Bytes) -> Response {
            let refuse = h.broken.load(Ordering::SeqCst) && body.as_ref() == BAD.as_bytes();
            h.seen
                .lock()
                .expect("not poisoned")
                .push((headers, body.to_vec()));
            if refuse {
                let error = json!({"error": {"kind": "validation", "message": "no amount"}});
                return (StatusCode::BAD_REQUEST, Json(error)).into_response();
            }
            StatusCode::NO_CONTENT.into_response()
        }
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port");
        let addr = listener.local_addr().expect("bound");
        let app = Router::new()
            .route("/orders", post(handle))
            .with_state(self.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}/orders")
    }

    /// Waits until the handler saw `id` `n` times; the headers of each.
    async fn deliveries(&self, id: &str, n: usize, server: &Server) -> Vec<HeaderMap> {
        let deadline = Instant::now() + EVENTUALLY;
        loop {
            let seen: Vec<HeaderMap> = self
                .seen
                .lock()
                .expect("not poisoned")
                .iter()
                .filter(|(h, _)| h.get("lazaret-message-id").is_some_and(|v| v == id))
                .map(|(h, _)| h.clone())
                .collect();
            if seen.len() >= n {
                return seen;
            }
            assert!(
                Instant::now() < deadline,
                "{id} delivered {} time(s), not {n}\n--- lazaret ---\n{}",
                seen.len(),
                server.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

const GOOD: &str = r#"{"order": 1, "amount": 4200}"#;
const BAD: &str = r#"{"order": 2}"#;

async fn dead_letters(server: &Server, query: &str, n: usize) -> Vec<Value> {
    let api = server.api();
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        let items = api.dead_letters(query).await;
        if items.len() >= n {
            return items;
        }
        assert!(
            Instant::now() < deadline,
            "{n} dead letter(s) for {query} within {EVENTUALLY:?}\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> &'a str {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_sqs_queue_delivers_quarantines_and_redrives_and_its_dlq_is_watched() {
    let test = "a_guarded_sqs_queue_delivers_quarantines_and_redrives_and_its_dlq_is_watched";
    let Some(url) = sqs_url(test) else { return };
    let q = Queues::new(&url).await;
    let handler = Handler::default();
    handler.broken.store(true, Ordering::SeqCst);
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
    q.produce(&q.queue, "m1", GOOD).await;
    let seen = handler.deliveries("m1", 1, &server).await;
    assert_eq!(header(&seen[0], "lazaret-attempt"), "1");
    assert_eq!(header(&seen[0], "lazaret-source"), "orders");
    let broker_headers: Value =
        serde_json::from_str(header(&seen[0], "lazaret-headers")).expect("JSON");
    assert_eq!(broker_headers["tenant"], "acme", "{broker_headers}");

    // A refused one: one dead letter, its source and bytes readable.
    q.produce(&q.queue, "m2", BAD).await;
    let items = dead_letters(&server, "source=orders", 1).await;
    let dl = &items[0];
    assert_eq!(dl["reason"], "permanent", "{dl}");
    assert_eq!(dl["tenant"], "acme", "{dl}");
    assert_eq!(dl["source"]["broker"], "sqs", "{dl}");
    assert_eq!(dl["source"]["queue"], q.queue.as_str(), "{dl}");
    assert_eq!(dl["source"]["message_id"], "m2", "{dl}");
    let id = id_text(&dl["id"]);
    let payload = api.get(&format!("/v1/dead-letters/{id}/payload")).await;
    assert_eq!(payload.bytes, BAD.as_bytes());

    // Fixed; a dry run moves nothing, the redrive sends it back to the
    // queue, where it succeeds as attempt 1 under the same id.
    handler.broken.store(false, Ordering::SeqCst);
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
    assert_eq!(header(&again[1], "lazaret-attempt"), "1", "a fresh budget");
    assert!(api.dead_letters("source=orders").await.is_empty());

    // A message on the dead-letter queue, as SQS moves one there: the
    // watch files it with the source queue.
    q.produce(&q.dlq, "m3", GOOD).await;
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
