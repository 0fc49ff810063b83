//! Metrics: `/metrics` read with a Prometheus text parser while jobs flow.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use prometheus_parse::{Sample, Scrape, Value as PromValue};
use serde_json::json;

use crate::harness::{EVENTUALLY, QUICK, Server, job, lease_req};

/// `/metrics`, parsed; also checks that every family has `# HELP` and `# TYPE`.
async fn scrape(server: &Server) -> Scrape {
    let text = server.api().get("/metrics").await.text();
    let typed: BTreeSet<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    let scrape = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).expect("valid exposition");
    for s in &scrape.samples {
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| {
                s.metric
                    .strip_suffix(suffix)
                    .filter(|base| typed.contains(base))
            })
            .unwrap_or(&s.metric);
        assert!(typed.contains(family), "no # TYPE for {}: {text}", s.metric);
        assert!(
            scrape.docs.contains_key(family),
            "no # HELP for {}",
            s.metric
        );
        for (k, v) in s.labels.iter() {
            assert!(
                !v.is_empty(),
                "a placeholder series {}{{{k}=\"\"}}: {text}",
                s.metric
            );
        }
    }
    scrape
}

/// The value of the one sample of `metric` whose labels include `labels`
/// (0 when there is none); a histogram's count of observations.
fn value(scrape: &Scrape, metric: &str, labels: &[(&str, &str)]) -> f64 {
    let matching: Vec<&Sample> = scrape
        .samples
        .iter()
        .filter(|s| s.metric == metric && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .collect();
    assert!(
        matching.len() <= 1,
        "{metric} {labels:?} names more than one series: {matching:?}"
    );
    matching.first().map_or(0.0, |s| match &s.value {
        PromValue::Counter(v) | PromValue::Gauge(v) | PromValue::Untyped(v) => *v,
        PromValue::Histogram(buckets) => buckets.iter().map(|b| b.count).fold(0.0, f64::max),
        PromValue::Summary(_) => panic!("{metric} is a summary, not a histogram"),
    })
}

/// A histogram's buckets: cumulative, and its +Inf bucket equals `_count`.
fn assert_histogram(scrape: &Scrape, metric: &str, lane: &str) -> f64 {
    let s = scrape
        .samples
        .iter()
        .find(|s| s.metric == metric && s.labels.get("lane") == Some(lane))
        .unwrap_or_else(|| panic!("no {metric} for lane {lane}"));
    let PromValue::Histogram(buckets) = &s.value else {
        panic!("{metric} is not a histogram: {s:?}");
    };
    assert!(buckets.len() > 5, "{buckets:?}");
    for w in buckets.windows(2) {
        assert!(
            w[0].less_than < w[1].less_than && w[0].count <= w[1].count,
            "{buckets:?}"
        );
    }
    let inf = buckets.last().unwrap();
    assert!(inf.less_than.is_infinite(), "{buckets:?}");
    let count = value(scrape, &format!("{metric}_count"), &[("lane", lane)]);
    assert_eq!(inf.count, count, "{metric}: +Inf bucket and _count");
    count
}

#[tokio::test]
async fn values_move_as_jobs_flow() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let lane = [("lane", "interactive")];

    let before = scrape(&server).await;
    let build = before
        .samples
        .iter()
        .find(|s| s.metric == "lazaret_build_info")
        .expect("lazaret_build_info");
    assert!(
        build.labels.get("version").is_some_and(|v| !v.is_empty()),
        "{build:?}"
    );
    assert_eq!(value(&before, "lazaret_queue_depth", &lane), 0.0);
    assert_eq!(value(&before, "lazaret_oldest_job_age_seconds", &lane), 0.0);
    assert_eq!(value(&before, "lazaret_job_wait_seconds", &lane), 0.0);

    let mut ids = Vec::new();
    for n in 0..3 {
        let mut j = job("resize", "acme", json!({"n": n}));
        j["lane"] = json!("interactive");
        ids.push(api.enqueue_ok(&j).await);
    }
    // The oldest job's age grows while it waits (each scrape reads the clock).
    let deadline = Instant::now() + EVENTUALLY;
    let queued = loop {
        let s = scrape(&server).await;
        if value(&s, "lazaret_oldest_job_age_seconds", &lane) > 0.0 {
            break s;
        }
        assert!(Instant::now() < deadline, "the oldest job's age stays 0");
    };
    assert_eq!(value(&queued, "lazaret_queue_depth", &lane), 3.0);
    assert_eq!(value(&queued, "lazaret_jobs_ready", &lane), 3.0);
    assert_eq!(
        value(
            &queued,
            "lazaret_jobs_enqueued_total",
            &[("type", "resize"), ("lane", "interactive")]
        ),
        3.0
    );

    // Lease all three: three waits observed; ack one, fail one, one expires unseen.
    let mut req = lease_req("w", 3, 30_000);
    req["lanes"] = json!(["interactive"]);
    let mut leased = Vec::new();
    while leased.len() < 3 {
        leased.extend(api.lease_eventually(&req).await);
    }
    let s = scrape(&server).await;
    assert_eq!(
        assert_histogram(&s, "lazaret_job_wait_seconds", "interactive"),
        3.0
    );
    assert_eq!(value(&s, "lazaret_jobs_leased", &lane), 3.0);
    assert_eq!(value(&s, "lazaret_queue_depth", &lane), 0.0);
    assert_eq!(
        value(&s, "lazaret_oldest_job_age_seconds", &lane),
        0.0,
        "none ready"
    );
    assert_eq!(value(&s, "lazaret_job_run_seconds", &lane), 0.0);

    api.ack(&leased[0]["id"], &leased[0]["lease_token"])
        .await
        .expect(200);
    api.fail(
        &leased[1]["id"],
        &leased[1]["lease_token"],
        json!({"class": "permanent", "kind": "bad_input", "message": "not a PNG"}),
    )
    .await
    .expect(200);
    let s = scrape(&server).await;
    assert_eq!(
        assert_histogram(&s, "lazaret_job_run_seconds", "interactive"),
        2.0
    );
    assert_eq!(
        value(&s, "lazaret_jobs_succeeded_total", &[("type", "resize")]),
        1.0
    );
    assert_eq!(
        value(
            &s,
            "lazaret_dead_letters",
            &[("type", "resize"), ("reason", "permanent")]
        ),
        1.0
    );
    assert_eq!(
        value(
            &s,
            "lazaret_dead_lettered_total",
            &[
                ("type", "resize"),
                ("reason", "permanent"),
                ("stage", "processing")
            ]
        ),
        1.0
    );
    assert_eq!(value(&s, "lazaret_jobs_leased", &lane), 1.0);
    // Seconds, not milliseconds: nothing here took an hour.
    let sum = value(&s, "lazaret_job_run_seconds_sum", &lane);
    assert!((0.0..3600.0).contains(&sum), "{sum}");
}

