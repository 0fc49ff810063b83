//! The charts' series (`GET /v1/series`, issue 33 part 5): what they count
//! after some dead letters, a redrive and successes, that they survive a
//! restart, that two nodes on one PostgreSQL answer the same, and that a
//! query naming what does not exist is refused.

use std::collections::BTreeMap;

use lazaret_testkit::eventually;
use serde_json::{Value, json};

use crate::harness::{Api, QUICK, Server, assert_error, job, lease_req};

/// The sampler every 100 ms, so a test waits little for its minute.
fn config() -> String {
    format!("{QUICK}\n[retention]\nseries_sample_ms = 100\n")
}

/// An answer's points, keyed `signal/by/name/at` (`name` `-` for null).
fn points(answer: &Value) -> BTreeMap<String, u64> {
    let at = answer["at"].as_array().expect("at");
    let mut out = BTreeMap::new();
    for line in answer["series"].as_array().expect("series") {
        let name = line["name"].as_str().unwrap_or("-");
        for (i, v) in line["values"]
            .as_array()
            .expect("values")
            .iter()
            .enumerate()
        {
            if let Some(v) = v.as_u64() {
                let key = format!("{}/{}/{name}/{}", line["signal"], line["by"], at[i]);
                out.insert(key.replace('"', ""), v);
            }
        }
    }
    out
}

/// The sum of one line's values over the answer's window.
fn sum(answer: &Value, signal: &str, by: &str, name: Option<&str>) -> u64 {
    answer["series"]
        .as_array()
        .expect("series")
        .iter()
        .filter(|l| l["signal"] == signal && l["by"] == by && l["name"].as_str() == name)
        .flat_map(|l| l["values"].as_array().expect("values").clone())
        .filter_map(|v| v.as_u64())
        .sum()
}

/// The latest sampled value of one line.
fn latest(answer: &Value, signal: &str, by: &str, name: Option<&str>) -> Option<u64> {
    answer["series"]
        .as_array()
        .expect("series")
        .iter()
        .find(|l| l["signal"] == signal && l["by"] == by && l["name"].as_str() == name)
        .and_then(|l| {
            l["values"]
                .as_array()
                .expect("values")
                .iter()
                .rev()
                .find_map(Value::as_u64)
        })
}

async fn series(api: &Api, window: &str) -> Value {
    api.get(&format!("/v1/series?window={window}"))
        .await
        .expect(200)
        .clone()
}

/// Two `report` jobs dead-lettered and one acked; the first dead letter
/// redriven and then acked.
async fn seed(api: &Api) {
    for n in 0..2 {
        let id = api
            .enqueue_ok(&job("report", "acme", json!({ "n": n })))
            .await;
        let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
        assert_eq!(leased["id"], id);
        api.fail(
            &id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "bad_row", "message": format!("row {n} is bad")}),
        )
        .await
        .expect(200);
    }
    let ok = api
        .enqueue_ok(&job("report", "acme", json!({"n": 9})))
        .await;
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    assert_eq!(leased["id"], ok);
    api.ack(&ok, &leased["lease_token"]).await.expect(200);
    // A dead letter counts once a sampling saw it (docs/api.md, "Signals
    // over time"): wait for that before one is redriven.
    eventually("a sampling saw both dead letters", || {
        let api = api.clone();
        async move {
            sum(
                &series(&api, "1h").await,
                "dead_lettered",
                "type",
                Some("report"),
            ) == 2
        }
    })
    .await;
    let first = api.dead_letters("type=report").await;
    let one = first.last().expect("a dead letter")["id"].clone();
    let r = api
        .post("/v1/dead-letters/redrive", &json!({ "ids": [one] }))
        .await;
    assert_eq!(r.expect(200)["redriven"], 1, "{}", r.text());
    let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
    api.ack(&leased["id"], &leased["lease_token"])
        .await
        .expect(200);
}

/// What [`seed`] left, as the hour's series count it.
fn counts_the_seed(a: &Value) -> bool {
    sum(a, "dead_lettered", "type", Some("report")) == 2
        && sum(a, "dead_lettered", "source", None) == 2
        && latest(a, "dlq_depth", "type", Some("report")) == Some(1)
        && latest(a, "failure_reasons", "type", Some("report")) == Some(1)
        && sum(a, "redrive_sent", "type", Some("report")) == 1
        && sum(a, "redrive_succeeded", "type", Some("report")) == 1
        && sum(a, "redrive_failed_again", "type", Some("report")) == 0
        && sum(a, "throughput", "lane", Some("default")) == 2
}

