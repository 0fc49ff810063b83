//! A history of what a fault battery's clients did and saw, and the
//! checker that judges it after a drain, in Jepsen's vocabulary.
//!
//! lazaret promises that nothing acknowledged is lost, nothing poisoned
//! loops, no broker message is acked without being handled or
//! quarantined, and nothing is quarantined twice. A battery (broker
//! faults, kill -9 of guard nodes, power loss, the simulation) believes
//! that promise only when a checker that would have caught the lie says
//! so; this module is that checker, shared by every battery.
//!
//! # The vocabulary
//!
//! A history is a list of [`Entry`]s: an operation ([`Op`]) with its
//! invoke and complete times (nanoseconds on one monotonic clock) and its
//! [`Outcome`]: `Ok` (it happened, and the reply said so), `Fail` (it
//! definitely did not happen) or `Info` (unknown: a timeout, a lost
//! reply, a crashed client; an operation never completed counts as
//! `Info`). Every id is a string: a job id or client key in queue mode,
//! a broker message id under a guard. One id names a job or message in
//! every operation about it: a battery that enqueues by client key maps
//! the job ids the server hands out back to the key.
//!
//! - Queue mode: [`Op::Enqueue`], [`Op::Lease`], [`Op::Ack`] (`Ok` when
//!   the server accepted it, `Fail` when it answered stale /
//!   `LEASE_LOST`).
//! - Guard mode: [`Op::Publish`], [`Op::Deliver`] (one handler call,
//!   completed with its [`Handled`] result), [`Op::BrokerAck`],
//!   [`Op::DeadLetter`].
//! - Both: [`Op::Redrive`] (starts a new *generation* of the id: its
//!   attempts restart and it may be dead-lettered once more) and
//!   [`Op::Fault`] (a nemesis: a broker restart, a killed connection, a
//!   kill -9; it explains a redelivery).
//! - Final observations, taken after the drain: [`Op::ObservedCompleted`],
//!   [`Op::ObservedDeadLetter`], [`Op::ObservedRemaining`].
//!
//! [`History::check`] returns a [`Report`] whose [`Anomaly`]s each name
//! their [`AnomalyKind`] and the operations involved: **lost** (an
//! acknowledged enqueue or publish never completed nor dead-lettered),
//! **unexpected** (something completed, delivered or dead-lettered that
//! was never enqueued or published), **duplicated** (a delivery that
//! neither a retry, a broker redelivery, an unfinished handler, an
//! expired lease nor a fault explains; the explained ones are counted per
//! cause in [`Report::duplicated_allowed`], since at-least-once allows
//! them), **delivery after ack**, **overlapping leases**, **stale ack
//! accepted**, **attempt backwards**, **dead letter incomplete** (without
//! its history or payload), **payload mismatch**, **acked unhandled** (a
//! broker ack with neither a handler success nor a dead letter) and
//! **dead-lettered twice** (within one generation). **Recovered** (an
//! `Info` enqueue or publish that turned out applied) and
//! **indeterminate** (an `Info` one never seen again) are counts, as in
//! Jepsen: neither breaks a promise. A poison message that loops breaks
//! none of the rules by itself; [`Report::deliveries_max`] shows it, for
//! a battery to hold against its retry budget.
//!
//! Time is judged conservatively: an operation took effect somewhere
//! between its invoke and its completion, so only what is certain in
//! every such order is an anomaly. The one duration the checker trusts is
//! a lease's `ttl_ms`, when the battery gives it.
//!
//! # How a battery uses it
//!
//! ```
//! use lazaret_testkit::history::{Handled, Op, Recorder, payload_hash};
//!
//! let history = Recorder::new(); // cheap to clone into every task
//! // Around each client call: invoke before, complete after.
//! let hash = payload_hash(b"{\"order\": 1}");
//! let call = history.invoke(Op::Publish { id: "m1".into(), payload_hash: hash });
//! // … publish, wait for the broker's confirm …
//! call.ok(); // or .fail() when refused, .info() on a timeout
//!
//! // In the handler: one Deliver per call, completed with its result.
//! let call = history.invoke(Op::deliver("m1", 1, "node-a", false, Some(hash)));
//! call.handled(Handled::Success); // `.info()` if the handler never returned
//!
//! // After the drain: what is left to see.
//! history.observe(Op::ObservedCompleted { id: "m1".into() });
//!
//! // Check; on failure the history is written to a JSON-lines file
//! // whose path the panic message gives.
//! let report = history.assert_ok("doc example");
//! assert_eq!(report.acknowledged, 1);
//! ```
//!
//! A failing run's file loads back with [`History::from_jsonl`], so the
//! checker (or a fixed checker) can be run on it again.

