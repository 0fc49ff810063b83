//! Enqueue: payloads kept byte for byte, idempotency keys, delays, the in-flight hint.

use lazaret_core::{AttemptOutcome, JobState};
use lazaret_store::{EnqueueOutcome, NewJob, Store};

use crate::Backend;

use super::{LEASE, at, created, enqueue_one, ids, job_view, lease, lease_one, lease_req, new_job};

pub async fn enqueue_then_lease_gives_the_payload_byte_for_byte<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    // Odd spacing, a tab, a non-ASCII letter and a number in exponent form:
    // the store keeps the text, it never re-serialises it.
    let payload = "{ \"to\" : \"zoë@example.com\",\n\t\"amount\": 1.50e0, \"tags\": [ ] }"
        .as_bytes()
        .to_vec();
    let job = NewJob {
        payload: payload.clone(),
        idempotency_key: Some("order-1".into()),
        schema_version: Some(3),
        ..new_job("send_email", "acme", "default")
    };
    let out = s.enqueue(vec![job]).await.unwrap();
    let id = created(&out[0]);
    assert_eq!(
        out,
        vec![EnqueueOutcome::Created {
            id,
            state: JobState::Queued,
            inflight: 0
        }]
    );

    let leased = lease_one(&s, lease_req(at(10), 1)).await;
    assert_eq!(leased.id, id);
    assert_eq!(leased.payload, payload, "payload byte for byte");
    assert_eq!(leased.attempt, 1);
    assert_eq!(leased.job_type.as_str(), "send_email");
    assert_eq!(leased.tenant.as_str(), "acme");
    assert_eq!(leased.lane.as_str(), "default");
    assert_eq!(leased.idempotency_key.as_deref(), Some("order-1"));
    assert_eq!(leased.schema_version, Some(3));
    assert_eq!(leased.lease_expires_at, at(10).saturating_add(LEASE));
    assert_eq!(leased.created_at, at(0));

    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Leased);
    assert_eq!(view.payload, payload);
    assert_eq!(view.lease_expires_at, Some(leased.lease_expires_at));
    assert_eq!(view.envelope.attempts, 1);
    assert_eq!(view.envelope.payload_size, payload.len() as u64);
    assert_eq!(view.envelope.history.len(), 1);
    let record = &view.envelope.history[0];
    assert_eq!(record.attempt, 1);
    assert_eq!(record.outcome, AttemptOutcome::Running);
    assert_eq!(record.started_at, at(10));
    assert_eq!(record.worker_id.as_ref().map(|w| w.as_str()), Some("w-1"));

    assert!(
        lease(&s, lease_req(at(11), 10)).await.is_empty(),
        "leased once only"
    );
}

