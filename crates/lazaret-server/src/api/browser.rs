//! What a browser may make this server do: one layer in front of every
//! route, before any body is read.
//!
//! On a server without tokens every caller is admin, and the operator's own
//! browser is a caller: any page open in it can send requests here. Two
//! rules keep those pages out (the contract's "Browser requests, without
//! tokens"):
//!
//! - **Host.** Only requests addressed to this server by one of its own
//!   names are answered: the listen address, `localhost`, `127.0.0.1`,
//!   `[::1]` (with the port), or an entry of `[http] allowed_hosts`. A page
//!   that rebinds its own name to 127.0.0.1 (DNS rebinding) becomes
//!   same-origin with lazaret, but its requests still carry its own name, and
//!   are refused on every route, `/healthz` and `/metrics` included (metrics
//!   name types, tenants' lanes and error kinds; a health check on a
//!   loopback-only server comes from this host, by one of its names). A
//!   request with no `Host` at all (HTTP/1.0) comes from no browser and is
//!   served.
//! - **Origin.** A request that may change state (any method but GET and
//!   HEAD) is refused when it says it comes from a page of another origin:
//!   an `Origin` that is not this `Host` (`null` included), or a
//!   `Sec-Fetch-Site` of `cross-site` or `same-site` (another port of the
//!   same host is same-site). Clients that send neither (curl, the SDKs)
//!   are not browsers and are served as before. `Sec-Fetch-Mode` is never
//!   looked at (Node's `fetch` sends `cors`).
//!
//! With tokens configured neither rule applies: every request needs a
//! Bearer token, which a page of another origin cannot send without CORS
//! (lazaret allows none) and which no browser adds on its own (there are no
//! cookies), and a server with tokens may be reached under any name.
//!
//! Every answer, on every route, carries `X-Content-Type-Options: nosniff`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, Method, header};
use axum::response::{IntoResponse, Response};
use lazaret_store::Store;

use crate::app::App;
use crate::error::ApiError;
use crate::metrics as m;

/// The layer: the Host and Origin rules, then `nosniff` on the answer.
pub(super) async fn guard<S: Store>(
    State(app): State<Arc<App<S>>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if !app.auth_on() {
        if let Err(e) = check(&app, req.method(), req.uri(), req.headers()) {
            m::rejected_code(&e.code);
            let mut resp = e.into_response();
            // The body, if any, is never read: close rather than drain it.
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            return nosniff(resp);
        }
    }
    nosniff(next.run(req).await)
}

fn nosniff(mut resp: Response) -> Response {
    resp.headers_mut()
        .entry(header::X_CONTENT_TYPE_OPTIONS)
        .or_insert(HeaderValue::from_static("nosniff"));
    resp
}

/// Both rules, for a server without tokens.
fn check<S: Store>(
    app: &App<S>,
    method: &Method,
    uri: &axum::http::Uri,
    headers: &HeaderMap,
) -> Result<(), ApiError> {
    let listen = app.listen();
    let allowed = &app.config.allowed_hosts;
    let mut hosts = headers.get_all(header::HOST).iter();
    let host = match (hosts.next(), hosts.next()) {
        (Some(h), None) => Some(
            h.to_str()
                .map_err(|_| host_refused("(not text)", listen, allowed))?,
        ),
        (Some(_), Some(_)) => return Err(host_refused("(sent twice)", listen, allowed)),
        // HTTP/2 and absolute-form requests name their authority in the URI.
        (None, _) => uri.authority().map(|a| a.as_str()),
    };
    if let Some(host) = host {
        if !host_allowed(host, listen, allowed) {
            return Err(host_refused(host, listen, allowed));
        }
    }
    if method == Method::GET || method == Method::HEAD {
        return Ok(());
    }
    if let Some(site) = headers.get("sec-fetch-site") {
        let site = site.to_str().unwrap_or("").trim().to_ascii_lowercase();
        if site == "cross-site" || site == "same-site" {
            return Err(cross_origin(
                format!("Sec-Fetch-Site: {}", echo(&site)),
                host,
            ));
        }
    }
    if let Some(origin) = headers.get(header::ORIGIN) {
        let text = origin.to_str().unwrap_or("(not text)");
        if !host.is_some_and(|h| same_origin(text, h)) {
            return Err(cross_origin(format!("Origin {:?}", echo(text)), host));
        }
    }
    Ok(())
}

