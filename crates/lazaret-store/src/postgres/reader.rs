//! Reads, on the reader connections (each a snapshot of committed data).

use lazaret_core::{Envelope, Failure, JobId, JobState, Timestamp};
use tokio_postgres::{Client, Row};

// The read of recent dead letters lives with the cluster's events.
pub(super) use super::cluster::dead_letters_after;
use super::pg;
use super::writer::{JOB_COLUMNS, stored_job};
use crate::{
    ApiToken, AuditEntry, AuditId, AuditPage, AuditQuery, DeadLetter, DeadLetterFilter,
    DeadLetterId, FailureGroup, GROUP_NAMES_MAX, GroupCursor, GroupQuery, Held, HeldRetry, JobView,
    ReasonCount, Selector, SourceRef, Stage, StoreError, Switch,
};

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

/// What a job view reads after the `StoredJob` columns.
const VIEW_COLUMNS: &str = "run_at, lease_expires_at, enqueued_by, cancel_requested, \
     (SELECT d.id FROM dead_letters d WHERE d.job_id = jobs.id) AS dead_letter_id, traceparent";

fn view(r: &Row) -> Result<JobView, StoreError> {
    let stored = stored_job(r)?;
    let run_at: i64 = r.get(14);
    let lease: Option<i64> = r.get(15);
    let enqueued_by: Option<String> = r.get(16);
    let cancel_requested: bool = r.get(17);
    let dead_letter_id: Option<i64> = r.get(18);
    let envelope = stored.envelope()?;
    let state = stored.state;
    let run_at = matches!(state, JobState::Queued | JobState::Scheduled)
        .then_some(Timestamp::from_millis(run_at));
    Ok(JobView {
        envelope,
        state,
        run_at,
        payload: stored.payload,
        lease_expires_at: lease.map(Timestamp::from_millis),
        enqueued_by,
        dead_letter_id: dead_letter_id.map(|d| DeadLetterId(d as u64)),
        cancel_requested,
    })
}

pub(super) async fn job(c: &Client, &id: &JobId) -> Result<Option<JobView>, StoreError> {
    let sql = format!("SELECT {JOB_COLUMNS}, {VIEW_COLUMNS} FROM jobs WHERE id = $1");
    pg(c.query_opt(&sql, &[&(id.0 as i64)]).await)?
        .map(|r| view(&r))
        .transpose()
}

/// A page of jobs, newest first: `jobs_state (state, id)` with a state
/// filter, the primary key without.
pub(super) async fn jobs(c: &Client, q: &crate::JobQuery) -> Result<crate::JobPage, StoreError> {
    let sql = format!(
        "SELECT {JOB_COLUMNS}, {VIEW_COLUMNS} FROM jobs
         WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR type = $2)
           AND ($3::text IS NULL OR tenant = $3) AND ($4::text IS NULL OR lane = $4)
           AND ($5::text IS NULL OR enqueued_by = $5) AND ($6::int8 IS NULL OR id < $6)
         ORDER BY id DESC LIMIT $7"
    );
    let rows = pg(c
        .query(
            &sql,
            &[
                &q.state.map(|s| s.as_str()),
                &q.job_type,
                &q.tenant,
                &q.lane,
                &q.enqueued_by,
                &q.before.map(|b| b.0 as i64),
                &(i64::from(q.limit) + 1),
            ],
        )
        .await)?;
    let mut items = rows.iter().map(view).collect::<Result<Vec<_>, _>>()?;
    let next = if items.len() > q.limit as usize {
        items.truncate(q.limit as usize);
        items.last().map(|j| j.envelope.id)
    } else {
        None
    };
    Ok((items, next))
}

pub(super) async fn pauses(c: &Client) -> Result<Vec<crate::Pause>, StoreError> {
    let rows = pg(c
        .query(
            "SELECT target, name, paused_at, paused_by FROM pauses ORDER BY target, name",
            &[],
        )
        .await)?;
    let mut out = Vec::new();
    for r in rows {
        let (target, name): (String, String) = (r.get(0), r.get(1));
        let target = match target.as_str() {
            "type" => crate::PauseTarget::Type(name),
            "lane" => crate::PauseTarget::Lane(name),
            other => return Err(corrupt(format!("a pause of an unknown target {other:?}"))),
        };
        out.push(crate::Pause {
            target,
            paused_at: Timestamp::from_millis(r.get(2)),
            paused_by: r.get(3),
        });
    }
    Ok(out)
}

