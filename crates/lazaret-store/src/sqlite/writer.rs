//! The writer thread: every change goes through here, grouped into shared
//! transactions. It also keeps the ready counts per (lane, tenant, type) and
//! the in-flight counts per (lane, tenant) that the core's lease plan and
//! fair scheduler pick from, rebuilt from the database at start.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};

use lazaret_core::{
    Among, Envelope, Event, FairScheduler, JobId, JobState, JobType, Lane, LeaseFilter, PairCounts,
    TenantId, Timestamp, Transition, payload_preview, plan_lease,
};
use rusqlite::{Connection, OptionalExtension, params};

use super::sequence::Reserved;
use super::stored::{COLUMNS, StoredJob};
use super::sync::Syncer;
use crate::request::{Claim, Reply, Request};
use crate::{
    AdmissionRecord, AuditEntry, CancelError, Cancelled, Completed, Completion, DeadLetterId,
    Decider, EnqueueOutcome, Heartbeat, ItemError, LaneCounts, LeaseRequest, LeaseToken, LeasedJob,
    NewJob, PauseTarget, StoreError, StoreStats, Tick,
};

/// What the writer thread takes: a store request, or one of its own
/// controls.
// Mostly requests, moved once into the channel.
#[allow(clippy::large_enum_variant)]
pub(super) enum Cmd {
    Request(Request),
    /// Flushes, checkpoints and stops the writer (`Writer::close`).
    Close(Reply<()>),
    /// Tests: waits for the gate to open (or close), then runs the SQL.
    #[cfg(test)]
    Sql(String, mpsc::Receiver<()>, Reply<()>),
    /// Tests: says it holds the writer, then holds it until `resume` opens
    /// (or closes).
    #[cfg(any(test, feature = "test-hooks"))]
    Hold(mpsc::Sender<()>, mpsc::Receiver<()>),
    /// Tests: the writer panics, as a bug in it would.
    #[cfg(any(test, feature = "test-hooks"))]
    Crash,
}

impl Cmd {
    /// Whether this waits behind small commands ([`Queue`]).
    fn is_bulk(&self) -> bool {
        let Cmd::Request(r) = self else {
            return false;
        };
        match r {
            Request::Enqueue { jobs, .. } => jobs.len() > BULK_ROWS,
            Request::Lease { req, .. } => req.max_jobs as usize > BULK_ROWS,
            Request::Complete { items, .. } => items.len() > BULK_ROWS,
            Request::Quarantine { dls, .. } => dls.len() > BULK_ROWS,
            Request::Redrive { ids, .. } | Request::Purge { ids, .. } => ids.len() > BULK_ROWS,
            // Housekeeping: promotions and expiries by the thousand, and
            // retention's deletes.
            Request::Tick { .. } | Request::RemoveSucceeded { .. } => true,
            _ => false,
        }
    }

    /// Answers a command that never ran: `StoreError::NotApplied`, for `why`.
    fn fail(self, why: &str) {
        let e = || StoreError::NotApplied(why.to_owned());
        match self {
            Cmd::Request(r) => r.fail(why),
            Cmd::Close(tx) => tx.send(Err(e())),
            #[cfg(test)]
            Cmd::Sql(_, _, tx) => tx.send(Err(e())),
            #[cfg(any(test, feature = "test-hooks"))]
            Cmd::Hold(..) | Cmd::Crash => {}
        }
    }
}

/// The writer's end of the command queue: takes commands off it and keeps
/// count of those still waiting (`SqliteStore::call` refuses commands past
/// its bound).
pub(super) struct Inbox {
    pub(super) rx: mpsc::Receiver<Cmd>,
    pub(super) waiting: Arc<AtomicUsize>,
}

impl Inbox {
    fn recv(&self) -> Option<Cmd> {
        let cmd = self.rx.recv().ok()?;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        Some(cmd)
    }

    fn try_recv(&self) -> Option<Cmd> {
        let cmd = self.rx.try_recv().ok()?;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        Some(cmd)
    }
}

/// Commands taken off the inbox and not yet run, in two queues: bulk
/// commands (many rows each: large enqueues and outcome batches, and
/// housekeeping) wait behind every other. A group runs the small commands
/// first and then bulk ones, but takes no bulk one once a small command
/// waits for its commit (see [`Queue::next`]); so a flood of bulk enqueues
/// delays a single job's enqueue, lease or ack by at most the one bulk
/// command running when it arrives, not by everything queued before it.
/// Commands of different requests are concurrent, so this reordering is
/// never visible to any one client.
#[derive(Default)]
pub(super) struct Queue {
    small: VecDeque<Cmd>,
    /// With when each was queued: a bulk command that has waited
    /// [`BULK_WAIT_MAX`] joins even a group of small ones.
    bulk: VecDeque<(std::time::Instant, Cmd)>,
    /// Small commands queued when the current group began: they run in it.
    group_smalls: usize,
    /// Small commands run in the current group so far.
    smalls_taken: usize,
}

impl Queue {
    fn len(&self) -> usize {
        self.small.len() + self.bulk.len()
    }

    fn is_empty(&self) -> bool {
        self.small.is_empty() && self.bulk.is_empty()
    }

    fn push(&mut self, cmd: Cmd) {
        if cmd.is_bulk() {
            self.bulk.push_back((std::time::Instant::now(), cmd));
        } else {
            self.small.push_back(cmd);
        }
    }

    /// Takes what waits in the inbox, as long as this holds fewer than
    /// [`GROUP_MAX`] (the inbox's own bound then holds the rest back).
    fn fill(&mut self, rx: &Inbox) {
        while self.len() < GROUP_MAX {
            match rx.try_recv() {
                Some(cmd) => self.push(cmd),
                None => break,
            }
        }
    }

    /// Any command, small ones first: for failing or flushing them all.
    fn pop_any(&mut self) -> Option<Cmd> {
        self.small
            .pop_front()
            .or_else(|| self.bulk.pop_front().map(|(_, c)| c))
    }

    /// Starts a group: the small commands queued now all run in it.
    fn begin_group(&mut self) {
        self.group_smalls = self.small.len();
        self.smalls_taken = 0;
    }

    /// The next command of the group that began at `began` and has run
    /// `taken` commands, or `None` to commit it now.
    ///
    /// - Small commands queued when it began run in it; those arriving
    ///   later join it during [`LATE_JOIN_WINDOW`] (to share its fsync),
    ///   and after that end it, so that they lead the next group.
    /// - Then bulk commands, only while no small command is in the group
    ///   or waiting: always one, more for up to [`BULK_GROUP_WINDOW`]. A
    ///   group with a small command commits without any (its fsync is what
    ///   the small one waits for), unless the oldest bulk command has
    ///   waited [`BULK_WAIT_MAX`]: then one joins, so that a steady stream
    ///   of small commands cannot starve bulk ones.
    /// - Once the store is closing, everything queued, and nothing more
    ///   from the inbox.
    fn next(
        &mut self,
        rx: &Inbox,
        taken: usize,
        bulk_taken: bool,
        closing: bool,
        began: std::time::Instant,
    ) -> Option<Cmd> {
        if closing {
            return self.pop_any();
        }
        if taken >= GROUP_MAX {
            return None;
        }
        if self.group_smalls > 0 {
            self.group_smalls -= 1;
            self.smalls_taken += 1;
            return self.small.pop_front();
        }
        self.fill(rx);
        let elapsed = began.elapsed();
        let open = elapsed <= LATE_JOIN_WINDOW;
        if !self.small.is_empty() {
            if !open {
                return None;
            }
            self.smalls_taken += 1;
            return self.small.pop_front();
        }
        let more_bulk = if self.smalls_taken > 0 {
            !bulk_taken
                && self
                    .bulk
                    .front()
                    .is_some_and(|(queued, _)| queued.elapsed() >= BULK_WAIT_MAX)
        } else {
            !bulk_taken || elapsed <= BULK_GROUP_WINDOW
        };
        if more_bulk {
            self.bulk.pop_front().map(|(_, c)| c)
        } else {
            None
        }
    }
}

/// An answer held back until the group's commit is durable; called with the
/// error that undid the group, if any.
pub(super) type Pending = Box<dyn FnOnce(Option<StoreError>) + Send>;

fn pend<T: Send + 'static>(tx: Reply<T>, result: Result<T, StoreError>) -> Pending {
    Box::new(move |group_error: Option<StoreError>| {
        // A command's own failure is the better answer than the group's.
        let r = match (group_error, result) {
            (_, Err(e)) => Err(e),
            (Some(e), Ok(_)) => Err(e),
            (None, ok) => ok,
        };
        tx.send(r);
    })
}

