//! The route table: each route's method, path, who may call it and how its
//! body is read, declared once.
//!
//! The router is built from [`table`], and the check that runs before any
//! body is read (`authorize_first`) looks the matched route up in the same
//! table: a token of the wrong role is refused (403, `Connection: close`)
//! without the server buffering what it sent, on every route, and a handler
//! receives the [`Caller`] it let through as an extractor. Adding a route is
//! one line of [`table`].

use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequestParts, MatchedPath, State};
use axum::handler::Handler;
use axum::http::request::Parts;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, MethodRouter, on};
use lazaret_store::{AuditEntry, Store};
use serde_json::json;

use crate::app::{App, now};
use crate::auth::{Action, Caller, authenticate, forbidden};
use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::metrics as m;

use super::{
    CANCEL_BODY_BYTES_MAX as CANCEL, LEASE_BODY_BYTES_MAX as LEASE,
    OPERATE_BODY_BYTES_MAX as OPERATE, OUTCOME_BODY_BYTES_MAX as OUTCOME,
    TOKEN_BODY_BYTES_MAX as TOKEN, connection_close, dashboard, dead_letters, healthz, jobs,
    leases, openapi, operations, series, tokens,
};

/// Who may call a route.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Anyone, without a token: the dashboard's files, `/healthz`, `/metrics`.
    Open,
    /// Any valid token (`GET /v1/whoami`).
    AnyToken,
    /// A token whose role may do this.
    May(Action),
}

/// How a route's request body is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyCap {
    /// The handler reads no body.
    None,
    /// Buffered whole before the handler runs, up to this many bytes
    /// (`413 TOO_LARGE` over it).
    Buffered(usize),
    /// Streamed by the handler, up to this many bytes ([`StreamCap`]): an
    /// enqueue over it is recorded as a poison dead letter.
    Streamed(usize),
}

/// The cap of a [`BodyCap::Streamed`] route, handed to its handler.
#[derive(Clone, Copy, Debug)]
pub struct StreamCap(pub usize);

/// One route as the table declares it.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Its method.
    pub method: Method,
    /// Its path, with `{id}`-style parameters as axum matches them.
    pub path: &'static str,
    /// Who may call it.
    pub access: Access,
    /// How its body is read.
    pub body: BodyCap,
}

/// A route of the table: its [`Spec`] and its handler.
pub struct Route<S> {
    spec: Spec,
    handler: MethodRouter<Arc<App<S>>>,
}

impl<S> std::fmt::Debug for Route<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl<S> Route<S> {
    /// What the table declares of it.
    pub fn spec(&self) -> &Spec {
        &self.spec
    }
}

fn route<S, H, T>(
    method: Method,
    path: &'static str,
    access: Access,
    body: BodyCap,
    handler: H,
) -> Route<S>
where
    S: Store,
    H: Handler<T, Arc<App<S>>>,
    T: 'static,
{
    let filter = MethodFilter::try_from(method.clone()).expect("a method axum routes");
    let handler = match body {
        BodyCap::None => on(filter, handler),
        BodyCap::Buffered(cap) => on(filter, handler).layer(DefaultBodyLimit::max(cap)),
        BodyCap::Streamed(cap) => on(filter, handler).layer(axum::Extension(StreamCap(cap))),
    };
    Route {
        spec: Spec {
            method,
            path,
            access,
            body,
        },
        handler,
    }
}

