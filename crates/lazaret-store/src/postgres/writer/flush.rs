//! Answers that wait for their group's commit to be on disk.
//!
//! The writer commits each group with `synchronous_commit = off`: its
//! `COMMIT` returns once the commit record is in PostgreSQL's WAL buffers,
//! the group's changes are visible and its row locks (and
//! [`COUNTS_LOCK`](super::COUNTS_LOCK)) are released, without waiting for
//! the WAL flush. So the writer runs the next group while the disk
//! flushes the last one, and two nodes' groups no longer queue behind
//! each other's flushes. A lease is answered then (see below); every other
//! answer (enqueues, acks, fails, dead letters, ticks…) goes to the
//! flusher, which answers it only after a commit of its own that
//! *does* wait for its flush, made after the group's: WAL is flushed in
//! order, so that flush covers every commit before it. While one flush
//! runs, the answers of the groups committed meanwhile gather, and the next
//! flush answers them all.
//!
//! The flusher's commit is a transactional logical message
//! (`pg_logical_emit_message(true, 'lazaret.flush', '')`): one WAL record
//! and a commit record, no table touched, so nothing to vacuum and no row
//! two nodes could wait on. It commits with the session's own
//! `synchronous_commit` (the server's, database's or role's setting, `on`
//! by default), so an answer means what it meant before this split: with
//! `on` the group is on the database host's disk, with `remote_apply` and
//! synchronous standbys it is applied there, and with `off` it is not
//! waited for at all. Logical decoding clients see the messages under the
//! prefix `lazaret.flush` and can skip them.
//!
//! **What a crash can take back.** A group whose `COMMIT` returned but
//! whose flush did not is lost whole if the database host crashes (or
//! the database restarts) before its WAL reaches the disk:
//!
//! - none of its non-lease answers was sent (they wait for the flush), so
//!   no acknowledged enqueue, ack, failure or dead letter is lost: the
//!   promise is the same as with every answer after its own commit;
//! - a lease of it may have been answered. The job is then leased again
//!   after the restart, and the attempt does not count; the lost lease's
//!   token is refused when its worker acks (a stale lease, as after an
//!   expiry). That is the SQLite store's exception under `full` (a lease
//!   answered at its COMMIT, docs/reliability.md), for the same reason: a
//!   lease is a promise to nobody but the worker, and losing one only
//!   delivers the job again, which at-least-once allows. One case is new
//!   on PostgreSQL: a lease may hand out a job whose enqueue commit is
//!   not flushed yet (enqueued in the same group, or by a group of
//!   another node not flushed yet). If that commit is lost, the worker ran
//!   a job whose enqueue was never acknowledged (its producer sends it
//!   again, since the enqueue failed for it), and the ack is refused (the
//!   job is gone): the job may run twice, as with any enqueue retried
//!   after a lost answer.
//!
//! **A flush that fails.** If the flush's statement fails (the connection
//! dropped, the database restarted), the answers waiting on it fail with
//! an error saying the request was committed and its outcome is unknown,
//! as a `COMMIT` lost on the way back does. A flush proves a group durable
//! only on a connection that was up when the group's `COMMIT` was sent (a
//! restart of the database closes every connection), so each group carries
//! the number its `COMMIT` was sent under ([`Flusher::sent`]). When the
//! writer connects again, it gives the flusher a new connection before it
//! sends any other `COMMIT` ([`Flusher::connect_again`]): the groups
//! before that go on the old connection, the ones after on the new. When
//! the flusher finds its own connection gone, it connects again and fails
//! the groups sent before that, which it cannot vouch for.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::Client;

use super::super::{PgOptions, connect, pg};
use crate::{DbError, StoreError};

/// An answer ready to send: with `None` it sends the answer, with
/// `Some(e)` it sends `e` instead.
pub(in crate::postgres) type Answer = Box<dyn FnOnce(Option<StoreError>) + Send>;

/// The flusher's statement: a commit that waits for its WAL flush.
const FLUSH_SQL: &str = "SELECT pg_logical_emit_message(true, 'lazaret.flush', '')";

/// A connection for the flusher, named `lazaret/SCHEMA/flusher` in
/// `pg_stat_activity`.
async fn connect_flusher(opts: &PgOptions) -> Result<Client, StoreError> {
    let c = connect(opts, None).await?;
    // The schema's name is checked (lowercase letters, digits, `_`).
    pg(c.batch_execute(&format!(
        "SET application_name = 'lazaret/{}/flusher'",
        opts.schema
    ))
    .await)?;
    Ok(c)
}

/// What the flusher takes, in the writer's order.
enum Msg {
    /// A group's answers, with the number its `COMMIT` was sent under.
    Group(u64, Vec<Answer>),
    /// A connection the writer made after its own was lost (the database
    /// may have restarted), before it sent any later group's `COMMIT`: the
    /// groups after this are flushed on it; the ones before on the old one.
    Connection(Client, u64),
}

/// The writer's side of the flusher task.
pub(in crate::postgres) struct Flusher {
    tx: mpsc::UnboundedSender<Msg>,
    /// Groups whose `COMMIT` was sent, counted before it is sent.
    sent: Arc<AtomicU64>,
    flushes: Arc<Flushes>,
    opts: PgOptions,
    done: JoinHandle<()>,
}

