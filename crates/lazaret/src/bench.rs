//! `lazaret bench`: drive a server over loopback HTTP and report throughput.
//!
//! Without `--server` each run starts its own `lazaret serve` (this same
//! binary) on a random loopback port with a fresh temporary data directory,
//! so the numbers are for the durable default store. Producers and consumers
//! run at once; the clock runs from the first enqueue to the last ack, and
//! every enqueued id must come back acked exactly once. The scenarios that
//! test the promise under pressure (a lane flood, a tenant flood, a poison
//! storm, an idle worker's start latency) are not in this binary: they are
//! `cargo bench -p lazaret --bench promise` (`benches/promise/`), which
//! shares `http`, `load`, `server` and `stats` with this module.

mod http;
mod load;
mod server;
mod stats;
mod tenants;

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use serde::Serialize;

use load::Load;
use server::{BenchSchema, ServerProcess};
use stats::{Latency, Verify};

/// Options of `lazaret bench`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// The global --server: drive the server at this URL instead of
    /// starting one (no RSS figures then).
    #[arg(skip)]
    server: Option<String>,
    /// The global --token, for --server (a token with producer and worker rights).
    #[arg(skip)]
    token: Option<String>,
    /// TOML config for the server the bench starts.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Start the server on this PostgreSQL database instead of a fresh
    /// SQLite directory: `postgres://USER@HOST:PORT/DB`. Each run gets a
    /// fresh schema of its own, dropped after.
    #[arg(long, value_name = "URL")]
    store: Option<String>,
    /// Nodes to start on the --store database; the clients are spread
    /// over them (worker i talks to node i mod N).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=16), requires = "store")]
    nodes: u64,
    /// Jobs to push through (enqueue → lease → ack) in each run.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..))]
    jobs: u64,
    /// Jobs per enqueue request, max_jobs per lease, acks per /v1/acks.
    /// 1 is unbatched: POST /v1/jobs, a lease of 1, POST /v1/jobs/{id}/ack.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    batch: u64,
    /// Concurrent producer clients.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(0..=1024))]
    producers: u64,
    /// Concurrent consumer clients.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(0..=1024))]
    consumers: u64,
    /// Concurrent clients that each enqueue, lease and ack in turn, like a
    /// service that both submits work and runs it (with or instead of
    /// producers and consumers).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1024))]
    cyclers: u64,
    /// Jobs queued in lane `backlog` before measuring; nobody leases them, so
    /// the queue holds this many while the measured jobs go through.
    #[arg(long, default_value_t = 0)]
    backlog: u64,
    /// Queue the backlog in the measured lane as jobs of this type, which
    /// the consumers never lease (their leases name the measured types):
    /// what a lease filtered by type costs beside another type's backlog.
    #[arg(long, value_name = "TYPE")]
    backlog_type: Option<String>,
    /// Job types the measured jobs are spread over, in turn within each
    /// tenant (`bench`, or `bench-0` … `bench-N-1`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    types: u64,
    /// Consumers' leases name the measured types (`"types": [...]`)
    /// instead of taking any type (implied by --backlog-type).
    #[arg(long)]
    filter_types: bool,
    /// Size of the string in each job's payload.
    #[arg(long, default_value_t = 100)]
    payload_bytes: usize,
    /// Tenants the jobs are spread over, round-robin.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..))]
    tenants: u64,
    /// lease_ms of each lease.
    #[arg(long, default_value_t = 30_000)]
    lease_ms: u64,
    /// Unbatched consumers ack with `next` (POST /v1/jobs/{id}/ack answers
    /// the next lease too): two requests per job, enqueue included,
    /// instead of three. Needs --batch 1.
    #[arg(long)]
    next: bool,
    /// Runs of each side in `--scenario next` and `--scenario tenants`
    /// (alternating, each against a fresh server).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=50))]
    runs: u64,
    /// tenants: seconds of leasing measured on each side.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=600))]
    measure_s: u64,
    /// Give up a run after this long (then it fails).
    #[arg(long, default_value = "10m")]
    timeout: humantime::Duration,
    /// Run the scenarios, each against a fresh server, instead of one
    /// run shaped by the options above (--jobs, --payload-bytes, --tenants,
    /// --lease-ms still apply; batched scenarios use --producers/--consumers).
    #[arg(long, value_enum)]
    scenario: Option<Scenario>,
    /// The global --json: print one JSON object on stdout (the human
    /// table goes to stderr).
    #[arg(skip)]
    json: bool,
}

