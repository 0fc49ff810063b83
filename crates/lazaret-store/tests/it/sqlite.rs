//! The conformance suite against `SqliteStore`, plus what only SQLite has (its file, its schema version).

use std::path::Path;
use std::sync::Arc;

use lazaret_core::FairScheduler;
use lazaret_store::sqlite::{DB_FILE, SCHEMA_VERSION};
use lazaret_store::{Durability, SqliteStore, Store, StoreError};

use lazaret_store_conformance::{Backend, Capabilities, scheduler_config, seeded_decider};

/// The SQLite backend of the conformance suite: a temporary directory per case.
#[derive(Debug)]
pub struct Sqlite;

impl Backend for Sqlite {
    type Store = SqliteStore;
    type Place = tempfile::TempDir;

    fn capabilities(&self) -> Capabilities {
        Capabilities::none().with_group_commit_stats(true)
    }

    async fn place(&self) -> tempfile::TempDir {
        tempfile::TempDir::new().expect("a temporary directory")
    }

    async fn open(&self, place: &tempfile::TempDir) -> SqliteStore {
        open(place.path())
    }
}

/// Always there: SQLite is embedded.
pub fn backend() -> Option<Sqlite> {
    Some(Sqlite)
}

/// Opens the store in `dir` as the suite expects it.
pub fn open(dir: &Path) -> SqliteStore {
    try_open(dir).expect("open the SQLite store")
}

fn try_open(dir: &Path) -> Result<SqliteStore, StoreError> {
    let scheduler = FairScheduler::new(scheduler_config()).expect("a valid scheduler config");
    SqliteStore::open(dir, Durability::Full, scheduler, Arc::new(seeded_decider()))
}

