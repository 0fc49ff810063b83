//! Reads on their own connection (WAL lets them run beside the writer).

use lazaret_core::{Envelope, Failure, JobId, JobState, Timestamp};
use rusqlite::{Connection, OptionalExtension, Row, params};

// The reads of held retries live with the broker messages.
pub(super) use super::sources::{due_held_retries, held_retry, message_held, next_held_retry_due};
use super::stored::{COLUMN_COUNT, COLUMNS, StoredJob};
use crate::{
    AuditEntry, DeadLetter, DeadLetterFilter, DeadLetterId, FailureGroup, GROUP_NAMES_MAX,
    GroupCursor, GroupQuery, JobPage, JobQuery, JobView, Pause, PauseTarget, ReasonCount,
    RecentDeadLetter, Selector, Stage, StoreError,
};

fn db<T>(r: rusqlite::Result<T>) -> Result<T, StoreError> {
    r.map_err(StoreError::from)
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// What a job view reads besides [`COLUMNS`]: its dead letter by the
/// `dead_letters_job` index.
const VIEW_COLUMNS: &str = "run_at, lease_expires_at, enqueued_by, cancel_requested, \
     (SELECT d.id FROM dead_letters d WHERE d.job_id = jobs.id), traceparent";

fn view_row(r: &Row<'_>) -> rusqlite::Result<(StoredJob, ViewExtra)> {
    Ok((
        StoredJob::from_row(r)?,
        ViewExtra {
            run_at: r.get(COLUMN_COUNT)?,
            lease_expires_at: r.get(COLUMN_COUNT + 1)?,
            enqueued_by: r.get(COLUMN_COUNT + 2)?,
            cancel_requested: r.get(COLUMN_COUNT + 3)?,
            dead_letter_id: r.get(COLUMN_COUNT + 4)?,
        },
    ))
}

struct ViewExtra {
    run_at: i64,
    lease_expires_at: Option<i64>,
    enqueued_by: Option<String>,
    cancel_requested: bool,
    dead_letter_id: Option<i64>,
}

fn view((stored, x): (StoredJob, ViewExtra)) -> Result<JobView, StoreError> {
    let envelope = stored.envelope()?;
    let state = stored.state;
    let run_at = matches!(state, JobState::Queued | JobState::Scheduled)
        .then_some(Timestamp::from_millis(x.run_at));
    Ok(JobView {
        envelope,
        state,
        run_at,
        payload: stored.payload,
        lease_expires_at: x.lease_expires_at.map(Timestamp::from_millis),
        enqueued_by: x.enqueued_by,
        dead_letter_id: x.dead_letter_id.map(|d| DeadLetterId(d as u64)),
        cancel_requested: x.cancel_requested,
    })
}

pub(super) fn job(c: &Connection, &id: &JobId) -> Result<Option<JobView>, StoreError> {
    let row = db(c
        .prepare_cached(&format!(
            "SELECT {COLUMNS}, {VIEW_COLUMNS} FROM jobs WHERE id = ?1"
        ))?
        .query_row(params![id.0 as i64], view_row)
        .optional())?;
    row.map(view).transpose()
}

/// Rows of `jobs` one page of `GET /v1/jobs` reads at most, newest first
/// from its cursor. A filter that matches few of them answers a short page
/// (even an empty one) with a cursor to go on from, as a scan with a budget
/// does: a page costs a bounded read whatever the table holds, and the
/// success path pays for no index kept for listing (an index on (state,
/// id) is updated at every enqueue, lease and ack: it cost 16% of batched
/// throughput).
pub const JOBS_PAGE_ROWS_MAX: u32 = 100_000;

/// The statement and its values for a page of jobs: the newest
/// [`JOBS_PAGE_ROWS_MAX`] rows below the cursor, by rowid, then the
/// filters given (only those given are in the SQL), one more than asked.
fn jobs_sql(q: &JobQuery, rows_max: u32) -> (String, Vec<rusqlite::types::Value>) {
    use rusqlite::types::Value;
    let before = q.before.map_or(i64::MAX, |b| b.0 as i64);
    let mut values: Vec<Value> = vec![Value::Integer(before), Value::Integer(i64::from(rows_max))];
    let mut wheres: Vec<String> = Vec::new();
    let mut add = |column: &str, v: Value| {
        values.push(v);
        wheres.push(format!("{column} = ?{}", values.len()));
    };
    if let Some(st) = q.state {
        add("state", Value::Text(st.as_str().to_owned()));
    }
    for (column, v) in [
        ("type", &q.job_type),
        ("tenant", &q.tenant),
        ("lane", &q.lane),
        ("enqueued_by", &q.enqueued_by),
    ] {
        if let Some(v) = v {
            add(column, Value::Text(v.clone()));
        }
    }
    // One more than asked says whether an older page exists.
    values.push(Value::Integer(i64::from(q.limit) + 1));
    let filter = if wheres.is_empty() {
        String::new()
    } else {
        format!(" WHERE {}", wheres.join(" AND "))
    };
    let sql = format!(
        "SELECT {COLUMNS}, {VIEW_COLUMNS} FROM
           (SELECT * FROM jobs WHERE id < ?1 ORDER BY id DESC LIMIT +?2) AS jobs{filter}
         ORDER BY id DESC LIMIT +?{}",
        values.len()
    );
    (sql, values)
}

pub(super) fn jobs(c: &Connection, q: &JobQuery) -> Result<JobPage, StoreError> {
    jobs_within(c, q, JOBS_PAGE_ROWS_MAX)
}

/// [`jobs`], reading at most `rows_max` rows.
fn jobs_within(c: &Connection, q: &JobQuery, rows_max: u32) -> Result<JobPage, StoreError> {
    let (sql, values) = jobs_sql(q, rows_max);
    let mut stmt = db(c.prepare_cached(&sql))?;
    let rows = db(stmt.query_map(rusqlite::params_from_iter(values.iter()), view_row))?;
    let mut items = Vec::new();
    for row in rows {
        items.push(view(db(row)?)?);
    }
    let next = if items.len() > q.limit as usize {
        items.truncate(q.limit as usize);
        items.last().map(|j| j.envelope.id)
    } else {
        // A short page: the end of the table, or the read's budget spent
        // first; then the next page starts at the first row not read.
        let before = q.before.map_or(i64::MAX, |b| b.0 as i64);
        let unread: Option<i64> = db(c
            .prepare_cached("SELECT id FROM jobs WHERE id < ?1 ORDER BY id DESC LIMIT 1 OFFSET ?2")?
            .query_row(params![before, i64::from(rows_max)], |r| r.get(0))
            .optional())?;
        unread.map(|id| JobId(id as u64 + 1))
    };
    Ok((items, next))
}

pub(super) fn pauses(c: &Connection) -> Result<Vec<Pause>, StoreError> {
    let mut stmt = db(c.prepare_cached(
        "SELECT target, name, paused_at, paused_by FROM pauses ORDER BY target, name",
    ))?;
    let rows = db(stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, i64>(2)?,
            r.get::<_, String>(3)?,
        ))
    }))?;
    let mut out = Vec::new();
    for row in rows {
        let (target, name, at, by) = db(row)?;
        let target = match target.as_str() {
            "type" => PauseTarget::Type(name),
            "lane" => PauseTarget::Lane(name),
            other => return Err(corrupt(format!("a pause of an unknown target {other:?}"))),
        };
        out.push(Pause {
            target,
            paused_at: Timestamp::from_millis(at),
            paused_by: by,
        });
    }
    Ok(out)
}

