//! The promise under pressure (issue 15): a batch flood beside an
//! interactive lane, one tenant's swarm beside nine small tenants, a poison
//! storm, and how soon an idle worker starts a job.
//!
//! Each scenario compares two sides measured in the same invocation (flood
//! and idle, say), alternating them `--runs` times, each run against a
//! fresh `lazaret serve` started with the scenario's own config; the report
//! gives each side's median and spread and the ratio of the medians against
//! the target. `start-latency` has one side: its reference in the
//! same run is the round trip of the enqueue itself.
//!
//! Not part of the shipped binary: `cargo bench -p lazaret --bench promise
//! -- --scenario lane-flood` runs it (`main.rs`), and `tests/it/bench.rs`
//! includes this module to run each scenario small. The HTTP client, the
//! server process and the statistics are the throughput bench's
//! (`src/bench/`), included by path. How the clients are arranged, and why,
//! is in `docs/benchmarks.md` ("The promise under pressure").

// Shared with `lazaret bench`, which uses parts these scenarios do not.
#[allow(dead_code)]
#[path = "../../src/bench/http.rs"]
mod http;
#[allow(dead_code)]
#[path = "../../src/bench/load.rs"]
mod load;
#[allow(dead_code)]
#[path = "../../src/bench/server.rs"]
mod server;
#[allow(dead_code)]
#[path = "../../src/bench/stats.rs"]
mod stats;
#[path = "work.rs"]
mod work;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Serialize;

use server::{BenchSchema, ServerProcess};
use stats::{Latency, Verify};
use work::{Fate, Goal, Paced, Pool, PoolOut, Run, Target};

/// The `lazaret` binary each run starts as its server.
const LAZARET: &str = env!("CARGO_BIN_EXE_lazaret");

/// Options of the promise scenarios.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "promise",
    about = "The promise under pressure: lazaret's lane-flood, tenant-flood, poison-storm and start-latency scenarios"
)]
pub struct Args {
    /// The scenario to run.
    #[arg(long, value_enum)]
    pub scenario: Promise,
    /// TOML config for the servers (not with lane-flood or poison-storm,
    /// which bring their own).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Start the servers on this PostgreSQL database instead of a fresh
    /// SQLite directory: `postgres://USER@HOST:PORT/DB`. Each run gets a
    /// fresh schema of its own, dropped after.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// poison-storm: jobs in each run.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    jobs: u64,
    /// Concurrent pool workers (the batch workers, the storm's, the tenants').
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1024))]
    consumers: u64,
    /// lease_ms of each lease.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// Runs of each side (alternating, each against a fresh server).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=50))]
    runs: u64,
    /// lane-flood: jobs in the batch flood.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    flood_jobs: u64,
    /// lane-flood and start-latency: jobs the paced producer sends, one at a time.
    #[arg(long, default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..))]
    probe_jobs: u64,
    /// lane-flood and start-latency: the paced producer sends a job this often.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    probe_interval_ms: u64,
    /// lane-flood: the batch workers lease both lanes, and nobody waits on
    /// the interactive lane alone.
    #[arg(long)]
    shared_pool: bool,
    /// lane-flood: workers long-polling the interactive lane, one job at a
    /// time each (ignored with --shared-pool). One is saturated by its own
    /// round trips during a flood (about 100 jobs/s at ~10 ms each), and
    /// its queue, not the server's, then sets the latency.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    interactive_workers: u64,
    /// tenant-flood: jobs of the big tenant.
    #[arg(long, default_value_t = 50_000, value_parser = clap::value_parser!(u64).range(1..))]
    big_tenant_jobs: u64,
    /// tenant-flood: small tenants.
    #[arg(long, default_value_t = 9, value_parser = clap::value_parser!(u64).range(1..=1000))]
    small_tenants: u64,
    /// tenant-flood: jobs of each small tenant.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..))]
    small_tenant_jobs: u64,
    /// Simulated handler time per delivery, in µs (the jobs of one lease
    /// run one after another).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    work_us: u64,
    /// Give up a run after this long (then it fails).
    #[arg(long, default_value = "10m")]
    timeout: humantime::Duration,
    /// Print one JSON object on stdout (the human tables go to stderr).
    #[arg(long)]
    pub json: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// What [`run`] found: the JSON report, and the runs that failed.
#[derive(Debug)]
pub struct Report {
    pub json: serde_json::Value,
    pub failed: Vec<String>,
}

/// The lanes of `lane-flood`: the interactive lane has four times the batch
/// lane's weight and a fifth of the lease capacity reserved while it has work.
const LANE_FLOOD_CONFIG: &str = "\
# lazaret bench --scenario lane-flood
[lanes.interactive]
weight = 4
reserve = 0.2

[lanes.batch]
weight = 1
";

