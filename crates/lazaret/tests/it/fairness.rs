//! Fairness: a tenant at its cap waits its turn, and a poison job never holds up the jobs behind it.

use serde_json::json;

use crate::harness::{QUICK, Server, job, lease_req};

#[tokio::test]
async fn a_tenant_at_its_cap_is_fair_queued_and_another_tenant_is_leased_first() {
    let config = "
[tenants]
inflight_max = 1

[defaults]
backoff_base_ms = 20
backoff_cap_ms = 100
";
    let server = Server::start(config).await;
    let api = server.api();

    let a1 = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let first = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(first["id"], a1);

    // acme has one job in flight in the default lane: its cap.
    let r = api.enqueue(&job("report", "acme", json!({"n": 2}))).await;
    let body = r.expect(201);
    assert_eq!(body["admission"], "FAIR_QUEUE", "{body}");
    assert_eq!(body["state"], "queued");
    let a2 = body["id"].clone();

    let r = api.enqueue(&job("report", "globex", json!({"n": 1}))).await;
    let body = r.expect(201);
    assert_eq!(body["admission"], "ADMITTED", "{body}");
    let g1 = body["id"].clone();

    // globex goes first, though acme's job came earlier.
    let next = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(next["id"], g1, "the tenant under its cap is served first");

    // Both tenants are at their caps: nothing more until acme frees a slot.
    let mut req = lease_req("w", 10, 30_000);
    req["wait_ms"] = json!(300);
    assert!(api.lease(&req).await.is_empty(), "acme is held at its cap");

    api.ack(&a1, &first["lease_token"]).await.expect(200);
    let last = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(
        last["id"], a2,
        "acme's waiting job runs once a slot is free"
    );
}

/// Without `[tenants] inflight_max` there is no cap: one team, one tenant,
/// every worker busy. Tenants still take turns.
#[tokio::test]
async fn without_a_configured_cap_a_tenant_takes_every_worker_and_tenants_still_take_turns() {
    let server = Server::start("").await;
    let api = server.api();
    let mut acme = Vec::new();
    for n in 0..6 {
        let body = api
            .enqueue(&job("report", "acme", json!({"n": n})))
            .await
            .expect(201)
            .clone();
        assert_eq!(
            body["admission"], "ADMITTED",
            "no cap, no FAIR_QUEUE: {body}"
        );
        acme.push(body["id"].clone());
    }
    let globex = api
        .enqueue_ok(&job("report", "globex", json!({"n": 0})))
        .await;

    // Two slots: one each, though acme's six came first.
    let first = api.lease(&lease_req("w", 2, 30_000)).await;
    let mut ids: Vec<_> = first.iter().map(|j| j["id"].clone()).collect();
    ids.sort_by_key(|v| v.to_string());
    let mut want = vec![acme[0].clone(), globex.clone()];
    want.sort_by_key(|v| v.to_string());
    assert_eq!(ids, want, "one of each tenant first");

    // acme holds one lease; with the old default cap of 2 it would get one
    // more. Without a cap it gets the other five.
    let rest = api.lease(&lease_req("w", 10, 30_000)).await;
    assert_eq!(
        rest.iter().map(|j| j["id"].clone()).collect::<Vec<_>>(),
        acme[1..].to_vec()
    );
    let body = api
        .enqueue(&job("report", "acme", json!({"n": 6})))
        .await
        .expect(201)
        .clone();
    assert_eq!(
        body["admission"], "ADMITTED",
        "six in flight, still no cap: {body}"
    );
}

