//! Guard sources on several nodes sharing one PostgreSQL store (issue 27
//! part 2): a held broker retry is claimed in the store by the one node
//! that delivers it, so two nodes guarding one RabbitMQ quorum queue call
//! the handler exactly twice for a message that fails once transiently.
//!
//! Needs `LAZARET_TEST_PG_URL` and `LAZARET_TEST_AMQP_URL`; skipped with a
//! message without them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;

use crate::harness::{QUICK, Server};
use crate::sources::{amqp_queue, amqp_url};
use crate::team_handler::percent_decode;

/// Messages published: enough that both nodes hold many due retries at once.
const MESSAGES: usize = 300;

/// The attempts (`Lazaret-Attempt`) the handler saw, per message id.
type Calls = Arc<Mutex<HashMap<String, Vec<String>>>>;

/// A handler that fails each message's first call with a 503 (transient)
/// and accepts every later one, recording every call.
async fn flaky_once() -> (String, Calls) {
    async fn handle(State(calls): State<Calls>, headers: HeaderMap) -> StatusCode {
        let header = |n: &str| {
            headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let id = percent_decode(&header("lazaret-message-id"));
        let mut calls = calls.lock().expect("not poisoned");
        let seen = calls.entry(id).or_default();
        seen.push(header("lazaret-attempt"));
        if seen.len() == 1 {
            StatusCode::SERVICE_UNAVAILABLE
        } else {
            StatusCode::NO_CONTENT
        }
    }
    let calls = Calls::default();
    let app = Router::new()
        .route("/orders", post(handle))
        .with_state(Arc::clone(&calls));
    (
        format!("{}/orders", crate::harness::serve_app(app).await),
        calls,
    )
}

/// Two nodes on one PostgreSQL schema guard one quorum queue (concurrency
/// 4, backoff 1 s); each of 300 messages fails once (503), then succeeds.
/// Every message reaches the handler exactly twice: attempt 1, then
/// attempt 2 from one node. Before, each node read the same due held
/// retries from the store and delivered them: 171 of 300 messages were
/// delivered as attempt 2 twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_deliver_each_held_retry_of_one_queue_once() {
    let test = "two_nodes_deliver_each_held_retry_of_one_queue_once";
    let Some(url) = amqp_url(test) else { return };
    if crate::harness::pg_url().is_none() {
        return;
    }
    let (_conn, ch, queue) = amqp_queue(&url, "nodes").await;
    let (deliver, calls) = flaky_once().await;
    let config = format!(
        r#"{QUICK}
[types.orders]
attempts_max = 3
backoff_base_ms = 1000
backoff_floor_ms = 1000
backoff_cap_ms = 1000

[[sources]]
name = "orders"
broker = "rabbitmq"
url = "{url}"
queue = "{queue}"
deliver = "{deliver}"
type = "orders"
concurrency = 4
"#
    );
    let Some(nodes) = Server::cluster(&config, 2).await else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    for node in &nodes {
        while !node.output().contains("connected to rabbitmq") {
            assert!(
                Instant::now() < deadline,
                "never connected:\n{}",
                node.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for i in 0..MESSAGES {
        ch.basic_publish(
            "",
            &queue,
            lapin::options::BasicPublishOptions::default(),
            format!("{{\"order\": {i}}}").as_bytes(),
            lapin::BasicProperties::default().with_message_id(format!("m-{i}").into()),
        )
        .await
        .expect("publish")
        .await
        .expect("published");
    }
    // Every message called twice (once failed, once retried)…
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = {
            let calls = calls.lock().expect("not poisoned");
            calls.len() == MESSAGES && calls.values().all(|v| v.len() >= 2)
        };
        if done {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not every message was retried within 120 s\n--- node 0 ---\n{}\n--- node 1 ---\n{}",
            nodes[0].output(),
            nodes[1].output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // …and a little longer for a second delivery of a retry that another
    // node may have started at the same time (it did, before the claim).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let calls = calls.lock().expect("not poisoned").clone();
    let twice: Vec<&String> = calls
        .iter()
        .filter(|(_, v)| v.iter().filter(|a| *a == "2").count() > 1)
        .map(|(k, _)| k)
        .collect();
    assert!(
        twice.is_empty(),
        "{} of {MESSAGES} messages were delivered as attempt 2 more than once (e.g. {:?})",
        twice.len(),
        twice.iter().take(5).collect::<Vec<_>>()
    );
    for (id, attempts) in &calls {
        assert_eq!(
            attempts,
            &vec!["1".to_owned(), "2".to_owned()],
            "message {id}: attempt 1 (503) then attempt 2, once each"
        );
    }
}

/// Calls per node (`a`, `b`): message id, attempt, per call.
type NodeCalls = Arc<Mutex<Vec<(String, String, String)>>>;

/// A handler that fails each message's first call with a 503; later calls
/// on node `a`'s path never answer (node `a` holds them until it dies),
/// later calls on node `b`'s path succeed.
async fn held_by_a() -> (String, NodeCalls) {
    async fn handle(
        State(calls): State<NodeCalls>,
        axum::extract::Path(node): axum::extract::Path<String>,
        headers: HeaderMap,
    ) -> StatusCode {
        let header = |n: &str| {
            headers
                .get(n)
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned()
        };
        let id = percent_decode(&header("lazaret-message-id"));
        let first = {
            let mut calls = calls.lock().expect("not poisoned");
            let first = !calls.iter().any(|(_, m, _)| *m == id);
            calls.push((node.clone(), id, header("lazaret-attempt")));
            first
        };
        if first {
            return StatusCode::SERVICE_UNAVAILABLE;
        }
        if node == "a" {
            std::future::pending::<()>().await;
        }
        StatusCode::NO_CONTENT
    }
    let calls = NodeCalls::default();
    let app = Router::new()
        .route("/{node}", post(handle))
        .with_state(Arc::clone(&calls));
    (crate::harness::serve_app(app).await, calls)
}

/// `kill -9` of a node while it delivers held retries it claimed: the
/// survivor delivers each of them exactly once, after the claims expire
/// (`delivery_timeout_ms` + 10 s), and every other retry once as well.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_claimed_retries_are_delivered_once_by_the_survivor() {
    let test = "a_killed_nodes_claimed_retries_are_delivered_once_by_the_survivor";
    let Some(url) = amqp_url(test) else { return };
    let Some(pg) = crate::harness::pg_url() else {
        return;
    };
    const N: usize = 40;
    let (_conn, ch, queue) = amqp_queue(&url, "nodes-kill").await;
    let (base, calls) = held_by_a().await;
    let config = |node: &str| {
        format!(
            r#"{QUICK}
[types.orders]
attempts_max = 5
backoff_base_ms = 500
backoff_floor_ms = 500
backoff_cap_ms = 500

[[sources]]
name = "orders"
broker = "rabbitmq"
url = "{url}"
queue = "{queue}"
deliver = "{base}/{node}"
type = "orders"
concurrency = 4
delivery_timeout_ms = 2000
"#
        )
    };
    let schema = crate::harness::PgSchema::fresh(&pg);
    let a = Server::on_schema(&config("a"), &schema).await;
    let b = Server::on_schema(&config("b"), &schema).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    for node in [&a, &b] {
        while !node.output().contains("connected to rabbitmq") {
            assert!(
                Instant::now() < deadline,
                "never connected:\n{}",
                node.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    for i in 0..N {
        ch.basic_publish(
            "",
            &queue,
            lapin::options::BasicPublishOptions::default(),
            format!("{{\"order\": {i}}}").as_bytes(),
            lapin::BasicProperties::default().with_message_id(format!("k-{i}").into()),
        )
        .await
        .expect("publish")
        .await
        .expect("published");
    }
    // Node a holds retries it claimed: its handler calls never answer.
    let retried_by_a = |calls: &NodeCalls| -> Vec<String> {
        let calls = calls.lock().expect("not poisoned");
        let mut firsts = std::collections::HashSet::new();
        calls
            .iter()
            .filter(|(_, m, _)| !firsts.insert(m.clone()))
            .filter(|(n, _, _)| n == "a")
            .map(|(_, m, _)| m.clone())
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while retried_by_a(&calls).is_empty() {
        assert!(
            Instant::now() < deadline,
            "node a never held a retry:\n{}",
            a.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(a); // SIGKILL
    let held = retried_by_a(&calls);
    // Every message succeeds on b, once.
    let answered_by_b = |calls: &NodeCalls| -> HashMap<String, usize> {
        let calls = calls.lock().expect("not poisoned");
        let mut firsts = std::collections::HashSet::new();
        let mut by_b = HashMap::new();
        for (n, m, _) in calls.iter() {
            if firsts.insert(m.clone()) {
                continue;
            }
            if n == "b" {
                *by_b.entry(m.clone()).or_insert(0) += 1;
            }
        }
        by_b
    };
    let deadline = Instant::now() + Duration::from_secs(90);
    while answered_by_b(&calls).len() < N {
        assert!(
            Instant::now() < deadline,
            "{} of {N} messages retried by the survivor within 90 s:\n{}",
            answered_by_b(&calls).len(),
            b.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A little longer, for a second delivery that must not come.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let by_b = answered_by_b(&calls);
    for id in &held {
        assert_eq!(
            by_b.get(id),
            Some(&1),
            "{id}, claimed by the killed node, is delivered once by the survivor"
        );
    }
    let twice: Vec<_> = by_b.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "retried more than once by b: {twice:?}");
}
