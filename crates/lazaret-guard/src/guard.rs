//! Guard mode: consume a broker's queue, deliver each message to the
//! handler, let `lazaret-core` decide, and carry the decision out on the
//! broker.
//!
//! The order of writes is the whole point:
//! - **success** → acknowledge;
//! - **retry or deferral** → hold the message in lazaret's store until it
//!   is due (`hold_retry`), *then* acknowledge: the wait holds up nothing
//!   behind it on the broker and survives a restart; when due, the runtime
//!   delivers it again from the store with its envelope (attempts, history);
//! - **dead letter** → quarantine (`quarantine_message`), *then*
//!   acknowledge. A crash between the write and the acknowledgement makes
//!   the broker redeliver; the redelivery is recognised
//!   (`message_held`) and only acknowledged, so there is exactly one dead
//!   letter (or one held retry).
//!
//! A delivery holds one of `concurrency` handler slots until its outcome is
//! decided and the host has observed it (so a breaker that this outcome
//! opens stops the next take); its write and acknowledgement then hold one
//! of [`SourceSpec::settling_max`] settling slots instead (15 ×
//! `concurrency` by default, `settling` in the config; with none, the
//! handler slot is held until the message is settled).
//!
//! A broker whose retries must wait on the broker itself (SQS FIFO: a failed
//! message keeps holding its group, [`Broker::holds_retries`]) is held
//! there instead of acknowledged; the store records what lazaret charged,
//! and the redelivery is resumed from that record (a receive lazaret caused
//! is neither a crash nor, for a deferral, an attempt).
//!
//! While the type's breaker is open or the type or lane is paused, the
//! runtime takes no message from the broker (the broker keeps them) and
//! delivers no held retry.
//!
//! While the store refuses writes (a full disk; [`StoreWrites`]) the same
//! gate is closed, and a message whose outcome could not be written keeps
//! it: the write is tried again after a growing delay
//! ([`store_retry_delay`]) while the message stays unacknowledged (kept
//! from redelivery by in-progress acks where the broker needs them), so
//! the handler is never asked again for an answer it gave and the broker
//! never spins it. Only a source that stops hands such a message back,
//! and counts it ([`Host::given_back`]).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lazaret_core::{
    Envelope, Event, Failure, FailureClass, JobId, SplitMix64, TenantId, Timestamp, Transition,
    TypePolicy, WorkerId, absorb_earlier_deliveries, bounded_name, decide, grant_lease,
};
use lazaret_store::{
    Completed, DeadLetterId, Held, HeldRetry, MessageKey, Quarantined, SourceDeadLetter, SourceRef,
    Stage, Store, StoreError,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot, watch};

use crate::broker::{Acker, Broker, BrokerError, Incoming, Reconnecting};
use crate::handler::{Call, Handler, Outcome};
use crate::host::{Host, StoreWrites, store_retry_delay};
use crate::message::Delivery;
use crate::quarantines::{QUARANTINE_LINGER, Quarantines};
use crate::redrive::redrive_id;
use crate::spec::{SourceSpec, TenantFrom};
use tracing::Instrument;

/// The wall clock, read by the runtime only (the core gets `now`).
pub fn now() -> Timestamp {
    Timestamp::from_millis(millis(since_epoch()))
}

/// The wall clock rounded up to the next whole millisecond: the time an
/// outcome is decided at. Its retry, due a backoff later, is then never
/// early when the runtime compares the due time with a [`now`] rounded
/// down, nor is a hold of `due - now()` short.
fn now_rounded_up() -> Timestamp {
    Timestamp::from_millis(millis_up(since_epoch()))
}

fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// Whole milliseconds in `d`, rounded down.
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Whole milliseconds in `d`, rounded up.
fn millis_up(d: Duration) -> i64 {
    millis(d + Duration::from_nanos(999_999))
}

/// Held retries taken from the store per look.
const DUE_BATCH: u32 = 256;
/// The longest a held retry waits past its due time for the next look.
const DUE_POLL: Duration = Duration::from_millis(100);
/// A held retry is claimed in the store for the node delivering it for the
/// source's `delivery_timeout_ms` plus this margin (the outcome's write,
/// and the wait for the source's gate): other nodes on the same store take
/// it only once that claim expired (its node died, or could not write the
/// outcome). A delivery whose gate wait ate into the margin is left for
/// the next look instead of started late.
const CLAIM_MARGIN: Duration = Duration::from_secs(10);

/// The key of a held retry's position that makes it a trace of a message
/// settled already (its value: when, in milliseconds since the epoch): a
/// held retry that finished while its broker may still hand the message out
/// again ([`Broker::may_come_again`]: a Kafka record whose offset is not
/// committed yet) stays in the store as such a trace, never delivered, so
/// that a redelivery is recognised (`message_held`) and only acknowledged.
/// Looked at again every [`TRACE_RECHECK`] and dropped once the broker will
/// not hand it out again, or after [`TRACE_KEEP`].
const SETTLED_AT: &str = "lazaret_settled_at";
/// How often a trace of a settled message is looked at again.
const TRACE_RECHECK: Duration = Duration::from_secs(1);
/// The longest a trace is kept: a topic created again or a group's offsets
/// reset never pass its offset.
const TRACE_KEEP: Duration = Duration::from_secs(3600);

/// Decides, for a message, whether an injected crash happens now.
pub type CrashHook = Arc<dyn Fn(&Delivery) -> bool + Send + Sync>;

/// Told how each broker message was settled (tests).
pub type SettledHook = Arc<dyn Fn(&Delivery, Settled) + Send + Sync>;

/// Decides, for a message, whether lazaret's next write for it fails, and
/// with what (tests: a full disk).
pub type RefuseHook = Arc<dyn Fn(&Delivery) -> Option<StoreError> + Send + Sync>;

/// How a broker message was settled, for [`Faults::settled`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Settled {
    /// Acknowledged after the handler succeeded.
    Succeeded,
    /// Acknowledged after its retry or deferral was held in the store.
    HeldRetry,
    /// Acknowledged after it was quarantined.
    Quarantined,
    /// A redelivery of a message the store already held: acknowledged
    /// without delivering it again.
    HeldAlready,
}