impl BenchArgs {
    /// Refuses a run in which nobody would enqueue or nobody would lease.
    fn check(&self) -> anyhow::Result<()> {
        // clap checks these conflicts only when --server follows `bench`.
        if self.server.is_some() && self.config.is_some() {
            anyhow::bail!(
                "--config configures the server the bench starts; with --server it drives yours"
            );
        }
        if self.server.is_some() && self.store.is_some() {
            anyhow::bail!(
                "--store starts servers on that database; with --server the bench drives yours (give one)"
            );
        }
        if self.server.is_some() && self.scenario.is_some() {
            anyhow::bail!(
                "--scenario runs each scenario against a fresh server; it cannot use --server"
            );
        }
        if self.producers + self.cyclers == 0 {
            anyhow::bail!("nobody would enqueue: give --producers or --cyclers at least 1");
        }
        if self.consumers + self.cyclers == 0 {
            anyhow::bail!("nobody would lease: give --consumers or --cyclers at least 1");
        }
        if self.next && self.batch > 1 {
            anyhow::bail!(
                "--next is for one-job-at-a-time workers: use it with --batch 1 (batched workers ack with /v1/acks)"
            );
        }
        Ok(())
    }
}

/// The scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    /// Batches of 100, 20,000 jobs queued.
    Batched,
    /// Batches of 100, 1,000,000 jobs queued.
    #[value(name = "batched-1m")]
    Batched1m,
    /// One job per request, 16 clients (6 producers + 10 consumers), 20,000 queued.
    Unbatched,
    /// All three in sequence, with a summary.
    All,
    /// Unbatched, 16 clients that each enqueue, lease and ack in turn,
    /// without and with `next` on acks (three requests per job, then two),
    /// alternating, --runs times each: medians, spread, ratio.
    Next,
    /// Leases filtered by type, batches of 100, with 100,000 jobs of
    /// another type queued in the same lane and tenants.
    #[value(name = "filtered-100k")]
    Filtered100k,
    /// Batches of 100, 8 types mixed within each tenant, 20,000 queued,
    /// leases of any type.
    #[value(name = "mixed-types")]
    MixedTypes,
    /// Single-job leases by 16 workers for --measure-s with --jobs queued
    /// over as many tenants (one job each), and over one tenant,
    /// alternating, --runs times each: lease rates and their ratio.
    Tenants,
}

/// One run's settings.
#[derive(Debug, Clone, Serialize)]
struct RunSpec {
    name: String,
    jobs: u64,
    batch: u64,
    producers: u64,
    consumers: u64,
    cyclers: u64,
    backlog: u64,
    /// The backlog's type when it waits in the measured lane.
    backlog_type: Option<String>,
    /// Types of the measured jobs.
    types: u64,
    /// Whether leases name the measured types.
    filter_types: bool,
    payload_bytes: usize,
    tenants: u64,
    lease_ms: u64,
    /// Consumers ack with `next`.
    next: bool,
    /// The floor for this run, if it sets one.
    target_jobs_per_s: Option<f64>,
    #[serde(skip)]
    timeout: Duration,
}

impl RunSpec {
    /// The clients, in words.
    fn clients(&self) -> String {
        let split = format!(
            "{} producers + {} consumers",
            self.producers, self.consumers
        );
        match (self.cyclers, self.producers + self.consumers) {
            (0, _) => split,
            (c, 0) => format!("{c} cyclers (enqueue, lease, ack in turn)"),
            (c, _) => format!("{split} + {c} cyclers"),
        }
    }

    /// The clients, for the summary table: `P+C`, or `Nc` for N cyclers.
    fn clients_short(&self) -> String {
        match (self.cyclers, self.producers + self.consumers) {
            (0, _) => format!("{}+{}", self.producers, self.consumers),
            (c, 0) => format!("{c}c"),
            (c, _) => format!("{}+{}+{c}c", self.producers, self.consumers),
        }
    }

    fn from_args(a: &BenchArgs) -> Self {
        RunSpec {
            name: if a.batch > 1 {
                "batched".into()
            } else {
                "unbatched".into()
            },
            jobs: a.jobs,
            batch: a.batch,
            producers: a.producers,
            consumers: a.consumers,
            cyclers: a.cyclers,
            backlog: a.backlog,
            backlog_type: a.backlog_type.clone(),
            types: a.types,
            filter_types: a.filter_types || a.backlog_type.is_some(),
            payload_bytes: a.payload_bytes,
            tenants: a.tenants,
            lease_ms: a.lease_ms,
            next: a.next,
            target_jobs_per_s: None,
            timeout: a.timeout.into(),
        }
    }

