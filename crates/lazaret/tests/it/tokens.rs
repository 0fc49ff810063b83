//! Tokens: producers read only their own jobs, and admins create, list and
//! revoke tokens through the API (audited, in force at once, kept across a
//! restart, refused while auth is off).

use serde_json::{Value, json};

use crate::harness::{Api, QUICK, Server, assert_error, id_text, job};

const SHOP: &str = "tok-shop-0123456789";
const BILLING: &str = "tok-billing-0123456789";
const WORKER: &str = "tok-worker-0123456789";
const OPERATOR: &str = "tok-operator-0123456789";
const ADMIN: &str = "tok-admin-0123456789";

/// Two producers, a worker, an operator and an admin (`root-bob`).
fn config() -> String {
    format!(
        r#"{QUICK}
[[tokens]]
name = "shop-frontend"
role = "producer"
token = "{SHOP}"

[[tokens]]
name = "billing"
role = "producer"
token = "{BILLING}"

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
    )
}

async fn start() -> Server {
    Server::start(&config()).await
}

fn job_path(id: &Value) -> String {
    format!("/v1/jobs/{}", id_text(id))
}

/// `POST /v1/tokens` that must be created (201); returns the reply body.
async fn create(admin: &Api, name: &str, role: &str) -> Value {
    let r = admin
        .post("/v1/tokens", &json!({"name": name, "role": role}))
        .await;
    r.expect(201).clone()
}

/// `GET /v1/tokens` that must succeed; returns its items.
async fn listed(admin: &Api) -> Vec<Value> {
    let r = admin.get("/v1/tokens").await;
    r.expect(200)["items"]
        .as_array()
        .unwrap_or_else(|| panic!("`items` is not a list: {}", r.text()))
        .clone()
}

fn names(items: &[Value]) -> Vec<&str> {
    items.iter().filter_map(|i| i["name"].as_str()).collect()
}

async fn audit(api: &Api) -> Vec<Value> {
    let r = api.get("/v1/audit").await;
    r.expect(200)["items"]
        .as_array()
        .expect("an items list")
        .clone()
}

#[tokio::test]
async fn a_producer_reads_only_the_jobs_it_enqueued() {
    let server = start().await;
    let shop = server.api_as(SHOP);
    let billing = server.api_as(BILLING);

    let mine = shop
        .enqueue_ok(&job("report", "acme", json!({"n": 1})))
        .await;
    let r = billing
        .post(
            "/v1/jobs/batch",
            &json!({"jobs": [job("invoice", "acme", json!({"n": 2}))]}),
        )
        .await;
    let theirs = r.expect(200)["results"][0]["id"].clone();
    assert!(
        !theirs.is_null(),
        "the batch job was admitted: {}",
        r.text()
    );

    // Each producer reads its own job, single or batch enqueued…
    assert_eq!(shop.job(&mine).await["type"], "report");
    assert_eq!(billing.job(&theirs).await["type"], "invoice");
    // …and not the other's, with a reason and what to do.
    for (who, id) in [(&shop, &theirs), (&billing, &mine)] {
        let e = assert_error(&who.get(&job_path(id)).await, 403, "FORBIDDEN", None);
        let message = e["message"].as_str().unwrap_or("");
        assert!(
            message.contains("enqueued by another token")
                && message.contains("reads only the jobs it enqueued"),
            "{e}"
        );
    }
    // An unknown id is still 404, not 403.
    assert_error(&shop.get("/v1/jobs/999999").await, 404, "NOT_FOUND", None);

    // Workers, operators and admins read every job.
    for tok in [WORKER, OPERATOR, ADMIN] {
        let api = server.api_as(tok);
        assert_eq!(api.job(&mine).await["id"], mine);
        assert_eq!(api.job(&theirs).await["id"], theirs);
    }
}

