//! Counters: the store's stats, and the in-memory counts rebuilt from
//! the database at start and after a rollback.

use super::*;

impl Writer {
    pub(super) fn stats(&mut self) -> Result<StoreStats, StoreError> {
        let mut lanes: HashMap<Lane, LaneCounts> = HashMap::new();
        for (lane, tenants) in self.pairs.iter() {
            let c = lanes.entry(lane.clone()).or_default();
            for p in tenants.values() {
                c.queued += u64::from(p.ready);
                c.leased += u64::from(p.inflight);
            }
        }
        for (lane, n) in &self.scheduled {
            lanes.entry(lane.clone()).or_default().scheduled += n;
        }
        let mut lanes: Vec<(Lane, LaneCounts)> = lanes.into_iter().collect();
        lanes.sort_by(|a, b| a.0.cmp(&b.0));
        // One index probe (`jobs_ready_type`) per (lane, tenant, type) with
        // jobs ready.
        let mut oldest: HashMap<Lane, i64> = HashMap::new();
        {
            let mut probe = db(self.conn.prepare_cached(
                "SELECT run_at FROM jobs INDEXED BY jobs_ready_type
                 WHERE lane = ?1 AND tenant = ?2 AND type = ?3 AND state = 'queued'
                 ORDER BY run_at, id LIMIT 1",
            ))?;
            for (lane, tenants) in self.pairs.iter() {
                for ((tenant, job_type), _) in tenants.iter().flat_map(|(tenant, p)| {
                    p.by_type
                        .iter()
                        .filter(|(_, n)| **n > 0)
                        .map(move |(t, n)| ((tenant, t), n))
                }) {
                    let at: Option<i64> = db(probe
                        .query_row(
                            params![lane.as_str(), tenant.as_str(), job_type.as_str()],
                            |r| r.get(0),
                        )
                        .optional())?;
                    if let Some(at) = at {
                        let e = oldest.entry(lane.clone()).or_insert(at);
                        *e = (*e).min(at);
                    }
                }
            }
        }
        let mut oldest_ready: Vec<(Lane, Timestamp)> = oldest
            .into_iter()
            .map(|(l, at)| (l, Timestamp::from_millis(at)))
            .collect();
        oldest_ready.sort_by(|a, b| a.0.cmp(&b.0));
        let mut stmt = db(self.conn.prepare_cached(
            "SELECT type, reason, COUNT(*) FROM dead_letters WHERE archived_at IS NULL GROUP BY type, reason",
        ))?;
        let rows = db(stmt.query_map([], |r| {
            Ok((
                r.get::<_, Option<String>>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
            ))
        }))?;
        let mut dead_letters = Vec::new();
        for row in rows {
            let (ty, reason, n) = db(row)?;
            let reason = reason
                .parse()
                .map_err(|e| StoreError::Corrupt(format!("{e}")))?;
            dead_letters.push((ty, reason, n as u64));
        }
        // The primary key (source, message_id) counts them by source.
        let mut stmt = db(self.conn.prepare_cached(
            "SELECT source, COUNT(*) FROM source_held_retries GROUP BY source ORDER BY source",
        ))?;
        let held_retries = db(db(stmt.query_map([], |r| {
            Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?.max(0) as u64))
        }))?
        .collect::<rusqlite::Result<Vec<_>>>())?;
        Ok(StoreStats {
            lanes,
            dead_letters,
            held_retries,
            succeeded: self.succeeded,
            cancelled: self.cancelled,
            oldest_ready,
            backend: "sqlite",
            group_commit: Some(crate::GroupCommitStats {
                commits: self.commits,
                commands: self.commands,
                syncs: self.syncer.as_ref().map_or(0, Syncer::syncs),
                sync_micros: self.syncer.as_ref().map_or(0, Syncer::sync_micros),
                leases: self.leases,
                lease_steps: self.lease_steps,
                lease_pairs: self.lease_pairs,
                conflicts: 0,
            }),
        })
    }

    /// Recounts queued, scheduled, leased and succeeded jobs from the database.
    pub(in crate::sqlite) fn rebuild_counts(&mut self) -> Result<(), StoreError> {
        self.pairs.clear();
        self.scheduled.clear();
        let mut stmt = db(self.conn.prepare(
            "SELECT lane, tenant, type, state, COUNT(*) FROM jobs
             WHERE state IN ('queued', 'scheduled', 'leased') GROUP BY lane, tenant, type, state",
        ))?;
        let rows = db(stmt.query_map([], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, String>(2)?,
                r.get::<_, String>(3)?,
                r.get::<_, i64>(4)?,
            ))
        }))?;
        let mut counted = Vec::new();
        for row in rows {
            counted.push(db(row)?);
        }
        drop(stmt);
        for (lane, tenant, job_type, state, n) in counted {
            let lane = Lane::new(lane);
            match state.as_str() {
                "scheduled" => *self.scheduled.entry(lane).or_default() += n as u64,
                "queued" => self.pairs.add_ready(&lane, &tenant, &job_type, n as u32),
                _ => self.pairs.add_inflight(&lane, &tenant, n as u32),
            }
        }
        self.succeeded = db(self.conn.query_row(
            "SELECT COUNT(*) FROM jobs WHERE state = 'succeeded'",
            [],
            |r| r.get::<_, i64>(0),
        ))? as u64;
        self.cancelled = db(self.conn.query_row(
            "SELECT COUNT(*) FROM jobs WHERE state = 'cancelled'",
            [],
            |r| r.get::<_, i64>(0),
        ))? as u64;
        self.dirty = false;
        Ok(())
    }
}

impl Writer {
    /// Writes one sampling of the charts' signals (`crate::signals`):
    /// `minute`'s gauges replaced, counts raised, the minute marked
    /// sampled, and minutes before `keep_after` deleted.
    pub(super) fn write_signals(
        &mut self,
        minute: Timestamp,
        rows: Vec<lazaret_core::series::Sample>,
        keep_after: Timestamp,
    ) -> Result<u64, StoreError> {
        let minute = minute.as_millis();
        db(self
            .conn
            .prepare_cached(crate::signals::DELETE_GAUGES_SQLITE)?
            .execute(params![minute]))?;
        db(self
            .conn
            .prepare_cached(
                "INSERT INTO signal_samples (minute, signal, axis, name, value)
                 VALUES (?1, ?2, '', '', 1) ON CONFLICT DO NOTHING",
            )?
            .execute(params![minute, lazaret_core::series::SAMPLED]))?;
        let mut insert = db(self.conn.prepare_cached(
            "INSERT INTO signal_samples (minute, signal, axis, name, value)
             VALUES (?1, ?2, ?3, ?4, ?5)
             ON CONFLICT (minute, signal, axis, name) DO UPDATE SET value = max(value, excluded.value)",
        ))?;
        for s in &rows {
            db(insert.execute(params![
                s.minute.as_millis(),
                s.signal.as_str(),
                s.by.as_str(),
                s.name,
                i64::try_from(s.value).unwrap_or(i64::MAX)
            ]))?;
        }
        db(self
            .conn
            .prepare_cached("DELETE FROM signal_samples WHERE minute < ?1")?
            .execute(params![keep_after.as_millis()]))?;
        Ok(rows.len() as u64 + 1)
    }
}
