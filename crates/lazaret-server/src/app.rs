//! The server's shared state: the store, the configuration and the live
//! policy state the core keeps (breakers, failure statistics).

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lazaret_core::{
    BreakerState, Breakers, DeadLetterReason, ErrorKind, Gate, JobId, JobType, Lane, LeaseGate,
    LeaseReservation, Paused, Timestamp, Transition,
};
use lazaret_guard::SourceSet;
use lazaret_store::{Completed, DeadLetterId, LeasedJob, PauseTarget, Store, Switch};

use crate::alerts::AlertHub;
use crate::auth::ApiTokens;
use crate::config::ServerConfig;
use crate::metrics as m;
use crate::ready::Ready;

/// The wall clock, the one place the server reads it.
pub fn now() -> Timestamp {
    let ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    Timestamp::from_millis(ms)
}

/// The failure statistics' configuration (the alerts' and `/v1/stats`'s,
/// which are one: `AlertHub`'s, read from the store).
fn stats_config(config: &ServerConfig) -> lazaret_core::StatsConfig {
    lazaret_core::StatsConfig {
        surge_count_min: config.surge_min,
        surge_share_min: config.surge_share,
        ..lazaret_core::StatsConfig::default()
    }
}

/// Everything a handler needs.
#[derive(Debug)]
pub struct App<S> {
    /// The store.
    pub store: S,
    /// The configuration.
    pub config: ServerConfig,
    /// Breakers per (type, kind).
    pub breakers: Mutex<Breakers>,
    /// `[[alerts]]`: the recent dead letters and breaker changes the alert
    /// tasks decide from, and their targets.
    pub alerts: AlertHub,
    /// Paused types and lanes.
    pub paused: Mutex<Paused>,
    /// Woken when a job may have become ready (long-polls wait on it).
    pub ready: Ready,
    /// Admission records kept per tenant in the current minute, and (under
    /// `None`) over all tenants.
    admission_records: Mutex<HashMap<Option<String>, (i64, u32)>>,
    /// Tokens created through the API that are in force: loaded at start,
    /// changed with the store, read by every authentication.
    pub api_tokens: RwLock<ApiTokens>,
    /// Held across a token change (store, then [`App::api_tokens`]), so that
    /// concurrent changes cannot leave the two disagreeing.
    pub token_changes: tokio::sync::Mutex<()>,
    /// The `[[sources]]` connected to their brokers so far (a source joins
    /// once its broker answers): where redrives of broker dead letters go.
    pub sources: RwLock<SourceSet>,
    /// Whether the store takes writes, as the sources saw it last
    /// (`/healthz` and `lazaret_store_writable` report it).
    pub store_writes: lazaret_guard::StoreWrites,
    /// Broker dead letters being republished now (see [`App::claim_redrive`]).
    redriving: Mutex<HashSet<DeadLetterId>>,
    /// `true` once the server is shutting down (see [`App::stopping`]).
    stop: tokio::sync::watch::Sender<bool>,
    /// The runtime that large requests do their CPU-heavy part on (see
    /// [`App::run_bulk`]); unset, they do it in place.
    bulk: std::sync::OnceLock<tokio::runtime::Handle>,
    /// Breakers this node opened or closed, to share with the cluster
    /// (`serve::cluster` publishes them through the store).
    opened: tokio::sync::mpsc::UnboundedSender<Switch>,
    opened_rx: Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Switch>>>,
    /// The address the server listens on, once bound (the real port when
    /// `--listen` asked for port 0): a `Host` naming it is this server.
    listen: std::sync::OnceLock<std::net::SocketAddr>,
}

/// A broker dead letter claimed for one redrive; released when dropped.
#[derive(Debug)]
pub struct RedriveClaim<'a> {
    set: &'a Mutex<HashSet<DeadLetterId>>,
    id: DeadLetterId,
}

impl Drop for RedriveClaim<'_> {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

impl<S: Store> App<S> {
    /// Wraps a store and a configuration.
    pub fn new(store: S, config: ServerConfig) -> Arc<Self> {
        let breakers = Breakers::new(config.breaker_default, config.breakers.clone());
        let (opened, opened_rx) = tokio::sync::mpsc::unbounded_channel();
        Arc::new(App {
            opened,
            opened_rx: Mutex::new(Some(opened_rx)),
            store,
            breakers: Mutex::new(breakers),
            alerts: AlertHub::new(&config.alerts, stats_config(&config)),
            paused: Mutex::new(Paused::default()),
            ready: Ready::default(),
            admission_records: Mutex::new(HashMap::new()),
            api_tokens: RwLock::new(ApiTokens::default()),
            token_changes: tokio::sync::Mutex::new(()),
            sources: RwLock::new(SourceSet::default()),
            store_writes: lazaret_guard::StoreWrites::default(),
            redriving: Mutex::new(HashSet::new()),
            stop: tokio::sync::watch::Sender::new(false),
            bulk: std::sync::OnceLock::new(),
            listen: std::sync::OnceLock::new(),
            config,
        })
    }

