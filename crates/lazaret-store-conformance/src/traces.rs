//! Trace context: the `traceparent` a job was enqueued with (or a broker
//! message carried) is kept with it, handed out with its lease, reported
//! with its outcome and kept on its dead letter.

use lazaret_core::{Event, TraceParent, Transition};
use lazaret_store::{NewJob, Stage, Store};

use crate::Backend;

use super::{at, complete, enqueue_one, job_view, lease_one, lease_req, new_job, permanent};

const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn tp() -> TraceParent {
    TraceParent::parse(TP).expect("the W3C example")
}

pub async fn a_traceparent_goes_from_enqueue_to_lease_outcome_and_dead_letter<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let traced = enqueue_one(
        &s,
        NewJob {
            traceparent: Some(tp()),
            ..new_job("resize", "acme", "default")
        },
    )
    .await;
    assert_eq!(job_view(&s, traced).await.envelope.traceparent, Some(tp()));

    let leased = lease_one(&s, lease_req(at(10), 1)).await;
    assert_eq!(leased.id, traced);
    assert_eq!(leased.traceparent, Some(tp()));

    let done = complete(&s, &leased, Event::Failed(permanent()), at(20)).await;
    assert!(matches!(done.transition, Transition::DeadLetter { .. }));
    assert_eq!(done.traceparent, Some(tp()));
    assert_eq!(done.tenant.as_str(), "acme");
    let dl = s
        .dead_letter(done.dead_letter.expect("dead-lettered"))
        .await
        .unwrap()
        .expect("the dead letter exists");
    assert_eq!(dl.traceparent, Some(tp()));

    // Redriven, the job keeps its trace: its next lease hands it out again.
    s.redrive(vec![dl.id], at(30), None).await.unwrap();
    let again = lease_one(&s, lease_req(at(40), 1)).await;
    assert_eq!((again.id, again.traceparent.clone()), (traced, Some(tp())));
    let acked = complete(&s, &again, Event::Succeeded, at(50)).await;
    assert_eq!(acked.traceparent, Some(tp()));
}

pub async fn a_job_without_a_traceparent_has_none_anywhere<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let id = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    let leased = lease_one(&s, lease_req(at(10), 1)).await;
    assert_eq!(leased.traceparent, None);
    let done = complete(&s, &leased, Event::Failed(permanent()), at(20)).await;
    assert_eq!(done.traceparent, None);
    let dl = s
        .dead_letter(done.dead_letter.expect("dead-lettered"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(dl.traceparent, None);
    assert_eq!(job_view(&s, id).await.envelope.traceparent, None);
}

pub async fn a_broker_dead_letter_keeps_its_messages_traceparent<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let mut dl = crate::sources::quarantined("orders-src", "m-1", Stage::Processing, 1_000);
    if let Some(env) = dl.envelope.as_mut() {
        env.traceparent = Some(tp());
    }
    let q = s.quarantine_message(dl).await.unwrap();
    let read = s.dead_letter(q.id).await.unwrap().unwrap();
    assert_eq!(read.traceparent, Some(tp()));
}
