//! Hostile input: durations far out of range, and requests axum itself
//! refuses (bad query strings, wrong methods, bad paths, bodies that are not
//! objects). Each is refused in the contract's error envelope, before
//! anything is written, and the server keeps serving the jobs it has.

use serde_json::{Value, json};

use crate::harness::{Api, QUICK, Server, assert_error, id_text, job, lease_req};

/// 3·10^14 ms: about 9,500 years, past year 9999 from now.
const HUGE_MS: u64 = 300_000_000_000_000;

/// One more than the documented cap of `delay_ms` / `retry_after_ms` (366 days).
const OVER_CAP_MS: u64 = 366 * 24 * 60 * 60 * 1000 + 1;

/// Asserts a 400 `BAD_REQUEST` whose message names `field` and the cap.
#[track_caller]
fn assert_duration_refused(r: &crate::harness::Reply, field: &str) {
    let e = assert_error(r, 400, "BAD_REQUEST", None);
    let message = e["message"].as_str().unwrap_or("");
    assert!(message.contains(field), "names {field}: {e}");
    assert!(message.contains("at most"), "says the maximum: {e}");
}

/// How many jobs a lease of every lane takes now (leasing them for 30 s).
async fn leasable(api: &Api) -> Vec<Value> {
    api.lease(&lease_req("hostile-w", 100, 30_000)).await
}

#[tokio::test]
async fn a_huge_delay_is_refused_on_enqueue_and_in_a_batch() {
    let server = Server::start(QUICK).await;
    let api = server.api();

    for delay in [HUGE_MS, OVER_CAP_MS, u64::MAX] {
        let mut j = job("report", "acme", json!({"n": 1}));
        j["delay_ms"] = json!(delay);
        let r = api.enqueue(&j).await;
        assert_duration_refused(&r, "delay_ms");
    }

    // In a batch, the bad job is one error in the list; the good one is admitted.
    let mut bad = job("report", "acme", json!({"n": 2}));
    bad["delay_ms"] = json!(HUGE_MS);
    let good = job("report", "acme", json!({"n": 3}));
    let r = api
        .post("/v1/jobs/batch", &json!({"jobs": [bad, good]}))
        .await;
    let results = r.expect(200)["results"].clone();
    let err = &results[0]["error"];
    assert_eq!(err["code"], "BAD_REQUEST", "{results}");
    assert!(
        err["message"].as_str().unwrap_or("").contains("delay_ms"),
        "{results}"
    );
    assert_eq!(results[1]["state"], "queued", "{results}");
    let good_id = results[1]["id"].clone();

    // The longest allowed delay is admitted and readable.
    let mut longest = job("report", "acme", json!({"n": 4}));
    longest["delay_ms"] = json!(OVER_CAP_MS - 1);
    let r = api.enqueue(&longest).await;
    let longest_id = r.expect(201)["id"].clone();
    assert_eq!(api.job(&longest_id).await["state"], "scheduled");

    // Nothing of the refused jobs was written: only the good one runs.
    let leased = leasable(&api).await;
    assert_eq!(leased.len(), 1, "{leased:?}");
    assert_eq!(leased[0]["id"], good_id);
    assert_eq!(leased[0]["payload"], json!({"n": 3}));
    let stats = api.get("/v1/stats").await;
    stats.expect(200);
}

#[tokio::test]
async fn a_huge_retry_after_is_refused_and_the_job_stays_leased() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    let token = leased["lease_token"].clone();
    let before = api.job(&id).await;

    for ms in [HUGE_MS, OVER_CAP_MS] {
        let r = api
            .fail(
                &id,
                &token,
                json!({"class": "deferred", "kind": "http_429", "message": "slow down",
                       "retry_after_ms": ms}),
            )
            .await;
        assert_duration_refused(&r, "retry_after_ms");
    }
    // The batch form refuses the item the same way.
    let r = api
        .post(
            "/v1/fails",
            &json!({"items": [{"id": id_text(&id), "lease_token": token,
                     "error": {"class": "deferred", "kind": "http_429", "retry_after_ms": HUGE_MS}}]}),
        )
        .await;
    let results = r.expect(200)["results"].clone();
    assert_eq!(results[0]["error"]["code"], "BAD_REQUEST", "{results}");

    // Unchanged: still leased by the same token, still readable.
    let after = api.job(&id).await;
    assert_eq!(after["state"], "leased", "{after}");
    assert_eq!(after["lease_expires_at"], before["lease_expires_at"]);
    assert_eq!(after["deferrals"], before["deferrals"]);
    assert_eq!(after["history"], before["history"]);
    // And the holder can still finish it.
    api.ack(&id, &token).await.expect(200);
    assert_eq!(api.job(&id).await["state"], "succeeded");
}

