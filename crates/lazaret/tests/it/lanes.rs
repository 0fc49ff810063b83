//! Lanes: a reserved share of the leases held, and `on_breaker_open = "park"` (accept while the breaker is open, run once it closes).

use serde_json::{Value, json};

use crate::harness::{Api, QUICK, Server, assert_error, job, lease_req};

/// A breaker that opens after two `http_503` failures and turns half-open
/// 300 ms later with one probe; the lane `inbox` parks instead of shedding.
async fn start() -> Server {
    let config = format!(
        "[lanes.inbox]
on_breaker_open = \"park\"
{QUICK}
[types.fragile]
attempts_max = 10

[types.fragile.breaker]
failures_min = 2
failure_ratio = 0.5
window_ms = 60000
cooldown_ms = 300
probes = 1
"
    );
    Server::start(&config).await
}

async fn breaker_state(api: &Api) -> Option<String> {
    let body = api.get("/v1/breakers").await.expect(200).clone();
    body["breakers"]
        .as_array()
        .expect("a breakers list")
        .iter()
        .find(|b| b["type"] == "fragile")
        .map(|b| b["state"].as_str().unwrap_or_default().to_owned())
}

fn in_lane(lane: &str, n: u32) -> Value {
    let mut j = job("fragile", "acme", json!({"n": n}));
    j["lane"] = json!(lane);
    j
}

#[tokio::test]
async fn a_park_lane_accepts_while_the_breaker_is_open_and_runs_its_jobs_after() {
    let server = start().await;
    let api = server.api();
    // Two failures open the breaker (both jobs are retried later).
    for n in 0..2 {
        api.enqueue_ok(&in_lane("default", n)).await;
    }
    let mut fragile = lease_req("w", 1, 30_000);
    fragile["types"] = json!(["fragile"]);
    for _ in 0..2 {
        let leased = api.lease_one(&fragile).await;
        api.fail(
            &leased["id"],
            &leased["lease_token"],
            json!({"class": "transient", "kind": "http_503", "message": "down"}),
        )
        .await
        .expect(200);
    }

    // While it is open (or half-open: it admits like open), a shedding
    // lane answers 503 SHED and the park lane accepts. Each check is made
    // only if the breaker was not yet closed after it.
    let shed = api.enqueue(&in_lane("default", 10)).await;
    let parked = api.enqueue(&in_lane("inbox", 11)).await;
    let state = breaker_state(&api).await;
    assert!(
        state.is_some(),
        "nothing closes the breaker before a probe succeeds"
    );
    assert_error(&shed, 503, "SHED", None);
    let body = parked.expect(201);
    assert_eq!(body["state"], "queued", "{body}");
    let parked_id = body["id"].clone();

    // Not leased while the breaker is open: if it is still open after the
    // lease, it was open during it.
    let mut inbox = fragile.clone();
    inbox["lanes"] = json!(["inbox"]);
    let jobs = api.lease(&inbox).await;
    if breaker_state(&api).await.as_deref() == Some("open") {
        assert!(jobs.is_empty(), "leased while open: {jobs:?}");
    }
    let early = jobs.first().map(|j| j["id"].clone());
    assert!(
        early.is_none() || early.as_ref() == Some(&parked_id),
        "{jobs:?}"
    );

    // Once half-open, the probe goes through (a long-poll is woken by the
    // breaker turning half-open); its success closes the breaker and the
    // parked job runs.
    let mut any = lease_req("w", 1, 30_000);
    any["types"] = json!(["fragile"]);
    any["wait_ms"] = json!(5_000);
    let mut ran_parked = early.is_some();
    if let Some(j) = jobs.first() {
        api.ack(&j["id"], &j["lease_token"]).await.expect(200);
    }
    while !ran_parked {
        let leased = api.lease_one(&any).await;
        ran_parked = leased["id"] == parked_id;
        api.ack(&leased["id"], &leased["lease_token"])
            .await
            .expect(200);
    }
    assert_eq!(api.job(&parked_id).await["state"], "succeeded");
    assert_eq!(
        breaker_state(&api).await,
        None,
        "closed by the probe's success"
    );
    // Closed: the shedding lane admits again.
    assert_eq!(api.enqueue(&in_lane("default", 12)).await.status, 201);
}

/// The tenants' caps out of the way, and three lanes: `interactive`
/// weighs 1 but reserves 0.3 of the leases held; `bulk` weighs 9.
const RESERVED: &str = r#"
[tenants]
inflight_max = 1000

[lanes.interactive]
weight = 1
reserve = 0.3
[lanes.batch]
weight = 1
[lanes.bulk]
weight = 9
"#;

async fn enqueue_in(api: &Api, lane: &str, n: u32) {
    for i in 0..n {
        let mut j = job("work", "acme", json!({"i": i}));
        j["lane"] = json!(lane);
        api.enqueue_ok(&j).await;
    }
}

fn lanes_of(jobs: &[Value]) -> Vec<String> {
    let mut lanes: Vec<String> = jobs
        .iter()
        .map(|j| j["lane"].as_str().unwrap_or_default().to_owned())
        .collect();
    lanes.sort();
    lanes
}

#[tokio::test]
async fn a_reserved_lane_takes_back_its_share_of_the_leases_held() {
    let server = Server::start(RESERVED).await;
    let api = server.api();

    // Idle, its share is lent: batch takes seven leases with nothing
    // ready left behind them.
    enqueue_in(&api, "batch", 7).await;
    let mut req = lease_req("w", 10, 30_000);
    let held = api.lease(&req).await;
    assert_eq!(lanes_of(&held), vec!["batch"; 7]);

    // Work arrives in interactive and in the heavy bulk lane. Of the
    // leases held, seven are batch's: the next three are interactive's
    // (3 of 10 held), weights notwithstanding, because every lease held
    // counts, also those of a lane with nothing ready.
    enqueue_in(&api, "interactive", 10).await;
    enqueue_in(&api, "bulk", 10).await;
    req["max_jobs"] = json!(3);
    let next = api.lease(&req).await;
    assert_eq!(lanes_of(&next), vec!["interactive"; 3], "{next:?}");

    // Holding its share, interactive is back to its weight: of the next
    // ten, bulk (weight 9) takes most.
    req["max_jobs"] = json!(10);
    let rest = lanes_of(&api.lease(&req).await);
    let bulk = rest.iter().filter(|l| *l == "bulk").count();
    assert!(bulk >= 7, "{rest:?}");
}
