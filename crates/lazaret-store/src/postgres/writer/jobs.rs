//! Jobs: enqueues (every enqueue of a group as one insert), cancels,
//! pauses, and the housekeeping that moves jobs along (the tick's
//! promotions and expiries, retention).

use super::*;

/// Scheduled jobs promoted per tick at most.
pub(super) const PROMOTE_MAX: i64 = 20_000;

/// Expired leases handled per tick at most.
pub(super) const EXPIRE_MAX: i64 = 2_000;

/// Inserts jobs, their ids drawn in their order (the ids returned in it).
const INSERT_JOBS_SQL: &str = "WITH ids AS MATERIALIZED (
       SELECT g.ord, nextval(pg_get_serial_sequence('jobs', 'id')) AS id
       FROM generate_series(1::int8, cardinality($1::text[])::int8) AS g(ord)),
     ins AS (
       INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, idempotency_key,
         schema_version, enqueued_by, created_at, payload, traceparent)
       SELECT ids.id, u.type, u.tenant, u.lane, u.state, u.run_at, 0, u.key, u.schema_version,
         u.enqueued_by, u.created_at, u.payload, u.traceparent
       FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int8[], $6::text[],
                   $7::int4[], $8::text[], $9::int8[], $10::bytea[], $11::text[])
         WITH ORDINALITY AS u(type, tenant, lane, state, run_at, key, schema_version,
              enqueued_by, created_at, payload, traceparent, ord)
       JOIN ids ON ids.ord = u.ord)
     SELECT id FROM ids ORDER BY ord";

/// The columns of a multi-row job insert.
#[derive(Default)]
pub(super) struct InsertColumns<'a> {
    pub(super) types: Vec<&'a str>,
    pub(super) tenants: Vec<&'a str>,
    pub(super) lanes: Vec<&'a str>,
    pub(super) states: Vec<&'static str>,
    pub(super) run_at: Vec<i64>,
    pub(super) keys: Vec<Option<&'a str>>,
    pub(super) schema_versions: Vec<Option<i32>>,
    pub(super) enqueued_by: Vec<Option<&'a str>>,
    pub(super) created_at: Vec<i64>,
    pub(super) payloads: Vec<&'a [u8]>,
    pub(super) traceparents: Vec<Option<&'a str>>,
}

impl<'a> InsertColumns<'a> {
    fn push(&mut self, job: &'a NewJob, state: JobState) {
        self.types.push(job.job_type.as_str());
        self.tenants.push(job.tenant.as_str());
        self.lanes.push(job.lane.as_str());
        self.states.push(state.as_str());
        self.run_at.push(ms(job.run_at));
        self.keys.push(job.idempotency_key.as_deref());
        self.schema_versions
            .push(job.schema_version.map(|v| v as i32));
        self.enqueued_by.push(job.enqueued_by.as_deref());
        self.created_at.push(ms(job.now));
        self.payloads.push(&job.payload);
        self.traceparents.push(
            job.traceparent
                .as_ref()
                .map(lazaret_core::TraceParent::as_str),
        );
    }
}

