//! Trace context end to end (issue #33, part 2): a W3C `traceparent`
//! taken at enqueue (header or field), handed to the worker with its
//! lease, kept on its dead letter; invalid ones refused (field) or ignored
//! (header); over RabbitMQ, taken from the message's header, sent to the
//! handler as a `traceparent` header and put on the redriven copy. With
//! the `otlp` feature, the spans that leave the process are checked at a
//! small OTLP receiver in this test (`otlp` below).
//!
//! On whichever store the harness runs (SQLite, or PostgreSQL with
//! `LAZARET_TEST_STORE=postgres`); the RabbitMQ test needs
//! `LAZARET_TEST_AMQP_URL` (skipped visibly without it, a failure under
//! `CI=true`).

use serde_json::{Value, json};

use crate::harness::{QUICK, Server, assert_error, id_text, job, lease_req};
use crate::team_handler::{Handler, ORDER_2};

/// The W3C example.
const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// Another valid one (sent as a header while a field names [`TP`]).
const TP_HEADER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

/// Enqueues `body` at `path` with a `traceparent` header.
async fn post_with_header(server: &Server, path: &str, body: &Value, tp: &str) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{}{path}", server.base()))
        .header("traceparent", tp)
        .json(body)
        .send()
        .await
        .expect("the server answers");
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

fn traced(payload: Value, tp: &str) -> Value {
    let mut j = job("resize", "acme", payload);
    j["traceparent"] = json!(tp);
    j
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traceparent_goes_from_enqueue_to_the_lease_and_the_dead_letter() {
    let server = Server::start(QUICK).await;
    let api = server.api();

    // As a field, and as a header.
    let by_field = api.enqueue_ok(&traced(json!({"n": 1}), TP)).await;
    let (status, by_header) = post_with_header(
        &server,
        "/v1/jobs",
        &job("resize", "acme", json!({"n": 2})),
        TP_HEADER,
    )
    .await;
    assert_eq!(status, 201, "{by_header}");
    assert_eq!(api.job(&by_field).await["traceparent"], TP);
    assert_eq!(api.job(&by_header["id"]).await["traceparent"], TP_HEADER);

    let leased = api.lease(&lease_req("w-1", 10, 30_000)).await;
    assert_eq!(leased.len(), 2, "{leased:?}");
    for j in &leased {
        let want = if j["id"] == by_field { TP } else { TP_HEADER };
        assert_eq!(j["traceparent"], want, "the lease reply hands it on: {j}");
        let failed = api
            .fail(
                &j["id"],
                &j["lease_token"],
                json!({"class": "permanent", "kind": "bad_input", "message": "no"}),
            )
            .await;
        assert_eq!(failed.expect(200)["state"], "dead_lettered");
    }
    let dl = api.dead_letter_of(&by_field).await;
    assert_eq!(dl["traceparent"], TP, "{dl}");
    let dl = api.dead_letter_of(&by_header["id"]).await;
    assert_eq!(dl["traceparent"], TP_HEADER, "{dl}");

    // Redriven, the job keeps its trace for its next worker.
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"ids": [id_text(&dl["id"])]}),
        )
        .await;
    assert_eq!(r.expect(200)["redriven"], 1, "{}", r.text());
    let again = api.lease_eventually(&lease_req("w-1", 1, 30_000)).await;
    assert_eq!(again[0]["traceparent"], TP_HEADER);

    // Without one: null, not absent.
    let plain = api
        .enqueue_ok(&job("resize", "acme", json!({"n": 3})))
        .await;
    let leased = api.lease_one(&lease_req("w-1", 1, 30_000)).await;
    assert_eq!(leased["id"], plain);
    assert!(
        leased.get("traceparent").is_some_and(Value::is_null),
        "{leased}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_traceparent_field_is_refused_and_a_bad_header_ignored() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    for bad in [
        "nonsense",
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
    ] {
        let r = api.enqueue(&traced(json!({}), bad)).await;
        let e = assert_error(&r, 400, "BAD_REQUEST", None);
        assert!(
            e["message"]
                .as_str()
                .is_some_and(|m| m.contains("traceparent")),
            "{e}"
        );
        // In a batch: that job's error, the others queued.
        let r = api
            .post(
                "/v1/jobs/batch",
                &json!({"jobs": [traced(json!({}), bad), job("resize", "acme", json!({}))]}),
            )
            .await;
        let results = &r.expect(200)["results"];
        assert_eq!(results[0]["error"]["code"], "BAD_REQUEST", "{results}");
        assert_eq!(results[1]["admission"], "ADMITTED", "{results}");
    }

    // A header that is not a traceparent is ignored: the job is queued
    // without one.
    let (status, body) = post_with_header(
        &server,
        "/v1/jobs",
        &job("resize", "acme", json!({})),
        "00-zz",
    )
    .await;
    assert_eq!(status, 201, "{body}");
    assert!(api.job(&body["id"]).await["traceparent"].is_null());

    // In a batch, a job's field wins over the request's header.
    let (status, body) = post_with_header(
        &server,
        "/v1/jobs/batch",
        &json!({"jobs": [traced(json!({}), TP), job("resize", "acme", json!({}))]}),
        TP_HEADER,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    let results = &body["results"];
    assert_eq!(api.job(&results[0]["id"]).await["traceparent"], TP);
    assert_eq!(api.job(&results[1]["id"]).await["traceparent"], TP_HEADER);
}

