//! The SQLite schema, created and migrated by the binary itself.

use rusqlite::Connection;

/// The schema version this build writes; `PRAGMA user_version` records it.
pub const SCHEMA_VERSION: i64 = 14;

/// The current schema, for a new database (and the tables a migration adds).
const CURRENT: &str = r#"
CREATE TABLE IF NOT EXISTS jobs (
    id               INTEGER PRIMARY KEY AUTOINCREMENT,
    type             TEXT    NOT NULL,
    tenant           TEXT    NOT NULL,
    lane             TEXT    NOT NULL,
    state            TEXT    NOT NULL,  -- JobState words: queued, scheduled, leased, succeeded, dead_lettered, cancelled
    run_at           INTEGER NOT NULL,  -- ms since the epoch
    attempts         INTEGER NOT NULL,  -- authoritative; the envelope's count lags by the running attempt
    leases           INTEGER NOT NULL DEFAULT 0,  -- leases granted, never reset
    lease_token      INTEGER,           -- from the store's one sequence (meta.lease_tokens_reserved)
    lease_expires_at INTEGER,
    lease_started_at INTEGER,           -- the running (or succeeded) attempt: when it was leased
    worker_id        TEXT,              -- and by whom
    idempotency_key  TEXT,
    schema_version   INTEGER,
    redrives         INTEGER NOT NULL DEFAULT 0,
    enqueued_by      TEXT,              -- name of the token that enqueued it (NULL without auth)
    created_at       INTEGER NOT NULL,
    finished_at      INTEGER,
    envelope         TEXT,              -- lazaret_core::Envelope as JSON as of the last failure or
                                        -- redrive, NULL before the first (see sqlite::envelope)
    payload          BLOB    NOT NULL,  -- the raw JSON text, byte for byte
    cancel_requested INTEGER NOT NULL DEFAULT 0  -- 1 once a cancel was accepted (version 6)
    -- traceparent TEXT: added by v12_to_v13, on new databases too
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (tenant, type, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
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
    payload          BLOB,              -- admission records and broker messages; lazaret's jobs read the job's
    source           TEXT,              -- broker messages: SourceRef as JSON
    source_name      TEXT,              -- broker messages: the source's name
    message_id       TEXT,              -- broker messages: the message id
    envelope         TEXT,              -- broker messages: counters and history (Envelope as JSON)
    redrive_id       TEXT    NOT NULL DEFAULT '',  -- broker messages: the x-lazaret-redrive-id it carried
    group_id         TEXT    NOT NULL DEFAULT '',  -- lazaret_core::group_id (version 9)
    fingerprint      TEXT    NOT NULL DEFAULT '',  -- lazaret_core::group_fingerprint of the error message
    archived_at      INTEGER                       -- ms since the epoch; NULL while active
    -- traceparent TEXT: added by v12_to_v13, on new databases too
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

-- Store-wide values. lease_tokens_reserved: lease tokens below it may have
-- been handed out; a start continues from it (see sqlite::tokens).
CREATE TABLE IF NOT EXISTS meta (
    key   TEXT    PRIMARY KEY,
    value INTEGER NOT NULL
);

CREATE TABLE IF NOT EXISTS tokens (
    name         TEXT    PRIMARY KEY,   -- API-created tokens; [[tokens]] from the config are not stored
    role         TEXT    NOT NULL,
    token_sha256 TEXT    NOT NULL UNIQUE,
    created_at   INTEGER NOT NULL,
    created_by   TEXT    NOT NULL
);
"#;

/// What version 4 added: broker messages' dead letters are unique per
/// (source, message id), so a redelivery after a crash between quarantine
/// and acknowledgement is recognised. (Version 4 also added
/// `source_parked`, the retries of broker messages held until due, keyed
/// by (source, message id); version 7 keys it by [`MessageKey`] and creates
/// it, see [`V7_OBJECTS`].)
///
/// [`MessageKey`]: crate::MessageKey
const V4_OBJECTS: &str = r#"
CREATE UNIQUE INDEX IF NOT EXISTS dead_letters_message ON dead_letters (source_name, message_id)
    WHERE source_name IS NOT NULL;
"#;

/// What version 5 added: the ready jobs indexed by type, so that a lease
/// for some types reads only jobs of those types. It replaces version 4's
/// `jobs_ready` (lane, tenant, run_at, id): a lease of any type reads the
/// oldest of each type its (lane, tenant) has ready, and every enqueue and
/// lease keeps one ready index up to date, not two.
const V5_OBJECTS: &str = r#"
CREATE INDEX IF NOT EXISTS jobs_ready_type ON jobs (lane, tenant, type, run_at, id) WHERE state = 'queued';
DROP INDEX IF EXISTS jobs_ready;
"#;

/// What version 6 added: retention finds cancelled jobs by
/// `jobs_cancelled` as it finds succeeded ones by `jobs_done`; pauses are
/// kept in `pauses`, so a restart keeps them. (Listing jobs needs no index:
/// a page reads a bounded range of the rowid, `reader::JOBS_PAGE_ROWS_MAX`.)
const V6_OBJECTS: &str = r#"
CREATE INDEX IF NOT EXISTS jobs_cancelled ON jobs (finished_at) WHERE state = 'cancelled';
CREATE TABLE IF NOT EXISTS pauses (
    target    TEXT    NOT NULL,         -- type | lane
    name      TEXT    NOT NULL,
    paused_at INTEGER NOT NULL,         -- ms since the epoch
    paused_by TEXT    NOT NULL,         -- the token's name
    PRIMARY KEY (target, name)
);
"#;

/// What version 7 changed: a broker message's dead letter, and its held
/// retry, are unique per (source, message id, payload SHA-256, redrive
/// id), no longer per (source, message id): a different message reusing a
/// quarantined or held id (another body) is kept as a message of its own,
/// and a redriven copy (which carries a redrive id) is never taken for the
/// dead letter it was redriven from. Retries of broker messages wait until
/// they are due (in `source_parked` then, `source_held_retries` since
/// version 8: [`V8_OBJECTS`]), and are claimed by one node (`claimed_by`,
/// `claim_expires_at`) while it delivers them.
const V7_OBJECTS: &str = r#"
DROP INDEX IF EXISTS dead_letters_message;
CREATE UNIQUE INDEX IF NOT EXISTS dead_letters_message_key
    ON dead_letters (source_name, message_id, payload_sha256, redrive_id)
    WHERE source_name IS NOT NULL;
"#;

/// What version 8 changed: the held retries of broker messages are named
/// for what they are (`source_held_retries`, was `source_parked`; "park"
/// is for a type or lane held back, see docs/glossary.md). The table, as
/// version 7 keyed it, with the claim of the node delivering each.
const V8_OBJECTS: &str = r#"
CREATE TABLE IF NOT EXISTS source_held_retries (
    source         TEXT    NOT NULL,    -- the source's name
    message_id     TEXT    NOT NULL,
    payload_sha256 TEXT    NOT NULL,    -- of body, lower-case hex
    redrive_id     TEXT    NOT NULL DEFAULT '',  -- the x-lazaret-redrive-id it carried, '' for none
    due_at         INTEGER NOT NULL,    -- ms since the epoch
    ref            TEXT    NOT NULL,    -- SourceRef as JSON
    envelope       TEXT    NOT NULL,    -- Envelope as JSON
    body           BLOB    NOT NULL,
    claimed_by     TEXT,                -- the node delivering it now (claim_held_retries)
    claim_expires_at INTEGER,           -- ms since the epoch; free again from then
    PRIMARY KEY (source, message_id, payload_sha256, redrive_id)
);
CREATE INDEX IF NOT EXISTS source_held_retries_due ON source_held_retries (source, due_at);
"#;

/// Version 7 → 8: the held retries' table is renamed with its rows (SQLite
/// renames no index: the old one is dropped, [`V8_OBJECTS`] creates the
/// new one).
const V7_TO_V8: &str = r#"
ALTER TABLE source_parked RENAME TO source_held_retries;
DROP INDEX IF EXISTS source_parked_due;
"#;

/// Version 6 → 7 (from any version from 1 on, whose `dead_letters` table
/// is kept as it was): the redrive id of a broker message's dead letter.
const V6_TO_V7: &str = r#"
ALTER TABLE dead_letters ADD COLUMN redrive_id TEXT NOT NULL DEFAULT '';
"#;

/// Version 6 → 7 (from versions 4 to 6, which have `source_parked` keyed
/// by (source, message id)): the old table is set aside, [`V8_OBJECTS`]
/// creates the new one, its rows are copied with their key
/// ([`copy_held_retries_v6`]) and the old table dropped.
const V6_HELD_RETRIES_ASIDE: &str = r#"
ALTER TABLE source_parked RENAME TO source_parked_v6;
DROP INDEX IF EXISTS source_parked_due;
"#;

/// Copies the retries held in `source_parked_v6` into `source_held_retries`, each
/// under its [`MessageKey`](crate::MessageKey) (the payload hash is
/// computed here: SQLite has no SHA-256), then drops the old table.
fn copy_held_retries_v6(conn: &Connection) -> rusqlite::Result<()> {
    let rows = {
        let mut stmt = conn.prepare(
            "SELECT source, message_id, due_at, ref, envelope, body FROM source_parked_v6",
        )?;
        stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, Vec<u8>>(5)?,
            ))
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?
    };
    let mut insert = conn.prepare(
        "INSERT OR REPLACE INTO source_held_retries
           (source, message_id, payload_sha256, redrive_id, due_at, ref, envelope, body)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?;
    for (source, message_id, due_at, reference, envelope, body) in rows {
        // A redrive id is recorded in the source reference when it had one.
        let redrive_id = serde_json::from_str::<serde_json::Value>(&reference)
            .ok()
            .and_then(|v| v.get("redrive_id")?.as_str().map(str::to_owned))
            .unwrap_or_default();
        let sha = hex::encode(lazaret_core::payload_sha256(&body));
        insert.execute(rusqlite::params![
            source, message_id, sha, redrive_id, due_at, reference, envelope, body
        ])?;
    }
    conn.execute_batch("DROP TABLE source_parked_v6;")
}

/// Version 5 → 6 (from any version from 2 on, whose `jobs` table is kept
/// as it was): the cancel mark on jobs. Version 1's table is rebuilt from
/// `CURRENT`, which has the column already.
const V5_TO_V6: &str = r#"
ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0;
"#;

/// Version 3 → 4: broker messages in the dead letters.
const V3_TO_V4: &str = r#"
ALTER TABLE dead_letters ADD COLUMN source TEXT;
ALTER TABLE dead_letters ADD COLUMN source_name TEXT;
ALTER TABLE dead_letters ADD COLUMN message_id TEXT;
ALTER TABLE dead_letters ADD COLUMN envelope TEXT;
"#;

/// Version 1 → 2: the envelope becomes nullable (written only on failures
/// and redrives; leases and successes write columns), and the running
/// attempt, schema version, redrive count and enqueuing token get columns.
/// SQLite cannot drop a NOT NULL, so the table is rebuilt, in the one
/// transaction `migrate` runs in.
const V1_TO_V2: &str = r#"
ALTER TABLE jobs RENAME TO jobs_v1;
DROP INDEX IF EXISTS jobs_idempotency;
DROP INDEX IF EXISTS jobs_ready;
DROP INDEX IF EXISTS jobs_due;
DROP INDEX IF EXISTS jobs_leases;
DROP INDEX IF EXISTS jobs_done;
"#;

/// Copies version-1 rows once the version-2 table exists. A v1 row always
/// has its envelope, with the running attempt already in its history; the
/// running-attempt columns stay NULL, which tells readers not to add it again.
const V1_COPY: &str = r#"
INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, leases, lease_token, lease_expires_at,
                  idempotency_key, schema_version, redrives, created_at, finished_at, envelope, payload)
