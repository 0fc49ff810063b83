//! Durability without stalling the writer.
//!
//! With [`Durability::Full`](super::Durability::Full) the connection runs
//! `synchronous = NORMAL` (a WAL commit writes its frames and does not wait
//! for the disk) and this thread makes each commit durable instead: it
//! fsyncs the WAL file, and only then sends the answers of every group
//! committed before that fsync began. That is the guarantee of
//! `synchronous = FULL` — nothing is answered before its commit is on stable
//! storage — but the fsync no longer holds the single writer: while the disk
//! flushes group N, the writer already runs group N+1, and one fsync covers
//! every group that committed while the previous one ran. (The writer still
//! waits for the disk when a COMMIT runs SQLite's automatic checkpoint,
//! about every 1,000 WAL pages.)
//!
//! SQLite in NORMAL mode still fsyncs the WAL before each checkpoint copies
//! it into the database, and the database after; a WAL restart rewrites the
//! file only after such a checkpoint. So the frames an answer depends on are
//! never overwritten before this thread has flushed them, and the file it
//! flushes is the one SQLite writes (the WAL is deleted only when the last
//! connection closes, after this thread has stopped).
//!
//! Leases are the exception: the writer answers one at COMMIT when its
//! tokens and job ids are covered by reservations already on disk
//! (`super::sequence`), since a power loss that takes it back only delivers
//! the job again.
//!
//! One more difference from `FULL` remains: reads on other connections (job and
//! dead-letter lookups) can see a commit before its fsync ends, up to one
//! fsync plus this thread's queue earlier; a power loss in that window takes
//! back what they saw. No answer to the request that made the change goes
//! out before the fsync.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, mpsc};
use std::thread::JoinHandle;

use super::writer::Pending;
use crate::StoreError;

/// Flushes the write-ahead log to stable storage.
pub(super) type SyncFn = Box<dyn FnMut() -> io::Result<()> + Send>;

/// The syncing thread and what the writer needs to talk to it.
pub(super) struct Syncer {
    tx: Option<mpsc::Sender<(u64, Vec<Pending>)>>,
    handle: Option<JoinHandle<()>>,
    shared: Arc<Shared>,
}

/// Why the store stopped writing: set for good by a failed fsync or a lost
/// sync thread; what the answers of unflushed commits say. Shared with the
/// store, which reports it (`Store::failure`).
pub(super) type Failure = Arc<OnceLock<String>>;

struct Shared {
    /// fsyncs done since start.
    syncs: AtomicU64,
    /// Time spent in them, in microseconds.
    sync_micros: AtomicU64,
    /// The last commit (by number) that an fsync covered.
    synced: AtomicU64,
    failure: Failure,
}

impl Shared {
    /// Records the first failure for good; returns the one in force.
    fn fail(&self, msg: String) -> String {
        self.failure.get_or_init(|| msg).clone()
    }
}

