//! The PostgreSQL store: several stateless lazaret nodes on one database.
//!
//! One writer connection per node runs every change, grouping the ops that
//! arrive together into one transaction (`writer`), so a commit's flush is
//! shared by every request in it; reads go to a small pool of their own.
//! Leases pick jobs `FOR UPDATE SKIP LOCKED` and charge the attempt in the
//! same statement; a transition and its effects (the dead letter, the
//! counts) are one transaction. Lease ends are on the database's clock
//! ([`Clock::Database`]), so a node whose clock runs ahead cannot expire,
//! and so steal, another node's lease. Wake-ups go through `LISTEN/NOTIFY`:
//! a commit that made jobs leasable notifies `lazaret_ready`, token changes
//! `lazaret_tokens`, shared switches (pauses, open breakers) `lazaret_switch`;
//! every node's listener turns them into [`StoreEvent`]s.
//!
//! What it deliberately does not do: TLS (connect through a local socket,
//! a sidecar or a private network), connection pooling beyond its own few
//! connections, and any decision (the lease plan is the core's
//! `plan_lease`, a freed slot its `FairScheduler::frees_slot`, outcomes
//! the `Decider`'s).

mod cluster;
mod reader;
mod schema;
mod writer;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use futures_util::StreamExt as _;
use lazaret_core::{FairScheduler, Timestamp};
use tokio::sync::{Mutex, broadcast, mpsc};
use tokio_postgres::{AsyncMessage, Client, NoTls};

pub use schema::SCHEMA_VERSION;
use writer::{Cmd, Writer};

use crate::backend::{Backend, StoreOn};
use crate::request::{Claim, Reply, Request};
use crate::{DbError, Decider, StoreError, StoreEvent, Switch, Tick};

/// The notification channels of one schema. Channels are the database's,
/// not a schema's: each schema gets its own names, so two lazaret clusters
/// in two schemas of one database never hear each other.
#[derive(Clone, Debug)]
pub(crate) struct Channels {
    /// Notified at the commit of anything that made jobs leasable.
    pub ready: String,
    /// Notified at the commit of a token's creation or revocation.
    pub tokens: String,
    /// Notified with a [`Switch`] as JSON.
    pub switch: String,
}

impl Channels {
    fn of(schema: &str) -> Self {
        // FNV-1a: a short, stable name within PostgreSQL's 63 bytes.
        let h = schema.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        Channels {
            ready: format!("lazaret_{h:016x}_ready"),
            tokens: format!("lazaret_{h:016x}_tokens"),
            switch: format!("lazaret_{h:016x}_switch"),
        }
    }
}
/// Reader connections per node.
const READERS: usize = 4;

/// Commands waiting for the writer at most; one more is refused with
/// [`StoreError::Overloaded`] (the server answers `503 UNAVAILABLE` with
/// `Retry-After`) instead of queueing without bound, as SQLite's
/// `COMMANDS_MAX`. Housekeeping (ticks, retention) and close are never
/// refused.
pub const COMMANDS_MAX: usize = 10_000;

/// The listener's first wait before connecting again, doubled after each
/// failed try up to [`LISTEN_RETRY_MAX`].
const LISTEN_RETRY_MIN: std::time::Duration = std::time::Duration::from_millis(100);
/// The listener's longest wait between tries to connect again.
const LISTEN_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// Whose clock a lease's end is measured on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Clock {
    /// The database's (`clock_timestamp()`), read with every transaction
    /// (a transaction's time is the last reading plus the monotonic time
    /// since, while it is fresh): the callers' times keep their distance
    /// from the callers' `now` but count from the database's, so nodes with
    /// skewed clocks agree on every lease's end. The default.
    #[default]
    Database,
    /// The caller's `now`, as given: for tests that drive time themselves
    /// (the conformance suite).
    Caller,
}

