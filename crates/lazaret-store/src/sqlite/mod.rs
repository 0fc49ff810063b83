//! The embedded store: one SQLite file in WAL mode, one writer thread with
//! group commit, one reader connection.
//!
//! Writes from concurrent requests queue on a channel; the writer thread
//! takes everything pending and runs it in one `BEGIN IMMEDIATE … COMMIT`
//! (see `writer::Writer::run_group` for what happens when one command
//! fails). With the durable default, the sync thread then fsyncs the WAL
//! and only then answers (see `sync`): one fsync covers every group
//! committed while the previous one ran, so durability costs neither one
//! fsync per job nor a writer waiting on the disk, and nothing is answered
//! before it is durable.
//!
//! One store at a time per data directory: `open` takes an exclusive lock
//! on `lazaret.lock` there (see `lock_dir`), held by the writer thread until
//! its connection is closed, so a second server on the same directory is
//! refused instead of issuing the same job ids and lease tokens.

mod checkpoint;
mod pairs;
mod reader;
mod schema;
mod sequence;
mod sources;
mod stored;
mod sync;
mod writer;

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;

use lazaret_core::FairScheduler;
use rusqlite::Connection;

use crate::backend::{Backend, StoreOn};
use crate::{Decider, StoreError};

pub use schema::SCHEMA_VERSION;
use writer::Cmd;

/// How hard a commit holds on to the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// Nothing is answered before its commit is on stable storage: the
    /// guarantee of `synchronous = FULL`, survives power loss. The default.
    /// Implemented as `synchronous = NORMAL` plus an fsync of the WAL on a
    /// thread of its own before the answers go out (see `sync`), so the
    /// writer does not wait for each commit's fsync. (Reads on the reader
    /// connection may see a commit up to one fsync before it is durable.)
    #[default]
    Full,
    /// `synchronous = NORMAL` and answers at COMMIT: survives a process
    /// crash; the last commits may be lost on power loss. Faster; named for
    /// what it is.
    Normal,
}

impl Durability {
    /// The word used in the server's config file (`durability = "full"`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Durability::Full => "full",
            Durability::Normal => "normal",
        }
    }
}

/// The file name inside the data directory.
pub const DB_FILE: &str = "lazaret.db";

/// The lock file inside the data directory: whoever holds an exclusive lock
/// on it owns the directory; it holds that process's id, for the message
/// the next one gets. It stays when the store closes (the lock, not the
/// file, is what counts; the kernel drops the lock when a process dies).
pub const LOCK_FILE: &str = "lazaret.lock";

/// Commands waiting for the writer at most; one more is refused with
/// [`StoreError::Overloaded`] (the server answers `503 UNAVAILABLE` with
/// `Retry-After`) instead of queueing without bound. About half a second of
/// the writer's work at its usual pace on a small machine; housekeeping
/// and close are never refused.
pub const COMMANDS_MAX: usize = 10_000;

/// The SQLite [`Store`](crate::Store): the generic store on [`Sqlite`].
pub type SqliteStore = StoreOn<Sqlite>;

/// The SQLite backend: the writer thread's queue and the reader connection.
#[derive(Debug)]
pub struct Sqlite {
    tx: mpsc::Sender<Cmd>,
    /// Commands sent and not yet taken by the writer.
    waiting: Arc<AtomicUsize>,
    /// The bound on `waiting` for requests ([`COMMANDS_MAX`]).
    commands_max: usize,
    reader: Arc<Mutex<Connection>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    path: PathBuf,
    closed: AtomicBool,
    /// Set by the sync thread if a commit could not be made durable.
    failure: sync::Failure,
}

/// Both durabilities run `synchronous = NORMAL`: SQLite fsyncs around
/// checkpoints only, and `Durability::Full` adds the per-commit fsync on the
/// sync thread.
///
/// The page cache is 4 MiB, not more: each B-tree split (`balance_nonroot`)
/// parks a page at a temporary high page number, and the next COMMIT then
/// scans the cache's whole hash table to drop pages past the end of the
/// file. With 16 MiB that scan was 3% of the writer; 4 MiB made the batched
/// bench ×1.09 at 20,000 and at 1,000,000 queued (docs/benchmarks.md), and
/// the hot pages (both ends of each index) fit many times over.
fn open_conn(path: &Path) -> Result<Connection, StoreError> {
    let conn = Connection::open(path)?;
    conn.execute_batch(
        "PRAGMA journal_mode = WAL;
         PRAGMA synchronous = NORMAL;
         PRAGMA busy_timeout = 10000;
         PRAGMA cache_size = -4000;
         PRAGMA temp_store = MEMORY;",
    )?;
    Ok(conn)
}

