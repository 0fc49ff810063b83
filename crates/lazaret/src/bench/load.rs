//! The load itself: the backlog fill, and producers and consumers running at once.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use std::borrow::Cow;

use anyhow::{Context, bail};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use super::http::{self, Connection};

/// Jobs per request when filling the backlog.
pub const BACKLOG_BATCH: u64 = 1000;
/// Concurrent requests when filling the backlog.
const BACKLOG_CONCURRENCY: u64 = 4;
/// The lane the measured jobs go to (and the only one consumers lease).
pub const BENCH_LANE: &str = "bench";
/// The lane of the backlog, which nobody leases.
pub const BACKLOG_LANE: &str = "backlog";
/// The type of the measured jobs when there is one (`--types 1`).
pub const JOB_TYPE: &str = "bench";
/// Long-poll of each lease request.
const LEASE_WAIT_MS: u64 = 1000;
/// The lease endpoint.
const LEASES: &str = "/v1/leases";
/// The batch ack endpoint.
const ACKS: &str = "/v1/acks";
/// Errors kept verbatim for the report.
const ERRORS_KEPT: usize = 5;

/// The shape of the load.
#[derive(Debug, Clone)]
pub struct Load {
    pub jobs: u64,
    pub batch: u64,
    pub producers: u64,
    pub consumers: u64,
    /// Clients that each enqueue, lease and ack in turn.
    pub cyclers: u64,
    pub payload_bytes: usize,
    pub tenants: u64,
    pub lease_ms: u64,
    pub timeout: Duration,
    /// Unbatched consumers ack with `next` (one request per job instead
    /// of two); a `next` that finds nothing ready falls back to a
    /// long-polling lease.
    pub next: bool,
    /// The measured jobs' types, taken in turn within each tenant.
    pub types: Vec<String>,
    /// Leases name `types` (`"types": [...]`) instead of `null`.
    pub filter_types: bool,
    /// The backlog's type, when it waits in the measured lane (where only
    /// a lease filtered by type passes it over) instead of lane `backlog`.
    pub backlog_type: Option<String>,
}

/// The measured jobs' types: `bench`, or `bench-0` … `bench-{n-1}`.
pub fn job_types(n: u64) -> Vec<String> {
    match n {
        0 | 1 => vec![JOB_TYPE.to_owned()],
        n => (0..n).map(|k| format!("{JOB_TYPE}-{k}")).collect(),
    }
}

/// Where jobs go and what they are: lane, tenants (round-robin by sequence
/// number) and types (in turn within each tenant).
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    pub lane: &'a str,
    pub tenants: u64,
    pub types: &'a [String],
}

/// Appends one job object to `out`. Every piece is plain ASCII with nothing
/// to escape, so the JSON is written by hand (the bench client shares the
/// machine with the server, so its CPU counts).
pub fn push_job(out: &mut String, seq: u64, shape: Shape<'_>, data: &str) {
    let tenants = shape.tenants.max(1);
    let tenant = seq % tenants;
    // By the sequence number over the tenants, so each tenant gets every type.
    let job_type = shape
        .types
        .get(((seq / tenants) % shape.types.len().max(1) as u64) as usize)
        .map_or(JOB_TYPE, String::as_str);
    let lane = shape.lane;
    let _ = write!(
        out,
        r#"{{"type":"{job_type}","tenant":"t{tenant}","lane":"{lane}","payload":{{"seq":{seq},"data":"{data}"}}}}"#
    );
}

/// `{"jobs":[...]}` for jobs `from..to`.
pub fn batch_body(from: u64, to: u64, shape: Shape<'_>, data: &str) -> String {
    let mut out = String::with_capacity((to - from) as usize * (data.len() + 96) + 16);
    out.push_str(r#"{"jobs":["#);
    for seq in from..to {
        if seq > from {
            out.push(',');
        }
        push_job(&mut out, seq, shape, data);
    }
    out.push_str("]}");
    out
}

/// An id or lease token as text, whether the server writes it as a JSON
/// string (borrowed from the reply unless it holds escapes) or a number.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Text<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for Visit<'a> {
            type Value = Text<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or an integer")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v.to_owned())))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v.to_string())))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Text<'a>, E> {
                Ok(Text(Cow::Owned(v.to_string())))
            }
        }
        d.deserialize_any(Visit(std::marker::PhantomData))
    }
}

impl Text<'_> {
    pub(super) fn as_str(&self) -> &str {
        &self.0
    }
}

