//! The worker protocol is plain HTTP: `examples/python_worker.py` (standard
//! library only) drains a real server, and every outcome is checked over HTTP.
//! Skipped, with a message, when `python3` is not on PATH.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Short backoffs so that the retried job comes back at once; `strict`'s
/// validation failures may spend one attempt (the worker also says permanent).
const CONFIG: &str = r#"
[defaults]
attempts_max = 4
backoff_base_ms = 20
backoff_cap_ms = 100
deferrals_max = 5

[types.strict]
kinds = { validation = 1, parse = 2 }
"#;

/// The server process, killed when dropped.
struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_server(dir: &Path) -> Server {
    let config = dir.join("lazaret.toml");
    std::fs::write(&config, CONFIG).expect("write the config");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lazaret"))
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .arg("--data")
        .arg(dir.join("data"))
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("server.log")).expect("server.log"))
        .spawn()
        .expect("spawn lazaret serve");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = lines.next().and_then(Result::ok).unwrap_or_default();
    // Keep draining stdout so that the server never writes into a closed pipe.
    std::thread::spawn(move || lines.for_each(drop));
    let mut server = Server {
        child,
        url: String::new(),
    };
    server.url = first
        .strip_prefix("lazaret listening on ")
        .unwrap_or_else(|| panic!("unexpected first line from the server: {first:?}"))
        .to_owned();
    server
}

fn python3() -> bool {
    Command::new("python3")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/python_worker.py")
}

async fn post(http: &reqwest::Client, url: String, body: Value) -> Value {
    let resp = http.post(&url).json(&body).send().await.expect("POST");
    let status = resp.status();
    let v: Value = resp.json().await.expect("a JSON reply");
    assert!(status.is_success(), "POST {url} {body}: {status} {v}");
    v
}

async fn get(http: &reqwest::Client, url: String) -> Value {
    let resp = http.get(&url).send().await.expect("GET");
    let status = resp.status();
    let v: Value = resp.json().await.expect("a JSON reply");
    assert!(status.is_success(), "GET {url}: {status} {v}");
    v
}

/// The job once it is in a final state (bounded wait).
async fn settled(http: &reqwest::Client, base: &str, id: &str) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let job = get(http, format!("{base}/v1/jobs/{id}")).await;
        if matches!(job["state"].as_str(), Some("succeeded" | "dead_lettered")) {
            return job;
        }
        assert!(Instant::now() < deadline, "job {id} never settled: {job}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn outcomes(job: &Value) -> Vec<&str> {
    job["history"]
        .as_array()
        .expect("history")
        .iter()
        .map(|h| h["outcome"].as_str().expect("outcome"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_worker_speaks_the_protocol() {
    if !python3() {
        lazaret_testkit::skip(
            "python_worker_speaks_the_protocol",
            "python3 is not on PATH",
        );
        return;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let server = start_server(dir.path());
    let base = server.url.clone();
    let http = reqwest::Client::new();

    let mut jobs = vec![];
    for n in 0..3 {
        jobs.push(json!({"type": "echo", "tenant": "acme", "payload": {"n": n}}));
    }
    jobs.push(json!({"type": "strict", "tenant": "acme", "payload": {"subject": "no recipient"}}));
    jobs.push(json!({"type": "flaky", "tenant": "acme", "payload": {"fail_times": 1}}));
    jobs.push(json!({"type": "rate_limited", "tenant": "acme",
        "payload": {"defer_times": 1, "retry_after_s": 0.2}}));
    let reply = post(
        &http,
        format!("{base}/v1/jobs/batch"),
        json!({ "jobs": jobs }),
    )
    .await;
    let ids: Vec<String> = reply["results"]
        .as_array()
        .expect("results")
        .iter()
        .map(|r| r["id"].as_str().unwrap_or_else(|| panic!("{r}")).to_owned())
        .collect();

    let run = tokio::process::Command::new("python3")
        .arg(example())
        .args(["--server", &base, "--once", "--concurrency", "2"])
        .env_remove("LAZARET_TOKEN")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the worker did not exit within 120 s")
        .expect("run python3");
    let log = String::from_utf8_lossy(&out.stderr);
    eprintln!("--- python worker log ---\n{log}--- end ---");
    assert!(out.status.success(), "the worker failed: {}", out.status);

    // echo: succeeded on the first delivery.
    for id in &ids[..3] {
        let job = settled(&http, &base, id).await;
        assert_eq!(job["state"], "succeeded", "{job}");
        assert_eq!(job["attempt"], 1, "{job}");
    }

    // strict: a KeyError is permanent at once, with the Python traceback kept.
    let job = settled(&http, &base, &ids[3]).await;
    assert_eq!(job["state"], "dead_lettered", "{job}");
    assert_eq!(job["attempt"], 1, "{job}");
    let dls = get(&http, format!("{base}/v1/dead-letters?type=strict")).await;
    let dl = &dls["items"][0];
    assert_eq!(dl["job_id"], ids[3], "{dls}");
    assert_eq!(dl["reason"], "permanent", "{dl}");
    assert_eq!(dl["error"]["class"], "permanent", "{dl}");
    assert_eq!(dl["error"]["kind"], "validation", "{dl}");
    let tb = dl["error"]["traceback"].as_str().unwrap_or_default();
    assert!(tb.starts_with("Traceback (most recent call last)"), "{dl}");
    assert!(tb.contains("KeyError: 'to'"), "{dl}");

    // flaky: one transient failure, then success on attempt 2.
    let job = settled(&http, &base, &ids[4]).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["attempt"], 2, "{job}");
    assert_eq!(outcomes(&job), ["retry_scheduled", "succeeded"], "{job}");
    let first = &job["history"][0]["error"];
    assert_eq!(first["class"], "transient", "{job}");
    assert_eq!(first["kind"], "connection", "{job}");
    let tb = first["traceback"].as_str().unwrap_or_default();
    assert!(tb.contains("ConnectionError"), "{job}");

    // rate_limited: a 429 with Retry-After is a deferral, which spends no attempt.
    let job = settled(&http, &base, &ids[5]).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    assert_eq!(job["attempt"], 1, "{job}");
    assert_eq!(job["deferrals"], 1, "{job}");
    assert_eq!(outcomes(&job), ["deferred", "succeeded"], "{job}");
    let first = &job["history"][0];
    assert_eq!(first["attempt"], 1, "{job}");
    assert_eq!(first["error"]["class"], "deferred", "{job}");
    assert_eq!(first["error"]["kind"], "http_429", "{job}");
    assert_eq!(first["error"]["retry_after_ms"], 200, "{job}");

    // Nothing is left over.
    let stats = get(&http, format!("{base}/v1/stats")).await;
    let lane = &stats["lanes"]["default"];
    for what in ["queued", "scheduled", "leased"] {
        assert_eq!(lane[what], 0, "{what}: {stats}");
    }
    drop(server);
}
