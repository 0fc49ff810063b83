//! Alerts at run time: `[[alerts]]` webhooks fed from what the server observes.
//!
//! The decisions (which event fires, dedup, cooldown, systemic) are
//! `lazaret_core::alerts`; this module only moves bytes and time:
//!
//! - the job path records each breaker change in
//!   [`AlertHub::record_breaker_change`] (a push under a mutex, nothing at
//!   all with no targets) and marks a dead letter written with
//!   [`AlertHub::touch`]; breakers opened or closed on other nodes of a
//!   cluster reach this node's breakers as switches and are recorded the
//!   same way;
//! - the dead letters counted (`poison_rate`, `reason_surge`, top reasons)
//!   are read from the store, every node's alike: each poll reads those
//!   above the last id read ([`Store::dead_letters_after`], an index range
//!   on a reader), and reads the last [`SETTLE`] again, since on a store
//!   several nodes write a dead letter may become visible after one with a
//!   higher id;
//! - one poller task ([`start`]) lets each target's `Alerts` decide every
//!   [`POLL`] on every node, so each node's dedup and cooldowns are those
//!   of the cluster and a node that takes over sends neither again nor
//!   late; only the node that leads the [`Duty::Alerts`] of the cluster
//!   ([`Store::lead`]: one at a time; SQLite: always) puts the alerts on
//!   the targets' bounded queues with
//!   `try_send` (a full queue drops the alert, logged and counted as
//!   failed: the poller never waits). The dead letters held come from the
//!   store's `reasons` (a `GROUP BY` on a reader connection, never the
//!   writer's: about 8 ms of CPU for 100,000 dead letters), read only when
//!   they may have changed (a dead letter recorded, a redrive or purge) or
//!   every [`REFRESH`], and never more often than a hundred times the last
//!   read took, so the read costs at most about 1 % of a core however large
//!   the quarantine;
//! - one sender task per target POSTs them, in order, retrying a failed
//!   delivery with backoff ([`DELIVERY_ATTEMPTS_MAX`] tries); a delivery
//!   that fails every try is logged and counted in
//!   `lazaret_alerts_failed_total`. A dead receiver therefore slows only its
//!   own queue, never an enqueue, a lease or an outcome.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use lazaret_core::alerts::TOP_REASONS_MAX;
use lazaret_core::{
    Alert, Alerts, BreakerTransition, DeadLetterReason, ErrorKind, FailureStats, JobType,
    Observation, RecentDeadLetters, StatsConfig,
};
use lazaret_store::{DeadLetterFilter, DeadLetterId, Duty, Store, StoreError};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::app::{App, now};
use crate::config::AlertTarget;
use crate::{metrics as m, views};

/// How often the conditions are checked (one store stats read each time).
pub const POLL: Duration = Duration::from_secs(1);

/// Alerts waiting for delivery per target; past it new ones are dropped.
pub const QUEUE_MAX: usize = 256;

/// Tries per alert delivery, the first included.
pub const DELIVERY_ATTEMPTS_MAX: u32 = 4;

/// The wait before the second try; it doubles before each next one.
pub const RETRY_BASE: Duration = Duration::from_millis(250);

/// The longest one try may take.
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest the dead letters held go unread from the store.
pub const REFRESH: Duration = Duration::from_secs(30);

/// A store read of the dead letters held waits at least this many times as
/// long as the last one took (the share of a core it may use: 1 %).
const READ_SPACING: u32 = 100;

/// Breaker changes kept between two polls.
const CHANGES_MAX: usize = 1024;

/// How long after it was written a dead letter is read again (each poll)
/// in case one with a lower id commits later on another node: longer than
/// any transaction of the store takes.
pub const SETTLE: Duration = Duration::from_secs(10);

/// Dead letters read from the store per poll at most (the rest next poll).
const READ_MAX: u32 = 1000;

/// Where the reading of the store's dead letters is.
#[derive(Debug, Default)]
struct Feed {
    /// Every dead letter at or below this id is counted or was there
    /// before the start; `None` until the first read.
    floor: Option<DeadLetterId>,
    /// Dead letters above `floor` counted already.
    seen: std::collections::BTreeSet<DeadLetterId>,
}

/// The dead letters held, as last read from the store.
#[derive(Debug, Default)]
struct Held {
    counts: Vec<(Option<JobType>, DeadLetterReason, u64)>,
    read_at: Option<Instant>,
    took: Duration,
}

/// One `[[alerts]]` target at run time.
#[derive(Debug)]
struct Target {
    url: String,
    alerts: Mutex<Alerts>,
    tx: mpsc::Sender<Value>,
    rx: Mutex<Option<mpsc::Receiver<Value>>>,
}

