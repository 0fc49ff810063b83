//! Redrive and purge: back into line with a fresh budget, or gone for good.

use lazaret_core::{AttemptOutcome, DeadLetterReason, Event, JobState};
use lazaret_store::{
    AuditEntry, DeadLetterFilter, DeadLetterId, EnqueueOutcome, NewJob, PayloadFix, Selector,
    Stage, Store,
};

use super::dead_letters::admission;
use crate::Backend;

use super::{
    at, complete, dead_letter_job, job_view, lane_counts, lease, lease_one, lease_req, new_job,
    permanent, sha256_hex,
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
    assert_eq!(view.envelope.redrive_count, 1);
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

fn fix(payload: &str) -> PayloadFix {
    PayloadFix {
        payload: payload.as_bytes().to_vec(),
        schema_version: Some(2),
        actor: "ops-alice".into(),
        reason: "width was a string".into(),
    }
}

pub async fn a_corrected_redrive_replaces_the_payload_and_keeps_the_original<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let job = NewJob {
        idempotency_key: Some("img-7".into()),
        ..new_job("resize", "acme", "default")
    };
    let original = job.payload.clone();
    let (id, dl) = dead_letter_job(&s, job.clone(), at(100)).await;
    let adm = s
        .record_admission(admission(
            Some("resize"),
            Some("acme"),
            DeadLetterReason::SchemaInvalid,
            at(50),
        ))
        .await
        .unwrap();
    let entry = s
        .audit(AuditEntry {
            at: at(150),
            actor: "ops-alice".into(),
            action: "redrive".into(),
            request: serde_json::json!({}),
            count: 0,
        })
        .await
        .unwrap();

    let corrected = r#"{"n": 2, "width": 640}"#;
    assert_eq!(
        s.redrive_corrected(dl, fix(corrected), at(200), Some(entry))
            .await
            .unwrap(),
        Some(id)
    );
    assert!(
        s.dead_letter(dl).await.unwrap().is_none(),
        "moved, not copied"
    );
    assert_eq!(s.audit_log(1).await.unwrap()[0].count, 1);

    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Queued);
    assert_eq!(view.payload, corrected.as_bytes(), "byte for byte");
    let e = &view.envelope;
    assert_eq!((e.attempts, e.redrive_count, e.history.len()), (0, 1, 1));
    assert_eq!(e.idempotency_key.as_deref(), Some("img-7"));
    assert_eq!(e.payload_size, corrected.len() as u64);
    assert_eq!(e.payload_sha256, sha256_hex(corrected.as_bytes()));
    assert_eq!(e.schema_version, Some(2));
    assert_eq!(e.payload_edits.len(), 1);
    let edit = &e.payload_edits[0];
    assert_eq!(
        edit.previous_payload.as_bytes(),
        &original[..],
        "the original stays readable"
    );
    assert_eq!(edit.previous_sha256, sha256_hex(&original));
    assert_eq!(
        (edit.actor.as_str(), edit.reason.as_str(), edit.at),
        ("ops-alice", "width was a string", at(200))
    );
    assert_eq!(lane_counts(&s.stats().await.unwrap(), "default").queued, 1);

    // The worker gets the corrected payload under the same id and key.
    let leased = lease_one(&s, lease_req(at(300), 10)).await;
    assert_eq!((leased.id, leased.attempt), (id, 1));
    assert_eq!(leased.payload, corrected.as_bytes());
    assert_eq!(leased.idempotency_key.as_deref(), Some("img-7"));
    let done = complete(&s, &leased, Event::Failed(permanent()), at(400)).await;
    let again = done.dead_letter.expect("dead-lettered again");
    assert_eq!(
        s.dead_letter_payload(again).await.unwrap(),
        Some(Some(corrected.as_bytes().to_vec()))
    );
    assert_eq!(
        job_view(&s, id).await.envelope.payload_edits.len(),
        1,
        "the edit survives the next failure"
    );

    // Nothing to correct: gone, an admission record, an unknown id.
    for gone in [dl, adm, DeadLetterId(again.0 + 1_000)] {
        assert_eq!(
            s.redrive_corrected(gone, fix("{}"), at(500), Some(entry))
                .await
                .unwrap(),
            None
        );
    }
    assert_eq!(
        s.audit_log(1).await.unwrap()[0].count,
        1,
        "nothing more counted"
    );
    // The key still names the same job.
    assert_eq!(
        s.enqueue(vec![job]).await.unwrap(),
        vec![EnqueueOutcome::Duplicate {
            id,
            state: JobState::DeadLettered
        }]
    );
}
