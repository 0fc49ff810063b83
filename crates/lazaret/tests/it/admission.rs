//! Admission: poison is stopped at the door, kept as an admission dead letter, and never leased.

use serde_json::{Value, json};

use crate::harness::{QUICK, Server, assert_error, job, lease_req, send_streamed, sha256_hex};

/// The byte cap these tests run with: small, so "far over it" is cheap.
const CAP: usize = 8192;

const V1: &str = r#"{
  "type": "object",
  "required": ["to"],
  "properties": {"to": {"type": "string"}}
}"#;

const V2: &str = r#"{
  "type": "object",
  "required": ["to", "subject"],
  "properties": {"to": {"type": "string"}, "subject": {"type": "string"}}
}"#;

async fn start() -> Server {
    let config = format!(
        "payload_bytes_max = {CAP}\n{QUICK}\n[types.email]\nschemas = {{ 1 = \"v1.json\", 2 = \"v2.json\" }}\n"
    );
    Server::start_with(&config, &[("v1.json", V1), ("v2.json", V2)]).await
}

/// Asserts that no worker can lease anything now.
async fn nothing_to_lease(server: &Server) {
    let mut req = lease_req("w-nothing", 100, 30_000);
    req["wait_ms"] = json!(200);
    let jobs = server.api().lease(&req).await;
    assert!(
        jobs.is_empty(),
        "a refused job must never be leased: {jobs:?}"
    );
}

/// The admission dead letters with `reason`.
async fn admission_records(server: &Server, reason: &str) -> Vec<Value> {
    let items = server
        .api()
        .dead_letters(&format!("reason={reason}&limit=100"))
        .await;
    for item in &items {
        assert_eq!(item["stage"], "admission", "{item}");
        assert_eq!(item["reason"], reason, "{item}");
    }
    items
}

#[tokio::test]
async fn schema_v1_and_v2_are_both_accepted_and_an_unknown_field_is_tolerated() {
    let server = start().await;
    let api = server.api();

    let mut v1 = job("email", "acme", json!({"to": "a@example.com"}));
    v1["schema_version"] = json!(1);
    let v1 = api.enqueue_ok(&v1).await;

    let mut v2 = job(
        "email",
        "acme",
        json!({"to": "b@example.com", "subject": "hi", "cc": ["someone"]}),
    );
    v2["schema_version"] = json!(2);
    let v2 = api.enqueue_ok(&v2).await;

    // No version means the latest, 2.
    let latest = api
        .enqueue_ok(&job(
            "email",
            "acme",
            json!({"to": "c@example.com", "subject": "yo"}),
        ))
        .await;

    let mut req = lease_req("w", 10, 30_000);
    req["wait_ms"] = json!(1000);
    let mut seen = Vec::new();
    while seen.len() < 3 {
        seen.extend(api.lease_eventually(&req).await);
    }
    let version_of = |id: &Value| {
        seen.iter()
            .find(|j| j["id"] == *id)
            .unwrap_or_else(|| panic!("job {id} leased: {seen:?}"))["schema_version"]
            .clone()
    };
    assert_eq!(version_of(&v1), 1);
    assert_eq!(version_of(&v2), 2);
    assert_eq!(version_of(&latest), 2);
}

#[tokio::test]
async fn a_missing_required_field_is_poison_schema_invalid_with_details() {
    let server = start().await;
    let api = server.api();

    let mut bad = job("email", "acme", json!({"to": "a@example.com"}));
    bad["schema_version"] = json!(2);
    let r = api.enqueue(&bad).await;
    let error = assert_error(&r, 422, "POISON", Some("schema_invalid"));
    let details = &error["details"];
    assert!(
        !details.is_null() && details != &json!([]) && details != &json!({}),
        "schema_invalid comes with details: {error}"
    );
    assert!(
        details.to_string().contains("subject"),
        "the details name the missing field: {details}"
    );

    // Absent version → latest (2) → the same violation.
    let r = api
        .enqueue(&job("email", "acme", json!({"to": "a@example.com"})))
        .await;
    assert_error(&r, 422, "POISON", Some("schema_invalid"));

    nothing_to_lease(&server).await;
    let records = admission_records(&server, "schema_invalid").await;
    assert_eq!(records.len(), 2, "{records:?}");
    assert_eq!(records[0]["type"], "email");
    assert_eq!(records[0]["tenant"], "acme");
}

