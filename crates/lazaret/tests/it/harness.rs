//! The harness: runs the real `lazaret serve` as a child process and speaks its HTTP API.
//!
//! Each test starts its own server on `127.0.0.1:0` with its own data
//! directory and a TOML config written for it (short timings, so tests are
//! quick). The server names its port on its first stdout line; the harness
//! waits for `/healthz`, and kills the child when the [`Server`] is dropped.
//! A server can be restarted on the same data directory, gracefully
//! (SIGTERM) or with `kill -9`.
//!
//! With `LAZARET_TEST_STORE=postgres` (and `LAZARET_TEST_PG_URL`), every
//! server runs on PostgreSQL instead, in a schema of its own (dropped at
//! the end), so the same tests hold the PostgreSQL store to the contract;
//! tests of what only SQLite has (its file, its fsyncs) say they are
//! skipped then ([`sqlite_only`]). [`Server::cluster`] starts several
//! nodes on one schema (needs `LAZARET_TEST_PG_URL` whatever the switch).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime};

use reqwest::header::HeaderMap;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// How long a server may take to print its address and answer `/healthz`.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a test waits for something the server will do on its own
/// (a retry coming due, a lease expiring). Generous: the machines are noisy.
pub const EVENTUALLY: Duration = Duration::from_secs(30);

/// The `[tenants]`, `[lanes]` and `[defaults]` most tests use: retries come
/// due within 100 ms and no tenant cap gets in the way. Append `[types.X]`
/// sections (top-level keys go before it).
pub const QUICK: &str = r#"
[tenants]
inflight_max = 1000

[lanes.interactive]
weight = 4
[lanes.batch]
weight = 1

[defaults]
attempts_max = 3
backoff_base_ms = 20
backoff_cap_ms = 100
crash_loop_max = 2
deferrals_max = 50
"#;

/// A running `lazaret serve`, killed when dropped.
#[derive(Debug)]
pub struct Server {
    dir: tempfile::TempDir,
    child: Option<Child>,
    base: String,
    starts: u32,
    /// Environment variables for the next start.
    env: Vec<(String, String)>,
    /// The PostgreSQL schema it serves, when on PostgreSQL (shared by the
    /// nodes of a cluster; dropped with the last of them).
    schema: Option<std::sync::Arc<PgSchema>>,
}

/// `LAZARET_TEST_PG_URL`, or `None` after saying the test is skipped (a
/// failure under `CI=true`).
pub fn pg_url() -> Option<String> {
    lazaret_testkit::service(
        "LAZARET_TEST_PG_URL",
        "postgres://…",
        "this PostgreSQL test",
    )
}

/// Whether the servers of this run are on PostgreSQL (`LAZARET_TEST_STORE=postgres`).
pub fn on_postgres() -> bool {
    std::env::var("LAZARET_TEST_STORE").as_deref() == Ok("postgres")
}

/// `true` for a test of what only the SQLite store has; says it is skipped
/// (and returns `false`) on PostgreSQL.
pub fn sqlite_only(what: &str) -> bool {
    if on_postgres() {
        eprintln!("skipped on PostgreSQL: {what} is SQLite's");
        return false;
    }
    true
}

/// A schema of its own on the test database, dropped when the last server
/// on it goes.
#[derive(Debug)]
pub struct PgSchema {
    url: String,
    /// The schema's name.
    pub name: String,
}

impl PgSchema {
    /// A fresh schema name on `url` (created by the first server's migration).
    pub fn fresh(url: &str) -> std::sync::Arc<PgSchema> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        std::sync::Arc::new(PgSchema {
            url: url.to_owned(),
            name: format!(
                "lz_it_{}_{}_{nanos}",
                std::process::id(),
                N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            ),
        })
    }

    /// The `--store` URL of a node on this schema.
    pub fn store_url(&self) -> String {
        let sep = if self.url.contains('?') { '&' } else { '?' };
        format!("{}{sep}schema={}", self.url, self.name)
    }
}

/// Runs the async cleanup `make` returns to its end, from a `Drop`: on a
/// thread and a runtime of its own, since a `Drop` may run inside the
/// test's runtime, where blocking on it would panic.
pub fn clean_up<F>(make: impl FnOnce() -> F + Send + 'static)
where
    F: std::future::Future<Output = ()>,
{
    let _ = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime")
            .block_on(make());
    })
    .join();
}