impl Writer {
    /// Every enqueue of the group as one (`answers` gets each op's part).
    pub(super) async fn enqueue_group<'a>(
        &mut self,
        ops: &[&'a Request],
        db_now: Option<Timestamp>,
        answers: &mut [Option<Held<'a>>],
    ) -> Result<(), StoreError> {
        let mut members: Vec<(usize, &'a Reply<Vec<EnqueueOutcome>>, usize)> = Vec::new();
        let mut jobs: Vec<NewJob> = Vec::new();
        for (i, op) in ops.iter().enumerate() {
            if let Request::Enqueue { jobs: js, reply } = *op {
                members.push((i, reply, js.len()));
                jobs.extend(js.iter().map(|j| NewJob {
                    run_at: rebase(db_now, j.run_at, j.now),
                    now: db_now.unwrap_or(j.now),
                    ..j.clone()
                }));
            }
        }
        if members.is_empty() {
            return Ok(());
        }
        let mut outcomes = self.insert_jobs(&jobs).await?.into_iter();
        for (i, reply, n) in members {
            answers[i] = Some(held(reply, outcomes.by_ref().take(n).collect()));
        }
        Ok(())
    }

    /// One enqueue alone, on the group's clock (a group's enqueues run as
    /// one, in [`Writer::enqueue_group`], before its other requests).
    pub(super) async fn enqueue(
        &mut self,
        jobs: &[NewJob],
    ) -> Result<Vec<EnqueueOutcome>, StoreError> {
        let jobs: Vec<NewJob> = jobs
            .iter()
            .map(|j| NewJob {
                run_at: self.rebase(j.run_at, j.now),
                now: self.now_of(j.now),
                ..j.clone()
            })
            .collect();
        self.insert_jobs(&jobs).await
    }

    /// Inserts jobs whose times are on the group's clock already.
    pub(super) async fn insert_jobs(
        &mut self,
        jobs: &[NewJob],
    ) -> Result<Vec<EnqueueOutcome>, StoreError> {
        let mut out: Vec<Option<EnqueueOutcome>> = vec![None; jobs.len()];
        // Keys seen before, in one statement.
        let keyed: Vec<usize> = (0..jobs.len())
            .filter(|&i| jobs[i].idempotency_key.is_some())
            .collect();
        let mut existing: HashMap<(String, String, String), (i64, String, i64)> = HashMap::new();
        if !keyed.is_empty() {
            let tenants: Vec<&str> = keyed.iter().map(|&i| jobs[i].tenant.as_str()).collect();
            let types: Vec<&str> = keyed.iter().map(|&i| jobs[i].job_type.as_str()).collect();
            let keys: Vec<&str> = keyed
                .iter()
                .map(|&i| jobs[i].idempotency_key.as_deref().unwrap_or_default())
                .collect();
            let rows = self
                .query(
                    "SELECT j.tenant, j.type, j.idempotency_key, j.id, j.state, j.run_at FROM jobs j
                     JOIN unnest($1::text[], $2::text[], $3::text[]) AS k(tenant, type, key)
                       ON j.tenant = k.tenant AND j.type = k.type AND j.idempotency_key = k.key",
                    &[&tenants, &types, &keys],
                )
                .await?;
            for r in rows {
                existing.insert(
                    (r.get(0), r.get(1), r.get(2)),
                    (r.get(3), r.get(4), r.get(5)),
                );
            }
        }
        let mut fresh: Vec<usize> = Vec::new();
        for (i, job) in jobs.iter().enumerate() {
            if let Some(key) = &job.idempotency_key {
                let k = (
                    job.tenant.as_str().to_owned(),
                    job.job_type.as_str().to_owned(),
                    key.clone(),
                );
                if existing.get(&k).is_some_and(|(id, _, _)| *id < 0) {
                    // A duplicate of a job earlier in this batch: answered below.
                    continue;
                }
                if let Some((id, state, run_at)) = existing.get(&k) {
                    let mut state: JobState = state.parse().map_err(corrupt)?;
                    if state == JobState::Scheduled && *run_at <= ms(job.now) {
                        state = JobState::Queued;
                    }
                    out[i] = Some(EnqueueOutcome::Duplicate {
                        id: JobId(*id as u64),
                        state,
                    });
                    continue;
                }
                // Later in the same batch, this job is the one found.
                let state = if job.run_at > job.now {
                    "scheduled"
                } else {
                    "queued"
                };
                existing.insert(k, (-(i as i64) - 1, state.to_owned(), ms(job.run_at)));
            }
            fresh.push(i);
        }
        self.refuse_new_tenants(jobs, &mut fresh, &mut out).await?;
        if !fresh.is_empty() {
            // Ids and rows in one statement: ids drawn in the jobs' order.
            let mut c = InsertColumns::default();
            let states: Vec<JobState> = fresh
                .iter()
                .map(|&i| {
                    let job = &jobs[i];
                    let state = if job.run_at > job.now {
                        JobState::Scheduled
                    } else {
                        JobState::Queued
                    };
                    c.push(job, state);
                    state
                })
                .collect();
            // The counts of the jobs' pairs go out with the insert, in the
            // same round trip (a pair read already in this group, or that
            // its early walk reads, is not read again; one whose jobs all
            // turn out duplicates costs a row read for nothing).
            let insert_st = self.stmt(INSERT_JOBS_SQL).await?;
            let counts_st = self.stmt(PAIRS_COUNTS_SQL).await?;
            let mut missing: BTreeSet<(&str, &str)> = fresh
                .iter()
                .map(|&i| (jobs[i].lane.as_str(), jobs[i].tenant.as_str()))
                .filter(|&(l, t)| !self.group.base.contains_key(&(l.to_owned(), t.to_owned())))
                .collect();
            // The early walk reads and locks these already.
            let walked = self.walked_early(&missing.iter().copied().collect::<Vec<_>>());
            for k in &walked {
                missing.remove(k);
            }
            let (count_lanes, count_tenants): (Vec<&str>, Vec<&str>) =
                missing.iter().copied().unzip();
            let params: [&(dyn ToSql + Sync); 11] = [
                &c.types,
                &c.tenants,
                &c.lanes,
                &c.states,
                &c.run_at,
                &c.keys,
                &c.schema_versions,
                &c.enqueued_by,
                &c.created_at,
                &c.payloads,
                &c.traceparents,
            ];
            let client = &self.client;
            let (rows, counted) = futures_util::join!(client.query(&insert_st, &params), async {
                if missing.is_empty() {
                    return Ok(Vec::new());
                }
                client
                    .query(&counts_st, &[&count_lanes, &count_tenants])
                    .await
            });
            let rows = pg(rows)?;
            self.keep_counts(missing, &pg(counted)?);
            self.keep_walked_counts(&walked).await?;
            if rows.len() != fresh.len() {
                return Err(corrupt("an insert drew fewer ids than jobs"));
            }
            for ((&i, state), r) in fresh.iter().zip(states).zip(&rows) {
                out[i] = Some(EnqueueOutcome::Created {
                    id: JobId(r.get::<_, i64>(0) as u64),
                    state,
                    inflight: 0,
                });
            }
        }
        // Duplicates of a job created earlier in this batch.
        for (i, job) in jobs.iter().enumerate() {
            if out[i].is_some() {
                continue;
            }
            let key = job.idempotency_key.clone().unwrap_or_default();
            let k = (
                job.tenant.as_str().to_owned(),
                job.job_type.as_str().to_owned(),
                key,
            );
            let (first, _, _) = existing[&k];
            let first = (-first - 1) as usize;
            out[i] = Some(match out[first].clone() {
                Some(EnqueueOutcome::Created { id, state, .. }) => {
                    EnqueueOutcome::Duplicate { id, state }
                }
                // Refused with its first job.
                Some(refused @ EnqueueOutcome::TooManyTenants { .. }) => refused,
                _ => return Err(corrupt("a batch duplicate without its first job")),
            });
        }
        let mut done = Vec::with_capacity(jobs.len());
        for (job, o) in jobs.iter().zip(out) {
            let mut o = o.expect("every job answered");
            if let EnqueueOutcome::Created {
                state, inflight, ..
            } = &mut o
            {
                let (lane, tenant) = (job.lane.as_str(), job.tenant.as_str());
                *inflight = self.counts(lane, tenant).await?.1.max(0) as u32;
                if *state == JobState::Scheduled {
                    self.delta(lane, tenant).scheduled += 1;
                } else {
                    self.add_ready(lane, tenant, job.job_type.as_str(), 1);
                    self.group
                        .woken
                        .insert((lane.to_owned(), job.job_type.as_str().to_owned()));
                }
            }
            done.push(o);
        }
        Ok(done)
    }

    /// `[tenants] ready_max`: drops from `fresh` (answering
    /// `TooManyTenants`) the jobs of tenants with no jobs ready once as many
    /// tenants as the bound have some (the core's `admits_tenant`). The
    /// count is read when the bound is set, and costs at most the bound;
    /// nodes enqueuing at once may each admit one more.
    pub(super) async fn refuse_new_tenants(
        &mut self,
        jobs: &[NewJob],
        fresh: &mut Vec<usize>,
        out: &mut [Option<EnqueueOutcome>],
    ) -> Result<(), StoreError> {
        let Some(max) = self.scheduler.config().tenants_ready_max else {
            return Ok(());
        };
        if fresh.is_empty() {
            return Ok(());
        }
        let rows = self
            .query("SELECT DISTINCT tenant FROM pairs WHERE ready > 0", &[])
            .await?;
        let mut ready: HashSet<String> = rows.iter().map(|r| r.get(0)).collect();
        ready.extend(
            self.group
                .deltas
                .iter()
                .filter(|(_, d)| d.ready > 0)
                .map(|((_, t), _)| t.clone()),
        );
        let config = self.scheduler.config();
        fresh.retain(|&i| {
            let tenant = jobs[i].tenant.as_str();
            if config.admits_tenant(ready.contains(tenant), ready.len()) {
                ready.insert(tenant.to_owned());
                true
            } else {
                out[i] = Some(EnqueueOutcome::TooManyTenants {
                    tenants_ready_max: max,
                });
                false
            }
        });
        Ok(())
    }

    /// Applies `lazaret_core::cancel`'s decision for the job's state, and
    /// the audit entry when the cancel is accepted.
    pub(super) async fn cancel(
        &mut self,
        &id: &JobId,
        &now: &Timestamp,
        entry: &AuditEntry,
    ) -> Result<Result<crate::Cancelled, crate::CancelError>, StoreError> {
        let now = self.now_of(now);
        let mut entry = entry.clone();
        let rows = self
            .query(
                "SELECT state, lane, tenant, cancel_requested, type FROM jobs WHERE id = $1 FOR UPDATE",
                &[&(id.0 as i64)],
            )
            .await?;
        let Some(r) = rows.first() else {
            return Ok(Err(crate::CancelError::NotFound));
        };
        let (state, lane, tenant, requested, job_type): (String, String, String, bool, String) =
            (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4));
        let state: JobState = state.parse().map_err(corrupt)?;
        let answer = match lazaret_core::cancel(state, requested) {
            lazaret_core::CancelDecision::Refuse { state } => {
                return Ok(Err(crate::CancelError::Finished(state)));
            }
            lazaret_core::CancelDecision::CancelNow => {
                self.execute(
                    "UPDATE jobs SET state = 'cancelled', finished_at = $2, cancel_requested = true
                     WHERE id = $1",
                    &[&(id.0 as i64), &ms(now)],
                )
                .await?;
                if state == JobState::Queued {
                    self.add_ready(&lane, &tenant, &job_type, -1);
                } else {
                    self.delta(&lane, &tenant).scheduled -= 1;
                }
                self.delta(&lane, &tenant).cancelled += 1;
                entry.count = 1;
                crate::Cancelled::Now
            }
            lazaret_core::CancelDecision::Request => {
                self.execute(
                    "UPDATE jobs SET cancel_requested = true WHERE id = $1",
                    &[&(id.0 as i64)],
                )
                .await?;
                entry.count = 1;
                crate::Cancelled::Requested { already: false }
            }
            lazaret_core::CancelDecision::AlreadyRequested => {
                entry.count = 0;
                crate::Cancelled::Requested { already: true }
            }
        };
        self.audit(&entry).await?;
        Ok(Ok(answer))
    }

    /// Records a pause or drops it, with its audit entry; whether it changed.
    pub(super) async fn set_pause(
        &mut self,
        target: &crate::PauseTarget,
        &paused: &bool,
        entry: &AuditEntry,
    ) -> Result<bool, StoreError> {
        let n = if paused {
            self.execute(
                "INSERT INTO pauses (target, name, paused_at, paused_by) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (target, name) DO NOTHING",
                &[&target.kind(), &target.name(), &ms(entry.at), &entry.actor],
            )
            .await?
        } else {
            self.execute(
                "DELETE FROM pauses WHERE target = $1 AND name = $2",
                &[&target.kind(), &target.name()],
            )
            .await?
        };
        if !paused && n > 0 {
            self.group.wake = true;
        }
        self.audit(entry).await?;
        Ok(n > 0)
    }

    pub(super) async fn tick(&mut self, &now: &Timestamp) -> Result<Tick, StoreError> {
        let now = self.now_of(now);
        let mut tick = Tick::default();
        let promoted = self
            .query(
                "WITH due AS (
                   SELECT id FROM jobs WHERE state = 'scheduled' AND run_at <= $1
                   ORDER BY run_at LIMIT $2 FOR UPDATE SKIP LOCKED)
                 UPDATE jobs j SET state = 'queued' FROM due WHERE j.id = due.id
                 RETURNING j.lane, j.tenant, j.type",
                &[&ms(now), &PROMOTE_MAX],
            )
            .await?;
        for r in &promoted {
            let (lane, tenant, job_type): (String, String, String) = (r.get(0), r.get(1), r.get(2));
            self.delta(&lane, &tenant).scheduled -= 1;
            self.add_ready(&lane, &tenant, &job_type, 1);
            tick.promoted += 1;
            self.group.wake = true;
        }
        let expired = self
            .query(
                "SELECT id FROM jobs WHERE state = 'leased' AND lease_expires_at <= $1
                 ORDER BY lease_expires_at LIMIT $2 FOR UPDATE SKIP LOCKED",
                &[&ms(now), &EXPIRE_MAX],
            )
            .await?;
        let ids: Vec<i64> = expired.iter().map(|r| r.get(0)).collect();
        if !ids.is_empty() {
            let mut rows = self.lock_jobs(&ids).await?;
            for id in ids {
                if let Ok(done) = self
                    .complete_one(&mut rows, JobId(id as u64), None, Event::LeaseExpired, now)
                    .await?
                {
                    tick.expired.push(done);
                }
            }
        }
        let next = self
            .query(
                "SELECT run_at FROM jobs WHERE state = 'scheduled' ORDER BY run_at LIMIT 1",
                &[],
            )
            .await?;
        tick.next_due = next.first().map(|r| Timestamp::from_millis(r.get(0)));
        Ok(tick)
    }

