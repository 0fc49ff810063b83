//! Bounded sizes and small things (issue 11, items 6 and 10): client-chosen
//! names have length limits and no control characters on every endpoint
//! that takes them, metric label values stay bounded under thousands of
//! random types and lanes, the admission-record cap holds across tenants,
//! `payload: null` is a payload, `limit=0` is an error, and config tokens
//! that cannot work are refused at start.

use serde_json::{Value, json};

use crate::harness::{QUICK, Server, assert_error, id_text, job, lease_req, serve_refused};

/// One byte over the limit of types, tenants, lanes, worker ids and kinds.
fn over_name() -> String {
    "n".repeat(129)
}

/// Asserts a 400 `BAD_REQUEST` naming `field` and `limit`.
#[track_caller]
fn assert_bounded(e: &Value, field: &str, limit: &str) {
    let message = e["message"].as_str().unwrap_or("");
    assert_eq!(e["code"], "BAD_REQUEST", "{field}: {e}");
    assert!(message.contains(field), "names {field}: {e}");
    assert!(message.contains(limit), "names the limit {limit}: {e}");
}

#[tokio::test]
async fn long_or_control_character_names_are_refused_on_enqueue_and_in_a_batch() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let cases: Vec<(&str, String, &str)> = vec![
        ("type", over_name(), "128"),
        ("tenant", over_name(), "128"),
        ("lane", over_name(), "128"),
        ("idempotency_key", "k".repeat(257), "256"),
        ("type", "send\u{0}email".into(), "128"),
        ("tenant", "acme\nx-admin: yes".into(), "128"),
        ("lane", "batch\u{7f}".into(), "128"),
        ("idempotency_key", "order\t42".into(), "256"),
    ];
    for (field, value, limit) in &cases {
        let mut j = job("report", "acme", json!({"n": 1}));
        j[*field] = json!(value);
        let r = api.enqueue(&j).await;
        assert_eq!(r.status, 400, "{field} {value:?}: {}", r.text());
        assert_bounded(&r.body["error"], field, limit);
    }
    // The limits themselves pass.
    let mut at_limit = job(&"t".repeat(128), &"a".repeat(128), json!({"n": 2}));
    at_limit["lane"] = json!("l".repeat(128));
    at_limit["idempotency_key"] = json!("k".repeat(256));
    let kept = api.enqueue_ok(&at_limit).await;

    // In a batch each bad job is its own error; the good one is admitted.
    let mut jobs: Vec<Value> = cases
        .iter()
        .map(|(field, value, _)| {
            let mut j = job("report", "acme", json!({"n": 3}));
            j[*field] = json!(value);
            j
        })
        .collect();
    jobs.push(job("report", "acme", json!({"n": 4})));
    let r = api.post("/v1/jobs/batch", &json!({ "jobs": jobs })).await;
    let results = r.expect(200)["results"].as_array().unwrap().clone();
    for (i, (field, _, limit)) in cases.iter().enumerate() {
        assert_bounded(&results[i]["error"], field, limit);
    }
    let good = results[cases.len()]["id"].clone();
    assert_eq!(results[cases.len()]["state"], "queued", "{results:?}");

    // Nothing of the refused jobs was written.
    let leased = api.lease(&lease_req("w", 100, 30_000)).await;
    let mut ids: Vec<String> = leased.iter().map(|j| id_text(&j["id"])).collect();
    ids.sort();
    let mut want = vec![id_text(&kept), id_text(&good)];
    want.sort();
    assert_eq!(ids, want, "{leased:?}");
}

