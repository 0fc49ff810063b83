//! The seam between the [`Store`] and a database, after River's driver
//! split: one generic `impl Store` ([`StoreOn`]) over a small [`Backend`]
//! trait that each database implements (`sqlite::Sqlite`,
//! `postgres::Postgres`).
//!
//! Every write method of the [`Store`] is written once, here, generated
//! from the table of requests ([`with_requests`](crate::request::with_requests)):
//! it builds its [`Request`], hands it to the backend's writer
//! ([`Backend::submit`]) and awaits the typed answer. Reads, and what only one backend does (its
//! close, PostgreSQL's events, switches, leadership and tick throttle),
//! are the backend's own methods, forwarded.

use std::future::Future;

use lazaret_core::Timestamp;

use crate::request::{Claim, Reply, Request};
use crate::{
    ClaimedRetry, Duty, HeldRetry, MessageKey, Quarantined, SourceDeadLetter, Store, StoreError,
    StoreEvent, Switch, Tick,
};

/// The table of the store's reads: every read of the [`Store`] is one line
///
/// ```text
/// dead_letter(id: DeadLetterId) -> Option<DeadLetter>;
/// ```
///
/// (the method, its arguments, its answer), and everything that routes it
/// is generated from that line by the macros that `with_reads!(then, ..)`
/// calls with the table (after the tokens given after `then`):
/// - here, `declare_reads!`: its declaration in [`Backend`], and
///   `forward_reads!`: the method of `impl Store for StoreOn<B>` that
///   forwards it to the backend (and of the fault injector,
///   `crate::faulty`, that forwards it to the backend it wraps);
/// - `sqlite/mod.rs`: `impl Backend for Sqlite` runs
///   `reader::dead_letter(conn, &id)` on the reader connection's thread;
/// - `postgres/mod.rs`: `impl Backend for Postgres` awaits
///   `reader::dead_letter(client, &id)` on a reader connection.
///
/// A reader function takes its arguments by reference, a `Copy` one as a
/// pattern (`&id: &DeadLetterId`). So adding a read is: the trait method,
/// one line here, one function in each backend's `reader` module (or
/// re-exported there from the file named for its concern), and the
/// conformance case. Reads that a backend answers its own way (claims,
/// switches, events) are written by hand below.
macro_rules! with_reads {
    ($then:ident $(, $($extra:tt)*)?) => {
        $then! {
            [$($($extra)*)?]
            jobs(query: crate::JobQuery) -> crate::JobPage;
            pauses() -> Vec<crate::Pause>;
            job(id: lazaret_core::JobId) -> Option<crate::JobView>;
            dead_letters(
                filter: crate::DeadLetterFilter,
                limit: u32,
                cursor: Option<crate::DeadLetterId>
            ) -> (Vec<crate::DeadLetter>, Option<crate::DeadLetterId>);
            dead_letter(id: crate::DeadLetterId) -> Option<crate::DeadLetter>;
            dead_letter_payload(id: crate::DeadLetterId) -> Option<Option<Vec<u8>>>;
            reasons() -> Vec<crate::ReasonCount>;
            redrive_report(id: String) -> Option<crate::RedriveReport>;
            lineage(job_id: lazaret_core::JobId) -> Vec<crate::LineageEntry>;
            message_lineage(dead_letter: crate::DeadLetterId) -> Vec<crate::LineageEntry>;
            groups(query: crate::GroupQuery)
                -> (Vec<crate::FailureGroup>, Option<crate::GroupCursor>);
            dead_letters_after(after: crate::DeadLetterId, limit: u32)
                -> Vec<crate::RecentDeadLetter>;
            match_dead_letters(selector: crate::Selector)
                -> Vec<(crate::DeadLetterId, crate::Stage)>;
            audit_page(query: crate::AuditQuery) -> crate::AuditPage;
            due_held_retries(source: String, now: lazaret_core::Timestamp, limit: u32)
                -> Vec<crate::HeldRetry>;
            held_retry(key: crate::MessageKey) -> Option<crate::HeldRetry>;
            next_held_retry_due(source: String) -> Option<lazaret_core::Timestamp>;
            message_held(key: crate::MessageKey) -> crate::Held;
            tokens() -> Vec<crate::ApiToken>;
            signal_samples(from: lazaret_core::Timestamp, to: lazaret_core::Timestamp)
                -> crate::SignalSamples;
        }
    };
}
pub(crate) use with_reads;