impl Syncer {
    /// Starts the thread; `sync` flushes the WAL, `failure` records why it
    /// could not.
    pub(super) fn start(mut sync: SyncFn, failure: Failure) -> io::Result<Self> {
        let (tx, rx) = mpsc::channel::<(u64, Vec<Pending>)>();
        let shared = Arc::new(Shared {
            syncs: AtomicU64::new(0),
            sync_micros: AtomicU64::new(0),
            synced: AtomicU64::new(0),
            failure,
        });
        let s = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("lazaret-fsync".into())
            .spawn(move || {
                while let Ok((mut last, mut answers)) = rx.recv() {
                    // Everything queued so far committed before this fsync
                    // starts: one flush covers it all.
                    while let Ok((commit, more)) = rx.try_recv() {
                        last = commit;
                        answers.extend(more);
                    }
                    let error = if let Some(msg) = s.failure.get() {
                        Some(msg.clone())
                    } else {
                        let began = std::time::Instant::now();
                        match sync() {
                            Ok(()) => {
                                let took = began.elapsed().as_micros();
                                s.sync_micros.fetch_add(
                                    u64::try_from(took).unwrap_or(u64::MAX),
                                    Ordering::Relaxed,
                                );
                                s.syncs.fetch_add(1, Ordering::Relaxed);
                                s.synced.store(last, Ordering::Release);
                                None
                            }
                            Err(e) => {
                                // After a failed fsync the kernel may have
                                // dropped the dirty pages and a later fsync
                                // can succeed without them: never trust the
                                // file again in this process.
                                let msg = format!(
                                    "committed, but the fsync that makes it durable failed ({e}), so it may not survive a power loss; lazaret stopped writing: check the disk, then restart it"
                                );
                                tracing::error!(error = %e, "fsync of the write-ahead log failed; refusing further writes");
                                Some(s.fail(msg))
                            }
                        }
                    };
                    for answer in answers {
                        answer(error.clone().map(StoreError::NotDurable));
                    }
                }
            })?;
        Ok(Syncer {
            tx: Some(tx),
            handle: Some(handle),
            shared,
        })
    }

    /// Hands over the answers of commit number `commit`; they go out after
    /// the next fsync. A commit with no answers is flushed only if `flush`
    /// (the next fsync covers it anyway).
    pub(super) fn submit(&self, commit: u64, answers: Vec<Pending>, flush: bool) {
        if answers.is_empty() && !flush {
            return;
        }
        let lost = match &self.tx {
            Some(tx) => tx
                .send((commit, answers))
                .err()
                .map(|mpsc::SendError((_, a))| a),
            None => Some(answers),
        };
        if let Some(answers) = lost {
            tracing::error!("the store's sync thread is gone; refusing further writes");
            let msg = self.shared.fail(
                "committed, but the store's sync thread is gone, so it may not survive a power loss; lazaret stopped writing: restart it".into(),
            );
            for answer in answers {
                answer(Some(StoreError::NotDurable(msg.clone())));
            }
        }
    }

    /// Why writes are refused, once an fsync has failed.
    pub(super) fn failure(&self) -> Option<String> {
        self.shared.failure.get().cloned()
    }

    /// fsyncs done since start.
    pub(super) fn syncs(&self) -> u64 {
        self.shared.syncs.load(Ordering::Relaxed)
    }

    /// The last commit (by number) that an fsync covered.
    pub(super) fn synced(&self) -> u64 {
        self.shared.synced.load(Ordering::Acquire)
    }

    /// Time the fsyncs done since start took, in microseconds.
    pub(super) fn sync_micros(&self) -> u64 {
        self.shared.sync_micros.load(Ordering::Relaxed)
    }

    /// Flushes and answers everything submitted, then stops the thread.
    pub(super) fn finish(&mut self) {
        self.tx = None;
        if let Some(handle) = self.handle.take() {
            let _ = handle.join();
        }
    }
}

impl Drop for Syncer {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// An answer that reports what it was called with on `tx`.
    fn answer(tx: &mpsc::Sender<Option<String>>) -> Pending {
        let tx = tx.clone();
        Box::new(move |e: Option<StoreError>| {
            let _ = tx.send(e.map(|e| e.to_string()));
        })
    }

    const LONG: Duration = Duration::from_secs(10);

    #[test]
    fn answers_wait_for_the_fsync_that_covers_them() {
        let (gate, opened) = mpsc::channel::<()>();
        let syncer = Syncer::start(
            Box::new(move || opened.recv().map_err(|_| io::Error::other("gate dropped"))),
            Failure::default(),
        )
        .expect("thread");
        let (tx, rx) = mpsc::channel();
        syncer.submit(1, vec![answer(&tx), answer(&tx)], false);
        assert!(
            rx.recv_timeout(Duration::from_millis(100)).is_err(),
            "an answer went out before its fsync"
        );
        assert_eq!(syncer.synced(), 0);
        gate.send(()).expect("syncer waiting");
        assert_eq!(rx.recv_timeout(LONG).expect("answered"), None);
        assert_eq!(rx.recv_timeout(LONG).expect("answered"), None);
        assert_eq!(syncer.syncs(), 1);
        assert_eq!(syncer.synced(), 1, "commit 1 is on disk");
        assert_eq!(syncer.failure(), None);
    }

