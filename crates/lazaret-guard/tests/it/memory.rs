//! An in-memory broker: queues, delivery counts, acknowledgements, and
//! redelivery of what a dropped connection left unacknowledged. The shared
//! scenarios run on it everywhere (no service needed), and the runtime's
//! own rules (breakers, crash loops, shutdown) are tested on it alone.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::future::BoxFuture;
use lazaret_core::DeadLetterReason;
use lazaret_guard::message::TakenIn;
use lazaret_guard::{
    Acker, Broker, BrokerError, BrokerKind, Consumer, Delivery, Incoming, Mode, Republish,
    SourceSpec,
};
use serde_json::{Map, Value, json};
use tokio::sync::Notify;

use crate::common::{TestBroker, unique};

#[derive(Clone, Debug)]
struct Msg {
    id: String,
    body: Vec<u8>,
    headers: Map<String, Value>,
    /// Deliveries so far.
    deliveries: u32,
    seq: u64,
}

#[derive(Default, Debug)]
struct State {
    queues: HashMap<String, VecDeque<Msg>>,
    /// Unacknowledged, by (connection, tag).
    unacked: HashMap<(u64, u64), (String, Msg)>,
    next: u64,
    /// What the runtime told the ackers, in order: (message id, `decided`
    /// or `ack`).
    told: Vec<(String, &'static str)>,
    /// Message ids the runtime kept from redelivery (`progress`), in order.
    progressed: Vec<String>,
    /// Times a consumer found its queue empty and began to wait.
    empty_waits: u64,
}

/// The broker itself, shared by every connection.
#[derive(Clone, Default, Debug)]
pub struct Memory {
    state: Arc<Mutex<State>>,
    ready: Arc<Notify>,
    /// Retries wait on the broker (as on an SQS FIFO queue): a held
    /// message comes back when its hold ends.
    holds: Arc<AtomicBool>,
}

impl Memory {
    /// A broker whose retries wait on it ([`Broker::holds_retries`]).
    #[allow(dead_code)]
    pub fn holding() -> Memory {
        let m = Memory::default();
        m.holds.store(true, Ordering::SeqCst);
        m
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    fn push(&self, queue: &str, msg: Msg) {
        self.lock()
            .queues
            .entry(queue.to_owned())
            .or_default()
            .push_back(msg);
        self.ready.notify_waiters();
    }

    /// What the runtime told the ackers of `id`, in order.
    #[allow(dead_code)]
    pub fn told(&self, id: &str) -> Vec<&'static str> {
        let s = self.lock();
        s.told
            .iter()
            .filter(|(m, _)| m == id)
            .map(|(_, what)| *what)
            .collect()
    }

    /// How often the runtime kept `id` from redelivery while holding it.
    #[allow(dead_code)]
    pub fn progressed(&self, id: &str) -> usize {
        self.lock().progressed.iter().filter(|m| *m == id).count()
    }

    /// How often a consumer found its queue empty and began to wait.
    #[allow(dead_code)]
    pub fn empty_waits(&self) -> u64 {
        self.lock().empty_waits
    }

    /// Messages ready plus unacknowledged on `queue`.
    pub fn depth(&self, queue: &str) -> usize {
        let s = self.lock();
        s.queues.get(queue).map_or(0, VecDeque::len)
            + s.unacked.values().filter(|(q, _)| q == queue).count()
    }

    /// Puts a message as if a consumer had died with it `times` times.
    #[allow(dead_code)]
    pub fn produce_delivered(&self, queue: &str, id: &str, body: &[u8], times: u32) {
        let seq = self.seq();
        self.push(
            queue,
            Msg {
                id: id.into(),
                body: body.to_vec(),
                headers: Map::new(),
                deliveries: times,
                seq,
            },
        );
    }

    fn seq(&self) -> u64 {
        let mut s = self.lock();
        s.next += 1;
        s.next
    }
}

/// One connection: what it leaves unacknowledged goes back when dropped.
#[derive(Debug)]
struct Conn {
    broker: Memory,
    id: u64,
    spec: SourceSpec,
}

impl Drop for Conn {
    fn drop(&mut self) {
        let mut s = self.broker.lock();
        let mine: Vec<(u64, u64)> = s
            .unacked
            .keys()
            .filter(|(c, _)| *c == self.id)
            .copied()
            .collect();
        for key in mine {
            if let Some((q, msg)) = s.unacked.remove(&key) {
                s.queues.entry(q).or_default().push_front(msg);
            }
        }
        drop(s);
        self.broker.ready.notify_waiters();
    }
}

struct MemConsumer {
    conn: Arc<Conn>,
}

struct MemAck {
    conn: Arc<Conn>,
    tag: u64,
}

impl MemAck {
    fn tell(&self, what: &'static str) {
        let mut s = self.conn.broker.lock();
        if let Some((_, msg)) = s.unacked.get(&(self.conn.id, self.tag)) {
            let id = msg.id.clone();
            s.told.push((id, what));
        }
    }
}

impl Acker for MemAck {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            self.tell("ack");
            self.conn
                .broker
                .lock()
                .unacked
                .remove(&(self.conn.id, self.tag));
            Ok(())
        })
    }

    fn decided(&self) {
        self.tell("decided");
    }

    fn progress(&self) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let mut s = self.conn.broker.lock();
            if let Some((_, msg)) = s.unacked.get(&(self.conn.id, self.tag)) {
                let id = msg.id.clone();
                s.progressed.push(id);
            }
            Ok(())
        })
    }

    fn hold(self: Box<Self>, wait: Duration) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            let held = self
                .conn
                .broker
                .lock()
                .unacked
                .remove(&(self.conn.id, self.tag));
            if let Some((q, msg)) = held {
                let broker = self.conn.broker.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(wait).await;
                    broker.lock().queues.entry(q).or_default().push_front(msg);
                    broker.ready.notify_waiters();
                });
            }
            Ok(())
        })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            self.tell("release");
            let mut s = self.conn.broker.lock();
            if let Some((q, msg)) = s.unacked.remove(&(self.conn.id, self.tag)) {
                s.queues.entry(q).or_default().push_front(msg);
            }
            drop(s);
            self.conn.broker.ready.notify_waiters();
            Ok(())
        })
    }
}

