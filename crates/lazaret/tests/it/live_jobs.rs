//! Live jobs: listing with filters and a cursor, cancel (at once while
//! waiting, at the outcome while leased), `dead_letter_id` on a job, and
//! pauses that a restart keeps.

use serde_json::{Value, json};

use crate::harness::{QUICK, Server, assert_error, id_text, job, lease_req};

/// The fields of a job in `GET /v1/jobs/{id}` and in the items of
/// `GET /v1/jobs` (which leave out `history`), each present even as `null`.
const JOB_FIELDS: [&str; 12] = [
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
    "dead_letter_id",
    "cancel_requested",
];

#[track_caller]
fn assert_job_fields(item: &Value, with_history: bool) {
    let o = item
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {item}"));
    for key in JOB_FIELDS {
        assert!(o.contains_key(key), "{key} missing from {item}");
    }
    assert_eq!(o.contains_key("history"), with_history, "{item}");
}

/// The ids of a list reply, in order.
fn ids(body: &Value) -> Vec<Value> {
    body["items"]
        .as_array()
        .unwrap_or_else(|| panic!("`items` is not a list: {body}"))
        .iter()
        .map(|j| j["id"].clone())
        .collect()
}

#[tokio::test]
async fn jobs_are_listed_newest_first_by_cursor_and_by_filter() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let mut a = job("resize", "acme", json!({"n": 1}));
    a["lane"] = json!("batch");
    let a = api.enqueue_ok(&a).await;
    let b = api.enqueue_ok(&job("email", "acme", json!({"n": 2}))).await;
    let c = api
        .enqueue_ok(&job("resize", "globex", json!({"n": 3})))
        .await;
    let mut later = job("resize", "acme", json!({"n": 4}));
    later["delay_ms"] = json!(3_600_000);
    let d = api.enqueue(&later).await.expect(201)["id"].clone();
    let mut req = lease_req("w", 1, 30_000);
    req["types"] = json!(["email"]);
    assert_eq!(api.lease_one(&req).await["id"], b);

    let first = api.get("/v1/jobs?limit=2").await.expect(200).clone();
    assert_eq!(ids(&first), vec![d.clone(), c.clone()]);
    for item in first["items"].as_array().unwrap() {
        assert_job_fields(item, false);
    }
    let cursor = first["next_cursor"].as_str().expect("a cursor").to_owned();
    let second = api
        .get(&format!("/v1/jobs?limit=2&cursor={cursor}"))
        .await
        .expect(200)
        .clone();
    assert_eq!(ids(&second), vec![b.clone(), a.clone()]);
    assert_eq!(second["next_cursor"], Value::Null, "{second}");

    for (query, want) in [
        ("state=queued", vec![c.clone(), a.clone()]),
        ("state=scheduled", vec![d.clone()]),
        ("state=leased", vec![b.clone()]),
        ("state=cancelled", vec![]),
        ("type=resize", vec![d.clone(), c.clone(), a.clone()]),
        ("tenant=globex", vec![c.clone()]),
        ("lane=batch", vec![a.clone()]),
        (
            "state=queued&type=resize&tenant=acme&lane=batch",
            vec![a.clone()],
        ),
    ] {
        let body = api
            .get(&format!("/v1/jobs?{query}"))
            .await
            .expect(200)
            .clone();
        assert_eq!(ids(&body), want, "{query}: {body}");
    }
    let body = api.get("/v1/jobs?state=leased").await.expect(200).clone();
    let leased = &body["items"][0];
    assert_eq!(
        (&leased["state"], &leased["type"], &leased["attempt"]),
        (&json!("leased"), &json!("email"), &json!(1))
    );
    assert_eq!(leased["payload"], json!({"n": 2}));

    // Payloads are listed byte for byte, as enqueued.
    let odd = r#"{"n" : 5,   "why":  "spacing"}"#;
    let body = format!(r#"{{"type": "odd", "tenant": "acme", "payload": {odd}}}"#);
    api.post_raw("/v1/jobs", body).await.expect(201);
    let r = api.get("/v1/jobs?type=odd").await;
    assert_eq!(r.status, 200);
    assert!(
        r.text().contains(&format!(r#""payload":{odd}"#)),
        "{}",
        r.text()
    );

    // Refusals say what was wrong.
    let r = api.get("/v1/jobs?colour=red").await;
    let e = assert_error(&r, 400, "BAD_REQUEST", None);
    assert!(
        e["message"]
            .as_str()
            .unwrap()
            .contains("state, type, tenant, lane, limit, cursor and payload"),
        "{e}"
    );
    let r = api.get("/v1/jobs?state=running").await;
    let e = assert_error(&r, 400, "BAD_REQUEST", None);
    let message = e["message"].as_str().unwrap();
    for word in [
        "queued",
        "scheduled",
        "leased",
        "succeeded",
        "dead_lettered",
        "cancelled",
    ] {
        assert!(message.contains(word), "{word} missing from {message}");
    }
    assert_error(
        &api.get("/v1/jobs?cursor=abc").await,
        400,
        "BAD_REQUEST",
        None,
    );
    assert_error(&api.get("/v1/jobs?limit=0").await, 400, "BAD_REQUEST", None);
}

#[tokio::test]
async fn a_job_has_every_field_and_its_dead_letter_id_once_dead_lettered() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let view = api.job(&id).await;
    assert_job_fields(&view, true);
    assert_eq!(view["dead_letter_id"], Value::Null);
    assert_eq!(view["idempotency_key"], Value::Null);
    assert_eq!(view["cancel_requested"], false);

    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    api.fail(
        &id,
        &leased["lease_token"],
        json!({"class": "permanent", "kind": "bad_input", "message": "no"}),
    )
    .await
    .expect(200);
    let dead = api.dead_letter_of(&id).await;
    let view = api.job(&id).await;
    assert_eq!(view["state"], "dead_lettered");
    assert_eq!(view["dead_letter_id"], dead["id"]);
    let body = api
        .get("/v1/jobs?state=dead_lettered")
        .await
        .expect(200)
        .clone();
    assert_eq!(body["items"][0]["dead_letter_id"], dead["id"]);

    // Redriven, it has none again.
    api.post("/v1/dead-letters/redrive", &json!({"ids": [dead["id"]]}))
        .await
        .expect(200);
    assert_eq!(api.job(&id).await["dead_letter_id"], Value::Null);
}

/// The `count`s of the audit log's `cancel` entries, newest first.
async fn cancel_audit(api: &crate::harness::Api) -> Vec<Value> {
    let body = api.get("/v1/audit?action=cancel").await.expect(200).clone();
    body["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| json!([e["actor"], e["request"]["job_id"], e["count"]]))
        .collect()
}

#[tokio::test]
async fn a_waiting_job_is_cancelled_at_once_and_never_leased() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let queued = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let mut later = job("report", "acme", json!({"n": 2}));
    later["delay_ms"] = json!(200);
    let scheduled = api.enqueue(&later).await.expect(201)["id"].clone();
    for id in [&queued, &scheduled] {
        let r = api
            .post(&format!("/v1/jobs/{}/cancel", id_text(id)), &json!({}))
            .await;
        assert_eq!(r.expect(200), &json!({"state": "cancelled"}));
        let view = api.job(id).await;
        assert_eq!(view["state"], "cancelled");
        assert_eq!(view["cancel_requested"], true);
    }
    // A job enqueued after them, past the scheduled one's time, is the
    // only one ever leased.
    let other = api
        .enqueue_ok(&job("report", "acme", json!({"n": 3})))
        .await;
    let mut req = lease_req("w", 10, 30_000);
    req["wait_ms"] = json!(500);
    let got = api.lease_eventually(&req).await;
    assert_eq!(got.len(), 1, "{got:?}");
    assert_eq!(got[0]["id"], other);
    api.job_eventually(&other, "leased").await;
    // Long past its time, the scheduled job is still cancelled.
    let later_lease = api.lease(&req).await;
    assert!(later_lease.is_empty(), "{later_lease:?}");
    assert_eq!(api.job(&scheduled).await["state"], "cancelled");

    // Finished: 409 BAD_STATE, and nothing more in the audit log.
    let r = api
        .post(&format!("/v1/jobs/{}/cancel", id_text(&queued)), &json!({}))
        .await;
    let e = assert_error(&r, 409, "BAD_STATE", None);
    assert!(e["message"].as_str().unwrap().contains("cancelled"), "{e}");
    let r = api.post("/v1/jobs/999999999/cancel", &json!({})).await;
    assert_error(&r, 404, "NOT_FOUND", None);
    assert_eq!(
        cancel_audit(&api).await,
        vec![
            json!(["anonymous", id_text(&scheduled), 1]),
            json!(["anonymous", id_text(&queued), 1]),
        ]
    );
    let stats = api.get("/v1/stats").await.expect(200).clone();
    assert_eq!(stats["cancelled_kept"], 2, "{stats}");
}

#[tokio::test]
async fn a_leased_job_hears_of_its_cancel_and_a_fail_then_cancels_it_without_a_dead_letter() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let id = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    let token = &leased["lease_token"];
    let hb = api.heartbeat(&id, token, 30_000).await.expect(200).clone();
    assert_eq!(hb["cancel_requested"], false, "{hb}");

    let r = api
        .post(
            &format!("/v1/jobs/{}/cancel", id_text(&id)),
            &json!({"reason": "customer asked"}),
        )
        .await;
    assert_eq!(
        r.expect(200),
        &json!({"state": "leased", "cancel_requested": true})
    );
    let hb = api.heartbeat(&id, token, 30_000).await.expect(200).clone();
    assert_eq!(hb["cancel_requested"], true, "{hb}");
    assert!(hb["lease_expires_at"].is_string(), "{hb}");
    let view = api.job(&id).await;
    assert_eq!(
        (&view["state"], &view["cancel_requested"]),
        (&json!("leased"), &json!(true))
    );

    // A transient failure with attempts left: cancelled, not retried.
    let r = api
        .fail(
            &id,
            token,
            json!({"class": "transient", "kind": "http_503", "message": "down"}),
        )
        .await;
    assert_eq!(r.expect(200)["state"], "cancelled");
    let view = api.job(&id).await;
    assert_eq!(view["state"], "cancelled");
    assert_eq!(view["dead_letter_id"], Value::Null);
    assert_eq!(view["history"][0]["outcome"], "cancelled");
    assert!(api.dead_letters("").await.is_empty());
    let audit = api.get("/v1/audit?action=cancel").await.expect(200).clone();
    assert_eq!(audit["items"][0]["count"], 1);
    assert_eq!(audit["items"][0]["request"]["reason"], "customer asked");
}

