//! The audit log through the client: pages follow `next_cursor` to the
//! oldest entry, and filters by action.

use lazaret_client::{AuditRequest, Lane, PauseTarget};

use crate::support::{self, CONFIG};

#[tokio::test]
async fn audit_pages_follow_the_cursor_to_the_oldest_entry() {
    let Some(server) = support::start(CONFIG).await else {
        return;
    };
    let client = &server.client;
    for n in 0..5 {
        let lane = PauseTarget::Lane(Lane::new(format!("lane-{n}")));
        client.pause(&lane).await.expect("paused");
    }
    client
        .resume(&PauseTarget::Lane(Lane::new("lane-0")))
        .await
        .expect("resumed");

    let mut req = AuditRequest {
        limit: Some(2),
        ..AuditRequest::default()
    };
    let mut pages = 0;
    let mut entries = Vec::new();
    loop {
        let page = client.audit_page(&req).await.expect("a page");
        assert!(page.items.len() <= 2);
        pages += 1;
        entries.extend(page.items);
        match page.next_cursor {
            Some(c) => req.cursor = Some(c),
            None => break,
        }
    }
    assert_eq!(pages, 3);
    let actions: Vec<&str> = entries.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(
        actions,
        ["resume", "pause", "pause", "pause", "pause", "pause"]
    );
    assert_eq!(entries[5].request["lane"], "lane-0", "the oldest is last");
    assert!(entries.iter().all(|e| e.id.is_some()));

    let resumes = client
        .audit_page(&AuditRequest {
            action: Some("resume".into()),
            ..AuditRequest::default()
        })
        .await
        .expect("filtered");
    assert_eq!(resumes.items.len(), 1);
    assert_eq!(resumes.next_cursor, None);
    assert_eq!(client.audit(Some(3)).await.expect("newest").len(), 3);
}
