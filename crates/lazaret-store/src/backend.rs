//! The seam between the [`Store`] and a database, after River's driver
//! split: one generic `impl Store` ([`StoreOn`]) over a small [`Backend`]
//! trait that each database implements (`sqlite::Sqlite`,
//! `postgres::Postgres`).
//!
//! Every write method of the [`Store`] is written once, here: it builds its
//! [`Request`], hands it to the backend's writer ([`Backend::submit`]) and
//! awaits the typed answer. Reads, and what only one backend does (its
//! close, PostgreSQL's events, switches, leadership and tick throttle),
//! are the backend's own methods, forwarded.

use std::future::Future;

use lazaret_core::{JobId, Timestamp};

use crate::request::{Claim, Reply, Request};
use crate::{
    AdmissionRecord, ApiToken, AuditEntry, AuditId, AuditPage, AuditQuery, CancelError, Cancelled,
    ClaimedRetry, Completed, Completion, DeadLetter, DeadLetterFilter, DeadLetterId, Duty,
    EnqueueOutcome, FailureGroup, GroupCursor, GroupQuery, Heartbeat, Held, HeldRetry, ItemError,
    JobPage, JobQuery, JobView, LeaseRequest, LeaseToken, LeasedJob, MessageKey, NewJob, Pause,
    PauseTarget, PayloadFix, Quarantined, ReasonCount, RecentDeadLetter, Selector,
    SourceDeadLetter, Stage, Store, StoreError, StoreEvent, StoreStats, Switch, Tick, TokenError,
};

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

    fn jobs(&self, query: JobQuery) -> impl Future<Output = Result<JobPage, StoreError>> + Send;
    fn pauses(&self) -> impl Future<Output = Result<Vec<Pause>, StoreError>> + Send;
    fn job(&self, id: JobId) -> impl Future<Output = Result<Option<JobView>, StoreError>> + Send;
    fn dead_letters(
        &self,
        filter: DeadLetterFilter,
        limit: u32,
        cursor: Option<DeadLetterId>,
    ) -> impl Future<Output = Result<(Vec<DeadLetter>, Option<DeadLetterId>), StoreError>> + Send;
    fn dead_letter(
        &self,
        id: DeadLetterId,
    ) -> impl Future<Output = Result<Option<DeadLetter>, StoreError>> + Send;
    fn dead_letter_payload(
        &self,
        id: DeadLetterId,
    ) -> impl Future<Output = Result<Option<Option<Vec<u8>>>, StoreError>> + Send;
    fn reasons(&self) -> impl Future<Output = Result<Vec<ReasonCount>, StoreError>> + Send;
    fn redrive_report(
        &self,
        id: String,
    ) -> impl Future<Output = Result<Option<crate::RedriveReport>, StoreError>> + Send;
    fn lineage(
        &self,
        job_id: JobId,
    ) -> impl Future<Output = Result<Vec<crate::LineageEntry>, StoreError>> + Send;
    fn message_lineage(
        &self,
        dead_letter: DeadLetterId,
    ) -> impl Future<Output = Result<Vec<crate::LineageEntry>, StoreError>> + Send;
    fn groups(
        &self,
        query: GroupQuery,
    ) -> impl Future<Output = Result<(Vec<FailureGroup>, Option<GroupCursor>), StoreError>> + Send;
    fn dead_letters_after(
        &self,
        after: DeadLetterId,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<RecentDeadLetter>, StoreError>> + Send;
    fn match_dead_letters(
        &self,
        selector: Selector,
    ) -> impl Future<Output = Result<Vec<(DeadLetterId, Stage)>, StoreError>> + Send;
    fn audit_page(
        &self,
        query: AuditQuery,
    ) -> impl Future<Output = Result<AuditPage, StoreError>> + Send;
    fn due_held_retries(
        &self,
        source: String,
        now: Timestamp,
        limit: u32,
    ) -> impl Future<Output = Result<Vec<HeldRetry>, StoreError>> + Send;
    fn held_retry(
        &self,
        key: MessageKey,
    ) -> impl Future<Output = Result<Option<HeldRetry>, StoreError>> + Send;
    fn next_held_retry_due(
        &self,
        source: String,
    ) -> impl Future<Output = Result<Option<Timestamp>, StoreError>> + Send;
    fn message_held(
        &self,
        key: MessageKey,
    ) -> impl Future<Output = Result<Held, StoreError>> + Send;
    fn tokens(&self) -> impl Future<Output = Result<Vec<ApiToken>, StoreError>> + Send;
    /// What a sampling of the charts' signals reads (`crate::signals`), on
    /// a reader.
    fn signal_readings(
        &self,
        now: Timestamp,
    ) -> impl Future<Output = Result<crate::signals::Readings, StoreError>> + Send;
    fn signal_samples(
        &self,
        from: Timestamp,
        to: Timestamp,
    ) -> impl Future<Output = Result<crate::SignalSamples, StoreError>> + Send;

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

impl<B: Backend> Store for StoreOn<B> {
    async fn enqueue(&self, jobs: Vec<NewJob>) -> Result<Vec<EnqueueOutcome>, StoreError> {
        call(&self.backend, |reply| Request::Enqueue { jobs, reply }).await
    }

    async fn lease(&self, req: LeaseRequest) -> Result<Vec<LeasedJob>, StoreError> {
        call(&self.backend, |reply| Request::Lease { req, reply }).await
    }

    async fn complete(
        &self,
        items: Vec<Completion>,
        now: Timestamp,
    ) -> Result<Vec<Result<Completed, ItemError>>, StoreError> {
        call(&self.backend, |reply| Request::Complete {
            items,
            now,
            reply,
        })
        .await
    }

    async fn heartbeat(
        &self,
        id: JobId,
        token: LeaseToken,
        expires_at: Timestamp,
        now: Timestamp,
    ) -> Result<Result<Heartbeat, ItemError>, StoreError> {
        call(&self.backend, |reply| Request::Heartbeat {
            id,
            token,
            expires_at,
            now,
            reply,
        })
        .await
    }

    async fn cancel(
        &self,
        id: JobId,
        now: Timestamp,
        audit: AuditEntry,
    ) -> Result<Result<Cancelled, CancelError>, StoreError> {
        call(&self.backend, |reply| Request::Cancel {
            id,
            now,
            audit,
            reply,
        })
        .await
    }

    async fn jobs(&self, query: JobQuery) -> Result<JobPage, StoreError> {
        self.backend.jobs(query).await
    }

    async fn set_pause(
        &self,
        target: PauseTarget,
        paused: bool,
        audit: AuditEntry,
    ) -> Result<bool, StoreError> {
        call(&self.backend, |reply| Request::SetPause {
            target,
            paused,
            audit,
            reply,
        })
        .await
    }

    async fn pauses(&self) -> Result<Vec<Pause>, StoreError> {
        self.backend.pauses().await
    }

    async fn tick(&self, now: Timestamp) -> Result<Tick, StoreError> {
        if let Some(t) = self.backend.tick_skip(now) {
            return Ok(t);
        }
        let t = call(&self.backend, |reply| Request::Tick { now, reply }).await?;
        self.backend.ticked(now, &t);
        Ok(t)
    }

    async fn record_admission(&self, rec: AdmissionRecord) -> Result<DeadLetterId, StoreError> {
        call(&self.backend, |reply| Request::RecordAdmission {
            rec,
            reply,
        })
        .await
    }

    async fn job(&self, id: JobId) -> Result<Option<JobView>, StoreError> {
        self.backend.job(id).await
    }

    async fn dead_letters(
        &self,
        filter: DeadLetterFilter,
        limit: u32,
        cursor: Option<DeadLetterId>,
    ) -> Result<(Vec<DeadLetter>, Option<DeadLetterId>), StoreError> {
        self.backend.dead_letters(filter, limit, cursor).await
    }

    async fn dead_letter(&self, id: DeadLetterId) -> Result<Option<DeadLetter>, StoreError> {
        self.backend.dead_letter(id).await
    }

    async fn dead_letter_payload(
        &self,
        id: DeadLetterId,
    ) -> Result<Option<Option<Vec<u8>>>, StoreError> {
        self.backend.dead_letter_payload(id).await
    }

    async fn reasons(&self) -> Result<Vec<ReasonCount>, StoreError> {
        self.backend.reasons().await
    }

    async fn dead_letters_after(
        &self,
        after: DeadLetterId,
        limit: u32,
    ) -> Result<Vec<RecentDeadLetter>, StoreError> {
        self.backend.dead_letters_after(after, limit).await
    }

    async fn match_dead_letters(
        &self,
        selector: Selector,
    ) -> Result<Vec<(DeadLetterId, Stage)>, StoreError> {
        self.backend.match_dead_letters(selector).await
    }

    async fn redrive_to(
        &self,
        ids: Vec<DeadLetterId>,
        to: crate::Redirect,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> Result<Vec<JobId>, StoreError> {
        call(&self.backend, |reply| Request::Redrive {
            ids,
            to,
            now,
            audit,
            reply,
        })
        .await
    }

    async fn redrive_corrected(
        &self,
        id: DeadLetterId,
        fix: PayloadFix,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> Result<Option<JobId>, StoreError> {
        call(&self.backend, |reply| Request::RedriveCorrected {
            id,
            fix,
            now,
            audit,
            reply,
        })
        .await
    }

    async fn purge(
        &self,
        ids: Vec<DeadLetterId>,
        audit: Option<AuditId>,
    ) -> Result<u64, StoreError> {
        call(&self.backend, |reply| Request::Purge { ids, audit, reply }).await
    }

    async fn archive(
        &self,
        ids: Vec<DeadLetterId>,
        archived: bool,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> Result<u64, StoreError> {
        call(&self.backend, |reply| Request::Archive {
            ids,
            archived,
            now,
            audit,
            reply,
        })
        .await
    }

    async fn groups(
        &self,
        query: GroupQuery,
    ) -> Result<(Vec<FailureGroup>, Option<GroupCursor>), StoreError> {
        self.backend.groups(query).await
    }

    async fn record_redrive(&self, id: String, audit: AuditId) -> Result<(), StoreError> {
        call(&self.backend, |reply| Request::RecordRedrive {
            id,
            audit,
            reply,
        })
        .await
    }

    async fn redrove_message(
        &self,
        id: DeadLetterId,
        redrive: String,
        now: Timestamp,
        audit: Option<AuditId>,
    ) -> Result<bool, StoreError> {
        call(&self.backend, |reply| Request::RedroveMessage {
            id,
            redrive,
            now,
            audit,
            reply,
        })
        .await
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

    async fn redrive_report(&self, id: String) -> Result<Option<crate::RedriveReport>, StoreError> {
        self.backend.redrive_report(id).await
    }

    async fn lineage(&self, job_id: JobId) -> Result<Vec<crate::LineageEntry>, StoreError> {
        self.backend.lineage(job_id).await
    }

    async fn message_lineage(
        &self,
        dead_letter: DeadLetterId,
    ) -> Result<Vec<crate::LineageEntry>, StoreError> {
        self.backend.message_lineage(dead_letter).await
    }

    async fn audit(&self, entry: AuditEntry) -> Result<AuditId, StoreError> {
        call(&self.backend, |reply| Request::Audit { entry, reply }).await
    }

    async fn audit_page(&self, query: AuditQuery) -> Result<AuditPage, StoreError> {
        self.backend.audit_page(query).await
    }

    async fn stats(&self) -> Result<StoreStats, StoreError> {
        call(&self.backend, |reply| Request::Stats { reply }).await
    }

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

    async fn signal_samples(
        &self,
        from: Timestamp,
        to: Timestamp,
    ) -> Result<crate::SignalSamples, StoreError> {
        self.backend.signal_samples(from, to).await
    }

    async fn remove_succeeded(&self, before: Timestamp, batch: u32) -> Result<u64, StoreError> {
        call(&self.backend, |reply| Request::RemoveSucceeded {
            before,
            batch,
            reply,
        })
        .await
    }

    async fn create_token(
        &self,
        token: ApiToken,
        audit: AuditEntry,
    ) -> Result<Result<(), TokenError>, StoreError> {
        call(&self.backend, |reply| Request::CreateToken {
            token,
            audit,
            reply,
        })
        .await
    }

    async fn revoke_token(&self, name: String, audit: AuditEntry) -> Result<bool, StoreError> {
        call(&self.backend, |reply| Request::RevokeToken {
            name,
            audit,
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

    async fn due_held_retries(
        &self,
        source: String,
        now: Timestamp,
        limit: u32,
    ) -> Result<Vec<HeldRetry>, StoreError> {
        self.backend.due_held_retries(source, now, limit).await
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

    async fn held_retry(&self, key: MessageKey) -> Result<Option<HeldRetry>, StoreError> {
        self.backend.held_retry(key).await
    }

    async fn next_held_retry_due(&self, source: String) -> Result<Option<Timestamp>, StoreError> {
        self.backend.next_held_retry_due(source).await
    }

    async fn message_held(&self, key: MessageKey) -> Result<Held, StoreError> {
        self.backend.message_held(key).await
    }

    async fn tokens(&self) -> Result<Vec<ApiToken>, StoreError> {
        self.backend.tokens().await
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
