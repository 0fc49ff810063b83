//! Guarded messages per second through one node and through two nodes of
//! `lazaret serve`, sharing one PostgreSQL schema and guarding one
//! RabbitMQ quorum queue, with a handler that takes `--handler-ms` per
//! message (issue 27: two nodes at least 1.7× one, no duplicate).
//!
//! Each run fills a fresh queue with `--messages` messages first, then
//! starts the nodes; the rate is measured between the 10th and the 90th
//! percentile of the messages handled (so the nodes' start-up, and the
//! second node joining a little later, are not in it). Runs alternate
//! between one and two nodes so that the machine's drift hits both.
//!
//! ```sh
//! cargo build --release -p lazaret --example guard_nodes --bin lazaret
//! target/release/examples/guard_nodes --rounds 3 --messages 20000 --handler-ms 5 --concurrency 8
//! ```
//!
//! RabbitMQ and PostgreSQL come from `LAZARET_TEST_AMQP_URL` and
//! `LAZARET_TEST_PG_URL` (defaults: the local ones of `.ci/run`).

// A benchmark's report is its standard output.
#![allow(clippy::print_stdout)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};

/// The handler's record: when each call came, per message id.
#[derive(Default)]
struct Seen {
    calls: HashMap<String, u32>,
    /// When each message was first handled, in order.
    firsts: Vec<Instant>,
}

/// Guarded messages per second through one node and through two.
#[derive(clap::Parser)]
struct Args {
    /// The `lazaret` binary the nodes run.
    #[arg(long, default_value = "target/release/lazaret")]
    bin: String,
    /// RabbitMQ.
    #[arg(
        long,
        env = "LAZARET_TEST_AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp: String,
    /// PostgreSQL (each run gets a schema of its own, dropped after).
    #[arg(
        long,
        env = "LAZARET_TEST_PG_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pg: String,
    /// Messages a run.
    #[arg(long, default_value_t = 20_000)]
    messages: usize,
    /// Rounds, each one run of one node and one of two.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Handler calls in flight a node (the source's `concurrency`).
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// How long the handler takes a message.
    #[arg(long, default_value_t = 5)]
    handler_ms: u64,
}

#[tokio::main]
async fn main() {
    let a = <Args as clap::Parser>::parse();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let deliver = handler(Arc::clone(&seen), a.handler_ms).await;
    let mut rates: HashMap<usize, Vec<f64>> = HashMap::new();
    let mut duplicates = 0u64;
    println!(
        "{} messages a run, handler {} ms, concurrency {} a node",
        a.messages, a.handler_ms, a.concurrency
    );
    for round in 0..a.rounds {
        for nodes in [1usize, 2] {
            *seen.lock().unwrap() = Seen::default();
            let (rate, dup) = run(&a, &deliver, &seen, nodes).await;
            println!("round {round}, {nodes} node(s): {rate:.0} msg/s, {dup} duplicate calls");
            rates.entry(nodes).or_default().push(rate);
            duplicates += dup;
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let one = median(rates.get_mut(&1).expect("runs of one node"));
    let two = median(rates.get_mut(&2).expect("runs of two nodes"));
    println!(
        "median: one node {one:.0} msg/s, two nodes {two:.0} msg/s, ratio {:.2}; duplicate calls in all runs: {duplicates}",
        two / one
    );
}

/// A handler taking `ms` per call and recording each.
async fn handler(seen: Arc<Mutex<Seen>>, ms: u64) -> String {
    async fn handle(
        State((seen, ms)): State<(Arc<Mutex<Seen>>, u64)>,
        headers: HeaderMap,
    ) -> StatusCode {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        let id = headers
            .get("lazaret-message-id")
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned();
        let mut s = seen.lock().unwrap();
        let n = s.calls.entry(id).or_insert(0);
        *n += 1;
        if *n == 1 {
            s.firsts.push(Instant::now());
        }
        StatusCode::NO_CONTENT
    }
    let app = Router::new()
        .route("/h", post(handle))
        .with_state((seen, ms));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the handler");
    let addr = listener.local_addr().expect("its address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/h")
}

/// One run: a fresh queue of `a.messages`, then `nodes` nodes on a fresh
/// schema; returns (messages/s between the 10th and 90th percentile,
/// duplicate handler calls).
async fn run(a: &Args, deliver: &str, seen: &Arc<Mutex<Seen>>, nodes: usize) -> (f64, u64) {
    let props = lapin::ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current());
    let conn = lapin::Connection::connect(&a.amqp, props)
        .await
        .unwrap_or_else(|e| panic!("connect to RabbitMQ at {}: {e}", a.amqp));
    let ch = conn.create_channel().await.expect("a channel");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirms");
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let queue = format!("lz-bench-nodes-{}-{stamp}", std::process::id());
    let mut qargs = FieldTable::default();
    qargs.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    qargs.insert("x-expires".into(), AMQPValue::LongInt(15 * 60 * 1000));
    ch.queue_declare(
        &queue,
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        qargs,
    )
    .await
    .expect("declare the queue");
    let mut confirms = Vec::with_capacity(a.messages);
    for i in 0..a.messages {
        confirms.push(
            ch.basic_publish(
                "",
                &queue,
                BasicPublishOptions::default(),
                format!("{{\"n\": {i}}}").as_bytes(),
                lapin::BasicProperties::default().with_message_id(format!("b-{i}").into()),
            )
            .await
            .expect("publish"),
        );
    }
    for c in confirms {
        c.await.expect("confirmed");
    }

    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = dir.path().join("lazaret.toml");
    std::fs::write(
        &config,
        format!(
            "[[sources]]\nname = \"bench\"\nbroker = \"rabbitmq\"\nurl = \"{}\"\nqueue = \"{queue}\"\ndeliver = \"{deliver}\"\nconcurrency = {}\n",
            a.amqp, a.concurrency
        ),
    )
    .expect("config written");
    let schema = format!("lz_bench_nodes_{}_{stamp}", std::process::id());
    let sep = if a.pg.contains('?') { '&' } else { '?' };
    let store = format!("{}{sep}schema={schema}", a.pg);
    let mut children: Vec<Child> = (0..nodes)
        .map(|_| {
            let mut child = Command::new(&a.bin)
                .args(["serve", "--listen", "127.0.0.1:0", "--store", &store])
                .arg("--config")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("start {}: {e} (build it first)", a.bin));
            let stdout = child.stdout.take().expect("piped stdout");
            std::thread::spawn(move || for _ in BufReader::new(stdout).lines() {});
            child
        })
        .collect();

    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let done = seen.lock().unwrap().firsts.len() >= a.messages;
        if done {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the run did not end in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Late duplicates of the last messages would show within a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for c in &mut children {
        let _ = c.kill();
        let _ = c.wait();
    }
    let (rate, dup) = {
        let s = seen.lock().unwrap();
        let (lo, hi) = (a.messages / 10, a.messages * 9 / 10);
        let took = s.firsts[hi].duration_since(s.firsts[lo]).as_secs_f64();
        let calls: u64 = s.calls.values().map(|&n| u64::from(n)).sum();
        ((hi - lo) as f64 / took, calls - s.calls.len() as u64)
    };

    let _ = ch
        .queue_delete(&queue, lapin::options::QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "bye").await;
    if let Ok((c, connection)) = tokio_postgres::connect(&a.pg, tokio_postgres::NoTls).await {
        tokio::spawn(connection);
        let _ = c
            .batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"))
            .await;
    }
    let _ = std::io::stdout().flush();
    (rate, dup)
}
