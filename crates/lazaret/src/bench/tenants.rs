//! `--scenario tenants` (issue 32): single-job leases with `--jobs` queued
//! over as many tenants (one job each), against the same jobs held by one
//! tenant, alternating `--runs` times in one invocation.
//!
//! Each side starts a fresh server, queues `--jobs` jobs in lane `bench`
//! (batches of 1000), then for `--measure-s` seconds 16 workers lease one
//! job at a time (`wait_ms: 0`) and ack it, while one client of another
//! tenant enqueues single jobs into lane `other` one after another. The
//! report gives each side's leases per second and the other tenant's
//! enqueue round trip (median and spread over the runs), and the ratio
//! of the lease rates against the issue's floor (at least 0.5).

use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::BenchArgs;
use super::http;
use super::load::{self, JOB_TYPE, Load};
use super::server::{self, BenchSchema, ServerProcess};
use super::stats::Latency;

/// Workers leasing at once (the issue's 16).
const WORKERS: u64 = 16;
/// The issue's floor: many tenants lease at least this share of one tenant's rate.
const FLOOR: f64 = 0.5;

#[derive(Debug, Serialize)]
struct Record {
    run: u64,
    tenants: u64,
    queued: u64,
    fill_s: f64,
    measured_s: f64,
    leases: u64,
    leases_per_s: f64,
    lease: Latency,
    other_enqueue: Latency,
    loadavg_start: Option<[f64; 3]>,
    errors: Vec<String>,
}

#[derive(Deserialize)]
struct LeaseReply {
    jobs: Vec<Leased>,
}

#[derive(Deserialize)]
struct Leased {
    id: String,
    lease_token: String,
}

/// Runs every side of every run, then the comparison.
pub async fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let mut human: Box<dyn std::io::Write> = if args.json {
        Box::new(std::io::stderr())
    } else {
        Box::new(std::io::stdout())
    };
    let loadavg_before = server::loadavg();
    let mut records = Vec::new();
    for run in 1..=args.runs {
        for tenants in [1, args.jobs] {
            eprintln!(
                "bench tenants run {run}/{}: {} jobs over {tenants} tenant(s)",
                args.runs, args.jobs
            );
            let r = one(args, run, tenants).await?;
            writeln!(
                human,
                "  run {run} tenants {:>7}: {:>8.1} leases/s ({} in {:.1} s), lease p50 {:.2} ms, other tenant's enqueue p50 {:.2} ms{}",
                r.tenants,
                r.leases_per_s,
                r.leases,
                r.measured_s,
                r.lease.p50_us as f64 / 1000.0,
                r.other_enqueue.p50_us as f64 / 1000.0,
                if r.errors.is_empty() {
                    String::new()
                } else {
                    format!(", errors: {:?}", r.errors)
                }
            )?;
            human.flush()?;
            records.push(r);
        }
    }
    let loadavg_after = server::loadavg();
    let side = |one: bool, f: &dyn Fn(&Record) -> f64| {
        let mut v: Vec<f64> = records
            .iter()
            .filter(|r| (r.tenants == 1) == one)
            .map(f)
            .collect();
        v.sort_by(f64::total_cmp);
        spread(&v)
    };
    let rate = |r: &Record| r.leases_per_s;
    let other = |r: &Record| r.other_enqueue.p50_us as f64 / 1000.0;
    let (one_rate, many_rate) = (side(true, &rate), side(false, &rate));
    let ratio = one_rate
        .zip(many_rate)
        .map(|(a, b)| b.median / a.median.max(1e-9));
    let mut out = String::new();
    let _ = writeln!(out, "\n== tenants summary ({} jobs queued)", args.jobs);
    for (name, rate, other) in [
        ("1 tenant", one_rate, side(true, &other)),
        ("one each", many_rate, side(false, &other)),
    ] {
        if let (Some(rate), Some(other)) = (rate, other) {
            let _ = writeln!(
                out,
                "  {name:<9} leases/s {}; other tenant's enqueue p50 {}",
                rate.text("", 1),
                other.text("ms", 2)
            );
        }
    }
    if let Some(x) = ratio {
        let _ = writeln!(
            out,
            "  lease rate, one job per tenant / one tenant = {x:.2} (floor {FLOOR}: {})",
            if x >= FLOOR { "met" } else { "MISSED" }
        );
    }
    let load = |l: Option<[f64; 3]>| {
        l.map_or_else(
            || "-".into(),
            |l| format!("{:.2} {:.2} {:.2}", l[0], l[1], l[2]),
        )
    };
    let _ = writeln!(
        out,
        "  load average before {}, after {}",
        load(loadavg_before),
        load(loadavg_after)
    );
    write!(human, "{out}")?;
    human.flush()?;
    if args.json {
        let json = serde_json::json!({
            "scenario": "tenants",
            "runs": records,
            "ratio": ratio,
            "loadavg_before": loadavg_before,
            "loadavg_after": loadavg_after,
        });
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{json}")?;
        stdout.flush()?;
    }
    if records.iter().any(|r| !r.errors.is_empty()) {
        anyhow::bail!("bench tenants FAILED: a run had errors (see above)");
    }
    Ok(())
}

