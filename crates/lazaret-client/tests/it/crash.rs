//! A worker process killed with SIGKILL mid-job: the lease runs out, the
//! expiry is charged as one attempt, and the job is leased again as
//! attempt 2.

use std::process::Stdio;
use std::time::Duration;

use lazaret_client::{JobState, LeaseRequest, NewJob, Outcome};
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::{self, CONFIG, DEADLINE, wait_state};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_worker_s_job_is_leased_again_with_one_attempt_charged() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let Some(worker_bin) = support::target_bin("examples/slow_worker") else {
        lazaret_testkit::skip(
            "a_killed_worker_s_job_is_leased_again_with_one_attempt_charged",
            "examples/slow_worker is not built (cargo test builds it)",
        );
        return;
    };
    let client = &server.client;
    let mut child = tokio::process::Command::new(worker_bin)
        .args(["--server", &server.url, "--lease-ms", "800"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start slow_worker");
    let id = client
        .enqueue(&NewJob::new("slow", "acme", &serde_json::json!({ "sleep_ms": 600_000 })).unwrap())
        .await
        .unwrap()
        .id;

    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let started = tokio::time::timeout(DEADLINE, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if line.starts_with("started ") {
                return line;
            }
        }
        panic!("slow_worker exited before starting the job");
    })
    .await
    .expect("slow_worker did not start the job in time");
    assert_eq!(started, format!("started {id} attempt 1"));
    assert_eq!(client.job(id).await.unwrap().state, JobState::Leased);

    child.start_kill().expect("SIGKILL"); // Child::start_kill sends SIGKILL
    child.wait().await.unwrap();

    // Nobody acks, fails or heartbeats: the lease runs out and the job comes back.
    let mut req = LeaseRequest::new("rescuer");
    req.wait = Duration::from_secs(2);
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let job = loop {
        if let Some(j) = client.lease(&req).await.unwrap().pop() {
            break j;
        }
        assert!(tokio::time::Instant::now() < deadline, "never re-leased");
    };
    assert_eq!(job.id, id);
    assert_eq!(job.attempt, 2, "the killed delivery was charged once");
    let info = client.job(id).await.unwrap();
    let expired = info.history[0].error.as_ref().unwrap();
    assert_eq!(expired.kind.as_str(), "lease_expired");
    assert_eq!(info.lease_expiries, 1);
    assert_eq!(
        info.history[1].worker_id.as_ref().unwrap().as_str(),
        "rescuer"
    );

    assert_eq!(
        client.ack(job.id, &job.lease_token).await.unwrap(),
        Outcome::Succeeded
    );
    wait_state(client, id, JobState::Succeeded).await;
}
