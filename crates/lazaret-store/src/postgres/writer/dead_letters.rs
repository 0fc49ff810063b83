//! Dead letters: admission records, redrives (with or without a corrected
//! payload) and purges.

use super::*;

impl Writer {
    pub(super) async fn record_admission(
        &mut self,
        rec: &AdmissionRecord,
    ) -> Result<DeadLetterId, StoreError> {
        let now = self.now_of(rec.now);
        let error = serde_json::json!({
            "class": "permanent", "kind": rec.reason.as_str(), "message": rec.message,
            "traceback": null, "retry_after_ms": null,
        })
        .to_string();
        let group = lazaret_core::group_of(
            rec.job_type.as_deref(),
            rec.reason.as_str(),
            Some(&lazaret_core::Failure::new(
                rec.reason.as_str(),
                rec.message.as_str(),
            )),
        );
        let rows = self
            .query(
                "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error,
                   idempotency_key, created_at, dead_lettered_at, payload_size, payload_sha256, payload_preview, payload,
                   group_id, fingerprint)
                 VALUES (NULL, $1, $2, $3, $4, 'admission', 0, $5, $6, $7, $7, $8, $9, $10, $11, $12, $13)
                 RETURNING id",
                &[
                    &rec.job_type,
                    &rec.tenant,
                    &rec.lane,
                    &rec.reason.as_str(),
                    &error,
                    &rec.idempotency_key,
                    &ms(now),
                    &(rec.payload_size as i64),
                    &rec.payload_sha256,
                    &rec.payload_preview,
                    &rec.payload,
                    &group.id,
                    &group.fingerprint,
                ],
            )
            .await?;
        Ok(DeadLetterId(rows[0].get::<_, i64>(0) as u64))
    }

    pub(super) async fn redrive_to(
        &mut self,
        ids: &[DeadLetterId],
        to: &crate::Redirect,
        &now: &Timestamp,
        &audit: &Option<AuditId>,
    ) -> Result<Vec<JobId>, StoreError> {
        let now = self.now_of(now);
        let mut out = Vec::new();
        for dl in ids {
            let rows = self
                .query(
                    "SELECT job_id FROM dead_letters WHERE id = $1 AND stage = 'processing' FOR UPDATE",
                    &[&(dl.0 as i64)],
                )
                .await?;
            let Some(job_id) = rows.first().and_then(|r| r.get::<_, Option<i64>>(0)) else {
                continue;
            };
            let rows = self
                .query(
                    "SELECT id, type, tenant, lane, state, attempts, lease_started_at, worker_id,
                       idempotency_key, schema_version, created_at, finished_at, envelope, payload
                     FROM jobs WHERE id = $1 AND state = 'dead_lettered' FOR UPDATE",
                    &[&job_id],
                )
                .await?;
            let Some(row) = rows.first() else { continue };
            let mut env = stored_job(row)?.envelope()?;
            lazaret_core::redrive(&mut env);
            to.apply(&mut env);
            if to.job_type.is_some() && self.key_taken(&env).await? {
                // The new type has a job with this key in this tenant
                // already: moving this one there would make two.
                continue;
            }
            self.execute(
                "UPDATE jobs SET state = 'queued', run_at = $2, attempts = 0, finished_at = NULL,
                 lease_started_at = NULL, worker_id = NULL, redrives = $3, envelope = $4,
                 type = $5, lane = $6, schema_version = $7 WHERE id = $1",
                &[
                    &job_id,
                    &ms(now),
                    &(env.redrive_count as i32),
                    &env.to_json(),
                    &env.job_type.as_str(),
                    &env.lane.as_str(),
                    &env.schema_version.map(|v| v as i32),
                ],
            )
            .await?;
            self.redrive_job(audit, *dl, job_id, false, to).await?;
            self.execute("DELETE FROM dead_letters WHERE id = $1", &[&(dl.0 as i64)])
                .await?;
            self.add_ready(
                env.lane.as_str(),
                env.tenant.as_str(),
                env.job_type.as_str(),
                1,
            );
            self.group.wake = true;
            out.push(env.id);
        }
        self.audit_add(audit, out.len() as u64).await?;
        Ok(out)
    }

    /// One processing dead letter back into line with a corrected payload
    /// (the envelope keeps the one it replaced: `lazaret_core::redrive_corrected`).
    pub(super) async fn redrive_corrected(
        &mut self,
        &dl: &DeadLetterId,
        fix: &crate::PayloadFix,
        &now: &Timestamp,
        &audit: &Option<AuditId>,
    ) -> Result<Option<JobId>, StoreError> {
        let now = self.now_of(now);
        let rows = self
            .query(
                "SELECT job_id FROM dead_letters WHERE id = $1 AND stage = 'processing' FOR UPDATE",
                &[&(dl.0 as i64)],
            )
            .await?;
        let Some(job_id) = rows.first().and_then(|r| r.get::<_, Option<i64>>(0)) else {
            return Ok(None);
        };
        let rows = self
            .query(
                "SELECT id, type, tenant, lane, state, attempts, lease_started_at, worker_id,
                   idempotency_key, schema_version, created_at, finished_at, envelope, payload
                 FROM jobs WHERE id = $1 AND state = 'dead_lettered' FOR UPDATE",
                &[&job_id],
            )
            .await?;
        let Some(row) = rows.first() else {
            return Ok(None);
        };
        let stored = stored_job(row)?;
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
        self.execute(
            "UPDATE jobs SET state = 'queued', run_at = $2, attempts = 0, finished_at = NULL,
             lease_started_at = NULL, worker_id = NULL, redrives = $3, envelope = $4,
             payload = $5, schema_version = $6 WHERE id = $1",
            &[
                &job_id,
                &ms(now),
                &(env.redrive_count as i32),
                &env.to_json(),
                &fix.payload,
                &fix.schema_version.map(|v| v as i32),
            ],
        )
        .await?;
        self.redrive_job(audit, dl, job_id, true, &crate::Redirect::default())
            .await?;
        self.execute("DELETE FROM dead_letters WHERE id = $1", &[&(dl.0 as i64)])
            .await?;
        self.add_ready(
            env.lane.as_str(),
            env.tenant.as_str(),
            env.job_type.as_str(),
            1,
        );
        self.group.wake = true;
        self.audit_add(audit, 1).await?;
        Ok(Some(env.id))
    }

    pub(super) async fn purge(
        &mut self,
        ids: &[DeadLetterId],
        &audit: &Option<AuditId>,
    ) -> Result<u64, StoreError> {
        let mut n = 0;
        for dl in ids {
            let rows = self
                .query(
                    "DELETE FROM dead_letters WHERE id = $1 RETURNING job_id",
                    &[&(dl.0 as i64)],
                )
                .await?;
            let Some(row) = rows.first() else { continue };
            if let Some(job_id) = row.get::<_, Option<i64>>(0) {
                self.execute(
                    "DELETE FROM jobs WHERE id = $1 AND state = 'dead_lettered'",
                    &[&job_id],
                )
                .await?;
            }
            n += 1;
        }
        self.audit_add(audit, n).await?;
        Ok(n)
    }

    pub(super) async fn archive(
        &mut self,
        ids: &[DeadLetterId],
        &archived: &bool,
        &now: &Timestamp,
        &audit: &Option<AuditId>,
    ) -> Result<u64, StoreError> {
        let now = self.now_of(now);
        let sql = if archived {
            "UPDATE dead_letters SET archived_at = $2 WHERE id = $1 AND archived_at IS NULL"
        } else {
            "UPDATE dead_letters SET archived_at = NULL WHERE id = $1 AND archived_at IS NOT NULL AND $2::int8 IS NOT NULL"
        };
        let mut n = 0;
        for dl in ids {
            n += self.execute(sql, &[&(dl.0 as i64), &ms(now)]).await?;
        }
        self.audit_add(audit, n).await?;
        Ok(n)
    }

    /// Whether another job of the envelope's (new) type holds its
    /// idempotency key in its tenant.
    async fn key_taken(&mut self, env: &lazaret_core::Envelope) -> Result<bool, StoreError> {
        let Some(key) = &env.idempotency_key else {
            return Ok(false);
        };
        let rows = self
            .query(
                "SELECT 1 FROM jobs WHERE tenant = $1 AND type = $2 AND idempotency_key = $3 AND id <> $4",
                &[
                    &env.tenant.as_str(),
                    &env.job_type.as_str(),
                    key,
                    &(env.id.0 as i64),
                ],
            )
            .await?;
        Ok(!rows.is_empty())
    }

    /// Notes a job a redrive moved, under the redrive's audit entry, with
    /// the group of the dead letter it leaves (read before it is deleted),
    /// whether its payload was edited, and where it was sent.
    async fn redrive_job(
        &mut self,
        audit: Option<AuditId>,
        dl: DeadLetterId,
        job_id: i64,
        edited: bool,
        to: &crate::Redirect,
    ) -> Result<(), StoreError> {
        let Some(audit) = audit else { return Ok(()) };
        self.execute(
            "INSERT INTO redrive_jobs (audit_id, job_id, from_group, edited, to_type, to_lane)
             SELECT $1, $2, group_id, $4, $5, $6 FROM dead_letters WHERE id = $3
             ON CONFLICT (audit_id, job_id) DO UPDATE SET from_group = excluded.from_group,
               edited = excluded.edited, to_type = excluded.to_type, to_lane = excluded.to_lane",
            &[
                &(audit.0 as i64),
                &job_id,
                &(dl.0 as i64),
                &edited,
                &to.job_type,
                &to.lane,
            ],
        )
        .await?;
        Ok(())
    }

    /// Notes the copy of a broker dead letter a redrive is about to
    /// republish, under the redrive id and with the dead letter's group; a
    /// note already there is kept (a copy seen back keeps its outcome).
    pub(super) async fn note_redrive_copy(
        &mut self,
        &dl: &DeadLetterId,
        redrive: &str,
        &now: &Timestamp,
    ) -> Result<(), StoreError> {
        let now = self.now_of(now);
        self.execute(
            "INSERT INTO redrive_messages
               (redrive_id, message_id, dead_letter_id, source, from_group, sent_at)
             SELECT $1, message_id, id, source_name, group_id, $3 FROM dead_letters
             WHERE id = $2 AND source_name IS NOT NULL AND message_id IS NOT NULL
             ON CONFLICT (redrive_id, message_id, dead_letter_id) DO NOTHING",
            &[&redrive, &(dl.0 as i64), &ms(now)],
        )
        .await?;
        Ok(())
    }

    /// The republish failed: its note goes, unless the copy was seen back.
    pub(super) async fn forget_redrive_copy(
        &mut self,
        &dl: &DeadLetterId,
        redrive: &str,
    ) -> Result<(), StoreError> {
        self.execute(
            "DELETE FROM redrive_messages
             WHERE redrive_id = $1 AND dead_letter_id = $2 AND outcome IS NULL",
            &[&redrive, &(dl.0 as i64)],
        )
        .await?;
        Ok(())
    }

    /// Notes the republished copy of a broker dead letter under the
    /// redrive id (unless noted before it was sent), and removes it.
    pub(super) async fn redrove_message(
        &mut self,
        dl: &DeadLetterId,
        redrive: &str,
        now: &Timestamp,
        &audit: &Option<AuditId>,
    ) -> Result<bool, StoreError> {
        self.note_redrive_copy(dl, redrive, now).await?;
        let removed = self
            .execute(
                "DELETE FROM dead_letters
                 WHERE id = $1 AND source_name IS NOT NULL AND message_id IS NOT NULL",
                &[&(dl.0 as i64)],
            )
            .await?;
        if removed == 0 {
            return Ok(false);
        }
        self.audit_add(audit, 1).await?;
        Ok(true)
    }

    pub(super) async fn record_redrive(
        &mut self,
        id: &str,
        &audit: &AuditId,
    ) -> Result<(), StoreError> {
        self.execute(
            "INSERT INTO redrives (id, audit_id) VALUES ($1, $2)
             ON CONFLICT (id) DO UPDATE SET audit_id = excluded.audit_id",
            &[&id, &(audit.0 as i64)],
        )
        .await?;
        Ok(())
    }
}