impl Drop for PgSchema {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        clean_up(move || async move {
            if let Ok((c, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                tokio::spawn(conn);
                let _ = c
                    .batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"))
                    .await;
            }
        });
    }
}

/// The schema a new server gets: a fresh one on PostgreSQL, else none.
fn default_schema() -> Option<std::sync::Arc<PgSchema>> {
    if !on_postgres() {
        return None;
    }
    let url = std::env::var("LAZARET_TEST_PG_URL")
        .expect("LAZARET_TEST_STORE=postgres needs LAZARET_TEST_PG_URL");
    Some(PgSchema::fresh(&url))
}

impl Server {
    /// Starts a server with `config` and these environment variables (which
    /// stay for restarts until [`Server::set_env`] changes them).
    pub async fn start_env(config: &str, env: &[(&str, &str)]) -> Server {
        let dir = tempfile::tempdir().expect("a temporary directory");
        std::fs::write(dir.path().join("lazaret.toml"), config).expect("config written");
        let mut server = Server {
            dir,
            child: None,
            base: String::new(),
            starts: 0,
            env: env
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            schema: default_schema(),
        };
        server.spawn().await;
        server
    }

    /// Starts `n` nodes with `config` on one PostgreSQL schema of their own
    /// (a cluster), or `None` (skipped) without `LAZARET_TEST_PG_URL`.
    pub async fn cluster(config: &str, n: usize) -> Option<Vec<Server>> {
        let url = pg_url()?;
        let schema = PgSchema::fresh(&url);
        let mut nodes = Vec::with_capacity(n);
        for _ in 0..n {
            nodes.push(Server::on_schema(config, &schema).await);
        }
        Some(nodes)
    }

    /// Starts one node with `config` on `schema` (created by its first
    /// node's migration, unless `lazaret migrate` made it).
    pub async fn on_schema(config: &str, schema: &std::sync::Arc<PgSchema>) -> Server {
        Server::on_schema_env(config, schema, &[]).await
    }

    /// [`Server::on_schema`] with these environment variables (as
    /// [`Server::start_env`]).
    pub async fn on_schema_env(
        config: &str,
        schema: &std::sync::Arc<PgSchema>,
        env: &[(&str, &str)],
    ) -> Server {
        let dir = tempfile::tempdir().expect("a temporary directory");
        std::fs::write(dir.path().join("lazaret.toml"), config).expect("config written");
        let mut server = Server {
            dir,
            child: None,
            base: String::new(),
            starts: 0,
            env: env
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            schema: Some(std::sync::Arc::clone(schema)),
        };
        server.spawn().await;
        server
    }

    /// The environment variables of the next start.
    pub fn set_env(&mut self, env: &[(&str, &str)]) {
        self.env = env
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
    }

    /// Starts a server with `config` as its TOML file.
    pub async fn start(config: &str) -> Server {
        Server::start_with(config, &[]).await
    }