#[tokio::test]
async fn an_unknown_schema_version_is_poison() {
    let server = start().await;
    let mut bad = job(
        "email",
        "acme",
        json!({"to": "a@example.com", "subject": "s"}),
    );
    bad["schema_version"] = json!(7);
    let r = server.api().enqueue(&bad).await;
    assert_error(&r, 422, "POISON", Some("unknown_schema_version"));
    nothing_to_lease(&server).await;
    assert_eq!(
        admission_records(&server, "unknown_schema_version")
            .await
            .len(),
        1
    );
}

#[tokio::test]
async fn a_payload_that_is_not_json_is_poison_invalid_json() {
    let server = start().await;
    // The envelope is fine; the payload's own text is not JSON (a trailing comma).
    let body = r#"{"type": "email", "tenant": "acme", "payload": {"to": "a@example.com", "subject": "s",}}"#;
    let r = server.api().post_raw("/v1/jobs", body).await;
    assert_error(&r, 422, "POISON", Some("invalid_json"));
    nothing_to_lease(&server).await;
    let records = admission_records(&server, "invalid_json").await;
    assert_eq!(records.len(), 1, "{records:?}");
    // A body that does not parse may not let the tenant be read: null then.
    let tenant = &records[0]["tenant"];
    assert!(tenant == "acme" || tenant.is_null(), "{}", records[0]);
}

