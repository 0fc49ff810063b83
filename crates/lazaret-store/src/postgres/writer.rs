//! The writer task: every change is an [`Op`] on a channel; the task takes
//! all pending ops into one transaction (group commit), so concurrent
//! requests share one commit (one WAL flush) instead of paying one each.
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
use crate::stored::StoredJob;
use crate::{
    AdmissionRecord, ApiToken, AuditEntry, AuditId, Completed, Completion, DeadLetterId, Decider,
    EnqueueOutcome, GroupCommitStats, ItemError, LaneCounts, LeaseRequest, LeaseToken, LeasedJob,
    MessageKey, NewJob, ParkedMessage, Quarantined, SourceDeadLetter, StoreError, StoreStats, Tick,
    TokenError,
};

/// Ops in one group at most.
const GROUP_MAX: usize = 256;
/// Scheduled jobs promoted per tick at most.
const PROMOTE_MAX: i64 = 20_000;
/// Expired leases handled per tick at most.
const EXPIRE_MAX: i64 = 2_000;
/// Tries of an op alone after a serialization failure or deadlock.
const RETRIES_MAX: u32 = 5;
/// The advisory lock retention holds, so one node at a time deletes.
pub(super) const RETENTION_LOCK: i64 = 0x6c61_7a61_7265_7402;

/// Lanes with jobs ready, by a skip scan of `pairs_walk`: one index probe
/// per lane, however many tenants wait in it.
const READY_LANES_SQL: &str = "WITH RECURSIVE l(lane) AS (
        (SELECT lane FROM pairs WHERE ready > 0 ORDER BY lane LIMIT 1)
        UNION ALL
        SELECT (SELECT p.lane FROM pairs p WHERE p.ready > 0 AND p.lane > l.lane ORDER BY p.lane LIMIT 1)
        FROM l WHERE l.lane IS NOT NULL)
    SELECT lane FROM l WHERE lane IS NOT NULL";

/// The types with jobs ready in lane `$1`, by a skip scan of `ready_types_walk`.
const LANE_TYPES_SQL: &str = "WITH RECURSIVE t(type) AS (
        (SELECT type FROM ready_types WHERE lane = $1 AND ready > 0 ORDER BY type LIMIT 1)
        UNION ALL
        SELECT (SELECT r.type FROM ready_types r WHERE r.lane = $1 AND r.ready > 0 AND r.type > t.type
                ORDER BY r.type LIMIT 1)
        FROM t WHERE t.type IS NOT NULL)
    SELECT type FROM t WHERE type IS NOT NULL";

/// The next `$3` tenants with jobs ready in lane `$1` after `$2`, in byte
/// order (`COLLATE "C"`: the order of the core's round), by `pairs_walk`.
const WALK_PAIRS_SQL: &str = r#"SELECT tenant FROM pairs
    WHERE lane = $1 AND ready > 0 AND tenant COLLATE "C" > $2
    ORDER BY tenant COLLATE "C" LIMIT $3"#;

/// The same among the tenants with jobs of the types `$4` ready, by
/// `ready_types_walk`: the first `$3` of each type, merged.
const WALK_TYPES_SQL: &str = r#"SELECT DISTINCT w.tenant COLLATE "C" FROM unnest($4::text[]) AS ty(type),
    LATERAL (SELECT r.tenant FROM ready_types r
             WHERE r.lane = $1 AND r.type = ty.type AND r.ready > 0 AND r.tenant COLLATE "C" > $2
             ORDER BY r.tenant COLLATE "C" LIMIT $3) w
    ORDER BY 1 LIMIT $3"#;

/// Counts of the tenants `$2` of lane `$1`, by type (read without locks:
/// the walk only chooses which pairs the lease locks and plans from).
const WALK_COUNTS_SQL: &str = "SELECT p.tenant, p.inflight, t.type, t.ready FROM pairs p
    LEFT JOIN ready_types t ON t.lane = p.lane AND t.tenant = p.tenant AND t.ready > 0
    WHERE p.lane = $1 AND p.tenant = ANY($2)";

/// Tenants the walk reads per statement at most.
const WALK_BATCH_MAX: u32 = 1000;

/// Leases up to `$4` queued jobs of one (lane, tenant) and one type `$3`,
/// oldest first, in one statement: one range of the typed ready index
/// `jobs_ready_type` (lane, tenant, type, run_at, id), picked `FOR UPDATE
/// SKIP LOCKED` (never a job another transaction holds), charged an attempt
/// and given a token from the sequence `lease_tokens`.
const LEASE_ONE_SQL: &str = "WITH picked AS (
                   SELECT id FROM jobs
                   WHERE lane = $1 AND tenant = $2 AND type = $3 AND state = 'queued'
                   ORDER BY run_at, id LIMIT $4 FOR UPDATE SKIP LOCKED)
                 UPDATE jobs j SET state = 'leased', attempts = j.attempts + 1, leases = j.leases + 1,
                   lease_token = nextval('lease_tokens'), lease_expires_at = $5, lease_started_at = $6,
                   worker_id = $7
                 FROM picked WHERE j.id = picked.id
                 RETURNING j.id, j.type, j.idempotency_key, j.schema_version, j.created_at, j.payload,
                   j.attempts, j.lease_token, j.run_at";

/// [`LEASE_ONE_SQL`] among several types `$3`, as SQLite's writer does it:
/// the first `$4` ready jobs of each type (a range of `jobs_ready_type`
/// each, unlocked), merged by (run_at, id), and the oldest `$4` of them
/// locked and leased. No read walks past jobs of a type it does not take.
const LEASE_MERGED_SQL: &str = "WITH picked AS (
                   SELECT id FROM jobs
                   WHERE id = ANY(ARRAY(
                       SELECT x.id FROM unnest($3::text[]) AS t(type)
                       CROSS JOIN LATERAL (
                         SELECT id, run_at FROM jobs
                         WHERE lane = $1 AND tenant = $2 AND type = t.type AND state = 'queued'
                         ORDER BY run_at, id LIMIT $4) x
                       ORDER BY x.run_at, x.id LIMIT $4))
                     AND state = 'queued'
                   FOR UPDATE SKIP LOCKED)
                 UPDATE jobs j SET state = 'leased', attempts = j.attempts + 1, leases = j.leases + 1,
                   lease_token = nextval('lease_tokens'), lease_expires_at = $5, lease_started_at = $6,
                   worker_id = $7
                 FROM picked WHERE j.id = picked.id
                 RETURNING j.id, j.type, j.idempotency_key, j.schema_version, j.created_at, j.payload,
                   j.attempts, j.lease_token, j.run_at";

/// The columns `StoredJob` is read from, in `stored_job`'s order.
const COLUMNS: &str = "id, type, tenant, lane, state, attempts, lease_started_at, worker_id, \
     idempotency_key, schema_version, created_at, finished_at, envelope, payload";

/// Adds a group's count changes per (lane, tenant) to `pairs`.
const PAIRS_UPSERT_SQL: &str = "INSERT INTO pairs AS p (lane, tenant, ready, inflight, scheduled, succeeded, cancelled)
     SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[], $6::int8[], $7::int8[])
     ON CONFLICT (lane, tenant) DO UPDATE SET
       ready = p.ready + excluded.ready, inflight = p.inflight + excluded.inflight,
       scheduled = p.scheduled + excluded.scheduled, succeeded = p.succeeded + excluded.succeeded,
       cancelled = p.cancelled + excluded.cancelled";

/// Adds a group's ready count changes per (lane, tenant, type) to `ready_types`.
const TYPES_UPSERT_SQL: &str = "INSERT INTO ready_types AS r (lane, tenant, type, ready)
     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[])
     ON CONFLICT (lane, tenant, type) DO UPDATE SET ready = r.ready + excluded.ready";

/// Successes on live leases (`$1` ids, `$2` their tokens, `$3` now) with
/// the running attempt in columns, which need neither policy nor history
/// (`decide`'s first rule, as SQLite's writer applies it): one statement,
/// returning what the answer needs and the counts of each job's pair.
const SUCCEED_SQL: &str =
    "UPDATE jobs j SET state = 'succeeded', finished_at = $3, lease_token = NULL,
       lease_expires_at = NULL
     FROM unnest($1::int8[], $2::int8[]) AS u(id, token)
     WHERE j.id = u.id AND j.state = 'leased' AND j.lease_token = u.token
       AND j.lease_expires_at > $3 AND j.lease_started_at IS NOT NULL
     RETURNING j.id, j.type, j.tenant, j.lane, j.attempts, j.lease_started_at, j.envelope,
       (SELECT p.ready FROM pairs p WHERE p.lane = j.lane AND p.tenant = j.tenant),
       (SELECT p.inflight FROM pairs p WHERE p.lane = j.lane AND p.tenant = j.tenant)";

/// Gives the jobs of a merged lease that went to another request than the
/// first its worker and lease end.
const LEASE_ASSIGN_SQL: &str =
    "UPDATE jobs j SET worker_id = u.worker, lease_expires_at = u.expires
     FROM unnest($1::int8[], $2::text[], $3::int8[]) AS u(id, worker, expires)
     WHERE j.id = u.id";

/// The count changes per (lane, tenant) of a group, as columns.
#[derive(Default)]
struct PairColumns {
    lanes: Vec<String>,
    tenants: Vec<String>,
    ready: Vec<i64>,
    inflight: Vec<i64>,
    scheduled: Vec<i64>,
    succeeded: Vec<i64>,
    cancelled: Vec<i64>,
}

/// Ready count changes per (lane, tenant, type), as columns.
type TypeColumns = (Vec<String>, Vec<String>, Vec<String>, Vec<i64>);

/// A group's count changes: per pair, and ready per (lane, tenant, type).
struct CountChanges {
    pairs: Option<PairColumns>,
    types: Option<TypeColumns>,
}

/// A caller's time `t`, given at the caller's `now`, on the database's
/// clock (`db_now`): the same distance from now.
fn rebase(db_now: Option<Timestamp>, t: Timestamp, now: Timestamp) -> Timestamp {
    match db_now {
        Some(d) => Timestamp::from_millis(d.as_millis() + (t.as_millis() - now.as_millis())),
        None => t,
    }
}

/// A lease's jobs (one run per take, each a (lane, tenant)) in turns:
/// the first of each take, then the second of each, and so on, so that
/// the requests sharing one lease get each what a lease of its own would
/// have taken in the scheduler's round, not one tenant's run.
fn round_robin(jobs: Vec<LeasedJob>) -> Vec<LeasedJob> {
    let mut runs: Vec<std::collections::VecDeque<LeasedJob>> = Vec::new();
    for j in jobs {
        match runs.last_mut() {
            Some(run)
                if run
                    .back()
                    .is_some_and(|b| b.lane == j.lane && b.tenant == j.tenant) =>
            {
                run.push_back(j);
            }
            _ => runs.push(std::collections::VecDeque::from([j])),
        }
    }
    let mut out = Vec::with_capacity(runs.iter().map(|r| r.len()).sum());
    while !runs.is_empty() {
        for run in &mut runs {
            out.extend(run.pop_front());
        }
        runs.retain(|r| !r.is_empty());
    }
    out
}

/// Whether two leases of one group can be planned as one: the same
/// filter (lanes and types, asked and left out), no probe quotas (a
/// half-open breaker's probes are counted per request) and the same time.
/// Workers and lease lengths may differ: each job is then given its own.
fn leases_merge(a: &LeaseRequest, b: &LeaseRequest, db_now: Option<Timestamp>) -> bool {
    a.lanes == b.lanes
        && a.types == b.types
        && a.exclude_types == b.exclude_types
        && a.exclude_lanes == b.exclude_lanes
        && a.type_limits.is_empty()
        && b.type_limits.is_empty()
        && db_now.unwrap_or(a.now) == db_now.unwrap_or(b.now)
}

