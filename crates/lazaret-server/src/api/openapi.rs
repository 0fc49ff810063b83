//! `GET /openapi.json`: an OpenAPI 3.0 document of `/v1`, generated from
//! the route table ([`super::routes::table`]).
//!
//! Every path, method, role and body cap comes from the table, so a route
//! added there is in the document without a second edit. What the table
//! does not say (a summary, the request and query types, the 2xx answers,
//! the errors only some routes give) is looked up here by method and path
//! ([`described`]); a route without an entry still gets a complete
//! operation (its body an untyped object). Request and query schemas are
//! derived from the handlers' own types with `schemars`, so a field added
//! to a body is in the document too. Replies are described objects, not
//! yet typed (docs/api.md, The API description).
//!
//! `docs/openapi.json` is this document for the default config; the test
//! `openapi_document_matches_docs` fails when it drifts and says how to
//! refresh it.

use axum::Json;
use axum::extract::State;
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use lazaret_store::Store;
use schemars::generate::{SchemaGenerator, SchemaSettings};
use schemars::{JsonSchema, Schema};
use serde_json::{Map, Value, json};

use super::routes::{Access, BodyCap, Spec, table};
use super::{Shared, dead_letters, jobs, leases, operations, series, tokens};
use crate::auth::Role;
use crate::error::Code;

/// `GET /openapi.json`: the document of this server's routes and caps.
pub(super) async fn serve<S: Store>(State(app): Shared<S>) -> Response {
    let specs: Vec<Spec> = table::<S>(&app.config)
        .iter()
        .map(|r| r.spec().clone())
        .collect();
    Json(document(&specs)).into_response()
}

/// What the route table does not say about a route.
struct Described {
    summary: &'static str,
    /// The 2xx answers: status and what the body holds.
    ok: &'static [(u16, &'static str)],
    /// Error statuses beyond those every route of its kind gives.
    errors: &'static [u16],
    /// The JSON body's schema (a `$ref` into `components/schemas`).
    body: Option<fn(&mut SchemaGenerator) -> Schema>,
    /// Whether a body must be sent (a cancel's may be empty).
    body_required: bool,
    /// The query parameters, as one struct's schema.
    query: Option<fn(&mut SchemaGenerator) -> Schema>,
    /// The answer is a stored payload's bytes, not a JSON object.
    payload: bool,
}

const OK: &[(u16, &str)] = &[(200, "OK")];
const PAUSED: &[(u16, &str)] = &[(200, "`{ok: true, paused, changed}`")];