mod check;
#[cfg(test)]
mod tests;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use check::{Anomaly, AnomalyKind, OpRef, Report};

/// Where [`History::assert_ok`] writes a failing run's history, when set;
/// the system's temporary directory otherwise.
pub const HISTORY_DIR_VAR: &str = "LAZARET_HISTORY_DIR";

/// How an operation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// It happened, and the reply said so.
    Ok,
    /// It definitely did not happen (refused, or answered stale).
    Fail,
    /// Unknown: a timeout, a lost reply, a crash; it may have happened.
    Info,
}

/// What a handler (guard mode) or a worker's ack (queue mode) made of a
/// delivery.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Handled {
    /// Done: the message or job is finished.
    Success,
    /// Failed, to be retried with the next attempt.
    Transient,
    /// Failed for good: to be dead-lettered now.
    Permanent,
    /// Put off without charging an attempt: the next delivery may show
    /// the same attempt.
    Deferred,
}

/// One operation of a history. Ids are strings: a job id or client key
/// (queue mode), a broker message id (guard mode).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// A producer enqueues a job (queue mode). `Ok`: the server
    /// acknowledged it.
    Enqueue {
        /// The job id, or the client key when the battery keys jobs by it.
        id: String,
        /// A hash of the payload, compared with what is delivered.
        payload_hash: u64,
    },
    /// A worker leases a job. `Ok`: granted (with `token` and `attempt`);
    /// a lease that returned no job is not recorded.
    Lease {
        /// The job.
        id: String,
        /// The lease token.
        token: String,
        /// The attempt the lease shows (1 on the first).
        attempt: u32,
        /// The lease's time to live, if known: a second lease granted
        /// before it ran out, the first not released, is an overlap.
        ttl_ms: Option<u64>,
        /// A hash of the payload the worker got.
        payload_hash: Option<u64>,
    },
    /// A worker acks a lease. `Ok`: accepted; `Fail`: answered stale
    /// (`LEASE_LOST`) or refused; `Info`: no answer.
    Ack {
        /// The job.
        id: String,
        /// The lease token acked with.
        token: String,
        /// What the worker reported.
        result: Handled,
        /// The server's answer code, if any (e.g. `LEASE_LOST`).
        answer: Option<String>,
    },
    /// A producer publishes to the broker (guard mode). `Ok`: the broker
    /// confirmed it.
    Publish {
        /// The message id.
        id: String,
        /// A hash of the body.
        payload_hash: u64,
    },
    /// One handler call under a guard: invoked when the handler starts,
    /// completed (see [`Pending::ok_with`]) with its `result`; `Info`
    /// when the handler never returned (timed out, node killed).
    Deliver {
        /// The message id.
        id: String,
        /// The attempt the handler was shown (1 on the first).
        attempt: u32,
        /// The guard node that delivered it.
        node: String,
        /// Whether the broker marked it redelivered.
        redelivered: bool,
        /// A hash of the body the handler got.
        payload_hash: Option<u64>,
        /// What the handler answered; `None` while running.
        result: Option<Handled>,
    },
    /// The guard acked the message to the broker (as seen by a broker
    /// hook or the broker itself).
    BrokerAck {
        /// The message id.
        id: String,
    },
    /// A dead letter was written (as the store or the guard reported it).
    DeadLetter {
        /// The message id or job id.
        id: String,
        /// The dead letter's own id.
        dead_letter_id: String,
        /// Whether it carries the delivery history.
        has_history: bool,
        /// Whether it carries the payload.
        has_payload: bool,
        /// A hash of the payload it carries.
        payload_hash: Option<u64>,
    },
    /// A dead letter was redriven back to its queue or broker. `Ok`
    /// starts a new generation of the id; an unknown redrive counts as
    /// not applied, so resolve it (observe) before recording it `Ok`.
    Redrive {
        /// The message id or job id.
        id: String,
    },
    /// A fault the battery injected (a nemesis): a broker restart or
    /// pause, killed connections, a kill -9. It explains a redelivery of
    /// any message in flight while it lasted.
    Fault {
        /// What was done, for the reader.
        what: String,
    },
    /// After the drain: this job or message is completed.
    ObservedCompleted {
        /// The job or message.
        id: String,
    },
    /// After the drain: this dead letter exists.
    ObservedDeadLetter {
        /// The message id or job id.
        id: String,
        /// The dead letter's own id.
        dead_letter_id: String,
        /// Whether it carries the delivery history.
        has_history: bool,
        /// Whether it carries the payload.
        has_payload: bool,
        /// A hash of the payload it carries.
        payload_hash: Option<u64>,
    },
    /// After the drain: this message is still in the broker (or this job
    /// still waits in the queue): not lost, but not finished either.
    ObservedRemaining {
        /// The job or message.
        id: String,
    },
}

