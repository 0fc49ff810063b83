//! Counters: the group's count changes per (lane, tenant) and per type,
//! written once before its commit, the counts a group reads, and the
//! store's stats.

use super::*;

/// The count changes per (lane, tenant) of a group, as columns.
#[derive(Default)]
pub(super) struct PairColumns {
    pub(super) lanes: Vec<String>,
    pub(super) tenants: Vec<String>,
    pub(super) ready: Vec<i64>,
    pub(super) inflight: Vec<i64>,
    pub(super) scheduled: Vec<i64>,
    pub(super) succeeded: Vec<i64>,
    pub(super) cancelled: Vec<i64>,
}

/// Ready count changes per (lane, tenant, type), as columns.
pub(super) type TypeColumns = (Vec<String>, Vec<String>, Vec<String>, Vec<i64>);

/// A group's count changes: per pair, and ready per (lane, tenant, type);
/// either may be empty.
pub(super) struct CountChanges {
    pub(super) pairs: PairColumns,
    pub(super) types: TypeColumns,
}

impl CountChanges {
    /// Whether the group changed no count at all.
    pub(super) fn is_empty(&self) -> bool {
        self.pairs.lanes.is_empty() && self.types.0.is_empty()
    }
}

/// A group's count changes and its notification, in one statement (one
/// answer, where three statements cost three): the changes per (lane,
/// tenant) `$1`..`$7` added to `pairs`, the ready changes per (lane,
/// tenant, type) `$8`..`$11` added to `ready_types` (either may be empty),
/// and `pg_notify($12, $13)` unless `$12` is null. The two upserts run as
/// one statement's parts, in no set order: the group holds
/// [`COUNTS_LOCK`] by then, so no other group locks these rows meanwhile,
/// in any order.
pub(super) const COUNTS_SQL: &str = "WITH pair_changes AS (
       INSERT INTO pairs AS p (lane, tenant, ready, inflight, scheduled, succeeded, cancelled)
       SELECT * FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[],
                            $6::int8[], $7::int8[])
       ON CONFLICT (lane, tenant) DO UPDATE SET
         ready = p.ready + excluded.ready, inflight = p.inflight + excluded.inflight,
         scheduled = p.scheduled + excluded.scheduled, succeeded = p.succeeded + excluded.succeeded,
         cancelled = p.cancelled + excluded.cancelled),
     type_changes AS (
       INSERT INTO ready_types AS r (lane, tenant, type, ready)
       SELECT * FROM unnest($8::text[], $9::text[], $10::text[], $11::int8[])
       ON CONFLICT (lane, tenant, type) DO UPDATE SET ready = r.ready + excluded.ready)
     SELECT pg_notify($12, $13) WHERE $12::text IS NOT NULL";

/// The (ready, inflight) counts of the pairs `($1[i], $2[i])` that have a row.
pub(super) const PAIRS_COUNTS_SQL: &str =
    "SELECT p.lane, p.tenant, p.ready, p.inflight FROM pairs p
     JOIN unnest($1::text[], $2::text[]) AS k(lane, tenant)
       ON p.lane = k.lane AND p.tenant = k.tenant";

impl Writer {
    pub(super) fn delta(&mut self, lane: &str, tenant: &str) -> &mut Delta {
        self.group
            .deltas
            .entry((lane.to_owned(), tenant.to_owned()))
            .or_default()
    }

    /// `n` more (or fewer) jobs of `job_type` ready in (lane, tenant):
    /// the pair's count and the type's.
    pub(super) fn add_ready(&mut self, lane: &str, tenant: &str, job_type: &str, n: i64) {
        self.delta(lane, tenant).ready += n;
        *self
            .group
            .typed
            .entry((lane.to_owned(), tenant.to_owned(), job_type.to_owned()))
            .or_default() += n;
    }

