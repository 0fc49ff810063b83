//! `ack_next` and `fail_next`: the outcome and the next lease in one round trip.

use lazaret_client::{ErrorCode, Failure, LeaseRequest, NewJob, Outcome};

use crate::support::{self, CONFIG};

#[tokio::test]
async fn ack_next_and_fail_next_answer_the_outcome_and_the_next_jobs() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    let mut ids = Vec::new();
    for n in 0..3 {
        let job = NewJob::new("report", "acme", &serde_json::json!({ "n": n })).unwrap();
        ids.push(client.enqueue(&job).await.unwrap().id);
    }
    let req = LeaseRequest::new("one-at-a-time");
    let first = client.lease(&req).await.unwrap().pop().expect("a job");
    assert_eq!(first.id, ids[0]);

    let r = client
        .ack_next(first.id, &first.lease_token, &req)
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::Succeeded);
    assert!(r.next_error.is_none(), "{:?}", r.next_error);
    let [second] = r.jobs.as_slice() else {
        panic!("one job: {:?}", r.jobs)
    };
    assert_eq!(second.id, ids[1]);
    assert_eq!(
        second.payload.get(),
        r#"{"n":1}"#,
        "the payload's own bytes"
    );

    let r = client
        .fail_next(
            second.id,
            &second.lease_token,
            &Failure::permanent("bad", "no"),
            &req,
        )
        .await
        .unwrap();
    assert!(
        matches!(r.outcome, Outcome::DeadLettered { .. }),
        "{:?}",
        r.outcome
    );
    assert_eq!(r.jobs.len(), 1);
    let third = &r.jobs[0];
    assert_eq!(third.id, ids[2]);

    // The lease part refused: the ack stands, and next_error says why.
    let mut bad = req.clone();
    bad.max_jobs = 0;
    let r = client
        .ack_next(third.id, &third.lease_token, &bad)
        .await
        .unwrap();
    assert_eq!(r.outcome, Outcome::Succeeded);
    assert!(r.jobs.is_empty());
    let e = r.next_error.expect("the lease was refused");
    assert_eq!(e.code, ErrorCode::BadRequest);
    assert!(e.message.contains("max_jobs"), "{e}");
    assert_eq!(
        client.job(third.id).await.unwrap().state,
        lazaret_client::JobState::Succeeded
    );

    // The ack refused: an error, and nothing leased.
    let e = client
        .ack_next(third.id, &third.lease_token, &req)
        .await
        .unwrap_err();
    assert!(e.is_lease_lost() || e.is_not_found(), "{e}");
}