impl Op {
    /// A [`Op::Deliver`] not yet handled.
    pub fn deliver(
        id: impl Into<String>,
        attempt: u32,
        node: impl Into<String>,
        redelivered: bool,
        payload_hash: Option<u64>,
    ) -> Op {
        Op::Deliver {
            id: id.into(),
            attempt,
            node: node.into(),
            redelivered,
            payload_hash,
            result: None,
        }
    }

    /// This [`Op::Deliver`] with the handler's result; any other
    /// operation unchanged.
    pub fn handled(mut self, handled: Handled) -> Op {
        if let Op::Deliver { result, .. } = &mut self {
            *result = Some(handled);
        }
        self
    }

    /// The job or message the operation is about (`None` for a fault).
    pub fn id(&self) -> Option<&str> {
        match self {
            Op::Enqueue { id, .. }
            | Op::Lease { id, .. }
            | Op::Ack { id, .. }
            | Op::Publish { id, .. }
            | Op::Deliver { id, .. }
            | Op::BrokerAck { id }
            | Op::DeadLetter { id, .. }
            | Op::Redrive { id }
            | Op::ObservedCompleted { id }
            | Op::ObservedDeadLetter { id, .. }
            | Op::ObservedRemaining { id } => Some(id),
            Op::Fault { .. } => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn hash(h: &Option<u64>) -> String {
            h.map_or_else(|| "-".to_owned(), |h| format!("{h:x}"))
        }
        fn dead_letter(
            f: &mut fmt::Formatter<'_>,
            what: &str,
            id: &str,
            dl: &str,
            history: bool,
            payload: bool,
            h: &Option<u64>,
        ) -> fmt::Result {
            write!(
                f,
                "{what} {id} dl={dl} history={history} payload={payload} hash={}",
                hash(h)
            )
        }
        match self {
            Op::Enqueue { id, payload_hash } => write!(f, "enqueue {id} hash={payload_hash:x}"),
            Op::Lease {
                id,
                token,
                attempt,
                ttl_ms,
                payload_hash,
            } => {
                write!(f, "lease {id} token={token} attempt={attempt}")?;
                if let Some(ttl) = ttl_ms {
                    write!(f, " ttl={ttl}ms")?;
                }
                write!(f, " hash={}", hash(payload_hash))
            }
            Op::Ack {
                id,
                token,
                result,
                answer,
            } => {
                write!(f, "ack {id} token={token} {result:?}")?;
                if let Some(a) = answer {
                    write!(f, " answer={a}")?;
                }
                Ok(())
            }
            Op::Publish { id, payload_hash } => write!(f, "publish {id} hash={payload_hash:x}"),
            Op::Deliver {
                id,
                attempt,
                node,
                redelivered,
                payload_hash,
                result,
            } => {
                write!(f, "deliver {id} attempt={attempt} node={node}")?;
                if *redelivered {
                    write!(f, " redelivered")?;
                }
                write!(f, " hash={}", hash(payload_hash))?;
                match result {
                    Some(r) => write!(f, " -> {r:?}"),
                    None => write!(f, " -> ?"),
                }
            }
            Op::BrokerAck { id } => write!(f, "broker-ack {id}"),
            Op::DeadLetter {
                id,
                dead_letter_id,
                has_history,
                has_payload,
                payload_hash,
            } => dead_letter(
                f,
                "dead-letter",
                id,
                dead_letter_id,
                *has_history,
                *has_payload,
                payload_hash,
            ),
            Op::Redrive { id } => write!(f, "redrive {id}"),
            Op::Fault { what } => write!(f, "fault: {what}"),
            Op::ObservedCompleted { id } => write!(f, "observed completed {id}"),
            Op::ObservedDeadLetter {
                id,
                dead_letter_id,
                has_history,
                has_payload,
                payload_hash,
            } => dead_letter(
                f,
                "observed dead letter",
                id,
                dead_letter_id,
                *has_history,
                *has_payload,
                payload_hash,
            ),
            Op::ObservedRemaining { id } => write!(f, "observed remaining {id}"),
        }
    }
}

/// One recorded operation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Its place in the history (the order of invocation).
    pub index: usize,
    /// When it was invoked, in nanoseconds on the recorder's clock.
    pub invoke_ns: u64,
    /// When it completed; `None` if it never did (then it is `Info`).
    pub complete_ns: Option<u64>,
    /// How it ended.
    pub outcome: Outcome,
    /// What it was.
    #[serde(flatten)]
    pub op: Op,
}