const DL_COLUMNS: &str = "d.id, d.job_id, d.type, d.tenant, d.lane, d.reason, d.stage, d.attempts, d.error,
    d.idempotency_key, d.created_at, d.dead_lettered_at, d.payload_size, d.payload_sha256, d.payload_preview, COALESCE(j.envelope, d.envelope), d.source,
    d.group_id, d.fingerprint, d.archived_at, COALESCE(d.traceparent, j.traceparent)";

fn dead_letter_row(r: &Row<'_>) -> rusqlite::Result<(DeadLetterRaw, Option<String>)> {
    Ok((
        DeadLetterRaw {
            id: r.get(0)?,
            job_id: r.get(1)?,
            job_type: r.get(2)?,
            tenant: r.get(3)?,
            lane: r.get(4)?,
            reason: r.get(5)?,
            stage: r.get(6)?,
            attempts: r.get(7)?,
            error: r.get(8)?,
            idempotency_key: r.get(9)?,
            created_at: r.get(10)?,
            dead_lettered_at: r.get(11)?,
            payload_size: r.get(12)?,
            payload_sha256: r.get(13)?,
            payload_preview: r.get(14)?,
            source: r.get(16)?,
            group_id: r.get(17)?,
            fingerprint: r.get(18)?,
            archived_at: r.get(19)?,
            traceparent: r.get(20)?,
        },
        r.get(15)?,
    ))
}

struct DeadLetterRaw {
    id: i64,
    job_id: Option<i64>,
    job_type: Option<String>,
    tenant: Option<String>,
    lane: Option<String>,
    reason: String,
    stage: String,
    attempts: i64,
    error: Option<String>,
    idempotency_key: Option<String>,
    created_at: i64,
    dead_lettered_at: i64,
    payload_size: i64,
    payload_sha256: Option<String>,
    payload_preview: String,
    source: Option<String>,
    group_id: String,
    fingerprint: String,
    archived_at: Option<i64>,
    traceparent: Option<String>,
}

fn finish(raw: DeadLetterRaw, envelope: Option<String>) -> Result<DeadLetter, StoreError> {
    let env = envelope
        .map(|e| Envelope::from_json(&e))
        .transpose()
        .map_err(corrupt)?;
    let error: Option<Failure> = raw
        .error
        .map(|e| serde_json::from_str(&e))
        .transpose()
        .map_err(corrupt)?;
    Ok(DeadLetter {
        id: DeadLetterId(raw.id as u64),
        job_id: raw.job_id.map(|j| JobId(j as u64)),
        job_type: raw.job_type,
        tenant: raw.tenant,
        lane: raw.lane,
        reason: raw.reason.parse().map_err(corrupt)?,
        stage: stage(&raw.stage),
        attempts: raw.attempts as u32,
        error,
        history: env.as_ref().map(|e| e.history.clone()).unwrap_or_default(),
        idempotency_key: raw.idempotency_key,
        created_at: Timestamp::from_millis(raw.created_at),
        dead_lettered_at: Timestamp::from_millis(raw.dead_lettered_at),
        payload_size: raw.payload_size as u64,
        payload_sha256: raw.payload_sha256,
        payload_preview: raw.payload_preview,
        redrive_count: env.as_ref().map_or(0, |e| e.redrive_count),
        schema_version: env.as_ref().and_then(|e| e.schema_version),
        source: raw
            .source
            .map(|s| serde_json::from_str(&s))
            .transpose()
            .map_err(corrupt)?,
        group_id: raw.group_id,
        fingerprint: raw.fingerprint,
        archived_at: raw.archived_at.map(Timestamp::from_millis),
        traceparent: crate::stored::stored_traceparent(raw.traceparent),
    })
}