SELECT id, type, tenant, lane, state, run_at, attempts,
       -- v1 tokens came from a counter kept above 1000 per ms of wall time:
       -- start every job's lease count past all of them.
       ((CAST(strftime('%s', 'now') AS INTEGER) + 1) * 1000000 >> 40) + 1,
       lease_token, lease_expires_at,
       idempotency_key, json_extract(envelope, '$.schema_version'),
       COALESCE(json_extract(envelope, '$.redrives'), 0), created_at, finished_at, envelope, payload
FROM jobs_v1;
-- Ids must never be reused: keep v1's AUTOINCREMENT high-water mark.
DELETE FROM sqlite_sequence WHERE name = 'jobs';
UPDATE sqlite_sequence SET name = 'jobs' WHERE name = 'jobs_v1';
DROP TABLE jobs_v1;
"#;

/// Version 8 → 9: failure groups and archiving (issue 30). Self-contained:
/// [`V8_TO_V9`] adds the columns to a `dead_letters` table of an older
/// version (a new database has them from `CURRENT`), [`V9_OBJECTS`] the
/// indexes, and [`groups_v9`] computes the group of every dead letter held.
const V8_TO_V9: &str = r#"
ALTER TABLE dead_letters ADD COLUMN group_id TEXT NOT NULL DEFAULT '';
ALTER TABLE dead_letters ADD COLUMN fingerprint TEXT NOT NULL DEFAULT '';
ALTER TABLE dead_letters ADD COLUMN archived_at INTEGER;
"#;