/// `POST /v1/jobs` (the other fields of the reply are skipped).
#[derive(Debug, Deserialize)]
struct Enqueued<'a> {
    #[serde(borrow)]
    id: Text<'a>,
}

/// `POST /v1/jobs/batch`: per job, its id or the server's error, kept verbatim.
#[derive(Debug, Deserialize)]
struct BatchReply<'a> {
    #[serde(borrow)]
    results: Vec<BatchItem<'a>>,
}

#[derive(Debug, Deserialize)]
struct BatchItem<'a> {
    #[serde(borrow)]
    id: Option<Text<'a>>,
    #[serde(borrow)]
    error: Option<&'a RawValue>,
}

/// `POST /v1/leases`: only what an ack needs (payloads are skipped unread).
#[derive(Debug, Deserialize)]
struct LeaseReply<'a> {
    #[serde(borrow)]
    jobs: Vec<Leased<'a>>,
}

#[derive(Debug, Deserialize)]
struct Leased<'a> {
    #[serde(borrow)]
    id: Text<'a>,
    #[serde(borrow)]
    lease_token: Text<'a>,
}

/// `POST /v1/acks`: per item, the server's error if it refused it.
#[derive(Debug, Deserialize)]
pub(super) struct AcksReply<'a> {
    #[serde(borrow)]
    pub(super) results: Vec<AckItem<'a>>,
}

#[derive(Debug, Deserialize)]
pub(super) struct AckItem<'a> {
    #[serde(borrow)]
    pub(super) error: Option<&'a RawValue>,
}

/// The body of `POST /v1/leases`; the same for every lease of a consumer.
#[derive(Debug, Serialize)]
struct LeaseBody<'a> {
    worker_id: &'a str,
    lanes: [&'a str; 1],
    types: Option<&'a [&'a str]>,
    max_jobs: u64,
    lease_ms: u64,
    wait_ms: u64,
}

/// The body of `POST /v1/jobs/{id}/ack`.
#[derive(Debug, Serialize)]
struct AckBody<'a> {
    lease_token: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<&'a RawValue>,
}

/// The answer of an ack with `next`: the jobs it leased, or why not.
#[derive(Debug, Deserialize)]
struct NextReply<'a> {
    #[serde(borrow)]
    jobs: Vec<Leased<'a>>,
    #[serde(borrow)]
    next_error: Option<&'a RawValue>,
}

/// The body of `POST /v1/acks`.
#[derive(Debug, Serialize)]
struct AcksBody<'a> {
    items: Vec<AckBodyItem<'a>>,
}

#[derive(Debug, Serialize)]
struct AckBodyItem<'a> {
    id: &'a str,
    lease_token: &'a str,
}

/// Decodes a 2xx answer of `POST {path}`.
pub(super) fn decode<'a, T: Deserialize<'a>>(path: &str, body: &'a [u8]) -> anyhow::Result<T> {
    serde_json::from_slice(body).with_context(|| format!("POST {path}: unexpected answer"))
}

/// Enqueues a batch and returns the ids in order; any refused job is an error.
pub(super) async fn enqueue_batch(
    conn: &mut Connection,
    body: String,
    expect: u64,
) -> anyhow::Result<Vec<String>> {
    const PATH: &str = "/v1/jobs/batch";
    let bytes = conn.post(PATH, body).await?;
    let reply: BatchReply<'_> = decode(PATH, &bytes)?;
    if reply.results.len() as u64 != expect {
        bail!(
            "POST {PATH}: {} results for {expect} jobs",
            reply.results.len()
        );
    }
    reply
        .results
        .into_iter()
        .map(|r| match (r.error, r.id) {
            (None, Some(id)) => Ok(id.0.into_owned()),
            (Some(e), _) => bail!("POST {PATH} refused a job: {e}"),
            (None, None) => bail!("POST {PATH}: a result with neither id nor error"),
        })
        .collect()
}

/// Enqueues one job (`POST /v1/jobs`) and returns its id.
pub(super) async fn enqueue_one(conn: &mut Connection, body: String) -> anyhow::Result<String> {
    const PATH: &str = "/v1/jobs";
    let bytes = conn.post(PATH, body).await?;
    let reply: Enqueued<'_> = decode(PATH, &bytes)?;
    Ok(reply.id.0.into_owned())
}