impl Consumer for MemConsumer {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Incoming>, BrokerError>> {
        Box::pin(async move {
            let queue = self.conn.spec.queue.clone();
            loop {
                let notified = self.conn.broker.ready.notified();
                {
                    let mut s = self.conn.broker.lock();
                    if let Some(mut msg) = s.queues.get_mut(&queue).and_then(VecDeque::pop_front) {
                        msg.deliveries += 1;
                        s.next += 1;
                        let tag = s.next;
                        s.unacked
                            .insert((self.conn.id, tag), (queue.clone(), msg.clone()));
                        let delivery = Delivery {
                            message_id: msg.id.clone(),
                            body: msg.body.clone(),
                            content_type: Some("application/json".into()),
                            headers: msg.headers.clone(),
                            broker_prior: msg.deliveries - 1,
                            redelivered: msg.deliveries > 1,
                            queue: queue.clone(),
                            position: json!({"seq": msg.seq}),
                        };
                        return Ok(Some(Incoming {
                            delivery,
                            ack: Box::new(MemAck {
                                conn: Arc::clone(&self.conn),
                                tag,
                            }),
                        }));
                    }
                    s.empty_waits += 1;
                }
                tokio::select! {
                    _ = notified => {}
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        })
    }
}

/// A connection as a `Broker`.
#[derive(Debug)]
struct MemBroker {
    conn: Arc<Conn>,
}

impl Broker for MemBroker {
    fn kind(&self) -> &'static str {
        "memory"
    }

    fn holds_retries(&self) -> bool {
        self.conn.broker.holds.load(Ordering::SeqCst)
    }

    fn consume(&self) -> BoxFuture<'_, Result<Box<dyn Consumer>, BrokerError>> {
        Box::pin(async move {
            Ok(Box::new(MemConsumer {
                conn: Arc::clone(&self.conn),
            }) as Box<dyn Consumer>)
        })
    }

    fn publish(&self, msg: Republish) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let seq = self.conn.broker.seq();
            self.conn.broker.push(
                &msg.queue,
                Msg {
                    id: msg.message_id,
                    body: msg.body,
                    headers: msg.headers,
                    deliveries: 0,
                    seq,
                },
            );
            Ok(())
        })
    }

    fn interpret<'a>(&'a self, d: &'a Delivery) -> BoxFuture<'a, Result<TakenIn, BrokerError>> {
        Box::pin(async move {
            Ok(TakenIn {
                reason: Some(DeadLetterReason::Rejected),
                original_queue: d.header("original-queue"),
                attempts: 1,
                ..TakenIn::default()
            })
        })
    }
}

impl TestBroker for Memory {
    async fn fresh_queue(&self, prefix: &str) -> String {
        unique(prefix)
    }

    fn spec(&self, name: &str, queue: &str, mode: Mode) -> SourceSpec {
        let mut spec = SourceSpec::guard(name, BrokerKind::Redis, "memory://", queue, "orders");
        spec.mode = mode;
        spec.delivery_timeout = Duration::from_secs(5);
        spec
    }

    async fn produce(
        &self,
        queue: &str,
        message_id: &str,
        body: &[u8],
        headers: Map<String, Value>,
    ) {
        let seq = self.seq();
        self.push(
            queue,
            Msg {
                id: message_id.into(),
                body: body.to_vec(),
                headers,
                deliveries: 0,
                seq,
            },
        );
    }

    async fn broker_dead_letter(
        &self,
        prefix: &str,
        message_id: &str,
        body: &[u8],
    ) -> (String, String) {
        let dlq = unique(&format!("{prefix}-dlq"));
        let original = unique(prefix);
        let mut headers = Map::new();
        headers.insert("original-queue".into(), Value::String(original.clone()));
        self.produce(&dlq, message_id, body, headers).await;
        (dlq, original)
    }

    fn broker_reason(&self) -> DeadLetterReason {
        DeadLetterReason::Rejected
    }

    async fn take_one(&self, queue: &str, wait: Duration) -> Option<(Vec<u8>, Map<String, Value>)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if let Some(m) = self
                .lock()
                .queues
                .get_mut(queue)
                .and_then(VecDeque::pop_front)
            {
                return Some((m.body, m.headers));
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn connect(&self, spec: &SourceSpec) -> Arc<dyn Broker> {
        let id = self.seq();
        Arc::new(MemBroker {
            conn: Arc::new(Conn {
                broker: self.clone(),
                id,
                spec: spec.clone(),
            }),
        })
    }
}

async fn memory() -> Option<Memory> {
    Some(Memory::default())
}

crate::scenarios::scenario_suite!(crate::memory::memory());

mod runtime {
    //! What the runtime does whatever the broker: crash loops, breakers.

    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    use lazaret_core::{BreakerConfig, Breakers, DeadLetterReason, JobType};
    use lazaret_guard::{Faults, Host, LocalHost, Mode, Outcome};
    use lazaret_store::{Completed, Store as _};
    use serde_json::json;

    use lazaret_testkit::eventually;

    use super::Memory;
    use crate::common::*;

