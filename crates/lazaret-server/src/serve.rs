//! `lazaret serve`: open the store, bind, run housekeeping and the
//! `[[sources]]`, shut down cleanly.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use lazaret_core::FairScheduler;
use lazaret_store::{Duty, PgOptions, PostgresStore, SqliteStore, Store, StoreEvent};
use tokio::net::TcpListener;

use crate::app::{App, now};
use crate::auth::api_token_entry;
use crate::config::{ServerConfig, millis};
use crate::sources::{self, Sources};
use crate::{alerts, api, conn, metrics, systemd};
use lazaret_store::PolicyDecider;

/// What `serve` needs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The data directory of the embedded store.
    pub data: PathBuf,
    /// A PostgreSQL store instead (`postgres://…`): several nodes may
    /// serve one database.
    pub postgres: Option<String>,
    /// The configuration.
    pub config: ServerConfig,
}

/// Why the server could not start or stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// Refused: a non-loopback address with no tokens.
    #[error(
        "refusing to listen on {0} without tokens: anyone who can reach it could redrive or purge. \
         Configure [[tokens]] in the config file, or listen on 127.0.0.1"
    )]
    OpenWithoutTokens(SocketAddr),
    /// The scheduler configuration is invalid.
    #[error("invalid scheduler configuration: {0}")]
    Scheduler(#[from] lazaret_core::SchedulerConfigError),
    /// The store could not open.
    #[error(transparent)]
    Store(#[from] lazaret_store::StoreError),
    /// Binding or serving failed.
    #[error(
        "cannot listen on {addr}: {source}; is another server using that port? Try --listen 127.0.0.1:0"
    )]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The HTTP server failed.
    #[error("the HTTP server failed: {0}")]
    Io(#[from] std::io::Error),
    /// A token created through the API has the name of a `[[tokens]]` entry.
    #[error(
        "token name `{0}` is both in [[tokens]] and a token created through the API: \
         names identify the actor in the audit log. Rename the [[tokens]] entry, start the \
         server, revoke the API token (DELETE /v1/tokens/{0}), then rename it back if you wish"
    )]
    TokenNameClash(String),
}

/// Runs the server until SIGTERM or ctrl-c. Prints, as its first line on
/// stdout, `lazaret listening on http://ADDR` (tests and scripts read it).
pub async fn serve(opts: ServeOptions) -> Result<(), ServeError> {
    if opts.config.tokens.is_empty() && !opts.listen.ip().is_loopback() {
        return Err(ServeError::OpenWithoutTokens(opts.listen));
    }
    metrics::install();
    metrics::describe();
    metrics::configure(
        opts.config.policies.types.keys().map(|t| t.as_str()),
        opts.config
            .scheduler
            .lane_weights
            .keys()
            .map(|l| l.as_str()),
    );
    let scheduler = FairScheduler::new(opts.config.scheduler.clone())?;
    let decider = Arc::new(PolicyDecider::new(opts.config.policies.clone()));
    if let Some(url) = &opts.postgres {
        let pg = PgOptions::from_url(url)?;
        let schema = pg.schema.clone();
        let store = PostgresStore::open(pg, scheduler, decider).await?;
        let described = format!(
            "data: PostgreSQL, schema {schema} (durable at each commit; nodes on the same database share it)"
        );
        return run(store, opts, described).await;
    }
    let durability = opts.config.durability;
    let store = SqliteStore::open(&opts.data, durability, scheduler, decider)?;
    let described = format!(
        "data: {} (sqlite, durability {})",
        store.path().display(),
        match durability {
            lazaret_store::Durability::Full => "full: survives power loss",
            lazaret_store::Durability::Normal => "normal: survives a process crash",
        }
    );
    run(store, opts, described).await
}

/// The nice value of the bulk runtime's thread: the kernel gives it about a
/// tenth of the CPU time of a thread at the default 0 when both want it.
const BULK_NICE: i32 = 10;

/// A runtime of one thread, at a lower CPU priority, for the CPU-heavy
/// part of large requests ([`App::run_bulk`]): a 1,000-job batch takes
/// milliseconds to parse and admit, which on the HTTP workers (one on two
/// cores) would hold up every small enqueue, lease and ack behind it.
/// Dropped, it shuts down without waiting (a runtime may not block inside
/// another).
struct BulkRuntime(Option<tokio::runtime::Runtime>);