/// A change to apply, with what it needs.
// One op per request, moved once into the channel: boxing the large ones
// would cost an allocation each and save nothing that matters.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(super) enum Op {
    Enqueue(Vec<NewJob>),
    Lease(LeaseRequest),
    Complete(Vec<Completion>, Timestamp),
    Heartbeat(JobId, LeaseToken, Timestamp, Timestamp),
    Cancel(JobId, Timestamp, AuditEntry),
    SetPause(crate::PauseTarget, bool, AuditEntry),
    Tick(Timestamp),
    RecordAdmission(AdmissionRecord),
    Redrive(Vec<DeadLetterId>, Timestamp, Option<AuditId>),
    RedriveCorrected(DeadLetterId, crate::PayloadFix, Timestamp, Option<AuditId>),
    Purge(Vec<DeadLetterId>, Option<AuditId>),
    Audit(AuditEntry),
    Stats,
    RemoveSucceeded(Timestamp, u32),
    CreateToken(ApiToken, AuditEntry),
    RevokeToken(String, AuditEntry),
    Quarantine(Vec<SourceDeadLetter>),
    Park(ParkedMessage),
    Unpark(crate::MessageKey),
}

/// What an op answers.
#[derive(Debug)]
pub(super) enum Answer {
    Enqueued(Vec<EnqueueOutcome>),
    Leased(Vec<LeasedJob>),
    Completed(Vec<Result<Completed, ItemError>>),
    Heartbeat(Result<crate::Heartbeat, ItemError>),
    Cancel(Result<crate::Cancelled, crate::CancelError>),
    Tick(Tick),
    DeadLetter(DeadLetterId),
    Jobs(Vec<JobId>),
    Job(Option<JobId>),
    Count(u64),
    Audit(AuditId),
    Stats(StoreStats),
    Token(Result<(), TokenError>),
    Flag(bool),
    Quarantined(Vec<Quarantined>),
    Done,
}

/// Sends an op's answer to whoever waits for it.
pub(super) type Reply = Box<dyn FnOnce(Result<Answer, StoreError>) + Send>;

/// An op and where its answer goes; `None` closes the writer.
pub(super) struct Cmd {
    pub op: Option<Op>,
    pub reply: Reply,
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
}

/// At most this many (lane, type) pairs named in one notification; more
/// wake every waiter (a NOTIFY payload is at most 8000 bytes).
const WOKEN_MAX: usize = 16;

pub(super) struct Writer {
    client: Client,
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
    })
}

pub(super) const JOB_COLUMNS: &str = COLUMNS;

