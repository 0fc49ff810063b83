//! A webhook-delivery worker: each job POSTs its payload's body to its
//! payload's URL, and the receiver's answer decides the job's fate — 2xx
//! delivered, 5xx and timeouts retried, 429/503 with `Retry-After` deferred
//! (no attempt spent), any other 4xx dead-lettered at once.
//!
//! One command, with a stub receiver that misbehaves on purpose and a few
//! demo deliveries aimed at it:
//!
//! ```text
//! lazaret serve --listen 127.0.0.1:7433 --data /tmp/lz &
//! cargo run -p lazaret-client --example webhook_worker -- --server http://127.0.0.1:7433 --stub
//! ```
//!
//! Without `--stub` it only works the `webhook` jobs already queued.

#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use clap::Parser;
use lazaret_client::{Client, Failure, Job, JobReport, JobResult, NewJob, Outcome, Worker};
use serde::{Deserialize, Serialize};

#[derive(Debug, Parser)]
struct Args {
    /// The lazaret server's base URL.
    #[arg(long, default_value = "http://127.0.0.1:7433")]
    server: String,
    /// Bearer token (a worker token, plus producer rights for --stub's demo jobs).
    #[arg(long, env = "LAZARET_TOKEN")]
    token: Option<String>,
    /// Start a local stub receiver and enqueue demo deliveries aimed at it.
    #[arg(long)]
    stub: bool,
    /// Deliveries in flight at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Per-delivery HTTP timeout in milliseconds.
    #[arg(long, default_value_t = 2_000)]
    timeout_ms: u64,
    /// Stop after this many seconds (default: run until ctrl-c / SIGTERM).
    #[arg(long)]
    run_for: Option<u64>,
}

/// The job: deliver `body` to `url`.
#[derive(Debug, Serialize, Deserialize)]
struct Webhook {
    url: String,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    body: serde_json::Value,
}

/// One delivery attempt. Every failure is classified, none is thrown.
async fn deliver(http: reqwest::Client, job: Job<Webhook>) -> Result<(), Failure> {
    let mut req = http
        .post(&job.payload.url)
        // The receiver dedupes on this: a redelivery after a crash between
        // its 200 and our ack does not deliver twice.
        .header(
            "Idempotency-Key",
            job.idempotency_key()
                .map_or_else(|| job.id().to_string(), str::to_owned),
        )
        .header("X-Lazaret-Attempt", job.attempt().to_string())
        .json(&job.payload.body);
    for (k, v) in &job.payload.headers {
        req = req.header(k, v);
    }
    // Refused connections and timeouts convert to transient failures.
    let reply = req.send().await?;
    match Failure::from_response(&reply) {
        None => Ok(()),
        Some(failure) => Err(failure),
    }
}

fn describe(r: &JobReport) -> String {
    let outcome = |o: &Outcome| match o {
        Outcome::Succeeded => "succeeded".to_owned(),
        Outcome::Scheduled {
            retry_at, deferred, ..
        } => {
            let in_ms = retry_at
                .duration_since(SystemTime::now())
                .unwrap_or_default()
                .as_millis();
            let what = if *deferred { "deferred" } else { "retry" };
            format!("{what} in {in_ms} ms")
        }
        Outcome::DeadLettered { reason, .. } => format!("dead-lettered ({reason})"),
        other => format!("{other:?}"),
    };
    match &r.result {
        JobResult::Succeeded => "delivered".to_owned(),
        JobResult::Failed {
            failure,
            outcome: o,
        } => format!("{failure} -> {}", outcome(o)),
        JobResult::HandedBack { outcome: o, .. } => format!("handed back -> {}", outcome(o)),
        JobResult::LeaseLost => "lease lost (dropped)".to_owned(),
        JobResult::NotReported { error } => format!("not reported: {error}"),
        other => format!("{other:?}"),
    }
}

// ---------------------------------------------------------------- the stub