const DL_COLUMNS: &str = "d.id, d.job_id, d.type, d.tenant, d.lane, d.reason, d.stage, d.attempts, d.error,
    d.idempotency_key, d.created_at, d.dead_lettered_at, d.payload_size, d.payload_sha256, d.payload_preview,
    COALESCE(j.envelope, d.envelope), d.source, d.group_id, d.fingerprint, d.archived_at,
    COALESCE(d.traceparent, j.traceparent)";

fn dead_letter_row(r: &Row) -> Result<DeadLetter, StoreError> {
    let envelope: Option<String> = r.get(15);
    let env = envelope
        .map(|e| Envelope::from_json(&e))
        .transpose()
        .map_err(corrupt)?;
    let error: Option<String> = r.get(8);
    let error: Option<Failure> = error
        .map(|e| serde_json::from_str(&e))
        .transpose()
        .map_err(corrupt)?;
    let reason: String = r.get(5);
    let stage: String = r.get(6);
    let source: Option<String> = r.get(16);
    Ok(DeadLetter {
        id: DeadLetterId(r.get::<_, i64>(0) as u64),
        job_id: r.get::<_, Option<i64>>(1).map(|j| JobId(j as u64)),
        job_type: r.get(2),
        tenant: r.get(3),
        lane: r.get(4),
        reason: reason.parse().map_err(corrupt)?,
        stage: Stage::parse(&stage).unwrap_or(Stage::Processing),
        attempts: r.get::<_, i32>(7) as u32,
        error,
        history: env.as_ref().map(|e| e.history.clone()).unwrap_or_default(),
        idempotency_key: r.get(9),
        created_at: Timestamp::from_millis(r.get(10)),
        dead_lettered_at: Timestamp::from_millis(r.get(11)),
        payload_size: r.get::<_, i64>(12) as u64,
        payload_sha256: r.get(13),
        payload_preview: r.get(14),
        redrive_count: env.as_ref().map_or(0, |e| e.redrive_count),
        schema_version: env.as_ref().and_then(|e| e.schema_version),
        source: source
            .map(|s| serde_json::from_str(&s))
            .transpose()
            .map_err(corrupt)?,
        group_id: r.get(17),
        fingerprint: r.get(18),
        archived_at: r.get::<_, Option<i64>>(19).map(Timestamp::from_millis),
        traceparent: crate::stored::stored_traceparent(r.get(20)),
    })
}

const FILTER: &str = "($1::text IS NULL OR d.type = $1) AND ($2::text IS NULL OR d.tenant = $2)
    AND ($3::text IS NULL OR d.lane = $3) AND ($4::text IS NULL OR d.reason = $4)
    AND ($5::text IS NULL OR d.source_name = $5) AND ($6::text IS NULL OR d.stage = $6)
    AND ($7::int8 IS NULL OR d.job_id = $7) AND ($8::text IS NULL OR d.group_id = $8)
    AND (d.archived_at IS NOT NULL) = $9";

pub(super) async fn dead_letters(
    c: &Client,
    f: &DeadLetterFilter,
    &limit: &u32,
    &cursor: &Option<DeadLetterId>,
) -> Result<(Vec<DeadLetter>, Option<DeadLetterId>), StoreError> {
    let sql = format!(
        "SELECT {DL_COLUMNS} FROM dead_letters d LEFT JOIN jobs j ON j.id = d.job_id
         WHERE {FILTER} AND ($10::int8 IS NULL OR d.id < $10) ORDER BY d.id DESC LIMIT $11"
    );
    let rows = pg(c
        .query(
            &sql,
            &[
                &f.job_type,
                &f.tenant,
                &f.lane,
                &f.reason,
                &f.source,
                &f.stage,
                &f.job_id.map(|j| j as i64),
                &f.group,
                &f.archived,
                &cursor.map(|c| c.0 as i64),
                &(i64::from(limit) + 1),
            ],
        )
        .await)?;
    let mut items = rows
        .iter()
        .map(dead_letter_row)
        .collect::<Result<Vec<_>, _>>()?;
    let next = if items.len() > limit as usize {
        items.truncate(limit as usize);
        items.last().map(|d| d.id)
    } else {
        None
    };
    Ok((items, next))
}

pub(super) async fn dead_letter(
    c: &Client,
    &id: &DeadLetterId,
) -> Result<Option<DeadLetter>, StoreError> {
    let sql = format!(
        "SELECT {DL_COLUMNS} FROM dead_letters d LEFT JOIN jobs j ON j.id = d.job_id WHERE d.id = $1"
    );
    pg(c.query_opt(&sql, &[&(id.0 as i64)]).await)?
        .map(|r| dead_letter_row(&r))
        .transpose()
}

