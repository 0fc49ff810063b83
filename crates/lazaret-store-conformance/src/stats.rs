//! Stats: job counts per lane, dead letters per (type, reason), succeeded jobs kept.

use lazaret_core::{DeadLetterReason, Event};
use lazaret_store::{LaneCounts, LeaseRequest, NewJob, Store};

use super::dead_letters::admission;
use crate::Backend;

use super::{at, complete, lane_counts, lease, lease_req, new_job, permanent};

pub async fn stats_count_jobs_per_lane<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let empty = s.stats().await.unwrap();
    assert_eq!(lane_counts(&empty, "slow"), LaneCounts::default());
    assert_eq!(empty.succeeded, 0);
    assert!(empty.dead_letters.is_empty());

    // slow: one acked, one dead-lettered, one left queued.
    let slow = |req: LeaseRequest| LeaseRequest {
        lanes: Some(vec!["slow".into()]),
        ..req
    };
    s.enqueue((0..3).map(|_| new_job("email", "b", "slow")).collect())
        .await
        .unwrap();
    let held = lease(&s, slow(lease_req(at(1), 2))).await;
    assert_eq!(held.len(), 2);
    complete(&s, &held[0], Event::Succeeded, at(2)).await;
    complete(&s, &held[1], Event::Failed(permanent()), at(2)).await;

    // fast: two leased (the cap), one queued, one delayed.
    let mut fast: Vec<NewJob> = (0..3).map(|_| new_job("resize", "a", "fast")).collect();
    fast.push(NewJob {
        run_at: at(60_000),
        ..new_job("resize", "a", "fast")
    });
    s.enqueue(fast).await.unwrap();
    let held = lease(
        &s,
        LeaseRequest {
            lanes: Some(vec!["fast".into()]),
            ..lease_req(at(3), 10)
        },
    )
    .await;
    assert_eq!(held.len(), 2);
    s.record_admission(admission(None, None, DeadLetterReason::InvalidJson, at(4)))
        .await
        .unwrap();

    let stats = s.stats().await.unwrap();
    let counts = |queued, scheduled, leased| LaneCounts {
        queued,
        scheduled,
        leased,
    };
    assert_eq!(lane_counts(&stats, "fast"), counts(1, 1, 2));
    assert_eq!(lane_counts(&stats, "slow"), counts(1, 0, 0));
    assert_eq!(stats.succeeded, 1);
    let mut dead = stats.dead_letters.clone();
    dead.sort();
    assert_eq!(
        dead,
        vec![
            (None, DeadLetterReason::InvalidJson, 1),
            (Some("email".to_owned()), DeadLetterReason::Permanent, 1),
        ]
    );

    // Time passes: the delayed job is promoted, the leases expire into retries.
    let tick = s.tick(at(60_000)).await.unwrap();
    assert_eq!((tick.promoted, tick.expired.len()), (1, 2));
    let stats = s.stats().await.unwrap();
    assert_eq!(lane_counts(&stats, "fast"), counts(2, 2, 0));
}

/// Commits and the commands in them are counted: called one at a time,
/// every command is a group of its own. A backend without group-commit
/// counters reports none.
pub async fn stats_count_commits_and_the_commands_in_them<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let counters = |stats: lazaret_store::StoreStats| stats.group_commit;
    if !b.capabilities().group_commit_stats {
        assert_eq!(counters(s.stats().await.unwrap()), None);
        return;
    }
    let before = counters(s.stats().await.unwrap()).expect("group-commit counters");
    let (jobs, leases) = (8, 4);
    for i in 0..jobs {
        s.enqueue(vec![new_job("resize", &format!("t-{i}"), "default")])
            .await
            .unwrap();
    }
    for _ in 0..leases {
        s.lease(lease_req(at(10), 1)).await.unwrap();
    }
    let after = counters(s.stats().await.unwrap()).expect("group-commit counters");
    // The enqueues, the leases and the first stats call.
    let calls = jobs + leases + 1;
    assert_eq!(after.commands - before.commands, calls);
    assert_eq!(after.commits - before.commits, calls);
}

/// What the wait and run histograms and the oldest-job gauge are made of: a
/// lease names when its job became ready (enqueue, or its retry coming
/// due), an outcome when its attempt was leased, and the stats the oldest
/// ready job of each lane.
pub async fn stats_time_when_jobs_became_ready_and_were_leased<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let in_lane = |lane: &str, req: LeaseRequest| LeaseRequest {
        lanes: Some(vec![lane.into()]),
        ..req
    };
    s.enqueue(vec![
        NewJob {
            now: at(10),
            run_at: at(10),
            ..new_job("email", "a", "slow")
        },
        NewJob {
            now: at(20),
            run_at: at(20),
            ..new_job("email", "b", "slow")
        },
        NewJob {
            now: at(5),
            run_at: at(30),
            ..new_job("email", "a", "fast")
        },
    ])
    .await
    .unwrap();
    let stats = s.stats().await.unwrap();
    assert_eq!(
        stats.oldest_ready,
        vec![("slow".into(), at(10))],
        "a delayed job is not ready until it is due"
    );
    s.tick(at(30)).await.unwrap();
    let stats = s.stats().await.unwrap();
    assert_eq!(
        stats.oldest_ready,
        vec![("fast".into(), at(30)), ("slow".into(), at(10))]
    );

    let first = lease(&s, in_lane("slow", lease_req(at(40), 1))).await;
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].ready_at, at(10));
    let stats = s.stats().await.unwrap();
    let slow = stats
        .oldest_ready
        .iter()
        .find(|(l, _)| l.as_str() == "slow");
    assert_eq!(slow, Some(&("slow".into(), at(20))), "the next oldest");

    // A failure retried: ready again when the retry is due.
    let done = complete(
        &s,
        &first[0],
        Event::Failed(super::transient("http_503")),
        at(50),
    )
    .await;
    assert_eq!(done.leased_at, Some(at(40)));
    let retry_at = match done.transition {
        lazaret_core::Transition::Retry { at, .. } => at,
        other => panic!("expected a retry, got {other:?}"),
    };
    s.tick(retry_at).await.unwrap();
    let mut again = Vec::new();
    for j in lease(&s, in_lane("slow", lease_req(retry_at, 10))).await {
        again.push((j.id, j.ready_at));
        let done = complete(
            &s,
            &j,
            Event::Succeeded,
            retry_at.saturating_add(std::time::Duration::from_millis(7)),
        )
        .await;
        assert_eq!(done.leased_at, Some(retry_at), "an ack names its lease too");
    }
    again.sort();
    assert!(again.contains(&(first[0].id, retry_at)), "{again:?}");
    let stats = s.stats().await.unwrap();
    assert!(
        stats.oldest_ready.iter().all(|(l, _)| l.as_str() != "slow"),
        "no job ready in slow: {:?}",
        stats.oldest_ready
    );
}
