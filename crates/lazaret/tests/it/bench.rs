//! `lazaret bench --server` against a running server: every job through once.

use serde_json::Value;

use crate::harness::{QUICK, Server};

/// Runs the bench binary against `server` with `args`; returns its report.
async fn bench(server: &Server, args: &[&str]) -> Value {
    let base = server.base().to_owned();
    let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_lazaret"))
            .args(["bench", "--server", &base, "--json"])
            .args(&args)
            .output()
            .expect("the lazaret binary runs")
    })
    .await
    .expect("bench thread");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench failed: {stderr}");
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {stderr}"))
}

#[tokio::test]
async fn cyclers_enqueue_lease_and_ack_every_job_exactly_once() {
    let server = Server::start(QUICK).await;
    let report = bench(
        &server,
        &[
            "--jobs",
            "300",
            "--batch",
            "1",
            "--producers",
            "0",
            "--consumers",
            "0",
            "--cyclers",
            "4",
        ],
    )
    .await;
    let verify = &report["verify"];
    assert_eq!(
        (&verify["enqueued"], &verify["acked"], &report["ok"]),
        (&Value::from(300), &Value::from(300), &Value::from(true)),
        "{report}"
    );
    assert_eq!(report["enqueue"]["count"], 300, "{report}");
    assert_eq!(report["ack"]["count"], 300, "{report}");
}

#[tokio::test]
async fn cyclers_work_alongside_producers_and_consumers() {
    let server = Server::start(QUICK).await;
    let report = bench(
        &server,
        &[
            "--jobs",
            "400",
            "--batch",
            "10",
            "--producers",
            "1",
            "--consumers",
            "1",
            "--cyclers",
            "2",
        ],
    )
    .await;
    assert_eq!(report["verify"]["acked"], 400, "{report}");
    assert_eq!(report["ok"], true, "{report}");
}
