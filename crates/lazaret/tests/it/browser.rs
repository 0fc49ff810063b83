//! The dashboard in a real browser: `tests/browser/dashboard.mjs` (playwright-core driving Debian's headless chromium) against the real server.
//!
//! This test starts the server, seeds dead letters over HTTP (a plain one,
//! one whose payload and error are markup, one with a 20 KB payload, a
//! failure group of two invoices that the page redrives, a surge and a
//! scatter: more failure groups than one page shows), runs the script with
//! `node`, and then checks over HTTP what the clicks in the browser did. Skipped, with a message, without `node`, chromium or
//! `tests/browser/node_modules` (`npm ci` there); under `CI=true` a missing
//! piece fails. `LAZARET_DASHBOARD_SCREENSHOTS=DIR` keeps the screenshots
//! (`docs/` holds the ones the README shows).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{Value, json};

use crate::harness::{Api, QUICK, Server, TOKENS, id_text, lease_req};

/// Dead letters of the surging type.
const SURGE: usize = 20;
/// Dead letters of the scattering type, each its own failure.
const SCATTER: usize = 30;

/// The charts' sampler every 200 ms, so the page's charts catch up fast.
const CHARTS: &str = r#"
[retention]
series_sample_ms = 200
"#;

/// A breaker that opens after two failures and stays open through the test.
const BREAKER: &str = r#"
[types.flaky.breaker]
failures_min = 2
failure_ratio = 0.5
window_ms = 60000
cooldown_ms = 3600000
probes = 1
"#;

fn browser_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/browser")
}

fn chromium() -> PathBuf {
    std::env::var_os("LAZARET_CHROMIUM").map_or_else(|| "/usr/bin/chromium".into(), PathBuf::from)
}

/// What is missing to run the browser test, if anything.
fn missing() -> Option<String> {
    let node = Command::new("node").arg("--version").output();
    if !node.is_ok_and(|o| o.status.success()) {
        return Some("`node` is not on PATH (apt-get install nodejs)".into());
    }
    if !chromium().exists() {
        return Some(format!(
            "{} is not there (apt-get install chromium, or set LAZARET_CHROMIUM)",
            chromium().display()
        ));
    }
    if !browser_dir().join("node_modules/playwright-core").exists() {
        return Some(format!(
            "playwright-core is not installed: run `npm ci` in {}",
            browser_dir().display()
        ));
    }
    None
}

/// Enqueues a job as the producer, leases it as the worker and fails it
/// permanently with `error`; returns (dead letter id, job id).
async fn dead_letter(producer: &Api, worker: &Api, job: Value, error: Value) -> (String, String) {
    let id = producer.enqueue_ok(&job).await;
    let leased = worker.lease_one(&lease_req("seed", 1, 30_000)).await;
    assert_eq!(leased["id"], id);
    let r = worker.fail(&id, &leased["lease_token"], error).await;
    let body = r.expect(200);
    assert_eq!(body["state"], "dead_lettered", "{body}");
    (id_text(&body["dead_letter_id"]), id_text(&id))
}

