//! The conformance suite against `PostgresStore`, each case in a schema of
//! its own (so cases run in parallel), plus what only PostgreSQL has: a
//! node whose clock runs ahead cannot steal a lease, two stores on one
//! schema never hold a job at once, wake-ups and switches through NOTIFY.
//!
//! Needs `LAZARET_TEST_PG_URL` (e.g. `postgres://postgres@127.0.0.1:5432/test`);
//! without it every case says it is skipped, and fails under `CI=true`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use lazaret_core::FairScheduler;
use lazaret_store::PostgresStore;
use lazaret_store::postgres::{Clock, PgOptions};
use lazaret_store_conformance::{Backend, Capabilities, scheduler_config, seeded_decider};

/// The PostgreSQL backend of the conformance suite.
#[derive(Debug)]
pub struct Postgres {
    url: String,
}

/// A schema of its own, dropped with everything in it at the end.
#[derive(Debug)]
pub struct Schema {
    url: String,
    pub name: String,
}

impl Drop for Schema {
    fn drop(&mut self) {
        let (url, name) = (self.url.clone(), self.name.clone());
        // Drop runs outside async: a thread with its own small runtime.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime");
            rt.block_on(async move {
                if let Ok((c, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                    tokio::spawn(conn);
                    // A store left holding locks (a test that failed while
                    // its writer hung) must not hang the test's end too.
                    let _ = c
                        .batch_execute(&format!(
                            "SET lock_timeout = '10s'; DROP SCHEMA IF EXISTS {name} CASCADE"
                        ))
                        .await;
                }
            });
        })
        .join();
    }
}

impl Backend for Postgres {
    type Store = PostgresStore;
    type Place = Schema;

    fn capabilities(&self) -> Capabilities {
        Capabilities::none()
            .with_group_commit_stats(true)
            .with_several_nodes(true)
    }

    async fn place(&self) -> Schema {
        fresh_schema(&self.url)
    }

    async fn open(&self, place: &Schema) -> PostgresStore {
        open(&place.url, &place.name, Clock::Caller).await
    }
}

