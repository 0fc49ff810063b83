//! Lifecycle: what survives a restart (closed or dropped), and a closed store's refusals.

use std::collections::HashSet;

use lazaret_core::{DeadLetterReason, Event, JobState};
use lazaret_store::{
    AuditEntry, DeadLetterFilter, EnqueueOutcome, LeaseRequest, LeaseToken, NewJob, Store,
    StoreError, StoreStats,
};

use super::dead_letters::admission;
use crate::Backend;

use super::{at, complete, enqueue_one, ids, job_view, lane_counts, lease, lease_req, new_job};

pub async fn restart_after_close_keeps_everything<B: Backend>(b: &B) {
    restart_keeps_everything(b, true).await;
}

pub async fn restart_after_drop_keeps_everything<B: Backend>(b: &B) {
    restart_keeps_everything(b, false).await;
}

/// The counts a restart must rebuild; the commit counters are per process.
fn sorted_stats(mut s: StoreStats) -> StoreStats {
    s.group_commit = None;
    s.lanes.retain(|(_, c)| *c != Default::default());
    s.lanes.sort_by(|a, b| a.0.cmp(&b.0));
    s.dead_letters.sort();
    s
}

async fn restart_keeps_everything<B: Backend>(b: &B, close: bool) {
    let place = b.place().await;
    let s = b.open(&place).await;
    // One tenant per job, so caps and fairness do not decide what is leased.
    let queued_job = NewJob {
        idempotency_key: Some("q-1".into()),
        ..new_job("keep", "t-q", "default")
    };
    let queued = enqueue_one(&s, queued_job.clone()).await;
    let delayed = enqueue_one(
        &s,
        NewJob {
            run_at: at(60_000),
            ..new_job("delay", "t-d", "default")
        },
    )
    .await;
    let leased_id = enqueue_one(&s, new_job("lease", "t-l", "bulk")).await;
    let poisoned = enqueue_one(&s, new_job("poison", "t-p", "default")).await;
    let acked = enqueue_one(&s, new_job("ack", "t-a", "default")).await;

    let held = lease(
        &s,
        LeaseRequest {
            types: Some(vec!["lease".into(), "poison".into(), "ack".into()]),
            ..lease_req(at(10), 10)
        },
    )
    .await;
    assert_eq!(ids(&held), vec![leased_id, poisoned, acked]);
    let mut old_tokens: HashSet<LeaseToken> = held.iter().map(|j| j.lease_token).collect();
    let by_id = |id| held.iter().find(|j| j.id == id).expect("leased");
    let kept = by_id(leased_id).clone();
    complete(&s, by_id(acked), Event::Succeeded, at(20)).await;
    let dl = complete(
        &s,
        by_id(poisoned),
        Event::Failed(super::permanent()),
        at(20),
    )
    .await
    .dead_letter
    .expect("a dead letter");
    let adm = s
        .record_admission(admission(None, None, DeadLetterReason::InvalidJson, at(30)))
        .await
        .unwrap();
    let entry = AuditEntry {
        at: at(40),
        actor: "ops".into(),
        action: "purge".into(),
        request: serde_json::json!({ "ids": [1, 2] }),
        count: 2,
    };
    s.audit(entry.clone()).await.unwrap();

    let stats_before = sorted_stats(s.stats().await.unwrap());
    let dl_before = s.dead_letter(dl).await.unwrap().expect("listed");
    let leased_before = job_view(&s, leased_id).await;
    // The newest job goes for good: its id must not come back either.
    let (purged, purged_dl) =
        super::dead_letter_job(&s, new_job("gone", "t-g", "default"), at(50)).await;
    assert_eq!(s.purge(vec![purged_dl], None).await.unwrap(), 1);
    let last_id = purged;

    if close {
        s.close().await.unwrap();
    }
    drop(s);
    let s = b.open(&place).await;

    assert_eq!(job_view(&s, queued).await.state, JobState::Queued);
    let view = job_view(&s, delayed).await;
    assert_eq!(
        (view.state, view.run_at),
        (JobState::Scheduled, Some(at(60_000)))
    );
    let view = job_view(&s, leased_id).await;
    assert_eq!(view.state, JobState::Leased);
    assert_eq!(view.lease_expires_at, leased_before.lease_expires_at);
    assert_eq!(view.envelope, leased_before.envelope);
    assert_eq!(job_view(&s, acked).await.state, JobState::Succeeded);
    assert_eq!(job_view(&s, poisoned).await.state, JobState::DeadLettered);
    assert!(s.job(purged).await.unwrap().is_none());

    let dl_after = s.dead_letter(dl).await.unwrap().expect("still listed");
    assert_eq!(format!("{dl_after:?}"), format!("{dl_before:?}"));
    assert!(s.dead_letter(adm).await.unwrap().is_some());
    let (page, _) = s
        .dead_letters(DeadLetterFilter::default(), 10, None)
        .await
        .unwrap();
    assert_eq!(page.iter().map(|d| d.id).collect::<Vec<_>>(), vec![adm, dl]);
    assert_eq!(s.audit_log(10).await.unwrap(), vec![entry]);
    let stats_after = sorted_stats(s.stats().await.unwrap());
    assert_eq!(
        format!("{stats_after:?}"),
        format!("{stats_before:?}"),
        "counts rebuilt"
    );
    assert_eq!(lane_counts(&stats_after, "bulk").leased, 1);

    // Idempotency keys survive.
    assert_eq!(
        s.enqueue(vec![queued_job]).await.unwrap(),
        vec![EnqueueOutcome::Duplicate {
            id: queued,
            state: JobState::Queued
        }]
    );
    // The lease granted before the restart is still good.
    let hb = s
        .heartbeat(leased_id, kept.lease_token, at(50_000), at(100))
        .await
        .unwrap();
    assert_eq!(hb.map(|h| h.lease_expires_at), Ok(at(50_000)));
    complete(&s, &kept, Event::Succeeded, at(40_000)).await;

    // New ids and tokens never repeat old ones.
    let fresh = enqueue_one(&s, new_job("keep", "t-n", "default")).await;
    assert!(fresh > last_id, "{fresh} reuses an id (last was {last_id})");
    assert_eq!(s.tick(at(60_000)).await.unwrap().promoted, 1);
    let again = lease(&s, lease_req(at(60_000), 10)).await;
    assert_eq!(ids(&again), vec![queued, delayed, fresh]);
    for j in &again {
        assert!(
            old_tokens.insert(j.lease_token),
            "token {} was handed out before the restart",
            j.lease_token
        );
    }
    assert_eq!(s.stats().await.unwrap().succeeded, 2);
}

pub async fn closed_store_refuses_calls<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    s.close().await.unwrap();

    let closed = |what: &str, r: Result<(), StoreError>| {
        assert!(
            matches!(r, Err(StoreError::Closed)),
            "{what} after close: expected Closed, got {r:?}"
        );
    };
    closed(
        "enqueue",
        s.enqueue(vec![new_job("resize", "acme", "default")])
            .await
            .map(drop),
    );
    closed("lease", s.lease(lease_req(at(1), 1)).await.map(drop));
    closed("tick", s.tick(at(1)).await.map(drop));
    closed("stats", s.stats().await.map(drop));
    closed("job", s.job(id).await.map(drop));
    closed(
        "dead_letters",
        s.dead_letters(DeadLetterFilter::default(), 10, None)
            .await
            .map(drop),
    );
    closed("audit_log", s.audit_log(10).await.map(drop));
    closed("close", s.close().await);
}
