//! `lazaret bench` (against a running server, and starting its own) and the
//! promise bench (`benches/promise/`): every job through once.

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

/// Runs `lazaret bench --json` with `args`, the bench starting servers of
/// its own; returns its report.
async fn bench_own_servers(args: &[&str]) -> Value {
    let mut args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
    if !args.iter().any(|a| a == "--consumers") {
        args.extend(["--consumers".into(), "2".into()]);
    }
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_lazaret"))
            .args(["bench", "--json", "--runs", "1"])
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

/// Two nodes on one PostgreSQL schema under one-job requests (6 producers,
/// 10 consumers over 8 tenants): every job once, and no group of either
/// node rolled back by a deadlock. Before the counts' lock (`COUNTS_LOCK`
/// in the PostgreSQL writer) two nodes deadlocked on the `pairs` rows
/// dozens of times a run, each costing the database's 1 s
/// `deadlock_timeout` (50 jobs/s instead of 900).
#[tokio::test]
async fn two_postgres_nodes_under_one_job_requests_never_deadlock() {
    let Some(url) = lazaret_testkit::service(
        "LAZARET_TEST_PG_URL",
        "postgres://…",
        "the two-node bench test",
    ) else {
        return;
    };
    let report = bench_own_servers(&[
        "--store",
        &url,
        "--nodes",
        "2",
        "--jobs",
        "1500",
        "--batch",
        "1",
        "--producers",
        "6",
        "--consumers",
        "10",
        "--backlog",
        "0",
    ])
    .await;
    assert_eq!(report["ok"], true, "{report}");
    assert_eq!(report["verify"]["acked"], 1500, "{report}");
    let nodes = report["store"].as_array().expect("each node's store stats");
    assert_eq!(nodes.len(), 2, "{report}");
    for node in nodes {
        assert_eq!(node["backend"], "postgres", "{report}");
        assert_eq!(node["conflicts"], 0, "a group rolled back: {node}");
    }
}

/// The promise scenarios: `cargo bench -p lazaret --bench promise`, outside
/// the shipped binary; included here to run each scenario small.
#[path = "../../benches/promise/scenarios.rs"]
mod promise;

/// Runs a promise scenario with `args` (one run of each side, two
/// workers), as `cargo bench -p lazaret --bench promise -- --json ...`
/// would; returns its report.
async fn promise_bench(args: &[&str]) -> Value {
    use clap::Parser as _;
    let argv = ["promise", "--runs", "1", "--consumers", "2"];
    let args = promise::Args::try_parse_from(argv.iter().chain(args)).expect("promise options");
    let mut human = Vec::new();
    let report = promise::run(&args, &mut human)
        .await
        .expect("the promise bench runs");
    if let Err(e) = report.check(args.scenario) {
        panic!("{e:#}\n{}", String::from_utf8_lossy(&human));
    }
    report.json
}

/// The runs of a promise scenario's report, by side, each checked to have
/// completed and verified.
fn runs_by_side(report: &Value) -> std::collections::BTreeMap<String, Value> {
    assert_eq!(report["failed_to_run"], serde_json::json!([]), "{report}");
    let runs = report["runs"].as_array().expect("runs");
    for r in runs {
        assert_eq!(r["ok"], true, "{r}");
    }
    runs.iter()
        .map(|r| (r["side"].as_str().unwrap().to_owned(), r.clone()))
        .collect()
}

#[tokio::test]
async fn lane_flood_measures_paced_jobs_idle_and_beside_a_flood() {
    let report = promise_bench(&[
        "--scenario",
        "lane-flood",
        "--flood-jobs",
        "300",
        "--probe-jobs",
        "8",
        "--probe-interval-ms",
        "2",
        "--work-us",
        "0",
    ])
    .await;
    let runs = runs_by_side(&report);
    for (side, jobs) in [("idle", 8), ("flood", 308)] {
        let r = &runs[side];
        assert_eq!(r["verify"]["enqueued"], jobs, "{r}");
        assert_eq!(r["verify"]["acked"], jobs, "{r}");
        // Every paced job's enqueue → lease was measured.
        assert_eq!(r["start_latency"]["count"], 8, "{r}");
    }
    assert!(report["summary"]["ratio_p95"].is_number(), "{report}");
}

#[tokio::test]
async fn tenant_flood_times_every_small_tenant_alone_and_beside_the_big_one() {
    let report = promise_bench(&[
        "--scenario",
        "tenant-flood",
        "--big-tenant-jobs",
        "200",
        "--small-tenants",
        "3",
        "--small-tenant-jobs",
        "5",
        "--work-us",
        "0",
    ])
    .await;
    let runs = runs_by_side(&report);
    for (side, jobs) in [("alone", 15), ("flood", 215)] {
        let r = &runs[side];
        assert_eq!(r["verify"]["acked"], jobs, "{r}");
        let tenants: Vec<&String> = r["small_tenants_s"].as_object().unwrap().keys().collect();
        assert_eq!(tenants, ["small-0", "small-1", "small-2"], "{r}");
    }
    assert!(runs["flood"]["big_tenant_s"].is_number());
    assert!(report["summary"]["worst_ratio"].is_number(), "{report}");
}

#[tokio::test]
async fn poison_storm_dead_letters_every_bad_job_with_its_reason() {
    let report = promise_bench(&[
        "--scenario",
        "poison-storm",
        "--jobs",
        "100",
        "--work-us",
        "0",
    ])
    .await;
    let runs = runs_by_side(&report);
    let clean = &runs["clean"];
    assert_eq!(clean["verify"]["acked"], 100, "{clean}");
    assert_eq!(clean["handler_calls"], 100, "{clean}");
    let storm = &runs["storm"];
    let v = &storm["verify"];
    // 10 failed permanently, 5 dropped until they crash-looped, 85 acked.
    assert_eq!(
        (&v["acked"], &v["dead_expected"], &v["dead_right"]),
        (&Value::from(85), &Value::from(15), &Value::from(15)),
        "{storm}"
    );
    // Each dropped job was delivered twice (crash_loop_max = 2).
    assert_eq!(storm["handler_calls"], 85 + 10 + 5 * 2, "{storm}");
    assert_eq!(report["summary"]["dead_letters_right"], true, "{report}");
}

#[tokio::test]
async fn start_latency_measures_every_job_of_an_idle_worker() {
    let report = promise_bench(&[
        "--scenario",
        "start-latency",
        "--probe-jobs",
        "6",
        "--probe-interval-ms",
        "2",
    ])
    .await;
    let runs = runs_by_side(&report);
    let r = &runs["idle"];
    assert_eq!(r["verify"]["acked"], 6, "{r}");
    assert_eq!(r["start_latency"]["count"], 6, "{r}");
    assert!(
        report["summary"]["start_p99_ms"]["median"].is_number(),
        "{report}"
    );
}

/// `--scenario tenants` (issue 32): both sides run, one tenant and one
/// job per tenant, and the report gives their lease rates and the ratio.
#[tokio::test]
async fn tenants_measures_single_job_leases_over_one_tenant_and_many() {
    let report =
        bench_own_servers(&["--scenario", "tenants", "--jobs", "300", "--measure-s", "1"]).await;
    let runs = report["runs"].as_array().expect("runs");
    let tenants: Vec<&Value> = runs.iter().map(|r| &r["tenants"]).collect();
    assert_eq!(
        tenants,
        [&serde_json::json!(1), &serde_json::json!(300)],
        "{report}"
    );
    for r in runs {
        assert_eq!(r["errors"], serde_json::json!([]), "{r}");
        assert!(r["leases"].as_u64().unwrap() > 0, "{r}");
        assert!(r["lease"]["count"].as_u64().unwrap() > 0, "{r}");
    }
    assert!(report["ratio"].is_number(), "{report}");
}
