//! The battery every broker runs: publish in four chunks while a guard
//! consumes; after each of the first three chunks, once part of it is
//! settled (messages are in flight), one fault: the guard's connections
//! killed by the broker, the broker paused past the guard's timeouts, the
//! broker restarted. The fourth chunk flows after the recovery. Then drain
//! and check.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write as _;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lazaret_core::{
    Backoff, Breakers, Failure, FailureClass, FairScheduler, JobType, Policies, SchedulerConfig,
    TypePolicy,
};
use lazaret_guard::{Faults, Guard, Host, LocalHost, Outcome, Settled, SourceSpec};
use lazaret_store::{DeadLetterFilter, Durability, PolicyDecider, SqliteStore, Store};
use lazaret_testkit::faults::{Restorer, Service};
use lazaret_testkit::history::{AnomalyKind, Handled, Op, Recorder, Report, payload_hash};
use tokio::sync::watch;

/// The job type of every source here.
pub const TYPE: &str = "orders";

/// The guard's delivery timeout in the battery: a pause lasts
/// [`PAUSE`], longer than it and than every client timeout of the
/// adapters (Redis: 5 s per command, 10 s for a blocking read; RabbitMQ:
/// the 5 s heartbeat the battery's URL asks for, missed twice; NATS: the
/// consumer's ack wait, this plus 5 s).
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the broker stays stopped (SIGSTOP) in the pause fault.
pub const PAUSE: Duration = Duration::from_secs(12);

/// How long the drain waits without a message finishing, after the last
/// fault, before it calls what is left unfinished.
const STALL: Duration = Duration::from_secs(20);

/// The longest a whole drain may take.
const DRAIN_MAX: Duration = Duration::from_secs(300);

/// What a battery needs of a broker.
pub trait FaultBroker {
    /// The machine's service this broker is.
    const SERVICE: Service;
    /// Whether a restart keeps the messages the broker holds (RabbitMQ's
    /// quorum queues, JetStream's file storage) or loses them (Redis
    /// without persistence, tansu and moto in memory).
    const RESTART_KEEPS: bool;
    /// Whether the broker is known to hand one message to two receives at
    /// once (moto's unlocked receive, see `sqs.rs`): a first receive
    /// (attempt 1, not redelivered by the broker's own count) that reaches
    /// the guard after a copy the broker marked redelivered is then the
    /// broker's, counted apart, not an attempt going backwards.
    const COPIES_AT_ONCE: bool = false;

    /// A fresh queue (stream) for the source `name`.
    async fn queue(&self, name: &str) -> String;

    /// The guard's source spec for `queue`.
    fn spec(&self, name: &str, queue: &str) -> SourceSpec;

    /// Publishes `batch` (message id, body) to `queue` as the team's
    /// producer would, waiting for the broker's confirmation of each;
    /// calls `confirmed` with each index confirmed. An error leaves the
    /// rest unconfirmed.
    async fn publish(
        &self,
        queue: &str,
        batch: &[(String, Vec<u8>)],
        confirmed: &mut dyn FnMut(usize),
    ) -> Result<(), String>;

    /// Closes the guard's connections from the broker's side (blocking);
    /// how many.
    fn kill_connections(&self, source: &str) -> Result<usize, String>;

    /// After a restart that lost the broker's state, creates the queue
    /// again as the team's setup would (Redis: the guard does it itself).
    async fn after_restart(&self, queue: &str) {
        let _ = queue;
    }

    /// Removes the queue (stream) after the run.
    async fn remove(&self, queue: &str);
}

/// `LAZARET_FAULTS=1`, or a message that the battery is skipped (which is
/// not a failure even under `CI=true`; see the crate's `faults.rs`).
pub fn enabled(test: &str) -> bool {
    if std::env::var("LAZARET_FAULTS").is_ok_and(|v| v == "1") {
        return true;
    }
    // Past the harness's capture, as `lazaret_testkit::skip` says it.
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED {test}: the broker fault battery restarts shared brokers; run it alone with \
         LAZARET_FAULTS=1 cargo test -p lazaret-guard --test faults -- --test-threads=1 \
         (.ci/run does, after the workspace's tests)"
    );
    false
}