    /// Where [`App::run_bulk`] runs its work from now on (`serve` sets its
    /// low-priority runtime once).
    pub fn set_bulk(&self, runtime: tokio::runtime::Handle) {
        let _ = self.bulk.set(runtime);
    }

    /// Runs the CPU-heavy part of a large request (parsing and admitting
    /// a big batch) on the bulk runtime, so that it never holds the
    /// worker that serves small requests, and at a lower CPU priority
    /// than that worker. `None` when the bulk runtime is gone (the server
    /// is stopping). Without one it runs in place.
    pub async fn run_bulk<T, F>(&self, work: F) -> Option<T>
    where
        T: Send + 'static,
        F: std::future::Future<Output = T> + Send + 'static,
    {
        let Some(runtime) = self.bulk.get() else {
            return Some(work.await);
        };
        match runtime.spawn(work).await {
            Ok(t) => Some(t),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => None,
        }
    }

    /// Records the address the server is bound to (`serve` sets it once,
    /// before the first request).
    pub fn set_listen(&self, addr: std::net::SocketAddr) {
        let _ = self.listen.set(addr);
    }

    /// The address the server is bound to; `None` for a router served
    /// without a socket (tests).
    pub fn listen(&self) -> Option<std::net::SocketAddr> {
        self.listen.get().copied()
    }

    /// The breakers this node opens, to share (taken once, by `serve`).
    pub fn take_opened(&self) -> Option<tokio::sync::mpsc::UnboundedReceiver<Switch>> {
        self.opened_rx
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }

    /// Applies a switch another node shared (or this one, echoed back):
    /// a pause, a resume, a breaker opened elsewhere.
    pub fn apply_switch(&self, s: &Switch) {
        match s {
            Switch::PauseType { name, paused } | Switch::PauseLane { name, paused } => {
                let mut p = self.paused.lock().unwrap_or_else(|p| p.into_inner());
                let set = if matches!(s, Switch::PauseType { .. }) {
                    &mut p.types
                } else {
                    &mut p.lanes
                };
                if *paused {
                    set.insert(name.clone());
                } else if set.remove(name) {
                    drop(p);
                    self.ready.anything();
                }
            }
            Switch::BreakerOpen {
                job_type,
                kind,
                until_ms,
            } => {
                let now = now();
                let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
                // This node's own changes first, shared as usual.
                self.drain_breaker_changes(&mut b, true);
                let until = Timestamp::from_millis(*until_ms);
                let (ty, kind) = (
                    JobType::new(job_type.as_str()),
                    ErrorKind::new(kind.as_str()),
                );
                b.open_elsewhere(&ty, &kind, until, now);
                // The other node's change: its alerts, not shared back.
                self.drain_breaker_changes(&mut b, false);
            }
            Switch::BreakerClosed { job_type, kind } => {
                let now = now();
                let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
                let mut unparked = self.drain_breaker_changes(&mut b, true);
                let (ty, kind) = (
                    JobType::new(job_type.as_str()),
                    ErrorKind::new(kind.as_str()),
                );
                b.close_elsewhere(&ty, &kind, now);
                unparked |= self.drain_breaker_changes(&mut b, false);
                drop(b);
                if unparked {
                    self.ready.anything();
                }
            }
            _ => {}
        }
    }

    /// Starts the shutdown: long-polls answer at once, redrives stop
    /// before their next batch.
    pub fn begin_stop(&self) {
        self.stop.send_replace(true);
    }

