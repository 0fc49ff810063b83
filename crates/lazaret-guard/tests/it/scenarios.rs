//! The behaviours every broker must show, written once and run against
//! each through [`TestBroker`] (`scenario_suite!`): the line is never held,
//! retries wait and survive a restart, exhaustion quarantines once with the
//! whole history, a crash between quarantine and acknowledgement leaves one
//! dead letter, a redrive republishes, a watch source files the broker's
//! own dead letters, and a message reusing another's id (another body) is
//! a message of its own, quarantined or held.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use lazaret_core::{AttemptOutcome, DeadLetterReason, Failure, FailureClass};
use lazaret_guard::{Faults, Mode, Outcome, Settled, SourceSet};
use lazaret_store::{Held, Stage, Store};
use serde_json::{Value, json};

use crate::common::*;
use lazaret_guard::Host;

/// Expands to one `#[tokio::test]` per scenario; `$make` is an expression
/// evaluating to a future of `Option<impl TestBroker>` (`None`: skipped,
/// after saying so).
macro_rules! scenario_suite {
    ($make:expr) => {
        $crate::scenarios::scenario_suite!(@tests $make;
            a_poison_message_at_the_head_does_not_delay_the_healthy_ones_behind_it
                => poison_at_the_head,
            a_transient_failure_is_retried_after_its_backoff_and_then_succeeds
                => transient_then_success,
            a_restart_mid_retry_keeps_the_attempt_count => restart_mid_retry,
            a_message_that_always_fails_ends_as_exactly_one_dead_letter_with_its_history
                => always_fails,
            a_crash_between_quarantine_and_ack_leaves_exactly_one_dead_letter
                => crash_between_quarantine_and_ack,
            a_redrive_republishes_and_the_message_is_processed => redrive_republishes,
            a_watch_source_files_the_brokers_own_dead_letter => watch_files_broker_dead_letters,
            a_watch_source_keeps_other_bodies_and_redriven_copies_under_a_quarantined_id
                => watch_keeps_messages_reusing_an_id,
            a_guard_keeps_other_bodies_and_redriven_copies_under_a_quarantined_id
                => guard_keeps_messages_reusing_an_id,
            a_guard_delivers_and_holds_another_body_under_an_id_whose_retry_is_held
                => guard_keeps_messages_reusing_a_held_id,
        );
    };
    (@tests $make:expr; $($test:ident => $scenario:ident),+ $(,)?) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $test() {
            let Some(b) = $make.await else { return };
            $crate::scenarios::$scenario(&b).await;
        }
    )+};
}
pub(crate) use scenario_suite;

/// How long any one wait in a scenario may take before it fails.
const PATIENCE: Duration = Duration::from_secs(60);

fn transient(msg: &str) -> Outcome {
    Outcome::Failure(Failure::new("http_503", msg).with_class(FailureClass::Transient))
}

fn permanent(msg: &str) -> Outcome {
    Outcome::Failure(Failure::new("http_400", msg).with_class(FailureClass::Permanent))
}

/// One delivery at a time: a poison message fails transiently at the head;
/// every healthy message behind it is delivered before its retry comes due.
pub async fn poison_at_the_head(b: &impl TestBroker) {
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("poison").await;
    let name = unique("poison");
    let mut spec = b.spec(&name, &queue, Mode::Guard);
    spec.concurrency = 1;
    let host = host(dir.path(), policies("orders", 3, Duration::from_secs(5)));
    b.produce(&queue, "poison", b"{\"bad\": true}", headers(json!({})))
        .await;
    for i in 0..10 {
        b.produce(&queue, &format!("ok-{i}"), b"{}", headers(json!({})))
            .await;
    }
    let log = Log::default();
    let handler = recording(&log, |s| {
        if s.message_id == "poison" {
            transient("downstream refused it")
        } else {
            Outcome::Success
        }
    });
    let (faults, settled) = settled_log();
    let g = start_guard(b, spec, Arc::clone(&host), handler, faults).await;
    let seen = log
        .wait_for(PATIENCE, |s| {
            s.iter().filter(|x| x.message_id.starts_with("ok-")).count() == 10
        })
        .await;
    // The healthy messages may overtake the poison's write (they settle
    // while it is under way); it is acknowledged once it is durable.
    wait_settled(&settled, "poison", Settled::HeldRetry, PATIENCE).await;
    // Every healthy message went through while the poison waited out its
    // backoff (5 s at least) in lazaret's store, not at the head of the queue.
    let poison: Vec<u32> = seen
        .iter()
        .filter(|s| s.message_id == "poison")
        .map(|s| s.attempt)
        .collect();
    assert_eq!(poison, vec![1], "{seen:#?}");
    assert_eq!(
        host.store()
            .message_held(lazaret_store::MessageKey::of(
                name.clone(),
                "poison",
                b"{\"bad\": true}",
                None
            ))
            .await
            .unwrap(),
        Held::Retry
    );
    g.stop().await.unwrap();
}

