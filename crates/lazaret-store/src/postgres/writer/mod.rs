//! The writer task: every change is a [`Request`] on a channel; the task takes
//! all pending requests into one transaction (group commit), so concurrent
//! requests share one commit (one WAL flush) instead of paying one each.
//! The commit does not wait for its flush: the writer goes on with the next
//! group, answers a lease at once and hands every other answer to the
//! flusher (`flush.rs`), which sends it once a later commit of its own is
//! flushed; that file says what a crash can take back (a lease only).
//!
//! If an op fails, the whole group rolls back and each of its ops runs
//! again alone, in a transaction of its own (a serialization failure or a
//! deadlock with another node is retried a few times), so one bad op
//! cannot fail the others and every answer is what happened.
//!
//! Counts per (lane, tenant) (`pairs`) and ready counts per (lane, tenant,
//! type) (`ready_types`) change with every transition; the group gathers
//! the changes and writes them once, in key order (the pairs first, then
//! their types), before its commit. A lease locks the pairs it may take
//! from (`FOR UPDATE`): their counts are then the cluster's, and another
//! node's lease of the same tenant waits for this commit, so a tenant's
//! in-flight cap holds across nodes. What to lease is the core's
//! `plan_lease`, from those counts by type; this writer only runs each
//! take's SQL. Jobs are picked `FOR UPDATE SKIP LOCKED`: two nodes never
//! wait on, or take, the same job.
//!
//! This file is the group commit loop; `requests.rs` runs each
//! [`Request`] with its function, which lives in the file named for its
//! concern (`jobs`, `leases` and `lease_plan`, `outcomes`, `dead_letters`,
//! `sources`, `tokens`, `stats`), as in SQLite's writer; `flush.rs` sends
//! the answers that wait for the disk.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use lazaret_core::{
    Among, Envelope, Event, FairScheduler, JobId, JobState, JobType, Lane, LaneWindow, LeaseFilter,
    PairCounts, TenantId, Timestamp, Transition, payload_preview, plan_lease,
};
use tokio::sync::mpsc;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, Statement};

use super::{Channels, Clock, pg};
use crate::request::{Reply, Request};
use crate::stored::StoredJob;
use crate::{
    AdmissionRecord, ApiToken, AuditEntry, AuditId, Completed, Completion, DeadLetterId, Decider,
    EnqueueOutcome, GroupCommitStats, HeldRetry, ItemError, LaneCounts, LeaseRequest, LeaseToken,
    LeasedJob, MessageKey, NewJob, Quarantined, SourceDeadLetter, StoreError, StoreStats, Tick,
    TokenError,
};

mod dead_letters;
mod flush;
mod jobs;
mod lease_plan;
mod leases;
mod outcomes;
#[cfg(test)]
mod plans;
mod requests;
mod sources;
mod stats;
mod tokens;

use flush::Answer;
pub(super) use flush::Flusher;
use leases::{LEASE_ASSIGN_SQL, leases_merge};
use stats::{COUNTS_SQL, CountChanges, PAIRS_COUNTS_SQL};

/// [`BEGIN_SQL`]'s text, a literal that [`BEGIN_CLOCK_SQL`] starts with too.
macro_rules! begin_sql {
    () => {
        "BEGIN; SET LOCAL synchronous_commit = off"
    };
}

/// A group's start: its `COMMIT` does not wait for the WAL flush (the
/// flusher does, for the answers that need it).
const BEGIN_SQL: &str = begin_sql!();

/// [`BEGIN_SQL`] and a read of the database's clock (in ms) behind it, in
/// one simple query: one answer for both (the server sends its answers
/// at the end of each query, one write each).
const BEGIN_CLOCK_SQL: &str = concat!(
    begin_sql!(),
    "; SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8"
);

/// The clock [`BEGIN_CLOCK_SQL`] read.
fn clock_of(answer: &[tokio_postgres::SimpleQueryMessage]) -> Result<i64, StoreError> {
    answer
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0),
            _ => None,
        })
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| corrupt("the database's clock read gave no number"))
}

/// Ops in one group at most.
const GROUP_MAX: usize = 256;
/// Tries of an op alone after a serialization failure or deadlock.
const RETRIES_MAX: u32 = 5;
/// The columns `StoredJob` is read from, in `stored_job`'s order.
const COLUMNS: &str = "id, type, tenant, lane, state, attempts, lease_started_at, worker_id, \
     idempotency_key, schema_version, created_at, finished_at, envelope, payload";

