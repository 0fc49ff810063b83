//! Hostile values from a real RabbitMQ message and a real HTTP handler
//! (issue #32): a content type that is no header value, a handler that
//! redirects, an error answer of 200 MB, broker headers too large for one
//! HTTP header, an `x-lazaret-attempt` out of range, and names from the
//! message that break the name rule. The guard runs with the real
//! [`HttpHandler`] against an axum handler in this test.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString};
use lazaret_core::{BreakerConfig, Breakers, DeadLetterReason, FailureClass, JobType};
use lazaret_guard::rabbitmq::json_to_table;
use lazaret_guard::{DeliverFormat, Faults, Host, HttpHandler, LocalHost, Mode};
use lazaret_store::SqliteStore;
use serde_json::{Value, json};

use crate::common::{
    self, TestBroker, dead_letters_of, headers, open_store, policies, unique, wait_dead_letters,
};
use crate::rabbitmq::{Rabbit, rabbit_or_skip};

/// How long any one wait here may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(60);

/// One request the handler got.
#[derive(Clone, Debug)]
struct Request {
    path: String,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

impl Request {
    fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }

    /// `Lazaret-Message-Id` (the ids here are alphanumeric, which
    /// percent-encoding leaves as they are).
    fn message_id(&self) -> &str {
        self.header("lazaret-message-id")
    }
}

/// The handler: records every request; `/ok` answers 200, `/moved` 301 to
/// `/final`, `/huge` a 500 whose body streams 200 MB (counted as it is
/// handed to the connection).
#[derive(Clone, Default)]
struct Team {
    requests: Arc<Mutex<Vec<Request>>>,
    /// Bytes of the 200 MB answer handed to the connection.
    huge_sent: Arc<AtomicU64>,
    /// Whether the 200 MB answer was dropped before its end (the guard
    /// dropped the connection).
    huge_cut: Arc<AtomicBool>,
}

/// The size of the error answer that must not be read whole.
const HUGE_BYTES: u64 = 200 * 1024 * 1024;

