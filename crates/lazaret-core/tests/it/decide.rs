//! The decision table, proven: budgets, classes, backoff bounds, state edges.

use std::time::Duration;

use expect_test::expect;
use lazaret_core::{
    Backoff, CorrectedPayload, DeadLetterReason, Envelope, Event, Failure, FailureClass, JobId,
    JobState, Lane, PAYLOAD_EDITS_MAX, SplitMix64, Timestamp, Transition, TypePolicy, decide,
    grant_lease, payload_sha256, redrive, redrive_corrected,
};
use proptest::prelude::*;

fn envelope() -> Envelope {
    Envelope::new(
        JobId(1),
        "send_email".into(),
        "acme".into(),
        Lane::default_lane(),
        b"{}",
        Timestamp::EPOCH,
    )
}

fn t(ms: i64) -> Timestamp {
    Timestamp::from_millis(ms)
}

/// Leases and fails once; returns the transition.
fn deliver(
    env: &mut Envelope,
    policy: &TypePolicy,
    event: Event,
    now: i64,
    rng: &mut SplitMix64,
) -> Transition {
    grant_lease(env, Some(&"w-1".into()), t(now));
    decide(env, policy, event, t(now + 1), rng)
}

fn transient(kind: &str) -> Event {
    Event::Failed(Failure::new(kind, "boom"))
}

#[test]
fn success_on_first_delivery() {
    let mut env = envelope();
    let tr = deliver(
        &mut env,
        &TypePolicy::default(),
        Event::Succeeded,
        0,
        &mut SplitMix64::new(1),
    );
    assert_eq!(tr, Transition::Succeeded);
    assert_eq!(env.attempts, 1);
    assert_eq!(env.history.len(), 1);
}

#[test]
fn permanent_is_dead_lettered_at_once() {
    let mut env = envelope();
    let ev = Event::Failed(
        Failure::new("validation", "missing field").with_class(FailureClass::Permanent),
    );
    let tr = deliver(
        &mut env,
        &TypePolicy::default(),
        ev,
        0,
        &mut SplitMix64::new(1),
    );
    assert_eq!(
        tr,
        Transition::DeadLetter {
            reason: DeadLetterReason::Permanent
        }
    );
    assert_eq!(
        env.last_error().unwrap().class,
        Some(FailureClass::Permanent)
    );
}

#[test]
fn transient_retries_until_attempts_max_then_exhausted() {
    let policy = TypePolicy {
        attempts_max: 3,
        ..TypePolicy::default()
    };
    let mut env = envelope();
    let mut rng = SplitMix64::new(9);
    assert!(matches!(
        deliver(&mut env, &policy, transient("timeout"), 0, &mut rng),
        Transition::Retry { attempt: 1, .. }
    ));
    assert!(matches!(
        deliver(&mut env, &policy, transient("timeout"), 10, &mut rng),
        Transition::Retry { attempt: 2, .. }
    ));
    assert_eq!(
        deliver(&mut env, &policy, transient("timeout"), 20, &mut rng),
        Transition::DeadLetter {
            reason: DeadLetterReason::Exhausted
        }
    );
    assert_eq!(env.history.len(), 3);
}

#[test]
fn kind_budgets_retry_parse_once_and_never_validation() {
    let mut policy = TypePolicy::default();
    policy.kinds.insert("parse".into(), 2);
    policy.kinds.insert("validation".into(), 1);
    let mut rng = SplitMix64::new(1);

    let mut env = envelope();
    assert!(matches!(
        deliver(&mut env, &policy, transient("parse"), 0, &mut rng),
        Transition::Retry { .. }
    ));
    assert_eq!(
        deliver(&mut env, &policy, transient("parse"), 10, &mut rng),
        Transition::DeadLetter {
            reason: DeadLetterReason::KindExhausted
        }
    );

    let mut env = envelope();
    assert_eq!(
        deliver(&mut env, &policy, transient("validation"), 0, &mut rng),
        Transition::DeadLetter {
            reason: DeadLetterReason::KindExhausted
        }
    );
}

#[test]
fn kind_classes_classify_failures_sent_without_a_class() {
    let mut policy = TypePolicy::default();
    policy
        .kind_classes
        .insert("http_404".into(), FailureClass::Permanent);
    let mut env = envelope();
    assert_eq!(
        deliver(
            &mut env,
            &policy,
            transient("http_404"),
            0,
            &mut SplitMix64::new(1)
        ),
        Transition::DeadLetter {
            reason: DeadLetterReason::Permanent
        }
    );
}

