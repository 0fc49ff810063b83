//! Checkpoints off the writer thread.
//!
//! SQLite's automatic checkpoint runs inside the COMMIT that pushes the WAL
//! past its threshold: the writer then copies the WAL into the database and
//! waits for two fsyncs, and every command queued behind it waits too
//! (during a 100,000-job flood that was the tail of the interactive lane's
//! latency). Here a thread of its own, on a connection of its own, runs a
//! `PASSIVE` checkpoint every [`CHECKPOINT_EVERY`]: it copies what is
//! committed and never blocks the writer, which goes on appending.
//!
//! Under writes that never pause a passive checkpoint is always a little
//! behind, and SQLite only starts the WAL over once everything in it is
//! copied; so the writer keeps an automatic checkpoint as a bound, at
//! [`WRITER_AUTOCHECKPOINT_PAGES`] instead of SQLite's 1,000, which then
//! finds almost everything copied already.
//!
//! Durability is SQLite's own either way: a checkpoint fsyncs the WAL
//! before it copies and the database after (`synchronous = NORMAL`), so
//! nothing it copies can be lost, and the WAL is only rewritten from its
//! start after such a checkpoint (see `super::sync`). After a failed fsync
//! this thread checkpoints no more: the WAL is left for recovery to verify.

use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::Connection;

use super::sync::Failure;

/// How often the checkpoint thread copies the WAL into the database.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(50);

/// How often, at most, checkpoints that keep failing are logged.
const FAILURE_LOG_EVERY: Duration = Duration::from_secs(10);

/// The writer's own automatic checkpoint, a bound on the WAL for writes
/// that never pause: 16,384 pages of 4 KiB, 64 MiB.
pub(super) const WRITER_AUTOCHECKPOINT_PAGES: u32 = 16_384;

/// The checkpoint thread; stopped (and joined) when dropped.
pub(super) struct Checkpointer {
    stop: Option<mpsc::Sender<()>>,
    handle: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Starts the thread, checkpointing on `conn` (a connection of its own).
    pub(super) fn start(conn: Connection, failure: Failure) -> std::io::Result<Checkpointer> {
        let (stop, stopped) = mpsc::channel::<()>();
        let handle = std::thread::Builder::new()
            .name("lazaret-sqlite-checkpoint".into())
            .spawn(move || {
                // Failures in a row, and when the last was logged: a full
                // disk fails every checkpoint, 20 a second, logged once per
                // `FAILURE_LOG_EVERY`.
                let mut failing: Option<(u64, std::time::Instant)> = None;
                // Ends when told to, or when the store is gone.
                while let Err(mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(CHECKPOINT_EVERY)
                {
                    if failure.get().is_some() {
                        return;
                    }
                    match conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
                        Ok(()) => {
                            if let Some((n, _)) = failing.take() {
                                tracing::info!("background checkpoints work again after {n} failed");
                            }
                        }
                        Err(e) => match &mut failing {
                            Some((n, logged)) => {
                                *n += 1;
                                if logged.elapsed() >= FAILURE_LOG_EVERY {
                                    tracing::warn!(error = %e, "background checkpoints still fail ({n} in a row); check the data directory's disk space");
                                    *logged = std::time::Instant::now();
                                }
                            }
                            None => {
                                tracing::warn!(error = %e, "a background checkpoint failed; the writer's own checkpoint still bounds the write-ahead log (further failures are logged every 10 s)");
                                failing = Some((1, std::time::Instant::now()));
                            }
                        },
                    }
                }
            })?;
        Ok(Checkpointer {
            stop: Some(stop),
            handle: Some(handle),
        })
    }

    /// Stops the thread and waits for a checkpoint under way to end.
    pub(super) fn stop(&mut self) {
        drop(self.stop.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.stop();
    }
}