async fn record(State(team): State<Team>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let req = Request {
        path: uri.path().to_owned(),
        headers: headers
            .iter()
            .map(|(k, v)| {
                (
                    k.as_str().to_owned(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body: body.to_vec(),
    };
    team.requests.lock().unwrap().push(req);
    match uri.path() {
        "/moved" => (StatusCode::MOVED_PERMANENTLY, [("location", "/final")]).into_response(),
        "/huge" => huge_answer(&team),
        _ => StatusCode::OK.into_response(),
    }
}

/// A 500 with 200 MB of text, made 64 KiB at a time as the connection
/// takes it (never held in memory).
fn huge_answer(team: &Team) -> Response {
    struct Cut(Arc<AtomicBool>, Arc<AtomicU64>);
    impl Drop for Cut {
        fn drop(&mut self) {
            if self.1.load(Ordering::SeqCst) < HUGE_BYTES {
                self.0.store(true, Ordering::SeqCst);
            }
        }
    }
    let sent = Arc::clone(&team.huge_sent);
    let cut = Cut(Arc::clone(&team.huge_cut), Arc::clone(&sent));
    let chunk = Bytes::from(vec![b'x'; 64 * 1024]);
    let stream = futures_util::stream::unfold((cut, 0u64), move |(cut, done)| {
        let chunk = chunk.clone();
        let sent = Arc::clone(&sent);
        async move {
            if done >= HUGE_BYTES {
                return None;
            }
            sent.fetch_add(chunk.len() as u64, Ordering::SeqCst);
            Some((
                Ok::<_, std::io::Error>(chunk.clone()),
                (cut, done + chunk.len() as u64),
            ))
        }
    });
    (StatusCode::INTERNAL_SERVER_ERROR, Body::from_stream(stream)).into_response()
}

impl Team {
    /// Serves on a free port; the base URL.
    async fn start(&self) -> String {
        let app = Router::new().fallback(record).with_state(self.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the handler");
        let addr = listener.local_addr().expect("its address");
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }

    fn all(&self) -> Vec<Request> {
        self.requests.lock().unwrap().clone()
    }

    /// Waits until `n` requests whose path is `path` arrived.
    async fn wait(&self, path: &str, n: usize) -> Vec<Request> {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let seen: Vec<Request> = self.all().into_iter().filter(|r| r.path == path).collect();
            if seen.len() >= n {
                return seen;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{n} requests to {path} not seen within {PATIENCE:?}: {} seen",
                seen.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A host whose type `orders` has a breaker that opens after 5 transient
/// failures of one kind and stays open a minute.
fn host_with_breaker(dir: &std::path::Path, attempts_max: u32) -> Arc<LocalHost<SqliteStore>> {
    let breaker = BreakerConfig {
        failures_min: 5,
        failure_ratio: 0.5,
        window: Duration::from_secs(30),
        cooldown: Duration::from_secs(60),
        probes: 1,
    };
    Arc::new(LocalHost::new(
        open_store(dir),
        policies("orders", attempts_max, Duration::from_millis(50)),
        Breakers::new(None, [(JobType::from("orders"), breaker)].into()),
    ))
}

/// A guard of a fresh queue delivering to `url` with the real HTTP handler.
async fn guard(
    b: &Rabbit,
    prefix: &str,
    host: Arc<LocalHost<SqliteStore>>,
    url: String,
    format: DeliverFormat,
) -> (String, String, common::Running) {
    let queue = b.fresh_queue(prefix).await;
    let name = unique(prefix);
    let mut spec = b.spec(&name, &queue, Mode::Guard);
    spec.concurrency = 2;
    spec.delivery_timeout = Duration::from_secs(10);
    let handler = Arc::new(HttpHandler::new(url).with_format(format));
    let running = common::start_guard(b, spec, host, handler, Faults::default()).await;
    (queue, name, running)
}

/// Finding 4: a content type with CR/LF is the message's fault. It goes to
/// the handler as `application/octet-stream` with the raw value kept in
/// `Lazaret-Headers`; it never counts as a `connect` failure, so ten of
/// them do not open the breaker and starve the healthy messages behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_type_with_crlf_is_sent_as_octet_stream_and_never_opens_the_breaker() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let team = Team::default();
    let url = format!("{}/ok", team.start().await);
    let host = host_with_breaker(dir.path(), 3);
    let (queue, name, g) = guard(&b, "ctype", Arc::clone(&host), url, DeliverFormat::Raw).await;
    let bad = "text/plain\r\nX-Evil: 1\0";
    for i in 0..10 {
        let props = BasicProperties::default()
            .with_message_id(format!("bad{i}").as_str().into())
            .with_content_type(bad.into());
        b.publish(&queue, props, b"bad").await;
    }
    for i in 0..40 {
        let props = BasicProperties::default()
            .with_message_id(format!("good{i}").as_str().into())
            .with_content_type("application/json".into());
        b.publish(&queue, props, b"{}").await;
    }
    let seen = team.wait("/ok", 50).await;
    g.stop().await.unwrap();
    for r in &seen {
        assert_eq!(r.header("lazaret-attempt"), "1", "{r:?}");
        if r.message_id().starts_with("bad") {
            assert_eq!(r.header("content-type"), "application/octet-stream");
            assert!(!r.headers.contains_key("x-evil"), "{r:?}");
            let kept: Value = serde_json::from_str(r.header("lazaret-headers")).unwrap();
            assert_eq!(kept["x-lazaret-content-type"], bad, "{r:?}");
        } else {
            assert_eq!(r.header("content-type"), "application/json");
        }
    }
    assert!(dead_letters_of(host.store(), &name).await.is_empty());
}

/// Finding 7: a redirect is never followed; it is a permanent failure of
/// kind `http_301` that names where it pointed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_redirect_is_a_permanent_http_301_and_is_not_followed() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let team = Team::default();
    let url = format!("{}/moved", team.start().await);
    let host = host_with_breaker(dir.path(), 3);
    let (queue, name, g) = guard(&b, "moved", Arc::clone(&host), url, DeliverFormat::Raw).await;
    b.produce(&queue, "m-moved", b"{}", headers(json!({})))
        .await;
    let dls = wait_dead_letters(host.store(), &name, 1, PATIENCE).await;
    g.stop().await.unwrap();
    let dl = &dls[0];
    assert_eq!(dl.reason, DeadLetterReason::Permanent, "{dl:#?}");
    let error = dl.error.as_ref().expect("the handler's failure");
    assert_eq!(error.kind.as_str(), "http_301");
    assert_eq!(error.class, Some(FailureClass::Permanent));
    assert_eq!(
        error.message,
        "the handler redirected to /final; point `deliver` at the final URL"
    );
    let paths: Vec<String> = team.all().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, vec!["/moved"], "the redirect was not followed");
}

/// A line of this process's `/proc/self/status` in kB (`VmRSS`, `VmHWM`).
fn status_kb(key: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

/// Finding 13: at most 64 KiB of an error answer is read, then the
/// connection is dropped: a 200 MB answer is never read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_200_mb_error_answer_is_not_read_whole() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let team = Team::default();
    let url = format!("{}/huge", team.start().await);
    let host = host_with_breaker(dir.path(), 1);
    let before = status_kb("VmRSS:");
    let (queue, name, g) = guard(&b, "huge", Arc::clone(&host), url, DeliverFormat::Raw).await;
    for i in 0..2 {
        b.produce(&queue, &format!("m-huge-{i}"), b"{}", headers(json!({})))
            .await;
    }
    let dls = wait_dead_letters(host.store(), &name, 2, PATIENCE).await;
    g.stop().await.unwrap();
    let (after, peak) = (status_kb("VmRSS:"), status_kb("VmHWM:"));
    let sent = team.huge_sent.load(Ordering::SeqCst);
    eprintln!(
        "two 200 MB error answers: {} MiB handed to the connections; RSS {before} kB before, {after} kB after, peak {peak} kB",
        sent / (1024 * 1024)
    );
    assert!(
        team.huge_cut.load(Ordering::SeqCst),
        "the guard dropped the connection before the answer's end"
    );
    assert!(
        sent < 2 * HUGE_BYTES / 4,
        "{sent} bytes of 2 × 200 MB were taken by the guard"
    );
    for dl in &dls {
        let error = dl.error.as_ref().expect("the handler's failure");
        assert_eq!(error.kind.as_str(), "http_500");
        assert!(error.message.len() < 1024, "{}", error.message.len());
    }
}

/// Finding 15: broker headers are cut to 6 KiB in `Lazaret-Headers` (and
/// the handler is told), and `deliver_format = "envelope"` carries them
/// whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_120_kb_header_is_cut_in_lazaret_headers_and_whole_in_the_envelope() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let team = Team::default();
    let base = team.start().await;
    let host = host_with_breaker(dir.path(), 1);
    let big = "b".repeat(120 * 1024);
    let h = headers(json!({"big": big, "trace": "t-1"}));
    let props = |id: &str| {
        BasicProperties::default()
            .with_message_id(id.into())
            .with_content_type("application/json".into())
            .with_headers(json_to_table(&h))
    };
    let (queue, name, g) = guard(
        &b,
        "bighdr",
        Arc::clone(&host),
        format!("{base}/raw"),
        DeliverFormat::Raw,
    )
    .await;
    b.publish(&queue, props("m-raw"), b"{\"a\": 1}").await;
    let raw = team.wait("/raw", 1).await;
    g.stop().await.unwrap();
    let r = &raw[0];
    assert!(dead_letters_of(host.store(), &name).await.is_empty());
    assert!(
        r.header("lazaret-headers").len() <= 6 * 1024,
        "{}",
        r.header("lazaret-headers").len()
    );
    assert_eq!(
        serde_json::from_str::<Value>(r.header("lazaret-headers")).unwrap(),
        json!({"trace": "t-1"})
    );
    assert_eq!(r.header("lazaret-headers-truncated"), "true");
    assert_eq!(r.body, b"{\"a\": 1}", "the body byte for byte");

    let (queue, _, g) = guard(
        &b,
        "bighdr-env",
        Arc::clone(&host),
        format!("{base}/envelope"),
        DeliverFormat::Envelope,
    )
    .await;
    b.publish(&queue, props("m-env"), b"{\"a\": 1}").await;
    let env = team.wait("/envelope", 1).await;
    g.stop().await.unwrap();
    let e = &env[0];
    assert_eq!(e.header("content-type"), "application/json");
    let body: Value = serde_json::from_slice(&e.body).unwrap();
    assert_eq!(body["headers"], json!({"big": big, "trace": "t-1"}));
    assert_eq!(body["body"], "{\"a\": 1}");
    assert_eq!(body["content_type"], "application/json");
    assert_eq!(body["message_id"], "m-env");
}

/// Finding 17: one rule for `x-lazaret-attempt`: any integer ≥ 0 is taken
/// (saturating), anything else is 0; a message already charged its whole
/// budget is dead-lettered `exhausted` without a delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_header_at_or_over_the_budget_is_exhausted_undelivered() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let team = Team::default();
    let url = format!("{}/ok", team.start().await);
    let host = host_with_breaker(dir.path(), 3);
    let (queue, name, g) = guard(&b, "attempt", Arc::clone(&host), url, DeliverFormat::Raw).await;
    let cases = [
        (
            "m2e31",
            AMQPValue::LongString(LongString::from("2147483648")),
        ),
        ("mi64max", AMQPValue::LongLongInt(i64::MAX)),
        ("m3", AMQPValue::LongString(LongString::from("3"))),
        ("mneg", AMQPValue::LongLongInt(-1)),
        ("m2", AMQPValue::LongString(LongString::from("2"))),
    ];
    for (id, v) in cases {
        let mut t = FieldTable::default();
        t.insert("x-lazaret-attempt".into(), v);
        let props = BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(t);
        b.publish(&queue, props, b"{}").await;
    }
    let seen = team.wait("/ok", 2).await;
    let dls = wait_dead_letters(host.store(), &name, 3, PATIENCE).await;
    g.stop().await.unwrap();
    let attempts: HashMap<String, String> = team
        .all()
        .iter()
        .map(|r| {
            (
                r.message_id().to_owned(),
                r.header("lazaret-attempt").to_owned(),
            )
        })
        .collect();
    assert_eq!(seen.len(), 2, "{attempts:?}");
    assert_eq!(
        attempts.get("mneg").map(String::as_str),
        Some("1"),
        "malformed: 0"
    );
    assert_eq!(attempts.get("m2").map(String::as_str), Some("3"));
    let mut ids: Vec<&str> = dls
        .iter()
        .map(|d| d.source.as_ref().map_or("", |s| s.message_id.as_str()))
        .collect();
    ids.sort_unstable();
    assert_eq!(ids, vec!["m2e31", "m3", "mi64max"]);
    for dl in &dls {
        assert_eq!(dl.reason, DeadLetterReason::Exhausted, "{dl:#?}");
        assert!(dl.history.is_empty(), "never delivered: {dl:#?}");
    }
}

/// Finding 11: a tenant from a message header and a Celery task name taken
/// in by a watch follow the name rule; a bad one falls back to the default
/// tenant or the source's type, the full value kept in the headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_from_a_message_follow_the_name_rule_or_fall_back() {
    let Some(b) = rabbit_or_skip().await else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let host = host_with_breaker(dir.path(), 1);
    let long = "t".repeat(100_000);
    let bad_names = [long.as_str(), "tasks.add\nX", "a\0b"];

    // A guard reading the tenant from a header; the handler refuses.
    let team = Team::default();
    let url = format!("{}/moved", team.start().await);
    let queue = b.fresh_queue("tenant").await;
    let name = unique("tenant");
    let mut spec = b.spec(&name, &queue, Mode::Guard);
    spec.tenant = lazaret_guard::TenantFrom::Header("x-tenant".into());
    let g = common::start_guard(
        &b,
        spec,
        Arc::clone(&host),
        Arc::new(HttpHandler::new(url)),
        Faults::default(),
    )
    .await;
    for (i, t) in bad_names.iter().enumerate() {
        b.produce(
            &queue,
            &format!("m-{i}"),
            b"{}",
            headers(json!({"x-tenant": t})),
        )
        .await;
    }
    let dls = wait_dead_letters(host.store(), &name, 3, PATIENCE).await;
    g.stop().await.unwrap();
    for dl in &dls {
        assert_eq!(dl.tenant.as_deref(), Some("default"), "{:?}", dl.tenant);
        let kept = &dl.source.as_ref().expect("its source").headers["x-tenant"];
        assert!(bad_names.contains(&kept.as_str().unwrap_or_default()));
    }

    // A watch taking in Celery tasks whose names break the rule.
    let dlq = b.fresh_queue("celery-dlq").await;
    let wname = unique("celery-watch");
    let w = common::start_watch(
        b.spec(&wname, &dlq, Mode::Watch),
        Arc::clone(&host),
        Faults::default(),
    )
    .await;
    for (i, t) in bad_names.iter().enumerate() {
        b.produce(
            &dlq,
            &format!("c-{i}"),
            b"[[], {}, {}]",
            headers(json!({"task": t, "id": format!("c-{i}")})),
        )
        .await;
    }
    let dls = wait_dead_letters(host.store(), &wname, 3, PATIENCE).await;
    w.stop().await.unwrap();
    for dl in &dls {
        assert_eq!(dl.job_type.as_deref(), Some("orders"), "the source's type");
        let message = &dl.error.as_ref().expect("the Celery failure").message;
        assert!(message.len() < 1024 && !message.contains('\n'), "{message}");
        let kept = &dl.source.as_ref().expect("its source").headers["task"];
        assert!(bad_names.contains(&kept.as_str().unwrap_or_default()));
    }
}
