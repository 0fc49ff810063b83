//! lazaret's durable store: the [`Store`] trait and its two implementations,
//! SQLite (the embedded default, [`sqlite`]) and PostgreSQL (several nodes,
//! `postgres`, behind the feature of that name).
//!
//! The store *applies* what `lazaret-core` decides; it never decides policy.
//! Every method that changes a job runs in one transaction: a lease charges
//! the attempt in the transaction that grants it; an outcome writes the
//! envelope, the new state and (for a dead letter) the quarantine record
//! together. The decision itself comes from a [`Decider`] the caller passes
//! in (the server wraps `lazaret_core::decide`), so the rule table stays in
//! one place.
//!
//! Both backends sit behind one generic `impl Store`, [`StoreOn`]: each
//! write method builds one request (`request.rs`: a variant per write
//! operation, with a reply typed for its answer) and hands it to the
//! backend's writer (`backend.rs`: the `Backend` trait), whose functions
//! live in files named for their concern, the same in both backends
//! (`sqlite/writer/`, `postgres/writer/`). [`faulty`] wraps either to fail
//! writes on purpose, for tests of what callers do then.
//!
//! What it deliberately does not do: HTTP, auth, admission checks, breaker
//! state, metrics. Those belong to the server. It keeps the tokens created
//! through the API (name, role, SHA-256 of the secret) but never decides who
//! may do what.

mod backend;
mod decider;
pub mod faulty;
mod model;
#[cfg(feature = "postgres")]
pub mod postgres;
mod request;
mod signals;
pub mod sqlite;
mod stored;

pub use backend::StoreOn;
pub use decider::PolicyDecider;
pub use faulty::{Fault, FaultRates, Faults, FaultyStore};
pub use model::*;
#[cfg(feature = "postgres")]
pub use postgres::{PgOptions, PostgresStore};
pub use sqlite::{Durability, SqliteStore};

use std::future::Future;

use lazaret_core::{Envelope, Event, JobId, Timestamp, Transition};

/// Turns an event into a transition: the store's only window on policy.
pub trait Decider: Send + Sync + 'static {
    /// Decides what happens after `event`, mutating the envelope's counters
    /// and history (see `lazaret_core::decide`).
    fn decide(&self, env: &mut Envelope, event: Event, now: Timestamp) -> Transition;
}

