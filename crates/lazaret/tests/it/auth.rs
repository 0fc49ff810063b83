//! Auth: bearer tokens with roles, purge for admins only, and an audit log that names the actor.

use serde_json::{Value, json};

use crate::harness::{Api, QUICK, Server, assert_error, id_text, job, lease_req};

const PRODUCER: &str = "tok-producer-0123456789";
const WORKER: &str = "tok-worker-0123456789";
const OPERATOR: &str = "tok-operator-0123456789";
const ADMIN: &str = "tok-admin-0123456789";

async fn start() -> Server {
    let config = format!(
        r#"{QUICK}
[[tokens]]
name = "shop-frontend"
role = "producer"
token = "{PRODUCER}"

[[tokens]]
name = "mail-worker"
role = "worker"
token = "{WORKER}"

[[tokens]]
name = "ops-alice"
role = "operator"
token = "{OPERATOR}"

[[tokens]]
name = "root-bob"
role = "admin"
token = "{ADMIN}"
"#
    );
    Server::start(&config).await
}

/// A job enqueued by the producer, leased and failed for good by the worker;
/// returns (job id, dead letter id).
async fn dead_letter(server: &Server, n: u32) -> (Value, Value) {
    let producer = server.api_as(PRODUCER);
    let worker = server.api_as(WORKER);
    let id = producer
        .enqueue_ok(&job("report", "acme", json!({"n": n})))
        .await;
    let leased = worker.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
    worker
        .fail(
            &id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "bad", "message": "no"}),
        )
        .await
        .expect(200);
    let dead = server.api_as(OPERATOR).dead_letter_of(&id).await["id"].clone();
    (id, dead)
}

#[tokio::test]
async fn a_missing_or_unknown_token_is_unauthorized() {
    let server = start().await;
    let j = job("report", "acme", json!({}));
    assert_error(&server.api().enqueue(&j).await, 401, "UNAUTHORIZED", None);
    assert_error(
        &server.api_as("tok-nobody").enqueue(&j).await,
        401,
        "UNAUTHORIZED",
        None,
    );
    let r = server
        .api()
        .post("/v1/leases", &lease_req("w", 1, 1000))
        .await;
    assert_error(&r, 401, "UNAUTHORIZED", None);
    let r = server.api().get("/v1/dead-letters").await;
    assert_error(&r, 401, "UNAUTHORIZED", None);
}

#[tokio::test]
async fn healthz_and_metrics_need_no_token() {
    let server = start().await;
    assert_eq!(server.api().get("/healthz").await.status, 200);
    let r = server.api().get("/metrics").await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test]
async fn each_role_may_do_its_own_part_only() {
    let server = start().await;
    let producer = server.api_as(PRODUCER);
    let worker = server.api_as(WORKER);
    let operator = server.api_as(OPERATOR);

    let id = producer.enqueue_ok(&job("report", "acme", json!({}))).await;
    // A producer reads its own job, but cannot lease or read dead letters.
    producer.job(&id).await;
    let r = producer
        .post("/v1/leases", &lease_req("w", 1, 30_000))
        .await;
    assert_error(&r, 403, "FORBIDDEN", None);
    assert_error(
        &producer.get("/v1/dead-letters").await,
        403,
        "FORBIDDEN",
        None,
    );

    // A worker leases and fails, but cannot redrive.
    let leased = worker.lease_one(&lease_req("w", 1, 30_000)).await;
    worker
        .fail(
            &id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "bad", "message": "no"}),
        )
        .await
        .expect(200);
    let redrive = json!({"filter": {"reason": "permanent"}});
    assert_error(
        &worker.post("/v1/dead-letters/redrive", &redrive).await,
        403,
        "FORBIDDEN",
        None,
    );
    assert_error(
        &worker.get("/v1/dead-letters").await,
        403,
        "FORBIDDEN",
        None,
    );

    // An operator reads dead letters and their payloads, but cannot purge.
    let dead = operator.dead_letter_of(&id).await["id"].clone();
    let r = operator
        .get(&format!("/v1/dead-letters/{}/payload", id_text(&dead)))
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let purge = json!({"ids": [dead], "confirm": true});
    assert_error(
        &operator.post("/v1/dead-letters/purge", &purge).await,
        403,
        "FORBIDDEN",
        None,
    );
    assert_eq!(operator.dead_letters("").await.len(), 1, "nothing purged");
    // Nor can a producer or a worker.
    for who in [&producer, &worker] {
        assert_error(
            &who.post("/v1/dead-letters/purge", &purge).await,
            403,
            "FORBIDDEN",
            None,
        );
    }
}