fn stage(word: &str) -> Stage {
    Stage::parse(word).unwrap_or(Stage::Processing)
}

const FILTER: &str = "(?1 IS NULL OR d.type = ?1) AND (?2 IS NULL OR d.tenant = ?2)
    AND (?3 IS NULL OR d.lane = ?3) AND (?4 IS NULL OR d.reason = ?4)
    AND (?5 IS NULL OR d.source_name = ?5) AND (?6 IS NULL OR d.stage = ?6)
    AND (?7 IS NULL OR d.job_id = ?7) AND (?8 IS NULL OR d.group_id = ?8)
    AND (d.archived_at IS NOT NULL) = ?9";

pub(super) fn dead_letters(
    c: &Connection,
    f: &DeadLetterFilter,
    &limit: &u32,
    &cursor: &Option<DeadLetterId>,
) -> Result<(Vec<DeadLetter>, Option<DeadLetterId>), StoreError> {
    let sql = format!(
        "SELECT {DL_COLUMNS} FROM dead_letters d LEFT JOIN jobs j ON j.id = d.job_id
         WHERE {FILTER} AND (?10 IS NULL OR d.id < ?10) ORDER BY d.id DESC LIMIT +?11"
    );
    let mut stmt = db(c.prepare_cached(&sql))?;
    let rows = db(stmt.query_map(
        params![
            f.job_type,
            f.tenant,
            f.lane,
            f.reason,
            f.source,
            f.stage,
            f.job_id.map(|j| j as i64),
            f.group,
            f.archived,
            cursor.map(|c| c.0 as i64),
            i64::from(limit) + 1
        ],
        dead_letter_row,
    ))?;
    let mut items = Vec::new();
    for row in rows {
        let (raw, env) = db(row)?;
        items.push(finish(raw, env)?);
    }
    let next = if items.len() > limit as usize {
        items.truncate(limit as usize);
        items.last().map(|d| d.id)
    } else {
        None
    };
    Ok((items, next))
}

pub(super) fn dead_letter(
    c: &Connection,
    &id: &DeadLetterId,
) -> Result<Option<DeadLetter>, StoreError> {
    let sql = format!(
        "SELECT {DL_COLUMNS} FROM dead_letters d LEFT JOIN jobs j ON j.id = d.job_id WHERE d.id = ?1"
    );
    let row = db(c
        .prepare_cached(&sql)?
        .query_row(params![id.0 as i64], dead_letter_row)
        .optional())?;
    row.map(|(raw, env)| finish(raw, env)).transpose()
}

pub(super) fn dead_letter_payload(
    c: &Connection,
    &id: &DeadLetterId,
) -> Result<Option<Option<Vec<u8>>>, StoreError> {
    let row = db(c
        .prepare_cached(
            "SELECT CASE WHEN d.job_id IS NOT NULL THEN j.payload ELSE d.payload END
             FROM dead_letters d LEFT JOIN jobs j ON j.id = d.job_id WHERE d.id = ?1",
        )?
        .query_row(params![id.0 as i64], |r| r.get::<_, Option<Vec<u8>>>(0))
        .optional())?;
    Ok(row)
}

pub(super) fn reasons(c: &Connection) -> Result<Vec<ReasonCount>, StoreError> {
    let mut stmt = db(c.prepare_cached(
        "SELECT reason, type, COUNT(*), MIN(dead_lettered_at), MAX(dead_lettered_at)
         FROM dead_letters WHERE archived_at IS NULL
         GROUP BY reason, type ORDER BY COUNT(*) DESC, reason, type",
    ))?;
    let rows = db(stmt.query_map([], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, Option<String>>(1)?,
            r.get::<_, i64>(2)?,
            r.get::<_, i64>(3)?,
            r.get::<_, i64>(4)?,
        ))
    }))?;
    let mut out = Vec::new();
    for row in rows {
        let (reason, job_type, count, first, last) = db(row)?;
        out.push(ReasonCount {
            reason: reason.parse().map_err(corrupt)?,
            job_type,
            count: count as u64,
            first_at: Timestamp::from_millis(first),
            last_at: Timestamp::from_millis(last),
        });
    }
    Ok(out)
}