impl Described {
    const fn new(summary: &'static str, ok: &'static [(u16, &'static str)]) -> Self {
        Described {
            summary,
            ok,
            errors: &[],
            body: None,
            body_required: true,
            query: None,
            payload: false,
        }
    }
    const fn errors(mut self, errors: &'static [u16]) -> Self {
        self.errors = errors;
        self
    }
    const fn body(mut self, body: fn(&mut SchemaGenerator) -> Schema) -> Self {
        self.body = Some(body);
        self
    }
    const fn query(mut self, query: fn(&mut SchemaGenerator) -> Schema) -> Self {
        self.query = Some(query);
        self
    }
}

/// A body's schema: a `$ref` into `components/schemas`.
fn schema<T: JsonSchema>(g: &mut SchemaGenerator) -> Schema {
    g.subschema_for::<T>()
}

/// A query struct's schema, whole (its fields become query parameters).
fn root<T: JsonSchema>(g: &mut SchemaGenerator) -> Schema {
    g.root_schema_for::<T>()
}

/// The summary, types and answers of a route of the table; a route not
/// listed here is described from the table alone.
// A table, one route per line, as the route table is.
#[rustfmt::skip]
fn described(method: &Method, path: &str) -> Described {
    use Described as D;
    match (method.as_str(), path) {
        ("GET", "/v1/whoami") => D::new("The caller's token name, role and what it may do.", &[(200, "`{name, role, auth, may, admin, payload_preview_bytes}`")]),
        ("POST", "/v1/jobs") => D::new("Enqueue a job. A W3C `traceparent` header (ignored when invalid) or field (400 when invalid; it wins) joins the job to a trace.", &[
            (201, "`{id, state: \"queued\", admission: \"ADMITTED\" | \"FAIR_QUEUE\"}`"),
            (200, "`{id, state, admission: \"DUPLICATE\"}`: the same (tenant, type, idempotency_key) was already admitted"),
        ]).errors(&[422, 429]).body(schema::<jobs::EnqueueBody<'static>>),
        ("GET", "/v1/jobs") => D::new("A page of jobs, newest first (a producer sees only its own).", &[(200, "`{items: [job without history], next_cursor}`")]).query(root::<jobs::ListParams>),
        ("POST", "/v1/jobs/batch") => D::new("Enqueue many jobs; one bad job is one error in the list. A `traceparent` header applies to every job without a `traceparent` field.", &[(200, "`{results: [{id, state, admission} | {error}]}` in order")]).body(schema::<jobs::BatchBody<'static>>),
        ("GET", "/v1/jobs/{id}") => D::new("One job, with its history (a producer only its own).", &[(200, "The job: `id, type, tenant, lane, state, attempt, idempotency_key, payload, created_at, run_at, history, dead_letter_id, traceparent`")]).query(root::<jobs::JobParams>),
        ("GET", "/v1/jobs/{id}/payload") => D { payload: true, ..D::new("A job's payload, byte for byte as enqueued.", &[(200, "The payload's bytes (`Content-Disposition: attachment`)")]) },
        ("POST", "/v1/jobs/{id}/cancel") => D { body_required: false, ..D::new("Cancel a job (a producer only its own); audited.", &[(200, "`{state: \"cancelled\"}`, or `{state: \"leased\", cancel_requested: true}` for a leased job")]).errors(&[409]).body(schema::<jobs::CancelBody>) },
        ("POST", "/v1/leases") => D::new("Lease ready jobs; `wait_ms > 0` long-polls.", &[(200, "`{jobs: [{id, type, tenant, lane, payload, attempt, idempotency_key, schema_version, lease_token, lease_expires_at, created_at, traceparent}]}`")]).body(schema::<leases::LeaseBody>),
        ("POST", "/v1/jobs/{id}/ack") => D::new("Ack a leased job; `next` leases more in the same reply.", &[(200, "`{state: \"succeeded\"}`, with `jobs` (and `next_error`) when `next` was sent")]).errors(&[409]).body(schema::<leases::AckBody>),
        ("POST", "/v1/jobs/{id}/fail") => D::new("Fail a leased job: retried, deferred or dead-lettered by its type's policy.", &[(200, "`{state: \"scheduled\", retry_at, attempt}` or `{state: \"dead_lettered\", reason}` (or `cancelled`)")]).errors(&[409]).body(schema::<leases::FailBody>),
        ("POST", "/v1/jobs/{id}/heartbeat") => D::new("Extend a lease.", &[(200, "`{lease_expires_at}` (and `cancel_requested: true` once a cancel was asked)")]).errors(&[409]).body(schema::<leases::HeartbeatBody>),
        ("POST", "/v1/acks") => D::new("Ack many leased jobs.", &[(200, "`{results: [reply | {error}]}` in order")]).body(schema::<leases::ItemsBody>),
        ("POST", "/v1/fails") => D::new("Fail many leased jobs (every item needs `error`).", &[(200, "`{results: [reply | {error}]}` in order")]).body(schema::<leases::ItemsBody>),
        ("POST", "/v1/outcomes") => D::new("Ack (no `error`) and fail (with `error`) many leased jobs.", &[(200, "`{results: [reply | {error}]}` in order")]).body(schema::<leases::ItemsBody>),
        ("GET", "/v1/dead-letters") => D::new("A page of dead letters, newest first (404 when `job_id` names no job).", &[(200, "`{items: [dead letter], next_cursor}`")]).errors(&[404]).query(root::<dead_letters::DlQuery>),
        ("GET", "/v1/dead-letters/reasons") => D::new("Dead letters held now, counted by reason and type.", &[(200, "`{reasons: [{reason, type, count, first_at, last_at}]}`")]),
        ("POST", "/v1/dead-letters/redrive") => D::new("Redrive dead letters by id, filter or group (dry-runnable, rate-limited; `to` redirects to another type or lane, admission re-applied; held dead letters are skipped unless named by id); audited.", &[(200, "`{matched, redriven, redrive_id, job_ids, items: [{dead_letter_id, job_id, source, message_id, to, refused}], not_found, held_skipped, refused: [{dead_letter_id, job_id, code, reason, message}], to}`")]).body(schema::<dead_letters::SelectBody>),
        ("POST", "/v1/dead-letters/purge") => D::new("Delete dead letters by id or filter (`confirm: true`; `dry_run: true` deletes nothing and shows what would go); audited.", &[(200, "`{purged, not_found}`; a dry run `{purged: 0, matched, ids, not_found, dry_run}`")]).body(schema::<dead_letters::SelectBody>),
        ("GET", "/v1/dead-letters/groups") => D::new("Failure groups (type, reason, kind, normalised error and first frame), the newest `last_at` first.", &[(200, "`{items: [{id, count, type, reason, kind, fingerprint, sample_error, sample_dead_letter_id, first_at, last_at, rate_1h, held, tenants, sources, verdict}], next_cursor}`")]).query(root::<dead_letters::GroupsQuery>),
        ("POST", "/v1/dead-letters/archive") => D::new("Archive dead letters by id, filter or group (kept, hidden, never alerting; dry-runnable, rate-limited); audited.", &[(200, "`{matched, ids, not_found, dry_run, interrupted, archived}`")]).body(schema::<dead_letters::SelectBody>),
        ("POST", "/v1/dead-letters/restore") => D::new("Restore archived dead letters by id, filter or group; audited.", &[(200, "`{matched, ids, not_found, dry_run, interrupted, restored}`")]).body(schema::<dead_letters::SelectBody>),
        ("GET", "/v1/redrives/{id}") => D::new("What a redrive did, live: sent, succeeded, running, failed again (with the groups they fell into), for its jobs and broker messages.", &[(200, "`{id, at, actor, request, sent, jobs, messages, succeeded, running, failed_again, cancelled, gone, from_groups, failed_again_groups}`")]),
        ("GET", "/v1/dead-letters/{id}") => D::new("One dead letter, with its job's redrive lineage.", &[(200, "The dead letter: `id, job_id, type, tenant, lane, reason, stage, attempts, error, history, source, payload_size, payload_sha256, payload_preview, traceparent, held, lineage: [{redrive_id, at, actor, from_group, payload_edited, to, outcome: {state, failed_again, group, current}}], ...`")]),
        ("POST", "/v1/dead-letters/{id}/redrive") => D::new("Redrive one dead letter with a corrected payload; audited.", &[(200, "`{redriven: true, dead_letter_id, job_id, source, message_id, payload_size, payload_sha256, previous_payload_sha256}` (and `warning` when there is one)")]).errors(&[409, 422]).body(schema::<dead_letters::CorrectedBody>),
        ("GET", "/v1/dead-letters/{id}/payload") => D { payload: true, ..D::new("A dead letter's original payload.", &[(200, "The payload's bytes (`Content-Disposition: attachment`)")]) },
        ("GET", "/v1/stats") => D::new("A JSON summary of the metrics: depths, dead letters, breakers, pauses.", OK),
        ("GET", "/v1/series") => D::new("The charts' signals over the last hour (a point per minute) or day (per five minutes): DLQ depth, dead-lettered, redrives sent, succeeded and failed again, and distinct failure groups, per type and per source; throughput and the oldest ready job's age per lane. The same on every node.", &[(200, "`{window, step_ms, from, to, sample_ms, at: [time], series: [{signal, by, name, gauge, values: [number | null]}]}`")]).query(root::<series::SeriesParams>),
        ("GET", "/v1/breakers") => D::new("The breakers not closed.", &[(200, "`{breakers: [{type, kind, state, until}]}`")]),
        ("POST", "/v1/pause") => D::new("Pause a type or a lane (`{type}` or `{lane}`); audited.", PAUSED).body(schema::<operations::PauseBody>),
        ("POST", "/v1/resume") => D::new("Resume a paused type or lane; audited.", PAUSED).body(schema::<operations::PauseBody>),
        ("GET", "/v1/audit") => D::new("The audit log, newest first.", &[(200, "`{items: [{at, actor, action, request, count}], next_cursor}`")]).query(root::<operations::AuditParams>),
        ("GET", "/v1/tokens") => D::new("The tokens: the config's and those made through the API (never their secrets).", &[(200, "`{items: [{name, role, origin, ...}]}`")]),
        ("POST", "/v1/tokens") => D::new("Make a token; its secret is in this answer only; audited.", &[(201, "`{name, role, token, created_at}`")]).errors(&[409]).body(schema::<tokens::CreateTokenBody>),
        ("DELETE", "/v1/tokens/{name}") => D::new("Revoke a token made through the API; audited.", &[(200, "`{name, revoked: true}`")]),
        _ => D::new("", OK),
    }
}

/// The document of the `/v1` routes among `specs`.
pub fn document(specs: &[Spec]) -> Value {
    let mut g = SchemaSettings::openapi3().into_generator();
    // Queries are read whole, each field a parameter.
    let mut inline = SchemaSettings::openapi3()
        .with(|s| s.inline_subschemas = true)
        .into_generator();
    let mut paths = Map::new();
    for spec in specs.iter().filter(|s| s.path.starts_with("/v1/")) {
        let op = operation(
            spec,
            &described(&spec.method, spec.path),
            &mut g,
            &mut inline,
        );
        let item = paths
            .entry(spec.path)
            .or_insert_with(|| Value::Object(Map::new()));
        item[spec.method.as_str().to_ascii_lowercase()] = op;
    }
    let mut schemas = g.take_definitions(true);
    schemas.insert("Error".into(), error_schema());
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "lazaret",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "lazaret's HTTP API (`/v1`), generated from the server's route table. \
                Every route needs `Authorization: Bearer TOKEN` of a role that may call it \
                (`x-lazaret-roles`); a server without tokens serves loopback only and asks for none. \
                Bodies are JSON; times are RFC 3339 in UTC; durations are integer milliseconds. \
                `x-lazaret-body-max` is the body cap in bytes (413 over it). See docs/api.md.",
            "license": { "name": "Apache-2.0" },
        },
        "paths": paths,
        "components": {
            "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer" } },
            "schemas": schemas,
            "responses": error_responses(),
        },
        "security": [ { "bearer": [] } ],
    })
}