/// The groups' index: a page of groups reads it (and only it) to count and
/// order the groups; active and archived dead letters apart.
const V9_OBJECTS: &str = r#"
CREATE INDEX IF NOT EXISTS dead_letters_group
    ON dead_letters (group_id, dead_lettered_at, archived_at);
-- Redrive reports: a redrive's id and its audit entry (which says who,
-- when, what was asked and how many were sent), and the jobs it moved
-- with the group each came from.
CREATE TABLE IF NOT EXISTS redrives (
    id       TEXT    PRIMARY KEY,       -- the redrive id (x-lazaret-redrive-id of its broker messages)
    audit_id INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS redrive_jobs (
    audit_id   INTEGER NOT NULL,        -- the redrive's audit entry
    job_id     INTEGER NOT NULL,
    from_group TEXT    NOT NULL,        -- the group of the dead letter it was redriven from
    PRIMARY KEY (audit_id, job_id)
);
"#;

/// Version 9 → 10 (and new databases, whose `redrive_jobs` [`V9_OBJECTS`]
/// just created): what each redrive of a job did to it, for its lineage
/// (issue 30): whether the payload was edited, and the type and lane it
/// was sent to when redirected. Rows of older redrives read as not
/// edited and not redirected.
const V9_TO_V10: &str = r#"
ALTER TABLE redrive_jobs ADD COLUMN edited INTEGER NOT NULL DEFAULT 0;
ALTER TABLE redrive_jobs ADD COLUMN to_type TEXT;
ALTER TABLE redrive_jobs ADD COLUMN to_lane TEXT;
-- A job's lineage reads its redrives by job.
CREATE INDEX IF NOT EXISTS redrive_jobs_job ON redrive_jobs (job_id, audit_id);
CREATE INDEX IF NOT EXISTS redrives_audit ON redrives (audit_id);
"#;

/// Version 10 → 11 (and new databases): the broker messages of redrive
/// reports (issue 30, part 6). Self-contained: a new table, empty on an
/// older database (the redrives it holds reported their jobs only).
const V11_OBJECTS: &str = r#"
-- Each broker message a redrive republished, from the dead letter it came
-- from, and how its copy ended: NULL while sent (not yet seen back),
-- 'succeeded' (a guard source handled it), 'failed_again' (dead-lettered
-- again, as dead_letter_again in group_again). Also a dead letter's
-- lineage: when, by which redrive, from which group.
CREATE TABLE IF NOT EXISTS redrive_messages (
    redrive_id        TEXT    NOT NULL, -- the x-lazaret-redrive-id its copy carries
    message_id        TEXT    NOT NULL, -- the message id its copy carries
    dead_letter_id    INTEGER NOT NULL, -- the dead letter it came from (removed once sent)
    source            TEXT    NOT NULL, -- the source of that dead letter
    from_group        TEXT    NOT NULL, -- that dead letter's group
    sent_at           INTEGER NOT NULL,
    outcome           TEXT,             -- NULL, 'succeeded' or 'failed_again'
    outcome_at        INTEGER,
    dead_letter_again INTEGER,          -- failed again: the dead letter it became
    group_again       TEXT,             -- and its group
    PRIMARY KEY (redrive_id, message_id, dead_letter_id)
);
"#;

/// Version 12 → 13 (and new databases, whose tables [`CURRENT`] just
/// created without it): the W3C `traceparent` a job was enqueued with, or
/// a broker message carried, validated (`lazaret_core::TraceParent`); its
/// dead letter keeps it. NULL for rows written before, and for jobs sent
/// without one. SQLite has no `ADD COLUMN IF NOT EXISTS`: a column already
/// there (a file a newer build wrote and its version set back) is left.
fn v12_to_v13(conn: &Connection) -> rusqlite::Result<()> {
    for table in ["jobs", "dead_letters"] {
        let has: bool = conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM pragma_table_info(?1) WHERE name = 'traceparent')",
            [table],
            |r| r.get(0),
        )?;
        if !has {
            conn.execute_batch(&format!("ALTER TABLE {table} ADD COLUMN traceparent TEXT;"))?;
        }
    }
    Ok(())
}