impl Writer {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        client: Client,
        opts: super::PgOptions,
        down: Arc<std::sync::Mutex<Option<String>>>,
        scheduler: FairScheduler,
        decider: Arc<dyn Decider>,
        clock: Clock,
        channels: Channels,
    ) -> Self {
        Writer {
            client,
            opts,
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
            let close = batch.iter().position(|c| c.op.is_none());
            let rest = close.map(|i| batch.split_off(i));
            if !batch.is_empty() {
                self.run_group(std::mem::take(&mut batch)).await;
            }
            if let Some(rest) = rest {
                // Everything after the close is refused; the close is answered.
                for (i, cmd) in rest.into_iter().enumerate() {
                    (cmd.reply)(if i == 0 {
                        Ok(Answer::Done)
                    } else {
                        Err(StoreError::Closed)
                    });
                }
                rx.close();
                while let Ok(cmd) = rx.try_recv() {
                    waiting.fetch_sub(1, Ordering::AcqRel);
                    (cmd.reply)(Err(StoreError::Closed));
                }
                return;
            }
        }
    }

    async fn run_group(&mut self, batch: Vec<Cmd>) {
        let ops: Vec<&Op> = batch.iter().filter_map(|c| c.op.as_ref()).collect();
        match self.transaction(&ops).await {
            Ok(answers) => {
                self.commits += 1;
                self.commands += ops.len() as u64;
                for (cmd, a) in batch.into_iter().zip(answers) {
                    (cmd.reply)(Ok(a));
                }
            }
            Err(_) if batch.len() > 1 => {
                // Each op alone: one bad op must not fail the others.
                for cmd in batch {
                    let op = cmd.op.as_ref().expect("closes are split off");
                    let r = self.alone(op).await;
                    (cmd.reply)(r);
                }
            }
            Err(first) => {
                let cmd = batch.into_iter().next().expect("one command");
                let r = if retryable(&first) {
                    self.alone(cmd.op.as_ref().expect("closes are split off"))
                        .await
                } else {
                    Err(first)
                };
                (cmd.reply)(r);
            }
        }
    }

    async fn alone(&mut self, op: &Op) -> Result<Answer, StoreError> {
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
                self.client = c;
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
    async fn transaction(&mut self, ops: &[&Op]) -> Result<Vec<Answer>, StoreError> {
        self.reconnect().await?;
        self.group = Group::default();
        let r = match self.begin().await {
            Ok(db_now) => match self.body(ops, db_now).await {
                Ok(answers) => self.commit().await.map(|()| answers),
                Err(e) => Err(e),
            },
            Err(e) => Err(e),
        };
        if r.is_err() {
            let _ = self.client.batch_execute("ROLLBACK").await;
        }
        r
    }

    /// `BEGIN`, and the database's clock read in the same round trip.
    async fn begin(&mut self) -> Result<Option<Timestamp>, StoreError> {
        match self.clock {
            Clock::Caller => {
                pg(self.client.batch_execute("BEGIN").await)?;
                Ok(None)
            }
            Clock::Database => {
                let st = self
                    .stmt("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8")
                    .await?;
                let (begun, row) = futures_util::join!(
                    self.client.batch_execute("BEGIN"),
                    self.client.query_one(&st, &[])
                );
                pg(begun)?;
                let row = pg(row)?;
                Ok(Some(Timestamp::from_millis(row.get(0))))
            }
        }
    }

    /// The group's count changes, its notification and `COMMIT`, pipelined.
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
        let pairs_st = self.stmt(PAIRS_UPSERT_SQL).await?;
        let types_st = self.stmt(TYPES_UPSERT_SQL).await?;
        let notify_st = self.stmt("SELECT pg_notify($1, $2)").await?;
        let assign_st = self.stmt(LEASE_ASSIGN_SQL).await?;
        let assign = std::mem::take(&mut self.group.assign);
        let client = &self.client;
        let assigned = async {
            if assign.0.is_empty() {
                return Ok(());
            }
            client
                .execute(&assign_st, &[&assign.0, &assign.1, &assign.2])
                .await
                .map(drop)
        };
        let pairs = async {
            match &counts.pairs {
                Some(c) => client
                    .execute(
                        &pairs_st,
                        &[
                            &c.lanes,
                            &c.tenants,
                            &c.ready,
                            &c.inflight,
                            &c.scheduled,
                            &c.succeeded,
                            &c.cancelled,
                        ],
                    )
                    .await
                    .map(drop),
                None => Ok(()),
            }
        };
        let types = async {
            match &counts.types {
                Some((lanes, tenants, types, ready)) => client
                    .execute(&types_st, &[lanes, tenants, types, ready])
                    .await
                    .map(drop),
                None => Ok(()),
            }
        };
        let notified = async {
            match &notify {
                Some((channel, payload)) => client
                    .execute(&notify_st, &[channel, payload])
                    .await
                    .map(drop),
                None => Ok(()),
            }
        };
        let (a, p, t, n, c) = futures_util::join!(
            assigned,
            pairs,
            types,
            notified,
            client.batch_execute("COMMIT")
        );
        pg(a)?;
        pg(p)?;
        pg(t)?;
        pg(n)?;
        pg(c)
    }

    async fn body(
        &mut self,
        ops: &[&Op],
        db_now: Option<Timestamp>,
    ) -> Result<Vec<Answer>, StoreError> {
        let mut answers: Vec<Option<Answer>> = ops.iter().map(|_| None).collect();
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
            if let Op::Lease(first) = ops[i] {
                let mut members = vec![i];
                for (j, op) in ops.iter().enumerate().skip(i + 1) {
                    if let Op::Lease(other) = op
                        && answers[j].is_none()
                        && leases_merge(first, other, db_now)
                    {
                        members.push(j);
                    }
                }
                let reqs: Vec<LeaseRequest> = members
                    .iter()
                    .map(|&j| match ops[j] {
                        Op::Lease(r) => LeaseRequest {
                            now: db_now.unwrap_or(r.now),
                            ..r.clone()
                        },
                        _ => unreachable!("members are leases"),
                    })
                    .collect();
                self.leases += reqs.len() as u64;
                let leased = self.lease_many(&reqs).await?;
                for (j, jobs) in members.into_iter().zip(leased) {
                    answers[j] = Some(Answer::Leased(jobs));
                }
                continue;
            }
            answers[i] = Some(self.exec(ops[i], db_now).await?);
        }
        Ok(answers
            .into_iter()
            .map(|a| a.expect("every op answered"))
            .collect())
    }

    /// Every enqueue of the group as one (`answers` gets each op's part).
    async fn enqueue_group(
        &mut self,
        ops: &[&Op],
        db_now: Option<Timestamp>,
        answers: &mut [Option<Answer>],
    ) -> Result<(), StoreError> {
        let mut members: Vec<(usize, usize)> = Vec::new();
        let mut jobs: Vec<NewJob> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            if let Op::Enqueue(js) = op {
                members.push((i, js.len()));
                jobs.extend(js.iter().map(|j| NewJob {
                    run_at: rebase(db_now, j.run_at, j.now),
                    now: db_now.unwrap_or(j.now),
                    ..j.clone()
                }));
            }
        }
        if members.is_empty() {
            return Ok(());
        }
        let mut outcomes = self.enqueue(&jobs).await?.into_iter();
        for (i, n) in members {
            answers[i] = Some(Answer::Enqueued(outcomes.by_ref().take(n).collect()));
        }
        Ok(())
    }

    /// Every outcome batch of the group at the same time as one.
    async fn complete_group(
        &mut self,
        ops: &[&Op],
        db_now: Option<Timestamp>,
        answers: &mut [Option<Answer>],
    ) -> Result<(), StoreError> {
        // By time (one time for all on the database's clock).
        let mut times: BTreeMap<Timestamp, Vec<usize>> = BTreeMap::new();
        for (i, op) in ops.iter().enumerate() {
            if let Op::Complete(_, now) = op {
                times.entry(db_now.unwrap_or(*now)).or_default().push(i);
            }
        }
        for (now, members) in times {
            let items: Vec<&Completion> = members
                .iter()
                .flat_map(|&i| match ops[i] {
                    Op::Complete(items, _) => items.iter(),
                    _ => unreachable!("members are outcome batches"),
                })
                .collect();
            let mut out = self.complete(&items, now).await?.into_iter();
            for i in members {
                let n = match ops[i] {
                    Op::Complete(items, _) => items.len(),
                    _ => unreachable!("members are outcome batches"),
                };
                answers[i] = Some(Answer::Completed(out.by_ref().take(n).collect()));
            }
        }
        Ok(())
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

    fn delta(&mut self, lane: &str, tenant: &str) -> &mut Delta {
        self.group
            .deltas
            .entry((lane.to_owned(), tenant.to_owned()))
            .or_default()
    }

    /// `n` more (or fewer) jobs of `job_type` ready in (lane, tenant):
    /// the pair's count and the type's.
    fn add_ready(&mut self, lane: &str, tenant: &str, job_type: &str, n: i64) {
        self.delta(lane, tenant).ready += n;
        *self
            .group
            .typed
            .entry((lane.to_owned(), tenant.to_owned(), job_type.to_owned()))
            .or_default() += n;
    }

    /// The group's count changes, in key order (two nodes' groups lock
    /// the rows in the same order: no deadlock between them); written by
    /// [`PAIRS_UPSERT_SQL`] and then [`TYPES_UPSERT_SQL`] (the types'
    /// counts under the pairs' row locks: a type's count changes only with
    /// its pair's).
    fn count_changes(&mut self) -> CountChanges {
        let deltas = std::mem::take(&mut self.group.deltas);
        let typed = std::mem::take(&mut self.group.typed);
        // Pairs whose types' counts change lock their row even when their
        // own counts add up to no change.
        let retyped: HashSet<(&str, &str)> = typed
            .iter()
            .filter(|(_, n)| **n != 0)
            .map(|((l, t, _), _)| (l.as_str(), t.as_str()))
            .collect();
        let mut c = PairColumns::default();
        for ((l, t), d) in deltas {
            if d.ready == 0
                && d.inflight == 0
                && d.scheduled == 0
                && d.succeeded == 0
                && d.cancelled == 0
                && !retyped.contains(&(l.as_str(), t.as_str()))
            {
                continue;
            }
            c.cancelled.push(d.cancelled);
            c.lanes.push(l);
            c.tenants.push(t);
            c.ready.push(d.ready);
            c.inflight.push(d.inflight);
            c.scheduled.push(d.scheduled);
            c.succeeded.push(d.succeeded);
        }
        let (mut lanes, mut tenants, mut types, mut ready) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for ((l, t, ty), n) in typed {
            if n != 0 {
                lanes.push(l);
                tenants.push(t);
                types.push(ty);
                ready.push(n);
            }
        }
        CountChanges {
            pairs: (!c.lanes.is_empty()).then_some(c),
            types: (!lanes.is_empty()).then_some((lanes, tenants, types, ready)),
        }
    }

    /// Reads the counts of the pairs `keys` not read yet in this group, in
    /// one statement (what [`Self::counts`] would read one by one).
    async fn prefetch_counts(
        &mut self,
        keys: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(), StoreError> {
        let missing: BTreeSet<(String, String)> = keys
            .into_iter()
            .filter(|k| !self.group.base.contains_key(k))
            .collect();
        match missing.len() {
            0 => return Ok(()),
            1 => {
                let (l, t) = missing.into_iter().next().expect("one");
                self.counts(&l, &t).await?;
                return Ok(());
            }
            _ => {}
        }
        let (lanes, tenants): (Vec<&str>, Vec<&str>) = missing
            .iter()
            .map(|(l, t)| (l.as_str(), t.as_str()))
            .unzip();
        let rows = self
            .query(
                "SELECT p.lane, p.tenant, p.ready, p.inflight FROM pairs p
                 JOIN unnest($1::text[], $2::text[]) AS k(lane, tenant)
                   ON p.lane = k.lane AND p.tenant = k.tenant",
                &[&lanes, &tenants],
            )
            .await?;
        let mut found: HashMap<(String, String), (i64, i64)> = rows
            .iter()
            .map(|r| ((r.get(0), r.get(1)), (r.get(2), r.get(3))))
            .collect();
        for k in missing {
            let b = found.remove(&k).unwrap_or((0, 0));
            self.group.base.insert(k, b);
        }
        Ok(())
    }

    /// The (ready, inflight) of a pair now, this group's changes included.
    async fn counts(&mut self, lane: &str, tenant: &str) -> Result<(i64, i64), StoreError> {
        let key = (lane.to_owned(), tenant.to_owned());
        let base = match self.group.base.get(&key) {
            Some(b) => *b,
            None => {
                let rows = self
                    .query(
                        "SELECT ready, inflight FROM pairs WHERE lane = $1 AND tenant = $2",
                        &[&lane, &tenant],
                    )
                    .await?;
                let b = rows.first().map_or((0, 0), |r| (r.get(0), r.get(1)));
                self.group.base.insert(key.clone(), b);
                b
            }
        };
        let d = self.group.deltas.get(&key).copied().unwrap_or_default();
        Ok((base.0 + d.ready, base.1 + d.inflight))
    }

    async fn exec(&mut self, op: &Op, db_now: Option<Timestamp>) -> Result<Answer, StoreError> {
        // On the database's clock, a caller's times keep their distance from
        // the caller's `now` but count from the database's.
        let rebase = |t: Timestamp, now: Timestamp| rebase(db_now, t, now);
        let now_of = |now: Timestamp| db_now.unwrap_or(now);
        Ok(match op {
            Op::Enqueue(jobs) => {
                let jobs: Vec<NewJob> = jobs
                    .iter()
                    .map(|j| NewJob {
                        run_at: rebase(j.run_at, j.now),
                        now: now_of(j.now),
                        ..j.clone()
                    })
                    .collect();
                Answer::Enqueued(self.enqueue(&jobs).await?)
            }
            Op::Lease(req) => {
                self.leases += 1;
                let req = LeaseRequest {
                    now: now_of(req.now),
                    ..req.clone()
                };
                Answer::Leased(self.lease(&req).await?)
            }
            Op::Complete(items, now) => {
                let items: Vec<&Completion> = items.iter().collect();
                Answer::Completed(self.complete(&items, now_of(*now)).await?)
            }
            Op::Heartbeat(id, token, until, now) => {
                let until = rebase(*until, *now);
                Answer::Heartbeat(self.heartbeat(*id, *token, until, now_of(*now)).await?)
            }
            Op::Cancel(id, now, entry) => {
                Answer::Cancel(self.cancel(*id, now_of(*now), entry.clone()).await?)
            }
            Op::SetPause(target, paused, entry) => {
                Answer::Flag(self.set_pause(target, *paused, entry).await?)
            }
            Op::Tick(now) => Answer::Tick(self.tick(now_of(*now)).await?),
            Op::RecordAdmission(rec) => {
                let rec = AdmissionRecord {
                    now: now_of(rec.now),
                    ..rec.clone()
                };
                Answer::DeadLetter(self.record_admission(&rec).await?)
            }
            Op::Redrive(ids, now, audit) => {
                Answer::Jobs(self.redrive(ids, now_of(*now), *audit).await?)
            }
            Op::RedriveCorrected(id, fix, now, audit) => Answer::Job(
                self.redrive_corrected(*id, fix, now_of(*now), *audit)
                    .await?,
            ),
            Op::Purge(ids, audit) => Answer::Count(self.purge(ids, *audit).await?),
            Op::Audit(e) => Answer::Audit(self.audit(e).await?),
            Op::Stats => Answer::Stats(self.stats().await?),
            Op::RemoveSucceeded(before, batch) => {
                Answer::Count(self.remove_succeeded(*before, *batch).await?)
            }
            Op::CreateToken(t, e) => Answer::Token(self.create_token(t, e).await?),
            Op::RevokeToken(name, e) => Answer::Flag(self.revoke_token(name, e).await?),
            Op::Quarantine(dls) => {
                let mut out = Vec::with_capacity(dls.len());
                for dl in dls {
                    out.push(self.quarantine(dl).await?);
                }
                Answer::Quarantined(out)
            }
            Op::Park(p) => {
                self.park(p).await?;
                Answer::Done
            }
            Op::Unpark(key) => Answer::Flag(self.unpark(key).await?),
        })
    }

    // -----------------------------------------------------------------
    // Jobs.

    /// Outcomes, in order. Successes on live leases first, all in one
    /// statement ([`SUCCEED_SQL`]: no row lock and read before the write,
    /// and the counts of their pairs read with them); everything else (a
    /// failure, a stale token, a job named twice) then the general way:
    /// the jobs locked at once (by id), the counts of their pairs read at
    /// once, each outcome through the `Decider`.
    async fn complete(
        &mut self,
        items: &[&Completion],
        now: Timestamp,
    ) -> Result<Vec<Result<Completed, ItemError>>, StoreError> {
        let mut out: Vec<Option<Result<Completed, ItemError>>> =
            items.iter().map(|_| None).collect();
        // A job named more than once goes the general way, item by item in
        // order, so each of its items finds it as the one before left it.
        let mut named: HashMap<JobId, u32> = HashMap::with_capacity(items.len());
        for item in items {
            *named.entry(item.id).or_default() += 1;
        }
        let fast: Vec<usize> = (0..items.len())
            .filter(|&i| matches!(items[i].event, Event::Succeeded) && named[&items[i].id] == 1)
            .collect();
        if !fast.is_empty() {
            let ids: Vec<i64> = fast.iter().map(|&i| items[i].id.0 as i64).collect();
            let tokens: Vec<i64> = fast.iter().map(|&i| items[i].token.0 as i64).collect();
            let rows = self.query(SUCCEED_SQL, &[&ids, &tokens, &ms(now)]).await?;
            let mut done: HashMap<i64, Completed> = HashMap::with_capacity(rows.len());
            for r in &rows {
                let id: i64 = r.get(0);
                let (lane, tenant): (String, String) = (r.get(3), r.get(2));
                self.group
                    .base
                    .entry((lane.clone(), tenant.clone()))
                    .or_insert((
                        r.get::<_, Option<i64>>(7).unwrap_or(0),
                        r.get::<_, Option<i64>>(8).unwrap_or(0),
                    ));
                // No envelope yet means no redrive yet.
                let redrives = match r.get::<_, Option<&str>>(6) {
                    Some(json) => {
                        Envelope::from_json(json)
                            .map_err(|e| corrupt(format!("job {id}: stored envelope: {e}")))?
                            .redrives
                    }
                    None => 0,
                };
                let (lane, tenant) = (Lane::new(lane), TenantId::new(tenant));
                let freed_slot = self.release_slot(&lane, &tenant).await?;
                self.delta(lane.as_str(), tenant.as_str()).succeeded += 1;
                done.insert(
                    id,
                    Completed {
                        id: JobId(id as u64),
                        job_type: JobType::new(r.get::<_, String>(1)),
                        lane,
                        transition: Transition::Succeeded,
                        attempt: r.get::<_, i32>(4) as u32,
                        kind: None,
                        class: None,
                        dead_letter: None,
                        message: None,
                        redrives,
                        freed_slot,
                        leased_at: r.get::<_, Option<i64>>(5).map(Timestamp::from_millis),
                    },
                );
            }
            for i in fast {
                if let Some(c) = done.remove(&(items[i].id.0 as i64)) {
                    out[i] = Some(Ok(c));
                }
            }
        }
        let rest: Vec<usize> = (0..items.len()).filter(|&i| out[i].is_none()).collect();
        if !rest.is_empty() {
            let ids: Vec<i64> = rest.iter().map(|&i| items[i].id.0 as i64).collect();
            let mut rows = self.lock_jobs(&ids).await?;
            let pairs: Vec<(String, String)> = rows
                .values()
                .filter(|(s, ..)| s.state == JobState::Leased)
                .map(|(s, ..)| (s.lane.clone(), s.tenant.clone()))
                .collect();
            self.prefetch_counts(pairs).await?;
            // Successes the statement above did not take are not live:
            // `try_succeed` finds so, and they go the general way.
            let mut succeeded: Vec<i64> = Vec::new();
            for i in rest {
                let item = items[i];
                if let Some(done) = self.try_succeed(&mut rows, item, now).await? {
                    succeeded.push(done.id.0 as i64);
                    out[i] = Some(Ok(done));
                    continue;
                }
                out[i] = Some(
                    self.complete_one(
                        &mut rows,
                        item.id,
                        Some(item.token),
                        item.event.clone(),
                        now,
                    )
                    .await?,
                );
            }
            if !succeeded.is_empty() {
                self.execute(
                    "UPDATE jobs SET state = 'succeeded', finished_at = $2, lease_token = NULL,
                       lease_expires_at = NULL
                     WHERE id = ANY($1)",
                    &[&succeeded, &ms(now)],
                )
                .await?;
            }
        }
        Ok(out
            .into_iter()
            .map(|o| o.expect("every outcome answered"))
            .collect())
    }

    /// Leases of one group with the same filter ([`leases_merge`]) as one:
    /// one plan for all the jobs they ask, the jobs then handed out in the
    /// requests' order (each request at most its `max_jobs`), and the jobs
    /// of requests other than the first given their worker and lease end
    /// by one UPDATE. One lease costs its statements once, however many
    /// workers asked at the same moment.
    async fn lease_many(
        &mut self,
        reqs: &[LeaseRequest],
    ) -> Result<Vec<Vec<LeasedJob>>, StoreError> {
        let [first, rest @ ..] = reqs else {
            return Ok(Vec::new());
        };
        if rest.is_empty() {
            return Ok(vec![self.lease(first).await?]);
        }
        let combined = LeaseRequest {
            max_jobs: reqs.iter().map(|r| r.max_jobs).fold(0, u32::saturating_add),
            ..first.clone()
        };
        let first_end = combined.now.saturating_add(combined.lease);
        let mut jobs = round_robin(self.lease(&combined).await?).into_iter();
        let (mut ids, mut workers, mut ends) = (Vec::new(), Vec::new(), Vec::new());
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs {
            let end = r.now.saturating_add(r.lease);
            let mine: Vec<LeasedJob> = jobs
                .by_ref()
                .take(r.max_jobs as usize)
                .map(|j| LeasedJob {
                    lease_expires_at: end,
                    ..j
                })
                .collect();
            if r.worker_id != first.worker_id || end != first_end {
                for j in &mine {
                    ids.push(j.id.0 as i64);
                    workers.push(r.worker_id.as_str());
                    ends.push(ms(end));
                }
            }
            out.push(mine);
        }
        debug_assert!(jobs.next().is_none(), "a lease took more than asked");
        let assign = &mut self.group.assign;
        assign.0.extend(ids);
        assign.1.extend(workers.into_iter().map(str::to_owned));
        assign.2.extend(ends);
        Ok(out)
    }

    async fn enqueue(&mut self, jobs: &[NewJob]) -> Result<Vec<EnqueueOutcome>, StoreError> {
        let mut out: Vec<Option<EnqueueOutcome>> = vec![None; jobs.len()];
        // Keys seen before, in one statement.
        let keyed: Vec<usize> = (0..jobs.len())
            .filter(|&i| jobs[i].idempotency_key.is_some())
            .collect();
        let mut existing: HashMap<(String, String, String), (i64, String, i64)> = HashMap::new();
        if !keyed.is_empty() {
            let tenants: Vec<&str> = keyed.iter().map(|&i| jobs[i].tenant.as_str()).collect();
            let types: Vec<&str> = keyed.iter().map(|&i| jobs[i].job_type.as_str()).collect();
            let keys: Vec<&str> = keyed
                .iter()
                .map(|&i| jobs[i].idempotency_key.as_deref().unwrap_or_default())
                .collect();
            let rows = self
                .query(
                    "SELECT j.tenant, j.type, j.idempotency_key, j.id, j.state, j.run_at FROM jobs j
                     JOIN unnest($1::text[], $2::text[], $3::text[]) AS k(tenant, type, key)
                       ON j.tenant = k.tenant AND j.type = k.type AND j.idempotency_key = k.key",
                    &[&tenants, &types, &keys],
                )
                .await?;
            for r in rows {
                existing.insert(
                    (r.get(0), r.get(1), r.get(2)),
                    (r.get(3), r.get(4), r.get(5)),
                );
            }
        }
        let mut fresh: Vec<usize> = Vec::new();
        for (i, job) in jobs.iter().enumerate() {
            if let Some(key) = &job.idempotency_key {
                let k = (
                    job.tenant.as_str().to_owned(),
                    job.job_type.as_str().to_owned(),
                    key.clone(),
                );
                if existing.get(&k).is_some_and(|(id, _, _)| *id < 0) {
                    // A duplicate of a job earlier in this batch: answered below.
                    continue;
                }
                if let Some((id, state, run_at)) = existing.get(&k) {
                    let mut state: JobState = state.parse().map_err(corrupt)?;
                    if state == JobState::Scheduled && *run_at <= ms(job.now) {
                        state = JobState::Queued;
                    }
                    out[i] = Some(EnqueueOutcome::Duplicate {
                        id: JobId(*id as u64),
                        state,
                    });
                    continue;
                }
                // Later in the same batch, this job is the one found.
                let state = if job.run_at > job.now {
                    "scheduled"
                } else {
                    "queued"
                };
                existing.insert(k, (-(i as i64) - 1, state.to_owned(), ms(job.run_at)));
            }
            fresh.push(i);
        }
        self.refuse_new_tenants(jobs, &mut fresh, &mut out).await?;
        if !fresh.is_empty() {
            // Ids and rows in one statement: ids drawn in the jobs' order.
            let mut c = InsertColumns::default();
            let states: Vec<JobState> = fresh
                .iter()
                .map(|&i| {
                    let job = &jobs[i];
                    let state = if job.run_at > job.now {
                        JobState::Scheduled
                    } else {
                        JobState::Queued
                    };
                    c.push(job, state);
                    state
                })
                .collect();
            let rows = self
                .query(
                    "WITH ids AS MATERIALIZED (
                       SELECT g.ord, nextval(pg_get_serial_sequence('jobs', 'id')) AS id
                       FROM generate_series(1::int8, cardinality($1::text[])::int8) AS g(ord)),
                     ins AS (
                       INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, idempotency_key,
                         schema_version, enqueued_by, created_at, payload)
                       SELECT ids.id, u.type, u.tenant, u.lane, u.state, u.run_at, 0, u.key, u.schema_version,
                         u.enqueued_by, u.created_at, u.payload
                       FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::text[],
                                   $7::int4[], $8::text[], $9::int8[], $10::bytea[])
                         WITH ORDINALITY AS u(type, tenant, lane, state, run_at, key, schema_version,
                                              enqueued_by, created_at, payload, ord)
                       JOIN ids ON ids.ord = u.ord)
                     SELECT id FROM ids ORDER BY ord",
                    &[
                        &c.types, &c.tenants, &c.lanes, &c.states, &c.run_at, &c.keys,
                        &c.schema_versions, &c.enqueued_by, &c.created_at, &c.payloads,
                    ],
                )
                .await?;
            if rows.len() != fresh.len() {
                return Err(corrupt("an insert drew fewer ids than jobs"));
            }
            for ((&i, state), r) in fresh.iter().zip(states).zip(&rows) {
                out[i] = Some(EnqueueOutcome::Created {
                    id: JobId(r.get::<_, i64>(0) as u64),
                    state,
                    inflight: 0,
                });
            }
        }
        // Duplicates of a job created earlier in this batch.
        for (i, job) in jobs.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let key = job.idempotency_key.clone().unwrap_or_default();
            let k = (
                job.tenant.as_str().to_owned(),
                job.job_type.as_str().to_owned(),
                key,
            );
            let (first, _, _) = existing[&k];
            let first = (-first - 1) as usize;
            out[i] = Some(match out[first].clone() {
                Some(EnqueueOutcome::Created { id, state, .. }) => {
                    EnqueueOutcome::Duplicate { id, state }
                }
                // Refused with its first job.
                Some(refused @ EnqueueOutcome::TooManyTenants { .. }) => refused,
                _ => return Err(corrupt("a batch duplicate without its first job")),
            });
        }
        let created: Vec<(String, String)> = jobs
            .iter()
            .zip(&out)
            .filter(|(_, o)| matches!(o, Some(EnqueueOutcome::Created { .. })))
            .map(|(j, _)| (j.lane.as_str().to_owned(), j.tenant.as_str().to_owned()))
            .collect();
        self.prefetch_counts(created).await?;
        let mut done = Vec::with_capacity(jobs.len());
        for (job, o) in jobs.iter().zip(out) {
            let mut o = o.expect("every job answered");
            if let EnqueueOutcome::Created {
                state, inflight, ..
            } = &mut o
            {
                let (lane, tenant) = (job.lane.as_str(), job.tenant.as_str());
                *inflight = self.counts(lane, tenant).await?.1.max(0) as u32;
                if *state == JobState::Scheduled {
                    self.delta(lane, tenant).scheduled += 1;
                } else {
                    self.add_ready(lane, tenant, job.job_type.as_str(), 1);
                    self.group
                        .woken
                        .insert((lane.to_owned(), job.job_type.as_str().to_owned()));
                }
            }
            done.push(o);
        }
        Ok(done)
    }

    /// Leases what the core's lease plan says, as SQLite's writer does.
    /// The pairs this lease may take from are locked (`FOR UPDATE`) with
    /// their ready counts by type (`ready_types`): their counts are then
    /// the cluster's until this group commits, and another node's lease of
    /// the same pair waits for it, so a tenant's cap holds across nodes.
    /// `plan_lease` turns the counts into takes; each take reads only the
    /// rows it leases, by the typed ready index ([`LEASE_ONE_SQL`],
    /// [`LEASE_MERGED_SQL`]), so what a lease costs does not depend on how
    /// many jobs of other types wait. The takes' statements go out at once,
    /// pipelined on the one connection.
    async fn lease(&mut self, req: &LeaseRequest) -> Result<Vec<LeasedJob>, StoreError> {
        let mut out: Vec<LeasedJob> = Vec::new();
        if req.max_jobs == 0 || req.types.as_ref().is_some_and(Vec::is_empty) {
            // Nothing could be taken: no rows to lock.
            return Ok(out);
        }
        let lane_ok = |lane: &str| {
            req.lanes
                .as_ref()
                .is_none_or(|ls| ls.iter().any(|l| l.as_str() == lane))
                && !req.exclude_lanes.iter().any(|l| l.as_str() == lane)
        };
        let filter = LeaseFilter {
            types: req.types.as_deref(),
            excluded: &req.exclude_types,
            probes: &req.type_limits,
        };
        // Only the pairs the plan needs (the core's `LaneWindow`, walked
        // from each lane's round position), then those locked in key order
        // with their counts: a lease costs about `max_jobs` pairs, however
        // many tenants have jobs ready.
        let wanted = self.window(req, &filter, &lane_ok).await?;
        if wanted.is_empty() {
            return Ok(out);
        }
        let (wanted_lanes, wanted_tenants): (Vec<&str>, Vec<&str>) =
            wanted.iter().map(|(l, t)| (l.as_str(), t.as_str())).unzip();
        let rows = self
            .query(
                "SELECT p.lane, p.tenant, p.ready, p.inflight, t.type, t.ready FROM pairs p
                 LEFT JOIN ready_types t ON t.lane = p.lane AND t.tenant = p.tenant AND t.ready > 0
                 WHERE (p.lane, p.tenant) IN (SELECT * FROM unnest($1::text[], $2::text[]))
                 ORDER BY p.lane, p.tenant FOR UPDATE OF p",
                &[&wanted_lanes, &wanted_tenants],
            )
            .await?;
        let mut keys: Vec<(String, String)> = Vec::new();
        for r in rows {
            let key: (String, String) = (r.get(0), r.get(1));
            if keys.last() != Some(&key) {
                self.group.base.insert(key.clone(), (r.get(2), r.get(3)));
                self.group.base_types.insert(key.clone(), BTreeMap::new());
                keys.push(key.clone());
            }
            if let Some(t) = r.get::<_, Option<String>>(4) {
                let types = self.group.base_types.get_mut(&key).expect("inserted above");
                types.insert(JobType::new(t), r.get(5));
            }
        }
        // Pairs made ready by this group only (enqueued earlier in it): none
        // of their jobs is another transaction's to see, so their types'
        // counts are this group's.
        let locked: HashSet<(String, String)> = keys.iter().cloned().collect();
        let unseen: Vec<(String, String)> =
            wanted.into_iter().filter(|k| !locked.contains(k)).collect();
        for key in unseen {
            self.counts(&key.0, &key.1).await?;
            self.group.base_types.insert(key.clone(), BTreeMap::new());
            keys.push(key);
        }
        keys.retain(|(lane, _)| lane_ok(lane));
        // The counts now, this group's changes included.
        let mut counted: Vec<(Lane, TenantId, u32, BTreeMap<JobType, u32>)> =
            Vec::with_capacity(keys.len());
        for key in &keys {
            let base = self.group.base.get(key).copied().unwrap_or_default();
            let d = self.group.deltas.get(key).copied().unwrap_or_default();
            let mut by_type: BTreeMap<JobType, i64> =
                self.group.base_types.get(key).cloned().unwrap_or_default();
            let from = (key.0.clone(), key.1.clone(), String::new());
            for ((l, t, ty), n) in self.group.typed.range(from..) {
                if (l, t) != (&key.0, &key.1) {
                    break;
                }
                *by_type.entry(JobType::new(ty.clone())).or_default() += n;
            }
            let by_type: BTreeMap<JobType, u32> = by_type
                .into_iter()
                .filter(|(_, n)| *n > 0)
                .map(|(t, n)| (t, count32(n)))
                .collect();
            let inflight = count32(base.1 + d.inflight);
            if !by_type.is_empty() || inflight > 0 {
                counted.push((
                    Lane::new(key.0.clone()),
                    TenantId::new(key.1.clone()),
                    inflight,
                    by_type,
                ));
            }
        }
        // The takes, owned, with the types each reads (any type: those the
        // pair has ready).
        let takes: Vec<(usize, Vec<String>, u32)> = {
            let pairs: Vec<PairCounts<'_>> = counted
                .iter()
                .map(|(lane, tenant, inflight, ready)| PairCounts {
                    lane,
                    tenant,
                    inflight: *inflight,
                    ready,
                })
                .collect();
            plan_lease(&mut self.scheduler, &pairs, &filter, req.max_jobs)
                .into_iter()
                .map(|t| {
                    let types = match t.among {
                        Among::AnyType => counted[t.pair]
                            .3
                            .keys()
                            .map(|ty| ty.as_str().to_owned())
                            .collect(),
                        Among::Types(ts) => ts.iter().map(|ty| ty.as_str().to_owned()).collect(),
                    };
                    (t.pair, types, t.count)
                })
                .collect()
        };
        if takes.is_empty() {
            return Ok(out);
        }
        let one = self.stmt(LEASE_ONE_SQL).await?;
        let merged = self.stmt(LEASE_MERGED_SQL).await?;
        let expires = req.now.saturating_add(req.lease);
        let (exp, now, worker) = (ms(expires), ms(req.now), req.worker_id.as_str());
        // Per take: lane, tenant, types, count.
        let args: Vec<(&str, &str, Vec<&str>, i64)> = takes
            .iter()
            .map(|(pair, types, count)| {
                (
                    counted[*pair].0.as_str(),
                    counted[*pair].1.as_str(),
                    types.iter().map(String::as_str).collect(),
                    i64::from(*count),
                )
            })
            .collect();
        let calls: Vec<(&Statement, [&(dyn ToSql + Sync); 7])> = args
            .iter()
            .map(
                |(lane, tenant, types, n)| -> (&Statement, [&(dyn ToSql + Sync); 7]) {
                    match types.as_slice() {
                        [one_type] => (&one, [lane, tenant, one_type, n, &exp, &now, &worker]),
                        _ => (&merged, [lane, tenant, types, n, &exp, &now, &worker]),
                    }
                },
            )
            .collect();
        let client = &self.client;
        let results = futures_util::future::join_all(
            calls.iter().map(|(st, p)| client.query(*st, p.as_slice())),
        )
        .await;
        drop(calls);
        for ((pair, _, count), rows) in takes.iter().zip(results) {
            let rows = pg(rows)?;
            let (lane, tenant) = (&counted[*pair].0, &counted[*pair].1);
            let got = self.take_leased(&rows, lane, tenant, expires, &mut out);
            if got < *count {
                // A job of the take was locked by another transaction (a
                // cancel), or the counts are off: this lease is short.
                tracing::debug!(%lane, %tenant, planned = count, got, "a lease take came up short");
            }
        }
        Ok(out)
    }

    /// `[tenants] ready_max`: drops from `fresh` (answering
    /// `TooManyTenants`) the jobs of tenants with no jobs ready once as many
    /// tenants as the bound have some (the core's `admits_tenant`). The
    /// count is read when the bound is set, and costs at most the bound;
    /// nodes enqueuing at once may each admit one more.
    async fn refuse_new_tenants(
        &mut self,
        jobs: &[NewJob],
        fresh: &mut Vec<usize>,
        out: &mut [Option<EnqueueOutcome>],
    ) -> Result<(), StoreError> {
        let Some(max) = self.scheduler.config().tenants_ready_max else {
            return Ok(());
        };
        if fresh.is_empty() {
            return Ok(());
        }
        let rows = self
            .query("SELECT DISTINCT tenant FROM pairs WHERE ready > 0", &[])
            .await?;
        let mut ready: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
        ready.extend(
            self.group
                .deltas
                .iter()
                .filter(|(_, d)| d.ready > 0)
                .map(|((_, t), _)| t.clone()),
        );
        let config = self.scheduler.config();
        fresh.retain(|&i| {
            let tenant = jobs[i].tenant.as_str();
            if config.admits_tenant(ready.contains(tenant), ready.len()) {
                ready.insert(tenant.to_owned());
                true
            } else {
                out[i] = Some(EnqueueOutcome::TooManyTenants {
                    tenants_ready_max: max,
                });
                false
            }
        });
        Ok(())
    }

    /// The (lane, tenant) pairs a lease needs, in key order: per lane that
    /// `lane_ok` lets through, its tenants with jobs ready (of the types
    /// the lease may take) in byte order from the round's position
    /// (`FairScheduler::resume_after`), wrapping once, offered to the
    /// core's `LaneWindow` until it has enough; this group's own changes
    /// counted in. With lane reserves, every pair holding leases too.
    /// Nothing is locked here: the lease locks what this returns.
    async fn window(
        &mut self,
        req: &LeaseRequest,
        filter: &LeaseFilter<'_>,
        lane_ok: &impl Fn(&str) -> bool,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let every_type =
            filter.types.is_none() && filter.excluded.is_empty() && filter.probes.is_empty();
        // A lease of one lane (a worker's usual) walks that lane: a lane
        // with nothing ready costs the walk's one read, as the lanes' would.
        let mut lanes: BTreeSet<String> = match req.lanes.as_deref() {
            Some([lane]) => BTreeSet::from([lane.as_str().to_owned()]),
            _ => self
                .query(READY_LANES_SQL, &[])
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect(),
        };
        lanes.extend(
            self.group
                .deltas
                .iter()
                .filter(|(_, d)| d.ready > 0)
                .map(|((l, _), _)| l.clone()),
        );
        lanes.retain(|l| lane_ok(l));
        let batch = req.max_jobs.clamp(8, WALK_BATCH_MAX);
        let limit = i64::from(batch);
        let mut wanted: BTreeSet<(String, String)> = BTreeSet::new();
        for lane in &lanes {
            let types: Vec<String> = if every_type {
                Vec::new()
            } else {
                let mut ts: BTreeSet<String> = match filter.types {
                    Some(ts) => ts.iter().map(|t| t.as_str().to_owned()).collect(),
                    None => self
                        .query(LANE_TYPES_SQL, &[lane])
                        .await?
                        .iter()
                        .map(|r| r.get(0))
                        .collect(),
                };
                if filter.types.is_none() {
                    let from = (lane.clone(), String::new(), String::new());
                    ts.extend(
                        self.group
                            .typed
                            .range(from..)
                            .take_while(|((l, _, _), _)| l == lane)
                            .filter(|(_, n)| **n > 0)
                            .map(|((_, _, t), _)| t.clone()),
                    );
                }
                ts.into_iter()
                    .filter(|t| filter.admits(&JobType::new(t.as_str())))
                    .collect()
            };
            if !every_type && types.is_empty() {
                continue;
            }
            // This group's pairs with jobs ready, which `pairs` shows only
            // at its commit.
            let from = (lane.clone(), String::new());
            let mine: BTreeSet<String> = self
                .group
                .deltas
                .range(from..)
                .take_while(|((l, _), _)| l == lane)
                .filter(|(_, d)| d.ready > 0)
                .map(|((_, t), _)| t.clone())
                .collect();
            let after: Option<String> = self
                .scheduler
                .resume_after(&Lane::new(lane.as_str()))
                .map(str::to_owned);
            let lane_id = Lane::new(lane.as_str());
            let mut window = LaneWindow::new(filter, req.max_jobs);
            // From the round's position to the end, then from the start up
            // to the position.
            let passes: Vec<(String, Option<String>)> = match &after {
                Some(a) => vec![(a.clone(), None), (String::new(), Some(a.clone()))],
                None => vec![(String::new(), None)],
            };
            'walk: for (mut lo, hi) in passes {
                loop {
                    let rows = if every_type {
                        self.query(WALK_PAIRS_SQL, &[lane, &lo, &limit]).await?
                    } else {
                        self.query(WALK_TYPES_SQL, &[lane, &lo, &limit, &types])
                            .await?
                    };
                    let mut batch_tenants: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
                    let full = batch_tenants.len() as i64 == limit;
                    // The range this batch covers, this group's tenants in it merged.
                    let end: Option<String> = if full {
                        batch_tenants.last().cloned()
                    } else {
                        hi.clone()
                    };
                    let upper = match &end {
                        Some(e) => std::ops::Bound::Included(e.clone()),
                        None => std::ops::Bound::Unbounded,
                    };
                    batch_tenants.extend(
                        mine.range((std::ops::Bound::Excluded(lo.clone()), upper))
                            .cloned(),
                    );
                    batch_tenants.sort();
                    batch_tenants.dedup();
                    if let Some(h) = &hi {
                        batch_tenants.retain(|t| t <= h);
                    }
                    let counted = self.walk_counts(lane, &batch_tenants).await?;
                    for (tenant, inflight, ready) in &counted {
                        self.lease_pairs += 1;
                        let tenant_id = TenantId::new(tenant.as_str());
                        let pair = PairCounts {
                            lane: &lane_id,
                            tenant: &tenant_id,
                            inflight: *inflight,
                            ready,
                        };
                        if window.offer(&self.scheduler, &pair) {
                            wanted.insert((lane.clone(), tenant.clone()));
                        }
                        if window.is_full() {
                            break 'walk;
                        }
                    }
                    let past_hi = match (&hi, &end) {
                        (Some(h), Some(e)) => e >= h,
                        _ => false,
                    };
                    if !full || past_hi {
                        break;
                    }
                    lo = end.expect("a full batch has a last tenant");
                }
            }
        }
        if self.scheduler.config().has_reserves() {
            let busy = self
                .query("SELECT lane, tenant FROM pairs WHERE inflight > 0", &[])
                .await?;
            for r in busy {
                let (lane, tenant): (String, String) = (r.get(0), r.get(1));
                if lane_ok(&lane) {
                    self.lease_pairs += 1;
                    wanted.insert((lane, tenant));
                }
            }
            for ((lane, tenant), d) in &self.group.deltas {
                if d.inflight > 0 && lane_ok(lane) {
                    wanted.insert((lane.clone(), tenant.clone()));
                }
            }
        }
        Ok(wanted.into_iter().collect())
    }

    /// The counts of `tenants` of `lane` now (this group's changes
    /// included), in the order given: (tenant, in flight, ready by type).
    async fn walk_counts(
        &mut self,
        lane: &str,
        tenants: &[String],
    ) -> Result<Vec<(String, u32, BTreeMap<JobType, u32>)>, StoreError> {
        if tenants.is_empty() {
            return Ok(Vec::new());
        }
        let rows = self.query(WALK_COUNTS_SQL, &[&lane, &tenants]).await?;
        let mut found: HashMap<String, (i64, BTreeMap<String, i64>)> = HashMap::new();
        for r in rows {
            let e = found
                .entry(r.get(0))
                .or_insert_with(|| (r.get(1), BTreeMap::new()));
            if let Some(t) = r.get::<_, Option<String>>(2) {
                e.1.insert(t, r.get(3));
            }
        }
        Ok(tenants
            .iter()
            .map(|tenant| {
                let key = (lane.to_owned(), tenant.clone());
                let (mut inflight, mut by_type) = found.remove(tenant).unwrap_or_default();
                if let Some(d) = self.group.deltas.get(&key) {
                    inflight += d.inflight;
                }
                let from = (lane.to_owned(), tenant.clone(), String::new());
                for ((l, t, ty), n) in self.group.typed.range(from..) {
                    if (l.as_str(), t) != (lane, tenant) {
                        break;
                    }
                    *by_type.entry(ty.clone()).or_default() += n;
                }
                let ready = by_type
                    .into_iter()
                    .filter(|(_, n)| *n > 0)
                    .map(|(t, n)| (JobType::new(t), count32(n)))
                    .collect();
                (tenant.clone(), count32(inflight.max(0)), ready)
            })
            .collect())
    }

    /// The jobs a lease statement returned, oldest first, into `out`;
    /// counted into the group's deltas, by type.
    fn take_leased(
        &mut self,
        rows: &[Row],
        lane: &Lane,
        tenant: &TenantId,
        expires: Timestamp,
        out: &mut Vec<LeasedJob>,
    ) -> u32 {
        let mut got: Vec<(i64, LeasedJob)> = rows
            .iter()
            .map(|r| {
                (
                    r.get::<_, i64>(8),
                    LeasedJob {
                        id: JobId(r.get::<_, i64>(0) as u64),
                        job_type: JobType::new(r.get::<_, String>(1)),
                        tenant: tenant.clone(),
                        lane: lane.clone(),
                        payload: r.get(5),
                        attempt: r.get::<_, i32>(6) as u32,
                        idempotency_key: r.get(2),
                        schema_version: r.get::<_, Option<i32>>(3).map(|v| v as u32),
                        lease_token: LeaseToken(r.get::<_, i64>(7) as u64),
                        lease_expires_at: expires,
                        created_at: Timestamp::from_millis(r.get(4)),
                        ready_at: Timestamp::from_millis(r.get(8)),
                    },
                )
            })
            .collect();
        got.sort_by_key(|(run_at, j)| (*run_at, j.id));
        let n = got.len() as u32;
        // Per type, once: a take reads one type, or a few.
        let mut by_type: Vec<(&JobType, i64)> = Vec::new();
        for (_, j) in &got {
            match by_type.iter_mut().find(|(t, _)| *t == &j.job_type) {
                Some((_, k)) => *k += 1,
                None => by_type.push((&j.job_type, 1)),
            }
        }
        for (t, k) in by_type {
            self.add_ready(lane.as_str(), tenant.as_str(), t.as_str(), -k);
        }
        self.delta(lane.as_str(), tenant.as_str()).inflight += i64::from(n);
        out.extend(got.into_iter().map(|(_, j)| j));
        n
    }

    /// Locks the jobs an outcome batch names, by id order (two batches lock
    /// in the same order), and reads them with their lease columns.
    async fn lock_jobs(&mut self, ids: &[i64]) -> Result<HashMap<i64, Locked>, StoreError> {
        let rows = self
            .query(
                "SELECT id, type, tenant, lane, state, attempts, lease_started_at, worker_id,
                   idempotency_key, schema_version, created_at, finished_at, envelope, payload,
                   lease_token, lease_expires_at, cancel_requested
                 FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE",
                &[&ids],
            )
            .await?;
        let mut out = HashMap::with_capacity(rows.len());
        for r in rows {
            let job = stored_job(&r)?;
            out.insert(job.id, (job, r.get(14), r.get(15), r.get(16)));
        }
        Ok(out)
    }

    /// A worker's success on its current, unexpired lease with the running
    /// attempt in columns (`lease_started_at`): answered here, written by
    /// the caller's one UPDATE for the batch. `None`: the general path.
    async fn try_succeed(
        &mut self,
        rows: &mut HashMap<i64, Locked>,
        item: &Completion,
        now: Timestamp,
    ) -> Result<Option<Completed>, StoreError> {
        if !matches!(item.event, Event::Succeeded) {
            return Ok(None);
        }
        let Some((stored, current, expires_at, _)) = rows.get_mut(&(item.id.0 as i64)) else {
            return Ok(None);
        };
        let live = stored.state == JobState::Leased
            && *current == Some(item.token.0 as i64)
            && expires_at.is_some_and(|end| end > ms(now))
            && stored.lease_started_at.is_some();
        if !live {
            return Ok(None);
        }
        // No envelope yet means no redrive yet.
        let redrives = match &stored.envelope {
            Some(_) => stored.envelope()?.redrives,
            None => 0,
        };
        let leased_at = stored.lease_started_at.map(Timestamp::from_millis);
        stored.state = JobState::Succeeded;
        *current = None;
        let (lane, tenant) = (
            Lane::new(stored.lane.clone()),
            TenantId::new(stored.tenant.clone()),
        );
        let (job_type, attempt) = (
            JobType::new(stored.job_type.clone()),
            stored.attempts as u32,
        );
        let freed_slot = self.release_slot(&lane, &tenant).await?;
        self.delta(lane.as_str(), tenant.as_str()).succeeded += 1;
        Ok(Some(Completed {
            id: item.id,
            job_type,
            lane,
            transition: Transition::Succeeded,
            attempt,
            kind: None,
            class: None,
            dead_letter: None,
            message: None,
            redrives,
            freed_slot,
            leased_at,
        }))
    }

    /// Applies one outcome to a locked job. `token: None` is the reaper.
    async fn complete_one(
        &mut self,
        rows: &mut HashMap<i64, Locked>,
        id: JobId,
        token: Option<LeaseToken>,
        event: Event,
        now: Timestamp,
    ) -> Result<Result<Completed, ItemError>, StoreError> {
        let Some((stored, current, expires_at, cancel_requested)) = rows.get_mut(&(id.0 as i64))
        else {
            return Ok(Err(ItemError::NotFound));
        };
        let cancel_requested = *cancel_requested;
        if stored.state != JobState::Leased {
            return Ok(Err(ItemError::LeaseLost));
        }
        if let Some(token) = token {
            let ended = expires_at.is_some_and(|end| end <= ms(now));
            if Some(token.0 as i64) != *current || ended {
                return Ok(Err(ItemError::LeaseLost));
            }
        }
        let mut env = stored.envelope()?;
        let leased_at = stored.lease_started_at.map(Timestamp::from_millis);
        let attempt = env.attempts;
        let decided = self.decider.decide(&mut env, event, now);
        let transition = lazaret_core::settle(&mut env, decided, cancel_requested);
        // A later item of the same batch finds the job as it is now.
        stored.state = transition.next_state(now);
        *current = None;
        let payload = std::mem::take(&mut stored.payload);
        let (dead_letter, freed_slot) = self.apply(&env, transition, now, &payload).await?;
        if let Some((s, _, _, _)) = rows.get_mut(&(id.0 as i64)) {
            s.payload = payload;
        }
        let (kind, class, message) = env
            .history
            .last()
            .and_then(|r| r.error.as_ref())
            .filter(|_| transition != Transition::Succeeded)
            .map_or((None, None, None), |e| {
                (Some(e.kind.clone()), e.class, Some(e.message.clone()))
            });
        Ok(Ok(Completed {
            id,
            job_type: env.job_type.clone(),
            lane: env.lane.clone(),
            transition,
            attempt,
            kind,
            class,
            dead_letter,
            message,
            redrives: env.redrives,
            freed_slot,
            leased_at,
        }))
    }

    /// A leased job of (lane, tenant) leaves the in-flight set; whether that
    /// freed a slot someone waits for (the core's rule,
    /// `FairScheduler::frees_slot`).
    async fn release_slot(&mut self, lane: &Lane, tenant: &TenantId) -> Result<bool, StoreError> {
        let (ready, inflight) = self.counts(lane.as_str(), tenant.as_str()).await?;
        self.delta(lane.as_str(), tenant.as_str()).inflight -= 1;
        let freed = self
            .scheduler
            .frees_slot(tenant, count32(inflight), count32(ready));
        if freed {
            self.group.wake = true;
        }
        Ok(freed)
    }

    /// Writes a leased job's transition: the envelope, the state, and for a
    /// dead letter its record, in this transaction.
    async fn apply(
        &mut self,
        env: &Envelope,
        transition: Transition,
        now: Timestamp,
        payload: &[u8],
    ) -> Result<(Option<DeadLetterId>, bool), StoreError> {
        let id = env.id.0 as i64;
        let freed_slot = self.release_slot(&env.lane, &env.tenant).await?;
        let (lane, tenant) = (env.lane.as_str(), env.tenant.as_str());
        match transition {
            Transition::Succeeded => {
                self.finish(env, JobState::Succeeded, now).await?;
                self.delta(lane, tenant).succeeded += 1;
                Ok((None, freed_slot))
            }
            Transition::Retry { at, .. } | Transition::Defer { until: at } => {
                let state = transition.next_state(now);
                self.execute(
                    "UPDATE jobs SET state = $2, run_at = $3, lease_token = NULL, lease_expires_at = NULL,
                     lease_started_at = NULL, worker_id = NULL, attempts = $4, envelope = $5 WHERE id = $1",
                    &[&id, &state.as_str(), &ms(at), &(env.attempts as i32), &env.to_json()],
                )
                .await?;
                if state == JobState::Queued {
                    self.add_ready(lane, tenant, env.job_type.as_str(), 1);
                    self.group.wake = true;
                } else {
                    self.delta(lane, tenant).scheduled += 1;
                }
                Ok((None, freed_slot))
            }
            Transition::Cancelled => {
                self.finish(env, JobState::Cancelled, now).await?;
                self.delta(lane, tenant).cancelled += 1;
                Ok((None, freed_slot))
            }
            Transition::DeadLetter { reason } => {
                self.finish(env, JobState::DeadLettered, now).await?;
                let error = env
                    .last_error()
                    .map(|e| serde_json::to_string(e).unwrap_or_default());
                let rows = self
                    .query(
                        "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error,
                           idempotency_key, created_at, dead_lettered_at, payload_size, payload_sha256, payload_preview)
                         VALUES ($1, $2, $3, $4, $5, 'processing', $6, $7, $8, $9, $10, $11, $12, $13)
                         RETURNING id",
                        &[
                            &id,
                            &env.job_type.as_str(),
                            &tenant,
                            &lane,
                            &reason.as_str(),
                            &(env.attempts as i32),
                            &error,
                            &env.idempotency_key,
                            &ms(env.created_at),
                            &ms(now),
                            &(env.payload_size as i64),
                            &env.payload_sha256,
                            &payload_preview(payload, lazaret_core::PREVIEW_BYTES_MAX),
                        ],
                    )
                    .await?;
                let dl: i64 = rows
                    .first()
                    .map(|r| r.get(0))
                    .ok_or_else(|| corrupt("no id"))?;
                Ok((Some(DeadLetterId(dl as u64)), freed_slot))
            }
        }
    }

    async fn finish(
        &mut self,
        env: &Envelope,
        state: JobState,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.execute(
            "UPDATE jobs SET state = $2, finished_at = $3, lease_token = NULL, lease_expires_at = NULL,
             lease_started_at = NULL, worker_id = NULL, attempts = $4, envelope = $5 WHERE id = $1",
            &[
                &(env.id.0 as i64),
                &state.as_str(),
                &ms(now),
                &(env.attempts as i32),
                &env.to_json(),
            ],
        )
        .await?;
        Ok(())
    }

    async fn heartbeat(
        &mut self,
        id: JobId,
        token: LeaseToken,
        until: Timestamp,
        now: Timestamp,
    ) -> Result<Result<crate::Heartbeat, ItemError>, StoreError> {
        let rows = self
            .query(
                "UPDATE jobs SET lease_expires_at = $2
                 WHERE id = $1 AND state = 'leased' AND lease_token = $3 AND lease_expires_at > $4
                 RETURNING cancel_requested",
                &[&(id.0 as i64), &ms(until), &(token.0 as i64), &ms(now)],
            )
            .await?;
        if let Some(r) = rows.first() {
            return Ok(Ok(crate::Heartbeat {
                lease_expires_at: until,
                cancel_requested: r.get(0),
            }));
        }
        let exists = self
            .query("SELECT 1 FROM jobs WHERE id = $1", &[&(id.0 as i64)])
            .await?;
        Ok(Err(if exists.is_empty() {
            ItemError::NotFound
        } else {
            ItemError::LeaseLost
        }))
    }

    /// Applies `lazaret_core::cancel`'s decision for the job's state, and
    /// the audit entry when the cancel is accepted.
    async fn cancel(
        &mut self,
        id: JobId,
        now: Timestamp,
        mut entry: AuditEntry,
    ) -> Result<Result<crate::Cancelled, crate::CancelError>, StoreError> {
        let rows = self
            .query(
                "SELECT state, lane, tenant, cancel_requested, type FROM jobs WHERE id = $1 FOR UPDATE",
                &[&(id.0 as i64)],
            )
            .await?;
        let Some(r) = rows.first() else {
            return Ok(Err(crate::CancelError::NotFound));
        };
        let (state, lane, tenant, requested, job_type): (String, String, String, bool, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        let state: JobState = state.parse().map_err(corrupt)?;
        let answer = match lazaret_core::cancel(state, requested) {
            lazaret_core::CancelDecision::Refuse { state } => {
                return Ok(Err(crate::CancelError::Finished(state)));
            }
            lazaret_core::CancelDecision::CancelNow => {
                self.execute(
                    "UPDATE jobs SET state = 'cancelled', finished_at = $2, cancel_requested = true
                     WHERE id = $1",
                    &[&(id.0 as i64), &ms(now)],
                )
                .await?;
                if state == JobState::Queued {
                    self.add_ready(&lane, &tenant, &job_type, -1);
                } else {
                    self.delta(&lane, &tenant).scheduled -= 1;
                }
                self.delta(&lane, &tenant).cancelled += 1;
                entry.count = 1;
                crate::Cancelled::Now
            }
            lazaret_core::CancelDecision::Request => {
                self.execute(
                    "UPDATE jobs SET cancel_requested = true WHERE id = $1",
                    &[&(id.0 as i64)],
                )
                .await?;
                entry.count = 1;
                crate::Cancelled::Requested { already: false }
            }
            lazaret_core::CancelDecision::AlreadyRequested => {
                entry.count = 0;
                crate::Cancelled::Requested { already: true }
            }
        };
        self.audit(&entry).await?;
        Ok(Ok(answer))
    }

    /// Records a pause or drops it, with its audit entry; whether it changed.
    async fn set_pause(
        &mut self,
        target: &crate::PauseTarget,
        paused: bool,
        entry: &AuditEntry,
    ) -> Result<bool, StoreError> {
        let n = if paused {
            self.execute(
                "INSERT INTO pauses (target, name, paused_at, paused_by) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (target, name) DO NOTHING",
                &[&target.kind(), &target.name(), &ms(entry.at), &entry.actor],
            )
            .await?
        } else {
            self.execute(
                "DELETE FROM pauses WHERE target = $1 AND name = $2",
                &[&target.kind(), &target.name()],
            )
            .await?
        };
        if !paused && n > 0 {
            self.group.wake = true;
        }
        self.audit(entry).await?;
        Ok(n > 0)
    }

    async fn tick(&mut self, now: Timestamp) -> Result<Tick, StoreError> {
        let mut tick = Tick::default();
        let promoted = self
            .query(
                "WITH due AS (
                   SELECT id FROM jobs WHERE state = 'scheduled' AND run_at <= $1
                   ORDER BY run_at LIMIT $2 FOR UPDATE SKIP LOCKED)
                 UPDATE jobs j SET state = 'queued' FROM due WHERE j.id = due.id
                 RETURNING j.lane, j.tenant, j.type",
                &[&ms(now), &PROMOTE_MAX],
            )
            .await?;
        for r in &promoted {
            let (lane, tenant, job_type): (String, String, String) = (r.get(0), r.get(1), r.get(2));
            self.delta(&lane, &tenant).scheduled -= 1;
            self.add_ready(&lane, &tenant, &job_type, 1);
            tick.promoted += 1;
            self.group.wake = true;
        }
        let expired = self
            .query(
                "SELECT id FROM jobs WHERE state = 'leased' AND lease_expires_at <= $1
                 ORDER BY lease_expires_at LIMIT $2 FOR UPDATE SKIP LOCKED",
                &[&ms(now), &EXPIRE_MAX],
            )
            .await?;
        let ids: Vec<i64> = expired.iter().map(|r| r.get(0)).collect();
        if !ids.is_empty() {
            let mut rows = self.lock_jobs(&ids).await?;
            for id in ids {
                if let Ok(done) = self
                    .complete_one(&mut rows, JobId(id as u64), None, Event::LeaseExpired, now)
                    .await?
                {
                    tick.expired.push(done);
                }
            }
        }
        let next = self
            .query(
                "SELECT run_at FROM jobs WHERE state = 'scheduled' ORDER BY run_at LIMIT 1",
                &[],
            )
            .await?;
        tick.next_due = next.first().map(|r| Timestamp::from_millis(r.get(0)));
        Ok(tick)
    }

    // -----------------------------------------------------------------
    // Dead letters, audit, tokens.

    async fn record_admission(
        &mut self,
        rec: &AdmissionRecord,
    ) -> Result<DeadLetterId, StoreError> {
        let error = serde_json::json!({
            "class": "permanent", "kind": rec.reason.as_str(), "message": rec.message,
            "traceback": null, "retry_after_ms": null,
        })
        .to_string();
        let rows = self
            .query(
                "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error,
                   idempotency_key, created_at, dead_lettered_at, payload_size, payload_sha256, payload_preview, payload)
                 VALUES (NULL, $1, $2, $3, $4, 'admission', 0, $5, $6, $7, $7, $8, $9, $10, $11)
                 RETURNING id",
                &[
                    &rec.job_type,
                    &rec.tenant,
                    &rec.lane,
                    &rec.reason.as_str(),
                    &error,
                    &rec.idempotency_key,
                    &ms(rec.now),
                    &(rec.payload_size as i64),
                    &rec.payload_sha256,
                    &rec.payload_preview,
                    &rec.payload,
                ],
            )
            .await?;
        Ok(DeadLetterId(rows[0].get::<_, i64>(0) as u64))
    }

    async fn redrive(
        &mut self,
        ids: &[DeadLetterId],
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> Result<Vec<JobId>, StoreError> {
        let mut out = Vec::new();
        for dl in ids {
            let rows = self
                .query(
                    "SELECT job_id FROM dead_letters WHERE id = $1 AND stage = 'processing' FOR UPDATE",
                    &[&(dl.0 as i64)],
                )
                .await?;
            let Some(job_id) = rows.first().and_then(|r| r.get::<_, Option<i64>>(0)) else {
                continue;
            };
            let rows = self
                .query(
                    "SELECT id, type, tenant, lane, state, attempts, lease_started_at, worker_id,
                       idempotency_key, schema_version, created_at, finished_at, envelope, payload
                     FROM jobs WHERE id = $1 AND state = 'dead_lettered' FOR UPDATE",
                    &[&job_id],
                )
                .await?;
            let Some(row) = rows.first() else { continue };
            let mut env = stored_job(row)?.envelope()?;
            lazaret_core::redrive(&mut env);
            self.execute(
                "UPDATE jobs SET state = 'queued', run_at = $2, attempts = 0, finished_at = NULL,
                 lease_started_at = NULL, worker_id = NULL, redrives = $3, envelope = $4 WHERE id = $1",
                &[&job_id, &ms(now), &(env.redrives as i32), &env.to_json()],
            )
            .await?;
            self.execute("DELETE FROM dead_letters WHERE id = $1", &[&(dl.0 as i64)])
                .await?;
            self.add_ready(
                env.lane.as_str(),
                env.tenant.as_str(),
                env.job_type.as_str(),
                1,
            );
            self.group.wake = true;
            out.push(env.id);
        }
        self.audit_add(audit, out.len() as u64).await?;
        Ok(out)
    }

    /// One processing dead letter back into line with a corrected payload
    /// (the envelope keeps the one it replaced: `lazaret_core::redrive_corrected`).
    async fn redrive_corrected(
        &mut self,
        dl: DeadLetterId,
        fix: &crate::PayloadFix,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> Result<Option<JobId>, StoreError> {
        let rows = self
            .query(
                "SELECT job_id FROM dead_letters WHERE id = $1 AND stage = 'processing' FOR UPDATE",
                &[&(dl.0 as i64)],
            )
            .await?;
        let Some(job_id) = rows.first().and_then(|r| r.get::<_, Option<i64>>(0)) else {
            return Ok(None);
        };
        let rows = self
            .query(
                "SELECT id, type, tenant, lane, state, attempts, lease_started_at, worker_id,
                   idempotency_key, schema_version, created_at, finished_at, envelope, payload
                 FROM jobs WHERE id = $1 AND state = 'dead_lettered' FOR UPDATE",
                &[&job_id],
            )
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let stored = stored_job(row)?;
        let mut env = stored.envelope()?;
        lazaret_core::redrive_corrected(
            &mut env,
            lazaret_core::CorrectedPayload {
                previous: &stored.payload,
                payload: &fix.payload,
                schema_version: fix.schema_version,
                actor: &fix.actor,
                reason: &fix.reason,
                now,
            },
        );
        self.execute(
            "UPDATE jobs SET state = 'queued', run_at = $2, attempts = 0, finished_at = NULL,
             lease_started_at = NULL, worker_id = NULL, redrives = $3, envelope = $4,
             payload = $5, schema_version = $6 WHERE id = $1",
            &[
                &job_id,
                &ms(now),
                &(env.redrives as i32),
                &env.to_json(),
                &fix.payload,
                &fix.schema_version.map(|v| v as i32),
            ],
        )
        .await?;
        self.execute("DELETE FROM dead_letters WHERE id = $1", &[&(dl.0 as i64)])
            .await?;
        self.add_ready(
            env.lane.as_str(),
            env.tenant.as_str(),
            env.job_type.as_str(),
            1,
        );
        self.group.wake = true;
        self.audit_add(audit, 1).await?;
        Ok(Some(env.id))
    }

    async fn audit_add(&mut self, audit: Option<AuditId>, n: u64) -> Result<(), StoreError> {
        if let (Some(id), 1..) = (audit, n) {
            self.execute(
                "UPDATE audit SET count = count + $2 WHERE id = $1",
                &[&(id.0 as i64), &(n as i64)],
            )
            .await?;
        }
        Ok(())
    }

    async fn purge(
        &mut self,
        ids: &[DeadLetterId],
        audit: Option<AuditId>,
    ) -> Result<u64, StoreError> {
        let mut n = 0;
        for dl in ids {
            let rows = self
                .query(
                    "DELETE FROM dead_letters WHERE id = $1 RETURNING job_id",
                    &[&(dl.0 as i64)],
                )
                .await?;
            let Some(row) = rows.first() else { continue };
            if let Some(job_id) = row.get::<_, Option<i64>>(0) {
                self.execute(
                    "DELETE FROM jobs WHERE id = $1 AND state = 'dead_lettered'",
                    &[&job_id],
                )
                .await?;
            }
            n += 1;
        }
        self.audit_add(audit, n).await?;
        Ok(n)
    }

    async fn audit(&mut self, e: &AuditEntry) -> Result<AuditId, StoreError> {
        let rows = self
            .query(
                "INSERT INTO audit (at, actor, action, request, count) VALUES ($1, $2, $3, $4, $5)
                 RETURNING id",
                &[
                    &ms(e.at),
                    &e.actor,
                    &e.action,
                    &e.request.to_string(),
                    &(e.count as i64),
                ],
            )
            .await?;
        Ok(AuditId(rows[0].get::<_, i64>(0) as u64))
    }

    async fn stats(&mut self) -> Result<StoreStats, StoreError> {
        let rows = self
            .query(
                "SELECT lane, sum(ready)::int8, sum(scheduled)::int8, sum(inflight)::int8, sum(succeeded)::int8,
                   sum(cancelled)::int8
                 FROM pairs GROUP BY lane ORDER BY lane",
                &[],
            )
            .await?;
        let mut lanes = Vec::new();
        let (mut succeeded, mut cancelled) = (0u64, 0u64);
        for r in rows {
            cancelled += r.get::<_, i64>(5).max(0) as u64;
            let c = LaneCounts {
                queued: r.get::<_, i64>(1).max(0) as u64,
                scheduled: r.get::<_, i64>(2).max(0) as u64,
                leased: r.get::<_, i64>(3).max(0) as u64,
            };
            succeeded += r.get::<_, i64>(4).max(0) as u64;
            if c != LaneCounts::default() {
                lanes.push((Lane::new(r.get::<_, String>(0)), c));
            }
        }
        // One index probe (`jobs_ready_type`) per (lane, tenant, type) with
        // jobs ready.
        let oldest = self
            .query(
                "SELECT r.lane, min(x.run_at)::int8 FROM ready_types r
                 CROSS JOIN LATERAL (
                   SELECT run_at FROM jobs j
                   WHERE j.lane = r.lane AND j.tenant = r.tenant AND j.type = r.type
                     AND j.state = 'queued'
                   ORDER BY run_at, id LIMIT 1) x
                 WHERE r.ready > 0 GROUP BY r.lane ORDER BY r.lane",
                &[],
            )
            .await?;
        let oldest_ready: Vec<(Lane, Timestamp)> = oldest
            .iter()
            .map(|r| {
                (
                    Lane::new(r.get::<_, String>(0)),
                    Timestamp::from_millis(r.get(1)),
                )
            })
            .collect();
        let rows = self
            .query(
                "SELECT type, reason, count(*) FROM dead_letters GROUP BY type, reason",
                &[],
            )
            .await?;
        let mut dead_letters = Vec::new();
        for r in rows {
            let reason: String = r.get(1);
            dead_letters.push((
                r.get::<_, Option<String>>(0),
                reason.parse().map_err(corrupt)?,
                r.get::<_, i64>(2) as u64,
            ));
        }
        let held_messages = self
            .query(
                "SELECT source, count(*) FROM source_parked GROUP BY source ORDER BY source",
                &[],
            )
            .await?
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1).max(0) as u64))
            .collect();
        Ok(StoreStats {
            lanes,
            dead_letters,
            held_messages,
            succeeded,
            cancelled,
            oldest_ready,
            backend: "postgres",
            group_commit: Some(GroupCommitStats {
                // Groups committed before this one, as SQLite counts.
                commits: self.commits,
                commands: self.commands,
                syncs: 0,
                sync_micros: 0,
                leases: self.leases,
                // Not counted: PostgreSQL's plans show a lease's reads.
                lease_steps: 0,
                lease_pairs: self.lease_pairs,
            }),
        })
    }

    /// Deletes a batch of old succeeded jobs, unless another node is
    /// doing so now (one node at a time: an advisory lock).
    async fn remove_succeeded(&mut self, before: Timestamp, batch: u32) -> Result<u64, StoreError> {
        let locked = self
            .query("SELECT pg_try_advisory_xact_lock($1)", &[&RETENTION_LOCK])
            .await?;
        if !locked.first().is_some_and(|r| r.get::<_, bool>(0)) {
            return Ok(0);
        }
        let rows = self
            .query(
                "WITH old AS (
                   SELECT id FROM jobs WHERE state = 'succeeded' AND finished_at < $1
                   ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED)
                 DELETE FROM jobs j USING old WHERE j.id = old.id RETURNING j.lane, j.tenant",
                &[&ms(before), &i64::from(batch)],
            )
            .await?;
        for r in &rows {
            let (lane, tenant): (String, String) = (r.get(0), r.get(1));
            self.delta(&lane, &tenant).succeeded -= 1;
        }
        let gone = self
            .query(
                "WITH old AS (
                   SELECT id FROM jobs WHERE state = 'cancelled' AND finished_at < $1
                   ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED)
                 DELETE FROM jobs j USING old WHERE j.id = old.id RETURNING j.lane, j.tenant",
                &[&ms(before), &i64::from(batch)],
            )
            .await?;
        for r in &gone {
            let (lane, tenant): (String, String) = (r.get(0), r.get(1));
            self.delta(&lane, &tenant).cancelled -= 1;
        }
        Ok((rows.len() + gone.len()) as u64)
    }

    async fn create_token(
        &mut self,
        t: &ApiToken,
        entry: &AuditEntry,
    ) -> Result<Result<(), TokenError>, StoreError> {
        if !self
            .query("SELECT 1 FROM tokens WHERE name = $1", &[&t.name])
            .await?
            .is_empty()
        {
            return Ok(Err(TokenError::NameTaken));
        }
        if !self
            .query(
                "SELECT 1 FROM tokens WHERE token_sha256 = $1",
                &[&t.token_sha256],
            )
            .await?
            .is_empty()
        {
            return Ok(Err(TokenError::SecretTaken));
        }
        self.execute(
            "INSERT INTO tokens (name, role, token_sha256, created_at, created_by)
             VALUES ($1, $2, $3, $4, $5)",
            &[
                &t.name,
                &t.role,
                &t.token_sha256,
                &ms(t.created_at),
                &t.created_by,
            ],
        )
        .await?;
        self.audit(entry).await?;
        self.tokens_changed().await?;
        Ok(Ok(()))
    }

    async fn revoke_token(&mut self, name: &str, entry: &AuditEntry) -> Result<bool, StoreError> {
        let n = self
            .execute("DELETE FROM tokens WHERE name = $1", &[&name])
            .await?;
        if n == 0 {
            return Ok(false);
        }
        self.audit(entry).await?;
        self.tokens_changed().await?;
        Ok(true)
    }

    /// Tells every node (at commit) that the API tokens changed.
    async fn tokens_changed(&mut self) -> Result<(), StoreError> {
        let channel = self.channels.tokens.clone();
        self.execute("SELECT pg_notify($1, '')", &[&channel])
            .await?;
        Ok(())
    }

    // -----------------------------------------------------------------
    // Broker messages.

    async fn quarantine(&mut self, dl: &SourceDeadLetter) -> Result<Quarantined, StoreError> {
        let src = &dl.source;
        if dl.may_be_parked {
            self.unpark(&MessageKey::of_source(src, &dl.payload))
                .await?;
        }
        let error = dl
            .error
            .as_ref()
            .map(|e| serde_json::to_string(e).map_err(corrupt))
            .transpose()?;
        let envelope = dl.envelope.as_ref().map(Envelope::to_json);
        let source = serde_json::to_string(src).map_err(corrupt)?;
        let sha = hex::encode(lazaret_core::payload_sha256(&dl.payload));
        let redrive_id = src.redrive_id.clone().unwrap_or_default();
        let rows = self
            .query(
                "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error,
                   idempotency_key, created_at, dead_lettered_at, payload_size, payload_sha256,
                   payload_preview, payload, source, source_name, message_id, envelope, redrive_id)
                 VALUES (NULL, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19)
                 ON CONFLICT (source_name, message_id, payload_sha256, redrive_id)
                   WHERE source_name IS NOT NULL DO NOTHING
                 RETURNING id",
                &[
                    &dl.job_type,
                    &dl.tenant,
                    &dl.lane,
                    &dl.reason.as_str(),
                    &dl.stage.as_str(),
                    &(dl.attempts as i32),
                    &error,
                    &dl.idempotency_key,
                    &ms(dl.created_at),
                    &ms(dl.now),
                    &(dl.payload.len() as i64),
                    &sha,
                    &payload_preview(&dl.payload, lazaret_core::PREVIEW_BYTES_MAX),
                    &dl.payload,
                    &source,
                    &src.name,
                    &src.message_id,
                    &envelope,
                    &redrive_id,
                ],
            )
            .await?;
        if let Some(r) = rows.first() {
            return Ok(Quarantined {
                id: DeadLetterId(r.get::<_, i64>(0) as u64),
                created: true,
            });
        }
        let rows = self
            .query(
                "SELECT id FROM dead_letters WHERE source_name = $1 AND message_id = $2
                   AND payload_sha256 = $3 AND redrive_id = $4",
                &[&src.name, &src.message_id, &sha, &redrive_id],
            )
            .await?;
        let id: i64 = rows
            .first()
            .map(|r| r.get(0))
            .ok_or_else(|| corrupt("a quarantined message without its dead letter"))?;
        Ok(Quarantined {
            id: DeadLetterId(id as u64),
            created: false,
        })
    }

    async fn park(&mut self, p: &ParkedMessage) -> Result<(), StoreError> {
        let source = serde_json::to_string(&p.source).map_err(corrupt)?;
        let key = p.key();
        self.execute(
            "INSERT INTO source_parked
               (source, message_id, payload_sha256, redrive_id, due_at, ref, envelope, body)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (source, message_id, payload_sha256, redrive_id) DO UPDATE SET
               due_at = excluded.due_at, ref = excluded.ref, envelope = excluded.envelope,
               body = excluded.body, claimed_by = NULL, claim_expires_at = NULL",
            &[
                &key.source,
                &key.message_id,
                &key.payload_sha256,
                &key.redrive_column(),
                &ms(p.due_at),
                &source,
                &p.envelope.to_json(),
                &p.body,
            ],
        )
        .await?;
        Ok(())
    }

    /// Drops the retry held for `key`; whether there was one.
    async fn unpark(&mut self, key: &MessageKey) -> Result<bool, StoreError> {
        let n = self
            .execute(
                "DELETE FROM source_parked WHERE source = $1 AND message_id = $2
                   AND payload_sha256 = $3 AND redrive_id = $4",
                &[
                    &key.source,
                    &key.message_id,
                    &key.payload_sha256,
                    &key.redrive_column(),
                ],
            )
            .await?;
        Ok(n > 0)
    }
}

