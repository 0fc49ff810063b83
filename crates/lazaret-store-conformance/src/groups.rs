//! Failure groups, archiving and redrive reports (issue 30).

use lazaret_core::{Event, Failure, FailureClass, Timestamp};
use lazaret_store::{
    AuditEntry, DeadLetterFilter, DeadLetterId, GroupCursor, GroupQuery, Selector, Store,
};

use crate::Backend;

use super::{at, complete, enqueue_one, lease_one, lease_req, new_job};

/// Dead-letters a job of `job_type` for `tenant` that fails permanently
/// with `message`, at `now`.
async fn dead_letter_with<S: Store>(
    s: &S,
    job_type: &str,
    tenant: &str,
    message: &str,
    now: Timestamp,
) -> DeadLetterId {
    let id = enqueue_one(
        s,
        lazaret_store::NewJob {
            run_at: now,
            now,
            ..new_job(job_type, tenant, "default")
        },
    )
    .await;
    let leased = lease_one(
        s,
        lazaret_store::LeaseRequest {
            types: Some(vec![job_type.into()]),
            ..lease_req(now, 1)
        },
    )
    .await;
    assert_eq!(leased.id, id);
    let failure = Failure::new("bad_input", message).with_class(FailureClass::Permanent);
    complete(s, &leased, Event::Failed(failure), now)
        .await
        .dead_letter
        .expect("a permanent failure writes a dead letter")
}

fn query(now: Timestamp) -> GroupQuery {
    GroupQuery {
        limit: 100,
        now,
        ..GroupQuery::default()
    }
}

fn audit(action: &str) -> AuditEntry {
    AuditEntry {
        at: at(0),
        actor: "op".into(),
        action: action.into(),
        request: serde_json::json!({}),
        count: 0,
    }
}