/// Lease expiries dead-letter a job as `crash_loop` at the second (the
/// config below), after a short backoff, so dropped jobs end quickly.
const STORM_CRASH_LOOP_MAX: u64 = 2;
/// The poison storm's leases: short, so dropped jobs come back soon, yet
/// far longer than a lease of ten 1 ms jobs takes to ack.
const STORM_LEASE_MS: u64 = 500;
const STORM_CONFIG: &str = "\
# lazaret bench --scenario poison-storm
[defaults]
attempts_max = 10
crash_loop_max = 2
backoff_base_ms = 10
backoff_cap_ms = 50
";

/// Jobs per lease of a pool worker (the batch workers, the storm's, the tenants').
const POOL_MAX_JOBS: u64 = 10;
/// Long poll of a pool worker's lease.
const POOL_WAIT_MS: u64 = 1000;
/// Long poll of the idle worker that takes paced jobs: it waits far longer
/// than the producer's interval, so a job always finds it waiting.
const PROBE_WAIT_MS: u64 = 30_000;
/// The lane-flood's flood and the big tenant: jobs per enqueue request.
const FLOOD_BATCH: u64 = 1000;
/// Connections enqueuing the lane-flood's flood at once.
const FLOOD_CONNECTIONS: u64 = 4;
/// A small tenant enqueues its jobs in requests of this many.
const SMALL_TENANT_BATCH: u64 = 10;
/// The storm's jobs: per request, and connections at once.
const STORM_BATCH: u64 = 100;
const STORM_CONNECTIONS: u64 = 2;
/// Tenants the flood's and the storm's jobs are spread over.
const SPREAD_TENANTS: u64 = 8;
/// Payload filler of bulk jobs.
const DATA_BYTES: usize = 100;

/// The scenarios of this module.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Promise {
    /// The interactive lane's enqueue → lease (p50/p95/p99), idle and
    /// beside a batch flood of --flood-jobs.
    LaneFlood,
    /// Nine small tenants' completion times, alone and after one tenant
    /// queued --big-tenant-jobs.
    TenantFlood,
    /// Handler calls per second with every job acked and with 10 % failed
    /// permanently and 5 % dropped until they crash-loop; checks where
    /// every bad job ended. --jobs per run.
    PoisonStorm,
    /// Enqueue → lease with one idle long-polling worker.
    StartLatency,
}

impl Promise {
    fn name(self) -> &'static str {
        match self {
            Promise::LaneFlood => "lane-flood",
            Promise::TenantFlood => "tenant-flood",
            Promise::PoisonStorm => "poison-storm",
            Promise::StartLatency => "start-latency",
        }
    }

    /// The sides compared, in the order each run takes them.
    fn sides(self) -> &'static [Side] {
        match self {
            Promise::LaneFlood => &[Side::Idle, Side::Flood],
            Promise::TenantFlood => &[Side::Alone, Side::Flood],
            Promise::PoisonStorm => &[Side::Clean, Side::Storm],
            Promise::StartLatency => &[Side::Idle],
        }
    }

    /// The config the scenario's servers start with (none: the defaults).
    fn config(self) -> Option<&'static str> {
        match self {
            Promise::LaneFlood => Some(LANE_FLOOD_CONFIG),
            Promise::PoisonStorm => Some(STORM_CONFIG),
            Promise::TenantFlood | Promise::StartLatency => None,
        }
    }
}

/// One side of a comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
enum Side {
    /// No flood (lane-flood), or a lone idle worker (start-latency).
    Idle,
    /// The flood running.
    Flood,
    /// The small tenants without the big one.
    Alone,
    /// Every job acked.
    Clean,
    /// Some jobs failed and dropped on purpose.
    Storm,
}

impl Side {
    fn name(self) -> &'static str {
        match self {
            Side::Idle => "idle",
            Side::Flood => "flood",
            Side::Alone => "alone",
            Side::Clean => "clean",
            Side::Storm => "storm",
        }
    }
}

/// What one run reports.
#[derive(Debug, Clone, Serialize)]
struct RunRecord {
    run: u64,
    side: Side,
    /// First enqueue → the end of the last handled delivery.
    elapsed_s: f64,
    loadavg_start: Option<[f64; 3]>,
    loadavg_end: Option<[f64; 3]>,
    /// Deliveries the workers received (each one a handler call).
    handler_calls: u64,
    handler_calls_per_s: f64,
    /// Enqueue (the instant the request was sent) → the lease that
    /// brought the job, of the paced jobs.
    #[serde(skip_serializing_if = "Option::is_none")]
    start_latency: Option<Latency>,
    /// Round trips of the paced `POST /v1/jobs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    enqueue: Option<Latency>,
    /// lane-flood: jobs not yet acked when the last paced job was sent
    /// (the flood's, and at most a few paced ones).
    #[serde(skip_serializing_if = "Option::is_none")]
    unacked_at_probe_end: Option<u64>,
    /// tenant-flood: each small tenant's first enqueue → its last ack, s.
    #[serde(skip_serializing_if = "Option::is_none")]
    small_tenants_s: Option<BTreeMap<String, f64>>,
    /// tenant-flood: the big tenant's first enqueue → its last ack, s.
    #[serde(skip_serializing_if = "Option::is_none")]
    big_tenant_s: Option<f64>,
    /// poison-storm: after the last delivery, until the dead letters held
    /// every bad job (the last leases' expiry), s.
    #[serde(skip_serializing_if = "Option::is_none")]
    dead_letters_settle_s: Option<f64>,
    verify: Verify,
    ok: bool,
    errors: Vec<String>,
}