#[tokio::test]
async fn an_ack_after_a_cancel_stands_and_an_expired_lease_ends_cancelled() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let acked = api
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    api.post(&format!("/v1/jobs/{}/cancel", id_text(&acked)), &json!({}))
        .await
        .expect(200);
    let r = api.ack(&acked, &leased["lease_token"]).await;
    assert_eq!(r.expect(200)["state"], "succeeded");
    assert_eq!(api.job(&acked).await["state"], "succeeded");

    // A short lease that is never answered: the reaper settles it.
    let expiring = api
        .enqueue_ok(&job("report", "acme", json!({"n": 2})))
        .await;
    let leased = api.lease_one(&lease_req("w", 1, 300)).await;
    assert_eq!(leased["id"], expiring);
    api.post(
        &format!("/v1/jobs/{}/cancel", id_text(&expiring)),
        &json!({}),
    )
    .await
    .expect(200);
    let view = api.job_eventually(&expiring, "cancelled").await;
    assert_eq!(view["history"][0]["outcome"], "cancelled");
    assert_eq!(view["history"][0]["error"]["kind"], "lease_expired");
    assert!(api.dead_letters("").await.is_empty());
}

const PRODUCER_A: &str = "tok-producer-a-0123456789";
const PRODUCER_B: &str = "tok-producer-b-0123456789";
const WORKER: &str = "tok-worker-0123456789";
const OPERATOR: &str = "tok-operator-0123456789";

