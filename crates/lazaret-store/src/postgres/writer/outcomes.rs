//! Outcomes: every outcome batch of a group at one time as one, successes
//! in one statement, the rest locked, read and decided by the `Decider`,
//! and the slot a finished lease frees.

use super::*;

/// Successes on live leases (`$1` ids, `$2` their tokens, `$3` now) with
/// the running attempt in columns, which need neither policy nor history
/// (`decide`'s first rule, as SQLite's writer applies it): one statement,
/// returning what the answer needs and the counts of each job's pair.
///
/// Each job is found by its id (`lease_expires_at + 0`: never by the lease
/// ends' index `jobs_leases`, which a plan made without the batch's size,
/// or without statistics, would scan whole), so its generic plan is the
/// custom one. The arrays are read through sub-selects, so a custom plan
/// does not know their length either: both plans cost the same, and after
/// its five custom plans PostgreSQL's `plan_cache_mode = auto` keeps the
/// generic one (which costs no planning), where with the arrays as they
/// come (3 ids to a custom plan, 10 to a generic one) the custom plan
/// always looked cheaper and was made again at every execution, a
/// planning as long as the execution.
pub(super) const SUCCEED_SQL: &str =
    "UPDATE jobs j SET state = 'succeeded', finished_at = $3, lease_token = NULL,
       lease_expires_at = NULL
     FROM unnest((SELECT $1::int8[]), (SELECT $2::int8[])) AS u(id, token)
     WHERE j.id = u.id AND j.state = 'leased' AND j.lease_token = u.token
       AND j.lease_expires_at + 0 > $3 AND j.lease_started_at IS NOT NULL
     RETURNING j.id, j.type, j.tenant, j.lane, j.attempts, j.lease_started_at, j.envelope,
       (SELECT p.ready FROM pairs p WHERE p.lane = j.lane AND p.tenant = j.tenant),
       (SELECT p.inflight FROM pairs p WHERE p.lane = j.lane AND p.tenant = j.tenant),
       j.traceparent";

/// A job locked for an outcome: its row, lease token, lease end, and
/// whether a cancel was requested.
pub(super) type Locked = (StoredJob, Option<i64>, Option<i64>, bool);

/// The items of an outcome batch that [`SUCCEED_SQL`] may apply: the
/// successes of jobs named once (a job named more than once goes the
/// general way, item by item in order, so each of its items finds it as
/// the one before left it).
fn fast_successes(items: &[&Completion]) -> Vec<usize> {
    let mut named: HashMap<JobId, u32> = HashMap::with_capacity(items.len());
    for item in items {
        *named.entry(item.id).or_default() += 1;
    }
    (0..items.len())
        .filter(|&i| matches!(items[i].event, Event::Succeeded) && named[&items[i].id] == 1)
        .collect()
}

impl Writer {
    /// Sends the group's successes on live leases ([`SUCCEED_SQL`]) before
    /// its other statements, without waiting: `complete_items` takes the
    /// rows when it gets to them, so the enqueues' insert and the acks'
    /// update share a round trip. Only when every outcome batch of the
    /// group is at one time (always, on the database's clock): then
    /// [`Writer::complete_group`] runs them as one batch.
    pub(super) async fn send_succeed_early(
        &mut self,
        ops: &[&Request],
        db_now: Option<Timestamp>,
    ) -> Result<(), StoreError> {
        let mut times = ops.iter().filter_map(|op| match op {
            Request::Complete { now, .. } => Some(db_now.unwrap_or(*now)),
            _ => None,
        });
        let Some(now) = times.next() else {
            return Ok(());
        };
        if times.any(|t| t != now) {
            return Ok(());
        }
        let items: Vec<&Completion> = ops
            .iter()
            .flat_map(|op| match op {
                Request::Complete { items, .. } => items.iter(),
                _ => [].iter(),
            })
            .collect();
        let fast = fast_successes(&items);
        if fast.is_empty() {
            return Ok(());
        }
        let ids: Vec<i64> = fast.iter().map(|&i| items[i].id.0 as i64).collect();
        let tokens: Vec<i64> = fast.iter().map(|&i| items[i].token.0 as i64).collect();
        let st = self.stmt(SUCCEED_SQL).await?;
        let client = Arc::clone(&self.client);
        let (i, t, at) = (ids.clone(), tokens.clone(), ms(now));
        let rows = send_early(Box::pin(async move {
            let params: [&(dyn ToSql + Sync); 3] = [&i, &t, &at];
            client.query(&st, &params).await
        }))
        .await;
        self.group.early_succeed = Some(((ids, tokens), now, rows));
        Ok(())
    }

