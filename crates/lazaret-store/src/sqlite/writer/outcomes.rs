//! Outcomes: acks and failures checked against their lease, each
//! transition through the `Decider`, and the slot a finished lease frees.

use super::*;

impl Writer {
    pub(super) fn complete(
        &mut self,
        items: Vec<Completion>,
        now: Timestamp,
    ) -> Result<Vec<Result<Completed, ItemError>>, StoreError> {
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            out.push(self.complete_one(item.id, Some(item.token), item.event, now)?);
        }
        Ok(out)
    }

    /// Applies one outcome. `token: None` is the reaper (no worker token).
    ///
    /// A worker's outcome counts only while its lease runs: at or after
    /// `lease_expires_at` it is `LeaseLost` and changes nothing, as if the
    /// reaper had run first (it expires leases with `lease_expires_at <= now`).
    pub(super) fn complete_one(
        &mut self,
        id: JobId,
        token: Option<LeaseToken>,
        event: Event,
        now: Timestamp,
    ) -> Result<Result<Completed, ItemError>, StoreError> {
        if let (Event::Succeeded, Some(token)) = (&event, token) {
            if let Some(done) = self.succeed(id, token, now)? {
                return Ok(Ok(done));
            }
            // Not a current lease (the answer comes below), or a lease granted
            // by schema version 1, whose running attempt is in the envelope.
        }
        let row = db(self
            .conn
            .prepare_cached(&format!(
                "SELECT {COLUMNS}, lease_token, lease_expires_at, cancel_requested, traceparent FROM jobs WHERE id = ?1"
            ))?
            .query_row(params![id.0 as i64], |r| {
                let extra = super::super::stored::COLUMN_COUNT;
                Ok((
                    StoredJob::from_row(r)?,
                    r.get::<_, Option<i64>>(extra)?,
                    r.get::<_, Option<i64>>(extra + 1)?,
                    r.get::<_, bool>(extra + 2)?,
                ))
            })
            .optional())?;
        let Some((stored, current, expires_at, cancel_requested)) = row else {
            return Ok(Err(ItemError::NotFound));
        };
        if stored.state != JobState::Leased {
            return Ok(Err(ItemError::LeaseLost));
        }
        if let Some(token) = token {
            let ended = expires_at.is_some_and(|end| end <= ms(now));
            if Some(token.0 as i64) != current || ended {
                return Ok(Err(ItemError::LeaseLost));
            }
        }
        let mut env = stored.envelope()?;
        let attempt = env.attempts;
        let decided = self.decider.decide(&mut env, event, now);
        let transition = lazaret_core::settle(&mut env, decided, cancel_requested);
        let (dead_letter, freed_slot) = self.apply(&env, transition, now, &stored.payload)?;
        let (kind, class, message) = env
            .history
            .last()
            .and_then(|r| r.error.as_ref())
            .filter(|_| transition != Transition::Succeeded)
            .map_or((None, None, None), |e| {
                (Some(e.kind.clone()), e.class, Some(e.message.clone()))
            });
        let redrive_count = env.redrive_count;
        let leased_at = stored.lease_started_at.map(Timestamp::from_millis);
        Ok(Ok(Completed {
            id,
            job_type: env.job_type,
            lane: env.lane,
            tenant: env.tenant,
            traceparent: env.traceparent,
            transition,
            attempt,
            kind,
            class,
            dead_letter,
            message,
            redrive_count,
            freed_slot,
            leased_at,
        }))
    }

    /// A leased job of (lane, tenant) leaves the in-flight set; returns
    /// whether that freed a slot someone waits for (the core's rule,
    /// `FairScheduler::frees_slot`).
    pub(super) fn release_slot(&mut self, lane: &Lane, tenant: &TenantId) -> bool {
        let (inflight, ready) = self.pairs.release(lane, tenant);
        self.scheduler.frees_slot(tenant, inflight, ready)
    }

    /// A success: `decide`'s first rule needs neither policy nor history, so
    /// it is one statement on columns. The record of the attempt that
    /// succeeded is rebuilt from `lease_started_at`, `worker_id` and
    /// `finished_at` when read (see `super::super::stored`). `None` when `token` is
    /// not the job's current, unexpired lease with its running attempt in
    /// columns.
    pub(super) fn succeed(
        &mut self,
        id: JobId,
        token: LeaseToken,
        now: Timestamp,
    ) -> Result<Option<Completed>, StoreError> {
        // A read, then a write by rowid: `UPDATE … RETURNING` would build
        // and tear down an ephemeral table for every ack.
        let row = db(self
            .conn
            .prepare_cached(
                "SELECT type, tenant, lane, attempts, redrives, lease_started_at, traceparent FROM jobs
                 WHERE id = ?1 AND state = 'leased' AND lease_token = ?2 AND lease_started_at IS NOT NULL
                   AND lease_expires_at > ?3",
            )?
            .query_row(params![id.0 as i64, token.0 as i64, ms(now)], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, i64>(3)?,
                    r.get::<_, i64>(4)?,
                    r.get::<_, Option<i64>>(5)?,
                    r.get::<_, Option<String>>(6)?,
                ))
            })
            .optional())?;
        let Some((job_type, tenant, lane, attempts, redrive_count, leased_at, traceparent)) = row
        else {
            return Ok(None);
        };
        db(self
            .conn
            .prepare_cached(
                "UPDATE jobs SET state = 'succeeded', finished_at = ?2, lease_token = NULL, lease_expires_at = NULL
                 WHERE id = ?1",
            )?
            .execute(params![id.0 as i64, ms(now)]))?;
        let lane = Lane::new(lane);
        let tenant = TenantId::new(tenant);
        let freed_slot = self.release_slot(&lane, &tenant);
        self.succeeded += 1;
        Ok(Some(Completed {
            id,
            job_type: JobType::new(job_type),
            lane,
            tenant,
            traceparent: stored_traceparent(traceparent),
            transition: Transition::Succeeded,
            attempt: attempts as u32,
            kind: None,
            class: None,
            dead_letter: None,
            message: None,
            redrive_count: redrive_count as u32,
            freed_slot,
            leased_at: leased_at.map(Timestamp::from_millis),
        }))
    }

    /// Writes a leased job's transition after a failure or an expiry (the
    /// whole envelope: counters and history changed); returns the dead
    /// letter written, if any, and whether a capped tenant's slot was freed
    /// (`release_slot`).
    pub(super) fn apply(
        &mut self,
        env: &Envelope,
        transition: Transition,
        now: Timestamp,
        payload: &[u8],
    ) -> Result<(Option<DeadLetterId>, bool), StoreError> {
        let id = env.id.0 as i64;
        let freed_slot = self.release_slot(&env.lane, &env.tenant);
        match transition {
            Transition::Succeeded => {
                self.finish(env, JobState::Succeeded, now)?;
                self.succeeded += 1;
                Ok((None, freed_slot))
            }
            Transition::Retry { at, .. } | Transition::Defer { until: at } => {
                let state = transition.next_state(now);
                db(self
                    .conn
                    .prepare_cached(
                        "UPDATE jobs SET state = ?2, run_at = ?3, lease_token = NULL, lease_expires_at = NULL,
                         lease_started_at = NULL, worker_id = NULL, attempts = ?4, envelope = ?5 WHERE id = ?1",
                    )?
                    .execute(params![id, state_word(state), ms(at), env.attempts, env.to_json()]))?;
                if state == JobState::Queued {
                    self.pairs
                        .add_ready(&env.lane, &env.tenant, &env.job_type, 1);
                } else {
                    *self.scheduled.entry(env.lane.clone()).or_default() += 1;
                }
                Ok((None, freed_slot))
            }
            Transition::Cancelled => {
                self.finish(env, JobState::Cancelled, now)?;
                self.cancelled += 1;
                Ok((None, freed_slot))
            }
            Transition::DeadLetter { reason } => {
                self.finish(env, JobState::DeadLettered, now)?;
                let error = env
                    .last_error()
                    .map(|e| serde_json::to_string(e).unwrap_or_default());
                let group = lazaret_core::group_of(
                    Some(env.job_type.as_str()),
                    reason.as_str(),
                    env.last_error(),
                );
                db(self
                    .conn
                    .prepare_cached(
                        "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error, idempotency_key,
                           created_at, dead_lettered_at, payload_size, payload_sha256, payload_preview,
                           group_id, fingerprint, traceparent)
                         VALUES (?1, ?2, ?3, ?4, ?5, 'processing', ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15,
                           (SELECT traceparent FROM jobs WHERE id = ?1))",
                    )?
                    .execute(params![
                        id,
                        env.job_type.as_str(),
                        env.tenant.as_str(),
                        env.lane.as_str(),
                        reason.as_str(),
                        env.attempts,
                        error,
                        env.idempotency_key,
                        ms(env.created_at),
                        ms(now),
                        env.payload_size as i64,
                        env.payload_sha256,
                        payload_preview(payload, lazaret_core::PREVIEW_BYTES_MAX),
                        group.id,
                        group.fingerprint,
                    ]))?;
                Ok((
                    Some(DeadLetterId(self.conn.last_insert_rowid() as u64)),
                    freed_slot,
                ))
            }
        }
    }

    /// Moves a leased job to a terminal state (`succeeded`, `dead_lettered`, `cancelled`)
    /// with its whole envelope.
    pub(super) fn finish(
        &mut self,
        env: &Envelope,
        state: JobState,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        db(self
            .conn
            .prepare_cached(
                "UPDATE jobs SET state = ?2, finished_at = ?3, lease_token = NULL, lease_expires_at = NULL,
                 lease_started_at = NULL, worker_id = NULL, attempts = ?4, envelope = ?5 WHERE id = ?1",
            )?
            .execute(params![env.id.0 as i64, state_word(state), ms(now), env.attempts, env.to_json()]))?;
        Ok(())
    }
}
