//! The clients of the promise scenarios: a pool of workers that spend a
//! simulated handler time on every delivery and, in a poison storm, fail
//! or drop jobs on purpose; bulk and paced producers; the dead-letter reader.
//!
//! Every job's payload carries its sequence number (`seq`), and a paced
//! producer's jobs also the instant they were sent (`t_us`, microseconds
//! since the run's start, on this process's monotonic clock), so the
//! worker that receives one measures enqueue → lease without asking anyone.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use hyper::Method;
use serde::{Deserialize, Serialize};

use super::http::{self, Connection};
use super::load::{self, Text, decode};

/// Errors kept verbatim for the report.
const ERRORS_KEPT: usize = 5;
/// The lease endpoint.
const LEASES: &str = "/v1/leases";

/// What everything in one run shares: the clock, the goal, the tallies.
#[derive(Debug)]
pub struct Run {
    /// The run's zero: `t_us` in payloads counts from here.
    pub start: Instant,
    deadline: Instant,
    timeout: Duration,
    goal: Goal,
    acked: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
    abort: AtomicBool,
    /// Turns true when the run is done or stops, so a worker parked in a
    /// long poll leaves at once.
    stopped: tokio::sync::watch::Sender<bool>,
    errors: Mutex<Vec<String>>,
}

/// The outcomes a run waits for before its workers stop.
#[derive(Debug, Clone, Copy, Default)]
pub struct Goal {
    /// Jobs acked.
    pub acked: u64,
    /// Jobs failed permanently on purpose.
    pub failed: u64,
    /// Deliveries dropped on purpose (each crash-looping job is delivered
    /// `crash_loop_max` times).
    pub dropped: u64,
}

impl Run {
    pub fn new(goal: Goal, timeout: Duration) -> Arc<Self> {
        let start = Instant::now();
        Arc::new(Run {
            start,
            deadline: start + timeout,
            timeout,
            goal,
            acked: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            abort: AtomicBool::new(false),
            stopped: tokio::sync::watch::Sender::new(false),
            errors: Mutex::new(Vec::new()),
        })
    }

    /// Whether every outcome the run waits for has happened.
    fn done(&self) -> bool {
        self.acked.load(Ordering::Relaxed) >= self.goal.acked
            && self.failed.load(Ordering::Relaxed) >= self.goal.failed
            && self.dropped.load(Ordering::Relaxed) >= self.goal.dropped
    }

    /// Counts outcomes; the last one the goal waits for stops the run.
    fn count(&self, tally: &AtomicU64, n: u64) {
        if n > 0 {
            tally.fetch_add(n, Ordering::Relaxed);
        }
        if self.done() {
            self.stopped.send_replace(true);
        }
    }

    /// Jobs acked so far.
    pub fn acked(&self) -> u64 {
        self.acked.load(Ordering::Relaxed)
    }

    /// Whether the clients should stop: done, failed, or out of time.
    fn stopping(&self) -> bool {
        if self.abort.load(Ordering::Relaxed) || self.done() {
            return true;
        }
        if Instant::now() > self.deadline {
            self.fail(anyhow::anyhow!(
                "timed out after {:?} with {} of {} jobs acked, {} of {} failed, {} of {} deliveries dropped",
                self.timeout,
                self.acked.load(Ordering::Relaxed),
                self.goal.acked,
                self.failed.load(Ordering::Relaxed),
                self.goal.failed,
                self.dropped.load(Ordering::Relaxed),
                self.goal.dropped,
            ));
            return true;
        }
        false
    }

    /// Records an error and stops the run.
    pub fn fail(&self, e: anyhow::Error) {
        let mut errors = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if errors.len() < ERRORS_KEPT {
            errors.push(format!("{e:#}"));
        }
        self.abort.store(true, Ordering::Relaxed);
        self.stopped.send_replace(true);
    }

