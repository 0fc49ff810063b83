//! Leases: compatible leases of a group merged into one, each take's
//! SQL, and heartbeats that extend a lease.

use super::*;

/// A lease's jobs (one run per take, each a (lane, tenant)) in turns:
/// the first of each take, then the second of each, and so on, so that
/// the requests sharing one lease get each what a lease of its own would
/// have taken in the scheduler's round, not one tenant's run.
pub(super) fn round_robin<T>(jobs: Vec<T>, job: impl Fn(&T) -> &LeasedJob) -> Vec<T> {
    let mut runs: Vec<std::collections::VecDeque<T>> = Vec::new();
    for j in jobs {
        match runs.last_mut() {
            Some(run)
                if run.back().is_some_and(|b| {
                    let (b, j) = (job(b), job(&j));
                    b.lane == j.lane && b.tenant == j.tenant
                }) =>
            {
                run.push_back(j);
            }
            _ => runs.push(std::collections::VecDeque::from([j])),
        }
    }
    let mut out = Vec::with_capacity(runs.iter().map(|r| r.len()).sum());
    while !runs.is_empty() {
        for run in &mut runs {
            out.extend(run.pop_front());
        }
        runs.retain(|r| !r.is_empty());
    }
    out
}

/// A request of a merged lease, as its jobs are written: its worker, its
/// lease end (ms) and how many jobs it asked.
pub(super) struct Hand<'a> {
    pub(super) worker: &'a str,
    pub(super) end: i64,
    pub(super) max_jobs: u32,
}

/// A take's jobs' workers and lease ends (ms), oldest job first.
pub(super) type Handed<'a> = (Vec<&'a str>, Vec<i64>);

/// The worker and lease end of each take's jobs, oldest first, when every
/// take yields its count: the jobs are handed out in turns
/// ([`round_robin`]), then in the requests' order, each up to its
/// `max_jobs` ([`Writer::lease_many`]). A take's statement writes them, so
/// a merged lease's jobs need no second update; a take that comes up short
/// shifts the turns, and `lease_many` gives the jobs that went elsewhere
/// their own ([`LEASE_ASSIGN_SQL`]).
pub(super) fn handed<'a>(counts: &[u32], hands: &[Hand<'a>]) -> Vec<Handed<'a>> {
    let mut out: Vec<Handed<'a>> = counts.iter().map(|_| (Vec::new(), Vec::new())).collect();
    let mut owners = hands
        .iter()
        .flat_map(|h| std::iter::repeat_n(h, h.max_jobs as usize));
    for k in 0..counts.iter().copied().max().unwrap_or(0) {
        for (t, _) in counts.iter().enumerate().filter(|(_, c)| k < **c) {
            let Some(h) = owners.next() else {
                return out;
            };
            out[t].0.push(h.worker);
            out[t].1.push(h.end);
        }
    }
    out
}

/// Whether two leases of one group can be planned as one: the same
/// filter (lanes and types, asked and left out), no probe quotas (a
/// half-open breaker's probes are counted per request) and the same time.
/// Workers and lease lengths may differ: each job is then given its own.
pub(super) fn leases_merge(a: &LeaseRequest, b: &LeaseRequest, db_now: Option<Timestamp>) -> bool {
    a.lanes == b.lanes
        && a.types == b.types
        && a.exclude_types == b.exclude_types
        && a.exclude_lanes == b.exclude_lanes
        && a.type_limits.is_empty()
        && b.type_limits.is_empty()
        && db_now.unwrap_or(a.now) == db_now.unwrap_or(b.now)
}

