//! What a lease reads before the core's `plan_lease`: the lanes and
//! types with ready jobs, the window of (lane, tenant) pairs to plan from,
//! walked, counted and locked in one statement per batch, and the leased
//! rows turned into answers.

use super::*;

/// Lanes with jobs ready, by a skip scan of `pairs_walk`: one index probe
/// per lane, however many tenants wait in it.
pub(super) const READY_LANES_SQL: &str = "WITH RECURSIVE l(lane) AS (
        (SELECT lane FROM pairs WHERE ready > 0 ORDER BY lane LIMIT 1)
        UNION ALL
        SELECT (SELECT p.lane FROM pairs p WHERE p.ready > 0 AND p.lane > l.lane ORDER BY p.lane LIMIT 1)
        FROM l WHERE l.lane IS NOT NULL)
    SELECT lane FROM l WHERE lane IS NOT NULL";

/// The types with jobs ready in lane `$1`, by a skip scan of `ready_types_walk`.
pub(super) const LANE_TYPES_SQL: &str = "WITH RECURSIVE t(type) AS (
        (SELECT type FROM ready_types WHERE lane = $1 AND ready > 0 ORDER BY type LIMIT 1)
        UNION ALL
        SELECT (SELECT r.type FROM ready_types r WHERE r.lane = $1 AND r.ready > 0 AND r.type > t.type
                ORDER BY r.type LIMIT 1)
        FROM t WHERE t.type IS NOT NULL)
    SELECT type FROM t WHERE type IS NOT NULL";

/// One batch of a lane's walk, counted and locked in one statement: the
/// next `$3` tenants with jobs ready in lane `$1` after `$2`, in byte order
/// (`COLLATE "C"`: the order of the core's round), by `pairs_walk`; then
/// their pairs and those of the tenants `$4` (this group's own, which
/// `pairs` shows only at its commit), with their ready counts by type,
/// locked (`FOR UPDATE OF p`) and marked whether the walk found them. The
/// group holds `COUNTS_LOCK` already, so no other node changes a count
/// between the walk and the lock, and the counts a lease plans from are
/// the ones it reads here.
pub(super) const WALK_PAIRS_SQL: &str = r#"WITH w AS MATERIALIZED (
        SELECT tenant FROM pairs
        WHERE lane = $1 AND ready > 0 AND tenant COLLATE "C" > $2
        ORDER BY tenant COLLATE "C" LIMIT $3)
    SELECT p.tenant, p.ready, p.inflight, t.type, t.ready, p.tenant IN (SELECT tenant FROM w)
    FROM pairs p LEFT JOIN ready_types t ON t.lane = p.lane AND t.tenant = p.tenant AND t.ready > 0
    WHERE p.lane = $1 AND (p.tenant IN (SELECT tenant FROM w) OR p.tenant = ANY($4::text[]))
    ORDER BY p.tenant FOR UPDATE OF p"#;

/// [`WALK_PAIRS_SQL`] among the tenants with jobs of the types `$5` ready,
/// by `ready_types_walk`: the first `$3` of each type, merged.
pub(super) const WALK_TYPES_SQL: &str = r#"WITH w AS MATERIALIZED (
        SELECT tenant FROM (
            SELECT DISTINCT x.tenant FROM unnest($5::text[]) AS ty(type),
            LATERAL (SELECT r.tenant FROM ready_types r
                     WHERE r.lane = $1 AND r.type = ty.type AND r.ready > 0 AND r.tenant COLLATE "C" > $2
                     ORDER BY r.tenant COLLATE "C" LIMIT $3) x) d
        ORDER BY tenant COLLATE "C" LIMIT $3)
    SELECT p.tenant, p.ready, p.inflight, t.type, t.ready, p.tenant IN (SELECT tenant FROM w)
    FROM pairs p LEFT JOIN ready_types t ON t.lane = p.lane AND t.tenant = p.tenant AND t.ready > 0
    WHERE p.lane = $1 AND (p.tenant IN (SELECT tenant FROM w) OR p.tenant = ANY($4::text[]))
    ORDER BY p.tenant FOR UPDATE OF p"#;