#[tokio::test]
async fn long_or_control_character_names_are_refused_on_lease_fail_and_pause() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;

    // Lease: worker_id, lanes, types. (The adversarial pass sent a 1 MB
    // worker_id; a lease body over 64 KiB is now refused whole, 413, see
    // hostile_suite.rs, so the field's own limit is shown under that cap.)
    for (body, field) in [
        (
            json!({"worker_id": "w".repeat(60_000), "max_jobs": 1}),
            "worker_id",
        ),
        (json!({"worker_id": "w\r\n1", "max_jobs": 1}), "worker_id"),
        (json!({"lanes": [over_name()], "max_jobs": 1}), "lanes"),
        (json!({"types": ["ok", "a\u{0}b"], "max_jobs": 1}), "types"),
    ] {
        let r = api.post("/v1/leases", &body).await;
        assert_eq!(r.status, 400, "{field}: {}", r.text());
        assert_bounded(&r.body["error"], field, "128");
    }
    assert_eq!(api.job(&id).await["state"], "queued", "nothing leased");

    let leased = api.lease_one(&lease_req("w-1", 1, 30_000)).await;
    let token = leased["lease_token"].clone();
    let before = api.job(&id).await;
    for kind in [over_name(), "http\n503".to_owned()] {
        let r = api
            .fail(&id, &token, json!({"class": "transient", "kind": kind}))
            .await;
        assert_eq!(r.status, 400, "{}", r.text());
        assert_bounded(&r.body["error"], "error.kind", "128");
        let r = api
            .post(
                "/v1/fails",
                &json!({"items": [{"id": id_text(&id), "lease_token": token,
                         "error": {"kind": kind}}]}),
            )
            .await;
        assert_bounded(&r.expect(200)["results"][0]["error"], "error.kind", "128");
    }
    let after = api.job(&id).await;
    assert_eq!(after["state"], "leased", "{after}");
    assert_eq!(after["history"], before["history"]);
    api.ack(&id, &token).await.expect(200);

    for (body, field) in [
        (json!({"type": over_name()}), "type"),
        (json!({"lane": "a\u{1b}[31m"}), "lane"),
    ] {
        let r = api.post("/v1/pause", &body).await;
        assert_eq!(r.status, 400, "{}", r.text());
        assert_bounded(&r.body["error"], field, "128");
    }
    let audit = api.get("/v1/audit").await;
    assert!(
        audit.expect(200)["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["action"] != "pause"),
        "a refused pause is not applied or audited: {}",
        audit.text()
    );
}

