//! The one request language of the writers: every write operation of the
//! [`Store`](crate::Store) is one [`Request`] variant, carrying its
//! arguments and a [`Reply`] typed for its answer. The generic store
//! (`crate::backend`) builds a request, hands it to its backend's writer
//! ([`Backend::submit`](crate::backend::Backend::submit)) and awaits the
//! answer; each backend's writer runs it (`sqlite/writer`,
//! `postgres/writer`, one file per concern) and answers through the reply.
//!
//! Adding a write operation: the trait method, one variant here (and its
//! arm in [`Request::reply`]), one function per backend in the writer file
//! named for its concern, and the conformance case.

use std::sync::Mutex;

use lazaret_core::{JobId, Timestamp};
use tokio::sync::oneshot;

use crate::{
    AdmissionRecord, ApiToken, AuditEntry, AuditId, CancelError, Cancelled, ClaimedRetry,
    Completed, Completion, DeadLetterId, EnqueueOutcome, Heartbeat, HeldRetry, ItemError,
    LeaseRequest, LeaseToken, LeasedJob, MessageKey, NewJob, PauseTarget, PayloadFix, Quarantined,
    SourceDeadLetter, StoreError, StoreStats, Tick, TokenError,
};

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

/// One write operation of the [`Store`](crate::Store), with its arguments
/// (named as the trait names them) and its reply.
// One request per call, moved once into the channel: boxing the large ones
// would cost an allocation each and save nothing that matters.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Request {
    Enqueue {
        jobs: Vec<NewJob>,
        reply: Reply<Vec<EnqueueOutcome>>,
    },
    Lease {
        req: LeaseRequest,
        reply: Reply<Vec<LeasedJob>>,
    },
    Complete {
        items: Vec<Completion>,
        now: Timestamp,
        reply: Reply<Vec<Result<Completed, ItemError>>>,
    },
    Heartbeat {
        id: JobId,
        token: LeaseToken,
        expires_at: Timestamp,
        now: Timestamp,
        reply: Reply<Result<Heartbeat, ItemError>>,
    },
    Cancel {
        id: JobId,
        now: Timestamp,
        audit: AuditEntry,
        reply: Reply<Result<Cancelled, CancelError>>,
    },
    SetPause {
        target: PauseTarget,
        paused: bool,
        audit: AuditEntry,
        reply: Reply<bool>,
    },
    Tick {
        now: Timestamp,
        reply: Reply<Tick>,
    },
    RecordAdmission {
        rec: AdmissionRecord,
        reply: Reply<DeadLetterId>,
    },
    Redrive {
        ids: Vec<DeadLetterId>,
        to: crate::Redirect,
        now: Timestamp,
        audit: Option<AuditId>,
        reply: Reply<Vec<JobId>>,
    },
    RedriveCorrected {
        id: DeadLetterId,
        fix: PayloadFix,
        now: Timestamp,
        audit: Option<AuditId>,
        reply: Reply<Option<JobId>>,
    },
    Purge {
        ids: Vec<DeadLetterId>,
        audit: Option<AuditId>,
        reply: Reply<u64>,
    },
    Archive {
        ids: Vec<DeadLetterId>,
        archived: bool,
        now: Timestamp,
        audit: Option<AuditId>,
        reply: Reply<u64>,
    },
    Audit {
        entry: AuditEntry,
        reply: Reply<AuditId>,
    },
    RecordRedrive {
        id: String,
        audit: AuditId,
        reply: Reply<()>,
    },
    RedroveMessage {
        id: DeadLetterId,
        redrive: String,
        now: Timestamp,
        audit: Option<AuditId>,
        reply: Reply<bool>,
    },
    RedrivenMessageSucceeded {
        key: Box<MessageKey>,
        now: Timestamp,
        reply: Reply<()>,
    },
    Stats {
        reply: Reply<StoreStats>,
    },
    RemoveSucceeded {
        before: Timestamp,
        batch: u32,
        reply: Reply<u64>,
    },
    CreateToken {
        token: ApiToken,
        audit: AuditEntry,
        reply: Reply<Result<(), TokenError>>,
    },
    RevokeToken {
        name: String,
        audit: AuditEntry,
        reply: Reply<bool>,
    },
    /// One or several broker messages (`quarantine_message` sends one).
    Quarantine {
        dls: Vec<SourceDeadLetter>,
        reply: Reply<Vec<Quarantined>>,
    },
    HoldRetry {
        p: Box<HeldRetry>,
        reply: Reply<()>,
    },
    ReleaseHeldRetry {
        key: Box<MessageKey>,
        reply: Reply<bool>,
    },
    /// Run by SQLite's writer; PostgreSQL claims on a reader connection
    /// (`FOR UPDATE SKIP LOCKED`) and never sends it.
    ClaimDue {
        claim: Box<Claim>,
        reply: Reply<Vec<ClaimedRetry>>,
    },
}

impl Request {
    /// Its reply, whatever the answer's type.
    pub(crate) fn reply(&self) -> &dyn AnyReply {
        match self {
            Request::Enqueue { reply, .. } => reply,
            Request::Lease { reply, .. } => reply,
            Request::Complete { reply, .. } => reply,
            Request::Heartbeat { reply, .. } => reply,
            Request::Cancel { reply, .. } => reply,
            Request::SetPause { reply, .. } => reply,
            Request::Tick { reply, .. } => reply,
            Request::RecordAdmission { reply, .. } => reply,
            Request::Redrive { reply, .. } => reply,
            Request::RedriveCorrected { reply, .. } => reply,
            Request::Purge { reply, .. } => reply,
            Request::Archive { reply, .. } => reply,
            Request::Audit { reply, .. } => reply,
            Request::RecordRedrive { reply, .. } => reply,
            Request::RedroveMessage { reply, .. } => reply,
            Request::RedrivenMessageSucceeded { reply, .. } => reply,
            Request::Stats { reply } => reply,
            Request::RemoveSucceeded { reply, .. } => reply,
            Request::CreateToken { reply, .. } => reply,
            Request::RevokeToken { reply, .. } => reply,
            Request::Quarantine { reply, .. } => reply,
            Request::HoldRetry { reply, .. } => reply,
            Request::ReleaseHeldRetry { reply, .. } => reply,
            Request::ClaimDue { reply, .. } => reply,
        }
    }

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
