//! The checker: walks a history id by id and reports what breaks
//! lazaret's promise, naming the operations involved.
//!
//! Time is judged conservatively: an operation took effect somewhere
//! between its invoke and its completion, so "A before B" means A
//! completed before B was invoked ([`Entry::precedes`]); anything less
//! certain is given the benefit of the doubt.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use super::{Entry, Handled, History, Op, Outcome};

/// How many anomalies the report's `Display` prints in full.
pub const ANOMALIES_SHOWN_MAX: usize = 10;
/// How many operations one anomaly lists at most (the first ones).
const OPS_PER_ANOMALY_MAX: usize = 8;

/// What went wrong, in Jepsen's words where Jepsen has one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AnomalyKind {
    /// Acknowledged (or recovered), then neither completed, dead-lettered
    /// nor still waiting after the drain.
    Lost,
    /// Leased, delivered, completed or dead-lettered, but never enqueued
    /// or published (or its enqueue failed, yet it was applied).
    Unexpected,
    /// Delivered again with nothing to explain it: not a retry, no broker
    /// redelivery, no unfinished handler, no expired lease, no fault.
    Duplicated,
    /// Leased or delivered after it was acked for good.
    DeliveryAfterAck,
    /// Two leases of one job granted, the first neither expired nor
    /// released when the second was granted.
    OverlappingLeases,
    /// An ack accepted with a token older than a lease granted since.
    StaleAckAccepted,
    /// A later delivery or lease shows a smaller attempt (one generation).
    AttemptBackwards,
    /// A dead letter without its delivery history or its payload.
    DeadLetterIncomplete,
    /// Delivered or dead-lettered with a payload hash other than the one
    /// enqueued or published.
    PayloadMismatch,
    /// Acked to the broker with neither a handler success nor a dead
    /// letter.
    AckedUnhandled,
    /// More than one dead letter for one id within one generation.
    DeadLetteredTwice,
}

impl AnomalyKind {
    /// Every kind, in report order.
    pub const ALL: [AnomalyKind; 11] = [
        AnomalyKind::Lost,
        AnomalyKind::Unexpected,
        AnomalyKind::Duplicated,
        AnomalyKind::DeliveryAfterAck,
        AnomalyKind::OverlappingLeases,
        AnomalyKind::StaleAckAccepted,
        AnomalyKind::AttemptBackwards,
        AnomalyKind::DeadLetterIncomplete,
        AnomalyKind::PayloadMismatch,
        AnomalyKind::AckedUnhandled,
        AnomalyKind::DeadLetteredTwice,
    ];

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            AnomalyKind::Lost => "lost",
            AnomalyKind::Unexpected => "unexpected",
            AnomalyKind::Duplicated => "duplicated",
            AnomalyKind::DeliveryAfterAck => "delivery-after-ack",
            AnomalyKind::OverlappingLeases => "overlapping-leases",
            AnomalyKind::StaleAckAccepted => "stale-ack-accepted",
            AnomalyKind::AttemptBackwards => "attempt-backwards",
            AnomalyKind::DeadLetterIncomplete => "dead-letter-incomplete",
            AnomalyKind::PayloadMismatch => "payload-mismatch",
            AnomalyKind::AckedUnhandled => "acked-unhandled",
            AnomalyKind::DeadLetteredTwice => "dead-lettered-twice",
        }
    }
}

impl fmt::Display for AnomalyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An operation an anomaly involves: its index and how it reads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRef {
    /// Its index in the history.
    pub index: usize,
    /// The entry as `Display` renders it.
    pub rendering: String,
}

/// One broken promise.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Anomaly {
    /// What kind.
    pub kind: AnomalyKind,
    /// The job or message.
    pub id: String,
    /// What happened, in a sentence.
    pub detail: String,
    /// The operations involved.
    pub ops: Vec<OpRef>,
}

impl fmt::Display for Anomaly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.kind, self.id, self.detail)?;
        for op in &self.ops {
            write!(f, "\n    {}", op.rendering)?;
        }
        Ok(())
    }
}