    /// Starts a server with `config` as its TOML file and `files` (name, text)
    /// written beside it (schemas: their paths are relative to the config).
    pub async fn start_with(config: &str, files: &[(&str, &str)]) -> Server {
        let dir = tempfile::tempdir().expect("a temporary directory");
        std::fs::write(dir.path().join("lazaret.toml"), config).expect("config written");
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).expect("side file written");
        }
        let mut server = Server {
            dir,
            child: None,
            base: String::new(),
            starts: 0,
            env: Vec::new(),
            schema: default_schema(),
        };
        server.spawn().await;
        server
    }

    /// Starts a server with `config`, after `prepare` was given its data
    /// directory's path (not created yet): a test mounts a small file
    /// system there.
    pub async fn start_prepared(config: &str, prepare: impl FnOnce(&std::path::Path)) -> Server {
        let dir = tempfile::tempdir().expect("a temporary directory");
        std::fs::write(dir.path().join("lazaret.toml"), config).expect("config written");
        prepare(&dir.path().join("data"));
        let mut server = Server {
            dir,
            child: None,
            base: String::new(),
            starts: 0,
            env: Vec::new(),
            schema: default_schema(),
        };
        server.spawn().await;
        server
    }

    /// The base URL, `http://127.0.0.1:PORT` (it changes on restart).
    pub fn base(&self) -> &str {
        &self.base
    }

    /// A client with no token.
    pub fn api(&self) -> Api {
        Api::new(&self.base, None)
    }

    /// A client that sends `Authorization: Bearer {token}`.
    pub fn api_as(&self, token: &str) -> Api {
        Api::new(&self.base, Some(token))
    }

    /// Stops the server with SIGTERM (SIGKILL if it lingers) and starts it
    /// again on the same data directory and config.
    pub async fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().expect("child status").is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = child.wait();
        }
        self.spawn().await;
    }

    /// Kills the server with SIGKILL (`kill -9`: no chance to flush anything)
    /// and starts it again on the same data directory and config.
    pub async fn kill_and_restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill().expect("SIGKILL delivered");
            let _ = child.wait();
        }
        self.spawn().await;
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join(format!("server-{}.log", self.starts))
    }

    fn stdout_path(&self) -> PathBuf {
        self.dir.path().join(format!("stdout-{}.log", self.starts))
    }

    /// What the server wrote to stderr in its current run, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// The server process's id (for `/proc/PID`).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("a running server").id()
    }

    /// Sends SIGTERM and waits up to `bound` for the process to exit;
    /// `None` (after SIGKILL) if it was still running then.
    pub async fn terminate(&mut self, bound: Duration) -> Option<ExitStatus> {
        let mut child = self.child.take().expect("a running server");
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + bound;
        loop {
            if let Some(status) = child.try_wait().expect("child status") {
                return Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Starts the server again on the same data directory after
    /// [`Server::terminate`].
    pub async fn start_again(&mut self) {
        assert!(self.child.is_none(), "the server is still running");
        self.spawn().await;
    }

    /// What the server wrote after its first stdout line, and to stderr, in its current run.
    pub fn output(&self) -> String {
        let out = std::fs::read_to_string(self.stdout_path()).unwrap_or_default();
        format!("{out}{}", self.log())
    }

    /// Waits (up to `EVENTUALLY`) until the server's output holds `needle`
    /// and returns that output; lines after the first reach the file
    /// through a draining thread, so they may lag the call that caused them.
    pub async fn wait_output(&self, needle: &str) -> String {
        let deadline = Instant::now() + EVENTUALLY;
        loop {
            let out = self.output();
            if out.contains(needle) {
                return out;
            }
            assert!(
                Instant::now() < deadline,
                "the server never printed {needle:?} within {EVENTUALLY:?}; it printed:\n{out}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn spawn(&mut self) {
        self.starts += 1;
        let config = self.dir.path().join("lazaret.toml");
        let data = self.dir.path().join("data");
        let log = std::fs::File::create(self.log_path()).expect("log file");
        let mut command = Command::new(env!("CARGO_BIN_EXE_lazaret"));
        command.arg("serve").args(["--listen", "127.0.0.1:0"]);
        match &self.schema {
            Some(schema) => command.arg("--store").arg(schema.store_url()),
            None => command.arg("--data").arg(&data),
        };
        let mut child = command
            .arg("--config")
            .arg(&config)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("lazaret binary starts");
        let stdout = child.stdout.take().expect("piped stdout");
        self.child = Some(child);

        // Read the first line on a thread that then keeps draining stdout
        // into a file, so the server never blocks on a full pipe.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let mut rest = std::fs::File::create(self.stdout_path()).expect("stdout file");
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let first = lines.next().and_then(Result::ok);
            let _ = tx.send(first);
            for line in lines.map_while(Result::ok) {
                let _ = writeln!(rest, "{line}");
            }
        });
        let first = match tokio::time::timeout(START_TIMEOUT, rx).await {
            Ok(Ok(Some(line))) => line,
            other => panic!(
                "server printed no first line ({other:?}); stderr:\n{}",
                self.log()
            ),
        };
        let base = first
            .strip_prefix("lazaret listening on ")
            .unwrap_or_else(|| {
                panic!(
                    "first stdout line should be `lazaret listening on http://...`, got {first:?}; stderr:\n{}",
                    self.log()
                )
            })
            .trim()
            .trim_end_matches('/')
            .to_owned();
        assert!(
            base.starts_with("http://127.0.0.1:"),
            "unexpected base URL {base}"
        );
        self.base = base;

        let http = reqwest::Client::new();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(r) = http.get(format!("{}/healthz", self.base)).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait().expect("child status") {
                    panic!(
                        "server exited with {status} before /healthz; stderr:\n{}",
                        self.log()
                    );
                }
            }
            assert!(
                Instant::now() < deadline,
                "/healthz not 200 within {START_TIMEOUT:?}; stderr:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}

/// Runs `lazaret serve --listen {listen}` with `config` and expects it to
/// refuse to start; returns its exit status and everything it printed.
/// Panics (after killing it) if it is still running after [`START_TIMEOUT`].
pub async fn serve_refused(config: &str, listen: &str) -> (ExitStatus, String) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    std::fs::write(dir.path().join("lazaret.toml"), config).expect("config written");
    let out = std::fs::File::create(dir.path().join("out.log")).expect("log file");
    let err = out.try_clone().expect("log file");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lazaret"))
        .arg("serve")
        .args(["--listen", listen])
        .arg("--data")
        .arg(dir.path().join("data"))
        .arg("--config")
        .arg(dir.path().join("lazaret.toml"))
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .expect("lazaret binary starts");
    let deadline = Instant::now() + START_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("child status") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "`serve --listen {listen}` kept running; it printed:\n{}",
                std::fs::read_to_string(dir.path().join("out.log")).unwrap_or_default()
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    let printed = std::fs::read_to_string(dir.path().join("out.log")).unwrap_or_default();
    (status, printed)
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// One HTTP reply: status, headers, the body as text and (when it is JSON) as a value.
#[derive(Debug)]
pub struct Reply {
    /// The HTTP status.
    pub status: u16,
    /// The headers.
    pub headers: HeaderMap,
    /// The raw body.
    pub bytes: Vec<u8>,
    /// The body parsed as JSON, `Value::Null` when it is not JSON.
    pub body: Value,
}

impl Reply {
    /// The body as text (lossy).
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    /// Asserts the status, saying what came back when it differs.
    #[track_caller]
    pub fn expect(&self, status: u16) -> &Value {
        assert_eq!(
            self.status,
            status,
            "unexpected status; body: {}",
            self.text()
        );
        &self.body
    }
}

/// A client of one server, with or without a bearer token.
#[derive(Clone, Debug)]
pub struct Api {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    fn new(base: &str, token: Option<&str>) -> Api {
        Api {
            http: reqwest::Client::new(),
            base: base.to_owned(),
            token: token.map(str::to_owned),
        }
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Reply {
        let req = match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        };
        let resp = req.send().await.expect("request sent and answered");
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let bytes = resp.bytes().await.expect("body read").to_vec();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            bytes,
            body,
        }
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> Reply {
        self.send(self.http.get(format!("{}{path}", self.base)))
            .await
    }

    /// `DELETE path`.
    pub async fn delete(&self, path: &str) -> Reply {
        self.send(self.http.delete(format!("{}{path}", self.base)))
            .await
    }

    /// `POST path` with a JSON body.
    pub async fn post(&self, path: &str, body: &Value) -> Reply {
        self.send(self.http.post(format!("{}{path}", self.base)).json(body))
            .await
    }

    /// `POST path` with `body` sent as is, labelled `application/json`.
    pub async fn post_raw(&self, path: &str, body: impl Into<String>) -> Reply {
        let body: String = body.into();
        self.send(
            self.http
                .post(format!("{}{path}", self.base))
                .header("content-type", "application/json")
                .body(body),
        )
        .await
    }

    /// `POST /v1/jobs`.
    pub async fn enqueue(&self, job: &Value) -> Reply {
        self.post("/v1/jobs", job).await
    }

    /// `POST /v1/jobs` that must be admitted (201); returns the job id.
    pub async fn enqueue_ok(&self, job: &Value) -> Value {
        let r = self.enqueue(job).await;
        let body = r.expect(201);
        assert_eq!(body["state"], "queued", "{body}");
        assert!(
            body["admission"] == "ADMITTED" || body["admission"] == "FAIR_QUEUE",
            "{body}"
        );
        body["id"].clone()
    }

    /// `POST /v1/leases` that must succeed; returns the leased jobs.
    pub async fn lease(&self, req: &Value) -> Vec<Value> {
        let r = self.post("/v1/leases", req).await;
        let body = r.expect(200);
        body["jobs"]
            .as_array()
            .unwrap_or_else(|| panic!("`jobs` is not a list: {body}"))
            .clone()
    }

    /// Leases until at least one job comes (long-polling), within [`EVENTUALLY`].
    pub async fn lease_eventually(&self, req: &Value) -> Vec<Value> {
        let deadline = Instant::now() + EVENTUALLY;
        let mut req = req.clone();
        if req["wait_ms"].as_u64().unwrap_or(0) == 0 {
            req["wait_ms"] = json!(1000);
        }
        loop {
            let jobs = self.lease(&req).await;
            if !jobs.is_empty() {
                return jobs;
            }
            assert!(
                Instant::now() < deadline,
                "no job leased within {EVENTUALLY:?} for {req}"
            );
        }
    }

    /// Leases exactly one job (long-polling until there is one).
    pub async fn lease_one(&self, req: &Value) -> Value {
        let mut req = req.clone();
        req["max_jobs"] = json!(1);
        let jobs = self.lease_eventually(&req).await;
        assert_eq!(jobs.len(), 1, "asked for one job: {jobs:?}");
        jobs[0].clone()
    }

    /// `POST /v1/jobs/{id}/ack`.
    pub async fn ack(&self, id: &Value, token: &Value) -> Reply {
        self.post(
            &format!("/v1/jobs/{}/ack", id_text(id)),
            &json!({"lease_token": token}),
        )
        .await
    }

    /// `POST /v1/jobs/{id}/fail`.
    pub async fn fail(&self, id: &Value, token: &Value, error: Value) -> Reply {
        self.post(
            &format!("/v1/jobs/{}/fail", id_text(id)),
            &json!({"lease_token": token, "error": error}),
        )
        .await
    }

    /// `POST /v1/jobs/{id}/heartbeat`.
    pub async fn heartbeat(&self, id: &Value, token: &Value, extend_ms: u64) -> Reply {
        self.post(
            &format!("/v1/jobs/{}/heartbeat", id_text(id)),
            &json!({"lease_token": token, "extend_ms": extend_ms}),
        )
        .await
    }

    /// `GET /v1/jobs/{id}` that must be found.
    pub async fn job(&self, id: &Value) -> Value {
        self.get(&format!("/v1/jobs/{}", id_text(id)))
            .await
            .expect(200)
            .clone()
    }

    /// Polls `GET /v1/jobs/{id}` until its state is `state`, within [`EVENTUALLY`].
    pub async fn job_eventually(&self, id: &Value, state: &str) -> Value {
        let deadline = Instant::now() + EVENTUALLY;
        loop {
            let job = self.job(id).await;
            if job["state"] == state {
                return job;
            }
            assert!(
                Instant::now() < deadline,
                "job {id} not {state} within {EVENTUALLY:?}: {job}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `GET /v1/dead-letters?{query}` that must succeed; returns its items.
    pub async fn dead_letters(&self, query: &str) -> Vec<Value> {
        let r = self.get(&format!("/v1/dead-letters?{query}")).await;
        let body = r.expect(200);
        assert!(body.get("next_cursor").is_some(), "no next_cursor: {body}");
        body["items"]
            .as_array()
            .unwrap_or_else(|| panic!("`items` is not a list: {body}"))
            .clone()
    }

    /// The one dead letter of job `id`.
    pub async fn dead_letter_of(&self, job_id: &Value) -> Value {
        let items = self.dead_letters("limit=1000").await;
        let mine: Vec<&Value> = items.iter().filter(|d| d["job_id"] == *job_id).collect();
        assert_eq!(mine.len(), 1, "one dead letter for job {job_id}: {items:?}");
        mine[0].clone()
    }
}

/// A job to enqueue: `type`, `tenant` and `payload`; add keys with `job[...] = ...`.
pub fn job(job_type: &str, tenant: &str, payload: Value) -> Value {
    json!({"type": job_type, "tenant": tenant, "payload": payload})
}

/// A lease request for one worker: every lane, any type, no wait.
pub fn lease_req(worker: &str, max_jobs: u32, lease_ms: u64) -> Value {
    json!({"worker_id": worker, "types": null, "max_jobs": max_jobs,
           "lease_ms": lease_ms, "wait_ms": 0})
}

/// An id as it goes into a path (ids may be JSON strings or numbers).
pub fn id_text(id: &Value) -> String {
    match id {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// An id of the same form as `id` that names nothing: a number far past it,
/// or a string with its last character changed.
pub fn unknown_id_like(id: &Value) -> String {
    match id {
        Value::Number(n) => (n.as_u64().expect("a non-negative id") + 1_000_000_000).to_string(),
        Value::String(s) => {
            if let Ok(n) = s.parse::<u64>() {
                return (n + 1_000_000_000).to_string();
            }
            let mut s = s.clone();
            let last = s.pop().expect("a non-empty id");
            s.push(if last == '0' { '1' } else { '0' });
            s
        }
        other => panic!("an id is a string or a number, got {other}"),
    }
}

/// Asserts the contract's error body `{"error": {"code", "reason", "message"}}`
/// with this status and code; `reason` is checked when given (POISON), and
/// must at least be present (possibly `null`) otherwise. Returns the error object.
#[track_caller]
pub fn assert_error(reply: &Reply, status: u16, code: &str, reason: Option<&str>) -> Value {
    assert_eq!(
        reply.status,
        status,
        "expected {status} {code}; body: {}",
        reply.text()
    );
    let error = reply
        .body
        .get("error")
        .unwrap_or_else(|| panic!("no `error` object in {}", reply.text()));
    assert_eq!(error["code"], code, "{error}");
    let present = error.as_object().is_some_and(|o| o.contains_key("reason"));
    assert!(
        present,
        "`reason` must be present (null when none): {error}"
    );
    if let Some(reason) = reason {
        assert_eq!(error["reason"], reason, "{error}");
    }
    let message = error["message"].as_str().unwrap_or("");
    assert!(
        !message.trim().is_empty(),
        "an error says what was wrong: {error}"
    );
    error.clone()
}

/// A time from the API (RFC 3339, UTC).
#[track_caller]
pub fn at(v: &Value) -> SystemTime {
    let s = v
        .as_str()
        .unwrap_or_else(|| panic!("a time is an RFC 3339 string, got {v}"));
    let normal = s
        .strip_suffix("+00:00")
        .map(|head| format!("{head}Z"))
        .unwrap_or_else(|| s.to_owned());
    humantime::parse_rfc3339_weak(&normal)
        .unwrap_or_else(|e| panic!("{s:?} is not RFC 3339 UTC: {e}"))
}

/// Milliseconds since the epoch, rounded down (the server keeps milliseconds).
pub fn ms(t: SystemTime) -> u128 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .expect("after 1970")
        .as_millis()
}

/// SHA-256 of `bytes`, lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// A reply read off a raw socket.
#[derive(Debug)]
pub struct RawReply {
    /// The HTTP status.
    pub status: u16,
    /// The body parsed as JSON (`Value::Null` when it is not).
    pub body: Value,
    /// The body as text.
    pub text: String,
}

/// Sends `head` (request line and headers, without the blank line) and then
/// `body_len` bytes of body — `prefix` followed by `x`s — on a raw socket,
/// chunked when `chunked`, while reading the reply; returns as soon as a
/// whole reply has arrived. The body is streamed, never built in memory, and
/// writing stops quietly if the server closes the connection.
pub async fn send_streamed(
    base: &str,
    head: &str,
    prefix: &str,
    body_len: usize,
    chunked: bool,
) -> RawReply {
    let addr = base.strip_prefix("http://").expect("an http:// base URL");
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connected");
    let (mut rd, mut wr) = stream.into_split();
    let head = format!("{head}\r\n\r\n");
    let prefix = prefix.as_bytes().to_vec();
    let writer = tokio::spawn(async move {
        wr.write_all(head.as_bytes()).await?;
        let filler = vec![b'x'; 64 * 1024];
        let mut sent = 0;
        let mut first = true;
        while sent < body_len {
            let chunk: &[u8] = if first {
                first = false;
                &prefix
            } else {
                &filler[..filler.len().min(body_len - sent)]
            };
            if chunked {
                wr.write_all(format!("{:x}\r\n", chunk.len()).as_bytes())
                    .await?;
                wr.write_all(chunk).await?;
                wr.write_all(b"\r\n").await?;
            } else {
                wr.write_all(chunk).await?;
            }
            sent += chunk.len();
        }
        if chunked {
            wr.write_all(b"0\r\n\r\n").await?;
        }
        wr.flush().await?;
        Ok::<_, std::io::Error>(wr)
    });

    let read = async {
        let mut buf = Vec::new();
        let mut tmp = vec![0u8; 16 * 1024];
        loop {
            if let Some(reply) = parse_reply(&buf) {
                return reply;
            }
            match rd.read(&mut tmp).await {
                Ok(0) => {
                    return parse_reply(&buf).unwrap_or_else(|| {
                        panic!(
                            "connection closed before a whole reply; got {:?}",
                            String::from_utf8_lossy(&buf)
                        )
                    });
                }
                Ok(n) => buf.extend_from_slice(&tmp[..n]),
                Err(e) => panic!(
                    "reading the reply failed ({e}) after {:?}",
                    String::from_utf8_lossy(&buf)
                ),
            }
        }
    };
    let reply = tokio::time::timeout(EVENTUALLY, read)
        .await
        .expect("a reply before the body was sent whole, within the timeout");
    writer.abort();
    reply
}

/// Parses a whole HTTP/1.1 reply out of `buf`, or `None` if more is needed.
pub fn parse_reply(buf: &[u8]) -> Option<RawReply> {
    let end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let rest = &buf[end + 4..];
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    let mut length = None;
    let mut chunked = false;
    for line in lines {
        let (k, v) = line.split_once(':')?;
        match k.trim().to_ascii_lowercase().as_str() {
            "content-length" => length = v.trim().parse::<usize>().ok(),
            "transfer-encoding" => chunked = v.to_ascii_lowercase().contains("chunked"),
            _ => {}
        }
    }
    let body = if chunked {
        let mut body = Vec::new();
        let mut at = rest;
        loop {
            let eol = at.windows(2).position(|w| w == b"\r\n")?;
            let size_text = String::from_utf8_lossy(&at[..eol]).into_owned();
            let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
            at = &at[eol + 2..];
            if size == 0 {
                break body;
            }
            if at.len() < size + 2 {
                return None;
            }
            body.extend_from_slice(&at[..size]);
            at = &at[size + 2..];
        }
    } else {
        let length = length.unwrap_or(0);
        if rest.len() < length {
            return None;
        }
        rest[..length].to_vec()
    };
    Some(RawReply {
        status,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        text: String::from_utf8_lossy(&body).into_owned(),
    })
}

/// Runs the `lazaret` CLI against `server`; returns its stdout, or panics
/// with everything it printed.
pub async fn cli(server: &Server, args: &[&str]) -> String {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_lazaret"));
    cmd.args(args)
        .args(["--server", server.base()])
        .env_remove("LAZARET_TOKEN")
        .env_remove("LAZARET_SERVER")
        .env_remove("COLUMNS")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("`lazaret {}` hung", args.join(" ")))
        .expect("the lazaret binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "`lazaret {}` failed ({}):\n{stdout}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// One token per role (`ops-alice` operator, `root` admin, `w-1` worker,
/// `p-1` producer; the secret is the role followed by `-secret`), for
/// tests of what each role may do.
pub const TOKENS: &str = r#"
[[tokens]]
name = "ops-alice"
role = "operator"
token = "operator-secret"

[[tokens]]
name = "root"
role = "admin"
token = "admin-secret"

[[tokens]]
name = "w-1"
role = "worker"
token = "worker-secret"

[[tokens]]
name = "p-1"
role = "producer"
token = "producer-secret"
"#;

/// Serves `app` on a free loopback port (a test's handler or webhook
/// receiver) until the test's runtime ends; returns `http://ADDR`.
pub async fn serve_app(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a free port");
    let addr = listener.local_addr().expect("bound");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

/// A seeded xorshift for the fault batteries (`kill9.rs`,
/// `power_loss.rs`): a run's choices and kill moments, replayable.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The seed in `var` (to replay a run), or one from the clock (odd, as
/// xorshift needs a non-zero state).
pub fn seed_from(var: &str) -> u64 {
    match std::env::var(var) {
        Ok(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("{var} is a number, got {s:?}")),
        Err(_) => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("after 1970")
                .as_nanos() as u64
                | 1
        }
    }
}