pub(super) async fn dead_letter_payload(
    c: &Client,
    &id: &DeadLetterId,
) -> Result<Option<Option<Vec<u8>>>, StoreError> {
    let row = pg(c
        .query_opt(
            "SELECT CASE WHEN d.job_id IS NOT NULL THEN j.payload ELSE d.payload END
             FROM dead_letters d LEFT JOIN jobs j ON j.id = d.job_id WHERE d.id = $1",
            &[&(id.0 as i64)],
        )
        .await)?;
    Ok(row.map(|r| r.get::<_, Option<Vec<u8>>>(0)))
}

pub(super) async fn reasons(c: &Client) -> Result<Vec<ReasonCount>, StoreError> {
    let rows = pg(c
        .query(
            "SELECT reason, type, count(*), min(dead_lettered_at), max(dead_lettered_at)
             FROM dead_letters WHERE archived_at IS NULL
             GROUP BY reason, type ORDER BY count(*) DESC, reason, type",
            &[],
        )
        .await)?;
    rows.iter()
        .map(|r| {
            let reason: String = r.get(0);
            Ok(ReasonCount {
                reason: reason.parse().map_err(corrupt)?,
                job_type: r.get(1),
                count: r.get::<_, i64>(2) as u64,
                first_at: Timestamp::from_millis(r.get(3)),
                last_at: Timestamp::from_millis(r.get(4)),
            })
        })
        .collect()
}

/// A page of failure groups (as SQLite's `reader::groups`), in one
/// statement: without a filter, or by type or reason only, the page is
/// read from the groups' summary (`dead_letter_groups`) in its index's
/// order, with the last hour's count on `dead_letters_group`; a filter by
/// source, tenant or time counts the matching dead letters instead. Each
/// group of the page is described from its summary: its newest dead letter
/// (`sample_id`), tenants and sources (`dead_letter_group_names`).
pub(super) async fn groups(
    c: &Client,
    q: &GroupQuery,
) -> Result<(Vec<FailureGroup>, Option<GroupCursor>), StoreError> {
    // `page` has (group_id, count, first_at, last_at, rate, sample_id).
    const DESCRIBED: &str = "
        SELECT p.group_id, p.count, p.first_at, p.last_at, p.rate,
               d.id, d.type, d.reason, d.error, d.fingerprint,
               ARRAY(SELECT n.name FROM dead_letter_group_names n
                     WHERE n.group_id = p.group_id AND n.archived = $1 AND n.what = 'tenant'
                     ORDER BY n.name LIMIT $11),
               ARRAY(SELECT n.name FROM dead_letter_group_names n
                     WHERE n.group_id = p.group_id AND n.archived = $1 AND n.what = 'source'
                     ORDER BY n.name LIMIT $11),
               -- held for a person: jobs redriven redrives_max times ($12)
               (SELECT count(*) FROM dead_letters h JOIN jobs j ON j.id = h.job_id
                WHERE $12::int4 IS NOT NULL AND h.group_id = p.group_id
                  AND (h.archived_at IS NOT NULL) = $1
                  AND h.stage = 'processing' AND j.redrives >= $12)
        FROM page p JOIN dead_letters d ON d.id = p.sample_id
        ORDER BY p.last_at DESC, p.group_id";
    let narrowed = q.source.is_some() || q.tenant.is_some() || q.since.is_some();
    let page = if narrowed {
        "SELECT a.*, g.sample_id FROM (
             SELECT d.group_id, count(*) AS count, min(d.dead_lettered_at) AS first_at,
                    max(d.dead_lettered_at) AS last_at,
                    count(*) FILTER (WHERE d.dead_lettered_at >= $7) AS rate
             FROM dead_letters d
             WHERE (d.archived_at IS NOT NULL) = $1
               AND ($2::text IS NULL OR d.type = $2) AND ($3::text IS NULL OR d.reason = $3)
               AND ($4::text IS NULL OR d.source_name = $4) AND ($5::text IS NULL OR d.tenant = $5)
               AND ($6::int8 IS NULL OR d.dead_lettered_at >= $6)
             GROUP BY d.group_id
             HAVING $8::int8 IS NULL OR max(d.dead_lettered_at) < $8
                 OR (max(d.dead_lettered_at) = $8 AND d.group_id > $9::text)
             ORDER BY max(d.dead_lettered_at) DESC, d.group_id LIMIT $10
         ) a JOIN dead_letter_groups g ON g.group_id = a.group_id AND g.archived = $1"
    } else {
        // The page first, then the hour's count of its groups only. The
        // cursor's `last_at <= $8` lets the page index seek to it; the
        // unused parameters are typed so that both statements take the same.
        "SELECT s.group_id, s.count, s.first_at, s.last_at,
                (SELECT count(*) FROM dead_letters r
                 WHERE r.group_id = s.group_id AND r.dead_lettered_at >= $7
                   AND (r.archived_at IS NOT NULL) = $1) AS rate,
                s.sample_id
         FROM (SELECT g.group_id, g.count, g.first_at, g.last_at, g.sample_id
               FROM dead_letter_groups g
               WHERE g.archived = $1 AND ($2::text IS NULL OR g.type = $2)
                 AND ($3::text IS NULL OR g.reason = $3)
                 AND $4::text IS NULL AND $5::text IS NULL AND $6::int8 IS NULL
                 AND ($8::int8 IS NULL
                      OR (g.last_at <= $8 AND (g.last_at < $8 OR g.group_id > $9::text)))
               ORDER BY g.last_at DESC, g.group_id LIMIT $10) s"
    };
    let hour_ago = q.now.as_millis().saturating_sub(3_600_000);
    let rows = pg(c
        .query(
            &format!("WITH page AS ({page}) {DESCRIBED}"),
            &[
                &q.archived,
                &q.job_type,
                &q.reason,
                &q.source,
                &q.tenant,
                &q.since.map(|t| t.as_millis()),
                &hour_ago,
                &q.cursor.as_ref().map(|c| c.last_at.as_millis()),
                &q.cursor.as_ref().map(|c| c.id.clone()),
                &(i64::from(q.limit) + 1),
                &(GROUP_NAMES_MAX as i64),
                &q.redrives_max.map(|max| max.min(i32::MAX as u32) as i32),
            ],
        )
        .await)?;
    let more = rows.len() > q.limit as usize;
    let mut out = Vec::new();
    for r in rows.iter().take(q.limit as usize) {
        let error: Option<Failure> = r
            .get::<_, Option<String>>(8)
            .map(|e| serde_json::from_str(&e))
            .transpose()
            .map_err(corrupt)?;
        let reason: String = r.get(7);
        out.push(FailureGroup {
            id: r.get(0),
            held: r.get::<_, i64>(12) as u64,
            count: r.get::<_, i64>(1) as u64,
            first_at: Timestamp::from_millis(r.get(2)),
            last_at: Timestamp::from_millis(r.get(3)),
            rate_1h: r.get::<_, i64>(4) as u64,
            sample_id: DeadLetterId(r.get::<_, i64>(5) as u64),
            job_type: r.get(6),
            reason: reason.parse().map_err(corrupt)?,
            kind: error.as_ref().map(|e| e.kind.as_str().to_owned()),
            fingerprint: r.get(9),
            sample_error: error.map(|e| e.message),
            tenants: r.get(10),
            sources: r.get(11),
        });
    }
    let next = if more {
        out.last().map(|g| GroupCursor {
            last_at: g.last_at,
            id: g.id.clone(),
        })
    } else {
        None
    };
    Ok((out, next))
}