#[tokio::test]
async fn five_thousand_random_types_do_not_make_five_thousand_series() {
    let server = Server::start(&format!("{QUICK}\n[types.configured]\n")).await;
    let api = server.api();
    for batch in 0..20 {
        let jobs: Vec<_> = (0..250)
            .map(|i| {
                let mut j = job(&format!("random-{batch}-{i}"), "acme", json!({}));
                j["lane"] = json!(format!("lane-{batch}-{i}"));
                j
            })
            .collect();
        let r = api.post("/v1/jobs/batch", &json!({"jobs": jobs})).await;
        let body = r.expect(200);
        assert!(
            body["results"]
                .as_array()
                .unwrap()
                .iter()
                .all(|x| x["id"].is_string() || x["id"].is_number()),
            "{body}"
        );
    }
    api.enqueue_ok(&job("configured", "acme", json!({}))).await;

    let s = scrape(&server).await;
    let mut series: BTreeMap<&str, usize> = BTreeMap::new();
    let mut types = BTreeSet::new();
    for sample in &s.samples {
        *series.entry(sample.metric.as_str()).or_default() += 1;
        if let Some(t) = sample.labels.get("type") {
            types.insert(t.to_owned());
        }
    }
    // The configured type, the first 64 others, and `other`.
    assert!(
        types.contains("configured") && types.contains("other"),
        "{types:?}"
    );
    assert!(types.len() <= 66, "{} type values: {types:?}", types.len());
    for (metric, n) in &series {
        assert!(*n <= 200, "{metric} has {n} series");
    }
    let enqueued: f64 = s
        .samples
        .iter()
        .filter(|x| x.metric == "lazaret_jobs_enqueued_total")
        .map(|x| match x.value {
            PromValue::Counter(v) | PromValue::Untyped(v) => v,
            _ => 0.0,
        })
        .sum();
    assert_eq!(enqueued, 5001.0, "every job is still counted");
}