    fn scenario(a: &BenchArgs, s: Scenario) -> Vec<Self> {
        let base = RunSpec::from_args(a);
        let batched = |name: &str, backlog| RunSpec {
            name: name.into(),
            batch: 100,
            backlog,
            target_jobs_per_s: Some(30_000.0),
            ..base.clone()
        };
        // A job costs a producer one request and a consumer two (lease, ack):
        // 6 + 10 keeps all 16 clients busy to the end, where 8 + 8 leaves
        // the producers done early and measures 8 consumers.
        let unbatched = RunSpec {
            name: "unbatched-20k".into(),
            batch: 1,
            producers: 6,
            consumers: 10,
            cyclers: 0,
            backlog: 20_000,
            target_jobs_per_s: Some(5_000.0),
            ..base.clone()
        };
        match s {
            Scenario::Batched => vec![batched("batched-20k", 20_000)],
            Scenario::Batched1m => vec![batched("batched-1m", 1_000_000)],
            Scenario::Unbatched => vec![unbatched],
            Scenario::All => vec![
                batched("batched-20k", 20_000),
                batched("batched-1m", 1_000_000),
                unbatched,
            ],
            Scenario::Next => {
                // Cyclers: each client waits for every answer before its
                // next request, so a job costs it three round trips, or
                // two with `next`, and a job is always ready for the
                // `next` (the one it has just enqueued, or another's). No
                // backlog: filling 20,000 jobs before each run adds nothing.
                let plain = RunSpec {
                    name: "unbatched".into(),
                    producers: 0,
                    consumers: 0,
                    cyclers: 16,
                    backlog: 0,
                    target_jobs_per_s: None,
                    next: false,
                    ..unbatched
                };
                let with_next = RunSpec {
                    name: "unbatched-next".into(),
                    next: true,
                    ..plain.clone()
                };
                (0..a.runs)
                    .flat_map(|_| [plain.clone(), with_next.clone()])
                    .collect()
            }
            Scenario::Filtered100k => vec![RunSpec {
                backlog_type: Some("other".into()),
                types: 1,
                filter_types: true,
                target_jobs_per_s: None,
                ..batched("filtered-100k", 100_000)
            }],
            Scenario::MixedTypes => vec![RunSpec {
                types: 8,
                filter_types: false,
                target_jobs_per_s: None,
                ..batched("mixed-types", 20_000)
            }],
            // Run by `tenants::run`, not as load runs.
            Scenario::Tenants => Vec::new(),
        }
    }

    fn load(&self) -> Load {
        Load {
            jobs: self.jobs,
            batch: self.batch,
            producers: self.producers,
            consumers: self.consumers,
            cyclers: self.cyclers,
            payload_bytes: self.payload_bytes,
            tenants: self.tenants,
            lease_ms: self.lease_ms,
            timeout: self.timeout,
            next: self.next,
            types: load::job_types(self.types),
            filter_types: self.filter_types,
            backlog_type: self.backlog_type.clone(),
        }
    }
}

/// Server memory in kB at points of a run (`None` when not ours to read).
#[derive(Debug, Clone, Default, Serialize)]
struct Memory {
    rss_start_kb: Option<u64>,
    rss_after_backlog_kb: Option<u64>,
    rss_end_kb: Option<u64>,
    rss_peak_kb: Option<u64>,
}

/// CPU seconds used during the measured phase (backlog fill excluded).
#[derive(Debug, Clone, Default, Serialize)]
struct Cpu {
    /// This bench process (the clients).
    client_s: Option<f64>,
    /// Client CPU microseconds per job: what the load generator takes from
    /// the cores it shares with the server.
    client_us_per_job: Option<f64>,
    /// The server, when the bench started it.
    server_s: Option<f64>,
    /// Server CPU microseconds per job.
    server_us_per_job: Option<f64>,
}

/// What one run reports.
#[derive(Debug, Clone, Serialize)]
struct RunReport {
    #[serde(flatten)]
    spec: RunSpec,
    server: String,
    elapsed_s: f64,
    jobs_per_s: f64,
    backlog_fill_s: f64,
    enqueue: Latency,
    lease: Latency,
    ack: Latency,
    leased_jobs: u64,
    empty_leases: u64,
    /// Requests the consumers sent per job (leases and acks; a producer
    /// adds one enqueue per job unbatched).
    consumer_requests_per_job: f64,
    /// Jobs that came in the answer of an ack with `next`.
    next_jobs: u64,
    /// `/proc/loadavg` (1, 5, 15 min) when the run started and ended.
    loadavg_start: Option<[f64; 3]>,
    loadavg_end: Option<[f64; 3]>,
    /// Mean jobs per non-empty lease (lease latencies count non-empty leases only).
    jobs_per_lease: f64,
    memory: Memory,
    cpu: Cpu,
    verify: Verify,
    /// Each node's `/v1/stats` `store` section after the run (its group
    /// commits, and on PostgreSQL the groups rolled back by a deadlock).
    store: Vec<serde_json::Value>,
    ok: bool,
    errors: Vec<String>,
}

