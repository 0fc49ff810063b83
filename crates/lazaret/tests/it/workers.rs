//! Producers and workers: enqueue, lease, ack, fail, heartbeat, batches, long polls and fencing.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{Api, QUICK, Server, assert_error, at, job, lease_req};

#[tokio::test]
async fn an_enqueued_job_is_leased_with_every_field_then_acked() {
    let server = Server::start(QUICK).await;
    let api = server.api();

    let mut j = job("report", "acme", json!({"n": 42, "who": "ada"}));
    j["lane"] = json!("interactive");
    j["idempotency_key"] = json!("order-42");
    let r = api.enqueue(&j).await;
    let body = r.expect(201);
    assert_eq!(body["state"], "queued");
    assert_eq!(body["admission"], "ADMITTED");
    let id = body["id"].clone();

    let jobs = api
        .lease(
            &json!({"worker_id": "w-1", "lanes": ["interactive"], "types": null,
                        "max_jobs": 10, "lease_ms": 30_000, "wait_ms": 0}),
        )
        .await;
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    let leased = &jobs[0];
    for key in [
        "id",
        "type",
        "tenant",
        "lane",
        "payload",
        "attempt",
        "idempotency_key",
        "schema_version",
        "lease_token",
        "lease_expires_at",
        "created_at",
    ] {
        assert!(
            leased.as_object().unwrap().contains_key(key),
            "a leased job has `{key}`: {leased}"
        );
    }
    assert_eq!(leased["id"], id);
    assert_eq!(leased["type"], "report");
    assert_eq!(leased["tenant"], "acme");
    assert_eq!(leased["lane"], "interactive");
    assert_eq!(leased["payload"], json!({"n": 42, "who": "ada"}));
    assert_eq!(leased["attempt"], 1);
    assert_eq!(leased["idempotency_key"], "order-42");
    assert!(at(&leased["lease_expires_at"]) > at(&leased["created_at"]));

    let job_now = api.job(&id).await;
    assert_eq!(job_now["state"], "leased", "{job_now}");

    let r = api.ack(&id, &leased["lease_token"]).await;
    assert_eq!(r.expect(200)["state"], "succeeded");
    assert_eq!(api.job(&id).await["state"], "succeeded");
    // Nothing left to lease.
    assert!(api.lease(&lease_req("w-1", 10, 30_000)).await.is_empty());
}

#[tokio::test]
async fn get_job_has_every_field_with_null_for_no_value() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api
        .enqueue_ok(&job("report", "acme", json!({"a": [1, 2, 3]})))
        .await;

    let got = api.job(&id).await;
    let fields = got
        .as_object()
        .unwrap_or_else(|| panic!("an object: {got}"));
    for key in [
        "id",
        "type",
        "tenant",
        "lane",
        "state",
        "attempt",
        "idempotency_key",
        "payload",
        "created_at",
        "run_at",
        "history",
    ] {
        assert!(
            fields.contains_key(key),
            "GET /v1/jobs/{{id}} has `{key}`: {got}"
        );
    }
    assert_eq!(got["id"], id);
    assert_eq!(got["type"], "report");
    assert_eq!(got["tenant"], "acme");
    assert_eq!(
        got["lane"], "default",
        "the default lane when none is named"
    );
    assert_eq!(got["state"], "queued");
    assert!(got["idempotency_key"].is_null(), "no key → null: {got}");
    assert_eq!(got["payload"], json!({"a": [1, 2, 3]}));
    at(&got["created_at"]);
    assert!(got["history"].is_array(), "{got}");
    assert!(got["attempt"].is_u64(), "{got}");

    // After a delivery and an ack the history tells it.
    let leased = api.lease_one(&lease_req("w-7", 1, 30_000)).await;
    api.ack(&leased["id"], &leased["lease_token"])
        .await
        .expect(200);
    let got = api.job(&id).await;
    assert_eq!(got["state"], "succeeded");
    assert_eq!(got["attempt"], 1);
    let history = got["history"].as_array().unwrap();
    assert_eq!(history.len(), 1, "{got}");
    assert_eq!(history[0]["attempt"], 1);
    assert_eq!(history[0]["worker_id"], "w-7");
}

