//! The audit log under hostile conditions (issue 11, item 5): a redrive
//! killed halfway leaves an entry that says what was redriven, a request
//! nested too deep or too long is kept (bounded), never `null`, and the log
//! pages by cursor so a flood of denied calls cannot hide a purge.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::harness::{EVENTUALLY, QUICK, Server, id_text, job};

/// Dead-letters `n` jobs of type `report` (permanent failures).
async fn dead_letters(api: &crate::harness::Api, n: usize) {
    let jobs: Vec<Value> = (0..n)
        .map(|i| job("report", "acme", json!({ "n": i })))
        .collect();
    let r = api.post("/v1/jobs/batch", &json!({ "jobs": jobs })).await;
    assert_eq!(r.expect(200)["results"].as_array().unwrap().len(), n);
    let mut leased = Vec::new();
    while leased.len() < n {
        let page = api
            .lease(&json!({"worker_id": "w", "max_jobs": 1000, "lease_ms": 60_000}))
            .await;
        assert!(!page.is_empty(), "all {n} jobs are leasable");
        leased.extend(page);
    }
    let items: Vec<Value> = leased
        .iter()
        .map(|j| {
            json!({"id": id_text(&j["id"]), "lease_token": j["lease_token"],
                        "error": {"class": "permanent", "kind": "bad_input"}})
        })
        .collect();
    let r = api.post("/v1/fails", &json!({ "items": items })).await;
    let results = r.expect(200)["results"].as_array().unwrap().clone();
    assert!(
        results.iter().all(|r| r["state"] == "dead_lettered"),
        "{results:?}"
    );
}

/// How many dead letters are held now.
async fn held(api: &crate::harness::Api) -> usize {
    let mut n = 0;
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/dead-letters?limit=1000&cursor={c}"),
            None => "/v1/dead-letters?limit=1000".into(),
        };
        let page = api.get(&path).await.expect(200).clone();
        n += page["items"].as_array().unwrap().len();
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return n,
        }
    }
}

/// Every entry of the audit log, newest first, paging by `next_cursor`.
async fn whole_log(api: &crate::harness::Api, query: &str) -> Vec<Value> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let path = match &cursor {
            Some(c) => format!("/v1/audit?limit=1000{query}&cursor={c}"),
            None => format!("/v1/audit?limit=1000{query}"),
        };
        let page = api.get(&path).await.expect(200).clone();
        out.extend(page["items"].as_array().unwrap().iter().cloned());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return out,
        }
    }
}