/// Where and how to connect.
#[derive(Clone, Debug)]
pub struct PgOptions {
    /// `postgres://user@host:port/db` (a `schema=NAME` query parameter is
    /// read here, not by the driver; other parameters go to the driver).
    pub url: String,
    /// The schema lazaret's tables live in (`lazaret` unless the URL says).
    pub schema: String,
    /// Whose clock leases run on.
    pub clock: Clock,
    /// A [`Store::tick`](crate::Store::tick) sooner than this after the last one (by the
    /// caller's `now`) does nothing: every node ticks, and the database
    /// need not be asked 40 times a second by each. Promotions and
    /// expiries wait at most this long more. 0 ticks every time (tests).
    pub tick_min: std::time::Duration,
}

/// The default [`PgOptions::tick_min`].
pub const TICK_MIN: std::time::Duration = std::time::Duration::from_millis(100);

impl PgOptions {
    /// Options from a `--store` URL: `postgres://…[?schema=NAME]`.
    pub fn from_url(url: &str) -> Result<Self, StoreError> {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut schema = "lazaret".to_owned();
        let mut rest = Vec::new();
        for kv in query.split('&').filter(|s| !s.is_empty()) {
            match kv.split_once('=') {
                Some(("schema", v)) => schema = v.to_owned(),
                _ => rest.push(kv),
            }
        }
        check_schema(&schema)?;
        let url = if rest.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", rest.join("&"))
        };
        Ok(PgOptions {
            url,
            schema,
            clock: Clock::Database,
            tick_min: TICK_MIN,
        })
    }
}

/// A schema name is put in SQL as written: letters, digits, `_` only.
fn check_schema(schema: &str) -> Result<(), StoreError> {
    let ok = !schema.is_empty()
        && schema.len() <= 63
        && schema
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !schema.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(StoreError::Open {
            path: schema.to_owned(),
            source: std::io::Error::other(
                "a schema name is 1 to 63 lower-case letters, digits and `_`, not starting with a digit; \
                 fix the `schema=` parameter of --store",
            ),
        })
    }
}

/// A PostgreSQL error as the seam carries it: its text, its SQLSTATE.
pub(crate) fn pg<T>(r: Result<T, tokio_postgres::Error>) -> Result<T, StoreError> {
    r.map_err(|e| {
        let code = e.code().map(|c| c.code().to_owned());
        let detail = e.as_db_error().map_or_else(
            || match std::error::Error::source(&e) {
                Some(cause) => format!("{e}: {cause}"),
                None => e.to_string(),
            },
            |d| d.message().to_owned(),
        );
        if e.is_closed() {
            return StoreError::Db(DbError {
                message: format!(
                    "PostgreSQL: the connection is closed ({detail}); check that the database is up; \
                     lazaret reconnects at its next start"
                ),
                code,
            });
        }
        StoreError::Db(DbError {
            message: format!("PostgreSQL: {detail}"),
            code,
        })
    })
}

/// Connects one client, with lazaret's schema first on its `search_path`,
/// and drives its connection on a task; notifications go to `notify`.
async fn connect(
    opts: &PgOptions,
    notify: Option<mpsc::UnboundedSender<tokio_postgres::Notification>>,
) -> Result<Client, StoreError> {
    let mut config: tokio_postgres::Config = opts.url.parse().map_err(|e| StoreError::Open {
        path: opts.url.clone(),
        source: std::io::Error::other(format!(
            "{e}; --store takes postgres://USER[:PASSWORD]@HOST[:PORT]/DATABASE[?schema=NAME]"
        )),
    })?;
    config.options(format!("-c search_path={}", opts.schema));
    // Names the schema, so an operator (or a test) can tell the clusters'
    // sessions apart in pg_stat_activity, and the listener from the rest.
    config.application_name(if notify.is_some() {
        format!("lazaret/{}/listener", opts.schema)
    } else {
        format!("lazaret/{}", opts.schema)
    });
    let (client, mut conn) = config.connect(NoTls).await.map_err(|e| StoreError::Open {
        path: lazaret_core::mask_url(&opts.url),
        source: std::io::Error::other(format!(
            "{e}; check that PostgreSQL is up, the address is right and the user may connect"
        )),
    })?;
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(m) = messages.next().await {
            match m {
                Ok(AsyncMessage::Notification(n)) => {
                    if let Some(tx) = &notify {
                        let _ = tx.send(n);
                    }
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "PostgreSQL connection ended");
                    break;
                }
            }
        }
    });
    Ok(client)
}