#[tokio::test]
async fn a_stale_lease_token_is_lease_lost_and_changes_nothing() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;

    // The first worker's lease runs out; the job is delivered again.
    let first = api.lease_one(&lease_req("w-slow", 1, 200)).await;
    let second = api.lease_one(&lease_req("w-fast", 1, 30_000)).await;
    assert_eq!(second["id"], id);
    assert_eq!(
        second["attempt"], 2,
        "an expired lease counts as an attempt"
    );
    assert_ne!(first["lease_token"], second["lease_token"]);

    let stale = &first["lease_token"];
    assert_error(&api.ack(&id, stale).await, 409, "LEASE_LOST", None);
    let r = api
        .fail(
            &id,
            stale,
            json!({"class": "permanent", "kind": "x", "message": "late"}),
        )
        .await;
    assert_error(&r, 409, "LEASE_LOST", None);
    assert_error(
        &api.heartbeat(&id, stale, 60_000).await,
        409,
        "LEASE_LOST",
        None,
    );
    let made_up = json!("not-a-token-anyone-was-given");
    assert_error(&api.ack(&id, &made_up).await, 409, "LEASE_LOST", None);

    // Nothing changed: still leased to the second worker, who can finish.
    let got = api.job(&id).await;
    assert_eq!(got["state"], "leased", "{got}");
    assert_eq!(got["attempt"], 2, "{got}");
    assert!(api.dead_letters("limit=10").await.is_empty());
    assert_eq!(
        api.ack(&id, &second["lease_token"]).await.expect(200)["state"],
        "succeeded"
    );
}

#[tokio::test]
async fn an_idempotent_enqueue_returns_the_existing_job_as_duplicate() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let mut j = job("report", "acme", json!({"n": 1}));
    j["idempotency_key"] = json!("order-42");
    let id = api.enqueue_ok(&j).await;

    let r = api.enqueue(&j).await;
    let body = r.expect(200);
    assert_eq!(body["admission"], "DUPLICATE");
    assert_eq!(body["id"], id);
    assert!(body.get("state").is_some(), "{body}");

    // The key is per (tenant, type): another tenant's job is new.
    let mut other = j.clone();
    other["tenant"] = json!("globex");
    let other_id = api.enqueue_ok(&other).await;
    assert_ne!(other_id, id);

    // Only two jobs exist.
    let jobs = api.lease(&lease_req("w", 10, 30_000)).await;
    assert_eq!(jobs.len(), 2, "{jobs:?}");
}

#[tokio::test]
async fn a_batch_with_one_bad_job_has_one_error_in_its_list() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let r = api
        .post(
            "/v1/jobs/batch",
            &json!({"jobs": [
                job("report", "acme", json!({"n": 1})),
                {"type": "report", "payload": {"n": 2}},
                job("report", "globex", json!({"n": 3})),
            ]}),
        )
        .await;
    let body = r.expect(200);
    let results = body["results"].as_array().expect("a results list");
    assert_eq!(results.len(), 3, "{body}");
    for ok in [&results[0], &results[2]] {
        assert!(ok.get("id").is_some(), "{ok}");
        assert_eq!(ok["state"], "queued");
        assert_eq!(ok["admission"], "ADMITTED");
    }
    assert_eq!(results[1]["error"]["code"], "NO_TENANT", "{body}");
    assert!(results[1]["error"]["message"].is_string(), "{body}");

    let mut leased: Vec<Value> = api
        .lease(&lease_req("w", 10, 30_000))
        .await
        .into_iter()
        .map(|j| j["payload"]["n"].clone())
        .collect();
    leased.sort_by_key(|n| n.as_u64());
    assert_eq!(leased, [json!(1), json!(3)]);
}

/// Enqueues `queued` report jobs and leases three of them as worker `w`.
async fn enqueue_and_lease_three(api: &Api, queued: u64) -> Vec<Value> {
    for n in 0..queued {
        api.enqueue_ok(&job("report", "acme", json!({"n": n})))
            .await;
    }
    let mut jobs = Vec::new();
    while jobs.len() < 3 {
        jobs.extend(api.lease_eventually(&lease_req("w", 3, 30_000)).await);
    }
    jobs
}

#[tokio::test]
async fn acks_and_fails_can_be_batched() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let jobs = enqueue_and_lease_three(&api, 3).await;
    let (a, b, c) = (&jobs[0], &jobs[1], &jobs[2]);

    let r = api
        .post(
            "/v1/acks",
            &json!({"items": [
                {"id": a["id"], "lease_token": a["lease_token"]},
                {"id": b["id"], "lease_token": "stale"},
            ]}),
        )
        .await;
    let body = r.expect(200);
    let results = body["results"].as_array().expect("results");
    assert_eq!(results.len(), 2, "{body}");
    assert_eq!(results[0]["state"], "succeeded", "{body}");
    assert_eq!(results[1]["error"]["code"], "LEASE_LOST", "{body}");

    let r = api
        .post(
            "/v1/fails",
            &json!({"items": [
                {"id": b["id"], "lease_token": b["lease_token"],
                 "error": {"class": "permanent", "kind": "bad_input", "message": "no"}},
                {"id": c["id"], "lease_token": c["lease_token"],
                 "error": {"class": "transient", "kind": "http_503", "message": "busy"}},
            ]}),
        )
        .await;
    let body = r.expect(200);
    let results = body["results"].as_array().expect("results");
    assert_eq!(results.len(), 2, "{body}");
    assert_eq!(results[0]["state"], "dead_lettered", "{body}");
    assert_eq!(results[0]["reason"], "permanent", "{body}");
    assert_eq!(results[1]["state"], "scheduled", "{body}");
    assert!(results[1].get("retry_at").is_some(), "{body}");
    assert_eq!(results[1]["attempt"], 1, "{body}");

    assert_eq!(api.job(&a["id"]).await["state"], "succeeded");
    assert_eq!(api.job(&b["id"]).await["state"], "dead_lettered");
    let again = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(again["id"], c["id"]);
    assert_eq!(again["attempt"], 2);
}

