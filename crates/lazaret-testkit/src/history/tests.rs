//! The checker against handcrafted histories (one per anomaly kind, and
//! clean ones) and generated ones (clean at-least-once runs with
//! redeliveries, and the same with one injected fault).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;

use super::*;

const MS: u64 = 1_000_000;
const HASH: u64 = 0xab;

/// A history written by hand, times in milliseconds.
#[derive(Default)]
struct H {
    entries: Vec<Entry>,
}

impl H {
    fn at(mut self, t0: u64, t1: u64, outcome: Outcome, op: Op) -> H {
        self.entries.push(Entry {
            index: 0,
            invoke_ns: t0 * MS,
            complete_ns: Some(t1 * MS),
            outcome,
            op,
        });
        self
    }
    fn ok(self, t0: u64, t1: u64, op: Op) -> H {
        self.at(t0, t1, Outcome::Ok, op)
    }
    fn fail(self, t0: u64, t1: u64, op: Op) -> H {
        self.at(t0, t1, Outcome::Fail, op)
    }
    fn info(self, t0: u64, t1: u64, op: Op) -> H {
        self.at(t0, t1, Outcome::Info, op)
    }
    fn build(mut self) -> History {
        self.entries.sort_by_key(|e| e.invoke_ns);
        History::new(self.entries)
    }
    fn check(self) -> Report {
        self.build().check()
    }
}

fn enqueue(id: &str) -> Op {
    Op::Enqueue {
        id: id.into(),
        payload_hash: HASH,
    }
}
fn publish(id: &str) -> Op {
    Op::Publish {
        id: id.into(),
        payload_hash: HASH,
    }
}
fn lease(id: &str, token: &str, attempt: u32, ttl_ms: u64) -> Op {
    Op::Lease {
        id: id.into(),
        token: token.into(),
        attempt,
        ttl_ms: Some(ttl_ms),
        payload_hash: Some(HASH),
    }
}
fn ack(id: &str, token: &str, result: Handled) -> Op {
    Op::Ack {
        id: id.into(),
        token: token.into(),
        result,
        answer: None,
    }
}
fn lease_lost(id: &str, token: &str) -> Op {
    Op::Ack {
        id: id.into(),
        token: token.into(),
        result: Handled::Success,
        answer: Some("LEASE_LOST".into()),
    }
}
fn deliver(id: &str, attempt: u32, redelivered: bool, result: Handled) -> Op {
    Op::deliver(id, attempt, "n1", redelivered, Some(HASH)).handled(result)
}
fn broker_ack(id: &str) -> Op {
    Op::BrokerAck { id: id.into() }
}
fn dead_letter(id: &str, dl: &str) -> Op {
    Op::DeadLetter {
        id: id.into(),
        dead_letter_id: dl.into(),
        has_history: true,
        has_payload: true,
        payload_hash: Some(HASH),
    }
}
fn observed_dead_letter(id: &str, dl: &str) -> Op {
    Op::ObservedDeadLetter {
        id: id.into(),
        dead_letter_id: dl.into(),
        has_history: true,
        has_payload: true,
        payload_hash: Some(HASH),
    }
}
fn redrive(id: &str) -> Op {
    Op::Redrive { id: id.into() }
}
fn completed(id: &str) -> Op {
    Op::ObservedCompleted { id: id.into() }
}
fn remaining(id: &str) -> Op {
    Op::ObservedRemaining { id: id.into() }
}
fn fault(what: &str) -> Op {
    Op::Fault { what: what.into() }
}

fn kinds(r: &Report) -> Vec<AnomalyKind> {
    r.counts().keys().copied().collect()
}

/// Asserts the report has anomalies of exactly these kinds, one each.
#[track_caller]
fn exactly(r: &Report, expected: &[AnomalyKind]) {
    assert_eq!(kinds(r), expected, "{r}");
    assert_eq!(r.anomalies.len(), expected.len(), "{r}");
}

#[test]
fn a_clean_queue_history_passes() {
    let r = H::default()
        // j1: a transient failure, then a success.
        .ok(0, 1, enqueue("j1"))
        .ok(2, 3, lease("j1", "t1", 1, 100))
        .ok(4, 5, ack("j1", "t1", Handled::Transient))
        .ok(6, 7, lease("j1", "t2", 2, 100))
        .ok(8, 9, ack("j1", "t2", Handled::Success))
        // j2: the lease expires, its late ack is refused, the next succeeds.
        .ok(0, 1, enqueue("j2"))
        .ok(2, 3, lease("j2", "a", 1, 5))
        .ok(10, 11, lease("j2", "b", 2, 5))
        .fail(12, 13, lease_lost("j2", "a"))
        .ok(14, 15, ack("j2", "b", Handled::Success))
        // j3: poison, dead-lettered once.
        .ok(0, 1, enqueue("j3"))
        .ok(2, 3, lease("j3", "p", 1, 100))
        .ok(4, 5, ack("j3", "p", Handled::Permanent))
        .ok(4, 5, dead_letter("j3", "dl3"))
        // j4: the enqueue timed out but was applied; j5: it was not.
        .info(0, 1, enqueue("j4"))
        .ok(2, 3, lease("j4", "q", 1, 100))
        .info(4, 5, ack("j4", "q", Handled::Success))
        .info(0, 1, enqueue("j5"))
        // After the drain.
        .ok(20, 20, completed("j1"))
        .ok(20, 20, completed("j2"))
        .ok(20, 20, observed_dead_letter("j3", "dl3"))
        .ok(20, 20, completed("j4"))
        .check();
    assert!(r.is_ok(), "{r}");
    assert_eq!(
        (
            r.acknowledged,
            r.completed,
            r.dead_lettered,
            r.recovered,
            r.indeterminate
        ),
        (3, 3, 1, 1, 1),
        "{r}"
    );
    assert_eq!(r.duplicated_allowed.get("lease_expired"), Some(&1), "{r}");
}