/// The reads of the table ([`with_reads`]) declared in [`Backend`].
macro_rules! declare_reads {
    ([] $($method:ident($($arg:ident: $ty:ty),* $(,)?) -> $answer:ty;)*) => {
        $(fn $method(
            &self,
            $($arg: $ty),*
        ) -> impl Future<Output = Result<$answer, StoreError>> + Send;)*
    };
}

/// The reads of the table ([`with_reads`]), each forwarded to the field
/// named (`with_reads!(forward_reads, backend)`).
macro_rules! forward_reads {
    ([$to:ident] $($method:ident($($arg:ident: $ty:ty),* $(,)?) -> $answer:ty;)*) => {
        $(async fn $method(&self, $($arg: $ty),*) -> Result<$answer, StoreError> {
            self.$to.$method($($arg),*).await
        })*
    };
}
pub(crate) use forward_reads;

/// A [`Store`] on a backend: `SqliteStore` is `StoreOn<Sqlite>`,
/// `PostgresStore` is `StoreOn<Postgres>`, and
/// [`StoreOn::with_faults`](crate::faulty) wraps either in a fault injector.
#[derive(Clone, Debug)]
pub struct StoreOn<B> {
    pub(crate) backend: B,
}

impl<B> StoreOn<B> {
    pub(crate) fn new(backend: B) -> Self {
        StoreOn { backend }
    }
}

