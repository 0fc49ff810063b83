//! The client commands against a tiny in-test HTTP stub: what goes on the
//! wire for given flags, and what the operator sees. End-to-end tests
//! against the real server live elsewhere.

use std::sync::{Arc, Mutex};

use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

#[derive(Debug, Parser)]
#[command(name = "lazaret")]
struct TestCli {
    #[command(flatten)]
    global: GlobalOpts,
    #[command(subcommand)]
    command: ClientCommand,
}

/// One request as the stub saw it.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    target: String,
    authorization: Option<String>,
    body: String,
}

/// A canned reply: status, extra header lines, body.
type Canned = (u16, &'static str, Vec<u8>);

/// Serves `replies` in order, one per connection, and records the requests.
async fn stub(replies: Vec<Canned>) -> (String, Arc<Mutex<Vec<Seen>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    tokio::spawn(async move {
        for (status, headers, body) in replies {
            let (mut sock, _) = listener.accept().await.unwrap();
            let mut buf = Vec::new();
            let head_end = loop {
                let mut chunk = [0u8; 4096];
                let n = sock.read(&mut chunk).await.unwrap();
                assert!(n > 0, "client closed early");
                buf.extend_from_slice(&chunk[..n]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
            };
            let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
            let header = |name: &str| {
                head.lines().find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
                })
            };
            let len: usize = header("content-length").map_or(0, |v| v.parse().unwrap());
            while buf.len() < head_end + len {
                let mut chunk = [0u8; 4096];
                let n = sock.read(&mut chunk).await.unwrap();
                buf.extend_from_slice(&chunk[..n]);
            }
            let mut request_line = head.lines().next().unwrap().split(' ');
            log.lock().unwrap().push(Seen {
                method: request_line.next().unwrap().to_owned(),
                target: request_line.next().unwrap().to_owned(),
                authorization: header("authorization"),
                body: String::from_utf8_lossy(&buf[head_end..head_end + len]).to_string(),
            });
            let reply = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n{headers}\
                 content-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            sock.write_all(reply.as_bytes()).await.unwrap();
            sock.write_all(&body).await.unwrap();
            sock.shutdown().await.unwrap();
        }
    });
    (url, seen)
}

fn ok(status: u16, body: &str) -> Canned {
    (status, "", body.as_bytes().to_vec())
}

/// Parses `args` with `--server url` added and runs the command; returns stdout.
async fn lazaret(url: &str, token: Option<&str>, args: &[&str]) -> (anyhow::Result<()>, String) {
    let argv = ["lazaret"]
        .into_iter()
        .chain(args.iter().copied())
        .chain(["--server", url]);
    let mut parsed = TestCli::try_parse_from(argv).unwrap();
    // The environment's LAZARET_TOKEN must not leak into these tests.
    parsed.global.token = token.map(str::to_owned);
    let cli = errors::client(&parsed.global).unwrap();
    let mut out = Vec::new();
    let result = execute(parsed.command, &cli, parsed.global.json, &mut out, None).await;
    (result, String::from_utf8(out).unwrap())
}

#[tokio::test]
async fn enqueue_posts_the_job_with_the_token_and_prints_the_admission() {
    let (url, seen) = stub(vec![ok(
        201,
        r#"{"id":"j1","state":"queued","admission":"FAIR_QUEUE"}"#,
    )])
    .await;
    let (result, out) = lazaret(
        &url,
        Some("tok"),
        &[
            "enqueue",
            "send_email",
            "--tenant",
            "acme",
            "--payload",
            r#"{"n": 1.0}"#,
        ],
    )
    .await;
    result.unwrap();
    let seen = seen.lock().unwrap()[0].clone();
    assert_eq!(
        (seen.method.as_str(), seen.target.as_str()),
        ("POST", "/v1/jobs")
    );
    assert_eq!(seen.authorization.as_deref(), Some("Bearer tok"));
    assert_eq!(
        seen.body,
        r#"{"type":"send_email","tenant":"acme","payload":{"n": 1.0}}"#
    );
    assert!(out.starts_with("id:         j1\nstate:      queued\nadmission:  FAIR_QUEUE\n"));
}