#[test]
fn deferral_spends_no_attempt_and_is_bounded() {
    // The contract's example: with deferrals_max = 2 the first two
    // deferrals reschedule and the third dead-letters.
    let policy = TypePolicy {
        deferrals_max: 2,
        ..TypePolicy::default()
    };
    let mut env = envelope();
    let mut rng = SplitMix64::new(1);
    let defer = || {
        Event::Failed(
            Failure::new("http_429", "slow down")
                .with_class(FailureClass::Deferred)
                .with_retry_after(Duration::from_secs(7)),
        )
    };
    assert_eq!(
        deliver(&mut env, &policy, defer(), 0, &mut rng),
        Transition::Defer { until: t(7001) }
    );
    assert_eq!(env.attempts, 0, "a deferral is not charged");
    assert_eq!(
        grant_lease(&mut env, None, t(8000)),
        1,
        "the next delivery shows the same attempt number"
    );
    assert!(matches!(
        decide(&mut env, &policy, defer(), t(8001), &mut rng),
        Transition::Defer { .. }
    ));
    assert_eq!(
        deliver(&mut env, &policy, defer(), 20_000, &mut rng),
        Transition::DeadLetter {
            reason: DeadLetterReason::DeferralsExhausted
        }
    );
}

#[test]
fn lease_expiries_charge_attempts_and_crash_loop() {
    let policy = TypePolicy {
        attempts_max: 10,
        crash_loop_max: 3,
        ..TypePolicy::default()
    };
    let mut env = envelope();
    let mut rng = SplitMix64::new(1);
    assert!(matches!(
        deliver(&mut env, &policy, Event::LeaseExpired, 0, &mut rng),
        Transition::Retry { attempt: 1, .. }
    ));
    assert!(matches!(
        deliver(&mut env, &policy, Event::LeaseExpired, 10, &mut rng),
        Transition::Retry { attempt: 2, .. }
    ));
    assert_eq!(
        deliver(&mut env, &policy, Event::LeaseExpired, 20, &mut rng),
        Transition::DeadLetter {
            reason: DeadLetterReason::CrashLoop
        }
    );
    assert_eq!(env.crashes, 3);
    assert_eq!(env.last_error().unwrap().kind.as_str(), "lease_expired");
}

#[test]
fn retry_after_wins_when_longer_than_backoff() {
    let policy = TypePolicy {
        backoff: Backoff {
            base: Duration::from_millis(10),
            cap: Duration::from_millis(20),
            ..Backoff::default()
        },
        ..TypePolicy::default()
    };
    let mut env = envelope();
    let ev =
        Event::Failed(Failure::new("http_503", "busy").with_retry_after(Duration::from_secs(60)));
    let tr = deliver(&mut env, &policy, ev, 0, &mut SplitMix64::new(1));
    assert_eq!(
        tr,
        Transition::Retry {
            at: t(60_001),
            attempt: 1
        }
    );
}

#[test]
fn redrive_renews_the_budget_and_keeps_history() {
    let policy = TypePolicy {
        attempts_max: 1,
        ..TypePolicy::default()
    };
    let mut env = envelope();
    let mut rng = SplitMix64::new(1);
    deliver(&mut env, &policy, transient("timeout"), 0, &mut rng);
    assert_eq!(redrive(&mut env), JobState::Queued);
    assert_eq!(
        (env.attempts, env.redrive_count, env.history.len()),
        (0, 1, 1)
    );
    assert_eq!(
        deliver(&mut env, &policy, Event::Succeeded, 100, &mut rng),
        Transition::Succeeded
    );
    assert_eq!(env.history.len(), 2);
}

fn correction<'a>(previous: &'a [u8], payload: &'a [u8], now: i64) -> CorrectedPayload<'a> {
    CorrectedPayload {
        previous,
        payload,
        schema_version: Some(2),
        actor: "ops-alice",
        reason: "the address was missing its domain",
        now: t(now),
    }
}

