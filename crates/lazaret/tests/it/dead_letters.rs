//! Dead letters: grouped by reason, payloads kept byte for byte, and redriven back into line.

use serde_json::{Value, json};

use crate::harness::{Api, QUICK, Server, at, id_text, job, lease_req, sha256_hex};

async fn start() -> Server {
    let config = format!("{QUICK}\n[types.flaky]\nkinds = {{ parse = 1 }}\n");
    Server::start(&config).await
}

/// Enqueues a job, leases it and fails it with `error`; returns its id.
async fn dead_letter(api: &Api, j: &Value, error: Value) -> Value {
    let id = api.enqueue_ok(j).await;
    let mut req = lease_req("w-dl", 1, 30_000);
    req["types"] = json!([j["type"]]);
    let leased = api.lease_one(&req).await;
    assert_eq!(leased["id"], id, "the job just enqueued");
    let r = api.fail(&id, &leased["lease_token"], error).await;
    assert_eq!(r.expect(200)["state"], "dead_lettered");
    id
}

fn permanent() -> Value {
    json!({"class": "permanent", "kind": "bad_input", "message": "cannot"})
}

#[tokio::test]
async fn reasons_count_the_dead_letters_held_by_reason_and_type() {
    let server = start().await;
    let api = server.api();
    dead_letter(&api, &job("report", "acme", json!({"n": 1})), permanent()).await;
    dead_letter(&api, &job("report", "globex", json!({"n": 2})), permanent()).await;
    dead_letter(
        &api,
        &job("flaky", "acme", json!({"n": 3})),
        json!({"kind": "parse", "message": "bad"}),
    )
    .await;

    let r = api.get("/v1/dead-letters/reasons").await;
    let body = r.expect(200);
    let reasons = body["reasons"].as_array().expect("a reasons list");
    let find = |reason: &str, ty: &str| {
        reasons
            .iter()
            .find(|r| r["reason"] == reason && r["type"] == ty)
            .unwrap_or_else(|| panic!("no ({reason}, {ty}) in {body}"))
            .clone()
    };
    let permanent = find("permanent", "report");
    assert_eq!(permanent["count"], 2);
    assert!(at(&permanent["first_at"]) <= at(&permanent["last_at"]));
    assert_eq!(find("kind_exhausted", "flaky")["count"], 1);
    assert_eq!(reasons.len(), 2, "only reasons held now: {body}");
}

/// Odd spacing, key order, a trailing zero and an escape: none of it may be normalised.
const ODD_PAYLOAD: &str = "{ \"zeta\" :1,\n  \"alpha\":[ 1 ,2.50 ],\"u\":\"\\u00e9t\u{e9}\"   }";