/// Leases up to `$4` queued jobs of one (lane, tenant) and one type `$3`,
/// oldest first, in one statement: one range of the typed ready index
/// `jobs_ready_type` (lane, tenant, type, run_at, id), picked `FOR UPDATE
/// SKIP LOCKED` (never a job another transaction holds), charged an attempt
/// and given a token from the sequence `lease_tokens`. The `k`-th job (oldest
/// first) goes to worker `$8[k]` until `$9[k]`, or `$7` until `$5` past
/// those arrays' ends (the requests of a merged lease, [`handed`]).
pub(super) const LEASE_ONE_SQL: &str = "WITH picked AS (
                   SELECT id, row_number() OVER (ORDER BY run_at, id) AS rn FROM (
                     SELECT id, run_at FROM jobs
                     WHERE lane = $1 AND tenant = $2 AND type = $3 AND state = 'queued'
                     ORDER BY run_at, id LIMIT $4 FOR UPDATE SKIP LOCKED) c)
                 UPDATE jobs j SET state = 'leased', attempts = j.attempts + 1, leases = j.leases + 1,
                   lease_token = nextval('lease_tokens'),
                   lease_expires_at = COALESCE(($9::int8[])[picked.rn], $5), lease_started_at = $6,
                   worker_id = COALESCE(($8::text[])[picked.rn], $7)
                 FROM picked WHERE j.id = picked.id
                 RETURNING j.id, j.type, j.idempotency_key, j.schema_version, j.created_at, j.payload,
                   j.attempts, j.lease_token, j.run_at, j.traceparent, j.worker_id, j.lease_expires_at";

/// [`LEASE_ONE_SQL`] among several types `$3`, as SQLite's writer does it:
/// the first `$4` ready jobs of each type (a range of `jobs_ready_type`
/// each, unlocked), merged by (run_at, id), and the oldest `$4` of them
/// locked and leased. No read walks past jobs of a type it does not take.
pub(super) const LEASE_MERGED_SQL: &str = "WITH picked AS (
                   SELECT id, row_number() OVER (ORDER BY run_at, id) AS rn FROM (
                     SELECT id, run_at FROM jobs
                     WHERE id = ANY(ARRAY(
                         SELECT x.id FROM unnest($3::text[]) AS t(type)
                         CROSS JOIN LATERAL (
                           SELECT id, run_at FROM jobs
                           WHERE lane = $1 AND tenant = $2 AND type = t.type AND state = 'queued'
                           ORDER BY run_at, id LIMIT $4) x
                         ORDER BY x.run_at, x.id LIMIT $4))
                       AND state = 'queued'
                     FOR UPDATE SKIP LOCKED) c)
                 UPDATE jobs j SET state = 'leased', attempts = j.attempts + 1, leases = j.leases + 1,
                   lease_token = nextval('lease_tokens'),
                   lease_expires_at = COALESCE(($9::int8[])[picked.rn], $5), lease_started_at = $6,
                   worker_id = COALESCE(($8::text[])[picked.rn], $7)
                 FROM picked WHERE j.id = picked.id
                 RETURNING j.id, j.type, j.idempotency_key, j.schema_version, j.created_at, j.payload,
                   j.attempts, j.lease_token, j.run_at, j.traceparent, j.worker_id, j.lease_expires_at";

