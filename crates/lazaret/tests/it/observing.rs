//! Observing: Prometheus metrics with the contract's names, stats, and circuit breakers that shed.

use serde_json::json;

use crate::harness::{QUICK, Server, assert_error, job, lease_req};

async fn start() -> Server {
    let config = format!(
        "{QUICK}
[types.fragile]
attempts_max = 5

[types.fragile.breaker]
failures_min = 2
failure_ratio = 0.5
window_ms = 60000
cooldown_ms = 60000
probes = 1
"
    );
    Server::start(&config).await
}

/// Fails two `fragile` deliveries with `http_503`: enough to open its breaker.
async fn trip_the_breaker(server: &Server) {
    let api = server.api();
    for n in 0..2 {
        api.enqueue_ok(&job("fragile", "acme", json!({"n": n})))
            .await;
    }
    let mut req = lease_req("w", 1, 30_000);
    req["types"] = json!(["fragile"]);
    for _ in 0..2 {
        // Either job: a retry of the first may come due before the second.
        let leased = api.lease_one(&req).await;
        api.fail(
            &leased["id"],
            &leased["lease_token"],
            json!({"class": "transient", "kind": "http_503", "message": "down"}),
        )
        .await
        .expect(200);
    }
}

#[tokio::test]
async fn an_open_breaker_sheds_its_type_and_parks_its_jobs() {
    let server = start().await;
    let api = server.api();
    trip_the_breaker(&server).await;

    let r = api.get("/v1/breakers").await;
    let body = r.expect(200);
    let open = body["breakers"]
        .as_array()
        .expect("a breakers list")
        .iter()
        .find(|b| b["type"] == "fragile" && b["kind"] == "http_503")
        .unwrap_or_else(|| panic!("the fragile/http_503 breaker: {body}"))
        .clone();
    assert_eq!(open["state"], "open", "{open}");
    assert!(open["until"].is_string(), "{open}");

    let r = api.enqueue(&job("fragile", "acme", json!({}))).await;
    assert_error(&r, 503, "SHED", None);
    assert!(
        r.headers.get("retry-after").is_some(),
        "SHED carries Retry-After"
    );

    // Its retries are parked, spending nothing; other types still flow.
    let mut req = lease_req("w", 10, 30_000);
    req["types"] = json!(["fragile"]);
    req["wait_ms"] = json!(500);
    assert!(
        api.lease(&req).await.is_empty(),
        "no lease while the breaker is open"
    );
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
}