    /// A message whose consumers died with it `crash_loop_max` times is
    /// quarantined as `crash_loop` before it is delivered again.
    #[tokio::test]
    async fn a_message_that_kept_killing_its_consumers_is_quarantined_undelivered() {
        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("crashloop").await;
        let name = unique("crashloop");
        let spec = b.spec(&name, &queue, Mode::Guard);
        // The default crash_loop_max is 3: three earlier deliveries died.
        b.produce_delivered(&queue, "m-c", b"{}", 3);
        b.produce(&queue, "m-ok", b"{}", headers(json!({}))).await;
        let h = host(
            dir.path(),
            policies("orders", 10, Duration::from_millis(100)),
        );
        let log = Log::default();
        let g = start_guard(
            &b,
            spec,
            Arc::clone(&h),
            recording(&log, |_| Outcome::Success),
            Faults::default(),
        )
        .await;
        let dls = wait_dead_letters(h.store(), &name, 1, Duration::from_secs(10)).await;
        log.wait_for(Duration::from_secs(10), |s| {
            s.iter().any(|x| x.message_id == "m-ok")
        })
        .await;
        assert_eq!(dls[0].reason, DeadLetterReason::CrashLoop);
        assert_eq!(dls[0].attempts, 3);
        assert!(
            log.all().iter().all(|s| s.message_id != "m-c"),
            "it was delivered"
        );
        g.stop().await.unwrap();
        assert_eq!(b.depth(&queue), 0);
    }

    /// Runs a guard on `STORM` messages that all fail permanently through
    /// `handler`, with `linger`; returns the fsyncs and the store commands
    /// (transactions' parts) it took.
    async fn poison_storm<F, Fut>(linger: Duration, handler: F) -> (u64, u64)
    where
        F: Fn(u64) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("storm").await;
        let name = unique("storm");
        let spec = b.spec(&name, &queue, Mode::Guard);
        for i in 0..STORM {
            b.produce(&queue, &format!("m-{i}"), b"{}", headers(json!({})))
                .await;
        }
        let h = host(
            dir.path(),
            policies("orders", 10, Duration::from_millis(100)),
        );
        let handler = Arc::new(lazaret_guard::handler_fn(move |call| {
            let i: u64 = call.delivery.message_id[2..].parse().unwrap();
            let wait = handler(i);
            async move {
                wait.await;
                Outcome::Failure(
                    lazaret_core::Failure::new("http_400", "poison")
                        .with_class(lazaret_core::FailureClass::Permanent),
                )
            }
        }));
        let before = h.store().stats().await.unwrap().group_commit.unwrap();
        let broker = b.connect(&spec).await;
        let (stop, rx) = tokio::sync::watch::channel(false);
        let guard = lazaret_guard::Guard::new(spec, Arc::clone(&h), broker, handler)
            .with_quarantine_linger(linger);
        let task = tokio::spawn(guard.run(rx));
        let dls = wait_dead_letters(h.store(), &name, STORM, Duration::from_secs(20)).await;
        let _ = stop.send(true);
        task.await.unwrap().unwrap();
        assert_eq!(dls.len(), STORM);
        assert!(
            dls.iter().all(|d| d.reason == DeadLetterReason::Permanent),
            "{dls:#?}"
        );
        assert_eq!(b.depth(&queue), 0, "every poison message was acknowledged");
        let after = h.store().stats().await.unwrap().group_commit.unwrap();
        (after.syncs - before.syncs, after.commands - before.commands)
    }

    const STORM: usize = 8;

    /// Dead letters that arrive within the linger share one transaction and
    /// one fsync: a poison storm costs the store far less than one durable
    /// write per message.
    #[tokio::test]
    async fn dead_letters_arriving_within_the_linger_share_one_durable_write() {
        // The handler calls fail 15 ms apart: alone, each would be its own
        // transaction and fsync. The first is written at once (no storm
        // yet); the second starts the storm's linger, far longer than the
        // other failures take to arrive (~90 ms), so the batch does not
        // depend on the machine's speed.
        let (syncs, commands) = poison_storm(Duration::from_millis(500), |i| {
            tokio::time::sleep(Duration::from_millis(15 * i))
        })
        .await;
        // Two quarantine writes (the first alone, the other seven
        // together), and at most one store command that is not a dead
        // letter's (before storms lingered, all eight shared one write and
        // this took 1–2).
        assert!(
            (2..=3).contains(&syncs),
            "{STORM} dead letters written together took {syncs} fsyncs ({commands} commands)"
        );
    }

    /// Without a linger, the dead letters that arrive while one is written
    /// share the next write: on this single-threaded runtime all of them
    /// are queued before the write task first runs.
    #[tokio::test]
    async fn dead_letters_arriving_during_a_write_share_the_next_one() {
        let together = Arc::new(tokio::sync::Barrier::new(STORM));
        let (syncs, commands) = poison_storm(Duration::ZERO, move |_| {
            let together = Arc::clone(&together);
            async move {
                together.wait().await;
            }
        })
        .await;
        assert!(
            (1..=2).contains(&syncs),
            "{STORM} dead letters failing at once took {syncs} fsyncs"
        );
        assert!(
            commands < STORM as u64,
            "{STORM} dead letters took {commands} store commands: not batched"
        );
    }

