//! The dashboard's server side: its files served at `/` without a token and from nowhere else, `GET /v1/whoami`, and redrive with a corrected payload (`POST /v1/dead-letters/{id}/redrive`) for jobs and broker messages.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{EVENTUALLY, QUICK, Server, TOKENS, assert_error, id_text, job, lease_req};
use crate::sources::{amqp_queue, amqp_url, orders_from_rabbitmq};
use crate::team_handler::{Handler, ORDER_2};

#[tokio::test]
async fn the_dashboard_is_served_without_a_token_and_needs_nothing_from_elsewhere() {
    let server = Server::start(&format!("{QUICK}\n{TOKENS}")).await;
    let api = server.api();
    let page = api.get("/").await;
    assert_eq!(page.status, 200, "{}", page.text());
    assert_eq!(page.headers["content-type"], "text/html; charset=utf-8");
    let csp = page.headers["content-security-policy"].to_str().unwrap();
    for directive in [
        "default-src 'none'",
        "script-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
    ] {
        assert!(csp.contains(directive), "{directive} in {csp}");
    }
    assert!(
        !csp.contains("unsafe-inline"),
        "no inline script or style: {csp}"
    );
    assert_eq!(page.headers["x-content-type-options"], "nosniff");
    let html = page.text();
    assert!(html.contains(r#"<script src="/dashboard/app.js" defer></script>"#));
    assert!(
        html.contains(r#"<label for="token">Token</label>"#),
        "a labelled login form"
    );

    let mut files = vec![html];
    for (path, content_type) in [
        ("/dashboard/app.js", "text/javascript; charset=utf-8"),
        ("/dashboard/app.css", "text/css; charset=utf-8"),
    ] {
        let r = api.get(path).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        assert_eq!(r.headers["content-type"], content_type, "{path}");
        assert!(r.headers.contains_key("content-security-policy"), "{path}");
        files.push(r.text());
    }
    for text in &files {
        for foreign in ["http://", "https://", "//cdn", "@import"] {
            assert!(
                !text.contains(foreign),
                "the dashboard names nothing elsewhere ({foreign} found)"
            );
        }
    }
    // Server text is hostile: the script never parses it as markup.
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
    ] {
        assert!(!files[1].contains(sink), "app.js uses {sink}");
    }
    assert!(
        !files[1].contains("document.cookie"),
        "the token is never a cookie"
    );

    // The API behind it still needs the token.
    assert_error(&api.get("/v1/stats").await, 401, "UNAUTHORIZED", None);
    assert_error(&api.get("/v1/whoami").await, 401, "UNAUTHORIZED", None);
    assert_error(
        &api.get("/dashboard/other.js").await,
        404,
        "NOT_FOUND",
        None,
    );
}

#[tokio::test]
async fn whoami_names_the_token_its_role_and_what_that_role_may_do() {
    let server = Server::start(&format!("{QUICK}\n{TOKENS}")).await;
    let cases = [
        (
            "operator-secret",
            json!({"name": "ops-alice", "role": "operator", "auth": true, "admin": false,
                   "may": ["observe", "read_jobs", "list_jobs", "read_dead_letters", "operate", "cancel"],
                   "payload_preview_bytes": 4096}),
        ),
        (
            "admin-secret",
            json!({"name": "root", "role": "admin", "auth": true, "admin": true,
                   "may": ["observe", "produce", "read_jobs", "list_jobs", "work", "read_dead_letters", "operate", "administer", "cancel"],
                   "payload_preview_bytes": 4096}),
        ),
        (
            "worker-secret",
            json!({"name": "w-1", "role": "worker", "auth": true, "admin": false,
                   "may": ["observe", "read_jobs", "work"], "payload_preview_bytes": 4096}),
        ),
        (
            "producer-secret",
            json!({"name": "p-1", "role": "producer", "auth": true, "admin": false,
                   "may": ["observe", "produce", "read_jobs", "list_jobs", "cancel"],
                   "payload_preview_bytes": 4096}),
        ),
    ];
    for (token, want) in cases {
        let r = server.api_as(token).get("/v1/whoami").await;
        assert_eq!(r.expect(200), &want, "{token}");
    }
    assert_error(
        &server.api_as("nope").get("/v1/whoami").await,
        401,
        "UNAUTHORIZED",
        None,
    );

    // Without tokens the server is loopback-only and everyone is admin.
    let open = Server::start(QUICK).await;
    let r = open.api().get("/v1/whoami").await;
    let body = r.expect(200);
    assert_eq!(
        (&body["name"], &body["role"], &body["auth"]),
        (&json!("anonymous"), &json!("admin"), &json!(false))
    );
}

const SCHEMA: &str = r#"{
  "type": "object",
  "required": ["to"],
  "properties": {"to": {"type": "string"}, "n": {"type": "integer"}}
}"#;

/// Enqueues `payload` as a `send_email` job, leases it and fails it for
/// good; returns (job id, dead letter id).
async fn dead_lettered(server: &Server, payload: Value, key: &str) -> (String, String) {
    let producer = server.api_as("producer-secret");
    let worker = server.api_as("worker-secret");
    let mut j = job("send_email", "acme", payload);
    j["idempotency_key"] = json!(key);
    let id = producer.enqueue_ok(&j).await;
    let leased = worker.lease_one(&lease_req("w-1", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
    let r = worker
        .fail(
            &id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "validation", "message": "to is not an address"}),
        )
        .await;
    let body = r.expect(200).clone();
    (id_text(&id), id_text(&body["dead_letter_id"]))
}

#[tokio::test]
async fn a_corrected_payload_is_admitted_like_an_enqueue_redriven_under_the_same_id_and_audited() {
    let config = format!(
        "payload_bytes_max = 1024\n{QUICK}\n{TOKENS}\n[types.send_email]\nschemas = {{ 1 = \"v1.json\" }}\n"
    );
    let server = Server::start_with(&config, &[("v1.json", SCHEMA)]).await;
    let operator = server.api_as("operator-secret");
    let original = json!({"to": "bob at example", "n": 1});
    let (job_id, dl) = dead_lettered(&server, original.clone(), "order-7").await;
    let path = format!("/v1/dead-letters/{dl}/redrive");

    // What a new enqueue would refuse is refused, and nothing changes.
    let r = operator
        .post(&path, &json!({"payload": {"n": 2}, "reason": "fixed"}))
        .await;
    let e = assert_error(&r, 422, "POISON", Some("schema_invalid"));
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("nothing was redriven"),
        "{e}"
    );
    let big = json!({"payload": {"to": "x".repeat(2000)}, "reason": "fixed"});
    assert_error(
        &operator.post(&path, &big).await,
        413,
        "POISON",
        Some("payload_too_large"),
    );
    assert_error(
        &operator
            .post(&path, &json!({"payload": {"to": "a@b"}}))
            .await,
        400,
        "BAD_REQUEST",
        None,
    );
    assert_error(
        &operator
            .post(&path, &json!({"reason": "forgot the payload"}))
            .await,
        400,
        "BAD_REQUEST",
        None,
    );
    assert_error(
        &operator
            .post(
                &path,
                &json!({"payload": {"to": "a@b"}, "reason": "r", "dry_run": true}),
            )
            .await,
        400,
        "BAD_REQUEST",
        None,
    );
    assert_error(
        &server
            .api_as("producer-secret")
            .post(&path, &json!({"payload": {"to": "a@b"}, "reason": "r"}))
            .await,
        403,
        "FORBIDDEN",
        None,
    );
    assert_error(
        &operator
            .post(
                "/v1/dead-letters/999999/redrive",
                &json!({"payload": {"to": "a@b"}, "reason": "r"}),
            )
            .await,
        404,
        "NOT_FOUND",
        None,
    );
    let held = operator.dead_letters("type=send_email").await;
    assert_eq!(held.len(), 1, "still quarantined: {held:?}");
    assert_eq!(
        operator.dead_letters("stage=admission").await.len(),
        0,
        "an operator's refused correction is not recorded as a producer's poison"
    );

    // A valid correction: the bytes as sent, the same job and key.
    let corrected = r#"{"to": "bob@example.com",  "n": 1}"#;
    let r = operator
        .post_raw(
            &path,
            format!(r#"{{"payload": {corrected}, "reason": "the address had no @ (TICKET-12)"}}"#),
        )
        .await;
    let body = r.expect(200).clone();
    assert_eq!(body["redriven"], true, "{body}");
    assert_eq!(body["job_id"], json!(job_id), "{body}");
    assert!(body["source"].is_null(), "{body}");
    assert!(
        operator.dead_letters("type=send_email").await.is_empty(),
        "moved, not copied"
    );
    assert_error(
        &operator
            .post(&path, &json!({"payload": {"to": "a@b"}, "reason": "again"}))
            .await,
        404,
        "NOT_FOUND",
        None,
    );

    let worker = server.api_as("worker-secret");
    let leased = worker.lease_one(&lease_req("w-1", 1, 30_000)).await;
    assert_eq!(id_text(&leased["id"]), job_id);
    assert_eq!(leased["attempt"], 1, "a fresh budget");
    assert_eq!(leased["idempotency_key"], "order-7");
    assert_eq!(
        leased["payload"],
        serde_json::from_str::<Value>(corrected).unwrap()
    );
    worker
        .ack(&leased["id"], &leased["lease_token"])
        .await
        .expect(200);

    let j = operator.get(&format!("/v1/jobs/{job_id}")).await;
    let j = j.expect(200);
    assert_eq!(j["state"], "succeeded");
    assert_eq!(j["payload_size"], corrected.len(), "byte for byte: {j}");
    let edits = j["payload_edits"].as_array().expect("payload_edits");
    assert_eq!(edits.len(), 1, "{j}");
    assert_eq!(edits[0]["previous_payload"], original, "the original stays");
    assert_eq!(edits[0]["actor"], "ops-alice");
    assert_eq!(edits[0]["reason"], "the address had no @ (TICKET-12)");
    assert_eq!(edits[0]["redrive"], 1);
    assert_eq!(
        j["history"].as_array().map(Vec::len),
        Some(2),
        "history kept: {j}"
    );

    let audit = operator.get("/v1/audit?action=redrive").await;
    let items = audit.expect(200)["items"].as_array().unwrap().clone();
    assert_eq!(items.len(), 1, "the refused ones wrote nothing: {items:?}");
    let entry = &items[0];
    assert_eq!(entry["actor"], "ops-alice");
    assert_eq!(entry["count"], 1);
    let req = &entry["request"];
    assert_eq!(req["payload_edited"], true, "{entry}");
    assert_eq!(req["edited_by"], "ops-alice", "{entry}");
    assert_eq!(req["reason"], "the address had no @ (TICKET-12)", "{entry}");
    assert_eq!(req["dead_letter_id"], json!(dl), "{entry}");
    assert_eq!(req["job_id"], json!(job_id), "{entry}");
    assert_eq!(req["payload_size"], corrected.len(), "{entry}");
    assert_eq!(
        req["previous_payload_sha256"],
        crate::harness::sha256_hex(original.to_string().as_bytes()),
        "{entry}"
    );
}

#[tokio::test]
async fn an_admission_record_cannot_be_redriven_with_a_corrected_payload() {
    let server = Server::start(&format!("payload_bytes_max = 64\n{QUICK}\n{TOKENS}")).await;
    let r = server
        .api_as("producer-secret")
        .enqueue(&job("send_email", "acme", json!({"blob": "y".repeat(100)})))
        .await;
    assert_error(&r, 413, "POISON", Some("payload_too_large"));
    let operator = server.api_as("operator-secret");
    let records = operator.dead_letters("stage=admission").await;
    assert_eq!(records.len(), 1, "{records:?}");
    let r = operator
        .post(
            &format!("/v1/dead-letters/{}/redrive", id_text(&records[0]["id"])),
            &json!({"payload": {"blob": "y"}, "reason": "smaller"}),
        )
        .await;
    let e = assert_error(&r, 400, "BAD_REQUEST", None);
    assert!(
        e["message"].as_str().unwrap().contains("POST /v1/jobs"),
        "says what to do: {e}"
    );
    assert_eq!(operator.dead_letters("stage=admission").await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_dead_letter_is_republished_with_the_corrected_body() {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};

    let test = "a_broker_dead_letter_is_republished_with_the_corrected_body";
    let Some(url) = amqp_url(test) else { return };
    let (_conn, ch, queue) = amqp_queue(&url, "dash").await;

    let handler = Handler::broken();
    let deliver = handler.start().await;
    let config = format!(
        "{}delivery_timeout_ms = 5000\n{TOKENS}",
        orders_from_rabbitmq(&url, &queue, deliver)
    );
    let server = Server::start(&config).await;
    server.wait_output("source orders: guard rabbitmq ").await;

    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm mode");
    let props = lapin::BasicProperties::default()
        .with_message_id("m2".into())
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    ch.basic_publish(
        "",
        &queue,
        BasicPublishOptions {
            mandatory: true,
            ..BasicPublishOptions::default()
        },
        ORDER_2.as_bytes(),
        props,
    )
    .await
    .expect("publish")
    .await
    .expect("confirmed");

    // The handler refuses order 2 (it has no amount): one dead letter.
    let operator = server.api_as("operator-secret");
    let deadline = Instant::now() + EVENTUALLY;
    let items = loop {
        let items = operator.dead_letters("source=orders").await;
        if !items.is_empty() {
            break items;
        }
        assert!(
            Instant::now() < deadline,
            "no dead letter within {EVENTUALLY:?}\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let dl = id_text(&items[0]["id"]);
    assert_eq!(items[0]["source"]["message_id"], "m2");

    // Corrected, it is republished with the new body under the same
    // message id, and the handler (still refusing the old body) takes it.
    let corrected = r#"{"order": 2, "amount": 1500}"#;
    let r = operator
        .post_raw(
            &format!("/v1/dead-letters/{dl}/redrive"),
            format!(r#"{{"payload": {corrected}, "reason": "the amount was lost upstream"}}"#),
        )
        .await;
    let body = r.expect(200).clone();
    assert_eq!(body["source"], "orders", "{body}");
    assert_eq!(body["message_id"], "m2", "{body}");
    assert!(body["job_id"].is_null(), "{body}");
    let seen = handler.deliveries_of_body(corrected, 1, &server).await;
    assert_eq!(seen[0].message_id(), "m2", "the same message id");
    assert_eq!(seen[0].header("lazaret-attempt"), "1", "a fresh budget");
    assert_eq!(
        handler.of("m2").len(),
        2,
        "the original once, the correction once"
    );
    let deadline = Instant::now() + EVENTUALLY;
    while !operator.dead_letters("source=orders").await.is_empty() {
        assert!(Instant::now() < deadline, "the dead letter left");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let audit = operator.get("/v1/audit?action=redrive").await;
    let entry = audit.expect(200)["items"][0].clone();
    assert_eq!(entry["count"], 1, "{entry}");
    assert_eq!(entry["actor"], "ops-alice", "{entry}");
    let req = &entry["request"];
    assert_eq!(
        (&req["payload_edited"], &req["source"], &req["message_id"]),
        (&json!(true), &json!("orders"), &json!("m2")),
        "{entry}"
    );
    assert_eq!(req["reason"], "the amount was lost upstream", "{entry}");
    assert_eq!(
        req["previous_payload_sha256"],
        crate::harness::sha256_hex(ORDER_2.as_bytes()),
        "{entry}"
    );
}
