//! `[[sources]]` in `lazaret serve`: the broker queues guarded or watched
//! next to lazaret's own queue, sharing its [`App`] (store, policies,
//! breakers, pauses, failure statistics, metrics).
//!
//! [`App`] is the sources' [`Host`]: a guard source's deliveries are gated
//! by the same pauses and breakers as leases of the same type, and their
//! outcomes feed the same breakers and statistics. [`Sources::start`] runs
//! one task per source: it connects (retrying in the background while the
//! broker is down, so a broker never keeps the server from starting), puts
//! the source in [`App::sources`] so that its dead letters can be redriven,
//! then runs its [`Guard`] or [`Watch`] until [`Sources::stop`].

use std::sync::Arc;
use std::time::Duration;

use lazaret_core::mask_url;
use lazaret_core::{JobType, Lane, Timestamp, Transition, TypePolicy};
use lazaret_guard::broker::reconnect_delay;
use lazaret_guard::{
    Broker, BrokerError, Faults, Guard, Host, HttpHandler, Mode, SourceSpec, TenantFrom, Watch,
};
use lazaret_store::{Completed, SourceDeadLetter, Store};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::app::App;
use crate::metrics as m;

/// Connection failures in a row between two warnings in the log (about a
/// minute apart once the reconnect delay is at its 5 s cap).
const CONNECT_WARN_EVERY: u32 = 12;

impl<S: Store> Host for App<S> {
    type Store = S;

    fn store(&self) -> &S {
        &self.store
    }

    fn policy(&self, ty: &JobType) -> TypePolicy {
        self.config.policies.for_type(ty.as_str()).clone()
    }

    fn try_deliver(&self, ty: &JobType, lane: &Lane, now: Timestamp) -> Result<(), Duration> {
        self.gate(|g| g.try_deliver(ty, lane, now))
    }

    fn held_back(&self, ty: &JobType, lane: &Lane, now: Timestamp) -> Option<Duration> {
        self.gate(|g| g.held_back(ty, lane, now))
    }

    fn observe(&self, source: &str, done: &Completed, now: Timestamp) {
        // Exactly what an ack or fail of a job does: breakers, statistics,
        // the job metrics by type.
        App::observe(self, std::iter::once(done), now);
        let outcome = match done.transition {
            Transition::Succeeded => "succeeded",
            Transition::Retry { .. } => "retried",
            Transition::Defer { .. } => "deferred",
            Transition::DeadLetter { .. } => "dead_lettered",
            Transition::Cancelled => "cancelled",
        };
        m::source_delivery(source, outcome);
    }

    fn recorded(&self, _source: &str, done: &Completed, _now: Timestamp) {
        // `observe` came before the write; a read of the dead letters that
        // ran in between did not see this one, so ask for another.
        if matches!(done.transition, Transition::DeadLetter { .. }) {
            self.alerts.touch();
        }
    }

    fn store_writes(&self) -> Option<&lazaret_guard::StoreWrites> {
        Some(&self.store_writes)
    }

    fn given_back(&self, source: &str) {
        m::source_given_back(source);
    }

    fn redelivered(&self, source: &str, recognised: bool) {
        m::source_redelivered(source, recognised);
    }

    fn observe_taken_in(&self, source: &str, dl: &SourceDeadLetter, _now: Timestamp) {
        let ty = dl.job_type.as_deref().unwrap_or("");
        m::dead_lettered(self.metric_type(source, ty), dl.reason.as_str(), "broker");
        m::source_taken_in(source);
        self.alerts.touch();
    }
}

impl<S: Store> App<S> {
    /// The `type` label for a dead letter a watch source took in. A Celery
    /// task's name comes from the message, so any name could arrive: it is
    /// used only when it is a configured type, else the source's own type
    /// stands in, and the series stay bounded by the config.
    fn metric_type<'a>(&'a self, source: &str, ty: &'a str) -> &'a str {
        if self.config.policies.types.contains_key(&JobType::new(ty)) {
            return ty;
        }
        self.config
            .sources
            .iter()
            .find(|s| s.name == source)
            .map_or("", |s| s.job_type.as_str())
    }
}

