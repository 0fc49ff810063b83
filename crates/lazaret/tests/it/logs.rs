//! The server's log on stderr as a log shipper reads it: no colour codes
//! when stderr is a file, one JSON object per line with
//! `LAZARET_LOG_FORMAT=json`, `LAZARET_LOG` as the filter, and a bad
//! `--log-format` refused by name.

use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};

use crate::harness::{EVENTUALLY, QUICK, Server, id_text, job, lease_req};

/// A Redis source on port 1, where nothing listens: the server warns that
/// it keeps retrying, a WARN line with fields, the kind that carried the
/// most colour codes.
fn config_with_a_warning() -> String {
    format!(
        r#"{QUICK}
[[sources]]
name = "orders"
broker = "redis"
url = "redis://127.0.0.1:1"
queue = "orders"
deliver = "http://127.0.0.1:9/orders"
"#
    )
}

/// Some ordinary traffic: enqueues, a lease, an ack, a fail to the dead
/// letters, a refused request.
async fn some_requests(server: &Server) {
    let api = server.api();
    for n in 0..2 {
        api.enqueue_ok(&job("logs.email", "acme", json!({"n": n})))
            .await;
    }
    let mut jobs = Vec::new();
    while jobs.len() < 2 {
        jobs.extend(api.lease_eventually(&lease_req("w-logs", 2, 30_000)).await);
    }
    let ack = api
        .post(
            &format!("/v1/jobs/{}/ack", id_text(&jobs[0]["id"])),
            &json!({"lease_token": jobs[0]["lease_token"]}),
        )
        .await;
    assert_eq!(ack.status, 200, "ack: {}", ack.text());
    let fail = api
        .post(
            &format!("/v1/jobs/{}/fail", id_text(&jobs[1]["id"])),
            &json!({"lease_token": jobs[1]["lease_token"],
                    "error": {"class": "permanent", "kind": "bad_input", "message": "no"}}),
        )
        .await;
    assert_eq!(fail.status, 200, "fail: {}", fail.text());
    assert_eq!(api.get("/v1/no-such-route").await.status, 404);
}

/// Waits until the server's stderr holds `needle` (lines reach the file
/// after the request that caused them) and returns it.
async fn wait_log(server: &Server, needle: &str) -> String {
    let deadline = std::time::Instant::now() + EVENTUALLY;
    loop {
        let log = server.log();
        if log.contains(needle) {
            return log;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the server never logged {needle:?} within {EVENTUALLY:?}; its stderr:\n{log}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_log_on_a_file_carries_no_colour_codes() {
    // The harness sends stderr to a file: not a terminal, so no colour,
    // whatever the format's default.
    let server = Server::start_env(&config_with_a_warning(), &[("LAZARET_LOG", "info")]).await;
    some_requests(&server).await;
    let log = wait_log(&server, "keeps retrying").await;
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("keeps retrying")),
        "a WARN line about the source: {log}"
    );
    assert!(
        !log.as_bytes().contains(&0x1b),
        "no ESC byte (ANSI colour code) in a log written to a file:\n{}",
        log.escape_debug()
    );
    // Fields read as `key=value`, as a shipper's parser expects.
    assert!(
        log.contains("source=orders"),
        "the warning's field as plain `source=orders`: {log}"
    );
}

#[tokio::test]
async fn the_json_format_writes_one_object_per_line_with_the_contract_keys() {
    let server = Server::start_env(
        &config_with_a_warning(),
        &[("LAZARET_LOG_FORMAT", "json"), ("LAZARET_LOG", "info")],
    )
    .await;
    some_requests(&server).await;
    let log = wait_log(&server, "keeps retrying").await;
    let mut levels = Vec::new();
    for line in log.lines() {
        let v: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("a log line that is not JSON ({e}): {line:?}\n{log}"));
        for key in ["timestamp", "level", "target", "message"] {
            assert!(
                v[key].is_string(),
                "{key:?} as a string at the top level of {line}"
            );
        }
        levels.push(v["level"].as_str().unwrap_or_default().to_owned());
    }
    assert!(!levels.is_empty(), "some lines: {log}");
    assert!(levels.iter().any(|l| l == "INFO"), "INFO lines: {log}");
    // The warning, with its field at the top level next to the message.
    let warning: Value = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| {
            v["message"]
                .as_str()
                .is_some_and(|m| m.contains("keeps retrying"))
        })
        .expect("the warning's line");
    assert_eq!(warning["level"], "WARN", "{warning}");
    assert_eq!(warning["source"], "orders", "{warning}");
    assert!(
        warning["target"]
            .as_str()
            .is_some_and(|t| t.starts_with("lazaret")),
        "{warning}"
    );
}

#[tokio::test]
async fn lazaret_log_filters_the_lines() {
    let server = Server::start_env(&config_with_a_warning(), &[("LAZARET_LOG", "warn")]).await;
    some_requests(&server).await;
    let log = wait_log(&server, "keeps retrying").await;
    assert!(
        !log.contains("INFO"),
        "LAZARET_LOG=warn keeps INFO lines out:\n{log}"
    );
}

/// Runs `lazaret serve ARGS` with `env`, expecting clap to refuse it
/// before it starts; returns its stderr.
async fn serve_refused_by_clap(args: &[&str], env: &[(&str, &str)]) -> String {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_lazaret"));
    cmd.arg("serve")
        .args(["--listen", "127.0.0.1:0", "--data"])
        .arg(dir.path().join("data"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(20), cmd.output())
        .await
        .expect("refused at once, not served")
        .expect("the lazaret binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "a usage error: {stderr}");
    stderr
}

#[tokio::test]
async fn a_log_format_it_does_not_know_is_refused_naming_the_accepted_ones() {
    for (args, env) in [
        (&["--log-format", "xml"][..], &[][..]),
        (&[][..], &[("LAZARET_LOG_FORMAT", "xml")][..]),
    ] {
        let stderr = serve_refused_by_clap(args, env).await;
        for word in ["xml", "--log-format", "text", "json"] {
            assert!(
                stderr.contains(word),
                "the refusal names {word:?}: {stderr}"
            );
        }
    }
}
