//! Broker messages: their dead letters and the retries lazaret holds for
//! them until they are due, each unique per [`MessageKey`] (source, message
//! id, payload SHA-256 and redrive id).

use lazaret_core::{Envelope, Timestamp, payload_preview};
use rusqlite::{Connection, OptionalExtension, params};

use crate::{
    ClaimedRetry, DeadLetterId, Held, HeldRetry, MessageKey, Quarantined, SourceDeadLetter,
    SourceRef, StoreError,
};

fn db<T>(r: rusqlite::Result<T>) -> Result<T, StoreError> {
    r.map_err(StoreError::from)
}

fn corrupt(e: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt(e.to_string())
}

fn json(v: &impl serde::Serialize) -> Result<String, StoreError> {
    serde_json::to_string(v).map_err(corrupt)
}

/// Writes the dead letter unless one of its [`MessageKey`] is there
/// already, and drops the retry held for that key (when the message
/// [may have one](SourceDeadLetter::may_be_held)) in the same transaction.
pub(super) fn quarantine(c: &Connection, dl: &SourceDeadLetter) -> Result<Quarantined, StoreError> {
    let src = &dl.source;
    let key = MessageKey::of_source(src, &dl.payload);
    if dl.may_be_held {
        release_held_retry(c, &key)?;
    }
    let error = dl.error.as_ref().map(json).transpose()?;
    let envelope = dl.envelope.as_ref().map(Envelope::to_json);
    let traceparent = dl
        .envelope
        .as_ref()
        .and_then(|e| e.traceparent.as_ref())
        .map(lazaret_core::TraceParent::as_str);
    let group = lazaret_core::group_of(
        dl.job_type.as_deref(),
        dl.reason.as_str(),
        dl.error.as_ref(),
    );
    let inserted = db(c.prepare_cached(
        "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error, idempotency_key,
           created_at, dead_lettered_at, payload_size, payload_sha256, payload_preview, payload,
           source, source_name, message_id, envelope, redrive_id, group_id, fingerprint, traceparent)
         VALUES (NULL, ?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, ?18, ?19, ?20, ?21, ?22)
         ON CONFLICT (source_name, message_id, payload_sha256, redrive_id)
           WHERE source_name IS NOT NULL DO NOTHING",
    )?
    .execute(params![
        dl.job_type,
        dl.tenant,
        dl.lane,
        dl.reason.as_str(),
        dl.stage.as_str(),
        i64::from(dl.attempts),
        error,
        dl.idempotency_key,
        dl.created_at.as_millis(),
        dl.now.as_millis(),
        dl.payload.len() as i64,
        key.payload_sha256,
        payload_preview(&dl.payload, lazaret_core::PREVIEW_BYTES_MAX),
        dl.payload,
        json(src)?,
        src.name,
        src.message_id,
        envelope,
        key.redrive_column(),
        group.id,
        group.fingerprint,
        traceparent,
    ]))?;
    if inserted == 0 {
        // Quarantined before (a redelivery after a crash before the ack).
        let id = quarantined(c, &key)?
            .ok_or_else(|| corrupt("a dead letter's key conflicted but no row has it"))?;
        return Ok(Quarantined { id, created: false });
    }
    let id = DeadLetterId(c.last_insert_rowid() as u64);
    if let Some(redrive) = &src.redrive_id {
        // A redriven copy failed again: its redrive's report says so, in
        // the group it fell into, even once this dead letter is gone.
        db(c.prepare_cached(
            "UPDATE redrive_messages SET outcome = 'failed_again', outcome_at = ?3,
               dead_letter_again = ?4, group_again = ?5
             WHERE redrive_id = ?1 AND message_id = ?2",
        )?
        .execute(params![
            redrive,
            src.message_id,
            dl.now.as_millis(),
            id.0 as i64,
            group.id
        ]))?;
    }
    Ok(Quarantined { id, created: true })
}

/// A redriven message succeeded: its held retry, if any, is dropped, and
/// its redrive's copy of that message id marked succeeded.
pub(super) fn redriven_message_succeeded(
    c: &Connection,
    key: &MessageKey,
    now: Timestamp,
) -> Result<(), StoreError> {
    release_held_retry(c, key)?;
    if let Some(redrive) = &key.redrive_id {
        db(c.prepare_cached(
            "UPDATE redrive_messages SET outcome = 'succeeded', outcome_at = ?3
             WHERE redrive_id = ?1 AND message_id = ?2 AND outcome IS NULL",
        )?
        .execute(params![redrive, key.message_id, now.as_millis()]))?;
    }
    Ok(())
}

/// Holds a retry (insert, or replace the one of the same [`MessageKey`]).
pub(super) fn hold_retry(c: &Connection, p: &HeldRetry) -> Result<(), StoreError> {
    let key = p.key();
    db(c.prepare_cached(
        "INSERT OR REPLACE INTO source_held_retries
           (source, message_id, payload_sha256, redrive_id, due_at, ref, envelope, body)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
    )?
    .execute(params![
        key.source,
        key.message_id,
        key.payload_sha256,
        key.redrive_column(),
        p.due_at.as_millis(),
        json(&p.source)?,
        p.envelope.to_json(),
        p.body,
    ]))?;
    Ok(())
}

/// Drops the retry held for `key`; whether there was one.
pub(super) fn release_held_retry(c: &Connection, key: &MessageKey) -> Result<bool, StoreError> {
    let n = db(c
        .prepare_cached(
            "DELETE FROM source_held_retries WHERE source = ?1 AND message_id = ?2
               AND payload_sha256 = ?3 AND redrive_id = ?4",
        )?
        .execute(key_params(key)))?;
    Ok(n > 0)
}

