//! The worker runtime: typed handlers per job type, lanes with their own
//! concurrency, batched leasing with a bounded prefetch, heartbeats,
//! panics caught as failures, batched acks, and a graceful shutdown that
//! charges no attempt to the jobs it hands back.
//!
//! How a job moves through it: a pool's lease loop asks for as many jobs
//! as it has room for ([`prefetch`]); each leased job gets a task that
//! waits for a slot (or hands the job back if shutdown comes first), runs
//! the handler under `panics::run_caught` while heartbeating every
//! lease/3, frees the slot, and passes the outcome to the reporter
//! (`report`), which batches acks and fails.

#[cfg(test)]
mod classification;
mod job;
mod panics;
pub mod prefetch;
mod report;

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lazaret_core::{JobType, Lane, WorkerId};
use serde::de::DeserializeOwned;
use serde_json::value::RawValue;
use tokio::sync::{Notify, Semaphore, mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

pub use self::job::Job;
pub use self::report::{JobReport, JobResult, RunReport};

use self::job::Meta;
use self::report::{Done, Settle, Sink};
use crate::client::Client;
use crate::error::{ClientError, ErrorCode};
use crate::failure::Failure;
use crate::model::{LeaseRequest, LeaseToken, LeasedJob};

/// Why a worker could not be built or had to stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The builder's settings do not make a worker.
    #[error("invalid worker configuration: {0}")]
    Config(String),
    /// Leasing failed in a way retrying cannot fix (bad token, forbidden,
    /// bad request); the worker drained and stopped.
    #[error("leasing failed for good: {0}")]
    Lease(#[source] Box<ClientError>),
}

/// The `retry_after` of jobs handed back at shutdown, unless
/// [`WorkerBuilder::handback_delay`] says otherwise.
pub const HANDBACK_DELAY_DEFAULT: Duration = Duration::from_secs(1);

/// What a job handed back at shutdown is failed with: deferred, kind
/// `shutdown`, so it spends no attempt.
fn hand_back_failure(delay: Duration, message: &str) -> Failure {
    Failure::deferred("shutdown", message, delay)
}

/// What a job of a type without a handler is failed with (only a server
/// that ignored the lease's `types` hands one over).
fn no_handler_failure(worker_id: &WorkerId, job_type: &JobType) -> Failure {
    Failure::transient(
        "no_handler",
        format!("worker {worker_id} has no handler for type {job_type}"),
    )
}

type HandlerFuture = Pin<Box<dyn Future<Output = Result<(), Failure>> + Send>>;
type Handler = Arc<dyn Fn(Arc<Meta>, Box<RawValue>) -> HandlerFuture + Send + Sync>;

/// A group of slots leasing from some lanes.
#[derive(Clone, Debug)]
struct PoolConfig {
    /// `None`: every lane.
    lanes: Option<Vec<Lane>>,
    concurrency: usize,
    prefetch_max: Option<usize>,
}

/// Configures a [`Worker`]. Start with [`Worker::builder`].
pub struct WorkerBuilder {
    client: Client,
    worker_id: Option<WorkerId>,
    pools: Vec<PoolConfig>,
    concurrency: usize,
    prefetch: Option<usize>,
    lease: Duration,
    heartbeats: bool,
    poll_wait: Duration,
    shutdown_grace: Duration,
    handback_delay: Duration,
    handlers: BTreeMap<JobType, Handler>,
    hook: Option<report::Hook>,
}

impl fmt::Debug for WorkerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerBuilder")
            .field("worker_id", &self.worker_id)
            .field("pools", &self.pools)
            .field("types", &self.handlers.keys().collect::<Vec<_>>())
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

impl WorkerBuilder {
    /// The id recorded in each attempt's history (default `lazaret-worker-<pid>`).
    pub fn worker_id(mut self, id: impl Into<WorkerId>) -> Self {
        self.worker_id = Some(id.into());
        self
    }

    /// Lease from `lane` with up to `concurrency` handlers running at once.
    /// Each lane gets its own slots, so a slow lane never starves another.
    /// Without any `lane`, one pool leases from every lane.
    pub fn lane(mut self, lane: impl Into<Lane>, concurrency: usize) -> Self {
        self.pools.push(PoolConfig {
            lanes: Some(vec![lane.into()]),
            concurrency,
            prefetch_max: None,
        });
        self
    }

    /// Concurrency of the every-lane pool used when no [`lane`](Self::lane)
    /// is configured (default 8).
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }

    /// Jobs each pool may hold beyond its slots, leased ahead so a freed
    /// slot starts at once (default: the pool's concurrency). The runtime
    /// lowers it to what can start within half a lease at the observed
    /// handler duration (see [`prefetch::prefetch_bound`]).
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = Some(n);
        self
    }

    /// Lease length (default 30 s). Heartbeats extend it every third of it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Whether running handlers are heartbeaten (default on). Off, a handler
    /// that runs past its lease loses the job to the next worker.
    pub fn heartbeats(mut self, on: bool) -> Self {
        self.heartbeats = on;
        self
    }

    /// How long one lease request waits for work when none is ready
    /// (default 2 s). Shutdown waits for an in-flight request to return, so
    /// this also bounds how long stopping the leasing takes.
    pub fn poll_wait(mut self, wait: Duration) -> Self {
        self.poll_wait = wait;
        self
    }

    /// How long shutdown lets running handlers finish before handing their
    /// jobs back (default 30 s).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// The `retry_after` of jobs handed back at shutdown (default 1 s).
    pub fn handback_delay(mut self, delay: Duration) -> Self {
        self.handback_delay = delay;
        self
    }

    /// Handles jobs of `job_type` with `handler`. The payload is
    /// deserialised into `T` first; when it does not fit, the job fails as
    /// permanent `parse` without the handler running. A panic in the
    /// handler is a transient failure of kind `panic` with the backtrace.
    pub fn handle<T, F, Fut>(mut self, job_type: impl Into<JobType>, handler: F) -> Self
    where
        T: DeserializeOwned + Send + 'static,
        F: Fn(Job<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Failure>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        let erased: Handler = Arc::new(move |meta: Arc<Meta>, payload: Box<RawValue>| {
            let handler = handler.clone();
            Box::pin(async move {
                let payload: T = serde_json::from_str(payload.get()).map_err(Failure::parse)?;
                handler(Job::new(payload, meta)).await
            })
        });
        self.handlers.insert(job_type.into(), erased);
        self
    }

    /// Calls `hook` with a report of every job, once its outcome is settled.
    pub fn on_report(mut self, hook: impl Fn(&JobReport) + Send + Sync + 'static) -> Self {
        self.hook = Some(Arc::new(hook));
        self
    }

    /// The worker.
    pub fn build(self) -> Result<Worker, WorkerError> {
        if self.handlers.is_empty() {
            return Err(WorkerError::Config(
                "no handlers: add one with .handle(\"type\", |job: Job<T>| async { ... })".into(),
            ));
        }
        if self.lease < Duration::from_millis(30) {
            return Err(WorkerError::Config(format!(
                "a lease of {:?} is too short to heartbeat; use at least 30 ms",
                self.lease
            )));
        }
        let mut pools = self.pools;
        if pools.is_empty() {
            pools.push(PoolConfig {
                lanes: None,
                concurrency: self.concurrency,
                prefetch_max: None,
            });
        }
        for p in &mut pools {
            if p.concurrency == 0 {
                return Err(WorkerError::Config(format!(
                    "the pool for {} has concurrency 0; give it at least 1",
                    lanes_name(&p.lanes)
                )));
            }
            p.prefetch_max = Some(self.prefetch.unwrap_or(p.concurrency));
        }
        let worker_id = self
            .worker_id
            .unwrap_or_else(|| WorkerId::new(format!("lazaret-worker-{}", std::process::id())));
        Ok(Worker {
            shared: Arc::new(Shared {
                client: self.client,
                worker_id,
                types: self.handlers.keys().cloned().collect(),
                handlers: self.handlers,
                lease: self.lease,
                heartbeats: self.heartbeats,
                poll_wait: self.poll_wait,
                shutdown_grace: self.shutdown_grace,
                handback_delay: self.handback_delay,
                sink: Arc::new(Sink::new(self.hook)),
            }),
            pools,
        })
    }
}