/// Attempt 1 fails transiently; attempt 2, after the backoff, succeeds.
pub async fn transient_then_success(b: &impl TestBroker) {
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("transient").await;
    let name = unique("transient");
    let spec = b.spec(&name, &queue, Mode::Guard);
    let backoff = Duration::from_millis(300);
    let host = host(dir.path(), policies("orders", 5, backoff));
    b.produce(
        &queue,
        "m-1",
        b"{\"n\": 1}",
        headers(json!({"x-app": "shop"})),
    )
    .await;
    let log = Log::default();
    let started = tokio::time::Instant::now();
    let times = Arc::new(std::sync::Mutex::new(Vec::new()));
    let t = Arc::clone(&times);
    let handler = recording(&log, move |s| {
        t.lock().unwrap().push(tokio::time::Instant::now());
        if s.attempt == 1 {
            transient("busy")
        } else {
            Outcome::Success
        }
    });
    let (faults, settled) = settled_log();
    let g = start_guard(b, spec, Arc::clone(&host), handler, faults).await;
    let seen = log.wait_for(PATIENCE, |s| s.len() >= 2).await;
    wait_settled(&settled, "m-1", Settled::Succeeded, PATIENCE).await;
    assert_eq!(
        seen.iter()
            .map(|s| (s.message_id.as_str(), s.attempt))
            .collect::<Vec<_>>(),
        vec![("m-1", 1), ("m-1", 2)]
    );
    assert_eq!(seen[1].body, b"{\"n\": 1}");
    let times = times.lock().unwrap().clone();
    assert!(
        times[1] - times[0] >= backoff,
        "the retry came {:?} after the failure, before its backoff of {backoff:?}",
        times[1] - times[0]
    );
    assert!(started.elapsed() < PATIENCE);
    assert!(dead_letters_of(host.store(), &name).await.is_empty());
    assert_eq!(
        host.store()
            .message_held(lazaret_store::MessageKey::of(
                name.clone(),
                "m-1",
                b"{\"n\": 1}",
                None
            ))
            .await
            .unwrap(),
        Held::Nothing,
        "a success leaves nothing held"
    );
    g.stop().await.unwrap();
}

/// The first attempt fails and its retry is held; lazaret stops and starts
/// again on the same store; the retry arrives as attempt 2.
pub async fn restart_mid_retry(b: &impl TestBroker) {
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("restart").await;
    let name = unique("restart");
    let spec = b.spec(&name, &queue, Mode::Guard);
    let pol = policies("orders", 5, Duration::from_secs(1));
    b.produce(&queue, "m-r", b"{}", headers(json!({}))).await;

    let first = host(dir.path(), pol.clone());
    let log1 = Log::default();
    let (faults, settled) = settled_log();
    let g1 = start_guard(
        b,
        spec.clone(),
        Arc::clone(&first),
        recording(&log1, |_| transient("try later")),
        faults,
    )
    .await;
    log1.wait_for(PATIENCE, |s| s.len() == 1).await;
    wait_settled(&settled, "m-r", Settled::HeldRetry, PATIENCE).await;
    g1.stop().await.unwrap();
    first.store().close().await.unwrap();
    drop(first);

    let second = host(dir.path(), pol);
    let log2 = Log::default();
    let g2 = start_guard(
        b,
        spec,
        Arc::clone(&second),
        recording(&log2, |_| Outcome::Success),
        Faults::default(),
    )
    .await;
    let seen = log2.wait_for(PATIENCE, |s| !s.is_empty()).await;
    assert_eq!((seen[0].message_id.as_str(), seen[0].attempt), ("m-r", 2));
    g2.stop().await.unwrap();
}