/// A page of failure groups.
///
/// Without a filter, or filtered by type or reason only (both are part of
/// the group id, so they narrow groups, never their counts), the page is
/// read from the groups' summary (`dead_letter_groups`, see
/// `schema::v10_objects`) in the order of its index: 50 rows whatever the
/// number of dead letters. A filter by source, tenant or time changes each
/// group's count, so it counts the dead letters that match on the groups'
/// index (`dead_letters_group`), which reads every dead letter matching
/// (docs/benchmarks.md, "Failure groups at a million dead letters", says
/// how long). Either way each group of the page is then described from
/// its summary: the newest dead letter (by its id, `sample_id`), the
/// tenants and sources (`dead_letter_group_names`) and, from the summary
/// path, the last hour's count on `dead_letters_group`.
pub(super) fn groups(
    c: &Connection,
    q: &GroupQuery,
) -> Result<(Vec<FailureGroup>, Option<GroupCursor>), StoreError> {
    let narrowed = q.source.is_some() || q.tenant.is_some() || q.since.is_some();
    let hour_ago = q.now.as_millis().saturating_sub(3_600_000);
    let cursor_at = q.cursor.as_ref().map(|c| c.last_at.as_millis());
    let cursor_id = q.cursor.as_ref().map(|c| c.id.clone());
    let limit = i64::from(q.limit) + 1;
    // (group id, count, first_at, last_at, rate over the hour)
    type Counted = (String, i64, i64, i64, i64);
    let counted_row = |r: &Row<'_>| -> rusqlite::Result<Counted> {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
    };
    let counted = if narrowed {
        let mut stmt = db(c.prepare_cached(
            "SELECT d.group_id, COUNT(*), MIN(d.dead_lettered_at), MAX(d.dead_lettered_at),
                    SUM(d.dead_lettered_at >= ?6)
             FROM dead_letters d
             WHERE (d.archived_at IS NOT NULL) = ?7
               AND (?1 IS NULL OR d.type = ?1) AND (?2 IS NULL OR d.reason = ?2)
               AND (?3 IS NULL OR d.source_name = ?3) AND (?4 IS NULL OR d.tenant = ?4)
               AND (?5 IS NULL OR d.dead_lettered_at >= ?5)
             GROUP BY d.group_id
             HAVING ?8 IS NULL OR MAX(d.dead_lettered_at) < ?8
                 OR (MAX(d.dead_lettered_at) = ?8 AND d.group_id > ?9)
             ORDER BY MAX(d.dead_lettered_at) DESC, d.group_id LIMIT ?10",
        ))?;
        let rows = db(stmt.query_map(
            params![
                q.job_type,
                q.reason,
                q.source,
                q.tenant,
                q.since.map(|t| t.as_millis()),
                hour_ago,
                q.archived,
                cursor_at,
                cursor_id,
                limit,
            ],
            counted_row,
        ))?;
        db(rows.collect::<rusqlite::Result<Vec<_>>>())?
    } else {
        // The cursor's `last_at <= ?5` lets the page index seek to it.
        let mut stmt = db(c.prepare_cached(
            "SELECT g.group_id, g.count, g.first_at, g.last_at,
                    (SELECT COUNT(*) FROM dead_letters d
                     WHERE d.group_id = g.group_id AND d.dead_lettered_at >= ?4
                       AND (d.archived_at IS NOT NULL) = ?1)
             FROM dead_letter_groups g
             WHERE g.archived = ?1 AND (?2 IS NULL OR g.type = ?2) AND (?3 IS NULL OR g.reason = ?3)
               AND (?5 IS NULL OR (g.last_at <= ?5 AND (g.last_at < ?5 OR g.group_id > ?6)))
             ORDER BY g.last_at DESC, g.group_id LIMIT ?7",
        ))?;
        let rows = db(stmt.query_map(
            params![
                q.archived, q.job_type, q.reason, hour_ago, cursor_at, cursor_id, limit,
            ],
            counted_row,
        ))?;
        db(rows.collect::<rusqlite::Result<Vec<_>>>())?
    };
    let mut counted = counted;
    let more = counted.len() > q.limit as usize;
    counted.truncate(q.limit as usize);
    let mut out = Vec::with_capacity(counted.len());
    for (id, count, first, last, rate) in counted {
        type Sample = (i64, Option<String>, String, Option<String>, String);
        let (sample_id, job_type, reason, error, fingerprint): Sample = db(c
            .prepare_cached(
                "SELECT d.id, d.type, d.reason, d.error, d.fingerprint
                 FROM dead_letter_groups g JOIN dead_letters d ON d.id = g.sample_id
                 WHERE g.group_id = ?1 AND g.archived = ?2",
            )?
            .query_row(params![id, q.archived], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
            }))?;
        let error: Option<Failure> = error
            .map(|e| serde_json::from_str(&e))
            .transpose()
            .map_err(corrupt)?;
        let names = |what: &str| -> Result<Vec<String>, StoreError> {
            let mut stmt = db(c.prepare_cached(
                "SELECT name FROM dead_letter_group_names
                 WHERE group_id = ?1 AND archived = ?2 AND what = ?3 ORDER BY name LIMIT ?4",
            ))?;
            let rows = db(stmt
                .query_map(params![id, q.archived, what, GROUP_NAMES_MAX as i64], |r| {
                    r.get::<_, String>(0)
                }))?;
            db(rows.collect())
        };
        let held: i64 = match q.redrives_max {
            Some(max) => db(c
                .prepare_cached(
                    "SELECT COUNT(*) FROM dead_letters d JOIN jobs j ON j.id = d.job_id
                     WHERE d.group_id = ?1 AND (d.archived_at IS NOT NULL) = ?2
                       AND d.stage = 'processing' AND j.redrives >= ?3",
                )?
                .query_row(params![id, q.archived, i64::from(max)], |r| r.get(0)))?,
            None => 0,
        };
        out.push(FailureGroup {
            held: held as u64,
            tenants: names("tenant")?,
            sources: names("source")?,
            id,
            count: count as u64,
            job_type,
            reason: reason.parse().map_err(corrupt)?,
            kind: error.as_ref().map(|e| e.kind.as_str().to_owned()),
            fingerprint,
            sample_error: error.map(|e| e.message),
            sample_id: DeadLetterId(sample_id as u64),
            first_at: Timestamp::from_millis(first),
            last_at: Timestamp::from_millis(last),
            rate_1h: rate as u64,
        });
    }
    let next = more.then(|| {
        out.last().map(|g| GroupCursor {
            last_at: g.last_at,
            id: g.id.clone(),
        })
    });
    Ok((out, next.flatten()))
}