/// Deliveries seen per (behaviour, idempotency key), to misbehave only at first.
#[derive(Clone, Default)]
struct Stub {
    seen: Arc<Mutex<HashMap<String, u32>>>,
}

async fn receive(
    State(stub): State<Stub>,
    Path(behaviour): Path<String>,
    headers: HeaderMap,
) -> Response {
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("-")
        .to_owned();
    let n = {
        let mut seen = stub.seen.lock().unwrap_or_else(|p| p.into_inner());
        let n = seen.entry(format!("{behaviour}/{key}")).or_default();
        *n += 1;
        *n
    };
    match (behaviour.as_str(), n) {
        ("ok", _) => StatusCode::OK.into_response(),
        // Down twice, then fine: retried with backoff, then delivered.
        ("flaky", 1..=2) => StatusCode::BAD_GATEWAY.into_response(),
        // Rate limited once: deferred for the Retry-After, no attempt spent.
        ("limited", 1) => {
            (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, "1")]).into_response()
        }
        // The endpoint is gone: permanent, dead-lettered at once.
        ("gone", _) => StatusCode::GONE.into_response(),
        // Always failing: retried until its attempts run out.
        ("broken", _) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
        // Hangs past the worker's timeout once: a transient timeout.
        ("slow", 1) => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            StatusCode::OK.into_response()
        }
        (_, _) => StatusCode::OK.into_response(),
    }
}

async fn start_stub() -> anyhow::Result<SocketAddr> {
    let app = axum::Router::new()
        .route("/hook/{behaviour}", post(receive))
        .with_state(Stub::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("stub receiver stopped: {e}");
        }
    });
    Ok(addr)
}

async fn enqueue_demo(client: &Client, stub: SocketAddr) -> anyhow::Result<()> {
    let run = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
    let mut jobs = Vec::new();
    for (i, behaviour) in [
        "ok", "flaky", "limited", "gone", "broken", "slow", "ok", "ok",
    ]
    .iter()
    .enumerate()
    {
        let hook = Webhook {
            url: format!("http://{stub}/hook/{behaviour}"),
            headers: BTreeMap::new(),
            body: serde_json::json!({ "event": "order.paid", "order": i, "behaviour": behaviour }),
        };
        jobs.push(
            NewJob::new("webhook", "demo", &hook)?.idempotency_key(format!("demo-{run}-{i}")),
        );
    }
    // A payload that is not a webhook: the handler never sees it.
    jobs.push(NewJob::new(
        "webhook",
        "demo",
        &serde_json::json!({ "oops": true }),
    )?);
    for r in client.enqueue_batch(&jobs).await? {
        match r {
            Ok(e) => println!("enqueued job {} ({:?})", e.id, e.admission),
            Err(e) => println!("refused: {e}"),
        }
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let args = Args::parse();
    let mut builder = Client::builder(&args.server);
    if let Some(t) = &args.token {
        builder = builder.token(t);
    }
    let client = builder.build()?;
    client.health().await?;
    if args.stub {
        let addr = start_stub().await?;
        println!("stub receiver on http://{addr}/hook/{{ok,flaky,limited,gone,broken,slow}}");
        enqueue_demo(&client, addr).await?;
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(args.timeout_ms))
        .build()?;
    let worker = Worker::builder(client)
        .concurrency(args.concurrency)
        .lease(Duration::from_secs(30))
        .handle("webhook", move |job: Job<Webhook>| {
            deliver(http.clone(), job)
        })
        .on_report(|r| {
            println!(
                "job {:>4} attempt {} {:>5} ms  {}",
                r.id,
                r.attempt,
                r.elapsed.as_millis(),
                describe(r)
            )
        })
        .build()?;
    println!("working webhook jobs; ctrl-c to stop");
    let report = match args.run_for {
        Some(secs) => {
            worker
                .run_until(tokio::time::sleep(Duration::from_secs(secs)))
                .await?
        }
        None => worker.run().await?,
    };
    println!("stopped: {report:?}");
    Ok(())
}