/// Groups run with a savepoint per command after a command failed.
const ISOLATED_GROUPS: u32 = 100;
/// Commands taken into one transaction at most.
const GROUP_MAX: usize = 1024;
/// Commands arriving while a group runs join it only during this window,
/// so a steady stream of arrivals cannot hold a group's commit back.
const LATE_JOIN_WINDOW: std::time::Duration = std::time::Duration::from_millis(2);
/// A group of bulk commands only goes on taking more of them for this long
/// (their answers wait for its commit).
const BULK_GROUP_WINDOW: std::time::Duration = std::time::Duration::from_millis(20);
/// A bulk command that has waited this long runs even in a group of small
/// commands ([`Queue::next`]).
const BULK_WAIT_MAX: std::time::Duration = std::time::Duration::from_millis(50);
/// A command of more rows than this (jobs enqueued, outcomes, dead letters,
/// ids) is bulk: it waits behind the small ones ([`Queue`]).
pub(super) const BULK_ROWS: usize = 1;
/// Scheduled jobs promoted per tick at most; the rest go on the next.
const PROMOTE_MAX: i64 = 20_000;
/// Expired leases handled per tick at most.
const EXPIRE_MAX: i64 = 2_000;

/// A take of the lease plan, owned, so the counts it was planned from can change.
struct OwnedTake {
    lane: Lane,
    tenant: TenantId,
    /// `None`: any type.
    types: Option<Vec<JobType>>,
    count: u32,
}

pub(super) struct Writer {
    /// Makes commits durable and sends their answers (`Durability::Full`);
    /// `None`: answers go out at COMMIT. Declared before `conn` so that it is
    /// dropped, and its answers flushed, before the connection closes.
    syncer: Option<Syncer>,
    /// Copies the WAL into the database beside this thread
    /// (`super::checkpoint`); stopped before the connection's last
    /// checkpoint at close.
    checkpointer: Option<super::checkpoint::Checkpointer>,
    conn: Connection,
    scheduler: FairScheduler,
    decider: Arc<dyn Decider>,
    /// Per lane, per tenant, with the ordered sets a lease walks (`super::pairs`).
    pairs: super::pairs::Pairs,
    scheduled: HashMap<Lane, u64>,
    succeeded: u64,
    cancelled: u64,
    /// Groups committed and the commands in them, since start.
    commits: u64,
    commands: u64,
    /// Job ids and lease tokens, reserved ahead so that a lease can be
    /// answered at COMMIT (`super::sequence`).
    seq: Reserved,
    /// The lease running now handed out an id or a token that a power loss
    /// could bring back: its answer waits for the fsync.
    lease_late: bool,
    /// A command failed after touching the counts: rebuild them after the group.
    dirty: bool,
    /// Groups still to run with a savepoint per command (after a failure).
    isolated_groups: u32,

    /// Lease commands run, and the SQLite VM steps their reads took
    /// (`StoreStats::lease_steps`).
    leases: u64,
    lease_steps: u64,
    /// (lane, tenant) pairs those leases looked at (`GroupCommitStats::lease_pairs`).
    lease_pairs: u64,
}

fn db<T>(r: rusqlite::Result<T>) -> Result<T, StoreError> {
    r.map_err(StoreError::from)
}

fn ms(t: Timestamp) -> i64 {
    t.as_millis()
}

fn state_word(s: JobState) -> &'static str {
    s.as_str()
}

impl Writer {
    pub(super) fn new(
        conn: Connection,
        scheduler: FairScheduler,
        decider: Arc<dyn Decider>,
    ) -> Result<Self, StoreError> {
        // One cached statement per shape of lease filter, besides the fixed ones.
        conn.set_prepared_statement_cache_capacity(128);
        let seq = Reserved::load(&conn)?;
        Ok(Writer {
            seq,
            lease_late: false,
            conn,
            scheduler,
            decider,
            pairs: super::pairs::Pairs::default(),
            scheduled: HashMap::new(),
            succeeded: 0,
            cancelled: 0,
            commits: 0,
            commands: 0,
            dirty: false,
            isolated_groups: 0,
            leases: 0,
            lease_steps: 0,
            lease_pairs: 0,
            syncer: None,
            checkpointer: None,
        })
    }

    /// From now on a thread of its own checkpoints, and this connection's
    /// automatic checkpoint only bounds the WAL.
    pub(super) fn set_checkpointer(
        &mut self,
        checkpointer: super::checkpoint::Checkpointer,
    ) -> Result<(), StoreError> {
        db(self.conn.pragma_update(
            None,
            "wal_autocheckpoint",
            super::checkpoint::WRITER_AUTOCHECKPOINT_PAGES,
        ))?;
        self.checkpointer = Some(checkpointer);
        Ok(())
    }

    /// From now on, answers go out after the syncer's fsync.
    pub(super) fn set_syncer(&mut self, syncer: Syncer) {
        self.syncer = Some(syncer);
    }