/// Faults to inject and hooks to observe, for tests of what a crash leaves
/// behind.
#[derive(Clone, Default)]
pub struct Faults {
    /// Called after lazaret's write for a message is durable and before the
    /// broker acknowledgement; `true` stops the runtime right there, as
    /// `kill -9` would: nothing is acknowledged, the connection is dropped.
    pub crash_after_write: Option<CrashHook>,
    /// Called once a message is settled: its broker acknowledgement
    /// succeeded, or, for a held retry, its outcome was written.
    pub settled: Option<SettledHook>,
    /// Called before each write of a message's outcome (a held retry, a
    /// dead letter, a held retry dropped): `Some(error)` fails that write
    /// with it, as a full disk would.
    pub refuse_write: Option<RefuseHook>,
    /// A deliberately broken guard, to show that a battery fails on one:
    /// for a message this selects whose outcome is a dead letter, the
    /// broker is acknowledged *before* the dead letter is written, and the
    /// runtime then stops as `kill -9` would, before the write. The
    /// message is lost: the broker forgot it and the store never had it.
    pub ack_before_dead_letter: Option<CrashHook>,
}

impl fmt::Debug for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Faults")
            .field("crash_after_write", &self.crash_after_write.is_some())
            .field("settled", &self.settled.is_some())
            .field("refuse_write", &self.refuse_write.is_some())
            .field(
                "ack_before_dead_letter",
                &self.ack_before_dead_letter.is_some(),
            )
            .finish()
    }
}

/// Why a guard stopped other than by shutdown.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GuardError {
    /// An injected fault stopped it (tests).
    #[error("stopped by an injected crash")]
    Crashed,
    /// The broker is unusable in a way a reconnect does not mend.
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

/// One guard source, ready to run.
pub struct Guard<H: Host> {
    inner: Arc<Inner<H>>,
}

impl<H: Host> fmt::Debug for Guard<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guard")
            .field("source", &self.inner.spec.name)
            .finish_non_exhaustive()
    }
}

struct Inner<H: Host> {
    spec: SourceSpec,
    host: Arc<H>,
    broker: Arc<dyn Broker>,
    handler: Arc<dyn Handler>,
    rng: Mutex<SplitMix64>,
    /// Handler calls in flight: `concurrency`.
    permits: Arc<Semaphore>,
    /// Messages whose outcome is decided and whose write and
    /// acknowledgement are under way ([`SourceSpec::settling_max`]). A
    /// delivery gives its handler slot back once its outcome is decided, so
    /// a slow durable write (a dead letter's fsync) does not hold up the
    /// next delivery; the broker's window (RabbitMQ's prefetch,
    /// [`SourceSpec::unsettled_max`]) covers both.
    settling: Arc<Semaphore>,
    /// Held retries being delivered now, by [`MessageKey`] (another body
    /// under the same message id is another message).
    running: Mutex<HashSet<MessageKey>>,
    /// Who this process is when it claims held retries in the store.
    claimer: String,
    faults: Faults,
    crashed: watch::Sender<bool>,
    quarantines: Arc<Quarantines>,
    /// The source stops: a message held for a refused write is handed back.
    stopping: watch::Sender<bool>,
    /// Whether the store takes writes, when the host keeps none for all
    /// its sources.
    own_writes: StoreWrites,
    /// Messages whose outcome waits for the store to take writes, by
    /// [`MessageKey`] (how many deliveries of that key): a redelivery of
    /// one (its channel was lost meanwhile) waits for that write instead of
    /// going to the handler again; another body under the same id does not.
    holding: Mutex<HashMap<MessageKey, u32>>,
    /// Messages this source handed back to the broker, by [`MessageKey`],
    /// with how often: the broker counts each as a delivery, which is no
    /// crash. In memory only (a restart forgets it), at most
    /// [`GIVEN_BACK_MAX`].
    given_back: Mutex<HashMap<MessageKey, u32>>,
}

/// Messages whose hand-backs a source remembers at most.
const GIVEN_BACK_MAX: usize = 10_000;
/// How often a source closed because the store refuses writes looks again.
const STORE_RECHECK: Duration = Duration::from_millis(100);

/// What an outcome writes to the store before the broker message is
/// settled.
enum Write {
    /// Nothing (a success straight from the broker).
    Nothing,
    /// Drop the held retry (a held retry succeeded).
    ReleaseHeldRetry,
    /// A redriven copy succeeded: noted in its redrive's report, its held
    /// retry (if any) dropped, in one write. Only redriven messages pay it.
    RedrivenSucceeded,
    /// Hold a retry.
    HoldRetry(Box<HeldRetry>),
    /// Quarantine.
    Quarantine(Box<SourceDeadLetter>),
}

/// Marks a message as held for a refused write while it lives.
struct Holding<'a> {
    keys: &'a Mutex<HashMap<MessageKey, u32>>,
    key: MessageKey,
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = keys.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                keys.remove(&self.key);
            }
        }
    }
}

/// Where a delivery came from, and so how it is settled.
enum Origin {
    /// Straight from the broker: acknowledge it once settled.
    Broker(Box<dyn Acker>),
    /// A held retry from lazaret's store.
    HeldRetry,
    /// A broker redelivery of a retry held on the broker
    /// ([`Broker::holds_retries`]): settled as from the broker, and its
    /// record in the store dropped on success.
    HeldOnBroker(Box<dyn Acker>),
}

impl Origin {
    fn acker(&self) -> Option<&dyn Acker> {
        match self {
            Origin::Broker(a) | Origin::HeldOnBroker(a) => Some(a.as_ref()),
            Origin::HeldRetry => None,
        }
    }

    fn into_acker(self) -> Option<Box<dyn Acker>> {
        match self {
            Origin::Broker(a) | Origin::HeldOnBroker(a) => Some(a),
            Origin::HeldRetry => None,
        }
    }
}

/// The key of a held-on-the-broker retry's position that records the
/// broker's count of earlier deliveries when lazaret held it: the next
/// receive is lazaret's own, any beyond it a consumer that died.
const HELD_PRIOR: &str = "lazaret_held_prior";