fn lanes_name(lanes: &Option<Vec<Lane>>) -> String {
    match lanes {
        None => "every lane".into(),
        Some(l) => l.iter().map(Lane::as_str).collect::<Vec<_>>().join(","),
    }
}

/// Where the run is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Leasing and running.
    Running,
    /// Shutdown: no more leases; waiting jobs are handed back; running
    /// handlers may finish.
    Draining,
    /// The grace is over: running handlers are dropped and handed back.
    Aborting,
}

struct Shared {
    client: Client,
    worker_id: WorkerId,
    types: Vec<JobType>,
    handlers: BTreeMap<JobType, Handler>,
    lease: Duration,
    heartbeats: bool,
    poll_wait: Duration,
    shutdown_grace: Duration,
    handback_delay: Duration,
    sink: Arc<Sink>,
}

/// One pool's live state.
struct Pool {
    config: PoolConfig,
    slots: Arc<Semaphore>,
    /// Leased and not finished: waiting for a slot or running.
    held: AtomicUsize,
    /// Signalled whenever a held job finishes.
    freed: Notify,
    avg_run: Mutex<Option<Duration>>,
}

impl Pool {
    fn running(&self) -> usize {
        self.config.concurrency - self.slots.available_permits()
    }

    fn avg_run(&self) -> Option<Duration> {
        *self.avg_run.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn observe_run(&self, d: Duration) {
        let mut avg = self.avg_run.lock().unwrap_or_else(|p| p.into_inner());
        *avg = Some(prefetch::ewma(*avg, d));
    }
}

/// Decrements `held` and wakes the lease loop however the job task ends.
struct Held(Arc<Pool>);

impl Drop for Held {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::AcqRel);
        self.0.freed.notify_one();
    }
}

