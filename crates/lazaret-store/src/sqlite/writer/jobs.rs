//! Jobs: enqueue, cancel, pauses, and the housekeeping that moves them
//! along (the tick's promotions and expiries, retention).

use super::*;

/// Scheduled jobs promoted per tick at most; the rest go on the next.
const PROMOTE_MAX: i64 = 20_000;
/// Expired leases handled per tick at most.
const EXPIRE_MAX: i64 = 2_000;

impl Writer {
    pub(super) fn enqueue(&mut self, jobs: Vec<NewJob>) -> Result<Vec<EnqueueOutcome>, StoreError> {
        let mut out = Vec::with_capacity(jobs.len());
        for job in jobs {
            if let Some(key) = &job.idempotency_key {
                let existing = db(self
                    .conn
                    .prepare_cached(
                        "SELECT id, state, run_at FROM jobs WHERE tenant = ?1 AND type = ?2 AND idempotency_key = ?3",
                    )?
                    .query_row(params![job.tenant.as_str(), job.job_type.as_str(), key], |r| {
                        Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?))
                    })
                    .optional())?;
                if let Some((id, state, run_at)) = existing {
                    let mut state: JobState = state
                        .parse()
                        .map_err(|e| StoreError::Corrupt(format!("{e}")))?;
                    if state == JobState::Scheduled && run_at <= ms(job.now) {
                        state = JobState::Queued;
                    }
                    out.push(EnqueueOutcome::Duplicate {
                        id: JobId(id as u64),
                        state,
                    });
                    continue;
                }
            }
            // A bound on the tenants with jobs ready, if configured: a job of
            // a tenant with none ready is refused at it (the core's rule).
            let config = self.scheduler.config();
            if !config.admits_tenant(
                self.pairs.has_ready(job.tenant.as_str()),
                self.pairs.tenants_ready(),
            ) {
                out.push(EnqueueOutcome::TooManyTenants {
                    tenants_ready_max: config.tenants_ready_max.unwrap_or_default(),
                });
                continue;
            }
            let id = JobId(self.seq.ids.issue(&self.conn)?);
            let state = if job.run_at > job.now {
                JobState::Scheduled
            } else {
                JobState::Queued
            };
            // No envelope yet: `StoredJob::envelope` builds the fresh one from
            // these columns when it is first needed.
            db(self
                .conn
                .prepare_cached(
                    "INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, idempotency_key,
                       schema_version, enqueued_by, created_at, payload, traceparent)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, 0, ?7, ?8, ?9, ?10, ?11, ?12)",
                )?
                .execute(params![
                    id.0 as i64,
                    job.job_type.as_str(),
                    job.tenant.as_str(),
                    job.lane.as_str(),
                    state_word(state),
                    ms(job.run_at),
                    job.idempotency_key,
                    job.schema_version,
                    job.enqueued_by,
                    ms(job.now),
                    job.payload,
                    job.traceparent.as_ref().map(TraceParent::as_str),
                ]))?;
            if state == JobState::Scheduled {
                *self.scheduled.entry(job.lane.clone()).or_default() += 1;
            } else {
                self.pairs
                    .add_ready(&job.lane, &job.tenant, &job.job_type, 1);
            }
            let inflight = self
                .pairs
                .get(job.lane.as_str(), job.tenant.as_str())
                .map_or(0, |p| p.inflight);
            out.push(EnqueueOutcome::Created {
                id,
                state,
                inflight,
            });
        }
        Ok(out)
    }

    /// Applies `lazaret_core::cancel`'s decision for the job's state, and
    /// the audit entry when the cancel is accepted.
    pub(super) fn cancel(
        &mut self,
        id: JobId,
        now: Timestamp,
        mut entry: AuditEntry,
    ) -> Result<Result<Cancelled, CancelError>, StoreError> {
        let row = db(self
            .conn
            .prepare_cached(
                "SELECT state, lane, tenant, cancel_requested, type FROM jobs WHERE id = ?1",
            )?
            .query_row(params![id.0 as i64], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, bool>(3)?,
                    r.get::<_, String>(4)?,
                ))
            })
            .optional())?;
        let Some((state, lane, tenant, requested, job_type)) = row else {
            return Ok(Err(CancelError::NotFound));
        };
        let state: JobState = state
            .parse()
            .map_err(|e| StoreError::Corrupt(format!("job {id}: {e}")))?;
        let answer = match lazaret_core::cancel(state, requested) {
            lazaret_core::CancelDecision::Refuse { state } => {
                return Ok(Err(CancelError::Finished(state)));
            }
            lazaret_core::CancelDecision::CancelNow => {
                db(self
                    .conn
                    .prepare_cached(
                        "UPDATE jobs SET state = 'cancelled', finished_at = ?2, cancel_requested = 1 WHERE id = ?1",
                    )?
                    .execute(params![id.0 as i64, ms(now)]))?;
                let lane = Lane::new(lane);
                if state == JobState::Queued {
                    self.pairs.take_ready(&lane, &tenant, &job_type, 1);
                } else if let Some(n) = self.scheduled.get_mut(&lane) {
                    *n = n.saturating_sub(1);
                }
                self.cancelled += 1;
                entry.count = 1;
                Cancelled::Now
            }
            lazaret_core::CancelDecision::Request => {
                db(self
                    .conn
                    .prepare_cached("UPDATE jobs SET cancel_requested = 1 WHERE id = ?1")?
                    .execute(params![id.0 as i64]))?;
                entry.count = 1;
                Cancelled::Requested { already: false }
            }
            lazaret_core::CancelDecision::AlreadyRequested => {
                entry.count = 0;
                Cancelled::Requested { already: true }
            }
        };
        self.write_audit(&entry)?;
        Ok(Ok(answer))
    }

    /// Records a pause or drops it, with its audit entry; whether it changed.
    pub(super) fn set_pause(
        &mut self,
        target: PauseTarget,
        paused: bool,
        entry: AuditEntry,
    ) -> Result<bool, StoreError> {
        let changed = if paused {
            db(self
                .conn
                .prepare_cached(
                    "INSERT OR IGNORE INTO pauses (target, name, paused_at, paused_by) VALUES (?1, ?2, ?3, ?4)",
                )?
                .execute(params![target.kind(), target.name(), ms(entry.at), entry.actor]))?
        } else {
            db(self
                .conn
                .prepare_cached("DELETE FROM pauses WHERE target = ?1 AND name = ?2")?
                .execute(params![target.kind(), target.name()]))?
        };
        self.write_audit(&entry)?;
        Ok(changed > 0)
    }

    pub(super) fn tick(&mut self, now: Timestamp) -> Result<Tick, StoreError> {
        let mut tick = Tick::default();
        let promoted: Vec<(String, String, String)> = {
            let mut stmt = db(self.conn.prepare_cached(
                "UPDATE OR FAIL jobs SET state = 'queued'
                 WHERE id IN (SELECT id FROM jobs WHERE state = 'scheduled' AND run_at <= ?1 ORDER BY run_at LIMIT +?2)
                 RETURNING lane, tenant, type",
            ))?;
            let rows = db(stmt.query_map(params![ms(now), PROMOTE_MAX], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?))
            }))?;
            let mut v = Vec::new();
            for row in rows {
                v.push(db(row)?);
            }
            v
        };
        for (lane, tenant, job_type) in promoted {
            let lane = Lane::new(lane);
            if let Some(n) = self.scheduled.get_mut(&lane) {
                *n = n.saturating_sub(1);
            }
            self.pairs.add_ready(&lane, &tenant, &job_type, 1);
            tick.promoted += 1;
        }
        let expired: Vec<i64> = {
            let mut stmt = db(self.conn.prepare_cached(
                "SELECT id FROM jobs WHERE state = 'leased' AND lease_expires_at <= ?1 ORDER BY lease_expires_at LIMIT +?2",
            ))?;
            let rows = db(stmt.query_map(params![ms(now), EXPIRE_MAX], |r| r.get(0)))?;
            let mut v = Vec::new();
            for row in rows {
                v.push(db(row)?);
            }
            v
        };
        for id in expired {
            if let Ok(done) = self.complete_one(JobId(id as u64), None, Event::LeaseExpired, now)? {
                tick.expired.push(done);
            }
        }
        tick.next_due = db(self
            .conn
            .prepare_cached("SELECT MIN(run_at) FROM jobs WHERE state = 'scheduled'")?
            .query_row([], |r| r.get::<_, Option<i64>>(0)))?
        .map(Timestamp::from_millis);
        Ok(tick)
    }

    /// Retention: succeeded and cancelled jobs finished before `before`,
    /// up to `batch` of each, each found by its partial index.
    pub(super) fn remove_succeeded(
        &mut self,
        before: Timestamp,
        batch: u32,
    ) -> Result<u64, StoreError> {
        let n = db(self
            .conn
            .prepare_cached(
                "DELETE FROM jobs WHERE id IN
                   (SELECT id FROM jobs WHERE state = 'succeeded' AND finished_at < ?1 ORDER BY finished_at LIMIT +?2)",
            )?
            .execute(params![ms(before), i64::from(batch)]))? as u64;
        self.succeeded = self.succeeded.saturating_sub(n);
        let c = db(self
            .conn
            .prepare_cached(
                "DELETE FROM jobs WHERE id IN
                   (SELECT id FROM jobs WHERE state = 'cancelled' AND finished_at < ?1 ORDER BY finished_at LIMIT +?2)",
            )?
            .execute(params![ms(before), i64::from(batch)]))? as u64;
        self.cancelled = self.cancelled.saturating_sub(c);
        Ok(n + c)
    }
}