/// Acks one leased job (`POST /v1/jobs/{id}/ack`); the answer's fields are not needed.
async fn ack_one(conn: &mut Connection, job: &Leased<'_>) -> anyhow::Result<()> {
    let mut path = String::with_capacity(32);
    path.push_str("/v1/jobs/");
    http::push_segment(&mut path, job.id.as_str());
    path.push_str("/ack");
    let body = serde_json::to_vec(&AckBody {
        lease_token: job.lease_token.as_str(),
        next: None,
    })?;
    conn.post(&path, body).await?;
    Ok(())
}

/// Acks one job with `next`; returns the id and token of the job it
/// leased, if one was ready.
async fn ack_next(
    conn: &mut Connection,
    (id, token): &(String, String),
    next: &RawValue,
) -> anyhow::Result<Option<(String, String)>> {
    let mut path = String::with_capacity(32);
    path.push_str("/v1/jobs/");
    http::push_segment(&mut path, id);
    path.push_str("/ack");
    let body = serde_json::to_vec(&AckBody {
        lease_token: token,
        next: Some(next),
    })?;
    let bytes = conn.post(&path, body).await?;
    let reply: NextReply<'_> = decode(&path, &bytes)?;
    if let Some(e) = reply.next_error {
        bail!("POST {path}: the ack stood but its next lease was refused: {e}");
    }
    Ok(reply
        .jobs
        .first()
        .map(|j| (j.id.as_str().to_owned(), j.lease_token.as_str().to_owned())))
}

/// The `next` of consumer `index`'s acks: one job, no wait (an empty
/// answer falls back to a long-polling lease, so the last ack of a run is
/// not held up by a wait).
fn next_body(index: u64, load: &Load) -> Box<RawValue> {
    let worker_id = format!("bench-{index}");
    let body = LeaseBody {
        worker_id: &worker_id,
        lanes: [BENCH_LANE],
        types: None,
        max_jobs: 1,
        lease_ms: load.lease_ms,
        wait_ms: 0,
    };
    let text = serde_json::to_string(&body).expect("a struct of strings and numbers encodes");
    RawValue::from_string(text).expect("serde_json wrote JSON")
}

/// The lease request of consumer `index`, encoded once and sent for every lease.
fn lease_body(index: u64, load: &Load) -> Bytes {
    let worker_id = format!("bench-{index}");
    let types: Vec<&str> = load.types.iter().map(String::as_str).collect();
    let body = LeaseBody {
        worker_id: &worker_id,
        lanes: [BENCH_LANE],
        types: load.filter_types.then_some(types.as_slice()),
        max_jobs: load.batch,
        lease_ms: load.lease_ms,
        wait_ms: LEASE_WAIT_MS,
    };
    Bytes::from(serde_json::to_vec(&body).expect("a struct of strings and numbers encodes"))
}