/// A worker: leases jobs of the types it has handlers for and runs them.
/// See the crate documentation for a complete example.
pub struct Worker {
    shared: Arc<Shared>,
    pools: Vec<PoolConfig>,
}

impl fmt::Debug for Worker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Worker")
            .field("worker_id", &self.shared.worker_id)
            .field("types", &self.shared.types)
            .field("pools", &self.pools)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A builder for a worker using `client`.
    pub fn builder(client: Client) -> WorkerBuilder {
        WorkerBuilder {
            client,
            worker_id: None,
            pools: Vec::new(),
            concurrency: 8,
            prefetch: None,
            lease: Duration::from_secs(30),
            heartbeats: true,
            poll_wait: Duration::from_secs(2),
            shutdown_grace: Duration::from_secs(30),
            handback_delay: HANDBACK_DELAY_DEFAULT,
            handlers: BTreeMap::new(),
            hook: None,
        }
    }

    /// Runs until SIGTERM or ctrl-c, then shuts down gracefully.
    pub async fn run(self) -> Result<RunReport, WorkerError> {
        self.run_until(shutdown_signal()).await
    }

    /// Runs until `shutdown` completes, then shuts down gracefully: stops
    /// leasing, hands back jobs that have not started, lets running
    /// handlers finish within the grace, hands back the rest, and reports
    /// every outcome before returning.
    pub async fn run_until(
        self,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<RunReport, WorkerError> {
        let shared = self.shared;
        let (phase_tx, phase_rx) = watch::channel(Phase::Running);
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        let reporter = tokio::spawn(report::report_loop(
            shared.client.clone(),
            done_rx,
            shared.sink.clone(),
        ));
        let phase_tx = Arc::new(phase_tx);
        let mut loops = JoinSet::new();
        for config in self.pools {
            let pool = Arc::new(Pool {
                slots: Arc::new(Semaphore::new(config.concurrency)),
                held: AtomicUsize::new(0),
                freed: Notify::new(),
                avg_run: Mutex::new(None),
                config,
            });
            loops.spawn(lease_loop(
                shared.clone(),
                pool,
                phase_tx.clone(),
                phase_rx.clone(),
                done_tx.clone(),
            ));
        }
        drop(done_tx);
        let mut error = None;
        tokio::pin!(shutdown);
        // Run until asked to stop, or until a pool fails for good.
        tokio::select! {
            _ = &mut shutdown => tracing::info!("shutting down: no more leases"),
            r = loops.join_next() => {
                if let Some(Ok(Err(e))) = r {
                    error = Some(e);
                }
            }
        }
        phase_tx.send_replace(Phase::Draining);
        let drain = async {
            let mut first = None;
            while let Some(r) = loops.join_next().await {
                if let Ok(Err(e)) = r {
                    first.get_or_insert(e);
                }
            }
            first
        };
        tokio::pin!(drain);
        let drained = tokio::select! {
            e = &mut drain => e,
            _ = tokio::time::sleep(shared.shutdown_grace) => {
                tracing::warn!(grace = ?shared.shutdown_grace, "shutdown grace over: handing back running jobs");
                phase_tx.send_replace(Phase::Aborting);
                drain.await
            }
        };
        let error = error.or(drained);
        // Every job task is done, so every sender is gone: the reporter
        // drains what is left and ends.
        if let Err(e) = reporter.await {
            tracing::error!(error = %e, "the reporter task failed");
        }
        let totals = shared.sink.totals();
        match error {
            Some(e) => Err(WorkerError::Lease(Box::new(e))),
            None => Ok(totals),
        }
    }
}

