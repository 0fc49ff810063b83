//! Heartbeats keep a long handler's lease; without them the lease expires,
//! the job goes back in line charged, and the late ack meets `LEASE_LOST`
//! — which the runtime drops instead of retrying.

use std::time::Duration;

use lazaret_client::{
    ErrorCode, Failure, Job, JobResult, JobState, LeaseRequest, NewJob, Outcome, Worker,
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::support::{self, CONFIG, recv, wait_for, wait_state};

#[derive(Debug, Serialize, Deserialize)]
struct Nap {
    /// How long the first delivery sleeps; later ones return at once.
    first_ms: u64,
}

async fn sleepy(job: Job<Nap>) -> Result<(), Failure> {
    if job.attempt() == 1 {
        tokio::time::sleep(Duration::from_millis(job.payload.first_ms)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_keep_the_lease_of_a_handler_that_outlives_it() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    let (tx, mut reports) = mpsc::unbounded_channel();
    let worker = Worker::builder(client.clone())
        .concurrency(1)
        .lease(Duration::from_millis(600))
        .poll_wait(Duration::from_millis(200))
        .handle("nap", sleepy)
        .on_report(move |r| drop(tx.send(r.clone())))
        .build()
        .unwrap();
    let running = support::run(worker);
    // Four leases long.
    let id = client
        .enqueue(&NewJob::new("nap", "acme", &Nap { first_ms: 2_400 }).unwrap())
        .await
        .unwrap()
        .id;
    let r = recv("the job's report", &mut reports).await;
    assert_eq!(r.id, id);
    assert!(matches!(r.result, JobResult::Succeeded), "{:?}", r.result);
    assert_eq!(r.attempt, 1);
    assert!(r.elapsed >= Duration::from_millis(2_400));
    let job = wait_state(client, id, JobState::Succeeded).await;
    assert_eq!(job.attempt, 1, "no lease expired, no attempt charged");
    assert_eq!(job.lease_expiries, 0);
    let report = running.stop().await;
    assert_eq!((report.succeeded, report.lease_lost), (1, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_heartbeats_the_lease_is_lost_and_the_late_ack_is_dropped() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    let (tx, mut reports) = mpsc::unbounded_channel();
    let worker = Worker::builder(client.clone())
        .concurrency(1)
        .lease(Duration::from_millis(300))
        .heartbeats(false)
        .poll_wait(Duration::from_millis(200))
        .handle("nap", sleepy)
        .on_report(move |r| drop(tx.send(r.clone())))
        .build()
        .unwrap();
    let running = support::run(worker);
    let id = client
        .enqueue(&NewJob::new("nap", "acme", &Nap { first_ms: 1_500 }).unwrap())
        .await
        .unwrap()
        .id;
    let first = recv("the first delivery's report", &mut reports).await;
    assert_eq!((first.id, first.attempt), (id, 1));
    assert!(
        matches!(first.result, JobResult::LeaseLost),
        "{:?}",
        first.result
    );
    // The expiry was charged; the next delivery runs and acks.
    let second = recv("the second delivery's report", &mut reports).await;
    assert_eq!((second.id, second.attempt), (id, 2));
    assert!(
        matches!(second.result, JobResult::Succeeded),
        "{:?}",
        second.result
    );
    let job = wait_state(client, id, JobState::Succeeded).await;
    let expired = job.history[0].error.as_ref().expect("the expiry's error");
    assert_eq!(expired.kind.as_str(), "lease_expired");
    let report = running.stop().await;
    assert_eq!((report.lease_lost, report.succeeded), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_ack_heartbeat_or_fail_gets_a_typed_lease_lost() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    let id = client
        .enqueue(&NewJob::new("manual", "acme", &serde_json::json!({})).unwrap())
        .await
        .unwrap()
        .id;
    let mut req = LeaseRequest::new("manual-worker");
    req.lease = Duration::from_millis(100);
    req.wait = Duration::from_secs(5);
    let job = client.lease(&req).await.unwrap().pop().expect("a job");
    assert_eq!((job.id, job.attempt), (id, 1));
    // Wait until the server has reaped the lease.
    wait_for("the lease to expire", || async {
        let j = client.job(id).await.ok()?;
        (j.state != JobState::Leased).then_some(())
    })
    .await;
    let err = client.ack(job.id, &job.lease_token).await.unwrap_err();
    assert!(err.is_lease_lost(), "{err}");
    match &err {
        lazaret_client::ClientError::Api { status, code, .. } => {
            assert_eq!(status.as_u16(), 409);
            assert_eq!(*code, ErrorCode::LeaseLost);
        }
        other => panic!("{other:?}"),
    }
    let hb = client
        .heartbeat(job.id, &job.lease_token, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(hb.is_lease_lost(), "{hb}");
    let fail = client
        .fail(job.id, &job.lease_token, &Failure::transient("x", "late"))
        .await
        .unwrap_err();
    assert!(fail.is_lease_lost(), "{fail}");
    // The batched form answers per item.
    let items = [lazaret_client::AckItem {
        id: job.id,
        lease_token: job.lease_token.clone(),
    }];
    let results = client.acks(&items).await.unwrap();
    assert_eq!(results[0].as_ref().unwrap_err().code, ErrorCode::LeaseLost);

    // The job's current holder can still finish it.
    let again = client.lease(&req).await.unwrap().pop().expect("re-leased");
    assert_eq!(again.attempt, 2);
    let outcome = client.ack(again.id, &again.lease_token).await.unwrap();
    assert_eq!(outcome, Outcome::Succeeded);
}