pub async fn dead_letters_fall_into_groups_whatever_their_data<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let a1 = dead_letter_with(&s, "resize", "acme", "order 17 failed", at(1_000)).await;
    let a2 = dead_letter_with(&s, "resize", "beta", "order 90211 failed", at(2_000)).await;
    let other = dead_letter_with(&s, "resize", "acme", "disk full", at(3_000)).await;
    let typed = dead_letter_with(&s, "crop", "acme", "order 17 failed", at(500)).await;

    let dl = |id| {
        let s = &s;
        async move { s.dead_letter(id).await.unwrap().expect("held") }
    };
    let (d1, d2, d3, d4) = (dl(a1).await, dl(a2).await, dl(other).await, dl(typed).await);
    assert_eq!(d1.group_id, d2.group_id, "numbers differ only");
    assert_eq!(d1.fingerprint, "order <n> failed");
    assert_ne!(d1.group_id, d3.group_id, "another message");
    assert_ne!(d1.group_id, d4.group_id, "another type");
    assert_eq!(
        d1.group_id,
        lazaret_core::group_of(Some("resize"), "permanent", d1.error.as_ref()).id,
        "the id is the core's, the same on every node and after a restart"
    );

    // Newest last_at first.
    let (groups, next) = s.groups(query(at(3_000))).await.unwrap();
    assert_eq!(next, None);
    let ids: Vec<&str> = groups.iter().map(|g| g.id.as_str()).collect();
    assert_eq!(
        ids,
        vec![
            d3.group_id.as_str(),
            d1.group_id.as_str(),
            d4.group_id.as_str()
        ]
    );
    let g = &groups[1];
    assert_eq!(g.count, 2);
    assert_eq!((g.first_at, g.last_at), (at(1_000), at(2_000)));
    assert_eq!(g.job_type.as_deref(), Some("resize"));
    assert_eq!(g.reason.as_str(), "permanent");
    assert_eq!(g.kind.as_deref(), Some("bad_input"));
    assert_eq!(g.fingerprint, "order <n> failed");
    assert_eq!(g.sample_error.as_deref(), Some("order 90211 failed"));
    assert_eq!(g.sample_id, a2);
    assert_eq!(g.tenants, vec!["acme".to_owned(), "beta".to_owned()]);
    assert!(g.sources.is_empty());
    assert_eq!(g.rate_1h, 2);
    let later = s.groups(query(at(2_000 + 3_600_001))).await.unwrap().0;
    assert_eq!(later[1].rate_1h, 0, "older than an hour");

    // Pages: one group each, the cursor going on where the last one ended.
    let mut seen = Vec::new();
    let mut cursor: Option<GroupCursor> = None;
    loop {
        let (page, next) = s
            .groups(GroupQuery {
                limit: 1,
                cursor: cursor.clone(),
                ..query(at(3_000))
            })
            .await
            .unwrap();
        seen.extend(page.into_iter().map(|g| g.id));
        match next {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(seen, ids.iter().map(|s| s.to_string()).collect::<Vec<_>>());

    // Filters narrow the dead letters counted.
    let of_beta = s
        .groups(GroupQuery {
            tenant: Some("beta".into()),
            ..query(at(3_000))
        })
        .await
        .unwrap()
        .0;
    assert_eq!(of_beta.len(), 1);
    assert_eq!(
        (of_beta[0].id.as_str(), of_beta[0].count),
        (d1.group_id.as_str(), 1)
    );
    let of_crop = s
        .groups(GroupQuery {
            job_type: Some("crop".into()),
            ..query(at(3_000))
        })
        .await
        .unwrap()
        .0;
    assert_eq!(of_crop.len(), 1);
    let since = s
        .groups(GroupQuery {
            since: Some(at(2_500)),
            ..query(at(3_000))
        })
        .await
        .unwrap()
        .0;
    assert_eq!(since.len(), 1);
    assert_eq!(since[0].id, d3.group_id);

    // A group is a filter of lists and of redrive, purge and archive.
    let by_group = DeadLetterFilter {
        group: Some(d1.group_id.clone()),
        ..DeadLetterFilter::default()
    };
    let (listed, _) = s.dead_letters(by_group.clone(), 10, None).await.unwrap();
    assert_eq!(
        listed.iter().map(|d| d.id).collect::<Vec<_>>(),
        vec![a2, a1]
    );
    let matched = s
        .match_dead_letters(Selector::Filter(by_group))
        .await
        .unwrap();
    assert_eq!(
        matched.iter().map(|m| m.0).collect::<Vec<_>>(),
        vec![a1, a2]
    );
}

pub async fn archived_dead_letters_are_kept_hidden_and_restorable<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let a1 = dead_letter_with(&s, "resize", "acme", "order 17 failed", at(1_000)).await;
    let a2 = dead_letter_with(&s, "resize", "acme", "order 18 failed", at(2_000)).await;
    let keep = dead_letter_with(&s, "resize", "acme", "disk full", at(3_000)).await;
    let group = s.dead_letter(a1).await.unwrap().unwrap().group_id;

    let entry = s.audit(audit("archive")).await.unwrap();
    let n = s
        .archive(
            vec![a1, a2, DeadLetterId(999_999)],
            true,
            at(4_000),
            Some(entry),
        )
        .await
        .unwrap();
    assert_eq!(n, 2, "an unknown id changes nothing");
    assert_eq!(
        s.archive(vec![a1], true, at(4_001), None).await.unwrap(),
        0,
        "archived already"
    );
    assert_eq!(s.audit_log(1).await.unwrap()[0].count, 2);

    // Kept, with when it was archived.
    let d = s.dead_letter(a1).await.unwrap().expect("kept");
    assert_eq!(d.archived_at, Some(at(4_000)));
    // Hidden from the active views: lists, groups, reasons, stats, alerts.
    let (active, _) = s
        .dead_letters(DeadLetterFilter::default(), 10, None)
        .await
        .unwrap();
    assert_eq!(active.iter().map(|d| d.id).collect::<Vec<_>>(), vec![keep]);
    let groups = s.groups(query(at(4_000))).await.unwrap().0;
    assert!(groups.iter().all(|g| g.id != group), "{groups:?}");
    let reasons = s.reasons().await.unwrap();
    assert_eq!(reasons.iter().map(|r| r.count).sum::<u64>(), 1);
    let stats = s.stats().await.unwrap();
    assert_eq!(stats.dead_letters.iter().map(|d| d.2).sum::<u64>(), 1);
    let recent = s.dead_letters_after(DeadLetterId(0), 10).await.unwrap();
    assert_eq!(recent.iter().map(|r| r.id).collect::<Vec<_>>(), vec![keep]);
    let unarchived = s
        .match_dead_letters(Selector::Filter(DeadLetterFilter {
            group: Some(group.clone()),
            ..DeadLetterFilter::default()
        }))
        .await
        .unwrap();
    assert!(unarchived.is_empty(), "a filter matches active ones only");
    // Shown when asked for.
    let archived = DeadLetterFilter {
        archived: true,
        ..DeadLetterFilter::default()
    };
    let (shown, _) = s.dead_letters(archived.clone(), 10, None).await.unwrap();
    assert_eq!(shown.iter().map(|d| d.id).collect::<Vec<_>>(), vec![a2, a1]);
    let archived_groups = s
        .groups(GroupQuery {
            archived: true,
            ..query(at(4_000))
        })
        .await
        .unwrap()
        .0;
    assert_eq!(archived_groups.len(), 1);
    assert_eq!(
        (archived_groups[0].id.as_str(), archived_groups[0].count),
        (group.as_str(), 2)
    );

    // Restored: active again, everywhere.
    assert_eq!(
        s.archive(vec![a1], false, at(5_000), None).await.unwrap(),
        1
    );
    assert_eq!(
        s.archive(vec![keep], false, at(5_000), None).await.unwrap(),
        0
    );
    assert_eq!(s.dead_letter(a1).await.unwrap().unwrap().archived_at, None);
    let groups = s.groups(query(at(5_000))).await.unwrap().0;
    let g = groups.iter().find(|g| g.id == group).expect("back");
    assert_eq!(g.count, 1);
}

