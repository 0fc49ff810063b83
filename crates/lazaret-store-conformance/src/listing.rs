//! Listing jobs: newest first, by cursor, filtered by state, type, tenant,
//! lane and the token that enqueued them; and pauses kept across restarts.

use lazaret_core::{Event, JobId, JobState};
use lazaret_store::{AuditEntry, JobQuery, NewJob, Pause, PauseTarget, Store};

use crate::Backend;

use super::cancel::cancel;
use super::{at, complete, dead_letter_job, enqueue_one, job_view, lease_one, lease_req, new_job};

/// The ids of a page, and its cursor.
async fn page<S: Store>(s: &S, q: JobQuery) -> (Vec<JobId>, Option<JobId>) {
    let (items, next) = s.jobs(q).await.expect("jobs");
    (items.iter().map(|j| j.envelope.id).collect(), next)
}

fn query(limit: u32) -> JobQuery {
    JobQuery {
        limit,
        ..JobQuery::default()
    }
}

pub async fn jobs_page_newest_first_with_cursor_and_filters<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let by = |token: &str, job: NewJob| NewJob {
        enqueued_by: Some(token.into()),
        ..job
    };
    let a = enqueue_one(&s, by("alice", new_job("resize", "acme", "default"))).await;
    let b = enqueue_one(&s, by("bob", new_job("email", "acme", "bulk"))).await;
    let c = enqueue_one(&s, by("alice", new_job("resize", "globex", "default"))).await;
    let d = enqueue_one(
        &s,
        NewJob {
            run_at: at(60_000),
            ..by("bob", new_job("resize", "acme", "default"))
        },
    )
    .await;
    let leased = lease_one(
        &s,
        lazaret_store::LeaseRequest {
            lanes: Some(vec!["bulk".into()]),
            ..lease_req(at(1), 1)
        },
    )
    .await;
    assert_eq!(leased.id, b);

    // Newest first, two at a time, to the end.
    let (first, next) = page(&s, query(2)).await;
    assert_eq!(first, vec![d, c]);
    assert_eq!(next, Some(c));
    let (second, next) = page(
        &s,
        JobQuery {
            before: next,
            ..query(2)
        },
    )
    .await;
    assert_eq!(second, vec![b, a]);
    assert_eq!(next, None, "nothing older: no cursor");
    let (older, _) = page(
        &s,
        JobQuery {
            before: Some(a),
            ..query(2)
        },
    )
    .await;
    assert!(older.is_empty(), "{older:?}");
    assert_eq!(
        page(&s, query(4)).await,
        (vec![d, c, b, a], None),
        "a full last page has no cursor"
    );

    // Each filter, and all of them together.
    let only = |q: JobQuery| JobQuery { limit: 10, ..q };
    for (q, want) in [
        (
            only(JobQuery {
                state: Some(JobState::Queued),
                ..query(0)
            }),
            vec![c, a],
        ),
        (
            only(JobQuery {
                state: Some(JobState::Scheduled),
                ..query(0)
            }),
            vec![d],
        ),
        (
            only(JobQuery {
                state: Some(JobState::Leased),
                ..query(0)
            }),
            vec![b],
        ),
        (
            only(JobQuery {
                state: Some(JobState::Succeeded),
                ..query(0)
            }),
            vec![],
        ),
        (
            only(JobQuery {
                job_type: Some("resize".into()),
                ..query(0)
            }),
            vec![d, c, a],
        ),
        (
            only(JobQuery {
                tenant: Some("acme".into()),
                ..query(0)
            }),
            vec![d, b, a],
        ),
        (
            only(JobQuery {
                lane: Some("bulk".into()),
                ..query(0)
            }),
            vec![b],
        ),
        (
            only(JobQuery {
                enqueued_by: Some("alice".into()),
                ..query(0)
            }),
            vec![c, a],
        ),
        (
            only(JobQuery {
                state: Some(JobState::Queued),
                job_type: Some("resize".into()),
                tenant: Some("acme".into()),
                lane: Some("default".into()),
                enqueued_by: Some("alice".into()),
                ..query(0)
            }),
            vec![a],
        ),
        (
            only(JobQuery {
                state: Some(JobState::Queued),
                before: Some(c),
                ..query(0)
            }),
            vec![a],
        ),
    ] {
        assert_eq!(page(&s, q.clone()).await.0, want, "{q:?}");
    }

    // The items are the jobs as `job` reads them.
    let (items, _) = s.jobs(query(10)).await.unwrap();
    for item in &items {
        let one = job_view(&s, item.envelope.id).await;
        assert_eq!(item.envelope, one.envelope);
        assert_eq!(
            (
                item.state,
                item.run_at,
                item.lease_expires_at,
                &item.enqueued_by,
                &item.payload
            ),
            (
                one.state,
                one.run_at,
                one.lease_expires_at,
                &one.enqueued_by,
                &one.payload
            )
        );
    }
    complete(&s, &leased, Event::Succeeded, at(2)).await;
    assert_eq!(
        page(
            &s,
            JobQuery {
                state: Some(JobState::Succeeded),
                ..query(10)
            }
        )
        .await
        .0,
        vec![b]
    );
}

