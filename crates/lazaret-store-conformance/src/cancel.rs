//! Cancel: a waiting job at once, a leased one at its outcome unless acked;
//! a finished one never. Retention keeps and cleans cancelled jobs like
//! succeeded ones.

use lazaret_core::{AttemptOutcome, Event, JobId, JobState, Transition};
use lazaret_store::{AuditEntry, CancelError, Cancelled, DeadLetterFilter, NewJob, Store};

use crate::Backend;

use super::{
    LEASE, at, complete, dead_letter_job, enqueue_one, job_view, lane_counts, lease, lease_one,
    lease_req, new_job, permanent, transient,
};

/// The audit entry a cancel of `id` by `actor` passes (the store sets `count`).
pub fn cancel_entry(id: JobId, actor: &str) -> AuditEntry {
    AuditEntry {
        at: at(0),
        actor: actor.into(),
        action: "cancel".into(),
        request: serde_json::json!({ "job_id": id.to_string() }),
        count: 99,
    }
}

/// Cancels `id` at `now` as `ops`; the store must not fail.
pub async fn cancel<S: Store>(
    s: &S,
    id: JobId,
    now: lazaret_core::Timestamp,
) -> Result<Cancelled, CancelError> {
    s.cancel(id, now, cancel_entry(id, "ops"))
        .await
        .expect("cancel")
}

/// The `count`s of the `cancel` entries of the audit log, oldest first.
async fn cancel_counts<S: Store>(s: &S) -> Vec<u64> {
    let mut counts: Vec<u64> = s
        .audit_log(100)
        .await
        .unwrap()
        .into_iter()
        .filter(|e| e.action == "cancel")
        .map(|e| e.count)
        .collect();
    counts.reverse();
    counts
}

pub async fn a_waiting_job_is_cancelled_at_once_and_never_leased<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let queued = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let scheduled = enqueue_one(
        &s,
        NewJob {
            run_at: at(10_000),
            ..new_job("resize", "globex", "default")
        },
    )
    .await;
    let other = enqueue_one(&s, new_job("resize", "initech", "default")).await;
    assert_eq!(cancel(&s, queued, at(1)).await, Ok(Cancelled::Now));
    assert_eq!(cancel(&s, scheduled, at(2)).await, Ok(Cancelled::Now));

    for id in [queued, scheduled] {
        let view = job_view(&s, id).await;
        assert_eq!(view.state, JobState::Cancelled, "{id}");
        assert!(view.cancel_requested, "{id}");
        assert_eq!(view.run_at, None, "{id}: it will never run");
        assert_eq!(view.dead_letter_id, None, "{id}");
    }
    let stats = s.stats().await.unwrap();
    assert_eq!(stats.cancelled, 2);
    let lane = lane_counts(&stats, "default");
    assert_eq!(
        (lane.queued, lane.scheduled),
        (1, 0),
        "only the job left waits"
    );
    // Long after the scheduled job's time, only the other job is leased.
    let got = lease(&s, lease_req(at(20_000), 10)).await;
    assert_eq!(
        got.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![other],
        "a cancelled job is never leased"
    );
    assert_eq!(cancel_counts(&s).await, vec![1, 1]);
}

pub async fn a_leased_job_asked_to_cancel_hears_it_and_ends_cancelled_at_a_fail<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let job = lease_one(&s, lease_req(at(0), 1)).await;
    let hb = s
        .heartbeat(id, job.lease_token, at(40_000), at(1))
        .await
        .unwrap()
        .unwrap();
    assert!(!hb.cancel_requested, "no cancel asked yet");

    assert_eq!(
        cancel(&s, id, at(2)).await,
        Ok(Cancelled::Requested { already: false })
    );
    assert_eq!(
        cancel(&s, id, at(3)).await,
        Ok(Cancelled::Requested { already: true }),
        "a second request changes nothing"
    );
    let view = job_view(&s, id).await;
    assert_eq!(
        (view.state, view.cancel_requested),
        (JobState::Leased, true)
    );
    let hb = s
        .heartbeat(id, job.lease_token, at(50_000), at(4))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(hb.lease_expires_at, at(50_000));
    assert!(hb.cancel_requested, "the worker hears of the cancel");

    // A transient failure with every attempt left: cancelled, not retried.
    let done = complete(&s, &job, Event::Failed(transient("http_503")), at(5)).await;
    assert_eq!(done.transition, Transition::Cancelled);
    assert_eq!(done.dead_letter, None);
    assert_eq!(done.attempt, 1);
    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Cancelled);
    assert_eq!(view.dead_letter_id, None);
    let record = view.envelope.history.last().expect("the attempt is kept");
    assert_eq!(record.outcome, AttemptOutcome::Cancelled);
    assert_eq!(
        record.error.as_ref().map(|e| e.kind.as_str()),
        Some("http_503"),
        "with the failure that ended it"
    );
    let (dls, _) = s
        .dead_letters(DeadLetterFilter::default(), 10, None)
        .await
        .unwrap();
    assert!(dls.is_empty(), "no dead letter: {dls:?}");
    assert!(lease(&s, lease_req(at(100_000), 10)).await.is_empty());
    let stats = s.stats().await.unwrap();
    assert_eq!(stats.cancelled, 1);
    assert_eq!(lane_counts(&stats, "default"), Default::default());
    assert_eq!(cancel_counts(&s).await, vec![1, 0]);
}

