//! kill -9 of guard nodes (issue 29 part 3): two `lazaret serve` nodes (one
//! on Kafka, see its test) on
//! one PostgreSQL store guard one broker queue while the battery kills
//! them, one at a time, at random moments and at the guard's fail points
//! (`lazaret_guard::failpoint`: after a dead letter's commit before the
//! broker ack, after a redrive's republish before the store forgets the
//! dead letter, after a held retry's handler answered before the store
//! records its outcome and releases its claim, after a Kafka offset commit
//! before the next poll), each killed node started again at once.
//!
//! Each cycle publishes a batch (most succeed, some fail once
//! transiently and are held as retries, some are poison: dead-lettered,
//! then redriven by the battery and accepted, as after a fix), then kills
//! a node: one whose start armed a fail point (`LAZARET_FAILPOINTS`) is
//! driven until it dies there (killed at random if it never gets there
//! within a bound), any other gets `kill -9` after a random wait. Every
//! publish, handler call, redrive and kill goes into a history
//! (`lazaret_testkit::history`); after the last cycle the nodes run
//! unarmed until every message is handled or dead-lettered, the dead
//! letters are read back, and the checker must find nothing lost, no dead
//! letter twice in one generation, no unexplained duplicate (those a kill
//! explains are counted, at-least-once allows them).
//!
//! The binary is the one `cargo test` builds, which has the fail points
//! (the `lazaret` package's dev-dependency turns on `lazaret-guard`'s
//! `failpoints` feature; a release build has none, `.ci/run` checks it).
//! Its own queue and schema, so it runs beside the other tests.
//! `LAZARET_KILL9_CYCLES` (RabbitMQ, default 8) and
//! `LAZARET_KILL9_KAFKA_CYCLES` (default 4: each kill costs the Kafka
//! group's 10 s session timeout) set the cycles, `LAZARET_KILL9_SEED`
//! replays a run's choices. See docs/reliability.md, "kill -9 of guard
//! nodes", for the 300-cycle command and the last results.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use lazaret_testkit::history::{AnomalyKind, Handled, Op, Recorder, payload_hash};
use serde_json::{Value, json};

use crate::brokers::{Kind, Queue};
use crate::harness::{PgSchema, QUICK};
use crate::team_handler::percent_decode;

/// Messages published per cycle.
const BATCH: usize = 12;
/// How long an armed node is driven towards its fail point before it is
/// killed at random instead.
const ARMED_WAIT: Duration = Duration::from_secs(8);
/// How long the drain after the last cycle may take: a held retry claimed
/// by a killed node waits out its claim (`delivery_timeout_ms` + 10 s), a
/// Kafka partition its group's session timeout.
const DRAIN: Duration = Duration::from_secs(120);

fn cycles(var: &str, default: u32) -> u32 {
    std::env::var(var)
        .ok()
        .map(|s| s.parse().unwrap_or_else(|_| panic!("{var} is a number")))
        .unwrap_or(default)
}

/// What the handler saw: the history, and per message id whether its
/// last call succeeded.
#[derive(Clone)]
struct Seen {
    history: Recorder,
    inner: Arc<Mutex<SeenInner>>,
}

#[derive(Default)]
struct SeenInner {
    /// Ids whose latest call succeeded.
    succeeded: BTreeSet<String>,
    /// (message id, redrive id) pairs seen: a new one starts a generation.
    redrives: BTreeSet<(String, String)>,
    /// Handler calls so far.
    calls: u64,
    /// A counter for the handler's small random delays.
    tick: u64,
}

