//! The writer thread: every change goes through here, grouped into shared
//! transactions. It also keeps the ready counts per (lane, tenant, type) and
//! the in-flight counts per (lane, tenant) that the core's lease plan and
//! fair scheduler pick from, rebuilt from the database at start.
//!
//! This file is the group commit loop; `requests.rs` runs each
//! [`Request`] with its function, which lives in the file named for its
//! concern (`jobs`, `leases`, `outcomes`, `dead_letters`, `sources`,
//! `tokens`, `stats`), as in PostgreSQL's writer; `queue.rs` orders the
//! commands waiting.

use std::collections::HashMap;
use std::sync::Arc;
#[cfg(any(test, feature = "test-hooks"))]
use std::sync::mpsc;

use lazaret_core::{
    Among, Envelope, Event, FairScheduler, JobId, JobState, JobType, Lane, LeaseFilter, PairCounts,
    TenantId, Timestamp, TraceParent, Transition, payload_preview, plan_lease,
};
use rusqlite::{Connection, OptionalExtension, params};

use super::sequence::Reserved;
use super::stored::{COLUMNS, StoredJob};
use super::sync::Syncer;
use crate::request::{Claim, Reply, Request};
use crate::stored::stored_traceparent;
use crate::{
    AdmissionRecord, AuditEntry, CancelError, Cancelled, Completed, Completion, DeadLetterId,
    Decider, EnqueueOutcome, Heartbeat, ItemError, LaneCounts, LeaseRequest, LeaseToken, LeasedJob,
    NewJob, PauseTarget, StoreError, StoreStats, Tick,
};

mod dead_letters;
mod jobs;
mod leases;
mod outcomes;
mod queue;
mod requests;
mod sources;
mod stats;
mod tokens;

pub(super) use queue::{BULK_ROWS, Inbox, Pending};
use queue::{Queue, pend};

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
            Request::Redrive { ids, .. }
            | Request::Purge { ids, .. }
            | Request::Archive { ids, .. } => ids.len() > BULK_ROWS,
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

/// Groups run with a savepoint per command after a command failed.
const ISOLATED_GROUPS: u32 = 100;
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
}

/// Answers every command still queued when the store closes.
fn fail_queued(queue: &mut Queue) {
    while let Some(cmd) = queue.pop_any() {
        cmd.fail(
            "the store closed before this request ran, so it was not applied; retry once lazaret is back",
        );
    }
}