/// The scenario's config, written to a file for the servers to read.
struct ConfigFile(PathBuf);

impl ConfigFile {
    fn write(name: &str, text: &str) -> anyhow::Result<Self> {
        let path =
            std::env::temp_dir().join(format!("lazaret-bench-{}-{name}.toml", std::process::id()));
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
        Ok(ConfigFile(path))
    }
}

impl Drop for ConfigFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Runs `--scenario`: every run of every side, then the comparison. The
/// human tables go to `human`; the report comes back.
pub async fn run(args: &Args, human: &mut dyn std::io::Write) -> anyhow::Result<Report> {
    let promise = args.scenario;
    if promise.config().is_some() && args.config.is_some() {
        bail!(
            "--scenario {} starts its servers with a config of its own (see docs/benchmarks.md); drop --config",
            promise.name()
        );
    }
    let config = promise
        .config()
        .map(|text| ConfigFile::write(promise.name(), text))
        .transpose()?;
    let config_path = config
        .as_ref()
        .map(|c| c.0.as_path())
        .or(args.config.as_deref());
    let loadavg_before = server::loadavg();
    let mut records = Vec::new();
    let mut broken = Vec::new();
    for run in 1..=args.runs {
        for &side in promise.sides() {
            eprintln!(
                "bench {} run {run}/{}: {}",
                promise.name(),
                args.runs,
                side.name()
            );
            match one(args, promise, side, run, config_path).await {
                Ok(r) => {
                    write!(human, "{}", render_record(&r))?;
                    human.flush()?;
                    records.push(r);
                }
                Err(e) => {
                    eprintln!(
                        "bench {} run {run} {} FAILED: {e:#}",
                        promise.name(),
                        side.name()
                    );
                    broken.push(format!("run {run} {}", side.name()));
                }
            }
        }
    }
    let loadavg_after = server::loadavg();
    let (summary, text) = summarize(args, promise, &records);
    write!(human, "{text}")?;
    let load = |l: Option<[f64; 3]>| {
        l.map_or_else(
            || "-".into(),
            |l| format!("{:.2} {:.2} {:.2}", l[0], l[1], l[2]),
        )
    };
    writeln!(
        human,
        "  load average before {}, after {}",
        load(loadavg_before),
        load(loadavg_after)
    )?;
    human.flush()?;
    let json = serde_json::json!({
        "scenario": promise.name(),
        "runs": records,
        "failed_to_run": broken,
        "summary": summary,
        "loadavg_before": loadavg_before,
        "loadavg_after": loadavg_after,
    });
    let failed: Vec<String> = records
        .iter()
        .filter(|r| !r.ok)
        .map(|r| format!("run {} {}", r.run, r.side.name()))
        .chain(broken)
        .collect();
    Ok(Report { json, failed })
}

impl Report {
    /// An error naming the failed runs, if any failed.
    pub fn check(&self, promise: Promise) -> anyhow::Result<()> {
        if !self.failed.is_empty() {
            bail!(
                "bench {} FAILED (an error, or jobs lost, duplicated, refused or dead-lettered wrongly) in: {}",
                promise.name(),
                self.failed.join(", ")
            );
        }
        Ok(())
    }
}

/// One run of one side against a fresh server.
async fn one(
    args: &Args,
    promise: Promise,
    side: Side,
    run: u64,
    config: Option<&Path>,
) -> anyhow::Result<RunRecord> {
    let schema = match &args.store {
        Some(url) => Some(BenchSchema::new(url).await?),
        None => None,
    };
    let store = schema.as_ref().map(BenchSchema::store_url);
    let server = ServerProcess::spawn_binary(Path::new(LAZARET), config, store.as_deref()).await?;
    let loadavg_start = server::loadavg();
    let result = async {
        let client = http::Client::new(server.url(), None)?;
        match promise {
            Promise::LaneFlood => lane_flood(args, &client, side).await,
            Promise::TenantFlood => tenant_flood(args, &client, side).await,
            Promise::PoisonStorm => poison_storm(args, &client, side).await,
            Promise::StartLatency => start_latency(args, &client).await,
        }
    }
    .await;
    let loadavg_end = server::loadavg();
    let log = server.log_excerpt();
    server.stop().await;
    if let Some(schema) = schema {
        schema.drop_schema().await;
    }
    let mut r = result.map_err(|e| anyhow::anyhow!("{e:#}\n{log}"))?;
    r.run = run;
    r.side = side;
    (r.loadavg_start, r.loadavg_end) = (loadavg_start, loadavg_end);
    Ok(r)
}