    /// A storm's linger ends once half the window's slots are taken: the
    /// messages behind a lingering dead letter keep theirs until its write
    /// ends, so lingering on would stall the consumer. With two settling
    /// slots, each lingering dead letter's wait ends when the next
    /// message (poison or healthy) takes the last slot: a storm with a
    /// linger of a minute is written well inside the 20 s waited here.
    #[tokio::test]
    async fn a_storms_linger_ends_when_half_the_window_is_taken() {
        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("full").await;
        let name = unique("full");
        let mut spec = b.spec(&name, &queue, Mode::Guard);
        spec.settling = Some(2);
        // Poison first, then healthy messages whose slots end the last
        // dead letter's linger; each call ends 15 ms after the one before.
        let ids: Vec<String> = (0..STORM)
            .map(|i| format!("p-{i}"))
            .chain((0..4).map(|i| format!("h-{i}")))
            .collect();
        for id in &ids {
            b.produce(&queue, id, b"{}", headers(json!({}))).await;
        }
        let h = host(
            dir.path(),
            policies("orders", 10, Duration::from_millis(100)),
        );
        let order: std::collections::HashMap<String, u64> = ids.iter().cloned().zip(0..).collect();
        let handler = Arc::new(lazaret_guard::handler_fn(move |call| {
            let id = call.delivery.message_id.clone();
            let at = Duration::from_millis(15 * order[&id]);
            async move {
                tokio::time::sleep(at).await;
                if id.starts_with('p') {
                    Outcome::Failure(
                        lazaret_core::Failure::new("http_400", "poison")
                            .with_class(lazaret_core::FailureClass::Permanent),
                    )
                } else {
                    Outcome::Success
                }
            }
        }));
        let broker = b.connect(&spec).await;
        let (stop, rx) = tokio::sync::watch::channel(false);
        let guard = lazaret_guard::Guard::new(spec, Arc::clone(&h), broker, handler)
            .with_quarantine_linger(Duration::from_secs(60));
        let task = tokio::spawn(guard.run(rx));
        let dls = wait_dead_letters(h.store(), &name, STORM, Duration::from_secs(20)).await;
        let _ = stop.send(true);
        task.await.unwrap().unwrap();
        assert_eq!(dls.len(), STORM);
    }

    /// A lone dead letter is not kept waiting for company: the linger is
    /// for storms (a batch taken within the last second), and a guard's
    /// first dead letter is written at once even with a linger of a
    /// minute.
    #[tokio::test]
    async fn a_lone_dead_letter_is_written_without_the_storms_linger() {
        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("lone").await;
        let name = unique("lone");
        let spec = b.spec(&name, &queue, Mode::Guard);
        b.produce(&queue, "m-0", b"{}", headers(json!({}))).await;
        let h = host(
            dir.path(),
            policies("orders", 10, Duration::from_millis(100)),
        );
        let handler = Arc::new(lazaret_guard::handler_fn(|_| async {
            Outcome::Failure(
                lazaret_core::Failure::new("http_400", "poison")
                    .with_class(lazaret_core::FailureClass::Permanent),
            )
        }));
        let broker = b.connect(&spec).await;
        let (stop, rx) = tokio::sync::watch::channel(false);
        let guard = lazaret_guard::Guard::new(spec, Arc::clone(&h), broker, handler)
            .with_quarantine_linger(Duration::from_secs(60));
        let task = tokio::spawn(guard.run(rx));
        // Well inside the minute the linger would have taken.
        let dls = wait_dead_letters(h.store(), &name, 1, Duration::from_secs(20)).await;
        let _ = stop.send(true);
        task.await.unwrap().unwrap();
        assert_eq!(dls.len(), 1);
        assert_eq!(b.depth(&queue), 0, "acknowledged");
    }

    /// The broker hears that a dead letter's outcome is decided before its
    /// acknowledgement (RabbitMQ then lets the acks above it wait for it);
    /// a success is only acknowledged.
    #[tokio::test]
    async fn the_acker_hears_a_dead_letter_is_decided_before_its_ack() {
        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("decided").await;
        let name = unique("decided");
        let spec = b.spec(&name, &queue, Mode::Guard);
        b.produce(&queue, "m-bad", b"{}", headers(json!({}))).await;
        b.produce(&queue, "m-ok", b"{}", headers(json!({}))).await;
        let h = host(
            dir.path(),
            policies("orders", 10, Duration::from_millis(100)),
        );
        let (faults, settled) = settled_log();
        let handler = lazaret_guard::handler_fn(|call| {
            let bad = call.delivery.message_id == "m-bad";
            async move {
                if bad {
                    Outcome::Failure(
                        lazaret_core::Failure::new("http_400", "poison")
                            .with_class(lazaret_core::FailureClass::Permanent),
                    )
                } else {
                    Outcome::Success
                }
            }
        });
        let g = start_guard(&b, spec, Arc::clone(&h), Arc::new(handler), faults).await;
        wait_settled(
            &settled,
            "m-bad",
            lazaret_guard::Settled::Quarantined,
            Duration::from_secs(10),
        )
        .await;
        wait_settled(
            &settled,
            "m-ok",
            lazaret_guard::Settled::Succeeded,
            Duration::from_secs(10),
        )
        .await;
        g.stop().await.unwrap();
        assert_eq!(b.told("m-bad"), vec!["decided", "ack"]);
        assert_eq!(b.told("m-ok"), vec!["ack"]);
    }