/// The number of messages per broker.
fn messages() -> usize {
    std::env::var("LAZARET_FAULTS_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// What a message is for the handler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Fine,
    Poison,
    Transient,
}

fn kind_of(i: usize) -> Kind {
    match i % 10 {
        3 => Kind::Poison,
        7 => Kind::Transient,
        _ => Kind::Fine,
    }
}

fn kind_in(body: &[u8]) -> Kind {
    if body.starts_with(b"{\"kind\":\"poison\"") {
        Kind::Poison
    } else if body.starts_with(b"{\"kind\":\"transient\"") {
        Kind::Transient
    } else {
        Kind::Fine
    }
}

fn body(i: usize) -> Vec<u8> {
    let kind = match kind_of(i) {
        Kind::Fine => "fine",
        Kind::Poison => "poison",
        Kind::Transient => "transient",
    };
    format!("{{\"kind\":\"{kind}\",\"n\":{i}}}").into_bytes()
}

fn store(dir: &Path) -> SqliteStore {
    SqliteStore::open(
        dir,
        Durability::Full,
        FairScheduler::new(SchedulerConfig::new(1000)).expect("a valid scheduler config"),
        Arc::new(PolicyDecider::new(Policies::default())),
    )
    .expect("open the store")
}

fn policies() -> Policies {
    let mut p = Policies::default();
    let base = Duration::from_millis(200);
    p.types.insert(
        JobType::from(TYPE),
        TypePolicy {
            attempts_max: 8,
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

/// What the settled hook saw: ids finished for good.
#[derive(Default)]
struct Finished {
    ids: HashSet<String>,
    completed: HashSet<String>,
    at: Option<Instant>,
}

/// One fault, as the report lists it.
struct FaultRun {
    what: &'static str,
    took: Duration,
    detail: String,
}

/// Which run of the battery.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Build {
    /// The guard as built, under the three broker faults.
    Sound,
    /// The deliberately broken guard (`Faults::ack_before_dead_letter`: one
    /// poison message in [`BROKEN_EVERY`] acknowledged before its dead
    /// letter is written, then a crash before the write), restarted after
    /// each crash, without broker faults and on [`BROKEN_MESSAGES`]
    /// messages: the battery must find what it lost.
    Broken,
}

/// How many messages the broken build's run publishes.
const BROKEN_MESSAGES: usize = 400;
/// The broken build breaks on one poison message in this many.
const BROKEN_EVERY: usize = 5;

/// What a run left for the verdict.
struct Ran {
    total: usize,
    report: Report,
    verdict: Verdict,
    summary: String,
    quarantined: BTreeMap<String, usize>,
    /// Broken build: the messages acknowledged before their dead letter.
    broken: HashSet<String>,
    /// How often the guard was started again after a crash.
    restarts: usize,
}

/// Runs the battery on `b`; panics when the checker finds a broken promise.
pub async fn run<B: FaultBroker>(b: &B, label: &str) {
    let Ran {
        total,
        report,
        verdict,
        summary,
        quarantined,
        ..
    } = execute(b, label, Build::Sound).await;
    if !verdict.anomalies.is_empty() {
        let path = lazaret_testkit::history::dump_path(&format!("faults-{label}"));
        let shown: Vec<String> = verdict
            .anomalies
            .iter()
            .take(10)
            .map(ToString::to_string)
            .collect();
        panic!(
            "{label}: {} anomalies (history in {}):\n{}\n{summary}",
            verdict.anomalies.len(),
            path.display(),
            shown.join("\n")
        );
    }
    // Every poison message the broker delivered is quarantined once; no
    // other message is.
    for (id, n) in &quarantined {
        assert_eq!(*n, 1, "{label}: {id} has {n} dead letters");
        let i: usize = id[1..].parse().expect("an id of the battery");
        assert_eq!(
            kind_of(i),
            Kind::Poison,
            "{label}: {id} was quarantined but is not poison"
        );
    }
    let expected = total - verdict.broker_lost.len();
    assert_eq!(
        report.completed + report.dead_lettered,
        expected,
        "{label}: every message the broker kept is handled or quarantined\n{summary}"
    );
}

/// Runs the battery on `b` with the deliberately broken guard ([`Build::Broken`])
/// and asserts that it fails: the checker finds messages lost (acknowledged,
/// neither completed nor dead-lettered) or acked unhandled, only among those
/// the broken guard acknowledged before their dead letter, and the judge
/// counts them as the guard's anomalies (not the broker's at-least-once).
pub async fn run_broken<B: FaultBroker>(b: &B, label: &str) {
    let Ran {
        verdict,
        summary,
        broken,
        restarts,
        ..
    } = execute(b, label, Build::Broken).await;
    assert!(
        restarts > 0,
        "{label}: the broken guard never broke\n{summary}"
    );
    let lost: Vec<&lazaret_testkit::history::Anomaly> = verdict
        .anomalies
        .iter()
        .filter(|a| matches!(a.kind, AnomalyKind::Lost | AnomalyKind::AckedUnhandled))
        .collect();
    assert!(
        !lost.is_empty(),
        "{label}: the battery did not catch the broken guard ({restarts} messages acknowledged \
         before their dead letter)\n{summary}"
    );
    for a in &verdict.anomalies {
        assert!(
            broken.contains(&a.id),
            "{label}: an anomaly the broken ack does not explain: {a}\n{summary}"
        );
    }
    eprintln!(
        "FAULTS {label} (broken build): caught: {} anomalies ({} lost or acked unhandled), all \
         of the {} messages acknowledged before their dead letter ({restarts} crashes and \
         restarts of the guard), e.g. {}",
        verdict.anomalies.len(),
        lost.len(),
        broken.len(),
        lost[0]
    );
}

/// One run of the battery, judged but not asserted.
#[allow(clippy::too_many_lines)]
async fn execute<B: FaultBroker>(b: &B, label: &str, build: Build) -> Ran {
    let started = Instant::now();
    let mut restorer = Restorer::new(&[B::SERVICE]);
    assert!(
        restorer.found(B::SERVICE),
        "{label}: {:?} does not answer on 127.0.0.1:{}; start it as .ci/run does",
        B::SERVICE,
        B::SERVICE.port()
    );
    let total = match build {
        Build::Sound => messages(),
        Build::Broken => BROKEN_MESSAGES,
    };
    let name = match build {
        Build::Sound => format!("faults-{label}-{}", std::process::id()),
        Build::Broken => format!("faults-{label}-broken-{}", std::process::id()),
    };
    let queue = b.queue(&name).await;
    let spec = b.spec(&name, &queue);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let host = Arc::new(LocalHost::new(
        store(dir.path()),
        policies(),
        Breakers::new(None, Default::default()),
    ));

    let history = Recorder::new();
    let finished = Arc::new(Mutex::new(Finished::default()));
    let broken: Arc<Mutex<HashSet<String>>> = Arc::default();
    let faults = {
        let history = history.clone();
        let finished = Arc::clone(&finished);
        let broken = Arc::clone(&broken);
        type Hook = Arc<dyn Fn(&lazaret_guard::Delivery) -> bool + Send + Sync>;
        let ack_before_dead_letter: Option<Hook> = match build {
            Build::Sound => None,
            // Once per message: its redelivery (the ack lost with the
            // crashed guard's connection) is dead-lettered as it should be.
            Build::Broken => Some(Arc::new(move |d: &lazaret_guard::Delivery| {
                let n: usize = d.message_id[1..].parse().unwrap_or(0);
                (n / 10) % BROKEN_EVERY == 0 && broken.lock().unwrap().insert(d.message_id.clone())
            })),
        };
        Faults {
            ack_before_dead_letter,
            settled: Some(Arc::new(move |d, how| {
                if matches!(how, Settled::Succeeded | Settled::Quarantined) {
                    history.observe(Op::BrokerAck {
                        id: d.message_id.clone(),
                    });
                    let mut f = finished.lock().unwrap();
                    f.ids.insert(d.message_id.clone());
                    if how == Settled::Succeeded {
                        f.completed.insert(d.message_id.clone());
                    }
                    f.at = Some(Instant::now());
                }
            })),
            ..Faults::default()
        }
    };
    let handler = {
        let history = history.clone();
        Arc::new(lazaret_guard::handler_fn(move |call| {
            let d = &call.delivery;
            let pending = history.invoke(Op::deliver(
                d.message_id.clone(),
                call.attempt,
                "guard-1",
                d.redelivered,
                Some(payload_hash(&d.body)),
            ));
            let (out, handled) = match (kind_in(&d.body), call.attempt) {
                (Kind::Poison, _) => (
                    Outcome::Failure(
                        Failure::new("http_400", "poison").with_class(FailureClass::Permanent),
                    ),
                    Handled::Permanent,
                ),
                (Kind::Transient, 1) => (
                    Outcome::Failure(
                        Failure::new("http_503", "try again").with_class(FailureClass::Transient),
                    ),
                    Handled::Transient,
                ),
                _ => (Outcome::Success, Handled::Success),
            };
            pending.handled(handled);
            async move { out }
        }))
    };
    let (stop, stop_rx) = watch::channel(false);
    // The guard, started again after each crash (the broken build's) on the
    // same store, as a supervisor restarts a killed process.
    let task = {
        let (spec, host) = (spec.clone(), Arc::clone(&host));
        tokio::spawn(async move {
            let mut restarts = 0usize;
            loop {
                let broker: Arc<dyn lazaret_guard::Broker> = lazaret_guard::connect(&spec)
                    .await
                    .expect("connect the guard to the broker")
                    .into();
                let guard = Guard::new(
                    spec.clone(),
                    Arc::clone(&host),
                    broker,
                    Arc::clone(&handler) as Arc<dyn lazaret_guard::Handler>,
                )
                .with_faults(faults.clone());
                match guard.run(stop_rx.clone()).await {
                    Err(lazaret_guard::GuardError::Crashed) => restarts += 1,
                    other => return other.map(|()| restarts),
                }
            }
        })
    };

    let all: Vec<(String, Vec<u8>)> = (0..total).map(|i| (format!("m{i:06}"), body(i))).collect();
    let chunks: Vec<&[(String, Vec<u8>)]> = all.chunks(total.div_ceil(4).max(1)).collect();
    let mut published = 0usize;
    let mut fault_runs = Vec::new();
    // Ids published before the restart of a broker that loses messages.
    let mut before_restart: HashSet<String> = HashSet::new();
    for (c, chunk) in chunks.iter().enumerate() {
        let mut pendings: Vec<Option<_>> = chunk
            .iter()
            .map(|(id, body)| {
                Some(history.invoke(Op::Publish {
                    id: id.clone(),
                    payload_hash: payload_hash(body),
                }))
            })
            .collect();
        let res = b
            .publish(&queue, chunk, &mut |i| {
                if let Some(p) = pendings[i].take() {
                    p.ok();
                }
            })
            .await;
        for p in pendings.into_iter().flatten() {
            p.info();
        }
        res.unwrap_or_else(|e| panic!("{label}: publish chunk {c}: {e}"));
        published += chunk.len();
        let fault: &'static str = match c {
            _ if build == Build::Broken => continue,
            0 => "connections killed",
            1 => "pause",
            2 => "restart",
            _ => continue,
        };
        // Strike while the chunk flows: a third of it settled. A restart
        // of a broker that loses its messages strikes near the chunk's end
        // instead (150 unsettled, some in the guard's hands): what it had
        // not delivered yet is lost by the broker, and counted apart.
        let target = if fault == "restart" && !B::RESTART_KEEPS {
            published.saturating_sub(150)
        } else {
            published - chunk.len() + chunk.len() / 3
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while finished.lock().unwrap().ids.len() < target {
            assert!(
                Instant::now() < deadline,
                "{label}: the guard settled {} of {target} messages within 120 s before the {fault}",
                finished.lock().unwrap().ids.len()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let at = finished.lock().unwrap().ids.len();
        let t = Instant::now();
        let op = history.invoke(Op::Fault {
            what: format!("{:?} {fault}", B::SERVICE),
        });
        let detail = match fault {
            "connections killed" => {
                let n = tokio::task::block_in_place(|| b.kill_connections(&name))
                    .unwrap_or_else(|e| panic!("{label}: kill the connections: {e}"));
                assert!(n > 0, "{label}: no connection of the guard to kill");
                format!("{n} connections closed by the broker")
            }
            "pause" => {
                restorer
                    .pause(B::SERVICE)
                    .unwrap_or_else(|e| panic!("{label}: {e}"));
                tokio::time::sleep(PAUSE).await;
                restorer.resume();
                format!("SIGSTOP for {PAUSE:?}, then SIGCONT")
            }
            _ => {
                if !B::RESTART_KEEPS {
                    before_restart = all[..published].iter().map(|(id, _)| id.clone()).collect();
                }
                tokio::task::block_in_place(|| restorer.restart(B::SERVICE))
                    .unwrap_or_else(|e| panic!("{label}: restart: {e}"));
                if !B::RESTART_KEEPS {
                    b.after_restart(&queue).await;
                }
                "stopped and started again".to_owned()
            }
        };
        op.ok();
        fault_runs.push(FaultRun {
            what: fault,
            took: t.elapsed(),
            detail: format!("{detail}; {at} of {published} published were settled when it struck"),
        });
    }

    // Drain: until everything published is finished, or nothing finishes
    // for STALL (what a broker lost in a restart never comes).
    let drain_from = Instant::now();
    loop {
        let (n, last) = {
            let f = finished.lock().unwrap();
            (f.ids.len(), f.at.unwrap_or(drain_from))
        };
        if n >= total {
            break;
        }
        let quiet = Instant::now().duration_since(last.max(drain_from));
        if quiet >= STALL || drain_from.elapsed() >= DRAIN_MAX {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = stop.send(true);
    let restarts = task
        .await
        .expect("the guard's task")
        .unwrap_or_else(|e| panic!("{label}: the guard stopped with an error: {e}"));

    // Final observations: the dead letters in the store, what completed.
    let store = host.store();
    let mut cursor = None;
    let mut quarantined: BTreeMap<String, usize> = BTreeMap::new();
    loop {
        let (items, next) = store
            .dead_letters(
                DeadLetterFilter {
                    source: Some(name.clone()),
                    ..DeadLetterFilter::default()
                },
                500,
                cursor,
            )
            .await
            .expect("read the dead letters");
        for d in &items {
            let id = d
                .source
                .as_ref()
                .map(|s| s.message_id.clone())
                .expect("a guard's dead letter names its broker message");
            *quarantined.entry(id.clone()).or_insert(0) += 1;
            history.observe(Op::ObservedDeadLetter {
                id,
                dead_letter_id: d.id.to_string(),
                has_history: !d.history.is_empty(),
                has_payload: d.payload_size > 0,
                payload_hash: None,
            });
        }
        if next.is_none() || items.is_empty() {
            break;
        }
        cursor = next;
    }
    let completed: Vec<String> = finished.lock().unwrap().completed.iter().cloned().collect();
    for id in &completed {
        history.observe(Op::ObservedCompleted { id: id.clone() });
    }
    b.remove(&queue).await;
    let restored = restorer.restore();

    let report = history.check();
    let verdict = judge(&history, &report, &before_restart, B::COPIES_AT_ONCE);
    let took = started.elapsed();
    let mut summary = format!(
        "FAULTS {label}: {total} messages in {took:.1?}: {} completed, {} quarantined, \
         {} lost by the broker's restart (never delivered), {} acks the broker lost \
         (redelivered after a settled ack), {} copies the broker handed out at once, {} guard \
         anomalies; duplicates at-least-once allowed {:?}; most deliveries of one message {}",
        report.completed,
        report.dead_lettered,
        verdict.broker_lost.len(),
        verdict.acks_lost,
        verdict.copies_at_once,
        verdict.anomalies.len(),
        report.duplicated_allowed,
        report.deliveries_max,
    );
    for f in &fault_runs {
        summary.push_str(&format!("\n  {}: {:.1?} ({})", f.what, f.took, f.detail));
    }
    if restarts > 0 {
        summary.push_str(&format!("\n  the guard was started again {restarts} times"));
    }
    eprintln!("{summary}");
    restored.unwrap_or_else(|e| panic!("{label}: the broker was not restored: {e}"));
    if !verdict.anomalies.is_empty() {
        let path = lazaret_testkit::history::dump_path(&format!("faults-{label}"));
        let _ = history.history().write_jsonl(&path);
    }
    let broken = broken.lock().unwrap().clone();
    Ran {
        total,
        report,
        verdict,
        summary,
        quarantined,
        broken,
        restarts,
    }
}

struct Verdict {
    /// Published before a restart that lost the broker's messages, and
    /// never delivered to the guard: the broker lost them, not lazaret.
    broker_lost: Vec<String>,
    /// Deliveries after a settled ack, redelivered by the broker: the
    /// broker did not get the ack (it went with a connection or a
    /// restart), at-least-once.
    acks_lost: usize,
    /// First receives delivered after a redelivered copy of the same
    /// message, for a broker that declares `COPIES_AT_ONCE`.
    copies_at_once: usize,
    /// Everything else the checker found: lazaret's broken promises.
    anomalies: Vec<lazaret_testkit::history::Anomaly>,
}

fn judge(
    history: &Recorder,
    report: &Report,
    before_restart: &HashSet<String>,
    copies_at_once: bool,
) -> Verdict {
    let h = history.history();
    let mut delivered: HashMap<&str, usize> = HashMap::new();
    let mut redelivered_after: HashSet<String> = HashSet::new();
    // A first receive (attempt 1, not redelivered) after a redelivered
    // copy: the broker's count contradicts its own order.
    let mut first_after_copy: HashSet<String> = HashSet::new();
    for e in &h.entries {
        if let Op::Deliver {
            id,
            redelivered,
            attempt,
            ..
        } = &e.op
        {
            *delivered.entry(id.as_str()).or_insert(0) += 1;
            if *redelivered {
                redelivered_after.insert(id.clone());
            } else if *attempt == 1 && redelivered_after.contains(id) {
                first_after_copy.insert(id.clone());
            }
        }
    }
    let mut broker_lost = Vec::new();
    let mut acks_lost = 0;
    let mut copies = 0;
    let mut anomalies = Vec::new();
    for a in &report.anomalies {
        match a.kind {
            AnomalyKind::Lost
                if before_restart.contains(&a.id) && !delivered.contains_key(a.id.as_str()) =>
            {
                broker_lost.push(a.id.clone());
            }
            AnomalyKind::DeliveryAfterAck if redelivered_after.contains(&a.id) => acks_lost += 1,
            AnomalyKind::AttemptBackwards if copies_at_once && first_after_copy.contains(&a.id) => {
                copies += 1;
            }
            _ => anomalies.push(a.clone()),
        }
    }
    Verdict {
        broker_lost,
        acks_lost,
        copies_at_once: copies,
        anomalies,
    }
}