impl<H: Host> Guard<H> {
    /// A guard of `spec`'s queue on `broker`, delivering to `handler`.
    pub fn new(
        spec: SourceSpec,
        host: Arc<H>,
        broker: Arc<dyn Broker>,
        handler: Arc<dyn Handler>,
    ) -> Guard<H> {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ u64::from(std::process::id()).rotate_left(32);
        let claimer = format!("{}@pid{}:{seed:016x}", spec.worker_id(), std::process::id());
        let permits = Arc::new(Semaphore::new(spec.concurrency.max(1) as usize));
        let settling = Arc::new(Semaphore::new(spec.settling_max() as usize));
        // The slots that bound the broker's window while messages settle.
        let room = match spec.settling_max() {
            0 => (Arc::clone(&permits), spec.concurrency.max(1) as usize),
            n => (Arc::clone(&settling), n as usize),
        };
        Guard {
            inner: Arc::new(Inner {
                spec,
                host,
                broker,
                handler,
                rng: Mutex::new(SplitMix64::new(seed)),
                permits,
                settling,
                running: Mutex::new(HashSet::new()),
                claimer,
                faults: Faults::default(),
                crashed: watch::channel(false).0,
                quarantines: Arc::new(Quarantines::new(QUARANTINE_LINGER, room)),
                stopping: watch::channel(false).0,
                own_writes: StoreWrites::default(),
                holding: Mutex::new(HashMap::new()),
                given_back: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// How long the first dead letter of a batch waits during a storm for
    /// others to share its durable write ([`QUARANTINE_LINGER`] by default;
    /// zero: only those that arrive while the previous batch is written
    /// share it).
    pub fn with_quarantine_linger(self, linger: Duration) -> Guard<H> {
        let mut inner = Arc::try_unwrap(self.inner)
            .unwrap_or_else(|_| unreachable!("a new guard is not shared yet"));
        Arc::get_mut(&mut inner.quarantines)
            .unwrap_or_else(|| unreachable!("a new guard's quarantines are not shared yet"))
            .linger = linger;
        Guard {
            inner: Arc::new(inner),
        }
    }

    /// Injects faults (tests).
    pub fn with_faults(self, faults: Faults) -> Guard<H> {
        let mut inner = Arc::try_unwrap(self.inner)
            .unwrap_or_else(|_| unreachable!("a new guard is not shared yet"));
        inner.faults = faults;
        Guard {
            inner: Arc::new(inner),
        }
    }

    /// Runs until `shutdown` turns true: consumes, delivers, settles, and
    /// delivers held retries when due. Deliveries in flight at shutdown are
    /// given up to the delivery timeout to finish; what is left unsettled
    /// the broker redelivers.
    pub async fn run(self, shutdown: watch::Receiver<bool>) -> Result<(), GuardError> {
        let inner = self.inner;
        let attempts_max = inner.host.policy(&inner.spec.job_type).attempts_max;
        for warning in inner.broker.check_limits(attempts_max).await {
            tracing::warn!(source = %inner.spec.name, "{warning}");
        }
        let mut crashed = inner.crashed.subscribe();
        // Retries held on the broker come back from it, not from the store.
        let held_retries = (!inner.broker.holds_retries())
            .then(|| tokio::spawn(Arc::clone(&inner).deliver_due(shutdown.clone())));
        let result = tokio::select! {
            r = Arc::clone(&inner).consume(shutdown.clone()) => r,
            _ = crashed.wait_for(|c| *c) => Err(GuardError::Crashed),
        };
        if let Some(held_retries) = held_retries {
            held_retries.abort();
        }
        // Messages held for a refused write are handed back now.
        inner.stopping.send_replace(true);
        if result.is_ok() && !*inner.crashed.borrow() {
            // Let deliveries in flight settle, for at most one delivery timeout.
            let all = inner.spec.concurrency.max(1);
            let _ = tokio::time::timeout(
                inner.spec.delivery_timeout + Duration::from_secs(1),
                async {
                    let calls = inner.permits.acquire_many(all).await;
                    let writes = inner.settling.acquire_many(inner.spec.settling_max()).await;
                    (calls, writes)
                },
            )
            .await;
        }
        result
    }
}

impl<H: Host> Inner<H> {
    /// Whether the store takes writes, for this source.
    fn writes(&self) -> &StoreWrites {
        self.host.store_writes().unwrap_or(&self.own_writes)
    }

    /// How long a message taken from the broker waits before it is
    /// delivered: while its type or lane is parked, or the store refuses
    /// writes (its outcome could not be written).
    fn held_back(&self) -> Option<Duration> {
        self.host
            .held_back(&self.spec.job_type, &self.spec.lane, now())
            .or_else(|| self.writes().refusal().map(|_| STORE_RECHECK))
    }

    /// How often a message held for a long time is kept from redelivery.
    fn progress_every(&self) -> Duration {
        (self.spec.delivery_timeout / 4).clamp(Duration::from_millis(500), Duration::from_secs(10))
    }

    /// Waits before the next try of a refused store operation (the
    /// `tries`-th failed): [`store_retry_delay`], at most
    /// [`Inner::progress_every`], then keeps `ack`'s message from
    /// redelivery. `false` when the source stops meanwhile.
    async fn wait_to_retry(&self, tries: u32, ack: Option<&dyn Acker>) -> bool {
        let mut stopping = self.stopping.subscribe();
        if *stopping.borrow_and_update() {
            return false;
        }
        tokio::select! {
            () = tokio::time::sleep(store_retry_delay(tries).min(self.progress_every())) => {}
            _ = stopping.changed() => return false,
        }
        if let Some(ack) = ack {
            if let Err(e) = ack.progress().await {
                tracing::debug!(source = %self.spec.name, "in-progress ack failed: {e}");
            }
        }
        true
    }

    /// Waits until the type and lane may be delivered, or shutdown. With
    /// `spend`, a delivery is about to follow: a half-open breaker's probe
    /// is spent on it. Without, it only waits for the type to be let go
    /// (nothing is spent, so a look that finds nothing to deliver leaves
    /// the probe to a message).
    async fn gate(&self, shutdown: &mut watch::Receiver<bool>, spend: bool) -> bool {
        loop {
            if *shutdown.borrow() {
                return false;
            }
            // The store refuses writes: take nothing whose outcome could
            // not be written. The source holding the refused write tries it
            // again, and the first that succeeds opens this again.
            if self.writes().refusal().is_some() {
                tokio::select! {
                    _ = tokio::time::sleep(STORE_RECHECK) => {}
                    _ = shutdown.changed() => {}
                }
                continue;
            }
            let (ty, lane, at) = (&self.spec.job_type, &self.spec.lane, now());
            let open = if spend {
                self.host.try_deliver(ty, lane, at)
            } else {
                self.host.held_back(ty, lane, at).map_or(Ok(()), Err)
            };
            match open {
                Ok(()) => return true,
                Err(wait) => {
                    let wait = wait.clamp(Duration::from_millis(10), Duration::from_secs(1));
                    tokio::select! {
                        _ = tokio::time::sleep(wait) => {}
                        _ = shutdown.changed() => {}
                    }
                }
            }
        }
    }

    async fn consume(
        self: Arc<Self>,
        mut shutdown: watch::Receiver<bool>,
    ) -> Result<(), GuardError> {
        let mut messages = Reconnecting::new(self.broker.as_ref(), &self.spec.name);
        loop {
            let Ok(permit) = Arc::clone(&self.permits).acquire_owned().await else {
                return Ok(());
            };
            if !self.gate(&mut shutdown, true).await {
                return Ok(());
            }
            let Some(incoming) = messages.next(&mut shutdown).await else {
                return Ok(());
            };
            tokio::spawn(Arc::clone(&self).take(incoming, permit));
        }
    }

    /// Delivers held retries as they come due: claims them in the store
    /// first (for [`Self::claim_for`]), so that of several nodes guarding
    /// the same source on one store only one delivers each; only as many
    /// as there are free handler slots, so none waits out its claim.
    async fn deliver_due(self: Arc<Self>, mut shutdown: watch::Receiver<bool>) {
        let name = self.spec.name.clone();
        let claim_for = self.claim_for();
        loop {
            // Only a look: a probe of a half-open breaker is spent below,
            // on a retry that is due. Spent here, every look that found
            // nothing due took it from the messages waiting for it (each
            // half-open period, this loop's 100 ms poll won the race).
            if !self.gate(&mut shutdown, false).await {
                return;
            }
            // A read first: claiming is a write (an fsync on SQLite), taken
            // only when a held retry is due.
            let any_due = match self.host.store().next_held_retry_due(name.clone()).await {
                Ok(next) => next.is_some_and(|at| at <= now()),
                Err(e) => {
                    tracing::warn!(source = %name, "cannot read held retries: {e}");
                    false
                }
            };
            if !any_due {
                tokio::select! {
                    _ = tokio::time::sleep(DUE_POLL) => {}
                    _ = shutdown.changed() => return,
                }
                continue;
            }
            let Ok(first) = Arc::clone(&self.permits).acquire_owned().await else {
                return;
            };
            let mut permits = vec![first];
            while permits.len() < DUE_BATCH as usize {
                match Arc::clone(&self.permits).try_acquire_owned() {
                    Ok(p) => permits.push(p),
                    Err(_) => break,
                }
            }
            let at = now();
            let expires = Timestamp::from_millis(at.as_millis().saturating_add(millis(claim_for)));
            let due = match self
                .host
                .store()
                .claim_held_retries(
                    name.clone(),
                    at,
                    permits.len() as u32,
                    self.claimer.clone(),
                    expires,
                )
                .await
            {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(source = %name, "cannot read held retries: {e}");
                    Vec::new()
                }
            };
            for claimed in due {
                let p = claimed.retry;
                // Another claimer's claim ran out: it died (or stopped)
                // delivering this retry and left no outcome. This node's
                // own lapsed claims (a retry it put back for the gate, or
                // whose outcome the store refused) are no crash.
                let crashed = claimed.lapsed_claim.is_some_and(|who| who != self.claimer);
                // A trace of a settled message is never delivered.
                if let Some(since) = p
                    .source
                    .position
                    .get(SETTLED_AT)
                    .and_then(serde_json::Value::as_i64)
                {
                    let me = Arc::clone(&self);
                    tokio::spawn(async move { me.recheck_trace(p, since).await });
                    continue;
                }
                let key = p.key();
                if !self.lock_running().insert(key.clone()) {
                    continue;
                }
                let Some(permit) = permits.pop() else {
                    self.lock_running().remove(&key);
                    break;
                };
                if !self.gate(&mut shutdown, true).await {
                    self.lock_running().remove(&key);
                    return;
                }
                // The gate held it so long that its handler might outlast
                // the claim: leave it to the next look (its claim expires).
                if now()
                    .as_millis()
                    .saturating_add(millis(self.spec.delivery_timeout))
                    >= expires.as_millis()
                {
                    self.lock_running().remove(&key);
                    continue;
                }
                let me = Arc::clone(&self);
                tokio::spawn(async move {
                    let delivery = held_retry_delivery(&p);
                    let settled = if crashed {
                        // Charged as a lease expiry, as a broker's
                        // redelivery after a dead consumer is: a retry
                        // that kills node after node ends as crash_loop.
                        me.charge_then_attempt(
                            Origin::HeldRetry,
                            delivery,
                            p.envelope,
                            None,
                            1,
                            permit,
                        )
                        .await
                    } else {
                        let policy = me.host.policy(&me.spec.job_type);
                        me.attempt(Origin::HeldRetry, delivery, p.envelope, policy, permit)
                            .await
                    };
                    if !settled {
                        // The store refused: the retry stays held (and
                        // claimed until its claim expires); look again later.
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    me.lock_running().remove(&key);
                });
            }
            drop(permits);
            tokio::select! {
                _ = tokio::time::sleep(DUE_POLL) => {}
                _ = shutdown.changed() => return,
            }
        }
    }

    /// Looks at a trace of a settled message again ([`SETTLED_AT`]): drops
    /// it once its broker will not hand the message out again (or it is
    /// older than [`TRACE_KEEP`]), else keeps it for another look.
    async fn recheck_trace(&self, p: HeldRetry, since: i64) {
        let at = now();
        let again = match self.broker.may_come_again(&p.source.position).await {
            Ok(again) => again,
            Err(e) => {
                tracing::debug!(source = %self.spec.name, message_id = %p.source.message_id, "cannot tell whether a settled message may come again: {e}; its trace is kept");
                true
            }
        };
        let expired = at.as_millis().saturating_sub(since) >= millis(TRACE_KEEP);
        let store = self.host.store();
        let written = if again && !expired {
            let due_at =
                Timestamp::from_millis(at.as_millis().saturating_add(millis(TRACE_RECHECK)));
            store.hold_retry(HeldRetry { due_at, ..p }).await
        } else {
            store.release_held_retry(p.key()).await.map(|_| ())
        };
        if let Err(e) = written {
            // Its claim expires and the next look takes it again.
            tracing::debug!(source = %self.spec.name, "cannot update the trace of a settled message: {e}");
        }
    }

    /// What a held retry that finished leaves in the store: nothing, or,
    /// while the broker may still hand the message out again, a trace of
    /// it ([`SETTLED_AT`]).
    async fn finished_retry(&self, delivery: &Delivery, env: Envelope, at: Timestamp) -> Write {
        match self.broker.may_come_again(&delivery.position).await {
            Ok(false) => return Write::ReleaseHeldRetry,
            Ok(true) => {}
            Err(e) => {
                tracing::debug!(source = %self.spec.name, message_id = %delivery.message_id, "cannot tell whether a settled message may come again: {e}; a trace of it is kept");
            }
        }
        let mut source = self.source_ref(delivery);
        with_position_key(&mut source, SETTLED_AT, at.as_millis().into());
        Write::HoldRetry(Box::new(HeldRetry {
            source,
            due_at: Timestamp::from_millis(at.as_millis().saturating_add(millis(TRACE_RECHECK))),
            envelope: env,
            body: delivery.body.clone(),
        }))
    }

    /// How long a held retry stays claimed by this node: the handler's
    /// `delivery_timeout_ms` plus [`CLAIM_MARGIN`].
    fn claim_for(&self) -> Duration {
        self.spec.delivery_timeout + CLAIM_MARGIN
    }

    fn lock_running(&self) -> std::sync::MutexGuard<'_, HashSet<MessageKey>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A message fresh from the broker.
    async fn take(self: Arc<Self>, incoming: Incoming, permit: OwnedSemaphorePermit) {
        let Incoming { mut delivery, ack } = incoming;
        // The gate was open when the runtime asked the broker, but a pause,
        // a breaker or a refused write may have closed it while `next`
        // waited: hold the message (kept from redelivery) until it opens
        // again.
        while let Some(wait) = self.held_back() {
            if let Err(e) = ack.progress().await {
                tracing::debug!(source = %self.spec.name, "in-progress ack failed: {e}");
            }
            tokio::time::sleep(wait.clamp(Duration::from_millis(10), Duration::from_secs(1))).await;
        }
        delivery.resolve_id();
        // Deliveries the broker counted because this source handed the
        // message back are no crashes.
        let given_back = self.given_back_before(&delivery);
        delivery.broker_prior = delivery.broker_prior.saturating_sub(given_back);
        if delivery.redelivered || delivery.broker_prior > 0 || given_back > 0 {
            // Held already only if it is this very message: a dead letter
            // or a held retry of the same body (another body reusing the
            // id is another message) and redrive id (a redriven copy is
            // never the dead letter it came from).
            let key = self.key(&delivery);
            // A redelivery of a message whose outcome this source still
            // holds for a refused write (its channel was lost): that write
            // decides; the handler is not asked again.
            let mut tries = 0;
            while self.is_holding(&key) {
                if !self.wait_to_retry(tries.min(3), Some(ack.as_ref())).await {
                    self.give_back(ack, &delivery, &StoreError::Closed).await;
                    return;
                }
                tries += 1;
            }
            let mut tries = 0;
            let held = loop {
                let held = self.host.store().message_held(key.clone()).await;
                match held {
                    Err(e) if !matches!(e, StoreError::Closed) => {
                        tracing::debug!(source = %self.spec.name, "cannot read whether a redelivered message is held: {e}; trying again");
                        if !self.wait_to_retry(tries, Some(ack.as_ref())).await {
                            self.give_back(ack, &delivery, &e).await;
                            return;
                        }
                        tries += 1;
                    }
                    held => break held,
                }
            };
            match held {
                // Delivered before, and lazaret never wrote an outcome: the
                // handler may have seen it (a duplicate the broker causes).
                Ok(Held::Nothing) if delivery.broker_prior > 0 => {
                    self.host.redelivered(&self.spec.name, false);
                }
                Ok(Held::Nothing) => {}
                Ok(Held::Retry) if self.broker.holds_retries() => {
                    let mut tries = 0;
                    let record = loop {
                        let record = self.host.store().held_retry(key.clone()).await;
                        match record {
                            Err(e) if !matches!(e, StoreError::Closed) => {
                                if !self.wait_to_retry(tries, Some(ack.as_ref())).await {
                                    self.give_back(ack, &delivery, &e).await;
                                    drop(permit);
                                    return;
                                }
                                tries += 1;
                            }
                            record => break record,
                        }
                    };
                    match record {
                        // Settled in between: new to lazaret after all.
                        Ok(None) => {}
                        Ok(Some(p)) => {
                            self.resume(ack, delivery, p, permit).await;
                            return;
                        }
                        Err(e) => {
                            self.give_back(ack, &delivery, &e).await;
                            drop(permit);
                            return;
                        }
                    }
                }
                Ok(held) => {
                    // lazaret wrote it down before a crash kept the ack from
                    // the broker: it is settled already.
                    tracing::info!(source = %self.spec.name, message_id = %delivery.message_id, ?held,
                        "a redelivered message is held already; acknowledging it");
                    self.host.redelivered(&self.spec.name, true);
                    self.settle(Origin::Broker(ack), &delivery, Settled::HeldAlready)
                        .await;
                    drop(permit);
                    return;
                }
                Err(e) => {
                    self.give_back(ack, &delivery, &e).await;
                    drop(permit);
                    return;
                }
            }
        }
        let env = self.envelope(&delivery, now());
        let header = delivery.attempt_header();
        let unseen = delivery.broker_prior;
        self.charge_then_attempt(
            Origin::Broker(ack),
            delivery,
            env,
            header.as_deref(),
            unseen,
            permit,
        )
        .await;
    }

    /// Charges what came before this delivery, then delivers it: the
    /// attempts lazaret's own `header` vouches for, and `unseen` earlier
    /// deliveries whose consumer died with the message (each a lease
    /// expiry). When those spent its budget (`crash_loop`, `exhausted`) it
    /// is quarantined undelivered instead. `false` when the outcome could
    /// not be recorded.
    async fn charge_then_attempt(
        &self,
        origin: Origin,
        delivery: Delivery,
        mut env: Envelope,
        header: Option<&[u8]>,
        unseen: u32,
        permit: OwnedSemaphorePermit,
    ) -> bool {
        let at = now();
        let policy = self.host.policy(&self.spec.job_type);
        let spent = {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
            absorb_earlier_deliveries(&mut env, &policy, header, unseen, at, &mut *rng)
        };
        if let Some(reason) = spent {
            let done = self.observe(&env, Transition::DeadLetter { reason }, at, None);
            let settled = self.finish(origin, &delivery, env, done, at).await;
            drop(permit);
            settled
        } else {
            self.attempt(origin, delivery, env, policy, permit).await
        }
    }

    /// The broker's redelivery of a retry it held: when due, the retry,
    /// with the envelope lazaret recorded; when early (the broker's longest
    /// hold ran out, or lazaret stopped before holding it), held again.
    async fn resume(
        &self,
        ack: Box<dyn Acker>,
        delivery: Delivery,
        p: HeldRetry,
        permit: OwnedSemaphorePermit,
    ) {
        let at = now();
        let recorded = p
            .source
            .position
            .get(HELD_PRIOR)
            .and_then(serde_json::Value::as_u64)
            .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX));
        if p.due_at > at {
            let wait = p.due_at.saturating_since(at);
            let again = HeldRetry {
                source: self.held_ref(&delivery),
                ..p
            };
            let written = self
                .write_held(
                    Some(ack.as_ref()),
                    &delivery,
                    &Write::HoldRetry(Box::new(again)),
                )
                .await;
            if let Err(e) = written {
                self.give_back(ack, &delivery, &e).await;
                return;
            }
            if let Err(e) = ack.hold(wait).await {
                tracing::warn!(source = %self.spec.name, message_id = %delivery.message_id, "holding a retry failed: {e}; the broker redelivers it early and it is held again");
            }
            return;
        }
        // The receive after lazaret held it is lazaret's own; any before
        // this one beyond that is a consumer that died with the message.
        let unseen = delivery
            .broker_prior
            .saturating_sub(recorded.saturating_add(1));
        self.charge_then_attempt(
            Origin::HeldOnBroker(ack),
            delivery,
            p.envelope,
            None,
            unseen,
            permit,
        )
        .await;
    }

    fn tenant(&self, d: &Delivery) -> TenantId {
        match &self.spec.tenant {
            TenantFrom::Fixed(t) => TenantId::from(t.as_str()),
            // Hostile: a value breaking the name rule falls back to
            // `default` (the full value stays in the source headers).
            TenantFrom::Header(h) => TenantId::from(
                d.header(h)
                    .as_deref()
                    .and_then(bounded_name)
                    .unwrap_or("default"),
            ),
        }
    }

    fn envelope(&self, d: &Delivery, at: Timestamp) -> Envelope {
        let mut env = Envelope::new(
            JobId(0),
            self.spec.job_type.clone(),
            self.tenant(d),
            self.spec.lane.clone(),
            &d.body,
            at,
        );
        env.idempotency_key = Some(self.idempotency_key(d));
        env.traceparent = d.traceparent(&self.spec.name);
        env
    }

    fn idempotency_key(&self, d: &Delivery) -> String {
        format!("{}:{}", self.spec.name, d.message_id)
    }

    /// Delivers once and settles; `false` when the outcome could not be
    /// recorded (the message was then handed back or left held). The
    /// handler slot `permit` is given back once the outcome is decided and
    /// observed; the write and the acknowledgement then hold a settling
    /// slot.
    async fn attempt(
        &self,
        origin: Origin,
        delivery: Delivery,
        mut env: Envelope,
        policy: TypePolicy,
        permit: OwnedSemaphorePermit,
    ) -> bool {
        // The channel it came on died since it was taken (RabbitMQ): the
        // broker hands it out again, so delivering it now would only be a
        // second call. A lost connection duplicates at most the calls
        // already running.
        if origin.acker().is_some_and(|a| !a.live()) {
            tracing::debug!(source = %self.spec.name, message_id = %delivery.message_id,
                "its channel is gone before its delivery; the broker redelivers it");
            return false;
        }
        let started = now();
        let worker = WorkerId::from(self.spec.worker_id());
        let attempt = grant_lease(&mut env, Some(&worker), started);
        let key = self.idempotency_key(&delivery);
        // Debug level: per message, so exported (`otlp`) but not logged at
        // the default `info`, where creating it costs next to nothing.
        let span = tracing::debug_span!(
            "lazaret.delivery",
            "job.id" = %key,
            "job.type" = %self.spec.job_type,
            "job.tenant" = %env.tenant,
            "job.lane" = %self.spec.lane,
            "job.attempt" = attempt,
            source = %self.spec.name,
            "message.id" = %delivery.message_id,
            outcome = tracing::field::Empty,
        );
        crate::trace::follow(&span, env.traceparent.as_ref());
        let traceparent = crate::trace::outgoing(&span, env.traceparent.as_ref());
        let call = Call {
            delivery: &delivery,
            attempt,
            source: &self.spec.name,
            idempotency_key: &key,
            traceparent: traceparent.as_deref(),
        };
        let outcome = async {
            let run = tokio::time::timeout(self.spec.delivery_timeout, self.handler.handle(call));
            tokio::pin!(run);
            let every = (self.spec.delivery_timeout / 4)
                .clamp(Duration::from_millis(500), Duration::from_secs(10));
            loop {
                tokio::select! {
                    r = &mut run => break r,
                    _ = tokio::time::sleep(every) => {
                        if let Some(ack) = origin.acker() {
                            if let Err(e) = ack.progress().await {
                                tracing::debug!(source = %self.spec.name, "in-progress ack failed: {e}");
                            }
                        }
                    }
                }
            }
        }
        .instrument(span.clone())
        .await;
        let event = match outcome {
            Ok(Outcome::Success) => Event::Succeeded,
            Ok(Outcome::Failure(f)) => Event::Failed(f),
            Err(_) => Event::Failed(
                Failure::new(
                    "timeout",
                    format!(
                        "the handler took longer than delivery_timeout_ms = {}",
                        self.spec.delivery_timeout.as_millis()
                    ),
                )
                .with_class(FailureClass::Transient),
            ),
        };
        let ended = now_rounded_up();
        let transition = {
            let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
            decide(&mut env, &policy, event, ended, &mut *rng)
        };
        // The breakers hear of the outcome before the slot is given back:
        // the next take asks them first, so the failure that opens one
        // stops it (were the slot freed first, another message could be
        // taken while this one's write is under way).
        span.record("outcome", transition.as_str());
        let done = self.observe(&env, transition, ended, Some(started));
        // With no settling allowance the handler slot is held to the end.
        let (slot, settling) = if self.spec.settling_max() == 0 {
            (Some(permit), None)
        } else {
            // Never closed; were it, settling without a slot is still correct.
            let settling = Arc::clone(&self.settling).acquire_owned().await.ok();
            drop(permit);
            (None, settling)
        };
        self.quarantines.slot_taken();
        let settled = self.finish(origin, &delivery, env, done, ended).await;
        drop((slot, settling));
        settled
    }

    /// Tells the host how an attempt ended (breakers, statistics,
    /// metrics), before its write: the outcome it returns is then carried
    /// out by [`Inner::finish`]. `leased_at`: when the delivery that ended
    /// started (none for a message quarantined undelivered).
    fn observe(
        &self,
        env: &Envelope,
        transition: Transition,
        at: Timestamp,
        leased_at: Option<Timestamp>,
    ) -> Completed {
        let failed = transition != Transition::Succeeded;
        let last = env.last_error().filter(|_| failed);
        let done = Completed {
            id: JobId(0),
            job_type: self.spec.job_type.clone(),
            lane: self.spec.lane.clone(),
            tenant: env.tenant.clone(),
            traceparent: env.traceparent.clone(),
            transition,
            attempt: env.attempts,
            kind: last.map(|f| f.kind.clone()),
            class: last.and_then(|f| f.class),
            dead_letter: None,
            message: last.map(|f| f.message.clone()),
            redrive_count: env.redrive_count,
            freed_slot: false,
            leased_at,
        };
        self.host.observe(&self.spec.name, &done, at);
        done
    }

    /// Carries an observed outcome out: the store first, then the broker.
    async fn finish(
        &self,
        origin: Origin,
        delivery: &Delivery,
        env: Envelope,
        mut done: Completed,
        at: Timestamp,
    ) -> bool {
        let transition = done.transition;
        if !matches!(transition, Transition::Succeeded | Transition::Cancelled) {
            if let Some(ack) = origin.acker() {
                ack.decided();
            }
        }
        let write = match transition {
            // A broker message is never asked to cancel (`decide` alone
            // settles it), so `Cancelled` does not come; were it to, the
            // message is done with, like a success: dropped and acknowledged.
            Transition::Succeeded | Transition::Cancelled => match origin {
                // A redriven copy's success is noted for its redrive's report
                // (and drops a held retry of it). Not kept as a Kafka trace
                // the way `finished_retry` keeps one: a re-read of such a
                // copy before its offset is committed is handled again.
                _ if redrive_id(delivery).is_some() => Write::RedrivenSucceeded,
                Origin::HeldRetry => self.finished_retry(delivery, env, at).await,
                Origin::HeldOnBroker(_) => Write::ReleaseHeldRetry,
                Origin::Broker(_) => Write::Nothing,
            },
            Transition::Retry { at: due, .. } | Transition::Defer { until: due } => {
                let source = if self.broker.holds_retries() {
                    self.held_ref(delivery)
                } else {
                    self.source_ref(delivery)
                };
                Write::HoldRetry(Box::new(HeldRetry {
                    source,
                    due_at: due,
                    envelope: env,
                    body: delivery.body.clone(),
                }))
            }
            Transition::DeadLetter { reason } => {
                // A first delivery from the broker was not looked up in the
                // store (`take`): no retry can be held for it.
                let first = matches!(origin, Origin::Broker(_))
                    && !delivery.redelivered
                    && delivery.broker_prior == 0;
                Write::Quarantine(Box::new(SourceDeadLetter {
                    source: self.source_ref(delivery),
                    job_type: Some(self.spec.job_type.to_string()),
                    tenant: Some(env.tenant.to_string()),
                    lane: Some(self.spec.lane.to_string()),
                    reason,
                    stage: Stage::Processing,
                    attempts: env.attempts,
                    error: env.last_error().cloned(),
                    idempotency_key: env.idempotency_key.clone(),
                    created_at: env.created_at,
                    envelope: Some(env),
                    now: at,
                    payload: delivery.body.clone(),
                    may_be_held: !first,
                }))
            }
        };
        crate::failpoint::fail_point!("guard::held_retry_before_outcome" if matches!(origin, Origin::HeldRetry));
        let quarantine_span = match (&write, transition) {
            (Write::Quarantine(dl), Transition::DeadLetter { reason }) => {
                let span = tracing::debug_span!(
                    "lazaret.dead_letter",
                    "job.id" = %self.idempotency_key(delivery),
                    "job.type" = %self.spec.job_type,
                    "job.tenant" = dl.tenant.as_deref(),
                    "job.lane" = %self.spec.lane,
                    "job.attempt" = dl.attempts,
                    source = %self.spec.name,
                    "message.id" = %delivery.message_id,
                    reason = reason.as_str(),
                );
                crate::trace::follow(
                    &span,
                    dl.envelope.as_ref().and_then(|e| e.traceparent.as_ref()),
                );
                span
            }
            _ => tracing::Span::none(),
        };
        let broken = matches!(write, Write::Quarantine(_))
            && origin.acker().is_some()
            && self
                .faults
                .ack_before_dead_letter
                .as_ref()
                .is_some_and(|broken| broken(delivery));
        if broken {
            // The broken order: the broker first, then a crash before the
            // write.
            self.settle(origin, delivery, Settled::Quarantined).await;
            let _ = self.crashed.send(true);
            return true;
        }
        // A refused write keeps the outcome and is tried again (the
        // message held meanwhile); it fails only when the source stops.
        match self
            .write_held(origin.acker(), delivery, &write)
            .instrument(quarantine_span)
            .await
        {
            Ok(dead_letter) => done.dead_letter = dead_letter,
            Err(e) => {
                if let Some(ack) = origin.into_acker() {
                    self.give_back(ack, delivery, &e).await;
                } else {
                    tracing::warn!(source = %self.spec.name, "cannot record the outcome of a held retry: {e}; it stays held");
                }
                return false;
            }
        }
        self.host.recorded(&self.spec.name, &done, at);
        if transition != Transition::Succeeded {
            if let Some(crash) = &self.faults.crash_after_write {
                if crash(delivery) {
                    let _ = self.crashed.send(true);
                    // Never acknowledge: as if the process died here.
                    drop(origin);
                    return true;
                }
            }
        }
        let how = match transition {
            Transition::Succeeded | Transition::Cancelled => Settled::Succeeded,
            Transition::Retry { .. } | Transition::Defer { .. } => Settled::HeldRetry,
            Transition::DeadLetter { .. } => Settled::Quarantined,
        };
        if let (Transition::Retry { at: due, .. } | Transition::Defer { until: due }, true) =
            (transition, self.broker.holds_retries())
        {
            if let Some(ack) = origin.into_acker() {
                if let Err(e) = ack.hold(due.saturating_since(now())).await {
                    tracing::warn!(source = %self.spec.name, message_id = %delivery.message_id, "holding a retry failed: {e}; the broker redelivers it early and it is held again");
                    return true;
                }
            }
            if let Some(hook) = &self.faults.settled {
                hook(delivery, how);
            }
            return true;
        }
        self.settle(origin, delivery, how).await;
        true
    }

    /// Quarantines one message, in a batch with those that arrive while the
    /// previous batch is written; answers once its write is durable.
    async fn quarantine(&self, dl: SourceDeadLetter) -> Result<Quarantined, StoreError> {
        let (reply, answer) = oneshot::channel();
        if self.quarantines.push(dl, reply) {
            // A task of its own, so that a waiter dropped (shutdown) never
            // strands the others.
            let host = Arc::clone(&self.host);
            let batch = Arc::clone(&self.quarantines);
            tokio::spawn(async move { batch.write_all(host.store()).await });
        }
        answer.await.unwrap_or(Err(StoreError::Closed))
    }

    /// Acknowledges a broker message (a held retry is settled by its store
    /// write alone), then tells the test hook.
    async fn settle(&self, origin: Origin, delivery: &Delivery, how: Settled) {
        if let Some(ack) = origin.into_acker() {
            if let Err(e) = ack.ack().await {
                // The broker redelivers it; the redelivery is recognised.
                tracing::warn!(source = %self.spec.name, message_id = %delivery.message_id, "acknowledgement failed: {e}");
                return;
            }
        }
        if let Some(hook) = &self.faults.settled {
            hook(delivery, how);
        }
    }

    /// Writes `write` for `delivery`; the dead letter it made, if any. A
    /// refused write is tried again after a growing delay, the message
    /// held meanwhile (`ack` keeps it from redelivery) and new messages
    /// kept out ([`StoreWrites`]); this fails only when the source stops
    /// or the store is closed.
    async fn write_held(
        &self,
        ack: Option<&dyn Acker>,
        delivery: &Delivery,
        write: &Write,
    ) -> Result<Option<DeadLetterId>, StoreError> {
        let mut tries = 0;
        let mut _holding = None;
        loop {
            match self.write_once(delivery, write).await {
                Ok(dead_letter) => {
                    self.writes().wrote();
                    return Ok(dead_letter);
                }
                Err(StoreError::Closed) => return Err(StoreError::Closed),
                Err(e) => {
                    self.writes().refused(&self.spec.name, &e);
                    _holding.get_or_insert_with(|| self.hold(self.key(delivery)));
                    if !self.wait_to_retry(tries, ack).await {
                        return Err(e);
                    }
                    tries += 1;
                }
            }
        }
    }

    /// One try of `write`.
    async fn write_once(
        &self,
        delivery: &Delivery,
        write: &Write,
    ) -> Result<Option<DeadLetterId>, StoreError> {
        if matches!(write, Write::Nothing) {
            return Ok(None);
        }
        if let Some(refuse) = &self.faults.refuse_write {
            if let Some(e) = refuse(delivery) {
                return Err(e);
            }
        }
        let store = self.host.store();
        match write {
            Write::Nothing => Ok(None),
            Write::ReleaseHeldRetry => store
                .release_held_retry(self.key(delivery))
                .await
                .map(|_| None),
            Write::RedrivenSucceeded => store
                .redriven_message_succeeded(self.key(delivery), now())
                .await
                .map(|()| None),
            Write::HoldRetry(p) => store.hold_retry((**p).clone()).await.map(|()| None),
            Write::Quarantine(dl) => self.quarantine((**dl).clone()).await.map(|q| Some(q.id)),
        }
    }

    /// The message's key in the store: its held retry and its dead
    /// letter are those of this source, message id, body and redrive id.
    fn key(&self, d: &Delivery) -> MessageKey {
        MessageKey::of(
            self.spec.name.clone(),
            d.message_id.clone(),
            &d.body,
            redrive_id(d),
        )
    }

    /// Marks `key` as held for a refused write until the mark is dropped.
    fn hold(&self, key: MessageKey) -> Holding<'_> {
        *self
            .holding
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.clone())
            .or_default() += 1;
        Holding {
            keys: &self.holding,
            key,
        }
    }

