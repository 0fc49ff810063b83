//! Alerts: `[[alerts]]` webhooks, checked with a local HTTP receiver.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Json;
use axum::extract::State;
use axum::routing::post;
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

use crate::harness::{EVENTUALLY, QUICK, Server, job, lease_req};

/// A webhook receiver on 127.0.0.1: keeps every body it is POSTed.
struct Receiver {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
    notify: Arc<tokio::sync::Notify>,
}

#[derive(Clone)]
struct Sink(Arc<Mutex<Vec<Value>>>, Arc<tokio::sync::Notify>);

async fn keep(State(sink): State<Sink>, Json(body): Json<Value>) -> &'static str {
    sink.0.lock().unwrap().push(body);
    sink.1.notify_waiters();
    "ok"
}

impl Receiver {
    async fn start() -> Receiver {
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let notify = Arc::new(tokio::sync::Notify::new());
        let app = axum::Router::new()
            .route("/hook", post(keep))
            .with_state(Sink(Arc::clone(&bodies), Arc::clone(&notify)));
        Receiver {
            url: format!("{}/hook", crate::harness::serve_app(app).await),
            bodies,
            notify,
        }
    }

    fn all(&self) -> Vec<Value> {
        self.bodies.lock().unwrap().clone()
    }

    /// Waits until an alert with `event` and `type` has arrived; returns it.
    async fn wait_for(&self, event: &str, ty: Option<&str>, server: &Server) -> Value {
        let deadline = Instant::now() + EVENTUALLY;
        loop {
            let notified = self.notify.notified();
            if let Some(a) = self
                .all()
                .into_iter()
                .find(|a| a["event"] == event && a["type"].as_str() == ty)
            {
                return a;
            }
            assert!(
                Instant::now() < deadline,
                "no {event} alert for {ty:?} within {EVENTUALLY:?}; got {:#?}\nserver log:\n{}",
                self.all(),
                server.log()
            );
            let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
        }
    }
}

/// `n` jobs of `ty`, each leased and failed permanently with `message(i)`.
async fn dead_letter(server: &Server, ty: &str, n: usize, message: impl Fn(usize) -> String) {
    let api = server.api();
    for i in 0..n {
        let id = api.enqueue_ok(&job(ty, "acme", json!({"n": i}))).await;
        let mut req = lease_req("w", 1, 30_000);
        req["types"] = json!([ty]);
        let leased = api.lease_one(&req).await;
        assert_eq!(leased["id"], id);
        api.fail(
            &id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "declined", "message": message(i)}),
        )
        .await
        .expect(200);
    }
}

fn config(url: &str, extra: &str) -> String {
    format!(
        "dead_letters_warn = 4
{QUICK}
[types.fragile]
attempts_max = 10
backoff_base_ms = 20
backoff_cap_ms = 20

[types.fragile.breaker]
failures_min = 2
failure_ratio = 0.5
window_ms = 60000
cooldown_ms = 1000
probes = 1

[[alerts]]
url = \"{url}\"
cooldown_ms = 600000
poison_rate_per_min = 3
surge_min = 5
{extra}"
    )
}

/// Counts of each (event, type, reason) received.
fn tally(alerts: &[Value]) -> Vec<String> {
    let mut keys: Vec<String> = alerts
        .iter()
        .map(|a| {
            format!(
                "{} {} {}",
                a["event"].as_str().unwrap(),
                a["type"],
                a["reason"]
            )
        })
        .collect();
    keys.sort();
    keys
}