#[tokio::test]
async fn an_admin_creates_a_token_that_works_until_it_is_revoked() {
    let server = start().await;
    let admin = server.api_as(ADMIN);

    let created = create(&admin, "ci-producer", "producer").await;
    assert_eq!(created["name"], "ci-producer", "{created}");
    assert_eq!(created["role"], "producer", "{created}");
    assert!(created["created_at"].is_string(), "{created}");
    let secret = created["token"]
        .as_str()
        .unwrap_or_else(|| panic!("the secret is shown once: {created}"))
        .to_owned();
    assert!(secret.len() >= 32, "a long random secret: {secret}");

    // The new token works at once: it enqueues and reads its own job only.
    let ci = server.api_as(&secret);
    let id = ci.enqueue_ok(&job("report", "acme", json!({"n": 1}))).await;
    assert_eq!(ci.job(&id).await["id"], id);
    let shops = server
        .api_as(SHOP)
        .enqueue_ok(&job("report", "acme", json!({"n": 2})))
        .await;
    assert_error(&ci.get(&job_path(&shops)).await, 403, "FORBIDDEN", None);
    assert_error(
        &server.api_as(SHOP).get(&job_path(&id)).await,
        403,
        "FORBIDDEN",
        None,
    );
    // It has its role's rights, no more.
    assert_error(&ci.get("/v1/dead-letters").await, 403, "FORBIDDEN", None);

    // Listed with the config tokens, without any secret or hash.
    let r = admin.get("/v1/tokens").await;
    assert!(
        !r.text().contains(&secret),
        "the secret is never listed: {}",
        r.text()
    );
    let items = listed(&admin).await;
    assert_eq!(
        names(&items),
        vec![
            "shop-frontend",
            "billing",
            "mail-worker",
            "ops-alice",
            "root-bob",
            "ci-producer"
        ]
    );
    for item in &items {
        let keys: Vec<&str> = item
            .as_object()
            .expect("an object")
            .keys()
            .map(String::as_str)
            .collect();
        let mut keys = keys;
        keys.sort_unstable();
        assert_eq!(
            keys,
            vec!["created_at", "created_by", "name", "role", "source"],
            "{item}"
        );
    }
    let ops = &items[3];
    assert_eq!(ops["source"], "config", "{ops}");
    assert_eq!(ops["role"], "operator", "{ops}");
    assert!(
        ops["created_at"].is_null() && ops["created_by"].is_null(),
        "{ops}"
    );
    let ci_item = &items[5];
    assert_eq!(ci_item["source"], "api", "{ci_item}");
    assert_eq!(ci_item["role"], "producer", "{ci_item}");
    assert_eq!(ci_item["created_by"], "root-bob", "{ci_item}");
    assert_eq!(ci_item["created_at"], created["created_at"], "{ci_item}");

    // Revoked: the next request with it is 401, and it is no longer listed.
    let r = admin.delete("/v1/tokens/ci-producer").await;
    assert_eq!(
        r.expect(200),
        &json!({"name": "ci-producer", "revoked": true})
    );
    assert_error(
        &ci.enqueue(&job("report", "acme", json!({}))).await,
        401,
        "UNAUTHORIZED",
        None,
    );
    assert_error(&ci.get(&job_path(&id)).await, 401, "UNAUTHORIZED", None);
    assert!(!names(&listed(&admin).await).contains(&"ci-producer"));
    // Revoking it again: there is no such token any more.
    assert_error(
        &admin.delete("/v1/tokens/ci-producer").await,
        404,
        "NOT_FOUND",
        None,
    );

    // Both changes are audited under the admin's name, without the secret.
    let r = admin.get("/v1/audit").await;
    assert!(!r.text().contains(&secret), "{}", r.text());
    let items = audit(&admin).await;
    let find = |action: &str| {
        items
            .iter()
            .find(|i| i["action"] == action)
            .unwrap_or_else(|| panic!("a {action} entry: {items:?}"))
            .clone()
    };
    let created_entry = find("token_create");
    assert_eq!(created_entry["actor"], "root-bob", "{created_entry}");
    assert_eq!(created_entry["count"], 1, "{created_entry}");
    assert_eq!(
        created_entry["request"],
        json!({"name": "ci-producer", "role": "producer"})
    );
    let revoked_entry = find("token_revoke");
    assert_eq!(revoked_entry["actor"], "root-bob", "{revoked_entry}");
    assert_eq!(revoked_entry["count"], 1, "{revoked_entry}");
    assert_eq!(revoked_entry["request"], json!({"name": "ci-producer"}));
    assert_eq!(
        items
            .iter()
            .filter(|i| i["action"] == "token_revoke")
            .count(),
        1,
        "the refused second revoke is not audited: {items:?}"
    );
}

