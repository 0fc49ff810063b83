//! Several nodes on one PostgreSQL database (issue 13): three `lazaret
//! serve` processes on one schema, workers spread over all three. No job is
//! ever held by two workers at once, every job ends as the policy says
//! (success, retry, exhaustion, lease expiry), a tenant's cap holds across
//! nodes under concurrent leases, a breaker opened or a pause made through
//! one node sheds on the others (and the breaker shows, half-opens with its
//! probes and closes there), a token revoked on one is refused by all, the
//! stats are the cluster's, alerts are sent once for the cluster by one
//! node (another takes over when it dies), after `kill -9` of a node
//! mid-lease under load its jobs are leased again elsewhere only once their
//! leases end, charged one attempt, and `lazaret migrate` prepares a schema
//! a node then serves.
//!
//! Needs `LAZARET_TEST_PG_URL`; skipped (visibly) without it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::Json;
use axum::extract::State;
use axum::routing::post;
use serde_json::{Value, json};

use crate::harness::{
    self, EVENTUALLY, PgSchema, QUICK, Server, assert_error, at, id_text, job, lease_req,
};

/// Polls `check` until it holds, within [`EVENTUALLY`] (no timing is asserted).
pub(crate) async fn eventually<F, Fut>(what: &str, mut check: F)
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

/// A job leased and not yet answered, as the workers' ledger keeps it.
#[derive(Debug, Clone)]
struct Hold {
    worker: String,
    attempt: u64,
    /// The lease's end, as the server reported it.
    expires: SystemTime,
    /// The worker let it go without an answer: the lease runs to its end.
    abandoned: bool,
}

/// What every worker of a test records, checked as it goes.
#[derive(Debug, Default)]
struct Ledger {
    held: HashMap<String, Hold>,
    deliveries: HashSet<(String, u64)>,
    violations: Vec<String>,
    served: [u64; 3],
}

impl Ledger {
    /// A lease reply: `job` is held by `worker` from now until its answer's
    /// reply (or, abandoned, until its lease ends).
    fn leased(&mut self, worker: &str, job: &Value, lease_ms: u64) {
        let id = id_text(&job["id"]);
        let attempt = job["attempt"].as_u64().expect("an attempt");
        let expires = at(&job["lease_expires_at"]);
        // When the server granted it, on its clock.
        let granted = expires - Duration::from_millis(lease_ms);
        if !self.deliveries.insert((id.clone(), attempt)) {
            self.violations
                .push(format!("job {id} attempt {attempt} was delivered twice"));
        }
        if let Some(before) = self.held.get(&id) {
            if !before.abandoned {
                self.violations.push(format!(
                    "job {id} leased to {worker} (attempt {attempt}) while {} still held attempt {}",
                    before.worker, before.attempt
                ));
            } else if granted < before.expires {
                self.violations.push(format!(
                    "job {id} leased again to {worker} {:?} before {}'s lease ended",
                    before.expires.duration_since(granted).unwrap_or_default(),
                    before.worker
                ));
            }
        }
        self.held.insert(
            id,
            Hold {
                worker: worker.to_owned(),
                attempt,
                expires,
                abandoned: false,
            },
        );
    }
}

/// What a worker does with job `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Act {
    /// Fails it for good.
    Permanent,
    /// Fails it once, then acks.
    FailOnce,
    /// Fails it every time: its attempts run out.
    FailAlways,
    /// Lets its first lease expire, then acks.
    AbandonOnce,
    /// Acks it.
    Ack,
}

impl Act {
    fn of(n: u64) -> Act {
        if n % 5 == 0 {
            Act::Permanent
        } else if n % 7 == 0 {
            Act::FailOnce
        } else if n % 11 == 0 {
            Act::FailAlways
        } else if n % 13 == 0 {
            Act::AbandonOnce
        } else {
            Act::Ack
        }
    }
}