/// `name` and `port` of `host[:port]` (`[v6]:port` keeps its brackets),
/// the name in lower case; `None` when it is not of that form.
fn split_host(host: &str) -> Option<(String, Option<u16>)> {
    let host = host.trim();
    let (name, port) = if host.starts_with('[') {
        let end = host.find(']')?;
        let (name, rest) = host.split_at(end + 1);
        match rest {
            "" => (name, None),
            r => (name, Some(r.strip_prefix(':')?)),
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (host, None),
        }
    };
    let valid = match name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        Some(v6) => v6
            .bytes()
            .all(|b| b.is_ascii_hexdigit() || b":.".contains(&b)),
        None => name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._".contains(&b)),
    };
    if name.is_empty() || !valid {
        return None;
    }
    let port = match port {
        Some(p) => Some(p.parse::<u16>().ok()?),
        None => None,
    };
    Some((name.to_ascii_lowercase(), port))
}

/// Whether `host` names this server: one of its own names with its port
/// (or none when the port is 80), or an `[http] allowed_hosts` entry (with
/// any port when the entry names none). `listen` unknown (a router without
/// a socket): its own names with any port.
pub(crate) fn host_allowed(host: &str, listen: Option<SocketAddr>, allowed: &[String]) -> bool {
    let Some((name, port)) = split_host(host) else {
        return false;
    };
    let own_port = match (listen, port) {
        (None, _) => true,
        (Some(a), Some(p)) => a.port() == p,
        (Some(a), None) => a.port() == 80,
    };
    let listen_name = listen.map(|a| match a {
        SocketAddr::V4(v4) => v4.ip().to_string(),
        SocketAddr::V6(v6) => format!("[{}]", v6.ip()),
    });
    let own_name = matches!(name.as_str(), "localhost" | "127.0.0.1" | "[::1]")
        || listen_name.as_deref() == Some(name.as_str());
    if own_name && own_port {
        return true;
    }
    allowed.iter().any(|entry| match split_host(entry) {
        Some((n, None)) => n == name,
        Some((n, Some(p))) => n == name && port == Some(p),
        None => false,
    })
}

/// Whether `origin` (`scheme://host[:port]`) is the origin of a page at
/// `host`: the same name and port, over http or https (behind a proxy that
/// ends TLS the page's scheme is https, this server's http; nothing else
/// can answer at this server's own host and port).
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false; // `null` and anything else that is no origin
    };
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" => 80,
        "https" => 443,
        _ => return false,
    };
    match (split_host(authority), split_host(host)) {
        (Some((on, op)), Some((hn, hp))) => {
            on == hn && op.unwrap_or(default_port) == hp.unwrap_or(default_port)
        }
        _ => false,
    }
}

/// The names this server answers to, for a message.
fn own_names(listen: Option<SocketAddr>, allowed: &[String]) -> String {
    let port = listen.map_or_else(|| ":PORT".to_owned(), |a| format!(":{}", a.port()));
    let mut names = vec![
        format!("127.0.0.1{port}"),
        format!("localhost{port}"),
        format!("[::1]{port}"),
    ];
    if let Some(own) = listen.map(|a| a.to_string()) {
        if !names.contains(&own) {
            names.insert(0, own);
        }
    }
    names.extend(allowed.iter().cloned());
    names.join(", ")
}

/// A header value as a message quotes it: at most [`ECHO_CHARS_MAX`]
/// characters (the value is visible ASCII: `to_str` allowed nothing else).
fn echo(value: &str) -> String {
    match value.char_indices().nth(ECHO_CHARS_MAX) {
        Some((at, _)) => format!("{}…", &value[..at]),
        None => value.to_owned(),
    }
}

/// The longest header value a refusal quotes.
const ECHO_CHARS_MAX: usize = 200;

fn host_refused(host: &str, listen: Option<SocketAddr>, allowed: &[String]) -> ApiError {
    let mut e = ApiError::forbidden(format!(
        "this server has no tokens and answers only requests addressed to it by its own names \
         ({}); Host {host} is not one of them, and a page of another site that points its name \
         at this address (DNS rebinding) must not read or change anything. To reach lazaret under \
         another name (a reverse proxy's), add that name to the config: [http] allowed_hosts = \
         [\"NAME\"] (or configure [[tokens]])",
        own_names(listen, allowed),
        host = echo(host),
    ));
    e.reason = Some("host_not_allowed");
    e
}