/// Runs the benchmark.
///
/// The clients run on one thread: they share the machine with the server,
/// and a multi-threaded runtime spends their CPU on waking and parking
/// worker threads (about a fifth of the client's CPU in the unbatched
/// scenario), while one thread has ample headroom for the requests the
/// server can answer.
pub fn run(mut args: BenchArgs, global: crate::cli::GlobalOpts) -> anyhow::Result<()> {
    args.server = global.server;
    args.token = global.token;
    args.json = global.json;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    rt.block_on(run_async(args))
}

async fn run_async(args: BenchArgs) -> anyhow::Result<()> {
    args.check()?;
    // A bad --server URL (https, say) is refused before anything starts.
    if let Some(url) = &args.server {
        http::parse_base_url(url).context("bad --server URL")?;
    }
    if args.scenario == Some(Scenario::Tenants) {
        return tenants::run(&args).await;
    }
    let specs = match args.scenario {
        Some(s) => RunSpec::scenario(&args, s),
        None => vec![RunSpec::from_args(&args)],
    };
    // The human tables go to stdout, or to stderr when stdout is for --json.
    let mut human: Box<dyn std::io::Write> = if args.json {
        Box::new(std::io::stderr())
    } else {
        Box::new(std::io::stdout())
    };
    let mut reports = Vec::new();
    let mut broken = Vec::new();
    // On a terminal, a bar over the scenarios (each says its own lines).
    let bar = crate::progress::Progress::bar(args.json, specs.len() as u64, "bench");
    for (done, spec) in specs.iter().enumerate() {
        bar.set(
            done as u64,
            specs.len() as u64,
            format!("bench {}", spec.name),
        );
        bar.suspend(|| {
            eprintln!(
                "bench {}: {} jobs, batch {}, {}, backlog {}",
                spec.name,
                spec.jobs,
                spec.batch,
                spec.clients(),
                spec.backlog
            );
        });
        match run_one(&args, spec).await {
            Ok(report) => {
                bar.suspend(|| -> std::io::Result<()> {
                    write!(human, "{}", render_run(&report))?;
                    human.flush()
                })?;
                reports.push(report);
            }
            // One scenario's error should not hide the others' numbers.
            Err(e) if specs.len() > 1 => {
                bar.suspend(|| eprintln!("bench {} FAILED: {e:#}", spec.name));
                broken.push(spec.name.clone());
            }
            Err(e) => return Err(e),
        }
    }
    drop(bar);
    if reports.len() > 1 {
        write!(human, "{}", render_summary(&reports))?;
        if args.scenario == Some(Scenario::Next) {
            write!(human, "{}", render_next(&reports))?;
        }
        human.flush()?;
    }
    if args.json {
        let json = if args.scenario.is_some() {
            serde_json::json!({
                "scenarios": reports,
                "failed_to_run": broken,
                "throughput_ratio_1m_vs_20k": ratio(&reports),
                "next_vs_plain": next_comparison(&reports),
            })
        } else {
            serde_json::to_value(&reports[0])?
        };
        let mut stdout = std::io::stdout().lock();
        writeln!(stdout, "{json}")?;
        stdout.flush()?;
    }

    let failed: Vec<&str> = reports
        .iter()
        .filter(|r| !r.ok)
        .map(|r| r.spec.name.as_str())
        .chain(broken.iter().map(String::as_str))
        .collect();
    if !failed.is_empty() {
        bail!(
            "bench FAILED (an error, or jobs lost, duplicated or refused) in: {}",
            failed.join(", ")
        );
    }
    Ok(())
}