/// A job locked for an outcome: its row, lease token, lease end, and
/// whether a cancel was requested.
type Locked = (StoredJob, Option<i64>, Option<i64>, bool);

/// The columns of a multi-row job insert.
#[derive(Default)]
struct InsertColumns<'a> {
    types: Vec<&'a str>,
    tenants: Vec<&'a str>,
    lanes: Vec<&'a str>,
    states: Vec<&'static str>,
    run_at: Vec<i64>,
    keys: Vec<Option<&'a str>>,
    schema_versions: Vec<Option<i32>>,
    enqueued_by: Vec<Option<&'a str>>,
    created_at: Vec<i64>,
    payloads: Vec<&'a [u8]>,
}

impl<'a> InsertColumns<'a> {
    fn push(&mut self, job: &'a NewJob, state: JobState) {
        self.types.push(job.job_type.as_str());
        self.tenants.push(job.tenant.as_str());
        self.lanes.push(job.lane.as_str());
        self.states.push(state.as_str());
        self.run_at.push(ms(job.run_at));
        self.keys.push(job.idempotency_key.as_deref());
        self.schema_versions
            .push(job.schema_version.map(|v| v as i32));
        self.enqueued_by.push(job.enqueued_by.as_deref());
        self.created_at.push(ms(job.now));
        self.payloads.push(&job.payload);
    }
}
