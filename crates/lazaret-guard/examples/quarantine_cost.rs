//! What one dead-letter write costs the SQLite store, by how many dead
//! letters share it: the reason a guard's dead letters wait for company in
//! a poison storm (`QUARANTINE_LINGER`).
//!
//! ```text
//! cargo run --release -p lazaret-guard --example quarantine_cost \
//!     [-- --durability normal] [--dead-letters 4000]
//! ```
//!
//! For each batch size it writes `--dead-letters` dead letters like the
//! source bench's poison messages (a small JSON body, an envelope, a
//! RabbitMQ source), one batch after another into a fresh store, and
//! prints the wall time and the CPU each thread of this process spent per
//! dead letter (from `/proc/self/task`: the store's writer thread, its
//! fsync thread, and the caller).

#![allow(clippy::print_stdout)]

use std::collections::BTreeMap;
use std::error::Error;
use std::sync::Arc;
use std::time::Instant;

use lazaret_core::{
    DeadLetterReason, Envelope, Failure, FairScheduler, JobId, Policies, SchedulerConfig, Timestamp,
};
use lazaret_store::{
    Durability, PolicyDecider, SourceDeadLetter, SourceRef, SqliteStore, Stage, Store,
};

type Res<T> = Result<T, Box<dyn Error + Send + Sync>>;

/// Batch sizes measured, in this order.
const BATCHES: [usize; 5] = [1, 2, 4, 8, 16];

/// CPU ticks (user + system) of each thread of this process, summed by
/// thread name.
fn thread_ticks() -> Res<BTreeMap<String, u64>> {
    let mut ticks = BTreeMap::new();
    for task in std::fs::read_dir("/proc/self/task")? {
        let stat = std::fs::read_to_string(task?.path().join("stat"))?;
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_owned();
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let (Some(user), Some(system)) = (fields.get(11), fields.get(12)) else {
            continue;
        };
        *ticks.entry(name).or_insert(0) += user.parse::<u64>()? + system.parse::<u64>()?;
    }
    Ok(ticks)
}

/// A dead letter like the source bench's poison message `n`.
fn dead_letter(n: usize) -> SourceDeadLetter {
    let body = format!("{{\"poison\":true,\"n\":{n},\"pad\":\"lazaret source bench\"}}");
    let at = Timestamp::from_millis(1_700_000_000_000);
    let mut env = Envelope::new(
        JobId(0),
        "bench".into(),
        "default".into(),
        "default".into(),
        body.as_bytes(),
        at,
    );
    env.idempotency_key = Some(format!("bench:m-{n}"));
    let mut headers = serde_json::Map::new();
    headers.insert("x-delivery-count".into(), 0.into());
    SourceDeadLetter {
        source: SourceRef {
            name: "bench".into(),
            broker: "rabbitmq".into(),
            queue: "orders".into(),
            message_id: format!("m-{n}"),
            headers,
            position: serde_json::json!({"exchange": "", "routing_key": "orders"}),
            content_type: Some("application/json".into()),
            redrive_id: None,
        },
        job_type: Some("bench".into()),
        tenant: Some("default".into()),
        lane: Some("default".into()),
        reason: DeadLetterReason::Permanent,
        stage: Stage::Processing,
        attempts: 1,
        error: Some(Failure::new(
            "http_400",
            "the handler answered 400 Bad Request",
        )),
        idempotency_key: env.idempotency_key.clone(),
        created_at: at,
        envelope: Some(env),
        now: at,
        payload: body.into_bytes(),
        may_be_held: false,
    }
}

#[tokio::main]
async fn main() -> Res<()> {
    let mut durability = Durability::Full;
    let mut total = 4000usize;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--durability" => {
                durability = match value()?.as_str() {
                    "full" => Durability::Full,
                    "normal" => Durability::Normal,
                    other => return Err(format!("--durability full|normal, not {other:?}").into()),
                }
            }
            "--dead-letters" => total = value()?.parse()?,
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    println!("{total} dead letters per batch size, durability {durability:?}; µs per dead letter:");
    for batch in BATCHES {
        let dir = tempfile::tempdir()?;
        let store = SqliteStore::open(
            dir.path(),
            durability,
            FairScheduler::new(SchedulerConfig::new(1000))?,
            Arc::new(PolicyDecider::new(Policies::default())),
        )?;
        let before = thread_ticks()?;
        let started = Instant::now();
        let mut n = 0;
        while n < total {
            let dls = (n..n + batch).map(dead_letter).collect();
            store.quarantine_messages(dls).await?;
            n += batch;
        }
        let wall = started.elapsed();
        let after = thread_ticks()?;
        let per = |ticks: u64| ticks as f64 * 10_000.0 / n as f64; // USER_HZ 100
        let spent: Vec<(&String, u64)> = after
            .iter()
            .map(|(name, t)| {
                (
                    name,
                    t.saturating_sub(before.get(name).copied().unwrap_or(0)),
                )
            })
            .filter(|(_, t)| *t > 0)
            .collect();
        let cpu: Vec<String> = spent
            .iter()
            .map(|(name, t)| format!("{name} {:.0}", per(*t)))
            .collect();
        let all: u64 = spent.iter().map(|(_, t)| t).sum();
        println!(
            "  batch {batch:>2}: wall {:>5.0}, CPU {:>4.0} ({})",
            wall.as_secs_f64() * 1e6 / n as f64,
            per(all),
            cpu.join(", ")
        );
    }
    Ok(())
}
