//! Several nodes on one PostgreSQL database (issue 13): three `lazaret
//! serve` processes on one schema, workers spread over all three. No job is
//! ever held by two workers at once, every job ends as the policy says, a
//! tenant's cap holds across nodes, a breaker opened or a pause made
//! through one node sheds on the others, a token revoked on one is refused
//! by all, the stats are the cluster's, and after `kill -9` of a node
//! mid-lease its jobs are leased again elsewhere once their leases end,
//! charged one attempt.
//!
//! Needs `LAZARET_TEST_PG_URL`; skipped (visibly) without it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{EVENTUALLY, QUICK, Server, assert_error, id_text, job, lease_req};

/// Polls `check` until it holds, within [`EVENTUALLY`] (no timing is asserted).
async fn eventually<F, Fut>(what: &str, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + EVENTUALLY;
    while !check().await {
        assert!(
            Instant::now() < deadline,
            "{what}: not within {EVENTUALLY:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn three_nodes_share_the_work_and_never_hand_a_job_to_two_workers() {
    let config = format!("{QUICK}\n[types.work]\nattempts_max = 3\n");
    let Some(nodes) = Server::cluster(&config, 3).await else {
        return;
    };
    const JOBS: u64 = 120;
    // n % 5 == 0: fails for good; n % 7 == 0: fails once, then succeeds.
    let mut ids = Vec::new();
    for n in 0..JOBS {
        let node = &nodes[(n % 3) as usize];
        let tenant = format!("t-{}", n % 8);
        ids.push((
            n,
            node.api()
                .enqueue_ok(&job("work", &tenant, json!({"n": n})))
                .await,
        ));
    }
    // (id, attempt) of every delivery, and the jobs held right now.
    let deliveries: Arc<Mutex<HashSet<(String, u64)>>> = Arc::default();
    let held: Arc<Mutex<HashSet<String>>> = Arc::default();
    let served: Arc<Mutex<[u64; 3]>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..6 {
        let api = nodes[w % 3].api();
        let (deliveries, held, served) = (
            Arc::clone(&deliveries),
            Arc::clone(&held),
            Arc::clone(&served),
        );
        workers.push(tokio::spawn(async move {
            let mut idle = 0;
            while idle < 3 {
                let mut req = lease_req(&format!("w-{w}"), 4, 30_000);
                req["wait_ms"] = json!(300);
                let jobs = api.lease(&req).await;
                if jobs.is_empty() {
                    idle += 1;
                    continue;
                }
                idle = 0;
                served.lock().unwrap()[w % 3] += jobs.len() as u64;
                for j in jobs {
                    let id = id_text(&j["id"]);
                    let attempt = j["attempt"].as_u64().expect("an attempt");
                    assert!(
                        deliveries.lock().unwrap().insert((id.clone(), attempt)),
                        "job {id} attempt {attempt} was delivered twice"
                    );
                    assert!(
                        held.lock().unwrap().insert(id.clone()),
                        "job {id} is held by two workers at once"
                    );
                    let n = j["payload"]["n"].as_u64().expect("n");
                    // Held until the outcome is sent.
                    held.lock().unwrap().remove(&id);
                    let reply = if n % 5 == 0 {
                        api.fail(
                            &j["id"],
                            &j["lease_token"],
                            json!({"class": "permanent", "kind": "bad_input", "message": "no"}),
                        )
                        .await
                    } else if n % 7 == 0 && attempt == 1 {
                        api.fail(
                            &j["id"],
                            &j["lease_token"],
                            json!({"class": "transient", "kind": "http_503", "message": "later"}),
                        )
                        .await
                    } else {
                        api.ack(&j["id"], &j["lease_token"]).await
                    };
                    reply.expect(200);
                }
            }
        }));
    }
    let deadline = Instant::now() + EVENTUALLY * 4;
    let api = nodes[0].api();
    for (n, id) in &ids {
        let (state, attempts) = if n % 5 == 0 {
            ("dead_lettered", 1)
        } else if n % 7 == 0 {
            ("succeeded", 2)
        } else {
            ("succeeded", 1)
        };
        loop {
            let j = api.job(id).await;
            if j["state"] == state {
                assert_eq!(j["attempt"], attempts, "job {n}: {j}");
                break;
            }
            assert!(Instant::now() < deadline, "job {n} never {state}: {j}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for w in workers {
        w.await.expect("a worker ran to its end");
    }
    let served = *served.lock().unwrap();
    assert!(
        served.iter().all(|&n| n > 0),
        "every node handed out work: {served:?}"
    );
}

#[tokio::test]
async fn a_tenants_cap_holds_across_nodes() {
    let config = "[tenants]\ninflight_max = 2\n";
    let Some(nodes) = Server::cluster(config, 3).await else {
        return;
    };
    for n in 0..12 {
        nodes[n % 3]
            .api()
            .enqueue(&job("work", "acme", json!({"n": n})))
            .await
            .expect(201);
    }
    let mut leased = Vec::new();
    for round in 0..3 {
        for node in &nodes {
            leased.extend(node.api().lease(&lease_req("w", 10, 30_000)).await);
        }
        assert_eq!(leased.len(), 2, "round {round}: {leased:?}");
    }
    // A slot freed through one node is taken through another, once.
    nodes[0]
        .api()
        .ack(&leased[0]["id"], &leased[0]["lease_token"])
        .await
        .expect(200);
    let mut req = lease_req("w", 10, 30_000);
    req["wait_ms"] = json!(2000);
    let more = nodes[2].api().lease(&req).await;
    assert_eq!(more.len(), 1, "{more:?}");
    assert!(
        nodes[1]
            .api()
            .lease(&lease_req("w", 10, 30_000))
            .await
            .is_empty()
    );
}

#[tokio::test]
async fn a_breaker_or_a_pause_through_one_node_sheds_on_the_others() {
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
    let Some(nodes) = Server::cluster(&config, 3).await else {
        return;
    };
    let first = nodes[0].api();
    for n in 0..2 {
        first
            .enqueue_ok(&job("fragile", "acme", json!({"n": n})))
            .await;
    }
    let mut req = lease_req("w", 1, 30_000);
    req["types"] = json!(["fragile"]);
    for _ in 0..2 {
        let leased = first.lease_one(&req).await;
        first
            .fail(
                &leased["id"],
                &leased["lease_token"],
                json!({"class": "transient", "kind": "http_503", "message": "down"}),
            )
            .await
            .expect(200);
    }
    assert_error(
        &first.enqueue(&job("fragile", "acme", json!({}))).await,
        503,
        "SHED",
        None,
    );
    for node in &nodes[1..] {
        let api = node.api();
        eventually("the other node sheds the type", || {
            let api = api.clone();
            async move { api.enqueue(&job("fragile", "acme", json!({}))).await.status == 503 }
        })
        .await;
        // And parks its jobs: none leased there either.
        let mut req = lease_req("w", 5, 30_000);
        req["types"] = json!(["fragile"]);
        assert!(api.lease(&req).await.is_empty());
    }

    // A pause through node 1 holds on node 2 too, and so does its resume.
    nodes[1]
        .api()
        .post("/v1/pause", &json!({"type": "report"}))
        .await
        .expect(200);
    let third = nodes[2].api();
    eventually("the pause reaches node 2", || {
        let api = third.clone();
        async move { api.enqueue(&job("report", "acme", json!({}))).await.status == 503 }
    })
    .await;
    nodes[1]
        .api()
        .post("/v1/resume", &json!({"type": "report"}))
        .await
        .expect(200);
    eventually("the resume reaches node 2", || {
        let api = third.clone();
        async move { api.enqueue(&job("report", "acme", json!({}))).await.status == 201 }
    })
    .await;
}

#[tokio::test]
async fn a_node_killed_mid_lease_leaves_its_jobs_to_the_others_charged_one_attempt() {
    let Some(mut nodes) = Server::cluster(QUICK, 3).await else {
        return;
    };
    let id = nodes[0]
        .api()
        .enqueue_ok(&job("report", "acme", json!({})))
        .await;
    let leased = nodes[2].api().lease_one(&lease_req("w-2", 1, 1_000)).await;
    assert_eq!(leased["id"], id);
    assert_eq!(leased["attempt"], 1);
    // kill -9 (the harness kills with SIGKILL when a server is dropped).
    drop(nodes.pop());
    let api = nodes[1].api();
    let again = api.lease_one(&lease_req("w-1", 1, 30_000)).await;
    assert_eq!(again["id"], id);
    assert_eq!(
        again["attempt"], 2,
        "the lost lease was charged one attempt"
    );
    // The dead node's token is no longer the job's.
    let stale = api.ack(&id, &leased["lease_token"]).await;
    assert_error(&stale, 409, "LEASE_LOST", None);
    api.ack(&id, &again["lease_token"]).await.expect(200);
    let j = nodes[0].api().job(&id).await;
    assert_eq!(
        (j["state"].clone(), j["attempt"].clone()),
        (json!("succeeded"), json!(2))
    );
}

#[tokio::test]
async fn stats_are_the_clusters_and_a_token_revoked_on_one_node_is_refused_by_all() {
    const ADMIN: &str = "tok-admin-0123456789";
    let config = format!(
        "{QUICK}
[[tokens]]
name = \"root\"
role = \"admin\"
token = \"{ADMIN}\"
"
    );
    let Some(nodes) = Server::cluster(&config, 2).await else {
        return;
    };
    let (a, b) = (nodes[0].api_as(ADMIN), nodes[1].api_as(ADMIN));
    for n in 0..3 {
        a.enqueue_ok(&job("report", "acme", json!({"n": n}))).await;
    }
    let stats = b.get("/v1/stats").await;
    assert_eq!(stats.expect(200)["lanes"]["default"]["queued"], 3);

    let created = a
        .post("/v1/tokens", &json!({"name": "ci", "role": "producer"}))
        .await;
    let secret = created.expect(201)["token"]
        .as_str()
        .expect("a secret")
        .to_owned();
    let on_b = nodes[1].api_as(&secret);
    eventually("node b knows the new token", || {
        let api = on_b.clone();
        async move { api.enqueue(&job("report", "acme", json!({}))).await.status == 201 }
    })
    .await;
    a.delete("/v1/tokens/ci").await.expect(200);
    eventually("node b refuses the revoked token", || {
        let api = on_b.clone();
        async move { api.enqueue(&job("report", "acme", json!({}))).await.status == 401 }
    })
    .await;
}
