//! One server per data directory: a second `lazaret serve --data D` is
//! refused while the first runs (both would issue the same job ids and lease
//! tokens), and the first goes on serving.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::harness::{QUICK, job};

/// How long a server may take to start, or to refuse to.
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// `lazaret serve` on `data` with [`QUICK`], its stdout and stderr in `log`.
fn serve(dir: &Path, data: &Path, log: &str) -> Child {
    let config = dir.join("lazaret.toml");
    std::fs::write(&config, QUICK).expect("config written");
    let err = std::fs::File::create(dir.join(log)).expect("log file");
    Command::new(env!("CARGO_BIN_EXE_lazaret"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .arg("--data")
        .arg(data)
        .arg("--config")
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::from(err))
        .spawn()
        .expect("lazaret binary starts")
}

/// A server that must start: returns its base URL once `/healthz` answers.
async fn started(child: &mut Child, log: &Path) -> String {
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let _ = tx.send(lines.next().and_then(Result::ok));
        for _ in lines.map_while(Result::ok) {}
    });
    let first = match tokio::time::timeout(START_TIMEOUT, rx).await {
        Ok(Ok(Some(line))) => line,
        other => panic!(
            "no first line ({other:?}); stderr:\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        ),
    };
    let base = first
        .strip_prefix("lazaret listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .trim()
        .trim_end_matches('/')
        .to_owned();
    let deadline = Instant::now() + START_TIMEOUT;
    while !healthy(&base).await {
        assert!(Instant::now() < deadline, "/healthz not 200 at {base}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    base
}

async fn healthy(base: &str) -> bool {
    match reqwest::get(format!("{base}/healthz")).await {
        Ok(r) => r.status() == 200,
        Err(_) => false,
    }
}

/// Kills `child` if it still runs (a failed assertion must not leak it).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn a_second_server_on_the_same_data_directory_is_refused_and_the_first_serves_on() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let data = dir.path().join("data");
    let mut first = Killed(serve(dir.path(), &data, "first.log"));
    let base = started(&mut first.0, &dir.path().join("first.log")).await;
    let before = reqwest::Client::new()
        .post(format!("{base}/v1/jobs"))
        .json(&job("report", "acme", json!({"n": 1})))
        .send()
        .await
        .expect("enqueue");
    assert_eq!(before.status(), 201);

    // The second exits at once, non-zero, saying why and what to do.
    let mut second = Killed(serve(dir.path(), &data, "second.log"));
    let deadline = Instant::now() + START_TIMEOUT;
    let status = loop {
        if let Some(status) = second.0.try_wait().expect("child status") {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "a second server on {} kept running",
            data.display()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let mut printed = std::fs::read_to_string(dir.path().join("second.log")).unwrap_or_default();
    if let Some(mut out) = second.0.stdout.take() {
        let _ = std::io::Read::read_to_string(&mut out, &mut printed);
    }
    assert!(!status.success(), "{status}; it printed:\n{printed}");
    assert!(
        !printed.contains("lazaret listening on"),
        "it must not listen: {printed}"
    );
    for part in [
        format!("another lazaret is using {}", data.display()),
        format!("(pid {})", first.0.id()),
        "stop it or use another --data directory".into(),
    ] {
        assert!(printed.contains(&part), "{part:?} missing from:\n{printed}");
    }

    // The first still serves, and takes writes.
    assert!(healthy(&base).await, "the first server stopped serving");
    let after = reqwest::Client::new()
        .post(format!("{base}/v1/jobs"))
        .json(&job("report", "acme", json!({"n": 2})))
        .send()
        .await
        .expect("enqueue");
    assert_eq!(after.status(), 201);

    // A server killed with SIGKILL leaves its lock file but not its lock:
    // the next start on the directory goes ahead.
    first.0.kill().expect("SIGKILL delivered");
    let _ = first.0.wait();
    let mut third = Killed(serve(dir.path(), &data, "third.log"));
    let base = started(&mut third.0, &dir.path().join("third.log")).await;
    assert!(healthy(&base).await);
}