#[tokio::test]
async fn a_huge_extend_is_refused_and_the_lease_is_unchanged() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    let token = leased["lease_token"].clone();
    let before = api.job(&id).await;

    for ms in [HUGE_MS, u64::MAX] {
        let r = api.heartbeat(&id, &token, ms).await;
        let e = assert_error(&r, 400, "BAD_REQUEST", None);
        assert!(
            e["message"].as_str().unwrap_or("").contains("extend_ms"),
            "{e}"
        );
    }
    let after = api.job(&id).await;
    assert_eq!(after["state"], "leased", "{after}");
    assert_eq!(after["lease_expires_at"], before["lease_expires_at"]);
    api.heartbeat(&id, &token, 1000).await.expect(200);
    api.ack(&id, &token).await.expect(200);
}

#[tokio::test]
async fn a_huge_lease_is_refused_and_leases_nothing() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let r = api.post("/v1/leases", &lease_req("w", 1, HUGE_MS)).await;
    let e = assert_error(&r, 400, "BAD_REQUEST", None);
    assert!(
        e["message"].as_str().unwrap_or("").contains("lease_ms"),
        "{e}"
    );
    assert_eq!(api.job(&id).await["state"], "queued");
    let leased = leasable(&api).await;
    assert_eq!(leased.len(), 1, "{leased:?}");
}

#[tokio::test]
async fn a_bad_query_string_is_bad_request_in_the_envelope() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    for path in [
        "/v1/dead-letters?limit=abc",
        "/v1/audit?limit=abc",
        "/v1/dead-letters?limit=-1",
    ] {
        let r = api.get(path).await;
        let e = assert_error(&r, 400, "BAD_REQUEST", None);
        assert!(
            e["message"].as_str().unwrap_or("").contains("limit"),
            "{path}: {e}"
        );
    }
}

#[tokio::test]
async fn a_wrong_method_is_405_in_the_envelope_naming_the_allowed_ones() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    for (method, path, allowed) in [
        ("GET", "/v1/leases", "POST"),
        ("GET", "/v1/jobs/1/ack", "POST"),
        ("DELETE", "/v1/jobs/1", "GET"),
        ("POST", "/v1/stats", "GET"),
    ] {
        let r = match method {
            "GET" => api.get(path).await,
            "DELETE" => api.delete(path).await,
            _ => api.post(path, &json!({})).await,
        };
        let e = assert_error(&r, 405, "BAD_REQUEST", None);
        let message = e["message"].as_str().unwrap_or("");
        assert!(
            message.contains(allowed) && message.contains(method),
            "{method} {path}: {e}"
        );
        let allow = r
            .headers
            .get("allow")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        assert!(allow.contains(allowed), "{method} {path}: Allow {allow:?}");
    }
}

#[tokio::test]
async fn bad_percent_encoding_in_a_path_is_bad_request_in_the_envelope() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    for path in [
        "/v1/jobs/%ZZ",
        "/v1/jobs/%FF",
        "/v1/jobs/1%",
        "/v1/dead-letters/%C3%28",
    ] {
        let r = api.get(path).await;
        assert_error(&r, 400, "BAD_REQUEST", None);
    }
    let r = api.delete("/v1/tokens/%FF").await;
    assert_error(&r, 400, "BAD_REQUEST", None);
    // A well-encoded id that names nothing is still NOT_FOUND.
    let r = api.get("/v1/jobs/%31%32%33%34%35%36%37%38%39").await;
    assert_error(&r, 404, "NOT_FOUND", None);
}

#[tokio::test]
async fn a_body_that_is_not_an_object_is_bad_request_in_the_envelope() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let fail = format!("/v1/jobs/{}/fail", id_text(&id));
    let heartbeat = format!("/v1/jobs/{}/heartbeat", id_text(&id));
    for path in [
        "/v1/jobs",
        "/v1/jobs/batch",
        "/v1/leases",
        "/v1/acks",
        "/v1/fails",
        "/v1/outcomes",
        "/v1/pause",
        "/v1/dead-letters/redrive",
        fail.as_str(),
        heartbeat.as_str(),
    ] {
        for body in ["[1]", "\"x\"", "null", "123", "true"] {
            let r = api.post_raw(path, body).await;
            let e = assert_error(&r, 400, "BAD_REQUEST", None);
            assert!(
                e["message"].as_str().unwrap_or("").contains("JSON object"),
                "POST {path} {body}: {e}"
            );
        }
    }
    // The job is untouched and still leasable.
    assert_eq!(api.job(&id).await["state"], "queued");
    assert_eq!(leasable(&api).await.len(), 1);
}