/// Three transient failures spend `attempts_max = 3`: one dead letter, with
/// the source's coordinates, the headers, the body and three attempts.
pub async fn always_fails(b: &impl TestBroker) {
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("exhaust").await;
    let name = unique("exhaust");
    let spec = b.spec(&name, &queue, Mode::Guard);
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    let body = b"{\"order\": 42, \"note\": \"caf\xc3\xa9\"}";
    b.produce(
        &queue,
        "m-x",
        body,
        headers(json!({"x-app": "shop", "trace": "t-1"})),
    )
    .await;
    let log = Log::default();
    let (faults, settled) = settled_log();
    let g = start_guard(
        b,
        spec,
        Arc::clone(&host),
        // A later message, once m-x is settled, succeeds (see below).
        recording(&log, |s| {
            if s.message_id == "m-after" {
                Outcome::Success
            } else {
                transient("downstream 500")
            }
        }),
        faults,
    )
    .await;
    let dls = wait_dead_letters(host.store(), &name, 1, PATIENCE).await;
    wait_settled(&settled, "m-x", Settled::Quarantined, PATIENCE).await;
    let dl = &dls[0];
    assert_eq!(dl.reason, DeadLetterReason::Exhausted);
    assert_eq!(dl.stage, Stage::Processing);
    assert_eq!(dl.attempts, 3);
    assert_eq!(dl.job_id, None);
    assert_eq!(dl.job_type.as_deref(), Some("orders"));
    assert_eq!(
        dl.idempotency_key.as_deref(),
        Some(format!("{name}:m-x").as_str())
    );
    let error = dl.error.as_ref().expect("the last error");
    assert_eq!(error.kind.as_str(), "http_503");
    assert_eq!(error.message, "downstream 500");
    assert_eq!(
        dl.history
            .iter()
            .map(|h| (h.attempt, h.outcome))
            .collect::<Vec<_>>(),
        vec![
            (1, AttemptOutcome::RetryScheduled),
            (2, AttemptOutcome::RetryScheduled),
            (3, AttemptOutcome::DeadLettered)
        ]
    );
    let src = dl
        .source
        .as_ref()
        .expect("a broker dead letter has its source");
    assert_eq!(src.name, name);
    assert_eq!(src.queue, queue);
    assert_eq!(src.message_id, "m-x");
    assert_eq!(src.headers.get("x-app"), Some(&Value::from("shop")));
    assert_eq!(src.headers.get("trace"), Some(&Value::from("t-1")));
    let payload = host.store().dead_letter_payload(dl.id).await.unwrap();
    assert_eq!(payload, Some(Some(body.to_vec())));
    // Nothing more is delivered: the broker message was acknowledged. A
    // message produced after it, handled, shows the source went past it.
    b.produce(&queue, "m-after", b"{}", headers(json!({})))
        .await;
    wait_settled(&settled, "m-after", Settled::Succeeded, PATIENCE).await;
    let seen = log.all();
    let of_x = seen.iter().filter(|s| s.message_id == "m-x").count();
    assert_eq!((of_x, seen.len()), (3, 4), "{seen:#?}");
    assert_eq!(dead_letters_of(host.store(), &name).await.len(), 1);
    g.stop().await.unwrap();
}

/// The runtime dies after the dead letter is durable and before the ack;
/// the restarted runtime gets the message again, recognises it and only
/// acknowledges it.
pub async fn crash_between_quarantine_and_ack(b: &impl TestBroker) {
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("crash").await;
    let name = unique("crash");
    let spec = b.spec(&name, &queue, Mode::Guard);
    let pol = policies("orders", 3, Duration::from_millis(100));
    b.produce(&queue, "m-k", b"{}", headers(json!({}))).await;

    let first = host(dir.path(), pol.clone());
    let log1 = Log::default();
    let crash = Faults {
        crash_after_write: Some(Arc::new(|d| d.message_id == "m-k")),
        ..Faults::default()
    };
    let g1 = start_guard(
        b,
        spec.clone(),
        Arc::clone(&first),
        recording(&log1, |_| permanent("no such customer")),
        crash,
    )
    .await;
    assert!(matches!(
        g1.join().await,
        Err(lazaret_guard::GuardError::Crashed)
    ));
    assert_eq!(dead_letters_of(first.store(), &name).await.len(), 1);
    first.store().close().await.unwrap();
    drop(first);

    let second = host(dir.path(), pol);
    let log2 = Log::default();
    let (faults, settled) = settled_log();
    let g2 = start_guard(
        b,
        spec,
        Arc::clone(&second),
        recording(&log2, |_| permanent("no such customer")),
        faults,
    )
    .await;
    wait_settled(&settled, "m-k", Settled::HeldAlready, PATIENCE).await;
    assert!(log2.all().is_empty(), "delivered again: {:#?}", log2.all());
    let dls = dead_letters_of(second.store(), &name).await;
    assert_eq!(dls.len(), 1);
    assert_eq!(dls[0].reason, DeadLetterReason::Permanent);
    g2.stop().await.unwrap();
}