/// A schema name no other test uses, in this run or a parallel one.
pub fn fresh_schema(url: &str) -> Schema {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    Schema {
        url: url.to_owned(),
        name: format!(
            "lz_test_{}_{}_{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ),
    }
}

/// Opens a store on `schema` with the suite's policy.
pub async fn open(url: &str, schema: &str, clock: Clock) -> PostgresStore {
    let scheduler = FairScheduler::new(scheduler_config()).expect("a valid scheduler config");
    PostgresStore::open(
        PgOptions {
            url: url.to_owned(),
            schema: schema.to_owned(),
            clock,
            tick_min: std::time::Duration::ZERO,
        },
        scheduler,
        Arc::new(seeded_decider()),
    )
    .await
    .expect("open the PostgreSQL store")
}

/// `LAZARET_TEST_PG_URL`, or `None` after saying the test is skipped (a
/// failure under `CI=true`).
pub fn url() -> Option<String> {
    lazaret_testkit::service(
        "LAZARET_TEST_PG_URL",
        "postgres://…",
        "this PostgreSQL store test",
    )
}

pub fn backend() -> Option<Postgres> {
    url().map(|url| Postgres { url })
}

lazaret_store_conformance::conformance_suite!(crate::postgres::backend);

/// What only a shared database has: two nodes on one schema.
mod cluster {
    use super::*;

    use std::time::Duration;

    use lazaret_core::{Event, JobState, Timestamp};
    use lazaret_store::{Store, StoreEvent, Switch};
    use lazaret_store_conformance::{complete, enqueue_one, job_view, lease, lease_req, new_job};

    /// The wall clock, as a node would read it.
    fn wall() -> Timestamp {
        Timestamp::from_millis(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("after 1970")
                .as_millis() as i64,
        )
    }

    /// Two nodes on one schema, on the database's clock.
    async fn two_nodes(url: &str) -> (Schema, PostgresStore, PostgresStore) {
        let schema = fresh_schema(url);
        let a = open(url, &schema.name, Clock::Database).await;
        let b = open(url, &schema.name, Clock::Database).await;
        (schema, a, b)
    }

    /// Failure groups written by one node are the same groups, with the
    /// same ids and counts, on the other, and after both restart.
    #[tokio::test]
    async fn failure_groups_are_the_same_on_every_node_and_after_a_restart() {
        let Some(url) = url() else { return };
        let (schema, a, b) = two_nodes(&url).await;
        for (n, message) in [
            (1, "order 17 has no amount"),
            (2, "order 9 has no amount"),
            (3, "disk full"),
        ] {
            let mut dl = super::broker_dead_letter();
            dl.source.message_id = format!("m-{n}");
            dl.error = Some(lazaret_core::Failure::new("http_400", message));
            dl.payload = format!("{{\"n\": {n}}}").into_bytes();
            // Written by each node in turn.
            let node = if n % 2 == 0 { &b } else { &a };
            node.quarantine_message(dl).await.unwrap();
        }
        let page = |s: &PostgresStore| {
            let s = s.clone();
            async move {
                let (groups, _) = s
                    .groups(lazaret_store::GroupQuery {
                        limit: 10,
                        now: wall(),
                        ..lazaret_store::GroupQuery::default()
                    })
                    .await
                    .unwrap();
                let mut seen: Vec<(String, u64, String)> = groups
                    .into_iter()
                    .map(|g| (g.id, g.count, g.fingerprint))
                    .collect();
                seen.sort();
                seen
            }
        };
        let on_a = page(&a).await;
        assert_eq!(on_a.len(), 2, "{on_a:?}");
        assert_eq!(
            on_a.iter().map(|g| g.1).sum::<u64>(),
            3,
            "the two orders share a group: {on_a:?}"
        );
        assert_eq!(page(&b).await, on_a, "the other node sees the same groups");
        a.close().await.unwrap();
        b.close().await.unwrap();
        let again = open(&url, &schema.name, Clock::Database).await;
        assert_eq!(page(&again).await, on_a, "and so does a restarted node");
        again.close().await.unwrap();
    }

    #[tokio::test]
    async fn a_node_whose_clock_runs_ahead_cannot_expire_another_nodes_lease() {
        let Some(url) = url() else { return };
        let (_schema, a, b) = two_nodes(&url).await;
        let now = wall();
        let id = enqueue_one(
            &a,
            lazaret_store::NewJob {
                run_at: now,
                now,
                ..new_job("resize", "acme", "default")
            },
        )
        .await;
        let job = lease(&a, lease_req(now, 1)).await.pop().expect("leased");
        // Node b's clock is an hour ahead: on its own clock the 30 s lease is
        // long over, but the lease's end is on the database's clock.
        let ahead = Timestamp::from_millis(now.as_millis() + 3_600_000);
        let tick = b.tick(ahead).await.unwrap();
        assert!(tick.expired.is_empty(), "{tick:?}");
        assert_eq!(job_view(&b, id).await.state, JobState::Leased);
        // Nor does b's clock decide an outcome's lateness: a's ack counts.
        let done = complete(&a, &job, Event::Succeeded, now).await;
        assert_eq!(done.id, id);
        assert_eq!(job_view(&b, id).await.state, JobState::Succeeded);
    }

    /// Groups in quick succession are timed from the last reading of the
    /// database's clock plus the time passed since (their statements go
    /// out with their `BEGIN`): still the database's clock, within its
    /// readings before and after, and never back, whatever the caller's.
    #[tokio::test]
    async fn groups_in_quick_succession_keep_the_databases_clock_and_never_go_back() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        let s = open(&url, &schema.name, Clock::Database).await;
        let db = client(&url).await;
        async fn db_now(db: &tokio_postgres::Client) -> i64 {
            db.query_one(
                "SELECT (extract(epoch FROM clock_timestamp()) * 1000)::int8",
                &[],
            )
            .await
            .unwrap()
            .get(0)
        }
        // The callers' clock is an hour behind: only durations come from it.
        let behind = Timestamp::from_millis(wall().as_millis() - 3_600_000);
        let jobs: Vec<_> = (0..40)
            .map(|i| lazaret_store::NewJob {
                run_at: behind,
                now: behind,
                ..new_job("resize", &format!("t-{i}"), "default")
            })
            .collect();
        s.enqueue(jobs).await.unwrap();
        let mut last = i64::MIN;
        for i in 0..40 {
            let before = db_now(&db).await;
            let job = lease(&s, lease_req(behind, 1)).await.pop().expect("leased");
            let after = db_now(&db).await;
            // A lease ends its length after the group's time.
            let at = job.lease_expires_at.as_millis()
                - i64::try_from(lazaret_store_conformance::LEASE.as_millis()).unwrap();
            // The estimate may run ahead by its reading's own delay (under a
            // millisecond on a quiet machine; a loaded one gets a second).
            assert!(
                at >= before - 2 && at <= after + 1000,
                "lease {i}: group time {at} outside the database's {before}..{after}"
            );
            assert!(
                at >= last,
                "lease {i}: group time went back from {last} to {at}"
            );
            last = at;
        }
        s.close().await.unwrap();
    }

    /// A group's successes go out before its other statements and their
    /// rows are read later: many of them (a batch of hundreds) must not
    /// fill the connection's answer channel and stall the enqueues sent
    /// behind them in the same group.
    #[tokio::test]
    async fn a_large_ack_batch_beside_an_enqueue_in_one_group_does_not_stall_the_writer() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        let s = open(&url, &schema.name, Clock::Database).await;
        let now = wall();
        let job = |i: usize| lazaret_store::NewJob {
            run_at: now,
            now,
            // Two jobs per tenant: under the suite's in-flight cap.
            ..new_job("resize", &format!("t-{}", i / 2), "default")
        };
        s.enqueue((0..800).map(job).collect()).await.unwrap();
        let mut leased = Vec::new();
        while leased.len() < 800 {
            let batch = lease(&s, lease_req(now, 800)).await;
            assert!(!batch.is_empty(), "800 jobs are queued");
            leased.extend(batch);
        }
        let items: Vec<lazaret_store::Completion> = leased
            .iter()
            .map(|j| lazaret_store::Completion {
                id: j.id,
                token: j.lease_token,
                event: Event::Succeeded,
            })
            .collect();
        // Sent together, so the writer takes both into one group.
        let both = async {
            tokio::join!(
                s.complete(items, now),
                s.enqueue((0..400).map(job).collect())
            )
        };
        let (done, enqueued) = tokio::time::timeout(Duration::from_secs(60), both)
            .await
            .expect("the writer answers within 60 s");
        let done = done.unwrap();
        assert_eq!(done.len(), 800);
        assert!(done.iter().all(Result::is_ok), "every ack applied");
        assert_eq!(enqueued.unwrap().len(), 400);
        s.close().await.unwrap();
    }

    #[tokio::test]
    async fn two_nodes_leasing_at_once_never_hand_out_a_job_twice() {
        let Some(url) = url() else { return };
        let (_schema, a, b) = two_nodes(&url).await;
        let now = wall();
        let jobs: Vec<_> = (0..300)
            .map(|i| lazaret_store::NewJob {
                run_at: now,
                now,
                ..new_job("resize", &format!("t-{}", i % 150), "default")
            })
            .collect();
        a.enqueue(jobs).await.unwrap();
        async fn drain(s: &PostgresStore, now: Timestamp) -> Vec<u64> {
            let mut got = Vec::new();
            for _ in 0..200 {
                let batch = lease(s, lease_req(now, 7)).await;
                assert!(batch.len() <= 7, "never more than asked: {}", batch.len());
                if batch.is_empty() {
                    break;
                }
                got.extend(batch.iter().map(|j| j.id.0));
            }
            got
        }
        let (mut from_a, from_b) = tokio::join!(drain(&a, now), drain(&b, now));
        assert!(
            !from_a.is_empty() && !from_b.is_empty(),
            "both nodes leased"
        );
        from_a.extend(from_b);
        let n = from_a.len();
        from_a.sort_unstable();
        from_a.dedup();
        assert_eq!(from_a.len(), n, "a job was leased by both nodes");
        // The cap (2 per tenant and lane) held across both: every job leased.
        assert_eq!(n, 300);
    }

    #[tokio::test]
    async fn a_tenants_cap_holds_across_nodes() {
        let Some(url) = url() else { return };
        let (_schema, a, b) = two_nodes(&url).await;
        let now = wall();
        let jobs: Vec<_> = (0..20)
            .map(|_| lazaret_store::NewJob {
                run_at: now,
                now,
                ..new_job("resize", "acme", "default")
            })
            .collect();
        a.enqueue(jobs).await.unwrap();
        let grab = |s: PostgresStore| async move {
            let mut n = 0;
            for _ in 0..20 {
                n += lease(&s, lease_req(now, 5)).await.len();
            }
            n
        };
        let (na, nb) = tokio::join!(grab(a.clone()), grab(b.clone()));
        assert_eq!(
            na + nb,
            lazaret_store_conformance::INFLIGHT_MAX as usize,
            "a: {na}, b: {nb}"
        );
    }

    #[tokio::test]
    async fn the_other_node_hears_of_ready_jobs_token_changes_and_switches() {
        let Some(url) = url() else { return };
        let (_schema, a, b) = two_nodes(&url).await;
        let mut events = b.events().expect("a shared store has events");
        async fn next(events: &mut tokio::sync::broadcast::Receiver<StoreEvent>) -> StoreEvent {
            tokio::time::timeout(Duration::from_secs(30), events.recv())
                .await
                .expect("an event within 30 s")
                .expect("the channel is open")
        }
        let now = wall();
        enqueue_one(
            &a,
            lazaret_store::NewJob {
                run_at: now,
                now,
                ..new_job("resize", "acme", "default")
            },
        )
        .await;
        assert_eq!(
            next(&mut events).await,
            StoreEvent::Ready {
                jobs: Some(vec![("default".into(), "resize".into())])
            }
        );

        let pause = Switch::PauseType {
            name: "resize".into(),
            paused: true,
        };
        a.publish(pause.clone()).await.unwrap();
        assert_eq!(next(&mut events).await, StoreEvent::Switch(pause.clone()));
        // Kept for a node that starts later, until resumed.
        assert_eq!(b.switches().await.unwrap(), vec![pause]);
        let resume = Switch::PauseType {
            name: "resize".into(),
            paused: false,
        };
        a.publish(resume.clone()).await.unwrap();
        assert_eq!(next(&mut events).await, StoreEvent::Switch(resume));
        assert_eq!(b.switches().await.unwrap(), vec![]);

        let entry = lazaret_store::AuditEntry {
            at: now,
            actor: "root".into(),
            action: "token_revoke".into(),
            request: serde_json::json!({}),
            count: 0,
        };
        assert!(!a.revoke_token("nobody".into(), entry).await.unwrap());
        let token = lazaret_store::ApiToken {
            name: "ci".into(),
            role: "worker".into(),
            token_sha256: "ab".repeat(32),
            created_at: now,
            created_by: "root".into(),
        };
        let entry = lazaret_store::AuditEntry {
            at: now,
            actor: "root".into(),
            action: "token_create".into(),
            request: serde_json::json!({}),
            count: 0,
        };
        a.create_token(token, entry).await.unwrap().unwrap();
        assert_eq!(next(&mut events).await, StoreEvent::TokensChanged);
    }

    #[tokio::test]
    async fn refuses_a_schema_from_a_newer_build() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        open(&url, &schema.name, Clock::Caller)
            .await
            .close()
            .await
            .unwrap();
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c.batch_execute(&format!(
            "UPDATE {}.lazaret_meta SET value = value + 1 WHERE key = 'schema_version'",
            schema.name
        ))
        .await
        .unwrap();
        let err = PostgresStore::open(
            PgOptions {
                url: url.clone(),
                schema: schema.name.clone(),
                clock: Clock::Caller,
                tick_min: Duration::ZERO,
            },
            FairScheduler::new(scheduler_config()).unwrap(),
            Arc::new(seeded_decider()),
        )
        .await
        .expect_err("a newer schema is refused");
        assert!(err.to_string().contains("newer than this build"), "{err}");
    }

    #[tokio::test]
    async fn the_store_connects_again_after_the_database_drops_its_connections() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        let s = open(&url, &schema.name, Clock::Database).await;
        let now = wall();
        let first = lazaret_store::NewJob {
            run_at: now,
            now,
            ..new_job("resize", "acme", "default")
        };
        enqueue_one(&s, first.clone()).await;
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let killed = c
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                &[&format!("lazaret/{}", schema.name)],
            )
            .await
            .unwrap();
        assert!(
            killed.len() >= 5,
            "the writer and the readers: {}",
            killed.len()
        );
        // The first calls may meet the closed connections; the store then
        // connects again, and goes on with everything committed before.
        let mut ok = false;
        for _ in 0..5 {
            if s.enqueue(vec![first.clone()]).await.is_ok() && s.stats().await.is_ok() {
                ok = true;
                break;
            }
        }
        assert!(ok, "the store never connected again");
        assert_eq!(s.failure(), None);
        let stats = s.stats().await.unwrap();
        assert_eq!(
            lazaret_store_conformance::lane_counts(&stats, "default").queued,
            2
        );
        assert_eq!(
            job_view(&s, lazaret_core::JobId(1)).await.state,
            JobState::Queued
        );
    }

    #[tokio::test]
    async fn answers_that_wait_for_a_lost_flush_say_their_outcome_is_unknown() {
        // The writer's commits do not wait for the disk; the flusher's do,
        // and only its flush lets an enqueue be answered. With the
        // flusher's connection cut, nothing vouches for the next group's
        // flush: its enqueue is committed but answered as unknown, never
        // as done. The flusher then connects again and the store goes on.
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        let s = open(&url, &schema.name, Clock::Database).await;
        let now = wall();
        let job = lazaret_store::NewJob {
            run_at: now,
            now,
            ..new_job("resize", "acme", "default")
        };
        enqueue_one(&s, job.clone()).await;
        let c = client(&url).await;
        let killed = c
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                &[&format!("lazaret/{}/flusher", schema.name)],
            )
            .await
            .unwrap();
        assert_eq!(killed.len(), 1, "the flusher");
        let err = s
            .enqueue(vec![job.clone()])
            .await
            .expect_err("no flush vouches for it");
        assert!(err.to_string().contains("outcome is unknown"), "{err}");
        enqueue_one(&s, job.clone()).await;
        assert_eq!(s.failure(), None);
        let stats = s.stats().await.unwrap();
        assert_eq!(
            lazaret_store_conformance::lane_counts(&stats, "default").queued,
            3,
            "the unknown enqueue was committed"
        );
    }

    /// A client of the test's own, outside the store.
    async fn client(url: &str) -> tokio_postgres::Client {
        let (c, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        c
    }

    /// The next event, within 30 s.
    async fn next(events: &mut tokio::sync::broadcast::Receiver<StoreEvent>) -> StoreEvent {
        tokio::time::timeout(Duration::from_secs(30), events.recv())
            .await
            .expect("an event within 30 s")
            .expect("the channel is open")
    }

    #[tokio::test]
    async fn the_listener_connects_again_and_hears_the_other_node_after_its_connection_drops() {
        let Some(url) = url() else { return };
        let (schema, a, b) = two_nodes(&url).await;
        let mut events = b.events().expect("a shared store has events");
        let c = client(&url).await;
        // A pause lifted while b cannot hear: b learns of it when it is back.
        let pause = |paused| Switch::PauseLane {
            name: "bulk".into(),
            paused,
        };
        a.publish(pause(true)).await.unwrap();
        assert_eq!(next(&mut events).await, StoreEvent::Switch(pause(true)));
        // Both nodes' listeners.
        let killed = c
            .query(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1",
                &[&format!("lazaret/{}/listener", schema.name)],
            )
            .await
            .unwrap();
        assert_eq!(killed.len(), 2, "both listeners");
        a.publish(pause(false)).await.unwrap();
        // Back, it says what it may have missed: tokens to reload, the
        // resume made while away, and every long-poll should look again.
        let want = [
            StoreEvent::TokensChanged,
            StoreEvent::Switch(pause(false)),
            StoreEvent::Ready { jobs: None },
        ];
        let mut heard = Vec::new();
        while !want.iter().all(|w| heard.contains(w)) {
            heard.push(next(&mut events).await);
        }
        // And it hears the other node again.
        let breaker = Switch::BreakerOpen {
            job_type: "resize".into(),
            kind: "timeout".into(),
            until_ms: wall().as_millis() + 60_000,
        };
        a.publish(breaker.clone()).await.unwrap();
        assert_eq!(next(&mut events).await, StoreEvent::Switch(breaker));
    }

    #[tokio::test]
    async fn a_full_command_queue_refuses_requests_but_never_housekeeping() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        let s = PostgresStore::open_bounded(
            PgOptions {
                url: url.clone(),
                schema: schema.name.clone(),
                clock: Clock::Caller,
                tick_min: Duration::ZERO,
            },
            FairScheduler::new(scheduler_config()).unwrap(),
            Arc::new(seeded_decider()),
            1,
        )
        .await
        .unwrap();
        // Hold the writer: its first enqueue waits for the table.
        let (c, watch) = (client(&url).await, client(&url).await);
        c.batch_execute(&format!(
            "BEGIN; LOCK TABLE {}.jobs IN ACCESS EXCLUSIVE MODE",
            schema.name
        ))
        .await
        .unwrap();
        let held = tokio::spawn({
            let s = s.clone();
            async move { s.enqueue(vec![new_job("resize", "acme", "default")]).await }
        });
        while s.commands_waiting() > 0 || !held_by_lock(&watch, &schema.name).await {
            tokio::task::yield_now().await;
        }
        // One waits (the bound), the next is refused at once.
        let queued = tokio::spawn({
            let s = s.clone();
            async move { s.enqueue(vec![new_job("resize", "acme", "default")]).await }
        });
        while s.commands_waiting() < 1 {
            tokio::task::yield_now().await;
        }
        let refused = s
            .enqueue(vec![new_job("resize", "acme", "default")])
            .await
            .expect_err("past the bound");
        assert!(
            matches!(
                refused,
                lazaret_store::StoreError::Overloaded { waiting: 1 }
            ),
            "{refused:?}"
        );
        // Housekeeping still gets in line.
        let tick = tokio::spawn({
            let s = s.clone();
            async move { s.tick(lazaret_store_conformance::at(0)).await }
        });
        while s.commands_waiting() < 2 {
            tokio::task::yield_now().await;
        }
        c.batch_execute("COMMIT").await.unwrap();
        held.await.unwrap().unwrap();
        queued.await.unwrap().unwrap();
        tick.await.unwrap().unwrap();
        assert_eq!(s.commands_waiting(), 0);
        s.enqueue(vec![new_job("resize", "acme", "default")])
            .await
            .unwrap();
    }

    /// Whether a session of `schema` waits for a lock.
    async fn held_by_lock(c: &tokio_postgres::Client, schema: &str) -> bool {
        let rows = c
            .query(
                "SELECT 1 FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
                &[&format!("lazaret/{schema}")],
            )
            .await
            .unwrap();
        !rows.is_empty()
    }
}