lazaret_store_conformance::conformance_suite!(crate::sqlite::backend);

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
async fn a_second_store_on_the_same_directory_is_refused_until_the_first_is_closed() {
    use lazaret_store_conformance::{enqueue_one, job_view, new_job};

    let dir = tempfile::TempDir::new().unwrap();
    let first = open(dir.path());
    let err = try_open(dir.path()).expect_err("the directory is taken");
    let pid = std::process::id();
    assert!(
        matches!(err, StoreError::InUse { pid: Some(p), .. } if p == pid),
        "{err:?}"
    );
    let message = err.to_string();
    for part in [
        format!("another lazaret is using {}", dir.path().display()),
        format!("(pid {pid})"),
        "stop it or use another --data directory".into(),
    ] {
        assert!(message.contains(&part), "{part:?} missing from: {message}");
    }

    // The refused open disturbed nothing: the first store goes on.
    let id = enqueue_one(&first, new_job("t", "acme", "default")).await;
    // Closed, it lets the directory go, though the value lives on.
    first.close().await.unwrap();
    let second = open(dir.path());
    assert_eq!(
        job_view(&second, id).await.state,
        lazaret_core::JobState::Queued
    );
    // Dropped without a close, too.
    drop(second);
    let third = open(dir.path());
    assert!(
        try_open(dir.path()).is_err(),
        "and the third holds it again"
    );
    third.close().await.unwrap();
    drop(first);
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
    use lazaret_store::{Completion, Selector};
    use lazaret_store_conformance::{at, enqueue_one, lease_one, lease_req, new_job, permanent};

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
        .redrive(vec![all[0].0], at(3), None)
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

/// A version-1 database (every envelope whole, a running attempt inside it,
/// tokens from the old clock-derived counter) opens as the current version and
/// reads, acks and leases on as if it had been written by this build, and takes
/// broker dead letters and held retries (version 4).
#[tokio::test]
async fn migrates_a_version_1_database_in_place() {
    use lazaret_core::{
        AttemptOutcome, Envelope, Event, JobId, JobState, WorkerId, grant_lease, record_success,
    };
    use lazaret_store::{LeaseToken, LeasedJob};
    use lazaret_store_conformance::{at, complete, job_view, lease_one, lease_req, new_job};

    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join(DB_FILE);
    let env = |id: u64, ty: &str| {
        let mut e = Envelope::new(
            JobId(id),
            ty.into(),
            "acme".into(),
            "default".into(),
            br#"{"n":1}"#,
            at(1),
        );
        e.schema_version = Some(2);
        e
    };
    let queued = {
        let mut e = env(1, "resize");
        e.idempotency_key = Some("k-1".into());
        e
    };
    let mut leased = env(2, "resize");
    grant_lease(&mut leased, Some(&WorkerId::new("old-worker")), at(5));
    let mut done = env(3, "resize");
    grant_lease(&mut done, Some(&WorkerId::new("old-worker")), at(5));
    record_success(&mut done, at(6));
    // A v1 token: its counter ran above 1000 per ms since the epoch.
    let old_token: i64 = 1_780_000_000_000 * 1000;
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v1.sql"))
            .unwrap();
        let insert =
            "INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, lease_token,
             lease_expires_at, idempotency_key, created_at, finished_at, envelope, payload)
             VALUES (?1, 'resize', 'acme', 'default', ?2, 1, ?3, ?4, ?5, ?6, 1, ?7, ?8, ?9)";
        // (envelope, state, lease token, lease expiry, finished at)
        type Row<'a> = (&'a Envelope, &'a str, Option<i64>, Option<i64>, Option<i64>);
        let rows: [Row<'_>; 3] = [
            (&queued, "queued", None, None, None),
            (
                &leased,
                "leased",
                Some(old_token),
                Some(at(60_000).as_millis()),
                None,
            ),
            (&done, "succeeded", None, None, Some(6)),
        ];
        for (e, state, token, expires, finished) in rows {
            conn.execute(
                insert,
                rusqlite::params![
                    e.id.0 as i64,
                    state,
                    e.attempts,
                    token,
                    expires,
                    e.idempotency_key,
                    finished,
                    e.to_json(),
                    br#"{"n":1}"#.to_vec()
                ],
            )
            .unwrap();
        }
        // Ids up to 10 were handed out; 4..=10 are gone (retention, purge).
        conn.execute_batch(
            "UPDATE sqlite_sequence SET seq = 10 WHERE name = 'jobs'; PRAGMA user_version = 1;",
        )
        .unwrap();
    }

    let s = open(dir.path());
    let version: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    assert_eq!(job_view(&s, JobId(1)).await.envelope, queued);
    assert_eq!(job_view(&s, JobId(2)).await.envelope, leased);
    assert_eq!(job_view(&s, JobId(3)).await.envelope, done);

    // The lease granted by the old build is still good.
    let held = LeasedJob {
        id: JobId(2),
        job_type: "resize".into(),
        tenant: "acme".into(),
        lane: "default".into(),
        payload: br#"{"n":1}"#.to_vec(),
        attempt: 1,
        idempotency_key: None,
        schema_version: Some(2),
        lease_token: LeaseToken(old_token as u64),
        lease_expires_at: at(60_000),
        created_at: at(1),
        ready_at: at(1),
        traceparent: None,
    };
    complete(&s, &held, Event::Succeeded, at(7)).await;
    let view = job_view(&s, JobId(2)).await;
    assert_eq!(view.state, JobState::Succeeded);
    assert_eq!(view.envelope.history.len(), 1);
    assert_eq!(view.envelope.history[0].outcome, AttemptOutcome::Succeeded);
    assert_eq!(view.envelope.history[0].ended_at, Some(at(7)));

    // New leases carry tokens above every old one; ids go on past the mark.
    let job = lease_one(&s, lease_req(at(8), 1)).await;
    assert_eq!(
        (job.id, job.schema_version, job.idempotency_key.as_deref()),
        (JobId(1), Some(2), Some("k-1"))
    );
    assert!(
        job.lease_token.0 > old_token as u64,
        "{} is not above the old {old_token}",
        job.lease_token
    );
    let fresh =
        lazaret_store_conformance::enqueue_one(&s, new_job("resize", "acme", "default")).await;
    assert_eq!(fresh, JobId(11));
    // Version 6's cancel works on the table version 1 → 2 rebuilt.
    assert_eq!(
        lazaret_store_conformance::cancel::cancel(&s, fresh, at(8)).await,
        Ok(lazaret_store::Cancelled::Now)
    );
    assert_eq!(job_view(&s, fresh).await.state, JobState::Cancelled);

    // Version 4's broker dead letters and held retries work on the migrated file.
    let msg = lazaret_store::SourceRef {
        name: "orders".into(),
        broker: "redis".into(),
        queue: "orders".into(),
        message_id: "m-1".into(),
        headers: serde_json::Map::new(),
        position: serde_json::json!({"entry_id": "1-0"}),
        content_type: None,
        redrive_id: None,
    };
    let held = lazaret_store::HeldRetry {
        source: msg.clone(),
        due_at: at(9),
        envelope: env(0, "orders"),
        body: b"x".to_vec(),
    };
    s.hold_retry(held.clone()).await.unwrap();
    assert_eq!(
        s.due_held_retries("orders".into(), at(9), 5).await.unwrap(),
        vec![held]
    );
    let q = s
        .quarantine_message(lazaret_store::SourceDeadLetter {
            source: msg.clone(),
            job_type: Some("orders".into()),
            tenant: None,
            lane: None,
            reason: lazaret_core::DeadLetterReason::Rejected,
            stage: lazaret_store::Stage::Broker,
            attempts: 1,
            error: None,
            envelope: None,
            idempotency_key: None,
            created_at: at(9),
            now: at(9),
            payload: b"x".to_vec(),
            may_be_held: true,
        })
        .await
        .unwrap();
    assert!(q.created);
    assert!(
        s.due_held_retries("orders".into(), at(9), 5)
            .await
            .unwrap()
            .is_empty()
    );
    s.close().await.unwrap();
}