/// Resolves on SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!(error = %e, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

/// Errors after which leasing again cannot help.
fn fatal(e: &ClientError) -> bool {
    matches!(
        e.code(),
        Some(ErrorCode::Unauthorized | ErrorCode::Forbidden | ErrorCode::BadRequest)
    )
}

async fn lease_loop(
    shared: Arc<Shared>,
    pool: Arc<Pool>,
    phase_tx: Arc<watch::Sender<Phase>>,
    mut phase: watch::Receiver<Phase>,
    done: mpsc::UnboundedSender<Done>,
) -> Result<(), ClientError> {
    let mut tasks = JoinSet::new();
    let mut backoff = Duration::from_millis(100);
    let mut outcome = Ok(());
    let concurrency = pool.config.concurrency;
    let prefetch_max = pool.config.prefetch_max.unwrap_or(concurrency);
    loop {
        while let Some(r) = tasks.try_join_next() {
            log_join(r);
        }
        if *phase.borrow() != Phase::Running {
            break;
        }
        let held = pool.held.load(Ordering::Acquire);
        let bound =
            prefetch::prefetch_bound(concurrency, shared.lease, pool.avg_run(), prefetch_max);
        let want = prefetch::lease_count(concurrency, bound, held);
        let queued = held.saturating_sub(pool.running());
        if want == 0 || (queued > 0 && want < prefetch::batch_min(concurrency, bound)) {
            // Enough in hand: wait for a job to finish (or shutdown).
            tokio::select! {
                _ = pool.freed.notified() => {}
                _ = phase.changed() => {}
            }
            continue;
        }
        let req = LeaseRequest {
            worker_id: shared.worker_id.clone(),
            lanes: pool.config.lanes.clone(),
            types: Some(shared.types.clone()),
            max_jobs: want,
            lease: shared.lease,
            wait: shared.poll_wait,
        };
        // Not raced against shutdown: a lease request dropped mid-flight
        // could strand jobs the server already leased to us.
        match shared.client.lease(&req).await {
            Ok(jobs) => {
                tracing::trace!(asked = want, got = jobs.len(), held, "leased");
                backoff = Duration::from_millis(100);
                let leased_at = Instant::now();
                for job in jobs {
                    pool.held.fetch_add(1, Ordering::AcqRel);
                    tasks.spawn(run_job(
                        shared.clone(),
                        Held(pool.clone()),
                        job,
                        leased_at,
                        phase.clone(),
                        done.clone(),
                    ));
                }
            }
            Err(e) if fatal(&e) => {
                tracing::error!(error = %e, lanes = %lanes_name(&pool.config.lanes), "leasing refused; stopping the worker");
                phase_tx.send_replace(Phase::Draining);
                outcome = Err(e);
                break;
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?backoff, "leasing failed; trying again");
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = phase.changed() => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    while let Some(r) = tasks.join_next().await {
        log_join(r);
    }
    outcome
}

fn log_join(r: Result<(), tokio::task::JoinError>) {
    if let Err(e) = r {
        tracing::error!(error = %e, "a job task failed outside its handler");
    }
}

/// Sends a finished job to the reporter.
fn finish(
    done: &mpsc::UnboundedSender<Done>,
    meta: Arc<Meta>,
    token: LeaseToken,
    elapsed: Duration,
    settle: Settle,
) {
    if let Err(e) = done.send(Done {
        meta,
        token,
        elapsed,
        settle,
    }) {
        tracing::error!(job = %e.0.meta.id, "the reporter is gone; the lease will expire");
    }
}

async fn run_job(
    shared: Arc<Shared>,
    held: Held,
    job: LeasedJob,
    leased_at: Instant,
    mut phase: watch::Receiver<Phase>,
    done: mpsc::UnboundedSender<Done>,
) {
    let pool = held.0.clone();
    let meta = Arc::new(Meta::of(&job));
    let token = job.lease_token;
    let hand_back = |message: &str, started: bool| Settle::HandBack {
        failure: hand_back_failure(shared.handback_delay, message),
        started,
    };
    // Wait for a slot, unless shutdown comes first.
    let permit = tokio::select! {
        p = pool.slots.clone().acquire_owned() => p.ok(),
        _ = phase.wait_for(|p| *p != Phase::Running) => None,
    };
    let Some(permit) = permit.filter(|_| *phase.borrow() == Phase::Running) else {
        let settle = hand_back(
            "the worker is shutting down; handed back before it started",
            false,
        );
        finish(&done, meta, token, Duration::ZERO, settle);
        return;
    };
    // A job that waited long for its slot: make sure the lease is still ours.
    let beat_every = shared.lease / 3;
    if shared.heartbeats {
        if leased_at.elapsed() >= beat_every && !beat(&shared, &meta, &token).await {
            shared
                .sink
                .record(&meta, Duration::ZERO, JobResult::LeaseLost);
            return;
        }
    } else if leased_at.elapsed() >= shared.lease {
        shared
            .sink
            .record(&meta, Duration::ZERO, JobResult::LeaseLost);
        return;
    }
    let Some(handler) = shared.handlers.get(&meta.job_type).cloned() else {
        // Only registered types are leased; this is a server that ignored `types`.
        let f = no_handler_failure(&shared.worker_id, &meta.job_type);
        finish(&done, meta, token, Duration::ZERO, Settle::Fail(f));
        return;
    };
    let started = Instant::now();
    let mut lost = false;
    let result = {
        let run = panics::run_caught(handler(meta.clone(), job.payload));
        tokio::pin!(run);
        let first_beat = started.max(leased_at + beat_every);
        let heartbeat = heartbeat_loop(&shared, &meta, &token, first_beat);
        tokio::pin!(heartbeat);
        loop {
            // Biased, handler first: a quick handler finishes in its first
            // poll and the heartbeat's timer is never even registered.
            tokio::select! {
                biased;
                r = &mut run => break Some(r),
                _ = phase.wait_for(|p| *p == Phase::Aborting) => break None,
                _ = &mut heartbeat, if shared.heartbeats && !lost => lost = true,
            }
        }
    };
    let elapsed = started.elapsed();
    drop(permit);
    pool.observe_run(elapsed);
    drop(held);
    match result {
        _ if lost => shared.sink.record(&meta, elapsed, JobResult::LeaseLost),
        None => {
            let settle = hand_back("the worker shut down before the handler finished", true);
            finish(&done, meta, token, elapsed, settle);
        }
        Some(Ok(())) => finish(&done, meta, token, elapsed, Settle::Ack),
        Some(Err(f)) => finish(&done, meta, token, elapsed, Settle::Fail(f.capped())),
    }
}

/// One heartbeat; `false` when the lease is no longer ours.
async fn beat(shared: &Shared, meta: &Meta, token: &LeaseToken) -> bool {
    match shared.client.heartbeat(meta.id, token, shared.lease).await {
        Ok(until) => {
            meta.set_lease_expires_at(until);
            true
        }
        Err(e) if e.is_lease_lost() || e.is_not_found() => {
            tracing::warn!(job = %meta.id, error = %e, "heartbeat: lease lost");
            false
        }
        Err(e) => {
            // Keep going: the next beat may get through before the lease ends.
            tracing::warn!(job = %meta.id, error = %e, "heartbeat failed");
            true
        }
    }
}

/// Heartbeats every lease/3 from `first`; returns only when the lease is lost.
async fn heartbeat_loop(shared: &Shared, meta: &Meta, token: &LeaseToken, first: Instant) {
    let every = shared.lease / 3;
    let mut next = first;
    loop {
        tokio::time::sleep_until(next).await;
        let sent = Instant::now();
        if !beat(shared, meta, token).await {
            return;
        }
        next = sent + every;
    }
}
