//! The writer's queue: commands taken off the channel, small ones ahead
//! of bulk ones, and the answers held back until their group is durable.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;

use super::{Cmd, Reply};
use crate::StoreError;

/// The writer's end of the command queue: takes commands off it and keeps
/// count of those still waiting (`SqliteStore::call` refuses commands past
/// its bound).
pub(in crate::sqlite) struct Inbox {
    pub(in crate::sqlite) rx: mpsc::Receiver<Cmd>,
    pub(in crate::sqlite) waiting: Arc<AtomicUsize>,
}

impl Inbox {
    pub(super) fn recv(&self) -> Option<Cmd> {
        let cmd = self.rx.recv().ok()?;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        Some(cmd)
    }

    pub(super) fn try_recv(&self) -> Option<Cmd> {
        let cmd = self.rx.try_recv().ok()?;
        self.waiting.fetch_sub(1, Ordering::AcqRel);
        Some(cmd)
    }
}

/// Commands taken off the inbox and not yet run, in two queues: bulk
/// commands (many rows each: large enqueues and outcome batches, and
/// housekeeping) wait behind every other. A group runs the small commands
/// first and then bulk ones, but takes no bulk one once a small command
/// waits for its commit (see [`Queue::next`]); so a flood of bulk enqueues
/// delays a single job's enqueue, lease or ack by at most the one bulk
/// command running when it arrives, not by everything queued before it.
/// Commands of different requests are concurrent, so this reordering is
/// never visible to any one client.
#[derive(Default)]
pub(super) struct Queue {
    small: VecDeque<Cmd>,
    /// With when each was queued: a bulk command that has waited
    /// [`BULK_WAIT_MAX`] joins even a group of small ones.
    bulk: VecDeque<(std::time::Instant, Cmd)>,
    /// Small commands queued when the current group began: they run in it.
    group_smalls: usize,
    /// Small commands run in the current group so far.
    smalls_taken: usize,
}

impl Queue {
    pub(super) fn len(&self) -> usize {
        self.small.len() + self.bulk.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.small.is_empty() && self.bulk.is_empty()
    }

    pub(super) fn push(&mut self, cmd: Cmd) {
        if cmd.is_bulk() {
            self.bulk.push_back((std::time::Instant::now(), cmd));
        } else {
            self.small.push_back(cmd);
        }
    }

    /// Takes what waits in the inbox, as long as this holds fewer than
    /// [`GROUP_MAX`] (the inbox's own bound then holds the rest back).
    pub(super) fn fill(&mut self, rx: &Inbox) {
        while self.len() < GROUP_MAX {
            match rx.try_recv() {
                Some(cmd) => self.push(cmd),
                None => break,
            }
        }
    }

    /// Any command, small ones first: for failing or flushing them all.
    pub(super) fn pop_any(&mut self) -> Option<Cmd> {
        self.small
            .pop_front()
            .or_else(|| self.bulk.pop_front().map(|(_, c)| c))
    }

    /// Starts a group: the small commands queued now all run in it.
    pub(super) fn begin_group(&mut self) {
        self.group_smalls = self.small.len();
        self.smalls_taken = 0;
    }

    /// The next command of the group that began at `began` and has run
    /// `taken` commands, or `None` to commit it now.
    ///
    /// - Small commands queued when it began run in it; those arriving
    ///   later join it during [`LATE_JOIN_WINDOW`] (to share its fsync),
    ///   and after that end it, so that they lead the next group.
    /// - Then bulk commands, only while no small command is in the group
    ///   or waiting: always one, more for up to [`BULK_GROUP_WINDOW`]. A
    ///   group with a small command commits without any (its fsync is what
    ///   the small one waits for), unless the oldest bulk command has
    ///   waited [`BULK_WAIT_MAX`]: then one joins, so that a steady stream
    ///   of small commands cannot starve bulk ones.
    /// - Once the store is closing, everything queued, and nothing more
    ///   from the inbox.
    pub(super) fn next(
        &mut self,
        rx: &Inbox,
        taken: usize,
        bulk_taken: bool,
        closing: bool,
        began: std::time::Instant,
    ) -> Option<Cmd> {
        if closing {
            return self.pop_any();
        }
        if taken >= GROUP_MAX {
            return None;
        }
        if self.group_smalls > 0 {
            self.group_smalls -= 1;
            self.smalls_taken += 1;
            return self.small.pop_front();
        }
        self.fill(rx);
        let elapsed = began.elapsed();
        let open = elapsed <= LATE_JOIN_WINDOW;
        if !self.small.is_empty() {
            if !open {
                return None;
            }
            self.smalls_taken += 1;
            return self.small.pop_front();
        }
        let more_bulk = if self.smalls_taken > 0 {
            !bulk_taken
                && self
                    .bulk
                    .front()
                    .is_some_and(|(queued, _)| queued.elapsed() >= BULK_WAIT_MAX)
        } else {
            !bulk_taken || elapsed <= BULK_GROUP_WINDOW
        };
        if more_bulk {
            self.bulk.pop_front().map(|(_, c)| c)
        } else {
            None
        }
    }
}