/// A caller's time `t`, given at the caller's `now`, on the database's
/// clock (`db_now`): the same distance from now.
fn rebase(db_now: Option<Timestamp>, t: Timestamp, now: Timestamp) -> Timestamp {
    match db_now {
        Some(d) => Timestamp::from_millis(d.as_millis() + (t.as_millis() - now.as_millis())),
        None => t,
    }
}

/// What the writer task takes: a request, or the store's close.
// Mostly requests, moved once into the channel.
#[allow(clippy::large_enum_variant)]
pub(super) enum Cmd {
    Request(Request),
    Close(Reply<()>),
}

impl Cmd {
    /// Answers a command that comes after the close.
    fn refuse(self) {
        match self {
            Cmd::Request(r) => r.reply().fail(StoreError::Closed),
            Cmd::Close(reply) => reply.send(Err(StoreError::Closed)),
        }
    }
}

/// A request's answer, held until its group commits: then it takes the
/// answer's way out of the request's reply, to send at once (a lease) or
/// once the commit is on disk ([`flush`]).
pub(super) type Held<'a> = Box<dyn FnOnce() -> Answer + Send + 'a>;

/// Holds `v` as the answer for `reply`.
fn held<'a, T: Send + 'static>(reply: &'a Reply<T>, v: T) -> Held<'a> {
    Box::new(move || {
        let reply = reply.detach();
        Box::new(move |e: Option<StoreError>| reply.send(e.map_or(Ok(v), Err)))
    })
}

#[derive(Clone, Copy, Debug, Default)]
struct Delta {
    ready: i64,
    inflight: i64,
    scheduled: i64,
    succeeded: i64,
    cancelled: i64,
}

/// What the group changed, written before its commit.
#[derive(Default)]
struct Group {
    /// Whether this group holds [`COUNTS_LOCK`] already (a lease took it),
    /// so its commit need not ask again.
    counts_locked: bool,
    /// Count changes per (lane, tenant), applied in key order.
    deltas: BTreeMap<(String, String), Delta>,
    /// Ready count changes per (lane, tenant, type), applied in key order
    /// after the pairs' (`ready_types`); they add up to `deltas`' `ready`.
    typed: BTreeMap<(String, String, String), i64>,
    /// Counts read in this group (before its own deltas).
    base: HashMap<(String, String), (i64, i64)>,
    /// Ready counts by type of the pairs a lease of this group locked
    /// (before the group's own changes).
    base_types: HashMap<(String, String), BTreeMap<JobType, i64>>,
    /// Anything may have become leasable: other nodes' long-polls should look.
    wake: bool,
    /// Only these (lane, type) pairs became leasable (enqueues).
    woken: BTreeSet<(String, String)>,
    /// Jobs of merged leases to give their own request's worker and lease
    /// end (id, worker, end in ms), written with the commit: no op of the
    /// group reads them (their tokens are unknown until it commits, and
    /// they expire after the group's time).
    assign: (Vec<i64>, Vec<String>, Vec<i64>),
    /// The database's clock at the group's start (`Clock::Database`), or
    /// `None`: the callers' times stand (`Writer::now_of`, `Writer::rebase`).
    db_now: Option<Timestamp>,
    /// The group's successes sent with its first statements (ids and
    /// tokens, time, rows to come), for `complete_items` to take
    /// ([`Writer::send_succeed_early`]).
    early_succeed: Option<SentSucceed>,
    /// The group's first lease's first walk batch, sent with its first
    /// statements ([`Writer::send_walk_early`]).
    early_walk: Option<lease_plan::EarlyWalk>,
}

/// A [`outcomes::SUCCEED_SQL`] sent early: its (ids, tokens), its time and
/// its rows to come.
type SentSucceed = ((Vec<i64>, Vec<i64>), Timestamp, Early<Vec<Row>>);

/// At most this many (lane, type) pairs named in one notification; more
/// wake every waiter (a NOTIFY payload is at most 8000 bytes).
const WOKEN_MAX: usize = 16;

pub(super) struct Writer {
    /// Shared with the statements a group sends before it needs their
    /// answers ([`Early`]).
    client: Arc<Client>,
    /// Answers the group's requests other than leases once its commit is
    /// flushed ([`flush`]).
    flusher: Flusher,
    /// The number the group's `COMMIT` was sent under ([`Flusher::sent`]).
    sent: u64,
    /// To connect again when the database restarts or the connection drops.
    opts: super::PgOptions,
    /// Why the writer cannot reach the database now (`Store::failure`).
    down: Arc<std::sync::Mutex<Option<String>>>,
    statements: HashMap<&'static str, Statement>,
    scheduler: FairScheduler,
    decider: Arc<dyn Decider>,
    clock: Clock,
    channels: Channels,
    group: Group,
    commits: u64,
    commands: u64,
    /// Lease ops run since start.
    leases: u64,
    /// (lane, tenant) pairs those leases looked at (`GroupCommitStats::lease_pairs`).
    lease_pairs: u64,
    /// Groups rolled back for a deadlock or a serialization failure
    /// (`GroupCommitStats::conflicts`).
    conflicts: u64,
    /// This schema's [`COUNTS_LOCK`] key.
    counts_lock: i64,
    /// This schema's [`RETENTION_LOCK`] key.
    retention_lock: i64,
    /// The database's clock as last read (in ms) and when that read was
    /// sent: a group's time is estimated from it while it is fresh
    /// ([`CLOCK_FRESH`]), so `BEGIN` and the group's first statements go
    /// out together, and each group reads the clock again behind its
    /// `BEGIN`.
    clock_read: Option<(i64, std::time::Instant)>,
    /// The last group's time: group times never go back.
    last_now: i64,
}

/// How long a reading of the database's clock stands in for reading it
/// again: a group's time is then the reading plus the time passed on this
/// node's monotonic clock (off by the reading's round trip at most, and by
/// the two clocks' rate difference: under a millisecond a second). An
/// idle writer's first group reads the clock before its first statement.
const CLOCK_FRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// A statement on its way, sent before its answer is needed: the
/// group's later statements go out behind it without waiting for it (the
/// connection answers in order), and its rows are taken when needed.
pub(super) type Early<T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, StoreError>> + Send>>;

/// A statement's future, not sent yet.
pub(super) type Unsent<T> =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<T, tokio_postgres::Error>> + Send>>;

/// Sends `fut`'s statement now (one poll puts it on the connection's
/// queue, ahead of whatever the writer sends next) and leaves the rest to
/// a task of its own, which takes the answer as it comes: an answer
/// nobody reads would fill its channel and stall the connection, and with
/// it every later answer. Dropped unawaited, the task still takes the
/// answer, and ends.
async fn send_early<T: Send + 'static>(mut fut: Unsent<T>) -> Early<T> {
    match futures_util::poll!(fut.as_mut()) {
        std::task::Poll::Ready(r) => Box::pin(std::future::ready(pg(r))),
        std::task::Poll::Pending => {
            let task = tokio::spawn(fut);
            Box::pin(async move {
                match task.await {
                    Ok(r) => pg(r),
                    Err(e) => Err(StoreError::NotApplied(format!(
                        "a statement of the store's writer was lost ({e}); retry the request"
                    ))),
                }
            })
        }
    }
}

