//! Leases: the lease plan's takes and each job's new token, and
//! heartbeats that extend a lease.

use super::*;

/// A take of the lease plan, owned, so the counts it was planned from can change.
struct OwnedTake {
    lane: Lane,
    tenant: TenantId,
    /// `None`: any type.
    types: Option<Vec<JobType>>,
    count: u32,
}

impl Writer {
    /// Leases what the core's lease plan says: it sees the ready counts by
    /// type, so it never sends the store to a (lane, tenant) without jobs
    /// of the asked types, and each take reads only rows it leases (see
    /// `lease_take`). What a lease costs does not depend on how many jobs
    /// of other types wait.
    pub(super) fn lease(&mut self, req: LeaseRequest) -> Result<Vec<LeasedJob>, StoreError> {
        self.leases += 1;
        let mut out: Vec<LeasedJob> = Vec::new();
        let lane_ok = |lane: &Lane| {
            req.lanes.as_ref().is_none_or(|ls| ls.contains(lane))
                && !req.exclude_lanes.contains(lane)
        };
        let takes: Vec<OwnedTake> = {
            let filter = LeaseFilter {
                types: req.types.as_deref(),
                excluded: &req.exclude_types,
                probes: &req.type_limits,
            };
            // Only the pairs the plan needs, walked in the round's order
            // from ordered sets (`super::super::pairs`): about `max_jobs` per
            // lane, however many tenants have jobs ready.
            let pairs: Vec<PairCounts<'_>> = self.pairs.window(
                &self.scheduler,
                &filter,
                lane_ok,
                req.max_jobs,
                &mut self.lease_pairs,
            );
            plan_lease(&mut self.scheduler, &pairs, &filter, req.max_jobs)
                .into_iter()
                .map(|t| OwnedTake {
                    lane: pairs[t.pair].lane.clone(),
                    tenant: pairs[t.pair].tenant.clone(),
                    types: match t.among {
                        Among::AnyType => None,
                        Among::Types(ts) => Some(ts.into_iter().cloned().collect()),
                    },
                    count: t.count,
                })
                .collect()
        };
        for take in &takes {
            let got = self.lease_take(&req, take, &mut out)?;
            if got < take.count {
                // The counts promised more than the table holds: recount
                // after this group rather than plan from wrong numbers again.
                tracing::warn!(
                    lane = %take.lane, tenant = %take.tenant, planned = take.count, got,
                    "ready counts were off; recounting"
                );
                self.dirty = true;
            }
        }
        Ok(out)
    }

    /// Leases up to `take.count` queued jobs of one (lane, tenant), oldest
    /// first, writing only columns: the attempt is charged and the running
    /// attempt recorded in `lease_started_at` and `worker_id` (see
    /// `super::super::stored`). The token comes from the store's one sequence
    /// (`super::super::sequence`): new for every lease, across restarts, redrives
    /// and power losses.
    ///
    /// Reads go by index and stop at what they lease: one type by
    /// `jobs_ready_type` (lane, tenant, type, run_at, id); several types
    /// (or any type, when the pair holds several) by the first `count`
    /// entries of each type in `jobs_ready_type`, merged by (run_at, id),
    /// then the chosen rows by rowid. No read walks past
    /// jobs of a type it does not take.
    fn lease_take(
        &mut self,
        req: &LeaseRequest,
        take: &OwnedTake,
        out: &mut Vec<LeasedJob>,
    ) -> Result<u32, StoreError> {
        // `LIMIT +?n`, never `LIMIT ?n`, here and in every cached statement:
        // SQLite (3.46 on) plans with a bare bound LIMIT's value, so each
        // new binding expires the statement and the next step re-parses and
        // re-plans it (a tenth of the writer's time in profiles). The unary
        // plus keeps the plan independent of the value.
        const ONE_TYPE: &str = "SELECT id, type, idempotency_key, schema_version, created_at, payload, attempts, run_at, traceparent
             FROM jobs INDEXED BY jobs_ready_type WHERE lane = ?1 AND tenant = ?2 AND type = ?3 AND state = 'queued'
             ORDER BY run_at, id LIMIT +?4";
        const OLDEST_OF_TYPE: &str = "SELECT run_at, id
             FROM jobs INDEXED BY jobs_ready_type WHERE lane = ?1 AND tenant = ?2 AND type = ?3 AND state = 'queued'
             ORDER BY run_at, id LIMIT +?4";
        const BY_ID: &str =
            "SELECT id, type, idempotency_key, schema_version, created_at, payload, attempts, run_at, traceparent
             FROM jobs WHERE id = ?1 AND state = 'queued'";
        let (lane, tenant, count) = (&take.lane, &take.tenant, i64::from(take.count));
        let expires = req.now.saturating_add(req.lease);
        let start = out.len();
        let ctx = Leasing {
            lane,
            tenant,
            expires,
        };
        // Every ready job is in one index, `jobs_ready_type` (lane, tenant,
        // type, run_at, id), kept up by each enqueue and lease: a lease of
        // any type reads the oldest of each type the pair has ready (one
        // range when the tenant has one type, the usual case), so the
        // success path pays for one ready index, not two.
        let any: Vec<JobType>;
        let types: &[JobType] = match take.types.as_deref() {
            Some(types) => types,
            None => {
                any = self
                    .pairs
                    .get(lane, tenant)
                    .map(|p| {
                        p.by_type
                            .iter()
                            .filter(|(_, n)| **n > 0)
                            .map(|(t, _)| t.clone())
                            .collect()
                    })
                    .unwrap_or_default();
                &any
            }
        };
        match types {
            [] => {}
            [job_type] => {
                let mut stmt = db(self.conn.prepare_cached(ONE_TYPE))?;
                let mut q = db(stmt.query(params![
                    lane.as_str(),
                    tenant.as_str(),
                    job_type.as_str(),
                    count
                ]))?;
                while let Some(r) = db(q.next())? {
                    out.push(ctx.job(r, &self.conn, &mut self.seq, &mut self.lease_late)?);
                }
                drop(q);
                self.lease_steps += vm_steps(&stmt);
            }
            types => {
                let mut oldest: Vec<(i64, i64)> = Vec::new();
                {
                    let mut stmt = db(self.conn.prepare_cached(OLDEST_OF_TYPE))?;
                    for t in types {
                        let rows = db(stmt.query_map(
                            params![lane.as_str(), tenant.as_str(), t.as_str(), count],
                            |r| Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?)),
                        ))?;
                        for row in rows {
                            oldest.push(db(row)?);
                        }
                    }
                    self.lease_steps += vm_steps(&stmt);
                }
                oldest.sort_unstable();
                oldest.truncate(take.count as usize);
                let mut stmt = db(self.conn.prepare_cached(BY_ID))?;
                for (_, id) in oldest {
                    let mut q = db(stmt.query(params![id]))?;
                    if let Some(r) = db(q.next())? {
                        out.push(ctx.job(r, &self.conn, &mut self.seq, &mut self.lease_late)?);
                    }
                }
                self.lease_steps += vm_steps(&stmt);
            }
        }
        // One write by rowid per job: a multi-row `UPDATE … WHERE id IN
        // (…) RETURNING` builds two ephemeral tables per statement, which
        // costs more than it saves when leases are small.
        let mut update = db(self.conn.prepare_cached(
            "UPDATE jobs SET state = 'leased', attempts = attempts + 1, leases = leases + 1,
                 lease_token = ?2, lease_expires_at = ?3, lease_started_at = ?4, worker_id = ?5
             WHERE id = ?1",
        ))?;
        for job in &out[start..] {
            db(update.execute(params![
                job.id.0 as i64,
                job.lease_token.0 as i64,
                ms(expires),
                ms(req.now),
                req.worker_id.as_str(),
            ]))?;
        }
        drop(update);
        let got = (out.len() - start) as u32;
        for job in &out[start..] {
            self.pairs
                .take_ready(lane, tenant, job.job_type.as_str(), 1);
        }
        self.pairs.add_inflight(lane, tenant, got);
        Ok(got)
    }

    pub(super) fn heartbeat(
        &mut self,
        id: JobId,
        token: LeaseToken,
        until: Timestamp,
        now: Timestamp,
    ) -> Result<Result<Heartbeat, ItemError>, StoreError> {
        // A lease at or past its end is not revived (see `complete_one`).
        let changed = db(self
            .conn
            .prepare_cached(
                "UPDATE jobs SET lease_expires_at = ?2
                 WHERE id = ?1 AND state = 'leased' AND lease_token = ?3 AND lease_expires_at > ?4",
            )?
            .execute(params![id.0 as i64, ms(until), token.0 as i64, ms(now)]))?;
        if changed == 0 {
            return Ok(Err(self.not_leased(id)?));
        }
        // A probe by rowid of the row just written: no `RETURNING` (see `succeed`).
        let cancel_requested = db(self
            .conn
            .prepare_cached("SELECT cancel_requested FROM jobs WHERE id = ?1")?
            .query_row(params![id.0 as i64], |r| r.get::<_, bool>(0)))?;
        Ok(Ok(Heartbeat {
            lease_expires_at: until,
            cancel_requested,
        }))
    }

    /// Why a heartbeat for `id` matched no current lease.
    pub(super) fn not_leased(&self, id: JobId) -> Result<ItemError, StoreError> {
        let exists = db(self
            .conn
            .prepare_cached("SELECT 1 FROM jobs WHERE id = ?1")?
            .query_row(params![id.0 as i64], |_| Ok(()))
            .optional())?;
        Ok(match exists {
            Some(()) => ItemError::LeaseLost,
            None => ItemError::NotFound,
        })
    }
}