/// Starts a server (unless --server), fills the backlog, runs the load.
async fn run_one(args: &BenchArgs, spec: &RunSpec) -> anyhow::Result<RunReport> {
    // A fresh schema per run on PostgreSQL, shared by its nodes.
    let schema = match &args.store {
        Some(url) => Some(BenchSchema::new(url).await?),
        None => None,
    };
    let mut spawned = Vec::new();
    if args.server.is_none() {
        for _ in 0..args.nodes {
            let store = schema.as_ref().map(BenchSchema::store_url);
            spawned.push(ServerProcess::spawn(args.config.as_deref(), store.as_deref()).await?);
        }
    }
    let urls: Vec<String> = match &args.server {
        Some(url) => vec![url.trim_end_matches('/').to_owned()],
        None => spawned.iter().map(|s| s.url().to_owned()).collect(),
    };
    let result = measure(args, spec, spawned.first_mut(), &urls).await;
    let mut log = String::new();
    for server in spawned {
        log.push_str(&server.log_excerpt());
        server.stop().await;
    }
    if let Some(schema) = schema {
        schema.drop_schema().await;
    }
    result.map_err(|e| anyhow::anyhow!("{e:#}\n{log}"))
}

async fn measure(
    args: &BenchArgs,
    spec: &RunSpec,
    mut server: Option<&mut ServerProcess>,
    urls: &[String],
) -> anyhow::Result<RunReport> {
    let Some(url) = urls.first().cloned() else {
        bail!("no server to drive")
    };
    let clients = urls
        .iter()
        .map(|u| http::Client::new(u, args.token.as_deref()))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let client = clients[0].clone();
    let rss =
        |server: &Option<&mut ServerProcess>| server.as_ref().map(|s| server::rss_kb(s.pid()));
    let mut memory = Memory {
        rss_start_kb: rss(&server).and_then(|r| r.0),
        ..Memory::default()
    };

    let load = spec.load();
    let mut backlog_fill = Duration::ZERO;
    if spec.backlog > 0 {
        backlog_fill = load::fill_backlog(&client, spec.backlog, &load).await?;
        eprintln!(
            "  backlog of {} queued in {:.2} s ({:.0} jobs/s)",
            spec.backlog,
            backlog_fill.as_secs_f64(),
            spec.backlog as f64 / backlog_fill.as_secs_f64().max(1e-9)
        );
    }
    memory.rss_after_backlog_kb = rss(&server).and_then(|r| r.0);

    let pid = server.as_ref().map(|s| s.pid());
    let cpu_at = || {
        (
            server::cpu_s(std::process::id()),
            pid.and_then(server::cpu_s),
        )
    };
    let cpu_before = cpu_at();
    let loadavg_start = server::loadavg();
    let mut m = load::run_load(&clients, &load).await?;
    let loadavg_end = server::loadavg();
    let cpu_after = cpu_at();
    let used = |a: Option<f64>, b: Option<f64>| Some(b? - a?);
    let per_job = |s: Option<f64>| s.map(|s| s * 1e6 / spec.jobs as f64);
    let (client_s, server_s) = (
        used(cpu_before.0, cpu_after.0),
        used(cpu_before.1, cpu_after.1),
    );
    let cpu = Cpu {
        client_s,
        client_us_per_job: per_job(client_s),
        server_s,
        server_us_per_job: per_job(server_s),
    };
    if let Some(r) = rss(&server) {
        (memory.rss_end_kb, memory.rss_peak_kb) = r;
    }
    if let Some(s) = server.as_mut() {
        if !s.running() {
            m.errors.push("the server exited during the run".into());
            m.aborted.get_or_insert_with(|| "the server exited".into());
        }
    }

    let mut store = Vec::new();
    for c in &clients {
        let reply = c
            .connection()
            .send(hyper::Method::GET, "/v1/stats", Bytes::new())
            .await?;
        let stats: serde_json::Value = serde_json::from_slice(&reply.body)
            .with_context(|| format!("the answer of GET /v1/stats ({})", reply.status))?;
        store.push(stats["store"].clone());
    }
    let verify = Verify::check(&m.enqueued_ids, &m.acked_ids, m.ack_errors);
    let nonempty = m.lease_us.len() as u64;
    let elapsed_s = m.elapsed.as_secs_f64();
    let mut errors = m.errors;
    if let Some(a) = m.aborted {
        if !errors.contains(&a) {
            errors.insert(0, a);
        }
    }
    let ok = verify.ok() && verify.enqueued == spec.jobs && errors.is_empty();
    Ok(RunReport {
        spec: spec.clone(),
        server: url,
        elapsed_s,
        jobs_per_s: verify.acked as f64 / elapsed_s.max(1e-9),
        backlog_fill_s: backlog_fill.as_secs_f64(),
        enqueue: Latency::from_samples(&mut m.enqueue_us),
        lease: Latency::from_samples(&mut m.lease_us),
        ack: Latency::from_samples(&mut m.ack_us),
        leased_jobs: m.leased_jobs,
        empty_leases: m.empty_leases,
        consumer_requests_per_job: m.consumer_requests as f64 / verify.acked.max(1) as f64,
        next_jobs: m.next_jobs,
        loadavg_start,
        loadavg_end,
        // Jobs that came with an ack's `next` came without a lease request.
        jobs_per_lease: (m.leased_jobs - m.next_jobs) as f64 / nonempty.max(1) as f64,
        memory,
        cpu,
        verify,
        store,
        ok,
        errors,
    })
}