    /// Every outcome batch of the group at the same time as one.
    pub(super) async fn complete_group<'a>(
        &mut self,
        ops: &[&'a Request],
        db_now: Option<Timestamp>,
        answers: &mut [Option<Held<'a>>],
    ) -> Result<(), StoreError> {
        // By time (one time for all on the database's clock).
        let mut times: BTreeMap<Timestamp, Vec<usize>> = BTreeMap::new();
        for (i, op) in ops.iter().enumerate() {
            if let Request::Complete { now, .. } = op {
                times.entry(db_now.unwrap_or(*now)).or_default().push(i);
            }
        }
        for (now, members) in times {
            let items: Vec<&Completion> = members
                .iter()
                .flat_map(|&i| match ops[i] {
                    Request::Complete { items, .. } => items.iter(),
                    _ => unreachable!("members are outcome batches"),
                })
                .collect();
            let mut out = self.complete_items(&items, now).await?.into_iter();
            for i in members {
                let Request::Complete { items, reply, .. } = ops[i] else {
                    unreachable!("members are outcome batches")
                };
                answers[i] = Some(held(reply, out.by_ref().take(items.len()).collect()));
            }
        }
        Ok(())
    }

    /// One outcome batch alone, on the group's clock (a group's batches
    /// run as one, in [`Writer::complete_group`], before its other requests).
    pub(super) async fn complete(
        &mut self,
        items: &[Completion],
        &now: &Timestamp,
    ) -> Result<Vec<Result<Completed, ItemError>>, StoreError> {
        let items: Vec<&Completion> = items.iter().collect();
        self.complete_items(&items, self.now_of(now)).await
    }

    /// Outcomes at `now` (on the group's clock already), in order.
    /// Successes on live leases first, all in one statement
    /// ([`SUCCEED_SQL`]: no row lock and read before the write, and the
    /// counts of their pairs read with them); everything else (a
    /// failure, a stale token, a job named twice) then the general way:
    /// the jobs locked at once (by id), the counts of their pairs read at
    /// once, each outcome through the `Decider`.
    pub(super) async fn complete_items(
        &mut self,
        items: &[&Completion],
        now: Timestamp,
    ) -> Result<Vec<Result<Completed, ItemError>>, StoreError> {
        let mut out: Vec<Option<Result<Completed, ItemError>>> =
            items.iter().map(|_| None).collect();
        let fast = fast_successes(items);
        if !fast.is_empty() {
            let ids: Vec<i64> = fast.iter().map(|&i| items[i].id.0 as i64).collect();
            let tokens: Vec<i64> = fast.iter().map(|&i| items[i].token.0 as i64).collect();
            let rows = match self.group.early_succeed.take() {
                // Sent with the group's first statements (`Writer::send_succeed_early`).
                Some((sent, at, rows)) if sent == (ids.clone(), tokens.clone()) && at == now => {
                    rows.await?
                }
                _ => self.query(SUCCEED_SQL, &[&ids, &tokens, &ms(now)]).await?,
            };
            let mut done: HashMap<i64, Completed> = HashMap::with_capacity(rows.len());
            for r in &rows {
                let id: i64 = r.get(0);
                let (lane, tenant): (String, String) = (r.get(3), r.get(2));
                self.group
                    .base
                    .entry((lane.clone(), tenant.clone()))
                    .or_insert((
                        r.get::<_, Option<i64>>(7).unwrap_or(0),
                        r.get::<_, Option<i64>>(8).unwrap_or(0),
                    ));
                // No envelope yet means no redrive yet.
                let redrive_count = match r.get::<_, Option<&str>>(6) {
                    Some(json) => {
                        Envelope::from_json(json)
                            .map_err(|e| corrupt(format!("job {id}: stored envelope: {e}")))?
                            .redrive_count
                    }
                    None => 0,
                };
                let (lane, tenant) = (Lane::new(lane), TenantId::new(tenant));
                let freed_slot = self.release_slot(&lane, &tenant).await?;
                self.delta(lane.as_str(), tenant.as_str()).succeeded += 1;
                done.insert(
                    id,
                    Completed {
                        id: JobId(id as u64),
                        job_type: JobType::new(r.get::<_, String>(1)),
                        lane,
                        tenant,
                        traceparent: crate::stored::stored_traceparent(r.get(9)),
                        transition: Transition::Succeeded,
                        attempt: r.get::<_, i32>(4) as u32,
                        kind: None,
                        class: None,
                        dead_letter: None,
                        message: None,
                        redrive_count,
                        freed_slot,
                        leased_at: r.get::<_, Option<i64>>(5).map(Timestamp::from_millis),
                    },
                );
            }
            for i in fast {
                if let Some(c) = done.remove(&(items[i].id.0 as i64)) {
                    out[i] = Some(Ok(c));
                }
            }
        }
        let rest: Vec<usize> = (0..items.len()).filter(|&i| out[i].is_none()).collect();
        if !rest.is_empty() {
            let ids: Vec<i64> = rest.iter().map(|&i| items[i].id.0 as i64).collect();
            let mut rows = self.lock_jobs(&ids).await?;
            let pairs: Vec<(String, String)> = rows
                .values()
                .filter(|(s, ..)| s.state == JobState::Leased)
                .map(|(s, ..)| (s.lane.clone(), s.tenant.clone()))
                .collect();
            self.prefetch_counts(pairs).await?;
            // Successes the statement above did not take are not live:
            // `try_succeed` finds so, and they go the general way.
            let mut succeeded: Vec<i64> = Vec::new();
            for i in rest {
                let item = items[i];
                if let Some(done) = self.try_succeed(&mut rows, item, now).await? {
                    succeeded.push(done.id.0 as i64);
                    out[i] = Some(Ok(done));
                    continue;
                }
                out[i] = Some(
                    self.complete_one(
                        &mut rows,
                        item.id,
                        Some(item.token),
                        item.event.clone(),
                        now,
                    )
                    .await?,
                );
            }
            if !succeeded.is_empty() {
                self.execute(
                    "UPDATE jobs SET state = 'succeeded', finished_at = $2, lease_token = NULL,
                       lease_expires_at = NULL
                     WHERE id = ANY($1)",
                    &[&succeeded, &ms(now)],
                )
                .await?;
            }
        }
        Ok(out
            .into_iter()
            .map(|o| o.expect("every outcome answered"))
            .collect())
    }

    /// Locks the jobs an outcome batch names, by id order (two batches lock
    /// in the same order), and reads them with their lease columns.
    pub(super) async fn lock_jobs(
        &mut self,
        ids: &[i64],
    ) -> Result<HashMap<i64, Locked>, StoreError> {
        let rows = self
            .query(
                "SELECT id, type, tenant, lane, state, attempts, lease_started_at, worker_id,
                   idempotency_key, schema_version, created_at, finished_at, envelope, payload,
                   lease_token, lease_expires_at, cancel_requested, traceparent
                 FROM jobs WHERE id = ANY($1) ORDER BY id FOR UPDATE",
                &[&ids],
            )
            .await?;
        let mut out = HashMap::with_capacity(rows.len());
        for r in rows {
            let job = stored_job(&r)?;
            out.insert(job.id, (job, r.get(14), r.get(15), r.get(16)));
        }
        Ok(out)
    }

    /// A worker's success on its current, unexpired lease with the running
    /// attempt in columns (`lease_started_at`): answered here, written by
    /// the caller's one UPDATE for the batch. `None`: the general path.
    pub(super) async fn try_succeed(
        &mut self,
        rows: &mut HashMap<i64, Locked>,
        item: &Completion,
        now: Timestamp,
    ) -> Result<Option<Completed>, StoreError> {
        if !matches!(item.event, Event::Succeeded) {
            return Ok(None);
        }
        let Some((stored, current, expires_at, _)) = rows.get_mut(&(item.id.0 as i64)) else {
            return Ok(None);
        };
        let live = stored.state == JobState::Leased
            && *current == Some(item.token.0 as i64)
            && expires_at.is_some_and(|end| end > ms(now))
            && stored.lease_started_at.is_some();
        if !live {
            return Ok(None);
        }
        // No envelope yet means no redrive yet.
        let redrive_count = match &stored.envelope {
            Some(_) => stored.envelope()?.redrive_count,
            None => 0,
        };
        let leased_at = stored.lease_started_at.map(Timestamp::from_millis);
        stored.state = JobState::Succeeded;
        *current = None;
        let (lane, tenant) = (
            Lane::new(stored.lane.clone()),
            TenantId::new(stored.tenant.clone()),
        );
        let (job_type, attempt) = (
            JobType::new(stored.job_type.clone()),
            stored.attempts as u32,
        );
        let freed_slot = self.release_slot(&lane, &tenant).await?;
        self.delta(lane.as_str(), tenant.as_str()).succeeded += 1;
        let traceparent = crate::stored::stored_traceparent(stored.traceparent.clone());
        Ok(Some(Completed {
            id: item.id,
            job_type,
            lane,
            tenant,
            traceparent,
            transition: Transition::Succeeded,
            attempt,
            kind: None,
            class: None,
            dead_letter: None,
            message: None,
            redrive_count,
            freed_slot,
            leased_at,
        }))
    }

    /// Applies one outcome to a locked job. `token: None` is the reaper.
    pub(super) async fn complete_one(
        &mut self,
        rows: &mut HashMap<i64, Locked>,
        id: JobId,
        token: Option<LeaseToken>,
        event: Event,
        now: Timestamp,
    ) -> Result<Result<Completed, ItemError>, StoreError> {
        let Some((stored, current, expires_at, cancel_requested)) = rows.get_mut(&(id.0 as i64))
        else {
            return Ok(Err(ItemError::NotFound));
        };
        let cancel_requested = *cancel_requested;
        if stored.state != JobState::Leased {
            return Ok(Err(ItemError::LeaseLost));
        }
        if let Some(token) = token {
            let ended = expires_at.is_some_and(|end| end <= ms(now));
            if Some(token.0 as i64) != *current || ended {
                return Ok(Err(ItemError::LeaseLost));
            }
        }
        let mut env = stored.envelope()?;
        let leased_at = stored.lease_started_at.map(Timestamp::from_millis);
        let attempt = env.attempts;
        let decided = self.decider.decide(&mut env, event, now);
        let transition = lazaret_core::settle(&mut env, decided, cancel_requested);
        // A later item of the same batch finds the job as it is now.
        stored.state = transition.next_state(now);
        *current = None;
        let payload = std::mem::take(&mut stored.payload);
        let (dead_letter, freed_slot) = self.apply(&env, transition, now, &payload).await?;
        if let Some((s, _, _, _)) = rows.get_mut(&(id.0 as i64)) {
            s.payload = payload;
        }
        let (kind, class, message) = env
            .history
            .last()
            .and_then(|r| r.error.as_ref())
            .filter(|_| transition != Transition::Succeeded)
            .map_or((None, None, None), |e| {
                (Some(e.kind.clone()), e.class, Some(e.message.clone()))
            });
        Ok(Ok(Completed {
            id,
            job_type: env.job_type.clone(),
            lane: env.lane.clone(),
            tenant: env.tenant.clone(),
            traceparent: env.traceparent.clone(),
            transition,
            attempt,
            kind,
            class,
            dead_letter,
            message,
            redrive_count: env.redrive_count,
            freed_slot,
            leased_at,
        }))
    }

    /// A leased job of (lane, tenant) leaves the in-flight set; whether that
    /// freed a slot someone waits for (the core's rule,
    /// `FairScheduler::frees_slot`).
    pub(super) async fn release_slot(
        &mut self,
        lane: &Lane,
        tenant: &TenantId,
    ) -> Result<bool, StoreError> {
        let (ready, inflight) = self.counts(lane.as_str(), tenant.as_str()).await?;
        self.delta(lane.as_str(), tenant.as_str()).inflight -= 1;
        let freed = self
            .scheduler
            .frees_slot(tenant, count32(inflight), count32(ready));
        if freed {
            self.group.wake = true;
        }
        Ok(freed)
    }

    /// Writes a leased job's transition: the envelope, the state, and for a
    /// dead letter its record, in this transaction.
    pub(super) async fn apply(
        &mut self,
        env: &Envelope,
        transition: Transition,
        now: Timestamp,
        payload: &[u8],
    ) -> Result<(Option<DeadLetterId>, bool), StoreError> {
        let id = env.id.0 as i64;
        let freed_slot = self.release_slot(&env.lane, &env.tenant).await?;
        let (lane, tenant) = (env.lane.as_str(), env.tenant.as_str());
        match transition {
            Transition::Succeeded => {
                self.finish(env, JobState::Succeeded, now).await?;
                self.delta(lane, tenant).succeeded += 1;
                Ok((None, freed_slot))
            }
            Transition::Retry { at, .. } | Transition::Defer { until: at } => {
                let state = transition.next_state(now);
                self.execute(
                    "UPDATE jobs SET state = $2, run_at = $3, lease_token = NULL, lease_expires_at = NULL,
                     lease_started_at = NULL, worker_id = NULL, attempts = $4, envelope = $5 WHERE id = $1",
                    &[&id, &state.as_str(), &ms(at), &(env.attempts as i32), &env.to_json()],
                )
                .await?;
                if state == JobState::Queued {
                    self.add_ready(lane, tenant, env.job_type.as_str(), 1);
                    self.group.wake = true;
                } else {
                    self.delta(lane, tenant).scheduled += 1;
                }
                Ok((None, freed_slot))
            }
            Transition::Cancelled => {
                self.finish(env, JobState::Cancelled, now).await?;
                self.delta(lane, tenant).cancelled += 1;
                Ok((None, freed_slot))
            }
            Transition::DeadLetter { reason } => {
                self.finish(env, JobState::DeadLettered, now).await?;
                let error = env
                    .last_error()
                    .map(|e| serde_json::to_string(e).unwrap_or_default());
                let group = lazaret_core::group_of(
                    Some(env.job_type.as_str()),
                    reason.as_str(),
                    env.last_error(),
                );
                let rows = self
                    .query(
                        "INSERT INTO dead_letters (job_id, type, tenant, lane, reason, stage, attempts, error,
                           idempotency_key, created_at, dead_lettered_at, payload_size, payload_sha256, payload_preview,
                           group_id, fingerprint, traceparent)
                         VALUES ($1, $2, $3, $4, $5, 'processing', $6, $7, $8, $9, $10, $11, $12, $13, $14, $15,
                           (SELECT traceparent FROM jobs WHERE id = $1))
                         RETURNING id",
                        &[
                            &id,
                            &env.job_type.as_str(),
                            &tenant,
                            &lane,
                            &reason.as_str(),
                            &(env.attempts as i32),
                            &error,
                            &env.idempotency_key,
                            &ms(env.created_at),
                            &ms(now),
                            &(env.payload_size as i64),
                            &env.payload_sha256,
                            &payload_preview(payload, lazaret_core::PREVIEW_BYTES_MAX),
                            &group.id,
                            &group.fingerprint,
                        ],
                    )
                    .await?;
                let dl: i64 = rows
                    .first()
                    .map(|r| r.get(0))
                    .ok_or_else(|| corrupt("no id"))?;
                Ok((Some(DeadLetterId(dl as u64)), freed_slot))
            }
        }
    }

