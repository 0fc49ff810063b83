//! The load itself: the backlog fill, and producers and consumers running at once.

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde::Deserialize;
use serde_json::Value;

/// Jobs per request when filling the backlog.
pub const BACKLOG_BATCH: u64 = 1000;
/// Concurrent requests when filling the backlog.
const BACKLOG_CONCURRENCY: u64 = 4;
/// The lane the measured jobs go to (and the only one consumers lease).
pub const BENCH_LANE: &str = "bench";
/// The lane of the backlog, which nobody leases.
pub const BACKLOG_LANE: &str = "backlog";
/// The type of every bench job.
const JOB_TYPE: &str = "bench";
/// Long-poll of each lease request.
const LEASE_WAIT_MS: u64 = 1000;
/// Errors kept verbatim for the report.
const ERRORS_KEPT: usize = 5;

/// A thin HTTP client for the few endpoints the bench uses.
#[derive(Debug, Clone)]
pub struct Api {
    client: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Api {
    pub fn new(client: reqwest::Client, base: &str, token: Option<String>) -> Self {
        Api {
            client,
            base: base.trim_end_matches('/').to_owned(),
            token,
        }
    }

    /// POSTs a JSON body and decodes the 2xx answer as `T`; any other
    /// status is an error naming the endpoint, status and body.
    async fn post<T: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: String,
    ) -> anyhow::Result<T> {
        let mut req = self
            .client
            .post(format!("{}{path}", self.base))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(token) = &self.token {
            req = req.bearer_auth(token);
        }
        let resp = req.send().await.with_context(|| format!("POST {path}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            bail!("POST {path}: {status}: {text}");
        }
        resp.json()
            .await
            .with_context(|| format!("POST {path}: unexpected answer"))
    }
}

/// The shape of the load.
#[derive(Debug, Clone)]
pub struct Load {
    pub jobs: u64,
    pub batch: u64,
    pub producers: u64,
    pub consumers: u64,
    pub payload_bytes: usize,
    pub tenants: u64,
    pub lease_ms: u64,
    pub timeout: Duration,
}

/// Appends one job object to `out`. Every piece is plain ASCII with nothing
/// to escape, so the JSON is written by hand (the bench client shares the
/// machine with the server, so its CPU counts).
pub fn push_job(out: &mut String, seq: u64, lane: &str, tenants: u64, data: &str) {
    let tenant = seq % tenants.max(1);
    let _ = write!(
        out,
        r#"{{"type":"{JOB_TYPE}","tenant":"t{tenant}","lane":"{lane}","payload":{{"seq":{seq},"data":"{data}"}}}}"#
    );
}

/// `{"jobs":[...]}` for jobs `from..to`.
pub fn batch_body(from: u64, to: u64, lane: &str, tenants: u64, data: &str) -> String {
    let mut out = String::with_capacity((to - from) as usize * (data.len() + 96) + 16);
    out.push_str(r#"{"jobs":["#);
    for seq in from..to {
        if seq > from {
            out.push(',');
        }
        push_job(&mut out, seq, lane, tenants, data);
    }
    out.push_str("]}");
    out
}

/// An id as text, whether the server sends numbers or strings.
fn id_key(id: &Value) -> String {
    match id {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[derive(Deserialize)]
struct Enqueued {
    id: Value,
}

#[derive(Deserialize)]
struct BatchReply {
    results: Vec<BatchItem>,
}

#[derive(Deserialize)]
struct BatchItem {
    id: Option<Value>,
    error: Option<Value>,
}

#[derive(Deserialize)]
struct LeaseReply {
    jobs: Vec<Leased>,
}

#[derive(Deserialize)]
struct Leased {
    id: Value,
    lease_token: Value,
}

#[derive(Deserialize)]
struct AcksReply {
    results: Vec<AckItem>,
}

#[derive(Deserialize)]
struct AckItem {
    error: Option<Value>,
}

/// Enqueues a batch and returns the ids in order; any refused job is an error.
async fn enqueue_batch(api: &Api, body: String, expect: u64) -> anyhow::Result<Vec<String>> {
    let reply: BatchReply = api.post("/v1/jobs/batch", body).await?;
    if reply.results.len() as u64 != expect {
        bail!(
            "POST /v1/jobs/batch: {} results for {expect} jobs",
            reply.results.len()
        );
    }
    reply
        .results
        .into_iter()
        .map(|r| match (r.error, r.id) {
            (None, Some(id)) => Ok(id_key(&id)),
            (Some(e), _) => bail!("POST /v1/jobs/batch refused a job: {e}"),
            (None, None) => bail!("POST /v1/jobs/batch: a result with neither id nor error"),
        })
        .collect()
}

/// Fills lane `backlog` with `n` jobs in batches of 1000; returns the time it took.
pub async fn fill_backlog(api: &Api, n: u64, load: &Load) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let data = Arc::new("x".repeat(load.payload_bytes));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..BACKLOG_CONCURRENCY {
        let (api, next, done, data, tenants) = (
            api.clone(),
            next.clone(),
            done.clone(),
            data.clone(),
            load.tenants,
        );
        tasks.spawn(async move {
            loop {
                let from = next.fetch_add(BACKLOG_BATCH, Ordering::Relaxed);
                if from >= n {
                    return anyhow::Ok(());
                }
                let to = (from + BACKLOG_BATCH).min(n);
                // Sequence numbers far above the measured jobs', for telling them apart.
                let body = batch_body(
                    from + (1 << 40),
                    to + (1 << 40),
                    BACKLOG_LANE,
                    tenants,
                    &data,
                );
                enqueue_batch(&api, body, to - from).await?;
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
    /// The first few errors verbatim.
    pub errors: Vec<String>,
    /// Set when the run stopped early (an error or the timeout).
    pub aborted: Option<String>,
}

struct Shared {
    api: Api,
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
    acked: Vec<String>,
    lease_lat: Vec<u64>,
    ack_lat: Vec<u64>,
    leased: u64,
    empty: u64,
    ack_errors: u64,
    errors: Vec<String>,
    last_ack: Option<Instant>,
    timed_out: bool,
}

fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

async fn producer(s: Arc<Shared>) -> ProducerOut {
    let mut out = ProducerOut::default();
    let batch = s.load.batch;
    while !s.stopping() {
        let from = s.next_job.fetch_add(batch, Ordering::Relaxed);
        if from >= s.load.jobs {
            break;
        }
        let to = (from + batch).min(s.load.jobs);
        let t = Instant::now();
        let result = if batch == 1 {
            let mut body = String::with_capacity(s.data.len() + 96);
            push_job(&mut body, from, BENCH_LANE, s.load.tenants, &s.data);
            s.api
                .post::<Enqueued>("/v1/jobs", body)
                .await
                .map(|e| vec![id_key(&e.id)])
        } else {
            let body = batch_body(from, to, BENCH_LANE, s.load.tenants, &s.data);
            enqueue_batch(&s.api, body, to - from).await
        };
        out.lat.push(micros(t));
        match result {
            Ok(ids) => out.ids.extend(ids),
            Err(e) => {
                out.error = Some(format!("{e:#}"));
                s.abort.store(true, Ordering::Relaxed);
                break;
            }
        }
    }
    out
}

async fn consumer(s: Arc<Shared>, index: u64) -> ConsumerOut {
    let mut out = ConsumerOut::default();
    let lease_body = serde_json::json!({
        "worker_id": format!("bench-{index}"),
        "lanes": [BENCH_LANE],
        "types": null,
        "max_jobs": s.load.batch,
        "lease_ms": s.load.lease_ms,
        "wait_ms": LEASE_WAIT_MS,
    })
    .to_string();
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
        let t = Instant::now();
        let leased = s
            .api
            .post::<LeaseReply>("/v1/leases", lease_body.clone())
            .await;
        let lat = micros(t);
        let jobs = match leased {
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
            let items: Vec<Value> = jobs
                .iter()
                .map(|j| serde_json::json!({"id": j.id, "lease_token": j.lease_token}))
                .collect();
            let body = serde_json::json!({ "items": items }).to_string();
            let t = Instant::now();
            let acked = s.api.post::<AcksReply>("/v1/acks", body).await;
            out.ack_lat.push(micros(t));
            match acked {
                Ok(r) if r.results.len() == jobs.len() => {
                    let mut ok = 0;
                    for (job, item) in jobs.iter().zip(r.results) {
                        match item.error {
                            None => {
                                out.acked.push(id_key(&job.id));
                                ok += 1;
                            }
                            Some(e) => {
                                out.ack_errors += 1;
                                fail(
                                    &mut out,
                                    anyhow::anyhow!("ack of job {} refused: {e}", job.id),
                                );
                            }
                        }
                    }
                    s.acked.fetch_add(ok, Ordering::Relaxed);
                    out.last_ack = Some(Instant::now());
                }
                Ok(r) => {
                    out.ack_errors += jobs.len() as u64;
                    let e = anyhow::anyhow!(
                        "POST /v1/acks: {} results for {} items",
                        r.results.len(),
                        jobs.len()
                    );
                    fail(&mut out, e);
                }
                Err(e) => {
                    out.ack_errors += jobs.len() as u64;
                    fail(&mut out, e);
                }
            }
        } else {
            for job in &jobs {
                let body = serde_json::json!({ "lease_token": job.lease_token }).to_string();
                let path = format!("/v1/jobs/{}/ack", id_key(&job.id));
                let t = Instant::now();
                let acked = s.api.post::<serde::de::IgnoredAny>(&path, body).await;
                out.ack_lat.push(micros(t));
                match acked {
                    Ok(_) => {
                        out.acked.push(id_key(&job.id));
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
/// from the first enqueue until the last of `load.jobs` jobs is acked.
pub async fn run_load(api: &Api, load: &Load) -> anyhow::Result<Measured> {
    let start = Instant::now();
    let shared = Arc::new(Shared {
        api: api.clone(),
        load: load.clone(),
        data: "x".repeat(load.payload_bytes),
        next_job: AtomicU64::new(0),
        acked: AtomicU64::new(0),
        abort: AtomicBool::new(false),
        deadline: start + load.timeout,
        start,
    });
    let consumers: Vec<_> = (0..load.consumers)
        .map(|i| tokio::spawn(consumer(shared.clone(), i)))
        .collect();
    let producers: Vec<_> = (0..load.producers)
        .map(|_| tokio::spawn(producer(shared.clone())))
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
        m.acked_ids.extend(out.acked);
        m.lease_us.extend(out.lease_lat);
        m.ack_us.extend(out.ack_lat);
        m.leased_jobs += out.leased;
        m.empty_leases += out.empty;
        m.ack_errors += out.ack_errors;
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
    use super::*;

    #[test]
    fn batch_body_is_valid_json_with_round_robin_tenants() {
        let body = batch_body(10, 13, BENCH_LANE, 2, "xxxx");
        let v: Value = serde_json::from_str(&body).unwrap();
        let jobs = v["jobs"].as_array().unwrap();
        assert_eq!(jobs.len(), 3);
        assert_eq!(jobs[0]["tenant"], "t0");
        assert_eq!(jobs[1]["tenant"], "t1");
        assert_eq!(jobs[2]["tenant"], "t0");
        assert_eq!(jobs[1]["lane"], "bench");
        assert_eq!(jobs[1]["type"], "bench");
        assert_eq!(
            jobs[1]["payload"],
            serde_json::json!({"seq": 11, "data": "xxxx"})
        );
    }

    #[test]
    fn ids_of_either_json_kind_become_text() {
        assert_eq!(id_key(&serde_json::json!(42)), "42");
        assert_eq!(id_key(&serde_json::json!("j_42")), "j_42");
    }
}
