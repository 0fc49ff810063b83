//! `/v1/stats` through the router: broker messages whose retries lazaret
//! holds are counted (they are off the broker, so only lazaret can say).

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt as _;
use lazaret_core::{Envelope, FairScheduler, JobId, Timestamp};
use lazaret_server::app::App;
use lazaret_server::config::ServerConfig;
use lazaret_store::PolicyDecider;
use lazaret_store::{Durability, HeldRetry, SourceRef, SqliteStore, Store};
use serde_json::{Value, json};
use tower::ServiceExt as _;

async fn stats(app: &Arc<App<SqliteStore>>) -> Value {
    let req = Request::builder()
        .uri("/v1/stats")
        .body(Body::empty())
        .expect("a request");
    let resp = lazaret_server::api::router(Arc::clone(app))
        .oneshot(req)
        .await
        .expect("the router answers");
    assert_eq!(resp.status(), StatusCode::OK);
    let bytes = resp.into_body().collect().await.expect("a body").to_bytes();
    serde_json::from_slice(&bytes).expect("JSON")
}

fn held(source: &str, id: &str) -> HeldRetry {
    HeldRetry {
        source: SourceRef {
            name: source.into(),
            broker: "rabbitmq".into(),
            queue: "orders".into(),
            message_id: id.into(),
            headers: serde_json::Map::new(),
            position: Value::Null,
            content_type: None,
            redrive_id: None,
        },
        due_at: Timestamp::from_millis(i64::MAX / 2),
        envelope: Envelope::new(
            JobId(0),
            "orders".into(),
            "default".into(),
            "default".into(),
            b"{}",
            Timestamp::from_millis(0),
        ),
        body: b"{}".to_vec(),
    }
}

#[tokio::test]
async fn held_broker_retries_are_counted_by_source() {
    let dir = tempfile::tempdir().unwrap();
    let config = ServerConfig::default();
    let scheduler = FairScheduler::new(config.scheduler.clone()).expect("scheduler");
    let decider = Arc::new(PolicyDecider::new(config.policies.clone()));
    let store = SqliteStore::open(dir.path(), Durability::Normal, scheduler, decider)
        .expect("open the store");
    let app = App::new(store, config);
    assert_eq!(
        stats(&app).await["held_retries"],
        json!({"total": 0, "by_source": {}})
    );
    for (source, id) in [("orders", "m-1"), ("orders", "m-2"), ("billing", "b-1")] {
        app.store.hold_retry(held(source, id)).await.unwrap();
    }
    assert_eq!(
        stats(&app).await["held_retries"],
        json!({"total": 3, "by_source": {"billing": 1, "orders": 2}})
    );
}