/// Every route of the API, with the caps `config` sets.
// A table, one route per line: rustfmt would spread each over five.
#[rustfmt::skip]
pub fn table<S: Store>(config: &ServerConfig) -> Vec<Route<S>> {
    use Access::{AnyToken, May, Open};
    use Action::*;
    use BodyCap::{Buffered, Streamed};
    let batch = config.batch_bytes_max;
    let corrected = config.admission.body_bytes_max();
    vec![
        get("/", Open, dashboard::index),
        get("/dashboard/app.js", Open, dashboard::app_js),
        get("/dashboard/app.css", Open, dashboard::app_css),
        get("/healthz", Open, healthz::<S>),
        get("/metrics", Open, operations::metrics::<S>),
        get("/openapi.json", Open, openapi::serve::<S>),
        get("/v1/whoami", AnyToken, dashboard::whoami::<S>),
        // Producers. An enqueue streams its body, capped while it reads.
        post("/v1/jobs", May(Produce), Streamed(corrected), jobs::enqueue::<S>),
        get("/v1/jobs", May(ListJobs), jobs::list::<S>),
        post("/v1/jobs/batch", May(Produce), Streamed(batch), jobs::enqueue_batch::<S>),
        get("/v1/jobs/{id}", May(ReadJob), jobs::job::<S>),
        get("/v1/jobs/{id}/payload", May(ReadJob), jobs::job_payload::<S>),
        post("/v1/jobs/{id}/cancel", May(Cancel), Buffered(CANCEL), jobs::cancel::<S>),
        // Workers.
        post("/v1/leases", May(Work), Buffered(LEASE), leases::lease::<S>),
        post("/v1/jobs/{id}/ack", May(Work), Buffered(OUTCOME), leases::ack::<S>),
        post("/v1/jobs/{id}/fail", May(Work), Buffered(OUTCOME), leases::fail::<S>),
        post("/v1/jobs/{id}/heartbeat", May(Work), Buffered(OUTCOME), leases::heartbeat::<S>),
        post("/v1/acks", May(Work), Buffered(batch), leases::acks::<S>),
        post("/v1/fails", May(Work), Buffered(batch), leases::fails::<S>),
        post("/v1/outcomes", May(Work), Buffered(batch), leases::outcomes::<S>),
        // Dead letters.
        get("/v1/dead-letters", May(ReadDeadLetters), dead_letters::dead_letters::<S>),
        get("/v1/dead-letters/reasons", May(ReadDeadLetters), dead_letters::reasons::<S>),
        get("/v1/dead-letters/groups", May(ReadDeadLetters), dead_letters::groups::<S>),
        post("/v1/dead-letters/redrive", May(Operate), Buffered(OPERATE), dead_letters::redrive::<S>),
        post("/v1/dead-letters/purge", May(Administer), Buffered(OPERATE), dead_letters::purge::<S>),
        post("/v1/dead-letters/archive", May(Operate), Buffered(OPERATE), dead_letters::archive::<S>),
        post("/v1/dead-letters/restore", May(Operate), Buffered(OPERATE), dead_letters::restore::<S>),
        get("/v1/dead-letters/{id}", May(ReadDeadLetters), dead_letters::dead_letter::<S>),
        post("/v1/dead-letters/{id}/redrive", May(Operate), Buffered(corrected), dead_letters::redrive_corrected::<S>),
        get("/v1/dead-letters/{id}/payload", May(ReadDeadLetters), dead_letters::dead_letter_payload::<S>),
        get("/v1/redrives/{id}", May(ReadDeadLetters), dead_letters::redrive_report::<S>),
        // Operators.
        get("/v1/stats", May(Observe), operations::stats::<S>),
        get("/v1/breakers", May(Observe), operations::breakers::<S>),
        get("/v1/series", May(Observe), series::series_page::<S>),
        post("/v1/pause", May(Operate), Buffered(OPERATE), operations::pause::<S>),
        post("/v1/resume", May(Operate), Buffered(OPERATE), operations::resume::<S>),
        get("/v1/audit", May(ReadDeadLetters), operations::audit::<S>),
        // Tokens.
        get("/v1/tokens", May(Administer), tokens::tokens::<S>),
        post("/v1/tokens", May(Administer), Buffered(TOKEN), tokens::create_token::<S>),
        delete("/v1/tokens/{name}", May(Administer), tokens::revoke_token::<S>),
    ]
}

/// A GET route (HEAD too, as axum answers it); it reads no body.
fn get<S: Store, H: Handler<T, Arc<App<S>>>, T: 'static>(
    path: &'static str,
    access: Access,
    handler: H,
) -> Route<S> {
    route(Method::GET, path, access, BodyCap::None, handler)
}

/// A POST route and how its body is read.
fn post<S: Store, H: Handler<T, Arc<App<S>>>, T: 'static>(
    path: &'static str,
    access: Access,
    body: BodyCap,
    handler: H,
) -> Route<S> {
    route(Method::POST, path, access, body, handler)
}

/// A DELETE route; it reads no body.
fn delete<S: Store, H: Handler<T, Arc<App<S>>>, T: 'static>(
    path: &'static str,
    access: Access,
    handler: H,
) -> Route<S> {
    route(Method::DELETE, path, access, BodyCap::None, handler)
}