/// A permanent failure is quarantined; the handler is fixed; a redrive
/// republishes the message with its id and attempt 0, and it succeeds.
pub async fn redrive_republishes(b: &impl TestBroker) {
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("redrive").await;
    let name = unique("redrive");
    let spec = b.spec(&name, &queue, Mode::Guard);
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    b.produce(
        &queue,
        "m-d",
        b"{\"v\": 1}",
        headers(json!({"x-app": "shop"})),
    )
    .await;
    let fixed = Arc::new(AtomicBool::new(false));
    let f = Arc::clone(&fixed);
    let log = Log::default();
    let (faults, settled) = settled_log();
    let g = start_guard(
        b,
        spec.clone(),
        Arc::clone(&host),
        recording(&log, move |_| {
            if f.load(Ordering::SeqCst) {
                Outcome::Success
            } else {
                permanent("bad address")
            }
        }),
        faults,
    )
    .await;
    let dl = wait_dead_letters(host.store(), &name, 1, PATIENCE)
        .await
        .remove(0);
    fixed.store(true, Ordering::SeqCst);

    let mut set = SourceSet::default();
    set.insert(spec.clone(), b.connect(&spec).await);
    let payload = host
        .store()
        .dead_letter_payload(dl.id)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let sent = set
        .redrive(&dl, payload)
        .await
        .expect("the broker confirms");
    assert_eq!(sent, "m-d");
    assert_eq!(host.store().purge(vec![dl.id], None).await.unwrap(), 1);

    wait_settled(&settled, "m-d", Settled::Succeeded, PATIENCE).await;
    let seen = log.all();
    assert_eq!(
        seen.iter()
            .map(|s| (s.message_id.as_str(), s.attempt))
            .collect::<Vec<_>>(),
        vec![("m-d", 1), ("m-d", 1)],
        "the redriven message starts again at attempt 1 with the same id"
    );
    assert_eq!(seen[1].body, b"{\"v\": 1}");
    assert!(dead_letters_of(host.store(), &name).await.is_empty());
    g.stop().await.unwrap();
}

/// The broker dead-letters a message itself; a watch source on its
/// dead-letter queue files it, readable; a redrive sends it back to the
/// original queue with lazaret's headers.
pub async fn watch_files_broker_dead_letters(b: &impl TestBroker) {
    let dir = tempfile::tempdir().unwrap();
    let (dlq, original) = b.broker_dead_letter("watched", "m-w", b"{\"w\": 1}").await;
    let name = unique("watch");
    let spec = b.spec(&name, &dlq, Mode::Watch);
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    let w = start_watch_on(b, spec.clone(), Arc::clone(&host), Faults::default()).await;
    let dl = wait_dead_letters(host.store(), &name, 1, PATIENCE)
        .await
        .remove(0);
    assert_eq!(dl.stage, Stage::Broker);
    assert_eq!(dl.reason, b.broker_reason());
    let src = dl.source.as_ref().expect("source");
    assert_eq!(
        src.queue, original,
        "the original queue is read from the message"
    );
    assert_eq!(src.message_id, "m-w");
    let payload = host
        .store()
        .dead_letter_payload(dl.id)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(payload, b"{\"w\": 1}");
    w.stop().await.unwrap();

    // The original queue comes from the message: a watch source redrives
    // there only when it is allowed (the server allows its config's queues).
    let mut spec = spec;
    spec.redrive_allow = vec![original.clone()];
    let mut set = SourceSet::default();
    set.insert(spec.clone(), b.connect(&spec).await);
    set.redrive(&dl, payload)
        .await
        .expect("the broker confirms");
    let (body, headers) = b
        .take_one(&original, PATIENCE)
        .await
        .expect("the redrive is on the original queue");
    assert_eq!(body, b"{\"w\": 1}");
    let text = |k: &str| headers.get(k).and_then(lazaret_guard::message::header_text);
    assert_eq!(text("x-lazaret-attempt").as_deref(), Some("0"));
    assert_eq!(text("x-lazaret-message-id").as_deref(), Some("m-w"));
    assert!(headers.get("x-death").is_none());
}