/// A guarded RabbitMQ queue: the message's `traceparent` header reaches the
/// handler as a `traceparent` HTTP header; its dead letter keeps it; the
/// redriven copy carries it on the broker (seen again by the handler, in
/// `Lazaret-Headers` beside the redrive id); an invalid one never becomes
/// the HTTP header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rabbitmq_message_carries_its_traceparent_to_the_handler_and_its_redriven_copy() {
    use lapin::options::BasicPublishOptions;
    use lapin::types::{AMQPValue, FieldTable};

    let test = "a_rabbitmq_message_carries_its_traceparent_to_the_handler_and_its_redriven_copy";
    let Some(url) = crate::sources::amqp_url(test) else {
        return;
    };
    let (_conn, ch, queue) = crate::sources::amqp_queue(&url, "traces").await;
    let handler = Handler::broken();
    let deliver = handler.start().await;
    let config = crate::sources::orders_from_rabbitmq(&url, &queue, &deliver);
    let server = Server::start(&config).await;
    let publish = |id: &'static str, tp: &'static str| {
        let mut headers = FieldTable::default();
        headers.insert("traceparent".into(), AMQPValue::LongString(tp.into()));
        let props = lapin::BasicProperties::default()
            .with_message_id(id.into())
            .with_headers(headers);
        let ch = ch.clone();
        let queue = queue.clone();
        async move {
            ch.basic_publish(
                "",
                &queue,
                BasicPublishOptions::default(),
                ORDER_2.as_bytes(),
                props,
            )
            .await
            .expect("publish")
            .await
            .expect("confirmed");
        }
    };
    publish("t-1", TP).await;
    publish("t-bad", "00-not-a-trace").await;

    let first = handler.deliveries("t-1", 1, &server).await;
    assert_eq!(first[0].header("traceparent"), TP);
    let bad = handler.deliveries("t-bad", 1, &server).await;
    assert!(
        bad[0].headers.get("traceparent").is_none(),
        "an invalid traceparent is dropped: {:?}",
        bad[0].headers
    );

    // Refused (permanent): quarantined with its trace.
    let dls = crate::team_handler::dead_letters(&server, "source=orders", 2).await;
    let dl = dls
        .iter()
        .find(|d| d["source"]["message_id"] == "t-1")
        .expect("t-1's dead letter");
    assert_eq!(dl["traceparent"], TP, "{dl}");
    let bad_dl = dls
        .iter()
        .find(|d| d["source"]["message_id"] == "t-bad")
        .expect("t-bad's dead letter");
    assert!(bad_dl["traceparent"].is_null(), "{bad_dl}");

    // Redriven: the copy on the broker carries the trace (and no invalid one).
    handler.mend();
    let api = server.api();
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"source": "orders"}}),
        )
        .await;
    assert_eq!(r.expect(200)["redriven"], 2, "{}", r.text());
    let again = handler.deliveries("t-1", 2, &server).await;
    let copy = &again[1];
    assert_eq!(copy.header("traceparent"), TP);
    let broker_headers: Value =
        serde_json::from_str(&copy.header("lazaret-headers")).expect("JSON headers");
    assert_eq!(broker_headers["traceparent"], TP, "{broker_headers}");
    assert!(
        broker_headers["x-lazaret-redrive-id"].is_string(),
        "the redriven copy: {broker_headers}"
    );
    let bad_again = handler.deliveries("t-bad", 2, &server).await;
    let bad_headers: Value =
        serde_json::from_str(&bad_again[1].header("lazaret-headers")).expect("JSON headers");
    assert!(
        bad_headers.get("traceparent").is_none(),
        "an invalid traceparent is not republished: {bad_headers}"
    );
}

