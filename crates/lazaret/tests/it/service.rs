//! Running as a service (`deploy/`): systemd's readiness protocol with
//! `serve` configured only through its environment variables, as
//! `deploy/lazaret.service` runs it, and the metric names that the shipped
//! Prometheus rules and Grafana dashboard use, held to `/metrics`.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;
use tokio::net::UnixDatagram;

use crate::harness::{QUICK, Server};

/// How long the server may take to say READY=1 or STOPPING=1.
const NOTIFY_TIMEOUT: Duration = Duration::from_secs(20);

/// Kills the server if the test ends early (a failed assertion).
struct KillOnDrop(Option<std::process::Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The next datagram on `socket`, as text.
async fn next_notification(socket: &UnixDatagram, waiting_for: &str, log: &Path) -> String {
    let mut buf = vec![0u8; 4096];
    match tokio::time::timeout(NOTIFY_TIMEOUT, socket.recv(&mut buf)).await {
        Ok(Ok(n)) => String::from_utf8(buf[..n].to_vec()).expect("a notification is text"),
        other => panic!(
            "no {waiting_for} on NOTIFY_SOCKET within {NOTIFY_TIMEOUT:?} ({other:?}); stderr:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        ),
    }
}

#[tokio::test]
async fn under_systemd_ready_comes_once_the_listener_answers_and_stopping_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let socket_path = dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).unwrap();
    // Tokens, so the config visibly applies (a request without one is
    // refused), and a source whose broker is down: readiness does not wait
    // for a broker (it would hold up the start of every node whenever one
    // broker is down).
    let config = format!(
        r#"{QUICK}
[[tokens]]
name = "ops"
role = "admin"
token = "service-test-token"

[[sources]]
name = "orders"
broker = "redis"
url = "redis://127.0.0.1:1"
queue = "orders"
deliver = "http://127.0.0.1:9/orders"
"#
    );
    let config_path = dir.path().join("lazaret.toml");
    std::fs::write(&config_path, config).unwrap();
    let data = dir.path().join("state");
    let log = dir.path().join("stderr.log");
    // Every setting through the environment, none on the command line.
    let mut child = Command::new(env!("CARGO_BIN_EXE_lazaret"))
        .arg("serve")
        .env("NOTIFY_SOCKET", &socket_path)
        .env("LAZARET_LISTEN", "127.0.0.1:0")
        .env("LAZARET_DATA", &data)
        .env("LAZARET_CONFIG", &config_path)
        .env("LAZARET_LOG_FORMAT", "json")
        .env_remove("LAZARET_STORE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(std::fs::File::create(&log).unwrap()))
        .spawn()
        .expect("lazaret binary starts");
    // The first stdout line is the address; the rest is drained (a pipe
    // nobody reads would fail the server's next print).
    let stdout = child.stdout.take().unwrap();
    let pid = child.id();
    let mut guard = KillOnDrop(Some(child));
    let (first_tx, first_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let _ = first_tx.send(lines.next());
        for _ in lines.map_while(Result::ok) {}
    });

    let ready = next_notification(&socket, "READY=1", &log).await;
    assert!(
        ready.lines().any(|l| l == "READY=1"),
        "first notification: {ready:?}"
    );
    // The address was printed before READY=1; the listener answers at once,
    // with no retry.
    let first = first_rx
        .recv_timeout(NOTIFY_TIMEOUT)
        .expect("a first stdout line")
        .expect("stdout open")
        .expect("stdout readable");
    let base = first
        .trim()
        .strip_prefix("lazaret listening on ")
        .unwrap_or_else(|| panic!("first stdout line: {first:?}"))
        .to_owned();
    assert!(
        ready.contains(&format!("STATUS=listening on {base}")),
        "{ready:?}"
    );
    let http = reqwest::Client::new();
    let health = http.get(format!("{base}/healthz")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let stats = http.get(format!("{base}/v1/stats")).send().await.unwrap();
    assert_eq!(stats.status(), 401, "LAZARET_CONFIG's tokens are in force");
    let stats = http
        .get(format!("{base}/v1/stats"))
        .bearer_auth("service-test-token")
        .send()
        .await
        .unwrap();
    assert_eq!(stats.status(), 200);
    assert!(
        data.join("lazaret.db").exists(),
        "LAZARET_DATA holds the database"
    );

    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let stopping = next_notification(&socket, "STOPPING=1", &log).await;
    assert_eq!(stopping, "STOPPING=1");
    let deadline = std::time::Instant::now() + NOTIFY_TIMEOUT;
    let status = loop {
        if let Some(status) = guard.0.as_mut().expect("the server").try_wait().unwrap() {
            guard.0 = None;
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the server did not exit within {NOTIFY_TIMEOUT:?} of SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert!(status.success(), "exit after SIGTERM: {status}");
    // LAZARET_LOG_FORMAT=json: every stderr line is a JSON object.
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(!text.is_empty());
    for line in text.lines() {
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        assert!(v.get("level").is_some(), "{line}");
    }
}

#[tokio::test]
async fn without_notify_socket_nothing_is_sent_and_nothing_is_logged_about_it() {
    let server = Server::start(QUICK).await;
    assert_eq!(server.api().get("/healthz").await.status, 200);
    assert!(!server.log().contains("NOTIFY_SOCKET"), "{}", server.log());
}

/// The `lazaret_*` names in `text` (a rules file, a dashboard).
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("lazaret_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

#[tokio::test]
async fn the_shipped_alert_rules_and_dashboard_name_only_metrics_the_server_exports() {
    let server = Server::start(QUICK).await;
    let exposition = server.api().get("/metrics").await.text();
    // Every family has its `# TYPE` line, also before its first sample.
    let families: Vec<(&str, &str)> = exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .collect();
    let kind_of = |name: &str| families.iter().find(|(n, _)| *n == name).map(|(_, k)| *k);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for file in [
        "deploy/prometheus/lazaret.rules.yml",
        "deploy/prometheus/lazaret.rules.test.yml",
        "deploy/grafana/lazaret.json",
    ] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        if file.ends_with(".json") {
            serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        }
        let names = metric_names(&text);
        assert!(names.len() >= 5, "{file}: {names:?}");
        for name in names {
            let known = match kind_of(&name) {
                Some(_) => true,
                // A histogram's series: NAME_bucket, NAME_sum, NAME_count.
                None => ["_bucket", "_sum", "_count"].iter().any(|suffix| {
                    name.strip_suffix(suffix)
                        .and_then(kind_of)
                        .is_some_and(|k| k == "histogram")
                }),
            };
            assert!(
                known,
                "{file} uses {name}, which /metrics does not export:\n{exposition}"
            );
        }
    }
}