/// A version-4 database (before cancel, job listing and kept pauses) opens
/// as the current version: its jobs list by state, a queued one cancels at
/// once and a leased one at its fail, and pauses are kept. The version-1
/// test above goes through the same step with its rebuilt table.
#[tokio::test]
async fn migrates_a_version_4_database_to_cancels_listing_and_kept_pauses() {
    use lazaret_core::{Event, JobId, JobState, Transition};
    use lazaret_store::{AuditEntry, Cancelled, JobQuery, LeaseToken, LeasedJob, PauseTarget};
    use lazaret_store_conformance::cancel::cancel;
    use lazaret_store_conformance::{at, complete, job_view, transient};

    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join(DB_FILE);
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v4.sql"))
            .unwrap();
        // Two queued jobs and one leased by the old build (token 77).
        conn.execute_batch(&format!(
            "INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, created_at, payload)
             VALUES (1, 'resize', 'acme', 'default', 'queued', 0, 0, {t}, X'7B7D'),
                    (2, 'resize', 'globex', 'default', 'queued', 0, 0, {t}, X'7B7D');
             INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, leases, lease_token,
                               lease_expires_at, lease_started_at, worker_id, created_at, payload)
             VALUES (3, 'resize', 'initech', 'default', 'leased', 0, 1, 1, 77, {end}, {t}, 'w-old', {t}, X'7B7D');",
            t = at(0).as_millis(),
            end = at(60_000).as_millis(),
        ))
        .unwrap();
    }

    let s = open(dir.path());
    let version: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let (queued, _) = s
        .jobs(JobQuery {
            state: Some(JobState::Queued),
            limit: 10,
            ..JobQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(
        queued.iter().map(|j| j.envelope.id).collect::<Vec<_>>(),
        vec![JobId(2), JobId(1)]
    );
    assert!(queued.iter().all(|j| !j.cancel_requested));

    assert_eq!(cancel(&s, JobId(1), at(1)).await, Ok(Cancelled::Now));
    assert_eq!(
        cancel(&s, JobId(3), at(1)).await,
        Ok(Cancelled::Requested { already: false })
    );
    let held = LeasedJob {
        id: JobId(3),
        job_type: "resize".into(),
        tenant: "initech".into(),
        lane: "default".into(),
        payload: b"{}".to_vec(),
        attempt: 1,
        idempotency_key: None,
        schema_version: None,
        lease_token: LeaseToken(77),
        lease_expires_at: at(60_000),
        created_at: at(0),
        ready_at: at(0),
        traceparent: None,
    };
    let done = complete(&s, &held, Event::Failed(transient("http_503")), at(2)).await;
    assert_eq!(done.transition, Transition::Cancelled);
    assert_eq!(job_view(&s, JobId(1)).await.state, JobState::Cancelled);
    assert_eq!(job_view(&s, JobId(3)).await.state, JobState::Cancelled);

    let entry = AuditEntry {
        at: at(3),
        actor: "ops".into(),
        action: "pause".into(),
        request: serde_json::json!({"lane": "default"}),
        count: 0,
    };
    s.set_pause(PauseTarget::Lane("default".into()), true, entry)
        .await
        .unwrap();
    s.close().await.unwrap();
    let s = open(dir.path());
    assert_eq!(s.pauses().await.unwrap().len(), 1);
    assert_eq!(s.stats().await.unwrap().cancelled, 2);
    s.close().await.unwrap();
}

/// Opens `dir` expecting a refusal; returns its message.
fn refused(dir: &Path) -> String {
    match try_open(dir) {
        Ok(_) => panic!("{} was opened", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[tokio::test]
async fn a_zero_byte_database_file_is_refused_not_started_empty() {
    let dir = tempfile::TempDir::new().unwrap();
    let db = dir.path().join(DB_FILE);
    std::fs::write(&db, b"").unwrap();
    let message = refused(dir.path());
    for part in [
        db.display().to_string(),
        "is empty (0 bytes)".into(),
        "not a new database".into(),
        "restore it from a backup".into(),
        "delete it to start a new, empty store".into(),
    ] {
        assert!(message.contains(&part), "{part:?} missing from: {message}");
    }
    assert_eq!(
        std::fs::metadata(&db).unwrap().len(),
        0,
        "the file is left as it was"
    );
    // Deleted, the directory starts a new store.
    std::fs::remove_file(&db).unwrap();
    open(dir.path()).close().await.unwrap();
}

#[tokio::test]
async fn a_file_that_is_not_sqlite_is_refused_as_corrupt() {
    let dir = tempfile::TempDir::new().unwrap();
    let db = dir.path().join(DB_FILE);
    let junk = vec![0x5au8; 8192];
    std::fs::write(&db, &junk).unwrap();
    let message = refused(dir.path());
    for part in [
        db.display().to_string(),
        "is corrupt or not a lazaret database".into(),
        "restore it from a backup".into(),
    ] {
        assert!(message.contains(&part), "{part:?} missing from: {message}");
    }
    assert_eq!(
        std::fs::read(&db).unwrap(),
        junk,
        "the file is left as it was"
    );
}

/// What one lease filtered by type costs the database (SQLite VM steps,
/// which count the rows a read looks at, not only those it returns), with
/// `others` jobs of another type queued ahead of the jobs it asks for, in
/// the same lane and tenant; `shape` builds the lease from the default.
async fn filtered_lease_steps(
    others: usize,
    shape: impl Fn(lazaret_store::LeaseRequest) -> lazaret_store::LeaseRequest,
) -> (u64, Vec<String>) {
    use lazaret_store_conformance::{at, lease, lease_req, new_job};

    let dir = tempfile::TempDir::new().unwrap();
    let s = open(dir.path());
    let bulk: Vec<_> = (0..others)
        .map(|_| new_job("bulk", "acme", "default"))
        .collect();
    s.enqueue(bulk).await.unwrap();
    s.enqueue(vec![
        new_job("email", "acme", "default"),
        new_job("sms", "acme", "default"),
    ])
    .await
    .unwrap();
    let before = s
        .stats()
        .await
        .unwrap()
        .group_commit
        .expect("SQLite counts");
    let got = lease(&s, shape(lease_req(at(1), 10))).await;
    let after = s
        .stats()
        .await
        .unwrap()
        .group_commit
        .expect("SQLite counts");
    assert_eq!(after.leases - before.leases, 1);
    s.close().await.unwrap();
    let mut types: Vec<String> = got.iter().map(|j| j.job_type.to_string()).collect();
    types.sort();
    (after.lease_steps - before.lease_steps, types)
}

/// A lease that asks for some types, or excludes the type of a large
/// backlog (its breaker is open), reads no job of the other types: it
/// costs exactly the same with 20,000 of them queued as with 10.
#[tokio::test]
async fn a_lease_filtered_by_type_reads_the_same_whatever_else_is_queued() {
    let only = |types: &[&str]| {
        let types: Vec<lazaret_core::JobType> = types.iter().map(|t| (*t).into()).collect();
        move |req| lazaret_store::LeaseRequest {
            types: Some(types.clone()),
            ..req
        }
    };
    let excluding_bulk = |req| lazaret_store::LeaseRequest {
        exclude_types: vec!["bulk".into()],
        ..req
    };
    for (what, few, many) in [
        (
            "types [email]",
            filtered_lease_steps(10, only(&["email"])).await,
            filtered_lease_steps(20_000, only(&["email"])).await,
        ),
        (
            "types [email, sms]",
            filtered_lease_steps(10, only(&["email", "sms"])).await,
            filtered_lease_steps(20_000, only(&["email", "sms"])).await,
        ),
        (
            "bulk excluded",
            filtered_lease_steps(10, excluding_bulk).await,
            filtered_lease_steps(20_000, excluding_bulk).await,
        ),
    ] {
        assert_eq!(few.1, many.1, "{what}: the same jobs");
        assert!(!many.1.iter().any(|t| t == "bulk"), "{what}: {:?}", many.1);
        assert_eq!(
            many.0, few.0,
            "{what}: {} steps with 20,000 others queued, {} with 10",
            many.0, few.0
        );
        // A few dozen steps per row leased, nowhere near one per job queued.
        assert!(many.0 < 500, "{what}: {} steps", many.0);
    }
}

/// A version-4 database (no typed ready index) opens as the current
/// version, gets the index, and filtered leases use it.
#[tokio::test]
async fn migrates_a_version_4_database_to_the_typed_ready_index() {
    use lazaret_core::JobId;
    use lazaret_store_conformance::{at, lease, lease_req};

    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join(DB_FILE);
    let index_count = |conn: &rusqlite::Connection| -> i64 {
        conn.query_row(
            "SELECT COUNT(*) FROM sqlite_master WHERE type = 'index' AND name = 'jobs_ready_type'",
            [],
            |r| r.get(0),
        )
        .unwrap()
    };
    {
        // A file of version 4, which had no typed index: a bulk job queued
        // before an email.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v4.sql"))
            .unwrap();
        conn.execute_batch(&format!(
            "INSERT INTO jobs (id, type, tenant, lane, state, run_at, attempts, created_at, payload)
             VALUES (1, 'bulk', 'acme', 'default', 'queued', 0, 0, {t}, X'7B7D'),
                    (2, 'email', 'acme', 'default', 'queued', 0, 0, {t}, X'7B7D');",
            t = at(0).as_millis(),
        ))
        .unwrap();
        assert_eq!(index_count(&conn), 0);
    }
    let email = JobId(2);
    let s = open(dir.path());
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!((version, index_count(&conn)), (SCHEMA_VERSION, 1));
    }
    let got = lease(
        &s,
        lazaret_store::LeaseRequest {
            types: Some(vec!["email".into()]),
            ..lease_req(at(1), 10)
        },
    )
    .await;
    assert_eq!(got.iter().map(|j| j.id).collect::<Vec<_>>(), [email]);
    s.close().await.unwrap();
}

/// A version-6 database (broker dead letters and held retries unique per
/// source and message id) opens as the current version: its broker dead
/// letter and its held retries are still recognised by their key (the
/// retries' key taken from their body and source reference), and a
/// different message reusing an id (another body) becomes a dead letter,
/// or a held retry, of its own.
#[tokio::test]
async fn migrates_a_version_6_database_to_dead_letters_and_held_retries_keyed_by_payload() {
    use lazaret_core::{Envelope, JobId};
    use lazaret_store::{Held, HeldRetry, MessageKey, SourceDeadLetter, SourceRef, Stage};
    use lazaret_store_conformance::at;

    let reference = |id: &str, redrive_id: Option<&str>| SourceRef {
        name: "orders".into(),
        broker: "rabbitmq".into(),
        queue: "orders".into(),
        message_id: id.into(),
        headers: serde_json::Map::new(),
        position: serde_json::Value::Null,
        content_type: None,
        redrive_id: redrive_id.map(str::to_owned),
    };
    let envelope = Envelope::new(
        JobId(0),
        "orders".into(),
        "acme".into(),
        "default".into(),
        b"held",
        at(1),
    );
    let held = |id: &str, redrive_id: Option<&str>, body: &[u8]| HeldRetry {
        source: reference(id, redrive_id),
        due_at: at(9),
        envelope: envelope.clone(),
        body: body.to_vec(),
    };
    let (plain, copy) = (
        held("order-8", None, b"held"),
        held("order-9", Some("r-1"), b"held"),
    );

    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join(DB_FILE);
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v6.sql"))
            .unwrap();
        let sha = hex::encode(lazaret_core::payload_sha256(b"first"));
        conn.execute_batch(&format!(
            "INSERT INTO dead_letters (id, job_id, type, reason, stage, attempts, created_at,
               dead_lettered_at, payload_size, payload_sha256, payload_preview, payload,
               source, source_name, message_id)
             VALUES (5, NULL, 'orders', 'rejected', 'broker', 1, 0, 0, 5, '{sha}', 'first',
               X'6669727374', '{{\"name\":\"dlq\",\"broker\":\"rabbitmq\",\"queue\":\"orders\",\"message_id\":\"order-7\"}}',
               'dlq', 'order-7');"
        ))
        .unwrap();
        for p in [&plain, &copy] {
            conn.execute(
                "INSERT INTO source_parked (source, message_id, due_at, ref, envelope, body)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                rusqlite::params![
                    p.source.name,
                    p.source.message_id,
                    p.due_at.as_millis(),
                    serde_json::to_string(&p.source).unwrap(),
                    p.envelope.to_json(),
                    p.body,
                ],
            )
            .unwrap();
        }
    }
    let s = open(dir.path());
    let version: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let old = lazaret_store::DeadLetterId(5);
    assert_eq!(
        s.message_held(MessageKey::of("dlq", "order-7", b"first", None))
            .await
            .unwrap(),
        Held::Quarantined(old)
    );
    let dl = |body: &[u8]| SourceDeadLetter {
        source: SourceRef {
            name: "dlq".into(),
            broker: "rabbitmq".into(),
            queue: "orders".into(),
            message_id: "order-7".into(),
            headers: serde_json::Map::new(),
            position: serde_json::Value::Null,
            content_type: None,
            redrive_id: None,
        },
        job_type: Some("orders".into()),
        tenant: None,
        lane: None,
        reason: lazaret_core::DeadLetterReason::UnknownOrigin,
        stage: Stage::Broker,
        attempts: 0,
        error: None,
        envelope: None,
        idempotency_key: None,
        created_at: at(1),
        now: at(1),
        payload: body.to_vec(),
        may_be_held: true,
    };
    let again = s.quarantine_message(dl(b"first")).await.unwrap();
    assert_eq!((again.id, again.created), (old, false));
    let other = s.quarantine_message(dl(b"second")).await.unwrap();
    assert!(other.created, "another body under the same id is kept");
    assert_ne!(other.id, old);

    // The held retries kept their place under their full key.
    assert_eq!(
        s.due_held_retries("orders".into(), at(9), 5).await.unwrap(),
        vec![plain.clone(), copy.clone()]
    );
    for p in [&plain, &copy] {
        assert_eq!(s.message_held(p.key()).await.unwrap(), Held::Retry);
        assert_eq!(s.held_retry(p.key()).await.unwrap().as_ref(), Some(p));
    }
    assert_eq!(
        s.message_held(MessageKey::of("orders", "order-9", b"held", None))
            .await
            .unwrap(),
        Held::Nothing,
        "the redrive id recorded in the source reference is part of the key"
    );
    let beside = held("order-8", None, b"another body");
    s.hold_retry(beside.clone()).await.unwrap();
    assert_eq!(
        s.due_held_retries("orders".into(), at(9), 5)
            .await
            .unwrap()
            .len(),
        3,
        "another body under a held id is held beside it"
    );
    assert!(s.release_held_retry(plain.key()).await.unwrap());
    assert_eq!(s.message_held(beside.key()).await.unwrap(), Held::Retry);
    s.close().await.unwrap();
}