pub async fn a_listed_job_shows_its_dead_letter_and_its_cancel<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let (dead, dl) = dead_letter_job(&s, new_job("email", "acme", "default"), at(1)).await;
    let gone = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    cancel(&s, gone, at(2)).await.unwrap();

    let (items, _) = s
        .jobs(JobQuery {
            state: Some(JobState::DeadLettered),
            ..query(10)
        })
        .await
        .unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(
        (items[0].envelope.id, items[0].dead_letter_id),
        (dead, Some(dl))
    );
    let (items, _) = s
        .jobs(JobQuery {
            state: Some(JobState::Cancelled),
            ..query(10)
        })
        .await
        .unwrap();
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].envelope.id, gone);
    assert!(items[0].cancel_requested);
    assert_eq!(items[0].dead_letter_id, None);

    // Redriven, the job no longer has a dead letter.
    s.redrive(vec![dl], at(3), None).await.unwrap();
    assert_eq!(job_view(&s, dead).await.dead_letter_id, None);
}

fn pause_entry(action: &str, at_ms: i64) -> AuditEntry {
    AuditEntry {
        at: at(at_ms),
        actor: "ops".into(),
        action: action.into(),
        request: serde_json::json!({}),
        count: 0,
    }
}

pub async fn pauses_are_kept_across_a_restart_and_audited<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    assert!(s.pauses().await.unwrap().is_empty());
    let ty = PauseTarget::Type("resize".into());
    let lane = PauseTarget::Lane("bulk".into());
    assert!(
        s.set_pause(ty.clone(), true, pause_entry("pause", 1))
            .await
            .unwrap()
    );
    assert!(
        s.set_pause(lane.clone(), true, pause_entry("pause", 2))
            .await
            .unwrap()
    );
    assert!(
        !s.set_pause(ty.clone(), true, pause_entry("pause", 3))
            .await
            .unwrap(),
        "paused already"
    );
    let want = vec![
        Pause {
            target: lane.clone(),
            paused_at: at(2),
            paused_by: "ops".into(),
        },
        Pause {
            target: ty.clone(),
            paused_at: at(1),
            paused_by: "ops".into(),
        },
    ];
    assert_eq!(s.pauses().await.unwrap(), want);
    s.close().await.unwrap();
    drop(s);

    let s = b.open(&place).await;
    assert_eq!(s.pauses().await.unwrap(), want, "a restart keeps them");
    assert!(
        s.set_pause(ty.clone(), false, pause_entry("resume", 4))
            .await
            .unwrap()
    );
    assert!(
        !s.set_pause(ty, false, pause_entry("resume", 5))
            .await
            .unwrap(),
        "resumed already"
    );
    assert_eq!(s.pauses().await.unwrap(), want[..1].to_vec());
    let actions: Vec<String> = s
        .audit_log(10)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.action)
        .collect();
    assert_eq!(actions, ["resume", "resume", "pause", "pause", "pause"]);
    s.close().await.unwrap();
}