pub async fn a_redrive_report_follows_its_jobs_to_success_and_failure_again<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let d1 = dead_letter_with(&s, "resize", "acme", "order 17 failed", at(1_000)).await;
    let d2 = dead_letter_with(&s, "resize", "acme", "order 18 failed", at(1_000)).await;
    let from = s.dead_letter(d1).await.unwrap().unwrap().group_id;
    assert_eq!(s.redrive_report("nope".into()).await.unwrap(), None);

    let entry = s.audit(audit("redrive")).await.unwrap();
    s.record_redrive("r-1".into(), entry).await.unwrap();
    let moved = s
        .redrive(vec![d1, d2], at(2_000), Some(entry))
        .await
        .unwrap();
    assert_eq!(moved.len(), 2);
    let r = s
        .redrive_report("r-1".into())
        .await
        .unwrap()
        .expect("known");
    assert_eq!((r.id.as_str(), r.audit.count, r.jobs), ("r-1", 2, 2));
    assert_eq!((r.running, r.succeeded, r.failed_again), (2, 0, 0));
    assert_eq!(r.from_groups, vec![(from.clone(), 2)]);

    // One succeeds.
    let first = lease_one(&s, lease_req(at(3_000), 1)).await;
    complete(&s, &first, Event::Succeeded, at(3_001)).await;
    let r = s.redrive_report("r-1".into()).await.unwrap().unwrap();
    assert_eq!((r.running, r.succeeded, r.failed_again), (1, 1, 0));

    // The other fails again, into another group.
    let second = lease_one(&s, lease_req(at(4_000), 1)).await;
    let failure = Failure::new("timeout", "upstream gone").with_class(FailureClass::Permanent);
    let again = complete(&s, &second, Event::Failed(failure), at(4_001))
        .await
        .dead_letter
        .expect("dead-lettered again");
    let new_group = s.dead_letter(again).await.unwrap().unwrap().group_id;
    assert_ne!(new_group, from);
    let r = s.redrive_report("r-1".into()).await.unwrap().unwrap();
    assert_eq!((r.running, r.succeeded, r.failed_again), (0, 1, 1));
    assert_eq!(r.failed_again_groups, vec![(new_group, 1)]);
    assert_eq!(r.audit.action, "redrive");
}