    /// On a broker that holds retries itself, a deferral and a retry wait
    /// on the broker, not in the store: the message comes back from the
    /// broker with the envelope lazaret recorded, the deferral spends no
    /// attempt, and the receives lazaret caused count as no crash.
    #[tokio::test]
    async fn a_retry_held_on_the_broker_resumes_its_envelope() {
        let b = Memory::holding();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("holding").await;
        let name = unique("holding");
        let spec = b.spec(&name, &queue, Mode::Guard);
        b.produce(&queue, "m-h", b"{}", headers(json!({}))).await;
        let h = host(dir.path(), policies("orders", 3, Duration::from_millis(50)));
        let log = Log::default();
        let calls = Arc::new(std::sync::Mutex::new(0u32));
        let c = Arc::clone(&calls);
        let g = start_guard(
            &b,
            spec,
            Arc::clone(&h),
            recording(&log, move |_| {
                let mut n = c.lock().unwrap();
                *n += 1;
                match *n {
                    1 => Outcome::Failure(
                        lazaret_core::Failure::new("http_429", "slow down")
                            .with_class(lazaret_core::FailureClass::Deferred)
                            .with_retry_after(Duration::from_millis(100)),
                    ),
                    _ => Outcome::Failure(
                        lazaret_core::Failure::new("http_503", "busy")
                            .with_class(lazaret_core::FailureClass::Transient),
                    ),
                }
            }),
            Faults::default(),
        )
        .await;
        // Deferred, then transient failures until attempts_max = 3 is
        // spent: quarantined as exhausted after attempt 3. Had a receive
        // lazaret caused been charged (as a crash), the attempts would run
        // ahead of the deliveries.
        let dls = wait_dead_letters(h.store(), &name, 1, Duration::from_secs(10)).await;
        let seen = log.all();
        assert_eq!(
            seen.iter().map(|s| s.attempt).collect::<Vec<_>>(),
            vec![1, 1, 2, 3],
            "{seen:#?}"
        );
        assert_eq!(dls[0].reason, DeadLetterReason::Exhausted);
        assert_eq!(dls[0].attempts, 3);
        g.stop().await.unwrap();
        assert_eq!(b.depth(&queue), 0, "acknowledged after the quarantine");
    }

    /// A host that notes what it is told, around a [`LocalHost`].
    struct Noting {
        inner: Arc<LocalHost<lazaret_store::SqliteStore>>,
        /// ("observe" or "recorded", the dead letter it named).
        told: std::sync::Mutex<Vec<(&'static str, Option<lazaret_store::DeadLetterId>)>>,
    }

    impl Host for Noting {
        type Store = lazaret_store::SqliteStore;

        fn store(&self) -> &Self::Store {
            self.inner.store()
        }

        fn policy(&self, ty: &JobType) -> lazaret_core::TypePolicy {
            self.inner.policy(ty)
        }

        fn try_deliver(
            &self,
            ty: &JobType,
            lane: &lazaret_core::Lane,
            now: lazaret_core::Timestamp,
        ) -> Result<(), Duration> {
            self.inner.try_deliver(ty, lane, now)
        }

        fn observe(&self, source: &str, done: &Completed, now: lazaret_core::Timestamp) {
            self.told
                .lock()
                .unwrap()
                .push(("observe", done.dead_letter));
            self.inner.observe(source, done, now);
        }

        fn recorded(&self, _source: &str, done: &Completed, _now: lazaret_core::Timestamp) {
            self.told
                .lock()
                .unwrap()
                .push(("recorded", done.dead_letter));
        }
    }

    /// The host observes an outcome before lazaret writes it (the breakers
    /// must know before the handler slot is free) and is told again once
    /// the write is durable, with the dead letter's id.
    #[tokio::test]
    async fn the_host_observes_an_outcome_before_its_write_and_hears_when_it_is_written() {
        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("noting").await;
        let name = unique("noting");
        let spec = b.spec(&name, &queue, Mode::Guard);
        b.produce(&queue, "m-n", b"{}", headers(json!({}))).await;
        let h = Arc::new(Noting {
            inner: host(dir.path(), policies("orders", 3, Duration::from_millis(50))),
            told: std::sync::Mutex::default(),
        });
        let (faults, settled) = settled_log();
        let handler = lazaret_guard::handler_fn(|_| async {
            Outcome::Failure(
                lazaret_core::Failure::new("http_400", "bad")
                    .with_class(lazaret_core::FailureClass::Permanent),
            )
        });
        let g = start_guard(&b, spec, Arc::clone(&h), Arc::new(handler), faults).await;
        wait_settled(
            &settled,
            "m-n",
            lazaret_guard::Settled::Quarantined,
            Duration::from_secs(10),
        )
        .await;
        g.stop().await.unwrap();
        let dls = dead_letters_of(h.store(), &name).await;
        assert_eq!(dls.len(), 1);
        assert_eq!(
            *h.told.lock().unwrap(),
            vec![("observe", None), ("recorded", Some(dls[0].id))]
        );
    }

    /// A host whose `orders` breaker opens after 3 failures and stays open
    /// for a minute.
    fn breaker_host(dir: &std::path::Path) -> Arc<LocalHost<lazaret_store::SqliteStore>> {
        let mut per_type = BTreeMap::new();
        per_type.insert(
            JobType::from("orders"),
            BreakerConfig {
                failures_min: 3,
                failure_ratio: 0.5,
                window: Duration::from_secs(30),
                cooldown: Duration::from_secs(60),
                probes: 1,
            },
        );
        Arc::new(LocalHost::new(
            open_store(dir),
            policies("orders", 10, Duration::from_secs(30)),
            Breakers::new(None, per_type),
        ))
    }

    /// A [`LocalHost`] that counts the takes its gate refused (a parked
    /// type or lane: the breaker open, a pause), so a test can wait until
    /// the source looked and declined instead of for a fixed time.
    struct Gated {
        inner: Arc<LocalHost<lazaret_store::SqliteStore>>,
        refused: std::sync::atomic::AtomicU64,
    }

    impl Gated {
        fn new(inner: Arc<LocalHost<lazaret_store::SqliteStore>>) -> Arc<Gated> {
            Arc::new(Gated {
                inner,
                refused: std::sync::atomic::AtomicU64::new(0),
            })
        }

