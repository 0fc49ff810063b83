//! The embedded store: one SQLite file in WAL mode, one writer thread with
//! group commit, one reader connection.
//!
//! Writes from concurrent requests queue on a channel; the writer thread
//! takes everything pending, runs it in one `BEGIN IMMEDIATE … COMMIT`
//! (each command in its own savepoint, so one failing command does not undo
//! the others), and only then answers. With `synchronous = FULL` that commit
//! is one fsync for the whole group: durability does not cost one fsync per
//! job, and nothing is answered before it is durable.

mod reader;
mod schema;
mod stored;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::thread::JoinHandle;

use lazaret_core::{FairScheduler, JobId, Timestamp};
use rusqlite::Connection;
use tokio::sync::oneshot;

use crate::{
    AdmissionRecord, AuditEntry, Completed, Completion, DeadLetter, DeadLetterFilter, DeadLetterId,
    Decider, EnqueueOutcome, ItemError, JobView, LeaseRequest, LeaseToken, LeasedJob, NewJob,
    ReasonCount, Selector, Stage, Store, StoreError, StoreStats, Tick,
};

pub use schema::SCHEMA_VERSION;
use writer::Cmd;

/// How hard a commit holds on to the disk.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Durability {
    /// `synchronous = FULL`: a commit survives power loss. The default.
    #[default]
    Full,
    /// `synchronous = NORMAL`: survives a process crash; the last commits may
    /// be lost on power loss. Faster; named for what it is.
    Normal,
}

/// The file name inside the data directory.
pub const DB_FILE: &str = "lazaret.db";

/// The SQLite [`Store`].
#[derive(Debug)]
pub struct SqliteStore {
    tx: mpsc::Sender<Cmd>,
    reader: Arc<Mutex<Connection>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    path: PathBuf,
    closed: AtomicBool,
}