#[tokio::test]
async fn json_prints_the_reply_as_is() {
    let body = r#"{"reasons": [], "extra": {"kept": true}}"#;
    let (url, seen) = stub(vec![ok(200, body)]).await;
    let (result, out) = lazaret(&url, None, &["dlq", "reasons", "--json"]).await;
    result.unwrap();
    assert_eq!(out, format!("{body}\n"));
    assert_eq!(seen.lock().unwrap()[0].target, "/v1/dead-letters/reasons");
    assert_eq!(seen.lock().unwrap()[0].authorization, None);
}

#[tokio::test]
async fn dlq_ls_sends_filters_and_paging_as_query() {
    let (url, seen) = stub(vec![ok(200, r#"{"items":[],"next_cursor":null}"#)]).await;
    let (result, out) = lazaret(
        &url,
        None,
        &[
            "dlq",
            "ls",
            "--type",
            "send email",
            "--reason",
            "exhausted",
            "--limit",
            "5",
            "--cursor",
            "c&1",
        ],
    )
    .await;
    result.unwrap();
    assert_eq!(
        seen.lock().unwrap()[0].target,
        "/v1/dead-letters?type=send+email&reason=exhausted&limit=5&cursor=c%261"
    );
    assert_eq!(out, "no dead letters match\n");
}

#[tokio::test]
async fn a_server_error_reads_code_reason_message_and_keeps_its_body() {
    let body = r#"{"error":{"code":"NOT_FOUND","reason":null,"message":"no job j9"}}"#;
    let (url, _) = stub(vec![ok(404, body)]).await;
    let (result, out) = lazaret(&url, None, &["jobs", "show", "j9"]).await;
    let err = result.unwrap_err();
    assert_eq!(format!("{err:#}"), "NOT_FOUND: no job j9");
    assert_eq!(
        err.downcast_ref::<ServerError>().unwrap().body,
        body.as_bytes()
    );
    assert!(out.is_empty());
}

#[tokio::test]
async fn unauthorized_without_a_token_says_to_set_one() {
    let body = r#"{"error":{"code":"UNAUTHORIZED","reason":null,"message":"token required"}}"#;
    let (url, _) = stub(vec![ok(401, body)]).await;
    let (result, _) = lazaret(&url, None, &["stats"]).await;
    assert_eq!(
        format!("{:#}", result.unwrap_err()),
        "UNAUTHORIZED: token required\n  hint: no token was sent: set LAZARET_TOKEN (or pass --token)"
    );
}

#[tokio::test]
async fn a_connection_refused_names_the_url_and_suggests_serve() {
    let url = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    }; // dropped: nothing listens there now
    let (result, _) = lazaret(&url, None, &["stats"]).await;
    let msg = format!("{:#}", result.unwrap_err());
    assert!(msg.contains(&url), "{msg}");
    assert!(msg.contains("lazaret serve"), "{msg}");
}

#[tokio::test]
async fn redrive_posts_the_selection_and_prints_counts() {
    let (url, seen) = stub(vec![ok(200, r#"{"matched":2,"redriven":0,"job_ids":[]}"#)]).await;
    let (result, out) = lazaret(
        &url,
        None,
        &[
            "dlq",
            "redrive",
            "--reason",
            "crash_loop",
            "--dry-run",
            "--rate",
            "10",
        ],
    )
    .await;
    result.unwrap();
    let seen = seen.lock().unwrap()[0].clone();
    assert_eq!(seen.target, "/v1/dead-letters/redrive");
    let body: Value = serde_json::from_str(&seen.body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"filter": {"reason": "crash_loop"}, "dry_run": true, "rate_per_sec": 10})
    );
    assert!(
        out.contains("matched:   2\n") && out.contains("dry run"),
        "{out}"
    );
}

#[tokio::test]
async fn redrive_by_source_prints_each_item_and_fails_when_one_stayed() {
    let reply = r#"{"matched":2,"redriven":1,"job_ids":[],"not_found":[],"dry_run":false,
        "skipped_admission_records":0,"items":[
        {"dead_letter_id":"5","job_id":null,"source":"orders","message_id":"m-1","redriven":true,"error":null},
        {"dead_letter_id":"6","job_id":null,"source":"orders","message_id":"m-2","redriven":false,
         "error":"source \"orders\" is not connected to its broker yet"}]}"#;
    let (url, seen) = stub(vec![ok(200, reply)]).await;
    let (result, out) = lazaret(&url, None, &["dlq", "redrive", "--source", "orders"]).await;
    let err = result.unwrap_err();
    assert!(
        err.to_string()
            .contains("1 dead letter(s) were not redriven"),
        "{err:#}"
    );
    assert!(err.downcast_ref::<Refused>().is_none(), "exit 1, not 2");
    let body: Value = serde_json::from_str(&seen.lock().unwrap()[0].body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"filter": {"source": "orders"}, "dry_run": false})
    );
    assert!(
        out.contains("\n5            -       orders  m-1         redriven\n"),
        "{out}"
    );
    assert!(
        out.contains("not redriven: source \"orders\" is not connected"),
        "{out}"
    );
}