#[tokio::test]
async fn an_api_admin_token_manages_tokens_and_is_named_in_the_audit_log() {
    let server = start().await;
    let root = server.api_as(ADMIN);
    let deputy = create(&root, "deputy", "admin").await;
    let deputy = server.api_as(deputy["token"].as_str().expect("a secret"));

    let worker = create(&deputy, "night-worker", "worker").await;
    let night = server.api_as(worker["token"].as_str().expect("a secret"));
    let r = night
        .post("/v1/leases", &json!({"worker_id": "w", "max_jobs": 1}))
        .await;
    r.expect(200);
    let listed_worker = listed(&root)
        .await
        .into_iter()
        .find(|i| i["name"] == "night-worker")
        .expect("listed");
    assert_eq!(listed_worker["created_by"], "deputy", "{listed_worker}");

    deputy.delete("/v1/tokens/night-worker").await.expect(200);
    let items = audit(&root).await;
    let actors: Vec<(&str, &str)> = items
        .iter()
        .filter(|i| {
            i["action"]
                .as_str()
                .is_some_and(|a| a.starts_with("token_"))
        })
        .map(|i| {
            (
                i["action"].as_str().unwrap_or(""),
                i["actor"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        actors,
        vec![
            ("token_revoke", "deputy"),
            ("token_create", "deputy"),
            ("token_create", "root-bob"),
        ],
        "newest first"
    );
}

#[tokio::test]
async fn token_requests_that_cannot_be_honoured_are_refused() {
    let server = start().await;
    let admin = server.api_as(ADMIN);
    create(&admin, "ci-producer", "producer").await;

    // A name already in use, by an API token or a config token: 409 CONFLICT.
    for name in ["ci-producer", "ops-alice"] {
        let r = admin
            .post("/v1/tokens", &json!({"name": name, "role": "worker"}))
            .await;
        let e = assert_error(&r, 409, "CONFLICT", None);
        assert!(
            e["message"].as_str().unwrap_or("").contains(name),
            "the message names the clash: {e}"
        );
    }
    // Bad names and roles: 400 BAD_REQUEST.
    for body in [
        json!({"name": "x", "role": "root"}),
        json!({"name": "x"}),
        json!({"name": "", "role": "worker"}),
        json!({"role": "worker"}),
        json!({"name": "a/b", "role": "worker"}),
        json!({"name": "with space", "role": "worker"}),
    ] {
        let r = admin.post("/v1/tokens", &body).await;
        assert_error(&r, 400, "BAD_REQUEST", None);
    }
    let r = admin.post_raw("/v1/tokens", "{not json").await;
    assert_error(&r, 400, "BAD_REQUEST", None);

    // A config token cannot be revoked here: it lives in the config file.
    let e = assert_error(
        &admin.delete("/v1/tokens/ops-alice").await,
        400,
        "BAD_REQUEST",
        None,
    );
    assert!(
        e["message"].as_str().unwrap_or("").contains("config file"),
        "{e}"
    );
    assert_eq!(
        server.api_as(OPERATOR).get("/v1/audit").await.status,
        200,
        "the config token still works"
    );
    // Unknown: 404.
    assert_error(
        &admin.delete("/v1/tokens/nobody").await,
        404,
        "NOT_FOUND",
        None,
    );
    // Nothing refused changed the list.
    assert_eq!(listed(&admin).await.len(), 6);

    // Only admins manage tokens.
    for tok in [SHOP, WORKER, OPERATOR] {
        let api = server.api_as(tok);
        let create = api
            .post("/v1/tokens", &json!({"name": "sneaky", "role": "admin"}))
            .await;
        assert_error(&create, 403, "FORBIDDEN", None);
        assert_error(&api.get("/v1/tokens").await, 403, "FORBIDDEN", None);
        assert_error(
            &api.delete("/v1/tokens/ci-producer").await,
            403,
            "FORBIDDEN",
            None,
        );
    }
    assert_error(
        &server.api().get("/v1/tokens").await,
        401,
        "UNAUTHORIZED",
        None,
    );
    assert!(!names(&listed(&admin).await).contains(&"sneaky"));
}

#[tokio::test]
async fn an_api_token_survives_a_restart_and_so_does_its_revocation() {
    let mut server = start().await;
    let created = create(&server.api_as(ADMIN), "ci-producer", "producer").await;
    let secret = created["token"].as_str().expect("a secret").to_owned();
    let id = server
        .api_as(&secret)
        .enqueue_ok(&job("report", "acme", json!({})))
        .await;

    server.restart().await;
    let ci = server.api_as(&secret);
    assert_eq!(ci.job(&id).await["id"], id, "it still reads its own job");
    ci.enqueue_ok(&job("report", "acme", json!({}))).await;
    let admin = server.api_as(ADMIN);
    let item = listed(&admin)
        .await
        .into_iter()
        .find(|i| i["name"] == "ci-producer")
        .expect("still listed");
    assert_eq!(item["created_at"], created["created_at"], "{item}");
    assert_eq!(item["created_by"], "root-bob", "{item}");

    admin.delete("/v1/tokens/ci-producer").await.expect(200);
    server.restart().await;
    assert_error(
        &server
            .api_as(&secret)
            .enqueue(&job("report", "acme", json!({})))
            .await,
        401,
        "UNAUTHORIZED",
        None,
    );
}

#[tokio::test]
async fn without_configured_tokens_the_token_endpoints_say_how_to_turn_auth_on() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let replies = [
        api.post("/v1/tokens", &json!({"name": "ci", "role": "admin"}))
            .await,
        api.get("/v1/tokens").await,
        api.delete("/v1/tokens/ci").await,
    ];
    for r in &replies {
        let e = assert_error(r, 400, "BAD_REQUEST", None);
        let message = e["message"].as_str().unwrap_or("");
        assert!(
            message.contains("auth is off") && message.contains("[[tokens]]"),
            "{e}"
        );
    }
    // Everyone is still an anonymous admin: jobs are readable as before.
    let id = api.enqueue_ok(&job("report", "acme", json!({}))).await;
    assert_eq!(api.job(&id).await["id"], id);
    assert!(
        audit(&api)
            .await
            .iter()
            .all(|i| i["action"] != "token_create"),
        "nothing was created"
    );
}