#[tokio::test]
async fn each_event_fires_once_per_condition_and_cooldown() {
    let receiver = Receiver::start().await;
    let server = Server::start(&config(&receiver.url, "")).await;
    let api = server.api();

    // Six dead letters of one failure: a type that had none, a poison rate
    // over 3 a minute, a surge (6 of 6, at least 5), more than 4 held.
    dead_letter(&server, "charge", 6, |i| {
        format!("card declined for order {i}")
    })
    .await;
    let appeared = receiver
        .wait_for("dead_letters_appeared", Some("charge"), &server)
        .await;
    let surge = receiver
        .wait_for("reason_surge", Some("charge"), &server)
        .await;
    receiver
        .wait_for("poison_rate", Some("charge"), &server)
        .await;
    let warn = receiver
        .wait_for("dead_letters_over_warn", None, &server)
        .await;

    // The body is the contract's, with nothing else in it.
    let mut keys: Vec<&str> = surge
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "at",
            "count",
            "event",
            "link",
            "reason",
            "summary",
            "systemic",
            "top_reasons",
            "type",
            "window_ms"
        ]
    );
    assert_eq!(surge["reason"], "permanent");
    assert_eq!(surge["systemic"], true, "{surge}");
    assert_eq!(surge["window_ms"], 300_000);
    assert!(surge["count"].as_u64().unwrap() >= 5, "{surge}");
    assert_eq!(
        surge["link"],
        "/#/dead-letters?type=charge&reason=permanent"
    );
    assert_eq!(
        surge["top_reasons"][0],
        json!({"reason": "permanent", "kind": "declined", "count": surge["top_reasons"][0]["count"]})
    );
    assert!(
        surge["summary"]
            .as_str()
            .unwrap()
            .contains("card declined for order <n>"),
        "{surge}"
    );
    assert!(
        humantime::parse_rfc3339(surge["at"].as_str().unwrap()).is_ok(),
        "{surge}"
    );
    assert_eq!(appeared["link"], "/#/dead-letters?type=charge");
    assert_eq!(warn["type"], Value::Null);
    assert!(warn["count"].as_u64().unwrap() > 4, "{warn}");

    // A breaker opens (two 503s) and closes (after its cooldown, a probe succeeds).
    for n in 0..2 {
        api.enqueue_ok(&job("fragile", "acme", json!({"n": n})))
            .await;
    }
    let mut req = lease_req("w", 1, 30_000);
    req["types"] = json!(["fragile"]);
    for _ in 0..2 {
        let leased = api.lease_one(&req).await;
        api.fail(
            &leased["id"],
            &leased["lease_token"],
            json!({"class": "transient", "kind": "http_503", "message": "down"}),
        )
        .await
        .expect(200);
    }
    let opened = receiver
        .wait_for("breaker_opened", Some("fragile"), &server)
        .await;
    assert_eq!(opened["reason"], "http_503");
    assert_eq!(opened["link"], "/#/breakers?type=fragile");
    let probe = api.lease_one(&req).await; // half-open: the probe
    api.ack(&probe["id"], &probe["lease_token"])
        .await
        .expect(200);
    receiver
        .wait_for("breaker_closed", Some("fragile"), &server)
        .await;

    // The same conditions again, within the cooldown: nothing new. A new
    // type's first dead letter, written after them, marks when every
    // check that saw them has been made (one queue, delivered in order).
    dead_letter(&server, "charge", 6, |i| {
        format!("card declined for order {i}")
    })
    .await;
    dead_letter(&server, "sentinel", 1, |_| "x".into()).await;
    receiver
        .wait_for("dead_letters_appeared", Some("sentinel"), &server)
        .await;
    let got = tally(&receiver.all());
    let mut want = vec![
        "breaker_closed \"fragile\" \"http_503\"",
        "breaker_opened \"fragile\" \"http_503\"",
        "dead_letters_appeared \"charge\" null",
        "dead_letters_appeared \"sentinel\" null",
        "dead_letters_over_warn null null",
        "poison_rate \"charge\" null",
        "reason_surge \"charge\" \"permanent\"",
    ];
    want.sort_unstable();
    assert_eq!(
        got,
        want,
        "each (event, type, reason) once: {:#?}",
        receiver.all()
    );

    // Counted once the receiver answered, which is just after it kept the body.
    let text = metrics_until(&server, "lazaret_alerts_sent_total", 7.0).await;
    assert_eq!(
        metric_sum(&text, "lazaret_alerts_sent_total"),
        7.0,
        "{text}"
    );
}

