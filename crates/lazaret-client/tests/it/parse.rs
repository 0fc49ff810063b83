//! A payload that does not deserialise into the handler's type is
//! dead-lettered at once as `parse`, and the handler never runs.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use lazaret_client::{Class, DeadLetterReason, Job, JobState, NewJob, Worker};
use serde::Deserialize;

use crate::support::{self, CONFIG, wait_state};

#[derive(Debug, Deserialize)]
struct Typed {
    n: u32,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_that_does_not_fit_is_dead_lettered_at_once_as_parse() {
    let config = format!("{CONFIG}\n[types.typed]\nkinds = {{ parse = 1 }}\n");
    let Some(server) = support::start(&config).await else {
        return;
    };
    let client = &server.client;
    let calls = Arc::new(AtomicU32::new(0));
    let seen = calls.clone();
    let worker = Worker::builder(client.clone())
        .poll_wait(Duration::from_millis(200))
        .handle("typed", move |job: Job<Typed>| {
            let seen = seen.clone();
            async move {
                assert_eq!(job.payload.n, 5);
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        })
        .build()
        .unwrap();
    let running = support::run(worker);

    let bad_payload = serde_json::json!({ "n": "five" });
    let bad = client
        .enqueue(&NewJob::new("typed", "acme", &bad_payload).unwrap())
        .await
        .unwrap()
        .id;
    let good = client
        .enqueue(&NewJob::new("typed", "acme", &serde_json::json!({ "n": 5 })).unwrap())
        .await
        .unwrap()
        .id;

    let dead = wait_state(client, bad, JobState::DeadLettered).await;
    wait_state(client, good, JobState::Succeeded).await;
    assert_eq!(dead.attempt, 1, "dead-lettered on the first delivery");
    assert_eq!(dead.history.len(), 1);
    let error = dead.history[0].error.as_ref().unwrap();
    assert_eq!(error.kind.as_str(), "parse");
    assert_eq!(error.class, Class::Permanent);
    assert!(error.message.contains("invalid type"), "{}", error.message);

    let page = client.dead_letters(&Default::default()).await.unwrap();
    let dl = page.items.iter().find(|d| d.job_id == Some(bad)).unwrap();
    assert!(
        matches!(
            dl.reason,
            DeadLetterReason::Permanent | DeadLetterReason::KindExhausted
        ),
        "{:?}",
        dl.reason
    );
    // The bytes are kept as sent, for a fix and a redrive.
    let payload = client.dead_letter_payload(dl.id).await.unwrap();
    assert_eq!(payload, serde_json::to_vec(&bad_payload).unwrap());

    let report = running.stop().await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "the handler only saw the good job"
    );
    assert_eq!(report.parse_failed, 1);
}
