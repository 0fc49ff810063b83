//! The dashboard at `/` and `GET /v1/whoami`.
//!
//! The dashboard is three static files compiled into the binary
//! (`src/dashboard/`: `index.html`, `app.js`, `app.css`): nothing is fetched
//! from anywhere else, so it works with no network. The page holds no data
//! of its own; its script calls the JSON API with the token typed into its
//! login form, kept in `sessionStorage` and sent as `Authorization: Bearer`
//! (never as a cookie, so no other site can make the browser act with it).
//! The page and its files need no token; every API call does.
//!
//! The script builds every element with `textContent`, never `innerHTML`:
//! payloads, error texts and names are hostile input. The
//! `Content-Security-Policy` sent with every file allows only this origin's
//! own script and style and forbids inline script, so even markup that got
//! into the page could not run.

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use lazaret_store::Store;
use serde_json::json;

use crate::auth::{Action, authenticate};
use crate::config::Role;

use super::{ApiResult, Shared, ok};

const INDEX_HTML: &str = include_str!("../dashboard/index.html");
const APP_JS: &str = include_str!("../dashboard/app.js");
const APP_CSS: &str = include_str!("../dashboard/app.css");

/// Only this origin's own files; no inline script, no framing, no plugins.
/// `img-src data:` is the empty favicon; `blob:` is a payload download.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; \
     frame-ancestors 'none'";

/// The paths of the dashboard's files: served without a token.
pub(super) fn is_dashboard_path(path: &str) -> bool {
    matches!(path, "/" | "/dashboard/app.js" | "/dashboard/app.css")
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut resp = ([(header::CONTENT_TYPE, content_type)], body).into_response();
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // The files change with the binary: revalidate rather than run an old script.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

pub(super) async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX_HTML)
}

pub(super) async fn app_js() -> Response {
    asset("text/javascript; charset=utf-8", APP_JS)
}

pub(super) async fn app_css() -> Response {
    asset("text/css; charset=utf-8", APP_CSS)
}

/// What each role may do, by the names the dashboard uses.
/// `read_jobs` is one job by id (a worker may); `list_jobs` is `GET /v1/jobs`
/// (a worker may not), so the dashboard offers the live-jobs list only to
/// the roles it answers.
const ABILITIES: [(&str, Action); 8] = [
    ("observe", Action::Observe),
    ("produce", Action::Produce),
    ("read_jobs", Action::ReadJob),
    ("list_jobs", Action::ListJobs),
    ("work", Action::Work),
    ("read_dead_letters", Action::ReadDeadLetters),
    ("operate", Action::Operate),
    ("administer", Action::Administer),
];

/// `GET /v1/whoami`: the caller's token name and role and what that role
/// may do, so the dashboard offers only that. Any valid token may ask.
pub(super) async fn whoami<S: Store>(State(app): Shared<S>, headers: HeaderMap) -> ApiResult {
    let caller = {
        let api = app.api_tokens.read().unwrap_or_else(|p| p.into_inner());
        authenticate(&app.config.tokens, &api, &headers)?
    };
    let may: Vec<&str> = ABILITIES
        .iter()
        .filter(|(_, a)| a.allowed_for(caller.role))
        .map(|(n, _)| *n)
        .collect();
    ok(json!({
        "name": caller.name,
        "role": caller.role.as_str(),
        "auth": app.auth_on(),
        "may": may,
        // Purge and tokens are admin-only; named for clients that gate on role.
        "admin": caller.role == Role::Admin,
    }))
}