#[tokio::test]
async fn an_operator_signs_in_finds_the_dead_letter_under_its_reason_and_redrives_it_to_success() {
    if let Some(why) = missing() {
        lazaret_testkit::skip(
            "the dashboard browser test",
            &format!("{why} (.ci/run installs it)"),
        );
        return;
    }
    let server = Server::start(&format!("{QUICK}\n{TOKENS}\n{BREAKER}\n{CHARTS}")).await;
    let producer = server.api_as("producer-secret");
    let worker = server.api_as("worker-secret");
    let operator = server.api_as("operator-secret");

    let (plain_dl, plain_job) = dead_letter(
        &producer,
        &worker,
        json!({"type": "send_email", "tenant": "acme", "idempotency_key": "order-1",
               "payload": {"to": "bob@example.com", "n": 1}}),
        json!({"class": "permanent", "kind": "smtp_550", "message": "mailbox unavailable"}),
    )
    .await;
    let hostile_payload = r#"{"to": "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">", "n": 2}"#;
    let (hostile_dl, hostile_job) = dead_letter(
        &producer,
        &worker,
        json!({"type": "send_email", "tenant": "acme", "idempotency_key": "order-2",
               "payload": serde_json::from_str::<Value>(hostile_payload).unwrap()}),
        json!({"class": "permanent", "kind": "validation",
               "message": "<script>window.__pwned=3</script> bad address",
               "traceback": "Traceback (most recent call last):\n  File \"worker.py\", line 3\n    raise ValueError('<b>bad</b>')"}),
    )
    .await;
    let large = json!({"blob": "x".repeat(20_000), "width": "640px"});
    let large_size = serde_json::to_string(&large).unwrap().len();
    let (large_dl, large_job) = dead_letter(
        &producer,
        &worker,
        json!({"type": "resize", "tenant": "globex", "payload": large}),
        json!({"class": "permanent", "kind": "parse", "message": "width is not a number"}),
    )
    .await;

    // One failure group of two: the same error but for the invoice's
    // number. The page redrives the group; one job succeeds, one fails again.
    let mut regroup = Vec::new();
    for n in [1001, 1002] {
        regroup.push(
            dead_letter(
                &producer,
                &worker,
                json!({"type": "invoice", "tenant": "acme", "payload": {"invoice": n}}),
                json!({"class": "permanent", "kind": "no_total", "message": format!("invoice {n} has no total")}),
            )
            .await,
        );
    }

    // A surge: twenty dead letters of one type with one cause, most of
    // all that arrived (the systemic signal of `/v1/stats`).
    let batch: Vec<Value> = (0..SURGE)
        .map(|n| json!({"type": "charge_card", "tenant": format!("t{n}"), "payload": {"n": n}}))
        .collect();
    let r = producer
        .post("/v1/jobs/batch", &json!({ "jobs": batch }))
        .await;
    r.expect(200);
    let mut req = lease_req("seed", SURGE as u32, 30_000);
    req["types"] = json!(["charge_card"]);
    let mut leased = Vec::new();
    while leased.len() < SURGE {
        leased.extend(worker.lease_eventually(&req).await);
    }
    let fails: Vec<Value> = leased
        .iter()
        .map(|j| json!({"id": j["id"], "lease_token": j["lease_token"],
                        "error": {"class": "permanent", "kind": "http_503", "message": "gateway unavailable"}}))
        .collect();
    let r = worker.post("/v1/fails", &json!({ "items": fails })).await;
    let results = r.expect(200)["results"].clone();
    assert!(
        results
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["state"] == "dead_lettered"),
        "{results}"
    );

    // One more dead letter of the surging type, with another reason: its
    // attempts ran out on timeouts.
    let extra = producer
        .enqueue_ok(&json!({"type": "charge_card", "tenant": "t-x", "payload": {"n": -1}}))
        .await;
    let mut req = lease_req("seed", 1, 30_000);
    req["types"] = json!(["charge_card"]);
    loop {
        let leased = worker.lease_eventually(&req).await;
        assert_eq!(leased[0]["id"], extra);
        let r = worker
            .fail(
                &extra,
                &leased[0]["lease_token"],
                json!({"class": "transient", "kind": "timeout", "message": "no answer"}),
            )
            .await;
        if r.expect(200)["state"] == "dead_lettered" {
            break;
        }
    }

    // A scatter in another type: every dead letter its own failure, so
    // over all types the surge's share falls under 80 %.
    let batch: Vec<Value> = (0..SCATTER)
        .map(|n| json!({"type": "export", "tenant": "initech", "payload": {"row": n}}))
        .collect();
    producer
        .post("/v1/jobs/batch", &json!({ "jobs": batch }))
        .await
        .expect(200);
    let mut req = lease_req("seed", SCATTER as u32, 30_000);
    req["types"] = json!(["export"]);
    let mut leased = Vec::new();
    while leased.len() < SCATTER {
        leased.extend(worker.lease_eventually(&req).await);
    }
    let fails: Vec<Value> = leased
        .iter()
        .enumerate()
        .map(|(i, j)| json!({"id": j["id"], "lease_token": j["lease_token"],
                             "error": {"class": "permanent", "kind": format!("parse_{i}"), "message": format!("column {i} is bad")}}))
        .collect();
    worker
        .post("/v1/fails", &json!({ "items": fails }))
        .await
        .expect(200);
    let stats = operator.get("/v1/stats").await;
    let dl = stats.expect(200)["dead_letters"].clone();
    assert_eq!(dl["surge"], Value::Null, "diluted over all types: {dl}");
    let surges: Vec<(&Value, &Value)> = dl["surges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| (&s["type"], &s["reason"]))
        .collect();
    assert_eq!(
        surges,
        [(&json!("charge_card"), &json!("permanent"))],
        "per type: {dl}"
    );

    // Two 503s of `flaky`: its breaker opens (and parks the retries).
    let mut req = lease_req("seed", 1, 30_000);
    req["types"] = json!(["flaky"]);
    for n in 0..2 {
        producer
            .enqueue_ok(&json!({"type": "flaky", "tenant": "acme", "payload": {"n": n}}))
            .await;
    }
    for _ in 0..2 {
        let leased = worker.lease_one(&req).await;
        worker
            .fail(
                &leased["id"],
                &leased["lease_token"],
                json!({"class": "transient", "kind": "http_503", "message": "down"}),
            )
            .await
            .expect(200);
    }
    let breakers = operator.get("/v1/breakers").await;
    let breakers = breakers.expect(200)["breakers"].clone();
    assert_eq!(
        (&breakers[0]["type"], &breakers[0]["state"]),
        (&json!("flaky"), &json!("open")),
        "{breakers}"
    );

    // A job an hour ahead, so no worker leases it: the page cancels it.
    let r = producer
        .post(
            "/v1/jobs",
            &json!({"type": "report", "tenant": "acme", "payload": {}, "delay_ms": 3_600_000}),
        )
        .await;
    let waiting = r.expect(201)["id"].clone();

    let seed = json!({
        "plain": {"dead_letter_id": plain_dl, "job_id": plain_job},
        "hostile": {"dead_letter_id": hostile_dl, "job_id": hostile_job},
        "large": {"dead_letter_id": large_dl, "job_id": large_job, "payload_size": large_size},
        "surge": {"type": "charge_card", "count": SURGE, "other_reason": "exhausted"},
        "scatter": {"type": "export", "count": SCATTER},
        "breaker": {"type": "flaky", "kind": "http_503"},
        "waiting": {"job_id": waiting},
        "regroup": {"type": "invoice", "count": regroup.len(),
                    "job_ids": regroup.iter().map(|(_, j)| j).collect::<Vec<_>>()},
    });
    let shots = tempfile::tempdir().expect("a screenshot directory");
    let shots_dir = std::env::var_os("LAZARET_DASHBOARD_SCREENSHOTS")
        .map_or_else(|| shots.path().to_owned(), PathBuf::from);
    let out = tokio::process::Command::new("node")
        .arg(browser_dir().join("dashboard.mjs"))
        .current_dir(browser_dir())
        .env("LAZARET_URL", server.base())
        .env("LAZARET_OPERATOR_TOKEN", "operator-secret")
        .env("LAZARET_WORKER_TOKEN", "worker-secret")
        .env("LAZARET_ADMIN_TOKEN", "admin-secret")
        .env("LAZARET_SEED", seed.to_string())
        .env("LAZARET_SCREENSHOTS", &shots_dir)
        .env("LAZARET_CHROMIUM", chromium())
        .kill_on_drop(true)
        .output()
        .await
        .expect("node runs");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The script's own account last: CI shows the tail of a failure.
    assert!(
        out.status.success() && printed.contains("dashboard browser test: passed"),
        "the browser test failed ({}).\nserver log:\n{}\nthe script printed:\n{printed}",
        out.status,
        server.log()
    );

    // What the clicks did, seen over HTTP.
    let plain = operator.get(&format!("/v1/jobs/{plain_job}")).await;
    let plain = plain.expect(200);
    assert_eq!(plain["state"], "succeeded", "{plain}");
    assert_eq!(plain["idempotency_key"], "order-1");
    assert_eq!(plain["redrive_count"], 1);

    let fixed = operator.get(&format!("/v1/jobs/{hostile_job}")).await;
    let fixed = fixed.expect(200);
    assert_eq!(fixed["state"], "succeeded", "{fixed}");
    assert_eq!(fixed["payload"], json!({"to": "bob@example.com", "n": 2}));
    assert_eq!(fixed["idempotency_key"], "order-2", "the key is kept");
    let edit = &fixed["payload_edits"][0];
    assert_eq!(
        edit["previous_payload"],
        serde_json::from_str::<Value>(hostile_payload).unwrap(),
        "the original stays readable"
    );
    assert_eq!(edit["actor"], "ops-alice");
    assert_eq!(edit["reason"], "the address held markup, not an address");

    let waiting = operator
        .get(&format!("/v1/jobs/{}", id_text(&waiting)))
        .await;
    let waiting = waiting.expect(200);
    assert_eq!(waiting["state"], "cancelled", "{waiting}");
    let cancels = operator.get("/v1/audit?action=cancel").await;
    let cancels = cancels.expect(200)["items"].clone();
    assert_eq!(
        (&cancels[0]["actor"], &cancels[0]["count"]),
        (&json!("ops-alice"), &json!(1)),
        "{cancels}"
    );

    let audit = operator.get("/v1/audit?action=redrive").await;
    let items = audit.expect(200)["items"].as_array().unwrap().clone();
    let edited: Vec<&Value> = items
        .iter()
        .filter(|e| e["request"]["payload_edited"] == true)
        .collect();
    assert_eq!(edited.len(), 1, "{items:?}");
    assert_eq!(edited[0]["actor"], "ops-alice");
    assert_eq!(edited[0]["count"], 1);
    assert_eq!(
        edited[0]["request"]["dead_letter_id"],
        json!(hostile_dl),
        "{}",
        edited[0]
    );
    let reasons = operator.get("/v1/dead-letters/reasons").await;
    let left = reasons.expect(200)["reasons"].clone();
    let mut left: Vec<(&Value, &Value, &Value)> = left
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (&r["type"], &r["reason"], &r["count"]))
        .collect();
    left.sort_by_key(|(t, r, _)| (t.to_string(), r.to_string()));
    assert_eq!(
        left,
        [
            (&json!("charge_card"), &json!("exhausted"), &json!(1)),
            (&json!("charge_card"), &json!("permanent"), &json!(SURGE)),
            (&json!("export"), &json!("permanent"), &json!(SCATTER)),
            (&json!("invoice"), &json!("permanent"), &json!(1)),
        ],
        "two redriven, the large one purged, the surge and the scatter left, \
         one invoice failed again; the archived group restored"
    );
    // The group's redrive, and the archive and restore of a group.
    let redrives = operator.get("/v1/audit?action=redrive").await;
    let by_group: Vec<&Value> = redrives.expect(200)["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["request"]["filter"]["group"].is_string())
        .map(|e| &e["count"])
        .collect();
    assert_eq!(
        by_group,
        [&json!(2), &json!(0)],
        "newest first: the real redrive, and its dry run before it"
    );
    for action in ["archive", "restore"] {
        let entries = operator.get(&format!("/v1/audit?action={action}")).await;
        let counts: Vec<Value> = entries.expect(200)["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["count"].clone())
            .collect();
        assert_eq!(
            counts,
            [json!(1)],
            "{action}: the real one (a dry run is not audited)"
        );
    }
    let dry_runs = operator.get("/v1/audit?action=redrive").await;
    let whole_reason = dry_runs.expect(200)["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["request"]["filter"]["type"] == "charge_card")
        .map(|e| (e["request"]["dry_run"].clone(), e["count"].clone()))
        .collect::<Vec<_>>();
    assert_eq!(
        whole_reason,
        vec![(json!(true), json!(0))],
        "the whole reason was only rehearsed"
    );
    let purges = operator.get("/v1/audit?action=purge").await;
    let purges = purges.expect(200)["items"].clone();
    assert_eq!(purges[0]["actor"], "root", "{purges}");
    assert_eq!(purges[0]["count"], 1, "{purges}");
    assert!(
        operator.get(&format!("/v1/jobs/{large_job}")).await.status == 404,
        "the purged dead letter's job went with it"
    );
}

/// Serves an empty HTML page for every request on `ip`, port chosen by the
/// system, until the test ends: a page of another origin for the browser
/// to act from. Returns its URL.
async fn attacker_page(ip: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind((ip, 0))
        .await
        .expect("a loopback port");
    let url = format!("http://{}/", listener.local_addr().expect("bound"));
    tokio::spawn(async move {
        const PAGE: &str = "<!doctype html><title>another site</title><body></body>";
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 16 * 1024];
                let mut got = Vec::new();
                while !got.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
                let reply = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{PAGE}",
                    PAGE.len()
                );
                let _ = conn.write_all(reply.as_bytes()).await;
            });
        }
    });
    url
}

