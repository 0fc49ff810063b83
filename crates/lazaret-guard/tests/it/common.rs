//! What every broker's tests share: a store in a temporary directory, a
//! host with a test policy, a guard or watch started in the background,
//! handlers that record what they saw, and [`TestBroker`], the few broker
//! operations the shared scenarios need.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lazaret_core::{
    Backoff, Breakers, DeadLetterReason, FairScheduler, JobType, Policies, SchedulerConfig,
    TypePolicy,
};
use lazaret_guard::{
    Broker, Faults, Guard, GuardError, Handler, LocalHost, Mode, Outcome, Settled, SourceSpec,
    Watch,
};
use lazaret_store::{DeadLetter, DeadLetterFilter, Durability, PolicyDecider, SqliteStore, Store};
use serde_json::{Map, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The broker's URL from `var`, or `None` after saying the test is skipped
/// (a failure under `CI=true`, where every broker must be there).
pub fn service(var: &str) -> Option<String> {
    lazaret_testkit::service(var, "the broker's URL", "this broker test")
}

/// A name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// The few broker operations the shared scenarios need, implemented in
/// each broker's test file.
pub trait TestBroker: Send + Sync + 'static {
    /// A fresh queue (stream) for a guard source, created as the broker
    /// docs in `docs/brokers.md` say (for RabbitMQ a quorum queue).
    fn fresh_queue(&self, prefix: &str) -> impl Future<Output = String> + Send;

    /// The source spec of a guard or watch source on `queue`.
    fn spec(&self, name: &str, queue: &str, mode: Mode) -> SourceSpec;

    /// Publishes a message as the team's producer would, with a message id
    /// the broker's own way (RabbitMQ `message_id`, `Nats-Msg-Id`, the
    /// Redis field `message_id`) and these headers.
    fn produce(
        &self,
        queue: &str,
        message_id: &str,
        body: &[u8],
        headers: Map<String, Value>,
    ) -> impl Future<Output = ()> + Send;

    /// Makes the broker dead-letter a message itself, as it does in
    /// production (RabbitMQ: a reject without requeue into a queue with a
    /// dead-letter exchange; JetStream: `MaxDeliver` reached, the advisory
    /// captured in a stream; Redis: the entry copied to a dead stream), and
    /// returns (the dead-letter queue a watch source reads, the original
    /// queue).
    fn broker_dead_letter(
        &self,
        prefix: &str,
        message_id: &str,
        body: &[u8],
    ) -> impl Future<Output = (String, String)> + Send;

    /// The reason the broker's dead letter above must be filed under.
    fn broker_reason(&self) -> DeadLetterReason;

    /// Takes one message off `queue` directly (not through lazaret), for
    /// checking what a redrive published: body and headers.
    fn take_one(
        &self,
        queue: &str,
        wait: Duration,
    ) -> impl Future<Output = Option<(Vec<u8>, Map<String, Value>)>> + Send;

    /// The broker adapter for `spec` (the real one, by default).
    fn connect<'a>(
        &'a self,
        spec: &'a SourceSpec,
    ) -> impl Future<Output = Arc<dyn Broker>> + Send + 'a {
        async move {
            lazaret_guard::connect(spec)
                .await
                .expect("connect to the broker")
                .into()
        }
    }
}

/// Opens the store in `dir` (again, after a "restart").
pub fn open_store(dir: &Path) -> SqliteStore {
    SqliteStore::open(
        dir,
        Durability::Full,
        FairScheduler::new(SchedulerConfig::new(1000)).expect("a valid scheduler config"),
        Arc::new(PolicyDecider::new(Policies::default())),
    )
    .expect("open the store")
}

/// A policy for `ty`: `attempts_max` attempts, backoff from `base`.
pub fn policies(ty: &str, attempts_max: u32, base: Duration) -> Policies {
    let mut p = Policies::default();
    p.types.insert(
        JobType::from(ty),
        TypePolicy {
            attempts_max,
            backoff: Backoff {
                base,
                cap: base * 2,
                floor: base,
                schedule: Vec::new(),
            },
            ..TypePolicy::default()
        },
    );
    p
}

/// A host on the store in `dir` with `policies` and no breakers.
pub fn host(dir: &Path, policies: Policies) -> Arc<LocalHost<SqliteStore>> {
    Arc::new(LocalHost::new(
        open_store(dir),
        policies,
        Breakers::new(None, Default::default()),
    ))
}

/// A running source: stop it with [`Running::stop`].
pub struct Running {
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), GuardError>>,
}

impl Running {
    /// Asks it to stop and waits.
    pub async fn stop(self) -> Result<(), GuardError> {
        let _ = self.stop.send(true);
        self.task.await.expect("the source's task")
    }

    /// Waits for it to stop by itself (an injected crash).
    pub async fn join(self) -> Result<(), GuardError> {
        tokio::time::timeout(Duration::from_secs(30), self.task)
            .await
            .expect("the source stops within 30 s")
            .expect("the source's task")
    }
}