/// What a database gives the generic store: a writer that takes
/// [`Request`]s, its reads, and its own answers to what the backends do
/// differently.
pub(crate) trait Backend: Send + Sync + 'static {
    /// Hands a write request to the writer, which answers it through its
    /// reply. An error: the request was not handed over (a full queue, a
    /// closed store), and nothing of it was applied.
    fn submit(&self, r: Request) -> Result<(), StoreError>;

    /// The error for a request whose reply was dropped unanswered (the
    /// writer is gone).
    fn gone(&self) -> StoreError;

    /// A tick's answer without running it, when the backend skips ticks
    /// that come too soon (PostgreSQL's `tick_min`).
    fn tick_skip(&self, now: Timestamp) -> Option<Tick> {
        let _ = now;
        None
    }

    /// A tick at `now` ran and answered `t`.
    fn ticked(&self, now: Timestamp, t: &Tick) {
        let _ = (now, t);
    }

    /// Claims due held retries: by default a request to the writer.
    fn claim_held_retries(
        &self,
        claim: Claim,
    ) -> impl Future<Output = Result<Vec<ClaimedRetry>, StoreError>> + Send {
        call(self, |reply| Request::ClaimDue {
            claim: Box::new(claim),
            reply,
        })
    }

    // Its reads, from the table.
    with_reads!(declare_reads);
    /// What a sampling of the charts' signals reads (`crate::signals`), on
    /// a reader: by hand, since no `Store` method answers it as it is
    /// (`Store::sample_signals` writes it).
    fn signal_readings(
        &self,
        now: Timestamp,
    ) -> impl Future<Output = Result<crate::signals::Readings, StoreError>> + Send;

    /// [`Store::orders_one_job_commands`].
    fn orders_one_job_commands(&self) -> bool {
        false
    }
    /// [`Store::failure`].
    fn failure(&self) -> Option<String> {
        None
    }
    /// [`Store::events`].
    fn events(&self) -> Option<tokio::sync::broadcast::Receiver<StoreEvent>> {
        None
    }
    /// [`Store::publish`].
    fn publish(&self, switch: Switch) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = switch;
        async { Ok(()) }
    }
    /// [`Store::switches`].
    fn switches(&self) -> impl Future<Output = Result<Vec<Switch>, StoreError>> + Send {
        async { Ok(Vec::new()) }
    }
    /// [`Store::lead`].
    fn lead(&self, duty: Duty) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = duty;
        async { Ok(true) }
    }
    /// [`Store::close`].
    fn close(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// Builds a request with a fresh reply, submits it and awaits the answer.
pub(crate) async fn call<B: Backend + ?Sized, T>(
    backend: &B,
    make: impl FnOnce(Reply<T>) -> Request,
) -> Result<T, StoreError> {
    let (reply, answer) = Reply::new();
    backend.submit(make(reply))?;
    answer.await.map_err(|_| backend.gone())?
}

/// The `forward` lines of the table of requests
/// ([`with_requests`](crate::request::with_requests)) as methods of
/// `impl Store for StoreOn<B>`: each builds its request, sends it and
/// awaits the reply ([`call`]). The `by_hand` lines are written below.
macro_rules! forward_requests {
    ($(
        $(#[$doc:meta])*
        $how:ident $variant:ident: $method:ident($($arg:ident: $ty:ty),* $(,)?) -> $answer:ty;
    )*) => {
        $(forward_request!($how $variant: $method($($arg: $ty),*) -> $answer);)*
    };
}

/// One line of [`forward_requests`]: a method for `forward`, none for `by_hand`.
macro_rules! forward_request {
    (forward $variant:ident: $method:ident($($arg:ident: $ty:ty),*) -> $answer:ty) => {
        async fn $method(&self, $($arg: $ty),*) -> Result<$answer, StoreError> {
            call(&self.backend, |reply| Request::$variant { $($arg,)* reply }).await
        }
    };
    (by_hand $($line:tt)*) => {};
}

impl<B: Backend> Store for StoreOn<B> {
    // Its reads, forwarded to the backend.
    with_reads!(forward_reads, backend);
    // The write methods marked `forward` in the table of requests; those
    // marked `by_hand` follow.
    crate::request::with_requests!(forward_requests);

    async fn sample_signals(
        &self,
        now: Timestamp,
        keep_after: Timestamp,
    ) -> Result<u64, StoreError> {
        let (minute, mut rows, before) = self.backend.signal_readings(now).await?.samples();
        rows.extend(before);
        call(&self.backend, |reply| Request::WriteSignals {
            minute,
            rows,
            keep_after,
            reply,
        })
        .await
    }

    async fn tick(&self, now: Timestamp) -> Result<Tick, StoreError> {
        if let Some(t) = self.backend.tick_skip(now) {
            return Ok(t);
        }
        let t = call(&self.backend, |reply| Request::Tick { now, reply }).await?;
        self.backend.ticked(now, &t);
        Ok(t)
    }

    async fn redriven_message_succeeded(
        &self,
        key: MessageKey,
        now: Timestamp,
    ) -> Result<(), StoreError> {
        call(&self.backend, |reply| Request::RedrivenMessageSucceeded {
            key: Box::new(key),
            now,
            reply,
        })
        .await
    }

    async fn quarantine_message(&self, dl: SourceDeadLetter) -> Result<Quarantined, StoreError> {
        let mut v = self.quarantine_messages(vec![dl]).await?;
        v.pop()
            .ok_or_else(|| StoreError::Corrupt("no answer for the quarantine".into()))
    }

    async fn quarantine_messages(
        &self,
        dls: Vec<SourceDeadLetter>,
    ) -> Result<Vec<Quarantined>, StoreError> {
        if dls.is_empty() {
            return Ok(Vec::new());
        }
        call(&self.backend, |reply| Request::Quarantine { dls, reply }).await
    }

    async fn hold_retry(&self, p: HeldRetry) -> Result<(), StoreError> {
        call(&self.backend, |reply| Request::HoldRetry {
            p: Box::new(p),
            reply,
        })
        .await
    }

    async fn release_held_retry(&self, key: MessageKey) -> Result<bool, StoreError> {
        call(&self.backend, |reply| Request::ReleaseHeldRetry {
            key: Box::new(key),
            reply,
        })
        .await
    }

    async fn claim_held_retries(
        &self,
        source: String,
        now: Timestamp,
        limit: u32,
        claimer: String,
        expires_at: Timestamp,
    ) -> Result<Vec<ClaimedRetry>, StoreError> {
        let claim = Claim {
            source,
            now,
            limit,
            claimer,
            expires_at,
        };
        self.backend.claim_held_retries(claim).await
    }

    fn orders_one_job_commands(&self) -> bool {
        self.backend.orders_one_job_commands()
    }

    fn failure(&self) -> Option<String> {
        self.backend.failure()
    }

    fn events(&self) -> Option<tokio::sync::broadcast::Receiver<StoreEvent>> {
        self.backend.events()
    }

    async fn publish(&self, switch: Switch) -> Result<(), StoreError> {
        self.backend.publish(switch).await
    }

    async fn switches(&self) -> Result<Vec<Switch>, StoreError> {
        self.backend.switches().await
    }

    async fn lead(&self, duty: Duty) -> Result<bool, StoreError> {
        self.backend.lead(duty).await
    }

    async fn close(&self) -> Result<(), StoreError> {
        self.backend.close().await
    }
}