impl Seen {
    fn lock(&self) -> std::sync::MutexGuard<'_, SeenInner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The team's handler, at `/{node}`: `ok-*` succeeds, `flaky-*` fails its
/// first attempt with a 503 (held as a retry), `poison-*` is refused with
/// a 422 (dead-lettered) unless it is a redriven copy, which succeeds.
async fn handle(
    State(seen): State<Seen>,
    UrlPath(node): UrlPath<String>,
    headers: HeaderMap,
    body: Bytes,
) -> StatusCode {
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let id = percent_decode(&header("lazaret-message-id"));
    let attempt: u32 = header("lazaret-attempt").parse().unwrap_or(0);
    let broker_headers: Value =
        serde_json::from_str(&header("lazaret-headers")).unwrap_or_default();
    let redrive = broker_headers[lazaret_guard::REDRIVE_ID_HEADER]
        .as_str()
        .map(str::to_owned);
    let delay = {
        let mut s = seen.lock();
        s.calls += 1;
        s.tick = s
            .tick
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1);
        if let Some(r) = &redrive {
            // The first call of a redriven copy shows the redrive took
            // effect: a new generation of the id starts here.
            if s.redrives.insert((id.clone(), r.clone())) {
                seen.history.observe(Op::Redrive { id: id.clone() });
                s.succeeded.remove(&id);
            }
        }
        Duration::from_millis((s.tick >> 33) % 25)
    };
    let call = seen.history.invoke(Op::deliver(
        id.clone(),
        attempt,
        node,
        false,
        Some(payload_hash(&body)),
    ));
    tokio::time::sleep(delay).await;
    let (handled, status) = if id.starts_with("poison-") && redrive.is_none() {
        (Handled::Permanent, StatusCode::UNPROCESSABLE_ENTITY)
    } else if id.starts_with("flaky-") && attempt <= 1 {
        (Handled::Transient, StatusCode::SERVICE_UNAVAILABLE)
    } else {
        (Handled::Success, StatusCode::NO_CONTENT)
    };
    {
        let mut s = seen.lock();
        if handled == Handled::Success {
            s.succeeded.insert(id);
        } else {
            s.succeeded.remove(&id);
        }
    }
    call.handled(handled);
    status
}

/// A `lazaret serve` node of this battery: killed with `kill -9` (or by
/// a fail point) and started again, on the shared schema.
struct Node {
    name: &'static str,
    root: PathBuf,
    store: String,
    child: Option<Child>,
    base: String,
    starts: u32,
    /// The fail point its current run armed, if any.
    armed: Option<&'static str>,
}

impl Node {
    fn new(name: &'static str, root: &Path, store: String) -> Node {
        Node {
            name,
            root: root.to_owned(),
            store,
            child: None,
            base: String::new(),
            starts: 0,
            armed: None,
        }
    }

    fn run(&self) -> String {
        format!("{}-{}", self.name, self.starts)
    }

    fn output(&self) -> String {
        let read = |f: String| std::fs::read_to_string(self.root.join(f)).unwrap_or_default();
        format!(
            "{}{}",
            read(format!("stdout-{}.log", self.run())),
            read(format!("server-{}.log", self.run()))
        )
    }