/// A walk batch sent ([`Writer::send_walk`]), early or not: what it asked,
/// and its rows to come.
pub(super) struct EarlyWalk {
    lane: String,
    lo: String,
    limit: i64,
    types: Option<Vec<String>>,
    /// The tenants of the group locked with the batch, walked or not.
    also: Vec<String>,
    rows: WalkRows,
}

/// A sent walk batch's answer: to come, or read into the group's base.
enum WalkRows {
    /// Its rows, once `COUNTS_LOCK` is held (an error of either).
    Sent(Early<Vec<Row>>),
    /// The tenants it walked, its pairs' counts kept ([`Writer::walked`]).
    Read(Vec<String>),
}

/// Tenants the walk reads per statement at most.
pub(super) const WALK_BATCH_MAX: u32 = 1000;

impl Writer {
    /// The (lane, tenant) pairs a lease needs, in key order: per lane that
    /// `lane_ok` lets through, its tenants with jobs ready (of the types
    /// the lease may take) in byte order from the round's position
    /// (`FairScheduler::resume_after`), wrapping once, offered to the
    /// core's `LaneWindow` until it has enough; this group's own changes
    /// counted in. With lane reserves, every pair holding leases too.
    /// Each batch of the walk locks the pairs it reads (`walk_batch`), so
    /// a lease reads, counts and locks in one round trip per batch; the
    /// lease locks what this returns and the walk did not.
    pub(super) async fn window(
        &mut self,
        req: &LeaseRequest,
        filter: &LeaseFilter<'_>,
        lane_ok: &impl Fn(&str) -> bool,
    ) -> Result<Vec<(String, String)>, StoreError> {
        let every_type =
            filter.types.is_none() && filter.excluded.is_empty() && filter.probes.is_empty();
        // A lease of one lane (a worker's usual) walks that lane: a lane
        // with nothing ready costs the walk's one read, as the lanes' would.
        let mut lanes: BTreeSet<String> = match req.lanes.as_deref() {
            Some([lane]) => BTreeSet::from([lane.as_str().to_owned()]),
            _ => self
                .query(READY_LANES_SQL, &[])
                .await?
                .iter()
                .map(|r| r.get(0))
                .collect(),
        };
        lanes.extend(
            self.group
                .deltas
                .iter()
                .filter(|(_, d)| d.ready > 0)
                .map(|((l, _), _)| l.clone()),
        );
        lanes.retain(|l| lane_ok(l));
        let batch = req.max_jobs.clamp(8, WALK_BATCH_MAX);
        let limit = i64::from(batch);
        let mut wanted: BTreeSet<(String, String)> = BTreeSet::new();
        for lane in &lanes {
            let types: Vec<String> = if every_type {
                Vec::new()
            } else {
                let mut ts: BTreeSet<String> = match filter.types {
                    Some(ts) => ts.iter().map(|t| t.as_str().to_owned()).collect(),
                    None => self
                        .query(LANE_TYPES_SQL, &[lane])
                        .await?
                        .iter()
                        .map(|r| r.get(0))
                        .collect(),
                };
                if filter.types.is_none() {
                    let from = (lane.clone(), String::new(), String::new());
                    ts.extend(
                        self.group
                            .typed
                            .range(from..)
                            .take_while(|((l, _, _), _)| l == lane)
                            .filter(|(_, n)| **n > 0)
                            .map(|((_, _, t), _)| t.clone()),
                    );
                }
                ts.into_iter()
                    .filter(|t| filter.admits(&JobType::new(t.as_str())))
                    .collect()
            };
            if !every_type && types.is_empty() {
                continue;
            }
            // This group's pairs with jobs ready, which `pairs` shows only
            // at its commit.
            let from = (lane.clone(), String::new());
            let mine: BTreeSet<String> = self
                .group
                .deltas
                .range(from..)
                .take_while(|((l, _), _)| l == lane)
                .filter(|(_, d)| d.ready > 0)
                .map(|((_, t), _)| t.clone())
                .collect();
            let after: Option<String> = self
                .scheduler
                .resume_after(&Lane::new(lane.as_str()))
                .map(str::to_owned);
            let lane_id = Lane::new(lane.as_str());
            let mut window = LaneWindow::new(filter, req.max_jobs);
            // From the round's position to the end, then from the start up
            // to the position.
            let passes: Vec<(String, Option<String>)> = match &after {
                Some(a) => vec![(a.clone(), None), (String::new(), Some(a.clone()))],
                None => vec![(String::new(), None)],
            };
            'walk: for (mut lo, hi) in passes {
                loop {
                    // This group's tenants past `lo` (up to `hi`) are
                    // locked with the batch: a few more than it needs when
                    // the batch ends before them.
                    let also: Vec<&str> = mine
                        .range::<String, _>((
                            std::ops::Bound::Excluded(&lo),
                            std::ops::Bound::Unbounded,
                        ))
                        .filter(|t| hi.as_ref().is_none_or(|h| *t <= h))
                        .map(String::as_str)
                        .collect();
                    let walked = self
                        .walk_batch(lane, &lo, limit, (!every_type).then_some(&types[..]), &also)
                        .await?;
                    let mut batch_tenants = walked;
                    let full = batch_tenants.len() as i64 == limit;
                    // The range this batch covers, this group's tenants in it merged.
                    let end: Option<String> = if full {
                        batch_tenants.last().cloned()
                    } else {
                        hi.clone()
                    };
                    let upper = match &end {
                        Some(e) => std::ops::Bound::Included(e.clone()),
                        None => std::ops::Bound::Unbounded,
                    };
                    batch_tenants.extend(
                        mine.range((std::ops::Bound::Excluded(lo.clone()), upper))
                            .cloned(),
                    );
                    batch_tenants.sort();
                    batch_tenants.dedup();
                    if let Some(h) = &hi {
                        batch_tenants.retain(|t| t <= h);
                    }
                    for tenant in &batch_tenants {
                        self.lease_pairs += 1;
                        let (inflight, ready) = self.pair_now(lane, tenant);
                        let tenant_id = TenantId::new(tenant.as_str());
                        let pair = PairCounts {
                            lane: &lane_id,
                            tenant: &tenant_id,
                            inflight,
                            ready: &ready,
                        };
                        if window.offer(&self.scheduler, &pair) {
                            wanted.insert((lane.clone(), tenant.clone()));
                        }
                        if window.is_full() {
                            break 'walk;
                        }
                    }
                    let past_hi = match (&hi, &end) {
                        (Some(h), Some(e)) => e >= h,
                        _ => false,
                    };
                    if !full || past_hi {
                        break;
                    }
                    lo = end.expect("a full batch has a last tenant");
                }
            }
        }
        if self.scheduler.config().has_reserves() {
            let busy = self
                .query("SELECT lane, tenant FROM pairs WHERE inflight > 0", &[])
                .await?;
            for r in busy {
                let (lane, tenant): (String, String) = (r.get(0), r.get(1));
                if lane_ok(&lane) {
                    self.lease_pairs += 1;
                    wanted.insert((lane, tenant));
                }
            }
            for ((lane, tenant), d) in &self.group.deltas {
                if d.inflight > 0 && lane_ok(lane) {
                    wanted.insert((lane.clone(), tenant.clone()));
                }
            }
        }
        Ok(wanted.into_iter().collect())
    }

    /// Sends the first walk batch of the group's first lease (and the
    /// leases that merge into it, as `Writer::body` runs them) with the
    /// group's first statements, `COUNTS_LOCK` before it, so the lease
    /// costs no round trip of its own for it: `walk_batch` takes its rows
    /// when it asks the same batch. Only a lease of one lane whose types
    /// are known without reading (every type, or the types it names) is
    /// walked early; the walk's own tenants of the group are its enqueues'
    /// in that lane (a tenant of the group it misses is locked later, as a
    /// new pair is). A batch the lease does not ask (ops before it changed
    /// what it walks) only locks what it read, and the lease walks again.
    pub(super) async fn send_walk_early(
        &mut self,
        ops: &[&Request],
        db_now: Option<Timestamp>,
    ) -> Result<(), StoreError> {
        let mut leases = ops.iter().filter_map(|op| match op {
            Request::Lease { req, .. } => Some(req),
            _ => None,
        });
        let Some(first) = leases.next() else {
            return Ok(());
        };
        let max_jobs = leases
            .filter(|r| leases_merge(first, r, db_now))
            .fold(first.max_jobs, |n, r| n.saturating_add(r.max_jobs));
        let Some([lane]) = first.lanes.as_deref() else {
            return Ok(());
        };
        if max_jobs == 0 || first.exclude_lanes.contains(lane) {
            return Ok(());
        }
        let filter = LeaseFilter {
            types: first.types.as_deref(),
            excluded: &first.exclude_types,
            probes: &first.type_limits,
        };
        let every_type =
            filter.types.is_none() && filter.excluded.is_empty() && filter.probes.is_empty();
        let types: Option<Vec<String>> = match filter.types {
            _ if every_type => None,
            None => return Ok(()),
            Some(ts) => {
                let ts: BTreeSet<String> = ts
                    .iter()
                    .filter(|t| filter.admits(t))
                    .map(|t| t.as_str().to_owned())
                    .collect();
                if ts.is_empty() {
                    return Ok(());
                }
                Some(ts.into_iter().collect())
            }
        };
        let also: Vec<String> = ops
            .iter()
            .flat_map(|op| match op {
                Request::Enqueue { jobs, .. } => jobs.iter(),
                _ => [].iter(),
            })
            .filter(|j| j.lane == *lane)
            .map(|j| j.tenant.as_str().to_owned())
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let lo = self
            .scheduler
            .resume_after(lane)
            .map(str::to_owned)
            .unwrap_or_default();
        let limit = i64::from(max_jobs.clamp(8, WALK_BATCH_MAX));
        let walk = self
            .send_walk(lane.as_str(), &lo, limit, types, also)
            .await?;
        self.group.early_walk = Some(walk);
        Ok(())
    }

    /// One batch of a lane's walk ([`WALK_PAIRS_SQL`], or
    /// [`WALK_TYPES_SQL`] when the lease names `types`): the tenants walked,
    /// in byte order. Their pairs and those of `also` are locked, their
    /// counts kept as the group's base (`Group::base`, `Group::base_types`);
    /// `COUNTS_LOCK` goes first in the same round trip unless the group
    /// holds it.
    pub(super) async fn walk_batch(
        &mut self,
        lane: &str,
        lo: &str,
        limit: i64,
        types: Option<&[String]>,
        also: &[&str],
    ) -> Result<Vec<String>, StoreError> {
        if let Some(early) = self.group.early_walk.take() {
            let same = early.lane == lane
                && early.lo == lo
                && early.limit == limit
                && early.types.as_deref() == types;
            let walked = self.walk_read(&early.lane, early.rows).await?;
            if same {
                return Ok(walked);
            }
        }
        let types = types.map(<[String]>::to_vec);
        let also = also.iter().map(|t| (*t).to_owned()).collect();
        let walk = self.send_walk(lane, lo, limit, types, also).await?;
        self.walk_read(lane, walk.rows).await
    }

    /// Sends one walk batch ([`WALK_PAIRS_SQL`], or [`WALK_TYPES_SQL`] with
    /// `types`), `COUNTS_LOCK` before it unless the group holds it, without
    /// waiting for either.
    async fn send_walk(
        &mut self,
        lane: &str,
        lo: &str,
        limit: i64,
        types: Option<Vec<String>>,
        also: Vec<String>,
    ) -> Result<EarlyWalk, StoreError> {
        let lock_st = self.stmt(LOCK_COUNTS_SQL).await?;
        let walk_st = match types {
            None => self.stmt(WALK_PAIRS_SQL).await?,
            Some(_) => self.stmt(WALK_TYPES_SQL).await?,
        };
        let client = Arc::clone(&self.client);
        let (key, locked) = (self.counts_lock, self.group.counts_locked);
        let (l, from, ts, with) = (lane.to_owned(), lo.to_owned(), types.clone(), also.clone());
        // One task takes both answers; the first poll sends both, the lock first.
        let rows = send_early(Box::pin(async move {
            let lock = async {
                if locked {
                    return Ok(0);
                }
                client.execute(&lock_st, &[&key]).await
            };
            let walk = async {
                match &ts {
                    None => client.query(&walk_st, &[&l, &from, &limit, &with]).await,
                    Some(ts) => {
                        client
                            .query(&walk_st, &[&l, &from, &limit, &with, ts])
                            .await
                    }
                }
            };
            let (lock, rows) = futures_util::join!(lock, walk);
            lock?;
            rows
        }))
        .await;
        Ok(EarlyWalk {
            lane: lane.to_owned(),
            lo: lo.to_owned(),
            limit,
            types,
            also,
            rows: WalkRows::Sent(rows),
        })
    }

    /// The pairs among `keys` whose counts the group's early walk reads:
    /// its lane's, of the tenants it locks (`EarlyWalk::also`, the group's
    /// enqueues' in that lane), which then need no read of their own.
    pub(super) fn walked_early<'k>(&self, keys: &[(&'k str, &'k str)]) -> Vec<(&'k str, &'k str)> {
        let Some(walk) = &self.group.early_walk else {
            return Vec::new();
        };
        keys.iter()
            .copied()
            .filter(|(l, t)| *l == walk.lane && walk.also.iter().any(|a| a == t))
            .collect()
    }

    /// Keeps the counts of the pairs `keys` (from [`Writer::walked_early`])
    /// as the group's base: the early walk's rows are read now (into the
    /// base, as the lease that asks its batch would read them), and a pair
    /// without a row counts none. The walk went out before the statements
    /// the caller waits on, so its answer is in by then.
    pub(super) async fn keep_walked_counts(
        &mut self,
        keys: &[(&str, &str)],
    ) -> Result<(), StoreError> {
        let Some(mut walk) = self.group.early_walk.take().filter(|_| !keys.is_empty()) else {
            return Ok(());
        };
        let rows = std::mem::replace(&mut walk.rows, WalkRows::Read(Vec::new()));
        walk.rows = WalkRows::Read(self.walk_read(&walk.lane, rows).await?);
        self.group.early_walk = Some(walk);
        for &(lane, tenant) in keys {
            self.group
                .base
                .entry((lane.to_owned(), tenant.to_owned()))
                .or_insert((0, 0));
        }
        Ok(())
    }

    /// The tenants a sent walk batch walked, its rows read into the
    /// group's base once ([`Writer::walked`]); the group holds
    /// `COUNTS_LOCK` then.
    async fn walk_read(&mut self, lane: &str, rows: WalkRows) -> Result<Vec<String>, StoreError> {
        match rows {
            WalkRows::Read(walked) => Ok(walked),
            WalkRows::Sent(rows) => {
                let rows = rows.await?;
                self.group.counts_locked = true;
                Ok(self.walked(lane, rows))
            }
        }
    }

    /// A walk batch's rows: its tenants walked, in byte order, and its
    /// pairs' counts kept as the group's base.
    fn walked(&mut self, lane: &str, rows: Vec<Row>) -> Vec<String> {
        let mut walked: Vec<String> = Vec::new();
        let mut seen: Option<String> = None;
        for r in rows {
            let tenant: String = r.get(0);
            let key = (lane.to_owned(), tenant.clone());
            if seen.as_ref() != Some(&tenant) {
                self.group.base.insert(key.clone(), (r.get(1), r.get(2)));
                self.group.base_types.insert(key.clone(), BTreeMap::new());
                if r.get::<_, bool>(5) {
                    walked.push(tenant.clone());
                }
                seen = Some(tenant);
            }
            if let Some(t) = r.get::<_, Option<String>>(3) {
                let types = self.group.base_types.get_mut(&key).expect("inserted above");
                types.insert(JobType::new(t), r.get(4));
            }
        }
        walked.sort();
        walked
    }

    /// The counts of a (lane, tenant) pair now, this group's changes
    /// included: (in flight, ready by type), from what the group read
    /// (`Group::base`, `Group::base_types`; nothing read counts as none).
    pub(super) fn pair_now(&self, lane: &str, tenant: &str) -> (u32, BTreeMap<JobType, u32>) {
        let key = (lane.to_owned(), tenant.to_owned());
        let base = self.group.base.get(&key).copied().unwrap_or_default();
        let d = self.group.deltas.get(&key).copied().unwrap_or_default();
        let mut by_type: BTreeMap<JobType, i64> =
            self.group.base_types.get(&key).cloned().unwrap_or_default();
        let from = (key.0.clone(), key.1.clone(), String::new());
        for ((l, t, ty), n) in self.group.typed.range(from..) {
            if (l, t) != (&key.0, &key.1) {
                break;
            }
            *by_type.entry(JobType::new(ty.clone())).or_default() += n;
        }
        let ready = by_type
            .into_iter()
            .filter(|(_, n)| *n > 0)
            .map(|(t, n)| (t, count32(n)))
            .collect();
        (count32(base.1 + d.inflight), ready)
    }

    /// The jobs a lease statement returned, oldest first, into `out`, each
    /// with the worker and lease end it was written with; counted into the
    /// group's deltas, by type.
    pub(super) fn take_leased(
        &mut self,
        rows: &[Row],
        lane: &Lane,
        tenant: &TenantId,
        out: &mut Vec<(LeasedJob, String)>,
    ) -> u32 {
        let mut got: Vec<(i64, (LeasedJob, String))> = rows
            .iter()
            .map(|r| {
                (
                    r.get::<_, i64>(8),
                    (
                        LeasedJob {
                            id: JobId(r.get::<_, i64>(0) as u64),
                            job_type: JobType::new(r.get::<_, String>(1)),
                            tenant: tenant.clone(),
                            lane: lane.clone(),
                            payload: r.get(5),
                            attempt: r.get::<_, i32>(6) as u32,
                            idempotency_key: r.get(2),
                            schema_version: r.get::<_, Option<i32>>(3).map(|v| v as u32),
                            lease_token: LeaseToken(r.get::<_, i64>(7) as u64),
                            lease_expires_at: Timestamp::from_millis(r.get(11)),
                            created_at: Timestamp::from_millis(r.get(4)),
                            ready_at: Timestamp::from_millis(r.get(8)),
                            traceparent: crate::stored::stored_traceparent(r.get(9)),
                        },
                        r.get(10),
                    ),
                )
            })
            .collect();
        got.sort_by_key(|(run_at, (j, _))| (*run_at, j.id));
        let n = got.len() as u32;
        // Per type, once: a take reads one type, or a few.
        let mut by_type: Vec<(&JobType, i64)> = Vec::new();
        for (_, (j, _)) in &got {
            match by_type.iter_mut().find(|(t, _)| *t == &j.job_type) {
                Some((_, k)) => *k += 1,
                None => by_type.push((&j.job_type, 1)),
            }
        }
        for (t, k) in by_type {
            self.add_ready(lane.as_str(), tenant.as_str(), t.as_str(), -k);
        }
        self.delta(lane.as_str(), tenant.as_str()).inflight += i64::from(n);
        out.extend(got.into_iter().map(|(_, j)| j));
        n
    }
}
