//! Connections (issue 11, item 1, and the half-closed request of item 10):
//! timeouts, the connection cap, authentication before any body is read,
//! body caps that fit each endpoint, and an answer for a client that
//! half-closed. Every test speaks raw HTTP/1.1 where a client library would
//! hide what the server does.

use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::harness::{EVENTUALLY, QUICK, Server, job, lease_req};
use crate::sockets::{Ended, addr, connect, exchange, read_reply, request};

pub const WORKER: &str = "tok-worker-0123456789";
pub const ADMIN: &str = "tok-admin-0123456789";

/// `QUICK` with a worker and an admin token, and `http` as the `[http]`
/// table (none when empty).
pub fn with_tokens(http: &str) -> String {
    let http = if http.is_empty() {
        String::new()
    } else {
        format!("[http]\n{http}\n")
    };
    format!(
        r#"{QUICK}
{http}
[[tokens]]
name = "worker"
role = "worker"
token = "{WORKER}"

[[tokens]]
name = "root"
role = "admin"
token = "{ADMIN}"
"#
    )
}

fn expect_reply(ended: Ended, what: &str) -> crate::harness::RawReply {
    match ended {
        Ended::Reply(r) => r,
        other => panic!("{what}: expected a reply, got {other:?}"),
    }
}

#[tokio::test]
async fn an_unauthenticated_body_is_refused_before_it_is_read() {
    let server = Server::start(&with_tokens("")).await;
    // Headers announce 2 MiB; not a byte of the body follows. The server
    // must answer from the headers alone.
    for (path, token) in [
        ("/v1/leases", "wrong"),
        ("/v1/jobs/1/fail", "wrong"),
        ("/v1/acks", "wrong"),
        ("/v1/dead-letters/purge", "wrong"),
        ("/v1/dead-letters/purge", WORKER),
        ("/v1/tokens", WORKER),
    ] {
        let mut s = connect(server.base()).await;
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            2 * 1024 * 1024,
            host = addr(server.base()),
        );
        s.write_all(head.as_bytes()).await.expect("head written");
        let r = expect_reply(
            read_reply(&mut s, EVENTUALLY).await,
            &format!("POST {path} as {token} with an unsent 2 MiB body"),
        );
        let (status, code) = if token == WORKER {
            (403, "FORBIDDEN")
        } else {
            (401, "UNAUTHORIZED")
        };
        assert_eq!(r.status, status, "POST {path} as {token}: {}", r.text);
        assert_eq!(r.body["error"]["code"], code, "{}", r.text);
    }
}

#[tokio::test]
async fn a_3mb_traceback_is_truncated_as_documented_not_refused() {
    let server = Server::start(&format!("{QUICK}\n[types.t]\nattempts_max = 1\n")).await;
    let api = server.api();
    let id = api.enqueue_ok(&job("t", "acme", json!({}))).await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    let traceback = "x".repeat(3 * 1024 * 1024);
    let r = api
        .fail(
            &id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "boom", "message": "m".repeat(100_000), "traceback": traceback}),
        )
        .await;
    let v = r.expect(200);
    assert_eq!(v["state"], "dead_lettered", "{v}");
    let dead = api.dead_letter_of(&id).await;
    let tb = dead["error"]["traceback"].as_str().expect("a traceback");
    let msg = dead["error"]["message"].as_str().expect("a message");
    assert!(
        tb.len() <= 16 * 1024 + 64,
        "traceback kept at {} bytes",
        tb.len()
    );
    assert!(
        msg.len() <= 4 * 1024 + 64,
        "message kept at {} bytes",
        msg.len()
    );

    // Over the 4 MiB cap of an outcome: 413 in the envelope. Sent on a raw
    // socket that reads the reply while it writes: the server answers
    // before it has read the whole body and closes, which an HTTP client
    // still writing takes for a broken pipe (this failed so under load).
    let id2 = api.enqueue_ok(&job("t", "acme", json!({}))).await;
    let leased2 = api.lease_one(&lease_req("w", 1, 30_000)).await;
    let announced: usize = 5 * 1024 * 1024;
    let head = format!(
        "POST /v1/jobs/{}/fail HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {announced}\r\nConnection: close",
        crate::harness::id_text(&id2),
        server.base().trim_start_matches("http://")
    );
    let prefix = format!(
        r#"{{"lease_token": {}, "error": {{"kind": "boom", "traceback": ""#,
        leased2["lease_token"]
    );
    let r = crate::harness::send_streamed(server.base(), &head, &prefix, announced, false).await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert_eq!(r.body["error"]["code"], "POISON", "{}", r.text);
}