fn cross_origin(what: String, host: Option<&str>) -> ApiError {
    let here = host.map_or_else(String::new, |h| format!(" (http://{}/)", echo(h)));
    let mut e = ApiError::forbidden(format!(
        "refused: this request comes from a page of another origin ({what}), and on a server \
         without tokens any page open in your browser could otherwise purge, redrive or enqueue. \
         Use the dashboard this server serves{here}, or a client that sends no Origin (curl, the \
         SDKs); to let other pages act, configure [[tokens]] and send a Bearer token"
    ));
    e.reason = Some("cross_origin");
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(port: u16) -> Option<SocketAddr> {
        Some(SocketAddr::from(([127, 0, 0, 1], port)))
    }

    #[test]
    fn a_host_is_one_of_the_servers_own_names_with_its_port() {
        let none: &[String] = &[];
        for ok in [
            "127.0.0.1:7433",
            "localhost:7433",
            "LOCALHOST:7433",
            "[::1]:7433",
        ] {
            assert!(host_allowed(ok, at(7433), none), "{ok}");
        }
        for refused in [
            "evil.example:7433",
            "localhost:7434",
            "127.0.0.1",
            "localhost",
            "127.0.0.2:7433",
            "localhost.:7433",
            "localhost:7433:1",
            "localhost:x",
            "user@localhost:7433",
            "",
            "[::1",
        ] {
            assert!(!host_allowed(refused, at(7433), none), "{refused}");
        }
        // Port 80: a browser leaves it out.
        assert!(host_allowed("localhost", at(80), none));
        // The listen address itself, another loopback one.
        let other = Some(SocketAddr::from(([127, 0, 0, 9], 5000)));
        assert!(host_allowed("127.0.0.9:5000", other, none));
        let v6: Option<SocketAddr> = Some("[::1]:5000".parse().unwrap());
        assert!(host_allowed("[::1]:5000", v6, none));
        assert!(!host_allowed("[0:0:0:0:0:0:0:1]:5000", v6, none));
    }

    #[test]
    fn an_allowed_hosts_entry_names_a_host_with_any_port_or_one() {
        let allowed = [
            "Lazaret.Example.com".to_owned(),
            "proxy.local:8443".to_owned(),
        ];
        assert!(host_allowed("lazaret.example.com", at(7433), &allowed));
        assert!(host_allowed("lazaret.example.com:9", at(7433), &allowed));
        assert!(host_allowed("proxy.local:8443", at(7433), &allowed));
        assert!(!host_allowed("proxy.local:8444", at(7433), &allowed));
        assert!(!host_allowed("proxy.local", at(7433), &allowed));
        assert!(!host_allowed(
            "evil.lazaret.example.com",
            at(7433),
            &allowed
        ));
    }

    #[test]
    fn a_refusal_quotes_a_long_host_cut() {
        let e = host_refused(&"a".repeat(10_000), at(7433), &[]);
        assert!(e.message.len() < 1_000, "{}", e.message.len());
        assert!(e.message.contains("[http] allowed_hosts"), "{}", e.message);
        assert_eq!(echo("short"), "short");
    }

    #[test]
    fn an_origin_is_same_only_with_the_hosts_name_and_port() {
        assert!(same_origin("http://127.0.0.1:7433", "127.0.0.1:7433"));
        assert!(same_origin("http://LOCALHOST:7433", "localhost:7433"));
        assert!(same_origin(
            "https://lazaret.example.com",
            "lazaret.example.com"
        ));
        assert!(same_origin(
            "http://lazaret.example.com",
            "lazaret.example.com:80"
        ));
        for foreign in [
            "null",
            "http://localhost:7433",
            "http://127.0.0.1:7434",
            "http://127.0.0.1",
            "https://127.0.0.1:443",
            "file://",
            "chrome-extension://abc",
            "http://evil.example",
        ] {
            assert!(!same_origin(foreign, "127.0.0.1:7433"), "{foreign}");
        }
    }
}
