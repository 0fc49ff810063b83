//! What one node of a cluster does for all of them: leadership of a
//! [`Duty`] (a session advisory lock held on a connection of its own), and
//! the read of every node's recent dead letters the alert leader counts.
//!
//! Leadership: a node leads a duty while its session holds the advisory
//! lock (the schema's key, the duty's number). The lock is the session's,
//! so it goes when the session does: a node that stops, is killed or loses
//! its connection loses it, and the next node to ask gets it. A leader
//! checks its connection each time it is asked (one round trip), so a
//! node whose connection broke stops leading at its next call. What it
//! cannot see: a network partition that leaves its session alive on the
//! server; the server drops that session only when TCP keepalive gives up
//! on it, and until then no other node leads (the duty pauses, it is never
//! done twice).

use std::collections::BTreeSet;

use tokio::sync::Mutex;
use tokio_postgres::Client;

use super::{PgOptions, connect, pg};
use crate::{DeadLetterId, Duty, RecentDeadLetter, StoreError};

/// The leadership connection and the duties it leads.
pub(super) struct Leadership {
    opts: PgOptions,
    /// The schema's key (the advisory lock's first): clusters in two
    /// schemas of one database lead apart.
    key: i32,
    state: Mutex<Led>,
}

#[derive(Default)]
struct Led {
    client: Option<Client>,
    held: BTreeSet<Duty>,
}

impl Leadership {
    pub(super) fn new(opts: PgOptions) -> Self {
        // FNV-1a of the schema name, folded to 32 bits.
        let h = opts.schema.bytes().fold(0x811c_9dc5u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        });
        Leadership {
            opts,
            key: h as i32,
            state: Mutex::new(Led::default()),
        }
    }

    /// Whether this node leads `duty` now (see [`crate::Store::lead`]).
    pub(super) async fn lead(&self, duty: Duty) -> Result<bool, StoreError> {
        let mut led = self.state.lock().await;
        if led.client.as_ref().is_some_and(Client::is_closed) {
            *led = Led::default();
        }
        if led.client.is_none() {
            led.client = Some(connect(&self.opts, None).await?);
        }
        let Some(client) = led.client.as_ref() else {
            return Ok(false);
        };
        let asked = if led.held.contains(&duty) {
            // Still ours while the session lives.
            client.simple_query("SELECT 1").await.map(|_| true)
        } else {
            client
                .query_one(
                    "SELECT pg_try_advisory_lock($1, $2)",
                    &[&self.key, &duty.number()],
                )
                .await
                .map(|r| r.get::<_, bool>(0))
        };
        match asked {
            Ok(true) => {
                if led.held.insert(duty) {
                    tracing::info!(
                        duty = duty.as_str(),
                        schema = %self.opts.schema,
                        "this node now leads the cluster's {} duty",
                        duty.as_str()
                    );
                }
                Ok(true)
            }
            Ok(false) => Ok(false),
            Err(e) => {
                // The session (and every lock of it) is gone or going: drop
                // it; the next call connects again and asks afresh.
                for d in std::mem::take(&mut led.held) {
                    tracing::warn!(
                        duty = d.as_str(),
                        "this node no longer leads: its leadership connection failed"
                    );
                }
                led.client = None;
                pg(Err(e))
            }
        }
    }

    /// Lets every duty go (the store closes). The locks are released by a
    /// statement, not left to the session's end: dropping the client only
    /// starts closing the connection, and until the server has ended the
    /// backend another node asking at once would still find them held.
    pub(super) async fn resign(&self) {
        let mut led = self.state.lock().await;
        if let Some(client) = led.client.as_ref() {
            if !led.held.is_empty() {
                // If this fails the session is going anyway, and its locks with it.
                let _ = client.simple_query("SELECT pg_advisory_unlock_all()").await;
            }
        }
        *led = Led::default();
    }
}

/// Dead letters above `after` by id, lowest first (the primary key).
pub(super) async fn dead_letters_after(
    c: &Client,
    &after: &DeadLetterId,
    &limit: &u32,
) -> Result<Vec<RecentDeadLetter>, StoreError> {
    let rows = pg(c
        .query(
            "SELECT id, dead_lettered_at, type, reason, error FROM dead_letters
             WHERE id > $1 AND archived_at IS NULL ORDER BY id LIMIT $2",
            &[&(after.0 as i64), &i64::from(limit)],
        )
        .await)?;
    rows.iter()
        .map(|r| {
            let error: Option<String> = r.get(4);
            RecentDeadLetter::from_columns(
                r.get(0),
                r.get(1),
                r.get(2),
                r.get::<_, &str>(3),
                error.as_deref(),
            )
        })
        .collect()
}
