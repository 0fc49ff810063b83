//! Prometheus metrics: counters bumped where things happen, gauges set from
//! the store when `/metrics` is scraped.
//!
//! Label values are bounded, so a client cannot grow `/metrics` (and the
//! recorder's memory) without limit by sending random types or lanes: the
//! types and lanes named in the config (and the `default` lane) keep their
//! own series; of the others, the first [`LABEL_VALUES_MAX`] seen keep
//! theirs and every later one counts under `other`. A value that has a
//! series keeps it for the life of the process, so no counter goes
//! backwards.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, OnceLock};

use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
static GAUGE_LABELS: Mutex<BTreeSet<(String, String)>> = Mutex::new(BTreeSet::new());
/// Lanes given a depth so far: a lane whose jobs are all gone reads 0, not
/// its last value.
static LANES_SEEN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
static BREAKER_TYPES: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
static TYPES: Mutex<Bounded> = Mutex::new(Bounded::new());
static LANES: Mutex<Bounded> = Mutex::new(Bounded::new());

/// The bucket bounds of the time histograms, in seconds: from a lease
/// straight off the queue to an hour-long backlog or job.
pub const SECONDS_BUCKETS: [f64; 16] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
];

/// Values of the `type` label, and of the `lane` label, that are not in the
/// config and still get a series of their own: the first ones seen.
pub const LABEL_VALUES_MAX: usize = 64;

/// The label value that stands for every value past the bound.
pub const OTHER: &str = "other";

/// One label's values: the configured ones and the first
/// [`LABEL_VALUES_MAX`] others seen.
#[derive(Debug)]
struct Bounded {
    configured: BTreeSet<String>,
    seen: BTreeSet<String>,
}

impl Bounded {
    const fn new() -> Self {
        Bounded {
            configured: BTreeSet::new(),
            seen: BTreeSet::new(),
        }
    }

    fn label(&mut self, value: &str) -> String {
        if self.configured.contains(value) || self.seen.contains(value) {
            return value.to_owned();
        }
        if self.seen.len() < LABEL_VALUES_MAX {
            self.seen.insert(value.to_owned());
            return value.to_owned();
        }
        OTHER.to_owned()
    }
}

/// Names the configured types and lanes: they always keep their own series.
pub fn configure<'a>(
    types: impl IntoIterator<Item = &'a str>,
    lanes: impl IntoIterator<Item = &'a str>,
) {
    let mut t = TYPES.lock().unwrap_or_else(|p| p.into_inner());
    t.configured.extend(types.into_iter().map(str::to_owned));
    let mut l = LANES.lock().unwrap_or_else(|p| p.into_inner());
    l.configured.insert("default".to_owned());
    l.configured.extend(lanes.into_iter().map(str::to_owned));
    // Real series from the first scrape (`set_gauges` writes them): every
    // configured type's breaker, every configured lane's depth.
    BREAKER_TYPES
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(t.configured.iter().cloned());
    LANES_SEEN
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .extend(l.configured.iter().cloned());
}

/// The `type` label value for `ty`: itself, or `other` past the bound.
pub fn type_label(ty: &str) -> String {
    TYPES.lock().unwrap_or_else(|p| p.into_inner()).label(ty)
}

/// The `lane` label value for `lane`: itself, or `other` past the bound.
pub fn lane_label(lane: &str) -> String {
    LANES.lock().unwrap_or_else(|p| p.into_inner()).label(lane)
}

/// Installs the process-wide recorder once; later calls reuse it.
pub fn install() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        // Histograms as Prometheus histograms (buckets), not the
        // exporter's default summaries: buckets aggregate across nodes.
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
            .unwrap_or_else(|_| PrometheusBuilder::new());
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!(
                "a metrics recorder was already installed; lazaret metrics may be missing"
            );
        }
        handle
    })
}

/// A job admitted.
pub fn enqueued(ty: &str, lane: &str) {
    metrics::counter!("lazaret_jobs_enqueued_total", "type" => type_label(ty), "lane" => lane_label(lane)).increment(1);
}