#[tokio::test]
async fn a_dead_letter_keeps_the_payload_byte_for_byte() {
    let server = start().await;
    let api = server.api();
    let payload = ODD_PAYLOAD;
    let body = format!(r#"{{"type": "report", "tenant": "acme", "payload": {payload}}}"#);
    let id = api.post_raw("/v1/jobs", body).await.expect(201)["id"].clone();
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    api.fail(&id, &leased["lease_token"], permanent())
        .await
        .expect(200);

    let dead = api.dead_letter_of(&id).await;
    assert_eq!(dead["payload_size"], payload.len());
    assert_eq!(dead["payload_sha256"], sha256_hex(payload.as_bytes()));
    let r = api
        .get(&format!(
            "/v1/dead-letters/{}/payload",
            id_text(&dead["id"])
        ))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(
        r.bytes,
        payload.as_bytes(),
        "the original bytes, byte for byte"
    );
}

#[tokio::test]
async fn workers_see_the_payload_byte_for_byte() {
    let server = start().await;
    let api = server.api();
    let payload = ODD_PAYLOAD;
    let body = format!(r#"{{"type": "report", "tenant": "acme", "payload": {payload}}}"#);
    api.post_raw("/v1/jobs", body).await.expect(201);

    let r = api.post("/v1/leases", &lease_req("w", 1, 30_000)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(
        r.text().contains(payload),
        "the lease reply embeds the payload's raw text {payload:?}, got: {}",
        r.text()
    );
}

#[tokio::test]
async fn redrive_by_reason_runs_the_job_again_with_its_id_key_and_a_fresh_budget() {
    let server = start().await;
    let api = server.api();
    let mut j = job("report", "acme", json!({"invoice": 9}));
    j["idempotency_key"] = json!("inv-9");
    let id = dead_letter(&api, &j, permanent()).await;
    let other = dead_letter(
        &api,
        &job("flaky", "acme", json!({})),
        json!({"kind": "parse", "message": "bad"}),
    )
    .await;

    // A dry run says what would move and moves nothing.
    let filter = json!({"reason": "permanent"});
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": filter, "dry_run": true}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["matched"], 1, "{body}");
    assert_eq!(body["redriven"], 0, "{body}");
    assert_eq!(api.job(&id).await["state"], "dead_lettered");
    assert_eq!(api.dead_letters("reason=permanent").await.len(), 1);

    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": filter, "dry_run": false}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["matched"], 1, "{body}");
    assert_eq!(body["redriven"], 1, "{body}");
    assert_eq!(body["job_ids"], json!([id]), "{body}");

    // Moved, not copied; the other reason is untouched.
    assert!(api.dead_letters("reason=permanent").await.is_empty());
    assert_eq!(api.dead_letter_of(&other).await["reason"], "kind_exhausted");

    // Same id, same key, attempt 1 again, and this time it succeeds.
    let leased = api.lease_one(&lease_req("w-2", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
    assert_eq!(leased["idempotency_key"], "inv-9");
    assert_eq!(leased["attempt"], 1, "a fresh budget");
    assert_eq!(
        api.ack(&id, &leased["lease_token"]).await.expect(200)["state"],
        "succeeded"
    );
    let got = api.job(&id).await;
    assert_eq!(got["state"], "succeeded");
    assert!(
        got["history"].as_array().map_or(0, Vec::len) >= 2,
        "the history of the first run is kept: {got}"
    );

    // The key still names this job.
    let r = api.enqueue(&j).await;
    let body = r.expect(200);
    assert_eq!(body["admission"], "DUPLICATE");
    assert_eq!(body["id"], id);
}

#[tokio::test]
async fn redrive_by_ids_moves_only_those() {
    let server = start().await;
    let api = server.api();
    let a = dead_letter(&api, &job("report", "acme", json!({"n": 1})), permanent()).await;
    let b = dead_letter(&api, &job("report", "acme", json!({"n": 2})), permanent()).await;
    let a_dead = api.dead_letter_of(&a).await["id"].clone();

    let r = api
        .post("/v1/dead-letters/redrive", &json!({"ids": [a_dead]}))
        .await;
    let body = r.expect(200);
    assert_eq!(body["redriven"], 1, "{body}");
    assert_eq!(body["job_ids"], json!([a]));
    assert_eq!(api.job(&b).await["state"], "dead_lettered");
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], a);
}

#[tokio::test]
async fn admission_records_cannot_be_redriven() {
    let server = start().await;
    let api = server.api();
    let r = api
        .post_raw(
            "/v1/jobs",
            r#"{"type": "report", "tenant": "acme", "payload": {"a": }}"#,
        )
        .await;
    assert_eq!(r.status, 422, "{}", r.text());
    let records = api.dead_letters("reason=invalid_json").await;
    assert_eq!(records.len(), 1, "{records:?}");

    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"reason": "invalid_json"}}),
        )
        .await;
    // Refused outright or matched-and-skipped; either way nothing moves.
    if r.status == 200 {
        assert_eq!(r.body["redriven"], 0, "{}", r.text());
    } else {
        assert!(r.body["error"]["code"].is_string(), "{}", r.text());
    }
    let mut req = lease_req("w", 10, 30_000);
    req["wait_ms"] = json!(200);
    assert!(api.lease(&req).await.is_empty());
    assert_eq!(api.dead_letters("reason=invalid_json").await.len(), 1);
}