#[tokio::test]
async fn a_producer_lists_and_cancels_only_its_own_jobs() {
    let config = format!(
        r#"{QUICK}
[[tokens]]
name = "shop"
role = "producer"
token = "{PRODUCER_A}"

[[tokens]]
name = "billing"
role = "producer"
token = "{PRODUCER_B}"

[[tokens]]
name = "mail-worker"
role = "worker"
token = "{WORKER}"

[[tokens]]
name = "ops-alice"
role = "operator"
token = "{OPERATOR}"
"#
    );
    let server = Server::start(&config).await;
    let (shop, billing) = (server.api_as(PRODUCER_A), server.api_as(PRODUCER_B));
    let mine = shop
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let theirs = billing
        .enqueue_ok(&job("report", "acme", json!({"n": 2})))
        .await;

    let body = shop.get("/v1/jobs").await.expect(200).clone();
    assert_eq!(ids(&body), vec![mine.clone()]);
    let body = server
        .api_as(OPERATOR)
        .get("/v1/jobs")
        .await
        .expect(200)
        .clone();
    assert_eq!(ids(&body), vec![theirs.clone(), mine.clone()]);
    let r = server.api_as(WORKER).get("/v1/jobs").await;
    assert_error(&r, 403, "FORBIDDEN", None);

    let r = shop
        .post(&format!("/v1/jobs/{}/cancel", id_text(&theirs)), &json!({}))
        .await;
    assert_error(&r, 403, "FORBIDDEN", None);
    let r = server
        .api_as(WORKER)
        .post(&format!("/v1/jobs/{}/cancel", id_text(&theirs)), &json!({}))
        .await;
    assert_error(&r, 403, "FORBIDDEN", None);
    assert_eq!(billing.job(&theirs).await["state"], "queued");

    shop.post(&format!("/v1/jobs/{}/cancel", id_text(&mine)), &json!({}))
        .await
        .expect(200);
    server
        .api_as(OPERATOR)
        .post(&format!("/v1/jobs/{}/cancel", id_text(&theirs)), &json!({}))
        .await
        .expect(200);
    assert_eq!(
        cancel_audit(&server.api_as(OPERATOR)).await,
        vec![
            json!(["ops-alice", id_text(&theirs), 1]),
            json!(["shop", id_text(&mine), 1]),
        ]
    );
}

