//! Every route refuses a token of the wrong role with 403 before a byte of
//! the request's body is read (issue #28, part 2).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use futures_util::StreamExt as _;
use lazaret_core::FairScheduler;
use lazaret_server::api::routes::{Access, BodyCap};
use lazaret_server::app::App;
use lazaret_server::auth::Role;
use lazaret_server::config::ServerConfig;
use lazaret_store::PolicyDecider;
use lazaret_store::{Durability, SqliteStore};
use tower::ServiceExt as _;

const TOKENS: &str = r#"
[[tokens]]
name = "p"
role = "producer"
token = "producer-secret"

[[tokens]]
name = "w"
role = "worker"
token = "worker-secret"

[[tokens]]
name = "o"
role = "operator"
token = "operator-secret"

[[tokens]]
name = "a"
role = "admin"
token = "admin-secret"
"#;

const ROLES: [(Role, &str); 4] = [
    (Role::Producer, "producer-secret"),
    (Role::Worker, "worker-secret"),
    (Role::Operator, "operator-secret"),
    (Role::Admin, "admin-secret"),
];

fn app(dir: &std::path::Path) -> Arc<App<SqliteStore>> {
    let config = ServerConfig::from_toml_str(TOKENS, dir).expect("a valid config");
    let scheduler = FairScheduler::new(config.scheduler.clone()).expect("scheduler");
    let decider = Arc::new(PolicyDecider::new(config.policies.clone()));
    let store = SqliteStore::open(dir, Durability::Normal, scheduler, decider).expect("a store");
    App::new(store, config)
}

/// A large body that records whether anyone started reading it.
fn watched_body(read: &Arc<AtomicBool>) -> Body {
    let read = Arc::clone(read);
    let chunks = futures_util::stream::iter(0..64).map(move |_| {
        read.store(true, Ordering::SeqCst);
        Ok::<_, std::io::Error>(vec![b' '; 64 * 1024])
    });
    Body::from_stream(chunks)
}

/// A path of the table with its parameters filled in.
fn sample(path: &str) -> String {
    path.replace("{id}", "1").replace("{name}", "x")
}

async fn send(
    app: &Arc<App<SqliteStore>>,
    method: &Method,
    path: &str,
    secret: Option<&str>,
    read: &Arc<AtomicBool>,
) -> axum::response::Response {
    let mut req = Request::builder()
        .method(method.clone())
        .uri(sample(path))
        .header("content-type", "application/json");
    if let Some(secret) = secret {
        req = req.header("authorization", format!("Bearer {secret}"));
    }
    lazaret_server::api::router(Arc::clone(app))
        .oneshot(req.body(watched_body(read)).unwrap())
        .await
        .expect("the router answers")
}

