//! Durability: what the server acknowledged survives a restart, and a `kill -9` too.

use serde_json::{Value, json};

use crate::harness::{QUICK, Server, id_text, job, lease_req};

/// What one run of the server left behind, to look for after a restart.
struct Before {
    acked: Value,
    dead: Value,
    waiting: Value,
    keyed: Value,
    payload: &'static str,
}

async fn leave_some_state(server: &Server) -> Before {
    let api = server.api();
    let acked = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], acked);
    api.ack(&acked, &leased["lease_token"]).await.expect(200);

    let payload = r#"{"n" : 2,  "odd":  "spacing"}"#;
    let body = format!(r#"{{"type": "report", "tenant": "acme", "payload": {payload}}}"#);
    let dead = api.post_raw("/v1/jobs", body).await.expect(201)["id"].clone();
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], dead);
    api.fail(
        &dead,
        &leased["lease_token"],
        json!({"class": "permanent", "kind": "bad", "message": "no"}),
    )
    .await
    .expect(200);

    let mut j = job("report", "acme", json!({"n": 3}));
    j["idempotency_key"] = json!("order-3");
    let keyed = api.enqueue_ok(&j).await;
    let waiting = api
        .enqueue_ok(&job("report", "globex", json!({"n": 4})))
        .await;
    Before {
        acked,
        dead,
        waiting,
        keyed,
        payload,
    }
}

async fn everything_is_still_there(server: &Server, before: &Before) {
    let api = server.api();
    assert_eq!(api.job(&before.acked).await["state"], "succeeded");
    assert_eq!(api.job(&before.dead).await["state"], "dead_lettered");
    let dead = api.dead_letter_of(&before.dead).await;
    assert_eq!(dead["reason"], "permanent");
    let r = api
        .get(&format!(
            "/v1/dead-letters/{}/payload",
            id_text(&dead["id"])
        ))
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.bytes, before.payload.as_bytes());

    let mut j = job("report", "acme", json!({"n": 3}));
    j["idempotency_key"] = json!("order-3");
    let r = api.enqueue(&j).await;
    let body = r.expect(200);
    assert_eq!(body["admission"], "DUPLICATE");
    assert_eq!(body["id"], before.keyed);

    // Both queued jobs are still there to be leased, and nothing else.
    let mut leased = Vec::new();
    while leased.len() < 2 {
        leased.extend(api.lease_eventually(&lease_req("w", 10, 30_000)).await);
    }
    let mut ids: Vec<String> = leased.iter().map(|j| id_text(&j["id"])).collect();
    ids.sort();
    let mut want = vec![id_text(&before.keyed), id_text(&before.waiting)];
    want.sort();
    assert_eq!(ids, want);
    for j in &leased {
        assert_eq!(j["attempt"], 1);
        api.ack(&j["id"], &j["lease_token"]).await.expect(200);
    }
}

#[tokio::test]
async fn a_restart_keeps_jobs_acks_and_dead_letters() {
    let mut server = Server::start(QUICK).await;
    let before = leave_some_state(&server).await;
    server.restart().await;
    everything_is_still_there(&server, &before).await;
}

#[tokio::test]
async fn a_kill_9_loses_nothing_the_server_had_acknowledged() {
    let mut server = Server::start(QUICK).await;
    let before = leave_some_state(&server).await;
    server.kill_and_restart().await;
    everything_is_still_there(&server, &before).await;
}

#[tokio::test]
async fn a_lease_held_across_a_kill_9_expires_and_the_job_runs_again() {
    let mut server = Server::start(QUICK).await;
    let id = server
        .api()
        .enqueue_ok(&job("report", "acme", json!({})))
        .await;
    let leased = server.api().lease_one(&lease_req("w", 1, 500)).await;
    assert_eq!(leased["id"], id);
    server.kill_and_restart().await;

    let api = server.api();
    let again = api.lease_one(&lease_req("w-2", 1, 30_000)).await;
    assert_eq!(again["id"], id);
    assert_eq!(again["attempt"], 2, "the lost lease was a charged attempt");
    api.ack(&id, &again["lease_token"]).await.expect(200);
}