/// `POST /v1/outcomes` acks and fails one batch in one request, each item
/// with the meaning of its single-job endpoint, and with `next` answers
/// the next lease too; a bad `next` leaves the outcomes standing.
#[tokio::test]
async fn outcomes_ack_and_fail_in_one_request_and_lease_the_next() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let jobs = enqueue_and_lease_three(&api, 5).await;
    let (a, b, c) = (&jobs[0], &jobs[1], &jobs[2]);

    let r = api
        .post(
            "/v1/outcomes",
            &json!({"items": [
                {"id": a["id"], "lease_token": a["lease_token"]},
                {"id": b["id"], "lease_token": b["lease_token"],
                 "error": {"class": "permanent", "kind": "bad_input", "message": "no"}},
                {"id": c["id"], "lease_token": "stale"},
            ], "next": lease_req("w", 2, 30_000)}),
        )
        .await;
    let body = r.expect(200);
    let results = body["results"].as_array().expect("results");
    assert_eq!(results.len(), 3, "{body}");
    assert_eq!(results[0]["state"], "succeeded", "{body}");
    assert_eq!(results[1]["state"], "dead_lettered", "{body}");
    assert_eq!(results[1]["reason"], "permanent", "{body}");
    assert_eq!(results[2]["error"]["code"], "LEASE_LOST", "{body}");
    let next = body["jobs"].as_array().expect("jobs: the next lease");
    assert_eq!(next.len(), 2, "the two jobs still queued: {body}");
    assert!(body.get("next_error").is_none(), "{body}");
    assert_eq!(api.job(&a["id"]).await["state"], "succeeded");
    assert_eq!(api.job(&b["id"]).await["state"], "dead_lettered");
    assert_eq!(api.job(&c["id"]).await["state"], "leased");

    // Without `next`, the reply is the results alone; a bad `next` is
    // refused in `next_error` while the outcomes stand.
    let r = api
        .post(
            "/v1/outcomes",
            &json!({"items": [{"id": next[0]["id"], "lease_token": next[0]["lease_token"]}],
                    "next": {"worker_id": "w", "max_jobs": 0}}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["results"][0]["state"], "succeeded", "{body}");
    assert_eq!(body["jobs"], json!([]), "{body}");
    assert_eq!(body["next_error"]["code"], "BAD_REQUEST", "{body}");
    assert_eq!(api.job(&next[0]["id"]).await["state"], "succeeded");
    let r = api
        .post(
            "/v1/outcomes",
            &json!({"items": [{"id": next[1]["id"], "lease_token": next[1]["lease_token"],
                               "error": {"class": "transient", "kind": "http_503"}}]}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["results"][0]["state"], "scheduled", "{body}");
    assert!(
        body.get("jobs").is_none(),
        "no lease asked, none answered: {body}"
    );
}

#[tokio::test]
async fn a_heartbeat_extends_the_lease() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let leased = api.lease_one(&lease_req("w", 1, 1000)).await;
    let before = at(&leased["lease_expires_at"]);

    let r = api.heartbeat(&id, &leased["lease_token"], 60_000).await;
    let after = at(&r.expect(200)["lease_expires_at"]);
    assert!(
        after >= before + Duration::from_secs(30),
        "extended by about a minute: {before:?} → {after:?}"
    );

    // Past the first expiry the job is still held: no one else gets it.
    let mut req = lease_req("w-other", 1, 30_000);
    req["wait_ms"] = json!(2000);
    assert!(
        api.lease(&req).await.is_empty(),
        "the heartbeat kept the lease"
    );
    assert_eq!(api.job(&id).await["state"], "leased");
    api.ack(&id, &leased["lease_token"]).await.expect(200);
}

#[tokio::test]
async fn a_long_poll_returns_as_soon_as_a_job_is_enqueued() {
    let server = Server::start(QUICK).await;
    let api = server.api();

    let waiting = {
        let api = api.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let mut req = lease_req("w", 1, 30_000);
            req["wait_ms"] = json!(20_000);
            let jobs = api.lease(&req).await;
            (jobs, started.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;

    let (jobs, took) = waiting.await.expect("the waiting lease");
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    assert_eq!(jobs[0]["id"], id);
    assert!(
        took < Duration::from_secs(15),
        "a long poll answers when the job comes, not when the wait ends (took {took:?})"
    );

    // With nothing to lease, the wait ends empty.
    let mut req = lease_req("w", 1, 30_000);
    req["wait_ms"] = json!(200);
    assert!(api.lease(&req).await.is_empty());
}