#[test]
fn a_clean_guard_history_passes() {
    let r = H::default()
        // m1: transient, then success.
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Transient))
        .ok(4, 5, deliver("m1", 2, false, Handled::Success))
        .ok(6, 7, broker_ack("m1"))
        // m2: poison, dead-lettered, redriven, then handled.
        .ok(0, 1, publish("m2"))
        .ok(2, 3, deliver("m2", 1, false, Handled::Permanent))
        .ok(4, 5, dead_letter("m2", "dl2"))
        .ok(6, 7, broker_ack("m2"))
        .ok(8, 9, redrive("m2"))
        .ok(10, 11, deliver("m2", 1, false, Handled::Success))
        .ok(12, 13, broker_ack("m2"))
        // m3: a killed connection makes the broker deliver it again.
        .ok(0, 1, publish("m3"))
        .ok(2, 3, deliver("m3", 1, false, Handled::Success))
        .ok(3, 4, fault("close_all_connections"))
        .ok(5, 6, deliver("m3", 1, false, Handled::Success))
        .ok(7, 8, broker_ack("m3"))
        // m4: the broker marks a redelivery.
        .ok(0, 1, publish("m4"))
        .ok(2, 3, deliver("m4", 1, false, Handled::Success))
        .info(4, 5, broker_ack("m4"))
        .ok(6, 7, deliver("m4", 1, true, Handled::Success))
        .ok(8, 9, broker_ack("m4"))
        // m5: the handler never returned; the guard delivers it again.
        .ok(0, 1, publish("m5"))
        .info(2, 30, Op::deliver("m5", 1, "n1", false, Some(HASH)))
        .ok(31, 32, deliver("m5", 2, false, Handled::Success))
        .ok(33, 34, broker_ack("m5"))
        // m6: still in the broker after the drain.
        .ok(0, 1, publish("m6"))
        .ok(40, 40, remaining("m6"))
        .check();
    assert!(r.is_ok(), "{r}");
    assert_eq!((r.acknowledged, r.completed, r.remaining), (6, 5, 1), "{r}");
    let allowed: Vec<(&str, usize)> = r
        .duplicated_allowed
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(
        allowed,
        [
            ("broker_redelivery", 1),
            ("fault", 1),
            ("handler_unfinished", 1)
        ]
    );
    assert_eq!(r.duplicated(), 3);
    assert_eq!((r.deliveries_max, r.attempt_max), (2, 2));
}

#[test]
fn a_poison_loop_shows_in_the_maxima() {
    let mut h = H::default().ok(0, 1, publish("m1"));
    for i in 0..50 {
        h = h.ok(
            2 + 2 * i,
            3 + 2 * i,
            deliver("m1", 1, false, Handled::Deferred),
        );
    }
    let r = h.ok(200, 201, remaining("m1")).check();
    assert!(r.is_ok(), "deferrals are allowed: {r}");
    assert_eq!((r.deliveries_max, r.attempt_max), (50, 1), "{r}");
    assert!(
        r.to_string()
            .contains("most deliveries of one id in one generation: 50 (highest attempt 1)"),
        "{r}"
    );
}

#[test]
fn lost() {
    let r = H::default().ok(0, 1, publish("m1")).check();
    exactly(&r, &[AnomalyKind::Lost]);
    // Dead-lettered, redriven, then never seen: lost in generation 1.
    let r = H::default()
        .ok(0, 1, enqueue("j1"))
        .ok(2, 3, lease("j1", "t", 1, 100))
        .ok(4, 5, ack("j1", "t", Handled::Permanent))
        .ok(4, 5, dead_letter("j1", "dl"))
        .ok(6, 7, redrive("j1"))
        .check();
    exactly(&r, &[AnomalyKind::Lost]);
    assert!(r.anomalies[0].detail.contains("generation 1"), "{r}");
    // A publish that timed out but was delivered must finish, too.
    let r = H::default()
        .info(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Transient))
        .check();
    exactly(&r, &[AnomalyKind::Lost]);
    assert_eq!(r.recovered, 1);
    assert!(
        r.anomalies[0].detail.starts_with("unknown but applied"),
        "{r}"
    );
}

#[test]
fn unexpected() {
    let r = H::default()
        .ok(2, 3, deliver("m9", 1, false, Handled::Success))
        .ok(4, 5, broker_ack("m9"))
        .check();
    exactly(&r, &[AnomalyKind::Unexpected]);
    // A failed enqueue is one that did not happen.
    let r = H::default()
        .fail(0, 1, enqueue("j1"))
        .ok(9, 9, completed("j1"))
        .check();
    exactly(&r, &[AnomalyKind::Unexpected]);
    assert!(r.anomalies[0].detail.contains("failed"), "{r}");
}