/// Leases the one ready job of `job_type` and fails it permanently with
/// `message`: its new dead letter.
async fn fail_again<S: Store>(
    s: &S,
    job_type: &str,
    message: &str,
    now: Timestamp,
) -> DeadLetterId {
    let leased = lease_one(
        s,
        lazaret_store::LeaseRequest {
            types: Some(vec![job_type.into()]),
            ..lease_req(now, 1)
        },
    )
    .await;
    let failure = Failure::new("bad_input", message).with_class(FailureClass::Permanent);
    complete(s, &leased, Event::Failed(failure), now)
        .await
        .dead_letter
        .expect("a permanent failure writes a dead letter")
}

pub async fn a_lineage_lists_each_redrive_with_its_group_edit_and_redirect<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let d1 = dead_letter_with(&s, "resize", "acme", "order 17 failed", at(1_000)).await;
    let first = s.dead_letter(d1).await.unwrap().unwrap();
    let job = first.job_id.expect("a lazaret job");
    assert!(s.lineage(job).await.unwrap().is_empty(), "never redriven");

    // A plain redrive, then it fails again into another group.
    let e1 = s.audit(audit("redrive")).await.unwrap();
    s.record_redrive("r-1".into(), e1).await.unwrap();
    assert_eq!(
        s.redrive(vec![d1], at(2_000), Some(e1)).await.unwrap(),
        vec![job]
    );
    let d2 = fail_again(&s, "resize", "timeout talking to s3", at(2_100)).await;
    let second = s.dead_letter(d2).await.unwrap().unwrap().group_id;
    assert_ne!(second, first.group_id);

    // A corrected redrive, failing again.
    let e2 = s
        .audit(AuditEntry {
            actor: "bob".into(),
            at: at(3_000),
            ..audit("redrive")
        })
        .await
        .unwrap();
    s.record_redrive("r-2".into(), e2).await.unwrap();
    let fix = lazaret_store::PayloadFix {
        payload: b"{\"fixed\":true}".to_vec(),
        schema_version: None,
        actor: "bob".into(),
        reason: "typo".into(),
    };
    assert_eq!(
        s.redrive_corrected(d2, fix, at(3_000), Some(e2))
            .await
            .unwrap(),
        Some(job)
    );
    let d3 = fail_again(&s, "resize", "still broken", at(3_100)).await;
    let third = s.dead_letter(d3).await.unwrap().unwrap().group_id;

    // A redirect to a repair type and lane.
    let e3 = s.audit(audit("redrive")).await.unwrap();
    s.record_redrive("r-3".into(), e3).await.unwrap();
    let to = lazaret_store::Redirect {
        job_type: Some("resize_repair".into()),
        lane: Some("repair".into()),
        schema_version: None,
    };
    assert_eq!(
        s.redrive_to(vec![d3], to, at(4_000), Some(e3))
            .await
            .unwrap(),
        vec![job]
    );
    let view = crate::job_view(&s, job).await;
    assert_eq!(view.envelope.job_type.as_str(), "resize_repair");
    assert_eq!(view.envelope.lane.as_str(), "repair");
    assert_eq!(view.envelope.redrive_count, 3);
    let stats = s.stats().await.unwrap();
    assert_eq!(crate::lane_counts(&stats, "repair").queued, 1);
    assert_eq!(crate::lane_counts(&stats, "default").queued, 0);
    // A worker of the repair type, and only one, gets it.
    let leased = lease_one(
        &s,
        lazaret_store::LeaseRequest {
            types: Some(vec!["resize_repair".into()]),
            ..lease_req(at(4_100), 5)
        },
    )
    .await;
    assert_eq!(leased.id, job);

    let lineage = s.lineage(job).await.unwrap();
    let seen: Vec<_> = lineage
        .iter()
        .map(|l| {
            (
                l.redrive_id.as_deref(),
                l.audit.actor.as_str(),
                l.from_group.as_str(),
                l.edited,
                l.to_type.as_deref(),
                l.to_lane.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        vec![
            (
                Some("r-1"),
                "op",
                first.group_id.as_str(),
                false,
                None,
                None
            ),
            (Some("r-2"), "bob", second.as_str(), true, None, None),
            (
                Some("r-3"),
                "op",
                third.as_str(),
                false,
                Some("resize_repair"),
                Some("repair")
            ),
        ]
    );
    assert_eq!(lineage[1].audit.at, at(3_000));
    // Survives a restart.
    drop(lineage);
    s.close().await.unwrap();
    let s = b.open(&place).await;
    assert_eq!(s.lineage(job).await.unwrap().len(), 3);
}

pub async fn a_redirect_never_gives_a_type_two_jobs_with_one_key<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let job = lazaret_store::NewJob {
        idempotency_key: Some("order-7".into()),
        ..new_job("resize", "acme", "default")
    };
    let (_, dl) = crate::dead_letter_job(&s, job, at(100)).await;
    enqueue_one(
        &s,
        lazaret_store::NewJob {
            idempotency_key: Some("order-7".into()),
            ..new_job("resize_repair", "acme", "default")
        },
    )
    .await;
    let to = lazaret_store::Redirect {
        job_type: Some("resize_repair".into()),
        lane: None,
        schema_version: None,
    };
    assert!(
        s.redrive_to(vec![dl], to, at(200), None)
            .await
            .unwrap()
            .is_empty(),
        "not redriven"
    );
    assert!(s.dead_letter(dl).await.unwrap().is_some(), "still there");
    // Another tenant's key is no conflict.
    let other = lazaret_store::NewJob {
        idempotency_key: Some("order-7".into()),
        ..new_job("resize", "other", "default")
    };
    let (id, dl) = crate::dead_letter_job(&s, other, at(300)).await;
    let to = lazaret_store::Redirect {
        job_type: Some("resize_repair".into()),
        lane: None,
        schema_version: None,
    };
    assert_eq!(
        s.redrive_to(vec![dl], to, at(400), None).await.unwrap(),
        vec![id]
    );
}

