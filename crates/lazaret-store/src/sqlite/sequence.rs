//! Numbers that are never issued twice, even across a power loss: lease
//! tokens and job ids.
//!
//! With `Durability::Full` a lease is answered at COMMIT, before the fsync
//! that makes it durable; every other answer waits for it. A power loss can
//! then take back a lease that a worker already holds, and with it the
//! enqueue of the job, if that had not reached the disk either. Either is
//! harmless — the job is delivered again, or its producer, never told 201,
//! enqueues it again — as long as no number the worker holds comes back:
//! not its token (it could then ack or fail someone else's lease of the job)
//! and not the job's id (workers key side effects by it, so a new job under
//! the same id would be skipped as done).
//!
//! So each is one sequence for the whole store, reserved ahead in the `meta`
//! table: the writer records "numbers below R may have been issued" before
//! it issues them, and answers a lease at COMMIT only when its tokens and
//! its jobs' ids lie below reservations already on disk ([`Sequence::durable`]).
//! Every other lease waits for its fsync like any write. A start continues
//! from the reservation it finds, above every number a worker can hold.
//!
//! The next reservation is written when half of the current one is used, so
//! its fsync is long done when it is needed: in practice only the first
//! leases after a start wait for the disk. `Durability::Normal` counts every
//! commit as on disk; it promises nothing across a power loss.

use rusqlite::{Connection, OptionalExtension, params};

use crate::StoreError;

/// The lease-token sequence: `meta` key and reservation size. More than one
/// group can use (1,024 leases of at most 1,000 jobs each).
pub(super) const TOKENS: (&str, u64) = ("lease_tokens_reserved", 1 << 22);
/// The job-id sequence. Ids are seen by people: a restart skips at most
/// this many.
pub(super) const JOB_IDS: (&str, u64) = ("job_ids_reserved", 1 << 16);

/// Where the token sequence starts in a database without a reservation:
/// above every token an earlier build handed out. Those were
/// `(leases << 40) | (id mod 2^40)`, `leases` being the job's lease count.
pub(super) fn token_floor(conn: &Connection) -> Result<u64, StoreError> {
    let floor: i64 = conn.query_row(
        "SELECT MAX((COALESCE(MAX(leases), 0) + 1) << 40, COALESCE(MAX(lease_token), 0) + 1)
         FROM jobs",
        [],
        |r| r.get(0),
    )?;
    Ok(floor as u64)
}

/// Where the job-id sequence starts without a reservation: above every id
/// used (`AUTOINCREMENT` keeps the highest in `sqlite_sequence`).
pub(super) fn job_id_floor(conn: &Connection) -> Result<u64, StoreError> {
    let last: i64 = conn.query_row(
        "SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'jobs'), 0)",
        [],
        |r| r.get(0),
    )?;
    Ok(last as u64 + 1)
}

/// One reserved sequence, owned by the writer.
#[derive(Debug)]
pub(super) struct Sequence {
    /// Its row in `meta`.
    key: &'static str,
    /// Numbers one reservation adds (at least 2).
    block: u64,
    /// The next number to issue.
    next: u64,
    /// The reservation in the open transaction (or the last committed one).
    reserved: u64,
    /// The last committed reservation.
    committed: u64,
    /// The highest reservation known to be on disk.
    durable: u64,
    /// A committed reservation not yet known to be on disk: (commit number,
    /// value).
    in_flight: Option<(u64, u64)>,
}