#[tokio::test]
async fn every_route_refuses_a_wrong_role_before_reading_the_body() {
    let dir = tempfile::TempDir::new().unwrap();
    let app = app(dir.path());
    let table = lazaret_server::api::routes::table::<SqliteStore>(&app.config);
    let mut failures = Vec::new();
    let mut refused = 0;
    for route in &table {
        let spec = route.spec();
        let Access::May(action) = spec.access else {
            continue;
        };
        for (role, secret) in ROLES {
            if action.allowed_for(role) {
                continue;
            }
            let read = Arc::new(AtomicBool::new(false));
            let resp = send(&app, &spec.method, spec.path, Some(secret), &read).await;
            let body_read = read.load(Ordering::SeqCst);
            let closed = resp.headers().get("connection").map(|v| v.as_bytes()) == Some(b"close");
            if resp.status() != StatusCode::FORBIDDEN
                || body_read
                || (spec.body != BodyCap::None && !closed)
            {
                failures.push(format!(
                    "{} {} as {}: {} (body read: {body_read}, closed: {closed})",
                    spec.method,
                    spec.path,
                    role.as_str(),
                    resp.status()
                ));
            }
            refused += 1;
        }
    }
    assert!(refused > 40, "the walk covered {refused} refusals");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn every_route_but_the_open_ones_refuses_an_unknown_token_before_reading_the_body() {
    let dir = tempfile::TempDir::new().unwrap();
    let app = app(dir.path());
    let table = lazaret_server::api::routes::table::<SqliteStore>(&app.config);
    let mut open = Vec::new();
    for route in &table {
        let spec = route.spec();
        for secret in [None, Some("nope")] {
            let read = Arc::new(AtomicBool::new(false));
            let resp = send(&app, &spec.method, spec.path, secret, &read).await;
            if spec.access == Access::Open {
                assert_ne!(
                    resp.status(),
                    StatusCode::UNAUTHORIZED,
                    "{} {}",
                    spec.method,
                    spec.path
                );
                open.push(spec.path);
                continue;
            }
            assert_eq!(
                resp.status(),
                StatusCode::UNAUTHORIZED,
                "{} {} with {secret:?}",
                spec.method,
                spec.path
            );
            assert!(
                !read.load(Ordering::SeqCst),
                "{} {}: body read",
                spec.method,
                spec.path
            );
            assert_eq!(
                resp.headers().get("connection").map(|v| v.as_bytes()),
                Some(&b"close"[..]),
                "{} {}",
                spec.method,
                spec.path
            );
        }
    }
    open.dedup();
    assert_eq!(
        open,
        [
            "/",
            "/dashboard/app.js",
            "/dashboard/app.css",
            "/healthz",
            "/metrics",
            "/openapi.json"
        ]
    );
}

/// The table is the contract's list of roles (docs/api.md, Auth): pinned
/// here so that a change of who may call a route is a visible diff.
#[test]
fn the_table_gives_each_route_the_contracts_role() {
    let dir = tempfile::TempDir::new().unwrap();
    let config = ServerConfig::from_toml_str(TOKENS, dir.path()).expect("a valid config");
    let table = lazaret_server::api::routes::table::<SqliteStore>(&config);
    let lines: Vec<String> = table
        .iter()
        .map(|r| {
            let s = r.spec();
            let who = match s.access {
                Access::Open => "open".to_owned(),
                Access::AnyToken => "any token".to_owned(),
                Access::May(a) => ROLES
                    .iter()
                    .filter(|(role, _)| a.allowed_for(*role))
                    .map(|(role, _)| role.as_str())
                    .collect::<Vec<_>>()
                    .join(" "),
            };
            format!("{:<6} {:<30} {who}", s.method.as_str(), s.path)
        })
        .collect();
    let want = "\
GET    /                              open
GET    /dashboard/app.js              open
GET    /dashboard/app.css             open
GET    /healthz                       open
GET    /metrics                       open
GET    /openapi.json                  open
GET    /v1/whoami                     any token
POST   /v1/jobs                       producer admin
GET    /v1/jobs                       producer operator admin
POST   /v1/jobs/batch                 producer admin
GET    /v1/jobs/{id}                  producer worker operator admin
GET    /v1/jobs/{id}/payload          producer worker operator admin
POST   /v1/jobs/{id}/cancel           producer operator admin
POST   /v1/leases                     worker admin
POST   /v1/jobs/{id}/ack              worker admin
POST   /v1/jobs/{id}/fail             worker admin
POST   /v1/jobs/{id}/heartbeat        worker admin
POST   /v1/acks                       worker admin
POST   /v1/fails                      worker admin
POST   /v1/outcomes                   worker admin
GET    /v1/dead-letters               operator admin
GET    /v1/dead-letters/reasons       operator admin
GET    /v1/dead-letters/groups        operator admin
POST   /v1/dead-letters/redrive       operator admin
POST   /v1/dead-letters/purge         admin
POST   /v1/dead-letters/archive       operator admin
POST   /v1/dead-letters/restore       operator admin
GET    /v1/dead-letters/{id}          operator admin
POST   /v1/dead-letters/{id}/redrive  operator admin
GET    /v1/dead-letters/{id}/payload  operator admin
GET    /v1/redrives/{id}              operator admin
GET    /v1/stats                      producer worker operator admin
GET    /v1/breakers                   producer worker operator admin
GET    /v1/series                     producer worker operator admin
POST   /v1/pause                      operator admin
POST   /v1/resume                     operator admin
GET    /v1/audit                      operator admin
GET    /v1/tokens                     admin
POST   /v1/tokens                     admin
DELETE /v1/tokens/{name}              admin";
    let got = lines
        .iter()
        .map(|l| l.trim_end())
        .collect::<Vec<_>>()
        .join("\n");
    assert_eq!(got, want);
}

/// What the table does not list: HEAD is checked as GET, and a method a
/// path does not take is 405 for any valid token (open paths need none).
#[tokio::test]
async fn head_is_checked_as_get_and_an_unknown_method_needs_only_a_token() {
    let dir = tempfile::TempDir::new().unwrap();
    let app = app(dir.path());
    let read = Arc::new(AtomicBool::new(false));
    let cases = [
        (
            Method::HEAD,
            "/v1/stats",
            Some("worker-secret"),
            StatusCode::OK,
        ),
        (
            Method::HEAD,
            "/v1/audit",
            Some("worker-secret"),
            StatusCode::FORBIDDEN,
        ),
        (
            Method::HEAD,
            "/v1/audit",
            Some("operator-secret"),
            StatusCode::OK,
        ),
        (
            Method::POST,
            "/healthz",
            None,
            StatusCode::METHOD_NOT_ALLOWED,
        ),
        (Method::PUT, "/v1/jobs", None, StatusCode::UNAUTHORIZED),
        (
            Method::PUT,
            "/v1/jobs",
            Some("worker-secret"),
            StatusCode::METHOD_NOT_ALLOWED,
        ),
        (
            Method::DELETE,
            "/v1/tokens",
            Some("producer-secret"),
            StatusCode::METHOD_NOT_ALLOWED,
        ),
    ];
    for (method, path, secret, want) in cases {
        let resp = send(&app, &method, path, secret, &read).await;
        assert_eq!(resp.status(), want, "{method} {path} with {secret:?}");
    }
}