/// An answer held back until the group's commit is durable; called with the
/// error that undid the group, if any.
pub(in crate::sqlite) type Pending = Box<dyn FnOnce(Option<StoreError>) + Send>;

pub(super) fn pend<T: Send + 'static>(tx: Reply<T>, result: Result<T, StoreError>) -> Pending {
    Box::new(move |group_error: Option<StoreError>| {
        // A command's own failure is the better answer than the group's.
        let r = match (group_error, result) {
            (_, Err(e)) => Err(e),
            (Some(e), Ok(_)) => Err(e),
            (None, ok) => ok,
        };
        tx.send(r);
    })
}

/// Commands taken into one transaction at most.
const GROUP_MAX: usize = 1024;
/// Commands arriving while a group runs join it only during this window,
/// so a steady stream of arrivals cannot hold a group's commit back.
const LATE_JOIN_WINDOW: std::time::Duration = std::time::Duration::from_millis(2);
/// A group of bulk commands only goes on taking more of them for this long
/// (their answers wait for its commit).
const BULK_GROUP_WINDOW: std::time::Duration = std::time::Duration::from_millis(20);
/// A bulk command that has waited this long runs even in a group of small
/// commands ([`Queue::next`]).
const BULK_WAIT_MAX: std::time::Duration = std::time::Duration::from_millis(50);
/// A command of more rows than this (jobs enqueued, outcomes, dead letters,
/// ids) is bulk: it waits behind the small ones ([`Queue`]).
pub(in crate::sqlite) const BULK_ROWS: usize = 1;

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::request::{Reply, Request};

    fn enqueue(jobs: usize) -> Cmd {
        let (reply, _rx) = Reply::new();
        let jobs = (0..jobs)
            .map(|i| crate::sqlite::tests::job(&format!("k{i}")))
            .collect();
        Cmd::Request(Request::Enqueue { jobs, reply })
    }

    fn rows(cmd: Option<Cmd>) -> Option<usize> {
        match cmd {
            Some(Cmd::Request(Request::Enqueue { jobs, .. })) => Some(jobs.len()),
            Some(_) => panic!("not an enqueue"),
            None => None,
        }
    }

    fn inbox() -> (mpsc::Sender<Cmd>, Inbox) {
        let (tx, rx) = mpsc::channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        (tx, Inbox { rx, waiting })
    }

    /// A group with a one-job command commits without the bulk command
    /// queued before it, which runs in the next group; a bulk command that
    /// has waited `BULK_WAIT_MAX` joins even a group of small ones.
    #[test]
    fn a_group_with_a_small_command_takes_no_bulk_one_until_bulk_waited_too_long() {
        let (_tx, rx) = inbox();
        let bulk = BULK_ROWS + 1;
        let mut q = Queue::default();
        q.push(enqueue(bulk));
        q.push(enqueue(1));
        q.begin_group();
        let began = Instant::now();
        assert_eq!(rows(q.next(&rx, 0, false, false, began)), Some(1));
        assert_eq!(rows(q.next(&rx, 1, false, false, began)), None, "commits");
        q.begin_group();
        let began = Instant::now();
        assert_eq!(rows(q.next(&rx, 0, false, false, began)), Some(bulk));
        assert_eq!(rows(q.next(&rx, 1, true, false, began)), None);

        let long_ago = Instant::now()
            .checked_sub(BULK_WAIT_MAX)
            .expect("the clock is past BULK_WAIT_MAX");
        q.bulk.push_back((long_ago, enqueue(bulk)));
        q.push(enqueue(1));
        q.begin_group();
        let began = Instant::now();
        assert_eq!(rows(q.next(&rx, 0, false, false, began)), Some(1));
        assert_eq!(rows(q.next(&rx, 1, false, false, began)), Some(bulk));
        assert_eq!(rows(q.next(&rx, 2, true, false, began)), None);
    }
}