/// Runs the migrations on the database `opts` names and returns the
/// schema version found before (0: none); what `lazaret migrate` does.
pub async fn migrate(opts: &PgOptions) -> Result<i64, StoreError> {
    let client = connect(opts, None).await?;
    schema::migrate(&client, &opts.schema).await
}

/// The server process serving a connection (what a notification names).
async fn backend_pid(c: &Client) -> Result<i32, StoreError> {
    Ok(pg(c.query_one("SELECT pg_backend_pid()", &[]).await)?.get(0))
}

/// Drops the schema `opts` names with everything in it (tests, benches).
pub async fn drop_schema(opts: &PgOptions) -> Result<(), StoreError> {
    check_schema(&opts.schema)?;
    let client = connect(opts, None).await?;
    pg(client
        .batch_execute(&format!("DROP SCHEMA IF EXISTS {} CASCADE", opts.schema))
        .await)
}

/// Hears the other nodes of the cluster: LISTENs on the schema's channels
/// and turns their notifications into [`StoreEvent`]s.
///
/// Notifications sent while the listener is not connected are lost, so
/// when the database drops its connection it connects again (waiting
/// [`LISTEN_RETRY_MIN`], doubling up to [`LISTEN_RETRY_MAX`]) and then says
/// what they would have: the tokens may have changed, the shared switches
/// as they are now (and a resume for each pause it knew of that is gone),
/// and jobs may be ready (every long-poll looks again).
struct Listener {
    opts: PgOptions,
    channels: Channels,
    events: broadcast::Sender<StoreEvent>,
    /// This node's writer and readers: their notifications are its own.
    own: HashSet<i32>,
    /// The pauses heard of, `true` for a type's: to resume those lifted
    /// while the listener was away.
    paused: HashSet<(bool, String)>,
}

/// A listening connection and its notifications (the sender ends with the
/// connection).
type Heard = (
    Client,
    mpsc::UnboundedReceiver<tokio_postgres::Notification>,
);

impl Listener {
    /// Connects and LISTENs; then reads the shared switches, so none set
    /// before the LISTEN is missed.
    async fn listen(&mut self) -> Result<Heard, StoreError> {
        let (ntx, nrx) = mpsc::unbounded_channel();
        let client = connect(&self.opts, Some(ntx)).await?;
        pg(client
            .batch_execute(&format!(
                "LISTEN {}; LISTEN {}; LISTEN {};",
                self.channels.ready, self.channels.tokens, self.channels.switch
            ))
            .await)?;
        let now = reader::switches(&client).await?;
        let was = std::mem::take(&mut self.paused);
        for s in &now {
            self.note(s);
        }
        // What changed while away (nothing at the first connection).
        for (is_type, name) in was.difference(&self.paused) {
            let name = name.clone();
            let _ = self.events.send(StoreEvent::Switch(if *is_type {
                Switch::PauseType {
                    name,
                    paused: false,
                }
            } else {
                Switch::PauseLane {
                    name,
                    paused: false,
                }
            }));
        }
        Ok((client, nrx))
    }

    /// Keeps `paused` up to date with a switch.
    fn note(&mut self, s: &Switch) {
        let (is_type, name, paused) = match s {
            Switch::PauseType { name, paused } => (true, name, *paused),
            Switch::PauseLane { name, paused } => (false, name, *paused),
            _ => return,
        };
        if paused {
            self.paused.insert((is_type, name.clone()));
        } else {
            self.paused.remove(&(is_type, name.clone()));
        }
    }