/// What a lease reads, counted by PostgreSQL's statistics.
mod reads {
    use super::*;

    use lazaret_core::JobType;
    use lazaret_store::Store;
    use lazaret_store_conformance::{at, lease, lease_req, new_job};

    /// Rows read from `jobs` (by index or by scan) since the schema was
    /// made, by sessions that have ended (a session's counts reach the
    /// statistics when it ends).
    async fn jobs_rows_read(c: &tokio_postgres::Client, schema: &str) -> i64 {
        let row = c
            .query_one(
                "SELECT (SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes
                          WHERE schemaname = $1 AND relname = 'jobs')::int8
                      + (SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_user_tables
                          WHERE schemaname = $1 AND relname = 'jobs')::int8",
                &[&schema],
            )
            .await
            .unwrap();
        row.get(0)
    }

    /// Closes the store and waits until its sessions have ended (and so
    /// reported what they read).
    async fn close(s: PostgresStore, c: &tokio_postgres::Client, schema: &str) {
        s.close().await.unwrap();
        drop(s);
        loop {
            let n: i64 = c
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name IN ($1, $2)",
                    &[
                        &format!("lazaret/{schema}"),
                        &format!("lazaret/{schema}/listener"),
                    ],
                )
                .await
                .unwrap()
                .get(0);
            if n == 0 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn a_lease_filtered_by_type_does_not_read_another_types_backlog() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        const BACKLOG: i64 = 10_000;
        let s = open(&url, &schema.name, Clock::Caller).await;
        for _ in 0..BACKLOG / 1_000 {
            let jobs = (0..1_000)
                .map(|_| new_job("bulk", "acme", "default"))
                .collect();
            s.enqueue(jobs).await.unwrap();
        }
        // Newer than every bulk job: an index without the type walks them all first.
        let email = |ms| lazaret_store::NewJob {
            run_at: at(ms),
            now: at(ms),
            ..new_job("email", "acme", "default")
        };
        s.enqueue(vec![email(1), email(2)]).await.unwrap();
        close(s, &c, &schema.name).await;
        let before = jobs_rows_read(&c, &schema.name).await;

        let s = open(&url, &schema.name, Clock::Caller).await;
        let asked = lease(
            &s,
            lazaret_store::LeaseRequest {
                types: Some(vec![JobType::from("email")]),
                ..lease_req(at(10), 1)
            },
        )
        .await;
        // A breaker open for bulk (or bulk paused): the lease leaves it out.
        let excluded = lease(
            &s,
            lazaret_store::LeaseRequest {
                exclude_types: vec![JobType::from("bulk")],
                ..lease_req(at(10), 1)
            },
        )
        .await;
        close(s, &c, &schema.name).await;
        let read = jobs_rows_read(&c, &schema.name).await - before;
        assert_eq!(asked.len(), 1);
        assert_eq!(asked[0].job_type.as_str(), "email");
        assert_eq!(excluded.len(), 1);
        assert_eq!(excluded[0].job_type.as_str(), "email");
        assert!(
            read < 100,
            "two leases of one email job each read {read} rows of jobs beside {BACKLOG} bulk jobs"
        );
    }
}