#[tokio::test]
async fn purge_needs_an_admin_and_confirm_true() {
    let server = start().await;
    let admin = server.api_as(ADMIN);
    let (_, dead) = dead_letter(&server, 1).await;

    for unconfirmed in [
        json!({"ids": [dead]}),
        json!({"ids": [dead], "confirm": false}),
    ] {
        let r = admin.post("/v1/dead-letters/purge", &unconfirmed).await;
        assert_error(&r, 400, "BAD_REQUEST", None);
    }
    assert_eq!(admin.dead_letters("").await.len(), 1, "nothing purged yet");

    // A dry run names what would go and deletes nothing, confirmed or not.
    for rehearsal in [
        json!({"ids": [dead, "99999"], "dry_run": true}),
        json!({"ids": [dead], "dry_run": true, "confirm": true}),
    ] {
        let r = admin.post("/v1/dead-letters/purge", &rehearsal).await;
        let b = r.expect(200);
        assert_eq!(b["dry_run"], true);
        assert_eq!(b["purged"], 0);
        assert_eq!(b["matched"], 1);
        assert_eq!(b["ids"], json!([id_text(&dead)]));
    }
    let r = admin
        .post(
            "/v1/dead-letters/purge",
            &json!({"ids": [dead, "99999"], "dry_run": true}),
        )
        .await;
    assert_eq!(r.expect(200)["not_found"], json!(["99999"]));
    assert_eq!(
        admin.dead_letters("").await.len(),
        1,
        "a dry run purges nothing"
    );

    let r = admin
        .post(
            "/v1/dead-letters/purge",
            &json!({"ids": [dead], "confirm": true}),
        )
        .await;
    assert_eq!(r.expect(200)["purged"], 1);
    assert!(admin.dead_letters("").await.is_empty());
    let r = admin
        .get(&format!("/v1/dead-letters/{}", id_text(&dead)))
        .await;
    assert_error(&r, 404, "NOT_FOUND", None);
}

async fn audit(api: &Api) -> Vec<Value> {
    let r = api.get("/v1/audit").await;
    r.expect(200)["items"]
        .as_array()
        .expect("an items list")
        .clone()
}

#[tokio::test]
async fn the_audit_log_records_redrive_and_purge_with_the_actors_name() {
    let server = start().await;
    let operator = server.api_as(OPERATOR);
    let admin = server.api_as(ADMIN);

    let (job_id, _) = dead_letter(&server, 1).await;
    let r = operator
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"reason": "permanent"}}),
        )
        .await;
    assert_eq!(r.expect(200)["redriven"], 1);
    // Let it fail for good again, then purge it.
    let worker = server.api_as(WORKER);
    let leased = worker.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], job_id);
    worker
        .fail(
            &job_id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "bad", "message": "still no"}),
        )
        .await
        .expect(200);
    let r = admin
        .post(
            "/v1/dead-letters/purge",
            &json!({"filter": {"reason": "permanent"}, "confirm": true}),
        )
        .await;
    assert_eq!(r.expect(200)["purged"], 1);

    let items = audit(&operator).await;
    let redrive = items
        .iter()
        .find(|i| i["action"] == "redrive")
        .unwrap_or_else(|| panic!("a redrive entry: {items:?}"));
    assert_eq!(redrive["actor"], "ops-alice", "{redrive}");
    assert_eq!(redrive["count"], 1, "{redrive}");
    assert!(
        redrive["at"].is_string() && !redrive["request"].is_null(),
        "{redrive}"
    );
    let purge = items
        .iter()
        .find(|i| i["action"] == "purge")
        .unwrap_or_else(|| panic!("a purge entry: {items:?}"));
    assert_eq!(purge["actor"], "root-bob", "{purge}");
    assert_eq!(purge["count"], 1, "{purge}");

    // Pause and resume are audited too.
    operator
        .post("/v1/pause", &json!({"type": "report"}))
        .await
        .expect(200);
    operator
        .post("/v1/resume", &json!({"type": "report"}))
        .await
        .expect(200);
    let items = audit(&operator).await;
    for action in ["pause", "resume"] {
        let entry = items
            .iter()
            .find(|i| i["action"] == action)
            .unwrap_or_else(|| panic!("a {action} entry: {items:?}"));
        assert_eq!(entry["actor"], "ops-alice", "{entry}");
    }

    // Admins read it too; producers and workers do not.
    assert!(!audit(&admin).await.is_empty());
    for tok in [PRODUCER, WORKER] {
        let r = server.api_as(tok).get("/v1/audit").await;
        assert_error(&r, 403, "FORBIDDEN", None);
    }
}