    /// The errors so far.
    pub fn errors(&self) -> Vec<String> {
        self.errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// What a worker does with a job, decided by its sequence number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Ack,
    /// `POST /v1/fails` with class `permanent`.
    FailPermanent,
    /// Never acked nor failed: the lease expires (a crash mid-job).
    Drop,
}

impl Fate {
    /// The poison storm's mix: every 20th job dropped (5 %), every 10th
    /// counting from 1 failed permanently (10 %), the rest acked.
    pub fn storm(seq: u64) -> Fate {
        if seq % 20 == 0 {
            Fate::Drop
        } else if seq % 10 == 1 {
            Fate::FailPermanent
        } else {
            Fate::Ack
        }
    }
}

/// A pool of workers alike.
#[derive(Debug, Clone)]
pub struct Pool {
    /// Worker ids are `{name}-{index}`.
    pub name: &'static str,
    pub workers: u64,
    pub lanes: Vec<String>,
    pub max_jobs: u64,
    pub lease_ms: u64,
    /// Long-poll of each lease.
    pub wait_ms: u64,
    /// Simulated handler time per delivery; the jobs of one lease run one
    /// after another.
    pub work: Duration,
    /// Jobs meet [`Fate::storm`] instead of all being acked.
    pub storm: bool,
}

/// What a pool saw.
#[derive(Debug, Default)]
pub struct PoolOut {
    /// Deliveries received: every one is a handler call.
    pub deliveries: u64,
    pub acked: Vec<String>,
    /// Enqueue → lease of jobs sent by a paced producer, in µs.
    pub start_us: Vec<u64>,
    /// The latest ack of each tenant.
    pub last_ack_by_tenant: HashMap<String, Instant>,
    /// When the last delivery's handling (its ack, fail or drop) ended.
    pub last_handled: Option<Instant>,
    pub leases: u64,
    pub empty_leases: u64,
    /// Acks or permanent fails the server refused or answered unexpectedly.
    pub outcome_errors: u64,
}

impl PoolOut {
    pub fn merge(&mut self, o: PoolOut) {
        self.deliveries += o.deliveries;
        self.acked.extend(o.acked);
        self.start_us.extend(o.start_us);
        for (tenant, t) in o.last_ack_by_tenant {
            let e = self.last_ack_by_tenant.entry(tenant).or_insert(t);
            *e = (*e).max(t);
        }
        self.last_handled = self.last_handled.max(o.last_handled);
        self.leases += o.leases;
        self.empty_leases += o.empty_leases;
        self.outcome_errors += o.outcome_errors;
    }
}

/// `POST /v1/leases`, with only what a worker of these scenarios reads.
#[derive(Debug, Deserialize)]
struct Leases<'a> {
    #[serde(borrow)]
    jobs: Vec<Delivery<'a>>,
}

#[derive(Debug, Deserialize)]
struct Delivery<'a> {
    #[serde(borrow)]
    id: Text<'a>,
    #[serde(borrow)]
    lease_token: Text<'a>,
    #[serde(borrow)]
    tenant: Text<'a>,
    payload: Payload,
}

/// The payload the producers here write (`data`, if any, is skipped).
#[derive(Debug, Deserialize)]
struct Payload {
    seq: u64,
    #[serde(default)]
    t_us: Option<u64>,
}

#[derive(Debug, Serialize)]
struct LeaseBody<'a> {
    worker_id: &'a str,
    lanes: &'a [String],
    types: Option<&'a [&'a str]>,
    max_jobs: u64,
    lease_ms: u64,
    wait_ms: u64,
}

#[derive(Debug, Serialize)]
struct Item<'a> {
    id: &'a str,
    lease_token: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<Poison>,
}

/// The error of a permanent failure on purpose.
#[derive(Debug, Serialize)]
struct Poison {
    class: &'static str,
    kind: &'static str,
    message: &'static str,
}

/// `POST /v1/outcomes`: per item, the outcome or the server's error.
#[derive(Debug, Deserialize)]
struct OutcomesReply<'a> {
    #[serde(borrow)]
    results: Vec<OutcomeResult<'a>>,
}

#[derive(Debug, Deserialize)]
struct OutcomeResult<'a> {
    #[serde(default, borrow)]
    state: Option<&'a str>,
    #[serde(default, borrow)]
    reason: Option<&'a str>,
    #[serde(default, borrow)]
    error: Option<&'a serde_json::value::RawValue>,
}