#[tokio::test]
async fn pauses_survive_a_restart_and_stats_show_them() {
    let mut server = Server::start(QUICK).await;
    let api = server.api();
    api.post("/v1/pause", &json!({"type": "report"}))
        .await
        .expect(200);
    let r = api.post("/v1/pause", &json!({"lane": "batch"})).await;
    assert_eq!(r.expect(200)["changed"], true);
    let r = api.post("/v1/pause", &json!({"lane": "batch"})).await;
    assert_eq!(r.expect(200)["changed"], false, "paused already");

    server.restart().await;
    let api = server.api();
    let stats = api.get("/v1/stats").await.expect(200).clone();
    assert_eq!(
        stats["paused"],
        json!({"types": ["report"], "lanes": ["batch"]}),
        "{stats}"
    );
    let r = api.enqueue(&job("report", "acme", json!({"n": 1}))).await;
    assert_error(&r, 503, "SHED", None);
    let mut batch = job("email", "acme", json!({"n": 2}));
    batch["lane"] = json!("batch");
    let parked = api.enqueue(&batch).await;
    assert_error(&parked, 503, "SHED", None);

    api.post("/v1/resume", &json!({"type": "report"}))
        .await
        .expect(200);
    server.restart().await;
    let api = server.api();
    let stats = api.get("/v1/stats").await.expect(200).clone();
    assert_eq!(stats["paused"], json!({"types": [], "lanes": ["batch"]}));
    let id = api
        .enqueue_ok(&job("report", "acme", json!({"n": 3})))
        .await;
    assert_eq!(api.lease_one(&lease_req("w", 1, 30_000)).await["id"], id);
}

