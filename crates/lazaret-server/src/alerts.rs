//! Alerts at run time: `[[alerts]]` webhooks fed from what the server observes.
//!
//! The decisions (which event fires, dedup, cooldown, systemic) are
//! `lazaret_core::alerts`; this module only moves bytes and time:
//!
//! - the job path records each dead letter in [`AlertHub::record_dead_letter`]
//!   and each breaker change in [`AlertHub::record_breaker_change`]: a
//!   push under a mutex, nothing more (breaker changes not at all with no
//!   targets; dead letters always, bounded by `RECENT_MAX`, since
//!   `/v1/stats` reads their reasons for its per-type `surges`);
//! - one poller task ([`start`]) lets each target's `Alerts` decide every
//!   [`POLL`], and puts the alerts on that target's bounded queue with
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
    Alert, Alerts, BreakerTransition, DeadLetterReason, ErrorKind, JobType, Observation,
    RecentDeadLetters, Timestamp,
};
use lazaret_store::Store;
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
    recent: Mutex<RecentDeadLetters>,
    /// The dead letters held may have changed since the last store read.
    dirty: AtomicBool,
    held: Mutex<Held>,
    changes: Mutex<VecDeque<BreakerTransition>>,
    targets: Vec<Target>,
}

impl AlertHub {
    /// The targets of `[[alerts]]`, nothing sent yet.
    pub fn new(targets: &[AlertTarget]) -> Self {
        AlertHub {
            recent: Mutex::new(RecentDeadLetters::default()),
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

    /// One dead letter, as it is written (processing, admission or broker).
    pub fn record_dead_letter(
        &self,
        ty: Option<&JobType>,
        reason: DeadLetterReason,
        kind: Option<&ErrorKind>,
        now: Timestamp,
    ) {
        // Kept with no targets too: `/v1/stats` names each surge's reason from them.
        self.recent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .record(ty, reason, kind, now);
        self.dirty.store(true, Ordering::Relaxed);
    }

    /// The recent dead letters (locked while the guard lives).
    pub fn recent(&self) -> std::sync::MutexGuard<'_, RecentDeadLetters> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The dead letters held may have changed (a redrive or purge): the
    /// next check reads them again.
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
/// paths often carry a secret).
fn shown(url: &str) -> String {
    let rest = url.strip_prefix("http://").unwrap_or(url);
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
    let now = now();
    {
        // Clock-driven changes (open → half-open) are noticed here too.
        let mut b = app.breakers.lock().unwrap_or_else(|p| p.into_inner());
        b.snapshot(now);
        if app.drain_breaker_changes(&mut b) {
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
        let failures = app.failures.lock().unwrap_or_else(|p| p.into_inner());
        let recent = app.alerts.recent.lock().unwrap_or_else(|p| p.into_inner());
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
    }
}
