//! Reporting outcomes to the server: acks and fails batched when many
//! finish together, `LEASE_LOST` dropped (never retried), and a report per
//! job for whoever watches.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use lazaret_core::{JobId, JobType, Lane, TenantId};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::client::Client;
use crate::error::{ClientError, ErrorCode, ItemError};
use crate::failure::Failure;
use crate::model::{AckItem, FailItem, LeaseToken, Outcome};

use super::job::Meta;

/// Items in one `/v1/acks` or `/v1/fails` request at most.
const BATCH_MAX: usize = 500;
/// Report requests in flight at once; more finishing jobs wait and batch up.
const FLUSHES_MAX: usize = 4;
/// Outcomes waiting before a report goes out beside one in flight.
const PARALLEL_MIN: usize = 64;
/// Tries of a report whose request failed in transport or with a 5xx.
const TRIES_MAX: u32 = 3;

/// What happened to one job, as the runtime saw it.
#[derive(Clone, Debug)]
pub struct JobReport {
    /// The job.
    pub id: JobId,
    /// Its type.
    pub job_type: JobType,
    /// Its tenant.
    pub tenant: TenantId,
    /// Its lane.
    pub lane: Lane,
    /// The delivery's attempt number.
    pub attempt: u32,
    /// How long the handler ran (zero when it never started).
    pub elapsed: Duration,
    /// How it ended.
    pub result: JobResult,
}

/// How a job ended for this worker.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum JobResult {
    /// The handler succeeded and the ack was accepted.
    Succeeded,
    /// The handler failed; `outcome` is the server's decision (retry,
    /// defer or dead-letter).
    Failed {
        /// What the handler (or the runtime: parse, panic) reported.
        failure: Failure,
        /// What the server made of it.
        outcome: Outcome,
    },
    /// Shutdown handed the job back as deferred, uncharged: it was
    /// prefetched and never started, or still running at the deadline.
    HandedBack {
        /// Whether the handler had started.
        started: bool,
        /// What the server made of it.
        outcome: Outcome,
    },
    /// The lease was no longer ours (it expired, or the job was leased
    /// again): the outcome was dropped, never retried.
    LeaseLost,
    /// The outcome could not be delivered (server unreachable, or an error
    /// other than `LEASE_LOST`): the lease will expire and the job retried.
    NotReported {
        /// Why.
        error: String,
    },
}

/// Totals of a worker's run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunReport {
    /// Jobs acked.
    pub succeeded: u64,
    /// Jobs failed (panics and parse failures included).
    pub failed: u64,
    /// Of those, handlers that panicked.
    pub panicked: u64,
    /// Of those, payloads that did not deserialise.
    pub parse_failed: u64,
    /// Jobs handed back at shutdown.
    pub handed_back: u64,
    /// Outcomes dropped on `LEASE_LOST`.
    pub lease_lost: u64,
    /// Outcomes that could not be delivered.
    pub not_reported: u64,
}

/// The hook called with every [`JobReport`].
pub(crate) type Hook = Arc<dyn Fn(&JobReport) + Send + Sync>;

/// Counters and the hook.
#[derive(Default)]
pub(crate) struct Sink {
    succeeded: AtomicU64,
    failed: AtomicU64,
    panicked: AtomicU64,
    parse_failed: AtomicU64,
    handed_back: AtomicU64,
    lease_lost: AtomicU64,
    not_reported: AtomicU64,
    pub(crate) hook: Option<Hook>,
}

impl Sink {
    pub(crate) fn new(hook: Option<Hook>) -> Self {
        Sink {
            hook,
            ..Sink::default()
        }
    }

    pub(crate) fn record(&self, meta: &Meta, elapsed: Duration, result: JobResult) {
        let bump = |c: &AtomicU64| c.fetch_add(1, Ordering::Relaxed);
        match &result {
            JobResult::Succeeded => {
                bump(&self.succeeded);
                tracing::debug!(job = %meta.id, "acked");
            }
            JobResult::Failed { failure, outcome } => {
                bump(&self.failed);
                match failure.kind.as_str() {
                    "panic" => bump(&self.panicked),
                    "parse" => bump(&self.parse_failed),
                    _ => 0,
                };
                tracing::info!(job = %meta.id, r#type = %meta.job_type, attempt = meta.attempt,
                    failure = %failure, outcome = ?outcome, "job failed");
            }
            JobResult::HandedBack { started, .. } => {
                bump(&self.handed_back);
                tracing::info!(job = %meta.id, started, "handed back at shutdown");
            }
            JobResult::LeaseLost => {
                bump(&self.lease_lost);
                tracing::warn!(job = %meta.id, "lease lost: the job is someone else's now; outcome dropped");
            }
            JobResult::NotReported { error } => {
                bump(&self.not_reported);
                tracing::error!(job = %meta.id, %error, "could not report the outcome; the lease will expire");
            }
        }
        if let Some(hook) = &self.hook {
            hook(&JobReport {
                id: meta.id,
                job_type: meta.job_type.clone(),
                tenant: meta.tenant.clone(),
                lane: meta.lane.clone(),
                attempt: meta.attempt,
                elapsed,
                result,
            });
        }
    }

    pub(crate) fn totals(&self) -> RunReport {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        RunReport {
            succeeded: get(&self.succeeded),
            failed: get(&self.failed),
            panicked: get(&self.panicked),
            parse_failed: get(&self.parse_failed),
            handed_back: get(&self.handed_back),
            lease_lost: get(&self.lease_lost),
            not_reported: get(&self.not_reported),
        }
    }
}

