//! A handler that panics spends its budget and lands in the dead letters
//! with kind `panic`, its message and a backtrace — and the same worker
//! goes on completing every other job.

use std::time::Duration;

use lazaret_client::{
    AttemptOutcome, DeadLetterFilter, DeadLetterQuery, DeadLetterReason, Job, JobState, NewJob,
    Worker,
};
use serde::{Deserialize, Serialize};

use crate::support::{self, CONFIG, wait_state};

#[derive(Debug, Serialize, Deserialize)]
struct Work {
    n: u32,
    panic: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_is_dead_lettered_after_its_budget_while_the_rest_succeed() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    let worker = Worker::builder(client.clone())
        .worker_id("panics")
        .concurrency(2)
        .lease(Duration::from_secs(5))
        .poll_wait(Duration::from_millis(200))
        .handle("work", |job: Job<Work>| async move {
            if job.payload.panic {
                panic!("deliberate panic in job {}", job.payload.n);
            }
            Ok(())
        })
        .build()
        .unwrap();
    let running = support::run(worker);

    let bad = client
        .enqueue(&NewJob::new("work", "acme", &Work { n: 0, panic: true }).unwrap())
        .await
        .unwrap()
        .id;
    let mut good = Vec::new();
    for n in 1..=10 {
        let job = NewJob::new("work", "acme", &Work { n, panic: false }).unwrap();
        good.push(client.enqueue(&job).await.unwrap().id);
    }

    let dead = wait_state(client, bad, JobState::DeadLettered).await;
    assert_eq!(dead.attempt, 3, "attempts_max = 3 deliveries");
    // The worker kept serving: jobs enqueued after the poison still run.
    let late = client
        .enqueue(
            &NewJob::new(
                "work",
                "acme",
                &Work {
                    n: 11,
                    panic: false,
                },
            )
            .unwrap(),
        )
        .await
        .unwrap()
        .id;
    good.push(late);
    for id in &good {
        wait_state(client, *id, JobState::Succeeded).await;
    }

    let page = client
        .dead_letters(&DeadLetterQuery {
            filter: DeadLetterFilter {
                job_type: Some("work".into()),
                ..Default::default()
            },
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(page.items.len(), 1);
    let dl = &page.items[0];
    assert_eq!(dl.job_id, Some(bad));
    assert!(
        matches!(
            dl.reason,
            DeadLetterReason::Exhausted | DeadLetterReason::KindExhausted
        ),
        "{:?}",
        dl.reason
    );
    let error = dl.error.as_ref().expect("the last failure");
    assert_eq!(error.kind.as_str(), "panic");
    assert!(
        error.message.contains("deliberate panic in job 0"),
        "{}",
        error.message
    );
    assert!(error.traceback.as_deref().is_some_and(|t| !t.is_empty()));
    assert_eq!(dl.history.len(), 3);
    for h in &dl.history {
        assert_eq!(h.error.as_ref().unwrap().kind.as_str(), "panic");
    }
    assert_eq!(
        dl.history.last().unwrap().outcome,
        AttemptOutcome::DeadLettered
    );

    let report = running.stop().await;
    assert_eq!(report.panicked, 3);
    assert_eq!(report.succeeded, 11);
}