/// The seam every backend implements (SQLite, PostgreSQL); one conformance
/// suite (`lazaret-store-conformance`) runs against each.
pub trait Store: Send + Sync + 'static {
    /// Inserts admitted jobs (idempotently on tenant, type and key), in order.
    fn enqueue(
        &self,
        jobs: Vec<NewJob>,
    ) -> impl Future<Output = Result<Vec<EnqueueOutcome>, StoreError>> + Send;

    /// Picks fairly and leases up to `max_jobs` ready jobs, charging each an attempt.
    fn lease(
        &self,
        req: LeaseRequest,
    ) -> impl Future<Output = Result<Vec<LeasedJob>, StoreError>> + Send;

    /// Applies worker outcomes (ack or fail), each checked against its lease
    /// token and its lease's end: an outcome at or after `lease_expires_at`
    /// (`now` being the outcome's time) is [`ItemError::LeaseLost`] and
    /// changes nothing, as if the reaper ([`Store::tick`]) had run first.
    fn complete(
        &self,
        items: Vec<Completion>,
        now: Timestamp,
    ) -> impl Future<Output = Result<Vec<Result<Completed, ItemError>>, StoreError>> + Send;

    /// Extends a lease to `expires_at`, and says whether a cancel of the
    /// job was requested. Like an outcome, a heartbeat at `now` at or after
    /// the lease's end is [`ItemError::LeaseLost`] and changes nothing: a
    /// lease past its end is not revived.
    fn heartbeat(
        &self,
        id: JobId,
        token: LeaseToken,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> impl Future<Output = Result<Result<Heartbeat, ItemError>, StoreError>> + Send;

    /// Cancels a job as `lazaret_core::cancel` decides: a waiting job
    /// becomes `cancelled` now; a leased one is marked, and its next
    /// outcome is settled by `lazaret_core::settle` (an ack stands, a fail
    /// or an expiry ends it `cancelled`, with no dead letter). A finished
    /// job is refused. The audit entry is written in the same transaction
    /// when the cancel is accepted, with `count` 1 when it changed the job
    /// and 0 for a repeated request.
    fn cancel(
        &self,
        id: JobId,
        now: Timestamp,
        audit: AuditEntry,
    ) -> impl Future<Output = Result<Result<Cancelled, CancelError>, StoreError>> + Send;

    /// A page of jobs, newest first (by id), without scanning the table
    /// for a state filter.
    fn jobs(&self, query: JobQuery) -> impl Future<Output = Result<JobPage, StoreError>> + Send;

    /// Pauses (`paused: true`) or resumes a type or lane, and writes its
    /// audit entry, in one transaction; whether that changed anything.
    /// Pauses are kept across restarts.
    fn set_pause(
        &self,
        target: PauseTarget,
        paused: bool,
        audit: AuditEntry,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Every type and lane paused now, ordered by target.
    fn pauses(&self) -> impl Future<Output = Result<Vec<Pause>, StoreError>> + Send;

    /// Housekeeping due at `now`: promotes scheduled jobs whose time came and
    /// turns expired leases into `lease_expired` attempts.
    fn tick(&self, now: Timestamp) -> impl Future<Output = Result<Tick, StoreError>> + Send;

    /// Records a payload refused at admission.
    fn record_admission(
        &self,
        rec: AdmissionRecord,
    ) -> impl Future<Output = Result<DeadLetterId, StoreError>> + Send;

    /// One job, whatever its state.
    fn job(&self, id: JobId) -> impl Future<Output = Result<Option<JobView>, StoreError>> + Send;

    /// A page of dead letters, newest first.
    fn dead_letters(
        &self,
        filter: DeadLetterFilter,
        limit: u32,
        cursor: Option<DeadLetterId>,
    ) -> impl Future<Output = Result<(Vec<DeadLetter>, Option<DeadLetterId>), StoreError>> + Send;

    /// One dead letter.
    fn dead_letter(
        &self,
        id: DeadLetterId,
    ) -> impl Future<Output = Result<Option<DeadLetter>, StoreError>> + Send;

    /// The original payload of a dead letter, byte for byte (`None`: unknown
    /// id; `Some(None)`: an admission record whose payload was not read whole).
    fn dead_letter_payload(
        &self,
        id: DeadLetterId,
    ) -> impl Future<Output = Result<Option<Option<Vec<u8>>>, StoreError>> + Send;

    /// Dead letters grouped by reason and type.
    fn reasons(&self) -> impl Future<Output = Result<Vec<ReasonCount>, StoreError>> + Send;

    /// Dead letters with an id above `after`, lowest id first, at most
    /// `limit`, whichever node wrote them (processing, admission and
    /// broker ones alike): what the alerts count. On a store several nodes
    /// write to, a dead letter may become visible after one with a higher
    /// id (its transaction committed later): a reader re-reads the last
    /// few seconds' ids (see the server's `alerts`).
    fn dead_letters_after(
        &self,
        after: DeadLetterId,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<RecentDeadLetter>, StoreError>> + Send;

    /// The dead letters a selector matches: (id, stage), oldest first.
    fn match_dead_letters(
        &self,
        selector: Selector,
    ) -> impl Future<Output = Result<Vec<(DeadLetterId, Stage)>, StoreError>> + Send;

    /// Moves processing dead letters back into line (same job id and key,
    /// fresh budget, history kept). Admission records are skipped. With
    /// `audit`, the jobs moved are added to that entry's `count` in the
    /// same transaction, so the audit log never says less (or more) than
    /// was done, whenever the process stops.
    fn redrive(
        &self,
        ids: Vec<DeadLetterId>,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> impl Future<Output = Result<Vec<JobId>, StoreError>> + Send {
        self.redrive_to(ids, Redirect::default(), now, audit)
    }

    /// [`Store::redrive`], sending the jobs to another type and/or lane
    /// (`to`; an empty [`Redirect`] keeps theirs): each job's type, lane
    /// and (with a new type) schema version change in the same
    /// transaction, and with `audit` its redrive is noted with where it
    /// was sent ([`Store::lineage`]). The caller admitted the payloads for
    /// the new type first.
    fn redrive_to(
        &self,
        ids: Vec<DeadLetterId>,
        to: Redirect,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> impl Future<Output = Result<Vec<JobId>, StoreError>> + Send;

    /// Redrives one processing dead letter with a corrected payload, in one
    /// transaction: the job's payload becomes `fix.payload`, its envelope
    /// keeps the payload it replaced with who, when and why
    /// (`lazaret_core::redrive_corrected`), the job re-enters `queued` with
    /// its id, idempotency key and history and a fresh budget, the dead
    /// letter leaves, and with `audit` that entry's count grows by one.
    /// `None` (nothing changed) when the dead letter is not there or holds
    /// no lazaret job (an admission record, a broker message).
    fn redrive_corrected(
        &self,
        id: DeadLetterId,
        fix: PayloadFix,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> impl Future<Output = Result<Option<JobId>, StoreError>> + Send;

    /// Deletes dead letters (and their jobs) for good; with `audit`, adds
    /// the number deleted to that entry's `count` in the same transaction.
    fn purge(
        &self,
        ids: Vec<DeadLetterId>,
        audit: Option<AuditId>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Archives (`archived: true`) or restores (`false`) dead letters: an
    /// archived one is kept, with its job, but leaves the default views
    /// (lists, groups, reasons, counts) until it is restored. Ids already
    /// in the asked state, or unknown, are left alone; the number changed
    /// is answered and, with `audit`, added to that entry's `count` in
    /// the same transaction.
    fn archive(
        &self,
        ids: Vec<DeadLetterId>,
        archived: bool,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// A page of failure groups (see [`GroupQuery`]), newest `last_at`
    /// first, and the cursor of the next page when there may be one.
    fn groups(
        &self,
        query: GroupQuery,
    ) -> impl Future<Output = Result<(Vec<FailureGroup>, Option<GroupCursor>), StoreError>> + Send;

    /// Records a redrive's id against its audit entry: the jobs a redrive
    /// with that entry moves ([`Store::redrive`], [`Store::redrive_corrected`])
    /// are then reported under the id ([`Store::redrive_report`]).
    fn record_redrive(
        &self,
        id: String,
        audit: AuditId,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Notes, before the redrive `redrive` republishes the broker dead
    /// letter `id`, the copy it is about to send, so that a guard source
    /// that handles the copy before the dead letter leaves
    /// ([`Store::redrove_message`]) finds the note and says how it ended.
    /// A note already there is kept as it is (with its outcome); a dead
    /// letter that is not there or is no broker message notes nothing.
    fn note_redrive_copy(
        &self,
        id: DeadLetterId,
        redrive: String,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// The republish of a copy noted by [`Store::note_redrive_copy`]
    /// failed: the note goes, unless the copy was seen back meanwhile (it
    /// did go out, then; its outcome stays).
    fn forget_redrive_copy(
        &self,
        id: DeadLetterId,
        redrive: String,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Notes a broker dead letter's copy that the redrive `redrive` has
    /// republished (the broker confirmed it), unless
    /// [`Store::note_redrive_copy`] noted it already, and removes the dead
    /// letter, in one transaction: the copy is then counted in that
    /// redrive's report (sent, until [`Store::redriven_message_succeeded`]
    /// or its dead letter again, [`Store::quarantine_messages`] with that
    /// redrive id, says how it ended), and with `audit` that entry's count
    /// grows by one. `false` (nothing changed) when the dead letter is not
    /// there or is no broker message.
    fn redrove_message(
        &self,
        id: DeadLetterId,
        redrive: String,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// A redriven broker message (`key.redrive_id` is `Some`) succeeded:
    /// drops the retry held for `key`, if any, and marks the redrive's copy
    /// of that message id succeeded, in one transaction. An unknown redrive
    /// or message changes nothing.
    fn redriven_message_succeeded(
        &self,
        key: MessageKey,
        now: Timestamp,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// What the redrive `id` did so far; `None` for an unknown id.
    fn redrive_report(
        &self,
        id: String,
    ) -> impl Future<Output = Result<Option<RedriveReport>, StoreError>> + Send;

    /// Every audited redrive of the job `job_id`, oldest first: who, when,
    /// from which group, with an edited payload or not, and where it was
    /// sent. Empty for an unknown job or one never redriven.
    fn lineage(
        &self,
        job_id: JobId,
    ) -> impl Future<Output = Result<Vec<LineageEntry>, StoreError>> + Send;

    /// The lineage of a broker message's dead letter: each redrive that
    /// republished the message it came from, oldest first, followed back
    /// through the dead letters its earlier copies became (never edited or
    /// redirected). Empty for a dead letter no redrive led to.
    fn message_lineage(
        &self,
        dead_letter: DeadLetterId,
    ) -> impl Future<Output = Result<Vec<LineageEntry>, StoreError>> + Send;

    /// Appends to the audit log; the new entry's id.
    fn audit(&self, entry: AuditEntry) -> impl Future<Output = Result<AuditId, StoreError>> + Send;

    /// A page of the audit log, newest first, and the cursor of the next
    /// (older) page when there may be one.
    fn audit_page(
        &self,
        query: AuditQuery,
    ) -> impl Future<Output = Result<AuditPage, StoreError>> + Send;

    /// The newest audit entries.
    fn audit_log(
        &self,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<AuditEntry>, StoreError>> + Send {
        async move {
            let (page, _) = self
                .audit_page(AuditQuery {
                    limit,
                    ..AuditQuery::default()
                })
                .await?;
            Ok(page.into_iter().map(|(_, e)| e).collect())
        }
    }

    /// Counters for stats and metrics.
    fn stats(&self) -> impl Future<Output = Result<StoreStats, StoreError>> + Send;

    /// Samples the charts' signals (`lazaret_core::series`) at `now`: the
    /// minute `now` is in gets the gauges as of now and the counts so far,
    /// the minute before its whole counts (never lowered), and samples of
    /// minutes before `keep_after` are deleted, in one transaction. The
    /// values are read from rows every node shares (on a reader, not the
    /// writer), so any node samples the same minute alike. Returns the
    /// rows written.
    fn sample_signals(
        &self,
        now: Timestamp,
        keep_after: Timestamp,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The samples of the minutes in `[from, to)`, and which of them were
    /// sampled.
    fn signal_samples(
        &self,
        from: Timestamp,
        to: Timestamp,
    ) -> impl Future<Output = Result<SignalSamples, StoreError>> + Send;

    /// Deletes up to `batch` succeeded jobs, and up to `batch` cancelled
    /// ones, finished before `before`.
    fn remove_succeeded(
        &self,
        before: Timestamp,
        batch: u32,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// Stores a token created through the API and, in the same transaction,
    /// its audit entry. A taken name or secret is refused and nothing is
    /// written. Names of config-file tokens are the caller's to check: the
    /// store knows only API tokens.
    fn create_token(
        &self,
        token: ApiToken,
        audit: AuditEntry,
    ) -> impl Future<Output = Result<Result<(), TokenError>, StoreError>> + Send;

    /// Deletes the API token `name` and, in the same transaction, writes its
    /// audit entry; `false` (and no audit entry) when there is none.
    fn revoke_token(
        &self,
        name: String,
        audit: AuditEntry,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// Quarantines a broker message: writes its dead letter unless one of
    /// the same [`MessageKey`] (source, message id, payload SHA-256,
    /// redrive id) is there already, and drops the retry held for that
    /// key, in one transaction. The caller acknowledges the broker message only
    /// after this returns.
    fn quarantine_message(
        &self,
        dl: SourceDeadLetter,
    ) -> impl Future<Output = Result<Quarantined, StoreError>> + Send;

    /// Quarantines several broker messages in one transaction, answered
    /// once that is durable (one fsync for all of them), each as
    /// [`Store::quarantine_message`] would; in the order given.
    fn quarantine_messages(
        &self,
        dls: Vec<SourceDeadLetter>,
    ) -> impl Future<Output = Result<Vec<Quarantined>, StoreError>> + Send;

    /// Holds a broker message's retry or deferral until `due_at` (replacing
    /// the one held for the same [`MessageKey`]: source, message id, payload
    /// SHA-256, redrive id; another body under the same id is held beside
    /// it). The caller acknowledges the broker message only after this
    /// returns.
    fn hold_retry(&self, p: HeldRetry) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Drops the retry held for `key` (it succeeded); whether one was held.
    fn release_held_retry(
        &self,
        key: MessageKey,
    ) -> impl Future<Output = Result<bool, StoreError>> + Send;

    /// The held retries of a source that are due at `now`, earliest first.
    fn due_held_retries(
        &self,
        source: String,
        now: Timestamp,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<HeldRetry>, StoreError>> + Send;

    /// Claims up to `limit` held retries of a source that are due at `now`
    /// and not claimed (or whose claim expired), earliest first, for
    /// `claimer` until `expires_at`: a claimed retry is given to no other
    /// caller (of this store or of another on the same database) until its
    /// claim expires, so a retry is delivered by one node at a time. The
    /// outcome's write clears the claim ([`Store::release_held_retry`],
    /// [`Store::hold_retry`] or a quarantine of its key); a caller that
    /// dies holding claims gives them back when they expire, and the
    /// next claim of such a retry names it ([`ClaimedRetry::lapsed_claim`]).
    /// Taken with `FOR UPDATE SKIP LOCKED` on PostgreSQL, by the single
    /// writer on SQLite.
    fn claim_held_retries(
        &self,
        source: String,
        now: Timestamp,
        limit: u32,
        claimer: String,
        expires_at: Timestamp,
    ) -> impl Future<Output = Result<Vec<ClaimedRetry>, StoreError>> + Send;

    /// The retry held for one message (its envelope, due time and where
    /// it is), if any: for brokers whose retries wait on the broker itself
    /// (SQS FIFO), the record of what lazaret charged.
    fn held_retry(
        &self,
        key: MessageKey,
    ) -> impl Future<Output = Result<Option<HeldRetry>, StoreError>> + Send;

    /// When the next held retry of a source is due.
    fn next_held_retry_due(
        &self,
        source: String,
    ) -> impl Future<Output = Result<Option<Timestamp>, StoreError>> + Send;

    /// What the store holds of a broker message already (a redelivery after
    /// a crash between a write and the broker acknowledgement): a dead
    /// letter of the same key (another body, or a redriven copy, is not
    /// it), else a retry held for the same key.
    fn message_held(
        &self,
        key: MessageKey,
    ) -> impl Future<Output = Result<Held, StoreError>> + Send;

    /// Every API token, oldest first.
    fn tokens(&self) -> impl Future<Output = Result<Vec<ApiToken>, StoreError>> + Send;

    /// Whether an enqueue of one job, once its future has been polled
    /// once, runs before any lease sent after that poll: then a caller may
    /// wake the job's long-polls right after that first poll instead of
    /// after the enqueue's answer, which waits for the disk. `false` by
    /// default (the caller wakes them after the answer).
    fn orders_one_job_commands(&self) -> bool {
        false
    }

    /// Why the store takes no more writes, once it has failed for good (a
    /// commit that could not be made durable); `None` while healthy.
    /// `/healthz` reports it.
    fn failure(&self) -> Option<String> {
        None
    }

    /// Changes other nodes on the same store made, as they commit: jobs
    /// that became leasable, token changes, shared switches. `None` for a
    /// store no other process writes to (SQLite: one process per data
    /// directory), where every change is this process's own.
    fn events(&self) -> Option<tokio::sync::broadcast::Receiver<StoreEvent>> {
        None
    }

    /// Shares a switch (a pause, a resume, an open breaker) with every node
    /// on this store, and keeps it for nodes that start later
    /// ([`Store::switches`]). A store of one process keeps nothing.
    fn publish(&self, switch: Switch) -> impl Future<Output = Result<(), StoreError>> + Send {
        let _ = switch;
        async { Ok(()) }
    }

    /// The switches in force, for a node that starts: pauses, and
    /// breakers opened until a time still to come.
    fn switches(&self) -> impl Future<Output = Result<Vec<Switch>, StoreError>> + Send {
        async { Ok(Vec::new()) }
    }

    /// Whether this node does `duty` for the cluster now: at most one node
    /// of a cluster gets `true` for a duty at a time, and when it stops
    /// (or dies, or loses the database) another one's next call gets it.
    /// Call it before each round of the duty. A store of one process
    /// (SQLite) always leads.
    fn lead(&self, duty: Duty) -> impl Future<Output = Result<bool, StoreError>> + Send {
        let _ = duty;
        async { Ok(true) }
    }

    /// Flushes and closes; later calls fail with [`StoreError::Closed`].
    fn close(&self) -> impl Future<Output = Result<(), StoreError>> + Send;
}
