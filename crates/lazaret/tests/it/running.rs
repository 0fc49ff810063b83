//! Running the server: loopback only without tokens, delayed jobs, and leases filtered by lane and type.

use std::time::{Duration, SystemTime};

use serde_json::json;

use crate::harness::{QUICK, Server, at, job, lease_req, ms, serve_refused};

#[tokio::test]
async fn without_tokens_the_server_refuses_a_non_loopback_address() {
    let (status, printed) = serve_refused(QUICK, "0.0.0.0:0").await;
    assert!(
        !status.success(),
        "no tokens and a public address: refuse to start; it printed:\n{printed}"
    );
    assert!(
        !printed.contains("lazaret listening on"),
        "it must not listen: {printed}"
    );
}

#[tokio::test]
async fn without_tokens_the_server_says_it_serves_loopback_only() {
    let server = Server::start(QUICK).await;
    // The notice may come just after the first line; give the pipe a moment.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let out = server.output().to_lowercase();
        if out.contains("loopback") && out.contains("token") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "at start it says it serves loopback only, for want of tokens; it printed:\n{out}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_delayed_job_waits_until_it_is_due() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let mut j = job("report", "acme", json!({}));
    j["delay_ms"] = json!(1500);
    let r = api.enqueue(&j).await;
    let id = r.expect(201)["id"].clone();

    let got = api.job(&id).await;
    assert_eq!(got["state"], "scheduled", "{got}");
    let run_at = at(&got["run_at"]);
    assert!(
        run_at >= at(&got["created_at"]) + Duration::from_millis(1500),
        "{got}"
    );
    assert!(
        api.lease(&lease_req("w", 10, 30_000)).await.is_empty(),
        "not before it is due"
    );

    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
    assert!(ms(SystemTime::now()) >= ms(run_at), "leased only once due");
}

#[tokio::test]
async fn a_worker_leases_only_the_lanes_and_types_it_asks_for() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let mut a = job("report", "acme", json!({"n": "a"}));
    a["lane"] = json!("interactive");
    let a = api.enqueue_ok(&a).await;
    let mut b = job("report", "acme", json!({"n": "b"}));
    b["lane"] = json!("batch");
    let b = api.enqueue_ok(&b).await;
    let mut c = job("email", "acme", json!({"n": "c"}));
    c["lane"] = json!("interactive");
    let c = api.enqueue_ok(&c).await;

    let mut req = lease_req("w", 10, 30_000);
    req["lanes"] = json!(["batch"]);
    let jobs = api.lease(&req).await;
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0]["id"], b);

    let mut req = lease_req("w", 10, 30_000);
    req["types"] = json!(["email"]);
    let jobs = api.lease(&req).await;
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0]["id"], c);

    // No `lanes`: every lane; `types: null`: any type.
    let jobs = api.lease(&lease_req("w", 10, 30_000)).await;
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0]["id"], a);
}