/// What a group sent before its body: `BEGIN`'s answer and, when the
/// group's time was estimated, when the clock read in that answer
/// ([`BEGIN_CLOCK_SQL`]) was sent.
struct Begun {
    begin: Early<Vec<tokio_postgres::SimpleQueryMessage>>,
    clock_sent: Option<std::time::Instant>,
}

/// The advisory lock (per schema, see [`schema_lock`]) a group takes before
/// its first lock of a `pairs` or `ready_types` row, held to its commit.
///
/// A group locks those rows twice: a lease locks the pairs it plans from
/// (`FOR UPDATE`, in key order), and the commit upserts every pair and type
/// count the group changed (in key order too). Two nodes' groups each in
/// key order can still wait on each other across the two statements (one
/// leased from pair B and upserts A, the other leased from A and upserts
/// B), and PostgreSQL breaks such a deadlock only after its
/// `deadlock_timeout` (1 s by default): with two nodes under one-job
/// requests, 620 of them in one 15 s run, 50 jobs/s instead of 900. Under
/// this lock the counts' rows are taken by one group at a time, in whatever
/// order (a lease's walk locks the pairs it reads, lane by lane from the
/// round's position); what runs before it (the enqueue insert, the acks)
/// still runs on both nodes at once. On one node it is never
/// contended, and it goes out pipelined with the statement after it.
pub(super) const COUNTS_LOCK: u32 = 0x6c7a_636e;

