//! `[[sources]]` end to end: `lazaret serve` guarding a Redis stream and
//! delivering to a handler in this test; the contract's delivery headers,
//! quarantine of a message the handler refuses, its dead letter read over
//! the API and the CLI, and a redrive that republishes it to the stream.
//! Config mistakes in `[[sources]]` are refused at start.
//!
//! The Redis tests need `LAZARET_TEST_REDIS_URL` (`redis://127.0.0.1:6379`);
//! without it they are skipped with a message, and fail under `CI=true`.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use lazaret_testkit::eventually;

use crate::harness::{EVENTUALLY, QUICK, Server, cli, id_text, serve_refused};
use crate::team_handler::{Handler, ORDER_1, ORDER_2, percent_decode, service};

/// The source's name.
const SOURCE: &str = "orders";

/// The Redis URL, or `None` after saying the test is skipped.
fn redis_url(test: &str) -> Option<String> {
    service("LAZARET_TEST_REDIS_URL", "redis://127.0.0.1:6379", test)
}

/// A stream of its own, deleted when dropped.
struct Stream {
    client: redis::Client,
    key: String,
}

impl Stream {
    fn new(url: &str) -> Stream {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("after 1970")
            .as_nanos();
        Stream {
            client: redis::Client::open(url).expect("a valid Redis URL"),
            key: format!("lz-sources-{}-{nanos}", std::process::id()),
        }
    }

    /// `XADD` as the team's producer would: a JSON body, a message id, a
    /// content type and one header of the team's own.
    async fn produce(&self, message_id: &str, body: &str, tenant: &str) {
        let mut con = self
            .client
            .get_multiplexed_async_connection()
            .await
            .expect("Redis answers");
        let _: String = redis::cmd("XADD")
            .arg(&self.key)
            .arg("*")
            .arg("body")
            .arg(body)
            .arg("message_id")
            .arg(message_id)
            .arg("content_type")
            .arg("application/json")
            .arg("tenant")
            .arg(tenant)
            .query_async(&mut con)
            .await
            .expect("XADD");
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Ok(mut con) = self.client.get_connection() {
            let _: Result<i64, _> = redis::cmd("DEL").arg(&self.key).query(&mut con);
        }
    }
}