impl Entry {
    /// When it completed, with "never" as the end of time.
    pub fn end_ns(&self) -> u64 {
        self.complete_ns.unwrap_or(u64::MAX)
    }

    /// Whether this one certainly completed before `other` was invoked.
    pub fn precedes(&self, other: &Entry) -> bool {
        self.end_ns() < other.invoke_ns
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ms = |ns: u64| ns as f64 / 1e6;
        let outcome = match self.outcome {
            Outcome::Ok => "ok",
            Outcome::Fail => "fail",
            Outcome::Info => "info",
        };
        match self.complete_ns {
            Some(c) => write!(
                f,
                "#{} [{:.3}..{:.3}ms] {outcome} {}",
                self.index,
                ms(self.invoke_ns),
                ms(c),
                self.op
            ),
            None => write!(
                f,
                "#{} [{:.3}ms..never] {outcome} {}",
                self.index,
                ms(self.invoke_ns),
                self.op
            ),
        }
    }
}

/// A finished list of operations, ready to check or dump.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct History {
    /// The operations, in the order they were invoked.
    pub entries: Vec<Entry>,
}

impl History {
    /// A history of these entries, renumbered in the order given.
    pub fn new(mut entries: Vec<Entry>) -> History {
        for (i, e) in entries.iter_mut().enumerate() {
            e.index = i;
        }
        History { entries }
    }

    /// Judges the history (see the module docs for what is checked).
    pub fn check(&self) -> Report {
        check::check(self)
    }

    /// One JSON object per line, one line per entry.
    pub fn to_jsonl(&self) -> String {
        let mut out = String::new();
        for e in &self.entries {
            // An entry is strings, numbers and booleans: it always serializes.
            out.push_str(&serde_json::to_string(e).expect("an entry serializes"));
            out.push('\n');
        }
        out
    }

    /// Reads back what [`History::to_jsonl`] wrote.
    pub fn from_jsonl(text: &str) -> Result<History, serde_json::Error> {
        let entries = text
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(serde_json::from_str)
            .collect::<Result<Vec<Entry>, _>>()?;
        Ok(History { entries })
    }

    /// Writes the history to `path` as JSON lines.
    pub fn write_jsonl(&self, path: &Path) -> io::Result<()> {
        std::fs::write(path, self.to_jsonl())
    }

    /// Checks the history and returns the report; when it has anomalies,
    /// writes the history to a file (see [`dump_path`]) and panics with
    /// the report and the file's path. `run` names the run in the file
    /// name.
    #[track_caller]
    pub fn assert_ok(&self, run: &str) -> Report {
        let report = self.check();
        if !report.is_ok() {
            let path = dump_path(run);
            let saved = match self.write_jsonl(&path) {
                Ok(()) => format!("history written to {}", path.display()),
                Err(e) => format!("could not write the history to {}: {e}", path.display()),
            };
            panic!("{run}: the history has anomalies\n{report}\n{saved}");
        }
        report
    }
}

/// Where a failing run named `run` dumps its history:
/// `$LAZARET_HISTORY_DIR` (or the temporary directory) /
/// `lazaret-history-<run>-<pid>.jsonl`.
pub fn dump_path(run: &str) -> PathBuf {
    let dir = std::env::var_os(HISTORY_DIR_VAR)
        .filter(|d| !d.is_empty())
        .map_or_else(std::env::temp_dir, PathBuf::from);
    let name: String = run
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!(
        "lazaret-history-{name}-{}.jsonl",
        std::process::id()
    ))
}

