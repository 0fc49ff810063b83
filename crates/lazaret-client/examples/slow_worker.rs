//! A worker whose handler sleeps for the payload's `sleep_ms`, printing a
//! line when each job starts and ends. The crash test kills it with
//! SIGKILL mid-job; it is also a handy way to watch leases and heartbeats.
//!
//! `cargo run -p lazaret-client --example slow_worker -- --server URL`,
//! then enqueue `{"type": "slow", "tenant": "t", "payload": {"sleep_ms": 5000}}`.

#![allow(clippy::print_stdout)]

use std::time::Duration;

use clap::Parser;
use lazaret_client::{Client, Job, Worker};
use serde::Deserialize;

#[derive(Debug, Parser)]
struct Args {
    /// The server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:7433")]
    server: String,
    /// Bearer token.
    #[arg(long, env = "LAZARET_TOKEN")]
    token: Option<String>,
    /// Lease length in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// Handlers running at once.
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    /// The job type to handle.
    #[arg(long, default_value = "slow")]
    job_type: String,
}

#[derive(Debug, Deserialize)]
struct Sleep {
    sleep_ms: u64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut client = Client::builder(&args.server);
    if let Some(t) = args.token {
        client = client.token(t);
    }
    let report = Worker::builder(client.build()?)
        .worker_id(format!("slow-worker-{}", std::process::id()))
        .concurrency(args.concurrency)
        .prefetch(0)
        .lease(Duration::from_millis(args.lease_ms))
        .poll_wait(Duration::from_millis(500))
        .handle(args.job_type, |job: Job<Sleep>| async move {
            println!("started {} attempt {}", job.id(), job.attempt());
            tokio::time::sleep(Duration::from_millis(job.payload.sleep_ms)).await;
            println!("finished {} attempt {}", job.id(), job.attempt());
            Ok(())
        })
        .build()?
        .run()
        .await?;
    println!("stopped: {report:?}");
    Ok(())
}
