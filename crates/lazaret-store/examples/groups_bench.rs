//! How long a page of failure groups takes (issue 30's target: 1,000,000
//! dead letters in 10,000 groups, a page under 50 ms at p99).
//!
//! ```sh
//! cargo run --release -p lazaret-store --example groups_bench -- sqlite 1000000 10000
//! cargo run --release -p lazaret-store --example groups_bench -- postgres://postgres@127.0.0.1/test 1000000 10000
//! # in a schema of your choice (created, filled, then dropped):
//! cargo run --release -p lazaret-store --example groups_bench -- 'postgres://postgres@127.0.0.1/test?schema=groups_bench' 1000000 10000
//! ```
//!
//! Fills a fresh store's `dead_letters` table directly (SQL, not the job
//! path: this measures the read; the schema's triggers keep the groups'
//! summary as they would on any write), then times the first page of
//! groups (50, as the API's default), one filtered by type, the next page
//! by cursor (each `RUNS` times), and pages filtered by tenant and by time
//! (`SLOW_RUNS` times: they count the dead letters that match), and
//! prints p50 and p99.

// A benchmark's output is what it is for.
#![allow(clippy::print_stdout)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use lazaret_core::{FairScheduler, SchedulerConfig, Timestamp};
use lazaret_store::{GroupQuery, PolicyDecider, Store};

const RUNS: usize = 200;
/// Runs of the filters that count dead letters (source, tenant, time).
const SLOW_RUNS: usize = 20;
const NOW: i64 = 1_800_000_000_000;

fn decider() -> Arc<PolicyDecider> {
    Arc::new(PolicyDecider::new(lazaret_core::Policies::default()))
}

fn scheduler() -> FairScheduler {
    FairScheduler::new(SchedulerConfig::new(2)).expect("a scheduler")
}

/// (group id, type, tenant, time) of dead letter `i` of `n` in `groups`.
fn row(i: u64, n: u64, groups: u64) -> (String, String, String, i64) {
    let g = i % groups;
    let id = lazaret_core::group_id(
        Some(&format!("t{}", g % 50)),
        "permanent",
        Some("k"),
        &format!("f{g}"),
        None,
    );
    // Spread over the last 24 hours.
    let at = NOW - ((n - i) as i64 * 86_400_000 / n as i64);
    (id, format!("t{}", g % 50), format!("tenant{}", i % 100), at)
}

async fn measure<S: Store>(s: &S, label: &str, q: GroupQuery) {
    measure_runs(s, label, q, RUNS).await;
}

async fn measure_runs<S: Store>(s: &S, label: &str, q: GroupQuery, runs: usize) {
    let mut times = Vec::with_capacity(runs);
    let mut groups = 0;
    for _ in 0..runs {
        let t = Instant::now();
        let (page, _) = s.groups(q.clone()).await.expect("groups");
        times.push(t.elapsed());
        groups = page.len();
    }
    times.sort();
    let p = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    println!(
        "{label:<32} {groups:>3} groups  p50 {:>8.2?}  p99 {:>8.2?}  max {:>8.2?}",
        p(0.50),
        p(0.99),
        times.last().copied().unwrap_or(Duration::ZERO)
    );
}