/// Upgrades of an older schema.
mod migration {
    use super::*;

    use lazaret_core::{Envelope, JobId};
    use lazaret_store::{Held, HeldRetry, MessageKey, SourceRef, Store};
    use lazaret_store_conformance::at;

    /// Takes schema `s` of this build back to version 4, where the held
    /// retries were `source_parked`.
    fn back_to_version_4(s: &str) -> String {
        format!(
            "ALTER TABLE {s}.source_held_retries RENAME CONSTRAINT source_held_retries_pkey TO source_parked_pkey;
             ALTER INDEX {s}.source_held_retries_due RENAME TO source_parked_due;
             ALTER TABLE {s}.source_held_retries RENAME TO source_parked;
             UPDATE {s}.lazaret_meta SET value = 4 WHERE key = 'schema_version';"
        )
    }

    /// A version-4 schema's held retries (`source_parked`) are found under
    /// the new name with their rows, index and primary key, and a retry
    /// whose envelope an older build wrote (`redrives`) keeps its count.
    #[tokio::test]
    async fn held_retries_of_a_version_4_schema_are_kept_under_their_new_name() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        open(&url, &schema.name, Clock::Caller)
            .await
            .close()
            .await
            .unwrap();
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let s = &schema.name;
        c.batch_execute(&back_to_version_4(s)).await.unwrap();

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
        c.execute(
            &format!(
                "INSERT INTO {s}.source_parked
                   (source, message_id, payload_sha256, redrive_id, due_at, ref, envelope, body)
                 VALUES ($1, $2, $3, '', $4, $5, $6, $7)"
            ),
            &[
                &held.source.name,
                &held.source.message_id,
                &hex::encode(lazaret_core::payload_sha256(&held.body)),
                &held.due_at.as_millis(),
                &serde_json::to_string(&held.source).unwrap(),
                &old_json.to_string(),
                &held.body,
            ],
        )
        .await
        .unwrap();