    /// The group's count changes, in key order (two nodes' groups lock
    /// the rows in the same order: no deadlock between them); written by
    /// [`COUNTS_SQL`] under [`COUNTS_LOCK`].
    pub(super) fn count_changes(&mut self) -> CountChanges {
        let deltas = std::mem::take(&mut self.group.deltas);
        let typed = std::mem::take(&mut self.group.typed);
        // Pairs whose types' counts change lock their row even when their
        // own counts add up to no change.
        let retyped: HashSet<(&str, &str)> = typed
            .iter()
            .filter(|(_, n)| **n != 0)
            .map(|((l, t, _), _)| (l.as_str(), t.as_str()))
            .collect();
        let mut c = PairColumns::default();
        for ((l, t), d) in deltas {
            if d.ready == 0
                && d.inflight == 0
                && d.scheduled == 0
                && d.succeeded == 0
                && d.cancelled == 0
                && !retyped.contains(&(l.as_str(), t.as_str()))
            {
                continue;
            }
            c.cancelled.push(d.cancelled);
            c.lanes.push(l);
            c.tenants.push(t);
            c.ready.push(d.ready);
            c.inflight.push(d.inflight);
            c.scheduled.push(d.scheduled);
            c.succeeded.push(d.succeeded);
        }
        let (mut lanes, mut tenants, mut types, mut ready) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for ((l, t, ty), n) in typed {
            if n != 0 {
                lanes.push(l);
                tenants.push(t);
                types.push(ty);
                ready.push(n);
            }
        }
        CountChanges {
            pairs: c,
            types: (lanes, tenants, types, ready),
        }
    }

    /// Reads the counts of the pairs `keys` not read yet in this group, in
    /// one statement (what [`Self::counts`] would read one by one).
    pub(super) async fn prefetch_counts(
        &mut self,
        keys: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(), StoreError> {
        let missing: BTreeSet<(String, String)> = keys
            .into_iter()
            .filter(|k| !self.group.base.contains_key(k))
            .collect();
        match missing.len() {
            0 => return Ok(()),
            1 => {
                let (l, t) = missing.into_iter().next().expect("one");
                self.counts(&l, &t).await?;
                return Ok(());
            }
            _ => {}
        }
        let (lanes, tenants): (Vec<&str>, Vec<&str>) = missing
            .iter()
            .map(|(l, t)| (l.as_str(), t.as_str()))
            .unzip();
        let rows = self.query(PAIRS_COUNTS_SQL, &[&lanes, &tenants]).await?;
        self.keep_counts(missing.iter().map(|(l, t)| (l.as_str(), t.as_str())), &rows);
        Ok(())
    }

    /// Keeps the counts [`PAIRS_COUNTS_SQL`] read for the pairs `asked` as
    /// the group's base; a pair without a row counts none.
    pub(super) fn keep_counts<'k>(
        &mut self,
        asked: impl IntoIterator<Item = (&'k str, &'k str)>,
        rows: &[Row],
    ) {
        let mut found: HashMap<(String, String), (i64, i64)> = rows
            .iter()
            .map(|r| ((r.get(0), r.get(1)), (r.get(2), r.get(3))))
            .collect();
        for (l, t) in asked {
            let k = (l.to_owned(), t.to_owned());
            let b = found.remove(&k).unwrap_or((0, 0));
            self.group.base.entry(k).or_insert(b);
        }
    }

    /// The (ready, inflight) of a pair now, this group's changes included.
    pub(super) async fn counts(
        &mut self,
        lane: &str,
        tenant: &str,
    ) -> Result<(i64, i64), StoreError> {
        let key = (lane.to_owned(), tenant.to_owned());
        let base = match self.group.base.get(&key) {
            Some(b) => *b,
            None => {
                let rows = self
                    .query(
                        "SELECT ready, inflight FROM pairs WHERE lane = $1 AND tenant = $2",
                        &[&lane, &tenant],
                    )
                    .await?;
                let b = rows.first().map_or((0, 0), |r| (r.get(0), r.get(1)));
                self.group.base.insert(key.clone(), b);
                b
            }
        };
        let d = self.group.deltas.get(&key).copied().unwrap_or_default();
        Ok((base.0 + d.ready, base.1 + d.inflight))
    }