/// What version 14 added (issue 33, part 5; 13 is another change's):
/// the charts' samples, a row per (minute, signal, axis, name) written by
/// each sampling (`crate::signals`; `signal = 'sampled'` marks a minute
/// sampled), kept about a day; and the indexes a sampling reads the
/// minute's events by, so it never scans a table: dead letters by time
/// (one more index entry per dead letter written), audit entries by time,
/// redriven broker messages by when they were sent and how they ended.
/// Self-contained: new objects only.
const V14_OBJECTS: &str = r#"
CREATE TABLE IF NOT EXISTS signal_samples (
    minute INTEGER NOT NULL,            -- the minute's start, ms since the epoch
    signal TEXT    NOT NULL,            -- lazaret_core::series::Signal words, or 'sampled'
    axis   TEXT    NOT NULL,            -- type | source | lane ('' for the mark)
    name   TEXT    NOT NULL,            -- the type, source or lane; '' for none
    value  INTEGER NOT NULL,
    PRIMARY KEY (minute, signal, axis, name)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS dead_letters_at ON dead_letters (dead_lettered_at);
CREATE INDEX IF NOT EXISTS audit_at ON audit (at);
CREATE INDEX IF NOT EXISTS redrive_messages_sent ON redrive_messages (sent_at);
CREATE INDEX IF NOT EXISTS redrive_messages_outcome ON redrive_messages (outcome_at)
    WHERE outcome_at IS NOT NULL;
"#;

/// Dead letters [`groups_v9`] reads at a time.
const GROUPS_V9_PAGE_ROWS: i64 = 1000;

/// Computes the group of every dead letter held (the fingerprint is Rust
/// code, so the rows are read and written back here), a page of
/// [`GROUPS_V9_PAGE_ROWS`] by id at a time, so that a million dead letters
/// are never all in memory at once.
fn groups_v9(conn: &Connection) -> rusqlite::Result<()> {
    let mut read = conn.prepare(
        "SELECT id, type, reason, error FROM dead_letters WHERE id > ?1 ORDER BY id LIMIT ?2",
    )?;
    let mut update =
        conn.prepare("UPDATE dead_letters SET group_id = ?2, fingerprint = ?3 WHERE id = ?1")?;
    let mut after = 0i64;
    loop {
        let rows = read
            .query_map(rusqlite::params![after, GROUPS_V9_PAGE_ROWS], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Option<String>>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, Option<String>>(3)?,
                ))
            })?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let Some(&(last, ..)) = rows.last() else {
            return Ok(());
        };
        after = last;
        for (id, job_type, reason, error) in rows {
            let error: Option<lazaret_core::Failure> =
                error.and_then(|e| serde_json::from_str(&e).ok());
            let g = lazaret_core::group_of(job_type.as_deref(), &reason, error.as_ref());
            update.execute(rusqlite::params![id, g.id, g.fingerprint])?;
        }
    }
}

