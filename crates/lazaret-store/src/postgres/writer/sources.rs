//! Broker messages: their dead letters and the retries held for them.

use super::*;

impl Writer {
    pub(super) async fn quarantine(
        &mut self,
        dls: &[SourceDeadLetter],
    ) -> Result<Vec<Quarantined>, StoreError> {
        let mut out = Vec::with_capacity(dls.len());
        for dl in dls {
            out.push(self.quarantine_one(dl).await?);
        }
        Ok(out)
    }

    async fn quarantine_one(&mut self, dl: &SourceDeadLetter) -> Result<Quarantined, StoreError> {
        let src = &dl.source;
        if dl.may_be_held {
            self.release_held_retry(&MessageKey::of_source(src, &dl.payload))
                .await?;
        }
        let error = dl
            .error
            .as_ref()
            .map(|e| serde_json::to_string(e).map_err(corrupt))
            .transpose()?;
        let envelope = dl.envelope.as_ref().map(Envelope::to_json);
        let traceparent = dl
            .envelope
            .as_ref()
            .and_then(|e| e.traceparent.as_ref())
            .map(lazaret_core::TraceParent::as_str);
        let source = serde_json::to_string(src).map_err(corrupt)?;
        let sha = hex::encode(lazaret_core::payload_sha256(&dl.payload));
        let redrive_id = src.redrive_id.clone().unwrap_or_default();
        let group = lazaret_core::group_of(
            dl.job_type.as_deref(),
            dl.reason.as_str(),
            dl.error.as_ref(),
        );
        let rows = self
            .query(
                "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error,
                   idempotency_key, created_at, dead_lettered_at, payload_size, payload_sha256,
                   payload_preview, payload, source, source_name, message_id, envelope, redrive_id,
                   group_id, fingerprint, traceparent)
                 VALUES (NULL, $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22)
                 ON CONFLICT (source_name, message_id, payload_sha256, redrive_id)
                   WHERE source_name IS NOT NULL DO NOTHING
                 RETURNING id",
                &[
                    &dl.job_type,
                    &dl.tenant,
                    &dl.lane,
                    &dl.reason.as_str(),
                    &dl.stage.as_str(),
                    &(dl.attempts as i32),
                    &error,
                    &dl.idempotency_key,
                    &ms(dl.created_at),
                    &ms(dl.now),
                    &(dl.payload.len() as i64),
                    &sha,
                    &payload_preview(&dl.payload, lazaret_core::PREVIEW_BYTES_MAX),
                    &dl.payload,
                    &source,
                    &src.name,
                    &src.message_id,
                    &envelope,
                    &redrive_id,
                    &group.id,
                    &group.fingerprint,
                    &traceparent,
                ],
            )
            .await?;
        if let Some(r) = rows.first() {
            let id: i64 = r.get(0);
            if let Some(redrive) = &src.redrive_id {
                // A redriven copy failed again: its redrive's report says
                // so, in the group it fell into, even once this is gone.
                self.execute(
                    "UPDATE redrive_messages SET outcome = 'failed_again', outcome_at = $3,
                       dead_letter_again = $4, group_again = $5
                     WHERE redrive_id = $1 AND message_id = $2",
                    &[redrive, &src.message_id, &ms(dl.now), &id, &group.id],
                )
                .await?;
            }
            return Ok(Quarantined {
                id: DeadLetterId(id as u64),
                created: true,
            });
        }
        let rows = self
            .query(
                "SELECT id FROM dead_letters WHERE source_name = $1 AND message_id = $2
                   AND payload_sha256 = $3 AND redrive_id = $4",
                &[&src.name, &src.message_id, &sha, &redrive_id],
            )
            .await?;
        let id: i64 = rows
            .first()
            .map(|r| r.get(0))
            .ok_or_else(|| corrupt("a quarantined message without its dead letter"))?;
        Ok(Quarantined {
            id: DeadLetterId(id as u64),
            created: false,
        })
    }

    pub(super) async fn hold_retry(&mut self, p: &HeldRetry) -> Result<(), StoreError> {
        let source = serde_json::to_string(&p.source).map_err(corrupt)?;
        let key = p.key();
        self.execute(
            "INSERT INTO source_held_retries
               (source, message_id, payload_sha256, redrive_id, due_at, ref, envelope, body)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (source, message_id, payload_sha256, redrive_id) DO UPDATE SET
               due_at = excluded.due_at, ref = excluded.ref, envelope = excluded.envelope,
               body = excluded.body, claimed_by = NULL, claim_expires_at = NULL",
            &[
                &key.source,
                &key.message_id,
                &key.payload_sha256,
                &key.redrive_column(),
                &ms(p.due_at),
                &source,
                &p.envelope.to_json(),
                &p.body,
            ],
        )
        .await?;
        Ok(())
    }

    /// Drops the retry held for `key`; whether there was one.
    pub(super) async fn release_held_retry(
        &mut self,
        key: &MessageKey,
    ) -> Result<bool, StoreError> {
        let n = self
            .execute(
                "DELETE FROM source_held_retries WHERE source = $1 AND message_id = $2
                   AND payload_sha256 = $3 AND redrive_id = $4",
                &[
                    &key.source,
                    &key.message_id,
                    &key.payload_sha256,
                    &key.redrive_column(),
                ],
            )
            .await?;
        Ok(n > 0)
    }

    /// A redriven message succeeded: its held retry, if any, is dropped,
    /// and its redrive's copy of that message id marked succeeded.
    pub(super) async fn redriven_message_succeeded(
        &mut self,
        key: &MessageKey,
        &now: &Timestamp,
    ) -> Result<(), StoreError> {
        let now = self.now_of(now);
        self.release_held_retry(key).await?;
        if let Some(redrive) = &key.redrive_id {
            self.execute(
                "UPDATE redrive_messages SET outcome = 'succeeded', outcome_at = $3
                 WHERE redrive_id = $1 AND message_id = $2 AND outcome IS NULL",
                &[redrive, &key.message_id, &ms(now)],
            )
            .await?;
        }
        Ok(())
    }

    /// Claims run on a reader connection (`Postgres::claim_held_retries`),
    /// never here.
    pub(super) async fn claim_due(
        &mut self,
        _claim: &crate::request::Claim,
    ) -> Result<Vec<crate::ClaimedRetry>, StoreError> {
        Err(corrupt(
            "a claim of held retries reached the PostgreSQL writer, which does not run them",
        ))
    }
}
