//! Live jobs through the client: a page of jobs by state and cursor, and a
//! cancel at once (waiting) or at the fail (leased), heard on heartbeats.

use std::time::Duration;

use lazaret_client::{ErrorCode, Failure, JobState, JobsQuery, LeaseRequest, NewJob, Outcome};

use crate::support::{self, CONFIG};

#[tokio::test]
async fn jobs_are_listed_by_page_and_cancelled_through_the_client() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    let mut ids = Vec::new();
    for n in 0..3 {
        let job = NewJob::new("report", "acme", &serde_json::json!({ "n": n })).unwrap();
        ids.push(client.enqueue(&job).await.expect("enqueued").id);
    }
    let leased = client
        .lease(&LeaseRequest::new("w-1"))
        .await
        .expect("leased")
        .pop()
        .expect("one job");
    assert_eq!(leased.id, ids[0], "the oldest first");

    // Newest first, a page of two, then the rest.
    let first = client
        .jobs(&JobsQuery {
            limit: Some(2),
            ..JobsQuery::default()
        })
        .await
        .expect("a page");
    assert_eq!(
        first.items.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![ids[2], ids[1]]
    );
    assert!(first.items.iter().all(|j| j.history.is_empty()));
    let rest = client
        .jobs(&JobsQuery {
            limit: Some(2),
            cursor: first.next_cursor.clone(),
            ..JobsQuery::default()
        })
        .await
        .expect("the next page");
    assert_eq!(
        rest.items.iter().map(|j| j.id).collect::<Vec<_>>(),
        vec![ids[0]]
    );
    assert_eq!(rest.next_cursor, None);
    let page = client
        .jobs(&JobsQuery {
            state: Some(JobState::Leased),
            ..JobsQuery::default()
        })
        .await
        .expect("leased jobs");
    assert_eq!(page.items.len(), 1);
    assert_eq!(page.items[0].id, ids[0]);

    // A waiting job at once; a leased one at its fail.
    let now = client.cancel(ids[2]).await.expect("cancelled");
    assert_eq!(
        (now.state, now.cancel_requested),
        (JobState::Cancelled, false)
    );
    let asked = client.cancel(ids[0]).await.expect("requested");
    assert_eq!(
        (asked.state, asked.cancel_requested),
        (JobState::Leased, true)
    );
    let hb = client
        .heartbeat_reply(leased.id, &leased.lease_token, Duration::from_secs(30))
        .await
        .expect("heartbeat");
    assert!(hb.cancel_requested);
    let outcome = client
        .fail(
            leased.id,
            &leased.lease_token,
            &Failure::transient("http_503", "upstream down"),
        )
        .await
        .expect("failed");
    assert_eq!(outcome, Outcome::Cancelled);
    let info = client.job(ids[0]).await.expect("the job");
    assert_eq!(info.state, JobState::Cancelled);
    assert!(info.cancel_requested);
    assert_eq!(info.dead_letter_id, None);

    let refused = client.cancel(ids[2]).await.expect_err("finished");
    assert_eq!(refused.code(), Some(&ErrorCode::BadState), "{refused}");
}
