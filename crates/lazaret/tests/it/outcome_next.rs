//! `next` on ack and fail: the outcome, then the next lease, in one round trip.

use serde_json::{Value, json};

use crate::harness::{QUICK, Server, assert_error, id_text, job, lease_req};

fn ack_next(token: &Value, next: Value) -> Value {
    json!({"lease_token": token, "next": next})
}

#[tokio::test]
async fn an_ack_with_next_answers_the_outcome_and_the_next_lease() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let first = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let second = api
        .enqueue_ok(&job("report", "acme", json!({"n": 2})))
        .await;
    let leased = api.lease_one(&lease_req("w-1", 1, 30_000)).await;
    assert_eq!(leased["id"], first);

    let r = api
        .post(
            &format!("/v1/jobs/{}/ack", id_text(&first)),
            &ack_next(&leased["lease_token"], lease_req("w-1", 5, 30_000)),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["state"], "succeeded", "{body}");
    assert!(body.get("next_error").is_none(), "{body}");
    let jobs = body["jobs"].as_array().expect("jobs");
    assert_eq!(jobs.len(), 1, "{body}");
    let next = &jobs[0];
    assert_eq!(next["id"], second);
    assert_eq!(next["payload"], json!({"n": 2}));
    assert_eq!(next["attempt"], 1);
    assert!(next["lease_token"].is_string() || next["lease_token"].is_number());
    assert_eq!(api.job(&first).await["state"], "succeeded");
    assert_eq!(api.job(&second).await["state"], "leased");

    // The lease it answered is a real one: the next outcome takes its token.
    let third = api
        .enqueue_ok(&job("report", "acme", json!({"n": 3})))
        .await;
    let r = api
        .post(
            &format!("/v1/jobs/{}/fail", id_text(&second)),
            &json!({"lease_token": next["lease_token"],
                    "error": {"class": "permanent", "kind": "bad", "message": "no"},
                    "next": lease_req("w-1", 1, 30_000)}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["state"], "dead_lettered", "{body}");
    assert_eq!(body["reason"], "permanent", "{body}");
    assert_eq!(body["jobs"][0]["id"], third, "{body}");

    // Nothing left: the reply carries the outcome and an empty list.
    let r = api
        .post(
            &format!("/v1/jobs/{}/ack", id_text(&third)),
            &ack_next(&body["jobs"][0]["lease_token"], lease_req("w-1", 1, 30_000)),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["state"], "succeeded");
    assert_eq!(body["jobs"], json!([]));
    assert!(body.get("next_error").is_none(), "{body}");
}

#[tokio::test]
async fn the_outcome_stands_when_the_lease_part_is_refused() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let a = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let b = api
        .enqueue_ok(&job("report", "acme", json!({"n": 2})))
        .await;
    let waiting = api
        .enqueue_ok(&job("report", "acme", json!({"n": 3})))
        .await;
    let mut req = lease_req("w-1", 2, 30_000);
    req["max_jobs"] = json!(2);
    let leased = api.lease(&req).await;
    assert_eq!(leased.len(), 2, "{leased:?}");
    let token = |id: &Value| {
        leased
            .iter()
            .find(|j| &j["id"] == id)
            .map(|j| j["lease_token"].clone())
            .expect("leased")
    };

    // A lease request the lease endpoint would refuse: max_jobs 0.
    let r = api
        .post(
            &format!("/v1/jobs/{}/ack", id_text(&a)),
            &ack_next(&token(&a), json!({"worker_id": "w-1", "max_jobs": 0})),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["state"], "succeeded", "{body}");
    assert_eq!(body["jobs"], json!([]), "{body}");
    assert_eq!(body["next_error"]["code"], "BAD_REQUEST", "{body}");
    let message = body["next_error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("max_jobs"), "{body}");
    assert_eq!(api.job(&a).await["state"], "succeeded");

    // A `next` that is not a lease request at all: the fail still stands.
    let r = api
        .post(
            &format!("/v1/jobs/{}/fail", id_text(&b)),
            &json!({"lease_token": token(&b),
                    "error": {"class": "permanent", "kind": "bad", "message": "no"},
                    "next": {"max_jobs": "many"}}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["state"], "dead_lettered", "{body}");
    assert_eq!(body["jobs"], json!([]), "{body}");
    assert_eq!(body["next_error"]["code"], "BAD_REQUEST", "{body}");
    assert_eq!(api.job(&b).await["state"], "dead_lettered");
    assert_eq!(api.job(&waiting).await["state"], "queued");
}

#[tokio::test]
async fn a_refused_outcome_leases_nothing() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let a = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let leased = api.lease_one(&lease_req("w-1", 1, 30_000)).await;
    let waiting = api
        .enqueue_ok(&job("report", "acme", json!({"n": 2})))
        .await;

    let r = api
        .post(
            &format!("/v1/jobs/{}/ack", id_text(&a)),
            &ack_next(&json!("12345"), lease_req("w-1", 1, 30_000)),
        )
        .await;
    assert_error(&r, 409, "LEASE_LOST", None);
    assert!(r.body.get("jobs").is_none(), "{}", r.text());
    assert_eq!(api.job(&waiting).await["state"], "queued");

    // The real holder's ack still works, and its `next` takes the job.
    let r = api
        .post(
            &format!("/v1/jobs/{}/ack", id_text(&a)),
            &ack_next(&leased["lease_token"], lease_req("w-1", 1, 30_000)),
        )
        .await;
    assert_eq!(r.expect(200)["jobs"][0]["id"], waiting);
}
