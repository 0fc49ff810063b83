//! `GET /openapi.json` (issue #33, part 3): an OpenAPI 3 document of `/v1`
//! generated from the route table, served without a token, and committed
//! as `docs/openapi.json`.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use http_body_util::BodyExt as _;
use lazaret_core::FairScheduler;
use lazaret_server::api::openapi::document;
use lazaret_server::api::routes::{Access, BodyCap, Spec, table};
use lazaret_server::app::App;
use lazaret_server::auth::Action;
use lazaret_server::config::ServerConfig;
use lazaret_store::{Durability, PolicyDecider, SqliteStore};
use serde_json::Value;
use tower::ServiceExt as _;

const TOKENS: &str = r#"
[[tokens]]
name = "a"
role = "admin"
token = "admin-secret"
"#;

/// The command that rewrites `docs/openapi.json`.
const REFRESH: &str = "LAZARET_UPDATE_OPENAPI=1 cargo test -p lazaret-server --test it openapi";

fn specs(config: &ServerConfig) -> Vec<Spec> {
    table::<SqliteStore>(config)
        .iter()
        .map(|r| r.spec().clone())
        .collect()
}

/// Every way `doc` fails the checks the outside tests make: `openapi` 3.x,
/// every `/v1` route of `specs` under `paths` with responses, every `$ref`
/// resolving, and what the table says (role, body cap) carried over.
fn problems(doc: &Value, specs: &[Spec]) -> Vec<String> {
    let mut out = Vec::new();
    if !doc["openapi"].as_str().is_some_and(|v| v.starts_with("3.")) {
        out.push(format!("openapi is {}, not 3.x", doc["openapi"]));
    }
    let v1: Vec<&Spec> = specs
        .iter()
        .filter(|s| s.path.starts_with("/v1/"))
        .collect();
    for s in &v1 {
        let op = &doc["paths"][s.path][s.method.as_str().to_ascii_lowercase()];
        let name = format!("{} {}", s.method, s.path);
        if !op.is_object() {
            out.push(format!("{name}: not in paths"));
            continue;
        }
        if op["responses"].as_object().is_none_or(|r| r.is_empty()) {
            out.push(format!("{name}: no responses"));
        }
        match s.access {
            Access::Open => {}
            _ => {
                if op["responses"]["401"].is_null() {
                    out.push(format!("{name}: needs a token but documents no 401"));
                }
                if op["x-lazaret-roles"].as_array().is_none_or(Vec::is_empty) {
                    out.push(format!("{name}: no x-lazaret-roles"));
                }
            }
        }
        match s.body {
            BodyCap::None => {
                if !op["requestBody"].is_null() {
                    out.push(format!("{name}: reads no body but documents one"));
                }
            }
            BodyCap::Buffered(cap) | BodyCap::Streamed(cap) => {
                if op["x-lazaret-body-max"] != cap {
                    out.push(format!("{name}: x-lazaret-body-max is not {cap}"));
                }
                if op["requestBody"]["content"]["application/json"]["schema"].is_null() {
                    out.push(format!("{name}: no request body schema"));
                }
                if op["responses"]["413"].is_null() {
                    out.push(format!("{name}: has a body cap but documents no 413"));
                }
            }
        }
        for param in s.path.split('/').filter_map(|p| p.strip_prefix('{')) {
            let param = param.trim_end_matches('}');
            let declared = op["parameters"]
                .as_array()
                .is_some_and(|ps| ps.iter().any(|p| p["name"] == param && p["in"] == "path"));
            if !declared {
                out.push(format!("{name}: path parameter {param} not declared"));
            }
        }
    }
    let operations: usize = doc["paths"]
        .as_object()
        .map(|p| {
            p.values()
                .filter_map(Value::as_object)
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0);
    if operations != v1.len() {
        out.push(format!(
            "{operations} operations for {} /v1 routes",
            v1.len()
        ));
    }
    let mut refs = Vec::new();
    collect_refs(doc, &mut refs);
    if refs.is_empty() {
        out.push("no $ref at all: the shared error envelope is not used".into());
    }
    for r in refs {
        let resolved = r.strip_prefix('#').and_then(|pointer| doc.pointer(pointer));
        if resolved.is_none() {
            out.push(format!("$ref {r} does not resolve"));
        }
    }
    out
}

fn collect_refs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            if let Some(Value::String(r)) = m.get("$ref") {
                out.push(r.clone());
            }
            m.values().for_each(|v| collect_refs(v, out));
        }
        Value::Array(a) => a.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}