/// Takes the exclusive lock on `dir`'s [`LOCK_FILE`] and writes this
/// process's id into it; [`StoreError::InUse`] when another store (in this
/// process or another) holds it. The lock lasts as long as the returned file.
fn lock_dir(dir: &Path) -> Result<File, StoreError> {
    let io_error = open_error(dir);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(dir.join(LOCK_FILE))
        .map_err(io_error)?;
    if !try_lock(&file).map_err(io_error)? {
        let mut held = String::new();
        let _ = file.read_to_string(&mut held);
        return Err(StoreError::InUse {
            path: dir.display().to_string(),
            pid: held.trim().parse().ok(),
        });
    }
    file.set_len(0).map_err(io_error)?;
    writeln!(file, "{}", std::process::id()).map_err(io_error)?;
    Ok(file)
}

/// Takes an exclusive `flock(2)` on `file` without waiting; `false` when
/// another open file holds it (in this process or another). The kernel
/// drops it when the file is closed or its process dies.
#[cfg(unix)]
fn try_lock(file: &File) -> std::io::Result<bool> {
    use rustix::fs::{FlockOperation, flock};
    match flock(file, FlockOperation::NonBlockingLockExclusive) {
        Ok(()) => Ok(true),
        Err(e) if e == rustix::io::Errno::WOULDBLOCK => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Elsewhere no lock is taken (std's `File::try_lock` needs Rust 1.89).
#[cfg(not(unix))]
fn try_lock(_: &File) -> std::io::Result<bool> {
    Ok(true)
}

/// The error for an I/O failure while opening the store in `dir`.
fn open_error(dir: &Path) -> impl Fn(std::io::Error) -> StoreError + Copy + '_ {
    move |source| StoreError::Open {
        path: dir.display().to_string(),
        source,
    }
}

/// Refuses a database file that is there but empty; `Ok(true)` when there
/// is none (a new store is created).
///
/// SQLite takes an empty file for a new database, so a lazaret.db truncated
/// to 0 bytes (a failed copy, a restore gone wrong) would start a fresh
/// store that issues job ids from 1 again: the data loss would go unseen.
/// A new database is never left empty: `PRAGMA journal_mode = WAL` writes
/// its first page before anything else happens (and a failed first open
/// removes the file, see `remove_if_empty`).
fn check_db_file(path: &Path) -> Result<bool, StoreError> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() && m.len() == 0 => Err(StoreError::Corrupt(format!(
            "the database file {} is empty (0 bytes): this is not a new database but one whose \
             data is gone (truncated, or a copy that failed), and starting it empty would issue \
             job ids from 1 again; restore it from a backup, or delete it to start a new, empty store",
            path.display()
        ))),
        Ok(_) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(true),
        // Let SQLite say what is wrong with it.
        Err(_) => Ok(false),
    }
}

/// Removes the database file at `path` if it is empty, with its WAL and
/// shared-memory files; best effort.
fn remove_if_empty(path: &Path) {
    if std::fs::metadata(path).is_ok_and(|m| m.len() == 0) {
        for suffix in ["-wal", "-shm", ""] {
            let mut p = path.as_os_str().to_owned();
            p.push(suffix);
            let _ = std::fs::remove_file(p);
        }
    }
}

/// `e`, or, when SQLite found the file at `path` is not a database or is
/// damaged, a [`StoreError::Corrupt`] that says so and what to do.
fn corrupt_error(path: &Path, e: StoreError) -> StoreError {
    match e {
        StoreError::Db(d)
            if matches!(d.code.as_deref(), Some("NotADatabase" | "DatabaseCorrupt")) =>
        {
            StoreError::Corrupt(format!(
                "the database file {} is corrupt or not a lazaret database ({}); \
                 lazaret will not start on it: restore it from a backup, or move it aside \
                 to start a new, empty store (its job ids start from 1 again)",
                path.display(),
                d.message
            ))
        }
        other => other,
    }
}

/// SQLite's errors cross the seam as text and code (`DbError`), so no
/// caller depends on rusqlite.
impl From<rusqlite::Error> for StoreError {
    fn from(e: rusqlite::Error) -> Self {
        let code = match &e {
            rusqlite::Error::SqliteFailure(f, _) => Some(format!("{:?}", f.code)),
            _ => None,
        };
        StoreError::Db(crate::DbError {
            message: format!("SQLite: {e}; check the data directory's disk space and permissions"),
            code,
        })
    }
}

/// Opens the WAL of the database at `path` (it exists once a connection has
/// read the database) and returns the function that flushes it. The
/// directory is flushed once too, so the WAL's own entry survives a power
/// loss.
fn wal_sync(dir: &Path, path: &Path) -> Result<sync::SyncFn, StoreError> {
    let mut wal_path = path.as_os_str().to_owned();
    wal_path.push("-wal");
    let io_error = open_error(dir);
    let wal = std::fs::File::open(&wal_path).map_err(io_error)?;
    wal.sync_data().map_err(io_error)?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error)?;
    Ok(Box::new(move || wal.sync_data()))
}