fn ms(us: u64) -> String {
    format!("{:.2}", us as f64 / 1000.0)
}

fn mb(kb: Option<u64>) -> String {
    kb.map_or_else(|| "-".into(), |kb| format!("{:.1} MB", kb as f64 / 1024.0))
}

fn render_run(r: &RunReport) -> String {
    let s = &r.spec;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "\n== {}: batch {}, {}, backlog {}{}, payload {} B, {} tenants, {} type{}{}",
        s.name,
        s.batch,
        s.clients(),
        s.backlog,
        s.backlog_type
            .as_deref()
            .map(|t| format!(" (type {t}, in the measured lane)"))
            .unwrap_or_default(),
        s.payload_bytes,
        s.tenants,
        s.types,
        if s.types == 1 { "" } else { "s" },
        if s.filter_types {
            ", leases filtered by type"
        } else {
            ""
        }
    );
    let target = s
        .target_jobs_per_s
        .map(|t| {
            format!(
                " (target ≥ {t:.0}: {})",
                if r.jobs_per_s >= t { "met" } else { "MISSED" }
            )
        })
        .unwrap_or_default();
    let _ = writeln!(
        out,
        "  throughput  {} jobs in {:.2} s = {:.0} jobs/s end to end{target}",
        r.verify.acked, r.elapsed_s, r.jobs_per_s
    );
    let _ = writeln!(
        out,
        "  request        count   p50 ms   p90 ms   p99 ms   max ms"
    );
    for (name, l) in [
        ("enqueue", &r.enqueue),
        ("lease", &r.lease),
        ("ack", &r.ack),
    ] {
        let _ = writeln!(
            out,
            "  {name:<9} {:>10} {:>8} {:>8} {:>8} {:>8}",
            l.count,
            ms(l.p50_us),
            ms(l.p90_us),
            ms(l.p99_us),
            ms(l.max_us)
        );
    }
    let _ = writeln!(
        out,
        "  leases      {:.1} jobs per non-empty lease, {} empty; consumers sent {:.2} requests per job{}",
        r.jobs_per_lease,
        r.empty_leases,
        r.consumer_requests_per_job,
        if r.spec.next {
            format!(" ({} jobs came with an ack's next)", r.next_jobs)
        } else {
            String::new()
        }
    );
    if let (Some(a), Some(b)) = (r.loadavg_start, r.loadavg_end) {
        let _ = writeln!(
            out,
            "  load avg    {:.2} {:.2} {:.2} at start, {:.2} {:.2} {:.2} at end",
            a[0], a[1], a[2], b[0], b[1], b[2]
        );
    }
    let m = &r.memory;
    let _ = writeln!(
        out,
        "  server RSS  start {}, after backlog {}, end {}, peak {}",
        mb(m.rss_start_kb),
        mb(m.rss_after_backlog_kb),
        mb(m.rss_end_kb),
        mb(m.rss_peak_kb)
    );
    let secs = |s: Option<f64>| s.map_or_else(|| "-".into(), |s| format!("{s:.2} s"));
    let _ = writeln!(
        out,
        "  CPU         client {}{}, server {}{}",
        secs(r.cpu.client_s),
        r.cpu
            .client_us_per_job
            .map(|us| format!(" ({us:.0} us per job)"))
            .unwrap_or_default(),
        secs(r.cpu.server_s),
        r.cpu
            .server_us_per_job
            .map(|us| format!(" ({us:.0} us of server CPU per job)"))
            .unwrap_or_default()
    );
    let v = &r.verify;
    let _ = writeln!(
        out,
        "  verify      {} enqueued, {} acked, {} acked twice, {} missing, {} unexpected, {} duplicate ids, {} ack errors: {}",
        v.enqueued,
        v.acked,
        v.acked_twice,
        v.missing,
        v.unexpected,
        v.duplicate_ids,
        v.ack_errors,
        if r.ok { "OK" } else { "FAILED" }
    );
    for e in &r.errors {
        let _ = writeln!(out, "  error       {e}");
    }
    out
}