/// A [`MessageKey`] as the four key columns' parameters.
fn key_params(key: &MessageKey) -> [&str; 4] {
    [
        &key.source,
        &key.message_id,
        &key.payload_sha256,
        key.redrive_column(),
    ]
}

/// The held retries of `source` due at `now`, earliest first.
pub(super) fn due_held_retries(
    c: &Connection,
    source: &str,
    &now: &Timestamp,
    &limit: &u32,
) -> Result<Vec<HeldRetry>, StoreError> {
    let mut stmt = db(c.prepare_cached(
        "SELECT due_at, ref, envelope, body FROM source_held_retries
         WHERE source = ?1 AND due_at <= ?2 ORDER BY due_at LIMIT +?3",
    ))?;
    let rows = db(
        stmt.query_map(params![source, now.as_millis(), i64::from(limit)], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, Vec<u8>>(3)?,
            ))
        }),
    )?;
    let mut out = Vec::new();
    for row in rows {
        let (due_at, src, env, body) = db(row)?;
        out.push(HeldRetry {
            source: serde_json::from_str::<SourceRef>(&src).map_err(corrupt)?,
            due_at: Timestamp::from_millis(due_at),
            envelope: Envelope::from_json(&env).map_err(corrupt)?,
            body,
        });
    }
    Ok(out)
}

/// Claims the due, unclaimed (or expired-claim) held retries of a source,
/// earliest first, each with the claimer whose claim had expired. Run by
/// the single writer, so two callers never claim the same retry (and the
/// read of the old claimer and the update are one step).
pub(super) fn claim_due(
    c: &Connection,
    claim: &crate::request::Claim,
) -> Result<Vec<ClaimedRetry>, StoreError> {
    let mut pick = db(c.prepare_cached(
        "SELECT rowid, claimed_by, due_at, ref, envelope, body FROM source_held_retries
         WHERE source = ?1 AND due_at <= ?2
           AND (claim_expires_at IS NULL OR claim_expires_at <= ?2)
         ORDER BY due_at LIMIT +?3",
    ))?;
    let rows = db(pick.query_map(
        params![claim.source, claim.now.as_millis(), i64::from(claim.limit)],
        |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, Option<String>>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, String>(4)?,
                r.get::<_, Vec<u8>>(5)?,
            ))
        },
    ))?;
    let mut out = Vec::new();
    let mut rowids = Vec::new();
    for row in rows {
        let (rowid, lapsed_claim, due_at, src, env, body) = db(row)?;
        rowids.push(rowid);
        out.push(ClaimedRetry {
            retry: HeldRetry {
                source: serde_json::from_str::<SourceRef>(&src).map_err(corrupt)?,
                due_at: Timestamp::from_millis(due_at),
                envelope: Envelope::from_json(&env).map_err(corrupt)?,
                body,
            },
            lapsed_claim,
        });
    }
    let mut take = db(c.prepare_cached(
        "UPDATE source_held_retries SET claimed_by = ?1, claim_expires_at = ?2 WHERE rowid = ?3",
    ))?;
    for rowid in rowids {
        db(take.execute(params![claim.claimer, claim.expires_at.as_millis(), rowid]))?;
    }
    Ok(out)
}

/// The retry held for `key`, if any.
pub(super) fn held_retry(
    c: &Connection,
    key: &MessageKey,
) -> Result<Option<HeldRetry>, StoreError> {
    let row = db(c
        .prepare_cached(
            "SELECT due_at, ref, envelope, body FROM source_held_retries
             WHERE source = ?1 AND message_id = ?2 AND payload_sha256 = ?3 AND redrive_id = ?4",
        )?
        .query_row(key_params(key), |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, Vec<u8>>(3)?,
            ))
        })
        .optional())?;
    let Some((due_at, src, env, body)) = row else {
        return Ok(None);
    };
    Ok(Some(HeldRetry {
        source: serde_json::from_str::<SourceRef>(&src).map_err(corrupt)?,
        due_at: Timestamp::from_millis(due_at),
        envelope: Envelope::from_json(&env).map_err(corrupt)?,
        body,
    }))
}

/// The earliest due time of `source`'s held retries.
pub(super) fn next_held_retry_due(
    c: &Connection,
    source: &str,
) -> Result<Option<Timestamp>, StoreError> {
    let at: Option<i64> = db(c
        .prepare_cached("SELECT MIN(due_at) FROM source_held_retries WHERE source = ?1")?
        .query_row(params![source], |r| r.get(0)))?;
    Ok(at.map(Timestamp::from_millis))
}

/// The dead letter of a message key, if any.
fn quarantined(c: &Connection, key: &MessageKey) -> Result<Option<DeadLetterId>, StoreError> {
    let id: Option<i64> = db(c
        .prepare_cached(
            "SELECT id FROM dead_letters WHERE source_name = ?1 AND message_id = ?2
               AND payload_sha256 = ?3 AND redrive_id = ?4",
        )?
        .query_row(key_params(key), |r| r.get(0))
        .optional())?;
    Ok(id.map(|id| DeadLetterId(id as u64)))
}

/// What the store holds of a message already.
pub(super) fn message_held(c: &Connection, key: &MessageKey) -> Result<Held, StoreError> {
    if let Some(id) = quarantined(c, key)? {
        return Ok(Held::Quarantined(id));
    }
    let retry: Option<i64> = db(c
        .prepare_cached(
            "SELECT 1 FROM source_held_retries WHERE source = ?1 AND message_id = ?2
               AND payload_sha256 = ?3 AND redrive_id = ?4",
        )?
        .query_row(key_params(key), |r| r.get(0))
        .optional())?;
    Ok(if retry.is_some() {
        Held::Retry
    } else {
        Held::Nothing
    })
}