#[tokio::test]
async fn three_nodes_never_hand_a_job_to_two_workers_and_end_every_job_as_the_policy_says() {
    // Retries wait a whole second: a retry leased before the failing
    // worker read its reply would be a double hold in the ledger's eyes.
    let config = format!(
        "{QUICK}\n[types.work]\nattempts_max = 3\ncrash_loop_max = 2\n\
         backoff_base_ms = 1000\nbackoff_floor_ms = 1000\nbackoff_cap_ms = 1000\n"
    );
    let Some(nodes) = Server::cluster(&config, 3).await else {
        return;
    };
    const JOBS: u64 = 150;
    const LEASE_MS: u64 = 4_000;
    // What each job does, by n, and the state and attempt it must end with.
    let plan = |n: u64| -> (&'static str, Option<&'static str>, u64) {
        match Act::of(n) {
            Act::Permanent => ("dead_lettered", Some("permanent"), 1),
            Act::FailOnce | Act::AbandonOnce => ("succeeded", None, 2),
            Act::FailAlways => ("dead_lettered", Some("exhausted"), 3),
            Act::Ack => ("succeeded", None, 1),
        }
    };
    let mut ids = Vec::new();
    for n in 0..JOBS {
        let tenant = format!("t-{}", n % 8);
        let id = nodes[(n % 3) as usize]
            .api()
            .enqueue_ok(&job("work", &tenant, json!({"n": n})))
            .await;
        ids.push((n, id));
    }
    let ledger: Arc<Mutex<Ledger>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..9 {
        let node = w % 3;
        let api = nodes[node].api();
        let (ledger, done) = (Arc::clone(&ledger), Arc::clone(&done));
        workers.push(tokio::spawn(async move {
            let name = format!("w-{w}");
            while !done.load(Ordering::Relaxed) {
                let mut req = lease_req(&name, 4, LEASE_MS);
                req["wait_ms"] = json!(300);
                let jobs = api.lease(&req).await;
                {
                    let mut l = ledger.lock().unwrap();
                    l.served[node] += jobs.len() as u64;
                    for j in &jobs {
                        l.leased(&name, j, LEASE_MS);
                    }
                }
                // The jobs of one lease are worked on at once.
                let mut answers = tokio::task::JoinSet::new();
                for j in jobs {
                    let (api, ledger) = (api.clone(), Arc::clone(&ledger));
                    answers.spawn(async move {
                        let id = id_text(&j["id"]);
                        let attempt = j["attempt"].as_u64().expect("an attempt");
                        let n = j["payload"]["n"].as_u64().expect("n");
                        let transient =
                            json!({"class": "transient", "kind": "http_503", "message": "later"});
                        let act = Act::of(n);
                        let reply = if act == Act::Permanent {
                            api.fail(
                                &j["id"],
                                &j["lease_token"],
                                json!({"class": "permanent", "kind": "bad_input", "message": "no"}),
                            )
                            .await
                        } else if (act == Act::FailOnce && attempt == 1) || act == Act::FailAlways {
                            api.fail(&j["id"], &j["lease_token"], transient).await
                        } else if act == Act::AbandonOnce && attempt == 1 {
                            // Let go without an answer: held until the lease ends.
                            ledger
                                .lock()
                                .unwrap()
                                .held
                                .get_mut(&id)
                                .expect("held")
                                .abandoned = true;
                            return;
                        } else {
                            api.ack(&j["id"], &j["lease_token"]).await
                        };
                        let mut l = ledger.lock().unwrap();
                        if reply.status != 200 {
                            l.violations.push(format!(
                                "job {id} attempt {attempt}: the answer got {} {}",
                                reply.status,
                                reply.text()
                            ));
                        }
                        // Held until the reply is read.
                        l.held.remove(&id);
                    });
                }
                while answers.join_next().await.is_some() {}
            }
        }));
    }
    let deadline = Instant::now() + EVENTUALLY * 4;
    let api = nodes[0].api();
    for (n, id) in &ids {
        let (state, reason, attempts) = plan(*n);
        loop {
            let violations = ledger.lock().unwrap().violations.clone();
            assert!(violations.is_empty(), "{violations:#?}");
            let j = api.job(id).await;
            if j["state"] == state {
                assert_eq!(j["attempt"], attempts, "job {n}: {j}");
                if let Some(reason) = reason {
                    assert_eq!(api.dead_letter_of(id).await["reason"], reason, "job {n}");
                }
                break;
            }
            assert!(
                !matches!(
                    j["state"].as_str(),
                    Some("succeeded" | "dead_lettered" | "cancelled")
                ),
                "job {n} ended {} instead of {state}: {j}",
                j["state"]
            );
            assert!(Instant::now() < deadline, "job {n} never {state}: {j}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    done.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.expect("a worker ran to its end");
    }
    let l = ledger.lock().unwrap();
    assert!(l.violations.is_empty(), "{:#?}", l.violations);
    assert!(
        l.served.iter().all(|&n| n > 0),
        "every node handed out work: {:?}",
        l.served
    );
    // Every delivery the policy implies, and no other.
    let expected: u64 = (0..JOBS).map(|n| plan(n).2).sum();
    assert_eq!(l.deliveries.len() as u64, expected);
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
async fn a_tenants_cap_holds_across_nodes_under_concurrent_leases() {
    let config = "[tenants]\ninflight_max = 2\n";
    let Some(nodes) = Server::cluster(config, 3).await else {
        return;
    };
    const JOBS: usize = 60;
    for n in 0..JOBS {
        let tenant = if n % 3 == 0 { "other" } else { "acme" };
        nodes[n % 3]
            .api()
            .enqueue_ok(&job("work", tenant, json!({"n": n})))
            .await;
    }
    // Per tenant: jobs between their lease reply and the sending of their
    // ack (inside the server's lease of them), now and at most.
    let holding: Arc<Mutex<HashMap<String, (u32, u32)>>> = Arc::default();
    let acked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..6 {
        let api = nodes[w % 3].api();
        let (holding, acked) = (Arc::clone(&holding), Arc::clone(&acked));
        workers.push(tokio::spawn(async move {
            while acked.load(Ordering::Relaxed) < JOBS {
                let mut req = lease_req(&format!("w-{w}"), 5, 30_000);
                req["wait_ms"] = json!(200);
                let jobs = api.lease(&req).await;
                for j in &jobs {
                    let mut h = holding.lock().unwrap();
                    let e = h
                        .entry(j["tenant"].as_str().unwrap().to_owned())
                        .or_default();
                    e.0 += 1;
                    e.1 = e.1.max(e.0);
                }
                // Held a moment, so that leases through other nodes overlap.
                tokio::time::sleep(Duration::from_millis(30)).await;
                for j in &jobs {
                    holding
                        .lock()
                        .unwrap()
                        .get_mut(j["tenant"].as_str().unwrap())
                        .unwrap()
                        .0 -= 1;
                    api.ack(&j["id"], &j["lease_token"]).await.expect(200);
                    acked.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for w in workers {
        tokio::time::timeout(EVENTUALLY * 2, w)
            .await
            .expect("the workers finish every job")
            .expect("a worker ran to its end");
    }
    let h = holding.lock().unwrap();
    for tenant in ["acme", "other"] {
        assert_eq!(
            h[tenant].1, 2,
            "{tenant}: at most its cap at once, and the cap reached: {h:?}"
        );
    }
}

/// The `lazaret_breaker_open` gauge of `ty` on a node's `/metrics`.
async fn breaker_gauge(node: &Server, ty: &str) -> Option<f64> {
    let text = node.api().get("/metrics").await.text();
    let needle = format!("lazaret_breaker_open{{type=\"{ty}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&needle))
        .and_then(|v| v.trim().parse().ok())
}

/// The breakers `GET /v1/breakers` lists for `ty` on a node: (kind, state).
async fn breakers_of(node: &Server, ty: &str) -> Vec<(String, String)> {
    let body = node.api().get("/v1/breakers").await.expect(200).clone();
    body["breakers"]
        .as_array()
        .expect("a list")
        .iter()
        .filter(|b| b["type"] == ty)
        .map(|b| {
            (
                b["kind"].as_str().unwrap().to_owned(),
                b["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Fails two jobs of `ty` transiently through `api`: trips its breaker.
pub(crate) async fn trip(api: &harness::Api, ty: &str) {
    let mut req = lease_req("w", 1, 30_000);
    req["types"] = json!([ty]);
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
    trip(&first, "fragile").await;
    assert_error(
        &first.enqueue(&job("fragile", "acme", json!({}))).await,
        503,
        "SHED",
        None,
    );
    let opened = Instant::now();
    // How long until each other node sheds it, watched at once.
    let mut watches = tokio::task::JoinSet::new();
    for (i, node) in nodes.iter().enumerate().skip(1) {
        let api = node.api();
        watches.spawn(async move {
            eventually("the other node sheds the type", || {
                let api = api.clone();
                async move { api.enqueue(&job("fragile", "acme", json!({}))).await.status == 503 }
            })
            .await;
            (i, opened.elapsed())
        });
    }
    while let Some(r) = watches.join_next().await {
        let (i, took) = r.expect("a watch ran to its end");
        // Reported, not asserted: the issue asks for within a second.
        eprintln!("node {i} shed the type {took:?} after the breaker opened on node 0");
    }
    for (i, node) in nodes.iter().enumerate().skip(1) {
        let api = node.api();
        // And parks its jobs: none leased there either.
        let mut req = lease_req("w", 5, 30_000);
        req["types"] = json!(["fragile"]);
        assert!(api.lease(&req).await.is_empty());
        // Shown there as open: GET /v1/breakers and the gauge.
        assert_eq!(
            breakers_of(node, "fragile").await,
            vec![("http_503".to_owned(), "open".to_owned())]
        );
        assert_eq!(breaker_gauge(node, "fragile").await, Some(1.0), "node {i}");
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
async fn a_breaker_opened_on_one_node_half_opens_with_its_probes_on_another_and_closes_everywhere()
{
    let config = format!(
        "{QUICK}
[types.flaky]
attempts_max = 10

[types.flaky.breaker]
failures_min = 2
failure_ratio = 0.5
window_ms = 60000
cooldown_ms = 4000
probes = 2
"
    );
    let Some(nodes) = Server::cluster(&config, 3).await else {
        return;
    };
    let first = nodes[0].api();
    for n in 0..6 {
        first
            .enqueue_ok(&job("flaky", "acme", json!({"n": n})))
            .await;
    }
    trip(&first, "flaky").await;
    // Node 1 learns of it, then the cooldown ends there too.
    eventually("node 1 half-opens the breaker", || async {
        breakers_of(&nodes[1], "flaky").await == [("http_503".to_owned(), "half_open".to_owned())]
    })
    .await;
    let second = nodes[1].api();
    let mut req = lease_req("w-1", 10, 30_000);
    req["types"] = json!(["flaky"]);
    let probes = second.lease(&req).await;
    assert_eq!(
        probes.len(),
        2,
        "node 1 lets its two probes through: {probes:?}"
    );
    assert!(
        second.lease(&req).await.is_empty(),
        "and no more while they are out"
    );
    // A probe's success closes it on node 1, and through it on the others.
    second
        .ack(&probes[0]["id"], &probes[0]["lease_token"])
        .await
        .expect(200);
    assert!(breakers_of(&nodes[1], "flaky").await.is_empty());
    for node in [&nodes[0], &nodes[2]] {
        eventually("the closing reaches the other nodes", || async {
            breakers_of(node, "flaky").await.is_empty()
        })
        .await;
        assert_eq!(breaker_gauge(node, "flaky").await, Some(0.0));
    }
    first
        .enqueue(&job("flaky", "acme", json!({})))
        .await
        .expect(201);
    let mut req = lease_req("w-0", 10, 30_000);
    req["types"] = json!(["flaky"]);
    assert!(
        first.lease_eventually(&req).await.len() >= 2,
        "node 0 leases the type freely again"
    );
}

#[tokio::test]
async fn a_node_killed_mid_lease_under_load_leaves_its_jobs_to_the_others_once_their_leases_end() {
    let config = format!("{QUICK}\n[types.work]\nattempts_max = 3\n");
    let Some(mut nodes) = Server::cluster(&config, 3).await else {
        return;
    };
    const JOBS: usize = 60;
    const VICTIM_LEASE_MS: u64 = 3_000;
    let mut ids = Vec::new();
    for n in 0..JOBS {
        ids.push(
            nodes[n % 3]
                .api()
                .enqueue_ok(&job("work", &format!("t-{}", n % 4), json!({"n": n})))
                .await,
        );
    }
    // Node 2's worker takes a batch and is killed with its node.
    let victim = nodes[2]
        .api()
        .lease(&lease_req("w-2", 5, VICTIM_LEASE_MS))
        .await;
    assert!(!victim.is_empty(), "node 2 leased something");
    let lost: HashMap<String, (SystemTime, Value)> = victim
        .iter()
        .map(|j| {
            assert_eq!(j["attempt"], 1);
            (
                id_text(&j["id"]),
                (at(&j["lease_expires_at"]), j["lease_token"].clone()),
            )
        })
        .collect();
    // Workers on nodes 0 and 1 are busy when node 2 dies.
    let ledger: Arc<Mutex<Ledger>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for w in 0..4 {
        let node = w % 2;
        let api = nodes[node].api();
        let (ledger, done) = (Arc::clone(&ledger), Arc::clone(&done));
        workers.push(tokio::spawn(async move {
            let name = format!("w-{w}");
            while !done.load(Ordering::Relaxed) {
                let mut req = lease_req(&name, 3, 30_000);
                req["wait_ms"] = json!(300);
                let jobs = api.lease(&req).await;
                {
                    let mut l = ledger.lock().unwrap();
                    l.served[node] += jobs.len() as u64;
                    for j in &jobs {
                        l.leased(&name, j, 30_000);
                    }
                }
                for j in jobs {
                    let reply = api.ack(&j["id"], &j["lease_token"]).await;
                    let mut l = ledger.lock().unwrap();
                    if reply.status != 200 {
                        l.violations.push(format!(
                            "ack of {}: {}",
                            id_text(&j["id"]),
                            reply.text()
                        ));
                    }
                    l.held.remove(&id_text(&j["id"]));
                }
            }
        }));
    }
    {
        // The dead node's leases stand until their ends.
        let mut l = ledger.lock().unwrap();
        for (id, (expires, _)) in &lost {
            l.held.insert(
                id.clone(),
                Hold {
                    worker: "w-2 (killed)".into(),
                    attempt: 1,
                    expires: *expires,
                    abandoned: true,
                },
            );
        }
    }
    // kill -9 (the harness kills with SIGKILL when a server is dropped).
    drop(nodes.pop());
    let api = nodes[0].api();
    for (n, id) in ids.iter().enumerate() {
        let j = api.job_eventually(id, "succeeded").await;
        let violations = ledger.lock().unwrap().violations.clone();
        assert!(violations.is_empty(), "{violations:#?}");
        let want = if lost.contains_key(&id_text(id)) {
            2
        } else {
            1
        };
        assert_eq!(
            j["attempt"], want,
            "job {n}: the lost lease charged one attempt: {j}"
        );
    }
    done.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.expect("a worker ran to its end");
    }
    {
        let l = ledger.lock().unwrap();
        assert!(l.violations.is_empty(), "{:#?}", l.violations);
        for id in lost.keys() {
            assert!(
                l.deliveries.contains(&(id.clone(), 2)),
                "job {id} was leased again by the surviving nodes"
            );
        }
    }
    // The dead node's tokens are no longer the jobs'.
    let (id, (_, token)) = lost.iter().next().expect("one lost");
    assert_error(&api.ack(&json!(id), token).await, 409, "LEASE_LOST", None);
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

#[tokio::test]
async fn failure_statistics_in_stats_count_every_nodes_dead_letters() {
    let Some(nodes) = Server::cluster(QUICK, 2).await else {
        return;
    };
    dead_letter(&nodes[0], "charge", 2).await;
    dead_letter(&nodes[1], "charge", 1).await;
    for (i, node) in nodes.iter().enumerate() {
        let stats = node.api().get("/v1/stats").await;
        let dl = stats.expect(200)["dead_letters"].clone();
        let counted: u64 = dl["top_failures"]
            .as_array()
            .expect("top_failures")
            .iter()
            .filter(|f| f["type"] == "charge")
            .map(|f| f["count"].as_u64().expect("a count"))
            .sum();
        assert_eq!(counted, 3, "node {i} counts both nodes' dead letters: {dl}");
    }
}

/// A webhook receiver on 127.0.0.1: keeps every body it is POSTed.
struct Hook {
    url: String,
    bodies: Arc<Mutex<Vec<Value>>>,
}

async fn keep(
    State(bodies): State<Arc<Mutex<Vec<Value>>>>,
    Json(body): Json<Value>,
) -> &'static str {
    bodies.lock().unwrap().push(body);
    "ok"
}

impl Hook {
    async fn start() -> Hook {
        let bodies: Arc<Mutex<Vec<Value>>> = Arc::default();
        let app = axum::Router::new()
            .route("/hook", post(keep))
            .with_state(Arc::clone(&bodies));
        Hook {
            url: format!("{}/hook", crate::harness::serve_app(app).await),
            bodies,
        }
    }

    /// The alerts of `event` for `ty` received so far.
    fn of(&self, event: &str, ty: &str) -> Vec<Value> {
        self.bodies
            .lock()
            .unwrap()
            .iter()
            .filter(|a| a["event"] == event && a["type"] == ty)
            .cloned()
            .collect()
    }

    /// Waits for the first alert of `event` for `ty`.
    async fn wait_for(&self, event: &str, ty: &str) -> Value {
        let deadline = Instant::now() + EVENTUALLY;
        loop {
            if let Some(a) = self.of(event, ty).into_iter().next() {
                return a;
            }
            assert!(
                Instant::now() < deadline,
                "no {event} alert for {ty} within {EVENTUALLY:?}; got {:#?}",
                self.bodies.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `n` jobs of `ty` dead-lettered (permanent failures) through `node`.
async fn dead_letter(node: &Server, ty: &str, n: usize) {
    let api = node.api();
    for i in 0..n {
        let id = api.enqueue_ok(&job(ty, "acme", json!({"n": i}))).await;
        let mut req = lease_req("w", 1, 30_000);
        req["types"] = json!([ty]);
        let leased = api.lease_one(&req).await;
        assert_eq!(leased["id"], id);
        api.fail(
            &id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "declined", "message": format!("bad row {i}")}),
        )
        .await
        .expect(200);
    }
}

/// The node whose log says it sends the cluster's alerts now.
fn alert_leader(nodes: &[Server]) -> Option<usize> {
    nodes
        .iter()
        .position(|n| n.log().contains("now sends the cluster's alerts"))
}

#[tokio::test]
async fn alerts_are_the_clusters_sent_once_by_one_node_and_another_takes_over() {
    let hook = Hook::start().await;
    let config = format!(
        "{QUICK}
[[alerts]]
url = \"{}\"
events = [\"dead_letters_appeared\", \"poison_rate\"]
cooldown_ms = 600000
poison_rate_per_min = 4
",
        hook.url
    );
    let Some(mut nodes) = Server::cluster(&config, 3).await else {
        return;
    };
    // Two dead letters through each of two nodes: four in the cluster,
    // which no single node saw.
    dead_letter(&nodes[1], "report", 2).await;
    dead_letter(&nodes[2], "report", 2).await;
    let rate = hook.wait_for("poison_rate", "report").await;
    assert_eq!(rate["count"], 4, "counted over both nodes: {rate}");
    hook.wait_for("dead_letters_appeared", "report").await;
    // A later alert through the third node: every node has polled since.
    dead_letter(&nodes[0], "marker", 1).await;
    hook.wait_for("dead_letters_appeared", "marker").await;
    assert_eq!(hook.of("dead_letters_appeared", "report").len(), 1);
    assert_eq!(hook.of("poison_rate", "report").len(), 1);

    // The leader dies (kill -9): another node takes over.
    let leader = alert_leader(&nodes).expect("one node says it sends the alerts");
    let others: Vec<usize> = (0..nodes.len()).filter(|&i| i != leader).collect();
    assert!(
        others
            .iter()
            .all(|&i| !nodes[i].log().contains("now sends the cluster's alerts")),
        "only one node sends"
    );
    drop(nodes.remove(leader));
    dead_letter(&nodes[0], "later", 1).await;
    hook.wait_for("dead_letters_appeared", "later").await;
    assert!(alert_leader(&nodes).is_some(), "a surviving node took over");
    dead_letter(&nodes[1], "last", 1).await;
    hook.wait_for("dead_letters_appeared", "last").await;
    assert_eq!(hook.of("dead_letters_appeared", "later").len(), 1);
    assert_eq!(
        hook.of("dead_letters_appeared", "report").len(),
        1,
        "not sent again"
    );
}

#[tokio::test]
async fn migrate_prepares_a_fresh_schema_once_and_a_node_serves_it() {
    let Some(url) = harness::pg_url() else {
        return;
    };
    let schema = PgSchema::fresh(&url);
    let migrate = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_lazaret"))
            .args(["migrate", "--store", &schema.store_url()])
            .output()
            .expect("lazaret migrate runs");
        assert!(
            out.status.success(),
            "migrate failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let first = migrate();
    assert!(
        first.contains(&format!(
            "schema {}: migrated from version 0 to",
            schema.name
        )),
        "{first}"
    );
    let again = migrate();
    assert!(again.contains("nothing to do"), "idempotent: {again}");
    let node = Server::on_schema(QUICK, &schema).await;
    let api = node.api();
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
    api.ack(&id, &leased["lease_token"]).await.expect(200);
    assert!(
        migrate().contains("nothing to do"),
        "and after a node served it"
    );
}

#[tokio::test]
async fn nodes_started_at_the_same_instant_on_a_fresh_schema_all_come_up() {
    let Some(url) = harness::pg_url() else {
        return;
    };
    // The race is between the nodes' first statements, so give it several
    // chances: every round is a fresh schema and three nodes spawned
    // together (each node's process starts at its task's first poll).
    for _ in 0..4 {
        let schema = PgSchema::fresh(&url);
        let starting: Vec<_> = (0..3)
            .map(|_| {
                let schema = Arc::clone(&schema);
                tokio::spawn(async move { Server::on_schema(QUICK, &schema).await })
            })
            .collect();
        let mut nodes = Vec::new();
        for node in starting {
            nodes.push(node.await.expect("every node comes up"));
        }
        let id = nodes[0]
            .api()
            .enqueue_ok(&job("report", "acme", json!({})))
            .await;
        let leased = nodes[2].api().lease_one(&lease_req("w", 1, 30_000)).await;
        assert_eq!(leased["id"], id, "one database behind all three");
    }
}
