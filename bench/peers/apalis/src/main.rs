//! Peer benchmark: apalis 1.0 with `apalis-postgres` on the PostgreSQL that `lazaret bench --store` uses.
//!
//! Creates a fresh database on the server of `--url` (apalis-postgres keeps
//! everything in a fixed schema named `apalis`, so a fresh schema per run is
//! not possible; a fresh database is), runs apalis's own migrations
//! (`PostgresStorage::setup`), queues `--backlog` jobs in a queue nobody
//! works (they stay in the same table and index for the whole run, as
//! lazaret's backlog lane does), then pushes `--jobs` jobs through a no-op
//! handler and prints one JSON line. The database is dropped at the end.
//!
//! Two modes:
//! - `drain` (default): the N jobs are enqueued first (timed on their own),
//!   then the workers start; jobs/s is N over the time from the workers'
//!   start until every worker has stopped with all N acknowledged.
//! - `concurrent`: producers push the N jobs while the workers run, as
//!   lazaret's bench does; jobs/s is N over the time from the first push
//!   until all N are acknowledged.
//!
//! Either way the count of jobs in status `Done` is read back from the table
//! after the workers stop and the run fails unless it is exactly N.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use apalis::prelude::*;
use apalis_postgres::{Config, PgPool, PostgresStorage};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, Connection, Row};
use tokio::sync::Notify;

const QUEUE: &str = "bench";
const BACKLOG_QUEUE: &str = "backlog";

struct Args {
    url: String,
    jobs: u64,
    backlog: u64,
    batch: usize,
    fetch: usize,
    workers: usize,
    concurrency: usize,
    producers: usize,
    payload_bytes: usize,
    mode: Mode,
    lock_tasks: bool,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Drain,
    Concurrent,
}

const USAGE: &str =
    "apalis-peer-bench [--url postgres://postgres@127.0.0.1:5432/test] [--jobs 50000] \
[--backlog 0] [--batch 100] [--fetch 100] [--workers 16] [--concurrency 100] [--producers 8] \
[--payload-bytes 100] [--mode drain|concurrent] [--lock-tasks true|false]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        url: "postgres://postgres@127.0.0.1:5432/test".into(),
        jobs: 50_000,
        backlog: 0,
        batch: 100,
        fetch: 100,
        workers: 16,
        concurrency: 100,
        producers: 8,
        payload_bytes: 100,
        mode: Mode::Drain,
        lock_tasks: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Err(USAGE.into());
        }
        let value = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\nusage: {USAGE}"))?;
        let num = |v: &str| {
            v.parse::<u64>()
                .map_err(|_| format!("{flag} takes a whole number, not {v:?}"))
        };
        match flag.as_str() {
            "--url" => a.url = value,
            "--jobs" => a.jobs = num(&value)?,
            "--backlog" => a.backlog = num(&value)?,
            "--batch" => a.batch = num(&value)? as usize,
            "--fetch" => a.fetch = num(&value)? as usize,
            "--workers" => a.workers = num(&value)? as usize,
            "--concurrency" => a.concurrency = num(&value)? as usize,
            "--producers" => a.producers = num(&value)? as usize,
            "--payload-bytes" => a.payload_bytes = num(&value)? as usize,
            "--mode" => {
                a.mode = match value.as_str() {
                    "drain" => Mode::Drain,
                    "concurrent" => Mode::Concurrent,
                    _ => return Err(format!("--mode is drain or concurrent, not {value:?}")),
                }
            }
            "--lock-tasks" => {
                a.lock_tasks = value
                    .parse()
                    .map_err(|_| format!("--lock-tasks is true or false, not {value:?}"))?
            }
            _ => return Err(format!("unknown option {flag}\nusage: {USAGE}")),
        }
    }
    if a.jobs == 0 || a.batch == 0 || a.fetch == 0 || a.workers == 0 || a.concurrency == 0 {
        return Err(
            "--jobs, --batch, --fetch, --workers and --concurrency must be at least 1".into(),
        );
    }
    if a.mode == Mode::Concurrent && a.producers == 0 {
        return Err("--mode concurrent needs --producers at least 1".into());
    }
    Ok(a)
}