/// `POST /v1/outcomes` with the next lease: every outcome of a lease and
/// the next lease in one request.
#[derive(Debug, Serialize)]
struct OutcomesBody<'a> {
    items: Vec<Item<'a>>,
    next: &'a serde_json::value::RawValue,
}

/// Runs `pool.workers` workers until the run is done or stops.
pub async fn run_pool(run: Arc<Run>, client: http::Client, pool: Pool) -> PoolOut {
    let pool = Arc::new(pool);
    let workers: Vec<_> = (0..pool.workers)
        .map(|i| tokio::spawn(worker(run.clone(), client.clone(), pool.clone(), i)))
        .collect();
    let mut out = PoolOut::default();
    for w in workers {
        match w.await {
            Ok(o) => out.merge(o),
            Err(e) => run.fail(anyhow::anyhow!("a {} worker panicked: {e}", pool.name)),
        }
    }
    out
}

/// A worker's lease requests: the long poll of `POST /v1/leases`, and the
/// `next` of its outcomes, which does not wait.
struct LeaseAsk {
    bytes: Bytes,
    raw: Box<serde_json::value::RawValue>,
}

async fn worker(run: Arc<Run>, client: http::Client, pool: Arc<Pool>, index: u64) -> PoolOut {
    let mut out = PoolOut::default();
    let mut conn = client.connection();
    let worker_id = format!("{}-{index}", pool.name);
    let body = |wait_ms| {
        serde_json::to_string(&LeaseBody {
            worker_id: &worker_id,
            lanes: &pool.lanes,
            types: None,
            max_jobs: pool.max_jobs,
            lease_ms: pool.lease_ms,
            wait_ms,
        })
        .expect("a struct of strings and numbers encodes")
    };
    // The lease that comes with outcomes does not wait: their answer would
    // wait with it. When it finds nothing, the worker long-polls.
    let ask = LeaseAsk {
        bytes: Bytes::from(body(pool.wait_ms)),
        raw: serde_json::value::RawValue::from_string(body(0)).expect("just encoded"),
    };
    // The next lease, when the last outcomes brought it.
    let mut carried: Option<Bytes> = None;
    let mut stopped = run.stopped.subscribe();
    while !run.stopping() {
        // Once the run is done, a lease still waiting is dropped: nobody
        // holds an unfinished job then (every outcome the run waits for
        // has happened).
        tokio::select! {
            r = lease_and_handle(&run, &pool, &mut conn, &ask, &mut carried, &mut out) => {
                if let Err(e) = r {
                    run.fail(e);
                    break;
                }
            }
            _ = stopped.wait_for(|s| *s) => break,
        }
    }
    out
}

/// One lease (or the one the last outcomes brought) and the handling of
/// what it brought: the work, then every outcome in one `POST
/// /v1/outcomes` that also leases the next jobs, as a batching worker
/// does.
async fn lease_and_handle(
    run: &Run,
    pool: &Pool,
    conn: &mut Connection,
    ask: &LeaseAsk,
    carried: &mut Option<Bytes>,
    out: &mut PoolOut,
) -> anyhow::Result<()> {
    let reply = match carried.take() {
        Some(reply) => reply,
        None => conn.post(LEASES, ask.bytes.clone()).await?,
    };
    let received = Instant::now();
    let received_us = u64::try_from(received.duration_since(run.start).as_micros()).unwrap_or(0);
    let jobs = decode::<Leases<'_>>(LEASES, &reply)?.jobs;
    out.leases += 1;
    if jobs.is_empty() {
        out.empty_leases += 1;
        return Ok(());
    }
    out.deliveries += jobs.len() as u64;
    for j in &jobs {
        if let Some(t) = j.payload.t_us {
            out.start_us.push(received_us.saturating_sub(t));
        }
    }
    if !pool.work.is_zero() {
        tokio::time::sleep(pool.work * u32::try_from(jobs.len()).unwrap_or(u32::MAX)).await;
    }
    let fate = |j: &Delivery<'_>| {
        if pool.storm {
            Fate::storm(j.payload.seq)
        } else {
            Fate::Ack
        }
    };
    let (mut reported, mut drops) = (Vec::new(), 0);
    for j in &jobs {
        match fate(j) {
            Fate::Drop => drops += 1,
            f => reported.push((j, f)),
        }
    }
    if !reported.is_empty() {
        *carried = Some(report(run, conn, &reported, &ask.raw, out).await?);
    }
    run.count(&run.dropped, drops);
    out.last_handled = Some(Instant::now());
    Ok(())
}

