//! Reading a `jobs` row into a [`StoredJob`] (see `crate::stored`).

use lazaret_core::JobState;
use rusqlite::Row;

pub(crate) use crate::stored::StoredJob;

/// The columns [`StoredJob::from_row`] reads, in its order.
pub(super) const COLUMNS: &str = "id, type, tenant, lane, state, attempts, lease_started_at, worker_id, \
     idempotency_key, schema_version, created_at, finished_at, envelope, payload";

/// How many columns [`COLUMNS`] names: extra columns a query selects start here.
pub(super) const COLUMN_COUNT: usize = 14;

impl StoredJob {
    /// Reads the [`COLUMNS`] of a row; a state word no build writes is an
    /// error rather than a guess.
    pub(super) fn from_row(r: &Row<'_>) -> rusqlite::Result<Self> {
        let state: String = r.get(4)?;
        let state = state.parse::<JobState>().map_err(|e| {
            rusqlite::Error::FromSqlConversionFailure(
                4,
                rusqlite::types::Type::Text,
                Box::new(std::io::Error::other(e.to_string())),
            )
        })?;
        Ok(StoredJob {
            id: r.get(0)?,
            job_type: r.get(1)?,
            tenant: r.get(2)?,
            lane: r.get(3)?,
            state,
            attempts: r.get(5)?,
            lease_started_at: r.get(6)?,
            worker_id: r.get(7)?,
            idempotency_key: r.get(8)?,
            schema_version: r.get(9)?,
            created_at: r.get(10)?,
            finished_at: r.get(11)?,
            envelope: r.get(12)?,
            payload: r.get(13)?,
            traceparent: r
                .as_ref()
                .column_index("traceparent")
                .ok()
                .map(|i| r.get::<_, Option<String>>(i))
                .transpose()?
                .flatten(),
        })
    }
}
