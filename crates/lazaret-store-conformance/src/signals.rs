//! The charts' samples (`Store::sample_signals`, `Store::signal_samples`):
//! what a sampling counts in its minute, that a count is never lowered,
//! that the samples survive a restart, and that old minutes are deleted.

use lazaret_core::series::{By, MINUTE_MS, Signal, minute_of};
use lazaret_core::{DeadLetterReason, Event, Timestamp};
use lazaret_store::{AuditEntry, LeaseRequest, SignalSamples, Store};

use super::dead_letters::admission;
use super::{at, complete, lease, lease_req, new_job, permanent};
use crate::Backend;

/// The value stored for (minute, signal, by, name), if any.
fn value(
    got: &SignalSamples,
    minute: Timestamp,
    signal: Signal,
    by: By,
    name: &str,
) -> Option<u64> {
    got.samples
        .iter()
        .find(|s| s.minute == minute && s.signal == signal && s.by == by && s.name == name)
        .map(|s| s.value)
}

pub async fn a_sampling_counts_its_minute_never_lowers_a_count_and_survives_a_restart<
    B: Backend,
>(
    b: &B,
) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let m0 = minute_of(at(0));
    let m1 = Timestamp::from_millis(m0.as_millis() + MINUTE_MS);
    let end = Timestamp::from_millis(m1.as_millis() + MINUTE_MS);
    assert!(
        at(10_000) < m1 && at(50_000) >= m1,
        "the case's times fall in two minutes"
    );

    // Minute m0: three jobs in lane slow; one succeeds, one is
    // dead-lettered, one waits; and an admission record with no type.
    s.enqueue((0..3).map(|_| new_job("email", "b", "slow")).collect())
        .await
        .unwrap();
    let held = lease(&s, lease_req(at(1_000), 2)).await;
    assert_eq!(held.len(), 2);
    complete(&s, &held[0], Event::Succeeded, at(2_000)).await;
    let dl = complete(&s, &held[1], Event::Failed(permanent()), at(2_000))
        .await
        .dead_letter
        .expect("dead-lettered");
    s.record_admission(admission(
        None,
        None,
        DeadLetterReason::InvalidJson,
        at(3_000),
    ))
    .await
    .unwrap();
    assert!(
        s.sample_signals(at(10_000), Timestamp::EPOCH)
            .await
            .unwrap()
            > 0
    );

    let got = s.signal_samples(m0, end).await.unwrap();
    assert_eq!(got.sampled, vec![m0]);
    let v = |signal, by, name| value(&got, m0, signal, by, name);
    assert_eq!(v(Signal::DlqDepth, By::Type, "email"), Some(1));
    assert_eq!(v(Signal::DlqDepth, By::Type, ""), Some(1));
    assert_eq!(v(Signal::DlqDepth, By::Source, ""), Some(2));
    assert_eq!(v(Signal::FailureReasons, By::Type, "email"), Some(1));
    assert_eq!(v(Signal::FailureReasons, By::Source, ""), Some(2));
    assert_eq!(v(Signal::DeadLettered, By::Type, "email"), Some(1));
    assert_eq!(v(Signal::DeadLettered, By::Source, ""), Some(2));
    assert_eq!(v(Signal::Throughput, By::Lane, "slow"), Some(1));
    assert_eq!(v(Signal::OldestAge, By::Lane, "slow"), Some(10_000));
    assert_eq!(v(Signal::RedriveSent, By::Type, "email"), None);

    // Minute m1: the dead letter is redriven, and it and the waiting job
    // succeed.
    let entry = s
        .audit(AuditEntry {
            at: at(50_000),
            actor: "op".into(),
            action: "redrive".into(),
            request: serde_json::json!({}),
            count: 0,
        })
        .await
        .unwrap();
    assert_eq!(
        s.redrive(vec![dl], at(50_000), Some(entry))
            .await
            .unwrap()
            .len(),
        1
    );
    let both = lease(
        &s,
        LeaseRequest {
            types: Some(vec!["email".into()]),
            ..lease_req(at(50_500), 2)
        },
    )
    .await;
    assert_eq!(both.len(), 2);
    for j in &both {
        complete(&s, j, Event::Succeeded, at(51_000)).await;
    }
    s.sample_signals(at(55_000), Timestamp::EPOCH)
        .await
        .unwrap();
    let got = s.signal_samples(m0, end).await.unwrap();
    assert_eq!(got.sampled, vec![m0, m1]);
    let v1 = |signal, by, name| value(&got, m1, signal, by, name);
    assert_eq!(v1(Signal::RedriveSent, By::Type, "email"), Some(1));
    assert_eq!(v1(Signal::RedriveSent, By::Source, ""), Some(1));
    assert_eq!(v1(Signal::RedriveSucceeded, By::Type, "email"), Some(1));
    assert_eq!(v1(Signal::Throughput, By::Lane, "slow"), Some(2));
    // Depth is a gauge: email's dead letter left, so no row (0).
    assert_eq!(v1(Signal::DlqDepth, By::Type, "email"), None);
    assert_eq!(v1(Signal::DlqDepth, By::Type, ""), Some(1));
    assert_eq!(v1(Signal::OldestAge, By::Lane, "slow"), None);
    // m0's count was sampled again, whole, and not lowered though its
    // dead letter was redriven.
    assert_eq!(
        value(&got, m0, Signal::DeadLettered, By::Type, "email"),
        Some(1)
    );

    // A restart keeps every sample.
    s.close().await.unwrap();
    drop(s);
    let s = b.open(&place).await;
    assert_eq!(s.signal_samples(m0, end).await.unwrap(), got);

    // Minutes before `keep_after` go.
    s.sample_signals(at(55_000), m1).await.unwrap();
    let kept = s.signal_samples(m0, end).await.unwrap();
    assert_eq!(kept.sampled, vec![m1]);
    assert!(kept.samples.iter().all(|x| x.minute == m1));
}
