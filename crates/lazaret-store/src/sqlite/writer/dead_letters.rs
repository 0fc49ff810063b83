//! Dead letters: admission records, redrives (with or without a corrected
//! payload) and purges.

use super::*;

impl Writer {
    pub(super) fn record_admission(
        &mut self,
        rec: AdmissionRecord,
    ) -> Result<DeadLetterId, StoreError> {
        let error = serde_json::json!({
            "class": "permanent", "kind": rec.reason.as_str(), "message": rec.message,
            "traceback": null, "retry_after_ms": null,
        });
        let group = lazaret_core::group_of(
            rec.job_type.as_deref(),
            rec.reason.as_str(),
            Some(&lazaret_core::Failure::new(
                rec.reason.as_str(),
                rec.message.as_str(),
            )),
        );
        db(self
            .conn
            .prepare_cached(
                "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error, idempotency_key,
                   created_at, dead_lettered_at, payload_size, payload_sha256, payload_preview, payload,
                   group_id, fingerprint)
                 VALUES (NULL, ?1, ?2, ?3, ?4, 'admission', 0, ?5, ?6, ?7, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
            )?
            .execute(params![
                rec.job_type,
                rec.tenant,
                rec.lane,
                rec.reason.as_str(),
                error.to_string(),
                rec.idempotency_key,
                ms(rec.now),
                rec.payload_size as i64,
                rec.payload_sha256,
                rec.payload_preview,
                rec.payload,
                group.id,
                group.fingerprint,
            ]))?;
        Ok(DeadLetterId(self.conn.last_insert_rowid() as u64))
    }

    pub(super) fn redrive_to(
        &mut self,
        ids: Vec<DeadLetterId>,
        to: crate::Redirect,
        now: Timestamp,
        audit: Option<crate::AuditId>,
    ) -> Result<Vec<JobId>, StoreError> {
        let mut out = Vec::new();
        for dl in &ids {
            let job_id: Option<i64> = db(self
                .conn
                .prepare_cached(
                    "SELECT job_id FROM dead_letters WHERE id = ?1 AND stage = 'processing'",
                )?
                .query_row(params![dl.0 as i64], |r| r.get(0))
                .optional())?
            .flatten();
            let Some(job_id) = job_id else { continue };
            let stored = db(self
                .conn
                .prepare_cached(&format!(
                    "SELECT {COLUMNS} FROM jobs WHERE id = ?1 AND state = 'dead_lettered'"
                ))?
                .query_row(params![job_id], StoredJob::from_row)
                .optional())?;
            let Some(stored) = stored else { continue };
            let mut env = stored.envelope()?;
            lazaret_core::redrive(&mut env);
            to.apply(&mut env);
            if to.job_type.is_some() && self.key_taken(&env)? {
                // The new type has a job with this key in this tenant
                // already: moving this one there would make two.
                continue;
            }
            db(self
                .conn
                .prepare_cached(
                    "UPDATE jobs SET state = 'queued', run_at = ?2, attempts = 0, finished_at = NULL,
                     lease_started_at = NULL, worker_id = NULL, redrives = ?3, envelope = ?4,
                     type = ?5, lane = ?6, schema_version = ?7 WHERE id = ?1",
                )?
                .execute(params![
                    job_id,
                    ms(now),
                    env.redrive_count,
                    env.to_json(),
                    env.job_type.as_str(),
                    env.lane.as_str(),
                    env.schema_version
                ]))?;
            self.redrive_job(audit, *dl, job_id, false, &to)?;
            db(self
                .conn
                .prepare_cached("DELETE FROM dead_letters WHERE id = ?1")?
                .execute(params![dl.0 as i64]))?;
            self.pairs
                .add_ready(&env.lane, &env.tenant, &env.job_type, 1);
            out.push(env.id);
        }
        self.audit_add(audit, out.len() as u64)?;
        Ok(out)
    }