        /// Takes refused so far.
        fn refused(&self) -> u64 {
            self.refused.load(std::sync::atomic::Ordering::SeqCst)
        }
    }

    impl Host for Gated {
        type Store = lazaret_store::SqliteStore;

        fn store(&self) -> &Self::Store {
            self.inner.store()
        }

        fn policy(&self, ty: &JobType) -> lazaret_core::TypePolicy {
            self.inner.policy(ty)
        }

        fn try_deliver(
            &self,
            ty: &JobType,
            lane: &lazaret_core::Lane,
            now: lazaret_core::Timestamp,
        ) -> Result<(), Duration> {
            let open = self.inner.try_deliver(ty, lane, now);
            if open.is_err() {
                self.refused
                    .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
            open
        }

        fn held_back(
            &self,
            ty: &JobType,
            lane: &lazaret_core::Lane,
            now: lazaret_core::Timestamp,
        ) -> Option<Duration> {
            self.inner.held_back(ty, lane, now)
        }

        fn observe(&self, source: &str, done: &Completed, now: lazaret_core::Timestamp) {
            self.inner.observe(source, done, now);
        }

        fn recorded(&self, source: &str, done: &Completed, now: lazaret_core::Timestamp) {
            self.inner.recorded(source, done, now);
        }

        fn store_writes(&self) -> Option<&lazaret_guard::StoreWrites> {
            self.inner.store_writes()
        }
    }

    /// While the type's breaker is open the source takes nothing from the
    /// broker: the messages wait there, spending no attempt.
    #[tokio::test]
    async fn an_open_breaker_stops_the_source_taking_messages() {
        breaker_stops_taking_after_three_failures(None).await;
    }

    /// A delivery that gives its handler slot back before its write and
    /// acknowledgement (a settling allowance) has fed the breakers first:
    /// the failure that opens the breaker stops the next take, with no
    /// delivery beyond the breaker's threshold.
    #[tokio::test]
    async fn with_a_settling_allowance_the_breaker_still_stops_at_its_threshold() {
        breaker_stops_taking_after_three_failures(Some(4)).await;
    }

    /// Ten messages, one at a time, each failing transiently: the breaker
    /// (three failures) opens on the third and the other seven stay on the
    /// broker.
    async fn breaker_stops_taking_after_three_failures(settling: Option<u32>) {
        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("breaker").await;
        let name = unique("breaker");
        let mut spec = b.spec(&name, &queue, Mode::Guard);
        spec.concurrency = 1;
        spec.settling = settling;
        for i in 0..10 {
            b.produce(&queue, &format!("m-{i}"), b"{}", headers(json!({})))
                .await;
        }
        let h = Gated::new(breaker_host(dir.path()));
        let log = Log::default();
        let g = start_guard(
            &b,
            spec,
            Arc::clone(&h),
            recording(&log, |_| {
                Outcome::Failure(
                    lazaret_core::Failure::new("http_503", "down")
                        .with_class(lazaret_core::FailureClass::Transient),
                )
            }),
            Faults::default(),
        )
        .await;
        log.wait_for(Duration::from_secs(10), |s| s.len() >= 3)
            .await;
        // The source went past the third message: its gate looked for the
        // next take and refused it (the breaker was closed until then).
        eventually("the gate refused a take", || async { h.refused() >= 1 }).await;
        eventually("the third message acknowledged", || async {
            b.depth(&queue) <= 7
        })
        .await;
        assert_eq!(log.all().len(), 3, "delivered while the breaker was open");
        assert_eq!(
            b.depth(&queue),
            7,
            "the broker keeps what lazaret does not take"
        );
        g.stop().await.unwrap();
    }

    /// A breaker that opens while the source waits on the broker holds the
    /// message it then gets: it is not delivered until the breaker lets it.
    #[tokio::test]
    async fn a_breaker_that_opens_while_the_source_waits_holds_the_next_message() {
        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("late-breaker").await;
        let name = unique("late-breaker");
        let spec = b.spec(&name, &queue, Mode::Guard);
        let ty = JobType::from("orders");
        let h = breaker_host(dir.path());
        let log = Log::default();
        let g = start_guard(
            &b,
            spec,
            Arc::clone(&h),
            recording(&log, |_| Outcome::Success),
            Faults::default(),
        )
        .await;
        // The source is waiting on an empty queue; the breaker opens.
        eventually("the source waits on the broker", || async {
            b.empty_waits() >= 1
        })
        .await;
        let now = lazaret_guard::guard::now();
        h.with_breakers(|br| {
            for _ in 0..3 {
                br.record_failure(&ty, &lazaret_core::ErrorKind::from("http_503"), now);
            }
            assert!(br.parked_until(&ty, now).is_some(), "the breaker opened");
        });
        b.produce(&queue, "m-late", b"{}", headers(json!({}))).await;
        // The source took it and holds it: it keeps a message from
        // redelivery only in the wait before delivering, which lasts while
        // the breaker is open (a minute).
        eventually("m-late held by the source", || async {
            b.progressed("m-late") >= 1
        })
        .await;
        assert!(log.all().is_empty(), "delivered while the breaker was open");
        assert_eq!(b.depth(&queue), 1, "held unacknowledged");
        g.stop().await.unwrap();
    }

    /// The store refuses writes (a full disk): the poison's outcome is kept
    /// and its write tried again after growing delays, the message held
    /// (never handed back), nothing new taken; once the store writes
    /// again, the dead letter carries the handler's answer and the rest
    /// flows.
    #[tokio::test]
    async fn a_refused_write_keeps_the_outcome_holds_the_message_and_takes_nothing_new() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::Instant;

