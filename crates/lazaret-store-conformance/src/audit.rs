//! Audit: appended entries come back newest first, as written.

use lazaret_store::{AuditEntry, AuditQuery, Store};

use crate::Backend;

use super::{at, dead_letter_job, new_job};

pub async fn audit_entries_are_listed_newest_first<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    assert!(s.audit_log(10).await.unwrap().is_empty());
    let entry = |ms: i64, action: &str, count: u64| AuditEntry {
        at: at(ms),
        actor: "ops-alice".into(),
        action: action.into(),
        request: serde_json::json!({ "filter": { "type": "resize" }, "dry_run": false, "n": ms }),
        count,
    };
    let written = [
        entry(1, "redrive", 3),
        entry(2, "purge", 1),
        entry(3, "pause", 0),
    ];
    for e in &written {
        s.audit(e.clone()).await.unwrap();
    }
    assert_eq!(
        s.audit_log(2).await.unwrap(),
        vec![written[2].clone(), written[1].clone()]
    );
    assert_eq!(
        s.audit_log(10).await.unwrap(),
        written.iter().rev().cloned().collect::<Vec<_>>()
    );
    assert!(s.audit_log(0).await.unwrap().is_empty());
}

pub async fn the_audit_log_pages_by_cursor_and_filters_by_action_and_actor<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let entry = |ms: i64, actor: &str, action: &str| AuditEntry {
        at: at(ms),
        actor: actor.into(),
        action: action.into(),
        request: serde_json::json!({ "n": ms }),
        count: 0,
    };
    let purge = s.audit(entry(1, "root", "purge")).await.unwrap();
    let mut denied = Vec::new();
    for i in 0..5 {
        denied.push(s.audit(entry(2 + i, "intern", "denied")).await.unwrap());
    }
    assert!(denied.iter().all(|d| *d > purge), "ids grow");

    // Pages of two, newest first, until the purge at the end.
    let mut seen = Vec::new();
    let mut before = None;
    loop {
        let (page, next) = s
            .audit_page(AuditQuery {
                limit: 2,
                before,
                ..AuditQuery::default()
            })
            .await
            .unwrap();
        assert!(page.len() <= 2);
        seen.extend(page.iter().map(|(id, _)| *id));
        match next {
            Some(n) => before = Some(n),
            None => break,
        }
    }
    let mut all = denied.clone();
    all.reverse();
    all.push(purge);
    assert_eq!(seen, all, "every entry once, newest first");

    // By action, and by actor.
    let (page, next) = s
        .audit_page(AuditQuery {
            limit: 10,
            action: Some("purge".into()),
            ..AuditQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(page, vec![(purge, entry(1, "root", "purge"))]);
    assert_eq!(next, None);
    let (page, _) = s
        .audit_page(AuditQuery {
            limit: 10,
            actor: Some("intern".into()),
            ..AuditQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(page.len(), 5);
}

pub async fn redrive_and_purge_count_onto_their_audit_entry<B: Backend>(b: &B) {
    let place = b.place().await;
    let s = b.open(&place).await;
    let entry = |action: &str| AuditEntry {
        at: at(1),
        actor: "ops".into(),
        action: action.into(),
        request: serde_json::json!({}),
        count: 0,
    };
    let mut dls = Vec::new();
    for n in 0..3 {
        let (_, dl) =
            dead_letter_job(&s, new_job("resize", &format!("t{n}"), "default"), at(100)).await;
        dls.push(dl);
    }
    let redrive = s.audit(entry("redrive")).await.unwrap();
    assert_eq!(
        s.redrive(vec![dls[0]], at(200), Some(redrive))
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(s.audit_log(1).await.unwrap()[0].count, 1);
    // A batch that moves nothing adds nothing.
    assert!(
        s.redrive(vec![dls[0]], at(200), Some(redrive))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        s.redrive(vec![dls[1]], at(200), Some(redrive))
            .await
            .unwrap()
            .len(),
        1
    );
    assert_eq!(s.audit_log(1).await.unwrap()[0].count, 2);

    let purge = s.audit(entry("purge")).await.unwrap();
    assert_eq!(s.purge(vec![dls[2], dls[0]], Some(purge)).await.unwrap(), 1);
    let log = s.audit_log(2).await.unwrap();
    assert_eq!((log[0].action.as_str(), log[0].count), ("purge", 1));
    assert_eq!((log[1].action.as_str(), log[1].count), ("redrive", 2));
}
