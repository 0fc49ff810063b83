//! The Host and Origin rules of a server without tokens, through the router:
//! a refused request is answered before a byte of its body is read, and
//! nothing is written (issue #32, findings 1 and 2).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt as _;
use lazaret_core::FairScheduler;
use lazaret_server::app::App;
use lazaret_server::config::ServerConfig;
use lazaret_store::PolicyDecider;
use lazaret_store::{Durability, SqliteStore};
use serde_json::Value;
use tower::ServiceExt as _;

/// An app over a fresh store, bound (as `serve` records it) to 127.0.0.1:7433.
fn app(dir: &std::path::Path) -> Arc<App<SqliteStore>> {
    let config = ServerConfig::default();
    let scheduler = FairScheduler::new(config.scheduler.clone()).expect("scheduler");
    let decider = Arc::new(PolicyDecider::new(config.policies.clone()));
    let store = SqliteStore::open(dir, Durability::Normal, scheduler, decider).expect("a store");
    let app = App::new(store, config);
    app.set_listen("127.0.0.1:7433".parse().unwrap());
    app
}

/// A job whose body records whether anyone read it.
fn watched_body(read: &Arc<AtomicBool>) -> Body {
    let read = Arc::clone(read);
    let chunks = futures_util::stream::once(async move {
        read.store(true, Ordering::SeqCst);
        Ok::<_, std::io::Error>(r#"{"type":"t","tenant":"a","payload":{}}"#.to_owned())
    });
    Body::from_stream(chunks)
}

async fn send(app: &Arc<App<SqliteStore>>, req: Request<Body>) -> (StatusCode, Value) {
    let resp = lazaret_server::api::router(Arc::clone(app))
        .oneshot(req)
        .await
        .expect("the router answers");
    let status = resp.status();
    assert_eq!(
        resp.headers()
            .get("x-content-type-options")
            .map(|v| v.as_bytes()),
        Some(&b"nosniff"[..]),
        "every answer is nosniff"
    );
    let bytes = resp.into_body().collect().await.expect("a body").to_bytes();
    (
        status,
        serde_json::from_slice(&bytes).unwrap_or(Value::Null),
    )
}

#[tokio::test]
async fn a_foreign_origin_or_host_is_refused_before_the_body_is_read() {
    let dir = tempfile::TempDir::new().unwrap();
    let app = app(dir.path());
    for (host, origin, site, reason) in [
        (
            "127.0.0.1:7433",
            Some("http://evil.example"),
            None,
            "cross_origin",
        ),
        ("127.0.0.1:7433", Some("null"), None, "cross_origin"),
        ("127.0.0.1:7433", None, Some("same-site"), "cross_origin"),
        ("evil.example:7433", None, None, "host_not_allowed"),
        (
            "localhost:9999",
            Some("http://localhost:9999"),
            None,
            "host_not_allowed",
        ),
    ] {
        let read = Arc::new(AtomicBool::new(false));
        let mut req = Request::post("/v1/jobs").header("host", host);
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        if let Some(s) = site {
            req = req.header("sec-fetch-site", s);
        }
        let (status, body) = send(&app, req.body(watched_body(&read)).unwrap()).await;
        assert_eq!(
            status,
            StatusCode::FORBIDDEN,
            "{host} {origin:?} {site:?}: {body}"
        );
        assert_eq!(body["error"]["reason"], reason, "{body}");
        assert!(
            !read.load(Ordering::SeqCst),
            "the body was never read: {host} {origin:?}"
        );
    }
    let list = Request::get("/v1/jobs").header("host", "localhost:7433");
    let (status, page) = send(&app, list.body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{page}");
    assert_eq!(page["items"], serde_json::json!([]), "nothing was enqueued");

    // Its own page, and a client with no Origin: served, body read.
    for origin in [Some("http://127.0.0.1:7433"), None] {
        let read = Arc::new(AtomicBool::new(false));
        let mut req = Request::post("/v1/jobs").header("host", "127.0.0.1:7433");
        if let Some(o) = origin {
            req = req
                .header("origin", o)
                .header("sec-fetch-site", "same-origin");
        }
        let (status, body) = send(&app, req.body(watched_body(&read)).unwrap()).await;
        assert_eq!(status, StatusCode::CREATED, "{body}");
        assert!(read.load(Ordering::SeqCst));
    }
}