#[test]
fn a_corrected_redrive_describes_the_new_payload_and_keeps_the_old() {
    let policy = TypePolicy {
        attempts_max: 1,
        ..TypePolicy::default()
    };
    let mut env = envelope();
    env.idempotency_key = Some("order-42".into());
    let mut rng = SplitMix64::new(1);
    deliver(&mut env, &policy, transient("timeout"), 0, &mut rng);
    let new = br#"{"to":"a@example.com"}"#;
    let state = redrive_corrected(&mut env, correction(b"{}", new, 50));
    assert_eq!(state, JobState::Queued);
    assert_eq!(
        (env.id, env.idempotency_key.as_deref()),
        (JobId(1), Some("order-42"))
    );
    assert_eq!(
        (env.attempts, env.redrive_count, env.history.len()),
        (0, 1, 1)
    );
    assert_eq!(env.payload_size, new.len() as u64);
    assert_eq!(env.payload_sha256, hex::encode(payload_sha256(new)));
    assert_eq!(env.schema_version, Some(2));
    let edit = &env.payload_edits[..];
    assert_eq!(edit.len(), 1);
    assert_eq!(edit[0].previous_payload, "{}");
    assert_eq!(edit[0].previous_size, 2);
    assert_eq!(edit[0].previous_sha256, hex::encode(payload_sha256(b"{}")));
    assert_eq!(edit[0].previous_schema_version, None);
    assert_eq!(
        (edit[0].actor.as_str(), edit[0].redrive, edit[0].at),
        ("ops-alice", 1, t(50))
    );
    // It survives the store's round trip.
    assert_eq!(Envelope::from_json(&env.to_json()).unwrap(), env);
}

#[test]
fn payload_edits_are_bounded_and_keep_the_payload_as_admitted() {
    let mut env = envelope();
    let payloads: Vec<String> = (0..PAYLOAD_EDITS_MAX + 3)
        .map(|n| format!("{{\"n\":{n}}}"))
        .collect();
    let mut previous = b"{}".to_vec();
    for (n, p) in payloads.iter().enumerate() {
        redrive_corrected(&mut env, correction(&previous, p.as_bytes(), n as i64));
        previous = p.clone().into_bytes();
    }
    assert_eq!(env.payload_edits.len(), PAYLOAD_EDITS_MAX);
    assert_eq!(env.payload_edits_dropped, 3);
    assert_eq!(
        env.payload_edits[0].previous_payload, "{}",
        "the original stays"
    );
    let last = env.payload_edits.last().unwrap();
    assert_eq!(last.previous_payload, payloads[payloads.len() - 2]);
}

#[test]
fn envelope_round_trips_through_json() {
    let mut env = envelope();
    env.idempotency_key = Some("order-42".into());
    let mut rng = SplitMix64::new(1);
    deliver(
        &mut env,
        &TypePolicy::default(),
        transient("timeout"),
        0,
        &mut rng,
    );
    let back = Envelope::from_json(&env.to_json()).unwrap();
    assert_eq!(back, env);
    assert!(
        Envelope::from_json("{\"id\":1}")
            .unwrap_err()
            .to_string()
            .contains("not valid")
    );
}