/// What the alert tasks share with the job path.
#[derive(Debug)]
pub struct AlertHub {
    /// The cluster's recent dead letters, as read from the store.
    recent: Mutex<RecentDeadLetters>,
    /// Their fingerprints and surges: the cluster's, for the alerts and
    /// `/v1/stats` alike.
    failures: Mutex<FailureStats>,
    feed: Mutex<Feed>,
    /// Whether this node sent the last poll's alerts (it leads).
    leading: AtomicBool,
    /// The dead letters held may have changed since the last store read.
    dirty: AtomicBool,
    held: Mutex<Held>,
    changes: Mutex<VecDeque<BreakerTransition>>,
    targets: Vec<Target>,
}

impl AlertHub {
    /// The targets of `[[alerts]]`, nothing sent yet; `stats` is the
    /// surge rule's configuration (as `/v1/stats` has it).
    pub fn new(targets: &[AlertTarget], stats: StatsConfig) -> Self {
        AlertHub {
            recent: Mutex::new(RecentDeadLetters::default()),
            failures: Mutex::new(FailureStats::new(stats).unwrap_or_default()),
            feed: Mutex::new(Feed::default()),
            leading: AtomicBool::new(false),
            dirty: AtomicBool::new(true),
            held: Mutex::new(Held::default()),
            changes: Mutex::new(VecDeque::new()),
            targets: targets
                .iter()
                .map(|t| {
                    let (tx, rx) = mpsc::channel(QUEUE_MAX);
                    Target {
                        url: t.url.clone(),
                        alerts: Mutex::new(Alerts::new(t.rule.clone())),
                        tx,
                        rx: Mutex::new(Some(rx)),
                    }
                })
                .collect(),
        }
    }

    /// Whether any target is configured.
    pub fn enabled(&self) -> bool {
        !self.targets.is_empty()
    }

    /// The cluster's failure statistics and recent dead letters, as last
    /// read from the store ([`catch_up`] reads what is new), locked in
    /// that order while the guards live: `/v1/stats` reports them.
    pub fn cluster_view(
        &self,
    ) -> (
        std::sync::MutexGuard<'_, FailureStats>,
        std::sync::MutexGuard<'_, RecentDeadLetters>,
    ) {
        let failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let recent = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        (failures, recent)
    }

    /// The dead letters held may have changed (one written, a redrive or
    /// a purge): the next check reads them again.
    pub fn touch(&self) {
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// Whether the next check should read the dead letters held from the store.
    fn read_due(&self, at: Instant) -> bool {
        let held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        let Some(last) = held.read_at else {
            return true;
        };
        let since = at.saturating_duration_since(last);
        let spacing = (held.took * READ_SPACING).max(POLL);
        since >= REFRESH || (self.dirty.load(Ordering::Relaxed) && since >= spacing)
    }

    /// One breaker change, as the breakers report it.
    pub fn record_breaker_change(&self, t: &BreakerTransition) {
        if !self.enabled() {
            return;
        }
        let mut c = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        if c.len() >= CHANGES_MAX {
            c.pop_front();
        }
        c.push_back(t.clone());
    }
}

impl AlertHub {
    /// Drops the breaker changes recorded so far (those a node finds in
    /// force when it starts are not news).
    pub fn forget_breaker_changes(&self) {
        self.changes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }
}

/// The alert body of the contract.
pub fn body(a: &Alert) -> Value {
    json!({
        "event": a.event.as_str(),
        "at": views::time(a.at),
        "type": a.job_type.as_ref().map(JobType::as_str),
        "reason": a.reason,
        "count": a.count,
        "window_ms": lazaret_core::time::duration_ms(a.window),
        "systemic": a.systemic,
        "top_reasons": a.top_reasons.iter().take(TOP_REASONS_MAX).map(|r| json!({
            "reason": r.reason.as_str(), "kind": r.kind.as_ref().map(ErrorKind::as_str), "count": r.count,
        })).collect::<Vec<_>>(),
        "summary": a.summary,
        "link": a.link,
    })
}

/// The URL as logs show it: scheme, host and port, not the path (webhook
/// paths often carry a secret), nor its user info (masked as everywhere).
fn shown(url: &str) -> String {
    let url = lazaret_core::mask_url(url);
    let rest = url.strip_prefix("http://").unwrap_or(&url);
    let host = rest.split('/').next().unwrap_or("");
    format!("http://{host}/…")
}

/// Starts the poller and one sender per target; they end when the server
/// stops. Nothing starts without `[[alerts]]`.
pub fn start<S: Store>(app: &Arc<App<S>>) -> Vec<tokio::task::JoinHandle<()>> {
    if !app.alerts.enabled() {
        return Vec::new();
    }
    let mut tasks = Vec::new();
    let client = reqwest::Client::builder()
        .timeout(DELIVERY_TIMEOUT)
        .connect_timeout(DELIVERY_TIMEOUT)
        .build()
        .unwrap_or_default();
    for (i, t) in app.alerts.targets.iter().enumerate() {
        let rx = t.rx.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(rx) = rx {
            let app = Arc::clone(app);
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                tokio::select! {
                    () = send_loop(&app, i, rx, &client) => {},
                    () = app.stopping() => {},
                }
            }));
        }
    }
    let app = Arc::clone(app);
    tasks.push(tokio::spawn(async move {
        tokio::select! {
            () = poll_loop(&app) => {},
            () = app.stopping() => {},
        }
    }));
    tasks
}