impl BulkRuntime {
    fn start() -> std::io::Result<BulkRuntime> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("lazaret-bulk")
            .on_thread_start(lower_priority)
            .enable_all()
            .build()?;
        Ok(BulkRuntime(Some(runtime)))
    }

    fn handle(&self) -> tokio::runtime::Handle {
        self.0
            .as_ref()
            .map(|r| r.handle().clone())
            .expect("set until dropped")
    }
}

impl Drop for BulkRuntime {
    fn drop(&mut self) {
        if let Some(r) = self.0.take() {
            r.shutdown_background();
        }
    }
}

/// Lowers the calling thread's CPU priority to [`BULK_NICE`] (on Linux a
/// nice value is per thread); where it cannot, the thread runs at the
/// default priority and still off the HTTP workers.
fn lower_priority() {
    #[cfg(unix)]
    if let Err(e) = rustix::process::setpriority_process(None, BULK_NICE) {
        tracing::debug!(error = %e, "cannot lower the bulk runtime's priority");
    }
}

/// Serves on an open store until the signal.
#[allow(clippy::print_stdout)] // the listening line on stdout is the interface
async fn run<S: Store>(store: S, opts: ServeOptions, described: String) -> Result<(), ServeError> {
    let fds = conn::raise_fd_limit();
    let connections_max = conn::connections_max(opts.config.http.connections_max, fds.now);
    let listener = TcpListener::bind(opts.listen)
        .await
        .map_err(|source| ServeError::Bind {
            addr: opts.listen,
            source,
        })?;
    let addr = listener.local_addr()?;
    let app = App::new(store, opts.config);
    app.set_listen(addr);
    let bulk = BulkRuntime::start()?;
    app.set_bulk(bulk.handle());
    let api_tokens = load_api_tokens(&app).await?;
    // Pauses are kept in the store: a restart keeps them in force.
    for pause in app.store.pauses().await? {
        tracing::info!(kind = pause.target.kind(), name = pause.target.name(), by = %pause.paused_by, "paused since before the restart");
        app.set_paused(&pause.target, true);
    }
    // Pauses made, and breakers opened, by other nodes of a cluster: in
    // force here too, but not news (the cluster's alerts told of them).
    for s in app.store.switches().await? {
        app.apply_switch(&s);
    }
    app.alerts.forget_breaker_changes();
    // The baseline, before any request can add a dead letter: the dead
    // letters already held are not recent, for the alerts nor /v1/stats.
    if app.alerts.enabled() {
        alerts::poll_once(&app).await;
    } else if let Err(e) = alerts::catch_up(&app).await {
        tracing::warn!(error = %e, "cannot read where the dead letters stand; /v1/stats counts from its first read");
    }
    // The first stdout line is a contract with scripts and tests.
    println!("lazaret listening on http://{addr}");
    println!("{described}");
    if app.config.tokens.is_empty() {
        println!("no tokens configured: serving loopback only, every caller is admin");
        if api_tokens > 0 {
            tracing::warn!(
                api_tokens,
                "tokens created through the API are stored but not in force while auth is off; \
                 configure [[tokens]] to use them"
            );
        }
    }
    for spec in &app.config.sources {
        println!("{}", sources::describe(spec));
    }
    tracing::info!(%addr, data = %described, "lazaret serving");
    let http = app.config.http;
    tracing::info!(
        fd_soft_before = %limit_text(fds.before),
        fd_soft = %limit_text(fds.now),
        fd_hard = %limit_text(fds.hard),
        connections_max,
        header_read_timeout_ms = millis(http.header_read_timeout),
        body_read_timeout_ms = millis(http.body_read_timeout),
        idle_timeout_ms = millis(http.idle_timeout),
        shutdown_grace_ms = millis(http.shutdown_grace),
        "connections: open-file limit raised to its hard limit, cap derived from it"
    );

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let cluster = tokio::spawn(cluster(Arc::clone(&app), stop_rx.clone()));
    let housekeeping = tokio::spawn(housekeeping(Arc::clone(&app), stop_rx.clone()));
    let sampler = tokio::spawn(sampler(Arc::clone(&app), stop_rx.clone()));
    let retention = tokio::spawn(retention(Arc::clone(&app), stop_rx));
    // Sources connect in the background: a broker that is down delays its
    // source, never the server.
    let sources = Sources::start(&app);
    // Alerts from background tasks: a slow or dead webhook never holds up a job.
    let alert_tasks = alerts::start(&app);
    // Ready for systemd (Type=notify): the listener is bound (connections
    // wait in its backlog until the accept loop below takes them) and the
    // sources are started. Not "connected": a broker that is down delays
    // its source, never the server, nor its start.
    systemd::notify_or_warn(&format!("READY=1\nSTATUS=listening on http://{addr}"));
    let (sources_stop_tx, sources_stop_rx) = tokio::sync::oneshot::channel::<()>();
    let sources_stopped = tokio::spawn(async move {
        // Stopped as soon as the signal comes, alongside the HTTP side's
        // own graceful shutdown: both end before the store closes.
        let _ = sources_stop_rx.await;
        sources.stop().await;
    });
    let router = api::router(Arc::clone(&app));
    let stopping = Arc::clone(&app);
    let signalled = async move {
        shutdown_signal().await;
        tracing::info!(
            grace_ms = millis(http.shutdown_grace),
            "stopping: long-polls answer now, redrives stop between batches, \
             requests under way get the grace, then the store closes"
        );
        systemd::notify_or_warn("STOPPING=1");
        stopping.begin_stop();
        let _ = sources_stop_tx.send(());
    };
    conn::run(listener, router, http, connections_max, signalled).await;
    // Whatever ended the HTTP side, the sources end too (the sender is
    // dropped with the signal future, which ends their wait).
    let _ = sources_stopped.await;
    tracing::info!("shutting down: requests and deliveries finished or dropped; closing the store");
    let _ = stop_tx.send(true);
    let _ = housekeeping.await;
    let _ = retention.await;
    let _ = sampler.await;
    let _ = cluster.await;
    for t in alert_tasks {
        t.abort();
    }
    app.store.close().await?;
    Ok(())
}