#[tokio::test]
async fn the_series_count_what_happened_and_survive_a_restart() {
    let mut server = Server::start(&config()).await;
    let api = server.api();
    seed(&api).await;
    eventually(
        "the hour's series count the dead letters, the redrive and the successes",
        || {
            let api = api.clone();
            async move { counts_the_seed(&series(&api, "1h").await) }
        },
    )
    .await;
    // Nothing happens any more: what it counts stays.
    let hour = series(&api, "1h").await;
    assert!(counts_the_seed(&hour), "{hour}");
    assert_eq!(hour["window"], "1h");
    assert_eq!(hour["step_ms"], 60_000);
    assert_eq!(hour["at"].as_array().unwrap().len(), 60);
    let day = series(&api, "24h").await;
    assert_eq!(day["at"].as_array().unwrap().len(), 288);
    assert!(counts_the_seed(&day), "the day counts the same: {day}");

    server.restart().await;
    let api = server.api();
    let after = series(&api, "1h").await;
    let (before, after_points) = (points(&hour), points(&after));
    for (key, v) in &before {
        assert_eq!(
            after_points.get(key),
            Some(v),
            "{key} after the restart; before: {hour}\nafter: {after}"
        );
    }
    assert!(counts_the_seed(&after), "{after}");
}

#[tokio::test]
async fn two_nodes_on_one_postgresql_answer_the_same_series() {
    let Some(nodes) = Server::cluster(&config(), 2).await else {
        return;
    };
    seed(&nodes[0].api()).await;
    // Two answers read at once may straddle a minute or a sampling: wait
    // until they agree (and show what the seed did).
    eventually("both nodes answer the same series", || {
        let (a, b) = (nodes[0].api(), nodes[1].api());
        async move {
            let one = series(&a, "1h").await;
            let two = series(&b, "1h").await;
            counts_the_seed(&one) && one["series"] == two["series"] && one["at"] == two["at"]
        }
    })
    .await;
    let one = series(&nodes[0].api(), "24h").await;
    assert!(counts_the_seed(&one), "{one}");
}

#[tokio::test]
async fn a_query_naming_what_does_not_exist_is_refused() {
    let server = Server::start(&config()).await;
    let api = server.api();
    for (query, says) in [
        ("window=2h", "use 1h or 24h"),
        ("signal=depth", "the signals are dlq_depth"),
        ("by=tenant", "use type, source, lane"),
        (
            "signal=throughput&by=type",
            "throughput is not broken down by type",
        ),
        ("colour=red", "the parameters are window, signal and by"),
    ] {
        let r = api.get(&format!("/v1/series?{query}")).await;
        let error = assert_error(&r, 400, "BAD_REQUEST", None);
        assert!(
            error["message"].as_str().unwrap().contains(says),
            "{query}: {error}"
        );
    }
    let only = api
        .get("/v1/series?signal=oldest_age_ms&by=lane&window=24h")
        .await;
    let only = only.expect(200);
    assert!(
        only["series"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["signal"] == "oldest_age_ms" && l["by"] == "lane")
    );
}

/// Runs the `lazaret` CLI against `server` with stdout and stderr piped;
/// `during` runs while it does (a worker acking what it redrove).
async fn piped<F: std::future::Future<Output = ()>>(
    server: &Server,
    args: &[&str],
    during: F,
) -> std::process::Output {
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_lazaret"))
        .args(args)
        .args(["--server", server.base()])
        .env_remove("LAZARET_TOKEN")
        .env_remove("LAZARET_SERVER")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the lazaret binary runs");
    during.await;
    let out = tokio::time::timeout(std::time::Duration::from_secs(60), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("`lazaret {}` hung", args.join(" ")))
        .expect("its output");
    assert!(
        out.status.success(),
        "`lazaret {}` failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// No byte of a progress bar or spinner: no carriage return, no escape.
fn assert_no_progress(what: &str, out: &std::process::Output) {
    for (stream, bytes) in [("stdout", &out.stdout), ("stderr", &out.stderr)] {
        assert!(
            !bytes.iter().any(|b| *b == b'\r' || *b == 0x1b),
            "{what}: progress bytes on piped {stream}: {:?}",
            String::from_utf8_lossy(bytes)
        );
    }
}

#[tokio::test]
async fn piped_the_cli_draws_no_progress() {
    let server = Server::start(&config()).await;
    let api = server.api();
    let mut dead = Vec::new();
    for n in 0..2 {
        let id = api
            .enqueue_ok(&job("report", "acme", json!({ "n": n })))
            .await;
        let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
        let r = api
            .fail(
                &id,
                &leased["lease_token"],
                json!({"class": "permanent", "kind": "bad_row", "message": "bad"}),
            )
            .await;
        dead.push(crate::harness::id_text(&r.expect(200)["dead_letter_id"]));
    }
    // A redrive followed through its report: a worker acks the job meanwhile.
    let worker = api.clone();
    let out = piped(
        &server,
        &["dlq", "redrive", "--id", &dead[0], "--follow"],
        async move {
            let leased = worker.lease_eventually(&lease_req("w", 1, 30_000)).await;
            worker
                .ack(&leased[0]["id"], &leased[0]["lease_token"])
                .await
                .expect(200);
        },
    )
    .await;
    assert_no_progress("dlq redrive --follow", &out);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("succeeded"),
        "the report is printed: {stdout}"
    );
    let out = piped(
        &server,
        &["dlq", "purge", "--id", &dead[1], "--confirm"],
        async {},
    )
    .await;
    assert_no_progress("dlq purge", &out);
    let out = piped(&server, &["dlq", "ls", "--json"], async {}).await;
    assert_no_progress("dlq ls --json", &out);
}
