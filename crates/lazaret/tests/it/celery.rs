//! Celery end to end: a real Celery worker on RabbitMQ whose task keeps
//! killing its own process, a quorum queue whose `x-delivery-limit`
//! dead-letters it into `<queue>.dlq`, and `lazaret serve` watching that
//! queue (`[[sources]]`, `mode = "watch"`). The dead letter is readable as a
//! Celery task (type, task id, arguments); once the task is fixed, a
//! redrive sends it back to Celery, which runs it to success.
//!
//! The Celery app is `tests/celery/lztasks.py`, driven by `lzctl.py`. Needs
//! `LAZARET_TEST_CELERY_PYTHON` (a Python with `celery[redis]` 5.5) and
//! `LAZARET_TEST_AMQP_URL`; Redis is `LAZARET_TEST_REDIS_URL` (default
//! `redis://127.0.0.1:6379`). Without them the test is skipped with a
//! message, or fails under `CI=true` (`.ci/run` sets them all up).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::harness::{Server, cli};

/// The source's name in lazaret.
const SOURCE: &str = "celery-orders";
/// How long RabbitMQ and Celery get to dead-letter the task (a worker
/// start and three deliveries, each killing a pool process).
const DEAD_LETTERED_WITHIN: Duration = Duration::from_secs(90);
/// How long one `lzctl.py` command may take.
const CTL_TIMEOUT: Duration = Duration::from_secs(90);

/// What the test needs from its environment.
struct Setup {
    python: String,
    amqp: String,
    redis: String,
}

fn setup(test: &str) -> Option<Setup> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    match (
        var("LAZARET_TEST_CELERY_PYTHON"),
        var("LAZARET_TEST_AMQP_URL"),
    ) {
        (Some(python), Some(amqp)) => Some(Setup {
            python,
            amqp,
            redis: var("LAZARET_TEST_REDIS_URL").unwrap_or_else(|| "redis://127.0.0.1:6379".into()),
        }),
        _ => {
            lazaret_testkit::skip(
                test,
                "LAZARET_TEST_CELERY_PYTHON (a Python with celery[redis] 5.5) and \
                 LAZARET_TEST_AMQP_URL must both be set (.ci/run sets them)",
            );
            None
        }
    }
}

/// The Redis URL of the result backend: database 15 unless one is named.
fn result_url(redis: &str) -> String {
    let redis = redis.trim_end_matches('/');
    let after_scheme = redis.split_once("://").map_or(redis, |(_, rest)| rest);
    if after_scheme.contains('/') {
        redis.to_owned()
    } else {
        format!("{redis}/15")
    }
}

/// The Celery app's environment and one-shot commands; deletes its queues
/// when dropped.
struct Celery {
    python: String,
    env: Vec<(&'static str, String)>,
    dir: PathBuf,
}

impl Celery {
    fn app_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/celery")
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.python);
        cmd.args(args)
            .current_dir(&self.dir)
            .env("PYTHONPATH", Self::app_dir())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null());
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        cmd
    }

    /// Runs `lzctl.py ARGS` and returns the JSON line it printed.
    async fn ctl(&self, args: &[&str]) -> Value {
        let mut cmd =
            tokio::process::Command::from(self.command(&[&["-m", "lzctl"], args].concat()));
        cmd.kill_on_drop(true);
        let out = tokio::time::timeout(CTL_TIMEOUT, cmd.output())
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "`lzctl {}` did not finish within {CTL_TIMEOUT:?}",
                    args.join(" ")
                )
            })
            .expect("the Celery Python runs");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "`lzctl {}` failed ({}):\n{stdout}{stderr}",
            args.join(" "),
            out.status
        );
        let line = stdout.lines().last().unwrap_or_default();
        serde_json::from_str(line).unwrap_or_else(|e| {
            panic!(
                "`lzctl {}` printed no JSON ({e}):\n{stdout}{stderr}",
                args.join(" ")
            )
        })
    }

    /// Starts `celery worker` (prefork, one process) in its own process group.
    fn worker(&self, queue: &str) -> Worker {
        let log_path = self.dir.join("worker.log");
        let log = std::fs::File::create(&log_path).expect("worker log");
        let child = self
            .command(&[
                "-m",
                "celery",
                "-A",
                "lztasks",
                "worker",
                "--pool",
                "prefork",
                "-c",
                "1",
                "-Q",
                queue,
                "-n",
                &format!("{queue}@%h"),
                "--without-mingle",
                "--without-gossip",
                "--without-heartbeat",
                "--loglevel",
                "INFO",
            ])
            .stdout(Stdio::from(log.try_clone().expect("worker log")))
            .stderr(Stdio::from(log))
            .process_group(0)
            .spawn()
            .expect("celery worker starts");
        Worker { child, log_path }
    }
}

