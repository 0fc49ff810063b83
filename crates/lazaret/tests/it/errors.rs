//! The error codes of the contract and the one error body shape they share.
//!
//! POISON has its own module (`admission`), LEASE_LOST is with the workers,
//! UNAUTHORIZED/FORBIDDEN with `auth`.

use serde_json::json;

use crate::harness::{QUICK, Server, assert_error, id_text, job, lease_req, unknown_id_like};

#[tokio::test]
async fn a_missing_or_empty_tenant_is_no_tenant() {
    let server = Server::start(QUICK).await;
    let api = server.api();

    let r = api
        .enqueue(&json!({"type": "report", "payload": {"n": 1}}))
        .await;
    assert_error(&r, 400, "NO_TENANT", None);

    let r = api.enqueue(&job("report", "", json!({"n": 1}))).await;
    assert_error(&r, 400, "NO_TENANT", None);

    // Nothing refused reaches a worker.
    assert!(api.lease(&lease_req("w", 10, 30_000)).await.is_empty());
}

#[tokio::test]
async fn an_unknown_type_is_refused_when_only_known_types_are_accepted() {
    let config =
        format!("accept_unknown_types = false\n{QUICK}\n[types.report]\nattempts_max = 2\n");
    let server = Server::start(&config).await;
    let api = server.api();

    let r = api.enqueue(&job("sned_email", "acme", json!({}))).await;
    assert_error(&r, 422, "UNKNOWN_TYPE", None);

    let known = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let leased = api.lease(&lease_req("w", 10, 30_000)).await;
    assert_eq!(
        leased.len(),
        1,
        "only the known type was admitted: {leased:?}"
    );
    assert_eq!(leased[0]["id"], known);
}

#[tokio::test]
async fn a_missing_job_type_is_bad_request() {
    let server = Server::start(QUICK).await;
    let r = server
        .api()
        .enqueue(&json!({"tenant": "acme", "payload": {}}))
        .await;
    assert_error(&r, 400, "BAD_REQUEST", None);
}

#[tokio::test]
async fn malformed_json_bodies_are_bad_request_everywhere() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
    let id = id_text(&id);

    // On `POST /v1/jobs` a body that is not JSON is the one way a payload
    // can fail to be JSON: that is POISON invalid_json (see `admission`),
    // kept as an admission record. Everywhere else it is BAD_REQUEST.
    for body in ["this is not json", "{\"type\": \"report\", "] {
        let r = api.post_raw("/v1/jobs", body).await;
        assert_error(&r, 422, "POISON", Some("invalid_json"));
    }

    let paths = [
        "/v1/jobs/batch".to_owned(),
        "/v1/leases".to_owned(),
        format!("/v1/jobs/{id}/ack"),
        format!("/v1/jobs/{id}/fail"),
        format!("/v1/jobs/{id}/heartbeat"),
        "/v1/acks".to_owned(),
        "/v1/fails".to_owned(),
        "/v1/outcomes".to_owned(),
        "/v1/dead-letters/redrive".to_owned(),
    ];
    for path in &paths {
        for body in ["this is not json", "{\"worker_id\": \"w\", "] {
            let r = api.post_raw(path, body).await;
            assert_eq!(r.status, 400, "POST {path} with {body:?}: {}", r.text());
            assert_error(&r, 400, "BAD_REQUEST", None);
        }
    }

    // Well-formed JSON of the wrong shape is malformed too.
    let r = api
        .post("/v1/leases", &json!({"worker_id": "w", "max_jobs": "ten"}))
        .await;
    assert_error(&r, 400, "BAD_REQUEST", None);

    // None of it disturbed the lease.
    let job = api.job(&leased["id"]).await;
    assert_eq!(job["state"], "leased", "{job}");
    api.ack(&leased["id"], &leased["lease_token"])
        .await
        .expect(200);
}

#[tokio::test]
async fn unknown_ids_are_not_found() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let real = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    api.fail(
        &leased["id"],
        &leased["lease_token"],
        json!({"class": "permanent", "kind": "bad", "message": "no"}),
    )
    .await
    .expect(200);
    let real_dead = api.dead_letter_of(&real).await["id"].clone();

    let ghost = unknown_id_like(&real);
    let token = &leased["lease_token"];
    let r = api.get(&format!("/v1/jobs/{ghost}")).await;
    assert_error(&r, 404, "NOT_FOUND", None);
    for verb in ["ack", "fail", "heartbeat"] {
        let r = api
            .post(
                &format!("/v1/jobs/{ghost}/{verb}"),
                &json!({"lease_token": token, "extend_ms": 1000,
                        "error": {"class": "transient", "kind": "x", "message": "m"}}),
            )
            .await;
        assert_error(&r, 404, "NOT_FOUND", None);
    }

    let ghost_dead = unknown_id_like(&real_dead);
    let r = api.get(&format!("/v1/dead-letters/{ghost_dead}")).await;
    assert_error(&r, 404, "NOT_FOUND", None);
    let r = api
        .get(&format!("/v1/dead-letters/{ghost_dead}/payload"))
        .await;
    assert_error(&r, 404, "NOT_FOUND", None);
}

#[tokio::test]
async fn a_paused_type_is_shed_with_retry_after_until_it_is_resumed() {
    let server = Server::start(QUICK).await;
    let api = server.api();

    api.post("/v1/pause", &json!({"type": "report"}))
        .await
        .expect(200);
    let r = api.enqueue(&job("report", "acme", json!({}))).await;
    assert_error(&r, 503, "SHED", None);
    let retry_after = r
        .headers
        .get("retry-after")
        .expect("a SHED reply carries Retry-After");
    let retry_after = retry_after.to_str().unwrap().trim();
    assert!(
        retry_after.parse::<u64>().is_ok() || retry_after.ends_with("GMT"),
        "Retry-After is seconds or an HTTP date: {retry_after:?}"
    );
    // Other types are not shed.
    api.enqueue_ok(&job("other", "acme", json!({}))).await;

    api.post("/v1/resume", &json!({"type": "report"}))
        .await
        .expect(200);
    api.enqueue_ok(&job("report", "acme", json!({}))).await;
}