/// One operation of the document.
fn operation(
    spec: &Spec,
    d: &Described,
    g: &mut SchemaGenerator,
    inline: &mut SchemaGenerator,
) -> Value {
    let mut op = Map::new();
    let summary = if d.summary.is_empty() {
        format!("{} {}", spec.method, spec.path)
    } else {
        d.summary.to_owned()
    };
    op.insert("summary".into(), summary.into());
    op.insert("operationId".into(), operation_id(spec).into());
    let tag = spec.path.split('/').nth(2).unwrap_or_default();
    op.insert("tags".into(), json!([tag]));
    let who = match spec.access {
        Access::Open => {
            op.insert("security".into(), json!([]));
            "No token needed.".to_owned()
        }
        Access::AnyToken => {
            op.insert("x-lazaret-roles".into(), json!(role_words(|_| true)));
            "Any valid token.".to_owned()
        }
        Access::May(action) => {
            let roles = role_words(|r| action.allowed_for(r));
            op.insert("x-lazaret-action".into(), action.as_str().into());
            op.insert("x-lazaret-roles".into(), json!(roles));
            format!(
                "Roles: {} (action `{}`).",
                roles.join(", "),
                action.as_str()
            )
        }
    };
    let mut description = who;
    let mut params: Vec<Value> = spec
        .path
        .split('/')
        .filter_map(|seg| seg.strip_prefix('{')?.strip_suffix('}'))
        .map(|name| json!({ "name": name, "in": "path", "required": true, "schema": { "type": "string" } }))
        .collect();
    if let Some(query) = d.query {
        params.extend(query_params(query(inline)));
    }
    if !params.is_empty() {
        op.insert("parameters".into(), params.into());
    }
    match spec.body {
        BodyCap::None => {}
        BodyCap::Buffered(cap) | BodyCap::Streamed(cap) => {
            let streamed = matches!(spec.body, BodyCap::Streamed(_));
            op.insert("x-lazaret-body-max".into(), cap.into());
            op.insert(
                "x-lazaret-body-read".into(),
                if streamed { "streamed" } else { "buffered" }.into(),
            );
            description.push_str(&format!(" Body: at most {cap} bytes (413 over it)."));
            let schema = match d.body {
                Some(body) => body(g).to_value(),
                None => json!({ "type": "object" }),
            };
            op.insert(
                "requestBody".into(),
                json!({
                    "required": d.body_required,
                    "content": { "application/json": { "schema": schema } },
                }),
            );
        }
    }
    op.insert("description".into(), description.into());
    op.insert("responses".into(), responses(spec, d));
    Value::Object(op)
}