#[tokio::test]
async fn a_job_payload_can_be_previewed_and_downloaded_whole_by_whoever_may_read_the_job() {
    use sha2::Digest;

    let config = format!(
        r#"{QUICK}
[[tokens]]
name = "shop"
role = "producer"
token = "{PRODUCER_A}"

[[tokens]]
name = "billing"
role = "producer"
token = "{PRODUCER_B}"

[[tokens]]
name = "mail-worker"
role = "worker"
token = "{WORKER}"

[[tokens]]
name = "ops-alice"
role = "operator"
token = "{OPERATOR}"
"#
    );
    let server = Server::start(&config).await;
    let (shop, worker, operator) = (
        server.api_as(PRODUCER_A),
        server.api_as(WORKER),
        server.api_as(OPERATOR),
    );
    // 10 KB of two-byte chars: 4096 bytes would end inside one.
    let payload = json!({"blob": "é".repeat(5000)});
    let text = serde_json::to_string(&payload).unwrap();
    let id = shop.enqueue_ok(&job("resize", "acme", payload)).await;
    let path = format!("/v1/jobs/{}", id_text(&id));

    // The default is the contract's: the whole payload.
    let full = shop.get(&path).await.expect(200).clone();
    assert_eq!(full["payload"]["blob"].as_str().unwrap().len(), 10_000);
    assert!(
        full.get("payload_preview").is_none(),
        "{}",
        full["payload_size"]
    );

    // `payload=preview`: its first 4 KiB (cut at a char), size and hash; no payload.
    let check = |j: &Value| {
        assert!(j.get("payload").is_none(), "no whole payload");
        let preview = j["payload_preview"].as_str().expect("payload_preview");
        assert!(
            preview.len() <= 4096 && preview.len() > 4090,
            "{}",
            preview.len()
        );
        assert!(text.starts_with(preview));
        assert_eq!(j["payload_size"], text.len());
        assert_eq!(
            j["payload_sha256"],
            hex::encode(sha2::Sha256::digest(text.as_bytes()))
        );
    };
    let one = shop.get(&format!("{path}?payload=preview")).await;
    check(one.expect(200));
    assert!(
        one.body["history"].is_array(),
        "still the whole job otherwise"
    );
    let page = operator.get("/v1/jobs?type=resize&payload=preview").await;
    let page = page.expect(200).clone();
    assert_eq!(ids(&page), vec![id.clone()]);
    check(&page["items"][0]);
    let page = operator.get("/v1/jobs?type=resize&payload=full").await;
    assert_eq!(page.expect(200)["items"][0]["payload"], full["payload"]);

    let r = shop.get(&format!("{path}?payload=half")).await;
    assert_error(&r, 400, "BAD_REQUEST", None);
    assert!(r.text().contains("preview"), "{}", r.text());
    assert_error(
        &shop.get(&format!("{path}?payloads=preview")).await,
        400,
        "BAD_REQUEST",
        None,
    );
    assert_error(
        &operator.get("/v1/jobs?payload=half").await,
        400,
        "BAD_REQUEST",
        None,
    );

    // The bytes whole, for whoever may read the job, exactly as admitted.
    let bytes_path = format!("{path}/payload");
    for api in [&shop, &worker, &operator] {
        let r = api.get(&bytes_path).await;
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.headers["content-type"], "application/json");
        assert_eq!(r.bytes, text.as_bytes());
    }
    assert_error(
        &server.api_as(PRODUCER_B).get(&bytes_path).await,
        403,
        "FORBIDDEN",
        None,
    );
    assert_error(
        &server.api().get(&bytes_path).await,
        401,
        "UNAUTHORIZED",
        None,
    );
    assert_error(
        &operator.get("/v1/jobs/999999/payload").await,
        404,
        "NOT_FOUND",
        None,
    );

    // After a corrected redrive the payload it replaced is previewed too.
    let leased = worker.lease_one(&lease_req("w", 1, 30_000)).await;
    worker
        .fail(
            &leased["id"],
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "too_big", "message": "too big"}),
        )
        .await
        .expect(200);
    let dl = operator.dead_letter_of(&id).await["id"].clone();
    operator
        .post(
            &format!("/v1/dead-letters/{}/redrive", id_text(&dl)),
            &json!({"payload": {"blob": "small"}, "reason": "shrunk"}),
        )
        .await
        .expect(200);
    let j = operator.get(&format!("{path}?payload=preview")).await;
    let j = j.expect(200);
    assert_eq!(j["payload_preview"], r#"{"blob":"small"}"#);
    let edit = &j["payload_edits"][0];
    assert!(edit.get("previous_payload").is_none(), "{edit}");
    let before = edit["previous_payload_preview"].as_str().unwrap();
    assert!(
        before.len() <= 4096 && text.starts_with(before),
        "{}",
        before.len()
    );
    assert_eq!(edit["previous_payload_size"], text.len());
    let r = operator.get(&bytes_path).await;
    assert_eq!(
        r.text(),
        r#"{"blob":"small"}"#,
        "the payload the job has now"
    );
}