#[tokio::test]
async fn a_redrive_killed_halfway_leaves_an_audit_entry_that_matches_what_moved() {
    const N: usize = 300;
    let mut server = Server::start(QUICK).await;
    let api = server.api();
    dead_letters(&api, N).await;
    assert_eq!(held(&api).await, N);

    // 50 a second: six batches a second apart. The request runs on its own
    // task; the server is killed once the first batch has moved.
    // (Its answer never comes: the connection dies with the server.)
    let redrive = {
        let url = format!("{}/v1/dead-letters/redrive", server.base());
        tokio::spawn(async move {
            let _ = reqwest::Client::new()
                .post(url)
                .json(&json!({"filter": {"type": "report"}, "rate_per_sec": 50}))
                .send()
                .await;
        })
    };
    let deadline = Instant::now() + EVENTUALLY;
    while held(&api).await == N {
        assert!(Instant::now() < deadline, "the first batch never moved");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.kill_and_restart().await;
    redrive.abort();

    let api = server.api();
    let left = held(&api).await;
    let moved = N - left;
    assert!(
        moved > 0 && moved < N,
        "killed halfway: {moved} of {N} moved"
    );
    let entries: Vec<Value> = whole_log(&api, "")
        .await
        .into_iter()
        .filter(|e| e["action"] == "redrive")
        .collect();
    assert_eq!(
        entries.len(),
        1,
        "one entry for the one redrive: {entries:?}"
    );
    assert_eq!(
        entries[0]["count"], moved,
        "the entry counts exactly the dead letters that left: {entries:?}"
    );
    assert_eq!(
        entries[0]["request"]["filter"]["type"], "report",
        "{entries:?}"
    );
    // And what left is back in line.
    let leased = api
        .lease(&json!({"worker_id": "w2", "max_jobs": 1000, "lease_ms": 60_000}))
        .await;
    assert_eq!(leased.len(), moved);
}

/// The redrive entry's count, read between two equal counts of the dead
/// letters held (so that no batch committed meanwhile), and that count.
async fn settled_count(api: &crate::harness::Api) -> (u64, usize) {
    loop {
        let before = held(api).await;
        let log = whole_log(api, "&action=redrive").await;
        let after = held(api).await;
        if before == after {
            let count = log.first().map_or(0, |e| e["count"].as_u64().unwrap_or(0));
            return (count, after);
        }
    }
}

#[tokio::test]
async fn a_redrive_whose_client_went_away_is_audited_as_far_as_it_got() {
    const N: usize = 300;
    let server = Server::start(QUICK).await;
    let api = server.api();
    dead_letters(&api, N).await;
    let url = format!("{}/v1/dead-letters/redrive", server.base());
    let redrive = tokio::spawn(async move {
        let _ = reqwest::Client::new()
            .post(url)
            .json(&json!({"filter": {"type": "report"}, "rate_per_sec": 50}))
            .send()
            .await;
    });
    let deadline = Instant::now() + EVENTUALLY;
    while held(&api).await == N {
        assert!(Instant::now() < deadline, "the first batch never moved");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The client goes away: its connection is closed mid-request.
    redrive.abort();
    let _ = redrive.await;
    // Whether the server stops or finishes, at every moment the entry
    // counts exactly what has left the dead letters.
    for _ in 0..3 {
        let (count, left) = settled_count(&api).await;
        assert!(left < N);
        assert_eq!(count as usize, N - left, "the entry matches what moved");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test]
async fn a_request_nested_too_deep_or_too_long_is_audited_as_received_and_bounded() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    // 200 levels: past serde_json's 128, which the action itself never reads.
    let deep = format!(
        r#"{{"type": "resize", "note": {}{}}}"#,
        "[".repeat(200),
        "]".repeat(200)
    );
    api.post_raw("/v1/pause", deep.clone()).await.expect(200);
    // 40,000 bytes: past the 16 KiB an entry keeps.
    let long = format!(r#"{{"type": "resize", "note": "{}"}}"#, "x".repeat(40_000));
    api.post_raw("/v1/resume", long.clone()).await.expect(200);

    let log = whole_log(&api, "").await;
    let pause = log.iter().find(|e| e["action"] == "pause").expect("paused");
    assert!(!pause["request"].is_null(), "{pause}");
    assert_eq!(pause["request"]["raw"], deep, "kept whole: {pause}");
    assert_eq!(pause["request"]["bytes"], deep.len());
    assert_eq!(pause["request"]["truncated"], false);

    let resume = log
        .iter()
        .find(|e| e["action"] == "resume")
        .expect("resumed");
    let raw = resume["request"]["raw"].as_str().expect("raw text");
    assert_eq!(raw.len(), 16 * 1024, "cut at 16 KiB");
    assert!(long.starts_with(raw));
    assert_eq!(resume["request"]["bytes"], long.len());
    assert_eq!(resume["request"]["truncated"], true);

    // An ordinary request is kept as its JSON.
    api.post("/v1/pause", &json!({"lane": "batch"}))
        .await
        .expect(200);
    let log = whole_log(&api, "&action=pause").await;
    assert_eq!(log[0]["request"], json!({"lane": "batch"}));
}

const ADMIN: &str = "tok-admin-audit-0123456789";
const PRODUCER: &str = "tok-producer-audit-0123456789";

#[tokio::test]
async fn a_flood_of_denied_calls_cannot_push_a_purge_out_of_view() {
    let server = Server::start(&format!(
        r#"{QUICK}
[[tokens]]
name = "root"
role = "admin"
token = "{ADMIN}"
[[tokens]]
name = "intruder"
role = "producer"
token = "{PRODUCER}"
"#
    ))
    .await;
    let admin = server.api_as(ADMIN);
    let intruder = server.api_as(PRODUCER);
    dead_letters(&admin, 3).await;
    let r = admin
        .post(
            "/v1/dead-letters/purge",
            &json!({"filter": {"type": "report"}, "confirm": true}),
        )
        .await;
    assert_eq!(r.expect(200)["purged"], 3);
    for _ in 0..1100 {
        assert_eq!(intruder.get("/v1/audit").await.status, 403);
    }

    // The newest page is all denials; the cursor reaches the purge.
    let first = admin.get("/v1/audit?limit=1000").await.expect(200).clone();
    let items = first["items"].as_array().unwrap();
    assert_eq!(items.len(), 1000);
    assert!(items.iter().all(|e| e["action"] == "denied"));
    assert!(first["next_cursor"].is_string(), "{}", first["next_cursor"]);
    let log = whole_log(&admin, "").await;
    assert_eq!(log.len(), 1101, "every entry once");
    let purge = log.iter().find(|e| e["action"] == "purge").expect("purge");
    assert_eq!(
        (&purge["actor"], &purge["count"]),
        (&json!("root"), &json!(3))
    );
    // Or straight to it.
    let purges = admin
        .get("/v1/audit?action=purge")
        .await
        .expect(200)
        .clone();
    assert_eq!(purges["items"].as_array().unwrap().len(), 1, "{purges}");
    assert!(purges["next_cursor"].is_null());
    let by_actor = whole_log(&admin, "&actor=intruder").await;
    assert_eq!(by_actor.len(), 1100);

    for bad in [
        "/v1/audit?cursor=abc",
        "/v1/audit?action=purgee",
        "/v1/audit?before=3",
    ] {
        assert_eq!(admin.get(bad).await.status, 400, "{bad}");
    }
}