/// Checks every [`POLL`], after the baseline `serve` took with [`poll_once`].
async fn poll_loop<S: Store>(app: &App<S>) {
    loop {
        tokio::time::sleep(POLL).await;
        poll_once(app).await;
    }
}

/// One check (the first, before the server listens, is the baseline: dead
/// letters held at start do not page): the store's dead-letter counts, the breakers' changes, and
/// each target's decisions, queued without waiting.
pub async fn poll_once<S: Store>(app: &App<S>) {
    let hub = &app.alerts;
    let started = Instant::now();
    if hub.read_due(started) {
        // Cleared first: a dead letter recorded during the read asks for another.
        hub.dirty.store(false, Ordering::Relaxed);
        match app.store.reasons().await {
            Ok(reasons) => {
                let mut held = hub.held.lock().unwrap_or_else(|p| p.into_inner());
                held.counts = reasons
                    .iter()
                    .map(|r| (r.job_type.as_deref().map(JobType::new), r.reason, r.count))
                    .collect();
                held.read_at = Some(started);
                held.took = started.elapsed();
            }
            Err(e) => {
                hub.dirty.store(true, Ordering::Relaxed);
                tracing::warn!(error = %e, "alerts: cannot read the dead-letter counts; checking again shortly");
                return;
            }
        }
    }
    if let Err(e) = read_dead_letters(app).await {
        tracing::warn!(error = %e, "alerts: cannot read the recent dead letters; checking again shortly");
        return;
    }
    let now = now();
    {
        // Clock-driven changes (open → half-open) are noticed here too.
        let mut b = app.breakers.lock().unwrap_or_else(|p| p.into_inner());
        b.snapshot(now);
        if app.drain_breaker_changes(&mut b, true) {
            app.ready.anything();
        }
    }
    let held = hub
        .held
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .counts
        .clone();
    let changes: Vec<BreakerTransition> = app
        .alerts
        .changes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .drain(..)
        .collect();
    let decided: Vec<(usize, Vec<Alert>)> = {
        let failures = hub.failures.lock().unwrap_or_else(|p| p.into_inner());
        let recent = hub.recent.lock().unwrap_or_else(|p| p.into_inner());
        let obs = Observation {
            held: &held,
            warn_at: app.config.dead_letters_warn,
            recent: &recent,
            failures: &failures,
            breaker_changes: &changes,
        };
        app.alerts
            .targets
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut a = t.alerts.lock().unwrap_or_else(|p| p.into_inner());
                (i, a.poll(now, &obs))
            })
            .collect()
    };
    // Every node decides (so its dedup and cooldowns stay the cluster's);
    // the leader alone sends.
    let leading = match app.store.lead(Duty::Alerts).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "alerts: cannot tell whether this node leads the cluster's alerts; sending none this time");
            false
        }
    };
    if hub.leading.swap(leading, Ordering::Relaxed) != leading {
        tracing::info!(
            leading,
            "alerts: this node {} the cluster's alerts",
            if leading {
                "now sends"
            } else {
                "no longer sends"
            }
        );
    }
    if !leading {
        return;
    }
    for (i, alerts) in decided {
        let target = &app.alerts.targets[i];
        for a in alerts {
            let event = a.event.as_str();
            if target.tx.try_send(body(&a)).is_err() {
                m::alert_failed(event);
                tracing::warn!(
                    target = %shown(&target.url), event, queue_max = QUEUE_MAX,
                    "alert dropped: the target's queue is full (it is down or slow)"
                );
            }
        }
    }
}