/// A job's audited redrives, oldest first (as SQLite's `reader::lineage`).
pub(super) async fn lineage(
    c: &Client,
    &job_id: &JobId,
) -> Result<Vec<crate::LineageEntry>, StoreError> {
    let rows = pg(c
        .query(
            "SELECT (SELECT min(r.id) FROM redrives r WHERE r.audit_id = rj.audit_id),
                    a.at, a.actor, a.action, a.request, a.count,
                    rj.from_group, rj.edited, rj.to_type, rj.to_lane
             FROM redrive_jobs rj JOIN audit a ON a.id = rj.audit_id
             WHERE rj.job_id = $1 ORDER BY rj.audit_id",
            &[&(job_id.0 as i64)],
        )
        .await)?;
    rows.iter().map(lineage_entry).collect()
}

/// A broker dead letter's lineage (as SQLite's `reader::message_lineage`):
/// the redrive whose copy became it, then the one whose copy became the
/// dead letter that redrive came from, and so on, oldest first.
pub(super) async fn message_lineage(
    c: &Client,
    &dead_letter: &DeadLetterId,
) -> Result<Vec<crate::LineageEntry>, StoreError> {
    let rows = pg(c
        .query(
            "WITH RECURSIVE chain (dl, depth) AS (
                 SELECT $1::int8, 0
                 UNION ALL
                 SELECT m.dead_letter_id, chain.depth + 1
                 FROM redrive_messages m JOIN chain ON m.dead_letter_again = chain.dl
                 WHERE chain.depth < 1000
             )
             SELECT m.redrive_id, a.at, a.actor, a.action, a.request, a.count,
                    m.from_group, false, NULL::text, NULL::text
             FROM chain
             JOIN redrive_messages m ON m.dead_letter_again = chain.dl
             JOIN redrives r ON r.id = m.redrive_id
             JOIN audit a ON a.id = r.audit_id
             ORDER BY chain.depth DESC",
            &[&(dead_letter.0 as i64)],
        )
        .await)?;
    rows.iter().map(lineage_entry).collect()
}