#[test]
fn duplicated() {
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Success))
        .ok(4, 5, deliver("m1", 1, false, Handled::Success))
        .ok(6, 7, broker_ack("m1"))
        .check();
    exactly(&r, &[AnomalyKind::Duplicated]);
    assert_eq!(r.duplicated(), 1);
    // A transient failure retried with the same attempt is one too.
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Transient))
        .ok(4, 5, deliver("m1", 1, false, Handled::Success))
        .ok(6, 7, broker_ack("m1"))
        .check();
    exactly(&r, &[AnomalyKind::Duplicated]);
}

#[test]
fn delivery_after_ack() {
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Success))
        .ok(4, 5, broker_ack("m1"))
        .ok(6, 7, deliver("m1", 1, true, Handled::Success))
        .check();
    exactly(&r, &[AnomalyKind::DeliveryAfterAck]);
    let r = H::default()
        .ok(0, 1, enqueue("j1"))
        .ok(2, 3, lease("j1", "t1", 1, 100))
        .ok(4, 5, ack("j1", "t1", Handled::Success))
        .ok(6, 7, lease("j1", "t2", 2, 100))
        .check();
    exactly(&r, &[AnomalyKind::DeliveryAfterAck]);
}

#[test]
fn overlapping_leases() {
    let r = H::default()
        .ok(0, 1, enqueue("j1"))
        .ok(2, 3, lease("j1", "t1", 1, 1_000))
        .ok(10, 11, lease("j1", "t2", 2, 1_000))
        .fail(12, 13, lease_lost("j1", "t1"))
        .ok(14, 15, ack("j1", "t2", Handled::Success))
        .check();
    exactly(&r, &[AnomalyKind::OverlappingLeases]);
    // Granted while the first was still being acked: no certain overlap.
    let r = H::default()
        .ok(0, 1, enqueue("j1"))
        .ok(2, 3, lease("j1", "t1", 1, 1_000))
        .ok(4, 11, ack("j1", "t1", Handled::Transient))
        .ok(10, 11, lease("j1", "t2", 2, 1_000))
        .ok(14, 15, ack("j1", "t2", Handled::Success))
        .check();
    assert!(r.is_ok(), "{r}");
}

#[test]
fn stale_ack_accepted() {
    let r = H::default()
        .ok(0, 1, enqueue("j1"))
        .ok(2, 3, lease("j1", "t1", 1, 5))
        .ok(10, 11, lease("j1", "t2", 2, 5))
        .ok(12, 13, ack("j1", "t1", Handled::Success))
        .fail(14, 15, lease_lost("j1", "t2"))
        .check();
    exactly(&r, &[AnomalyKind::StaleAckAccepted]);
    assert_eq!(r.anomalies[0].ops.len(), 3, "{r}");
}

#[test]
fn attempt_backwards() {
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 2, false, Handled::Transient))
        .ok(4, 5, deliver("m1", 1, false, Handled::Success))
        .ok(6, 7, broker_ack("m1"))
        .check();
    exactly(&r, &[AnomalyKind::AttemptBackwards]);
    let r = H::default()
        .ok(0, 1, enqueue("j1"))
        .ok(2, 3, lease("j1", "t1", 3, 100))
        .ok(4, 5, ack("j1", "t1", Handled::Transient))
        .ok(6, 7, lease("j1", "t2", 2, 100))
        .ok(8, 9, ack("j1", "t2", Handled::Success))
        .check();
    exactly(&r, &[AnomalyKind::AttemptBackwards]);
    // A redrive restarts the attempts.
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 3, false, Handled::Permanent))
        .ok(4, 5, dead_letter("m1", "dl"))
        .ok(6, 7, broker_ack("m1"))
        .ok(8, 9, redrive("m1"))
        .ok(10, 11, deliver("m1", 1, false, Handled::Success))
        .ok(12, 13, broker_ack("m1"))
        .check();
    assert!(r.is_ok(), "{r}");
}

#[test]
fn dead_letter_incomplete() {
    let without_history = |op: Op| match op {
        Op::DeadLetter {
            id,
            dead_letter_id,
            has_payload,
            payload_hash,
            ..
        } => Op::DeadLetter {
            id,
            dead_letter_id,
            has_history: false,
            has_payload,
            payload_hash,
        },
        Op::ObservedDeadLetter {
            id,
            dead_letter_id,
            has_payload,
            payload_hash,
            ..
        } => Op::ObservedDeadLetter {
            id,
            dead_letter_id,
            has_history: false,
            has_payload,
            payload_hash,
        },
        other => other,
    };
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Permanent))
        .ok(4, 5, without_history(dead_letter("m1", "dl")))
        .ok(6, 7, broker_ack("m1"))
        .ok(9, 9, without_history(observed_dead_letter("m1", "dl")))
        .check();
    // One dead letter, seen twice: one anomaly naming both sightings.
    exactly(&r, &[AnomalyKind::DeadLetterIncomplete]);
    assert_eq!(r.anomalies[0].ops.len(), 2, "{r}");
    assert!(r.anomalies[0].detail.contains("history"), "{r}");
}