    /// Recounts queued, scheduled, leased and succeeded jobs from the database.
    pub(super) fn rebuild_counts(&mut self) -> Result<(), StoreError> {
        self.pairs.clear();
        self.scheduled.clear();
        let mut stmt = db(self.conn.prepare(
            "SELECT lane, tenant, type, state, COUNT(*) FROM jobs
             WHERE state IN ('queued', 'scheduled', 'leased') GROUP BY lane, tenant, type, state",
        ))?;
        let rows = db(stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, i64>(4)?,
            ))
        }))?;
        let mut counted = Vec::new();
        for row in rows {
            counted.push(db(row)?);
        }
        drop(stmt);
        for (lane, tenant, job_type, state, n) in counted {
            let lane = Lane::new(lane);
            match state.as_str() {
                "scheduled" => *self.scheduled.entry(lane).or_default() += n as u64,
                "queued" => self.pairs.add_ready(&lane, &tenant, &job_type, n as u32),
                _ => self.pairs.add_inflight(&lane, &tenant, n as u32),
            }
        }
        self.succeeded = db(self.conn.query_row(
            "SELECT COUNT(*) FROM jobs WHERE state = 'succeeded'",
            [],
            |r| r.get::<_, i64>(0),
        ))? as u64;
        self.cancelled = db(self.conn.query_row(
            "SELECT COUNT(*) FROM jobs WHERE state = 'cancelled'",
            [],
            |r| r.get::<_, i64>(0),
        ))? as u64;
        self.dirty = false;
        Ok(())
    }

    pub(super) fn run(mut self, rx: Inbox) {
        let mut queue = Queue::default();
        loop {
            if queue.is_empty() {
                match rx.recv() {
                    Some(cmd) => queue.push(cmd),
                    None => return,
                }
            }
            queue.fill(&rx);
            if self.run_group(&mut queue, &rx) {
                return;
            }
        }
    }

    /// Runs a parameterless statement through the statement cache: the
    /// transaction and savepoint statements run for every command, and
    /// parsing them each time showed in profiles.
    fn exec(&self, sql: &str) -> rusqlite::Result<()> {
        self.conn.prepare_cached(sql)?.execute([]).map(|_| ())
    }

    /// Runs one group in one transaction; returns whether the store closes.
    ///
    /// Normally without savepoints (they cost a sub-journal copy of every
    /// page each command touches): if a command fails, the whole group rolls
    /// back, every command in it is answered with an error (nothing of it
    /// happened; the caller may retry), and the next [`ISOLATED_GROUPS`]
    /// groups run each command in its own savepoint, so a command that keeps
    /// failing cannot take other requests down with it for long.
    ///
    /// Commands that arrive while the group runs join it before its COMMIT
    /// (up to [`GROUP_MAX`], for [`LATE_JOIN_WINDOW`]): they share its fsync
    /// instead of waiting for the next one.
    fn run_group(&mut self, queue: &mut Queue, rx: &Inbox) -> bool {
        let mut pending: Vec<Pending> = Vec::with_capacity(queue.len());
        // Leases whose tokens are all below a reservation on disk: answered
        // at COMMIT, before the fsync (see `super::sequence`).
        let mut early: Vec<Pending> = Vec::new();
        let mut close: Option<Reply<()>> = None;
        let isolated = self.isolated_groups > 0;
        self.isolated_groups = self.isolated_groups.saturating_sub(1);
        // Why the whole group is not applied (`StoreError::NotApplied`), if so.
        let refused = match self.syncer.as_ref().and_then(Syncer::failure) {
            Some(why) => Some(format!(
                "lazaret stopped writing after an earlier commit could not be made durable, so nothing of this request was applied; check the disk, then restart lazaret (the earlier failure: {why})"
            )),
            None => self.exec("BEGIN IMMEDIATE").err().map(|e| {
                format!(
                    "could not start a transaction ({e}); retry, and if it persists check the data directory's disk space and permissions"
                )
            }),
        };
        if let Some(why) = refused {
            let mut closing = false;
            while let Some(cmd) = queue.pop_any() {
                if let Cmd::Close(tx) = cmd {
                    closing = true;
                    self.close(tx);
                    continue;
                }
                cmd.fail(&why);
            }
            return closing;
        }
        if let Some(syncer) = &self.syncer {
            self.seq.flushed(syncer.synced());
        }
        let mut group_error: Option<String> = None;
        let mut taken = 0;
        let mut bulk_taken = false;
        let began_at = std::time::Instant::now();
        queue.begin_group();
        while group_error.is_none() {
            let Some(cmd) = queue.next(rx, taken, bulk_taken, close.is_some(), began_at) else {
                break;
            };
            taken += 1;
            bulk_taken |= cmd.is_bulk();
            if let Cmd::Close(tx) = cmd {
                close = Some(tx);
                continue;
            }
            if isolated {
                if let Err(e) = self.exec("SAVEPOINT cmd") {
                    cmd.fail(
                        &format!(
                            "could not open a savepoint ({e}); retry, and if it persists check the data directory's disk space and permissions"
                        ),
                    );
                    continue;
                }
            }
            let mark = self.seq.mark();
            let is_lease = matches!(cmd, Cmd::Request(Request::Lease { .. }));
            self.lease_late = false;
            let (p, ok) = self.execute(cmd);
            if is_lease && !self.lease_late && self.syncer.is_some() {
                early.push(p);
            } else {
                pending.push(p);
            }
            if ok && !isolated {
                continue;
            }
            if !ok {
                self.dirty = true;
            }
            if !isolated {
                // What is still queued runs in the next groups, isolated.
                group_error = Some(
                    "another request in the same transaction failed, so none of it was applied; retry".into(),
                );
                continue;
            }
            if !ok && self.conn.is_autocommit() {
                // SQLite rolled the whole transaction back by itself
                // (a full disk, an I/O error): nothing of the group is
                // left, and a savepoint now would start a transaction
                // of its own, committed by its RELEASE.
                group_error = Some(
                    "the database rolled the transaction back after an error in another request, so none of it was applied; retry, and if it persists check the data directory's disk space".into(),
                );
                continue;
            }
            let end = if ok {
                self.exec("RELEASE cmd")
            } else {
                self.seq.rolled_back_to(mark);
                self.exec("ROLLBACK TO cmd")
                    .and_then(|()| self.exec("RELEASE cmd"))
            };
            if let Err(e) = end {
                tracing::error!(error = %e, "savepoint release failed");
                self.dirty = true;
            }
        }
        if let Some(why) = group_error {
            tracing::warn!(
                "a command failed; its group was rolled back and the next groups run isolated"
            );
            let _ = self.exec("ROLLBACK");
            self.seq.rolled_back();
            self.isolated_groups = ISOLATED_GROUPS;
            self.dirty = true;
            if let Err(e) = self.rebuild_counts() {
                tracing::error!(error = %e, "rebuilding counts failed");
            }
            for p in pending.into_iter().chain(early) {
                p(Some(StoreError::NotApplied(why.clone())));
            }
            if let Some(tx) = close {
                fail_queued(queue);
                self.close(tx);
                return true;
            }
            return false;
        }
        let commit_error = self.exec("COMMIT").err();
        // Whether the commit needs an fsync even when no answer waits for
        // it: it carries a new reservation, or early leases (so that the
        // attempts they charged reach the disk soon).
        let mut needs_fsync = false;
        if commit_error.is_none() {
            self.commits += 1;
            self.commands += taken as u64;
            needs_fsync = self.seq.committed(self.commits) | !early.is_empty();
            if self.syncer.as_ref().and_then(Syncer::failure).is_some() {
                // The store stopped writing while this group ran: these
                // leases will never be durable; answer them as such.
                pending.append(&mut early);
            }
            for p in early.drain(..) {
                p(None);
            }
        } else {
            let _ = self.conn.execute_batch("ROLLBACK");
            self.seq.rolled_back();
            self.dirty = true;
            pending.append(&mut early);
        }
        if self.dirty {
            if let Err(e) = self.rebuild_counts() {
                tracing::error!(error = %e, "rebuilding counts failed");
            }
        }
        match (commit_error, &self.syncer) {
            (Some(e), _) => {
                let why = format!(
                    "the commit failed ({e}); retry, and if it persists check the data directory's disk space and permissions"
                );
                for p in pending {
                    p(Some(StoreError::NotApplied(why.clone())));
                }
            }
            // Answered once the WAL is flushed, while this thread goes on.
            (None, Some(syncer)) => syncer.submit(self.commits, pending, needs_fsync),
            (None, None) => {
                for p in pending {
                    p(None);
                }
                // `Durability::Normal` counts a commit as written.
                self.seq.flushed(self.commits);
            }
        }
        if let Some(tx) = close {
            fail_queued(queue);
            self.close(tx);
            return true;
        }
        false
    }

    /// Closes the store: every answer out (after its fsync), the WAL folded
    /// into the database and truncated, then `tx` answered.
    ///
    /// After a failed fsync the WAL is left as it is, and `tx` answered
    /// `NotDurable`: a checkpoint would copy frames the kernel may have lost
    /// into the database unchecked, while recovery at the next start
    /// verifies their checksums. This connection then closes without a
    /// checkpoint, and so must the reader (`SqliteStore::close`).
    fn close(&mut self, tx: Reply<()>) {
        if let Some(c) = &mut self.checkpointer {
            c.stop();
        }
        let failure = self.syncer.as_mut().and_then(|syncer| {
            syncer.finish();
            syncer.failure()
        });
        let r = match failure {
            None => {
                let _ = self.conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE)");
                Ok(())
            }
            Some(why) => {
                let _ = self.conn.set_db_config(
                    rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
                    true,
                );
                Err(StoreError::NotDurable(format!(
                    "closed without a checkpoint, the write-ahead log left for recovery to verify at the next start: {why}"
                )))
            }
        };
        tx.send(r);
    }

    /// Runs one command; returns its held-back answer and whether it succeeded.
    fn execute(&mut self, cmd: Cmd) -> (Pending, bool) {
        macro_rules! run {
            ($tx:expr, $e:expr) => {{
                let r = $e;
                let ok = r.is_ok();
                (pend($tx, r), ok)
            }};
        }
        let r = match cmd {
            Cmd::Request(r) => r,
            Cmd::Close(tx) => return run!(tx, Ok(())),
            #[cfg(test)]
            Cmd::Sql(sql, gate, tx) => {
                let _ = gate.recv();
                return run!(tx, db(self.conn.execute_batch(&sql)));
            }
            #[cfg(any(test, feature = "test-hooks"))]
            Cmd::Hold(held, resume) => {
                let _ = held.send(());
                let _ = resume.recv();
                return (Box::new(|_: Option<StoreError>| {}), true);
            }
            #[cfg(any(test, feature = "test-hooks"))]
            Cmd::Crash => panic!("the writer crashed (a test hook)"),
        };
        match r {
            Request::Enqueue { jobs, reply } => run!(reply, self.enqueue(jobs)),
            Request::Lease { req, reply } => run!(reply, self.lease(&req)),
            Request::Complete { items, now, reply } => run!(reply, self.complete(items, now)),
            Request::Heartbeat {
                id,
                token,
                expires_at,
                now,
                reply,
            } => run!(reply, self.heartbeat(id, token, expires_at, now)),
            Request::Cancel {
                id,
                now,
                audit,
                reply,
            } => run!(reply, self.cancel(id, now, audit)),
            Request::SetPause {
                target,
                paused,
                audit,
                reply,
            } => run!(reply, self.set_pause(&target, paused, &audit)),
            Request::Tick { now, reply } => run!(reply, self.tick(now)),
            Request::RecordAdmission { rec, reply } => run!(reply, self.record_admission(&rec)),
            Request::Redrive {
                ids,
                now,
                audit,
                reply,
            } => run!(reply, self.redrive(&ids, now, audit)),
            Request::RedriveCorrected {
                id,
                fix,
                now,
                audit,
                reply,
            } => run!(reply, self.redrive_corrected(id, &fix, now, audit)),
            Request::Purge { ids, audit, reply } => run!(reply, self.purge(&ids, audit)),
            Request::Audit { entry, reply } => run!(reply, self.audit(&entry)),
            Request::Stats { reply } => run!(reply, self.stats()),
            Request::RemoveSucceeded {
                before,
                batch,
                reply,
            } => run!(reply, self.remove_succeeded(before, batch)),
            Request::CreateToken {
                token,
                audit,
                reply,
            } => run!(reply, self.create_token(&token, &audit)),
            Request::RevokeToken { name, audit, reply } => {
                run!(reply, self.revoke_token(&name, &audit))
            }
            Request::Quarantine { dls, reply } => run!(reply, self.quarantine(&dls)),
            Request::Park { p, reply } => run!(reply, self.park(&p)),
            Request::Unpark { key, reply } => run!(reply, self.unpark(&key)),
            Request::ClaimDue { claim, reply } => run!(reply, self.claim_due(&claim)),
        }
    }

    fn enqueue(&mut self, jobs: Vec<NewJob>) -> Result<Vec<EnqueueOutcome>, StoreError> {
        let mut out = Vec::with_capacity(jobs.len());
        for job in jobs {
            if let Some(key) = &job.idempotency_key {
                let existing = db(self
                    .conn
                    .prepare_cached(
                        "SELECT id, state, run_at FROM jobs WHERE tenant = ?1 AND type = ?2 AND idempotency_key = ?3",
                    )?
                    .query_row(params![job.tenant.as_str(), job.job_type.as_str(), key], |r| {
                        Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?))
                    })
                    .optional())?;
                if let Some((id, state, run_at)) = existing {
                    let mut state: JobState = state
                        .parse()
                        .map_err(|e| StoreError::Corrupt(format!("{e}")))?;
                    if state == JobState::Scheduled && run_at <= ms(job.now) {
                        state = JobState::Queued;
                    }
                    out.push(EnqueueOutcome::Duplicate {
                        id: JobId(id as u64),
                        state,
                    });
                    continue;
                }
            }
            // A bound on the tenants with jobs ready, if configured: a job of
            // a tenant with none ready is refused at it (the core's rule).
            let config = self.scheduler.config();
            if !config.admits_tenant(
                self.pairs.has_ready(job.tenant.as_str()),
                self.pairs.tenants_ready(),
            ) {
                out.push(EnqueueOutcome::TooManyTenants {
                    tenants_ready_max: config.tenants_ready_max.unwrap_or_default(),
                });
                continue;
            }
            let id = JobId(self.seq.ids.issue(&self.conn)?);
            let state = if job.run_at > job.now {
                JobState::Scheduled
            } else {
                JobState::Queued
            };
            // No envelope yet: `StoredJob::envelope` builds the fresh one from
            // these columns when it is first needed.
            db(self
                .conn
                .prepare_cached(
                    "INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, idempotency_key,
                       schema_version, enqueued_by, created_at, payload)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, 0, ?7, ?8, ?9, ?10, ?11)",
                )?
                .execute(params![
                    id.0 as i64,
                    job.job_type.as_str(),
                    job.tenant.as_str(),
                    job.lane.as_str(),
                    state_word(state),
                    ms(job.run_at),
                    job.idempotency_key,
                    job.schema_version,
                    job.enqueued_by,
                    ms(job.now),
                    job.payload,
                ]))?;
            if state == JobState::Scheduled {
                *self.scheduled.entry(job.lane.clone()).or_default() += 1;
            } else {
                self.pairs
                    .add_ready(&job.lane, &job.tenant, &job.job_type, 1);
            }
            let inflight = self
                .pairs
                .get(job.lane.as_str(), job.tenant.as_str())
                .map_or(0, |p| p.inflight);
            out.push(EnqueueOutcome::Created {
                id,
                state,
                inflight,
            });
        }
        Ok(out)
    }

    /// Leases what the core's lease plan says: it sees the ready counts by
    /// type, so it never sends the store to a (lane, tenant) without jobs
    /// of the asked types, and each take reads only rows it leases (see
    /// `lease_take`). What a lease costs does not depend on how many jobs
    /// of other types wait.
    fn lease(&mut self, req: &LeaseRequest) -> Result<Vec<LeasedJob>, StoreError> {
        self.leases += 1;
        let mut out: Vec<LeasedJob> = Vec::new();
        let lane_ok = |lane: &Lane| {
            req.lanes.as_ref().is_none_or(|ls| ls.contains(lane))
                && !req.exclude_lanes.contains(lane)
        };
        let takes: Vec<OwnedTake> = {
            let filter = LeaseFilter {
                types: req.types.as_deref(),
                excluded: &req.exclude_types,
                probes: &req.type_limits,
            };
            // Only the pairs the plan needs, walked in the round's order
            // from ordered sets (`super::pairs`): about `max_jobs` per
            // lane, however many tenants have jobs ready.
            let pairs: Vec<PairCounts<'_>> = self.pairs.window(
                &self.scheduler,
                &filter,
                lane_ok,
                req.max_jobs,
                &mut self.lease_pairs,
            );
            plan_lease(&mut self.scheduler, &pairs, &filter, req.max_jobs)
                .into_iter()
                .map(|t| OwnedTake {
                    lane: pairs[t.pair].lane.clone(),
                    tenant: pairs[t.pair].tenant.clone(),
                    types: match t.among {
                        Among::AnyType => None,
                        Among::Types(ts) => Some(ts.into_iter().cloned().collect()),
                    },
                    count: t.count,
                })
                .collect()
        };
        for take in &takes {
            let got = self.lease_take(req, take, &mut out)?;
            if got < take.count {
                // The counts promised more than the table holds: recount
                // after this group rather than plan from wrong numbers again.
                tracing::warn!(
                    lane = %take.lane, tenant = %take.tenant, planned = take.count, got,
                    "ready counts were off; recounting"
                );
                self.dirty = true;
            }
        }
        Ok(out)
    }

    /// Leases up to `take.count` queued jobs of one (lane, tenant), oldest
    /// first, writing only columns: the attempt is charged and the running
    /// attempt recorded in `lease_started_at` and `worker_id` (see
    /// `super::stored`). The token comes from the store's one sequence
    /// (`super::sequence`): new for every lease, across restarts, redrives
    /// and power losses.
    ///
    /// Reads go by index and stop at what they lease: one type by
    /// `jobs_ready_type` (lane, tenant, type, run_at, id); several types
    /// (or any type, when the pair holds several) by the first `count`
    /// entries of each type in `jobs_ready_type`, merged by (run_at, id),
    /// then the chosen rows by rowid. No read walks past
    /// jobs of a type it does not take.
    fn lease_take(
        &mut self,
        req: &LeaseRequest,
        take: &OwnedTake,
        out: &mut Vec<LeasedJob>,
    ) -> Result<u32, StoreError> {
        // `LIMIT +?n`, never `LIMIT ?n`, here and in every cached statement:
        // SQLite (3.46 on) plans with a bare bound LIMIT's value, so each
        // new binding expires the statement and the next step re-parses and
        // re-plans it (a tenth of the writer's time in profiles). The unary
        // plus keeps the plan independent of the value.
        const ONE_TYPE: &str = "SELECT id, type, idempotency_key, schema_version, created_at, payload, attempts, run_at
             FROM jobs INDEXED BY jobs_ready_type WHERE lane = ?1 AND tenant = ?2 AND type = ?3 AND state = 'queued'
             ORDER BY run_at, id LIMIT +?4";
        const OLDEST_OF_TYPE: &str = "SELECT run_at, id
             FROM jobs INDEXED BY jobs_ready_type WHERE lane = ?1 AND tenant = ?2 AND type = ?3 AND state = 'queued'
             ORDER BY run_at, id LIMIT +?4";
        const BY_ID: &str =
            "SELECT id, type, idempotency_key, schema_version, created_at, payload, attempts, run_at
             FROM jobs WHERE id = ?1 AND state = 'queued'";
        let (lane, tenant, count) = (&take.lane, &take.tenant, i64::from(take.count));
        let expires = req.now.saturating_add(req.lease);
        let start = out.len();
        let ctx = Leasing {
            lane,
            tenant,
            expires,
        };
        // Every ready job is in one index, `jobs_ready_type` (lane, tenant,
        // type, run_at, id), kept up by each enqueue and lease: a lease of
        // any type reads the oldest of each type the pair has ready (one
        // range when the tenant has one type, the usual case), so the
        // success path pays for one ready index, not two.
        let any: Vec<JobType>;
        let types: &[JobType] = match take.types.as_deref() {
            Some(types) => types,
            None => {
                any = self
                    .pairs
                    .get(lane, tenant)
                    .map(|p| {
                        p.by_type
                            .iter()
                            .filter(|(_, n)| **n > 0)
                            .map(|(t, _)| t.clone())
                            .collect()
                    })
                    .unwrap_or_default();
                &any
            }
        };
        match types {
            [] => {}
            [job_type] => {
                let mut stmt = db(self.conn.prepare_cached(ONE_TYPE))?;
                let mut q = db(stmt.query(params![
                    lane.as_str(),
                    tenant.as_str(),
                    job_type.as_str(),
                    count
                ]))?;
                while let Some(r) = db(q.next())? {
                    out.push(ctx.job(r, &self.conn, &mut self.seq, &mut self.lease_late)?);
                }
                drop(q);
                self.lease_steps += vm_steps(&stmt);
            }
            types => {
                let mut oldest: Vec<(i64, i64)> = Vec::new();
                {
                    let mut stmt = db(self.conn.prepare_cached(OLDEST_OF_TYPE))?;
                    for t in types {
                        let rows = db(stmt.query_map(
                            params![lane.as_str(), tenant.as_str(), t.as_str(), count],
                            |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)),
                        ))?;
                        for row in rows {
                            oldest.push(db(row)?);
                        }
                    }
                    self.lease_steps += vm_steps(&stmt);
                }
                oldest.sort_unstable();
                oldest.truncate(take.count as usize);
                let mut stmt = db(self.conn.prepare_cached(BY_ID))?;
                for (_, id) in oldest {
                    let mut q = db(stmt.query(params![id]))?;
                    if let Some(r) = db(q.next())? {
                        out.push(ctx.job(r, &self.conn, &mut self.seq, &mut self.lease_late)?);
                    }
                }
                self.lease_steps += vm_steps(&stmt);
            }
        }
        // One write by rowid per job: a multi-row `UPDATE … WHERE id IN
        // (…) RETURNING` builds two ephemeral tables per statement, which
        // costs more than it saves when leases are small.
        let mut update = db(self.conn.prepare_cached(
            "UPDATE jobs SET state = 'leased', attempts = attempts + 1, leases = leases + 1,
                 lease_token = ?2, lease_expires_at = ?3, lease_started_at = ?4, worker_id = ?5
             WHERE id = ?1",
        ))?;
        for job in &out[start..] {
            db(update.execute(params![
                job.id.0 as i64,
                job.lease_token.0 as i64,
                ms(expires),
                ms(req.now),
                req.worker_id.as_str(),
            ]))?;
        }
        drop(update);
        let got = (out.len() - start) as u32;
        for job in &out[start..] {
            self.pairs
                .take_ready(lane, tenant, job.job_type.as_str(), 1);
        }
        self.pairs.add_inflight(lane, tenant, got);
        Ok(got)
    }

    fn complete(
        &mut self,
        items: Vec<Completion>,
        now: Timestamp,
    ) -> Result<Vec<Result<Completed, ItemError>>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            out.push(self.complete_one(item.id, Some(item.token), item.event, now)?);
        }
        Ok(out)
    }

    /// Applies one outcome. `token: None` is the reaper (no worker token).
    ///
    /// A worker's outcome counts only while its lease runs: at or after
    /// `lease_expires_at` it is `LeaseLost` and changes nothing, as if the
    /// reaper had run first (it expires leases with `lease_expires_at <= now`).
    fn complete_one(
        &mut self,
        id: JobId,
        token: Option<LeaseToken>,
        event: Event,
        now: Timestamp,
    ) -> Result<Result<Completed, ItemError>, StoreError> {
        if let (Event::Succeeded, Some(token)) = (&event, token) {
            if let Some(done) = self.succeed(id, token, now)? {
                return Ok(Ok(done));
            }
            // Not a current lease (the answer comes below), or a lease granted
            // by schema version 1, whose running attempt is in the envelope.
        }
        let row = db(self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS}, lease_token, lease_expires_at, cancel_requested FROM jobs WHERE id = ?1"
            ))?
            .query_row(params![id.0 as i64], |r| {
                let extra = super::stored::COLUMN_COUNT;
                Ok((
                    StoredJob::from_row(r)?,
                    r.get::<_, Option<i64>>(extra)?,
                    r.get::<_, Option<i64>>(extra + 1)?,
                    r.get::<_, bool>(extra + 2)?,
                ))
            })
            .optional())?;
        let Some((stored, current, expires_at, cancel_requested)) = row else {
            return Ok(Err(ItemError::NotFound));
        };
        if stored.state != JobState::Leased {
            return Ok(Err(ItemError::LeaseLost));
        }
        if let Some(token) = token {
            let ended = expires_at.is_some_and(|end| end <= ms(now));
            if Some(token.0 as i64) != current || ended {
                return Ok(Err(ItemError::LeaseLost));
            }
        }
        let mut env = stored.envelope()?;
        let attempt = env.attempts;
        let decided = self.decider.decide(&mut env, event, now);
        let transition = lazaret_core::settle(&mut env, decided, cancel_requested);
        let (dead_letter, freed_slot) = self.apply(&env, transition, now, &stored.payload)?;
        let (kind, class, message) = env
            .history
            .last()
            .and_then(|r| r.error.as_ref())
            .filter(|_| transition != Transition::Succeeded)
            .map_or((None, None, None), |e| {
                (Some(e.kind.clone()), e.class, Some(e.message.clone()))
            });
        let redrives = env.redrives;
        let leased_at = stored.lease_started_at.map(Timestamp::from_millis);
        Ok(Ok(Completed {
            id,
            job_type: env.job_type,
            lane: env.lane,
            transition,
            attempt,
            kind,
            class,
            dead_letter,
            message,
            redrives,
            freed_slot,
            leased_at,
        }))
    }

    /// A leased job of (lane, tenant) leaves the in-flight set; returns
    /// whether that freed a slot someone waits for (the core's rule,
    /// `FairScheduler::frees_slot`).
    fn release_slot(&mut self, lane: &Lane, tenant: &TenantId) -> bool {
        let (inflight, ready) = self.pairs.release(lane, tenant);
        self.scheduler.frees_slot(tenant, inflight, ready)
    }

    /// A success: `decide`'s first rule needs neither policy nor history, so
    /// it is one statement on columns. The record of the attempt that
    /// succeeded is rebuilt from `lease_started_at`, `worker_id` and
    /// `finished_at` when read (see `super::stored`). `None` when `token` is
    /// not the job's current, unexpired lease with its running attempt in
    /// columns.
    fn succeed(
        &mut self,
        id: JobId,
        token: LeaseToken,
        now: Timestamp,
    ) -> Result<Option<Completed>, StoreError> {
        // A read, then a write by rowid: `UPDATE … RETURNING` would build
        // and tear down an ephemeral table for every ack.
        let row = db(self
            .conn
            .prepare_cached(
                "SELECT type, tenant, lane, attempts, redrives, lease_started_at FROM jobs
                 WHERE id = ?1 AND state = 'leased' AND lease_token = ?2 AND lease_started_at IS NOT NULL
                   AND lease_expires_at > ?3",
            )?
            .query_row(params![id.0 as i64, token.0 as i64, ms(now)], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, i64>(4)?,
                    r.get::<_, Option<i64>>(5)?,
                ))
            })
            .optional())?;
        let Some((job_type, tenant, lane, attempts, redrives, leased_at)) = row else {
            return Ok(None);
        };
        db(self
            .conn
            .prepare_cached(
                "UPDATE jobs SET state = 'succeeded', finished_at = ?2, lease_token = NULL, lease_expires_at = NULL
                 WHERE id = ?1",
            )?
            .execute(params![id.0 as i64, ms(now)]))?;
        let lane = Lane::new(lane);
        let freed_slot = self.release_slot(&lane, &TenantId::new(tenant));
        self.succeeded += 1;
        Ok(Some(Completed {
            id,
            job_type: JobType::new(job_type),
            lane,
            transition: Transition::Succeeded,
            attempt: attempts as u32,
            kind: None,
            class: None,
            dead_letter: None,
            message: None,
            redrives: redrives as u32,
            freed_slot,
            leased_at: leased_at.map(Timestamp::from_millis),
        }))
    }

    /// Why a heartbeat for `id` matched no current lease.
    fn not_leased(&self, id: JobId) -> Result<ItemError, StoreError> {
        let exists = db(self
            .conn
            .prepare_cached("SELECT 1 FROM jobs WHERE id = ?1")?
            .query_row(params![id.0 as i64], |_| Ok(()))
            .optional())?;
        Ok(match exists {
            Some(()) => ItemError::LeaseLost,
            None => ItemError::NotFound,
        })
    }

    /// Writes a leased job's transition after a failure or an expiry (the
    /// whole envelope: counters and history changed); returns the dead
    /// letter written, if any, and whether a capped tenant's slot was freed
    /// (`release_slot`).
    fn apply(
        &mut self,
        env: &Envelope,
        transition: Transition,
        now: Timestamp,
        payload: &[u8],
    ) -> Result<(Option<DeadLetterId>, bool), StoreError> {
        let id = env.id.0 as i64;
        let freed_slot = self.release_slot(&env.lane, &env.tenant);
        match transition {
            Transition::Succeeded => {
                self.finish(env, JobState::Succeeded, now)?;
                self.succeeded += 1;
                Ok((None, freed_slot))
            }
            Transition::Retry { at, .. } | Transition::Defer { until: at } => {
                let state = transition.next_state(now);
                db(self
                    .conn
                    .prepare_cached(
                        "UPDATE jobs SET state = ?2, run_at = ?3, lease_token = NULL, lease_expires_at = NULL,
                         lease_started_at = NULL, worker_id = NULL, attempts = ?4, envelope = ?5 WHERE id = ?1",
                    )?
                    .execute(params![id, state_word(state), ms(at), env.attempts, env.to_json()]))?;
                if state == JobState::Queued {
                    self.pairs
                        .add_ready(&env.lane, &env.tenant, &env.job_type, 1);
                } else {
                    *self.scheduled.entry(env.lane.clone()).or_default() += 1;
                }
                Ok((None, freed_slot))
            }
            Transition::Cancelled => {
                self.finish(env, JobState::Cancelled, now)?;
                self.cancelled += 1;
                Ok((None, freed_slot))
            }
            Transition::DeadLetter { reason } => {
                self.finish(env, JobState::DeadLettered, now)?;
                let error = env
                    .last_error()
                    .map(|e| serde_json::to_string(e).unwrap_or_default());
                db(self
                    .conn
                    .prepare_cached(
                        "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error, idempotency_key,
                           created_at, dead_lettered_at, payload_size, payload_sha256, payload_preview)
                         VALUES (?1, ?2, ?3, ?4, ?5, 'processing', ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
                    )?
                    .execute(params![
                        id,
                        env.job_type.as_str(),
                        env.tenant.as_str(),
                        env.lane.as_str(),
                        reason.as_str(),
                        env.attempts,
                        error,
                        env.idempotency_key,
                        ms(env.created_at),
                        ms(now),
                        env.payload_size as i64,
                        env.payload_sha256,
                        payload_preview(payload, lazaret_core::PREVIEW_BYTES_MAX),
                    ]))?;
                Ok((
                    Some(DeadLetterId(self.conn.last_insert_rowid() as u64)),
                    freed_slot,
                ))
            }
        }
    }

    /// Moves a leased job to a terminal state (`succeeded`, `dead_lettered`, `cancelled`)
    /// with its whole envelope.
    fn finish(
        &mut self,
        env: &Envelope,
        state: JobState,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        db(self
            .conn
            .prepare_cached(
                "UPDATE jobs SET state = ?2, finished_at = ?3, lease_token = NULL, lease_expires_at = NULL,
                 lease_started_at = NULL, worker_id = NULL, attempts = ?4, envelope = ?5 WHERE id = ?1",
            )?
            .execute(params![env.id.0 as i64, state_word(state), ms(now), env.attempts, env.to_json()]))?;
        Ok(())
    }

    fn heartbeat(
        &mut self,
        id: JobId,
        token: LeaseToken,
        until: Timestamp,
        now: Timestamp,
    ) -> Result<Result<Heartbeat, ItemError>, StoreError> {
        // A lease at or past its end is not revived (see `complete_one`).
        let changed = db(self
            .conn
            .prepare_cached(
                "UPDATE jobs SET lease_expires_at = ?2
                 WHERE id = ?1 AND state = 'leased' AND lease_token = ?3 AND lease_expires_at > ?4",
            )?
            .execute(params![id.0 as i64, ms(until), token.0 as i64, ms(now)]))?;
        if changed == 0 {
            return Ok(Err(self.not_leased(id)?));
        }
        // A probe by rowid of the row just written: no `RETURNING` (see `succeed`).
        let cancel_requested = db(self
            .conn
            .prepare_cached("SELECT cancel_requested FROM jobs WHERE id = ?1")?
            .query_row(params![id.0 as i64], |r| r.get::<_, bool>(0)))?;
        Ok(Ok(Heartbeat {
            lease_expires_at: until,
            cancel_requested,
        }))
    }

    /// Applies `lazaret_core::cancel`'s decision for the job's state, and
    /// the audit entry when the cancel is accepted.
    fn cancel(
        &mut self,
        id: JobId,
        now: Timestamp,
        mut entry: AuditEntry,
    ) -> Result<Result<Cancelled, CancelError>, StoreError> {
        let row = db(self
            .conn
            .prepare_cached(
                "SELECT state, lane, tenant, cancel_requested, type FROM jobs WHERE id = ?1",
            )?
            .query_row(params![id.0 as i64], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, bool>(3)?,
                    r.get::<_, String>(4)?,
                ))
            })
            .optional())?;
        let Some((state, lane, tenant, requested, job_type)) = row else {
            return Ok(Err(CancelError::NotFound));
        };
        let state: JobState = state
            .parse()
            .map_err(|e| StoreError::Corrupt(format!("job {id}: {e}")))?;
        let answer = match lazaret_core::cancel(state, requested) {
            lazaret_core::CancelDecision::Refuse { state } => {
                return Ok(Err(CancelError::Finished(state)));
            }
            lazaret_core::CancelDecision::CancelNow => {
                db(self
                    .conn
                    .prepare_cached(
                        "UPDATE jobs SET state = 'cancelled', finished_at = ?2, cancel_requested = 1 WHERE id = ?1",
                    )?
                    .execute(params![id.0 as i64, ms(now)]))?;
                let lane = Lane::new(lane);
                if state == JobState::Queued {
                    self.pairs.take_ready(&lane, &tenant, &job_type, 1);
                } else if let Some(n) = self.scheduled.get_mut(&lane) {
                    *n = n.saturating_sub(1);
                }
                self.cancelled += 1;
                entry.count = 1;
                Cancelled::Now
            }
            lazaret_core::CancelDecision::Request => {
                db(self
                    .conn
                    .prepare_cached("UPDATE jobs SET cancel_requested = 1 WHERE id = ?1")?
                    .execute(params![id.0 as i64]))?;
                entry.count = 1;
                Cancelled::Requested { already: false }
            }
            lazaret_core::CancelDecision::AlreadyRequested => {
                entry.count = 0;
                Cancelled::Requested { already: true }
            }
        };
        self.audit(&entry)?;
        Ok(Ok(answer))
    }

    /// Records a pause or drops it, with its audit entry; whether it changed.
    fn set_pause(
        &mut self,
        target: &PauseTarget,
        paused: bool,
        entry: &AuditEntry,
    ) -> Result<bool, StoreError> {
        let changed = if paused {
            db(self
                .conn
                .prepare_cached(
                    "INSERT OR IGNORE INTO pauses (target, name, paused_at, paused_by) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![target.kind(), target.name(), ms(entry.at), entry.actor]))?
        } else {
            db(self
                .conn
                .prepare_cached("DELETE FROM pauses WHERE target = ?1 AND name = ?2")?
                .execute(params![target.kind(), target.name()]))?
        };
        self.audit(entry)?;
        Ok(changed > 0)
    }

    fn tick(&mut self, now: Timestamp) -> Result<Tick, StoreError> {
        let mut tick = Tick::default();
        let promoted: Vec<(String, String, String)> = {
            let mut stmt = db(self.conn.prepare_cached(
                "UPDATE OR FAIL jobs SET state = 'queued'
                 WHERE id IN (SELECT id FROM jobs WHERE state = 'scheduled' AND run_at <= ?1 ORDER BY run_at LIMIT +?2)
                 RETURNING lane, tenant, type",
            ))?;
            let rows = db(stmt.query_map(params![ms(now), PROMOTE_MAX], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            }))?;
            let mut v = Vec::new();
            for row in rows {
                v.push(db(row)?);
            }
            v
        };
        for (lane, tenant, job_type) in promoted {
            let lane = Lane::new(lane);
            if let Some(n) = self.scheduled.get_mut(&lane) {
                *n = n.saturating_sub(1);
            }
            self.pairs.add_ready(&lane, &tenant, &job_type, 1);
            tick.promoted += 1;
        }
        let expired: Vec<i64> = {
            let mut stmt = db(self.conn.prepare_cached(
                "SELECT id FROM jobs WHERE state = 'leased' AND lease_expires_at <= ?1 ORDER BY lease_expires_at LIMIT +?2",
            ))?;
            let rows = db(stmt.query_map(params![ms(now), EXPIRE_MAX], |r| r.get(0)))?;
            let mut v = Vec::new();
            for row in rows {
                v.push(db(row)?);
            }
            v
        };
        for id in expired {
            if let Ok(done) = self.complete_one(JobId(id as u64), None, Event::LeaseExpired, now)? {
                tick.expired.push(done);
            }
        }
        tick.next_due = db(self
            .conn
            .prepare_cached("SELECT MIN(run_at) FROM jobs WHERE state = 'scheduled'")?
            .query_row([], |r| r.get::<_, Option<i64>>(0)))?
        .map(Timestamp::from_millis);
        Ok(tick)
    }

    fn record_admission(&mut self, rec: &AdmissionRecord) -> Result<DeadLetterId, StoreError> {
        let error = serde_json::json!({
            "class": "permanent", "kind": rec.reason.as_str(), "message": rec.message,
            "traceback": null, "retry_after_ms": null,
        });
        db(self
            .conn
            .prepare_cached(
                "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error, idempotency_key,
                   created_at, dead_lettered_at, payload_size, payload_sha256, payload_preview, payload)
                 VALUES (NULL, ?1, ?2, ?3, ?4, 'admission', 0, ?5, ?6, ?7, ?7, ?8, ?9, ?10, ?11)",
            )?
            .execute(params![
                rec.job_type,
                rec.tenant,
                rec.lane,
                rec.reason.as_str(),
                error.to_string(),
                rec.idempotency_key,
                ms(rec.now),
                rec.payload_size as i64,
                rec.payload_sha256,
                rec.payload_preview,
                rec.payload,
            ]))?;
        Ok(DeadLetterId(self.conn.last_insert_rowid() as u64))
    }

    fn redrive(
        &mut self,
        ids: &[DeadLetterId],
        now: Timestamp,
        audit: Option<crate::AuditId>,
    ) -> Result<Vec<JobId>, StoreError> {
        let mut out = Vec::new();
        for dl in ids {
            let job_id: Option<i64> = db(self
                .conn
                .prepare_cached(
                    "SELECT job_id FROM dead_letters WHERE id = ?1 AND stage = 'processing'",
                )?
                .query_row(params![dl.0 as i64], |r| r.get(0))
                .optional())?
            .flatten();
            let Some(job_id) = job_id else { continue };
            let stored = db(self
                .conn
                .prepare_cached(&format!(
                    "SELECT {COLUMNS} FROM jobs WHERE id = ?1 AND state = 'dead_lettered'"
                ))?
                .query_row(params![job_id], StoredJob::from_row)
                .optional())?;
            let Some(stored) = stored else { continue };
            let mut env = stored.envelope()?;
            lazaret_core::redrive(&mut env);
            db(self
                .conn
                .prepare_cached(
                    "UPDATE jobs SET state = 'queued', run_at = ?2, attempts = 0, finished_at = NULL,
                     lease_started_at = NULL, worker_id = NULL, redrives = ?3, envelope = ?4 WHERE id = ?1",
                )?
                .execute(params![job_id, ms(now), env.redrives, env.to_json()]))?;
            db(self
                .conn
                .prepare_cached("DELETE FROM dead_letters WHERE id = ?1")?
                .execute(params![dl.0 as i64]))?;
            self.pairs
                .add_ready(&env.lane, &env.tenant, &env.job_type, 1);
            out.push(env.id);
        }
        self.audit_add(audit, out.len() as u64)?;
        Ok(out)
    }

    fn redrive_corrected(
        &mut self,
        dl: DeadLetterId,
        fix: &crate::PayloadFix,
        now: Timestamp,
        audit: Option<crate::AuditId>,
    ) -> Result<Option<JobId>, StoreError> {
        let job_id: Option<i64> = db(self
            .conn
            .prepare_cached(
                "SELECT job_id FROM dead_letters WHERE id = ?1 AND stage = 'processing'",
            )?
            .query_row(params![dl.0 as i64], |r| r.get(0))
            .optional())?
        .flatten();
        let Some(job_id) = job_id else {
            return Ok(None);
        };
        let stored = db(self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM jobs WHERE id = ?1 AND state = 'dead_lettered'"
            ))?
            .query_row(params![job_id], StoredJob::from_row)
            .optional())?;
        let Some(stored) = stored else {
            return Ok(None);
        };
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
        db(self
            .conn
            .prepare_cached(
                "UPDATE jobs SET state = 'queued', run_at = ?2, attempts = 0, finished_at = NULL,
                 lease_started_at = NULL, worker_id = NULL, redrives = ?3, envelope = ?4,
                 payload = ?5, schema_version = ?6 WHERE id = ?1",
            )?
            .execute(params![
                job_id,
                ms(now),
                env.redrives,
                env.to_json(),
                fix.payload,
                fix.schema_version
            ]))?;
        db(self
            .conn
            .prepare_cached("DELETE FROM dead_letters WHERE id = ?1")?
            .execute(params![dl.0 as i64]))?;
        self.pairs
            .add_ready(&env.lane, &env.tenant, &env.job_type, 1);
        self.audit_add(audit, 1)?;
        Ok(Some(env.id))
    }

    /// Adds `n` to an audit entry's count, in the transaction of what it counts.
    fn audit_add(&mut self, audit: Option<crate::AuditId>, n: u64) -> Result<(), StoreError> {
        if let (Some(id), 1..) = (audit, n) {
            db(self
                .conn
                .prepare_cached("UPDATE audit SET count = count + ?2 WHERE id = ?1")?
                .execute(params![id.0 as i64, n as i64]))?;
        }
        Ok(())
    }

    fn purge(
        &mut self,
        ids: &[DeadLetterId],
        audit: Option<crate::AuditId>,
    ) -> Result<u64, StoreError> {
        let mut n = 0;
        for dl in ids {
            let job_id: Option<Option<i64>> = db(self
                .conn
                .prepare_cached("DELETE FROM dead_letters WHERE id = ?1 RETURNING job_id")?
                .query_row(params![dl.0 as i64], |r| r.get(0))
                .optional())?;
            let Some(job_id) = job_id else { continue };
            if let Some(job_id) = job_id {
                db(self
                    .conn
                    .prepare_cached("DELETE FROM jobs WHERE id = ?1 AND state = 'dead_lettered'")?
                    .execute(params![job_id]))?;
            }
            n += 1;
        }
        self.audit_add(audit, n)?;
        Ok(n)
    }

    fn audit(&mut self, e: &AuditEntry) -> Result<crate::AuditId, StoreError> {
        db(self
            .conn
            .prepare_cached(
                "INSERT INTO audit (at, actor, action, request, count) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                ms(e.at),
                e.actor,
                e.action,
                e.request.to_string(),
                e.count as i64
            ]))?;
        Ok(crate::AuditId(self.conn.last_insert_rowid() as u64))
    }

    fn stats(&mut self) -> Result<StoreStats, StoreError> {
        let mut lanes: HashMap<Lane, LaneCounts> = HashMap::new();
        for (lane, tenants) in self.pairs.iter() {
            let c = lanes.entry(lane.clone()).or_default();
            for p in tenants.values() {
                c.queued += u64::from(p.ready);
                c.leased += u64::from(p.inflight);
            }
        }
        for (lane, n) in &self.scheduled {
            lanes.entry(lane.clone()).or_default().scheduled += n;
        }
        let mut lanes: Vec<(Lane, LaneCounts)> = lanes.into_iter().collect();
        lanes.sort_by(|a, b| a.0.cmp(&b.0));
        // One index probe (`jobs_ready_type`) per (lane, tenant, type) with
        // jobs ready.
        let mut oldest: HashMap<Lane, i64> = HashMap::new();
        {
            let mut probe = db(self.conn.prepare_cached(
                "SELECT run_at FROM jobs INDEXED BY jobs_ready_type
                 WHERE lane = ?1 AND tenant = ?2 AND type = ?3 AND state = 'queued'
                 ORDER BY run_at, id LIMIT 1",
            ))?;
            for (lane, tenants) in self.pairs.iter() {
                for ((tenant, job_type), _) in tenants.iter().flat_map(|(tenant, p)| {
                    p.by_type
                        .iter()
                        .filter(|(_, n)| **n > 0)
                        .map(move |(t, n)| ((tenant, t), n))
                }) {
                    let at: Option<i64> = db(probe
                        .query_row(
                            params![lane.as_str(), tenant.as_str(), job_type.as_str()],
                            |r| r.get(0),
                        )
                        .optional())?;
                    if let Some(at) = at {
                        let e = oldest.entry(lane.clone()).or_insert(at);
                        *e = (*e).min(at);
                    }
                }
            }
        }
        let mut oldest_ready: Vec<(Lane, Timestamp)> = oldest
            .into_iter()
            .map(|(l, at)| (l, Timestamp::from_millis(at)))
            .collect();
        oldest_ready.sort_by(|a, b| a.0.cmp(&b.0));
        let mut stmt = db(self.conn.prepare_cached(
            "SELECT type, reason, COUNT(*) FROM dead_letters GROUP BY type, reason",
        ))?;
        let rows = db(stmt.query_map([], |r| {
            Ok((
                r.get::<_, Option<String>>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
            ))
        }))?;
        let mut dead_letters = Vec::new();
        for row in rows {
            let (ty, reason, n) = db(row)?;
            let reason = reason
                .parse()
                .map_err(|e| StoreError::Corrupt(format!("{e}")))?;
            dead_letters.push((ty, reason, n as u64));
        }
        // The primary key (source, message_id) counts them by source.
        let mut stmt = db(self.conn.prepare_cached(
            "SELECT source, COUNT(*) FROM source_parked GROUP BY source ORDER BY source",
        ))?;
        let held_messages = db(db(stmt.query_map([], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?.max(0) as u64))
        }))?
        .collect::<rusqlite::Result<Vec<_>>>())?;
        Ok(StoreStats {
            lanes,
            dead_letters,
            held_messages,
            succeeded: self.succeeded,
            cancelled: self.cancelled,
            oldest_ready,
            backend: "sqlite",
            group_commit: Some(crate::GroupCommitStats {
                commits: self.commits,
                commands: self.commands,
                syncs: self.syncer.as_ref().map_or(0, Syncer::syncs),
                sync_micros: self.syncer.as_ref().map_or(0, Syncer::sync_micros),
                leases: self.leases,
                lease_steps: self.lease_steps,
                lease_pairs: self.lease_pairs,
            }),
        })
    }

    /// Retention: succeeded and cancelled jobs finished before `before`,
    /// up to `batch` of each, each found by its partial index.
    fn remove_succeeded(&mut self, before: Timestamp, batch: u32) -> Result<u64, StoreError> {
        let n = db(self
            .conn
            .prepare_cached(
                "DELETE FROM jobs WHERE id IN
                   (SELECT id FROM jobs WHERE state = 'succeeded' AND finished_at < ?1 ORDER BY finished_at LIMIT +?2)",
            )?
            .execute(params![ms(before), i64::from(batch)]))? as u64;
        self.succeeded = self.succeeded.saturating_sub(n);
        let c = db(self
            .conn
            .prepare_cached(
                "DELETE FROM jobs WHERE id IN
                   (SELECT id FROM jobs WHERE state = 'cancelled' AND finished_at < ?1 ORDER BY finished_at LIMIT +?2)",
            )?
            .execute(params![ms(before), i64::from(batch)]))? as u64;
        self.cancelled = self.cancelled.saturating_sub(c);
        Ok(n + c)
    }

    /// Inserts an API token and its audit entry. A taken name or secret is
    /// checked first and answered as a refusal, not a failed command, so it
    /// does not roll back the rest of the group.
    fn create_token(
        &mut self,
        t: &crate::ApiToken,
        entry: &AuditEntry,
    ) -> Result<Result<(), crate::TokenError>, StoreError> {
        let taken = |sql: &str, value: &str| -> Result<bool, StoreError> {
            db(self
                .conn
                .prepare_cached(sql)?
                .query_row(params![value], |_| Ok(()))
                .optional())
            .map(|row| row.is_some())
        };
        if taken("SELECT 1 FROM tokens WHERE name = ?1", &t.name)? {
            return Ok(Err(crate::TokenError::NameTaken));
        }
        if taken(
            "SELECT 1 FROM tokens WHERE token_sha256 = ?1",
            &t.token_sha256,
        )? {
            return Ok(Err(crate::TokenError::SecretTaken));
        }
        db(self
            .conn
            .prepare_cached(
                "INSERT INTO tokens (name, role, token_sha256, created_at, created_by)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                t.name,
                t.role,
                t.token_sha256,
                ms(t.created_at),
                t.created_by
            ]))?;
        self.audit(entry)?;
        Ok(Ok(()))
    }

    /// Deletes an API token and writes its audit entry; `false` when unknown.
    fn revoke_token(&mut self, name: &str, entry: &AuditEntry) -> Result<bool, StoreError> {
        let n = db(self
            .conn
            .prepare_cached("DELETE FROM tokens WHERE name = ?1")?
            .execute(params![name]))?;
        if n == 0 {
            return Ok(false);
        }
        self.audit(entry)?;
        Ok(true)
    }

    // -----------------------------------------------------------------
    // Broker messages (`super::sources` holds their SQL).

    fn quarantine(
        &mut self,
        dls: &[crate::SourceDeadLetter],
    ) -> Result<Vec<crate::Quarantined>, StoreError> {
        dls.iter()
            .map(|dl| super::sources::quarantine(&self.conn, dl))
            .collect()
    }

    fn park(&mut self, p: &crate::ParkedMessage) -> Result<(), StoreError> {
        super::sources::park(&self.conn, p)
    }

    fn unpark(&mut self, key: &crate::MessageKey) -> Result<bool, StoreError> {
        super::sources::unpark(&self.conn, key)
    }

    fn claim_due(&mut self, claim: &Claim) -> Result<Vec<crate::ClaimedRetry>, StoreError> {
        super::sources::claim_due(&self.conn, claim)
    }
}