pub async fn groups_count_the_dead_letters_held_after_redrives_max<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let once = dead_letter_with(&s, "resize", "acme", "order 17 failed", at(1_000)).await;
    let _fresh = dead_letter_with(&s, "resize", "acme", "order 18 failed", at(1_000)).await;
    let group = s.dead_letter(once).await.unwrap().unwrap().group_id;
    s.redrive(vec![once], at(2_000), None).await.unwrap();
    let again = fail_again(&s, "resize", "order 17 failed", at(2_100)).await;
    assert_eq!(s.dead_letter(again).await.unwrap().unwrap().group_id, group);
    assert_eq!(
        s.dead_letter(again).await.unwrap().unwrap().redrive_count,
        1
    );
    let held = |max: Option<u32>| {
        let s = &s;
        let group = group.clone();
        async move {
            let groups = s
                .groups(GroupQuery {
                    redrives_max: max,
                    ..query(at(3_000))
                })
                .await
                .unwrap()
                .0;
            let g = groups.iter().find(|g| g.id == group).expect("the group");
            (g.count, g.held)
        }
    };
    assert_eq!(held(Some(1)).await, (2, 1));
    assert_eq!(held(Some(2)).await, (2, 0));
    assert_eq!(held(None).await, (2, 0));
}

/// Every dead letter (active or archived as asked), page by page.
async fn all_dead_letters<S: Store>(s: &S, archived: bool) -> Vec<lazaret_store::DeadLetter> {
    let mut out = Vec::new();
    let mut cursor = None;
    loop {
        let (page, next) = s
            .dead_letters(
                DeadLetterFilter {
                    archived,
                    ..DeadLetterFilter::default()
                },
                100,
                cursor,
            )
            .await
            .unwrap();
        out.extend(page);
        match next {
            Some(c) => cursor = Some(c),
            None => return out,
        }
    }
}