impl RunRecord {
    /// A record of what `run` and the pools saw; the scenario fills in the rest.
    fn new(run: &Run, out: &PoolOut, verify: Verify) -> Self {
        let elapsed = out
            .last_handled
            .map_or_else(|| run.start.elapsed(), |t| t - run.start);
        let errors = run.errors();
        RunRecord {
            run: 0,
            side: Side::Idle,
            elapsed_s: elapsed.as_secs_f64(),
            loadavg_start: None,
            loadavg_end: None,
            handler_calls: out.deliveries,
            handler_calls_per_s: out.deliveries as f64 / elapsed.as_secs_f64().max(1e-9),
            start_latency: None,
            enqueue: None,
            unacked_at_probe_end: None,
            small_tenants_s: None,
            big_tenant_s: None,
            dead_letters_settle_s: None,
            ok: verify.ok() && errors.is_empty() && out.outcome_errors == 0,
            verify,
            errors,
        }
    }
}

fn work(args: &Args) -> Duration {
    Duration::from_micros(args.work_us)
}

fn target(lane: &str, job_type: &str, tenant: &str, tenants: u64) -> Target {
    Target {
        lane: lane.into(),
        job_type: job_type.into(),
        tenant: tenant.into(),
        tenants,
    }
}

/// The interactive lane's enqueue → lease, idle or beside a batch flood.
///
/// The batch workers (`--consumers`, ten jobs per lease, `--work-us` per
/// job) lease lane `batch` only; one idle worker long-polls lane
/// `interactive` for one job at a time, as latency-critical queues get
/// workers of their own. With `--shared-pool` there is no such worker:
/// the batch workers lease both lanes. The paced producer and the
/// interactive worker run on a thread of their own, so the flood's
/// clients do not delay their clocks on the bench's side.
async fn lane_flood(args: &Args, client: &http::Client, side: Side) -> anyhow::Result<RunRecord> {
    let flood = if side == Side::Flood {
        args.flood_jobs
    } else {
        0
    };
    let run = Run::new(
        Goal {
            acked: flood + args.probe_jobs,
            ..Goal::default()
        },
        args.timeout.into(),
    );
    let lanes = |l: &[&str]| l.iter().map(|&s| s.to_owned()).collect::<Vec<_>>();
    let batch_pool = Pool {
        name: "batch",
        workers: args.consumers,
        lanes: if args.shared_pool {
            lanes(&["interactive", "batch"])
        } else {
            lanes(&["batch"])
        },
        max_jobs: POOL_MAX_JOBS,
        lease_ms: args.lease_ms,
        wait_ms: POOL_WAIT_MS,
        work: work(args),
        storm: false,
    };
    let interactive_pool = (!args.shared_pool).then(|| Pool {
        name: "interactive",
        workers: args.interactive_workers,
        lanes: lanes(&["interactive"]),
        max_jobs: 1,
        wait_ms: PROBE_WAIT_MS,
        ..batch_pool.clone()
    });
    let probe = {
        let (run, client) = (run.clone(), client.clone());
        let (count, interval) = (
            args.probe_jobs,
            Duration::from_millis(args.probe_interval_ms),
        );
        std::thread::spawn(move || -> anyhow::Result<(Paced, PoolOut, u64)> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the probe's runtime")?;
            rt.block_on(async move {
                let pool = interactive_pool
                    .map(|p| tokio::spawn(work::run_pool(run.clone(), client.clone(), p)));
                let t = target("interactive", "interactive", "t0", 1);
                let paced = work::enqueue_paced(&run, &client, &t, count, interval).await;
                let unacked = (flood + count).saturating_sub(run.acked());
                if let Err(e) = &paced {
                    run.fail(anyhow::anyhow!("{e:#}"));
                }
                let out = match pool {
                    Some(p) => p.await.context("the interactive worker panicked")?,
                    None => PoolOut::default(),
                };
                Ok((paced?, out, unacked))
            })
        })
    };
    let batch = tokio::spawn(work::run_pool(run.clone(), client.clone(), batch_pool));
    let mut enqueued = Vec::new();
    if flood > 0 {
        let t = target("batch", "batch", "t", SPREAD_TENANTS);
        let data = "x".repeat(DATA_BYTES);
        match work::enqueue_bulk(client, &t, 0..flood, FLOOD_BATCH, FLOOD_CONNECTIONS, &data).await
        {
            Ok((ids, _)) => enqueued.extend(ids.into_iter().map(|(_, id)| id)),
            Err(e) => run.fail(e.context("enqueuing the flood")),
        }
    }
    let mut out = batch.await.context("the batch pool panicked")?;
    let probed = tokio::task::spawn_blocking(move || probe.join())
        .await
        .context("joining the probe")?
        .map_err(|_| anyhow::anyhow!("the probe thread panicked"))?;
    let (paced, probe_out, unacked) = match probed {
        Ok(p) => p,
        Err(e) => {
            run.fail(e);
            (Paced::default(), PoolOut::default(), 0)
        }
    };
    out.merge(probe_out);
    enqueued.extend(paced.ids);
    let verify = Verify::check(&enqueued, &out.acked, out.outcome_errors);
    let mut r = RunRecord::new(&run, &out, verify);
    r.start_latency = Some(Latency::from_samples(&mut out.start_us));
    r.enqueue = Some(Latency::from_samples(&mut paced.enqueue_us.clone()));
    r.unacked_at_probe_end = (side == Side::Flood).then_some(unacked);
    Ok(r)
}