#[test]
fn payload_mismatch() {
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(
            2,
            3,
            Op::deliver("m1", 1, "n1", false, Some(HASH + 1)).handled(Handled::Success),
        )
        .ok(4, 5, broker_ack("m1"))
        .check();
    exactly(&r, &[AnomalyKind::PayloadMismatch]);
}

#[test]
fn acked_unhandled() {
    // An ack without a success or a dead letter never comes alone: the
    // message is lost, or whatever still comes of it comes after the ack.
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Permanent))
        .ok(4, 5, broker_ack("m1"))
        .check();
    exactly(&r, &[AnomalyKind::Lost, AnomalyKind::AckedUnhandled]);
    // The success came only after the ack.
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Transient))
        .ok(4, 5, broker_ack("m1"))
        .ok(6, 7, deliver("m1", 2, false, Handled::Success))
        .check();
    exactly(
        &r,
        &[AnomalyKind::DeliveryAfterAck, AnomalyKind::AckedUnhandled],
    );
    // A success under way while the ack was sent may have come first.
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Transient))
        .ok(4, 5, broker_ack("m1"))
        .ok(4, 6, deliver("m1", 2, false, Handled::Success))
        .check();
    assert!(r.is_ok(), "{r}");
}

#[test]
fn dead_lettered_twice() {
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Permanent))
        .ok(4, 5, dead_letter("m1", "dl1"))
        .ok(4, 5, dead_letter("m1", "dl2"))
        .ok(6, 7, broker_ack("m1"))
        .check();
    exactly(&r, &[AnomalyKind::DeadLetteredTwice]);
    // Once per generation is the promise.
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(2, 3, deliver("m1", 1, false, Handled::Permanent))
        .ok(4, 5, dead_letter("m1", "dl1"))
        .ok(6, 7, broker_ack("m1"))
        .ok(8, 9, redrive("m1"))
        .ok(10, 11, deliver("m1", 1, false, Handled::Permanent))
        .ok(12, 13, dead_letter("m1", "dl2"))
        .ok(14, 15, broker_ack("m1"))
        .ok(20, 20, observed_dead_letter("m1", "dl2"))
        .check();
    assert!(r.is_ok(), "{r}");
    assert_eq!(r.dead_lettered, 1);
}

#[test]
fn the_report_names_kinds_counts_and_operations() {
    let r = H::default()
        .ok(0, 1, publish("m1"))
        .ok(0, 1, publish("m2"))
        .ok(2, 3, deliver("m2", 1, false, Handled::Success))
        .ok(4, 5, deliver("m2", 1, false, Handled::Success))
        .ok(6, 7, broker_ack("m2"))
        .check();
    let text = r.to_string();
    assert!(!r.is_ok());
    assert!(
        text.contains("anomalies: 2 (lost 1, duplicated 1)"),
        "{text}"
    );
    assert!(text.contains("lost m1: acknowledged"), "{text}");
    assert!(text.contains("ok publish m1 hash=ab"), "{text}");
    assert!(
        text.contains("[2.000..3.000ms] ok deliver m2 attempt=1 node=n1 hash=ab -> Success"),
        "{text}"
    );
    assert!(
        H::default()
            .check()
            .to_string()
            .ends_with("anomalies: none")
    );
}