/// Several takes of [`LEASE_ONE_SQL`] (each of one type) in one statement:
/// take `k` (1-based) leases up to `$4[k]` queued jobs of type `$3[k]` in
/// (`$1[k]`, `$2[k]`), oldest first, as `LEASE_ONE_SQL` would, and its
/// `i`-th job goes to worker `$8[$10[k] + i]` until `$9[$10[k] + i]` (each
/// take's hands padded with nulls to its count: `$7` until `$5`). Each row
/// says its take (the last column). One statement where each take was one
/// costs one execution and one answer: a lease of one job from each of
/// eight tenants was eight. The leased jobs are found by id through an
/// array (`unnest` of sub-selects, ten rows to the planner whatever the
/// takes), so the update probes the primary key job by job, never a scan;
/// the takes' arrays too, so a custom plan costs what the generic one does
/// and PostgreSQL keeps the generic one (no planning per execution).
pub(super) const LEASE_TAKES_SQL: &str = "WITH picked AS (
                   SELECT x.id, w.k, w.base + row_number() OVER (PARTITION BY w.k ORDER BY x.run_at, x.id) AS slot
                   FROM unnest((SELECT $1::text[]), (SELECT $2::text[]), (SELECT $3::text[]),
                               (SELECT $4::int8[]), (SELECT $10::int8[]))
                     WITH ORDINALITY AS w(lane, tenant, type, n, base, k)
                   CROSS JOIN LATERAL (
                     SELECT id, run_at FROM jobs
                     WHERE lane = w.lane AND tenant = w.tenant AND type = w.type AND state = 'queued'
                     ORDER BY run_at, id LIMIT w.n FOR UPDATE SKIP LOCKED) x)
                 UPDATE jobs j SET state = 'leased', attempts = j.attempts + 1, leases = j.leases + 1,
                   lease_token = nextval('lease_tokens'),
                   lease_expires_at = COALESCE(($9::int8[])[u.slot], $5), lease_started_at = $6,
                   worker_id = COALESCE(($8::text[])[u.slot], $7)
                 FROM unnest((SELECT array_agg(id ORDER BY slot) FROM picked),
                             (SELECT array_agg(k ORDER BY slot) FROM picked),
                             (SELECT array_agg(slot ORDER BY slot) FROM picked)) AS u(id, k, slot)
                 WHERE j.id = u.id
                 RETURNING j.id, j.type, j.idempotency_key, j.schema_version, j.created_at, j.payload,
                   j.attempts, j.lease_token, j.run_at, j.traceparent, j.worker_id, j.lease_expires_at, u.k";

/// Gives the jobs of a merged lease that went to another request than the
/// first its worker and lease end.
pub(super) const LEASE_ASSIGN_SQL: &str =
    "UPDATE jobs j SET worker_id = u.worker, lease_expires_at = u.expires
     FROM unnest($1::int8[], $2::text[], $3::int8[]) AS u(id, worker, expires)
     WHERE j.id = u.id";

/// The takes [`LEASE_TAKES_SQL`] runs, as its columns.
#[derive(Default)]
struct TakeColumns<'a> {
    lanes: Vec<&'a str>,
    tenants: Vec<&'a str>,
    types: Vec<&'a str>,
    counts: Vec<i64>,
    /// Where each take's hands start in `workers` and `ends`.
    bases: Vec<i64>,
    workers: Vec<Option<&'a str>>,
    ends: Vec<Option<i64>>,
}

impl<'a> TakeColumns<'a> {
    /// A take of `n` jobs and their hands (fewer than `n`: the rest null,
    /// the statement's defaults).
    fn push(
        &mut self,
        lane: &'a str,
        tenant: &'a str,
        job_type: &'a str,
        n: i64,
        workers: &[&'a str],
        ends: &[i64],
    ) {
        self.lanes.push(lane);
        self.tenants.push(tenant);
        self.types.push(job_type);
        self.counts.push(n);
        self.bases.push(self.workers.len() as i64);
        for j in 0..usize::try_from(n).unwrap_or(0) {
            self.workers.push(workers.get(j).copied());
            self.ends.push(ends.get(j).copied());
        }
    }
}

impl Writer {
    /// Leases of one group with the same filter ([`leases_merge`]) as one:
    /// one plan for all the jobs they ask, the jobs then handed out in the
    /// requests' order (each request at most its `max_jobs`), each job
    /// written with its own request's worker and lease end by the take that
    /// leases it ([`handed`]). One lease costs its statements once, however
    /// many workers asked at the same moment.
    pub(super) async fn lease_many(
        &mut self,
        reqs: &[LeaseRequest],
    ) -> Result<Vec<Vec<LeasedJob>>, StoreError> {
        let [first, rest @ ..] = reqs else {
            return Ok(Vec::new());
        };
        if rest.is_empty() {
            return Ok(vec![self.lease_one(first).await?]);
        }
        let combined = LeaseRequest {
            max_jobs: reqs.iter().map(|r| r.max_jobs).fold(0, u32::saturating_add),
            ..first.clone()
        };
        let hands: Vec<Hand<'_>> = reqs
            .iter()
            .map(|r| Hand {
                worker: r.worker_id.as_str(),
                end: ms(r.now.saturating_add(r.lease)),
                max_jobs: r.max_jobs,
            })
            .collect();
        let taken = self.lease_handed(&combined, &hands).await?;
        let mut jobs = round_robin(taken, |(j, _)| j).into_iter();
        let (mut ids, mut workers, mut ends) = (Vec::new(), Vec::new(), Vec::new());
        let mut out = Vec::with_capacity(reqs.len());
        for (r, hand) in reqs.iter().zip(&hands) {
            let end = r.now.saturating_add(r.lease);
            let mut mine = Vec::new();
            for (j, written) in jobs.by_ref().take(r.max_jobs as usize) {
                if written != hand.worker || ms(j.lease_expires_at) != hand.end {
                    ids.push(j.id.0 as i64);
                    workers.push(hand.worker);
                    ends.push(hand.end);
                }
                mine.push(LeasedJob {
                    lease_expires_at: end,
                    ..j
                });
            }
            out.push(mine);
        }
        debug_assert!(jobs.next().is_none(), "a lease took more than asked");
        let assign = &mut self.group.assign;
        assign.0.extend(ids);
        assign.1.extend(workers.into_iter().map(str::to_owned));
        assign.2.extend(ends);
        Ok(out)
    }

