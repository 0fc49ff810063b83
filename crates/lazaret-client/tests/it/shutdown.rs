//! Graceful shutdown: running handlers finish and ack; jobs prefetched but
//! not started, and handlers still running at the grace's end, are handed
//! back as `deferred` — so they are not charged an attempt.

use std::time::Duration;

use lazaret_client::{
    AttemptOutcome, Job, JobId, JobResult, JobState, LeaseRequest, NewJob, Worker,
};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::support::{self, CONFIG, recv, wait_state};

#[derive(Debug, Serialize, Deserialize)]
struct Nap {
    ms: u64,
}

/// Leases `id` by hand (after its handback delay) and checks it was not charged.
async fn assert_uncharged(client: &lazaret_client::Client, ids: &[JobId]) {
    for id in ids {
        let info = client.job(*id).await.unwrap();
        let last = info.history.last().expect("a delivery");
        assert_eq!(last.outcome, AttemptOutcome::Deferred, "job {id}");
        assert_eq!(last.error.as_ref().unwrap().kind.as_str(), "shutdown");
        assert_eq!(
            info.attempt, 0,
            "job {id}: the deferral gave the attempt back"
        );
    }
    let mut req = LeaseRequest::new("after-shutdown");
    req.max_jobs = 100;
    req.wait = Duration::from_secs(3);
    let mut seen = Vec::new();
    while seen.len() < ids.len() {
        let jobs = client.lease(&req).await.unwrap();
        assert!(!jobs.is_empty(), "the handed-back jobs came back");
        for j in jobs {
            assert!(ids.contains(&j.id));
            assert_eq!(j.attempt, 1, "job {}: the same attempt number again", j.id);
            seen.push(j.id);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_running_jobs_and_hands_back_prefetched_ones_uncharged() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let (report_tx, mut reports) = mpsc::unbounded_channel();
    let worker = Worker::builder(client.clone())
        .concurrency(1)
        .prefetch(3)
        .lease(Duration::from_secs(10))
        .poll_wait(Duration::from_millis(300))
        .shutdown_grace(Duration::from_secs(20))
        .handle("nap", move |job: Job<Nap>| {
            let started_tx = started_tx.clone();
            async move {
                let _ = started_tx.send(job.id());
                tokio::time::sleep(Duration::from_millis(job.payload.ms)).await;
                Ok(())
            }
        })
        .on_report(move |r| drop(report_tx.send(r.clone())))
        .build()
        .unwrap();
    let running = support::run(worker);

    // Two quick jobs first: the runtime prefetches only once it has seen
    // how long handlers take.
    for _ in 0..2 {
        let job = NewJob::new("nap", "acme", &Nap { ms: 0 }).unwrap();
        client.enqueue(&job).await.unwrap();
        recv("a warm-up start", &mut started).await;
        let r = recv("a warm-up report", &mut reports).await;
        assert!(matches!(r.result, JobResult::Succeeded), "{:?}", r.result);
    }

    // One batch: one runs, three wait leased in the prefetch.
    let jobs: Vec<NewJob> = (0..4)
        .map(|_| NewJob::new("nap", "acme", &Nap { ms: 800 }).unwrap())
        .collect();
    let ids: Vec<JobId> = client
        .enqueue_batch(&jobs)
        .await
        .unwrap()
        .into_iter()
        .map(|r| r.unwrap().id)
        .collect();
    let first = recv("a slow start", &mut started).await;
    // All four are leased to this worker before it is told to stop.
    for id in &ids {
        wait_state(client, *id, JobState::Leased).await;
    }
    let report = running.stop().await;

    assert_eq!(report.succeeded, 3, "{report:?}");
    assert_eq!(report.handed_back, 3, "{report:?}");
    assert!(started.try_recv().is_err(), "no job started after shutdown");
    let info = wait_state(client, first, JobState::Succeeded).await;
    assert_eq!(info.attempt, 1);
    let rest: Vec<JobId> = ids.into_iter().filter(|id| *id != first).collect();
    let mut handed_back = Vec::new();
    while let Ok(r) = reports.try_recv() {
        if let JobResult::HandedBack { started, .. } = r.result {
            assert!(!started);
            handed_back.push(r.id);
        }
    }
    handed_back.sort();
    assert_eq!(handed_back, rest);
    assert_uncharged(client, &rest).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handlers_still_running_when_the_grace_ends_are_handed_back_uncharged() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    let (started_tx, mut started) = mpsc::unbounded_channel();
    let worker = Worker::builder(client.clone())
        .concurrency(2)
        .lease(Duration::from_secs(10))
        .poll_wait(Duration::from_millis(300))
        .shutdown_grace(Duration::from_millis(300))
        .handle("nap", move |job: Job<Nap>| {
            let started_tx = started_tx.clone();
            async move {
                let _ = started_tx.send(job.id());
                tokio::time::sleep(Duration::from_millis(job.payload.ms)).await;
                Ok(())
            }
        })
        .build()
        .unwrap();
    let running = support::run(worker);
    let mut ids = Vec::new();
    for _ in 0..2 {
        let job = NewJob::new("nap", "acme", &Nap { ms: 600_000 }).unwrap();
        ids.push(client.enqueue(&job).await.unwrap().id);
    }
    recv("a start", &mut started).await;
    recv("a start", &mut started).await;
    let report = running.stop().await;
    assert_eq!((report.handed_back, report.succeeded), (2, 0), "{report:?}");
    ids.sort();
    assert_uncharged(client, &ids).await;
}