/// A job's audited redrives, oldest first.
pub(super) fn lineage(
    c: &Connection,
    &job_id: &JobId,
) -> Result<Vec<crate::LineageEntry>, StoreError> {
    lineage_rows(
        c,
        "SELECT (SELECT MIN(r.id) FROM redrives r WHERE r.audit_id = rj.audit_id),
                a.at, a.actor, a.action, a.request, a.count,
                rj.from_group, rj.edited, rj.to_type, rj.to_lane
         FROM redrive_jobs rj JOIN audit a ON a.id = rj.audit_id
         WHERE rj.job_id = ?1 ORDER BY rj.audit_id",
        job_id.0 as i64,
    )
}

/// A broker dead letter's lineage: the redrive whose copy became it, then
/// the one whose copy became the dead letter that redrive came from, and
/// so on (`redrive_messages`), oldest first.
pub(super) fn message_lineage(
    c: &Connection,
    &dead_letter: &DeadLetterId,
) -> Result<Vec<crate::LineageEntry>, StoreError> {
    lineage_rows(
        c,
        "WITH RECURSIVE chain (dl, depth) AS (
             SELECT ?1, 0
             UNION ALL
             SELECT m.dead_letter_id, chain.depth + 1
             FROM redrive_messages m JOIN chain ON m.dead_letter_again = chain.dl
             WHERE chain.depth < 1000
         )
         SELECT m.redrive_id, a.at, a.actor, a.action, a.request, a.count,
                m.from_group, 0, NULL, NULL
         FROM chain
         JOIN redrive_messages m ON m.dead_letter_again = chain.dl
         JOIN redrives r ON r.id = m.redrive_id
         JOIN audit a ON a.id = r.audit_id
         ORDER BY chain.depth DESC",
        dead_letter.0 as i64,
    )
}

/// Lineage entries from `sql`, whose one parameter is `key` and whose
/// columns are: redrive id, its audit entry's at, actor, action, request
/// and count, from_group, edited, to_type, to_lane.
fn lineage_rows(
    c: &Connection,
    sql: &str,
    key: i64,
) -> Result<Vec<crate::LineageEntry>, StoreError> {
    let mut stmt = db(c.prepare_cached(sql))?;
    let rows = db(stmt.query_map(params![key], |r| {
        Ok((
            r.get::<_, Option<String>>(0)?,
            r.get::<_, i64>(1)?,
            r.get::<_, String>(2)?,
            r.get::<_, String>(3)?,
            r.get::<_, String>(4)?,
            r.get::<_, i64>(5)?,
            r.get::<_, String>(6)?,
            r.get::<_, bool>(7)?,
            r.get::<_, Option<String>>(8)?,
            r.get::<_, Option<String>>(9)?,
        ))
    }))?;
    let rows: Vec<_> = db(rows.collect())?;
    rows.into_iter()
        .map(
            |(
                redrive_id,
                at,
                actor,
                action,
                request,
                count,
                from_group,
                edited,
                to_type,
                to_lane,
            )| {
                Ok(crate::LineageEntry {
                    redrive_id,
                    audit: AuditEntry {
                        at: Timestamp::from_millis(at),
                        actor,
                        action,
                        request: serde_json::from_str(&request).map_err(corrupt)?,
                        count: count as u64,
                    },
                    from_group,
                    edited,
                    to_type,
                    to_lane,
                })
            },
        )
        .collect()
}

/// A redrive's report: its audit entry, and its jobs by their state now.
pub(super) fn redrive_report(
    c: &Connection,
    id: &str,
) -> Result<Option<crate::RedriveReport>, StoreError> {
    let entry = db(c
        .prepare_cached(
            "SELECT a.id, a.at, a.actor, a.action, a.request, a.count
             FROM redrives r JOIN audit a ON a.id = r.audit_id WHERE r.id = ?1",
        )?
        .query_row(params![id], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, i64>(5)?,
            ))
        })
        .optional())?;
    let Some((audit_id, at, actor, action, request, count)) = entry else {
        return Ok(None);
    };
    let mut stmt = db(c.prepare_cached(
        "SELECT rj.from_group, j.state, d.group_id
         FROM redrive_jobs rj
         LEFT JOIN jobs j ON j.id = rj.job_id
         LEFT JOIN dead_letters d ON d.job_id = rj.job_id
         WHERE rj.audit_id = ?1",
    ))?;
    let rows = db(stmt.query_map(params![audit_id], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, Option<String>>(1)?,
            r.get::<_, Option<String>>(2)?,
        ))
    }))?;
    let rows: Vec<_> = db(rows.collect())?;
    let mut stmt = db(c.prepare_cached(
        "SELECT from_group, outcome, group_again FROM redrive_messages WHERE redrive_id = ?1",
    ))?;
    let messages = db(stmt.query_map(params![id], |r| {
        Ok((
            r.get::<_, String>(0)?,
            r.get::<_, Option<String>>(1)?,
            r.get::<_, Option<String>>(2)?,
        ))
    }))?;
    let messages: Vec<_> = db(messages.collect())?;
    Ok(Some(crate::RedriveReport::tally(
        id,
        AuditEntry {
            at: Timestamp::from_millis(at),
            actor,
            action,
            request: serde_json::from_str(&request).map_err(corrupt)?,
            count: count as u64,
        },
        rows,
        messages,
    )))
}