    pub(super) fn redrive_corrected(
        &mut self,
        dl: DeadLetterId,
        fix: crate::PayloadFix,
        now: Timestamp,
        audit: Option<crate::AuditId>,
    ) -> Result<Option<JobId>, StoreError> {
        let job_id: Option<i64> = db(self
            .conn
            .prepare_cached(
                "SELECT job_id FROM dead_letters WHERE id = ?1 AND stage = 'processing'",
            )?
            .query_row(params![dl.0 as i64], |r| r.get(0))
            .optional())?
        .flatten();
        let Some(job_id) = job_id else {
            return Ok(None);
        };
        let stored = db(self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS} FROM jobs WHERE id = ?1 AND state = 'dead_lettered'"
            ))?
            .query_row(params![job_id], StoredJob::from_row)
            .optional())?;
        let Some(stored) = stored else {
            return Ok(None);
        };
        let mut env = stored.envelope()?;
        lazaret_core::redrive_corrected(
            &mut env,
            lazaret_core::CorrectedPayload {
                previous: &stored.payload,
                payload: &fix.payload,
                schema_version: fix.schema_version,
                actor: &fix.actor,
                reason: &fix.reason,
                now,
            },
        );
        db(self
            .conn
            .prepare_cached(
                "UPDATE jobs SET state = 'queued', run_at = ?2, attempts = 0, finished_at = NULL,
                 lease_started_at = NULL, worker_id = NULL, redrives = ?3, envelope = ?4,
                 payload = ?5, schema_version = ?6 WHERE id = ?1",
            )?
            .execute(params![
                job_id,
                ms(now),
                env.redrive_count,
                env.to_json(),
                fix.payload,
                fix.schema_version
            ]))?;
        self.redrive_job(audit, dl, job_id, true, &crate::Redirect::default())?;
        db(self
            .conn
            .prepare_cached("DELETE FROM dead_letters WHERE id = ?1")?
            .execute(params![dl.0 as i64]))?;
        self.pairs
            .add_ready(&env.lane, &env.tenant, &env.job_type, 1);
        self.audit_add(audit, 1)?;
        Ok(Some(env.id))
    }

    pub(super) fn purge(
        &mut self,
        ids: Vec<DeadLetterId>,
        audit: Option<crate::AuditId>,
    ) -> Result<u64, StoreError> {
        let mut n = 0;
        for dl in ids {
            let job_id: Option<Option<i64>> = db(self
                .conn
                .prepare_cached("DELETE FROM dead_letters WHERE id = ?1 RETURNING job_id")?
                .query_row(params![dl.0 as i64], |r| r.get(0))
                .optional())?;
            let Some(job_id) = job_id else { continue };
            if let Some(job_id) = job_id {
                db(self
                    .conn
                    .prepare_cached("DELETE FROM jobs WHERE id = ?1 AND state = 'dead_lettered'")?
                    .execute(params![job_id]))?;
            }
            n += 1;
        }
        self.audit_add(audit, n)?;
        Ok(n)
    }

    pub(super) fn archive(
        &mut self,
        ids: Vec<DeadLetterId>,
        archived: bool,
        now: Timestamp,
        audit: Option<crate::AuditId>,
    ) -> Result<u64, StoreError> {
        let sql = if archived {
            "UPDATE dead_letters SET archived_at = ?2 WHERE id = ?1 AND archived_at IS NULL"
        } else {
            "UPDATE dead_letters SET archived_at = NULL WHERE id = ?1 AND archived_at IS NOT NULL AND ?2 IS NOT NULL"
        };
        let mut n = 0;
        for dl in ids {
            n += db(self
                .conn
                .prepare_cached(sql)?
                .execute(params![dl.0 as i64, ms(now)]))? as u64;
        }
        self.audit_add(audit, n)?;
        Ok(n)
    }

    /// Whether another job of the envelope's (new) type holds its
    /// idempotency key in its tenant.
    fn key_taken(&mut self, env: &lazaret_core::Envelope) -> Result<bool, StoreError> {
        let Some(key) = &env.idempotency_key else {
            return Ok(false);
        };
        Ok(db(self
            .conn
            .prepare_cached(
                "SELECT 1 FROM jobs WHERE tenant = ?1 AND type = ?2 AND idempotency_key = ?3 AND id != ?4",
            )?
            .query_row(
                params![env.tenant.as_str(), env.job_type.as_str(), key, env.id.0 as i64],
                |_| Ok(()),
            )
            .optional())?
        .is_some())
    }

    /// Notes a job a redrive moved, under the redrive's audit entry, with
    /// the group of the dead letter it leaves (read before it is deleted),
    /// whether its payload was edited, and where it was sent.
    fn redrive_job(
        &mut self,
        audit: Option<crate::AuditId>,
        dl: DeadLetterId,
        job_id: i64,
        edited: bool,
        to: &crate::Redirect,
    ) -> Result<(), StoreError> {
        let Some(audit) = audit else { return Ok(()) };
        db(self
            .conn
            .prepare_cached(
                "INSERT OR REPLACE INTO redrive_jobs (audit_id, job_id, from_group, edited, to_type, to_lane)
                 SELECT ?1, ?2, group_id, ?4, ?5, ?6 FROM dead_letters WHERE id = ?3",
            )?
            .execute(params![
                audit.0 as i64,
                job_id,
                dl.0 as i64,
                edited,
                to.job_type,
                to.lane
            ]))?;
        Ok(())
    }

    /// Notes the copy of a broker dead letter a redrive is about to
    /// republish, under the redrive id and with the dead letter's group; a
    /// note already there is kept (a copy seen back keeps its outcome).
    pub(super) fn note_redrive_copy(
        &mut self,
        dl: DeadLetterId,
        redrive: String,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        db(self
            .conn
            .prepare_cached(
                "INSERT OR IGNORE INTO redrive_messages
                   (redrive_id, message_id, dead_letter_id, source, from_group, sent_at)
                 SELECT ?1, message_id, id, source_name, group_id, ?3 FROM dead_letters
                 WHERE id = ?2 AND source_name IS NOT NULL AND message_id IS NOT NULL",
            )?
            .execute(params![redrive, dl.0 as i64, ms(now)]))?;
        Ok(())
    }

    /// The republish failed: its note goes, unless the copy was seen back.
    pub(super) fn forget_redrive_copy(
        &mut self,
        dl: DeadLetterId,
        redrive: String,
    ) -> Result<(), StoreError> {
        db(self
            .conn
            .prepare_cached(
                "DELETE FROM redrive_messages
                 WHERE redrive_id = ?1 AND dead_letter_id = ?2 AND outcome IS NULL",
            )?
            .execute(params![redrive, dl.0 as i64]))?;
        Ok(())
    }

    /// Notes the republished copy of a broker dead letter under the
    /// redrive id (unless noted before it was sent), and removes it.
    pub(super) fn redrove_message(
        &mut self,
        dl: DeadLetterId,
        redrive: String,
        now: Timestamp,
        audit: Option<crate::AuditId>,
    ) -> Result<bool, StoreError> {
        self.note_redrive_copy(dl, redrive, now)?;
        let removed = db(self
            .conn
            .prepare_cached(
                "DELETE FROM dead_letters
                 WHERE id = ?1 AND source_name IS NOT NULL AND message_id IS NOT NULL",
            )?
            .execute(params![dl.0 as i64]))?;
        if removed == 0 {
            return Ok(false);
        }
        self.audit_add(audit, 1)?;
        Ok(true)
    }

    pub(super) fn record_redrive(
        &mut self,
        id: String,
        audit: crate::AuditId,
    ) -> Result<(), StoreError> {
        db(self
            .conn
            .prepare_cached("INSERT OR REPLACE INTO redrives (id, audit_id) VALUES (?1, ?2)")?
            .execute(params![id, audit.0 as i64]))?;
        Ok(())
    }
}