    /// Starts it, with `failpoints` (`LAZARET_FAILPOINTS`) when armed;
    /// waits for its address.
    fn start(&mut self, failpoints: Option<(&'static str, u64)>) {
        assert!(self.child.is_none(), "{} is running", self.name);
        self.starts += 1;
        let run = self.run();
        let log = std::fs::File::create(self.root.join(format!("server-{run}.log"))).expect("log");
        // LAZARET_KILL9_BIN: a copy of the binary, so a long run goes on
        // while cargo builds another into the target directory.
        let bin = std::env::var_os("LAZARET_KILL9_BIN").map_or_else(
            || PathBuf::from(env!("CARGO_BIN_EXE_lazaret")),
            PathBuf::from,
        );
        let mut command = Command::new(bin);
        command
            .arg("serve")
            .args([
                "--listen",
                "127.0.0.1:0",
                "--store",
                &self.store,
                "--config",
            ])
            .arg(self.root.join("lazaret.toml"))
            .env_remove(lazaret_guard::failpoint::FAILPOINTS_VAR)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log));
        self.armed = failpoints.map(|(p, _)| p);
        if let Some((point, hit)) = failpoints {
            command.env(
                lazaret_guard::failpoint::FAILPOINTS_VAR,
                format!("{point}={hit}"),
            );
        }
        let mut child = command.spawn().expect("lazaret starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        let mut rest =
            std::fs::File::create(self.root.join(format!("stdout-{run}.log"))).expect("stdout");
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next().and_then(Result::ok));
            for line in lines.map_while(Result::ok) {
                let _ = writeln!(rest, "{line}");
            }
        });
        self.child = Some(child);
        let first = tokio::task::block_in_place(|| rx.recv_timeout(Duration::from_secs(30)))
            .ok()
            .flatten()
            .unwrap_or_else(|| panic!("{run}: no first line; it printed:\n{}", self.output()));
        self.base = first
            .strip_prefix("lazaret listening on ")
            .unwrap_or_else(|| panic!("{run}: unexpected first line {first:?}"))
            .trim()
            .trim_end_matches('/')
            .to_owned();
        if failpoints.is_some() {
            // A build without fail points would never die at one: the
            // battery would pass while testing nothing.
            let deadline = Instant::now() + Duration::from_secs(10);
            while !self.output().contains("lazaret failpoints armed:") {
                assert!(
                    Instant::now() < deadline,
                    "{run}: the binary did not arm LAZARET_FAILPOINTS (built without lazaret-guard's `failpoints` feature?); it printed:\n{}",
                    self.output()
                );
                tokio::task::block_in_place(|| std::thread::sleep(Duration::from_millis(20)));
            }
        }
    }

    /// Whether the process is gone (a fail point killed it).
    fn dead(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| c.try_wait().expect("child status").is_some())
    }

    /// Whether its last run died at its fail point (its log says so).
    fn died_at_fail_point(&self) -> bool {
        self.output().contains("): killing the process (kill -9)")
    }

    /// `kill -9` (a no-op on a process already gone), and waits for it.
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until its source takes messages; `false` if it died first
    /// (armed, it may reach its fail point before that).
    async fn ready(&mut self, queue: &Queue) -> bool {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let out = self.output();
            // On Kafka, in the group: a restarted node may hold no
            // partition until the group rebalances again (the other took
            // them while it was dead), as tansu's coordinator assigns.
            let ready = match queue.kind {
                Kind::Kafka => out.contains("the group assigned this node partitions"),
                _ => queue.ready(&out),
            };
            if ready {
                return true;
            }
            if self.dead() {
                return false;
            }
            assert!(
                Instant::now() < deadline,
                "{}: the source never became ready:\n{}",
                self.run(),
                self.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The numbers a run reports.
#[derive(Debug, Default)]
struct Tally {
    published: usize,
    random_kills: usize,
    fail_point_kills: BTreeMap<&'static str, usize>,
    /// Armed nodes that never reached their point within `ARMED_WAIT`
    /// (then killed at random).
    fail_point_missed: usize,
    redrive_requests: usize,
}

/// Every dead letter of source `orders` (all pages).
async fn dead_letters(http: &reqwest::Client, base: &str) -> Option<Vec<Value>> {
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut url = format!("{base}/v1/dead-letters?source=orders&limit=500");
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let page: Value = http.get(&url).send().await.ok()?.json().await.ok()?;
        out.extend(page["items"].as_array()?.iter().cloned());
        match page["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_owned()),
            None => return Some(out),
        }
    }
}

/// A dead letter as the history records it: (message id, dead letter id,
/// has history, has payload, payload hash); `None` if the node is gone.
async fn dead_letter_op(
    http: &reqwest::Client,
    base: &str,
    dl: &Value,
) -> Option<(String, String, bool, bool, Option<u64>)> {
    let id = crate::harness::id_text(&dl["id"]);
    let message = dl["source"]["message_id"].as_str()?.to_owned();
    let history = dl["history"].as_array().is_some_and(|h| !h.is_empty());
    let reply = http
        .get(format!("{base}/v1/dead-letters/{id}/payload"))
        .send()
        .await
        .ok()?;
    let ok = reply.status() == 200;
    let bytes = reply.bytes().await.ok()?;
    let hash = ok.then(|| payload_hash(&bytes));
    Some((message, id, history, ok, hash))
}

/// Records the dead letters a node lists now that are not recorded yet
/// (their generation is the one before any redrive of them), and redrives
/// them through `base`; a node that dies meanwhile answers nothing.
async fn redrive(
    http: &reqwest::Client,
    base: &str,
    history: &Recorder,
    recorded: &mut BTreeSet<String>,
) -> usize {
    let Some(dls) = dead_letters(http, base).await else {
        return 0;
    };
    let mut ids = Vec::new();
    for dl in &dls {
        let Some((message, dl_id, has_history, has_payload, hash)) =
            dead_letter_op(http, base, dl).await
        else {
            return 0;
        };
        if recorded.insert(dl_id.clone()) {
            history.observe(Op::DeadLetter {
                id: message,
                dead_letter_id: dl_id.clone(),
                has_history,
                has_payload,
                payload_hash: hash,
            });
        }
        ids.push(dl_id);
    }
    if ids.is_empty() {
        return 0;
    }
    let _ = http
        .post(format!("{base}/v1/dead-letters/redrive"))
        .json(&json!({ "ids": ids }))
        .send()
        .await;
    ids.len()
}

/// Publishes one message of `kind` (`ok`, `flaky`, `poison`), recorded.
async fn publish(queue: &Queue, history: &Recorder, tally: &mut Tally, kind: &str, tag: &str) {
    let id = format!("{kind}-{tag}");
    let body = format!("{{\"tag\": \"{tag}\", \"kind\": \"{kind}\"}}");
    let call = history.invoke(Op::Publish {
        id: id.clone(),
        payload_hash: payload_hash(body.as_bytes()),
    });
    queue.publish(&id, &body).await;
    call.ok();
    tally.published += 1;
}

/// The message kind that drives a node towards fail point `point`.
fn feeds(point: &str) -> &'static str {
    match point {
        "guard::after_dead_letter_commit" | "guard::redrive_after_publish" => "poison",
        "guard::held_retry_before_outcome" => "flaky",
        _ => "ok",
    }
}

