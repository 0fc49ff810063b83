//! Shutdown (issue 11, item 2): SIGTERM ends the process within the grace
//! whatever clients do. Long-polls answer `{"jobs": []}` at once, partial
//! requests (a head or a body half-sent) are dropped at once without
//! waiting for the grace, and a redrive stops between batches with what it
//! did answered and audited.

use std::time::Duration;

use serde_json::json;
use tokio::io::AsyncWriteExt;

use crate::harness::{EVENTUALLY, QUICK, Server, job, lease_req};
use crate::sockets::{Ended, connect, read_reply, request};

/// How long SIGTERM may take here: far above what the server needs, so a
/// slow machine does not fail the tests, and far below the grace and the
/// timeouts the first test configures (ten minutes), so none of them may
/// be what ended the process.
const EXIT_BOUND: Duration = Duration::from_secs(20);

#[tokio::test]
async fn sigterm_with_partial_requests_and_a_long_poll_exits_and_answers_the_poll() {
    let mut server = Server::start(&format!(
        "{QUICK}\n[http]\nshutdown_grace_ms = 600000\nheader_read_timeout_ms = 600000\nbody_read_timeout_ms = 600000\n"
    ))
    .await;
    // Half a request line and headers, never finished.
    let mut head = connect(server.base()).await;
    let host = crate::sockets::addr(server.base()).to_owned();
    head.write_all(format!("POST /v1/jobs HTTP/1.1\r\nHost: {host}\r\nContent-Le").as_bytes())
        .await
        .expect("written");
    // Whole headers, a tenth of the body, then nothing.
    let mut body = connect(server.base()).await;
    body.write_all(
        format!("POST /v1/leases HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"worker_").as_bytes(),
    )
    .await
    .expect("written");
    // A long-poll of 60 s, under way.
    let mut poll = connect(server.base()).await;
    let lease = json!({"worker_id": "w", "max_jobs": 1, "wait_ms": 60_000}).to_string();
    poll.write_all(&request(server.base(), "POST", "/v1/leases", &[], &lease))
        .await
        .expect("written");
    // The poll is waiting once a second poll sees the same empty queue
    // (both go through the same lease path; this one answers at once).
    let api = server.api();
    assert!(api.lease(&lease_req("probe", 1, 1000)).await.is_empty());

    let status = server.terminate(EXIT_BOUND).await;
    let status =
        status.unwrap_or_else(|| panic!("SIGTERM did not end the server within {EXIT_BOUND:?}"));
    assert!(status.success(), "exit status {status}");
    match read_reply(&mut poll, EVENTUALLY).await {
        Ended::Reply(r) => {
            assert_eq!(r.status, 200, "{}", r.text);
            assert_eq!(r.body, json!({"jobs": []}), "{}", r.text);
        }
        other => panic!("the long-poll was not answered: {other:?}"),
    }
    for (what, s) in [("partial head", &mut head), ("partial body", &mut body)] {
        assert!(
            !matches!(
                read_reply(s, Duration::from_secs(5)).await,
                Ended::StillOpen
            ),
            "the {what} connection stayed open"
        );
    }
}

#[tokio::test]
async fn a_redrive_stops_between_batches_at_sigterm_and_what_it_did_is_answered_and_audited() {
    let mut server = Server::start(&format!(
        "{QUICK}\n[types.t]\nattempts_max = 1\n[http]\nshutdown_grace_ms = 5000\n"
    ))
    .await;
    let api = server.api();
    let total = 6;
    let mut ids = Vec::new();
    for n in 0..total {
        ids.push(api.enqueue_ok(&job("t", "acme", json!({ "n": n }))).await);
    }
    for _ in 0..total {
        let leased = api.lease_one(&lease_req("w", 1, 30_000)).await;
        api.fail(
            &leased["id"],
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "boom"}),
        )
        .await
        .expect(200);
    }
    // One job a second: six batches, five pauses between them.
    let operator = server.api();
    let redrive = tokio::spawn(async move {
        operator
            .post(
                "/v1/dead-letters/redrive",
                &json!({"filter": {"type": "t"}, "rate_per_sec": 1}),
            )
            .await
    });
    // SIGTERM once the first batch is in.
    let deadline = std::time::Instant::now() + EVENTUALLY;
    loop {
        let mut queued = 0;
        for id in &ids {
            if api.job(id).await["state"] == "queued" {
                queued += 1;
            }
        }
        if queued > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the redrive never began"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let status = server
        .terminate(EXIT_BOUND)
        .await
        .unwrap_or_else(|| panic!("SIGTERM did not end the server within {EXIT_BOUND:?}"));
    assert!(status.success(), "exit status {status}");
    let reply = redrive.await.expect("the redrive task");
    let body = reply.expect(200).clone();
    assert_eq!(body["interrupted"], true, "{body}");
    let redriven = body["redriven"].as_u64().expect("a count");
    assert!(
        (1..total).contains(&redriven),
        "stopped between batches: {body}"
    );

    server.start_again().await;
    let api = server.api();
    let audit = api.get("/v1/audit").await;
    let items = audit.expect(200)["items"].clone();
    let entry = items
        .as_array()
        .expect("items")
        .iter()
        .find(|e| e["action"] == "redrive")
        .unwrap_or_else(|| panic!("no redrive in the audit log: {items}"))
        .clone();
    assert_eq!(entry["count"], redriven, "{entry}");
    let queued = {
        let mut n = 0;
        for id in &ids {
            if api.job(id).await["state"] == "queued" {
                n += 1;
            }
        }
        n
    };
    assert_eq!(queued, redriven, "the jobs redriven are the ones counted");
}