/// What the checker found: counts, and the anomalies.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Operations in the history.
    pub operations: usize,
    /// Ids whose enqueue or publish was acknowledged (`Ok`).
    pub acknowledged: usize,
    /// Ids completed (in their last generation).
    pub completed: usize,
    /// Ids dead-lettered (in their last generation) and not completed.
    pub dead_lettered: usize,
    /// Ids neither completed nor dead-lettered but still waiting after
    /// the drain: not lost, not finished either. A battery that drained
    /// expects none.
    pub remaining: usize,
    /// Ids whose enqueue or publish was unknown (`Info`) and turned out
    /// applied.
    pub recovered: usize,
    /// Ids whose enqueue or publish was unknown and never seen again.
    pub indeterminate: usize,
    /// Repeated deliveries at-least-once allows, per cause
    /// (`broker_redelivery`, `fault`, `handler_unfinished`,
    /// `lease_expired`).
    pub duplicated_allowed: BTreeMap<String, usize>,
    /// The most deliveries (handler calls, granted leases) of one id in
    /// one generation: a battery asserts it stays within the retry
    /// budget, since a poison message that loops shows here first.
    pub deliveries_max: usize,
    /// The highest attempt any delivery or lease showed.
    pub attempt_max: u32,
    /// The broken promises, id by id.
    pub anomalies: Vec<Anomaly>,
}

impl Report {
    /// Whether no promise was broken.
    pub fn is_ok(&self) -> bool {
        self.anomalies.is_empty()
    }

    /// How many anomalies of `kind`.
    pub fn count(&self, kind: AnomalyKind) -> usize {
        self.anomalies.iter().filter(|a| a.kind == kind).count()
    }

    /// The anomalies of `kind`.
    pub fn of(&self, kind: AnomalyKind) -> impl Iterator<Item = &Anomaly> {
        self.anomalies.iter().filter(move |a| a.kind == kind)
    }

    /// Anomalies per kind, the kinds without any left out.
    pub fn counts(&self) -> BTreeMap<AnomalyKind, usize> {
        let mut counts = BTreeMap::new();
        for a in &self.anomalies {
            *counts.entry(a.kind).or_insert(0) += 1;
        }
        counts
    }

    /// Every repeated delivery that was not a retry: the allowed ones
    /// and the [`AnomalyKind::Duplicated`] ones.
    pub fn duplicated(&self) -> usize {
        self.duplicated_allowed.values().sum::<usize>() + self.count(AnomalyKind::Duplicated)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} operations: {} acknowledged, {} completed, {} dead-lettered, {} remaining, \
             {} recovered, {} indeterminate",
            self.operations,
            self.acknowledged,
            self.completed,
            self.dead_lettered,
            self.remaining,
            self.recovered,
            self.indeterminate
        )?;
        let allowed: usize = self.duplicated_allowed.values().sum();
        write!(f, "duplicated: {} ({allowed} allowed", self.duplicated())?;
        for (i, (cause, n)) in self.duplicated_allowed.iter().enumerate() {
            write!(f, "{} {cause} {n}", if i == 0 { ":" } else { "," })?;
        }
        writeln!(f, "; {} anomalous)", self.count(AnomalyKind::Duplicated))?;
        writeln!(
            f,
            "most deliveries of one id in one generation: {} (highest attempt {})",
            self.deliveries_max, self.attempt_max
        )?;
        if self.anomalies.is_empty() {
            return write!(f, "anomalies: none");
        }
        write!(f, "anomalies: {} (", self.anomalies.len())?;
        for (i, (kind, n)) in self.counts().iter().enumerate() {
            write!(f, "{}{kind} {n}", if i == 0 { "" } else { ", " })?;
        }
        write!(f, ")")?;
        for a in self.anomalies.iter().take(ANOMALIES_SHOWN_MAX) {
            write!(f, "\n  {a}")?;
        }
        if self.anomalies.len() > ANOMALIES_SHOWN_MAX {
            write!(
                f,
                "\n  … and {} more",
                self.anomalies.len() - ANOMALIES_SHOWN_MAX
            )?;
        }
        Ok(())
    }
}