/// A version-7 database's held retries (`source_parked`) are kept under
/// their new name, `source_held_retries`, with their index; a retry whose
/// envelope an older build wrote (`redrives`) keeps its count, and broker
/// dead letters that differ only by body (which version 7 allows) are kept.
#[tokio::test]
async fn migrates_a_version_7_database_to_held_retries_under_their_new_name() {
    use lazaret_core::{Envelope, JobId};
    use lazaret_store::{Held, HeldRetry, MessageKey, SourceRef};
    use lazaret_store_conformance::at;

    let mut envelope = Envelope::new(
        JobId(0),
        "orders".into(),
        "acme".into(),
        "default".into(),
        b"held",
        at(1),
    );
    let mut old_json: serde_json::Value = serde_json::from_str(&envelope.to_json()).unwrap();
    old_json["redrives"] = serde_json::json!(2);
    envelope.redrive_count = 2;
    let held = HeldRetry {
        source: SourceRef {
            name: "orders".into(),
            broker: "rabbitmq".into(),
            queue: "orders".into(),
            message_id: "order-8".into(),
            headers: serde_json::Map::new(),
            position: serde_json::Value::Null,
            content_type: None,
            redrive_id: None,
        },
        due_at: at(9),
        envelope,
        body: b"held".to_vec(),
    };

    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join(DB_FILE);
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v7.sql"))
            .unwrap();
        for (id, body) in [(5, b"first".as_slice()), (6, b"second".as_slice())] {
            conn.execute(
                "INSERT INTO dead_letters (id, job_id, type, reason, stage, attempts, created_at,
                   dead_lettered_at, payload_size, payload_sha256, payload_preview, payload,
                   source, source_name, message_id)
                 VALUES (?1, NULL, 'orders', 'rejected', 'broker', 1, 0, 0, ?2, ?3, 'x', ?4,
                   '{\"name\":\"dlq\",\"broker\":\"rabbitmq\",\"queue\":\"orders\",\"message_id\":\"order-7\"}',
                   'dlq', 'order-7')",
                rusqlite::params![
                    id,
                    body.len() as i64,
                    hex::encode(lazaret_core::payload_sha256(body)),
                    body
                ],
            )
            .unwrap();
        }
        conn.execute(
            "INSERT INTO source_parked
               (source, message_id, payload_sha256, redrive_id, due_at, ref, envelope, body)
             VALUES (?1, ?2, ?3, '', ?4, ?5, ?6, ?7)",
            rusqlite::params![
                held.source.name,
                held.source.message_id,
                hex::encode(lazaret_core::payload_sha256(&held.body)),
                held.due_at.as_millis(),
                serde_json::to_string(&held.source).unwrap(),
                old_json.to_string(),
                held.body,
            ],
        )
        .unwrap();
    }
    let s = open(dir.path());
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        let mut stmt = conn
            .prepare(
                "SELECT type || ' ' || name FROM sqlite_master
                 WHERE (tbl_name LIKE 'source_%' OR name LIKE 'source_%')
                   AND name NOT LIKE 'sqlite_autoindex_%' ORDER BY 1",
            )
            .unwrap();
        let objects: Vec<String> = stmt
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(
            objects,
            ["index source_held_retries_due", "table source_held_retries",]
        );
    }
    assert_eq!(
        s.due_held_retries("orders".into(), at(9), 5).await.unwrap(),
        vec![held.clone()]
    );
    assert_eq!(s.message_held(held.key()).await.unwrap(), Held::Retry);
    assert_eq!(
        s.held_retry(held.key())
            .await
            .unwrap()
            .map(|h| h.envelope.redrive_count),
        Some(2)
    );
    for (id, body) in [(5, b"first".as_slice()), (6, b"second".as_slice())] {
        assert_eq!(
            s.message_held(MessageKey::of("dlq", "order-7", body, None))
                .await
                .unwrap(),
            Held::Quarantined(lazaret_store::DeadLetterId(id))
        );
    }
    assert!(s.release_held_retry(held.key()).await.unwrap());
    assert_eq!(s.message_held(held.key()).await.unwrap(), Held::Nothing);
    s.close().await.unwrap();
}