fn open_conn(path: &Path, durability: Durability) -> Result<Connection, StoreError> {
    let conn = Connection::open(path)?;
    let sync = match durability {
        Durability::Full => "FULL",
        Durability::Normal => "NORMAL",
    };
    conn.execute_batch(&format!(
        "PRAGMA journal_mode = WAL;
         PRAGMA synchronous = {sync};
         PRAGMA busy_timeout = 10000;
         PRAGMA cache_size = -16000;
         PRAGMA temp_store = MEMORY;"
    ))?;
    Ok(conn)
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
        std::fs::create_dir_all(dir).map_err(|source| StoreError::Open {
            path: dir.display().to_string(),
            source,
        })?;
        let path = dir.join(DB_FILE);
        let conn = open_conn(&path, durability)?;
        schema::migrate(&conn)?;
        let reader = open_conn(&path, durability)?;
        let mut w = writer::Writer::new(conn, scheduler, decider)?;
        w.rebuild_counts()?;
        let (tx, rx) = mpsc::channel();
        let handle = std::thread::Builder::new()
            .name("lazaret-sqlite-writer".into())
            .spawn(move || w.run(rx))
            .map_err(|source| StoreError::Open {
                path: dir.display().to_string(),
                source,
            })?;
        Ok(SqliteStore {
            tx,
            reader: Arc::new(Mutex::new(reader)),
            writer: Mutex::new(Some(handle)),
            path,
            closed: AtomicBool::new(false),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Cmd,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(make(tx)).map_err(|_| StoreError::Closed)?;
        rx.await.map_err(|_| StoreError::Closed)?
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

impl Store for SqliteStore {
    async fn enqueue(&self, jobs: Vec<NewJob>) -> Result<Vec<EnqueueOutcome>, StoreError> {
        self.call(|tx| Cmd::Enqueue(jobs, tx)).await
    }

    async fn lease(&self, req: LeaseRequest) -> Result<Vec<LeasedJob>, StoreError> {
        self.call(|tx| Cmd::Lease(req, tx)).await
    }

    async fn complete(
        &self,
        items: Vec<Completion>,
        now: Timestamp,
    ) -> Result<Vec<Result<Completed, ItemError>>, StoreError> {
        self.call(|tx| Cmd::Complete(items, now, tx)).await
    }

    async fn heartbeat(
        &self,
        id: JobId,
        token: LeaseToken,
        expires_at: Timestamp,
    ) -> Result<Result<Timestamp, ItemError>, StoreError> {
        self.call(|tx| Cmd::Heartbeat(id, token, expires_at, tx))
            .await
    }

    async fn tick(&self, now: Timestamp) -> Result<Tick, StoreError> {
        self.call(|tx| Cmd::Tick(now, tx)).await
    }

    async fn record_admission(&self, rec: AdmissionRecord) -> Result<DeadLetterId, StoreError> {
        self.call(|tx| Cmd::RecordAdmission(rec, tx)).await
    }

    async fn job(&self, id: JobId) -> Result<Option<JobView>, StoreError> {
        self.read(move |c| reader::job(c, id)).await
    }

    async fn dead_letters(
        &self,
        filter: DeadLetterFilter,
        limit: u32,
        cursor: Option<DeadLetterId>,
    ) -> Result<(Vec<DeadLetter>, Option<DeadLetterId>), StoreError> {
        self.read(move |c| reader::dead_letters(c, &filter, limit, cursor))
            .await
    }

    async fn dead_letter(&self, id: DeadLetterId) -> Result<Option<DeadLetter>, StoreError> {
        self.read(move |c| reader::dead_letter(c, id)).await
    }

    async fn dead_letter_payload(
        &self,
        id: DeadLetterId,
    ) -> Result<Option<Option<Vec<u8>>>, StoreError> {
        self.read(move |c| reader::dead_letter_payload(c, id)).await
    }

    async fn reasons(&self) -> Result<Vec<ReasonCount>, StoreError> {
        self.read(reader::reasons).await
    }

    async fn match_dead_letters(
        &self,
        selector: Selector,
    ) -> Result<Vec<(DeadLetterId, Stage)>, StoreError> {
        self.read(move |c| reader::match_dead_letters(c, &selector))
            .await
    }

    async fn redrive(
        &self,
        ids: Vec<DeadLetterId>,
        now: Timestamp,
    ) -> Result<Vec<JobId>, StoreError> {
        self.call(|tx| Cmd::Redrive(ids, now, tx)).await
    }

    async fn purge(&self, ids: Vec<DeadLetterId>) -> Result<u64, StoreError> {
        self.call(|tx| Cmd::Purge(ids, tx)).await
    }

    async fn audit(&self, entry: AuditEntry) -> Result<(), StoreError> {
        self.call(|tx| Cmd::Audit(entry, tx)).await
    }

    async fn audit_log(&self, limit: u32) -> Result<Vec<AuditEntry>, StoreError> {
        self.read(move |c| reader::audit_log(c, limit)).await
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        self.call(Cmd::Stats).await
    }

    async fn remove_succeeded(&self, before: Timestamp, batch: u32) -> Result<u64, StoreError> {
        self.call(|tx| Cmd::RemoveSucceeded(before, batch, tx))
            .await
    }

    async fn create_token(
        &self,
        token: crate::ApiToken,
        audit: AuditEntry,
    ) -> Result<Result<(), crate::TokenError>, StoreError> {
        self.call(|tx| Cmd::CreateToken(token, audit, tx)).await
    }

    async fn revoke_token(&self, name: String, audit: AuditEntry) -> Result<bool, StoreError> {
        self.call(|tx| Cmd::RevokeToken(name, audit, tx)).await
    }

    async fn tokens(&self) -> Result<Vec<crate::ApiToken>, StoreError> {
        self.read(reader::tokens).await
    }

    async fn close(&self) -> Result<(), StoreError> {
        self.closed.store(true, Ordering::Release);
        let r = self.call(Cmd::Close).await;
        let handle = self.writer.lock().ok().and_then(|mut h| h.take());
        if let Some(handle) = handle {
            let _ = tokio::task::spawn_blocking(move || handle.join()).await;
        }
        r
    }
}