/// Median, min and max of ascending values.
#[derive(Clone, Copy)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
    n: usize,
}

impl Spread {
    fn text(&self, unit: &str, digits: usize) -> String {
        format!(
            "median {:.digits$}{unit} (min {:.digits$}, max {:.digits$}, {} runs)",
            self.median, self.min, self.max, self.n
        )
    }
}

fn spread(sorted: &[f64]) -> Option<Spread> {
    let n = sorted.len();
    (n > 0).then(|| Spread {
        median: if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        },
        min: sorted[0],
        max: sorted[n - 1],
        n,
    })
}

/// One side of one run, against a fresh server.
async fn one(args: &BenchArgs, run: u64, tenants: u64) -> anyhow::Result<Record> {
    let schema = match &args.store {
        Some(url) => Some(BenchSchema::new(url).await?),
        None => None,
    };
    let store = schema.as_ref().map(BenchSchema::store_url);
    let server = ServerProcess::spawn(args.config.as_deref(), store.as_deref()).await?;
    let result = measure(args, run, tenants, server.url()).await;
    let log = server.log_excerpt();
    server.stop().await;
    if let Some(schema) = schema {
        schema.drop_schema().await;
    }
    result.map_err(|e| anyhow::anyhow!("{e:#}\n{log}"))
}

async fn measure(args: &BenchArgs, run: u64, tenants: u64, url: &str) -> anyhow::Result<Record> {
    let client = http::Client::new(url, None)?;
    // The backlog fill of the other scenarios, in the measured lane.
    let fill = Load {
        jobs: args.jobs,
        batch: 1,
        producers: 0,
        consumers: 0,
        cyclers: 0,
        payload_bytes: 16,
        tenants,
        lease_ms: args.lease_ms,
        timeout: args.timeout.into(),
        next: false,
        types: load::job_types(1),
        filter_types: false,
        backlog_type: Some(JOB_TYPE.to_owned()),
    };
    let fill_s = load::fill_backlog(&client, args.jobs, &fill)
        .await
        .context("queueing the jobs")?
        .as_secs_f64();
    let loadavg_start = server::loadavg();
    let measure = Duration::from_secs(args.measure_s);
    let start = Instant::now();
    let deadline = start + measure;
    let leases = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..WORKERS {
        let (mut conn, leases, lease_ms) = (client.connection(), leases.clone(), args.lease_ms);
        tasks.spawn(async move {
            let body = serde_json::to_vec(&serde_json::json!({
                "worker_id": format!("bench-{w}"), "lanes": [load::BENCH_LANE],
                "max_jobs": 1, "lease_ms": lease_ms, "wait_ms": 0,
            }))?;
            let mut lat = Vec::new();
            while Instant::now() < deadline {
                let t = Instant::now();
                let bytes = conn.post("/v1/leases", body.clone()).await?;
                lat.push(load::micros(t));
                let reply: LeaseReply =
                    serde_json::from_slice(&bytes).context("POST /v1/leases: unexpected answer")?;
                let Some(job) = reply.jobs.first() else {
                    break;
                };
                let ack = serde_json::to_vec(&serde_json::json!({"lease_token": job.lease_token}))?;
                conn.post(&format!("/v1/jobs/{}/ack", job.id), ack).await?;
                leases.fetch_add(1, Ordering::Relaxed);
            }
            anyhow::Ok(lat)
        });
    }
    let other = {
        let mut conn = client.connection();
        tokio::spawn(async move {
            let mut lat = Vec::new();
            let body = r#"{"type":"bench","tenant":"unrelated","lane":"other","payload":{}}"#;
            while Instant::now() < deadline {
                let t = Instant::now();
                load::enqueue_one(&mut conn, body.to_owned()).await?;
                lat.push(load::micros(t));
            }
            anyhow::Ok(lat)
        })
    };
    let mut lease_us = Vec::new();
    let mut errors = Vec::new();
    while let Some(r) = tasks.join_next().await {
        match r.context("a worker panicked")? {
            Ok(lat) => lease_us.extend(lat),
            Err(e) => errors.push(format!("{e:#}")),
        }
    }
    let measured_s = start.elapsed().as_secs_f64();
    let mut other_us = match other
        .await
        .context("the other tenant's producer panicked")?
    {
        Ok(lat) => lat,
        Err(e) => {
            errors.push(format!("{e:#}"));
            Vec::new()
        }
    };
    let leases = leases.load(Ordering::Relaxed);
    Ok(Record {
        run,
        tenants,
        queued: args.jobs,
        fill_s,
        measured_s,
        leases,
        leases_per_s: leases as f64 / measured_s.max(1e-9),
        lease: Latency::from_samples(&mut lease_us),
        other_enqueue: Latency::from_samples(&mut other_us),
        loadavg_start,
        errors,
    })
}