    /// Leases what the core's lease plan says, as SQLite's writer does.
    /// The pairs this lease may take from are locked (`FOR UPDATE`, by the
    /// walk that finds them, `Writer::window`) with their ready counts by
    /// type (`ready_types`): their counts are then
    /// the cluster's until this group commits, and another node's lease of
    /// the same pair waits for it, so a tenant's cap holds across nodes.
    /// `plan_lease` turns the counts into takes; each take reads only the
    /// rows it leases, by the typed ready index ([`LEASE_ONE_SQL`],
    /// [`LEASE_MERGED_SQL`]), so what a lease costs does not depend on how
    /// many jobs of other types wait. The takes' statements go out at once,
    /// pipelined on the one connection.
    /// One lease alone, on the group's clock (a group's compatible leases
    /// run as one, in `Writer::body`).
    pub(super) async fn lease(&mut self, req: &LeaseRequest) -> Result<Vec<LeasedJob>, StoreError> {
        self.leases += 1;
        let req = LeaseRequest {
            now: self.now_of(req.now),
            ..req.clone()
        };
        self.lease_one(&req).await
    }

    /// One lease whose `now` is on the group's clock already.
    pub(super) async fn lease_one(
        &mut self,
        req: &LeaseRequest,
    ) -> Result<Vec<LeasedJob>, StoreError> {
        let taken = self.lease_handed(req, &[]).await?;
        Ok(taken.into_iter().map(|(j, _)| j).collect())
    }