pub(super) fn check(history: &History) -> Report {
    let mut by_id: BTreeMap<&str, Vec<&Entry>> = BTreeMap::new();
    let mut faults = Vec::new();
    for e in &history.entries {
        match e.op.id() {
            Some(id) => by_id.entry(id).or_default().push(e),
            None => faults.push(e),
        }
    }
    let mut report = Report {
        operations: history.entries.len(),
        ..Report::default()
    };
    for (id, mut ops) in by_id {
        ops.sort_by_key(|e| (e.invoke_ns, e.index));
        IdCheck::new(id, &ops, &faults, &mut report).run();
    }
    report
}

/// The checks of one id.
struct IdCheck<'a, 'h> {
    id: &'h str,
    ops: &'a [&'h Entry],
    faults: &'a [&'h Entry],
    report: &'a mut Report,
    /// When each `Ok` redrive of the id completed, in order.
    redrives: Vec<u64>,
    /// The generation of each dead letter id recorded as written.
    dead_letter_gen: BTreeMap<&'h str, usize>,
}

fn ok(e: &Entry) -> bool {
    e.outcome == Outcome::Ok
}

impl<'a, 'h> IdCheck<'a, 'h> {
    fn new(
        id: &'h str,
        ops: &'a [&'h Entry],
        faults: &'a [&'h Entry],
        report: &'a mut Report,
    ) -> Self {
        let mut redrives: Vec<u64> = ops
            .iter()
            .filter(|e| ok(e) && matches!(e.op, Op::Redrive { .. }))
            .map(|e| e.end_ns())
            .collect();
        redrives.sort_unstable();
        let mut check = IdCheck {
            id,
            ops,
            faults,
            report,
            redrives,
            dead_letter_gen: BTreeMap::new(),
        };
        for e in ops {
            if let Op::DeadLetter { dead_letter_id, .. } = &e.op
                && ok(e)
            {
                let g = check.gen_at(e);
                check.dead_letter_gen.entry(dead_letter_id).or_insert(g);
            }
        }
        check
    }

    /// The generation an operation belongs to: how many redrives of the
    /// id completed before it was invoked. An observed dead letter
    /// belongs to the generation it was written in, if that was recorded.
    fn gen_of(&self, e: &Entry) -> usize {
        if let Op::ObservedDeadLetter { dead_letter_id, .. } = &e.op
            && let Some(&g) = self.dead_letter_gen.get(dead_letter_id.as_str())
        {
            return g;
        }
        self.gen_at(e)
    }

    fn gen_at(&self, e: &Entry) -> usize {
        self.redrives.iter().filter(|&&c| c < e.invoke_ns).count()
    }

    fn last_gen(&self) -> usize {
        self.redrives.len()
    }

    fn anomaly(&mut self, kind: AnomalyKind, detail: String, ops: &[&Entry]) {
        let mut refs: Vec<&Entry> = ops.to_vec();
        refs.sort_by_key(|e| e.index);
        refs.dedup_by_key(|e| e.index);
        self.report.anomalies.push(Anomaly {
            kind,
            id: self.id.to_owned(),
            detail,
            ops: refs
                .iter()
                .take(OPS_PER_ANOMALY_MAX)
                .map(|e| OpRef {
                    index: e.index,
                    rendering: e.to_string(),
                })
                .collect(),
        });
    }

    fn allow_duplicate(&mut self, cause: &str) {
        *self
            .report
            .duplicated_allowed
            .entry(cause.to_owned())
            .or_insert(0) += 1;
    }

    fn run(&mut self) {
        self.sources_and_fates();
        self.payloads();
        self.dead_letters();
        self.deliveries();
        self.broker_acks();
        self.leases();
        self.acks();
        self.loops();
    }

    /// How many times one id went round, for the report's maxima.
    fn loops(&mut self) {
        let mut per_gen: BTreeMap<usize, usize> = BTreeMap::new();
        for e in self.ops {
            let attempt = match e.op {
                Op::Deliver { attempt, .. } => attempt,
                Op::Lease { attempt, .. } if ok(e) => attempt,
                _ => continue,
            };
            *per_gen.entry(self.gen_of(e)).or_insert(0) += 1;
            self.report.attempt_max = self.report.attempt_max.max(attempt);
        }
        let most = per_gen.values().copied().max().unwrap_or(0);
        self.report.deliveries_max = self.report.deliveries_max.max(most);
    }

    /// Lost, unexpected, recovered, and the counts of fates.
    fn sources_and_fates(&mut self) {
        let ops = self.ops;
        let sources = |o: Outcome| -> Vec<&'h Entry> {
            ops.iter()
                .copied()
                .filter(|e| {
                    e.outcome == o && matches!(e.op, Op::Enqueue { .. } | Op::Publish { .. })
                })
                .collect()
        };
        let (acked, unknown, failed) = (
            sources(Outcome::Ok),
            sources(Outcome::Info),
            sources(Outcome::Fail),
        );
        // What shows the id made it into the system.
        let downstream: Vec<&Entry> = ops
            .iter()
            .copied()
            .filter(|e| match &e.op {
                Op::Enqueue { .. } | Op::Publish { .. } | Op::Fault { .. } => false,
                // A handler that was called saw it, whatever came of the call.
                Op::Deliver { .. } => true,
                _ => ok(e),
            })
            .collect();
        let last = self.last_gen();
        let completed = ops.iter().any(|e| {
            self.gen_of(e) == last
                && ok(e)
                && match &e.op {
                    Op::Ack { result, .. }
                    | Op::Deliver {
                        result: Some(result),
                        ..
                    } => *result == Handled::Success,
                    Op::ObservedCompleted { .. } => true,
                    _ => false,
                }
        });
        let dead = ops.iter().any(|e| {
            self.gen_of(e) == last
                && ok(e)
                && matches!(e.op, Op::DeadLetter { .. } | Op::ObservedDeadLetter { .. })
        });
        let remaining = ops
            .iter()
            .any(|e| ok(e) && matches!(e.op, Op::ObservedRemaining { .. }));

        if !acked.is_empty() {
            self.report.acknowledged += 1;
        }
        let applied = if !acked.is_empty() {
            true
        } else if !unknown.is_empty() {
            if downstream.is_empty() {
                self.report.indeterminate += 1;
            } else {
                self.report.recovered += 1;
            }
            !downstream.is_empty()
        } else {
            if !downstream.is_empty() {
                let detail = if failed.is_empty() {
                    "never enqueued or published".to_owned()
                } else {
                    "its enqueue or publish failed, yet it was applied".to_owned()
                };
                let mut involved = failed.clone();
                involved.extend(&downstream);
                self.anomaly(AnomalyKind::Unexpected, detail, &involved);
            }
            false
        };
        if completed {
            self.report.completed += 1;
        } else if dead {
            self.report.dead_lettered += 1;
        } else if remaining {
            self.report.remaining += 1;
        } else if applied {
            let mut involved: Vec<&Entry> = acked.iter().chain(&unknown).copied().collect();
            // The last things seen of it say where it went missing.
            let tail = downstream.len().saturating_sub(4);
            involved.extend(&downstream[tail..]);
            let how = if acked.is_empty() {
                "unknown but applied"
            } else {
                "acknowledged"
            };
            let detail = if downstream.is_empty() {
                format!("{how}, never seen again: neither completed nor dead-lettered")
            } else {
                format!(
                    "{how}, then neither completed nor dead-lettered (last seen in \
                     generation {last})"
                )
            };
            self.anomaly(AnomalyKind::Lost, detail, &involved);
        }
    }

    fn payloads(&mut self) {
        let ops = self.ops;
        let sources: Vec<&Entry> = ops
            .iter()
            .copied()
            .filter(|e| {
                e.outcome != Outcome::Fail
                    && matches!(e.op, Op::Enqueue { .. } | Op::Publish { .. })
            })
            .collect();
        let hashes: BTreeSet<u64> = sources
            .iter()
            .filter_map(|e| match e.op {
                Op::Enqueue { payload_hash, .. } | Op::Publish { payload_hash, .. } => {
                    Some(payload_hash)
                }
                _ => None,
            })
            .collect();
        if hashes.is_empty() {
            return;
        }
        for e in ops {
            let seen = match &e.op {
                Op::Lease { payload_hash, .. } | Op::DeadLetter { payload_hash, .. } if ok(e) => {
                    *payload_hash
                }
                Op::Deliver { payload_hash, .. } | Op::ObservedDeadLetter { payload_hash, .. } => {
                    *payload_hash
                }
                _ => None,
            };
            if let Some(h) = seen
                && !hashes.contains(&h)
            {
                let sent: Vec<String> = hashes.iter().map(|h| format!("{h:x}")).collect();
                let mut involved = sources.clone();
                involved.push(e);
                self.anomaly(
                    AnomalyKind::PayloadMismatch,
                    format!("payload hash {h:x}, but {} was sent", sent.join(" or ")),
                    &involved,
                );
            }
        }
    }

    fn dead_letters(&mut self) {
        let records: Vec<&Entry> = self
            .ops
            .iter()
            .copied()
            .filter(|e| {
                ok(e) && matches!(e.op, Op::DeadLetter { .. } | Op::ObservedDeadLetter { .. })
            })
            .collect();
        let mut by_dl: BTreeMap<&str, Vec<&Entry>> = BTreeMap::new();
        let mut by_gen: BTreeMap<usize, (BTreeSet<&str>, Vec<&Entry>)> = BTreeMap::new();
        for e in &records {
            if let Op::DeadLetter { dead_letter_id, .. }
            | Op::ObservedDeadLetter { dead_letter_id, .. } = &e.op
            {
                by_dl.entry(dead_letter_id).or_default().push(e);
                let (ids, es) = by_gen.entry(self.gen_of(e)).or_default();
                ids.insert(dead_letter_id);
                es.push(e);
            }
        }
        for (dl, es) in &by_dl {
            let mut missing = BTreeSet::new();
            for e in es {
                if let Op::DeadLetter {
                    has_history,
                    has_payload,
                    ..
                }
                | Op::ObservedDeadLetter {
                    has_history,
                    has_payload,
                    ..
                } = &e.op
                {
                    if !has_history {
                        missing.insert("history");
                    }
                    if !has_payload {
                        missing.insert("payload");
                    }
                }
            }
            if !missing.is_empty() {
                let missing: Vec<&str> = missing.into_iter().collect();
                self.anomaly(
                    AnomalyKind::DeadLetterIncomplete,
                    format!("dead letter {dl} without its {}", missing.join(" and ")),
                    es,
                );
            }
        }
        for (g, (ids, es)) in &by_gen {
            if ids.len() > 1 {
                let ids: Vec<&str> = ids.iter().copied().collect();
                self.anomaly(
                    AnomalyKind::DeadLetteredTwice,
                    format!(
                        "{} dead letters in generation {g}: {}",
                        ids.len(),
                        ids.join(", ")
                    ),
                    es,
                );
            }
        }
    }

    /// Guard mode: after-ack, backwards and duplicated handler deliveries.
    fn deliveries(&mut self) {
        let ops = self.ops;
        let dels: Vec<&Entry> = ops
            .iter()
            .copied()
            .filter(|e| matches!(e.op, Op::Deliver { .. }))
            .collect();
        let broker_acks: Vec<&Entry> = ops
            .iter()
            .copied()
            .filter(|e| ok(e) && matches!(e.op, Op::BrokerAck { .. }))
            .collect();
        for (i, &d) in dels.iter().enumerate() {
            let Op::Deliver {
                attempt,
                redelivered,
                ..
            } = d.op
            else {
                continue;
            };
            let g = self.gen_of(d);
            if let Some(&a) = broker_acks
                .iter()
                .find(|a| self.gen_of(a) == g && a.precedes(d))
            {
                self.anomaly(
                    AnomalyKind::DeliveryAfterAck,
                    "delivered to the handler after the broker ack".to_owned(),
                    &[a, d],
                );
                continue;
            }
            let earlier = &dels[..i];
            if let Some(&e) = earlier
                .iter()
                .filter(|e| self.gen_of(e) == g && e.precedes(d) && deliver_attempt(e) > attempt)
                .max_by_key(|e| deliver_attempt(e))
            {
                self.anomaly(
                    AnomalyKind::AttemptBackwards,
                    format!(
                        "attempt {attempt} delivered after attempt {}",
                        deliver_attempt(e)
                    ),
                    &[e, d],
                );
                continue;
            }
            let Some(&p) = earlier.iter().rev().find(|e| self.gen_of(e) == g) else {
                continue;
            };
            let Op::Deliver {
                attempt: p_attempt,
                result: p_result,
                ..
            } = p.op
            else {
                continue;
            };
            let p_result = if ok(p) { p_result } else { None };
            let retry = match p_result {
                Some(Handled::Transient) => attempt > p_attempt,
                Some(Handled::Deferred) => attempt >= p_attempt,
                _ => false,
            };
            if retry {
                continue;
            }
            if redelivered {
                self.allow_duplicate("broker_redelivery");
            } else if p_result.is_none() {
                self.allow_duplicate("handler_unfinished");
            } else if self
                .faults
                .iter()
                .any(|f| f.invoke_ns < d.invoke_ns && f.end_ns() > p.invoke_ns)
            {
                self.allow_duplicate("fault");
            } else {
                let was = p_result.map_or("?".to_owned(), |r| format!("{r:?}"));
                self.anomaly(
                    AnomalyKind::Duplicated,
                    format!(
                        "delivered again at attempt {attempt} after attempt {p_attempt} ended \
                         {was}, with no broker redelivery, fault or unfinished handler"
                    ),
                    &[p, d],
                );
            }
        }
    }

    /// Guard mode: every broker ack has a handler success or a dead letter
    /// in its generation.
    fn broker_acks(&mut self) {
        let ops = self.ops;
        for &a in ops {
            if !(ok(a) && matches!(a.op, Op::BrokerAck { .. })) {
                continue;
            }
            let g = self.gen_of(a);
            let handled = ops.iter().any(|e| {
                self.gen_of(e) == g
                    && ok(e)
                    && match &e.op {
                        Op::Deliver { result, .. } => {
                            *result == Some(Handled::Success) && e.invoke_ns < a.end_ns()
                        }
                        Op::DeadLetter { .. } => e.invoke_ns < a.end_ns(),
                        // Observed after the drain, or a redrive that
                        // closed this generation: a dead letter existed.
                        Op::ObservedDeadLetter { .. } | Op::Redrive { .. } => true,
                        _ => false,
                    }
            });
            if !handled {
                let mut involved: Vec<&Entry> = ops
                    .iter()
                    .copied()
                    .filter(|e| self.gen_of(e) == g && matches!(e.op, Op::Deliver { .. }))
                    .collect();
                involved.push(a);
                self.anomaly(
                    AnomalyKind::AckedUnhandled,
                    "acked to the broker with neither a handler success nor a dead letter"
                        .to_owned(),
                    &involved,
                );
            }
        }
    }

    /// Queue mode: after-ack, backwards, duplicated and overlapping leases.
    fn leases(&mut self) {
        let ops = self.ops;
        let leases: Vec<&Entry> = ops
            .iter()
            .copied()
            .filter(|e| ok(e) && matches!(e.op, Op::Lease { .. }))
            .collect();
        let acks: Vec<&Entry> = ops
            .iter()
            .copied()
            .filter(|e| matches!(e.op, Op::Ack { .. }))
            .collect();
        for (i, &l) in leases.iter().enumerate() {
            let (token, attempt) = lease_of(l);
            let g = self.gen_of(l);
            if let Some(&a) = acks.iter().find(|a| {
                ok(a)
                    && self.gen_of(a) == g
                    && a.precedes(l)
                    && matches!(ack_result(a), Handled::Success | Handled::Permanent)
            }) {
                self.anomaly(
                    AnomalyKind::DeliveryAfterAck,
                    format!("leased after an accepted {:?} ack", ack_result(a)),
                    &[a, l],
                );
                continue;
            }
            let earlier = &leases[..i];
            if let Some(&e) = earlier
                .iter()
                .filter(|e| self.gen_of(e) == g && e.precedes(l) && lease_of(e).1 > attempt)
                .max_by_key(|e| lease_of(e).1)
            {
                self.anomaly(
                    AnomalyKind::AttemptBackwards,
                    format!("attempt {attempt} leased after attempt {}", lease_of(e).1),
                    &[e, l],
                );
                continue;
            }
            if let Some(&p) = earlier.iter().rev().find(|e| self.gen_of(e) == g) {
                let p_token = lease_of(p).0;
                let retried = acks.iter().any(|a| {
                    ok(a)
                        && ack_token(a) == p_token
                        && matches!(ack_result(a), Handled::Transient | Handled::Deferred)
                });
                if !retried {
                    self.allow_duplicate("lease_expired");
                }
            }
            // Overlap: an earlier lease still unexpired and unreleased
            // when this one was granted.
            for &e in earlier {
                let Op::Lease {
                    token: e_token,
                    ttl_ms: Some(ttl),
                    ..
                } = &e.op
                else {
                    continue;
                };
                if e_token == token || !e.precedes(l) {
                    continue;
                }
                let expires = e.invoke_ns.saturating_add(ttl.saturating_mul(1_000_000));
                let released = acks.iter().any(|a| {
                    a.outcome != Outcome::Fail
                        && ack_token(a) == e_token
                        && a.invoke_ns < l.end_ns()
                });
                if l.end_ns() < expires && !released {
                    self.anomaly(
                        AnomalyKind::OverlappingLeases,
                        format!(
                            "lease {token} granted while lease {e_token} was unexpired \
                             ({ttl} ms) and unreleased"
                        ),
                        &[e, l],
                    );
                }
            }
        }
    }

    /// Queue mode: accepted acks of stale or unknown tokens.
    fn acks(&mut self) {
        let ops = self.ops;
        for &a in ops {
            if !(ok(a) && matches!(a.op, Op::Ack { .. })) {
                continue;
            }
            let token = ack_token(a);
            let Some(&mine) = ops.iter().find(|e| {
                e.outcome != Outcome::Fail
                    && matches!(e.op, Op::Lease { .. })
                    && lease_of(e).0 == token
            }) else {
                self.anomaly(
                    AnomalyKind::Unexpected,
                    format!("ack accepted for token {token}, never leased"),
                    &[a],
                );
                continue;
            };
            if let Some(&newer) = ops.iter().find(|e| {
                ok(e)
                    && matches!(e.op, Op::Lease { .. })
                    && lease_of(e).0 != token
                    && mine.precedes(e)
                    && e.precedes(a)
            }) {
                self.anomaly(
                    AnomalyKind::StaleAckAccepted,
                    format!(
                        "ack with token {token} accepted after lease {} was granted",
                        lease_of(newer).0
                    ),
                    &[mine, newer, a],
                );
            }
        }
    }
}

fn deliver_attempt(e: &Entry) -> u32 {
    match e.op {
        Op::Deliver { attempt, .. } => attempt,
        _ => 0,
    }
}

fn lease_of(e: &Entry) -> (&str, u32) {
    match &e.op {
        Op::Lease { token, attempt, .. } => (token, *attempt),
        _ => ("", 0),
    }
}

fn ack_token(e: &Entry) -> &str {
    match &e.op {
        Op::Ack { token, .. } => token,
        _ => "",
    }
}

fn ack_result(e: &Entry) -> Handled {
    match &e.op {
        Op::Ack { result, .. } => *result,
        _ => Handled::Transient,
    }
}
