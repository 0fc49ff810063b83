//! The conformance suite against `SqliteStore`, plus what only SQLite has (its file, its schema version).

use std::path::Path;
use std::sync::Arc;

use lazaret_core::FairScheduler;
use lazaret_store::sqlite::{DB_FILE, SCHEMA_VERSION};
use lazaret_store::{Durability, SqliteStore, Store, StoreError};

use crate::conformance::{SeededDecider, scheduler_config};

/// Opens the store in `dir` as the suite expects it.
pub fn open(dir: &Path) -> SqliteStore {
    try_open(dir).expect("open the SQLite store")
}

fn try_open(dir: &Path) -> Result<SqliteStore, StoreError> {
    let scheduler = FairScheduler::new(scheduler_config()).expect("a valid scheduler config");
    SqliteStore::open(
        dir,
        Durability::Full,
        scheduler,
        Arc::new(SeededDecider::new()),
    )
}

crate::conformance::conformance_suite!(crate::sqlite::open);

#[tokio::test]
async fn creates_its_file_in_the_data_directory() {
    let dir = tempfile::TempDir::new().unwrap();
    let nested = dir.path().join("data").join("lazaret");
    let s = open(&nested);
    assert_eq!(s.path(), nested.join(DB_FILE));
    assert!(s.path().is_file());
    s.close().await.unwrap();
}

#[tokio::test]
async fn refuses_a_database_from_a_newer_build() {
    let dir = tempfile::TempDir::new().unwrap();
    open(dir.path()).close().await.unwrap();
    let conn = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
    conn.execute_batch(&format!("PRAGMA user_version = {}", SCHEMA_VERSION + 1))
        .unwrap();
    drop(conn);
    let err = try_open(dir.path()).expect_err("a newer schema is refused");
    assert!(
        matches!(err, StoreError::Corrupt(ref m) if m.contains("newer")),
        "{err}"
    );
}

#[tokio::test]
async fn a_failing_command_changes_nothing_and_the_store_goes_on() {
    use crate::conformance::{at, enqueue_one, lease_one, lease_req, new_job, permanent};
    use lazaret_store::{Completion, Selector};

    let dir = tempfile::TempDir::new().unwrap();
    let s = open(dir.path());
    // A dead letter whose stored envelope is then corrupted behind the store's back.
    let id = enqueue_one(&s, new_job("t", "acme", "default")).await;
    let job = lease_one(&s, lease_req(at(1), 1)).await;
    let done = s
        .complete(
            vec![Completion {
                id,
                token: job.lease_token,
                event: lazaret_core::Event::Failed(permanent()),
            }],
            at(2),
        )
        .await
        .unwrap();
    assert!(done[0].is_ok());
    let raw = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
    raw.execute(
        "UPDATE jobs SET envelope = 'not json' WHERE id = ?1",
        [id.0 as i64],
    )
    .unwrap();
    drop(raw);
    let all = s
        .match_dead_letters(Selector::Filter(Default::default()))
        .await
        .unwrap();
    // Redriving it fails with a typed error and changes nothing…
    let err = s
        .redrive(vec![all[0].0], at(3))
        .await
        .expect_err("a corrupt envelope cannot be redriven");
    assert!(matches!(err, StoreError::Corrupt(_)), "{err}");
    assert_eq!(
        s.match_dead_letters(Selector::Filter(Default::default()))
            .await
            .unwrap()
            .len(),
        1
    );
    // …and the store keeps serving: a new job goes all the way through.
    let id2 = enqueue_one(&s, new_job("t", "acme", "default")).await;
    let job2 = lease_one(&s, lease_req(at(4), 1)).await;
    assert_eq!(job2.id, id2);
    let done = s
        .complete(
            vec![Completion {
                id: id2,
                token: job2.lease_token,
                event: lazaret_core::Event::Succeeded,
            }],
            at(5),
        )
        .await
        .unwrap();
    assert!(done[0].is_ok());
    let stats = s.stats().await.unwrap();
    assert_eq!(stats.succeeded, 1);
    s.close().await.unwrap();
}
