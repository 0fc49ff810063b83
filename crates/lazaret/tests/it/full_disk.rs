//! A full disk under a RabbitMQ guard source, end to end: `lazaret serve`
//! with its SQLite data directory on a small tmpfs that the test fills, a
//! real quorum queue, and a handler that refuses a poison message (400)
//! and fails a transient one once (503).
//!
//! While the store cannot write, the source takes no new message, the
//! poison and the transient message reach the handler once each, nothing
//! is handed back to the broker in a loop, `/healthz` says the store is
//! not writable and the queue's own API answers `UNAVAILABLE` with
//! `Retry-After`. Once space is back everything resumes by itself: the
//! poison's dead letter carries the handler's answer (`permanent`,
//! `http_400`), not an invented `crash_loop`.
//!
//! Needs `LAZARET_TEST_AMQP_URL` and the right to mount a tmpfs (root);
//! without either it is skipped with a message, and fails under
//! `CI=true`. `LAZARET_TEST_FULL_DISK_SECS` (default 3) sets how long the
//! disk stays full while the test watches for a redelivery storm; the
//! numbers it measured (deliveries, WARN lines, CPU) are printed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::post;
use serde_json::{Value, json};

use crate::harness::{EVENTUALLY, QUICK, Server, assert_error, sqlite_only};
use crate::team_handler::{percent_decode, service};

/// The source's name.
const SOURCE: &str = "orders";
/// The size of the tmpfs the data directory lives on.
const TMPFS_BYTES: u64 = 32 * 1024 * 1024;
/// The poison and the transient message are this large, so that writing
/// either needs more room than the write-ahead log already has.
const BIG: usize = 200 * 1024;

/// A tmpfs mounted for the test, unmounted when dropped (also when the
/// test fails).
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `bytes` at `dir` (created), or says why it
    /// cannot (then the test is skipped, or fails under `CI=true`).
    fn mount(dir: &Path, bytes: u64) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}")])
            .arg("tmpfs")
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "mount -t tmpfs failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(Tmpfs {
            dir: dir.to_owned(),
        })
    }

    /// Fills the file system with `filler` until a write of one page fails
    /// for lack of room; returns the filler's path.
    fn fill(&self) -> PathBuf {
        let path = self.dir.join("filler");
        let mut f = std::fs::File::create(&path).expect("the filler file");
        for chunk in [1 << 20, 64 << 10, 4 << 10, 512] {
            let block = vec![0u8; chunk];
            while f.write_all(&block).is_ok() {}
        }
        let _ = f.sync_all();
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        // Lazily, so a process still holding a file there cannot keep it.
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
        let _ = std::fs::remove_dir(&self.dir);
        if let Some(parent) = self.dir.parent() {
            let _ = std::fs::remove_dir_all(parent);
        }
    }
}

/// The team's handler: refuses bodies starting with `poison` (400, no JSON
/// body, so the kind is `http_400`), fails bodies starting with
/// `transient` once (503 without `Retry-After`: transient), takes the rest.
/// The poison is answered once the transient message has arrived.
#[derive(Clone, Default)]
struct Handler {
    /// Message ids in the order they were delivered.
    seen: Arc<Mutex<Vec<String>>>,
}