/// Dead letters above `after` by id (the primary key), lowest first.
pub(super) fn dead_letters_after(
    c: &Connection,
    &after: &DeadLetterId,
    &limit: &u32,
) -> Result<Vec<RecentDeadLetter>, StoreError> {
    let mut stmt = db(c.prepare_cached(
        "SELECT id, dead_lettered_at, type, reason, error FROM dead_letters
         WHERE id > ?1 AND archived_at IS NULL ORDER BY id LIMIT +?2",
    ))?;
    let rows = db(
        stmt.query_map(params![after.0 as i64, i64::from(limit)], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, Option<String>>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, Option<String>>(4)?,
            ))
        }),
    )?;
    let mut out = Vec::new();
    for row in rows {
        let (id, at, ty, reason, error) = db(row)?;
        out.push(RecentDeadLetter::from_columns(
            id,
            at,
            ty,
            &reason,
            error.as_deref(),
        )?);
    }
    Ok(out)
}

pub(super) fn match_dead_letters(
    c: &Connection,
    sel: &Selector,
) -> Result<Vec<(DeadLetterId, Stage)>, StoreError> {
    let map = |r: &Row<'_>| Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?));
    let rows: Vec<(i64, String)> = match sel {
        Selector::Ids(ids) => {
            let json = serde_json::to_string(&ids.iter().map(|i| i.0).collect::<Vec<_>>())
                .map_err(corrupt)?;
            let mut stmt = db(c.prepare_cached(
                "SELECT d.id, d.stage FROM dead_letters d WHERE d.id IN (SELECT value FROM json_each(?1)) ORDER BY d.id",
            ))?;
            let rows = db(stmt.query_map(params![json], map))?;
            rows.collect::<Result<_, _>>()?
        }
        Selector::Filter(f) => {
            let sql =
                format!("SELECT d.id, d.stage FROM dead_letters d WHERE {FILTER} ORDER BY d.id");
            let mut stmt = db(c.prepare_cached(&sql))?;
            let rows = db(stmt.query_map(
                params![
                    f.job_type,
                    f.tenant,
                    f.lane,
                    f.reason,
                    f.source,
                    f.stage,
                    f.job_id.map(|j| j as i64),
                    f.group,
                    f.archived
                ],
                map,
            ))?;
            rows.collect::<Result<_, _>>()?
        }
    };
    Ok(rows
        .into_iter()
        .map(|(id, st)| (DeadLetterId(id as u64), stage(&st)))
        .collect())
}

pub(super) fn audit_page(
    c: &Connection,
    q: &crate::AuditQuery,
) -> Result<crate::AuditPage, StoreError> {
    // One more than asked says whether an older page exists.
    let mut stmt = db(c.prepare_cached(
        "SELECT id, at, actor, action, request, count FROM audit
         WHERE (?1 IS NULL OR id < ?1) AND (?2 IS NULL OR action = ?2) AND (?3 IS NULL OR actor = ?3)
         ORDER BY id DESC LIMIT +?4",
    ))?;
    let rows = db(stmt.query_map(
        params![
            q.before.map(|b| b.0 as i64),
            q.action,
            q.actor,
            i64::from(q.limit) + 1
        ],
        |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, i64>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, i64>(5)?,
            ))
        },
    ))?;
    let mut out = Vec::new();
    for row in rows {
        let (id, at, actor, action, request, count) = db(row)?;
        out.push((
            crate::AuditId(id as u64),
            AuditEntry {
                at: Timestamp::from_millis(at),
                actor,
                action,
                request: serde_json::from_str(&request)
                    .unwrap_or(serde_json::Value::String(request)),
                count: count as u64,
            },
        ));
    }
    let next = if out.len() > q.limit as usize {
        out.truncate(q.limit as usize);
        out.last().map(|(id, _)| *id)
    } else {
        None
    };
    Ok((out, next))
}

pub(super) fn tokens(c: &Connection) -> Result<Vec<crate::ApiToken>, StoreError> {
    let mut stmt = db(c.prepare_cached(
        "SELECT name, role, token_sha256, created_at, created_by FROM tokens ORDER BY created_at, name",
    ))?;
    let rows = db(stmt.query_map([], |r| {
        Ok(crate::ApiToken {
            name: r.get(0)?,
            role: r.get(1)?,
            token_sha256: r.get(2)?,
            created_at: Timestamp::from_millis(r.get(3)?),
            created_by: r.get(4)?,
        })
    }))?;
    let mut out = Vec::new();
    for row in rows {
        out.push(db(row)?);
    }
    Ok(out)
}

