//! The HTTP API's request parsers, through the real router (`api::router`)
//! over a SQLite store in a temporary directory: the JSON bodies of
//! enqueue (one and batch), lease, ack, fail, heartbeat, the batch outcomes,
//! cancel, redrive (selector and corrected), purge, pause, resume and
//! tokens; the query strings of the job list, the dead-letter list and the
//! audit log; the path ids.
//!
//! Input: the first byte picks the route (`A` + the index in `ROUTES`; any
//! other byte by its value); up to the first newline is the path's tail
//! (the `{id}` of the route, or the query string of a GET), the rest is the
//! body. The last route takes its method and whole path from that line.
//!
//! Properties: never a panic; never a 500; every error answer is the
//! contract's envelope, `{"error": {"code", "message"}}`, with a message.
//! The server's config is docs/api.md's example with one admin token, sent
//! with every request (so that a token created by the fuzzer changes
//! nothing). Time is tokio's paused clock: a long-poll returns at once.
#![no_main]

use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt;
use lazaret_core::FairScheduler;
use lazaret_server::app::App;
use lazaret_server::config::ServerConfig;
use lazaret_store::{Durability, PolicyDecider, SqliteStore};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;
use tower::ServiceExt;

const CONFIG: &str = r#"
payload_bytes_max = 1024
admission_records_per_minute = 3

[tenants]
inflight_max = 2

[lanes.interactive]
weight = 4
[lanes.batch]
weight = 1

[defaults]
attempts_max = 3
backoff_base_ms = 100
backoff_cap_ms = 1000
crash_loop_max = 2
deferrals_max = 2
kind_classes = { http_404 = "permanent", http_429 = "deferred" }

[types.send_email]
attempts_max = 4
backoff_base_ms = 50
kinds = { parse = 2, validation = 1 }
schemas = { 1 = "schemas/send_email.v1.json", 2 = "schemas/send_email.v2.json" }

[types.send_email.breaker]
failures_min = 3
failure_ratio = 0.5
window_ms = 10000
cooldown_ms = 3000
probes = 1

[[tokens]]
name = "root"
role = "admin"
token = "fuzz-admin-secret"
"#;

/// (method, path before the tail, whether the tail is a path segment).
const ROUTES: &[(&str, &str, bool)] = &[
    ("POST", "/v1/jobs", false),
    ("POST", "/v1/jobs/batch", false),
    ("GET", "/v1/jobs", false),
    ("GET", "/v1/jobs/", true),
    ("GET", "/v1/jobs/{}/payload", true),
    ("POST", "/v1/jobs/{}/cancel", true),
    ("POST", "/v1/leases", false),
    ("POST", "/v1/jobs/{}/ack", true),
    ("POST", "/v1/jobs/{}/fail", true),
    ("POST", "/v1/jobs/{}/heartbeat", true),
    ("POST", "/v1/acks", false),
    ("POST", "/v1/fails", false),
    ("POST", "/v1/outcomes", false),
    ("GET", "/v1/dead-letters", false),
    ("POST", "/v1/dead-letters/redrive", false),
    ("POST", "/v1/dead-letters/purge", false),
    ("GET", "/v1/dead-letters/", true),
    ("POST", "/v1/dead-letters/{}/redrive", true),
    ("POST", "/v1/pause", false),
    ("POST", "/v1/resume", false),
    ("GET", "/v1/audit", false),
    ("POST", "/v1/tokens", false),
    ("GET", "/v1/stats", false),
    ("RAW", "", false),
];

struct Server {
    rt: tokio::runtime::Runtime,
    router: axum::Router,
}

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let dir = tempfile::tempdir().expect("a temporary directory").keep();
        let schemas = dir.join("schemas");
        std::fs::create_dir_all(&schemas).expect("schemas/");
        std::fs::write(
            schemas.join("send_email.v1.json"),
            r#"{"type": "object", "required": ["to"], "properties": {"to": {"type": "string"}}}"#,
        )
        .expect("v1");
        std::fs::write(
            schemas.join("send_email.v2.json"),
            r#"{"type": "object", "required": ["to", "subject"],
               "properties": {"to": {"type": "string"}, "subject": {"type": "string"}}}"#,
        )
        .expect("v2");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .expect("a runtime");
        let router = {
            let _in = rt.enter();
            let config = ServerConfig::from_toml_str(CONFIG, &dir).expect("the docs' config");
            let scheduler = FairScheduler::new(config.scheduler.clone()).expect("a scheduler");
            let decider = Arc::new(PolicyDecider::new(config.policies.clone()));
            let store =
                SqliteStore::open(&dir, Durability::Normal, scheduler, decider).expect("a store");
            lazaret_server::api::router(App::new(store, config))
        };
        Server { rt, router }
    })
}

fn request(data: &[u8]) -> Option<Request<Body>> {
    let (&which, rest) = data.split_first()?;
    let (tail, body) = match rest.iter().position(|&b| b == b'\n') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, &[][..]),
    };
    let tail = std::str::from_utf8(tail).ok()?;
    let (method, path) = match ROUTES[usize::from(which.wrapping_sub(b'A')) % ROUTES.len()] {
        ("RAW", _, _) => {
            let (m, p) = tail.split_once(' ')?;
            (Method::from_bytes(m.as_bytes()).ok()?, p.to_owned())
        }
        (m, p, true) if p.contains("{}") => (m.parse().ok()?, p.replace("{}", tail)),
        (m, p, true) => (m.parse().ok()?, format!("{p}{tail}")),
        (m, p, false) if tail.is_empty() => (m.parse().ok()?, p.to_owned()),
        (m, p, false) => (m.parse().ok()?, format!("{p}?{tail}")),
    };
    Request::builder()
        .method(method)
        .uri(path)
        .header("authorization", "Bearer fuzz-admin-secret")
        .header("content-type", "application/json")
        .body(Body::from(body.to_vec()))
        .ok()
}

fuzz_target!(|data: &[u8]| {
    let Some(req) = request(data) else {
        return;
    };
    let s = server();
    let (status, bytes) = s.rt.block_on(async {
        let resp = s.router.clone().oneshot(req).await.expect("infallible");
        let status = resp.status();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        (status, bytes)
    });
    let shown = String::from_utf8_lossy(&bytes);
    assert_ne!(status, StatusCode::INTERNAL_SERVER_ERROR, "a 500: {shown}");
    if status.is_client_error() || status.is_server_error() {
        let v: Value = serde_json::from_slice(&bytes)
            .unwrap_or_else(|e| panic!("a {status} that is not JSON ({e}): {shown}"));
        let error = &v["error"];
        assert!(
            error["code"].is_string(),
            "a {status} without error.code: {shown}"
        );
        assert!(
            error["message"]
                .as_str()
                .is_some_and(|m| !m.trim().is_empty()),
            "a {status} without a message: {shown}"
        );
    }
});
