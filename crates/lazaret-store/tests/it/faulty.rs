//! The fault-injecting store (`lazaret_store::faulty`) on each backend:
//! after its countdown a write fails either not applied (the job is absent
//! afterwards) or applied with its answer lost (the job is there).

use lazaret_core::Timestamp;
use lazaret_store::{EnqueueOutcome, Fault, FaultRates, FaultyStore, NewJob, Store, StoreError};
use lazaret_store_conformance::new_job;

fn keyed(key: &str) -> NewJob {
    NewJob {
        idempotency_key: Some(key.into()),
        ..new_job("email", "acme", "default")
    }
}

/// Whether the job of `key` is there: an enqueue of it again says.
async fn present<S: Store>(s: &S, key: &str) -> bool {
    let out = s.enqueue(vec![keyed(key)]).await.expect("enqueue");
    matches!(out[..], [EnqueueOutcome::Duplicate { .. }])
}

/// Both modes on `s`, whose faults are off.
pub async fn both_modes<B>(s: &FaultyStore<B>)
where
    FaultyStore<B>: Store,
{
    let faults = s.faults().clone();
    // Two writes pass, the third is refused and not applied.
    faults.fail_after(2, Fault::NotApplied);
    for key in ["a1", "a2"] {
        s.enqueue(vec![keyed(key)])
            .await
            .expect("before the countdown ran out");
    }
    let refused = s.enqueue(vec![keyed("a3")]).await.expect_err("injected");
    assert!(matches!(refused, StoreError::NotApplied(_)), "{refused:?}");
    // Every write fails until healed; reads still work.
    let tick = s.tick(Timestamp::from_millis(0)).await;
    assert!(tick.is_err(), "{tick:?}");
    assert!(s.stats().await.is_err());
    assert_eq!(s.tokens().await.expect("reads pass").len(), 0);
    assert_eq!(faults.injected(), 3);
    faults.heal();
    assert!(present(s, "a1").await && present(s, "a2").await);
    assert!(!present(s, "a3").await, "a refused request was applied");

    // The answer is lost: the caller sees an error, the job is there.
    faults.fail_after(0, Fault::AnswerLost);
    let lost = s.enqueue(vec![keyed("b1")]).await.expect_err("injected");
    assert!(matches!(lost, StoreError::Db(_)), "{lost:?}");
    faults.heal();
    assert!(
        present(s, "b1").await,
        "the request whose answer was lost was not applied"
    );
    s.close().await.expect("close");
}

#[tokio::test]
async fn sqlite_after_the_countdown_fails_requests_applied_or_not() {
    let dir = tempfile::TempDir::new().unwrap();
    let (s, _faults) = crate::sqlite::open(dir.path()).with_faults();
    both_modes(&s).await;
}

#[tokio::test]
async fn postgres_after_the_countdown_fails_requests_applied_or_not() {
    let Some(url) = crate::postgres::url() else {
        return;
    };
    let schema = crate::postgres::fresh_schema(&url);
    let store =
        crate::postgres::open(&url, &schema.name, lazaret_store::postgres::Clock::Caller).await;
    let (s, _faults) = store.with_faults();
    both_modes(&s).await;
}

/// The error kinds of `n` keyed enqueues on `s`: `'.'` passed, `'n'` not
/// applied, `'l'` answer lost.
async fn pattern<B>(s: &FaultyStore<B>, n: usize) -> String
where
    FaultyStore<B>: Store,
{
    let mut out = String::new();
    for i in 0..n {
        out.push(match s.enqueue(vec![keyed(&format!("r{i}"))]).await {
            Ok(_) => '.',
            Err(StoreError::NotApplied(_)) => 'n',
            Err(_) => 'l',
        });
    }
    out
}

#[tokio::test]
async fn sqlite_random_faults_follow_the_seed_and_slow_requests_run_the_hook() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};

    let rates = FaultRates {
        not_applied: 250_000,
        answer_lost: 250_000,
        slow: 250_000,
    };
    let mut seen = Vec::new();
    for _ in 0..2 {
        let dir = tempfile::TempDir::new().unwrap();
        let (s, faults) = crate::sqlite::open(dir.path()).with_faults();
        let slowed = Arc::new(AtomicU64::new(0));
        let counter = slowed.clone();
        faults.on_slow(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        });
        faults.at_random(7, rates);
        let p = pattern(&s, 64).await;
        // Every request drew: the slow ones passed and ran the hook.
        let failed = p.chars().filter(|&c| c != '.').count() as u64;
        assert_eq!(faults.injected(), failed + slowed.load(Ordering::SeqCst));
        assert!(p.contains('n') && p.contains('l') && p.contains('.'), "{p}");
        assert!(slowed.load(Ordering::SeqCst) > 0);
        // Healed: no more faults, and the hook is not run.
        faults.heal();
        let before = slowed.load(Ordering::SeqCst);
        assert_eq!(pattern(&s, 8).await, "........");
        assert_eq!(slowed.load(Ordering::SeqCst), before);
        seen.push(p);
        s.close().await.expect("close");
    }
    assert_eq!(seen[0], seen[1], "one seed, two fault patterns");
}