/// jobs/s with 1,000,000 queued over jobs/s with 20,000 queued.
fn ratio(reports: &[RunReport]) -> Option<f64> {
    let rate = |name: &str| {
        reports
            .iter()
            .find(|r| r.spec.name == name)
            .map(|r| r.jobs_per_s)
    };
    Some(rate("batched-1m")? / rate("batched-20k")?)
}

/// Median, lowest and highest jobs/s of the runs named `name`.
fn spread(reports: &[RunReport], name: &str) -> Option<(f64, f64, f64)> {
    let mut rates: Vec<f64> = reports
        .iter()
        .filter(|r| r.spec.name == name && r.ok)
        .map(|r| r.jobs_per_s)
        .collect();
    if rates.is_empty() {
        return None;
    }
    rates.sort_by(f64::total_cmp);
    let n = rates.len();
    let median = if n % 2 == 1 {
        rates[n / 2]
    } else {
        (rates[n / 2 - 1] + rates[n / 2]) / 2.0
    };
    Some((median, rates[0], rates[n - 1]))
}

/// `--scenario next`: medians and spreads of both sides, and their ratio.
fn next_comparison(reports: &[RunReport]) -> Option<serde_json::Value> {
    let (plain, plain_lo, plain_hi) = spread(reports, "unbatched")?;
    let (next, next_lo, next_hi) = spread(reports, "unbatched-next")?;
    Some(serde_json::json!({
        "plain_median_jobs_per_s": plain, "plain_min": plain_lo, "plain_max": plain_hi,
        "next_median_jobs_per_s": next, "next_min": next_lo, "next_max": next_hi,
        "ratio_of_medians": next / plain,
    }))
}

fn render_next(reports: &[RunReport]) -> String {
    let mut out = String::new();
    let (Some((p, plo, phi)), Some((n, nlo, nhi))) = (
        spread(reports, "unbatched"),
        spread(reports, "unbatched-next"),
    ) else {
        return out;
    };
    let runs = reports
        .iter()
        .filter(|r| r.spec.name == "unbatched")
        .count();
    let _ = writeln!(
        out,
        "  unbatched, 3 requests per job:      median {p:.0} jobs/s (min {plo:.0}, max {phi:.0}) over {runs} runs"
    );
    let _ = writeln!(
        out,
        "  unbatched with next, 2 per job:     median {n:.0} jobs/s (min {nlo:.0}, max {nhi:.0})"
    );
    let _ = writeln!(out, "  with next / without = {:.2}", n / p);
    let loads: Vec<f64> = reports
        .iter()
        .filter_map(|r| r.loadavg_start.map(|l| l[0]))
        .collect();
    if let (Some(lo), Some(hi)) = (
        loads.iter().copied().reduce(f64::min),
        loads.iter().copied().reduce(f64::max),
    ) {
        let _ = writeln!(
            out,
            "  1-min load average at the runs' starts: {lo:.2} to {hi:.2}"
        );
    }
    out
}