/// `post_v1_jobs_id_cancel` for `POST /v1/jobs/{id}/cancel`.
fn operation_id(spec: &Spec) -> String {
    let mut id = spec.method.as_str().to_ascii_lowercase();
    for seg in spec.path.split('/').filter(|s| !s.is_empty()) {
        id.push('_');
        id.extend(
            seg.chars()
                .filter(|c| !matches!(c, '{' | '}'))
                .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }),
        );
    }
    id
}

/// The roles `may` lets through, in the order of [`Role::ALL`].
fn role_words(may: impl Fn(Role) -> bool) -> Vec<&'static str> {
    Role::ALL
        .into_iter()
        .filter(|r| may(*r))
        .map(Role::as_str)
        .collect()
}

/// A query struct's fields as optional query parameters.
fn query_params(schema: Schema) -> Vec<Value> {
    let value = schema.to_value();
    let Some(props) = value.get("properties").and_then(Value::as_object) else {
        return Vec::new();
    };
    props
        .iter()
        .map(|(name, prop)| {
            let mut prop = prop.clone();
            let description = prop.as_object_mut().and_then(|p| {
                p.remove("nullable");
                p.remove("description")
            });
            let mut param =
                json!({ "name": name, "in": "query", "required": false, "schema": prop });
            if let Some(d) = description {
                param["description"] = d;
            }
            param
        })
        .collect()
}