/// Headers giving a message the id `order-7` whatever the broker's own
/// (JetStream drops a repeated `Nats-Msg-Id` itself).
fn same_id() -> serde_json::Map<String, Value> {
    headers(json!({"x-lazaret-message-id": "order-7"}))
}

/// A message reusing a quarantined message id with another body (an order
/// id used as message id) is a dead letter of its own, and so is a
/// redriven copy (same id and body, a redrive id) that reaches the watched
/// queue before the redrive removed its dead letter; the same message
/// arriving again is still recognised.
pub async fn watch_keeps_messages_reusing_an_id(b: &impl TestBroker) {
    let dir = tempfile::tempdir().unwrap();
    let dlq = b.fresh_queue("reuse-dlq").await;
    let name = unique("reuse-watch");
    let mut spec = b.spec(&name, &dlq, Mode::Watch);
    spec.redrive_to = Some(b.fresh_queue("reuse-back").await);
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    let copy = headers(json!({
        "x-lazaret-message-id": "order-7", "x-lazaret-attempt": "0", "x-lazaret-redrive-id": "r-1",
    }));
    b.produce(&dlq, "a", b"{\"order\": 7}", same_id()).await;
    b.produce(&dlq, "b", b"{\"order\": 7}", same_id()).await;
    b.produce(&dlq, "c", b"{\"order\": 8}", same_id()).await;
    b.produce(&dlq, "order-7", b"{\"order\": 7}", copy).await;
    let w = start_watch_on(b, spec, Arc::clone(&host), Faults::default()).await;
    let dls = wait_dead_letters(host.store(), &name, 3, PATIENCE).await;
    w.stop().await.unwrap();
    let mut kept: Vec<(Vec<u8>, Option<String>)> = Vec::new();
    for dl in &dls {
        let body = host
            .store()
            .dead_letter_payload(dl.id)
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        let src = dl.source.as_ref().expect("source");
        assert_eq!(src.message_id, "order-7");
        kept.push((body, src.redrive_id.clone()));
    }
    kept.sort();
    assert_eq!(
        kept,
        vec![
            (b"{\"order\": 7}".to_vec(), None),
            (b"{\"order\": 7}".to_vec(), Some("r-1".to_owned())),
            (b"{\"order\": 8}".to_vec(), None),
        ],
        "one dead letter per (message id, body, redrive id)"
    );
}