/// A resource limit as logged: its number, or `unlimited`.
fn limit_text(limit: Option<u64>) -> String {
    limit.map_or_else(|| "unlimited".to_owned(), |n| n.to_string())
}

/// Puts the tokens created through the API in force (in place of those
/// before: another node may have revoked some); returns how many.
async fn load_api_tokens<S: Store>(app: &App<S>) -> Result<usize, ServeError> {
    let stored = app.store.tokens().await?;
    let mut table = app.api_tokens.write().unwrap_or_else(|p| p.into_inner());
    *table = crate::auth::ApiTokens::default();
    for t in &stored {
        if app.config.tokens.iter().any(|c| c.name == t.name) {
            return Err(ServeError::TokenNameClash(t.name.clone()));
        }
        let entry = api_token_entry(t).map_err(lazaret_store::StoreError::Corrupt)?;
        table.insert(entry);
    }
    Ok(table.len())
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

/// A node of a cluster: what the other nodes do reaches this one through
/// the store's events (ready jobs wake long-polls, token changes reload the
/// tokens, switches pause, resume or open breakers here too), and the
/// breakers this node opens go out to them. A store of one process has no
/// events; only the second half runs, and publishing keeps nothing.
async fn cluster<S: Store>(app: Arc<App<S>>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut opened = app.take_opened();
    let mut events = app.store.events();
    loop {
        let event = async {
            match events.as_mut() {
                Some(rx) => Some(rx.recv().await),
                None => std::future::pending().await,
            }
        };
        let share = async {
            match opened.as_mut() {
                Some(rx) => rx.recv().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = stop.changed() => return,
            s = share => match s {
                Some(s) => {
                    if let Err(e) = app.store.publish(s).await {
                        tracing::warn!(error = %e, "could not share a breaker with the cluster");
                    }
                }
                None => opened = None,
            },
            e = event => match e {
                Some(Ok(StoreEvent::Ready { jobs: None })) => app.ready.anything(),
                Some(Ok(StoreEvent::Ready { jobs: Some(jobs) })) => {
                    app.ready.jobs(jobs.iter().map(|(l, t)| (l, t)));
                }
                Some(Ok(StoreEvent::TokensChanged)) => {
                    let _guard = app.token_changes.lock().await;
                    if let Err(e) = load_api_tokens(&app).await {
                        tracing::error!(error = %e, "could not reload the API tokens");
                    }
                }
                Some(Ok(StoreEvent::Switch(s))) => app.apply_switch(&s),
                Some(Ok(_)) => {}
                Some(Err(tokio::sync::broadcast::error::RecvError::Lagged(n))) => {
                    // Missed events: look at everything again.
                    tracing::warn!(missed = n, "cluster events came faster than they were read");
                    app.ready.anything();
                    let _guard = app.token_changes.lock().await;
                    let _ = load_api_tokens(&app).await;
                    if let Ok(switches) = app.store.switches().await {
                        for s in switches {
                            app.apply_switch(&s);
                        }
                    }
                }
                Some(Err(_)) | None => events = None,
            },
        }
    }
}

/// Promotes due jobs and reaps expired leases, waking long-polls. An index
/// probe each tick: nothing scans every job.
async fn housekeeping<S: Store>(app: Arc<App<S>>, mut stop: tokio::sync::watch::Receiver<bool>) {
    const TICK: Duration = Duration::from_millis(25);
    let mut warned = false;
    let mut ticks: u64 = 0;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(TICK) => {},
        }
        let now = now();
        match app.store.tick(now).await {
            Ok(t) => {
                app.observe(&t.expired, now);
                app.count_redrive_outcomes(&t.expired);
                if t.promoted > 0 || !t.expired.is_empty() {
                    app.ready.anything();
                }
            }
            Err(e) => tracing::error!(error = %e, "housekeeping failed"),
        }
        // A breaker the clock turns half-open wakes the long-polls.
        app.poll_breakers(now);
        ticks += 1;
        if ticks % 400 == 0 {
            if let Ok(s) = app.store.stats().await {
                let total: u64 = s.dead_letters.iter().map(|d| d.2).sum();
                let over = total > app.config.dead_letters_warn;
                if over && !warned {
                    tracing::warn!(
                        total,
                        warn_at = app.config.dead_letters_warn,
                        "the dead letters grew past dead_letters_warn: look at `lazaret dlq reasons`"
                    );
                }
                warned = over;
            }
        }
    }
}

