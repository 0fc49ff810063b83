//! Backpressure and a dead writer, through the router: a full command queue
//! answers `503 UNAVAILABLE` with `Retry-After`, and a writer that died turns
//! `/healthz` to 503 with the reason.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt as _;
use lazaret_core::FairScheduler;
use lazaret_server::app::App;
use lazaret_server::config::ServerConfig;
use lazaret_store::PolicyDecider;
use lazaret_store::{Durability, SqliteStore};
use serde_json::{Value, json};
use tower::ServiceExt as _;

/// An app over a fresh store whose command queue holds `commands_max`.
fn app(dir: &std::path::Path, commands_max: usize) -> Arc<App<SqliteStore>> {
    let config = ServerConfig::default();
    let scheduler = FairScheduler::new(config.scheduler.clone()).expect("scheduler");
    let decider = Arc::new(PolicyDecider::new(config.policies.clone()));
    let store = SqliteStore::open_with_commands_max(
        dir,
        Durability::Normal,
        scheduler,
        decider,
        commands_max,
    )
    .expect("open the store");
    App::new(store, config)
}

/// Sends one request through the router; (status, Retry-After, JSON body).
async fn send(
    app: &Arc<App<SqliteStore>>,
    method: &str,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Option<String>, Value) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .expect("a request");
    let resp = lazaret_server::api::router(Arc::clone(app))
        .oneshot(req)
        .await
        .expect("the router answers");
    let status = resp.status();
    let retry = resp
        .headers()
        .get(header::RETRY_AFTER)
        .map(|v| v.to_str().unwrap_or_default().to_owned());
    let bytes = resp.into_body().collect().await.expect("a body").to_bytes();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    (status, retry, body)
}

fn job(n: u32) -> Value {
    json!({"type": "report", "tenant": "acme", "payload": {"n": n}})
}

#[tokio::test]
async fn a_full_command_queue_answers_503_unavailable_with_retry_after() {
    let dir = tempfile::TempDir::new().unwrap();
    let app = app(dir.path(), 1);
    // The writer is busy and one request waits for it: the queue is full.
    let resume = app.store.hold_writer();
    let waiting = {
        let app = Arc::clone(&app);
        tokio::spawn(async move { send(&app, "POST", "/v1/jobs", Some(job(1))).await })
    };
    while app.store.commands_waiting() < 1 {
        tokio::task::yield_now().await;
    }
    let refused = {
        let (status, retry, body) = send(&app, "POST", "/v1/jobs", Some(job(2))).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        (retry, body)
    };
    assert!(
        refused.1["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("overloaded") && m.contains("retry")),
        "{}",
        refused.1
    );
    assert_eq!(refused.0.as_deref(), Some("1"), "Retry-After");
    assert_eq!(refused.1["error"]["code"], "UNAVAILABLE", "{}", refused.1);
    assert_eq!(refused.1["error"]["retry_after_ms"], 1000, "{}", refused.1);
    // /healthz needs no store command: the server is busy, not broken.
    let (health, _, _) = send(&app, "GET", "/healthz", None).await;
    assert_eq!(health, StatusCode::OK);

    drop(resume);
    let (status, _, body) = waiting.await.unwrap();
    assert_eq!(
        status,
        StatusCode::CREATED,
        "the waiting request runs: {body}"
    );
    let (status, _, body) = send(&app, "POST", "/v1/jobs", Some(job(3))).await;
    assert_eq!(status, StatusCode::CREATED, "room again: {body}");
}

#[tokio::test]
async fn a_dead_writer_turns_healthz_503_with_the_reason() {
    let dir = tempfile::TempDir::new().unwrap();
    let app = app(dir.path(), 100);
    let (health, _, _) = send(&app, "GET", "/healthz", None).await;
    assert_eq!(health, StatusCode::OK);

    app.store.crash_writer();
    let (health, _, body) = send(&app, "GET", "/healthz", None).await;
    assert_eq!(health, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "UNAVAILABLE", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("writer thread stopped") && message.contains("restart lazaret"),
        "{message}"
    );
    // Writes are refused with the same reason, and nothing is applied.
    let (status, _, body) = send(&app, "POST", "/v1/jobs", Some(job(1))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("writer thread stopped")),
        "{body}"
    );
}