/// Nine small tenants' completion times, alone or after a big tenant
/// queued its swarm.
///
/// A pool of `--consumers` workers leases any tenant's jobs, ten per
/// lease, `--work-us` per job. The big tenant's jobs are all queued first
/// (the swarm waits in the queue, the workers already at it); then the
/// small tenants start at once, each on a connection of its own,
/// enqueuing its jobs ten per request.
async fn tenant_flood(args: &Args, client: &http::Client, side: Side) -> anyhow::Result<RunRecord> {
    let big = if side == Side::Flood {
        args.big_tenant_jobs
    } else {
        0
    };
    let small = args.small_tenant_jobs;
    let run = Run::new(
        Goal {
            acked: big + args.small_tenants * small,
            ..Goal::default()
        },
        args.timeout.into(),
    );
    let pool = Pool {
        name: "tenants",
        workers: args.consumers,
        lanes: vec!["bench".into()],
        max_jobs: POOL_MAX_JOBS,
        lease_ms: args.lease_ms,
        wait_ms: POOL_WAIT_MS,
        work: work(args),
        storm: false,
    };
    let workers = tokio::spawn(work::run_pool(run.clone(), client.clone(), pool));
    let data = "x".repeat(DATA_BYTES);
    let mut enqueued = Vec::new();
    let mut big_start = None;
    if big > 0 {
        let t = target("bench", "bench", "big", 1);
        match work::enqueue_bulk(client, &t, 0..big, FLOOD_BATCH, 1, &data).await {
            Ok((ids, first)) => {
                enqueued.extend(ids.into_iter().map(|(_, id)| id));
                big_start = Some(first);
            }
            Err(e) => run.fail(e.context("enqueuing the big tenant's jobs")),
        }
    }
    let mut small_tasks = Vec::new();
    for k in 0..args.small_tenants {
        let (client, data) = (client.clone(), data.clone());
        let t = target("bench", "bench", &format!("small-{k}"), 1);
        let from = (k + 1) << 32;
        small_tasks.push(tokio::spawn(async move {
            work::enqueue_bulk(
                &client,
                &t,
                from..from + small,
                SMALL_TENANT_BATCH,
                1,
                &data,
            )
            .await
        }));
    }
    let mut small_start = Vec::new();
    for (k, task) in small_tasks.into_iter().enumerate() {
        match task.await.context("a small tenant's producer panicked")? {
            Ok((ids, first)) => {
                enqueued.extend(ids.into_iter().map(|(_, id)| id));
                small_start.push((format!("small-{k}"), first));
            }
            Err(e) => run.fail(e.context(format!("enqueuing tenant small-{k}'s jobs"))),
        }
    }
    let out = workers.await.context("the pool panicked")?;
    let took = |tenant: &str, first: Instant| {
        out.last_ack_by_tenant
            .get(tenant)
            .map(|last| last.saturating_duration_since(first).as_secs_f64())
    };
    let small_tenants_s: BTreeMap<String, f64> = small_start
        .iter()
        .filter_map(|(tenant, first)| Some((tenant.clone(), took(tenant, *first)?)))
        .collect();
    let verify = Verify::check(&enqueued, &out.acked, out.outcome_errors);
    let mut r = RunRecord::new(&run, &out, verify);
    r.small_tenants_s = Some(small_tenants_s);
    r.big_tenant_s = big_start.and_then(|first| took("big", first));
    Ok(r)
}