/// What every job of one take shares.
struct Leasing<'a> {
    lane: &'a Lane,
    tenant: &'a TenantId,
    expires: Timestamp,
}

impl Leasing<'_> {
    /// The leased job of a row `(id, type, idempotency_key, schema_version,
    /// created_at, payload, attempts)`, with a new token.
    fn job(
        &self,
        r: &rusqlite::Row<'_>,
        conn: &Connection,
        seq: &mut Reserved,
        late: &mut bool,
    ) -> Result<LeasedJob, StoreError> {
        let id: i64 = db(r.get(0))?;
        let token = seq.tokens.issue(conn)?;
        *late |= !seq.durable(id as u64, token);
        Ok(LeasedJob {
            id: JobId(id as u64),
            job_type: JobType::new(db(r.get::<_, String>(1))?),
            tenant: self.tenant.clone(),
            lane: self.lane.clone(),
            payload: db(r.get(5))?,
            attempt: db(r.get::<_, i64>(6))? as u32 + 1,
            idempotency_key: db(r.get(2))?,
            schema_version: db(r.get::<_, Option<i64>>(3))?.map(|v| v as u32),
            lease_token: LeaseToken(token),
            lease_expires_at: self.expires,
            created_at: Timestamp::from_millis(db(r.get(4))?),
            ready_at: Timestamp::from_millis(db(r.get(7))?),
        })
    }
}