    /// [`Writer::lease_one`] for the requests `hands` (none: all of it for
    /// `req`'s worker): each job with the worker it was written with, and
    /// the lease end it was written with as its `lease_expires_at`.
    async fn lease_handed(
        &mut self,
        req: &LeaseRequest,
        hands: &[Hand<'_>],
    ) -> Result<Vec<(LeasedJob, String)>, StoreError> {
        let mut out: Vec<(LeasedJob, String)> = Vec::new();
        if req.max_jobs == 0 || req.types.as_ref().is_some_and(Vec::is_empty) {
            // Nothing could be taken: no rows to lock.
            return Ok(out);
        }
        let lane_ok = |lane: &str| {
            req.lanes
                .as_ref()
                .is_none_or(|ls| ls.iter().any(|l| l.as_str() == lane))
                && !req.exclude_lanes.iter().any(|l| l.as_str() == lane)
        };
        let filter = LeaseFilter {
            types: req.types.as_deref(),
            excluded: &req.exclude_types,
            probes: &req.type_limits,
        };
        // Only the pairs the plan needs (the core's `LaneWindow`, walked
        // from each lane's round position), locked with their counts as
        // they are walked: a lease costs about `max_jobs` pairs, however
        // many tenants have jobs ready.
        let wanted = self.window(req, &filter, &lane_ok).await?;
        if wanted.is_empty() {
            return Ok(out);
        }
        // The walk locked the pairs it read; the rest (this group's new
        // pairs, lane reserves' busy ones) are locked here with their counts.
        let to_lock: Vec<(String, String)> = wanted
            .iter()
            .filter(|k| !self.group.base_types.contains_key(*k))
            .cloned()
            .collect();
        if !to_lock.is_empty() {
            self.lock_pairs(&to_lock).await?;
        }
        let counted: Vec<(Lane, TenantId, u32, BTreeMap<JobType, u32>)> = wanted
            .iter()
            .filter(|(lane, _)| lane_ok(lane))
            .filter_map(|(lane, tenant)| {
                let (inflight, by_type) = self.pair_now(lane, tenant);
                (!by_type.is_empty() || inflight > 0).then(|| {
                    (
                        Lane::new(lane.as_str()),
                        TenantId::new(tenant.as_str()),
                        inflight,
                        by_type,
                    )
                })
            })
            .collect();
        // The takes, owned, with the types each reads (any type: those the
        // pair has ready).
        let takes: Vec<(usize, Vec<String>, u32)> = {
            let pairs: Vec<PairCounts<'_>> = counted
                .iter()
                .map(|(lane, tenant, inflight, ready)| PairCounts {
                    lane,
                    tenant,
                    inflight: *inflight,
                    ready,
                })
                .collect();
            plan_lease(&mut self.scheduler, &pairs, &filter, req.max_jobs)
                .into_iter()
                .map(|t| {
                    let types = match t.among {
                        Among::AnyType => counted[t.pair]
                            .3
                            .keys()
                            .map(|ty| ty.as_str().to_owned())
                            .collect(),
                        Among::Types(ts) => ts.iter().map(|ty| ty.as_str().to_owned()).collect(),
                    };
                    (t.pair, types, t.count)
                })
                .collect()
        };
        if takes.is_empty() {
            return Ok(out);
        }
        let one = self.stmt(LEASE_ONE_SQL).await?;
        let merged = self.stmt(LEASE_MERGED_SQL).await?;
        let expires = req.now.saturating_add(req.lease);
        let (exp, now, worker) = (ms(expires), ms(req.now), req.worker_id.as_str());
        let counts: Vec<u32> = takes.iter().map(|(_, _, n)| *n).collect();
        // Per take: lane, tenant, types, count, and its jobs' workers and
        // lease ends (none: `worker` and `exp`).
        let args: Vec<(&str, &str, Vec<&str>, i64, Handed<'_>)> = takes
            .iter()
            .zip(handed(&counts, hands))
            .map(|((pair, types, count), hand)| {
                (
                    counted[*pair].0.as_str(),
                    counted[*pair].1.as_str(),
                    types.iter().map(String::as_str).collect(),
                    i64::from(*count),
                    hand,
                )
            })
            .collect();
        // Two or more takes of one type each go as one statement
        // (`LEASE_TAKES_SQL`), the others one statement each. No two takes
        // read the same (lane, tenant, type) (`plan_lease`'s guarantee):
        // within one statement the second would find the first's jobs,
        // locked by its own transaction, again.
        let singles: Vec<usize> = (0..args.len()).filter(|&i| args[i].2.len() == 1).collect();
        let together: &[usize] = if singles.len() >= 2 { &singles } else { &[] };
        let mut in_together = vec![false; args.len()];
        for &i in together {
            in_together[i] = true;
        }
        let mut cols = TakeColumns::default();
        for &i in together {
            let (lane, tenant, types, n, (workers, ends)) = &args[i];
            cols.push(lane, tenant, types[0], *n, workers, ends);
        }
        let takes_st = self.stmt(LEASE_TAKES_SQL).await?;
        let calls: Vec<(usize, &Statement, [&(dyn ToSql + Sync); 9])> = args
            .iter()
            .enumerate()
            .filter(|(i, _)| !in_together[*i])
            .map(
                |(i, (lane, tenant, types, n, (workers, ends)))| -> (usize, &Statement, [&(dyn ToSql + Sync); 9]) {
                    match types.as_slice() {
                        [one_type] => (
                            i,
                            &one,
                            [lane, tenant, one_type, n, &exp, &now, &worker, workers, ends],
                        ),
                        _ => (
                            i,
                            &merged,
                            [lane, tenant, types, n, &exp, &now, &worker, workers, ends],
                        ),
                    }
                },
            )
            .collect();
        let together_params: [&(dyn ToSql + Sync); 10] = [
            &cols.lanes,
            &cols.tenants,
            &cols.types,
            &cols.counts,
            &exp,
            &now,
            &worker,
            &cols.workers,
            &cols.ends,
            &cols.bases,
        ];
        let client = &self.client;
        let (results, together_rows) = futures_util::join!(
            futures_util::future::join_all(
                calls
                    .iter()
                    .map(|(_, st, p)| client.query(*st, p.as_slice())),
            ),
            async {
                if together.is_empty() {
                    return Ok(Vec::new());
                }
                client.query(&takes_st, &together_params).await
            }
        );
        // Each take's rows, in the takes' order.
        let mut rows_of: Vec<Vec<Row>> = takes.iter().map(|_| Vec::new()).collect();
        for ((i, _, _), rows) in calls.iter().zip(results) {
            rows_of[*i] = pg(rows)?;
        }
        for r in pg(together_rows)? {
            let k = usize::try_from(r.get::<_, i64>(12) - 1)
                .ok()
                .and_then(|k| together.get(k))
                .ok_or_else(|| corrupt("a take's row named no take"))?;
            rows_of[*k].push(r);
        }
        drop(calls);
        for ((pair, _, count), rows) in takes.iter().zip(rows_of) {
            let (lane, tenant) = (&counted[*pair].0, &counted[*pair].1);
            let got = self.take_leased(&rows, lane, tenant, &mut out);
            if got < *count {
                // A job of the take was locked by another transaction (a
                // cancel), or the counts are off: this lease is short.
                tracing::debug!(%lane, %tenant, planned = count, got, "a lease take came up short");
            }
        }
        Ok(out)
    }

    /// Locks the pairs `keys` (`FOR UPDATE`, in key order) and keeps their
    /// counts as the group's base, `COUNTS_LOCK` first in the same round
    /// trip unless the group holds it. A pair `pairs` has no row for (made
    /// ready by this group only) is none of another transaction's to see:
    /// its counts are this group's.
    async fn lock_pairs(&mut self, keys: &[(String, String)]) -> Result<(), StoreError> {
        let (lanes, tenants): (Vec<&str>, Vec<&str>) =
            keys.iter().map(|(l, t)| (l.as_str(), t.as_str())).unzip();
        let lock_st = self.stmt(LOCK_COUNTS_SQL).await?;
        let pairs_st = self
            .stmt(
                "SELECT p.lane, p.tenant, p.ready, p.inflight, t.type, t.ready FROM pairs p
                 LEFT JOIN ready_types t ON t.lane = p.lane AND t.tenant = p.tenant AND t.ready > 0
                 WHERE (p.lane, p.tenant) IN (SELECT * FROM unnest($1::text[], $2::text[]))
                 ORDER BY p.lane, p.tenant FOR UPDATE OF p",
            )
            .await?;
        let counts_lock = self.counts_lock;
        let lock_params: [&(dyn ToSql + Sync); 1] = [&counts_lock];
        let pairs_params: [&(dyn ToSql + Sync); 2] = [&lanes, &tenants];
        let locked = self.group.counts_locked;
        let (lock, rows) = futures_util::join!(
            async {
                if locked {
                    return Ok(0);
                }
                self.client.execute(&lock_st, &lock_params).await
            },
            self.client.query(&pairs_st, &pairs_params)
        );
        pg(lock)?;
        self.group.counts_locked = true;
        let rows = pg(rows)?;
        let mut found: HashSet<(String, String)> = HashSet::new();
        for r in rows {
            let key: (String, String) = (r.get(0), r.get(1));
            if found.insert(key.clone()) {
                self.group.base.insert(key.clone(), (r.get(2), r.get(3)));
                self.group.base_types.insert(key.clone(), BTreeMap::new());
            }
            if let Some(t) = r.get::<_, Option<String>>(4) {
                let types = self.group.base_types.get_mut(&key).expect("inserted above");
                types.insert(JobType::new(t), r.get(5));
            }
        }
        for key in keys {
            if !found.contains(key) {
                self.group.base.insert(key.clone(), (0, 0));
                self.group.base_types.insert(key.clone(), BTreeMap::new());
            }
        }
        Ok(())
    }

    pub(super) async fn heartbeat(
        &mut self,
        &id: &JobId,
        &token: &LeaseToken,
        &expires_at: &Timestamp,
        &now: &Timestamp,
    ) -> Result<Result<crate::Heartbeat, ItemError>, StoreError> {
        let until = self.rebase(expires_at, now);
        let now = self.now_of(now);
        let rows = self
            .query(
                "UPDATE jobs SET lease_expires_at = $2
                 WHERE id = $1 AND state = 'leased' AND lease_token = $3 AND lease_expires_at > $4
                 RETURNING cancel_requested",
                &[&(id.0 as i64), &ms(until), &(token.0 as i64), &ms(now)],
            )
            .await?;
        if let Some(r) = rows.first() {
            return Ok(Ok(crate::Heartbeat {
                lease_expires_at: until,
                cancel_requested: r.get(0),
            }));
        }
        let exists = self
            .query("SELECT 1 FROM jobs WHERE id = $1", &[&(id.0 as i64)])
            .await?;
        Ok(Err(if exists.is_empty() {
            ItemError::NotFound
        } else {
            ItemError::LeaseLost
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::{Hand, handed};

    fn hands<'a>(asked: &[(&'a str, u32)]) -> Vec<Hand<'a>> {
        asked
            .iter()
            .enumerate()
            .map(|(i, &(worker, max_jobs))| Hand {
                worker,
                end: 1000 + i as i64,
                max_jobs,
            })
            .collect()
    }

    /// The turns `round_robin` makes: the first job of each take, then the
    /// second of each, handed to the requests in order.
    #[test]
    fn each_takes_jobs_go_to_the_requests_the_turns_give_them() {
        let got = handed(&[2, 1, 3], &hands(&[("a", 1), ("b", 2), ("c", 3)]));
        // Turns: t0 t1 t2 | t0 t2 | t2 -> a b b | c c | c
        assert_eq!(got[0], (vec!["a", "c"], vec![1000, 1002]));
        assert_eq!(got[1], (vec!["b"], vec![1001]));
        assert_eq!(got[2], (vec!["b", "c", "c"], vec![1001, 1002, 1002]));
    }

    /// Takes that ask more than the requests do (they never should) get
    /// nothing past the requests: their jobs keep the statement's defaults.
    #[test]
    fn jobs_past_the_requests_keep_the_defaults() {
        let got = handed(&[2, 2], &hands(&[("a", 1), ("b", 1)]));
        assert_eq!(got[0], (vec!["a"], vec![1000]));
        assert_eq!(got[1], (vec!["b"], vec![1001]));
        assert!(
            handed(&[3], &[])
                .iter()
                .all(|(w, e)| w.is_empty() && e.is_empty())
        );
    }
}

/// The takes' statement as the writer runs it.
#[cfg(test)]
mod plan_tests {
    use super::super::plans::{answered, plan_counts, plan_text, scratch};
    use super::LEASE_TAKES_SQL;

    /// Several takes in one statement: each take's oldest jobs of its
    /// pair and type, each job handed as its slot says (a null slot: the
    /// statement's defaults), each row naming its take. PostgreSQL keeps
    /// its generic plan after five custom ones (its arrays are read
    /// through sub-selects), and that plan finds the leased jobs by id,
    /// however many jobs wait.
    #[tokio::test]
    async fn the_takes_lease_each_pairs_oldest_on_one_generic_plan() {
        // 30,000 queued jobs over 8 tenants (job g in tenant g % 8, its
        // run_at g), and no statistics yet.
        let Some((opts, c)) = scratch(
            "the takes' statement",
            "INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, created_at, payload)
             SELECT g, 'bench', 't' || (g % 8), 'bench', 'queued', g, 0, g, '\\x00'
             FROM generate_series(1, 30000) g",
        )
        .await
        else {
            return;
        };
        let take = |tenants: &str, counts: &str, workers: &str, ends: &str, bases: &str| {
            let n = tenants.split(',').count();
            let lanes = vec!["bench"; n].join(",");
            let types = vec!["bench"; n].join(",");
            format!(
                "EXECUTE takes ('{{{lanes}}}', '{{{tenants}}}', '{{{types}}}', '{{{counts}}}',
                                 100, 5, 'w0', '{{{workers}}}', '{{{ends}}}', '{{{bases}}}');"
            )
        };
        let mut script = format!(
            "BEGIN; PREPARE takes (text[], text[], text[], int8[], int8, int8, text, text[],
                                   int8[], int8[]) AS {LEASE_TAKES_SQL};"
        );
        // The first: t1 one job, t2 two, t3 one; hands for the first three
        // slots but t2's second.
        script.push_str(&take(
            "t1,t2,t3",
            "1,2,1",
            "a,b,NULL,d",
            "1,2,NULL,4",
            "0,1,3",
        ));
        for (tenants, counts) in [
            ("t4", "1"),
            ("t5,t6", "1,1"),
            ("t7,t0,t4,t5", "1,1,1,1"),
            ("t6", "3"),
            ("t1,t2", "1,1"),
            ("t3,t4,t5", "2,1,1"),
        ] {
            let slots: i64 = counts.split(',').map(|n| n.parse::<i64>().unwrap()).sum();
            let nulls = vec!["NULL"; slots as usize].join(",");
            let mut base = 0;
            let bases: Vec<String> = counts
                .split(',')
                .map(|n| {
                    let b = base;
                    base += n.parse::<i64>().unwrap();
                    b.to_string()
                })
                .collect();
            script.push_str(&take(tenants, counts, &nulls, &nulls, &bases.join(",")));
        }
        script.push_str(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements
               WHERE name = 'takes';
             EXPLAIN EXECUTE takes ('{bench}', '{t7}', '{bench}', '{1}', 100, 5, 'w0', '{NULL}',
                                    '{NULL}', '{0}');
             ROLLBACK",
        );
        let all = answered(&opts, &c, &script).await;
        // The first execution's rows: (id, worker, lease end, take).
        let mut first: Vec<(String, String, String, String)> = all[..4]
            .iter()
            .map(|r| {
                let col = |i: usize| r[i].clone().expect("a value");
                (col(0), col(10), col(11), col(12))
            })
            .collect();
        first.sort();
        let want = |id: &str, w: &str, end: &str, k: &str| {
            (id.to_owned(), w.to_owned(), end.to_owned(), k.to_owned())
        };
        assert_eq!(
            first,
            vec![
                want("1", "a", "1", "1"),
                want("10", "w0", "100", "2"),
                want("2", "b", "2", "2"),
                want("3", "d", "4", "3"),
            ],
            "each pair's oldest, handed by slot"
        );
        // Seven executions: five custom plans, then the generic one kept.
        assert_eq!(plan_counts(&all), (2, 5), "generic, custom: {all:?}");
        let plan = plan_text(&all);
        assert!(plan.contains("jobs_pkey"), "the jobs found by id: {plan}");
        assert!(
            !plan.contains("Seq Scan on jobs"),
            "no scan of the queue: {plan}"
        );
    }
}
