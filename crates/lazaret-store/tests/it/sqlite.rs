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