/// The groups as the store pages them (two at a time, so the cursor is
/// used) are the groups computed here from the dead letters themselves:
/// count, first and last seen, the newest as sample, the hour's rate, the
/// tenants and sources.
async fn assert_groups_agree_with_their_dead_letters<S: Store>(
    s: &S,
    now: Timestamp,
    archived: bool,
    step: &str,
) {
    use std::collections::{BTreeMap, BTreeSet};
    #[derive(Debug, Default, PartialEq)]
    struct Seen {
        count: u64,
        first_at: i64,
        last_at: i64,
        sample: (i64, u64),
        rate_1h: u64,
        tenants: BTreeSet<String>,
        sources: BTreeSet<String>,
    }
    let mut expected: BTreeMap<String, Seen> = BTreeMap::new();
    for d in all_dead_letters(s, archived).await {
        let at = d.dead_lettered_at.as_millis();
        let g = expected.entry(d.group_id.clone()).or_insert(Seen {
            first_at: at,
            last_at: at,
            ..Seen::default()
        });
        g.count += 1;
        g.first_at = g.first_at.min(at);
        g.last_at = g.last_at.max(at);
        g.sample = g.sample.max((at, d.id.0));
        g.rate_1h += u64::from(at >= now.as_millis() - 3_600_000);
        g.tenants.extend(d.tenant.clone());
        g.sources.extend(d.source.as_ref().map(|r| r.name.clone()));
    }
    let mut expected_order: Vec<(&String, &Seen)> = expected.iter().collect();
    expected_order.sort_by(|a, b| b.1.last_at.cmp(&a.1.last_at).then(a.0.cmp(b.0)));

    let mut got = Vec::new();
    let mut cursor = None;
    loop {
        let (page, next) = s
            .groups(GroupQuery {
                limit: 2,
                cursor: cursor.clone(),
                archived,
                ..query(now)
            })
            .await
            .unwrap();
        got.extend(page);
        match next {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    let got_ids: Vec<&String> = got.iter().map(|g| &g.id).collect();
    let expected_ids: Vec<&String> = expected_order.iter().map(|e| e.0).collect();
    assert_eq!(got_ids, expected_ids, "{step}: the groups, in order");
    for g in &got {
        let seen = Seen {
            count: g.count,
            first_at: g.first_at.as_millis(),
            last_at: g.last_at.as_millis(),
            sample: (g.last_at.as_millis(), g.sample_id.0),
            rate_1h: g.rate_1h,
            tenants: g.tenants.iter().cloned().collect(),
            sources: g.sources.iter().cloned().collect(),
        };
        assert_eq!(&seen, &expected[&g.id], "{step}: group {}", g.id);
        let mut tenants = g.tenants.clone();
        tenants.sort();
        assert_eq!(tenants, g.tenants, "{step}: tenants in order");
        let sample = s.dead_letter(g.sample_id).await.unwrap().expect("held");
        assert_eq!(
            sample.error.map(|e| e.message),
            g.sample_error,
            "{step}: the sample is the newest dead letter"
        );
    }
}

async fn assert_both_views_agree<S: Store>(s: &S, now: Timestamp, step: &str) {
    assert_groups_agree_with_their_dead_letters(s, now, false, step).await;
    assert_groups_agree_with_their_dead_letters(s, now, true, step).await;
}

pub async fn the_group_summary_follows_every_change_to_its_dead_letters<B: Backend>(b: &B) {
    use lazaret_store::Stage;
    let place = b.place().await;
    let s = b.open(&place).await;
    let hour = 3_600_000;
    let a1 = dead_letter_with(&s, "resize", "acme", "order 1 failed", at(1_000)).await;
    let a2 = dead_letter_with(&s, "resize", "beta", "order 2 failed", at(2_000)).await;
    let a3 = dead_letter_with(&s, "resize", "gamma", "order 3 failed", at(hour + 3_000)).await;
    let a4 = dead_letter_with(&s, "resize", "acme", "order 4 failed", at(hour + 3_000)).await;
    let b1 = dead_letter_with(&s, "crop", "acme", "disk full", at(1_500)).await;
    let b2 = dead_letter_with(&s, "crop", "acme", "disk full", at(2_500)).await;
    let broker = s
        .quarantine_message(crate::sources::quarantined(
            "src",
            "m-1",
            Stage::Broker,
            1_200,
        ))
        .await
        .unwrap()
        .id;
    let broker2 = s
        .quarantine_message(crate::sources::quarantined(
            "src2",
            "m-2",
            Stage::Broker,
            1_300,
        ))
        .await
        .unwrap()
        .id;
    let now = at(hour + 4_000);
    assert_both_views_agree(&s, now, "written").await;

    // Archive the sample (newest) and the oldest of a group, then restore.
    assert_eq!(s.archive(vec![a4], true, at(5_000), None).await.unwrap(), 1);
    assert_both_views_agree(&s, now, "the newest archived").await;
    assert_eq!(s.archive(vec![a1], true, at(5_000), None).await.unwrap(), 1);
    assert_both_views_agree(&s, now, "the oldest archived").await;
    assert_eq!(
        s.archive(vec![broker], true, at(5_000), None)
            .await
            .unwrap(),
        1
    );
    assert_both_views_agree(&s, now, "a source's only dead letter archived").await;
    assert_eq!(
        s.archive(vec![a4], false, at(6_000), None).await.unwrap(),
        1
    );
    assert_both_views_agree(&s, now, "the newest restored").await;

    // Purge: the only dead letter of a tenant, then a whole group.
    assert_eq!(s.purge(vec![a3], None).await.unwrap(), 1);
    assert_both_views_agree(&s, now, "a tenant's only dead letter purged").await;
    assert_eq!(s.purge(vec![b1, b2, broker2], None).await.unwrap(), 3);
    assert_both_views_agree(&s, now, "a group purged").await;

    // Redrive: out of its group; it succeeds and retention removes it.
    let moved = s.redrive(vec![a2], at(7_000), None).await.unwrap();
    assert_eq!(moved.len(), 1);
    assert_both_views_agree(&s, now, "redriven").await;
    let job = lease_one(&s, lease_req(at(8_000), 1)).await;
    complete(&s, &job, Event::Succeeded, at(8_001)).await;
    assert_eq!(s.remove_succeeded(at(9_000), 10).await.unwrap(), 1);
    assert_both_views_agree(&s, now, "retention after the redrive").await;

    // Redriven again, it fails again: back in a group, newest there.
    let again = s.redrive(vec![a4], at(10_000), None).await.unwrap();
    assert_eq!(again.len(), 1);
    let job = lease_one(&s, lease_req(at(hour + 3_500), 1)).await;
    let failure = Failure::new("bad_input", "order 4 failed").with_class(FailureClass::Permanent);
    let back = complete(&s, &job, Event::Failed(failure), at(hour + 3_500))
        .await
        .dead_letter
        .expect("dead-lettered again");
    assert_both_views_agree(&s, now, "failed again after a redrive").await;
    let groups = s.groups(query(now)).await.unwrap().0;
    assert_eq!(groups[0].sample_id, back);

    // Kept across a restart.
    s.close().await.unwrap();
    drop(s);
    let s = b.open(&place).await;
    assert_both_views_agree(&s, now, "after a restart").await;
}