/// The sum of a family's samples in the exposition `text`.
fn metric_sum(text: &str, family: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")) || l.starts_with(&format!("{family} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// `/metrics` once `family` sums to at least `min`.
async fn metrics_until(server: &Server, family: &str, min: f64) -> String {
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        let text = server.api().get("/metrics").await.text();
        if metric_sum(&text, family) >= min {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{family} never reached {min}: {text}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_surge_of_one_reason_is_systemic_and_a_scatter_is_not() {
    let receiver = Receiver::start().await;
    let server = Server::start(&config(
        &receiver.url,
        "events = [\"poison_rate\", \"reason_surge\", \"dead_letters_appeared\"]",
    ))
    .await;

    // Eight dead letters, eight different failures (letters-only words, so
    // that each message is its own fingerprint).
    let words = [
        "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel",
    ];
    dead_letter(&server, "import", 8, |i| {
        format!("column {} is missing", words[i])
    })
    .await;
    dead_letter(&server, "sentinel", 1, |_| "x".into()).await;
    receiver
        .wait_for("dead_letters_appeared", Some("sentinel"), &server)
        .await;
    let rate = receiver
        .wait_for("poison_rate", Some("import"), &server)
        .await;
    assert_eq!(rate["systemic"], false, "{rate}");
    assert!(
        receiver.all().iter().all(|a| a["event"] != "reason_surge"),
        "a scatter is no surge: {:#?}",
        receiver.all()
    );
    assert!(
        rate["top_reasons"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["reason"] == "permanent"),
        "{rate}"
    );

    // Now one failure floods another type (20 of 29 recent dead letters would
    // not do: 8 + 1 scattered ones stay in the window, so 40 make it 40/49).
    dead_letter(&server, "charge", 40, |i| {
        format!("card declined for order {i}")
    })
    .await;
    let surge = receiver
        .wait_for("reason_surge", Some("charge"), &server)
        .await;
    assert_eq!(surge["systemic"], true, "{surge}");
    assert_eq!(surge["reason"], "permanent", "{surge}");
    // (Its poison_rate alert may come before the surge holds, and is then
    // not systemic: which poll sees how many is up to the machine.)
}

#[tokio::test]
async fn a_dead_receiver_does_not_slow_enqueues_and_failed_deliveries_are_counted() {
    // A port that refuses: bound, then closed.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    drop(listener);
    let server = Server::start(&config(&url, "")).await;
    let api = server.api();

    dead_letter(&server, "charge", 6, |i| {
        format!("card declined for order {i}")
    })
    .await;
    // While the alerts about them fail and retry, enqueues go on.
    for n in 0..200 {
        let r = api.enqueue(&job("report", "acme", json!({"n": n}))).await;
        assert_eq!(
            r.status,
            201,
            "enqueue {n} while the receiver is down: {}",
            r.text()
        );
    }
    let text = metrics_until(&server, "lazaret_alerts_failed_total", 1.0).await;
    assert_eq!(
        metric_sum(&text, "lazaret_alerts_sent_total"),
        0.0,
        "{text}"
    );
    let log = server.log();
    assert!(log.contains("alert not delivered"), "{log}");
    assert!(
        !log.contains("/hook"),
        "the webhook path stays out of the log: {log}"
    );
}

/// A webhook receiver that accepts every connection, reads the request
/// and never answers: each request stays open until the client gives up
/// or the test ends. It counts the requests it holds open now.
struct Silent {
    url: String,
    open: Arc<AtomicUsize>,
    received: Arc<AtomicUsize>,
    notify: Arc<tokio::sync::Notify>,
}

impl Silent {
    async fn start() -> Silent {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hook", listener.local_addr().unwrap());
        let open = Arc::new(AtomicUsize::new(0));
        let received = Arc::new(AtomicUsize::new(0));
        let notify = Arc::new(tokio::sync::Notify::new());
        let (o, r, n) = (
            Arc::clone(&open),
            Arc::clone(&received),
            Arc::clone(&notify),
        );
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let (open, received, notify) = (Arc::clone(&o), Arc::clone(&r), Arc::clone(&n));
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    open.fetch_add(1, Ordering::SeqCst);
                    received.fetch_add(1, Ordering::SeqCst);
                    notify.notify_waiters();
                    // Read on (the body) and never write: held until the
                    // client closes its end.
                    while let Ok(n) = stream.read(&mut buf).await {
                        if n == 0 {
                            break;
                        }
                    }
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        Silent {
            url,
            open,
            received,
            notify,
        }
    }

    /// Waits until the receiver holds at least one request open.
    async fn wait_holding(&self, server: &Server) {
        let deadline = Instant::now() + EVENTUALLY;
        loop {
            let notified = self.notify.notified();
            if self.open.load(Ordering::SeqCst) > 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no alert request reached the receiver within {EVENTUALLY:?}\nserver log:\n{}",
                server.log()
            );
            let _ = tokio::time::timeout(Duration::from_millis(200), notified).await;
        }
    }
}

#[tokio::test]
async fn a_receiver_that_never_answers_does_not_hold_up_the_job_path() {
    let receiver = Silent::start().await;
    let server = Server::start(&config(&receiver.url, "")).await;
    let api = server.api();

    // One dead letter: its alert goes out and the receiver holds it open.
    dead_letter(&server, "charge", 1, |_| "card declined".into()).await;
    receiver.wait_holding(&server).await;

    // Meanwhile, the job path: 400 jobs of 400 new types enqueued, leased
    // and failed into dead letters, each of which is one more alert
    // (`dead_letters_appeared` for its type) for the stuck target. Every
    // request is answered (each within the harness's usual deadline).
    const TYPES: usize = 400;
    let batch: Vec<Value> = (0..TYPES)
        .map(|i| job(&format!("t{i}"), "acme", json!({ "n": i })))
        .collect();
    let r = api.post("/v1/jobs/batch", &json!({ "jobs": batch })).await;
    let results = r.expect(200)["results"].clone();
    assert!(
        results
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["state"] == "queued"),
        "{results}"
    );
    let mut leased = Vec::new();
    while leased.len() < TYPES {
        leased.extend(api.lease_eventually(&lease_req("w", 1000, 30_000)).await);
    }
    let fails: Vec<Value> = leased
        .iter()
        .map(|j| {
            json!({"id": j["id"], "lease_token": j["lease_token"],
                        "error": {"class": "permanent", "kind": "bad", "message": "no"}})
        })
        .collect();
    let r = api.post("/v1/fails", &json!({ "items": fails })).await;
    let results = r.expect(200)["results"].clone();
    assert!(
        results
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["state"] == "dead_lettered"),
        "{results}"
    );
    let r = api.enqueue(&job("report", "acme", json!({}))).await;
    assert_eq!(r.status, 201, "{}", r.text());

    // The alerts queue (256) overflowed: the poller dropped and counted
    // the rest instead of waiting for the receiver. Only drops reach 100
    // here: one delivery takes several held tries before it fails.
    let text = metrics_until(&server, "lazaret_alerts_failed_total", 100.0).await;
    assert_eq!(
        metric_sum(&text, "lazaret_alerts_sent_total"),
        0.0,
        "nothing was answered, so nothing counts as sent: {text}"
    );
    assert!(
        server
            .log()
            .contains("alert dropped: the target's queue is full"),
        "{}",
        server.log()
    );
    assert!(receiver.received.load(Ordering::SeqCst) >= 1);
}

#[tokio::test]
async fn top_level_surge_thresholds_set_the_stats_surge_too() {
    let server = Server::start(&format!("surge_min = 3\nsurge_share = 0.9\n{QUICK}")).await;
    dead_letter(&server, "charge", 2, |i| {
        format!("card declined for order {i}")
    })
    .await;
    let stats = server.api().get("/v1/stats").await;
    assert_eq!(
        stats.expect(200)["dead_letters"]["surge"],
        Value::Null,
        "2 is under 3"
    );
    dead_letter(&server, "charge", 1, |i| {
        format!("card declined for order {i}")
    })
    .await;
    let stats = server.api().get("/v1/stats").await;
    let surge = stats.expect(200)["dead_letters"]["surge"].clone();
    assert_eq!(surge["count"], 3, "{surge}");
}