/// Handler calls per second with every job acked, or with a tenth failed
/// permanently and a twentieth dropped (left to expire until they
/// crash-loop), and where every bad job ended.
///
/// A pool of `--consumers` workers, ten jobs per lease of 500 ms,
/// `--work-us` per delivery (a dropped one too: the handler ran, then the
/// process died); the `--jobs` jobs are enqueued while the workers run. The
/// clock stops when the last delivery has been handled; the wait for the
/// last leases to expire is reported apart.
async fn poison_storm(args: &Args, client: &http::Client, side: Side) -> anyhow::Result<RunRecord> {
    let storm = side == Side::Storm;
    let n = args.jobs;
    let fate = |seq| if storm { Fate::storm(seq) } else { Fate::Ack };
    let count = |f| (0..n).filter(|&s| fate(s) == f).count() as u64;
    let (good, permanent, dropped) = (
        count(Fate::Ack),
        count(Fate::FailPermanent),
        count(Fate::Drop),
    );
    let run = Run::new(
        Goal {
            acked: good,
            failed: permanent,
            dropped: dropped * STORM_CRASH_LOOP_MAX,
        },
        args.timeout.into(),
    );
    let pool = Pool {
        name: "storm",
        workers: args.consumers,
        lanes: vec!["bench".into()],
        max_jobs: POOL_MAX_JOBS,
        lease_ms: STORM_LEASE_MS,
        wait_ms: POOL_WAIT_MS,
        work: work(args),
        storm,
    };
    let workers = tokio::spawn(work::run_pool(run.clone(), client.clone(), pool));
    let t = target("bench", "bench", "t", SPREAD_TENANTS);
    let data = "x".repeat(DATA_BYTES);
    let ids =
        match work::enqueue_bulk(client, &t, 0..n, STORM_BATCH, STORM_CONNECTIONS, &data).await {
            Ok((ids, _)) => ids,
            Err(e) => {
                run.fail(e.context("enqueuing the jobs"));
                Vec::new()
            }
        };
    let out = workers.await.context("the pool panicked")?;
    let expected_dead: HashMap<String, String> = ids
        .iter()
        .filter_map(|(seq, id)| {
            let reason = match fate(*seq) {
                Fate::Ack => return None,
                Fate::FailPermanent => "permanent",
                Fate::Drop => "crash_loop",
            };
            Some((id.clone(), reason.to_owned()))
        })
        .collect();
    let mut settle = None;
    let mut dead = Vec::new();
    if storm && run.errors().is_empty() {
        // The last dropped jobs end when their second lease expires.
        let within = Duration::from_millis(4 * STORM_LEASE_MS) + Duration::from_secs(10);
        match work::await_dead_letters(client, permanent + dropped, within).await {
            Ok(took) => settle = Some(took.as_secs_f64()),
            Err(e) => run.fail(e),
        }
        match work::dead_letters(client).await {
            Ok(d) => dead = d,
            Err(e) => run.fail(e.context("reading the dead letters")),
        }
    }
    let enqueued: Vec<String> = ids.into_iter().map(|(_, id)| id).collect();
    let verify = Verify::check_outcomes(
        &enqueued,
        &out.acked,
        out.outcome_errors,
        &expected_dead,
        &dead,
    );
    let mut r = RunRecord::new(&run, &out, verify);
    r.dead_letters_settle_s = settle;
    Ok(r)
}

/// Enqueue → lease with one idle worker long-polling for one job at a
/// time and a producer sending a job every `--probe-interval-ms`.
async fn start_latency(args: &Args, client: &http::Client) -> anyhow::Result<RunRecord> {
    let run = Run::new(
        Goal {
            acked: args.probe_jobs,
            ..Goal::default()
        },
        args.timeout.into(),
    );
    let pool = Pool {
        name: "idle",
        workers: 1,
        lanes: vec!["bench".into()],
        max_jobs: 1,
        lease_ms: args.lease_ms,
        wait_ms: PROBE_WAIT_MS,
        work: work(args),
        storm: false,
    };
    let worker = tokio::spawn(work::run_pool(run.clone(), client.clone(), pool));
    let t = target("bench", "bench", "t0", 1);
    let interval = Duration::from_millis(args.probe_interval_ms);
    let mut paced = match work::enqueue_paced(&run, client, &t, args.probe_jobs, interval).await {
        Ok(p) => p,
        Err(e) => {
            run.fail(e);
            Paced::default()
        }
    };
    let mut out = worker.await.context("the worker panicked")?;
    let verify = Verify::check(&paced.ids, &out.acked, out.outcome_errors);
    let mut r = RunRecord::new(&run, &out, verify);
    r.start_latency = Some(Latency::from_samples(&mut out.start_us));
    r.enqueue = Some(Latency::from_samples(&mut paced.enqueue_us));
    Ok(r)
}

/// Median, lowest and highest of some values.
#[derive(Debug, Clone, Copy, Serialize)]
struct Spread {
    median: f64,
    min: f64,
    max: f64,
    n: usize,
}

impl Spread {
    fn of(mut v: Vec<f64>) -> Option<Self> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: v[0],
            max: v[n - 1],
            n,
        })
    }

    fn text(&self, unit: &str, digits: usize) -> String {
        format!(
            "median {:.digits$} {unit} (min {:.digits$}, max {:.digits$}, {} runs)",
            self.median, self.min, self.max, self.n
        )
    }
}

/// One value of the good runs of one side.
fn spread_of(
    records: &[RunRecord],
    side: Side,
    f: impl Fn(&RunRecord) -> Option<f64>,
) -> Option<Spread> {
    Spread::of(
        records
            .iter()
            .filter(|r| r.side == side && r.ok)
            .filter_map(f)
            .collect(),
    )
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "MISSED" }
}

fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// The comparison: JSON and text.
fn summarize(args: &Args, promise: Promise, records: &[RunRecord]) -> (serde_json::Value, String) {
    let mut out = String::new();
    let _ = writeln!(out, "\n== {} summary", promise.name());
    let json = match promise {
        Promise::LaneFlood => {
            let p = |side, f: fn(&Latency) -> u64| {
                spread_of(records, side, |r| {
                    r.start_latency.as_ref().map(|l| ms(f(l)))
                })
            };
            let mut sides = serde_json::Map::new();
            for side in [Side::Idle, Side::Flood] {
                let (p50, p95, p99) = (
                    p(side, |l| l.p50_us),
                    p(side, |l| l.p95_us),
                    p(side, |l| l.p99_us),
                );
                for (name, s) in [("p50", p50), ("p95", p95), ("p99", p99)] {
                    if let Some(s) = s {
                        let _ = writeln!(
                            out,
                            "  {:<6} {name} enqueue → lease  {}",
                            side.name(),
                            s.text("ms", 2)
                        );
                    }
                }
                sides.insert(
                    side.name().into(),
                    serde_json::json!({"p50_ms": p50, "p95_ms": p95, "p99_ms": p99}),
                );
            }
            let ratio =
                |f: fn(&Latency) -> u64| Some(p(Side::Flood, f)?.median / p(Side::Idle, f)?.median);
            let p95 = ratio(|l| l.p95_us);
            if let Some(x) = p95 {
                let _ = writeln!(
                    out,
                    "  p95 under flood / idle = {x:.2} (target ≤ 1.5: {}); p50 {:.2}, p99 {:.2}",
                    verdict(x <= 1.5),
                    ratio(|l| l.p50_us).unwrap_or(f64::NAN),
                    ratio(|l| l.p99_us).unwrap_or(f64::NAN)
                );
            }
            let _ = writeln!(
                out,
                "  workers: {}; {} µs of work per job; flood {} jobs, probe {} jobs every {} ms",
                if args.shared_pool {
                    format!("{} shared by both lanes", args.consumers)
                } else {
                    format!(
                        "{} batch + {} interactive (long poll, one job at a time)",
                        args.consumers, args.interactive_workers
                    )
                },
                args.work_us,
                args.flood_jobs,
                args.probe_jobs,
                args.probe_interval_ms
            );
            serde_json::json!({
                "sides": sides,
                "ratio_p95": p95,
                "ratio_p50": ratio(|l| l.p50_us),
                "ratio_p99": ratio(|l| l.p99_us),
                "target_ratio_p95_max": 1.5,
                "met": p95.map(|x| x <= 1.5),
                "shared_pool": args.shared_pool,
            })
        }
        Promise::TenantFlood => {
            let tenants: Vec<String> = (0..args.small_tenants)
                .map(|k| format!("small-{k}"))
                .collect();
            let mut per = serde_json::Map::new();
            let mut worst: Option<(f64, &str)> = None;
            for t in &tenants {
                let s = |side| {
                    spread_of(records, side, |r| {
                        r.small_tenants_s.as_ref()?.get(t).copied()
                    })
                };
                let (alone, flood) = (s(Side::Alone), s(Side::Flood));
                let ratio = alone.zip(flood).map(|(a, f)| f.median / a.median);
                if let Some(x) = ratio {
                    if worst.is_none_or(|(w, _)| x > w) {
                        worst = Some((x, t));
                    }
                }
                if let (Some(a), Some(f), Some(x)) = (alone, flood, ratio) {
                    let _ = writeln!(
                        out,
                        "  {t:<9} alone {:.3} s ({:.3}–{:.3}), beside the swarm {:.3} s ({:.3}–{:.3}): {x:.2}×",
                        a.median, a.min, a.max, f.median, f.min, f.max
                    );
                }
                per.insert(
                    t.clone(),
                    serde_json::json!({"alone_s": alone, "flood_s": flood, "ratio": ratio}),
                );
            }
            let big = spread_of(records, Side::Flood, |r| r.big_tenant_s);
            if let Some(b) = big {
                let _ = writeln!(
                    out,
                    "  the big tenant's {} jobs drained in {}",
                    args.big_tenant_jobs,
                    b.text("s", 2)
                );
            }
            if let Some((x, t)) = worst {
                let _ = writeln!(
                    out,
                    "  worst small tenant ({t}): {x:.2}× its time alone (target ≤ 1.5: {})",
                    verdict(x <= 1.5)
                );
            }
            serde_json::json!({
                "small_tenants": per,
                "big_tenant_s": big,
                "worst_ratio": worst.map(|w| w.0),
                "worst_tenant": worst.map(|w| w.1),
                "target_ratio_max": 1.5,
                "met": worst.map(|w| w.0 <= 1.5),
            })
        }
        Promise::PoisonStorm => {
            let rate = |side| spread_of(records, side, |r| Some(r.handler_calls_per_s));
            let (clean, storm) = (rate(Side::Clean), rate(Side::Storm));
            for (side, s) in [(Side::Clean, clean), (Side::Storm, storm)] {
                if let Some(s) = s {
                    let _ = writeln!(
                        out,
                        "  {:<5} handler calls/s {}",
                        side.name(),
                        s.text("", 0)
                    );
                }
            }
            let settle = spread_of(records, Side::Storm, |r| r.dead_letters_settle_s);
            if let Some(s) = settle {
                let _ = writeln!(
                    out,
                    "  after the last delivery the dead letters were complete in {}",
                    s.text("s", 2)
                );
            }
            let ratio = clean.zip(storm).map(|(c, s)| s.median / c.median);
            if let Some(x) = ratio {
                let _ = writeln!(
                    out,
                    "  storm / clean = {x:.2} (target ≥ 0.9: {})",
                    verdict(x >= 0.9)
                );
            }
            let storms: Vec<&RunRecord> =
                records.iter().filter(|r| r.side == Side::Storm).collect();
            let right = storms.iter().all(|r| {
                r.verify.dead_right == r.verify.dead_expected && r.verify.dead_unexpected == 0
            });
            let _ = writeln!(
                out,
                "  every bad job in the dead letters with its reason, every good job acked once: {}",
                if right && storms.iter().all(|r| r.ok) {
                    "yes, in every storm run"
                } else {
                    "NO"
                }
            );
            serde_json::json!({
                "clean_handler_calls_per_s": clean,
                "storm_handler_calls_per_s": storm,
                "ratio": ratio,
                "target_ratio_min": 0.9,
                "met": ratio.map(|x| x >= 0.9),
                "dead_letters_settle_s": settle,
                "dead_letters_right": right,
            })
        }
        Promise::StartLatency => {
            let p = |f: fn(&Latency) -> u64| {
                spread_of(records, Side::Idle, |r| {
                    r.start_latency.as_ref().map(|l| ms(f(l)))
                })
            };
            let e = |f: fn(&Latency) -> u64| {
                spread_of(records, Side::Idle, |r| {
                    r.enqueue.as_ref().map(|l| ms(f(l)))
                })
            };
            let (p50, p99) = (p(|l| l.p50_us), p(|l| l.p99_us));
            let (e50, e99) = (e(|l| l.p50_us), e(|l| l.p99_us));
            for (name, s) in [
                ("start p50", p50),
                ("start p99", p99),
                ("enqueue round trip p50", e50),
                ("enqueue round trip p99", e99),
            ] {
                if let Some(s) = s {
                    let _ = writeln!(out, "  {name:<23} {}", s.text("ms", 2));
                }
            }
            let _ = writeln!(
                out,
                "  (earlier on this machine: start p50 about 1.5 ms, p99 about 8 ms)"
            );
            serde_json::json!({
                "start_p50_ms": p50, "start_p99_ms": p99,
                "enqueue_p50_ms": e50, "enqueue_p99_ms": e99,
            })
        }
    };
    (json, out)
}