/// Guard mode: a second message reusing a dead-lettered id with another
/// body is delivered as attempt 1 and dead-lettered on its own; a redrive
/// of a message that fails again leaves the copy's dead letter once the
/// redrive removed the old one.
pub async fn guard_keeps_messages_reusing_an_id(b: &impl TestBroker) {
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("reuse").await;
    let name = unique("reuse-guard");
    let mut spec = b.spec(&name, &queue, Mode::Guard);
    spec.concurrency = 1;
    let host = host(
        dir.path(),
        policies("orders", 3, Duration::from_millis(100)),
    );
    b.produce(&queue, "a", b"{\"order\": 7}", same_id()).await;
    let log = Log::default();
    let g = start_guard(
        b,
        spec.clone(),
        Arc::clone(&host),
        recording(&log, |_| permanent("no such customer")),
        Faults::default(),
    )
    .await;
    let first = wait_dead_letters(host.store(), &name, 1, PATIENCE)
        .await
        .remove(0);
    b.produce(&queue, "b", b"{\"order\": 8}", same_id()).await;
    let dls = wait_dead_letters(host.store(), &name, 2, PATIENCE).await;
    let seen = log.all();
    assert_eq!(
        seen.iter()
            .map(|s| (s.attempt, s.body.clone()))
            .collect::<Vec<_>>(),
        vec![
            (1, b"{\"order\": 7}".to_vec()),
            (1, b"{\"order\": 8}".to_vec())
        ]
    );

    // The handler still refuses it: the redriven copy fails again, before
    // the redrive has removed the dead letter it came from.
    let mut set = SourceSet::default();
    set.insert(spec.clone(), b.connect(&spec).await);
    set.redrive(&first, b"{\"order\": 7}".to_vec())
        .await
        .expect("the broker confirms");
    let all = wait_dead_letters(host.store(), &name, 3, PATIENCE).await;
    assert_eq!(host.store().purge(vec![first.id], None).await.unwrap(), 1);
    let left = dead_letters_of(host.store(), &name).await;
    assert_eq!(left.len(), 2, "{all:#?}");
    assert!(
        left.iter().any(|d| d.id == dls[1].id),
        "the other body's dead letter stays"
    );
    assert!(
        left.iter()
            .any(|d| d.source.as_ref().is_some_and(|s| s.redrive_id.is_some())),
        "the redriven copy's dead letter stays: {left:#?}"
    );
    g.stop().await.unwrap();
}

/// A message (id `order-7`) fails transiently and its retry is held; then a
/// different message reusing the id (another body) arrives while it is
/// held: it is delivered as attempt 1 (not acknowledged as "held
/// already"), fails transiently too and is held as a retry of its own,
/// beside the first one's (not in its place); both retries come due and
/// succeed. None is lost, none is taken for the other.
pub async fn guard_keeps_messages_reusing_a_held_id(b: &impl TestBroker) {
    const FIRST: &[u8] = b"{\"order\": 7}";
    const OTHER: &[u8] = b"{\"order\": 8}";
    let dir = tempfile::tempdir().unwrap();
    let queue = b.fresh_queue("reuse-held").await;
    let name = unique("reuse-held");
    let spec = b.spec(&name, &queue, Mode::Guard);
    // Retries wait 2 to 4 s: the other body arrives, and is held, while
    // the first one's retry is.
    let host = host(dir.path(), policies("orders", 5, Duration::from_secs(2)));
    b.produce(&queue, "first", FIRST, same_id()).await;
    let log = Log::default();
    let handler = recording(&log, |s| {
        if s.attempt == 1 {
            transient("busy")
        } else {
            Outcome::Success
        }
    });
    let (faults, settled) = settled_log();
    let g = start_guard(b, spec, Arc::clone(&host), handler, faults).await;
    wait_settled(&settled, "order-7", Settled::HeldRetry, PATIENCE).await;
    b.produce(&queue, "other", OTHER, same_id()).await;

    let attempts = |seen: &[Seen], body: &[u8]| -> Vec<u32> {
        seen.iter()
            .filter(|s| s.body == body)
            .map(|s| s.attempt)
            .collect()
    };
    let seen = log
        .wait_for(PATIENCE, |s| {
            attempts(s, FIRST).contains(&2) && attempts(s, OTHER).contains(&2)
        })
        .await;
    assert_eq!(attempts(&seen, FIRST), vec![1, 2], "{seen:#?}");
    assert_eq!(
        attempts(&seen, OTHER),
        vec![1, 2],
        "the other body is delivered as attempt 1 and retried: {seen:#?}"
    );
    // Both retries settle (their held retries dropped).
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let done = settled
            .lock()
            .unwrap()
            .iter()
            .filter(|(id, how)| id == "order-7" && *how == Settled::Succeeded)
            .count();
        if done == 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "both retries did not settle: {:?}",
            settled.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for body in [FIRST, OTHER] {
        assert_eq!(
            host.store()
                .message_held(lazaret_store::MessageKey::of(
                    name.clone(),
                    "order-7",
                    body,
                    None
                ))
                .await
                .unwrap(),
            Held::Nothing,
            "a success leaves nothing held"
        );
    }
    assert!(dead_letters_of(host.store(), &name).await.is_empty());
    assert_eq!(
        log.all().len(),
        4,
        "no delivery beyond the two attempts of each"
    );
    g.stop().await.unwrap();
}