impl Sequence {
    /// Reads the reservation of `(key, block)`; the sequence continues from
    /// it. A new or migrated database has none: the sequence then starts at
    /// `floor`, above every number issued before. (Once a reservation
    /// exists, every number was issued below it.)
    pub(super) fn load(
        conn: &Connection,
        (key, block): (&'static str, u64),
        floor: u64,
    ) -> Result<Self, StoreError> {
        debug_assert!(block >= 2, "a reservation must leave room to issue");
        let reserved: Option<i64> = conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()?;
        let start = match reserved {
            Some(r) => u64::try_from(r).map_err(|_| {
                StoreError::Corrupt(format!(
                    "meta.{key} is {r}, not a count; restore the database from a backup"
                ))
            })?,
            None => floor,
        };
        Ok(Sequence {
            key,
            block,
            next: start,
            reserved: start,
            committed: start,
            durable: start,
            in_flight: None,
        })
    }

    /// Issues a number, writing a new reservation first when this one runs
    /// low (in the open transaction).
    pub(super) fn issue(&mut self, conn: &Connection) -> Result<u64, StoreError> {
        if self.reserved.saturating_sub(self.next) < self.block / 2 {
            let r = self.reserved.max(self.next) + self.block;
            conn.prepare_cached(
                "INSERT INTO meta (key, value) VALUES (?1, ?2)
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            )?
            .execute(params![self.key, r as i64])?;
            self.reserved = r;
        }
        let n = self.next;
        self.next += 1;
        Ok(n)
    }

    /// Numbers below this can never be issued again, whatever happens to
    /// the commits not yet on disk.
    pub(super) fn durable(&self) -> u64 {
        self.durable
    }

    /// Where a savepoint starts, for [`Sequence::rolled_back_to`].
    pub(super) fn mark(&self) -> u64 {
        self.reserved
    }

    /// A savepoint was rolled back: so was any reservation written in it.
    /// (Numbers issued in it are skipped, never reused.)
    pub(super) fn rolled_back_to(&mut self, mark: u64) {
        self.reserved = mark;
    }

    /// The open transaction was rolled back.
    pub(super) fn rolled_back(&mut self) {
        self.reserved = self.committed;
    }

    /// The open transaction committed as commit number `seq`; returns
    /// whether it carried a new reservation, which then needs an fsync.
    pub(super) fn committed(&mut self, seq: u64) -> bool {
        if self.reserved == self.committed {
            return false;
        }
        self.committed = self.reserved;
        self.in_flight = Some((seq, self.reserved));
        true
    }

    /// Every commit up to number `seq` is on disk.
    pub(super) fn flushed(&mut self, seq: u64) {
        if let Some((s, r)) = self.in_flight {
            if s <= seq {
                self.durable = self.durable.max(r);
                self.in_flight = None;
            }
        }
    }
}

/// The writer's two sequences, which roll back, commit and reach the disk
/// together, as the transactions that write their reservations do.
#[derive(Debug)]
pub(super) struct Reserved {
    pub(super) ids: Sequence,
    pub(super) tokens: Sequence,
}

impl Reserved {
    /// Both sequences of the database, from their reservations or floors.
    pub(super) fn load(conn: &Connection) -> Result<Self, StoreError> {
        Ok(Reserved {
            ids: Sequence::load(conn, JOB_IDS, job_id_floor(conn)?)?,
            tokens: Sequence::load(conn, TOKENS, token_floor(conn)?)?,
        })
    }

    /// Whether a worker may get job `id` with `token` before the fsync:
    /// neither can be issued again, whatever a power loss takes back.
    pub(super) fn durable(&self, id: u64, token: u64) -> bool {
        id < self.ids.durable() && token < self.tokens.durable()
    }

    /// See [`Sequence::mark`].
    pub(super) fn mark(&self) -> (u64, u64) {
        (self.ids.mark(), self.tokens.mark())
    }

    /// See [`Sequence::rolled_back_to`].
    pub(super) fn rolled_back_to(&mut self, (ids, tokens): (u64, u64)) {
        self.ids.rolled_back_to(ids);
        self.tokens.rolled_back_to(tokens);
    }

    /// See [`Sequence::rolled_back`].
    pub(super) fn rolled_back(&mut self) {
        self.ids.rolled_back();
        self.tokens.rolled_back();
    }

    /// See [`Sequence::committed`]: whether either carried a new
    /// reservation.
    pub(super) fn committed(&mut self, seq: u64) -> bool {
        // Both, always: `|` does not short-circuit.
        self.ids.committed(seq) | self.tokens.committed(seq)
    }

    /// See [`Sequence::flushed`].
    pub(super) fn flushed(&mut self, seq: u64) {
        self.ids.flushed(seq);
        self.tokens.flushed(seq);
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    fn db() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(
            "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
             CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, leases INTEGER NOT NULL,
                                lease_token INTEGER);",
        )
        .unwrap();
        conn
    }

    /// The committed `meta` rows: what a fsync would make survive.
    type Disk = Vec<(String, i64)>;