/// Dead letters held and their failure groups, per type, per source, and
/// for lazaret's own (no source), from the groups' summary.
const SIGNALS_HELD_SQL: &str = "
SELECT 'type', COALESCE(type, ''), SUM(count), COUNT(*)
FROM dead_letter_groups WHERE archived = 0 GROUP BY type
UNION ALL
SELECT 'source', name, SUM(count), COUNT(*)
FROM dead_letter_group_names WHERE archived = 0 AND what = 'source' GROUP BY name
UNION ALL
SELECT 'source', '', COALESCE(SUM(own), 0), COALESCE(SUM(own > 0), 0) FROM (
    SELECT g.count - COALESCE((SELECT SUM(n.count) FROM dead_letter_group_names n
        WHERE n.group_id = g.group_id AND n.archived = 0 AND n.what = 'source'), 0) AS own
    FROM dead_letter_groups g WHERE g.archived = 0)";

/// Per lane, when its longest-waiting ready job became ready (the typed
/// ready index covers it).
const SIGNALS_OLDEST_SQL: &str =
    "SELECT lane, MIN(run_at) FROM jobs WHERE state = 'queued' GROUP BY lane";

/// Dead letters written in `[?1, ?2)` (`dead_letters_at`).
const SIGNALS_DEAD_SQL: &str = "
SELECT COALESCE(d.type, ''), COALESCE(d.source_name, ''),
       d.redrive_id <> '' OR COALESCE(j.redrives, 0) > 0, COUNT(*)
FROM dead_letters d LEFT JOIN jobs j ON j.id = d.job_id
WHERE d.dead_lettered_at >= ?1 AND d.dead_lettered_at < ?2 GROUP BY 1, 2, 3";

/// Jobs succeeded in `[?1, ?2)` (`jobs_done`).
const SIGNALS_SUCCEEDED_SQL: &str = "
SELECT type, lane, redrives > 0, COUNT(*) FROM jobs
WHERE state = 'succeeded' AND finished_at >= ?1 AND finished_at < ?2 GROUP BY 1, 2, 3";

/// Jobs redriven by the redrives audited in `[?1, ?2)` (`audit_at`).
const SIGNALS_SENT_SQL: &str = "
SELECT COALESCE(j.type, ''), COUNT(*)
FROM audit a JOIN redrive_jobs rj ON rj.audit_id = a.id LEFT JOIN jobs j ON j.id = rj.job_id
WHERE a.at >= ?1 AND a.at < ?2 GROUP BY 1";

/// Broker messages republished, and redriven copies succeeded, in `[?1, ?2)`.
const SIGNALS_MESSAGES_SQL: &str = "
SELECT source, SUM(sent_at >= ?1 AND sent_at < ?2),
       SUM(outcome = 'succeeded' AND outcome_at >= ?1 AND outcome_at < ?2)
FROM redrive_messages
WHERE (sent_at >= ?1 AND sent_at < ?2) OR (outcome_at >= ?1 AND outcome_at < ?2)
GROUP BY source";

fn count(n: Option<i64>) -> u64 {
    u64::try_from(n.unwrap_or(0)).unwrap_or(0)
}

/// What happened in `[from, to)`.
fn signal_events(c: &Connection, from: i64, to: i64) -> Result<crate::signals::Events, StoreError> {
    let mut e = crate::signals::Events::default();
    let mut stmt = db(c.prepare_cached(SIGNALS_DEAD_SQL))?;
    e.dead = db(db(stmt.query_map(params![from, to], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, count(r.get(3)?)))
    }))?
    .collect())?;
    let mut stmt = db(c.prepare_cached(SIGNALS_SUCCEEDED_SQL))?;
    e.succeeded = db(db(stmt.query_map(params![from, to], |r| {
        Ok((r.get(0)?, r.get(1)?, r.get(2)?, count(r.get(3)?)))
    }))?
    .collect())?;
    let mut stmt = db(c.prepare_cached(SIGNALS_SENT_SQL))?;
    e.sent_jobs = db(
        db(stmt.query_map(params![from, to], |r| Ok((r.get(0)?, count(r.get(1)?)))))?.collect(),
    )?;
    let mut stmt = db(c.prepare_cached(SIGNALS_MESSAGES_SQL))?;
    e.messages = db(db(stmt.query_map(params![from, to], |r| {
        Ok((r.get(0)?, count(r.get(1)?), count(r.get(2)?)))
    }))?
    .collect())?;
    Ok(e)
}

/// What a sampling of the charts' signals reads at `now`
/// (`crate::signals`), in one read transaction.
pub(super) fn signal_readings(
    c: &Connection,
    now: Timestamp,
) -> Result<crate::signals::Readings, StoreError> {
    use lazaret_core::series::{By, MINUTE_MS, minute_of};
    let tx = db(c.unchecked_transaction())?;
    let mut held = Vec::new();
    {
        let mut stmt = db(tx.prepare_cached(SIGNALS_HELD_SQL))?;
        let rows = db(stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                count(r.get(2)?),
                count(r.get(3)?),
            ))
        }))?;
        for row in rows {
            let (axis, name, depth, groups) = db(row)?;
            let by = if axis == "type" { By::Type } else { By::Source };
            held.push((by, name, depth, groups));
        }
    }
    let oldest = {
        let mut stmt = db(tx.prepare_cached(SIGNALS_OLDEST_SQL))?;
        db(db(stmt.query_map([], |r| {
            Ok((r.get::<_, String>(0)?, Timestamp::from_millis(r.get(1)?)))
        }))?
        .collect())?
    };
    let minute = minute_of(now).as_millis();
    let current = signal_events(&tx, minute, now.as_millis() + 1)?;
    let previous = signal_events(&tx, minute - MINUTE_MS, minute)?;
    db(tx.commit())?;
    Ok(crate::signals::Readings {
        now,
        held,
        oldest,
        current,
        previous,
    })
}