#[tokio::test]
async fn metrics_carry_every_name_the_contract_lists() {
    let server = start().await;
    let api = server.api();

    // Give every metric something to count.
    let ok = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], ok);
    api.ack(&ok, &leased["lease_token"]).await.expect(200);

    let flaky = api
        .enqueue_ok(&job("report", "acme", json!({"n": 2})))
        .await;
    let leased = api.lease_one(&lease_req("w", 1, 300)).await; // expires
    assert_eq!(leased["id"], flaky);
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], flaky);
    api.fail(
        &flaky,
        &leased["lease_token"],
        json!({"class": "permanent", "kind": "bad", "message": "no"}),
    )
    .await
    .expect(200);
    api.post(
        "/v1/dead-letters/redrive",
        &json!({"filter": {"reason": "permanent"}}),
    )
    .await
    .expect(200);
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], flaky);
    api.fail(
        &flaky,
        &leased["lease_token"],
        json!({"class": "transient", "kind": "http_500", "message": "hm"}),
    )
    .await
    .expect(200);
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    api.ack(&flaky, &leased["lease_token"]).await.expect(200);
    trip_the_breaker(&server).await;
    // A job still waiting, so queue depth has something to say.
    api.enqueue_ok(&job("report", "acme", json!({"n": 3})))
        .await;
    // A dead letter held now.
    let last = api.enqueue_ok(&job("other", "acme", json!({}))).await;
    let mut req = lease_req("w", 1, 30_000);
    req["types"] = json!(["other"]);
    let leased = api.lease_one(&req).await;
    api.fail(
        &last,
        &leased["lease_token"],
        json!({"class": "permanent", "kind": "bad", "message": "no"}),
    )
    .await
    .expect(200);

    // A redriven job's outcome is counted by the group it was redriven
    // from, which the server reads off the ack's path.
    let group =
        api.get("/v1/dead-letters?type=other").await.expect(200)["items"][0]["group_id"].clone();
    assert!(group.is_string(), "dead letters carry their group: {group}");
    lazaret_testkit::eventually(
        "the redrive's success is counted with its group",
        || async {
            api.get("/metrics").await.text().lines().any(|l| {
                l.starts_with("lazaret_redrive_outcomes_total{")
                    && l.contains("outcome=\"succeeded\"")
                    && l.contains("group=\"")
                    && !l.contains("group=\"\"")
            })
        },
    )
    .await;

    let r = api.get("/metrics").await;
    assert_eq!(r.status, 200);
    let text = r.text();
    let samples: Vec<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .collect();
    let has = |name: &str| {
        samples.iter().any(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
    };
    for name in [
        "lazaret_dead_letters",
        "lazaret_dead_lettered_total",
        "lazaret_redriven_total",
        "lazaret_redrive_outcomes_total",
        "lazaret_jobs_enqueued_total",
        "lazaret_jobs_succeeded_total",
        "lazaret_jobs_retried_total",
        "lazaret_queue_depth",
        "lazaret_lease_expired_total",
        "lazaret_breaker_open",
    ] {
        assert!(has(name), "/metrics has a sample of {name}:\n{text}");
    }
    let labelled = |name: &str, labels: &[&str]| {
        samples.iter().any(|l| {
            l.starts_with(&format!("{name}{{"))
                && labels.iter().all(|k| l.contains(&format!("{k}=\"")))
        })
    };
    assert!(
        labelled("lazaret_dead_letters", &["type", "reason"]),
        "{text}"
    );
    assert!(
        labelled("lazaret_dead_lettered_total", &["type", "reason", "stage"]),
        "{text}"
    );
    assert!(
        labelled("lazaret_redrive_outcomes_total", &["outcome", "group"]),
        "{text}"
    );
    assert!(labelled("lazaret_queue_depth", &["lane"]), "{text}");
    assert!(labelled("lazaret_breaker_open", &["type"]), "{text}");

    let r = api.get("/v1/stats").await;
    let stats = r.expect(200);
    // Group commit is visible: the requests above were committed, and no
    // commit carried nothing.
    let store = &stats["store"];
    let (commits, commands) = (
        store["commits"].as_u64().expect("store.commits"),
        store["commands"].as_u64().expect("store.commands"),
    );
    assert!(commits > 0 && commands >= commits, "{stats}");
    let ratio = store["commands_per_commit"].as_f64().expect("a ratio");
    assert!(
        (ratio - commands as f64 / commits as f64).abs() < 1e-9,
        "{stats}"
    );
    // With the durable default every commit with an answer that waits for
    // the disk was flushed before it, by fsyncs (on PostgreSQL, the
    // flusher's commits) that each cover one commit or more.
    let backend = if crate::harness::on_postgres() {
        "postgres"
    } else {
        "sqlite"
    };
    assert_eq!(store["backend"], backend, "{stats}");
    let syncs = store["syncs"].as_u64().expect("store.syncs");
    assert!(syncs > 0 && syncs <= commits, "{stats}");
    let per_sync = store["commands_per_sync"].as_f64().expect("a ratio");
    assert!(
        (per_sync - commands as f64 / syncs as f64).abs() < 1e-9,
        "{stats}"
    );
    let avg = store["sync_avg_ms"].as_f64().expect("store.sync_avg_ms");
    assert!(avg.is_finite() && avg >= 0.0, "{stats}");
}

#[tokio::test]
async fn waiting_leases_of_other_types_cost_no_store_work_and_the_right_waiter_still_wakes() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let long_poll = |worker: String, job_type: &'static str, wait_ms: u64| {
        let api = api.clone();
        tokio::spawn(async move {
            let mut req = lease_req(&worker, 1, 30_000);
            req["types"] = json!([job_type]);
            req["wait_ms"] = json!(wait_ms);
            api.lease(&req).await
        })
    };
    // Eight idle workers of another type, and one for the jobs to come.
    let idle: Vec<_> = (0..8)
        .map(|n| long_poll(format!("sms-{n}"), "sms", 20_000))
        .collect();
    let waiter = long_poll("email-1".into(), "email", 20_000);
    // Lease commands the store ran (housekeeping and stats run commands of
    // their own, as many as the machine's pace makes: they are not counted).
    let leases = || async {
        let stats = api.get("/v1/stats").await.expect(200).clone();
        stats["store"]["leases"].as_u64().expect("store.leases")
    };
    // Wait until all nine made their first look and went to sleep.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let mut before = leases().await;
    while before < 9 {
        assert!(
            std::time::Instant::now() < deadline,
            "the waiters' first looks: {before} of 9"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        before = leases().await;
    }
    assert_eq!(before, 9, "one first look each");

    let first = api.enqueue_ok(&job("email", "acme", json!({"n": 0}))).await;
    let got = waiter.await.expect("the email waiter");
    assert_eq!(
        got.len(),
        1,
        "the waiter of the enqueued type wakes and leases it"
    );
    assert_eq!(got[0]["id"], first);
    for n in 1..20 {
        api.enqueue_ok(&job("email", "acme", json!({"n": n}))).await;
    }

    // One lease: the email waiter's. Waking the sms waiters for every
    // email and letting them ask the store would be 8 more per enqueue.
    let spent = leases().await - before;
    assert_eq!(spent, 1, "{spent} lease commands");
    for h in idle {
        assert!(!h.is_finished(), "an sms waiter returned with no sms job");
        h.abort();
    }
}