    /// Hears until the store goes, connecting again whenever the
    /// connection ends.
    async fn run(mut self, mut heard: Heard, mut stopped: tokio::sync::watch::Receiver<()>) {
        loop {
            if self.hear(&mut heard.1, &mut stopped).await {
                return;
            }
            tracing::warn!("PostgreSQL: the listener's connection ended; connecting again");
            let mut wait = LISTEN_RETRY_MIN;
            heard = loop {
                tokio::select! {
                    () = tokio::time::sleep(wait) => {},
                    _ = stopped.changed() => return,
                }
                match self.listen().await {
                    Ok(h) => break h,
                    Err(e) => {
                        tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64,
                            "PostgreSQL: the listener could not connect again");
                        wait = (wait * 2).min(LISTEN_RETRY_MAX);
                    }
                }
            };
            tracing::info!("PostgreSQL: the listener connected again");
            // `listen` sent the resumes; the rest of what may have been missed.
            let _ = self.events.send(StoreEvent::TokensChanged);
            let switches = reader::switches(&heard.0).await.unwrap_or_default();
            for s in switches {
                let _ = self.events.send(StoreEvent::Switch(s));
            }
            let _ = self.events.send(StoreEvent::Ready { jobs: None });
        }
    }

    /// Turns notifications into events until the connection ends (`false`)
    /// or the store goes (`true`).
    async fn hear(
        &mut self,
        nrx: &mut mpsc::UnboundedReceiver<tokio_postgres::Notification>,
        stopped: &mut tokio::sync::watch::Receiver<()>,
    ) -> bool {
        loop {
            let n = tokio::select! {
                n = nrx.recv() => match n { Some(n) => n, None => return false },
                _ = stopped.changed() => return true,
            };
            if self.own.contains(&n.process_id()) {
                // This node's own commit: it woke its own waiters already.
                continue;
            }
            let event = match n.channel() {
                c if c == self.channels.ready => StoreEvent::Ready {
                    jobs: serde_json::from_str::<Vec<(String, String)>>(n.payload())
                        .ok()
                        .map(|v| {
                            v.into_iter()
                                .map(|(l, t)| {
                                    (lazaret_core::Lane::new(l), lazaret_core::JobType::new(t))
                                })
                                .collect()
                        }),
                },
                c if c == self.channels.tokens => StoreEvent::TokensChanged,
                c if c == self.channels.switch => match serde_json::from_str::<Switch>(n.payload())
                {
                    Ok(s) => {
                        self.note(&s);
                        StoreEvent::Switch(s)
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, payload = n.payload(), "an unreadable switch");
                        continue;
                    }
                },
                _ => continue,
            };
            let _ = self.events.send(event);
        }
    }
}

/// The PostgreSQL [`Store`](crate::Store): the generic store on [`Postgres`].
pub type PostgresStore = StoreOn<Postgres>;

/// The PostgreSQL backend: the writer task's queue, the readers, the
/// listener's events and the cluster's duties.
#[derive(Debug, Clone)]
pub struct Postgres {
    inner: Arc<Inner>,
}

struct Inner {
    tx: mpsc::UnboundedSender<Cmd>,
    /// Commands sent and not yet taken by the writer.
    waiting: Arc<AtomicUsize>,
    /// The bound on `waiting` for requests ([`COMMANDS_MAX`]).
    commands_max: usize,
    readers: Vec<Mutex<Client>>,
    next_reader: AtomicUsize,
    closed: AtomicBool,
    events: broadcast::Sender<StoreEvent>,
    schema: String,
    channels: Channels,
    tick_min: std::time::Duration,
    /// Why the writer cannot reach the database now.
    down: Arc<std::sync::Mutex<Option<String>>>,
    /// To connect readers again.
    opts: PgOptions,
    /// The caller's `now` of the last tick that ran, and what it found due next.
    last_tick: std::sync::Mutex<Option<(Timestamp, Option<Timestamp>)>>,
    /// The duties this node leads for the cluster (`cluster.rs`).
    leadership: cluster::Leadership,
    /// Dropped (or sent) when the store goes: the listener stops.
    _stop: tokio::sync::watch::Sender<()>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("schema", &self.schema)
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// Connects, migrates (one node at a time), and starts the writer and
    /// the listener.
    pub async fn open(
        opts: PgOptions,
        scheduler: FairScheduler,
        decider: Arc<dyn Decider>,
    ) -> Result<Self, StoreError> {
        Self::open_bounded(opts, scheduler, decider, COMMANDS_MAX).await
    }