/// Reports the outcomes of `jobs` and leases the next jobs (`next`), in
/// one request; returns the reply, whose `jobs` are that next lease.
async fn report(
    run: &Run,
    conn: &mut Connection,
    jobs: &[(&Delivery<'_>, Fate)],
    next: &serde_json::value::RawValue,
    out: &mut PoolOut,
) -> anyhow::Result<Bytes> {
    const PATH: &str = "/v1/outcomes";
    let body = OutcomesBody {
        items: jobs
            .iter()
            .map(|(j, fate)| Item {
                id: j.id.as_str(),
                lease_token: j.lease_token.as_str(),
                error: (*fate == Fate::FailPermanent).then_some(Poison {
                    class: "permanent",
                    kind: "bench_poison",
                    message: "poison storm: this job fails on purpose",
                }),
            })
            .collect(),
        next,
    };
    let bytes = conn.post(PATH, serde_json::to_vec(&body)?).await?;
    let reply: OutcomesReply<'_> = decode(PATH, &bytes)?;
    if reply.results.len() != jobs.len() {
        out.outcome_errors += jobs.len() as u64;
        bail!(
            "POST {PATH}: {} results for {} items",
            reply.results.len(),
            jobs.len()
        );
    }
    let now = Instant::now();
    let (mut acked, mut failed) = (0, 0);
    for ((j, fate), r) in jobs.iter().zip(&reply.results) {
        match (fate, r.state, r.reason, r.error) {
            (Fate::Ack, Some("succeeded"), _, None) => {
                acked += 1;
                out.acked.push(j.id.as_str().to_owned());
                match out.last_ack_by_tenant.get_mut(j.tenant.as_str()) {
                    Some(t) => *t = now,
                    None => {
                        out.last_ack_by_tenant
                            .insert(j.tenant.as_str().to_owned(), now);
                    }
                }
            }
            (Fate::FailPermanent, Some("dead_lettered"), Some("permanent"), None) => failed += 1,
            _ => {
                out.outcome_errors += 1;
                run.fail(anyhow::anyhow!(
                    "the outcome of job {} ({fate:?}) was answered state {:?}, reason {:?}, error {:?}",
                    j.id.as_str(),
                    r.state,
                    r.reason,
                    r.error.map(|e| e.get())
                ));
            }
        }
    }
    run.count(&run.acked, acked);
    run.count(&run.failed, failed);
    Ok(bytes)
}

/// Where jobs go: one lane, one type, and the tenant of each.
#[derive(Debug, Clone)]
pub struct Target {
    pub lane: String,
    pub job_type: String,
    /// Each job's tenant: this one, or with [`Target::tenants`] > 1,
    /// `{tenant}{seq % tenants}`.
    pub tenant: String,
    pub tenants: u64,
}

impl Target {
    fn push_job(&self, out: &mut String, seq: u64, t_us: Option<u64>, data: &str) {
        let (lane, job_type, tenant) = (&self.lane, &self.job_type, &self.tenant);
        let _ = write!(out, r#"{{"type":"{job_type}","tenant":"{tenant}"#);
        if self.tenants > 1 {
            let _ = write!(out, "{}", seq % self.tenants);
        }
        let _ = write!(out, r#"","lane":"{lane}","payload":{{"seq":{seq}"#);
        if let Some(t) = t_us {
            let _ = write!(out, r#","t_us":{t}"#);
        }
        let _ = write!(out, r#","data":"{data}"}}}}"#);
    }

    /// `{"jobs":[...]}` for sequence numbers `seqs`.
    pub fn batch_body(&self, seqs: std::ops::Range<u64>, data: &str) -> String {
        let mut out = String::with_capacity((seqs.end - seqs.start) as usize * (data.len() + 96));
        out.push_str(r#"{"jobs":["#);
        for seq in seqs.clone() {
            if seq > seqs.start {
                out.push(',');
            }
            self.push_job(&mut out, seq, None, data);
        }
        out.push_str("]}");
        out
    }
}

/// Enqueues jobs `seqs` in batches of `batch` over `connections`
/// connections at once; returns (seq, id) of each, and the instant the
/// first request was sent.
pub async fn enqueue_bulk(
    client: &http::Client,
    target: &Target,
    seqs: std::ops::Range<u64>,
    batch: u64,
    connections: u64,
    data: &str,
) -> anyhow::Result<(Vec<(u64, String)>, Instant)> {
    let first = Instant::now();
    let next = Arc::new(AtomicU64::new(seqs.start));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..connections.max(1) {
        let (mut conn, next, target, data) = (
            client.connection(),
            next.clone(),
            target.clone(),
            data.to_owned(),
        );
        let end = seqs.end;
        tasks.spawn(async move {
            let mut ids = Vec::new();
            loop {
                let from = next.fetch_add(batch, Ordering::Relaxed);
                if from >= end {
                    return anyhow::Ok(ids);
                }
                let to = (from + batch).min(end);
                let body = target.batch_body(from..to, &data);
                let got = load::enqueue_batch(&mut conn, body, to - from).await?;
                ids.extend((from..to).zip(got));
            }
        });
    }
    let mut all = Vec::with_capacity((seqs.end - seqs.start) as usize);
    while let Some(r) = tasks.join_next().await {
        all.extend(r.context("an enqueue task panicked")??);
    }
    Ok((all, first))
}

/// What a paced producer sent.
#[derive(Debug, Default)]
pub struct Paced {
    pub ids: Vec<String>,
    /// Round trip of each `POST /v1/jobs`, in µs.
    pub enqueue_us: Vec<u64>,
}

/// Enqueues `count` jobs one at a time, one every `interval` (a late tick
/// is not caught up with a burst), each stamped with the instant it is sent.
pub async fn enqueue_paced(
    run: &Run,
    client: &http::Client,
    target: &Target,
    count: u64,
    interval: Duration,
) -> anyhow::Result<Paced> {
    let mut conn = client.connection();
    let mut out = Paced::default();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for seq in 0..count {
        tick.tick().await;
        if run.abort.load(Ordering::Relaxed) {
            break;
        }
        let mut body = String::with_capacity(128);
        let sent = Instant::now();
        target.push_job(
            &mut body,
            seq,
            Some(u64::try_from(sent.duration_since(run.start).as_micros()).unwrap_or(0)),
            "",
        );
        let id = load::enqueue_one(&mut conn, body).await?;
        out.enqueue_us.push(load::micros(sent));
        out.ids.push(id);
    }
    Ok(out)
}

/// `GET /v1/dead-letters`, the fields read here.
#[derive(Debug, Deserialize)]
struct DeadLetters<'a> {
    #[serde(borrow)]
    items: Vec<DeadLetter<'a>>,
    next_cursor: Option<String>,
}

#[derive(Debug, Deserialize)]
struct DeadLetter<'a> {
    #[serde(borrow)]
    job_id: Option<Text<'a>>,
    reason: String,
}

/// `GET /v1/dead-letters/reasons`.
#[derive(Debug, Deserialize)]
struct Reasons {
    reasons: Vec<ReasonCount>,
}

#[derive(Debug, Deserialize)]
struct ReasonCount {
    count: u64,
}

async fn get(conn: &mut Connection, path: &str) -> anyhow::Result<Bytes> {
    let reply = conn
        .send(Method::GET, path, Bytes::new())
        .await
        .with_context(|| format!("GET {path}"))?;
    if !reply.status.is_success() {
        bail!(
            "GET {path}: {}: {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        );
    }
    Ok(reply.body)
}

/// Waits until the dead letters hold at least `count`, polling their
/// reason counts; returns how long it took.
pub async fn await_dead_letters(
    client: &http::Client,
    count: u64,
    within: Duration,
) -> anyhow::Result<Duration> {
    const PATH: &str = "/v1/dead-letters/reasons";
    let start = Instant::now();
    let mut conn = client.connection();
    loop {
        let bytes = get(&mut conn, PATH).await?;
        let held: u64 = serde_json::from_slice::<Reasons>(&bytes)
            .with_context(|| format!("GET {PATH}: unexpected answer"))?
            .reasons
            .iter()
            .map(|r| r.count)
            .sum();
        if held >= count {
            return Ok(start.elapsed());
        }
        if start.elapsed() > within {
            bail!(
                "the dead letters held {held} of the {count} expected {within:?} after the last delivery"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Every dead letter, page by page: (job id, reason) of each with a job id.
pub async fn dead_letters(client: &http::Client) -> anyhow::Result<Vec<(String, String)>> {
    let mut conn = client.connection();
    let mut out = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut path = String::from("/v1/dead-letters?limit=1000");
        if let Some(c) = &cursor {
            path.push_str("&cursor=");
            http::push_segment(&mut path, c);
        }
        let bytes = get(&mut conn, &path).await?;
        let page: DeadLetters<'_> = serde_json::from_slice(&bytes)
            .with_context(|| format!("GET {path}: unexpected answer"))?;
        out.extend(
            page.items
                .into_iter()
                .filter_map(|d| Some((d.job_id?.as_str().to_owned(), d.reason))),
        );
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return Ok(out),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn the_storm_fails_a_tenth_and_drops_a_twentieth() {
        let fates: Vec<Fate> = (0..1000).map(Fate::storm).collect();
        let count = |f| fates.iter().filter(|&&x| x == f).count();
        assert_eq!(
            (
                count(Fate::Ack),
                count(Fate::FailPermanent),
                count(Fate::Drop)
            ),
            (850, 100, 50)
        );
    }

    #[test]
    fn jobs_carry_their_seq_and_send_instant() {
        let target = Target {
            lane: "batch".into(),
            job_type: "bench".into(),
            tenant: "t".into(),
            tenants: 3,
        };
        let v: Value = serde_json::from_str(&target.batch_body(4..6, "xy")).unwrap();
        assert_eq!(
            v,
            json!({"jobs": [
                {"type": "bench", "tenant": "t1", "lane": "batch", "payload": {"seq": 4, "data": "xy"}},
                {"type": "bench", "tenant": "t2", "lane": "batch", "payload": {"seq": 5, "data": "xy"}},
            ]})
        );
        let one = Target {
            tenant: "big".into(),
            tenants: 1,
            ..target
        };
        let mut body = String::new();
        one.push_job(&mut body, 7, Some(1234), "");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["tenant"], "big");
        assert_eq!(v["payload"], json!({"seq": 7, "t_us": 1234, "data": ""}));
    }

    #[test]
    fn deliveries_decode_seq_stamp_and_tenant() {
        let reply = br#"{"jobs":[{"id":"7","type":"bench","tenant":"small-3","lane":"bench",
            "payload":{"seq":4,"t_us":99,"data":""},"attempt":1,"lease_token":"12"},
            {"id":8,"tenant":"t0","lease_token":"13","payload":{"seq":5,"data":"x"}}]}"#;
        let got = decode::<Leases<'_>>(LEASES, reply).unwrap().jobs;
        assert_eq!(
            (
                got[0].tenant.as_str(),
                got[0].payload.seq,
                got[0].payload.t_us
            ),
            ("small-3", 4, Some(99))
        );
        assert_eq!((got[1].id.as_str(), got[1].payload.t_us), ("8", None));
    }

    #[test]
    fn outcomes_carry_an_error_only_for_a_permanent_failure_and_the_next_lease() {
        let next =
            serde_json::value::RawValue::from_string(r#"{"max_jobs":10,"wait_ms":0}"#.into())
                .unwrap();
        let body = OutcomesBody {
            items: vec![
                Item {
                    id: "1",
                    lease_token: "2",
                    error: Some(Poison {
                        class: "permanent",
                        kind: "bench_poison",
                        message: "m",
                    }),
                },
                Item {
                    id: "3",
                    lease_token: "4",
                    error: None,
                },
            ],
            next: &next,
        };
        let v: Value = serde_json::to_value(&body).unwrap();
        assert_eq!(v["items"][0]["error"]["class"], "permanent");
        assert_eq!(v["items"][1], json!({"id": "3", "lease_token": "4"}));
        assert_eq!(v["next"], json!({"max_jobs": 10, "wait_ms": 0}));
    }
}
