//! Housekeeping: lease expiry and the crash loop, heartbeats, retention of succeeded jobs.

use std::time::Duration;

use lazaret_core::{
    AttemptOutcome, DeadLetterReason, Event, FailureClass, JobState, Timestamp, Transition,
};
use lazaret_store::{Completion, ItemError, Stage, Store};

use crate::Backend;

use super::{
    CRASH_LOOP_MAX, LEASE, RETRY_DELAY, at, complete, dead_letter_job, enqueue_one, ids, job_view,
    lane_counts, lease, lease_one, lease_req, new_job,
};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

pub async fn lease_expiry_charges_an_attempt<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let first = lease_one(&s, lease_req(at(0), 1)).await;
    let expires = first.lease_expires_at;
    assert_eq!(expires, at(0).saturating_add(LEASE));

    let tick = s.tick(expires.saturating_sub(ms(1))).await.unwrap();
    assert!(tick.expired.is_empty(), "not before its expiry");
    assert_eq!(job_view(&s, id).await.state, JobState::Leased);

    let now = expires.saturating_add(ms(1));
    let tick = s.tick(now).await.unwrap();
    assert_eq!(tick.expired.len(), 1, "{:?}", tick.expired);
    let done = &tick.expired[0];
    let due = now.saturating_add(RETRY_DELAY);
    assert_eq!(done.id, id);
    assert_eq!(
        done.transition,
        Transition::Retry {
            at: due,
            attempt: 1
        }
    );
    assert_eq!(done.attempt, 1);
    assert_eq!(
        done.kind.as_ref().map(|k| k.as_str()),
        Some("lease_expired")
    );
    assert_eq!(done.class, Some(FailureClass::Transient));
    assert_eq!(tick.next_due, Some(due));

    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Scheduled);
    assert_eq!(view.lease_expires_at, None);
    assert_eq!(view.envelope.attempts, 1, "the expired attempt is charged");
    assert_eq!(view.envelope.crashes, 1);
    let record = &view.envelope.history[0];
    assert_eq!(record.outcome, AttemptOutcome::RetryScheduled);
    assert_eq!(record.ended_at, Some(now));
    assert_eq!(
        record.error.as_ref().map(|e| e.kind.as_str()),
        Some("lease_expired")
    );
    assert_eq!(lane_counts(&s.stats().await.unwrap(), "default").leased, 0);

    // The old holder is fenced off.
    let late_ack = Completion {
        id,
        token: first.lease_token,
        event: Event::Succeeded,
    };
    let out = s.complete(vec![late_ack], now).await.unwrap();
    assert_eq!(out[0].as_ref().unwrap_err(), &ItemError::LeaseLost);
    let hb = s
        .heartbeat(id, first.lease_token, at(90_000), now)
        .await
        .unwrap();
    assert_eq!(hb, Err(ItemError::LeaseLost));

    assert_eq!(s.tick(due).await.unwrap().promoted, 1);
    let second = lease_one(&s, lease_req(due, 1)).await;
    assert_eq!((second.id, second.attempt), (id, 2));
}

pub async fn crash_loop_after_crash_loop_max_expiries<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let mut now: Timestamp = at(0);
    for crash in 1..=CRASH_LOOP_MAX {
        assert_eq!(s.tick(now).await.unwrap().expired.len(), 0);
        let leased = lease_one(&s, lease_req(now, 1)).await;
        assert_eq!((leased.id, leased.attempt), (id, crash));
        now = leased.lease_expires_at.saturating_add(ms(1));
        let tick = s.tick(now).await.unwrap();
        assert_eq!(tick.expired.len(), 1);
        let done = &tick.expired[0];
        if crash < CRASH_LOOP_MAX {
            now = now.saturating_add(RETRY_DELAY);
            assert_eq!(
                done.transition,
                Transition::Retry {
                    at: now,
                    attempt: crash
                }
            );
        } else {
            assert_eq!(
                done.transition,
                Transition::DeadLetter {
                    reason: DeadLetterReason::CrashLoop
                }
            );
            let dl_id = done
                .dead_letter
                .expect("the crash loop writes a dead letter");
            let dl = s.dead_letter(dl_id).await.unwrap().expect("listed");
            assert_eq!(dl.reason, DeadLetterReason::CrashLoop);
            assert_eq!(dl.stage, Stage::Processing);
            assert_eq!(dl.job_id, Some(id));
            assert_eq!(dl.attempts, CRASH_LOOP_MAX);
            assert_eq!(dl.dead_lettered_at, now);
            assert_eq!(dl.history.len(), CRASH_LOOP_MAX as usize);
            assert!(
                dl.history
                    .iter()
                    .all(|r| r.error.as_ref().map(|e| e.kind.as_str()) == Some("lease_expired"))
            );
            assert_eq!(
                dl.error.as_ref().map(|e| e.kind.as_str()),
                Some("lease_expired")
            );
        }
    }
    assert_eq!(job_view(&s, id).await.state, JobState::DeadLettered);
    assert!(lease(&s, lease_req(now, 10)).await.is_empty());
}

