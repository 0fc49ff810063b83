//! The one request language of the writers: every write operation of the
//! [`Store`](crate::Store) is one [`Request`] variant, carrying its
//! arguments and a [`Reply`] typed for its answer. The generic store
//! (`crate::backend`) builds a request, hands it to its backend's writer
//! ([`Backend::submit`](crate::backend::Backend::submit)) and awaits the
//! answer; each backend's writer runs it (`sqlite/writer`,
//! `postgres/writer`, one file per concern) and answers through the reply.
//!
//! Adding a write operation: the trait method, one line in the table
//! [`with_requests`], one function per backend in the writer file named for
//! its concern, and the conformance case.

use std::sync::Mutex;

use lazaret_core::Timestamp;
use tokio::sync::oneshot;

use crate::StoreError;

/// Where a request's answer goes: a one-shot sender typed for it, that a
/// writer may answer through a shared reference (PostgreSQL's writer runs a
/// group's requests by reference and may run them again one by one).
pub(crate) struct Reply<T>(Mutex<Answer<T>>);

struct Answer<T> {
    tx: Option<oneshot::Sender<Result<T, StoreError>>>,
    /// Set by `crate::faulty`: the request is applied, but its caller is
    /// answered with this error instead (an answer lost on the way).
    lost: Option<Box<str>>,
}

impl<T> Reply<T> {
    /// A reply and the receiver its answer arrives on.
    pub(crate) fn new() -> (Self, oneshot::Receiver<Result<T, StoreError>>) {
        let (tx, rx) = oneshot::channel();
        (
            Reply(Mutex::new(Answer {
                tx: Some(tx),
                lost: None,
            })),
            rx,
        )
    }

    /// Answers (the first answer counts; later ones are dropped).
    pub(crate) fn send(&self, r: Result<T, StoreError>) {
        let mut a = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let r = match &a.lost {
            Some(why) => Err(StoreError::Db(crate::DbError::new(why.to_string()))),
            None => r,
        };
        if let Some(tx) = a.tx.take() {
            let _ = tx.send(r);
        }
    }

    /// Moves the answer's way out of this reply into a reply of its own,
    /// to be answered later from elsewhere (PostgreSQL's writer hands the
    /// answers of a committed group to the task that waits for its flush);
    /// this one answers nothing after.
    pub(crate) fn detach(&self) -> Reply<T> {
        let mut a = self.0.lock().unwrap_or_else(|p| p.into_inner());
        Reply(Mutex::new(Answer {
            tx: a.tx.take(),
            lost: a.lost.take(),
        }))
    }
}

/// What every reply can do whatever its answer's type.
pub(crate) trait AnyReply {
    /// Answers with an error.
    fn fail(&self, e: StoreError);
    /// Makes the answer `why` (as a [`StoreError::Db`], like a connection
    /// lost at COMMIT), whatever the writer answers.
    fn lose(&self, why: String);
}

impl<T> AnyReply for Reply<T> {
    fn fail(&self, e: StoreError) {
        self.send(Err(e));
    }

    fn lose(&self, why: String) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).lost = Some(why.into());
    }
}

/// A claim of due held retries ([`crate::Store::claim_held_retries`]).
pub(crate) struct Claim {
    pub source: String,
    pub now: Timestamp,
    pub limit: u32,
    pub claimer: String,
    pub expires_at: Timestamp,
}

