//! Small defects (issue 11, item 10), held through the real server: the
//! `Bearer` scheme is case-insensitive, token names `.` and `..` are
//! refused, and a zero-byte database file stops the server from starting.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{QUICK, Server, assert_error};

const ADMIN: &str = "tok-admin-smaller-0123456789";

async fn start() -> Server {
    Server::start(&format!(
        r#"{QUICK}
[[tokens]]
name = "root"
role = "admin"
token = "{ADMIN}"
"#
    ))
    .await
}

/// `GET /v1/stats` with `Authorization: {value}`; the status.
async fn stats_with(server: &Server, value: &str) -> u16 {
    reqwest::Client::new()
        .get(format!("{}/v1/stats", server.base()))
        .header("authorization", value)
        .send()
        .await
        .expect("request sent and answered")
        .status()
        .as_u16()
}

#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let server = start().await;
    for value in [
        format!("Bearer {ADMIN}"),
        format!("bearer {ADMIN}"),
        format!("BEARER {ADMIN}"),
    ] {
        assert_eq!(stats_with(&server, &value).await, 200, "{value:?}");
    }
    for value in [format!("Basic {ADMIN}"), "Bearer nope".into()] {
        assert_eq!(stats_with(&server, &value).await, 401, "{value:?}");
    }
}

#[tokio::test]
async fn token_names_dot_and_dot_dot_are_refused() {
    let server = start().await;
    let admin = server.api_as(ADMIN);
    for name in [".", "..", " ", "   "] {
        let r = admin
            .post("/v1/tokens", &json!({"name": name, "role": "producer"}))
            .await;
        assert_error(&r, 400, "BAD_REQUEST", None);
    }
    // Names that only contain dots among other characters are fine.
    admin
        .post("/v1/tokens", &json!({"name": "ci.2", "role": "producer"}))
        .await
        .expect(201);
}

#[tokio::test]
async fn a_zero_byte_database_file_stops_the_server_from_starting() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let data = dir.path().join("data");
    std::fs::create_dir_all(&data).expect("data directory");
    std::fs::write(data.join("lazaret.db"), b"").expect("zero-byte database");
    let config = dir.path().join("lazaret.toml");
    std::fs::write(&config, QUICK).expect("config written");
    let out = std::fs::File::create(dir.path().join("err.log")).expect("log file");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lazaret"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .arg("--data")
        .arg(&data)
        .arg("--config")
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(out))
        .spawn()
        .expect("lazaret binary starts");
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = child.try_wait().expect("child status") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "the server started on a zero-byte database; stderr:\n{}",
                std::fs::read_to_string(dir.path().join("err.log")).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let stderr = std::fs::read_to_string(dir.path().join("err.log")).unwrap_or_default();
    assert!(!status.success(), "{status}; stderr:\n{stderr}");
    for part in [
        "is empty (0 bytes)",
        "not a new database",
        "restore it from a backup",
        "delete it to start a new, empty store",
    ] {
        assert!(stderr.contains(part), "{part:?} missing from:\n{stderr}");
    }
    assert_eq!(
        std::fs::metadata(data.join("lazaret.db")).unwrap().len(),
        0,
        "the file is left as it was"
    );
}