fn render_record(r: &RunRecord) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "  run {} {:<5} {:>7.2} s, {:>6} handler calls ({:.0}/s)",
        r.run,
        r.side.name(),
        r.elapsed_s,
        r.handler_calls,
        r.handler_calls_per_s
    );
    if let Some(l) = &r.start_latency {
        let _ = write!(
            out,
            ", enqueue → lease p50 {:.2} p95 {:.2} p99 {:.2} max {:.2} ms",
            ms(l.p50_us),
            ms(l.p95_us),
            ms(l.p99_us),
            ms(l.max_us)
        );
    }
    if let Some(n) = r.unacked_at_probe_end {
        let _ = write!(out, ", {n} unacked at the probe's end");
    }
    if let Some(t) = &r.small_tenants_s {
        let worst = t.values().copied().fold(0.0, f64::max);
        let _ = write!(out, ", slowest small tenant {worst:.3} s");
    }
    if let Some(b) = r.big_tenant_s {
        let _ = write!(out, ", big tenant {b:.2} s");
    }
    if let Some(s) = r.dead_letters_settle_s {
        let v = &r.verify;
        let _ = write!(
            out,
            ", {} of {} dead letters right (+{s:.2} s)",
            v.dead_right, v.dead_expected
        );
    }
    let v = &r.verify;
    let _ = writeln!(
        out,
        "; {} acked of {} enqueued: {}",
        v.acked,
        v.enqueued,
        if r.ok { "OK" } else { "FAILED" }
    );
    if !r.ok {
        let _ = writeln!(out, "      verify {v:?}");
    }
    for e in &r.errors {
        let _ = writeln!(out, "      error {e}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spreads_take_the_median() {
        let s = Spread::of(vec![3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max, s.n), (2.0, 1.0, 3.0, 3));
        assert_eq!(Spread::of(vec![4.0, 1.0]).unwrap().median, 2.5);
        assert!(Spread::of(vec![]).is_none());
    }

    #[test]
    fn scenario_configs_are_valid_server_configs() {
        for p in [Promise::LaneFlood, Promise::PoisonStorm] {
            let text = p.config().unwrap();
            lazaret_server::config::ServerConfig::from_toml_str(text, Path::new("."))
                .unwrap_or_else(|e| panic!("{}: {e}", p.name()));
        }
        let storm =
            lazaret_server::config::ServerConfig::from_toml_str(STORM_CONFIG, Path::new("."))
                .unwrap();
        assert_eq!(
            u64::from(storm.policies.for_type("bench").crash_loop_max),
            STORM_CRASH_LOOP_MAX
        );
    }
}
