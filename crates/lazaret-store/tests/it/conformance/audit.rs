//! Audit: appended entries come back newest first, as written.

use std::path::Path;

use lazaret_store::{AuditEntry, Store};

use super::at;

pub async fn audit_entries_are_listed_newest_first<S: Store>(
    dir: &Path,
    open: impl Fn(&Path) -> S,
) {
    let s = open(dir);
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