/// Counts handled jobs and wakes the main task when the last one is in.
struct Done {
    handled: AtomicU64,
    target: u64,
    all: Notify,
}

async fn handle(_payload: String, done: Data<Arc<Done>>) -> Result<(), BoxDynError> {
    if done.handled.fetch_add(1, Ordering::Relaxed) + 1 == done.target {
        done.all.notify_one();
    }
    Ok(())
}

fn config(a: &Args, queue: &str) -> Config {
    Config::default()
        .queue(queue)
        .batch_size(a.fetch)
        .lock_tasks(a.lock_tasks)
}

/// Pushes `count` jobs into `queue`, `batch` per `push_bulk` (one multi-row
/// INSERT in one transaction each), from `producers` concurrent tasks.
async fn enqueue(
    pool: &PgPool,
    a: &Args,
    queue: &str,
    count: u64,
    producers: usize,
) -> Result<Duration, String> {
    let start = Instant::now();
    let payload: String = "x".repeat(a.payload_bytes);
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..producers.max(1) {
        let mut storage = PostgresStorage::<String>::new(pool).with_config(config(a, queue));
        let next = next.clone();
        let payload = payload.clone();
        let batch = a.batch as u64;
        tasks.push(tokio::spawn(async move {
            loop {
                let from = next.fetch_add(batch, Ordering::Relaxed);
                if from >= count {
                    return Ok::<(), String>(());
                }
                let n = batch.min(count - from) as usize;
                storage
                    .push_bulk(vec![payload.clone(); n])
                    .await
                    .map_err(|e| format!("push_bulk failed: {e}"))?;
            }
        }));
    }
    for t in tasks {
        t.await.map_err(|e| format!("producer panicked: {e}"))??;
    }
    Ok(start.elapsed())
}

async fn status_counts(pool: &PgPool, queue: &str) -> Result<Vec<(String, i64)>, String> {
    let rows = sqlx::query(
        "SELECT status, count(*) FROM apalis.jobs WHERE job_type = $1 GROUP BY status ORDER BY status",
    )
    .bind(queue)
    .fetch_all(pool)
    .await
    .map_err(|e| format!("counting jobs by status: {e}"))?;
    Ok(rows
        .iter()
        .map(|r| (r.get::<String, _>(0), r.get::<i64, _>(1)))
        .collect())
}

