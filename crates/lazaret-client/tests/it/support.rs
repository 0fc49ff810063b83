//! Starting a real server for a test, and bounded waits.
//!
//! The server binary is found next to the test executable
//! (`target/debug/lazaret`: build it with `cargo build -p lazaret`) or at
//! `$LAZARET_BIN`. When it is missing the test says so and passes: a
//! `cargo test -p lazaret-client` on a fresh checkout must not fail for a
//! binary it cannot build itself.

use std::future::Future;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use lazaret_client::{Client, JobId, JobInfo, JobState, RunReport, Worker, WorkerError};
use tokio::io::{AsyncBufReadExt, BufReader};

/// Short leases and backoffs so that failure paths run in milliseconds.
pub const CONFIG: &str = r#"
lease_ms_default = 1000

[tenants]
inflight_max = 1000

[defaults]
attempts_max = 3
backoff_base_ms = 20
backoff_cap_ms = 50
crash_loop_max = 3
"#;

/// How long any wait in these tests may take before it is a failure.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// A running `lazaret serve`, killed when dropped.
pub struct Server {
    _child: tokio::process::Child,
    _dir: tempfile::TempDir,
    pub url: String,
    pub client: Client,
}

/// `target/debug/<name>` (or `target/debug/examples/<name>` for examples).
pub fn target_bin(rel: &str) -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    // target/debug/deps/it-<hash> → target/debug
    let debug = exe.parent()?.parent()?;
    let path = debug.join(rel);
    path.exists().then_some(path)
}

fn server_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("LAZARET_BIN") {
        return Some(PathBuf::from(p));
    }
    target_bin("lazaret")
}

/// Starts a server with `config` (TOML); `None` (after saying why) when the
/// binary is not built.
pub async fn start(config: &str) -> Option<Server> {
    let Some(bin) = server_bin() else {
        lazaret_testkit::skip(
            "this client test",
            "the lazaret binary is not built next to this test \
             (run `cargo build -p lazaret` first, or set LAZARET_BIN)",
        );
        return None;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let config_path = dir.path().join("lazaret.toml");
    std::fs::write(&config_path, config).expect("write config");
    let stderr = if std::env::var_os("LAZARET_TEST_LOG").is_some() {
        Stdio::inherit()
    } else {
        Stdio::null()
    };
    let mut child = tokio::process::Command::new(&bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--data"])
        .arg(dir.path().join("data"))
        .arg("--config")
        .arg(&config_path)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let first = tokio::time::timeout(DEADLINE, lines.next_line())
        .await
        .expect("the server did not start in time")
        .expect("read stdout")
        .expect("the server exited before listening");
    let url = first
        .strip_prefix("lazaret listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
        .trim()
        .to_owned();
    // Keep reading so the server never writes into a closed pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let client = Client::new(url.clone()).expect("client");
    Some(Server {
        _child: child,
        _dir: dir,
        url,
        client,
    })
}

/// Polls `probe` until it yields a value, or panics after [`DEADLINE`].
pub async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until job `id` is in `state`, and returns it.
pub async fn wait_state(client: &Client, id: JobId, state: JobState) -> JobInfo {
    wait_for(&format!("job {id} to be {state}"), || async {
        client.job(id).await.ok().filter(|j| j.state == state)
    })
    .await
}

/// Receives from `rx` within [`DEADLINE`].
pub async fn recv<T>(what: &str, rx: &mut tokio::sync::mpsc::UnboundedReceiver<T>) -> T {
    tokio::time::timeout(DEADLINE, rx.recv())
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
        .unwrap_or_else(|| panic!("channel closed waiting for {what}"))
}

/// A worker running on a task of its own until [`Running::stop`].
pub struct Running {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<RunReport, WorkerError>>,
}

/// Runs `worker` until the returned [`Running`] is stopped.
pub fn run(worker: Worker) -> Running {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(worker.run_until(async {
        let _ = stopped.await;
    }));
    Running { stop, task }
}

impl Running {
    /// Asks the worker to stop (it must still be running), and returns
    /// its report once it has.
    pub async fn stop(self) -> RunReport {
        self.stop
            .send(())
            .expect("the worker still running when asked to stop");
        self.task
            .await
            .expect("the worker's task")
            .expect("the worker's run")
    }
}