    /// [`PostgresStore::open`] with another bound on the commands waiting
    /// for the writer than [`COMMANDS_MAX`] (at least 1).
    pub async fn open_bounded(
        opts: PgOptions,
        scheduler: FairScheduler,
        decider: Arc<dyn Decider>,
        commands_max: usize,
    ) -> Result<Self, StoreError> {
        check_schema(&opts.schema)?;
        let writer_client = connect(&opts, None).await?;
        schema::migrate(&writer_client, &opts.schema).await?;
        let mut readers = Vec::with_capacity(READERS);
        // The backends of this node's own connections: their notifications
        // are its own changes, already seen.
        let mut own: HashSet<i32> = HashSet::new();
        own.insert(backend_pid(&writer_client).await?);
        for _ in 0..READERS {
            let c = connect(&opts, None).await?;
            own.insert(backend_pid(&c).await?);
            readers.push(Mutex::new(c));
        }
        let channels = Channels::of(&opts.schema);
        let (events, _) = broadcast::channel(1024);
        let (stop, stopped) = tokio::sync::watch::channel(());
        let mut listener = Listener {
            opts: opts.clone(),
            channels: channels.clone(),
            events: events.clone(),
            own,
            paused: HashSet::new(),
        };
        let heard = listener.listen().await?;
        tokio::spawn(listener.run(heard, stopped));
        let (tx, rx) = mpsc::unbounded_channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let down = Arc::new(std::sync::Mutex::new(None));
        // Before any group commits (see `writer::flush`).
        let flusher = writer::Flusher::open(opts.clone()).await?;
        let w = Writer::new(
            writer_client,
            flusher,
            opts.clone(),
            Arc::clone(&down),
            scheduler,
            decider,
            opts.clock,
            channels.clone(),
        );
        tokio::spawn(w.run(rx, Arc::clone(&waiting)));
        Ok(StoreOn::new(Postgres {
            inner: Arc::new(Inner {
                tx,
                waiting,
                commands_max: commands_max.max(1),
                readers,
                next_reader: AtomicUsize::new(0),
                closed: AtomicBool::new(false),
                events,
                schema: opts.schema.clone(),
                channels,
                tick_min: opts.tick_min,
                down,
                opts: opts.clone(),
                last_tick: std::sync::Mutex::new(None),
                leadership: cluster::Leadership::new(opts.clone()),
                _stop: stop,
            }),
        }))
    }

    /// The schema this store keeps its tables in.
    pub fn schema(&self) -> &str {
        &self.backend.inner.schema
    }

    /// Commands sent to the writer that it has not taken yet.
    pub fn commands_waiting(&self) -> usize {
        self.backend.inner.waiting.load(Ordering::Acquire)
    }
}

impl Postgres {
    /// Sends a request to the writer; [`StoreError::Overloaded`] at once
    /// when `bounded` and the bound's worth of commands wait already
    /// ([`COMMANDS_MAX`]; housekeeping must run however busy the store is).
    fn send(&self, r: Request, bounded: bool) -> Result<(), StoreError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(StoreError::Closed);
        }
        let before = self.inner.waiting.fetch_add(1, Ordering::AcqRel);
        if bounded && before >= self.inner.commands_max {
            self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Overloaded { waiting: before });
        }
        if self.inner.tx.send(Cmd::Request(r)).is_err() {
            self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(StoreError::Closed);
        }
        Ok(())
    }

    async fn reader(&self) -> Result<tokio::sync::MutexGuard<'_, Client>, StoreError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(StoreError::Closed);
        }
        let i = self.inner.next_reader.fetch_add(1, Ordering::Relaxed) % self.inner.readers.len();
        let mut c = self.inner.readers[i].lock().await;
        if c.is_closed() {
            *c = connect(&self.inner.opts, None).await?;
        }
        Ok(c)
    }
}