impl SqliteStore {
    /// Opens (creating and migrating) the database in `dir`.
    ///
    /// `scheduler` picks leases fairly; `decider` turns outcomes into
    /// transitions. Both come from `lazaret-core` through the server.
    pub fn open(
        dir: &Path,
        durability: Durability,
        scheduler: FairScheduler,
        decider: Arc<dyn Decider>,
    ) -> Result<Self, StoreError> {
        Self::open_with(dir, durability, scheduler, decider, None, COMMANDS_MAX)
    }

    /// [`SqliteStore::open`] with another bound on the commands waiting for
    /// the writer than [`COMMANDS_MAX`] (at least 1).
    pub fn open_with_commands_max(
        dir: &Path,
        durability: Durability,
        scheduler: FairScheduler,
        decider: Arc<dyn Decider>,
        commands_max: usize,
    ) -> Result<Self, StoreError> {
        Self::open_with(dir, durability, scheduler, decider, None, commands_max)
    }

    /// [`SqliteStore::open`], with `sync` in place of the WAL fsync (tests).
    fn open_with(
        dir: &Path,
        durability: Durability,
        scheduler: FairScheduler,
        decider: Arc<dyn Decider>,
        sync: Option<sync::SyncFn>,
        commands_max: usize,
    ) -> Result<Self, StoreError> {
        std::fs::create_dir_all(dir).map_err(open_error(dir))?;
        let lock = lock_dir(dir)?;
        let path = dir.join(DB_FILE);
        let new = check_db_file(&path)?;
        let opened = open_conn(&path).and_then(|conn| {
            schema::migrate(&conn)?;
            let reader = open_conn(&path)?;
            let mut w = writer::Writer::new(conn, scheduler, decider)?;
            w.rebuild_counts()?;
            Ok((reader, w))
        });
        let (reader, mut w) = match opened {
            Ok(opened) => opened,
            Err(e) => {
                if new {
                    // A new database that could not be set up (a full disk,
                    // say) must not stay behind as an empty file, which the
                    // next start would refuse as a truncated database.
                    remove_if_empty(&path);
                }
                return Err(corrupt_error(&path, e));
            }
        };
        let failure = sync::Failure::default();
        if durability == Durability::Full {
            let sync = match sync {
                Some(f) => f,
                None => wal_sync(dir, &path)?,
            };
            let syncer =
                sync::Syncer::start(sync, Arc::clone(&failure)).map_err(open_error(dir))?;
            w.set_syncer(syncer);
        }
        // Checkpoints run beside the writer (see `checkpoint`); its own
        // automatic one only bounds the WAL.
        let started = open_conn(&path)
            .map_err(|e| corrupt_error(&path, e))
            .and_then(|conn| {
                checkpoint::Checkpointer::start(conn, Arc::clone(&failure)).map_err(open_error(dir))
            })?;
        w.set_checkpointer(started)?;
        let (tx, rx) = mpsc::channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let inbox = writer::Inbox {
            rx,
            waiting: Arc::clone(&waiting),
        };
        let died = Arc::clone(&failure);
        let handle = std::thread::Builder::new()
            .name("lazaret-sqlite-writer".into())
            .spawn(move || {
                // The writer's connection closes when `run` returns (or
                // unwinds); only then may another store take the directory.
                let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.run(inbox)));
                if let Err(panic) = ran {
                    let what = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "no message".into());
                    let _ = died.set(format!(
                        "the store's writer thread stopped (it panicked: {what}), so nothing more can be written; \
                         what was committed before is safe in the database: restart lazaret, and report the panic"
                    ));
                    tracing::error!(panic = %what, "the store's writer thread panicked; the store takes no more writes");
                }
                drop(lock);
            })
            .map_err(open_error(dir))?;
        Ok(StoreOn::new(Sqlite {
            tx,
            waiting,
            commands_max: commands_max.max(1),
            reader: Arc::new(Mutex::new(reader)),
            writer: Mutex::new(Some(handle)),
            path,
            closed: AtomicBool::new(false),
            failure,
        }))
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.backend.path
    }

    /// Commands sent to the writer that it has not taken yet (at most
    /// [`COMMANDS_MAX`] of them requests).
    pub fn commands_waiting(&self) -> usize {
        self.backend.waiting.load(Ordering::Acquire)
    }

    /// Holds the writer until the returned sender is dropped (or sends);
    /// returns once the writer is held, so commands sent meanwhile wait in
    /// the queue. For tests of a busy store.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn hold_writer(&self) -> mpsc::Sender<()> {
        let (held, is_held) = mpsc::channel();
        let (resume, until) = mpsc::channel();
        self.backend.waiting.fetch_add(1, Ordering::AcqRel);
        self.backend
            .tx
            .send(Cmd::Hold(held, until))
            .expect("the writer runs");
        is_held.recv().expect("the writer holds");
        resume
    }

    /// Makes the writer thread panic, as a bug in it would, and waits until
    /// it is gone. For tests of a dead writer.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn crash_writer(&self) {
        self.backend.waiting.fetch_add(1, Ordering::AcqRel);
        let _ = self.backend.tx.send(Cmd::Crash);
        let handle = self.backend.writer.lock().ok().and_then(|mut h| h.take());
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