/// Flushes done since start, and the time they took.
#[derive(Default)]
struct Flushes {
    count: AtomicU64,
    micros: AtomicU64,
}

impl Flusher {
    /// Connects the flusher and starts it, before any group commits. One
    /// flush first, so a server that refuses it fails the store's open and
    /// not its first request.
    pub(in crate::postgres) async fn open(opts: PgOptions) -> Result<Self, StoreError> {
        let client = connect_flusher(&opts).await?;
        pg(client.batch_execute(FLUSH_SQL).await)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let sent = Arc::new(AtomicU64::new(0));
        let flushes = Arc::new(Flushes::default());
        let task = Task {
            client,
            opts: opts.clone(),
            sent: Arc::clone(&sent),
            flushes: Arc::clone(&flushes),
            connected_after: 0,
        };
        let done = tokio::spawn(task.run(rx));
        Ok(Flusher {
            tx,
            sent,
            flushes,
            opts,
            done,
        })
    }

    /// Counts a group whose `COMMIT` is about to be sent, and gives the
    /// number to hand its answers with.
    pub(super) fn sent(&self) -> u64 {
        self.sent.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Answers `answers` of group `group` once it is flushed.
    pub(super) fn hand(&self, group: u64, answers: Vec<Answer>) {
        if answers.is_empty() {
            return;
        }
        if let Err(mpsc::error::SendError(Msg::Group(_, answers))) =
            self.tx.send(Msg::Group(group, answers))
        {
            for a in answers {
                a(Some(StoreError::Closed));
            }
        }
    }

    /// Gives the flusher a new connection, after the writer connected
    /// again and before it sends another `COMMIT`: so the flusher need not
    /// find out for itself (then it must fail the groups sent before it
    /// connected, since it cannot tell whether the database restarted
    /// after them).
    pub(super) async fn connect_again(&self) -> Result<(), StoreError> {
        let c = connect_flusher(&self.opts).await?;
        let _ = self
            .tx
            .send(Msg::Connection(c, self.sent.load(Ordering::Acquire)));
        Ok(())
    }

    /// Flushes done since start, and the time they took in microseconds
    /// (`GroupCommitStats::syncs`, `sync_micros`).
    pub(super) fn flushes(&self) -> (u64, u64) {
        (
            self.flushes.count.load(Ordering::Relaxed),
            self.flushes.micros.load(Ordering::Relaxed),
        )
    }

    /// Waits until every answer handed is sent.
    pub(super) async fn close(self) {
        drop(self.tx);
        let _ = self.done.await;
    }
}

struct Task {
    client: Client,
    opts: PgOptions,
    sent: Arc<AtomicU64>,
    flushes: Arc<Flushes>,
    /// Groups numbered up to this had sent their `COMMIT` when `client`
    /// connected: its flush does not vouch for them.
    connected_after: u64,
}

impl Task {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Msg>) {
        while let Some(first) = rx.recv().await {
            let mut waiting = Vec::new();
            let mut next = Some(first);
            while let Some(msg) = next {
                match msg {
                    Msg::Group(group, answers) => waiting.push((group, answers)),
                    Msg::Connection(client, sent) => {
                        // The groups before it go on the old connection.
                        self.answer(std::mem::take(&mut waiting)).await;
                        self.client = client;
                        self.connected_after = sent;
                    }
                }
                next = rx.try_recv().ok();
            }
            self.answer(waiting).await;
        }
    }

    /// Flushes, and answers the groups `waiting` as the flush vouches.
    async fn answer(&mut self, waiting: Vec<(u64, Vec<Answer>)>) {
        if waiting.is_empty() {
            return;
        }
        let flushed = self.flush().await;
        for (group, answers) in waiting {
            let why = match &flushed {
                Ok(()) if group > self.connected_after => None,
                Ok(()) => Some(
                    "its commit was sent before the database connection was lost, \
                     and whether it reached the disk is unknown"
                        .to_owned(),
                ),
                Err(e) => Some(format!("its flush to disk was not confirmed: {e}")),
            };
            for a in answers {
                a(why.as_ref().map(|w| {
                    StoreError::Db(DbError::new(format!(
                        "PostgreSQL: the request was committed, but {w}; its outcome is unknown"
                    )))
                }));
            }
        }
    }

    /// One commit that waits for its WAL flush, connecting again first
    /// if the connection is gone.
    async fn flush(&mut self) -> Result<(), StoreError> {
        if self.client.is_closed() {
            let c = connect_flusher(&self.opts).await?;
            // Only now: a group counted after this was sent while this
            // connection was up, so the database has not restarted since.
            self.connected_after = self.sent.load(Ordering::Acquire);
            self.client = c;
        }
        let started = std::time::Instant::now();
        pg(self.client.batch_execute(FLUSH_SQL).await)?;
        let took = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        self.flushes.count.fetch_add(1, Ordering::Relaxed);
        self.flushes.micros.fetch_add(took, Ordering::Relaxed);
        Ok(())
    }
}