        use lazaret_guard::host::store_retry_delay;
        use lazaret_store::StoreError;

        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("full").await;
        let name = unique("full");
        let mut spec = b.spec(&name, &queue, Mode::Guard);
        spec.concurrency = 1;
        b.produce(&queue, "m-poison", b"{}", headers(json!({})))
            .await;
        for i in 1..=3 {
            b.produce(&queue, &format!("m-{i}"), b"{}", headers(json!({})))
                .await;
        }
        let h = host(dir.path(), policies("orders", 3, Duration::from_millis(50)));
        let full = Arc::new(AtomicBool::new(true));
        let tries: Arc<std::sync::Mutex<Vec<Instant>>> = Arc::default();
        let faults = Faults {
            refuse_write: Some({
                let (full, tries) = (Arc::clone(&full), Arc::clone(&tries));
                Arc::new(move |_| {
                    tries.lock().unwrap().push(Instant::now());
                    full.load(Ordering::SeqCst).then(|| {
                        StoreError::NotApplied(
                            "the commit failed (database or disk is full)".into(),
                        )
                    })
                })
            }),
            ..Faults::default()
        };
        let log = Log::default();
        let g = start_guard(
            &b,
            spec,
            Arc::clone(&h),
            recording(&log, |s| {
                if s.message_id == "m-poison" {
                    Outcome::Failure(
                        lazaret_core::Failure::new("http_400", "no amount")
                            .with_class(lazaret_core::FailureClass::Permanent),
                    )
                } else {
                    Outcome::Success
                }
            }),
            faults,
        )
        .await;
        // Five tries of the write: four waits between them.
        let deadline = Instant::now() + Duration::from_secs(30);
        while tries.lock().unwrap().len() < 5 {
            assert!(Instant::now() < deadline, "the write was not tried again");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let why = h.store_writes().and_then(|w| w.refusal());
        assert!(
            why.as_deref().is_some_and(|w| w.contains("not writable")),
            "{why:?}"
        );
        // Each wait at least as long as the schedule says: growing.
        let at = tries.lock().unwrap().clone();
        for (n, pair) in at.windows(2).take(4).enumerate() {
            let waited = pair[1] - pair[0];
            assert!(
                waited >= store_retry_delay(n as u32),
                "wait {n} was {waited:?}, less than {:?}",
                store_retry_delay(n as u32)
            );
        }
        let seen = log.all();
        assert_eq!(
            seen.iter().filter(|s| s.message_id == "m-poison").count(),
            1,
            "the handler is not asked again: {seen:?}"
        );
        // A healthy message taken in the instant before the refusal was
        // known may pass (it needs no write); no more.
        assert!(seen.len() <= 2, "taken while the store refused: {seen:?}");
        assert!(
            !b.told("m-poison").contains(&"release"),
            "handed back: {:?}",
            b.told("m-poison")
        );

        // The disk has room again.
        full.store(false, Ordering::SeqCst);
        let dls = wait_dead_letters(h.store(), &name, 1, Duration::from_secs(30)).await;
        assert_eq!(dls[0].reason, DeadLetterReason::Permanent);
        assert_eq!(dls[0].attempts, 1);
        assert_eq!(
            dls[0].error.as_ref().map(|e| e.kind.as_str()),
            Some("http_400")
        );
        log.wait_for(Duration::from_secs(10), |s| {
            (1..=3).all(|i| s.iter().any(|x| x.message_id == format!("m-{i}")))
        })
        .await;
        assert_eq!(h.store_writes().and_then(|w| w.refusal()), None);
        assert_eq!(b.told("m-poison"), vec!["decided", "ack"]);
        assert_eq!(log.all().len(), 4, "each delivered once: {:?}", log.all());
        g.stop().await.unwrap();
        assert_eq!(b.depth(&queue), 0);
    }

    /// A message lazaret handed back itself (its outcome could not be
    /// written: here the store was closed under it) comes back with the
    /// broker's count one higher; that delivery is no crash: the handler
    /// gets attempt 1 again, and the dead letter has no lease expiry.
    #[tokio::test]
    async fn a_hand_back_lazaret_caused_is_not_charged_as_a_crash() {
        use std::sync::atomic::{AtomicU32, Ordering};

        use lazaret_store::StoreError;

        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("handback").await;
        let name = unique("handback");
        let spec = b.spec(&name, &queue, Mode::Guard);
        b.produce(&queue, "m-h", b"{}", headers(json!({}))).await;
        // One crash would be a crash loop.
        let mut p = policies("orders", 5, Duration::from_millis(50));
        for t in p.types.values_mut() {
            t.crash_loop_max = 1;
        }
        let h = host(dir.path(), p);
        let writes = Arc::new(AtomicU32::new(0));
        let faults = Faults {
            refuse_write: Some({
                let writes = Arc::clone(&writes);
                Arc::new(move |_| {
                    (writes.fetch_add(1, Ordering::SeqCst) == 0).then_some(StoreError::Closed)
                })
            }),
            ..Faults::default()
        };
        let log = Log::default();
        let g = start_guard(
            &b,
            spec,
            Arc::clone(&h),
            recording(&log, |_| {
                Outcome::Failure(
                    lazaret_core::Failure::new("http_400", "no amount")
                        .with_class(lazaret_core::FailureClass::Permanent),
                )
            }),
            faults,
        )
        .await;
        let dls = wait_dead_letters(h.store(), &name, 1, Duration::from_secs(10)).await;
        assert!(b.told("m-h").contains(&"release"), "{:?}", b.told("m-h"));
        assert_eq!(
            log.all().iter().map(|s| s.attempt).collect::<Vec<_>>(),
            vec![1, 1],
            "the hand-back spent no attempt"
        );
        assert_eq!(dls[0].reason, DeadLetterReason::Permanent, "not crash_loop");
        assert_eq!(dls[0].attempts, 1);
        assert_eq!(dls[0].history.len(), 1, "{:?}", dls[0].history);
        assert!(
            dls[0].history[0].worker_id.is_some(),
            "the handler's attempt, not a lease expiry: {:?}",
            dls[0].history
        );
        g.stop().await.unwrap();
    }