#[test]
fn backoff_schedule_snapshot() {
    let b = Backoff {
        base: Duration::from_millis(100),
        cap: Duration::from_secs(10),
        ..Backoff::default()
    };
    let mut rng = SplitMix64::new(42);
    let mut table = String::from("attempt  ceiling_ms  delay_ms\n");
    for attempt in 1..=10 {
        let d = b.delay(attempt, &mut rng);
        table.push_str(&format!(
            "{attempt:>7}  {:>10}  {:>8}\n",
            b.ceiling(attempt).as_millis(),
            d.as_millis()
        ));
    }
    expect![[r#"
        attempt  ceiling_ms  delay_ms
              1         100        74
              2         200        32
              3         400       111
              4         800       275
              5        1600        60
              6        3200      2779
              7        6400      1398
              8       10000      8007
              9       10000      3399
             10       10000      6185
    "#]]
    .assert_eq(&table);
}

// ---- properties ----

#[derive(Clone, Debug)]
enum Step {
    Succeed,
    Transient(u8),
    Permanent,
    Defer(Option<u32>),
    Expire,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        1 => Just(Step::Succeed),
        4 => (0u8..4).prop_map(Step::Transient),
        1 => Just(Step::Permanent),
        2 => proptest::option::of(0u32..100_000).prop_map(Step::Defer),
        2 => Just(Step::Expire),
    ]
}

const KINDS: [&str; 4] = ["timeout", "parse", "validation", "http_503"];

fn policy() -> impl Strategy<Value = TypePolicy> {
    (
        1u32..8,
        1u32..5,
        1u32..6,
        0u64..5_000,
        0u64..100_000,
        0u64..1000,
        proptest::option::of(1u32..4),
    )
        .prop_map(
            |(attempts_max, crash_loop_max, deferrals_max, base, cap, floor, parse)| {
                let mut p = TypePolicy {
                    attempts_max,
                    crash_loop_max,
                    deferrals_max,
                    backoff: Backoff {
                        base: Duration::from_millis(base),
                        cap: Duration::from_millis(cap.max(floor)),
                        floor: Duration::from_millis(floor),
                        schedule: Vec::new(),
                    },
                    ..TypePolicy::default()
                };
                if let Some(n) = parse {
                    p.kinds.insert("parse".into(), n);
                }
                p
            },
        )
}

fn event_of(s: &Step) -> Event {
    match s {
        Step::Succeed => Event::Succeeded,
        Step::Transient(k) => Event::Failed(Failure::new(KINDS[*k as usize], "x")),
        Step::Permanent => {
            Event::Failed(Failure::new("bad", "x").with_class(FailureClass::Permanent))
        }
        Step::Defer(after) => {
            let mut f = Failure::new("http_429", "x").with_class(FailureClass::Deferred);
            f.retry_after = after.map(|ms| Duration::from_millis(ms.into()));
            Event::Failed(f)
        }
        Step::Expire => Event::LeaseExpired,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Walks a job through random outcomes until it ends; checks budgets,
    /// the permanent rule and that every transition is a state-machine edge.
    #[test]
    fn budgets_hold_and_transitions_are_edges(policy in policy(), steps in proptest::collection::vec(step(), 1..40), seed: u64) {
        let mut env = envelope();
        let mut rng = SplitMix64::new(seed);
        let mut now = 0i64;
        let mut state = JobState::Queued;
        for s in &steps {
            prop_assert!(state.can_become(JobState::Leased));
            let attempt = grant_lease(&mut env, None, t(now));
            state = JobState::Leased;
            prop_assert!(attempt <= policy.attempts_max, "leased attempt {attempt} over attempts_max {}", policy.attempts_max);
            prop_assert!(env.crashes < policy.crash_loop_max);
            prop_assert!(env.deferrals <= policy.deferrals_max);
            now += 1;
            let tr = decide(&mut env, &policy, event_of(s), t(now), &mut rng);
            let next = tr.next_state(t(now));
            prop_assert!(state.can_become(next), "{state} -> {next} is not an edge");
            state = next;
            match (s, tr) {
                (Step::Permanent, tr) => prop_assert_eq!(tr, Transition::DeadLetter { reason: DeadLetterReason::Permanent }),
                (Step::Succeed, tr) => prop_assert_eq!(tr, Transition::Succeeded),
                (_, Transition::Retry { at, attempt }) => {
                    prop_assert!(at >= t(now));
                    prop_assert_eq!(attempt, env.attempts);
                }
                _ => {}
            }
            if state.is_terminal() {
                break;
            }
            if state == JobState::Scheduled {
                prop_assert!(state.can_become(JobState::Queued));
                state = JobState::Queued;
            }
            now += 100_000_000;
        }
    }

    #[test]
    fn backoff_stays_within_floor_and_cap(base in 0u64..u64::MAX / 2, cap in 0u64..u64::MAX / 2, floor in 0u64..1_000_000, attempt: u32, seed: u64) {
        let b = Backoff {
            base: Duration::from_millis(base),
            cap: Duration::from_millis(cap.max(floor)),
            floor: Duration::from_millis(floor),
            schedule: Vec::new(),
        };
        let d = b.delay(attempt, &mut SplitMix64::new(seed));
        prop_assert!(d >= b.floor && d <= b.cap, "{d:?} outside [{:?}, {:?}]", b.floor, b.cap);
    }

    #[test]
    fn jitter_is_full_not_fixed(seed: u64) {
        // Two jobs that fail at the same moment rarely wake at the same moment.
        let b = Backoff { base: Duration::from_secs(10), cap: Duration::from_secs(10), ..Backoff::default() };
        let mut rng = SplitMix64::new(seed);
        let draws: std::collections::BTreeSet<_> = (0..20).map(|_| b.delay(1, &mut rng)).collect();
        prop_assert!(draws.len() > 10);
    }
}