/// The SQLite VM steps `stmt` ran since the last call (and resets the count):
/// a measure of the rows a read looked at, whatever it returned.
fn vm_steps(stmt: &rusqlite::Statement<'_>) -> u64 {
    u64::try_from(stmt.reset_status(rusqlite::StatementStatus::VmStep)).unwrap_or(0)
}

/// Answers a command that never ran: `StoreError::NotApplied`, for `why`.
/// Answers every command still queued when the store closes.
fn fail_queued(queue: &mut Queue) {
    while let Some(cmd) = queue.pop_any() {
        cmd.fail(
            "the store closed before this request ran, so it was not applied; retry once lazaret is back",
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    fn enqueue(jobs: usize) -> Cmd {
        let (reply, _rx) = Reply::new();
        let jobs = (0..jobs)
            .map(|i| super::super::tests::job(&format!("k{i}")))
            .collect();
        Cmd::Request(Request::Enqueue { jobs, reply })
    }

    fn rows(cmd: Option<Cmd>) -> Option<usize> {
        match cmd {
            Some(Cmd::Request(Request::Enqueue { jobs, .. })) => Some(jobs.len()),
            Some(_) => panic!("not an enqueue"),
            None => None,
        }
    }

    fn inbox() -> (mpsc::Sender<Cmd>, Inbox) {
        let (tx, rx) = mpsc::channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        (tx, Inbox { rx, waiting })
    }

    /// A group with a one-job command commits without the bulk command
    /// queued before it, which runs in the next group; a bulk command that
    /// has waited `BULK_WAIT_MAX` joins even a group of small ones.
    #[test]
    fn a_group_with_a_small_command_takes_no_bulk_one_until_bulk_waited_too_long() {
        let (_tx, rx) = inbox();
        let bulk = BULK_ROWS + 1;
        let mut q = Queue::default();
        q.push(enqueue(bulk));
        q.push(enqueue(1));
        q.begin_group();
        let began = Instant::now();
        assert_eq!(rows(q.next(&rx, 0, false, false, began)), Some(1));
        assert_eq!(rows(q.next(&rx, 1, false, false, began)), None, "commits");
        q.begin_group();
        let began = Instant::now();
        assert_eq!(rows(q.next(&rx, 0, false, false, began)), Some(bulk));
        assert_eq!(rows(q.next(&rx, 1, true, false, began)), None);

        let long_ago = Instant::now()
            .checked_sub(BULK_WAIT_MAX)
            .expect("the clock is past BULK_WAIT_MAX");
        q.bulk.push_back((long_ago, enqueue(bulk)));
        q.push(enqueue(1));
        q.begin_group();
        let began = Instant::now();
        assert_eq!(rows(q.next(&rx, 0, false, false, began)), Some(1));
        assert_eq!(rows(q.next(&rx, 1, false, false, began)), Some(bulk));
        assert_eq!(rows(q.next(&rx, 2, true, false, began)), None);
    }
}