    /// Ends once the shutdown has begun.
    pub async fn stopping(&self) {
        let mut rx = self.stop.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Whether the shutdown has begun.
    pub fn is_stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// The sources connected now, for a redrive (a copy: the broker
    /// handles are shared, and no lock is held across the publish).
    pub fn source_set(&self) -> SourceSet {
        self.sources
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Claims a broker dead letter for one redrive, or `None` while
    /// another redrive holds it: two requests republishing the same message
    /// at once would put it on the broker twice (the second one, once the
    /// first is done, finds the dead letter gone).
    pub fn claim_redrive(&self, id: DeadLetterId) -> Option<RedriveClaim<'_>> {
        let mut set = self.redriving.lock().unwrap_or_else(|p| p.into_inner());
        set.insert(id).then_some(RedriveClaim {
            set: &self.redriving,
            id,
        })
    }

    /// Whether auth is on: tokens are configured in `[[tokens]]`. Off, every
    /// caller is `anonymous` and admin (the server then serves loopback only).
    pub fn auth_on(&self) -> bool {
        !self.config.tokens.is_empty()
    }

    /// Whether another admission record may be kept for `tenant` now: the
    /// tenant is under `admission_records_per_minute` this minute and all
    /// tenants together under `admission_records_all_per_minute` (one batch
    /// naming 5,000 tenants must not write 5,000 records).
    pub fn admission_record_allowed(&self, tenant: Option<&str>, now: Timestamp) -> bool {
        let minute = now.as_millis() / 60_000;
        let mut map = self
            .admission_records
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if map.len() > 10_000 {
            map.retain(|_, (m, _)| *m == minute);
        }
        let used = |map: &mut HashMap<Option<String>, (i64, u32)>, key: Option<String>| {
            let entry = map.entry(key).or_insert((minute, 0));
            if entry.0 != minute {
                *entry = (minute, 0);
            }
            entry.1
        };
        let all = used(&mut map, None);
        let one = used(&mut map, Some(tenant.unwrap_or("").to_owned()));
        if all >= self.config.admission_records_all_per_minute
            || one >= self.config.admission_records_per_minute
        {
            return false;
        }
        for key in [None, Some(tenant.unwrap_or("").to_owned())] {
            if let Some(e) = map.get_mut(&key) {
                e.1 += 1;
            }
        }
        true
    }

    /// Puts a pause in force or lifts it (the store has it already).
    pub fn set_paused(&self, target: &PauseTarget, paused: bool) {
        let mut p = self.paused.lock().unwrap_or_else(|p| p.into_inner());
        let set = match target {
            PauseTarget::Type(_) => &mut p.types,
            PauseTarget::Lane(_) => &mut p.lanes,
        };
        if paused {
            set.insert(target.name().to_owned());
        } else {
            set.remove(target.name());
        }
    }

    /// Asks the gate (`lazaret_core::gate`) one question with this node's
    /// pauses, breakers and park lanes. The pauses are locked before the
    /// breakers, here and only here.
    pub fn gate<T>(&self, f: impl FnOnce(&mut Gate<'_>) -> T) -> T {
        let paused = self.paused.lock().unwrap_or_else(|p| p.into_inner());
        let mut breakers = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut Gate {
            paused: &paused,
            breakers: &mut breakers,
            park_lanes: &self.config.park_lanes,
        })
    }

    /// Why a job of `ty` in `lane` is shed now (paused, or a breaker open
    /// outside a park lane), as a wait ([`Gate::shed`]).
    pub fn shed(&self, ty: &str, lane: &str, now: Timestamp) -> Option<Duration> {
        self.gate(|g| g.shed(&JobType::new(ty), &Lane::new(lane), now))
    }

    /// Feeds applied outcomes to breakers, statistics and metrics.
    pub fn observe<'a>(&self, done: impl IntoIterator<Item = &'a Completed>, now: Timestamp) {
        let mut breakers = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        for c in done {
            if let Some(leased_at) = c.leased_at {
                m::job_ran(c.lane.as_str(), now.saturating_since(leased_at));
            }
            let expired = c
                .kind
                .as_ref()
                .is_some_and(|k| k.as_str() == ErrorKind::LEASE_EXPIRED);
            if expired {
                m::lease_expired();
            }
            breakers.observe(&c.job_type, c.transition, c.class, c.kind.as_ref(), now);
            match c.transition {
                Transition::Succeeded => m::succeeded(c.job_type.as_str()),
                Transition::Retry { .. } => m::retried(c.job_type.as_str()),
                Transition::DeadLetter { reason } => {
                    m::dead_lettered(c.job_type.as_str(), reason.as_str(), "processing");
                    self.alerts.touch();
                }
                _ => {}
            }
        }
        if self.drain_breaker_changes(&mut breakers, true) {
            self.ready.anything();
        }
    }