/// The series of `family` in a `/metrics` text: (labels, value).
fn series(metrics: &str, family: &str) -> Vec<(String, f64)> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix(family))
        .filter(|rest| rest.starts_with('{'))
        .filter_map(|rest| {
            let (labels, value) = rest.rsplit_once(' ')?;
            Some((labels.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[tokio::test]
async fn five_thousand_random_types_and_lanes_make_a_bounded_number_of_series() {
    let config = format!("{QUICK}\n[types.report]\nattempts_max = 3\n");
    let server = Server::start(&config).await;
    let api = server.api();
    api.enqueue_ok(&job("report", "acme", json!({}))).await;
    let jobs: Vec<Value> = (0..5000)
        .map(|i| json!({"type": format!("ty-{i}"), "tenant": "acme", "lane": format!("ln-{i}"), "payload": {}}))
        .collect();
    let r = api.post("/v1/jobs/batch", &json!({ "jobs": jobs })).await;
    let results = r.expect(200)["results"].as_array().unwrap().clone();
    assert!(results.iter().all(|r| r["state"] == "queued"));

    let metrics = api.get("/metrics").await.text();
    let enqueued = series(&metrics, "lazaret_jobs_enqueued_total");
    // report + 64 unconfigured types + other, times the lanes they came in.
    assert!(
        enqueued.len() <= 2 * (64 + 2),
        "{} series of lazaret_jobs_enqueued_total",
        enqueued.len()
    );
    let total: f64 = enqueued.iter().map(|(_, v)| v).sum();
    assert_eq!(
        total, 5001.0,
        "every enqueue is counted, past the bound under other"
    );
    assert!(
        enqueued
            .iter()
            .any(|(l, _)| l.contains("type=\"other\"") && l.contains("lane=\"other\"")),
        "{enqueued:?}"
    );
    assert!(
        enqueued
            .iter()
            .any(|(l, _)| l.contains("type=\"report\"") && l.contains("lane=\"default\"")),
        "configured types and the default lane keep their series: {enqueued:?}"
    );
    let depth = series(&metrics, "lazaret_queue_depth");
    // default, interactive, batch (configured), 64 others, other.
    assert!(depth.len() <= 3 + 64 + 1, "{} lane series", depth.len());
    let queued: f64 = depth.iter().map(|(_, v)| v).sum();
    assert_eq!(queued, 5001.0, "{depth:?}");
}

#[tokio::test]
async fn the_admission_record_cap_holds_across_tenants() {
    let config = format!(
        "admission_records_per_minute = 2\nadmission_records_all_per_minute = 50\npayload_bytes_max = 64\n{QUICK}"
    );
    let server = Server::start(&config).await;
    let api = server.api();
    let jobs: Vec<Value> = (0..5000)
        .map(|i| json!({"type": "t", "tenant": format!("tenant-{i}"), "payload": {"blob": "x".repeat(100)}}))
        .collect();
    let r = api.post("/v1/jobs/batch", &json!({ "jobs": jobs })).await;
    let results = r.expect(200)["results"].as_array().unwrap().clone();
    assert!(
        results
            .iter()
            .all(|r| r["error"]["reason"] == "payload_too_large"),
        "every job is refused as poison"
    );
    let mut records = 0;
    let mut cursor: Option<String> = None;
    loop {
        let q = match &cursor {
            Some(c) => format!("/v1/dead-letters?stage=admission&limit=1000&cursor={c}"),
            None => "/v1/dead-letters?stage=admission&limit=1000".into(),
        };
        let page = api.get(&q).await.expect(200).clone();
        records += page["items"].as_array().unwrap().len();
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    // 50 a minute over all tenants; a batch that straddles a minute's turn
    // may use two minutes' allowance, never more.
    assert!((50..=100).contains(&records), "{records} admission records");
    let metrics = api.get("/metrics").await.text();
    let dropped_total: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("lazaret_admission_records_dropped_total "))
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1.0);
    assert_eq!(
        dropped_total as usize,
        5000 - records,
        "the rest are counted"
    );
}

#[tokio::test]
async fn a_null_payload_is_a_payload() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api
        .enqueue_ok(&json!({"type": "report", "tenant": "acme", "payload": null}))
        .await;
    let view = api.job(&id).await;
    assert!(view.get("payload").is_some_and(Value::is_null), "{view}");
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
    assert!(
        leased.get("payload").is_some_and(Value::is_null),
        "{leased}"
    );
    // A missing payload is still refused.
    let r = api
        .enqueue(&json!({"type": "report", "tenant": "acme"}))
        .await;
    let e = assert_error(&r, 400, "BAD_REQUEST", None);
    assert!(
        e["message"].as_str().unwrap_or("").contains("payload"),
        "{e}"
    );
}

#[tokio::test]
async fn limit_zero_is_an_error_on_every_list() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    for path in ["/v1/dead-letters?limit=0", "/v1/audit?limit=0"] {
        let r = api.get(path).await;
        let e = assert_error(&r, 400, "BAD_REQUEST", None);
        assert!(
            e["message"].as_str().unwrap_or("").contains("limit"),
            "{path}: {e}"
        );
    }
    for path in ["/v1/dead-letters?limit=1", "/v1/audit?limit=1"] {
        api.get(path).await.expect(200);
    }
}

#[tokio::test]
async fn long_or_control_character_token_names_are_refused_through_the_api() {
    const ADMIN: &str = "tok-admin-fields-0123456789";
    let server = Server::start(&format!(
        "{QUICK}\n[[tokens]]\nname = \"root\"\nrole = \"admin\"\ntoken = \"{ADMIN}\"\n"
    ))
    .await;
    let admin = server.api_as(ADMIN);
    for name in ["t".repeat(65), "ci\u{0}bot".into(), "ci\nbot".into()] {
        let r = admin
            .post("/v1/tokens", &json!({"name": name, "role": "producer"}))
            .await;
        let e = assert_error(&r, 400, "BAD_REQUEST", None);
        assert!(e["message"].as_str().unwrap_or("").contains("64"), "{e}");
    }
    admin
        .post(
            "/v1/tokens",
            &json!({"name": "t".repeat(64), "role": "producer"}),
        )
        .await
        .expect(201);
}

#[tokio::test]
async fn config_tokens_that_cannot_work_are_refused_at_start() {
    for (name, token, key, says) in [
        ("ops", "   ", "tokens[0].token", "whitespace"),
        ("ops", "\t\n", "tokens[0].token", "whitespace"),
        (".", "a-long-secret-1", "tokens[0].name", "path segment"),
        ("..", "a-long-secret-1", "tokens[0].name", "path segment"),
        (
            "ops\u{1b}",
            "a-long-secret-1",
            "tokens[0].name",
            "control character",
        ),
    ] {
        let config = format!(
            "{QUICK}\n[[tokens]]\nname = {}\nrole = \"admin\"\ntoken = {}\n",
            toml_str(name),
            toml_str(token)
        );
        let (status, printed) = serve_refused(&config, "127.0.0.1:0").await;
        assert!(!status.success(), "{name:?}/{token:?}: {printed}");
        assert!(printed.contains(key), "{key} in: {printed}");
        assert!(printed.contains(says), "{says:?} in: {printed}");
    }
}

/// A TOML basic string holding `s`.
fn toml_str(s: &str) -> String {
    serde_json::to_string(s).expect("a string serialises")
}
