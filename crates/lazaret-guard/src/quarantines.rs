//! The dead-letter batching of guard mode: a poison message's quarantine
//! must be durable before its acknowledgement, so the guard writes dead
//! letters together (group commit), lingering for company in a storm.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use lazaret_store::{Quarantined, SourceDeadLetter, Store, StoreError};
use tokio::sync::{Notify, Semaphore, oneshot};

/// How long the first dead letter of a batch waits for others to share its
/// durable write during a poison storm (see `Quarantines`), beyond those
/// that arrive while the previous batch is written. A write costs a
/// transaction and an fsync whoever shares it: on the 2-core VM of
/// `docs/benchmarks.md` one dead letter alone costs ~140 µs of CPU in the
/// store, four together ~50 each, sixteen ~16.
pub const QUARANTINE_LINGER: Duration = Duration::from_millis(2);
/// A dead letter is part of a storm when the batch before it was taken
/// less than this long ago; a lone one is written at once.
const STORM_GAP: Duration = Duration::from_secs(1);
/// Dead letters written in one transaction at most.
const QUARANTINE_BATCH: usize = 256;
/// Dead letters pending that make a batch worth writing without lingering:
/// past this many, sharing saves little more per dead letter.
const QUARANTINE_COMPANY: usize = 16;

type QuarantineReply = oneshot::Sender<Result<Quarantined, StoreError>>;

/// Dead letters waiting to be written together. A quarantine must be durable
/// before its message is acknowledged, and alone each one is a transaction
/// and an fsync, which cost more than a whole healthy delivery. So at most
/// one write is in flight per guard, and the dead letters that arrive while
/// it runs are written together by the next one, in one transaction and
/// one fsync (group commit). In a storm (the previous batch was taken less
/// than [`STORM_GAP`] ago) each batch also waits `linger`
/// ([`QUARANTINE_LINGER`]) for company, unless [`QUARANTINE_COMPANY`] are
/// pending already or half the broker's window is taken (see
/// [`Quarantines::room`]); a lone dead letter is written at once. Only the
/// poison messages' acknowledgements wait (and, on RabbitMQ, the acks above
/// them, which then go with theirs as one frame).
pub(crate) struct Quarantines {
    state: Mutex<Batching>,
    pub(crate) linger: Duration,
    /// The slots that bound the broker's window while messages settle (the
    /// settling slots, or the handler slots with no settling allowance),
    /// and how many there are. The messages behind a lingering dead letter
    /// keep theirs until its write ends (RabbitMQ holds their acks for it),
    /// so a linger that outlasted the free slots would stall the consumer
    /// on a full window: on a fast machine 2 ms is 60 deliveries.
    room: (Arc<Semaphore>, usize),
    /// Ends a linger under way: enough company, or the window half full.
    /// The linger ends then even if the slot is soon given back (an ack
    /// sent at once): the window was full enough to stall.
    hurry: Notify,
    /// A linger is under way: only then is `hurry` worth a call.
    lingering: AtomicBool,
}

#[derive(Default)]
struct Batching {
    pending: Vec<(SourceDeadLetter, QuarantineReply)>,
    /// A write task is running; it takes what is pending until none is.
    writing: bool,
    /// When the last batch was taken: whether a storm is on.
    last_batch: Option<tokio::time::Instant>,
}

impl Quarantines {
    pub(crate) fn new(linger: Duration, room: (Arc<Semaphore>, usize)) -> Quarantines {
        Quarantines {
            state: Mutex::new(Batching::default()),
            linger,
            room,
            hurry: Notify::new(),
            lingering: AtomicBool::new(false),
        }
    }

    /// Whether at least half the window's slots are free, so that a
    /// linger does not stall the deliveries behind it.
    fn roomy(&self) -> bool {
        let (slots, max) = &self.room;
        slots.available_permits() * 2 >= *max
    }

    /// A slot was taken: a linger under way ends if the window is now
    /// half full. An atomic load while none is.
    pub(crate) fn slot_taken(&self) {
        if self.lingering.load(Ordering::Acquire) && !self.roomy() {
            self.hurry.notify_waiters();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Batching> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `dl`; whether the caller must start the write task.
    pub(crate) fn push(&self, dl: SourceDeadLetter, reply: QuarantineReply) -> bool {
        let mut state = self.lock();
        state.pending.push((dl, reply));
        if state.pending.len() == QUARANTINE_COMPANY {
            self.hurry.notify_waiters();
        }
        !std::mem::replace(&mut state.writing, true)
    }

    /// Whether a batch should wait for more company now.
    fn should_linger(&self) -> bool {
        let state = self.lock();
        let storm = state.last_batch.is_some_and(|t| t.elapsed() < STORM_GAP);
        storm && state.pending.len() < QUARANTINE_COMPANY && self.roomy()
    }

    /// Waits up to `linger` for company, during a storm, while the window
    /// has room (see [`Quarantines::room`]).
    async fn linger_for_company(&self) {
        let hurried = self.hurry.notified();
        tokio::pin!(hurried);
        // Registered before the last look, so a hurry after it is heard
        // (a slot taken in a race with the look is missed at worst, and
        // the linger runs its course).
        hurried.as_mut().enable();
        self.lingering.store(true, Ordering::Release);
        if self.should_linger() {
            tokio::select! {
                () = tokio::time::sleep(self.linger) => {}
                () = hurried => {}
            }
        }
        self.lingering.store(false, Ordering::Release);
    }

    /// Writes what is pending, batch after batch, until nothing is; then
    /// the next arrival starts a new task.
    pub(crate) async fn write_all<S: Store>(&self, store: &S) {
        loop {
            if !self.linger.is_zero() {
                self.linger_for_company().await;
            }
            let batch = {
                let mut state = self.lock();
                if state.pending.is_empty() {
                    state.writing = false;
                    return;
                }
                state.last_batch = Some(tokio::time::Instant::now());
                let n = state.pending.len().min(QUARANTINE_BATCH);
                state.pending.drain(..n).collect::<Vec<_>>()
            };
            Self::write(store, batch).await;
        }
    }

    /// Writes one batch, answering each waiter.
    async fn write<S: Store>(store: &S, batch: Vec<(SourceDeadLetter, QuarantineReply)>) {
        let (dls, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
        match store.quarantine_messages(dls).await {
            Ok(written) => {
                crate::failpoint::fail_point!("guard::after_dead_letter_commit");
                for (reply, q) in replies.into_iter().zip(written) {
                    let _ = reply.send(Ok(q));
                }
            }
            Err(e) => {
                let why = e.to_string();
                let mut e = Some(e);
                for reply in replies {
                    let err = e
                        .take()
                        .unwrap_or_else(|| StoreError::NotApplied(why.clone()));
                    let _ = reply.send(Err(err));
                }
            }
        }
    }
}