/// The router of every route of [`table`]: each behind [`authorize_first`].
pub(super) fn router<S: Store>(app: &Arc<App<S>>) -> axum::Router<Arc<App<S>>> {
    let mut router = axum::Router::new();
    let mut specs = Vec::new();
    for r in table::<S>(&app.config) {
        router = router.route(r.spec.path, r.handler);
        specs.push(r.spec);
    }
    let specs: Arc<[Spec]> = specs.into();
    router.route_layer(axum::middleware::from_fn_with_state(
        (Arc::clone(app), specs),
        authorize_first::<S>,
    ))
}

/// What [`authorize_first`] checks against: the app and the table's specs.
type Checked<S> = (Arc<App<S>>, Arc<[Spec]>);

/// Authenticates and authorises every request by its route's [`Access`],
/// before a byte of its body is read: an unknown or unauthorised caller is
/// refused (401/403; `Connection: close` whenever a body may be left
/// unread) without the server buffering what it sent. The [`Caller`] let
/// through goes to the handler.
async fn authorize_first<S: Store>(
    State((app, specs)): State<Checked<S>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let (access, body) = match req.extensions().get::<MatchedPath>() {
        Some(path) => access_of(&specs, req.method(), path.as_str()),
        None => (Access::AnyToken, BodyCap::None),
    };
    match authorize(&app, req.headers(), access).await {
        Ok(Some(caller)) => {
            req.extensions_mut().insert(caller);
            next.run(req).await
        }
        Ok(None) => next.run(req).await,
        Err(e) => {
            // An unauthenticated caller's body is never drained, nor is a
            // refused body of a route that takes one.
            let close = e.status == StatusCode::UNAUTHORIZED || body != BodyCap::None;
            let resp = e.into_response();
            if close { connection_close(resp) } else { resp }
        }
    }
}

/// What the table declares of `method` on `path`. A method the path does
/// not take (answered 405) needs what the least of the path's routes needs:
/// nothing on an open path, else a valid token of any role.
fn access_of(specs: &[Spec], method: &Method, path: &str) -> (Access, BodyCap) {
    // axum answers HEAD with a GET route's handler.
    let method = if method == Method::HEAD {
        &Method::GET
    } else {
        method
    };
    let mut of_path = specs.iter().filter(|s| s.path == path);
    if let Some(s) = of_path.clone().find(|s| s.method == method) {
        return (s.access, s.body);
    }
    if of_path.any(|s| s.access == Access::Open) {
        (Access::Open, BodyCap::None)
    } else {
        (Access::AnyToken, BodyCap::None)
    }
}

/// The caller, when `access` lets it through (`None` for an open route); a
/// refused operator action is audited.
async fn authorize<S: Store>(
    app: &App<S>,
    headers: &HeaderMap,
    access: Access,
) -> Result<Option<Caller>, ApiError> {
    let action = match access {
        Access::Open => return Ok(None),
        Access::AnyToken => None,
        Access::May(action) => Some(action),
    };
    let caller = {
        let api = app.api_tokens.read().unwrap_or_else(|p| p.into_inner());
        authenticate(&app.config.tokens, &api, headers)
    }
    .inspect_err(|e| m::rejected_code(&e.code))?;
    let Some(action) = action else {
        return Ok(Some(caller));
    };
    if action.allowed_for(caller.role) {
        return Ok(Some(caller));
    }
    if matches!(
        action,
        Action::Operate | Action::Administer | Action::ReadDeadLetters | Action::Cancel
    ) {
        let entry = AuditEntry {
            at: now(),
            actor: caller.name.clone(),
            action: "denied".into(),
            request: json!({ "wanted": format!("{action:?}") }),
            count: 0,
        };
        let _ = app.store.audit(entry).await;
    }
    m::rejected("FORBIDDEN");
    Err(forbidden(&caller, action))
}

/// A handler's caller: the one `authorize_first` let through.
impl<St: Send + Sync> FromRequestParts<St> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Caller>().cloned().ok_or_else(|| {
            ApiError::internal(
                "this route is declared open in the route table, so it has no caller; \
                 declare who may call it (api/routes.rs)",
            )
        })
    }
}

/// A streamed route's cap, from the table.
impl<St: Send + Sync> FromRequestParts<St> for StreamCap {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &St) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<StreamCap>().copied().ok_or_else(|| {
            ApiError::internal(
                "this route's body is not declared streamed in the route table (api/routes.rs)",
            )
        })
    }
}