/// The answers of one operation: its 2xx ones and the errors it can give.
fn responses(spec: &Spec, d: &Described) -> Value {
    let mut out = Map::new();
    for &(status, what) in d.ok {
        let content = if d.payload {
            json!({
                "application/json": { "schema": {} },
                "application/octet-stream": { "schema": { "type": "string", "format": "binary" } },
            })
        } else {
            json!({ "application/json": { "schema": { "type": "object", "description": what } } })
        };
        out.insert(
            status.to_string(),
            json!({ "description": what, "content": content }),
        );
    }
    let mut errors = vec![400, 403, 503];
    if spec.access != Access::Open {
        errors.push(401);
    }
    if spec.path.contains('{') {
        errors.push(404);
    }
    if spec.body != BodyCap::None {
        errors.push(413);
    }
    errors.extend_from_slice(d.errors);
    errors.sort_unstable();
    errors.dedup();
    for status in errors {
        if let Some((name, _, _)) = ERRORS.iter().find(|(_, s, _)| *s == status) {
            out.insert(
                status.to_string(),
                json!({ "$ref": format!("#/components/responses/{name}") }),
            );
        }
    }
    Value::Object(out)
}

/// The shared error answers: name, status and which codes they carry.
const ERRORS: [(&str, u16, &str); 9] = [
    (
        "BadRequest",
        400,
        "`BAD_REQUEST` (malformed request, unknown query parameter or body key) or `NO_TENANT`.",
    ),
    (
        "Unauthorized",
        401,
        "`UNAUTHORIZED`: missing or unknown token.",
    ),
    (
        "Forbidden",
        403,
        "`FORBIDDEN`: the token's role may not do this, or a browser request refused (`reason`: `cross_origin`, `host_not_allowed`).",
    ),
    (
        "NotFound",
        404,
        "`NOT_FOUND`: no such job, dead letter or token.",
    ),
    (
        "Conflict",
        409,
        "`LEASE_LOST` (the lease token is not the job's current one), `BAD_STATE` (the job's state does not allow it) or `CONFLICT`.",
    ),
    (
        "TooLarge",
        413,
        "`POISON` with `reason: \"payload_too_large\"`: the body is over the route's cap (`x-lazaret-body-max`).",
    ),
    (
        "Unprocessable",
        422,
        "`POISON` (`invalid_json`, `schema_invalid` with `details`, `unknown_schema_version`) or `UNKNOWN_TYPE`.",
    ),
    (
        "TooManyRequests",
        429,
        "`TOO_MANY_TENANTS`: a new tenant while `[tenants] ready_max` tenants hold ready jobs.",
    ),
    (
        "Unavailable",
        503,
        "`UNAVAILABLE` (overloaded, or the store cannot write now; nothing was applied) or `SHED` (breaker open, type or lane paused); retry after `Retry-After` seconds.",
    ),
];

fn error_responses() -> Value {
    let mut out = Map::new();
    for (name, status, what) in ERRORS {
        let mut r = json!({
            "description": what,
            "content": { "application/json": { "schema": { "$ref": "#/components/schemas/Error" } } },
        });
        if matches!(status, 429 | 503) {
            r["headers"] = json!({
                "Retry-After": { "description": "Seconds to wait before retrying.", "schema": { "type": "integer" } },
            });
        }
        out.insert(name.into(), r);
    }
    Value::Object(out)
}

/// The error envelope every error answer carries.
fn error_schema() -> Value {
    let codes: Vec<&str> = Code::KNOWN.iter().filter_map(Code::word).collect();
    json!({
        "type": "object",
        "description": "Every error answer: `{\"error\": {\"code\", \"reason\", \"message\", ...}}`.",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["code", "message"],
                "properties": {
                    "code": {
                        "type": "string",
                        "description": "The error code; more may be added, so a client keeps one it does not know.",
                        "x-lazaret-known": codes,
                    },
                    "reason": { "type": "string", "nullable": true, "description": "A reason word (POISON reasons, `cross_origin`, ...), else null." },
                    "message": { "type": "string", "description": "What was wrong and what to do." },
                    "details": { "type": "array", "items": { "type": "object" }, "description": "Schema violations (POISON `schema_invalid`)." },
                },
            },
        },
    })
}