/// Takes [`COUNTS_LOCK`]: a lease's pair lock and a commit's count
/// upserts send it first in the same pipeline, unless the group holds it.
pub(super) const LOCK_COUNTS_SQL: &str = "SELECT pg_advisory_xact_lock($1)";

/// The advisory lock retention holds, so one node at a time deletes.
pub(super) const RETENTION_LOCK: u32 = 0x6c7a_7274;

/// The `bigint` advisory lock key of `class` in `schema`: the class in the
/// high half, an FNV-1a hash of the schema name in the low half, so two
/// clusters in two schemas of one database never wait on each other.
/// (The duties' session locks use the two-`int` form, which PostgreSQL
/// keeps apart from `bigint` keys.)
pub(super) fn schema_lock(schema: &str, class: u32) -> i64 {
    let h = schema.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    (i64::from(class) << 32) | i64::from(h)
}

/// Whether the database rolled a transaction back for a deadlock or a
/// serialization failure.
fn conflict(e: &StoreError) -> bool {
    matches!(e, StoreError::Db(d) if matches!(d.code.as_deref(), Some("40001" | "40P01")))
}

fn ms(t: Timestamp) -> i64 {
    t.as_millis()
}

/// A count of the database's as the core counts (negative: 0; past
/// `u32::MAX`: `u32::MAX`).
fn count32(n: i64) -> u32 {
    u32::try_from(n.max(0)).unwrap_or(u32::MAX)
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// Whether another try alone may succeed: a serialization failure, a
/// deadlock with another node, or a unique key another node took meanwhile.
fn retryable(e: &StoreError) -> bool {
    matches!(e, StoreError::Db(d) if matches!(d.code.as_deref(), Some("40001" | "40P01" | "23505")))
}

/// A `jobs` row read with [`COLUMNS`] (and extra columns after them).
pub(super) fn stored_job(r: &Row) -> Result<StoredJob, StoreError> {
    let state: String = r.get(4);
    Ok(StoredJob {
        id: r.get(0),
        job_type: r.get(1),
        tenant: r.get(2),
        lane: r.get(3),
        state: state.parse::<JobState>().map_err(corrupt)?,
        attempts: i64::from(r.get::<_, i32>(5)),
        lease_started_at: r.get(6),
        worker_id: r.get(7),
        idempotency_key: r.get(8),
        schema_version: r.get::<_, Option<i32>>(9).map(i64::from),
        created_at: r.get(10),
        finished_at: r.get(11),
        envelope: r.get(12),
        payload: r.get(13),
        // By name: only the queries that need it select it.
        traceparent: r.try_get::<_, Option<String>>("traceparent").ok().flatten(),
    })
}

pub(super) const JOB_COLUMNS: &str = COLUMNS;

impl Writer {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        client: Client,
        flusher: Flusher,
        opts: super::PgOptions,
        down: Arc<std::sync::Mutex<Option<String>>>,
        scheduler: FairScheduler,
        decider: Arc<dyn Decider>,
        clock: Clock,
        channels: Channels,
    ) -> Self {
        Writer {
            client: Arc::new(client),
            clock_read: None,
            last_now: i64::MIN,
            flusher,
            sent: 0,
            down,
            statements: HashMap::new(),
            scheduler,
            decider,
            clock,
            channels,
            group: Group::default(),
            commits: 0,
            commands: 0,
            leases: 0,
            lease_pairs: 0,
            conflicts: 0,
            counts_lock: schema_lock(&opts.schema, COUNTS_LOCK),
            retention_lock: schema_lock(&opts.schema, RETENTION_LOCK),
            opts,
        }
    }

    /// Runs groups until closed; `waiting` counts the commands sent and not
    /// taken yet (the store's bound on them), so each one taken counts down.
    pub(super) async fn run(
        mut self,
        mut rx: mpsc::UnboundedReceiver<Cmd>,
        waiting: Arc<std::sync::atomic::AtomicUsize>,
    ) {
        use std::sync::atomic::Ordering;
        let mut batch: Vec<Cmd> = Vec::with_capacity(GROUP_MAX);
        while let Some(first) = rx.recv().await {
            batch.push(first);
            while batch.len() < GROUP_MAX {
                match rx.try_recv() {
                    Ok(cmd) => batch.push(cmd),
                    Err(_) => break,
                }
            }
            waiting.fetch_sub(batch.len(), Ordering::AcqRel);
            let close = batch.iter().position(|c| matches!(c, Cmd::Close(_)));
            let rest = close.map(|i| batch.split_off(i));
            let requests: Vec<Request> = batch
                .drain(..)
                .map(|c| match c {
                    Cmd::Request(r) => r,
                    Cmd::Close(_) => unreachable!("closes are split off"),
                })
                .collect();
            if !requests.is_empty() {
                self.run_group(requests).await;
            }
            if let Some(rest) = rest {
                // Everything after the close is refused; the close is
                // answered once every answer held for a flush is sent.
                let mut rest = rest.into_iter();
                let close = rest.next();
                for cmd in rest {
                    cmd.refuse();
                }
                rx.close();
                while let Ok(cmd) = rx.try_recv() {
                    waiting.fetch_sub(1, Ordering::AcqRel);
                    cmd.refuse();
                }
                self.flusher.close().await;
                if let Some(Cmd::Close(reply)) = close {
                    reply.send(Ok(()));
                }
                return;
            }
        }
    }

    /// Sends the answers of a committed group: a lease's at once, the
    /// others once the commit is flushed (see [`flush`]).
    fn answer<'a>(&self, ops: &[&'a Request], answers: Vec<Held<'a>>) {
        let mut durable = Vec::with_capacity(answers.len());
        for (op, answer) in ops.iter().zip(answers) {
            let answer = answer();
            if matches!(op, Request::Lease { .. }) {
                answer(None);
            } else {
                durable.push(answer);
            }
        }
        self.flusher.hand(self.sent, durable);
    }

    async fn run_group(&mut self, batch: Vec<Request>) {
        let ops: Vec<&Request> = batch.iter().collect();
        match self.transaction(&ops).await {
            Ok(answers) => {
                self.commits += 1;
                self.commands += ops.len() as u64;
                self.answer(&ops, answers);
            }
            Err(_) if batch.len() > 1 => {
                // Each op alone: one bad op must not fail the others.
                for op in &batch {
                    match self.alone(op).await {
                        Ok(answer) => self.answer(&[op], vec![answer]),
                        Err(e) => op.reply().fail(e),
                    }
                }
            }
            Err(first) => {
                let op = &batch[0];
                let r = if retryable(&first) {
                    self.alone(op).await
                } else {
                    Err(first)
                };
                match r {
                    Ok(answer) => self.answer(&[op], vec![answer]),
                    Err(e) => op.reply().fail(e),
                }
            }
        }
    }

    async fn alone<'a>(&mut self, op: &'a Request) -> Result<Held<'a>, StoreError> {
        let mut tries = 0;
        loop {
            match self.transaction(&[op]).await {
                Ok(mut a) => {
                    self.commits += 1;
                    self.commands += 1;
                    return Ok(a.pop().expect("one answer"));
                }
                Err(e) if retryable(&e) && tries < RETRIES_MAX => tries += 1,
                Err(e) => return Err(e),
            }
        }
    }

    /// Connects again if the connection is gone (a database restart, a
    /// network cut): the ops of a group that met a closed connection failed
    /// as not applied (or, at COMMIT, unknown), later ones go on.
    async fn reconnect(&mut self) -> Result<(), StoreError> {
        if !self.client.is_closed() {
            return Ok(());
        }
        match super::connect(&self.opts, None).await {
            Ok(c) => {
                tracing::info!("PostgreSQL: the writer connected again");
                // The flusher too, before this connection sends a COMMIT.
                if let Err(e) = self.flusher.connect_again().await {
                    *self.down.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(format!("the store's database is unreachable: {e}"));
                    return Err(e);
                }
                self.client = Arc::new(c);
                self.statements.clear();
                *self.down.lock().unwrap_or_else(|p| p.into_inner()) = None;
                Ok(())
            }
            Err(e) => {
                *self.down.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(format!("the store's database is unreachable: {e}"));
                Err(e)
            }
        }
    }

    /// Runs ops in one transaction; on any error rolls it back.
    ///
    /// Round trips are what a group costs on PostgreSQL (each is a wake-up
    /// of the server process and of this task), so the fixed ones are
    /// pipelined: `BEGIN` goes out with the read of the database's clock,
    /// and the count changes, the notification and `COMMIT` go out
    /// together. Every statement's result is checked: an error in any of
    /// them aborts the transaction (PostgreSQL answers a `COMMIT` of an
    /// aborted transaction by rolling it back), and the group fails as
    /// not applied.
    async fn transaction<'a>(&mut self, ops: &[&'a Request]) -> Result<Vec<Held<'a>>, StoreError> {
        self.reconnect().await?;
        self.group = Group::default();
        let r = match self.begin().await {
            Ok((db_now, begun)) => {
                self.group.db_now = db_now;
                match self.body(ops, db_now).await {
                    Ok(answers) => match self.begun(begun).await {
                        Ok(()) => self.commit().await.map(|()| answers),
                        Err(e) => Err(e),
                    },
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        if let Err(e) = &r {
            if conflict(e) {
                self.conflicts += 1;
            }
            let _ = self.client.batch_execute("ROLLBACK").await;
        }
        r
    }

    /// `BEGIN` (with `synchronous_commit = off`: the answers that must be
    /// durable wait for the flusher, see [`flush`]) and the group's time.
    /// On the database's clock, the time is estimated from a fresh reading
    /// ([`CLOCK_FRESH`]) and `BEGIN` is sent without waiting for it, with
    /// a new reading in the same query ([`BEGIN_CLOCK_SQL`]; [`Writer::begun`]
    /// takes both before the commit); otherwise that query is waited for.
    async fn begin(&mut self) -> Result<(Option<Timestamp>, Begun), StoreError> {
        let send_begin = |client: &Arc<Client>, sql: &'static str| -> Unsent<_> {
            let client = Arc::clone(client);
            Box::pin(async move { client.simple_query(sql).await })
        };
        let db_now = match self.clock {
            Clock::Caller => {
                let begin = send_early(send_begin(&self.client, BEGIN_SQL)).await;
                let begun = Begun {
                    begin,
                    clock_sent: None,
                };
                return Ok((None, begun));
            }
            Clock::Database => match self.clock_read {
                Some((at, read)) if read.elapsed() < CLOCK_FRESH => {
                    at + i64::try_from(read.elapsed().as_millis()).unwrap_or(i64::MAX)
                }
                _ => {
                    let sent = std::time::Instant::now();
                    let at = clock_of(&pg(self.client.simple_query(BEGIN_CLOCK_SQL).await)?)?;
                    self.clock_read = Some((at, sent));
                    self.last_now = self.last_now.max(at);
                    let begun = Begun {
                        begin: Box::pin(std::future::ready(Ok(Vec::new()))),
                        clock_sent: None,
                    };
                    return Ok((Some(Timestamp::from_millis(self.last_now)), begun));
                }
            },
        };
        let sent = std::time::Instant::now();
        let begin = send_early(send_begin(&self.client, BEGIN_CLOCK_SQL)).await;
        self.last_now = self.last_now.max(db_now);
        Ok((
            Some(Timestamp::from_millis(self.last_now)),
            Begun {
                begin,
                clock_sent: Some(sent),
            },
        ))
    }

    /// Takes what [`Writer::begin`] sent early: `BEGIN`'s answer (an error
    /// fails the group) and the clock's new reading. The group's statements
    /// went out behind `BEGIN` before its answer came: on a connection that
    /// is up, `BEGIN` does not fail (inside a transaction it only warns),
    /// and on one that is down they fail with it.
    async fn begun(&mut self, begun: Begun) -> Result<(), StoreError> {
        let answer = begun.begin.await?;
        if let Some(sent) = begun.clock_sent {
            self.clock_read = Some((clock_of(&answer)?, sent));
        }
        Ok(())
    }

    /// The group's count changes and its notification (one statement,
    /// [`COUNTS_SQL`]) and `COMMIT`, pipelined.
    async fn commit(&mut self) -> Result<(), StoreError> {
        let counts = self.count_changes();
        let notify = if self.group.wake || !self.group.woken.is_empty() {
            let woken = std::mem::take(&mut self.group.woken);
            let payload = if self.group.wake || woken.len() > WOKEN_MAX {
                String::new()
            } else {
                serde_json::to_string(&woken).map_err(corrupt)?
            };
            Some((self.channels.ready.clone(), payload))
        } else {
            None
        };
        let counts_st = self.stmt(COUNTS_SQL).await?;
        let assign_st = self.stmt(LEASE_ASSIGN_SQL).await?;
        let lock_st = self.stmt(LOCK_COUNTS_SQL).await?;
        let assign = std::mem::take(&mut self.group.assign);
        let client = &self.client;
        let (counts_lock, counts_locked) = (self.counts_lock, self.group.counts_locked);
        let changed = !counts.is_empty();
        let locked = async {
            if counts_locked || !changed {
                return Ok(());
            }
            client.execute(&lock_st, &[&counts_lock]).await.map(drop)
        };
        let assigned = async {
            if assign.0.is_empty() {
                return Ok(());
            }
            client
                .execute(&assign_st, &[&assign.0, &assign.1, &assign.2])
                .await
                .map(drop)
        };
        let counted = async {
            if !changed && notify.is_none() {
                return Ok(());
            }
            let CountChanges {
                pairs: c,
                types: (lanes, tenants, types, ready),
            } = counts;
            let (channel, payload) = match notify {
                Some((channel, payload)) => (Some(channel), payload),
                None => (None, String::new()),
            };
            client
                .execute(
                    &counts_st,
                    &[
                        &c.lanes,
                        &c.tenants,
                        &c.ready,
                        &c.inflight,
                        &c.scheduled,
                        &c.succeeded,
                        &c.cancelled,
                        &lanes,
                        &tenants,
                        &types,
                        &ready,
                        &channel,
                        &payload,
                    ],
                )
                .await
                .map(drop)
        };
        self.sent = self.flusher.sent();
        let (l, a, n, c) =
            futures_util::join!(locked, assigned, counted, client.batch_execute("COMMIT"));
        pg(l)?;
        pg(a)?;
        pg(n)?;
        pg(c)
    }

    async fn body<'a>(
        &mut self,
        ops: &[&'a Request],
        db_now: Option<Timestamp>,
    ) -> Result<Vec<Held<'a>>, StoreError> {
        let mut answers: Vec<Option<Held<'a>>> = ops.iter().map(|_| None).collect();
        self.send_succeed_early(ops, db_now).await?;
        self.send_walk_early(ops, db_now).await?;
        // Ops of one kind from concurrent requests run as one: every
        // enqueue of the group is one insert, every outcome at one time one
        // lock and one update, and compatible leases one lease. Concurrent
        // requests may be applied in any order, so running them together
        // (enqueues first, so leases of the group can take their jobs)
        // answers each as if it had run alone in some order.
        self.enqueue_group(ops, db_now, &mut answers).await?;
        self.complete_group(ops, db_now, &mut answers).await?;
        for i in 0..ops.len() {
            if answers[i].is_some() {
                continue;
            }
            if let Request::Lease { req: first, .. } = ops[i] {
                let mut members = vec![i];
                for (j, op) in ops.iter().enumerate().skip(i + 1) {
                    if let Request::Lease { req: other, .. } = op
                        && answers[j].is_none()
                        && leases_merge(first, other, db_now)
                    {
                        members.push(j);
                    }
                }
                let reqs: Vec<LeaseRequest> = members
                    .iter()
                    .map(|&j| match ops[j] {
                        Request::Lease { req: r, .. } => LeaseRequest {
                            now: db_now.unwrap_or(r.now),
                            ..r.clone()
                        },
                        _ => unreachable!("members are leases"),
                    })
                    .collect();
                self.leases += reqs.len() as u64;
                let leased = self.lease_many(&reqs).await?;
                for (j, jobs) in members.into_iter().zip(leased) {
                    answers[j] = Some(match ops[j] {
                        Request::Lease { reply, .. } => held(reply, jobs),
                        _ => unreachable!("members are leases"),
                    });
                }
                continue;
            }
            answers[i] = Some(self.run_request(ops[i]).await?);
        }
        Ok(answers
            .into_iter()
            .map(|a| a.expect("every op answered"))
            .collect())
    }

    async fn stmt(&mut self, sql: &'static str) -> Result<Statement, StoreError> {
        if let Some(s) = self.statements.get(sql) {
            return Ok(s.clone());
        }
        let s = pg(self.client.prepare(sql).await)?;
        self.statements.insert(sql, s.clone());
        Ok(s)
    }

    async fn query(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, StoreError> {
        let st = self.stmt(sql).await?;
        pg(self.client.query(&st, params).await)
    }

    async fn execute(
        &mut self,
        sql: &'static str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        let st = self.stmt(sql).await?;
        pg(self.client.execute(&st, params).await)
    }
}