/// A lineage row: redrive id, its audit entry's at, actor, action, request
/// and count, from_group, edited, to_type, to_lane.
fn lineage_entry(r: &tokio_postgres::Row) -> Result<crate::LineageEntry, StoreError> {
    let request: String = r.get(4);
    Ok(crate::LineageEntry {
        redrive_id: r.get(0),
        audit: AuditEntry {
            at: Timestamp::from_millis(r.get(1)),
            actor: r.get(2),
            action: r.get(3),
            request: serde_json::from_str(&request).map_err(corrupt)?,
            count: r.get::<_, i64>(5) as u64,
        },
        from_group: r.get(6),
        edited: r.get(7),
        to_type: r.get(8),
        to_lane: r.get(9),
    })
}

/// A redrive's report (as SQLite's `reader::redrive_report`).
pub(super) async fn redrive_report(
    c: &Client,
    id: &str,
) -> Result<Option<crate::RedriveReport>, StoreError> {
    let Some(a) = pg(c
        .query_opt(
            "SELECT a.id, a.at, a.actor, a.action, a.request, a.count
             FROM redrives r JOIN audit a ON a.id = r.audit_id WHERE r.id = $1",
            &[&id],
        )
        .await)?
    else {
        return Ok(None);
    };
    let rows = pg(c
        .query(
            "SELECT rj.from_group, j.state, d.group_id
             FROM redrive_jobs rj
             LEFT JOIN jobs j ON j.id = rj.job_id
             LEFT JOIN dead_letters d ON d.job_id = rj.job_id
             WHERE rj.audit_id = $1",
            &[&a.get::<_, i64>(0)],
        )
        .await)?;
    let messages = pg(c
        .query(
            "SELECT from_group, outcome, group_again FROM redrive_messages WHERE redrive_id = $1",
            &[&id],
        )
        .await)?;
    let request: String = a.get(4);
    Ok(Some(crate::RedriveReport::tally(
        id,
        AuditEntry {
            at: Timestamp::from_millis(a.get(1)),
            actor: a.get(2),
            action: a.get(3),
            request: serde_json::from_str(&request).map_err(corrupt)?,
            count: a.get::<_, i64>(5) as u64,
        },
        rows.iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect(),
        messages
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect(),
    )))
}

pub(super) async fn match_dead_letters(
    c: &Client,
    sel: &Selector,
) -> Result<Vec<(DeadLetterId, Stage)>, StoreError> {
    let rows = match sel {
        Selector::Ids(ids) => {
            let ids: Vec<i64> = ids.iter().map(|i| i.0 as i64).collect();
            pg(c.query(
                "SELECT d.id, d.stage FROM dead_letters d WHERE d.id = ANY($1) ORDER BY d.id",
                &[&ids],
            )
            .await)?
        }
        Selector::Filter(f) => {
            let sql =
                format!("SELECT d.id, d.stage FROM dead_letters d WHERE {FILTER} ORDER BY d.id");
            pg(c.query(
                &sql,
                &[
                    &f.job_type,
                    &f.tenant,
                    &f.lane,
                    &f.reason,
                    &f.source,
                    &f.stage,
                    &f.job_id.map(|j| j as i64),
                    &f.group,
                    &f.archived,
                ],
            )
            .await)?
        }
    };
    Ok(rows
        .iter()
        .map(|r| {
            let stage: String = r.get(1);
            (
                DeadLetterId(r.get::<_, i64>(0) as u64),
                Stage::parse(&stage).unwrap_or(Stage::Processing),
            )
        })
        .collect())
}

pub(super) async fn audit_page(c: &Client, q: &AuditQuery) -> Result<AuditPage, StoreError> {
    let rows = pg(c
        .query(
            "SELECT id, at, actor, action, request, count FROM audit
             WHERE ($1::int8 IS NULL OR id < $1) AND ($2::text IS NULL OR action = $2)
               AND ($3::text IS NULL OR actor = $3)
             ORDER BY id DESC LIMIT $4",
            &[
                &q.before.map(|b| b.0 as i64),
                &q.action,
                &q.actor,
                &(i64::from(q.limit) + 1),
            ],
        )
        .await)?;
    let mut out: Vec<(AuditId, AuditEntry)> = rows
        .iter()
        .map(|r| {
            let request: String = r.get(4);
            (
                AuditId(r.get::<_, i64>(0) as u64),
                AuditEntry {
                    at: Timestamp::from_millis(r.get(1)),
                    actor: r.get(2),
                    action: r.get(3),
                    request: serde_json::from_str(&request)
                        .unwrap_or(serde_json::Value::String(request)),
                    count: r.get::<_, i64>(5) as u64,
                },
            )
        })
        .collect();
    let next = if out.len() > q.limit as usize {
        out.truncate(q.limit as usize);
        out.last().map(|(id, _)| *id)
    } else {
        None
    };
    Ok((out, next))
}

