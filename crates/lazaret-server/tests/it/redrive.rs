//! Redrives through the router (issue 30, parts 3 to 5): a dead letter's
//! lineage, jobs held for a person after `redrives_max` redrives, and
//! redirects to another type and lane with admission applied again.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt as _;
use lazaret_core::FairScheduler;
use lazaret_server::app::App;
use lazaret_server::config::ServerConfig;
use lazaret_store::{Durability, PolicyDecider, SqliteStore};
use serde_json::{Value, json};
use tower::ServiceExt as _;

const CONFIG: &str = r#"
redrives_max = 1

[types.repair]
schemas = { 1 = "repair.v1.json" }

[[tokens]]
name = "p"
role = "producer"
token = "producer-secret"

[[tokens]]
name = "w"
role = "worker"
token = "worker-secret"

[[tokens]]
name = "ops-alice"
role = "operator"
token = "operator-secret"
"#;

const PRODUCER: &str = "producer-secret";
const WORKER: &str = "worker-secret";
const OPERATOR: &str = "operator-secret";

fn app(dir: &std::path::Path) -> Arc<App<SqliteStore>> {
    std::fs::write(
        dir.join("repair.v1.json"),
        r#"{"type": "object", "required": ["order"]}"#,
    )
    .unwrap();
    let config = ServerConfig::from_toml_str(CONFIG, dir).expect("a valid config");
    let scheduler = FairScheduler::new(config.scheduler.clone()).expect("scheduler");
    let decider = Arc::new(PolicyDecider::new(config.policies.clone()));
    let data = dir.join("data");
    std::fs::create_dir_all(&data).unwrap();
    let store = SqliteStore::open(&data, Durability::Normal, scheduler, decider).expect("a store");
    App::new(store, config)
}

async fn call(
    app: &Arc<App<SqliteStore>>,
    method: Method,
    path: &str,
    secret: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("authorization", format!("Bearer {secret}"));
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req
        .body(body.map_or_else(Body::empty, |b| Body::from(b.to_string())))
        .expect("a request");
    let resp = lazaret_server::api::router(Arc::clone(app))
        .oneshot(req)
        .await
        .expect("the router answers");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("a body").to_bytes();
    let v = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).expect("JSON")
    };
    (status, v)
}

async fn post(app: &Arc<App<SqliteStore>>, path: &str, secret: &str, body: Value) -> Value {
    let (status, v) = call(app, Method::POST, path, secret, Some(body)).await;
    assert!(status.is_success(), "POST {path}: {status} {v}");
    v
}

async fn get(app: &Arc<App<SqliteStore>>, path: &str) -> Value {
    let (status, v) = call(app, Method::GET, path, OPERATOR, None).await;
    assert_eq!(status, StatusCode::OK, "GET {path}: {v}");
    v
}

async fn enqueue(app: &Arc<App<SqliteStore>>, job_type: &str, payload: Value) -> String {
    let v = post(
        app,
        "/v1/jobs",
        PRODUCER,
        json!({"type": job_type, "tenant": "acme", "payload": payload}),
    )
    .await;
    v["id"].as_str().expect("a job id").to_owned()
}

/// Leases the one ready job of `job_type` in `lane`, fails it permanently
/// with `message`, and answers its new dead letter.
async fn fail(app: &Arc<App<SqliteStore>>, job_type: &str, lane: &str, message: &str) -> Value {
    let leased = post(
        app,
        "/v1/leases",
        WORKER,
        json!({"worker_id": "w-1", "types": [job_type], "lanes": [lane], "max_jobs": 1}),
    )
    .await;
    let job = &leased["jobs"][0];
    let id = job["id"].as_str().expect("a leased job");
    let v = post(
        app,
        &format!("/v1/jobs/{id}/fail"),
        WORKER,
        json!({"lease_token": job["lease_token"],
               "error": {"class": "permanent", "kind": "bad_input", "message": message}}),
    )
    .await;
    assert_eq!(v["state"], "dead_lettered");
    let page = get(app, &format!("/v1/dead-letters?job_id={id}")).await;
    let dl = page["items"][0]["id"].as_str().expect("its dead letter");
    get(app, &format!("/v1/dead-letters/{dl}")).await
}