        let store = open(&url, &schema.name, Clock::Caller).await;
        let names = |kind: &'static str| {
            let c = &c;
            async move {
                let sql = match kind {
                    "table" => {
                        "SELECT table_name::text FROM information_schema.tables
                                WHERE table_schema = $1 AND table_name LIKE 'source_%' ORDER BY 1"
                    }
                    "index" => {
                        "SELECT indexname::text FROM pg_indexes
                                WHERE schemaname = $1 AND indexname LIKE 'source_%' ORDER BY 1"
                    }
                    _ => {
                        "SELECT constraint_name::text FROM information_schema.table_constraints
                          WHERE table_schema = $1 AND constraint_name LIKE 'source_%'
                            AND constraint_type = 'PRIMARY KEY' ORDER BY 1"
                    }
                };
                c.query(sql, &[&s.as_str()])
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| r.get::<_, String>(0))
                    .collect::<Vec<_>>()
            }
        };
        assert_eq!(names("table").await, ["source_held_retries"]);
        assert_eq!(
            names("index").await,
            ["source_held_retries_due", "source_held_retries_pkey"]
        );
        assert_eq!(names("constraint").await, ["source_held_retries_pkey"]);
        assert_eq!(
            store
                .due_held_retries("orders".into(), at(9), 5)
                .await
                .unwrap(),
            vec![held.clone()]
        );
        assert_eq!(store.message_held(held.key()).await.unwrap(), Held::Retry);
        assert_eq!(
            store
                .held_retry(held.key())
                .await
                .unwrap()
                .map(|h| h.envelope.redrive_count),
            Some(2)
        );
        assert!(store.release_held_retry(held.key()).await.unwrap());
        assert_eq!(store.message_held(held.key()).await.unwrap(), Held::Nothing);
        store.close().await.unwrap();
    }

    /// A version-3 schema's held retries (keyed by source and message id)
    /// keep their place under their full key, the redrive id taken from
    /// their source reference; another body under a held id is then held
    /// beside it.
    #[tokio::test]
    async fn held_retries_of_a_version_3_schema_are_keyed_by_payload() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        open(&url, &schema.name, Clock::Caller)
            .await
            .close()
            .await
            .unwrap();
        let held = |id: &str, redrive_id: Option<&str>, body: &[u8]| HeldRetry {
            source: SourceRef {
                name: "orders".into(),
                broker: "rabbitmq".into(),
                queue: "orders".into(),
                message_id: id.into(),
                headers: serde_json::Map::new(),
                position: serde_json::Value::Null,
                content_type: None,
                redrive_id: redrive_id.map(str::to_owned),
            },
            due_at: at(9),
            envelope: Envelope::new(
                JobId(0),
                "orders".into(),
                "acme".into(),
                "default".into(),
                body,
                at(1),
            ),
            body: body.to_vec(),
        };
        let (plain, copy) = (
            held("order-8", None, b"held"),
            held("order-9", Some("r-1"), b"held"),
        );
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let s = &schema.name;
        // Back to version 3's held retries.
        c.batch_execute(&format!(
            "{}
             ALTER TABLE {s}.source_parked DROP CONSTRAINT source_parked_pkey;
             ALTER TABLE {s}.source_parked DROP COLUMN payload_sha256, DROP COLUMN redrive_id;
             ALTER TABLE {s}.source_parked ADD PRIMARY KEY (source, message_id);
             UPDATE {s}.lazaret_meta SET value = 3 WHERE key = 'schema_version';",
            back_to_version_4(s)
        ))
        .await
        .unwrap();
        for p in [&plain, &copy] {
            c.execute(
                &format!(
                    "INSERT INTO {s}.source_parked (source, message_id, due_at, ref, envelope, body)
                     VALUES ($1, $2, $3, $4, $5, $6)"
                ),
                &[
                    &p.source.name,
                    &p.source.message_id,
                    &p.due_at.as_millis(),
                    &serde_json::to_string(&p.source).unwrap(),
                    &p.envelope.to_json(),
                    &p.body,
                ],
            )
            .await
            .unwrap();
        }

        let store = open(&url, &schema.name, Clock::Caller).await;
        assert_eq!(
            store
                .due_held_retries("orders".into(), at(9), 5)
                .await
                .unwrap(),
            vec![plain.clone(), copy.clone()]
        );
        for p in [&plain, &copy] {
            assert_eq!(store.message_held(p.key()).await.unwrap(), Held::Retry);
        }
        assert_eq!(
            store
                .message_held(MessageKey::of("orders", "order-9", b"held", None))
                .await
                .unwrap(),
            Held::Nothing,
            "the redrive id recorded in the source reference is part of the key"
        );
        let beside = held("order-8", None, b"another body");
        store.hold_retry(beside.clone()).await.unwrap();
        assert!(store.release_held_retry(plain.key()).await.unwrap());
        assert_eq!(store.message_held(beside.key()).await.unwrap(), Held::Retry);
        store.close().await.unwrap();
    }

    /// A version-6 schema's redrives (issue 30's reports) read in the
    /// lineage of their jobs after the migration to 7, as not edited and
    /// not redirected.
    #[tokio::test]
    async fn redrives_of_a_version_6_schema_read_in_the_lineage() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        open(&url, &schema.name, Clock::Caller)
            .await
            .close()
            .await
            .unwrap();
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let s = &schema.name;
        c.batch_execute(&format!(
            "DROP INDEX {s}.redrive_jobs_job;
             DROP INDEX {s}.redrives_audit;
             ALTER TABLE {s}.redrive_jobs DROP COLUMN edited, DROP COLUMN to_type, DROP COLUMN to_lane;
             INSERT INTO {s}.audit (id, at, actor, action, request, count)
               VALUES (4, 1000, 'ops-alice', 'redrive', '{{\"all\":true}}', 1);
             INSERT INTO {s}.redrives (id, audit_id) VALUES ('r-9', 4);
             INSERT INTO {s}.redrive_jobs (audit_id, job_id, from_group) VALUES (4, 12, 'g-old');
             UPDATE {s}.lazaret_meta SET value = 6 WHERE key = 'schema_version';"
        ))
        .await
        .unwrap();
        let store = open(&url, &schema.name, Clock::Caller).await;
        let version: i64 = c
            .query_one(
                &format!("SELECT value FROM {s}.lazaret_meta WHERE key = 'schema_version'"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(version, lazaret_store::postgres::SCHEMA_VERSION);
        let lineage = store.lineage(JobId(12)).await.unwrap();
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
        store.close().await.unwrap();
    }

    /// A version-7 schema (no `redrive_messages`) gains the table: a broker
    /// dead letter it held is redriven and counted in its redrive's report.
    #[tokio::test]
    async fn a_version_7_schema_gains_the_broker_messages_of_redrive_reports() {
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        let store = open(&url, &schema.name, Clock::Caller).await;
        let dl = store
            .quarantine_message(super::broker_dead_letter())
            .await
            .unwrap()
            .id;
        store.close().await.unwrap();
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let s = &schema.name;
        c.batch_execute(&format!(
            "DROP TABLE {s}.redrive_messages;
             UPDATE {s}.lazaret_meta SET value = 7 WHERE key = 'schema_version';"
        ))
        .await
        .unwrap();

        let store = open(&url, &schema.name, Clock::Caller).await;
        let version: i64 = c
            .query_one(
                &format!("SELECT value FROM {s}.lazaret_meta WHERE key = 'schema_version'"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(version, lazaret_store::postgres::SCHEMA_VERSION);
        let entry = store.audit(super::redrive_entry()).await.unwrap();
        store.record_redrive("r-1".into(), entry).await.unwrap();
        assert!(
            store
                .redrove_message(dl, "r-1".into(), at(2), Some(entry))
                .await
                .unwrap()
        );
        let r = store.redrive_report("r-1".into()).await.unwrap().unwrap();
        assert_eq!((r.messages, r.running, r.audit.count), (1, 1, 1));
        store.close().await.unwrap();
    }

    /// A version-8 schema's dead letters (grouped already, one archived)
    /// are summarised by the migration to version 9: the page of groups
    /// counts them all, active and archived apart, with the newest as
    /// sample and the tenants; the summary then follows new writes.
    #[tokio::test]
    async fn dead_letters_of_a_version_8_schema_are_summarised_into_their_groups() {
        use lazaret_store::{DeadLetterId, GroupQuery};
        let Some(url) = url() else { return };
        let schema = fresh_schema(&url);
        open(&url, &schema.name, Clock::Caller)
            .await
            .close()
            .await
            .unwrap();
        let (c, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        let s = &schema.name;
        c.batch_execute(&format!(
            "DROP TRIGGER dead_letter_groups_keep ON {s}.dead_letters;
             DROP FUNCTION {s}.dead_letter_groups_keep();
             DROP TABLE {s}.dead_letter_groups, {s}.dead_letter_group_names;
             UPDATE {s}.lazaret_meta SET value = 8 WHERE key = 'schema_version';
             INSERT INTO {s}.dead_letters (id, type, tenant, reason, stage, attempts, created_at,
                 dead_lettered_at, payload_size, payload_preview, group_id, fingerprint, archived_at)
             SELECT i, 'resize', 'tenant' || (i % 3), 'permanent', 'processing', 1, i, i / 2, 2, '{{}}',
                    'g' || (i % 2), 'f', CASE WHEN i = 7 THEN 100 END
             FROM generate_series(1, 10) i;"
        ))
        .await
        .unwrap();

        let store = open(&url, &schema.name, Clock::Caller).await;
        let ms = lazaret_core::Timestamp::from_millis;
        let query = |archived| GroupQuery {
            limit: 10,
            archived,
            now: at(10),
            ..GroupQuery::default()
        };
        let (active, _) = store.groups(query(false)).await.unwrap();
        let summary: Vec<_> = active
            .iter()
            .map(|g| (g.id.as_str(), g.count, g.first_at, g.last_at, g.sample_id))
            .collect();
        // g0: 2, 4, 6, 8, 10 (at i / 2); g1: 1, 3, 5, 9 (7 archived).
        assert_eq!(
            summary,
            [
                ("g0", 5, ms(1), ms(5), DeadLetterId(10)),
                ("g1", 4, ms(0), ms(4), DeadLetterId(9)),
            ]
        );
        assert_eq!(active[0].tenants, ["tenant0", "tenant1", "tenant2"]);
        let (archived, _) = store.groups(query(true)).await.unwrap();
        assert_eq!(
            archived
                .iter()
                .map(|g| (g.id.as_str(), g.count, g.sample_id))
                .collect::<Vec<_>>(),
            [("g1", 1, DeadLetterId(7))]
        );
        assert_eq!(archived[0].tenants, ["tenant1"]);

        // The trigger is back: a purge is seen.
        assert_eq!(store.purge(vec![DeadLetterId(10)], None).await.unwrap(), 1);
        let (active, _) = store.groups(query(false)).await.unwrap();
        assert_eq!(
            (active[0].id.as_str(), active[0].count, active[0].sample_id),
            ("g0", 4, DeadLetterId(8))
        );
        store.close().await.unwrap();
    }
}

/// A broker message's dead letter, for the migration tests.
pub fn broker_dead_letter() -> lazaret_store::SourceDeadLetter {
    use lazaret_store_conformance::at;
    lazaret_store::SourceDeadLetter {
        source: lazaret_store::SourceRef {
            name: "orders".into(),
            broker: "rabbitmq".into(),
            queue: "orders".into(),
            message_id: "order-1".into(),
            headers: serde_json::Map::new(),
            position: serde_json::Value::Null,
            content_type: None,
            redrive_id: None,
        },
        job_type: Some("orders".into()),
        tenant: Some("acme".into()),
        lane: Some("default".into()),
        reason: lazaret_core::DeadLetterReason::Exhausted,
        stage: lazaret_store::Stage::Processing,
        attempts: 1,
        error: Some(lazaret_core::Failure::new("http_400", "no amount")),
        envelope: None,
        idempotency_key: None,
        created_at: at(1),
        now: at(1),
        payload: b"{}".to_vec(),
        may_be_held: false,
    }
}

/// A redrive's audit entry, for the migration tests.
pub fn redrive_entry() -> lazaret_store::AuditEntry {
    lazaret_store::AuditEntry {
        at: lazaret_store_conformance::at(2),
        actor: "op".into(),
        action: "redrive".into(),
        request: serde_json::json!({}),
        count: 0,
    }
}