pub(super) async fn tokens(c: &Client) -> Result<Vec<ApiToken>, StoreError> {
    let rows = pg(c
        .query(
            "SELECT name, role, token_sha256, created_at, created_by FROM tokens ORDER BY created_at, name",
            &[],
        )
        .await)?;
    Ok(rows
        .iter()
        .map(|r| ApiToken {
            name: r.get(0),
            role: r.get(1),
            token_sha256: r.get(2),
            created_at: Timestamp::from_millis(r.get(3)),
            created_by: r.get(4),
        })
        .collect())
}

fn held_retry_row(r: &Row) -> Result<HeldRetry, StoreError> {
    let src: String = r.get(1);
    let env: String = r.get(2);
    Ok(HeldRetry {
        source: serde_json::from_str::<SourceRef>(&src).map_err(corrupt)?,
        due_at: Timestamp::from_millis(r.get(0)),
        envelope: Envelope::from_json(&env).map_err(corrupt)?,
        body: r.get(3),
    })
}

pub(super) async fn due_held_retries(
    c: &Client,
    source: &str,
    &now: &Timestamp,
    &limit: &u32,
) -> Result<Vec<HeldRetry>, StoreError> {
    let rows = pg(c
        .query(
            "SELECT due_at, ref, envelope, body FROM source_held_retries
             WHERE source = $1 AND due_at <= $2 ORDER BY due_at LIMIT $3",
            &[&source, &now.as_millis(), &i64::from(limit)],
        )
        .await)?;
    rows.iter().map(held_retry_row).collect()
}