    fn is_holding(&self, key: &MessageKey) -> bool {
        self.holding
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(key)
    }

    /// How often this source handed `d` back before this delivery (and
    /// forgets it: the delivery at hand accounts for them). Its key (a
    /// hash of the body) is computed only when some message was handed
    /// back.
    fn given_back_before(&self, d: &Delivery) -> u32 {
        let mut given = self.given_back.lock().unwrap_or_else(|p| p.into_inner());
        if given.is_empty() {
            return 0;
        }
        given.remove(&self.key(d)).unwrap_or(0)
    }

    /// Hands a message back to the broker (it could not be recorded and
    /// cannot be held any longer: the source stops, or the store is
    /// closed), remembering it so that its redelivery is not taken for a
    /// crash, and counting it ([`Host::given_back`]).
    async fn give_back(&self, ack: Box<dyn Acker>, d: &Delivery, e: &StoreError) {
        tracing::warn!(source = %self.spec.name, message_id = %d.message_id, "cannot record a message's outcome: {e}; handing it back to the broker");
        {
            let key = self.key(d);
            let mut given = self.given_back.lock().unwrap_or_else(|p| p.into_inner());
            if given.len() < GIVEN_BACK_MAX || given.contains_key(&key) {
                *given.entry(key).or_default() += 1;
            }
        }
        self.host.given_back(&self.spec.name);
        if let Err(e) = ack.release().await {
            tracing::warn!(source = %self.spec.name, "handing it back failed too: {e}; the broker redelivers it when the connection drops");
        }
    }