/// The sum of a counter's series whose line holds every one of `labels`
/// (`name="value"`), or `None` when there is none.
pub(crate) fn counter(metrics: &str, name: &str, labels: &[&str]) -> Option<f64> {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| labels.iter().all(|want| l.contains(want)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}

/// `lazaret_source_deliveries_total` of the source's successes.
async fn succeeded(api: &crate::harness::Api) -> Option<f64> {
    let metrics = api.get("/metrics").await.text();
    counter(
        &metrics,
        "lazaret_source_deliveries_total",
        &[r#"source="orders""#, r#"outcome="succeeded""#],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_redis_stream_delivers_quarantines_and_redrives() {
    let test = "a_guarded_redis_stream_delivers_quarantines_and_redrives";
    let Some(url) = redis_url(test) else { return };
    let stream = Stream::new(&url);
    let handler = Handler::broken();
    let deliver = handler.start().await;
    let config = format!(
        r#"{QUICK}
[[sources]]
name = "{SOURCE}"
broker = "redis"
url = "{url}"
queue = "{queue}"
deliver = "{deliver}"
tenant_header = "tenant"
delivery_timeout_ms = 5000
"#,
        queue = stream.key
    );
    let server = Server::start(&config).await;
    let api = server.api();
    // A line per source at start.
    server
        .wait_output(&format!("source {SOURCE}: guard redis "))
        .await;

    // (a) A healthy message is delivered once, with the contract's headers.
    stream.produce("m1", ORDER_1, "acme").await;
    let seen = handler.deliveries("m1", 1, &server).await;
    let d = &seen[0];
    assert_eq!(d.body, ORDER_1.as_bytes(), "the body byte for byte");
    assert_eq!(d.header("content-type"), "application/json");
    assert_eq!(d.header("lazaret-attempt"), "1");
    assert_eq!(d.header("lazaret-source"), SOURCE);
    assert_eq!(d.message_id(), "m1");
    assert_eq!(
        percent_decode(&d.header("lazaret-idempotency-key")),
        format!("{SOURCE}:m1")
    );
    let broker_headers: Value =
        serde_json::from_str(&d.header("lazaret-headers")).expect("Lazaret-Headers is JSON");
    assert_eq!(
        broker_headers,
        json!({"tenant": "acme"}),
        "the entry's other fields"
    );
    // Its outcome observed (m2 below, handled after it, shows no second
    // delivery came either).
    eventually("m1's outcome counted", || async {
        succeeded(&api).await == Some(1.0)
    })
    .await;
    assert_eq!(handler.of("m1").len(), 1, "delivered once");
    let metrics = api.get("/metrics").await.text();
    assert_eq!(
        counter(
            &metrics,
            "lazaret_source_deliveries_total",
            &[r#"source="orders""#, r#"outcome="succeeded""#]
        ),
        Some(1.0),
        "{metrics}"
    );

    // (b) A message the handler refuses (400) becomes exactly one dead
    // letter, with its source and its bytes.
    stream.produce("m2", ORDER_2, "acme").await;
    let deadline = Instant::now() + EVENTUALLY;
    loop {
        if !api
            .dead_letters(&format!("source={SOURCE}"))
            .await
            .is_empty()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no dead letter of source {SOURCE} within {EVENTUALLY:?}\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A message produced after it, handled, shows the source went past it.
    stream.produce("m3", ORDER_1, "acme").await;
    handler.deliveries("m3", 1, &server).await;
    eventually("m3's outcome counted", || async {
        succeeded(&api).await == Some(2.0)
    })
    .await;
    assert_eq!(handler.of("m1").len(), 1, "m1 delivered once");
    assert_eq!(
        handler.of("m2").len(),
        1,
        "a permanent failure is not retried"
    );
    let items = api.dead_letters(&format!("source={SOURCE}")).await;
    assert_eq!(items.len(), 1, "exactly one dead letter: {items:?}");
    let dl = &items[0];
    assert_eq!(dl["reason"], "permanent", "{dl}");
    assert_eq!(dl["stage"], "processing", "{dl}");
    assert_eq!(
        dl["type"], SOURCE,
        "the type defaults to the source's name: {dl}"
    );
    assert_eq!(dl["tenant"], "acme", "from tenant_header: {dl}");
    assert_eq!(dl["lane"], "default", "{dl}");
    assert!(dl["job_id"].is_null(), "a broker message, not a job: {dl}");
    assert_eq!(dl["attempts"], 1, "{dl}");
    assert_eq!(
        dl["error"]["kind"], "validation",
        "from the handler's body: {dl}"
    );
    assert_eq!(dl["idempotency_key"], format!("{SOURCE}:m2"), "{dl}");
    assert_eq!(dl["payload_size"], ORDER_2.len(), "{dl}");
    assert!(dl["celery"].is_null(), "{dl}");
    let source = &dl["source"];
    assert_eq!(source["name"], SOURCE, "{dl}");
    assert_eq!(source["broker"], "redis", "{dl}");
    assert_eq!(source["queue"], stream.key.as_str(), "{dl}");
    assert_eq!(source["message_id"], "m2", "{dl}");
    assert_eq!(source["headers"], json!({"tenant": "acme"}), "{dl}");
    assert!(
        source["position"]["entry_id"].is_string(),
        "the entry id: {dl}"
    );
    let id = id_text(&dl["id"]);
    let payload = api.get(&format!("/v1/dead-letters/{id}/payload")).await;
    assert_eq!(payload.status, 200, "{}", payload.text());
    assert_eq!(
        payload.bytes,
        ORDER_2.as_bytes(),
        "the message body byte for byte"
    );
    assert_eq!(
        payload.headers["content-type"], "application/json",
        "JSON, as it parses"
    );
    assert_eq!(
        payload.headers["lazaret-content-type"], "application/json",
        "the message's own content type"
    );
    assert_eq!(
        api.dead_letters(&format!("source={SOURCE}&stage=processing"))
            .await
            .len(),
        1
    );
    assert!(
        api.dead_letters(&format!("source={SOURCE}&stage=broker"))
            .await
            .is_empty()
    );
    assert!(api.dead_letters("source=elsewhere").await.is_empty());
    let r = api.get("/v1/dead-letters?sourse=orders").await;
    crate::harness::assert_error(&r, 400, "BAD_REQUEST", None);
    let metrics = api.get("/metrics").await.text();
    assert_eq!(
        counter(
            &metrics,
            "lazaret_source_deliveries_total",
            &[r#"source="orders""#, r#"outcome="dead_lettered""#]
        ),
        Some(1.0),
        "{metrics}"
    );

    // The CLI shows where it came from.
    let listed = cli(&server, &["dlq", "ls", "--source", SOURCE]).await;
    assert!(listed.starts_with("ID  JOB_ID  SOURCE"), "{listed}");
    let shown = cli(&server, &["dlq", "show", &id]).await;
    for needle in [
        "\nsource:\n",
        "  broker:",
        "redis",
        "m2",
        "entry_id",
        "tenant:",
    ] {
        assert!(
            shown.contains(needle),
            "`dlq show` has {needle:?}:\n{shown}"
        );
    }

    // (c) The handler is fixed. A dry run lists what would be redriven and
    // moves nothing; the CLI's redrive republishes it to the stream, the
    // handler sees it afresh under the same id, and the dead letter is gone.
    handler.mend();
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"source": SOURCE}, "dry_run": true}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["matched"], 1, "{body}");
    assert_eq!(body["redriven"], 0, "{body}");
    assert_eq!(body["job_ids"], json!([]), "{body}");
    assert_eq!(body["not_found"], json!([]), "{body}");
    assert_eq!(body["items"].as_array().map(Vec::len), Some(1), "{body}");
    let item = &body["items"][0];
    assert_eq!(id_text(&item["dead_letter_id"]), id, "{body}");
    assert!(item["job_id"].is_null(), "{body}");
    assert_eq!(item["source"], SOURCE, "{body}");
    assert_eq!(item["message_id"], "m2", "{body}");
    // (m4 below, after the real redrive, shows nothing more came.)
    assert_eq!(handler.of("m2").len(), 1, "a dry run publishes nothing");
    assert_eq!(api.dead_letters(&format!("source={SOURCE}")).await.len(), 1);

    let redriven = cli(&server, &["dlq", "redrive", "--source", SOURCE]).await;
    assert!(redriven.contains("redriven:  1\n"), "{redriven}");
    assert!(
        redriven.contains(" m2 "),
        "the message is listed: {redriven}"
    );
    let again = handler.deliveries("m2", 2, &server).await;
    let d = &again[1];
    assert_eq!(d.header("lazaret-attempt"), "1", "a fresh budget");
    assert_eq!(d.message_id(), "m2", "the same message id");
    assert_eq!(d.body, ORDER_2.as_bytes());
    assert!(
        api.dead_letters(&format!("source={SOURCE}"))
            .await
            .is_empty(),
        "the dead letter left once the broker confirmed"
    );
    // A message produced after the redrive, handled, and every outcome so
    // far counted (m1, m3, m2 again, m4): the source went past m2, which
    // came once more, from the redrive alone, and succeeded.
    stream.produce("m4", ORDER_1, "acme").await;
    handler.deliveries("m4", 1, &server).await;
    eventually("every outcome counted", || async {
        succeeded(&api).await == Some(4.0)
    })
    .await;
    assert_eq!(
        handler.of("m2").len(),
        2,
        "the dry run published nothing, the redrive once"
    );
    assert!(
        api.dead_letters(&format!("source={SOURCE}"))
            .await
            .is_empty(),
        "and it succeeded this time"
    );
    let audit = api.get("/v1/audit").await;
    let entries = audit.expect(200)["items"].clone();
    let redrives: Vec<&Value> = entries
        .as_array()
        .expect("items")
        .iter()
        .filter(|e| e["action"] == "redrive")
        .collect();
    assert!(
        redrives
            .iter()
            .any(|e| e["count"] == 1 && e["request"]["filter"]["source"] == SOURCE),
        "the redrive is audited with its count: {entries}"
    );
    let metrics = api.get("/metrics").await.text();
    assert_eq!(
        counter(&metrics, "lazaret_redriven_total", &[]),
        Some(1.0),
        "{metrics}"
    );
}

/// A job dead letter for the redrive tests: enqueued, leased, failed for good.
async fn job_dead_letter(api: &crate::harness::Api, n: u32) -> (Value, String) {
    let id = api
        .enqueue_ok(&crate::harness::job("report", "acme", json!({"n": n})))
        .await;
    let leased = api
        .lease_one(&crate::harness::lease_req("w", 1, 30_000))
        .await;
    assert_eq!(leased["id"], id);
    let failed = api
        .fail(
            &id,
            &leased["lease_token"],
            json!({"class": "permanent", "kind": "bad", "message": "no"}),
        )
        .await;
    assert_eq!(failed.expect(200)["state"], "dead_lettered");
    let dl = api.dead_letter_of(&id).await;
    (id, id_text(&dl["id"]))
}

#[tokio::test]
async fn a_redrive_lists_each_item_and_the_ids_it_could_not_find() {
    let server = Server::start(QUICK).await;
    let api = server.api();
    let (job_a, dl_a) = job_dead_letter(&api, 1).await;
    let (_job_b, dl_b) = job_dead_letter(&api, 2).await;
    let unknown = crate::harness::unknown_id_like(&json!(dl_b));

    // The filter keys are the contract's; anything else is refused, and an
    // empty filter must say it means everything.
    for body in [
        json!({"filter": {"job_id": 1}}),
        json!({"filter": {"reason": "permanent"}, "dryrun": true}),
        json!({"filter": {}}),
        json!({"filter": {"stage": "parked"}}),
    ] {
        let r = api.post("/v1/dead-letters/redrive", &body).await;
        crate::harness::assert_error(&r, 400, "BAD_REQUEST", None);
    }
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {}, "all": true, "dry_run": true}),
        )
        .await;
    assert_eq!(r.expect(200)["matched"], 2, "{}", r.text());

    let r = api
        .post("/v1/dead-letters/redrive", &json!({"ids": [dl_a, unknown]}))
        .await;
    let body = r.expect(200);
    assert_eq!(body["matched"], 1, "{body}");
    assert_eq!(body["redriven"], 1, "{body}");
    assert_eq!(body["job_ids"], json!([job_a]), "{body}");
    assert_eq!(body["not_found"], json!([unknown]), "{body}");
    let item = &body["items"][0];
    assert_eq!(id_text(&item["dead_letter_id"]), dl_a, "{body}");
    assert_eq!(item["job_id"], job_a, "{body}");
    assert!(
        item["source"].is_null() && item["message_id"].is_null(),
        "{body}"
    );
    assert_eq!(body["dry_run"], false, "{body}");
    // By stage: lazaret's own jobs dead-letter in processing.
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"stage": "processing"}, "dry_run": true}),
        )
        .await;
    let body = r.expect(200);
    assert_eq!(body["matched"], 1, "{body}");
    assert_eq!(id_text(&body["items"][0]["dead_letter_id"]), dl_b, "{body}");
}