/// A version-9 database's redrives (issue 30's reports) read in the
/// lineage of their jobs after the migration to 10, as not edited and not
/// redirected; a redirect is recorded from then on.
#[tokio::test]
async fn migrates_a_version_9_database_to_lineage_with_edits_and_redirects() {
    use lazaret_core::JobId;

    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join(DB_FILE);
    open(dir.path()).close().await.unwrap();
    {
        // Back to version 9: `redrive_jobs` without the new columns.
        let conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(
            "DROP INDEX redrive_jobs_job;
             DROP INDEX redrives_audit;
             ALTER TABLE redrive_jobs DROP COLUMN edited;
             ALTER TABLE redrive_jobs DROP COLUMN to_type;
             ALTER TABLE redrive_jobs DROP COLUMN to_lane;
             INSERT INTO audit (id, at, actor, action, request, count)
               VALUES (4, 1000, 'ops-alice', 'redrive', '{\"all\":true}', 1);
             INSERT INTO redrives (id, audit_id) VALUES ('r-9', 4);
             INSERT INTO redrive_jobs (audit_id, job_id, from_group) VALUES (4, 12, 'g-old');
             PRAGMA user_version = 9;",
        )
        .unwrap();
    }
    let s = open(dir.path());
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        let indexes: i64 = conn
            .query_row(
                "SELECT count(*) FROM sqlite_master
                 WHERE name IN ('redrive_jobs_job', 'redrives_audit')",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(indexes, 2);
    }
    let lineage = s.lineage(JobId(12)).await.unwrap();
    assert_eq!(lineage.len(), 1);
    let l = &lineage[0];
    assert_eq!(
        (
            l.redrive_id.as_deref(),
            l.audit.actor.as_str(),
            l.from_group.as_str(),
            l.edited,
            l.to_type.as_deref(),
            l.to_lane.as_deref()
        ),
        (Some("r-9"), "ops-alice", "g-old", false, None, None)
    );
    s.close().await.unwrap();
}

