//! How fast one worker process drains a queue with no-op handlers, next to
//! a bare lease-and-batch-ack loop (roughly what the server can hand out to
//! one client). If the runtime keeps up, the two numbers are close.
//!
//! ```text
//! cargo build -p lazaret && cargo run -p lazaret-client --example noop_bench -- --jobs 20000
//! ```
//!
//! Without `--server` it starts `target/debug/lazaret` (next to this
//! example's binary) on a temporary directory, with in-flight caps raised
//! so the tenants' fairness caps do not throttle the measurement.

#![allow(clippy::print_stdout)]

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use lazaret_client::{AckItem, Client, Job, LeaseRequest, NewJob, Worker};
use tokio::io::{AsyncBufReadExt, BufReader};

#[derive(Debug, Parser)]
struct Args {
    /// A running server (default: start one).
    #[arg(long)]
    server: Option<String>,
    /// Jobs per measurement.
    #[arg(long, default_value_t = 20_000)]
    jobs: u64,
    /// Worker concurrency (a lease holds at most concurrency + prefetch).
    #[arg(long, default_value_t = 256)]
    concurrency: usize,
    /// Tenants the jobs are spread over.
    #[arg(long, default_value_t = 8)]
    tenants: u64,
    /// `durability` of the started server: full or normal.
    #[arg(long, default_value = "full")]
    durability: String,
}

struct Spawned {
    child: tokio::process::Child,
    _dir: tempfile::TempDir,
    url: String,
}

async fn spawn_server(durability: &str) -> anyhow::Result<Spawned> {
    let exe = std::env::current_exe()?;
    let bin: PathBuf = exe
        .parent()
        .and_then(|p| p.parent())
        .map(|d| d.join("lazaret"))
        .context("cannot locate the target directory")?;
    if !bin.exists() {
        bail!(
            "{} not found: run `cargo build -p lazaret` first, or pass --server",
            bin.display()
        );
    }
    let dir = tempfile::tempdir()?;
    let config = dir.path().join("lazaret.toml");
    std::fs::write(
        &config,
        format!("durability = \"{durability}\"\n[tenants]\ninflight_max = 1000000\n"),
    )?;
    let mut child = tokio::process::Command::new(bin)
        .args(["serve", "--listen", "127.0.0.1:0", "--data"])
        .arg(dir.path().join("data"))
        .arg("--config")
        .arg(&config)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().context("no stdout")?).lines();
    let first = lines
        .next_line()
        .await?
        .context("the server said nothing")?;
    let url = first
        .strip_prefix("lazaret listening on ")
        .context("unexpected first line")?
        .trim()
        .to_owned();
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Spawned {
        child,
        _dir: dir,
        url,
    })
}

async fn enqueue(client: &Client, n: u64, tenants: u64, job_type: &str) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut i = 0;
    while i < n {
        let jobs: Vec<NewJob> = (i..n.min(i + 1000))
            .map(|k| {
                NewJob::new(
                    job_type,
                    format!("t{}", k % tenants),
                    &serde_json::json!({ "k": k }),
                )
            })
            .collect::<Result<_, _>>()?;
        i += jobs.len() as u64;
        for r in client.enqueue_batch(&jobs).await? {
            r?;
        }
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

/// Lease up to 1000, ack them all in one request, repeat: no handlers.
async fn bare_loop(client: &Client, n: u64) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut done = 0;
    while done < n {
        let mut req = LeaseRequest::new("bare");
        req.max_jobs = 1000;
        req.types = Some(vec!["bare".into()]);
        req.wait = Duration::from_secs(1);
        let jobs = client.lease(&req).await?;
        let items: Vec<AckItem> = jobs
            .into_iter()
            .map(|j| AckItem {
                id: j.id,
                lease_token: j.lease_token,
            })
            .collect();
        if items.is_empty() {
            continue;
        }
        for r in client.acks(&items).await? {
            r?;
        }
        done += items.len() as u64;
    }
    Ok(n as f64 / start.elapsed().as_secs_f64())
}

async fn worker_run(client: &Client, n: u64, concurrency: usize) -> anyhow::Result<f64> {
    let acked = Arc::new(AtomicU64::new(0));
    let all_done = Arc::new(tokio::sync::Notify::new());
    let (a, d) = (acked.clone(), all_done.clone());
    let worker = Worker::builder(client.clone())
        .concurrency(concurrency)
        .poll_wait(Duration::from_millis(500))
        .handle("noop", |_job: Job<serde_json::Value>| async { Ok(()) })
        .on_report(move |_| {
            if a.fetch_add(1, Ordering::Relaxed) + 1 == n {
                d.notify_one();
            }
        })
        .build()?;
    let start = Instant::now();
    let report = worker
        .run_until(async move { all_done.notified().await })
        .await?;
    let secs = start.elapsed().as_secs_f64();
    if report.succeeded != n {
        bail!("expected {n} acks, the worker reports {report:?}");
    }
    Ok(n as f64 / secs)
}

/// CPU seconds (user + system) a process has used, from `/proc` (Linux).
fn cpu_secs(pid: &str) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after_name = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after_name.split(' ').collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Runs `phase` and prints its rate and the CPU each process spent per job.
async fn measure<F: std::future::Future<Output = anyhow::Result<f64>>>(
    label: &str,
    n: u64,
    server_pid: Option<String>,
    phase: F,
) -> anyhow::Result<()> {
    let cpu = |pid: &Option<String>| pid.as_deref().and_then(cpu_secs);
    let (s0, c0) = (cpu(&server_pid), cpu_secs("self"));
    let rate = phase.await?;
    let (s1, c1) = (cpu(&server_pid), cpu_secs("self"));
    let per_job = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => format!("{:>4.0} us", (b - a) * 1e6 / n as f64),
        _ => "   ?".to_owned(),
    };
    println!(
        "{label:<40} {rate:>7.0} jobs/s   CPU per job: server {}, client {}",
        per_job(s0, s1),
        per_job(c0, c1)
    );
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let spawned = match &args.server {
        Some(_) => None,
        None => Some(spawn_server(&args.durability).await?),
    };
    let url = args
        .server
        .clone()
        .or_else(|| spawned.as_ref().map(|s| s.url.clone()))
        .context("no server")?;
    let client = Client::new(url.clone())?;
    client.health().await?;
    println!("server {url}, {} jobs, {} tenants", args.jobs, args.tenants);

    let pid = spawned
        .as_ref()
        .and_then(|s| s.child.id())
        .map(|p| p.to_string());
    let n = args.jobs;
    measure(
        "enqueue (batches of 1000)",
        n,
        pid.clone(),
        enqueue(&client, n, args.tenants, "bare"),
    )
    .await?;
    measure(
        "bare lease(1000) + acks loop",
        n,
        pid.clone(),
        bare_loop(&client, n),
    )
    .await?;
    enqueue(&client, n, args.tenants, "noop").await?;
    let label = format!("Worker, no-op handlers, concurrency {}", args.concurrency);
    measure(&label, n, pid, worker_run(&client, n, args.concurrency)).await?;
    Ok(())
}