#[tokio::test]
async fn an_oversized_payload_is_poison_and_never_reaches_a_worker() {
    let server = start().await;
    let api = server.api();

    // Over the payload cap, but within cap + 16 KiB: the body is read whole.
    let payload = format!(
        r#"{{"to": "a@example.com", "subject": "s", "blob": "{}"}}"#,
        "x".repeat(CAP + 2000)
    );
    let body = format!(r#"{{"type": "email", "tenant": "acme", "payload": {payload}}}"#);
    let r = api.post_raw("/v1/jobs", body).await;
    assert_error(&r, 413, "POISON", Some("payload_too_large"));

    nothing_to_lease(&server).await;
    let records = admission_records(&server, "payload_too_large").await;
    assert_eq!(records.len(), 1, "{records:?}");
    let record = &records[0];
    assert_eq!(record["type"], "email");
    assert_eq!(record["tenant"], "acme");
    assert!(
        record["payload_size"].as_u64().unwrap_or(0) > CAP as u64,
        "{record}"
    );
    // Read whole, so its hash is known — the hash of the payload's own bytes.
    assert_eq!(
        record["payload_sha256"],
        sha256_hex(payload.as_bytes()),
        "{record}"
    );
    let preview = record["payload_preview"]
        .as_str()
        .unwrap_or_else(|| panic!("a preview of the payload: {record}"));
    assert!(
        !preview.is_empty() && preview.len() <= 4096,
        "{}",
        preview.len()
    );
    assert!(
        payload.starts_with(preview),
        "the preview is the payload's first bytes"
    );

    // The record is also found by its id.
    let id = crate::harness::id_text(&record["id"]);
    let again = api.get(&format!("/v1/dead-letters/{id}")).await;
    assert_eq!(again.expect(200)["reason"], "payload_too_large");
}

#[tokio::test]
async fn a_body_far_over_the_cap_is_refused_before_it_is_read_whole() {
    let server = start().await;
    let announced: usize = 50 * 1024 * 1024;
    let head = format!(
        "POST /v1/jobs HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {announced}\r\nConnection: close",
        server.base().trim_start_matches("http://")
    );
    let prefix = r#"{"type": "email", "tenant": "acme", "payload": {"blob": ""#;
    let reply = send_streamed(server.base(), &head, prefix, announced, false).await;
    assert_eq!(reply.status, 413, "{}", reply.text);
    assert_eq!(reply.body["error"]["code"], "POISON", "{}", reply.text);
    assert_eq!(
        reply.body["error"]["reason"], "payload_too_large",
        "{}",
        reply.text
    );

    // The server is still serving, and nothing got through.
    nothing_to_lease(&server).await;
    let records = admission_records(&server, "payload_too_large").await;
    assert_eq!(records.len(), 1, "{records:?}");
    let record = &records[0];
    assert!(
        record["payload_sha256"].is_null(),
        "not read whole, so no hash: {record}"
    );
    assert_eq!(
        record["payload_size"],
        json!(announced),
        "the announced size: {record}"
    );
    let preview = &record["payload_preview"];
    assert!(
        record.as_object().unwrap().contains_key("payload_preview"),
        "{record}"
    );
    if let Some(p) = preview.as_str() {
        assert!(
            p.len() <= 4096,
            "a preview is at most 4 KiB, got {}",
            p.len()
        );
    }
}

#[tokio::test]
async fn a_chunked_body_over_the_cap_is_refused_as_it_streams() {
    let server = start().await;
    let total: usize = 6 * 1024 * 1024;
    let head = format!(
        "POST /v1/jobs HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close",
        server.base().trim_start_matches("http://")
    );
    let prefix = r#"{"type": "email", "tenant": "acme", "payload": {"blob": ""#;
    let reply = send_streamed(server.base(), &head, prefix, total, true).await;
    assert_eq!(reply.status, 413, "{}", reply.text);
    assert_eq!(reply.body["error"]["code"], "POISON", "{}", reply.text);
    assert_eq!(
        reply.body["error"]["reason"], "payload_too_large",
        "{}",
        reply.text
    );

    nothing_to_lease(&server).await;
    let records = admission_records(&server, "payload_too_large").await;
    assert_eq!(records.len(), 1, "{records:?}");
    let record = &records[0];
    assert!(
        record["payload_sha256"].is_null(),
        "not read whole: {record}"
    );
    let size = record["payload_size"].as_u64().unwrap_or(0);
    assert!(
        size > CAP as u64 && size <= total as u64,
        "the bytes read, past the cap: {record}"
    );
}

#[tokio::test]
async fn a_batch_over_batch_bytes_max_is_refused_whole_and_one_under_it_is_taken() {
    let config = format!("batch_bytes_max = 65536\n{QUICK}");
    let server = Server::start(&config).await;
    let api = server.api();
    let blob = "y".repeat(7000);
    let jobs: Vec<Value> = (0..10)
        .map(|n| job("report", "acme", json!({"n": n, "blob": blob})))
        .collect();

    let r = api.post("/v1/jobs/batch", &json!({"jobs": jobs})).await;
    assert_error(&r, 413, "POISON", Some("payload_too_large"));
    nothing_to_lease(&server).await;

    let r = api
        .post("/v1/jobs/batch", &json!({"jobs": jobs[..5].to_vec()}))
        .await;
    let body = r.expect(200);
    assert_eq!(body["results"].as_array().map(Vec::len), Some(5), "{body}");
}

/// A batch of several hundred jobs is applied in chunks (one store command
/// each), yet answers as one list: every job's result in its own place, a
/// poison job's error where it was, a key repeated across chunks a
/// duplicate of the first, and every admitted job leasable once.
#[tokio::test]
async fn a_large_batch_answers_every_job_in_place_across_chunks() {
    let server = start().await;
    let api = server.api();
    let mut jobs: Vec<Value> = (0..250)
        .map(|n| job("report", "acme", json!({"n": n})))
        .collect();
    jobs[3]["idempotency_key"] = json!("same");
    jobs[230]["idempotency_key"] = json!("same");
    jobs[120] = job("email", "acme", json!({"not_to": 1}));
    jobs[120]["schema_version"] = json!(1);

    let r = api.post("/v1/jobs/batch", &json!({"jobs": jobs})).await;
    let body = r.expect(200);
    let results = body["results"].as_array().expect("results");
    assert_eq!(results.len(), 250, "{body}");
    assert_eq!(results[120]["error"]["code"], "POISON", "{}", results[120]);
    assert_eq!(results[230]["admission"], "DUPLICATE", "{}", results[230]);
    assert_eq!(results[230]["id"], results[3]["id"]);
    let mut created: Vec<String> = Vec::new();
    for (n, r) in results.iter().enumerate() {
        if n == 120 || n == 230 {
            continue;
        }
        assert_eq!(r["state"], "queued", "job {n}: {r}");
        created.push(r["id"].to_string());
    }
    let distinct: std::collections::HashSet<_> = created.iter().collect();
    assert_eq!(
        distinct.len(),
        248,
        "every admitted job has an id of its own"
    );

    let mut leased: Vec<String> = Vec::new();
    loop {
        let got = api.lease(&lease_req("w-batch", 100, 30_000)).await;
        if got.is_empty() {
            break;
        }
        leased.extend(got.iter().map(|j| j["id"].to_string()));
    }
    leased.sort();
    created.sort();
    assert_eq!(leased, created, "every admitted job is leased once");
}
