//! Lease tokens that are never issued twice, even across a power loss.
//!
//! A lease is answered at COMMIT, before the fsync that makes it durable
//! (`Durability::Full` holds back every other answer until then): a lease
//! lost in a power loss only means the job is delivered again, which the
//! visibility timeout already allows. What must not happen is that the lost
//! lease's token comes back: a worker still holding it could then ack or
//! fail someone else's lease of the same job. So tokens come from one
//! sequence for the whole store, and the sequence is reserved ahead in the
//! `meta` table: the writer records "tokens below R may have been issued"
//! before it issues them, and answers a lease at COMMIT only when its tokens
//! lie below a reservation that is already on disk. Every other lease waits
//! for its fsync like any write. A restart continues from the reservation it
//! finds, above every token that any worker can hold.
//!
//! A reservation covers [`BLOCK`] tokens and the next one is written when
//! half of it is used, so its fsync is long done when it is needed: in
//! practice only the first leases after a start wait for the disk.

use rusqlite::{Connection, OptionalExtension, params};

use crate::StoreError;

/// Tokens one reservation adds. A new reservation is written once fewer
/// than half are left: more than one group can use (1,024 commands of at
/// most 1,000 jobs each), so its fsync is done long before it is needed.
const BLOCK: u64 = 1 << 22;
/// The `meta` row holding the reservation.
const KEY: &str = "lease_tokens_reserved";

/// The token sequence and its reservations, owned by the writer.
#[derive(Debug)]
pub(super) struct Tokens {
    /// Tokens one reservation adds ([`BLOCK`]; smaller in tests).
    block: u64,
    /// The next token to issue.
    next: u64,
    /// The reservation in the open transaction (or the last committed one).
    reserved: u64,
    /// The last committed reservation.
    committed: u64,
    /// The highest reservation known to be on disk: tokens below it may be
    /// answered at COMMIT.
    durable: u64,
    /// A committed reservation not yet known to be on disk: (commit number,
    /// value).
    in_flight: Option<(u64, u64)>,
    /// Whether a token issued since [`Tokens::take_late`] lies at or above
    /// `durable`.
    late: bool,
}

impl Tokens {
    /// Reads the reservation; without one (a new or migrated database), the
    /// sequence starts above every token this or an earlier build may have
    /// handed out: earlier builds' tokens were `(leases << 40) | id`, with
    /// `leases` the job's lease count.
    pub(super) fn load(conn: &Connection) -> Result<Self, StoreError> {
        Self::load_with(conn, BLOCK)
    }