    /// Counts how redriven jobs ended in `lazaret_redrive_outcomes_total`,
    /// by the failure group they were last redriven from (their lineage's
    /// newest entry; `""` when it is gone). The group is read from the
    /// store off the caller's path: only redriven jobs cost a read.
    pub fn count_redrive_outcomes<'a>(
        self: &Arc<Self>,
        done: impl IntoIterator<Item = &'a Completed>,
    ) {
        let ended: Vec<(JobId, &'static str)> = done
            .into_iter()
            .filter(|c| c.redrive_count > 0)
            .filter_map(|c| match c.transition {
                Transition::Succeeded => Some((c.id, "succeeded")),
                Transition::DeadLetter { .. } => Some((c.id, "dead_lettered")),
                _ => None,
            })
            .collect();
        if ended.is_empty() {
            return;
        }
        let app = Arc::clone(self);
        tokio::spawn(async move {
            for (job, outcome) in ended {
                let group = match app.store.lineage(job).await {
                    Ok(lineage) => lineage.last().map(|e| e.from_group.clone()),
                    Err(e) => {
                        tracing::debug!(error = %e, job = job.0, "the group of a redriven job could not be read for its outcome metric");
                        None
                    }
                };
                m::redrive_outcome(outcome, group.unwrap_or_default());
            }
        });
    }

    /// Lets the clock move the breakers (open → half-open, spent probe
    /// slots refilled) and logs every change since the last call; wakes
    /// the long-polls when one may have made parked jobs leasable.
    pub fn poll_breakers(&self, now: Timestamp) {
        let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        let _ = b.snapshot(now);
        if self.drain_breaker_changes(&mut b, true) {
            self.ready.anything();
        }
    }

    /// Logs the breakers' state changes and hands them to the alerts;
    /// true when one may have made parked jobs leasable (a breaker left
    /// `open`, or its probe slots were handed out again). With `share`,
    /// openings and closings go out to the other nodes of a cluster
    /// (without it they came from one: sending them back would echo).
    pub fn drain_breaker_changes(&self, breakers: &mut Breakers, share: bool) -> bool {
        let mut unparked = false;
        while let Some(t) = breakers.poll_transition() {
            unparked |= !matches!(t.to, BreakerState::Open { .. });
            if matches!(t.to, BreakerState::HalfOpen { .. })
                && matches!(t.from, BreakerState::HalfOpen { .. })
            {
                continue; // probe slots handed out again: not news
            }
            tracing::warn!(r#type = %t.ty, kind = %t.kind, from = %t.from, to = %t.to, "breaker changed state");
            // Shared with the other nodes of a cluster (`serve::cluster`).
            match t.to {
                BreakerState::Open { until } if share => {
                    let _ = self.opened.send(Switch::BreakerOpen {
                        job_type: t.ty.as_str().to_owned(),
                        kind: t.kind.as_str().to_owned(),
                        until_ms: until.as_millis(),
                    });
                }
                BreakerState::Closed if share => {
                    let _ = self.opened.send(Switch::BreakerClosed {
                        job_type: t.ty.as_str().to_owned(),
                        kind: t.kind.as_str().to_owned(),
                    });
                }
                _ => {}
            }
            self.alerts.record_breaker_change(&t);
        }
        unparked
    }

    /// Counts an admission rejection (the statistics read its record
    /// from the store, like every dead letter).
    pub fn observe_admission(&self, ty: Option<&str>, reason: DeadLetterReason) {
        m::dead_lettered(ty.unwrap_or(""), reason.as_str(), "admission");
        self.alerts.touch();
    }

    /// Parked lanes and types, and half-open probe limits, for a lease of
    /// at most `max_jobs` jobs of `types` (`None`: any).
    ///
    /// The probe slots of half-open breakers are reserved here, before the
    /// store leases, so concurrent leases never let more than `probes`
    /// through; hand the filters back to [`App::refund_probes`] with the
    /// jobs leased.
    pub fn lease_filters(
        &self,
        types: Option<&[JobType]>,
        max_jobs: u32,
        now: Timestamp,
    ) -> LeaseGate {
        self.gate(|g| g.lease_filter(types, max_jobs, now))
    }

    /// Gives back the probe slots a lease reserved and did not use.
    pub fn refund_probes(&self, reservations: Vec<LeaseReservation>, jobs: &[LeasedJob]) {
        if reservations.is_empty() {
            return;
        }
        let mut b = self.breakers.lock().unwrap_or_else(|p| p.into_inner());
        for r in reservations {
            let used = jobs.iter().filter(|j| &j.job_type == r.job_type()).count();
            b.refund(r, u32::try_from(used).unwrap_or(u32::MAX));
        }
    }
}