/// What every job of one take shares.
struct Leasing<'a> {
    lane: &'a Lane,
    tenant: &'a TenantId,
    expires: Timestamp,
}

impl Leasing<'_> {
    /// The leased job of a row `(id, type, idempotency_key, schema_version,
    /// created_at, payload, attempts, run_at, traceparent)`, with a new token.
    fn job(
        &self,
        r: &rusqlite::Row<'_>,
        conn: &Connection,
        seq: &mut Reserved,
        late: &mut bool,
    ) -> Result<LeasedJob, StoreError> {
        let id: i64 = db(r.get(0))?;
        let token = seq.tokens.issue(conn)?;
        *late |= !seq.durable(id as u64, token);
        Ok(LeasedJob {
            id: JobId(id as u64),
            job_type: JobType::new(db(r.get::<_, String>(1))?),
            tenant: self.tenant.clone(),
            lane: self.lane.clone(),
            payload: db(r.get(5))?,
            attempt: db(r.get::<_, i64>(6))? as u32 + 1,
            idempotency_key: db(r.get(2))?,
            schema_version: db(r.get::<_, Option<i64>>(3))?.map(|v| v as u32),
            lease_token: LeaseToken(token),
            lease_expires_at: self.expires,
            created_at: Timestamp::from_millis(db(r.get(4))?),
            ready_at: Timestamp::from_millis(db(r.get(7))?),
            traceparent: stored_traceparent(db(r.get(8))?),
        })
    }
}

/// The SQLite VM steps `stmt` ran since the last call (and resets the count):
/// a measure of the rows a read looked at, whatever it returned.
fn vm_steps(stmt: &rusqlite::Statement<'_>) -> u64 {
    u64::try_from(stmt.reset_status(rusqlite::StatementStatus::VmStep)).unwrap_or(0)
}
