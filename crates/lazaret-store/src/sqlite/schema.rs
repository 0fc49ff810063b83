//! The SQLite schema, created and migrated by the binary itself.

use rusqlite::Connection;

/// The schema version this build writes; `PRAGMA user_version` records it.
pub const SCHEMA_VERSION: i64 = 1;

const V1: &str = r#"
CREATE TABLE IF NOT EXISTS jobs (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    type             TEXT    NOT NULL,
    tenant           TEXT    NOT NULL,
    lane             TEXT    NOT NULL,
    state            TEXT    NOT NULL,  -- JobState words: queued, scheduled, leased, succeeded, dead_lettered
    run_at           INTEGER NOT NULL,  -- ms since the epoch
    attempts         INTEGER NOT NULL,
    lease_token      INTEGER,
    lease_expires_at INTEGER,
    idempotency_key  TEXT,
    created_at       INTEGER NOT NULL,
    finished_at      INTEGER,
    envelope         TEXT    NOT NULL,  -- lazaret_core::Envelope as JSON: counters and history
    payload          BLOB    NOT NULL   -- the raw JSON text, byte for byte
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (tenant, type, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_ready  ON jobs (lane, tenant, run_at, id) WHERE state = 'queued';
CREATE INDEX IF NOT EXISTS jobs_due    ON jobs (run_at)                   WHERE state = 'scheduled';
CREATE INDEX IF NOT EXISTS jobs_leases ON jobs (lease_expires_at)         WHERE state = 'leased';
CREATE INDEX IF NOT EXISTS jobs_done   ON jobs (finished_at)              WHERE state = 'succeeded';

CREATE TABLE IF NOT EXISTS dead_letters (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id           INTEGER,           -- NULL for admission records
    type             TEXT,
    tenant           TEXT,
    lane             TEXT,
    reason           TEXT    NOT NULL,
    stage            TEXT    NOT NULL,  -- admission | processing
    attempts         INTEGER NOT NULL,
    error            TEXT,              -- lazaret_core::Failure as JSON
    idempotency_key  TEXT,
    created_at       INTEGER NOT NULL,
    dead_lettered_at INTEGER NOT NULL,
    payload_size     INTEGER NOT NULL,
    payload_sha256   TEXT,
    payload_preview  TEXT    NOT NULL,
    payload          BLOB               -- admission records only; processing ones read the job's
);
CREATE INDEX IF NOT EXISTS dead_letters_reason ON dead_letters (reason, type);
CREATE UNIQUE INDEX IF NOT EXISTS dead_letters_job ON dead_letters (job_id) WHERE job_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS audit (
    id      INTEGER PRIMARY KEY AUTOINCREMENT,
    at      INTEGER NOT NULL,
    actor   TEXT    NOT NULL,
    action  TEXT    NOT NULL,
    request TEXT    NOT NULL,
    count   INTEGER NOT NULL
);
"#;

/// Creates or migrates the schema; refuses a database from a newer build.
pub fn migrate(conn: &Connection) -> Result<(), crate::StoreError> {
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(crate::StoreError::Corrupt(format!(
            "the database has schema version {version}, newer than this build's {SCHEMA_VERSION}; run a newer lazaret"
        )));
    }
    if version < 1 {
        conn.execute_batch(V1)?;
        conn.execute_batch(&format!("PRAGMA user_version = {SCHEMA_VERSION}"))?;
    }
    Ok(())
}