pub async fn a_permanent_failure_of_a_cancel_requested_job_writes_no_dead_letter<B: Backend>(
    b: &B,
) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let job = lease_one(&s, lease_req(at(0), 1)).await;
    cancel(&s, id, at(1)).await.unwrap();
    let done = complete(&s, &job, Event::Failed(permanent()), at(2)).await;
    assert_eq!(done.transition, Transition::Cancelled);
    assert_eq!(done.dead_letter, None);
    assert_eq!(job_view(&s, id).await.state, JobState::Cancelled);
    assert!(s.reasons().await.unwrap().is_empty());
}

pub async fn an_ack_after_a_cancel_request_stands<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let job = lease_one(&s, lease_req(at(0), 1)).await;
    cancel(&s, id, at(1)).await.unwrap();
    let done = complete(&s, &job, Event::Succeeded, at(2)).await;
    assert_eq!(done.transition, Transition::Succeeded);
    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Succeeded, "the work was done");
    assert!(view.cancel_requested, "the request is still on record");
    assert_eq!(
        cancel(&s, id, at(3)).await,
        Err(CancelError::Finished(JobState::Succeeded))
    );
}

pub async fn a_cancel_requested_lease_that_expires_ends_cancelled<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let job = lease_one(&s, lease_req(at(0), 1)).await;
    cancel(&s, id, at(1)).await.unwrap();
    let end = at(LEASE.as_millis() as i64);
    let tick = s.tick(end).await.unwrap();
    assert_eq!(tick.expired.len(), 1);
    assert_eq!(tick.expired[0].transition, Transition::Cancelled);
    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Cancelled);
    assert_eq!(
        view.envelope.history.last().map(|r| r.outcome),
        Some(AttemptOutcome::Cancelled)
    );
    // The worker's late fail finds its lease gone.
    let late = s
        .complete(
            vec![lazaret_store::Completion {
                id,
                token: job.lease_token,
                event: Event::Failed(transient("http_503")),
            }],
            end,
        )
        .await
        .unwrap();
    assert_eq!(
        late[0].as_ref().err(),
        Some(&lazaret_store::ItemError::LeaseLost)
    );
}

pub async fn a_finished_or_unknown_job_is_refused_and_nothing_is_written<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let done = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let job = lease_one(&s, lease_req(at(0), 1)).await;
    complete(&s, &job, Event::Succeeded, at(1)).await;
    let (dead, dl) = dead_letter_job(&s, new_job("email", "acme", "other"), at(2)).await;
    let cancelled = enqueue_one(&s, new_job("resize", "globex", "default")).await;
    cancel(&s, cancelled, at(3)).await.unwrap();

    for (id, state) in [
        (done, JobState::Succeeded),
        (dead, JobState::DeadLettered),
        (cancelled, JobState::Cancelled),
    ] {
        assert_eq!(
            cancel(&s, id, at(4)).await,
            Err(CancelError::Finished(state))
        );
    }
    assert_eq!(
        cancel(&s, JobId(987_654), at(4)).await,
        Err(CancelError::NotFound)
    );
    assert_eq!(cancel_counts(&s).await, vec![1], "only the accepted cancel");
    let view = job_view(&s, dead).await;
    assert_eq!(view.state, JobState::DeadLettered);
    assert_eq!(view.dead_letter_id, Some(dl));
    assert!(!view.cancel_requested);
}

pub async fn retention_removes_old_cancelled_jobs_like_succeeded_ones<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let old = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let recent = enqueue_one(&s, new_job("resize", "globex", "default")).await;
    let waiting = enqueue_one(&s, new_job("resize", "initech", "default")).await;
    cancel(&s, old, at(1_000)).await.unwrap();
    cancel(&s, recent, at(5_000)).await.unwrap();
    assert_eq!(s.stats().await.unwrap().cancelled, 2);

    assert_eq!(s.remove_succeeded(at(2_000), 10).await.unwrap(), 1);
    assert!(s.job(old).await.unwrap().is_none(), "the old one is gone");
    assert_eq!(job_view(&s, recent).await.state, JobState::Cancelled);
    assert_eq!(job_view(&s, waiting).await.state, JobState::Queued);
    assert_eq!(s.stats().await.unwrap().cancelled, 1);
}

pub async fn cancels_survive_a_restart<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let waiting = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let running = enqueue_one(&s, new_job("resize", "globex", "default")).await;
    cancel(&s, waiting, at(1)).await.unwrap();
    let job = lease_one(&s, lease_req(at(2), 1)).await;
    assert_eq!(job.id, running);
    cancel(&s, running, at(3)).await.unwrap();
    s.close().await.unwrap();
    drop(s);

    let s = b.open(&place).await;
    assert_eq!(job_view(&s, waiting).await.state, JobState::Cancelled);
    let stats = s.stats().await.unwrap();
    assert_eq!(stats.cancelled, 1, "counted again at start");
    assert_eq!(lane_counts(&stats, "default").queued, 0);
    let hb = s
        .heartbeat(running, job.lease_token, at(20_000), at(4))
        .await
        .unwrap()
        .unwrap();
    assert!(hb.cancel_requested);
    let done = complete(&s, &job, Event::Failed(transient("http_503")), at(5)).await;
    assert_eq!(done.transition, Transition::Cancelled);
    s.close().await.unwrap();
}