/// The line `lazaret serve` prints for a source at start: what it does,
/// where, without the broker's password.
pub fn describe(spec: &SourceSpec) -> String {
    let what = match spec.mode {
        Mode::Guard => "guard",
        Mode::Watch => "watch",
    };
    let to = match (spec.mode, &spec.deliver) {
        (Mode::Guard, Some(url)) => mask_url(url),
        (Mode::Guard, None) => "(no handler)".to_owned(),
        (Mode::Watch, _) => "dead letters".to_owned(),
    };
    let tenant = match &spec.tenant {
        TenantFrom::Fixed(t) => format!("tenant {t}"),
        TenantFrom::Header(h) => format!("tenant from header {h}"),
    };
    format!(
        "source {}: {what} {} {} queue {} → {to} (type {}, lane {}, {tenant})",
        spec.name,
        spec.broker.as_str(),
        mask_url(&spec.url),
        spec.queue,
        spec.job_type,
        spec.lane,
    )
}

/// The running sources of a server, stopped together.
#[derive(Debug)]
pub struct Sources {
    stop: watch::Sender<bool>,
    tasks: Vec<(String, JoinHandle<()>)>,
    grace: Duration,
}

impl Sources {
    /// Starts every configured source in the background and returns at
    /// once: connecting is the tasks' business, never a reason for the
    /// server not to start.
    pub fn start<S: Store>(app: &Arc<App<S>>) -> Sources {
        let (stop, rx) = watch::channel(false);
        let mut tasks = Vec::new();
        let mut grace = Duration::ZERO;
        for spec in &app.config.sources {
            m::describe_source(&spec.name);
            grace = grace.max(spec.delivery_timeout);
            let task = tokio::spawn(run(Arc::clone(app), spec.clone(), rx.clone()));
            tasks.push((spec.name.clone(), task));
        }
        Sources {
            stop,
            tasks,
            // A guard gives its deliveries in flight one delivery timeout
            // and a second more to settle; no longer is waited for.
            grace: grace + Duration::from_secs(1),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    /// Stops every source and waits for them, at most the longest delivery
    /// timeout and a second. A delivery still unsettled then is dropped
    /// unacknowledged: the broker redelivers it, and the redelivery is
    /// recognised if lazaret had written its outcome.
    pub async fn stop(self) {
        let _ = self.stop.send(true);
        let deadline = tokio::time::Instant::now() + self.grace;
        for (name, mut task) in self.tasks {
            match tokio::time::timeout_at(deadline, &mut task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::error!(source = %name, "the source's task failed: {e}"),
                Err(_) => {
                    tracing::warn!(source = %name, "the source did not stop in time; leaving its unsettled messages to the broker");
                    task.abort();
                }
            }
        }
    }
}

/// The environment variable naming a source that stops dead between its
/// write and the broker acknowledgement, for tests that `kill -9` lazaret
/// exactly there. Never set it in production.
pub const FAULT_HANG_AFTER_WRITE: &str = "LAZARET_FAULT_HANG_AFTER_WRITE";

/// Test hooks from the environment: with [`FAULT_HANG_AFTER_WRITE`] naming
/// this source, the first message written (quarantined or held) prints
/// `lazaret-fault: …` to stderr and blocks its thread forever, before the
/// broker acknowledgement, so the test can kill the process there.
fn fault_hooks(source: &str) -> Faults {
    if std::env::var(FAULT_HANG_AFTER_WRITE).ok().as_deref() != Some(source) {
        return Faults::default();
    }
    tracing::warn!(
        source,
        "{FAULT_HANG_AFTER_WRITE} is set: this source hangs after its first write (tests only)"
    );
    Faults {
        crash_after_write: Some(Arc::new(|d| {
            eprintln!(
                "lazaret-fault: wrote message {}, hanging before the broker acknowledgement",
                d.message_id
            );
            loop {
                std::thread::sleep(Duration::from_secs(3600));
            }
        })),
        ..Faults::default()
    }
}

/// One source, from connecting to shutdown.
async fn run<S: Store>(app: Arc<App<S>>, spec: SourceSpec, mut stop: watch::Receiver<bool>) {
    let Some(broker) = connect(&spec, &mut stop).await else {
        return;
    };
    app.sources
        .write()
        .unwrap_or_else(|p| p.into_inner())
        .insert(spec.clone(), Arc::clone(&broker));
    tracing::info!(source = %spec.name, "connected to {} at {}", spec.broker.as_str(), mask_url(&spec.url));
    let name = spec.name.clone();
    let result = match spec.mode {
        Mode::Guard => {
            let Some(url) = spec.deliver.clone() else {
                // The config refuses a guard without `deliver`.
                tracing::error!(source = %name, "a guard source has no deliver URL; it does not run");
                return;
            };
            let classes = app.policy(&spec.job_type).kind_classes;
            let handler = Arc::new(
                HttpHandler::new(url)
                    .with_format(spec.deliver_format)
                    .with_kind_classes(classes),
            );
            let faults = fault_hooks(&spec.name);
            Guard::new(spec, app, Arc::clone(&broker), handler)
                .with_faults(faults)
                .run(stop)
                .await
        }
        Mode::Watch => {
            let faults = fault_hooks(&spec.name);
            Watch::new(spec, app, Arc::clone(&broker))
                .with_faults(faults)
                .run(stop)
                .await
        }
    };
    if let Err(e) = result {
        tracing::error!(source = %name, "the source stopped: {e}; restart lazaret to run it again");
    }
    // Closed while the runtime runs, not torn down with it.
    broker.close().await;
}

/// Connects, retrying while the broker cannot be reached; `None` at
/// shutdown or when retrying cannot help (this build lacks the adapter, or
/// the broker refuses the source's settings).
async fn connect(spec: &SourceSpec, stop: &mut watch::Receiver<bool>) -> Option<Arc<dyn Broker>> {
    let mut failures = 0u32;
    loop {
        if *stop.borrow() {
            return None;
        }
        let err = tokio::select! {
            r = lazaret_guard::connect(spec) => match r {
                Ok(b) => return Some(Arc::from(b)),
                Err(e) => e,
            },
            _ = stop.changed() => return None,
        };
        if matches!(err, BrokerError::NotBuilt(_) | BrokerError::Config(_)) {
            tracing::error!(source = %spec.name, "{err}; this source does not run");
            return None;
        }
        if failures % CONNECT_WARN_EVERY == 0 {
            tracing::warn!(source = %spec.name, "{err}; lazaret keeps retrying in the background");
        } else {
            tracing::debug!(source = %spec.name, "{err}; retrying");
        }
        failures += 1;
        tokio::select! {
            _ = tokio::time::sleep(reconnect_delay(failures)) => {}
            _ = stop.changed() => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use lazaret_guard::BrokerKind;

    use super::*;

    #[test]
    fn the_start_line_hides_the_password() {
        let mut spec = SourceSpec::guard(
            "orders",
            BrokerKind::RabbitMq,
            "amqp://guest:secret@127.0.0.1:5672/%2f",
            "orders",
            "orders",
        );
        spec.deliver = Some("http://127.0.0.1:8080/orders".into());
        let line = describe(&spec);
        assert_eq!(
            line,
            "source orders: guard rabbitmq amqp://***@127.0.0.1:5672/%2f queue orders → \
             http://127.0.0.1:8080/orders (type orders, lane default, tenant default)"
        );
        let mut watch = SourceSpec::watch("dlq", BrokerKind::Redis, "redis://h", "dead", "t");
        watch.tenant = TenantFrom::Header("x-tenant".into());
        assert!(describe(&watch).contains("watch redis redis://h queue dead → dead letters"));
        assert!(describe(&watch).ends_with("tenant from header x-tenant)"));
    }
}