#[tokio::test]
async fn the_served_document_describes_every_v1_route_of_the_table() {
    let dir = tempfile::TempDir::new().unwrap();
    let config = ServerConfig::from_toml_str(TOKENS, dir.path()).expect("a valid config");
    let scheduler = FairScheduler::new(config.scheduler.clone()).expect("scheduler");
    let decider = Arc::new(PolicyDecider::new(config.policies.clone()));
    let store = SqliteStore::open(dir.path(), Durability::Normal, scheduler, decider).unwrap();
    let app = App::new(store, config);
    // No token: the document is open, like /healthz and /metrics.
    let req = Request::get("/openapi.json").body(Body::empty()).unwrap();
    let resp = lazaret_server::api::router(Arc::clone(&app))
        .oneshot(req)
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()
            .get("content-type")
            .map(|v| v.to_str().unwrap()),
        Some("application/json")
    );
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    let doc: Value = serde_json::from_slice(&body).expect("the document is JSON");
    let specs = specs(&app.config);
    let found = problems(&doc, &specs);
    assert!(found.is_empty(), "{}", found.join("\n"));
    // The caps are this server's: a corrected redrive's is the admission cap.
    let corrected = &doc["paths"]["/v1/dead-letters/{id}/redrive"]["post"];
    assert_eq!(
        corrected["x-lazaret-body-max"],
        app.config.admission.body_bytes_max()
    );
    // A request schema is derived from the handler's own type.
    let enqueue =
        &doc["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"];
    let target = enqueue["$ref"]
        .as_str()
        .expect("a $ref to the enqueue body");
    let props = &doc.pointer(&target[1..]).unwrap()["properties"];
    for field in [
        "type",
        "tenant",
        "lane",
        "payload",
        "idempotency_key",
        "schema_version",
        "delay_ms",
    ] {
        assert!(
            props.get(field).is_some(),
            "enqueue body has no {field}: {props}"
        );
    }
    // Roles come from the table.
    assert_eq!(
        doc["paths"]["/v1/dead-letters/purge"]["post"]["x-lazaret-roles"],
        serde_json::json!(["admin"])
    );
}

/// The checks catch what they claim to: a route missing from the document
/// and a dangling `$ref`.
#[test]
fn the_checks_find_a_missing_route_and_a_dangling_ref() {
    let specs = specs(&ServerConfig::default());
    let mut doc = document(&specs);
    assert!(problems(&doc, &specs).is_empty());
    doc["paths"].as_object_mut().unwrap().remove("/v1/leases");
    doc["components"]["responses"]
        .as_object_mut()
        .unwrap()
        .remove("NotFound");
    let found = problems(&doc, &specs).join("\n");
    assert!(found.contains("POST /v1/leases: not in paths"), "{found}");
    assert!(
        found.contains("#/components/responses/NotFound does not resolve"),
        "{found}"
    );
}

/// A route the generator has never heard of (a new row of the table) is
/// documented from its row alone: roles, cap, path parameter, errors.
#[test]
fn a_new_row_of_the_table_is_documented_without_another_edit() {
    let mut specs = specs(&ServerConfig::default());
    specs.push(Spec {
        method: Method::POST,
        path: "/v1/not-yet/{id}/described",
        access: Access::May(Action::Operate),
        body: BodyCap::Buffered(4096),
    });
    let doc = document(&specs);
    assert!(
        problems(&doc, &specs).is_empty(),
        "{:?}",
        problems(&doc, &specs)
    );
    let op = &doc["paths"]["/v1/not-yet/{id}/described"]["post"];
    assert_eq!(
        op["x-lazaret-roles"],
        serde_json::json!(["operator", "admin"])
    );
    assert_eq!(op["x-lazaret-body-max"], 4096);
    assert_eq!(op["summary"], "POST /v1/not-yet/{id}/described");
    assert_eq!(
        op["requestBody"]["content"]["application/json"]["schema"]["type"],
        "object"
    );
}

/// `docs/openapi.json` is the document of a server with the default config.
#[test]
fn openapi_document_matches_docs() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
    let doc = document(&specs(&ServerConfig::default()));
    let text = serde_json::to_string_pretty(&doc).unwrap() + "\n";
    if std::env::var_os("LAZARET_UPDATE_OPENAPI").is_some() {
        std::fs::write(&path, &text).expect("docs/openapi.json is writable");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let committed: Value = serde_json::from_str(&committed).unwrap_or(Value::Null);
    assert!(
        committed == doc,
        "docs/openapi.json is not the document the route table makes now; refresh it with\n  {REFRESH}\nand commit it"
    );
}