/// Opens connections each running a long-poll of `wait_ms` (a request
/// running: never closed to make room) until `n` are held, retrying while
/// the harness's own connections still take places under the cap.
async fn hold_long_polls(base: &str, n: usize, wait_ms: u64) -> Vec<tokio::net::TcpStream> {
    let body = json!({"worker_id": "holder", "max_jobs": 1, "wait_ms": wait_ms}).to_string();
    let mut held = Vec::new();
    let deadline = std::time::Instant::now() + EVENTUALLY;
    while held.len() < n {
        let mut s = connect(base).await;
        s.write_all(&request(base, "POST", "/v1/leases", &[], &body))
            .await
            .expect("written");
        match read_reply(&mut s, Duration::from_millis(300)).await {
            // Still waiting: the long-poll holds its place.
            Ended::StillOpen => held.push(s),
            other => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "a long-poll never held a place: {other:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    held
}

#[tokio::test]
async fn over_the_connection_cap_a_connection_is_answered_503_with_retry_after() {
    let server = Server::start(&format!("{QUICK}\n[http]\nconnections_max = 8\n")).await;
    // Eight connections each running a long-poll: nothing to make room of.
    let held = hold_long_polls(server.base(), 8, 3000).await;
    let mut s = connect(server.base()).await;
    s.write_all(
        format!(
            "GET /v1/stats HTTP/1.1\r\nHost: {}\r\n\r\n",
            addr(server.base())
        )
        .as_bytes(),
    )
    .await
    .expect("written");
    let mut buf = Vec::new();
    let deadline = tokio::time::Instant::now() + EVENTUALLY;
    let mut tmp = [0u8; 4096];
    while let Ok(Ok(n)) = tokio::time::timeout_at(deadline, s.read(&mut tmp)).await {
        if n == 0 {
            break;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
    let text = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    assert!(text.starts_with("http/1.1 503"), "{text}");
    assert!(text.contains("\r\nretry-after: 1\r\n"), "{text}");
    assert!(text.contains("application/json"), "{text}");
    let body = &buf[buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a head")
        + 4..];
    let body: Value = serde_json::from_slice(body).expect("a JSON body");
    assert_eq!(body["error"]["code"], "UNAVAILABLE", "{body}");
    // Once the long-polls end, the server serves again.
    drop(held);
    let deadline = std::time::Instant::now() + EVENTUALLY;
    loop {
        let r = exchange(
            server.base(),
            &request(server.base(), "GET", "/v1/stats", &[], ""),
            false,
        )
        .await;
        if matches!(&r, Ended::Reply(r) if r.status == 200) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never served again: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn at_the_cap_the_connection_idle_the_longest_makes_room() {
    let server = Server::start(&format!("{QUICK}\n[http]\nconnections_max = 6\n")).await;
    // Two long-polls and four idle sockets fill the cap.
    let _polls = hold_long_polls(server.base(), 2, 20_000).await;
    let mut idle = Vec::new();
    for _ in 0..4 {
        idle.push(connect(server.base()).await);
    }
    // A normal client is served: the oldest idle socket made room.
    for n in 0..3 {
        let r = match exchange(
            server.base(),
            &request(server.base(), "GET", "/v1/stats", &[], ""),
            false,
        )
        .await
        {
            Ended::Reply(r) => r,
            other => panic!("request {n}: {other:?}"),
        };
        assert_eq!(r.status, 200, "request {n}: {}", r.text);
    }
    let mut closed = 0;
    for s in &mut idle {
        if matches!(
            read_reply(s, Duration::from_millis(500)).await,
            Ended::Closed
        ) {
            closed += 1;
        }
    }
    assert!(closed >= 1, "no idle connection was closed to make room");
}

#[tokio::test]
async fn a_slow_header_is_cut_off_and_an_idle_connection_closed() {
    let server = Server::start(&format!(
        "{QUICK}\n[http]\nheader_read_timeout_ms = 300\nidle_timeout_ms = 600\n"
    ))
    .await;
    // Slowloris: half a request line, then nothing.
    let mut slow = connect(server.base()).await;
    slow.write_all(
        format!(
            "POST /v1/jobs HTTP/1.1\r\nHost: {}\r\nX-A: ",
            addr(server.base())
        )
        .as_bytes(),
    )
    .await
    .expect("written");
    // Idle: connected, nothing sent.
    let mut idle = connect(server.base()).await;
    assert!(
        matches!(read_reply(&mut slow, EVENTUALLY).await, Ended::Closed),
        "a request whose headers never end is cut off"
    );
    assert!(
        matches!(read_reply(&mut idle, EVENTUALLY).await, Ended::Closed),
        "an idle connection is closed"
    );
    // After a request, an idle keep-alive connection is closed too.
    let mut kept = connect(server.base()).await;
    kept.write_all(&request(server.base(), "GET", "/v1/stats", &[], ""))
        .await
        .expect("written");
    expect_reply(read_reply(&mut kept, EVENTUALLY).await, "stats");
    assert!(
        matches!(read_reply(&mut kept, EVENTUALLY).await, Ended::Closed),
        "an idle keep-alive connection is closed"
    );
}

#[tokio::test]
async fn a_long_poll_outlives_the_idle_timeout() {
    let server = Server::start(&format!(
        "{QUICK}\n[http]\nheader_read_timeout_ms = 200\nidle_timeout_ms = 200\n"
    ))
    .await;
    // Waits 1.5 s for a job that never comes: seven idle timeouts.
    let body = json!({"worker_id": "w", "max_jobs": 1, "wait_ms": 1500}).to_string();
    let r = expect_reply(
        exchange(
            server.base(),
            &request(server.base(), "POST", "/v1/leases", &[], &body),
            false,
        )
        .await,
        "a long-poll",
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body, json!({"jobs": []}));
}

#[tokio::test]
async fn a_stalled_body_is_cut_off() {
    let server = Server::start(&format!("{QUICK}\n[http]\nbody_read_timeout_ms = 300\n")).await;
    for path in ["/v1/leases", "/v1/jobs"] {
        let mut s = connect(server.base()).await;
        s.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"wor",
                addr(server.base())
            )
            .as_bytes(),
        )
        .await
        .expect("written");
        match read_reply(&mut s, EVENTUALLY).await {
            Ended::Reply(r) => {
                assert!(
                    r.status >= 400 && r.status < 500,
                    "{path}: {} {}",
                    r.status,
                    r.text
                );
                assert!(r.body["error"]["code"].is_string(), "{path}: {}", r.text);
            }
            Ended::Closed => {}
            Ended::StillOpen => panic!("{path}: a stalled body held the connection"),
        }
    }
}

#[tokio::test]
async fn a_half_closed_request_is_answered_and_what_it_did_is_visible() {
    let server = Server::start(QUICK).await;
    let body = job("t", "acme", json!({"n": 1})).to_string();
    // The client sends its whole request, then shuts its write side.
    let r = expect_reply(
        exchange(
            server.base(),
            &request(server.base(), "POST", "/v1/jobs", &[], &body),
            true,
        )
        .await,
        "a half-closed enqueue",
    );
    assert_eq!(r.status, 201, "{}", r.text);
    let id = r.body["id"].clone();
    let seen: Value = server.api().job(&id).await;
    assert_eq!(seen["state"], "queued", "{seen}");

    // The same for a lease and its ack: answered, so the worker knows.
    let lease = json!({"worker_id": "w", "max_jobs": 1}).to_string();
    let r = expect_reply(
        exchange(
            server.base(),
            &request(server.base(), "POST", "/v1/leases", &[], &lease),
            true,
        )
        .await,
        "a half-closed lease",
    );
    assert_eq!(r.status, 200, "{}", r.text);
    let leased = &r.body["jobs"][0];
    assert_eq!(leased["id"], id, "{}", r.text);
    let ack = json!({"lease_token": leased["lease_token"]}).to_string();
    let path = format!("/v1/jobs/{}/ack", crate::harness::id_text(&id));
    let r = expect_reply(
        exchange(
            server.base(),
            &request(server.base(), "POST", &path, &[], &ack),
            true,
        )
        .await,
        "a half-closed ack",
    );
    assert_eq!(r.status, 200, "{}", r.text);
    assert_eq!(r.body["state"], "succeeded", "{}", r.text);
}