/// The reads of the table ([`with_reads`](crate::backend::with_reads)):
/// each awaits `reader::method(client, &argument, ..)` on a reader
/// connection.
macro_rules! read_on_reader {
    ([] $($method:ident($($arg:ident: $ty:ty),* $(,)?) -> $answer:ty;)*) => {
        $(async fn $method(&self, $($arg: $ty),*) -> Result<$answer, StoreError> {
            reader::$method(&*self.reader().await?, $(&$arg),*).await
        })*
    };
}

impl Backend for Postgres {
    // Its reads, each on a reader connection.
    crate::backend::with_reads!(read_on_reader);

    fn submit(&self, r: Request) -> Result<(), StoreError> {
        let bounded = !r.is_housekeeping();
        self.send(r, bounded)
    }

    fn gone(&self) -> StoreError {
        StoreError::Closed
    }

    async fn signal_readings(
        &self,
        now: Timestamp,
    ) -> Result<crate::signals::Readings, StoreError> {
        reader::signal_readings(&*self.reader().await?, now).await
    }

    fn tick_skip(&self, now: Timestamp) -> Option<Tick> {
        if self.inner.tick_min.is_zero() {
            return None;
        }
        let last = *self
            .inner
            .last_tick
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let (at, next_due) = last?;
        (now < at.saturating_add(self.inner.tick_min) && now >= at).then(|| Tick {
            next_due,
            ..Tick::default()
        })
    }

    fn ticked(&self, now: Timestamp, t: &Tick) {
        *self
            .inner
            .last_tick
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some((now, t.next_due));
    }

    /// Claims run on a reader (`FOR UPDATE SKIP LOCKED`), beside the writer.
    async fn claim_held_retries(
        &self,
        claim: Claim,
    ) -> Result<Vec<crate::ClaimedRetry>, StoreError> {
        reader::claim_due(
            &*self.reader().await?,
            &claim.source,
            claim.now,
            claim.limit,
            &claim.claimer,
            claim.expires_at,
        )
        .await
    }

    fn failure(&self) -> Option<String> {
        self.inner
            .down
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn events(&self) -> Option<broadcast::Receiver<StoreEvent>> {
        Some(self.inner.events.subscribe())
    }

    async fn publish(&self, switch: Switch) -> Result<(), StoreError> {
        let payload = serde_json::to_string(&switch)
            .map_err(|e| StoreError::Corrupt(format!("a switch as JSON: {e}")))?;
        let c = self.reader().await?;
        reader::save_switch(&c, &switch).await?;
        pg(c.execute(
            "SELECT pg_notify($1, $2)",
            &[&self.inner.channels.switch, &payload],
        )
        .await)?;
        Ok(())
    }

    async fn switches(&self) -> Result<Vec<Switch>, StoreError> {
        reader::switches(&*self.reader().await?).await
    }

    async fn lead(&self, duty: crate::Duty) -> Result<bool, StoreError> {
        if self.inner.closed.load(Ordering::Acquire) {
            return Err(StoreError::Closed);
        }
        self.inner.leadership.lead(duty).await
    }

    async fn close(&self) -> Result<(), StoreError> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return Err(StoreError::Closed);
        }
        self.inner.leadership.resign().await;
        let (reply, answer) = Reply::new();
        self.inner.waiting.fetch_add(1, Ordering::AcqRel);
        if self.inner.tx.send(Cmd::Close(reply)).is_err() {
            self.inner.waiting.fetch_sub(1, Ordering::AcqRel);
            return Ok(());
        }
        answer.await.map_err(|_| StoreError::Closed)?
    }
}