pub async fn heartbeat_extends_the_lease<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    enqueue_one(&s, new_job("resize", "acme", "default")).await;
    enqueue_one(&s, new_job("resize", "globex", "default")).await;
    let held = lease(&s, lease_req(at(0), 2)).await;
    assert_eq!(held.len(), 2);
    let (acked, expiring) = (&held[0], &held[1]);
    assert_eq!(acked.lease_expires_at, at(30_000));

    for j in &held {
        let hb = s
            .heartbeat(j.id, j.lease_token, at(60_000), at(1_000))
            .await
            .unwrap();
        assert_eq!(hb.map(|h| h.lease_expires_at), Ok(at(60_000)));
        assert_eq!(job_view(&s, j.id).await.lease_expires_at, Some(at(60_000)));
    }

    // Past the old expiry, before the new one: nothing expires.
    let tick = s.tick(at(45_000)).await.unwrap();
    assert!(tick.expired.is_empty(), "{:?}", tick.expired);
    for j in &held {
        assert_eq!(job_view(&s, j.id).await.state, JobState::Leased);
    }
    let done = complete(&s, acked, Event::Succeeded, at(50_000)).await;
    assert_eq!(done.transition, Transition::Succeeded);

    let tick = s.tick(at(60_001)).await.unwrap();
    assert_eq!(
        tick.expired.iter().map(|c| c.id).collect::<Vec<_>>(),
        vec![expiring.id],
        "the extended lease runs out at its new expiry"
    );
}

pub async fn remove_succeeded_deletes_only_old_succeeded_jobs_in_batches<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    for tenant in ["a", "b", "c", "d"] {
        enqueue_one(&s, new_job("resize", tenant, "default")).await;
    }
    let held = lease(&s, lease_req(at(0), 10)).await;
    assert_eq!(held.len(), 4);
    let mut old = Vec::new();
    for j in &held[..3] {
        complete(&s, j, Event::Succeeded, at(1_000)).await;
        old.push(j.id);
    }
    let recent = &held[3];
    complete(&s, recent, Event::Succeeded, at(5_000)).await;
    let queued = enqueue_one(&s, new_job("resize", "e", "default")).await;
    let (dead, _) = dead_letter_job(&s, new_job("email", "f", "other"), at(1_000)).await;
    assert_eq!(s.stats().await.unwrap().succeeded, 4);

    assert_eq!(
        s.remove_succeeded(at(2_000), 2).await.unwrap(),
        2,
        "one batch"
    );
    assert_eq!(
        s.remove_succeeded(at(2_000), 2).await.unwrap(),
        1,
        "the rest"
    );
    assert_eq!(
        s.remove_succeeded(at(2_000), 2).await.unwrap(),
        0,
        "nothing old left"
    );

    for id in old {
        assert!(s.job(id).await.unwrap().is_none(), "{id} removed");
    }
    assert_eq!(job_view(&s, recent.id).await.state, JobState::Succeeded);
    assert_eq!(job_view(&s, queued).await.state, JobState::Queued);
    assert_eq!(job_view(&s, dead).await.state, JobState::DeadLettered);
    assert_eq!(s.stats().await.unwrap().succeeded, 1);
    assert_eq!(
        ids(&lease(&s, lease_req(at(6_000), 10)).await),
        vec![queued]
    );

    assert_eq!(s.remove_succeeded(at(9_000), 10).await.unwrap(), 1);
    assert_eq!(s.stats().await.unwrap().succeeded, 0);
    assert!(s.job(recent.id).await.unwrap().is_none());
}