async fn run<S: Store>(s: &S) {
    let base = GroupQuery {
        limit: 50,
        now: Timestamp::from_millis(NOW),
        // As the server asks: each group's held count too.
        redrives_max: Some(3),
        ..GroupQuery::default()
    };
    measure(s, "first page", base.clone()).await;
    measure(
        s,
        "first page, type=t7",
        GroupQuery {
            job_type: Some("t7".into()),
            ..base.clone()
        },
    )
    .await;
    // Filters that change a group's count read the dead letters that
    // match (the slower path, fewer runs).
    measure_runs(
        s,
        "first page, tenant=tenant7",
        GroupQuery {
            tenant: Some("tenant7".into()),
            ..base.clone()
        },
        SLOW_RUNS,
    )
    .await;
    measure_runs(
        s,
        "first page, since=1h ago",
        GroupQuery {
            since: Some(Timestamp::from_millis(NOW - 3_600_000)),
            ..base.clone()
        },
        SLOW_RUNS,
    )
    .await;
    let (first, cursor) = s.groups(base.clone()).await.expect("groups");
    assert_eq!(first.len(), 50);
    measure(
        s,
        "second page (cursor)",
        GroupQuery {
            cursor,
            ..base.clone()
        },
    )
    .await;
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let target = args.get(1).map_or("sqlite", String::as_str).to_owned();
    let n: u64 = args
        .get(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1_000_000);
    let groups: u64 = args.get(3).and_then(|a| a.parse().ok()).unwrap_or(10_000);
    println!("{n} dead letters in {groups} groups on {target}");
    if target == "sqlite" {
        let dir = tempfile_dir();
        {
            let s = lazaret_store::SqliteStore::open(
                &dir,
                lazaret_store::Durability::Full,
                scheduler(),
                decider(),
            )
            .expect("open");
            s.close().await.expect("close");
        }
        let t = Instant::now();
        let mut c =
            rusqlite::Connection::open(dir.join(lazaret_store::sqlite::DB_FILE)).expect("db");
        let tx = c.transaction().expect("tx");
        {
            let mut ins = tx
                .prepare(
                    "INSERT INTO dead_letters (type, tenant, reason, stage, attempts, error, created_at,
                       dead_lettered_at, payload_size, payload_preview, group_id, fingerprint)
                     VALUES (?1, ?2, 'permanent', 'processing', 1, ?3, ?4, ?4, 2, '{}', ?5, ?6)",
                )
                .expect("insert");
            for i in 0..n {
                let (g, ty, tenant, at) = row(i, n, groups);
                let error = format!(
                    r#"{{"class":"permanent","kind":"k","message":"failure {} of {i}","traceback":null,"retry_after_ms":null}}"#,
                    i % groups
                );
                ins.execute(rusqlite::params![
                    ty,
                    tenant,
                    error,
                    at,
                    g,
                    format!("failure <n> of <n>")
                ])
                .expect("row");
            }
        }
        tx.commit().expect("commit");
        c.execute_batch("ANALYZE").expect("analyze");
        drop(c);
        println!("filled in {:.1?}", t.elapsed());
        let s = lazaret_store::SqliteStore::open(
            &dir,
            lazaret_store::Durability::Full,
            scheduler(),
            decider(),
        )
        .expect("open");
        run(&s).await;
        s.close().await.expect("close");
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        // `?schema=NAME` names the schema to fill (and drop at the end);
        // else one of this process's own.
        let (target, schema) = match target.split_once("?schema=") {
            Some((url, schema)) => (url.to_owned(), schema.to_owned()),
            None => (
                target.clone(),
                format!("lz_groups_bench_{}", std::process::id()),
            ),
        };
        let s = lazaret_store::PostgresStore::open(
            lazaret_store::PgOptions {
                url: target.clone(),
                schema: schema.clone(),
                clock: lazaret_store::postgres::Clock::Caller,
                tick_min: Duration::ZERO,
            },
            scheduler(),
            decider(),
        )
        .await
        .expect("open");
        let (c, conn) = tokio_postgres::connect(&target, tokio_postgres::NoTls)
            .await
            .expect("connect");
        tokio::spawn(conn);
        let t = Instant::now();
        // In chunks of 10,000 rows, generated by the database itself.
        let ids: Vec<String> = (0..groups).map(|g| row(g, n, groups).0).collect();
        c.batch_execute(&format!("SET search_path TO {schema}"))
            .await
            .expect("path");
        c.execute("CREATE TEMP TABLE g (n int8, id text)", &[])
            .await
            .expect("g");
        for (g, id) in ids.iter().enumerate() {
            c.execute("INSERT INTO g VALUES ($1, $2)", &[&(g as i64), id])
                .await
                .expect("g row");
        }
        c.execute(
            "INSERT INTO dead_letters (type, tenant, reason, stage, attempts, error, created_at,
               dead_lettered_at, payload_size, payload_preview, group_id, fingerprint)
             SELECT 't' || (i % $2::int8 % 50), 'tenant' || (i % 100), 'permanent', 'processing', 1,
               '{\"class\":\"permanent\",\"kind\":\"k\",\"message\":\"failure ' || (i % $2::int8) || ' of ' || i || '\",\"traceback\":null,\"retry_after_ms\":null}',
               $3::int8 - (($1::int8 - i) * 86400000 / $1::int8), $3::int8 - (($1::int8 - i) * 86400000 / $1::int8), 2, '{}', g.id, 'failure <n> of <n>'
             FROM generate_series(0::int8, $1::int8 - 1) i JOIN g ON g.n = i % $2::int8",
            &[&(n as i64), &(groups as i64), &NOW],
        )
        .await
        .expect("fill");
        c.batch_execute("ANALYZE dead_letters")
            .await
            .expect("analyze");
        println!("filled in {:.1?}", t.elapsed());
        run(&s).await;
        s.close().await.expect("close");
        c.batch_execute(&format!("DROP SCHEMA {schema} CASCADE"))
            .await
            .expect("drop");
    }
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("lz-groups-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    dir
}