/// Issue #32, finding 1 in a real browser: pages of other origins send a
/// no-cors purge of everything to a server without tokens (from another
/// port of the same host, from another host, from a sandboxed frame); the
/// dead letters are all still there afterwards, and the dashboard, opened
/// as `localhost` and as `127.0.0.1`, still pauses, resumes, shows a binary
/// payload as binary and downloads it.
#[tokio::test]
async fn pages_of_other_origins_cannot_purge_a_server_without_tokens() {
    if let Some(why) = missing() {
        lazaret_testkit::skip(
            "the cross-site browser test",
            &format!("{why} (.ci/run installs it)"),
        );
        return;
    }
    let server = Server::start(QUICK).await;
    let api = server.api();
    let (plain_dl, _) = dead_letter(
        &api,
        &api,
        json!({"type": "send_email", "tenant": "acme", "payload": {"n": 1}}),
        json!({"class": "permanent", "kind": "smtp_550", "message": "mailbox unavailable"}),
    )
    .await;
    // 14 bytes that are not UTF-8: refused as not JSON, kept as an admission record.
    let png: &[u8] = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIH";
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/jobs", server.base()))
        .body(png.to_vec())
        .send()
        .await
        .expect("answered");
    assert_eq!(resp.status(), 422);
    let binary = api.dead_letters("reason=invalid_json").await;
    assert_eq!(binary.len(), 1, "{binary:?}");
    let binary_dl = id_text(&binary[0]["id"]);

    // Same-site (another port of this host) and cross-site (another host).
    let attackers = vec![
        attacker_page("127.0.0.1").await,
        attacker_page("127.0.0.2").await,
    ];
    let seed = json!({"binary": {"dead_letter_id": binary_dl, "payload_size": png.len()}});
    let out = tokio::process::Command::new("node")
        .arg(browser_dir().join("cross_site.mjs"))
        .current_dir(browser_dir())
        .env("LAZARET_URL", server.base())
        .env("LAZARET_ATTACKERS", json!(attackers).to_string())
        .env("LAZARET_SEED", seed.to_string())
        .env("LAZARET_CHROMIUM", chromium())
        .kill_on_drop(true)
        .output()
        .await
        .expect("node runs");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut ids: Vec<String> = api
        .dead_letters("")
        .await
        .iter()
        .map(|d| id_text(&d["id"]))
        .collect();
    ids.sort();
    let mut seeded = vec![plain_dl, binary_dl];
    seeded.sort();
    assert_eq!(
        ids, seeded,
        "every dead letter is still there\nthe script printed:\n{printed}"
    );
    assert!(
        out.status.success() && printed.contains("cross-site browser test: passed"),
        "the cross-site browser test failed ({}).\nserver log:\n{}\nthe script printed:\n{printed}",
        out.status,
        server.log()
    );
    // Each attacker page's two purges reached the server and were refused.
    let metrics = api.get("/metrics").await;
    let refused: f64 = metrics
        .text()
        .lines()
        .find(|l| l.starts_with("lazaret_rejected_total{") && l.contains("code=\"FORBIDDEN\""))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0);
    assert_eq!(
        refused,
        (2 * attackers.len()) as f64,
        "two refused purges per attacker page\n{printed}"
    );
}