/// The spans that leave the process over OTLP/HTTP (JSON), received by a
/// small collector in this test: each per-job span of one job carries the
/// job id and the trace id of the `traceparent` it was enqueued with.
#[cfg(feature = "otlp")]
mod otlp {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use axum::Router;
    use axum::body::Bytes;
    use axum::extract::State;
    use axum::routing::post;
    use serde_json::{Value, json};

    use super::{TP, traced};
    use crate::harness::{EVENTUALLY, QUICK, Server, id_text, lease_req};

    /// Every span received: (name, trace id, attributes as key → text).
    type Spans = Arc<Mutex<Vec<(String, String, Vec<(String, String)>)>>>;

    async fn collector() -> (String, Spans) {
        async fn traces(State(spans): State<Spans>, body: Bytes) -> &'static str {
            let doc: Value = serde_json::from_slice(&body).expect("OTLP/JSON");
            let mut got = spans.lock().expect("not poisoned");
            for rs in doc["resourceSpans"].as_array().into_iter().flatten() {
                for ss in rs["scopeSpans"].as_array().into_iter().flatten() {
                    for s in ss["spans"].as_array().into_iter().flatten() {
                        let attrs = s["attributes"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .map(|a| {
                                let v = &a["value"];
                                let text = ["stringValue", "intValue", "boolValue"]
                                    .iter()
                                    .find_map(|k| v.get(*k))
                                    .map(|v| match v {
                                        Value::String(s) => s.clone(),
                                        other => other.to_string(),
                                    })
                                    .unwrap_or_default();
                                (a["key"].as_str().unwrap_or_default().to_owned(), text)
                            })
                            .collect();
                        got.push((
                            s["name"].as_str().unwrap_or_default().to_owned(),
                            s["traceId"].as_str().unwrap_or_default().to_owned(),
                            attrs,
                        ));
                    }
                }
            }
            "{}"
        }
        let spans: Spans = Arc::default();
        let app = Router::new()
            .route("/v1/traces", post(traces))
            .with_state(Arc::clone(&spans));
        (crate::harness::serve_app(app).await, spans)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_spans_of_a_job_leave_over_otlp_in_its_trace() {
        let (endpoint, spans) = collector().await;
        let server = Server::start_env(
            QUICK,
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
                ("OTEL_SERVICE_NAME", "lazaret-test"),
                // Batches go out every 100 ms, not every 5 s.
                ("OTEL_BSP_SCHEDULE_DELAY", "100"),
            ],
        )
        .await;
        let api = server.api();
        let queued = api.enqueue_ok(&traced(json!({"n": 1}), TP)).await;
        let id = id_text(&queued);
        let j = api.lease_one(&lease_req("w-1", 1, 30_000)).await;
        assert_eq!(id_text(&j["id"]), id);
        // Handed to the worker: lazaret's lease span in the producer's trace.
        let handed = j["traceparent"].as_str().expect("a traceparent");
        assert_eq!(&handed[3..35], &TP[3..35], "the same trace: {handed}");
        api.fail(
            &j["id"],
            &j["lease_token"],
            json!({"class": "permanent", "kind": "bad_input", "message": "no"}),
        )
        .await
        .expect(200);

        let want = [
            "lazaret.admission",
            "lazaret.lease",
            "lazaret.outcome",
            "lazaret.dead_letter",
        ];
        let trace_id = &TP[3..35];
        let deadline = Instant::now() + EVENTUALLY;
        loop {
            let got = spans.lock().expect("not poisoned").clone();
            let of_job: Vec<_> = got
                .iter()
                .filter(|(_, _, attrs)| attrs.iter().any(|(k, v)| k == "job.id" && *v == id))
                .collect();
            if want
                .iter()
                .all(|w| of_job.iter().any(|(name, _, _)| name == w))
            {
                for (name, trace, attrs) in &of_job {
                    assert_eq!(trace, trace_id, "{name} in the traceparent's trace");
                    assert!(
                        attrs.iter().any(|(k, v)| k == "job.type" && v == "resize"),
                        "{name}: {attrs:?}"
                    );
                }
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the spans of job {id} never all arrived: {got:?}\n{}",
                server.output()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
