//! Outcomes: permanent, transient, kind budgets, deferrals and crash loops, each ending where the policy says.

use std::time::SystemTime;

use serde_json::{Value, json};

use crate::harness::{QUICK, Server, at, job, lease_req, ms, sha256_hex};

async fn start() -> Server {
    let config = format!(
        "{QUICK}
[types.flaky]
attempts_max = 4
kinds = {{ parse = 1, timeout = 2 }}

[types.patient]
deferrals_max = 3

[types.crashy]
attempts_max = 5
crash_loop_max = 2
"
    );
    Server::start(&config).await
}

fn only(ty: &str, worker: &str, lease_ms: u64) -> Value {
    let mut req = lease_req(worker, 1, lease_ms);
    req["types"] = json!([ty]);
    req
}

fn transient(kind: &str) -> Value {
    json!({"class": "transient", "kind": kind, "message": format!("{kind} again")})
}

#[tokio::test]
async fn a_permanent_failure_is_dead_lettered_at_once_with_everything_needed_to_replay_it() {
    let server = start().await;
    let api = server.api();
    let payload = r#"{"to": "ada@example.com", "n": 7}"#;
    let body = format!(
        r#"{{"type": "report", "tenant": "acme", "lane": "batch", "idempotency_key": "order-7", "payload": {payload}}}"#
    );
    let id = api.post_raw("/v1/jobs", body).await.expect(201)["id"].clone();

    let leased = api.lease_one(&lease_req("w-1", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
    let error = json!({
        "class": "permanent",
        "kind": "bad_address",
        "message": "no such mailbox",
        "traceback": "Traceback (most recent call last):\n  File \"send.py\", line 3\nValueError: no such mailbox",
    });
    let r = api.fail(&id, &leased["lease_token"], error.clone()).await;
    let reply = r.expect(200);
    assert_eq!(reply["state"], "dead_lettered", "{reply}");
    assert_eq!(reply["reason"], "permanent", "{reply}");

    assert_eq!(api.job(&id).await["state"], "dead_lettered");
    let dead = api.dead_letter_of(&id).await;
    for key in [
        "id",
        "job_id",
        "type",
        "tenant",
        "lane",
        "reason",
        "stage",
        "attempts",
        "error",
        "history",
        "idempotency_key",
        "created_at",
        "dead_lettered_at",
        "payload_size",
        "payload_sha256",
        "payload_preview",
    ] {
        assert!(
            dead.as_object().unwrap().contains_key(key),
            "a dead letter has `{key}`: {dead}"
        );
    }
    assert_eq!(dead["type"], "report");
    assert_eq!(dead["tenant"], "acme");
    assert_eq!(dead["lane"], "batch");
    assert_eq!(dead["reason"], "permanent");
    assert_eq!(dead["stage"], "processing");
    assert_eq!(dead["attempts"], 1, "never retried");
    assert_eq!(dead["error"]["class"], "permanent");
    assert_eq!(dead["error"]["kind"], "bad_address");
    assert_eq!(dead["error"]["message"], "no such mailbox");
    assert_eq!(dead["error"]["traceback"], error["traceback"]);
    assert_eq!(dead["idempotency_key"], "order-7");
    assert_eq!(dead["payload_size"], payload.len());
    assert_eq!(dead["payload_sha256"], sha256_hex(payload.as_bytes()));
    assert_eq!(dead["payload_preview"], payload);
    assert!(at(&dead["created_at"]) <= at(&dead["dead_lettered_at"]));

    let history = dead["history"].as_array().expect("a history list");
    assert_eq!(history.len(), 1, "{dead}");
    let h = &history[0];
    assert_eq!(h["attempt"], 1);
    assert_eq!(h["worker_id"], "w-1");
    assert!(at(&h["started_at"]) <= at(&h["ended_at"]), "{h}");
    assert!(h["outcome"].is_string(), "{h}");
    assert_eq!(h["error"]["kind"], "bad_address", "{h}");

    // The same record by its own id, with its lineage (never redriven).
    let by_id = api
        .get(&format!(
            "/v1/dead-letters/{}",
            crate::harness::id_text(&dead["id"])
        ))
        .await;
    let mut one = by_id.expect(200).clone();
    assert_eq!(one["lineage"], json!([]), "{one}");
    one.as_object_mut().expect("an object").remove("lineage");
    assert_eq!(&one, &dead);
}

#[tokio::test]
async fn a_transient_failure_is_retried_after_a_backoff_then_dead_lettered_as_exhausted() {
    let server = start().await;
    let api = server.api();
    // `report` has the defaults: attempts_max 3, backoff 20 ms up to 100 ms.
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;

    for attempt in 1..=3u64 {
        let leased = api.lease_one(&only("report", "w", 30_000)).await;
        assert_eq!(leased["id"], id);
        assert_eq!(leased["attempt"], attempt);
        let before = SystemTime::now();
        let r = api
            .fail(&id, &leased["lease_token"], transient("http_503"))
            .await;
        let after = SystemTime::now();
        let reply = r.expect(200);
        if attempt < 3 {
            assert_eq!(reply["state"], "scheduled", "{reply}");
            assert_eq!(reply["attempt"], attempt, "{reply}");
            let retry_at = ms(at(&reply["retry_at"]));
            assert!(
                retry_at >= ms(before),
                "a retry is never due before the failure"
            );
            assert!(
                retry_at <= ms(after) + 100 + 1,
                "the backoff stays within backoff_cap_ms (100)"
            );
        } else {
            assert_eq!(reply["state"], "dead_lettered", "{reply}");
            assert_eq!(reply["reason"], "exhausted", "{reply}");
        }
    }

    let dead = api.dead_letter_of(&id).await;
    assert_eq!(dead["reason"], "exhausted");
    assert_eq!(dead["attempts"], 3);
    assert_eq!(dead["history"].as_array().map(Vec::len), Some(3), "{dead}");
    assert_eq!(dead["error"]["kind"], "http_503");
}

#[tokio::test]
async fn a_kind_budget_is_spent_as_kind_exhausted_even_when_it_is_one() {
    let server = start().await;
    let api = server.api();

    // parse = 1: the first parse failure spends it. No class: the policy
    // classifies by kind, and a kind it does not know is transient.
    let once = api.enqueue_ok(&job("flaky", "acme", json!({"n": 1}))).await;
    let leased = api.lease_one(&only("flaky", "w", 30_000)).await;
    assert_eq!(leased["id"], once);
    let r = api
        .fail(
            &once,
            &leased["lease_token"],
            json!({"kind": "parse", "message": "unexpected <"}),
        )
        .await;
    let reply = r.expect(200);
    assert_eq!(reply["state"], "dead_lettered", "{reply}");
    assert_eq!(reply["reason"], "kind_exhausted", "{reply}");

    // timeout = 2: one retry, then kind_exhausted (attempts_max 4 not spent).
    let twice = api.enqueue_ok(&job("flaky", "acme", json!({"n": 2}))).await;
    let leased = api.lease_one(&only("flaky", "w", 30_000)).await;
    assert_eq!(leased["id"], twice);
    let reply = api
        .fail(&twice, &leased["lease_token"], transient("timeout"))
        .await;
    assert_ne!(reply.expect(200)["state"], "dead_lettered");
    let leased = api.lease_one(&only("flaky", "w", 30_000)).await;
    assert_eq!(leased["id"], twice);
    assert_eq!(leased["attempt"], 2);
    let reply = api
        .fail(&twice, &leased["lease_token"], transient("timeout"))
        .await;
    let reply = reply.expect(200);
    assert_eq!(reply["state"], "dead_lettered", "{reply}");
    assert_eq!(reply["reason"], "kind_exhausted", "{reply}");

    assert_eq!(api.dead_letter_of(&once).await["reason"], "kind_exhausted");
    let dead = api.dead_letter_of(&twice).await;
    assert_eq!(dead["reason"], "kind_exhausted");
    assert_eq!(dead["attempts"], 2);
}

#[tokio::test]
async fn a_deferred_failure_does_not_advance_the_attempt() {
    let server = start().await;
    let api = server.api();
    let id = api.enqueue_ok(&job("patient", "acme", json!({}))).await;

    let leased = api.lease_one(&only("patient", "w", 30_000)).await;
    assert_eq!(leased["attempt"], 1);
    let r = api
        .fail(
            &id,
            &leased["lease_token"],
            json!({"class": "deferred", "kind": "rate_limited", "message": "429",
                   "retry_after_ms": 50}),
        )
        .await;
    let reply = r.expect(200);
    assert_eq!(reply["state"], "scheduled", "{reply}");
    assert!(reply.get("retry_at").is_some(), "{reply}");

    let again = api.lease_one(&only("patient", "w", 30_000)).await;
    assert_eq!(again["id"], id);
    assert_eq!(again["attempt"], 1, "a deferral is not charged");
    api.ack(&id, &again["lease_token"]).await.expect(200);
    let got = api.job(&id).await;
    assert_eq!(got["state"], "succeeded");
    assert_eq!(got["attempt"], 1, "{got}");
}

#[tokio::test]
async fn deferrals_past_deferrals_max_are_dead_lettered_as_deferrals_exhausted() {
    let server = start().await;
    let api = server.api();
    // `patient` has deferrals_max = 3: three deferrals reschedule, the
    // fourth dead-letters (the contract's boundary).
    let id = api.enqueue_ok(&job("patient", "acme", json!({}))).await;
    for deferral in 1..=4 {
        let leased = api.lease_one(&only("patient", "w", 30_000)).await;
        assert_eq!(leased["attempt"], 1);
        let r = api
            .fail(
                &id,
                &leased["lease_token"],
                json!({"class": "deferred", "kind": "rate_limited", "message": "429",
                       "retry_after_ms": 20}),
            )
            .await;
        let reply = r.expect(200);
        if deferral <= 3 {
            assert_ne!(reply["state"], "dead_lettered", "{reply}");
        } else {
            assert_eq!(reply["state"], "dead_lettered", "{reply}");
            assert_eq!(reply["reason"], "deferrals_exhausted", "{reply}");
        }
    }
    assert_eq!(
        api.dead_letter_of(&id).await["reason"],
        "deferrals_exhausted"
    );
}

#[tokio::test]
async fn a_worker_that_leases_and_vanishes_ends_in_crash_loop_while_other_jobs_flow() {
    let server = start().await;
    let api = server.api();
    // `crashy`: crash_loop_max 2, attempts_max 5.
    let id = api.enqueue_ok(&job("crashy", "acme", json!({}))).await;

    let mut healthy_done = 0;
    for expiry in 1..=2u64 {
        // A worker takes it with a short lease and is never heard from again.
        let leased = api.lease_one(&only("crashy", "w-doomed", 300)).await;
        assert_eq!(leased["id"], id);
        assert_eq!(
            leased["attempt"], expiry,
            "an expired lease is a charged attempt"
        );

        // Meanwhile the line moves: other jobs are leased and acked.
        for n in 0..3 {
            api.enqueue_ok(&job("report", "acme", json!({"n": n})))
                .await;
        }
        let mut req = lease_req("w-healthy", 3, 30_000);
        req["types"] = json!(["report"]);
        let mut got = 0;
        while got < 3 {
            for j in api.lease_eventually(&req).await {
                api.ack(&j["id"], &j["lease_token"]).await.expect(200);
                got += 1;
            }
        }
        healthy_done += got;
    }
    assert_eq!(healthy_done, 6);

    let got = api.job_eventually(&id, "dead_lettered").await;
    assert_eq!(got["attempt"], 2, "{got}");
    let dead = api.dead_letter_of(&id).await;
    assert_eq!(dead["reason"], "crash_loop");
    assert_eq!(dead["stage"], "processing");
    assert_eq!(dead["attempts"], 2);
    let history = dead["history"].as_array().expect("history");
    assert_eq!(history.len(), 2, "{dead}");
    for h in history {
        assert_eq!(h["worker_id"], "w-doomed");
        assert_eq!(h["error"]["kind"], "lease_expired", "{h}");
    }
}