    pub(super) async fn finish(
        &mut self,
        env: &Envelope,
        state: JobState,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        self.execute(
            "UPDATE jobs SET state = $2, finished_at = $3, lease_token = NULL, lease_expires_at = NULL,
             lease_started_at = NULL, worker_id = NULL, attempts = $4, envelope = $5 WHERE id = $1",
            &[
                &(env.id.0 as i64),
                &state.as_str(),
                &ms(now),
                &(env.attempts as i32),
                &env.to_json(),
            ],
        )
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::plans::{answered, plan_counts, plan_text, scratch};
    use super::SUCCEED_SQL;

    /// The acks' statement runs on a generic plan, which PostgreSQL's
    /// `plan_cache_mode = auto` chooses after five custom plans: made
    /// once, perhaps before the table has statistics, and kept. It
    /// must find each job by its id however many jobs are leased, never by
    /// scanning the lease ends' index (`jobs_leases`), as the plan made
    /// without `+ 0` did: a hash join over every live lease, 2.9 ms for 3
    /// acks among 10,000 leases here.
    #[tokio::test]
    async fn the_acks_generic_plan_finds_each_job_by_its_id() {
        // 10,000 live leases among 30,000 jobs, and no statistics yet.
        let Some((opts, c)) = scratch(
            "the acks' generic plan",
            "INSERT INTO jobs (type, tenant, lane, state, run_at, attempts, created_at, payload,
                               lease_token, lease_expires_at, lease_started_at)
             SELECT 'bench', 't' || (g % 8), 'bench',
                    CASE WHEN g % 3 = 0 THEN 'leased' ELSE 'queued' END,
                    g, 0, g, '\\x00', g, 9999999999, 1
             FROM generate_series(1, 30000) g",
        )
        .await
        else {
            return;
        };
        // As the writer runs it: prepared once, executed with arrays of
        // several lengths under the session's default `plan_cache_mode`.
        let mut script = format!("BEGIN; PREPARE succeed (int8[], int8[], int8) AS {SUCCEED_SQL};");
        for ids in [
            "{3,6,9}",
            "{12}",
            "{15,18}",
            "{21,24,27,30}",
            "{33}",
            "{36}",
            "{39,42}",
        ] {
            script.push_str(&format!("EXECUTE succeed ('{ids}', '{ids}', 5);"));
        }
        script.push_str(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements
               WHERE name = 'succeed';
             EXPLAIN EXECUTE succeed ('{48}', '{48}', 5);
             ROLLBACK",
        );
        let rows = answered(&opts, &c, &script).await;
        // Seven executions: five custom plans, then the generic one kept.
        assert_eq!(plan_counts(&rows), (2, 5), "generic, custom: {rows:?}");
        let plan = plan_text(&rows);
        assert!(plan.contains("Nested Loop"), "by id, job by job: {plan}");
        assert!(!plan.contains("jobs_leases"), "not by lease end: {plan}");
    }
}