#[tokio::test]
async fn a_broker_that_is_down_does_not_keep_the_server_from_starting() {
    // Nothing listens on port 1: the source keeps retrying in the background.
    let config = format!(
        r#"{QUICK}
[[sources]]
name = "{SOURCE}"
broker = "redis"
url = "redis://:hunter2@127.0.0.1:1"
queue = "orders"
deliver = "http://127.0.0.1:9/orders"
"#
    );
    let mut server = Server::start(&config).await;
    let api = server.api();
    assert_eq!(api.get("/healthz").await.status, 200);
    // A warning about the broker, and the source's line with the password
    // masked.
    server.wait_output("keeps retrying").await;
    let output = server
        .wait_output("source orders: guard redis redis://***@127.0.0.1:1 queue orders")
        .await;
    assert!(
        !output.contains("hunter2"),
        "the password stays out: {output}"
    );
    // A redrive by source finds nothing and says so; nothing is refused.
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"source": SOURCE}}),
        )
        .await;
    assert_eq!(r.expect(200)["matched"], 0);
    // It stops promptly: the source's retries do not hold up shutdown.
    let started = Instant::now();
    server.restart().await;
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "restart took {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn source_config_mistakes_are_refused_at_start_naming_the_key() {
    let source = |extra: &str| {
        format!(
            "[[sources]]\nname = \"orders\"\nbroker = \"redis\"\nurl = \"redis://127.0.0.1:6379\"\nqueue = \"orders\"\n{extra}"
        )
    };
    let deliver = "deliver = \"http://127.0.0.1:9/orders\"\n";
    let cases = [
        (
            source(""),
            "sources[0].deliver",
            "a guard source needs deliver",
        ),
        (
            format!("{}{}", source(deliver), source(deliver)),
            "sources[1].name",
            "already used by sources[0]",
        ),
        (
            source(&format!("{deliver}delivr = \"http://h/\"\n")),
            "sources[0].delivr",
            "unknown field",
        ),
        (
            source(deliver).replace("\"redis\"", "\"kinesis\""),
            "sources[0].broker",
            "unknown broker \"kinesis\"",
        ),
    ];
    for (config, key, words) in cases {
        let (status, printed) = serve_refused(&config, "127.0.0.1:0").await;
        assert!(
            !status.success(),
            "started with:\n{config}\nprinted:\n{printed}"
        );
        assert!(
            printed.contains(&format!(":{key}: ")) || printed.contains(&format!(" {key}: ")),
            "names {key}:\n{printed}"
        );
        assert!(printed.contains(words), "says {words:?}:\n{printed}");
        assert!(
            !printed.contains("lazaret listening on"),
            "refused before listening:\n{printed}"
        );
    }
}