    fn disk(conn: &Connection) -> Disk {
        let mut stmt = conn.prepare("SELECT key, value FROM meta").unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// A store restarted on `disk`.
    fn reopen(disk: &Disk) -> Connection {
        let conn = db();
        for (k, v) in disk {
            conn.execute("INSERT INTO meta VALUES (?1, ?2)", params![k, v])
                .unwrap();
        }
        conn
    }

    #[test]
    fn without_a_reservation_the_sequences_start_above_earlier_numbers() {
        let conn = db();
        assert_eq!(token_floor(&conn).unwrap(), 1 << 40);
        assert_eq!(job_id_floor(&conn).unwrap(), 1);
        conn.execute_batch(
            "INSERT INTO jobs VALUES (17, 3, (3 << 40) | 17), (18, 1, NULL), (19, 0, NULL);",
        )
        .unwrap();
        assert_eq!(token_floor(&conn).unwrap(), 4 << 40);
        assert_eq!(job_id_floor(&conn).unwrap(), 20);
        let s = Sequence::load(&conn, TOKENS, token_floor(&conn).unwrap()).unwrap();
        assert_eq!(s.next, 4 << 40);
    }

    #[test]
    fn a_reservation_is_durable_only_once_its_commit_is_flushed() {
        let conn = db();
        let mut s = Sequence::load(&conn, JOB_IDS, 1).unwrap();
        conn.execute_batch("BEGIN").unwrap();
        assert_eq!(s.issue(&conn).unwrap(), 1);
        assert_eq!(s.durable(), 1, "nothing is reserved on disk yet");
        conn.execute_batch("COMMIT").unwrap();
        assert!(s.committed(7), "the first reservation needs an fsync");
        s.flushed(6);
        assert_eq!(s.durable(), 1, "commit 7 is not covered by a flush up to 6");
        s.flushed(7);
        assert_eq!(s.durable(), 1 + JOB_IDS.1);
        assert_eq!(s.issue(&conn).unwrap(), 2);
        assert!(!s.committed(8), "no new reservation in this commit");
        // A restart continues from the reservation, not from the last id
        // or a floor.
        let again = Sequence::load(&conn, JOB_IDS, 1 << 30).unwrap();
        assert_eq!(again.next, 1 + JOB_IDS.1);
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Issue this many numbers, as one command, in the open transaction.
        Issue(u16),
        /// The same in a savepoint that is then rolled back.
        IssueRolledBack(u16),
        Commit,
        Rollback,
        /// The sync thread flushes the commits up to this far back from the
        /// last (0: all of them).
        Flush(u8),
        /// Power loss: the flushed commits survive, and this many of the
        /// ones after them (at most all); then the store restarts.
        PowerLoss(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u16..100).prop_map(Op::Issue),
            1 => (1u16..100).prop_map(Op::IssueRolledBack),
            3 => Just(Op::Commit),
            1 => Just(Op::Rollback),
            2 => (0u8..4).prop_map(Op::Flush),
            1 => (0u8..4).prop_map(Op::PowerLoss),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// No number a worker may hold is ever issued again: not one
        /// answered at COMMIT (below the durable reservation when issued),
        /// not one answered after the fsync of its commit, whatever the
        /// rollbacks and power losses in between.
        #[test]
        fn no_number_a_worker_holds_is_issued_again(ops in prop::collection::vec(op(), 1..80)) {
            const SMALL: (&str, u64) = ("test_reserved", 64);
            let mut conn = db();
            let mut s = Sequence::load(&conn, SMALL, 1).unwrap();
            // Disk after each commit since the last start; [0] at the start.
            let mut commits: Vec<Disk> = vec![disk(&conn)];
            let mut flushed = 0usize;
            conn.execute_batch("BEGIN").unwrap();
            // Answered numbers; numbers answered once their commit is flushed.
            let mut held: BTreeSet<u64> = BTreeSet::new();
            let mut waiting: Vec<(usize, u64)> = Vec::new();
            // This transaction's numbers: (answered at COMMIT?, number).
            let mut open: Vec<(bool, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Issue(n) | Op::IssueRolledBack(n) => {
                        let rolled = matches!(op, Op::IssueRolledBack(_));
                        let mark = s.mark();
                        if rolled {
                            conn.execute_batch("SAVEPOINT cmd").unwrap();
                        }
                        let mut issued = Vec::new();
                        for _ in 0..n {
                            let k = s.issue(&conn).unwrap();
                            prop_assert!(!held.contains(&k), "{k} issued twice");
                            issued.push(k);
                        }
                        // As the writer decides for a lease: early only if
                        // every number is below the durable reservation.
                        let early = issued.iter().all(|&k| k < s.durable());
                        if rolled {
                            conn.execute_batch("ROLLBACK TO cmd; RELEASE cmd").unwrap();
                            s.rolled_back_to(mark);
                        } else {
                            open.extend(issued.into_iter().map(|k| (early, k)));
                        }
                    }
                    Op::Commit => {
                        conn.execute_batch("COMMIT").unwrap();
                        commits.push(disk(&conn));
                        let seq = commits.len() - 1;
                        s.committed(seq as u64);
                        for (early, k) in open.drain(..) {
                            if early {
                                held.insert(k);
                            } else {
                                waiting.push((seq, k));
                            }
                        }
                        conn.execute_batch("BEGIN").unwrap();
                    }
                    Op::Rollback => {
                        conn.execute_batch("ROLLBACK").unwrap();
                        s.rolled_back();
                        open.clear();
                        conn.execute_batch("BEGIN").unwrap();
                    }
                    Op::Flush(back) => {
                        let last = commits.len() - 1;
                        flushed = flushed.max(last.saturating_sub(usize::from(back)));
                        s.flushed(flushed as u64);
                        waiting.retain(|&(seq, k)| {
                            if seq <= flushed {
                                held.insert(k);
                            }
                            seq > flushed
                        });
                    }
                    Op::PowerLoss(extra) => {
                        let kept = (flushed + usize::from(extra)).min(commits.len() - 1);
                        let survived = commits[kept].clone();
                        drop(conn);
                        conn = reopen(&survived);
                        s = Sequence::load(&conn, SMALL, 1).unwrap();
                        for &k in &held {
                            prop_assert!(k < s.next, "restart at {} under held {k}", s.next);
                        }
                        commits = vec![survived];
                        flushed = 0;
                        waiting.clear();
                        open.clear();
                        conn.execute_batch("BEGIN").unwrap();
                    }
                }
            }
        }
    }
}