    /// A held retry claimed by a node that died (its claim expired, no
    /// outcome written) is charged a crash when another node claims it,
    /// as a broker's redelivery after a dead consumer is: with
    /// `crash_loop_max = 1` it is quarantined `crash_loop` undelivered;
    /// with 3 it is delivered, as attempt 3 (the dead node's call was
    /// attempt 2). Before, it came back as attempt 2 however many nodes it
    /// had killed.
    #[tokio::test]
    async fn a_held_retry_whose_claimer_died_is_charged_a_crash() {
        use lazaret_core::{Failure, FailureClass, Timestamp};

        for (crash_loop_max, quarantined) in [(1, true), (3, false)] {
            let b = Memory::default();
            let dir = tempfile::tempdir().unwrap();
            let queue = b.fresh_queue("lapsed").await;
            let name = unique("lapsed");
            let spec = b.spec(&name, &queue, Mode::Guard);
            b.produce(&queue, "m-l", b"{}", headers(json!({}))).await;
            let mut p = policies("orders", 10, Duration::from_millis(300));
            for t in p.types.values_mut() {
                t.crash_loop_max = crash_loop_max;
            }
            let h = host(dir.path(), p);
            let log = Log::default();
            let handler = || {
                recording(&log, |s| {
                    if s.attempt == 1 {
                        Outcome::Failure(
                            Failure::new("http_503", "down").with_class(FailureClass::Transient),
                        )
                    } else {
                        Outcome::Success
                    }
                })
            };
            let g = start_guard(
                &b,
                spec.clone(),
                Arc::clone(&h),
                handler(),
                Faults::default(),
            )
            .await;
            log.wait_for(Duration::from_secs(10), |s| s.len() == 1)
                .await;
            while h
                .store()
                .next_held_retry_due(name.clone())
                .await
                .unwrap()
                .is_none()
            {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            g.stop().await.unwrap();
            // Another node claimed it and died: its claim has run out.
            let wall = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_millis() as i64;
            let ghost = h
                .store()
                .claim_held_retries(
                    name.clone(),
                    Timestamp::from_millis(wall + 10_000),
                    10,
                    "ghost@pid1".into(),
                    Timestamp::from_millis(wall),
                )
                .await
                .unwrap();
            assert_eq!(ghost.len(), 1, "the ghost held it");
            let g = start_guard(&b, spec, Arc::clone(&h), handler(), Faults::default()).await;
            if quarantined {
                let dls = wait_dead_letters(h.store(), &name, 1, Duration::from_secs(10)).await;
                assert_eq!(dls[0].reason, DeadLetterReason::CrashLoop);
                assert_eq!(log.all().len(), 1, "not delivered again: {:?}", log.all());
            } else {
                let seen = log
                    .wait_for(Duration::from_secs(10), |s| s.len() == 2)
                    .await;
                assert_eq!(
                    seen.iter().map(|s| s.attempt).collect::<Vec<_>>(),
                    vec![1, 3],
                    "the dead node's attempt 2 was charged"
                );
                assert!(dead_letters_of(h.store(), &name).await.is_empty());
            }
            g.stop().await.unwrap();
        }
    }

    /// A watch source whose quarantine the store refuses holds the broker's
    /// dead letter and tries again later, never handing it back at once
    /// (which made the broker hand it straight back, in a loop).
    #[tokio::test]
    async fn a_watch_source_holds_a_dead_letter_the_store_refuses() {
        use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

        use lazaret_store::StoreError;

        let b = Memory::default();
        let dir = tempfile::tempdir().unwrap();
        let queue = b.fresh_queue("watchfull").await;
        let name = unique("watchfull");
        let spec = b.spec(&name, &queue, Mode::Watch);
        b.produce(&queue, "m-w", b"{}", headers(json!({}))).await;
        let h = host(dir.path(), policies("orders", 3, Duration::from_millis(50)));
        let full = Arc::new(AtomicBool::new(true));
        let tries = Arc::new(AtomicU32::new(0));
        let faults = Faults {
            refuse_write: Some({
                let (full, tries) = (Arc::clone(&full), Arc::clone(&tries));
                Arc::new(move |_| {
                    tries.fetch_add(1, Ordering::SeqCst);
                    full.load(Ordering::SeqCst)
                        .then(|| StoreError::NotApplied("database or disk is full".into()))
                })
            }),
            ..Faults::default()
        };
        let w = start_watch_on(&b, spec, Arc::clone(&h), faults).await;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while tries.load(Ordering::SeqCst) < 4 {
            assert!(std::time::Instant::now() < deadline, "not tried again");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(b.told("m-w").is_empty(), "{:?}", b.told("m-w"));
        assert!(h.store_writes().and_then(|w| w.refusal()).is_some());
        full.store(false, Ordering::SeqCst);
        let dls = wait_dead_letters(h.store(), &name, 1, Duration::from_secs(30)).await;
        assert_eq!(dls.len(), 1);
        assert_eq!(b.told("m-w"), vec!["ack"]);
        assert_eq!(h.store_writes().and_then(|w| w.refusal()), None);
        w.stop().await.unwrap();
    }
}