#[tokio::test]
async fn a_lease_waiting_on_a_tenants_cap_wakes_when_an_ack_frees_a_slot() {
    let server = Server::start("[tenants]\ninflight_max = 1\n").await;
    let api = server.api();
    let a1 = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let a2 = api
        .enqueue_ok(&job("report", "acme", json!({"n": 2})))
        .await;
    let first = api.lease_one(&lease_req("w-1", 1, 30_000)).await;
    assert_eq!(first["id"], a1);

    // acme is at its cap: a second worker long-polls for 20 s.
    let waiting = {
        let api = api.clone();
        tokio::spawn(async move {
            let mut req = lease_req("w-2", 1, 30_000);
            req["wait_ms"] = json!(20_000);
            let started = std::time::Instant::now();
            (api.lease(&req).await, started.elapsed())
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "acme's second job leased past its cap"
    );

    // The ack frees acme's slot: the waiter gets the job long before its
    // wait runs out (no other event happens meanwhile).
    api.ack(&a1, &first["lease_token"]).await.expect(200);
    let (got, waited) = waiting.await.expect("the waiter");
    assert_eq!(got.len(), 1, "the waiter got acme's next job");
    assert_eq!(got[0]["id"], a2);
    assert!(
        waited < std::time::Duration::from_secs(15),
        "woken by the ack, not by the end of its wait: {waited:?}"
    );
}

#[tokio::test]
async fn a_poison_job_at_the_head_of_a_lane_does_not_delay_the_healthy_jobs_behind_it() {
    let server = Server::start(QUICK).await;
    let api = server.api();

    // The poison comes first; five healthy jobs queue behind it.
    let poison = api
        .enqueue_ok(&job("render", "acme", json!({"poison": true})))
        .await;
    let mut healthy = Vec::new();
    for n in 0..5 {
        healthy.push(
            api.enqueue_ok(&job("render", "acme", json!({"n": n})))
                .await,
        );
    }

    // One worker at a time, one job at a time. The poison hangs its worker
    // (the lease is held and never answered); every healthy job still runs.
    let mut done = Vec::new();
    let mut poison_held = None;
    while done.len() < healthy.len() {
        let mut req = lease_req("w", 1, 60_000);
        req["wait_ms"] = json!(2000);
        let jobs = api.lease(&req).await;
        assert_eq!(
            jobs.len(),
            1,
            "a healthy job is ready, so a lease gets it at once (done so far: {done:?})"
        );
        let j = &jobs[0];
        if j["id"] == poison {
            assert!(
                poison_held.is_none(),
                "a held lease is not handed out twice"
            );
            poison_held = Some(j["lease_token"].clone());
        } else {
            api.ack(&j["id"], &j["lease_token"]).await.expect(200);
            done.push(j["id"].clone());
        }
    }
    for id in &healthy {
        assert_eq!(api.job(id).await["state"], "succeeded");
    }

    // The poison is still stuck where it was, and then fails for good.
    if let Some(token) = poison_held {
        assert_eq!(api.job(&poison).await["state"], "leased");
        let r = api
            .fail(
                &poison,
                &token,
                json!({"class": "permanent", "kind": "render_crash", "message": "segfault"}),
            )
            .await;
        assert_eq!(r.expect(200)["reason"], "permanent");
    }
}

/// `[tenants] ready_max` bounds the distinct tenants with jobs ready
/// (issue 32, item 10): a job of one more is refused `429
/// TOO_MANY_TENANTS` and nothing is queued, a tenant already waiting is
/// still served, and a tenant whose jobs are all leased makes room.
#[tokio::test]
async fn a_new_tenant_beyond_ready_max_is_refused_with_429() {
    let server = Server::start("[tenants]\nready_max = 2\n").await;
    let api = server.api();
    api.enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    api.enqueue_ok(&job("report", "globex", json!({"n": 1})))
        .await;

    let r = api
        .enqueue(&job("report", "initech", json!({"n": 1})))
        .await;
    let body = r.expect(429);
    assert_eq!(body["error"]["code"], "TOO_MANY_TENANTS", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("`initech`") && message.contains("[tenants] ready_max"),
        "the message names the tenant and the key: {message}"
    );
    // In a batch, the refused job is one error in the list.
    let r = api
        .post(
            "/v1/jobs/batch",
            &json!({"jobs": [
                job("report", "acme", json!({"n": 2})),
                job("report", "umbrella", json!({"n": 1})),
            ]}),
        )
        .await;
    let results = r.expect(200)["results"].clone();
    assert!(
        results[0]["id"].is_string(),
        "acme waits already: {results}"
    );
    assert_eq!(results[1]["error"]["code"], "TOO_MANY_TENANTS", "{results}");

    // Nothing of the refused tenants was queued.
    let page = api.get("/v1/jobs?tenant=initech").await;
    assert_eq!(page.expect(200)["items"], json!([]));

    // globex's only job is leased: two tenants wait no more than one.
    let mut req = lease_req("w", 10, 30_000);
    req["types"] = json!(["report"]);
    let leased = api.lease(&req).await;
    assert_eq!(leased.len(), 3, "acme's two and globex's one");
    api.enqueue_ok(&job("report", "initech", json!({"n": 1})))
        .await;
}
