//! A job's W3C trace context goes from the producer's `NewJob` to the
//! leased job and the handler, and one the server refuses is an error.

use std::time::Duration;

use lazaret_client::{ErrorCode, Job, JobState, LeaseRequest, NewJob, Worker};

use crate::support::{self, CONFIG, recv, wait_state};

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_goes_from_the_enqueue_to_the_leased_job_and_the_handler() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    let job = |n: u32| NewJob::new("traced", "acme", &serde_json::json!({ "n": n })).unwrap();
    let traced = client
        .enqueue(&job(1).traceparent(TRACEPARENT))
        .await
        .unwrap()
        .id;
    let plain = client.enqueue(&job(2)).await.unwrap().id;
    let refused = client
        .enqueue(&job(3).traceparent("00-0000"))
        .await
        .expect_err("not a traceparent");
    assert_eq!(refused.code(), Some(&ErrorCode::BadRequest), "{refused}");
    assert!(refused.to_string().contains("traceparent"), "{refused}");

    let mut req = LeaseRequest::new("trace-reader");
    req.max_jobs = 2;
    let leased = client.lease(&req).await.unwrap();
    let mut seen: Vec<_> = leased
        .iter()
        .map(|j| (j.id, j.traceparent.clone()))
        .collect();
    seen.sort_by_key(|(id, _)| *id);
    assert_eq!(
        seen,
        vec![(traced, Some(TRACEPARENT.to_owned())), (plain, None)]
    );
    for j in &leased {
        client.ack(j.id, &j.lease_token).await.unwrap();
    }

    // The handler reads it from its job.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let worker = Worker::builder(client.clone())
        .poll_wait(Duration::from_millis(200))
        .handle("traced", move |job: Job<serde_json::Value>| {
            let tx = tx.clone();
            async move {
                let _ = tx.send(job.traceparent().map(str::to_owned));
                Ok(())
            }
        })
        .build()
        .unwrap();
    let running = support::run(worker);
    let again = client
        .enqueue(&job(4).traceparent(TRACEPARENT))
        .await
        .unwrap()
        .id;
    assert_eq!(
        recv("the handler's traceparent", &mut rx).await.as_deref(),
        Some(TRACEPARENT)
    );
    wait_state(client, again, JobState::Succeeded).await;
    running.stop().await;
}