/// The payload hash every battery records (64-bit FNV-1a): stable across
/// runs, processes and machines, so a dumped history can be compared
/// with the bytes a broker or the store still holds.
pub fn payload_hash(payload: &[u8]) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    payload
        .iter()
        .fold(OFFSET, |h, &b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

type Clock = Arc<dyn Fn() -> u64 + Send + Sync>;

/// Records a history from any number of threads or tasks; clones share
/// one history.
#[derive(Clone)]
pub struct Recorder {
    inner: Arc<Inner>,
}

struct Inner {
    clock: Clock,
    entries: Mutex<Vec<Entry>>,
}

impl fmt::Debug for Recorder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recorder")
            .field("entries", &self.lock().len())
            .finish_non_exhaustive()
    }
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

impl Recorder {
    /// A recorder whose clock is the monotonic time since now.
    pub fn new() -> Recorder {
        let start = Instant::now();
        Recorder::with_clock(move || u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    /// A recorder on another clock (nanoseconds, never going back): a
    /// simulation's fake clock, so its history does not depend on how
    /// fast the machine is.
    pub fn with_clock(clock: impl Fn() -> u64 + Send + Sync + 'static) -> Recorder {
        Recorder {
            inner: Arc::new(Inner {
                clock: Arc::new(clock),
                entries: Mutex::new(Vec::new()),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Entry>> {
        // A task that panicked while recording leaves a usable history.
        self.inner
            .entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn now(&self) -> u64 {
        (self.inner.clock)()
    }

    /// Records that `op` is invoked now; complete it through the
    /// returned [`Pending`] (one left incomplete counts as `Info`).
    pub fn invoke(&self, op: Op) -> Pending {
        let mut entries = self.lock();
        // The clock is read under the lock, so indices follow time.
        let now = self.now();
        let index = entries.len();
        entries.push(Entry {
            index,
            invoke_ns: now,
            complete_ns: None,
            outcome: Outcome::Info,
            op,
        });
        Pending {
            recorder: self.clone(),
            index,
        }
    }

    /// Records `op` invoked and completed now with `outcome`.
    pub fn record(&self, op: Op, outcome: Outcome) {
        self.invoke(op).complete(outcome);
    }

    /// Records a final observation (or anything seen rather than done)
    /// as `Ok` now.
    pub fn observe(&self, op: Op) {
        self.record(op, Outcome::Ok);
    }

    /// How many operations are recorded so far.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether nothing is recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of the history so far.
    pub fn history(&self) -> History {
        History {
            entries: self.lock().clone(),
        }
    }

    /// Checks the history so far.
    pub fn check(&self) -> Report {
        self.history().check()
    }

    /// [`History::assert_ok`] on the history so far: the report, or a
    /// panic naming the file the failing history was written to.
    #[track_caller]
    pub fn assert_ok(&self, run: &str) -> Report {
        self.history().assert_ok(run)
    }
}

/// An invoked operation waiting for its outcome.
#[derive(Debug)]
#[must_use = "complete the operation with ok, fail or info (dropped, it stays unknown)"]
pub struct Pending {
    recorder: Recorder,
    index: usize,
}

impl Pending {
    /// Its index in the history.
    pub fn index(&self) -> usize {
        self.index
    }

    /// Completes it now with `outcome`.
    pub fn complete(self, outcome: Outcome) {
        self.finish(outcome, None);
    }

    /// Completes it now with `outcome`, and with `op` in place of what
    /// was known at invocation (a lease's token, a handler's result).
    pub fn complete_with(self, outcome: Outcome, op: Op) {
        self.finish(outcome, Some(op));
    }

    /// It happened.
    pub fn ok(self) {
        self.complete(Outcome::Ok);
    }

    /// It happened, as `op` says.
    pub fn ok_with(self, op: Op) {
        self.complete_with(Outcome::Ok, op);
    }

    /// A handler's [`Op::Deliver`] returned `result` (`Ok`).
    pub fn handled(self, result: Handled) {
        let mut entries = self.recorder.lock();
        let e = &mut entries[self.index];
        let op = e.op.clone().handled(result);
        drop(entries);
        self.complete_with(Outcome::Ok, op);
    }

    /// It definitely did not happen.
    pub fn fail(self) {
        self.complete(Outcome::Fail);
    }

    /// Nobody knows whether it happened.
    pub fn info(self) {
        self.complete(Outcome::Info);
    }

    fn finish(self, outcome: Outcome, op: Option<Op>) {
        let mut entries = self.recorder.lock();
        let now = self.recorder.now();
        let e = &mut entries[self.index];
        e.complete_ns = Some(now);
        e.outcome = outcome;
        if let Some(op) = op {
            e.op = op;
        }
    }
}