impl Sqlite {
    /// Sends a command to the writer; [`StoreError::Overloaded`] at once
    /// when `bounded` and [`COMMANDS_MAX`] commands wait already (requests;
    /// housekeeping and close must run however busy the store is).
    fn send(&self, cmd: Cmd, bounded: bool) -> Result<(), StoreError> {
        let before = self.waiting.fetch_add(1, Ordering::AcqRel);
        if bounded && before >= self.commands_max {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Overloaded { waiting: before });
        }
        if self.tx.send(cmd).is_err() {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(self.gone());
        }
        Ok(())
    }

    /// Why the writer takes no command: it died (the failure says so), or
    /// the store was closed.
    fn gone(&self) -> StoreError {
        match self.failure.get() {
            Some(why) => StoreError::NotApplied(why.clone()),
            None => StoreError::Closed,
        }
    }

    async fn read<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(StoreError::Closed);
        }
        let reader = Arc::clone(&self.reader);
        tokio::task::spawn_blocking(move || {
            let conn = reader.lock().map_err(|_| StoreError::Closed)?;
            f(&conn)
        })
        .await
        .map_err(|_| StoreError::Closed)?
    }
}

impl Drop for Sqlite {
    /// Stops the writer and waits for it: it runs what was already sent,
    /// closes its connection and releases the directory's lock, so the
    /// directory can be opened again as soon as the store is gone. (`close`
    /// is the graceful way, with a checkpoint; after it this does nothing.)
    fn drop(&mut self) {
        drop(std::mem::replace(&mut self.tx, mpsc::channel().0));
        let handle = self.writer.get_mut().ok().and_then(Option::take);
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

/// The reads of the table ([`with_reads`](crate::backend::with_reads)):
/// each runs `reader::method(conn, &argument, ..)` on the reader
/// connection's thread.
macro_rules! read_on_reader {
    ([] $($method:ident($($arg:ident: $ty:ty),* $(,)?) -> $answer:ty;)*) => {
        $(async fn $method(&self, $($arg: $ty),*) -> Result<$answer, StoreError> {
            self.read(move |c| reader::$method(c, $(&$arg),*)).await
        })*
    };
}

impl Backend for Sqlite {
    // Its reads, each run on the reader connection's thread.
    crate::backend::with_reads!(read_on_reader);

    fn submit(&self, r: crate::request::Request) -> Result<(), StoreError> {
        let bounded = !r.is_housekeeping();
        self.send(Cmd::Request(r), bounded)
    }

    fn gone(&self) -> StoreError {
        Sqlite::gone(self)
    }

    async fn signal_readings(
        &self,
        now: lazaret_core::Timestamp,
    ) -> Result<crate::signals::Readings, StoreError> {
        self.read(move |c| reader::signal_readings(c, now)).await
    }

    /// The writer takes one-row commands in the order they were sent
    /// (`writer::Queue`), and `enqueue` sends its command at the first
    /// poll; a lease is answered at its commit once its token is reserved
    /// on disk (`sync`).
    fn orders_one_job_commands(&self) -> bool {
        true
    }

    fn failure(&self) -> Option<String> {
        self.failure.get().cloned()
    }

    async fn close(&self) -> Result<(), StoreError> {
        self.closed.store(true, Ordering::Release);
        let (reply, answer) = crate::request::Reply::new();
        let r = match self.send(Cmd::Close(reply), false) {
            Ok(()) => answer.await.map_err(|_| self.gone()).and_then(|r| r),
            Err(e) => Err(e),
        };
        if let Err(StoreError::NotDurable(_)) = &r {
            // After a failed fsync the last connection to close must not
            // checkpoint either (see `writer::Writer::close`).
            if let Ok(reader) = self.reader.lock() {
                let _ = reader.set_db_config(
                    rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE,
                    true,
                );
            }
        }
        let handle = self.writer.lock().ok().and_then(|mut h| h.take());
        if let Some(handle) = handle {
            let _ = tokio::task::spawn_blocking(move || handle.join()).await;
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use lazaret_core::{Envelope, Event, JobId, SchedulerConfig, Timestamp, Transition};
    use tokio::sync::oneshot;

    use super::*;
    use crate::{Completion, EnqueueOutcome, LeaseRequest, NewJob, Store};

    /// These tests only enqueue: nothing is ever decided.
    struct NoDecisions;

    impl Decider for NoDecisions {
        fn decide(&self, _: &mut Envelope, _: Event, _: Timestamp) -> Transition {
            unreachable!("an enqueue decides nothing")
        }
    }

    fn open(dir: &Path, sync: sync::SyncFn) -> SqliteStore {
        let scheduler = FairScheduler::new(SchedulerConfig::new(10)).expect("scheduler");
        SqliteStore::open_with(
            dir,
            Durability::Full,
            scheduler,
            Arc::new(NoDecisions),
            Some(sync),
            COMMANDS_MAX,
        )
        .expect("open")
    }

    pub(super) fn job(key: &str) -> NewJob {
        NewJob {
            job_type: "t".into(),
            tenant: "acme".into(),
            lane: "default".into(),
            payload: br#"{"n":1}"#.to_vec(),
            idempotency_key: Some(key.into()),
            schema_version: None,
            run_at: Timestamp::from_millis(0),
            now: Timestamp::from_millis(0),
            enqueued_by: None,
            traceparent: None,
        }
    }

    /// A store whose every fsync waits for one message on the returned
    /// sender (and fails once it is dropped).
    fn open_gated(dir: &Path) -> (Arc<SqliteStore>, mpsc::Sender<()>) {
        let (gate, opened) = mpsc::channel::<()>();
        let s = open(
            dir,
            Box::new(move || {
                opened
                    .recv()
                    .map_err(|_| std::io::Error::other("gate dropped"))
            }),
        );
        (Arc::new(s), gate)
    }

    #[tokio::test]
    async fn an_enqueue_is_answered_only_after_the_fsync_of_its_commit() {
        let dir = tempfile::TempDir::new().unwrap();
        let (s, gate) = open_gated(dir.path());
        let s2 = Arc::clone(&s);
        let answer = tokio::spawn(async move { s2.enqueue(vec![job("k1")]).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!answer.is_finished(), "answered before the fsync");
        gate.send(()).unwrap();
        let out = answer.await.unwrap().expect("enqueued");
        assert!(
            matches!(out[..], [EnqueueOutcome::Created { .. }]),
            "{out:?}"
        );
        gate.send(()).unwrap();
        s.close().await.unwrap();
    }

    fn lease_one() -> LeaseRequest {
        LeaseRequest {
            worker_id: "w-1".into(),
            lanes: None,
            types: None,
            exclude_types: Vec::new(),
            exclude_lanes: Vec::new(),
            type_limits: Vec::new(),
            max_jobs: 1,
            lease: Duration::from_secs(30),
            now: Timestamp::from_millis(0),
        }
    }

    #[tokio::test]
    async fn a_lease_is_answered_at_commit_once_its_token_is_reserved_on_disk() {
        let dir = tempfile::TempDir::new().unwrap();
        let (s, gate) = open_gated(dir.path());
        let s2 = Arc::clone(&s);
        let enqueued = tokio::spawn(async move { s2.enqueue(vec![job("k1"), job("k2")]).await });
        gate.send(()).unwrap();
        enqueued.await.unwrap().expect("enqueued");

        // The first lease writes the first reservation: it waits for its fsync.
        let s2 = Arc::clone(&s);
        let first = tokio::spawn(async move { s2.lease(lease_one()).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !first.is_finished(),
            "answered before its reservation was on disk"
        );
        gate.send(()).unwrap();
        let first = first.await.unwrap().expect("leased");

        // The next is answered with no fsync at all (the gate stays shut).
        let second = tokio::time::timeout(Duration::from_secs(10), s.lease(lease_one()))
            .await
            .expect("answered at COMMIT, without waiting for an fsync")
            .expect("leased");
        assert_eq!((first.len(), second.len()), (1, 1));
        assert_ne!(first[0].id, second[0].id);
        assert!(
            second[0].lease_token.0 > first[0].lease_token.0,
            "one sequence: {:?} then {:?}",
            first[0].lease_token,
            second[0].lease_token
        );

        // An ack still waits for its fsync.
        let s2 = Arc::clone(&s);
        let (id, token) = (second[0].id, second[0].lease_token);
        let acked = tokio::spawn(async move {
            s2.complete(
                vec![Completion {
                    id,
                    token,
                    event: Event::Succeeded,
                }],
                Timestamp::from_millis(1),
            )
            .await
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!acked.is_finished(), "an ack answered before its fsync");
        // The fsync the early lease asked for, then the ack's.
        gate.send(()).unwrap();
        gate.send(()).unwrap();
        let acked = acked.await.unwrap().expect("acked");
        assert!(acked[0].is_ok(), "{acked:?}");
        drop(gate);
        let _ = s.close().await;
    }

    #[tokio::test]
    async fn a_lease_goes_out_at_once_even_when_its_jobs_enqueue_is_not_on_disk() {
        let dir = tempfile::TempDir::new().unwrap();
        // Each fsync says it is waiting, then waits for the gate: the warm-up
        // below lets through exactly the fsyncs asked for, none to spare.
        let (gate, opened) = mpsc::channel::<()>();
        let (asks, asked) = mpsc::channel::<()>();
        let s = Arc::new(open(
            dir.path(),
            Box::new(move || {
                let _ = asks.send(());
                opened
                    .recv()
                    .map_err(|_| std::io::Error::other("gate dropped"))
            }),
        ));
        // A first enqueue and lease put both reservations on disk.
        let s2 = Arc::clone(&s);
        let warm = tokio::spawn(async move {
            s2.enqueue(vec![job("k0")]).await.unwrap();
            s2.lease(lease_one()).await.unwrap()
        });
        while !warm.is_finished() {
            while asked.try_recv().is_ok() {
                gate.send(()).unwrap();
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        warm.await.unwrap();

        // This enqueue's commit is not flushed (the gate stays shut) ...
        let s2 = Arc::clone(&s);
        let enqueued = tokio::spawn(async move { s2.enqueue(vec![job("k1")]).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!enqueued.is_finished());
        // ... but its id is below the reservation on disk: a power loss
        // cannot give the id to another job, so its lease goes out at once.
        let leased = tokio::time::timeout(Duration::from_secs(10), s.lease(lease_one()))
            .await
            .expect("answered at COMMIT")
            .expect("leased");
        assert_eq!(leased.len(), 1);
        drop(gate);
        let _ = s.close().await;
    }

    #[tokio::test]
    async fn a_restart_issues_tokens_above_every_earlier_one() {
        let dir = tempfile::TempDir::new().unwrap();
        let s = open(dir.path(), Box::new(|| Ok(())));
        s.enqueue(vec![job("k1"), job("k2")]).await.unwrap();
        let before = s.lease(lease_one()).await.unwrap();
        drop(s);
        let s = open(dir.path(), Box::new(|| Ok(())));
        let after = s.lease(lease_one()).await.unwrap();
        // The first start reserved a block of tokens past the first; the
        // restart continues from the end of that block, not from what the
        // jobs table shows.
        assert_eq!(before[0].lease_token.0, 1 << 40);
        assert_eq!(
            after[0].lease_token.0,
            (1 << 40) + sequence::TOKENS.1,
            "{after:?}"
        );
        // Job ids continue from their reservation the same way.
        let out = s.enqueue(vec![job("k3")]).await.unwrap();
        assert!(
            matches!(out[..], [EnqueueOutcome::Created { id, .. }] if id.0 == 1 + sequence::JOB_IDS.1),
            "{out:?}"
        );
        s.close().await.unwrap();
    }

    /// Runs `sql` on the writer once `gate` opens (a dropped sender opens it).
    fn sql(
        s: &SqliteStore,
        sql: &str,
        gate: mpsc::Receiver<()>,
    ) -> oneshot::Receiver<Result<(), StoreError>> {
        let (tx, rx) = crate::request::Reply::new();
        s.backend.waiting.fetch_add(1, Ordering::AcqRel);
        s.backend
            .tx
            .send(Cmd::Sql(sql.into(), gate, tx))
            .expect("writer running");
        rx
    }

    fn open_gate() -> mpsc::Receiver<()> {
        mpsc::channel().1
    }

    fn enqueue_cmd(
        s: &SqliteStore,
        key: &str,
    ) -> oneshot::Receiver<Result<Vec<EnqueueOutcome>, StoreError>> {
        let (reply, rx) = crate::request::Reply::new();
        s.backend.waiting.fetch_add(1, Ordering::AcqRel);
        s.backend
            .tx
            .send(Cmd::Request(crate::request::Request::Enqueue {
                jobs: vec![job(key)],
                reply,
            }))
            .expect("writer running");
        rx
    }

    #[tokio::test]
    async fn when_sqlite_rolls_a_whole_group_back_what_follows_runs_in_a_new_transaction() {
        let dir = tempfile::TempDir::new().unwrap();
        let s = open(dir.path(), Box::new(|| Ok(())));
        // A failing command rolls its group back; the next groups run with
        // a savepoint per command.
        let failed = sql(&s, "SELECT no_such_column", open_gate()).await.unwrap();
        assert!(failed.is_err());

        // Three commands queue while the writer is held, so they share a
        // group; the middle one ends the transaction, as SQLite does by
        // itself after some disk-full and I/O errors, and then fails.
        let (release, held) = mpsc::channel();
        let pause = sql(&s, "SELECT 1", held);
        let first = enqueue_cmd(&s, "k1");
        let breaker = sql(&s, "ROLLBACK; SELECT no_such_column", open_gate());
        let after = enqueue_cmd(&s, "k2");
        release.send(()).unwrap();
        let _ = pause.await.unwrap();
        assert!(breaker.await.unwrap().is_err());
        // The command before it is undone with it; the one queued behind it
        // runs in a transaction of its own, after the rollback.
        let first = first.await.unwrap();
        assert!(
            matches!(first, Err(StoreError::NotApplied(_))),
            "k1: {first:?}"
        );
        let after = after.await.unwrap();
        assert!(
            matches!(after.as_deref(), Ok([EnqueueOutcome::Created { .. }])),
            "k2: {after:?}"
        );
        // The database says the same: k1 is new, k2 is there.
        let out = s.enqueue(vec![job("k1"), job("k2")]).await.unwrap();
        assert!(
            matches!(
                out[..],
                [
                    EnqueueOutcome::Created { .. },
                    EnqueueOutcome::Duplicate { .. }
                ]
            ),
            "{out:?}"
        );
        s.close().await.unwrap();
    }

    /// Committed jobs reach the database file without the writer running
    /// a checkpoint: its own automatic one waits for a WAL far larger than
    /// these, so the file grows only by the checkpoint thread's copies.
    #[tokio::test]
    async fn the_checkpoint_thread_copies_commits_into_the_database() {
        let dir = tempfile::TempDir::new().unwrap();
        let s = open(dir.path(), Box::new(|| Ok(())));
        let db_len = || std::fs::metadata(dir.path().join(DB_FILE)).unwrap().len();
        let before = db_len();
        let jobs: Vec<NewJob> = (0..2000).map(|i| job(&format!("k{i}"))).collect();
        s.enqueue(jobs).await.expect("enqueued");
        let wal = std::fs::metadata(dir.path().join(format!("{DB_FILE}-wal")))
            .unwrap()
            .len();
        assert!(
            wal < u64::from(checkpoint::WRITER_AUTOCHECKPOINT_PAGES) * 1024,
            "the WAL ({wal} bytes) is far below the writer's own checkpoint"
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while db_len() <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "the database file stayed at {before} bytes: nothing checkpointed the WAL"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        s.close().await.unwrap();
    }

    /// Two bulk enqueues wait in the queue before a one-job enqueue: the
    /// small one runs first (ids are issued in the order commands run), and
    /// all three are applied.
    #[tokio::test]
    async fn a_small_command_runs_before_bulk_commands_queued_ahead_of_it() {
        let dir = tempfile::TempDir::new().unwrap();
        let s = Arc::new(open(dir.path(), Box::new(|| Ok(()))));
        let bulk = |prefix: &str| -> Vec<NewJob> {
            (0..=writer::BULK_ROWS)
                .map(|i| job(&format!("{prefix}-{i}")))
                .collect()
        };
        let resume = s.hold_writer();
        let send = |jobs: Vec<NewJob>| {
            let s = Arc::clone(&s);
            tokio::spawn(async move { s.enqueue(jobs).await })
        };
        let first = send(bulk("a"));
        while s.backend.waiting.load(Ordering::Acquire) < 1 {
            tokio::task::yield_now().await;
        }
        let second = send(bulk("b"));
        while s.backend.waiting.load(Ordering::Acquire) < 2 {
            tokio::task::yield_now().await;
        }
        let small = send(vec![job("small")]);
        while s.backend.waiting.load(Ordering::Acquire) < 3 {
            tokio::task::yield_now().await;
        }
        drop(resume);
        let id = |o: &EnqueueOutcome| match o {
            EnqueueOutcome::Created { id, .. } => id.0,
            other => panic!("not created: {other:?}"),
        };
        let small = small.await.unwrap().expect("applied");
        let (first, second) = (
            first.await.unwrap().expect("applied"),
            second.await.unwrap().expect("applied"),
        );
        assert_eq!(
            (first.len(), second.len()),
            (writer::BULK_ROWS + 1, writer::BULK_ROWS + 1)
        );
        let bulk_ids: Vec<u64> = first.iter().chain(&second).map(id).collect();
        assert!(
            bulk_ids.iter().all(|&b| id(&small[0]) < b),
            "the small enqueue ({}) ran after bulk ones ({bulk_ids:?})",
            id(&small[0])
        );
        // The bulk commands kept their own order.
        assert!(bulk_ids.windows(2).all(|w| w[0] < w[1]), "{bulk_ids:?}");
        s.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_full_command_queue_refuses_at_once_and_applies_nothing() {
        let dir = tempfile::TempDir::new().unwrap();
        let scheduler = FairScheduler::new(SchedulerConfig::new(10)).expect("scheduler");
        let s = Arc::new(
            SqliteStore::open_with(
                dir.path(),
                Durability::Full,
                scheduler,
                Arc::new(NoDecisions),
                Some(Box::new(|| Ok(()))),
                2,
            )
            .expect("open"),
        );
        // The writer is busy; two requests wait for it: the bound.
        let resume = s.hold_writer();
        let queued: Vec<_> = ["k1", "k2"]
            .into_iter()
            .map(|key| {
                let s = Arc::clone(&s);
                tokio::spawn(async move { s.enqueue(vec![job(key)]).await })
            })
            .collect();
        while s.backend.waiting.load(Ordering::Acquire) < 2 {
            tokio::task::yield_now().await;
        }
        let refused = s
            .enqueue(vec![job("k3")])
            .await
            .expect_err("over the bound");
        assert!(
            matches!(refused, StoreError::Overloaded { waiting: 2 }),
            "{refused:?}"
        );
        assert!(
            refused
                .to_string()
                .contains("nothing of this request was applied"),
            "{refused}"
        );
        // Housekeeping is never refused: it waits its turn.
        let s2 = Arc::clone(&s);
        let tick = tokio::spawn(async move { s2.tick(Timestamp::from_millis(0)).await });

        drop(resume);
        for q in queued {
            let out = q.await.unwrap().expect("the waiting requests run");
            assert!(
                matches!(out[..], [EnqueueOutcome::Created { .. }]),
                "{out:?}"
            );
        }
        tick.await.unwrap().expect("the tick ran");
        // The refused enqueue left nothing behind: its key is new.
        let out = s.enqueue(vec![job("k3"), job("k1")]).await.unwrap();
        assert!(
            matches!(
                out[..],
                [
                    EnqueueOutcome::Created { .. },
                    EnqueueOutcome::Duplicate { .. }
                ]
            ),
            "{out:?}"
        );
        assert_eq!(s.backend.waiting.load(Ordering::Acquire), 0);
        s.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_writer_that_dies_is_reported_and_refuses_every_write() {
        let dir = tempfile::TempDir::new().unwrap();
        let s = open(dir.path(), Box::new(|| Ok(())));
        s.enqueue(vec![job("k1")]).await.unwrap();
        assert_eq!(s.failure(), None);
        s.crash_writer();
        let why = s.failure().expect("the store reports its dead writer");
        assert!(
            why.contains("writer thread stopped") && why.contains("restart lazaret"),
            "{why}"
        );
        let refused = s.enqueue(vec![job("k2")]).await.expect_err("no writer");
        assert!(
            matches!(refused, StoreError::NotApplied(ref m) if m == &why),
            "{refused:?}"
        );
        // Reads still work: what was committed is there.
        assert!(s.job(JobId(1)).await.unwrap().is_some());
        drop(s);
        // A restart takes writes again, with the job committed before.
        let s = open(dir.path(), Box::new(|| Ok(())));
        let out = s.enqueue(vec![job("k1")]).await.unwrap();
        assert!(
            matches!(out[..], [EnqueueOutcome::Duplicate { .. }]),
            "{out:?}"
        );
        s.close().await.unwrap();
    }

    #[tokio::test]
    async fn after_a_failed_fsync_the_store_refuses_writes_until_restarted() {
        let dir = tempfile::TempDir::new().unwrap();
        let s = open(
            dir.path(),
            Box::new(|| Err(std::io::Error::other("EIO from the test disk"))),
        );
        let first = s.enqueue(vec![job("k1")]).await.expect_err("not durable");
        assert!(
            matches!(first, StoreError::NotDurable(ref m) if m.contains("EIO from the test disk") && m.contains("restart")),
            "{first}"
        );
        assert_eq!(
            s.failure().as_deref(),
            Some(first.to_string().as_str()),
            "the store reports why it stopped writing"
        );
        let second = s.enqueue(vec![job("k2")]).await.expect_err("refused");
        assert!(
            matches!(second, StoreError::NotApplied(ref m) if m.contains("nothing of this request was applied") && m.contains("restart")),
            "{second}"
        );
        let closed = s
            .close()
            .await
            .expect_err("closing says the WAL was left as it is");
        assert!(
            matches!(closed, StoreError::NotDurable(ref m) if m.contains("without a checkpoint")),
            "{closed}"
        );

        // A restart on a healthy disk takes writes again; the refused
        // enqueue was never applied, the unsynced one was committed (and,
        // the WAL being left unchecked at close, recovered at open).
        let s = open(dir.path(), Box::new(|| Ok(())));
        assert_eq!(s.failure(), None);
        let out = s.enqueue(vec![job("k1"), job("k2")]).await.unwrap();
        assert!(
            matches!(
                out[..],
                [
                    EnqueueOutcome::Duplicate { .. },
                    EnqueueOutcome::Created { .. }
                ]
            ),
            "{out:?}"
        );
        s.close().await.unwrap();
    }
}
