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
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use lazaret_store::Store;
use serde_json::json;

use crate::auth::Role;
use crate::auth::{Action, Caller};

use super::{ApiResult, Shared, ok};

const INDEX_HTML: &str = include_str!("../dashboard/index.html");
const APP_JS: &str = include_str!("../dashboard/app.js");
const APP_CSS: &str = include_str!("../dashboard/app.css");

/// Only this origin's own files; no inline script, no framing, no plugins.
/// `img-src data:` is the empty favicon; `blob:` is a payload download.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; \
     frame-ancestors 'none'";

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

/// `GET /v1/whoami`: the caller's token name and role, every action that
/// role may do (`Action::ALL`, by its word), and the sizes the dashboard
/// shows, so the page offers only what the server will do and derives
/// nothing itself. Any valid token may ask.
pub(super) async fn whoami<S: Store>(State(app): Shared<S>, caller: Caller) -> ApiResult {
    let may: Vec<&str> = Action::ALL
        .into_iter()
        .filter(|a| a.allowed_for(caller.role))
        .map(Action::as_str)
        .collect();
    ok(json!({
        "name": caller.name,
        "role": caller.role.as_str(),
        "auth": app.auth_on(),
        "may": may,
        // Purge and tokens are admin-only; named for clients that gate on role.
        "admin": caller.role == Role::Admin,
        "payload_preview_bytes": lazaret_core::PREVIEW_BYTES_MAX,
    }))
}