#[test]
fn a_history_round_trips_through_json_lines() {
    let h = H::default()
        .ok(0, 1, publish("m1"))
        .info(2, 3, Op::deliver("m1", 1, "n1", false, None))
        .ok(4, 5, lease("j", "t", 1, 5))
        .ok(6, 6, fault("SIGSTOP"))
        .build();
    let mut h = h;
    h.entries[1].complete_ns = None;
    let text = h.to_jsonl();
    assert_eq!(text.lines().count(), 4);
    assert!(
        text.lines().next().unwrap().contains(r#""op":"publish""#),
        "{text}"
    );
    assert_eq!(History::from_jsonl(&text).unwrap(), h);

    let dir = std::env::temp_dir().join(format!("lazaret-history-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("h.jsonl");
    h.write_jsonl(&path).unwrap();
    let back = History::from_jsonl(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(back, h);
}

#[test]
fn assert_ok_dumps_a_failing_history_and_says_where() {
    let h = H::default().ok(0, 1, publish("m1")).build();
    let err = std::panic::catch_unwind(|| h.assert_ok("dump test/1")).unwrap_err();
    let msg = err.downcast_ref::<String>().unwrap();
    assert!(msg.contains("lost m1"), "{msg}");
    let path = msg
        .rsplit("history written to ")
        .next()
        .map(std::path::PathBuf::from)
        .unwrap();
    assert!(path.ends_with(format!(
        "lazaret-history-dump_test_1-{}.jsonl",
        std::process::id()
    )));
    let back = History::from_jsonl(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(back, h);
    // A clean one returns its report.
    assert_eq!(History::default().assert_ok("clean").operations, 0);
}

#[test]
fn the_recorder_is_shared_by_threads_and_keeps_unfinished_calls_unknown() {
    let rec = Recorder::new();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            let rec = rec.clone();
            std::thread::spawn(move || {
                for i in 0..50 {
                    let id = format!("m{t}-{i}");
                    rec.invoke(publish(&id)).ok();
                    let call = rec.invoke(Op::deliver(id.as_str(), 1, "n1", false, Some(HASH)));
                    call.handled(Handled::Success);
                    rec.observe(broker_ack(&id));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let never = rec.invoke(publish("late"));
    assert_eq!(never.index(), 600);
    drop(never);
    let h = rec.history();
    assert_eq!(h.entries.len(), 601);
    assert!(h.entries.iter().enumerate().all(|(i, e)| e.index == i));
    assert!(
        h.entries
            .windows(2)
            .all(|w| w[0].invoke_ns <= w[1].invoke_ns)
    );
    let last = h.entries.last().unwrap();
    assert_eq!((last.outcome, last.complete_ns), (Outcome::Info, None));
    let r = rec.check();
    assert!(r.is_ok(), "{r}");
    assert_eq!((r.completed, r.indeterminate), (200, 1));
}

#[test]
fn the_payload_hash_is_fnv_1a() {
    // The published test vectors of 64-bit FNV-1a.
    assert_eq!(payload_hash(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(payload_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(payload_hash(b"foobar"), 0x8594_4171_f739_67e8);
}

#[test]
fn a_recorder_runs_on_a_fake_clock() {
    let now = Arc::new(AtomicU64::new(0));
    let clock = now.clone();
    let rec = Recorder::with_clock(move || clock.load(Ordering::SeqCst));
    now.store(5, Ordering::SeqCst);
    let call = rec.invoke(enqueue("j1"));
    now.store(9, Ordering::SeqCst);
    call.fail();
    rec.record(fault("restart"), Outcome::Info);
    let h = rec.history();
    assert_eq!(
        (h.entries[0].invoke_ns, h.entries[0].complete_ns),
        (5, Some(9))
    );
    assert_eq!(h.entries[1].invoke_ns, 9);
    assert!(rec.check().is_ok());
}

// ---------------------------------------------------------------------
// Generated histories.

/// SplitMix64: the generator's only randomness, from proptest's seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    /// True `pct` percent of the time.
    fn pct(&mut self, pct: u64) -> bool {
        self.below(100) < pct
    }
}

const ATTEMPTS_MAX: u32 = 3;
const TTL_MS: u64 = 10;

/// Writes a correct at-least-once run, id by id, each id's operations in
/// sequence from a random start so ids interleave.
struct Gen {
    rng: Rng,
    entries: Vec<Entry>,
    faults: bool,
    end: u64,
}

impl Gen {
    fn push(&mut self, t: &mut u64, dur: u64, outcome: Outcome, op: Op) -> (u64, u64) {
        let t0 = *t;
        let t1 = t0 + dur;
        self.entries.push(Entry {
            index: 0,
            invoke_ns: t0 * MS,
            complete_ns: Some(t1 * MS),
            outcome,
            op,
        });
        *t = t1 + 1 + self.rng.below(3);
        self.end = self.end.max(*t);
        (t0, t1)
    }

    /// The producer's call: `None` when nothing downstream should follow.
    fn source(&mut self, t: &mut u64, op: Op) -> Option<()> {
        let roll = self.rng.below(100);
        let (outcome, applied) = match roll {
            0..85 => (Outcome::Ok, true),
            85..90 => (Outcome::Info, true),
            90..95 => (Outcome::Info, false),
            _ => (Outcome::Fail, false),
        };
        let dur = 1 + self.rng.below(2);
        self.push(t, dur, outcome, op);
        applied.then_some(())
    }

    fn guard(&mut self, id: &str, hash: u64) -> Vec<Op> {
        let mut t = self.rng.below(500);
        let published = self.source(
            &mut t,
            Op::Publish {
                id: id.into(),
                payload_hash: hash,
            },
        );
        if published.is_none() {
            return Vec::new();
        }
        if self.rng.pct(5) {
            return vec![remaining(id)];
        }
        let d = |attempt, redelivered, result: Option<Handled>| {
            let op = Op::deliver(id, attempt, "n1", redelivered, Some(hash));
            match result {
                Some(r) => op.handled(r),
                None => op,
            }
        };
        let mut generation = 0;
        loop {
            let mut attempt = 1;
            let dead = loop {
                let roll = self.rng.below(100);
                let (outcome, result) = match roll {
                    0..50 => (Outcome::Ok, Some(Handled::Success)),
                    50..75 => (Outcome::Ok, Some(Handled::Transient)),
                    75..85 => (Outcome::Ok, Some(Handled::Permanent)),
                    85..95 => (Outcome::Info, None),
                    _ => (Outcome::Ok, Some(Handled::Deferred)),
                };
                let dur = 1 + self.rng.below(4);
                self.push(&mut t, dur, outcome, d(attempt, false, result));
                match result {
                    Some(Handled::Success) => {
                        // The ack may be lost: the broker delivers it again.
                        if self.rng.pct(20) {
                            if self.faults && self.rng.pct(50) {
                                self.push(&mut t, 1, Outcome::Info, fault("close_all_connections"));
                                self.push(&mut t, 1, Outcome::Ok, d(attempt, false, result));
                            } else {
                                self.push(&mut t, 1, Outcome::Info, broker_ack(id));
                                self.push(&mut t, 1, Outcome::Ok, d(attempt, true, result));
                            }
                        }
                        self.push(&mut t, 1, Outcome::Ok, broker_ack(id));
                        break false;
                    }
                    Some(Handled::Transient) if attempt >= ATTEMPTS_MAX => break true,
                    Some(Handled::Transient) => attempt += 1,
                    Some(Handled::Permanent) => break true,
                    Some(Handled::Deferred) => {}
                    // The handler never returned: the same attempt again, or the next.
                    _ => attempt += u32::from(self.rng.pct(50)),
                }
            };
            if !dead {
                return vec![completed(id)];
            }
            let dl = format!("{id}-dl{generation}");
            self.push(
                &mut t,
                1,
                Outcome::Ok,
                Op::DeadLetter {
                    id: id.into(),
                    dead_letter_id: dl.clone(),
                    has_history: true,
                    has_payload: true,
                    payload_hash: Some(hash),
                },
            );
            self.push(&mut t, 1, Outcome::Ok, broker_ack(id));
            if generation < 2 && self.rng.pct(40) {
                self.push(&mut t, 1, Outcome::Ok, redrive(id));
                generation += 1;
                continue;
            }
            return vec![Op::ObservedDeadLetter {
                id: id.into(),
                dead_letter_id: dl,
                has_history: true,
                has_payload: true,
                payload_hash: Some(hash),
            }];
        }
    }

    fn queue(&mut self, id: &str, hash: u64) -> Vec<Op> {
        let mut t = self.rng.below(500);
        let enqueued = self.source(
            &mut t,
            Op::Enqueue {
                id: id.into(),
                payload_hash: hash,
            },
        );
        if enqueued.is_none() {
            return Vec::new();
        }
        let mut tokens = 0;
        let mut generation = 0;
        let mut stale: Option<String> = None;
        loop {
            let mut attempt = 1;
            let dead = loop {
                tokens += 1;
                let token = format!("{id}-t{tokens}");
                let op = Op::Lease {
                    id: id.into(),
                    token: token.clone(),
                    attempt,
                    ttl_ms: Some(TTL_MS),
                    payload_hash: Some(hash),
                };
                let (granted, _) = self.push(&mut t, 1, Outcome::Ok, op);
                // The expired lease's worker answers late and is refused.
                if let Some(old) = stale.take() {
                    self.push(&mut t, 1, Outcome::Fail, lease_lost(id, &old));
                }
                let roll = self.rng.below(100);
                let acked = |result| ack(id, &token, result);
                match roll {
                    0..45 => {
                        self.push(&mut t, 1, Outcome::Ok, acked(Handled::Success));
                        break false;
                    }
                    // The reply to the final ack is lost; the ack was applied.
                    45..50 => {
                        self.push(&mut t, 1, Outcome::Info, acked(Handled::Success));
                        break false;
                    }
                    50..75 => {
                        self.push(&mut t, 1, Outcome::Ok, acked(Handled::Transient));
                        if attempt >= ATTEMPTS_MAX {
                            break true;
                        }
                        attempt += 1;
                    }
                    75..80 => {
                        self.push(&mut t, 1, Outcome::Ok, acked(Handled::Deferred));
                    }
                    80..95 => {
                        // The worker stalls; the lease runs out.
                        t = t.max(granted + TTL_MS + 1);
                        stale = Some(token);
                        attempt += 1;
                        if attempt > ATTEMPTS_MAX {
                            // The expiry charged the last attempt.
                            self.push(
                                &mut t,
                                1,
                                Outcome::Fail,
                                lease_lost(id, stale.as_ref().unwrap()),
                            );
                            stale = None;
                            break true;
                        }
                    }
                    _ => {
                        self.push(&mut t, 1, Outcome::Ok, acked(Handled::Permanent));
                        break true;
                    }
                }
            };
            if !dead {
                return vec![completed(id)];
            }
            let dl = format!("{id}-dl{generation}");
            let record = |observed: bool| {
                let op = if observed {
                    observed_dead_letter(id, &dl)
                } else {
                    dead_letter(id, &dl)
                };
                with_hash(op, hash)
            };
            self.push(&mut t, 1, Outcome::Ok, record(false));
            if generation < 2 && self.rng.pct(40) {
                self.push(&mut t, 1, Outcome::Ok, redrive(id));
                generation += 1;
                continue;
            }
            return vec![record(true)];
        }
    }
}

/// A dead letter record with the payload hash `hash`.
fn with_hash(mut op: Op, hash: u64) -> Op {
    if let Op::DeadLetter { payload_hash, .. } | Op::ObservedDeadLetter { payload_hash, .. } =
        &mut op
    {
        *payload_hash = Some(hash);
    }
    op
}

/// A clean run of `n` guard messages and `n` queue jobs.
fn generate(seed: u64, n: usize, faults: bool) -> History {
    let mut g = Gen {
        rng: Rng(seed),
        entries: Vec::new(),
        faults,
        end: 0,
    };
    let mut finals = Vec::new();
    for i in 0..n {
        let hash = g.rng.next();
        finals.extend(g.guard(&format!("m{i}"), hash));
        let hash = g.rng.next();
        finals.extend(g.queue(&format!("j{i}"), hash));
    }
    if faults {
        for _ in 0..g.rng.below(4) {
            let mut t = g.rng.below(g.end.max(1));
            g.push(&mut t, 5, Outcome::Info, fault("rabbitmqctl stop_app"));
        }
    }
    let mut t = g.end + 10;
    for op in finals {
        g.push(&mut t, 0, Outcome::Ok, op);
    }
    let mut entries = g.entries;
    entries.sort_by_key(|e| e.invoke_ns);
    History::new(entries)
}

/// The faults the generator's runs can have injected, each as the anomaly
/// the checker must then report.
const INJECTABLE: [AnomalyKind; 11] = AnomalyKind::ALL;

/// Breaks a clean history with one fault of `kind`; `None` when the
/// history has nothing to break that way. `pick` chooses where.
fn inject(h: &History, kind: AnomalyKind, pick: u64) -> Option<History> {
    let mut es = h.entries.clone();
    let choose = |candidates: Vec<usize>| -> Option<usize> {
        (!candidates.is_empty()).then(|| candidates[(pick % candidates.len() as u64) as usize])
    };
    let id_of = |i: usize, es: &[Entry]| es[i].op.id().unwrap_or_default().to_owned();
    let where_ = |es: &[Entry], f: &dyn Fn(&Entry) -> bool| -> Vec<usize> {
        es.iter()
            .enumerate()
            .filter(|(_, e)| f(e))
            .map(|(i, _)| i)
            .collect()
    };
    let is_source = |e: &Entry| matches!(e.op, Op::Enqueue { .. } | Op::Publish { .. });
    let ok = |e: &Entry| e.outcome == Outcome::Ok;
    match kind {
        AnomalyKind::Lost => {
            // Everything after an acknowledged enqueue or publish vanishes.
            let i = choose(where_(&es, &|e| ok(e) && is_source(e)))?;
            let id = id_of(i, &es);
            if es.iter().filter(|e| e.op.id() == Some(&id)).count() < 2
                || es
                    .iter()
                    .any(|e| e.op.id() == Some(&id) && matches!(e.op, Op::ObservedRemaining { .. }))
            {
                return None;
            }
            es.retain(|e| e.op.id() != Some(&id) || is_source(e));
        }
        AnomalyKind::Unexpected => {
            let i = choose(where_(&es, &|e| !is_source(e) && e.op.id().is_some()))?;
            let id = id_of(i, &es);
            es.retain(|e| e.op.id() != Some(&id) || !is_source(e));
        }
        AnomalyKind::PayloadMismatch => {
            let i = choose(where_(&es, &|e| {
                ok(e) && matches!(e.op, Op::Deliver { .. } | Op::Lease { .. })
            }))?;
            if let Op::Deliver { payload_hash, .. } | Op::Lease { payload_hash, .. } = &mut es[i].op
            {
                *payload_hash = payload_hash.map(|h| h ^ 1);
            }
        }
        AnomalyKind::DeadLetterIncomplete => {
            let i = choose(where_(&es, &|e| matches!(e.op, Op::DeadLetter { .. })))?;
            if let Op::DeadLetter { has_payload, .. } = &mut es[i].op {
                *has_payload = false;
            }
        }
        AnomalyKind::DeadLetteredTwice => {
            let i = choose(where_(&es, &|e| matches!(e.op, Op::DeadLetter { .. })))?;
            let mut twin = es[i].clone();
            if let Op::DeadLetter { dead_letter_id, .. } = &mut twin.op {
                dead_letter_id.push_str("-again");
            }
            es.insert(i + 1, twin);
        }
        AnomalyKind::Duplicated => {
            // The same attempt handed to the handler twice at once.
            let i = choose(where_(&es, &|e| {
                ok(e)
                    && matches!(
                        e.op,
                        Op::Deliver {
                            result: Some(Handled::Success),
                            ..
                        }
                    )
            }))?;
            let mut twin = es[i].clone();
            twin.invoke_ns += 1;
            if let Op::Deliver { redelivered, .. } = &mut twin.op {
                *redelivered = false;
            }
            es.insert(i + 1, twin);
        }
        AnomalyKind::DeliveryAfterAck => {
            let i = choose(where_(&es, &|e| {
                ok(e)
                    && matches!(
                        e.op,
                        Op::BrokerAck { .. }
                            | Op::Ack {
                                result: Handled::Success,
                                ..
                            }
                    )
            }))?;
            let id = id_of(i, &es);
            let after = es[i].end_ns() + MS;
            let op = match es[i].op {
                Op::BrokerAck { .. } => deliver(&id, 9, true, Handled::Success),
                _ => lease(&id, "late", 9, TTL_MS),
            };
            es.push(Entry {
                index: 0,
                invoke_ns: after,
                complete_ns: Some(after + MS),
                outcome: Outcome::Ok,
                op,
            });
        }
        AnomalyKind::AttemptBackwards => {
            let i = choose(where_(&es, &|e| {
                ok(e)
                    && matches!(
                        e.op,
                        Op::Deliver { attempt: 2.., .. } | Op::Lease { attempt: 2.., .. }
                    )
            }))?;
            if let Op::Deliver { attempt, .. } | Op::Lease { attempt, .. } = &mut es[i].op {
                *attempt = 0;
            }
        }
        AnomalyKind::AckedUnhandled => {
            // Every success of a message never dead-lettered becomes a failure.
            let i = choose(where_(&es, &|e| {
                matches!(
                    e.op,
                    Op::Deliver {
                        result: Some(Handled::Success),
                        ..
                    }
                )
            }))?;
            let id = id_of(i, &es);
            if es.iter().any(|e| {
                e.op.id() == Some(&id) && matches!(e.op, Op::DeadLetter { .. } | Op::Redrive { .. })
            }) {
                return None;
            }
            for e in es.iter_mut().filter(|e| e.op.id() == Some(&id)) {
                if let Op::Deliver { result, .. } = &mut e.op {
                    *result = Some(Handled::Transient);
                }
            }
        }
        AnomalyKind::StaleAckAccepted => {
            // A late ack of an expired lease is accepted after all.
            let i = choose(where_(&es, &|e| {
                e.outcome == Outcome::Fail && matches!(e.op, Op::Ack { .. })
            }))?;
            let token = match &es[i].op {
                Op::Ack { token, .. } => token.clone(),
                _ => return None,
            };
            let id = id_of(i, &es);
            // Only when a newer lease was granted before it.
            if !es.iter().any(|e| {
                e.op.id() == Some(&id)
                    && matches!(&e.op, Op::Lease { token: t, .. } if *t != token)
                    && e.end_ns() < es[i].invoke_ns
                    && es.iter().any(|m| {
                        matches!(&m.op, Op::Lease { token: t, .. } if *t == token)
                            && m.end_ns() < e.invoke_ns
                    })
            }) {
                return None;
            }
            es[i].outcome = Outcome::Ok;
        }
        AnomalyKind::OverlappingLeases => {
            // An expired lease (never acked but refused) had a long life.
            let expired: BTreeSet<String> = es
                .iter()
                .filter_map(|e| match &e.op {
                    Op::Ack { token, .. } if e.outcome == Outcome::Fail => Some(token.clone()),
                    _ => None,
                })
                .collect();
            let i = choose(where_(
                &es,
                &|e| matches!(&e.op, Op::Lease { token, .. } if expired.contains(token)),
            ))?;
            let (id, token) = match &es[i].op {
                Op::Lease { id, token, .. } => (id.clone(), token.clone()),
                _ => return None,
            };
            // Only when another lease followed it.
            if !es.iter().any(|e| {
                e.op.id() == Some(&id)
                    && matches!(&e.op, Op::Lease { token: t, .. } if *t != token)
                    && es[i].precedes(e)
            }) {
                return None;
            }
            if let Op::Lease { ttl_ms, .. } = &mut es[i].op {
                *ttl_ms = Some(1_000_000);
            }
        }
    }
    es.sort_by_key(|e| e.invoke_ns);
    Some(History::new(es))
}

#[test]
fn generated_clean_runs_pass_and_every_injected_fault_is_caught() {
    let mut injected = std::collections::BTreeMap::new();
    let mut seen = Report::default();
    for seed in 0..200 {
        let h = generate(seed, 6, seed % 2 == 0);
        let r = h.check();
        assert!(r.is_ok(), "seed {seed}: {r}");
        seen.recovered += r.recovered;
        seen.indeterminate += r.indeterminate;
        seen.remaining += r.remaining;
        seen.dead_lettered += r.dead_lettered;
        for (cause, n) in r.duplicated_allowed {
            *seen.duplicated_allowed.entry(cause).or_insert(0) += n;
        }
        let h = generate(seed, 6, false);
        for kind in INJECTABLE {
            let Some(broken) = inject(&h, kind, seed) else {
                continue;
            };
            let r = broken.check();
            assert!(r.count(kind) > 0, "seed {seed}, injected {kind}: {r}");
            *injected.entry(kind).or_insert(0) += 1;
        }
    }
    // The clean runs were not clean by having nothing in them.
    assert!(
        seen.recovered > 0 && seen.indeterminate > 0 && seen.remaining > 0,
        "{seen}"
    );
    assert!(seen.dead_lettered > 0, "{seen}");
    for cause in [
        "broker_redelivery",
        "fault",
        "handler_unfinished",
        "lease_expired",
    ] {
        assert!(seen.duplicated_allowed.contains_key(cause), "{seen}");
    }
    for kind in INJECTABLE {
        assert!(
            injected.get(&kind).copied().unwrap_or(0) >= 10,
            "{kind} injected only {:?} times",
            injected.get(&kind)
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn a_generated_clean_run_has_no_anomaly(seed in any::<u64>(), n in 1usize..24, faults in any::<bool>()) {
        let h = generate(seed, n, faults);
        let r = h.check();
        prop_assert!(r.is_ok(), "{}", r);
        // Every generated redelivery the checker saw is an allowed one.
        prop_assert_eq!(r.count(AnomalyKind::Duplicated), 0);
    }

    #[test]
    fn one_injected_fault_is_caught(seed in any::<u64>(), n in 1usize..24, which in 0usize..11, pick in any::<u64>()) {
        let h = generate(seed, n, false);
        let kind = INJECTABLE[which];
        let broken = inject(&h, kind, pick);
        prop_assume!(broken.is_some());
        let r = broken.unwrap().check();
        prop_assert!(r.count(kind) > 0, "injected {}: {}", kind, r);
    }
}