    /// The source of a retry held on the broker, recording the broker's
    /// count of earlier deliveries ([`HELD_PRIOR`]).
    fn held_ref(&self, d: &Delivery) -> SourceRef {
        let mut source = self.source_ref(d);
        with_position_key(&mut source, HELD_PRIOR, d.broker_prior.into());
        source
    }

    fn source_ref(&self, d: &Delivery) -> SourceRef {
        SourceRef {
            name: self.spec.name.clone(),
            broker: self.broker.kind().to_owned(),
            queue: d.queue.clone(),
            message_id: d.message_id.clone(),
            headers: d.headers.clone(),
            position: d.position.clone(),
            content_type: d.content_type.clone(),
            redrive_id: redrive_id(d),
        }
    }
}

/// Sets `key` in a source's position (a position that is no object is
/// kept under `broker`).
fn with_position_key(source: &mut SourceRef, key: &str, value: serde_json::Value) {
    let mut position = match std::mem::take(&mut source.position) {
        serde_json::Value::Object(m) => m,
        serde_json::Value::Null => serde_json::Map::new(),
        other => {
            let mut m = serde_json::Map::new();
            m.insert("broker".into(), other);
            m
        }
    };
    position.insert(key.into(), value);
    source.position = serde_json::Value::Object(position);
}

/// A held retry as a delivery again.
fn held_retry_delivery(p: &HeldRetry) -> Delivery {
    Delivery {
        message_id: p.source.message_id.clone(),
        body: p.body.clone(),
        content_type: p.source.content_type.clone(),
        headers: p.source.headers.clone(),
        broker_prior: 0,
        redelivered: false,
        queue: p.source.queue.clone(),
        position: p.source.position.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_time_is_never_before_the_clock_it_was_read_from() {
        let ms = Duration::from_millis;
        assert_eq!(millis_up(Duration::ZERO), 0);
        assert_eq!(millis_up(ms(300)), 300);
        assert_eq!(millis_up(Duration::from_nanos(1)), 1);
        assert_eq!(millis_up(ms(299) + Duration::from_micros(765)), 300);
        assert_eq!(millis_up(ms(300) + Duration::from_nanos(1)), 301);
        // `now` floors the same instant it would round up.
        assert_eq!(millis(ms(299) + Duration::from_micros(765)), 299);
    }
}