/// A job leased after waiting `waited` since it became ready.
pub fn job_waited(lane: &str, waited: Duration) {
    metrics::histogram!("lazaret_job_wait_seconds", "lane" => lane_label(lane))
        .record(waited.as_secs_f64());
}

/// An attempt's outcome (ack, fail or expiry), `ran` after its lease.
pub fn job_ran(lane: &str, ran: Duration) {
    metrics::histogram!("lazaret_job_run_seconds", "lane" => lane_label(lane))
        .record(ran.as_secs_f64());
}

/// A job acknowledged.
pub fn succeeded(ty: &str) {
    metrics::counter!("lazaret_jobs_succeeded_total", "type" => type_label(ty)).increment(1);
}

/// A retry scheduled.
pub fn retried(ty: &str) {
    metrics::counter!("lazaret_jobs_retried_total", "type" => type_label(ty)).increment(1);
}

/// A job or payload dead-lettered.
pub fn dead_lettered(ty: &str, reason: &str, stage: &str) {
    metrics::counter!("lazaret_dead_lettered_total", "type" => type_label(ty), "reason" => reason.to_owned(), "stage" => stage.to_owned())
        .increment(1);
}

/// An admission record dropped by the per-tenant cap.
pub fn admission_record_dropped() {
    metrics::counter!("lazaret_admission_records_dropped_total").increment(1);
}

/// A lease expired.
pub fn lease_expired() {
    metrics::counter!("lazaret_lease_expired_total").increment(1);
}

/// Dead letters redriven.
pub fn redriven(n: u64) {
    metrics::counter!("lazaret_redriven_total").increment(n);
}

/// How a redriven job ended, by the failure group it was redriven from.
/// Groups are bounded by what operators redrive, not by traffic.
pub fn redrive_outcome(outcome: &'static str, group: String) {
    metrics::counter!("lazaret_redrive_outcomes_total", "outcome" => outcome, "group" => group)
        .increment(1);
}