    // -----------------------------------------------------------------
    // Dead letters, audit, tokens.

    /// Deletes a batch of old succeeded jobs, unless another node is
    /// doing so now (one node at a time: an advisory lock).
    pub(super) async fn remove_succeeded(
        &mut self,
        &before: &Timestamp,
        &batch: &u32,
    ) -> Result<u64, StoreError> {
        let key = self.retention_lock;
        let locked = self
            .query("SELECT pg_try_advisory_xact_lock($1)", &[&key])
            .await?;
        if !locked.first().is_some_and(|r| r.get::<_, bool>(0)) {
            return Ok(0);
        }
        let rows = self
            .query(
                "WITH old AS (
                   SELECT id FROM jobs WHERE state = 'succeeded' AND finished_at < $1
                   ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED)
                 DELETE FROM jobs j USING old WHERE j.id = old.id RETURNING j.lane, j.tenant",
                &[&ms(before), &i64::from(batch)],
            )
            .await?;
        for r in &rows {
            let (lane, tenant): (String, String) = (r.get(0), r.get(1));
            self.delta(&lane, &tenant).succeeded -= 1;
        }
        let gone = self
            .query(
                "WITH old AS (
                   SELECT id FROM jobs WHERE state = 'cancelled' AND finished_at < $1
                   ORDER BY finished_at LIMIT $2 FOR UPDATE SKIP LOCKED)
                 DELETE FROM jobs j USING old WHERE j.id = old.id RETURNING j.lane, j.tenant",
                &[&ms(before), &i64::from(batch)],
            )
            .await?;
        for r in &gone {
            let (lane, tenant): (String, String) = (r.get(0), r.get(1));
            self.delta(&lane, &tenant).cancelled -= 1;
        }
        Ok((rows.len() + gone.len()) as u64)
    }
}