/// A version-10 database (no `redrive_messages`) gains the table: a broker
/// dead letter it held is redriven and counted in its redrive's report.
#[tokio::test]
async fn migrates_a_version_10_database_to_the_broker_messages_of_redrive_reports() {
    use lazaret_store_conformance::at;

    let dir = tempfile::TempDir::new().unwrap();
    let s = open(dir.path());
    let dl = s
        .quarantine_message(crate::postgres::broker_dead_letter())
        .await
        .unwrap()
        .id;
    s.close().await.unwrap();
    {
        let conn = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
        conn.execute_batch("DROP TABLE redrive_messages; PRAGMA user_version = 10;")
            .unwrap();
    }
    let s = open(dir.path());
    {
        let conn = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
    }
    let entry = s.audit(crate::postgres::redrive_entry()).await.unwrap();
    s.record_redrive("r-1".into(), entry).await.unwrap();
    assert!(
        s.redrove_message(dl, "r-1".into(), at(2), Some(entry))
            .await
            .unwrap()
    );
    let r = s.redrive_report("r-1".into()).await.unwrap().unwrap();
    assert_eq!((r.messages, r.running, r.audit.count), (1, 1, 1));
    s.close().await.unwrap();
}

/// A version-12 database (no `traceparent` columns) gains them: its jobs
/// and dead letters read as having no trace, and new jobs keep theirs.
#[tokio::test]
async fn migrates_a_version_12_database_to_traceparents() {
    use lazaret_core::{Event, TraceParent};
    use lazaret_store_conformance::{
        at, complete, enqueue_one, lease_one, lease_req, new_job, permanent,
    };

    let dir = tempfile::TempDir::new().unwrap();
    let s = open(dir.path());
    let old = enqueue_one(&s, new_job("resize", "acme", "default")).await;
    s.close().await.unwrap();
    {
        let conn = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
        conn.execute_batch(
            "ALTER TABLE jobs DROP COLUMN traceparent;
             ALTER TABLE dead_letters DROP COLUMN traceparent;
             PRAGMA user_version = 12;",
        )
        .unwrap();
    }
    let s = open(dir.path());
    {
        let conn = rusqlite::Connection::open(dir.path().join(DB_FILE)).unwrap();
        let version: i64 = conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
    }
    let leased = lease_one(&s, lease_req(at(10), 1)).await;
    assert_eq!((leased.id, leased.traceparent.clone()), (old, None));
    let done = complete(&s, &leased, Event::Failed(permanent()), at(20)).await;
    let dl = s
        .dead_letter(done.dead_letter.unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(dl.traceparent, None);
    let tp = TraceParent::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
    enqueue_one(
        &s,
        lazaret_store::NewJob {
            traceparent: Some(tp.clone()),
            ..new_job("resize", "acme", "default")
        },
    )
    .await;
    assert_eq!(
        lease_one(&s, lease_req(at(30), 1)).await.traceparent,
        Some(tp)
    );
    s.close().await.unwrap();
}

/// A version-7 database with more dead letters than the group migration
/// reads at a time: every dead letter gets its group (page after page),
/// and the groups' summary (version 12) is built from them, so the page of
/// groups counts them all, with their newest as sample and their tenants.
#[tokio::test]
async fn migrates_a_version_7_database_to_groups_computed_page_by_page_and_summarised() {
    use lazaret_store::{DeadLetterFilter, GroupQuery};
    use lazaret_store_conformance::at;

    let dir = tempfile::TempDir::new().unwrap();
    let path = dir.path().join(DB_FILE);
    let rows: i64 = 2_500;
    {
        let mut conn = rusqlite::Connection::open(&path).unwrap();
        conn.execute_batch(include_str!("fixtures/schema_v7.sql"))
            .unwrap();
        let tx = conn.transaction().unwrap();
        for i in 0..rows {
            // Three groups: the numbers in a message do not split one.
            let message = match i % 3 {
                0 => format!("order {i} failed"),
                1 => format!("cannot open /data/{i}.csv"),
                _ => "disk full".to_owned(),
            };
            let error = serde_json::to_string(
                &lazaret_core::Failure::new("bad_input", message)
                    .with_class(lazaret_core::FailureClass::Permanent),
            )
            .unwrap();
            tx.execute(
                "INSERT INTO dead_letters (type, tenant, reason, stage, attempts, error,
                   created_at, dead_lettered_at, payload_size, payload_preview)
                 VALUES ('resize', ?1, 'permanent', 'processing', 1, ?2, ?3, ?3, 2, '{}')",
                rusqlite::params![format!("tenant{}", i % 4), error, i],
            )
            .unwrap();
        }
        tx.commit().unwrap();
    }
    let s = open(dir.path());
    let version: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(version, SCHEMA_VERSION);
    let ungrouped: i64 = rusqlite::Connection::open(&path)
        .unwrap()
        .query_row(
            "SELECT COUNT(*) FROM dead_letters WHERE group_id = ''",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(ungrouped, 0, "every page of dead letters got its group");

    let (groups, next) = s
        .groups(GroupQuery {
            limit: 10,
            now: at(rows),
            ..GroupQuery::default()
        })
        .await
        .unwrap();
    assert_eq!(next, None);
    assert_eq!(groups.len(), 3);
    assert_eq!(groups.iter().map(|g| g.count).sum::<u64>(), rows as u64);
    for g in &groups {
        let (newest, _) = s
            .dead_letters(
                DeadLetterFilter {
                    group: Some(g.id.clone()),
                    ..DeadLetterFilter::default()
                },
                1,
                None,
            )
            .await
            .unwrap();
        assert_eq!(g.sample_id, newest[0].id, "the newest is the sample");
        assert_eq!(g.last_at, newest[0].dead_lettered_at);
        assert_eq!(
            g.tenants,
            ["tenant0", "tenant1", "tenant2", "tenant3"].map(String::from)
        );
    }
    let newest = &groups[0];
    assert_eq!(
        (newest.last_at, newest.count),
        (lazaret_core::Timestamp::from_millis(rows - 1), 834)
    );
    s.close().await.unwrap();
}