async fn run(a: &Args, pool: &PgPool) -> Result<serde_json::Value, String> {
    PostgresStorage::setup(pool)
        .await
        .map_err(|e| format!("apalis migrations failed: {e}"))?;

    let mut backlog_s = 0.0;
    if a.backlog > 0 {
        backlog_s = enqueue(pool, a, BACKLOG_QUEUE, a.backlog, a.producers)
            .await?
            .as_secs_f64();
    }
    let mut enqueue_s = None;
    if a.mode == Mode::Drain {
        enqueue_s = Some(
            enqueue(pool, a, QUEUE, a.jobs, a.producers)
                .await?
                .as_secs_f64(),
        );
    }

    let done = Arc::new(Done {
        handled: AtomicU64::new(0),
        target: a.jobs,
        all: Notify::new(),
    });
    let start = Instant::now();
    let mut contexts = Vec::new();
    let mut workers = Vec::new();
    for i in 0..a.workers {
        let ctx = WorkerContext::new(&format!("bench-worker-{i}"));
        let backend = PostgresStorage::<String>::new(pool)
            .with_config(config(a, QUEUE))
            .with_pubsub();
        let worker = WorkerBuilder::new(&ctx)
            .backend(backend)
            .concurrency(a.concurrency)
            .data(done.clone())
            .build(handle);
        contexts.push(ctx);
        workers.push(tokio::spawn(worker.run()));
    }
    let producers = if a.mode == Mode::Concurrent {
        let (pool, a2) = (pool.clone(), clone_args(a));
        Some(tokio::spawn(async move {
            enqueue(&pool, &a2, QUEUE, a2.jobs, a2.producers).await
        }))
    } else {
        None
    };

    let notified = done.all.notified();
    if done.handled.load(Ordering::Relaxed) < a.jobs {
        tokio::time::timeout(Duration::from_secs(600), notified)
            .await
            .map_err(|_| {
                format!(
                    "gave up after 600 s with {} of {} jobs handled",
                    done.handled.load(Ordering::Relaxed),
                    a.jobs
                )
            })?;
    }
    let handled_s = start.elapsed().as_secs_f64();
    for ctx in &contexts {
        // A worker that already stopped answers with an error; nothing to do then.
        let _ = ctx.stop();
    }
    for w in workers {
        w.await
            .map_err(|e| format!("worker panicked: {e}"))?
            .map_err(|e| format!("worker failed: {e}"))?;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let mut produce_s = None;
    if let Some(p) = producers {
        produce_s = Some(
            p.await
                .map_err(|e| format!("producers panicked: {e}"))??
                .as_secs_f64(),
        );
    }

    let counts = status_counts(pool, QUEUE).await?;
    let done_rows: i64 = counts
        .iter()
        .filter(|(s, _)| s == "Done")
        .map(|(_, n)| n)
        .sum();
    if done_rows as u64 != a.jobs {
        return Err(format!(
            "the table holds {done_rows} jobs Done, not {}: by status {counts:?}",
            a.jobs
        ));
    }
    let backlog_left: i64 = status_counts(pool, BACKLOG_QUEUE)
        .await?
        .iter()
        .map(|(_, n)| n)
        .sum();

    Ok(serde_json::json!({
        "peer": "apalis 1.0 + apalis-postgres 1.0",
        "mode": if a.mode == Mode::Drain { "drain" } else { "concurrent" },
        "jobs": a.jobs,
        "jobs_per_s": (a.jobs as f64 / elapsed).round(),
        "elapsed_s": elapsed,
        "handled_s": handled_s,
        "enqueue_s": enqueue_s,
        "enqueue_jobs_per_s": enqueue_s.map(|s| (a.jobs as f64 / s).round()),
        "produce_s": produce_s,
        "backlog": a.backlog,
        "backlog_left": backlog_left,
        "backlog_fill_s": backlog_s,
        "batch": a.batch,
        "fetch": a.fetch,
        "workers": a.workers,
        "concurrency": a.concurrency,
        "producers": a.producers,
        "payload_bytes": a.payload_bytes,
        "lock_tasks": a.lock_tasks,
        "persist_results": true,
        "pubsub": true,
        "done_in_table": done_rows,
        "handled": done.handled.load(Ordering::Relaxed),
    }))
}

fn clone_args(a: &Args) -> Args {
    Args {
        url: a.url.clone(),
        mode: a.mode,
        ..*a
    }
}

#[tokio::main]
async fn main() {
    let a = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let base: PgConnectOptions = match a.url.parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("--url {:?} is not a PostgreSQL URL: {e}", a.url);
            std::process::exit(2);
        }
    };
    let db = format!("apalis_bench_{}", std::process::id());
    let mut admin = match base.connect().await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot connect to {}: {e} (is PostgreSQL running?)", a.url);
            std::process::exit(1);
        }
    };
    if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut admin)
        .await
    {
        eprintln!("cannot create database {db}: {e} (the role needs CREATEDB)");
        std::process::exit(1);
    }
    let pool = PgPoolOptions::new()
        .max_connections((2 * a.workers + a.producers + 4) as u32)
        .connect_with(base.clone().database(&db))
        .await;
    let result = match pool {
        Ok(pool) => {
            let r = run(&a, &pool).await;
            pool.close().await;
            r
        }
        Err(e) => Err(format!("cannot connect to the fresh database {db}: {e}")),
    };
    if let Err(e) = sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
    )))
    .execute(&mut admin)
    .await
    {
        eprintln!("warning: could not drop database {db}: {e}; drop it by hand");
    }
    let _ = admin.close().await;
    match result {
        Ok(v) => println!("{v}"),
        Err(e) => {
            eprintln!("apalis peer bench failed: {e}");
            std::process::exit(1);
        }
    }
}