/// The charts' samples of the minutes in `[from, to)`.
pub(super) fn signal_samples(
    c: &Connection,
    &from: &Timestamp,
    &to: &Timestamp,
) -> Result<crate::SignalSamples, StoreError> {
    let mut stmt = db(c.prepare_cached(
        "SELECT minute, signal, axis, name, value FROM signal_samples
         WHERE minute >= ?1 AND minute < ?2 ORDER BY minute, signal, axis, name",
    ))?;
    let rows = db(
        stmt.query_map(params![from.as_millis(), to.as_millis()], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, i64>(4)?,
            ))
        }),
    )?;
    let mut out = crate::SignalSamples::default();
    for row in rows {
        let (minute, signal, axis, name, value) = db(row)?;
        if signal == lazaret_core::series::SAMPLED {
            out.sampled.push(Timestamp::from_millis(minute));
        } else if let Some(s) = crate::signals::sample_of(minute, &signal, &axis, name, value) {
            out.samples.push(s);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SQLite's plan for a page of jobs, one line per step.
    fn plan(q: &JobQuery) -> String {
        let c = Connection::open_in_memory().unwrap();
        super::super::schema::migrate(&c).unwrap();
        let (sql, values) = jobs_sql(q, JOBS_PAGE_ROWS_MAX);
        let mut stmt = c.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
        let rows = stmt
            .query_map(rusqlite::params_from_iter(values.iter()), |r| {
                r.get::<_, String>(3)
            })
            .unwrap();
        rows.map(Result::unwrap).collect::<Vec<_>>().join("\n")
    }

    #[test]
    fn a_page_reads_a_bounded_range_of_the_rowid_whatever_its_filters() {
        let queries = JobState::ALL.into_iter().flat_map(|state| {
            [
                JobQuery {
                    state: Some(state),
                    limit: 50,
                    ..JobQuery::default()
                },
                JobQuery {
                    state: Some(state),
                    job_type: Some("resize".into()),
                    tenant: Some("acme".into()),
                    lane: Some("default".into()),
                    enqueued_by: Some("alice".into()),
                    before: Some(JobId(1000)),
                    limit: 50,
                },
            ]
        });
        for q in queries {
            let plan = plan(&q);
            assert!(
                plan.contains("SEARCH jobs USING INTEGER PRIMARY KEY (rowid<?)"),
                "{q:?}: {plan}"
            );
            // The outer `SCAN jobs` reads the bounded inner read (the
            // co-routine), not the table.
            assert!(plan.starts_with("CO-ROUTINE jobs"), "{q:?}: {plan}");
            assert!(!plan.contains("TEMP B-TREE"), "{q:?} sorts: {plan}");
            let (sql, _) = jobs_sql(&q, JOBS_PAGE_ROWS_MAX);
            assert!(sql.contains("LIMIT +?2"), "the read has its budget: {sql}");
        }
    }

    #[test]
    fn without_a_state_filter_the_page_walks_the_rowid_from_the_cursor_without_sorting() {
        let plan = plan(&JobQuery {
            tenant: Some("acme".into()),
            before: Some(JobId(1000)),
            limit: 50,
            ..JobQuery::default()
        });
        assert!(
            plan.contains("SEARCH jobs USING INTEGER PRIMARY KEY (rowid<?)"),
            "{plan}"
        );
        assert!(!plan.contains("TEMP B-TREE"), "{plan}");
    }

    /// A filter that matches only old rows gets short pages, each with a
    /// cursor past what it read, until the match; then the end.
    #[test]
    fn a_page_that_spends_its_budget_first_says_where_to_go_on() {
        let c = Connection::open_in_memory().unwrap();
        super::super::schema::migrate(&c).unwrap();
        for id in 1..=20 {
            let ty = if id <= 2 { "rare" } else { "bulk" };
            c.execute(
                "INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, created_at, payload)
                 VALUES (?1, ?2, 'acme', 'default', 'succeeded', 0, 1, 0, X'7B7D')",
                params![id, ty],
            )
            .unwrap();
        }
        let mut q = JobQuery {
            job_type: Some("rare".into()),
            limit: 10,
            ..JobQuery::default()
        };
        let mut pages = Vec::new();
        loop {
            let (items, next) = jobs_within(&c, &q, 5).unwrap();
            pages.push((
                items.iter().map(|j| j.envelope.id.0).collect::<Vec<_>>(),
                next.map(|n| n.0),
            ));
            match next {
                Some(n) => q.before = Some(n),
                None => break,
            }
        }
        assert_eq!(
            pages,
            [
                (vec![], Some(16)),
                (vec![], Some(11)),
                (vec![], Some(6)),
                (vec![2, 1], None)
            ]
        );
    }
}