#[tokio::test]
async fn dlq_ls_filters_by_source() {
    let page = r#"{"items":[{"id":"5","job_id":null,"type":"orders","reason":"permanent",
        "stage":"processing","source":{"name":"orders","broker":"redis"}}],"next_cursor":null}"#;
    let (url, seen) = stub(vec![ok(200, page)]).await;
    let (result, out) = lazaret(&url, None, &["dlq", "ls", "--source", "orders"]).await;
    result.unwrap();
    assert_eq!(
        seen.lock().unwrap()[0].target,
        "/v1/dead-letters?source=orders"
    );
    assert!(out.starts_with("ID  JOB_ID  SOURCE  TYPE"), "{out}");
    assert!(out.contains("\n5   -       orders  orders"), "{out}");
}

#[tokio::test]
async fn dlq_ls_finds_the_dead_letter_of_a_job() {
    let (url, seen) = stub(vec![ok(200, r#"{"items":[],"next_cursor":null}"#)]).await;
    let (result, _) = lazaret(&url, None, &["dlq", "ls", "--job-id", "41", "--limit", "1"]).await;
    result.unwrap();
    assert_eq!(
        seen.lock().unwrap()[0].target,
        "/v1/dead-letters?job_id=41&limit=1"
    );
}

#[tokio::test]
async fn redrive_without_a_selection_sends_nothing() {
    // No stub: a request would fail to connect instead of being refused.
    let (result, _) = lazaret("http://127.0.0.1:9", None, &["dlq", "redrive"]).await;
    let err = result.unwrap_err();
    assert!(err.downcast_ref::<Refused>().is_some(), "{err:#}");
}

#[tokio::test]
async fn purge_without_confirm_counts_every_page_and_refuses() {
    let item =
        |id: &str| format!(r#"{{"id":"{id}","job_id":"j","type":"t","reason":"exhausted"}}"#);
    let page1 = format!(
        r#"{{"items":[{},{}],"next_cursor":"c2"}}"#,
        item("d1"),
        item("d2")
    );
    let page2 = format!(r#"{{"items":[{}],"next_cursor":null}}"#, item("d3"));
    let (url, seen) = stub(vec![ok(200, &page1), ok(200, &page2)]).await;
    let (result, out) = lazaret(&url, None, &["dlq", "purge", "--type", "t"]).await;
    let err = result.unwrap_err();
    assert!(err.downcast_ref::<Refused>().is_some());
    assert!(err.to_string().contains("--confirm"), "{err}");
    assert!(
        out.starts_with("would purge 3 dead letter(s) matching type=t\n"),
        "{out}"
    );
    let seen = seen.lock().unwrap();
    assert!(seen.iter().all(|s| s.method == "GET"), "no purge was sent");
    assert_eq!(
        seen[1].target,
        "/v1/dead-letters?type=t&limit=500&cursor=c2"
    );
}

#[tokio::test]
async fn purge_by_ids_without_confirm_reports_missing_ones() {
    let found = r#"{"id":"d1","job_id":"j1","type":"t","reason":"permanent"}"#;
    let missing = r#"{"error":{"code":"NOT_FOUND","reason":null,"message":"no dead letter d2"}}"#;
    let (url, _) = stub(vec![ok(200, found), ok(404, missing)]).await;
    let (result, out) = lazaret(&url, None, &["dlq", "purge", "--id", "d1", "--id", "d2"]).await;
    assert!(result.is_err());
    assert!(
        out.contains("would purge 1 dead letter(s) matching ids d1, d2"),
        "{out}"
    );
    assert!(out.ends_with("not found: d2\n"), "{out}");
}

#[tokio::test]
async fn purge_with_confirm_posts_it() {
    let (url, seen) = stub(vec![ok(200, r#"{"purged":1}"#)]).await;
    let (result, out) = lazaret(
        &url,
        Some("admin"),
        &["dlq", "purge", "--id", "d1", "--confirm"],
    )
    .await;
    result.unwrap();
    let seen = seen.lock().unwrap()[0].clone();
    assert_eq!(seen.target, "/v1/dead-letters/purge");
    assert_eq!(seen.body, r#"{"ids":["d1"],"confirm":true}"#);
    assert_eq!(out, "purged:  1\n");
}

#[tokio::test]
async fn the_payload_streams_byte_for_byte_to_stdout_or_a_file() {
    let bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let (url, seen) = stub(vec![(200, "", bytes.clone()), (200, "", bytes.clone())]).await;
    let cmd = TestCli::try_parse_from(["lazaret", "dlq", "payload", "d/1"])
        .unwrap()
        .command;
    let cli = errors::client(&GlobalOpts {
        server: Some(url.clone()),
        ..GlobalOpts::default()
    })
    .unwrap();
    let mut out = Vec::new();
    execute(cmd, &cli, false, &mut out, None).await.unwrap();
    assert_eq!(out, bytes);
    assert_eq!(
        seen.lock().unwrap()[0].target,
        "/v1/dead-letters/d%2F1/payload"
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("payload.bin");
    let (result, out) = lazaret(
        &url,
        None,
        &["dlq", "payload", "d1", "--output", path.to_str().unwrap()],
    )
    .await;
    result.unwrap();
    assert!(out.is_empty());
    assert_eq!(std::fs::read(&path).unwrap(), bytes);
}

#[tokio::test]
async fn a_missing_payload_leaves_no_file() {
    let body = r#"{"error":{"code":"NOT_FOUND","reason":null,"message":"no dead letter d1"}}"#;
    let (url, _) = stub(vec![ok(404, body)]).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.json");
    let (result, _) = lazaret(
        &url,
        None,
        &["dlq", "payload", "d1", "--output", path.to_str().unwrap()],
    )
    .await;
    assert!(result.is_err());
    assert!(!path.exists());
}

#[tokio::test]
async fn a_reply_that_is_not_an_api_error_still_says_what_happened() {
    let (url, _) = stub(vec![(502, "", b"<html>bad gateway</html>".to_vec())]).await;
    let (result, _) = lazaret(&url, None, &["stats"]).await;
    let msg = format!("{:#}", result.unwrap_err());
    assert!(msg.starts_with("HTTP 502 Bad Gateway from "), "{msg}");
    assert!(msg.ends_with("<html>bad gateway</html>"), "{msg}");
}

#[tokio::test]
async fn tokens_create_ls_and_revoke_speak_the_tokens_api() {
    let (url, seen) = stub(vec![
        ok(
            201,
            r#"{"name":"ci-bot","role":"producer","token":"lzt_abc","created_at":"2026-11-30T09:00:00Z"}"#,
        ),
        ok(
            200,
            r#"{"items":[{"name":"root","role":"admin","source":"config","created_at":null,"created_by":null},{"name":"ci-bot","role":"producer","source":"api","created_at":"2026-11-30T09:00:00Z","created_by":"root"}]}"#,
        ),
        ok(200, r#"{"name":"ci-bot","revoked":true}"#),
    ])
    .await;
    let (result, created) = lazaret(
        &url,
        Some("adm"),
        &["tokens", "create", "ci-bot", "--role", "producer"],
    )
    .await;
    result.unwrap();
    assert!(
        created.contains("token:") && created.contains("lzt_abc"),
        "{created}"
    );
    assert!(created.contains("shown this once"), "{created}");
    let (result, listed) = lazaret(&url, Some("adm"), &["tokens", "ls"]).await;
    result.unwrap();
    let rows: Vec<&str> = listed.lines().collect();
    assert_eq!(rows.len(), 3, "{listed}");
    assert!(rows[0].starts_with("NAME") && rows[0].contains("SOURCE"));
    assert!(rows[2].contains("ci-bot") && rows[2].contains("api") && rows[2].contains("root"));
    let (result, revoked) = lazaret(&url, Some("adm"), &["tokens", "revoke", "ci-bot"]).await;
    result.unwrap();
    assert!(revoked.contains("ci-bot"), "{revoked}");

    let seen = seen.lock().unwrap().clone();
    let calls: Vec<(&str, &str)> = seen
        .iter()
        .map(|s| (s.method.as_str(), s.target.as_str()))
        .collect();
    assert_eq!(
        calls,
        vec![
            ("POST", "/v1/tokens"),
            ("GET", "/v1/tokens"),
            ("DELETE", "/v1/tokens/ci-bot")
        ]
    );
    assert_eq!(seen[0].body, r#"{"name":"ci-bot","role":"producer"}"#);
    assert!(
        seen.iter()
            .all(|s| s.authorization.as_deref() == Some("Bearer adm"))
    );
}

#[test]
fn tokens_create_refuses_an_unknown_role_before_sending() {
    let err = TestCli::try_parse_from(["lazaret", "tokens", "create", "x", "--role", "root"])
        .expect_err("root is not a role");
    assert!(err.to_string().contains("producer"), "{err}");
}

#[tokio::test]
async fn pause_and_resume_post_the_target() {
    let (url, seen) = stub(vec![
        ok(200, r#"{"ok":true,"paused":true}"#),
        ok(200, r#"{"ok":true,"paused":false}"#),
    ])
    .await;
    let (result, paused) = lazaret(&url, Some("op"), &["pause", "--type", "send_email"]).await;
    result.unwrap();
    let (result, resumed) = lazaret(&url, Some("op"), &["resume", "--lane", "batch"]).await;
    result.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(
        (seen[0].target.as_str(), seen[0].body.as_str()),
        ("/v1/pause", r#"{"type":"send_email"}"#)
    );
    assert_eq!(
        (seen[1].target.as_str(), seen[1].body.as_str()),
        ("/v1/resume", r#"{"lane":"batch"}"#)
    );
    assert!(paused.starts_with("paused type send_email:"), "{paused}");
    assert_eq!(resumed, "resumed lane batch\n");
}

#[tokio::test]
async fn jobs_ls_and_cancel_speak_the_jobs_api() {
    let page = r#"{"items":[{"id":"12","type":"t","tenant":"acme","lane":"default","state":"queued",
        "attempt":0,"created_at":"2026-12-01T21:00:00.123Z","run_at":null,"dead_letter_id":null}],
        "next_cursor":"12"}"#;
    let (url, seen) = stub(vec![
        ok(200, page),
        ok(200, r#"{"state":"cancelled"}"#),
        ok(200, r#"{"state":"leased","cancel_requested":true}"#),
    ])
    .await;
    let (result, listed) = lazaret(
        &url,
        None,
        &[
            "jobs", "ls", "--state", "queued", "--tenant", "acme", "--limit", "1",
        ],
    )
    .await;
    result.unwrap();
    let (result, cancelled) = lazaret(&url, None, &["jobs", "cancel", "12"]).await;
    result.unwrap();
    let (result, requested) = lazaret(&url, None, &["jobs", "cancel", "13"]).await;
    result.unwrap();
    let seen = seen.lock().unwrap().clone();
    let calls: Vec<(&str, &str)> = seen
        .iter()
        .map(|s| (s.method.as_str(), s.target.as_str()))
        .collect();
    assert_eq!(
        calls,
        [
            ("GET", "/v1/jobs?state=queued&tenant=acme&limit=1"),
            ("POST", "/v1/jobs/12/cancel"),
            ("POST", "/v1/jobs/13/cancel")
        ]
    );
    assert!(
        listed.contains("\n12  t     acme    default  queued"),
        "{listed}"
    );
    assert!(listed.ends_with("next cursor: 12  (add --cursor to see the next page)\n"));
    assert_eq!(cancelled, "cancelled job 12: it will not be leased again\n");
    assert!(
        requested.starts_with("job 13 is leased: cancel requested"),
        "{requested}"
    );
}

#[tokio::test]
async fn audit_sends_its_filters_and_breakers_show_what_is_not_closed() {
    let (url, seen) = stub(vec![
        ok(200, r#"{"items":[],"next_cursor":null}"#),
        ok(
            200,
            r#"{"breakers":[{"type":"t","kind":"http_503","state":"open","until":"2026-12-01T21:00:10Z"},
                {"type":"u","kind":"timeout","state":"closed","until":null}]}"#,
        ),
    ])
    .await;
    let (result, audit) = lazaret(
        &url,
        None,
        &["audit", "--action", "redrive", "--cursor", "9"],
    )
    .await;
    result.unwrap();
    let (result, breakers) = lazaret(&url, None, &["breakers"]).await;
    result.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen[0].target, "/v1/audit?action=redrive&cursor=9");
    assert_eq!(seen[1].target, "/v1/breakers");
    assert_eq!(audit, "no audit entries match\n");
    assert_eq!(
        breakers,
        "TYPE  KIND      STATE  UNTIL\nt     http_503  open   2026-12-01T21:00:10Z\n"
    );
}

#[tokio::test]
async fn a_redrive_dry_run_lists_its_rows_and_fails_naming_unknown_ids() {
    let reply = r#"{"matched":1,"redriven":0,"job_ids":[],"not_found":["d9"],"dry_run":true,
        "skipped_admission_records":0,
        "items":[{"dead_letter_id":"d1","job_id":"j1","source":null,"message_id":null}]}"#;
    let (url, seen) = stub(vec![ok(200, reply)]).await;
    let (result, out) = lazaret(
        &url,
        None,
        &["dlq", "redrive", "--id", "d1", "--id", "d9", "--dry-run"],
    )
    .await;
    let err = result.unwrap_err();
    assert_eq!(errors::exit_code(&err), ExitCode::Failed);
    let msg = format!("{err:#}");
    assert!(
        msg.starts_with("1 id(s) match no dead letter that can be redriven: d9;"),
        "{msg}"
    );
    assert_eq!(
        serde_json::from_str::<Value>(&seen.lock().unwrap()[0].body).unwrap(),
        serde_json::json!({"ids": ["d1", "d9"], "dry_run": true})
    );
    assert!(out.contains("dry run: nothing was redriven\n"), "{out}");
    assert!(
        out.contains("\nd1           j1      -       -           would be redriven\n"),
        "{out}"
    );
}

#[tokio::test]
async fn json_prints_an_error_body_as_is() {
    let body =
        r#"{"error":{"code":"FORBIDDEN","reason":null,"message":"purge needs admin","x":1}}"#;
    let (url, _) = stub(vec![ok(403, body)]).await;
    let (result, _) = lazaret(&url, Some("op"), &["stats", "--json"]).await;
    let err = result.unwrap_err();
    assert_eq!(
        err.downcast_ref::<ServerError>().unwrap().body,
        body.as_bytes()
    );
    assert!(
        format!("{err:#}").contains("hint: this token's role may not do this"),
        "{err:#}"
    );
    assert_eq!(errors::exit_code(&err), ExitCode::Failed);
}

#[tokio::test]
async fn an_unreachable_server_exits_3() {
    let url = {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let (result, _) = lazaret(&url, None, &["breakers"]).await;
    assert_eq!(
        errors::exit_code(&result.unwrap_err()),
        ExitCode::Unreachable
    );
}

#[tokio::test]
async fn dlq_correct_sends_the_payload_bytes_the_reason_and_prints_both_hashes() {
    let reply = r#"{"redriven":true,"dead_letter_id":"7","job_id":"12","source":null,"message_id":null,
        "payload_size":11,"payload_sha256":"aa","previous_payload_sha256":"bb"}"#;
    let (url, seen) = stub(vec![ok(200, reply)]).await;
    let (result, out) = lazaret(
        &url,
        Some("op"),
        &[
            "dlq",
            "correct",
            "7",
            "--payload",
            r#"{"n": 1.0}"#,
            "--reason",
            "TICKET-9",
            "--schema-version",
            "2",
        ],
    )
    .await;
    result.unwrap();
    let seen = seen.lock().unwrap()[0].clone();
    assert_eq!(seen.target, "/v1/dead-letters/7/redrive");
    assert_eq!(
        seen.body,
        r#"{"payload":{"n": 1.0},"reason":"TICKET-9","schema_version":2}"#
    );
    assert_eq!(
        out,
        "redriven:         7\njob_id:           12\npayload_size:     11\n\
         payload_sha256:   aa\nprevious_sha256:  bb\n"
    );
    let (result, _) = lazaret(
        &url,
        None,
        &["dlq", "correct", "7", "--payload", "{", "--reason", "x"],
    )
    .await;
    assert_eq!(errors::exit_code(&result.unwrap_err()), ExitCode::Usage);
}

#[tokio::test]
async fn a_redirected_redrive_sends_to_and_fails_naming_what_admission_refused() {
    let reply = r#"{"matched":2,"redriven":1,"job_ids":["j1"],"not_found":[],"dry_run":false,
        "skipped_admission_records":0,"held_skipped":3,"to":{"type":"repair","lane":"fix"},
        "refused":[{"dead_letter_id":"d2","job_id":"j2","code":"POISON","reason":"schema_invalid",
                    "message":"type \"repair\" refuses its payload as a new enqueue would: no order"}],
        "items":[
        {"dead_letter_id":"d1","job_id":"j1","source":null,"message_id":null,"redriven":true,"error":null,
         "to":{"type":"repair","lane":"fix"},"refused":null},
        {"dead_letter_id":"d2","job_id":"j2","source":null,"message_id":null,"redriven":false,
         "error":"type \"repair\" refuses its payload as a new enqueue would: no order",
         "to":{"type":"repair","lane":"fix"},
         "refused":{"code":"POISON","reason":"schema_invalid","message":"no order"}}]}"#;
    let (url, seen) = stub(vec![ok(200, reply)]).await;
    let (result, out) = lazaret(
        &url,
        None,
        &[
            "dlq",
            "redrive",
            "--group",
            "g1",
            "--to-type",
            "repair",
            "--to-lane",
            "fix",
        ],
    )
    .await;
    let err = result.unwrap_err();
    assert!(
        err.to_string()
            .starts_with("1 job(s) were refused by the admission of the type they were sent to"),
        "{err:#}"
    );
    assert_eq!(
        serde_json::from_str::<Value>(&seen.lock().unwrap()[0].body).unwrap(),
        serde_json::json!({"filter": {"group": "g1"}, "dry_run": false,
                           "to": {"type": "repair", "lane": "fix"}})
    );
    assert!(out.contains("sent to: type repair, lane fix\n"), "{out}");
    assert!(out.contains("skipped 3 held dead letter(s)"), "{out}");
    assert!(
        out.contains("refused by the new type's admission:\n  d2  type \"repair\" refuses"),
        "{out}"
    );
}

#[tokio::test]
async fn dlq_show_prints_held_and_the_lineage() {
    let reply = r#"{"id":"d3","job_id":"j1","type":"resize","tenant":"acme","lane":"default",
        "stage":"processing","reason":"permanent","attempts":1,"idempotency_key":null,
        "redrive_count":2,"held":true,"created_at":"2026-12-06T09:00:00.000Z",
        "dead_lettered_at":"2026-12-06T10:00:00.000Z","payload_size":2,"payload_sha256":"x",
        "error":null,"history":[],"source":null,"payload_preview":null,
        "lineage":[
         {"redrive_id":"r-1","at":"2026-12-06T09:10:00.000Z","actor":"ops-alice","from_group":"g1",
          "payload_edited":false,"to":null,
          "outcome":{"state":"dead_lettered","failed_again":true,"group":"g2","current":false}},
         {"redrive_id":"r-2","at":"2026-12-06T09:40:00.000Z","actor":"ops-bob","from_group":"g2",
          "payload_edited":true,"to":{"type":"repair","lane":null},
          "outcome":{"state":"dead_lettered","failed_again":true,"group":"g3","current":true}}]}"#;
    let (url, _) = stub(vec![ok(200, reply)]).await;
    let (result, out) = lazaret(&url, None, &["dlq", "show", "d3"]).await;
    result.unwrap();
    assert!(out.contains("held:"), "{out}");
    assert!(out.contains("\nlineage:\n"), "{out}");
    assert!(out.contains("failed again into group g2"), "{out}");
    assert!(out.contains("repair/-"), "{out}");
    assert!(out.contains("now dead_lettered (group g3)"), "{out}");
}

#[tokio::test]
async fn dlq_report_prints_what_a_redrive_did_and_the_groups() {
    let reply = r#"{"id":"r-7","at":"2026-12-06T09:10:00.000Z","actor":"ops-alice","request":{},
        "sent":5,"jobs":3,"messages":2,"succeeded":2,"running":1,"failed_again":2,"cancelled":0,
        "gone":0,"from_groups":[{"group":"g1","count":5}],
        "failed_again_groups":[{"group":"g2","count":2}]}"#;
    let (url, seen) = stub(vec![ok(200, reply)]).await;
    let (result, out) = lazaret(&url, None, &["dlq", "report", "r-7"]).await;
    result.unwrap();
    assert_eq!(seen.lock().unwrap()[0].target, "/v1/redrives/r-7");
    for line in [
        "redrive:",
        "sent:",
        "failed again:",
        "from group g1: 5\n",
        "failed again into g2: 2\n",
    ] {
        assert!(out.contains(line), "{line:?} in {out}");
    }
    assert!(out.contains("succeeded:") && out.contains(" 2\n"), "{out}");
}