    fn load_with(conn: &Connection, block: u64) -> Result<Self, StoreError> {
        let reserved: Option<i64> = conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [KEY], |r| r.get(0))
            .optional()?;
        let start = match reserved {
            Some(r) => u64::try_from(r).map_err(|_| {
                StoreError::Corrupt(format!(
                    "meta.{KEY} is {r}, not a token count; restore the database from a backup"
                ))
            })?,
            None => conn.query_row(
                "SELECT MAX((COALESCE(MAX(leases), 0) + 1) << 40, COALESCE(MAX(lease_token), 0) + 1)
                 FROM jobs",
                [],
                |r| r.get::<_, i64>(0),
            )? as u64,
        };
        Ok(Tokens {
            block,
            next: start,
            reserved: start,
            committed: start,
            durable: start,
            in_flight: None,
            late: false,
        })
    }

    /// Issues a token, writing a new reservation first when this one runs
    /// low (in the open transaction).
    pub(super) fn issue(&mut self, conn: &Connection) -> Result<u64, StoreError> {
        if self.reserved.saturating_sub(self.next) < self.block / 2 {
            let r = self.reserved.max(self.next) + self.block;
            conn.prepare_cached(
                "INSERT INTO meta (key, value) VALUES (?1, ?2)
                 ON CONFLICT (key) DO UPDATE SET value = excluded.value",
            )?
            .execute(params![KEY, r as i64])?;
            self.reserved = r;
        }
        let token = self.next;
        self.next += 1;
        self.late |= token >= self.durable;
        Ok(token)
    }

    /// Whether a token issued since the last call must wait for the fsync;
    /// resets.
    pub(super) fn take_late(&mut self) -> bool {
        std::mem::take(&mut self.late)
    }

    /// Where a savepoint starts, for [`Tokens::rolled_back_to`].
    pub(super) fn mark(&self) -> u64 {
        self.reserved
    }

    /// A savepoint was rolled back: so was any reservation written in it.
    /// (Tokens issued in it are skipped, never reused.)
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

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    const SCHEMA: &str = "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
                          CREATE TABLE jobs (leases INTEGER NOT NULL, lease_token INTEGER);";

    fn db() -> Connection {
        let conn = Connection::open_in_memory().unwrap();
        conn.execute_batch(SCHEMA).unwrap();
        conn
    }

    /// The `meta` rows another connection sees: what is committed.
    type Disk = Vec<(String, i64)>;

    fn committed(reader: &Connection) -> Disk {
        let mut stmt = reader.prepare("SELECT key, value FROM meta").unwrap();
        stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .map(Result::unwrap)
            .collect()
    }

    /// A store on `disk`, as a restart finds it: the writer's connection
    /// and a reader's.
    fn reopen(dir: &tempfile::TempDir, n: &mut u32, disk: &Disk) -> (Connection, Connection) {
        *n += 1;
        let path = dir.path().join(format!("{n}.db"));
        let conn = Connection::open(&path).unwrap();
        conn.execute_batch(SCHEMA).unwrap();
        for (k, v) in disk {
            conn.execute("INSERT INTO meta VALUES (?1, ?2)", params![k, v])
                .unwrap();
        }
        (conn, Connection::open(&path).unwrap())
    }

    #[test]
    fn a_new_database_starts_above_every_earlier_builds_token() {
        let conn = db();
        conn.execute_batch("INSERT INTO jobs VALUES (3, (3 << 40) | 17), (1, NULL), (0, NULL);")
            .unwrap();
        let t = Tokens::load(&conn).unwrap();
        assert_eq!(t.next, 4 << 40);

        let empty = db();
        assert_eq!(Tokens::load(&empty).unwrap().next, 1 << 40);
    }

    #[test]
    fn only_tokens_below_a_flushed_reservation_go_out_early() {
        let conn = db();
        let mut t = Tokens::load(&conn).unwrap();
        conn.execute_batch("BEGIN").unwrap();
        t.issue(&conn).unwrap();
        assert!(t.take_late(), "nothing is reserved on disk yet");
        conn.execute_batch("COMMIT").unwrap();
        assert!(t.committed(1), "the first reservation needs an fsync");
        t.issue(&conn).unwrap();
        assert!(t.take_late(), "reservation committed, not yet flushed");
        t.flushed(1);
        t.issue(&conn).unwrap();
        assert!(!t.take_late(), "below a flushed reservation");
        assert!(!t.committed(2), "no new reservation in this commit");
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// Issue this many tokens in the open transaction.
        Issue(u16),
        /// Issue in a savepoint, then roll it back.
        IssueRolledBack(u16),
        Commit,
        Rollback,
        /// The sync thread flushes everything committed so far.
        Flush,
        /// Power loss: only flushed commits survive; the store reopens.
        PowerLoss,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u16..100).prop_map(Op::Issue),
            1 => (1u16..100).prop_map(Op::IssueRolledBack),
            3 => Just(Op::Commit),
            1 => Just(Op::Rollback),
            2 => Just(Op::Flush),
            1 => Just(Op::PowerLoss),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// No token a worker may hold is ever issued again: not one
        /// answered at COMMIT (early), not one answered after its fsync,
        /// whatever the power losses in between.
        #[test]
        fn no_token_a_worker_holds_is_issued_again(ops in prop::collection::vec(op(), 1..60)) {
            // Small reservations, so that cases run through many.
            let block = 64;
            let dir = tempfile::TempDir::new().unwrap();
            let mut files = 0;
            let mut flushed: Disk = Vec::new();
            let (mut conn, mut reader) = reopen(&dir, &mut files, &flushed);
            let mut t = Tokens::load_with(&conn, block).unwrap();
            conn.execute_batch("BEGIN").unwrap();
            let mut seq = 0;
            // Tokens answered (or to be answered, once flushed).
            let mut held: BTreeSet<u64> = BTreeSet::new();
            // This transaction's late tokens, and committed-unflushed ones.
            let mut open_late: Vec<u64> = Vec::new();
            let mut open_early: Vec<u64> = Vec::new();
            let mut unflushed_late: Vec<u64> = Vec::new();
            for op in ops {
                match op {
                    Op::Issue(n) | Op::IssueRolledBack(n) => {
                        let rolled = matches!(op, Op::IssueRolledBack(_));
                        let mark = t.mark();
                        if rolled {
                            conn.execute_batch("SAVEPOINT cmd").unwrap();
                        }
                        let mut issued = Vec::new();
                        for _ in 0..n {
                            let tok = t.issue(&conn).unwrap();
                            prop_assert!(!held.contains(&tok), "token {tok} issued twice");
                            issued.push(tok);
                        }
                        let late = t.take_late();
                        if rolled {
                            conn.execute_batch("ROLLBACK TO cmd; RELEASE cmd").unwrap();
                            t.rolled_back_to(mark);
                        } else if late {
                            open_late.extend(issued);
                        } else {
                            open_early.extend(issued);
                        }
                    }
                    Op::Commit => {
                        conn.execute_batch("COMMIT").unwrap();
                        seq += 1;
                        t.committed(seq);
                        // Early answers go out now; late ones after a flush.
                        held.extend(open_early.drain(..));
                        unflushed_late.append(&mut open_late);
                        conn.execute_batch("BEGIN").unwrap();
                    }
                    Op::Rollback => {
                        conn.execute_batch("ROLLBACK").unwrap();
                        t.rolled_back();
                        open_early.clear();
                        open_late.clear();
                        conn.execute_batch("BEGIN").unwrap();
                    }
                    Op::Flush => {
                        flushed = committed(&reader);
                        t.flushed(seq);
                        held.extend(unflushed_late.drain(..));
                    }
                    Op::PowerLoss => {
                        drop((conn, reader));
                        (conn, reader) = reopen(&dir, &mut files, &flushed);
                        t = Tokens::load_with(&conn, block).unwrap();
                        for tok in &held {
                            prop_assert!(*tok < t.next, "restart at {} under held token {tok}", t.next);
                        }
                        open_early.clear();
                        open_late.clear();
                        unflushed_late.clear();
                        conn.execute_batch("BEGIN").unwrap();
                    }
                }
            }
        }
    }
}