    #[test]
    fn one_fsync_covers_every_group_queued_while_the_last_ran() {
        let (gate, opened) = mpsc::channel::<()>();
        let (started_tx, started) = mpsc::channel::<()>();
        let mut syncer = Syncer::start(
            Box::new(move || {
                let _ = started_tx.send(());
                opened.recv().map_err(|_| io::Error::other("gate dropped"))
            }),
            Failure::default(),
        )
        .expect("thread");
        let (tx, rx) = mpsc::channel();
        syncer.submit(1, vec![answer(&tx)], false);
        started.recv_timeout(LONG).expect("first fsync started");
        // Three groups commit while the first fsync runs, and one with no
        // answers and nothing to flush, which is not queued.
        for commit in 2..5 {
            syncer.submit(commit, vec![answer(&tx)], false);
        }
        syncer.submit(5, Vec::new(), false);
        gate.send(()).expect("first fsync waiting");
        assert_eq!(rx.recv_timeout(LONG).expect("first group"), None);
        started.recv_timeout(LONG).expect("second fsync started");
        gate.send(()).expect("second fsync waiting");
        for _ in 0..3 {
            assert_eq!(rx.recv_timeout(LONG).expect("later groups"), None);
        }
        syncer.finish();
        assert_eq!(syncer.syncs(), 2, "the three later groups shared one fsync");
        assert_eq!(syncer.synced(), 4);
    }

    #[test]
    fn a_commit_without_answers_is_flushed_when_asked() {
        let mut syncer = Syncer::start(Box::new(|| Ok(())), Failure::default()).expect("thread");
        syncer.submit(7, Vec::new(), true);
        syncer.finish();
        assert_eq!((syncer.syncs(), syncer.synced()), (1, 7));
    }

    #[test]
    fn a_failed_fsync_fails_its_answers_and_nothing_is_flushed_after_it() {
        let calls = Arc::new(AtomicU64::new(0));
        let c = Arc::clone(&calls);
        let mut syncer = Syncer::start(
            Box::new(move || {
                c.fetch_add(1, Ordering::SeqCst);
                Err(io::Error::other("EIO from the test disk"))
            }),
            Failure::default(),
        )
        .expect("thread");
        let (tx, rx) = mpsc::channel();
        syncer.submit(1, vec![answer(&tx)], false);
        let first = rx.recv_timeout(LONG).expect("answered").expect("an error");
        assert!(first.contains("EIO from the test disk"), "{first}");
        assert!(first.contains("restart"), "says what to do: {first}");
        assert_eq!(syncer.failure().as_deref(), Some(first.as_str()));
        syncer.submit(2, vec![answer(&tx)], false);
        let second = rx.recv_timeout(LONG).expect("answered").expect("an error");
        assert_eq!(second, first);
        syncer.finish();
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "no fsync is trusted after a failed one"
        );
        assert_eq!(syncer.syncs(), 0);
        assert_eq!(syncer.synced(), 0, "nothing counts as on disk");
    }

    #[test]
    fn finish_answers_everything_submitted() {
        let mut syncer = Syncer::start(Box::new(|| Ok(())), Failure::default()).expect("thread");
        let (tx, rx) = mpsc::channel();
        for commit in 1..=5 {
            syncer.submit(commit, vec![answer(&tx), answer(&tx)], false);
        }
        syncer.finish();
        drop(tx);
        let answers: Vec<_> = rx.iter().collect();
        assert_eq!(answers, vec![None; 10]);
    }
}