#[tokio::test]
async fn dead_letters_are_listed_by_filter_a_page_at_a_time() {
    let server = start().await;
    let api = server.api();
    let mut mine = Vec::new();
    for n in 0..3 {
        mine.push(dead_letter(&api, &job("report", "acme", json!({"n": n})), permanent()).await);
    }
    dead_letter(&api, &job("report", "globex", json!({})), permanent()).await;
    dead_letter(
        &api,
        &job("flaky", "acme", json!({})),
        json!({"kind": "parse"}),
    )
    .await;

    let mut seen = Vec::new();
    let mut query = "type=report&tenant=acme&lane=default&reason=permanent&limit=1".to_owned();
    for _ in 0..10 {
        let r = api.get(&format!("/v1/dead-letters?{query}")).await;
        let body = r.expect(200).clone();
        let items = body["items"].as_array().expect("items");
        assert!(items.len() <= 1, "limit=1: {body}");
        for item in items {
            assert_eq!(item["tenant"], "acme");
            assert_eq!(item["type"], "report");
            seen.push(item["job_id"].clone());
        }
        match body["next_cursor"].as_str() {
            Some(cursor) => {
                query = format!(
                    "type=report&tenant=acme&lane=default&reason=permanent&limit=1&cursor={cursor}"
                )
            }
            None => {
                assert!(body["next_cursor"].is_null(), "{body}");
                break;
            }
        }
    }
    seen.sort_by_key(id_text);
    mine.sort_by_key(id_text);
    assert_eq!(seen, mine, "every page once, no more");
}

#[tokio::test]
async fn admission_records_are_capped_per_tenant_and_minute() {
    let config = format!("admission_records_per_minute = 2\npayload_bytes_max = 64\n{QUICK}");
    let server = Server::start(&config).await;
    let api = server.api();
    let oversize =
        |tenant: &str| json!({"type": "t", "tenant": tenant, "payload": {"blob": "x".repeat(200)}});
    for _ in 0..5 {
        let r = api.enqueue(&oversize("junk")).await;
        crate::harness::assert_error(&r, 413, "POISON", Some("payload_too_large"));
    }
    api.enqueue(&oversize("other")).await;
    let records = api.dead_letters("").await;
    let by = |t: &str| {
        records
            .iter()
            .filter(|d| d["tenant"] == t && d["stage"] == "admission")
            .count()
    };
    assert_eq!(
        by("junk"),
        2,
        "at most admission_records_per_minute records per tenant: {records:?}"
    );
    assert_eq!(by("other"), 1, "another tenant has its own allowance");
    // Every refusal is still answered and counted, kept or not.
    let metrics = api.get("/metrics").await.text();
    assert!(
        metrics.contains("lazaret_admission_records_dropped_total 3"),
        "{metrics}"
    );
}

#[tokio::test]
async fn redrive_with_a_rate_moves_everything_in_paced_chunks() {
    let server = start().await;
    let api = server.api();
    for n in 0..3 {
        dead_letter(&api, &job("report", "acme", json!({"n": n})), permanent()).await;
    }
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"reason": "permanent"}, "rate_per_sec": 2}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["matched"], 3);
    assert_eq!(body["redriven"], 3);
    assert_eq!(body["job_ids"].as_array().unwrap().len(), 3);
    assert!(api.dead_letters("reason=permanent").await.is_empty());
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {}, "rate_per_sec": 0}),
        )
        .await;
    crate::harness::assert_error(&r, 400, "BAD_REQUEST", None);
}

/// Issue 11, item 4: a misspelt filter key once purged every dead letter.
/// Unknown keys are refused, and an empty filter needs an explicit `all`.
#[tokio::test]
async fn a_misspelt_or_empty_filter_never_purges_everything() {
    let server = start().await;
    let api = server.api();
    dead_letter(&api, &job("report", "acme", json!({"n": 1})), permanent()).await;
    dead_letter(&api, &job("report", "globex", json!({"n": 2})), permanent()).await;
    let held = || async { api.dead_letters("").await.len() };
    assert_eq!(held().await, 2);

    for body in [
        json!({"filter": {"tennant": "acme"}, "confirm": true}),
        json!({"filter": {}, "confirm": true}),
        json!({"filter": {"tenant": "acme"}, "confirm": true, "dryrun": true}),
    ] {
        let r = api.post("/v1/dead-letters/purge", &body).await;
        crate::harness::assert_error(&r, 400, "BAD_REQUEST", None);
        assert_eq!(held().await, 2, "{body} changed something");
    }
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"tennant": "acme"}}),
        )
        .await;
    crate::harness::assert_error(&r, 400, "BAD_REQUEST", None);
    assert_eq!(
        api.get("/v1/dead-letters?tennant=acme").await.status,
        400,
        "an unknown query parameter is refused"
    );

    let r = api
        .post(
            "/v1/dead-letters/purge",
            &json!({"filter": {}, "all": true, "confirm": true}),
        )
        .await;
    assert_eq!(r.expect(200)["purged"], 2);
    assert_eq!(held().await, 0);
}