/// The battery on `kind` with `nodes` nodes (1 or 2): `cycles` kills,
/// the fail points `points` armed in turn.
async fn battery(kind: Kind, test: &str, nodes: usize, cycles: u32, points: &[&'static str]) {
    let Some(pg) = crate::harness::pg_url() else {
        return;
    };
    let Some(queue) = Queue::fresh(kind, "kill9", 2, test).await else {
        return;
    };
    let seed = crate::harness::seed_from("LAZARET_KILL9_SEED");
    eprintln!(
        "{test}: seed {seed} (LAZARET_KILL9_SEED={seed} replays its choices), {cycles} cycles"
    );
    let mut rng = crate::harness::Rng(seed);
    let history = Recorder::new();
    let seen = Seen {
        history: history.clone(),
        inner: Arc::default(),
    };
    let deliver = crate::harness::serve_app(
        Router::new()
            .route("/{node}", post(handle))
            .with_state(seen.clone()),
    )
    .await;
    let root = tempfile::tempdir().expect("a temporary directory");
    let schema = PgSchema::fresh(&pg);
    // Each node its own path on the handler, so that a call names its node.
    let mut nodes: Vec<Node> = ["a", "b"][..nodes]
        .iter()
        .map(|&name| {
            let dir = root.path().join(name);
            std::fs::create_dir_all(&dir).expect("node dir");
            std::fs::write(
                dir.join("lazaret.toml"),
                format!(
                    r#"{QUICK}
[types.orders]
attempts_max = 5
backoff_base_ms = 200
backoff_floor_ms = 200
backoff_cap_ms = 400

[[sources]]
name = "orders"
{keys}deliver = "{deliver}/{name}"
type = "orders"
concurrency = 8
delivery_timeout_ms = 2000
"#,
                    keys = queue.source_keys()
                ),
            )
            .expect("config written");
            Node::new(name, &dir, schema.store_url())
        })
        .collect();
    for n in &mut nodes {
        n.start(None);
        assert!(n.ready(&queue).await, "{} died unarmed", n.name);
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("an HTTP client");
    let mut tally = Tally::default();
    let mut recorded_dls = BTreeSet::new();
    let mut next_point = 0usize;
    let mut extra = 0u64;
    // A node's death as a fault: from the kill (or, for an armed life,
    // from its start: it may die at its point any time) to its restart.
    let mut armed_faults: Vec<Option<lazaret_testkit::history::Pending>> =
        nodes.iter().map(|_| None).collect();
    for cycle in 0..cycles {
        for i in 0..BATCH {
            let kind = match rng.below(20) {
                0..=11 => "ok",
                12..=16 => "flaky",
                _ => "poison",
            };
            publish(&queue, &history, &mut tally, kind, &format!("{cycle}-{i}")).await;
        }
        let v = cycle as usize % nodes.len();
        let fault = match armed_faults[v].take() {
            Some(f) => f,
            None => history.invoke(Op::Fault {
                what: format!("cycle {cycle}: kill -9 of node {}", nodes[v].name),
            }),
        };
        if let Some(point) = nodes[v].armed {
            // Drive the armed node towards its point until it dies there.
            let deadline = Instant::now() + ARMED_WAIT;
            let mut last_redrive: Option<Instant> = None;
            while !nodes[v].dead() && Instant::now() < deadline {
                extra += 1;
                publish(
                    &queue,
                    &history,
                    &mut tally,
                    feeds(point),
                    &format!("x{extra}"),
                )
                .await;
                if point == "guard::redrive_after_publish"
                    && last_redrive.is_none_or(|t| t.elapsed() > Duration::from_millis(500))
                {
                    last_redrive = Some(Instant::now());
                    let base = nodes[v].base.clone();
                    if redrive(&http, &base, &history, &mut recorded_dls).await > 0 {
                        tally.redrive_requests += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let died = nodes[v].dead() && nodes[v].died_at_fail_point();
            nodes[v].kill9();
            if died {
                *tally.fail_point_kills.entry(point).or_default() += 1;
            } else {
                tally.fail_point_missed += 1;
                tally.random_kills += 1;
            }
        } else {
            // A redrive now and then, through the other node.
            if cycle % 3 == 2 {
                let base = nodes[(v + 1) % nodes.len()].base.clone();
                if redrive(&http, &base, &history, &mut recorded_dls).await > 0 {
                    tally.redrive_requests += 1;
                }
            }
            tokio::time::sleep(Duration::from_millis(50 + rng.below(1500))).await;
            assert!(
                !nodes[v].dead(),
                "node {} died unarmed:\n{}",
                nodes[v].name,
                nodes[v].output()
            );
            nodes[v].kill9();
            tally.random_kills += 1;
        }
        // Started again at once; half its lives armed with the next point.
        let arm = (!points.is_empty() && (cycle as usize / nodes.len()) % 2 == 0).then(|| {
            let p = points[next_point % points.len()];
            next_point += 1;
            (p, 1 + rng.below(3))
        });
        nodes[v].start(arm);
        fault.ok();
        if arm.is_some() {
            armed_faults[v] = Some(history.invoke(Op::Fault {
                what: format!("cycle {cycle}: node {} armed at {arm:?}", nodes[v].name),
            }));
        }
        if !nodes[v].ready(&queue).await {
            // It reached its point before its source was ready.
            if nodes[v].died_at_fail_point() {
                *tally
                    .fail_point_kills
                    .entry(nodes[v].armed.unwrap_or("?"))
                    .or_default() += 1;
            }
            nodes[v].kill9();
            nodes[v].start(None);
            if let Some(f) = armed_faults[v].take() {
                f.ok();
            }
            assert!(
                nodes[v].ready(&queue).await,
                "{} died unarmed",
                nodes[v].name
            );
        }
    }

    // The drain: both nodes unarmed, then everything handled or
    // dead-lettered, what a crash left dead-lettered redriven once more.
    for (n, armed) in nodes.iter_mut().zip(&mut armed_faults) {
        if n.armed.is_some() || n.dead() {
            let fault = armed.take().unwrap_or_else(|| {
                history.invoke(Op::Fault {
                    what: format!("drain: kill -9 of node {}", n.name),
                })
            });
            if n.armed.is_some() && n.dead() && n.died_at_fail_point() {
                *tally
                    .fail_point_kills
                    .entry(n.armed.unwrap_or("?"))
                    .or_default() += 1;
            } else {
                tally.random_kills += 1;
            }
            n.kill9();
            n.start(None);
            assert!(n.ready(&queue).await, "{} died unarmed", n.name);
            fault.ok();
        }
    }
    let base = nodes[0].base.clone();
    let ids: BTreeSet<String> = history
        .history()
        .entries
        .iter()
        .filter_map(|e| match &e.op {
            Op::Publish { id, .. } => Some(id.clone()),
            _ => None,
        })
        .collect();
    let deadline = Instant::now() + DRAIN;
    let mut redriven_at_drain = false;
    let final_dls = loop {
        let dls = dead_letters(&http, &base).await.expect("node a answers");
        let dead: BTreeSet<String> = dls
            .iter()
            .filter_map(|d| d["source"]["message_id"].as_str().map(str::to_owned))
            .collect();
        let (open, calls): (Vec<String>, u64) = {
            let s = seen.lock();
            (
                ids.iter()
                    .filter(|id| !s.succeeded.contains(*id) && !dead.contains(*id))
                    .cloned()
                    .collect(),
                s.calls,
            )
        };
        let held = match http.get(format!("{base}/v1/stats")).send().await {
            Ok(r) => r.json::<Value>().await.ok(),
            Err(_) => None,
        }
        .and_then(|s| s["held_retries"]["total"].as_u64());
        if open.is_empty() && held == Some(0) {
            if !redriven_at_drain {
                redriven_at_drain = true;
                if redrive(&http, &base, &history, &mut recorded_dls).await > 0 {
                    tally.redrive_requests += 1;
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            }
            // Quiet for a moment: no call still on its way.
            tokio::time::sleep(Duration::from_secs(2)).await;
            if seen.lock().calls == calls {
                break dls;
            }
            continue;
        }
        if Instant::now() >= deadline {
            // Lost, or stuck: the checker names each (lost: neither
            // completed nor dead-lettered), with what was last seen of it.
            eprintln!(
                "{test}: {} of {} messages neither handled nor dead-lettered within {DRAIN:?} \
                 ({held:?} held retries), e.g. {:?}\n{}",
                open.len(),
                ids.len(),
                open.iter().take(10).collect::<Vec<_>>(),
                nodes
                    .iter()
                    .map(|n| format!("node {}:\n{}", n.name, n.output()))
                    .collect::<String>()
            );
            break dls;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let mut stale = 0usize;
    let succeeded = seen.lock().succeeded.clone();
    for dl in &final_dls {
        let (message, dl_id, has_history, has_payload, hash) = dead_letter_op(&http, &base, dl)
            .await
            .expect("node a answers");
        if succeeded.contains(&message) {
            stale += 1;
        }
        history.observe(Op::ObservedDeadLetter {
            id: message,
            dead_letter_id: dl_id,
            has_history,
            has_payload,
            payload_hash: hash,
        });
    }
    let kills = tally.random_kills + tally.fail_point_kills.values().sum::<usize>();
    let report = history.check();
    eprintln!(
        "{test}: {cycles} cycles, {kills} kills ({} at random, at fail points {:?}, {} armed \
         lives killed at random for never reaching their point), {} messages, {} redrive \
         requests; {} completed, {} dead-lettered, {} remaining; lost {}, dead-lettered twice \
         {}, duplicated {} unexplained and {:?} explained; {} dead letters left of messages \
         handled since; at most {} deliveries of one message; {} anomalies",
        tally.random_kills,
        tally.fail_point_kills,
        tally.fail_point_missed,
        tally.published,
        tally.redrive_requests,
        report.completed,
        report.dead_lettered,
        report.remaining,
        report.count(AnomalyKind::Lost),
        report.count(AnomalyKind::DeadLetteredTwice),
        report.count(AnomalyKind::Duplicated),
        report.duplicated_allowed,
        stale,
        report.deliveries_max,
        report.anomalies.len(),
    );
    history.assert_ok(&format!("kill9-{}", kind.word()));
    assert_eq!(
        report.acknowledged, tally.published,
        "every publish recorded"
    );
    assert_eq!(
        report.completed + report.dead_lettered,
        tally.published,
        "every message handled or dead-lettered: {report}"
    );
    if kind != Kind::Kafka {
        assert!(
            tally.fail_point_kills.values().sum::<usize>() > 0 || cycles < 3,
            "no node died at a fail point: {tally:?}"
        );
    }
    if cycles as usize >= 2 * nodes.len() * points.len() {
        for p in points {
            assert!(
                tally.fail_point_kills.contains_key(p),
                "no node died at fail point {p} in {cycles} cycles: {tally:?}"
            );
        }
    }
}

/// RabbitMQ: random kills and the guard's fail points but Kafka's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_nodes_killed_at_random_and_at_fail_points_lose_nothing_on_rabbitmq() {
    battery(
        Kind::RabbitMq,
        "kill9::guard_nodes_killed_at_random_and_at_fail_points_lose_nothing_on_rabbitmq",
        2,
        cycles("LAZARET_KILL9_CYCLES", 8),
        &[
            "guard::after_dead_letter_commit",
            "guard::held_retry_before_outcome",
            "guard::redrive_after_publish",
        ],
    )
    .await;
}

/// Kafka (tansu): random kills and kills between an offset commit and
/// the next poll. A node started again joins the group as a new member;
/// tansu may leave it without a partition until the group rebalances
/// again, so an armed node does not always get to commit (the run says how
/// many did; one node alone was left with none after its first kill).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guard_nodes_killed_after_a_kafka_commit_lose_nothing() {
    battery(
        Kind::Kafka,
        "kill9::guard_nodes_killed_after_a_kafka_commit_lose_nothing",
        2,
        cycles("LAZARET_KILL9_KAFKA_CYCLES", 4),
        &["guard::kafka_after_commit"],
    )
    .await;
}