/// The table of the store's write requests: every write operation of the
/// [`Store`](crate::Store) is one line, and everything that routes it is
/// generated from that line. A line reads
///
/// ```text
/// forward SetPause: set_pause(target: PauseTarget, paused: bool, audit: AuditEntry) -> bool;
/// ```
///
/// that is: how `StoreOn` answers it (`forward`: a generated
/// [`Store`](crate::Store) method of the same name that sends the request
/// and awaits its reply; `by_hand`: the method is written by hand in
/// `crate::backend`, for a skip, a box or an empty batch), the
/// [`Request`] variant, the function name, the arguments and the answer.
///
/// `with_requests!(then)` calls the macro `then!` with the whole table, and
/// each place that needs one arm per request writes such a macro over the
/// lines, once:
/// - here, `requests_enum!`: the [`Request`] variant
///   (`SetPause { target, paused, audit, reply: Reply<bool> }`) and its
///   arm in [`Request::reply`];
/// - `crate::backend`, `forward_requests!`: the `forward` methods of
///   `impl Store for StoreOn<B>`;
/// - `sqlite/writer/requests.rs`: `Writer::run_request`, which calls
///   `self.set_pause(target, paused, audit)` with the arguments by value;
/// - `postgres/writer/requests.rs`: `Writer::run_request`, which calls
///   `self.set_pause(target, paused, audit, clock).await` with the
///   arguments by reference and the group's clock.
///
/// So adding a write operation is: the trait method, one line here, in each
/// backend one writer function of that name in the file named for its
/// concern, and the conformance case. A backend without the function does
/// not compile. Types are written with `crate::` paths, since the table is
/// expanded in several modules.
macro_rules! with_requests {
    ($then:ident) => {
        $then! {
            forward Enqueue: enqueue(jobs: Vec<crate::NewJob>) -> Vec<crate::EnqueueOutcome>;
            forward Lease: lease(req: crate::LeaseRequest) -> Vec<crate::LeasedJob>;
            forward Complete: complete(items: Vec<crate::Completion>, now: lazaret_core::Timestamp)
                -> Vec<Result<crate::Completed, crate::ItemError>>;
            forward Heartbeat: heartbeat(
                id: lazaret_core::JobId,
                token: crate::LeaseToken,
                expires_at: lazaret_core::Timestamp,
                now: lazaret_core::Timestamp
            ) -> Result<crate::Heartbeat, crate::ItemError>;
            forward Cancel: cancel(id: lazaret_core::JobId, now: lazaret_core::Timestamp, audit: crate::AuditEntry)
                -> Result<crate::Cancelled, crate::CancelError>;
            forward SetPause: set_pause(target: crate::PauseTarget, paused: bool, audit: crate::AuditEntry) -> bool;
            /// `StoreOn::tick` skips a tick that comes too soon (`Backend::tick_skip`).
            by_hand Tick: tick(now: lazaret_core::Timestamp) -> crate::Tick;
            forward RecordAdmission: record_admission(rec: crate::AdmissionRecord) -> crate::DeadLetterId;
            forward Redrive: redrive_to(
                ids: Vec<crate::DeadLetterId>,
                to: crate::Redirect,
                now: lazaret_core::Timestamp,
                audit: Option<crate::AuditId>
            ) -> Vec<lazaret_core::JobId>;
            forward RedriveCorrected: redrive_corrected(
                id: crate::DeadLetterId,
                fix: crate::PayloadFix,
                now: lazaret_core::Timestamp,
                audit: Option<crate::AuditId>
            ) -> Option<lazaret_core::JobId>;
            forward Purge: purge(ids: Vec<crate::DeadLetterId>, audit: Option<crate::AuditId>) -> u64;
            forward Archive: archive(
                ids: Vec<crate::DeadLetterId>,
                archived: bool,
                now: lazaret_core::Timestamp,
                audit: Option<crate::AuditId>
            ) -> u64;
            forward Audit: audit(entry: crate::AuditEntry) -> crate::AuditId;
            forward RecordRedrive: record_redrive(id: String, audit: crate::AuditId) -> ();
            forward NoteRedriveCopy: note_redrive_copy(
                id: crate::DeadLetterId,
                redrive: String,
                now: lazaret_core::Timestamp
            ) -> ();
            forward ForgetRedriveCopy: forget_redrive_copy(id: crate::DeadLetterId, redrive: String) -> ();
            forward RedroveMessage: redrove_message(
                id: crate::DeadLetterId,
                redrive: String,
                now: lazaret_core::Timestamp,
                audit: Option<crate::AuditId>
            ) -> bool;
            /// Boxed, to keep every request small.
            by_hand RedrivenMessageSucceeded: redriven_message_succeeded(
                key: Box<crate::MessageKey>,
                now: lazaret_core::Timestamp
            ) -> ();
            forward Stats: stats() -> crate::StoreStats;
            /// `StoreOn::sample_signals` reads the samples on a reader first.
            by_hand WriteSignals: write_signals(
                minute: lazaret_core::Timestamp,
                rows: Vec<lazaret_core::series::Sample>,
                keep_after: lazaret_core::Timestamp
            ) -> u64;
            forward RemoveSucceeded: remove_succeeded(before: lazaret_core::Timestamp, batch: u32) -> u64;
            forward CreateToken: create_token(token: crate::ApiToken, audit: crate::AuditEntry)
                -> Result<(), crate::TokenError>;
            forward RevokeToken: revoke_token(name: String, audit: crate::AuditEntry) -> bool;
            /// One or several broker messages (`quarantine_message` sends one;
            /// `quarantine_messages` sends none for none).
            by_hand Quarantine: quarantine(dls: Vec<crate::SourceDeadLetter>) -> Vec<crate::Quarantined>;
            /// Boxed, to keep every request small.
            by_hand HoldRetry: hold_retry(p: Box<crate::HeldRetry>) -> ();
            /// Boxed, to keep every request small.
            by_hand ReleaseHeldRetry: release_held_retry(key: Box<crate::MessageKey>) -> bool;
            /// Run by SQLite's writer; PostgreSQL claims on a reader connection
            /// (`FOR UPDATE SKIP LOCKED`), and its writer refuses it.
            by_hand ClaimDue: claim_due(claim: Box<crate::request::Claim>) -> Vec<crate::ClaimedRetry>;
        }
    };
}
pub(crate) use with_requests;

/// The [`Request`] enum and [`Request::reply`], from the table.
macro_rules! requests_enum {
    ($(
        $(#[$doc:meta])*
        $how:ident $variant:ident: $method:ident($($arg:ident: $ty:ty),* $(,)?) -> $answer:ty;
    )*) => {
        /// One write operation of the [`Store`](crate::Store), with its
        /// arguments (named as the trait names them) and its reply: see
        /// [`with_requests`].
        // One request per call, moved once into the channel: boxing the large ones
        // would cost an allocation each and save nothing that matters.
        #[allow(clippy::large_enum_variant)]
        pub(crate) enum Request {
            $(
                $(#[$doc])*
                $variant { $($arg: $ty,)* reply: Reply<$answer> },
            )*
        }

        impl Request {
            /// Its reply, whatever the answer's type.
            pub(crate) fn reply(&self) -> &dyn AnyReply {
                match self {
                    $(Request::$variant { reply, .. } => reply,)*
                }
            }
        }
    };
}
with_requests!(requests_enum);

impl Request {
    /// Answers a request that was not applied: `StoreError::NotApplied`, for `why`.
    pub(crate) fn fail(&self, why: &str) {
        self.reply().fail(StoreError::NotApplied(why.to_owned()));
    }

    /// Housekeeping (promotions and expiries, retention): never refused
    /// for a full queue, since it must run however busy the store is.
    pub(crate) fn is_housekeeping(&self) -> bool {
        matches!(self, Request::Tick { .. } | Request::RemoveSucceeded { .. })
    }

    /// This request, applied as usual, but answered with `why` (an error)
    /// whatever its outcome: what a caller sees when the answer to a
    /// committed change is lost (`crate::faulty`).
    pub(crate) fn lose_answer(self, why: String) -> Self {
        self.reply().lose(why);
        self
    }
}