pub async fn idempotent_enqueue_returns_the_first_job<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let keyed = |tenant: &str, ty: &str, payload: &str| NewJob {
        payload: payload.as_bytes().to_vec(),
        idempotency_key: Some("k-1".into()),
        ..new_job(ty, tenant, "default")
    };
    let first = enqueue_one(&s, keyed("acme", "resize", r#"{"v":1}"#)).await;

    let again = s
        .enqueue(vec![keyed("acme", "resize", r#"{"v":2}"#)])
        .await
        .unwrap();
    assert_eq!(
        again,
        vec![EnqueueOutcome::Duplicate {
            id: first,
            state: JobState::Queued
        }]
    );
    assert_eq!(
        job_view(&s, first).await.payload,
        br#"{"v":1}"#,
        "the first payload stays"
    );

    // The key is scoped to (tenant, type).
    let other_tenant = enqueue_one(&s, keyed("globex", "resize", "{}")).await;
    let other_type = enqueue_one(&s, keyed("acme", "email", "{}")).await;
    assert_ne!(other_tenant, first);
    assert_ne!(other_type, first);
    assert_ne!(other_type, other_tenant);

    // Without a key, every enqueue is a new job.
    let a = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let b = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    assert_ne!(a, b);

    // A duplicate reports the first job's state now.
    let leased = lease(&s, lease_req(at(5), 10)).await;
    assert!(
        ids(&leased).contains(&first),
        "FIFO inside a tenant: the first job is leased first"
    );
    let again = s
        .enqueue(vec![keyed("acme", "resize", r#"{"v":3}"#)])
        .await
        .unwrap();
    assert_eq!(
        again,
        vec![EnqueueOutcome::Duplicate {
            id: first,
            state: JobState::Leased
        }]
    );
}

pub async fn duplicate_within_one_batch<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let keyed = |key: &str, payload: &str| NewJob {
        payload: payload.as_bytes().to_vec(),
        idempotency_key: Some(key.into()),
        ..new_job("resize", "acme", "default")
    };
    let out = s
        .enqueue(vec![
            keyed("k-1", r#"{"v":1}"#),
            keyed("k-1", r#"{"v":2}"#),
            keyed("k-2", r#"{"v":3}"#),
        ])
        .await
        .unwrap();
    assert_eq!(out.len(), 3, "one outcome per job, in order: {out:?}");
    let first = created(&out[0]);
    assert_eq!(
        out[1],
        EnqueueOutcome::Duplicate {
            id: first,
            state: JobState::Queued
        }
    );
    let second = created(&out[2]);
    assert_ne!(first, second);

    let leased = lease(&s, lease_req(at(1), 10)).await;
    assert_eq!(ids(&leased), vec![first, second], "two jobs, not three");
    let first_job = leased.iter().find(|j| j.id == first).unwrap();
    assert_eq!(first_job.payload, br#"{"v":1}"#);
}

pub async fn delayed_job_waits_for_its_time<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let job = NewJob {
        run_at: at(5_000),
        idempotency_key: Some("later".into()),
        ..new_job("report", "acme", "default")
    };
    let out = s.enqueue(vec![job.clone()]).await.unwrap();
    let id = created(&out[0]);
    assert_eq!(
        out[0],
        EnqueueOutcome::Created {
            id,
            state: JobState::Scheduled,
            inflight: 0
        }
    );
    let view = job_view(&s, id).await;
    assert_eq!(view.state, JobState::Scheduled);
    assert_eq!(view.run_at, Some(at(5_000)));

    assert!(lease(&s, lease_req(at(4_999), 10)).await.is_empty());
    let tick = s.tick(at(4_999)).await.unwrap();
    assert_eq!(tick.promoted, 0);
    assert_eq!(tick.next_due, Some(at(5_000)));
    assert!(lease(&s, lease_req(at(4_999), 10)).await.is_empty());

    let dup = s.enqueue(vec![job]).await.unwrap();
    assert_eq!(
        dup,
        vec![EnqueueOutcome::Duplicate {
            id,
            state: JobState::Scheduled
        }]
    );

    let tick = s.tick(at(5_000)).await.unwrap();
    assert_eq!(tick.promoted, 1);
    assert_eq!(tick.next_due, None);
    assert_eq!(job_view(&s, id).await.state, JobState::Queued);
    let leased = lease_one(&s, lease_req(at(5_000), 10)).await;
    assert_eq!((leased.id, leased.attempt), (id, 1));
}

pub async fn enqueue_reports_the_tenants_inflight<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let first = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    assert_eq!(lease_one(&s, lease_req(at(1), 1)).await.id, first);

    let out = s
        .enqueue(vec![
            new_job("resize", "acme", "default"),
            new_job("resize", "acme", "bulk"),
            new_job("resize", "globex", "default"),
        ])
        .await
        .unwrap();
    let inflight: Vec<u32> = out
        .iter()
        .map(|o| match o {
            EnqueueOutcome::Created { inflight, .. } => *inflight,
            other => panic!("expected Created, got {other:?}"),
        })
        .collect();
    assert_eq!(inflight, vec![1, 0, 0], "per tenant, per lane");
}