/// The number of entries of `stream`'s group `lazaret` still pending
/// (delivered, never acknowledged).
async fn pending(stream: &Stream) -> i64 {
    let mut con = stream
        .client
        .get_multiplexed_async_connection()
        .await
        .expect("Redis answers");
    let reply: redis::Value = redis::cmd("XPENDING")
        .arg(&stream.key)
        .arg("lazaret")
        .query_async(&mut con)
        .await
        .expect("XPENDING");
    match reply {
        redis::Value::Array(items) => match items.first() {
            Some(redis::Value::Int(n)) => *n,
            other => panic!("XPENDING summary starts with {other:?}"),
        },
        other => panic!("XPENDING answered {other:?}"),
    }
}

/// `kill -9` of lazaret after the dead letter is durable and before Redis
/// got its `XACK`: the restarted lazaret claims the entry the dead process
/// left pending, recognises it as quarantined, acknowledges it without
/// delivering it again, and there is exactly one dead letter.
#[tokio::test]
async fn kill_9_between_quarantine_and_ack_leaves_exactly_one_dead_letter() {
    let test = "kill_9_between_quarantine_and_ack_leaves_exactly_one_dead_letter";
    let Some(url) = redis_url(test) else { return };
    let stream = Stream::new(&url);
    let handler = Handler::broken();
    let deliver = handler.start().await;
    // Entries a dead consumer left are claimed after twice the delivery timeout.
    let config = format!(
        r#"{QUICK}
[[sources]]
name = "{SOURCE}"
broker = "redis"
url = "{url}"
queue = "{queue}"
deliver = "{deliver}"
delivery_timeout_ms = 500
"#,
        queue = stream.key
    );
    let mut server = Server::start_env(
        &config,
        &[(lazaret_server::sources::FAULT_HANG_AFTER_WRITE, SOURCE)],
    )
    .await;
    stream.produce("m-k", ORDER_2, "acme").await;
    let deadline = Instant::now() + EVENTUALLY;
    while !server.log().contains("lazaret-fault: wrote message m-k") {
        assert!(
            Instant::now() < deadline,
            "the fault hook never fired:\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(pending(&stream).await, 1, "written, not acknowledged");

    server.set_env(&[]);
    server.kill_and_restart().await;
    let deadline = Instant::now() + EVENTUALLY;
    while pending(&stream).await != 0 {
        assert!(
            Instant::now() < deadline,
            "the entry left pending was never acknowledged:\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dead = server
        .api()
        .get(&format!("/v1/dead-letters?source={SOURCE}"))
        .await;
    let items = dead.expect(200)["items"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(items.len(), 1, "exactly one dead letter: {items:#?}");
    assert_eq!(items[0]["reason"], "permanent");
    assert_eq!(items[0]["source"]["message_id"], "m-k");
    assert_eq!(
        handler.of("m-k").len(),
        1,
        "the redelivery was recognised, not delivered again"
    );
}

/// A server's config ([`QUICK`](crate::harness::QUICK) and one RabbitMQ
/// source `orders` on `queue`, delivering to `deliver`).
pub(crate) fn orders_from_rabbitmq(
    url: &str,
    queue: &str,
    deliver: impl std::fmt::Display,
) -> String {
    format!(
        r#"{}
[[sources]]
name = "orders"
broker = "rabbitmq"
url = "{url}"
queue = "{queue}"
deliver = "{deliver}"
"#,
        crate::harness::QUICK
    )
}

/// The AMQP URL, or `None` after saying the test is skipped.
pub(crate) fn amqp_url(test: &str) -> Option<String> {
    service(
        "LAZARET_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
        test,
    )
}

/// A connection and channel of the test's own, and a fresh quorum queue
/// RabbitMQ deletes by itself once unused (if the test dies).
pub(crate) async fn amqp_queue(
    url: &str,
    prefix: &str,
) -> (lapin::Connection, lapin::Channel, String) {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::{AMQPValue, FieldTable};
    let props = lapin::ConnectionProperties::default()
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current());
    let conn = lapin::Connection::connect(url, props)
        .await
        .unwrap_or_else(|e| panic!("connect to RabbitMQ at {url}: {e}"));
    let ch = conn.create_channel().await.expect("a channel");
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos();
    let queue = format!("lz-{prefix}-{}-{nanos}", std::process::id());
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert("x-expires".into(), AMQPValue::LongInt(15 * 60 * 1000));
    ch.queue_declare(
        &queue,
        QueueDeclareOptions {
            durable: true,
            ..QueueDeclareOptions::default()
        },
        args,
    )
    .await
    .expect("declare the queue");
    (conn, ch, queue)
}

/// A clean shutdown (SIGTERM) with a RabbitMQ guard and watch running
/// logs no ERROR: the AMQP connections are closed before the runtime stops
/// (lapin's I/O loop used to log "Tokio context … being shutdown").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_with_rabbitmq_sources_logs_no_error() {
    let test = "a_clean_shutdown_with_rabbitmq_sources_logs_no_error";
    let Some(url) = amqp_url(test) else { return };
    let (_conn, ch, queue) = amqp_queue(&url, "shutdown").await;
    let (_conn2, _ch2, dlq) = amqp_queue(&url, "shutdown-dlq").await;
    let handler = Handler::broken();
    let deliver = handler.start().await;
    let config = format!(
        r#"{}
[[sources]]
name = "orders-dlq"
broker = "rabbitmq"
url = "{url}"
queue = "{dlq}"
mode = "watch"
redrive_to = "{queue}"
"#,
        orders_from_rabbitmq(&url, &queue, &deliver)
    );
    let mut server = Server::start(&config).await;
    // Both sources connected (and consume).
    let deadline = Instant::now() + EVENTUALLY;
    while server.output().matches("connected to rabbitmq").count() < 2 {
        assert!(
            Instant::now() < deadline,
            "the sources never connected:\n{}",
            server.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A message goes through the guard (refused: held for a retry, acked).
    ch.basic_publish(
        "",
        &queue,
        lapin::options::BasicPublishOptions::default(),
        b"{\"order\": 1}",
        lapin::BasicProperties::default().with_message_id("s-1".into()),
    )
    .await
    .expect("publish");
    handler.deliveries("s-1", 1, &server).await;
    let status = server
        .terminate(Duration::from_secs(20))
        .await
        .expect("lazaret stops on SIGTERM");
    assert!(status.success(), "{status}");
    let output = server.output();
    assert!(
        !output.contains("ERROR"),
        "a clean shutdown logs no error:\n{output}"
    );
}

/// A watched RabbitMQ dead-letter queue holding messages an application
/// published there (no `x-death`): each is a dead letter with reason
/// `unknown_origin`, and redriving them to the watched queue itself is
/// refused per item (asking for `redrive_to`), so none is lost. Before,
/// the watch consumer took each republished copy for the dead letter it
/// came from and acknowledged it away: 30 of 30 gone, `redriven: 30`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_source_never_redrives_into_its_own_queue() {
    let test = "a_watch_source_never_redrives_into_its_own_queue";
    let Some(url) = amqp_url(test) else { return };
    let (_conn, ch, dlq) = amqp_queue(&url, "own-dlq").await;
    let config = format!(
        r#"{QUICK}
[[sources]]
name = "dlq"
broker = "rabbitmq"
url = "{url}"
queue = "{dlq}"
mode = "watch"
"#
    );
    let server = Server::start(&config).await;
    for i in 0..5 {
        ch.basic_publish(
            "",
            &dlq,
            lapin::options::BasicPublishOptions::default(),
            format!("{{\"n\": {i}}}").as_bytes(),
            lapin::BasicProperties::default().with_message_id(format!("app-{i}").into()),
        )
        .await
        .expect("publish");
    }
    let dls = crate::team_handler::dead_letters(&server, "source=dlq", 5).await;
    assert!(
        dls.iter().all(|d| d["reason"] == "unknown_origin"),
        "{dls:#?}"
    );
    let api = server.api();
    let dry = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"source": "dlq"}, "dry_run": true}),
        )
        .await;
    let dry = dry.expect(200);
    for item in dry["items"].as_array().expect("items") {
        assert_eq!(item["target_queue"], Value::Null, "{item}");
        assert!(
            item["error"]
                .as_str()
                .is_some_and(|e| e.contains("redrive_to")),
            "{item}"
        );
    }
    let r = api
        .post(
            "/v1/dead-letters/redrive",
            &json!({"filter": {"source": "dlq"}}),
        )
        .await;
    let r = r.expect(200);
    assert_eq!(r["redriven"], 0, "{r}");
    assert_eq!(
        crate::team_handler::dead_letters(&server, "source=dlq", 5)
            .await
            .len(),
        5,
        "every dead letter stays"
    );
}