#[tokio::test]
async fn a_job_failing_again_after_redrives_max_is_held_until_a_person_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(dir.path());
    let job = enqueue(&app, "resize", json!({"n": 1})).await;
    let first = fail(&app, "resize", "default", "order 17 failed").await;
    assert_eq!(first["held"], false);
    assert_eq!(first["lineage"], json!([]));

    let r1 = post(
        &app,
        "/v1/dead-letters/redrive",
        OPERATOR,
        json!({"filter": {"type": "resize"}}),
    )
    .await;
    assert_eq!(
        (r1["redriven"].as_u64(), r1["held_skipped"].as_u64()),
        (Some(1), Some(0))
    );
    let second = fail(&app, "resize", "default", "timeout talking to s3").await;
    assert_eq!(second["job_id"].as_str(), Some(job.as_str()));
    assert_eq!(second["redrive_count"], 1);
    assert_eq!(
        second["held"], true,
        "redriven redrives_max (1) times: held"
    );
    assert_eq!(
        second["lineage"],
        json!([{
            "redrive_id": r1["redrive_id"],
            "at": second["lineage"][0]["at"],
            "actor": "ops-alice",
            "from_group": first["group_id"],
            "payload_edited": false,
            "to": null,
            "outcome": {"state": "dead_lettered", "failed_again": true,
                        "group": second["group_id"], "current": true},
        }])
    );
    assert!(second["lineage"][0]["at"].is_string());
    let group = second["group_id"].as_str().unwrap().to_owned();
    let groups = get(&app, "/v1/dead-letters/groups").await;
    let g = groups["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["id"] == group.as_str())
        .expect("its group");
    assert_eq!(
        (g["count"].as_u64(), g["held"].as_u64()),
        (Some(1), Some(1))
    );

    // Filters and groups skip it, and say so (the answer, the audit entry).
    for body in [
        json!({"filter": {"type": "resize"}}),
        json!({"filter": {"group": group}}),
        json!({"all": true, "dry_run": true}),
    ] {
        let r = post(&app, "/v1/dead-letters/redrive", OPERATOR, body.clone()).await;
        assert_eq!(
            (
                r["matched"].as_u64(),
                r["redriven"].as_u64(),
                r["held_skipped"].as_u64()
            ),
            (Some(0), Some(0), Some(1)),
            "{body}: {r}"
        );
    }
    let audit = get(&app, "/v1/audit?action=redrive").await;
    assert_eq!(audit["items"][0]["request"]["held_skipped"], 1);
    assert_eq!(audit["items"][0]["count"], 0);
    assert_eq!(
        get(
            &app,
            &format!("/v1/dead-letters/{}", second["id"].as_str().unwrap())
        )
        .await["id"],
        second["id"],
        "still there"
    );

    // Named by id, it goes.
    let r3 = post(
        &app,
        "/v1/dead-letters/redrive",
        OPERATOR,
        json!({"ids": [second["id"]]}),
    )
    .await;
    assert_eq!(
        (r3["redriven"].as_u64(), r3["held_skipped"].as_u64()),
        (Some(1), Some(0))
    );
    let third = fail(&app, "resize", "default", "still broken").await;
    let lineage = third["lineage"].as_array().unwrap();
    assert_eq!(lineage.len(), 2);
    assert_eq!(
        lineage[0]["outcome"],
        json!({"state": "dead_lettered", "failed_again": true,
               "group": second["group_id"], "current": false})
    );
    assert_eq!(lineage[1]["redrive_id"], r3["redrive_id"]);
    assert_eq!(lineage[1]["from_group"], second["group_id"]);
    assert_eq!(lineage[1]["outcome"]["current"], true);
}

#[tokio::test]
async fn a_redirect_applies_the_new_types_admission_and_is_in_the_lineage() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(dir.path());
    let good = enqueue(&app, "resize", json!({"order": 7})).await;
    let _bad = enqueue(&app, "resize", json!({"nope": 1})).await;
    let a = fail(&app, "resize", "default", "upstream said no").await;
    let b = fail(&app, "resize", "default", "upstream said no").await;
    let (good_dl, bad_dl) = if a["job_id"] == good.as_str() {
        (a, b)
    } else {
        (b, a)
    };

    let ask = |dry_run: bool| {
        json!({"filter": {"type": "resize"}, "to": {"type": "repair", "lane": "fix"},
               "dry_run": dry_run})
    };
    let dry = post(&app, "/v1/dead-letters/redrive", OPERATOR, ask(true)).await;
    assert_eq!(
        (dry["matched"].as_u64(), dry["redriven"].as_u64()),
        (Some(2), Some(0))
    );
    assert_eq!(dry["to"], json!({"type": "repair", "lane": "fix"}));
    let refused = dry["refused"].as_array().unwrap();
    assert_eq!(refused.len(), 1, "{dry}");
    assert_eq!(refused[0]["dead_letter_id"], bad_dl["id"]);
    assert_eq!(
        (refused[0]["code"].as_str(), refused[0]["reason"].as_str()),
        (Some("POISON"), Some("schema_invalid"))
    );
    for item in dry["items"].as_array().unwrap() {
        assert_eq!(item["to"], json!({"type": "repair", "lane": "fix"}));
        assert_eq!(
            item["refused"].is_null(),
            item["dead_letter_id"] == good_dl["id"],
            "{item}"
        );
    }

    let done = post(&app, "/v1/dead-letters/redrive", OPERATOR, ask(false)).await;
    assert_eq!(done["redriven"], 1, "{done}");
    assert_eq!(done["job_ids"], json!([good]));
    assert_eq!(done["refused"][0]["dead_letter_id"], bad_dl["id"]);
    // The refused one stays where it was.
    get(
        &app,
        &format!("/v1/dead-letters/{}", bad_dl["id"].as_str().unwrap()),
    )
    .await;
    let job = get(&app, &format!("/v1/jobs/{good}")).await;
    assert_eq!(
        (job["type"].as_str(), job["lane"].as_str()),
        (Some("repair"), Some("fix"))
    );
    assert_eq!(job["state"], "queued");

    let again = fail(&app, "repair", "fix", "repair failed too").await;
    assert_eq!(again["type"], "repair");
    assert_eq!(
        again["lineage"][0]["to"],
        json!({"type": "repair", "lane": "fix"})
    );
    assert_eq!(again["lineage"][0]["from_group"], good_dl["group_id"]);
}

#[tokio::test]
async fn a_redirect_is_refused_when_malformed_or_asked_of_a_purge() {
    let dir = tempfile::tempdir().unwrap();
    let app = app(dir.path());
    for (path, body) in [
        ("/v1/dead-letters/redrive", json!({"all": true, "to": {}})),
        (
            "/v1/dead-letters/redrive",
            json!({"all": true, "to": {"type": ""}}),
        ),
        (
            "/v1/dead-letters/redrive",
            json!({"all": true, "to": {"queue": "x"}}),
        ),
        (
            "/v1/dead-letters/archive",
            json!({"all": true, "to": {"lane": "x"}}),
        ),
    ] {
        let (status, v) = call(&app, Method::POST, path, OPERATOR, Some(body.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {v}");
        assert_eq!(v["error"]["code"], "BAD_REQUEST");
    }
}
