//! Redrive and purge: back into line with a fresh budget, or gone for good.

use lazaret_core::{AttemptOutcome, DeadLetterReason, Event, JobState};
use lazaret_store::{
    DeadLetterFilter, DeadLetterId, EnqueueOutcome, NewJob, Selector, Stage, Store,
};

use super::dead_letters::admission;
use crate::Backend;

use super::{
    at, complete, dead_letter_job, job_view, lane_counts, lease, lease_one, lease_req, new_job,
    permanent,
};

pub async fn redrive_keeps_id_key_and_history_with_a_fresh_budget<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let job = NewJob {
        idempotency_key: Some("img-7".into()),
        ..new_job("resize", "acme", "default")
    };
    let (id, dl) = dead_letter_job(&s, job.clone(), at(100)).await;
    assert_eq!(lane_counts(&s.stats().await.unwrap(), "default").queued, 0);

    assert_eq!(s.redrive(vec![dl], at(200), None).await.unwrap(), vec![id]);
    assert!(
        s.dead_letter(dl).await.unwrap().is_none(),
        "the dead letter is gone"
    );
    assert!(
        s.match_dead_letters(Selector::Ids(vec![dl]))
            .await
            .unwrap()
            .is_empty()
    );
    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Queued);
    assert_eq!(view.run_at, Some(at(200)));
    assert_eq!(view.envelope.attempts, 0, "a fresh budget");
    assert_eq!(view.envelope.redrives, 1);
    assert_eq!(view.envelope.history.len(), 1, "history kept");
    assert_eq!(view.envelope.idempotency_key.as_deref(), Some("img-7"));
    let stats = s.stats().await.unwrap();
    assert_eq!(lane_counts(&stats, "default").queued, 1);
    assert!(stats.dead_letters.is_empty());

    // The key still names the same job.
    assert_eq!(
        s.enqueue(vec![job]).await.unwrap(),
        vec![EnqueueOutcome::Duplicate {
            id,
            state: JobState::Queued
        }]
    );
    // Redriving it again finds nothing to do.
    assert!(s.redrive(vec![dl], at(210), None).await.unwrap().is_empty());

    let leased = lease_one(&s, lease_req(at(300), 10)).await;
    assert_eq!((leased.id, leased.attempt), (id, 1));
    assert_eq!(leased.idempotency_key.as_deref(), Some("img-7"));

    let done = complete(&s, &leased, Event::Failed(permanent()), at(400)).await;
    let again = s
        .dead_letter(done.dead_letter.expect("dead-lettered again"))
        .await
        .unwrap()
        .expect("listed");
    assert_eq!(again.job_id, Some(id));
    assert_eq!(again.redrive_count, 1);
    assert_eq!(again.attempts, 1);
    assert_eq!(
        again.history.iter().map(|r| r.outcome).collect::<Vec<_>>(),
        vec![AttemptOutcome::DeadLettered, AttemptOutcome::DeadLettered],
        "both runs are in the history"
    );
}

pub async fn redrive_skips_admission_records<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let adm = s
        .record_admission(admission(
            Some("resize"),
            Some("acme"),
            DeadLetterReason::SchemaInvalid,
            at(50),
        ))
        .await
        .unwrap();
    let (id, dl) = dead_letter_job(&s, new_job("resize", "acme", "default"), at(100)).await;

    assert_eq!(
        s.redrive(vec![adm, dl], at(200), None).await.unwrap(),
        vec![id]
    );
    assert_eq!(
        s.match_dead_letters(Selector::Filter(DeadLetterFilter::default()))
            .await
            .unwrap(),
        vec![(adm, Stage::Admission)],
        "the admission record stays"
    );
    assert_eq!(
        lease(&s, lease_req(at(300), 10)).await.len(),
        1,
        "only the job came back"
    );
}

pub async fn purge_removes_the_dead_letter_and_its_job<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let adm = s
        .record_admission(admission(None, None, DeadLetterReason::InvalidJson, at(50)))
        .await
        .unwrap();
    let (id, dl) = dead_letter_job(&s, new_job("resize", "acme", "default"), at(100)).await;
    let live = super::enqueue_one(&s, new_job("resize", "acme", "default")).await;

    let ghost = DeadLetterId(dl.0.max(adm.0) + 1_000);
    assert_eq!(s.purge(vec![dl, adm, ghost], None).await.unwrap(), 2);
    assert!(s.dead_letter(dl).await.unwrap().is_none());
    assert!(s.dead_letter(adm).await.unwrap().is_none());
    assert_eq!(s.dead_letter_payload(dl).await.unwrap(), None);
    assert!(s.job(id).await.unwrap().is_none(), "the job went with it");
    assert_eq!(
        job_view(&s, live).await.state,
        JobState::Queued,
        "live jobs stay"
    );

    assert_eq!(
        s.purge(vec![dl, adm], None).await.unwrap(),
        0,
        "already gone"
    );
    assert!(s.redrive(vec![dl], at(200), None).await.unwrap().is_empty());
    let (page, next) = s
        .dead_letters(DeadLetterFilter::default(), 10, None)
        .await
        .unwrap();
    assert!(page.is_empty() && next.is_none());
    assert!(s.stats().await.unwrap().dead_letters.is_empty());
    assert!(s.reasons().await.unwrap().is_empty());
}