    pub(super) async fn stats(&mut self) -> Result<StoreStats, StoreError> {
        let rows = self
            .query(
                "SELECT lane, sum(ready)::int8, sum(scheduled)::int8, sum(inflight)::int8, sum(succeeded)::int8,
                   sum(cancelled)::int8
                 FROM pairs GROUP BY lane ORDER BY lane",
                &[],
            )
            .await?;
        let mut lanes = Vec::new();
        let (mut succeeded, mut cancelled) = (0u64, 0u64);
        for r in rows {
            cancelled += r.get::<_, i64>(5).max(0) as u64;
            let c = LaneCounts {
                queued: r.get::<_, i64>(1).max(0) as u64,
                scheduled: r.get::<_, i64>(2).max(0) as u64,
                leased: r.get::<_, i64>(3).max(0) as u64,
            };
            succeeded += r.get::<_, i64>(4).max(0) as u64;
            if c != LaneCounts::default() {
                lanes.push((Lane::new(r.get::<_, String>(0)), c));
            }
        }
        // One index probe (`jobs_ready_type`) per (lane, tenant, type) with
        // jobs ready.
        let oldest = self
            .query(
                "SELECT r.lane, min(x.run_at)::int8 FROM ready_types r
                 CROSS JOIN LATERAL (
                   SELECT run_at FROM jobs j
                   WHERE j.lane = r.lane AND j.tenant = r.tenant AND j.type = r.type
                     AND j.state = 'queued'
                   ORDER BY run_at, id LIMIT 1) x
                 WHERE r.ready > 0 GROUP BY r.lane ORDER BY r.lane",
                &[],
            )
            .await?;
        let oldest_ready: Vec<(Lane, Timestamp)> = oldest
            .iter()
            .map(|r| {
                (
                    Lane::new(r.get::<_, String>(0)),
                    Timestamp::from_millis(r.get(1)),
                )
            })
            .collect();
        let rows = self
            .query(
                "SELECT type, reason, count(*) FROM dead_letters WHERE archived_at IS NULL GROUP BY type, reason",
                &[],
            )
            .await?;
        let mut dead_letters = Vec::new();
        for r in rows {
            let reason: String = r.get(1);
            dead_letters.push((
                r.get::<_, Option<String>>(0),
                reason.parse().map_err(corrupt)?,
                r.get::<_, i64>(2) as u64,
            ));
        }
        let held_retries = self
            .query(
                "SELECT source, count(*) FROM source_held_retries GROUP BY source ORDER BY source",
                &[],
            )
            .await?
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1).max(0) as u64))
            .collect();
        Ok(StoreStats {
            lanes,
            dead_letters,
            held_retries,
            succeeded,
            cancelled,
            oldest_ready,
            backend: "postgres",
            group_commit: Some(GroupCommitStats {
                // Groups committed before this one, as SQLite counts.
                commits: self.commits,
                commands: self.commands,
                // The flusher's commits, each covering the groups
                // committed before it.
                syncs: self.flusher.flushes().0,
                sync_micros: self.flusher.flushes().1,
                leases: self.leases,
                // Not counted: PostgreSQL's plans show a lease's reads.
                lease_steps: 0,
                lease_pairs: self.lease_pairs,
                conflicts: self.conflicts,
            }),
        })
    }
}

/// A sampling's rows, in one statement, in key order (so two nodes
/// writing the same minute lock its rows in one order); a count already
/// there is never lowered.
const SIGNALS_UPSERT_SQL: &str = "INSERT INTO signal_samples AS s (minute, signal, axis, name, value)
     SELECT * FROM unnest($1::int8[], $2::text[], $3::text[], $4::text[], $5::int8[])
     ORDER BY 1, 2, 3, 4
     ON CONFLICT (minute, signal, axis, name) DO UPDATE SET value = greatest(s.value, excluded.value)";

impl Writer {
    /// Writes one sampling of the charts' signals (as SQLite's
    /// `write_signals`): `minute`'s gauges replaced, counts raised, the
    /// minute marked sampled, minutes before `keep_after` deleted.
    pub(super) async fn write_signals(
        &mut self,
        &minute: &Timestamp,
        rows: &[lazaret_core::series::Sample],
        &keep_after: &Timestamp,
    ) -> Result<u64, StoreError> {
        let m = minute.as_millis();
        self.execute(crate::signals::DELETE_GAUGES_PG, &[&m])
            .await?;
        let mut minutes = vec![m];
        let mut signals = vec![lazaret_core::series::SAMPLED.to_owned()];
        let mut axes = vec![String::new()];
        let mut names = vec![String::new()];
        let mut values = vec![1i64];
        for s in rows {
            minutes.push(s.minute.as_millis());
            signals.push(s.signal.as_str().to_owned());
            axes.push(s.by.as_str().to_owned());
            names.push(s.name.clone());
            values.push(i64::try_from(s.value).unwrap_or(i64::MAX));
        }
        let n = self
            .execute(
                SIGNALS_UPSERT_SQL,
                &[&minutes, &signals, &axes, &names, &values],
            )
            .await?;
        self.execute(
            "DELETE FROM signal_samples WHERE minute < $1",
            &[&keep_after.as_millis()],
        )
        .await?;
        Ok(n)
    }
}