impl Handler {
    async fn start(&self) -> String {
        async fn handle(
            State(h): State<Handler>,
            headers: HeaderMap,
            body: Bytes,
        ) -> impl IntoResponse {
            let id = headers
                .get("lazaret-message-id")
                .and_then(|v| v.to_str().ok())
                .map(percent_decode)
                .unwrap_or_default();
            let before = {
                let mut seen = h.seen.lock().expect("not poisoned");
                let before = seen.iter().filter(|s| **s == id).count();
                seen.push(id);
                before
            };
            if body.starts_with(b"poison") {
                // Answered once the transient message is in flight too, so
                // that both outcomes meet the full disk (the first refused
                // write closes the source to new messages).
                let deadline = Instant::now() + Duration::from_secs(10);
                while h.count("t1") == 0 && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                (StatusCode::BAD_REQUEST, "this order has no amount").into_response()
            } else if body.starts_with(b"transient") && before == 0 {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the database is restarting",
                )
                    .into_response()
            } else {
                StatusCode::NO_CONTENT.into_response()
            }
        }
        let app = axum::Router::new()
            .route("/orders", post(handle))
            .with_state(self.clone());
        format!("{}/orders", crate::harness::serve_app(app).await)
    }

    fn count(&self, id: &str) -> usize {
        let seen = self.seen.lock().expect("not poisoned");
        seen.iter().filter(|s| *s == id).count()
    }

    async fn wait(&self, id: &str, n: usize, server: &Server) {
        let deadline = Instant::now() + EVENTUALLY;
        while self.count(id) < n {
            assert!(
                Instant::now() < deadline,
                "{id} delivered {} time(s), not {n}, within {EVENTUALLY:?}\n{}",
                self.count(id),
                server.output()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A quorum queue of its own on RabbitMQ, and a channel to publish on.
struct Queue {
    _conn: lapin::Connection,
    ch: lapin::Channel,
    name: String,
}

impl Queue {
    async fn declare(url: &str) -> Queue {
        use lapin::options::ConfirmSelectOptions;
        let (conn, ch, name) = crate::sources::amqp_queue(url, "full-disk").await;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        Queue {
            _conn: conn,
            ch,
            name,
        }
    }

    async fn publish(&self, id: &str, body: &[u8]) {
        use lapin::options::BasicPublishOptions;
        let props = lapin::BasicProperties::default()
            .with_message_id(id.into())
            .with_content_type("application/octet-stream".into())
            .with_delivery_mode(2);
        self.ch
            .basic_publish(
                "",
                &self.name,
                BasicPublishOptions {
                    mandatory: true,
                    ..BasicPublishOptions::default()
                },
                body,
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirmed");
    }
}

/// CPU time the process used so far (user and system), from `/proc`.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name, which is in parentheses.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 here;
    // the kernel counts them in USER_HZ (100 on Linux).
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}

fn warn_lines(log: &str) -> usize {
    log.lines().filter(|l| l.contains("WARN")).count()
}

/// The value of the series `name` (with `label` in its labels, if any).
fn metric(metrics: &str, name: &str, label: &str) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(&format!("{name} ")) || l.starts_with(&format!("{name}{{")))
        .find(|l| l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

async fn healthz(server: &Server) -> (u16, Value) {
    let r = server.api().get("/healthz").await;
    (r.status, r.body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_holds_the_handlers_answer_and_spins_nothing() {
    let test = "a_full_disk_holds_the_handlers_answer_and_spins_nothing";
    if !sqlite_only("a data directory on a full disk") {
        return;
    }
    let Some(url) = service(
        "LAZARET_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        test,
    ) else {
        return;
    };
    let window = Duration::from_secs(
        std::env::var("LAZARET_TEST_FULL_DISK_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(3),
    );
    let queue = Queue::declare(&url).await;
    let handler = Handler::default();
    let deliver = handler.start().await;
    let config = format!(
        r#"{QUICK}
[[sources]]
name = "{SOURCE}"
broker = "rabbitmq"
url = "{url}"
queue = "{queue}"
deliver = "{deliver}"
delivery_timeout_ms = 5000
"#,
        queue = queue.name
    );
    // Declared before the server, so it is unmounted after the server is
    // gone.
    let mut tmpfs: Option<Result<Tmpfs, String>> = None;
    let server = Server::start_prepared(&config, |data| {
        tmpfs = Some(Tmpfs::mount(data, TMPFS_BYTES));
    })
    .await;
    let tmpfs = match tmpfs.expect("prepared") {
        Ok(t) => t,
        Err(why) => {
            lazaret_testkit::skip(
                test,
                &format!("needs a tmpfs for the data directory: {why}"),
            );
            return;
        }
    };
    server
        .wait_output(&format!("source {SOURCE}: guard rabbitmq "))
        .await;
    queue.publish("h0", b"healthy 0").await;
    handler.wait("h0", 1, &server).await;

    // The disk fills up. The poison and the transient message need a write
    // each (a dead letter, a held retry); the healthy ones need none.
    let filler = tmpfs.fill();
    let poison = [b"poison".as_slice(), &vec![b'p'; BIG]].concat();
    let transient = [b"transient".as_slice(), &vec![b't'; BIG]].concat();
    queue.publish("p1", &poison).await;
    queue.publish("t1", &transient).await;
    let healthy: Vec<String> = (1..=10).map(|i| format!("h{i}")).collect();
    for id in &healthy {
        queue.publish(id, format!("healthy {id}").as_bytes()).await;
    }
    handler.wait("p1", 1, &server).await;
    handler.wait("t1", 1, &server).await;

    // Watch the full disk for a while: what lazaret does meanwhile.
    let pid = server.pid();
    let (cpu0, warn0) = (cpu_time(pid), warn_lines(&server.log()));
    tokio::time::sleep(window).await;
    let (cpu1, warn1) = (cpu_time(pid), warn_lines(&server.log()));
    let (health, why) = healthz(&server).await;
    let (p1_during, t1_during) = (handler.count("p1"), handler.count("t1"));
    let enqueue = server
        .api()
        .post(
            "/v1/jobs",
            &json!({"type": "orders", "tenant": "acme", "payload": {"blob": "x".repeat(BIG)}}),
        )
        .await;
    let metrics_during = server.api().get("/metrics").await.text();
    let during = format!(
        "during {window:?} of full disk: handler calls p1 {}, t1 {}; WARN lines {}; CPU {:?}; \
         /healthz {health} {why}; POST /v1/jobs {} {:?}; lazaret_store_writable {:?}; \
         lazaret_source_given_back_total {:?}",
        handler.count("p1"),
        handler.count("t1"),
        warn1 - warn0,
        cpu1.saturating_sub(cpu0),
        enqueue.status,
        enqueue.headers.get("retry-after"),
        metric(&metrics_during, "lazaret_store_writable", ""),
        metric(&metrics_during, "lazaret_source_given_back_total", SOURCE),
    );
    let _ = writeln!(std::io::stderr(), "{test}: {during}");

    // Space is back: everything resumes by itself.
    std::fs::remove_file(&filler).expect("the filler removed");
    let api = server.api();
    let deadline = Instant::now() + EVENTUALLY;
    let dl = loop {
        if let Some(dl) = api.dead_letters(&format!("source={SOURCE}")).await.pop() {
            break dl;
        }
        assert!(
            Instant::now() < deadline,
            "no dead letter within {EVENTUALLY:?} after space came back\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    for id in &healthy {
        handler.wait(id, 1, &server).await;
    }
    handler.wait("t1", 2, &server).await;
    let deadline = Instant::now() + EVENTUALLY;
    while healthz(&server).await.0 != 200 {
        assert!(
            Instant::now() < deadline,
            "/healthz is not 200 again within {EVENTUALLY:?}\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = api.get("/metrics").await.text();
    let delivery_count = dl["source"]["headers"]["x-delivery-count"]
        .as_u64()
        .unwrap_or(0);
    let _ = writeln!(
        std::io::stderr(),
        "{test}: after space came back: the poison's dead letter: reason {}, kind {}, \
         attempts {}, worker {}, broker deliveries before the last {delivery_count}; \
         handler calls p1 {}, t1 {}; lazaret_source_given_back_total {:?}",
        dl["reason"],
        dl["error"]["kind"],
        dl["attempts"],
        dl["history"][0]["worker_id"],
        handler.count("p1"),
        handler.count("t1"),
        metric(&metrics, "lazaret_source_given_back_total", SOURCE),
    );
    assert_eq!(
        p1_during, 1,
        "the poison reached the handler once: {during}"
    );
    assert_eq!(
        t1_during, 1,
        "the transient message reached the handler once: {during}"
    );
    assert!(
        warn1 - warn0 <= 2 * (window.as_secs() as usize / 10 + 1),
        "a line per interval, not per message: {during}\n{}",
        server.log()
    );
    assert_eq!(
        health, 503,
        "/healthz says the store is not writable: {during}"
    );
    assert!(
        why["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("not writable")),
        "/healthz says why: {why}"
    );
    let e = assert_error(&enqueue, 503, "UNAVAILABLE", None);
    assert!(
        enqueue.headers.contains_key("retry-after"),
        "an enqueue is refused with Retry-After: {e}"
    );
    assert_eq!(
        metric(&metrics_during, "lazaret_store_writable", ""),
        Some(0.0),
        "{during}"
    );
    assert_eq!(dl["source"]["message_id"], "p1", "{dl}");
    assert_eq!(
        dl["reason"], "permanent",
        "the handler's answer, kept: {dl}"
    );
    assert_eq!(dl["error"]["kind"], "http_400", "{dl}");
    assert_eq!(dl["attempts"], 1, "{dl}");
    assert_eq!(
        delivery_count, 0,
        "RabbitMQ delivered the poison once: nothing was handed back: {dl}"
    );
    assert_eq!(
        handler.count("p1"),
        1,
        "the poison reached the handler once in all"
    );
    assert_eq!(
        handler.count("t1"),
        2,
        "the transient message: its failure and its retry"
    );
    for id in &healthy {
        assert_eq!(handler.count(id), 1, "{id} delivered once");
    }
    assert_eq!(metric(&metrics, "lazaret_store_writable", ""), Some(1.0));
    api.post(
        "/v1/jobs",
        &json!({"type": "orders", "tenant": "acme", "payload": {"n": 1}}),
    )
    .await
    .expect(201);
}