/// What a finished job asks the server to record.
#[derive(Debug)]
pub(crate) enum Settle {
    /// Ack.
    Ack,
    /// Fail with the handler's failure.
    Fail(Failure),
    /// Hand back as deferred (shutdown).
    HandBack { failure: Failure, started: bool },
}

/// A finished job waiting to be reported.
#[derive(Debug)]
pub(crate) struct Done {
    pub(crate) meta: Arc<Meta>,
    pub(crate) token: LeaseToken,
    pub(crate) elapsed: Duration,
    pub(crate) settle: Settle,
}

/// Reports everything sent on `rx` until every sender is gone.
///
/// A lone outcome goes out at once. While a report is in flight, outcomes
/// accumulate and go out together; a second request in parallel is only
/// worth it once a batch of `PARALLEL_MIN` is waiting. So an idle worker
/// acks with no added latency and a busy one acks in batches that grow
/// with the load.
pub(crate) async fn report_loop(
    client: Client,
    mut rx: mpsc::UnboundedReceiver<Done>,
    sink: Arc<Sink>,
) {
    let mut inflight = JoinSet::new();
    let mut pending: Vec<Done> = Vec::new();
    let mut closed = false;
    loop {
        tokio::select! {
            biased;
            Some(_) = inflight.join_next(), if !inflight.is_empty() => {}
            d = rx.recv(), if !closed => match d {
                Some(d) => pending.push(d),
                None => closed = true,
            },
        }
        while let Ok(d) = rx.try_recv() {
            pending.push(d);
        }
        while !pending.is_empty()
            && (inflight.is_empty()
                || (pending.len() >= PARALLEL_MIN && inflight.len() < FLUSHES_MAX))
        {
            let rest = pending.split_off(pending.len().min(BATCH_MAX));
            let batch = std::mem::replace(&mut pending, rest);
            inflight.spawn(flush(client.clone(), batch, sink.clone()));
        }
        if closed && inflight.is_empty() && pending.is_empty() {
            break;
        }
    }
}

async fn with_tries<T, F, Fut>(mut call: F) -> Result<T, ClientError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let mut wait = Duration::from_millis(100);
    let mut tries = 1;
    loop {
        match call().await {
            Err(e) if e.is_retryable() && tries < TRIES_MAX => {
                tracing::warn!(error = %e, "reporting outcomes failed; trying again");
                tokio::time::sleep(wait).await;
                wait *= 4;
                tries += 1;
            }
            other => return other,
        }
    }
}

async fn flush(client: Client, batch: Vec<Done>, sink: Arc<Sink>) {
    let (acks, fails): (Vec<Done>, Vec<Done>) = batch
        .into_iter()
        .partition(|d| matches!(d.settle, Settle::Ack));
    let ack_items: Vec<AckItem> = acks
        .iter()
        .map(|d| AckItem {
            id: d.meta.id,
            lease_token: d.token.clone(),
        })
        .collect();
    let fail_items: Vec<FailItem> = fails
        .iter()
        .filter_map(|d| match &d.settle {
            Settle::Fail(f) | Settle::HandBack { failure: f, .. } => Some(FailItem {
                id: d.meta.id,
                lease_token: d.token.clone(),
                error: f.clone(),
            }),
            Settle::Ack => None,
        })
        .collect();
    tracing::trace!(
        acks = ack_items.len(),
        fails = fail_items.len(),
        "reporting"
    );
    let (ack_results, fail_results) = tokio::join!(
        async {
            if ack_items.is_empty() {
                Ok(Vec::new())
            } else {
                with_tries(|| client.acks(&ack_items)).await
            }
        },
        async {
            if fail_items.is_empty() {
                Ok(Vec::new())
            } else {
                with_tries(|| client.fails(&fail_items)).await
            }
        }
    );
    settle(&sink, acks, ack_results);
    settle(&sink, fails, fail_results);
}

fn settle(
    sink: &Sink,
    done: Vec<Done>,
    results: Result<Vec<Result<Outcome, ItemError>>, ClientError>,
) {
    let results = match results {
        Ok(r) if r.len() == done.len() => r,
        Ok(r) => {
            let error = format!(
                "the server answered {} results for {} items",
                r.len(),
                done.len()
            );
            for d in done {
                sink.record(
                    &d.meta,
                    d.elapsed,
                    JobResult::NotReported {
                        error: error.clone(),
                    },
                );
            }
            return;
        }
        Err(e) => {
            let error = e.to_string();
            for d in done {
                sink.record(
                    &d.meta,
                    d.elapsed,
                    JobResult::NotReported {
                        error: error.clone(),
                    },
                );
            }
            return;
        }
    };
    for (d, r) in done.into_iter().zip(results) {
        let result = match (r, d.settle) {
            (Ok(_), Settle::Ack) => JobResult::Succeeded,
            (Ok(outcome), Settle::Fail(failure)) => JobResult::Failed { failure, outcome },
            (Ok(outcome), Settle::HandBack { started, .. }) => {
                JobResult::HandedBack { started, outcome }
            }
            (Err(e), _) if e.code == ErrorCode::LeaseLost => JobResult::LeaseLost,
            (Err(e), _) => JobResult::NotReported {
                error: e.to_string(),
            },
        };
        sink.record(&d.meta, d.elapsed, result);
    }
}