/// `{"items":[{"id", "lease_token"}, ...]}` for the jobs of one lease.
fn acks_body(jobs: &[Leased<'_>]) -> Vec<u8> {
    let body = AcksBody {
        items: jobs
            .iter()
            .map(|j| AckBodyItem {
                id: j.id.as_str(),
                lease_token: j.lease_token.as_str(),
            })
            .collect(),
    };
    serde_json::to_vec(&body).expect("a struct of strings encodes")
}

/// Queues `n` jobs in batches of 1000, in lane `backlog` or, with
/// `load.backlog_type`, as jobs of that type in the measured lane; returns
/// the time it took.
pub async fn fill_backlog(client: &http::Client, n: u64, load: &Load) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let data = Arc::new("x".repeat(load.payload_bytes));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..BACKLOG_CONCURRENCY {
        let (mut conn, next, done, data, tenants) = (
            client.connection(),
            next.clone(),
            done.clone(),
            data.clone(),
            load.tenants,
        );
        let (lane, types) = match &load.backlog_type {
            Some(t) => (BENCH_LANE, vec![t.clone()]),
            None => (BACKLOG_LANE, vec![JOB_TYPE.to_owned()]),
        };
        tasks.spawn(async move {
            let shape = Shape {
                lane,
                tenants,
                types: &types,
            };
            loop {
                let from = next.fetch_add(BACKLOG_BATCH, Ordering::Relaxed);
                if from >= n {
                    return anyhow::Ok(());
                }
                let to = (from + BACKLOG_BATCH).min(n);
                // Sequence numbers far above the measured jobs', for telling them apart.
                let body = batch_body(from + (1 << 40), to + (1 << 40), shape, &data);
                enqueue_batch(&mut conn, body, to - from).await?;
                let total = done.fetch_add(to - from, Ordering::Relaxed) + (to - from);
                if total % 100_000 < BACKLOG_BATCH && n >= 200_000 {
                    eprintln!("  backlog: {total}/{n} queued");
                }
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.context("backlog task panicked")?
            .context("filling the backlog")?;
    }
    Ok(start.elapsed())
}

/// Everything measured in one run, before summarizing.
#[derive(Debug, Default)]
pub struct Measured {
    pub elapsed: Duration,
    pub enqueued_ids: Vec<String>,
    pub acked_ids: Vec<String>,
    pub enqueue_us: Vec<u64>,
    pub lease_us: Vec<u64>,
    pub ack_us: Vec<u64>,
    pub leased_jobs: u64,
    pub empty_leases: u64,
    pub ack_errors: u64,
    /// Requests the consumers sent (leases and acks).
    pub consumer_requests: u64,
    /// Jobs that came in the answer of an ack with `next`.
    pub next_jobs: u64,
    /// The first few errors verbatim.
    pub errors: Vec<String>,
    /// Set when the run stopped early (an error or the timeout).
    pub aborted: Option<String>,
}

struct Shared {
    /// One per node: worker `i` talks to node `i % clients.len()`.
    clients: Vec<http::Client>,
    load: Load,
    data: String,
    next_job: AtomicU64,
    acked: AtomicU64,
    abort: AtomicBool,
    deadline: Instant,
    start: Instant,
}

impl Shared {
    fn stopping(&self) -> bool {
        self.abort.load(Ordering::Relaxed)
    }
}

#[derive(Default)]
struct ProducerOut {
    ids: Vec<String>,
    lat: Vec<u64>,
    error: Option<String>,
}

#[derive(Default)]
struct ConsumerOut {
    /// A cycler's own enqueues.
    produced: ProducerOut,
    acked: Vec<String>,
    lease_lat: Vec<u64>,
    ack_lat: Vec<u64>,
    leased: u64,
    empty: u64,
    ack_errors: u64,
    requests: u64,
    next_jobs: u64,
    errors: Vec<String>,
    last_ack: Option<Instant>,
    timed_out: bool,
}

pub(super) fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

async fn producer(s: Arc<Shared>, index: u64) -> ProducerOut {
    let mut out = ProducerOut::default();
    let mut conn = s.clients[(index as usize) % s.clients.len()].connection();
    while !s.stopping() && produce(&s, &mut conn, &mut out).await {}
    out
}

/// Enqueues the next request's worth of jobs; false once there are no more
/// to enqueue or the request failed (then the run aborts).
async fn produce(s: &Shared, conn: &mut http::Connection, out: &mut ProducerOut) -> bool {
    let batch = s.load.batch;
    let from = s.next_job.fetch_add(batch, Ordering::Relaxed);
    if from >= s.load.jobs {
        return false;
    }
    let to = (from + batch).min(s.load.jobs);
    let shape = Shape {
        lane: BENCH_LANE,
        tenants: s.load.tenants,
        types: &s.load.types,
    };
    let t = Instant::now();
    let result = if batch == 1 {
        let mut body = String::with_capacity(s.data.len() + 96);
        push_job(&mut body, from, shape, &s.data);
        enqueue_one(conn, body).await.map(|id| vec![id])
    } else {
        let body = batch_body(from, to, shape, &s.data);
        enqueue_batch(conn, body, to - from).await
    };
    out.lat.push(micros(t));
    match result {
        Ok(ids) => {
            out.ids.extend(ids);
            true
        }
        Err(e) => {
            out.error = Some(format!("{e:#}"));
            s.abort.store(true, Ordering::Relaxed);
            false
        }
    }
}

/// A consumer; with `cycle`, a cycler: it enqueues before each lease while
/// there are jobs left to enqueue.
async fn consumer(s: Arc<Shared>, index: u64, cycle: bool) -> ConsumerOut {
    let mut out = ConsumerOut::default();
    let mut producing = cycle;
    let mut conn = s.clients[(index as usize) % s.clients.len()].connection();
    let lease_body = lease_body(index, &s.load);
    let next = next_body(index, &s.load);
    // With `next`: the job held, acked (and the next one leased) at the top
    // of the loop.
    let mut held: Option<(String, String)> = None;
    let fail = |out: &mut ConsumerOut, e: anyhow::Error| {
        if out.errors.len() < ERRORS_KEPT {
            out.errors.push(format!("{e:#}"));
        }
        s.abort.store(true, Ordering::Relaxed);
    };
    loop {
        if s.stopping() || s.acked.load(Ordering::Relaxed) >= s.load.jobs {
            break;
        }
        if Instant::now() > s.deadline {
            out.timed_out = true;
            s.abort.store(true, Ordering::Relaxed);
            break;
        }
        if producing {
            producing = produce(&s, &mut conn, &mut out.produced).await;
            if s.stopping() {
                break;
            }
        }
        if let Some(job) = held.take() {
            let t = Instant::now();
            let acked = ack_next(&mut conn, &job, &next).await;
            out.ack_lat.push(micros(t));
            out.requests += 1;
            match acked {
                Ok(following) => {
                    out.acked.push(job.0);
                    s.acked.fetch_add(1, Ordering::Relaxed);
                    out.last_ack = Some(Instant::now());
                    if following.is_some() {
                        out.leased += 1;
                        out.next_jobs += 1;
                    }
                    held = following;
                }
                Err(e) => {
                    out.ack_errors += 1;
                    fail(&mut out, e);
                    break;
                }
            }
            continue;
        }
        let t = Instant::now();
        let leased = conn.post(LEASES, lease_body.clone()).await;
        out.requests += 1;
        let lat = micros(t);
        let reply = match leased {
            Ok(bytes) => bytes,
            Err(e) => {
                fail(&mut out, e);
                break;
            }
        };
        let jobs = match decode::<LeaseReply<'_>>(LEASES, &reply) {
            Ok(r) => r.jobs,
            Err(e) => {
                fail(&mut out, e);
                break;
            }
        };
        if jobs.is_empty() {
            // A long poll that ran out: its time is the wait, not the server's.
            out.empty += 1;
            continue;
        }
        out.lease_lat.push(lat);
        out.leased += jobs.len() as u64;

        if s.load.batch > 1 {
            let body = acks_body(&jobs);
            let t = Instant::now();
            let acked = conn.post(ACKS, body).await;
            out.requests += 1;
            out.ack_lat.push(micros(t));
            let acked = acked.and_then(|bytes| {
                let r: AcksReply<'_> = decode(ACKS, &bytes)?;
                Ok(r.results
                    .iter()
                    .map(|i| i.error.map(|e| e.get().to_owned()))
                    .collect::<Vec<_>>())
            });
            match acked {
                Ok(results) if results.len() == jobs.len() => {
                    let mut ok = 0;
                    for (job, error) in jobs.iter().zip(results) {
                        match error {
                            None => {
                                out.acked.push(job.id.as_str().to_owned());
                                ok += 1;
                            }
                            Some(e) => {
                                out.ack_errors += 1;
                                fail(
                                    &mut out,
                                    anyhow::anyhow!("ack of job {} refused: {e}", job.id.as_str()),
                                );
                            }
                        }
                    }
                    s.acked.fetch_add(ok, Ordering::Relaxed);
                    out.last_ack = Some(Instant::now());
                }
                Ok(results) => {
                    out.ack_errors += jobs.len() as u64;
                    let e = anyhow::anyhow!(
                        "POST {ACKS}: {} results for {} items",
                        results.len(),
                        jobs.len()
                    );
                    fail(&mut out, e);
                }
                Err(e) => {
                    out.ack_errors += jobs.len() as u64;
                    fail(&mut out, e);
                }
            }
        } else if s.load.next {
            // Leases ask for one job; it is acked with `next` above.
            held = jobs
                .first()
                .map(|j| (j.id.as_str().to_owned(), j.lease_token.as_str().to_owned()));
        } else {
            for job in &jobs {
                let t = Instant::now();
                let acked = ack_one(&mut conn, job).await;
                out.requests += 1;
                out.ack_lat.push(micros(t));
                match acked {
                    Ok(()) => {
                        out.acked.push(job.id.as_str().to_owned());
                        s.acked.fetch_add(1, Ordering::Relaxed);
                        out.last_ack = Some(Instant::now());
                    }
                    Err(e) => {
                        out.ack_errors += 1;
                        fail(&mut out, e);
                    }
                }
            }
        }
    }
    out
}

/// Runs `load.producers` producers and `load.consumers` consumers at once,
/// from the first enqueue until the last of `load.jobs` jobs is acked;
/// with several clients (nodes), the workers are spread over them.
pub async fn run_load(clients: &[http::Client], load: &Load) -> anyhow::Result<Measured> {
    let start = Instant::now();
    let shared = Arc::new(Shared {
        clients: clients.to_vec(),
        load: load.clone(),
        data: "x".repeat(load.payload_bytes),
        next_job: AtomicU64::new(0),
        acked: AtomicU64::new(0),
        abort: AtomicBool::new(false),
        deadline: start + load.timeout,
        start,
    });
    let consumers: Vec<_> = (0..load.consumers + load.cyclers)
        .map(|i| tokio::spawn(consumer(shared.clone(), i, i >= load.consumers)))
        .collect();
    let producers: Vec<_> = (0..load.producers)
        .map(|i| tokio::spawn(producer(shared.clone(), i)))
        .collect();

    let mut m = Measured::default();
    for p in producers {
        let out = p.await.context("producer task panicked")?;
        m.enqueued_ids.extend(out.ids);
        m.enqueue_us.extend(out.lat);
        if let Some(e) = out.error {
            if m.errors.len() < ERRORS_KEPT {
                m.errors.push(e);
            }
        }
    }
    let mut last_ack = None;
    let mut timed_out = false;
    for c in consumers {
        let out = c.await.context("consumer task panicked")?;
        m.enqueued_ids.extend(out.produced.ids);
        m.enqueue_us.extend(out.produced.lat);
        if let Some(e) = out.produced.error {
            if m.errors.len() < ERRORS_KEPT {
                m.errors.push(e);
            }
        }
        m.acked_ids.extend(out.acked);
        m.lease_us.extend(out.lease_lat);
        m.ack_us.extend(out.ack_lat);
        m.leased_jobs += out.leased;
        m.empty_leases += out.empty;
        m.ack_errors += out.ack_errors;
        m.consumer_requests += out.requests;
        m.next_jobs += out.next_jobs;
        for e in out.errors {
            if m.errors.len() < ERRORS_KEPT {
                m.errors.push(e);
            }
        }
        last_ack = last_ack.max(out.last_ack);
        timed_out |= out.timed_out;
    }
    m.elapsed = last_ack.map_or_else(|| shared.start.elapsed(), |t| t - shared.start);
    if timed_out {
        m.aborted = Some(format!(
            "timed out after {:?} with {} of {} jobs acked",
            load.timeout,
            shared.acked.load(Ordering::Relaxed),
            load.jobs
        ));
    } else if shared.abort.load(Ordering::Relaxed) {
        m.aborted = Some(
            m.errors
                .first()
                .cloned()
                .unwrap_or_else(|| "aborted".into()),
        );
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn batch_body_is_valid_json_with_round_robin_tenants() {
        let one = job_types(1);
        let shape = Shape {
            lane: BENCH_LANE,
            tenants: 2,
            types: &one,
        };
        let body = batch_body(10, 13, shape, "xxxx");
        let v: Value = serde_json::from_str(&body).unwrap();
        let jobs = v["jobs"].as_array().unwrap();
        assert_eq!(jobs.len(), 3);
        assert_eq!(jobs[0]["tenant"], "t0");
        assert_eq!(jobs[1]["tenant"], "t1");
        assert_eq!(jobs[2]["tenant"], "t0");
        assert_eq!(jobs[1]["lane"], "bench");
        assert_eq!(jobs[1]["type"], "bench");
        assert_eq!(jobs[1]["payload"], json!({"seq": 11, "data": "xxxx"}));
    }

    #[test]
    fn every_tenant_gets_every_type_in_turn() {
        let types = job_types(3);
        assert_eq!(types, ["bench-0", "bench-1", "bench-2"]);
        let shape = Shape {
            lane: BENCH_LANE,
            tenants: 2,
            types: &types,
        };
        let v: Value = serde_json::from_str(&batch_body(0, 12, shape, "x")).unwrap();
        let mut seen = std::collections::BTreeSet::new();
        for j in v["jobs"].as_array().unwrap() {
            seen.insert((
                j["tenant"].as_str().unwrap().to_owned(),
                j["type"].as_str().unwrap().to_owned(),
            ));
        }
        assert_eq!(seen.len(), 6, "2 tenants × 3 types: {seen:?}");
    }

    #[test]
    fn ids_of_either_json_kind_become_text() {
        let text = |json: &str| serde_json::from_str::<Text<'_>>(json).map(|t| t.0.into_owned());
        assert_eq!(text("42").unwrap(), "42");
        assert_eq!(text(r#""j_42""#).unwrap(), "j_42");
        assert_eq!(text(r#""a\"b""#).unwrap(), r#"a"b"#);
        assert!(text("null").is_err());
        assert!(text("[1]").is_err());
        // Plain strings are borrowed from the reply, not copied.
        let t: Text<'_> = serde_json::from_str(r#""17""#).unwrap();
        assert!(matches!(t.0, Cow::Borrowed("17")));
    }

    #[test]
    fn a_lease_reply_gives_ids_and_tokens_and_skips_the_rest() {
        let reply = br#"{"jobs":[
            {"id":"7","type":"bench","tenant":"t0","lane":"bench","payload":{"seq":1,"data":"x\"y"},
             "attempt":1,"idempotency_key":null,"schema_version":null,"lease_token":"99",
             "lease_expires_at":"2026-11-30T07:00:00.000Z","created_at":"2026-11-30T07:00:00.000Z"},
            {"id":8,"lease_token":"100"}]}"#;
        let r: LeaseReply<'_> = decode(LEASES, reply).unwrap();
        let got: Vec<_> = r
            .jobs
            .iter()
            .map(|j| (j.id.as_str(), j.lease_token.as_str()))
            .collect();
        assert_eq!(got, [("7", "99"), ("8", "100")]);
        let bad = decode::<LeaseReply<'_>>(LEASES, b"<html>").unwrap_err();
        assert_eq!(bad.to_string(), "POST /v1/leases: unexpected answer");
    }

    #[test]
    fn batch_replies_keep_the_servers_error_verbatim() {
        let reply = br#"{"results":[{"id":"1","state":"queued"},{"error":{"code":"POISON","message":"too big"}}]}"#;
        let r: BatchReply<'_> = decode("/v1/jobs/batch", reply).unwrap();
        assert_eq!(r.results[0].id.as_ref().map(Text::as_str), Some("1"));
        assert!(r.results[0].error.is_none());
        assert_eq!(
            r.results[1].error.map(RawValue::get),
            Some(r#"{"code":"POISON","message":"too big"}"#)
        );
        let acks: AcksReply<'_> = decode(
            ACKS,
            br#"{"results":[{"state":"succeeded"},{"error":{"code":"LEASE_LOST"}}]}"#,
        )
        .unwrap();
        let errors: Vec<_> = acks
            .results
            .iter()
            .map(|i| i.error.map(RawValue::get))
            .collect();
        assert_eq!(errors, [None, Some(r#"{"code":"LEASE_LOST"}"#)]);
    }

    #[test]
    fn request_bodies_are_what_the_api_expects() {
        let load = Load {
            jobs: 10,
            batch: 100,
            producers: 1,
            consumers: 1,
            cyclers: 0,
            payload_bytes: 4,
            tenants: 2,
            lease_ms: 30_000,
            timeout: Duration::from_secs(1),
            next: true,
            types: job_types(2),
            filter_types: false,
            backlog_type: None,
        };
        let next: Value = serde_json::from_str(next_body(3, &load).get()).unwrap();
        assert_eq!(
            next,
            json!({"worker_id": "bench-3", "lanes": ["bench"], "types": null,
                   "max_jobs": 1, "lease_ms": 30_000, "wait_ms": 0})
        );
        let lease: Value = serde_json::from_slice(&lease_body(3, &load)).unwrap();
        assert_eq!(
            lease,
            json!({"worker_id": "bench-3", "lanes": ["bench"], "types": null,
                   "max_jobs": 100, "lease_ms": 30_000, "wait_ms": LEASE_WAIT_MS})
        );
        let filtered = Load {
            filter_types: true,
            ..load.clone()
        };
        let lease: Value = serde_json::from_slice(&lease_body(3, &filtered)).unwrap();
        assert_eq!(lease["types"], json!(["bench-0", "bench-1"]));
        let reply = br#"{"jobs":[{"id":"7","lease_token":"99"},{"id":"8","lease_token":"1\"0"}]}"#;
        let leased: LeaseReply<'_> = decode(LEASES, reply).unwrap();
        let acks: Value = serde_json::from_slice(&acks_body(&leased.jobs)).unwrap();
        assert_eq!(
            acks,
            json!({"items": [{"id": "7", "lease_token": "99"}, {"id": "8", "lease_token": "1\"0"}]})
        );
    }
}