/// Samples the charts' signals every `[retention] series_sample_ms`
/// (`Store::sample_signals`; docs/api.md, "Signals over time"), the first
/// time at start, and deletes samples older than
/// `lazaret_core::series::KEEP_MS`. In a cluster only the node leading
/// [`Duty::Retention`] samples: every node reads the same rows, so one
/// writer is enough, and the others spend nothing. A failed sampling is
/// logged and tried again at the next round; it never touches a job.
async fn sampler<S: Store>(app: Arc<App<S>>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let every = app.config.retention.series_sample;
    let keep = Duration::from_millis(lazaret_core::series::KEEP_MS as u64);
    loop {
        match app.store.lead(Duty::Retention).await {
            Ok(true) => {
                let now = now();
                if let Err(e) = app
                    .store
                    .sample_signals(now, now.saturating_sub(keep))
                    .await
                {
                    tracing::warn!(error = %e, "charts: sampling the signals failed; trying again at the next round");
                }
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "charts: cannot tell whether this node samples the signals; trying again at the next round");
            }
        }
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(every) => {},
        }
    }
}

/// Removes succeeded jobs past their retention in small batches; in a
/// cluster, on the one node that leads [`Duty::Retention`] (the others
/// would only contend for the same rows).
async fn retention<S: Store>(app: Arc<App<S>>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let r = app.config.retention;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            () = tokio::time::sleep(r.cleaner_interval) => {},
        }
        match app.store.lead(Duty::Retention).await {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "retention: cannot tell whether this node leads it; trying again at the next round");
                continue;
            }
        }
        let before = now().saturating_sub(r.succeeded);
        loop {
            match app.store.remove_succeeded(before, r.cleaner_batch).await {
                Ok(n) if n == u64::from(r.cleaner_batch) => tokio::task::yield_now().await,
                Ok(_) => break,
                Err(e) => {
                    tracing::error!(error = %e, "retention cleaner failed");
                    break;
                }
            }
        }
    }
}