/// What became of one delivery of a source's message (`succeeded`,
/// `retried`, `deferred`, `dead_lettered`). Source names come from the
/// config, so the series stay bounded.
pub fn source_delivery(source: &str, outcome: &'static str) {
    metrics::counter!("lazaret_source_deliveries_total", "source" => source.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// A watch source took in one of its broker's dead letters.
pub fn source_taken_in(source: &str) {
    metrics::counter!("lazaret_source_taken_in_total", "source" => source.to_owned()).increment(1);
}

/// A source handed a message back to its broker because lazaret could not
/// write its outcome (see `Host::given_back`).
pub fn source_given_back(source: &str) {
    metrics::counter!("lazaret_source_given_back_total", "source" => source.to_owned())
        .increment(1);
}

/// The broker delivered a source's message again without lazaret having
/// acknowledged it (see `Host::redelivered`): `recognised` when its
/// outcome was written already, `delivered` when the handler got it again.
pub fn source_redelivered(source: &str, recognised: bool) {
    let outcome = if recognised {
        "recognised"
    } else {
        "delivered"
    };
    metrics::counter!("lazaret_source_redeliveries_total", "source" => source.to_owned(), "outcome" => outcome)
        .increment(1);
}

/// Whether the store takes writes (1) or refuses them (0: a full disk).
pub fn store_writable(writable: bool) {
    metrics::gauge!("lazaret_store_writable").set(if writable { 1.0 } else { 0.0 });
}

/// Broker messages of a configured source whose retry lazaret holds now.
pub fn source_held(source: &str, held: u64) {
    metrics::gauge!("lazaret_source_held_retries", "source" => source.to_owned()).set(held as f64);
}

/// Makes a configured source's series exist from the start at 0, so a
/// scrape before its first message lists it.
pub fn describe_source(source: &str) {
    for outcome in SOURCE_OUTCOMES {
        metrics::counter!("lazaret_source_deliveries_total", "source" => source.to_owned(), "outcome" => outcome)
            .increment(0);
    }
    metrics::counter!("lazaret_source_taken_in_total", "source" => source.to_owned()).increment(0);
    metrics::counter!("lazaret_source_given_back_total", "source" => source.to_owned())
        .increment(0);
    for outcome in ["recognised", "delivered"] {
        metrics::counter!("lazaret_source_redeliveries_total", "source" => source.to_owned(), "outcome" => outcome)
            .increment(0);
    }
}

/// The `outcome` label values of `lazaret_source_deliveries_total`.
pub const SOURCE_OUTCOMES: [&str; 4] = ["succeeded", "retried", "deferred", "dead_lettered"];

/// An alert delivered to its target.
pub fn alert_sent(event: &str) {
    metrics::counter!("lazaret_alerts_sent_total", "event" => event.to_owned()).increment(1);
}

/// An alert that could not be delivered (every try failed, or its queue was full).
pub fn alert_failed(event: &str) {
    metrics::counter!("lazaret_alerts_failed_total", "event" => event.to_owned()).increment(1);
}

/// Open HTTP connections now.
pub fn connections(n: usize) {
    metrics::gauge!("lazaret_http_connections").set(n as f64);
}

/// A connection over the cap, answered 503 and closed.
pub fn connection_refused() {
    metrics::counter!("lazaret_http_connections_refused_total").increment(1);
}

/// An idle connection closed to make room for a new one at the cap.
pub fn connection_evicted() {
    metrics::counter!("lazaret_http_connections_evicted_total").increment(1);
}

/// A connection closed by a timeout: `headers` or `idle`.
pub fn connection_timed_out(what: &'static str) {
    metrics::counter!("lazaret_http_connection_timeouts_total", "timeout" => what).increment(1);
}

/// A refused request, by code.
pub fn rejected(code: &'static str) {
    metrics::counter!("lazaret_rejected_total", "code" => code).increment(1);
}

/// [`rejected`] by the code of an error answer.
pub fn rejected_code(code: &crate::error::Code) {
    // The server answers only named codes; `Other` is a client's.
    rejected(code.word().unwrap_or("INTERNAL"));
}

/// Sets the gauges from a fresh snapshot; gauges whose labels vanished go to 0.
pub fn set_gauges(
    lanes: &[(String, u64, u64, u64)],
    oldest_ready_age: &[(String, Duration)],
    dead_letters: &[(String, String, u64)],
    breakers: &[(String, bool)],
    dead_letters_over_warn: bool,
) {
    // Lanes and types past the bound are summed under `other`.
    let mut by_lane: BTreeMap<String, (u64, u64, u64)> = BTreeMap::new();
    for (lane, queued, scheduled, leased) in lanes {
        let e = by_lane.entry(lane_label(lane)).or_default();
        e.0 += queued;
        e.1 += scheduled;
        e.2 += leased;
    }
    let mut oldest: BTreeMap<String, Duration> = BTreeMap::new();
    for (lane, age) in oldest_ready_age {
        let e = oldest.entry(lane_label(lane)).or_default();
        *e = (*e).max(*age);
    }
    let mut seen_lanes = LANES_SEEN.lock().unwrap_or_else(|p| p.into_inner());
    seen_lanes.extend(by_lane.keys().cloned());
    seen_lanes.extend(oldest.keys().cloned());
    for lane in seen_lanes.iter() {
        let (queued, scheduled, leased) = by_lane.get(lane).copied().unwrap_or_default();
        metrics::gauge!("lazaret_queue_depth", "lane" => lane.clone())
            .set((queued + scheduled) as f64);
        metrics::gauge!("lazaret_jobs_ready", "lane" => lane.clone()).set(queued as f64);
        metrics::gauge!("lazaret_jobs_leased", "lane" => lane.clone()).set(leased as f64);
        let age = oldest.get(lane).copied().unwrap_or_default();
        metrics::gauge!("lazaret_oldest_job_age_seconds", "lane" => lane.clone())
            .set(age.as_secs_f64());
    }
    drop(seen_lanes);
    let mut by_type: BTreeMap<(String, String), u64> = BTreeMap::new();
    for (ty, reason, n) in dead_letters {
        *by_type.entry((type_label(ty), reason.clone())).or_default() += n;
    }
    let mut seen = BTreeSet::new();
    for ((ty, reason), n) in by_type {
        metrics::gauge!("lazaret_dead_letters", "type" => ty.clone(), "reason" => reason.clone())
            .set(n as f64);
        seen.insert((ty, reason));
    }
    let mut old = GAUGE_LABELS.lock().unwrap_or_else(|p| p.into_inner());
    for (ty, reason) in old.difference(&seen) {
        metrics::gauge!("lazaret_dead_letters", "type" => ty.clone(), "reason" => reason.clone())
            .set(0.0);
    }
    *old = seen;
    // A type reported once stays reported: 0 once its breakers close.
    let mut types = BREAKER_TYPES.lock().unwrap_or_else(|p| p.into_inner());
    let breakers: Vec<(String, bool)> = breakers
        .iter()
        .map(|(ty, open)| (type_label(ty), *open))
        .collect();
    for (ty, _) in &breakers {
        types.insert(ty.clone());
    }
    for ty in types.iter() {
        let open = breakers.iter().any(|(t, open)| t == ty && *open);
        metrics::gauge!("lazaret_breaker_open", "type" => ty.clone()).set(if open {
            1.0
        } else {
            0.0
        });
    }
    metrics::gauge!("lazaret_dead_letters_over_warn").set(if dead_letters_over_warn {
        1.0
    } else {
        0.0
    });
}

/// A metric family: its name, Prometheus type and help text.
struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
}

const fn family(name: &'static str, kind: &'static str, help: &'static str) -> Family {
    Family { name, kind, help }
}

/// Every family lazaret exports. `/metrics` lists each with `# HELP` and
/// `# TYPE`, also before its first sample (a family with no series yet is
/// its two comment lines and nothing else: no placeholder series with
/// empty labels). Times are in seconds.
const FAMILIES: &[Family] = &[
    family(
        "lazaret_build_info",
        "gauge",
        "Always 1; the version of this lazaret in the version label",
    ),
    family(
        "lazaret_jobs_enqueued_total",
        "counter",
        "Jobs admitted, by type and lane",
    ),
    family(
        "lazaret_jobs_succeeded_total",
        "counter",
        "Jobs acknowledged by a worker, by type",
    ),
    family(
        "lazaret_jobs_retried_total",
        "counter",
        "Failed attempts rescheduled for a retry, by type",
    ),
    family(
        "lazaret_dead_lettered_total",
        "counter",
        "Dead letters written, by type, reason and stage (admission, processing, broker)",
    ),
    family(
        "lazaret_dead_letters",
        "gauge",
        "Dead letters held now, by type and reason",
    ),
    family(
        "lazaret_dead_letters_over_warn",
        "gauge",
        "1 while the dead letters held outnumber dead_letters_warn",
    ),
    family(
        "lazaret_admission_records_dropped_total",
        "counter",
        "Admission records not kept because the per-tenant, per-minute cap was reached",
    ),
    family(
        "lazaret_lease_expired_total",
        "counter",
        "Leases that ran out without an ack or fail",
    ),
    family("lazaret_redriven_total", "counter", "Dead letters redriven"),
    family(
        "lazaret_redrive_outcomes_total",
        "counter",
        "How redriven jobs ended, by outcome (succeeded, dead_lettered) and the failure group they were redriven from",
    ),
    family(
        "lazaret_queue_depth",
        "gauge",
        "Jobs waiting, ready or scheduled, by lane",
    ),
    family(
        "lazaret_jobs_ready",
        "gauge",
        "Jobs ready to lease now, by lane",
    ),
    family(
        "lazaret_jobs_leased",
        "gauge",
        "Jobs held by workers now, by lane",
    ),
    family(
        "lazaret_oldest_job_age_seconds",
        "gauge",
        "How long the longest-waiting ready job has waited since it became ready, by lane (0: none ready)",
    ),
    family(
        "lazaret_job_wait_seconds",
        "histogram",
        "Time from a job becoming ready (enqueue, or its delay, retry or deferral coming due) to its lease, by lane",
    ),
    family(
        "lazaret_job_run_seconds",
        "histogram",
        "Time from a lease to its outcome (ack, fail or lease expiry), by lane",
    ),
    family(
        "lazaret_breaker_open",
        "gauge",
        "1 while a breaker of the type is open (half-open reads 0: it admits probes), by type",
    ),
    family(
        "lazaret_rejected_total",
        "counter",
        "Requests refused, by error code",
    ),
    family(
        "lazaret_source_deliveries_total",
        "counter",
        "Deliveries of source messages to their handler, by source and outcome (succeeded, retried, deferred, dead_lettered)",
    ),
    family(
        "lazaret_source_taken_in_total",
        "counter",
        "Dead letters a watch source took in from its broker, by source",
    ),
    family(
        "lazaret_source_given_back_total",
        "counter",
        "Messages a source handed back to its broker (nack with requeue) because lazaret could not write their outcome and could hold them no longer; each raises the broker's delivery count, by source",
    ),
    family(
        "lazaret_source_redeliveries_total",
        "counter",
        "Messages the broker delivered again that lazaret had not acknowledged (its own at-least-once: a dead consumer, a lost connection, a rebalance, an expired visibility), by source and outcome: recognised (their outcome was written already; only acknowledged) or delivered (handed to the handler again: a possible duplicate)",
    ),
    family(
        "lazaret_store_writable",
        "gauge",
        "1 while the store takes writes, 0 while it refuses them (a full disk); the sources then take no messages",
    ),
    family(
        "lazaret_source_held_retries",
        "gauge",
        "Broker messages whose retry or deferral lazaret holds now, by source",
    ),
    family(
        "lazaret_alerts_sent_total",
        "counter",
        "Alerts delivered to an [[alerts]] target, by event",
    ),
    family(
        "lazaret_alerts_failed_total",
        "counter",
        "Alerts not delivered (every try failed, or the target's queue was full), by event",
    ),
    family("lazaret_http_connections", "gauge", "Open HTTP connections"),
    family(
        "lazaret_http_connections_refused_total",
        "counter",
        "Connections over connections_max, answered 503 and closed",
    ),
    family(
        "lazaret_http_connections_evicted_total",
        "counter",
        "Idle connections closed to make room at connections_max",
    ),
    family(
        "lazaret_http_connection_timeouts_total",
        "counter",
        "Connections closed by a timeout, by timeout (headers, idle)",
    ),
];

/// Names every family (its `# HELP`) and sets `lazaret_build_info`.
pub fn describe() {
    for f in FAMILIES {
        match f.kind {
            "counter" => metrics::describe_counter!(f.name, f.help),
            "histogram" => metrics::describe_histogram!(f.name, metrics::Unit::Seconds, f.help),
            _ => metrics::describe_gauge!(f.name, f.help),
        }
    }
    metrics::gauge!("lazaret_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// The exposition text: what the recorder renders, then `# HELP` and
/// `# TYPE` of every family that has no series yet.
pub fn render() -> String {
    let mut text = install().render();
    for f in FAMILIES {
        if !text.contains(&format!("# TYPE {} ", f.name)) {
            if !text.is_empty() && !text.ends_with('\n') {
                text.push('\n');
            }
            text.push_str(&format!(
                "# HELP {} {}\n# TYPE {} {}\n",
                f.name, f.help, f.name, f.kind
            ));
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configured_values_and_the_first_others_keep_their_label() {
        let mut b = Bounded::new();
        b.configured.insert("send_email".into());
        for i in 0..LABEL_VALUES_MAX {
            assert_eq!(b.label(&format!("t{i}")), format!("t{i}"));
        }
        assert_eq!(b.label("late"), OTHER);
        assert_eq!(b.label("t0"), "t0", "a value with a series keeps it");
        assert_eq!(b.label("send_email"), "send_email");
        assert_eq!(b.seen.len(), LABEL_VALUES_MAX);
    }
}