/// What version 12 added: a summary row per failure group, so that a page
/// of groups reads 50 summary rows instead of counting every dead letter
/// (issue 30: 1,000,000 dead letters in 10,000 groups, a page under
/// 50 ms). `dead_letter_groups` holds, per (group, active or archived),
/// the count, the oldest and newest time and the newest dead letter (the
/// sample: newest `dead_lettered_at`, then highest id);
/// `dead_letter_group_names` the count of each tenant and source in it.
///
/// Triggers keep both in the transaction of every write to `dead_letters`
/// (an insert on any path, purge, retention, archive, restore, redrive,
/// a group recomputed), so no writer can forget them; a removal recomputes
/// the oldest or the newest only when it removed that one, by the groups'
/// index (`dead_letters_group`). [`SUMMARY_REBUILD`] builds both from the
/// rows held.
fn v12_objects() -> String {
    let added = summary_added("NEW");
    let removed = summary_removed("OLD");
    format!(
        r#"
CREATE TABLE IF NOT EXISTS dead_letter_groups (
    group_id  TEXT    NOT NULL,
    archived  INTEGER NOT NULL,         -- 0 active, 1 archived
    type      TEXT,                     -- part of the group id: one per group
    reason    TEXT    NOT NULL,         -- as type
    count     INTEGER NOT NULL,
    first_at  INTEGER NOT NULL,         -- ms since the epoch
    last_at   INTEGER NOT NULL,
    sample_id INTEGER NOT NULL,         -- the newest dead letter (last_at, then highest id)
    PRIMARY KEY (group_id, archived)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS dead_letter_groups_page
    ON dead_letter_groups (archived, last_at DESC, group_id);
-- A page of one type's groups: without it, the page index is read until
-- 50 groups of the type are found (a fiftieth of the groups in
-- groups_bench: 2,500 rows).
CREATE INDEX IF NOT EXISTS dead_letter_groups_type
    ON dead_letter_groups (archived, type, last_at DESC, group_id);
CREATE TABLE IF NOT EXISTS dead_letter_group_names (
    group_id TEXT    NOT NULL,
    archived INTEGER NOT NULL,
    what     TEXT    NOT NULL,          -- tenant | source
    name     TEXT    NOT NULL,
    count    INTEGER NOT NULL,          -- dead letters of the group with this name
    PRIMARY KEY (group_id, archived, what, name)
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS dead_letter_groups_insert AFTER INSERT ON dead_letters
BEGIN {added} END;
CREATE TRIGGER IF NOT EXISTS dead_letter_groups_delete AFTER DELETE ON dead_letters
BEGIN {removed} END;
CREATE TRIGGER IF NOT EXISTS dead_letter_groups_update
    AFTER UPDATE OF group_id, archived_at, dead_lettered_at, type, reason, tenant, source_name
    ON dead_letters
BEGIN {removed} {added} END;
"#
    )
}

/// The statements adding dead letter `row` (`NEW`) to the summary.
fn summary_added(row: &str) -> String {
    let names = |what: &str, column: &str| {
        format!(
            "INSERT INTO dead_letter_group_names (group_id, archived, what, name, count)
             SELECT {row}.group_id, {row}.archived_at IS NOT NULL, '{what}', {row}.{column}, 1
             WHERE {row}.{column} IS NOT NULL
             ON CONFLICT (group_id, archived, what, name) DO UPDATE SET count = count + 1;"
        )
    };
    format!(
        "INSERT INTO dead_letter_groups
           (group_id, archived, type, reason, count, first_at, last_at, sample_id)
         VALUES ({row}.group_id, {row}.archived_at IS NOT NULL, {row}.type, {row}.reason, 1,
           {row}.dead_lettered_at, {row}.dead_lettered_at, {row}.id)
         ON CONFLICT (group_id, archived) DO UPDATE SET
           count = count + 1,
           first_at = min(first_at, excluded.first_at),
           last_at = max(last_at, excluded.last_at),
           sample_id = CASE WHEN (excluded.last_at, excluded.sample_id) > (last_at, sample_id)
                       THEN excluded.sample_id ELSE sample_id END;
         {} {}",
        names("tenant", "tenant"),
        names("source", "source_name")
    )
}

/// The statements taking dead letter `row` (`OLD`, no longer in its
/// group's rows when they run) out of the summary.
fn summary_removed(row: &str) -> String {
    let key = format!("group_id = {row}.group_id AND archived = ({row}.archived_at IS NOT NULL)");
    let rows = format!(
        "FROM dead_letters d WHERE d.group_id = {row}.group_id
           AND (d.archived_at IS NOT NULL) = ({row}.archived_at IS NOT NULL)"
    );
    let names = |what: &str, column: &str| {
        format!(
            "UPDATE dead_letter_group_names SET count = count - 1
             WHERE {key} AND what = '{what}' AND name = {row}.{column};
             DELETE FROM dead_letter_group_names
             WHERE {key} AND what = '{what}' AND name = {row}.{column} AND count <= 0;"
        )
    };
    format!(
        "UPDATE dead_letter_groups SET count = count - 1 WHERE {key};
         DELETE FROM dead_letter_groups WHERE {key} AND count <= 0;
         UPDATE dead_letter_groups
           SET first_at = (SELECT d.dead_lettered_at {rows} ORDER BY d.dead_lettered_at LIMIT 1)
           WHERE {key} AND first_at = {row}.dead_lettered_at;
         UPDATE dead_letter_groups
           SET (last_at, sample_id) = (SELECT d.dead_lettered_at, d.id {rows}
                                       ORDER BY d.dead_lettered_at DESC, d.id DESC LIMIT 1)
           WHERE {key} AND sample_id = {row}.id;
         {} {}",
        names("tenant", "tenant"),
        names("source", "source_name")
    )
}

/// Builds the groups' summary from the dead letters held (version 12's
/// migration; idempotent: it starts from empty tables).
const SUMMARY_REBUILD: &str = r#"
DELETE FROM dead_letter_groups;
DELETE FROM dead_letter_group_names;
INSERT INTO dead_letter_groups (group_id, archived, type, reason, count, first_at, last_at, sample_id)
SELECT group_id, archived_at IS NOT NULL, MIN(type), MIN(reason), COUNT(*),
       MIN(dead_lettered_at), MAX(dead_lettered_at), 0
FROM dead_letters GROUP BY group_id, archived_at IS NOT NULL;
UPDATE dead_letter_groups SET sample_id = (
    SELECT d.id FROM dead_letters d
    WHERE d.group_id = dead_letter_groups.group_id
      AND (d.archived_at IS NOT NULL) = dead_letter_groups.archived
    ORDER BY d.dead_lettered_at DESC, d.id DESC LIMIT 1);
INSERT INTO dead_letter_group_names (group_id, archived, what, name, count)
SELECT group_id, archived_at IS NOT NULL, 'tenant', tenant, COUNT(*)
FROM dead_letters WHERE tenant IS NOT NULL GROUP BY 1, 2, 4;
INSERT INTO dead_letter_group_names (group_id, archived, what, name, count)
SELECT group_id, archived_at IS NOT NULL, 'source', source_name, COUNT(*)
FROM dead_letters WHERE source_name IS NOT NULL GROUP BY 1, 2, 4;
"#;

/// Creates or migrates the schema; refuses a database from a newer build.
///
/// Version 2 → 3 only adds the `meta` table, which `CURRENT` creates; the
/// lease-token sequence then starts above every version-2 token
/// (`sqlite::tokens`).
pub fn migrate(conn: &Connection) -> Result<(), crate::StoreError> {
    let version: i64 = conn.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    if version > SCHEMA_VERSION {
        return Err(crate::StoreError::Corrupt(format!(
            "the database has schema version {version}, newer than this build's {SCHEMA_VERSION}; run a newer lazaret"
        )));
    }
    if version == SCHEMA_VERSION {
        return Ok(());
    }
    let mut script = String::from("BEGIN IMMEDIATE;\n");
    if version == 1 {
        script.push_str(V1_TO_V2);
        script.push_str(CURRENT);
        script.push_str(V1_COPY);
    } else {
        script.push_str(CURRENT);
    }
    if (1..4).contains(&version) {
        // `CURRENT` left the existing `dead_letters` table as it was.
        script.push_str(V3_TO_V4);
    }
    if version < 7 {
        // Version 7 dropped this index, and may hold broker dead letters
        // that differ only by body, which it would refuse.
        script.push_str(V4_OBJECTS);
    }
    // Version 4 → 5 (and new databases): the typed ready index.
    script.push_str(V5_OBJECTS);
    if (2..6).contains(&version) {
        script.push_str(V5_TO_V6);
    }
    script.push_str(V6_OBJECTS);
    if (1..7).contains(&version) {
        script.push_str(V6_TO_V7);
    }
    // Versions 4 to 6 have the held retries keyed by (source, message id).
    let held_retries_v6 = (4..7).contains(&version);
    if held_retries_v6 {
        script.push_str(V6_HELD_RETRIES_ASIDE);
    }
    script.push_str(V7_OBJECTS);
    // Version 7 has them as `source_parked`.
    if version == 7 {
        script.push_str(V7_TO_V8);
    }
    script.push_str(V8_OBJECTS);
    let groups = (1..9).contains(&version);
    if groups {
        script.push_str(V8_TO_V9);
    }
    script.push_str(V9_OBJECTS);
    // Every version below 10 has `redrive_jobs` without the columns.
    if version < 10 {
        script.push_str(V9_TO_V10);
    }
    script.push_str(V11_OBJECTS);
    script.push_str(&v12_objects());
    script.push_str(V14_OBJECTS);
    let migrated = conn.execute_batch(&script).and_then(|()| {
        if held_retries_v6 {
            copy_held_retries_v6(conn)?;
        }
        if groups {
            groups_v9(conn)?;
        }
        if version < 13 {
            v12_to_v13(conn)?;
        }
        if version >= 1 {
            // After the groups are computed (their updates went through
            // the triggers; the rebuild starts over from the rows).
            conn.execute_batch(SUMMARY_REBUILD)?;
        }
        conn.execute_batch(&format!("PRAGMA user_version = {SCHEMA_VERSION};\nCOMMIT;"))
    });
    if let Err(e) = migrated {
        let _ = conn.execute_batch("ROLLBACK");
        return Err(e.into());
    }
    Ok(())
}