/// Counts the dead letters written since the last read, on every node:
/// those above the floor not counted yet. The floor moves past a dead
/// letter once it is [`SETTLE`] old (every lower id has committed by then);
/// the first read only finds where the store is (dead letters from before
/// the start are not recent).
/// Reads the dead letters written on any node since the last read into the
/// cluster's failure statistics, with or without alert targets: the poller
/// does each [`POLL`], `serve` once before it listens (the baseline: dead
/// letters from before the start are not recent) and `GET /v1/stats` before
/// it reports them, so its `rate_per_min`, `top_failures` and surges are
/// the cluster's and never a poll behind.
pub async fn catch_up<S: Store>(app: &App<S>) -> Result<(), StoreError> {
    // A burst larger than one read takes a few (bounded: a flood of dead
    // letters is reported a call or two later rather than stalling one).
    for _ in 0..CATCH_UP_READS_MAX {
        if read_dead_letters(app).await? < READ_MAX as usize {
            break;
        }
    }
    Ok(())
}

/// Reads of [`READ_MAX`] dead letters one [`catch_up`] may make.
const CATCH_UP_READS_MAX: usize = 10;

/// Reads what is new; how many rows the read returned.
async fn read_dead_letters<S: Store>(app: &App<S>) -> Result<usize, StoreError> {
    let hub = &app.alerts;
    let floor = hub.feed.lock().unwrap_or_else(|p| p.into_inner()).floor;
    let Some(floor) = floor else {
        let (newest, _) = app
            .store
            .dead_letters(DeadLetterFilter::default(), 1, None)
            .await?;
        hub.feed.lock().unwrap_or_else(|p| p.into_inner()).floor =
            Some(newest.first().map_or(DeadLetterId(0), |d| d.id));
        return Ok(0);
    };
    let rows = app.store.dead_letters_after(floor, READ_MAX).await?;
    let read = rows.len();
    if rows.is_empty() {
        return Ok(0);
    }
    let now = now();
    let settled_before = now.saturating_sub(SETTLE);
    let mut feed = hub.feed.lock().unwrap_or_else(|p| p.into_inner());
    // Always `failures` before `recent` (as `poll_once` and
    // `AlertHub::cluster_view` take them): `/v1/stats` runs this while the
    // poller may decide.
    let mut failures = hub.failures.lock().unwrap_or_else(|p| p.into_inner());
    let mut recent = hub.recent.lock().unwrap_or_else(|p| p.into_inner());
    let mut settled = true;
    let mut new = false;
    for d in rows {
        if feed.seen.insert(d.id) {
            new = true;
            // Never ahead of this node's clock (the store's may be).
            let at = d.at.min(now);
            let ty = JobType::new(d.job_type.as_deref().unwrap_or(""));
            let kind = d.kind.as_deref().map(ErrorKind::new);
            recent.record(Some(&ty), d.reason, kind.as_ref(), at);
            failures.record_dead_letter(&ty, d.reason, kind.as_ref(), &d.message, at);
        }
        settled &= d.at < settled_before;
        if settled {
            feed.floor = Some(d.id);
        }
    }
    if let Some(floor) = feed.floor {
        feed.seen = feed.seen.split_off(&DeadLetterId(floor.0 + 1));
    }
    if new {
        // The held counts changed too.
        hub.touch();
    }
    Ok(read)
}

/// Delivers one target's alerts in order, each with its retries.
async fn send_loop<S: Store>(
    app: &App<S>,
    i: usize,
    mut rx: mpsc::Receiver<Value>,
    client: &reqwest::Client,
) {
    let url = app.alerts.targets[i].url.clone();
    while let Some(body) = rx.recv().await {
        let event = body["event"].as_str().unwrap_or("").to_owned();
        let mut wait = RETRY_BASE;
        let mut last_error = String::new();
        let mut sent = false;
        for attempt in 1..=DELIVERY_ATTEMPTS_MAX {
            match client.post(&url).json(&body).send().await {
                Ok(r) if r.status().is_success() => {
                    sent = true;
                    break;
                }
                Ok(r) => last_error = format!("answered {}", r.status()),
                Err(e) => last_error = e.without_url().to_string(),
            }
            if attempt < DELIVERY_ATTEMPTS_MAX {
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
        }
        if sent {
            m::alert_sent(&event);
        } else {
            m::alert_failed(&event);
            tracing::warn!(
                target = %shown(&url), event, attempts = DELIVERY_ATTEMPTS_MAX, error = %last_error,
                "alert not delivered: the target failed every try"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_show_the_target_without_its_path() {
        assert_eq!(
            shown("http://hooks.internal:9099/T0/secret"),
            "http://hooks.internal:9099/…"
        );
        assert_eq!(
            shown("http://hook:s3cret@hooks.internal:9099/T0"),
            "http://***@hooks.internal:9099/…"
        );
    }
}