fn render_summary(reports: &[RunReport]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n== summary");
    let _ = writeln!(
        out,
        "  {:<14} {:>5} {:>7} {:>9} {:>9} {:>7} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10}  ok",
        "scenario",
        "batch",
        "clients",
        "backlog",
        "jobs/s",
        "target",
        "enq p99",
        "lse p99",
        "ack p99",
        "RSS end",
        "RSS peak",
        "srv us/job"
    );
    for r in reports {
        let s = &r.spec;
        let _ = writeln!(
            out,
            "  {:<14} {:>5} {:>7} {:>9} {:>9.0} {:>7} {:>8} {:>8} {:>8} {:>10} {:>10} {:>10}  {}",
            s.name,
            s.batch,
            s.clients_short(),
            s.backlog,
            r.jobs_per_s,
            s.target_jobs_per_s
                .map_or_else(|| "-".into(), |t| format!("{t:.0}")),
            ms(r.enqueue.p99_us),
            ms(r.lease.p99_us),
            ms(r.ack.p99_us),
            mb(r.memory.rss_end_kb),
            mb(r.memory.rss_peak_kb),
            r.cpu
                .server_us_per_job
                .map_or_else(|| "-".into(), |us| format!("{us:.0}")),
            if r.ok { "yes" } else { "NO" }
        );
    }
    if let Some(x) = ratio(reports) {
        let _ = writeln!(
            out,
            "  jobs/s at 1,000,000 queued / at 20,000 queued = {x:.2} (must not fall: {})",
            if x >= 0.9 { "ok" } else { "FELL" }
        );
    }
    if let Some(r) = reports.iter().find(|r| r.spec.name == "batched-1m") {
        if let Some(kb) = r.memory.rss_peak_kb {
            let _ = writeln!(
                out,
                "  server RSS peak with 1,000,000 queued: {} (target < 150 MB: {})",
                mb(Some(kb)),
                if kb < 150 * 1024 { "met" } else { "MISSED" }
            );
        }
    }
    let _ = writeln!(
        out,
        "  latencies in ms; times are wall clock on this machine, client and server sharing its cores"
    );
    out
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> BenchArgs {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
            .unwrap()
            .bench
    }

    #[test]
    fn defaults_and_scenarios() {
        let a = parse(&[]);
        assert_eq!(
            (a.jobs, a.batch, a.producers, a.consumers),
            (100_000, 100, 8, 8)
        );
        assert_eq!(
            (a.backlog, a.payload_bytes, a.tenants, a.lease_ms),
            (0, 100, 8, 30_000)
        );

        let all = RunSpec::scenario(
            &parse(&["--scenario", "all", "--jobs", "5000"]),
            Scenario::All,
        );
        let shape: Vec<_> = all
            .iter()
            .map(|s| {
                (
                    s.name.as_str(),
                    s.batch,
                    s.producers + s.consumers,
                    s.backlog,
                    s.jobs,
                )
            })
            .collect();
        assert_eq!(
            shape,
            vec![
                ("batched-20k", 100, 16, 20_000, 5000),
                ("batched-1m", 100, 16, 1_000_000, 5000),
                ("unbatched-20k", 1, 16, 20_000, 5000),
            ]
        );
        assert_eq!(
            parse(&["--scenario", "batched-1m"]).scenario,
            Some(Scenario::Batched1m)
        );

        let next = RunSpec::scenario(
            &parse(&["--scenario", "next", "--runs", "2"]),
            Scenario::Next,
        );
        let shape: Vec<_> = next
            .iter()
            .map(|s| (s.name.as_str(), s.batch, s.next, s.cyclers, s.backlog))
            .collect();
        assert_eq!(
            shape,
            vec![
                ("unbatched", 1, false, 16, 0),
                ("unbatched-next", 1, true, 16, 0),
                ("unbatched", 1, false, 16, 0),
                ("unbatched-next", 1, true, 16, 0),
            ]
        );
        let a = parse(&["--scenario", "filtered-100k"]);
        let [filtered] = &RunSpec::scenario(&a, Scenario::Filtered100k)[..] else {
            panic!("one run");
        };
        assert_eq!(
            (filtered.backlog, filtered.backlog_type.as_deref()),
            (100_000, Some("other"))
        );
        assert!(filtered.filter_types);
        let [mixed] = &RunSpec::scenario(&a, Scenario::MixedTypes)[..] else {
            panic!("one run");
        };
        assert_eq!((mixed.types, mixed.filter_types), (8, false));
        assert_eq!(mixed.load().types.len(), 8);
        // A backlog of another type in the measured lane needs filtered leases.
        assert!(RunSpec::from_args(&parse(&["--backlog-type", "x"])).filter_types);
    }

    #[test]
    fn refuses_nonsense() {
        let bad = |args: &[&str]| {
            Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).is_err()
        };
        assert!(bad(&["--batch", "0"]));
        assert!(bad(&["--jobs", "0"]));
        let unchecked = |args: &[&str]| parse(args).check().map_err(|e| e.to_string());
        assert_eq!(
            unchecked(&["--consumers", "0"]),
            Err("nobody would lease: give --consumers or --cyclers at least 1".into())
        );
        assert_eq!(
            unchecked(&["--producers", "0"]),
            Err("nobody would enqueue: give --producers or --cyclers at least 1".into())
        );
        assert_eq!(
            unchecked(&["--producers", "0", "--consumers", "0", "--cyclers", "16"]),
            Ok(())
        );
        assert!(
            unchecked(&["--next"])
                .unwrap_err()
                .contains("use it with --batch 1")
        );
        assert_eq!(unchecked(&["--next", "--batch", "1"]), Ok(()));
        // --server is a global option of the binary, set here as main sets it.
        let with_server = |args: &[&str]| {
            let mut a = parse(args);
            a.server = Some("http://127.0.0.1:1".into());
            a.check().map_err(|e| e.to_string())
        };
        assert!(with_server(&["--scenario", "all"]).is_err_and(|e| e.contains("--scenario")));
        assert!(with_server(&["--config", "x.toml"]).is_err_and(|e| e.contains("--config")));
        assert!(
            with_server(&["--store", "postgres://u@h/db"]).is_err_and(|e| e.contains("--store"))
        );
        assert_eq!(with_server(&[]), Ok(()));
    }
}