/// Claims the due, unclaimed (or expired-claim) held retries of a source,
/// earliest first: one autocommit statement, rows locked by another
/// node's claim in flight are skipped (`FOR UPDATE SKIP LOCKED`), and a
/// row claimed already is left until its claim expires.
pub(super) async fn claim_due(
    c: &Client,
    source: &str,
    now: Timestamp,
    limit: u32,
    claimer: &str,
    expires_at: Timestamp,
) -> Result<Vec<crate::ClaimedRetry>, StoreError> {
    // `d` is read before the update: its `claimed_by` is the claimer whose
    // claim had expired.
    let rows = pg(c
        .query(
            "UPDATE source_held_retries p SET claimed_by = $4, claim_expires_at = $5
             FROM (SELECT source, message_id, payload_sha256, redrive_id, claimed_by FROM source_held_retries
                   WHERE source = $1 AND due_at <= $2
                     AND (claim_expires_at IS NULL OR claim_expires_at <= $2)
                   ORDER BY due_at LIMIT $3
                   FOR UPDATE SKIP LOCKED) d
             WHERE p.source = d.source AND p.message_id = d.message_id
               AND p.payload_sha256 = d.payload_sha256 AND p.redrive_id = d.redrive_id
             RETURNING p.due_at, p.ref, p.envelope, p.body, d.claimed_by",
            &[
                &source,
                &now.as_millis(),
                &i64::from(limit),
                &claimer,
                &expires_at.as_millis(),
            ],
        )
        .await)?;
    let mut out = rows
        .iter()
        .map(|r| {
            Ok(crate::ClaimedRetry {
                retry: held_retry_row(r)?,
                lapsed_claim: r.get(4),
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    out.sort_by_key(|c| c.retry.due_at.as_millis());
    Ok(out)
}

pub(super) async fn held_retry(
    c: &Client,
    key: &crate::MessageKey,
) -> Result<Option<HeldRetry>, StoreError> {
    pg(c.query_opt(
        "SELECT due_at, ref, envelope, body FROM source_held_retries WHERE source = $1 AND message_id = $2
           AND payload_sha256 = $3 AND redrive_id = $4",
        &[
            &key.source,
            &key.message_id,
            &key.payload_sha256,
            &key.redrive_column(),
        ],
    )
    .await)?
    .map(|r| held_retry_row(&r))
    .transpose()
}

pub(super) async fn next_held_retry_due(
    c: &Client,
    source: &str,
) -> Result<Option<Timestamp>, StoreError> {
    let row = pg(c
        .query_one(
            "SELECT min(due_at) FROM source_held_retries WHERE source = $1",
            &[&source],
        )
        .await)?;
    Ok(row.get::<_, Option<i64>>(0).map(Timestamp::from_millis))
}

pub(super) async fn message_held(c: &Client, key: &crate::MessageKey) -> Result<Held, StoreError> {
    let (source, message_id) = (&key.source, &key.message_id);
    if let Some(r) = pg(c
        .query_opt(
            "SELECT id FROM dead_letters WHERE source_name = $1 AND message_id = $2
               AND payload_sha256 = $3 AND redrive_id = $4",
            &[
                source,
                message_id,
                &key.payload_sha256,
                &key.redrive_column(),
            ],
        )
        .await)?
    {
        return Ok(Held::Quarantined(DeadLetterId(r.get::<_, i64>(0) as u64)));
    }
    let retry = pg(c
        .query_opt(
            "SELECT 1 FROM source_held_retries WHERE source = $1 AND message_id = $2
               AND payload_sha256 = $3 AND redrive_id = $4",
            &[
                source,
                message_id,
                &key.payload_sha256,
                &key.redrive_column(),
            ],
        )
        .await)?;
    Ok(if retry.is_some() {
        Held::Retry
    } else {
        Held::Nothing
    })
}

/// Keeps a switch for nodes that start later (a resume deletes its pause).
pub(super) async fn save_switch(c: &Client, s: &Switch) -> Result<(), StoreError> {
    let (kind, key, until, keep) = match s {
        Switch::PauseType { name, paused } => ("pause_type", name.clone(), None, *paused),
        Switch::PauseLane { name, paused } => ("pause_lane", name.clone(), None, *paused),
        Switch::BreakerOpen {
            job_type,
            kind,
            until_ms,
        } => (
            "breaker",
            format!("{job_type}\u{1f}{kind}"),
            Some(*until_ms),
            true,
        ),
        Switch::BreakerClosed { job_type, kind } => {
            ("breaker", format!("{job_type}\u{1f}{kind}"), None, false)
        }
    };
    if keep {
        pg(c.execute(
            "INSERT INTO cluster_state (kind, key, until) VALUES ($1, $2, $3)
             ON CONFLICT (kind, key) DO UPDATE SET until = excluded.until",
            &[&kind, &key, &until],
        )
        .await)?;
    } else {
        pg(c.execute(
            "DELETE FROM cluster_state WHERE kind = $1 AND key = $2",
            &[&kind, &key],
        )
        .await)?;
    }
    Ok(())
}

pub(super) async fn switches(c: &Client) -> Result<Vec<Switch>, StoreError> {
    let rows = pg(c
        .query(
            "SELECT kind, key, until FROM cluster_state ORDER BY kind, key",
            &[],
        )
        .await)?;
    let mut out = Vec::new();
    for r in rows {
        let (kind, key, until): (String, String, Option<i64>) = (r.get(0), r.get(1), r.get(2));
        match kind.as_str() {
            "pause_type" => out.push(Switch::PauseType {
                name: key,
                paused: true,
            }),
            "pause_lane" => out.push(Switch::PauseLane {
                name: key,
                paused: true,
            }),
            "breaker" => {
                if let (Some((t, k)), Some(u)) = (key.split_once('\u{1f}'), until) {
                    out.push(Switch::BreakerOpen {
                        job_type: t.to_owned(),
                        kind: k.to_owned(),
                        until_ms: u,
                    });
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// As SQLite's `reader::signal_readings`: dead letters held and their
/// failure groups, per type, per source and for lazaret's own.
const SIGNALS_HELD_SQL: &str = "
SELECT 'type', coalesce(type, ''), sum(count)::int8, count(*)::int8
FROM dead_letter_groups WHERE NOT archived GROUP BY type
UNION ALL
SELECT 'source', name, sum(count)::int8, count(*)::int8
FROM dead_letter_group_names WHERE NOT archived AND what = 'source' GROUP BY name
UNION ALL
SELECT 'source', '', coalesce(sum(own), 0)::int8, count(*) FILTER (WHERE own > 0) FROM (
    SELECT g.count - coalesce((SELECT sum(n.count) FROM dead_letter_group_names n
        WHERE n.group_id = g.group_id AND NOT n.archived AND n.what = 'source'), 0) AS own
    FROM dead_letter_groups g WHERE NOT g.archived) o";

const SIGNALS_OLDEST_SQL: &str =
    "SELECT lane, min(run_at) FROM jobs WHERE state = 'queued' GROUP BY lane";

const SIGNALS_DEAD_SQL: &str = "
SELECT coalesce(d.type, ''), coalesce(d.source_name, ''),
       d.redrive_id <> '' OR coalesce(j.redrives, 0) > 0, count(*)::int8
FROM dead_letters d LEFT JOIN jobs j ON j.id = d.job_id
WHERE d.dead_lettered_at >= $1 AND d.dead_lettered_at < $2 GROUP BY 1, 2, 3";

const SIGNALS_SUCCEEDED_SQL: &str = "
SELECT type, lane, redrives > 0, count(*)::int8 FROM jobs
WHERE state = 'succeeded' AND finished_at >= $1 AND finished_at < $2 GROUP BY 1, 2, 3";

const SIGNALS_SENT_SQL: &str = "
SELECT coalesce(j.type, ''), count(*)::int8
FROM audit a JOIN redrive_jobs rj ON rj.audit_id = a.id LEFT JOIN jobs j ON j.id = rj.job_id
WHERE a.at >= $1 AND a.at < $2 GROUP BY 1";

const SIGNALS_MESSAGES_SQL: &str = "
SELECT source, count(*) FILTER (WHERE sent_at >= $1 AND sent_at < $2),
       count(*) FILTER (WHERE outcome = 'succeeded' AND outcome_at >= $1 AND outcome_at < $2)
FROM redrive_messages
WHERE (sent_at >= $1 AND sent_at < $2) OR (outcome_at >= $1 AND outcome_at < $2)
GROUP BY source";

fn count_of(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

async fn signal_events(
    c: &Client,
    from: i64,
    to: i64,
) -> Result<crate::signals::Events, StoreError> {
    let range: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&from, &to];
    let dead = pg(c.query(SIGNALS_DEAD_SQL, &range).await)?;
    let succeeded = pg(c.query(SIGNALS_SUCCEEDED_SQL, &range).await)?;
    let sent = pg(c.query(SIGNALS_SENT_SQL, &range).await)?;
    let messages = pg(c.query(SIGNALS_MESSAGES_SQL, &range).await)?;
    Ok(crate::signals::Events {
        dead: dead
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), count_of(r.get(3))))
            .collect(),
        succeeded: succeeded
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2), count_of(r.get(3))))
            .collect(),
        sent_jobs: sent
            .iter()
            .map(|r| (r.get(0), count_of(r.get(1))))
            .collect(),
        messages: messages
            .iter()
            .map(|r| (r.get(0), count_of(r.get(1)), count_of(r.get(2))))
            .collect(),
    })
}

/// What a sampling of the charts' signals reads at `now`
/// (`crate::signals`), from the rows every node shares.
pub(super) async fn signal_readings(
    c: &Client,
    now: Timestamp,
) -> Result<crate::signals::Readings, StoreError> {
    use lazaret_core::series::{By, MINUTE_MS, minute_of};
    let held = pg(c.query(SIGNALS_HELD_SQL, &[]).await)?
        .iter()
        .map(|r| {
            let axis: &str = r.get(0);
            let by = if axis == "type" { By::Type } else { By::Source };
            (
                by,
                r.get::<_, String>(1),
                count_of(r.get::<_, Option<i64>>(2).unwrap_or(0)),
                count_of(r.get::<_, Option<i64>>(3).unwrap_or(0)),
            )
        })
        .collect();
    let oldest = pg(c.query(SIGNALS_OLDEST_SQL, &[]).await)?
        .iter()
        .map(|r| (r.get::<_, String>(0), Timestamp::from_millis(r.get(1))))
        .collect();
    let minute = minute_of(now).as_millis();
    let current = signal_events(c, minute, now.as_millis() + 1).await?;
    let previous = signal_events(c, minute - MINUTE_MS, minute).await?;
    Ok(crate::signals::Readings {
        now,
        held,
        oldest,
        current,
        previous,
    })
}

/// The charts' samples of the minutes in `[from, to)`.
pub(super) async fn signal_samples(
    c: &Client,
    &from: &Timestamp,
    &to: &Timestamp,
) -> Result<crate::SignalSamples, StoreError> {
    let rows = pg(c
        .query(
            "SELECT minute, signal, axis, name, value FROM signal_samples
             WHERE minute >= $1 AND minute < $2 ORDER BY minute, signal, axis, name",
            &[&from.as_millis(), &to.as_millis()],
        )
        .await)?;
    let mut out = crate::SignalSamples::default();
    for r in &rows {
        let minute: i64 = r.get(0);
        let signal: &str = r.get(1);
        if signal == lazaret_core::series::SAMPLED {
            out.sampled.push(Timestamp::from_millis(minute));
        } else if let Some(s) =
            crate::signals::sample_of(minute, signal, r.get(2), r.get(3), r.get(4))
        {
            out.samples.push(s);
        }
    }
    Ok(out)
}