impl Drop for Celery {
    fn drop(&mut self) {
        // Best effort: the queues are unique to this run.
        let _ = self
            .command(&["-m", "lzctl", "delete"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A Celery worker's process group, killed when dropped (also on panic).
struct Worker {
    child: Child,
    log_path: PathBuf,
}

impl Worker {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// Panics with its log if the worker's main process has exited.
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().expect("worker status") {
            panic!("the Celery worker exited ({status}):\n{}", self.log());
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // The group: the main process and its pool children.
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.child.id())])
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_celery_task_that_kills_its_worker_is_quarantined_then_redriven_to_success() {
    let test = "a_celery_task_that_kills_its_worker_is_quarantined_then_redriven_to_success";
    let Some(env) = setup(test) else { return };

    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos();
    let run = format!("{}-{nanos}", std::process::id());
    let queue = format!("lz-celery-{run}");
    let dead_letter_queue = format!("{queue}.dlq");
    let task_id = format!("charge-{run}");
    let order = format!("order-{run}");
    let amount = "4200";

    let dir = tempfile::tempdir().expect("a temporary directory");
    let crash_file = dir.path().join("crash");
    std::fs::write(&crash_file, "the task is broken").expect("crash file");
    let celery = Celery {
        python: env.python.clone(),
        env: vec![
            ("LZ_CELERY_BROKER_URL", env.amqp.clone()),
            ("LZ_CELERY_RESULT_URL", result_url(&env.redis)),
            ("LZ_CELERY_QUEUE", queue.clone()),
            ("LZ_CELERY_CRASH_FILE", crash_file.display().to_string()),
            ("LZ_CELERY_DELIVERY_LIMIT", "2".into()),
        ],
        dir: dir.path().to_owned(),
    };

    // The task queue (quorum, x-delivery-limit 2, dead-lettering to
    // <queue>.dlq) and the dead-letter queue exist before anything is sent
    // or watched: RabbitMQ drops what it dead-letters to no queue.
    let declared = celery.ctl(&["declare"]).await;
    assert_eq!(
        declared["declared"],
        json!([queue, dead_letter_queue]),
        "{declared}"
    );

    let config = format!(
        r#"
[[sources]]
name = "{SOURCE}"
broker = "rabbitmq"
url = "{amqp}"
queue = "{dead_letter_queue}"
mode = "watch"
type = "celery"
tenant = "default"
# The task queue is Celery's, not a source of this config: a redrive may
# go back to it only when it is allowed (issue 32: redrive targets come
# from the message's x-death, which whoever publishes to the DLQ controls).
redrive_allow = ["{queue}"]
"#,
        amqp = env.amqp
    );
    let server = Server::start(&config).await;
    let api = server.api();

    let started = Instant::now();
    let mut worker = celery.worker(&queue);
    let sent = celery.ctl(&["send", &task_id, &order, amount]).await;
    assert_eq!(sent["sent"], task_id.as_str(), "{sent}");

    // Three deliveries, each killing the pool process; Celery hands the task
    // back each time (reject_on_worker_lost), and RabbitMQ dead-letters it
    // past the delivery limit. lazaret takes it in.
    let deadline = Instant::now() + DEAD_LETTERED_WITHIN;
    let items = loop {
        let items = api.dead_letters(&format!("source={SOURCE}")).await;
        if !items.is_empty() {
            break items;
        }
        worker.assert_running();
        assert!(
            Instant::now() < deadline,
            "no dead letter from source {SOURCE} within {DEAD_LETTERED_WITHIN:?}\n\
             --- celery worker ---\n{}\n--- lazaret ---\n{}",
            worker.log(),
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!(
        "dead-lettered and taken in {:?} after the worker started",
        started.elapsed()
    );
    assert_eq!(items.len(), 1, "exactly one dead letter: {items:?}");
    let dl = &items[0];
    assert_eq!(dl["type"], "lztasks.charge", "{dl}");
    assert_eq!(dl["reason"], "delivery_limit", "{dl}");
    assert_eq!(dl["stage"], "broker", "{dl}");
    assert_eq!(dl["idempotency_key"], task_id.as_str(), "{dl}");
    let source = &dl["source"];
    assert_eq!(source["name"], SOURCE, "{dl}");
    assert_eq!(source["broker"], "rabbitmq", "{dl}");
    assert_eq!(
        source["queue"],
        queue.as_str(),
        "the original queue, from x-death: {dl}"
    );
    assert_eq!(
        source["message_id"],
        task_id.as_str(),
        "Celery's id header: {dl}"
    );
    let preview = dl["payload_preview"].as_str().unwrap_or_default();
    assert!(preview.contains(&order), "the task's JSON body: {dl}");
    assert_eq!(dl["celery"]["task"], "lztasks.charge", "{dl}");
    assert_eq!(dl["celery"]["id"], task_id.as_str(), "{dl}");
    let worker_log = worker.log();
    assert!(
        worker_log
            .matches("exited with 'signal 9 (SIGKILL)'")
            .count()
            >= 2,
        "the task killed its pool process on every delivery:\n{worker_log}"
    );

    // One dead letter read whole: the task's arguments from its JSON body.
    let id = match &dl["id"] {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let one = api.get(&format!("/v1/dead-letters/{id}")).await;
    let one = one.expect(200);
    assert_eq!(
        one["celery"]["arguments"],
        json!({"args": [order, 4200], "kwargs": {}}),
        "{one}"
    );

    // The CLI shows it as the Celery task it is.
    let shown = cli(&server, &["dlq", "show", &id]).await;
    for needle in [task_id.as_str(), "lztasks.charge", order.as_str(), amount] {
        assert!(
            shown.contains(needle),
            "`dlq show {id}` names {needle:?}:\n{shown}"
        );
    }

    // Fix the task, then redrive: lazaret republishes it to the queue
    // x-death names, with the same task id, and Celery runs it.
    std::fs::remove_file(&crash_file).expect("crash file removed");
    let redriven = cli(&server, &["dlq", "redrive", "--source", SOURCE]).await;
    eprintln!("lazaret dlq redrive --source {SOURCE}:\n{redriven}");

    let redriven_at = Instant::now();
    let result = celery.ctl(&["result", &task_id, "60"]).await;
    eprintln!(
        "result {:?} after the redrive: {result}",
        redriven_at.elapsed()
    );
    assert_eq!(
        result,
        json!({"state": "SUCCESS",
               "result": {"order_id": order, "charged": 4200, "status": "charged"}}),
        "the redriven task ran to success\n--- celery worker ---\n{}",
        worker.log()
    );

    // It left the quarantine (the broker confirmed the publish first).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let items = api.dead_letters(&format!("source={SOURCE}")).await;
        if items.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the redriven dead letter is still there: {items:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    worker.assert_running();
    drop(worker);
    drop(server);
}