/// Starts a guard of `spec` delivering to `handler`, on any host.
pub async fn start_guard<B: TestBroker, H: lazaret_guard::Host + 'static>(
    b: &B,
    spec: SourceSpec,
    host: Arc<H>,
    handler: Arc<dyn Handler>,
    faults: Faults,
) -> Running {
    let broker = b.connect(&spec).await;
    let (stop, rx) = watch::channel(false);
    let guard = Guard::new(spec, host, broker, handler).with_faults(faults);
    Running {
        stop,
        task: tokio::spawn(guard.run(rx)),
    }
}

/// Starts a watch of `spec` on `b`'s adapter.
pub async fn start_watch_on<B: TestBroker>(
    b: &B,
    spec: SourceSpec,
    host: Arc<LocalHost<SqliteStore>>,
    faults: Faults,
) -> Running {
    let broker = b.connect(&spec).await;
    let (stop, rx) = watch::channel(false);
    let w = Watch::new(spec, host, broker).with_faults(faults);
    Running {
        stop,
        task: tokio::spawn(w.run(rx)),
    }
}

/// Starts a watch of `spec`.
pub async fn start_watch(
    spec: SourceSpec,
    host: Arc<LocalHost<SqliteStore>>,
    faults: Faults,
) -> Running {
    let broker: Arc<dyn Broker> = lazaret_guard::connect(&spec)
        .await
        .expect("connect to the broker")
        .into();
    let (stop, rx) = watch::channel(false);
    let w = Watch::new(spec, host, broker).with_faults(faults);
    Running {
        stop,
        task: tokio::spawn(w.run(rx)),
    }
}

/// One call a handler saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Seen {
    /// `Lazaret-Message-Id` / the delivery's id.
    pub message_id: String,
    /// The attempt.
    pub attempt: u32,
    /// The body.
    pub body: Vec<u8>,
}

/// Everything handlers saw, in order, with a way to wait for a count.
#[derive(Clone, Default)]
pub struct Log {
    seen: Arc<Mutex<Vec<Seen>>>,
    changed: Arc<tokio::sync::Notify>,
}

impl Log {
    /// Records a call.
    pub fn push(&self, s: Seen) {
        self.seen.lock().unwrap().push(s);
        self.changed.notify_waiters();
    }

    /// What was seen so far.
    pub fn all(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// Waits until `pred` holds for what was seen (at most `within`).
    pub async fn wait_for(&self, within: Duration, pred: impl Fn(&[Seen]) -> bool) -> Vec<Seen> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.changed.notified();
            {
                let seen = self.seen.lock().unwrap();
                if pred(&seen) {
                    return seen.clone();
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let seen = self.all();
                assert!(pred(&seen), "not seen within {within:?}: {seen:#?}");
                return seen;
            }
        }
    }
}

/// A closure handler that records each call and answers with `answer`.
pub fn recording(
    log: &Log,
    answer: impl Fn(&Seen) -> Outcome + Send + Sync + 'static,
) -> Arc<dyn Handler> {
    let log = log.clone();
    let answer = Arc::new(answer);
    Arc::new(lazaret_guard::handler_fn(move |call| {
        let seen = Seen {
            message_id: call.delivery.message_id.clone(),
            attempt: call.attempt,
            body: call.delivery.body.clone(),
        };
        let out = answer(&seen);
        log.push(seen);
        async move { out }
    }))
}

/// The dead letters of `source`, oldest first.
pub async fn dead_letters_of(store: &impl Store, source: &str) -> Vec<DeadLetter> {
    let (mut items, _) = store
        .dead_letters(
            DeadLetterFilter {
                source: Some(source.into()),
                ..DeadLetterFilter::default()
            },
            1000,
            None,
        )
        .await
        .expect("read dead letters");
    items.reverse();
    items
}

/// Waits until `source` has `n` dead letters.
pub async fn wait_dead_letters(
    store: &impl Store,
    source: &str,
    n: usize,
    within: Duration,
) -> Vec<DeadLetter> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let d = dead_letters_of(store, source).await;
        if d.len() >= n || tokio::time::Instant::now() >= deadline {
            assert_eq!(
                d.len(),
                n,
                "dead letters of {source} within {within:?}: {d:#?}"
            );
            return d;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Counts per message id.
pub fn counts(seen: &[Seen]) -> HashMap<String, usize> {
    let mut m = HashMap::new();
    for s in seen {
        *m.entry(s.message_id.clone()).or_insert(0) += 1;
    }
    m
}

/// A header map from JSON.
pub fn headers(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap_or_default()
}

/// What a settled hook recorded: (message id, how), in order.
pub type SettledLog = Arc<Mutex<Vec<(String, Settled)>>>;

/// A settled hook that records (message id, how) in order.
pub fn settled_log() -> (Faults, SettledLog) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = Arc::clone(&log);
    let faults = Faults {
        settled: Some(Arc::new(move |d, how| {
            l.lock().unwrap().push((d.message_id.clone(), how));
        })),
        ..Faults::default()
    };
    (faults, log)
}

/// Waits (at most `within`) until `id` was settled as `how`.
pub async fn wait_settled(
    log: &Mutex<Vec<(String, Settled)>>,
    id: &str,
    how: Settled,
    within: Duration,
) {
    let deadline = tokio::time::Instant::now() + within;
    while !log
        .lock()
        .unwrap()
        .iter()
        .any(|(i, h)| i == id && *h == how)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{id} not settled as {how:?} within {within:?}: {:?}",
            log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
